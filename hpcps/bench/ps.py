"""``hpcps bench ps``: push and pull throughput per server beside raw MPI bandwidth, and the cost
of the sleeping waits. Run with 1 server and 1 worker: ``mpiexec -n 2 hpcps bench ps``.

All figures come from one run: medians over repetitions; ratios against the raw MPI ping-pong
bandwidth at the same message size, measured between the same two ranks just before. Each row
also says how many bytes the server received for one such request and sent in reply, counted
from the messages (``request_bytes``, ``reply_bytes``; its GB/s counts the wire format's sizes).
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.ps import filters, protocol, transport
from hpcps.bench import mpi as bench_mpi
from hpcps.ps.context import init
from hpcps_kernels import optim
from hpcps_kernels.profiler import rooflines

SIZES = [1_000, 10_000, 100_000, 1_000_000]
# the request rows: bursts of BURST small requests sent at once, the server's time per request
REQUEST_SIZES = [100, 1_000]
BURST = 400
# the filter rows: a push-pull of these many keys with each traffic filter on (hpcps.ps.filters),
# beside the same request unfiltered
FILTER_SIZES = [2_000, 20_000]  # (not REQUEST_SIZES: the server times push-pulls by their keys)
FILTERS = {"none": filters.Filters(), "push_threshold": filters.Filters(push_threshold=1.0),
           "wire fp16": filters.Filters(wire_dtype="fp16"), "wire bf16": filters.Filters(wire_dtype="bf16"),
           "key_cache": filters.Filters(key_cache=True),
           "fp16+key_cache": filters.Filters(wire_dtype="fp16", key_cache=True)}


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _waiting_cost(comm, rank: int, server: int, worker: int) -> dict | None:
    """Worker CPU while waiting 1 s for a message: blocking MPI Recv vs transport.wait."""
    out = {}
    buf = np.zeros(1)
    for mode in ("blocking Recv", "hpcps wait"):
        if rank == server:
            time.sleep(1.0)
            transport.send_blocking(comm, buf, worker, 99, 30)
        elif rank == worker:
            t, c = time.perf_counter(), time.process_time()
            if mode == "blocking Recv":
                transport.blocking_recv_reference(comm, buf, server, 99)
            else:
                transport.recv_blocking(comm, buf, server, 99, 30)
            out[mode] = (time.process_time() - c) / (time.perf_counter() - t)
        transport.barrier(comm, 30)
    # latency: 8-byte ping-pong with blocking calls vs with the polling wait
    if rank in (server, worker):
        peer = worker if rank == server else server
        times = bench_mpi.pingpong(comm, 8, 200, peer)
        out["rtt_wait_us"] = float(np.median(times)) * 1e6
        times = transport.blocking_pingpong_reference(comm, peer, rank == server, buf, 200)
        out["rtt_blocking_us"] = float(np.median(times)) * 1e6
    return out if rank == worker else None


def run(sizes=SIZES, reps: int = 5, dim: int = 1, optimizer: str = "ftrl", key_bits: int = 64) -> list[dict] | None:
    """Collective over the world; returns the result rows on the first worker, None elsewhere."""
    world = transport.dup()
    if world.Get_size() < 2:
        raise SystemExit("hpcps bench ps needs at least 2 ranks: mpiexec -n 2 hpcps bench ps")
    rank = world.Get_rank()
    server, worker = 0, 1
    # 1. raw MPI bandwidth at each message size, and the cost of waiting, before the PS starts
    raw = {}
    for n in sizes:
        nbytes = protocol.request_bytes(n, 0, dim)
        if rank in (server, worker):
            peer = worker if rank == server else server
            raw[n] = nbytes / (float(np.median(bench_mpi.blocking_pingpong(world, nbytes, reps, peer))) / 2)
        transport.barrier(world, 60)
    waiting = _waiting_cost(world, rank, server, worker)
    raw_requests = {}
    for n in REQUEST_SIZES:
        for op, n_push, n_pull in (("pull", 0, n), ("push+apply", n, 0), ("push-pull", n, n)):
            raw_requests[op, n] = bench_mpi.request_stream(
                world, protocol.request_bytes(n_push, n_pull, dim),
                protocol.reply_bytes(protocol.PULL, n_pull, dim), BURST, reps, server, worker)
    transport.free(world)

    # 2. the parameter server: 1 server, the first worker drives, others idle
    ctx = init(servers=1, staleness=-1, stall_timeout_s=600, traffic=filters.Filters(key_cache=True))
    table = ctx.sparse_table("bench", dim=dim, optimizer=optimizer, key_bits=key_bits, traffic=filters.Filters())
    filtered = {name: ctx.sparse_table(f"bench {name}", dim=dim, optimizer=optimizer, key_bits=key_bits, traffic=f)
                for name, f in FILTERS.items()}
    together = {name: ctx.table_set([t, ctx.sparse_table(f"bench {name} 2", dim=dim, optimizer=optimizer,
                                                         key_bits=key_bits, traffic=FILTERS[name])])
                for name, t in filtered.items()}  # (the filter rows again, two tables in each request)
    rows, inside = None, None
    if ctx.is_server:
        stats = ctx.serve(trace=True)
        # idle spells (the worker sleeps 2 s below) tell what an idle server costs
        idle = stats["idle_gap_cpu_s"] / max(stats["idle_gap_wall_s"], 1e-9)
        print(f"idle server CPU (over {stats['idle_gap_wall_s']:.1f} s without requests): {idle:.1%}", flush=True)
        inside = _server_times(stats["trace"])
    elif ctx.worker_index == 0:
        rows = []
        rng = np.random.default_rng(0)
        roof = rooflines(3)["random_access_m_s"] * 1e6  # random accesses/s of one core, this run
        for n in sizes:
            keys = _keys(rng, n, key_bits)
            grads = rng.normal(size=(keys.size, dim)).astype(np.float32)
            table.wait(table.push(keys, grads))  # create the keys
            t_push = _median_time(lambda: table.wait(table.push(keys, grads)), reps)
            t_pull = _median_time(lambda: table.pull(keys), reps)
            push_bytes = protocol.request_bytes(keys.size, 0, dim) + protocol.REPLY_BYTES
            pull_bytes = protocol.request_bytes(0, keys.size, dim) + protocol.reply_bytes(protocol.PULL, keys.size, dim)
            for op, t, b in (("push+apply", t_push, push_bytes), ("pull", t_pull, pull_bytes)):
                gbs = b / t / 1e9
                rows.append({"op": op, "keys": int(keys.size), "time_s": t, "keys_per_s": keys.size / t,
                             "gb_per_s": gbs, "raw_mpi_gb_per_s": raw[n] / 1e9, "ratio": gbs / (raw[n] / 1e9),
                             "roofline_keys_per_s": roof, "roofline_ratio": keys.size / t / roof})
        rows += _request_rows(ctx, table, rng, dim, reps, raw_requests, key_bits)
        rows += _filter_rows(ctx, filtered, rng, dim, reps, key_bits)
        rows += _filter_rows(ctx, together, rng, dim, reps, key_bits)
        time.sleep(2.0)  # let the server idle
        rows.append({"op": "waiting", **waiting})
    ctx.finalize()
    # the server's own time per request (from its receipt to the reply queued), for the worker's table
    world = transport.dup()
    inside = transport.bcast_object(world, inside, root=server, timeout=60, what="the server's request times")
    transport.free(world)
    width = optim.width(optimizer, dim)
    for r in rows or []:
        if r["op"] == "requests" and (r["request"], r["keys"]) in inside:
            r["server_us"] = inside[r["request"], r["keys"]][0] * 1e6
            r["server_loop_us"] = inside[r["request"], r["keys"]][3] * 1e6
        elif (r["op"], r.get("keys")) in inside:
            t, received, sent, _ = inside[r["op"], r.get("keys")]
            rate = r["keys"] / t
            r.update(server_s=t, server_keys_per_s=rate, server_roofline_ratio=rate / r["roofline_keys_per_s"],
                     server_gb_per_s=r["keys"] * _moved_bytes(r["op"], dim, width) / t / 1e9,
                     request_bytes=received, reply_bytes=sent)
    return rows


def _burst(ctx, messages: list, reply_bytes: int, op: int) -> float:
    """Seconds per request for ``messages`` (packed, with their request ids) sent to the server
    at once, their replies' receives posted first, until every reply has come."""
    replies = [np.empty(reply_bytes, dtype=np.uint8) for _ in messages]
    t = time.perf_counter()
    pending = []
    for (req_id, msg), reply in zip(messages, replies):
        pending += ctx.exchange(0, msg, reply, req_id, op)
    transport.wait(pending, 60, max_sleep=bench_mpi.BURST_MAX_SLEEP_S)
    return (time.perf_counter() - t) / len(messages)


