"""Delta snapshots: whole jobs that write them, are killed (kill -9) and resumed from a chain (a
full checkpoint and the deltas over it), compared bit for bit with a run never stopped (BSP); a
damaged delta in the chain; resharding from a chain; admission and eviction; retention; export; a failed
write; the chaos schedule under them."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from hpcps.ps import checkpoint, deltas
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import Features, TableSpec
from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_chaos import chaos_run  # noqa: E402
from test_faults import wait_for  # noqa: E402
from test_checkpoint import (HPCPS, assert_same_model, job_data, rank_pids, reference, reference_run,  # noqa: E402,F401
                             run_job, train_args)

DELTAS = {"checkpoint.every_steps": 0, "checkpoint.delta_every_steps": 100, "checkpoint.full_every": 4}


@pytest.mark.parametrize("key_bits", [12, 64])  # (a direct index, a hash index)
def test_a_chain_of_changed_parts_gives_the_table_exactly_through_admission_and_eviction(key_bits):
    t = ServerTable(TableSpec("w", optimizer="ftrl", key_bits=key_bits, features=Features(
        admit_count=2, evict_after_steps=3, evict_every_steps=2)))
    t.store.track_changes()
    keys, rows, last = np.zeros(0, np.uint64), np.zeros((0, 3), np.float32), np.zeros(0, np.int64)
    # the restore's way: the deltas put in place into a table indexed once (deltas.put_delta)
    restored, restored_last = ServerTable(t.spec), np.zeros(0, np.int64)
    rng = np.random.default_rng(5)
    removed_seen = 0
    for clock in range(1, 40):
        pushed = np.unique(rng.integers(0, 3000 if clock < 20 else 300, 200).astype(np.uint64))
        t.push(pushed, rng.normal(size=(pushed.shape[0], 1)).astype(np.float32), clock)
        t.evict_if_due(clock)
        if clock % 3 == 0:  # a delta
            name, dkeys, drows, state = deltas.changed_part(t)
            removed_seen += state["removed"].shape[0]
            keys, rows, last = deltas.apply_delta(keys, rows, last, (dkeys, drows, state["last"], state["removed"]))
            restored_last = deltas.put_delta(restored, restored_last, (dkeys, drows, state["last"], state["removed"]), clock)
            for got, want in zip((*restored.items(), restored_last), (keys, rows, last)):
                np.testing.assert_array_equal(got, want)  # (the same order too)
            now_keys, now_rows = t.items()
            order, now = np.argsort(keys), np.argsort(now_keys)
            np.testing.assert_array_equal(keys[order], now_keys[now])
            np.testing.assert_array_equal(rows[order], now_rows[now])
            np.testing.assert_array_equal(last[order], t.last[: now_keys.shape[0]][now])
            assert state["evicted"] == t.evicted and ("pending_keys" in state or "count_buckets" in state)
    assert removed_seen > 0 and t.evicted > 0  # (eviction ran, and the deltas said which keys went)


def test_apply_delta_gives_the_rebuilt_table_with_keys_updated_new_removed_and_removed_again():
    rng = np.random.default_rng(3)
    keys = rng.permutation(np.arange(1, 2**40, 2**40 // 5000, dtype=np.uint64))
    rows, last = rng.normal(size=(keys.shape[0], 3)).astype(np.float32), rng.integers(0, 9, keys.shape[0])
    dkeys = np.concatenate([keys[:700], rng.integers(2**41, 2**42, 300).astype(np.uint64)])  # updated, new
    drows, dlast = rng.normal(size=(1000, 3)).astype(np.float32), rng.integers(9, 20, 1000)
    removed = np.concatenate([keys[700:800], keys[:10]])  # gone, and gone then pushed again (in the delta)
    gone = np.isin(keys, np.concatenate([dkeys, removed]))  # the rebuild: the rest, then the delta's rows
    want = np.concatenate([keys[~gone], dkeys]), np.concatenate([rows[~gone], drows]), np.concatenate([last[~gone], dlast])
    got = deltas.apply_delta(keys, rows.copy(), last.copy(), (dkeys, drows, dlast, removed))
    order, want_order = np.argsort(got[0]), np.argsort(want[0])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[order], w[want_order])


def test_a_delta_whose_write_fails_is_one_line_and_nothing_is_committed(tmp_path):
    t = ServerTable(TableSpec("w", optimizer="ftrl"))
    t.store.track_changes()
    t.push(np.arange(10, dtype=np.uint64), np.ones((10, 1), np.float32), 1)
    tmp = checkpoint.begin(str(tmp_path), 5, "delta")
    os.makedirs(checkpoint.server_file(tmp, 0))  # (a directory where the server's file goes)
    writer, said = deltas.DeltaWriter(0, 1, 64), []
    commits = deltas.Commits(report=said.append)
    writer.take(tmp, [t])
    commits.start(tmp, {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "layout": {}}, [0], 3, 60)
    writer.wait()
    commits.wait()
    assert commits.last is None and "server 0 cannot write" in commits.failed, commits.failed
    assert len(said) == 1 and "not written" in said[0] and "the next snapshot is a full one" in said[0], said
    assert not os.path.exists(tmp) and checkpoint.complete_checkpoints(str(tmp_path)) == []


def delta_args(data, ckpt_dir, model_out, servers=1, **sets):
    """The jobs of tests/test_checkpoint.py (2 workers, 600 steps an epoch, 1,200 in all) with a
    snapshot every 100 steps: a full checkpoint, then 3 deltas over it, and again."""
    out = train_args(data, ckpt_dir, model_out, servers=servers)
    for k, v in {**DELTAS, **sets}.items():
        out += ["--set", f"{k}={v}"]
    return out


def start_and_kill(data, tmp, rank, after, servers=1, **sets):
    """Start a job with delta snapshots; once the snapshot ``after`` (a directory name, or a glob
    pattern of one) is committed, kill -9 ``rank``. Returns the job's output."""
    ckdir = tmp / "ck"
    n = servers + 2
    proc = subprocess.Popen([*mpiexec(), "-n", str(n), *HPCPS, *delta_args(data, ckdir, tmp / "never.h5", servers, **sets)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    appeared = wait_for(lambda: glob.glob(str(ckdir / after)), 240, proc)
    assert proc.poll() is None, f"the job ended before {after}:\n{proc.stdout.read()[-3000:]}"
    assert appeared, f"{after} never appeared"
    pids = rank_pids(str(ckdir))
    assert set(pids) == set(range(n)), pids
    os.kill(pids[rank], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    return out


def test_a_job_with_deltas_trains_the_same_model_and_keeps_each_deltas_base(job_data, reference, tmp_path):
    rc, out = run_job(3, delta_args(job_data, tmp_path / "ck", tmp_path / "model.h5", **{"checkpoint.keep": 2}))
    assert rc == 0, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)  # (snapshots change nothing)
    assert "delta snapshot" in out
    # retention (keep 2): the 2 newest full checkpoints (900 and the final one), the deltas taken
    # over the older one (1,000 to 1,200), each with its base; the older chains went whole
    names = sorted(n for n in os.listdir(tmp_path / "ck"))
    fulls = [n for n in names if n.startswith("ckpt-")]
    deltas = [n for n in names if n.startswith("delta-")]
    assert len(fulls) == 2 and fulls[0] == "ckpt-0000000900" and deltas, names
    for n in deltas:
        m = checkpoint.read_manifest(str(tmp_path / "ck" / n))
        assert m["base"]["name"] == fulls[0] and checkpoint.step_of(n) > 900, (n, names)
    # export: the model at the newest delta (over its chain), and a delta model since its base,
    # which applied to the base's model (replace the keys it has, drop NAME.removed) gives it
    ck = tmp_path / "ck"
    for args in ([deltas[-1], "--out", "new.h5"], [fulls[0], "--out", "old.h5"],
                 [deltas[-1], "--since", str(ck / fulls[0]), "--out", "delta.h5"]):
        done = subprocess.run([*HPCPS, "export", str(ck / args[0]), *[str(tmp_path / a) if a.endswith(".h5") else a
                                                                      for a in args[1:]]],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    new, old, delta = (ServingModel(str(tmp_path / n)).tables for n in ("new.h5", "old.h5", "delta.h5"))
    assert 0 < delta["w"].keys.shape[0] < new["w"].keys.shape[0]
    keep = ~np.isin(old["w"].keys, np.concatenate([delta["w"].keys, delta["w.removed"].keys]))
    keys = np.concatenate([old["w"].keys[keep], delta["w"].keys])
    values = np.concatenate([old["w"].values[keep], delta["w"].values])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], new["w"].keys)
    np.testing.assert_array_equal(values[order], new["w"].values)


def test_kill_9_then_resume_from_a_delta_chain_is_bit_identical(job_data, reference, tmp_path):
    start_and_kill(job_data, tmp_path, 0, "delta-0000000700")  # (the server)
    found, m = checkpoint.newest_good(str(tmp_path / "ck"))
    assert checkpoint.is_delta(found) and m["base"]["name"] == "ckpt-0000000500", found
    rc, out = run_job(3, delta_args(job_data, tmp_path / "ck", tmp_path / "model.h5") + ["--resume", "auto"])
    assert rc == 0 and f"resuming from {found}" in out, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)


