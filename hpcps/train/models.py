"""Models on the parameter server: logistic/linear regression and factorization machines.

* ``lr``: one table ``w`` of dim 1 (initialised to zeros); margin = sum of w[key] * value.
* ``fm``: one table ``fm`` of dim 1 + k holding, per key, ``[w | v_1..v_k]`` (one pull per batch for
  both); margin = linear part + pairwise interactions (:func:`hpcps_kernels.models.fm_forward_backward`).
* ``ffm``: one table ``ffm`` of dim 1 + fields * k holding, per key, ``[w | v_{.,0} | .. |
  v_{.,fields-1}]``; margin = linear part + field-aware pairwise interactions
  (:mod:`hpcps_kernels.ffm`).
* ``wdl``, ``deepfm``: :class:`DeepModel`.

Every row carries the bias key (:data:`hpcps.train.data.BIAS_KEY`), so the bias is a weight like
any other. L2 regularisation is the server optimizer's ``l2``.
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.config import BUILT_IN_MODELS, DEEP, FIELDED, add_choice
from hpcps.train.data import BIAS_KEY, values_if_any
from hpcps.train.ffm import batch_fields, ffm_margins, field_error
from hpcps_kernels import deep as kdeep
from hpcps_kernels import ffm as kffm
from hpcps_kernels import keys as kkeys
from hpcps_kernels import models as kmodels

LOSSES = {"logistic": kmodels.LOGISTIC, "squared": kmodels.SQUARED}


class NonFiniteError(RuntimeError):
    """A step's loss is NaN or infinite: its gradients are not pushed. ``tables``: the tables
    whose rows pulled for the batch hold a non-finite number (none: the batch's own numbers
    overflowed, or a non-finite weight hid behind the MLP's activation)."""

    exit_status = 1  # a run-time failure (see hpcps.errors)

    def __init__(self, loss: float, tables: list[str]):
        self.loss, self.tables = loss, tables
        where = f"non-finite rows pulled from table(s) {', '.join(tables)}" if tables else "the rows pulled are finite"
        super().__init__(f"the loss is {loss}: {where}")


def tick(stages: dict, stage: str, since: float) -> float:
    """Add the time since ``since`` to ``stages[stage]``; returns now."""
    now = time.perf_counter()
    stages[stage] = stages.get(stage, 0.0) + now - since
    return now


class Model:
    """Common part: the sparse tables (the first carries the step's clock), the loss, and the
    maths of a batch given its keys' pulled rows: :meth:`forward_backward` (the loss and the
    gradients) and :meth:`margins`. A model declares its tables in :meth:`declare_tables`; the rows of
    all of them are pulled together for a batch's unique keys, and its gradients pushed together,
    by a :class:`hpcps.train.pipeline.StepPipeline` (a model sends no message itself)."""

    compute_empty = False  # call forward_backward on an empty batch (group collectives follow it)
    reads_keys = False     # a step reads the batch's keys, not only their positions (a batch's
                           # keys may then not be compacted: see Dataset.compact)
    fields = 1             # fields per row (the deep models' embeddings)
    times_compute = False  # forward_backward times its own stages (else it is one, "compute")
    narrow_positions = False  # forward_backward reads a kept batch's positions as kept (uint16 or int32)

    def __init__(self, ctx, cfg, bias: float = 0.0, suffix: str = ""):
        self.cfg = cfg
        self.bias = bias  # the bias key's initial weight (a regression's label mean)
        self.suffix = suffix  # added to the names of its tables (a member of a Grid)
        self.loss = LOSSES[cfg.model.loss]
        self.sparse = self.declare_tables(ctx, cfg)
        self.table = self.sparse[0]
        # the training data's keys are hash values (Criteo, VW): their dedup skips remixing them
        # (set by the trainer from the data's format; see hpcps_kernels.keys.dedup_keys)
        self.hashed_keys = False
        self.stages: dict[str, float] = {}   # seconds per stage of the step (the pipeline's too)

    def declare_tables(self, ctx, cfg) -> list:
        """The model's sparse tables, declared with ``ctx.sparse_table`` (collective: the same on
        every rank); names end with :attr:`suffix`."""
        raise NotImplementedError

    @property
    def all_tables(self) -> list:
        """Every table on the servers (sparse handles), for server functions over the whole model."""
        return list(self.sparse)

    @property
    def mlp_models(self) -> list:
        """The models whose MLP replica the step pipeline keeps in step (deep models)."""
        return []

    def bias_init_keys(self, dim: int) -> tuple:
        """``init_keys`` for a table of ``dim`` values: the bias feature's row starting at
        :attr:`bias` (none when it is 0)."""
        if not self.bias:
            return ()
        return ((int(BIAS_KEY), (self.bias,) + (0.0,) * (dim - 1)),)

    def forward_backward(self, batch, pos, params: list, grads: list, scale, dense_ready=None) -> float:
        """The summed loss of ``batch`` (keys at positions ``pos`` of the unique keys whose rows of
        each sparse table are ``params``) and its gradients into ``grads`` (like ``params``).
        ``dense_ready(model, grad)``: called by a deep model once its MLP's gradient is complete."""
        raise NotImplementedError

    def margins_into(self, batch, pos, params: list, out) -> None:
        """The margins of ``batch``'s rows (a batch with rows) into ``out``."""
        raise NotImplementedError

    def margins(self, batch, pos, params: list) -> np.ndarray:
        out = np.empty(batch.rows, dtype=np.float64)
        if batch.rows:
            self.margins_into(batch, pos, params, out)
        return out

    def residuals(self, partials, labels, scale, out, weights=None) -> float:
        """``model.compute = "servers"``: each row's residual given its partial sums, into ``out``
        (``weights``: the rows' importance weights, None: all 1); returns the summed loss."""
        raise NotImplementedError

    def non_finite_tables(self, params: list) -> list[str]:
        """The names of the tables whose rows in ``params`` (pulled for a batch) are not all
        finite (a failed step's diagnosis only: a pass over them)."""
        return [t.name for t, p in zip(self.sparse, params) if not np.isfinite(p).all()]


class LinearModel(Model):
    narrow_positions = True

    def residuals(self, partials, labels, scale, out, weights=None) -> float:
        return kmodels.lr_residuals(partials, labels, scale, self.loss, out[:, 0], weights)

    def declare_tables(self, ctx, cfg):
        return [ctx.sparse_table("w" + self.suffix, dim=1, optimizer=cfg.optimizer.name, params=cfg.optimizer.params,
                                 init="zeros", seed=cfg.model.seed, key_bits=cfg.data.hash_bits,
                                 features=cfg.features, init_keys=self.bias_init_keys(1))]

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        return kmodels.lr_forward_backward(batch.indptr, pos, values_if_any(batch.values), batch.labels,
                                           params[0][:, 0], grads[0][:, 0], scale, 0.0, self.loss, batch.weights)

    def margins_into(self, batch, pos, params, out):
        kmodels.lr_predict(batch.indptr, pos, batch.values, params[0][:, 0], out)


class FactorizationMachine(Model):
    def residuals(self, partials, labels, scale, out, weights=None) -> float:
        return kmodels.fm_residuals(partials, labels, scale, self.loss, out, weights)

    def declare_tables(self, ctx, cfg):
        return [ctx.sparse_table("fm" + self.suffix, dim=1 + cfg.model.factors, optimizer=cfg.optimizer.name,
                                 params=cfg.optimizer.params, init="normal", init_scale=cfg.model.init_scale,
                                 seed=cfg.model.seed, key_bits=cfg.data.hash_bits, features=cfg.features,
                                 init_keys=self.bias_init_keys(1 + cfg.model.factors))]

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        p, g = params[0], grads[0]
        return kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, p[:, 0],
                                           p[:, 1:], g[:, 0], g[:, 1:], scale, 0.0, self.loss, np.empty(0),
                                           batch.weights)

    def margins_into(self, batch, pos, params, out):
        p = params[0]
        g = np.empty_like(p)
        kmodels.fm_forward_backward(batch.indptr, pos, batch.values, batch.labels, p[:, 0], p[:, 1:],
                                    g[:, 0], g[:, 1:], 0.0, 0.0, self.loss, out)


