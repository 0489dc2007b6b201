"""The parameter server under mpiexec: exact sums, initializers, staleness bounds, BSP determinism.

Each test declares its layout; it runs at the world size of its ``mpi`` marker (tests/run.py).
Every worker can recompute every other worker's pushes from seeds, so expected values are exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numba
import numpy as np
import pytest

import hpcps
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import TableSpec
from hpcps_kernels import init as kinit

U64_MAX = 2**64 - 1
EDGE = np.array([0, 1, U64_MAX, U64_MAX - 1, 2**63], dtype=np.uint64)
LAYOUTS = {  # world size -> (servers, worker_groups)
    "1 server + 2 workers": (3, 1, None),
    "2 servers + 2 groups of 1": (4, 2, 2),
    "2 servers + 1 group of 2": (4, 2, 1),
}


def world_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def layout_for(name):
    size, servers, groups = LAYOUTS[name]
    if world_size() != size:
        pytest.skip(f"layout {name!r} needs {size} ranks")
    return servers, groups


def push_plan(worker: int, it: int, dim: int):
    """The keys and integer gradients that ``worker`` pushes at iteration ``it`` (with duplicates,
    keys at both ends of uint64, and an empty push now and then)."""
    rng = np.random.default_rng(1000 * worker + it)
    if it % 5 == 4:
        return np.zeros(0, dtype=np.uint64), np.zeros((0, dim), dtype=np.float32)
    keys = np.concatenate([rng.integers(0, 50, 20).astype(np.uint64), EDGE[rng.integers(0, 5, 3)],
                           rng.integers(0, 2**64, 5, dtype=np.uint64)])
    grads = rng.integers(-3, 4, (keys.size, dim)).astype(np.float32)
    return keys, grads


def expected_sums(workers, iters, dim):
    total: dict[int, np.ndarray] = {}
    for w in range(workers):
        for it in range(iters):
            keys, grads = push_plan(w, it, dim)
            for k, g in zip(keys.tolist(), grads):
                total[k] = total.get(k, 0) + g.astype(np.float64)
    return total


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.mpi(min_size=LAYOUTS[name][0]))
                                    for name in LAYOUTS])
@pytest.mark.parametrize("staleness", [0, 2, -1])
@pytest.mark.parametrize("aggregate", [False, True])
def test_exact_sums_of_integer_pushes(layout, staleness, aggregate):
    servers, groups = layout_for(layout)
    ctx = hpcps.init(servers=servers, worker_groups=groups, staleness=staleness, stall_timeout_s=60)
    dim, iters = 3, 12
    w = ctx.sparse_table("w", dim=dim, optimizer="sgd", params={"lr": 1.0})
    d = ctx.dense_table("bias", size=2500, optimizer="sgd", params={"lr": 1.0})
    if ctx.is_server:
        ctx.serve()
    else:
        me, workers = ctx.worker_index, ctx.layout.workers
        for it in range(iters):
            keys, grads = push_plan(me, it, dim)
            w.pull(keys)
            ts = w.push(keys, -grads, aggregate=aggregate)  # SGD, lr 1: w -= -g, so w = sum of g
            d.push(np.full(2500, me + 1, dtype=np.float32) * -1)
            w.wait(ts)
            ctx.clock()
        for _ in range(max(staleness, 0)):
            ctx.clock()  # under SSP, a pull at clock iters + s waits for everyone's clock iters
        expect = expected_sums(workers, iters, dim)
        keys = np.array(sorted(expect), dtype=np.uint64)
        got = w.pull(keys)
        if staleness >= 0:
            np.testing.assert_array_equal(got, np.array([expect[k] for k in keys.tolist()]))
            # dense: every iteration each worker adds its (index + 1) to every entry
            np.testing.assert_array_equal(d.pull(), np.full(2500, iters * workers * (workers + 1) / 2))
    ctx.finalize()
    if ctx.is_server and staleness < 0:  # ASP: no visibility guarantee for pulls; check the servers
        table = ctx.server.tables[0]
        keys, rows = table.items()
        expect = expected_sums(ctx.layout.workers, iters, dim)
        for k, row in zip(keys.tolist(), rows[:, :dim]):
            np.testing.assert_array_equal(row, expect[k])


@pytest.mark.mpi(min_size=3)
def test_never_pushed_keys_return_the_initializer_and_create_nothing():
    ctx = hpcps.init(servers=1, stall_timeout_s=60)
    t = ctx.sparse_table("emb", dim=4, optimizer="adam", init="normal", init_scale=0.5, seed=7)
    keys = np.concatenate([EDGE, np.arange(100, dtype=np.uint64)])
    if ctx.is_server:
        ctx.serve()
        assert ctx.server.tables[0].size == 0
    else:
        got = t.pull(keys)
        expect = np.empty((keys.size, 4), dtype=np.float32)
        kinit.init_values(keys, 4, kinit.NORMAL, 0.5, 7, expect)
        np.testing.assert_array_equal(got, expect)
        assert abs(float(expect.std()) - 0.5) < 0.1
        assert t.pull(np.zeros(0, dtype=np.uint64)).shape == (0, 4)
    ctx.finalize()


@numba.njit
def _signsgd(rows, slots, grads, lr):
    for i in range(slots.shape[0]):
        for d in range(grads.shape[1]):
            g = grads[i, d]
            rows[slots[i], d] -= lr * (1.0 if g > 0 else (-1.0 if g < 0 else 0.0))
            rows[slots[i], grads.shape[1] + d] += 1.0  # a state column: how many updates


@pytest.mark.mpi(min_size=3)
def test_a_registered_update_rule_runs_on_the_servers_and_must_be_the_same_on_every_rank():
    from hpcps.ps.context import ConfigMismatch
    from mpi4py import MPI

    if world_size() != 3:
        pytest.skip("needs 3 ranks")
    hpcps.register_optimizer("test_signsgd", {"lr": 0.5}, _signsgd, state_width=lambda dim: dim, replace=True)
    # a rank that registered another definition under the same name: an error on every rank
    hpcps.register_optimizer("test_other", {"lr": 0.1 * (MPI.COMM_WORLD.Get_rank() + 1)}, _signsgd, replace=True)
    ctx = hpcps.init(servers=1, stall_timeout_s=60)
    with pytest.raises(ConfigMismatch, match="ranks disagree on table 'm'"):
        ctx.sparse_table("m", optimizer="test_other")
    t = ctx.sparse_table("s", dim=2, optimizer="test_signsgd", params={"lr": 0.25})
    keys = np.arange(10, dtype=np.uint64)
    if ctx.is_server:
        ctx.serve()
        k, rows = ctx.server.tables[0].items()
        order = np.argsort(k)
        np.testing.assert_array_equal(rows[order, 2:], np.full((10, 2), 6.0))  # 3 pushes x 2 workers
    else:
        for _ in range(3):
            grads = np.where((keys % 2 == 0)[:, None], 3.0, -2.0) * np.array([1.0, -1.0]) * (ctx.worker_index + 1)
            t.wait(t.push(keys, grads.astype(np.float32)))
            ctx.clock()
        got = t.pull(keys)
        sign = np.where((keys % 2 == 0)[:, None], 1.0, -1.0) * np.array([1.0, -1.0])
        np.testing.assert_array_equal(got, -0.25 * 6 * sign)  # each update moves by exactly lr
    ctx.finalize()


def _sq_norm(shard, keys, args):
    """A reduction over a key set: the sum of squares of the keys' rows (initializer if absent)."""
    rows = np.empty((keys.shape[0], shard.spec.dim), dtype=np.float32)
    shard.pull(keys, rows)
    return np.array([(rows.astype(np.float64) ** 2).sum()])


