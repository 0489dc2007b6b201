"""Every kernel against its NumPy/SciPy reference, over many shapes, plus invariants."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcps_kernels import directindex, hashing, hashtable, keys, metrics, models, optim, parse
from hpcps_kernels import reference as ref
from shared_runs import writable

U64_MAX = np.iinfo(np.uint64).max
SETTINGS = settings(max_examples=60, deadline=None)


def key_arrays():
    """uint64 key arrays: empty, tiny, with duplicates, near both ends of the uint64 range."""
    edge = st.sampled_from([0, 1, 2, U64_MAX, U64_MAX - 1, 2**63, 2**63 - 1])
    key = st.one_of(edge, st.integers(0, 50), st.integers(0, U64_MAX))
    return st.lists(key, max_size=300).map(lambda xs: np.array(xs, dtype=np.uint64))


def random_batch(rng, rows, per_row, space, dup_rows=True):
    counts = rng.integers(0, per_row + 1, rows)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    indptr[1:] = np.cumsum(counts)
    idx = rng.integers(0, space, indptr[-1], dtype=np.uint64)
    if dup_rows and indptr[-1] > 2:
        idx[1] = idx[0]  # a key repeated inside a row (when row 0 has two nonzeros) or across rows
    vals = rng.normal(size=indptr[-1]).astype(np.float32)
    labels = (rng.random(rows) < 0.4).astype(np.float32)
    return indptr, idx, vals, labels


# -- 1. batch keys and 4. segment reduce ---------------------------------------------------------

@SETTINGS
@given(key_arrays())
def test_unique_keys_matches_numpy(k):
    uniq, pos = keys.unique_keys(k)
    ruq, rpos = ref.unique_keys(k)
    np.testing.assert_array_equal(uniq, ruq)
    np.testing.assert_array_equal(pos, rpos)
    assert keys.is_sorted_unique(uniq)
    np.testing.assert_array_equal(uniq[pos], k)


@SETTINGS
@given(key_arrays(), st.sampled_from([1, 3, 16]))
def test_segment_reduce_matches_numpy_and_loses_no_mass(k, dim):
    rng = np.random.default_rng(len(k))
    v = rng.integers(-5, 6, size=(len(k), dim)).astype(np.float32)  # integers: sums are exact
    uk, uv = keys.segment_reduce(k, v)
    rk, rv = ref.segment_reduce(k, v)
    np.testing.assert_array_equal(uk, rk)
    np.testing.assert_array_equal(uv, rv)
    assert keys.is_sorted_unique(uk)
    np.testing.assert_array_equal(uv.sum(axis=0), v.sum(axis=0))


@SETTINGS
@given(key_arrays(), st.data())
def test_reusable_slots_is_array_equal_then_flatnonzero(k, data):
    slots = np.array(data.draw(st.lists(st.integers(-1, 9), min_size=k.size, max_size=k.size)), dtype=np.int64)
    other = k.copy()
    if k.size and data.draw(st.booleans()):  # one key differs, anywhere
        other[data.draw(st.integers(0, k.size - 1))] ^= np.uint64(1 << data.draw(st.integers(0, 63)))
    if data.draw(st.booleans()):  # or the lengths differ
        other = other[:data.draw(st.integers(0, k.size))]
    absent = np.full(k.size, -7, dtype=np.int64)
    m = keys.reusable_slots(k, slots, other, absent)
    if not np.array_equal(k, other):
        assert m == -1
    else:
        np.testing.assert_array_equal(absent[:m], np.flatnonzero(slots < 0))


@SETTINGS
@given(st.lists(key_arrays(), min_size=1, max_size=7), st.sampled_from([1, 4]))
def test_merge_sorted_equals_segment_reduce_of_the_concatenation(lists, dim):
    parts = []
    for i, k in enumerate(lists):
        u = np.unique(k)
        parts.append((u, np.full((u.size, dim), i + 1, dtype=np.float32)))
    mk, mv = keys.merge_sorted(parts)
    rk, rv = ref.segment_reduce(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    np.testing.assert_array_equal(mk, rk)
    np.testing.assert_array_equal(mv, rv)


def test_segment_reduce_of_float_values_is_bitwise_like_add_at():
    rng = np.random.default_rng(1)
    k = rng.integers(0, 1000, 50_000).astype(np.uint64)
    v = rng.normal(size=(50_000, 4)).astype(np.float32)
    uk, uv = keys.segment_reduce(k, v)
    rk, rv = ref.segment_reduce(k, v)
    np.testing.assert_array_equal(uv, rv)


@SETTINGS
@given(key_arrays(), st.sampled_from([1, 3, 16]), st.booleans())
def test_segment_reduce_is_numpy_bit_for_bit(k, dim, strided):
    """Float values (so the order of the additions shows), in a strided view or not."""
    rng = np.random.default_rng(len(k))
    v = rng.normal(size=(len(k), 2 * dim)).astype(np.float32)
    v = v[:, ::2] if strided else np.ascontiguousarray(v[:, :dim])
    uk, uv = keys.segment_reduce(k, v)
    rk, rv = ref.segment_reduce(k, v)
    assert uk.dtype == np.uint64 and uv.dtype == np.float32 and uv.shape == (rk.size, dim)
    np.testing.assert_array_equal(uk, rk)
    np.testing.assert_array_equal(uv, rv)


@pytest.mark.parametrize("dim", [1, 4])
@pytest.mark.parametrize("wide", [[], [2**63 + 5, 7]], ids=["packed", "radix"])
def test_segment_reduce_of_pushes_is_numpy_bit_for_bit(dim, wide):
    """Four sorted pushes concatenated, keys of a 2**24 space (a key's varying bits and its index
    fit one word: NumPy sorts them) or with a 64-bit key among them (every bit varies: the radix
    sort), 1 in 3 keys repeated, above a common high bit or not."""
    rng = np.random.default_rng(dim)
    parts = [np.unique(rng.integers(0, 1 << 24, 30_000)).astype(np.uint64) for _ in range(4)]
    for high in (0, 1 << 50):
        k = np.concatenate(parts + [np.array(wide, np.uint64)]) | np.uint64(high)
        v = rng.normal(size=(k.size, dim)).astype(np.float32)
        uk, uv = keys.segment_reduce(k, v)
        rk, rv = ref.segment_reduce(k, v)
        np.testing.assert_array_equal(uk, rk)
        assert uv.tobytes() == rv.tobytes()


def test_softplus_without_branches_is_the_branching_formula_bit_for_bit():
    """metrics.logloss_sum and the models' logistic loss select instead of branching on the
    margin's sign: the same libm calls, so the same figures to the bit (no fastmath)."""
    rng = np.random.default_rng(5)
    m = np.concatenate([rng.normal(size=2000) * 10, [0.0, -0.0, 1e-300, -1e-300, 36.0, -36.0, 710.0, -710.0]])
    y = (rng.random(m.size) < 0.3).astype(np.float32)
    for mi, yi in zip(m.tolist(), y.tolist()):
        sp = mi + math.log1p(math.exp(-mi)) if mi >= 0 else math.log1p(math.exp(mi))
        assert metrics.logloss_sum(np.array([yi], np.float32), np.array([mi])) == sp - yi * mi
    # one row, one nonzero of value 1: the margin is the weight; the gradient is sigmoid(m) - y
    for mi, yi in zip(m[:200].tolist(), y[:200].tolist()):
        g = np.empty(1, np.float32)
        w = np.array([mi], np.float32)
        got = models.lr_forward_backward(np.array([0, 1]), np.array([0]), np.ones(1, np.float32),
                                         np.array([yi], np.float32), w, g, 1.0, 0.0, 0)
        mf = float(w[0])
        sp = mf + math.log1p(math.exp(-mf)) if mf >= 0 else math.log1p(math.exp(mf))
        assert got == sp - yi * mf
        e = math.exp(-mf) if mf >= 0 else math.exp(mf)
        want = (1.0 / (1.0 + e) if mf >= 0 else e / (1.0 + e)) - yi
        assert g[0] == np.float32(want)


