"""A lost server's new backups copied over the wire (issue 40, item 2), measured: how long the copy
takes (rows a second) and how long training stands still, beside the same kill where no copy is
needed.

    .venv/bin/python docs/measure-rereplication.py DATA.svm [--kill-at 700] [--runs 3] [--work DIR]
        [--staleness -1|2]

Each run, under ULFM (``.venv-ft``'s ``mpiexec --with-ft ulfm``), trains one epoch of DATA (FTRL,
batch 100, BSP, or SSP/ASP with ``--staleness 2`` or ``-1``: the copies cut at the workers' notices,
each from its source's shadow of the moved rows, whose pushes and their time are counted) with
``cluster.replicas = 1`` and 2 workers, and kills server 1 with kill -9 once
the first worker has done ``--kill-at`` steps: with 3 servers (the survivors copy each other the
new backups of the lost server's shards) and with 2 (each survivor holds every shard: promotion
only), alternating. Per run: the exit status; the stall, the longest the first worker's step
stood still from the kill to the end (its status file, written at every step); and with 3
servers each copy's rows and seconds from the source's cut to its landing (the targets' lines).
The medians are printed at the end. Use data with many keys (``hpcps gen-data DIR --rows 200000``:
about 200 k keys on the servers by step 700).

    .venv/bin/python docs/measure-rereplication.py --shadow-costs

measures a source's shadow (SSP, ASP) in process instead: its making over a 200 k-key FTRL table
with a third of the shards moved, and its apply of a push beside the table's own (medians of 40
alternating pushes of 100, 1,000 and 10,000 keys).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_checkpoint import rank_pids  # noqa: E402
from test_faults import wait_for  # noqa: E402
from test_ulfm import longest_stall  # noqa: E402

FT = os.path.join(ROOT, ".venv-ft")
LANDED = re.compile(r"landed from server \d+ \((\d+) rows, ([0-9.]+) s")
SHADOW = re.compile(r"cut at the workers' notices \((\d+) pushes sent before their notices applied to its shadow "
                    r"in ([0-9.]+) s, (\d+) sent after")


def run(data: str, servers: int, kill_at: int, work: str, staleness: int = 0) -> tuple[int, float, list, list]:
    """One job killed at step ``kill_at``: (exit status, stall in seconds, [(rows, seconds)] of its
    copies, [(pushes before their notices, their seconds, pushes after)] of each source's shadow
    under SSP and ASP)."""
    os.makedirs(work)
    sets = {"data.train": json.dumps(data), "train.batch_size": 100, "train.epochs": 1, "train.progress": "false",
            "cluster.servers": servers, "cluster.fault_tolerance": '"ulfm"', "optimizer.name": '"ftrl"',
            "cluster.replicas": 1, "cluster.staleness": staleness, "checkpoint.dir": json.dumps(work + "/ck")}
    status = pathlib.Path(work) / "status.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HPCPS_STATUS_FILE=str(status), HPCPS_TUNE_STATUS_EVERY_S="0")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    with open(work + "/out.log", "w") as out:
        proc = subprocess.Popen([f"{FT}/bin/mpiexec", *root, "--oversubscribe", "--with-ft", "ulfm", "-n",
                                 str(servers + 2), f"{FT}/bin/python", "-m", "hpcps.cli", "train",
                                 *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)

    def at_the_kill() -> bool:
        try:
            step = json.loads(status.read_text()).get("global_step", 0)
        except (OSError, ValueError):
            step = 0
        return step >= kill_at and len(rank_pids(work + "/ck", "OMPI_COMM_WORLD_RANK")) == servers + 2

    try:
        if not wait_for(at_the_kill, 600, proc) or proc.poll() is not None:
            raise SystemExit(f"the job never reached step {kill_at}: {work}/out.log")
        os.kill(rank_pids(work + "/ck", "OMPI_COMM_WORLD_RANK")[1], signal.SIGKILL)
        stall = longest_stall(status, proc, time.monotonic())
        proc.wait(600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = open(work + "/out.log").read()
    return (proc.returncode, stall, [(int(m[1]), float(m[2])) for m in LANDED.finditer(text)],
            [(int(m[1]), float(m[2]), int(m[3])) for m in SHADOW.finditer(text)])


def shadow_costs() -> None:
    """A shadow's making and its apply of a push beside the table's own (in process)."""
    import numpy as np

    from hpcps.ps.rereplication import Shadow
    from hpcps.ps.server_table import ServerTable
    from hpcps.ps.tables import TableSpec

    rng = np.random.default_rng(0)
    table = ServerTable(TableSpec("w", dim=1, optimizer="ftrl", key_bits=24))
    keys = np.unique(rng.integers(1, 1 << 24, 200_000, dtype=np.uint64))
    table.push(keys, rng.normal(size=(keys.shape[0], 1)).astype(np.float32))
    started = time.perf_counter()
    shadow = Shadow([table], list(range(0, 1024, 3)), 1024)
    print(f"a shadow of {shadow.tables[0].size} rows made in {time.perf_counter() - started:.4f} s")
    for n in (100, 1000, 10000):
        own, shadowed = [], []
        for _ in range(41):
            k = np.sort(rng.choice(keys, n, replace=False))
            g = rng.normal(size=(n, 1)).astype(np.float32)
            for times, push in ((own, lambda: table.push(k, g, 0)), (shadowed, lambda: shadow.push(0, k, g, 0))):
                t = time.perf_counter()
                push()
                times.append(time.perf_counter() - t)
        own, shadowed = own[1:], shadowed[1:]  # (the first: compiling)
        print(f"{n} keys: the table's apply {statistics.median(own) * 1e6:.1f} us, the shadow's "
              f"{statistics.median(shadowed) * 1e6:.1f} us, "
              f"{statistics.median(b / a for a, b in zip(own, shadowed)):.2f}x (median of the pairs)")


def main() -> None:
    if sys.argv[1:] == ["--shadow-costs"]:
        shadow_costs()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--kill-at", type=int, default=700)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default=None)
    ap.add_argument("--staleness", type=int, default=0, help="0 BSP, -1 ASP, s > 0 SSP")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="hpcps-rerep-")
    stalls: dict[int, list[float]] = {2: [], 3: []}
    copies, shadows = [], []
    for i in range(a.runs):
        for servers in (2, 3):
            rc, stall, landed, shadowed = run(os.path.abspath(a.data), servers, a.kill_at, f"{work}/s{servers}-{i}",
                                          a.staleness)
            print(json.dumps({"servers": servers, "exit": rc, "stall_s": round(stall, 3), "copies": landed,
                              **({"shadows": shadowed} if a.staleness else {})}), flush=True)
            shadows += shadowed
            stalls[servers].append(stall)
            copies += landed
    ratios = [b / a for a, b in zip(stalls[2], stalls[3])]
    print(f"stall median: 3 servers (copies) {statistics.median(stalls[3]):.3f} s, 2 servers (promotion only) "
          f"{statistics.median(stalls[2]):.3f} s, pairs {statistics.median(ratios):.2f}x (median)")
    if copies:
        print(f"copy: median {statistics.median(t for _, t in copies):.3f} s for "
              f"{statistics.median(n for n, _ in copies):.0f} rows, "
              f"{statistics.median(n / t for n, t in copies if t > 0):,.0f} rows/s (median of {len(copies)})")
    if shadows:
        print(f"a source's shadow (SSP, ASP): median {statistics.median(n for n, _, _ in shadows):.0f} pushes before "
              f"their notices applied in {statistics.median(t for _, t, _ in shadows):.4f} s, "
              f"{statistics.median(m for _, _, m in shadows):.0f} sent after (median of {len(shadows)} sources)")


if __name__ == "__main__":
    main()