def _scaled_and_count(shard, keys, args):
    """Per key: the row times the key's argument, and how many keys this server was asked."""
    rows = np.empty((keys.shape[0], shard.spec.dim), dtype=np.float32)
    shard.pull(keys, rows)
    return np.concatenate([rows * args[:, :1], np.full((keys.shape[0], 1), keys.shape[0], np.float32)], axis=1)


@pytest.mark.mpi(min_size=4)
def test_registered_server_functions_run_where_the_keys_live():
    from hpcps.ps.context import ConfigMismatch
    from mpi4py import MPI

    if world_size() != 4:
        pytest.skip("needs 4 ranks")
    hpcps.register_server_function("sq_norm", _sq_norm, out_width=1, per_key=False, replace=True)
    hpcps.register_server_function("scaled", _scaled_and_count, out_width=3, in_width=1, replace=True)
    hpcps.register_server_function("odd", _sq_norm, out_width=1 + MPI.COMM_WORLD.Get_rank() % 2, replace=True)
    ctx = hpcps.init(servers=2, stall_timeout_s=60)
    t = ctx.sparse_table("e", dim=2, optimizer="sgd", params={"lr": 1.0}, init="normal", init_scale=0.5, seed=3)
    sq = ctx.server_function("sq_norm")
    scaled = ctx.server_function("scaled")
    with pytest.raises(ConfigMismatch, match="ranks disagree on server function 'odd'"):
        ctx.server_function("odd")
    keys = np.arange(0, 400, 3, dtype=np.uint64)
    if ctx.is_server:
        ctx.serve()
    else:
        if ctx.worker_index == 0:
            t.wait(t.push(keys[:50], np.ones((50, 2), np.float32)))
        ctx.clock()
        rows = t.pull(keys).astype(np.float64)  # BSP: the push of step 0 is visible, to both
        assert t.call(sq, keys)[0] == pytest.approx((rows ** 2).sum(), rel=1e-6)
        args = np.arange(keys.shape[0], dtype=np.float32)[::-1].copy()
        got = t.call(scaled, keys[::-1], args[:, None])  # any order: results come back in it
        np.testing.assert_allclose(got[:, :2], rows[::-1] * args[:, None], rtol=1e-6)
        _, offsets = ctx.placement.slice(keys[::-1])
        owner = np.repeat(np.arange(2), np.diff(offsets))  # each key's server, in sliced order
        order, _ = ctx.placement.slice(keys[::-1])
        per_server = np.diff(offsets)
        assert per_server.min() > 0  # both servers own some of the keys
        np.testing.assert_array_equal(got[order, 2], per_server[owner])  # each key ran on its server
    ctx.finalize()


