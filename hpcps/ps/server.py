"""The server side: the serving loop of a server rank and its table from request op to handler.

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
  exactly the updates of all earlier iterations. With backup workers (``cluster.backup_workers``)
  ``W - b`` workers complete a clock and a late push is dropped or deferred
  (:mod:`hpcps.ps.consistency`).
* Determinism under BSP: pushes are acknowledged on arrival but applied, once every worker has
  passed their clock, in the order (clock, worker, sequence), so the result never depends on
  which message arrived first (with FTRL or AdaGrad the order changes the numbers, not only
  their rounding). A push is thus not visible to pulls of its own iteration. Under SSP and ASP
  pushes are applied on arrival.

The loop never spins: it polls for requests and sleeps between polls with an exponential
back-off (:mod:`hpcps.ps.transport`), so an idle server costs almost no CPU.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np

from hpcps.ps import checkpoint, deltas, failover, filters, protocol, recovery, signals, transport
from hpcps.ps.consistency import NO_BACKUP, Backup, WorkerClocks
from hpcps.ps.placement import Placement
from hpcps.ps.plain_requests import PlainRequests
from hpcps.ps.quick_requests import QuickRequests
from hpcps.ps.replication import Replication, ServerCopies
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import MARGINS_FUNCTION, RESIDUALS_FUNCTION, SERVER_FUNCTIONS, ServerFunction, TableSpec
from hpcps_kernels.parallel import TwoThreads, server_threads_problem, server_threads_setting, splits_pull

# a checkpoint write that fails late, in HDF5's release of the file's objects, says so in one line
transport.EXPLAINERS.append(checkpoint.explain_write_failure)


def server_threads() -> TwoThreads | None:
    """Whether a server runs the halves of a large push or pull at once (``HPCPS_SERVER_THREADS``:
    2, the default, or 1; see :mod:`hpcps_kernels.parallel`)."""
    problem = server_threads_problem()
    if problem:
        raise ValueError(problem)
    return TwoThreads() if server_threads_setting() == "2" else None


def server_tables(specs: list[TableSpec]) -> tuple[list[ServerTable], TwoThreads | None]:
    """A server's table of each spec, and the threads they share (:func:`server_threads`)."""
    tables = [ServerTable(s) for s in specs]
    threads = server_threads()
    for table in tables:
        table.threads = threads
    return tables, threads


def registered_function(name: str) -> ServerFunction:
    """The server function registered under ``name`` (those of the servers' own requests)."""
    if name not in SERVER_FUNCTIONS:
        raise RuntimeError(f"no server function {name!r} is registered (hpcps.ps.margins registers it)")
    return SERVER_FUNCTIONS[name]


def call_result(f: ServerFunction, out, n: int, server: int) -> np.ndarray:
    """Server function ``f``'s result ``out`` over ``n`` keys as float32, checked against the
    shape it declares."""
    out = np.asarray(out, dtype=np.float32)
    want = (n, f.out_width) if f.per_key else (f.out_width,)
    if out.size != int(np.prod(want)):
        raise RuntimeError(f"server {server}: server function {f.name!r} returned shape {out.shape} "
                           f"for {n} keys; it declares {want}")
    return out


def table_counts(tables: list[ServerTable]) -> dict:
    """Each table's rows held, keys admitted and rows evicted (the server's final statistics)."""
    return {"keys": [t.size for t in tables], "admitted": [t.admitted for t in tables],
            "evicted": [t.evicted for t in tables]}


def restore_checkpoint(tables: list[ServerTable], workers: WorkerClocks, ckpt: str, manifest: dict, server: int,
                       replication: Replication) -> None:
    """Load server ``server``'s shards of every table (every shard it keeps a copy of, under
    ``replication``'s placement) from checkpoint ``ckpt``, and its clock as every worker's."""
    deltas.restore(tables, ckpt, manifest, server, *replication.restore_where())  # (or a delta's chain)
    workers.set_all(manifest["clock"])


