"""The training loop: read batch → unique keys → pull → forward/backward → push → clock.

Run on every rank (collective). Servers serve; workers each read their own byte range of the
training file and step through it in batches of ``train.batch_size`` rows for ``train.epochs``.
All workers take the same number of steps per epoch (the largest of their batch counts; a worker
out of rows takes empty steps), so worker groups and clocks stay in step. The gradient of a step
is the sum over the worker group's rows (``train.gradient = "sum"``) or their mean.

Evaluation (logloss and AUC, or RMSE for the squared loss) runs on the held-out file's parts on
every worker; the margins are gathered on the first worker, which computes the exact metrics.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import time

import numpy as np

from dataclasses import dataclass, replace

from hpcps import config, outputs
from hpcps.ps import checkpoint, signals, tables
from hpcps.ps.collectives import World
from hpcps.ps.context import init
from hpcps.train import data as tdata
from hpcps.train import model_file, synth
from hpcps.train.models import NonFiniteError, make_model, resolve_fields
from hpcps.train.pipeline import StepPipeline
from hpcps.train.progress import STATUS_ENV, Progress, summary_table, vm_hwm_mb, write_status
from hpcps_kernels import metrics, optim


EXIT_PREEMPTED = 75  # the job stopped on SIGUSR1/SIGTERM after writing a checkpoint (EX_TEMPFAIL)
EXIT_INTERRUPTED = signals.EXIT_INTERRUPTED  # 130: the job stopped on SIGINT (after its checkpoint, if any)


def _snapshot(shard, keys, args):
    shard.snapshot()
    return np.zeros(1, dtype=np.float32)


def _restore(shard, keys, args):
    shard.restore_snapshot()
    return np.zeros(1, dtype=np.float32)


# early stopping keeps the best model on the servers (server functions, see hpcps.ps.tables)
tables.register_server_function("hpcps.snapshot", _snapshot, 1, per_key=False, replace=True)
tables.register_server_function("hpcps.restore", _restore, 1, per_key=False, replace=True)


class TrainError(RuntimeError):
    """A failure every rank agreed on (bad data, missing file): each rank raises the same message
    (or an empty one, when the rank that failed reports it). ``exit_status``: the exit status, 2 (bad
    configuration or input) or 1 (a run-time failure, such as a full disk)."""

    def __init__(self, message: str = "", status: int = 2):
        super().__init__(message)
        self.exit_status = status


@dataclass
class Result:
    summary: dict | None      # on the first worker
    preempted: int            # on every rank: the exit status of a stop by a signal after its checkpoint
                              # (75 after SIGTERM or SIGUSR1, 130 after SIGINT), else 0
    resumed_from: str = ""


def resolve_resume(cfg, world: World) -> tuple[str, dict] | None:
    """Collective: the checkpoint to resume from (verified on the first rank), or None."""
    ck = cfg.checkpoint
    if not ck.resume:
        return None
    found, error = None, None
    if world.is_first:
        if ck.resume == "auto":
            found = checkpoint.newest_good(ck.dir, report=checkpoint.say, move_damaged=True)
            if found is None:
                print(f"hpcps: no checkpoint to resume in {ck.dir}: starting from scratch", flush=True)
        else:
            try:
                found = (ck.resume, checkpoint.verify(ck.resume))
            except checkpoint.CheckpointError as e:
                error = str(e)
        if found and found[1].get("model_fingerprint") != cfg.model_fingerprint():
            changed = config.fingerprint_differences(found[1].get("config") or {}, cfg.to_dict())
            error = (f"{found[0]} was written for another model, optimizer or key space "
                     f"(model fingerprint {found[1].get('model_fingerprint')} != {cfg.model_fingerprint()}"
                     + (f": {'; '.join(changed)}" if changed else "") + ")")
    found, error = world.first_decides((found, error), "broadcast of the checkpoint to resume")
    if error:
        raise TrainError(f"cannot resume: {error}")
    return found


def claim_checkpoints(cfg, world: World, restore: tuple[str, dict] | None) -> str:
    """Collective: this run's id, inherited from the checkpoint it resumes (its lineage) or new,
    once the first rank has made ``checkpoint.dir`` hold this run's checkpoints only
    (:func:`hpcps.ps.checkpoint.claim`: another run's stop the job, unless ``checkpoint.existing =
    "replace"`` moves them aside)."""
    run_id, error = None, None
    if world.is_first:
        run_id = checkpoint.run_of(restore[1]) if restore else checkpoint.new_run_id()
        if cfg.checkpoint.dir:
            error = checkpoint.claim(cfg.checkpoint.dir, run_id, restore[0] if restore else None, cfg.checkpoint.existing,
                                     report=checkpoint.say)
    run_id, error = world.first_decides((run_id, error), "broadcast of the run's id")
    if error:
        raise TrainError(error)
    return run_id


def resolve_data(cfg, world: World) -> tuple[dict, dict | None]:
    """Collective: the data files to use. With no ``data.train``, the first rank generates a
    synthetic data set (``[synth]``), or reuses the one it generated before with the same
    parameters (in ``synth.dir``, else under :func:`synth.cache_dir`), and every rank gets its
    paths and known best metrics."""
    paths = {"train": cfg.data.train, "test": cfg.data.test}
    if cfg.data.train:
        return paths, None
    info = None
    if world.is_first:
        out = cfg.synth.dir or os.path.join(synth.cache_dir(), synth.dir_name(
            cfg.synth.rows, cfg.synth.test_rows, cfg.synth.fields, cfg.synth.interactions, cfg.synth.seed,
            cfg.data.hash_bits))
        try:  # the cache's directories are hpcps's own, named by their parameters: replaced if need be
            s = synth.generate(out, cfg.synth.rows, cfg.synth.test_rows, cfg.synth.fields, cfg.synth.interactions,
                               cfg.synth.seed, cfg.data.hash_bits, formats=("libsvm",), overwrite=not cfg.synth.dir,
                               how="give synth.dir another directory (or \"\" to use the cache)")
            info = {"train": s.files["train_libsvm"], "test": s.files["test_libsvm"],
                    "best_test_logloss": float(s.best_test_logloss), "best_test_auc": float(s.best_test_auc),
                    "dir": out, "reused": s.reused}
        except synth.SynthError as e:
            info = {"error": f"synth.dir = {cfg.synth.dir!r}: {e}"}
    info = world.first_decides(info, "broadcast of the synthetic data's paths")
    if "error" in info:
        raise TrainError(info["error"])
    return {"train": info["train"], "test": info["test"]}, info


def data_position_meaning(cfg, train_path: str, workers: int) -> dict:
    """What a checkpoint's data position refers to: the training file, the batch size, the
    number of workers (each reads its own byte range) and the shuffle of their rows, if any."""
    meaning = {"train": tdata.fingerprint(train_path), "batch_size": cfg.train.batch_size, "workers": workers}
    if cfg.data.shuffle_rows:  # (absent when off: checkpoints written before the key resume as before)
        meaning["shuffle"] = [cfg.data.shuffle_rows, cfg.data.shuffle_seed]
    return meaning


def check_same_data(manifest: dict, now: dict) -> str | None:
    """Why resuming ``manifest`` over the data described by ``now`` would continue at its step
    over other rows (None if it would not)."""
    then = manifest.get("data", {})
    if not isinstance(then.get("train"), dict):
        return None  # written before checkpoints recorded their data (version 1)
    problems = []
    a, b = then["train"], now["train"]
    if (a.get("bytes"), a.get("head_tail_xxh64")) != (b["bytes"], b["head_tail_xxh64"]):
        problems.append(f"the training file differs ({a.get('path')}, {a.get('bytes')} bytes, then; "
                        f"{b['path']}, {b['bytes']} bytes, now)")
    for key, what in (("batch_size", "train.batch_size"), ("workers", "the number of workers")):
        if then.get(key) != now[key]:
            problems.append(f"{what} was {then.get(key)}, now {now[key]}")
    if then.get("shuffle") != now.get("shuffle"):
        show = lambda v: f"shuffle_rows {v[0]}, seed {v[1]}" if v else "off"  # noqa: E731
        problems.append(f"data.shuffle_rows/shuffle_seed were {show(then.get('shuffle'))}, now {show(now.get('shuffle'))}")
    if not problems:
        return None
    return ("the checkpoint's data position would point at other rows: " + "; ".join(problems)
            + ". Set checkpoint.allow_other_data = true to resume anyway")


def _load(ctx, cfg, path: str, what: str, stream: bool = False):
    """Collective over the world: workers load their part of ``path`` (or open it as a
    :class:`~hpcps.train.data.PartStream`, parsing its first block); any error is raised on every
    rank with every failing rank's message. A file without a row is an error; so is, for the
    training file, a worker's part without one (a test or prediction file's rows are gathered)."""
    ds, error, empty = None, None, np.zeros(3, dtype=np.int64)  # workers: without rows, all, of an empty file
    if ctx.is_worker and path:
        try:
            d = cfg.data
            fields = cfg.model.type in config.DEEP  # keys carry their field
            squared = cfg.model.loss == "squared"  # (labels far from the first rows' get a warning)
            if stream and not d.cache_dir:
                ds = tdata.PartStream(path, ctx.worker_index, ctx.layout.workers, d.format, d.hash_bits,
                                      d.skip_bad_lines, cfg.model.loss == "logistic", d.memory_mb,
                                      fields=fields, shuffle_rows=d.shuffle_rows, shuffle_seed=d.shuffle_seed,
                                      warn_labels=squared).open()
                rows = int(ds.has_rows)  # (the part's count goes on, on a thread, until steps are agreed)
            else:
                ds = tdata.load_part(path, ctx.worker_index, ctx.layout.workers, d.format, d.hash_bits,
                                     d.skip_bad_lines, d.cache_dir, binary=cfg.model.loss == "logistic",
                                     fields=fields)
                rows = ds.rows
                if stream:
                    ds = tdata.LoadedPart(ds, d.shuffle_rows, d.shuffle_seed, warn_labels=squared)
            empty[:] = (rows == 0, 1, os.path.getsize(path) == 0)
        except (tdata.DataError, OSError) as e:
            error = str(e)
    errors = ctx.every_rank.failures(error, f"loading of {what} data")
    if errors:
        raise TrainError("cannot load data:\n  " + "\n  ".join(errors))
    if path:
        no_rows, workers, zero_bytes = ctx.every_rank.reduce(empty, "sum", f"count of the {what} parts without rows")
        if no_rows == workers:
            raise TrainError(f"cannot load data: {what} file {path} holds no rows: "
                             + ("it is empty" if zero_bytes else "its lines are all blank or comments"
                                + (" or bad lines skipped" if cfg.data.skip_bad_lines else "")))
        if no_rows and stream:
            raise TrainError(f"cannot load data: {what} file {path}: a worker's byte range holds no rows ({no_rows} "
                             f"of {workers} workers); use fewer workers or more data")
    return ds


def model_fields(ctx, cfg, train_path: str) -> int:
    """Collective: the fields per row of a deep model (1 for the others); a libffm file without
    ``model.fields`` is an error on every rank."""
    if cfg.model.type not in config.DEEP:
        return 1
    error, fields = None, 1
    if ctx.every_rank.is_first:
        try:
            fields = resolve_fields(cfg, tdata.detect_format(train_path, cfg.data.format))
        except (ValueError, OSError) as e:
            error = str(e)
    fields, error = ctx.every_rank.first_decides((fields, error), "broadcast of the number of fields")
    if error:
        raise TrainError(error)
    return fields


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


# train.batch_size = 0 (auto): rows per worker a step, at least AUTO_BATCH_MIN and at most
# AUTO_BATCH_MAX, so that an epoch takes at least AUTO_BATCH_STEPS steps. A step updates each of its
# keys once (FTRL and AdaGrad move a key by about the same amount whatever the rows behind its summed
# gradient), so a small set in batches of 1000 rows gets a few updates an epoch and undertrains; a
# large one keeps 1000 rows a step, which the servers' per-step cost needs (2.2x the loop's speed of
# 200 rows a step on bench vw's rows, for the same test logloss). Calibrated on docs/defaults-sweep.py
# (64 steps and 100 rows at least: 5 of its 12 logloss sets within 0.002; 128 and 50: 8; 256 and 50:
# 9, but the Criteo example's 100 k rows a worker then take 390-row steps, 1.8x its loop's time).
AUTO_BATCH_MIN, AUTO_BATCH_MAX, AUTO_BATCH_STEPS = 50, 1000, 128


def auto_batch_size(rows: int, workers: int) -> int:
    """``train.batch_size`` = 0: the rows a step for ``rows`` rows of training over ``workers``."""
    return min(AUTO_BATCH_MAX, max(AUTO_BATCH_MIN, math.ceil(rows / max(workers, 1) / AUTO_BATCH_STEPS)))


BIAS_ROWS = 4096  # rows per worker whose labels set the initial bias (model.bias_init = "auto")


# The logistic bias starts within the log-odds of [BIAS_P, 1 - BIAS_P]. It does for LR and FM,
# whose test logloss it improved on all 11 of docs/defaults-sweep.py's sets (up to 0.0033 on the
# smallest); W&D and DeepFM keep 0: on the DeepFM example it was 0.0014 worse (0.3903 against
# 0.3889), on deep200k 0.0008, with the MLP's own output bias there to learn the base rate.
BIAS_P = 1e-4


def bias_for(mean: float, loss: str) -> float:
    """The bias that predicts ``mean``, the labels' mean: the mean itself under the squared loss,
    its log-odds under the logistic loss (labels 0 and 1)."""
    if loss == "squared":
        return float(mean)
    p = min(max(float(mean), BIAS_P), 1.0 - BIAS_P)
    return math.log(p / (1.0 - p))


def initial_bias(ctx, cfg, train) -> float:
    """Collective over the world: the bias weight's initial value. With ``model.bias_init =
    "auto"``, the one that predicts the mean label of the first ``BIAS_ROWS`` rows of every
    worker's part (:func:`bias_for`: a regression starts at the mean and an LR or FM classifier
    at the base rate's log-odds, not at 0); with ``"zero"``, and for W&D and DeepFM, 0."""
    if cfg.model.bias_init != "auto" or (cfg.model.loss == "logistic" and cfg.model.type in config.DEEP):
        return 0.0
    labels = train.head_labels(BIAS_ROWS).astype(np.float64) if ctx.is_worker and train is not None else np.zeros(0)
    total = ctx.every_rank.reduce(np.array([labels.sum(), labels.shape[0]]), "sum", "sum of the first labels")
    return bias_for(total[0] / total[1], cfg.model.loss) if total[1] else 0.0


