#!/usr/bin/env python
"""The scaling model of hpcps (hpcps/train/scaling.py): its tables, its picture, and its fit.
Explained in docs/scaling.md.

    python docs/scaling.py                      # the tables, and docs/scaling.png (needs matplotlib)
    python docs/scaling.py --measured docs/scaling-measured.json docs/scaling-measured-16core.json --out docs/scaling.png
    python docs/scaling.py fit --ps PS.jsonl... --mpi MPI.jsonl... --job JOB.json... [--batch 1000]
                               [--cores 2] [--requests worker] [--mpi-hosts MPI-HOSTS.jsonl...]
                               [--job-hosts JOB-HOSTS.json...]

``fit`` reads what ``mpiexec -n 2 hpcps bench ps --json``, ``mpiexec -n 2 hpcps bench mpi --json``
and 2-rank ``hpcps train ... --summary-json JOB.json`` runs wrote (medians over the files of each)
and rewrites the fitted constants (``FITTED``) in hpcps/train/scaling.py; ``bash
docs/measure-scaling.sh`` runs them three times each, the fit, then the points it compares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import lru_cache

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hpcps.train import scaling  # noqa: E402
from hpcps.train.scaling import Job, Machine, cluster, step  # noqa: E402

NODES = (1, 10, 100, 1000)
AUTO_NODES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@lru_cache(maxsize=None)
def zipf_unique_keys(rows: int, fields: int = 39, seed: int = 0) -> float:
    """Distinct keys in ``rows`` rows of the generated Zipf data (``hpcps gen-data``: each field
    Zipf(1.25) over a vocabulary between 10 and 10^6, 0-20 % missing), by sampling: the points of
    ``scaling.ZIPF_KEYS``."""
    rng = np.random.default_rng(12345)
    vocab = np.geomspace(10, 1_000_000, fields).astype(np.int64)[rng.permutation(fields)]
    missing = rng.uniform(0.0, 0.2, fields)
    rng = np.random.default_rng(seed)
    tokens = (rng.zipf(1.25, size=(rows, fields)) - 1) % vocab[None, :]
    present = rng.random((rows, fields)) >= missing[None, :]
    keys = tokens.astype(np.int64) * fields + np.arange(fields)[None, :]
    return float(np.unique(keys[present]).size)


def auto(nodes: int, **job) -> scaling.Choice:
    """The layout auto picks on ``nodes`` nodes of 16 ranks (25 Gb/s Ethernet)."""
    j, m = cluster(nodes, **job)
    return scaling.choose(nodes * 16, j, m)


def _row(name: str, r: dict) -> str:
    return (f"{name:<40} {r['unique_per_worker']:>13,.0f} {r['bytes_per_worker'] / 1e3:>10.1f} "
            f"{r['messages_per_worker']:>6.0f} {r['keys_per_request']:>8.1f} {r['step_s'] * 1e3:>8.2f} "
            f"{r['examples_per_s']:>14,.0f}  {r['bottleneck']}"
            + (f" (+{r['stragglers'] * 1e3:.2f} ms stragglers)" if r['stragglers'] else ""))


def tables() -> str:
    lines = [f"Machine: {Machine()}", "", "Where the time of a step goes (BSP unless named, 39 fields, dim 1), per job:",
             "", f"{'job':<40} {'unique/worker':>13} {'KB/worker':>10} {'msgs':>6} {'keys/msg':>8} {'step ms':>8} "
             f"{'examples/s':>14}  bottleneck"]
    here = Machine()
    rows = [("here: 1 server + 1 worker", Job(1, 1), here), ("here: 1 server + 3 workers", Job(1, 3), here),
            ("here: 2 hosts, 1 server + 1 worker", Job(1, 1, hosts=2), here)]
    for nodes in NODES:
        for s in (0, 2):
            job, m = cluster(nodes, staleness=s)
            rows.append((f"{nodes} nodes x 16, S={job.servers}, {'BSP' if s == 0 else f'SSP {s}'}", job, m))
        job, m = cluster(nodes, group=12, batch=10_000)
        rows.append((f"{nodes} nodes, S={job.servers}, groups of 12, batch 10k", job, m))
    lines += [_row(name, step(job, m)) for name, job, m in rows]
    lines += ["", "The layout auto picks (cluster.layout = \"auto\"), 16 ranks a node:", ""]
    for requests in ("worker", "group"):
        for nodes in AUTO_NODES:
            c = auto(nodes, requests=requests)
            lines.append(_row(f"{nodes} nodes: S={c.servers}, g={c.group}, B={c.batch}, {requests}", c.step))
    lines += ["", "Server ranks whose memory holds the model (128 GB nodes of 16 ranks):"]
    for feats in (1e8, 1e9, 1e10):
        lines.append(f"  {feats:.0e} keys: LR {scaling.servers_for(feats, 1):>5} ranks, "
                     f"FM k=8 {scaling.servers_for(feats, 9):>5} ranks")
    return "\n".join(lines)


def predicted(point: dict) -> dict:
    """The model's step for a measured point (its job; the constants of its machine where the point
    gives them, a 16-core node's, else this module's, and its cores)."""
    return step(Job(**point["job"]), Machine(**point.get("machine", {})))


def draw(out: str, measured: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    nodes = np.unique(np.geomspace(1, 1000, 25).astype(int))
    for requests, color in (("worker", "C0"), ("group", "C2")):
        ys = [auto(n, requests=requests).step["examples_per_s"] for n in nodes]
        what = "a pull per worker" if requests == "worker" else "one request per server per group"
        a.plot(nodes, ys, "-", color=color, marker=".", label=f"auto layout, {what}")
    ys = [step(*cluster(n))["examples_per_s"] for n in nodes]
    a.plot(nodes, ys, "--", color="C0", label="servers 25 % of ranks, no groups, batch 1000")
    a.plot(nodes, ys[0] * nodes, ":", color="gray", label="linear from 1 node (fixed layout)")
    a.axhline(100e6, color="C3", lw=0.8, ls="-.", label="target: 100 M examples/s at 1,000 nodes")
    a.set(xscale="log", yscale="log", xlabel="nodes (16 ranks each, 25 Gb/s)", ylabel="examples/s (model)",
          title="The model: LR, FTRL, 39 Zipf fields")
    a.legend(fontsize=8)
    if measured:
        pred = [predicted(p)["examples_per_s"] for p in measured]
        got = [p["examples_per_s"] for p in measured]
        b.scatter(pred, got, c=["C1" if p.get("machine", {}).get("cores", 2) > 2 else "C3" for p in measured])
        for i, (p, x, y) in enumerate(zip(measured, pred, got)):  # (labels of close points apart)
            b.annotate(p["name"], (x, y), fontsize=7, xytext=(4, (4, -10, 14)[i % 3]), textcoords="offset points")
        lo, hi = min(pred + got) * 0.6, max(pred + got) * 1.5
        b.plot([lo, hi], [lo, hi], ":", color="gray", label="model = measured")
        b.fill_between([lo, hi], [0.7 * lo, 0.7 * hi], [1.3 * lo, 1.3 * hi], color="gray", alpha=0.15,
                       label="0.7-1.3x")
        b.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="model examples/s",
              ylabel="measured examples/s (training loop)",
              title="Measured: 2 cores, 1-3 hosts (red); a 16-core node (orange)")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _json_lines(path: str) -> list[dict]:
    """The JSON objects of a file of lines (a bench's --json output; other lines are skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.lstrip().startswith("{")]


def fit_command(args) -> None:
    jobs = [_read_json(p) for p in args.job]
    fitted = scaling.fit([r for p in args.ps for r in _json_lines(p)], [r for p in args.mpi for r in _json_lines(p)],
                         jobs, args.batch, args.cores, args.requests,
                         [r for p in args.mpi_hosts or [] for r in _json_lines(p)],
                         [_read_json(p) for p in args.job_hosts or []])
    path = args.module
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:
        f.write(scaling.fitted_source(source, fitted))
    for k, v in fitted.items():
        print(f"{k:<24} {v if isinstance(v, str) else f'{v:.4g}'}")
    print(f"wrote {os.path.relpath(path)}")


def main() -> None:
    if sys.argv[1:2] == ["fit"]:
        ap = argparse.ArgumentParser(prog="scaling.py fit", description="re-fit the model's constants")
        ap.add_argument("--ps", nargs="+", required=True,
                        help="files of mpiexec -n 2 hpcps bench ps --json --sizes 100,1000,10000,100000")
        ap.add_argument("--mpi", nargs="+", required=True, help="files of mpiexec -n 2 hpcps bench mpi --json")
        ap.add_argument("--mpi-hosts", nargs="+",
                        help="files of hpcps bench mpi --json between two hosts that share the cores (the "
                             "namespace hosts): the CPU of a message between hosts; without: kept as it is")
        ap.add_argument("--job-hosts", nargs="+",
                        help="--summary-json files of the --job jobs with the server and the worker on two such "
                             "hosts: the CPU of a byte between hosts; without: bench mpi's (or kept as it is)")
        ap.add_argument("--job", nargs="+", required=True,
                        help="--summary-json files of 2-rank hpcps train jobs (1 server, 1 worker)")
        ap.add_argument("--batch", type=int, default=1000, help="the job's train.batch_size")
        ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the job's ranks shared")
        ap.add_argument("--requests", choices=("worker", "group"), default=scaling.FITTED["requests"],
                        help="how the code sends requests: a pull per worker (worker) or one request per "
                             "server per group for pull and push (group)")
        ap.add_argument("--module", default=os.path.join(ROOT, "hpcps", "train", "scaling.py"),
                        help="the file whose FITTED constants are rewritten")
        return fit_command(ap.parse_args(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", nargs="+", default=[os.path.join(ROOT, "docs", f"scaling-measured{s}.json")
                                                      for s in ("", "-16core")],
                    help="points measured (JSON lists: this machine's, a 16-core node's with its constants)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "scaling.png"))
    args = ap.parse_args()
    print(tables())
    try:
        measured = [p for path in args.measured for p in _read_json(path)]
    except FileNotFoundError:
        measured = []
    for p in measured:
        r = predicted(p)
        load = f", load {np.median(p['load']):.1f}" if p.get("load") else ""
        print(f"measured {p['name']}: {p['examples_per_s']:,.0f} examples/s, model {r['examples_per_s']:,.0f} "
              f"({p['examples_per_s'] / r['examples_per_s']:.2f}x), bottleneck {r['bottleneck']}{load}")
    try:
        draw(args.out, measured)
        print(f"wrote {args.out}")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install 'hpcps[plot]')")


if __name__ == "__main__":
    main()
