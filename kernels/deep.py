"""Kernels of the deep CTR models (Wide & Deep, DeepFM): per-field embeddings and an MLP.

**Fields.** A key carries its field in the bits above the key space: ``field = key >> shift``
(``shift`` = the data's hash bits; 64: every key is field 0, one field per row). One key,
``skip_key`` (the bias feature), belongs to no field.

**Embedding pooling** (:func:`embed_pool`): a row's input to the MLP is ``fields`` blocks of ``k``,
block ``f`` = the sum over the row's nonzeros of field ``f`` of ``value * E[key]`` (one-hot fields,
as Criteo's, give each field's embedding; multi-hot fields a weighted bag; a missing field
zeros). ``E`` holds the batch-local rows pulled for the batch's unique keys (``pos`` maps each
nonzero to its row, as in :mod:`hpcps_kernels.models`). :func:`embed_scatter` is its transpose:
it adds the gradient of each block back into the rows of ``E``'s gradient.

**The MLP** (:func:`mlp_forward`, :func:`mlp_backward`): ``fields * k`` inputs, hidden layers with
an activation (ReLU or tanh), one linear output (the deep part's margin). Its parameters are one
flat float32 vector (:func:`mlp_layout`: per layer ``W (in x out)`` row-major, then ``b``), the
form in which they live in a dense table on the servers. Matrix products go to BLAS through
NumPy (a numba loop is several times slower at these sizes); the bias add with activation, its
derivative and the bias gradients are numba kernels, fused into one pass each.
"""

from __future__ import annotations

import numpy as np
from numba import njit

RELU = 0
TANH = 1
ACTIVATIONS = {"relu": RELU, "tanh": TANH}


@njit(inline="always")
def _field(key, sh, shift):
    return np.int64(key >> sh) if shift < 64 else 0


@njit(cache=True)
def embed_pool(indptr, pos, keys, vals, E, shift, fields, skip_key, out):
    """Pool each row's nonzeros into ``out[r, f*k:(f+1)*k]`` (zeroed here) by field. Returns -1,
    or the index of the first nonzero whose field is ``>= fields`` (nothing is pooled after it)."""
    k = E.shape[1]
    out[:, :] = 0.0
    sh = np.uint64(shift)
    for r in range(indptr.shape[0] - 1):
        for j in range(indptr[r], indptr[r + 1]):
            if keys[j] == skip_key:
                continue
            f = _field(keys[j], sh, shift)
            if f >= fields:
                return j
            base = f * k
            for d in range(k):
                out[r, base + d] += vals[j] * E[pos[j], d]
    return -1


@njit(cache=True)
def embed_scatter(indptr, pos, keys, vals, dx, shift, skip_key, gE):
    """The transpose of :func:`embed_pool`: ``gE[pos[j]] += vals[j] * dx[r, f*k:(f+1)*k]`` for every
    nonzero ``j`` of row ``r`` (``gE`` is added to, not zeroed; fields were checked by the pool)."""
    k = gE.shape[1]
    sh = np.uint64(shift)
    for r in range(indptr.shape[0] - 1):
        for j in range(indptr[r], indptr[r + 1]):
            if keys[j] != skip_key:
                p, v, base = pos[j], vals[j], _field(keys[j], sh, shift) * k
                for d in range(k):
                    gE[p, d] += v * dx[r, base + d]


@njit(cache=True)
def bias_activate(z, b, act):
    """``z = act(z + b)`` in place (one pass)."""
    for r in range(z.shape[0]):
        for c in range(z.shape[1]):
            x = z[r, c] + b[c]
            if act == RELU:
                z[r, c] = x if x > 0.0 else 0.0
            else:
                z[r, c] = np.tanh(x)


@njit(cache=True)
def activation_backward(d, h, act):
    """``d *= act'(.)`` in place, from the activation's output ``h``."""
    for r in range(d.shape[0]):
        for c in range(d.shape[1]):
            if act == RELU:
                if h[r, c] <= 0.0:
                    d[r, c] = 0.0
            else:
                d[r, c] *= 1.0 - h[r, c] * h[r, c]


@njit(cache=True)
def column_sums(d, out):
    """``out[c] = sum_r d[r, c]`` (overwritten)."""
    out[:] = 0.0
    for r in range(d.shape[0]):
        for c in range(d.shape[1]):
            out[c] += d[r, c]


def mlp_layout(n_in: int, hidden) -> tuple[list, int]:
    """([(W offset, in, out, b offset), ...] per layer, the last being the output layer of width
    1), and the total number of parameters."""
    sizes = [int(n_in), *[int(h) for h in hidden], 1]
    layers, at = [], 0
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers.append((at, a, b, at + a * b))
        at += a * b + b
    return layers, at


def mlp_init(n_in: int, hidden, activation: str, seed: int) -> np.ndarray:
    """Initial parameters: weights normal with std sqrt(2 / fan_in) (He, for ReLU) or
    sqrt(1 / fan_in) (tanh; the output layer too), biases 0; deterministic in ``seed``."""
    layers, size = mlp_layout(n_in, hidden)
    out = np.zeros(size, dtype=np.float32)
    rng = np.random.default_rng(seed)
    for i, (w, a, b, _) in enumerate(layers):
        gain = 2.0 if activation == "relu" and i < len(layers) - 1 else 1.0
        out[w:w + a * b] = rng.normal(0.0, np.sqrt(gain / a), a * b)
    return out


def _views(params, layers):
    return [(params[w:w + a * b].reshape(a, b), params[bo:bo + b]) for w, a, b, bo in layers]


def mlp_forward(params: np.ndarray, layers: list, x: np.ndarray, act: int) -> tuple[np.ndarray, list]:
    """The deep part's margin per row (``x``'s dtype) and the activations kept for the backward
    pass (the input, then each hidden layer's output)."""
    hs = [x]
    h = x
    views = _views(params, layers)
    for W, b in views[:-1]:
        h = h @ W
        bias_activate(h, b, act)
        hs.append(h)
    W, b = views[-1]
    return (h @ W)[:, 0] + b[0], hs


def mlp_backward(params: np.ndarray, layers: list, hs: list, dout: np.ndarray, act: int,
                 grad: np.ndarray) -> np.ndarray:
    """Gradients of ``sum(dout * margin)``: the parameters' into ``grad`` (flat, overwritten) and
    the input's, returned (``rows x n_in``)."""
    views = _views(params, layers)
    gviews = _views(grad, layers)
    d = dout.reshape(-1, 1).astype(hs[0].dtype, copy=False)
    for i in range(len(layers) - 1, -1, -1):
        W, _ = views[i]
        gW, gb = gviews[i]
        np.matmul(hs[i].T, d, out=gW)
        column_sums(d, gb)
        d = d @ W.T
        if i > 0:
            activation_backward(d, hs[i], act)
    return d
