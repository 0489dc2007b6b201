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
``rows[slots[i]]``. A slot listed twice is updated twice, in order (merge duplicates first with
:func:`hpcps_kernels.keys.segment_reduce`). Arithmetic is float64, stored as float32.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

STATE = {"sgd": 0, "adagrad": 1, "ftrl": 2, "adam": 3}  # state columns per value dimension


def width(name: str, dim: int) -> int:
    """Row length of a table of value dimension ``dim`` under optimizer ``name``."""
    if name not in STATE:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(STATE)}")
    return dim + STATE[name] * dim if name != "adam" else 3 * dim + 2


def state_init(name: str, dim: int, adagrad_init: float = 0.0) -> np.ndarray:
    """Initial values of a new row's state columns (``rows[s, dim:]``)."""
    state = np.zeros(width(name, dim) - dim, dtype=np.float32)
    if name == "adagrad":
        state[:] = adagrad_init
    elif name == "adam":
        state[2 * dim:] = 1.0  # beta1**0, beta2**0
    return state


@njit(cache=True)
def sgd(rows, slots, grads, lr, l2):
    dim = grads.shape[1]
    for i in range(slots.shape[0]):
        r = rows[slots[i]]
        for d in range(dim):
            w = np.float64(r[d])
            r[d] = w - lr * (grads[i, d] + l2 * w)


@njit(cache=True)
def adagrad(rows, slots, grads, lr, eps, l2):
    dim = grads.shape[1]
    for i in range(slots.shape[0]):
        r = rows[slots[i]]
        for d in range(dim):
            w = np.float64(r[d])
            g = grads[i, d] + l2 * w
            a = r[dim + d] + g * g
            r[dim + d] = a
            r[d] = w - lr * g / (math.sqrt(a) + eps)


@njit(cache=True)
def ftrl(rows, slots, grads, alpha, beta, l1, l2):
    dim = grads.shape[1]
    inv_alpha = 1.0 / alpha
    for i in range(slots.shape[0]):
        s = slots[i]
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
            rows[s, d] = -math.copysign(shrink, z) / ((beta + sqrt_new) * inv_alpha + l2) + 0.0


@njit(cache=True)
def adam(rows, slots, grads, lr, beta1, beta2, eps, l2):
    dim = grads.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
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
