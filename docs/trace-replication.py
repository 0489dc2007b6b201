"""Where a push's round trip goes, with and without ``cluster.replicas``: each rank's stages,
timestamped. Run with 2 servers and 1 worker (issue 40; docs/benchmarks.md's replication row):

    mpiexec -n 3 .venv/bin/python docs/trace-replication.py [--keys 1000] [--pushes 300] [--pairs 2]
                                                            [--timelines 4]

The worker pushes the same keys back to back under ASP, as ``hpcps bench ps --replicas 1``'s
push+apply row does, in contexts of replicas 0 and 1 taken in turn (``--pairs`` of each). Every rank
records its stages into a list by wrapping the functions involved, with ``time.perf_counter()``
(CLOCK_MONOTONIC: one clock for the processes of a host): on the worker the push's start, its sends
posted, each transfer its wait saw done (a request's send, a server's reply) and the push's end; on
a server the poll that found a request, its handling's start, its reply posted, its backup part
applied (replicas) and its handling's end; on every rank each sleep of a wait or of the serving
loop's idle, with its length. The worker prints, per stage, the microseconds from the stage before
(medians, quartiles and means over the pushes), the sleeps each rank took in a push's time, and
``--timelines`` pushes' events of every rank in time order. The wrappers cost a few microseconds a
stage, the same with and without replicas.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hpcps.ps import client, replication, server as server_mod, transport
from hpcps.ps.context import init

EVENTS: list = []  # (stage, time, detail) on this rank
WORKER = 2  # (the world's ranks: servers first)


def _after(owner, name: str, stage: str) -> None:
    """Record ``stage`` once ``owner.name`` returns."""
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        EVENTS.append((stage, time.perf_counter(), 0))
        return out
    setattr(owner, name, wrapped)


class _SleepsRecorded:
    """The transport's ``time`` module, its sleeps recorded (a wait's back-off, a serving loop's idle)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(s: float) -> None:
        t = time.perf_counter()
        time.sleep(s)
        EVENTS.append(("sleep", t, time.perf_counter() - t))


def _instrument() -> None:
    push = client.SparseTable.push

    def traced_push(*args, **kwargs):
        EVENTS.append(("push", time.perf_counter(), 0))
        return push(*args, **kwargs)
    client.SparseTable.push = traced_push
    _after(client.SparseTable, "push", "sent")
    _after(client.SparseTable, "wait", "done")
    test = transport._test

    def traced_test(todo):  # (each transfer a wait's poll saw done: a request's send or a reply)
        left, started, done = test(todo)
        now = time.perf_counter()
        for p in todo:
            if p not in left:
                EVENTS.append(("reply" if "reply" in str(p.what) else "send", now, p.peer))
        return left, started, done
    transport._test = traced_test
    transport.time = _SleepsRecorded()
    handle = server_mod.ServingLoop._handle_timed

    def traced_handle(self, source, buf, words, grads, probed):
        EVENTS.append(("found", probed, 0))
        EVENTS.append(("handle", time.perf_counter(), 0))
        handle(self, source, buf, words, grads, probed)
        EVENTS.append(("handled", time.perf_counter(), 0))
    server_mod.ServingLoop._handle_timed = traced_handle
    _after(server_mod.Replies, "post", "replied")
    _after(replication.ServerCopies, "apply_backlog", "backlog")


def _run(replicas: int, n_keys: int, pushes: int) -> list | None:
    """One context's pushes; every rank's events on the worker (None elsewhere)."""
    ctx = init(servers=2, staleness=-1, stall_timeout_s=600, replicas=replicas)
    table = ctx.sparse_table("bench", dim=1, optimizer="ftrl")
    EVENTS.clear()
    if ctx.is_server:
        ctx.serve()
    else:
        rng = np.random.default_rng(0)
        keys = np.unique(rng.integers(0, 2**63, n_keys, dtype=np.uint64))
        grads = rng.normal(size=(keys.size, 1)).astype(np.float32) * np.float32(0.01)
        for i in range(20 + pushes):  # (the first create the keys and warm up)
            if i == 20:
                EVENTS.clear()
            table.wait(table.push(keys, grads, unique=True))
    ctx.finalize()
    world = transport.dup()
    events = world.gather(list(EVENTS), root=WORKER)  # (after the run: not timed)
    transport.free(world)
    return events


