"""Batch key handling and sparse aggregation.

* :func:`unique_keys`: a CSR batch's ``indices`` (uint64 keys) → sorted unique keys and, for every
  nonzero, its position in them, so a worker pulls each key once per batch and kernels address
  the pulled weights by position. Reference: ``np.unique(indices, return_inverse=True)``.
* :func:`segment_reduce`: several (keys, values) lists concatenated → unique sorted keys with the
  values of equal keys summed (row-wise for dim > 1). Used to merge gradients inside a worker
  group and on servers. Reference: ``np.unique`` + ``np.add.at``.

:func:`unique_keys` dedups with a scratch open-addressing table over the nonzeros (one pass, O(nnz))
and sorts only the unique keys (:func:`radix_argsort`), instead of sorting every nonzero.
:func:`segment_reduce` sorts every key with its index in one word (NumPy's vectorised sort) and
sums the runs: across several pushes most keys are unique, a table of them outgrows the cache,
and the sort's sequential passes beat its two cache misses a key.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import mix64
from .tuning import DEDUP_MAX_FIRST_SLOTS, DEDUP_MIN_SLOTS




@njit(cache=True)
def _dedup_table(uniq, u, cap, hashed):
    """A scratch table of ``cap`` int32 entries holding ``uniq[:u]`` (ids, -1 = empty)."""
    table = np.full(cap, -1, dtype=np.int32)
    mask = np.uint64(cap - 1)
    for t in range(u):
        j = (uniq[t] if hashed else mix64(uniq[t])) & mask
        while table[j] != -1:
            j = (j + np.uint64(1)) & mask
        table[j] = t
    return table


@njit(cache=True, nogil=True)  # a parse thread (data.parse_thread) runs beside it
def _dedup(keys, hashed=False):
    """First-seen order dedup: returns (unique keys unsorted, id of each key in them).

    The scratch table is sized for the unique keys, not the nonzeros (a Criteo-shaped batch has
    about 1 unique key in 5): it starts at half the keys (at most 64 k entries of int32, 256 KiB,
    so it stays in cache) and doubles whenever it is half full. A key's place in it is its mixed
    bits (:func:`~hpcps_kernels.hashing.mix64`), or with ``hashed`` its own low bits: keys that
    are hash values already (hashed features) need no second mix, which saves time on every
    batch. Other keys must be mixed: raw indices that are multiples of a power of two would all land in one place."""
    n = keys.shape[0]
    cap = DEDUP_MIN_SLOTS
    while cap < n // 2 and cap < DEDUP_MAX_FIRST_SLOTS:
        cap *= 2
    table = np.full(cap, -1, dtype=np.int32)
    mask = np.uint64(cap - 1)
    limit = cap // 2
    uniq = np.empty(n, dtype=np.uint64)
    ids = np.empty(n, dtype=np.int64)
    u = 0
    for i in range(n):
        k = keys[i]
        j = (k if hashed else mix64(k)) & mask
        while True:
            t = table[j]
            if t == -1:
                table[j] = u
                uniq[u] = k
                ids[i] = u
                u += 1
                if u > limit:
                    cap *= 2
                    table = _dedup_table(uniq, u, cap, hashed)
                    mask = np.uint64(cap - 1)
                    limit = cap // 2
                break
            if uniq[t] == k:
                ids[i] = t
                break
            j = (j + np.uint64(1)) & mask
    return uniq[:u], ids


@njit(cache=True)
def radix_argsort(keys):
    """Stable LSD radix sort of uint64 keys: returns (sorted keys, order) with
    ``sorted == keys[order]``. Bytes on which all keys agree are skipped (keys of a 2**24 space
    take 3 passes), which is what makes it faster than a comparison sort here."""
    n = keys.shape[0]
    hist = np.zeros((8, 256), dtype=np.int64)
    for i in range(n):
        k = keys[i]
        for b in range(8):
            hist[b, (k >> np.uint64(8 * b)) & np.uint64(255)] += 1
    cur_k = keys.copy()
    cur_o = np.arange(n)
    tmp_k = np.empty(n, dtype=np.uint64)
    tmp_o = np.empty(n, dtype=np.int64)
    offs = np.empty(256, dtype=np.int64)
    for b in range(8):
        if hist[b].max() == n:
            continue
        total = 0
        for d in range(256):
            offs[d] = total
            total += hist[b, d]
        shift = np.uint64(8 * b)
        for i in range(n):
            d = (cur_k[i] >> shift) & np.uint64(255)
            p = offs[d]
            offs[d] = p + 1
            tmp_k[p] = cur_k[i]
            tmp_o[p] = cur_o[i]
        cur_k, tmp_k = tmp_k, cur_k
        cur_o, tmp_o = tmp_o, cur_o
    return cur_k, cur_o


@njit(cache=True, nogil=True)  # a parse thread (data.parse_thread) runs beside it
def unique_keys(keys):
    """Sorted unique keys and ``pos`` with ``uniq[pos[i]] == keys[i]`` (pos as int32 if small)."""
    uniq, ids = _dedup(keys)
    sorted_uniq, order = radix_argsort(uniq)
    rank = np.empty(order.shape[0], dtype=np.int64)
    for r in range(order.shape[0]):
        rank[order[r]] = r
    pos = np.empty(keys.shape[0], dtype=np.int64)
    for i in range(keys.shape[0]):
        pos[i] = rank[ids[i]]
    return sorted_uniq, pos


@njit(cache=True, nogil=True)  # a parse thread (data.parse_thread) runs beside it
def dedup_keys(keys, hashed=False):
    """Unique keys in first-seen order and ``pos`` with ``uniq[pos[i]] == keys[i]``: what a batch
    needs when nothing asks for sorted keys (no radix sort: about twice as fast as
    :func:`unique_keys` on Criteo-shaped batches, whose 64-bit bias key defeats the byte skip).
    ``hashed``: the keys' low bits are uniform already (hashed features; see :func:`_dedup`);
    the result is the same either way."""
    uniq, ids = _dedup(keys, hashed)
    return uniq.copy(), ids


def segment_reduce(keys, values):
    """Sum ``values`` (shape ``(n, dim)``) of equal ``keys`` (uint64, any order); returns (sorted
    unique keys, sums), the result of ``np.unique`` + ``np.add.at`` bit for bit: equal keys' rows
    are summed in their input order, from zero.

    One sort of every key with its index (a stable order), then one pass summing the runs of equal
    keys. When a key's varying bits and the index fit one 64-bit word together (keys of a 2**40
    space in up to 2**24 of them), that word is sorted by NumPy's sort (vectorised; equal keys
    keep their index order because the index is the word's low bits); else by
    :func:`radix_argsort`."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    common, varying = _key_bits(keys)
    shift, width = _bit_span(int(varying))
    ib = max(int(keys.shape[0] - 1), 0).bit_length()
    if width + ib <= 64:
        packed = _pack_keys(keys, np.uint64(shift), width, np.uint64(ib))
        packed.sort()
        field = ((1 << width) - 1) << shift
        return _sum_packed_runs(packed, np.uint64(ib), np.uint64(shift), np.uint64(int(common) & ~field), values)
    sorted_keys, order = radix_argsort(keys)
    return _sum_runs(sorted_keys, order, values)