# -- 2. logistic regression, 3. factorization machine -------------------------------------------

@pytest.mark.parametrize("rows,per_row,space", [(0, 5, 10), (1, 1, 10), (1, 39, 5), (257, 39, 2**24),
                                                (64, 10, 2**64 - 1), (100, 3, 7)])
@pytest.mark.parametrize("loss", [models.LOGISTIC, models.SQUARED])
@pytest.mark.parametrize("l2", [0.0, 0.1])
def test_lr_matches_scipy(rows, per_row, space, loss, l2):
    rng = np.random.default_rng(rows * 31 + per_row)
    indptr, idx, vals, labels = random_batch(rng, rows, per_row, space)
    uniq, pos = keys.unique_keys(idx)
    w = rng.normal(size=len(uniq)).astype(np.float32)
    grad = np.empty_like(w)
    scale = 1.0 / max(rows, 1)
    total = models.lr_forward_backward(indptr, pos, vals, labels, w, grad, scale, l2, loss)
    rtotal, rgrad = ref.lr_forward_backward(indptr, pos, vals, labels, w, scale, l2, loss)
    assert total == pytest.approx(rtotal, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(grad, rgrad, rtol=2e-5, atol=1e-6)
    margins = np.empty(rows)
    models.lr_predict(indptr, pos, vals, w, margins)
    X = ref.csr(indptr, pos, vals, len(w))
    np.testing.assert_allclose(margins, X @ w.astype(np.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("pos_type", [np.int64, np.int32, np.uint16])
def test_lr_without_values_is_the_kernel_with_values_of_one_bit_for_bit(pos_type):
    # binary features (vals None: nothing read) and a kept batch's narrow positions, as trained
    rng = np.random.default_rng(9)
    indptr, idx, _, labels = random_batch(rng, 300, 39, 5000)
    uniq, pos = keys.dedup_keys(idx)
    w = rng.normal(size=len(uniq)).astype(np.float32)
    weights = rng.random(300).astype(np.float32)
    for loss, wt in ((models.LOGISTIC, None), (models.SQUARED, weights)):
        want_g, got_g = np.empty_like(w), np.empty_like(w)
        want = models.lr_forward_backward(indptr, pos, np.ones(idx.shape[0], np.float32), labels, w, want_g, 0.3, 0.1,
                                          loss, wt)
        got = models.lr_forward_backward(indptr, pos.astype(pos_type), None, labels, w, got_g, 0.3, 0.1, loss, wt)
        assert got == want
        np.testing.assert_array_equal(got_g, want_g)


def test_lr_duplicate_key_in_a_row_acts_as_the_sum_of_its_values():
    indptr = np.array([0, 3], dtype=np.int64)
    idx = np.array([5, 9, 5], dtype=np.uint64)
    uniq, pos = keys.unique_keys(idx)
    vals = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    w = np.array([0.5, -0.25], dtype=np.float32)  # keys 5, 9
    grad = np.empty_like(w)
    total = models.lr_forward_backward(indptr, pos, vals, np.ones(1, np.float32), w, grad, 1.0, 0.0, 0)
    m = 0.5 * 4 - 0.25 * 2  # key 5 with value 1 + 3
    p = 1 / (1 + math.exp(-m))
    assert total == pytest.approx(math.log1p(math.exp(-m)))
    np.testing.assert_allclose(grad, [(p - 1) * 4, (p - 1) * 2], rtol=1e-6)


@pytest.mark.parametrize("rows,per_row,space", [(0, 4, 10), (1, 1, 10), (1, 39, 4), (200, 39, 2**24),
                                                (50, 8, 2**64 - 1)])
@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("loss", [models.LOGISTIC, models.SQUARED])
def test_fm_matches_scipy(rows, per_row, space, k, loss):
    rng = np.random.default_rng(rows + 7 * k)
    indptr, idx, vals, labels = random_batch(rng, rows, per_row, space)
    uniq, pos = keys.unique_keys(idx)
    w = rng.normal(size=len(uniq)).astype(np.float32)
    V = (0.3 * rng.normal(size=(len(uniq), k))).astype(np.float32)
    gw, gV, margins = np.empty_like(w), np.empty_like(V), np.empty(rows)
    scale, l2 = 1.0 / max(rows, 1), 0.05
    total = models.fm_forward_backward(indptr, pos, vals, labels, w, V, gw, gV, scale, l2, loss, margins)
    rtotal, rgw, rgV, rm = ref.fm_forward_backward(indptr, pos, vals, labels, w, V, scale, l2, loss)
    assert total == pytest.approx(rtotal, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(margins, rm, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(gw, rgw, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(gV, rgV, rtol=2e-5, atol=1e-6)


def test_fm_gradient_matches_finite_differences():
    rng = np.random.default_rng(3)
    indptr, idx, vals, labels = random_batch(rng, 5, 6, 12)
    uniq, pos = keys.unique_keys(idx)
    w = rng.normal(size=len(uniq))
    V = 0.5 * rng.normal(size=(len(uniq), 3))
    gw, gV, none = np.empty_like(w), np.empty_like(V), np.empty(0)

    def f(w_, V_):
        return models.fm_forward_backward(indptr, pos, vals, labels, w_, V_, np.empty_like(w_),
                                          np.empty_like(V_), 1.0, 0.0, 0, none)

    models.fm_forward_backward(indptr, pos, vals, labels, w, V, gw, gV, 1.0, 0.0, 0, none)
    h = 1e-6
    for u in range(len(uniq)):
        e = np.zeros_like(w); e[u] = h
        assert gw[u] == pytest.approx((f(w + e, V) - f(w - e, V)) / (2 * h), rel=1e-5, abs=1e-7)
        for c in range(3):
            E = np.zeros_like(V); E[u, c] = h
            assert gV[u, c] == pytest.approx((f(w, V + E) - f(w, V - E)) / (2 * h), rel=1e-5, abs=1e-7)


# -- 5. optimizers against line-by-line transcriptions -------------------------------------------

def _opt_case(name, dim, seed):
    rng = np.random.default_rng(seed)
    n_rows, n_upd = 20, 60
    slots = rng.integers(0, n_rows, n_upd)  # repeated slots: applied in order
    grads = rng.normal(size=(n_upd, dim)).astype(np.float32)
    rows = np.zeros((n_rows, optim.width(name, dim)), dtype=np.float32)
    rows[:, :dim] = rng.normal(size=(n_rows, dim))
    rows[:, dim:] = optim.state_init(name, dim, adagrad_init=0.1)
    return slots, grads, rows


CASES = {
    "sgd": ((0.1, 0.01), optim.sgd, ref.sgd),
    "adagrad": ((0.05, 1e-8, 0.001), optim.adagrad, ref.adagrad),
    "ftrl": ((0.1, 1.0, 0.5, 0.3), optim.ftrl, ref.ftrl),
    "adam": ((0.01, 0.9, 0.999, 1e-8, 0.01), optim.adam, ref.adam),
}


@pytest.mark.parametrize("dim", [1, 16, 64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_update_rule_against_its_transcription(name, dim):
    args, kernel, reference = CASES[name]
    slots, grads, rows = _opt_case(name, dim, dim)
    expect = rows.copy()
    kernel(rows, slots, grads, *args)
    reference(expect, slots, grads, *args)
    np.testing.assert_allclose(rows, expect, rtol=2e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(rows.shape[0]), slots)
    fresh = _opt_case(name, dim, dim)[2]
    np.testing.assert_array_equal(rows[untouched], fresh[untouched])  # lazy: only listed rows move


def test_sgd_lr1_integer_gradients_are_exact_sums():
    p = np.zeros((3, 2), dtype=np.float32)
    slots = np.array([0, 2, 0, 0], dtype=np.int64)
    g = np.array([[1, 2], [3, 4], [5, 6], [-7, 8]], dtype=np.float32)
    optim.sgd(p, slots, g, 1.0, 0.0)
    np.testing.assert_array_equal(p, [[1, -16], [0, 0], [-3, -4]])


@pytest.mark.parametrize("dim", [1, 16])
def test_ftrl_without_beta_leaves_a_row_of_zero_gradients_at_zero(dim):
    """beta = 0 and l2 = 0 are allowed; a new row whose gradients are all 0 has n = 0 and z = 0:
    its weight is 0 (it raised ZeroDivisionError on the server, 0 / 0)."""
    rows = np.zeros((4, optim.width("ftrl", dim)), dtype=np.float32)
    grads = np.zeros((2, dim), dtype=np.float32)
    grads[1, 0] = 0.5  # and a row with a gradient moves as usual
    optim.ftrl(rows, np.array([0, 1]), grads, 0.1, 0.0, 0.0, 0.0)
    assert np.all(rows[0] == 0) and np.all(np.isfinite(rows))
    assert rows[1, 0] == pytest.approx(-0.1)  # -z alpha / sqrt(n) = -0.5 * 0.1 / 0.5


@pytest.mark.parametrize("l1", [0.0, 5.0])
def test_ftrl_l1_gives_exact_zeros(l1):
    slots, grads, rows = _opt_case("ftrl", 4, 9)
    rows[:] = 0
    optim.ftrl(rows, slots, grads, 0.1, 1.0, l1, 0.0)
    w, z = rows[:, :4], rows[:, 4:8]
    assert np.all((w == 0) == (np.abs(z) <= l1))


def test_adam_counts_steps_per_row():
    slots, grads, rows = _opt_case("adam", 2, 5)
    optim.adam(rows, slots, grads, 0.01, 0.9, 0.999, 1e-8, 0.0)
    steps = np.bincount(slots, minlength=rows.shape[0])
    np.testing.assert_allclose(rows[:, 6], 0.9 ** steps, rtol=1e-6)
    np.testing.assert_allclose(rows[:, 7], 0.999 ** steps, rtol=1e-6)


def test_width_rejects_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'"):
        optim.width("adamw", 1)


def test_the_registry_defines_each_optimizer_in_one_place_and_checks_registrations():
    assert sorted(optim.REGISTRY) == ["adagrad", "adam", "ftrl", "sgd"]
    assert [optim.width(n, 4) for n in ("sgd", "adagrad", "ftrl", "adam")] == [4, 8, 12, 14]
    assert optim.get("ftrl").range_error("alpha", 0.0) == "must be greater than 0 (got 0)"
    assert optim.get("adam").range_error("beta1", 1.0) == "must be in [0, 1) (got 1)"
    rule = optim.Optimizer("t_half", {"lr": 0.5}, optim.sgd, ("lr", "l2"))
    with pytest.raises(ValueError, match=r"kernel arguments \['l2'\] are not among its params"):
        optim.register(rule)
    with pytest.raises(ValueError, match="default lr must be greater than 0"):
        optim.register(optim.Optimizer("t_bad", {"lr": 0.0, "l2": 0.0}, optim.sgd, ("lr", "l2"),
                                       ranges={"lr": optim.POSITIVE}))
    with pytest.raises(ValueError, match="'sgd' is already registered"):
        optim.register(optim.Optimizer("sgd", {"lr": 0.5, "l2": 0.0}, optim.sgd, ("lr", "l2")))
    a = optim.Optimizer("t_fp", {"lr": 0.5, "l2": 0.0}, optim.sgd, ("lr", "l2"))
    b = optim.Optimizer("t_fp", {"lr": 0.25, "l2": 0.0}, optim.sgd, ("lr", "l2"))
    c = optim.Optimizer("t_fp", {"lr": 0.5, "l2": 0.0}, optim.adagrad, ("lr", "l2"))
    assert a.fingerprint() == optim.Optimizer("t_fp", {"lr": 0.5, "l2": 0.0}, optim.sgd, ("lr", "l2")).fingerprint()
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


# -- 6. hash table -------------------------------------------------------------------------------

@SETTINGS
@given(key_arrays(), key_arrays())
def test_key_index_against_a_dict(a, b):
    idx = hashtable.KeyIndex(capacity=1)
    model: dict[int, int] = {}
    for batch in (a, b, a):
        slots = idx.lookup_or_insert(batch)
        for k, s in zip(batch.tolist(), slots.tolist()):
            assert model.setdefault(k, len(model)) == s
    assert idx.size == len(model)
    np.testing.assert_array_equal(idx.keys[: idx.size], np.array(list(model), dtype=np.uint64))
    probe = np.concatenate([a, b, np.array([12345678901, 3], dtype=np.uint64)])
    expect = [model.get(k, -1) for k in probe.tolist()]
    np.testing.assert_array_equal(idx.lookup(probe), expect)


def test_key_index_growth_rebuild_and_bytes_per_key():
    rng = np.random.default_rng(5)
    keys_ = np.unique(rng.integers(0, 2**64, 200_000, dtype=np.uint64))
    rng.shuffle(keys_)
    idx = hashtable.KeyIndex()
    for lo in range(0, len(keys_), 7_000):
        idx.lookup_or_insert(keys_[lo:lo + 7_000])
    assert idx.size == len(keys_)
    np.testing.assert_array_equal(idx.lookup(keys_), np.arange(len(keys_)))
    assert idx.size <= hashtable.HASH_MAX_LOAD * idx.index.shape[0]
    # index: 4 bytes / load; keys: 8 bytes and at most 1.5x growth slack
    assert idx.nbytes() / idx.size <= 4 / (hashtable.HASH_MAX_LOAD / 2) + 8 * 1.5 + 1
    rebuilt = hashtable.KeyIndex.from_keys(idx.keys[: idx.size])
    np.testing.assert_array_equal(rebuilt.lookup(keys_), np.arange(len(keys_)))
    given = keys_.copy()  # (a restore's keys, given away: kept as the index's, not copied)
    owned = hashtable.KeyIndex.from_keys(given, own=True)
    assert owned.keys is given and np.shares_memory(owned.keys, given)
    np.testing.assert_array_equal(owned.lookup(keys_), np.arange(len(keys_)))
    np.testing.assert_array_equal(owned.lookup_or_insert(np.array([2**64 - 1, keys_[3]], dtype=np.uint64))[1], 3)


def test_lookup_or_insert_in_slot_order_gives_lookup_or_inserts_slots_whatever_the_order():
    rng = np.random.default_rng(8)
    held = np.unique(rng.integers(0, 2**64, 50_000, dtype=np.uint64))
    in_order = held[np.sort(rng.choice(held.shape[0], 20_000, replace=False))]  # (a delta's keys, with jumps)
    absent = rng.integers(0, 2**64, 500, dtype=np.uint64)
    for queries in (in_order, rng.permutation(in_order), np.concatenate([in_order[:9_000], absent, in_order[9_000:]]),
                    held[::-1].copy(), np.zeros(0, dtype=np.uint64)):
        a, b = hashtable.KeyIndex.from_keys(held), hashtable.KeyIndex.from_keys(held)
        np.testing.assert_array_equal(a.lookup_or_insert_in_slot_order(queries), b.lookup_or_insert(queries))
        np.testing.assert_array_equal(a.keys[: a.size], b.keys[: b.size])  # (the absent ones inserted alike)


def test_sequential_keys_spread_over_the_index():
    idx = hashtable.KeyIndex.from_keys(np.arange(100_000, dtype=np.uint64))
    occupied = (idx.index != hashtable.EMPTY).reshape(64, -1).sum(axis=1)
    assert occupied.max() < 1.2 * occupied.mean()


# -- 7. hashing ----------------------------------------------------------------------------------

def test_xxh64_known_answers_from_the_specification():
    def h(data: bytes, seed: int = 0) -> int:
        buf = np.frombuffer(data, dtype=np.uint8)
        return int(hashing.xxh64(buf, 0, len(buf), np.uint64(seed)))

    assert h(b"") == 0xEF46DB3751D8E999
    assert h(b"abc") == 0x44BC2CF5AD770999


@SETTINGS
@given(st.binary(max_size=200), st.integers(0, U64_MAX))
def test_xxh64_matches_the_reference_c_implementation(data, seed):
    xxhash = pytest.importorskip("xxhash")
    buf = np.frombuffer(data, dtype=np.uint8)
    assert int(hashing.xxh64(buf, 0, len(buf), np.uint64(seed))) == xxhash.xxh64_intdigest(data, seed=seed)


@SETTINGS
@given(st.binary(max_size=300), st.integers(0, U64_MAX))
def test_xxh64_over_words_equals_xxh64_over_bytes(data, seed):
    buf = np.frombuffer(data, dtype=np.uint8)
    whole = len(data) // 8 * 8
    words = np.frombuffer(data[:whole], dtype=np.uint64)
    tail = np.frombuffer(data[whole:], dtype=np.uint8)
    assert int(hashing.xxh64_words(words, tail, np.uint64(seed))) == int(hashing.xxh64(buf, 0, len(buf), np.uint64(seed)))


def test_feature_key_depends_on_field_and_token():
    assert hashing.feature_key(3, "abc") == hashing.feature_key(3, b"abc")
    assert hashing.feature_key(3, "abc") != hashing.feature_key(4, "abc")
    assert hashing.feature_key(3, "abc") != hashing.feature_key(3, "abd")


# -- 8. parsing ----------------------------------------------------------------------------------

def libsvm_lines():
    num = st.one_of(st.integers(-1000, 1000).map(str),
                    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32).map(repr))
    feat = st.tuples(st.integers(0, U64_MAX), num).map(lambda t: f"{t[0]}:{t[1]}")
    line = st.tuples(st.sampled_from(["1", "0", "-1", "+1", "0.5"]), st.lists(feat, max_size=8))
    return st.lists(line.map(lambda t: " ".join([t[0], *t[1]])), max_size=20)


@SETTINGS
@given(libsvm_lines(), st.sampled_from(["\n", "\r\n"]))
def test_libsvm_matches_python_parser(lines, eol):
    text = (eol.join(lines) + (eol if lines else "")).encode()
    labels, indptr, indices, values, skipped = parse.parse_libsvm(writable(text))
    rl, rp, ri, rv = ref.parse_libsvm(text.replace(b"\r", b""))
    np.testing.assert_array_equal(labels, rl)
    np.testing.assert_array_equal(indptr, rp)
    np.testing.assert_array_equal(indices, ri)
    np.testing.assert_allclose(values, rv, rtol=2e-7)
    assert skipped == 0


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300))
def test_count_bytes_counts_two_bytes_in_one_pass(data):
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    assert parse.count_bytes(buf, 10, 58) == (data.count(b"\n"), data.count(b":"))


@pytest.mark.parametrize("bad,reason", [
    (b"1 3:x", "bad number"), (b"x 3:1", "bad label"), (b"1 3", "expected index:value"),
    (b"1 -3:1", "bad feature index"), (b"1 18446744073709551616:1", "bad feature index"),
    (b"1 3:nan", "bad number"), (b"1 3:1e999", "value is NaN or infinite"), (b"1 3:1e39", "value is NaN or infinite"),
    (b"inf 3:1", "bad label"),
])
def test_libsvm_bad_line_names_file_and_line(bad, reason):
    text = b"1 1:1\n# comment\n0 2:2\n" + bad + b"\n1 4:4\n"
    with pytest.raises(parse.ParseError, match=rf"^data\.svm:4: {reason}") as e:
        parse.parse_libsvm(writable(text), source="data.svm")
    assert e.value.line == 4
    labels, indptr, _, _, skipped = parse.parse_libsvm(writable(text), skip_bad=True)
    assert skipped == 1 and list(labels) == [1, 0, 1]
    with pytest.raises(parse.ParseError, match=r"^big\.svm:1004:"):
        parse.parse_libsvm(writable(text), source="big.svm", first_line=1001)


def criteo_line(rng, label=None):
    ints = [str(int(x)) if rng.random() > 0.2 else "" for x in rng.integers(-3, 10**6, 13)]
    cats = [f"{int(x):08x}" if rng.random() > 0.2 else "" for x in rng.integers(0, 2**32, 26)]
    lab = str(int(rng.random() < 0.3)) if label is None else label
    return "\t".join([lab, *ints, *cats])


@pytest.mark.parametrize("bits", [24, 40, 64])
def test_criteo_matches_python_parser(bits):
    rng = np.random.default_rng(bits)
    text = ("\n".join(criteo_line(rng) for _ in range(300)) + "\n").encode()
    labels, indptr, indices, values, skipped = parse.parse_criteo(writable(text), bits=bits)
    rl, rp, ri = ref.parse_criteo(text, bits=bits)
    np.testing.assert_array_equal(labels, rl)
    np.testing.assert_array_equal(indptr, rp)
    np.testing.assert_array_equal(indices, ri)
    assert np.all(values == 1) and skipped == 0
    assert indices.max() < 2**bits if bits < 64 else True


def test_criteo_fields_and_bias_match_python_parser():
    # a key with its field above the hash bits, and the bias key after each row's own
    rng = np.random.default_rng(11)
    lines = [criteo_line(rng) for _ in range(200)]
    text = ("\n".join(lines) + "\n").encode()
    bits, bias = 20, 2**40 + 5
    labels, indptr, indices, _, _ = parse.parse_criteo(writable(text), bits=bits, fields=True, bias=bias)
    _, rp, ri = ref.parse_criteo(text, bits=bits)
    fields = [c - 1 for line in lines for c, col in enumerate(line.split("\t")) if c and col]
    expect = ri | (np.array(fields, dtype=np.uint64) << np.uint64(bits))
    got = np.delete(indices, indptr[1:] - 1)  # each row's last key is the bias
    np.testing.assert_array_equal(got, expect)
    assert np.all(indices[indptr[1:] - 1] == bias) and np.array_equal(indptr - np.arange(201), rp)


def test_criteo_crlf_blank_lines_and_tokens_of_any_length_match_python_parser():
    # the kernel reads a line in one pass (a column ends at a tab or the line's end), hashes
    # 8-byte tokens as one word, and looks small integers' buckets up in a table
    rng = np.random.default_rng(7)
    lines = []
    for i in range(400):
        cols = criteo_line(rng).split("\t")
        for c in range(14, 40):
            if cols[c] and rng.random() < 0.3:
                cols[c] = "x" * int(rng.integers(1, 40))
        for c in range(1, 14):
            if cols[c] and rng.random() < 0.1:
                cols[c] = str(int(rng.integers(4000, 5000)))  # around the table's end
        lines.append("\t".join(cols) + ("\r" if i % 3 == 0 else ""))
        if i % 50 == 0:
            lines.append("")
    text = ("\n".join(lines)).encode()  # no newline after the last line
    labels, indptr, indices, _, skipped = parse.parse_criteo(writable(text), bits=64)
    rl, rp, ri = ref.parse_criteo(text, bits=64)
    np.testing.assert_array_equal(labels, rl)
    np.testing.assert_array_equal(indptr, rp)
    np.testing.assert_array_equal(indices, ri)
    assert skipped == 0 and labels.shape[0] == 400


def vw_line(rng, label):
    spaces = []
    for ns in rng.choice(["f", "", "user", "ad"], size=int(rng.integers(1, 4)), replace=False):
        scale = f":{rng.choice([0.5, 2.0])}" if ns and rng.random() < 0.3 else ""
        feats = [f"k{int(x)}" + (f":{rng.normal():.4g}" if rng.random() < 0.3 else "")
                 for x in rng.integers(0, 10**6, int(rng.integers(0, 8)))]
        spaces.append(f"|{ns}{scale} " + " ".join(feats))
    head = label + (" 1" if rng.random() < 0.2 else "") + (" 'tag7" if rng.random() < 0.2 else "")
    return head + " " + " ".join(spaces)


@pytest.mark.parametrize("bits", [24, 64])
def test_vw_text_matches_python_parser(bits):
    rng = np.random.default_rng(bits)
    lines = [vw_line(rng, str(rng.choice(["1", "-1"]))) for _ in range(300)]
    lines[5] = "1 'only|f a b"   # a tag against the bar
    lines[9] = ""               # a blank line
    text = ("\n".join(lines) + "\n").encode()
    labels, indptr, indices, values, skipped = parse.parse_vw(writable(text), bits=bits, binary=True)
    rl, rp, ri, rv = ref.parse_vw(text, bits=bits, binary=True)
    np.testing.assert_array_equal(labels, rl)
    np.testing.assert_array_equal(indptr, rp)
    np.testing.assert_array_equal(indices, ri)
    np.testing.assert_allclose(values, rv, rtol=1e-6)
    assert skipped == 0 and set(np.unique(labels)) <= {0.0, 1.0}


@pytest.mark.parametrize("bad,reason", [
    ("1 |f a\n-1 0.5 |f a\n", "an importance weight other than 1"),
    ("1 |f a\n1 f a\n", "no '|'"),
    ("1 |f a\nx |f a\n", "bad label"),
    ("1 |f a\n1 |f a:zz\n", "bad number"),
    ("1 |f a\n2 |f a\n", "label must be 0 or 1"),
])
def test_vw_bad_line_names_file_and_line(bad, reason):
    with pytest.raises(parse.ParseError, match=rf"^train\.vw:2: {reason}"):
        parse.parse_vw(writable(bad.encode()), source="train.vw", binary=True)
    assert parse.parse_vw(writable(bad.encode()), binary=True, skip_bad=True)[4] == 1


def test_xxh64_of_a_word_equals_xxh64_of_its_bytes():
    rng = np.random.default_rng(3)
    for v, seed in zip(rng.integers(0, 2**63, 50, dtype=np.uint64), rng.integers(0, 2**63, 50, dtype=np.uint64)):
        buf = np.frombuffer(int(v).to_bytes(8, "little"), dtype=np.uint8)
        assert hashing.xxh64_u64(v, seed) == hashing.xxh64(buf, 0, 8, seed)


@pytest.mark.parametrize("bad", ["2\t" + "\t" * 38, "1\t" + "\t" * 37, "1\t" + "\t" * 39, "1\tx" + "\t" * 38])
def test_criteo_bad_line_names_line(bad):
    rng = np.random.default_rng(0)
    text = "\n".join([criteo_line(rng), criteo_line(rng), bad, criteo_line(rng)]).encode()
    with pytest.raises(parse.ParseError, match=r"^day_0\.tsv:3: "):
        parse.parse_criteo(writable(text), source="day_0.tsv")
    assert parse.parse_criteo(writable(text), skip_bad=True)[4] == 1


# -- 9. metrics ----------------------------------------------------------------------------------

@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20)), min_size=1, max_size=300))
def test_auc_exact_with_ties(pairs):
    labels = np.array([p[0] for p in pairs], dtype=np.float32)
    scores = np.array([p[1] for p in pairs], dtype=np.float64) / 4  # many ties
    got, want = metrics.auc(labels, scores), ref.auc(labels, scores)
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, abs=1e-12)
        # brute force over all pairs
        pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
        brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
        assert got == pytest.approx(brute, abs=1e-12)


