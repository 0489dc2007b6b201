"""Issue 40's restart target, measured: "without ULFM, a supervised job is back in its training loop
within 5 s of a kill -9 and loses at most the last delta interval".

    .venv/bin/python docs/measure-restart.py [--keys 10000000] [--runs 3] [--delta-s 2] [--backoff 0]

1. Data whose keys are all distinct (``--keys`` of them, 40 a row, 40-bit keys), and one job of
   1 server + 2 workers (FTRL, batch 100, BSP) that trains an epoch of it and writes a full
   checkpoint: a table of ``--keys`` keys.
2. Each run: a copy of that checkpoint, then ``hpcps supervise --backoff B -- mpiexec -n 3 hpcps
   train ... --resume auto`` for `--epochs` - 1 more epochs (default 2) with ``checkpoint.delta_every_s``; once it has
   trained ``--kill-after-s`` seconds and written two snapshots, and then a share of the delta
   interval more (run i of n: (i + 0.5) / n of it, so the runs see different losses), a kill -9
   of the server. The times,
   all from the same clock: the kill; the old ``mpiexec``'s end (the job seen dead, what the
   supervisor waits for); the relaunch (the supervisor resets its status file just before it starts
   the job again); the restarted job's first training step (the first worker's first status
   write, made at its first step), and the CPU time the restarted server and first worker had
   used by then. Steps lost: the last step the first worker reported before the
   kill (its status is written every ``HPCPS_TUNE_STATUS_EVERY_S``, 0.02 s here) minus the step
   the restart resumes at (the supervisor's line), against the steps between the deltas the run
   wrote; and in seconds, from the moment the job had reached the step resumed to the kill.
3. The restarted job is stopped (SIGTERM) a second after its first step; the median and the
   maximum over the runs are printed, and every run as one JSON line in WORK/runs.jsonl.

Run it with the checkout's environment (it reads the status file through hpcps); ``--python``
names the environment whose mpiexec and hpcps run the jobs (default: this checkout's .venv).
``--backoff`` is the supervisor's (default 0 here: the restart at once; ``hpcps supervise``'s
own default, 5 s, adds itself to every figure).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from hpcps.train.progress import read_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS_A_ROW = 40


def write_data(path: str, keys: int, seed: int) -> None:
    """Rows of 40 distinct 40-bit keys each, no key in two rows: an epoch makes a table of ``keys``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    rows = keys // KEYS_A_ROW
    # distinct keys: an odd multiplier is a bijection modulo 2^40
    all_keys = (np.arange(1, rows * KEYS_A_ROW + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 | 1)) & np.uint64(2**40 - 1)
    labels = rng.integers(0, 2, rows)
    with open(path, "w") as f:
        for lo in range(0, rows, 20000):
            block = all_keys[lo * KEYS_A_ROW:(lo + 20000) * KEYS_A_ROW].reshape(-1, KEYS_A_ROW)
            f.write("".join(f"{labels[lo + i]} " + " ".join(f"{k}:1" for k in r.tolist()) + "\n"
                            for i, r in enumerate(block)))


