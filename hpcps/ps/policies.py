"""Which keys a table shard gives a row and which rows it drops (pure: NumPy and the kernels).

Each policy is built from the table's :class:`~hpcps.ps.tables.Features` (see there for the
semantics), keeps its own state and says what a checkpoint keeps of it:

* :class:`Admission`: push counts of keys without a row, and a deterministic draw per key and
  clock; a key gets a row at its ``admit_count``-th push if the draw passes.
* :class:`Eviction`: each row's last update, and the rounds of eviction by age and norm.
* :class:`MemoryBudget`: how many rows fit ``server_memory_mb``, and which rows go (the least
  recently updated) when a push's new keys would pass it.

:class:`RowPolicies` holds those a table's features ask for and makes them act together on its
rows (an eviction drops rows from the store and clears their push counts).
"""

from __future__ import annotations

import numpy as np

from hpcps.ps.store import RowStore
from hpcps.ps.tables import Features, TableSpec
from hpcps_kernels import admission as kadmit

KEEP = np.iinfo(np.int64).max  # the age of a row a push updates: never the least recent


class Admission:
    """Push counts of the keys without a row: one exact counter per key when keys are addressed
    directly, else counters shared by hash (see :mod:`hpcps_kernels.admission`)."""

    def __init__(self, spec: TableSpec):
        f = self.features = spec.features
        self.direct = spec.direct
        self.exact_below = np.uint64(1 << spec.key_bits if spec.direct else 0)
        self.counts = np.zeros(1 << (spec.key_bits if spec.direct else f.count_bits), dtype=np.uint8)
        self.threshold = np.uint64(min(int(f.admit_probability * 2.0**64), 2**64 - 1))

    def admitted(self, keys: np.ndarray, absent: np.ndarray, clock: int) -> np.ndarray:
        """Of the ``absent`` keys (without a row), which get one now (the others' pushes count)."""
        new = keys[absent]
        admit = np.ones(new.shape[0], dtype=np.bool_)
        f = self.features
        if f.admit_count > 1:
            counts = np.empty(new.shape[0], dtype=np.uint8)
            kadmit.bump_counts(self.counts, new, self.exact_below, counts)
            admit &= counts >= f.admit_count
        if f.admit_probability < 1.0:
            draw = np.empty(new.shape[0], dtype=np.bool_)
            kadmit.admit_draw(new, clock, self.threshold, draw)
            admit &= draw
        return admit

    def forget(self, keys: np.ndarray) -> None:
        """Evicted keys count their pushes from zero again."""
        kadmit.clear_counts(self.counts, np.ascontiguousarray(keys), self.exact_below)

    def state_arrays(self) -> dict:
        """The counts that are not zero: by key (one counter per key), else by hash bucket."""
        nz = np.flatnonzero(self.counts)
        if self.direct:  # one counter per key: the positions are the keys
            return {"pending_keys": nz.astype(np.uint64), "pending_counts": self.counts[nz]}
        return {"count_buckets": nz.astype(np.uint64), "count_values": self.counts[nz]}

    def restore_state(self, state: dict) -> None:
        """Add the counts :meth:`state_arrays` saved (of one or several servers' files)."""
        for k, v in (("pending_keys", "pending_counts"), ("count_buckets", "count_values")):
            if k in state:
                idx = state[k].astype(np.int64) & (self.counts.shape[0] - 1)
                total = self.counts.astype(np.int64)
                np.add.at(total, idx, state[v].astype(np.int64))
                self.counts[:] = np.minimum(total, 255)

    def nbytes(self) -> int:
        return self.counts.nbytes


