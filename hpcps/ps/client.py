"""The worker side: ps-lite style push/pull on sparse tables, dense tables, and clocks.

    ts = table.push(keys, grads)      # nonblocking: returns a timestamp
    vals = table.pull(keys)           # blocking; or ts = table.ipull(keys); vals = table.wait(ts)
    table.wait(ts, timeout=...)       # waits for a push's acknowledgements (or a pull's values)
    ctx.clock()                       # ends this worker's iteration

Keys are uint64 in any order, duplicates allowed: a pull returns one row per key as given; a push
*sums* the gradients of duplicate keys (the server applies one update per distinct key). A request
is sliced by server (:mod:`hpcps.ps.placement`), and the messages to all servers are in flight at
once; a message never exceeds 2 GiB (larger requests are split).

Waits poll and sleep (no spinning). A request not answered within ``stall_warn_s`` is reported on
stderr naming the servers and the request; after ``stall_timeout_s`` the wait raises
:class:`hpcps.ps.transport.StallError`, which aborts the job with that message.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hpcps.ps import failover, filters, protocol, transport
from hpcps.ps.tables import TableSpec
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
    function: object = None                         # CALL: the ServerFunction
    ahead: int = 0                                  # PUSHPULL: its pull reads this many clocks later
    clock_workers: int = 1                          # PUSHPULL: the workers whose clock it carries
    # each part's server and pulled keys (None: a push's), for a lost server's parts asked again
    # of the new primaries (hpcps.ps.failover); the servers whose part failed at its start
    servers: list = field(default_factory=list)
    asked: list = field(default_factory=list)
    unanswered: set = field(default_factory=set)
    owner: object = None                            # a TableSet's request: the set


_POSITIONS = np.arange(1 << 16)
_POSITIONS.flags.writeable = False  # (shared by every request: a write through a view would reach them all)


def positions(n: int) -> np.ndarray:
    """``np.arange(n)``: a view of one shared array (never written), the positions of a single
    server's part of a request, which holds every key in order (none made a step)."""
    global _POSITIONS
    if _POSITIONS.shape[0] < n:
        _POSITIONS = np.arange(max(n, 2 * _POSITIONS.shape[0]))
        _POSITIONS.flags.writeable = False
    return _POSITIONS[:n]


def call_result(req: _Request) -> np.ndarray:
    """What a CALL's ``wait`` returns, from its replies: a row per key in request order, or for a
    reduction the sum over the servers."""
    f = req.function
    parts = [(sel, reply[protocol.REPLY_BYTES:].view(np.float32)) for sel, reply in req.parts]
    if not f.per_key:  # a reduction: summed over the servers
        return np.sum([p for _, p in parts], axis=0, dtype=np.float32)
    out = np.empty((req.n_unique, f.out_width), dtype=np.float32)
    for sel, p in parts:
        out[sel] = p.reshape(-1, f.out_width)
    return out


def margins_result(req: _Request, dim: int) -> np.ndarray:
    """What a MARGINS request's ``wait`` returns: the servers' partial sums of each row, summed
    (a vector for a dim-1 table)."""
    out = np.zeros((req.n_unique, protocol.margin_width(dim)), dtype=np.float64)
    for _, reply in req.parts:
        out += reply[protocol.REPLY_BYTES:].view(np.float64).reshape(out.shape)
    return out if dim > 1 else out[:, 0]


def read_reply_header(ctx, reply: np.ndarray) -> tuple[int, tuple[int, int, int], int]:
    """(the server, its counts of the request's table, the slowest worker's clock it knew) of a
    reply; a stop status it carries is kept in ``ctx.server_stop``."""
    _, status, min_clock, server, table_keys, admitted, evicted, _ = protocol.reply_words(reply)
    if status & protocol.STOP:
        ctx.server_stop = signal.SIGINT if status & protocol.INTERRUPT else (ctx.server_stop or signal.SIGTERM)
    return server, (table_keys, admitted, evicted), min_clock


def wait_for_replies(ctx, req: _Request, timeout: float | None) -> None:
    """Wait for a request's transfers (the context's background work meanwhile), timed in
    ``ctx.stats["wait_s"]`` less that work."""
    t = time.perf_counter()
    busy = ctx.stats["background_s"]

    def wait(r: _Request) -> None:
        transport.wait(r.pending, ctx.stall_timeout_s if timeout is None else timeout,
                       warn_after=ctx.stall_warn_s, max_sleep=transport.POLL_SHORT_MAX_SLEEP_S,
                       background=ctx.run_background if ctx.background is not None else None)
    if ctx.placement.replicas or ctx.placement.lost:  # (a lost server's replies asked again: hpcps.ps.failover)
        failover.wait_replies(ctx, req, wait)
    else:
        wait(req)
    ctx.stats["wait_s"] += time.perf_counter() - t - (ctx.stats["background_s"] - busy)


def note_staleness(ctx, req: _Request, min_clock: int | None) -> None:
    """The staleness a pull observed (its read's clock less the slowest worker's), into the
    context's ``max_staleness``."""
    if min_clock is not None:
        ctx.stats["max_staleness"] = max(ctx.stats["max_staleness"],
                                         protocol.pull_clock(req.op, req.clock, req.ahead) - min_clock)


