"""A push to the slots its worker's pull before it resolved, the quick way (hpcps.ps.quick_steps):
the same rows pulled and the same table as the general way, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import hpcps
from hpcps.ps import quick_steps

FTRL = {"optimizer": "ftrl", "params": {"alpha": 0.1, "beta": 1.0, "l1": 0.01}}
BIAS = 1 << 40  # a key with given initial values (a model's bias), pushed at every step


def _steps_run(staleness: int, quick: bool, dim: int, opt: dict = FTRL) -> tuple[list, dict, list]:
    """Steps of a training loop through a job of one process (its server reached through the
    Loopback transport): each step pushes the keys the step before pulled, with in-pull marks or
    without, and pulls the next batch's; then push-pulls of the same keys (``hpcps bench ps``'s),
    and a pull, then a push of its keys.
    Batches of odd and even sizes (the pulled keys off their alignment or not), new keys among
    known ones, the bias key among them. Returns (the rows pulled, the table, the quick ways
    taken); ``quick`` off: the general way (no plain way either)."""
    ctx = hpcps.init(servers=1, staleness=staleness)
    table = ctx.sparse_table("w", dim=dim, init="normal", init_keys=((BIAS, (0.5,) * dim),), **opt)
    rng = np.random.default_rng(3)
    # (keys below 300 pushed first; batches 3 and 6 bring new ones)
    batches = [np.append(np.unique(rng.integers(0, 300 + 50 * (b in (3, 6)), 61 + b)), BIAS).astype(np.uint64)
               for b in range(9)]
    known = np.arange(300, dtype=np.uint64)
    table.wait(table.push(known, rng.normal(size=(known.size, dim)).astype(np.float32)))  # (makes the server)
    pulled = [table.pull(batches[0])]
    taken: list = []
    steps = ctx.server.quick.steps
    for name in ("push", "push_pull", "step", "_push_pull_at_once"):
        way = getattr(steps, name)
        setattr(steps, name, (lambda name, way: lambda *a: way(*a) and (taken.append(name) or True))(name, way))
    if not quick:
        ctx.server.plain = {}
    for b in range(8):
        keys, grads = batches[b], rng.normal(size=(batches[b].size, dim)).astype(np.float32)
        in_pull = np.isin(keys, batches[b + 1]) if b % 4 < 2 else None  # (a training step's marks, or none)
        pulled.append(table.wait(table.ipushpull(keys, grads, batches[b + 1], unique=True, in_pull=in_pull)))
    keys = batches[8]
    for _ in range(3):  # (bench ps's push-pull: the same keys pushed and pulled)
        grads = rng.normal(size=(keys.size, dim)).astype(np.float32)
        pulled.append(table.wait(table.ipushpull(keys, grads, keys, unique=True)))
    keys = batches[7]  # (a pull, then a push of its keys)
    pulled.append(table.pull(keys))
    table.wait(table.push(keys, rng.normal(size=(keys.size, dim)).astype(np.float32), unique=True))
    pulled.append(table.pull(keys))
    contents = ctx.tables_contents()
    ctx.finalize()
    return pulled, contents, taken


@pytest.mark.parametrize("staleness", [-1, 0, 1])
def test_quick_pushes_to_a_pulls_slots_give_the_general_ways_rows_and_table(staleness):
    """ASP, BSP and SSP, dim 1 and 3: every step's rows and the table the general way's, bit for
    bit, with the quick ways taken where they apply."""
    for dim in (1, 3):
        pulled, contents, taken = _steps_run(staleness, True, dim)
        want_pulled, want_contents, none = _steps_run(staleness, False, dim)
        assert none == []
        assert len(pulled) == len(want_pulled) == 14
        for got, want in zip(pulled, want_pulled):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        for got, want in zip(contents["w"][:2], want_contents["w"][:2]):
            np.testing.assert_array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                                          want.view(np.uint32) if want.dtype == np.float32 else want)
        # (BSP: a training step's push-pull with its marks; ASP and SSP also the others, and the push)
        # (and the push-pulls by one kernel: 2 of other keys pulled, 3 of the keys pushed)
        assert taken == ["step"] * 3 if staleness == 0 else \
            sorted(taken) == ["_push_pull_at_once"] * 5 + ["push"] + ["push_pull"] * 5 + ["step"] * 3


def test_adams_push_pull_by_one_kernel_gives_the_general_ways_rows_and_table():
    """Adam, ASP, dim 3 (a row with values after its runs, unlike FTRL's above): its push-pull
    kernel (``hpcps_kernels.fused.PUSH_PULL``) gives the general way's rows and table, bit for
    bit. (SGD and AdaGrad share FTRL's shape of row; each rule compiles kernels of its own,
    seconds a rule on a clean clone.)"""
    pulled, contents, taken = _steps_run(-1, True, 3, {"optimizer": "adam"})
    want_pulled, want_contents, _ = _steps_run(-1, False, 3, {"optimizer": "adam"})
    assert taken.count("_push_pull_at_once") == 5, taken
    for got, want in zip(pulled, want_pulled):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for got, want in zip(contents["w"][:2], want_contents["w"][:2]):
        np.testing.assert_array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                                      want.view(np.uint32) if want.dtype == np.float32 else want)


def test_a_rules_compiled_version_takes_its_parameters_as_one_tuple():
    """``run_and_find(..., packed=True)``: a rule kernel's ``*args`` go to its compiled version
    as one tuple, and it updates the rows as the kernel does, bit for bit."""
    from hpcps_kernels import optim
    from hpcps_kernels.entry import run_and_find

    rng = np.random.default_rng(1)
    rows = rng.random((50, 3)).astype(np.float32)
    want = rows.copy()
    slots, grads, hp = rng.permutation(50)[:20], rng.normal(size=(20, 1)).astype(np.float32), (0.1, 1.0, 0.01, 0.0)
    _, found = run_and_find(optim.ftrl, (rows, slots, grads, hp), packed=True)
    assert found is not optim.ftrl and type(found).__name__ == "builtin_function_or_method"  # (not the dispatch)
    found(rows, slots, grads, hp)
    optim.ftrl(want, slots, grads, *hp)
    optim.ftrl(want, slots, grads, *hp)
    np.testing.assert_array_equal(rows.view(np.uint32), want.view(np.uint32))


def _two_tables_run(quick: bool) -> tuple[list, list]:
    """Push-pulls by one kernel through two tables, one of an initial scale given as an int (a
    compiled version of its own), then again once the first table's index entries widened in
    place (as ``KeyIndex.reserve`` widens them past ``NARROW_MAX_KEYS`` keys). Returns (the rows
    pulled, the quick ways taken); ``quick`` off: the general way."""
    from hpcps_kernels.hashtable import WIDE_TAG_BITS, build_index

    ctx = hpcps.init(servers=1, staleness=-1)
    tables = [ctx.sparse_table("b", init="normal", init_scale=1, **FTRL),
              ctx.sparse_table("a", init="normal", init_scale=0.5, **FTRL)]
    rng = np.random.default_rng(5)
    keys, other = np.arange(10, 74, dtype=np.uint64), np.arange(40, 120, dtype=np.uint64)  # (other: some absent)
    for t in tables:
        t.wait(t.push(keys, rng.normal(size=(keys.size, 1)).astype(np.float32)))
    taken: list = []
    steps = ctx.server.quick.steps
    way = steps._push_pull_at_once
    steps._push_pull_at_once = lambda *a: way(*a) and (taken.append(a[2]) or True)
    if not quick:
        ctx.server.plain = {}
    pulled = []
    for widened in (False, True):
        if widened:  # (the first table's index: its entries made 64-bit in place, the keys' slots kept)
            ki = ctx.server.tables[0].store.index
            ki.index, ki.tag_bits = np.full(ki.index.shape[0], np.iinfo(np.uint64).max, np.uint64), WIDE_TAG_BITS
            build_index(ki.keys, ki.size, ki.index, ki.tag_bits, np.uint64(0))
        for t in tables:
            pulled.append(t.pull(keys))
            pulled.append(t.wait(t.ipushpull(keys, rng.normal(size=(keys.size, 1)).astype(np.float32), other,
                                             unique=True)))
    ctx.finalize()
    return pulled, taken


def test_push_pulls_by_one_kernel_of_two_tables_and_an_index_widened_in_place():
    """The push-pull kernel's compiled version is found per table and for its index's arrays, as
    the quick pull's: a table whose initial scale is an int beside one whose is 0.5 (the version
    found for the first took the second's 0.5 as 0: absent keys pulled as zeros), and an index
    whose entries widened in place (the version found before could not take its 64-bit entries: an
    error on the server), give the general way's rows, bit for bit."""
    pulled, taken = _two_tables_run(True)
    want, none = _two_tables_run(False)
    assert none == [] and taken == [0, 1, 0, 1]
    for got, expected in zip(pulled, want):
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.any(pulled[3][-40:] != 0)  # (the absent keys' initial values, scale 0.5)
