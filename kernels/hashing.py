"""Feature hashing: XXH64 (xxHash, 64-bit) of a token's bytes, seeded by its field.

A feature key is ``xxh64(token_bytes, seed=field)``: the token's raw bytes (no terminator, no
encoding step) hashed with the field's index as the 64-bit seed, so the same token in two fields
gives two unrelated keys. XXH64 is the published algorithm of the xxHash project (Yann Collet);
the tests check known-answer vectors against the reference C implementation (PyPI ``xxhash``).
Keys use the whole uint64 space; reducing them to a smaller space (``key & (2**bits - 1)``)
is left to the caller.
"""

from __future__ import annotations

import numpy as np
from numba import njit

P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)
P4 = np.uint64(0x85EBCA77C2B2AE63)
P5 = np.uint64(0x27D4EB2F165667C5)


@njit(inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(inline="always")
def _read_le(buf, i, nbytes):
    """The ``nbytes`` bytes ``buf[i:i + nbytes]`` as a little-endian uint64."""
    v = np.uint64(0)
    for k in range(nbytes):
        v |= np.uint64(buf[i + k]) << np.uint64(8 * k)
    return v


@njit(inline="always")
def read64(buf, i):
    """The 8 bytes ``buf[i:i + 8]`` as a little-endian uint64."""
    return _read_le(buf, i, 8)


@njit(inline="always")
def _read32(buf, i):
    return _read_le(buf, i, 4)


@njit(inline="always")
def _round(acc, lane):
    acc = acc + lane * P2
    acc = _rotl(acc, 31)
    return acc * P1


@njit(inline="always")
def _merge(acc, val):
    val = _round(np.uint64(0), val)
    acc ^= val
    return acc * P1 + P4


@njit(inline="always")
def _converge(v1, v2, v3, v4):
    h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
    h = _merge(h, v1)
    h = _merge(h, v2)
    h = _merge(h, v3)
    return _merge(h, v4)


@njit(inline="always")
def _avalanche(h):
    h ^= h >> np.uint64(33)
    h *= P2
    h ^= h >> np.uint64(29)
    h *= P3
    return h ^ (h >> np.uint64(32))


@njit(cache=True)
def xxh64(buf, start, end, seed):
    """XXH64 of ``buf[start:end]`` (a uint8 array) with a uint64 ``seed``."""
    seed = np.uint64(seed)
    n = end - start
    i = start
    if n >= 32:
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        limit = end - 32
        while i <= limit:
            v1 = _round(v1, read64(buf, i))
            v2 = _round(v2, read64(buf, i + 8))
            v3 = _round(v3, read64(buf, i + 16))
            v4 = _round(v4, read64(buf, i + 24))
            i += 32
        h = _converge(v1, v2, v3, v4)
    else:
        h = seed + P5
    h += np.uint64(n)
    while i + 8 <= end:
        k1 = _round(np.uint64(0), read64(buf, i))
        h ^= k1
        h = _rotl(h, 27) * P1 + P4
        i += 8
    if i + 4 <= end:
        h ^= _read32(buf, i) * P1
        h = _rotl(h, 23) * P2 + P3
        i += 4
    while i < end:
        h ^= np.uint64(buf[i]) * P5
        h = _rotl(h, 11) * P1
        i += 1
    return _avalanche(h)


@njit(inline="always")
def xxh64_u64(v, seed):
    """XXH64 of the 8 little-endian bytes of the uint64 ``v``: the value :func:`xxh64` gives for
    those bytes, without writing them anywhere."""
    h = np.uint64(seed) + P5 + np.uint64(8)
    h ^= _round(np.uint64(0), v)
    h = _rotl(h, 27) * P1 + P4
    return _avalanche(h)


@njit(cache=True)
def hash_tokens(buf, starts, ends, fields):
    """Keys of many tokens: ``xxh64(buf[starts[i]:ends[i]], seed=fields[i])`` for each i."""
    out = np.empty(starts.shape[0], dtype=np.uint64)
    for i in range(starts.shape[0]):
        out[i] = xxh64(buf, starts[i], ends[i], fields[i])
    return out


def feature_key(field: int, token: bytes | str) -> int:
    """The key of one (field, token) pair, as a Python int (convenience, not for hot loops)."""
    if isinstance(token, str):
        token = token.encode()
    buf = np.frombuffer(token, dtype=np.uint8)
    return int(xxh64(buf, 0, buf.shape[0], np.uint64(field)))


@njit(inline="always")
def mix64(x):
    """A bijective 64-bit finaliser (splitmix64's): spreads sequential keys over all bits."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


SHARD_SALT = np.uint64(0x5BD1E9955BD1E995)


@njit(inline="always")
def shard_mask(n):
    """What :func:`shard_index` takes beside ``n`` shards (uint64): ``n - 1`` where ``n`` is a
    power of two (the default 1024), else 0."""
    return n - np.uint64(1) if n > np.uint64(0) and (n & (n - np.uint64(1))) == np.uint64(0) else np.uint64(0)


@njit(inline="always")
def shard_index(key, n, mask):
    """The virtual shard of ``key`` among ``n`` (uint64; ``mask``: :func:`shard_mask`):
    ``mix64(key ^ SHARD_SALT) % n``, by a bitwise and where ``n`` is a power of two (the same
    number, where a 64-bit division costs six times the rest of the hash)."""
    h = mix64(key ^ SHARD_SALT)
    return np.int64(h & mask) if mask else np.int64(h % n)


@njit(cache=True)
def shard_of(keys, num_shards):
    """Virtual shard of every key (int64)."""
    out = np.empty(keys.shape[0], dtype=np.int64)
    n = np.uint64(num_shards)
    mask = shard_mask(n)
    for i in range(keys.shape[0]):
        out[i] = shard_index(keys[i], n, mask)
    return out


@njit(cache=True)
def server_of(keys, num_shards, shard_server):
    """Server of every key (int64), through its shard."""
    out = np.empty(keys.shape[0], dtype=np.int64)
    n = np.uint64(num_shards)
    mask = shard_mask(n)
    for i in range(keys.shape[0]):
        out[i] = shard_server[shard_index(keys[i], n, mask)]
    return out


@njit(cache=True)
def xxh64_words(words, tail, seed):
    """XXH64 of the bytes ``words`` (uint64, little-endian) followed by ``tail`` (uint8, fewer than
    8 bytes): the same value as :func:`xxh64` of those bytes, reading 8 bytes at a time (faster
    for checksumming files through a memory map)."""
    seed = np.uint64(seed)
    nw = words.shape[0]
    n = nw * 8 + tail.shape[0]
    w = 0
    if n >= 32:
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        while (w + 4) * 8 <= n:
            v1 = _round(v1, words[w])
            v2 = _round(v2, words[w + 1])
            v3 = _round(v3, words[w + 2])
            v4 = _round(v4, words[w + 3])
            w += 4
        h = _converge(v1, v2, v3, v4)
    else:
        h = seed + P5
    h += np.uint64(n)
    while w < nw:
        h ^= _round(np.uint64(0), words[w])
        h = _rotl(h, 27) * P1 + P4
        w += 1
    i = 0
    if tail.shape[0] >= 4:
        h ^= _read32(tail, 0) * P1
        h = _rotl(h, 23) * P2 + P3
        i = 4
    while i < tail.shape[0]:
        h ^= np.uint64(tail[i]) * P5
        h = _rotl(h, 11) * P1
        i += 1
    return _avalanche(h)