class TableRequests:
    """A table's requests in flight, by timestamp: each one's messages sent to the servers after
    the receives of their replies are posted (:meth:`_post`), then waited for and read
    (:meth:`wait`): the servers' stop status, counts and clocks from every reply's header, and what
    the request returns (the pulled rows, or :func:`margins_result` and :func:`call_result`)."""

    def __init__(self, ctx, table_id: int, spec: TableSpec):
        self.ctx = ctx
        self.id = table_id
        self.spec = spec
        self.dim = spec.dim
        self._requests: dict[int, _Request] = {}
        self.last_min_clock = None   # smallest worker clock the servers reported for the last pull
        self.server_counts: dict[int, tuple[int, int, int]] = {}  # server -> its latest (keys, admitted, evicted)
        self.max_keys = protocol.max_keys_per_message(self.dim, transport.MAX_MESSAGE_BYTES)

    @property
    def name(self) -> str:
        return self.spec.name

    def _post(self, req: _Request, server: int, pulled, reply_bytes: int, pack, grads=None, lent=False,
              asked=None) -> None:
        """Post the receive of a reply of ``reply_bytes``, then send ``pack(req_id)`` to ``server`` (and ``grads`` after it, when they go apart;
        ``lent``: see :meth:`_message`; ``asked``: the keys it pulls)."""
        ctx = self.ctx
        req_id = ctx.next_request_id()
        reply = ctx.pool.take(reply_bytes)
        msg = pack(req_id)
        ctx.stats["bytes_sent"] += msg.nbytes + (0 if grads is None else grads.nbytes)
        ctx.stats["bytes_received"] += reply_bytes
        req.parts.append((pulled, reply))
        req.servers.append(server)
        req.asked.append(asked)
        try:
            req.pending += ctx.exchange(server, msg, reply, req_id, req.op, self.name)
            if grads is not None:
                sends = ctx.send_grads(server, grads, req.op)
                if lent:
                    transport.wait(sends, ctx.stall_timeout_s, warn_after=ctx.stall_warn_s)
                req.pending += sends
        except transport.RankFailed as e:  # (a server lost: its part asked again of the copies left)
            failover.send_failed(ctx, req, server, e)

    def ask_pull(self, again: _Request, server: int, sel: np.ndarray, keys: np.ndarray, owner=None) -> None:
        """Send ``server`` the pull of ``keys`` (at positions ``sel`` of the rows a request pulled)
        as a part of request ``again``: this table's, or a :class:`TableSet` ``owner``'s for its
        every table (the rows a lost server did not send: :mod:`hpcps.ps.failover`)."""
        if owner is None:
            self._message(again, server, sel, None, None, keys)
            return
        ctx, empty = self.ctx, [np.zeros((0, d), np.float32) for d in owner.dims]
        enc = replace(protocol.PLAIN, wire=owner.wire)  # (the set reads every reply in its wire type)
        self._post(again, server, sel, protocol.tables_reply_bytes(keys.shape[0], owner.dims, owner.wire),
                   lambda req_id: protocol.TablesPull(owner.ids, req_id, again.clock, ctx.worker_index, protocol.NO_KEYS,
                                                      empty, keys, 0, None, 1, enc).pack(ctx.pool.take), asked=keys)

    def _register(self, req: _Request) -> int:
        ts = self.ctx.next_timestamp()
        self._requests[ts] = req
        return ts

    def wait(self, ts: int, timeout: float | None = None):
        """Wait for request ``ts``; returns the pulled rows for a pull, None for a push."""
        req = self._requests.pop(ts)
        ctx = self.ctx
        wait_for_replies(ctx, req, timeout)
        min_clock = None
        for _, reply in req.parts:
            server, counts, server_min_clock = read_reply_header(ctx, reply)
            self.server_counts[server] = counts
            min_clock = server_min_clock if min_clock is None else min(min_clock, server_min_clock)
        if req.op in (protocol.PUSH, protocol.RESIDUALS):
            return None
        self.last_min_clock = min_clock
        note_staleness(ctx, req, min_clock)
        if req.op == protocol.CALL:
            return call_result(req)
        if req.op == protocol.MARGINS:
            return margins_result(req, self.dim)
        wire = self.wire
        values = [protocol.pulled_values(reply, self.dim, wire, -1 if chunk is None else chunk.shape[0])
                  for chunk, reply in req.parts]
        if self.filters is not None:
            for v in values:
                self.filters.saturated(v, pulled=True)
        if len(req.parts) == 1 and req.expand is None and values[0].shape[0] == req.n_unique:
            return values[0]  # one server answered for every key, in order
        out = np.empty((req.n_unique, self.dim), dtype=np.float32)
        for (chunk, _), v in zip(req.parts, values):
            if v.shape[0]:
                kkeys.scatter_rows(out, chunk, v)
        return out if req.expand is None else kkeys.gather_rows(out, req.expand)

    def key_counts(self) -> tuple[int, int, int]:
        """(rows held, keys admitted, rows evicted) of this table over the servers, as their
        latest replies to this worker said."""
        c = list(self.server_counts.values())
        return tuple(sum(x[i] for x in c) for i in range(3)) if c else (0, 0, 0)

    def wait_all(self, timeout: float | None = None) -> None:
        for ts in list(self._requests):
            self.wait(ts, timeout)


