"""When the next timed snapshot is due, so that a kill loses at most ``checkpoint.delta_every_s``
of work: :class:`SnapshotSchedule` (pure: times in, decisions out; no MPI, no files).

A snapshot holds the model of its *data point*, the step after which it is taken, but it only
counts once *committed* (its files written, its manifest renamed into place), a write that goes on
while training does. A kill loses the work since the data point of the newest snapshot committed
before it; the worst kill comes just before the next one commits. Taking snapshots every interval
``D`` from data point to data point would lose up to ``D`` plus that write (the write of the
snapshot under way). So the next snapshot is taken ``I`` seconds after the data point before, and
a step early (a snapshot starts at a step's end), where ``I`` plus its expected write is ``D``:

* a full snapshot's write is expected to take the longest of the recent full ones (``I`` no less
  than ``D / 2``: a full write longer than that cannot keep the bound, and full snapshots taken at
  every step would hold training at each);
* a delta writes the rows changed since the snapshot before, more of them over a longer time, fewer
  over a shorter one: a recent delta that took ``w`` seconds over an interval of ``i`` expects
  ``w * I / i`` over ``I``, so that ``I = D / (1 + w / i)``; the least ``I`` of the recent deltas
  is taken. (Expecting no less than ``w`` over a shorter interval would answer one slow write
  with snapshots back to back, each waiting for the one before, training with them.)

The time from a committed snapshot's data point to its successor's commit, the most a kill can
lose, then stays within ``D`` while each write takes no longer than so expected. Before any write
of a kind is seen, ``I`` is half the interval; the run's first data point is its first step
(:meth:`SnapshotSchedule.start`: its start-up trained nothing). Snapshots are written one at a
time, so where a write takes longer than the interval before it the next one waits for it, and
where it takes more than half of ``D`` the bound cannot hold: :meth:`SnapshotSchedule.over_half`
says so, once.
"""

from __future__ import annotations

from collections import deque

RECENT = 4  # the writes of each kind the expected one is the longest of


class SnapshotSchedule:
    """The first worker's timed snapshots over ``interval`` seconds (``checkpoint.delta_every_s``),
    on a monotonic clock: :meth:`due` after each step, :meth:`taken` at each snapshot's data point,
    :meth:`committed` when it is in place (or :meth:`missed`); :attr:`most_lost` is the most a kill
    would have lost so far (from the run's first snapshot on)."""

    def __init__(self, interval: float, now: float):
        self.interval = interval
        self.point = now  # the data point of the newest snapshot taken (the run's start before any)
        # the recent writes of each kind: (seconds since the data point before, seconds to commit)
        self.writes: dict[str, deque] = {"full": deque(maxlen=RECENT), "delta": deque(maxlen=RECENT)}
        self.pending: tuple[str, float, float] | None = None  # (kind, data point, covered) being written
        self.committed_point: float | None = None  # the data point of the newest snapshot committed
        self.most_lost = 0.0  # the longest from a committed snapshot's data point to the next commit
        self.warned = False

    def next_interval(self, kind: str) -> float:
        """Seconds from the newest data point to the next one (of ``kind``) that keep the bound."""
        seen, d = self.writes[kind], self.interval
        if not seen:
            return d / 2
        return min(d / (1 + took / covered) if kind == "delta" and covered > 0 else max(d - took, d / 2)
                   for covered, took in seen)

    def start(self, now: float) -> None:
        """Training starts at ``now``: the first data point (before any snapshot of this run)."""
        if self.pending is None and self.committed_point is None:
            self.point = now

    def deadline(self, kind: str) -> float:
        """The latest data point of the next snapshot (of ``kind``) that keeps the bound."""
        return self.point + self.next_interval(kind)

    def due(self, now: float, step_s: float, kind: str) -> bool:
        """Whether to take the next snapshot (of ``kind``) now, after a step of ``step_s``
        seconds: waiting for the next step would take its data point past :meth:`deadline`."""
        return now + step_s >= self.deadline(kind)

    def taken(self, now: float, kind: str) -> None:
        """A snapshot of ``kind`` ("full" or "delta") taken at the data point ``now``."""
        self.point, self.pending = now, (kind, now, now - self.point)

    def committed(self, now: float) -> None:
        """The snapshot under way is in place at ``now``: its write time is remembered."""
        if self.pending is not None:
            kind, point, covered = self.pending
            self.writes[kind].append((covered, now - point))
            if self.committed_point is not None:
                self.most_lost = max(self.most_lost, now - self.committed_point)
            self.committed_point, self.pending = point, None

    def missed(self) -> None:
        """The snapshot under way failed: nothing is learnt of its write."""
        self.pending = None

    def over_half(self) -> str:
        """Once, when a recent write took more than half the interval (the bound cannot hold: the
        next snapshot waits for it), a line saying so; else '' (always without timed snapshots:
        ``checkpoint.delta_every_s = 0``, the checkpoints a signal or a count asks for)."""
        longest = max((took for seen in self.writes.values() for _, took in seen), default=0.0)
        if self.warned or not self.interval or longest <= self.interval / 2:
            return ""
        self.warned = True
        return (f"a snapshot took {longest:.2f} s from its step to its commit, more than half of "
                f"checkpoint.delta_every_s = {self.interval:g}: a kill may lose more than the interval "
                f"(raise it, or fewer rows change between snapshots)")