def test_logloss_is_stable_for_large_margins():
    y = np.array([1, 0, 1, 0], dtype=np.float32)
    m = np.array([800.0, -800.0, -800.0, 800.0])
    assert metrics.logloss(y, m) == pytest.approx(ref.logloss(y, m)) == pytest.approx(400.0)


def test_auc_orders_negative_scores_and_signed_zeros():
    y = np.array([0, 1, 0, 1, 1, 0], dtype=np.float32)
    s = np.array([-3.5, -0.0, 0.0, 1e-300, -1e300, -2.0])
    assert metrics.auc(y, s) == pytest.approx(ref.auc(y, s))
    with pytest.raises(ValueError, match="NaN"):
        metrics.auc(y, np.array([0, 1, np.nan, 0, 0, 1.0]))


def test_nothing_is_compiled_at_import():
    """Importing the kernels, the library and the CLI compiles no kernel (each compiles, or loads
    from the cache, on its first call)."""
    import subprocess
    import sys
    code = (
        "import pkgutil, importlib, numba, hpcps_kernels, hpcps.cli, hpcps.train.loop, hpcps.ps.context, hpcps.ps.placement\n"
        "mods = [importlib.import_module('hpcps_kernels.' + m.name) for m in pkgutil.iter_modules(hpcps_kernels.__path__)]\n"
        "ds = [v for m in mods for v in vars(m).values() if isinstance(v, numba.core.registry.CPUDispatcher)]\n"
        "print(len(ds), sum(len(d.signatures) for d in ds))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n, compiled = map(int, out.stdout.split())
    assert n > 30 and compiled == 0


# -- capacity: an index is not capped at 2**27 keys --------------------------------------------------

def test_entry_format_widens_past_the_narrow_limit_without_allocating():
    assert hashtable.entry_format(hashtable.NARROW_MAX_KEYS) == (np.uint32, hashtable.TAG_BITS)
    assert hashtable.entry_format(hashtable.NARROW_MAX_KEYS + 1) == (np.uint64, hashtable.WIDE_TAG_BITS)
    assert hashtable.entry_format(10**12)[0] is np.uint64  # a trillion keys: memory is the limit
    with pytest.raises(OverflowError):
        hashtable.entry_format(hashtable.MAX_KEYS + 1)
    with pytest.raises(OverflowError):  # refused before anything is allocated
        hashtable.KeyIndex().reserve(2**60)


@pytest.mark.parametrize("how", ["insert", "from_keys"])
def test_index_widens_its_entries_and_keeps_every_key(monkeypatch, how):
    """The narrow limit lowered to 1000 keys: the same code path as at 2**27, on small arrays."""
    monkeypatch.setattr(hashtable, "NARROW_MAX_KEYS", 1000)
    keys = np.random.default_rng(3).integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True)
    keys = np.unique(keys)
    rng = np.random.default_rng(4)
    if how == "insert":
        idx = hashtable.KeyIndex()
        slots = np.concatenate([idx.lookup_or_insert(part) for part in np.array_split(keys, 7)])
        np.testing.assert_array_equal(slots, np.arange(keys.size))  # slots in insertion order
    else:
        idx = hashtable.KeyIndex.from_keys(keys)
    assert idx.wide and idx.index.dtype == np.uint64 and idx.size == keys.size
    probe = np.concatenate([keys, rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True)])
    expect = {int(k): s for s, k in enumerate(keys)}
    got = idx.lookup(probe)
    np.testing.assert_array_equal(got, [expect.get(int(k), -1) for k in probe])
    again = idx.lookup_or_insert(keys[::-1].copy())  # nothing new
    np.testing.assert_array_equal(again, np.arange(keys.size)[::-1])


