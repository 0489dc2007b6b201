"""What a training run says and records: :class:`Reporter`.

On the first worker: the start lines, the progress line and the metrics file
(:class:`~hpcps.train.progress.Progress`), the status file ``hpcps supervise`` watches, each
epoch's record, the one line of a non-finite stop, and at the end the summary table with where
things went and what to try next. Every worker counts its rows and losses with it (the epoch's
record sums them over the workers).
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time

from hpcps import outputs
from hpcps.ps import checkpoint, failover
from hpcps.ps.filters import SATURATED_KEY, SAVED_KEYS
from hpcps.ps.collectives import World
from hpcps.train import data as tdata
from hpcps.train import inputs
from hpcps.train.checkpointing import EXIT_INTERRUPTED
from hpcps.train.evaluation import end_job_on
from hpcps.train.progress import STATUS_ENV, Progress, summary_table, write_status
from hpcps.train.stragglers import stalls_said
from hpcps_kernels import optim
from hpcps_kernels.tuning import STATUS_EVERY_S



class Reporter:
    """A run's progress, records and summary (see the module's docstring), on a worker:
    ``steps`` steps an epoch; ``first``: the first worker (the one that speaks and writes)."""

    def __init__(self, ctx, plan, steps: int, first: bool):
        cfg, tr = plan.cfg, plan.cfg.train
        self.ctx, self.cfg, self.plan, self.steps, self.first = ctx, cfg, plan, steps, first
        resume = plan.restore[1]["position"] if plan.restore is not None else None
        self.progress = Progress(first and tr.progress, steps, ctx.layout.workers, tr.metrics if first else "",
                                 on_error=end_job_on, resume=(resume["epoch"], resume["step"]) if resume else None)
        self.status_path = os.environ.get(STATUS_ENV, "") if first else ""
        self.counting = cfg.features.admission or cfg.features.eviction  # key counts in the progress line
        self.last_status = 0.0
        self.t0 = time.perf_counter()  # the first step begins about now (Trainer.plan_steps ends)
        self.startup_s = process_age_s()  # from this process's start to here (None where unknown)
        self.cpu0 = time.process_time()  # this process's CPU time at its first step
        self.waited_before = 0.0  # ctx.stats["wait_s"] at the end of the last epoch
        self.examples = 0  # rows trained, over every worker, in the epochs ended
        self.loss_sum, self.rows, self.first_step = 0.0, 0, 1  # this epoch's, on this worker

    # -- the start -----------------------------------------------------------------------------

    def say_start(self, model, train, start: tuple[int, int, int]) -> None:
        """The start lines (first worker): the layout, the model, the rows and steps; where a
        resumed run continues; that nothing is left to train."""
        if not self.first:
            return
        cfg, ctx, tr, plan = self.cfg, self.ctx, self.cfg.train, self.plan
        where = "one process (a server and a worker inside it, no messages)" if ctx.local else ctx.layout.describe()
        print(f"hpcps train: {where}; {cfg.model.type} with {cfg.optimizer.name}, staleness "
              f"{cfg.cluster.staleness}; {rows_said(train)} on this worker, {self.steps} steps/epoch "
              f"of {tr.batch_size} rows{' (auto)' if plan.batch_size_auto else ''}", flush=True)
        if getattr(model, "dense_lr", None) is not None:
            print(f"hpcps train: the MLP: {cfg.model.dense_optimizer}, lr {model.dense_lr:g}"
                  f"{'' if cfg.model.dense_lr else ' (auto: 0.001 per 1000 rows a step)'}", flush=True)
        if len(set(ctx.hosts)) > 1:
            print(f"hpcps train: {ctx.layout.describe_hosts(ctx.hosts)}", flush=True)
        if plan.restore is not None:
            path, manifest = plan.restore
            written_with = manifest["layout"]["workers"]
            print(f"hpcps train: resuming from {path} at epoch {start[0]}, step {start[1]}"
                  + ("" if written_with == ctx.layout.workers else f" (written with {written_with} workers: each "
                     f"worker continues at the same step of its own part, so the rows seen differ slightly)"),
                  flush=True)

    def say_nothing_left(self, start_epoch: int) -> None:
        tr = self.cfg.train
        if self.first and start_epoch > tr.epochs:
            print(f"hpcps train: nothing left to train: {self.plan.resumed or 'the checkpoint'} is at "
                  f"the end of training (train.epochs = {tr.epochs}); raise train.epochs to train on from it",
                  flush=True)

    # -- steps and epochs ----------------------------------------------------------------------

    def start_epoch(self, first_step: int) -> None:
        self.loss_sum, self.rows, self.first_step = 0.0, 0, first_step

    def step(self, epoch: int, step: int, rows: int, loss: float, global_step: int, key_counts) -> None:
        """A step done: its rows and loss counted; the progress line and metrics; supervise's
        status file. ``key_counts()``: the model's key counts on the servers (when counting)."""
        self.loss_sum += loss
        self.rows += rows
        ctx = self.ctx
        self.progress.step(epoch, step, rows, loss, ctx.stats["wait_s"], ctx.stats["max_staleness"],
                           key_counts() if self.counting else None)
        if self.status_path and time.monotonic() - self.last_status > STATUS_EVERY_S:  # for `hpcps supervise`
            ck = self.cfg.checkpoint
            try:
                write_status(self.status_path, global_step=global_step, epoch=epoch, step=step,
                             checkpoint_dir=os.path.abspath(ck.dir) if ck.dir else "")
            except outputs.OutputError as e:  # (supervise then sees no progress: training goes on)
                print(f"hpcps train: warning: {e}; supervise's status file is no longer written", flush=True)
                self.status_path = ""
            self.last_status = time.monotonic()

    def epoch_record(self, stage_times: dict, workers, stop) -> dict:
        """Collective over the workers: the epoch's train loss, stage times and waiting. A whole
        epoch without a row (a training file of blank and comment lines) ends the job
        (``stop(line, code)``)."""
        rows = workers.total(self.rows, "agreement of the workers")
        self.examples += rows
        whole_epoch = self.first_step == 1
        if not self.examples and whole_epoch:  # (its loss would read 0)
            named = inputs.describe(inputs.data_files(self.plan.paths["train"]))
            stop(f"error: the training file {named} holds no rows: an epoch of {self.steps} steps read "
                 f"none (its lines are all blank or comments"
                 + (" or bad lines skipped)" if self.cfg.data.skip_bad_lines else ")"), 2)
        total_loss = workers.total(float(self.loss_sum), "agreement of the workers")
        wait = self.ctx.stats["wait_s"]
        record = {"train_loss": total_loss / max(rows, 1),
                  **({} if whole_epoch else {"first_step": self.first_step}),  # (resumed mid-epoch: its loss
                  "time_s": time.perf_counter() - self.t0,                     # is of the steps from there)
                  **{f"stage_{k}": v for k, v in stage_times.items()},
                  "stage_wait_s": round(wait - self.waited_before, 4)}
        self.waited_before = wait
        return record

    def epoch_end(self, epoch: int, record: dict) -> None:
        self.progress.epoch_end(epoch, record)

    def check_finite(self, record: dict, when: str, train, model, stop) -> None:
        """Collective over the workers: ``stop(line, code)`` ends the job (exit 1) when a loss
        of the epoch's ``record`` is not finite (the model is not)."""
        bad = [k for k in ("train_loss", "test_logloss", "test_rmse") if not math.isfinite(record.get(k, 0.0))]
        if bad:
            stop("error: " + self.non_finite_line(when, f"{bad[0].replace('_', ' ')} is {record[bad[0]]}: the model "
                                                        f"holds non-finite weights", train, model), 1)

    def end_job_non_finite(self, e, when: str, batch, train, model) -> None:
        """This worker's step had a non-finite loss (:class:`~hpcps.train.models.NonFiniteError`):
        it ends the job at once (exit 1), before any checkpoint or model is written from it."""
        labels = f" (the batch's labels: {batch.labels.min():g} to {batch.labels.max():g})" if batch.rows else ""
        line = self.non_finite_line(when, f"{e}{labels}", train, model, sparse_rows_finite=not e.tables)
        World.end_job_with(f"error: {line}", 1)

    def non_finite_line(self, when: str, what: str, train, model, sparse_rows_finite: bool = False) -> str:
        """The one line of a non-finite stop: when, what, the likely cause, and what is kept."""
        cfg = self.cfg
        labels = getattr(getattr(train, "labels", None), "range", None)
        rate_key = "alpha" if "alpha" in optim.get(cfg.optimizer.name).params else "lr"
        rate = cfg.optimizer.params.get(rate_key, optim.get(cfg.optimizer.name).params.get(rate_key))
        causes = [f"the learning rate (optimizer.{rate_key} = {rate:g} for {cfg.optimizer.name})"]
        if getattr(model, "dense_lr", None) is not None:  # first when the sparse rows were finite
            causes.insert(len(causes) * (not sparse_rows_finite),
                          f"the MLP's rate (model.dense_lr = {model.dense_lr:g})")
        if cfg.model.loss == "squared" and labels is not None:
            causes.insert(0, f"the labels' range ({labels[0]:g} to {labels[1]:g} on this worker so far: scale them)")
        ck = checkpoint.newest_of(cfg.checkpoint.dir, self.plan.run_id) if cfg.checkpoint.dir else None
        return (f"non-finite numbers {when}: {what}; likely cause: {' or '.join(causes)}. Training stops; no "
                f"checkpoint or model is written from it" + (f" (the last good checkpoint: {ck})" if ck else ""))

    def close(self) -> None:
        self.progress.close()

    def say_stopped(self, preempted: int, written: str | None) -> None:
        """The line of a run stopped by a signal after its checkpoint (first worker)."""
        if self.first:
            name = "SIGINT" if preempted == EXIT_INTERRUPTED else "a signal"
            print(f"hpcps train: stopped by {name} after checkpoint {written}; rerun with --resume auto to "
                  f"continue (exit status {preempted})", flush=True)

    # -- the end -------------------------------------------------------------------------------

    def summary(self, elapsed: float, ending: dict, last_record: dict, feed, written: str | None, early) -> dict:
        """The run's summary (first worker): its examples and speed, the layout, the last epoch's
        record, what the end agreed (``ending``: waiting, skipped lines, memory, key counts,
        traffic, predictions), the batches kept by ``feed``, the newest checkpoint ``written``, and
        ``early`` stopping's."""
        ctx, examples, cfg = self.ctx, self.examples, self.cfg
        summary = {"examples": examples, "time_s": elapsed, "examples_per_s": examples / elapsed if examples else None,
                   "startup_s": self.startup_s,
                   "workers": ctx.layout.workers, "servers": ctx.layout.servers, **last_record,
                   "max_wait_s": ending["wait"], "max_staleness": ctx.stats["max_staleness"],
                   "bad_lines_skipped": ending["skipped"], "peak_rss_mb_worker": ending["worker_rss"],
                   "peak_rss_mb_server": ending["server_rss"], "loop_cpu_s_worker": ending["worker_loop_cpu_s"],
                   "loop_cpu_s_server": ending["server_loop_cpu_s"], **ending["key_counts"],
                   "bytes_sent": int(ending["traffic"][0]), "bytes_received": int(ending["traffic"][1]),
                   "requests_sent": int(ending["traffic"][2])}
        saved = dict(zip((*SAVED_KEYS, SATURATED_KEY), ending["traffic"][3:].tolist()))
        summary.update({k: saved[k] for k in cfg.filters.traffic().saved_keys()})  # (the filters on)
        if cfg.filters.wire_dtype == "fp16":
            summary[SATURATED_KEY] = saved[SATURATED_KEY]
        if ctx.hosts:
            summary["hosts"] = ctx.layout.by_host(ctx.hosts)
        kept_mb = feed.kept_batches_mb()  # the first worker's batches kept across epochs, compacted
        if kept_mb is not None:
            summary["kept_batches_mb"] = kept_mb
        if cfg.checkpoint.dir:
            summary["checkpoint"] = written  # this run's newest (None: it wrote none)
        if early.holdout is not None:
            summary.update(early.summary(cfg.train.epochs))
        if self.plan.synth_info:
            summary["best_test_logloss"] = self.plan.synth_info["best_test_logloss"]
            summary["best_test_auc"] = self.plan.synth_info["best_test_auc"]
        if ending["predicted"]:
            summary["predictions"] = ending["predicted"]
        if cfg.cluster.backup_workers:  # each worker that was late (rank, clocks, pushes, rows skipped)
            summary["stalled_workers"] = ending["stalled_workers"]
        summary.update(failover.summary(ctx))  # (servers lost, their shards promoted: cluster.replicas)
        return summary

    def print_summary(self, summary: dict, elapsed: float, wait: float, key_counts: dict, written: str | None) -> None:
        """On the first worker: the summary table, where things went and what to try next."""
        ck = self.cfg.checkpoint
        rows = summary_rows(summary, elapsed, wait, key_counts, self.ctx.layout, self.cfg, self.plan.synth_info)
        if summary.get(SATURATED_KEY):
            print(f"hpcps train: warning: {summary[SATURATED_KEY]:,} pushed or pulled values were beyond fp16's "
                  f"range and travelled as +-65504 (filters.wire_dtype = 'fp16'): the model may be wrong; use "
                  f"'bf16' (float32's range) or 'fp32'", file=sys.stderr, flush=True)
        print(summary_table(rows), flush=True)
        print(next_steps(self.cfg, self.plan.paths, written if ck.dir else None, self.plan.synth_info), flush=True)


