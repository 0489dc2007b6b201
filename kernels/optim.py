"""Server update rules, in place on a table's slot rows.

A table keeps one float32 row per slot holding the parameters and the optimizer's state side by
side, ``rows[s] = [w (dim) | state ...]``, so an update of a key touches one cache line rather
than one per array (the tables are far larger than the cache: that is what bounds these kernels).
``width(name, dim)`` gives the row length; ``rows[:, :dim]`` are the parameters (what a pull
returns). Layouts:

* ``sgd``: ``[w]`` — ``w -= lr * (g + l2 * w)``.
* ``adagrad`` (Duchi et al. 2011): ``[w | acc]`` — ``acc += g**2; w -= lr * g / (sqrt(acc) + eps)``.
* ``ftrl`` (FTRL-Proximal, McMahan et al. 2013, Algorithm 1): ``[w | z | n]``, per coordinate
  ``sigma = (sqrt(n + g**2) - sqrt(n)) / alpha; z += g - sigma * w; n += g**2;``
  ``w = 0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``.
* ``adam`` (Kingma & Ba 2015), lazy: ``[w | m | v | beta1**t | beta2**t]`` — only the updated
  rows move, each with its own step count ``t``, kept as the two running powers that the bias
  correction needs (a multiply per update instead of two ``exp``).

Each rule is defined once, as the update of one row (``<rule>_update``, with its constants and its
state width beside it); :func:`rule_kernel` makes its kernel from that definition, and the fused
lookup and update of a push inlines the same update. Every kernel takes ``slots`` (int64) and
``grads`` (float32, ``(n, dim)``); ``grads[i]`` updates ``rows[slots[i]]``, prefetching every
cache line of the row ``ahead_keys(width)`` keys on. A slot listed twice is updated twice, in order
(merge duplicates first with :func:`hpcps_kernels.keys.segment_reduce`). Arithmetic is float64,
stored as float32, except FTRL, AdaGrad and Adam on rows of ``TWO_PASS_DIM`` values and wider,
whose vectorised loops compute in float32.

**The registry.** Everything about an optimizer is one :class:`Optimizer` in :data:`REGISTRY`: its
hyper-parameters with defaults and allowed ranges, its state width, how a new row's state starts,
and its kernel with the order of its arguments. Tables, the configuration, the servers, the CLI and
the profiler all read it from there. :func:`register` adds one from user code (an update rule is
one kind of server function); every rank must register the same definition, which
:meth:`Optimizer.fingerprint` (part of a table's fingerprint) checks.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba import njit
from numba import types
from numba.extending import overload, register_jitable

from ._prefetch import prefetch_lines
from .parallel import TwoThreads, run_split, worth_splitting
from .tuning import NARROW_VALUES, PREFETCH_KEYS, WIDE_PREFETCH_BYTES



@njit(inline="always")
def ahead_keys(width):
    """The prefetch distance, in keys, for rows of ``width`` float32 values."""
    if width <= NARROW_VALUES:
        return PREFETCH_KEYS
    return max(4, min(PREFETCH_KEYS, WIDE_PREFETCH_BYTES // (4 * width)))


def width(name: str, dim: int) -> int:
    """Row length of a table of value dimension ``dim`` under optimizer ``name``."""
    return get(name).width(dim)


def state_init(name: str, dim: int, adagrad_init: float | None = None) -> np.ndarray:
    """Initial values of a new row's state columns (``rows[s, dim:]``), with the optimizer's
    default hyper-parameters (``adagrad_init``: AdaGrad's initial accumulator instead)."""
    opt = get(name)
    params = dict(opt.params)
    if adagrad_init is not None and "initial_accumulator" in params:
        params["initial_accumulator"] = adagrad_init
    return opt.new_state(dim, params)


# From this row width up, the rules with a float32 loop (FTRL, AdaGrad, Adam) run it: eight lanes
# to a vector instead of float64's four, and vectorised at all only because each row is updated
# in two passes (see rule_kernel). Below it, rows are too short for vectors to pay.
TWO_PASS_DIM = 8
ROW_PARTS = 4  # a rule's row has at most this many parts: its runs of dim values, then its extra values

# the built-in one-pass rules' codes in a push's fused lookup and update (Optimizer.fused,
# hpcps_kernels.fused.PUSH)
FUSED_SGD, FUSED_ADAGRAD, FUSED_FTRL, FUSED_ADAM = 0, 1, 2, 3


# -- the update rules, one definition each ----------------------------------------------------------
#
# A rule is two functions:
# * ``<rule>_constants(ft, hp)``: its hyper-parameters (a tuple in its kernel's argument order) as
#   its update takes them, in the float type ``ft`` it computes in (np.float64 or np.float32);
# * ``<rule>_update(rows, s, grads, i, out, dim, ft, c)``: the new parameters and state of row
#   ``rows[s]`` (``[w (dim) | state]``) under the gradient ``grads[i]``, each value written with
#   :func:`store`: into the row itself when ``out`` is None, else into scratch (see rule_kernel);
# and ``<RULE>_ROW``, the shape of its row: ``(runs, extra)``, ``runs`` runs of ``dim`` values
# (the first the parameters ``w``) and ``extra`` values after them.
# :func:`rule_kernel` makes the rule's kernel from them, and the fused lookup and update of a push
# (:func:`hpcps_kernels.fused.push_kernel`) inlines the same updates: a fix lands once.
# They are register_jitable functions, which numba inlines where they are called, and not njit
# dispatchers: numba's disk cache keys a closure by its pickled cells, and a pickled dispatcher
# carries an id of its process, so a kernel closing over one would compile again in every process.
# An update takes the table and the gradients, not views of a row, and no array to write in place:
# each array an inlined call takes may cost a reference count increment and decrement per call,
# which numba does not remove in a loop that can raise.

def store(rows, out, s, part, dim, d, value):
    """Write ``value`` as value ``d`` of run ``part`` of updated row ``s`` (a row is runs of
    ``dim`` values, ``[w | state]``): into ``rows[s, part * dim + d]`` when ``out`` is None (an
    update in place), into ``out[part][d]`` when ``out`` is scratch, one array per run."""


@overload(store, inline="always")
def _store_impl(rows, out, s, part, dim, d, value):
    if isinstance(out, types.NoneType):
        def store_in_row(rows, out, s, part, dim, d, value):
            rows[s, part * dim + d] = value
        return store_in_row

    def store_in_scratch(rows, out, s, part, dim, d, value):
        out[part][d] = value
    return store_in_scratch


SGD_ROW = (1, 0)  # [w]


@register_jitable(inline="always")
def sgd_constants(ft, hp):
    lr, l2 = hp
    return ft(lr), ft(l2)


@register_jitable(inline="always")
def sgd_update(rows, s, grads, i, out, dim, ft, c):
    lr, l2 = c
    for d in range(dim):
        w = ft(rows[s, d])
        store(rows, out, s, 0, dim, d, w - lr * (grads[i, d] + l2 * w))


ADAGRAD_ROW = (2, 0)  # [w | acc]


@register_jitable(inline="always")
def adagrad_constants(ft, hp):
    lr, eps, l2 = hp
    return ft(lr), ft(eps), ft(l2)


@register_jitable(inline="always")
def adagrad_update(rows, s, grads, i, out, dim, ft, c):
    lr, eps, l2 = c
    for d in range(dim):
        w = ft(rows[s, d])
        g = grads[i, d] + l2 * w
        a = rows[s, dim + d] + g * g
        store(rows, out, s, 1, dim, d, a)
        store(rows, out, s, 0, dim, d, w - lr * g / (np.sqrt(a) + eps))


# The denominator of FTRL's weight is at least this: with beta = 0 (allowed) and l2 = 0, a new row
# whose gradients so far are all 0 has n = 0 and z = 0, and its weight is 0, not 0 / 0 (which
# raised ZeroDivisionError on the server, or, without the check, made a NaN).
FTRL_FLOOR = 1e-30


FTRL_ROW = (3, 0)  # [w | z | n]


@register_jitable(inline="always")
def ftrl_constants(ft, hp):
    alpha, beta, l1, l2 = hp
    return ft(1.0 / alpha), ft(beta), ft(l1), ft(l2)


@register_jitable(inline="always")
def ftrl_update(rows, s, grads, i, out, dim, ft, c):
    inv_alpha, beta, l1, l2 = c
    zero, floor = ft(0.0), ft(FTRL_FLOOR)
    for d in range(dim):
        g = ft(grads[i, d])
        w = ft(rows[s, d])
        n_old = ft(rows[s, 2 * dim + d])
        n_new = n_old + g * g
        sqrt_new = np.sqrt(n_new)
        z = ft(rows[s, dim + d]) + g - (sqrt_new - np.sqrt(n_old)) * inv_alpha * w
        store(rows, out, s, 1, dim, d, z)
        store(rows, out, s, 2, dim, d, n_new)
        # w = 0 when |z| <= l1, written without a branch (it mispredicts on real data)
        shrink = max(abs(z) - l1, zero)
        w_new = -math.copysign(shrink, z) / max((beta + sqrt_new) * inv_alpha + l2, floor) + zero
        store(rows, out, s, 0, dim, d, w_new)


ADAM_ROW = (3, 2)  # [w | m | v | beta1**t beta2**t]


@register_jitable(inline="always")
def adam_constants(ft, hp):
    """Also 1 - beta1 and 1 - beta2, taken in float64 first: float32's 1 - 0.999 is 1.3e-5 off."""
    lr, beta1, beta2, eps, l2 = hp
    return ft(lr), ft(beta1), ft(beta2), ft(1.0 - beta1), ft(1.0 - beta2), ft(eps), ft(l2)


@register_jitable(inline="always")
def adam_update(rows, s, grads, i, out, dim, ft, c):
    lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2 = c
    p1 = rows[s, 3 * dim] * beta1  # beta1**t, kept as a running product: no pow/exp
    p2 = rows[s, 3 * dim + 1] * beta2
    store(rows, out, s, 3, dim, 0, p1)
    store(rows, out, s, 3, dim, 1, p2)
    c1 = ft(1.0 - np.float64(p1))
    c2 = ft(1.0 - np.float64(p2))
    for d in range(dim):
        w = ft(rows[s, d])
        g = grads[i, d] + l2 * w
        m = beta1 * rows[s, dim + d] + one_minus_beta1 * g
        v = beta2 * rows[s, 2 * dim + d] + one_minus_beta2 * g * g
        store(rows, out, s, 1, dim, d, m)
        store(rows, out, s, 2, dim, d, v)
        store(rows, out, s, 0, dim, d, w - lr * (m / c1) / (np.sqrt(v / c2) + eps))


def state_width(row: tuple[int, int]) -> Callable[[int], int]:
    """The state columns of a row of shape ``row`` (``(runs, extra)``, see above), as a function of
    ``dim``: what :class:`Optimizer` takes."""
    runs, extra = row
    return lambda dim: (runs - 1) * dim + extra


def rule_kernel(name: str, constants, update, row: tuple[int, int], float32_rows: bool = True):
    """The kernel ``name(rows, slots, grads, *hp)`` of the update rule defined by ``constants``,
    ``update`` (register_jitable functions) and ``row`` (its row's shape), see above:
    ``rows[slots[i]]`` updated with ``grads[i]``, in order, ``hp`` being the rule's
    hyper-parameters.

    Rows of fewer than ``TWO_PASS_DIM`` values, or any row when not ``float32_rows``, are updated
    in one pass, in float64, in place. Wider rows are updated in float32 in two passes: the new
    values into scratch, one array per run of the row, then copied into the row, every run in one
    loop. Writing the row's runs in one loop (or runs of one scratch array), LLVM cannot prove them
    apart and leaves the loop scalar; split, both loops vectorise. Either way the row
    ``ahead_keys(width)`` keys on is prefetched, every cache line of it, as slots land anywhere in
    a table far larger than the cache.

    Compiled without numba's zero check on divisions (numpy's error model), which kept the loops
    scalar: every rule's denominators are positive for hyper-parameters in their ranges."""
    runs, extra = row
    if not 1 <= runs <= ROW_PARTS - (extra > 0) or not 0 <= extra <= TWO_PASS_DIM:
        raise ValueError(f"update rule {name!r}: a row of {runs} runs and {extra} more values does not fit")

    def kernel(rows, slots, grads, *hp):
        dim = grads.shape[1]
        flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
        ahead = ahead_keys(width)
        if float32_rows and dim >= TWO_PASS_DIM:
            c32 = constants(np.float32, hp)
            o0, o1, o2, o3 = out = (np.empty(dim, np.float32), np.empty(dim, np.float32),
                                    np.empty(dim, np.float32), np.empty(dim, np.float32))
            for i in range(n):
                if i + ahead < n:
                    p = slots[i + ahead] * width
                    prefetch_lines(flat, p, p + width)
                s = slots[i]
                update(rows, s, grads, i, out, dim, np.float32, c32)
                for d in range(dim):
                    rows[s, d] = o0[d]
                    if runs > 1:
                        rows[s, dim + d] = o1[d]
                    if runs > 2:
                        rows[s, 2 * dim + d] = o2[d]
                    if runs > 3:
                        rows[s, 3 * dim + d] = o3[d]
                for d in range(extra):
                    rows[s, runs * dim + d] = out[runs][d]
            return
        c64 = constants(np.float64, hp)
        for i in range(n):
            if i + ahead < n:
                p = slots[i + ahead] * width
                prefetch_lines(flat, p, p + width)
            update(rows, slots[i], grads, i, None, dim, np.float64, c64)

    kernel.__name__ = kernel.__qualname__ = name
    return njit(cache=True, nogil=True, error_model="numpy")(kernel)  # (nogil: see hpcps_kernels.parallel)


sgd = rule_kernel("sgd", sgd_constants, sgd_update, SGD_ROW, float32_rows=False)
adagrad = rule_kernel("adagrad", adagrad_constants, adagrad_update, ADAGRAD_ROW)
ftrl = rule_kernel("ftrl", ftrl_constants, ftrl_update, FTRL_ROW)
adam = rule_kernel("adam", adam_constants, adam_update, ADAM_ROW)


# -- the registry --------------------------------------------------------------------------------

POSITIVE = (0.0, float("inf"), True, False)   # (low, high, low open, high open)
NON_NEGATIVE = (0.0, float("inf"), False, False)
UNIT = (0.0, 1.0, False, True)  # [0, 1)


@dataclass(frozen=True)
class Optimizer:
    """A server-side update rule.

    ``kernel(rows, slots, grads, *[params[a] for a in args])`` updates ``rows[slots[i]]`` with
    ``grads[i]`` in place (a numba function, or any callable taking NumPy arrays); a row is
    ``[w (dim) | state (state_width(dim))]``. ``params``: hyper-parameter name → default;
    ``ranges``: name → (low, high, low open, high open), a name not listed is ">= 0".
    ``init_state(dim, params)``: a new row's state columns (None: zeros).
    """

    name: str
    params: dict
    kernel: Callable
    args: tuple
    state_width: Callable[[int], int] = lambda dim: 0
    init_state: Callable[[int, dict], np.ndarray] | None = None
    ranges: dict = field(default_factory=dict)
    fused: int = -1  # a built-in one-pass rule's code (FUSED_*) for a push's fused lookup and update

    def fused_rule(self, dim: int) -> int:
        """The code under which :data:`hpcps_kernels.fused.PUSH` applies this rule to rows of
        ``dim`` values with the same bits as :attr:`kernel`, or -1: a rule registered from user
        code, or a row wide enough for the two-pass loops."""
        return self.fused if dim < TWO_PASS_DIM else -1

    def fused_params(self, params: dict) -> tuple:
        """The hyper-parameters :data:`hpcps_kernels.fused.PUSH`'s kernels take: the rule kernel's
        arguments in order, as floats (float64, as the kernel computes with them)."""
        return tuple(float(params[a]) for a in self.args)

    def width(self, dim: int) -> int:
        return dim + self.state_width(dim)

    def new_state(self, dim: int, params: dict) -> np.ndarray:
        """A new row's state columns (float32, ``state_width(dim)``)."""
        n = self.state_width(dim)
        if self.init_state is None:
            return np.zeros(n, dtype=np.float32)
        state = np.asarray(self.init_state(dim, params), dtype=np.float32).reshape(-1)
        if state.shape[0] != n:
            raise ValueError(f"optimizer {self.name!r}: init_state gave {state.shape[0]} values, state width is {n}")
        return state

    def apply(self, rows, slots, grads, params: dict, threads: TwoThreads | None = None) -> None:
        """Update ``rows[slots[i]]`` with ``grads[i]``; with ``threads``, a large push's two halves at
        once (the slots are distinct and a rule updates each row from its own gradient only)."""
        self.run(rows, slots, grads, self.kernel_args(params), threads)

    def kernel_args(self, params: dict) -> tuple:
        """The hyper-parameters :attr:`kernel` takes after its arrays, in order (for :meth:`run`)."""
        return tuple(params[a] for a in self.args)

    def run(self, rows, slots, grads, args: tuple, threads: TwoThreads | None = None) -> None:
        """:meth:`apply` with the kernel's hyper-parameters given (:meth:`kernel_args`): a
        server's push, which has them at hand."""
        if not worth_splitting(threads, slots.shape[0], grads.shape[1]):  # (most pushes: no closure)
            self.kernel(rows, slots, grads, *args)
            return
        run_split(threads, slots.shape[0], lambda lo, hi: self.kernel(rows, slots[lo:hi], grads[lo:hi], *args),
                  grads.shape[1])

    def range_error(self, key: str, value: float) -> str | None:
        """Why ``value`` is not allowed for hyper-parameter ``key`` (None if it is)."""
        lo, hi, lo_open, hi_open = self.ranges.get(key, NON_NEGATIVE)
        if value != value or value in (float("inf"), float("-inf")):
            return f"must be a finite number (got {value})"
        if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
            if hi == float("inf"):
                return f"must be {'greater than' if lo_open else 'at least'} {lo:g} (got {value:g})"
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            return f"must be in {left}{lo:g}, {hi:g}{right} (got {value:g})"
        return None

    def fingerprint(self) -> str:
        """What must be identical on every rank: name, parameters, ranges, state widths, the
        initial state and the kernel's source."""
        fn = getattr(self.kernel, "py_func", self.kernel)
        # a kernel made by rule_kernel: its loop's source and those of the rule it closes over
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
        source = "".join(_source(f) for f in [fn] + [c for c in cells if inspect.isfunction(c)])
        facts = (self.name, sorted(self.params.items()), self.args, sorted(self.ranges.items()),
                 [self.state_width(d) for d in (1, 2, 8)],
                 [self.new_state(d, self.params).tolist() for d in (1, 2)], source)
        return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


REGISTRY: dict[str, Optimizer] = {}


def register(opt: Optimizer, replace: bool = False) -> Optimizer:
    """Add an update rule to the registry (on every rank, identically). Raises ValueError if the
    name is taken (unless ``replace``) or a default is out of its own range."""
    if opt.name in REGISTRY and not replace:
        raise ValueError(f"optimizer {opt.name!r} is already registered")
    missing = [a for a in opt.args if a not in opt.params]
    if missing:
        raise ValueError(f"optimizer {opt.name!r}: kernel arguments {missing} are not among its params")
    for key, value in opt.params.items():
        why = opt.range_error(key, float(value))
        if why:
            raise ValueError(f"optimizer {opt.name!r}: default {key} {why}")
    REGISTRY[opt.name] = opt
    return opt


def get(name: str) -> Optimizer:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(REGISTRY)}") from None


