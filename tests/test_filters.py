"""The traffic filters (hpcps.ps.filters): each object checked exactly (wire types against NumPy and
a reference rounding, the residual's sums conserved, the key cache's hits, misses and evictions,
the wire format's round trip), then through the parameter server under mpiexec (exact sums with
every filter on) and through whole training jobs (the bytes each filter saved, the test logloss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hpcps
from hpcps.ps import filters, protocol
from hpcps.train import synth
from hpcps_kernels import reference

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_chaos import chaos_run  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]

# -- wire types -------------------------------------------------------------------------------------


def edge_floats() -> np.ndarray:
    """float32 values at the edges of fp16 and bf16: zeros, subnormals, ties, the largest, past it,
    infinities, NaN, and random values of every exponent."""
    rng = np.random.default_rng(3)
    fixed = np.array([0.0, -0.0, 1.0, -1.0, 1e-8, 6e-8, 3e-8, 2.0**-24, 2.0**-25, 65504.0, 65519.0, 65520.0,
                      -70000.0, 1e30, 3.4e38, np.inf, -np.inf, np.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                      1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11], dtype=np.float32)
    bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([fixed, bits.view(np.float32)])


def test_fp16_is_numpys_rounding_saturated_at_65504():
    x = edge_floats()
    words = filters.encode(x, filters.FP16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(words[~nan], reference.fp16_bits(x[~nan]))  # every bit, as NumPy's
    got = filters.decode(words, filters.FP16)
    np.testing.assert_array_equal(got, np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32))
    assert np.isnan(got[nan]).all() and np.isfinite(got[~nan]).all() and got[x == 65520.0][0] == 65504.0
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)  # every fp16 word decodes as NumPy's
    np.testing.assert_array_equal(filters.decode(every, filters.FP16), every.view(np.float16).astype(np.float32))


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 by choosing the nearer of the two bfloat16 neighbours (in float64), the
    even one on a tie; NaN stays NaN."""
    bits = x.view(np.uint32)
    lo = bits & np.uint32(0xFFFF0000)
    hi = lo + np.uint32(0x10000)
    lo_f, hi_f = lo.view(np.float32).astype(np.float64), hi.view(np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(x.astype(np.float64) - lo_f), np.abs(hi_f - x.astype(np.float64))
    with np.errstate(invalid="ignore"):
        take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo >> np.uint32(16)) & np.uint32(1) == 1))
    out = np.where(take_hi, hi, lo).view(np.float32)
    return np.where(np.isnan(x) | np.isinf(x), x, out)


def test_bf16_rounds_to_nearest_even_as_the_reference():
    x = edge_floats()
    np.testing.assert_array_equal(filters.encode(x, filters.BF16), reference.bf16_bits(x))  # NumPy's bit ops
    got = filters.decode(filters.encode(x, filters.BF16), filters.BF16)
    finite = np.isfinite(x) & (np.abs(x) < 3.38e38)  # (past that, rounding up gives inf in both)
    np.testing.assert_array_equal(got[finite], bf16_reference(x[finite]))
    assert np.isnan(got[np.isnan(x)]).all() and (got[np.isinf(x)] == x[np.isinf(x)]).all()
    assert filters.decode(filters.encode(np.float32([1 + 2.0**-8]), filters.BF16), filters.BF16)[0] == 1.0  # tie: even
    assert filters.wire_bytes(3, filters.FP16) == 8 and filters.wire_bytes(4, filters.BF16) == 8


# -- the significance filter ------------------------------------------------------------------------