def process_age_s() -> float | None:
    """Seconds since this process was started (exec'd by ``mpiexec``'s launcher: the interpreter,
    imports, MPI's start and everything after), from Linux's ``/proc/self/stat`` (in clock ticks,
    1/100 s here) against the boot-time clock; None where those are not there."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def rows_said(train) -> str:
    """The rows of a worker's part, as the start line says them: exact when the part was loaded
    whole, else its lines, an upper bound (blank, comment and bad lines count)."""
    if isinstance(train, tdata.LoadedPart):
        return f"{train.rows_bound} rows"
    return f"up to {train.rows_bound} rows (its lines)"


def summary_rows(summary: dict, elapsed: float, wait: float, key_counts: dict, layout, cfg,
                 synth_info: dict | None) -> list[tuple]:
    """The summary table's rows."""
    examples, f = summary["examples"], cfg.features
    rows = [("examples", f"{examples:,}"), ("time", f"{elapsed:.1f} s"),
            ("examples/s", f"{examples / elapsed:,.0f}" if examples else "none trained"),
            ("layout", f"{layout.servers} server(s), {layout.workers} worker(s)"),
            ("waiting (max over workers)", f"{wait:.1f} s"),
            ("keys on the servers", f"{key_counts['table_keys']:,}"
             + (f" ({key_counts['admitted_keys']:,} admitted, {key_counts['evicted_keys']:,} evicted)"
                if f.admission or f.eviction else ""))]
    for k in ("train_loss", "test_logloss", "test_auc", "test_rmse"):
        if k in summary:
            rows.append((k.replace("_", " "), f"{summary[k]:.5f}"))
    if "stalled_workers" in summary:
        rows.append(("stalled workers", stalls_said(summary["stalled_workers"]) or "none"))
    for lost in summary.get("servers_lost", []):
        rows.append(("server lost", f"server {lost['server']} at clock {lost['clock']} ({lost['at_s']:.1f} s): "
                                    f"its shards' backups promoted"))
    rows += [(k.replace("_", " "), f"{summary[k]:,}") for k in SAVED_KEYS if summary.get(k)]
    if synth_info:
        rows.append(("best achievable logloss", f"{synth_info['best_test_logloss']:.5f}"))
        rows.append(("best achievable AUC", f"{synth_info['best_test_auc']:.5f}"))
    return rows


