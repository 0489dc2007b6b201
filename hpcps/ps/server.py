"""The server side: the serving loop of a server rank.

A server rank owns, for every declared table, the keys of the virtual shards placed on it
(:mod:`hpcps.ps.placement`): a :class:`~hpcps.ps.server_table.ServerTable` each, whose rows are in
a :class:`~hpcps.ps.store.RowStore` and whose admission, eviction and memory budget are the
objects of :mod:`hpcps.ps.policies`. The servers' own computation (``MARGINS``, ``RESIDUALS``)
and users' requests (``CALL``) run server functions from the registry
(:func:`hpcps.ps.tables.register_server_function`); the server knows no model's maths.

Semantics a worker can rely on:

* A pull of a key never pushed returns the table's initializer for that key and creates nothing.
* A push creates missing keys (initializer, then the update) and applies the optimizer to each
  key once per push: the client merges duplicate keys by summing their gradients before sending.
* Requests from one worker are applied in the order it sent them.
* Consistency: the server knows every worker's clock. A pull sent at clock ``c`` is answered only
  once every worker has clocked at least ``c - staleness`` (BSP: staleness 0; ASP: staleness < 0,
  never waits). A worker sends its pushes before its clock message, so under BSP a pull sees
  exactly the updates of all earlier iterations.
* Determinism under BSP: pushes are acknowledged on arrival but applied, once every worker has
  passed their clock, in the order (clock, worker, sequence), so the result never depends on
  which message arrived first (with FTRL or AdaGrad the order changes the numbers, not only
  their rounding). A push is thus not visible to pulls of its own iteration. Under SSP and ASP
  pushes are applied on arrival.

The loop never spins: it polls for requests and sleeps between polls with an exponential
back-off (:mod:`hpcps.ps.transport`), so an idle server costs almost no CPU.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from hpcps.ps import checkpoint, protocol, signals, transport
from hpcps.ps.placement import Placement
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import MARGINS_FUNCTION, RESIDUALS_FUNCTION, SERVER_FUNCTIONS, ServerFunction, TableSpec
from hpcps_kernels.parallel import TwoThreads

# a checkpoint write that fails late, in HDF5's release of the file's objects, says so in one line
transport.EXPLAINERS.append(checkpoint.explain_write_failure)


def server_threads() -> TwoThreads | None:
    """Whether a server runs the halves of a large push or pull at once (``HPCPS_SERVER_THREADS``:
    2, the default, or 1; see :mod:`hpcps_kernels.parallel`)."""
    value = os.environ.get("HPCPS_SERVER_THREADS", "2").strip()
    if value not in ("1", "2"):
        raise ValueError(f"HPCPS_SERVER_THREADS must be 1 or 2 (got {value!r})")
    return TwoThreads() if value == "2" else None


def registered_function(name: str) -> ServerFunction:
    """The server function registered under ``name`` (those of the servers' own requests)."""
    if name not in SERVER_FUNCTIONS:
        raise RuntimeError(f"no server function {name!r} is registered (hpcps.ps.margins registers it)")
    return SERVER_FUNCTIONS[name]


class Server:
    """The serving loop of one server rank."""

    def __init__(self, comm, server_index: int, num_workers: int, worker_rank0: int,
                 specs: list[TableSpec], placement: Placement, staleness: int,
                 stall_warn_s: float = 30.0, functions: list | None = None, stall_timeout_s: float = 300.0):
        self.comm = comm
        self.functions = list(functions or [])  # declared ServerFunctions, by number
        self.index = server_index
        self.num_workers = num_workers
        self.worker_rank0 = worker_rank0
        self.tables = [ServerTable(s) for s in specs]
        self.threads = server_threads()
        for table in self.tables:
            table.threads = self.threads
        self.dims = [s.dim for s in specs]
        self.placement = placement
        self.staleness = staleness
        self.stall_warn_s = stall_warn_s
        self.stall_timeout_s = stall_timeout_s
        self.clocks = np.zeros(num_workers, dtype=np.int64)
        self.done = np.zeros(num_workers, dtype=bool)
        self.n_done = 0           # workers that sent DONE (the loop's test, without a NumPy reduction)
        self.deferred: list[tuple[int, protocol.Request, float]] = []  # (source, request, since)
        # BSP: (clock, worker, seq, request) of pushes waiting for every worker to pass their clock
        self.buffered: list[tuple[int, int, int, protocol.Request]] = []
        self.seq = 0
        self.sending: list[transport.Pending] = []
        self.pool = transport.BufferPool()  # large requests and replies
        self.tag_ub = transport.tag_upper_bound(comm)
        self.stats = {"requests": 0, "idle_s": 0.0, "busy_s": 0.0, "deferred": 0}
        # (op, keys pushed, keys pulled, seconds handling it) of every request, when a list
        # (``hpcps bench ps``: the server's own time beside the round trip)
        self.trace: list | None = None
        self.evicting = any(t.features.eviction for t in self.tables)
        self.fragments: dict = {}  # (worker, table) -> the nonzeros of its last MARGINS

    # -- consistency -------------------------------------------------------------------------

    def min_clock(self) -> int:
        """The smallest clock of the workers not done (plain Python: a few workers, called per request)."""
        live = [c for c, d in zip(self.clocks.tolist(), self.done.tolist()) if not d]
        return min(live) if live else max(self.clocks.tolist(), default=0)

    def _ready(self, r: protocol.Request) -> bool:
        """A pull waits for its clock - staleness; a checkpoint for every worker to reach its clock."""
        if r.op == protocol.CHECKPOINT:
            return r.clock <= self.min_clock()
        return self.staleness < 0 or r.pull_clock - self.staleness <= self.min_clock()

    def restore(self, ckpt: str, manifest: dict) -> None:
        """Load this server's shards of every table (under the current placement) and the clock."""
        where = (self.index, self.placement.shard_server, self.placement.num_servers)
        for table in self.tables:
            keys, rows = checkpoint.read_for_server(ckpt, manifest, table.spec.name, *where)
            state = checkpoint.read_state_for_server(ckpt, manifest, table.spec.name, *where)
            table.restore_checkpoint(keys, rows, state, manifest["clock"])
        self.clocks[:] = manifest["clock"]

    def _write_checkpoint(self, source: int, r: protocol.Request) -> None:
        path = checkpoint.server_file(protocol.decode_path(r.pull_keys), self.index)
        for table in self.tables:
            table.check_finite(f"checkpoint (step {r.clock})")
        parts = [(table.spec.name, *table.items(), table.state_arrays()) for table in self.tables]
        try:
            size, digest = checkpoint.write_server_file(path, self.index, self.placement.num_servers,
                                                        self.placement.num_shards, parts)
        except OSError as e:
            raise checkpoint.write_failure(path, e, f"server {self.index}") from None
        reply, payload = self._reply(r.req_id, protocol.CHECKPOINT_RESULT.itemsize)
        protocol.pack_checkpoint_result(payload, size, digest)
        self._send(reply, source, r.req_id, "checkpoint reply")

    # -- requests ----------------------------------------------------------------------------

    def _reply(self, req_id: int, payload_bytes: int, table: int = -1) -> tuple[np.ndarray, np.ndarray]:
        status = protocol.stop_status(signals.requested())
        t = self.tables[table] if table >= 0 else None
        counts = (t.size, t.admitted, t.evicted) if t is not None else (0, 0, 0)
        return protocol.pack_reply(req_id, status, self.min_clock(), self.index, payload_bytes, counts,
                                   self.pool.take)

    def _send(self, buf: np.ndarray, dest: int, req_id: int, what: str, announced: bool = False) -> None:
        """Send a reply (``announced``: as header then payload, see ``protocol.announced``)."""
        tag = protocol.reply_tag(req_id, self.tag_ub)
        if announced:
            self.sending.extend(transport.start_send_announced(self.comm, buf, protocol.REPLY_BYTES, dest, tag, what))
        else:
            self.sending.extend(transport.start_send(self.comm, buf, dest, tag, what))

    def _serve_pull(self, source: int, r: protocol.Request) -> None:
        """Answer a pull, or a push-pull (whose reply is also its push's acknowledgement)."""
        n, dim = r.pull_keys.shape[0], self.dims[r.table]
        reply, payload = self._reply(r.req_id, 4 * n * dim, r.table)
        if n:
            self.tables[r.table].pull(r.pull_keys, payload.view(np.float32).reshape(n, dim),
                                      source - self.worker_rank0)
        self._send(reply, source, r.req_id, f"{protocol.OP_NAMES[r.op]} reply", protocol.announced(r.op, n, dim))

    def _push(self, worker: int, r: protocol.Request) -> None:
        """Apply a push now (SSP/ASP), or keep it for its turn (BSP, see the module docstring)."""
        if r.push_keys.shape[0] == 0:
            return
        if self.staleness == 0:
            self.seq += 1
            self.buffered.append((r.clock, worker, self.seq, r))
        else:
            self.tables[r.table].push(r.push_keys, r.grads, r.clock, worker)

    def _advance(self, worker: int, clock: int) -> None:
        self.clocks[worker] = max(self.clocks[worker], clock)
        self._apply_buffered()
        self._evict_if_due()
        self._release_deferred()

    def _evict_if_due(self) -> None:
        """Every ``evict_every_steps`` clocks (of the slowest worker, once its pushes are applied
        under BSP), evict by age and norm: the same point of the run whatever the message order."""
        if not self.evicting:
            return
        now = self.min_clock()
        for table in self.tables:
            table.evict_if_due(now)

    def _apart_grads(self, source: int, buf: np.ndarray) -> np.ndarray | None:
        """The gradients that follow a request from ``source`` as a message of their own
        (``protocol.GRADS_APART``: the next ``TAG_GRADS`` message from that rank), or None."""
        nbytes = protocol.apart_grads_bytes(buf, self.dims)
        if not nbytes:
            return None
        grads = self.pool.take(nbytes)
        transport.wait(transport.start_recv(self.comm, grads, source, protocol.TAG_GRADS,
                                            f"gradients of request {protocol.header(buf)['req_id']} from rank {source}"),
                       timeout=self.stall_timeout_s, warn_after=self.stall_warn_s)
        return grads

    def handle(self, source: int, buf: np.ndarray, grads: np.ndarray | None = None) -> None:
        """Serve request ``buf`` from rank ``source`` (``grads``: its gradients, when they came
        apart)."""
        r = protocol.unpack_request(buf, self.dims, grads)
        worker = source - self.worker_rank0
        self.stats["requests"] += 1
        if r.op == protocol.PUSHPULL and r.in_pull is not None and self._answers_at_once(worker, r):
            # the push's keys the pull reads, the pull, then (the reply gone) the push's other keys
            table = self.tables[r.table]
            rest = table.push(r.push_keys, r.grads, r.clock, worker, in_pull=r.in_pull)
            self._serve_pull(source, r)
            if rest is not None:
                table.apply_after_reply(rest)
        elif r.op == protocol.PUSHPULL:  # push at clock c, clock c + 1, pull at clock c + 1 (+ ahead)
            self._push(worker, r)
            self._advance(worker, r.clock + 1)
            self._serve_or_defer(source, r)
        elif r.op in (protocol.PULL, protocol.CHECKPOINT):
            self._serve_or_defer(source, r)
        elif r.op == protocol.PUSH:
            self._push(worker, r)
            self._send(self._reply(r.req_id, 0, r.table)[0], source, r.req_id, "push ack")
        elif r.op in (protocol.MARGINS, protocol.CALL):
            self._serve_or_defer(source, r)
        elif r.op == protocol.RESIDUALS:  # push at clock c, then clock c + 1
            keys, values, row_ids = self.fragments.pop((worker, r.table))
            residuals = registered_function(RESIDUALS_FUNCTION).fn
            uniq, grads = residuals(self.tables[r.table], keys, values, row_ids, r.residuals)
            self._push(worker, protocol.Request(protocol.PUSH, r.table, r.req_id, r.clock, r.worker, uniq, grads,
                                                r.pull_keys))
            self._advance(worker, r.clock + 1)
            self._send(self._reply(r.req_id, 0, r.table)[0], source, r.req_id, "residuals ack")
        elif r.op == protocol.CLOCK:
            self._advance(worker, r.clock)
        elif r.op == protocol.DONE:
            if not self.done[worker]:
                self.done[worker] = True
                self.n_done += 1
            self._apply_buffered()
            self._release_deferred()
        else:
            raise RuntimeError(f"server {self.index}: unknown request op {r.op} from rank {source}")

    def _answers_at_once(self, worker: int, r: protocol.Request) -> bool:
        """Advance ``worker``'s clock past a push-pull's push and say whether its push is applied
        now and its pull answered now, with nothing else served or applied in between (then part
        of its push may wait until after the reply): no push kept for its turn, no pull waiting,
        no eviction due, under BSP every worker past the push's clock, and the pull ready."""
        self.clocks[worker] = max(self.clocks[worker], r.clock + 1)  # (as _advance does)
        if self.buffered or self.deferred or self.evicting or r.push_keys.shape[0] == 0:
            return False
        return (self.staleness != 0 or r.clock < self.min_clock()) and self._ready(r)

    def _serve_or_defer(self, source: int, r: protocol.Request) -> None:
        if self._ready(r) or (r.op == protocol.PUSHPULL and r.pull_keys.shape[0] == 0):  # a bare push + clock
            self._serve_deferrable(source, r)
        else:
            self.deferred.append((source, r, time.monotonic()))
            self.stats["deferred"] += 1

    def _apply_buffered(self) -> None:
        """BSP: apply, in (clock, worker, seq) order, the pushes of clocks every worker has passed."""
        if not self.buffered:
            return
        limit = self.min_clock() if self.n_done < self.num_workers else np.iinfo(np.int64).max
        ready = sorted((b for b in self.buffered if b[0] < limit), key=lambda b: b[:3])
        if not ready:
            return
        self.buffered = [b for b in self.buffered if b[0] >= limit]
        for _, worker, _, r in ready:
            self.tables[r.table].push(r.push_keys, r.grads, r.clock, worker)

    def _release_deferred(self) -> None:
        if not self.deferred:
            return
        keep = []
        for source, r, since in self.deferred:
            if self._ready(r):
                self._serve_deferrable(source, r)
            else:
                keep.append((source, r, since))
        self.deferred = keep

    def _serve_deferrable(self, source: int, r: protocol.Request) -> None:
        if r.op == protocol.CHECKPOINT:
            self._write_checkpoint(source, r)
        elif r.op == protocol.MARGINS:
            self._serve_margins(source, r)
        elif r.op == protocol.CALL:
            self._serve_call(source, r)
        else:
            self._serve_pull(source, r)

    def _serve_call(self, source: int, r: protocol.Request) -> None:
        """Run a declared server function over the keys this server owns."""
        f = self.functions[r.function]
        n = r.push_keys.shape[0]
        out = np.asarray(f.fn(self.tables[r.table], r.push_keys, r.grads), dtype=np.float32)
        want = (n, f.out_width) if f.per_key else (f.out_width,)
        if out.size != int(np.prod(want)):
            raise RuntimeError(f"server {self.index}: server function {f.name!r} returned shape {out.shape} "
                               f"for {n} keys; it declares {want}")
        reply, payload = self._reply(r.req_id, 4 * out.size, r.table)
        payload.view(np.float32)[:] = out.reshape(-1)
        self._send(reply, source, r.req_id, f"call reply ({f.name})")

    def _serve_margins(self, source: int, r: protocol.Request) -> None:
        """Partial margins of a batch's rows over this server's nonzeros; the nonzeros are kept
        for the worker's RESIDUALS."""
        width = protocol.margin_width(self.dims[r.table])
        reply, payload = self._reply(r.req_id, 8 * r.n_rows * width, r.table)
        values = r.grads[:, 0]
        margins = registered_function(MARGINS_FUNCTION).fn
        margins(self.tables[r.table], r.push_keys, values, r.row_ids, payload.view(np.float64).reshape(r.n_rows, width))
        self.fragments[(source - self.worker_rank0, r.table)] = (r.push_keys, values, r.row_ids)
        self._send(reply, source, r.req_id, "margins reply")

    def _check_stalled_pulls(self, warned: set) -> None:
        now = time.monotonic()
        for source, r, since in self.deferred:
            if now - since > self.stall_warn_s and id(r) not in warned:
                warned.add(id(r))
                need = r.clock if r.op == protocol.CHECKPOINT else r.pull_clock - self.staleness
                behind = [int(w) + self.worker_rank0 for w in np.flatnonzero((self.clocks < need) & ~self.done)]
                sys.stderr.write(
                    f"hpcps: server {self.index} (rank {self.comm.Get_rank()}): {protocol.OP_NAMES[r.op]} from rank "
                    f"{source} at clock {r.pull_clock} waits {now - since:.0f} s for rank(s) {behind} to reach clock "
                    f"{need} (staleness {self.staleness})\n")
                sys.stderr.flush()

    # -- loop --------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker has sent DONE; returns statistics."""
        poll = transport.Poller()
        warned: set = set()
        last_check = time.monotonic()
        last_request = (time.perf_counter(), time.process_time())
        self.stats.update(idle_gap_wall_s=0.0, idle_gap_cpu_s=0.0)
        while self.n_done < self.num_workers or self.deferred or self.buffered:
            got = transport.probe_request(self.comm, protocol.TAG_REQUEST, self.pool.take)
            if got is None:
                if self.sending:
                    self.sending = transport.completed(self.sending)
                now = time.monotonic()
                if now - last_check > 1.0:
                    self._check_stalled_pulls(warned)
                    last_check = now
                self.stats["idle_s"] += poll.idle()
                continue
            source, buf = got
            grads = self._apart_grads(source, buf)  # (a transfer: before the request's own time)
            t = time.perf_counter()
            cpu = time.process_time()
            if t - last_request[0] > 0.5:  # a quiet spell: what did waiting cost?
                self.stats["idle_gap_wall_s"] += t - last_request[0]
                self.stats["idle_gap_cpu_s"] += cpu - last_request[1]
            queued = len(self.sending)
            self.handle(source, buf, grads)
            busy = time.perf_counter() - t
            self.stats["busy_s"] += busy
            if self.trace is not None:  # (the bytes as MPI carried them: the probed size, the sends queued)
                h = protocol.header(buf)
                self.trace.append((int(h["op"]), int(h["n_push"]), int(h["n_pull"]), busy,
                                   buf.nbytes + (0 if grads is None else grads.nbytes),
                                   sum(p.nbytes for p in self.sending[queued:])))
            # keep polling without sleep while the replies just queued should be in transfer
            poll.reset(sum(p.nbytes for p in self.sending))
            last_request = (time.perf_counter(), time.process_time())
        transport.wait(self.sending, timeout=self.stall_timeout_s)
        self.sending = []
        if self.threads is not None:
            self.threads.close()
        if self.trace is not None:
            self.stats["trace"] = self.trace
        return self.final_stats()

    def final_stats(self) -> dict:
        """The serving statistics with each table's rows held, keys admitted and rows evicted."""
        self.stats["keys"] = [t.size for t in self.tables]
        self.stats["admitted"] = [t.admitted for t in self.tables]
        self.stats["evicted"] = [t.evicted for t in self.tables]
        return self.stats


class LocalServer(Server):
    """A server inside the worker's process (a job of one process): the worker hands it each
    request as bytes and it answers at once into :attr:`outbox` (req_id -> reply bytes); no
    message is sent. With one worker nothing is ever deferred: its own clock is the slowest."""

    def __init__(self, specs: list[TableSpec], placement: Placement, staleness: int, functions: list,
                 stall_timeout_s: float = 300.0):
        super().__init__(transport.self_comm(), 0, 1, 1, specs, placement, staleness, functions=functions,
                         stall_timeout_s=stall_timeout_s)
        self.outbox: dict[int, np.ndarray] = {}

    def _send(self, buf: np.ndarray, dest: int, req_id: int, what: str, announced: bool = False) -> None:
        self.outbox[req_id] = buf