def _gather_on_first(ctx, array: np.ndarray) -> np.ndarray | None:
    workers = ctx.among_workers
    counts = workers.sizes(array.shape[0], "gather of evaluation sizes")
    return workers.gather_to_first(array, counts, "gather of evaluation results")


EVAL_ROWS = 4096  # rows a worker scores at once at least, whatever the training's batch


def eval_batch(batch_size: int) -> int:
    """Rows per request when scoring (:func:`evaluate_columns`, :func:`predict`): the training's
    batch, but at least ``EVAL_ROWS``. A row's margin does not depend on the rows beside it, so
    this changes no score, only the number of round trips: a 2,000-row job trains in batches of
    25, and scoring its 50,000 test rows 25 at a time took 2,000 pulls, 0.57 s an evaluation here."""
    return max(batch_size, EVAL_ROWS)


def evaluate(ctx, pipeline, ds: tdata.Dataset | None, batch_size: int, loss: str) -> dict:
    """Collective over the workers: exact metrics of the whole held-out set (on every worker),
    its margins from ``pipeline``'s model (:class:`~hpcps.train.pipeline.StepPipeline`)."""
    return evaluate_columns(ctx, pipeline, lambda b: pipeline.margins(b)[:, None], 1, ds, batch_size, loss)[0]


