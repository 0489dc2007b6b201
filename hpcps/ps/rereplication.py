"""New backups after a lost server (``cluster.replicas`` under ULFM, three servers or more): every
shard whose copies fell below ``r + 1`` gets a new backup on the survivor the placement picks
(:meth:`hpcps.ps.placement.Placement.after_loss`, :func:`hpcps.ps.placement.new_copies`), copied
over the wire from its primary, while training goes on.

The copy must give the new backup every push exactly once: those the copy holds, and those the
workers send it directly. Under BSP that is agreed on a clock, ``C`` (under SSP and ASP: below):

* **A worker** that learns of the loss moves to the new placement and, before any other request,
  tells every server so (``PLACED``, with its clock ``K``: every push it sent before has a clock
  of at most ``K``; :meth:`hpcps.ps.context.ContextReplicas.server_lost`). Under
  ``train.group_pull`` a group's first rank tells it for its members too: they push nothing
  (their first rank pushes for the group) and would tell it only at their end. A worker's messages to
  a server arrive in the order it sent them, so each server sees exactly which of its pushes came
  before the switch.
* **The source** (the shard's primary after the loss) waits for every worker's ``PLACED`` (a
  worker done or lost sends no more pushes: its last clock stands in) and takes ``C`` = the
  largest ``K`` + 1: every push of clock ``C`` or later was sent under the new placement, to the
  new backup too. Under BSP a server applies the pushes of clock ``c`` once every worker has
  passed ``c``, in clock order, so there is a moment where every push of a clock before ``C`` is
  applied and none after: the cut (:meth:`Rereplication.due`, between requests, and
  :meth:`Rereplication.before_push`, before the first push of clock ``C`` where a lost or done
  worker moved the slowest clock past it at once). The moved shards' rows are read then and sent
  (``COPY``, nonblocking: two servers may copy to each other at once, each serving loop receives
  its copy as a request).
* **The new backup** holds its part of the pushes of the shards it waits for (they would create
  rows from the initializer) until the copy lands; then it loads the rows, drops the pushes held
  of a clock before ``C`` (in the copy already) and applies the others in their order; a push
  of those shards of a clock before ``C`` that comes later is dropped too
  (:meth:`Rereplication.sort_backlog`, over the backups' part of the pushes, which is all it
  gets of them: a backup is not read).

Under SSP and ASP a server applies pushes as they arrive: there is no clock to cut at. The cut is
made at the workers' ``PLACED`` instead, each worker's own (a consistent cut, as Chandy and
Lamport's markers): the copy holds every push a worker sent before its ``PLACED``, and none it
sent after.

* **The source** applies every push to its rows as it comes, as always: reads, checkpoints and
  delta snapshots see every push (SSP's bound holds; a snapshot written meanwhile loses none).
  Beside its rows it keeps a *shadow* of the moved shards' rows (:class:`Shadow`), a copy taken
  when it learns of the loss (no push sent after a ``PLACED`` can have come yet: a worker sends
  its ``PLACED`` first, and a server learns of the loss by then at the latest), to which it
  applies, with the table's own rule and in their order of arrival, only the pushes of workers
  whose ``PLACED`` has not come yet, and of those only their keys of the moved shards (rows
  created there as the table would). Once every worker's ``PLACED`` is in (or the worker is done
  or lost), the shadow holds exactly the pushes sent before each worker's notice: it is sent as
  the copy and dropped (:meth:`Rereplication.cut`). What it costs: the rows the source copies out,
  held a second time from the loss until every notice is in (as large as the copy it sends), and
  the pushes sent before a notice applied twice to the moved shards' keys (measured:
  docs/benchmarks.md). A rule updates each row from its own row and gradient (Adam's step count is
  per row), which the copy relies on: the shadow's rows are those the table would hold had it had
  only those pushes. Admission draws per key and clock, as the table does (``admit_count > 1`` and
  memory budgets do not go with replicas).
* **The new backup** gets from each worker only pushes sent after that worker's ``PLACED`` (the
  old placement did not send it those shards): it holds them until the copy lands and then
  applies every one, in their order; none is dropped. So each push reaches each copy once. The
  backup's rows equal the primary's up to the order of two workers' pushes: the primary may
  have applied a push sent after one worker's notice before one sent before another's, the
  backup applies the latter first (as any two copies under SSP and ASP, whose pushes interleave
  as they arrive).

Why a shadow rather than keeping the pushes sent after a ``PLACED`` aside until the cut (which
gives the same copy): those pushes would be missing meanwhile from reads (SSP promises them to
its reads, and deferring a read could wait on a worker that learns of the loss only through it)
and from a checkpoint or delta snapshot written meanwhile (applied after it, lost on a restore
from it). The shadow leaves the rows, and all that reads them, as without a loss.

Why not a cut by a per-worker sequence of pushes (the source telling, for each worker, the last
push it applied, and the new backup dropping those up to it): a push goes to each server as a
message of its own, with a request id of its own, so nothing in the messages says which of the
new backup's is which of the source's; a sequence would be a new header word on every request.
The cut at ``PLACED`` needs none, and the new backup drops nothing.

A server that learns of the loss from a worker's ``PLACED`` before its own MPI says so handles
the loss right then (a new backup must hold the pushes that follow it). Not done here, each
ending the job in one line as without replicas: copies with rows that age or are evicted, and a
second loss while copies are under way, or before a new backup has had (and dropped) every push
its landed copy holds already (:meth:`Rereplication.check_promoted`, BSP). A second loss after
that is survived as the first.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from hpcps.ps import protocol, transport
from hpcps.ps.server_table import ServerTable
from hpcps_kernels.hashing import shard_of

HOLD = np.iinfo(np.int64).max  # a shard's first clock taken from the workers: none yet (its copy awaited)
END = HOLD - 1  # a copy's clock when it was cut once every worker was done (it holds every push)
NOTICES = -1  # an SSP or ASP copy's clock: cut at the workers' PLACED (it holds no push sent after; none dropped)


def insert_rows(tables: list, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Add each table's ``(keys, rows)`` of ``parts`` (keys it does not hold: a copy's new
    shards) as a push adds new keys: the others' rows stay in place, the time is the rows added's."""
    for table, (keys, rows) in zip(tables, parts):
        if keys.shape[0] == 0:
            continue
        store = table.store
        first_new = store.index.size
        slots = store.lookup_or_insert(keys)
        table.policies.rows_created(store.create_rows(keys, slots, first_new), first_new)
        store.rows[slots] = rows
        if store.changed is not None:  # (delta snapshots: rows this server may write once primary)
            store.mark_changed(slots)


