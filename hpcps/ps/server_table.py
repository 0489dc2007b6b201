"""One table's shard on a server: its rows (:mod:`hpcps.ps.store`), its admission, eviction and
memory budget (:mod:`hpcps.ps.policies`) and its optimizer, composed (pure: no MPI).

A push finds its keys' slots in one of three ways, chosen in one place (:meth:`ServerTable.push`):
the slots a pull of the same keys by the same worker resolved (a push-pull's next push; with the
keys the next pull reads marked, the others are updated after the reply); with a built-in
one-pass rule, one kernel that looks each key up and updates its row (up to the first key without
a row; :mod:`hpcps_kernels.fused`, either index); else a lookup (inserting new keys) and then the
rule's kernel.
"""

from __future__ import annotations

import numpy as np

from hpcps.ps.policies import RowPolicies
from hpcps.ps.store import RowStore
from hpcps.ps.tables import TableSpec
from hpcps_kernels import keys as kkeys
from hpcps_kernels.parallel import TwoThreads
from hpcps_kernels.tuning import FINITE_CHECK_VALUES


class NonFiniteTable(RuntimeError):
    """A table holds a NaN or infinite number where a checkpoint or a model would be written from
    it: nothing is written (the last good checkpoint stays the newest)."""

    exit_status = 1  # a run-time failure (see hpcps.errors)