class FieldAwareFM(Model):
    """The field-aware FM (libffm, xLearn): one table ``ffm`` of ``1 + fields * factors`` values a
    key (its weight, then a vector of ``factors`` for each field it can meet). A key's field is in
    its bits above ``data.hash_bits`` (libffm: the field written; Criteo: the column)."""

    reads_keys = True  # a key's field is in its high bits

    def __init__(self, ctx, cfg, bias: float = 0.0, suffix: str = "", fields: int = 1):
        self.fields, self.k, self.shift = fields, cfg.model.factors, cfg.data.hash_bits
        self.key_bits = min(64, self.shift + max(1, (fields - 1).bit_length()))
        super().__init__(ctx, cfg, bias, suffix)

    def declare_tables(self, ctx, cfg):
        dim = 1 + self.fields * self.k
        return [ctx.sparse_table("ffm" + self.suffix, dim=dim, optimizer=cfg.optimizer.name, params=cfg.optimizer.params,
                                 init="normal", init_scale=cfg.model.init_scale, seed=cfg.model.seed,
                                 key_bits=self.key_bits, features=cfg.features, init_keys=self.bias_init_keys(dim))]

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        fld = batch_fields(batch, self.shift, self.fields)
        return kffm.ffm_forward_backward(batch.indptr, pos, fld, batch.values, batch.labels, params[0], grads[0],
                                         self.k, scale, 0.0, self.loss, np.empty(0), batch.weights)

    def margins_into(self, batch, pos, params, out):
        out[:] = ffm_margins(batch, pos, params[0], self.k, self.shift, self.fields)


