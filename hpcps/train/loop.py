"""The training loop: read batch → unique keys → pull → forward/backward → push → clock.

Run on every rank (collective). Servers serve; workers each read their own byte range of the
training file and step through it in batches of ``train.batch_size`` rows for ``train.epochs``.
All workers take the same number of steps per epoch (the largest of their batch counts; a worker
out of rows takes empty steps), so worker groups and clocks stay in step. The gradient of a step
is the sum over the worker group's rows (``train.gradient = "sum"``) or their mean.

:class:`Trainer` orchestrates a run's parts, each in its module: the plan every rank agrees on
(:mod:`~hpcps.train.plan`), the data and the model's start (:mod:`~hpcps.train.loading`), the
step's messages (:mod:`~hpcps.train.pipeline`), the batches (:mod:`~hpcps.train.feed`), early
stopping (:mod:`~hpcps.train.early_stop`), checkpoints (:mod:`~hpcps.train.checkpointing`),
scoring (:mod:`~hpcps.train.evaluation`) and what the run says (:mod:`~hpcps.train.report`).
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass

import numpy as np

from hpcps import outputs
from hpcps.ps import failover
from hpcps.ps.collectives import World
from hpcps.ps.context import init
from hpcps.ps.filters import SATURATED_KEY, SAVED_KEYS
from hpcps.train import data as tdata
from hpcps.train import model_file
from hpcps.train.checkpointing import Checkpointing, catch_stop_signals
from hpcps.train.early_stop import EarlyStopping
from hpcps.train.evaluation import evaluate, kept_for_scoring, predict
from hpcps.train.feed import BatchFeed
from hpcps.train.flush import flush_filters
from hpcps.train.loading import initial_bias, load_part, model_fields, parse_ahead
from hpcps.train.models import NonFiniteError, make_model
from hpcps.train.pipeline import StepPipeline
from hpcps.train.plan import (RunPlan, TrainError, agree_on_plan, backup_of, check_output_paths, gradient_scale,
                              release_checkpoints)
from hpcps.train.progress import vm_hwm_mb
from hpcps.train.report import Reporter
from hpcps.train.stragglers import LateWorker, agree_on_stalls
from hpcps.train.takeover import Takeover


@dataclass
class Result:
    summary: dict | None      # on the first worker
    preempted: int            # on every rank: the exit status of a stop by a signal after its checkpoint
                              # (75 after SIGTERM or SIGUSR1, 130 after SIGINT), else 0
    resumed_from: str = ""


def export_model(ctx, cfg, model, input_format: str) -> str | None:
    """Collective over the servers (or the one process): write the trained model's tables, with
    what it was trained on (:func:`hpcps.train.model_file.trained_on`). Returns why the write
    failed (on the server that wrote), else None."""
    try:
        model_file.export_from_servers(ctx, [t.name for t in model.all_tables], cfg.train.model_out,
                                       {"model": cfg.model.type, "loss": cfg.model.loss,
                                        "config": json.dumps(cfg.to_dict()), "fields": model.fields,
                                        **model_file.trained_on(input_format, cfg.data.hash_bits)})
    except outputs.OutputError as e:
        return str(e)
    return None


def agree_model_written(ctx, error: str | None) -> None:
    """Collective over the world: raise on every rank when the model's write failed (the rank
    that failed reports it; exit status 1), so that no rank reports a model that is not there."""
    errors = ctx.every_rank.failures(error, "agreement on the model's write")
    if errors:
        raise TrainError(error or "", status=1)



def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (getrusage where /proc is missing)."""
    peak = vm_hwm_mb()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def agree_on_the_end(ctx, preempted: int, loop_cpu_s: float = 0.0) -> dict:
    """Collective over the world (servers after serving, workers before finalizing; workers first
    tell the servers they are done, so that the servers leave their loop and join): the exit
    status of a stop on a signal (the largest of the ranks' ``preempted``, 0 for none), the
    largest peak memory of a worker and of a server (MiB), the largest CPU time of a worker's
    and of a server's loop (``loop_cpu_s``: this rank's, from its first step or the start of its
    serving; the scaling model's CPU cost per row; a one-process job's server is in its worker's),
    and the servers' key counts summed (rows held, keys admitted, rows evicted)."""
    if ctx.is_worker:
        ctx.finish_serving()
    rss = _peak_rss_mb()

    def sums():
        flag = ctx.every_rank.reduce(np.array([float(preempted), rss if ctx.is_worker else 0.0,
                                               rss if ctx.is_server else 0.0, loop_cpu_s if ctx.is_worker else 0.0,
                                               loop_cpu_s if ctx.is_server else 0.0]),
                                     "max", "agreement on the end of training")
        failover.killed_here_in_tests(ctx, "summing")
        st = ctx.server_stats or {}  # server ranks, or a one-process job's in-process server
        counts = np.array([sum(st.get(k, [])) for k in ("keys", "admitted", "evicted")], dtype=np.int64)
        counts = ctx.every_rank.reduce(counts, "sum", "sum of the servers' key counts")
        return flag, counts, ctx.compare_replicas()  # (cluster.replicas: every backup against its primary)

    # (under ULFM, a server lost after the last request that would have met its loss: failed over first)
    flag, counts, replicas = failover.after_serving(ctx, sums)
    ctx.warn_of_differing_replicas(replicas)
    counts[1:] //= ctx.placement.replicas + 1  # (every copy of a shard admits and evicts the same keys)
    keys = {"table_keys": int(counts[0]), "admitted_keys": int(counts[1]), "evicted_keys": int(counts[2]), **replicas}
    return {"preempted": int(flag[0]), "worker_rss": float(flag[1]), "server_rss": float(flag[2]),
            "worker_loop_cpu_s": float(flag[3]), "server_loop_cpu_s": float(flag[4]), "key_counts": keys,
            "stalled_workers": agree_on_stalls(ctx)}


