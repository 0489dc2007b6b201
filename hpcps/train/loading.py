"""Loading a run's data parts and its model's starting point, collective over the world.

Workers load their part of each data file (the training file as a stream), and every rank agrees
on what the files say before the model is declared: whether each loaded (every failing rank's
message on every rank), the fields per row of a model that reads them, and the bias weight's initial value.
"""

from __future__ import annotations

import math
import os

import numpy as np

from hpcps import config
from hpcps.train import data as tdata
from hpcps.train import inputs, tables
from hpcps.train.models import resolve_fields
from hpcps.train.plan import TrainError


KEYS = {"training": "data.train", "test": "data.test", "prediction": "data.predict"}  # (what: its key)


def load_part(ctx, cfg, path, what: str, stream: bool = False):
    """Collective over the world: workers load their part of ``path`` (or open it as a
    :class:`~hpcps.train.data.PartStream`, parsing its first block); any error is raised on every
    rank with every failing rank's message. A file without a row is an error; so is, for the
    training file, a worker's part without one (a test or prediction file's rows are gathered).
    The rows of a prediction file may come without labels. ``path``: a file, a glob, a directory
    of part files or a list of them (:func:`hpcps.train.inputs.data_files`)."""
    ds, error, empty = None, None, np.zeros(3, dtype=np.int64)  # workers: without rows, all, of an empty file
    if ctx.is_worker and path:
        try:
            d = cfg.data
            fields = cfg.model.type in config.FIELDED  # keys carry their field
            squared = cfg.model.loss == "squared"  # (labels far from the first rows' get a warning)
            if stream and not d.cache_dir:
                ds = tdata.PartStream(path, ctx.worker_index, ctx.layout.workers, d.format, d.hash_bits,
                                      d.skip_bad_lines, cfg.model.loss == "logistic", d.memory_mb,
                                      fields=fields, shuffle_rows=d.shuffle_rows, shuffle_seed=d.shuffle_seed,
                                      warn_labels=squared, key=KEYS.get(what, "data"),
                                      columns=tables.Columns.of(d)).open()
                rows = int(ds.has_rows)  # (the part's count goes on, on a thread, until steps are agreed)
            else:
                ds = tdata.load_part(path, ctx.worker_index, ctx.layout.workers, d.format, d.hash_bits,
                                     d.skip_bad_lines, d.cache_dir, binary=cfg.model.loss == "logistic",
                                     fields=fields, key=KEYS.get(what, "data"), idle_ok=not stream,
                                     need_labels=what != "prediction", columns=tables.Columns.of(d))
                rows = ds.rows
                if stream:
                    ds = tdata.LoadedPart(ds, d.shuffle_rows, d.shuffle_seed, warn_labels=squared)
            empty[:] = (rows == 0, 1, sum(os.path.getsize(f) for f in inputs.data_files(path)) == 0)
        except (tdata.DataError, OSError) as e:
            error = str(e)
    errors = ctx.every_rank.failures(error, f"loading of {what} data")
    if errors:
        raise TrainError("cannot load data:\n  " + "\n  ".join(errors))
    if path:
        named = inputs.describe(inputs.data_files(path))
        no_rows, workers, zero_bytes = ctx.every_rank.reduce(empty, "sum", f"count of the {what} parts without rows")
        if no_rows == workers:
            raise TrainError(f"cannot load data: {what} file {named} holds no rows: "
                             + ("it is empty" if zero_bytes else "its lines are all blank or comments"
                                + (" or bad lines skipped" if cfg.data.skip_bad_lines else "")))
        if no_rows and stream:
            raise TrainError(f"cannot load data: {what} file {named}: a worker's byte range holds no rows "
                             f"({no_rows} of {workers} workers); use fewer workers or more data")
    return ds


def model_fields(ctx, cfg, train_path: str) -> int:
    """Collective: the fields per row of a model that reads fields (ffm, wdl, deepfm; 1 for the
    others); a libffm file without ``model.fields`` is an error on every rank."""
    if cfg.model.type not in config.FIELDED:
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


BIAS_ROWS = 4096  # rows per worker whose labels set the initial bias (model.bias_init = "auto")


# The logistic bias starts within the log-odds of [BIAS_P, 1 - BIAS_P]. It does for LR and FM,
# whose test logloss it improved on every set of docs/defaults-sweep.py; W&D and DeepFM keep 0
# (their logloss was worse with it: the MLP's own output bias is there to learn the base rate).
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


def parse_ahead(ctx, cfg, train) -> None:
    """A training stream parses its next rows ahead: on a thread (``data.parse_thread``, stopped
    at the end of training) or while the steps wait for the servers (the context's background
    work). A part loaded whole has nothing to parse."""
    if isinstance(train, tdata.PartStream):
        if cfg.data.parse_thread:
            train.start_thread()
        else:
            ctx.background = train.pump


def lost_part(ctx, cfg, path, worker: int):
    """Worker ``worker``'s part of the training data ``path``, loaded whole on this worker alone
    (not collective): the part of a worker lost under ULFM, which the others take over
    (:mod:`hpcps.train.takeover`). Its batches are those the lost worker's own steps made."""
    d = cfg.data
    ds = tdata.load_part(path, worker, ctx.layout.workers, d.format, d.hash_bits, d.skip_bad_lines, d.cache_dir,
                         binary=cfg.model.loss == "logistic", fields=cfg.model.type in config.FIELDED,
                         key=KEYS["training"], columns=tables.Columns.of(d))
    return tdata.LoadedPart(ds, d.shuffle_rows, d.shuffle_seed)
