"""When a training run writes checkpoints, and what they hold: :class:`Checkpointing`.

``[checkpoint]``: a checkpoint every ``every_steps`` steps or ``every_s`` seconds, one at the end
(``final``), and one on a stop signal. SIGINT, SIGTERM and SIGUSR1 are caught: with a checkpoint
directory, at the next step (a checkpoint, then exit 130 after SIGINT, 75 after the others, or
training goes on with ``on_signal = "continue"``); without one, at once (exit 128 + the signal).
Every worker agrees on each decision; the first worker asks the servers to write and writes the
manifest, whose position is the step to run next. Under backup workers no worker waits for the
others at each step: the first worker writes periodic checkpoints alone and stop signals are
agreed where the workers meet (:mod:`hpcps.train.quorum_checkpoints`).

Delta snapshots (``delta_every_steps`` / ``delta_every_s``, :mod:`hpcps.ps.deltas`) are taken at the
same points over the run's newest full checkpoint, written while training goes on; every
``full_every``-th one, the first one with no full checkpoint to be taken over (none yet in this
run's lineage, or one resumed from elsewhere), and the one after a delta that failed, are full.
``delta_every_s`` bounds the work a kill loses: each snapshot is taken early enough that it is
committed within that many seconds of the data point of the one before
(:mod:`hpcps.train.snapshot_schedule`).
"""

from __future__ import annotations

import os
import time

from hpcps.ps import checkpoint, deltas, signals
from hpcps.train.flush import flush_filters
from hpcps.train.quorum_checkpoints import QuorumCheckpoints, stop_wanted
from hpcps.train.snapshot_schedule import SnapshotSchedule

EXIT_PREEMPTED = 75  # the job stopped on SIGUSR1/SIGTERM after writing a checkpoint (EX_TEMPFAIL)
EXIT_INTERRUPTED = signals.EXIT_INTERRUPTED  # 130: the job stopped on SIGINT (after its checkpoint, if any)


def catch_stop_signals(cfg, world, no_checkpoint: str) -> None:
    """SIGINT, SIGTERM and SIGUSR1 from now on: deferred to the next step when a checkpoint can be
    written, else the end of the job at once, the first rank saying why (``no_checkpoint``)."""
    ck = cfg.checkpoint
    signals.install(defer=bool(ck.dir), prefix=f"hpcps: {world.prefix}: ", first=world.is_first,
                    why="" if ck.dir else no_checkpoint, end=world.end_job)


