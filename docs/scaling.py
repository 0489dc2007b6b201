#!/usr/bin/env python
"""The scaling model of hpcps (hpcps/train/scaling.py): its tables, its picture, and its fit.
Explained in docs/scaling.md.

    python docs/scaling.py                      # the tables, and docs/scaling.png (needs matplotlib)
    python docs/scaling.py --measured docs/scaling-measured.json docs/scaling-measured-16core.json --out docs/scaling.png
    python docs/scaling.py fit --ps PS.jsonl... --mpi MPI.jsonl... --job JOB.json... [--batch 1000]
                               [--cores 2] [--requests worker] [--mpi-hosts MPI-HOSTS.jsonl...]
                               [--job-hosts JOB-HOSTS.json...]
    python docs/scaling.py fit-terms [--write]  # the job's terms on the 16-core node's points, left out in turn
    python docs/scaling.py fit-polls [--write]  # the servers' poll share on this machine's points, its table

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
from dataclasses import replace
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


@lru_cache(maxsize=None)
def auto(nodes: int, requests: str = "worker") -> scaling.Choice:
    """The layout auto picks on ``nodes`` nodes of 16 ranks (25 Gb/s Ethernet) with ``requests``
    ("worker", "group", or "auto": either, as hpcps train picks them: group pulls only on several hosts)."""
    j, m = cluster(nodes, requests="worker" if requests == "auto" else requests)
    both = ("worker", "group") if requests == "auto" and nodes > 1 else ()
    return scaling.choose(nodes * 16, j, m, requests=both)


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
    for requests in ("worker", "group", "auto"):
        for nodes in AUTO_NODES:
            c = auto(nodes, requests)
            lines.append(_row(f"{nodes} nodes: S={c.servers}, g={c.group}, B={c.batch}, {requests}"
                              + (f" ({c.requests})" if requests == "auto" else ""), c.step))
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
        ys = [auto(int(n), requests).step["examples_per_s"] for n in nodes]
        what = "a pull per worker" if requests == "worker" else "one request per server per group"
        a.plot(nodes, ys, "-", color=color, marker=".", label=f"auto layout, {what}")
    ys = [auto(int(n), "auto").step["examples_per_s"] for n in nodes]
    a.plot(nodes, ys, "-", color="k", lw=0.8, label="auto layout as hpcps train picks it (group pulls from 2 nodes)")
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
            b.annotate(p["name"].removeprefix("16 cores: "), (x, y), fontsize=7, xytext=(4, (4, -10, 14)[i % 3]), textcoords="offset points")
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


NODE = os.path.join(ROOT, "docs", "scaling-measured-16core.json")
LADDER = ("16 cores: 1S+3W", "16 cores: 2S+6W", "16 cores: 4S+12W", "16 cores: 8 separate 1S+1W at once")


def _ratios(points: list[dict], m: Machine) -> list[float]:
    return [p["examples_per_s"] / step(Job(**p["job"]), m)["examples_per_s"] for p in points]


def fit_terms_command(args) -> None:
    """The job's terms from a node's points: fitted on all of them (written to scaling.py's
    JOB_TERMS and the points' machine with --write), on the first run's (LADDER) to check on the
    later runs', and each point left out in turn: a table of measured / modelled for each."""
    points = _read_json(args.points)
    m0 = Machine(**points[0]["machine"])
    fit_of = [p for p in points if p["name"] != args.rate_point]
    pairs = lambda ps: [(Job(**p["job"]), p["examples_per_s"]) for p in ps]  # noqa: E731
    terms = scaling.fit_job_terms(pairs(fit_of), m0, args.rate_of)
    ladder = scaling.fit_job_terms(pairs([p for p in fit_of if p["name"] in LADDER]), m0, args.rate_of)
    print("fitted on all:", {k: f"{v:.4g}" for k, v in terms.items()})
    print("fitted on the first run's (1S+3W, 2S+6W, 4S+12W, 8 at once):", {k: f"{v:.4g}" for k, v in ladder.items()})
    loo = {}
    for i, p in enumerate(fit_of):
        t = scaling.fit_job_terms(pairs(fit_of[:i] + fit_of[i + 1:]), m0, args.rate_of)
        loo[p["name"]] = _ratios([p], replace(m0, **t))[0]
    new, first = replace(m0, **terms), replace(m0, **ladder)
    print("\n| point | measured | fitted on all | on the first run's | left out |\n|---|---|---|---|---|")
    for p in points:
        a, f = _ratios([p], new)[0], _ratios([p], first)[0]
        lo = f"{loo[p['name']]:.2f}×" if p["name"] in loo else "(the rate's)"
        print(f"| {p['name'].removeprefix('16 cores: ')} | {p['examples_per_s']:,} ex/s | {a:.2f}× | {f:.2f}× | {lo} |")
    if args.write:
        for p in points:
            p["machine"]["worker_rows_per_s"] = float(f"{terms['worker_rows_per_s']:.4g}")
        with open(args.points, "w") as f:
            f.write(json.dumps(points, indent=1) + "\n")
        with open(args.module) as f:
            source = f.read()
        job_terms = {k: terms[k] for k in scaling.JOB_TERMS}
        with open(args.module, "w") as f:
            f.write(scaling.fitted_source(source, job_terms, scaling.JOB_TERMS_BLOCK, "JOB_TERMS"))
        print(f"wrote {os.path.relpath(args.module)} and {os.path.relpath(args.points)}")


HERE_POINTS = os.path.join(ROOT, "docs", "scaling-measured.json")


def fit_polls_command(args) -> None:
    """The servers' poll share (scaling.POLLS) from this machine's points' loops' CPU seconds
    (written with --write), and the table of measured / modelled: each point with the share
    fitted on all of them, and with the share fitted on the others (left out)."""
    points = _read_json(args.points)
    runs = [(Job(**p["job"]), Machine(**p.get("machine", {})), p) for p in points]
    try:
        share = scaling.fit_poll_share(runs)
    except ValueError as e:  # (no point on hosts: the table with the share as it is)
        share, args.write = Machine().server_poll_share, False
        print(f"{e}: server_poll_share kept at {share:.4g}")
    print(f"server_poll_share: {share:.4g} (each point's on hosts: "
          + ", ".join(f"{p['name']} {x:.2f}" for j, m, p in runs for x in [scaling.poll_share_of(j, m, p)]
                      if x is not None and j.crossing_share() > 0) + ")")
    print("\n| point | measured (loop), runs | model | measured / model | left out | load before | model's bottleneck |"
          "\n|---|---|---|---|---|---|---|")
    for i, (j, m, p) in enumerate(runs):
        try:
            alone = scaling.fit_poll_share(runs[:i] + runs[i + 1:])
        except ValueError:  # (no other point to fit on: the share as it is)
            alone = m.server_poll_share
        r, lo = step(j, replace(m, server_poll_share=share)), step(j, replace(m, server_poll_share=alone))
        spread = f" ({min(p['runs']) / 1e3:,.0f} k-{max(p['runs']) / 1e3:,.0f} k)" if p.get("runs") else ""
        load = f"{min(p['load']):.1f}-{max(p['load']):.1f}" if p.get("load") else "-"
        print(f"| {p['name']} | {p['examples_per_s']:,} ex/s{spread} | {r['examples_per_s']:,.0f} ex/s | "
              f"{p['examples_per_s'] / r['examples_per_s']:.2f}× | {p['examples_per_s'] / lo['examples_per_s']:.2f}× | "
              f"{load} | {r['bottleneck']} |")
    if args.write:
        with open(args.module) as f:
            source = f.read()
        with open(args.module, "w") as f:
            f.write(scaling.fitted_source(source, {"server_poll_share": share}, scaling.POLLS_BLOCK, "POLLS"))
        print(f"wrote {os.path.relpath(args.module)}")


def main() -> None:
    if sys.argv[1:2] == ["fit-terms"]:
        ap = argparse.ArgumentParser(prog="scaling.py fit-terms", description="fit the job's terms on a node's points")
        ap.add_argument("--points", default=NODE, help="the node's points (JSON, with its constants)")
        ap.add_argument("--rate-point", default="16 cores: 1S+1W", help="the point of the fit's 1+1 (not fitted on)")
        ap.add_argument("--rate-of", type=float, default=427130.0,
                        help="the examples/s of the fit's 1 server + 1 worker jobs (the model's 1+1 stays there)")
        ap.add_argument("--write", action="store_true", help="write JOB_TERMS and the points' worker rate")
        ap.add_argument("--module", default=os.path.join(ROOT, "hpcps", "train", "scaling.py"))
        return fit_terms_command(ap.parse_args(sys.argv[2:]))
    if sys.argv[1:2] == ["fit-polls"]:
        ap = argparse.ArgumentParser(prog="scaling.py fit-polls",
                                     description="fit the servers' poll share on this machine's points")
        ap.add_argument("--points", default=HERE_POINTS, help="the points (JSON, as docs/measure-scaling.sh writes)")
        ap.add_argument("--write", action="store_true", help="write POLLS in hpcps/train/scaling.py")
        ap.add_argument("--module", default=os.path.join(ROOT, "hpcps", "train", "scaling.py"))
        return fit_polls_command(ap.parse_args(sys.argv[2:]))
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
