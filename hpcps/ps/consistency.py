"""What a server knows of its workers' progress, and the requests that wait on it (pure: no MPI).

The semantics (BSP, SSP, ASP; pushes applied in (clock, worker, sequence) order under BSP) are
those of :mod:`hpcps.ps.server`'s docstring; :class:`WorkerClocks` keeps the state they need: each
worker's clock and whether it is done, the reads deferred until the clocks allow them, and under
BSP the pushes kept for their turn.

Backup workers (``cluster.backup_workers = b`` under BSP, TensorFlow's SyncReplicasOptimizer and
KunPeng's backup instances; :class:`Backup`): a clock completes once ``W - b`` of the ``W`` workers
have passed it (a worker that sent DONE counts as past every clock), not all of them. Pulls of
clock ``c`` wait for clock ``c - 1`` to complete, so the ``b`` slowest workers are waited for by
nobody; a late worker's pulls are answered at once, from the current model. A push of a clock that
completed without it is *late*: dropped (``late_pushes = "drop"``) or kept for the clock now being
collected and applied with it (``"next"``). The pushes of a clock are applied when it completes,
in (clock, worker, sequence) order, as with ``b = 0``; which pushes are late depends on timing, so
runs with ``b > 0`` are not bit-reproducible. A checkpoint still waits for every worker to reach
its clock and holds every push sent before it, late ones included; a *quorum* checkpoint (one the
first worker writes alone, periodic ones under backup workers: ``protocol.Checkpoint.quorum``)
waits only for its clock's previous clock to complete, the pushes of later clocks held while it
waits, and is *missed* (nothing written) when a later clock completed before it came. With
``b = 0`` nothing changes: the clock that completes is the slowest worker's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcps.ps import protocol

LATE_PUSHES = ("next", "drop")  # what a late push does: applied with the next clock, or dropped


@dataclass(frozen=True)
class Backup:
    """Backup workers: ``workers`` (b) of the W workers nobody waits for, and what a late push does
    (``late_pushes``, one of :data:`LATE_PUSHES`)."""

    workers: int = 0
    late_pushes: str = "next"

    def check(self, num_workers: int, staleness: int, groups: int | None = None) -> str | None:
        """Why this setting cannot run with ``num_workers`` workers in ``groups`` worker groups (None:
        one each) at ``staleness`` (None if it can), in words naming the configuration keys."""
        if self.late_pushes not in LATE_PUSHES:
            return f"cluster.late_pushes = {self.late_pushes!r}: expected one of {list(LATE_PUSHES)}"
        if not self.workers:
            return None
        if staleness != 0:
            return (f"cluster.backup_workers = {self.workers} is for BSP (cluster.staleness = 0; got "
                    f"{staleness}): under SSP and ASP nobody waits for the slowest worker anyway")
        if not 0 <= self.workers < num_workers:
            return (f"cluster.backup_workers = {self.workers} must be at least 0 and less than the number of "
                    f"workers ({num_workers})")
        if groups is not None and groups != num_workers:
            return (f"cluster.backup_workers = {self.workers} needs one worker per group (cluster.worker_groups "
                    f"= 0, or as many as the workers; got {groups} groups of {num_workers} workers): a group's members "
                    f"wait for each other")
        return None


NO_BACKUP = Backup()


class LateWorkers:
    """Under backup workers, which pushes are late and what each worker lost: per worker, the
    clocks at which it was late, its late pushes dropped and deferred to the next clock."""

    def __init__(self, num_workers: int, backup: Backup):
        self.backup = backup
        self.quorum = num_workers - backup.workers  # the workers that complete a clock
        self.clocks_late = np.zeros(num_workers, dtype=np.int64)
        self.dropped = np.zeros(num_workers, dtype=np.int64)
        self.deferred = np.zeros(num_workers, dtype=np.int64)
        self.deferred_seqs: set[int] = set()  # the kept pushes that were late (a checkpoint applies them)

    def completed_without(self, clocks: np.ndarray, done: np.ndarray, worker: int, clock: int) -> bool:
        """Whether clock ``clock`` is complete without ``worker``: ``W - b`` of the others are past it."""
        past = (clocks > clock) | done
        return int(past.sum()) - bool(past[worker]) >= self.quorum

    def counts(self) -> dict:
        """What each worker lost, for the server's statistics (summed over servers by the caller)."""
        return {"backup_clocks_late": self.clocks_late.tolist(), "backup_pushes_dropped": self.dropped.tolist(),
                "backup_pushes_deferred": self.deferred.tolist()}


