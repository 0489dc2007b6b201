"""Requests per step: a step that touches several tables sends one message per server
(``hpcps.ps.client.TableSet``), and with ``train.group_pull`` a worker group sends one per server
for the group; the numbers are those of each table's and each worker's own requests, bit for bit.

Each MPI test runs at the world size of its ``mpi`` marker (tests/run.py).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import hpcps
from hpcps.ps import protocol
from hpcps.train import synth
from hpcps.train.model_file import ServingModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ps import run_script  # noqa: E402
from test_train import hpcps_job, sets  # noqa: E402

FTRL = dict(optimizer="ftrl", params={"alpha": 0.1, "l1": 0.01}, init="uniform", init_scale=0.1, seed=3)


def test_a_tables_request_unpacks_to_what_was_packed_and_its_reply_to_each_table():
    """Two tables (dims 1 and 3) at 5 pushed and 3 pulled keys, with in-pull bits: every array
    back as given; the reply's layout gives each table its counts and rows."""
    rng = np.random.default_rng(0)
    keys, pull = rng.integers(0, 2**64, 5, dtype=np.uint64), rng.integers(0, 2**64, 3, dtype=np.uint64)
    grads = [rng.normal(size=(5, d)).astype(np.float32) for d in (1, 3)]
    dims = [7, 1, 2, 3]  # tables 1 and 3 of four
    in_pull = np.array([1, 0, 0, 1, 1], bool)
    buf = protocol.TablesPushPull((1, 3), 9, 4, 1, keys, grads, pull, 1, in_pull).pack()
    assert buf.nbytes == protocol.tables_request_bytes(2, 5, 3, [1, 3], True)
    r = protocol.unpack_request(buf, dims)
    assert (r.op, r.tables, r.req_id, r.clock, r.worker, r.ahead, r.pull_clock) == (protocol.PUSHPULLS, (1, 3), 9, 4, 1,
                                                                                   1, 6)
    np.testing.assert_array_equal(r.push_keys, keys)
    np.testing.assert_array_equal(r.pull_keys, pull)
    for x, y in zip(r.grads, grads):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(np.unpackbits(r.in_pull, count=5, bitorder="little").astype(bool), in_pull)
    pulled = protocol.unpack_request(protocol.TablesPull((1, 3), 2, 4, 1, keys[:0], [g[:0] for g in grads], pull).pack(),
                                     dims)
    assert (pulled.op, pulled.pull_clock, pulled.push_keys.size) == (protocol.PULLS, 4, 0)
    reply, _ = protocol.pack_reply(9, 0, 3, 1, protocol.tables_reply_bytes(3, [1, 3]) - protocol.REPLY_BYTES)
    counts, values = protocol.tables_reply_parts(reply, 3, [1, 3])
    counts[:] = [[1, 2, 3], [4, 5, 6]]
    values[1][:] = 7.0
    assert [v.shape for v in values] == [(3, 1), (3, 3)]
    assert reply[protocol.REPLY_BYTES:protocol.REPLY_BYTES + 48].view(np.int64).tolist() == [1, 2, 3, 4, 5, 6]
    assert (reply[-36:].view(np.float32) == 7.0).all()


def _batches(worker: int, n: int) -> list[np.ndarray]:
    """Distinct keys per step (new keys and keys seen before, in any order)."""
    rng = np.random.default_rng(10 + worker)
    return [rng.permutation(np.unique(rng.integers(0, 600, 200)).astype(np.uint64)) for _ in range(n)]


def _grads(rows: list[np.ndarray], worker: int, it: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * worker + it)
    return [(r * 0.5 + rng.normal(size=r.shape)).astype(np.float32) for r in rows]


def _sent(ctx, call):
    """(what ``call()`` returns, the requests it sent)."""
    before = ctx.stats["requests"]
    out = call()
    return out, ctx.stats["requests"] - before