def _per_push(events: list) -> dict:
    """Per push (its start on the worker): the delays from stage to stage, and each rank's sleeps."""
    w = events[WORKER]
    starts = np.array([t for s, t, _ in w if s == "push"])
    n = len(starts)
    at: dict = {}  # (rank, stage) -> each push's first such event (nan: none)
    sleeps = {who: np.zeros(n) for who in ("worker", "server 0", "server 1")}
    for who, evs in (("worker", w), ("server 0", events[0]), ("server 1", events[1])):
        for s, t, e in evs:
            i = np.searchsorted(starts, t, side="right") - 1
            if i < 0:
                continue
            if s == "sleep":
                sleeps[who][i] += 1
                continue
            a = at.setdefault((who, f"{s} {e}" if s in ("reply", "send") else s), np.full(n, np.nan))
            if np.isnan(a[i]):
                a[i] = t

    def delay(a, b) -> list:
        x, y = at.get(a, np.full(n, np.nan)), at.get(b, np.full(n, np.nan))
        v = (y - x) * 1e6
        return list(v[~np.isnan(v)])
    out = {"worker: push start -> sends posted": list((at["worker", "sent"] - starts) * 1e6),
           "worker: round trip": list((at["worker", "done"] - starts) * 1e6)}
    for k in (0, 1):
        s = f"server {k}"
        out[f"{s}: sends posted -> found"] = delay(("worker", "sent"), (s, "found"))
        out[f"{s}: found -> received (handle)"] = delay((s, "found"), (s, "handle"))
        out[f"{s}: handle -> replied"] = delay((s, "handle"), (s, "replied"))
        out[f"{s}: replied -> backlog applied"] = delay((s, "replied"), (s, "backlog"))
        out[f"{s}: replied -> handled"] = delay((s, "replied"), (s, "handled"))
        out[f"{s}: replied -> worker saw reply"] = delay((s, "replied"), ("worker", f"reply {k}"))
    last = np.fmax(at.get(("worker", "reply 0"), np.full(n, np.nan)), at.get(("worker", "reply 1"), np.full(n, np.nan)))
    out["worker: last reply seen -> done"] = list(((at["worker", "done"] - last) * 1e6)[~np.isnan(last)])
    for who, v in sleeps.items():
        out[f"{who}: sleeps a push"] = list(v)
    return out


def _timelines(events: list, replicas: int, count: int) -> None:
    """``count`` pushes' events on every rank in time order (microseconds after the push's start)."""
    w = events[WORKER]
    starts = [t for s, t, _ in w if s == "push"]
    for i in range(len(starts) // 3, len(starts) // 3 + count):
        lo, hi = starts[i], starts[i + 1]
        merged = sorted((t, who, s, e) for who, ev in (("W", w), ("S0", events[0]), ("S1", events[1]))
                        for s, t, e in ev if lo <= t < hi)
        print(f"replicas {replicas}, push {i}: " + " ".join(
            f"{who}:{s}{'(%.0f)' % (e * 1e6) if s == 'sleep' else ''}@{(t - lo) * 1e6:.0f}" for t, who, s, e in merged))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--pushes", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--timelines", type=int, default=0, help="print this many pushes' events of every rank")
    args = ap.parse_args()
    _instrument()
    results: dict = {0: [], 1: []}
    for pair in range(args.pairs):
        for r in ((0, 1) if pair % 2 == 0 else (1, 0)):
            events = _run(r, args.keys, args.pushes)
            if events is not None:
                results[r].append(events)
    if not results[0]:
        return
    for r in (0, 1):
        _timelines(results[r][0], r, args.timelines)
    for r in (0, 1):
        print(f"--- replicas {r}: {args.keys} keys, {args.pushes} pushes x {args.pairs} runs: each stage's "
              f"microseconds after the one before, per push: median [p25, p75], mean")
        rows: dict = {}
        for events in results[r]:
            for name, v in _per_push(events).items():
                rows.setdefault(name, []).extend(v)
        for name, v in rows.items():
            v = np.array(v, dtype=float)
            if v.size:
                print(f"{name:<40} {np.median(v):8.1f}  [{np.percentile(v, 25):7.1f}, {np.percentile(v, 75):7.1f}]"
                      f"  {v.mean():8.1f}")


if __name__ == "__main__":
    main()