FORMAT_FIELDS = {"criteo": 39, "libsvm": 1, "vw": 1}  # fields per row by format (libffm: say model.fields)


def resolve_fields(cfg, fmt: str) -> int:
    """The number of fields of a deep model's rows: ``model.fields``, or the format's. Raises
    ValueError naming the key where it cannot be known."""
    if cfg.model.fields:
        return cfg.model.fields
    if fmt not in FORMAT_FIELDS:
        raise ValueError(f"model.fields: set the number of fields of the {fmt} data (its largest field id + 1) "
                         f"for model.type = {cfg.model.type!r}")
    return FORMAT_FIELDS[fmt]


class DeepNet:
    """The deep models' computation, apart from where parameters live (no MPI; used to train and
    to serve). ``wdl``: margin = wide (a linear model over every key) + MLP(the row's per-field
    embeddings). ``deepfm``: margin = FM + MLP(the same embeddings, the FM's factors). The sparse
    parameters come as the batch-local rows of each table (wdl: ``[w (n,1), E (n,k)]``; deepfm:
    ``[[w | V] (n,1+k)]``), the MLP as one flat vector (:func:`hpcps_kernels.deep.mlp_layout`)."""

    def __init__(self, kind: str, k: int, fields: int, shift: int, hidden, activation: str, loss: int):
        self.kind, self.k, self.fields, self.shift, self.loss = kind, k, fields, shift, loss
        self.act = kdeep.ACTIVATIONS[activation]
        self.layers, self.size = kdeep.mlp_layout(fields * k, hidden)
        self.stages: dict[str, float] = {}  # seconds per stage (a training model shares its own)

    def _embeddings(self, params: list) -> np.ndarray:
        return params[1] if self.kind == "wdl" else params[0][:, 1:]

    def _pool(self, batch, pos, params) -> np.ndarray:
        x = np.empty((batch.rows, self.fields * self.k), dtype=np.float32)
        bad = kdeep.embed_pool(batch.indptr, pos, batch.indices, batch.values, self._embeddings(params),
                               self.shift, self.fields, BIAS_KEY, x)
        if bad >= 0:
            raise field_error(int(batch.indices[bad]) >> self.shift, self.fields)
        return x

    def _shallow(self, batch, pos, row_ids, params) -> tuple[np.ndarray, np.ndarray | None]:
        """The wide or FM part: (margins, FM partial sums or None)."""
        if self.kind == "wdl":
            m = np.empty(batch.rows, dtype=np.float64)
            kmodels.lr_partial_margins(pos, batch.values, row_ids, params[0][:, 0], m)
            return m, None
        p = params[0]
        partials = np.empty((batch.rows, self.k + 2), dtype=np.float64)
        kmodels.fm_partial_margins(pos, batch.values, row_ids, p[:, 0], p[:, 1:], partials)
        s = partials[:, 1:1 + self.k]
        return partials[:, 0] + 0.5 * (np.einsum("rk,rk->r", s, s) - partials[:, 1 + self.k]), partials

    def margins(self, batch, pos, params: list, mlp: np.ndarray) -> np.ndarray:
        row_ids = np.repeat(np.arange(batch.rows, dtype=np.int32), np.diff(batch.indptr))
        shallow, _ = self._shallow(batch, pos, row_ids, params)
        deep, _ = kdeep.mlp_forward(mlp, self.layers, self._pool(batch, pos, params), self.act)
        return shallow + deep

    def forward_backward(self, batch, pos, params: list, mlp: np.ndarray, grads: list, mlp_grad: np.ndarray,
                         scale: float, between=None) -> float:
        """The summed loss; the sparse gradients into ``grads`` (like ``params``) and the MLP's
        into ``mlp_grad``. ``between()`` is called once the MLP's gradient is complete and before
        the embeddings' gradients are scattered (the model starts its allreduce there)."""
        t = time.perf_counter()
        rows = batch.rows
        row_ids = np.repeat(np.arange(rows, dtype=np.int32), np.diff(batch.indptr))
        x = self._pool(batch, pos, params)
        shallow, partials = self._shallow(batch, pos, row_ids, params)
        t = tick(self.stages, "embed", t)
        with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is a NaN loss: the step reports it)
            deep, hs = kdeep.mlp_forward(mlp, self.layers, x, self.act)
            margins = shallow + deep
            dm = np.empty(rows, dtype=np.float64)
            loss = kmodels.lr_residuals(margins, batch.labels, scale, self.loss, dm, batch.weights) if rows else 0.0
            dx = kdeep.mlp_backward(mlp, self.layers, hs, dm.astype(np.float32), self.act, mlp_grad)
        t = tick(self.stages, "mlp", t)
        if between is not None:
            between()
        if self.kind == "wdl":
            kmodels.lr_residual_grads(pos, batch.values, row_ids, dm, grads[0][:, 0])
            grads[1][:, :] = 0.0
            kdeep.embed_scatter(batch.indptr, pos, batch.indices, batch.values, dx, self.shift, BIAS_KEY, grads[1])
        else:
            g, p = grads[0], params[0]
            residuals = np.empty((rows, 1 + self.k), dtype=np.float64)
            residuals[:, 0] = dm
            residuals[:, 1:] = partials[:, 1:1 + self.k]
            kmodels.fm_residual_grads(pos, batch.values, row_ids, p[:, 1:], residuals, g[:, 0], g[:, 1:])
            kdeep.embed_scatter(batch.indptr, pos, batch.indices, batch.values, dx, self.shift, BIAS_KEY, g[:, 1:])
        tick(self.stages, "embed", t)
        return loss


