"""``hpcps.init``: split the world into servers and worker groups, declare tables, serve, finish.

    ctx = hpcps.init(servers=1, worker_groups=None, staleness=0)
    w = ctx.sparse_table("w", dim=1, optimizer="ftrl", params={"alpha": 0.1})
    if ctx.is_server:
        ctx.serve()                     # returns when every worker has called finalize()
    else:
        vals = w.pull(keys); w.push(keys, grads); ctx.clock()
    ctx.finalize()

Everything here is collective over the world (init, table declarations, finalize) or over a
worker group (aggregated pushes, dense tables). Nothing happens at import.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcps.ps import checkpoint, collectives, deltas, failover, filters, protocol, recovery, replication, signals, transport
from hpcps.ps import margins  # noqa: F401 - registers the server functions of MARGINS and RESIDUALS
from hpcps.ps.client import DenseTable, SparseTable, TableSet, push_residual
from hpcps.ps.consistency import NO_BACKUP, Backup
from hpcps.ps.layout import Layout, LayoutError, check_world
from hpcps.ps.placement import DEFAULT_SHARDS, Placement
from hpcps.ps.server import Server
from hpcps.ps.tables import SERVER_FUNCTIONS, Features, ServerFunction, TableSpec
from hpcps_kernels import keys as kkeys
from hpcps_kernels.hashtable import set_up_numba


# what a request and its reply are, in stall messages
_REQUEST_WHAT = {op: f"{name} request to server" for op, name in protocol.OP_NAMES.items()}


def _reply_what(op: int, table: str, req_id: int) -> str:
    of = f" of table {table!r}" if table else ""
    return f"{protocol.OP_NAMES[op]} reply{of} (request {req_id}) from server"


class ConfigMismatch(RuntimeError):
    """Ranks disagree on something that must be identical everywhere."""


class TableDeclarations:
    """A context's declarations of tables and server functions: collective, each checked identical
    on every rank (:class:`ConfigMismatch` otherwise). The context keeps what they declare:
    ``specs``, ``functions`` and ``tables``."""

    def _check_same(self, what: str, value: int) -> None:
        """Collective: raise on every rank if ranks passed different values."""
        if not transport.agree(self.comm, value, self.stall_timeout_s, f"check of {what}"):
            raise ConfigMismatch(f"{transport.rank_prefix(self.comm)}: ranks disagree on {what} "
                                 f"(declare tables and settings identically on every rank)")

    def sparse_table(self, name: str, dim: int = 1, optimizer: str = "sgd", params: dict | None = None,
                     init: str = "zeros", init_scale: float = 0.01, seed: int = 0, key_bits: int = 64,
                     features: Features | None = None, init_keys: tuple = (),
                     traffic: filters.Filters | None = None) -> SparseTable:
        """Declare a sparse table (collective; identical on every rank). ``key_bits``: keys are
        (mostly) below ``2**key_bits`` (hashed features): up to 26 bits servers address rows
        directly by key. ``features``: admission and eviction of keys (:class:`hpcps.ps.tables.Features`).
        ``init_keys``: ``((key, values), ...)``, keys that start at given values instead of the
        initializer (a regression's bias at the label mean). ``traffic``: this table's traffic filters
        (default: the context's, ``init``'s ``traffic``; a server keeps key lists only where the
        context's have the key cache on)."""
        if name in self.tables:
            raise ValueError(f"table {name!r} is already declared")
        spec = TableSpec(name, dim, optimizer, dict(params or {}), init, init_scale, seed, key_bits,
                         features or Features(), tuple((int(k), tuple(float(x) for x in v)) for k, v in init_keys))
        self._check_same(f"table {name!r}", spec.fingerprint())
        self.specs.append(spec)
        table = SparseTable(self, len(self.specs) - 1, spec, traffic)
        self.tables[name] = table
        return table

    def server_function(self, name: str) -> int:
        """Declare a registered server function (collective; :func:`hpcps.register_server_function`
        on every rank first, with the same definition: checked). Returns its handle for
        :meth:`hpcps.ps.client.SparseTable.call`."""
        if name not in SERVER_FUNCTIONS:
            raise ValueError(f"server function {name!r} is not registered; registered: {sorted(SERVER_FUNCTIONS)}")
        f = SERVER_FUNCTIONS[name]
        self._check_same(f"server function {name!r}", f.fingerprint())
        self.functions.append(f)
        return len(self.functions) - 1

    def dense_table(self, name: str, size: int, optimizer: str = "sgd", params: dict | None = None,
                    init: str = "zeros", init_scale: float = 0.01, seed: int = 0,
                    initial: np.ndarray | None = None) -> DenseTable:
        """Declare a dense table of ``size`` floats (collective; identical on every rank).
        ``initial``: its starting values (else the initializer's)."""
        chunks = -(-size // DenseTable.CHUNK)
        init_keys = ()
        if initial is not None:
            padded = np.zeros(chunks * DenseTable.CHUNK, dtype=np.float32)
            padded[:size] = np.asarray(initial, dtype=np.float32).reshape(-1)[:size]
            init_keys = tuple((c, padded[c * DenseTable.CHUNK:(c + 1) * DenseTable.CHUNK].tolist()) for c in range(chunks))
        sparse = self.sparse_table(name, DenseTable.CHUNK, optimizer, params, init, init_scale, seed,
                                   key_bits=max(1, (chunks - 1).bit_length()),  # chunk keys 0..chunks-1
                                   init_keys=init_keys)
        table = DenseTable(self, sparse, size)
        self.tables[name] = table
        return table


class GroupExchanges:
    """A worker group's exchanges through its first rank (collective over the group): merged
    pushes (``train.aggregate``) and the group's pulls (``train.group_pull``). Needs
    ``group_comm`` and ``stall_timeout_s`` (a context's)."""

    def gather_to_leader(self, keys: np.ndarray, grads: np.ndarray, dim: int):
        """Group collective: merge every member's (sorted unique) keys and gradients on the
        group's rank 0. Returns (keys, sums) there, None elsewhere."""
        g = self.group_comm
        t = self.stall_timeout_s
        counts = transport.allgather_int(g, keys.shape[0], t, "gather of push sizes")
        all_keys = transport.gatherv(g, keys, counts, 0, t, "gather of pushed keys")
        all_grads = transport.gatherv(g, grads.reshape(-1), counts * dim, 0, t, "gather of pushed gradients")
        if g.Get_rank() != 0:
            return None
        all_grads = all_grads.reshape(-1, dim)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        parts = [(all_keys[bounds[i]:bounds[i + 1]], all_grads[bounds[i]:bounds[i + 1]]) for i in range(len(counts))]
        return kkeys.merge_sorted(parts)

    def gather_keys_to_leader(self, keys: np.ndarray) -> list[np.ndarray] | None:
        """Group collective: every member's ``keys`` (uint64), in member order, on the group's
        first rank; None elsewhere."""
        g, t = self.group_comm, self.stall_timeout_s
        counts = transport.allgather_int(g, keys.shape[0], t, "gather of pulled key counts")
        every = transport.gatherv(g, np.ascontiguousarray(keys, dtype=np.uint64), counts, 0, t, "gather of pulled keys")
        return None if every is None else np.split(every, np.cumsum(counts)[:-1])

    def scatter_rows_from_leader(self, parts: list[np.ndarray] | None, rows: int, width: int) -> np.ndarray:
        """Group collective: the group's first rank hands each member its rows (``parts``, float32
        ``n_m x width`` in member order, there only); returns this member's ``rows x width``."""
        out = np.empty((rows, width), dtype=np.float32)
        if parts is None:
            return transport.scatterv(self.group_comm, None, None, out, 0, self.stall_timeout_s, "scatter of pulled rows")
        counts = np.array([p.size for p in parts], dtype=np.int64)
        return transport.scatterv(self.group_comm, np.concatenate([p.reshape(-1) for p in parts]), counts, out, 0,
                                  self.stall_timeout_s, "scatter of pulled rows")


class ContextReplicas:
    """A context's view of the shards' copies (``cluster.replicas``): their check at the end, and
    the loss of a server. Needs ``placement``, ``placement_at_start``, ``server`` (a server
    rank's), ``every_rank``."""

    failovers: tuple = ()  # the servers lost, (server, clock, seconds): hpcps.ps.failover
    # the workers from this one on whose clocks its push-pulls carry (train.group_pull's first rank:
    # its group, whose other members send the servers nothing while training)
    carried_workers = 1

    def compare_replicas(self) -> dict:
        """Collective over the world, once serving is done: each server's digest of every shard
        copy it keeps (:meth:`hpcps.ps.replication.ServerCopies.replica_digests`), summed over
        the ranks; returns the copies compared and the shards whose backups differ from their
        primary (``{}`` without replicas)."""
        start = self.placement_at_start  # (the same on every rank: a lost server changes the workers' placement)
        if not start.replicas:
            return {}
        mine = np.zeros(start.copies.shape, np.int64)
        now = self.server.placement if self.is_server else self.placement
        if self.is_server:  # (fewer columns after a loss: the copies left)
            mine[:, :now.copies.shape[1]] = self.server.replica_digests()
        every = self.every_rank.reduce(mine.reshape(-1), "sum", "sum of the replicas' digests")
        differing = replication.differing_shards(every.reshape(mine.shape)[:, :now.copies.shape[1]])
        return {"replica_copies": int(every.shape[0]), "replica_shards_differing": differing}

    def warn_of_differing_replicas(self, compared: dict) -> None:
        """The first worker's warning where :meth:`compare_replicas` found backups that differ
        from their primary (said once its sums are final: under ULFM they are done again where
        a server is lost during them, :func:`hpcps.ps.failover.after_serving`)."""
        # (under BSP a failover would not continue the same model; under SSP and ASP two workers'
        # pushes may interleave differently on two copies: counted, not a warning)
        differing = compared.get("replica_shards_differing", 0)
        if differing and self.worker_index == 0 and self.staleness == 0:
            sys.stderr.write(f"hpcps: warning: the backups of {differing} of {self.placement.num_shards} shards "
                             f"differ from their primary's rows at the end of serving\n")

    def server_lost(self, server: int) -> None:
        """A worker learns that ``server`` is gone (the fault-tolerant transport's event): its
        shards' first backups answer their pulls from now on, pushes go to the new copies, and
        no request or clock goes to it (requests in flight to it are the transport's to resend).
        Every server is told first (``PLACED``, with this worker's clock), so that each has failed
        over before this worker's next request reaches it: a checkpoint asked of the survivors
        alone, written by one that had not learned of the loss yet, would hold only the shards
        it was primary of before. Where its shards get new backups, the copies' clock is agreed
        on the notices (:mod:`hpcps.ps.rereplication`); a group's first rank under
        ``train.group_pull`` tells it for its members too (they push nothing, and would tell it
        only at their end)."""
        self.placement = self.placement.after_loss(server)
        for worker in range(self.worker_index, self.worker_index + self.carried_workers):
            notice = protocol.Placed(self.clock_value, worker, server).pack()
            for s in self.placement.live_servers:
                self._clock_sends += failover.start_send(self, notice, s, protocol.TAG_REQUEST,
                                                         f"notice of the placement without server {server}")


class Context(collectives.ContextCollectives, TableDeclarations, GroupExchanges, ContextReplicas,
              recovery.ContextRecovery):
    """One rank's view of the parameter server. ``net``: how it reaches the other ranks, and the
    communicators its collectives run over (:class:`hpcps.ps.transport.Transport`): every message
    and collective of the server, the client and the context goes through it."""

    local = False  # a job of one process (LocalContext)

    def __init__(self, net: transport.Transport, layout: Layout, staleness: int, num_shards: int,
                 stall_warn_s: float, stall_timeout_s: float, backup: Backup = NO_BACKUP, replicas: int = 0):
        self.net = net
        self.backup = backup
        self.layout = layout
        self.rank = net.rank
        self.is_server = layout.is_server(self.rank)
        self.is_worker = not self.is_server
        self.worker_index = layout.worker_index(self.rank) if self.is_worker else -1
        self.group = layout.group_of(self.rank)
        self.staleness = staleness
        self.stall_warn_s = stall_warn_s
        self.stall_timeout_s = stall_timeout_s
        self._init_state()
        self._check_same("layout", hash((layout.servers, layout.worker_groups, staleness, num_shards,
                                         backup.workers, backup.late_pushes == "drop", replicas)) & 0x7FFFFFFF)
        self.hosts = transport.host_names(self.comm, stall_timeout_s)  # each rank's host, in rank order
        # (a shard's copies on distinct hosts: the servers are the first ranks)
        self.placement = self.placement_at_start = Placement(
            layout.servers, num_shards, replicas=replicas, hosts=tuple(self.hosts[:layout.servers]) if replicas else ())

    # the communicators, all the transport's: every rank; this worker's group (servers get none);
    # all workers together (evaluation, data checks) and all servers together (export)
    comm = property(lambda self: self.net.everyone)
    group_comm = property(lambda self: self.net.group)
    workers_comm = property(lambda self: self.net.workers)
    servers_comm = property(lambda self: self.net.servers)

    def _init_state(self) -> None:
        """What a rank keeps apart from its layout and transport (shared with LocalContext)."""
        self.tag_ub = self.net.tag_ub
        self.pool = transport.BufferPool()  # large requests and replies
        self.specs: list[TableSpec] = []
        self.functions: list[ServerFunction] = []  # declared server functions, in order
        self.tables: dict[str, SparseTable | DenseTable] = {}
        self.clock_value = 0
        self.flush_clocks, self.flushed_at = 0, -1  # the clocks flush_filters added; the clock after the last
        self._req_id = 0
        self._ts = 0
        self._clock_sends: list[transport.Pending] = []
        # wait_s: time waiting for the servers; background_s: time of background work done
        # during those waits (not counted as waiting); requests: the requests sent to the servers
        self.stats = {"wait_s": 0.0, "max_staleness": 0, "background_s": 0.0, "bytes_sent": 0, "bytes_received": 0,
                      "requests": 0, **dict.fromkeys(filters.SAVED_KEYS, 0)}
        self.filters = filters.Filters()  # the traffic filters (init's ``filters``), all off
        self.server_stats: dict | None = None
        self.server_stop = 0       # the stop signal a server reported (SIGINT or SIGTERM for the others), or 0
        # work a worker does while it waits for the servers instead of sleeping (the training loop
        # parses its next rows): returns whether it did any (see transport.wait)
        self.background: Callable[[], bool] | None = None
        self._finalized = False
        self._done_sent = False    # this worker told the servers it is done

    def run_background(self) -> bool:
        """One piece of :attr:`background` work, timed in ``stats["background_s"]``."""
        t = time.perf_counter()
        did = self.background()
        self.stats["background_s"] += time.perf_counter() - t
        return did

    # -- server ------------------------------------------------------------------------------

    def serve(self, restore: tuple[str, dict] | None = None, trace: bool = False) -> dict:
        """Server ranks: answer requests until every worker has finalized; returns statistics.

        Args:
            restore: (checkpoint directory, its manifest): load this server's shards first.
            trace: the statistics get ``trace``, a list of ``(op, keys pushed, keys pulled,
                seconds, bytes received, bytes sent, seconds with receipt)`` per request handled:
                seconds from its receipt to its reply queued; the bytes of its messages (their size
                as received) and of the replies queued meanwhile; seconds from the poll that found
                it to the loop's next poll, its reply queued (the serving loop's cost of one request).
        """
        if not self.is_server:
            raise RuntimeError("serve() is for server ranks (ctx.is_server)")
        server = Server(self.net, self.rank, self.layout.workers, self.layout.servers, self.specs,
                        self.placement, self.staleness, self.stall_warn_s, self.functions, self.stall_timeout_s,
                        self.backup, key_lists=self.filters.server_lists(self.layout.servers))
        self.server = server
        failover.plug(server) if self.fault_tolerant and self.placement.replicas else None  # (shards promoted)
        if restore is not None:
            server.restore(*restore)
        server.trace = [] if trace else None
        self.server_stats = server.serve()
        return self.server_stats

    # -- worker ------------------------------------------------------------------------------

    def next_request_id(self) -> int:
        """A new request id of this worker (its reply's tag is made from it)."""
        self._req_id += 1
        return self._req_id

    def next_timestamp(self) -> int:
        """A new timestamp for a table's request (what push/ipull return)."""
        self._ts += 1
        return self._ts

    def exchange(self, server: int, msg: np.ndarray, reply: np.ndarray, req_id: int, op: int, table: str = "") -> list:
        """Post the receive of request ``req_id``'s reply into ``reply`` (whole, or its header then
        its payload, as the header says: ``protocol.payload_apart``), then send ``msg`` to
        ``server``; returns the pending transfers (for :func:`hpcps.ps.transport.wait`), described
        by the operation and table for stall messages."""
        tag = protocol.reply_tag(req_id, self.tag_ub)
        self.stats["requests"] += 1
        what = transport.Described(_reply_what, (op, table, req_id))  # (written out only in a stall message)
        pending = self.net.start_recv_framed(reply, protocol.REPLY_BYTES, server, tag, what, protocol.payload_apart)
        return pending + failover.or_cancel(pending, self.net.start_send, msg, server, protocol.TAG_REQUEST, _REQUEST_WHAT[op])

    def table_set(self, tables: list[SparseTable]) -> TableSet:
        """Sparse tables a step reads and updates at the same keys, their requests as one message
        per server (:class:`hpcps.ps.client.TableSet`)."""
        return TableSet(self, tables)

    def send_grads(self, server: int, grads: np.ndarray, op: int) -> list:
        """Send the gradients of the request just sent to ``server`` as a message of their own
        (``protocol.GRADS_APART``); returns the pending sends."""
        return self.net.start_send(grads, server, protocol.TAG_GRADS, f"{protocol.OP_NAMES[op]} gradients to server")

    def _notify_servers(self, op: int, *more) -> None:
        sends, self._clock_sends = self._clock_sends, []  # (a loss found here may add its notices)
        self._clock_sends += failover.without_lost(self, transport.completed, sends)
        for server in self.placement.live_servers:
            self.stats["requests"] += 1
            self._clock_sends += failover.start_send(self, protocol.MESSAGES[op](self.clock_value, self.worker_index, *more).pack(),
                                                     server, protocol.TAG_REQUEST, f"{protocol.OP_NAMES[op]} message to server")

    @property
    def stop_requested(self) -> bool:
        """This rank got a stop signal (SIGINT, SIGTERM or SIGUSR1), or a server reported one."""
        return self.stop_signal is not None

    @property
    def stop_signal(self) -> int | None:
        """The stop signal this rank got or a server reported (SIGINT before the others), or None."""
        mine, theirs = signals.requested(), self.server_stop or None
        return signal.SIGINT if signal.SIGINT in (mine, theirs) else (mine or theirs)

    def save_checkpoint(self, root: str, step: int, manifest: dict, keep: int, delta=None, track: bool = False,
                        for_signal: bool = False) -> str:
        """First worker only: every server's shards and a manifest into a new checkpoint under
        ``root`` (:func:`write_checkpoint`); returns its path."""
        return write_checkpoint(self, root, step, manifest, keep, delta, track, for_signal)

    def clock(self) -> int:
        """End this worker's iteration: tell every server; returns the new clock."""
        self.clock_value += 1
        self._notify_servers(protocol.CLOCK)
        return self.clock_value

    def advance_clock(self) -> int:
        """End this worker's iteration when a push-pull has told every server already."""
        self.clock_value += 1
        return self.clock_value

    def flush_filters(self, timeout: float | None = None) -> bool:
        """Workers, every one at the same point: :func:`flush_residuals`."""
        return flush_residuals(self, timeout)

    def clock_to(self, clock: int) -> None:
        """A late backup worker skips to ``clock`` (the steps it leaves out): tell every server."""
        if clock > self.clock_value:
            self.clock_value = clock
            self._notify_servers(protocol.CLOCK)

    # -- end ---------------------------------------------------------------------------------

    def finish_serving(self, timeout: float | None = None) -> None:
        """Workers: finish their requests and tell the servers they are done (servers' serve()
        then returns). Called by finalize(); call it earlier to do collective work after it."""
        if not self.is_worker or self._done_sent:
            return
        timeout = self.stall_timeout_s if timeout is None else timeout
        for table in self.tables.values():
            (table.sparse if isinstance(table, DenseTable) else table).wait_all(timeout)
        self._notify_servers(protocol.DONE)
        failover.without_lost(self, lambda sends: transport.wait(sends, timeout), self._clock_sends)
        self._done_sent = True

    def finalize(self, timeout: float | None = None) -> None:
        """Collective end: workers finish their requests and tell the servers they are done;
        every rank then meets in a (sleeping) barrier and the communicators are freed."""
        if self._finalized:
            return
        timeout = self.stall_timeout_s if timeout is None else timeout
        if self.is_worker:
            self.finish_serving(timeout)
        elif self.server_stats is None:
            self.serve()
        transport.barrier(self.comm, timeout, "finalize barrier")
        self.net.free()
        self._finalized = True


class LocalContext(Context):
    """A job of one process (``hpcps train`` without mpiexec): the tables live in this process,
    in a :class:`hpcps.ps.server.Server` that the worker's requests reach through a
    :class:`hpcps.ps.transport.Loopback`, which hands it each request as it is sent: the same
    server and client code (consistency, optimizers, admission, checkpoints) with no message. It
    behaves as 1 server + 1 worker: its checkpoints are those of that layout, and resume either way."""

    local = True

    def __init__(self, staleness: int, num_shards: int, stall_warn_s: float, stall_timeout_s: float):
        self.net = transport.Loopback()
        self.net.deliver = self._deliver
        self.layout = Layout.plan(2, 1, None, num_shards)
        self.rank = self.net.rank         # as the worker of 1 server + 1 worker
        self.is_server, self.is_worker = False, True
        self.worker_index, self.group = 0, 0
        self.staleness = staleness
        self.backup = NO_BACKUP  # (one worker: nobody to wait for)
        self.placement = self.placement_at_start = Placement(1, num_shards)
        self.stall_warn_s, self.stall_timeout_s = stall_warn_s, stall_timeout_s
        self._init_state()
        self.hosts: list[str] = []  # no ranks to place
        self.server: Server | None = None

    def _deliver(self, source: int, msg: np.ndarray) -> None:
        """A request from the worker: the in-process server handles it (and answers) at once."""
        self._local_server().handle(source, msg)

    def _local_server(self) -> Server:
        if self.server is None:
            self.server = Server(self.net, self.net.SERVER, 1, self.net.WORKER, self.specs, self.placement,
                                 self.staleness, self.stall_warn_s, self.functions, self.stall_timeout_s,
                                 key_lists=self.filters.server_lists(1))
        if len(self.server.tables) != len(self.specs) or len(self.server.functions) != len(self.functions):
            raise RuntimeError("declare every table and server function before the first request")
        return self.server

    def restore(self, ckpt: str, manifest: dict) -> None:
        """Load a checkpoint into the in-process server (what server ranks do in :meth:`serve`)."""
        self._local_server().restore(ckpt, manifest)

    def tables_contents(self) -> dict:
        """Every table's rows and optimizer state (copies, by table name) in the in-process server."""
        return {t.spec.name: t.copy_contents() for t in self._local_server().tables}

    def load_tables(self, contents: dict, clock: int) -> None:
        """Continue from :meth:`tables_contents` of an earlier context with the same tables, at the
        clock it had reached (this worker's and the server's: what a checkpoint's restore does)."""
        server = self._local_server()
        for table in server.tables:
            table.set_contents(contents[table.spec.name])
        self.clock_value = clock
        server.workers.set_all(clock)  # each worker's clock as the server knows it

    def finish_serving(self, timeout: float | None = None) -> None:
        if not self._done_sent:
            super().finish_serving(timeout)
            self.server_stats = self._local_server().final_stats()

    def finalize(self, timeout: float | None = None) -> None:
        if self._finalized:
            return
        self.finish_serving(timeout)
        self.net.free()
        self._finalized = True


def flush_residuals(ctx: Context, timeout: float | None = None) -> bool:
    """Workers, every one at the same point: push what each table's significance filter
    (``filters.push_threshold``) kept and end the iteration, so that every read from the next
    clock on (a checkpoint, the model's export, an evaluation) sees every update pushed, under
    BSP in (clock, worker) order as any push. Returns whether it did (a table has the filter, and
    a clock passed since the last flush: every worker decides the same); ``ctx.flush_clocks``
    counts the clocks it added. Rows pulled before it for later steps lack what it pushed."""
    tables = [t.sparse if isinstance(t, DenseTable) else t for t in ctx.tables.values()]
    tables = [t for t in tables if t.filters is not None and t.filters.residual is not None]
    if not ctx.is_worker or not tables or ctx.clock_value == ctx.flushed_at:
        return False
    timeout = ctx.stall_timeout_s if timeout is None else timeout
    for table, ts in [(t, push_residual(t)) for t in tables]:
        if ts is not None:
            table.wait(ts, timeout)
    ctx.flushed_at = ctx.clock()
    ctx.flush_clocks += 1
    return True


def write_checkpoint(ctx: Context, root: str, step: int, manifest: dict, keep: int,
                     delta: deltas.Commits | None = None, track: bool = False, for_signal: bool = False) -> str:
    """First worker only: ask every server to write its shards into ``root/ckpt-<step>.tmp``
    (each waits until every worker has reached this clock), then write the manifest with the
    files' checksums and rename the directory. Returns the checkpoint's path. ``delta``: a delta
    snapshot ``delta-<step>`` instead, committed by ``delta`` once written (:mod:`hpcps.ps.deltas`);
    ``track``: delta snapshots follow this checkpoint; ``for_signal``: it is a stop signal's (the
    servers forget theirs once it is written)."""
    asked = ask_for_checkpoint(ctx, root, step, ctx.clock_value, delta is not None, track, for_signal=for_signal)
    # (a server lost meanwhile under replicas: its loss handled, the others' replies waited for)
    failover.without_lost(ctx, lambda p: transport.wait(p, ctx.stall_timeout_s, warn_after=ctx.stall_warn_s),
                          asked.pending)
    return commit_checkpoint(ctx, asked, manifest, keep, delta)


@dataclass
class AskedCheckpoint:
    """A checkpoint the servers were asked for (:func:`ask_for_checkpoint`): its directory, its
    clock, the replies' buffers and the transfers pending."""

    tmp: str
    clock: int
    replies: list
    pending: list
    servers: list  # the servers asked (under replicas, those not lost: they hold every shard)


def forward_stop(ctx: Context, sig: int) -> None:
    """Backup workers: this worker saw stop signal ``sig`` and joins the agreement on it: every
    server told first (``protocol.STOPPING``), so that it reports the stop to the workers not in
    the agreement yet and holds none of their reads meanwhile."""
    ctx._notify_servers(protocol.STOPPING, int(sig))


def ask_for_checkpoint(ctx: Context, root: str, step: int, clock: int, delta: bool, track: bool,
                       quorum: bool = False, for_signal: bool = False) -> AskedCheckpoint:
    """First worker only: ``root/ckpt-<step>.tmp`` (``delta-``) made, and every server asked to
    write its shards of clock ``clock`` there, without waiting. ``quorum`` (backup workers): the
    server waits for the clock before it to complete, not for every worker, and writes nothing when
    it came after the clock completed (:meth:`hpcps.ps.consistency.WorkerClocks.missed`)."""
    kind = "delta" if delta else "ckpt"
    tmp = checkpoint.step_dir(root, step, kind) + ".tmp"
    try:
        deltas.begin(root, step, kind, track)
    except OSError as e:
        raise checkpoint.write_failure(tmp, e, "the first worker") from None
    asked = AskedCheckpoint(tmp, clock, [], [], ctx.placement.live_servers)  # (a server lost: the survivors)
    for server in asked.servers:
        req_id = ctx.next_request_id()
        reply = np.empty(protocol.reply_bytes(protocol.CHECKPOINT, 0, 0), dtype=np.uint8)
        msg = protocol.Checkpoint(req_id, clock, ctx.worker_index, tmp, quorum, for_signal).pack()
        asked.pending += ctx.exchange(server, msg, reply, req_id, protocol.CHECKPOINT)
        asked.replies.append(reply)
    return asked


def checkpoint_replied(ctx: Context, asked: AskedCheckpoint, block: bool) -> bool:
    """Whether every server replied to the checkpoint asked for (``block``: once they have)."""
    if block:
        transport.wait(asked.pending, ctx.stall_timeout_s, warn_after=ctx.stall_warn_s)
        asked.pending = []
    else:
        asked.pending = transport.completed(asked.pending)
    return not asked.pending


def commit_checkpoint(ctx: Context, asked: AskedCheckpoint, manifest: dict, keep: int,
                      delta: deltas.Commits | None = None) -> str | None:
    """First worker only, every server's reply in: the manifest with the files' checksums written
    and the directory renamed (a delta: committed by ``delta``). Returns the checkpoint's path;
    None when a server missed it (a quorum checkpoint) or was lost while it was written (under
    replicas): the directory removed."""
    if lost := [s for s in asked.servers if s in ctx.placement.lost]:  # (its shards' backups promoted)
        shutil.rmtree(asked.tmp, ignore_errors=True)
        checkpoint.say(f"hpcps train: {'delta snapshot' if delta is not None else 'checkpoint'} {asked.tmp[:-4]} not "
                       f"written: server {lost[0]} was lost while it was written; the next snapshot is a full one")
        return None
    results = [protocol.unpack_checkpoint_result(reply) for reply in asked.replies]
    if any(size == protocol.CHECKPOINT_MISSED for size, _ in results):
        shutil.rmtree(asked.tmp, ignore_errors=True)
        return None
    tmp = asked.tmp
    files = [{"name": os.path.basename(checkpoint.server_file(tmp, server)), "bytes": size, "xxh64": digest}
             for server, (size, digest) in zip(asked.servers, results)]
    full = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "clock": asked.clock,
            "layout": {"servers": ctx.layout.servers, "workers": ctx.layout.workers,
                       "worker_groups": ctx.layout.worker_groups, "num_shards": ctx.placement.num_shards},
            "tables": [{"name": s.name, "dim": s.dim, "optimizer": s.optimizer, "width": s.width,
                        "init": s.init, "init_scale": s.init_scale, "seed": s.seed,
                        "fingerprint": s.fingerprint()} for s in ctx.specs],
            "files": files, **manifest}
    if delta is not None:
        return delta.start(tmp, full, list(asked.servers), keep, ctx.stall_timeout_s,
                           lambda: ctx.placement.lost)  # (under ULFM: replaced on a loss, read here)
    try:
        return checkpoint.commit(tmp, full, keep)
    except OSError as e:
        raise checkpoint.write_failure(os.path.join(tmp, checkpoint.MANIFEST), e, "the first worker") from None


def init(servers: int = 1, worker_groups: int | None = None, staleness: int = 0,
         num_shards: int = DEFAULT_SHARDS, stall_warn_s: float = 30.0, stall_timeout_s: float = 300.0,
         comm=None, backup: Backup = NO_BACKUP, traffic: filters.Filters | None = None, replicas: int = 0,
         fault_tolerance: str = "none") -> Context:
    """Split the world (collective) into ``servers`` server ranks and ``worker_groups`` groups.

    Args:
        servers: number of server ranks (the first ranks of the world).
        worker_groups: number of worker groups; default one per worker.
        staleness: 0 = BSP, s > 0 = SSP with staleness s, negative = ASP.
        num_shards: virtual shards (fixed for a model's life: part of its checkpoints).
        stall_warn_s: report a request not answered after this many seconds.
        stall_timeout_s: abort the job when a request is not answered after this many seconds.
        comm: the world to split (default MPI.COMM_WORLD); the library works on a duplicate.
        backup: backup workers under BSP (:class:`hpcps.ps.consistency.Backup`): a clock completes
            once all but ``backup.workers`` workers have passed it.
        traffic: the traffic filters (:class:`hpcps.ps.filters.Filters`; default none), the same
            on every rank, before any table is declared.
        replicas: hot backups: each shard kept on ``replicas + 1`` servers, a push applied on every
            copy, a pull answered by the primary (:mod:`hpcps.ps.replication`).
        fault_tolerance: "ulfm": the job goes on without a lost worker (:mod:`hpcps.ps.recovery`;
            Open MPI launched with ``mpiexec --with-ft ulfm``); "none": a lost rank ends it.

    A world of one process (no mpiexec) gives a :class:`LocalContext`: one server inside the
    process, no messages.

    Raises:
        hpcps.ps.layout.LayoutError: the world is too small for the layout, before any communication.
        ValueError: ``backup`` does not fit the layout or the staleness, or goes with ``replicas``
            (before any communication).
    """
    if replicas and backup.workers:  # (as hpcps.config refuses it)
        raise ValueError(f"cluster.replicas = {replicas} does not go with cluster.backup_workers = {backup.workers} "
                         f"(which pushes are late depends on each server's timing, so copies could differ)")
    base = comm if comm is not None else transport.world()
    check_world(base.Get_size(), servers, worker_groups, num_shards)
    if not 0 <= replicas < servers:
        raise LayoutError(f"cluster.replicas = {replicas} needs at least {replicas + 1} servers ({servers} "
                          f"planned): each shard's copies are on distinct servers")
    if base.Get_size() == 1:
        if backup.workers:
            raise ValueError(backup.check(1, staleness))
        transport.install_abort_handler()
        transport.set_stall_warning(stall_warn_s)
        ctx = LocalContext(staleness, num_shards, stall_warn_s, stall_timeout_s)
        ctx.filters = traffic or ctx.filters
        return ctx
    layout = Layout.plan(base.Get_size(), servers, worker_groups, num_shards)
    problem = backup.check(layout.workers, staleness, layout.worker_groups)
    if problem:
        raise ValueError(problem)
    transport.install_abort_handler()
    transport.set_stall_warning(stall_warn_s)
    world = transport.dup(base)
    rank = world.Get_rank()
    net = transport.MPITransport.split(world, layout.group_of(rank), not layout.is_server(rank), stall_timeout_s,
                                       fault_tolerance == "ulfm")
    for explainer in [e for e in transport.EXPLAINERS if getattr(e, "lost_rank_line", False)]:
        transport.EXPLAINERS.remove(explainer)  # (the layout of an earlier context of this process)

    def explainer(exc):
        return lost_rank_line(exc, layout, fault_tolerance == "ulfm", replicas)

    explainer.lost_rank_line = True
    transport.EXPLAINERS.insert(0, explainer)
    ctx = Context(net, layout, staleness, num_shards, stall_warn_s, stall_timeout_s, backup, replicas)
    ctx.filters = traffic or ctx.filters
    # numba's start-up now, on this thread: a server's while the workers go on to their data, not at
    # their first request; a worker's before its data's threads (the count of its part's lines)
    # make its first compiled call, which, made there, took the main thread's parse 2-4 times as long
    set_up_numba()
    if fault_tolerance == "ulfm":
        ctx.fault_tolerant = True
        ctx.recovery = recovery.WorkerRecovery(net, layout.servers, stall_timeout_s)
    return ctx


def lost_rank_line(exc: BaseException, layout: Layout, ulfm: bool = False, replicas: int = 0) -> tuple[str, str] | None:
    """What a lost rank (:class:`~hpcps.ps.transport.RankFailed`) means, naming its role (``ulfm``,
    ``replicas``: the job's, so that it does not advise what is on already)."""
    if not isinstance(exc, transport.RankFailed) or not exc.ranks:
        return None
    names = [f"{'server' if layout.is_server(r) else 'worker'} "
             f"{r if layout.is_server(r) else layout.worker_index(r)} (rank {r})" for r in exc.ranks]
    servers = any(layout.is_server(r) for r in exc.ranks)
    if exc.why:
        why = exc.why
    elif servers and replicas:
        why = ("a lost server ends the job here (its shards' copies are not promoted in this step: "
               "docs/operations.md, ULFM's limits)" if ulfm else
               "a lost server ends the job (cluster.fault_tolerance = \"ulfm\" goes on with its shards' copies)")
    elif servers:
        why = "a lost server ends the job (no replicas of its shards)"
    elif ulfm:
        why = "the job cannot go on without it in this step (docs/operations.md, ULFM's limits)"
    else:
        why = "the job cannot go on without it here (cluster.fault_tolerance = \"ulfm\" goes on without a lost worker)"
    return "RankFailed", (f"{', '.join(names)} was lost (killed, or its node failed) during {exc.what or 'the job'}; "
                          f"{why}: hpcps supervise restarts the job from its last checkpoint")


