"""Standalone profiler of the kernels: ``python -m hpcps_kernels {warmup,bench,tuning}``.

``bench`` times every kernel on Criteo-shaped batches (39 nonzeros per row, Zipf-distributed
tokens per field, keys in a 2**24 or 2**40 space) beside its NumPy/SciPy reference, and beside the
roofline figures it measures in the same run on this machine:

* sequential read bandwidth (GB/s): one core summing a 512 MiB array;
* memory bandwidth (GB/s): a STREAM triad ``a = b + s * c`` over three 128 MiB arrays, counting
  the three arrays' bytes;
* random-access rate (M/s): one core gathering from a 512 MiB table at random positions;
* sgemm (GFLOP/s): one BLAS call multiplying float32 matrices of 1000 x 400 and 400 x 400 (the
  shape of the profiled MLP's largest product: the floor for its GEMMs);
* exp + log1p (M/s): the two libm calls of a stable softplus, per element of a cached array.

Each kernel's ``roof`` column is its fraction of the roofline that bounds it, computed from what
it must move or compute per item (its ``bound`` column names which: bytes at the triad's
bandwidth, random accesses at the gather rate measured on the kernel's own positions, flops at
sgemm's rate, softplus calls at libm's rate, a radix sort's passes). The probe of that bound
runs in turn with the kernel and its reference (:func:`median_times`), so that the machine's load
weighs on all three alike.

Figures are medians of ``--repeat`` runs after a warm-up call; speed-up = reference time / kernel
time from the same run. Single-threaded on purpose: parallelism comes from MPI ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from numba import njit

from . import (admission, copies, deep, directindex, ffm, fused, hashing, hashtable, init, keys, metrics, models, optim,
               parse, textgen, tuning, wire)
from . import reference as ref

ROOF_BYTES = 512 << 20
QUICK_BYTES = 32 << 20  # bench --quick's tables


# -- rooflines -------------------------------------------------------------------------------------

@njit(cache=True)
def _seq_read(a):
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(cache=True)
def _random_gather(table, idx):
    s = 0.0
    for i in range(idx.shape[0]):
        s += table[idx[i]]
    return s


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


@njit(cache=True)
def _triad(a, b, c, s):
    for i in range(a.shape[0]):
        a[i] = b[i] + s * c[i]


@njit(cache=True)
def _softplus_sum(x):
    s = 0.0
    for i in range(x.shape[0]):
        s += math.log1p(math.exp(-abs(x[i])))
    return s


def median_times(fns, repeat: int) -> list:
    """Medians of ``repeat`` timed runs of each of ``fns``, run in turn (a, b, c, a, b, c, ...)
    after a warm-up call of each: on a shared machine a change of load then slows them alike,
    and their ratios hold where separate medians would not."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [float(np.median(ts)) for ts in times]


def gather_probe(table, idx):
    """(a run, its count): gathering ``table[idx]``, the floor of a kernel that reads its model
    rows at those positions."""
    return (lambda: _random_gather(table, idx)), idx.shape[0]