DENSE_LR, DENSE_LR_ROWS = 0.001, 1000  # the MLP's default rate for 1000 rows a step (Adam's usual default)


def dense_lr_for(cfg, layout) -> float:
    """``model.dense_lr``, or when it is 0 (the default): for Adam and AdaGrad, 0.001 per 1000 rows
    in each of the MLP's steps (``train.batch_size`` x the workers per group); for SGD, 0.001.

    The servers' MLP takes one step per group push, and a group of g workers pushes the sum of g
    batches' gradients. Adam and AdaGrad ignore a gradient's scale, so a group of g, like a g times
    larger batch, would move the MLP g times less per epoch: the rate grows with the rows a step
    (the linear scaling rule). A group of 2 with batches of 250 thus trains as one worker with
    batches of 500, as it does with a fixed rate. SGD's step already grows with the summed gradient.
    """
    m = cfg.model
    if m.dense_lr > 0:
        return m.dense_lr
    if m.dense_optimizer == "sgd":
        return DENSE_LR
    return DENSE_LR * cfg.train.batch_size * layout.workers / layout.worker_groups / DENSE_LR_ROWS


class DeepModel(Model):
    """Wide & Deep (``wdl``) and DeepFM (``deepfm``) on the parameter server (KunPeng style).

    Sparse tables on the servers, pulled and pushed by key with the server optimizer
    (``[optimizer]``): ``wide`` (dim 1) and ``emb`` (dim k) for wdl, ``fm`` (``[w | V]``, V the
    embeddings) for deepfm. The MLP is a dense table ``mlp`` on the servers (optimizer
    ``model.dense_optimizer``, Adam by default) with a replica in every worker: each step its
    gradient is allreduced inside the worker group (started as soon as it is known, overlapping
    the scatter of the embeddings' gradients) and the group's first rank pushes the sum before the
    step's clock; every ``model.dense_sync_steps`` steps the group's first rank pulls the MLP
    after the clock and broadcasts it to the group. With 1 under BSP every step sees every group's
    updates, as the sparse tables do. The model holds the replica (:attr:`mlp`); the step pipeline
    keeps it in step (:class:`hpcps.train.pipeline.DenseSync`).
    """

    compute_empty = True  # an empty batch still joins its group's allreduce
    times_compute = True  # embed and mlp, timed inside the net
    reads_keys = True     # a key's field is in its high bits

    def __init__(self, ctx, cfg, bias: float = 0.0, fields: int = 1, suffix: str = ""):
        m = cfg.model
        self.net = DeepNet(m.type, m.factors, fields, cfg.data.hash_bits, m.hidden, m.activation, LOSSES[m.loss])
        self.fields = fields
        self.key_bits = min(64, cfg.data.hash_bits + max(1, (fields - 1).bit_length()))
        super().__init__(ctx, cfg, bias, suffix)
        self.net.stages = self.stages  # the embed and mlp stages are timed inside the net
        init = kdeep.mlp_init(fields * m.factors, m.hidden, m.activation, m.seed)
        self.dense_lr = dense_lr_for(cfg, ctx.layout)
        self.dense = ctx.dense_table("mlp" + suffix, self.net.size, optimizer=m.dense_optimizer, params={"lr": self.dense_lr},
                                     initial=init)
        self.mlp = init  # the replica of the servers' MLP
        self.sync_every = m.dense_sync_steps

    @property
    def all_tables(self) -> list:
        return [*self.sparse, self.dense.sparse]

    @property
    def mlp_models(self) -> list:
        return [self]

    def declare_tables(self, ctx, cfg):
        m, o = cfg.model, cfg.optimizer
        common = dict(optimizer=o.name, params=o.params, seed=m.seed, key_bits=self.key_bits, features=cfg.features)
        if m.type == "wdl":
            return [ctx.sparse_table("wide" + self.suffix, dim=1, init="zeros", init_keys=self.bias_init_keys(1), **common),
                    ctx.sparse_table("emb" + self.suffix, dim=m.factors, init="normal", init_scale=m.init_scale,
                                     **common)]
        return [ctx.sparse_table("fm" + self.suffix, dim=1 + m.factors, init="normal", init_scale=m.init_scale,
                                 init_keys=self.bias_init_keys(1 + m.factors), **common)]

    def non_finite_tables(self, params: list) -> list[str]:
        return super().non_finite_tables(params) + ([self.dense.sparse.name] if not np.isfinite(self.mlp).all() else [])

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        mlp_grad = np.empty(self.net.size, dtype=np.float32)
        between = (lambda: dense_ready(self, mlp_grad)) if dense_ready is not None else None
        return self.net.forward_backward(batch, pos, params, self.mlp, grads, mlp_grad, scale, between)

    def margins_into(self, batch, pos, params, out):
        out[:] = self.net.margins(batch, pos, params, self.mlp)


