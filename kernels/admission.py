"""Feature admission and eviction on a server's table shard (pure kernels, no MPI).

* **Counts** of pushes per key not yet admitted live in a fixed array of uint8 (saturating at
  255), so their memory is bounded whatever the key space: a key below ``exact_below`` (a table
  with directly addressed keys: the array has one counter per key) has its own counter, exact; any
  other key shares a counter chosen by its hash (a counting filter: a collision can only admit a
  key early, never late).
* **Admission by probability** is a deterministic draw per (key, clock): the same run admits the
  same keys, and a frequent key is admitted soon while a rare one mostly never is.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import mix64

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True)
def bump_counts(counts, keys, exact_below, out):
    """Add one push to the count of each key; ``out[i]`` = the count of ``keys[i]`` after it."""
    mask = np.uint64(counts.shape[0] - 1)
    for i in range(keys.shape[0]):
        k = keys[i]
        j = k if k < exact_below else mix64(k) & mask
        c = counts[j]
        if c < 255:
            c += 1
            counts[j] = c
        out[i] = c


@njit(cache=True)
def clear_counts(counts, keys, exact_below):
    """Forget the counts of ``keys`` (evicted keys start over; shared counters are left alone)."""
    for i in range(keys.shape[0]):
        if keys[i] < exact_below:
            counts[keys[i]] = 0


@njit(cache=True)
def admit_draw(keys, clock, threshold, out):
    """``out[i]`` = whether ``keys[i]`` is admitted at ``clock`` with probability
    ``threshold / 2**64`` (a deterministic draw per key and clock)."""
    c = np.uint64(clock) * GOLDEN
    for i in range(keys.shape[0]):
        out[i] = mix64(keys[i] ^ c) < threshold