def test_residual_keeps_what_it_does_not_send_and_sent_plus_kept_is_all_pushed():
    rng = np.random.default_rng(5)
    r = filters.PushResidual(dim=2, threshold=1.0)
    pushed: dict[int, np.ndarray] = {}
    sent: dict[int, np.ndarray] = {}
    for _ in range(60):
        keys = np.unique(rng.integers(0, 40, 15).astype(np.uint64))
        grads = (rng.integers(-8, 9, (keys.size, 2)) / 8).astype(np.float32)  # eighths: every sum exact
        send, rows = r.filter(keys, grads.copy())
        assert rows.shape == (int(send.sum()), 2)
        assert np.all(np.abs(rows).max(axis=1) >= 1.0)  # each row sent passed the threshold
        for k, g in zip(keys.tolist(), grads):
            pushed[k] = pushed.get(k, 0) + g
        for k, row in zip(keys[send].tolist(), rows):
            sent[k] = sent.get(k, 0) + row
    keys = np.array(sorted(pushed), dtype=np.uint64)
    kept = r.kept(keys)
    for k, row in zip(keys.tolist(), kept):
        np.testing.assert_array_equal(sent.get(k, 0) + row, pushed[k])  # exactly
    assert r.largest() < 1.0 and np.all(r.kept(np.array([999], np.uint64)) == 0)
    assert r.nbytes() > 0
    drained, rows = r.drain()  # (the flush: every key still kept, then nothing)
    assert np.all(np.abs(rows).max(axis=1) > 0) and drained.size == np.count_nonzero(np.abs(kept).max(axis=1))
    for k, row in zip(drained.tolist(), rows):
        np.testing.assert_array_equal(sent.get(k, 0) + row, pushed[k])
    assert r.largest() == 0.0 and r.drain()[0].size == 0


# -- the key cache ----------------------------------------------------------------------------------


def test_key_cache_hits_misses_and_evicts_in_step_on_worker_and_server():
    a, b, c = (np.arange(i, i + 10, dtype=np.uint64) for i in (0, 100, 200))  # 80 bytes each
    worker = filters.WorkerKeyLists(budget_bytes=160)                        # room for two lists
    server = filters.ServerKeyLists(budget_bytes=160)
    log = []
    one = np.array([7], dtype=np.uint64)  # (an id is as long as one key: a dense table's chunk, each step)
    for keys in (a, b, a, c, b, a, np.zeros(0, np.uint64), np.arange(30, dtype=np.uint64), one, one):
        list_id, held = worker.ref(keys)
        log.append((list_id, held))
        if list_id and held:
            got = server.get(0, 5, list_id)
        elif list_id:
            got = server.store(0, 5, list_id, keys)
        else:
            got = keys
        np.testing.assert_array_equal(got, keys)
    # a new, b new, a hit (b now older), c new (evicts b), b new again (evicts a), a new (evicts c);
    # empty, larger than the budget and one key: sent plainly
    assert log == [(1, False), (2, False), (1, True), (3, False), (4, False), (5, False)] + [(0, False)] * 4
    assert sorted(server.caches[(0, 5)].lists) == sorted(worker.cache.lists) == [4, 5]
    assert server.nbytes() == 160
    with pytest.raises(filters.UnknownKeyList, match="worker 0 named key list 1 of table 5"):
        server.get(0, 5, 1)
    changed = b.copy()
    changed[3] += 1
    assert worker.ref(changed) == (6, False)  # a changed list is a new one, never the old id


@pytest.mark.parametrize("wire", [filters.FP32, filters.FP16])
def test_a_push_pull_with_key_lists_and_a_wire_type_round_trips(wire):
    keys, pull = np.arange(7, dtype=np.uint64) * 3, np.arange(5, dtype=np.uint64)
    grads = np.linspace(-2, 2, 14, dtype=np.float32).reshape(7, 2)
    lists = filters.ServerKeyLists(1 << 20)
    for push_list, pull_list, held in ((1, 2, False), (1, 2, True), (0, 3, False)):
        enc = protocol.Encoding(wire, push_list, held and push_list > 0, pull_list, held)
        buf = protocol.PushPull(4, 9, 3, 1, keys, grads, pull, encoding=enc,
                                in_pull=np.ones(7, bool)).pack()
        assert buf.nbytes == protocol.request_bytes(7, 5, 2, True, False, enc)
        r = protocol.unpack_request(buf, [1, 1, 1, 1, 2], None, lists)
        np.testing.assert_array_equal(r.push_keys, keys)
        np.testing.assert_array_equal(r.pull_keys, pull)
        np.testing.assert_array_equal(r.grads, filters.decode(filters.encode(grads, wire), wire).reshape(7, 2)
                                      if wire else grads)
        assert r.encoding == enc and r.in_pull is not None
    with pytest.raises(ValueError, match="keeps none"):
        protocol.unpack_request(protocol.Pull(0, 1, 0, 0, pull, protocol.Encoding(wire, 0, False, 2, True)).pack(),
                                [1])


