"""Field-aware factorization machine (FFM, as libffm and xLearn define it) on a CSR batch.

Every key ``j`` belongs to a field ``f_j`` and has a weight ``w_j`` and one latent vector per
field, ``v_{j,f}`` (``k`` values each). A row's margin is

    sum_a w_a x_a + sum_{a < b} <v_{a, f_b}, v_{b, f_a}> x_a x_b

over the row's nonzeros ``a``, ``b``: a feature meets each other field through the vector it
keeps for that field. As in libffm, the pairs are of nonzeros: a key written twice in a row is two
nonzeros (its own field's vector meets itself), not one merged value as in
:func:`hpcps_kernels.models.fm_forward_backward`. A nonzero without a field (the bias key: field
``-1``) adds its linear term only. The cost is ``O(sum over rows of nnz^2 * k)``, against the FM's
``O(nnz * k)``, and a key's row holds ``fields`` vectors instead of one.

Inputs as in :mod:`hpcps_kernels.models` (``indptr``, ``pos``, ``vals``, ``labels``), plus ``fld``
(int32, each nonzero's field: :func:`nonzero_fields`). Parameters are the batch-local rows pulled
for the unique keys, ``P`` of shape ``(n, 1 + fields * k)``: ``[w | v_0 | v_1 | ... ]``, ``v_f``
at columns ``1 + f*k .. 1 + (f+1)*k``; gradients go into a buffer of the same shape. Margins are
accumulated in float64.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .models import lr_residuals


@njit(cache=True)
def nonzero_fields(keys, shift, fields, skip_key, out):
    """Each nonzero's field into ``out`` (int32): ``key >> shift`` (0 when ``shift`` is 64), -1
    for ``skip_key``. Returns -1, or the index of the first nonzero whose field is ``>= fields``."""
    sh = np.uint64(shift)
    for j in range(keys.shape[0]):
        if keys[j] == skip_key:
            out[j] = -1
            continue
        f = np.int64(keys[j] >> sh) if shift < 64 else 0
        if f >= fields:
            return j
        out[j] = f
    return -1


@njit(cache=True, nogil=True)
def ffm_margins(indptr, pos, fld, vals, P, k, out):
    """Each row's margin into ``out`` (float64)."""
    none = np.empty((0, P.shape[1]), dtype=P.dtype)
    for r in range(indptr.shape[0] - 1):
        out[r] = _row(indptr[r], indptr[r + 1], pos, fld, vals, P, k, 0.0, none, False)


@njit(cache=True, nogil=True)
def ffm_forward_backward(indptr, pos, fld, vals, labels, P, G, k, scale, l2, loss, margins, weights=None):
    """The summed loss of the batch (``loss``: :data:`hpcps_kernels.models.LOGISTIC` or
    ``SQUARED``) and its gradients times ``scale`` into ``G`` (overwritten), plus ``l2 * P`` for
    every unique key when ``l2 > 0``. Writes the margins to ``margins`` when it is not empty.
    ``weights``: the rows' importance weights (None: all 1, pruned at compile time), as in
    :mod:`hpcps_kernels.models`.
    Row by row: a row's gradients are scattered while its parameters are still in cache."""
    G[:, :] = 0.0
    m, dm = np.empty(1, dtype=np.float64), np.empty(1, dtype=np.float64)
    total = 0.0
    for r in range(indptr.shape[0] - 1):
        a, b = indptr[r], indptr[r + 1]
        m[0] = _row(a, b, pos, fld, vals, P, k, 0.0, G, False)
        if margins.shape[0] > 0:
            margins[r] = m[0]
        if weights is None:
            total += lr_residuals(m, labels[r:r + 1], scale, loss, dm)
        else:
            total += lr_residuals(m, labels[r:r + 1], scale, loss, dm, weights[r:r + 1])
        _row(a, b, pos, fld, vals, P, k, dm[0], G, True)
    if l2 > 0.0:
        for u in range(P.shape[0]):
            for c in range(P.shape[1]):
                G[u, c] += l2 * P[u, c]
    return total


@njit(inline="always")
def _row(a0, b0, pos, fld, vals, P, k, g, G, backward):
    """One pass over every pair of the nonzeros ``a0:b0`` of a row: forward, returns its margin;
    backward, adds to ``G`` the gradient of its margin times ``g``."""
    m = 0.0
    for a in range(a0, b0):
        pa, fa, xa = pos[a], fld[a], np.float64(vals[a])
        if backward:
            G[pa, 0] += g * xa
        else:
            m += np.float64(P[pa, 0]) * xa
        if fa < 0:
            continue
        for b in range(a + 1, b0):
            fb = fld[b]
            if fb < 0:
                continue
            pb = pos[b]
            ca, cb = 1 + fb * k, 1 + fa * k  # v_{a, f_b} and v_{b, f_a}
            xab = xa * np.float64(vals[b])
            if backward:
                c = g * xab
                for d in range(k):
                    va = P[pa, ca + d]
                    G[pa, ca + d] += c * P[pb, cb + d]
                    G[pb, cb + d] += c * va
            else:
                dot = 0.0
                for d in range(k):
                    dot += np.float64(P[pa, ca + d]) * np.float64(P[pb, cb + d])
                m += dot * xab
    return m
