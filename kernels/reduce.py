"""Sorting reduction of (key, value) lists: :func:`sort_reduce`.

Several workers' pushes concatenated (each sorted, together in no order), or one batch's keys
with a gradient row each, become unique sorted keys with the rows of equal keys summed, as
``np.unique`` + ``np.add.at`` give them, bit for bit: equal keys are summed in their input order,
from zero.

One stable LSD radix sort of every key (:func:`hpcps_kernels.keys.radix_argsort`: bytes on which
all keys agree are skipped, so keys of a 2**24 space take 3 passes), then one pass summing the
runs of equal keys. :func:`hpcps_kernels.keys.segment_reduce` dedups through a scratch hash table
first and sorts only the unique keys; across four pushes about 2 keys in 3 are unique, its table
outgrows the cache and each key costs two cache misses, where the sort's passes read and write in
sequence (figures: docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .keys import radix_argsort


@njit(cache=True)
def _sum_runs(sorted_keys, order, values):
    """Runs of equal keys → (unique keys, each run's rows ``values[order[i]]`` summed from zero)."""
    n = sorted_keys.shape[0]
    u = 0
    for i in range(n):
        if i == 0 or sorted_keys[i] != sorted_keys[i - 1]:
            u += 1
    dim = values.shape[1]
    uniq = np.empty(u, dtype=np.uint64)
    out = np.zeros((u, dim), dtype=values.dtype)
    t = -1
    for i in range(n):
        if i == 0 or sorted_keys[i] != sorted_keys[i - 1]:
            t += 1
            uniq[t] = sorted_keys[i]
        o = order[i]
        for d in range(dim):
            out[t, d] += values[o, d]
    return uniq, out


@njit(cache=True)
def sort_reduce(keys, values):
    """Sum ``values`` (shape ``(n, dim)``) of equal ``keys`` (uint64, any order); returns (sorted
    unique keys, sums), the result of ``np.unique`` + ``np.add.at`` bit for bit."""
    sorted_keys, order = radix_argsort(keys)
    return _sum_runs(sorted_keys, order, values)
