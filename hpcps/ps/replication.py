"""Replicated shards (``cluster.replicas = r``, hot backup): what a server keeping copies does
differently. Pure: NumPy and the kernels, no MPI.

How the copies stay equal. Each virtual shard is kept on ``r + 1`` servers
(:meth:`hpcps.ps.placement.Placement.copies`: the primary, then its backups). A worker sends a
push to every copy of its keys' shards (:meth:`~hpcps.ps.placement.Placement.push_slice`), inside
the messages it sends each server anyway (a push-pull goes to every server: each needs the
clock), and pulls from the primary alone. A server needs no notion of primary to apply a push: it
applies what it is sent, and under BSP in the order (clock, worker, sequence), which does not
depend on the server. So a backup applies the same pushes to the same keys in the same order as
the primary, and its rows equal the primary's bit for bit, before the clock completes (a pull at
the next clock waits for every worker's clock, on the primary as always). Under SSP and ASP a
server applies pushes as they arrive: each worker's in its order, but two workers' pushes may
interleave differently on two copies (rows equal up to that order, as any two ASP runs).

Why the worker sends to every copy rather than the primary forwarding to its backups (ps-lite's
chain replication): forwarding adds a server-to-server hop and its acknowledgement before the
clock may complete, a message per backup per push, and servers that wait on each other (the
serving loop would have to take requests from servers as well as workers); sending to every
copy adds no message and no round trip (the backup's keys ride in the message each server gets
anyway), keeps the server unchanged, and makes the order argument above hold by construction.
Its cost is the push's bytes sent ``r + 1`` times by the worker and applied ``r + 1`` times over
the servers (``hpcps bench ps``: the replication row). What it adds beside that is two splits of
a push, one kernel each (:mod:`hpcps_kernels.copies`): the worker's, of its keys by every server
keeping their shards (:meth:`~hpcps.ps.placement.Placement.push_slice`), and each server's, of
what it gets into the part it is primary of, applied before its reply, and the backups' part,
applied after (:meth:`ServerCopies.push_now`).

What else changes on a server (:class:`Replication`): a checkpoint or delta snapshot writes each
shard once, from its primary (:meth:`Replication.primary_part`); a restore keeps every shard the
server holds a copy of (:meth:`Replication.restore_where`); the end of a run compares every
backup's rows with its primary's (:meth:`Replication.digests`, :func:`differing_shards`); losing a
server promotes backups and plans the new copies (:meth:`Replication.rank_lost`).
"""

from __future__ import annotations

import numpy as np

from hpcps.ps.placement import Placement, new_copies
from hpcps_kernels.copies import primary_prefix, split_primary
from hpcps_kernels.hashing import shard_of, xxh64

# A server count no checkpoint has: restore reads every file and keeps the shards asked for
# (a server holding backups needs shards of other servers' files).
EVERY_FILE = 0
NO_BITS = np.zeros(0, dtype=np.uint8)  # (a push without in-pull bits: split_primary's)


def primary_rows_mask(placement: Placement, server: int, keys: np.ndarray) -> np.ndarray:
    """A bool per key: whether ``server`` is its shard's primary."""
    return placement.shard_server[shard_of(np.ascontiguousarray(keys, dtype=np.uint64), placement.num_shards)] == server


def shard_digest(keys: np.ndarray, rows: np.ndarray) -> int:
    """XXH64 of one shard's keys and rows in key order (the slots' order is a server's own)."""
    order = np.argsort(keys, kind="stable")
    k = np.ascontiguousarray(keys[order]).view(np.uint8)
    r = np.ascontiguousarray(rows[order]).view(np.uint8).reshape(-1)
    seed = np.uint64(xxh64(k, 0, k.shape[0], np.uint64(0)))
    return int(xxh64(r, 0, r.shape[0], seed))


def differing_shards(digests: np.ndarray) -> int:
    """Of a ``num_shards x copies`` table of each copy's digest (:meth:`Replication.digests`,
    summed over the servers), the shards whose backups differ from their primary."""
    return int((digests[:, 1:] != digests[:, :1]).any(axis=1).sum())