def _keys(rng, n: int, key_bits: int) -> np.ndarray:
    """About ``n`` distinct sorted keys below ``2**key_bits``."""
    if key_bits < 40:  # distinct keys of a bounded (hashed) key space
        return np.sort(rng.choice(2**key_bits, size=min(n, 2**key_bits), replace=False)).astype(np.uint64)
    return np.unique(rng.integers(0, 2**min(key_bits, 63), n, dtype=np.uint64))


def _request_rows(ctx, table, rng, dim: int, reps: int, raw: dict, key_bits: int) -> list[dict]:
    """The server's fixed cost per request: bursts of BURST pulls, pushes and push-pulls (a
    training step's request: the same keys pushed and pulled) of REQUEST_SIZES keys, packed before the clock starts (the worker only posts them), beside raw MPI's blocking
    calls carrying the same bytes (``hpcps.bench.mpi.request_stream``)."""
    rows = []
    for n in REQUEST_SIZES:
        keys = _keys(rng, n, key_bits)
        grads = rng.normal(size=(keys.size, dim)).astype(np.float32)
        table.wait(table.push(keys, grads))  # create the keys
        for op, name in ((protocol.PULL, "pull"), (protocol.PUSH, "push+apply"), (protocol.PUSHPULL, "push-pull")):
            def pack(req_id):
                if op == protocol.PULL:
                    return protocol.Pull(table.id, req_id, ctx.clock_value, ctx.worker_index, keys).pack()
                if op == protocol.PUSH:
                    return protocol.Push(table.id, req_id, ctx.clock_value, ctx.worker_index, keys, grads).pack()
                # (the same clock each time: under ASP the pull is answered at once)
                return protocol.PushPull(table.id, req_id, ctx.clock_value, ctx.worker_index, keys, grads, keys).pack()
            times = []
            for _ in range(reps + 1):  # one warm-up burst
                ids = [ctx.next_request_id() for _ in range(BURST)]
                times.append(_burst(ctx, [(i, pack(i)) for i in ids],
                                    protocol.reply_bytes(op, 0 if op == protocol.PUSH else keys.size, dim), op))
            t = float(np.median(times[1:]))
            rows.append({"op": "requests", "request": name, "keys": int(keys.size), "us_per_request": t * 1e6,
                         "raw_mpi_us_per_request": raw[name, n] * 1e6, "ratio": t / raw[name, n]})
    return rows


