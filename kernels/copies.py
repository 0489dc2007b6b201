"""A push's keys and their shards' copies (``cluster.replicas``): where a worker sends each key,
and which part of what a server receives it is the primary of.

With replicas each key goes to every server keeping its shard (the primary, then the backups),
and a server applies the part it is primary of before it replies and the rest after. Both
splits are on a push's critical path, once per push, so each is a kernel: the worker's
(:func:`push_slice`) puts each server's primary keys first, so that the server's
(:func:`primary_prefix`) only hashes its keys to find where they end, and applies both parts
from the message as they are, with no copy (:func:`split_primary` where they come in another
order). Their NumPy references (a 2-d fancy index and :func:`hpcps_kernels.keys.group_by`; a
boolean mask and four boolean indexings) cost 4 to 10 times as much at 10,000 keys: boolean
indexing over a mask as good as random mispredicts a branch on every other key.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import shard_index, shard_mask
from .keys import split_by_bits
from .tuning import PUSH_SLICE_SCAN_SERVERS


@njit(cache=True)
def push_slice(keys, num_shards, copies, num_servers):
    """Each key to every server of its shard's row of ``copies`` (``num_shards x c``, primary
    first, distinct servers a row): (order, offsets), ``order[offsets[s]:offsets[s + 1]]`` the
    positions of the keys server ``s`` gets: those it is primary of, then the others, each part in
    the keys' order (:func:`primary_prefix` finds the parts' edge on the server).

    Up to ``PUSH_SLICE_SCAN_SERVERS`` servers, two scans of the keys a server, each key's position
    stored and kept where the server is its shard's primary (the first scan) or backup (the
    second): no branch, and no store waiting on another; beyond, a counting sort of the ``n x c``
    copies (primaries, then backups), whose counters' stores each wait on the last one to the same
    server."""
    n, c = keys.shape[0], copies.shape[1]
    m = np.uint64(num_shards)
    mask = shard_mask(m)
    shards = np.empty(n, dtype=np.int64)
    for i in range(n):
        shards[i] = shard_index(keys[i], m, mask)
    offsets = np.zeros(num_servers + 1, dtype=np.int64)
    if num_servers <= PUSH_SLICE_SCAN_SERVERS:
        held = np.zeros((2, num_servers, num_shards), dtype=np.uint8)  # (primary of it; backup of it)
        for shard in range(num_shards):
            held[0, copies[shard, 0], shard] = 1
            for j in range(1, c):
                held[1, copies[shard, j], shard] = 1
        order = np.empty(n * c + 1, dtype=np.int64)  # (the last key's store, kept or not)
        at = 0
        for s in range(num_servers):
            for part in range(2):
                for i in range(n):
                    order[at] = i
                    at += held[part, s, shards[i]]
            offsets[s + 1] = at
        return order[:at], offsets
    for i in range(n):
        for j in range(c):
            offsets[copies[shards[i], j] + 1] += 1
    for s in range(num_servers):
        offsets[s + 1] += offsets[s]
    at = offsets[:-1].copy()
    order = np.empty(n * c, dtype=np.int64)
    for first, last in ((0, 1), (1, c)):  # (each server's primaries, then its backups)
        for i in range(n):
            for j in range(first, last):
                s = copies[shards[i], j]
                order[at[s]] = i
                at[s] += 1
    return order, offsets


@njit(cache=True)
def primary_prefix(keys, num_shards, shard_server, server):
    """Where a push's keys that ``server`` is primary of (``shard_server``) end, when they come
    first (as :func:`push_slice` orders them): ``keys[:m]`` are its own, ``keys[m:]`` none; -1
    where they do not come first (:func:`split_primary` then)."""
    n = keys.shape[0]
    m = np.uint64(num_shards)
    mask = shard_mask(m)
    edge = n
    for i in range(n):
        if shard_server[shard_index(keys[i], m, mask)] == server:
            if edge < n:
                return -1
        elif edge == n:
            edge = i
    return edge


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
