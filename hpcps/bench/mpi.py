"""Raw MPI point-to-point bandwidth between rank 0 and rank 1: the reference of the PS benchmarks.

Ping-pong of NumPy buffers, reported as one-way bandwidth (bytes / half the round-trip time),
median over repetitions, two ways:

* **blocking** ``Send``/``Recv``: the most MPI gives (it spins a core while it waits): the raw
  reference;
* **hpcps wait**: ``Isend``/``Irecv`` and :func:`hpcps.ps.transport.wait`, which sleeps between polls
  (what hpcps's own messages get). Over shared memory the two are close. Over TCP a message of
  more than the socket's buffer moves only while both sides poll, so the sleeps stretch it.

With the sleeping wait, ``wait_cpu_s`` is rank 0's CPU seconds (user and system: its TCP stack's
sends and receives included) a round trip: it sends one message and receives one, so it is the CPU
of both ends of one message. Across hosts, less the same on one host, it is what the scaling
model charges a message between hosts whose ranks share cores (hpcps/train/scaling.py).
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.ps import transport

# a burst's wait sleeps at most this long between polls (its last sleep stays small beside it)
BURST_MAX_SLEEP_S = 50e-6

SIZES = [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26]


def pingpong(comm, nbytes: int, reps: int, peer: int, timeout: float = 60.0) -> list[float]:
    """Round-trip times (seconds) of ``reps`` ping-pongs of ``nbytes`` with ``peer``."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    out = np.empty_like(buf)
    times = []
    first = comm.Get_rank() < peer
    for _ in range(reps + 1):  # one warm-up round
        t = time.perf_counter()
        if first:
            transport.wait(transport.start_send(comm, buf, peer, 1, "ping"), timeout)
            transport.wait(transport.start_recv(comm, out, peer, 2, "pong"), timeout)
        else:
            transport.wait(transport.start_recv(comm, out, peer, 1, "ping"), timeout)
            transport.wait(transport.start_send(comm, buf, peer, 2, "pong"), timeout)
        times.append(time.perf_counter() - t)
    return times[1:]


def blocking_pingpong(comm, nbytes: int, reps: int, peer: int) -> list[float]:
    """Round-trip times of ``reps`` ping-pongs of ``nbytes`` with ``peer`` over blocking calls."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    return transport.blocking_pingpong_reference(comm, peer, comm.Get_rank() < peer, buf, reps)


def request_stream(comm, request_bytes: int, reply_bytes: int, requests: int, reps: int, server: int, worker: int,
                   timeout: float = 60.0) -> float | None:
    """Seconds per request when ``worker`` sends ``requests`` messages of ``request_bytes`` at once
    and ``server`` answers each with ``reply_bytes`` over blocking MPI calls: the raw floor of a
    parameter server's fixed cost per request, the reference of ``bench ps``'s request rows.
    Median of ``reps`` bursts after one warm-up, on ``worker`` (None elsewhere)."""
    rank = comm.Get_rank()
    times = []
    for _ in range(reps + 1):
        if rank == server:
            transport.blocking_serve_reference(comm, requests, request_bytes, reply_bytes, 3)
        elif rank == worker:
            msgs = [np.zeros(max(request_bytes, 1), dtype=np.uint8)[:request_bytes] for _ in range(requests)]
            replies = [np.empty(max(reply_bytes, 1), dtype=np.uint8)[:reply_bytes] for _ in range(requests)]
            t = time.perf_counter()
            pending = []
            for msg, reply in zip(msgs, replies):
                pending += transport.start_recv(comm, reply, server, 4, "reply")
                pending += transport.start_send(comm, msg, server, 3, "request")
            transport.wait(pending, timeout, max_sleep=BURST_MAX_SLEEP_S)
            times.append((time.perf_counter() - t) / requests)
    return float(np.median(times[1:])) if rank == worker else None


def run_on_world(sizes=SIZES, reps: int = 10) -> list[dict]:
    """:func:`run` over a private duplicate of the world (freed after)."""
    comm = transport.dup()
    try:
        return run(comm, sizes, reps)
    finally:
        transport.free(comm)


def run(comm, sizes=SIZES, reps: int = 10) -> list[dict]:
    """Measure every size; returns rows (on rank 0) of size, latency and bandwidth."""
    if comm.Get_size() < 2:
        raise SystemExit("hpcps bench mpi needs at least 2 ranks (mpiexec -n 2 hpcps bench mpi)")
    rows = []
    for nbytes in sizes:
        r = max(3, min(reps, int(2e8 // max(nbytes, 1))))
        rank = comm.Get_rank()
        if rank <= 1:
            half = float(np.median(blocking_pingpong(comm, nbytes, r, 1 - rank))) / 2
            cpu = time.process_time()
            wait_half = float(np.median(pingpong(comm, nbytes, r, 1 - rank))) / 2
            cpu = (time.process_time() - cpu) / (r + 1)  # (its warm-up round included)
            rows.append({"bytes": nbytes, "reps": r, "one_way_s": half, "gb_per_s": nbytes / half / 1e9,
                         "wait_one_way_s": wait_half, "wait_gb_per_s": nbytes / wait_half / 1e9,
                         "wait_cpu_s": cpu})
        transport.barrier(comm, timeout=120)
    return rows
