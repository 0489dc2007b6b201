"""Early stopping over the held-out rows (``train.holdout``, ``train.early_stop``).

The holdout set (every Nth row of each worker's part, collected over the first whole epoch: see
:mod:`hpcps.train.feed`) is scored after each epoch; its metric (logloss, or RMSE for the squared
loss) decides. With ``train.early_stop = K``, training ends when the metric has not improved for K
epochs, and the servers keep a snapshot of the best epoch's model (server functions), which
replaces the last one's at the end (the model exported, checkpointed and summarised).
"""

from __future__ import annotations

import math

import numpy as np

from hpcps.ps import tables


def _snapshot(shard, keys, args):
    shard.snapshot()
    return np.zeros(1, dtype=np.float32)


def _restore(shard, keys, args):
    shard.restore_snapshot()
    return np.zeros(1, dtype=np.float32)


# early stopping keeps the best model on the servers (server functions, see hpcps.ps.tables)
tables.register_server_function("hpcps.snapshot", _snapshot, 1, per_key=False, replace=True)
tables.register_server_function("hpcps.restore", _restore, 1, per_key=False, replace=True)


class EarlyStopping:
    """The holdout's best epoch so far and when training stops. Made on every rank (the server
    functions it needs are declared collectively), used on the workers."""

    def __init__(self, ctx, cfg):
        self.every = cfg.train.holdout  # every Nth row is held out (0: none)
        self.patience = cfg.train.early_stop  # epochs without improvement before stopping (0: never)
        self.metric = "logloss" if cfg.model.loss == "logistic" else "rmse"
        self.best = {"loss": math.inf, "epoch": 0}
        self.stopped_at = 0  # the epoch early stopping ended training at (0: it did not)
        self.holdout = None  # the holdout set (this worker's part of it), once collected
        self.holdout_rows = 0  # every worker's held-out rows
        self.functions = (ctx.server_function("hpcps.snapshot"), ctx.server_function("hpcps.restore")) \
            if self.patience else None

    def set_holdout(self, holdout, workers, stop, examples: int) -> None:
        """Collective over the workers: the holdout set, collected over an epoch of ``examples``
        rows; ``stop(line, code)`` ends the job when no worker holds out a row (its loss
        would read 0: a silently wrong number)."""
        self.holdout = holdout
        self.holdout_rows = workers.total(holdout.rows, "sum of the holdout rows")
        if not self.holdout_rows:
            n = self.every
            stop(f"error: train.holdout = {n} holds out no row: every worker's part has fewer than {n} rows "
                 f"({examples} rows trained an epoch); use a smaller train.holdout or more data", 2)

    def after_epoch(self, epoch: int, record: dict, evaluate, model, first: bool) -> bool:
        """Collective over the workers: :meth:`watch` the holdout after ``epoch``; returns True
        when training stops here (:attr:`stopped_at`)."""
        self.stopped_at = epoch if self.watch(epoch, record, evaluate, model, first) else 0
        return bool(self.stopped_at)

    def watch(self, epoch: int, record: dict, evaluate, model, first: bool) -> bool:
        """The holdout metric into ``record`` (``evaluate(ds)``: the model's metrics on a set);
        the servers keep a snapshot of the best ``model`` so far (the first worker asks them).
        Returns True when early stopping ends training at this epoch."""
        name = self.metric
        record[f"holdout_{name}"] = value = evaluate(self.holdout)[f"test_{name}"]
        if value < self.best["loss"]:
            self.best.update(loss=value, epoch=epoch)
            if self.functions and first:
                for table in model.all_tables:
                    table.call(self.functions[0], np.zeros(0, dtype=np.uint64))
            return False
        return bool(self.patience and epoch - self.best["epoch"] >= self.patience)

    def keep_best(self, history: list, first_epoch: int, model, pipeline, workers, evaluate, test) -> None:
        """Collective over the workers, at the end of training: the servers go back to the best
        epoch's model (the one exported, checkpointed and summarised) unless it is the last of
        ``history`` (the records of the epochs from ``first_epoch``); the workers' MLP replicas
        then are the restored one, and a last record describes it (its metrics on ``test``)."""
        if not self.restore_best(len(history) + first_epoch - 1, model, workers):
            return
        pipeline.finish()
        if test is not None:
            history.append({**history[-1], **evaluate(test), f"holdout_{self.metric}": self.best["loss"]})

    def restore_best(self, last_epoch: int, model, workers) -> bool:
        """Collective over the workers: the servers go back to the best epoch's model unless it is
        the last (or early stopping is off). Returns whether they did."""
        best = self.best["epoch"]
        if not (self.functions and best and best != last_epoch):
            return False
        if workers.is_first:
            for table in model.all_tables:
                table.call(self.functions[1], np.zeros(0, dtype=np.uint64))
        workers.wait_for_all("barrier after keeping the best model")
        return True

    def summary(self, epochs: int) -> dict:
        """The summary's lines on early stopping, of a run of at most ``epochs`` epochs."""
        return {"best_epoch": self.best["epoch"], "epochs_trained": self.stopped_at or epochs,
                "stopped_early": bool(self.stopped_at)}
