"""Checkpoints under backup workers (``cluster.backup_workers = b``) with no agreement per step.

Without backup workers the workers agree at every step whether to checkpoint (a collective): a
stalled worker then holds every other one there, whatever the servers do. Under backup workers
nobody waits for the ``b`` slowest workers, checkpoints included:

- periodic checkpoints and delta snapshots (``checkpoint.every_steps``, ``every_s`` and the delta
  keys) are the first worker's alone: it asks the servers for a *quorum* checkpoint at its clock,
  which each server writes once the clock before it is complete (``W - b`` workers past it) and the
  pushes of that clock and later held meanwhile, so that every server writes the model of the same
  clock; a late first worker's request comes after that clock completed and is missed (nothing
  written): it asks again after its next step. The other workers take no part: a stalled one
  holds nobody, and a late one's pushes of earlier clocks that come after the checkpoint are in
  the model, not in the checkpoint (as a dropped late push). The position is the first worker's
  step, the same step for every worker on resume (a late worker's rows before it are skipped);
- stop signals (SIGINT, SIGTERM, SIGUSR1, or a server's) are agreed where the workers meet
  anyway: a worker that sees one tells every server (``protocol.STOPPING``) and joins the
  agreement at once. The servers then report the stop in every reply and answer every read at
  once until the signal's checkpoint, so each other worker sees it after its step in flight and
  joins too (more than ``b`` workers in the agreement push nothing more: a worker held for a clock
  they leave incomplete would otherwise wait for them); those that see none join it before the
  loop's next collective (an evaluation, the epoch's end), where every worker agrees, once each
  between two of them (:meth:`QuorumCheckpoints.at_collective`). Every worker then moves to the
  largest clock among them, skipping the steps between (as a late worker does), and the
  checkpoint waits for all of them, as without backup workers.
"""

from __future__ import annotations

import signal
import time

import numpy as np

from hpcps.ps import context


def stop_wanted(sig: int) -> int:
    """What a stop signal asks of the checkpointing: 4 after SIGINT (the job stops with 130), 3
    after another (75, or training goes on with ``checkpoint.on_signal = "continue"``)."""
    return 4 if sig == signal.SIGINT else 3


LEAD = 2  # a quorum checkpoint's clock: this many past the largest clock the first worker knows of


