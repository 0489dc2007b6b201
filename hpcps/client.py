"""The worker side: ps-lite style push/pull on sparse tables, dense tables, and clocks.

    ts = table.push(keys, grads)      # nonblocking: returns a timestamp
    vals = table.pull(keys)           # blocking; or ts = table.ipull(keys); vals = table.wait(ts)
    table.wait(ts, timeout=...)       # waits for a push's acknowledgements (or a pull's values)
    ctx.clock()                       # ends this worker's iteration

Keys are uint64 in any order, duplicates allowed: a pull returns one row per key as given; a push
*sums* the gradients of duplicate keys (the server applies one update per distinct key). A request
is sliced by server (:mod:`hpcps.placement`), and the messages to all servers are in flight at
once; a message never exceeds 2 GiB (larger requests are split).

Waits poll and sleep (no spinning). A request not answered within ``stall_warn_s`` is reported on
stderr naming the servers and the request; after ``stall_timeout_s`` the wait raises
:class:`hpcps.transport.StallError`, which aborts the job with that message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from hpcps import protocol, transport
from hpcps.tables import TableSpec
from hpcps_kernels import keys as kkeys


@dataclass
class _Request:
    op: int
    table: "SparseTable"
    pending: list = field(default_factory=list)     # sends and receives in flight
    parts: list = field(default_factory=list)       # (positions in the unique keys, reply buffer)
    n_unique: int = 0
    expand: np.ndarray | None = None                # pull: unique position of each requested key
    clock: int = 0
    started: float = 0.0


class SparseTable:
    """A worker's handle on a sparse table (declared identically on every rank)."""

    def __init__(self, ctx, table_id: int, spec: TableSpec):
        self.ctx = ctx
        self.id = table_id
        self.spec = spec
        self.dim = spec.dim
        self._requests: dict[int, _Request] = {}
        self.last_min_clock = None   # smallest worker clock the servers reported for the last pull
        self.max_keys = protocol.max_keys_per_message(self.dim, transport.MAX_MESSAGE_BYTES)

    @property
    def name(self) -> str:
        return self.spec.name

    # -- requests ----------------------------------------------------------------------------

    def _send(self, op: int, keys: np.ndarray, grads: np.ndarray | None) -> _Request:
        ctx = self.ctx
        req = _Request(op, self, n_unique=keys.shape[0], clock=ctx.clock_value, started=time.monotonic())
        order, offsets = ctx.placement.slice(keys)
        for server in range(ctx.layout.servers):
            sel = order[offsets[server]:offsets[server + 1]]
            for lo in range(0, sel.shape[0], self.max_keys):
                chunk = sel[lo:lo + self.max_keys]
                req_id = ctx._next_request_id()
                tag = protocol.reply_tag(req_id, ctx.tag_ub)
                what = f"{protocol.OP_NAMES[op]} reply of table {self.name!r} (request {req_id}) from server"
                reply = np.empty(protocol.reply_bytes(op, chunk.shape[0], self.dim), dtype=np.uint8)
                req.pending += transport.start_recv(ctx.comm, reply, server, tag, what)
                msg = protocol.pack_request(op, self.id, req_id, ctx.clock_value, ctx.worker_index,
                                            keys[chunk], None if grads is None else grads[chunk], self.dim)
                req.pending += transport.start_send(ctx.comm, msg, server, protocol.TAG_REQUEST,
                                               f"{protocol.OP_NAMES[op]} request to server")
                req.parts.append((chunk, reply))
        ts = ctx._next_timestamp()
        self._requests[ts] = req
        return ts

    def ipull(self, keys) -> int:
        """Start pulling the rows of ``keys``; returns a timestamp for :meth:`wait`."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        expand = None
        if not kkeys.is_sorted_unique(keys):
            keys, expand = kkeys.unique_keys(keys)
        ts = self._send(protocol.PULL, keys, None)
        self._requests[ts].expand = expand
        return ts

    def pull(self, keys, timeout: float | None = None) -> np.ndarray:
        """The rows (float32, ``(len(keys), dim)``) of ``keys``, waiting for them."""
        return self.wait(self.ipull(keys), timeout)

    def push(self, keys, grads, aggregate: bool = False) -> int:
        """Send gradients; returns a timestamp for :meth:`wait`.

        Args:
            keys: uint64 keys (any order; duplicates are summed).
            grads: float32, ``(len(keys), dim)`` or flat.
            aggregate: collective over the worker group: the members' pushes are merged on the
                group's first rank (sum per key) and sent once.
        """
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(keys.shape[0], self.dim)
        if not kkeys.is_sorted_unique(keys):
            keys, grads = kkeys.segment_reduce(keys, grads)
        if aggregate and self.ctx.group_comm.Get_size() > 1:
            merged = self.ctx._gather_to_leader(keys, grads, self.dim)
            if merged is None:  # not the leader: nothing to send
                ts = self.ctx._next_timestamp()
                self._requests[ts] = _Request(protocol.PUSH, self)
                return ts
            keys, grads = merged
        return self._send(protocol.PUSH, keys, grads)

    def wait(self, ts: int, timeout: float | None = None):
        """Wait for request ``ts``; returns the pulled rows for a pull, None for a push."""
        req = self._requests.pop(ts)
        ctx = self.ctx
        t = time.perf_counter()
        transport.wait(req.pending, ctx.stall_timeout_s if timeout is None else timeout,
                       warn_after=ctx.stall_warn_s)
        ctx.stats["wait_s"] += time.perf_counter() - t
        min_clock = None
        for _, reply in req.parts:
            h = reply[:protocol.REPLY_BYTES].view(np.int64)
            if h[1] & protocol.STOP:
                ctx.server_stop = True
            min_clock = int(h[2]) if min_clock is None else min(min_clock, int(h[2]))
        if req.op != protocol.PULL:
            return None
        self.last_min_clock = min_clock
        if min_clock is not None:
            ctx.stats["max_staleness"] = max(ctx.stats["max_staleness"], req.clock - min_clock)
        values = [reply[protocol.REPLY_BYTES:].view(np.float32).reshape(-1, self.dim) for _, reply in req.parts]
        if len(req.parts) == 1 and req.expand is None:
            return values[0]  # one server answered for every key, in order
        out = np.empty((req.n_unique, self.dim), dtype=np.float32)
        for (chunk, _), v in zip(req.parts, values):
            kkeys.scatter_rows(out, chunk, v)
        return out if req.expand is None else kkeys.gather_rows(out, req.expand)

    def wait_all(self, timeout: float | None = None) -> None:
        for ts in list(self._requests):
            self.wait(ts, timeout)


class DenseTable:
    """A dense float32 vector of ``size``, stored on the servers as chunks of a sparse table.

    Collective over a worker group: :meth:`push` allreduces (sums) the members' gradients inside
    the group and the group's first rank pushes the sum; :meth:`pull` is done by that rank and
    broadcast to the group. Several groups combine through the servers.
    """

    CHUNK = 1024

    def __init__(self, ctx, sparse: SparseTable, size: int):
        self.ctx = ctx
        self.sparse = sparse
        self.size = size
        self.chunks = -(-size // self.CHUNK)
        self.keys = np.arange(self.chunks, dtype=np.uint64)

    def push(self, grad) -> None:
        grad = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
        if grad.shape[0] != self.size:
            raise ValueError(f"dense table {self.sparse.name!r}: gradient of size {grad.shape[0]}, expected {self.size}")
        total = transport.allreduce(self.ctx.group_comm, grad, "sum", timeout=self.ctx.stall_timeout_s,
                                    what=f"allreduce of dense table {self.sparse.name!r}")
        if self.ctx.group_comm.Get_rank() == 0:
            padded = np.zeros(self.chunks * self.CHUNK, dtype=np.float32)
            padded[: self.size] = total
            self.sparse.wait(self.sparse._send(protocol.PUSH, self.keys, padded.reshape(self.chunks, self.CHUNK)))

    def pull(self) -> np.ndarray:
        out = np.empty(self.size, dtype=np.float32)
        if self.ctx.group_comm.Get_rank() == 0:
            out[:] = self.sparse.pull(self.keys).reshape(-1)[: self.size]
        transport.bcast(self.ctx.group_comm, out, root=0, timeout=self.ctx.stall_timeout_s,
                        what=f"broadcast of dense table {self.sparse.name!r}")
        return out