class ServerComputations:
    """Computation on the servers through a table (what its :meth:`~SparseTable.imargins`,
    :meth:`~SparseTable.iresiduals` and :meth:`~SparseTable.icall` do): each builds its op's
    requests to the servers concerned, posted and registered as the table's others are."""

    def __init__(self, table: "SparseTable"):
        self.table = table

    def imargins(self, keys, values, row_ids, n_rows: int) -> int:
        """Computation on the servers: send a batch's nonzeros (keys, their values and row
        numbers, a row's nonzeros consecutive, duplicates allowed) to the servers that own them;
        ``wait`` returns each row's sums over all servers (float64, ``n_rows x
        protocol.margin_width(dim)``): the margin for a dim-1 table (LR), or an FM's ``[sum w x,
        sum V_f x, sum (V_f x)^2]``. Follow it with :meth:`iresiduals`. Weights never leave the
        servers."""
        table, ctx = self.table, self.table.ctx
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        row_ids = np.ascontiguousarray(row_ids, dtype=np.int32).reshape(-1)
        req = _Request(protocol.MARGINS, table, n_unique=n_rows, clock=ctx.clock_value, started=time.monotonic())
        if ctx.layout.servers == 1:
            parts = [(keys, values, row_ids)]
        else:  # every server, each with its nonzeros in their order (it may own none)
            order, offsets = ctx.placement.slice(keys)
            parts = [(keys[sel], values[sel], row_ids[sel])
                     for sel in (order[offsets[s]:offsets[s + 1]] for s in range(ctx.layout.servers))]
        for server, (k, v, r) in enumerate(parts):
            table._post(req, server, None, protocol.reply_bytes(protocol.MARGINS, n_rows, table.dim),
                        lambda req_id, k=k, v=v, r=r: protocol.Margins(table.id, req_id, req.clock, ctx.worker_index,
                                                                       k, v, r, n_rows).pack())
        return table._register(req)

    def iresiduals(self, residuals) -> int:
        """After :meth:`imargins`: per row, d loss / d margin (scaled as the gradient should be)
        and, for an FM, the row's factor sums ``S_f`` (``n_rows x dim``, float64); the servers push
        the resulting per-key gradients at this clock, and the worker's step ends (the clock
        advances, as with :meth:`SparseTable.ipushpull`). ``wait`` returns None."""
        table, ctx = self.table, self.table.ctx
        residuals = np.ascontiguousarray(residuals, dtype=np.float64).reshape(-1, table.dim)
        req = _Request(protocol.RESIDUALS, table, clock=ctx.clock_value, started=time.monotonic())
        for server in range(ctx.layout.servers):
            table._post(req, server, None, protocol.reply_bytes(protocol.RESIDUALS, 0, 1),
                        lambda req_id: protocol.Residuals(table.id, req_id, req.clock, ctx.worker_index,
                                                          residuals).pack())
        ctx.advance_clock()
        return table._register(req)

    def icall(self, function: int, keys, args=None) -> int:
        """Run a declared server function (``ctx.server_function(name)``) over ``keys`` (any
        order, duplicates allowed) with ``args`` (float32, a row of ``in_width`` per key). ``wait``
        returns a row of ``out_width`` per key in request order, or for a reduction the sum over
        the servers of their ``out_width`` values."""
        table, ctx = self.table, self.table.ctx
        f = ctx.functions[function]
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        args = np.zeros((keys.shape[0], 0), np.float32) if args is None else \
            np.ascontiguousarray(args, dtype=np.float32).reshape(keys.shape[0], f.in_width)
        req = _Request(protocol.CALL, table, n_unique=keys.shape[0], clock=ctx.clock_value, started=time.monotonic())
        req.function = f
        if ctx.layout.servers == 1:
            slices = [np.arange(keys.shape[0])]
        else:
            order, offsets = ctx.placement.slice(keys)
            slices = [order[offsets[s]:offsets[s + 1]] for s in range(ctx.layout.servers)]
        for server, sel in enumerate(slices):
            if server in ctx.placement.lost:  # (a server lost: cluster.replicas)
                continue
            out = 4 * f.out_width * (sel.shape[0] if f.per_key else 1)
            table._post(req, server, sel, protocol.REPLY_BYTES + out,
                        lambda req_id, sel=sel: protocol.Call(table.id, req_id, req.clock, ctx.worker_index,
                                                              function, keys[sel], args[sel]).pack())
        return table._register(req)