# model.type -> the Model subclass that trains it, built as cls(ctx, cfg, bias, suffix), plus
# fields=<fields per row> for the models that read fields (config.FIELDED; the deep models are DeepModel)
MODELS: dict[str, type] = {"lr": LinearModel, "fm": FactorizationMachine, "ffm": FieldAwareFM}


def register_model(name: str, cls: type, replace: bool = False) -> type:
    """Train ``model.type = name`` with ``cls``, a :class:`Model` subclass (on every rank, before
    the configuration is read). Raises ValueError when the name is taken (unless ``replace``; a
    built-in model cannot be replaced) and TypeError when ``cls`` is not a Model."""
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise TypeError(f"register_model({name!r}, ...): expected a subclass of hpcps.Model, got {cls!r}")
    if name in BUILT_IN_MODELS or (name in MODELS and not replace):
        raise ValueError(f"model type {name!r} is already registered")
    MODELS[name] = cls
    add_choice("model", "type", name)
    return cls


def make_model(ctx, cfg, bias: float = 0.0, fields: int = 1, suffix: str = "") -> Model:
    """The configured model; ``bias``: the bias weight's initial value; ``fields``: fields per row
    (deep models, see :func:`resolve_fields`); ``suffix``: added to its tables' names."""
    if cfg.model.type in DEEP:
        return DeepModel(ctx, cfg, bias, fields, suffix)
    if cfg.model.type not in MODELS:
        raise ValueError(f"model.type = {cfg.model.type!r} is not registered on this rank; registered: "
                         f"{sorted([*MODELS, *DEEP])} (hpcps.register_model on every rank)")
    if cfg.model.type in FIELDED:
        return MODELS[cfg.model.type](ctx, cfg, bias, suffix, fields=fields)
    return MODELS[cfg.model.type](ctx, cfg, bias, suffix)