class WorkerClocks:
    """Each worker's clock, the reads that wait for the slowest, and (BSP) the pushes that wait
    for every worker to pass their clock."""

    def __init__(self, num_workers: int, staleness: int, backup: Backup = NO_BACKUP):
        self.num_workers = num_workers
        self.staleness = staleness
        # backup workers: the quorum that completes a clock and the late pushes (None: b = 0)
        self.late = LateWorkers(num_workers, backup) if backup.workers else None
        self.clocks = np.zeros(num_workers, dtype=np.int64)
        self.done = np.zeros(num_workers, dtype=bool)
        self.n_done = 0           # workers that sent DONE (the loop's test, without a NumPy reduction)
        self.deferred: list[tuple[int, protocol.Message, float]] = []  # (source, request, since)
        # BSP: (clock, worker, seq, request) of pushes waiting for every worker to pass their clock
        self.buffered: list[tuple[int, int, int, protocol.Push]] = []
        self.seq = 0
        self._min_clock: int | None = None  # min_clock() until a clock moves (every reply carries it)
        # backup workers: a stop is wanted (workers are joining the agreement on it): every read is
        # answered at once until its checkpoint, as a late worker's is (no worker waits for those
        # in the agreement, who push nothing more)
        self.stopping = False
        self.stopped_at = -1  # the clock of the last signal's checkpoint: a STOPPING of it or before is late

    @property
    def waiting(self) -> bool:
        """Whether a read is deferred or a push kept for its turn."""
        return bool(self.deferred or self.buffered)

    @property
    def all_done(self) -> bool:
        return self.n_done >= self.num_workers

    def min_clock(self) -> int:
        """The first clock not complete: the smallest clock of the workers not done; with backup
        workers, the smallest of the ``W - b`` largest (kept until a clock moves: called per request)."""
        if self._min_clock is None:
            if self.late is None:
                self._min_clock = self.slowest_clock()
            else:  # (a done worker is past every clock)
                ordered = sorted(c if not d else np.iinfo(np.int64).max
                                 for c, d in zip(self.clocks.tolist(), self.done.tolist()))
                q = ordered[self.num_workers - self.late.quorum]
                self._min_clock = q if q != np.iinfo(np.int64).max else max(self.clocks.tolist(), default=0)
        return self._min_clock

    def slowest_clock(self) -> int:
        """The smallest clock of the workers not done (every worker's, when all are)."""
        live = [c for c, d in zip(self.clocks.tolist(), self.done.tolist()) if not d]
        return min(live) if live else max(self.clocks.tolist(), default=0)

    def is_late(self, worker: int, clock: int) -> bool:
        """Backup workers: whether a push of ``clock`` from ``worker`` is late (the clock completed
        without it). Always False with b = 0."""
        return self.late is not None and self.late.completed_without(self.clocks, self.done, worker, clock)

    def set_all(self, clock: int) -> None:
        """Every worker's clock is ``clock`` (a restored checkpoint's)."""
        self.clocks[:] = clock
        self._min_clock = None

    def ready(self, r: protocol.Message) -> bool:
        """A pull waits for its clock - staleness; a checkpoint for every worker to reach its clock."""
        if r.op == protocol.CHECKPOINT:  # (every worker, backup or not, unless a quorum checkpoint)
            return r.clock <= (self.min_clock() if self.late is None or r.quorum else self.slowest_clock())
        return self.readable(r.pull_clock)

    def readable(self, clock: int) -> bool:
        """Whether a read at ``clock`` is answered now: once every worker (but the backups) has
        reached ``clock - staleness``; at once under ASP, and while a stop is agreed under backup
        workers (:attr:`stopping`)."""
        return self.staleness < 0 or clock - self.staleness <= self.min_clock() or self.stopping

    def missed(self, r: protocol.Checkpoint) -> bool:
        """A quorum checkpoint that came after its clock completed (its pushes applied): the model
        is past it."""
        return r.quorum and self.min_clock() > r.clock

    def _checkpoint_clock(self) -> int | None:
        """The smallest clock of the quorum checkpoints waiting (pushes of it and later are held
        until they are written), or None."""
        clocks = [r.clock for _, r, _ in self.deferred if r.op == protocol.CHECKPOINT and r.quorum]
        return min(clocks) if clocks else None

    def advance(self, worker: int, clock: int) -> None:
        if clock > self.clocks[worker]:
            if self.is_late(worker, int(self.clocks[worker])):
                self.late.clocks_late[worker] += 1
            self.clocks[worker] = clock
            self._min_clock = None

    def finish(self, worker: int) -> None:
        """``worker`` sent DONE: the others no longer wait for its clock."""
        if not self.done[worker]:
            self.done[worker] = True
            self.n_done += 1
            self._min_clock = None

    def lose(self, worker: int, clock: int, source: int) -> None:
        """``worker`` (rank ``source``) is gone with ``clock`` its last complete clock: the others no
        longer wait for it, its pushes of later clocks are dropped (its rows of those steps are
        trained again by the others) and so are its reads."""
        self.clocks[worker] = min(int(self.clocks[worker]), clock)
        self.finish(worker)
        self.buffered = [b for b in self.buffered if b[1] != worker or b[0] < clock]
        self.deferred = [d for d in self.deferred if d[0] != source]

    def keep_push(self, worker: int, push: protocol.Push) -> None:
        """BSP: keep a push for its turn (:meth:`pushes_due`); with backup workers a late push is
        dropped, or kept for the clock now being collected (the module's docstring)."""
        self.seq += 1
        clock = push.clock
        if self.is_late(worker, clock):
            if self.late.backup.late_pushes == "drop":
                self.late.dropped[worker] += 1
                return
            self.late.deferred[worker] += 1
            self.late.deferred_seqs.add(self.seq)
            clock = self.min_clock()
        self.buffered.append((clock, worker, self.seq, push))

    def late_pushes_kept(self) -> list[tuple[int, protocol.Push]]:
        """Backup workers: the late pushes kept for their next clock, as (worker, request) in
        (clock, worker, seq) order (taken out of the kept ones): a checkpoint applies them first."""
        if self.late is None or not self.late.deferred_seqs:
            return []
        seqs = self.late.deferred_seqs
        due = sorted((b for b in self.buffered if b[2] in seqs), key=lambda b: b[:3])
        self.buffered = [b for b in self.buffered if b[2] not in seqs]
        seqs.clear()
        return [(worker, r) for _, worker, _, r in due]

    def late_counts(self) -> dict:
        """Backup workers: what each worker lost (:meth:`LateWorkers.counts`); {} with b = 0."""
        return {} if self.late is None else self.late.counts()

    def pushes_due(self) -> list[tuple[int, protocol.Push]]:
        """BSP: the kept pushes of clocks every worker has passed, as (worker, request) in (clock,
        worker, seq) order (taken out of the kept ones)."""
        if not self.buffered:
            return []
        limit = self.min_clock() if self.n_done < self.num_workers else np.iinfo(np.int64).max
        held = self._checkpoint_clock() if self.late is not None and self.deferred else None
        if held is not None:  # (a quorum checkpoint waiting: the model at its clock)
            limit = min(limit, held)
        due = sorted((b for b in self.buffered if b[0] < limit), key=lambda b: b[:3])
        if due:
            self.buffered = [b for b in self.buffered if b[0] >= limit]
            if self.late is not None and self.late.deferred_seqs:
                self.late.deferred_seqs.difference_update(b[2] for b in due)
        return [(worker, r) for _, worker, _, r in due]

    def defer(self, source: int, r: protocol.Message, now: float) -> None:
        self.deferred.append((source, r, now))

    def reads_due(self) -> list[tuple[int, protocol.Message]]:
        """The deferred reads the clocks now allow, as (source, request) in arrival order (taken
        out of the deferred ones)."""
        if not self.deferred:
            return []
        due, waiting = [], []
        for source, r, since in self.deferred:
            if self.ready(r):
                due.append((source, r))
            else:
                waiting.append((source, r, since))
        self.deferred = waiting
        if self.late is not None and len(due) > 1:  # (a quorum checkpoint first: the model of its clock)
            due.sort(key=lambda d: not (d[1].op == protocol.CHECKPOINT and d[1].quorum))
        return due

    def stalled_reads(self, now: float, warn_after: float, warned: set) -> list[tuple]:
        """The deferred reads waiting longer than ``warn_after`` seconds not yet in ``warned`` (added
        to it), as (source, request, seconds waited, clock needed, workers behind it)."""
        out = []
        for source, r, since in self.deferred:
            if now - since > warn_after and id(r) not in warned:
                warned.add(id(r))
                need = r.clock if r.op == protocol.CHECKPOINT else r.pull_clock - self.staleness
                behind = [int(w) for w in np.flatnonzero((self.clocks < need) & ~self.done)]
                out.append((source, r, now - since, need, behind))
        return out
