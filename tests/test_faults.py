"""Faults a running job meets, each ended the way docs/operations.md's "Exit codes: what survives what" says.

Every test runs ``hpcps`` as a user would (``mpiexec -n N hpcps ...`` in a subprocess under a
timeout, or one process) and checks the exit status, the one line the user reads, and what is
left on the disk: the retention of checkpoints, SIGINT and SIGTERM mid-run, a full disk during a
model write and during a checkpoint (a small tmpfs, ``small_disk``), and a file truncated while a
job reads it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps.ps import checkpoint
from hpcps.train import synth

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_checkpoint import rank_pids  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def job(n: int, args: list[str], timeout: float = 180, cwd: str | None = None) -> tuple[int, str]:
    """Run ``hpcps args`` in ``n`` ranks (0: one process without mpiexec); (exit status, output)."""
    cmd = [*mpiexec(), "-n", str(n), *HPCPS, *args] if n else [*HPCPS, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
    return proc.returncode, proc.stdout + proc.stderr


def start(n: int, args: list[str], cwd: str | None = None, log=None) -> subprocess.Popen:
    """Start ``hpcps args`` in ``n`` ranks in the background (its output on ``.stdout``, or in the
    file ``log``), in a session of its own so that a test can signal the launcher alone."""
    cmd = [*mpiexec(), "-n", str(n), *HPCPS, *args] if n else [*HPCPS, *args]
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=cwd,
                            start_new_session=True)


def wait_for(predicate, timeout: float = 120, proc: subprocess.Popen | None = None) -> bool:
    """Poll ``predicate()`` until it holds (True), ``proc`` ends or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.02)
    return False