def serve(ctx, cfg, plan, model) -> Result:
    """A server rank: answer requests until every worker is done, then write the model."""
    cpu0 = time.process_time()
    ctx.serve(plan.restore)
    failover.killed_here_in_tests(ctx, "served")
    preempted = agree_on_the_end(ctx, 0, time.process_time() - cpu0)["preempted"]
    if cfg.train.model_out and not preempted:
        agree_model_written(ctx, export_model(ctx, cfg, model, plan.input_format))
    ctx.finalize()
    return Result(None, preempted, plan.resumed)


def end_the_run(ctx, plan, model, pipeline, parts: tuple, preempted: int, reporter) -> dict:
    """A worker once the steps are done (collective over the workers, then over the world): the
    lines skipped in the ``parts`` (training, test and prediction: said), the predictions (written,
    unless the run stopped on a signal), the end of the progress, the longest wait, the traffic,
    the end of serving (:func:`agree_on_the_end`), the model (one process: this rank writes it)
    and the context finalized. Returns the totals for the summary."""
    cfg, workers = plan.cfg, ctx.among_workers
    train, test, to_predict = parts
    skipped = workers.total(train.skipped + (test.skipped if test else 0), "sum of skipped lines")
    if skipped and workers.is_first:
        print(f"hpcps train: {skipped} bad lines skipped", flush=True)
    predicted = 0
    if to_predict is not None and not preempted:
        predicted = predict(ctx, pipeline, to_predict, cfg.train.batch_size, cfg.model.loss, cfg.data.predict_out)
    reporter.close()
    wait = workers.largest(float(ctx.stats["wait_s"]), "agreement of the workers")
    traffic = workers.reduce(np.array([ctx.stats.get(k, 0) for k in ("bytes_sent", "bytes_received", "requests",
                                                                    *SAVED_KEYS, SATURATED_KEY)], dtype=np.int64),
                             "sum", "sum of the bytes and requests sent and received, and of the bytes filters saved")
    ending = {"skipped": skipped, "predicted": predicted, "wait": wait, "traffic": traffic,
              **agree_on_the_end(ctx, preempted, time.process_time() - reporter.cpu0)}
    if not preempted and cfg.train.model_out:  # (one process: no server writes the model; this one does)
        agree_model_written(ctx, export_model(ctx, cfg, model, plan.input_format) if ctx.local else None)
    ctx.finalize()
    return ending