class Eviction:
    """Each row's last update (``last``, by slot), and the eviction by age and norm that runs
    every ``evict_every_steps`` clocks."""

    def __init__(self, features: Features, capacity: int):
        self.features = features
        self.last = np.zeros(capacity, dtype=np.int64)
        self.round = 0  # evict_every_steps periods of the slowest worker's clock done

    def due(self, now: int) -> bool:
        """Whether an eviction round is due at clock ``now`` (once per ``evict_every_steps``)."""
        if now // self.features.evict_every_steps > self.round:
            self.round = now // self.features.evict_every_steps
            return True
        return False

    def start_rounds_at(self, clock: int) -> None:
        """A run resumed at ``clock``: its rounds continue where the saved run's were."""
        self.round = clock // self.features.evict_every_steps

    def touch(self, slots: np.ndarray, clock: int) -> None:
        """The rows at ``slots`` were updated at ``clock``."""
        self.last[slots] = clock

    def grow(self, capacity: int, first_new: int) -> None:
        """Room for ``capacity`` rows, keeping the first ``first_new`` rows' ages."""
        if capacity > self.last.shape[0]:
            last = np.zeros(capacity, dtype=np.int64)
            last[:first_new] = self.last[:first_new]
            self.last = last

    def reset(self, capacity: int, clock: int, first_ages: np.ndarray | None = None) -> None:
        """New contents of ``capacity`` rows: each updated at ``clock``, but for the first ones
        whose last updates are ``first_ages`` (the rows an eviction left)."""
        self.last = np.full(capacity, clock, dtype=np.int64)
        if first_ages is not None:
            self.last[: first_ages.shape[0]] = first_ages

    def rows_to_drop(self, clock: int, size: int, rows: np.ndarray, dim: int) -> np.ndarray | None:
        """Of the first ``size`` rows, those not updated in the last ``evict_after_steps`` clocks
        and those whose parameters' L2 norm is below ``evict_l2_below``; None: neither rule is on."""
        f = self.features
        if not (f.evict_after_steps or f.evict_l2_below) or size == 0:
            return None
        drop = np.zeros(size, dtype=np.bool_)
        if f.evict_after_steps:
            drop |= clock - self.last[:size] >= f.evict_after_steps
        if f.evict_l2_below:
            w = rows[:size, :dim].astype(np.float64)
            drop |= np.sqrt((w * w).sum(axis=1)) < f.evict_l2_below
        return drop

    def state_arrays(self, size: int) -> dict:
        return {"last": self.last[:size]}

    def restore_state(self, state: dict, size: int) -> None:
        if "last" in state and state["last"].shape[0] == size:
            self.last[:size] = state["last"]

    def nbytes(self) -> int:
        return self.last.nbytes


class MemoryBudget:
    """The rows that fit ``server_memory_mb``: before a push would pass them, the least recently
    updated rows (not those it updates) are evicted, down to 90 % of them; new keys beyond the
    budget get no row."""

    def __init__(self, spec: TableSpec, fixed_bytes: int):
        self.max_keys = self._budget_keys(spec, fixed_bytes)

    @staticmethod
    def _budget_keys(spec: TableSpec, fixed: int) -> int:
        """How many rows fit: the ``fixed`` arrays (direct index, counters) first, then per key
        its row, key and age with the room the arrays keep to grow (x 1.5), and a hash index
        entry's share."""
        mb = spec.features.server_memory_mb
        per_key = 1.5 * (4 * spec.width + 8 + 8) + 24
        n = int((mb * 2**20 - fixed) / per_key)
        if n < 1024:
            raise ValueError(f"features.server_memory_mb = {mb:g} leaves room for {max(n, 0)} keys of table "
                             f"{spec.name!r} after its fixed arrays ({fixed / 2**20:.1f} MiB); give it more")
        return n

    def rows_to_drop(self, slots: np.ndarray, size: int, last: np.ndarray) -> np.ndarray | None:
        """The rows to evict before a push of keys at ``slots`` (-1: new) into a table of ``size``
        rows whose last updates are ``last``: None when the new keys fit."""
        n_new = int((slots < 0).sum())
        if size + n_new <= self.max_keys:
            return None
        age = last[:size].copy()
        age[slots[slots >= 0]] = KEEP  # this push's rows stay
        target = max(0, min(size, size + n_new - int(0.9 * self.max_keys)))
        drop = np.zeros(size, dtype=np.bool_)
        drop[np.argsort(age, kind="stable")[:target]] = True
        drop &= age != KEEP
        return drop

    def keys_that_fit(self, absent: np.ndarray, size: int) -> np.ndarray | None:
        """Which keys of a push (``absent``: new) fit a table of ``size`` rows: all but its last
        new keys when the push alone is larger than the budget (None: all)."""
        room = self.max_keys - size
        if int(absent.sum()) <= room:
            return None
        keep = ~absent
        keep[np.flatnonzero(absent)[:room]] = True
        return keep