def sets(**kv) -> list[str]:
    """``--set`` options from keyword arguments: ``train__epochs=2`` is ``--set train.epochs=2``."""
    out = []
    for k, v in kv.items():
        value = json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v
        out += ["--set", f"{k.replace('__', '.')}={value}"]
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 3,000-row training file and a 1,000-row test file (libsvm)."""
    d = tmp_path_factory.mktemp("faults")
    info = synth.generate(str(d), 3_000, 1_000, fields=8, seed=5, formats=("libsvm",))
    return info.files["train_libsvm"], info.files["test_libsvm"]


# -- checkpoints belong to a run: lineage and retention ---------------------------------------------

def _train(small, ck, *extra, epochs=1, n=2, **kv):
    return job(n, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=epochs,
                                  train__progress=False, checkpoint__dir=str(ck), **kv), *extra])


def _listing(ck) -> list[str]:
    return [os.path.basename(p) for p in checkpoint.complete_checkpoints(str(ck))]


def test_a_fresh_run_into_another_runs_checkpoints_stops_and_deletes_nothing(small, tmp_path):
    ck = tmp_path / "ck"
    rc, out = _train(small, ck, epochs=3, checkpoint__every_steps=50)
    assert rc == 0, out[-3000:]
    before = _listing(ck)
    assert len(before) == 3 and all(checkpoint.verify(str(ck / n)) for n in before)
    first_run = checkpoint.run_of(checkpoint.read_manifest(str(ck / before[-1])))
    # a fresh 1-epoch run into the same directory: its steps are lower than the other run's
    rc, out = _train(small, ck, "--summary-json", str(tmp_path / "s.json"))
    assert rc == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if ": error: " in ln]
    assert errors and all(f"checkpoint.dir {ck} holds 3 checkpoint(s) of another run (run {first_run}" in ln
                          and "--resume auto" in ln and 'checkpoint.existing = "replace"' in ln for ln in errors), out
    assert "Traceback" not in out and not (tmp_path / "s.json").exists()
    assert _listing(ck) == before  # nothing deleted, nothing written
    # moved aside on request, never deleted; the summary names the checkpoint this run wrote
    rc, out = _train(small, ck, "--summary-json", str(tmp_path / "s.json"), checkpoint__existing="replace")
    assert rc == 0, out[-3000:]
    moved = [os.path.join(r, d) for r, ds, _ in os.walk(ck / checkpoint.REPLACED) for d in ds if d.startswith("ckpt-")]
    assert sorted(map(os.path.basename, moved)) == before and all(checkpoint.verify(m) for m in moved)
    summary = json.load(open(tmp_path / "s.json"))
    mine = _listing(ck)
    assert len(mine) == 1 and summary["checkpoint"] == str(ck / mine[0]), (summary.get("checkpoint"), mine)
    assert checkpoint.run_of(checkpoint.read_manifest(str(ck / mine[0]))) != first_run
    assert f"  checkpoints  {ck / mine[0]}" in out and f"hpcps export {ck / mine[0]}" in out


def test_resume_over_only_damaged_checkpoints_keeps_them_and_the_new_run(small, tmp_path):
    ck = tmp_path / "ck"
    rc, out = _train(small, ck, epochs=3, checkpoint__every_steps=50)
    assert rc == 0, out[-3000:]
    before = _listing(ck)
    for name in before:  # every checkpoint damaged: a byte flipped in the middle of its server file
        with open(ck / name / "server-0.h5", "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    rc, out = _train(small, ck, "--resume", "auto", "--summary-json", str(tmp_path / "s.json"))
    assert rc == 0, out[-3000:]
    assert out.count("fails its XXH64 checksum") == 3 and "starting from scratch" in out, out[-3000:]
    assert sorted(os.listdir(ck / checkpoint.DAMAGED)) == before  # moved, said so, not deleted
    mine = _listing(ck)  # the new run's checkpoint is kept (its steps are lower than the damaged ones')
    assert len(mine) == 1 and json.load(open(tmp_path / "s.json"))["checkpoint"] == str(ck / mine[0])
    checkpoint.verify(str(ck / mine[0]))


def _fake(root, step, run_id, keep=2):
    """A one-server checkpoint of ``run_id`` at ``step``, committed with ``keep``."""
    tmp = checkpoint.begin(str(root), step)
    keys = np.arange(step, step + 100, dtype=np.uint64)
    rows = np.full((100, 2), step, dtype=np.float32)
    size, digest = checkpoint.write_server_file(checkpoint.server_file(tmp, 0), 0, 1, 8, [("w", keys, rows)])
    manifest = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "run_id": run_id,
                "position": {"global_step": step}, "layout": {"num_shards": 8, "servers": 1},
                "tables": [{"name": "w", "dim": 1, "width": 2, "optimizer": "sgd"}],
                "files": [{"name": "server-0.h5", "bytes": size, "xxh64": digest}]}
    return checkpoint.commit(tmp, manifest, keep, report=lambda m: None)


def test_retention_keeps_good_checkpoints_of_its_own_run_only(tmp_path):
    _fake(tmp_path, 500, "other")  # another run's, with higher steps
    for step in (10, 20):
        _fake(tmp_path, step, "mine")
    with open(tmp_path / "ckpt-0000000020" / "server-0.h5", "r+b") as f:  # the newer of mine is damaged
        f.seek(3000)
        f.write(b"\xff" * 8)
    path = _fake(tmp_path, 30, "mine", keep=2)  # two good ones of mine kept: 30 and 10; 20 moved aside
    assert path.endswith("ckpt-0000000030")
    assert _listing(tmp_path) == ["ckpt-0000000010", "ckpt-0000000030", "ckpt-0000000500"]
    assert os.listdir(tmp_path / checkpoint.DAMAGED) == ["ckpt-0000000020"]
    _fake(tmp_path, 40, "mine", keep=2)  # now 10 is the oldest of mine beyond keep: deleted
    assert _listing(tmp_path) == ["ckpt-0000000030", "ckpt-0000000040", "ckpt-0000000500"]
    checkpoint.verify(str(tmp_path / "ckpt-0000000500"))  # the other run's, untouched throughout


def test_a_run_resumed_from_an_older_checkpoint_moves_the_later_ones_aside(tmp_path):
    for step in (10, 20, 30):
        _fake(tmp_path, step, "mine", keep=5)
    lines = []
    resumed = str(tmp_path / "ckpt-0000000010")
    assert checkpoint.claim(str(tmp_path), "mine", resumed, report=lines.append) is None
    assert _listing(tmp_path) == ["ckpt-0000000010"]
    assert sorted(os.listdir(tmp_path / checkpoint.SUPERSEDED)) == ["ckpt-0000000020", "ckpt-0000000030"]
    assert len(lines) == 2 and all(f"past the checkpoint resumed from ({resumed})" in ln for ln in lines)
    _fake(tmp_path, 20, "mine", keep=1)  # the resumed run's step 20 is its newest, kept
    assert _listing(tmp_path) == ["ckpt-0000000020"]
    assert checkpoint.read_manifest(str(tmp_path / "ckpt-0000000020"))["position"]["global_step"] == 20
    # another run's checkpoints stop a fresh run, and are moved aside whole on request
    error = checkpoint.claim(str(tmp_path), "new", None)
    assert error and "holds 1 checkpoint(s) of another run (run mine; newest ckpt-0000000020)" in error
    assert checkpoint.claim(str(tmp_path), "new", None, "replace", report=lines.append) is None
    assert _listing(tmp_path) == [] and "moved 1 checkpoint(s) of another run" in lines[-1]


def test_the_checkpoint_resumed_from_is_never_moved_aside_whatever_its_name(tmp_path):
    for step in (10, 20):
        _fake(tmp_path, step, "mine", keep=5)
    renamed = tmp_path / "ckpt-0000000025"  # a folder renamed by hand: its name says 25, its manifest 20
    os.rename(tmp_path / "ckpt-0000000020", renamed)
    lines = []
    assert checkpoint.claim(str(tmp_path), "mine", str(renamed), report=lines.append) is None
    assert _listing(tmp_path) == ["ckpt-0000000010", "ckpt-0000000025"] and not lines
    checkpoint.verify(str(renamed))
    # another run's checkpoint beside the one resumed: the advice is not to resume (that was done)
    _fake(tmp_path, 5, "other", keep=5)
    error = checkpoint.claim(str(tmp_path), "mine", str(renamed))
    assert f"besides the one resumed ({renamed})" in error and "--resume auto" not in error


def test_a_checkpoint_of_the_same_run_and_step_written_again_replaces_it(tmp_path):
    first = _fake(tmp_path, 10, "mine", keep=1)
    inode = os.stat(first).st_ino
    again = _fake(tmp_path, 10, "mine", keep=1)  # (a resumed run with nothing new to train, its data changed)
    assert again == first and _listing(tmp_path) == ["ckpt-0000000010"] and os.stat(again).st_ino != inode
    assert not os.path.exists(tmp_path / checkpoint.SUPERSEDED) and not any(n.endswith(".tmp") for n in
                                                                            os.listdir(tmp_path))
    checkpoint.verify(again)


def test_resuming_a_finished_run_writes_nothing_and_reports_no_empty_epoch(small, tmp_path):
    ck = tmp_path / "ck"
    rc, out = _train(small, ck, epochs=2, checkpoint__every_steps=10, train__batch_size=100, checkpoint__keep=1)
    assert rc == 0, out[-3000:]
    (final,) = _listing(ck)
    before = os.stat(ck / final / checkpoint.MANIFEST).st_mtime_ns
    for _ in range(2):  # resumed at its last step (a periodic checkpoint's position is the next epoch's first)
        rc, out = _train(small, ck, "--resume", "auto", "--summary-json", str(tmp_path / "s.json"), epochs=2,
                         checkpoint__every_steps=10, train__batch_size=100, checkpoint__keep=1,
                         train__metrics=str(tmp_path / "m.jsonl"))
        assert rc == 0 and "nothing left to train" in out, out[-3000:]
    assert _listing(ck) == [final] and not os.path.exists(ck / checkpoint.SUPERSEDED)
    assert os.stat(ck / final / checkpoint.MANIFEST).st_mtime_ns == before  # not written again
    summary = json.load(open(tmp_path / "s.json"))
    assert "train_loss" not in summary, summary  # (it read 0.0: an epoch of no step)
    assert not [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if r.get("kind") == "epoch"]


def test_an_epoch_resumed_midway_says_where_its_loss_starts(small, tmp_path):
    ck = tmp_path / "ck"
    rc, out = _train(small, ck, epochs=1, checkpoint__every_steps=10, train__batch_size=100)
    assert rc == 0, out[-3000:]
    middle = [n for n in _listing(ck) if checkpoint.step_of(n) == 10][0]
    rc, out = _train(small, ck, "--resume", str(ck / middle), epochs=1, checkpoint__every_steps=10,
                     train__batch_size=100, train__metrics=str(tmp_path / "m.jsonl"))
    assert rc == 0, out[-3000:]
    (epoch,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if r.get("kind") == "epoch"]
    assert epoch["first_step"] == 11, epoch


def test_inspect_and_export_of_a_checkpoint_directory(tmp_path):
    for step in (10, 20):
        _fake(tmp_path, step, "mine", keep=5)
    checkpoint.quarantine(str(tmp_path / "ckpt-0000000010"), "test", report=lambda m: None)
    rc, out = job(0, ["inspect", str(tmp_path)])
    assert rc == 0 and out.rstrip().endswith(f"{tmp_path}: set aside: 1 under damaged/"), out
    rc, out = job(0, ["export", str(tmp_path), "--out", str(tmp_path / "m.h5")])
    assert rc == 2 and f"name one of its checkpoints, e.g. the newest, {tmp_path / 'ckpt-0000000020'}" in out, out



# -- signals: SIGINT and SIGTERM mid-run ------------------------------------------------------------

@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A training file for jobs that run long enough to be interrupted (tens of seconds)."""
    d = tmp_path_factory.mktemp("long")
    info = synth.generate(str(d), 20_000, 1_000, fields=8, seed=6, formats=("libsvm",))
    return info.files["train_libsvm"]


