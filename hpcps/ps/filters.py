"""The parameter server's traffic filters (the OSDI'14 parameter server's, section 5): pure objects,
no MPI. Each is off by default (``[filters]`` in the configuration) and each saves bytes on its own:

* :class:`PushResidual` (``push_threshold``): a worker adds each push's gradients to a residual per
  key and sends only the keys with a coordinate whose accumulated update reaches the threshold in
  absolute value (the whole row, the residual then zero); the rest stays in the residual, on the
  worker, per table. Its memory: a key index and a row of ``dim`` float32 per distinct key pushed
  (about ``16 + 4 dim`` bytes a key). It is flushed (every key with a nonzero residual pushed,
  :meth:`PushResidual.drain`) at the end of every epoch and before every checkpoint
  (``Context.flush_filters``), so a saved model holds every update and a restart from a checkpoint
  loses nothing; but not the periodic checkpoints of backup workers, which the first worker writes
  alone (:mod:`hpcps.train.quorum_checkpoints`): a restart from one loses each worker's residual,
  less than the threshold per coordinate of each key; a worker lost between two flushes loses less than the threshold per coordinate of
  each key (:meth:`PushResidual.largest`).
* Wire types (``wire_dtype``): the pushed and pulled values travel as fp16 or bf16, rounded to the
  nearest even (:func:`encode`, :func:`decode`); fp16 saturates at its largest finite value
  (65504) instead of turning into infinity. The servers decode to float32: their rows and
  optimizer state stay float32.
* :class:`KeyListCache` (``key_cache``): a worker sends a key list to a server once, with an id,
  and then only the id while the list is unchanged. The server keeps the lists it was sent per
  (worker, table), the least recently used dropped past a byte budget; the worker keeps the same
  cache (of sizes only), fed the same lists in the same order, so it knows exactly which ids its
  servers hold (:class:`WorkerKeyLists`); it knows a list by a 128-bit hash of its keys and length.
  A server sent an id it does not hold raises an error naming the worker, the table and the id
  (:class:`ServerKeyLists`): never a wrong row.

:class:`Savings` counts the bytes each filter kept off the wire (the summary's
``<filter>_saved_bytes``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from hpcps_kernels import wire as kwire
from hpcps_kernels.hashtable import KeyIndex

FP16_MAX = 65504.0  # fp16's largest finite value (kwire.FP16_MAX_BITS)

# -- wire types ---------------------------------------------------------------------------------

FP32, FP16, BF16 = 0, 1, 2
WIRE_NAMES = {"fp32": FP32, "fp16": FP16, "bf16": BF16}
WIRE_ITEMSIZE = {FP32: 4, FP16: 2, BF16: 2}


def wire_code(name: str) -> int:
    """The wire type's code (``fp32``, ``fp16`` or ``bf16``)."""
    if name not in WIRE_NAMES:
        raise ValueError(f"unknown wire dtype {name!r}; expected one of {sorted(WIRE_NAMES)}")
    return WIRE_NAMES[name]


def wire_bytes(count: int, wire: int) -> int:
    """The bytes ``count`` values take on the wire in type ``wire``, padded to 4 bytes (so that
    what follows them stays aligned as float32 values would leave it)."""
    return -(-count * WIRE_ITEMSIZE[wire] // 4) * 4


def encode(values: np.ndarray, wire: int) -> np.ndarray:
    """float32 ``values`` as the 16-bit words of type ``wire`` (fp16 or bf16), flat; fp32: as given.
    One pass (:mod:`hpcps_kernels.wire`)."""
    if wire == FP32:
        return values
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.shape[0], dtype=np.uint16)
    (kwire.fp16_bits if wire == FP16 else kwire.bf16_bits)(bits, out)
    return out