def count_non_finite_rows(rows: np.ndarray) -> int:
    """How many rows of ``rows`` (2-d) hold a NaN or an infinity, checked in chunks."""
    bad = 0
    step = max(1, FINITE_CHECK_VALUES // max(rows.shape[1], 1))
    for lo in range(0, rows.shape[0], step):
        bad += int((~np.isfinite(rows[lo:lo + step])).any(axis=1).sum())
    return bad


class ServerTable:
    """One table's shard on this server."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.features = spec.features
        self.store = RowStore(spec)
        self.policies = RowPolicies(spec, self.store)
        self.opt = spec.opt
        # a push whose slots no pull resolved looks its keys up and updates their rows in one pass
        # when the rule is a built-in one-pass rule (-1: two kernels)
        self.fused = self.opt.fused_rule(spec.dim)
        self.fused_params = self.opt.fused_params(spec.params)
        self.rule_args = self.opt.kernel_args(spec.params)  # the rule kernel's hyper-parameters
        self.threads: TwoThreads | None = None  # large requests' halves at once (set by the Server)
        self._snapshot: tuple | None = None  # early stopping's best model so far (snapshot)

    @property
    def index(self):
        return self.store.index

    @property
    def size(self) -> int:
        return self.store.size

    @property
    def reused(self) -> int:
        return self.store.reused

    @property
    def admitted(self) -> int:
        return self.policies.admitted

    @property
    def evicted(self) -> int:
        return self.policies.evicted

    @property
    def last(self) -> np.ndarray | None:
        """Each row's last update (by slot), when rows may be evicted."""
        return self.policies.eviction.last if self.policies.eviction is not None else None

    def counts(self) -> tuple[int, int, int]:
        """(rows held, keys admitted, rows evicted): what every reply about the table carries."""
        return self.store.index.size, self.policies.admitted, self.policies.evicted

    @property
    def max_keys(self) -> int:
        """The rows the memory budget allows (0: no budget)."""
        return self.policies.budget.max_keys if self.policies.budget is not None else 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of everything stored, in slot order (views)."""
        return self.store.items()

    def pull(self, keys: np.ndarray, out: np.ndarray, worker: int = -1) -> None:
        """Values of ``keys`` into ``out`` (n, dim); ``worker``: who pulls, whose next push of
        the same keys reuses their slots (see :meth:`RowStore.slots_of_pull`)."""
        slots = self.store.pull(keys, out, self.threads)
        if worker >= 0 and self.policies.reuses_slots:
            self.store.remember_pull(worker, keys, slots)

    # -- pushes ----------------------------------------------------------------------------------

    def push(self, keys: np.ndarray, grads: np.ndarray, clock: int = 0, worker: int = -1,
             in_pull: np.ndarray | None = None) -> tuple | None:
        """Apply one update per key (keys unique within a push) at ``clock``; ``worker``: who
        pushes (see :meth:`RowStore.slots_of_pull`).

        ``in_pull``: a bit per key (``protocol.IN_PULL``), set where the key is read by the pull
        served next. The keys whose bit is set are updated now, the others are returned, as
        ``(slots, grads)`` for :meth:`apply_after_reply`, when the push takes its slots from a
        pull before it and the table does not age its rows (else everything is applied now and
        None returned). A rule updates each row on its own, so the rows end the same, bit for
        bit, once the rest is applied before anything else reads or updates the table."""
        if self.policies.filters_keys:
            keys, grads = self.policies.keys_given_rows(keys, grads, clock)
            if keys.shape[0] == 0:
                return None
        store = self.store
        first_new = store.index.size
        slots = store.slots_of_pull(keys, worker) if worker in store.resolved else None
        if slots is not None and in_pull is not None and self.policies.eviction is None:
            return self._push_pulled_part_first(keys, grads, slots, first_new, in_pull)
        if slots is not None:
            return self._push_to_slots(keys, grads, slots, first_new, clock)
        if self.fused >= 0:
            return self._push_in_one_pass(keys, grads, first_new, clock)
        return self._push_to_slots(keys, grads, store.lookup_or_insert(keys), first_new, clock)

    # (the pushes' paths below call the policies and the change marks only when they are on: a
    # server's fixed cost per request is mostly such Python calls)

    def _rows_created(self, keys: np.ndarray, slots: np.ndarray, first_new: int) -> None:
        """Rows for the keys ``slots`` inserted (those from ``first_new`` on), if any."""
        if self.store.index.size > first_new:
            self.policies.rows_created(self.store.create_rows(keys, slots, first_new), first_new)

    def _updated(self, slots: np.ndarray, clock: int, not_done: np.ndarray | None = None) -> None:
        """The rows at ``slots`` (but the positions ``not_done``) were updated at ``clock``."""
        if self.policies.eviction is not None:
            self.policies.touch(slots, clock, not_done)
        if self.store.changed is not None:
            self.store.mark_changed(slots, not_done)

    def _push_to_slots(self, keys: np.ndarray, grads: np.ndarray, slots: np.ndarray, first_new: int,
                       clock: int) -> None:
        """The rule over the rows at ``slots`` (those from ``first_new`` on created first)."""
        self._rows_created(keys, slots, first_new)
        self.opt.run(self.store.rows, slots, grads, self.rule_args, self.threads)
        self._updated(slots, clock)
        return None

    def _push_in_one_pass(self, keys: np.ndarray, grads: np.ndarray, first_new: int, clock: int) -> None:
        """Lookups and updates in one pass, up to the first absent key; the rest looked up (new
        keys inserted) and updated by the rule's kernel."""
        slots = np.empty(keys.shape[0], dtype=np.int64)
        todo = self.store.push_in_one_pass(keys, grads, self.fused, self.fused_params, slots, self.threads)
        self._updated(slots, clock, todo)
        if todo.shape[0] == 0:
            return None
        keys, grads = keys[todo], grads[todo]
        return self._push_to_slots(keys, grads, self.store.lookup_or_insert(keys), first_new, clock)

    def _push_pulled_part_first(self, keys: np.ndarray, grads: np.ndarray, slots: np.ndarray, first_new: int,
                                in_pull: np.ndarray) -> tuple | None:
        """The keys the next pull reads updated now; the others returned for :meth:`apply_after_reply`."""
        self._rows_created(keys, slots, first_new)
        self._updated(slots, 0)  # (the rest too: applied before anything reads the table; no eviction here)
        slots, grads, rest_slots, rest_grads = kkeys.split_by_bits(in_pull, slots, grads)
        self.opt.run(self.store.rows, slots, grads, self.rule_args, self.threads)
        return (rest_slots, rest_grads) if rest_slots.shape[0] else None

    def apply_after_reply(self, rest: tuple) -> None:
        """Apply the part of a push that :meth:`push` returned (once the pull's reply is gone)."""
        self.opt.run(self.store.rows, *rest, self.rule_args, self.threads)

    def evict_if_due(self, now: int) -> int:
        return self.policies.evict_if_due(now)

    def evict(self, clock: int) -> int:
        return self.policies.evict(clock)

    # -- contents --------------------------------------------------------------------------------

    def load(self, keys: np.ndarray, rows: np.ndarray, clock: int = 0, own: bool = False) -> None:
        """Replace the contents with ``keys`` and their rows, updated at ``clock`` (``own``: :meth:`RowStore.load`)."""
        self.store.load(keys, rows, own)
        if self.store.changed is not None:  # (while changes are tracked: every row; a restore tracks after)
            self.store.mark_changed(np.arange(self.store.size))
        self.policies.loaded(clock)

    def state_arrays(self) -> dict:
        """What a checkpoint keeps beside the rows (see :meth:`RowPolicies.state_arrays`)."""
        return self.policies.state_arrays()

    def restore_state(self, state: dict) -> None:
        """Put back what :meth:`state_arrays` saved (after :meth:`load` of the rows)."""
        self.policies.restore_state(state)

    def copy_contents(self) -> tuple:
        """A copy of the keys, their rows and their state, for :meth:`set_contents`."""
        keys, rows = self.items()
        return (keys.copy(), rows.copy(),
                {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self.state_arrays().items()})

    def set_contents(self, contents: tuple, clock: int = 0) -> None:
        """Replace the contents with a :meth:`copy_contents`."""
        keys, rows, state = contents
        self.load(keys, rows, clock)
        self.restore_state(state)

    def snapshot(self) -> None:
        """Keep a copy of the rows and their state (early stopping's best model so far)."""
        self._snapshot = self.copy_contents()

    def restore_snapshot(self) -> None:
        """Go back to the rows of the last :meth:`snapshot`."""
        self.set_contents(self._snapshot)

    def check_finite(self, what: str) -> None:
        """Raise :class:`NonFiniteTable` when a row (weights or optimizer state) is not finite,
        before ``what`` (a checkpoint, a model) is written from it: a pass over the rows, at a
        write only (steps check their loss; see hpcps.train.models.NonFiniteError)."""
        bad = count_non_finite_rows(self.items()[1])
        if bad:
            raise NonFiniteTable(f"table {self.spec.name!r} holds NaN or infinite numbers in {bad:,} of its "
                                 f"{self.size:,} rows here: no {what} is written from it (the last good checkpoint "
                                 f"is kept); likely cause: labels far out of range (squared loss) or too high a "
                                 f"learning rate")

    def nbytes(self) -> int:
        return self.store.nbytes() + self.policies.nbytes()
