"""Synthetic click-through data with known true weights, written as libsvm, Criteo TSV and VW text.

Rows have ``fields`` (≤ 39) fields: the first ``min(13, fields // 3)`` integer-valued, the rest
categorical, like Criteo. Each field's tokens are Zipf-distributed over a vocabulary whose size
ranges from 10 to 10**6 across fields, and each field is missing with its own probability. Every
feature (its Criteo key, so bucketed integers share a weight) has a true weight drawn from a
normal distribution by a hash of its key; the label is Bernoulli(sigmoid(bias + sum of weights
[+ pairwise interactions of six pairs of the fields with the smallest vocabularies])). Because the generator knows every row's true
probability, the best achievable test logloss and AUC are known and reported with the data.

The libsvm file holds each present feature as ``key:1`` with the key exactly as the Criteo parser
computes it, so the libsvm and Criteo files of one data set parse into the same batch.

``ratings`` makes explicit-feedback data for the squared loss: user and item ids (Zipf), rating =
3.5 + user bias + item bias + <user factors, item factors> + noise, clipped to [1, 5].
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from hpcps import outputs
from hpcps_kernels import init as kinit
from hpcps_kernels import metrics, textgen

WEIGHT_STD = 0.35
BIAS = -1.3
INTERACTION_DIM = 4
INTERACTION_STD = 0.45


@dataclass
class SynthInfo:
    rows: int
    test_rows: int
    fields: int
    interactions: bool
    hash_bits: int
    seed: int
    best_test_logloss: float
    best_test_auc: float
    positive_rate: float
    files: dict
    bytes: dict = field(default_factory=dict)  # each file's size when it was written
    reused: bool = False  # (not saved) generate found it already written

    def save(self, path: str) -> None:
        facts = asdict(self)
        del facts["reused"]
        _write_whole(path, outputs.dumps(facts, indent=1).encode())


EXTENSIONS = {"libsvm": ".svm", "criteo": ".tsv", "vw": ".vw"}  # the click data's files, by format
CLICK_PARAMS = ("rows", "test_rows", "fields", "interactions", "hash_bits", "seed")  # what makes its rows
HOW = "give another directory, or add --overwrite to replace them"  # (gen-data's way on)


class SynthError(ValueError):
    """A data set that cannot be written where it was asked (one line; exit status 2: the user
    must choose another directory or ask to replace what is there)."""

    exit_status = 2


def _generator_of(info) -> dict | None:
    """The generator and parameters an ``info.json`` (parsed) records, or None for one it cannot
    tell (not hpcps's, or the deep data's of before it recorded them)."""
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("generator"), dict):  # ratings and deep data
        return info["generator"]
    if "files" in info and "rows" in info:  # the click data (SynthInfo)
        return {"kind": "click", **{k: info.get(k) for k in CLICK_PARAMS}}
    return None


def _differences(there: dict, wanted: dict) -> str:
    """``rows 3000, not 100; seed 1, not 2``: the parameters in which ``there`` is not ``wanted``."""
    return "; ".join(f"{k} {there.get(k)}, not {wanted.get(k)}" for k in dict.fromkeys([*there, *wanted])
                     if there.get(k) != wanted.get(k))


def check_dir(out_dir: str, wanted: dict, writes: list[str], overwrite: bool = False,
              how: str = HOW) -> None:
    """Raise :class:`SynthError` when writing the data set ``wanted`` (its generator and parameters)
    into ``out_dir`` would replace another: an ``info.json`` of other parameters, or any file of
    ``writes`` (names in ``out_dir``) that no ``info.json`` of these parameters vouches for (the
    user's own data, say). The same data set is written again or reused: its rows depend only on
    its parameters. ``overwrite``: replace whatever is there. ``how``: the way on, for the line."""
    if overwrite or not os.path.isdir(out_dir):
        return
    info_path = os.path.join(out_dir, "info.json")
    info = None
    try:
        with open(info_path) as f:
            info = json.load(f)
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        info = "unreadable"
    there = _generator_of(info)
    if there == wanted:
        return
    hit = [p for p in [info_path] + [os.path.join(out_dir, w) for w in writes] if os.path.lexists(p)]
    if not hit:
        return
    what = ("files that no info.json of this data set vouches for" if not there else
            f"another kind of data set ({there.get('kind')}, not {wanted['kind']})" if there.get("kind") != wanted["kind"]
            else f"a data set wanted with other parameters ({_differences(there, wanted)})")
    raise SynthError(f"{out_dir} holds {what}: writing this one would replace {', '.join(hit)}; {how}")


def cache_dir() -> str:
    """Where a training job without data and without ``synth.dir`` keeps its generated data:
    ``$HPCPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/hpcps``, else ``~/.cache/hpcps``."""
    root = os.environ.get("HPCPS_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "hpcps")
    return root


def dir_name(rows: int, test_rows: int, fields: int, interactions: bool, seed: int, hash_bits: int) -> str:
    """The cache directory's name of one data set: its parameters, readable."""
    return f"synth-{rows}-{test_rows}-f{fields}{'-fm' if interactions else ''}-s{seed}-b{hash_bits}"


def bench_dir(out_dir: str, rows: int, test_rows: int, hash_bits: int) -> str:
    """Where a benchmark's click data (39 fields, seed 1) goes under its ``--dir``: a directory of
    its own named by its parameters (:func:`dir_name`), so that a benchmark with other rows
    never replaces, nor is refused by, what is there."""
    return os.path.join(out_dir, dir_name(rows, test_rows, 39, False, 1, hash_bits))


def _existing(out_dir: str, params: dict, formats) -> SynthInfo | None:
    """The data set already in ``out_dir`` if it has these parameters and every file of
    ``formats``, each of the size it was written with; None otherwise."""
    try:
        with open(os.path.join(out_dir, "info.json")) as f:
            info = SynthInfo(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None
    if any(getattr(info, k) != v for k, v in params.items()):
        return None
    for name in ("train", "test"):
        for fmt in formats:
            path = info.files.get(f"{name}_{fmt}")
            if not path or not os.path.isfile(path) or os.path.getsize(path) != info.bytes.get(path):
                return None
    info.reused = True
    return info


def _layout(fields: int):
    n_int = min(13, fields // 3)
    n_cat = fields - n_int
    cols = list(range(n_int)) + [13 + j for j in range(n_cat)]  # Criteo columns used
    vocab = np.geomspace(10, 1_000_000, fields).astype(np.int64)
    rng = np.random.default_rng(12345)
    vocab = vocab[rng.permutation(fields)]
    missing = rng.uniform(0.0, 0.2, fields)
    return n_int, n_cat, cols, vocab, missing


def _rows(n: int, fields: int, seed: int, hash_bits: int, interactions: bool):
    """(labels, true probabilities, ints, cats, present (n, 39), keys (n, 39))."""
    n_int, n_cat, cols, vocab, missing = _layout(fields)
    rng = np.random.default_rng(seed)
    tokens = (rng.zipf(1.25, size=(n, fields)) - 1) % vocab[None, :]
    present = np.zeros((n, 39), dtype=np.bool_)
    present[:, cols] = rng.random((n, fields)) >= missing[None, :]
    ints = np.zeros((n, 13), dtype=np.int64)
    ints[:, :n_int] = tokens[:, :n_int]
    cats = np.zeros((n, 26), dtype=np.int64)
    cats[:, :n_cat] = tokens[:, n_int:]
    mask = np.uint64(2**hash_bits - 1) if hash_bits < 64 else np.uint64(2**64 - 1)
    keys = textgen.criteo_keys(ints, cats, present, mask)
    flat = keys.reshape(-1)
    w = np.empty((flat.size, 1), dtype=np.float32)
    kinit.init_values(flat, 1, kinit.NORMAL, WEIGHT_STD, 7, w)
    margin = BIAS + (w.reshape(n, 39) * present).sum(axis=1, dtype=np.float64)
    if interactions:
        v = np.empty((flat.size, INTERACTION_DIM), dtype=np.float32)
        kinit.init_values(flat, INTERACTION_DIM, kinit.NORMAL, INTERACTION_STD, 11, v)
        v = v.reshape(n, 39, INTERACTION_DIM) * present[:, :, None]
        # six pairs of the fields with the smallest vocabularies interact (as user segment x ad
        # category would): pairs of rare tokens could not be learned from any amount of data
        small = [cols[f] for f in np.argsort(vocab, kind="stable")[:12]]
        for a, b in zip(small[0::2], small[1::2]):
            margin += np.einsum("rk,rk->r", v[:, a], v[:, b])
    p = 1.0 / (1.0 + np.exp(-margin))
    labels = (rng.random(n) < p).astype(np.float32)
    return labels, p, ints, cats, present, keys


def _write_whole(path: str, data) -> None:
    """Write ``data`` (bytes-like) to a temporary name, then rename (:func:`hpcps.outputs.replacing`):
    a job reading the file (another job generating the same data at the same time) sees it whole
    or not at all, and a failed write leaves no temporary file."""
    size = memoryview(data).nbytes
    with outputs.replacing(path, size) as tmp, open(tmp, "wb") as f:
        f.write(data)


def _write(path: str, writer, size_hint: int) -> None:
    buf = np.empty(size_hint, dtype=np.uint8)
    n = writer(buf)
    _write_whole(path, buf[:n].data)


def _write_all(prefix: str, labels, ints, cats, present, keys, formats) -> dict:
    n = labels.shape[0]
    files = {}
    if "libsvm" in formats:
        files["libsvm"] = prefix + EXTENSIONS["libsvm"]
        _write(files["libsvm"], lambda b: textgen.write_libsvm(labels, keys, present, 0, b), n * 39 * 24 + n * 4)
    if "criteo" in formats:
        files["criteo"] = prefix + EXTENSIONS["criteo"]
        _write(files["criteo"], lambda b: textgen.write_criteo(labels, ints, cats, present, b), n * (40 + 13 * 20 + 26 * 8))
    if "vw" in formats:
        files["vw"] = prefix + EXTENSIONS["vw"]
        _write(files["vw"], lambda b: textgen.write_vw(labels, keys, present, b), n * 39 * 23 + n * 8)
    return files


def generate(out_dir: str, rows: int, test_rows: int, fields: int = 39, interactions: bool = False,
             seed: int = 1, hash_bits: int = 24, formats=("libsvm", "criteo"), overwrite: bool = False,
             how: str = HOW) -> SynthInfo:
    """Write ``train.*`` and ``test.*`` in ``formats`` and ``info.json``; returns the info.

    When ``out_dir`` already holds this data set (same parameters, every file of ``formats`` whole),
    it is reused (``info.reused``) instead of written again: the rows depend only on the parameters.
    A directory that holds another data set, or files of the names it writes that no ``info.json``
    of these parameters vouches for, is refused (:func:`check_dir`, :class:`SynthError`) unless
    ``overwrite``. A failed write (a full disk) leaves nothing new behind (:func:`hpcps.outputs.making`).
    """
    params = {"rows": rows, "test_rows": test_rows, "fields": fields, "interactions": interactions,
              "hash_bits": hash_bits, "seed": seed}
    check_dir(out_dir, {"kind": "click", **{k: params[k] for k in CLICK_PARAMS}},
              [n + EXTENSIONS[f] for n in ("train", "test") for f in formats], overwrite, how)
    found = _existing(out_dir, params, formats) if os.path.isdir(out_dir) else None
    if found is not None:
        return found
    with outputs.making(out_dir):
        files = {}
        for name, n, s in (("train", rows, seed), ("test", test_rows, seed + 1_000_003)):
            labels, p, ints, cats, present, keys = _rows(n, fields, s, hash_bits, interactions)
            for fmt, path in _write_all(os.path.join(out_dir, name), labels, ints, cats, present, keys,
                                        formats).items():
                files[f"{name}_{fmt}"] = path
            if name == "test":
                margins = np.log(p) - np.log1p(-p)
                best_ll = metrics.logloss(labels, margins)
                best_auc = metrics.auc(labels, p)
                pos_rate = float(labels.mean())
        info = SynthInfo(rows, test_rows, fields, interactions, hash_bits, seed, best_ll, best_auc, pos_rate, files,
                         {p: os.path.getsize(p) for p in files.values()})
        info.save(os.path.join(out_dir, "info.json"))  # last: it marks the files whole
    return info


def _new_set(out_dir: str, generator: dict, writes: list[str], overwrite: bool, how: str, write) -> dict:
    """``write()`` a data set into ``out_dir`` (checked first, :func:`check_dir`; nothing left
    behind if it fails, :func:`hpcps.outputs.making`), then its ``info.json``: what ``write`` returns and
    ``generator`` (its kind and parameters)."""
    check_dir(out_dir, generator, writes, overwrite, how)
    with outputs.making(out_dir):
        out = write()
        _write_whole(os.path.join(out_dir, "info.json"), outputs.dumps({**out, "generator": generator}, indent=1).encode())
    return out


def ratings(out_dir: str, rows: int, test_rows: int, users: int = 5000, items: int = 2000,
            factors: int = 4, seed: int = 1, overwrite: bool = False, how: str = HOW) -> dict:
    """Explicit ratings as libsvm (``rating user:1 item:1``) and ``info.json``; returns the files
    and the best RMSE. Refuses a directory holding another data set (see :func:`generate`)."""
    generator = {"kind": "ratings", "rows": rows, "test_rows": test_rows, "users": users, "items": items,
            "factors": factors, "seed": seed}
    return _new_set(out_dir, generator, ["train.svm", "test.svm"], overwrite, how,
                    lambda: _ratings(out_dir, rows, test_rows, users, items, factors, seed))


def _ratings(out_dir: str, rows: int, test_rows: int, users: int, items: int, factors: int, seed: int) -> dict:
    out = {}
    for name, n, s in (("train", rows, seed), ("test", test_rows, seed + 7)):
        rng = np.random.default_rng(s)
        u = (rng.zipf(1.2, n) - 1) % users
        i = (rng.zipf(1.2, n) - 1) % items
        keys = np.stack([u.astype(np.uint64) * np.uint64(2) + np.uint64(1),          # odd keys: users
                         i.astype(np.uint64) * np.uint64(2) + np.uint64(2)], axis=1)  # even keys: items
        bias = np.empty((2 * n, 1), dtype=np.float32)
        kinit.init_values(keys.reshape(-1), 1, kinit.NORMAL, 0.4, 3, bias)
        fac = np.empty((2 * n, factors), dtype=np.float32)
        kinit.init_values(keys.reshape(-1), factors, kinit.NORMAL, 0.6, 5, fac)
        fac = fac.reshape(n, 2, factors)
        truth = 3.5 + bias.reshape(n, 2).sum(axis=1) + np.einsum("rk,rk->r", fac[:, 0], fac[:, 1])
        y = np.clip(truth + rng.normal(0, 0.5, n), 1, 5).astype(np.float32)
        path = os.path.join(out_dir, f"{name}.svm")
        present = np.ones((n, 2), dtype=np.bool_)
        _write(path, lambda b: textgen.write_libsvm(y, keys, present, 3, b), n * 64)
        out[name] = path
        if name == "test":
            out["best_rmse"] = float(np.sqrt(np.mean((np.clip(truth, 1, 5) - y) ** 2)))
    return out


DEEP_VOCAB = (4, 6, 8, 10, 30, 100, 1_000, 10_000)  # tokens per field of the deep data


def deep(out_dir: str, rows: int, test_rows: int, seed: int = 1, overwrite: bool = False,
         how: str = HOW) -> dict:
    """libffm data with a known nonlinear truth (``train.ffm``, ``test.ffm``, ``info.json``).

    Eight fields, each one token (Zipf over ``DEEP_VOCAB``; the last three fields are missing
    5 % of the time). The margin is ``-1 + sum_f w_f[t_f]`` (weights normal, std 0.3), plus the
    pairwise interactions ``<v_3, v_4> + <v_4, v_5>`` (factors of dimension 4, std 0.5), which an
    FM can learn and LR cannot, plus ``1.2 * (+1 if b_0 ^ b_1 ^ b_2 else -1)`` where ``b_f[t]`` is
    a random bit per token of the first three fields: a three-way parity, which no sum of
    pairwise terms can express and an MLP over the fields' embeddings can. The truth is the same
    for every seed (the seed draws the rows). Returns the files, the fields and the best
    achievable test logloss and AUC (of the true probabilities). Refuses a directory holding
    another data set (see :func:`generate`).
    """
    generator = {"kind": "deep", "rows": rows, "test_rows": test_rows, "seed": seed}
    return _new_set(out_dir, generator, ["train.ffm", "test.ffm"], overwrite, how,
                    lambda: _deep(out_dir, rows, test_rows, seed))


def _deep(out_dir: str, rows: int, test_rows: int, seed: int) -> dict:
    fields = len(DEEP_VOCAB)
    truth = np.random.default_rng(20261122)
    w = [truth.normal(0.0, 0.3, v) for v in DEEP_VOCAB]
    v = {f: truth.normal(0.0, 0.5, (DEEP_VOCAB[f], 4)) for f in (3, 4, 5)}
    bits = [truth.integers(0, 2, DEEP_VOCAB[f]) for f in range(3)]
    out = {"fields": fields}
    for name, n, s in (("train", rows, seed), ("test", test_rows, seed + 1_000_003)):
        rng = np.random.default_rng(s)
        tok = np.stack([(rng.zipf(1.3, n) - 1) % vocab for vocab in DEEP_VOCAB], axis=1)
        present = np.ones((n, fields), dtype=bool)
        present[:, 5:] = rng.random((n, fields - 5)) >= 0.05
        margin = np.full(n, -1.0)
        for f in range(fields):
            margin += np.where(present[:, f], w[f][tok[:, f]], 0.0)
        vv = {f: v[f][tok[:, f]] * present[:, f, None] for f in v}
        margin += np.einsum("rk,rk->r", vv[3], vv[4]) + np.einsum("rk,rk->r", vv[4], vv[5])
        parity = bits[0][tok[:, 0]] ^ bits[1][tok[:, 1]] ^ bits[2][tok[:, 2]]
        margin += 1.2 * (2.0 * parity - 1.0)
        p = 1.0 / (1.0 + np.exp(-margin))
        labels = (rng.random(n) < p).astype(np.int64)
        path = os.path.join(out_dir, f"{name}.ffm")
        _write_whole(path, "".join(f"{labels[r]} " + " ".join(f"{f}:{tok[r, f]}:1" for f in range(fields)
                                                              if present[r, f]) + "\n" for r in range(n)).encode())
        out[name] = path
        if name == "test":
            out["best_test_logloss"] = metrics.logloss(labels.astype(np.float64), margin)
            out["best_test_auc"] = metrics.auc(labels.astype(np.float64), margin)
    return out
