"""Checkpoints: the format and its integrity checks, and whole jobs that are stopped (signal,
kill -9) and resumed, compared with an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps.ps import checkpoint
from hpcps.ps.placement import Placement
from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from shared_runs import once  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]


# -- format ----------------------------------------------------------------------------------------

def _fake_checkpoint(root, step, servers=2, n=500, shards=64):
    tmp = checkpoint.step_dir(str(root), step) + ".tmp"
    os.makedirs(tmp)
    place = Placement(servers, shards)
    keys = np.random.default_rng(step).integers(0, 2**64, n, dtype=np.uint64)
    rows = np.random.default_rng(step).normal(size=(n, 3)).astype(np.float32)
    owner = place.server_of(keys)
    files = []
    for s in range(servers):
        mine = owner == s
        size, digest = checkpoint.write_server_file(checkpoint.server_file(tmp, s), s, servers, shards,
                                                    [("w", keys[mine], rows[mine])])
        files.append({"name": f"server-{s}.h5", "bytes": size, "xxh64": digest})
    manifest = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "files": files,
                "tables": [{"name": "w", "dim": 1, "width": 3}], "layout": {"num_shards": shards, "servers": servers}}
    return checkpoint.commit(tmp, manifest, keep=3), keys, rows


def test_commit_verify_and_keep_the_newest(tmp_path):
    for step in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, step)
    names = [os.path.basename(p) for p in checkpoint.complete_checkpoints(str(tmp_path))]
    assert names == ["ckpt-0000000020", "ckpt-0000000030", "ckpt-0000000040"]
    os.makedirs(tmp_path / "ckpt-0000000050.tmp")  # an interrupted write is not a checkpoint
    ckpt, m = checkpoint.newest_good(str(tmp_path))
    assert ckpt.endswith("ckpt-0000000040") and len(m["files"]) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove", "manifest"])
def test_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, damage):
    _fake_checkpoint(tmp_path, 10)
    newest, _, _ = _fake_checkpoint(tmp_path, 20)
    f = os.path.join(newest, "server-1.h5")
    if damage == "truncate":
        os.truncate(f, os.path.getsize(f) // 2)
    elif damage == "flip":
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    elif damage == "remove":
        os.remove(f)
    else:
        open(os.path.join(newest, "manifest.json"), "w").write("{not json")
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.verify(newest)
    reports = []
    ckpt, _ = checkpoint.newest_good(str(tmp_path), report=reports.append)
    assert ckpt.endswith("ckpt-0000000010") and "ckpt-0000000020" in reports[0]
    assert not checkpoint.inspect(newest).ok


def test_what_supervise_verified_is_not_hashed_again_by_the_job_it_restarts_unless_changed(tmp_path):
    """hpcps supervise verifies the checkpoint a restart resumes and hands what it verified to the
    job (checkpoint.VERIFIED_ENV), whose first rank does not hash those files again; a file changed
    since (size, modification time or inode) is hashed, and its damage found."""
    _fake_checkpoint(tmp_path, 10)
    newest, _, _ = _fake_checkpoint(tmp_path, 20)
    code = ("import os, sys; from hpcps.ps import checkpoint; "
            "handed = checkpoint.trust_verified(os.environ.get(checkpoint.VERIFIED_ENV, '')); "
            "found = checkpoint.newest_good(sys.argv[1], report=lambda line: None, trust_unchanged=handed); "
            "print(os.path.basename(found[0])); print(checkpoint.verified_under(sys.argv[1]))")

    def newest_found(handed: str = "") -> list[str]:  # (a fresh process: the supervisor, or the job restarted)
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                              env=dict(os.environ, **{checkpoint.VERIFIED_ENV: handed}), timeout=120).stdout.splitlines()

    name, handed = newest_found()
    assert name == "ckpt-0000000020" and os.path.abspath(newest) in json.loads(handed)
    f = os.path.join(newest, "server-1.h5")
    st = os.stat(f)
    with open(f, "r+b") as fh:  # damaged, its size and modification time kept
        fh.seek(st.st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert newest_found(handed)[0] == "ckpt-0000000020"  # trusted: not hashed again
    os.utime(f)                                           # changed since the supervisor's check: hashed,
    assert newest_found(handed)[0] == "ckpt-0000000010"   # the damage found


def test_what_supervise_hands_over_is_the_resumed_snapshot_alone_and_never_too_large(tmp_path, monkeypatch):
    """Only the snapshot a restart resumes (and a delta's chain) is handed over, and nothing where
    the text would be too large for one environment variable (Linux refuses one over 128 KiB at
    exec: with thousands of servers' files the restart would not start)."""
    old, _, _ = _fake_checkpoint(tmp_path, 10)
    new, _, _ = _fake_checkpoint(tmp_path, 20)
    checkpoint.verify(old)
    checkpoint.verify(new)
    assert {os.path.abspath(old), os.path.abspath(new)} <= set(json.loads(checkpoint.verified_under(str(tmp_path))))
    assert set(json.loads(checkpoint.verified_under(str(tmp_path), new))) == {os.path.abspath(new)}
    monkeypatch.setattr(checkpoint, "VERIFIED_MAX_BYTES", 10)
    assert checkpoint.verified_under(str(tmp_path), new) == ""


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_shards_restore_onto_any_number_of_servers(tmp_path, servers):
    ckpt, keys, rows = _fake_checkpoint(tmp_path, 10, servers=2)
    m = checkpoint.verify(ckpt)
    place = Placement(servers, 64)
    got_keys, got_rows = [], []
    for s in range(servers):
        k, r = checkpoint.read_for_server(ckpt, m, "w", s, place.shard_server, place.num_servers)
        assert np.all(place.server_of(k) == s)
        got_keys.append(k)
        got_rows.append(r)
    k, r = np.concatenate(got_keys), np.concatenate(got_rows)
    order, ref = np.argsort(k), np.argsort(keys)
    np.testing.assert_array_equal(k[order], keys[ref])
    np.testing.assert_array_equal(r[order], rows[ref])


# -- jobs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job_data():
    """The jobs' data (also tests/test_deltas.py's), made once a session."""
    d = once("ckdata", lambda d: synth.generate(str(d / "data"), 60_000, 5_000, fields=10, seed=8, formats=("libsvm",)))
    return str(d / "data" / "train.svm"), str(d / "data" / "test.svm")


def train_args(data, ckpt_dir, model_out, servers=1, every=200):
    sets = {"data.train": json.dumps(data[0]), "data.test": json.dumps(data[1]), "train.batch_size": 50,
            "train.epochs": 2, "train.progress": "false", "cluster.servers": servers, "cluster.staleness": 0,
            "checkpoint.dir": json.dumps(str(ckpt_dir)), "checkpoint.every_steps": every,
            "train.model_out": json.dumps(str(model_out))}
    out = ["train"]
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def run_job(n, args, timeout=300):
    proc = subprocess.run([*mpiexec(), "-n", str(n), *HPCPS, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr


def rank_pids(marker: str, rank_variable: str = "PMI_RANK") -> dict[int, int]:
    """PIDs of the ranks whose command line mentions ``marker``, by MPI rank (the launcher's
    ``rank_variable``: MPICH's PMI_RANK, Open MPI's OMPI_COMM_WORLD_RANK)."""
    key = rank_variable.encode() + b"="
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            if marker not in cmd or "hpcps.cli" not in cmd:
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(key):
                found[int(kv.split(b"=")[1])] = int(pid)
    return found


def start_and_interrupt(data, tmp, action, rank, n=3, after_step=400, extra=()):
    """Start a 3-rank job (``extra``: more arguments); once the checkpoint of ``after_step``
    exists, signal or kill ``rank``. Returns (exit status, output, seconds from the interruption
    to the job's end)."""
    ckdir = tmp / "ck"
    proc = subprocess.Popen([*mpiexec(), "-n", str(n), *HPCPS, *train_args(data, ckdir, tmp / "never.h5"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 240
    target = checkpoint.step_dir(str(ckdir), after_step)
    while not os.path.exists(target):
        assert proc.poll() is None, f"the job ended before step {after_step}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    pids = rank_pids(str(ckdir))
    assert set(pids) == set(range(n)), pids
    t = time.monotonic()
    os.kill(pids[rank], action)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, time.monotonic() - t


@pytest.fixture(scope="module")
def reference_run(job_data):
    """The uninterrupted run's directory, made once a session (tests/test_deltas.py compares with
    it too): ``model.h5`` and, in ``ck``, only the final checkpoint (no periodic one: the stopped
    and resumed runs, which write one every 200 steps, must still equal it bit for bit)."""
    def make(tmp):
        rc, out = run_job(3, train_args(job_data, tmp / "ck", tmp / "model.h5", every=0))
        assert rc == 0, out[-3000:]

    return once("ckref", make)


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's final model."""
    return ServingModel(str(reference_run / "model.h5"))


def assert_same_model(path, reference):
    m = ServingModel(str(path))
    np.testing.assert_array_equal(m.keys, reference.keys)
    np.testing.assert_array_equal(m.values, reference.values)  # bit-identical


@pytest.mark.parametrize("sig,rank,who", [(signal.SIGUSR1, 2, "worker"), (signal.SIGTERM, 0, "server")])
def test_signal_checkpoints_exits_75_and_resume_is_bit_identical(job_data, reference, tmp_path, sig, rank, who):
    rc, out, _ = start_and_interrupt(job_data, tmp_path, sig, rank)
    assert rc == 75, out[-3000:]
    newest, manifest = checkpoint.newest_good(str(tmp_path / "ck"))
    assert manifest["reason"] == "signal", (who, manifest["reason"])
    rc, out = run_job(3, train_args(job_data, tmp_path / "ck", tmp_path / "model.h5") + ["--resume", "auto"])
    assert rc == 0 and f"resuming from {newest}" in out, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)


def test_a_signal_to_a_server_under_on_signal_continue_is_one_checkpoint_and_training_goes_on(job_data, reference,
                                                                                              tmp_path):
    """The server forgets its signal once the checkpoint written for it is (it kept reporting it
    in every reply, and the workers wrote a signal checkpoint at every step after it)."""
    rc, out, _ = start_and_interrupt(job_data, tmp_path, signal.SIGTERM, 0,
                                     extra=["--set", 'checkpoint.on_signal="continue"'])
    assert rc == 0 and out.count("(signal)") == 1, out[-3000:]
    assert_same_model(tmp_path / "never.h5", reference)


@pytest.mark.parametrize("rank,who", [(0, "server"), (1, "worker")])
def test_kill_9_ends_the_job_promptly_and_resume_finishes_identically(job_data, reference, tmp_path, rank, who):
    rc, out, elapsed = start_and_interrupt(job_data, tmp_path, signal.SIGKILL, rank)
    assert rc != 0 and elapsed < 30, (who, rc, elapsed)
    rc, out = run_job(3, train_args(job_data, tmp_path / "ck", tmp_path / "model.h5") + ["--resume", "auto"])
    assert rc == 0 and "resuming from" in out, out[-3000:]
    assert_same_model(tmp_path / "model.h5", reference)


def test_resume_onto_more_servers_and_past_a_damaged_checkpoint(job_data, reference, tmp_path):
    rc, out, _ = start_and_interrupt(job_data, tmp_path, signal.SIGUSR1, 1, after_step=600)
    assert rc == 75, out[-3000:]
    newest, _ = checkpoint.newest_good(str(tmp_path / "ck"))
    with open(os.path.join(newest, "server-0.h5"), "r+b") as f:  # damage the newest: resume the one before
        f.seek(4000)
        f.write(b"\xff" * 64)
    # 2 servers + the same 2 workers: shards move to the new server, the numbers do not change
    rc, out = run_job(4, train_args(job_data, tmp_path / "ck", tmp_path / "model.h5", servers=2) + ["--resume", "auto"])
    assert rc == 0, out[-3000:]
    assert "checkpoint skipped" in out and "fails its XXH64 checksum" in out
    assert_same_model(tmp_path / "model.h5", reference)


def test_inspect_and_export(reference_run, reference, tmp_path):
    final = checkpoint.complete_checkpoints(str(reference_run / "ck"))[-1]  # (its only one: the final)
    shown = subprocess.run([*HPCPS, "inspect", final], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "OK" in shown.stdout and "end of training" in shown.stdout
    assert f"{reference.keys.size} keys" in shown.stdout
    subprocess.run([*HPCPS, "export", final, "--out", str(tmp_path / "exported.h5")], check=True,
                   capture_output=True, timeout=120)
    assert_same_model(tmp_path / "exported.h5", reference)


def test_resuming_with_another_model_names_the_settings_that_differ(tmp_path):
    # an FM checkpointed with FTRL's l2 at 0, resumed with the factor models' default l2 of 10
    common = ["train", "--set", "synth.rows=3000", "--set", "synth.test_rows=300", "--set",
              f"synth.dir={json.dumps(str(tmp_path / 'd'))}", "--set", 'model.type="fm"', "--set",
              f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}", "--set", "train.progress=false"]
    first = subprocess.run([*mpiexec(), "-n", "2", *HPCPS, *common, "--set", "optimizer.l2=0", "--set", "train.epochs=1"],
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([*mpiexec(), "-n", "2", *HPCPS, *common, "--set", 'checkpoint.resume="auto"'],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0
    assert "written for another model, optimizer or key space" in again.stderr
    assert "optimizer.l2 was 0.0, now 10.0)" in again.stderr  # the only difference, named


def test_a_late_hdf5_write_failure_is_reported_as_the_checkpoint_write_it_is():
    """HDF5 may report a full disk only when an object of the failed file is freed, as a bare
    RuntimeError; the abort message names the file and the cause in the one line of a write
    failure (the disk-full test met it about once in ten runs)."""
    from hpcps.ps import server, transport
    assert checkpoint.explain_write_failure in server.transport.EXPLAINERS  # the server registers it
    late = RuntimeError("Can't decrement id ref count (file write failed: time = Mon Nov 23 06:46:26 2026\n"
                        ", filename = '/d/ck/ckpt-0000000080.tmp/server-3.h5', file descriptor = 28, errno = 28, "
                        "error message = 'No space left on device', buf = 0x1, total write size = 14000)")
    assert transport.explain(late) == (
        "CheckpointError", "server 3 cannot write /d/ck/ckpt-0000000080.tmp/server-3.h5: No space left on device; "
                           "the checkpoints committed before it are intact")
    other = RuntimeError("Can't decrement id ref count (file write failed: filename = '/d/model.h5', errno = 28)")
    assert transport.explain(other) == ("RuntimeError", "Can't decrement id ref count (file write failed: "
                                                         "filename = '/d/model.h5', errno = 28)")
    assert transport.explain(ValueError("bad")) == ("ValueError", "bad")