class Grid(Model):
    """Several models trained at once on the same batches (``hpcps tune``): member ``i`` is the
    model of ``cfgs[i]`` (its own optimizer and hyper-parameters) with its own tables, named with
    ``@i``, on the same servers. A step pulls the rows of every member's sparse tables for the
    batch's keys in one go, runs each member's kernels and pushes every gradient together, so each
    member trains exactly as it would alone, for one pass over the data. :attr:`member_loss` sums
    each member's loss; the loss the step returns is 0 (a member that diverges does not stop the
    others: see :mod:`hpcps.train.tune`).

    Members are all LR/FM or all read fields (FFM, W&D, DeepFM: the same fields per row). A deep member keeps
    its own MLP (``mlp@i``): its gradient allreduced in the group and pushed, its pulls when due,
    by the step pipeline (:attr:`mlp_models`: the members, in order)."""

    def __init__(self, ctx, cfgs: list, bias: float = 0.0, fields: int = 1):
        fielded = [c.model.type in FIELDED for c in cfgs]
        if any(fielded) and not all(fielded):
            raise ValueError("a grid's models are all lr/fm or all wdl/deepfm/ffm (these read each row's fields)")
        for c in cfgs:
            if c.model.compute != "workers":
                raise ValueError(f"a grid's models compute on the workers (got model.compute = {c.model.compute!r})")
        self.cfgs = list(cfgs)
        self.fields = fields
        super().__init__(ctx, cfgs[0], bias)
        self.member_loss = np.zeros(len(cfgs))
        self.deep = [m for m in self.members if isinstance(m, DeepModel)]
        self.reads_keys = any(m.reads_keys for m in self.members)
        if self.deep:
            self.compute_empty = self.times_compute = True  # each member's group collectives and stages
            for m in self.deep:
                m.stages = m.net.stages = self.stages

    @property
    def all_tables(self) -> list:
        return [t for m in self.members for t in m.all_tables]

    @property
    def mlp_models(self) -> list:
        return list(self.deep)

    def declare_tables(self, ctx, cfg):
        self.members = [make_model(ctx, c, self.bias, self.fields, suffix=f"@{i}") for i, c in enumerate(self.cfgs)]
        self.spans, tables = [], []
        for m in self.members:
            self.spans.append((len(tables), len(tables) + len(m.sparse)))
            tables += m.sparse
        return tables

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        for i, (m, (a, b)) in enumerate(zip(self.members, self.spans)):
            self.member_loss[i] += m.forward_backward(batch, pos, params[a:b], grads[a:b], scale, dense_ready)
        return 0.0  # (see the class's docstring)

    def member_margins(self, batch, pos, params) -> np.ndarray:
        """The margins of every member, ``(rows, members)``."""
        out = np.empty((batch.rows, len(self.members)), dtype=np.float64)
        col = np.empty(batch.rows, dtype=np.float64)
        for i, (m, (a, b)) in enumerate(zip(self.members, self.spans)):
            if batch.rows:
                m.margins_into(batch, pos, params[a:b], col)
            out[:, i] = col
        return out

    def margins(self, batch, pos, params) -> np.ndarray:
        return self.member_margins(batch, pos, params)[:, 0]


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