# -- the direct index of bounded key spaces -----------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.integers(0, 2**12 - 1), st.integers(2**12, 2**64 - 1)), max_size=300),
                min_size=1, max_size=6))
def test_direct_index_gives_the_slots_a_hash_index_gives(batches):
    """Slots come in insertion order in both, so the same requests give the same slots."""
    d, h = directindex.DirectKeyIndex(12), hashtable.KeyIndex()
    for b in batches:
        q = np.array(b, dtype=np.uint64)
        np.testing.assert_array_equal(d.lookup(q), h.lookup(q))
        np.testing.assert_array_equal(d.lookup_or_insert(q), h.lookup_or_insert(q))
    assert d.size == h.size
    np.testing.assert_array_equal(d.keys[:d.size], h.keys[:h.size])
    again = directindex.DirectKeyIndex.from_keys(d.keys[:d.size].copy(), 12)
    allq = np.array(sum(batches, []) + [2**12 - 1, 2**64 - 1], dtype=np.uint64)
    np.testing.assert_array_equal(again.lookup(allq), h.lookup(allq))


def _rows_for(idx, width: int, pipelined: bool, rng) -> np.ndarray:
    """float32 rows of ``width`` for index ``idx``'s slots; ``pipelined``: more rows than used, so
    that the table outgrows CACHED_TABLE_BYTES and the fused kernels take their prefetch pipeline
    (else their plain loop, as the tables here are small)."""
    from hpcps_kernels.tuning import CACHED_TABLE_BYTES

    n = max(idx.key_capacity, CACHED_TABLE_BYTES // (4 * width) + 1 if pipelined else 0)
    return rng.normal(size=(n, width)).astype(np.float32)


def _index_of(kind: str, keys: list):
    """A direct index of 12 bits (keys above it in its overflow hash index) or a hash index,
    holding ``keys`` (distinct)."""
    idx = directindex.DirectKeyIndex(12) if kind == "direct" else hashtable.KeyIndex()
    idx.lookup_or_insert(np.unique(np.array(keys, dtype=np.uint64)))
    return idx


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**12 - 1), st.integers(2**12, 2**64 - 1)), max_size=300),
       st.lists(st.one_of(st.integers(0, 2**12 - 1), st.integers(2**12, 2**64 - 1)), max_size=300),
       st.sampled_from([(1, "zeros"), (3, "normal"), (2, "uniform")]), st.sampled_from(["direct", "hash"]),
       st.booleans())