def _plain_or_general_run(staleness: int, plain: bool, dim: int = 2) -> tuple[list, dict, list, list]:
    """Pulls, pushes and push-pulls of one FTRL table through a job of one process (its server
    in the process, reached through the Loopback transport), the server's plain ways and quick
    pulls on or off: (the rows pulled, the table's rows and state, the ops its plain ways served,
    those its quick pulls answered)."""
    ctx = hpcps.init(servers=1, staleness=staleness)
    table = ctx.sparse_table("w", dim=dim, **FTRL)
    rng = np.random.default_rng(5)
    keys = [np.unique(rng.integers(0, 400, 80)).astype(np.uint64) for _ in range(6)]
    pulled = [table.pull(keys[0])]  # (the first request makes the server)
    served: list = []
    quick: list = []
    ways, answer = ctx.server.plain, ctx.server.quick.answer_pull
    ctx.server.plain = {op: (lambda op, way: lambda *a: way(*a) and (served.append(op) or True))(op, way)
                        for op, way in ways.items()} if plain else {}
    ctx.server.quick.answer_pull = (lambda *a: answer(*a) and (quick.append(a[1]) or True)) if plain else \
        (lambda *a: False)
    for step in range(5):
        grads = rng.normal(size=(keys[step].size, dim)).astype(np.float32)
        table.wait(table.push(keys[step], grads))
        pulled.append(table.pull(keys[step + 1]))
        pulled.append(table.wait(table.ipushpull(keys[step], grads, keys[step + 1], unique=True)))
        in_pull = np.isin(keys[step], keys[step + 1])  # (a training step's request: its push's keys pulled next)
        pulled.append(table.wait(table.ipushpull(keys[step], grads, keys[step + 1], unique=True, in_pull=in_pull)))
    contents = ctx.tables_contents()
    ctx.finalize()
    return pulled, contents, served, quick


@pytest.mark.parametrize("staleness", [-1, 0, 1])
def test_the_plain_way_of_a_request_gives_the_general_ways_numbers(staleness):
    """A server's plain way (pulls, pushes and push-pulls whose arrays travel as they are, with
    in-pull marks or without, hpcps.ps.plain_requests) gives the rows pulled and the table of the
    general way (the op's message and handler), bit for bit, under ASP, BSP (its pushes kept for
    their turn, a training step's push-pull answered at once) and SSP; every op the plain way."""
    pulled, contents, served, quick = _plain_or_general_run(staleness, plain=True)
    want_pulled, want_contents, *_ = _plain_or_general_run(staleness, plain=False)
    _same_run(pulled, contents, want_pulled, want_contents)
    assert len(pulled) == 16
    assert sorted(served) == [protocol.PULL] * 5 + [protocol.PUSH] * 5 + [protocol.PUSHPULL] * 10
    assert sorted(quick) == [protocol.PULL] * 5 + [protocol.PUSHPULL] * 10  # (the first pull makes the server)


def test_quick_pulls_give_the_general_ways_rows_with_keys_of_any_alignment():
    """A dim-1 table under ASP: a push-pull of an odd number of keys carries its pulled keys 4
    bytes off their alignment, an even number aligned; the quick pulls (hpcps.ps.quick_requests),
    answering both kinds, pulls of absent keys (their initial values) and pulls after pushes
    that grew the table, give the general way's rows and table, bit for bit."""
    pulled, contents, _, quick = _plain_or_general_run(-1, plain=True, dim=1)
    want_pulled, want_contents, *_ = _plain_or_general_run(-1, plain=False, dim=1)
    _same_run(pulled, contents, want_pulled, want_contents)
    assert sorted(quick) == [protocol.PULL] * 5 + [protocol.PUSHPULL] * 10


def _pushes_run(quick: bool) -> tuple[np.ndarray, dict, list]:
    """ASP pushes of a dim-1 FTRL table in a job of one process, new keys among known ones, then a
    pull of every key: (the rows pulled, the table, the pushes the quick way applied); ``quick``
    off: the general way (no plain way either)."""
    ctx = hpcps.init(servers=1, staleness=-1)
    table = ctx.sparse_table("w", dim=1, **FTRL)
    rng = np.random.default_rng(7)
    table.wait(table.push(np.arange(3, dtype=np.uint64), np.ones((3, 1), np.float32)))  # (makes the server)
    done: list = []
    push = ctx.server.quick.push
    ctx.server.quick.push = lambda *a: push(*a) and (done.append(a[2].shape[0]) or True)
    if not quick:
        ctx.server.plain = {}
    for step in range(6):  # (keys below 100 * (step + 1): new ones at each step, after known ones)
        keys = np.unique(rng.integers(0, 100 * (step + 1), 61)).astype(np.uint64)
        table.wait(table.push(keys, rng.normal(size=(keys.size, 1)).astype(np.float32), unique=True))
    pulled = table.pull(np.arange(600, dtype=np.uint64))
    contents = ctx.tables_contents()
    ctx.finalize()
    return pulled, contents, done


def test_quick_pushes_give_the_general_ways_table():
    """ASP pushes with no pull before them take the quick way (hpcps.ps.quick_requests: the one-pass
    kernel's compiled version, the keys from the first new one on through the table's push): the
    table and the rows pulled are the general way's, bit for bit."""
    pulled, contents, done = _pushes_run(True)
    want_pulled, want_contents, none = _pushes_run(False)
    assert len(done) == 6 and none == []
    _same_run([pulled], contents, [want_pulled], want_contents)


