"""Scoring with the model on the servers: the exact metrics of a held-out set (logloss and AUC,
or RMSE for the squared loss; weighted by the rows' importance weights where it has any) and the
predictions of a file, collective over the workers.

Each worker scores its own part; the margins are gathered on the first worker, which computes the
metrics over every row (or writes every score, in input order) and shares them.
"""

from __future__ import annotations

import numpy as np

from hpcps import outputs
from hpcps.ps.collectives import World
from hpcps.train import data as tdata
from hpcps_kernels import keys as kkeys
from hpcps_kernels import metrics
from hpcps_kernels.tuning import EVAL_BATCH_ROWS


def _gather_on_first(ctx, array: np.ndarray) -> np.ndarray | None:
    workers = ctx.among_workers
    counts = workers.sizes(array.shape[0], "gather of evaluation sizes")
    return workers.gather_to_first(array, counts, "gather of evaluation results")




def eval_batch(batch_size: int) -> int:
    """Rows per request when scoring (:func:`evaluate_columns`, :func:`predict`): the training's
    batch, but at least ``EVAL_BATCH_ROWS``. A row's margin does not depend on the rows beside it, so
    this changes no score, only the number of round trips (a small job trains in small batches,
    and scoring its test rows in those would take a pull per batch)."""
    return max(batch_size, EVAL_BATCH_ROWS)


class KeptTestSet:
    """A held-out set kept as the batches it is scored in (:func:`eval_batch` rows each), each
    deduplicated once when the set is loaded (:meth:`hpcps.train.data.Dataset.compact`: its
    sorted unique keys, as a pull asks for them, and each nonzero's position among them), not
    again at every evaluation; the set's keys take 2 bytes a nonzero instead of 8. For a model
    that reads only positions (not ``reads_keys``). Read as a Dataset is by the evaluation: its
    ``rows``, ``labels``, ``weights``, ``skipped`` and its batches (:meth:`batch`)."""

    def __init__(self, ds: tdata.Dataset, rows_per_batch: int):
        self.labels, self.weights, self.skipped, self.source = ds.labels, ds.weights, ds.skipped, ds.source
        self.rows_per_batch = rows_per_batch
        self.batches = []
        for lo in range(0, ds.rows, rows_per_batch):
            b = ds.batch(lo, lo + rows_per_batch)
            b.compact(*kkeys.unique_keys(b.indices))
            self.batches.append(b)

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    def batch(self, lo: int, hi: int) -> tdata.Dataset:
        """Rows ``[lo, hi)``: one of the batches kept (``lo`` where one starts, ``hi`` where it ends)."""
        b = self.batches[lo // self.rows_per_batch]
        if lo % self.rows_per_batch or min(hi, self.rows) != lo + b.rows:
            raise ValueError(f"rows [{lo}, {hi}) are not a batch of {self.rows_per_batch} rows kept")
        return b


def kept_for_scoring(ds: tdata.Dataset | None, model, batch_size: int):
    """``ds`` as a :class:`KeptTestSet` where the model reads only positions, else as it is."""
    if ds is None or not ds.rows or model.reads_keys:
        return ds
    return KeptTestSet(ds, eval_batch(batch_size))


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
    weights = ds.weights if ds is not None and ds.weights is not None else np.ones(n, dtype=np.float32)
    all_w = _gather_on_first(ctx, weights[:n].astype(np.float64))
    all_w = None if all_w is None or (all_w == 1.0).all() else all_w  # (unweighted: the same sums as before)
    out = np.zeros((columns, 3))
    for c in range(columns):
        all_m = _gather_on_first(ctx, m[:, c])
        if ctx.among_workers.is_first and all_m.size:
            if loss == "logistic":
                out[c] = (metrics.logloss(all_y, all_m, all_w), metrics.auc(all_y, all_m, all_w), all_m.size)
            else:
                out[c] = (metrics.rmse(all_y, all_m, all_w), np.nan, all_m.size)
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
            end_job_on(e)
        return everything.size
    return 0


def end_job_on(e: outputs.OutputError) -> None:
    """An output that failed mid-run on one rank (the metrics, the predictions): its one line
    ends the job (the other ranks are serving or stepping)."""
    World.end_job_with(f"error: {e}", e.exit_status)


def write_scores(path: str, scores: np.ndarray) -> None:
    """One score per line, replacing ``path`` whole (:func:`hpcps.outputs.replacing`)."""
    with outputs.replacing(path, scores.size * 9) as tmp, open(tmp, "w") as f:
        np.savetxt(f, scores, fmt="%.6f")  # (a file object: given a name, savetxt opens it twice, which a FIFO cannot take)
