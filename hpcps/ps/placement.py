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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcps_kernels.hashing import feature_key, server_of, shard_of
from hpcps_kernels.keys import group_by

DEFAULT_SHARDS = 1024
DEFAULT_VNODES = 128


def ring_points(num_servers: int, vnodes: int = DEFAULT_VNODES) -> tuple[np.ndarray, np.ndarray]:
    """The consistent-hash ring: sorted point positions and the server owning each."""
    pos = np.array([feature_key(s, f"vnode-{v}") for s in range(num_servers) for v in range(vnodes)],
                   dtype=np.uint64)
    owner = np.repeat(np.arange(num_servers, dtype=np.int64), vnodes)
    order = np.argsort(pos, kind="stable")
    return pos[order], owner[order]


def shard_servers(num_shards: int, num_servers: int, vnodes: int = DEFAULT_VNODES) -> np.ndarray:
    """``shard_server[shard]`` = the server index (0..num_servers-1) owning each virtual shard."""
    if num_servers < 1:
        raise ValueError("at least one server is needed")
    if num_shards < num_servers:
        raise ValueError(f"num_shards ({num_shards}) must be at least the number of servers ({num_servers})")
    points, owner = ring_points(num_servers, vnodes)
    shard_pos = np.array([feature_key(0x5EED, f"shard-{s}") for s in range(num_shards)], dtype=np.uint64)
    idx = np.searchsorted(points, shard_pos, side="left") % len(points)
    return owner[idx]


@dataclass(frozen=True)
class Placement:
    """Where keys live: ``num_shards`` virtual shards over ``num_servers`` servers."""

    num_servers: int
    num_shards: int = DEFAULT_SHARDS
    vnodes: int = DEFAULT_VNODES

    def __post_init__(self):
        object.__setattr__(self, "_table", shard_servers(self.num_shards, self.num_servers, self.vnodes))

    @property
    def shard_server(self) -> np.ndarray:
        return self._table

    def server_of(self, keys: np.ndarray) -> np.ndarray:
        return server_of(np.ascontiguousarray(keys, dtype=np.uint64), self.num_shards, self._table)

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        return shard_of(np.ascontiguousarray(keys, dtype=np.uint64), self.num_shards)

    def slice(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split ``keys`` by server: (order, offsets) — ``keys[order[offsets[s]:offsets[s+1]]]``
        go to server ``s``, in their original relative order (sorted keys stay sorted)."""
        return group_by(self.server_of(keys), self.num_servers)