def test_fused_pull_is_lookup_then_pull_rows_in_one_pass(stored, asked, dim_kind, index_kind, pipelined):
    """The fused pull of either index, in cache or pipelined: the same slots and the same bits as
    the two kernels, present keys (direct, overflow and hashed) and absent ones (their initial
    values) alike."""
    from hpcps_kernels import fused, init

    dim, kind = dim_kind
    d = _index_of(index_kind, stored)
    rows = _rows_for(d, 3 * dim, pipelined, np.random.default_rng(len(stored)))
    q = np.array(asked + stored[:50], dtype=np.uint64)
    out = np.full((q.size, dim), np.nan, np.float32)
    slots, absent = fused.index_pull(d, q, rows, dim, init.KINDS[kind], 0.1, 7, out)
    want_slots = d.lookup(q)
    assert absent == int((want_slots < 0).sum())
    want = np.empty((q.size, dim), np.float32)
    init.pull_rows(rows, want_slots, q, dim, init.KINDS[kind], 0.1, 7, want)
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(out, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**12 - 1), st.integers(2**12, 2**64 - 1)), max_size=300),
       st.lists(st.one_of(st.integers(0, 2**12 - 1), st.integers(2**12, 2**64 - 1)), max_size=300),
       st.sampled_from(["sgd", "adagrad", "ftrl", "adam"]), st.sampled_from([1, 3]),
       st.sampled_from(["direct", "hash"]), st.booleans())
