"""The deep models' kernels (hpcps_kernels.deep) against NumPy/SciPy and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from hpcps_kernels import deep, keys
from hpcps_kernels import reference as ref

SKIP = np.uint64(2**63 + 12345)


def field_batch(rng, rows, fields, shift, per_field=2, vocab=7):
    """A CSR batch whose keys carry their field above ``shift``, multi-hot fields, missing fields,
    a key repeated in a row, and the skipped (bias) key in every row."""
    idx, vals, indptr = [], [], [0]
    for _ in range(rows):
        for f in range(fields):
            for _ in range(rng.integers(0, per_field + 1)):
                idx.append((f << shift) | int(rng.integers(0, vocab)) if shift < 64 else int(rng.integers(0, vocab)))
                vals.append(rng.normal())
        idx.append(int(SKIP))
        vals.append(1.0)
        indptr.append(len(idx))
    idx = np.array(idx, dtype=np.uint64)
    if idx.shape[0] > 3:
        idx[1] = idx[0]
    return np.array(indptr, np.int64), idx, np.array(vals, np.float32)


@pytest.mark.parametrize("shift,fields", [(10, 4), (40, 3), (64, 1)])
def test_embed_pool_matches_scipy_and_scatter_is_its_transpose(shift, fields):
    rng = np.random.default_rng(shift)
    indptr, idx, vals = field_batch(rng, 30, fields, shift)
    uniq, pos = keys.unique_keys(idx)
    k = 5
    E = rng.normal(size=(uniq.shape[0], k)).astype(np.float32)
    out = np.empty((30, fields * k), np.float32)
    assert deep.embed_pool(indptr, pos, idx, vals, E, shift, fields, SKIP, out) == -1
    want = ref.embed_pool(indptr, pos, idx, vals, E, shift, fields, SKIP)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # <pool(E), D> == <E, scatter(D)> for any D
    D = rng.normal(size=out.shape).astype(np.float64)
    gE = np.zeros((uniq.shape[0], k))
    deep.embed_scatter(indptr, pos, idx, vals, D, shift, SKIP, gE)
    np.testing.assert_allclose(np.sum(want * D), np.sum(E.astype(np.float64) * gE), rtol=1e-6)
    assert np.abs(gE[pos[idx == SKIP]]).max() == 0.0  # the bias key gets no embedding gradient


def test_embed_pool_reports_a_field_beyond_the_model():
    indptr = np.array([0, 2], np.int64)
    idx = np.array([(1 << 8) | 3, (5 << 8) | 1], np.uint64)
    uniq, pos = keys.unique_keys(idx)
    out = np.empty((1, 4 * 2), np.float32)
    assert deep.embed_pool(indptr, pos, idx, np.ones(2, np.float32), np.ones((2, 2), np.float32), 8, 4, SKIP,
                           out) == 1


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_mlp_matches_numpy_and_finite_differences(activation):
    rng = np.random.default_rng(1)
    n_in, hidden, rows = 6, [5, 4], 9
    layers, size = deep.mlp_layout(n_in, hidden)
    assert size == 6 * 5 + 5 + 5 * 4 + 4 + 4 + 1
    params = deep.mlp_init(n_in, hidden, activation, seed=3).astype(np.float64)
    params[layers[0][3]:layers[0][3] + 5] = rng.normal(size=5) * 0.1  # biases that matter
    x = rng.normal(size=(rows, n_in))
    act = deep.ACTIVATIONS[activation]
    m, hs = deep.mlp_forward(params, layers, x.copy(), act)
    want_m, want_grad = ref.mlp(params, n_in, hidden, x, activation)
    np.testing.assert_allclose(m, want_m, rtol=1e-12, atol=1e-12)
    dout = rng.normal(size=rows)
    grad = np.empty(size)
    dx = deep.mlp_backward(params, layers, hs, dout, act, grad)
    want_g, want_dx = want_grad(dout)
    np.testing.assert_allclose(grad, want_g, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-10, atol=1e-12)

    def f(p, x_):
        return float(dout @ deep.mlp_forward(p, layers, x_.copy(), act)[0])

    h = 1e-6
    for i in range(size):
        e = np.zeros(size); e[i] = h
        assert grad[i] == pytest.approx((f(params + e, x) - f(params - e, x)) / (2 * h), rel=1e-5, abs=1e-7)
    for r, c in [(0, 0), (3, 2), (8, 5)]:
        e = np.zeros_like(x); e[r, c] = h
        assert dx[r, c] == pytest.approx((f(params, x + e) - f(params, x - e)) / (2 * h), rel=1e-5, abs=1e-7)


def test_mlp_init_is_deterministic_and_scaled_by_fan_in():
    a = deep.mlp_init(400, [200], "relu", seed=5)
    b = deep.mlp_init(400, [200], "relu", seed=5)
    np.testing.assert_array_equal(a, b)
    layers, _ = deep.mlp_layout(400, [200])
    w0 = a[:400 * 200]
    assert np.std(w0) == pytest.approx(np.sqrt(2 / 400), rel=0.02)
    assert not a[layers[0][3]:layers[0][3] + 200].any()  # biases start at 0
