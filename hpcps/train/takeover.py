"""The rows of lost workers, trained by the others (``cluster.fault_tolerance = "ulfm"``).

A worker lost mid-epoch has trained the batches of its part up to its last complete clock (the
servers agree on it and dropped what it pushed after: :mod:`hpcps.ps.recovery`). At the end of
the epoch the workers left agree on who is gone (:meth:`hpcps.ps.context.Context.lost_workers`)
and train the rest of each lost part, from that data position, in extra steps: the lost batches
in order, dealt to the survivors in turn (survivor ``i`` of ``m`` takes the ``i``-th, ``i + m``-th,
... ; one that runs out takes empty steps, so clocks stay in step). In the later epochs they take
over the lost parts whole the same way. So every row is trained once an epoch, as without the
loss, only by other workers and later in the epoch: under BSP the model is that of a run whose
steps were dealt that way.
"""

from __future__ import annotations

import math

from hpcps.train.feed import BatchFeed
from hpcps.train.loading import lost_part


class Takeover:
    """A worker's share of the lost workers' batches (run by :meth:`after_epoch`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.since: dict[int, tuple[int, int]] = {}  # lost worker -> (epoch lost in, its first batch not trained)
        self.feeds: dict[int, BatchFeed] = {}  # lost worker -> the batches of its part
        self.epoch_clock = 0  # the clock at the start of the epoch (every worker's under BSP)

    def start_epoch(self) -> None:
        self.epoch_clock = self.trainer.ctx.clock_value

    def after_epoch(self, epoch: int) -> None:
        """Collective over the workers left: learn of the workers lost, then train this worker's
        share of their batches of this epoch."""
        t = self.trainer
        ctx, steps = t.ctx, t.steps
        for worker, clock in ctx.lost_workers():
            done = min(max(clock - self.epoch_clock, 0), steps)
            self.since[worker] = (epoch, done)
            self.feeds[worker] = BatchFeed(t.cfg, lost_part(ctx, t.cfg, t.plan.paths["train"], worker), steps,
                                           t.holdout_phase, t.model.reads_keys, t.world.end_job_with)
            if t.workers.is_first:
                print(f"hpcps train: worker {worker} lost after clock {clock} (step {done} of {steps} of epoch "
                      f"{epoch}): its rows from there are trained by the {t.workers.size} workers left", flush=True)
        if not self.since:
            return
        for feed in self.feeds.values():
            feed.start_epoch(False)
        lost = [(w, j) for w, (lost_in, done) in sorted(self.since.items()) if lost_in <= epoch
                for j in range(done if lost_in == epoch else 0, steps)]
        mine = lost[t.workers.rank::t.workers.size]
        extra = math.ceil(len(lost) / t.workers.size)
        batches = [self._batch(w, epoch, j) for w, j in mine]
        t.pipeline.forget_ahead()  # (rows pulled for the next epoch's first step would be stale)
        empty = None
        for k in range(extra):
            if k < len(batches):
                batch = batches[k]
            else:
                empty = empty if empty is not None else batches[0].batch(0, 0) if batches else self._empty()
                batch = empty
            loss = t.train_step(batch, batches[k + 1:k + 3])
            t.reporter.step(epoch, steps, batch.rows, loss, t.global_step, t.model.table.key_counts)
        t.pipeline.forget_ahead()

    def _batch(self, worker: int, epoch: int, j: int):
        return self.feeds[worker].take((epoch - 1) * self.trainer.steps + j)

    def _empty(self):
        feed = next(iter(self.feeds.values()))
        return feed.train.ds.batch(0, 0)
