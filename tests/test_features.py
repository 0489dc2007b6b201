"""Feature admission and eviction on a server's table shard (issue 13), and the counts a job
reports. The shard is driven directly (no MPI) with pushes at given clocks; the job test runs
under mpiexec."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpcps.ps.server_table import ServerTable
from hpcps.ps.store import RowStore
from hpcps.ps.tables import Features, TableSpec
from hpcps_kernels.directindex import DirectKeyIndex
from hpcps_kernels.hashtable import KeyIndex

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402


def shard(key_bits=20, **features):
    return ServerTable(TableSpec("w", optimizer="sgd", params={"lr": 1.0}, key_bits=key_bits,
                                 features=Features(**features)))


def push(t, keys, clock, g=1.0):
    keys = np.asarray(keys, dtype=np.uint64)
    t.push(keys, np.full((keys.shape[0], 1), g, dtype=np.float32), clock)


def pull(t, keys):
    out = np.empty((len(keys), 1), dtype=np.float32)
    t.pull(np.asarray(keys, dtype=np.uint64), out)
    return out[:, 0]


@pytest.mark.parametrize("key_bits", [20, 64])  # exact counters per key; counters shared by hash
@pytest.mark.parametrize("n", [2, 3, 5])
def test_admission_is_exact_a_key_pushed_n_minus_1_times_has_no_row(key_bits, n):
    t = shard(key_bits, admit_count=n)
    keys = [7, 2**19 + 3, 12345]
    for clock in range(n - 1):
        push(t, keys, clock)
        assert t.size == 0
        np.testing.assert_array_equal(pull(t, keys), 0.0)  # the initializer: pushes only count
    push(t, keys[:2], n - 1)
    assert t.size == 2 and t.admitted == 2
    np.testing.assert_array_equal(pull(t, keys), [-1.0, -1.0, 0.0])  # only the admitting push trains
    push(t, keys, n)
    np.testing.assert_array_equal(pull(t, keys), [-2.0, -2.0, -1.0])  # key 3 reached n too


def test_admission_by_probability_is_deterministic_per_key_and_clock():
    keys = np.arange(20_000, dtype=np.uint64)
    a, b = shard(admit_probability=0.25), shard(admit_probability=0.25)
    push(a, keys, 4)
    push(b, keys, 4)
    assert abs(a.size / keys.size - 0.25) < 0.02
    np.testing.assert_array_equal(np.sort(a.items()[0]), np.sort(b.items()[0]))
    push(a, keys, 5)  # another clock, another draw: about a quarter of the rest joins
    assert abs(a.size / keys.size - (1 - 0.75**2)) < 0.02


def test_eviction_by_age_and_by_norm_and_evicted_keys_must_be_admitted_again():
    t = shard(admit_count=2, evict_after_steps=5, evict_l2_below=0.5)
    for clock in range(10):
        push(t, [1], clock)                   # trained every clock
        if clock < 2:
            push(t, [2], clock)               # admitted at clock 1, then never again
    push(t, [3], 8)
    push(t, [3], 9, g=0.25)                   # admitted at clock 9 with |w| = 0.25 < 0.5
    assert sorted(t.items()[0].tolist()) == [1, 2, 3]
    assert t.evict(10) == 2                   # key 2: 9 clocks old; key 3: small norm
    assert t.items()[0].tolist() == [1] and t.evicted == 2
    np.testing.assert_array_equal(pull(t, [1, 2, 3]), [-9.0, 0.0, 0.0])
    push(t, [2], 11)
    assert t.size == 1  # its count started over
    push(t, [2], 12)
    assert t.size == 2
    np.testing.assert_array_equal(pull(t, [1, 2]), [-9.0, -1.0])


@pytest.mark.parametrize("key_bits", [20, 64])
def test_a_table_under_a_memory_budget_never_exceeds_it_and_keeps_the_recent_keys(key_bits):
    budget_mb = 8 if key_bits == 20 else 3  # the direct index alone takes 4 MiB at 20 bits
    t = shard(key_bits, server_memory_mb=budget_mb, admit_count=1)
    rng = np.random.default_rng(1)
    hot = np.arange(100, dtype=np.uint64)  # pushed every clock: never the least recent
    for clock in range(120):
        fresh = rng.integers(1000, 2**19, 3000).astype(np.uint64)
        push(t, np.unique(np.concatenate([hot, fresh])), clock)
        assert t.nbytes() <= budget_mb * 2**20, (clock, t.nbytes())
        assert t.size <= t.max_keys
    assert t.evicted > 0 and t.size > 0.8 * t.max_keys
    np.testing.assert_array_equal(pull(t, hot), -120.0)  # the hot keys kept every update


def test_a_budget_too_small_for_the_fixed_arrays_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"features.server_memory_mb = 2 leaves room for 0 keys of table 'w'"):
        shard(20, server_memory_mb=2)


def test_features_are_checked_and_named():
    with pytest.raises(ValueError, match=r"features.admit_count must be in \[1, 255\] \(got 0\)"):
        Features(admit_count=0)
    with pytest.raises(ValueError, match=r"features.admit_probability must be in \(0, 1\]"):
        Features(admit_probability=1.5)


def _job(tmp_path, name, *sets):
    out = tmp_path / f"{name}.json"
    cmd = [*mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.cli", "train", "--set", "synth.rows=6000", "--set", "synth.test_rows=2000",
           "--set", f"synth.dir={json.dumps(str(tmp_path / 'data'))}", "--set", "train.progress=false",
           *[x for kv in sets for x in ("--set", kv)], "--summary-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.load(open(out)), proc.stdout


def test_a_job_reports_kept_admitted_and_evicted_keys(tmp_path):
    plain, _ = _job(tmp_path, "plain")
    metrics = tmp_path / "m.jsonl"
    s, text = _job(tmp_path, "features", "features.admit_count=2", "features.evict_after_steps=3",
                   "features.evict_every_steps=2", f"train.metrics={json.dumps(str(metrics))}")
    assert plain["evicted_keys"] == 0 and plain["table_keys"] == plain["admitted_keys"] > 0
    assert s["evicted_keys"] > 0 and 0 < s["table_keys"] < plain["table_keys"]  # (evicted keys may come back)
    assert s["table_keys"] == s["admitted_keys"] - s["evicted_keys"]
    assert f"{s['table_keys']:,} ({s['admitted_keys']:,} admitted, {s['evicted_keys']:,} evicted)" in text
    steps = [json.loads(line) for line in open(metrics) if '"kind": "step"' in line]
    live = [(r["table_keys"], r["admitted_keys"], r["evicted_keys"]) for r in steps]
    assert live[0][1] <= live[-1][1] <= s["admitted_keys"] and live[-1][2] > 0  # counts grow while training
    assert all(k == a - e for k, a, e in live)


def test_resume_after_admission_and_eviction_is_bit_identical(tmp_path):
    from hpcps.ps.checkpoint import step_dir
    from hpcps.train.model_file import ServingModel

    sets = ["synth.rows=20000", "synth.test_rows=2000", f"synth.dir={json.dumps(str(tmp_path / 'data'))}", "train.batch_size=50",
            "features.admit_count=2", "features.evict_after_steps=40", "features.evict_every_steps=30",
            "checkpoint.every_steps=100", "checkpoint.keep=20", "cluster.staleness=0"]

    def job(name, ck, *more):
        cmd = [*mpiexec(), "-n", "3", sys.executable, "-m", "hpcps.cli", "train", "--set", "train.progress=false",
               *[x for kv in sets for x in ("--set", kv)], "--set", f"checkpoint.dir={json.dumps(str(ck))}",
               "--set", f"train.model_out={json.dumps(str(tmp_path / name))}", *more,
               "--summary-json", str(tmp_path / f"{name}.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        return json.load(open(tmp_path / f"{name}.json")), proc.stdout

    whole, _ = job("whole.h5", tmp_path / "ck")
    assert whole["evicted_keys"] > 0
    mid = tmp_path / "ck2"
    mid.mkdir()
    src = step_dir(str(tmp_path / "ck"), 300)  # mid-way through the first epoch, between evictions
    shutil.copytree(src, mid / os.path.basename(src))
    resumed, out = job("resumed.h5", mid, "--resume", "auto")
    assert "resuming from" in out
    a, b = ServingModel(str(tmp_path / "whole.h5")), ServingModel(str(tmp_path / "resumed.h5"))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)
    assert (resumed["admitted_keys"], resumed["evicted_keys"]) == (whole["admitted_keys"], whole["evicted_keys"])


def test_a_bounded_shard_goes_from_a_hash_to_a_direct_index_keeping_its_rows():
    """key_bits 20: a hash index up to 4,096 keys (2**(20 - 8)), then direct, with the same slots;
    every value, pulled and pushed through the switch (a push-pull's reused slots included),
    equals that of a shard hash-indexed throughout (64-bit keys). At 16 bits: direct at once."""
    rng = np.random.default_rng(1)
    bounded, hashed = shard(20), shard(64)
    assert isinstance(bounded.index, KeyIndex) and isinstance(shard(16).index, DirectKeyIndex)
    seen = np.zeros(0, dtype=np.uint64)
    for clock in range(12):
        keys = np.unique(rng.integers(0, 1 << 20, 700)).astype(np.uint64)
        g = rng.normal(size=(keys.size, 1)).astype(np.float32)
        bounded.pull(keys, np.empty((keys.size, 1), np.float32), worker=0)
        bounded.push(keys, g, clock, worker=0)
        hashed.push(keys, g, clock)
        seen = np.union1d(seen, keys)
        assert isinstance(bounded.index, DirectKeyIndex) == (bounded.size >= 4096), (clock, bounded.size)
        np.testing.assert_array_equal(pull(bounded, seen), pull(hashed, seen))
    assert isinstance(bounded.index, DirectKeyIndex)
    for a, b in zip(bounded.items(), hashed.items()):
        np.testing.assert_array_equal(a, b)
    k, r = bounded.items()
    bounded.load(k.copy(), r.copy())  # a restore of as many keys: direct again
    assert isinstance(bounded.index, DirectKeyIndex)
    bounded.load(k[:100].copy(), r[:100].copy())
    assert isinstance(bounded.index, KeyIndex)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "ftrl", "adam"])
def test_a_push_without_a_pull_before_looks_up_and_updates_in_one_pass_with_the_same_bits(optimizer, monkeypatch):
    """A direct index takes a push of keys no pull resolved in one pass (lookups and the rule,
    up to the first absent key; the rest inserted and updated as before): every row, and each
    row's last update (eviction), equals that of a hash-indexed shard given the same pushes."""
    calls = []  # where each one-pass push of the direct index stopped (its first position not done)
    fused = RowStore.push_in_one_pass

    def recorded(self, queries, *a):
        todo = fused(self, queries, *a)
        if isinstance(self.index, DirectKeyIndex):
            calls.append(int(todo[0]) if todo.size else queries.shape[0])
        return todo

    monkeypatch.setattr(RowStore, "push_in_one_pass", recorded)
    rng = np.random.default_rng(3)
    spec = dict(optimizer=optimizer, init="normal", features=Features(evict_after_steps=100))
    direct, hashed = ServerTable(TableSpec("w", key_bits=16, **spec)), ServerTable(TableSpec("w", **spec))
    assert isinstance(direct.index, DirectKeyIndex) and direct.fused >= 0
    seen, known = np.zeros(0, np.uint64), []
    for clock in range(6):
        old = rng.permutation(seen)[:300]  # keys with rows first, then new ones (none at the end)
        new = np.setdiff1d(np.unique(rng.integers(0, 1 << 16, 300)), seen).astype(np.uint64)
        keys = np.concatenate([old, new[:0] if clock == 5 else new])
        known.append(old.size)
        g = rng.normal(size=(keys.size, 1)).astype(np.float32)
        for t in (direct, hashed):
            t.push(keys, g, clock)
        seen = np.union1d(seen, keys)
        for a, b in zip(direct.items(), hashed.items()):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(direct.last[:direct.size], hashed.last[:hashed.size])
    assert calls == known and known[0] == 0 and known[-1] == 300  # the fused pass stopped at the first new key


@pytest.mark.parametrize("key_bits", [16, 64])  # direct index; hash index
def test_a_push_after_a_pull_of_the_same_keys_takes_their_slots_and_updates_what_a_lookup_would(key_bits):
    """A push-pull's next push is of the keys its pull resolved: the push takes those slots and
    looks up only the keys absent at the pull (another worker may have inserted them since);
    after the rows move (the index rebuilt) nothing is reused."""
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 1 << 16, 500)).astype(np.uint64)
    other = np.unique(rng.integers(0, 1 << 16, 300)).astype(np.uint64)
    g = rng.normal(size=(keys.size, 1)).astype(np.float32)
    reusing, fresh = shard(key_bits), shard(key_bits)
    for t in (reusing, fresh):
        push(t, keys[::3], 0)
    reusing.pull(keys, np.empty((keys.size, 1), np.float32), worker=0)
    present = np.isin(keys, keys[::3]).sum()
    for t in (reusing, fresh):
        push(t, other, 1, g=0.5)  # another worker's push inserts keys absent at the pull
    reusing.push(keys, g, 2, worker=0)
    fresh.push(keys, g, 2)
    assert reusing.reused == present
    for a, b in zip(reusing.items(), fresh.items()):
        np.testing.assert_array_equal(a, b)
    reusing.pull(keys, np.empty((keys.size, 1), np.float32), worker=0)
    k, r = reusing.items()
    reusing.load(k.copy(), r.copy())  # the rows may move: the pulled slots no longer stand
    reusing.push(keys, g, 3, worker=0)
    fresh.push(keys, g, 3)
    assert reusing.reused == present
    for a, b in zip(reusing.items(), fresh.items()):
        np.testing.assert_array_equal(a, b)
    reusing.pull(keys[:10], np.empty((10, 1), np.float32), worker=0)  # other keys: looked up
    reusing.push(keys[10:20], g[:10], 4, worker=0)
    fresh.push(keys[10:20], g[:10], 4)
    assert reusing.reused == present


