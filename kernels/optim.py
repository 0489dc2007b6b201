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
  correction needs (a multiply per update instead of two ``exp``, which cost 3x here).

Every rule takes ``slots`` (int64) and ``grads`` (float32, ``(n, dim)``); ``grads[i]`` updates
``rows[slots[i]]``; each rule prefetches the row of the key ``ahead_keys(width)`` keys on, since slots land
anywhere in a table far larger than the cache (2.5-2.9x faster on random slots here), every cache
line of it (a dim-64 FTRL row is twelve: 1.6-1.9x on 100 k random slots against fetching the first). A slot
listed twice is updated twice, in order (merge duplicates first with
:func:`hpcps_kernels.keys.segment_reduce`). Arithmetic is float64, stored as float32, except FTRL,
AdaGrad and Adam on rows of ``TWO_PASS_DIM`` values and wider, whose vectorised loops compute in float32.

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

from ._prefetch import NARROW, prefetch, prefetch_lines
from .parallel import TwoThreads, run_split

AHEAD = 16  # prefetch distance, in keys: a row's cache lines are fetched this many keys early
WIDE_AHEAD_BYTES = 4096  # ... or, for wide rows, this many bytes of rows early (at least 4 keys)


@njit(inline="always")
def ahead_keys(width):
    """The prefetch distance, in keys, for rows of ``width`` float32 values."""
    return AHEAD if width <= NARROW else max(4, min(AHEAD, WIDE_AHEAD_BYTES // (4 * width)))


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


# the built-in one-pass rules' codes in a push's fused lookup and update (Optimizer.fused)
FUSED_SGD, FUSED_ADAGRAD, FUSED_FTRL, FUSED_ADAM = 0, 1, 2, 3

# The one-pass rules update a row with a row function (``_<rule>_row(rows, s, grads, i, dim, ...)``:
# ``grads[i]`` into ``rows[s]``), inlined at numba's level into the rule's loop and into the fused
# lookup-and-update of a push (:func:`hpcps_kernels.directindex.direct_push`): one definition of
# each rule's arithmetic. Inlined, not called: in the fused push a call per row (a compiled
# function) ran at half the speed of the inlined row.

@njit(inline="always")
def _sgd_row(rows, s, grads, i, dim, lr, l2):
    for d in range(dim):
        w = np.float64(rows[s, d])
        rows[s, d] = w - lr * (grads[i, d] + l2 * w)


@njit(cache=True, nogil=True)  # (see hpcps_kernels.parallel)
def sgd(rows, slots, grads, lr, l2):
    dim = grads.shape[1]
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    ahead = ahead_keys(width)
    for i in range(n):
        if i + ahead < n:  # (written out in each rule: as an inline helper it ran at half speed)
            p = slots[i + ahead] * width
            prefetch_lines(flat, p, p + width)
        _sgd_row(rows, slots[i], grads, i, dim, lr, l2)


# From this row width up, FTRL, AdaGrad and Adam run their two-pass float32 loops (below), which
# vectorise: against the one-pass float64 loops, FTRL 1.7x at 8 (1.2x at 4), AdaGrad 2.4x at 8 and
# 2.6x at 64 (0.8x at 2), Adam 3.2x at 16, 2.3x at 64 and 4.3x at 1024.
TWO_PASS_DIM = 8


@njit(cache=True, nogil=True, error_model="numpy")  # no zero check on the division (eps > 0): the loop vectorises
def _adagrad_two_pass(rows, slots, grads, lr, eps, l2):
    """AdaGrad on wide rows: the new weights and accumulators into float32 scratch, then both
    stores, so the loops vectorise (see :func:`_ftrl_two_pass`): 2.5-2.7x the one-pass float64
    loop at dims 16-64, within 2 units in the last place."""
    dim = grads.shape[1]
    wt = np.empty(dim, dtype=np.float32)
    at = np.empty(dim, dtype=np.float32)
    lr, eps, l2 = np.float32(lr), np.float32(eps), np.float32(l2)
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    ahead = ahead_keys(width)
    for i in range(n):
        if i + ahead < n:  # (written out in each rule: as an inline helper it ran at half speed)
            p = slots[i + ahead] * width
            prefetch_lines(flat, p, p + width)
        r = rows[slots[i]]
        for d in range(dim):
            w = r[d]
            g = grads[i, d] + l2 * w
            a = r[dim + d] + g * g
            at[d] = a
            wt[d] = w - lr * g / (np.sqrt(a) + eps)
        for d in range(dim):
            r[d] = wt[d]
            r[dim + d] = at[d]


@njit(inline="always")
def _adagrad_row(rows, s, grads, i, dim, lr, eps, l2):
    for d in range(dim):
        w = np.float64(rows[s, d])
        g = grads[i, d] + l2 * w
        a = rows[s, dim + d] + g * g
        rows[s, dim + d] = a
        rows[s, d] = w - lr * g / (math.sqrt(a) + eps)


@njit(cache=True, nogil=True)  # (see hpcps_kernels.parallel)
def adagrad(rows, slots, grads, lr, eps, l2):
    dim = grads.shape[1]
    if dim >= TWO_PASS_DIM:
        _adagrad_two_pass(rows, slots, grads, lr, eps, l2)
        return
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    for i in range(n):
        if i + AHEAD < n:  # (written out in each rule: as an inline helper it ran at half speed)
            prefetch(flat, slots[i + AHEAD] * width)
        _adagrad_row(rows, slots[i], grads, i, dim, lr, eps, l2)


# The denominator of FTRL's weight is at least this: with beta = 0 (allowed) and l2 = 0, a new row
# whose gradients so far are all 0 has n = 0 and z = 0, and its weight is 0, not 0 / 0 (which
# raised ZeroDivisionError on the server, or, without the check, made a NaN).
FTRL_FLOOR = 1e-30


@njit(cache=True, nogil=True, error_model="numpy")  # no zero check on the division (it kept the loop scalar)
def _ftrl_two_pass(rows, slots, grads, inv_alpha, beta, l1, l2):
    """FTRL on wide rows in two passes per row: z, n and sqrt(n) into scratch, then the three
    stores. One pass reads and writes the row's three parts at once, which LLVM cannot prove
    apart and does not vectorise; split, the loops vectorise: 2x at dim 64 (244 against 125 M
    coordinates/s here). The arithmetic is float32, eight lanes to a vector instead of float64's
    four: 1.7-1.8x again at dims 16-64, within 2 units in the last place of the float64 rule
    (the state is stored as float32 either way)."""
    dim = grads.shape[1]
    zt = np.empty(dim, dtype=np.float32)
    nt = np.empty(dim, dtype=np.float32)
    st = np.empty(dim, dtype=np.float32)
    inv_alpha, beta, l1, l2 = np.float32(inv_alpha), np.float32(beta), np.float32(l1), np.float32(l2)
    zero, floor = np.float32(0.0), np.float32(FTRL_FLOOR)
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    ahead = ahead_keys(width)
    for i in range(n):
        if i + ahead < n:  # (written out in each rule: as an inline helper it ran at half speed)
            p = slots[i + ahead] * width
            prefetch_lines(flat, p, p + width)
        r = rows[slots[i]]
        for d in range(dim):
            g = grads[i, d]
            n_old = r[2 * dim + d]
            n_new = n_old + g * g
            sqrt_new = np.sqrt(n_new)
            zt[d] = r[dim + d] + g - (sqrt_new - np.sqrt(n_old)) * inv_alpha * r[d]
            nt[d] = n_new
            st[d] = sqrt_new
        for d in range(dim):
            z = zt[d]
            r[dim + d] = z
            r[2 * dim + d] = nt[d]
            shrink = max(abs(z) - l1, zero)
            r[d] = -math.copysign(shrink, z) / max((beta + st[d]) * inv_alpha + l2, floor) + zero


@njit(inline="always")
def _ftrl_row(rows, s, grads, i, dim, inv_alpha, beta, l1, l2):
    for d in range(dim):
        g = np.float64(grads[i, d])
        w = np.float64(rows[s, d])
        n_old = np.float64(rows[s, 2 * dim + d])
        n_new = n_old + g * g
        sqrt_new = math.sqrt(n_new)
        z = np.float64(rows[s, dim + d]) + g - (sqrt_new - math.sqrt(n_old)) * inv_alpha * w
        rows[s, dim + d] = z
        rows[s, 2 * dim + d] = n_new
        # w = 0 when |z| <= l1, written without a branch (it mispredicts on real data)
        shrink = max(abs(z) - l1, 0.0)
        rows[s, d] = -math.copysign(shrink, z) / max((beta + sqrt_new) * inv_alpha + l2, FTRL_FLOOR) + 0.0


@njit(cache=True, nogil=True)  # (see hpcps_kernels.parallel)
def ftrl(rows, slots, grads, alpha, beta, l1, l2):
    dim = grads.shape[1]
    inv_alpha = 1.0 / alpha
    if dim >= TWO_PASS_DIM:
        _ftrl_two_pass(rows, slots, grads, inv_alpha, beta, l1, l2)
        return
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    for i in range(n):
        if i + AHEAD < n:  # (written out in each rule: as an inline helper it ran at half speed)
            prefetch(flat, slots[i + AHEAD] * width)
        _ftrl_row(rows, slots[i], grads, i, dim, inv_alpha, beta, l1, l2)


@njit(cache=True, nogil=True, error_model="numpy")  # no zero check on the divisions (eps > 0): the loops vectorise
def _adam_two_pass(rows, slots, grads, lr, beta1, beta2, eps, l2):
    """Adam on wide rows (embeddings, and the dense tables' 1024-value chunks: an MLP's weights):
    the new weights and moments into float32 scratch, then the stores, so the loops vectorise
    (see :func:`_ftrl_two_pass`); within a few units in the last place of the float64 loop. The
    constants 1 - beta are taken in float64 first: float32's 1 - 0.999 is 1.3e-5 off."""
    dim = grads.shape[1]
    wt = np.empty(dim, dtype=np.float32)
    mt = np.empty(dim, dtype=np.float32)
    vt = np.empty(dim, dtype=np.float32)
    omb1, omb2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    lr, beta1, beta2, eps, l2 = np.float32(lr), np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(l2)
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    ahead = ahead_keys(width)
    for i in range(n):
        if i + ahead < n:  # (written out in each rule: as an inline helper it ran at half speed)
            p = slots[i + ahead] * width
            prefetch_lines(flat, p, p + width)
        r = rows[slots[i]]
        p1 = r[3 * dim] * beta1
        p2 = r[3 * dim + 1] * beta2
        r[3 * dim] = p1
        r[3 * dim + 1] = p2
        c1 = np.float32(1.0 - np.float64(p1))
        c2 = np.float32(1.0 - np.float64(p2))
        for d in range(dim):
            w = r[d]
            g = grads[i, d] + l2 * w
            m = beta1 * r[dim + d] + omb1 * g
            v = beta2 * r[2 * dim + d] + omb2 * g * g
            mt[d] = m
            vt[d] = v
            wt[d] = w - lr * (m / c1) / (np.sqrt(v / c2) + eps)
        for d in range(dim):
            r[d] = wt[d]
            r[dim + d] = mt[d]
            r[2 * dim + d] = vt[d]


@njit(inline="always")
def _adam_row(rows, s, grads, i, dim, lr, beta1, beta2, eps, l2):
    p1 = rows[s, 3 * dim] * beta1       # beta1**t, kept as a running product: no pow/exp
    p2 = rows[s, 3 * dim + 1] * beta2
    rows[s, 3 * dim] = p1
    rows[s, 3 * dim + 1] = p2
    c1 = 1.0 - np.float64(p1)
    c2 = 1.0 - np.float64(p2)
    for d in range(dim):
        w = np.float64(rows[s, d])
        g = grads[i, d] + l2 * w
        m = beta1 * rows[s, dim + d] + (1.0 - beta1) * g
        v = beta2 * rows[s, 2 * dim + d] + (1.0 - beta2) * g * g
        rows[s, dim + d] = m
        rows[s, 2 * dim + d] = v
        rows[s, d] = w - lr * (m / c1) / (math.sqrt(v / c2) + eps)


@njit(cache=True, nogil=True)  # (see hpcps_kernels.parallel)
def adam(rows, slots, grads, lr, beta1, beta2, eps, l2):
    dim = grads.shape[1]
    if dim >= TWO_PASS_DIM:
        _adam_two_pass(rows, slots, grads, lr, beta1, beta2, eps, l2)
        return
    flat, width, n = rows.reshape(-1), rows.shape[1], slots.shape[0]
    for i in range(n):
        if i + AHEAD < n:  # (written out in each rule: as an inline helper it ran at half speed)
            prefetch(flat, slots[i + AHEAD] * width)
        _adam_row(rows, slots[i], grads, i, dim, lr, beta1, beta2, eps, l2)


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
        """The code under which :func:`hpcps_kernels.directindex.direct_push` applies this rule to
        rows of ``dim`` values with the same bits as :attr:`kernel`, or -1: a rule registered from
        user code, or a row wide enough for the two-pass loops."""
        return self.fused if dim < TWO_PASS_DIM else -1

    def fused_params(self, params: dict) -> np.ndarray:
        """The hyper-parameters :func:`~hpcps_kernels.directindex.direct_push` takes: the kernel's
        arguments in order, as float64 (as the kernel receives them)."""
        return np.array([float(params[a]) for a in self.args], dtype=np.float64)

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
        args = [params[a] for a in self.args]
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
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = getattr(fn, "__qualname__", repr(fn))
        facts = (self.name, sorted(self.params.items()), self.args, sorted(self.ranges.items()),
                 [self.state_width(d) for d in (1, 2, 8)],
                 [self.new_state(d, self.params).tolist() for d in (1, 2)], source)
        return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


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


register(Optimizer("sgd", {"lr": 0.01, "l2": 0.0}, sgd, ("lr", "l2"), ranges={"lr": POSITIVE}, fused=FUSED_SGD))
register(Optimizer("adagrad", {"lr": 0.01, "eps": 1e-8, "l2": 0.0, "initial_accumulator": 0.1}, adagrad,
                   ("lr", "eps", "l2"), lambda dim: dim, _adagrad_state, {"lr": POSITIVE, "eps": POSITIVE},
                   fused=FUSED_ADAGRAD))
register(Optimizer("ftrl", {"alpha": 0.1, "beta": 1.0, "l1": 0.0, "l2": 0.0}, ftrl, ("alpha", "beta", "l1", "l2"),
                   lambda dim: 2 * dim, ranges={"alpha": POSITIVE}, fused=FUSED_FTRL))
register(Optimizer("adam", {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "l2": 0.0}, adam,
                   ("lr", "beta1", "beta2", "eps", "l2"), lambda dim: 2 * dim + 2, _adam_state,
                   {"lr": POSITIVE, "eps": POSITIVE, "beta1": UNIT, "beta2": UNIT}, fused=FUSED_ADAM))
