"""Deterministic per-key initial values for new table rows.

``value[key, d]`` depends only on (key, d, seed): every server, any server count, any insertion
order and a pull of a never-pushed key all see the same number. Kinds: ``zeros``; ``uniform``
(in ``[-scale, scale)``); ``normal`` (mean 0, std ``scale``, Box-Muller on two hashes).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._prefetch import prefetch_lines
from .hashing import mix64
from .tuning import PREFETCH_KEYS


ZEROS, UNIFORM, NORMAL = 0, 1, 2
KINDS = {"zeros": ZEROS, "uniform": UNIFORM, "normal": NORMAL}
_INV_2_53 = 1.0 / 9007199254740992.0


@njit(inline="always")
def _unit(h):
    """A float in (0, 1) from a 64-bit hash (53 high bits)."""
    return (np.float64(h >> np.uint64(11)) + 0.5) * _INV_2_53


@njit(cache=True)
def init_values(keys, dim, kind, scale, seed, out):
    """``out[i, :dim]`` = the initial parameters of ``keys[i]``."""
    s = mix64(np.uint64(seed) + np.uint64(0x632BE59BD9B4E019))
    for i in range(keys.shape[0]):
        base = mix64(keys[i] ^ s)
        for d in range(dim):
            if kind == ZEROS:
                out[i, d] = 0.0
                continue
            h1 = mix64(base + np.uint64(2 * d + 1))
            if kind == UNIFORM:
                out[i, d] = scale * (2.0 * _unit(h1) - 1.0)
            else:
                h2 = mix64(base + np.uint64(2 * d + 2))
                out[i, d] = scale * math.sqrt(-2.0 * math.log(_unit(h1))) * math.cos(2.0 * math.pi * _unit(h2))


@njit(cache=True)
def pull_rows(rows, slots, keys, dim, kind, scale, seed, out):
    """``out[i] = rows[slots[i], :dim]``, or the initializer of ``keys[i]`` where ``slots[i] < 0``
    (a key never pushed: pulls do not create rows)."""
    one = np.empty((1, dim), dtype=np.float32)
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    for i in range(n):
        if i + PREFETCH_KEYS < n and slots[i + PREFETCH_KEYS] >= 0:
            p = slots[i + PREFETCH_KEYS] * width
            prefetch_lines(flat, p, p + dim)  # the lines of the values pulled (a dim-64 pull: 4)
        s = slots[i]
        if s >= 0:
            for d in range(dim):
                out[i, d] = rows[s, d]
        else:
            init_values(keys[i:i + 1], dim, kind, scale, seed, one)
            for d in range(dim):
                out[i, d] = one[0, d]


@njit(cache=True)
def create_rows(rows, slots, keys, first_new, dim, kind, scale, seed, state):
    """Initialise the rows of keys inserted by the last lookup-or-insert (``slots >= first_new``):
    parameters from the initializer, state columns from ``state``."""
    one = np.empty((1, dim), dtype=np.float32)
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= first_new:
            init_values(keys[i:i + 1], dim, kind, scale, seed, one)
            for d in range(dim):
                rows[s, d] = one[0, d]
            for c in range(state.shape[0]):
                rows[s, dim + c] = state[c]