class Shadow:
    """A source's copy of the rows it copies out (under SSP and ASP, from the loss to the cut),
    given only the pushes sent before their worker's ``PLACED``: ``tables`` (each a
    :class:`~hpcps.ps.server_table.ServerTable` of the table's spec, holding the rows of
    ``shards`` of the server's ``tables`` as they are now)."""

    def __init__(self, tables: list, shards: list[int], num_shards: int):
        self.moved = np.zeros(num_shards, dtype=bool)
        self.moved[shards] = True
        self.tables = []
        for table in tables:
            keys, rows = table.items()
            sel = self.moved[shard_of(np.ascontiguousarray(keys), num_shards)]
            # (a hash index whatever the key space: a direct index's array, 64 MiB at 24 bits, would
            # cost its making and its memory for a table held until the notices are in)
            shadow = ServerTable(dataclasses.replace(table.spec, key_bits=64))
            shadow.threads = table.threads
            shadow.load(keys[sel], rows[sel], own=True)  # (copies: fancy indexing)
            self.tables.append(shadow)
        self.pushes = 0  # pushes applied here (their keys of the moved shards)
        self.seconds = 0.0  # the time they took (the double apply's cost)

    def push(self, table: int, keys: np.ndarray, grads: np.ndarray, clock: int) -> None:
        """Apply a push sent before its worker's ``PLACED`` (its keys of the moved shards) as the
        table applies it (``clock``: admission's draw)."""
        started = time.perf_counter()
        sel = self.moved[shard_of(np.ascontiguousarray(keys), self.moved.shape[0])]
        if sel.all():
            self.tables[table].push(keys, grads, clock)
        elif sel.any():
            self.tables[table].push(keys[sel], grads[sel], clock)
        self.pushes += 1
        self.seconds += time.perf_counter() - started


