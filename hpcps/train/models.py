"""Models on the parameter server: logistic/linear regression and factorization machines.

* ``lr``: one table ``w`` of dim 1 (initialised to zeros); margin = sum of w[key] * value.
* ``fm``: one table ``fm`` of dim 1 + k holding, per key, ``[w | v_1..v_k]`` (one pull per batch for
  both); margin = linear part + pairwise interactions (:func:`hpcps_kernels.models.fm_forward_backward`).

Every row carries the bias key (:data:`hpcps.train.data.BIAS_KEY`), so the bias is a weight like
any other. L2 regularisation is the server optimizer's ``l2``.
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from hpcps.train.data import BIAS_KEY
from hpcps_kernels import keys as kkeys
from hpcps_kernels import models as kmodels

LOSSES = {"logistic": kmodels.LOGISTIC, "squared": kmodels.SQUARED}


@dataclass
class _Prepared:
    """A batch whose unique keys are known, and whose rows may be on their way (``ts``) or here."""

    batch: object
    uniq: np.ndarray
    pos: np.ndarray
    ts: int | None = None
    params: np.ndarray | None = None


class Model:
    """Common part: the table, the loss, a step and margins."""

    def __init__(self, ctx, cfg, bias: float = 0.0):
        self.cfg = cfg
        self.bias = bias  # the bias key's initial weight (a regression's label mean)
        self.loss = LOSSES[cfg.model.loss]
        self.aggregate = cfg.train.aggregate
        self.table = self._declare(ctx, cfg)
        self.ctx = ctx
        # a batch's keys need sorting only where a worker group merges its pushes
        self._sorted = ctx.is_worker and self.aggregate and ctx.group_comm.Get_size() > 1
        self._pending = None                 # a push in flight (the last step's, without push-pull)
        self._ahead: list[_Prepared] = []    # the next batches, prepared (see step)

    def _declare(self, ctx, cfg):
        raise NotImplementedError

    def _bias_key(self, dim: int) -> tuple:
        """The bias feature's initial row, when it does not start at the initializer."""
        if not self.bias:
            return ()
        return ((int(BIAS_KEY), (self.bias,) + (0.0,) * (dim - 1)),)

    def _forward_backward(self, batch, pos, params, grads, scale) -> float:
        raise NotImplementedError

    def _margins(self, batch, pos, params, out) -> None:
        raise NotImplementedError

    def _prepare(self, batch) -> _Prepared:
        for p in self._ahead:
            if p.batch is batch:
                return p
        return _Prepared(batch, *(kkeys.unique_keys if self._sorted else kkeys.dedup_keys)(batch.indices))

    def step(self, batch, scale: float, upcoming=()) -> float:
        """One iteration: pull the batch's rows, compute, push the gradients, end the clock.
        Returns the summed loss.

        ``upcoming``: the batches this worker trains on next (the same objects will be passed to
        the next steps). With them the step pipelines (the seeds' pipelining, one level down): the
        push of this step, the clock and the pull of the next batch's rows go in one push-pull
        round trip, and the keys of the batch after it are deduplicated while the servers work.
        Under BSP the numbers are those of the unpipelined step, bit for bit.
        """
        if self.cfg.model.compute == "servers":
            return self._step_on_servers(batch, scale)
        if self._pending is not None:
            self.table.wait(self._pending)  # at most one push in flight
            self._pending = None
        cur = self._prepare(batch)
        if cur.params is None:
            cur.params = self.table.wait(cur.ts) if cur.ts is not None else self.table.pull(cur.uniq, unique=True)
        self._ahead = [p for p in self._ahead if p is not cur]
        grads = np.empty_like(cur.params)
        loss = self._forward_backward(batch, cur.pos, cur.params, grads, scale) if batch.rows else 0.0
        if upcoming:
            nxt = self._prepare(upcoming[0])
            nxt.ts = self.table.ipushpull(cur.uniq, grads, nxt.uniq, aggregate=self.aggregate, unique=True)
            self._ahead = [nxt]
            if len(upcoming) > 1:  # overlaps the servers' work on the push-pull just sent
                self._ahead.append(self._prepare(upcoming[1]))
        else:
            self._pending = self.table.push(cur.uniq, grads, aggregate=self.aggregate, unique=True)
            self.ctx.clock()
        return loss

    def _step_on_servers(self, batch, scale: float) -> float:
        """``model.compute = "servers"`` (the seeds' third realm): the batch's nonzeros go to the
        servers, which return each row's partial sums and, given each row's residual, compute and
        apply the gradients themselves. Two round trips a step and no pipelining; weights are
        never pulled. Under BSP it computes what the pull-based step computes (bit for bit with
        one server; with several, partial sums add in another order)."""
        if self._pending is not None:
            self.table.wait(self._pending)
            self._pending = None
        rows = batch.rows
        row_ids = np.repeat(np.arange(rows, dtype=np.int32), np.diff(batch.indptr))
        partials = self.table.wait(self.table.imargins(batch.indices, batch.values, row_ids, rows))
        residuals = np.empty((rows, self.table.dim), dtype=np.float64)
        loss = self._residuals(partials, batch.labels, scale, residuals) if rows else 0.0
        self._pending = self.table.iresiduals(residuals)  # ends the step (the clock)
        return loss

    def _residuals(self, partials, labels, scale, out) -> float:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for every request in flight (pulled rows ahead are kept for their step)."""
        if self._pending is not None:
            self.table.wait(self._pending)
            self._pending = None
        for p in self._ahead:
            if p.ts is not None:
                p.params = self.table.wait(p.ts)
                p.ts = None

    def margins(self, batch) -> np.ndarray:
        uniq, pos = kkeys.unique_keys(batch.indices)
        params = self.table.pull(uniq)
        out = np.empty(batch.rows, dtype=np.float64)
        if batch.rows:
            self._margins(batch, pos, params, out)
        return out


class LinearModel(Model):
    def _residuals(self, partials, labels, scale, out) -> float:
        return kmodels.lr_residuals(partials, labels, scale, self.loss, out[:, 0])

    def _declare(self, ctx, cfg):
        return ctx.sparse_table("w", dim=1, optimizer=cfg.optimizer.name, params=cfg.optimizer.params,
                                init="zeros", seed=cfg.model.seed, key_bits=cfg.data.hash_bits,
                                features=cfg.features, init_keys=self._bias_key(1))

    def _forward_backward(self, batch, pos, params, grads, scale):
        return kmodels.lr_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0],
                                           grads[:, 0], scale, 0.0, self.loss)

    def _margins(self, batch, pos, params, out):
        kmodels.lr_predict(batch.indptr, pos, batch.values, params[:, 0], out)


class FactorizationMachine(Model):
    def _residuals(self, partials, labels, scale, out) -> float:
        return kmodels.fm_residuals(partials, labels, scale, self.loss, out)

    def _declare(self, ctx, cfg):
        return ctx.sparse_table("fm", dim=1 + cfg.model.factors, optimizer=cfg.optimizer.name,
                                params=cfg.optimizer.params, init="normal", init_scale=cfg.model.init_scale,
                                seed=cfg.model.seed, key_bits=cfg.data.hash_bits, features=cfg.features,
                                init_keys=self._bias_key(1 + cfg.model.factors))

    def _forward_backward(self, batch, pos, params, grads, scale):
        return kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0],
                                           params[:, 1:], grads[:, 0], grads[:, 1:], scale, 0.0, self.loss,
                                           np.empty(0))

    def _margins(self, batch, pos, params, out):
        g = np.empty_like(params)
        kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[:, 0], params[:, 1:],
                                    g[:, 0], g[:, 1:], 0.0, 0.0, self.loss, out)


def make_model(ctx, cfg, bias: float = 0.0) -> Model:
    """The configured model; ``bias``: the bias weight's initial value."""
    return {"lr": LinearModel, "fm": FactorizationMachine}[cfg.model.type](ctx, cfg, bias)


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
