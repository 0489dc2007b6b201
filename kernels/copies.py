"""A push's keys and their shards' copies (``cluster.replicas``): where a worker sends each key,
and which part of what a server receives it is the primary of.

With replicas each key goes to every server keeping its shard (the primary, then the backups),
and a server applies the part it is primary of before it replies and the rest after. Both
splits are on a push's critical path, once per push, so each is one kernel: the shard of each
key hashed once (:func:`hpcps_kernels.hashing.shard_index`), then the keys kept or moved
without a branch on where each goes. Their NumPy references (a 2-d fancy index and
:func:`hpcps_kernels.keys.group_by`; a boolean mask and four boolean indexings) cost 4 to 8
times as much at 10,000 keys: boolean indexing over a mask as good as random mispredicts a
branch on every other key.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import shard_index, shard_mask
from .keys import split_by_bits
from .tuning import PUSH_SLICE_SCAN_SERVERS


@njit(cache=True)
def push_slice(keys, num_shards, copies, num_servers):
    """Each key to every server of its shard's row of ``copies`` (``num_shards x c``, distinct
    servers a row): (order, offsets), ``order[offsets[s]:offsets[s + 1]]`` the positions of the
    keys server ``s`` gets, in their order (sorted keys stay sorted).

    Up to ``PUSH_SLICE_SCAN_SERVERS`` servers, a scan of the keys a server, each key's position
    stored and kept where the server holds its shard (no branch, and no store waiting on
    another); beyond, a counting sort of the ``n x c`` copies, whose counters' stores each wait
    on the last one to the same server."""
    n, c = keys.shape[0], copies.shape[1]
    m = np.uint64(num_shards)
    mask = shard_mask(m)
    shards = np.empty(n, dtype=np.int64)
    for i in range(n):
        shards[i] = shard_index(keys[i], m, mask)
    offsets = np.zeros(num_servers + 1, dtype=np.int64)
    if num_servers <= PUSH_SLICE_SCAN_SERVERS:
        held = np.zeros((num_servers, num_shards), dtype=np.uint8)
        for shard in range(num_shards):
            for j in range(c):
                held[copies[shard, j], shard] = 1
        order = np.empty(n * c + 1, dtype=np.int64)  # (the last key's store, kept or not)
        at = 0
        for s in range(num_servers):
            for i in range(n):
                order[at] = i
                at += held[s, shards[i]]
            offsets[s + 1] = at
        return order[:at], offsets
    for i in range(n):
        for j in range(c):
            offsets[copies[shards[i], j] + 1] += 1
    for s in range(num_servers):
        offsets[s + 1] += offsets[s]
    at = offsets[:-1].copy()
    order = np.empty(n * c, dtype=np.int64)
    for i in range(n):
        for j in range(c):
            s = copies[shards[i], j]
            order[at[s]] = i
            at[s] += 1
    return order, offsets


@njit(cache=True)
def split_primary(keys, grads, bits, num_shards, shard_server, server):
    """A push's keys and gradients (``n x dim``) split by whether ``server`` is their shard's
    primary (``shard_server``): (keys, gradients, bits) of those it is, then (keys, gradients) of
    the others, each in order. ``bits``: a bit per key (little-endian within a byte, as
    ``np.packbits(..., bitorder="little")``), or empty; the first part's are packed alike."""
    n = keys.shape[0]
    m = np.uint64(num_shards)
    mask = shard_mask(m)
    mine = np.zeros((n + 7) // 8, dtype=np.uint8)  # (a bit per key, as split_by_bits reads them)
    for i in range(n):
        mine[i >> 3] |= np.uint8(shard_server[shard_index(keys[i], m, mask)] == server) << (i & 7)
    k_mine, g_mine, k_rest, g_rest = split_by_bits(mine, keys, grads)
    count = k_mine.shape[0]
    b_out = np.zeros(count // 8 + 1 if bits.shape[0] else 0, dtype=np.uint8)  # (a byte to spare: below)
    if bits.shape[0]:
        at = 0
        for i in range(n):  # (a key not its own adds a 0 bit where the next of its own goes)
            own = (mine[i >> 3] >> (i & 7)) & 1
            b_out[at >> 3] |= (((bits[i >> 3] >> (i & 7)) & 1) & own) << (at & 7)
            at += own
    return k_mine, g_mine, b_out[:(count + 7) // 8], k_rest, g_rest
