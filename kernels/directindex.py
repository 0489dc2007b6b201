"""A key → slot index addressed directly by the key, for bounded key spaces (hashed features).

When keys are hashed into ``2**bits`` values (``data.hash_bits`` <= 26 or so), a table shard needs
no hash probe: ``direct[key]`` is the key's slot (int32, -1 = absent), one random access instead
of hashing, probing and comparing keys. The array costs ``4 * 2**bits`` bytes (64 MiB at 24
bits) whatever the number of keys stored; rows stay compact, in slot order, as with
:class:`~hpcps_kernels.hashtable.KeyIndex`.

Keys at or above ``2**bits`` (the bias feature, or any key a user sends) still work: they go to an
overflow hash index (the kernels of :mod:`.hashtable`) that shares the slot-ordered ``keys`` array,
so both kinds of key draw slots from one sequence. :class:`DirectKeyIndex` has the interface of
``KeyIndex`` (``lookup``, ``lookup_or_insert``, ``from_keys``, ``keys``, ``size``,
``key_capacity``, ``nbytes``), so a server table uses either; a pull's or a push's lookups and
rows are one pass over either (:mod:`.fused`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._prefetch import prefetch
from .hashing import mix64
from .hashtable import build_index, entry_format, index_capacity, key_tag, pack_entry, probe
from .tuning import HASH_MAX_LOAD, PREFETCH_KEYS

MAX_DIRECT_BITS = 31  # int32 slots


@njit(cache=True)
def direct_lookup(direct, index, keys, queries, out, tag_bits):
    """``out[i]`` = the slot of ``queries[i]``, or -1 if absent."""
    nd = np.uint64(direct.shape[0])
    mask = np.uint64(index.shape[0] - 1)
    n = queries.shape[0]
    for i in range(min(PREFETCH_KEYS, n)):
        if queries[i] < nd:
            prefetch(direct, queries[i])
    for i in range(n):
        if i + PREFETCH_KEYS < n and queries[i + PREFETCH_KEYS] < nd:
            prefetch(direct, queries[i + PREFETCH_KEYS])
        k = queries[i]
        if k < nd:
            out[i] = direct[k]
        else:
            h = mix64(k)
            out[i] = probe(index, keys, k, key_tag(h, tag_bits), h & mask, mask, tag_bits)[0]


@njit(cache=True)
def direct_lookup_or_insert(direct, index, keys, size, n_over, queries, out, start, limit, over_limit, tag_bits):
    """Slots of ``queries[start:]``, inserting absent keys at slots ``size, size+1, ...``.

    Stops before an insertion would pass ``limit`` slots or ``over_limit`` overflow keys.
    Returns ``(new size, new overflow count, stop)``; ``out[i] >= old size`` marks an insertion.
    """
    nd = np.uint64(direct.shape[0])
    mask = np.uint64(index.shape[0] - 1)
    n = queries.shape[0]
    for i in range(start, min(start + PREFETCH_KEYS, n)):
        if queries[i] < nd:
            prefetch(direct, queries[i])
    for i in range(start, n):
        if i + PREFETCH_KEYS < n and queries[i + PREFETCH_KEYS] < nd:
            prefetch(direct, queries[i + PREFETCH_KEYS])
        k = queries[i]
        if k < nd:
            s = direct[k]
            if s >= 0:
                out[i] = s
                continue
            if size >= limit:
                return size, n_over, i
            direct[k] = size
        else:
            h = mix64(k)
            tag = key_tag(h, tag_bits)
            s, j = probe(index, keys, k, tag, h & mask, mask, tag_bits)
            if s >= 0:
                out[i] = s
                continue
            if size >= limit or n_over >= over_limit:
                return size, n_over, i
            index[j] = pack_entry(size, tag, tag_bits)
            n_over += 1
        keys[size] = k
        out[i] = size
        size += 1
    return size, n_over, n


@njit(cache=True)
def build_direct(direct, keys, size):
    """Point ``direct`` at slots 0..size-1 of ``keys`` (the keys below its length); returns the
    number of keys left for the overflow index."""
    nd = np.uint64(direct.shape[0])
    over = 0
    for s in range(size):
        if keys[s] < nd:
            direct[keys[s]] = s
        else:
            over += 1
    return over


class DirectKeyIndex:
    """Key → slot for keys mostly below ``2**bits``: a direct array, plus an overflow hash index."""

    def __init__(self, bits: int, capacity: int = 16):
        if not 1 <= bits <= MAX_DIRECT_BITS:
            raise ValueError(f"a DirectKeyIndex addresses 1 to {MAX_DIRECT_BITS} bits, got {bits}")
        self.bits = bits
        self.direct = np.full(1 << bits, -1, dtype=np.int32)
        self.keys = np.zeros(max(int(capacity), 1), dtype=np.uint64)
        self.index = np.zeros(0, dtype=np.uint32)  # the overflow keys' hash index
        self.tag_bits = 0
        self.size = 0
        self.n_over = 0
        self._grow_overflow(0)

    @classmethod
    def from_keys(cls, keys: np.ndarray, bits: int) -> "DirectKeyIndex":
        """An index whose slot ``s`` holds ``keys[s]`` (keys must be unique)."""
        self = cls(bits, max(len(keys), 1))
        self.keys[: len(keys)] = keys
        self.size = len(keys)
        self.n_over = int(build_direct(self.direct, self.keys, self.size))
        self._grow_overflow(self.n_over, rebuild=True)
        return self

    def _grow_overflow(self, n: int, rebuild: bool = False) -> None:
        """Room for ``n`` overflow keys, with entries wide enough for every slot of ``keys``."""
        dtype, tag_bits = entry_format(self.keys.shape[0])
        cap = max(index_capacity(n), self.index.shape[0])
        if rebuild or cap > self.index.shape[0] or dtype != self.index.dtype:
            self.index = np.full(cap, np.iinfo(dtype).max, dtype=dtype)
            self.tag_bits = tag_bits
            build_index(self.keys, self.size, self.index, self.tag_bits, np.uint64(self.direct.shape[0]))

    def reserve(self, n: int) -> bool:
        """Room for ``n`` keys in all; True if the key array was reallocated."""
        if n >= 2**31:
            raise OverflowError(f"a DirectKeyIndex holds fewer than 2**31 keys, asked for {n}")
        if n > self.keys.shape[0]:
            keys = np.zeros(min(max(n, int(self.keys.shape[0] * 1.5)), 2**31 - 1), dtype=np.uint64)
            keys[: self.size] = self.keys[: self.size]
            self.keys = keys
            self._grow_overflow(self.n_over)  # slots may now need wider entries
            return True
        return False

    def lookup(self, queries: np.ndarray) -> np.ndarray:
        out = np.empty(queries.shape[0], dtype=np.int64)
        direct_lookup(self.direct, self.index, self.keys, queries, out, self.tag_bits)
        return out

    def lookup_or_insert(self, queries: np.ndarray) -> np.ndarray:
        """Slots of ``queries``, inserting the absent ones."""
        out = np.empty(queries.shape[0], dtype=np.int64)
        done = 0
        while True:
            size, n_over, done = direct_lookup_or_insert(
                self.direct, self.index, self.keys, self.size, self.n_over, queries, out, done,
                self.keys.shape[0], int(HASH_MAX_LOAD * self.index.shape[0]), self.tag_bits)
            self.size, self.n_over = int(size), int(n_over)
            if done == queries.shape[0]:
                return out
            if self.n_over >= int(HASH_MAX_LOAD * self.index.shape[0]):
                self._grow_overflow(self.n_over + 1)
            if self.size >= self.keys.shape[0]:
                self.reserve(self.size + max(1024, (queries.shape[0] - done) // 4))

    # (a direct lookup reads one array entry whatever the order: nothing to gain from the slot order)
    lookup_or_insert_in_slot_order = lookup_or_insert

    @property
    def key_capacity(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        return self.direct.nbytes + self.index.nbytes + self.keys.nbytes