def _long_args(train, ck=None, **kv):
    settings = {"data__train": train, "train__epochs": 200, "train__batch_size": 50, "train__progress": False}
    if ck:
        settings["checkpoint__dir"] = str(ck)
    return ["train", *sets(**{**settings, **kv})]


def _started(log) -> bool:
    return os.path.exists(log) and "steps/epoch" in open(log).read()


def _interrupt(proc, log, signum, pid=None, meanwhile=None) -> tuple[int, str]:
    """Once ``proc``'s job trains (and ``meanwhile()`` ran), send ``signum`` to ``pid()`` (default:
    ``proc`` itself, the launcher); (exit status, output), checked for tracebacks."""
    assert wait_for(lambda: _started(log), proc=proc), open(log).read()[-3000:]
    time.sleep(1.0)  # mid-run
    if meanwhile:
        meanwhile()
    os.kill(pid() if pid else proc.pid, signum)
    rc = proc.wait(timeout=60)
    out = open(log).read()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    return rc, out


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_sigint_to_mpiexec_stops_the_job_with_one_line_and_status_130(long_run, tmp_path, with_checkpoint):
    ck, log = (tmp_path / "ck" if with_checkpoint else None), tmp_path / "log"
    rc, out = _interrupt(start(3, _long_args(long_run, ck), log=log), log, signal.SIGINT)  # what Ctrl-C sends
    assert rc == 130, out[-3000:]
    said = [ln for ln in out.splitlines() if "stopped by SIGINT" in ln]
    assert len(said) == 1, out[-3000:]
    if with_checkpoint:
        newest, manifest = checkpoint.newest_good(str(ck))
        assert manifest["reason"] == "signal" and f"after checkpoint {newest};" in said[0], out[-3000:]
        rc, out = job(3, _long_args(long_run, ck, train__epochs=2) + ["--resume", "auto"])
        assert rc == 0 and f"resuming from {newest}" in out, out[-3000:]
    else:
        assert said[0].startswith("hpcps: rank ") and "no checkpoint to write" in said[0]