def _bit_span(varying: int):
    """(lowest bit, width) of the span of bits that vary among the keys (0, 0 when none do)."""
    if varying == 0:
        return 0, 0
    low = (varying & -varying).bit_length() - 1
    return low, varying.bit_length() - low


@njit(cache=True)
def _key_bits(keys):
    """(bits every key has, bits on which keys differ)."""
    both = ~np.uint64(0)
    either = np.uint64(0)
    for i in range(keys.shape[0]):
        both &= keys[i]
        either |= keys[i]
    return both, (both ^ either) if keys.shape[0] else np.uint64(0)


@njit(cache=True)
def _pack_keys(keys, shift, width, ib):
    """Each key's ``width`` bits from ``shift`` on, above its index's ``ib`` bits."""
    field = (np.uint64(1) << np.uint64(width)) - np.uint64(1) if width < 64 else ~np.uint64(0)
    out = np.empty(keys.shape[0], dtype=np.uint64)
    for i in range(keys.shape[0]):
        out[i] = (((keys[i] >> shift) & field) << ib) | np.uint64(i)
    return out


@njit(cache=True)
def _sum_packed_runs(packed, ib, shift, base, values):
    """Runs of equal keys in the sorted words of :func:`_pack_keys` → (unique keys, each run's
    rows ``values[index]`` summed from zero, in the words' order). A new run is counted, not
    branched on (as random as which keys repeat)."""
    n = packed.shape[0]
    start = (packed[0] >> ib) ^ np.uint64(1) if n else np.uint64(0)  # a key unlike the first
    u = 0
    prev = start
    for i in range(n):
        key = packed[i] >> ib
        u += np.int64(key != prev)
        prev = key
    uniq = np.empty(u, dtype=np.uint64)
    out = np.zeros((u, values.shape[1]), dtype=values.dtype)
    index = (np.uint64(1) << ib) - np.uint64(1)
    t = -1
    prev = start
    for i in range(n):
        key = packed[i] >> ib
        t += np.int64(key != prev)
        prev = key
        uniq[t] = base | (key << shift)
        _add_row(out, t, values, np.int64(packed[i] & index))
    return uniq, out