def decode(words: np.ndarray, wire: int) -> np.ndarray:
    """The float32 values of ``words`` (uint16 or bytes) in type ``wire``: exact (both types are
    subsets of float32)."""
    if wire == FP16:
        out = np.empty(words.view(np.uint16).shape[0], dtype=np.uint32)
        kwire.fp16_values(words.view(np.uint16), out)
        return out.view(np.float32)
    return (words.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# -- the significance filter ---------------------------------------------------------------------


class PushResidual:
    """One table's residual on a worker: per key, the pushed update not sent yet."""

    def __init__(self, dim: int, threshold: float):
        if not threshold > 0:
            raise ValueError(f"push_threshold must be > 0 (got {threshold})")
        self.dim = dim
        self.threshold = np.float32(threshold)
        self.index = KeyIndex()
        self.rows = np.zeros((16, dim), dtype=np.float32)

    def filter(self, keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``grads`` (float32, a row per key of the distinct ``keys``) to the residual; returns
        (which keys to send, a bool each; their rows to send: the accumulated update). The residual
        of the keys sent is then zero, and for every key sent + kept equals all it was pushed."""
        slots = self.index.lookup_or_insert(keys)
        if self.index.key_capacity > self.rows.shape[0]:
            rows = np.zeros((self.index.key_capacity, self.dim), dtype=np.float32)
            rows[:self.rows.shape[0]] = self.rows
            self.rows = rows
        total = self.rows[slots] + grads.reshape(-1, self.dim)
        send = (np.abs(total) >= self.threshold).any(axis=1)
        out = total[send]
        total[send] = 0.0
        self.rows[slots] = total
        return send, out

    def drain(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of every key whose residual is not zero (in the order first pushed), to be
        sent: the residual is then zero everywhere (the flush at the end of an epoch and before a
        checkpoint)."""
        n = self.index.size
        rows = self.rows[:n]
        left = (rows != 0).any(axis=1)
        keys, out = self.index.keys[:n][left].copy(), rows[left]  # (a boolean index copies)
        rows[:] = 0.0
        return keys, out

    def kept(self, keys: np.ndarray) -> np.ndarray:
        """The residual of ``keys`` (zero for a key never pushed)."""
        slots = self.index.lookup(np.ascontiguousarray(keys, dtype=np.uint64))
        out = np.zeros((keys.shape[0], self.dim), dtype=np.float32)
        found = slots >= 0
        out[found] = self.rows[slots[found]]
        return out

    def largest(self) -> float:
        """The largest absolute coordinate kept (below the threshold)."""
        return float(np.abs(self.rows[:self.index.size]).max(initial=0.0))

    def nbytes(self) -> int:
        return self.index.nbytes() + self.rows.nbytes


# -- the key cache ---------------------------------------------------------------------------------


class KeyListCache:
    """Key lists by id, the least recently used dropped once they pass ``budget_bytes`` (a list
    larger than the budget is never kept). The worker's and the server's are the same object, fed
    the same calls in the same order, so they hold the same ids; the server's holds copies of the
    lists, the worker's only their sizes."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.lists: OrderedDict[int, tuple[int, np.ndarray | None]] = OrderedDict()  # id -> (bytes, keys)
        self.nbytes = 0

    def fits(self, keys: np.ndarray) -> bool:
        """Whether a list of ``keys`` is ever kept."""
        return 0 < keys.nbytes <= self.budget

    def get(self, list_id: int) -> np.ndarray | bool | None:
        """The list kept as ``list_id`` (True where only its size is), now the most recently used;
        None: not kept."""
        entry = self.lists.get(list_id)
        if entry is None:
            return None
        self.lists.move_to_end(list_id)
        return True if entry[1] is None else entry[1]

    def put(self, list_id: int, keys: np.ndarray, copy: bool = True) -> list[int]:
        """Keep ``keys`` (:meth:`fits`) as ``list_id``, a copy of them or (``copy`` False) only their
        size; returns the ids dropped for room."""
        dropped = []
        while self.lists and self.nbytes + keys.nbytes > self.budget:
            old, (nbytes, _) = self.lists.popitem(last=False)
            self.nbytes -= nbytes
            dropped.append(old)
        self.lists[list_id] = (keys.nbytes, np.array(keys, dtype=np.uint64, copy=True) if copy else None)
        self.nbytes += keys.nbytes
        return dropped


def list_hash(keys: np.ndarray) -> int:
    """A list's identity: the 128-bit hash (xxh3) of its keys' bytes, seeded with its length. Two
    different lists of keys share one with a probability of about 2**-128."""
    return xxhash.xxh3_128_intdigest(memoryview(np.ascontiguousarray(keys)).cast("B"), seed=keys.shape[0])


class WorkerKeyLists:
    """A worker's key lists sent to one server for one table: :meth:`ref` says what to send."""

    def __init__(self, budget_bytes: int):
        self.cache = KeyListCache(budget_bytes)
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.next_id = 1

    def ref(self, keys: np.ndarray) -> tuple[int, bool]:
        """(the list's id, whether the server holds it already) for a list of ``keys`` to send;
        (0, False): send it plainly (empty; one key, which is no longer than an id, so that caching it
        would only cost the id of its first sending, as a dense table's chunk did; or larger than the
        budget)."""
        if keys.shape[0] < 2 or not self.cache.fits(keys):
            return 0, False
        h = list_hash(keys)
        list_id = self.by_hash.get(h, 0)
        if list_id and self.cache.get(list_id) is not None:
            return list_id, True
        list_id, self.next_id = self.next_id, self.next_id + 1
        for old in self.cache.put(list_id, keys, copy=False):
            self.by_hash.pop(self.hash_of.pop(old), None)
        self.by_hash[h], self.hash_of[list_id] = list_id, h
        return list_id, False


class UnknownKeyList(RuntimeError):
    """A request named a key list its server does not hold."""


class ServerKeyLists:
    """A server's key lists, per (worker, table), each a :class:`KeyListCache` of ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.caches: dict[tuple[int, int], KeyListCache] = {}

    def _cache(self, worker: int, table: int) -> KeyListCache:
        cache = self.caches.get((worker, table))
        if cache is None:
            cache = self.caches[(worker, table)] = KeyListCache(self.budget)
        return cache

    def store(self, worker: int, table: int, list_id: int, keys: np.ndarray) -> np.ndarray:
        """Keep the list ``keys`` a worker sent as ``list_id``; returns it."""
        cache = self._cache(worker, table)
        cache.put(list_id, keys)
        return cache.lists[list_id][1]

    def get(self, worker: int, table: int, list_id: int) -> np.ndarray:
        """The list a worker sent as ``list_id`` before, or :class:`UnknownKeyList`."""
        keys = self._cache(worker, table).get(list_id)
        if keys is None:
            raise UnknownKeyList(f"worker {worker} named key list {list_id} of table {table}, which this server "
                                 f"does not hold (the worker's and the server's key caches disagree)")
        return keys

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())


def charged(stats: dict, work):
    """Run ``work()`` (and return what it returns), its traffic (in ``stats``, the context's
    statistics) taken back from the bytes the significance filter saved, and nothing it saved
    counted: what a flush of the residuals costs, which the filter only deferred (a run without
    the filter sends none of it)."""
    before = stats["bytes_sent"] + stats["bytes_received"]
    saved = {k: stats[k] for k in SAVED_KEYS}
    try:
        return work()
    finally:
        stats.update(saved)
        stats["push_threshold_saved_bytes"] -= stats["bytes_sent"] + stats["bytes_received"] - before


# -- the filters of a run ---------------------------------------------------------------------------

SAVED_KEYS = ("push_threshold_saved_bytes", "wire_dtype_saved_bytes", "key_cache_saved_bytes")
# the values fp16 could not carry (beyond its largest, 65504) that travelled as +-65504
SATURATED_KEY = "wire_dtype_saturated_values"


@dataclass(frozen=True)
class Filters:
    """The filters a run uses (``[filters]``): all off by default. ``key_cache_mb``: the key lists
    a worker keeps per table; each of its servers holds its share (divided by the servers)."""

    push_threshold: float = 0.0
    wire_dtype: str = "fp32"
    key_cache: bool = False
    key_cache_mb: float = 64.0

    def __post_init__(self):
        # the library's check of what hpcps.config checks for [filters]: a value out of range is an
        # error naming the field, not a filter silently off (a negative or NaN threshold, no budget)
        def number(name: str, value, positive: bool) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    value <= 0 if positive else value < 0):
                raise ValueError(f"Filters.{name} must be a finite number {'> 0' if positive else '>= 0'} "
                                 f"(got {value!r})")
        number("push_threshold", self.push_threshold, positive=False)
        number("key_cache_mb", self.key_cache_mb, positive=True)
        wire_code(self.wire_dtype)
        if not isinstance(self.key_cache, bool):
            raise ValueError(f"Filters.key_cache must be True or False (got {self.key_cache!r})")

    @property
    def wire(self) -> int:
        return wire_code(self.wire_dtype)

    @property
    def any(self) -> bool:
        return self.push_threshold > 0 or self.wire != FP32 or self.key_cache

    def list_budget(self, servers: int) -> int:
        """The byte budget of the key lists of one (worker, server, table)."""
        return int(self.key_cache_mb * 2**20 / max(servers, 1))

    def server_lists(self, servers: int) -> ServerKeyLists | None:
        """A server's key lists (None without the key cache)."""
        return ServerKeyLists(self.list_budget(servers)) if self.key_cache else None

    def saved_keys(self) -> tuple[str, ...]:
        """The summary's ``<filter>_saved_bytes`` keys of the filters on."""
        on = (self.push_threshold > 0, self.wire != FP32, self.key_cache)
        return tuple(k for k, yes in zip(SAVED_KEYS, on) if yes)


class TableFilters:
    """A worker's filters of one table: its residual, its wire type, its key lists per server, and
    the bytes saved (into ``stats``, the context's statistics, under :data:`SAVED_KEYS`)."""

    def __init__(self, filters: Filters, dim: int, servers: int, stats: dict):
        self.dim = dim
        self.wire = filters.wire
        self.residual = PushResidual(dim, filters.push_threshold) if filters.push_threshold > 0 else None
        budget = filters.list_budget(servers)
        self.lists = [WorkerKeyLists(budget) for _ in range(servers)] if filters.key_cache else None
        self.stats = stats

    def saturated(self, values: np.ndarray | None, pulled: bool = False) -> None:
        """Under fp16, count into ``stats[SATURATED_KEY]`` the ``values`` beyond its range: pushed
        ones before they are clipped to +-65504, pulled ones decoded as +-65504 (where the server
        clipped them). A row past 65504 pulled as 65504 trains a wrong model without a sign."""
        if self.wire != FP16 or values is None or not values.size:
            return
        size = np.abs(values)
        n = int(np.count_nonzero(size >= FP16_MAX if pulled else size > FP16_MAX))
        if n:
            self.stats[SATURATED_KEY] = self.stats.get(SATURATED_KEY, 0) + n

    def threshold(self, keys: np.ndarray, grads: np.ndarray, in_pull: np.ndarray | None):
        """The significance filter on a push of distinct ``keys``: (keys, rows, in-pull bools) to send."""
        if self.residual is None or keys.shape[0] == 0:
            return keys, grads, in_pull
        send, rows = self.significant(keys, grads)
        n, sent = keys.shape[0], rows.shape[0]
        # (each key and its float32 values, and its in-pull bit: exact for a message to one server)
        self.stats["push_threshold_saved_bytes"] += (n - sent) * (8 + 4 * self.dim) + (
            0 if in_pull is None else -(-n // 8) - -(-sent // 8))
        return keys[send], rows, None if in_pull is None else in_pull[send]

    def significant(self, keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The significance filter on a push of distinct ``keys`` (:meth:`PushResidual.filter`):
        (which keys to send, a bool each; their rows), the bytes saved not counted (a push of several
        tables counts its own: :meth:`hpcps.ps.client.TableSet`)."""
        return self.residual.filter(keys, grads)

    def flush(self) -> tuple[np.ndarray, np.ndarray] | None:
        """What the significance filter kept, to push now (:meth:`PushResidual.drain`; None: the
        filter is off). The push's bytes are taken back from the saved ones by its sender."""
        return None if self.residual is None else self.residual.drain()

    def key_ref(self, server: int, keys: np.ndarray | None, pushed: bool = False) -> tuple[int, bool]:
        """What a message to ``server`` carries for a list of ``keys``: see :meth:`WorkerKeyLists.ref`.
        ``pushed``: the keys of a push, sent plainly behind the significance filter (which picks
        another subset of the batch's keys nearly every time: cached, they would only push the
        pulls' lists out)."""
        if self.lists is None or keys is None or (pushed and self.residual is not None):
            return 0, False
        list_id, held = self.lists[server].ref(keys)
        if list_id:
            self.stats["key_cache_saved_bytes"] += 8 * keys.shape[0] - 8 if held else -8
        return list_id, held

    def count_values(self, count: int) -> None:
        """``count`` values went on the wire (either way) in the wire type."""
        if self.wire != FP32:
            self.stats["wire_dtype_saved_bytes"] += 4 * count - wire_bytes(count, self.wire)
