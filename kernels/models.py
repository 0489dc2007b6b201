"""Forward and backward passes of the sparse models on a CSR batch.

A batch is CSR over its unique keys: ``indptr`` (rows + 1), ``pos`` (each nonzero's position in
the batch's sorted unique keys, from :func:`hpcps_kernels.keys.unique_keys`), ``vals`` (float32)
and ``labels`` (float32; 0/1 for the logistic loss). Parameters are the *batch-local* rows pulled
for those unique keys: ``w[u]`` (linear weights) and ``V[u, k]`` (factors). Gradients are
scatter-added into buffers of the same shapes, ready to be pushed.

Losses (``loss`` argument): ``LOGISTIC`` (logloss of sigmoid(margin), labels in [0, 1]) or
``SQUARED`` (0.5 * (margin - label)**2, for ratings). The returned loss is the *sum* over rows;
gradients are of that sum times ``scale`` (pass ``1/rows`` for the mean), plus ``l2 * w`` once
per unique key of the batch when ``l2 > 0`` (the L2 term of the keys the batch touches).
Margins are accumulated in float64.

``weights`` (float32 per row, or None: every row's 1): each row's importance weight, which
multiplies its loss and its gradient, so a row of weight 2 counts as the row twice (as VW's
importance weights, LightGBM's and scikit-learn's sample weights). None compiles a kernel of its
own without the multiplication (numba prunes the ``weights is None`` branches), so an unweighted
batch runs the code it ran before weights existed.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._prefetch import prefetch
from .tuning import PREFETCH_NONZEROS

LOGISTIC = 0
SQUARED = 1


@njit(inline="always")
def _loss_and_dmargin(m, y, loss):
    """(loss, d loss / d margin) of one row."""
    if loss == LOGISTIC:
        # softplus(m) - y*m, stably; sigmoid(m) stably: with e = exp(-|m|), softplus is
        # max(m, 0) + log1p(e) and sigmoid 1 / (1 + e) or e / (1 + e). Selects, not branches (the
        # sign of a margin is as random as its label), the same figures bit for bit.
        e = math.exp(-abs(m))
        sp = (m if m > 0.0 else 0.0) + math.log1p(e)
        p = (1.0 if m >= 0.0 else e) / (1.0 + e)
        return sp - y * m, p - y
    d = m - y
    return 0.5 * d * d, d


@njit(cache=True, nogil=True)  # a parse thread (data.parse_thread) runs beside it
def lr_forward_backward(indptr, pos, vals, labels, w, grad, scale, l2, loss, weights=None):
    """Logistic/linear regression: one fused pass over the nonzeros.

    ``grad`` (float32, like ``w``) is overwritten. Returns the summed loss (float64).
    A key repeated within a row acts as the sum of its values, as in a sparse vector.
    ``vals`` None: every value is 1 (binary features: Criteo, ``index:1`` libsvm), a kernel of
    its own that reads no values, the same figures bit for bit (``x * 1`` is ``x`` exactly).
    ``pos`` may be of any integer type (a kept batch's uint16 positions are read as they are).
    """
    grad[:] = 0.0
    total = 0.0
    for r in range(indptr.shape[0] - 1):
        a, b = indptr[r], indptr[r + 1]
        m = 0.0
        if vals is None:
            for j in range(a, b):
                m += np.float64(w[np.intp(pos[j])])
        else:
            for j in range(a, b):
                m += np.float64(w[np.intp(pos[j])]) * vals[j]
        lo, g = _loss_and_dmargin(m, labels[r], loss)
        if weights is not None:
            lo, g = lo * weights[r], g * weights[r]
        total += lo
        g *= scale
        if vals is None:
            for j in range(a, b):
                grad[np.intp(pos[j])] += g
        else:
            for j in range(a, b):
                grad[np.intp(pos[j])] += g * vals[j]
    if l2 > 0.0:
        for u in range(w.shape[0]):
            grad[u] += l2 * w[u]
    return total


@njit(cache=True)
def lr_predict(indptr, pos, vals, w, out):
    """Margins of every row into ``out`` (float64)."""
    for r in range(indptr.shape[0] - 1):
        m = 0.0
        for j in range(indptr[r], indptr[r + 1]):
            m += np.float64(w[pos[j]]) * vals[j]
        out[r] = m


@njit(cache=True, nogil=True)  # a parse thread (data.parse_thread) runs beside it
def fm_forward_backward(indptr, pos, vals, labels, w, V, gw, gV, scale, l2, loss, margins, weights=None):
    """Second-order factorization machine in O(nnz * k); gradients overwrite ``gw``, ``gV``.

    margin = sum_i w_i x_i + 1/2 sum_f [(sum_i V_if x_i)^2 - sum_i V_if^2 x_i^2], where a key
    repeated within a row is first merged (its values summed), so the model sees the same
    sparse vector as scipy would. Writes each row's margin to ``margins`` when it is not empty.
    Returns the summed loss.

    A row's repeated keys are found by a small table of the row's own positions (:func:`_fm_row_merge`),
    which stays in L1, not by a scratch entry per key of the batch. The rows of ``w``, ``V``, ``gw``,
    ``gV`` a nonzero needs are prefetched ``PREFETCH_NONZEROS`` nonzeros early, in that first pass:
    the batch's parameters exceed L2, and without it the kernel waits on one cache miss after another.
    """
    k = V.shape[1]
    gw[:] = 0.0
    gV[:, :] = 0.0
    longest = 1
    for r in range(indptr.shape[0] - 1):
        longest = max(longest, indptr[r + 1] - indptr[r])
    cap = 64
    while cap < 2 * longest:
        cap *= 2
    # the row's table: a slot's row (-1: never used), position, and nonzero (its offset in the row);
    # per nonzero of the row: its merged value, and whether it carries it (False: a later copy)
    table = np.full((cap, 3), -1, dtype=np.int64)
    xs = np.empty(longest, dtype=np.float64)
    first = np.empty(longest, dtype=np.bool_)
    s = np.zeros(k, dtype=np.float64)
    total = 0.0
    for r in range(indptr.shape[0] - 1):
        a, b = indptr[r], indptr[r + 1]
        dup = _fm_row_merge(pos, vals, a, b, r, table, xs, first, w, V, gw, gV)
        # With a repeated key, its first nonzero carries the merged value and later copies are
        # skipped; rows without one (nearly all) read their values straight.
        m = 0.0
        sq = 0.0
        s[:] = 0.0
        for j in range(a, b):
            if dup and not first[j - a]:
                continue
            p = pos[j]
            x = xs[j - a] if dup else np.float64(vals[j])
            m += np.float64(w[p]) * x
            for f in range(k):
                v = np.float64(V[p, f]) * x
                s[f] += v
                sq += v * v
        for f in range(k):
            m += 0.5 * s[f] * s[f]
        m -= 0.5 * sq
        if margins.shape[0] > 0:
            margins[r] = m
        lo, g = _loss_and_dmargin(m, labels[r], loss)
        if weights is not None:
            lo, g = lo * weights[r], g * weights[r]
        total += lo
        g *= scale
        for j in range(a, b):
            if dup and not first[j - a]:
                continue
            p = pos[j]
            x = xs[j - a] if dup else np.float64(vals[j])
            gx = g * x
            gw[p] += gx
            for f in range(k):
                gV[p, f] += gx * (s[f] - V[p, f] * x)
    if l2 > 0.0:
        _fm_add_l2(w, V, gw, gV, l2)
    return total


@njit(inline="always")
def _fm_row_merge(pos, vals, a, b, row, table, xs, first, w, V, gw, gV):
    """The first pass of :func:`fm_forward_backward` over row ``row`` (nonzeros ``a:b``): each
    key's summed value into ``xs`` at its first nonzero (``first``), through ``table`` (open
    addressing on the position's mixed bits, its slots stamped with the row so it is never
    cleared), prefetching the parameters of the nonzero ``PREFETCH_NONZEROS`` on. Returns whether
    a key repeats in the row."""
    nnz = pos.shape[0]
    mask = table.shape[0] - 1
    shift = np.uint64(64 - 6)
    while (np.int64(1) << (np.uint64(64) - shift)) < table.shape[0]:
        shift -= np.uint64(1)
    dup = False
    for j in range(a, b):
        if j + PREFETCH_NONZEROS < nnz:
            q = pos[j + PREFETCH_NONZEROS]
            prefetch(w, q)
            prefetch(V[q], 0)
            prefetch(gw, q)
            prefetch(gV[q], 0)
        p = np.int64(pos[j])
        h = np.int64((np.uint64(p) * np.uint64(0x9E3779B97F4A7C15)) >> shift) & mask
        while True:
            if table[h, 0] != row:
                table[h, 0], table[h, 1], table[h, 2] = row, p, j - a
                xs[j - a] = vals[j]
                first[j - a] = True
                break
            if table[h, 1] == p:
                xs[table[h, 2]] += vals[j]
                first[j - a] = False
                dup = True
                break
            h = (h + 1) & mask
    return dup


@njit(inline="always")
def _fm_add_l2(w, V, gw, gV, l2):
    for u in range(w.shape[0]):
        gw[u] += l2 * w[u]
        for f in range(V.shape[1]):
            gV[u, f] += l2 * V[u, f]


@njit(cache=True)
def lr_partial_margins(pos, vals, row_ids, w, out):
    """Computation on the servers: ``out[row]`` (float64, zeroed here) = the sum of
    ``w[pos[j]] * vals[j]`` over the nonzeros ``j`` of that row given here (a server's share of a
    batch), in order: with one server, exactly the margins :func:`lr_forward_backward` sums."""
    out[:] = 0.0
    for j in range(pos.shape[0]):
        out[row_ids[j]] += np.float64(w[pos[j]]) * vals[j]


@njit(cache=True)
def lr_residual_grads(pos, vals, row_ids, residuals, grad):
    """The per-key gradients of a server's nonzeros from each row's d loss / d margin
    (``residuals``, already scaled): ``grad[pos[j]] += residuals[row_ids[j]] * vals[j]`` in order,
    as :func:`lr_forward_backward` accumulates them (so the same float32 sums)."""
    grad[:] = 0.0
    for j in range(pos.shape[0]):
        grad[pos[j]] += residuals[row_ids[j]] * vals[j]


@njit(cache=True)
def lr_residuals(margins, labels, scale, loss, out, weights=None):
    """Each row's d loss / d margin times ``scale`` (and its weight) into ``out``; returns the
    summed loss."""
    total = 0.0
    for r in range(margins.shape[0]):
        lo, g = _loss_and_dmargin(margins[r], labels[r], loss)
        if weights is not None:
            lo, g = lo * weights[r], g * weights[r]
        total += lo
        out[r] = g * scale
    return total


@njit(cache=True)
def _merge_repeated_keys(pos, vals, row_ids, n_keys):
    """A server's nonzeros with a key repeated within its row merged, as
    :func:`fm_forward_backward` merges them: its values summed in order at its first place.
    Returns (pos, x float64, row_ids) of the merged nonzeros (a row's nonzeros consecutive)."""
    n = pos.shape[0]
    out_pos = np.empty(n, dtype=np.int64)
    out_x = np.empty(n, dtype=np.float64)
    out_row = np.empty(n, dtype=np.int32)
    at = np.empty(n_keys, dtype=np.int64)           # a key's place in the output, in its last row
    last_row = np.full(n_keys, -1, dtype=np.int64)  # the last row that had the key
    m = 0
    for j in range(n):
        p = pos[j]
        r = row_ids[j]
        if last_row[p] == r:
            out_x[at[p]] += vals[j]
        else:
            last_row[p] = r
            at[p] = m
            out_pos[m] = p
            out_x[m] = vals[j]
            out_row[m] = r
            m += 1
    return out_pos[:m], out_x[:m], out_row[:m]


@njit(cache=True)
def fm_partial_margins(pos, vals, row_ids, w, V, out):
    """Computation on the servers for a factorization machine: per row of the nonzeros given
    here (a server's share of a batch; a row's nonzeros consecutive, as they are in the batch),
    ``out[row] = [sum w x, sum_i V_if x (k of them), sum_i sum_f (V_if x)^2]`` (float64, zeroed
    here), with a key repeated within the row merged first, in the order
    :func:`fm_forward_backward` sums them. The margin is ``L + 1/2 sum_f S_f^2 - 1/2 Q`` over the
    servers' sums."""
    k = V.shape[1]
    out[:, :] = 0.0
    mpos, mx, mrow = _merge_repeated_keys(pos, vals, row_ids, w.shape[0])
    for j in range(mpos.shape[0]):
        p, x, r = mpos[j], mx[j], mrow[j]
        out[r, 0] += np.float64(w[p]) * x
        for f in range(k):
            v = np.float64(V[p, f]) * x
            out[r, 1 + f] += v
            out[r, 1 + k] += v * v


@njit(cache=True)
def fm_residual_grads(pos, vals, row_ids, V, residuals, gw, gV):
    """The per-key gradients of a server's nonzeros for a factorization machine, from each row's
    ``[d loss / d margin (scaled), S_1..S_k]`` (``residuals``, the row's sums over all servers):
    ``gw += g x``, ``gV[f] += g x (S_f - V_f x)``, a repeated key merged within its row, as
    :func:`fm_forward_backward` accumulates them."""
    k = V.shape[1]
    gw[:] = 0.0
    gV[:, :] = 0.0
    mpos, mx, mrow = _merge_repeated_keys(pos, vals, row_ids, gw.shape[0])
    for j in range(mpos.shape[0]):
        p, x, r = mpos[j], mx[j], mrow[j]
        gx = residuals[r, 0] * x
        gw[p] += gx
        for f in range(k):
            gV[p, f] += gx * (residuals[r, 1 + f] - V[p, f] * x)


@njit(cache=True)
def fm_residuals(partials, labels, scale, loss, out, weights=None):
    """From the servers' summed ``[L, S_1..S_k, Q]`` per row: each row's margin
    ``L + 1/2 sum S_f^2 - 1/2 Q``, then ``out[row] = [d loss / d margin * scale (* weight), S_1..S_k]``;
    returns the summed loss."""
    k = partials.shape[1] - 2
    total = 0.0
    for r in range(partials.shape[0]):
        m = partials[r, 0]
        for f in range(k):
            m += 0.5 * partials[r, 1 + f] * partials[r, 1 + f]
        m -= 0.5 * partials[r, 1 + k]
        lo, g = _loss_and_dmargin(m, labels[r], loss)
        if weights is not None:
            lo, g = lo * weights[r], g * weights[r]
        total += lo
        out[r, 0] = g * scale
        for f in range(k):
            out[r, 1 + f] = partials[r, 1 + f]
    return total
