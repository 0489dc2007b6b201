"""``hpcps bench backup``: backup workers against a stalled worker (issue 41's target), in one run.

Runs ``mpiexec -n 4 hpcps train`` (1 server + 3 workers, BSP) on synthetic rows; once the first
worker is past step ``--at``, worker rank 3 is stopped (SIGSTOP) for ``--stop-s`` seconds, then
continued (SIGCONT); ``--stop-s 0`` stops nothing (what backup workers do on a loaded machine alone). Jobs with ``cluster.backup_workers = 0`` and ``= 1`` alternate ``--repeats``
times, so that both meet the same load on the machine. Reports each job's wall time (the whole
job: start-up, training, the end), the medians and their ratio (b = 1 over b = 0), the fraction of
the stop recovered (``(b = 0's median - b = 1's) / stop_s``: 1 when b = 1 loses none of the stop's
seconds, more when the stalled worker's skipped rows save work too; it does not depend on the job's
length, as the ratio does), each job's test logloss and the rows the stalled worker skipped.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from hpcps import outputs
from hpcps.bench.vw import mpiexec_command
from hpcps.train import synth
from hpcps.train.progress import STATUS_ENV, read_status


def rank_pid(marker: str, rank: int) -> int | None:
    """The PID of MPI rank ``rank`` of the job whose command line holds ``marker`` (from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"PMI_RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    return None


def stalled_job(files: dict, out_dir: str, name: str, b: int, stop_s: float, at: int, settings: dict,
                timeout: float = 1800, times: dict | None = None) -> tuple:
    """One 4-rank job with ``cluster.backup_workers = b`` and ``settings`` (key: TOML value), rank 3
    stopped ``stop_s`` seconds once the first worker is past step ``at`` (0: never), killed after
    ``timeout`` seconds; ``times``: gets the job's ``start``, the stop's (``stop``, ``cont``) and the
    job's ``end`` (``time.time()``). Returns (its wall time, its summary, its output); a failed job
    raises RuntimeError with its output's end."""
    summary, status = os.path.join(out_dir, f"summary-{name}.json"), os.path.join(out_dir, f"status-{name}.json")
    for path in (summary, status):
        if os.path.exists(path):
            os.remove(path)
    sets = {"data.train": json.dumps(files["train_libsvm"]), "data.test": json.dumps(files["test_libsvm"]),
            "train.progress": "false", "cluster.backup_workers": b, **settings}
    cmd = [mpiexec_command(), "-n", "4", sys.executable, "-m", "hpcps.cli", "train", "--summary-json", summary,
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    start, times = time.perf_counter(), {} if times is None else times
    times["start"] = time.time()
    # (the status file written every 10 ms, not every 0.2 s: rank 3 stopped near step ``at``, not
    # some hundred steps later)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"HPCPS_TUNE_STATUS_EVERY_S": "0.01", **os.environ, "PYTHONUNBUFFERED": "1",
                                 STATUS_ENV: status})
    try:
        pid = None
        while stop_s and pid is None and proc.poll() is None and time.perf_counter() - start < timeout:
            if read_status(status).get("global_step", -1) >= at:
                pid = rank_pid(summary, 3)
            time.sleep(0.02)
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            times["stop"] = time.time()
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            times["cont"] = time.time()
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall, times["end"] = time.perf_counter() - start, time.time()
    if proc.returncode != 0 or (stop_s and pid is None):
        raise RuntimeError(f"hpcps bench backup: the job {name} (b = {b}) exited {proc.returncode}"
                           f"{'' if pid or not stop_s else ' before rank 3 could be stopped'}:\n{out[-2000:]}")
    return wall, json.load(open(summary)), out