DEEP_TABLES = {"wdl": ("wide", "emb"), "deepfm": ("fm",)}


class Scorer:
    """Margins of batches from a model file (:class:`hpcps.train.model_file.ServingModel`), no
    servers: the same computation as training's."""

    def __init__(self, model):
        if model.kind not in ("lr", "fm", "ffm", *DEEP_TABLES):
            raise ValueError(f"a model of type {model.kind!r} (registered by its training script) cannot be served "
                             f"from its file: hpcps eval and predict serve lr, fm, ffm, wdl and deepfm models")
        self.model = model
        self.net = None
        cfg = model.config
        m, self.shift = cfg.get("model", {}), int(cfg.get("data", {}).get("hash_bits", 24))
        self.fields = int(model.attrs.get("fields", 1))
        self.k = (model.dim - 1) // self.fields  # (an ffm's row: a weight and a vector for each field)
        if model.kind in DEEP_TABLES:
            self.net = DeepNet(model.kind, int(m["factors"]), self.fields, self.shift, m["hidden"],
                               m.get("activation", "relu"), LOSSES[model.loss])
            self.mlp = model.dense("mlp", self.net.size)

    def margins(self, batch) -> np.ndarray:
        uniq, pos = kkeys.unique_keys(batch.indices)
        if self.model.kind == "ffm":
            return ffm_margins(batch, pos, self.model.pull(uniq), self.k, self.shift, self.fields)
        if self.net is None:
            return margins_from_params(self.model.kind, batch, pos, self.model.pull(uniq), self.model.loss)
        params = [self.model.tables[name].pull(uniq) for name in DEEP_TABLES[self.model.kind]]
        return self.net.margins(batch, pos, params, self.mlp) if batch.rows else np.zeros(0)