@pytest.mark.parametrize("key_bits", [16, 64])
def test_a_push_takes_the_slots_of_the_pull_before_the_last_as_train_pull_early_sends_them(key_bits):
    """With train.pull_early a worker pulls batch t + 1 before it pushes batch t: the push takes
    the slots of the pull before the last one. A server keeps RESOLVED_PULLS = 2 pulls a worker:
    a third pull pushes the oldest out, and its keys are looked up again."""
    rng = np.random.default_rng(1)
    batches = [np.unique(rng.integers(0, 1 << 16, 400)).astype(np.uint64) for _ in range(4)]
    grads = [np.full((b.size, 1), 0.25 * (i + 1), np.float32) for i, b in enumerate(batches)]
    reusing, fresh = shard(key_bits), shard(key_bits)
    for t in (reusing, fresh):
        push(t, np.concatenate(batches)[::2], 0)
    reusing.pull(batches[0], np.empty((batches[0].size, 1), np.float32), worker=0)
    for t in range(3):  # pull t + 1, then push t: the pull before the last one's keys
        reusing.pull(batches[t + 1], np.empty((batches[t + 1].size, 1), np.float32), worker=0)
        before = reusing.reused
        reusing.push(batches[t], grads[t], t + 1, worker=0)
        fresh.push(batches[t], grads[t], t + 1)
        # the keys there at its pull (one step before: pushed then, batches 0..t-2 and the first)
        there = np.concatenate([np.concatenate(batches)[::2], *batches[:max(t - 1, 0)]])
        assert reusing.reused - before == np.isin(batches[t], there).sum() > 0
        for a, b in zip(reusing.items(), fresh.items()):
            np.testing.assert_array_equal(a, b)
    for k in (1, 2):  # two later pulls push batch 3's out
        reusing.pull(batches[k], np.empty((batches[k].size, 1), np.float32), worker=0)
    before = reusing.reused
    reusing.push(batches[3], grads[3], 5, worker=0)
    fresh.push(batches[3], grads[3], 5)
    assert reusing.reused == before
    for a, b in zip(reusing.items(), fresh.items()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("key_bits", [16, 64])  # direct index; hash index
@pytest.mark.parametrize("optimizer,params", [("ftrl", {"alpha": 0.1, "l1": 0.01}), ("adam", {"lr": 0.05})])
def test_a_push_split_by_the_next_pull_reads_and_ends_what_a_whole_push_does(key_bits, optimizer, params):
    """A push-pull whose push marks the keys its pull reads (protocol.IN_PULL): the server
    updates those, answers the pull, then updates the others (keys new to the table on both
    sides). The pull reads what it reads after the whole push, and the rows end the same, bit for
    bit; without slots from a pull before it, the push is applied whole."""
    rng = np.random.default_rng(2)
    spec = dict(dim=2, optimizer=optimizer, params=params, init="uniform", init_scale=0.1, seed=3,
                key_bits=key_bits)
    split, whole = ServerTable(TableSpec("w", **spec)), ServerTable(TableSpec("w", **spec))
    batches = [rng.permutation(np.unique(rng.integers(0, 3000, 900)).astype(np.uint64)) for _ in range(5)]
    for t in (split, whole):
        t.push(batches[0][::2], np.ones((batches[0][::2].size, 2), np.float32), 0)
    split.pull(batches[0], np.empty((batches[0].size, 2), np.float32), worker=0)
    deferred = 0
    for i in range(4):
        cur, nxt = batches[i], batches[i + 1]
        g = rng.normal(size=(cur.size, 2)).astype(np.float32)
        mask = np.isin(cur, nxt)
        assert 0 < mask.sum() < cur.size
        later = split.push(cur, g, i + 1, worker=0, in_pull=np.packbits(mask, bitorder="little"))
        assert later is not None and later[0].shape[0] == (~mask).sum()
        deferred += later[0].shape[0]
        got, want = np.empty((nxt.size, 2), np.float32), np.empty((nxt.size, 2), np.float32)
        split.pull(nxt, got, worker=0)
        whole.push(cur, g, i + 1)
        whole.pull(nxt, want)
        np.testing.assert_array_equal(got, want)
        split.apply_after_reply(later)
        for a, b in zip(split.items(), whole.items()):
            np.testing.assert_array_equal(a, b)
    assert deferred > 0
    fresh = rng.permutation(np.arange(5000, 5100, dtype=np.uint64))  # no pull before: no slots to split
    g = np.ones((fresh.size, 2), np.float32)
    assert split.push(fresh, g, 9, worker=0, in_pull=np.packbits(np.zeros(fresh.size, bool), bitorder="little")) is None
    whole.push(fresh, g, 9)
    for a, b in zip(split.items(), whole.items()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("key_bits,dim,optimizer", [(21, 1, "ftrl"), (21, 70, "ftrl"), (21, 4, "adam"), (64, 8, "adagrad")])
def test_large_requests_in_two_halves_at_once_give_what_one_thread_gives(key_bits, dim, optimizer):
    """A server runs a large push's halves on two threads (hpcps_kernels.parallel): lookups and
    updates in one pass (a direct index, keys absent in both halves), a rule's kernel (a hash
    index, rows too wide for one pass, reused slots); and a large pull's (keys absent in both
    halves). The rows and every value pulled between the pushes are those of one thread, bit for
    bit."""
    from hpcps_kernels.parallel import PARALLEL_MIN_PULL_WORK, PULL_KEY_VALUES, TwoThreads, splits_pull, worth_splitting

    rng = np.random.default_rng(dim)
    n = PARALLEL_MIN_PULL_WORK // (dim + PULL_KEY_VALUES) + 1001
    assert splits_pull(n, dim) and worth_splitting(TwoThreads(), n, dim)  # pulls and pushes both in halves
    spec = TableSpec("w", dim=dim, optimizer=optimizer, key_bits=key_bits, init="uniform", init_scale=0.1, seed=1)
    one, two = ServerTable(spec), ServerTable(spec)
    two.threads = TwoThreads()
    space = rng.permutation(1 << 21)[: 2 * n].astype(np.uint64)
    for t in (one, two):
        t.push(space[::3].copy(), np.ones((space[::3].size, dim), np.float32), 0)
    for step in range(3):
        keys = rng.permutation(space)[:n]  # about a third present at first: absent keys in both halves
        g = rng.normal(size=(n, dim)).astype(np.float32)
        got = []
        for t in (one, two):
            out = np.empty((n, dim), np.float32)
            t.pull(keys, out, worker=0)
            got.append(out)
            t.push(keys, g, step + 1, worker=0 if step else -1)  # reused slots, or the one-pass push
        np.testing.assert_array_equal(*got)
        for a, b in zip(one.items(), two.items()):
            np.testing.assert_array_equal(a, b)
    assert two.threads.pool is not None
    two.threads.close()


def test_server_threads_come_from_the_environment_and_a_bad_value_names_the_variable(monkeypatch):
    from hpcps.ps.server import server_threads

    monkeypatch.delenv("HPCPS_SERVER_THREADS", raising=False)
    assert server_threads() is not None
    monkeypatch.setenv("HPCPS_SERVER_THREADS", "1")
    assert server_threads() is None
    monkeypatch.setenv("HPCPS_SERVER_THREADS", "4")
    with pytest.raises(ValueError, match=r"HPCPS_SERVER_THREADS must be 1 or 2 \(got '4'\)"):
        server_threads()