def digest(wall: float, summary: dict, times: dict) -> dict:
    """A job's figures in the results: wall time, test logloss, rows trained and skipped, and when
    rank 3 was stopped and the job ended after it continued (``times``: :func:`stalled_job`'s)."""
    stopped = "cont" in times
    return {"wall_s": wall, "test_logloss": summary["test_logloss"], "examples": summary["examples"],
            "rows_skipped": sum(w["rows_skipped"] for w in summary.get("stalled_workers", [])),
            "stop_at_s": times["stop"] - times["start"] if stopped else 0.0,
            "end_after_cont_s": times["end"] - times["cont"] if stopped else 0.0}


def run(out_dir: str, rows: int, test_rows: int, stop_s: float, repeats: int, at: int = 50, batch_size: int = 20,
        epochs: int = 1) -> dict:
    """The jobs' wall times, alternating b = 0 and b = 1, and the medians' ratio."""
    os.makedirs(out_dir, exist_ok=True)
    info = synth.generate(os.path.join(out_dir, "data"), rows, test_rows, fields=10, seed=5, formats=("libsvm",),
                          overwrite=True)
    jobs: dict[int, list[dict]] = {0: [], 1: []}
    for i in range(repeats):
        for b in (0, 1):
            times: dict = {}
            r = digest(*stalled_job(info.files, out_dir, f"b{b}", b, stop_s, at,
                                    {"train.batch_size": batch_size, "train.epochs": epochs}, times=times)[:2], times)
            jobs[b].append(r)
            print(outputs.dumps({"repeat": i + 1, "backup_workers": b, **{k: round(v, 5) for k, v in r.items()}}),
                  flush=True)
    med = {b: statistics.median(r["wall_s"] for r in jobs[b]) for b in jobs}
    loss = {b: statistics.median(r["test_logloss"] for r in jobs[b]) for b in jobs}
    return {"rows": rows, "stop_s": stop_s, "at_step": at, "batch_size": batch_size, "epochs": epochs,
            "repeats": repeats, "jobs": jobs, "median_wall_s": med, "median_test_logloss": loss,
            "b1_over_b0": med[1] / med[0], "stop_recovered": (med[0] - med[1]) / stop_s if stop_s else None,
            "median_end_after_cont_s": {b: statistics.median(r["end_after_cont_s"] for r in jobs[b]) for b in jobs},
            "logloss_b1_minus_b0": loss[1] - loss[0]}


def format_results(r: dict) -> str:
    out = [f"{r['rows']:,} rows, mpiexec -n 4 hpcps train (1 server + 3 workers, BSP), {r['epochs']} epoch(s) of "
           f"batch {r['batch_size']}; rank 3 stopped {r['stop_s']:g} s after step {r['at_step']}; "
           f"{r['repeats']} runs each, alternating",
           f"{'backup_workers':<15} {'wall s (each)':>24} {'median s':>9} {'test logloss':>13} {'rows skipped':>13}"]
    for b in (0, 1):
        each = " ".join(f"{j['wall_s']:.2f}" for j in r["jobs"][b])
        skipped = statistics.median(j["rows_skipped"] for j in r["jobs"][b])
        out.append(f"{b:<15} {each:>24} {r['median_wall_s'][b]:>9.2f} {r['median_test_logloss'][b]:>13.5f} "
                   f"{skipped:>13,.0f}")
    recovered = "" if r.get("stop_recovered") is None else f", {r['stop_recovered']:.2f} of the stop recovered"
    out.append(f"b = 1 / b = 0 (medians): {r['b1_over_b0']:.2f}x wall ({1 - r['b1_over_b0']:.0%} sooner{recovered}), "
               f"test logloss {r['logloss_b1_minus_b0']:+.5f}")
    if r["stop_s"] and "median_end_after_cont_s" in r:  # (b = 1 can end no sooner: mpiexec waits for rank 3)
        after = r["median_end_after_cont_s"]
        out.append(f"the jobs ended a median {after[1]:.2f} s (b = 1) and {after[0]:.2f} s (b = 0) after rank 3 "
                   f"continued (stopped at {statistics.median(j.get('stop_at_s', 0) for j in r['jobs'][1]):.2f} s "
                   f"of b = 1's)")
    return "\n".join(out)