class SparseTable(TableRequests):
    """A worker's handle on a sparse table (declared identically on every rank): its pulls,
    pushes and push-pulls, and computation on the servers (:class:`ServerComputations`)."""

    def __init__(self, ctx, table_id: int, spec: TableSpec, traffic: filters.Filters | None = None):
        super().__init__(ctx, table_id, spec)
        self.computations = ServerComputations(self)
        # the traffic filters of its pushes, pulls and push-pulls (hpcps.ps.filters), or None
        traffic = traffic or ctx.filters
        self.filters = filters.TableFilters(traffic, self.dim, ctx.layout.servers, ctx.stats) if traffic.any else None
        self.wire = traffic.wire
        self.traffic = traffic

    def _send(self, op: int, keys: np.ndarray, grads: np.ndarray | None, ahead: int = 0, lent: bool = False) -> int:
        """Send a pull (``grads`` None) or a push of sorted unique ``keys``, sliced by server and
        split so that no message passes 2 GiB; returns its timestamp. ``ahead``: added to the
        request's clock (a pull for a later step); ``lent``: see :meth:`_message`."""
        ctx = self.ctx
        req = _Request(op, self, n_unique=keys.shape[0], clock=ctx.clock_value + ahead, started=time.monotonic())
        if ctx.layout.servers == 1 and keys.shape[0] <= self.max_keys:  # no hashing of keys, no copies
            if op == protocol.PULL:
                self._message(req, 0, positions(keys.shape[0]), None, None, keys)
            else:
                self._message(req, 0, None, keys, grads, None, lent=lent)
            return self._register(req)
        # (a push goes to every copy of its keys' shards: cluster.replicas)
        order, offsets = (ctx.placement.slice if op == protocol.PULL else ctx.placement.push_slice)(keys)
        for server in ctx.placement.live_servers:
            sel = order[offsets[server]:offsets[server + 1]]
            for lo in range(0, sel.shape[0], self.max_keys):
                chunk = sel[lo:lo + self.max_keys]
                if op == protocol.PULL:
                    self._message(req, server, chunk, None, None, keys[chunk])
                else:
                    self._message(req, server, None, keys[chunk], grads[chunk], None)
        return self._register(req)

    def _message(self, req: _Request, server: int, pulled: np.ndarray | None, push_keys, grads, pull_keys,
                 in_pull: np.ndarray | None = None, lent: bool = False) -> None:
        """Post the reply's receive, then send one request to ``server``. ``pulled``: the
        positions of ``pull_keys`` among the request's unique pull keys. Large gradients go as a
        message of their own, from their array (``protocol.GRADS_APART``); ``lent``: the array is
        the caller's, who may change it once the push returns, so it returns once they are sent
        (the transfer the wait for the reply would otherwise have done)."""
        n_pull = 0 if pull_keys is None else pull_keys.shape[0]
        enc = self._encoding(server, push_keys, grads, pull_keys)
        apart = grads is not None and not self.ctx.local and enc.wire == filters.FP32 and protocol.grads_apart(grads)
        worker = self.ctx.worker_index
        if req.op == protocol.PULL:
            message = lambda req_id: protocol.Pull(self.id, req_id, req.clock, worker, pull_keys, enc)  # noqa: E731
        elif req.op == protocol.PUSH:
            message = lambda req_id: protocol.Push(self.id, req_id, req.clock, worker, push_keys, grads,  # noqa: E731
                                                   apart, enc)
        else:
            message = lambda req_id: protocol.PushPull(self.id, req_id, req.clock, worker, push_keys,  # noqa: E731
                                                       grads, pull_keys, req.ahead, in_pull, apart,
                                                       req.clock_workers, enc)
        self._post(req, server, pulled, protocol.reply_bytes(req.op, n_pull, self.dim, enc.wire),
                   lambda req_id: message(req_id).pack(self.ctx.pool.take), grads if apart else None, lent, pull_keys)

    def _encoding(self, server: int, push_keys, grads, pull_keys) -> protocol.Encoding:
        """How a message to ``server`` travels under the table's filters (the pushed list first,
        then the pulled one: the order the server reads them in), its values counted."""
        f = self.filters
        if f is None:
            return protocol.PLAIN
        n_pull = 0 if pull_keys is None else pull_keys.shape[0]
        f.count_values(0 if grads is None else grads.size)  # (each way padded apart)
        f.saturated(grads)
        f.count_values(n_pull * self.dim)
        return protocol.Encoding(f.wire, *f.key_ref(server, push_keys, pushed=True), *f.key_ref(server, pull_keys))

    def _threshold(self, keys, grads, in_pull=None):
        """The significance filter (``filters.push_threshold``) on a push: what is sent of it."""
        return (keys, grads, in_pull) if self.filters is None else self.filters.threshold(keys, grads, in_pull)

    def ipushpull(self, push_keys, grads, pull_keys, aggregate: bool = False, unique: bool = False,
                  ahead: int = 0, in_pull: np.ndarray | None = None, donate: bool = False,
                  clock_workers: int = 1) -> int:
        """Push a step's gradients, end the step (the clock), and start pulling the next step's
        keys, in one message to each server (ps-lite's ZPushPull). Returns a timestamp for
        :meth:`wait`, which returns the pulled rows.

        Equivalent to ``push(push_keys, grads, aggregate); ctx.clock(); ipull(pull_keys, ahead=ahead)``,
        with one round trip instead of three messages and a reply per server. Under BSP the pull
        is answered once every worker has passed the clock (``ahead`` more clocks: a pull for a
        later step), so it sees every push before that step.
        ``unique``: both key arrays are already distinct (in any order): no dedup.
        ``in_pull`` (with ``unique``): a bool per pushed key, whether it is among ``pull_keys``
        (:func:`hpcps_kernels.keys.member_mask`, best computed while the worker waits anyway):
        the servers then update the other keys after they have replied, which shortens the wait
        by that part of the push, with the same numbers. Ignored where a group merges its pushes.
        ``donate``: as for :meth:`push`. ``clock_workers``: the step's clock is that of as many
        workers from this one on (a worker group's first rank pushing and pulling for its group:
        ``protocol.CLOCK_WORKERS_SHIFT``).
        """
        ctx = self.ctx
        if not unique or (aggregate and ctx.group_comm.Get_size() > 1):
            in_pull = None  # (the keys sent are not those given)
        push_keys, grads = self._prepare_push(push_keys, grads, aggregate, unique)
        push_keys, grads, in_pull = self._threshold(push_keys, grads, in_pull)
        pull_keys = np.ascontiguousarray(pull_keys, dtype=np.uint64).reshape(-1)
        expand = None
        if not unique and not kkeys.is_sorted_unique(pull_keys):
            pull_keys, expand = kkeys.unique_keys(pull_keys)
        if max(push_keys.shape[0], pull_keys.shape[0]) > self.max_keys:  # too big for one message
            self.wait(self._send(protocol.PUSH, push_keys, grads, lent=not donate))
            if clock_workers > 1:  # the group's clock, as a bare push-pull
                self.wait(self.ipushpull(protocol.NO_KEYS, grads[:0], protocol.NO_KEYS, unique=True, clock_workers=clock_workers))
            else:
                ctx.clock()
            return self.ipull(pull_keys[expand] if expand is not None else pull_keys, ahead=ahead)
        req = _Request(protocol.PUSHPULL, self, n_unique=pull_keys.shape[0], clock=ctx.clock_value,
                       started=time.monotonic(), expand=expand, ahead=ahead, clock_workers=clock_workers)
        if ctx.layout.servers == 1:  # nothing to slice: no hashing of keys, no copies
            self._message(req, 0, positions(pull_keys.shape[0]), push_keys, grads, pull_keys, in_pull, lent=not donate)
        else:
            push_order, push_offsets = ctx.placement.push_slice(push_keys)  # (to every copy)
            pull_order, pull_offsets = ctx.placement.slice(pull_keys)
            for server in ctx.placement.live_servers:  # every server: each needs the clock
                sp = push_order[push_offsets[server]:push_offsets[server + 1]]
                sl = pull_order[pull_offsets[server]:pull_offsets[server + 1]]
                self._message(req, server, sl, push_keys[sp], grads[sp], pull_keys[sl],
                              None if in_pull is None else in_pull[sp])
        ctx.advance_clock()
        return self._register(req)

    def imargins(self, keys, values, row_ids, n_rows: int) -> int:
        """Partial margins on the servers: :meth:`ServerComputations.imargins`."""
        return self.computations.imargins(keys, values, row_ids, n_rows)

    def iresiduals(self, residuals) -> int:
        """Gradients from residuals on the servers: :meth:`ServerComputations.iresiduals`."""
        return self.computations.iresiduals(residuals)

    def icall(self, function: int, keys, args=None) -> int:
        """Run a declared server function: :meth:`ServerComputations.icall`."""
        return self.computations.icall(function, keys, args)

    def call(self, function: int, keys, args=None, timeout: float | None = None) -> np.ndarray:
        """:meth:`icall`, waiting for the result."""
        return self.wait(self.icall(function, keys, args), timeout)

    def ipull(self, keys, unique: bool = False, ahead: int = 0) -> int:
        """Start pulling the rows of ``keys``; returns a timestamp for :meth:`wait`.
        ``unique``: the keys are distinct already (any order): no dedup. ``ahead``: pull for the
        step ``ahead`` clocks later; the servers answer once the consistency model allows a read
        at that clock (under BSP, after every worker's next clock; under SSP and ASP, usually at
        once, so the pull overlaps this step's work)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        expand = None
        if not unique and not kkeys.is_sorted_unique(keys):
            keys, expand = kkeys.unique_keys(keys)
        ts = self._send(protocol.PULL, keys, None, ahead)
        self._requests[ts].expand = expand
        return ts

    def pull(self, keys, timeout: float | None = None, unique: bool = False) -> np.ndarray:
        """The rows (float32, ``(len(keys), dim)``) of ``keys``, waiting for them."""
        return self.wait(self.ipull(keys, unique), timeout)

    def push(self, keys, grads, aggregate: bool = False, unique: bool = False, donate: bool = False) -> int:
        """Send gradients; returns a timestamp for :meth:`wait`.

        Args:
            keys: uint64 keys (any order; duplicates are summed).
            grads: float32, ``(len(keys), dim)`` or flat.
            aggregate: collective over the worker group: the members' pushes are merged on the
                group's first rank (sum per key) and sent once.
            unique: the keys are distinct already (any order): no summing of duplicates.
            donate: the caller will not write ``grads`` again. Gradients of 2 MiB or more
                (``protocol.GRADS_APART_BYTES``) go to a server from the array itself, with no copy;
                without ``donate`` the call returns once they are sent (the transfer that
                :meth:`wait` would otherwise do), so the caller may then change the array.
        """
        keys, grads = self._prepare_push(keys, grads, aggregate, unique)
        keys, grads, _ = self._threshold(keys, grads)
        return self._send(protocol.PUSH, keys, grads, lent=not donate)

    def _prepare_push(self, keys, grads, aggregate: bool, unique: bool = False):
        """Unique keys with summed gradients (sorted when a group merges them), merged over the
        group when ``aggregate`` (group collective). A member that is not the group's leader gets
        empty arrays: the leader sends for the group."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(keys.shape[0], self.dim)
        merge = aggregate and self.ctx.group_comm.Get_size() > 1
        if (merge or not unique) and not kkeys.is_sorted_unique(keys):
            keys, grads = kkeys.segment_reduce(keys, grads)
        if merge:
            merged = self.ctx.gather_to_leader(keys, grads, self.dim)
            if merged is None:
                return np.zeros(0, np.uint64), np.zeros((0, self.dim), np.float32)
            keys, grads = merged
        return keys, grads