def _same_run(pulled: list, contents: dict, want_pulled: list, want_contents: dict) -> None:
    assert len(pulled) == len(want_pulled)
    for got, want in zip(pulled, want_pulled):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    keys, rows, _ = contents["w"]
    want_keys, want_rows, _ = want_contents["w"]
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(rows.view(np.uint32), want_rows.view(np.uint32))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dims", [(1, 4), (1, 2, 3)])
def test_a_step_of_several_tables_is_one_request_per_server_with_the_same_numbers(dims):
    """2 servers + 2 workers under BSP, FTRL: tables A (a TableSet) and tables B (each table's own
    requests, as before) get the same pushes. Every pull of A equals B's bit for bit, the keys a
    push-pull's pull reads marked or not; a step of A sends exactly 1 request per server, B's
    (2T - 1) per server; a bare push (the last step) 1 per server, B's T + 1 (the clock)."""
    ctx = hpcps.init(servers=2, worker_groups=2, staleness=0, stall_timeout_s=60)
    a = [ctx.sparse_table(f"a{i}", dim=d, key_bits=12, **FTRL) for i, d in enumerate(dims)]
    b = [ctx.sparse_table(f"b{i}", dim=d, key_bits=12, **FTRL) for i, d in enumerate(dims)]
    if ctx.is_server:
        ctx.serve()
        ctx.finalize()
        return
    servers, n_tables, me = ctx.layout.servers, len(dims), ctx.worker_index
    batches = _batches(me, 9)
    together = ctx.table_set(a)
    for keys in batches:  # (the counts below assume every server owns keys of every batch)
        _, offsets = ctx.placement.slice(keys)
        assert (np.diff(offsets) > 0).all()
    got_a, sent = _sent(ctx, lambda: together.wait(together.ipull(batches[0], unique=True)))
    assert sent == servers
    got_b = [t.wait(t.ipull(batches[0], unique=True)) for t in b]
    for it in range(len(batches) - 1):
        cur, nxt = batches[it], batches[it + 1]
        for x, y in zip(got_a, got_b):
            np.testing.assert_array_equal(x, y)
        grads = _grads(got_a, me, it)
        in_pull = np.isin(cur, nxt) if it % 2 else None
        got_a, sent = _sent(ctx, lambda: together.wait(together.ipushpull(cur, grads, nxt, in_pull=in_pull)))
        assert sent == servers
        assert ctx.clock_value == 2 * it + 1

        def each():
            pushes = [(t, t.push(cur, g, unique=True)) for t, g in zip(b[1:], grads[1:])]
            head = b[0].ipushpull(cur, grads[0], nxt, unique=True, in_pull=in_pull)
            pulls = [t.ipull(nxt, unique=True) for t in b[1:]]
            for t, ts in pushes:
                t.wait(ts)
            return [b[0].wait(head)] + [t.wait(ts) for t, ts in zip(b[1:], pulls)]

        got_b, sent = _sent(ctx, each)
        assert sent == (2 * n_tables - 1) * servers
    last = batches[-1]
    grads = _grads(got_a, me, len(batches))
    _, sent = _sent(ctx, lambda: together.wait(together.ipushpull(last, grads, np.zeros(0, np.uint64))))
    assert sent == servers

    def bare_push():
        for t, g in zip(b, grads):
            t.wait(t.push(last, g, unique=True))
        ctx.clock()

    _, sent = _sent(ctx, bare_push)
    assert sent == (n_tables + 1) * servers
    everything = np.arange(600, dtype=np.uint64)
    for x, y in zip(together.wait(together.ipull(everything)), [t.pull(everything) for t in b]):
        np.testing.assert_array_equal(x, y)
    ctx.finalize()


# -- whole jobs: a worker group's pull (train.group_pull) ---------------------------------------

