"""A uint64 → slot open-addressing hash table in NumPy arrays, the index of a table shard.

Layout, chosen for bytes per key and for few cache misses:

* ``keys``: uint64, dense by slot — ``keys[s]`` is the key stored at slot ``s``. Slots are handed
  out in insertion order 0, 1, 2, ..., so a table's values and optimizer state live in arrays
  indexed by slot too and never move when the index grows.
* ``index``: uint32 entries, capacity a power of two, empty = all bits set; linear probing from
  ``mix64(key)`` (a bijection, so small sequential keys spread). An entry packs the slot (27 bits)
  and a 5-bit tag from the key's hash, so a probe reads ``keys[slot]`` only when the tags agree
  (1 time in 32 for another key). The index costs ``4 / load`` bytes per key (5.3 to 10.7 at the
  load factors kept here) on top of the 8-byte key that the payload holds anyway.
* Past ``NARROW_MAX_KEYS`` = 2**27 - 1 (134 M) keys the index is rebuilt once with uint64 entries
  (a 48-bit slot and a 16-bit tag), so an index holds as many keys as memory allows (up to
  ``MAX_KEYS`` = 2**48 - 1); only such huge indexes pay 8 bytes per entry.

Any uint64 is a valid key (2**64 - 1 too). No deletion: eviction rebuilds an index.

Probes prefetch the index entry of the query ``2 * PREFETCH_KEYS`` ahead and the key of the one ``PREFETCH_KEYS``
ahead, so the cache misses of successive queries overlap instead of queueing.
The functions are pure kernels on the arrays; :class:`KeyIndex` is a small holder that grows
them (index ×2 when the load passes ``HASH_MAX_LOAD``, keys ×1.5).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._prefetch import prefetch
from .hashing import mix64
from .tuning import HASH_MAX_LOAD, PREFETCH_KEYS

EMPTY = np.uint32(0xFFFFFFFF)            # an empty narrow entry
TAG_BITS = 5                             # narrow entries: uint32 = 27-bit slot | 5-bit tag
NARROW_MAX_KEYS = 2**27 - 1
WIDE_EMPTY = np.uint64(2**64 - 1)        # an empty wide entry
WIDE_TAG_BITS = 16                       # wide entries: uint64 = 48-bit slot | 16-bit tag
MAX_KEYS = 2**48 - 1
IN_ORDER_WINDOW = 16  # slots a lookup in slot order reads on from the last found (two cache lines of keys)
NO_DIRECT = np.zeros(0, dtype=np.int32)  # a KeyIndex's direct array (see hpcps_kernels.fused): none

# The kernels below serve both entry widths: numba compiles them once per index dtype; the tag
# width comes as an argument (``tag_bits``) and the empty value is all bits set in either.


@njit(inline="always")
def key_tag(h, tag_bits):
    return h >> np.uint64(64 - tag_bits)


@njit(inline="always")
def pack_entry(slot, tag, tag_bits):
    return (np.uint64(slot) << np.uint64(tag_bits)) | tag


@njit(inline="always")
def _slot(e, tag_bits):
    return np.int64(np.uint64(e) >> np.uint64(tag_bits))


@njit(inline="always")
def _is_empty(e):
    return ~e == 0


@njit(inline="always")
def probe(index, keys, k, tag, j, mask, tag_bits):
    """Linear probe for ``k`` from position ``j``: (slot or -1, position where the probe ended)."""
    tag_mask = (np.uint64(1) << np.uint64(tag_bits)) - np.uint64(1)
    while True:
        e = index[j]
        if _is_empty(e):
            return np.int64(-1), j
        if (np.uint64(e) & tag_mask) == tag:
            s = _slot(e, tag_bits)
            if keys[s] == k:
                return s, j
        j = (j + np.uint64(1)) & mask


@njit(cache=True)
def lookup(index, keys, queries, out, tag_bits):
    """``out[i]`` = the slot of ``queries[i]``, or -1 if absent."""
    mask = np.uint64(index.shape[0] - 1)
    n = queries.shape[0]
    hashes = np.empty(n, dtype=np.uint64)
    for i in range(n):
        hashes[i] = mix64(queries[i])
    for i in range(min(2 * PREFETCH_KEYS, n)):
        prefetch(index, hashes[i] & mask)
    for i in range(n):
        # prefetch the entry of query i + 2*PREFETCH_KEYS and the key of query i + PREFETCH_KEYS
        if i + 2 * PREFETCH_KEYS < n:
            prefetch(index, hashes[i + 2 * PREFETCH_KEYS] & mask)
        if i + PREFETCH_KEYS < n:
            e = index[hashes[i + PREFETCH_KEYS] & mask]
            if not _is_empty(e):
                prefetch(keys, _slot(e, tag_bits))
        h = hashes[i]
        out[i] = probe(index, keys, queries[i], key_tag(h, tag_bits), h & mask, mask, tag_bits)[0]


@njit(cache=True)
def lookup_in_slot_order(index, keys, size, queries, out, window, tag_bits):
    """``out[i]`` = the slot of ``queries[i]``, or -1 if absent, as :func:`lookup`, for queries
    mostly in the order of their slots (a delta snapshot's keys, written in its server's slot
    order, against the table restored from its base): each is first looked for among the
    ``window`` slots after the one found before (a sequential read), then probed for."""
    mask = np.uint64(index.shape[0] - 1)
    p = 0
    for i in range(queries.shape[0]):
        k = queries[i]
        s = np.int64(-1)
        for t in range(p, min(size, p + window)):
            if keys[t] == k:
                s = np.int64(t)
                break
        if s < 0:
            h = mix64(k)
            s = probe(index, keys, k, key_tag(h, tag_bits), h & mask, mask, tag_bits)[0]
        out[i] = s
        if s >= 0:
            p = s + 1


@njit(cache=True)
def lookup_or_insert(index, keys, size, queries, out, start, limit, tag_bits):
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
    for i in range(start, min(start + 2 * PREFETCH_KEYS, n)):
        prefetch(index, hashes[i] & mask)
    for i in range(start, n):
        # the same prefetch as in lookup(), written out: as an inline helper it halved the speed
        if i + 2 * PREFETCH_KEYS < n:
            prefetch(index, hashes[i + 2 * PREFETCH_KEYS] & mask)
        if i + PREFETCH_KEYS < n:
            e = index[hashes[i + PREFETCH_KEYS] & mask]
            if not _is_empty(e):
                prefetch(keys, _slot(e, tag_bits))
        k = queries[i]
        h = hashes[i]
        tag = key_tag(h, tag_bits)
        s, j = probe(index, keys, k, tag, h & mask, mask, tag_bits)
        if s >= 0:
            out[i] = s
            continue
        if size >= limit:
            return size, i
        index[j] = pack_entry(size, tag, tag_bits)
        keys[size] = k
        out[i] = size
        size += 1
    return size, n


@njit(cache=True)
def build_index(keys, size, index, tag_bits, skip_below):
    """Fill the empty ``index`` with slots 0..size-1 of ``keys`` (growth, or loading a shard),
    leaving out keys below ``skip_below`` (those a direct index addresses itself; 0 for none).
    Prefetches the entry of the key ``2 * PREFETCH_KEYS`` ahead, as :func:`lookup` does: each
    insertion's first entry is a cache miss in an index larger than the cache (a 10 M-key
    restore's)."""
    mask = np.uint64(index.shape[0] - 1)
    ahead = 2 * PREFETCH_KEYS
    for s in range(min(ahead, size)):
        prefetch(index, mix64(keys[s]) & mask)
    for s in range(size):
        if s + ahead < size:
            prefetch(index, mix64(keys[s + ahead]) & mask)
        if keys[s] < skip_below:
            continue
        h = mix64(keys[s])
        j = h & mask
        while not _is_empty(index[j]):
            j = (j + np.uint64(1)) & mask
        index[j] = pack_entry(s, key_tag(h, tag_bits), tag_bits)


