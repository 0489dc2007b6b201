"""Backup workers under BSP (``cluster.backup_workers``): a clock completes once W - b workers have
pushed it, a late push is dropped or applied with the next clock, a late worker skips the rest of an
epoch the others ended, and the summary names it. The rules first (pure), then real jobs of 1 server
+ 3 workers, one of them stopped (SIGSTOP) for a few seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps import config
from hpcps.bench import backup as bench_backup
from hpcps.bench.vw import mpiexec_command
from hpcps.ps import protocol
from hpcps.ps.consistency import Backup, WorkerClocks
from hpcps.train import synth
from hpcps.train.model_file import ServingModel
from hpcps.train.progress import STATUS_ENV, read_status
from hpcps.train.quorum_checkpoints import next_meeting

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_chaos import chaos_run, close_model  # noqa: E402


def push(clock: int, worker: int) -> protocol.Push:
    return protocol.Push(0, 1, clock, worker, np.array([7], np.uint64), np.ones((1, 1), np.float32))


def pull(clock: int) -> protocol.Pull:
    return protocol.Pull(0, 1, clock, 0, np.array([7], np.uint64))


@pytest.mark.parametrize("late_pushes", ["next", "drop"])
def test_a_clock_completes_with_w_minus_b_workers_and_a_late_push_is_deferred_or_dropped(late_pushes):
    w = WorkerClocks(3, 0, Backup(1, late_pushes))
    for worker in (1, 2):  # two of three push clock 0 and pass it: clock 0 is complete
        w.keep_push(worker, push(0, worker))
        w.advance(worker, 1)
    assert w.min_clock() == 1 and w.ready(pull(1)) and not w.ready(pull(2))
    assert [k for k, _ in w.pushes_due()] == [1, 2]  # applied in worker order
    assert not w.is_late(1, 1) and w.is_late(0, 0)
    w.keep_push(0, push(0, 0))  # worker 0's push of clock 0 comes late
    w.advance(0, 1)
    assert w.pushes_due() == []  # (not applied with the clock that completed without it)
    counts = w.late_counts()
    assert counts["backup_clocks_late"] == [1, 0, 0]
    if late_pushes == "drop":
        assert counts["backup_pushes_dropped"] == [1, 0, 0] and not w.buffered
    else:  # kept for clock 1, applied when it completes (or before a checkpoint)
        assert counts["backup_pushes_deferred"] == [1, 0, 0] and [b[:2] for b in w.buffered] == [(1, 0)]
        for worker in (1, 2):
            w.advance(worker, 2)
        assert [(k, r.clock) for k, r in w.pushes_due()] == [(0, 0)]


def test_a_checkpoint_waits_for_every_worker_and_holds_the_late_pushes():
    w = WorkerClocks(3, 0, Backup(1))
    for worker in (1, 2):
        w.advance(worker, 1)
    w.keep_push(0, push(0, 0))
    ck = protocol.Checkpoint(1, 1, 0, "x")
    assert not w.ready(ck)  # worker 0 has not reached clock 1
    w.advance(0, 1)
    assert w.ready(ck) and [k for k, _ in w.late_pushes_kept()] == [0] and not w.buffered


def test_a_quorum_checkpoint_waits_for_its_clock_holds_later_pushes_and_is_missed_after_it():
    """The first worker's checkpoint under backup workers: ready once the clock before it is
    complete (worker 2 stopped), the pushes of its clock held until it is written (the model of its
    clock on every server), and missed once a later clock completed before it came."""
    w = WorkerClocks(3, 0, Backup(1))
    ck = protocol.Checkpoint(1, 2, 0, "x", quorum=True)
    w.advance(0, 1)
    w.advance(1, 1)
    assert not w.ready(ck) and not w.missed(ck)
    w.defer(0, ck, 0.0)
    for clock in (1, 2):  # workers 0 and 1 push clocks 1 and 2; clock 2 completes too
        for worker in (0, 1):
            w.keep_push(worker, push(clock, worker))
            w.advance(worker, clock + 1)
    assert w.min_clock() == 3 and [r.clock for _, r in w.pushes_due()] == [1, 1]  # (clock 2's held)
    assert [r for _, r in w.reads_due()] == [ck]
    assert [r.clock for _, r in w.pushes_due()] == [2, 2]
    assert w.missed(protocol.Checkpoint(2, 2, 0, "y", quorum=True)) and not w.missed(protocol.Checkpoint(3, 2, 0, "y"))


def test_a_quorum_checkpoint_is_asked_no_later_than_the_workers_next_meeting():
    """A stop's agreement moves every worker to the clock of the quorum checkpoint asked: asked
    past an evaluation, the worker that saw the stop (moved past it) would skip the evaluation that
    the workers who joined the agreement there make, and the job would hang in it. So the latest
    step it may be asked at is the next evaluation's (not the epoch's last step's), else the
    epoch's end."""
    assert [next_meeting(s, 23, 5) for s in (3, 4, 5, 9, 10, 19, 20, 22)] == [5, 5, 10, 10, 15, 20, 23, 23]
    assert next_meeting(4, 23, 0) == 23 and next_meeting(4, 3, 5) == 3


