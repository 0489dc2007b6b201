"""What a server knows of its workers' progress, and the requests that wait on it (pure: no MPI).

The semantics (BSP, SSP, ASP; pushes applied in (clock, worker, sequence) order under BSP) are
those of :mod:`hpcps.ps.server`'s docstring; :class:`WorkerClocks` keeps the state they need: each
worker's clock and whether it is done, the reads deferred until the clocks allow them, and under
BSP the pushes kept for their turn.
"""

from __future__ import annotations

import numpy as np

from hpcps.ps import protocol


class WorkerClocks:
    """Each worker's clock, the reads that wait for the slowest, and (BSP) the pushes that wait
    for every worker to pass their clock."""

    def __init__(self, num_workers: int, staleness: int):
        self.num_workers = num_workers
        self.staleness = staleness
        self.clocks = np.zeros(num_workers, dtype=np.int64)
        self.done = np.zeros(num_workers, dtype=bool)
        self.n_done = 0           # workers that sent DONE (the loop's test, without a NumPy reduction)
        self.deferred: list[tuple[int, protocol.Message, float]] = []  # (source, request, since)
        # BSP: (clock, worker, seq, request) of pushes waiting for every worker to pass their clock
        self.buffered: list[tuple[int, int, int, protocol.Push]] = []
        self.seq = 0
        self._min_clock: int | None = None  # min_clock() until a clock moves (every reply carries it)

    @property
    def waiting(self) -> bool:
        """Whether a read is deferred or a push kept for its turn."""
        return bool(self.deferred or self.buffered)

    @property
    def all_done(self) -> bool:
        return self.n_done >= self.num_workers

    def min_clock(self) -> int:
        """The smallest clock of the workers not done (kept until a clock moves: called per request)."""
        if self._min_clock is None:
            live = [c for c, d in zip(self.clocks.tolist(), self.done.tolist()) if not d]
            self._min_clock = min(live) if live else max(self.clocks.tolist(), default=0)
        return self._min_clock

    def set_all(self, clock: int) -> None:
        """Every worker's clock is ``clock`` (a restored checkpoint's)."""
        self.clocks[:] = clock
        self._min_clock = None

    def ready(self, r: protocol.Message) -> bool:
        """A pull waits for its clock - staleness; a checkpoint for every worker to reach its clock."""
        if r.op == protocol.CHECKPOINT:
            return r.clock <= self.min_clock()
        return self.staleness < 0 or r.pull_clock - self.staleness <= self.min_clock()

    def advance(self, worker: int, clock: int) -> None:
        if clock > self.clocks[worker]:
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
        """BSP: keep a push for its turn (:meth:`pushes_due`)."""
        self.seq += 1
        self.buffered.append((push.clock, worker, self.seq, push))

    def pushes_due(self) -> list[tuple[int, protocol.Push]]:
        """BSP: the kept pushes of clocks every worker has passed, as (worker, request) in (clock,
        worker, seq) order (taken out of the kept ones)."""
        if not self.buffered:
            return []
        limit = self.min_clock() if self.n_done < self.num_workers else np.iinfo(np.int64).max
        due = sorted((b for b in self.buffered if b[0] < limit), key=lambda b: b[:3])
        if due:
            self.buffered = [b for b in self.buffered if b[0] >= limit]
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
