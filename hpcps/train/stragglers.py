"""A late worker under backup workers (``cluster.backup_workers = b``), and what the run says of it.

The servers complete a clock once ``W - b`` workers have pushed it (:mod:`hpcps.ps.consistency`):
a late worker's pulls are answered at once, from the current model, and its late pushes are
dropped or applied with the next clock (``cluster.late_pushes``). Its data is still its own part,
so a stalled worker would still owe the rest of its part, and the job would end no sooner. What a
user of TensorFlow's sync replicas gets instead (training ends at a global step, whatever rows a
slow worker has not read): once ``W - b`` workers have ended an epoch, a worker still in it stops
at its next step, skips the rest of the epoch (its rows are counted, not trained on) and starts
the next epoch with the others. It learns which clock is complete from the servers' replies
(their header's clock: :func:`hpcps.ps.client.read_reply_header`).

Every collective of the loop stays matched: the others can end an epoch only after the late
worker has joined each collective inside it (evaluations, stop agreements: under backup workers the
periodic checkpoints are the first worker's alone, :mod:`hpcps.train.quorum_checkpoints`), so the
steps it skips hold none. The summary names each stalled worker (:func:`agree_on_stalls`).
"""

from __future__ import annotations

import numpy as np

# what each stalled worker lost, in the summary (the servers' counts, then the worker's)
STALL_KEYS = ("clocks_late", "pushes_dropped", "pushes_deferred", "rows_skipped")
_SERVER_COUNTS = ("backup_clocks_late", "backup_pushes_dropped", "backup_pushes_deferred")


class LateWorker:
    """A worker's side of backup workers: whether the others ended the epoch it is in
    (:meth:`others_ended`), and skipping the rest of it (:meth:`skip_rest`). Does nothing with
    b = 0."""

    def __init__(self, ctx, tables: list):
        self.ctx = ctx
        self.on = ctx.backup.workers > 0 and ctx.is_worker
        self.tables = tables  # the model's sparse tables: their replies carry the complete clock
        ctx.stats.setdefault("rows_skipped", 0)
        self.end_base = 0

    def start_epoch(self, steps_left: int) -> None:
        """An epoch (or the rest of a resumed one) of ``steps_left`` steps begins."""
        self.end_base = self.ctx.clock_value + steps_left - self.ctx.flush_clocks

    @property
    def end_clock(self) -> int:
        """The clock at the end of this worker's epoch: one a step, and one for each of the
        filters' flushes (``filters.push_threshold``: one a checkpoint) made in it."""
        return self.end_base + self.ctx.flush_clocks

    def others_ended(self) -> bool:
        """Whether the clocks up to :attr:`end_clock` are complete while this worker is still in
        the epoch, as the servers' last reply said."""
        end_clock = self.end_clock
        if not self.on or self.ctx.clock_value >= end_clock:
            return False
        complete = max((t.last_min_clock for t in self.tables if t.last_min_clock is not None), default=-1)
        return complete >= end_clock

    def skip_rest(self, pipeline, feed, first: int, last: int, clock: int | None = None) -> int:
        """Skip the steps of indices ``first`` to ``last`` (exclusive) of the epoch: the requests in
        flight finished, the rows pulled ahead dropped, the batches taken and their rows counted,
        the clock moved to ``clock`` (default :attr:`end_clock`) on every server. Returns the steps
        skipped."""
        pipeline.forget_ahead()
        rows = sum(feed.take(i).rows for i in range(first, last))
        self.ctx.stats["rows_skipped"] += rows
        self.ctx.clock_to(self.end_clock if clock is None else clock)
        return last - first

    def skip_to(self, pipeline, feed, first: int, clock: int) -> int:
        """A stop agreed under backup workers (:mod:`hpcps.train.quorum_checkpoints`): this worker
        moved to ``clock`` (the largest among the workers, in this epoch) from the step of index
        ``first``, the steps between skipped as :meth:`skip_rest` does. Returns the steps skipped."""
        n = clock - self.ctx.clock_value
        return self.skip_rest(pipeline, feed, first, first + n, clock) if n > 0 else 0


def agree_on_stalls(ctx) -> list[dict]:
    """Collective over the world, with backup workers only (else []): each worker that was late at
    some clock, as ``{"rank", "worker"}`` and :data:`STALL_KEYS` (the servers' counts, the largest
    over the servers; the rows it skipped), the most rows skipped first, then the most clocks late."""
    if not ctx.backup.workers:
        return []
    workers = ctx.layout.workers
    table = np.zeros((workers, len(STALL_KEYS)), dtype=np.int64)
    st = ctx.server_stats or {}
    for j, key in enumerate(_SERVER_COUNTS):
        if key in st:
            table[:, j] = st[key]
    if ctx.is_worker:
        table[ctx.worker_index, -1] = ctx.stats.get("rows_skipped", 0)
    table = ctx.every_rank.reduce(table.reshape(-1), "max", "agreement on the late workers").reshape(table.shape)
    rank0 = ctx.layout.servers
    stalls = [{"rank": rank0 + w, "worker": w, **{k: int(v) for k, v in zip(STALL_KEYS, row)}}
              for w, row in enumerate(table.tolist()) if any(row)]
    return sorted(stalls, key=lambda s: (-s["rows_skipped"], -s["clocks_late"], s["rank"]))


SAID_STALLS = 3  # the stalled workers the text summary names (every worker is late now and then)


def stalls_said(stalls: list[dict]) -> str:
    """The summary's line of the stalled workers: each one's rows skipped, and the clocks at which
    its push came late (dropped or deferred); the first :data:`SAID_STALLS` of them (the most
    stalled, as :func:`agree_on_stalls` orders them), then how many more."""
    def said(s: dict) -> str:
        fate = ", ".join(f"{s[k]:,} {word}" for k, word in (("pushes_dropped", "dropped"),
                                                            ("pushes_deferred", "deferred")) if s[k])
        return (f"rank {s['rank']}: {s['rows_skipped']:,} rows skipped, late at {s['clocks_late']:,} clocks"
                + (f" (pushes {fate})" if fate else ""))
    more = len(stalls) - SAID_STALLS
    return "; ".join(said(s) for s in stalls[:SAID_STALLS]) + (
        f"; {more} more (stalled_workers in --summary-json)" if more > 0 else "")
