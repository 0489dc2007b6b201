"""A request's keys in one pass: each key's slot found in a table shard's index and its row read
(a pull) or updated (a push) in the same loop, for either index (pure kernels, no MPI).

Both indexes are the same arrays (``direct``, ``index``, ``keys``, ``tag_bits``): a
:class:`~hpcps_kernels.directindex.DirectKeyIndex` addresses keys below ``direct``'s length
directly and the others through its overflow hash index; a
:class:`~hpcps_kernels.hashtable.KeyIndex` is the same with an empty ``direct`` array (every key
hashed). One kernel serves both, and gives the bits of the two kernels it replaces: a lookup
(``lookup``/``direct_lookup``), then :func:`hpcps_kernels.init.pull_rows` or the rule's kernel.

Where the shard's index and rows are small enough to stay in cache (:func:`in_cache`), the loop
takes the keys one by one. Elsewhere it is a pipeline of three stages, so that the cache misses
of successive keys overlap instead of queueing: the key ``2 * PREFETCH_KEYS`` ahead has its index
entry prefetched (its direct entry, or the first probe position of its hash); the key
``PREFETCH_KEYS`` ahead reads that entry and prefetches the slot it names (the slot's key, to
compare, and the row's lines: a guess that a probe confirms for all but one key in 32 tags); the
key at hand is then looked up, all in cache, and its row read or updated. Both loops give the
same slots and the same bits.

A push's rule is compiled into its kernel (:func:`push_kernel`, one per built-in one-pass rule,
:data:`PUSH`): the same inlined update as the rule's own kernel (``<rule>_update`` of
:mod:`hpcps_kernels.optim`, in float64), so the same bits. The kernels use numpy's error model:
numba's Python one made every division a check that can raise, and a loop that can raise keeps
its arrays' reference counts per key (3x slower).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._prefetch import prefetch, prefetch_lines
from .hashing import mix64
from .hashtable import key_tag, probe
from .init import init_values
from .optim import (FUSED_ADAGRAD, FUSED_ADAM, FUSED_FTRL, FUSED_SGD, adagrad_constants, adagrad_update,
                    adam_constants, adam_update, ahead_keys, ftrl_constants, ftrl_update, sgd_constants, sgd_update)
from .parallel import TwoThreads, run_split, worth_splitting
from .tuning import CACHED_TABLE_BYTES, PREFETCH_KEYS

NOTHING_LEFT = np.zeros(0, dtype=np.int64)  # a push's positions not done, when it did them all


@njit(inline="always")
def in_cache(direct, index, keys, rows):
    """Whether a shard's index and rows take at most CACHED_TABLE_BYTES: they then stay in cache
    between requests, and the loops below look its keys up one by one, without the prefetch
    pipeline, whose stages cost more than the misses they would hide (twice the time of a 1,000-key
    pull's loop)."""
    return direct.nbytes + index.nbytes + keys.nbytes + rows.nbytes <= CACHED_TABLE_BYTES


@njit(inline="always")
def slot_of(direct, index, keys, k, nd, mask, tag_bits):
    """Key ``k``'s slot (-1: absent): its direct entry below ``nd``, else its hash probe."""
    if k < nd:
        return np.int64(direct[k])
    h = mix64(k)
    return probe(index, keys, k, key_tag(h, tag_bits), h & mask, mask, tag_bits)[0]


@njit(cache=True, nogil=True, error_model="numpy")  # (nogil: see hpcps_kernels.parallel)
def pull(direct, index, keys, queries, tag_bits, rows, dim, kind, scale, seed, slots, out):
    """A pull in one pass: ``slots[i]`` = the slot of ``queries[i]`` (-1 if absent) and
    ``out[i]`` = its row's first ``dim`` values, or its initial values if absent. Returns how
    many keys were absent (0: the caller has no initial values to fix, e.g. given ones)."""
    nd = np.uint64(direct.shape[0])
    mask = np.uint64(index.shape[0] - 1)
    flat, width, n = rows.reshape(-1), rows.shape[1], queries.shape[0]
    one = np.empty((1, dim), dtype=np.float32)
    absent = 0
    if in_cache(direct, index, keys, rows):
        for i in range(n):
            s = slot_of(direct, index, keys, queries[i], nd, mask, tag_bits)
            slots[i] = s
            if s >= 0:
                for d in range(dim):
                    out[i, d] = rows[s, d]
            else:
                absent += 1
                init_values(queries[i:i + 1], dim, kind, scale, seed, one)
                for d in range(dim):
                    out[i, d] = one[0, d]
        return absent
    hashes = np.empty(n, dtype=np.uint64)  # (first, in a loop of their own: it vectorises)
    for i in range(n):
        hashes[i] = mix64(queries[i])
    # The stages are written out here and in push_kernel's loop: as inline helpers taking the
    # arrays, each kept reference counts per key and the kernels ran 3-4 times slower (a helper
    # that slices an array, as the initial values' does, 10 times; slot_of, which does not, costs
    # nothing).
    for i in range(-2 * PREFETCH_KEYS, n):  # (negative i: the stages filling up)
        j = i + 2 * PREFETCH_KEYS
        if j < n:  # stage one: the key's direct entry, or its first probe position
            if queries[j] < nd:
                prefetch(direct, queries[j])
            else:
                prefetch(index, hashes[j] & mask)
        j = i + PREFETCH_KEYS
        if 0 <= j < n:  # stage two: the slot that entry names, its key and its row's values
            s = np.int64(-1)
            if queries[j] < nd:
                s = np.int64(direct[queries[j]])
            else:
                e = index[hashes[j] & mask]
                if ~e != 0:
                    s = np.int64(np.uint64(e) >> np.uint64(tag_bits))
                    prefetch(keys, s)
            if s >= 0:  # (a dim-64 pull: 4 lines)
                prefetch_lines(flat, s * width, s * width + dim)
        if i < 0:
            continue
        k = queries[i]  # stage three: the slot, and the row's values
        if k < nd:
            s = np.int64(direct[k])
        else:
            s = probe(index, keys, k, key_tag(hashes[i], tag_bits), hashes[i] & mask, mask, tag_bits)[0]
        slots[i] = s
        if s >= 0:
            for d in range(dim):
                out[i, d] = rows[s, d]
        else:
            absent += 1
            init_values(queries[i:i + 1], dim, kind, scale, seed, one)
            for d in range(dim):
                out[i, d] = one[0, d]
    return absent


def push_kernel(name: str, constants, update):
    """The fused push of the one-pass rule defined by ``constants`` and ``update`` (see
    :mod:`hpcps_kernels.optim`): ``kernel(direct, index, keys, queries, tag_bits, rows, grads,
    slots, *hp)`` sets ``slots[i]`` to the slot of ``queries[i]`` and applies ``grads[i]`` to its
    row, in float64 as the rule's kernel does on rows narrower than ``TWO_PASS_DIM``; ``hp``: the
    rule's hyper-parameters, its kernel's arguments in order.

    Stops at the first absent key and returns its position (``n`` when every key is present):
    the keys before it are updated, the others untouched (the caller inserts the rest)."""

    def kernel(direct, index, keys, queries, tag_bits, rows, grads, slots, *hp):
        nd = np.uint64(direct.shape[0])
        mask = np.uint64(index.shape[0] - 1)
        flat, width, n, dim = rows.reshape(-1), rows.shape[1], queries.shape[0], grads.shape[1]
        c = constants(np.float64, hp)
        if in_cache(direct, index, keys, rows):
            for i in range(n):
                s = slot_of(direct, index, keys, queries[i], nd, mask, tag_bits)
                slots[i] = s
                if s < 0:
                    return i
                update(rows, s, grads, i, None, dim, np.float64, c)
            return n
        hashes = np.empty(n, dtype=np.uint64)
        for i in range(n):
            hashes[i] = mix64(queries[i])
        for i in range(-2 * PREFETCH_KEYS, n):  # (pull's stages, the whole row prefetched)
            j = i + 2 * PREFETCH_KEYS
            if j < n:
                if queries[j] < nd:
                    prefetch(direct, queries[j])
                else:
                    prefetch(index, hashes[j] & mask)
            j = i + PREFETCH_KEYS
            if 0 <= j < n:
                s = np.int64(-1)
                if queries[j] < nd:
                    s = np.int64(direct[queries[j]])
                else:
                    e = index[hashes[j] & mask]
                    if ~e != 0:
                        s = np.int64(np.uint64(e) >> np.uint64(tag_bits))
                        prefetch(keys, s)
                if s >= 0:
                    prefetch_lines(flat, s * width, s * width + width)
            if i < 0:
                continue
            k = queries[i]
            if k < nd:
                s = np.int64(direct[k])
            else:
                s = probe(index, keys, k, key_tag(hashes[i], tag_bits), hashes[i] & mask, mask, tag_bits)[0]
            slots[i] = s
            if s < 0:
                return i
            update(rows, s, grads, i, None, dim, np.float64, c)
        return n

    kernel.__name__ = kernel.__qualname__ = name
    return njit(cache=True, nogil=True, error_model="numpy")(kernel)  # (nogil: see hpcps_kernels.parallel)


def push_pull_kernel(name: str, constants, update):
    """The push-pull of the one-pass rule defined by ``constants`` and ``update`` whose push takes
    the slots a pull of the same keys resolved: ``kernel(direct, index, keys, tag_bits, rows,
    got_keys, got_slots, queries, grads, pull_keys, kind, scale, seed, slots, out, *hp)`` applies
    ``grads[i]`` to row ``got_slots[i]`` in order, as the rule's kernel does on rows narrower
    than ``TWO_PASS_DIM`` (the same inlined update, in float64: the same bits), then pulls
    ``pull_keys`` as :func:`pull` does (``slots``, ``out``; the pull's ``dim`` is ``out``'s).

    Returns -1, nothing changed, unless ``got_keys`` are ``queries`` and every one of them had a
    slot (``got_slots[i] >= 0``: the general way inserts the others); else the number of pulled
    keys absent. A pull of the keys just pushed (ps-lite's push-pull) reads the rows at
    ``got_slots`` without looking its keys up again."""

    def kernel(direct, index, keys, tag_bits, rows, got_keys, got_slots, queries, grads, pull_keys, kind, scale,
               seed, slots, out, *hp):
        n, dim, pull_dim = queries.shape[0], grads.shape[1], out.shape[1]
        if got_keys.shape[0] != n:
            return -1
        for i in range(n):
            if got_keys[i] != queries[i] or got_slots[i] < 0:
                return -1
        flat, width = rows.reshape(-1), rows.shape[1]
        ahead = ahead_keys(width)
        c = constants(np.float64, hp)
        for i in range(n):  # (the rule kernel's loop, its prefetch included)
            if i + ahead < n:
                p = got_slots[i + ahead] * width
                prefetch_lines(flat, p, p + width)
            update(rows, got_slots[i], grads, i, None, dim, np.float64, c)
        same = pull_keys.shape[0] == n
        for i in range(n if same else 0):
            if pull_keys[i] != queries[i]:
                same = False
                break
        if not same:
            return pull(direct, index, keys, pull_keys, tag_bits, rows, pull_dim, kind, scale, seed, slots, out)
        for i in range(n):
            s = got_slots[i]
            slots[i] = s
            for d in range(pull_dim):
                out[i, d] = rows[s, d]
        return 0

    kernel.__name__ = kernel.__qualname__ = name
    return njit(cache=True, nogil=True, error_model="numpy")(kernel)


# the fused push of each built-in one-pass rule, by its code (Optimizer.fused)
PUSH = {FUSED_SGD: push_kernel("sgd_push", sgd_constants, sgd_update),
        FUSED_ADAGRAD: push_kernel("adagrad_push", adagrad_constants, adagrad_update),
        FUSED_FTRL: push_kernel("ftrl_push", ftrl_constants, ftrl_update),
        FUSED_ADAM: push_kernel("adam_push", adam_constants, adam_update)}

# the push-pull to a pull's slots of each built-in one-pass rule, by its code
PUSH_PULL = {FUSED_SGD: push_pull_kernel("sgd_push_pull", sgd_constants, sgd_update),
             FUSED_ADAGRAD: push_pull_kernel("adagrad_push_pull", adagrad_constants, adagrad_update),
             FUSED_FTRL: push_pull_kernel("ftrl_push_pull", ftrl_constants, ftrl_update),
             FUSED_ADAM: push_pull_kernel("adam_push_pull", adam_constants, adam_update)}


def index_pull(idx, queries: np.ndarray, rows: np.ndarray, dim: int, kind: int, scale: float, seed: int,
               out: np.ndarray, threads: TwoThreads | None = None) -> tuple[np.ndarray, int]:
    """The slots of ``queries`` in index ``idx`` (a ``KeyIndex`` or a ``DirectKeyIndex``, -1:
    absent) and their rows' first ``dim`` values (or the initializer's) into ``out``, in one pass
    (:func:`pull`; with ``threads``, a large pull's halves at once); returns (the slots, how many
    keys were absent)."""
    n = queries.shape[0]
    slots = np.empty(n, dtype=np.int64)
    if not worth_splitting(threads, n, dim, pull=True):  # (most pulls: no closure on their way)
        return slots, pull(idx.direct, idx.index, idx.keys, queries, idx.tag_bits, rows, dim, kind, scale, seed,
                           slots, out)
    absent = run_split(threads, n, lambda lo, hi: pull(idx.direct, idx.index, idx.keys, queries[lo:hi], idx.tag_bits,
                                                       rows, dim, kind, scale, seed, slots[lo:hi], out[lo:hi]),
                       dim, pull=True)
    return slots, sum(absent)


def index_push(idx, queries: np.ndarray, rows: np.ndarray, grads: np.ndarray, rule: int, hp: tuple,
               slots: np.ndarray, threads: TwoThreads | None = None) -> np.ndarray:
    """Look up ``queries`` in index ``idx`` and apply ``grads`` to their rows by the built-in
    one-pass rule ``rule`` (:data:`PUSH`; ``hp``: its hyper-parameters) in one pass; with
    ``threads``, a large push's halves at once, each up to its first absent key. Returns the
    positions not done (:data:`NOTHING_LEFT` when none; the others' slots are in ``slots``)."""
    kernel, n = PUSH[rule], queries.shape[0]
    if not worth_splitting(threads, n, grads.shape[1]):
        stop = kernel(idx.direct, idx.index, idx.keys, queries, idx.tag_bits, rows, grads, slots, *hp)
        return NOTHING_LEFT if stop == n else np.arange(stop, n)
    left = run_split(threads, n, lambda lo, hi: (
        lo + kernel(idx.direct, idx.index, idx.keys, queries[lo:hi], idx.tag_bits, rows, grads[lo:hi],
                    slots[lo:hi], *hp), hi), grads.shape[1])
    todo = np.concatenate([np.arange(lo, hi) for lo, hi in left])
    return todo if todo.shape[0] else NOTHING_LEFT