def _slow(worker: int, it: int) -> float:
    """Artificial delays: worker 0 is a straggler, the others jitter."""
    rng = np.random.default_rng(77 * worker + it)
    return (0.02 if worker == 0 else 0.0) + 0.01 * rng.random()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_no_pull_observes_more_than_the_allowed_staleness(staleness):
    ctx = hpcps.init(servers=1, staleness=staleness, stall_timeout_s=60)
    t = ctx.sparse_table("w", dim=1, optimizer="sgd", params={"lr": 1.0})
    if ctx.is_server:
        ctx.serve()
    else:
        observed = []
        keys = np.arange(10, dtype=np.uint64)
        for it in range(25):
            time.sleep(_slow(ctx.worker_index, it))
            t.pull(keys)
            observed.append(ctx.clock_value - t.last_min_clock)
            t.wait(t.push(keys, np.ones((10, 1), np.float32)))
            ctx.clock()
        assert max(observed) <= staleness, observed
        if staleness > 0 and ctx.worker_index != 0:
            # the fast workers do run ahead of the straggler: the bound is reached, not just respected
            assert max(observed) == staleness, observed
    ctx.finalize()


def _grad_from(values: np.ndarray, worker: int, it: int) -> np.ndarray:
    """A float gradient that depends on the pulled values (so any ordering difference shows)."""
    rng = np.random.default_rng(31 * worker + it)
    return (0.3 * np.tanh(values) + rng.normal(size=values.shape)).astype(np.float32)


def _keys_of(worker: int, it: int) -> np.ndarray:
    rng = np.random.default_rng(5 * worker + 11 * it)
    return np.unique(rng.integers(0, 40, 15).astype(np.uint64))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("optimizer,params", [("ftrl", {"alpha": 0.1, "l1": 0.5}), ("adagrad", {"lr": 0.1}),
                                              ("adam", {"lr": 0.05})])