def test_fused_push_is_lookup_then_the_rule_in_one_pass(stored, asked, rule_name, dim, index_kind, pipelined):
    """The fused push of either index, in cache or pipelined: up to the first absent key, the
    slots of a lookup and the bits of the rule's own kernel on them; the rows of the keys from
    there on are untouched."""
    from hpcps_kernels import fused

    rule = optim.get(rule_name)
    params = {**rule.params, "l2": 0.01}  # a non-zero of each argument the rules take
    d = _index_of(index_kind, stored)
    rng = np.random.default_rng(len(stored) + 7 * len(asked))
    rows = np.abs(_rows_for(d, rule.width(dim), pipelined, rng)) + np.float32(0.1)
    q = np.unique(np.array(asked + stored[:40], dtype=np.uint64))
    rng.shuffle(q)
    g = rng.normal(size=(q.size, dim)).astype(np.float32)
    want_slots = d.lookup(q)
    first_absent = int(np.argmax(want_slots < 0)) if (want_slots < 0).any() else q.size
    want = rows.copy()
    rule.apply(want, want_slots[:first_absent], g[:first_absent], params)
    slots = np.full(q.size, -2, np.int64)
    todo = fused.index_push(d, q, rows, g, rule.fused_rule(dim), rule.fused_params(params), slots)
    np.testing.assert_array_equal(todo, np.arange(first_absent, q.size))  # the positions not done
    done = first_absent
    np.testing.assert_array_equal(slots[:done], want_slots[:done])
    np.testing.assert_array_equal(rows.view(np.uint32), want.view(np.uint32))


