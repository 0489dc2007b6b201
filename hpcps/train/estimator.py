"""scikit-learn estimators on the parameter server's tables, in one process.

:class:`SparseClassifier` (logistic loss) and :class:`SparseRegressor` (squared loss) train an LR or
an FM on a matrix (CSR, any SciPy sparse format, or dense) with the library's own parts: the
model's tables live in an in-process server (:class:`hpcps.ps.context.LocalContext`), updated by the
server optimizers (FTRL by default), and every step is :meth:`hpcps.train.pipeline.StepPipeline.step`, the
kernels of ``hpcps train``. A column ``j`` of the matrix is the key ``j``; every row also carries
the bias key, as in the training files.

    from hpcps import SparseClassifier
    clf = SparseClassifier(model="fm").fit(X_train, y_train)
    clf.predict_proba(X_test)[:, 1]

After ``fit`` the model is plain NumPy: ``coef_``, ``intercept_`` (and ``factors_`` for an FM);
the tables' rows with their optimizer state are kept too, so :meth:`partial_fit` continues where
training stopped (FTRL's and AdaGrad's accumulators included) and a pickled estimator resumes.
``sample_weight`` multiplies each row's loss and gradient (as VW's importance weights in ``hpcps
train``): a row of weight 2 counts as the row twice within its step. scikit-learn (>= 1.6) is
needed only here.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import _check_sample_weight, check_is_fitted, validate_data

from hpcps import config
from hpcps.ps.context import LocalContext
from hpcps.train.data import BIAS_KEY, Dataset
from hpcps.train.loading import BIAS_ROWS, bias_for
from hpcps.train.models import make_model, margins_from_params
from hpcps.train.pipeline import StepPipeline
from hpcps.train.predictor import matrix_rows
from hpcps.train.plan import auto_batch_size
from hpcps_kernels import optim


def _rows(X: sp.csr_matrix, y=None, bias_pos=None) -> Dataset:
    """``X`` as a Dataset whose every row ends with the bias: keys = column numbers (or, for
    prediction, positions into dense parameters with the bias at ``bias_pos``)."""
    if bias_pos is None:
        return matrix_rows(X, y)
    return matrix_rows(X, y, bias=bias_pos, key_dtype=np.int64)


class _SparseModel(BaseEstimator):
    """What the classifier and the regressor share: the configuration of the model, training
    on an in-process server, and the margins of new rows."""

    _loss = "logistic"

    def __init__(self, model: str = "lr", optimizer: str = "ftrl", learning_rate: float | None = None,
                 l1: float = 0.0, l2: float | None = None, factors: int = 8, init_scale: float = 0.01, epochs: int = 2,
                 batch_size: int = 0, random_state: int = 0):
        self.model = model
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.l1 = l1
        self.l2 = l2
        self.factors = factors
        self.init_scale = init_scale
        self.epochs = epochs
        self.batch_size = batch_size
        self.random_state = random_state

    # -- configuration ------------------------------------------------------------------------

    def _config(self, n_features: int) -> config.Config:
        """The equivalent ``hpcps train`` configuration (a bad parameter is a ValueError naming it)."""
        if self.model not in ("lr", "fm"):
            raise ValueError(f"model = {self.model!r}: expected 'lr' or 'fm'")
        if self.optimizer not in optim.REGISTRY:
            raise ValueError(f"optimizer = {self.optimizer!r}: expected one of {sorted(optim.REGISTRY)}")
        takes = optim.get(self.optimizer).params
        params = {}
        if self.learning_rate is not None:
            params["alpha" if "alpha" in takes else "lr"] = self.learning_rate
        for name in ("l1", "l2"):
            value = getattr(self, name)
            if value:
                if name not in takes:
                    raise ValueError(f"{name} = {value}: the {self.optimizer} optimizer has no {name} "
                                     f"(it takes {sorted(takes)})")
                params[name] = value
            elif value is not None and name in takes:  # an explicit 0 (None: hpcps train's default)
                params[name] = value
        seed = self.random_state if isinstance(self.random_state, (int, np.integer)) else 0
        raw = {"model": {"type": self.model, "loss": self._loss, "factors": self.factors,
                         "init_scale": self.init_scale, "seed": int(seed)},
               "optimizer": {"name": self.optimizer, **params},
               "data": {"hash_bits": max(1, int(n_features - 1).bit_length())},
               "train": {"epochs": self.epochs, "batch_size": self.batch_size, "progress": False}}
        try:
            return config.from_dict(raw)
        except config.ConfigError as e:  # name the estimator's parameter, not the config key
            names = {"optimizer.alpha": "learning_rate", "optimizer.lr": "learning_rate", "model.": "",
                     "optimizer.": "", "train.": ""}
            text = str(e)
            for key, param in names.items():
                text = text.replace(key, param)
            raise ValueError(text) from None

    # -- training ---------------------------------------------------------------------------

    def _train(self, X, labels: np.ndarray, epochs: int, weights: np.ndarray | None = None) -> None:
        """``epochs`` passes over ``X`` in batches of ``batch_size`` rows, continuing from the
        tables kept by an earlier call (``tables_``) if there are any; ``weights``: each row's
        (None: all 1)."""
        cfg = self._config(self.n_features_in_)
        tr = cfg.train
        ctx = LocalContext(staleness=0, num_shards=cfg.cluster.num_shards,
                           stall_warn_s=cfg.cluster.stall_warn_s, stall_timeout_s=cfg.cluster.stall_timeout_s)
        try:
            resumed = getattr(self, "tables_", None)
            bias = 0.0
            if not resumed:  # the bias that predicts the first labels' mean (model.bias_init = "auto")
                first = None if weights is None else weights[:BIAS_ROWS]
                mean = np.average(labels[:BIAS_ROWS].astype(np.float64), weights=first) \
                    if first is None or first.sum() > 0 else np.mean(labels[:BIAS_ROWS], dtype=np.float64)
                bias = bias_for(mean, self._loss)
            model = make_model(ctx, cfg, bias)
            if resumed:
                ctx.load_tables(resumed, self.clock_)
            data = _rows(X, labels)
            data.weights = weights
            size = tr.batch_size or auto_batch_size(data.rows, 1, cfg.model.type)
            batches = [data.batch(lo, lo + size) for lo in range(0, data.rows, size)] * epochs
            pipeline = StepPipeline(ctx, model)
            losses = [pipeline.step(batch, 1.0, batches[i + 1:i + 3]) for i, batch in enumerate(batches)]
            pipeline.finish()
            total = data.rows if weights is None else max(float(weights.sum(dtype=np.float64)), 1e-300)
            self.train_loss_ = float(np.sum(losses[-(len(batches) // epochs):]) / total)  # the last epoch's
            self.tables_ = ctx.tables_contents()
            self.clock_ = ctx.clock_value
            keys = np.append(np.arange(self.n_features_in_, dtype=np.uint64), BIAS_KEY)
            params = model.table.pull(keys)  # keys never seen: their initial rows
        finally:
            ctx.finalize()
        self.coef_ = params[:-1, 0].astype(np.float64)[None, :]
        self.intercept_ = np.array([float(params[-1, 0])])
        if self.model == "fm":
            self.factors_ = params[:-1, 1:].astype(np.float64)
        self._params = params  # the kernels' layout: one row per column, the bias's last

    # -- prediction -------------------------------------------------------------------------

    def _margins(self, X) -> np.ndarray:
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, accept_sparse="csr", dtype=np.float64, reset=False)
        data = _rows(sp.csr_matrix(X), bias_pos=self.n_features_in_)
        return margins_from_params(self.model, data, data.indices, self._params, self._loss)

    def _check(self, X, y, reset: bool, sample_weight=None):
        """(X as CSR, y, the rows' weights as float32 or None), validated; ``reset``: a first fit
        (learns ``n_features_in_``). Weights are finite and non-negative, one per row, not all 0."""
        X, y = validate_data(self, X, y, accept_sparse="csr", dtype=np.float64, reset=reset,
                             y_numeric=self._loss == "squared")
        if sample_weight is not None:
            sample_weight = _check_sample_weight(sample_weight, X, dtype=np.float64,
                                                 ensure_non_negative=True).astype(np.float32)
        return sp.csr_matrix(X), y, sample_weight

    def _forget(self) -> None:
        """A new fit starts from scratch: no tables kept from an earlier one."""
        for name in ("tables_", "clock_"):
            self.__dict__.pop(name, None)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        return tags


class SparseClassifier(ClassifierMixin, _SparseModel):
    """Binary classification by logistic loss: an LR (``model="lr"``) or an FM (``model="fm"``).

    Parameters (``hpcps train``'s keys in brackets):
        model: ``"lr"`` or ``"fm"`` [model.type].
        optimizer: the server optimizer, ``"ftrl"`` (default), ``"adagrad"``, ``"adam"``, ``"sgd"``
            [optimizer.name].
        learning_rate: FTRL's alpha or the others' lr; None = the optimizer's default.
        l1, l2: regularisation (l1: FTRL only) [optimizer.l1, optimizer.l2]; l2 None: hpcps train's
            default (10 for an FM classifier with FTRL, else 0).
        factors, init_scale: an FM's factors per feature and their initial std.
        epochs: passes over the data (2, as hpcps train); batch_size: rows per step (the gradient
            of a step is the sum over its rows, as ``train.gradient = "sum"``; 0, the default:
            automatic, as ``train.batch_size = 0``).
        random_state: the seed of the factors' initializer [model.seed].

    The bias starts at the log-odds of the first 4096 labels' base rate, as ``model.bias_init =
    "auto"`` does. More than two classes: wrap it, ``sklearn.multiclass.OneVsRestClassifier(SparseClassifier())``.
    """

    def fit(self, X, y, sample_weight=None):
        """Train from scratch; ``sample_weight``: each row's weight (None: all 1)."""
        self._forget()
        X, y, sample_weight = self._check(X, y, True, sample_weight)
        self.classes_ = self._classes(y)
        return self._fit_binary(X, y, self.epochs, sample_weight)

    def partial_fit(self, X, y, classes=None, sample_weight=None):
        """One pass over ``X`` (the first call needs ``classes``, as scikit-learn's SGDClassifier)."""
        first = not hasattr(self, "classes_")
        X, y, sample_weight = self._check(X, y, first, sample_weight)
        if first:
            if classes is None:
                raise ValueError("classes must be passed on the first call to partial_fit")
            self.classes_ = self._classes(np.asarray(classes))
        elif classes is not None and not np.array_equal(np.unique(classes), self.classes_):
            raise ValueError(f"classes={list(classes)} differs from the first call's {list(self.classes_)}")
        unknown = np.setdiff1d(np.unique(y), self.classes_)
        if unknown.size:
            raise ValueError(f"y holds labels not in classes: {list(unknown)}")
        return self._fit_binary(X, y, 1, sample_weight)

    def _classes(self, y) -> np.ndarray:
        check_classification_targets(y)
        classes = np.unique(y)
        if classes.shape[0] != 2:
            raise ValueError(f"Only binary classification is supported: SparseClassifier needs 2 classes, got "
                             f"{classes.shape[0]} class{'es' if classes.shape[0] != 1 else ''} "
                             f"({list(classes)[:5]}); for more, use "
                             f"sklearn.multiclass.OneVsRestClassifier(SparseClassifier())")
        return classes

    def _fit_binary(self, X, y, epochs: int, sample_weight=None):
        self._train(X, (y == self.classes_[1]).astype(np.float32), epochs, sample_weight)
        return self

    def decision_function(self, X) -> np.ndarray:
        """The margins (log-odds of ``classes_[1]``)."""
        return self._margins(X)

    def predict_proba(self, X) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-self._margins(X)))
        return np.column_stack([1.0 - p, p])

    def predict_log_proba(self, X) -> np.ndarray:
        m = self._margins(X)
        return np.column_stack([-np.logaddexp(0.0, m), -np.logaddexp(0.0, -m)])

    def predict(self, X) -> np.ndarray:
        margins = self._margins(X)
        return self.classes_[(margins > 0).astype(int)]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        return tags


class SparseRegressor(RegressorMixin, _SparseModel):
    """Regression by squared loss: an LR or an FM (the parameters are :class:`SparseClassifier`'s).
    The bias starts at the mean of the first labels, as ``model.bias_init = "auto"`` does."""

    _loss = "squared"

    def fit(self, X, y, sample_weight=None):
        """Train from scratch; ``sample_weight``: each row's weight (None: all 1)."""
        self._forget()
        X, y, sample_weight = self._check(X, y, True, sample_weight)
        self._train(X, y.astype(np.float32), self.epochs, sample_weight)
        return self

    def partial_fit(self, X, y, sample_weight=None):
        """One pass over ``X``, continuing from the last call."""
        X, y, sample_weight = self._check(X, y, not hasattr(self, "coef_"), sample_weight)
        self._train(X, y.astype(np.float32), 1, sample_weight)
        return self

    def predict(self, X) -> np.ndarray:
        return self._margins(X)
