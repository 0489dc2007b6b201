"""Issue 40's failover target, measured: "with ULFM and one replica, a server's kill -9 stalls
training for at most 2 s, and nothing is lost", on a 10 M-key FTRL table.

    .venv/bin/python docs/measure-failover.py [--keys 10000000] [--runs 3] [--kill-after-s 3] [--data DIR]

1. Data whose keys are all distinct (``--keys`` of them, 40 a row) and a full checkpoint of one
   epoch over it, a table of ``--keys`` keys: made as ``docs/measure-restart.py`` makes them (its
   work directory can be given as ``--data``: its ``train.svm``, ``test.svm`` and ``base/``).
2. Under Open MPI's ULFM (.venv-ft, ``mpiexec --with-ft ulfm``), jobs of 2 servers with
   ``cluster.replicas = 1`` (each holds every shard) and 2 workers, FTRL, batch 100, BSP, resumed
   from that checkpoint (each server loads the whole table) for ``--epochs`` - 1 more epochs: one
   left alone (the reference; ``--no-reference`` skips it), then ``--runs`` in which server 1
   (rank 1) is killed with kill -9 once the job has trained ``--kill-after-s`` seconds.
3. The first worker writes its status at every step (``HPCPS_TUNE_STATUS_EVERY_S=0``), read here
   every 2 ms: the stall is the longest time its step stood still from the last step before the
   kill to the job's end (the step under way at the kill included), beside the median step before
   the kill. Also: the job's exit status, its "server lost" line, and its model file against the
   reference's, bit for bit. Each run is a JSON line (also in WORK/runs.jsonl); then medians and
   maxima.

Run it with the checkout's environment; ``--python`` names the fault-tolerant environment whose
``mpiexec`` and ``python`` run the jobs (default: this checkout's .venv-ft, ``make install-ft``).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcps.train.model_file import ServingModel
from hpcps.train.progress import read_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("measure_restart", os.path.join(ROOT, "docs", "measure-restart.py"))
restart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(restart)  # (its data, its base checkpoint, its /proc helpers)


def job(args, data: str, out_dir: str, status: str) -> subprocess.Popen:
    """A 4-rank ULFM job (servers 0 and 1 with one replica, workers 2 and 3) resumed from the base
    checkpoint, its model written into ``out_dir``."""
    base = sorted(p for p in glob.glob(f"{data}/base/ckpt-*") if os.path.exists(f"{p}/manifest.json"))[-1]
    sets = {"data.train": f'"{data}/train.svm"', "data.hash_bits": 40, "train.batch_size": 100,
            "train.epochs": args.epochs, "train.progress": "false", "cluster.servers": 2, "cluster.replicas": 1,
            "cluster.staleness": 0, "cluster.fault_tolerance": '"ulfm"', "train.model_out": f'"{out_dir}/model.h5"'}
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [args.bin + "/mpiexec", *root, "--oversubscribe", "--with-ft", "ulfm", "-n", "4", args.python, "-m",
           "hpcps.cli", "train", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")], "--resume", base]
    env = dict(os.environ, HPCPS_STATUS_FILE=status, HPCPS_TUNE_STATUS_EVERY_S="0", PYTHONUNBUFFERED="1")
    os.makedirs(out_dir, exist_ok=True)
    return subprocess.Popen(cmd, env=env, stdout=open(f"{out_dir}/out.txt", "w"), stderr=subprocess.STDOUT,
                            cwd=out_dir, start_new_session=True)


def watch(proc: subprocess.Popen, status: str, kill_after_s: float | None, timeout: float = 900) -> dict:
    """Follow the first worker's steps until the job ends; kill -9 server 1 once it has trained
    ``kill_after_s`` seconds (None: never). Returns the steps seen and the kill's time."""
    seen, t_kill, first, deadline = [], None, None, time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        st = read_status(status)
        now = time.time()
        if "global_step" in st and (not seen or seen[-1][1] != st["global_step"]):
            seen.append((now, st["global_step"]))  # (the time it was seen: the poll's resolution, 2 ms)
            first = first or now
        if kill_after_s is not None and t_kill is None and first and now - first > kill_after_s:
            pid = restart.rank_pid(status, 1, "OMPI_COMM_WORLD_RANK")
            if pid is None:
                raise SystemExit(f"no rank 1 of the job writing {status}")
            os.kill(pid, signal.SIGKILL)
            t_kill = time.time()
        time.sleep(0.002)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"the job writing {status} did not end within {timeout:.0f} s")
    return {"seen": seen, "t_kill": t_kill, "first": first}


def same_model(a: str, b: str) -> bool:
    """Whether two model files hold the same keys and rows, bit for bit (in any order)."""
    x, y = ServingModel(a).tables, ServingModel(b).tables

    def rows(t):
        order = np.argsort(t.keys)
        return t.keys[order], t.values[order].tobytes()

    return x.keys() == y.keys() and all(np.array_equal(rows(x[n])[0], rows(y[n])[0]) and rows(x[n])[1] == rows(y[n])[1]
                                        for n in x)