def test_only_the_built_in_one_pass_rules_are_fused():
    assert [optim.get(n).fused_rule(1) for n in ("sgd", "adagrad", "ftrl", "adam")] == [
        optim.FUSED_SGD, optim.FUSED_ADAGRAD, optim.FUSED_FTRL, optim.FUSED_ADAM]
    assert optim.get("ftrl").fused_rule(optim.TWO_PASS_DIM) == -1  # the two-pass float32 loops
    mine = optim.Optimizer("mine", {"lr": 0.1}, optim.sgd, ("lr", "lr"))
    assert mine.fused_rule(1) == -1


def test_direct_index_overflow_grows_past_its_load():
    d = directindex.DirectKeyIndex(8)
    big = np.arange(2**40, 2**40 + 5000, dtype=np.uint64)   # all above 2**8: all overflow
    small = np.arange(256, dtype=np.uint64)
    slots = d.lookup_or_insert(np.concatenate([small, big]))
    np.testing.assert_array_equal(slots, np.arange(256 + 5000))
    assert d.n_over == 5000 and d.index.shape[0] >= 5000 / hashtable.HASH_MAX_LOAD
    np.testing.assert_array_equal(d.lookup(big[::-1].copy()), np.arange(256, 256 + 5000)[::-1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 30), st.integers(0, 2**64 - 1), st.integers(0, 50).map(lambda i: i << 20)),
                max_size=400))