def test_b_0_waits_for_the_slowest_and_nothing_is_late():
    w = WorkerClocks(3, 0)
    w.advance(1, 5)
    w.advance(2, 5)
    assert w.min_clock() == 0 and not w.is_late(0, 0) and not w.ready(pull(1)) and w.late_counts() == {}


def test_done_workers_count_as_past_every_clock():
    w = WorkerClocks(3, 0, Backup(1))
    w.finish(2)
    w.advance(1, 4)
    assert w.min_clock() == 4 and w.is_late(0, 3)


@pytest.mark.parametrize("sets, words", [
    ({"backup_workers": 1, "staleness": 2}, "is for BSP"),
    ({"backup_workers": 1, "worker_groups": 1}, "one worker per group"),
    ({"late_pushes": "later"}, "expected one of"),
    ({"backup_workers": -1}, "at least 0"),
])
def test_bad_settings_are_one_line_naming_the_key(sets, words):
    with pytest.raises(config.ConfigError) as e:
        config.from_dict({"cluster": sets})
    assert words in str(e.value) and "cluster." in str(e.value)


def test_as_many_backups_as_workers_is_refused():
    assert "less than the number of workers (3)" in Backup(3).check(3, 0)
    assert Backup(2).check(3, 0) is None and Backup(0).check(1, 5) is None


def test_the_summary_line_names_the_most_stalled_workers_first_and_counts_the_rest():
    """Every worker is late now and then under b > 0: the line named all of them, the one stopped
    not first unless it skipped rows (one line of 219 characters in a 4-rank run)."""
    from hpcps.train.stragglers import stalls_said

    stalls = [{"rank": r, "worker": r - 1, "clocks_late": late, "pushes_dropped": 0, "pushes_deferred": late,
               "rows_skipped": 0} for r, late in ((3, 47), (1, 25), (2, 10), (5, 9), (4, 3))]  # (agree_on_stalls' order)
    said = stalls_said(stalls)
    assert said.startswith("rank 3: 0 rows skipped, late at 47 clocks (pushes 47 deferred); rank 1: ")
    assert "rank 4" not in said and said.endswith("; 2 more (stalled_workers in --summary-json)")