def test_timed_deltas_are_committed_and_a_kill_resumes_from_them_bit_identical(job_data, reference, tmp_path):
    # checkpoint.delta_every_s (the schedule that bounds the work lost: tests/test_snapshot_schedule.py):
    # the server killed once a delta is committed
    timed = {"checkpoint.delta_every_steps": 0, "checkpoint.delta_every_s": 0.2}
    start_and_kill(job_data, tmp_path, 0, "delta-*[0-9]", **timed)
    found, m = checkpoint.newest_good(str(tmp_path / "ck"))
    assert checkpoint.is_delta(found) and checkpoint.step_of(m["base"]["name"]) < checkpoint.step_of(found), found
    rc, out = run_job(3, delta_args(job_data, tmp_path / "ck", tmp_path / "model.h5", **timed) + ["--resume", "auto"])
    assert rc == 0 and f"resuming from {found}" in out, out[-3000:]
    assert "a kill would have lost at most" in out and "checkpoint.delta_every_s = 0.2 bounds it" in out, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)


def test_a_damaged_delta_stops_the_chain_and_resume_goes_on_from_the_one_before(job_data, reference, tmp_path):
    start_and_kill(job_data, tmp_path, 1, "delta-0000000700")  # (a worker)
    ck = tmp_path / "ck"
    damaged = ck / "delta-0000000600" / "server-0.h5"
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        f.write(b"\xff" * 64)
    rc, out = run_job(3, delta_args(job_data, ck, tmp_path / "model.h5") + ["--resume", "auto"])
    assert rc == 0, out[-3000:]
    said = [ln for ln in out.splitlines() if "delta chain" in ln]
    assert len(said) == 1 and "delta-0000000600" in said[0] and "fails its XXH64 checksum" in said[0], out[-3000:]
    assert f"resuming from {ck / 'ckpt-0000000500'}" in out, out[-3000:]
    assert os.path.isdir(ck / "damaged" / "delta-0000000600")
    assert_same_model(tmp_path / "model.h5", reference)