class Replication:
    """A server's copies of the shards under ``placement`` (which it replaces when a server is
    lost): which it writes, which it restores, and their digests."""

    def __init__(self, placement: Placement, server: int):
        self.placement = placement
        self.server = server

    @property
    def on(self) -> bool:
        return self.placement.replicas > 0

    def primary_part(self, part: tuple) -> tuple:
        """A table's ``(name, keys, rows, state)`` for a checkpoint or a delta, narrowed to the
        shards this server is primary of: each shard written once. Per-row state (``last``) and
        keyed state (``removed``, ``pending_keys``/``pending_counts``) narrowed alike."""
        if not self.on:
            return part
        name, keys, rows, state = part
        mine = primary_rows_mask(self.placement, self.server, keys)
        state = dict(state)
        if isinstance(state.get("last"), np.ndarray) and state["last"].shape[0] == keys.shape[0]:
            state["last"] = state["last"][mine]
        for key, paired in (("removed", ()), ("pending_keys", ("pending_counts",))):
            if isinstance(state.get(key), np.ndarray):
                keep = primary_rows_mask(self.placement, self.server, state[key])
                for k in (key, *paired):
                    state[k] = state[k][keep]
        return name, keys[mine], rows[mine], state

    def restore_where(self) -> tuple[np.ndarray, int]:
        """(``shard_server``, ``num_servers``) for :func:`hpcps.ps.deltas.restore`: without
        replicas, the placement's; with them, every shard this server holds a copy of, read from
        every file (a checkpoint holds each shard once, in its primary's file)."""
        if not self.on:
            return self.placement.shard_server, self.placement.num_servers
        return np.where(self.placement.holds(self.server), self.server, -1), EVERY_FILE

    def digests(self, tables: list) -> np.ndarray:
        """A ``num_shards x copies`` int64 table: this server's digest of every shard it keeps
        (over every table), in the column of its copy; 0 elsewhere. Summed over the servers it
        holds every copy's digest (:func:`differing_shards`)."""
        p = self.placement
        out = np.zeros(p.copies.shape, dtype=np.int64)
        held = np.flatnonzero(p.holds(self.server))
        digests = np.zeros((held.shape[0], len(tables)), dtype=np.uint64)
        for t, table in enumerate(tables):
            keys, rows = table.items()
            shards = shard_of(np.ascontiguousarray(keys), p.num_shards)
            order = np.argsort(shards, kind="stable")
            lo = np.searchsorted(shards[order], held, side="left")
            hi = np.searchsorted(shards[order], held, side="right")
            for i in range(held.shape[0]):
                sel = order[lo[i]:hi[i]]
                digests[i, t] = shard_digest(keys[sel], rows[sel])
        for i, shard in enumerate(held):  # (one number a shard: the tables' digests folded)
            column = int(np.flatnonzero(p.copies[shard] == self.server)[0])
            d = np.ascontiguousarray(digests[i]).view(np.uint8)
            out[shard, column] = np.array([xxh64(d, 0, d.shape[0], np.uint64(0))], dtype=np.uint64).view(np.int64)[0]
        return out

    def primary_counts(self, tables: list) -> list[int]:
        """Each table's rows of the shards this server is primary of (the summary's keys: each
        shard counted once)."""
        return [int(primary_rows_mask(self.placement, self.server, t.items()[0]).sum()) for t in tables]

    def rank_lost(self, server: int) -> list[tuple[int, int, int]]:
        """Server ``server`` is gone: move on to the placement without it (its shards' first
        backups are their primaries now) and return the copies to make, ``(shard, source,
        target)`` (:func:`hpcps.ps.placement.new_copies`); this server sends those whose
        ``source`` it is (:meth:`copy_out`) and loads those whose ``target`` it is
        (:func:`hpcps.ps.rereplication.insert_rows`)."""
        before = self.placement
        self.placement = before.after_loss(server)
        return new_copies(before.copies, self.placement.copies)

    def copy_out(self, tables: list, moves: list[tuple[int, int, int]]) -> dict[int, list[tuple]]:
        """The rows this server sends for ``moves``: target -> [(table name, keys, rows, each
        row's last update or None)] (copies)."""
        by_target: dict[int, list[int]] = {}
        for shard, source, target in moves:
            if source == self.server:
                by_target.setdefault(target, []).append(shard)
        out = {}
        for target, shards in by_target.items():
            wanted = np.zeros(self.placement.num_shards, dtype=bool)
            wanted[shards] = True
            parts = []
            for table in tables:
                keys, rows = table.items()
                sel = wanted[shard_of(np.ascontiguousarray(keys), self.placement.num_shards)]
                last = None if table.last is None else table.last[:keys.shape[0]][sel].copy()
                parts.append((table.spec.name, keys[sel].copy(), rows[sel].copy(), last))
            out[target] = parts
        return out


