"""Kernels of the synthetic data generator: Criteo keys of (field, token) pairs, and text output.

The keys are those :func:`hpcps_kernels.parse.parse_criteo` computes: integer column ``i`` (0..12)
with value ``v`` → ``xxh64(int64 bucket(v), seed=i)``; categorical column ``j`` (0..25) with token
id ``t`` written as 8 lower-case hex digits → ``xxh64(hex bytes, seed=13 + j)``; then ``& mask``.
So a generated libsvm file (``key:1`` per present field) and the generated Criteo TSV file parse
into the same CSR batch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import xxh64
from .parse import int_bucket

HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@njit(cache=True)
def criteo_keys(ints, cats, present, mask):
    """Keys (rows, 39) of integer values ``ints`` (rows, 13) and token ids ``cats`` (rows, 26);
    entries where ``present`` is False are left 0."""
    rows = ints.shape[0]
    out = np.zeros((rows, 39), dtype=np.uint64)
    scratch = np.empty(8, dtype=np.uint8)
    for r in range(rows):
        for c in range(13):
            if present[r, c]:
                u = np.uint64(int_bucket(ints[r, c]))
                for t in range(8):
                    scratch[t] = np.uint8((u >> np.uint64(8 * t)) & np.uint64(255))
                out[r, c] = xxh64(scratch, 0, 8, np.uint64(c)) & mask
        for c in range(26):
            if present[r, 13 + c]:
                v = np.uint64(cats[r, c])
                for t in range(8):
                    scratch[7 - t] = HEX[(v >> np.uint64(4 * t)) & np.uint64(15)]
                out[r, 13 + c] = xxh64(scratch, 0, 8, np.uint64(13 + c)) & mask
    return out


TEN = np.uint64(10)


@njit(inline="always")
def _put_uint(buf, p, v):
    """Write the decimal digits of the non-negative int ``v`` at ``buf[p:]``; returns the new p.

    In uint64 throughout: numba mixes uint64 with a plain int literal in float64, which wrote
    keys from 2**53 up with wrong digits (and ran at a quarter of this speed)."""
    x = np.uint64(v)
    n = 1
    y = x // TEN
    while y > 0:
        n += 1
        y //= TEN
    for i in range(n - 1, -1, -1):
        q = x // TEN
        buf[p + i] = np.uint8(48 + (x - q * TEN))
        x = q
    return p + n


@njit(inline="always")
def _put_int(buf, p, v):
    if v < 0:
        buf[p] = 45
        return _put_uint(buf, p + 1, -v)
    return _put_uint(buf, p, v)


@njit(inline="always")
def _put_label(buf, p, y, decimals):
    """A label: an integer, or with ``decimals`` digits after the point."""
    if decimals == 0:
        return _put_int(buf, p, np.int64(round(y)))
    scale = 10 ** decimals
    v = np.int64(round(y * scale))
    if v < 0:
        buf[p] = 45
        p += 1
        v = -v
    p = _put_uint(buf, p, v // scale)
    buf[p] = 46
    p += 1
    frac = v % scale
    for i in range(decimals - 1, -1, -1):
        buf[p + i] = 48 + frac % 10
        frac //= 10
    return p + decimals


@njit(cache=True)
def write_libsvm(labels, keys, present, decimals, buf):
    """``label key:1 key:1 ...`` per row (present entries only). Returns bytes written."""
    p = 0
    for r in range(keys.shape[0]):
        p = _put_label(buf, p, labels[r], decimals)
        for c in range(keys.shape[1]):
            if present[r, c]:
                buf[p] = 32
                p = _put_uint(buf, p + 1, keys[r, c])
                buf[p] = 58
                buf[p + 1] = 49
                p += 2
        buf[p] = 10
        p += 1
    return p


@njit(cache=True)
def write_vw(labels, keys, present, buf):
    """Vowpal Wabbit text: ``1 |f k<key> ...`` (label -1/1). Returns bytes written."""
    p = 0
    for r in range(keys.shape[0]):
        if labels[r] > 0.5:
            buf[p] = 49
            p += 1
        else:
            buf[p] = 45
            buf[p + 1] = 49
            p += 2
        buf[p] = 32
        buf[p + 1] = 124
        buf[p + 2] = 102
        p += 3
        for c in range(keys.shape[1]):
            if present[r, c]:
                buf[p] = 32
                buf[p + 1] = 107
                p = _put_uint(buf, p + 2, keys[r, c])
        buf[p] = 10
        p += 1
    return p


@njit(cache=True)
def write_criteo(labels, ints, cats, present, buf):
    """Criteo TSV rows: label, 13 integers, 26 8-hex-digit tokens; absent = empty column."""
    p = 0
    for r in range(ints.shape[0]):
        p = _put_int(buf, p, np.int64(round(labels[r])))
        for c in range(13):
            buf[p] = 9
            p += 1
            if present[r, c]:
                p = _put_int(buf, p, ints[r, c])
        for c in range(26):
            buf[p] = 9
            p += 1
            if present[r, 13 + c]:
                v = np.uint64(cats[r, c])
                for t in range(8):
                    buf[p + 7 - t] = HEX[(v >> np.uint64(4 * t)) & np.uint64(15)]
                p += 8
        buf[p] = 10
        p += 1
    return p