def one_run(args, data: str, work: str, i: int, reference: str | None) -> dict:
    out_dir, status = f"{work}/run-{i}", f"{work}/status-{i}.json"
    if os.path.exists(status):
        os.remove(status)
    t0 = time.time()
    proc = job(args, data, out_dir, status)
    w = watch(proc, status, args.kill_after_s)
    seen, t_kill = w["seen"], w["t_kill"]
    text = open(f"{out_dir}/out.txt").read()
    if t_kill is None:
        raise SystemExit(f"run {i}: the job ended before the kill (see {out_dir}/out.txt)")
    before = [b[0] - a[0] for a, b in zip(seen, seen[1:]) if b[0] < t_kill]
    last_before = max((t for t, _ in seen if t < t_kill), default=t_kill)
    after = [t for t, _ in seen if t >= t_kill]
    gaps = [b - a for a, b in zip([last_before, *after], after)]
    lost = [ln for ln in text.splitlines() if "server lost" in ln]
    model = f"{out_dir}/model.h5"
    return {"run": i, "load": os.getloadavg()[0], "exit": proc.returncode,
            "stall_s": max(gaps) if gaps else None, "kill_to_next_step_s": after[0] - t_kill if after else None,
            "step_median_s": statistics.median(before) if before else None,
            "step_at_kill": max((s for t, s in seen if t < t_kill), default=None),
            "steps_after_kill": len(after), "job_s": time.time() - t0,
            "trained_s_before_kill": t_kill - w["first"],
            "same_model": same_model(model, reference) if reference and os.path.exists(model) else None,
            "server_lost_line": lost[0].strip() if lost else None}


def prepare(args, data: str) -> None:
    """The data and the base checkpoint (as docs/measure-restart.py makes them), unless there."""
    os.makedirs(data, exist_ok=True)
    if os.path.exists(f"{data}/base"):
        return
    t = time.time()
    restart.write_data(f"{data}/train.svm", args.keys, 1)
    restart.write_data(f"{data}/test.svm", 40 * 1000, 2)
    print(f"data: {args.keys} keys in {time.time() - t:.0f} s", flush=True)
    t = time.time()
    main_bin = os.path.join(ROOT, ".venv", "bin")
    subprocess.run([main_bin + "/mpiexec", "-n", "3", main_bin + "/hpcps", "train",
                    *restart.train_args(data, f"{data}/base", 1, 2.0)], check=True, stdout=subprocess.DEVNULL,
                   timeout=1800)  # (a 10 M-key job: minutes, never hours)
    print(f"the {args.keys}-key checkpoint: {time.time() - t:.0f} s ({data}/base)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--python", default=os.path.join(ROOT, ".venv-ft", "bin", "python"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kill-after-s", type=float, default=3.0, help="seconds of training before the kill")
    p.add_argument("--epochs", type=int, default=2, help="train.epochs (the base checkpoint holds the first)")
    p.add_argument("--data", default="", help="a docs/measure-restart.py work directory to take the data and "
                   "base checkpoint from (default: made in the work directory)")
    p.add_argument("--no-reference", action="store_true", help="no uninterrupted run, no model compared")
    p.add_argument("--work", default="", help="work directory (default: a new one under /tmp); kept")
    args = p.parse_args()
    work, args.bin = args.work or tempfile.mkdtemp(prefix="hpcps-failover."), os.path.dirname(args.python)
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(ROOT, ".numba_cache"))
    data = args.data or work
    prepare(args, data)
    reference = None
    if not args.no_reference:
        t = time.time()
        status = f"{work}/status-ref.json"
        proc = job(args, data, f"{work}/ref", status)
        w = watch(proc, status, None)
        if proc.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed ({proc.returncode}): see {work}/ref/out.txt")
        reference = f"{work}/ref/model.h5"
        steps = [b[0] - a[0] for a, b in zip(w["seen"], w["seen"][1:])]
        print(json.dumps({"run": "reference", "job_s": time.time() - t, "load": os.getloadavg()[0],
                          "step_median_s": statistics.median(steps) if steps else None,
                          "longest_step_s": max(steps) if steps else None}), flush=True)
    runs = []
    with open(f"{work}/runs.jsonl", "a") as f:
        for i in range(args.runs):
            r = one_run(args, data, work, i, reference)
            runs.append(r)
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
    for k in ("stall_s", "kill_to_next_step_s", "step_median_s", "job_s", "load"):
        v = [r[k] for r in runs if r[k] is not None]
        if v:
            print(f"{k}: median {statistics.median(v):.3g}, max {max(v):.3g} ({', '.join(f'{x:.3g}' for x in v)})")
    print(f"exit statuses {[r['exit'] for r in runs]}; models equal to the reference: {[r['same_model'] for r in runs]}")
    return 0 if all(r["exit"] == 0 and r["same_model"] in (True, None) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