def _adagrad_state(dim: int, params: dict) -> np.ndarray:
    return np.full(dim, params["initial_accumulator"], dtype=np.float32)


def _adam_state(dim: int, params: dict) -> np.ndarray:
    state = np.zeros(2 * dim + 2, dtype=np.float32)
    state[2 * dim:] = 1.0  # beta1**0, beta2**0
    return state


register(Optimizer("sgd", {"lr": 0.01, "l2": 0.0}, sgd, ("lr", "l2"), state_width(SGD_ROW),
                   ranges={"lr": POSITIVE}, fused=FUSED_SGD))
register(Optimizer("adagrad", {"lr": 0.01, "eps": 1e-8, "l2": 0.0, "initial_accumulator": 0.1}, adagrad,
                   ("lr", "eps", "l2"), state_width(ADAGRAD_ROW), _adagrad_state, {"lr": POSITIVE, "eps": POSITIVE},
                   fused=FUSED_ADAGRAD))
register(Optimizer("ftrl", {"alpha": 0.1, "beta": 1.0, "l1": 0.0, "l2": 0.0}, ftrl, ("alpha", "beta", "l1", "l2"),
                   state_width(FTRL_ROW), ranges={"alpha": POSITIVE}, fused=FUSED_FTRL))
register(Optimizer("adam", {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "l2": 0.0}, adam,
                   ("lr", "beta1", "beta2", "eps", "l2"), state_width(ADAM_ROW), _adam_state,
                   {"lr": POSITIVE, "eps": POSITIVE, "beta1": UNIT, "beta2": UNIT}, fused=FUSED_ADAM))