def test_resharding_a_delta_chain_from_2_servers_onto_1(job_data, reference, tmp_path):
    start_and_kill(job_data, tmp_path, 3, "delta-0000000300", servers=2)  # (a worker of 2 servers + 2 workers)
    found, m = checkpoint.newest_good(str(tmp_path / "ck"))
    assert checkpoint.is_delta(found) and m["layout"]["servers"] == 2 and len(m["deltas_before"]) >= 1, found
    rc, out = run_job(3, delta_args(job_data, tmp_path / "ck", tmp_path / "model.h5") + ["--resume", "auto"])
    assert rc == 0 and f"resuming from {found}" in out, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)


def test_admission_and_eviction_resume_from_a_delta_chain_bit_identical(job_data, tmp_path):
    feats = {"features.admit_count": 2, "features.evict_after_steps": 150, "features.evict_every_steps": 50}
    rc, ref_out = run_job(3, delta_args(job_data, tmp_path / "ref-ck", tmp_path / "ref.h5", **{
        **feats, "checkpoint.delta_every_steps": 0}))
    assert rc == 0, ref_out[-3000:]
    start_and_kill(job_data, tmp_path, 0, "delta-0000000700", **feats)
    rc, out = run_job(3, delta_args(job_data, tmp_path / "ck", tmp_path / "model.h5", **feats) + ["--resume", "auto"])
    assert rc == 0 and "resuming from" in out and "/delta-" in out.split("resuming from")[1].splitlines()[0], out[-3000:]
    counts = [ln for ln in ref_out.splitlines() if ln.startswith("keys on the servers")]
    assert "evicted" in counts[0] and counts == [ln for ln in out.splitlines() if ln.startswith("keys on the servers")]
    assert_same_model(tmp_path / "model.h5", ServingModel(str(tmp_path / "ref.h5")))


@pytest.mark.timeout(900)
def test_chaos_schedule_under_delta_snapshots_and_supervise_is_bit_identical(tmp_path):
    out = chaos_run(tmp_path, {"checkpoint.every_steps": 0, "checkpoint.delta_every_steps": 50,
                               "checkpoint.full_every": 5})
    restarts = [ln for ln in out.splitlines() if "hpcps supervise: job failed" in ln]
    assert "delta snapshot" in out and any("/delta-" in ln for ln in restarts), restarts  # (resumed from a delta)



@pytest.fixture(scope="module")
def small_chain(tmp_path_factory):
    """A one-process job's snapshots (60 steps: full at 10 and 40, deltas at 20, 30, 50 and 60) and
    the job's arguments."""
    from test_faults import job, sets
    tmp = tmp_path_factory.mktemp("chain")
    data = synth.generate(str(tmp / "d"), 3_000, 10, fields=4, seed=2, formats=("libsvm",))
    ck = tmp / "ck"
    args = ["train", "--set", f"data.train={json.dumps(data.files['train_libsvm'])}",
            *sets(train__epochs=1, train__batch_size=50, train__progress=False, checkpoint__dir=str(ck),
                  checkpoint__delta_every_steps=10, checkpoint__full_every=3, checkpoint__final=False)]
    rc, out = job(0, args, timeout=120)
    assert rc == 0, out[-3000:]
    names = sorted(os.listdir(ck))
    assert names == ["ckpt-0000000010", "ckpt-0000000040", *(f"delta-00000000{s}0" for s in "2356")], names
    return ck, args