def test_bsp_equals_the_sequential_reference_exactly(servers, optimizer, params):
    ctx = hpcps.init(servers=servers, staleness=0, stall_timeout_s=60)
    spec = dict(dim=2, optimizer=optimizer, params=params, init="uniform", init_scale=0.1, seed=3)
    t = ctx.sparse_table("w", **spec)
    iters, workers = 8, ctx.layout.workers
    if ctx.is_server:
        ctx.serve()
    else:
        for it in range(iters):
            time.sleep(0.01 * ((ctx.worker_index + it) % 2))  # vary arrival order at the servers
            keys = _keys_of(ctx.worker_index, it)
            t.wait(t.push(keys, _grad_from(t.pull(keys), ctx.worker_index, it)))
            ctx.clock()
        all_keys = np.arange(40, dtype=np.uint64)
        got = t.pull(all_keys)
        # sequential reference: one table, every iteration pulls then pushes in worker order
        ref = ServerTable(TableSpec("w", **spec))
        for it in range(iters):
            pulled = []
            for w in range(workers):
                out = np.empty((len(_keys_of(w, it)), 2), dtype=np.float32)
                ref.pull(_keys_of(w, it), out)
                pulled.append(out)
            for w in range(workers):
                ref.push(_keys_of(w, it), _grad_from(pulled[w], w, it))
        expect = np.empty((40, 2), dtype=np.float32)
        ref.pull(all_keys, expect)
        np.testing.assert_array_equal(got, expect)
    ctx.finalize()


def run_script(script, ranks: int, timeout: float = 90) -> tuple[int, str, float]:
    """(exit status, output, seconds) of ``script`` under ``mpiexec -n ranks``, within ``timeout``."""
    sys.path.insert(0, os.path.dirname(__file__))
    from run import mpiexec

    start = time.monotonic()
    proc = subprocess.run([*mpiexec(), "-n", str(ranks), sys.executable, str(script)], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_a_request_nobody_answers_is_reported_then_aborts_the_job(tmp_path):
    """Worker 2 never clocks; worker 1's BSP pull at clock 1 can never be answered."""
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent("""
        import time, numpy as np, hpcps
        ctx = hpcps.init(servers=1, staleness=0, stall_warn_s=1, stall_timeout_s=4)
        t = ctx.sparse_table("w")
        if ctx.is_server:
            ctx.serve()
        elif ctx.worker_index == 0:
            ctx.clock()
            t.pull(np.arange(3, dtype=np.uint64))
        else:
            time.sleep(120)
        ctx.finalize()
    """))
    rc, out, took = run_script(script, 3)
    assert rc != 0
    assert took < 40
    assert "still waiting" in out and "pull reply of table 'w'" in out
    assert "no answer after 4 s" in out and "(from rank 0)" in out
    assert "waits" in out and "rank(s) [2]" in out  # the server names the worker that is behind


def test_table_declarations_are_validated():
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'"):
        TableSpec("w", optimizer="adamw")
    with pytest.raises(ValueError, match=r"unknown ftrl parameter\(s\) \['lr'\]"):
        TableSpec("w", optimizer="ftrl", params={"lr": 0.1})
    with pytest.raises(ValueError, match="unknown init 'gauss'"):
        TableSpec("w", init="gauss")


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.mpi(min_size=LAYOUTS[name][0]))
                                    for name in LAYOUTS])
@pytest.mark.parametrize("aggregate", [False, True])
def test_push_pull_pulls_exactly_what_push_clock_pull_would(layout, aggregate):
    """BSP: the pull of a push-pull at iteration it sees the pushes of every worker up to it,
    exactly; empty pushes and pulls, keys owned by one server only, and duplicates included."""
    servers, groups = layout_for(layout)
    ctx = hpcps.init(servers=servers, worker_groups=groups, staleness=0, stall_timeout_s=60)
    dim, iters = 2, 10
    w = ctx.sparse_table("w", dim=dim, optimizer="sgd", params={"lr": 1.0}, key_bits=6)  # direct + overflow keys
    if ctx.is_server:
        ctx.serve()
    else:
        me, workers = ctx.worker_index, ctx.layout.workers
        keys, grads = push_plan(me, 0, dim)
        w.pull(keys)
        for it in range(iters):
            nxt = push_plan(me, it + 1, dim)[0]
            got = w.wait(w.ipushpull(keys, -grads, nxt, aggregate=aggregate))
            assert ctx.clock_value == it + 1
            seen = expected_sums(workers, it + 1, dim)  # every worker's pushes of iterations 0..it
            np.testing.assert_array_equal(got, np.array([seen.get(k, np.zeros(dim)) for k in nxt.tolist()],
                                                        dtype=np.float32).reshape(-1, dim))
            keys, grads = nxt, push_plan(me, it + 1, dim)[1]
    ctx.finalize()


