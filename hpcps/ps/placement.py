"""Key placement: keys → virtual shards → servers. Pure functions, no MPI.

* A key's virtual shard is ``mix64(key ^ SHARD_SALT) % num_shards``: a hash, so small sequential
  keys (dense ids 0, 1, 2, ...) spread evenly instead of all landing on one server, as they do with
  equal ranges of the 2**64 space.
* Shards map to servers by consistent hashing with virtual nodes: each server owns ``vnodes``
  points on a 64-bit ring (``xxh64`` of its index and the point's number), and a shard belongs to
  the first point at or after the shard's own position. Adding a server moves only the shards that
  the new server's points take over (about ``num_shards / (S + 1)``), and always whole shards, so
  a checkpoint written with one server count restores onto another by reassigning shards.

The shard count is fixed for the life of a model (it is part of the checkpoint format); the server
count may change between runs.

Replicas (``cluster.replicas = r``): each shard is kept on ``r + 1`` servers, its *copies*: walking
the ring from the shard's position, the first server met is the primary (the same server as with
no replicas) and the next distinct servers are its backups, in order, skipping servers on a host
that already holds a copy as long as a host without one remains (with fewer hosts than copies,
every host holds one before any holds two). Losing a server: each of its shards' first backup
becomes primary, the other survivors keep their order, and the same rule over the live servers
picks the new last backup (the next one on the ring); shards that had no copy on it do not move
(:meth:`Placement.after_loss`, :func:`new_copies`). Copies share a host only where there are
fewer hosts than copies (a host lost then takes several copies of a shard with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from hpcps_kernels.copies import push_slice as copies_slice
from hpcps_kernels.hashing import server_of, shard_of
from hpcps_kernels.keys import group_by

DEFAULT_SHARDS = 1024
DEFAULT_VNODES = 128


def _feature_keys(pairs) -> np.ndarray:
    """``hpcps_kernels.hashing.feature_key(field, token)`` of each (field, token) pair, as uint64:
    the same XXH64, by the xxhash package's C function. The ring's 1,152 keys or more are made
    by every rank before its first step, and here they take no compiled kernel's first load."""
    return np.fromiter((xxhash.xxh64_intdigest(token.encode(), seed=field) for field, token in pairs), dtype=np.uint64)


def ring_points(num_servers: int, vnodes: int = DEFAULT_VNODES) -> tuple[np.ndarray, np.ndarray]:
    """The consistent-hash ring: sorted point positions and the server owning each."""
    pos = _feature_keys((s, f"vnode-{v}") for s in range(num_servers) for v in range(vnodes))
    owner = np.repeat(np.arange(num_servers, dtype=np.int64), vnodes)
    order = np.argsort(pos, kind="stable")
    return pos[order], owner[order]


def shard_positions(num_shards: int) -> np.ndarray:
    """Each virtual shard's position on the ring."""
    return _feature_keys((0x5EED, f"shard-{s}") for s in range(num_shards))


def shard_servers(num_shards: int, num_servers: int, vnodes: int = DEFAULT_VNODES) -> np.ndarray:
    """``shard_server[shard]`` = the server index (0..num_servers-1) owning each virtual shard."""
    if num_servers < 1:
        raise ValueError("at least one server is needed")
    if num_shards < num_servers:
        raise ValueError(f"num_shards ({num_shards}) must be at least the number of servers ({num_servers})")
    points, owner = ring_points(num_servers, vnodes)
    idx = np.searchsorted(points, shard_positions(num_shards), side="left") % len(points)
    return owner[idx]


def ring_walk(owner: np.ndarray, start: int, lost: set, hosts: tuple, copies: int) -> list[int]:
    """The distinct live servers met walking the ring from point ``start``, in order, as far as
    :func:`pick_copies` needs: ``copies`` of them, on as many distinct hosts as there are (or
    ``copies``) when ``hosts`` are given; every live server when ``copies`` is 0."""
    live = set(range(int(owner.max()) + 1)) - lost
    hosts_wanted = min(copies, len({hosts[s] for s in live})) if hosts else 0
    walk, seen_hosts = [], set()
    j, n = start, owner.shape[0]
    while len(walk) < len(live) and (not copies or len(walk) < copies or len(seen_hosts) < hosts_wanted):
        s = int(owner[j])
        if s in live and s not in walk:
            walk.append(s)
            if hosts:
                seen_hosts.add(hosts[s])
        j = (j + 1) % n
    return walk


def pick_copies(walk: list[int], copies: int, hosts: tuple, chosen: list[int] | None = None) -> list[int]:
    """``chosen`` (none by default) and then servers of ``walk`` (live servers in the ring's order
    from a shard) up to ``copies``: those on a host (``hosts``: a host name per server; empty:
    every server its own) holding no copy yet while any is left, then the rest in ring order."""
    chosen = list(chosen or [])
    used = {hosts[s] for s in chosen} if hosts else set(chosen)
    for s in walk:
        if len(chosen) < copies and (hosts[s] if hosts else s) not in used:
            chosen.append(s)
            used.add(hosts[s] if hosts else s)
    for s in walk:  # fewer hosts than copies: the rest on hosts that hold one already, in ring order
        if len(chosen) < copies and s not in chosen:
            chosen.append(s)
    return chosen