def overdue(copying) -> transport.StallError:
    """The error of a :class:`Rereplication` whose awaited copies have not landed within
    ``cluster.stall_timeout_s`` of the loss (their sources named)."""
    server = copying.server
    return transport.StallError(
        f"server {server.index}: the copies of {copying.waiting_for} shards as new backups after server "
        f"{copying.lost} was lost never landed from server(s) {', '.join(map(str, sorted(copying.awaited_from)))} "
        f"in cluster.stall_timeout_s = {server.stall_timeout_s:g} s")


def check_awaited(copying) -> None:
    """Where copies are awaited by a :class:`Rereplication`: RankFailed where a source of theirs
    is known lost (they never come: the job ends at once), the :func:`overdue` error past
    ``cluster.stall_timeout_s`` from the loss."""
    gone = copying.awaited_from & set(transport.failed_ranks())
    if gone:
        raise transport.RankFailed(sorted(gone), "serving", "a second server lost while new backups were being copied")
    if time.monotonic() - copying.lost_at > copying.server.stall_timeout_s:
        raise overdue(copying)


def cut_said(clock: int) -> str:
    """Where a copy was cut, in its lines."""
    return "at the end" if clock == END else "at the workers' notices" if clock == NOTICES else f"at clock {clock}"


class Rereplication:
    """A server's new backups after a lost server: those it copies out (the source) and those it
    waits for (the target). ``server``: a :class:`hpcps.ps.server.Server` under ULFM with replicas."""

    def __init__(self, server):
        self.server = server
        # each shard's first clock whose pushes this server applies from the workers (-1: every
        # push; HOLD: none yet, its copy awaited; C: those of clock C on, earlier ones in the copy)
        self.from_clock = np.full(server.placement.num_shards, -1, dtype=np.int64)
        self.held: list = []  # the backups' part of pushes of shards awaited, in their order
        self.sorting = False  # whether a shard's pushes are held or some dropped (from_clock >= 0 somewhere)
        self.landed_by: int | None = None  # the latest clock of the copies landed, until forgotten
        self.lost = -1  # the server whose loss the copies under way follow
        self.outgoing: dict[int, list[int]] = {}  # target server -> shards this server copies to it
        self.waiting_for = 0  # shards awaited here
        self.placed: dict[int, int] = {}  # worker -> its clock at PLACED (the loss ``lost``)
        self.boundary: int | None = None  # C, once every worker's PLACED is in
        self.lost_at = 0.0
        self.awaited_from: set[int] = set()  # the servers whose copies land here (the loss ``lost``)
        self.at_notices = server.staleness != 0  # (SSP, ASP: the copies cut at the workers' PLACED, from a shadow)
        self.shadow: Shadow | None = None  # a source's, from the loss to the cut (SSP, ASP)
        self.unshadowed = 0  # pushes after their worker's PLACED meanwhile (the shadow not given them)

    @property
    def busy(self) -> bool:
        """Whether copies of the last loss are still to be sent from here or to land here."""
        return bool(self.outgoing or self.waiting_for)

    def plan(self, lost: int, moves: list[tuple[int, int, int]]) -> None:
        """Server ``lost`` is gone and ``moves`` (``(shard, source, target)``) are the copies to
        make: wait for this server's own, and hold the pushes of those it is the target of."""
        server = self.server
        why = ("a second server lost while new backups were being copied" if self.busy else
               "new backups are not copied where rows are evicted (features.evict_*)" if server.evicting else "")
        if why:
            raise transport.RankFailed([lost], "serving", why)
        self.lost, self.placed, self.boundary, self.lost_at = lost, {}, None, time.monotonic()
        self.outgoing, self.awaited_from = {}, set()
        for shard, source, target in moves:
            if source == server.index:
                self.outgoing.setdefault(target, []).append(shard)
            if target == server.index:
                self.from_clock[shard] = HOLD
                self.awaited_from.add(source)
        self.waiting_for = int((self.from_clock == HOLD).sum())
        self.sorting = self.sorting or bool(self.waiting_for)
        if self.at_notices and self.outgoing:  # (every push applied so far was sent before any PLACED)
            shards = sorted(s for moved in self.outgoing.values() for s in moved)
            self.shadow, self.unshadowed = Shadow(server.tables, shards, server.placement.num_shards), 0
        self._find_boundary()

    def check_promoted(self, lost: int) -> None:
        """After server ``lost``'s shards were promoted (this server's placement is the one without
        it): where this server is now primary of a shard whose copy landed here at clock ``C``
        but pushes of a clock before ``C`` may still be kept for their turn (:meth:`due` has not
        forgotten ``C`` yet), the job ends as for a loss while copies are under way: applied as a
        primary's, those pushes would not be dropped (:meth:`sort_backlog` sees only the backups'
        part) and would update rows the copy holds them in already."""
        if self.landed_by is None:
            return
        landed = (self.from_clock >= 0) & (self.from_clock < END)
        if (landed & (self.server.placement.shard_server == self.server.index)).any():
            raise transport.RankFailed([lost], "serving", "a second server lost before the new backups copied "
                                                          "after the first held every push before their copy")

    def placed_by(self, worker: int, clock: int, lost: int) -> None:
        """Worker ``worker``'s ``PLACED``: from clock ``clock`` on it sends under the placement
        without server ``lost``."""
        if lost == self.lost:
            self.placed[worker] = clock
            self._find_boundary()

    def _find_boundary(self) -> None:
        """C, once every worker not done has sent its ``PLACED`` (where this server copies out)."""
        workers = self.server.workers
        if not self.outgoing or self.boundary is not None:
            return
        clocks = []
        for w in range(workers.num_workers):
            if w in self.placed:
                clocks.append(self.placed[w])
            elif workers.done[w]:
                clocks.append(int(workers.clocks[w]))
            else:
                return
        self.boundary = max(clocks) + 1

    def due(self) -> bool:
        """Between requests: send the copies once their clock is reached (every push before it
        applied) or every worker is done (every push applied); whether copies are still under way.
        A landed copy's clock is forgotten once every push before it has been applied here; one
        that cannot land (its source lost, or past the timeout) ends the job (:func:`check_awaited`)."""
        workers = self.server.workers
        if self.landed_by is not None and workers.min_clock() >= self.landed_by:
            self.from_clock[(self.from_clock >= 0) & (self.from_clock < END)] = -1
            self.landed_by = None
            self.sorting = bool(self.waiting_for)
        if self.outgoing:
            self._find_boundary()  # (a worker done or lost since: its PLACED will not come)
            if self.at_notices:  # (every worker done: its boundary is found, the shadow holds every push)
                if self.boundary is not None:
                    self.cut(NOTICES)
            elif workers.all_done and not workers.waiting:
                self.cut(END)
            elif self.boundary is not None and workers.min_clock() >= self.boundary:
                self.cut(self.boundary)
        if self.waiting_for:
            check_awaited(self)
        return self.busy

    def on_push(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray, clock: int) -> None:
        """Before a push of ``clock`` from ``worker`` to table number ``table`` is applied (to
        every key, as always): under SSP and ASP, given to the shadow too where its worker's
        ``PLACED`` has not come; under BSP, :meth:`before_push`."""
        if not self.at_notices:
            self.before_push(clock)
        elif self.shadow is not None:
            if worker in self.placed:
                self.unshadowed += 1
            else:
                self.shadow.push(table, keys, grads, clock)

    def before_push(self, clock: int) -> None:
        """BSP, before a push of ``clock`` is applied: where it is the first of the clock the copies
        reflect, they are read first."""
        if self.outgoing and self.boundary is not None and clock >= self.boundary:
            self.cut(self.boundary)

    def cut(self, clock: int) -> None:
        """Read the moved shards' rows (every push of a clock before ``clock`` applied, none
        after; at the notices: the shadow's) and send each target its copy, without waiting."""
        if self.shadow is None:
            self.server.apply_backlog()
        for target, shards in self.outgoing.items():
            self.copy_to(target, sorted(shards), clock, time.monotonic())
        self.outgoing, self.shadow = {}, None

    def copy_to(self, target: int, shards: list[int], clock: int, started: float) -> None:
        """Send server ``target`` the rows of ``shards`` as they are now (``clock``: the copy's),
        in as many messages as keep each under MPI's 2 GiB (halving the shards)."""
        server, shadow = self.server, self.shadow
        tables = server.tables if shadow is None else shadow.tables
        parts = server.replication.copy_out(tables, [(s, server.index, target) for s in shards])[target]
        msg = protocol.Copy(clock, server.index, self.lost, np.array(shards, dtype=np.int64),
                            [(k, r) for _, k, r, _ in parts], started).pack()
        if msg.nbytes > transport.MAX_MESSAGE_BYTES and len(shards) > 1:
            for half in (shards[:len(shards) // 2], shards[len(shards) // 2:]):
                self.copy_to(target, half, clock, started)
            return
        server.replies.sending += server.net.start_send(msg, target, protocol.TAG_REQUEST,
                                                        f"copy of {len(shards)} shards to server {target}")
        sys.stderr.write(f"hpcps: server {server.index}: copying {len(shards)} shards "
                         f"({sum(int(k.shape[0]) for _, k, _, _ in parts)} rows) to server "
                         f"{target} as new backups, cut {cut_said(clock)}{self._shadow_said()}, "
                         f"{started - self.lost_at:.3f} s after the loss\n")

    def _shadow_said(self) -> str:
        """What the shadow a copy is read from took, in its line (nothing under BSP)."""
        shadow = self.shadow
        return "" if shadow is None else (f" ({shadow.pushes} pushes sent before their notices applied to its "
                                          f"shadow in {shadow.seconds:.4f} s, {self.unshadowed} sent after)")

    def take(self, copy: protocol.Copy) -> None:
        """A copy landed here: load its rows; of the pushes held for its shards, drop those of a
        clock before its own and apply the others, in their order."""
        server = self.server
        server.apply_backlog()  # (the pushes of shards not awaited; those awaited stay held)
        insert_rows(server.tables, copy.parts)
        self.from_clock[copy.shards] = copy.clock
        if NOTICES < copy.clock < END:
            self.landed_by = max(copy.clock, self.landed_by or 0)
        self.waiting_for = int((self.from_clock == HOLD).sum())
        self.sorting = bool((self.from_clock >= 0).any())  # (an ASP copy's shards: nothing held or dropped)
        held, self.held = self.held, []
        server.backlog = held + server.backlog
        server.apply_backlog()
        landed = time.monotonic()
        rows = sum(int(k.shape[0]) for k, _ in copy.parts)
        sys.stderr.write(f"hpcps: server {server.index}: new backups of {copy.shards.shape[0]} shards landed from "
                         f"server {copy.source} ({rows} rows, {landed - copy.cut_at:.3f} s from its cut "
                         f"{cut_said(copy.clock)})\n")

    def sort_backlog(self, backlog: list) -> list:
        """The backups' part of the pushes to apply now: of the shards awaited, held back (their
        copy applies them); of the shards landed, those of a clock before their copy's dropped."""
        if not self.sorting:
            return backlog
        keep = []
        for entry in backlog:
            target, keys, grads, clock, worker = entry
            start = self.from_clock[shard_of(np.ascontiguousarray(keys), self.from_clock.shape[0])]
            held = start == HOLD
            now = ~held & (clock >= start)
            if held.any():
                self.held.append((target, keys[held], grads[held], clock, worker))
            if now.all():
                keep.append(entry)
            elif now.any():
                keep.append((target, keys[now], grads[now], clock, worker))
        return keep