@njit(cache=True)
def _sum_runs(sorted_keys, order, values):
    """Runs of equal keys → (unique keys, each run's rows ``values[order[i]]`` summed from zero)."""
    n = sorted_keys.shape[0]
    u = 0
    for i in range(n):
        u += np.int64(i == 0 or sorted_keys[i] != sorted_keys[i - 1])
    uniq = np.empty(u, dtype=np.uint64)
    out = np.zeros((u, values.shape[1]), dtype=values.dtype)
    t = -1
    for i in range(n):
        t += np.int64(i == 0 or sorted_keys[i] != sorted_keys[i - 1])
        uniq[t] = sorted_keys[i]
        _add_row(out, t, values, order[i])
    return uniq, out


@njit(inline="always")
def _add_row(out, t, values, o):
    """``out[t] += values[o]``; one value without a loop (whose set-up per key, for a loop of one,
    cost more than the addition)."""
    if values.shape[1] == 1:
        out[t, 0] += values[o, 0]
    else:
        for d in range(values.shape[1]):
            out[t, d] += values[o, d]


@njit(cache=True)
def reusable_slots(saved_keys, saved_slots, keys, absent):
    """Whether ``saved_slots`` (the slots of ``saved_keys``, -1 = absent) are those of ``keys``:
    -1 when the two key arrays differ, else the number ``m`` of absent positions, written to
    ``absent[:m]`` in order. One pass instead of ``np.array_equal`` then ``np.flatnonzero``."""
    n = keys.shape[0]
    if saved_keys.shape[0] != n:
        return -1
    m = 0
    for i in range(n):
        if saved_keys[i] != keys[i]:
            return -1
        if saved_slots[i] < 0:
            absent[m] = i
            m += 1
    return m


@njit(cache=True)
def member_mask(keys, members, hashed=False):
    """``out[i]``: whether ``keys[i]`` is among ``members`` (``np.isin``, without its sort): a
    scratch table over the members as in :func:`_dedup` (``hashed``: place keys by their own low
    bits), then one probe per key. A worker marks which of a step's pushed keys its next pull
    reads, so that the server can apply the others after its reply (see
    :func:`split_by_bits`)."""
    cap = DEDUP_MIN_SLOTS
    while cap < 2 * members.shape[0]:
        cap *= 2
    table = _dedup_table(members, members.shape[0], cap, hashed)  # (a repeated member: two entries)
    mask = np.uint64(cap - 1)
    out = np.empty(keys.shape[0], dtype=np.bool_)
    for i in range(keys.shape[0]):
        k = keys[i]
        j = (k if hashed else mix64(k)) & mask
        found = False
        while True:
            t = table[j]
            if t == -1:
                break
            if members[t] == k:
                found = True
                break
            j = (j + np.uint64(1)) & mask
        out[i] = found
    return out