def test_the_bench_says_the_fraction_of_the_stop_recovered_beside_the_ratio():
    """``hpcps bench backup``'s figure that does not depend on the job's length: (b = 0's median
    - b = 1's) / the stop's seconds."""
    jobs = {b: [{"wall_s": w, "test_logloss": 0.4, "examples": 1, "rows_skipped": r}] for b, w, r in ((0, 21.0, 0), (1, 15.0, 9))}
    r = {"rows": 30_000, "stop_s": 5.0, "at_step": 50, "batch_size": 20, "epochs": 1, "repeats": 1, "jobs": jobs,
         "median_wall_s": {0: 21.0, 1: 15.0}, "median_test_logloss": {0: 0.4, 1: 0.4}, "b1_over_b0": 15 / 21,
         "stop_recovered": 6 / 5, "logloss_b1_minus_b0": 0.0}
    assert "0.71x wall (29% sooner, 1.20 of the stop recovered)" in bench_backup.format_results(r)
    r["median_end_after_cont_s"] = {0: 2.5, 1: 0.2}
    assert "ended a median 0.20 s (b = 1) and 2.50 s (b = 0) after rank 3 continued" in bench_backup.format_results(r)


# -- real jobs: 1 server + 3 workers, rank 3 stopped for a few seconds ---------------------------

ROWS, EPOCHS = 12_000, 2  # 4,000 rows a worker, 200 steps of 20 an epoch