def shard_copies(num_shards: int, num_servers: int, replicas: int, vnodes: int = DEFAULT_VNODES,
                 hosts: tuple = (), lost: tuple = ()) -> np.ndarray:
    """``copies[shard]`` = the ``replicas + 1`` servers keeping each virtual shard, primary first
    (see the module docstring), after losing the servers ``lost`` in that order."""
    if replicas < 0 or replicas + 1 > num_servers - len(set(lost)):
        raise ValueError(f"{replicas} replica(s) need at least {replicas + 1} servers, "
                         f"{num_servers - len(set(lost))} {'remain' if lost else 'given'}")
    if hosts and len(hosts) != num_servers:
        raise ValueError(f"{len(hosts)} host names for {num_servers} servers")
    points, owner = ring_points(num_servers, vnodes)
    idx = np.searchsorted(points, shard_positions(num_shards), side="left") % len(points)
    # shards starting at the same ring point share their copies: pick once per point
    picked = {int(i): pick_copies(ring_walk(owner, int(i), set(), hosts, replicas + 1), replicas + 1, hosts)
              for i in np.unique(idx)}
    copies = np.array([picked[int(i)] for i in idx], dtype=np.int64).reshape(num_shards, replicas + 1)
    gone: set = set()
    for server in lost:  # each loss in turn: survivors keep their order, the ring refills the rest
        gone.add(server)
        for shard in np.flatnonzero((copies == server).any(axis=1)):
            kept = [int(c) for c in copies[shard] if c not in gone]
            copies[shard] = pick_copies(ring_walk(owner, int(idx[shard]), gone, hosts, 0), replicas + 1, hosts, kept)
    return copies


def new_copies(before: np.ndarray, after: np.ndarray) -> list[tuple[int, int, int]]:
    """What a change of copies (after a lost server) must move: ``(shard, source, target)``, a
    copy made on ``target`` from ``source``, the shard's new primary (a survivor holding it)."""
    moves = []
    for shard in np.flatnonzero((before != after).any(axis=1)):
        held = set(before[shard].tolist())
        moves += [(int(shard), int(after[shard, 0]), int(t)) for t in after[shard] if t not in held]
    return moves


@dataclass(frozen=True)
class Placement:
    """Where keys live: ``num_shards`` virtual shards over ``num_servers`` servers, each shard on
    ``replicas + 1`` of them (``hosts``: each server's host name, for copies on distinct hosts;
    ``lost``: the servers gone, in the order they went; they hold nothing)."""

    num_servers: int
    num_shards: int = DEFAULT_SHARDS
    vnodes: int = DEFAULT_VNODES
    replicas: int = 0
    hosts: tuple = ()
    lost: tuple = ()

    def __post_init__(self):
        if self.replicas == 0 and not self.lost:
            copies = shard_servers(self.num_shards, self.num_servers, self.vnodes).reshape(-1, 1)
        else:
            copies = shard_copies(self.num_shards, self.num_servers, self.replicas, self.vnodes, self.hosts,
                                  self.lost)
        object.__setattr__(self, "_copies", copies)
        object.__setattr__(self, "_table", np.ascontiguousarray(copies[:, 0]))

    @property
    def shard_server(self) -> np.ndarray:
        """Each shard's primary: the server its pulls go to."""
        return self._table

    @property
    def copies(self) -> np.ndarray:
        """``copies[shard]``: the servers keeping each shard, primary first (``num_shards x (replicas + 1)``)."""
        return self._copies

    @property
    def live_servers(self) -> list[int]:
        """The servers not lost, in order: those a worker sends its requests and clocks to."""
        return [s for s in range(self.num_servers) if s not in self.lost]

    def holds(self, server: int) -> np.ndarray:
        """A bool per shard: whether ``server`` keeps a copy of it."""
        return (self._copies == server).any(axis=1)

    def after_loss(self, server: int) -> "Placement":
        """The placement once ``server`` is lost: its shards' first backups become primaries and
        the next live servers on the ring their new backups (see :func:`new_copies` for the moves).
        Where fewer servers are left than copies, each shard keeps the copies left (its replicas
        fall to the servers left less one: 2 servers with 1 replica leave 1 copy of each shard)."""
        lost = (*self.lost, server)
        replicas = min(self.replicas, self.num_servers - len(set(lost)) - 1)
        return Placement(self.num_servers, self.num_shards, self.vnodes, replicas, self.hosts, lost)

    def server_of(self, keys: np.ndarray) -> np.ndarray:
        return server_of(np.ascontiguousarray(keys, dtype=np.uint64), self.num_shards, self._table)

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        return shard_of(np.ascontiguousarray(keys, dtype=np.uint64), self.num_shards)

    def slice(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split ``keys`` by server: (order, offsets) — ``keys[order[offsets[s]:offsets[s+1]]]``
        go to server ``s``, in their original relative order (sorted keys stay sorted)."""
        return group_by(self.server_of(keys), self.num_servers)

    def push_slice(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`slice` for a push: each key to every server keeping its shard (primary and
        backups); a server's keys of the shards it is primary of first, then the others, each in
        the keys' relative order (the server applies the first part before it replies:
        :meth:`hpcps.ps.replication.ServerCopies.push_now`); the same as :meth:`slice` without
        replicas."""
        if self.replicas == 0:
            return self.slice(keys)
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        return copies_slice(keys, self.num_shards, self._copies, self.num_servers)