@pytest.mark.parametrize("own", [False, True])
def test_a_tables_push_pull_with_filters_round_trips(own):
    """A push-pull of two tables (dims 1 and 3) in fp16 with key lists, each table's values
    decoded as NumPy's fp16; ``own``: each table sends its own subset (the significance filter);
    the reply's values in fp16 too."""
    rng = np.random.default_rng(2)
    keys, pull = np.arange(9, dtype=np.uint64) * 5, np.arange(4, dtype=np.uint64)
    sends = [rng.random(9) < 0.5, rng.random(9) < 0.7] if own else None
    grads = [rng.normal(size=(int(m.sum()) if own else 9, d)).astype(np.float32) for m, d in
             zip(sends or [None, None], (1, 3))]
    lists, dims = filters.ServerKeyLists(1 << 20), [2, 1, 5, 3]
    for held in (False, True):
        enc = protocol.Encoding(filters.FP16, 0 if own else 1, held and not own, 2, held)
        buf = protocol.TablesPushPull((1, 3), 9, 4, 1, keys, grads, pull, 0, np.ones(9, bool), 1, enc, sends).pack()
        assert buf.nbytes == protocol.tables_request_bytes(2, 9, 4, [1, 3], not own, enc,
                                                           [g.shape[0] for g in grads] if own else None)
        r = protocol.unpack_request(buf, dims, None, lists)
        assert r.encoding == enc and (r.in_pull is None) == own and (r.sends is None) != own
        np.testing.assert_array_equal(r.pull_keys, pull)
        for (t, k, g), sent, m in zip(r.pushes(), grads, sends or [np.ones(9, bool)] * 2):
            np.testing.assert_array_equal(k, keys[m])
            np.testing.assert_array_equal(g, sent.astype(np.float16).astype(np.float32))
    reply, _ = protocol.pack_reply(9, 0, 3, 1, protocol.tables_reply_bytes(3, [1, 3], filters.FP16)
                                   - protocol.REPLY_BYTES)
    counts, payloads = protocol.tables_reply_payloads(reply, 3, [1, 3], filters.FP16)
    rows = [rng.normal(size=(3, d)).astype(np.float32) for d in (1, 3)]
    for p, x in zip(payloads, rows):
        protocol.encode_pulled(x, p, filters.FP16)
    for got, x in zip(protocol.tables_reply_parts(reply, 3, [1, 3], filters.FP16)[1], rows):
        np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    assert reply.nbytes == protocol.REPLY_BYTES + 48 + 8 + 20  # (3 and 9 fp16 values, each padded to 4 bytes)


def test_bad_filter_settings_are_one_line_naming_the_key():
    from hpcps import config

    for raw, said in (({"wire_dtype": "fp8"}, "filters.wire_dtype = 'fp8': expected one of"),
                      ({"push_threshold": -1.0}, "filters.push_threshold must be at least 0"),
                      ({"key_cache_mb": 0}, "filters.key_cache_mb must be greater than 0")):
        with pytest.raises(config.ConfigError, match=said):
            config.from_dict({"filters": raw})
    assert config.from_dict({"filters": {"wire_dtype": "bf16", "key_cache": True}}).filters.traffic() == \
        filters.Filters(wire_dtype="bf16", key_cache=True)


@pytest.mark.parametrize("kw,said", [
    ({"push_threshold": -0.1}, "push_threshold must be a finite number >= 0"),
    ({"push_threshold": float("nan")}, "push_threshold must be a finite number >= 0"),
    ({"key_cache": True, "key_cache_mb": 0}, "key_cache_mb must be a finite number > 0"),
    ({"wire_dtype": "FP16"}, "unknown wire dtype 'FP16'"),
])
def test_the_librarys_filters_refuse_what_the_config_refuses(kw, said):
    """hpcps.init(traffic=Filters(...)) bypasses [filters]'s checks: a negative or NaN threshold, or
    no key-list budget, was a filter silently off."""
    with pytest.raises(ValueError, match=said):
        filters.Filters(**kw)


