"""Field-aware FM (``model.type = "ffm"``): its kernel against the NumPy reference and finite
differences, and the model end to end on the libffm rows of ``hpcps gen-data --deep``."""

from __future__ import annotations

import numpy as np
import pytest

from hpcps_kernels import ffm as kffm
from hpcps_kernels import keys as kkeys
from hpcps_kernels import models as kmodels
from hpcps_kernels import reference as ref

SKIP = np.uint64(2**63 + 5)  # a key with no field, as the bias key


def random_batch(rows, fields, k, seed, shift=16, vocab=12, dtype=np.float32):
    """A batch of rows with a random subset of fields each (a field now and then twice, a key now
    and then repeated), the bias key last; the keys carry their field above ``shift``."""
    rng = np.random.default_rng(seed)
    keys, indptr = [], [0]
    for _ in range(rows):
        row = [(int(f) << shift) | int(rng.integers(0, vocab)) for f in range(fields) if rng.random() < 0.7]
        if row and rng.random() < 0.3:
            row.append(row[rng.integers(0, len(row))])  # the same key twice
        if rng.random() < 0.2:
            row.append((int(rng.integers(0, fields)) << shift) | int(rng.integers(0, vocab)))
        keys += [*row, int(SKIP)]
        indptr.append(len(keys))
    keys = np.array(keys, dtype=np.uint64)
    uniq, pos = kkeys.unique_keys(keys)
    vals = rng.uniform(0.2, 2.0, keys.shape[0]).astype(np.float32)
    labels = (rng.random(rows) < 0.4).astype(np.float32)
    P = rng.normal(0.0, 0.3, (uniq.shape[0], 1 + fields * k)).astype(dtype)
    fld = np.empty(keys.shape[0], dtype=np.int32)
    assert kffm.nonzero_fields(keys, shift, fields, SKIP, fld) == -1
    return np.array(indptr, dtype=np.int64), pos, fld, vals, labels, P


@pytest.mark.parametrize("loss", [kmodels.LOGISTIC, kmodels.SQUARED])
@pytest.mark.parametrize("rows,fields,k,seed", [(1, 1, 1, 0), (40, 3, 4, 1), (200, 8, 5, 2), (7, 20, 2, 3)])
def test_kernel_equals_the_numpy_reference(rows, fields, k, seed, loss):
    indptr, pos, fld, vals, labels, P = random_batch(rows, fields, k, seed)
    G, m = np.empty_like(P), np.empty(rows)
    total = kffm.ffm_forward_backward(indptr, pos, fld, vals, labels, P, G, k, 0.5, 0.01, loss, m)
    rtotal, rG, rm = ref.ffm_forward_backward(indptr, pos, fld, vals, labels, P, k, 0.5, 0.01, loss)
    np.testing.assert_allclose(m, rm, rtol=1e-9, atol=1e-12)
    assert total == pytest.approx(rtotal, rel=1e-9)
    np.testing.assert_allclose(G, rG, rtol=2e-5, atol=1e-6)
    only = np.empty(rows)
    kffm.ffm_margins(indptr, pos, fld, vals, P, k, only)
    np.testing.assert_array_equal(only, m)


def test_bias_key_adds_only_its_weight_and_a_row_of_one_feature_has_no_pair():
    k, shift = 3, 16
    keys = np.array([5, int(SKIP), (1 << shift) | 2, 7, int(SKIP)], dtype=np.uint64)  # rows: [5, bias], [f1, f0, bias]
    uniq, pos = kkeys.unique_keys(keys)
    fld = np.empty(5, dtype=np.int32)
    assert kffm.nonzero_fields(keys, shift, 2, SKIP, fld) == -1
    assert fld.tolist() == [0, -1, 1, 0, -1]
    P = np.arange(uniq.shape[0] * 7, dtype=np.float32).reshape(-1, 7) / 10
    m = np.empty(2)
    kffm.ffm_margins(np.array([0, 2, 5]), pos, fld, np.ones(5, np.float32), P, k, m)
    row = {int(u): P[i].astype(np.float64) for i, u in enumerate(uniq)}
    a, b = row[(1 << shift) | 2], row[7]  # a of field 1 meets field 0 through v_{a,0}; b meets 1 through v_{b,1}
    assert m[0] == pytest.approx(row[5][0] + row[int(SKIP)][0])
    assert m[1] == pytest.approx(a[0] + b[0] + row[int(SKIP)][0] + a[1:4] @ b[4:7])
    assert kffm.nonzero_fields(keys, shift, 1, SKIP, fld) == 2  # field 1 in a model of one field


def test_gradient_matches_finite_differences():
    k = 3
    indptr, pos, fld, vals, labels, P = random_batch(12, 4, k, 7, dtype=np.float64)
    none = np.empty(0)

    def loss(p):
        return kffm.ffm_forward_backward(indptr, pos, fld, vals, labels, p, np.empty_like(p), k, 1.0, 0.0,
                                         kmodels.LOGISTIC, none)

    G = np.empty_like(P)
    kffm.ffm_forward_backward(indptr, pos, fld, vals, labels, P, G, k, 1.0, 0.0, kmodels.LOGISTIC, none)
    eps = 1e-6
    fd = np.empty_like(P)
    for i in np.ndindex(P.shape):
        up, down = P.copy(), P.copy()
        up[i] += eps
        down[i] -= eps
        fd[i] = (loss(up) - loss(down)) / (2 * eps)
    np.testing.assert_allclose(G, fd, rtol=1e-5, atol=1e-7)
    assert np.abs(G[:, 1:]).max() > 1e-3  # the factors' gradients are there to check
