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
from hpcps.ps.collectives import World
from hpcps.ps.context import init
from hpcps.train import data as tdata
from hpcps.train import model_file
from hpcps.train.checkpointing import EXIT_INTERRUPTED, Checkpointing, catch_stop_signals
from hpcps.train.early_stop import EarlyStopping
from hpcps.train.evaluation import evaluate, predict
from hpcps.train.feed import BatchFeed
from hpcps.train.loading import initial_bias, load_part, model_fields
from hpcps.train.models import NonFiniteError, make_model
from hpcps.train.pipeline import StepPipeline
from hpcps.train.plan import RunPlan, TrainError, agree_on_plan, check_output_paths
from hpcps.train.progress import vm_hwm_mb
from hpcps.train.report import Reporter


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


def agree_on_the_end(ctx, preempted: int) -> dict:
    """Collective over the world (servers after serving, workers before finalizing; workers first
    tell the servers they are done, so that the servers leave their loop and join): the exit
    status of a stop on a signal (the largest of the ranks' ``preempted``, 0 for none), the
    largest peak memory of a worker and of a server (MiB), and the servers' key counts summed
    (rows held, keys admitted, rows evicted)."""
    if ctx.is_worker:
        ctx.finish_serving()
    rss = _peak_rss_mb()
    flag = ctx.every_rank.reduce(np.array([float(preempted), rss if ctx.is_worker else 0.0,
                                           rss if ctx.is_server else 0.0]), "max", "agreement on the end of training")
    st = ctx.server_stats or {}  # server ranks, or a one-process job's in-process server
    counts = np.array([sum(st.get(k, [])) for k in ("keys", "admitted", "evicted")], dtype=np.int64)
    counts = ctx.every_rank.reduce(counts, "sum", "sum of the servers' key counts")
    keys = {"table_keys": int(counts[0]), "admitted_keys": int(counts[1]), "evicted_keys": int(counts[2])}
    return {"preempted": int(flag[0]), "worker_rss": float(flag[1]), "server_rss": float(flag[2]), "key_counts": keys}


def run(cfg, comm=None) -> Result:
    """Train as configured (collective over ``comm``, default the world): :meth:`Trainer.run`."""
    return Trainer(cfg, comm).run()