def triad_probe(table_bytes: int = ROOF_BYTES):
    """(a run, its bytes): a STREAM triad over three float64 arrays of a quarter of
    ``table_bytes`` each (128 MiB)."""
    b, c = (np.ones(table_bytes // 32, dtype=np.float64) for _ in range(2))
    out = np.empty_like(b)
    return (lambda: _triad(out, b, c, 3.0)), 3 * b.nbytes


def sgemm_probe():
    """(a run, its flops): sgemm at the shape of the profiled MLP's largest product (1000 rows,
    400 x 400 weights)."""
    rng = np.random.default_rng(0)
    h, w = rng.normal(size=(1000, 400)).astype(np.float32), rng.normal(size=(400, 400)).astype(np.float32)
    return (lambda: h @ w), 2 * h.size * w.shape[1]


def softplus_probe():
    """(a run, its count): log1p(exp(-|x|)) over a cached array."""
    x = np.random.default_rng(0).normal(size=1 << 18) * 3
    return (lambda: _softplus_sum(x)), x.shape[0]


def rooflines(repeat: int, table_bytes: int = ROOF_BYTES) -> dict:
    """The machine's rooflines, for the header; a kernel's ``roof`` column is computed from the
    probe of its own bound, timed in turn with the kernel (:func:`median_times`). ``table_bytes``
    smaller than the default (``bench --quick``) makes a smoke run: the tables may fit a cache."""
    rng = np.random.default_rng(0)
    a = np.ones(table_bytes // 8, dtype=np.float64)
    t = median_time(lambda: _seq_read(a), repeat)
    seq = a.nbytes / t
    gather, n_gather = gather_probe(a, rng.integers(0, a.shape[0], (1 << 24) * table_bytes // ROOF_BYTES))
    t_ra = median_time(gather, repeat)
    del a, gather
    (triad, triad_bytes), (sgemm, flops), (softplus, n_sp) = triad_probe(table_bytes), sgemm_probe(), softplus_probe()
    t_tr, t_mm, t_sp = median_times([triad, sgemm, softplus], repeat)
    return {"seq_read_gb_s": seq / 1e9, "random_access_m_s": n_gather / t_ra / 1e6,
            "triad_gb_s": triad_bytes / t_tr / 1e9, "sgemm_gflop_s": flops / t_mm / 1e9,
            "softplus_m_s": n_sp / t_sp / 1e6, "table_mib": table_bytes >> 20}


# -- data ----------------------------------------------------------------------------------------

VOCAB = np.array([10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000,
                  3_000_000, 10_000_000] * 3)  # 39 fields of very different sizes


def criteo_batch(rows: int, bits: int, seed: int = 0):
    """A CSR batch shaped like Criteo: 39 nonzeros per row, Zipf tokens per field, hashed keys."""
    rng = np.random.default_rng(seed)
    tok = (rng.zipf(1.2, size=(rows, 39)) - 1) % VOCAB[None, :]
    raw = (np.arange(39, dtype=np.uint64)[None, :] << np.uint64(40)) ^ tok.astype(np.uint64)
    mixed = raw * np.uint64(0x9E3779B97F4A7C15)
    mixed ^= mixed >> np.uint64(29)
    idx = (mixed & np.uint64((1 << bits) - 1)).reshape(-1)
    indptr = np.arange(0, rows * 39 + 1, 39, dtype=np.int64)
    vals = np.ones(rows * 39, dtype=np.float32)
    labels = (rng.random(rows) < 0.25).astype(np.float32)
    return indptr, idx, vals, labels


def libsvm_text(indptr, idx, labels) -> bytes:
    lines = []
    for r in range(len(indptr) - 1):
        feats = " ".join(f"{k}:1" for k in np.unique(idx[indptr[r]:indptr[r + 1]]).tolist())
        lines.append(f"{int(labels[r])} {feats}")
    return ("\n".join(lines) + "\n").encode()


def criteo_text(rows: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    ints = rng.integers(0, 5000, (rows, 13))
    cats = (rng.zipf(1.2, size=(rows, 26)) - 1) % VOCAB[None, :26]
    out = []
    for r in range(rows):
        out.append("\t".join([str(int(rng.random() < 0.25)), *map(str, ints[r]), *(f"{c:08x}" for c in cats[r])]))
    return ("\n".join(out) + "\n").encode()


# -- benchmarks ----------------------------------------------------------------------------------

def _row(name, n, unit, t, t_ref=None, ref_name="", roof=None, extra=None, bound=""):
    r = {"kernel": name, "n": n, "unit": unit, "time_s": t, "rate": n / t,
         "ref": ref_name, "ref_time_s": t_ref, "speedup": (t_ref / t) if t_ref else None,
         "roofline_fraction": roof, "bound": bound}
    r.update(extra or {})
    return r


def bench_unique(rows, repeat, roof):
    out = []
    for bits in (24, 40):
        indptr, idx, vals, labels = criteo_batch(rows, bits)
        t = median_time(lambda: keys.unique_keys(idx), repeat)
        tr = median_time(lambda: np.unique(idx, return_inverse=True), repeat)
        out.append(_row(f"unique_keys/2^{bits}", idx.size, "keys", t, tr, "np.unique(return_inverse)"))
        t = median_time(lambda: keys.dedup_keys(idx), repeat)
        out.append(_row(f"dedup_keys/2^{bits}", idx.size, "keys", t, tr, "np.unique(return_inverse)"))
    # a push's keys among the next pull's (two consecutive 1000-row batches), and its split by them
    a, b = (keys.dedup_keys(criteo_batch(1000, 24, seed)[1], True)[0] for seed in (1, 2))
    t = median_time(lambda: keys.member_mask(a, b, True), repeat)
    tr = median_time(lambda: np.isin(a, b), repeat)
    out.append(_row(f"member_mask (u={a.size})", a.size, "keys", t, tr, "np.isin"))
    mask = keys.member_mask(a, b, True)
    bits, slots = np.packbits(mask, bitorder="little"), np.arange(a.size, dtype=np.int64)
    g = np.ones((a.size, 1), np.float32)
    t = median_time(lambda: keys.split_by_bits(bits, slots, g), repeat)
    tr = median_time(lambda: (slots[mask], g[mask], slots[~mask], g[~mask]), repeat)
    out.append(_row(f"split_by_bits (u={a.size})", a.size, "keys", t, tr, "boolean indexing"))
    return out


def bench_lr(rows, repeat, roof):
    out = []
    for bits in (24, 40):
        indptr, idx, vals, labels = criteo_batch(rows, bits)
        uniq, pos = keys.unique_keys(idx)
        w = np.random.default_rng(1).normal(size=len(uniq)).astype(np.float32) * 0.01
        g = np.empty_like(w)
        # two random accesses a nonzero (read w, add into grad) at the rate of gathering w[pos] alone
        gather, n_gather = gather_probe(w, pos)
        t, tr, t_ga = median_times([
            lambda: models.lr_forward_backward(indptr, pos, vals, labels, w, g, 1.0 / rows, 0.0, 0),
            lambda: ref.lr_forward_backward(indptr, pos, vals, labels, w, 1.0 / rows, 0.0), gather], repeat)
        ga = n_gather / t_ga / 1e6
        out.append(_row(f"lr_grad/2^{bits} (u={len(uniq)})", idx.size, "nnz", t, tr, "scipy CSR X@w, X.T@g",
                        2 * idx.size / t / 1e6 / ga, bound=f"2 random accesses/nnz, gather {ga:.0f} M/s"))
    # Roofline case: positions straight into a 2^26-entry weight vector (256 MiB, beyond any cache);
    # two random accesses per nonzero (read w, update grad). At least 200k rows, so the pass over
    # the nonzeros dwarfs the zeroing of the gradient buffer that is subtracted from it. Held
    # against the gather rate on a 512 MiB table: not run against a smaller one (``--quick``).
    if roof["table_mib"] << 20 < ROOF_BYTES:
        return out
    indptr, idx, vals, labels = criteo_batch(max(rows, 200_000), 26)
    pos = idx.astype(np.int64)
    w = np.zeros(1 << 26, dtype=np.float32)
    big_grad = np.zeros_like(w)

    def run():
        # lr_forward_backward zeroes the whole gradient buffer; time only the pass over nonzeros
        return models.lr_forward_backward(indptr, pos, vals, labels, w, big_grad, 1.0, 0.0, 0)

    t_zero = median_time(lambda: big_grad.fill(0.0), repeat)
    t = median_time(run, repeat) - t_zero
    rate = 2 * idx.size / t / 1e6
    out.append(_row("lr_grad/2^26 weights (256 MiB)", idx.size, "nnz", t, None, "",
                    rate / roof["random_access_m_s"], {"random_accesses_m_s": rate},
                    "2 random accesses/nnz, 512 MiB gather"))
    return out


def bench_fm(rows, repeat, roof):
    """The FM step beside its two floors, run in turn: the lines it must touch (a random gather of
    ``w``, ``V``'s row, ``gw`` and ``gV``'s row at each nonzero's position: its roofline) and its
    own work (the same rows on 2,048 keys, every parameter in L2). A row's gradients wait on its
    margin, and its margin on float64 sums kept in order (bit for bit), so the two add up rather
    than overlap: each is about half of its time."""
    rows = max(rows // 4, 1)
    indptr, idx, vals, labels = criteo_batch(rows, 24)
    uniq, pos = keys.unique_keys(idx)
    rng = np.random.default_rng(2)
    w = (0.01 * rng.normal(size=len(uniq))).astype(np.float32)
    V = (0.01 * rng.normal(size=(len(uniq), 8))).astype(np.float32)
    gw, gV, m = np.empty_like(w), np.empty_like(V), np.empty(0)
    # the same rows in cache: each row's nonzeros on consecutive positions (no key repeats in a row)
    near = np.arange(idx.size, dtype=np.int64) % 2048
    wc, Vc, gwc, gVc = w[:2048].copy(), V[:2048].copy(), gw[:2048].copy(), gV[:2048].copy()
    t, tr, t_lines, t_own = median_times([
        lambda: models.fm_forward_backward(indptr, pos, vals, labels, w, V, gw, gV, 1.0, 0.0, 0, m),
        lambda: ref.fm_forward_backward(indptr, pos, vals, labels, w, V, 1.0, 0.0),
        lambda: _fm_lines_gather(pos, w, V, gw, gV),
        lambda: models.fm_forward_backward(indptr, near, vals, labels, wc, Vc, gwc, gVc, 1.0, 0.0, 0, m)], repeat)
    n = idx.size
    return [_row("fm_grad/k=8", n, "nnz", t, tr, "scipy CSR (X@V, X.T@...)", t_lines / t,
                 bound=f"4 random lines/nnz {1e9 * t_lines / n:.0f} ns/nnz, then its own work "
                       f"{1e9 * t_own / n:.0f} ns/nnz in cache ({t_own / t:.0%})")]


@njit(cache=True)
def _fm_lines_gather(pos, w, V, gw, gV):
    """The four lines an FM nonzero touches (``w``, ``V``'s row, ``gw``, ``gV``'s row), read."""
    s = 0.0
    for i in range(pos.shape[0]):
        p = pos[i]
        s += w[p] + V[p, 0] + gw[p] + gV[p, 0]
    return s


def bench_ffm(rows, repeat, roof):
    """A field-aware FM's step (margins, loss, gradients) on Criteo-shaped rows: 39 fields, each
    key's field above bit 24, k = 4; its cost is per pair of a row's nonzeros (741 a row)."""
    rows = max(rows // 100, 1)
    indptr, idx, vals, labels = criteo_batch(rows, 24)
    fkeys = idx | (np.tile(np.arange(39, dtype=np.uint64), rows) << np.uint64(24))
    uniq, pos = keys.unique_keys(fkeys)
    fld = np.empty(fkeys.shape[0], np.int32)
    ffm.nonzero_fields(fkeys, 24, 39, np.uint64(2**63), fld)
    k = 4
    P = (0.01 * np.random.default_rng(7).normal(size=(uniq.shape[0], 1 + 39 * k))).astype(np.float32)
    G, m = np.empty_like(P), np.empty(0)
    t = median_time(lambda: ffm.ffm_forward_backward(indptr, pos, fld, vals, labels, P, G, k, 1.0, 0.0, 0, m), repeat)
    tr = median_time(lambda: ref.ffm_forward_backward(indptr, pos, fld, vals, labels, P, k, 1.0, 0.0), repeat)
    return [_row("ffm_grad/39 fields k=4", rows * 39 * 38 // 2, "pairs", t, tr, "NumPy pairs gathered, np.add.at")]


def bench_deep(rows, repeat, roof):
    """Per-field embedding pooling and its transpose (39 fields of k = 8, keys carrying their field
    above bit 24), and an MLP step (312 -> 400 -> 400 -> 1, ReLU, float32) on 1000-row batches."""
    rows = max(rows // 4, 1)
    indptr, idx, vals, labels = criteo_batch(rows, 24)
    idx = idx | (np.tile(np.arange(39, dtype=np.uint64), rows) << np.uint64(24))
    uniq, pos = keys.unique_keys(idx)
    k = 8
    rng = np.random.default_rng(3)
    E = rng.normal(size=(uniq.shape[0], k)).astype(np.float32)
    x = np.empty((rows, 39 * k), np.float32)
    skip = np.uint64(2**63)
    t = median_time(lambda: deep.embed_pool(indptr, pos, idx, vals, E, 24, 39, skip, x), repeat)
    tr = median_time(lambda: ref.embed_pool(indptr, pos, idx, vals, E, 24, 39, skip), repeat)
    out = [_row("embed_pool/39 fields k=8", idx.size, "nnz", t, tr, "scipy CSR per field")]
    gE = np.zeros_like(E)
    t = median_time(lambda: deep.embed_scatter(indptr, pos, idx, vals, x, 24, skip, gE), repeat)
    tr = median_time(lambda: ref.embed_scatter(indptr, pos, idx, vals, x, 24, skip, uniq.shape[0], k), repeat)
    out.append(_row("embed_scatter/39 fields k=8", idx.size, "nnz", t, tr, "np.add.at"))
    hidden = [400, 400]
    layers, size = deep.mlp_layout(39 * k, hidden)
    params = deep.mlp_init(39 * k, hidden, "relu", 0)
    xb = x[:1000].copy()
    dout = rng.normal(size=xb.shape[0]).astype(np.float32)
    grad = np.empty(size, np.float32)

    def step():
        _, hs = deep.mlp_forward(params, layers, xb, deep.RELU)
        deep.mlp_backward(params, layers, hs, dout, deep.RELU, grad)

    def step_ref():
        _, g = ref.mlp(params, 39 * k, hidden, xb, "relu", np.float32)
        g(dout)

    sgemm, sgemm_flops = sgemm_probe()
    t, tr, t_mm = median_times([step, step_ref, sgemm], repeat)
    # a multiply-add per weight and row forward, two backward (the weights' and the input's gradients)
    flops = 6 * xb.shape[0] * sum(a * b for _, a, b, _ in layers)
    peak = sgemm_flops / t_mm / 1e9
    out.append(_row("mlp fwd+bwd/312-400-400-1", xb.shape[0], "row", t, tr, "NumPy float32 (same BLAS)",
                    flops / t / 1e9 / peak, bound=f"{flops / 1e9:.2f} GFLOP at sgemm's {peak:.0f} GFLOP/s"))
    return out


def bench_segment_reduce(rows, repeat, roof):
    out = []
    for dim in (1, 16):
        r = rows if dim == 1 else max(rows // 8, 1)
        # four workers' pushes: each its batch's sorted unique keys with a gradient row per key
        parts = [keys.unique_keys(criteo_batch(r // 4, 24, seed=s)[1])[0] for s in range(4)]
        k = np.concatenate(parts)
        v = np.ones((k.size, dim), dtype=np.float32)
        pv = [(p, np.ones((p.size, dim), dtype=np.float32)) for p in parts]
        # one NumPy sort of the n keys: segment_reduce sorts n words (a key's varying bits above
        # its index) as much alike, then reads each key's row once in a pass summing the runs
        tr, t, t_sort = median_times([lambda: ref.segment_reduce(k, v), lambda: keys.segment_reduce(k, v),
                                      lambda: np.sort(k)], repeat)
        out.append(_row(f"segment_reduce/dim={dim} (any order)", k.size, "keys", t, tr, "np.unique + np.add.at",
                        t_sort / t, bound=f"a sort of {k.size} 64-bit words at NumPy's {k.size / t_sort / 1e6:.0f} M/s"))
        t = median_time(lambda: keys.merge_sorted(pv), repeat)
        out.append(_row(f"merge_sorted/dim={dim} (4 sorted)", k.size, "keys", t, tr, "np.unique + np.add.at"))
    return out


def bench_optim(rows, repeat, roof):
    rng = np.random.default_rng(3)
    n_rows = 10_000_000
    slots = np.unique(rng.integers(0, n_rows, rows * 8))
    rng.shuffle(slots)
    g = rng.normal(size=(slots.size, 1)).astype(np.float32)
    w = np.zeros((n_rows, 1), dtype=np.float32)
    s1, s2 = np.zeros_like(w), np.zeros_like(w)
    t_ = np.zeros(n_rows, dtype=np.float32)
    cases = [  # the registered rules (:data:`optim.REGISTRY`) with hyper-parameters, and a NumPy reference
        ("sgd", {"lr": 0.1, "l2": 0.0}, lambda: ref.sgd_vectorized(w, slots, g, 0.1, 0.0)),
        ("adagrad", {"lr": 0.1, "eps": 1e-8, "l2": 0.0}, lambda: ref.adagrad_vectorized(w, s1, slots, g, 0.1, 1e-8, 0.0)),
        ("ftrl", {"alpha": 0.1, "beta": 1.0, "l1": 1.0, "l2": 1.0},
         lambda: ref.ftrl_vectorized(w, s1, s2, slots, g, 0.1, 1.0, 1.0, 1.0)),
        ("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "l2": 0.0},
         lambda: ref.adam_vectorized(w, s1, s2, t_, slots, g, 0.01, 0.9, 0.999, 1e-8, 0.0)),
    ]
    out = []
    for name, params, rfn in cases:
        rule = optim.get(name)
        params = {**rule.params, **params}
        table = np.zeros((n_rows, rule.width(1)), dtype=np.float32)
        table[:, 1:] = rule.new_state(1, params)
        t = median_time(lambda: rule.apply(table, slots, g, params), repeat)
        tr = median_time(rfn, repeat)
        out.append(_row(f"{name}/10M rows", slots.size, "keys", t, tr, "vectorised NumPy, separate arrays",
                        slots.size / t / 1e6 / roof["random_access_m_s"]))
    # the rules on wide rows (an embedding or FM table, a dense chunk): their two-pass loops, per coordinate
    dim, n_wide = 64, 1 << 17
    sw = np.unique(rng.integers(0, n_wide, min(rows * 8, 100_000)))
    gw = rng.normal(size=(sw.size, dim)).astype(np.float32)
    ww, s1, s2 = (np.zeros((n_wide, dim), dtype=np.float32) for _ in range(3))
    acc = np.full((n_wide, dim), 0.1, dtype=np.float32)
    steps = np.zeros(n_wide, dtype=np.float32)
    wide = [
        ("ftrl", {"alpha": 0.1, "beta": 1.0, "l1": 1.0, "l2": 1.0},
         lambda: ref.ftrl_vectorized(ww, s1, s2, sw, gw, 0.1, 1.0, 1.0, 1.0)),
        ("adagrad", {"lr": 0.1, "eps": 1e-8, "l2": 0.0}, lambda: ref.adagrad_vectorized(ww, acc, sw, gw, 0.1, 1e-8, 0.0)),
        ("adam", {"lr": 0.01, "l2": 0.0},
         lambda: ref.adam_vectorized(ww, s1, s2, steps, sw, gw, 0.01, 0.9, 0.999, 1e-8, 0.0)),
    ]
    for name, params, rfn in wide:
        rule = optim.get(name)
        params = {**rule.params, **params}
        table = np.zeros((n_wide, rule.width(dim)), dtype=np.float32)
        table[:, dim:] = rule.new_state(dim, params)
        t = median_time(lambda: rule.apply(table, sw, gw, params), repeat)
        tr = median_time(rfn, repeat)
        out.append(_row(f"{name} dim {dim}/{n_wide} rows", sw.size * dim, "coords", t, tr,
                        "vectorised NumPy, separate arrays"))
        if name == "ftrl":  # a server's slots in a batch's key order: anywhere in the table
            shuffled = rng.permutation(sw)
            t = median_time(lambda: rule.apply(table, shuffled, gw, params), repeat)
            tr = median_time(lambda: ref.ftrl_vectorized(ww, s1, s2, shuffled, gw, 0.1, 1.0, 1.0, 1.0), repeat)
            out.append(_row(f"{name} dim {dim}/random slots", sw.size * dim, "coords", t, tr,
                            "vectorised NumPy, separate arrays"))
    return out


def bench_hashtable(rows, repeat, roof):
    n = 10_000_000
    rng = np.random.default_rng(4)
    k = np.unique(rng.integers(0, 2**64, int(n * 1.2), dtype=np.uint64))
    rng.shuffle(k)
    k, fresh = k[:n], k[n:]

    def insert_all():
        idx = hashtable.KeyIndex()
        for lo in range(0, n, 1_000_000):
            idx.lookup_or_insert(k[lo:lo + 1_000_000])
        return idx

    t_grow = median_time(insert_all, max(1, repeat // 2))
    idx = insert_all()
    # steady state at 10 M keys: batches of 1 M keys, 90 % already present, 10 % new
    batches = []
    for b in range(repeat + 1):
        mix = np.concatenate([k[rng.integers(0, n, 900_000)], fresh[b * 100_000:(b + 1) * 100_000]])
        rng.shuffle(mix)
        batches.append(mix)
    idx.reserve(n + len(batches) * 100_000)
    it = iter(batches)
    t_steady = median_time(lambda: idx.lookup_or_insert(next(it)), repeat)
    probe = k[rng.integers(0, n, 2_000_000)]
    t_look = median_time(lambda: idx.lookup(probe), repeat)
    sub = k[:1_000_000]
    t_dict = median_time(lambda: {key: i for i, key in enumerate(sub.tolist())}, 1) * (n / sub.size)
    d = {key: i for i, key in enumerate(sub.tolist())}
    probe_sub = probe[:200_000].tolist()
    t_dict_look = median_time(lambda: [d.get(x, -1) for x in probe_sub], repeat) * (probe.size / len(probe_sub))
    grown = insert_all()
    # payload of an FTRL table, dim 1: key 8 + weight 4 + z 4 + n 4 bytes; the table holds the
    # index and, per allocated slot, the key and the row
    payload = 8 + 4 + 4 + 4
    table_bytes = grown.index.nbytes + grown.key_capacity * payload
    extra = {"bytes_per_key": table_bytes / grown.size, "payload_bytes": payload,
             "bytes_ratio": table_bytes / grown.size / payload}
    return bench_direct_index(rng, repeat, roof) + [
        _row("hash lookup_or_insert/grow 0->10M", n, "keys", t_grow, t_dict, "Python dict", None, extra),
        _row("hash lookup_or_insert/at 10M", 1_000_000, "keys", t_steady, t_dict_look / 2, "Python dict",
             1e6 / t_steady / 1e6 / roof["random_access_m_s"]),
        _row("hash lookup/10M", probe.size, "keys", t_look, t_dict_look, "Python dict",
             probe.size / t_look / 1e6 / roof["random_access_m_s"])]


def bench_direct_index(rng, repeat, roof):
    """A server's pull and push on a direct index (hashed keys), each in one pass, against its
    lookup then the gather or the update rule; ``rng`` goes on from :func:`bench_hashtable`'s."""
    # a server's pull on a direct index (hashed keys): lookup and row gather fused, against the two
    # kernels one after the other; 1 M keys of 2**24 stored, Zipf batches of ~18 k distinct keys
    di = directindex.DirectKeyIndex(24)
    di.lookup_or_insert(np.sort(rng.choice(2**24, 1_000_000, replace=False)).astype(np.uint64))
    rows_ = np.zeros((di.key_capacity, 3), np.float32)
    zb = [np.unique(rng.zipf(1.1, 39_000) % (1 << 24)).astype(np.uint64) for _ in range(50)]
    nz = sum(q.size for q in zb)

    def pull_fused():
        for q in zb:
            fused.index_pull(di, q, rows_, 1, init.ZEROS, 0.0, 0, np.empty((q.size, 1), np.float32))

    def pull_two():
        for q in zb:
            init.pull_rows(rows_, di.lookup(q), q, 1, init.ZEROS, 0.0, 0, np.empty((q.size, 1), np.float32))

    t_pf, t_p2 = median_time(pull_fused, repeat), median_time(pull_two, repeat)
    # a server's push of keys no pull resolved: lookups and FTRL in one pass against the two kernels
    # (the batches' keys stored first: the fused pass stops at an absent key)
    for q in zb:
        di.lookup_or_insert(q)
    ftrl = optim.get("ftrl")
    hp, rule = ftrl.fused_params(ftrl.params), ftrl.fused_rule(1)
    frows = np.zeros((di.key_capacity, ftrl.width(1)), np.float32)
    zg = [np.ones((q.size, 1), np.float32) for q in zb]

    def push_fused():
        for q, gq in zip(zb, zg):
            fused.index_push(di, q, frows, gq, rule, hp, np.empty(q.size, np.int64))

    def push_two():
        for q, gq in zip(zb, zg):
            ftrl.apply(frows, di.lookup(q), gq, ftrl.params)

    t_uf, t_u2 = median_time(push_fused, repeat), median_time(push_two, repeat)
    return [_row("direct pull (lookup + gather)/Zipf", nz, "keys", t_pf, t_p2, "direct_lookup then pull_rows",
                 nz / t_pf / 1e6 / roof["random_access_m_s"]),
            _row("direct push (lookup + FTRL)/Zipf", nz, "keys", t_uf, t_u2, "direct_lookup then ftrl",
                 nz / t_uf / 1e6 / roof["random_access_m_s"])]


def bench_hashing(rows, repeat, roof):
    toks = [f"{x:08x}".encode() for x in np.random.default_rng(5).integers(0, 2**32, rows)]
    buf = np.frombuffer(b"".join(toks), dtype=np.uint8)
    starts = np.arange(0, 8 * rows, 8, dtype=np.int64)
    ends = starts + 8
    fields = (np.arange(rows) % 26).astype(np.uint64)
    t = median_time(lambda: hashing.hash_tokens(buf, starts, ends, fields), repeat)
    try:
        import xxhash

        f = xxhash.xxh64_intdigest
        tr = median_time(lambda: [f(tk, seed=int(s)) for tk, s in zip(toks, fields.tolist())], repeat)
        name = "xxhash (C) per token from Python"
    except ImportError:
        tr, name = None, ""
    return [_row("xxh64 tokens (8 B)", rows, "keys", t, tr, name)]


def bench_parse(rows, repeat, roof):
    indptr, idx, vals, labels = criteo_batch(max(rows // 4, 1), 24)
    text = libsvm_text(indptr, idx, labels)
    # the parsers on writable buffers, as the data loader calls them (bytes are read-only arrays:
    # another compilation of each parser, one that training never runs)
    buf = np.frombuffer(bytearray(text), np.uint8)
    t = median_time(lambda: parse.parse_libsvm(buf), repeat)
    try:
        import io

        from sklearn.datasets import load_svmlight_file

        tr = median_time(lambda: load_svmlight_file(io.BytesIO(text), n_features=1 << 24), repeat)
        name = "sklearn load_svmlight_file (Cython)"
    except ImportError:
        tr = median_time(lambda: ref.parse_libsvm(text), 1)
        name = "pure Python"
    out = [_row("parse libsvm", len(text) / 1e6, "MB", t, tr, name, len(text) / t / 1e9 / roof["seq_read_gb_s"])]
    ctext = criteo_text(max(rows // 8, 1))
    cbuf = np.frombuffer(bytearray(ctext), np.uint8)
    t = median_time(lambda: parse.parse_criteo(cbuf, bits=24), repeat)
    part = ctext[: ctext.rfind(b"\n", 0, len(ctext) // 10) + 1]
    tr = median_time(lambda: ref.parse_criteo(part, bits=24), 1) * (len(ctext) / len(part))
    out.append(_row("parse criteo tsv", len(ctext) / 1e6, "MB", t, tr, "Python split + xxh64"))
    return out


def bench_metrics(rows, repeat, roof):
    rng = np.random.default_rng(6)
    n = rows * 5
    y = (rng.random(n) < 0.25).astype(np.float32)
    s = rng.normal(size=n) + y
    t = median_time(lambda: metrics.auc(y, s), repeat)
    tr = median_time(lambda: ref.auc(y, s), repeat)
    softplus, n_sp = softplus_probe()
    t2, tr2, t_sp = median_times([lambda: metrics.logloss(y, s), lambda: ref.logloss(y, s), softplus], repeat)
    sp_rate = n_sp / t_sp / 1e6
    return [_row("auc", n, "rows", t, tr, "scipy rankdata"),
            _row("logloss", n, "rows", t2, tr2, "NumPy logaddexp", n / t2 / 1e6 / sp_rate,
                 bound=f"exp + log1p a row at libm's {sp_rate:.0f} M/s")]


BENCHES = {
    "unique": bench_unique, "lr": bench_lr, "fm": bench_fm, "segment_reduce": bench_segment_reduce,
    "optim": bench_optim, "hashtable": bench_hashtable, "hashing": bench_hashing, "parse": bench_parse,
    "metrics": bench_metrics, "deep": bench_deep, "ffm": bench_ffm,
}


def warmup() -> None:
    """Compile (or load from the cache) every kernel once, on tiny inputs."""
    warmup_models()
    warmup_data()



def warmup_models() -> None:
    """The training's and the server's kernels: keys, models, deep, optimizer rows in the index."""
    indptr, idx, vals, labels = criteo_batch(4, 24)
    uniq, pos = keys.unique_keys(idx)
    keys.dedup_keys(idx)
    keys.dedup_keys(idx, True)  # hashed features' keys
    w = np.zeros(len(uniq), dtype=np.float32)
    V = np.zeros((len(uniq), 2), dtype=np.float32)
    models.lr_forward_backward(indptr, pos, vals, labels, w, np.empty_like(w), 1.0, 0.0, 0)
    models.lr_predict(indptr, pos, vals, w, np.empty(4))
    row_ids = np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int32), np.diff(indptr))
    models.lr_partial_margins(pos, vals, row_ids, w, np.empty(indptr.shape[0] - 1))
    models.lr_residual_grads(pos, vals, row_ids, np.zeros(indptr.shape[0] - 1), np.empty_like(w))
    models.lr_residuals(np.zeros(indptr.shape[0] - 1), labels, 1.0, 0, np.empty(indptr.shape[0] - 1))
    nrows = indptr.shape[0] - 1
    P = np.zeros((len(uniq), 3), dtype=np.float32)  # the servers pass column views of their rows
    models.fm_partial_margins(pos, vals, row_ids, P[:, 0], P[:, 1:], np.empty((nrows, 4)))
    models.fm_residual_grads(pos, vals, row_ids, P[:, 1:], np.zeros((nrows, 3)), P[:, 0], P[:, 1:])
    models.fm_partial_margins(pos, vals, row_ids, w, V, np.empty((nrows, 4)))
    models.fm_residual_grads(pos, vals, row_ids, V, np.zeros((nrows, 3)), np.empty_like(w), np.empty_like(V))
    models.fm_residuals(np.zeros((nrows, 4)), labels, 1.0, 0, np.empty((nrows, 3)))
    models.fm_forward_backward(indptr, pos, vals, labels, w, V, np.empty_like(w), np.empty_like(V), 1.0, 0.0, 0, np.empty(4))
    pos32 = pos.astype(np.int32)  # a batch kept across epochs (hpcps.train.data.Dataset.compact)
    models.lr_forward_backward(indptr, pos32, vals, labels, w, np.empty_like(w), 1.0, 0.0, 0)
    models.fm_forward_backward(indptr, pos32, vals, labels, w, V, np.empty_like(w), np.empty_like(V), 1.0, 0.0, 0,
                               np.empty(4))
    # binary features (no values read) on the model's column views, at dedup's, a kept batch's
    # int32 and its uint16 positions
    W = np.zeros((len(uniq), 1), dtype=np.float32)
    for p in (pos, pos32, pos.astype(np.uint16)):
        models.lr_forward_backward(indptr, p, None, labels, W[:, 0], np.empty_like(W)[:, 0], 1.0, 0.0, 0)
    # the deep models: pooling and its transpose (a plain and a column-view embedding), the MLP
    fkeys = idx | np.uint64(1 << 30)
    x = np.empty((nrows, 2 * 2), np.float32)
    deep.embed_pool(indptr, pos, fkeys, vals, V, 30, 2, np.uint64(0), x)
    deep.embed_pool(indptr, pos, fkeys, vals, P[:, 1:], 30, 2, np.uint64(0), x)
    deep.embed_scatter(indptr, pos, fkeys, vals, x, 30, np.uint64(0), V)
    deep.embed_scatter(indptr, pos, fkeys, vals, x, 30, np.uint64(0), P[:, 1:])
    fld = np.empty(idx.shape[0], np.int32)  # the field-aware FM: each nonzero's field, margins, a step
    ffm.nonzero_fields(fkeys, 30, 2, np.uint64(0), fld)
    F = np.zeros((len(uniq), 1 + 2 * 2), np.float32)
    ffm.ffm_margins(indptr, pos, fld, vals, F, 2, np.empty(nrows))
    ffm.ffm_forward_backward(indptr, pos, fld, vals, labels, F, np.empty_like(F), 2, 1.0, 0.0, 0, np.empty(0))
    W1 = np.zeros((len(uniq), 1), np.float32)[:, 0]  # a wide table's column, as the deep models pass it
    models.lr_partial_margins(pos, vals, row_ids, W1, np.empty(nrows))
    models.lr_residual_grads(pos, vals, row_ids, np.zeros(nrows), W1)
    layers, size = deep.mlp_layout(4, [3])
    for act in ("relu", "tanh"):
        mp = deep.mlp_init(4, [3], act, 0)
        _, hs = deep.mlp_forward(mp, layers, x, deep.ACTIVATIONS[act])
        deep.mlp_backward(mp, layers, hs, np.ones(nrows, np.float32), deep.ACTIVATIONS[act], np.empty(size, np.float32))
    keys.segment_reduce(idx, np.ones((idx.size, 1), dtype=np.float32))
    keys.segment_reduce(idx, np.ones((idx.size, 3), dtype=np.float32))
    keys.segment_reduce(np.array([0, 2**64 - 1, 0], np.uint64), np.ones((3, 1), np.float32))  # keys too wide to pack
    keys.merge_sorted([(uniq, np.ones((uniq.size, 1), np.float32))] * 2)
    keys.is_sorted_unique(uniq)
    keys.reusable_slots(uniq, np.zeros(uniq.size, np.int64), uniq, np.empty(uniq.size, np.int64))
    keys.member_mask(uniq, uniq[::2].copy())
    keys.member_mask(uniq, uniq[::2].copy(), True)  # hashed features' keys
    for dim in (1, 3):  # a push split by the keys its pull reads
        keys.split_by_bits(np.packbits(np.ones(uniq.size, np.bool_)), np.zeros(uniq.size, np.int64),
                           np.ones((uniq.size, dim), np.float32))
    few = np.array([1, 2**40], dtype=np.uint64)
    admission.bump_counts(np.zeros(16, np.uint8), few, np.uint64(16), np.empty(2, np.uint8))
    admission.clear_counts(np.zeros(16, np.uint8), few, np.uint64(16))
    admission.admit_draw(few, 3, np.uint64(2**63), np.empty(2, np.bool_))
    warmup_server()


def warmup_server() -> None:
    """The server's kernels (part of :func:`warmup_models`): key indexes, fused pulls and pushes,
    placement, row initialisation, and the client's row scatter/gather."""
    ki = hashtable.KeyIndex()
    ki.lookup(ki.keys[:0].copy())
    ki.lookup_or_insert(np.arange(100, dtype=np.uint64))
    ki.lookup_or_insert_in_slot_order(np.arange(98, 103, dtype=np.uint64))  # (a delta snapshot's rows restored)
    hashtable.KeyIndex.from_keys(np.arange(10, dtype=np.uint64))
    di = directindex.DirectKeyIndex.from_keys(np.array([1, 2**40], dtype=np.uint64), 4)
    di.lookup(np.array([1, 3, 2**40], dtype=np.uint64))
    di.lookup_or_insert(np.array([5, 2**41], dtype=np.uint64))
    q3, q2 = np.array([1, 3, 2**40], dtype=np.uint64), np.array([1, 2**40], dtype=np.uint64)
    # (a push-pull's pulled keys follow its float32 gradients: 4 bytes off their alignment after an odd
    # number of them, a version of the pull of its own)
    q3u = np.zeros(3 * 8 + 4, np.uint8)[4:].view(np.uint64)
    for dim in (1, 3):  # a server's pull: LR and FM/embedding rows (one kernel, either index)
        for q in (q3, q3u):
            fused.index_pull(di, q, np.zeros((di.key_capacity, 3 * dim), np.float32), dim, init.NORMAL, 0.01, 0,
                             np.empty((3, dim), np.float32))
    g = np.ones((2, 1), dtype=np.float32)
    for rule in optim.REGISTRY.values():  # a server's push without a pull before it (one kernel)
        if rule.fused_rule(1) >= 0:
            fused.index_push(di, q2, np.ones((di.key_capacity, rule.width(1)), np.float32), g, rule.fused_rule(1),
                             rule.fused_params(rule.params), np.empty(2, np.int64))
    for rule in optim.REGISTRY.values():  # a push-pull to a pull's slots (ASP, SSP), keys either side aligned or not
        if rule.fused_rule(1) >= 0:
            rows = np.ones((di.key_capacity, rule.width(1)), np.float32)
            for got, pulled in ((q2, q2), (q2, q3u[:2]), (q3u[:2], q3u[:2]), (q3u[:2], q2)):
                fused.PUSH_PULL[rule.fused_rule(1)](di.direct, di.index, di.keys, di.tag_bits, rows, got,
                                                    np.zeros(2, np.int64), q2, g, pulled, init.NORMAL, 0.01, 0,
                                                    np.empty(2, np.int64), np.empty((2, 1), np.float32),
                                                    *rule.fused_params(rule.params))
    # the server: placement, row initialisation, pulls; the client's row scatter/gather
    k8 = np.arange(8, dtype=np.uint64)
    sl8 = np.arange(8, dtype=np.int64)
    table = np.zeros(64, dtype=np.int64)
    keys.group_by(hashing.server_of(k8, 64, table), 1)
    # replicas (cluster.replicas): a worker's push to every copy, a server's split of it
    copies.push_slice(k8, 64, np.zeros((64, 2), np.int64), 2)
    copies.split_primary(k8, np.ones((8, 1), np.float32), np.ones(1, np.uint8), 64, table, 0)
    copies.primary_prefix(k8, 64, table, 0)
    for kind in range(3):
        init.init_values(k8, 1, kind, 0.01, 0, np.empty((8, 1), np.float32))
        init.pull_rows(np.zeros((8, 3), np.float32), sl8, k8, 1, kind, 0.01, 0, np.empty((8, 1), np.float32))
        init.create_rows(np.zeros((8, 3), np.float32), sl8, k8, 0, 1, kind, 0.01, 0, np.zeros(2, np.float32))
    keys.gather_rows(np.zeros((8, 2), np.float32), sl8)
    keys.scatter_rows(np.zeros((8, 2), np.float32), sl8, np.zeros((8, 2), np.float32))
    keys.radix_argsort(k8.copy())
    # the traffic filters' 16-bit wire types (pushes and pulls both ways)
    f32 = np.ones(4, np.float32).view(np.uint32)
    wire.fp16_bits(f32, np.empty(4, np.uint16))
    wire.bf16_bits(f32, np.empty(4, np.uint16))
    wire.fp16_values(np.ones(4, np.uint16), np.empty(4, np.uint32))


def warmup_data() -> None:
    """Parsing, hashing, metrics, the update rules and the data generator."""
    indptr, idx, vals, labels = criteo_batch(4, 24)
    sl = np.array([0, 2], dtype=np.int64)
    g = np.ones((2, 1), dtype=np.float32)
    for rule in optim.REGISTRY.values():  # every registered update rule
        rule.apply(np.ones((3, rule.width(1)), np.float32), sl, g, rule.params)
    hashing.feature_key(1, b"x")
    # parsing, as the data loader calls it: on writable buffers (a bytearray's view)
    text = np.frombuffer(bytearray(b"1 1:1\n"), dtype=np.uint8)
    parse.parse_libsvm(text)
    parse.parse_libsvm(text, binary=True)
    parse.parse_vw(np.frombuffer(bytearray(b"1 |f a\n"), dtype=np.uint8), binary=True, bias=1, bits=24)
    parse.parse_libffm(np.frombuffer(bytearray(b"1 0:1:1\n"), dtype=np.uint8), binary=True, bias=1, bits=24)
    parse.count_byte(np.zeros(3, np.uint8), 10)
    parse.append_feature(indptr, idx, vals, np.uint64(1), np.float32(1.0))
    parse.parse_criteo(np.frombuffer(bytearray(b"1" + b"\t" * 39 + b"\n"), dtype=np.uint8), bits=24)
    parse.parse_criteo(np.frombuffer(bytearray(b"1" + b"\t" * 39 + b"\n"), dtype=np.uint8), bits=24, fields=True)
    hashing.xxh64(np.zeros(40, np.uint8), 0, 40, np.uint64(0))
    hashing.xxh64_words(np.zeros(5, np.uint64), np.zeros(3, np.uint8), np.uint64(0))
    hashing.xxh64_words(np.frombuffer(bytes(40), np.uint64), np.frombuffer(bytes(3), np.uint8), np.uint64(0))  # mmap
    # metrics, as evaluation calls them (float64 labels and margins)
    y = labels.astype(np.float64)
    metrics.auc(labels, y)
    metrics.auc(y, y)
    metrics.logloss(labels, y)
    metrics.logloss(y, y)
    hashing.shard_of(np.arange(8, dtype=np.uint64), 64)
    # the synthetic data generator
    ints = np.zeros((2, 13), np.int64)
    cats = np.zeros((2, 26), np.int64)
    present = np.ones((2, 39), np.bool_)
    kk = textgen.criteo_keys(ints, cats, present, np.uint64(2**24 - 1))
    out = np.empty(4096, np.uint8)
    textgen.write_libsvm(labels[:2].copy(), kk, present, 0, out)
    textgen.write_vw(labels[:2].copy(), kk, present, out)
    textgen.write_criteo(labels[:2].copy(), ints, cats, present, out)
    # the profiler's own hashing benchmark
    tokens = np.frombuffer(bytearray(b"abcdef"), dtype=np.uint8)
    hashing.hash_tokens(tokens, np.array([0, 3], np.int64), np.array([3, 6], np.int64), np.array([0, 1], np.uint64))


WARMUP_PARTS = {"models": warmup_models, "data": warmup_data}  # disjoint sets of kernels, for `warmup --jobs 2`


def _kernel_dispatchers() -> list:
    """Every kernel's dispatcher in this package (the compiled functions its modules define)."""
    from numba.core.registry import CPUDispatcher

    mods = (admission, copies, deep, directindex, hashing, hashtable, init, keys, metrics, models, optim, parse,
            textgen)
    return [obj for mod in mods for obj in vars(mod).values()
            if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__]


def _warmup_command(part: str | None, jobs: int) -> int:
    """``warmup``: with ``jobs`` > 1 the parts compile in that many processes at once (the
    kernels of one part are not the other's, so no two processes write one kernel's cache index);
    then this process runs the whole warm-up, which loads everything from the cache and compiles
    whatever a process missed (a kernel called from both parts, say), and says how many."""
    t = time.perf_counter()
    if part:
        WARMUP_PARTS[part]()
        return 0
    if jobs > 1:
        import subprocess

        procs = [subprocess.Popen([sys.executable, "-m", "hpcps_kernels", "warmup", "--part", p])
                 for p in WARMUP_PARTS]
        if any(p.wait() != 0 for p in procs):
            return 1
    t_parts = time.perf_counter() - t
    warmup()
    again = sum(sum(d.stats.cache_misses.values()) for d in _kernel_dispatchers())
    if jobs > 1:
        print(f"hpcps_kernels: kernels compiled in {len(WARMUP_PARTS)} processes in {t_parts:.1f} s, then loaded "
              f"in {time.perf_counter() - t - t_parts:.1f} s ({again} compiled again)")
    else:
        print(f"hpcps_kernels: kernels compiled/loaded in {time.perf_counter() - t:.1f} s ({again} compiled)")
    return 0


def _fmt(r, roof) -> str:
    rate = r["rate"]
    unit = r["unit"]
    if unit == "MB":
        rate_s = f"{rate:8.1f} MB/s"
    else:
        rate_s = f"{rate / 1e6:8.2f} M{unit}/s"
    sp = f"{r['speedup']:7.1f}x" if r["speedup"] else "      - "
    rf = f"{100 * r['roofline_fraction']:5.0f}%" if r["roofline_fraction"] is not None else "    -"
    extra = ""
    if "bytes_per_key" in r:
        extra = f"  {r['bytes_per_key']:.1f} B/key = {r['bytes_ratio']:.2f}x payload"
    if "random_accesses_m_s" in r:
        extra = f"  {r['random_accesses_m_s']:.0f} M random accesses/s"
    ref_t = f"{r['ref_time_s'] * 1e3:9.1f}" if r["ref_time_s"] else "        -"
    bound = f"  [bound: {r['bound']}]" if r.get("bound") else ""
    return f"{r['kernel']:<34} {r['time_s'] * 1e3:9.2f} {rate_s}  {ref_t} {sp} {rf}  {r['ref']}{extra}{bound}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcps_kernels", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmup", help="compile every kernel once into the numba cache")
    w.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes compiling at once, each a disjoint set of kernels (default: 2, or 1 on one core)")
    w.add_argument("--part", choices=WARMUP_PARTS, help=argparse.SUPPRESS)  # one process's share
    b = sub.add_parser("bench", help="time every kernel beside its reference and this machine's rooflines")
    b.add_argument("--kernel", choices=sorted(BENCHES), action="append", help="only these (repeatable)")
    b.add_argument("--rows", type=int, default=200_000, help="rows of the Criteo-shaped batch (39 nnz each)")
    b.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median reported)")
    b.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    b.add_argument("--quick", action="store_true",
                   help=f"a smoke run (the tests'): rooflines on {QUICK_BYTES >> 20} MiB instead of {ROOF_BYTES >> 20} "
                        "MiB (figures not comparable), no 2^26-weight LR case")
    sub.add_parser("tuning", help="the tuned knobs, their values and overrides (the table of docs/tuning.md)")
    args = ap.parse_args(argv)
    if args.cmd == "tuning":
        sys.stdout.write(tuning.markdown())
        return 0
    if args.cmd == "warmup":
        return _warmup_command(args.part, args.jobs)
    roof = rooflines(args.repeat, QUICK_BYTES if args.quick else ROOF_BYTES)
    if args.json:
        print(json.dumps({"roofline": roof}))
    else:
        print(f"rooflines (1 core): sequential read {roof['seq_read_gb_s']:.1f} GB/s, "
              f"random access {roof['random_access_m_s']:.0f} M/s ({roof['table_mib']} MiB table), triad {roof['triad_gb_s']:.1f} GB/s, "
              f"sgemm {roof['sgemm_gflop_s']:.0f} GFLOP/s, exp + log1p {roof['softplus_m_s']:.0f} M/s")
        print(f"{'kernel':<34} {'ms':>9} {'throughput':>13}  {'ref ms':>9} {'speedup':>8} {'roof':>5}  reference")
    for name in args.kernel or list(BENCHES):
        for r in BENCHES[name](args.rows, args.repeat, roof):
            print(json.dumps(r) if args.json else _fmt(r, roof), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
