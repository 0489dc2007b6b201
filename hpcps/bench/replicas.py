"""``hpcps bench ps --replicas R``: what hot backups cost a push. Run with ``R + 1`` servers and one
worker: ``mpiexec -n 3 hpcps bench ps --replicas 1``.

The same servers, keys and gradients with ``cluster.replicas`` 0 and R, in alternating pairs (the
order flipped every pair), each pair's ratio taken within it; the rows give the medians over the
pairs. Two kinds of push:

* ``push+apply``: a push's round trip under ASP, answered once the update is applied on the
  server (on every copy with replicas: the worker sends each copy its keys);
* ``push-pull step``: a BSP training step's request, the push of a batch's keys, the clock and the
  pull of the same keys in one message a server (:meth:`hpcps.ps.client.SparseTable.ipushpull`
  with ``in_pull``), until the pulled rows are back;
* ``push-pull step, paced``: the same with the worker idle, after each, as long as it took (as a
  worker computing its next step is): a backup applies its copies' updates after its reply
  (:meth:`hpcps.ps.replication.ServerCopies.push_now`), which this lets overlap.

Back to back, a server with replicas applies ``r + 1`` times the keys on the same cores: the
first two kinds show that cost where the servers' cores are the limit.
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.ps.context import init

SIZES = [1_000, 10_000, 100_000]
# the kinds measured in one context each, by its staleness (ASP: a push is applied before its reply)
KINDS = ((-1, ("push+apply",)), (0, ("push-pull step", "push-pull step, paced")))


def _median_time(fn, reps: int, paced: bool) -> float:
    """Median seconds of ``fn``; ``paced``: after each call, idle as long as it took."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if paced:
            time.sleep(times[-1])
    return float(np.median(times))


def _measure(table, kinds: tuple, sizes: list[int], reps: int, dim: int) -> dict[tuple, float]:
    """Median seconds of one request of each kind and size (the first, creating the keys, not
    counted): {(kind, keys): s}."""
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        keys = np.unique(rng.integers(0, 2**63, n, dtype=np.uint64))
        grads = rng.normal(size=(keys.size, dim)).astype(np.float32) * np.float32(0.01)
        in_pull = np.ones(keys.size, dtype=bool)
        for kind in kinds:
            if kind == "push+apply":
                step = lambda: table.wait(table.push(keys, grads, unique=True))  # noqa: E731
            else:
                step = lambda: table.wait(table.ipushpull(keys, grads, keys, unique=True, in_pull=in_pull))  # noqa: E731
            step()
            out[kind, n] = _median_time(step, reps, kind.endswith("paced"))
    return out


def run(sizes=SIZES, replicas: int = 1, pairs: int = 3, reps: int = 5, dim: int = 1,
        optimizer: str = "ftrl") -> list[dict] | None:
    """Collective over the world (``replicas + 1`` servers, the first worker drives, any others
    idle); returns the rows on the first worker, None elsewhere."""
    servers = replicas + 1
    times: dict = {}
    for pair in range(pairs):
        for r in ((0, replicas) if pair % 2 == 0 else (replicas, 0)):
            for staleness, kinds in KINDS:
                ctx = init(servers=servers, staleness=staleness, stall_timeout_s=600, replicas=r)
                table = ctx.sparse_table("bench", dim=dim, optimizer=optimizer)
                if ctx.is_server:
                    ctx.serve()
                elif ctx.worker_index == 0:
                    for key, t in _measure(table, kinds, sizes, reps, dim).items():
                        times.setdefault(key, {}).setdefault(r, []).append(t)
                ctx.finalize()
    if not times:
        return None
    rows = []
    for (kind, n), by in times.items():
        plain, copies = np.array(by[0]), np.array(by[replicas])
        rows.append({"op": "replication", "kind": kind, "keys": n, "servers": servers, "replicas": replicas,
                     "pairs": pairs, "time_s": float(np.median(plain)), "replicated_time_s": float(np.median(copies)),
                     "ratio": float(np.median(copies / plain))})
    return rows


def format_rows(rows: list[dict]) -> str:
    out = [f"{'replication':<22} {'keys':>9} {'replicas 0 ms':>14} {'replicas R ms':>14} {'ratio':>6}"]
    for r in rows:
        out.append(f"{r['kind']:<22} {r['keys']:>9} {r['time_s'] * 1e3:>14.2f} {r['replicated_time_s'] * 1e3:>14.2f} "
                   f"{r['ratio']:>5.2f}x")
    r = rows[0]
    out.append(f"({r['servers']} servers, 1 worker; R = {r['replicas']}: each shard on {r['replicas'] + 1} servers, "
               f"a push sent to every copy; medians of {r['pairs']} alternating pairs, ratio = the median of the "
               f"pairs' ratios; push+apply: a push's round trip with the update applied (ASP); push-pull step: a BSP "
               f"step's push, clock and pull of the same keys in one request a server; paced: the worker idles as long as "
               f"each request took before the next, as one computing its next step would, which a backup's "
               f"update (applied after the reply) can overlap)")
    return "\n".join(out)
