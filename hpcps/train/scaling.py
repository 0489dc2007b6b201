"""The scaling model of one training step, and the layout ``cluster.layout = "auto"`` picks with it.

A step of every worker: the keys, bytes and requests it sends, the time each part of the job takes
(the workers' rows, the servers' keys and requests, the network, the cores the ranks share) and
which part is the slowest (docs/scaling.md explains each formula). :func:`choose` searches the
servers, the worker groups' size and the batch for the highest modelled throughput.

Pure Python and NumPy, no MPI: ``docs/scaling.py`` draws its tables and picture from it, and
``python docs/scaling.py fit`` re-fits :data:`FITTED` from ``hpcps bench ps``, ``hpcps bench mpi``
and a 2-rank job's summary (:func:`fit`).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

# The machine's constants: written by `python docs/scaling.py fit` (see fit()); edit them there.
# --- fitted: begin ---
FITTED = {
    "requests": "worker",
    "local_latency_s": 8.368e-06,
    "local_bytes_per_s": 4.86e+09,
    "server_pull_keys_per_s": 7.566e+07,
    "server_push_keys_per_s": 6.489e+07,
    "server_request_s": 8.912e-06,
    "worker_request_s": 0.0003416,
    "worker_rows_per_s": 1.271e+06,
    "worker_cpu_row_s": 1.61e-06,
    "server_cpu_step_s": 0.000327,
    "link_cpu_message_s": 3.81e-07,
    "link_cpu_byte_s": 2.468e-09,
}
# --- fitted: end ---

# The job's terms (see Machine): written by `python docs/scaling.py fit-terms` from the 16-core
# node's points (docs/scaling-measured-16core.json; see fit_job_terms).
# --- job terms: begin ---
JOB_TERMS = {
    "server_job_request_s": 0.0003354,
    "contention": 0.1842,
    "straggler_cv": 0.01361,
}
# --- job terms: end ---

# What a serving loop's polls take of the cores while it waits for requests across hosts (see
# shared_cores): written by `python docs/scaling.py fit-polls` from the loops' CPU seconds of the
# points measured on this machine (docs/scaling-measured.json; see fit_poll_share).
# --- poll share: begin ---
POLLS = {
    "server_poll_share": 0.3612,
}
# --- poll share: end ---


@dataclass(frozen=True)
class Machine:
    """What one core and one link do (the fitted constants, plus what a cluster is assumed to be)."""

    cores: int = 2                         # cores the ranks share, over all hosts
    server_pull_keys_per_s: float = FITTED["server_pull_keys_per_s"]  # a pull's keys: lookup and copy
    server_push_keys_per_s: float = FITTED["server_push_keys_per_s"]  # a push's keys: lookup and FTRL
    server_floats_per_s: float = 93e6      # each float of a key's row beyond the 3 of FTRL at dim 1
    server_request_s: float = FITTED["server_request_s"]  # a server's fixed cost of one request
    worker_request_s: float = FITTED["worker_request_s"]  # a worker's fixed cost of one round trip
    worker_rows_per_s: float = FITTED["worker_rows_per_s"]  # parse, unique and gradient, 39 fields
    # CPU seconds, for ranks that outnumber the cores (see shared_cores): a worker's per row (both
    # its threads: the training's and the parse thread's), and a server loop's per step beyond the
    # work server_s counts (receiving, replying, polling between requests), as a 1 server +
    # 1 worker job spends them
    worker_cpu_row_s: float = FITTED["worker_cpu_row_s"]
    server_cpu_step_s: float = FITTED["server_cpu_step_s"]
    # CPU seconds of a message between hosts beyond one within a host, a message and a byte, both
    # ends together (each rank's TCP stack: its system calls, copies and softirq work, and its polls
    # while the message moves): charged where hosts share the cores (see shared_cores)
    link_cpu_message_s: float = FITTED["link_cpu_message_s"]
    link_cpu_byte_s: float = FITTED["link_cpu_byte_s"]
    # the share of a core a server's loop takes while it waits for requests from other hosts (its
    # short sleeps between polls, each poll a pass over the TCP sockets), where the ranks outnumber
    # the cores (see shared_cores); within a host its polls are reads of shared memory: none counted
    server_poll_share: float = POLLS["server_poll_share"]
    local_bytes_per_s: float = FITTED["local_bytes_per_s"]  # between ranks of one host
    local_latency_s: float = FITTED["local_latency_s"]
    link_bytes_per_s: float = 25e9 / 8     # a host's link to the others (25 Gb/s Ethernet assumed)
    latency_s: float = 5e-6                # one way across hosts
    # Fitted on a 16-core node's jobs (docs/scaling.md, "A 16-core node"), not by `fit`: what a job's
    # step costs beyond the benches. A server's cost of a request in a job beyond bench ps's (the
    # requests of W workers that come together each step, their gradients' messages, the clock);
    # the contention of the ranks busy on one node (memory and caches shared): each rank's work
    # takes 1 + contention * (busy ranks - 2) / cores longer, 0 for the 2 ranks the rates are
    # fitted on; the spread of a worker's step time (coefficient of variation) for the stragglers
    server_job_request_s: float = JOB_TERMS["server_job_request_s"]
    contention: float = JOB_TERMS["contention"]
    straggler_cv: float = JOB_TERMS["straggler_cv"]


# Distinct keys in the first rows of `hpcps gen-data`'s Zipf data (each of 39 fields Zipf(1.25)
# over a vocabulary between 10 and 10^6, 0-20 % missing), sampled by docs/scaling.py's
# zipf_unique_keys: the curve used when the training data cannot be read ahead.
ZIPF_KEYS = ((100, 1749), (250, 3410), (500, 5548), (1000, 9070), (2000, 14749), (4000, 23968), (8000, 38927),
             (16000, 62532), (32000, 99196), (64000, 156624), (128000, 244802), (256000, 378237),
             (512000, 574926))


@dataclass(frozen=True)
class KeyCurve:
    """Distinct keys in a number of rows, from points measured on the data: interpolated in
    log-log, and beyond the last point a power law through the last two (Heaps' law)."""

    points: tuple = ZIPF_KEYS
    source: str = "the Zipf data of hpcps gen-data"

    @classmethod
    def of_csr(cls, indptr: np.ndarray, indices: np.ndarray, source: str) -> "KeyCurve":
        """The curve of rows given as CSR (``indices[indptr[i]:indptr[i + 1]]``: row i's keys),
        at 100, 200, 400, ... rows and all of them."""
        rows = indptr.shape[0] - 1
        counts = [n for n in (100 << i for i in range(40)) if n < rows] + [rows]
        points = tuple((n, max(1, int(np.unique(indices[:indptr[n]]).size))) for n in counts if n > 0)
        return cls(points or ((1, 1),), source)

    def __call__(self, rows: float) -> float:
        r = np.array([p[0] for p in self.points], float)
        u = np.array([p[1] for p in self.points], float)
        if rows <= r[0] or r.size == 1:
            return float(u[0] * min(1.0, rows / r[0]) if rows <= r[0] else u[0] * rows / r[0])
        if rows <= r[-1]:
            return float(np.exp(np.interp(math.log(rows), np.log(r), np.log(u))))
        slope = min(1.0, math.log(u[-1] / u[-2]) / math.log(r[-1] / r[-2]))
        return float(u[-1] * (rows / r[-1]) ** slope)


@dataclass(frozen=True)
class Job:
    servers: int = 1
    workers: int = 1
    group: int = 1                     # workers per group (their pushes are merged before sending)
    batch: int = 1000                  # rows per worker per step
    dim: int = 1                       # floats per key (1 = LR; FM: 1 + factors)
    state: int = 2                     # optimizer state floats per float (FTRL 2, AdaGrad 1, SGD 0)
    staleness: int = 0                 # 0 = BSP, s = SSP, -1 = ASP
    dense_bytes: int = 0               # an MLP allreduced inside each group (deep models)
    hosts: int = 1                     # hosts the ranks are spread over (1 = shared memory)
    tables: int = 1                    # sparse tables a step touches (one message carries them all)
    requests: str = FITTED["requests"]  # "worker": a push-pull per server per worker (the group's push
                                       # riding on its first rank's); "group" (train.group_pull): a
                                       # push-pull per server per group. Either carries every table.
    keys: KeyCurve = field(default_factory=KeyCurve)
    node_ranks: int = 0                # ranks busy on a node beside other jobs' (0: the job's own only)
    crossing: float = -1.0             # the share of a worker's traffic that goes between hosts; -1:
                                       # (hosts - 1) / hosts, its servers spread evenly over the hosts

    def crossing_share(self) -> float:
        """The share of a worker's traffic with its servers that crosses hosts."""
        if self.hosts <= 1:
            return 0.0
        return self.crossing if self.crossing >= 0 else (self.hosts - 1) / self.hosts


def _requests(job: Job, u: float, ug: float) -> dict:
    """Keys and requests: a worker's own, and each server's, per step."""
    S, W, g = job.servers, job.workers, job.group
    groups = W / g
    touched = S * (1 - (1 - 1 / S) ** u)       # servers holding some of a worker's keys
    touched_g = S * (1 - (1 - 1 / S) ** ug)    # ... of a group's
    if job.requests == "group":                # the group pulls and pushes its merged keys at once
        return {"pull_keys": groups * ug / S, "push_keys": groups * ug / S,
                "server_requests": groups * touched_g / S, "worker_requests": touched_g / g,
                "keys_per_request": ug / touched_g}
    # each worker's push-pull to the servers of its keys; a group's first rank's to those of the group's
    leaders, members = groups * touched_g, (W - groups) * touched
    return {"pull_keys": W * u / S, "push_keys": groups * ug / S,
            "server_requests": (leaders + members) / S, "worker_requests": (leaders + members) / W,
            "keys_per_request": u / touched}


def step(job: Job, m: Machine) -> dict:
    """One step of every worker: the bytes and requests, each part's time and the slowest."""
    S, W, g, d = job.servers, job.workers, job.group, job.dim
    u, ug = job.keys(job.batch), job.keys(job.batch * g)      # a worker's keys, and its group's
    row_bytes = 8 + 4 * d                                     # a key and its floats
    if job.requests == "group":   # the group gathers its keys and scatters the rows: its share of both
        worker_bytes = 2 * ug * row_bytes / g
    else:                         # its own pull (keys out, rows back), its share of the group's push
        worker_bytes = u * row_bytes + ug * row_bytes / g
    rq = _requests(job, u, ug)
    extra_floats = max(0, d * (1 + job.state) - 3) / m.server_floats_per_s
    slower = contended(job, m)
    server_s = slower * (rq["pull_keys"] * (1 / m.server_pull_keys_per_s + extra_floats)
                         + rq["push_keys"] * (1 / m.server_push_keys_per_s + extra_floats)
                         + rq["server_requests"] * (m.server_request_s + m.server_job_request_s))
    worker_s = slower * job.batch / m.worker_rows_per_s
    remote = job.hosts > 1
    bw, lat = (m.link_bytes_per_s, m.latency_s) if remote else (m.local_bytes_per_s, m.local_latency_s)
    # bytes through one host's link per step: the servers' traffic on it (both ways)
    net_s = W * worker_bytes / job.hosts / bw if remote else 0.0
    served = (u if job.requests == "worker" else ug / g) / S / m.server_push_keys_per_s
    # BSP's phases: the servers apply the pushes once all have come, then answer the pulls, so a
    # worker waits for the whole of the servers' step, not only its keys' share (ASP: the two
    # overlap); SSP s lets 1/(s + 1) of it stay in the worker's path
    phases_s = max(0.0, server_s / (job.staleness + 1) - served) if job.staleness >= 0 else 0.0
    own_s = 4 * lat + worker_bytes / bw + served + rq["worker_requests"] * m.worker_request_s
    if job.requests == "group" and g > 1:     # the exchange inside the group (shared memory if on one host)
        inside = g <= (S + W) / job.hosts
        glat, gbw = (m.local_latency_s, m.local_bytes_per_s) if inside else (m.latency_s, m.link_bytes_per_s)
        own_s += 2 * (g - 1) * glat + 2 * ug * row_bytes / gbw
    allreduce_s = (2 * (g - 1) / g * job.dense_bytes / bw + 2 * (g - 1) * lat) if g > 1 else 0.0
    spread = m.straggler_cv * worker_s * math.sqrt(2 * math.log(W)) if W > 1 else 0.0
    straggler_s = 0.0 if job.staleness < 0 else spread / (job.staleness + 1)
    # every rank shares the cores: the CPU work of a step cannot take less than this
    worker_cpu_s = worker_s + rq["worker_requests"] * m.worker_request_s
    link_s = link_cpu(job, m, worker_bytes, 2 * rq["worker_requests"])
    cpu_s = max((W * worker_cpu_s + S * server_s) / min(m.cores, S + W),
                shared_cores(job, m, server_s, link_s, worker_s, own_s - served, rq["worker_requests"]))
    parts = {"worker compute + round trips": worker_s + own_s, "server keys + requests": server_s,
             "network": net_s, "CPU shared by ranks": cpu_s}
    paths = {**parts, "worker compute + round trips": worker_s + own_s + phases_s}
    slowest = max(paths, key=paths.get)
    t = paths[slowest] + allreduce_s + straggler_s
    if slowest.startswith("worker") and phases_s + served > worker_s:  # its path is mostly the servers' step
        slowest = "server keys + requests"
    return {"step_s": t, "examples_per_s": W * job.batch / t, "bottleneck": slowest, **parts,
            "phases": phases_s, "allreduce": allreduce_s, "stragglers": straggler_s, "unique_per_worker": u,
            "server_requests": rq["server_requests"], "keys_per_request": rq["keys_per_request"],
            "bytes_per_worker": worker_bytes, "messages_per_worker": 2 * rq["worker_requests"]}


def contended(job: Job, m: Machine) -> float:
    """How much longer a rank's work takes for the ranks busy beside it on its node (their memory
    and caches shared): ``1 + contention * (busy - 2) / cores``, the busy ranks and cores a node's
    (no more busy than cores: beyond, :func:`shared_cores` counts the sharing), 1 for the 2 ranks
    the rates are fitted on."""
    per_node = m.cores / job.hosts
    busy = min(job.node_ranks or (job.servers + job.workers) / job.hosts, per_node)
    return 1.0 + m.contention * max(0.0, busy - 2) / per_node


def shared_cores(job: Job, m: Machine, server_s: float, link_s: float = 0.0, worker_s: float = 0.0,
                 trips_s: float = 0.0, requests: float = 1.0) -> float:
    """A step's time when its R ranks outnumber the C cores (0 when each has a core of its own),
    work-conserving: a core that one rank leaves (a server asleep between requests, a worker
    waiting for its reply) is taken by another. A worker's CPU a step is its rows at
    ``worker_cpu_row_s`` (its parse thread's included, and its one request's: a 1 server +
    1 worker job's), ``worker_request_s`` for each of its further ``requests`` (its packing and
    posting) and ``link_s`` (:func:`link_cpu`, its messages' CPU between hosts that share these
    cores); a server's is ``server_s`` (its keys and requests) and ``server_cpu_step_s`` (the rest
    of its loop). The step is the critical path through BSP's phases, each phase's CPU on the
    cores it has:

    * the workers' rows, and under SSP ``s`` the share ``1 - 1/(s + 1)`` of the servers' work
      that overlaps them (all of it under ASP), over the C cores less what the servers' polls
      take (:attr:`Machine.server_poll_share` of a core each while they wait for requests from
      other hosts, no more than a rank's share ``C/R``), no faster than a worker's wall-time rate
      ``worker_s``;
    * then ``trips_s``, the worker's round trips (its latencies, bytes and requests' fixed cost);
    * then the rest of the servers' step, each server on a core of its own where there are as
      many cores, else ``S/C`` of its time.

    So it is never less than all the step's CPU over the C cores, however it interleaves."""
    S, W, C = job.servers, job.workers, m.cores
    if S + W <= C:
        return 0.0
    worker_cpu = job.batch * m.worker_cpu_row_s + (requests - 1) * m.worker_request_s + link_s
    server_cpu = server_s + m.server_cpu_step_s
    apart = 0.0 if job.staleness < 0 else 1.0 / (job.staleness + 1)  # of the servers' step, after the rows
    polls = S * min(m.server_poll_share, C / (S + W)) * job.crossing_share()
    rows = max((W * worker_cpu + (1 - apart) * S * server_cpu) / (C - polls), worker_s)
    return rows + trips_s + apart * server_cpu * max(1.0, S / C)


def link_cpu(job: Job, m: Machine, nbytes: float, messages: float) -> float:
    """The CPU seconds, both ends together, of a worker's ``messages`` messages and ``nbytes``
    bytes a step with its servers, beyond what they cost within a host: the share of them that
    crosses hosts (:meth:`Job.crossing_share`) at ``link_cpu_message_s`` a message and
    ``link_cpu_byte_s`` a byte. It counts only where the ranks outnumber the cores
    (:func:`shared_cores`), as the rest of that term: with a core a rank it is left out."""
    return job.crossing_share() * (messages * m.link_cpu_message_s + nbytes * m.link_cpu_byte_s)


def cluster(nodes: int, ranks_per_node: int = 16, server_share: float = 0.25, **job) -> tuple[Job, Machine]:
    """A cluster of ``nodes`` nodes of ``ranks_per_node`` cores on 25 Gb/s Ethernet, a
    ``server_share`` of the ranks servers; ``job``: the other fields of the :class:`Job`."""
    ranks = nodes * ranks_per_node
    S = max(1, round(ranks * server_share))
    return Job(servers=S, workers=ranks - S, hosts=nodes, **job), Machine(cores=ranks)


def servers_for(features: float, dim: int, state: int = 2, node_bytes: float = 128e9,
                ranks_per_node: int = 16) -> int:
    """Server ranks whose memory holds ``features`` keys: 4 bytes a float and its optimizer
    state, 1.5x for the table's slack, 8 bytes a key (per rank: 80 % of a node's memory / its ranks)."""
    per_key = 4 * dim * (1 + state) * 1.5 + 8
    return math.ceil(features * per_key / (node_bytes * 0.8 / ranks_per_node))


BATCHES = (1000, 2000, 5000, 10000)  # the batches auto tries (rows per worker a step)
MAX_GROUP = 64                       # the largest worker group auto tries (and no more than a host's ranks:
                                     # a group merges its keys in shared memory, as KunPeng's do)
NEAR = 0.05                          # layouts within 5 % of the best count as as fast


@dataclass(frozen=True)
class Choice:
    """The layout :func:`choose` picked: servers, workers per group, batch, and its step."""

    servers: int
    groups: int                        # worker groups (cluster.worker_groups; as many as workers: 0)
    group: int                         # workers a group (the model's; the last group may differ)
    batch: int
    workers: int
    step: dict
    requests: str = FITTED["requests"]  # "group": train.group_pull (one push-pull per server per group)


def _server_counts(ranks: int) -> list[int]:
    """The server counts tried: every one up to 64, then about 40 a decade."""
    counts = set(range(1, min(ranks - 1, 64) + 1))
    counts |= {int(round(x)) for x in np.geomspace(64, max(ranks - 1, 64), 160)}
    return sorted(c for c in counts if 1 <= c < ranks)


def choose(ranks: int, job: Job, m: Machine, servers: int = 0, groups: int = 0, batch: int = 0,
           batch_cap=lambda workers: BATCHES[-1], max_servers: int = 1 << 30, max_group: int = MAX_GROUP,
           min_servers: int = 1, requests: tuple = ()) -> Choice:
    """The layout of ``ranks`` ranks with the highest modelled throughput: ``job`` gives the rest
    (model, data, hosts); ``servers``, ``groups`` (the number of worker groups) and ``batch``, when
    not 0, are fixed by the user. Batches are those of :data:`BATCHES` up to ``batch_cap(workers)``
    (or the cap alone, below the smallest); from ``min_servers`` (each shard's copies) to ``max_servers``
    servers, and groups of ``max_group``; ``requests``: the ways of sending requests tried (``Job.requests``;
    none: the job's). Among the layouts within :data:`NEAR` of the best, the one with the job's own
    requests (the default's, where it is as fast), then the fewest rows a group's step (g·B: the
    smallest effective batch), then the smallest group, then the fastest."""
    found = []
    for S in [servers] if servers else [c for c in _server_counts(ranks) if min_servers <= c <= max_servers]:
        W = ranks - S
        if W < 1:
            continue
        cap = batch_cap(W)
        batches = [batch] if batch else ([b for b in BATCHES if b <= cap] or [max(1, cap)])
        most = min(W, max_group, math.ceil(ranks / job.hosts))
        sizes = ([(groups, max(1, round(W / groups)))] if groups else
                 [(W // g, g) for g in range(1, most + 1) if W % g == 0])
        for (G, g), B, how in itertools.product(sizes, batches, requests or (job.requests,)):
            if G <= W and (how == job.requests or g > 1):  # (a group of 1 sends as a worker does)
                r = step(replace(job, servers=S, workers=W, group=g, batch=B, requests=how), m)
                found.append((r["examples_per_s"], S, G, g, B, W, r, how))
    if not found:
        raise ValueError(f"no layout of {ranks} ranks with {servers or 'any number of'} server(s) and "
                         f"{groups or 'any number of'} worker group(s)")
    best = max(f[0] for f in found)
    eps, S, G, g, B, W, r, how = min((f for f in found if f[0] >= (1 - NEAR) * best),
                                     key=lambda f: (f[7] != job.requests, f[4] * f[3], f[3], -f[0], f[1]))
    return Choice(S, G, g, B, W, r, how)


def explain(c: Choice, fixed: dict) -> str:
    """The plan in one line: what was picked, the step it models and what bounds it; ``fixed``:
    the parts the user set (their keys), which auto kept."""
    r = c.step
    kept = f" ({', '.join(f'{k} as set' for k in fixed)})" if fixed else ""
    pulls = ", train.group_pull" if c.requests == "group" else ""
    return (f"layout auto: {c.servers} server(s), {c.groups} group(s) of {c.group}, batch {c.batch}{pulls}{kept} — "
            f"the model's step: {r['step_s'] * 1e3:.2f} ms, {r['examples_per_s']:,.0f} examples/s, bottleneck "
            f"{r['bottleneck']}, {r['keys_per_request']:.0f} keys a request")


def _robust_line(xs, ys) -> tuple[float, float]:
    """Intercept and slope of ys over xs, robust to a slow outlier on a busy machine (Theil-Sen:
    the median of the slopes between pairs, the median of what each point leaves for the intercept)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for i in range(x.size) for j in range(i + 1, x.size) if x[j] != x[i]]
    slope = float(np.median(slopes))
    return float(np.median(y - slope * x)), slope


def _medians(rows: list[dict], by: tuple, of: tuple) -> list[dict]:
    """One row per value of the keys ``by``, with the median of each of ``of`` over its rows."""
    groups: dict = {}
    for r in rows:
        if all(k in r for k in by + of):
            groups.setdefault(tuple(r[k] for k in by), []).append(r)
    return [{**dict(zip(by, key)), **{k: float(np.median([r[k] for r in rs])) for k in of}}
            for key, rs in sorted(groups.items())]


def fit(ps_rows: list[dict], mpi_rows: list[dict], jobs: list[dict], batch: int, cores: int,
        requests: str = "worker", mpi_hosts_rows: list[dict] | None = None,
        jobs_hosts: list[dict] | None = None) -> dict:
    """The constants of :data:`FITTED`, from the rows of one or more runs of each (medians over
    the runs): ``hpcps bench ps --json`` (the server's own time of a pull and of a push,
    ``server_s``, over their keys, a robust line each: their intercepts' sum is the server's fixed
    cost of a step's request, a push-pull and its slope the cost of a key; the worker's round trip
    less the server's time, at 0 keys, less two one-way latencies: the worker's cost of a
    request), ``hpcps bench mpi --json`` (the one-way time of the smallest message with hpcps's
    waits: the latency; the largest bytes/s: the bandwidth) and the ``--summary-json`` of jobs of
    1 server and 1 worker on ``cores`` cores, ``batch`` rows a step: the worker's rows/s that
    makes the model's throughput of that job the median measured, and the CPU costs of ranks
    that share cores (:func:`_cpu_costs`); with ``mpi_hosts_rows`` (``hpcps bench mpi --json``
    between two hosts that share the cores) the CPU of a message between hosts (:func:`_link_costs`),
    and with ``jobs_hosts`` (summaries of the same jobs with the server and the worker on two such
    hosts) the CPU of a byte between hosts from the jobs themselves (:func:`_link_byte_of_jobs`);
    without them, those constants as they are."""
    out: dict = {"requests": requests}
    mpi = _medians(mpi_rows, ("bytes",), ("wait_one_way_s",))
    if not mpi:
        raise ValueError("no hpcps bench mpi --json rows")
    out["local_latency_s"] = mpi[0]["wait_one_way_s"]
    out["local_bytes_per_s"] = max(r["bytes"] / r["wait_one_way_s"] for r in mpi)
    ps = _medians(ps_rows, ("op", "keys"), ("time_s", "server_s"))
    fixed, rest = [], []
    for op, name in (("pull", "server_pull_keys_per_s"), ("push+apply", "server_push_keys_per_s")):
        rows = [r for r in ps if r["op"] == op]
        if len(rows) < 2:
            raise ValueError(f"hpcps bench ps rows: need the server's time of {op} at 2 sizes or more (--sizes)")
        a, b = _robust_line([r["keys"] for r in rows], [r["server_s"] for r in rows])
        fixed.append(max(a, 0.0))
        out[name] = 1.0 / b if b > 0 else 1e12
        rest.append(_robust_line([r["keys"] for r in rows], [r["time_s"] - r["server_s"] for r in rows])[0])
    out["server_request_s"] = float(np.sum(fixed))  # a step's request is a push-pull: a pull's and a push's
    out["worker_request_s"] = max(0.0, float(np.mean(rest)) - 2 * out["local_latency_s"])
    m = replace(Machine(cores=cores), **{k: v for k, v in out.items() if k != "requests"})
    if not jobs or any((j.get("servers"), j.get("workers")) != (1, 1) for j in jobs):
        raise ValueError("the jobs' summaries: need one or more of 1 server and 1 worker")
    job = Job(servers=1, workers=1, batch=batch, requests=requests)
    cpu = _cpu_costs(jobs, job, m)  # (first: on fewer cores than 2 they bound the job the rate is fitted to)
    out["worker_rows_per_s"] = _worker_rate(job, replace(m, **cpu),
                                            float(np.median([j["examples_per_s"] for j in jobs])))
    link = _link_costs(mpi_rows, mpi_hosts_rows) if mpi_hosts_rows else {
        k: FITTED[k] for k in ("link_cpu_message_s", "link_cpu_byte_s")}
    if jobs_hosts:
        link["link_cpu_byte_s"] = _link_byte_of_jobs(jobs, jobs_hosts, job, replace(m, **cpu, **link))
    return {**out, **cpu, **link}


def _link_byte_of_jobs(jobs: list[dict], jobs_hosts: list[dict], job: Job, m: Machine) -> float:
    """The CPU of a byte between hosts as 1 server + 1 worker jobs spend it: the loops' CPU a step
    (worker's and server's, medians) with the two on hosts that share the cores, less on one host,
    less the model's ``link_cpu_message_s`` for the step's messages, over the step's bytes (none
    below 0). It holds what ``bench mpi``'s one message at a time leaves out: a request's several
    MPI messages (its gradients, a large reply's head apart) and the polls while they move."""
    if any((j.get("servers"), j.get("workers")) != (1, 1) for j in jobs_hosts):
        raise ValueError("the jobs' summaries on hosts: need one or more of 1 server and 1 worker")

    def per_step(js: list[dict]) -> float:
        return float(np.median([(j["loop_cpu_s_worker"] + j["loop_cpu_s_server"]) * job.batch / j["examples"]
                                for j in js]))
    r = step(job, m)
    extra = per_step(jobs_hosts) - per_step(jobs) - r["messages_per_worker"] * m.link_cpu_message_s
    return max(0.0, extra / r["bytes_per_worker"])


LINK_FIT_MAX_BYTES = 1 << 20  # the sizes of bench mpi the link's CPU is fitted on: those of a step's messages


def _link_costs(local_rows: list[dict], hosts_rows: list[dict]) -> dict:
    """The CPU of a message between hosts beyond one within a host: ``bench mpi``'s ``wait_cpu_s``
    (a round trip's CPU on one end: one message sent and one received, both ends of a message)
    over the bytes up to :data:`LINK_FIT_MAX_BYTES`, a robust line across hosts and one within a
    host (medians over the runs):
    the difference of their intercepts a message, of their slopes a byte (none below 0)."""
    lines = []
    for rows, where in ((local_rows, "within a host"), (hosts_rows, "between hosts")):
        med = [r for r in _medians(rows, ("bytes",), ("wait_cpu_s",)) if r["bytes"] <= LINK_FIT_MAX_BYTES]
        if len(med) < 2:
            raise ValueError(f"hpcps bench mpi rows {where}: need wait_cpu_s at 2 sizes or more "
                             "(rows of an hpcps older than the fit)")
        lines.append(_robust_line([r["bytes"] for r in med], [r["wait_cpu_s"] for r in med]))
    (a0, b0), (a1, b1) = lines
    return {"link_cpu_message_s": max(0.0, a1 - a0), "link_cpu_byte_s": max(0.0, b1 - b0)}


def _cpu_costs(jobs: list[dict], job: Job, m: Machine) -> dict:
    """The CPU costs of :func:`shared_cores` from the summaries of 1 server + 1 worker jobs (medians):
    the worker loop's CPU seconds a row (``loop_cpu_s_worker``: both its threads), and the server
    loop's (``loop_cpu_s_server``) a step less the model's server time of that step."""
    for key in ("examples", "loop_cpu_s_worker", "loop_cpu_s_server"):
        if any(key not in j for j in jobs):
            raise ValueError(f"the jobs' summaries: no {key} (a summary of an hpcps older than the fit)")
    r = step(job, m)
    per_step = float(np.median([j["loop_cpu_s_server"] * job.batch / j["examples"] for j in jobs]))
    return {"worker_cpu_row_s": float(np.median([j["loop_cpu_s_worker"] / j["examples"] for j in jobs])),
            "server_cpu_step_s": max(0.0, per_step - r["server keys + requests"])}


def _worker_rate(job: Job, m: Machine, measured: float) -> float:
    """The worker's rows/s at which the model's throughput of ``job`` is ``measured`` (bisection
    in log; the model's throughput grows with the rate, up to what the servers bound it to)."""
    lo, hi = 1e3, 1e9
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if step(job, replace(m, worker_rows_per_s=mid))["examples_per_s"] < measured:
            lo = mid
        else:
            hi = mid
    return float(f"{math.sqrt(lo * hi):.4g}")


FITTED_BLOCK = re.compile(r"(# --- fitted: begin ---\n)(.*?)(# --- fitted: end ---)", re.S)
JOB_TERMS_BLOCK = re.compile(r"(# --- job terms: begin ---\n)(.*?)(# --- job terms: end ---)", re.S)


def fitted_source(source: str, fitted: dict, block: re.Pattern = FITTED_BLOCK, name: str = "FITTED") -> str:
    """This module's source ``source`` with :data:`FITTED` (or the dict ``name`` of ``block``,
    e.g. :data:`JOB_TERMS`) replaced by ``fitted``."""
    body = "".join(f"    \"{k}\": \"{v}\",\n" if isinstance(v, str) else f"    \"{k}\": {float(v):.4g},\n"
                   for k, v in fitted.items())
    return block.sub(lambda mt: mt.group(1) + name + " = {\n" + body + "}\n" + mt.group(3), source, count=1)


POLLS_BLOCK = re.compile(r"(# --- poll share: begin ---\n)(.*?)(# --- poll share: end ---)", re.S)


def poll_share_of(job: Job, m: Machine, point: dict) -> float | None:
    """The share of a core a server's loop took while it waited, at a measured ``point`` of
    ``job`` (its ``examples``, ``examples_per_s`` and busiest server's ``loop_cpu_s_server``):
    the loop's CPU a step beyond the model's work of it (its keys and requests, the rest of its
    loop, and its end of the link's CPU, half of each worker's :func:`link_cpu` for the requests
    it answers) over the step's time beyond that work. None where the point lacks them."""
    if not all(point.get(k) for k in ("examples", "examples_per_s", "loop_cpu_s_server")):
        return None
    r = step(job, m)
    rows = job.workers * job.batch  # a step's rows
    cpu = point["loop_cpu_s_server"] * rows / point["examples"]
    link = link_cpu(job, m, r["bytes_per_worker"], r["messages_per_worker"]) * job.workers / (2 * job.servers)
    work = r["server keys + requests"] + m.server_cpu_step_s + link
    wall = rows / point["examples_per_s"]
    return min(1.0, max(0.0, (cpu - work) / (wall - work))) if wall > work else None


def fit_poll_share(points: list[tuple[Job, Machine, dict]]) -> float:
    """:attr:`Machine.server_poll_share` from measured points (each its :class:`Job`, the
    :class:`Machine` it ran on, and its figures): the median of :func:`poll_share_of` over the
    points where the model counts it, those whose servers answer workers on other hosts and
    whose ranks outnumber the cores (from the loops' CPU seconds, not from the points'
    throughput: what the servers spent, not how well the model then does)."""
    shares = [x for j, m, p in points if j.crossing_share() > 0 and j.servers + j.workers > m.cores
              for x in [poll_share_of(j, m, p)] if x is not None]
    if not shares:
        raise ValueError("no point on several hosts with more ranks than cores, its examples and "
                         "loop_cpu_s_server (as docs/measure-scaling.sh writes them)")
    return float(np.median(shares))


JOB_TERM_NAMES = ("server_job_request_s", "straggler_cv")  # fitted together; contention apart


def fit_job_terms(points: list[tuple[Job, float]], m: Machine, rate_of: float, rate_job: Job = Job()) -> dict:
    """The job's terms of :class:`Machine` from measured points of one node (each a :class:`Job`
    and its examples/s; ``m`` the node's constants from :func:`fit`): ``worker_rows_per_s`` again
    at each try, so that the model's ``rate_job`` (the fit's 1 server + 1 worker) stays at
    ``rate_of`` (the examples/s of the fit's jobs); ``contention`` from the points of separate jobs at once (``node_ranks``; their
    median), where the job alone is the 1 + 1 of the rate; then ``server_job_request_s`` and
    ``straggler_cv``, least squares of log(measured / model) over the other points."""
    from scipy.optimize import least_squares

    def with_terms(**terms) -> Machine:
        t = replace(m, **terms)
        return replace(t, worker_rows_per_s=_worker_rate(rate_job, t, rate_of))

    apart = [(j, x) for j, x in points if j.node_ranks]
    rest = [(j, x) for j, x in points if not j.node_ranks]

    def contention(terms: dict) -> float:  # the median of the separate jobs' (bisection: it slows them)
        found = []
        for job, measured in apart:
            lo, hi = 0.0, 4.0
            for _ in range(40):
                mid = (lo + hi) / 2
                if step(job, with_terms(**{**terms, "contention": mid}))["examples_per_s"] > measured:
                    lo = mid
                else:
                    hi = mid
            found.append((lo + hi) / 2)
        return float(np.median(found)) if found else kappa

    def resid(p, kappa):
        t = with_terms(contention=kappa, **dict(zip(JOB_TERM_NAMES, p)))
        return [math.log(x / step(j, t)["examples_per_s"]) for j, x in rest]
    p = [max(getattr(m, k), 1e-6) for k in JOB_TERM_NAMES]
    kappa = m.contention
    for _ in range(4):  # the two depend on each other a little (the separate jobs' requests): in turn
        kappa = contention(dict(zip(JOB_TERM_NAMES, p)))
        if rest:
            p = list(least_squares(resid, p, args=(kappa,), bounds=([0.0] * len(p), [np.inf] * len(p)),
                                   x_scale=p, diff_step=1e-2).x)
    t = with_terms(contention=kappa, **dict(zip(JOB_TERM_NAMES, map(float, p))))
    return {"contention": kappa, **{k: getattr(t, k) for k in JOB_TERM_NAMES}, "worker_rows_per_s": t.worker_rows_per_s}