class Trainer:
    """One training run, collective over the world, in named phases (:meth:`run` reads as the list):

    1. :meth:`agree_on_plan`: the output paths checked, the stop signals caught, and every rank's
       :class:`~hpcps.train.plan.RunPlan` (the checkpoint to resume, the data, the batch size);
    2. :meth:`connect_and_load`: the context (servers and worker groups), the data parts, the
       model and its step pipeline;
    3. servers :meth:`serve` until the workers are done, and write the model;
    4. workers :meth:`plan_steps` (steps per epoch, where training starts, the batch feed, the
       reporter, checkpointing), then for each epoch :meth:`train_epoch` (each :meth:`step`, a
       checkpoint when due, an evaluation when due) and :meth:`end_epoch` (its record: losses,
       stage times, test and holdout metrics, early stopping);
    5. :meth:`keep_best` (early stopping's model back on the servers), :meth:`finish` (the final
       checkpoint, predictions, the summary).
    """

    NO_CHECKPOINT = "no checkpoint to write (checkpoint.dir is not set)"  # what a stop signal's line says
    # Tune's grid trains members with other rates side by side: a member that diverges is ranked
    # last (its holdout loss is NaN), it does not stop the others (see hpcps.train.tune)
    check_finite = True

    def __init__(self, cfg, comm=None):
        self.cfg = cfg  # (train.batch_size resolved once the plan is agreed)
        self.world = World(comm, cfg.cluster.stall_timeout_s)
        self.holdout_phase = -1  # train.holdout holds out the rows r % N == phase % N (the last of N)
        self.plan: RunPlan | None = None
        self.ctx = None
        self.train = self.test = self.to_predict = None  # this worker's parts of the data files
        self.model = None
        self.pipeline: StepPipeline | None = None
        self.early: EarlyStopping | None = None
        self.workers = None  # the collectives among the workers (a worker's)
        self.feed: BatchFeed | None = None
        self.reporter: Reporter | None = None
        self.checkpoints: Checkpointing | None = None
        self.steps, self.scale = 0, 1.0  # steps per epoch, and the gradient's scale
        self.start = (1, 1, 0)  # where training starts: epoch, step, and the steps done before
        self.global_step = 0  # steps done since the start of training
        self.history: list[dict] = []  # the epochs' records
        self.preempted = 0  # the exit status of a stop by a signal after its checkpoint (Result.preempted)

    # -- 1-3: every rank ---------------------------------------------------------------------------

    def run(self) -> Result:
        self.agree_on_plan()
        self.connect_and_load()
        if self.ctx.is_server:
            return self.serve()
        self.plan_steps()
        for epoch in range(self.start[0], self.cfg.train.epochs + 1):
            self.train_epoch(epoch)
            if self.preempted or self.end_epoch(epoch):
                break
        self.keep_best()
        return self.finish()

    def agree_on_plan(self) -> None:
        check_output_paths(self.cfg, self.world)
        catch_stop_signals(self.cfg, self.world, self.NO_CHECKPOINT)
        self.plan = agree_on_plan(self.cfg, self.world)
        self.cfg = self.plan.cfg

    def connect_and_load(self) -> None:
        cfg, cl, paths = self.cfg, self.cfg.cluster, self.plan.paths
        self.ctx = ctx = init(servers=cl.servers, worker_groups=cl.worker_groups or None, staleness=cl.staleness,
                              num_shards=cl.num_shards, stall_warn_s=cl.stall_warn_s,
                              stall_timeout_s=cl.stall_timeout_s, comm=self.world.comm)
        self.train = load_part(ctx, cfg, paths["train"], "training", stream=True)
        self.test = load_part(ctx, cfg, paths["test"], "test")
        self.to_predict = load_part(ctx, cfg, cfg.data.predict, "prediction")
        bias, fields = initial_bias(ctx, cfg, self.train), model_fields(ctx, cfg, paths["train"])
        self.model = self.build_model(bias, fields)
        self.model.hashed_keys = getattr(self.train, "fmt", "") in tdata.HASHED_FORMATS
        self.pipeline = StepPipeline(ctx, self.model)
        self.early = self.early_stopping()

    def build_model(self, bias: float, fields: int):
        return make_model(self.ctx, self.cfg, bias, fields)

    def early_stopping(self) -> EarlyStopping:
        return EarlyStopping(self.ctx, self.cfg)

    def serve(self) -> Result:
        """A server rank: answer requests until every worker is done, then write the model."""
        ctx = self.ctx
        ctx.serve(self.plan.restore)
        preempted = agree_on_the_end(ctx, 0)["preempted"]
        if self.cfg.train.model_out and not preempted:
            agree_model_written(ctx, export_model(ctx, self.cfg, self.model, self.plan.input_format))
        ctx.finalize()
        return Result(None, preempted, self.plan.resumed)

    # -- 4: workers --------------------------------------------------------------------------------

    def plan_steps(self) -> None:
        """Steps per epoch, the gradient's scale, where training starts, and the parts of the loop."""
        cfg, ctx, tr, plan = self.cfg, self.ctx, self.cfg.train, self.plan
        if ctx.local and plan.restore is not None:  # one process: its in-process server loads the checkpoint
            ctx.restore(*plan.restore)
        self.workers = workers = ctx.among_workers
        if isinstance(self.train, tdata.PartStream):
            if cfg.data.parse_thread:
                self.train.start_thread()  # parse ahead on a thread (stopped in finish)
            else:
                ctx.background = self.train.pump  # parse ahead while steps wait for the servers
        # every worker takes the same number of steps: enough for the largest part (its lines: blank,
        # comment or skipped lines only add empty steps at the end)
        self.steps = workers.largest(math.ceil(self.train.rows_bound / tr.batch_size), "agreement on steps per epoch")
        # "sum": each row's gradient counts in full (per-coordinate optimizers like FTRL and AdaGrad
        # set their own step sizes, and a mean would shrink rare keys' gradients by the batch size);
        # "mean": the gradient of the mean loss over the group's rows (the objective of plain SGD).
        self.scale = 1.0 if tr.gradient == "sum" else 1.0 / (tr.batch_size * ctx.within_group.size)
        self.start = plan.start(self.steps)
        self.global_step = self.start[2]
        if plan.restore is not None:
            ctx.clock_value = plan.restore[1]["clock"]
        self.reporter = Reporter(ctx, plan, self.steps, workers.is_first)
        self.reporter.say_start(self.model, self.train, self.start)
        self.checkpoints = Checkpointing(ctx, plan, self.pipeline, self.model, workers.is_first)
        self.checkpoints.agree_on_resumed(self.global_step)
        self.reporter.say_nothing_left(self.start[0])
        self.feed = BatchFeed(cfg, self.train, self.steps, self.holdout_phase, self.model.reads_keys,
                              World.end_job_with)

    def train_epoch(self, epoch: int) -> None:
        """The epoch's steps (from the resumed step in the first); sets ``preempted`` when a stop
        signal ended it after a checkpoint."""
        first_step = self.start[1] if epoch == self.start[0] else 1
        self.reporter.start_epoch(first_step)
        self.feed.start_epoch(bool(self.cfg.train.holdout and self.early.holdout is None and first_step == 1))
        for step in range(first_step, self.steps + 1):
            self.step(epoch, step)
            self.preempted = self.checkpoints.if_due(epoch, step, self.global_step)
            if self.preempted:
                break
            tr = self.cfg.train
            if tr.eval_every and self.test is not None and step % tr.eval_every == 0 and step != self.steps:
                self.reporter.epoch_end(epoch, {"step": step, **self.evaluate(self.test)})
        self.pipeline.finish()

    def step(self, epoch: int, step: int) -> None:
        i = (epoch - 1) * self.steps + step - 1
        batch = self.feed.take(i)
        upcoming = self.feed.upcoming(i, self.pipeline.pulls_ahead)
        try:
            loss = self.train_step(batch, upcoming)
        except NonFiniteError as e:  # this worker ends the job at once (exit 1), before any checkpoint or model
            labels = f" (the batch's labels: {batch.labels.min():g} to {batch.labels.max():g})" if batch.rows else ""
            World.end_job_with("error: " + self.reporter.non_finite_line(
                f"at step {self.global_step + 1} (epoch {epoch}, step {step} of {self.steps})", f"{e}{labels}",
                self.train, self.model, sparse_rows_finite=not e.tables), 1)
        self.global_step += 1
        self.reporter.step(epoch, step, batch.rows, loss, self.global_step, self.model.table.key_counts)

    def train_step(self, batch, upcoming) -> float:
        """One step of the pipeline; its summed loss."""
        return self.pipeline.step(batch, self.scale, upcoming)

    def evaluate(self, ds) -> dict:
        return evaluate(self.ctx, self.pipeline, ds, self.cfg.train.batch_size, self.cfg.model.loss)

    def end_epoch(self, epoch: int) -> bool:
        """Collective over the workers: the epoch's record (train loss, stage times, test and
        holdout metrics), written to the progress and metrics. Stops the job when a metric is not
        finite (the model is not). Returns True when early stopping ends training here."""
        record = self.reporter.epoch_record(self.pipeline.stage_times(), self.workers, self.stop)
        if self.test is not None:
            record.update(self.evaluate(self.test))
        bad = self.reporter.non_finite(record)
        if bad and self.check_finite:
            self.stop(self.reporter.non_finite_line(f"after epoch {epoch} ({self.global_step} steps)", bad,
                                                    self.train, self.model), 1)
        if self.feed.collecting and not self.early.set_holdout(self.feed.holdout_set(), self.workers):
            n = self.cfg.train.holdout  # (its loss would read 0: a silently wrong number)
            self.stop(f"train.holdout = {n} holds out no row: every worker's part has fewer than {n} rows "
                      f"({self.reporter.examples} rows trained an epoch); use a smaller train.holdout or more data", 2)
        stopped = self.early.holdout is not None and self.early.after_epoch(epoch, record, self.evaluate, self.model,
                                                                             self.workers.is_first)
        self.history.append(record)
        self.reporter.epoch_end(epoch, record)
        return stopped

    def stop(self, message: str, code: int) -> None:
        """Collective over the workers: end the job, the first worker saying why in one line."""
        self.workers.end_job_by_first(f"error: {message}", code)

    # -- 5: workers --------------------------------------------------------------------------------

    def keep_best(self) -> None:
        """Collective over the workers: with early stopping, the servers go back to the best
        epoch's model (the one exported, checkpointed and summarised) unless it is the last."""
        last = len(self.history) + self.start[0] - 1
        if self.preempted or not self.early.restore_best(last, self.model, self.workers):
            return
        self.pipeline.finish()  # the deep models' MLP replica: the restored one
        if self.test is not None:  # the summary describes the model kept
            self.history.append({**self.history[-1], **self.evaluate(self.test),
                                 f"holdout_{self.early.metric}": self.early.best["loss"]})

    def finish(self) -> Result:
        """The final checkpoint, predictions, the end of serving, the model (one process) and the
        summary (printed and returned on the first worker)."""
        cfg, ctx, first = self.cfg, self.ctx, self.workers.is_first
        elapsed = time.perf_counter() - self.reporter.t0
        if isinstance(self.train, tdata.PartStream):
            self.train.stop_thread()
        self.checkpoints.at_the_end(self.global_step, self.preempted)
        ending = self.agree_on_totals()
        if self.preempted:  # stopped by a signal after checkpointing
            agree_on_the_end(ctx, self.preempted)
            ctx.finalize()
            if first:
                name = "SIGINT" if self.preempted == EXIT_INTERRUPTED else "a signal"
                print(f"hpcps train: stopped by {name} after checkpoint {self.checkpoints.written}; rerun with "
                      f"--resume auto to continue (exit status {self.preempted})", flush=True)
            return Result(None, self.preempted, self.plan.resumed)
        ending.update(agree_on_the_end(ctx, 0))
        if cfg.train.model_out:  # (one process: no server rank writes the model; this one does)
            agree_model_written(ctx, export_model(ctx, cfg, self.model, self.plan.input_format) if ctx.local else None)
        ctx.finalize()
        if not first:
            return Result(None, 0, self.plan.resumed)
        kept_mb = self.feed.kept_batches_mb()  # the first worker's batches kept across epochs, compacted
        extra = {"kept_batches_mb": kept_mb} if kept_mb is not None else {}
        if cfg.checkpoint.dir:
            extra["checkpoint"] = self.checkpoints.written  # this run's newest (None: it wrote none)
        if self.early.holdout is not None:
            extra.update(self.early.summary(cfg.train.epochs))
        summary = self.reporter.summary(elapsed, ending, self.history[-1] if self.history else {}, extra,
                                        ending["predicted"])
        self.report(summary, elapsed, ending["wait"], ending["key_counts"])
        return Result(summary, 0, self.plan.resumed)

    def agree_on_totals(self) -> dict:
        """Collective over the workers, at the end: the lines skipped, the predictions (written),
        the longest wait and the traffic."""
        workers, ctx, tr = self.workers, self.ctx, self.cfg.train
        skipped = workers.total(self.train.skipped + (self.test.skipped if self.test else 0), "sum of skipped lines")
        if skipped and workers.is_first:
            print(f"hpcps train: {skipped} bad lines skipped", flush=True)
        predicted = 0
        if self.to_predict is not None and not self.preempted:
            predicted = predict(ctx, self.pipeline, self.to_predict, tr.batch_size, self.cfg.model.loss,
                                self.cfg.data.predict_out)
        self.reporter.close()
        wait = workers.largest(float(ctx.stats["wait_s"]), "agreement of the workers")
        traffic = workers.reduce(np.array([ctx.stats["bytes_sent"], ctx.stats["bytes_received"]], dtype=np.int64),
                                 "sum", "sum of the bytes sent and received")
        return {"skipped": skipped, "predicted": predicted, "wait": wait, "traffic": traffic}

    def report(self, summary: dict, elapsed: float, wait: float, key_counts: dict) -> None:
        """On the first worker: the summary table, where things went and what to try next."""
        self.reporter.print_summary(summary, elapsed, wait, key_counts, self.checkpoints.written)
