"""A uint64 → slot open-addressing hash table in NumPy arrays, the index of a table shard.

Layout, chosen for bytes per key and for few cache misses:

* ``keys``: uint64, dense by slot — ``keys[s]`` is the key stored at slot ``s``. Slots are handed
  out in insertion order 0, 1, 2, ..., so a table's values and optimizer state live in arrays
  indexed by slot too and never move when the index grows.
* ``index``: uint32 entries, capacity a power of two, ``EMPTY`` = 0xFFFFFFFF; linear probing from
  ``mix64(key)`` (a bijection, so small sequential keys spread). An entry packs the slot (27 bits)
  and a 5-bit tag from the key's hash, so a probe reads ``keys[slot]`` only when the tags agree
  (1 time in 32 for another key). The index costs ``4 / load`` bytes per key (5.3 to 10.7 at the
  load factors kept here) on top of the 8-byte key that the payload holds anyway.

Any uint64 is a valid key (2**64 - 1 too). At most ``MAX_KEYS`` = 2**27 - 1 (134 M) keys per index:
servers keep one index per virtual shard, so a table holds that many keys per shard. No deletion:
eviction rebuilds a shard.

Probes prefetch the index entry of the query ``2 * AHEAD`` ahead and the key of the one ``AHEAD``
ahead, so the cache misses of successive queries overlap instead of queueing (1.5x here).
The functions are pure kernels on the arrays; :class:`KeyIndex` is a small holder that grows
them (index ×2 when the load passes ``MAX_LOAD``, keys ×1.5).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._prefetch import prefetch
from .hashing import mix64

EMPTY = np.uint32(0xFFFFFFFF)
TAG_BITS = 5
TAG_MASK = np.uint32((1 << TAG_BITS) - 1)
MAX_KEYS = 2**27 - 1
MAX_LOAD = 0.75
AHEAD = 16  # prefetch distance, in queries


@njit(inline="always")
def _tag(h):
    return np.uint32(h >> np.uint64(64 - TAG_BITS))


@njit(inline="always")
def _entry(slot, tag):
    return np.uint32((np.uint32(slot) << np.uint32(TAG_BITS)) | tag)


@njit(inline="always")
def _slot(e):
    return np.int64(e >> np.uint32(TAG_BITS))


@njit(inline="always")
def _probe(index, keys, k, tag, j, mask):
    """Linear probe for ``k`` from position ``j``: (slot or -1, position where the probe ended)."""
    while True:
        e = index[j]
        if e == EMPTY:
            return np.int64(-1), j
        if (e & TAG_MASK) == tag:
            s = _slot(e)
            if keys[s] == k:
                return s, j
        j = (j + np.uint64(1)) & mask


@njit(cache=True)
def lookup(index, keys, queries, out):
    """``out[i]`` = the slot of ``queries[i]``, or -1 if absent."""
    mask = np.uint64(index.shape[0] - 1)
    n = queries.shape[0]
    hashes = np.empty(n, dtype=np.uint64)
    for i in range(n):
        hashes[i] = mix64(queries[i])
    for i in range(min(2 * AHEAD, n)):
        prefetch(index, hashes[i] & mask)
    for i in range(n):
        # prefetch the entry of query i + 2*AHEAD and the key of query i + AHEAD
        if i + 2 * AHEAD < n:
            prefetch(index, hashes[i + 2 * AHEAD] & mask)
        if i + AHEAD < n:
            e = index[hashes[i + AHEAD] & mask]
            if e != EMPTY:
                prefetch(keys, _slot(e))
        h = hashes[i]
        out[i] = _probe(index, keys, queries[i], _tag(h), h & mask, mask)[0]


@njit(cache=True)
def lookup_or_insert(index, keys, size, queries, out, start, limit):
    """Slots of ``queries[start:]``, inserting absent keys at slots ``size, size+1, ...``.

    Stops before an insertion would make ``size`` exceed ``limit`` (the caller's room: the key
    array's length and the index's load limit). Returns ``(new_size, stop)``: ``queries[:stop]``
    are done; ``out[i] >= old size`` marks a key this call inserted. Prefetches like
    :func:`lookup` (a hint only: every query is resolved by a full probe of the current table).
    """
    mask = np.uint64(index.shape[0] - 1)
    n = queries.shape[0]
    hashes = np.empty(n, dtype=np.uint64)
    for i in range(start, n):
        hashes[i] = mix64(queries[i])
    for i in range(start, min(start + 2 * AHEAD, n)):
        prefetch(index, hashes[i] & mask)
    for i in range(start, n):
        # the same prefetch as in lookup(), written out: as an inline helper it halved the speed
        if i + 2 * AHEAD < n:
            prefetch(index, hashes[i + 2 * AHEAD] & mask)
        if i + AHEAD < n:
            e = index[hashes[i + AHEAD] & mask]
            if e != EMPTY:
                prefetch(keys, _slot(e))
        k = queries[i]
        h = hashes[i]
        tag = _tag(h)
        s, j = _probe(index, keys, k, tag, h & mask, mask)
        if s >= 0:
            out[i] = s
            continue
        if size >= limit:
            return size, i
        index[j] = _entry(size, tag)
        keys[size] = k
        out[i] = size
        size += 1
    return size, n


@njit(cache=True)
def build_index(keys, size, index):
    """Fill the empty ``index`` with slots 0..size-1 of ``keys`` (growth, or loading a shard)."""
    mask = np.uint64(index.shape[0] - 1)
    for s in range(size):
        h = mix64(keys[s])
        j = h & mask
        while index[j] != EMPTY:
            j = (j + np.uint64(1)) & mask
        index[j] = _entry(s, _tag(h))


def index_capacity(n: int) -> int:
    """Smallest power-of-two index capacity that holds ``n`` keys under ``MAX_LOAD``."""
    cap = 16
    while n > MAX_LOAD * cap:
        cap *= 2
    return cap


class KeyIndex:
    """A growable uint64 → slot index. ``keys[:size]`` are the keys in slot order."""

    def __init__(self, capacity: int = 16):
        capacity = max(int(capacity), 1)
        self.index = np.full(index_capacity(capacity), EMPTY, dtype=np.uint32)
        self.keys = np.zeros(capacity, dtype=np.uint64)
        self.size = 0

    @classmethod
    def from_keys(cls, keys: np.ndarray) -> "KeyIndex":
        """An index whose slot ``s`` holds ``keys[s]`` (keys must be unique)."""
        if len(keys) > MAX_KEYS:
            raise OverflowError(f"a KeyIndex holds at most {MAX_KEYS} keys, got {len(keys)}")
        self = cls(max(len(keys), 1))
        self.keys[: len(keys)] = keys
        self.size = len(keys)
        build_index(self.keys, self.size, self.index)
        return self

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` keys in all; returns True if the key array was reallocated (a
        table holding values by slot then grows its own arrays to ``key_capacity``)."""
        if n > MAX_KEYS:
            raise OverflowError(f"a KeyIndex holds at most {MAX_KEYS} keys, asked for {n}")
        cap = index_capacity(n)
        if cap > self.index.shape[0]:
            self.index = np.full(cap, EMPTY, dtype=np.uint32)
            build_index(self.keys, self.size, self.index)
        if n > self.keys.shape[0]:
            keys = np.zeros(min(max(n, int(self.keys.shape[0] * 1.5)), MAX_KEYS), dtype=np.uint64)
            keys[: self.size] = self.keys[: self.size]
            self.keys = keys
            return True
        return False

    def lookup(self, queries: np.ndarray) -> np.ndarray:
        out = np.empty(queries.shape[0], dtype=np.int64)
        lookup(self.index, self.keys, queries, out)
        return out

    def lookup_or_insert(self, queries: np.ndarray) -> np.ndarray:
        """Slots of ``queries``, inserting the absent ones; grows only by what is inserted."""
        out = np.empty(queries.shape[0], dtype=np.int64)
        done = 0
        while True:
            limit = min(self.keys.shape[0], int(MAX_LOAD * self.index.shape[0]))
            size, done = lookup_or_insert(self.index, self.keys, self.size, queries, out, done, limit)
            self.size = int(size)
            if done == queries.shape[0]:
                return out
            self.reserve(self.size + max(1024, (queries.shape[0] - done) // 4))

    @property
    def key_capacity(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        """Bytes held: the index plus the key array (allocated, not just used)."""
        return self.index.nbytes + self.keys.nbytes
