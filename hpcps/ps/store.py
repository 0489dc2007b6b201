"""A table shard's keys and rows on a server (pure: NumPy and the kernels, no MPI).

A :class:`RowStore` is a key → slot index plus a float32 array of slot rows ``[parameters |
optimizer state]``, kept in slot order and grown as keys arrive. The index is a
:class:`~hpcps_kernels.directindex.DirectKeyIndex` (one array lookup per key) when the table's
keys are bounded (``key_bits`` <= 26: hashed features) and the shard holds enough of them
(from 2**(key_bits - 8) keys: the same slots), else a :class:`~hpcps_kernels.hashtable.KeyIndex`
(any uint64 keys).

Changes since the last snapshot (delta snapshots, :mod:`hpcps.ps.deltas`): once
:meth:`RowStore.track_changes` is called, a mark per slot says which rows a push changed, and the
keys removed (evicted) are kept, until :meth:`RowStore.take_changes` hands them over. Off (no
cost) until then.

A pull's slots are kept per worker (:data:`RESOLVED_PULLS` of them) so that the push of the same
keys that follows (the next step of a push-pull) takes them instead of looking the keys up again.
"""

from __future__ import annotations

import numpy as np

from hpcps.ps.tables import TableSpec
from hpcps_kernels import fused as kfused
from hpcps_kernels import init as kinit
from hpcps_kernels import keys as kkeys
from hpcps_kernels.directindex import DirectKeyIndex
from hpcps_kernels.hashtable import KeyIndex
from hpcps_kernels.parallel import TwoThreads
from hpcps_kernels.tuning import DIRECT_AT_ONCE_BITS, DIRECT_FROM_SHIFT

# Pulls whose slots a server keeps per worker and table for the pushes of the same keys: 2, the
# last pull and the one before it, which train.pull_early's push follows (the next batch's pull
# goes before this batch's push).
RESOLVED_PULLS = 2