def write_checkpoint_file(ckpt: str, tables: list[ServerTable], server: int, replication: Replication,
                          clock: int) -> tuple[int, str]:
    """Write server ``server``'s shards of ``tables`` (rows and state; with replicas, those it is
    primary of) into its file of checkpoint directory ``ckpt``, once every table is checked
    finite; returns the file's size and checksum."""
    placement = replication.placement
    path = checkpoint.server_file(ckpt, server)
    for table in tables:
        table.check_finite(f"checkpoint (step {clock})")
    parts = [replication.primary_part((table.spec.name, *table.items(), table.state_arrays())) for table in tables]
    try:
        return checkpoint.write_server_file(path, server, placement.num_servers, placement.num_shards, parts)
    except OSError as e:
        raise checkpoint.write_failure(path, e, f"server {server}") from None


_PUSHPULLS = (protocol.PUSHPULL, protocol.PUSHPULLS)

# what a reply is, in stall messages (made once, not per reply)
_REPLY_WHAT = {op: f"{name} reply" for op, name in protocol.OP_NAMES.items()}


class Replies:
    """A server's replies: packed into pooled buffers with its stop status, the slowest worker's
    clock and the request's table's counts (``protocol.pack_reply``), and sent through ``net``
    (the server's :class:`~hpcps.ps.transport.Transport`) without waiting (:attr:`sending`: the
    sends in flight)."""

    def __init__(self, net: transport.Transport, server_index: int, pool: transport.BufferPool,
                 workers: WorkerClocks, tables: list[ServerTable]):
        self.net = net
        self.index = server_index
        self.pool = pool
        self.workers = workers
        self.tables = tables
        self.tag_ub = net.tag_ub
        self.take = pool.take
        self.sending: list[transport.Pending] = []
        self.posted_bytes = 0  # bytes of the replies posted since the serving loop last looked

    def new(self, req_id: int, payload_bytes: int, table: int = -1,
            apart: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """A reply to request ``req_id`` of table ``table`` (-1: none) and a view of its payload;
        ``apart``: it goes as its header, then its payload (``protocol.PAYLOAD_APART``)."""
        counts = self.tables[table].counts() if table >= 0 else (0, 0, 0)
        return protocol.pack_reply(req_id, protocol.stop_status(signals.requested()), self.workers.min_clock(),
                                   self.index, payload_bytes, counts, self.take, apart)

    def post(self, buf: np.ndarray, dest: int, req_id: int, what: str, apart: bool | None = None) -> None:
        """Send a reply, as its header says (or ``apart``, where known): whole, or its header then
        its payload."""
        tag = protocol.reply_tag(req_id, self.tag_ub)
        if protocol.payload_apart(buf) if apart is None else apart:
            self.sending += self.net.start_send_announced(buf, protocol.REPLY_BYTES, dest, tag, what)
        else:
            self.sending += self.net.start_send(buf, dest, tag, what)
        self.posted_bytes += buf.nbytes

    def take_posted_bytes(self) -> int:
        """The bytes of the replies posted since the last call."""
        n, self.posted_bytes = self.posted_bytes, 0
        return n

    def ack(self, dest: int, req_id: int, table: int, what: str) -> None:
        """An empty reply: request ``req_id`` about table ``table`` is done."""
        self.post(self.new(req_id, 0, table)[0], dest, req_id, what, False)

    def drop_completed(self) -> None:
        if self.sending:
            self.sending = transport.completed(self.sending)

    def finish(self, timeout: float) -> None:
        """Wait for every reply's send."""
        transport.wait(self.sending, timeout=timeout)
        self.sending = []


class ServerReads:
    """How a :class:`Server` answers a read once the clocks allow it (its ``readers``): pulls,
    pulls of several tables, server functions, margins and checkpoints, each reply posted through
    its ``replies``."""

    def _serve_pull(self, source: int, r: protocol.Pull | protocol.PushPull) -> None:
        """Answer a pull, or a push-pull (whose reply is also its push's acknowledgement)."""
        self.answer_pull(source, r.op, r.req_id, r.table, r.pull_keys, r.encoding.wire)

    def answer_pull(self, source: int, op: int, req_id: int, table: int, keys: np.ndarray,
                    wire: int = filters.FP32) -> None:
        """Answer request ``req_id`` (a pull or a push-pull, ``op``) from rank ``source`` with the
        rows of ``keys`` in table ``table``, in the wire type ``wire``. A pull the server runs on
        two threads (``splits_pull``) is answered as its header, sent once the values are ready,
        then the values: the waiting worker sleeps until the header comes rather than spinning
        through the server's work, which leaves the core to the second thread."""
        if wire == filters.FP32 and self.quick.answer_pull(source, op, req_id, table, keys):
            return  # (the commonest pull, in the fewest steps: hpcps.ps.quick_requests)
        failover.before_read(self, keys)
        n, dim = keys.shape[0], self.dims[table]
        apart = splits_pull(n, dim)
        reply, payload = self.replies.new(req_id, protocol.reply_bytes(op, n, dim, wire) - protocol.REPLY_BYTES,
                                          table, apart)
        if n:  # (the rows in the request's wire type: hpcps.ps.filters)
            rows = protocol.pull_into(payload, n, dim, wire)
            self.tables[table].pull(keys, rows, source - self.worker_rank0)
            protocol.encode_pulled(rows, payload, wire)
        self.replies.post(reply, source, req_id, _REPLY_WHAT[op], apart)

    def _serve_tables(self, source: int, r: protocol.TablesPull | protocol.TablesPushPull) -> None:
        """Answer a pull of several tables (or a tables push-pull): each table's counts, then its
        rows (``protocol.tables_reply_bytes``); as :meth:`_serve_pull` for each table."""
        failover.before_read(self, r.pull_keys)
        n, dims, wire = r.pull_keys.shape[0], [self.dims[t] for t in r.tables], r.encoding.wire
        apart = any(splits_pull(n, dim) for dim in dims)
        reply, _ = self.replies.new(r.req_id, protocol.tables_reply_bytes(n, dims, wire) - protocol.REPLY_BYTES,
                                    r.tables[0], apart)
        counts, payloads = protocol.tables_reply_payloads(reply, n, dims, wire)
        worker = source - self.worker_rank0
        for i, t in enumerate(r.tables):
            counts[i] = self.tables[t].counts()
            if n:  # (the rows in the request's wire type, as _serve_pull's)
                rows = protocol.pull_into(payloads[i], n, dims[i], wire)
                self.tables[t].pull(r.pull_keys, rows, worker)
                protocol.encode_pulled(rows, payloads[i], wire)
        self.replies.post(reply, source, r.req_id, _REPLY_WHAT[r.op])

    def _serve_call(self, source: int, r: protocol.Call) -> None:
        """Run a declared server function over the keys this server owns."""
        self.apply_backlog()  # (a function, e.g. early stopping's snapshot, sees every copy's rows)
        f = self.functions[r.function]
        out = call_result(f, f.fn(self.tables[r.table], r.keys, r.args), r.keys.shape[0], self.index)
        reply, payload = self.replies.new(r.req_id, 4 * out.size, r.table)
        payload.view(np.float32)[:] = out.reshape(-1)
        self.replies.post(reply, source, r.req_id, f"call reply ({f.name})")

    def _serve_margins(self, source: int, r: protocol.Margins) -> None:
        """Partial margins of a batch's rows over this server's nonzeros; the nonzeros are kept
        for the worker's RESIDUALS."""
        width = protocol.margin_width(self.dims[r.table])
        reply, payload = self.replies.new(r.req_id, 8 * r.n_rows * width, r.table)
        margins = registered_function(MARGINS_FUNCTION).fn
        margins(self.tables[r.table], r.keys, r.values, r.row_ids, payload.view(np.float64).reshape(r.n_rows, width))
        self.fragments[(source - self.worker_rank0, r.table)] = (r.keys, r.values, r.row_ids)
        self.replies.post(reply, source, r.req_id, "margins reply")

    def _checkpoint_or_defer(self, source: int, r: protocol.Checkpoint) -> None:
        """A checkpoint now or once the clocks allow it; a quorum checkpoint come too late, none."""
        if not self.workers.missed(r):
            self._serve_or_defer(source, r)
            return
        reply, payload = self.replies.new(r.req_id, protocol.CHECKPOINT_RESULT.itemsize)
        protocol.pack_checkpoint_result(payload, protocol.CHECKPOINT_MISSED, "")
        self.replies.post(reply, source, r.req_id, "checkpoint reply")

    def _write_checkpoint(self, source: int, r: protocol.Checkpoint) -> None:
        self._apply(self.workers.late_pushes_kept())  # (backup workers: every push sent before it)
        self.apply_backlog()  # (a snapshot's marks of changed rows cover every copy's)
        size, digest = self.snapshots.snapshot(r.path, r.clock, self.tables, self.replication, write_checkpoint_file)
        reply, payload = self.replies.new(r.req_id, protocol.CHECKPOINT_RESULT.itemsize)
        protocol.pack_checkpoint_result(payload, size, digest)
        self.replies.post(reply, source, r.req_id, "checkpoint reply")
        if r.quorum:  # (the pushes of its clock and later, held while it waited)
            self._apply_pushes_due()
        if r.for_signal:  # (this server's own signal is answered: no more STOP in its replies)
            signals.clear()
            self.workers.stopping, self.workers.stopped_at = False, r.clock

    def _handle_stopping(self, source: int, r: protocol.Stopping) -> None:
        """A worker saw stop signal ``r.signal`` (backup workers): reported as this server's own,
        unless it is one the last signal's checkpoint answered (a worker's notice may come after
        it: with ``checkpoint.on_signal = "continue"`` it would stop the job again)."""
        if r.clock <= self.workers.stopped_at:
            return
        signals.forwarded(r.signal)
        self.stop_known()

    def stop_known(self) -> None:
        """A stop is wanted (this server's signal, or a worker's forwarded): under backup workers
        every read is answered at once until the signal's checkpoint (``WorkerClocks.stopping``):
        a worker held for a clock the workers in the agreement will not push would never see the
        stop, and they would wait for it until ``cluster.stall_timeout_s``."""
        if self.workers.late is not None and not self.workers.stopping:
            self.workers.stopping = True
            self._serve_reads_due()


class Server(ServerReads, PlainRequests, ServerCopies):
    """The serving loop of one server rank, and its handlers, one per request op. ``net``: how it
    reaches the workers (:class:`hpcps.ps.transport.MPITransport` on a server rank; a
    :class:`~hpcps.ps.transport.Loopback` hands it each request of a job of one process)."""

    def __init__(self, net: transport.Transport, server_index: int, num_workers: int, worker_rank0: int,
                 specs: list[TableSpec], placement: Placement, staleness: int,
                 stall_warn_s: float = 30.0, functions: list | None = None, stall_timeout_s: float = 300.0,
                 backup: Backup = NO_BACKUP, key_lists=None):
        self.net = net
        self.key_lists = key_lists  # the key lists workers sent (hpcps.ps.filters.ServerKeyLists), or None
        self.functions = list(functions or [])  # declared ServerFunctions, by number
        self.index = server_index
        self.worker_rank0 = worker_rank0
        self.tables, self.threads = server_tables(specs)
        self.dims = [s.dim for s in specs]
        self.replication = Replication(placement, server_index)  # (self.placement: its placement)
        self.staleness = staleness
        self.stall_warn_s = stall_warn_s
        self.stall_timeout_s = stall_timeout_s
        self.workers = WorkerClocks(num_workers, staleness, backup)
        self.pool = transport.BufferPool()  # large requests and replies
        self.replies = Replies(net, server_index, self.pool, self.workers, self.tables)
        self.quick = QuickRequests(self)  # the commonest requests in the fewest steps
        self.snapshots = deltas.DeltaWriter(server_index, placement.num_servers, placement.num_shards)
        self.snapshots.narrow = self.replication.primary_part  # (a delta writes each shard once too)
        self.stats = {"requests": 0, "general_requests": 0, "idle_s": 0.0, "busy_s": 0.0, "deferred": 0}
        # (op, keys pushed, keys pulled, seconds handling it) of every request, when a list
        # (``hpcps bench ps``: the server's own time beside the round trip)
        self.trace: list | None = None
        self.evicting = any(t.features.eviction for t in self.tables)
        self.fragments: dict = {}  # (worker, table) -> the nonzeros of its last MARGINS
        self.backlog: list = []  # replicas: pushes to backups, applied once the request is answered
        self.recovery = recovery.ServerRecovery(self)  # the "rank lost" event (hpcps.ps.recovery)
        # what a request asks: op -> handler(source, request)
        self.handlers = {
            protocol.PULL: self._serve_or_defer, protocol.CHECKPOINT: self._checkpoint_or_defer,
            protocol.MARGINS: self._serve_or_defer, protocol.CALL: self._serve_or_defer,
            protocol.PUSHPULL: self._handle_push_pull, protocol.PUSH: self._handle_push,
            protocol.RESIDUALS: self._handle_residuals, protocol.CLOCK: self._handle_clock,
            protocol.DONE: self._handle_done, protocol.STOPPING: self._handle_stopping,
            protocol.PULLS: self._serve_or_defer, protocol.PUSHPULLS: self._handle_tables_push_pull,
        }
        self.plain = self.plain_handlers()  # op -> its plain way (source, message, header words) -> done
        # how a read is answered once the clocks allow it: op -> reader(source, request)
        self.readers = {protocol.PULL: self._serve_pull, protocol.PUSHPULL: self._serve_pull,
                        protocol.CHECKPOINT: self._write_checkpoint, protocol.MARGINS: self._serve_margins,
                        protocol.CALL: self._serve_call, protocol.PULLS: self._serve_tables,
                        protocol.PUSHPULLS: self._serve_tables}

    # -- requests ----------------------------------------------------------------------------

    def _handle_push_pull(self, source: int, r: protocol.PushPull) -> None:
        self._push_pull(source, r, ((r.table, r.push_keys, r.grads),), self._serve_pull)

    def _handle_tables_push_pull(self, source: int, r: protocol.TablesPushPull) -> None:
        self._push_pull(source, r, r.pushes(), self._serve_tables)

    def _push_pull(self, source: int, r: protocol.PushPull | protocol.TablesPushPull, pushes: tuple,
                   serve: Callable) -> None:
        """Push at clock c (``pushes``: (table, keys, gradients) of each table), clock
        c + 1 once, pull at clock c + 1 (+ ahead) by ``serve``. When nothing else is to be served or
        applied in between (:meth:`_answers_at_once`), the push's keys the pull reads are updated,
        the pull answered, and then (the reply gone) the push's other keys."""
        worker = source - self.worker_rank0
        self._advance(worker, r.clock_workers, r.clock)
        if r.in_pull is not None and self._answers_at_once(r.push_keys.shape[0], r.clock, r.worker, r.pull_clock):
            rests = [(self.tables[t], self.push_now(worker, t, k, g, r.clock, r.in_pull)) for t, k, g in pushes]
            serve(source, r)
            for table, rest in rests:
                if rest is not None:
                    table.apply_after_reply(rest)
            return
        for t, k, g in pushes:
            self._push(worker, protocol.Push(t, r.req_id, r.clock, r.worker, k, g))
        self._after_clock()
        self._serve_or_defer(source, r)

    def _advance(self, worker: int, clock_workers: int, clock: int) -> None:
        """A push-pull's clock advance past ``clock``: the sender's, or its group's (``clock_workers``
        from ``worker`` on)."""
        for w in range(worker, worker + clock_workers):
            self.workers.advance(w, clock + 1)

    def _answers_at_once(self, n_push: int, clock: int, worker: int, pull_clock: int) -> bool:
        """Whether a push-pull (of ``n_push`` keys at ``clock`` from ``worker``, its header's, pulling
        at ``pull_clock``) has its push applied now and its pull answered now, with nothing else
        served or applied in between: no push kept for its turn, no read waiting, no eviction due,
        under BSP every worker past the push's clock, and the pull ready."""
        if self.workers.waiting or self.evicting or n_push == 0:
            return False
        if self.staleness == 0 and (clock >= self.workers.min_clock() or self.workers.is_late(worker, clock)):
            return False  # (BSP: its clock not complete, or complete without it: a backup worker's late push)
        return self.workers.readable(pull_clock)

    def _handle_push(self, source: int, r: protocol.Push) -> None:
        self._push(source - self.worker_rank0, r)
        self.replies.ack(source, r.req_id, r.table, "push ack")

    def _handle_residuals(self, source: int, r: protocol.Residuals) -> None:
        """The gradients of the worker's last MARGINS nonzeros, pushed at clock c; then clock c + 1."""
        worker = source - self.worker_rank0
        keys, values, row_ids = self.fragments.pop((worker, r.table))
        uniq, grads = registered_function(RESIDUALS_FUNCTION).fn(self.tables[r.table], keys, values, row_ids,
                                                                 r.residuals)
        self._push(worker, protocol.Push(r.table, r.req_id, r.clock, r.worker, uniq, grads))
        self.workers.advance(worker, r.clock + 1)
        self._after_clock()
        self.replies.ack(source, r.req_id, r.table, "residuals ack")

    def _handle_clock(self, source: int, r: protocol.Clock) -> None:
        self.workers.advance(source - self.worker_rank0, r.clock)
        self._after_clock()

    def _handle_done(self, source: int, r: protocol.Done) -> None:
        self.workers.finish(source - self.worker_rank0)
        self._apply_pushes_due()
        self._serve_reads_due()

    def _push(self, worker: int, push: protocol.Push) -> None:
        """Apply a push now (SSP/ASP), or keep it for its turn (BSP, see the module docstring)."""
        if push.keys.shape[0] == 0:
            return
        if self.staleness == 0:
            self.workers.keep_push(worker, push)
        else:
            self.push_now(worker, push.table, push.keys, push.grads, push.clock)

    def _after_clock(self) -> None:
        """A worker's clock advanced: the pushes, evictions and reads it allows."""
        self._apply_pushes_due()
        self._evict_if_due()
        self._serve_reads_due()

    def _evict_if_due(self) -> None:
        """Every ``evict_every_steps`` clocks (of the slowest worker, once its pushes are applied
        under BSP), evict by age and norm: the same point of the run whatever the message order."""
        if self.evicting:
            now = self.workers.min_clock()
            for table in self.tables:
                table.evict_if_due(now)

    def _apply_pushes_due(self) -> None:
        """BSP: apply, in (clock, worker, seq) order, the pushes of clocks every worker has passed."""
        self._apply(self.workers.pushes_due())

    def _apply(self, pushes: list[tuple[int, protocol.Push]]) -> None:
        for worker, push in pushes:
            self.push_now(worker, push.table, push.keys, push.grads, push.clock)

    def _serve_or_defer(self, source: int, r: protocol.Message) -> None:
        if self.workers.ready(r) or (r.op in _PUSHPULLS and r.pull_keys.shape[0] == 0):  # a bare push + clock
            self.readers[r.op](source, r)
        else:
            self.workers.defer(source, r, time.monotonic())
            self.stats["deferred"] += 1

    def _serve_reads_due(self) -> None:
        for source, r in self.workers.reads_due():
            self.readers[r.op](source, r)

    def lose_worker(self, worker: int, clock: int) -> None:
        """Worker ``worker`` is gone, ``clock`` its last complete clock (:mod:`hpcps.ps.recovery`):
        go on without it, serving what its loss lets through."""
        rank = worker + self.worker_rank0
        self.workers.lose(worker, clock, rank)
        self.fragments = {k: v for k, v in self.fragments.items() if k[0] != worker}
        self.replies.sending = [p for p in self.replies.sending if p.peer != rank]
        self._after_clock()

    def restore(self, ckpt: str, manifest: dict) -> None:
        """Load this server's shards of every table (under the current placement) and the clock."""
        restore_checkpoint(self.tables, self.workers, ckpt, manifest, self.index, self.replication)

    # -- loop --------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker has sent DONE; returns statistics."""
        ServingLoop(self).run()
        self.snapshots.wait()  # (a delta snapshot's file being written)
        self.replies.finish(self.stall_timeout_s)
        if self.threads is not None:
            self.threads.close()
        if self.trace is not None:
            self.stats["trace"] = self.trace
        return self.final_stats()

    def final_stats(self) -> dict:
        """The serving statistics with each table's rows held, keys admitted and rows evicted."""
        self.stats.update(table_counts(self.tables), **self.copy_stats())
        self.stats.update(self.workers.late_counts())  # (backup workers: what each lost)
        return self.stats


QUIET_S = 0.5  # a serving loop this long without a request counts its CPU while idle (idle_gap_cpu_s)


class ServingLoop:
    """Receives a server's requests and hands each to :meth:`Server.handle` until every worker is
    done and nothing waits: it polls and sleeps between polls (no spinning), warns of reads that
    wait too long, and times each request (the server's statistics and trace)."""

    def __init__(self, server: Server):
        self.server = server
        self.poll = transport.Poller()
        self.warned: set = set()  # the stalled reads already reported
        self.last_check = time.monotonic()
        self.last_request = time.perf_counter()  # when the last request's handling ended
        # a quiet spell's clocks (wall, CPU), read once the loop has had no request for QUIET_S
        # (the CPU clock is a system call: not read once a request), else None
        self.quiet_since: tuple[float, float] | None = None

    def run(self) -> None:
        server = self.server
        server.stats.update(idle_gap_wall_s=0.0, idle_gap_cpu_s=0.0)
        while (server.copying is not None and server.copying.due()) or not server.workers.all_done \
                or server.workers.waiting:  # (due: new backups after a lost server, hpcps.ps.rereplication)
            try:
                self._serve_one()
            except transport.RankFailed as e:  # (under ULFM: a rank is gone)
                server.recovery.ranks_lost(e)

    def _serve_one(self) -> None:
        """Receive and handle one request, or idle."""
        server = self.server
        probed = time.perf_counter()
        got = server.net.probe_request(protocol.TAG_REQUEST, server.pool.take)
        if got is None:
            self._idle()
            return
        source, buf = got
        words = protocol.request_words(buf)
        # (a transfer: before the request's own time; the flag checked here, on every request)
        grads = self._apart_grads(source, buf, words) if words[8] & protocol.GRADS_APART else None
        self._handle_timed(source, buf, words, grads, probed)

    def _idle(self) -> None:
        """No request: while the poller spins, poll again at once; else finish the sends that are
        done, check for stalled reads now and then, sleep."""
        server = self.server
        if self.poll.spinning():  # (the bookkeeping once a sleep, not once a poll)
            return
        server.replies.drop_completed()
        if self.quiet_since is None and time.perf_counter() - self.last_request > QUIET_S:
            self.quiet_since = (time.perf_counter(), time.process_time())
        if signals.requested():  # (this server's own stop signal)
            server.stop_known()
        now = time.monotonic()
        if now - self.last_check > 1.0:
            self._warn_of_stalled_reads()
            self.last_check = now
        server.stats["idle_s"] += self.poll.idle()

    def _handle_timed(self, source: int, buf: np.ndarray, words: tuple, grads: np.ndarray | None,
                      probed: float) -> None:
        server, stats = self.server, self.server.stats
        t = time.perf_counter()
        if self.quiet_since is not None:  # a quiet spell: what did waiting cost?
            stats["idle_gap_wall_s"] += t - self.quiet_since[0]
            stats["idle_gap_cpu_s"] += time.process_time() - self.quiet_since[1]
            self.quiet_since = None
        server.handle(source, buf, grads, words)
        end = time.perf_counter()
        stats["busy_s"] += end - t
        sent = server.replies.take_posted_bytes()
        # keep polling without sleep while the replies just queued should be in transfer
        self.poll.reset(sent, end)
        self.last_request = end
        if server.trace is not None:  # (the bytes as MPI carried them: the probed size, the replies queued;
            looped = time.perf_counter()  # the loop's time on it: from the poll that found it to the next poll)
            op, _, _, n_push, n_pull, *_ = words
            server.trace.append((op, n_push, n_pull, end - t, buf.nbytes + (0 if grads is None else grads.nbytes),
                                 sent, looped - probed))

    def _apart_grads(self, source: int, buf: np.ndarray, words: tuple) -> np.ndarray | None:
        """The gradients that follow request ``buf`` (header ``words``) from ``source`` as a message
        of their own (``protocol.GRADS_APART``: the next ``TAG_GRADS`` message from that rank), or None."""
        server = self.server
        nbytes = protocol.apart_grads_bytes(buf, server.dims, words)
        if not nbytes:
            return None
        grads = server.pool.take(nbytes)
        transport.wait(server.net.start_recv(grads, source, protocol.TAG_GRADS,
                                             f"gradients of request {words[2]} from rank {source}"),
                       timeout=server.stall_timeout_s, warn_after=server.stall_warn_s)
        return grads

    def _warn_of_stalled_reads(self) -> None:
        server = self.server
        for source, r, waited, need, behind in server.workers.stalled_reads(time.monotonic(), server.stall_warn_s,
                                                                             self.warned):
            sys.stderr.write(
                f"hpcps: server {server.index} (rank {server.net.rank}): {protocol.OP_NAMES[r.op]} from rank "
                f"{source} at clock {r.pull_clock} waits {waited:.0f} s for rank(s) "
                f"{[w + server.worker_rank0 for w in behind]} to reach clock {need} (staleness {server.staleness})\n")
            sys.stderr.flush()