def next_steps(cfg, paths: dict, ckpt: str | None, synth_info: dict | None = None) -> str:
    """Where a run's outputs went, and the commands to try next with them."""
    tr = cfg.train
    test = paths.get("test")  # (a glob is quoted for the shell; a list of files is no one --data)
    test = shlex.quote(test) if test and isinstance(test, str) else "TEST_FILE"
    model = shlex.quote(tr.model_out) if tr.model_out else "MODEL.h5"  # (each command runnable as printed)
    out = ["where things went:"]
    if synth_info:
        out.append(f"  data         {synth_info['dir']} (synthetic; "
                   + ("reused from an earlier run)" if synth_info.get("reused") else "the next run reuses it)"))
    out += ["  model        " + (tr.model_out or 'not written (set train.model_out = "model.h5")'),
            "  checkpoints  " + (ckpt or (f"none written by this run (checkpoint.dir = {cfg.checkpoint.dir!r})"
                                          if cfg.checkpoint.dir else 'none (set checkpoint.dir = "ckpt")')),
            "  metrics      " + (tr.metrics or 'not written (set train.metrics = "run.jsonl")'),
            "next:"]
    if ckpt:
        out.append("  resume       the same command with --resume auto (continues from the newest checkpoint)")
        out.append(f"  export       hpcps export {shlex.quote(ckpt)} --out model.h5")
    out.append(f"  evaluate     hpcps eval --model {model} --data {test}")
    out.append(f"  predict      hpcps predict --model {model} --data {test} --out scores.txt")
    out.append(f"  plot         hpcps plot {shlex.quote(tr.metrics) if tr.metrics else 'run.jsonl'} -o run.png")
    return "\n".join(out)