def evaluate_columns(ctx, pipeline, margins, columns: int, ds: tdata.Dataset | None, batch_size: int,
                     loss: str) -> list[dict]:
    """Collective over the workers: the metrics of ``columns`` models whose margins of a batch
    are ``margins(batch)``, ``(rows, columns)`` (a :class:`~hpcps.train.models.Grid`'s members),
    once ``pipeline``'s steps are done."""
    pipeline.finish()
    batch_size = eval_batch(batch_size)
    n = ds.rows if ds is not None else 0
    m = np.concatenate([margins(ds.batch(lo, lo + batch_size)) for lo in range(0, n, batch_size)] or
                       [np.zeros((0, columns))])
    labels = ds.labels[:n].astype(np.float64) if ds is not None else np.zeros(0)
    all_y = _gather_on_first(ctx, labels)
    out = np.zeros((columns, 3))
    for c in range(columns):
        all_m = _gather_on_first(ctx, m[:, c])
        if ctx.among_workers.is_first and all_m.size:
            if loss == "logistic":
                out[c] = (metrics.logloss(all_y, all_m), metrics.auc(all_y, all_m), all_m.size)
            else:
                out[c] = (float(np.sqrt(np.mean((all_m - all_y) ** 2))), np.nan, all_m.size)
    ctx.among_workers.share_from_first(out, "broadcast of metrics")
    if loss == "logistic":
        return [{"test_logloss": float(o[0]), "test_auc": float(o[1]), "test_rows": int(o[2])} for o in out]
    return [{"test_rmse": float(o[0]), "test_rows": int(o[2])} for o in out]


def predict(ctx, pipeline, ds: tdata.Dataset, batch_size: int, loss: str, out_path: str) -> int:
    """Collective over the workers: one score per row of every worker's part, in input order,
    written by the first worker. Returns the number of scores written."""
    pipeline.finish()
    batch_size = eval_batch(batch_size)
    margins = np.concatenate([pipeline.margins(ds.batch(lo, lo + batch_size)) for lo in range(0, ds.rows, batch_size)]
                             or [np.zeros(0)])
    scores = 1.0 / (1.0 + np.exp(-margins)) if loss == "logistic" else margins
    everything = _gather_on_first(ctx, scores)
    if ctx.among_workers.is_first:
        try:
            write_scores(out_path, everything)
        except outputs.OutputError as e:
            _abort_on(e)
        return everything.size
    return 0


def _abort_on(e: outputs.OutputError) -> None:
    """An output that failed mid-run on one rank (the metrics, the predictions): its one line
    ends the job (the other ranks are serving or stepping)."""
    World.end_job_with(f"error: {e}", e.exit_status)


def write_scores(path: str, scores: np.ndarray) -> None:
    """One score per line, replacing ``path`` whole (:func:`hpcps.outputs.replacing`)."""
    with outputs.replacing(path, scores.size * 9) as tmp, open(tmp, "w") as f:
        np.savetxt(f, scores, fmt="%.6f")  # (a file object: given a name, savetxt opens it twice, which a FIFO cannot take)


def run(cfg, comm=None) -> Result:
    """Train as configured (collective over ``comm``, default the world): :meth:`Trainer.run`."""
    return Trainer(cfg, comm).run()