class ServerCopies:
    """What a :class:`hpcps.ps.server.Server` (its ``replication``, ``tables`` and ``index``) does
    with its copies: its placement, its statistics and its digests (a lost server:
    :mod:`hpcps.ps.failover`, :mod:`hpcps.ps.rereplication`)."""

    failover_on = False  # under ULFM: a lost server's shards promoted here (hpcps.ps.failover.plug)
    copying = None  # under ULFM: new backups after a lost server (hpcps.ps.rereplication.Rereplication)

    @property
    def placement(self) -> Placement:
        """The placement this server works under (it changes when a server is lost)."""
        return self.replication.placement

    def copy_stats(self) -> dict:
        """With replicas, the final statistics' ``keys`` count the rows of the shards this server is
        primary of (each shard once over the servers)."""
        return {"keys": self.replication.primary_counts(self.tables)} if self.replication.on else {}

    def push_now(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray, clock: int,
                 in_pull: np.ndarray | None = None):
        """Apply a push to table number ``table`` now (``ServerTable.push``: returns its rest).
        With replicas, only its keys of the shards this server is primary of: those of the shards
        it backs up wait in :attr:`backlog` for :meth:`apply_backlog`, once the request is
        answered (nobody reads a backup, so its update need not delay a reply; each key's updates
        keep their order). Not where rows age or are evicted at a clock: there a backup's rows
        must have every push of the clock before an eviction, as the primary's have. A worker
        sends a server's own keys first (:meth:`~hpcps.ps.placement.Placement.push_slice`): the
        two parts are then views of the message (which the backlog keeps alive; nothing writes
        into a request's buffer)."""
        target = self.tables[table]
        if self.copying is not None:  # (new backups after a lost server: hpcps.ps.rereplication)
            self.copying.on_push(worker, table, keys, grads, clock)
        if not self.replication.on or self.evicting:
            return target.push(keys, grads, clock, worker, in_pull=in_pull)
        p = self.placement
        edge = primary_prefix(keys, p.num_shards, p.shard_server, self.index)
        if edge >= 0:  # (its own keys first, as a worker sends them: both parts are views of the message)
            keys, grads, rest_keys, rest_grads = keys[:edge], grads[:edge], keys[edge:], grads[edge:]
        else:  # (in_pull: a bit per key, protocol.IN_PULL; the first keys' bits are theirs either way)
            keys, grads, in_pull, rest_keys, rest_grads = split_primary(
                keys, grads, NO_BITS if in_pull is None else in_pull, p.num_shards, p.shard_server, self.index)
            in_pull = in_pull if in_pull.shape[0] else None
        if rest_keys.shape[0]:
            self.backlog.append((target, rest_keys, rest_grads, clock, worker))
        return target.push(keys, grads, clock, worker, in_pull=in_pull) if keys.shape[0] else None

    def apply_backlog(self) -> None:
        """Apply the backups' part of the pushes :meth:`push_now` kept, in their order."""
        if self.backlog and self.copying is not None:  # (new backups awaited: their part held)
            self.backlog = self.copying.sort_backlog(self.backlog)
        if self.backlog:
            for target, keys, grads, clock, worker in self.backlog:
                target.push(keys, grads, clock, worker)
            self.backlog = []

    def primary_items(self, table) -> tuple[np.ndarray, np.ndarray]:
        """``table.items()`` of the shards this server is primary of (all it holds without
        replicas): what a model written from the servers takes from it."""
        return self.replication.primary_part((table.spec.name, *table.items(), {}))[1:3]

    def replica_digests(self) -> np.ndarray:
        """This server's :meth:`Replication.digests` of its tables (after serving)."""
        return self.replication.digests(self.tables)