def _filter_rows(ctx, tables: dict, rng, dim: int, reps: int, key_bits: int) -> list[dict]:
    """A push-pull round trip (the same keys pushed and pulled, as a step of kept batches) of
    FILTER_SIZES keys through each table of ``tables`` (one per entry of FILTERS), the tables taken
    in turn within each repetition: its median microseconds and the bytes it sent and received,
    each beside the unfiltered table's as a ratio. A table set's (``ctx.table_set``): its tables'
    push-pull in one request per server (``protocol.PUSHPULLS``)."""
    rows = []
    for n in FILTER_SIZES:
        keys = _keys(rng, n, key_bits)
        grads = rng.normal(size=(keys.size, dim)).astype(np.float32)
        times: dict = {name: [] for name in tables}
        traffic: dict = {name: [] for name in tables}
        for rep in range(reps + 1):  # (the first round creates the keys and fills the key caches)
            for name, table in tables.items():
                before = ctx.stats["bytes_sent"] + ctx.stats["bytes_received"]
                t = time.perf_counter()
                if hasattr(table, "tables"):  # (a TableSet)
                    table.wait(table.ipushpull(keys, [grads] * len(table.tables), keys))
                else:
                    table.wait(table.ipushpull(keys, grads, keys, unique=True))
                if rep:
                    times[name].append(time.perf_counter() - t)
                    traffic[name].append(ctx.stats["bytes_sent"] + ctx.stats["bytes_received"] - before)
        base_t, base_b = float(np.median(times["none"])), float(np.median(traffic["none"]))
        for name in tables:
            t, b = float(np.median(times[name])), float(np.median(traffic[name]))
            rows.append({"op": "filter", "filter": name, "tables": len(getattr(tables[name], "tables", [0])),
                         "keys": int(keys.size), "us_per_request": t * 1e6,
                         "bytes_per_request": b, "time_ratio": t / base_t, "bytes_ratio": b / base_b})
    return rows


def format_filter_rows(rows: list[dict]) -> list[str]:
    """The filter rows: a push-pull's time and bytes with each filter, as ratios to none."""
    if not rows:
        return []
    out = [f"{'filter':<15} {'tables':>6} {'keys':>7} {'us/push-pull':>13} {'vs none':>8} {'bytes':>10} {'vs none':>8}"]
    for r in rows:
        out.append(f"{r['filter']:<15} {r['tables']:>6} {r['keys']:>7} {r['us_per_request']:>13.1f} "
                   f"{r['time_ratio']:>7.2f}x {r['bytes_per_request']:>10.0f} {r['bytes_ratio']:>7.2f}x")
    out.append("(filters: a push-pull of the same keys, repeated, through a table with each traffic filter on "
               "(docs/architecture.md), or two such tables in one request per server, medians of the repetitions "
               "taken in turn; bytes both ways; push_threshold 1.0 on normal gradients)")
    return out


def _moved_bytes(op: str, dim: int, width: int) -> int:
    """Bytes of memory the server's kernels read and write per key: a push reads the gradient and
    reads and writes the key's row (parameters and the rule's state); a pull reads the row's
    parameters and writes them into the reply."""
    return 4 * dim + 2 * 4 * width if op == "push+apply" else 2 * 4 * dim