class Trainer:
    """One training run, collective over the world, in named steps (:meth:`run` reads as the list):

    1. :meth:`prepare`: check the output paths, find the checkpoint to resume and the data, and
       check that the checkpoint's data position still means the same rows;
    2. :meth:`start`: the context (servers and worker groups), the data parts, the model;
    3. servers :meth:`serve` until the workers are done, and write the model;
    4. workers :meth:`begin` (steps per epoch, the resumed position), then for each epoch
       :meth:`train_epoch` (each :meth:`step` followed by :meth:`checkpoint_if_due` and
       :meth:`evaluate_if_due`) and :meth:`end_epoch` (its record: losses, stage times, test and
       holdout metrics, early stopping);
    5. :meth:`keep_best` (early stopping's model back on the servers), :meth:`finish` (the final
       checkpoint, predictions, the summary).
    """

    NO_CHECKPOINT = "no checkpoint to write (checkpoint.dir is not set)"  # what a stop signal's line says

    def __init__(self, cfg, comm=None):
        self.cfg = cfg
        self.batch_size_set = bool(cfg.train.batch_size)  # else auto, resolved in prepare
        self.world = World(comm, cfg.cluster.stall_timeout_s)
        self.restore: tuple[str, dict] | None = None
        self.run_id = ""  # the lineage of the checkpoints this run writes (set in prepare)
        self.written: str | None = None  # the newest checkpoint this run wrote (first worker)
        self.synth_info: dict | None = None
        self.history: list[dict] = []
        self.preempted = 0  # the exit status of a stop by a signal after its checkpoint (Result.preempted)
        self.holdout_phase = -1  # train.holdout holds out the rows r % N == phase % N (the last of N)

    # -- 1-3: every rank ---------------------------------------------------------------------------

    def run(self) -> Result:
        self.prepare()
        self.start()
        if self.ctx.is_server:
            return self.serve()
        self.begin()
        for epoch in range(self.start_epoch, self.cfg.train.epochs + 1):
            self.train_epoch(epoch)
            if self.preempted or self.end_epoch(epoch):
                break
        self.keep_best()
        return self.finish()

    def prepare(self) -> None:
        cfg, world, ck = self.cfg, self.world, self.cfg.checkpoint
        problem = config.check_paths(cfg) if world.is_first else None
        errors = world.failures(problem, "check of the output paths")
        if errors:
            raise TrainError(errors[0].split(": ", 1)[1])
        # SIGINT, SIGTERM and SIGUSR1: with a checkpoint to write, at the next step (a checkpoint,
        # then exit 130 or 75); without one, at once (exit 128 + the signal)
        signals.install(defer=bool(ck.dir), prefix=f"hpcps: {world.prefix}: ",
                        first=world.is_first, why="" if ck.dir else self.NO_CHECKPOINT, end=world.end_job)
        self.restore = resolve_resume(cfg, world)
        if ck.dir and world.is_first:
            os.makedirs(ck.dir, exist_ok=True)
        self.run_id = claim_checkpoints(cfg, world, self.restore)
        self.paths, self.synth_info = resolve_data(cfg, world)
        self.input_format = ""
        problem = None
        if world.is_first:
            if self.synth_info:  # the generated files are inputs too
                problem = outputs.clash(*config.path_roles(cfg, data=self.paths))
            try:  # recorded in the model file (what its keys mean)
                self.input_format = tdata.detect_format(self.paths["train"], cfg.data.format)
            except (OSError, tdata.DataError):
                pass  # (a missing file, or a FIFO, is reported where it is loaded)
        problem, self.input_format = world.first_decides((problem, self.input_format),
                                                         "broadcast of the training file's format")
        if problem:
            raise TrainError(problem)
        workers = world.size - cfg.cluster.servers if world.size > 1 else 1  # one process: one worker
        if not cfg.train.batch_size:  # auto: from the training file's rows (counted as far as it matters)
            enough = AUTO_BATCH_MAX * AUTO_BATCH_STEPS * workers
            rows = tdata.rows_at_least(self.paths["train"], enough) if world.is_first else 0
            rows = world.first_decides(rows, "broadcast of the training file's rows")
            self.set_batch_size(auto_batch_size(rows, workers))
            cfg = self.cfg
        problem = None
        if (world.is_first and self.restore is not None and not ck.allow_other_data
                and os.path.isfile(self.paths["train"])):
            problem = check_same_data(self.restore[1], data_position_meaning(cfg, self.paths["train"], workers))
        errors = world.failures(problem, "check of the resumed data position")
        if errors:
            raise TrainError(f"cannot resume {self.restore[0]}: " + errors[0].split(": ", 1)[1])

    def set_batch_size(self, rows: int) -> None:
        """``train.batch_size`` from here on (the auto value, resolved in :meth:`prepare`)."""
        self.cfg = replace(self.cfg, train=replace(self.cfg.train, batch_size=rows))

    def start(self) -> None:
        cfg, cl = self.cfg, self.cfg.cluster
        self.ctx = ctx = init(servers=cl.servers, worker_groups=cl.worker_groups or None, staleness=cl.staleness,
                              num_shards=cl.num_shards, stall_warn_s=cl.stall_warn_s,
                              stall_timeout_s=cl.stall_timeout_s, comm=self.world.comm)
        self.train = _load(ctx, cfg, self.paths["train"], "training", stream=True)
        self.test = _load(ctx, cfg, self.paths["test"], "test")
        self.to_predict = _load(ctx, cfg, cfg.data.predict, "prediction")
        bias, fields = initial_bias(ctx, cfg, self.train), model_fields(ctx, cfg, self.paths["train"])
        self.model = self.build_model(bias, fields)
        self.model.hashed_keys = getattr(self.train, "fmt", "") in tdata.HASHED_FORMATS
        self.pipeline = StepPipeline(ctx, self.model)
        self.keep_best_functions = (ctx.server_function("hpcps.snapshot"), ctx.server_function("hpcps.restore")) \
            if cfg.train.early_stop else None

    def build_model(self, bias: float, fields: int):
        return make_model(self.ctx, self.cfg, bias, fields)

    def serve(self) -> Result:
        """A server rank: answer requests until every worker is done, then write the model."""
        ctx = self.ctx
        ctx.serve(self.restore)
        preempted = _agree_preempted(ctx, 0)[0]
        if self.cfg.train.model_out and not preempted:
            agree_model_written(ctx, export_model(ctx, self.cfg, self.model, self.input_format))
        ctx.finalize()
        return Result(None, preempted, self.resumed)

    @property
    def resumed(self) -> str:
        return self.restore[0] if self.restore else ""

    # -- 4: workers --------------------------------------------------------------------------------

    def begin(self) -> None:
        """Steps per epoch, the gradient's scale, progress, and where a resumed run continues."""
        cfg, ctx, tr, ck = self.cfg, self.ctx, self.cfg.train, self.cfg.checkpoint
        if ctx.local and self.restore is not None:  # one process: its in-process server loads the checkpoint
            ctx.restore(*self.restore)
        self.workers = ctx.among_workers
        if isinstance(self.train, tdata.PartStream):
            if cfg.data.parse_thread:
                self.train.start_thread()  # parse ahead on a thread (stopped in finish)
            else:
                ctx.background = self.train.pump  # parse ahead while steps wait for the servers
        self.first = first = self.workers.is_first
        # every worker takes the same number of steps: enough for the largest part (its lines: blank,
        # comment or skipped lines only add empty steps at the end)
        self.steps = steps = self.workers.largest(math.ceil(self.train.rows_bound / tr.batch_size), "agreement on steps per epoch")
        # "sum": each row's gradient counts in full (per-coordinate optimizers like FTRL and AdaGrad
        # set their own step sizes, and a mean would shrink rare keys' gradients by the batch size);
        # "mean": the gradient of the mean loss over the group's rows (the objective of plain SGD).
        self.scale = 1.0 if tr.gradient == "sum" else 1.0 / (tr.batch_size * ctx.within_group.size)
        resume = self.restore[1]["position"] if self.restore is not None else None
        self.progress = Progress(first and tr.progress, steps, ctx.layout.workers, tr.metrics if first else "",
                                 on_error=_abort_on, resume=(resume["epoch"], resume["step"]) if resume else None)
        if first:
            where = "one process (a server and a worker inside it, no messages)" if ctx.local else ctx.layout.describe()
            print(f"hpcps train: {where}; {cfg.model.type} with {cfg.optimizer.name}, staleness "
                  f"{cfg.cluster.staleness}; {self._rows_said()} on this worker, {steps} steps/epoch "
                  f"of {tr.batch_size} rows{' (auto)' if not self.batch_size_set else ''}", flush=True)
            if getattr(self.model, "dense_lr", None) is not None:
                print(f"hpcps train: the MLP: {cfg.model.dense_optimizer}, lr {self.model.dense_lr:g}"
                      f"{'' if cfg.model.dense_lr else ' (auto: 0.001 per 1000 rows a step)'}", flush=True)
            if len(set(ctx.hosts)) > 1:
                print(f"hpcps train: {ctx.layout.describe_hosts(ctx.hosts)}", flush=True)
        self.start_epoch, self.start_step, self.global_step = 1, 1, 0
        if self.restore is not None:
            path, manifest = self.restore
            pos = manifest["position"]
            self.start_epoch, self.start_step, self.global_step = pos["epoch"], pos["step"], pos["global_step"]
            if self.start_step > steps:  # written at an epoch's last step: the next epoch's first
                self.start_epoch, self.start_step = self.start_epoch + 1, 1
            ctx.clock_value = manifest["clock"]
            if first:
                same = manifest["layout"]["workers"] == ctx.layout.workers
                print(f"hpcps train: resuming from {path} at epoch {self.start_epoch}, step {self.start_step}"
                      + ("" if same else f" (written with {manifest['layout']['workers']} workers: each worker "
                         f"continues at the same step of its own part, so the rows seen differ slightly)"),
                      flush=True)
        self.data_meaning = data_position_meaning(cfg, self.paths["train"], ctx.layout.workers) \
            if (first and ck.dir) else None
        self.status_path = os.environ.get(STATUS_ENV, "") if first else ""
        self.counting = cfg.features.admission or cfg.features.eviction  # key counts in the progress line
        self.last_status = 0.0
        self.t0 = time.perf_counter()
        self.waited_before = 0.0  # ctx.stats["wait_s"] at the end of the last epoch
        self.last_save = time.monotonic()
        self.examples = 0
        # the step of the newest checkpoint of this run in checkpoint.dir: the one resumed from, when
        # it lies there and means the same data (so a run with nothing left to train writes none)
        here = False
        if self.restore is not None and ck.dir and not ck.allow_other_data:
            try:
                here = os.path.samefile(os.path.dirname(os.path.normpath(self.restore[0])) or ".", ck.dir)
            except OSError:
                pass
        self.saved_at = self.global_step if self.workers.smallest(int(here), "agreement on the checkpoint resumed") \
            else -1
        if first and self.start_epoch > tr.epochs:
            print(f"hpcps train: nothing left to train: {self.restore[0] if self.restore else 'the checkpoint'} is at "
                  f"the end of training (train.epochs = {tr.epochs}); raise train.epochs to train on from it",
                  flush=True)
        # The steps left, in order, and their batches: a step is given the next two batches, which
        # the model pulls and prepares ahead (see Model.step); each batch object is made once, in
        # order, from one pass over the worker's part per epoch.
        self.last_index = tr.epochs * steps
        self.made: dict[int, object] = {}
        self.feed, self.feed_next = None, -1  # the current pass's batches, and the next one's index
        # Batches kept for the next epochs, by step of an epoch, compacted (Dataset.compact: their
        # unique keys and int32 positions, deduplicated once) when the part is kept in memory
        # anyway and a step needs nothing else of the keys; once every step's batch is kept the
        # stream's parsed slices go. With a holdout a batch is split once: its training rows are
        # kept compacted, its held-out rows until the holdout set is built. Not for the
        # computation on the servers (it sends the keys).
        self.kept: dict[int, tuple] | None = (
            {} if tr.epochs > 1 and isinstance(self.train, tdata.PartStream) and self.train.keep
            and cfg.model.compute == "workers" and not self.model.reads_keys else None)
        if self.kept is not None:
            self.train.keep_no_slices()
        # train.holdout = N: every Nth row of the part never trains; the rows of the first whole
        # epoch are the holdout set, evaluated after each epoch (early stopping watches it)
        self.held_out: dict[int, tdata.Dataset] = {}
        self.holdout_pieces: list = []
        self.holdout: tdata.Dataset | None = None
        self.holdout_metric = "logloss" if cfg.model.loss == "logistic" else "rmse"
        self.best = {"loss": math.inf, "epoch": 0}
        self.stopped_at = 0

    def batch_at(self, i: int):
        """The batch of the ``i``-th step since the start of training (made once, in order)."""
        tr = self.cfg.train
        if i not in self.made:
            j = i % self.steps
            got = self.kept.get(j) if self.kept is not None else None
            if got is not None:
                b, held = got
            else:
                b, held = self._from_feed(j), None
                if tr.holdout:
                    b, held = b.split_every(tr.holdout, j * tr.batch_size, self.holdout_phase)
                if self.kept is not None:
                    b.keep_prepared = True
                    self.kept[j] = (b, held)
                    if len(self.kept) == self.steps:  # every batch kept: the stream's slices go
                        self._close_feed()
                        try:
                            self.train.forget()
                        except tdata.DataError as e:
                            World.end_job_with(f"error: {e}", 2)
            if held is not None:
                self.held_out[i] = held
            self.made[i] = b
        return self.made[i]

    def _from_feed(self, j: int):
        """Batch ``j`` of an epoch from a pass over the part: the current pass when it is at
        batch ``j``, else a new one from there (a new epoch starts again at batch 0)."""
        if self.feed_next != j:
            self._close_feed()
            self.feed = self.train.batches(self.cfg.train.batch_size, j)
        self.feed_next = j + 1
        try:
            return next(self.feed)
        except tdata.DataError as e:  # a bad line past the first block: this rank stops the job
            World.end_job_with(f"error: {e}", 2)

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.feed, self.feed_next = None, -1

    def train_epoch(self, epoch: int) -> None:
        """The epoch's steps (from the resumed step in the first); sets ``preempted`` when a stop
        signal ended it after a checkpoint."""
        self.loss_sum, self.rows = 0.0, 0
        self.first_step = first_step = self.start_step if epoch == self.start_epoch else 1
        self.whole_epoch = first_step == 1
        self.collecting = self.cfg.train.holdout and self.holdout is None and first_step == 1
        try:  # (a stream checks at each read too; a part in memory reads nothing)
            self.train.check_unchanged()
        except tdata.DataError as e:
            World.end_job_with(f"error: {e}", 2)
        for step in range(first_step, self.steps + 1):
            self.step(epoch, step)
            if self.checkpoint_if_due(epoch, step):
                break
            self.evaluate_if_due(epoch, step)
        self.pipeline.finish()

    def step(self, epoch: int, step: int) -> None:
        i = (epoch - 1) * self.steps + step - 1
        batch = self.batch_at(i)
        self.made.pop(i - 1, None)
        held = self.held_out.pop(i, None)
        if self.collecting and held is not None and held.rows:
            self.holdout_pieces.append(held)
        # the batches the step pipelines (see Model.step): one more when it pulls two ahead
        upcoming = [self.batch_at(j) for j in range(i + 1, min(i + 3 + self.pipeline.pulls_ahead, self.last_index))]
        try:
            loss = self.train_step(batch, upcoming)
        except NonFiniteError as e:
            self.stop_non_finite(e, epoch, step, batch)
        self.global_step += 1
        self.loss_sum += loss
        self.rows += batch.rows
        ctx = self.ctx
        self.progress.step(epoch, step, batch.rows, loss, ctx.stats["wait_s"], ctx.stats["max_staleness"],
                           self.model.table.key_counts() if self.counting else None)
        if self.status_path and time.monotonic() - self.last_status > 0.2:  # for `hpcps supervise`
            ck = self.cfg.checkpoint
            try:
                write_status(self.status_path, global_step=self.global_step, epoch=epoch, step=step,
                             checkpoint_dir=os.path.abspath(ck.dir) if ck.dir else "")
            except outputs.OutputError as e:  # (supervise then sees no progress: training goes on)
                print(f"hpcps train: warning: {e}; supervise's status file is no longer written", flush=True)
                self.status_path = ""
            self.last_status = time.monotonic()

    def _rows_said(self) -> str:
        """The rows of this worker's part, as the start line says them: exact when the part was
        loaded whole, else its lines, an upper bound (blank, comment and bad lines count)."""
        if isinstance(self.train, tdata.LoadedPart):
            return f"{self.train.rows_bound} rows"
        return f"up to {self.train.rows_bound} rows (its lines)"

    def checkpoint_if_due(self, epoch: int, step: int) -> bool:
        """Collective over the workers: a checkpoint when one is due somewhere (a stop signal, a
        periodic one). Returns True when the run stops on the signal (``preempted``)."""
        ck = self.cfg.checkpoint
        if not ck.dir:
            return False
        # 3 = SIGINT somewhere, 2 = another stop signal, 1 = a periodic checkpoint is due; all workers agree
        sig = self.ctx.stop_signal
        want = (3 if sig == signal.SIGINT else 2) if sig else int(
            bool(ck.every_steps and self.global_step % ck.every_steps == 0)
            or bool(self.first and ck.every_s and time.monotonic() - self.last_save >= ck.every_s))
        want = self.workers.largest(want, "agreement on checkpointing")
        if not want:
            return False
        self.save(epoch, step + 1, "signal" if want >= 2 else "periodic")
        self.saved_at, self.last_save = self.global_step, time.monotonic()
        if want >= 2:
            if ck.on_signal == "exit" or want == 3:  # (SIGINT always stops)
                self.preempted = EXIT_INTERRUPTED if want == 3 else EXIT_PREEMPTED
                return True
            signals.clear()
            self.ctx.server_stop = 0
        return False

    def save(self, epoch_next: int, step_next: int, reason: str) -> None:
        """Collective over the workers: a checkpoint whose position is the step to run next."""
        ctx, cfg = self.ctx, self.cfg
        self.pipeline.finish()  # every worker: its pushes acknowledged
        if self.first:
            path = ctx.save_checkpoint(cfg.checkpoint.dir, self.global_step, {
                "run_id": self.run_id, "model_fingerprint": cfg.model_fingerprint(), "config": cfg.to_dict(),
                "reason": reason,
                "position": {"epoch": epoch_next, "step": step_next, "global_step": self.global_step},
                "data": {**self.data_meaning, "random_state": "none: the loop draws no random numbers"},
                "fields": self.model.fields, "input_format": self.input_format}, cfg.checkpoint.keep)
            self.written = path
            print(f"hpcps train: checkpoint {path} ({reason})", flush=True)
        self.workers.wait_for_all("checkpoint barrier")

    def train_step(self, batch, upcoming) -> float:
        """One step of the pipeline; its summed loss."""
        return self.pipeline.step(batch, self.scale, upcoming)

    def evaluate(self, ds) -> dict:
        return evaluate(self.ctx, self.pipeline, ds, self.cfg.train.batch_size, self.cfg.model.loss)

    def evaluate_if_due(self, epoch: int, step: int) -> None:
        tr = self.cfg.train
        if tr.eval_every and self.test is not None and step % tr.eval_every == 0 and step != self.steps:
            self.progress.epoch_end(epoch, {"step": step, **self.evaluate(self.test)})

    def end_epoch(self, epoch: int) -> bool:
        """Collective over the workers: the epoch's record (train loss, stage times, test and
        holdout metrics), written to the progress and metrics. Returns True when early stopping
        ends training here."""
        record = self.epoch_record(epoch)
        if self.collecting:
            pieces = [(p.labels, p.indptr, p.indices, p.values) for p in self.holdout_pieces]
            self.holdout = tdata.Dataset(*tdata._concat(pieces))
            self.holdout_pieces = []
            self.holdout_rows = self.workers.total(self.holdout.rows, "sum of the holdout rows")
            if not self.holdout_rows:  # (its loss would read 0: a silently wrong number)
                n = self.cfg.train.holdout
                self.stop(f"train.holdout = {n} holds out no row: every worker's part has fewer than {n} rows "
                          f"({self.examples} rows trained an epoch); use a smaller train.holdout or more data", 2)
            if self.kept is not None:  # the kept batches' held-out rows are in the holdout set now
                self.kept = {j: (b, None) for j, (b, _) in self.kept.items()}
        if self.holdout is not None:
            self.stopped_at = epoch if self.watch_holdout(epoch, record) else 0
        self.history.append(record)
        self.progress.epoch_end(epoch, record)
        return bool(self.stopped_at)

    def epoch_record(self, epoch: int) -> dict:
        """The train loss, stage times, waiting and test metrics of the epoch. Stops the job when
        a whole epoch had no row (a training file of blank and comment lines) and when a metric
        is not finite (the model is not: :meth:`stop_non_finite`)."""
        ctx = self.ctx
        rows = self.workers.total(self.rows, "agreement of the workers")
        self.examples += rows
        if not self.examples and self.whole_epoch:  # (its loss would read 0)
            self.stop(f"the training file {self.paths['train']} holds no rows: an epoch of {self.steps} steps read "
                      f"none (its lines are all blank or comments"
                      + (" or bad lines skipped)" if self.cfg.data.skip_bad_lines else ")"), 2)
        total_loss = self.workers.total(float(self.loss_sum), "agreement of the workers")
        record = {"train_loss": total_loss / max(rows, 1),
                  **({} if self.whole_epoch else {"first_step": self.first_step}),  # (resumed mid-epoch: its loss
                  "time_s": time.perf_counter() - self.t0,                             # is of the steps from there)
                  **{f"stage_{k}": v for k, v in self.pipeline.stage_times().items()},
                  "stage_wait_s": round(ctx.stats["wait_s"] - self.waited_before, 4)}
        self.waited_before = ctx.stats["wait_s"]
        if self.test is not None:
            record.update(self.evaluate(self.test))
        bad = [k for k in ("train_loss", "test_logloss", "test_rmse") if not math.isfinite(record.get(k, 0.0))]
        if bad and self.check_finite:
            self.stop(self.non_finite_line(f"after epoch {epoch} ({self.global_step} steps)",
                                           f"{bad[0].replace('_', ' ')} is {record[bad[0]]}: the model holds "
                                           f"non-finite weights"), 1)
        return record

    def stop(self, message: str, code: int) -> None:
        """Collective over the workers: end the job, the first worker saying why in one line
        (the others wait for the abort)."""
        if self.first:
            World.end_job_with(f"error: {message}", code)
        self.workers.wait_for_all("the stop of the job")

    # Tune's grid trains members with other rates side by side: a member that diverges is ranked
    # last (its holdout loss is NaN), it does not stop the others (see hpcps.train.tune)
    check_finite = True

    def non_finite_line(self, when: str, what: str, sparse_rows_finite: bool = False) -> str:
        """The one line of a non-finite stop: when, what, the likely cause, and what is kept."""
        cfg = self.cfg
        labels = getattr(getattr(self.train, "labels", None), "range", None)
        rate_key = "alpha" if "alpha" in optim.get(cfg.optimizer.name).params else "lr"
        rate = cfg.optimizer.params.get(rate_key, optim.get(cfg.optimizer.name).params.get(rate_key))
        causes = [f"the learning rate (optimizer.{rate_key} = {rate:g} for {cfg.optimizer.name})"]
        if getattr(self.model, "dense_lr", None) is not None:  # first when the sparse rows were finite
            causes.insert(len(causes) * (not sparse_rows_finite),
                          f"the MLP's rate (model.dense_lr = {self.model.dense_lr:g})")
        if cfg.model.loss == "squared" and labels is not None:
            causes.insert(0, f"the labels' range ({labels[0]:g} to {labels[1]:g} on this worker so far: scale them)")
        ck = checkpoint.newest_of(cfg.checkpoint.dir, self.run_id) if cfg.checkpoint.dir else None
        return (f"non-finite numbers {when}: {what}; likely cause: {' or '.join(causes)}. Training stops; no "
                f"checkpoint or model is written from it" + (f" (the last good checkpoint: {ck})" if ck else ""))

    def stop_non_finite(self, e, epoch: int, step: int, batch) -> None:
        """This worker's step had a non-finite loss (:class:`~hpcps.train.models.NonFiniteError`):
        it ends the job at once (exit 1), before any checkpoint or model is written from it."""
        labels = f" (the batch's labels: {batch.labels.min():g} to {batch.labels.max():g})" if batch.rows else ""
        line = self.non_finite_line(f"at step {self.global_step + 1} (epoch {epoch}, step {step} of {self.steps})",
                                    f"{e}{labels}", sparse_rows_finite=not e.tables)
        World.end_job_with(f"error: {line}", 1)

    def watch_holdout(self, epoch: int, record: dict) -> bool:
        """The holdout metric into ``record``; the servers keep a snapshot of the best model so
        far. Returns True when early stopping ends training at this epoch."""
        name = self.holdout_metric
        record[f"holdout_{name}"] = value = self.evaluate(self.holdout)[f"test_{name}"]
        if value < self.best["loss"]:
            self.best.update(loss=value, epoch=epoch)
            if self.keep_best_functions and self.first:
                for table in self.model.all_tables:
                    table.call(self.keep_best_functions[0], np.zeros(0, dtype=np.uint64))
            return False
        return bool(self.cfg.train.early_stop and epoch - self.best["epoch"] >= self.cfg.train.early_stop)

    # -- 5: workers --------------------------------------------------------------------------------

    def keep_best(self) -> None:
        """Collective over the workers: with early stopping, the servers go back to the best
        epoch's model (the one exported, checkpointed and summarised) unless it is the last."""
        best = self.best["epoch"]
        last = len(self.history) + self.start_epoch - 1
        if not (self.keep_best_functions and best and best != last and not self.preempted):
            return
        if self.first:
            for table in self.model.all_tables:
                table.call(self.keep_best_functions[1], np.zeros(0, dtype=np.uint64))
        self.workers.wait_for_all("barrier after keeping the best model")
        self.pipeline.finish()  # the deep models' MLP replica: the restored one
        if self.test is not None:  # the summary describes the model kept
            self.history.append({**self.history[-1], **self.evaluate(self.test),
                                 f"holdout_{self.holdout_metric}": self.best["loss"]})

    def finish(self) -> Result:
        """The final checkpoint, predictions, the end of serving, the model (one process) and the
        summary (printed and returned on the first worker)."""
        cfg, ctx, ck, tr = self.cfg, self.ctx, self.cfg.checkpoint, self.cfg.train
        elapsed = time.perf_counter() - self.t0
        if isinstance(self.train, tdata.PartStream):
            self.train.stop_thread()
        if ck.dir and ck.final and not self.preempted and self.saved_at != self.global_step:
            self.save(tr.epochs + 1, 1, "end of training")
        skipped = self.workers.total(self.train.skipped + (self.test.skipped if self.test else 0), "sum of skipped lines")
        if skipped and self.first:
            print(f"hpcps train: {skipped} bad lines skipped", flush=True)
        predicted = 0
        if self.to_predict is not None and not self.preempted:
            predicted = predict(ctx, self.pipeline, self.to_predict, tr.batch_size, cfg.model.loss, cfg.data.predict_out)
        self.progress.close()
        wait = self.workers.largest(float(ctx.stats["wait_s"]), "agreement of the workers")
        traffic = self.workers.reduce(np.array([ctx.stats["bytes_sent"], ctx.stats["bytes_received"]], dtype=np.int64),
                                      "sum", "sum of the bytes sent and received")
        if self.preempted:  # stopped by a signal after checkpointing
            _agree_preempted_worker(ctx, self.preempted)
            ctx.finalize()
            if self.first:
                name = "SIGINT" if self.preempted == EXIT_INTERRUPTED else "a signal"
                print(f"hpcps train: stopped by {name} after checkpoint {self.written}; rerun with --resume auto "
                      f"to continue (exit status {self.preempted})", flush=True)
            return Result(None, self.preempted, self.resumed)
        _, worker_rss, server_rss, key_counts = _agree_preempted_worker(ctx, 0)
        if tr.model_out:  # (one process: no server rank writes the model; this one does)
            agree_model_written(ctx, export_model(ctx, cfg, self.model, self.input_format) if ctx.local else None)
        ctx.finalize()
        if not self.first:
            return Result(None, 0, self.resumed)
        examples = self.examples
        summary = {"examples": examples, "time_s": elapsed, "examples_per_s": examples / elapsed if examples else None,
                   "workers": ctx.layout.workers, "servers": ctx.layout.servers,
                   **(self.history[-1] if self.history else {}),
                   "max_wait_s": wait, "max_staleness": ctx.stats["max_staleness"], "bad_lines_skipped": skipped,
                   "peak_rss_mb_worker": worker_rss, "peak_rss_mb_server": server_rss, **key_counts,
                   "bytes_sent": int(traffic[0]), "bytes_received": int(traffic[1])}
        if ctx.hosts:
            summary["hosts"] = ctx.layout.by_host(ctx.hosts)
        if self.kept is not None:  # the first worker's batches kept across epochs, compacted
            summary["kept_batches_mb"] = round(sum(b.nbytes + (h.nbytes if h is not None else 0)
                                                   for b, h in self.kept.values()) / 2**20, 1)
        if cfg.checkpoint.dir:
            summary["checkpoint"] = self.written  # this run's newest (None: it wrote none)
        if self.holdout is not None:
            summary["best_epoch"] = self.best["epoch"]
            summary["epochs_trained"] = self.stopped_at or tr.epochs
            summary["stopped_early"] = bool(self.stopped_at)
        if self.synth_info:
            summary["best_test_logloss"] = self.synth_info["best_test_logloss"]
            summary["best_test_auc"] = self.synth_info["best_test_auc"]
        if predicted:
            summary["predictions"] = predicted
        self.report(summary, elapsed, wait, key_counts)
        return Result(summary, 0, self.resumed)

    def report(self, summary: dict, elapsed: float, wait: float, key_counts: dict) -> None:
        """On the first worker: the summary table, where things went and what to try next."""
        ck = self.cfg.checkpoint
        print(summary_table(self.summary_rows(summary, elapsed, wait, key_counts)), flush=True)
        print(next_steps(self.cfg, self.paths, self.written if ck.dir else None, self.synth_info), flush=True)

    def summary_rows(self, summary: dict, elapsed: float, wait: float, key_counts: dict) -> list[tuple]:
        examples, layout, f = summary["examples"], self.ctx.layout, self.cfg.features
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
        if self.synth_info:
            rows.append(("best achievable logloss", f"{self.synth_info['best_test_logloss']:.5f}"))
            rows.append(("best achievable AUC", f"{self.synth_info['best_test_auc']:.5f}"))
        return rows