def restore_on_worker(ctx, plan) -> None:
    """A worker of a resumed run: its clock continues from the checkpoint's (and a job of one
    process loads the checkpoint into its in-process server)."""
    if plan.restore is not None:
        if ctx.local:
            ctx.restore(*plan.restore)
        ctx.clock_value = plan.restore[1]["clock"]


def agree_on_steps(workers, train, batch_size: int) -> int:
    """Collective over the workers: the steps of an epoch. Every worker takes the same number:
    enough for the largest part (its lines: blank, comment or skipped lines only add empty steps
    at the end)."""
    return workers.largest(math.ceil(train.rows_bound / batch_size), "agreement on steps per epoch")


def run(cfg, comm=None) -> Result:
    """Train as configured (collective over ``comm``, default the world): :meth:`Trainer.run`."""
    return Trainer(cfg, comm).run()


class Trainer:
    """One training run, collective over the world, in named phases (:meth:`run` reads as the list):
    :meth:`agree_on_plan` (a :class:`~hpcps.train.plan.RunPlan` every rank agrees on), then
    :meth:`connect_and_load` (the context, the data parts, the model and its step pipeline);
    servers then :func:`serve`; workers :meth:`plan_steps`, then for each epoch :meth:`train_epoch`
    (its steps, checkpoints and evaluations when due) and :meth:`end_epoch` (its record, early
    stopping), then early stopping's best model is kept and :meth:`finish` writes the final
    checkpoint and the summary."""

    NO_CHECKPOINT = "no checkpoint to write (checkpoint.dir is not set)"  # what a stop signal's line says
    check_finite = True  # a non-finite epoch record stops the job (not a grid's: see hpcps.train.tune)

    def __init__(self, cfg, comm=None):
        self.cfg = cfg  # (train.batch_size resolved once the plan is agreed)
        self.world = World(comm, cfg.cluster.stall_timeout_s)
        self.holdout_phase = -1  # train.holdout holds out the rows r % N == phase % N (the last of N)
        self.plan: RunPlan | None = None
        self.ctx = self.workers = None  # the context, and the collectives among its workers
        self.train = self.test = self.to_predict = None  # this worker's parts of the data files
        self.model, self.pipeline, self.early = None, None, None  # the model, its StepPipeline, EarlyStopping
        self.feed: BatchFeed | None = None
        self.late: LateWorker | None = None  # backup workers: this worker's skips when late
        self.takeover: Takeover | None = None
        self.reporter, self.checkpoints = None, None  # its Reporter and Checkpointing
        self.steps, self.scale = 0, 1.0  # steps per epoch, and the gradient's scale
        self.start = (1, 1, 0)  # where training starts: epoch, step, and the steps done before
        self.global_step = 0  # steps done since the start of training
        self.history: list[dict] = []  # the epochs' records
        self.preempted = 0  # the exit status of a stop by a signal after its checkpoint (Result.preempted)

    def run(self) -> Result:
        try:
            return self._run()
        finally:  # the first rank's lock on checkpoint.dir (plan.claim_checkpoints), for the next run
            release_checkpoints(self.cfg)

    def _run(self) -> Result:
        self.agree_on_plan()
        self.connect_and_load()
        if self.ctx.is_server:
            return serve(self.ctx, self.cfg, self.plan, self.model)
        self.plan_steps()
        for epoch in range(self.start[0], self.cfg.train.epochs + 1):
            self.train_epoch(epoch)
            if self.preempted or self.end_epoch(epoch):
                break
        if not self.preempted:  # early stopping's best model back on the servers
            self.early.keep_best(self.history, self.start[0], self.model, self.pipeline, self.workers,
                                 self.evaluate, self.test)
        return self.finish()

    def agree_on_plan(self) -> None:
        missing = self.world.fault_tolerance_missing(self.cfg.cluster.fault_tolerance)
        if missing:  # (the same on every rank: the first says it)
            raise TrainError(f"cluster.fault_tolerance = \"ulfm\": {missing}" if self.world.is_first else "")
        check_output_paths(self.cfg, self.world)
        catch_stop_signals(self.cfg, self.world, self.NO_CHECKPOINT)
        self.plan = agree_on_plan(self.cfg, self.world)
        self.cfg = self.plan.cfg

    def connect_and_load(self) -> None:
        cfg, cl, paths = self.cfg, self.cfg.cluster, self.plan.paths
        self.ctx = ctx = init(servers=cl.servers, worker_groups=cl.worker_groups or None, staleness=cl.staleness,
                              num_shards=cl.num_shards, stall_warn_s=cl.stall_warn_s,
                              stall_timeout_s=cl.stall_timeout_s, comm=self.world.comm, backup=backup_of(cfg),
                              traffic=cfg.filters.traffic(), replicas=cl.replicas, fault_tolerance=cl.fault_tolerance)
        self.train = load_part(ctx, cfg, paths["train"], "training", stream=True)
        self.test = load_part(ctx, cfg, paths["test"], "test")
        self.to_predict = load_part(ctx, cfg, cfg.data.predict, "prediction")
        bias, fields = initial_bias(ctx, cfg, self.train), model_fields(ctx, cfg, paths["train"])
        self.model = self.build_model(bias, fields)
        self.model.hashed_keys = getattr(self.train, "fmt", "") in tdata.HASHED_FORMATS
        self.test = kept_for_scoring(self.test, self.model, cfg.train.batch_size)  # (deduplicated once)
        self.pipeline = StepPipeline(ctx, self.model)
        self.early = self.early_stopping()

    def build_model(self, bias: float, fields: int):
        return make_model(self.ctx, self.cfg, bias, fields)

    def early_stopping(self) -> EarlyStopping:
        return EarlyStopping(self.ctx, self.cfg)

    # -- workers -----------------------------------------------------------------------------------

    def plan_steps(self) -> None:
        """Steps per epoch, the gradient's scale, where training starts, and the parts of the loop."""
        cfg, ctx, plan = self.cfg, self.ctx, self.plan
        restore_on_worker(ctx, plan)
        self.workers = workers = ctx.among_workers
        parse_ahead(ctx, cfg, self.train)
        self.steps = agree_on_steps(workers, self.train, cfg.train.batch_size)
        self.scale = gradient_scale(cfg, ctx.within_group.size)
        self.start = plan.start(self.steps)
        self.global_step = self.start[2]
        self.reporter = Reporter(ctx, plan, self.steps, workers.is_first)
        self.reporter.say_start(self.model, self.train, self.start)
        self.checkpoints = Checkpointing(ctx, plan, self.pipeline, self.model, workers.is_first, self)
        self.checkpoints.agree_on_resumed(self.global_step)
        self.reporter.say_nothing_left(self.start[0])
        self.feed = BatchFeed(cfg, self.train, self.steps, self.holdout_phase, self.model.reads_keys,
                              World.end_job_with)
        self.late = LateWorker(ctx, self.model.sparse)
        self.takeover = Takeover(self) if ctx.fault_tolerant else None  # (lost workers' rows: ULFM)

    def train_epoch(self, epoch: int) -> None:
        """The epoch's steps (from the resumed step in the first); sets ``preempted`` when a stop
        signal ended it after a checkpoint."""
        tr = self.cfg.train
        first_step = self.start[1] if epoch == self.start[0] else 1
        self.reporter.start_epoch(first_step)
        self.feed.start_epoch(bool(tr.holdout and self.early.holdout is None and first_step == 1))
        self.late.start_epoch(self.steps - first_step + 1)
        if self.takeover is not None:
            self.takeover.start_epoch()
        step = first_step
        while step <= self.steps:
            if self.late.others_ended():  # backup workers: W - b workers ended the epoch
                i = (epoch - 1) * self.steps + step - 1
                self.global_step += self.late.skip_rest(self.pipeline, self.feed, i, epoch * self.steps)
                break
            self.step(epoch, step)
            done = self.global_step
            self.preempted = self.checkpoints.if_due(epoch, step, done)
            step += self.global_step - done  # (backup workers: the steps a stop's agreement skipped)
            evaluate = tr.eval_every and self.test is not None and step % tr.eval_every == 0 and step != self.steps
            if evaluate and not self.preempted:  # (backup workers: the stop's agreement before it)
                self.preempted = self.checkpoints.at_collective(epoch, step, self.global_step)
            if self.preempted:
                break
            if evaluate:
                self.reporter.epoch_end(epoch, {"step": step, **self.evaluate(self.test)})
            step += 1
        if not self.preempted:  # (backup workers: a stop seen by no worker in the epoch's steps)
            self.preempted = self.checkpoints.at_collective(epoch, self.steps, self.global_step)
        self.pipeline.finish()
        if self.takeover is not None and not self.preempted:
            self.takeover.after_epoch(epoch)
        if not self.preempted:  # (filters.push_threshold: the epoch's model holds every update)
            flush_filters(self.ctx, self.pipeline)

    def step(self, epoch: int, step: int) -> None:
        i = (epoch - 1) * self.steps + step - 1
        batch = self.feed.take(i)
        try:
            loss = self.train_step(batch, self.feed.upcoming(i, self.pipeline.pulls_ahead))
        except NonFiniteError as e:
            self.reporter.end_job_non_finite(e, f"at step {self.global_step + 1} (epoch {epoch}, step {step} of "
                                                f"{self.steps})", batch, self.train, self.model)
        self.global_step += 1
        self.reporter.step(epoch, step, batch.rows, loss, self.global_step, self.model.table.key_counts)

    def train_step(self, batch, upcoming) -> float:
        """One step of the pipeline; its summed loss."""
        return self.pipeline.step(batch, self.scale, upcoming)

    def evaluate(self, ds) -> dict:
        return evaluate(self.ctx, self.pipeline, ds, self.cfg.train.batch_size, self.cfg.model.loss)

    def end_epoch(self, epoch: int) -> bool:
        """Collective over the workers: the epoch's record (train loss, stage times, test and
        holdout metrics), written to the progress and metrics. Returns True when early stopping
        ends training here."""
        stop = self.workers.end_job_by_first  # (the first worker's line, the same on every worker)
        record = self.reporter.epoch_record(self.pipeline.stage_times(), self.workers, stop)
        if self.test is not None:
            record.update(self.evaluate(self.test))
        if self.check_finite:
            self.reporter.check_finite(record, f"after epoch {epoch} ({self.global_step} steps)", self.train,
                                       self.model, stop)
        if self.feed.collecting:
            self.early.set_holdout(self.feed.holdout_set(), self.workers, stop, self.reporter.examples)
        stopped = self.early.holdout is not None and self.early.after_epoch(epoch, record, self.evaluate, self.model,
                                                                             self.workers.is_first)
        self.history.append(record)
        self.reporter.epoch_end(epoch, record)
        return stopped

    def finish(self) -> Result:
        """The final checkpoint, predictions, the end of serving, the model (one process) and the
        summary (printed and returned on the first worker)."""
        resumed = self.plan.resumed
        elapsed = time.perf_counter() - self.reporter.t0
        if isinstance(self.train, tdata.PartStream):
            self.train.stop_thread()
        self.checkpoints.at_the_end(self.global_step, self.preempted)
        ending = end_the_run(self.ctx, self.plan, self.model, self.pipeline, (self.train, self.test, self.to_predict),
                             self.preempted, self.reporter)
        if self.preempted:  # stopped by a signal after checkpointing
            self.reporter.say_stopped(self.preempted, self.checkpoints.written)
            return Result(None, self.preempted, resumed)
        if not self.reporter.first:  # (the context is finalized: its communicators are freed)
            return Result(None, 0, resumed)
        summary = self.reporter.summary(elapsed, ending, self.history[-1] if self.history else {}, self.feed,
                                        self.checkpoints.written, self.early)
        self.report(summary, elapsed, ending["wait"], ending["key_counts"])
        return Result(summary, 0, resumed)

    def report(self, summary: dict, elapsed: float, wait: float, key_counts: dict) -> None:
        """On the first worker: the summary table, where things went and what to try next."""
        self.reporter.print_summary(summary, elapsed, wait, key_counts, self.checkpoints.written)