@njit(cache=True)
def split_by_bits(bits, slots, grads):
    """(slots, gradients) of the positions whose bit is set in ``bits`` (one bit a position,
    little-endian within a byte: ``np.packbits(..., bitorder="little")``), then those of the
    others, each in order."""
    n, dim = slots.shape[0], grads.shape[1]
    m = 0
    for i in range(n):
        m += (bits[i >> 3] >> (i & 7)) & 1
    s_out = np.empty(n, dtype=slots.dtype)
    g_out = np.empty((n, dim), dtype=grads.dtype)
    gi, go = np.ascontiguousarray(grads).reshape(-1), g_out.reshape(-1)
    a, b = 0, m
    for i in range(n):  # without a branch (the bits are as good as random)
        bit = (bits[i >> 3] >> (i & 7)) & 1
        j = a if bit else b
        a += bit
        b += 1 - bit
        s_out[j] = slots[i]
        if dim == 1:
            go[j] = gi[i]
        else:
            for d in range(dim):
                go[j * dim + d] = gi[i * dim + d]
    s_set, g_set, s_rest, g_rest = s_out[:m], g_out[:m], s_out[m:], g_out[m:]
    return s_set, g_set, s_rest, g_rest


@njit(cache=True)
def is_sorted_unique(keys):
    for i in range(1, keys.shape[0]):
        if keys[i] <= keys[i - 1]:
            return False
    return True


@njit(cache=True)
def _merge2(ka, va, kb, vb):
    """Merge two sorted unique key lists, summing the values of keys in both."""
    n, m = ka.shape[0], kb.shape[0]
    dim = va.shape[1]
    keys = np.empty(n + m, dtype=np.uint64)
    vals = np.empty((n + m, dim), dtype=va.dtype)
    i = j = o = 0
    while i < n and j < m:
        a, b = ka[i], kb[j]
        if a < b:
            keys[o] = a
            vals[o, :] = va[i, :]
            i += 1
        elif b < a:
            keys[o] = b
            vals[o, :] = vb[j, :]
            j += 1
        else:
            keys[o] = a
            for d in range(dim):
                vals[o, d] = va[i, d] + vb[j, d]
            i += 1
            j += 1
        o += 1
    while i < n:
        keys[o] = ka[i]
        vals[o, :] = va[i, :]
        i += 1
        o += 1
    while j < m:
        keys[o] = kb[j]
        vals[o, :] = vb[j, :]
        j += 1
        o += 1
    return keys[:o], vals[:o]


def merge_sorted(parts):
    """Segment reduce of lists that are each sorted and unique (what workers push).

    Args:
        parts: a sequence of ``(keys, values)`` with ``keys`` sorted unique uint64 and
            ``values`` of shape ``(len(keys), dim)``.

    Returns:
        ``(keys, sums)`` like :func:`segment_reduce` over their concatenation, by pairwise
        merges (log2(len(parts)) sequential passes, no hashing, no sort).
    """
    parts = [(np.asarray(k, dtype=np.uint64), np.asarray(v)) for k, v in parts]
    if not parts:
        raise ValueError("merge_sorted needs at least one list")
    while len(parts) > 1:
        nxt = [_merge2(*parts[i], *parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


@njit(cache=True)
def group_by(ids, n_groups):
    """Stable counting sort of ``ids`` in ``[0, n_groups)``: (order, offsets).

    ``order[offsets[g]:offsets[g + 1]]`` are the positions with id ``g``, in their original order.
    """
    counts = np.zeros(n_groups + 1, dtype=np.int64)
    for i in range(ids.shape[0]):
        counts[ids[i] + 1] += 1
    for g in range(n_groups):
        counts[g + 1] += counts[g]
    offsets = counts.copy()
    order = np.empty(ids.shape[0], dtype=np.int64)
    for i in range(ids.shape[0]):
        g = ids[i]
        order[counts[g]] = i
        counts[g] += 1
    return order, offsets


@njit(cache=True)
def scatter_rows(out, rows, values):
    """``out[rows[i]] = values[i]`` (2-D), faster than NumPy's fancy assignment."""
    for i in range(rows.shape[0]):
        out[rows[i], :] = values[i, :]


@njit(cache=True)
def gather_rows(src, rows):
    """``src[rows]`` (2-D) into a new array."""
    out = np.empty((rows.shape[0], src.shape[1]), dtype=src.dtype)
    for i in range(rows.shape[0]):
        out[i, :] = src[rows[i], :]
    return out