def next_meeting(step: int, steps: int, eval_every: int) -> int:
    """The first step after ``step`` (of an epoch of ``steps``) after which the workers meet: the
    next evaluation (every ``eval_every`` steps, 0: none; :meth:`hpcps.train.loop.Trainer.train_epoch`
    evaluates at those steps but the epoch's last), else the epoch's end. A quorum checkpoint is
    asked no later: a stop's agreement moves every worker to its clock, and one moved past an
    evaluation would skip it while the workers that joined the agreement there evaluate."""
    return min(steps, (step // eval_every + 1) * eval_every) if eval_every else steps


class QuorumCheckpoints:
    """A worker's checkpoint decisions under backup workers (the module's docstring), for its
    :class:`~hpcps.train.checkpointing.Checkpointing` (``ck``) in the training ``loop`` (the
    :class:`~hpcps.train.loop.Trainer`: its steps an epoch, and what :meth:`skip_to` moves)."""

    def __init__(self, ck, loop):
        self.ck, self.loop = ck, loop
        self.agreed = False  # this worker joined the stop agreement since the loop's last collective
        self.pending = 0     # first worker: a periodic checkpoint due, not asked yet (2, or 1: a delta)
        self.asked: tuple | None = None  # first worker: (AskedCheckpoint, manifest, delta, want) in flight

    def if_due(self, epoch: int, step: int, global_step: int) -> int:
        """After step ``step``: the agreement on a stop when this worker sees one; on the first
        worker, a periodic checkpoint asked for when due, and the one asked committed once its
        clock is past. Returns the exit status the run stops with on a signal, else 0."""
        sig = self.ck.ctx.stop_signal
        if sig and not self.agreed:
            self.agreed = True
            context.forward_stop(self.ck.ctx, sig)  # (the others learn of it from the servers, none held meanwhile)
            return self.agree(stop_wanted(sig), epoch, step)
        if self.ck.first:
            self.finish_asked(block=False)  # (one in flight: only a count's due is kept for later)
            self.pending = self.pending or self.ck.due(global_step, by_time=self.asked is None)
            if self.pending and self.asked is None:
                self.ask(epoch, step, global_step)
        return 0

    def ask(self, epoch: int, step: int, global_step: int) -> None:
        """First worker: ask the servers for a quorum checkpoint at a clock ``LEAD`` past the
        largest it knows of (this epoch's, else later), without waiting."""
        ck, ctx = self.ck, self.ck.ctx
        seen = max((t.last_min_clock for t in ck.model.sparse if t.last_min_clock is not None), default=0)
        ahead = max(ctx.clock_value, seen) + LEAD - ctx.clock_value
        loop = self.loop
        if step + ahead > next_meeting(step, loop.steps, ck.cfg.train.eval_every if loop.test is not None else 0):
            return  # (its clock before the workers' next meeting: a stop's agreement moves every worker to it)
        delta = ck.delta_possible(self.pending == 1)
        ck.schedule.taken(time.monotonic(), "delta" if delta else "full")  # (about its data point: a few steps on)
        at = global_step + ahead
        manifest = ck.manifest(epoch, step + ahead + 1, at, "periodic", delta)
        asked = context.ask_for_checkpoint(ctx, ck.cfg.checkpoint.dir, at, ctx.clock_value + ahead, delta,
                                           ck.deltas_on and not delta, quorum=True)
        self.asked, self.pending = (asked, manifest, delta, self.pending), 0

    def finish_asked(self, block: bool) -> None:
        """First worker: the checkpoint asked for committed once every server replied (``block``:
        wait for them, else only if they have: training never waits for the others here), or
        asked for again when missed."""
        if self.asked is None:
            return
        asked, manifest, delta, want = self.asked
        ctx = self.ck.ctx
        if not context.checkpoint_replied(ctx, asked, block=block):
            return
        self.asked = None
        path = context.commit_checkpoint(ctx, asked, manifest, self.ck.cfg.checkpoint.keep,
                                         self.ck.commits if delta else None)
        if self.ck.committed(path, "periodic", delta):
            self.ck.saved_at = manifest["position"]["global_step"]
        else:
            self.pending = self.pending or want

    def at_collective(self, epoch: int, step: int, global_step: int) -> int:
        """Before a collective of the loop, after step ``step``: the agreement on a stop, unless
        this worker joined it since the last one (each worker joins once between two)."""
        if self.agreed:
            self.agreed = False
            return 0
        sig = self.ck.ctx.stop_signal
        return self.agree(stop_wanted(sig) if sig else 0, epoch, step)

    def skip_to(self, epoch: int, step: int, clock: int) -> tuple[int, int]:
        """This worker, after step ``step``, moved to ``clock`` (:meth:`LateWorker.skip_to`: the
        steps between skipped). Returns (its step, its global step) there."""
        loop = self.loop
        n = loop.late.skip_to(loop.pipeline, loop.feed, (epoch - 1) * loop.steps + step, clock)
        loop.global_step += n
        return step + n, loop.global_step

    def agree(self, want: int, epoch: int, step: int) -> int:
        """Collective over the workers: whether any worker saw a stop, and the largest clock among
        them (and of the checkpoint asked); then (on a stop) every worker at that clock and the
        signal's checkpoint."""
        ctx = self.ck.ctx
        clock = max(ctx.clock_value, self.asked[0].clock if self.asked is not None else 0)
        got = self.ck.workers.reduce(np.array([want, clock], dtype=np.int64), "max",
                                     "agreement on a stop (backup workers)")
        if not got[0]:
            return 0
        step, global_step = self.skip_to(epoch, step, int(got[1]))
        return self.ck.act(int(got[0]), epoch, step, global_step)