def _fixed_width_rows(path, rows: int, seed: int = 3) -> str:
    """libsvm rows of equal length, so every worker's part of the file has the same rows."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            keys = np.sort(rng.choice(np.arange(1, 300_000), 10, replace=False))
            f.write(f"{rng.integers(0, 2)} " + " ".join(f"{k:07d}:1" for k in keys) + "\n")
    return str(path)


def _job(tmp_path, name: str, group_pull: bool, extra: list) -> dict:
    out = tmp_path / f"{name}.h5"
    hpcps_job(5, ["train", *extra, *sets(cluster__servers=1, cluster__worker_groups=2, cluster__staleness=0,
                                          train__group_pull=group_pull, train__progress=False, train__epochs=2,
                                          train__model_out=str(out)),
                  "--summary-json", str(tmp_path / f"{name}.json")])
    return {"summary": json.loads((tmp_path / f"{name}.json").read_text()), "model": ServingModel(str(out))}


def _assert_same_tables(a: ServingModel, b: ServingModel) -> None:
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        np.testing.assert_array_equal(a.tables[name].keys, b.tables[name].keys)
        np.testing.assert_array_equal(a.tables[name].values, b.tables[name].values, err_msg=f"table {name}")


def test_a_group_pull_sends_one_request_per_server_per_group_with_the_same_model(tmp_path):
    """1 server + 2 groups of 2 workers, BSP, LR, 2 epochs of 4 steps on equal parts: with
    train.group_pull each group's first rank pushes and pulls for the group (the others send
    only the first pull), so the job sends G x steps + W requests instead of W x (steps + 2) (a
    push-pull a step, the first pull, the last step's push and clock apart); the model is the
    same bit for bit."""
    train = _fixed_width_rows(tmp_path / "train.svm", 800)
    common = sets(data__train=train, data__hash_bits=20, model__type="lr", train__batch_size=50)
    off, on = _job(tmp_path, "off", False, common), _job(tmp_path, "on", True, common)
    workers, groups, steps = 4, 2, 2 * 800 // (4 * 50)
    assert off["summary"]["requests_sent"] == workers * (steps + 2)
    assert on["summary"]["requests_sent"] == groups * steps + workers
    _assert_same_tables(off["model"], on["model"])


def test_a_group_pull_of_a_deep_model_trains_the_same_model(tmp_path):
    """wdl (a wide and an embedding table, pulled and pushed together, and the MLP) with
    train.group_pull: every table the same bit for bit as without it."""
    d = synth.deep(str(tmp_path / "deep"), 4000, 100, seed=5)
    common = sets(data__train=d["train"], data__hash_bits=16, model__fields=d["fields"], model__type="wdl",
                  train__batch_size=250)
    off, on = _job(tmp_path, "off", False, common), _job(tmp_path, "on", True, common)
    assert on["summary"]["requests_sent"] < off["summary"]["requests_sent"]
    _assert_same_tables(off["model"], on["model"])


def test_a_group_clock_lets_the_others_on_and_a_stall_still_names_the_group_behind(tmp_path):
    """1 server, workers 0 and 1 in a group, worker 2 alone, BSP. Group 0's first rank carries its
    member's clock (``clock_workers=2``), the member sends nothing: worker 2's pulls are answered
    with both groups' pushes, exactly. Once group 0 stops after 3 steps, worker 2's next pull
    waits, and the server names both ranks of that group as behind; the job ends on the stall."""
    script = tmp_path / "group_clock.py"
    script.write_text(textwrap.dedent("""
        import time, numpy as np, hpcps
        ctx = hpcps.init(servers=1, worker_groups=2, staleness=0, stall_warn_s=1, stall_timeout_s=4)
        t = ctx.sparse_table("w", optimizer="sgd", params={"lr": 1.0})
        keys, g = np.arange(3, dtype=np.uint64), np.ones((3, 1), np.float32)
        if ctx.is_server:
            ctx.serve()
        elif ctx.worker_index == 0:
            for it in range(3):
                t.wait(t.ipushpull(keys, g, keys, unique=True, clock_workers=2))
            time.sleep(120)
        elif ctx.worker_index == 1:
            time.sleep(120)
        else:
            for it in range(5):
                print("step", it, t.wait(t.ipushpull(keys, g, keys, unique=True))[:, 0].tolist(), flush=True)
        ctx.finalize()
    """))
    rc, out, took = run_script(script, 4)
    assert rc != 0
    assert took < 40
    for it in range(3):  # both groups pushed -1 per key at each clock before the pull's
        assert f"step {it} {[-2.0 * (it + 1)] * 3}" in out
    assert "step 3" not in out
    assert "waits" in out and "rank(s) [1, 2]" in out  # the server names the group behind


def test_the_shared_positions_are_read_only_views_of_one_arange():
    # every single-server request holds a view of one array: none may write to it, as it grows too
    from hpcps.ps import client

    for n in (10, (1 << 16) + 5):
        got = client.positions(n)
        assert np.array_equal(got, np.arange(n)) and not got.flags.writeable
        with pytest.raises(ValueError):
            got[0] = 1
