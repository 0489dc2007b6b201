"""Models on the parameter server: logistic/linear regression and factorization machines.

* ``lr``: one table ``w`` of dim 1 (initialised to zeros); margin = sum of w[key] * value.
* ``fm``: one table ``fm`` of dim 1 + k holding, per key, ``[w | v_1..v_k]`` (one pull per batch for
  both); margin = linear part + pairwise interactions (:func:`hpcps_kernels.models.fm_forward_backward`).

Every row carries the bias key (:data:`hpcps.train.data.BIAS_KEY`), so the bias is a weight like
any other. L2 regularisation is the server optimizer's ``l2``.
"""

from __future__ import annotations

import numpy as np

from hpcps_kernels import keys as kkeys
from hpcps_kernels import models as kmodels

LOSSES = {"logistic": kmodels.LOGISTIC, "squared": kmodels.SQUARED}


class Model:
    """Common part: the table, the loss, a step and margins."""

    def __init__(self, ctx, cfg):
        self.cfg = cfg
        self.loss = LOSSES[cfg.model.loss]
        self.aggregate = cfg.train.aggregate
        self.table = self._declare(ctx, cfg)
        self._pending = None

    def _declare(self, ctx, cfg):
        raise NotImplementedError

    def _forward_backward(self, batch, pos, params, grads, scale) -> float:
        raise NotImplementedError

    def _margins(self, batch, pos, params, out) -> None:
        raise NotImplementedError

    def step(self, batch, scale: float) -> float:
        """Pull the batch's unique keys, compute, push the gradients; returns the summed loss."""
        if self._pending is not None:
            self.table.wait(self._pending)  # at most one push in flight
        uniq, pos = kkeys.unique_keys(batch.indices)
        params = self.table.pull(uniq)
        grads = np.empty_like(params)
        loss = self._forward_backward(batch, pos, params, grads, scale) if batch.rows else 0.0
        self._pending = self.table.push(uniq, grads, aggregate=self.aggregate)
        return loss

    def finish(self) -> None:
        if self._pending is not None:
            self.table.wait(self._pending)
            self._pending = None

    def margins(self, batch) -> np.ndarray:
        uniq, pos = kkeys.unique_keys(batch.indices)
        params = self.table.pull(uniq)
        out = np.empty(batch.rows, dtype=np.float64)
        if batch.rows:
            self._margins(batch, pos, params, out)
        return out


class LinearModel(Model):
    def _declare(self, ctx, cfg):
        return ctx.sparse_table("w", dim=1, optimizer=cfg.optimizer.name, params=cfg.optimizer.params,
                                init="zeros", seed=cfg.model.seed)

    def _forward_backward(self, batch, pos, params, grads, scale):
        return kmodels.lr_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0],
                                           grads[:, 0], scale, 0.0, self.loss)

    def _margins(self, batch, pos, params, out):
        kmodels.lr_predict(batch.indptr, pos, batch.values, params[:, 0], out)


class FactorizationMachine(Model):
    def _declare(self, ctx, cfg):
        return ctx.sparse_table("fm", dim=1 + cfg.model.factors, optimizer=cfg.optimizer.name,
                                params=cfg.optimizer.params, init="normal", init_scale=cfg.model.init_scale,
                                seed=cfg.model.seed)

    def _forward_backward(self, batch, pos, params, grads, scale):
        return kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0],
                                           params[:, 1:], grads[:, 0], grads[:, 1:], scale, 0.0, self.loss,
                                           np.empty(0))

    def _margins(self, batch, pos, params, out):
        g = np.empty_like(params)
        kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0], params[:, 1:],
                                    g[:, 0], g[:, 1:], 0.0, 0.0, self.loss, out)


def make_model(ctx, cfg) -> Model:
    return {"lr": LinearModel, "fm": FactorizationMachine}[cfg.model.type](ctx, cfg)


def margins_from_params(kind: str, batch, pos, params, loss: str = "logistic") -> np.ndarray:
    """Margins of a batch given its keys' pulled parameters (used by serving without servers)."""
    out = np.empty(batch.rows, dtype=np.float64)
    if not batch.rows:
        return out
    if kind == "lr":
        kmodels.lr_predict(batch.indptr, pos, batch.values, np.ascontiguousarray(params[:, 0]), out)
    else:
        g = np.empty_like(params)
        kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0], params[:, 1:],
                                    g[:, 0], g[:, 1:], 0.0, 0.0, LOSSES[loss], out)
    return out