def train_args(work: str, ckdir: str, epochs: int, delta_s: float) -> list[str]:
    sets = {"data.train": f'"{work}/train.svm"', "data.test": f'"{work}/test.svm"', "data.hash_bits": 40,
            "train.batch_size": 100, "train.epochs": epochs, "train.progress": "false",
            "checkpoint.dir": f'"{ckdir}"', "checkpoint.every_steps": 0, "checkpoint.delta_every_s": delta_s,
            "checkpoint.full_every": 10}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def rank_pid(status_path: str, rank: int, variable: str = "PMI_RANK") -> int | None:
    """The PID of the hpcps rank ``rank`` of the job whose supervisor writes ``status_path`` (the
    launcher's rank ``variable``: MPICH's PMI_RANK, Open MPI's OMPI_COMM_WORLD_RANK)."""
    want = {f"HPCPS_STATUS_FILE={status_path}".encode(), f"{variable}={rank}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = set(open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if want <= env and b"hpcps" in cmd and b"mpiexec" not in cmd and b"hydra" not in cmd:
            return int(pid)
    return None


def cpu_s(pid: int | None) -> float | None:
    """The CPU seconds (user + system) a process has used so far."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def snapshots(ckdir: str) -> list[int]:
    """The steps of the committed snapshots (full and delta) in ``ckdir``, in order."""
    return sorted(int(m.group(1)) for p in glob.glob(f"{ckdir}/*-*")
                  if (m := re.search(r"/(?:ckpt|delta)-(\d+)$", p)) and os.path.exists(f"{p}/manifest.json"))


def start(args, work: str, i: int):
    """Run ``i``'s supervised job on a copy of the base checkpoint: (supervisor, its output file,
    the checkpoint directory, the status file)."""
    ckdir = f"{work}/ck-{i}"
    shutil.rmtree(ckdir, ignore_errors=True)
    shutil.copytree(f"{work}/base", ckdir)
    status = f"{work}/status-{i}.json"
    if os.path.exists(status):
        os.remove(status)  # (an earlier run's)
    env = dict(os.environ, HPCPS_STATUS_FILE=status, HPCPS_TUNE_STATUS_EVERY_S="0.02", PYTHONUNBUFFERED="1")
    out = open(f"{work}/run-{i}.out", "w")
    sup = subprocess.Popen([args.bin + "/hpcps", "supervise", "--max-restarts", "1", "--backoff", str(args.backoff),
                            "--", args.bin + "/mpiexec", "-n", "3", args.bin + "/hpcps", "train",
                            *train_args(work, ckdir, args.epochs, args.delta_s), "--resume", "auto"],
                           env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return sup, out, ckdir, status


def one_run(args, work: str, i: int) -> dict:
    sup, out, ckdir, status = start(args, work, i)
    try:
        base = snapshots(ckdir)
        first, n_base = None, len(base)
        seen = []  # (time, step) of the first worker's status writes: when each step was reached
        due = None  # trained --kill-after-s seconds since the first step and two snapshots written,
        # then a share of an interval on (a different one each run: the loss depends on it)
        while due is None or time.time() < due:
            st = read_status(status)
            if "global_step" in st and (not seen or seen[-1][1] != st["global_step"]):
                seen.append((st["time"], st["global_step"]))
            if "global_step" in st and first is None:
                first = st["time"]
            if (due is None and first and time.time() - first > args.kill_after_s
                    and len(snapshots(ckdir)) > n_base + 1):
                due = time.time() + args.delta_s * (args.phase if args.phase is not None else (i + 0.5) / args.runs)
            if sup.poll() is not None:
                raise SystemExit(f"run {i}: the job ended before the kill (see {work}/run-{i}.out)")
            time.sleep(0.01)
        old_mpiexec = children(sup.pid)[0]
        server = rank_pid(status, 0)
        before = read_status(status).get("global_step", 0)
        t_kill = time.time()
        os.kill(server, signal.SIGKILL)
        # this run's snapshots committed by the kill (a write under way then is lost with the job)
        snaps = [base[-1], *(s for s in snapshots(ckdir) if s > base[-1])]
        t_exit = t_reset = t_first = None
        resumed_status: dict = {}
        cpu: dict = {}
        while t_first is None:
            now = time.time()
            if t_exit is None and not os.path.exists(f"/proc/{old_mpiexec}"):
                t_exit = now
            st = read_status(status)
            if "global_step" in st and t_reset is None:
                before = max(before, st["global_step"])  # (a last write of the dying job)
            elif "global_step" not in st and st and t_reset is None:
                t_reset = st["time"]
            elif "global_step" in st and t_reset is not None:
                t_first, resumed_status = st["time"], st
                # the CPU the restarted server and first worker used to get there (wall time less
                # the waits for a core the other jobs here hold)
                cpu = {"server_cpu_s": cpu_s(rank_pid(status, 0)), "worker_cpu_s": cpu_s(rank_pid(status, 1))}
            if now - t_kill > 120 or sup.poll() is not None:
                raise SystemExit(f"run {i}: no restart within 120 s (see {work}/run-{i}.out)")
            time.sleep(0.005)
        time.sleep(1)
    finally:
        if sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(sup.pid, signal.SIGKILL)
                sup.wait()
        out.close()
    text = open(f"{work}/run-{i}.out").read()
    m = re.search(r"resuming at step (\d+)", text)
    resumed = int(m.group(1)) if m else None
    # the work lost in seconds: from the moment the job reached the step resumed to the kill
    reached = next((t for t, step in seen if resumed is not None and step >= resumed), None)
    gaps = [b - a for a, b in zip(snaps[1:], snaps[2:])]  # (the run's first snapshot comes at its first step)
    shutil.rmtree(ckdir, ignore_errors=True)
    return {"run": i, "load": os.getloadavg()[0], "kill_to_first_step_s": t_first - t_kill,
            "detection_s": (t_exit or t_reset) - t_kill, "relaunch_s": t_reset - t_kill,
            "relaunch_to_first_step_s": t_first - t_reset, "step_at_kill": before, "resumed_at": resumed,
            "first_step_after": resumed_status.get("global_step"), "steps_lost": before - resumed if resumed is not None else None,
            "lost_s": t_kill - reached if reached is not None else None,
            "delta_interval_steps": statistics.median(gaps) if gaps else None, "snapshots_before_kill": snaps, **cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--delta-s", type=float, default=2.0)
    p.add_argument("--backoff", type=float, default=0.0, help="hpcps supervise --backoff")
    p.add_argument("--kill-after-s", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=3, help="train.epochs of the supervised jobs (the base checkpoint "
                   "holds the first): more where the machine trains the rest before the kill")
    p.add_argument("--phase", type=float, default=None,
                   help="kill this share of the delta interval after the second snapshot (default: (i + 0.5) / runs)")
    p.add_argument("--work", default="", help="work directory (default: a new one under /tmp); kept")
    p.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    args = p.parse_args()
    args.bin = os.path.dirname(args.python)
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(ROOT, ".numba_cache"))
    work = args.work or tempfile.mkdtemp(prefix="hpcps-restart.")
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(f"{work}/base"):
        t = time.time()
        write_data(f"{work}/train.svm", args.keys, 1)
        write_data(f"{work}/test.svm", 40 * 1000, 2)
        print(f"data: {args.keys} keys in {time.time() - t:.0f} s", flush=True)
        t = time.time()
        subprocess.run([args.bin + "/mpiexec", "-n", "3", args.bin + "/hpcps", "train",
                        *train_args(work, f"{work}/base", 1, args.delta_s)], check=True, stdout=subprocess.DEVNULL)
        print(f"the {args.keys}-key checkpoint: {time.time() - t:.0f} s ({work}/base)", flush=True)
    runs = []
    with open(f"{work}/runs.jsonl", "a") as f:
        for i in range(args.runs):
            r = one_run(args, work, i)
            runs.append(r)
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
    for k in ("kill_to_first_step_s", "detection_s", "relaunch_s", "relaunch_to_first_step_s", "server_cpu_s",
              "worker_cpu_s", "steps_lost", "lost_s", "delta_interval_steps"):
        v = [r[k] for r in runs if r[k] is not None]
        if v:
            print(f"{k}: median {statistics.median(v):.3g}, max {max(v):.3g} ({', '.join(f'{x:.3g}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