@pytest.mark.mpi(min_size=2)
def test_a_push_pull_marking_the_keys_its_pull_reads_equals_the_sequential_reference():
    """``ipushpull(..., in_pull=...)``: one worker (every other rank a server) marks which pushed
    keys its pull reads; each server updates those, replies, then updates the rest. Every pull,
    and the table at the end, are those of a sequential pull-then-push, exactly (FTRL; new keys
    on both sides of the mark)."""
    ctx = hpcps.init(servers=world_size() - 1, staleness=0, stall_timeout_s=60)
    spec = dict(dim=2, optimizer="ftrl", params={"alpha": 0.1, "l1": 0.01}, init="uniform", init_scale=0.1, seed=3)
    t = ctx.sparse_table("w", **spec, key_bits=12)
    rng = np.random.default_rng(4)
    batches = [rng.permutation(np.unique(rng.integers(0, 600, 200)).astype(np.uint64)) for _ in range(9)]
    if ctx.is_server:
        ctx.serve()
    else:
        ref = ServerTable(TableSpec("w", **spec))

        def ref_pull(keys):
            out = np.empty((keys.size, 2), np.float32)
            ref.pull(keys, out)
            return out

        got = t.pull(batches[0])
        for it in range(len(batches) - 1):
            cur, nxt = batches[it], batches[it + 1]
            np.testing.assert_array_equal(got, ref_pull(cur))
            g = _grad_from(got, 0, it)
            ref.push(cur, g)
            got = t.wait(t.ipushpull(cur, g, nxt, unique=True, in_pull=np.isin(cur, nxt)))
        np.testing.assert_array_equal(got, ref_pull(batches[-1]))
        everything = np.arange(600, dtype=np.uint64)
        np.testing.assert_array_equal(t.pull(everything), ref_pull(everything))
    ctx.finalize()


@pytest.mark.mpi(min_size=3)
def test_a_push_pull_ahead_reads_at_the_clock_after_the_next():
    """``ipushpull(..., ahead=1)`` (train.pull_early's step) pulls for the clock after the next:
    under BSP its rows hold every worker's pushes up to the next iteration, exactly, though it was
    sent one iteration before them; the worker waits for it after its next push-pull."""
    if world_size() != 3:
        pytest.skip("1 server + 2 workers")
    ctx = hpcps.init(servers=1, staleness=0, stall_timeout_s=60)
    dim, iters = 2, 8
    w = ctx.sparse_table("w", dim=dim, optimizer="sgd", params={"lr": 1.0}, key_bits=6)
    if ctx.is_server:
        ctx.serve()
    else:
        me, workers = ctx.worker_index, ctx.layout.workers
        in_flight = []  # (iteration whose rows, timestamp)
        for it in range(iters):
            keys, grads = push_plan(me, it, dim)
            later = push_plan(me, it + 2, dim)[0]
            in_flight.append((it + 2, later, w.ipushpull(keys, -grads, later, ahead=1)))
            if len(in_flight) == 2:  # the pull sent one iteration ago: answered after this clock
                step, pulled, ts = in_flight.pop(0)
                got = w.wait(ts)
                seen = expected_sums(workers, step, dim)  # every worker's pushes of iterations 0..step-1
                np.testing.assert_array_equal(got, np.array([seen.get(k, np.zeros(dim)) for k in pulled.tolist()],
                                                            dtype=np.float32).reshape(-1, dim))
        ctx.clock()  # the last pull's clock
        step, pulled, ts = in_flight.pop(0)
        seen = expected_sums(workers, step - 1, dim)
        np.testing.assert_array_equal(w.wait(ts), np.array([seen.get(k, np.zeros(dim)) for k in pulled.tolist()],
                                                           dtype=np.float32).reshape(-1, dim))
    ctx.finalize()