def push_residual(table: SparseTable) -> int | None:
    """Push what a table's significance filter (``filters.push_threshold``) kept: every key whose
    residual is not zero, with it (the residual is then zero), its traffic taken back from the
    bytes the filter saved. Returns the push's timestamp (None: nothing kept, or the filter is
    off). Follow it with a clock (``Context.flush_filters``)."""
    drained = None if table.filters is None else table.filters.flush()
    if drained is None or drained[0].shape[0] == 0:
        return None
    return filters.charged(table.ctx.stats, lambda: table._send(protocol.PUSH, *drained))  # (not filtered again)


class TableSet:
    """Sparse tables that a step reads and updates at the same keys (a tune grid's members, a deep
    model's wide and embedding tables): their pulls and push-pulls go as one message per server
    (``protocol.PULLS``, ``protocol.PUSHPULLS``) instead of one per table. ``wait`` returns the
    pulled rows of every table, in the set's order.

    The traffic filters (the tables', which must be the same: else each table's own requests go)
    apply as to each table's own requests: each table's values in the wire type, each table's
    significance filter on its push (each table then pushes its own subset of the keys: the message
    carries the keys any table sends, and a bit per key and table), and the key lists the tables
    share cached once per message, under the first table.

    A request too large for one message per server goes as the tables' own requests instead
    (what ``wait`` returns is the same)."""

    def __init__(self, ctx, tables: list[SparseTable]):
        self.ctx = ctx
        self.tables = list(tables)
        self.ids = tuple(t.id for t in self.tables)
        self.dims = [t.dim for t in self.tables]
        self._requests: dict[int, _Request | list] = {}
        head = self.tables[0]
        self.together = all(t.traffic == head.traffic for t in self.tables)  # (else: the tables' own requests)
        self.filters = head.filters  # (the first table's key lists are the set's)
        self.wire = head.wire
        self.own_pushes = self.filters is not None and self.filters.residual is not None

    def _fits(self, n_push: int, n_pull: int) -> bool:
        limit, n = transport.MAX_MESSAGE_BYTES, len(self.ids)
        counts = [n_push] * n if self.own_pushes else None
        return (self.together
                and protocol.tables_request_bytes(n, n_push, n_pull, self.dims, True, table_counts=counts) + 16 <= limit
                and protocol.tables_reply_bytes(n_pull, self.dims) <= limit)

    def ipull(self, keys, unique: bool = False, ahead: int = 0) -> int:
        """Start pulling every table's rows of ``keys``, as :meth:`SparseTable.ipull`."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        if not self._fits(0, keys.shape[0]):
            return self._register([(t, t.ipull(keys, unique, ahead)) for t in self.tables])
        expand = None
        if not unique and not kkeys.is_sorted_unique(keys):
            keys, expand = kkeys.unique_keys(keys)
        req = _Request(protocol.PULLS, self.tables[0], n_unique=keys.shape[0], clock=self.ctx.clock_value + ahead,
                       started=time.monotonic(), expand=expand)
        empty = [np.zeros((0, d), np.float32) for d in self.dims]
        self._send(req, protocol.NO_KEYS, empty, keys, None)
        return self._register(req)

    def ipushpull(self, push_keys, grads: list, pull_keys, ahead: int = 0, in_pull: np.ndarray | None = None,
                  clock_workers: int = 1) -> int:
        """Push every table's gradients of ``push_keys`` (distinct, any order), end the step (the
        clock), and start pulling every table's rows of ``pull_keys`` (distinct; none: the push
        and the clock alone), as :meth:`SparseTable.ipushpull` with ``unique`` for each table.
        ``in_pull``: a bool per pushed key, whether it is among ``pull_keys``; ``clock_workers``: as
        for :meth:`SparseTable.ipushpull`."""
        ctx = self.ctx
        push_keys = np.ascontiguousarray(push_keys, dtype=np.uint64).reshape(-1)
        pull_keys = np.ascontiguousarray(pull_keys, dtype=np.uint64).reshape(-1)
        grads = [np.ascontiguousarray(g, dtype=np.float32).reshape(push_keys.shape[0], d)
                 for g, d in zip(grads, self.dims)]
        if not self._fits(push_keys.shape[0], pull_keys.shape[0]):  # each table's own requests
            head, rest = self.tables[0], list(zip(self.tables[1:], grads[1:]))
            pushes = [(t, t.push(push_keys, g, unique=True, donate=True)) for t, g in rest]
            for t, ts in pushes:  # (before the clock that the first table's push-pull carries)
                t.wait(ts)
            ts = head.ipushpull(push_keys, grads[0], pull_keys, unique=True, ahead=ahead, donate=True,
                                clock_workers=clock_workers)
            return self._register([(head, ts)] + [(t, t.ipull(pull_keys, unique=True, ahead=ahead)) for t, _ in rest])
        req = _Request(protocol.PUSHPULLS, self.tables[0], n_unique=pull_keys.shape[0], clock=ctx.clock_value,
                       started=time.monotonic(), ahead=ahead, clock_workers=clock_workers)
        if self.own_pushes and push_keys.shape[0]:  # each table's significance filter: its own subset
            sig = [t.filters.significant(push_keys, g) for t, g in zip(self.tables, grads)]
            self._send(req, push_keys, sig, pull_keys, in_pull)
        else:
            self._send(req, push_keys, grads, pull_keys, in_pull)
        ctx.advance_clock()
        return self._register(req)

    def _parts(self, push_keys, grads: list, pull_keys, in_pull) -> list:
        """Each server's (pushed keys; the tables' gradients; positions of its pulled keys; in-pull
        bits or None; each table's bools over its pushed keys, or None where every table pushes every
        key). ``grads``: each table's (send bools, rows sent) where each table sends its own subset
        (:meth:`~hpcps.ps.filters.TableFilters.significant`): a server gets the keys any table sends,
        and instead of in-pull bits, (the keys it would have got, whether with in-pull bits)."""
        ctx, n = self.ctx, push_keys.shape[0]
        own = n and isinstance(grads[0], tuple)
        if own:
            sends = [m for m, _ in grads]
            union = np.logical_or.reduce(sends)
            if ctx.layout.servers == 1:  # (every table's rows as they are, in the keys' order)
                at = np.flatnonzero(union)
                return [(push_keys[at], [g for _, g in grads], positions(pull_keys.shape[0]),
                         (n, in_pull is not None), [m[at] for m in sends])]
            rank = [np.cumsum(m) - 1 for m in sends]  # (a sent key's row among the table's rows)
        if ctx.layout.servers == 1:
            pushed, pull_parts = [positions(n)], [positions(pull_keys.shape[0])]
        else:
            push_order, push_offsets = ctx.placement.push_slice(push_keys)  # (to every copy)
            pull_order, pull_offsets = ctx.placement.slice(pull_keys)
            pushed = [push_order[push_offsets[s]:push_offsets[s + 1]] for s in range(ctx.layout.servers)]
            pull_parts = [pull_order[pull_offsets[s]:pull_offsets[s + 1]] for s in range(ctx.layout.servers)]
        parts = []
        for sp, sl in zip(pushed, pull_parts):
            if not own:
                whole = ctx.layout.servers == 1
                parts.append((push_keys if whole else push_keys[sp], grads if whole else [g[sp] for g in grads], sl,
                              in_pull if whole or in_pull is None else in_pull[sp], None))
                continue
            at = sp[union[sp]]  # (the server's keys that some table sends)
            masks = [m[at] for m in sends]
            rows = [g[r[at[m]]] for (_, g), r, m in zip(grads, rank, masks)]
            parts.append((push_keys[at], rows, sl, (sp.shape[0], in_pull is not None), masks))
        return parts

    def _send(self, req: _Request, push_keys, grads: list, pull_keys, in_pull) -> None:
        """One message to every server (each needs the clock; a pull only those owning keys).
        ``grads``: as :meth:`_parts` says."""
        ctx, head = self.ctx, self.tables[0]
        req.owner = self
        kind = protocol.MESSAGES[req.op]
        every = req.op == protocol.PUSHPULLS
        for server, (keys, g, sel, bits, sends) in enumerate(self._parts(push_keys, grads, pull_keys, in_pull)):
            if (not every and sel.shape[0] == 0) or server in ctx.placement.lost:
                continue
            pulled = pull_keys if ctx.layout.servers == 1 else pull_keys[sel]
            enc = self._encoding(server, keys, g, pulled, sends, bits)
            head._post(req, server, sel, protocol.tables_reply_bytes(sel.shape[0], self.dims, enc.wire),
                       lambda req_id, keys=keys, g=g, pulled=pulled, bits=bits, enc=enc, sends=sends: kind(
                           self.ids, req_id, req.clock, ctx.worker_index, keys, g, pulled, req.ahead,
                           None if sends is not None else bits, req.clock_workers, enc, sends).pack(ctx.pool.take),
                       asked=pulled)

    def _encoding(self, server: int, push_keys, grads: list, pull_keys, sends, bits) -> protocol.Encoding:
        """How a message to ``server`` travels under the tables' filters, as
        :meth:`SparseTable._encoding` says (each table's values counted by its own filters; the key
        lists cached under the first table, the pushed one plainly behind the significance filter).
        Where each table sends its own subset (``sends``; ``bits``: then the keys the server would
        have been pushed and whether with in-pull bits), the bytes saved are what the message would
        have been less what it is."""
        f = self.filters
        if f is None:
            return protocol.PLAIN
        for table, g in zip(self.tables, grads):
            table.filters.count_values(g.size)
            table.filters.saturated(g)
            table.filters.count_values(pull_keys.shape[0] * table.dim)
        enc = protocol.Encoding(f.wire, *f.key_ref(server, push_keys, pushed=True), *f.key_ref(server, pull_keys))
        if sends is not None:  # (in float32: the wire type counts its own savings on the values sent)
            n, dims, n_pull, fp32 = len(self.dims), self.dims, pull_keys.shape[0], replace(enc, wire=filters.FP32)
            whole = protocol.tables_request_bytes(n, bits[0], n_pull, dims, bits[1] and bits[0] > 0, fp32)
            sent = protocol.tables_request_bytes(n, push_keys.shape[0], n_pull, dims, False, fp32,
                                                 [g.shape[0] for g in grads])
            f.stats["push_threshold_saved_bytes"] += whole - sent
        return enc

    def _register(self, req) -> int:
        ts = self.ctx.next_timestamp()
        self._requests[ts] = req
        return ts

    def wait(self, ts: int, timeout: float | None = None) -> list[np.ndarray]:
        """Wait for request ``ts``; returns every table's pulled rows (none after a bare push)."""
        req = self._requests.pop(ts)
        if isinstance(req, list):  # the tables' own requests
            return [t.wait(x, timeout) for t, x in req]
        ctx = self.ctx
        wait_for_replies(ctx, req, timeout)
        # one server answered for every key, in order: its rows as they came
        whole = ctx.layout.servers == 1 and len(req.parts) == 1
        out = None if whole else [np.empty((req.n_unique, d), dtype=np.float32) for d in self.dims]
        min_clock = None
        for sel, reply in req.parts:
            server, _, server_min_clock = read_reply_header(ctx, reply)
            counts, values = protocol.tables_reply_parts(reply, sel.shape[0], self.dims, self.wire)
            for table, c, v in zip(self.tables, counts.tolist(), values):
                table.server_counts[server] = tuple(c)
                if table.filters is not None:
                    table.filters.saturated(v, pulled=True)
            if whole:
                out = values
            else:
                for o, v in zip(out, values):
                    if v.shape[0]:
                        kkeys.scatter_rows(o, sel, v)
            min_clock = server_min_clock if min_clock is None else min(min_clock, server_min_clock)
        for table in self.tables:
            table.last_min_clock = min_clock
        note_staleness(ctx, req, min_clock)
        if out is None:  # (nothing pulled)
            out = [np.empty((0, d), dtype=np.float32) for d in self.dims]
        return out if req.expand is None else [kkeys.gather_rows(o, req.expand) for o in out]

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
        """Group collective: allreduce ``grad`` in the group; its first rank pushes the sum and
        waits for the servers' acknowledgement."""
        grad = self._check(grad)
        total = transport.allreduce(self.ctx.group_comm, grad, "sum", timeout=self.ctx.stall_timeout_s,
                                    what=f"allreduce of dense table {self.sparse.name!r}")
        ts = self.ipush_summed(total)
        if ts is not None:
            self.sparse.wait(ts)

    def _check(self, grad) -> np.ndarray:
        grad = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
        if grad.shape[0] != self.size:
            raise ValueError(f"dense table {self.sparse.name!r}: gradient of size {grad.shape[0]}, expected {self.size}")
        return grad

    def start_allreduce(self, grad) -> tuple:
        """Group collective, nonblocking: start summing ``grad`` over the group; returns (the sum's
        array, its Pending) for :meth:`ipush_summed` after ``transport.finish_collective``."""
        return transport.start_allreduce(self.ctx.group_comm, self._check(grad), "sum",
                                         f"allreduce of dense table {self.sparse.name!r}")

    def ipush_summed(self, total) -> int | None:
        """The group's first rank pushes the group's summed gradient ``total`` (nonblocking; its
        timestamp, None on the other members)."""
        if self.ctx.group_comm.Get_rank() != 0:
            return None
        padded = np.zeros(self.chunks * self.CHUNK, dtype=np.float32)
        padded[: self.size] = total
        return self.sparse.push(self.keys, padded.reshape(self.chunks, self.CHUNK), unique=True, donate=True)

    def ipull(self, ahead: int = 0) -> int | None:
        """The group's first rank starts pulling the vector (its timestamp, None elsewhere), for
        the step ``ahead`` clocks later (see :meth:`SparseTable.ipull`); :meth:`finish_pull`
        completes it on every member."""
        return self.sparse.ipull(self.keys, unique=True, ahead=ahead) if self.ctx.group_comm.Get_rank() == 0 else None

    def finish_pull(self, ts: int | None, out: np.ndarray | None = None) -> np.ndarray:
        """Group collective: the vector pulled by :meth:`ipull`, broadcast from the first rank."""
        out = np.empty(self.size, dtype=np.float32) if out is None else out
        if ts is not None:
            out[:] = self.sparse.wait(ts).reshape(-1)[: self.size]
        if self.ctx.group_comm.Get_size() > 1:
            transport.bcast(self.ctx.group_comm, out, root=0, timeout=self.ctx.stall_timeout_s,
                            what=f"broadcast of dense table {self.sparse.name!r}")
        return out

    def pull(self) -> np.ndarray:
        """Group collective: the vector, pulled by the group's first rank and broadcast."""
        return self.finish_pull(self.ipull())