def stalled_job(tmp, data, name: str, b: int, stop_s: float) -> tuple[dict, str]:
    """A 4-rank job of two epochs (``cluster.backup_workers = b``, the model written to
    ``tmp/name.h5``); rank 3 is stopped (SIGSTOP) for ``stop_s`` seconds once the first worker is
    past step 20 (``hpcps bench backup``'s job). Returns (its summary, its output)."""
    files = {"train_libsvm": data[0], "test_libsvm": data[1]}
    _, summary, out = bench_backup.stalled_job(files, str(tmp), name, b, stop_s, 20, {
        "train.batch_size": 20, "train.epochs": EPOCHS, "train.model_out": json.dumps(str(tmp / f"{name}.h5"))}, timeout=240)
    return summary, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The data, and the b = 0 job run without a stop."""
    tmp = tmp_path_factory.mktemp("backup")
    info = synth.generate(str(tmp / "data"), ROWS, 2_000, fields=10, seed=5, formats=("libsvm",))
    data = info.files["train_libsvm"], info.files["test_libsvm"]
    summary, _ = stalled_job(tmp, data, "ref", 0, 0)
    return tmp, data, summary


def test_b_0_waits_for_a_stopped_worker_and_trains_the_same_model(reference):
    tmp, data, ref = reference
    summary, _ = stalled_job(tmp, data, "b0", 0, 3)
    assert "stalled_workers" not in summary and summary["examples"] == EPOCHS * ROWS
    a, b = ServingModel(str(tmp / "b0.h5")), ServingModel(str(tmp / "ref.h5"))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)  # every push applied, in the same order


def test_b_1_goes_on_without_a_stopped_worker_and_names_it(reference):
    tmp, data, ref = reference
    summary, out = stalled_job(tmp, data, "b1", 1, 5)
    stalls = {s["rank"]: s for s in summary["stalled_workers"]}
    assert stalls[3]["clocks_late"] > 0 and stalls[3]["pushes_deferred"] > 0, stalls
    # every row was trained on or counted as skipped
    assert summary["examples"] + sum(s["rows_skipped"] for s in stalls.values()) == EPOCHS * ROWS
    assert abs(summary["test_logloss"] - ref["test_logloss"]) < 0.005
    assert "stalled workers" in out and "rank 3: " in out


def test_b_1_with_checkpoints_goes_on_without_a_stopped_worker_and_resumes(reference, tmp_path):
    """With ``checkpoint.dir`` the workers agreed at every step whether to checkpoint (a
    collective), so a stopped worker held every other one there: it skipped no row. Now the first
    worker writes its periodic checkpoints alone (hpcps.train.quorum_checkpoints): some are written
    while rank 3 is stopped, rank 3 skips rows as without checkpoints, and a run resumed from one
    written then (every worker from its position) ends at the same step with a close model."""
    tmp, data, ref = reference
    files, ck, times = {"train_libsvm": data[0], "test_libsvm": data[1]}, tmp_path / "ck", {}
    sets = {"train.batch_size": 20, "train.epochs": EPOCHS, "checkpoint.dir": json.dumps(str(ck)),
            "checkpoint.every_steps": 10, "checkpoint.keep": 1000}
    _, summary, out = bench_backup.stalled_job(files, str(tmp_path), "ck", 1, 5, 20, sets, timeout=240, times=times)
    stalls = {s["rank"]: s for s in summary["stalled_workers"]}
    assert stalls[3]["rows_skipped"] > 0, stalls
    manifests = {d: json.load(open(ck / d / "manifest.json")) for d in sorted(os.listdir(ck))}
    during = [d for d in manifests if times["stop"] < os.path.getmtime(ck / d / "manifest.json") < times["cont"]]
    assert during and all(m["clock"] == m["position"]["global_step"] for m in manifests.values()), manifests
    last = manifests[max(manifests)]["position"]["global_step"]
    _, resumed, _ = bench_backup.stalled_job(files, str(tmp_path), "resumed", 1, 0, 0, {
        **sets, "checkpoint.dir": json.dumps(str(tmp_path / "ck2")), "checkpoint.resume": json.dumps(str(ck / during[0]))},
        timeout=240)
    assert 0 < resumed["examples"] < EPOCHS * ROWS
    assert json.load(open(resumed["checkpoint"] + "/manifest.json"))["position"]["global_step"] == last
    assert abs(resumed["test_logloss"] - ref["test_logloss"]) < 0.005


def signalled_job(tmp, data, sets: dict, sig: int, rank: int | tuple, at: int) -> tuple[int, str, int]:
    """A 4-rank job of ``cluster.backup_workers = 1`` and ``sets`` (key: TOML value); ``sig`` (0:
    none) sent to rank ``rank`` alone (or to each of a tuple of ranks) once the first worker is past
    step ``at``, every rank stopped (SIGSTOP) meanwhile, so that the step the signal lands at is
    known: the first worker's last reported global step then (-1 without a signal; its report is
    at most ``HPCPS_TUNE_STATUS_EVERY_S`` old). Returns (its exit status, its output, that step)."""
    status, summary = tmp / "status.json", tmp / f"summary-{time.monotonic_ns()}.json"
    sets = {"data.train": json.dumps(data[0]), "data.test": json.dumps(data[1]), "train.progress": "false",
            "cluster.backup_workers": 1, **sets}
    cmd = [mpiexec_command(), "-n", "4", sys.executable, "-m", "hpcps.cli", "train", "--summary-json", str(summary),
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HPCPS_TUNE_STATUS_EVERY_S="0.01", **{STATUS_ENV: str(status)}))
    try:
        deadline = time.monotonic() + 120
        while sig and read_status(str(status)).get("global_step", -1) < at and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        landed = -1
        if sig and proc.poll() is None:  # (under load the job runs on many steps between a report and a kill)
            pids = [bench_backup.rank_pid(str(summary), r) for r in range(4)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                landed = read_status(str(status)).get("global_step", -1)
                for r in rank if isinstance(rank, tuple) else (rank,):
                    os.kill(pids[r], sig)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, landed


def test_a_signal_to_one_worker_is_agreed_by_every_worker_and_resume_finishes(reference, tmp_path):
    """Under backup workers the workers no longer agree at each step whether to checkpoint: a stop
    signal to worker rank 2 alone is told to the servers, which report it to the other workers, so
    it is agreed within a few steps, at the latest before the loop's next collective (an evaluation
    every 60 steps), every worker moved to the same clock; the signal's checkpoint is written
    there, the job exits 75, and --resume auto trains on from it to the last step."""
    tmp, data, ref = reference
    ck = tmp_path / "ck"
    sets = {"train.batch_size": 20, "train.epochs": EPOCHS, "train.eval_every": 60, "checkpoint.dir": json.dumps(str(ck))}
    rc, out, landed = signalled_job(tmp_path, data, sets, signal.SIGTERM, 2, 30)
    assert rc == 75, out[-3000:]
    (name,) = os.listdir(ck)
    m = json.load(open(ck / name / "manifest.json"))
    pos = m["position"]
    assert m["reason"] == "signal" and m["clock"] == pos["global_step"], m
    # after the signal, no later than the evaluation after it (the signal landed within a few steps
    # of the report read: 60 steps where it is read before step 50, as it is unless under load)
    evaluation = 60 * -(-(landed + 10) // 60)
    assert 30 < pos["step"] <= evaluation + 1, (pos, landed)
    rc, out, _ = signalled_job(tmp_path, data, {**sets, "checkpoint.resume": '"auto"'}, 0, 0, 0)
    assert rc == 0 and f"resuming from {ck / name}" in out, out[-3000:]
    last = json.load(open(ck / max(os.listdir(ck)) / "manifest.json"))
    assert last["reason"] == "end of training" and last["position"]["epoch"] == EPOCHS + 1


def test_a_signal_to_more_workers_than_b_is_told_to_the_servers_and_nobody_waits_for_a_clock():
    """The rules: a stop known to a server (a worker's STOPPING, or its own signal) under backup
    workers answers every read at once until the signal's checkpoint; a signal forwarded is
    reported as the server's own but is not its own (its own SIGTERM after it is no second one)."""
    from hpcps.ps import signals
    w = WorkerClocks(3, 0, Backup(1))
    w.advance(0, 5)  # (worker 0 ahead, workers 1 and 2 at clock 0: stopped in the agreement)
    assert not w.ready(pull(5))
    w.stopping = True
    assert w.ready(pull(5))
    assert signals.requested() is None
    signals.forwarded(signal.SIGUSR1)
    signals.forwarded(signal.SIGTERM)
    assert signals.requested() == signal.SIGTERM and signals._state["signal"] is None
    signals.clear()
    assert signals.requested() is None
    msg = protocol.Stopping(7, 2, int(signal.SIGTERM))
    words = protocol.request_words(msg.pack())
    got = protocol.MESSAGES[words[0]].unpack(list(words), None, [], None)
    assert (type(got), got.clock, got.worker, got.signal) == (protocol.Stopping, 7, 2, signal.SIGTERM)


def test_a_signal_to_two_of_three_workers_with_b_1_stops_the_job_with_its_checkpoint(reference, tmp_path):
    """SIGTERM to two of the three workers (more than b = 1, as a scheduler's preemption signal to
    some ranks): the two join the agreement at once and push nothing more, so the clock a third
    worker ahead waits for never completes. They tell the servers first (STOPPING), which answer
    every read at once and report the stop: the third joins after its step, and the job writes the
    signal's checkpoint at one clock for all and exits 75 (it stalled until
    ``cluster.stall_timeout_s`` and died without a checkpoint before)."""
    tmp, data, ref = reference
    ck = tmp_path / "ck"
    sets = {"train.batch_size": 20, "train.epochs": EPOCHS, "checkpoint.dir": json.dumps(str(ck)),
            "cluster.stall_timeout_s": 40, "cluster.stall_warn_s": 20}
    rc, out, _ = signalled_job(tmp_path, data, sets, signal.SIGTERM, (2, 3), 30)
    assert rc == 75, out[-3000:]
    (name,) = os.listdir(ck)
    m = json.load(open(ck / name / "manifest.json"))
    assert m["reason"] == "signal" and m["clock"] == m["position"]["global_step"] > 30, m
    assert "StallError" not in out, out[-3000:]


def test_the_chaos_kill_schedule_with_b_1_finishes_with_a_finite_model_near_the_reference(tmp_path):
    """tests/test_chaos.py's kill schedule under ``supervise`` (checkpoints, --resume auto: a late
    worker's data position is the others' step) with a backup worker, its first kill -9 only (the
    cost): exit 0, every weight finite, test logloss within 0.005 of the run without kills (not bit
    for bit: which pushes come late depends on timing)."""
    out = chaos_run(tmp_path, {"cluster.backup_workers": 1}, check=close_model, kills=1)
    assert "stalled workers" in out
