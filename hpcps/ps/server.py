"""The server side: table shards, optimizers, worker clocks and the serving loop.

A server rank owns, for every declared table, the keys of the virtual shards placed on it
(:mod:`hpcps.ps.placement`). Each table shard is a key → slot index plus a float32 array of slot rows
``[parameters | optimizer state]``. The index is a
:class:`~hpcps_kernels.directindex.DirectKeyIndex` (one array lookup per key) when the table's
keys are bounded (``key_bits`` <= 26: hashed features) and the shard holds enough of them
(from 2**(key_bits - 8) keys: the same slots), else a :class:`~hpcps_kernels.hashtable.KeyIndex`
(any uint64 keys). A push finds its keys' slots in one of three ways: the slots a pull of the
same keys by the same worker resolved (a push-pull's next push); on a direct index with a
built-in one-pass rule, one kernel that looks each key up and updates its row (up to the first
key without a row); else a lookup (inserting new keys) and then the rule's kernel.

Semantics a worker can rely on:

* A pull of a key never pushed returns the table's initializer for that key and creates nothing.
* A push creates missing keys (initializer, then the update) and applies the optimizer to each
  key once per push: the client merges duplicate keys by summing their gradients before sending.
* Requests from one worker are applied in the order it sent them.
* Consistency: the server knows every worker's clock. A pull sent at clock ``c`` is answered only
  once every worker has clocked at least ``c - staleness`` (BSP: staleness 0; ASP: staleness < 0,
  never waits). A worker sends its pushes before its clock message, so under BSP a pull sees
  exactly the updates of all earlier iterations.
* Determinism under BSP: pushes are acknowledged on arrival but applied, once every worker has
  passed their clock, in the order (clock, worker, sequence), so the result never depends on
  which message arrived first (with FTRL or AdaGrad the order changes the numbers, not only
  their rounding). A push is thus not visible to pulls of its own iteration. Under SSP and ASP
  pushes are applied on arrival.

The loop never spins: it polls for requests and sleeps between polls with an exponential
back-off (:mod:`hpcps.ps.transport`), so an idle server costs almost no CPU.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from hpcps.ps import checkpoint, protocol, signals, transport
from hpcps.ps.placement import Placement
from hpcps.ps.tables import (DIRECT_AT_ONCE_BITS, DIRECT_FROM_SHIFT, MARGINS_FUNCTION, RESIDUALS_FUNCTION,
                              SERVER_FUNCTIONS, ServerFunction, TableSpec)
from hpcps_kernels import admission as kadmit
from hpcps_kernels import init as kinit
from hpcps_kernels import keys as kkeys
from hpcps_kernels.directindex import DirectKeyIndex
from hpcps_kernels.hashtable import KeyIndex
from hpcps_kernels.parallel import TwoThreads, run_split

# a checkpoint write that fails late, in HDF5's release of the file's objects, says so in one line
transport.EXPLAINERS.append(checkpoint.explain_write_failure)


# Pulls whose slots a server keeps per worker and table for the pushes of the same keys: 2, the
# last pull and the one before it, which train.pull_early's push follows (the next batch's pull
# goes before this batch's push).
RESOLVED_PULLS = 2


class NonFiniteTable(RuntimeError):
    """A table holds a NaN or infinite number where a checkpoint or a model would be written from
    it: nothing is written (the last good checkpoint stays the newest)."""

    exit_status = 1  # a run-time failure (see hpcps.errors)


FINITE_CHUNK = 1 << 20  # numbers checked at once (no temporary array the size of a table)


def count_non_finite_rows(rows: np.ndarray) -> int:
    """How many rows of ``rows`` (2-d) hold a NaN or an infinity, checked in chunks."""
    bad = 0
    step = max(1, FINITE_CHUNK // max(rows.shape[1], 1))
    for lo in range(0, rows.shape[0], step):
        bad += int((~np.isfinite(rows[lo:lo + step])).any(axis=1).sum())
    return bad


class ServerTable:
    """One table's shard on this server."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.index = self._new_index(np.zeros(0, dtype=np.uint64))
        self.rows = np.zeros((self.index.key_capacity, spec.width), dtype=np.float32)
        self.kind = kinit.KINDS[spec.init]
        self.opt = spec.opt
        self.state = self.opt.new_state(spec.dim, spec.params)
        # a push whose slots no pull resolved looks its keys up and updates their rows in one pass
        # when the index is direct and the rule is a built-in one-pass rule (-1: two kernels)
        self.fused = self.opt.fused_rule(spec.dim)
        self.fused_params = self.opt.fused_params(spec.params)
        f = self.features = spec.features
        # admission: push counts of keys without a row (one exact counter per key when keys are
        # addressed directly, else counters shared by hash; see hpcps_kernels.admission)
        self.exact_below = np.uint64(1 << spec.key_bits if spec.direct else 0)
        self.counts = (np.zeros(1 << (spec.key_bits if spec.direct else f.count_bits), dtype=np.uint8)
                       if f.admission else None)
        self.threshold = np.uint64(min(int(f.admit_probability * 2.0**64), 2**64 - 1))
        # eviction: the clock of each row's last update
        self.last = np.zeros(self.rows.shape[0], dtype=np.int64) if f.eviction else None
        self.admitted = 0   # keys given a row
        self.evicted = 0    # rows evicted
        self.max_keys = self._budget_keys() if f.server_memory_mb > 0 else 0
        # keys whose initial values are given (a regression's bias at the label mean)
        self.init_keys = [(np.uint64(k), np.asarray(v, dtype=np.float32)) for k, v in spec.init_keys]
        # worker -> [(keys, slots, index)] of its last RESOLVED_PULLS pulls, newest first: the push
        # of the same keys that follows (the next step of a push-pull, or with train.pull_early the
        # step after the next batch's pull) takes those slots instead of looking the keys up again
        self.resolved: dict[int, list] = {}
        self.reused = 0  # keys of pushes whose slots came from the pull before
        self.threads: TwoThreads | None = None  # large requests' halves at once (set by the Server)

    def _budget_keys(self) -> int:
        """How many rows fit ``server_memory_mb``: the fixed arrays (direct index, counters)
        first, then per key its row, key and age with the room the arrays keep to grow (x 1.5),
        and a hash index entry's share."""
        budget = self.features.server_memory_mb * 2**20
        fixed = (self.counts.nbytes if self.counts is not None else 0) + (
            4 << self.spec.key_bits if self.spec.direct else 0)  # (the direct index it will have)
        per_key = 1.5 * (4 * self.spec.width + 8 + 8) + 24
        n = int((budget - fixed) / per_key)
        if n < 1024:
            raise ValueError(f"features.server_memory_mb = {self.features.server_memory_mb:g} leaves room for "
                             f"{max(n, 0)} keys of table {self.spec.name!r} after its fixed arrays "
                             f"({fixed / 2**20:.1f} MiB); give it more")
        return n

    def _make_room(self, keys: np.ndarray, grads: np.ndarray, clock: int):
        """Under a memory budget: evict the least recently updated rows (not those this push
        updates) so that the push's new keys fit; new keys beyond the budget get no row."""
        slots = self.index.lookup(keys)
        absent = slots < 0
        n_new = int(absent.sum())
        if self.index.size + n_new <= self.max_keys:
            return keys, grads
        n = self.index.size
        age = self.last[:n].copy()
        age[slots[~absent]] = np.iinfo(np.int64).max  # this push's rows stay
        target = max(0, min(n, n + n_new - int(0.9 * self.max_keys)))
        drop = np.zeros(n, dtype=np.bool_)
        drop[np.argsort(age, kind="stable")[:target]] = True
        drop &= age != np.iinfo(np.int64).max
        self._drop(drop)
        room = self.max_keys - self.index.size
        if n_new > room:  # a push larger than the budget: its last new keys get no row
            keep = ~absent
            keep[np.flatnonzero(absent)[:room]] = True
            keys, grads = keys[keep], grads[keep]
        return keys, grads

    def _drop(self, drop: np.ndarray) -> int:
        """Evict the rows where ``drop`` (over slots) is set; returns how many."""
        gone = int(drop.sum())
        if gone:
            keys, rows = self.items()
            keep = ~drop
            if self.counts is not None:
                kadmit.clear_counts(self.counts, np.ascontiguousarray(keys[drop]), self.exact_below)
            last = self.last[: keys.shape[0]][keep].copy()
            self.load(keys[keep].copy(), rows[keep].copy())
            self.last[: last.shape[0]] = last
            self.evicted += gone
        return gone

    def _new_index(self, keys: np.ndarray):
        """Direct addressing for a bounded key space once the table holds enough keys to pay for
        it (:meth:`_direct_now`), else a hash index."""
        if self._direct_now(keys.shape[0]):
            return DirectKeyIndex.from_keys(keys, self.spec.key_bits)
        return KeyIndex.from_keys(keys)

    def _direct_now(self, n: int) -> bool:
        """Whether a table of ``n`` keys is addressed directly: a bounded key space whose direct
        array is small (at most ``DIRECT_AT_ONCE_BITS``), or one that holds ``2**key_bits /
        2**DIRECT_FROM_SHIFT`` keys (64 k at 24 bits). Below that a hash index costs less: the
        direct array (64 MiB at 24 bits) is written through when made, 2 s of a 10 s ``hpcps
        tune`` of 18 members on 3,000 rows (an index per member and per fold), and 1.2 GiB."""
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

    def pull(self, keys: np.ndarray, out: np.ndarray, worker: int = -1) -> None:
        """Values of ``keys`` into ``out`` (n, dim); ``worker``: who pulls, whose next push of
        the same keys reuses their slots (see :meth:`_reused_slots`)."""
        s = self.spec
        if isinstance(self.index, DirectKeyIndex):  # lookup and gather in one pass
            slots = self.index.pull(keys, self.rows, s.dim, self.kind, s.init_scale, s.seed, out, self.threads)
        else:
            slots = self.index.lookup(keys)
            run_split(self.threads, keys.shape[0], lambda lo, hi: kinit.pull_rows(
                self.rows, slots[lo:hi], keys[lo:hi], s.dim, self.kind, s.init_scale, s.seed, out[lo:hi]),
                s.dim, pull=True)
        for key, values in self.init_keys:  # absent keys with given initial values
            out[(keys == key) & (slots < 0)] = values
        if worker >= 0 and self.counts is None and not self.max_keys:
            self.resolved[worker] = [(keys, slots, self.index)] + self.resolved.get(worker, [])[:RESOLVED_PULLS - 1]

    def _reused_slots(self, keys: np.ndarray, worker: int) -> np.ndarray | None:
        """The slots of a push's keys that one of ``worker``'s last pulls resolved, inserting the
        keys absent then; None when none of those pulls was of the same keys. Its slots stand
        when no row has moved since (rows move only when the index is rebuilt: eviction,
        loading); only the keys absent then are looked up again (a push since, this worker's or
        another's, may have inserted them)."""
        absent = np.empty(keys.shape[0], dtype=np.int64)
        for i, (got_keys, got_slots, index) in enumerate(self.resolved.get(worker, []) if worker >= 0 else []):
            m = kkeys.reusable_slots(got_keys, got_slots, keys, absent) if index is self.index else -1
            if m >= 0:
                del self.resolved[worker][i]
                break
        else:
            return None
        slots = got_slots  # the pull's own array, used by nothing else now: completed in place
        if m:
            absent = absent[:m]
            slots[absent] = self.index.lookup_or_insert(keys[absent])
        self.reused += keys.shape[0] - m
        return slots

    def _admit(self, keys: np.ndarray, grads: np.ndarray, clock: int):
        """The keys of a push that have or get a row (with their gradients); the others count."""
        absent = self.index.lookup(keys) < 0
        if not absent.any():
            return keys, grads
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
        self.admitted += int(admit.sum())
        if admit.all():
            return keys, grads
        keep = ~absent
        keep[np.flatnonzero(absent)[admit]] = True
        return keys[keep], grads[keep]

    def push(self, keys: np.ndarray, grads: np.ndarray, clock: int = 0, worker: int = -1,
             in_pull: np.ndarray | None = None) -> tuple | None:
        """Apply one update per key (keys unique within a push) at ``clock``; ``worker``: who
        pushes (see :meth:`_reused_slots`).

        ``in_pull``: a bit per key (``protocol.IN_PULL``), set where the key is read by the pull
        served next. The keys whose bit is set are updated now, the others are returned, as
        ``(slots, grads)`` for :meth:`apply_after_reply`, when the push takes its slots from a pull
        before it and the table neither ages nor admits rows (else everything is applied now and
        None returned). A rule updates each row on its own, so the rows end the same, bit for bit,
        once the rest is applied before anything else reads or updates the table."""
        s = self.spec
        if self.counts is not None:
            keys, grads = self._admit(keys, grads, clock)
            if keys.shape[0] == 0:
                return
        if self.max_keys:
            keys, grads = self._make_room(keys, grads, clock)
        first_new = self.index.size
        slots = self._reused_slots(keys, worker)
        reused = slots is not None
        if slots is None and self.fused >= 0 and isinstance(self.index, DirectKeyIndex):
            # lookups and updates in one pass, up to the first absent key (the rest go below)
            slots = np.empty(keys.shape[0], dtype=np.int64)
            todo = self.index.push(keys, self.rows, grads, self.fused, self.fused_params, slots, self.threads)
            if self.last is not None:
                done = np.ones(keys.shape[0], dtype=np.bool_)
                done[todo] = False
                self.last[slots[done]] = clock
            if todo.shape[0] == 0:
                return
            keys, grads, slots = keys[todo], grads[todo], None
        if slots is None:
            slots = self.index.lookup_or_insert(keys)
        if self.index.key_capacity > self.rows.shape[0]:
            rows = np.zeros((self.index.key_capacity, s.width), dtype=np.float32)
            rows[:first_new] = self.rows[:first_new]
            self.rows = rows
            if self.last is not None:
                last = np.zeros(self.rows.shape[0], dtype=np.int64)
                last[:first_new] = self.last[:first_new]
                self.last = last
        if self.index.size > first_new:
            kinit.create_rows(self.rows, slots, keys, first_new, s.dim, self.kind, s.init_scale, s.seed, self.state)
            for key, values in self.init_keys:
                self.rows[slots[(keys == key) & (slots >= first_new)], :s.dim] = values
            if self.counts is None:
                self.admitted += self.index.size - first_new
        rest = None
        if in_pull is not None and reused and self.last is None:
            slots, grads, rest_slots, rest_grads = kkeys.split_by_bits(in_pull, slots, grads)
            rest = (rest_slots, rest_grads) if rest_slots.shape[0] else None
        self.opt.apply(self.rows, slots, grads, s.params, self.threads)
        if self.last is not None:
            self.last[slots] = clock
        if self.index.size > first_new:
            self._go_direct_when_due()  # (the same slots: the rows stay where they are)
        return rest

    def apply_after_reply(self, rest: tuple) -> None:
        """Apply the part of a push that :meth:`push` returned (once the pull's reply is gone)."""
        self.opt.apply(self.rows, *rest, self.spec.params, self.threads)

    def evict(self, clock: int) -> int:
        """Drop the rows not updated in the last ``evict_after_steps`` clocks and those whose
        parameters' L2 norm is below ``evict_l2_below``; returns how many."""
        f = self.features
        n = self.index.size
        if not (f.evict_after_steps or f.evict_l2_below) or n == 0:
            return 0
        drop = np.zeros(n, dtype=np.bool_)
        if f.evict_after_steps:
            drop |= clock - self.last[:n] >= f.evict_after_steps
        if f.evict_l2_below:
            w = self.rows[:n, :self.spec.dim].astype(np.float64)
            drop |= np.sqrt((w * w).sum(axis=1)) < f.evict_l2_below
        return self._drop(drop)

    def load(self, keys: np.ndarray, rows: np.ndarray, clock: int = 0) -> None:
        """Replace the contents with ``keys`` and their rows (restoring a checkpoint: every row
        counts as updated at ``clock``)."""
        self.index = self._new_index(np.ascontiguousarray(keys, dtype=np.uint64))
        self.rows = np.zeros((self.index.key_capacity, self.spec.width), dtype=np.float32)
        self.rows[: keys.shape[0]] = rows
        if self.last is not None:
            self.last = np.full(self.rows.shape[0], clock, dtype=np.int64)

    def state_arrays(self) -> dict:
        """What a checkpoint keeps beside the rows for exact resume: each row's last update,
        the push counts of keys without a row, and the admitted and evicted counters (nothing
        for a table without admission or eviction)."""
        if self.counts is None and self.last is None:
            return {}
        out: dict = {"admitted": self.admitted, "evicted": self.evicted}
        if self.last is not None:
            out["last"] = self.last[: self.index.size]
        if self.counts is not None:
            nz = np.flatnonzero(self.counts)
            if self.spec.direct:  # one counter per key: the positions are the keys
                out["pending_keys"], out["pending_counts"] = nz.astype(np.uint64), self.counts[nz]
            else:                 # counters shared by hash: positions only
                out["count_buckets"], out["count_values"] = nz.astype(np.uint64), self.counts[nz]
        return out

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

    def restore_state(self, state: dict) -> None:
        """Put back what :meth:`state_arrays` saved (after :meth:`load` of the rows)."""
        self.admitted = int(state.get("admitted", self.index.size))
        self.evicted = int(state.get("evicted", 0))
        if self.last is not None and "last" in state and state["last"].shape[0] == self.index.size:
            self.last[: self.index.size] = state["last"]
        if self.counts is not None:
            for k, v in (("pending_keys", "pending_counts"), ("count_buckets", "count_values")):
                if k in state:
                    idx = state[k].astype(np.int64) & (self.counts.shape[0] - 1)
                    total = self.counts.astype(np.int64)
                    np.add.at(total, idx, state[v].astype(np.int64))
                    self.counts[:] = np.minimum(total, 255)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of everything stored, in slot order (views)."""
        n = self.index.size
        return self.index.keys[:n], self.rows[:n]

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
        extra = (self.counts.nbytes if self.counts is not None else 0) + (self.last.nbytes if self.last is not None else 0)
        return self.index.nbytes() + self.rows.nbytes + extra


def server_threads() -> TwoThreads | None:
    """Whether a server runs the halves of a large push or pull at once (``HPCPS_SERVER_THREADS``:
    2, the default, or 1; see :mod:`hpcps_kernels.parallel`)."""
    value = os.environ.get("HPCPS_SERVER_THREADS", "2").strip()
    if value not in ("1", "2"):
        raise ValueError(f"HPCPS_SERVER_THREADS must be 1 or 2 (got {value!r})")
    return TwoThreads() if value == "2" else None


def registered_function(name: str) -> ServerFunction:
    """The server function registered under ``name`` (those of the servers' own requests)."""
    if name not in SERVER_FUNCTIONS:
        raise RuntimeError(f"no server function {name!r} is registered (hpcps.ps.margins registers it)")
    return SERVER_FUNCTIONS[name]


class Server:
    """The serving loop of one server rank."""

    def __init__(self, comm, server_index: int, num_workers: int, worker_rank0: int,
                 specs: list[TableSpec], placement: Placement, staleness: int,
                 stall_warn_s: float = 30.0, functions: list | None = None, stall_timeout_s: float = 300.0):
        self.comm = comm
        self.functions = list(functions or [])  # declared ServerFunctions, by number
        self.index = server_index
        self.num_workers = num_workers
        self.worker_rank0 = worker_rank0
        self.tables = [ServerTable(s) for s in specs]
        self.threads = server_threads()
        for table in self.tables:
            table.threads = self.threads
        self.dims = [s.dim for s in specs]
        self.placement = placement
        self.staleness = staleness
        self.stall_warn_s = stall_warn_s
        self.stall_timeout_s = stall_timeout_s
        self.clocks = np.zeros(num_workers, dtype=np.int64)
        self.done = np.zeros(num_workers, dtype=bool)
        self.n_done = 0           # workers that sent DONE (the loop's test, without a NumPy reduction)
        self.deferred: list[tuple[int, protocol.Request, float]] = []  # (source, request, since)
        # BSP: (clock, worker, seq, request) of pushes waiting for every worker to pass their clock
        self.buffered: list[tuple[int, int, int, protocol.Request]] = []
        self.seq = 0
        self.sending: list[transport.Pending] = []
        self.pool = transport.BufferPool()  # large requests and replies
        self.tag_ub = transport.tag_upper_bound(comm)
        self.stats = {"requests": 0, "idle_s": 0.0, "busy_s": 0.0, "deferred": 0}
        # (op, keys pushed, keys pulled, seconds handling it) of every request, when a list
        # (``hpcps bench ps``: the server's own time beside the round trip)
        self.trace: list | None = None
        self.evicting = any(t.features.eviction for t in self.tables)
        self.fragments: dict = {}  # (worker, table) -> the nonzeros of its last MARGINS
        self.evict_round = {t.spec.name: 0 for t in self.tables}

    # -- consistency -------------------------------------------------------------------------

    def min_clock(self) -> int:
        """The smallest clock of the workers not done (plain Python: a few workers, called per request)."""
        live = [c for c, d in zip(self.clocks.tolist(), self.done.tolist()) if not d]
        return min(live) if live else max(self.clocks.tolist(), default=0)

    def _ready(self, r: protocol.Request) -> bool:
        """A pull waits for its clock - staleness; a checkpoint for every worker to reach its clock."""
        if r.op == protocol.CHECKPOINT:
            return r.clock <= self.min_clock()
        return self.staleness < 0 or r.pull_clock - self.staleness <= self.min_clock()

    def restore(self, ckpt: str, manifest: dict) -> None:
        """Load this server's shards of every table (under the current placement) and the clock."""
        for table in self.tables:
            keys, rows = checkpoint.read_for_server(ckpt, manifest, table.spec.name, self.index,
                                                    self.placement.shard_server, self.placement.num_servers)
            table.load(keys, rows, manifest["clock"])
            table.restore_state(checkpoint.read_state_for_server(
                ckpt, manifest, table.spec.name, self.index, self.placement.shard_server, self.placement.num_servers))
        self.clocks[:] = manifest["clock"]
        self.evict_round = {t.spec.name: manifest["clock"] // t.features.evict_every_steps for t in self.tables}

    def _write_checkpoint(self, source: int, r: protocol.Request) -> None:
        path = checkpoint.server_file(protocol.decode_path(r.pull_keys), self.index)
        for table in self.tables:
            table.check_finite(f"checkpoint (step {r.clock})")
        parts = [(table.spec.name, *table.items(), table.state_arrays()) for table in self.tables]
        try:
            size, digest = checkpoint.write_server_file(path, self.index, self.placement.num_servers,
                                                        self.placement.num_shards, parts)
        except OSError as e:
            raise checkpoint.write_failure(path, e, f"server {self.index}") from None
        reply, payload = self._reply(r.req_id, protocol.CHECKPOINT_RESULT.itemsize)
        protocol.pack_checkpoint_result(payload, size, digest)
        self._send(reply, source, r.req_id, "checkpoint reply")

    # -- requests ----------------------------------------------------------------------------

    def _reply(self, req_id: int, payload_bytes: int, table: int = -1) -> tuple[np.ndarray, np.ndarray]:
        status = protocol.stop_status(signals.requested())
        t = self.tables[table] if table >= 0 else None
        counts = (t.size, t.admitted, t.evicted) if t is not None else (0, 0, 0)
        return protocol.pack_reply(req_id, status, self.min_clock(), self.index, payload_bytes, counts,
                                   self.pool.take)

    def _send(self, buf: np.ndarray, dest: int, req_id: int, what: str, announced: bool = False) -> None:
        """Send a reply (``announced``: as header then payload, see ``protocol.announced``)."""
        tag = protocol.reply_tag(req_id, self.tag_ub)
        if announced:
            self.sending.extend(transport.start_send_announced(self.comm, buf, protocol.REPLY_BYTES, dest, tag, what))
        else:
            self.sending.extend(transport.start_send(self.comm, buf, dest, tag, what))

    def _serve_pull(self, source: int, r: protocol.Request) -> None:
        """Answer a pull, or a push-pull (whose reply is also its push's acknowledgement)."""
        n, dim = r.pull_keys.shape[0], self.dims[r.table]
        reply, payload = self._reply(r.req_id, 4 * n * dim, r.table)
        if n:
            self.tables[r.table].pull(r.pull_keys, payload.view(np.float32).reshape(n, dim),
                                      source - self.worker_rank0)
        self._send(reply, source, r.req_id, f"{protocol.OP_NAMES[r.op]} reply", protocol.announced(r.op, n, dim))

    def _push(self, worker: int, r: protocol.Request) -> None:
        """Apply a push now (SSP/ASP), or keep it for its turn (BSP, see the module docstring)."""
        if r.push_keys.shape[0] == 0:
            return
        if self.staleness == 0:
            self.seq += 1
            self.buffered.append((r.clock, worker, self.seq, r))
        else:
            self.tables[r.table].push(r.push_keys, r.grads, r.clock, worker)

    def _advance(self, worker: int, clock: int) -> None:
        self.clocks[worker] = max(self.clocks[worker], clock)
        self._apply_buffered()
        self._evict_if_due()
        self._release_deferred()

    def _evict_if_due(self) -> None:
        """Every ``evict_every_steps`` clocks (of the slowest worker, once its pushes are applied
        under BSP), evict by age and norm: the same point of the run whatever the message order."""
        if not self.evicting:
            return
        now = self.min_clock()
        for table in self.tables:
            f = table.features
            if f.eviction and now // f.evict_every_steps > self.evict_round[table.spec.name]:
                self.evict_round[table.spec.name] = now // f.evict_every_steps
                table.evict(now)

    def _apart_grads(self, source: int, buf: np.ndarray) -> np.ndarray | None:
        """The gradients that follow a request from ``source`` as a message of their own
        (``protocol.GRADS_APART``: the next ``TAG_GRADS`` message from that rank), or None."""
        nbytes = protocol.apart_grads_bytes(buf, self.dims)
        if not nbytes:
            return None
        grads = self.pool.take(nbytes)
        transport.wait(transport.start_recv(self.comm, grads, source, protocol.TAG_GRADS,
                                            f"gradients of request {protocol.header(buf)['req_id']} from rank {source}"),
                       timeout=self.stall_timeout_s, warn_after=self.stall_warn_s)
        return grads

    def handle(self, source: int, buf: np.ndarray, grads: np.ndarray | None = None) -> None:
        """Serve request ``buf`` from rank ``source`` (``grads``: its gradients, when they came
        apart)."""
        r = protocol.unpack_request(buf, self.dims, grads)
        worker = source - self.worker_rank0
        self.stats["requests"] += 1
        if r.op == protocol.PUSHPULL and r.in_pull is not None and self._answers_at_once(worker, r):
            # the push's keys the pull reads, the pull, then (the reply gone) the push's other keys
            table = self.tables[r.table]
            rest = table.push(r.push_keys, r.grads, r.clock, worker, in_pull=r.in_pull)
            self._serve_pull(source, r)
            if rest is not None:
                table.apply_after_reply(rest)
        elif r.op == protocol.PUSHPULL:  # push at clock c, clock c + 1, pull at clock c + 1 (+ ahead)
            self._push(worker, r)
            self._advance(worker, r.clock + 1)
            self._serve_or_defer(source, r)
        elif r.op in (protocol.PULL, protocol.CHECKPOINT):
            self._serve_or_defer(source, r)
        elif r.op == protocol.PUSH:
            self._push(worker, r)
            self._send(self._reply(r.req_id, 0, r.table)[0], source, r.req_id, "push ack")
        elif r.op in (protocol.MARGINS, protocol.CALL):
            self._serve_or_defer(source, r)
        elif r.op == protocol.RESIDUALS:  # push at clock c, then clock c + 1
            keys, values, row_ids = self.fragments.pop((worker, r.table))
            residuals = registered_function(RESIDUALS_FUNCTION).fn
            uniq, grads = residuals(self.tables[r.table], keys, values, row_ids, r.residuals)
            self._push(worker, protocol.Request(protocol.PUSH, r.table, r.req_id, r.clock, r.worker, uniq, grads,
                                                r.pull_keys))
            self._advance(worker, r.clock + 1)
            self._send(self._reply(r.req_id, 0, r.table)[0], source, r.req_id, "residuals ack")
        elif r.op == protocol.CLOCK:
            self._advance(worker, r.clock)
        elif r.op == protocol.DONE:
            if not self.done[worker]:
                self.done[worker] = True
                self.n_done += 1
            self._apply_buffered()
            self._release_deferred()
        else:
            raise RuntimeError(f"server {self.index}: unknown request op {r.op} from rank {source}")

    def _answers_at_once(self, worker: int, r: protocol.Request) -> bool:
        """Advance ``worker``'s clock past a push-pull's push and say whether its push is applied
        now and its pull answered now, with nothing else served or applied in between (then part
        of its push may wait until after the reply): no push kept for its turn, no pull waiting,
        no eviction due, under BSP every worker past the push's clock, and the pull ready."""
        self.clocks[worker] = max(self.clocks[worker], r.clock + 1)  # (as _advance does)
        if self.buffered or self.deferred or self.evicting or r.push_keys.shape[0] == 0:
            return False
        return (self.staleness != 0 or r.clock < self.min_clock()) and self._ready(r)

    def _serve_or_defer(self, source: int, r: protocol.Request) -> None:
        if self._ready(r) or (r.op == protocol.PUSHPULL and r.pull_keys.shape[0] == 0):  # a bare push + clock
            self._serve_deferrable(source, r)
        else:
            self.deferred.append((source, r, time.monotonic()))
            self.stats["deferred"] += 1

    def _apply_buffered(self) -> None:
        """BSP: apply, in (clock, worker, seq) order, the pushes of clocks every worker has passed."""
        if not self.buffered:
            return
        limit = self.min_clock() if self.n_done < self.num_workers else np.iinfo(np.int64).max
        ready = sorted((b for b in self.buffered if b[0] < limit), key=lambda b: b[:3])
        if not ready:
            return
        self.buffered = [b for b in self.buffered if b[0] >= limit]
        for _, worker, _, r in ready:
            self.tables[r.table].push(r.push_keys, r.grads, r.clock, worker)

    def _release_deferred(self) -> None:
        if not self.deferred:
            return
        keep = []
        for source, r, since in self.deferred:
            if self._ready(r):
                self._serve_deferrable(source, r)
            else:
                keep.append((source, r, since))
        self.deferred = keep

    def _serve_deferrable(self, source: int, r: protocol.Request) -> None:
        if r.op == protocol.CHECKPOINT:
            self._write_checkpoint(source, r)
        elif r.op == protocol.MARGINS:
            self._serve_margins(source, r)
        elif r.op == protocol.CALL:
            self._serve_call(source, r)
        else:
            self._serve_pull(source, r)

    def _serve_call(self, source: int, r: protocol.Request) -> None:
        """Run a declared server function over the keys this server owns."""
        f = self.functions[r.function]
        n = r.push_keys.shape[0]
        out = np.asarray(f.fn(self.tables[r.table], r.push_keys, r.grads), dtype=np.float32)
        want = (n, f.out_width) if f.per_key else (f.out_width,)
        if out.size != int(np.prod(want)):
            raise RuntimeError(f"server {self.index}: server function {f.name!r} returned shape {out.shape} "
                               f"for {n} keys; it declares {want}")
        reply, payload = self._reply(r.req_id, 4 * out.size, r.table)
        payload.view(np.float32)[:] = out.reshape(-1)
        self._send(reply, source, r.req_id, f"call reply ({f.name})")

    def _serve_margins(self, source: int, r: protocol.Request) -> None:
        """Partial margins of a batch's rows over this server's nonzeros; the nonzeros are kept
        for the worker's RESIDUALS."""
        width = protocol.margin_width(self.dims[r.table])
        reply, payload = self._reply(r.req_id, 8 * r.n_rows * width, r.table)
        values = r.grads[:, 0]
        margins = registered_function(MARGINS_FUNCTION).fn
        margins(self.tables[r.table], r.push_keys, values, r.row_ids, payload.view(np.float64).reshape(r.n_rows, width))
        self.fragments[(source - self.worker_rank0, r.table)] = (r.push_keys, values, r.row_ids)
        self._send(reply, source, r.req_id, "margins reply")

    def _check_stalled_pulls(self, warned: set) -> None:
        now = time.monotonic()
        for source, r, since in self.deferred:
            if now - since > self.stall_warn_s and id(r) not in warned:
                warned.add(id(r))
                need = r.clock if r.op == protocol.CHECKPOINT else r.pull_clock - self.staleness
                behind = [int(w) + self.worker_rank0 for w in np.flatnonzero((self.clocks < need) & ~self.done)]
                sys.stderr.write(
                    f"hpcps: server {self.index} (rank {self.comm.Get_rank()}): {protocol.OP_NAMES[r.op]} from rank "
                    f"{source} at clock {r.pull_clock} waits {now - since:.0f} s for rank(s) {behind} to reach clock "
                    f"{need} (staleness {self.staleness})\n")
                sys.stderr.flush()

    # -- loop --------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker has sent DONE; returns statistics."""
        poll = transport.Poller()
        warned: set = set()
        last_check = time.monotonic()
        last_request = (time.perf_counter(), time.process_time())
        self.stats.update(idle_gap_wall_s=0.0, idle_gap_cpu_s=0.0)
        while self.n_done < self.num_workers or self.deferred or self.buffered:
            got = transport.probe_request(self.comm, protocol.TAG_REQUEST, self.pool.take)
            if got is None:
                if self.sending:
                    self.sending = transport.completed(self.sending)
                now = time.monotonic()
                if now - last_check > 1.0:
                    self._check_stalled_pulls(warned)
                    last_check = now
                self.stats["idle_s"] += poll.idle()
                continue
            source, buf = got
            grads = self._apart_grads(source, buf)  # (a transfer: before the request's own time)
            t = time.perf_counter()
            cpu = time.process_time()
            if t - last_request[0] > 0.5:  # a quiet spell: what did waiting cost?
                self.stats["idle_gap_wall_s"] += t - last_request[0]
                self.stats["idle_gap_cpu_s"] += cpu - last_request[1]
            queued = len(self.sending)
            self.handle(source, buf, grads)
            busy = time.perf_counter() - t
            self.stats["busy_s"] += busy
            if self.trace is not None:  # (the bytes as MPI carried them: the probed size, the sends queued)
                h = protocol.header(buf)
                self.trace.append((int(h["op"]), int(h["n_push"]), int(h["n_pull"]), busy,
                                   buf.nbytes + (0 if grads is None else grads.nbytes),
                                   sum(p.nbytes for p in self.sending[queued:])))
            # keep polling without sleep while the replies just queued should be in transfer
            poll.reset(sum(p.nbytes for p in self.sending))
            last_request = (time.perf_counter(), time.process_time())
        transport.wait(self.sending, timeout=self.stall_timeout_s)
        self.sending = []
        if self.threads is not None:
            self.threads.close()
        if self.trace is not None:
            self.stats["trace"] = self.trace
        return self.final_stats()

    def final_stats(self) -> dict:
        """The serving statistics with each table's rows held, keys admitted and rows evicted."""
        self.stats["keys"] = [t.size for t in self.tables]
        self.stats["admitted"] = [t.admitted for t in self.tables]
        self.stats["evicted"] = [t.evicted for t in self.tables]
        return self.stats


class LocalServer(Server):
    """A server inside the worker's process (a job of one process): the worker hands it each
    request as bytes and it answers at once into :attr:`outbox` (req_id -> reply bytes); no
    message is sent. With one worker nothing is ever deferred: its own clock is the slowest."""

    def __init__(self, specs: list[TableSpec], placement: Placement, staleness: int, functions: list,
                 stall_timeout_s: float = 300.0):
        super().__init__(transport.self_comm(), 0, 1, 1, specs, placement, staleness, functions=functions,
                         stall_timeout_s=stall_timeout_s)
        self.outbox: dict[int, np.ndarray] = {}

    def _send(self, buf: np.ndarray, dest: int, req_id: int, what: str, announced: bool = False) -> None:
        self.outbox[req_id] = buf