@pytest.mark.parametrize("out", ["ckpt-0000000040/manifest.json", "damaged/m.h5"])  # (a link of the chain; aside)
def test_export_never_writes_into_a_snapshot_of_the_chain_it_reads(small_chain, out):
    # (the base's manifest was overwritten by the model, exit 0: the chain then broken for good)
    ck, _ = small_chain
    before = {p: open(p, "rb").read() for p in glob.glob(str(ck / "*" / "*"))}
    done = subprocess.run([*HPCPS, "export", str(ck / "delta-0000000060"), "--since", str(ck / "delta-0000000030"),
                           "--out", str(ck / out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and ("give --out a path outside" in done.stderr or "move it out of" in done.stderr), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert {p: open(p, "rb").read() for p in glob.glob(str(ck / "*" / "*"))} == before
    assert not os.path.exists(ck / "damaged")


def test_a_damaged_base_is_moved_once_and_resume_goes_on_from_the_chain_before_it(small_chain, tmp_path):
    # the newest full checkpoint damaged under its deltas: the walk from the newest delta moves it
    # under damaged/, and met again as a checkpoint of its own it is not moved twice (that raised
    # FileNotFoundError, exit 1); the run resumes from the newest delta of the chain before it
    from test_faults import job
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(small_chain[0], ck)
    args = [a.replace(str(small_chain[0]), str(ck)) for a in small_chain[1]]
    base = ck / "ckpt-0000000040" / "server-0.h5"
    with open(base, "r+b") as f:
        f.seek(os.path.getsize(base) // 2)
        f.write(b"\xff" * 64)
    rc, out = job(0, args + ["--resume", "auto"], timeout=120)
    assert rc == 0, out[-3000:]
    said = [ln for ln in out.splitlines() if "ckpt-0000000040" in ln and "fails its XXH64 checksum" in ln]
    assert len(said) == 1 and "its deltas cannot be used" in said[0], out[-3000:]
    assert f"resuming from {ck / 'delta-0000000030'}" in out, out[-3000:]
    assert sorted(os.listdir(ck / "damaged")) == ["ckpt-0000000040"]


def test_export_since_a_snapshot_of_another_model_is_one_line(small_chain, tmp_path):
    # (an FM checkpoint against the chain's LR snapshot: a KeyError, "unexpected", exit 1)
    from test_faults import job
    ck, args = small_chain
    fm = tmp_path / "fm"
    train = [a for a in args if a.startswith("data.train=")]
    rc, out = job(0, ["train", "--set", train[0], "--set", "model.type=fm", "--set", "model.factors=2", "--set",
                      "train.epochs=1", "--set", "train.batch_size=500", "--set", "train.progress=false",
                      "--set", f"checkpoint.dir={json.dumps(str(fm))}"], timeout=120)
    assert rc == 0, out[-3000:]
    for new, old in ((ck / "delta-0000000060", fm / "ckpt-0000000006"), (fm / "ckpt-0000000006", ck / "delta-0000000060")):
        done = subprocess.run([*HPCPS, "export", str(new), "--since", str(old), "--out", str(tmp_path / "d.h5")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "is not a snapshot of the same model as" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "d.h5"), done.stderr


def test_inspect_and_export_name_the_missing_base_of_a_delta(small_chain, tmp_path):
    # (inspect said every delta OK and exited 0, export 'its chain ... is broken (hpcps inspect
    # ... says where)' and inspect did not say where)
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(small_chain[0], ck)
    shutil.rmtree(ck / "ckpt-0000000040")
    done = subprocess.run([*HPCPS, "inspect", str(ck)], capture_output=True, text=True, timeout=60)
    said = [ln for ln in done.stdout.splitlines() if ln.startswith(str(ck))]
    assert done.returncode == 1 and [ln.split(": ", 1)[1] for ln in said] == ["OK"] * 3 + [
        f"DAMAGED: its delta chain is broken: {ck / 'ckpt-0000000040'}: no such checkpoint directory"] * 2, done.stdout
    done = subprocess.run([*HPCPS, "export", str(ck / "delta-0000000060"), "--out", str(tmp_path / "m.h5")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().endswith(
        f"its chain of delta snapshots is broken: {ck / 'ckpt-0000000040'}: no such checkpoint directory"), done.stderr