def given_initial_values(init_keys: list, keys: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """The rows pulled (``out``) of absent keys (slot -1) whose initial values are given
    (``init_keys``: ``RowStore.init_keys``): those values."""
    where = np.flatnonzero(slots < 0)  # (the absent keys only: a pull's first pass has a few of many)
    absent = keys[where]
    for key, values in init_keys:
        out[where[absent == key]] = values


def find_pull(pulls: list, index, keys: np.ndarray, absent: np.ndarray, reusable=kkeys.reusable_slots) -> tuple:
    """``(i, m)``: kept pull ``i`` of ``pulls`` (a worker's in :attr:`RowStore.resolved`, the latest
    first) was of ``keys`` and resolved through ``index`` (the store's now), ``m`` of them absent
    then (their positions in ``absent[:m]``); ``(-1, -1)``: none was. ``reusable(got_keys,
    got_slots, keys, absent)`` compares one, as :func:`hpcps_kernels.keys.reusable_slots` does
    (-1: other keys), or returns None: look no further. Nothing is taken."""
    for i, (got_keys, got_slots, got_index) in enumerate(pulls):
        if got_index is index:
            m = reusable(got_keys, got_slots, keys, absent)
            if m is None:
                break
            if m >= 0:
                return i, m
    return -1, -1


class RowStore:
    """One table's keys and rows on a server: ``index`` gives a key's slot, ``rows[slot]`` its row."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.index = self._new_index(np.zeros(0, dtype=np.uint64))
        self.rows = np.zeros((self.index.key_capacity, spec.width), dtype=np.float32)
        self.init_kind = kinit.KINDS[spec.init]
        self.new_state = spec.opt.new_state(spec.dim, spec.params)  # a new row's optimizer state
        # keys whose initial values are given (a regression's bias at the label mean)
        self.init_keys = [(np.uint64(k), np.asarray(v, dtype=np.float32)) for k, v in spec.init_keys]
        # worker -> [(keys, slots, index)] of its last RESOLVED_PULLS pulls, newest first: the push
        # of the same keys that follows (the next step of a push-pull, or with train.pull_early the
        # step after the next batch's pull) takes those slots instead of looking the keys up again
        self.resolved: dict[int, list] = {}
        self.reused = 0  # keys of pushes whose slots came from a pull before
        self.changed: np.ndarray | None = None  # a mark per slot: changed since the last snapshot
        self.removed: list[np.ndarray] = []  # keys removed since the last snapshot

    # -- the index -----------------------------------------------------------------------------

    def _new_index(self, keys: np.ndarray, own: bool = False):
        """Direct addressing for a bounded key space once the table holds enough keys to pay for
        it (:meth:`_direct_now`), else a hash index (``own``: :meth:`KeyIndex.from_keys`)."""
        if self._direct_now(keys.shape[0]):
            return DirectKeyIndex.from_keys(keys, self.spec.key_bits)
        return KeyIndex.from_keys(keys, own)

    def _direct_now(self, n: int) -> bool:
        """Whether a table of ``n`` keys is addressed directly: a bounded key space whose direct
        array is small (at most ``DIRECT_AT_ONCE_BITS``), or one that holds ``2**key_bits /
        2**DIRECT_FROM_SHIFT`` keys (64 k at 24 bits). Below that a hash index costs less: the
        direct array (64 MiB at 24 bits) is written through when made, which costs a tuning run
        (an index per member and per fold) most of its time, and its memory."""
        bits = self.spec.key_bits
        return self.spec.direct and (bits <= DIRECT_AT_ONCE_BITS or n >= 1 << (bits - DIRECT_FROM_SHIFT))

    def _go_direct_when_due(self) -> None:
        """A hash-indexed table of a bounded key space that has grown enough goes direct: the
        same slots (the rows stay where they are)."""
        if not isinstance(self.index, DirectKeyIndex) and self._direct_now(self.index.size):
            n = self.index.size
            self.index = DirectKeyIndex.from_keys(self.index.keys[:n].copy(), self.spec.key_bits)

    @property
    def size(self) -> int:
        return self.index.size

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slots of ``keys`` (-1: absent)."""
        return self.index.lookup(keys)

    def lookup_or_insert(self, keys: np.ndarray) -> np.ndarray:
        """The slots of ``keys``, inserting the absent ones (their rows: :meth:`create_rows`)."""
        return self.index.lookup_or_insert(keys)

    # -- reads and updates -----------------------------------------------------------------------

    def pull(self, keys: np.ndarray, out: np.ndarray, threads: TwoThreads | None = None) -> np.ndarray:
        """Values of ``keys`` into ``out`` (n, dim), the initializer's for absent keys; returns
        their slots (-1: absent). The lookups and the rows' values in one pass, either index."""
        s = self.spec
        slots, absent = kfused.index_pull(self.index, keys, self.rows, s.dim, self.init_kind, s.init_scale, s.seed,
                                          out, threads)
        if absent and self.init_keys:
            given_initial_values(self.init_keys, keys, slots, out)
        return slots

    def push_in_one_pass(self, keys: np.ndarray, grads: np.ndarray, rule: int, params: tuple,
                         slots: np.ndarray, threads: TwoThreads | None = None) -> np.ndarray:
        """Look up ``keys`` and apply a built-in rule to their rows in one pass, up to the first
        absent key (of each half); returns the positions not done (the others' slots are in
        ``slots``)."""
        return kfused.index_push(self.index, keys, self.rows, grads, rule, params, slots, threads)

    def create_rows(self, keys: np.ndarray, slots: np.ndarray, first_new: int) -> int:
        """Room and initial values for the rows of the keys inserted since the store held
        ``first_new`` keys (slots from ``first_new`` on), and a direct index once it is due;
        returns how many there are."""
        self._room_for_rows(first_new)
        added = self.index.size - first_new
        if added:
            s = self.spec
            kinit.create_rows(self.rows, slots, keys, first_new, s.dim, self.init_kind, s.init_scale, s.seed,
                              self.new_state)
            for key, values in self.init_keys:
                self.rows[slots[(keys == key) & (slots >= first_new)], :s.dim] = values
            self._go_direct_when_due()  # (the same slots: the rows stay where they are)
        return added

    def _room_for_rows(self, first_new: int) -> None:
        """Rows (and change marks) for every slot the index has room for, keeping the first ``first_new``."""
        if self.index.key_capacity > self.rows.shape[0]:
            rows = np.zeros((self.index.key_capacity, self.spec.width), dtype=np.float32)
            rows[:first_new] = self.rows[:first_new]
            self.rows = rows
            if self.changed is not None:
                changed = np.zeros(rows.shape[0], dtype=np.bool_)
                changed[:first_new] = self.changed[:first_new]
                self.changed = changed

    def put_rows(self, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Give ``keys`` (unique; a delta snapshot's, restored: mostly in slot order) the rows ``rows``:
        a key held gets its row replaced, a new key a slot after the others; returns their slots."""
        first_new = self.index.size
        slots = self.index.lookup_or_insert_in_slot_order(np.ascontiguousarray(keys, dtype=np.uint64))
        self._room_for_rows(first_new)
        self.rows[slots] = rows
        self._go_direct_when_due()  # (the same slots)
        return slots

    # -- slots of the pulls before a push --------------------------------------------------------

    def remember_pull(self, worker: int, keys: np.ndarray, slots: np.ndarray) -> None:
        """Keep the slots a pull by ``worker`` resolved, for its push of the same keys."""
        self.resolved[worker] = [(keys, slots, self.index)] + self.resolved.get(worker, [])[:RESOLVED_PULLS - 1]

    def slots_of_pull(self, keys: np.ndarray, worker: int) -> np.ndarray | None:
        """The slots of a push's keys that one of ``worker``'s last pulls resolved, inserting the
        keys absent then; None when none of those pulls was of the same keys. Its slots stand
        when no row has moved since (rows move only when the index is rebuilt: eviction,
        loading); only the keys absent then are looked up again (a push since, this worker's or
        another's, may have inserted them)."""
        pulls = self.resolved.get(worker) if worker >= 0 else None
        if not pulls:
            return None
        absent = np.empty(keys.shape[0], dtype=np.int64)
        i, m = find_pull(pulls, self.index, keys, absent)
        if i < 0:
            return None
        slots = pulls.pop(i)[1]  # the pull's own array, used by nothing else now: completed in place
        if m:
            absent = absent[:m]
            slots[absent] = self.index.lookup_or_insert(keys[absent])
        self.reused += keys.shape[0] - m
        return slots

    # -- contents ------------------------------------------------------------------------------

    def load(self, keys: np.ndarray, rows: np.ndarray, own: bool = False) -> None:
        """Replace the contents with ``keys`` and their rows (a new index: the rows may move).
        While changes are tracked, the changed rows kept stay marked, and the keys gone are
        remembered as removed (an eviction). ``own``: ``keys`` and ``rows`` are the caller's to give
        away (a restore's, read for this): kept as the index's keys and the store's rows when they
        have their shape, not copied."""
        old_keys, old_changed = (self.items()[0], self.changed) if self.changed is not None else (None, None)
        self.index = self._new_index(np.ascontiguousarray(keys, dtype=np.uint64), own)
        shape = (self.index.key_capacity, self.spec.width)
        if own and rows.shape == shape and rows.dtype == np.float32 and rows.flags.c_contiguous and rows.flags.writeable:
            self.rows = rows
        else:
            self.rows = np.zeros(shape, dtype=np.float32)
            self.rows[: keys.shape[0]] = rows
        if old_keys is not None:
            self.changed = np.zeros(self.rows.shape[0], dtype=np.bool_)
            slots = self.index.lookup(old_keys)
            self.removed.append(old_keys[slots < 0].copy())
            kept_changed = slots[old_changed[: old_keys.shape[0]] & (slots >= 0)]
            self.changed[kept_changed] = True

    # -- changes since the last snapshot ---------------------------------------------------------

    def track_changes(self) -> None:
        """From now on, mark the rows changed and remember the keys removed (nothing yet)."""
        self.changed = np.zeros(self.rows.shape[0], dtype=np.bool_)
        self.removed = []

    def mark_changed(self, slots: np.ndarray, not_done: np.ndarray | None = None) -> None:
        """The rows at ``slots`` (but the positions ``not_done``) were changed."""
        if self.changed is None:
            return
        if not_done is not None and not_done.shape[0]:
            slots = np.delete(slots, not_done)
        self.changed[slots] = True

    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, rows, slots) of the rows changed since the last call (copies), and the keys
        removed since and not stored now; the marks start again from none."""
        n = self.index.size
        slots = np.flatnonzero(self.changed[:n])
        keys, rows = self.index.keys[:n][slots], np.take(self.rows, slots, axis=0)
        removed = np.unique(np.concatenate(self.removed)) if self.removed else np.zeros(0, dtype=np.uint64)
        if removed.shape[0]:
            removed = removed[self.index.lookup(removed) < 0]  # (a key removed, then stored again: in keys)
        self.changed[:] = False
        self.removed = []
        return keys, rows, slots, removed

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of everything stored, in slot order (views)."""
        n = self.index.size
        return self.index.keys[:n], self.rows[:n]

    def nbytes(self) -> int:
        return self.index.nbytes() + self.rows.nbytes