# -- through the parameter server ---------------------------------------------------------------


def push_plan(worker: int, it: int):
    """Integer gradients of keys that repeat every third iteration (so that key lists repeat)."""
    rng = np.random.default_rng(100 * worker + it % 3)
    keys = np.unique(rng.integers(0, 60, 25).astype(np.uint64))
    return keys, np.random.default_rng(1000 * worker + it).integers(-3, 4, (keys.size, 2)).astype(np.float32)


@pytest.mark.mpi(min_size=4)
def test_every_filter_on_gives_the_sums_its_residuals_say_exactly():
    """2 servers + 2 workers, SGD with rate 1 (a row is the sum of what was sent for it): every
    filter on, a key cache small enough to evict. Each worker recomputes every worker's residual,
    so the rows pulled are known exactly (integers: fp16 carries them exactly)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 4:
        pytest.skip("needs 4 ranks")
    traffic = filters.Filters(push_threshold=2.5, wire_dtype="fp16", key_cache=True, key_cache_mb=1000 / 2**20)
    ctx = hpcps.init(servers=2, staleness=0, stall_timeout_s=60, traffic=traffic)
    w = ctx.sparse_table("w", dim=2, optimizer="sgd", params={"lr": 1.0})
    iters = 12
    if ctx.is_server:
        ctx.serve()
        assert 0 < ctx.server.key_lists.nbytes() <= 2 * 500  # (2 workers, each 1000 bytes over 2 servers)
    else:
        expect: dict[int, np.ndarray] = {}
        for worker in range(2):
            residual = filters.PushResidual(2, 2.5)
            for it in range(iters):
                keys, grads = push_plan(worker, it)
                send, rows = residual.filter(keys, grads)
                for k, row in zip(keys[send].tolist(), rows):
                    expect[k] = expect.get(k, 0) + row  # SGD: w -= g, and the push sends -grads
        for it in range(iters):
            keys, grads = push_plan(ctx.worker_index, it)
            w.wait(w.ipushpull(keys, -grads, keys, unique=True))
        keys = np.arange(60, dtype=np.uint64)
        got = w.pull(keys)
        np.testing.assert_array_equal(got, np.array([expect.get(k, np.zeros(2)) for k in keys.tolist()]))
        s = ctx.stats
        assert s["key_cache_saved_bytes"] > 0 and s["wire_dtype_saved_bytes"] > 0
        assert s["push_threshold_saved_bytes"] > 0 and s["push_threshold_saved_bytes"] % (8 + 4 * 2) == 0
    ctx.finalize()


@pytest.mark.mpi(min_size=4)
def test_tables_together_filter_as_alone_and_the_flush_leaves_nothing_behind():
    """2 servers + 2 workers, SGD with rate 1, requests of two tables at once (``TableSet``).
    With the significance filter (and fp16, key cache): each table holds back its own keys, and
    every row is exactly minus what was pushed for it less what the residuals hold (integers,
    which fp16 carries exactly); after ``flush_filters``, exactly minus all it was pushed: nothing
    left behind. With fp16 alone: a row pushed once is NumPy's fp16 of what was pushed, bit for
    bit."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 4:
        pytest.skip("needs 4 ranks")
    held = filters.Filters(push_threshold=2.5, wire_dtype="fp16", key_cache=True)
    wire = filters.Filters(wire_dtype="fp16", key_cache=True)
    ctx = hpcps.init(servers=2, staleness=0, stall_timeout_s=60, traffic=wire)  # (the servers keep key lists)
    sgd = {"optimizer": "sgd", "params": {"lr": 1.0}}
    a, b = ctx.sparse_table("a", dim=1, traffic=held, **sgd), ctx.sparse_table("b", dim=3, traffic=held, **sgd)
    c, d = ctx.sparse_table("c", dim=2, **sgd), ctx.sparse_table("d", dim=1, **sgd)
    if ctx.is_server:
        ctx.serve()
        ctx.finalize()
        return
    first, second = ctx.table_set([a, b]), ctx.table_set([c, d])
    assert first.together and first.own_pushes and second.together and not second.own_pushes
    total = {dim: np.zeros((60, dim), np.float32) for dim in (1, 3)}
    for it in range(9):
        for worker in range(2):
            keys, g = push_plan(worker, it)
            for dim in (1, 3):
                total[dim][keys.astype(np.int64)] += np.tile(g[:, :1], (1, dim)) * (dim if worker else 1)
        keys, g = push_plan(ctx.worker_index, it)
        grads = [g[:, :1], np.tile(g[:, :1], (1, 3)) * (3 if ctx.worker_index else 1)]
        first.wait(first.ipushpull(keys, grads, keys))
    saved = ctx.stats["push_threshold_saved_bytes"]
    assert saved > 0 and ctx.stats["key_cache_saved_bytes"] > 0
    every = np.arange(60, dtype=np.uint64)
    kept = ctx.workers_comm.allreduce(np.concatenate([t.filters.residual.kept(every).ravel() for t in (a, b)]))
    kept = [kept[:60].reshape(60, 1), kept[60:].reshape(60, 3)]  # (both workers' residuals)
    assert np.abs(kept[1]).max() > 0
    rows = first.wait(first.ipull(every))
    np.testing.assert_array_equal(rows[0], -(total[1] - kept[0]))
    np.testing.assert_array_equal(rows[1], -(total[3] - kept[1]))
    assert ctx.flush_filters() and ctx.flush_clocks == 1 and not ctx.flush_filters()  # (no clock since)
    assert a.filters.residual.largest() == 0.0 == b.filters.residual.largest()
    assert ctx.stats["push_threshold_saved_bytes"] < saved  # (the flush's traffic taken back)
    rows = first.wait(first.ipull(every))
    np.testing.assert_array_equal(rows[0], -total[1])
    np.testing.assert_array_equal(rows[1], -total[3])
    # fp16 alone: one push of worker 0's values, pulled back
    keys = np.arange(0, 200, 3, dtype=np.uint64)
    g = [np.random.default_rng(7).normal(0, 40, (keys.size, dim)).astype(np.float32) for dim in (2, 1)]
    mine = keys if ctx.worker_index == 0 else protocol.NO_KEYS
    second.wait(second.ipushpull(mine, [x[:mine.size] for x in g], protocol.NO_KEYS))
    before = ctx.stats["wire_dtype_saved_bytes"]
    for got, x in zip(second.wait(second.ipull(keys)), g):
        np.testing.assert_array_equal(got, -(x.astype(np.float16).astype(np.float32)))
    assert 0 < ctx.stats["wire_dtype_saved_bytes"] - before <= 2 * keys.size * 3  # (the pulled values' halves)
    ctx.finalize()


