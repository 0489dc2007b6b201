#!/usr/bin/env python
"""The scaling model of hpcps: bytes, messages and time per training step, and where the
bottleneck moves as servers and workers grow. Explained in docs/scaling.md.

    python docs/scaling.py                      # the tables, and docs/scaling.png (needs matplotlib)
    python docs/scaling.py --measured docs/scaling-measured.json --out docs/scaling.png

Pure NumPy (matplotlib for the picture): nothing here imports hpcps, so the model can be read and
changed on its own. The machine constants are those measured on the 2-core machine the project is
developed on (``hpcps bench ps``, ``hpcps bench mpi``, ``hpcps bench vw``); change them to your own.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Machine:
    cores: int = 2                     # cores the ranks share (None of the hosts below adds any)
    server_keys_per_s: float = 30e6    # one server core, lookup + optimizer, dim 1 (bench ps: 25-40 M)
    server_coords_per_s: float = 93e6  # FTRL coordinate updates per second beyond the lookup (dim > 1)
    worker_rows_per_s: float = 400e3   # one worker core: parse + unique + gradient, 39 fields: fitted
                                       # to the 1 server + 1 worker point measured here (bench vw's
                                       # loop on 1.5 M rows suggests 600 k)
    link_bytes_per_s: float = 3.0e9    # per host: TCP between namespaces here (bench mpi, blocking)
    latency_s: float = 15e-6           # one-way message latency (bench mpi, 8 bytes, across hosts)
    straggler_cv: float = 0.10         # spread of a worker's step time (coefficient of variation)
    request_s: float = 40e-6           # fixed cost of one request on a server, and on the worker that
                                       # sent it (bench ps: a 1,000-key round trip takes 0.25-0.3 ms of
                                       # which the keys are 0.03 ms; Python, packing, the wait's wake-up)


@dataclass(frozen=True)
class Job:
    servers: int = 1
    workers: int = 1
    group: int = 1                     # workers per group (their pushes are merged before sending)
    batch: int = 1000                  # rows per worker per step
    fields: int = 39                   # nonzeros per row
    dim: int = 1                       # floats per key (1 = LR; FM: 1 + factors)
    staleness: int = 0                 # 0 = BSP, s = SSP, -1 = ASP
    dense_bytes: int = 0               # an MLP allreduced inside each group (deep models)
    hosts: int = 1                     # hosts the ranks are spread over (1 = shared memory)


@lru_cache(maxsize=None)
def unique_keys(rows: int, fields: int = 39, seed: int = 0) -> float:
    """Distinct keys in ``rows`` rows of the generated Zipf data (``hpcps gen-data``: each field
    Zipf(1.25) over a vocabulary between 10 and 10^6, 0-20 % missing), by sampling."""
    rng = np.random.default_rng(12345)
    vocab = np.geomspace(10, 1_000_000, fields).astype(np.int64)[rng.permutation(fields)]
    missing = rng.uniform(0.0, 0.2, fields)
    rng = np.random.default_rng(seed)
    n = min(rows, 200_000)
    tokens = (rng.zipf(1.25, size=(n, fields)) - 1) % vocab[None, :]
    present = rng.random((n, fields)) >= missing[None, :]
    keys = tokens.astype(np.int64) * fields + np.arange(fields)[None, :]
    u = float(np.unique(keys[present]).size)
    return u * rows / n if rows > n else u  # beyond the sample: linear (an over-estimate)


def step(job: Job, m: Machine) -> dict:
    """One step of every worker: the bytes and messages, each part's time and the slowest."""
    S, W, g, d = job.servers, job.workers, job.group, job.dim
    groups = max(1, W // g)
    u = unique_keys(job.batch, job.fields)                 # a worker's pull
    ug = unique_keys(job.batch * g, job.fields)            # a group's merged push
    key_bytes, row_bytes = 8, 4 * d
    pull_bytes = u * key_bytes + u * row_bytes             # keys out, rows back
    push_bytes = ug * (key_bytes + row_bytes) / g          # a worker's share of its group's push
    worker_bytes = pull_bytes + push_bytes
    touched = S * (1 - (1 - 1 / S) ** u)                   # servers holding some of a worker's keys
    touched_g = S * (1 - (1 - 1 / S) ** ug)
    messages = 2 * touched + 2 * touched_g / g             # pull and push, request and reply
    # a server's work per step: every worker's pull and every group's push, spread over S
    per_key = 1.0 / m.server_keys_per_s + (d - 1) / m.server_coords_per_s
    server_keys = (W * u + groups * ug) / S
    server_requests = (W * touched + groups * touched_g) / S
    server_s = server_keys * per_key + server_requests * m.request_s
    worker_s = job.batch / m.worker_rows_per_s
    remote = job.hosts > 1
    bw = m.link_bytes_per_s if remote else 10e9            # shared memory: 10 GB/s
    lat = m.latency_s if remote else 5e-6
    # bytes through one host's link per step: its servers' traffic (both ways) or its workers'
    server_host_bytes = (W * pull_bytes + groups * ug * (key_bytes + row_bytes)) / S * max(1, S / job.hosts)
    net_s = server_host_bytes / bw if remote else 0.0
    own_s = (2 * (2 * lat) + worker_bytes / bw + u / S * per_key   # a worker's round trips, served
             + (touched + touched_g / g) * m.request_s)
    allreduce_s = (2 * (g - 1) / g * job.dense_bytes / bw + 2 * (g - 1) * lat) if g > 1 else 0.0
    spread = m.straggler_cv * worker_s * math.sqrt(2 * math.log(W)) if W > 1 else 0.0
    straggler_s = 0.0 if job.staleness < 0 else spread / (job.staleness + 1)
    # every rank shares the cores: the CPU work of a step cannot take less than this
    ranks = S + W
    worker_cpu_s = worker_s + (touched + touched_g / g) * m.request_s
    cpu_s = (W * worker_cpu_s + S * server_s) / min(m.cores, ranks)
    parts = {"worker compute + round trips": worker_s + own_s, "server keys + requests": server_s, "network": net_s,
             "CPU shared by ranks": cpu_s}
    slowest = max(parts, key=parts.get)
    t = parts[slowest] + allreduce_s + straggler_s
    return {"step_s": t, "examples_per_s": W * job.batch / t, "bottleneck": slowest, **parts,
            "allreduce": allreduce_s, "stragglers": straggler_s, "unique_per_worker": u,
            "server_requests": server_requests, "keys_per_request": u / touched,
            "bytes_per_worker": worker_bytes, "messages_per_worker": messages}


def cluster(nodes: int, ranks_per_node: int = 16, server_share: float = 0.25, staleness: int = 0,
            dim: int = 1, group: int = 1, dense_bytes: int = 0, batch: int = 1000) -> tuple[Job, Machine]:
    """A cluster of ``nodes`` nodes of ``ranks_per_node`` cores, 25 Gb/s Ethernet, a quarter of
    the ranks servers."""
    ranks = nodes * ranks_per_node
    S = max(1, round(ranks * server_share))
    m = Machine(cores=ranks, link_bytes_per_s=25e9 / 8, latency_s=5e-6)
    return Job(servers=S, workers=ranks - S, group=group, staleness=staleness, dim=dim, dense_bytes=dense_bytes,
               hosts=nodes, batch=batch), m


def servers_for(features: float, dim: int, node_bytes: float = 128e9, ranks_per_node: int = 16) -> int:
    """Server ranks whose memory holds ``features`` keys: 4 bytes per float, FTRL's two state
    floats per float, 1.5x for the table's slack and keys (per rank: a node's memory / its ranks)."""
    per_key = 4 * dim * 3 * 1.5 + 8
    return math.ceil(features * per_key / (node_bytes * 0.8 / ranks_per_node))


def tables() -> str:
    lines = ["Where the time of a step goes (BSP, batch 1000, 39 fields, dim 1), per job:", ""]
    hdr = (f"{'job':<34} {'unique/worker':>13} {'KB/worker':>10} {'msgs':>6} {'keys/msg':>8} {'step ms':>8} "
           f"{'examples/s':>14}  bottleneck")
    lines.append(hdr)
    here = Machine()
    rows = [("here: 1 server + 1 worker", Job(1, 1), here),
            ("here: 1 server + 3 workers", Job(1, 3), here),
            ("here: 2 hosts, 1 server + 1 worker", Job(1, 1, hosts=2), here)]
    for nodes in (1, 10, 100, 1000):
        for s in (0, 2):
            job, m = cluster(nodes, staleness=s)
            rows.append((f"{nodes} nodes x 16, S={job.servers}, {'BSP' if s == 0 else f'SSP {s}'}", job, m))
        job, m = cluster(nodes, group=12)
        rows.append((f"{nodes} nodes, BSP, groups of 12", job, m))
        job, m = cluster(nodes, server_share=1 / 16, group=15)
        rows.append((f"{nodes} nodes, S={job.servers} (1/node), groups 15", job, m))
        job, m = cluster(nodes, group=12, batch=10_000)
        rows.append((f"{nodes} nodes, groups of 12, batch 10k", job, m))
    for name, job, m in rows:
        r = step(job, m)
        lines.append(f"{name:<34} {r['unique_per_worker']:>13,.0f} {r['bytes_per_worker'] / 1e3:>10.1f} "
                     f"{r['messages_per_worker']:>6.0f} {r['keys_per_request']:>8.1f} {r['step_s'] * 1e3:>8.2f} "
                     f"{r['examples_per_s']:>14,.0f}  "
                     f"{r['bottleneck']}" + (f" (+{r['stragglers'] * 1e3:.2f} ms stragglers)" if r['stragglers'] else ""))
    lines += ["", "Server ranks whose memory holds the model (128 GB nodes of 16 ranks):"]
    for feats in (1e8, 1e9, 1e10):
        lines.append(f"  {feats:.0e} keys: LR {servers_for(feats, 1):>5} ranks, FM k=8 {servers_for(feats, 9):>5} ranks")
    return "\n".join(lines)


def draw(out: str, measured: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    nodes = np.unique(np.geomspace(1, 1000, 25).astype(int))
    for share, style in ((0.25, "-"), (1 / 16, "--")):
        for s, color in ((0, "C0"), (2, "C1")):
            ys = [step(*cluster(n, server_share=share, staleness=s))["examples_per_s"] for n in nodes]
            a.plot(nodes, ys, style, color=color, label=f"{'BSP' if s == 0 else 'SSP 2'}, servers {share:.0%} of ranks")
    ys = [step(*cluster(n, group=12, batch=10_000))["examples_per_s"] for n in nodes]
    a.plot(nodes, ys, "-", color="C2", label="BSP, servers 25%, groups of 12, batch 10,000")
    one = step(*cluster(1))["examples_per_s"]
    a.plot(nodes, one * nodes, ":", color="gray", label="linear from 1 node")
    a.set(xscale="log", yscale="log", xlabel="nodes (16 ranks each, 25 Gb/s)", ylabel="examples/s (model)",
          title="The model: LR, batch 1000, 39 Zipf fields")
    a.legend(fontsize=8)
    if measured:
        pred = [step(Job(**p["job"]), Machine(**p.get("machine", {})))["examples_per_s"] for p in measured]
        got = [p["examples_per_s"] for p in measured]
        b.scatter(pred, got, color="C3")
        for p, x, y in zip(measured, pred, got):
            b.annotate(p["name"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        lo, hi = min(pred + got) * 0.7, max(pred + got) * 1.4
        b.plot([lo, hi], [lo, hi], ":", color="gray", label="model = measured")
        b.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="model examples/s",
              ylabel="measured examples/s (training loop)", title="This machine: 2 cores, 1-4 ranks, 1-3 hosts")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default="docs/scaling-measured.json", help="points measured here (JSON list)")
    ap.add_argument("--out", default="docs/scaling.png")
    args = ap.parse_args()
    print(tables())
    try:
        with open(args.measured) as f:
            measured = json.load(f)
    except FileNotFoundError:
        measured = []
    for p in measured:
        r = step(Job(**p["job"]), Machine(**p.get("machine", {})))
        print(f"measured {p['name']}: {p['examples_per_s']:,.0f} examples/s, model {r['examples_per_s']:,.0f} "
              f"({p['examples_per_s'] / r['examples_per_s']:.2f}x), bottleneck {r['bottleneck']}")
    try:
        draw(args.out, measured)
        print(f"wrote {args.out}")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install 'hpcps[plot]')")


if __name__ == "__main__":
    main()

