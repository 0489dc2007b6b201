"""NumPy/SciPy reference implementations of every kernel, for the tests and the profiler.

Written for clarity, vectorised where NumPy allows, so that the profiler's speed-up compares
against what a competent NumPy user would write.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp
from scipy.special import expit
from scipy.stats import rankdata

from .hashing import xxh64


def unique_keys(keys):
    uniq, inv = np.unique(keys, return_inverse=True)
    return uniq, inv.reshape(-1)


def segment_reduce(keys, values):
    uniq, inv = np.unique(keys, return_inverse=True)
    out = np.zeros((uniq.shape[0], values.shape[1]), dtype=values.dtype)
    np.add.at(out, inv.reshape(-1), values)
    return uniq, out


def csr(indptr, pos, vals, ncols):
    """The batch as a canonical scipy CSR matrix (duplicates summed)."""
    m = sp.csr_matrix((vals.astype(np.float64), pos, indptr), shape=(len(indptr) - 1, ncols))
    m.sum_duplicates()
    return m


def _loss(m, y, loss):
    if loss == 0:
        return float(np.sum(np.logaddexp(0.0, m) - y * m)), expit(m) - y
    d = m - y
    return float(0.5 * np.sum(d * d)), d


def lr_forward_backward(indptr, pos, vals, labels, w, scale, l2, loss=0):
    X = csr(indptr, pos, vals, len(w))
    m = X @ w.astype(np.float64)
    total, g = _loss(m, labels.astype(np.float64), loss)
    grad = X.T @ (g * scale) + l2 * w
    return total, grad.astype(np.float32)


def fm_forward_backward(indptr, pos, vals, labels, w, V, scale, l2, loss=0):
    X = csr(indptr, pos, vals, len(w))
    X2 = X.multiply(X).tocsr()
    V64 = V.astype(np.float64)
    s = X @ V64
    m = X @ w.astype(np.float64) + 0.5 * (np.sum(s * s, axis=1) - (X2 @ (V64 * V64)).sum(axis=1))
    total, g = _loss(m, labels.astype(np.float64), loss)
    g = g * scale
    gw = X.T @ g + l2 * w
    gV = X.T @ (g[:, None] * s) - V64 * (X2.T @ g)[:, None] + l2 * V64
    return total, gw.astype(np.float32), gV.astype(np.float32), m


def ffm_pairs(indptr, fld):
    """The pairs ``(a, b)``, ``a < b``, of nonzeros of one row that both have a field (``fld >= 0``)."""
    lengths = np.diff(indptr)
    firsts, seconds = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for n in np.unique(lengths):
        starts = indptr[:-1][lengths == n]
        i, j = np.triu_indices(n, 1)
        firsts.append((starts[:, None] + i[None, :]).ravel())
        seconds.append((starts[:, None] + j[None, :]).ravel())
    a, b = np.concatenate(firsts), np.concatenate(seconds)
    keep = (fld[a] >= 0) & (fld[b] >= 0)
    return a[keep], b[keep]


def ffm_forward_backward(indptr, pos, fld, vals, labels, P, k, scale, l2, loss=0):
    """The field-aware FM: (summed loss, gradient like ``P``, margins), every pair of a row's
    nonzeros gathered at once and scattered back with ``np.add.at``."""
    rows, n = indptr.shape[0] - 1, P.shape[0]
    P64 = P.astype(np.float64)
    V = P64[:, 1:].reshape(n, -1, k)
    x = vals.astype(np.float64)
    row = np.repeat(np.arange(rows), np.diff(indptr))
    a, b = ffm_pairs(indptr, fld)
    va, vb = V[pos[a], fld[b]], V[pos[b], fld[a]]
    c = x[a] * x[b]
    m = (np.bincount(row, P64[pos, 0] * x, minlength=rows)
         + np.bincount(row[a], np.einsum("pk,pk->p", va, vb) * c, minlength=rows))
    total, g = _loss(m, labels.astype(np.float64), loss)
    g = g * scale
    G = np.zeros_like(P64)
    np.add.at(G[:, 0], pos, g[row] * x)
    GV = np.zeros_like(V)
    gc = (g[row[a]] * c)[:, None]
    np.add.at(GV, (pos[a], fld[b]), gc * vb)
    np.add.at(GV, (pos[b], fld[a]), gc * va)
    G[:, 1:] = GV.reshape(n, -1)
    return total, G + l2 * P64, m


def sgd(rows, slots, grads, lr, l2):
    dim = grads.shape[1]
    for i, s in enumerate(slots):
        w = rows[s, :dim].astype(np.float64)
        rows[s, :dim] = w - lr * (grads[i] + l2 * w)


def adagrad(rows, slots, grads, lr, eps, l2):
    dim = grads.shape[1]
    for i, s in enumerate(slots):
        w = rows[s, :dim].astype(np.float64)
        g = grads[i] + l2 * w
        rows[s, dim:2 * dim] = rows[s, dim:2 * dim] + g * g
        rows[s, :dim] = w - lr * g / (np.sqrt(rows[s, dim:2 * dim].astype(np.float64)) + eps)


def ftrl(rows, slots, grads, alpha, beta, l1, l2):
    """McMahan et al. 2013, Algorithm 1, line by line for each listed coordinate (w | z | n)."""
    dim = grads.shape[1]
    for i, s in enumerate(slots):
        for d in range(dim):
            g = float(grads[i, d])
            w, z, n = float(rows[s, d]), float(rows[s, dim + d]), float(rows[s, 2 * dim + d])
            sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / alpha
            z = z + g - sigma * w
            n = n + g * g
            rows[s, dim + d] = z
            rows[s, 2 * dim + d] = n
            z, n = float(rows[s, dim + d]), float(rows[s, 2 * dim + d])
            if abs(z) <= l1:
                rows[s, d] = 0.0
            else:
                rows[s, d] = -(z - np.sign(z) * l1) / ((beta + math.sqrt(n)) / alpha + l2)


def adam(rows, slots, grads, lr, beta1, beta2, eps, l2):
    """Kingma & Ba 2015, Algorithm 1, per row with its own step count t = number of its updates.

    ``t`` is recovered from the stored power ``beta1**t`` only to index the published formula."""
    dim = grads.shape[1]
    for i, s in enumerate(slots):
        t = round(math.log(float(rows[s, 3 * dim])) / math.log(beta1)) + 1
        rows[s, 3 * dim], rows[s, 3 * dim + 1] = beta1 ** t, beta2 ** t
        w = rows[s, :dim].astype(np.float64)
        g = grads[i] + l2 * w
        rows[s, dim:2 * dim] = beta1 * rows[s, dim:2 * dim] + (1 - beta1) * g
        rows[s, 2 * dim:3 * dim] = beta2 * rows[s, 2 * dim:3 * dim] + (1 - beta2) * g * g
        mhat = rows[s, dim:2 * dim].astype(np.float64) / (1 - beta1 ** t)
        vhat = rows[s, 2 * dim:3 * dim].astype(np.float64) / (1 - beta2 ** t)
        rows[s, :dim] = w - lr * mhat / (np.sqrt(vhat) + eps)


def auc(labels, scores):
    pos = labels > 0.5
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def logloss(labels, margins):
    m = np.asarray(margins, dtype=np.float64)
    return float(np.mean(np.logaddexp(0.0, m) - labels * m))


def parse_libsvm(text: bytes):
    labels, indptr, indices, values = [], [0], [], []
    for raw in text.split(b"\n"):
        line = raw.split(b"#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        labels.append(float(parts[0]))
        for tok in parts[1:]:
            k, v = tok.split(b":")
            if k == b"qid":
                continue
            indices.append(int(k))
            values.append(float(v))
        indptr.append(len(indices))
    return (np.array(labels, dtype=np.float32), np.array(indptr, dtype=np.int64),
            np.array(indices, dtype=np.uint64), np.array(values, dtype=np.float32))


def parse_vw(text: bytes, bits: int = 64, binary: bool = False):
    """Vowpal Wabbit text, line by line in Python (the grammar of :func:`parse.vw_kernel`)."""
    mask = (1 << bits) - 1
    labels, indptr, indices, values = [], [0], [], []
    for line in text.split(b"\n"):
        line = line.rstrip(b"\r")
        if not line.strip():
            continue
        head, *spaces = line.split(b"|")
        label = float(head.split()[0])
        labels.append(0.0 if binary and label == -1 else label)
        for space in spaces:
            ns, _, rest = space.partition(b" ") if not space[:1].isspace() else (b"", b"", space)
            name, _, scale = ns.partition(b":")
            seed = int(xxh64(np.frombuffer(name, np.uint8), 0, len(name), np.uint64(0)))
            for tok in rest.split():
                f, _, v = tok.partition(b":")
                indices.append(int(xxh64(np.frombuffer(f, np.uint8), 0, len(f), np.uint64(seed))) & mask)
                values.append(float(v or 1.0) * float(scale or 1.0))
        indptr.append(len(indices))
    return (np.array(labels, dtype=np.float32), np.array(indptr, dtype=np.int64),
            np.array(indices, dtype=np.uint64), np.array(values, dtype=np.float32))


def criteo_key(col: int, field: bytes) -> int:
    """The key of one non-empty Criteo column (1..39), as documented in :mod:`.parse`."""
    if col <= 13:
        v = int(field)
        b = v if v <= 2 else int(math.floor(math.log(v) ** 2))
        data = np.frombuffer(int(b).to_bytes(8, "little", signed=True), dtype=np.uint8)
        return int(xxh64(data, 0, 8, np.uint64(col - 1)))
    data = np.frombuffer(field, dtype=np.uint8)
    return int(xxh64(data, 0, len(field), np.uint64(col - 1)))


def parse_criteo(text: bytes, bits: int = 64):
    mask = (1 << bits) - 1
    labels, indptr, indices = [], [0], []
    for line in text.split(b"\n"):
        if not line:
            continue
        cols = line.rstrip(b"\r").split(b"\t")
        labels.append(float(cols[0]))
        for c in range(1, 40):
            if cols[c]:
                indices.append(criteo_key(c, cols[c]) & mask)
        indptr.append(len(indices))
    return (np.array(labels, dtype=np.float32), np.array(indptr, dtype=np.int64),
            np.array(indices, dtype=np.uint64))


# Vectorised forms of the update rules for rows listed once (what the profiler compares against;
# the loops above are the line-by-line transcriptions the tests use). A NumPy user would keep
# parameters and each state in separate arrays, so these take separate arrays.

def sgd_vectorized(w_, slots, grads, lr, l2):
    w = w_[slots].astype(np.float64)
    w_[slots] = w - lr * (grads + l2 * w)


def adagrad_vectorized(w_, acc, slots, grads, lr, eps, l2):
    w = w_[slots].astype(np.float64)
    g = grads + l2 * w
    a = acc[slots] + g * g
    acc[slots] = a
    w_[slots] = w - lr * g / (np.sqrt(a) + eps)


def ftrl_vectorized(w_, z, n, slots, grads, alpha, beta, l1, l2):
    g = grads.astype(np.float64)
    w = w_[slots].astype(np.float64)
    n_old = n[slots].astype(np.float64)
    n_new = n_old + g * g
    zz = z[slots] + g - (np.sqrt(n_new) - np.sqrt(n_old)) / alpha * w
    z[slots] = zz
    n[slots] = n_new
    w_[slots] = np.where(np.abs(zz) <= l1, 0.0,
                         -(zz - np.sign(zz) * l1) / ((beta + np.sqrt(n_new)) / alpha + l2))


def adam_vectorized(w_, m, v, t, slots, grads, lr, beta1, beta2, eps, l2):
    t[slots] += 1
    step = t[slots].astype(np.float64)[:, None]
    w = w_[slots].astype(np.float64)
    g = grads + l2 * w
    mm = beta1 * m[slots] + (1 - beta1) * g
    vv = beta2 * v[slots] + (1 - beta2) * g * g
    m[slots], v[slots] = mm, vv
    w_[slots] = w - lr * (mm / (1 - beta1 ** step)) / (np.sqrt(vv / (1 - beta2 ** step)) + eps)


def embed_pool(indptr, pos, keys, vals, E, shift, fields, skip_key):
    """Per-field pooled embeddings (rows x fields*k): one sparse product per field."""
    rows, k = indptr.shape[0] - 1, E.shape[1]
    field = (keys >> np.uint64(shift)).astype(np.int64) if shift < 64 else np.zeros(keys.shape[0], np.int64)
    keep = keys != np.uint64(skip_key)
    row = np.repeat(np.arange(rows), np.diff(indptr))
    out = np.zeros((rows, fields * k), dtype=np.float64)
    for f in range(fields):
        sel = keep & (field == f)
        X = sp.csr_matrix((vals[sel].astype(np.float64), (row[sel], pos[sel])), shape=(rows, E.shape[0]))
        out[:, f * k:(f + 1) * k] = X @ E.astype(np.float64)
    return out


def embed_scatter(indptr, pos, keys, vals, dx, shift, skip_key, n_rows, k):
    """The transpose of :func:`embed_pool` (``n_rows`` unique keys, ``k`` per field) with ``np.add.at``."""
    rows = np.repeat(np.arange(indptr.shape[0] - 1), np.diff(indptr))
    keep = keys != np.uint64(skip_key)
    field = (keys >> np.uint64(shift)).astype(np.int64) if shift < 64 else np.zeros(keys.shape[0], np.int64)
    cols = field[keep, None] * k + np.arange(k)[None, :]
    out = np.zeros((n_rows, k), dtype=dx.dtype)
    np.add.at(out, pos[keep], vals[keep, None] * dx[rows[keep, None], cols])
    return out


def mlp(params, n_in, hidden, x, activation="relu", dtype=np.float64):
    """An MLP's margins and, as a function of the margins' weights ``dout``, its gradients:
    returns (margins, grad(dout) -> (flat parameter gradient, input gradient)), in ``dtype``."""
    sizes = [n_in, *hidden, 1]
    p = params.astype(dtype)
    Ws, bs, at = [], [], 0
    for a, b in zip(sizes[:-1], sizes[1:]):
        Ws.append(p[at:at + a * b].reshape(a, b))
        bs.append(p[at + a * b:at + a * b + b])
        at += a * b + b
    act = (lambda z: np.maximum(z, 0.0)) if activation == "relu" else np.tanh
    dact = (lambda h: (h > 0).astype(np.float64)) if activation == "relu" else (lambda h: 1.0 - h * h)
    hs = [x.astype(dtype)]
    for W, b in zip(Ws[:-1], bs[:-1]):
        hs.append(act(hs[-1] @ W + b))
    margins = (hs[-1] @ Ws[-1] + bs[-1])[:, 0]

    def grad(dout):
        g = []
        d = dout.reshape(-1, 1).astype(dtype)
        for i in range(len(Ws) - 1, -1, -1):
            g.append((hs[i].T @ d).reshape(-1))
            g.append(d.sum(axis=0))
            d = d @ Ws[i].T
            if i > 0:
                d = d * dact(hs[i]).astype(dtype)
        flat = []
        for i in range(len(Ws)):  # back into layout order: W0, b0, W1, b1, ...
            flat += [g[2 * (len(Ws) - 1 - i)], g[2 * (len(Ws) - 1 - i) + 1]]
        return np.concatenate(flat), d

    return margins, grad


def fp16_bits(values):
    """float32 values as fp16 words, saturated at +-65504 (NumPy's rounding: nearest, ties to even)."""
    return np.clip(values, -65504, 65504).astype(np.float16).view(np.uint16)


def bf16_bits(values):
    """float32 values as bfloat16 words: the upper halves rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return rounded.astype(np.uint16)


def shard_of(keys, num_shards):
    """Each key's virtual shard, in Python integers (:func:`hpcps_kernels.hashing.shard_of`)."""
    from .hashing import SHARD_SALT, mix64
    return np.array([int(mix64(np.uint64(k) ^ SHARD_SALT)) % num_shards for k in keys], dtype=np.int64)


def push_slice(keys, num_shards, copies, num_servers):
    """Each key to every server of its shard's copies, the server's primaries first: (order,
    offsets), as :func:`hpcps_kernels.copies.push_slice`."""
    held = copies[shard_of(keys, num_shards)]  # (n, c): a key's copies on one row, primary first
    parts = [np.concatenate([np.flatnonzero(held[:, 0] == s), np.flatnonzero((held[:, 1:] == s).any(axis=1))])
             for s in range(num_servers)]
    return np.concatenate([np.zeros(0, np.int64), *parts]), np.cumsum([0] + [p.shape[0] for p in parts])


def primary_prefix(keys, num_shards, shard_server, server):
    """Where the keys ``server`` is primary of end, when they come first; else -1
    (:func:`hpcps_kernels.copies.primary_prefix`)."""
    mine = shard_server[shard_of(keys, num_shards)] == server
    m = int(mine.sum())
    return m if mine[:m].all() else -1


def split_primary(keys, grads, bits, num_shards, shard_server, server):
    """The part of a push ``server`` is primary of, then the rest (:func:`hpcps_kernels.copies.split_primary`)."""
    mine = shard_server[shard_of(keys, num_shards)] == server
    if bits.shape[0]:
        bits = np.packbits(np.unpackbits(bits, count=keys.shape[0], bitorder="little")[mine], bitorder="little")
    return keys[mine], grads[mine], bits, keys[~mine], grads[~mine]
