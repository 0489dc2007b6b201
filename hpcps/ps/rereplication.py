"""New backups after a lost server (``cluster.replicas`` under ULFM, three servers or more): every
shard whose copies fell below ``r + 1`` gets a new backup on the survivor the placement picks
(:meth:`hpcps.ps.placement.Placement.after_loss`, :func:`hpcps.ps.placement.new_copies`), copied
over the wire from its primary, while training goes on.

The copy must give the new backup every push exactly once: those the copy holds, and those the
workers send it directly. Under BSP that is agreed on a clock, ``C`` (under ASP: below):

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

Under ASP a server applies pushes as they arrive: there is no clock to cut at. The cut is made at
the workers' ``PLACED`` instead, each worker's own (a consistent cut, as Chandy and Lamport's
markers): the copy holds every push a worker sent before its ``PLACED``, and none it sent after.

* **The source**, from a worker's ``PLACED`` on, keeps that worker's pushes (all of them, in
  their order) instead of applying them (:meth:`Rereplication.keeps`). Once every worker's
  ``PLACED`` is in (or the worker is done or lost), the moved shards' rows are read and sent,
  and the pushes kept are applied, in their order (:meth:`Rereplication.cut`). Its rows then
  hold every push before each worker's ``PLACED`` (each came before it on the same channel and
  was applied on arrival) and none after. Reads meanwhile see the rows without the pushes kept:
  under ASP a read is promised no push. The wait lasts until every worker has sent its notice,
  which a worker sends when a request of its own meets the loss: milliseconds while all train
  (1-2 pushes kept in docs/measure-rereplication.py), longer if one sits in a collective
  meanwhile. Not handled: a checkpoint written on the source in that window holds its rows
  without the pushes kept (they are applied after it).
* **The new backup** gets from each worker only pushes sent after that worker's ``PLACED`` (the
  old placement did not send it those shards): it holds them until the copy lands and then
  applies every one, in their order; none is dropped. So each push reaches each copy once, and the
  backup's rows equal the primary's up to the interleaving of two workers' pushes, as any two
  copies' under ASP.

Why not a cut by a per-worker sequence of pushes (the source telling, for each worker, the last
push it applied, and the new backup dropping those up to it): a push goes to each server as a
message of its own, with a request id of its own, so nothing in the messages says which of the
new backup's is which of the source's; a sequence would be a new header word on every request.
The cut at ``PLACED`` needs none, and the new backup drops nothing.

A server that learns of the loss from a worker's ``PLACED`` before its own MPI says so handles
the loss right then (a new backup must hold the pushes that follow it). Not done here, each
ending the job in one line as without replicas: copies under SSP (the source's kept pushes would
be missing from reads the staleness bound promises them to, and deferring those reads could wait
on a worker that learns of the loss only through them), with rows that age or are evicted, and a
second loss while copies are under way, or before a new backup has had (and dropped) every push
its landed copy holds already (:meth:`Rereplication.check_promoted`, BSP). A second loss after
that is survived as the first.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from hpcps.ps import protocol, transport
from hpcps_kernels.hashing import shard_of

HOLD = np.iinfo(np.int64).max  # a shard's first clock taken from the workers: none yet (its copy awaited)
END = HOLD - 1  # a copy's clock when it was cut once every worker was done (it holds every push)
NOTICES = -1  # an ASP copy's clock: cut at the workers' PLACED (it holds no push sent after; none dropped)


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
        self.asp = server.staleness < 0  # (the copies cut at the workers' PLACED, the pushes after it kept)
        self.kept: list = []  # ASP, a source: the pushes sent after their worker's PLACED, until the cut

    @property
    def busy(self) -> bool:
        """Whether copies of the last loss are still to be sent from here or to land here."""
        return bool(self.outgoing or self.waiting_for)

    def plan(self, lost: int, moves: list[tuple[int, int, int]]) -> None:
        """Server ``lost`` is gone and ``moves`` (``(shard, source, target)``) are the copies to
        make: wait for this server's own, and hold the pushes of those it is the target of."""
        server = self.server
        why = ("a second server lost while new backups were being copied" if self.busy else
               "new backups are copied under BSP and ASP only (cluster.staleness 0 or -1, not SSP)"
               if server.staleness > 0 else
               "new backups are not copied where rows are evicted (features.evict_*)" if server.evicting else "")
        if why:
            raise transport.RankFailed([lost], "serving", why)
        self.lost, self.placed, self.boundary, self.lost_at = lost, {}, None, time.monotonic()
        self.outgoing = {}
        for shard, source, target in moves:
            if source == server.index:
                self.outgoing.setdefault(target, []).append(shard)
            if target == server.index:
                self.from_clock[shard] = HOLD
        self.waiting_for = int((self.from_clock == HOLD).sum())
        self.sorting = self.sorting or bool(self.waiting_for)
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
        A landed copy's clock is forgotten once every push before it has been applied here."""
        workers = self.server.workers
        if self.landed_by is not None and workers.min_clock() >= self.landed_by:
            self.from_clock[(self.from_clock >= 0) & (self.from_clock < END)] = -1
            self.landed_by = None
            self.sorting = bool(self.waiting_for)
        if self.outgoing:
            self._find_boundary()  # (a worker done or lost since: its PLACED will not come)
            if self.asp and self.boundary is not None:
                self.cut(NOTICES)
            elif workers.all_done and not workers.waiting:
                self.cut(END)
            elif self.boundary is not None and workers.min_clock() >= self.boundary:
                self.cut(self.boundary)
        return self.busy

    def keeps(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray, clock: int) -> bool:
        """Before a push of ``clock`` from ``worker`` to table number ``table`` is applied: whether
        it is kept for :meth:`cut` instead (ASP: its worker's ``PLACED`` came before it and the
        copies are still to be read); under BSP, :meth:`before_push`."""
        if not self.asp:
            self.before_push(clock)
            return False
        if self.outgoing and worker in self.placed:
            self.kept.append((worker, table, keys, grads, clock))
            return True
        return False

    def before_push(self, clock: int) -> None:
        """BSP, before a push of ``clock`` is applied: where it is the first of the clock the copies
        reflect, they are read first."""
        if self.outgoing and self.boundary is not None and clock >= self.boundary:
            self.cut(self.boundary)

    def cut(self, clock: int) -> None:
        """Read the moved shards' rows (every push of a clock before ``clock`` applied, none
        after) and send each target its copy, without waiting."""
        self.server.apply_backlog()
        for target, shards in self.outgoing.items():
            self.copy_to(target, sorted(shards), clock, time.monotonic())
        self.outgoing = {}
        kept, self.kept = self.kept, []
        for worker, table, keys, grads, at in kept:  # (ASP: the pushes sent after the PLACED, in their order)
            self.server.push_now(worker, table, keys, grads, at)
        self.server.apply_backlog()

    def copy_to(self, target: int, shards: list[int], clock: int, started: float) -> None:
        """Send server ``target`` the rows of ``shards`` as they are now (``clock``: the copy's),
        in as many messages as keep each under MPI's 2 GiB (halving the shards)."""
        server = self.server
        parts = server.replication.copy_out(server.tables, [(s, server.index, target) for s in shards])[target]
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
                         f"{target} as new backups, cut {cut_said(clock)}"
                         f"{f' ({len(self.kept)} pushes sent since kept for it)' if self.asp else ''}, "
                         f"{started - self.lost_at:.3f} s after the loss\n")

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