# -- whole jobs ---------------------------------------------------------------------------------


def train(tmp_path, name: str, data, extra: dict | None = None, **filters_set) -> dict:
    """A 3-epoch job on 1 server + 2 workers with kept batches (``extra``: more settings, as
    ``--set`` takes them); its summary."""
    out = tmp_path / f"{name}.json"
    sets = {"data.train": json.dumps(data[0]), "data.test": json.dumps(data[1]), "train.epochs": 3,
            "train.batch_size": 100, "train.progress": "false", **(extra or {}),
            **{f"filters.{k}": json.dumps(v) for k, v in filters_set.items()}}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run([*mpiexec(), "-n", "3", *HPCPS, "train", *args, "--summary-json", str(out)],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.load(open(out))
    summary["text"] = proc.stdout
    return summary


def test_jobs_save_the_bytes_they_say_and_keep_the_logloss(tmp_path):
    info = synth.generate(str(tmp_path / "data"), 6_000, 1_000, fields=10, seed=4, formats=("libsvm",))
    data = info.files["train_libsvm"], info.files["test_libsvm"]
    plain = train(tmp_path, "plain", data)
    cut = train(tmp_path, "cut", data, wire_dtype="fp16", key_cache=True)
    assert "saved_bytes" not in json.dumps({k: v for k, v in plain.items() if k != "text"})
    traffic = [s["bytes_sent"] + s["bytes_received"] for s in (plain, cut)]
    # the keys sent do not depend on the values: what the two filters say they saved is the difference
    assert traffic[0] - traffic[1] == cut["wire_dtype_saved_bytes"] + cut["key_cache_saved_bytes"]
    assert cut["key_cache_saved_bytes"] > 0 and "key cache saved bytes" in cut["text"]
    assert abs(cut["test_logloss"] - plain["test_logloss"]) <= 0.002
    sparse = train(tmp_path, "sparse", data, push_threshold=0.05, wire_dtype="bf16")
    # the significance filter too, with one server (its flushes' traffic taken back)
    assert traffic[0] - sparse["bytes_sent"] - sparse["bytes_received"] == \
        sparse["push_threshold_saved_bytes"] + sparse["wire_dtype_saved_bytes"]
    assert sparse["bytes_sent"] < plain["bytes_sent"]
    assert abs(sparse["test_logloss"] - plain["test_logloss"]) <= 0.01


def test_a_deep_models_tables_together_save_the_bytes_they_say(tmp_path):
    """W&D: the wide and the embedding table travel together (``PULLS``, ``PUSHPULLS``), the MLP
    as a dense table. fp16 with the key cache, and the significance filter alone (each table its
    own keys; flushed at each epoch's end, its traffic taken back): what each says it saved is
    exactly the traffic it has less, and the test logloss stays within 0.002."""
    d = synth.deep(str(tmp_path / "deep"), 10_000, 1000, seed=5)  # (50 steps an epoch: more than a flush costs)
    extra = {"data.hash_bits": 16, "model.fields": d["fields"], "model.type": '"wdl"'}
    data = d["train"], d["test"]
    plain = train(tmp_path, "plain", data, extra)
    traffic = plain["bytes_sent"] + plain["bytes_received"]
    for name, on in (("cut", {"wire_dtype": "fp16", "key_cache": True}), ("held", {"push_threshold": 0.05})):
        s = train(tmp_path, name, data, extra, **on)
        saved = [s[k] for k in filters.Filters(**on).saved_keys()]
        assert all(x > 0 for x in saved) and traffic - s["bytes_sent"] - s["bytes_received"] == sum(saved), (name, s)
        assert abs(s["test_logloss"] - plain["test_logloss"]) <= 0.002, (name, s["test_logloss"], plain["test_logloss"])


def test_fp16_values_beyond_its_range_are_counted_and_warned_of(tmp_path):
    """fp16 carries at most 65504: a regression whose bias passes it trained a wrong model without a
    sign (test RMSE 213,067 against fp32's 42,695 here). The summary counts such values, and the
    first worker warns once."""
    data = tmp_path / "big.svm"
    data.write_text("".join(f"{200_000 + 3_000 * (i % 7)} {i % 7 + 1}:1 {i % 5 + 10}:1\n" for i in range(600)))
    out = tmp_path / "s.json"
    proc = subprocess.run([*mpiexec(), "-n", "3", *HPCPS, "train", "--set", f"data.train={json.dumps(str(data))}",
                           "--set", "model.loss='squared'", "--set", "train.progress=false",
                           "--set", "filters.wire_dtype='fp16'", "--summary-json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.load(open(out))["wire_dtype_saturated_values"] > 0
    warned = [ln for ln in proc.stderr.splitlines() if "beyond fp16's range" in ln]
    assert len(warned) == 1 and "use 'bf16'" in warned[0], proc.stderr[-2000:]


def test_a_supervised_run_with_every_filter_survives_the_kill_schedule_bit_identical(tmp_path):
    """The chaos test's three kill -9s with every filter on, against an uninterrupted run with the
    same filters and checkpoints: bit for bit. The wire type and the key cache keep nothing a
    restart loses, and each checkpoint flushes the residuals first (the uninterrupted run's too),
    so a restart from it loses nothing either."""
    every = {"filters.push_threshold": 0.05, "filters.wire_dtype": '"fp16"', "filters.key_cache": "true"}
    out = chaos_run(tmp_path, every, every)
    assert "key cache saved bytes" in out and "push threshold saved bytes" in out