def next_steps(cfg, paths: dict, ckpt: str | None, synth_info: dict | None = None) -> str:
    """Where a run's outputs went, and the commands to try next with them."""
    tr = cfg.train
    test = paths.get("test") or "TEST_FILE"
    model = tr.model_out or "MODEL.h5"
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
        out.append(f"  export       hpcps export {ckpt} --out model.h5")
    out.append(f"  evaluate     hpcps eval --model {model} --data {test}")
    out.append(f"  predict      hpcps predict --model {model} --data {test} --out scores.txt")
    out.append(f"  plot         hpcps plot {tr.metrics or 'run.jsonl'} -o run.png")
    return "\n".join(out)


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (getrusage where /proc is missing)."""
    peak = vm_hwm_mb()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _agree_preempted(ctx, mine: int) -> tuple[int, float, float, dict]:
    """Collective over the world (servers after serving, workers before finalizing): the exit
    status of a stop on a signal (the largest of the ranks', 0 for none), the largest peak memory of a worker and of a server (MiB), and the
    servers' key counts summed (rows held, keys admitted, rows evicted)."""
    rss = _peak_rss_mb()
    flag = ctx.every_rank.reduce(np.array([float(mine), rss if ctx.is_worker else 0.0, rss if ctx.is_server else 0.0]),
                                 "max", "agreement on the end of training")
    st = ctx.server_stats or {}  # server ranks, or a one-process job's in-process server
    counts = np.array([sum(st.get(k, [])) for k in ("keys", "admitted", "evicted")], dtype=np.int64)
    counts = ctx.every_rank.reduce(counts, "sum", "sum of the servers' key counts")
    keys = {"table_keys": int(counts[0]), "admitted_keys": int(counts[1]), "evicted_keys": int(counts[2])}
    return int(flag[0]), float(flag[1]), float(flag[2]), keys


def _agree_preempted_worker(ctx, mine: int) -> tuple[int, float, float, dict]:
    # workers send DONE first (after their requests complete) so that the servers leave their
    # loop and join the agreement
    ctx.finish_serving()
    return _agree_preempted(ctx, mine)
