"""hpcps: an MPI parameter server for huge sparse models.

    import hpcps
    ctx = hpcps.init(servers=1)          # collective; nothing happens at import

See :mod:`hpcps.ps.context`. Layers, each importing only those before it: ``hpcps_kernels`` (numba,
pure) → ``hpcps.ps.transport`` (the only MPI module) → ``hpcps.ps.server`` / ``hpcps.ps.client`` →
``hpcps.train`` → ``hpcps.cli``.
"""

__version__ = "0.1.0"

import os as _os

# One BLAS thread per process unless told otherwise: parallelism comes from the MPI ranks, and a
# multi-threaded BLAS in every rank of an oversubscribed node spins its threads against the other
# ranks (the deep models' MLP step was 80x slower with OpenBLAS's default threads on 2 cores).
# Effective when hpcps is imported before NumPy (the CLI and `python -m` entry points are).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")


def __getattr__(name):
    # the scikit-learn estimators, imported on first use (scikit-learn is an optional extra)
    if name in ("SparseClassifier", "SparseRegressor"):
        from hpcps.train import estimator

        return getattr(estimator, name)
    if name == "Model":  # the base class of a model of your own (see register_model)
        from hpcps.train.models import Model

        return Model
    if name == "Features":  # a table's admission and eviction (sparse_table(..., features=hpcps.Features(...)))
        from hpcps.ps.tables import Features

        return Features
    raise AttributeError(f"module 'hpcps' has no attribute {name!r}")


def init(*args, **kwargs):
    """See :func:`hpcps.ps.context.init`."""
    from hpcps.ps.context import init as _init

    return _init(*args, **kwargs)


def register_optimizer(name: str, params: dict, kernel, args=None, state_width=None, init_state=None,
                       ranges=None, replace: bool = False):
    """Register a server-side update rule under ``name`` (on every rank, identically, before
    declaring tables that use it). See :class:`hpcps_kernels.optim.Optimizer`:

        @numba.njit
        def signsgd(rows, slots, grads, lr):
            for i in range(slots.shape[0]):
                for d in range(grads.shape[1]):
                    rows[slots[i], d] -= lr * np.sign(grads[i, d])

        hpcps.register_optimizer("signsgd", {"lr": 0.01}, signsgd)
        w = ctx.sparse_table("w", optimizer="signsgd", params={"lr": 0.1})

    ``args``: the hyper-parameters passed to ``kernel`` after (rows, slots, grads), in order
    (default: all of ``params``, in their order). ``state_width(dim)``: state columns per row
    (default none); ``init_state(dim, params)``: a new row's state (default zeros); ``ranges``:
    name → (low, high, low_open, high_open) (default: >= 0). Tables compare the definition's
    fingerprint across ranks, so a rank that registered something else is an error.
    """
    from hpcps_kernels import optim

    opt = optim.Optimizer(name, dict(params), kernel, tuple(args if args is not None else params),
                          state_width or (lambda dim: 0), init_state, dict(ranges or {}))
    return optim.register(opt, replace=replace)


def register_server_function(name: str, fn, out_width: int, in_width: int = 0, per_key: bool = True,
                             replace: bool = False):
    """Register a request kind of your own, run on the servers (see
    :class:`hpcps.ps.tables.ServerFunction`); every rank registers it, then declares it with
    ``ctx.server_function(name)`` and calls it with ``table.call(handle, keys, args)``::

        def sq_norm(shard, keys, args):             # a reduction over a key set
            rows = np.empty((len(keys), shard.spec.dim), np.float32)
            shard.pull(keys, rows)
            return np.array([(rows.astype(np.float64) ** 2).sum()])

        hpcps.register_server_function("sq_norm", sq_norm, out_width=1, per_key=False)
    """
    from hpcps.ps.tables import register_server_function as _register

    return _register(name, fn, out_width, in_width, per_key, replace)


def register_model(name: str, cls, replace: bool = False):
    """Train ``model.type = name`` with ``cls``, a subclass of :class:`hpcps.Model` (on every rank,
    before the configuration is read). See :func:`hpcps.train.models.register_model` and
    docs/extending.md::

        class HingeModel(hpcps.Model):
            def declare_tables(self, ctx, cfg): ...             # its sparse tables
            def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None): ...
            def margins_into(self, batch, pos, params, out): ...

        hpcps.register_model("svm", HingeModel)                 # then [model] type = "svm"
    """
    from hpcps.train.models import register_model as _register

    return _register(name, cls, replace)


def register_format(name: str, parser, replace: bool = False):
    """Read ``data.format = name`` files with ``parser`` (on every rank, before the configuration
    is read); its signature and results are those of :func:`hpcps_kernels.parse.parse_libsvm`. See
    :func:`hpcps.train.data.register_format` and docs/extending.md."""
    from hpcps.train.data import register_format as _register

    return _register(name, parser, replace)


def load_model(path: str):
    """A model file (``train.model_out``, or ``hpcps export``'s) loaded for scoring in this
    process, no MPI: ``predict``, ``predict_proba`` and ``decision_function`` on a SciPy sparse
    matrix (columns: libsvm feature indices) or a data file's path. See
    :class:`hpcps.train.predictor.Predictor`::

        model = hpcps.load_model("model.h5")
        p = model.predict_proba("test.svm")[:, 1]
    """
    from hpcps.train.predictor import load_model as _load

    return _load(path)