def test_dedup_of_hashed_keys_gives_what_the_mixed_dedup_gives(xs):
    """``hashed`` only changes where a key sits in the scratch table, never the result: the same
    unique keys in the same order, the same positions, for any keys (structured ones too)."""
    k = np.array(xs, dtype=np.uint64)
    for got, want in zip(keys.dedup_keys(k, True), keys.dedup_keys(k)):
        np.testing.assert_array_equal(got, want)


def test_dedup_of_hashed_keys_grows_its_table_the_same_way():
    k = np.random.default_rng(5).integers(0, 2**24, 300_000).astype(np.uint64)  # > 64 k distinct: two doublings
    (u1, p1), (u2, p2) = keys.dedup_keys(k, True), keys.dedup_keys(k)
    assert u1.size > 2**16
    np.testing.assert_array_equal(u1, u2)
    np.testing.assert_array_equal(p1, p2)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 30), st.integers(0, 2**64 - 1)), max_size=400))
def test_dedup_keys_is_unique_keys_up_to_order(xs):
    k = np.array(xs, dtype=np.uint64)
    uniq, pos = keys.dedup_keys(k)
    np.testing.assert_array_equal(uniq[pos], k)                      # every key maps back
    assert len(set(uniq.tolist())) == uniq.size                       # distinct
    np.testing.assert_array_equal(np.sort(uniq), keys.unique_keys(k)[0])
    if k.size:  # first-seen order
        first = {}
        for i, x in enumerate(xs):
            first.setdefault(x, i)
        assert uniq.tolist() == sorted(first, key=first.get)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 30), st.integers(0, 2**64 - 1), st.integers(0, 50).map(lambda i: i << 20)),
                max_size=300),
       st.lists(st.one_of(st.integers(0, 30), st.integers(0, 2**64 - 1), st.integers(0, 50).map(lambda i: i << 20)),
                max_size=3000))
def test_member_mask_is_isin(xs, ys):
    """Keys (any, repeated) among members (any, repeated, more than a first scratch table holds),
    mixed or placed by their low bits: what ``np.isin`` says."""
    k, m = np.array(xs, dtype=np.uint64), np.array(ys, dtype=np.uint64)
    for hashed in (False, True):
        np.testing.assert_array_equal(keys.member_mask(k, m, hashed), np.isin(k, m))


@pytest.mark.parametrize("dim", [1, 3])
def test_split_by_bits_keeps_each_part_in_order(dim):
    rng = np.random.default_rng(dim)
    for n in (0, 1, 7, 8, 9, 1000):
        mask = rng.random(n) < 0.4
        slots = rng.permutation(5 * n + 1)[:n].astype(np.int64)
        grads = rng.normal(size=(n, dim)).astype(np.float32)
        got = keys.split_by_bits(np.packbits(mask, bitorder="little"), slots, grads)
        for a, b in zip(got, (slots[mask], grads[mask], slots[~mask], grads[~mask])):
            np.testing.assert_array_equal(a, b)


def test_profiler_prints_each_kernel_s_roofline_fraction_and_names_its_bound(capsys):
    """The kernels of issue 39's bar: each row carries its fraction of a roofline measured in the
    same run and the bound it is held to (no figure is asserted: timings are not tested)."""
    from hpcps_kernels import profiler

    args = ["bench", "--quick", "--rows", "4000", "--repeat", "1", "--json"]
    for k in ("fm", "metrics", "deep", "segment_reduce"):
        args += ["--kernel", k]
    assert profiler.main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    roof = rows[0]["roofline"]
    assert all(roof[k] > 0 for k in ("triad_gb_s", "sgemm_gflop_s", "softplus_m_s", "random_access_m_s"))
    bound = {r["kernel"].split("/")[0]: r for r in rows[1:] if r["bound"]}
    assert {"fm_grad", "logloss", "mlp fwd+bwd", "segment_reduce"} <= set(bound)
    for r in bound.values():
        assert r["roofline_fraction"] > 0 and r["speedup"] > 0
