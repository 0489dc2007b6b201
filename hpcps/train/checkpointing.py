"""When a training run writes checkpoints, and what they hold: :class:`Checkpointing`.

``[checkpoint]``: a checkpoint every ``every_steps`` steps or ``every_s`` seconds, one at the end
(``final``), and one on a stop signal. SIGINT, SIGTERM and SIGUSR1 are caught: with a checkpoint
directory, at the next step (a checkpoint, then exit 130 after SIGINT, 75 after the others, or
training goes on with ``on_signal = "continue"``); without one, at once (exit 128 + the signal).
Every worker agrees on each decision; the first worker asks the servers to write and writes the
manifest, whose position is the step to run next.
"""

from __future__ import annotations

import signal
import time

from hpcps.ps import signals

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

    def __init__(self, ctx, plan, pipeline, model, first: bool):
        self.ctx, self.plan, self.cfg = ctx, plan, plan.cfg
        self.pipeline, self.model = pipeline, model
        self.first = first
        self.workers = ctx.among_workers
        self.written: str | None = None  # the newest checkpoint this run wrote (first worker)
        self.data_meaning = plan.data_meaning() if (first and self.cfg.checkpoint.dir) else None
        self.last_save = time.monotonic()
        self.saved_at = -1  # the step of this run's newest checkpoint in checkpoint.dir

    def agree_on_resumed(self, global_step: int) -> None:
        """Collective over the workers: the checkpoint resumed counts as this run's newest when it
        lies in ``checkpoint.dir`` and means the same data (a run with nothing left to train then
        writes none)."""
        here = self.plan.resumes_from_its_checkpoint_dir()
        if self.workers.smallest(int(here), "agreement on the checkpoint resumed"):
            self.saved_at = global_step

    def if_due(self, epoch: int, step: int, global_step: int) -> int:
        """Collective over the workers, after step ``step`` of ``epoch``: a checkpoint when one is
        due somewhere (a stop signal, a periodic one). Returns the exit status the run stops with
        on the signal (130 after SIGINT, 75 after the others), else 0."""
        ck = self.cfg.checkpoint
        if not ck.dir:
            return 0
        # 3 = SIGINT somewhere, 2 = another stop signal, 1 = a periodic checkpoint is due; all workers agree
        sig = self.ctx.stop_signal
        want = (3 if sig == signal.SIGINT else 2) if sig else int(
            bool(ck.every_steps and global_step % ck.every_steps == 0)
            or bool(self.first and ck.every_s and time.monotonic() - self.last_save >= ck.every_s))
        want = self.workers.largest(want, "agreement on checkpointing")
        if not want:
            return 0
        self.save(epoch, step + 1, global_step, "signal" if want >= 2 else "periodic")
        self.saved_at, self.last_save = global_step, time.monotonic()
        if want >= 2:
            if ck.on_signal == "exit" or want == 3:  # (SIGINT always stops)
                return EXIT_INTERRUPTED if want == 3 else EXIT_PREEMPTED
            signals.clear()
            self.ctx.server_stop = 0
        return 0

    def at_the_end(self, global_step: int, preempted: int) -> None:
        """Collective over the workers: the final checkpoint (``checkpoint.final``), unless the
        run stopped on a signal or its last step's is written already."""
        ck = self.cfg.checkpoint
        if ck.dir and ck.final and not preempted and self.saved_at != global_step:
            self.save(self.cfg.train.epochs + 1, 1, global_step, "end of training")

    def save(self, epoch_next: int, step_next: int, global_step: int, reason: str) -> None:
        """Collective over the workers: a checkpoint whose position is the step to run next."""
        ctx, cfg = self.ctx, self.cfg
        self.pipeline.finish()  # every worker: its pushes acknowledged
        if self.first:
            path = ctx.save_checkpoint(cfg.checkpoint.dir, global_step, {
                "run_id": self.plan.run_id, "model_fingerprint": cfg.model_fingerprint(), "config": cfg.to_dict(),
                "reason": reason,
                "position": {"epoch": epoch_next, "step": step_next, "global_step": global_step},
                "data": {**self.data_meaning, "random_state": "none: the loop draws no random numbers"},
                "fields": self.model.fields, "input_format": self.plan.input_format}, cfg.checkpoint.keep)
            self.written = path
            print(f"hpcps train: checkpoint {path} ({reason})", flush=True)
        self.workers.wait_for_all("checkpoint barrier")