class Checkpointing:
    """A run's checkpoint decisions on a worker (collective over the workers): the periodic and
    signal checkpoints (:meth:`if_due`), the final one (:meth:`at_the_end`), and the newest this
    run wrote (:attr:`written`, on the first worker)."""

    def __init__(self, ctx, plan, pipeline, model, first: bool, loop=None):
        self.ctx, self.plan, self.cfg = ctx, plan, plan.cfg
        self.pipeline, self.model = pipeline, model
        self.first = first
        self.workers = ctx.among_workers
        self.written: str | None = None  # the newest checkpoint this run wrote (first worker)
        self.data_meaning = plan.data_meaning() if (first and self.cfg.checkpoint.dir) else None
        self.last_save = self.step_at = time.monotonic()  # (step_at: the last step's end)
        self.step_s: float | None = None  # the last step's length (None before the first: start-up is no step)
        # first worker: when the next delta_every_s snapshot is due (each committed in time)
        self.schedule = SnapshotSchedule(self.cfg.checkpoint.delta_every_s, self.last_save)
        self.saved_at = -1  # the step of this run's newest checkpoint in checkpoint.dir
        # first worker, with delta snapshots: the chain they extend ({"base": {name, manifest_xxh64},
        # "deltas_before": [...]}), None until a full checkpoint they can be taken over
        self.deltas_on = bool(self.cfg.checkpoint.dir and (self.cfg.checkpoint.delta_every_steps or self.cfg.checkpoint.delta_every_s))
        self.commits = deltas.Commits()
        self.chain: dict | None = None
        self.delta_pauses: list[float] = []  # first worker: how long training waited for each delta
        # backup workers: no agreement per step (``loop``: the Trainer, whose steps a stop may skip)
        self.quorum = QuorumCheckpoints(self, loop) if (self.cfg.checkpoint.dir and ctx.backup.workers) else None

    def agree_on_resumed(self, global_step: int) -> None:
        """Collective over the workers: the checkpoint resumed counts as this run's newest when it
        lies in ``checkpoint.dir`` and means the same data (a run with nothing left to train then
        writes none)."""
        here = self.plan.resumes_from_its_checkpoint_dir()
        if self.workers.smallest(int(here), "agreement on the checkpoint resumed"):
            self.saved_at = global_step
            if self.first and self.deltas_on and deltas.tracked(self.plan.restore[0]):
                self._extend_chain(*self.plan.restore)

    def _extend_chain(self, ckpt: str, manifest: dict) -> None:
        """The next delta is taken over ``ckpt`` (a full checkpoint marked for deltas, or a delta)."""
        link = {"name": os.path.basename(os.path.normpath(ckpt)), "manifest_xxh64": manifest["manifest_xxh64"]}
        if checkpoint.is_delta(ckpt):
            self.chain = {"base": manifest["base"], "deltas_before": [*manifest["deltas_before"], link]}
        else:
            self.chain = {"base": link, "deltas_before": []}

    def if_due(self, epoch: int, step: int, global_step: int) -> int:
        """Collective over the workers, after step ``step`` of ``epoch``: a checkpoint when one is
        due somewhere (a stop signal, a periodic one). Returns the exit status the run stops with
        on the signal (130 after SIGINT, 75 after the others), else 0. Under backup workers, no
        collective unless this worker sees a stop (:meth:`QuorumCheckpoints.if_due`)."""
        if not self.cfg.checkpoint.dir:
            return 0
        if self.quorum is not None:
            return self.quorum.if_due(epoch, step, global_step)
        sig = self.ctx.stop_signal
        want = self.workers.largest(stop_wanted(sig) if sig else self.due(global_step), "agreement on checkpointing")
        return self.act(want, epoch, step, global_step) if want else 0

    def at_collective(self, epoch: int, step: int, global_step: int) -> int:
        """Before a collective of the loop (an evaluation, the epoch's end), after step ``step``:
        under backup workers, the agreement on a stop signal where the workers meet
        (:meth:`QuorumCheckpoints.at_collective`); else nothing. Returns as :meth:`if_due`."""
        return 0 if self.quorum is None else self.quorum.at_collective(epoch, step, global_step)

    def due(self, global_step: int, by_time: bool = True) -> int:
        """What this worker's count and clock make due: 2 = a periodic checkpoint, 1 = a delta
        snapshot (by seconds, unless not ``by_time``: the first worker's clock), 0 = nothing."""
        ck, now = self.cfg.checkpoint, time.monotonic()
        timed = by_time and self.first
        if self.step_s is None:  # (the first step: the work a kill could lose starts here)
            self.schedule.start(now)
        self.step_s, self.step_at = (0.0 if self.step_s is None else now - self.step_at), now
        return 2 if (bool(ck.every_steps and global_step % ck.every_steps == 0)
                     or bool(timed and ck.every_s and now - self.last_save >= ck.every_s)) else int(
            bool(ck.delta_every_steps and global_step % ck.delta_every_steps == 0)
            or bool(timed and ck.delta_every_s and self.snapshot_due(now)))

    def snapshot_due(self, now: float) -> bool:
        """First worker: whether the next ``delta_every_s`` snapshot is due after this step
        (:meth:`SnapshotSchedule.due`, for the kind it will be)."""
        self._note_commit()
        ck, chain = self.cfg.checkpoint, self.chain
        under_way = int(self.commits.thread is not None)  # (a delta the chain will hold by then)
        delta = chain is not None and len(chain["deltas_before"]) + under_way + 1 < ck.full_every
        return self.schedule.due(now, self.step_s, "delta" if delta else "full")

    def _note_commit(self) -> None:
        """First worker: the delta under way, once committed (or failed), told to the schedule."""
        if self.schedule.pending is None or self.schedule.pending[0] != "delta":
            return
        if self.commits.done_at is not None:
            self._snapshot_committed(self.commits.done_at)
        elif self.commits.failed:
            self.schedule.missed()

    def _snapshot_committed(self, at: float) -> None:
        """First worker: the snapshot under way committed at ``at``, told to the schedule (and a
        write too long for ``delta_every_s`` said, once)."""
        self.schedule.committed(at)
        if line := self.schedule.over_half():
            print(f"hpcps train: warning: {line}", flush=True)

    def act(self, want: int, epoch: int, step: int, global_step: int) -> int:
        """Collective over the workers: the checkpoint the workers agreed on after step ``step``
        (``want``: 4 = SIGINT somewhere, 3 = another stop signal, 2 = periodic, 1 = a delta
        snapshot). Returns the exit status the run stops with on the signal, else 0."""
        written = self.save(epoch, step + 1, global_step, "signal" if want >= 3 else "periodic", delta=want == 1)
        self.saved_at, self.step_at = global_step, time.monotonic()  # (the next step's length without the pause)
        if want >= 3:
            if self.cfg.checkpoint.on_signal == "exit" or want == 4:  # (SIGINT always stops)
                return signals.checkpoint_written(EXIT_INTERRUPTED if want == 4 else EXIT_PREEMPTED, written)
            signals.clear()
            self.ctx.server_stop = 0
        return 0

    def at_the_end(self, global_step: int, preempted: int) -> None:
        """Collective over the workers: the final checkpoint (``checkpoint.final``), unless the
        run stopped on a signal or its last step's is written already."""
        ck = self.cfg.checkpoint
        if self.quorum is not None:  # (backup workers: the first worker's checkpoint asked alone, in first)
            self.quorum.finish_asked(block=True)
        saved = self.saved_at == global_step
        if self.quorum is not None and ck.final and not preempted:
            saved = bool(self.workers.largest(int(saved), "agreement on the last checkpoint"))
        if ck.dir and ck.final and not preempted and not saved:
            self.save(self.cfg.train.epochs + 1, 1, global_step, "end of training")
        self._delta_committed()
        if self.delta_pauses:
            p = self.delta_pauses
            bound = self.cfg.checkpoint.delta_every_s
            lost = (f"; a kill would have lost at most {self.schedule.most_lost:.2f} s of training "
                    f"(checkpoint.delta_every_s = {bound:g} bounds it)" if bound and self.schedule.most_lost else "")
            print(f"hpcps train: {len(p)} delta snapshot(s); training waited {sum(p):.2f} s for them in all "
                  f"(median {sorted(p)[len(p) // 2]:.3f} s, longest {max(p):.3f} s){lost}", flush=True)

    def save(self, epoch_next: int, step_next: int, global_step: int, reason: str, delta: bool = False) -> bool:
        """Collective over the workers: a checkpoint (or a delta snapshot, when one can be taken)
        whose position is the step to run next; whether it was committed (a signal's; else True)."""
        t, path = time.perf_counter(), None
        self.pipeline.finish()  # every worker: its pushes acknowledged
        flush_filters(self.ctx, self.pipeline)  # (filters.push_threshold: the checkpoint holds every update)
        if self.first:
            if self.quorum is not None:
                self.quorum.finish_asked(block=True)  # (backup workers: a checkpoint asked alone, in first)
            delta = self.delta_possible(delta)
            self.schedule.taken(self.step_at, "delta" if delta else "full")  # (its data point: the step's end)
            path = self.ctx.save_checkpoint(self.cfg.checkpoint.dir, global_step,
                                            self.manifest(epoch_next, step_next, global_step, reason, delta),
                                            self.cfg.checkpoint.keep, delta=self.commits if delta else None,
                                            track=self.deltas_on and not delta, for_signal=reason == "signal")
            self.committed(path, reason, delta)
            if delta:
                self.delta_pauses.append(time.perf_counter() - t)  # (the rows copied; written meanwhile)
        self.workers.wait_for_all("checkpoint barrier")
        return reason != "signal" or self.workers.first_decides(path is not None, "the signal's checkpoint committed")

    def delta_possible(self, delta: bool) -> bool:
        """First worker: whether a delta snapshot asked for can be one (the one before committed;
        a full checkpoint to take it over, and fewer than ``full_every - 1`` deltas over it)."""
        self._delta_committed()  # (the one before, written)
        return delta and self.chain is not None and len(self.chain["deltas_before"]) + 1 < self.cfg.checkpoint.full_every

    def manifest(self, epoch_next: int, step_next: int, global_step: int, reason: str, delta: bool) -> dict:
        """First worker: what a checkpoint's manifest says beside the servers' files."""
        cfg = self.cfg
        manifest = {
            "run_id": self.plan.run_id, "model_fingerprint": cfg.model_fingerprint(), "config": cfg.to_dict(),
            "reason": reason,
            "position": {"epoch": epoch_next, "step": step_next, "global_step": global_step},
            "data": {**self.data_meaning, "random_state": "none: the loop draws no random numbers"},
            "fields": self.model.fields, "input_format": self.plan.input_format}
        return {**manifest, "snapshot": "delta", **self.chain} if delta else manifest

    def committed(self, path: str | None, reason: str, delta: bool) -> bool:
        """First worker: a checkpoint written at ``path`` (a full one: said, the newest, and the
        one deltas follow), or missed (None: some servers may have taken their snapshot, so the
        next one is full). Returns whether it was written."""
        if path is None:
            self.chain = None
            self.schedule.missed()
            return False
        if not delta:
            self._snapshot_committed(time.monotonic())
            self.written, self.last_save = path, time.monotonic()
            if self.deltas_on:
                self._extend_chain(path, checkpoint.read_manifest(path))
            print(f"hpcps train: checkpoint {path} ({reason})", flush=True)
        return True

    def _delta_committed(self) -> None:
        """First worker: wait for the delta snapshot being committed; the next one is taken over
        it, or, when it failed, the next snapshot is a full one."""
        if not self.first or self.commits.thread is None:
            return
        self.commits.wait()
        self._note_commit()
        if self.commits.last:
            self.written = self.commits.last[0]
            self._extend_chain(self.commits.last[0], checkpoint.read_manifest(self.commits.last[0]))
        else:
            self.chain = None