def index_capacity(n: int) -> int:
    """Smallest power-of-two index capacity that holds ``n`` keys under ``HASH_MAX_LOAD``."""
    cap = 16
    while n > HASH_MAX_LOAD * cap:
        cap *= 2
    return cap


def entry_format(n: int) -> tuple[type, int]:
    """(entry dtype, tag bits) of an index that must address ``n`` keys."""
    if n > MAX_KEYS:
        raise OverflowError(f"a KeyIndex holds at most {MAX_KEYS} keys, asked for {n}")
    return (np.uint32, TAG_BITS) if n <= NARROW_MAX_KEYS else (np.uint64, WIDE_TAG_BITS)


class KeyIndex:
    """A growable uint64 → slot index. ``keys[:size]`` are the keys in slot order."""

    direct = NO_DIRECT  # no key addressed directly (the arrays of hpcps_kernels.fused's kernels)

    def __init__(self, capacity: int = 16, keys: np.ndarray | None = None):
        capacity = max(int(capacity), 1)
        dtype, self.tag_bits = entry_format(capacity)
        self.index = np.full(index_capacity(capacity), np.iinfo(dtype).max, dtype=dtype)
        self.keys = np.zeros(capacity, dtype=np.uint64) if keys is None else keys
        self.size = 0

    @classmethod
    def from_keys(cls, keys: np.ndarray, own: bool = False) -> "KeyIndex":
        """An index whose slot ``s`` holds ``keys[s]`` (keys must be unique). ``own``: ``keys`` is
        the caller's to give away (a restore's, read for it): kept as the index's key array when
        it is one (contiguous uint64), not copied."""
        n = len(keys)
        entry_format(n)
        mine = own and n > 0 and keys.dtype == np.uint64 and keys.flags.c_contiguous and keys.flags.writeable
        self = cls(max(n, 1), keys if mine else None)
        if not mine:
            self.keys[:n] = keys
        self.size = n
        build_index(self.keys, self.size, self.index, self.tag_bits, np.uint64(0))
        return self

    @property
    def wide(self) -> bool:
        return self.index.dtype == np.uint64

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` keys in all; returns True if the key array was reallocated (a
        table holding values by slot then grows its own arrays to ``key_capacity``)."""
        dtype, tag_bits = entry_format(n)
        if dtype is np.uint32 and self.wide:
            dtype, tag_bits = np.uint64, WIDE_TAG_BITS  # never narrows again
        cap = index_capacity(n)
        if cap > self.index.shape[0] or dtype != self.index.dtype:
            self.index = np.full(max(cap, self.index.shape[0]), np.iinfo(dtype).max, dtype=dtype)
            self.tag_bits = tag_bits
            build_index(self.keys, self.size, self.index, self.tag_bits, np.uint64(0))
        if n > self.keys.shape[0]:
            keys = np.zeros(min(max(n, int(self.keys.shape[0] * 1.5)), MAX_KEYS), dtype=np.uint64)
            keys[: self.size] = self.keys[: self.size]
            self.keys = keys
            return True
        return False

    def lookup(self, queries: np.ndarray) -> np.ndarray:
        out = np.empty(queries.shape[0], dtype=np.int64)
        lookup(self.index, self.keys, queries, out, self.tag_bits)
        return out

    def lookup_or_insert_in_slot_order(self, queries: np.ndarray) -> np.ndarray:
        """:meth:`lookup_or_insert` for queries mostly in the order of their slots (a delta
        snapshot's keys, restored): most found by a sequential read (:func:`lookup_in_slot_order`),
        the absent ones inserted in their order."""
        out = np.empty(queries.shape[0], dtype=np.int64)
        lookup_in_slot_order(self.index, self.keys, self.size, queries, out, IN_ORDER_WINDOW, self.tag_bits)
        new = np.flatnonzero(out < 0)
        if new.shape[0]:
            out[new] = self.lookup_or_insert(queries[new])
        return out

    def lookup_or_insert(self, queries: np.ndarray) -> np.ndarray:
        """Slots of ``queries``, inserting the absent ones; grows only by what is inserted."""
        out = np.empty(queries.shape[0], dtype=np.int64)
        done = 0
        while True:
            limit = min(self.keys.shape[0], int(HASH_MAX_LOAD * self.index.shape[0]),
                        NARROW_MAX_KEYS if not self.wide else MAX_KEYS)
            size, done = lookup_or_insert(self.index, self.keys, self.size, queries, out, done, limit,
                                          self.tag_bits)
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


def set_up_numba() -> None:
    """numba's CPU target set up now, as the first call of any compiled kernel does before its own
    work (numba's typing and lowering registries, SciPy's BLAS probe: about 0.1 s of a process's
    CPU), here by indexing no keys (:func:`build_index`, which an index calls as it grows, with
    its own types: its cached code is used later). Called where the time is best spent: on a
    server while the workers parse their first rows (it then answers their first requests without
    it), on the main thread before a rank's own threads make their first compiled calls."""
    KeyIndex.from_keys(np.zeros(0, dtype=np.uint64))