def test_sigint_to_one_worker_rank_stops_the_whole_job(long_run, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log"
    rc, out = _interrupt(start(3, _long_args(long_run, ck), log=log), log, signal.SIGINT,
                         pid=lambda: rank_pids(str(ck))[2])  # a worker alone, not the launcher
    assert rc == 130, out[-3000:]
    assert checkpoint.newest_good(str(ck))[1]["reason"] == "signal"


def test_sigterm_to_mpiexec_checkpoints_and_exits_75(long_run, tmp_path):
    ck, log, second = tmp_path / "ck", tmp_path / "log", []
    # meanwhile a second job into the same checkpoint.dir, fresh or resuming, is refused in one line
    rc, out = _interrupt(start(3, _long_args(long_run, ck), log=log), log, signal.SIGTERM, meanwhile=lambda: second.extend(
        job(0, _long_args(long_run, ck, train__epochs=1) + resume, timeout=60) for resume in ([], ["--resume", "auto"])))
    assert rc == 75, out[-3000:]
    assert checkpoint.newest_good(str(ck))[1]["reason"] == "signal"
    for rc2, out2 in second:
        errors = [ln for ln in out2.splitlines() if ": error: " in ln]
        assert rc2 == 2 and len(errors) == 1 and f"checkpoint.dir {ck} is in use by another running job" in errors[0], out2
    assert [n for n in os.listdir(ck) if not n.startswith("ckpt-")] == []  # the lock adds no file


def test_sigint_to_supervise_reaches_the_job_once_and_leaves_no_process(long_run, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log"
    proc = subprocess.Popen([*HPCPS, "supervise", "--", *mpiexec(), "-n", "3", *HPCPS, *_long_args(long_run, ck)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    rc, out = _interrupt(proc, log, signal.SIGINT)
    assert rc == 130, out[-3000:]
    assert "hpcps supervise: job interrupted (SIGINT) (exit status 130)" in out, out[-3000:]
    assert out.count("Sending Ctrl-C to processes") <= 1  # (MPICH says it) one SIGINT reached mpiexec, not two
    assert checkpoint.newest_good(str(ck))[1]["reason"] == "signal"
    assert not rank_pids(str(ck))  # no rank left behind


def test_a_second_sigint_to_supervise_ends_the_job_at_once_not_as_finished(long_run, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log"
    proc = subprocess.Popen([*HPCPS, "supervise", "--", *mpiexec(), "-n", "3", *HPCPS, *_long_args(long_run, ck)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    assert wait_for(lambda: _started(log), proc=proc), open(log).read()[-3000:]
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.02)  # an impatient second Ctrl-C: on as SIGTERM, not as a second SIGINT to mpiexec
    os.kill(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    out = open(log).read()
    assert rc in (130, 143), out[-3000:]  # (which of the two the ranks saw first)
    assert "finished" not in out and "Traceback" not in out, out[-3000:]
    assert not rank_pids(str(ck))


FAKE_JOB = """
import json, os, sys
count = os.path.join(os.path.dirname(os.path.abspath(__file__)), "starts")
n = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(n))
open(os.path.join(os.path.dirname(count), f"argv-{n}"), "w").write(json.dumps(sys.argv[1:]))
json.dump({"global_step": 5, "checkpoint_dir": ""}, open(os.environ["HPCPS_STATUS_FILE"], "w"))
sys.exit(1 if n == 1 else 0)  # the first start fails (a crash), the second finishes
"""


def test_supervise_restarts_a_job_without_checkpoints_from_the_start(tmp_path):
    """A job whose status says it writes no checkpoints (a real process standing in for training,
    as supervise reads it) is restarted as it was given: --resume auto would be refused."""
    (tmp_path / "job.py").write_text(FAKE_JOB)
    rc, out = job(0, ["supervise", "--backoff", "0", "--", sys.executable, str(tmp_path / "job.py"), "train"])
    assert rc == 0 and "restart 1/3 in 0 s from the start (the job has no checkpoint.dir)" in out, out
    assert json.load(open(tmp_path / "argv-2")) == ["train"]


SIGNALLED_JOB = """
import json, os, signal, sys, time
json.dump({"global_step": 12, "checkpoint_dir": sys.argv[1]}, open(os.environ["HPCPS_STATUS_FILE"], "w"))
signal.signal(signal.SIGTERM, lambda *a: os._exit(143))  # (as a second SIGTERM ends a job at once)
open(sys.argv[2], "w").close()
time.sleep(60)
"""


def test_a_job_ended_by_signals_under_supervise_names_the_checkpoint_to_resume_from(tmp_path):
    """A job whose ranks a second signal ended with 143 while the signal's checkpoint committed (a
    real process standing in for it, as supervise sees it): supervise does not restart it, and
    names the newest good checkpoint, which the ranks could not (they said none was written)."""
    from test_reliability import _tiny_checkpoint
    tmp, manifest = _tiny_checkpoint(tmp_path / "ck")
    final = checkpoint.commit(tmp, manifest, keep=3)
    (tmp_path / "job.py").write_text(SIGNALLED_JOB)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([*HPCPS, "supervise", "--backoff", "0", "--", sys.executable, str(tmp_path / "job.py"),
                             str(tmp_path / "ck"), str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV)
    assert wait_for(ready.exists, 60, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert f"not restarting; --resume auto continues from {final}" in out, out


def test_a_failed_mpi_call_is_reported_as_a_peer_that_died_not_as_a_bug():
    """What a rank says when MPI fails under it (a peer killed, out of memory): one line, no
    "unexpected" (the MPI error is made here: when it happens depends on the launcher's teardown)."""
    from mpi4py import MPI

    from hpcps import errors
    from hpcps.ps import transport

    e = MPI.Exception(MPI.ERR_OTHER)
    line, status = errors.one_line(e, transport.explanation(e))
    assert status == 1 and line.startswith("MPIError: an MPI call failed (") and "another rank of the job died" in line
    assert "unexpected" not in line


@pytest.mark.parametrize("args,match", [
    (["--", "no-such-launcher-xyz", "-n", "2"], "cannot start the job: no-such-launcher-xyz: No such file or directory"),
    (["--max-restarts", "-1", "--", "true"], "--max-restarts must be at least 0 (got -1)"),
    (["--backoff", "nan", "--", "true"], "--backoff must be at least 0 (got nan)"),
    (["--log", "/nonexistent-dir/log", "--", "true"], "--log /nonexistent-dir/log: cannot write there: No such file"),
])
def test_supervise_refuses_what_it_cannot_run_in_one_line(args, match):
    rc, out = job(0, ["supervise", *args], timeout=60)
    assert rc == 2 and match in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out



# -- a full disk during a model write -------------------------------------------------------------

def _fill(disk, leave: int = 0) -> None:
    """Fill the small disk up to ``leave`` bytes free."""
    import shutil

    with open(disk / "fill", "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_full_disk_during_the_model_write_is_one_line_and_keeps_the_old_model(small, small_disk, tmp_path, ranks):
    model = small_disk / "model.h5"
    model.write_bytes(b"the previous model")
    _fill(small_disk)
    rc, out = job(ranks, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1,
                                         train__progress=False, train__model_out=str(model))])
    errors = [line for line in out.splitlines() if "error:" in line]
    assert rc == 1 and len(errors) == 1 and str(model) in errors[0] and "No space left on device" in errors[0], out
    assert "needed about" in errors[0] and "Traceback" not in out and "where things went" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill", "model.h5"]  # no temporary file left
    assert model.read_bytes() == b"the previous model"


def test_a_full_disk_during_predict_out_is_one_line(small, small_disk, tmp_path):
    rc, out = job(0, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,
                                     train__model_out=str(tmp_path / "m.h5"))])
    assert rc == 0, out
    _fill(small_disk)
    scores = small_disk / "scores.txt"
    rc, out = job(0, ["predict", "--model", str(tmp_path / "m.h5"), "--data", small[1], "--out", str(scores)])
    assert rc == 1 and f"cannot write {scores}: No space left on device" in out and "Traceback" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill"]
    rc, out = job(2, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,  # data.predict_out
                                     data__predict=small[1], data__predict_out=str(scores))])
    assert rc == 1 and f"cannot write {scores}: No space left on device" in out and "Traceback" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill"]


def test_a_model_write_that_fails_inside_hdf5_leaves_no_temporary_file(small_disk):
    """The write's own failure (not the check of the free space before it): HDF5 meets the full
    disk part-way through the file."""
    import numpy as np

    from hpcps import outputs

    model = small_disk / "model.h5"
    model.write_bytes(b"the previous model")
    _fill(small_disk, leave=1 << 20)

    def fill(f):
        f["values"] = np.ones(4 << 20, dtype=np.float32)  # 16 MiB

    with pytest.raises(outputs.OutputError, match="No space left on device") as e:
        outputs.write_h5(str(model), fill)  # (the model file's write, with no size to refuse before)
    assert e.value.exit_status == 1 and "the previous" in str(e.value)
    assert sorted(os.listdir(small_disk)) == ["fill", "model.h5"]
    assert model.read_bytes() == b"the previous model"



# -- a full disk during a checkpoint --------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 0])
def test_disk_full_during_a_checkpoint_loses_nothing_committed(small, tmp_path, small_disk, ranks):
    """The disk fills up while a job checkpoints: the job ends with one line (who could not write
    what, how much it needed where known), no traceback (one process too: it printed Python's),
    exit 1; every committed checkpoint still verifies and the job resumes from the newest."""
    ck = small_disk / "ck"
    args = ["train", *sets(data__train=small[0], train__epochs=2, train__progress=False, train__batch_size=20,
                           checkpoint__dir=str(ck), checkpoint__every_steps=40, checkpoint__keep=100)]
    proc = start(ranks, args)
    first = checkpoint.step_dir(str(ck), 40)
    assert wait_for(lambda: os.path.exists(first), 120, proc), proc.communicate()[0][-2000:]
    with open(small_disk / "filler", "wb") as f:  # the disk fills up while training goes on
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-2000:]
    # the server's file or the first worker's manifest meets the full disk first: either says so
    lines = [ln for ln in out.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and re.match(r"hpcps: rank (0/1|[01]/2): error: CheckpointError: (server 0|the first "
                                        r"worker) cannot write ", lines[0]), out[-3000:]
    size = r"[\d.]+ (bytes|KiB|MiB|GiB)"
    assert re.search(rf"No space left on device( \({size} needed, {size} free\))?; the checkpoints "
                     r"committed before it are intact$", lines[0]), lines[0]
    assert "Traceback" not in out and "HPCPS_DEBUG" not in out, out[-3000:]
    good = checkpoint.newest_good(str(ck), report=lambda m: None)
    assert good is not None and good[0] >= first  # every committed checkpoint still verifies
    os.unlink(small_disk / "filler")
    rc, out = job(ranks, args + ["--resume", "auto"])
    assert rc == 0 and "resuming from" in out, out[-2000:]


# -- files that change under a running job ---------------------------------------------------------


def _change(path: str, how: str) -> None:
    """Change a data file as a user might while a job reads it."""
    if how == "truncated":
        subprocess.run(["truncate", "-s", str(os.path.getsize(path) // 2), path], check=True)
    elif how == "grown":
        with open(path, "ab") as f:
            f.write(b"1 3:1 5:1\n" * 2000)
    elif how == "replaced":  # another file renamed over it (a new inode, the same size)
        data = open(path, "rb").read()
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)
    else:  # "rewritten" in place: the same size, other bytes
        with open(path, "r+b") as f:
            f.seek(0)
            first = f.readline()
            f.seek(0)
            f.write(b"1" + first[1:] if first[:1] == b"0" else b"0" + first[1:])


@pytest.mark.parametrize("how,settings", [
    ("truncated", {"data__memory_mb": 1}),                             # read again each epoch: the repro
    ("truncated", {"data__memory_mb": 1, "data__parse_thread": True}),  # read on the parse thread
    ("grown", {"data__memory_mb": 1}),
    ("replaced", {"data__memory_mb": 1}),
    ("rewritten", {"data__memory_mb": 0}),                              # in memory: checked each epoch
    ("truncated", {"data__memory_mb": 0, "data__cache_dir": "CACHE"}),  # a loaded (cached) part
])
def test_a_data_file_changed_under_a_running_job_ends_it_in_one_line(small, tmp_path, how, settings):
    """A training file truncated while a job reads it made the reader spin a core for ever (a
    read of 0 bytes, again and again), past the stall timeout. A file that shrinks, grows or is
    replaced or rewritten now ends the job within an epoch: one line naming the file, exit 2."""
    path = str(tmp_path / "train.svm")
    with open(small[0], "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    metrics = tmp_path / "m.jsonl"
    settings = {k: (str(tmp_path / "cache") if v == "CACHE" else v) for k, v in settings.items()}
    proc = start(2, ["train", *sets(data__train=path, train__epochs=100_000, train__progress=False,
                                    train__metrics=str(metrics), cluster__stall_timeout_s=20,
                                    cluster__stall_warn_s=10, **settings)])
    try:
        assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, proc), \
            proc.communicate(timeout=10)[0][-2000:]
        changed = time.monotonic()
        _change(path, how)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - changed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, out[-2000:]
    lines = [ln for ln in out.splitlines() if ": error: " in ln]
    assert lines and all(re.fullmatch(r"hpcps: rank 1/2: error: data file \S+train\.svm changed while this job read "
                                      r"it \(.+\); a job reads its training file again each epoch, so it must stay "
                                      r"as it was: copy it before changing it", ln) for ln in lines), out[-2000:]
    assert "Traceback" not in out
    assert took < 20, f"{took:.1f} s: not within the stall timeout"


# -- non-finite numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks,settings,where,cause", [
    (2, {"model__type": "fm", "optimizer__name": "sgd", "optimizer__lr": 1e30},
     r"non-finite rows pulled from table\(s\) fm", r"the learning rate \(optimizer\.lr = 1e\+30 for sgd\)"),
    (0, {"model__type": "fm", "optimizer__name": "sgd", "optimizer__lr": 1e30},  # one process: no MPI abort
     r"non-finite rows pulled from table\(s\) fm", r"the learning rate \(optimizer\.lr = 1e\+30 for sgd\)"),
    (2, {"model__type": "wdl", "model__dense_optimizer": "sgd", "model__dense_lr": 1e30},
     r"the rows pulled are finite", r"the MLP's rate \(model\.dense_lr = 1e\+30\) or the learning rate"),
])
def test_a_diverging_model_stops_at_its_first_non_finite_loss(small, tmp_path, ranks, settings, where, cause):
    """Too high a learning rate (the sparse tables' or the MLP's) makes the loss NaN within a few
    steps: the job stops there, one line naming the step, what was not finite and the rate
    (the MLP's first when the pulled rows were finite), exit 1, no model, no numpy warning."""
    model = tmp_path / "model.h5"
    rc, out = job(ranks, ["train", *sets(data__train=small[0], train__epochs=2, train__progress=False,
                                         train__model_out=str(model), **settings)])
    assert rc == 1, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("hpcps train:")]
    rank = "0/1" if not ranks else "1/2"
    assert len(lines) == 1 and re.fullmatch(
        rf"hpcps: rank {rank}: error: non-finite numbers at step \d+ \(epoch 1, step \d+ of \d+\): the loss is "
        rf"(nan|inf): {where} \(the batch's labels: 0 to 1\); likely cause: {cause}.*\. Training stops; no "
        rf"checkpoint or model is written from it", lines[0]), out[-3000:]
    assert not model.exists()


def _with_label(src: str, dst: str, line: int, label: str) -> str:
    """A copy of ``src`` whose line ``line`` (1-based) has the label ``label``."""
    lines = open(src, "rb").read().split(b"\n")
    lines[line - 1] = label.encode() + b" " + lines[line - 1].split(b" ", 1)[1]
    with open(dst, "wb") as f:
        f.write(b"\n".join(lines))
    return dst


def _finite_checkpoints(ck: str) -> list[str]:
    """The committed checkpoints under ``ck``, each checked: it verifies and its rows are finite."""
    import h5py
    import numpy as np

    found = checkpoint.complete_checkpoints(ck)
    for path in found:
        m = checkpoint.verify(path)
        for f in m["files"]:
            with h5py.File(os.path.join(path, f["name"]), "r") as h:
                for name in h["tables"]:
                    assert np.isfinite(h["tables"][name]["rows"][()]).all(), (path, name)
    return found


@pytest.mark.parametrize("every", [7, 10])
def test_a_label_far_out_of_range_stops_training_with_one_line_and_keeps_the_good_checkpoints(small, tmp_path,
                                                                                               every):
    """Squared loss with one label of 1e30 trained to ``train loss nan``, wrote a NaN checkpoint
    and a NaN model, and exited 0. Now the label gets a warning when it is read, and the step
    that meets the NaN (a step after the label's: its pull) stops the job: one line naming
    the step, the table and the likely cause, exit 1. No checkpoint and no model is written
    from it: with a checkpoint due right after the label's step (``every`` = 10), the server
    refuses to write it. The checkpoints before stay, all finite."""
    path = _with_label(small[0], str(tmp_path / "big.svm"), 1990, "1e30")  # in step 40 of 50-row steps
    ck, model = tmp_path / "ck", tmp_path / "model.h5"
    # (model.bias_init = "zero": the auto bias, the mean of the first rows' labels, would hold the 1e30 from step 1)
    rc, out = job(2, ["train", *sets(data__train=path, model__loss="squared", model__bias_init="zero",
                                     train__epochs=3, train__batch_size=50,
                                     train__progress=False, train__model_out=str(model), checkpoint__dir=str(ck),
                                     checkpoint__every_steps=every, checkpoint__keep=100)])
    assert rc == 1, out[-3000:]
    assert re.search(r"^hpcps: warning: \S+big\.svm: a label of 1e\+30 is far outside the first rows' labels "
                     r"\(1st to 99th percentile: 0 to 1\)", out, re.M), out[-3000:]
    errors = [ln for ln in out.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    if every == 7:  # a step after the label's pulls the NaN rows (FTRL's state overflows first, then its weight)
        assert re.fullmatch(r"hpcps: rank 1/2: error: non-finite numbers at step (4[12]) \(epoch 1, step \1 of 60\): the "
                            r"loss is nan: non-finite rows pulled from table\(s\) w \(the batch's labels: 0 to 1\); "
                            r"likely cause: the labels' range \(0 to 1e\+30 on this worker so far: scale them\) or the "
                            r"learning rate \(optimizer\.alpha = 0\.1 for ftrl\)\. Training stops; no checkpoint or "
                            r"model is written from it \(the last good checkpoint: \S+ckpt-0000000035\)", errors[0]), \
            errors[0]
    else:  # the checkpoint of step 40, right after the label's push
        assert re.fullmatch(r"hpcps: rank 0/2: error: NonFiniteTable: table 'w' holds NaN or infinite numbers in \d+ "
                            r"of its [\d,]+ rows here: no checkpoint \(step 40\) is written from it \(the last good "
                            r"checkpoint is kept\); likely cause: .*", errors[0]), errors[0]
    assert not model.exists() and not os.path.exists(str(model) + ".tmp")
    found = _finite_checkpoints(str(ck))
    assert [os.path.basename(p) for p in found][-1] == ("ckpt-0000000035" if every == 7 else "ckpt-0000000030")


@pytest.mark.parametrize("written", [False, True, "then another run"])
def test_a_second_signal_after_the_signals_checkpoint_keeps_its_exit_status(written):
    # a rank that gets SIGTERM twice: before the checkpoint is written, 143 (nothing to resume
    # from); once it is (the rank on its way out, exit 75), the second one said so and 75 kept,
    # for a scheduler to requeue (it said "before the checkpoint was written" and exited 143); a
    # later run in the same process (signals installed again) starts without it
    again = "signals.clear()\nsignals.install(defer=True, first=True)\nos.kill(os.getpid(), signal.SIGTERM)\n"
    script = ("import os, signal\nfrom hpcps.ps import signals\nsignals.install(defer=True, first=True)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\nassert signals.requested() == signal.SIGTERM\n"
              + ("signals.checkpoint_written(75)\n" if written else "")
              + (again if written == "then another run" else "")
              + "os.kill(os.getpid(), signal.SIGTERM)\nraise SystemExit(9)\n")
    written = written is True
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == (75 if written else 143), done.stderr
    assert done.stderr.strip() == ("hpcps: stopped by SIGTERM: again after the signal's checkpoint was written (exit "
                                   "status 75)" if written else
                                   "hpcps: stopped by SIGTERM: again before the checkpoint was written (exit status 143)")