def _server_times(trace: list) -> dict:
    """Per push, and per pull, of each size, with the op named as in the result rows: the median
    seconds the server spent on one, the median bytes it received for one and sent in reply, as
    the messages carried them, and the median seconds from the poll that found one to the loop's
    next poll: ``{(op, keys): (s, bytes received, bytes sent, s with receipt)}``. The first
    push of each size, which creates its keys and is not timed on the worker either, is left out."""
    seen: dict = {}
    for op, n_push, n_pull, *measured in trace:
        if op == protocol.PUSH:
            seen.setdefault(("push+apply", n_push), []).append(measured)
        elif op == protocol.PULL:
            seen.setdefault(("pull", n_pull), []).append(measured)
        elif op == protocol.PUSHPULL:
            seen.setdefault(("push-pull", n_pull), []).append(measured)
    out = {}
    for k, v in seen.items():
        m = np.median(v[1:] if k[0] == "push+apply" and len(v) > 1 else v, axis=0)
        out[k] = (float(m[0]), int(m[1]), int(m[2]), float(m[3]))
    return out


def format_rows(rows: list[dict], optimizer: str) -> str:
    out = [f"{'op':<11} {'keys':>9} {'ms':>9} {'Mkeys/s':>9} {'vs roofline':>11} {'GB/s':>7} {'raw MPI GB/s':>13} "
           f"{'ratio':>6} {'server ms':>10} {'server vs roofline':>19} {'server GB/s':>12}"]
    for r in rows:
        if r["op"] in ("waiting", "requests", "filter"):
            continue
        inside = (f" {r['server_s'] * 1e3:>10.2f} {r['server_roofline_ratio']:>19.0%} {r['server_gb_per_s']:>12.1f}"
                  if "server_s" in r else f" {'-':>10} {'-':>19} {'-':>12}")
        out.append(f"{r['op']:<11} {r['keys']:>9} {r['time_s'] * 1e3:>9.2f} {r['keys_per_s'] / 1e6:>9.2f} "
                   f"{r['roofline_ratio']:>11.0%} {r['gb_per_s']:>7.3f} {r['raw_mpi_gb_per_s']:>13.3f} {r['ratio']:>6.0%}"
                   + inside)
    w = [r for r in rows if r["op"] == "waiting"]
    if w:
        w = w[0]
        out.append(f"(optimizer {optimizer}; push+apply = push round trip with the update applied on the server; "
                   f"roofline = one core's random accesses/s, {rows[0]['roofline_keys_per_s'] / 1e6:.0f} M/s here; "
                   f"ratio = bytes/s against a raw MPI ping-pong (blocking calls) at the same size; "
                   f"server ms = the server's own median time on such a request, from its receipt to the reply queued; "
                   f"server GB/s = the memory its kernels read and write in that time: a push's gradients and each "
                   f"row read and written whole (parameters and the rule's state), a pull's values read and written)")
        out.append(f"waiting 1 s for a message, worker CPU: blocking MPI Recv {w['blocking Recv']:.0%}, "
                   f"hpcps wait {w['hpcps wait']:.0%}")
        out.append(f"8-byte round trip: blocking {w['rtt_blocking_us']:.1f} us, hpcps wait {w['rtt_wait_us']:.1f} us")
    out += format_request_rows([r for r in rows if r["op"] == "requests"])
    out += format_filter_rows([r for r in rows if r["op"] == "filter"])
    return "\n".join(out)


def format_request_rows(rows: list[dict]) -> list[str]:
    """The request rows: microseconds per request in a burst, beside raw MPI's for the same bytes."""
    if not rows:
        return []
    out = [f"{'requests':<11} {'keys':>9} {'us/request':>11} {'raw MPI us':>11} {'ratio':>6} {'server us':>10} "
           f"{'server us with receipt':>22}"]
    for r in rows:
        server = f"{r['server_us']:>10.1f}" if "server_us" in r else f"{'-':>10}"
        server += f" {r['server_loop_us']:>22.1f}" if "server_loop_us" in r else f" {'-':>22}"
        out.append(f"{r['request']:<11} {r['keys']:>9} {r['us_per_request']:>11.1f} "
                   f"{r['raw_mpi_us_per_request']:>11.1f} {r['ratio']:>5.1f}x {server}")
    out.append(f"(requests: {BURST} requests sent at once, packed beforehand, until every reply has come: the "
               f"server's fixed cost per request with its keys' work; raw MPI: the same bytes each way over blocking "
               f"MPI calls, answered by a loop that only receives and replies; server us: its own median time on one, "
               f"from its receipt to the reply queued; with receipt: from the poll that found "
               f"it to the next poll, its receipt included: the serving loop's cost of one request (the scaling "
               f"model's r, with the keys' work))")
    return out