class RowPolicies:
    """A table's admission, eviction and memory budget (each None when its features do not ask
    for it; a memory budget evicts, so it comes with an eviction), acting together on the
    table's :class:`~hpcps.ps.store.RowStore`; and the counts of keys admitted and rows evicted."""

    def __init__(self, spec: TableSpec, store: RowStore):
        f = spec.features
        self.spec = spec
        self.store = store
        self.admission = Admission(spec) if f.admission else None
        self.eviction = Eviction(f, store.rows.shape[0]) if f.eviction else None
        self.budget = None
        if f.server_memory_mb > 0:
            fixed = (self.admission.nbytes() if self.admission is not None else 0) + (
                4 << spec.key_bits if spec.direct else 0)  # (the direct index it will have)
            self.budget = MemoryBudget(spec, fixed)
        self.admitted = 0   # keys given a row
        self.evicted = 0    # rows evicted
        # a push may take the slots of a pull before it, unless admission or a budget may have
        # changed in between which keys have rows
        self.reuses_slots = self.admission is None and self.budget is None
        self.filters_keys = not self.reuses_slots  # whether a push's keys go through keys_given_rows


    # -- pushes ----------------------------------------------------------------------------------

    def keys_given_rows(self, keys: np.ndarray, grads: np.ndarray, clock: int) -> tuple:
        """The keys of a push that have or get a row, with their gradients: those admission
        admits, then those the memory budget has room for."""
        if self.admission is not None:
            keys, grads = self._admit(keys, grads, clock)
            if keys.shape[0] == 0:
                return keys, grads
        if self.budget is not None:
            keys, grads = self._make_room(keys, grads)
        return keys, grads

    def _admit(self, keys: np.ndarray, grads: np.ndarray, clock: int) -> tuple:
        """The keys of a push that have or get a row (with their gradients); the others count."""
        absent = self.store.lookup(keys) < 0
        if not absent.any():
            return keys, grads
        admit = self.admission.admitted(keys, absent, clock)
        self.admitted += int(admit.sum())
        if admit.all():
            return keys, grads
        keep = ~absent
        keep[np.flatnonzero(absent)[admit]] = True
        return keys[keep], grads[keep]

    def _make_room(self, keys: np.ndarray, grads: np.ndarray) -> tuple:
        """Evict the least recently updated rows (not those this push updates) so that the
        push's new keys fit the memory budget; new keys beyond it get no row."""
        slots = self.store.lookup(keys)
        drop = self.budget.rows_to_drop(slots, self.store.size, self.eviction.last)
        if drop is None:
            return keys, grads
        self._drop(drop)
        keep = self.budget.keys_that_fit(slots < 0, self.store.size)
        return (keys, grads) if keep is None else (keys[keep], grads[keep])

    def rows_created(self, added: int, first_new: int) -> None:
        """The store made rows for ``added`` keys from slot ``first_new`` on."""
        if self.eviction is not None:
            self.eviction.grow(self.store.rows.shape[0], first_new)
        if self.admission is None:
            self.admitted += added

    def touch(self, slots: np.ndarray, clock: int, not_done: np.ndarray | None = None) -> None:
        """The rows at ``slots`` (but the positions ``not_done``) were updated at ``clock``."""
        if self.eviction is not None:
            if not_done is not None:
                done = np.ones(slots.shape[0], dtype=np.bool_)
                done[not_done] = False
                slots = slots[done]
            self.eviction.touch(slots, clock)

    # -- eviction --------------------------------------------------------------------------------

    def evict_if_due(self, now: int) -> int:
        """At the slowest worker's clock ``now``: evict by age and norm if a round is due."""
        return self.evict(now) if self.eviction is not None and self.eviction.due(now) else 0

    def evict(self, clock: int) -> int:
        """Drop the rows not updated in the last ``evict_after_steps`` clocks and those whose
        parameters' L2 norm is below ``evict_l2_below``; returns how many."""
        if self.eviction is None:
            return 0
        drop = self.eviction.rows_to_drop(clock, self.store.size, self.store.rows, self.spec.dim)
        return 0 if drop is None else self._drop(drop)

    def _drop(self, drop: np.ndarray) -> int:
        """Evict the rows where ``drop`` (over slots) is set; returns how many."""
        gone = int(drop.sum())
        if gone:
            keys, rows = self.store.items()
            keep = ~drop
            if self.admission is not None:
                self.admission.forget(keys[drop])
            ages = self.eviction.last[: keys.shape[0]][keep].copy()
            self.store.load(keys[keep].copy(), rows[keep].copy())
            self.eviction.reset(self.store.rows.shape[0], 0, ages)
            self.evicted += gone
        return gone

    # -- contents --------------------------------------------------------------------------------

    def loaded(self, clock: int) -> None:
        """The store was given new contents: every row counts as updated at ``clock``."""
        if self.eviction is not None:
            self.eviction.reset(self.store.rows.shape[0], clock)

    def resumed_at(self, clock: int) -> None:
        """A checkpoint of ``clock`` was restored: eviction rounds go on from it."""
        if self.eviction is not None:
            self.eviction.start_rounds_at(clock)

    def state_arrays(self) -> dict:
        """What a checkpoint keeps for exact resume: each row's last update, the push counts of
        keys without a row, and the admitted and evicted counters (nothing without admission or
        eviction)."""
        if self.admission is None and self.eviction is None:
            return {}
        out: dict = {"admitted": self.admitted, "evicted": self.evicted}
        if self.eviction is not None:
            out.update(self.eviction.state_arrays(self.store.size))
        if self.admission is not None:
            out.update(self.admission.state_arrays())
        return out

    def restore_state(self, state: dict) -> None:
        """Put back what :meth:`state_arrays` saved (after the store's rows were loaded)."""
        self.admitted = int(state.get("admitted", self.store.size))
        self.evicted = int(state.get("evicted", 0))
        if self.eviction is not None:
            self.eviction.restore_state(state, self.store.size)
        if self.admission is not None:
            self.admission.restore_state(state)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in (self.admission, self.eviction) if p is not None)
