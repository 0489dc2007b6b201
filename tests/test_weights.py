"""Unlabeled rows and weights (issue 38): ``hpcps predict`` and ``load_model`` read rows without
labels in every format and score them as the same rows with labels, bit for bit; training and
``hpcps eval`` refuse them, naming the file and line."""

from __future__ import annotations

import numpy as np
import pytest

import hpcps
from hpcps.train import data as tdata
from hpcps.train import synth
from hpcps_kernels import parse
from shared_runs import writable
from test_faults import job, sets


def strip_labels(path: str, fmt: str, out: str) -> str:
    """The rows of ``path`` without their labels, as a user's file to score would hold them:
    libsvm without its first token, Criteo without its first column (Criteo's own test files),
    VW from its ``|`` on."""
    with open(path) as f, open(out, "w") as g:
        for line in f:
            if fmt == "criteo":
                g.write(line.split("\t", 1)[1])
            elif fmt == "vw":
                g.write(line[line.index("|"):])
            else:
                g.write(line.split(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An LR model trained in one process on each format's file of one 3,000-row data set, and
    each format's test file without labels."""
    d = tmp_path_factory.mktemp("weights")
    info = synth.generate(str(d / "data"), 3_000, 500, fields=8, seed=11, formats=("libsvm", "criteo", "vw"))
    out = {}
    for fmt in ("libsvm", "criteo", "vw"):
        model = str(d / f"{fmt}.h5")
        rc, text = job(0, ["train", *sets(data__train=info.files[f"train_{fmt}"], train__epochs=1,
                                          train__progress=False, train__model_out=model)])
        assert rc == 0, text
        test = info.files[f"test_{fmt}"]
        out[fmt] = (model, test, strip_labels(test, fmt, str(d / f"unlabeled.{fmt}")))
    return out


@pytest.mark.parametrize("fmt", ["libsvm", "criteo", "vw"])
def test_predict_scores_rows_without_labels_as_the_same_rows_with_them(trained, fmt, tmp_path):
    model_path, labeled, unlabeled = trained[fmt]
    model = hpcps.load_model(model_path)
    assert np.array_equal(model.predict_proba(unlabeled), model.predict_proba(labeled))
    files = []
    for name, data in (("labeled", labeled), ("unlabeled", unlabeled)):
        files.append(tmp_path / f"{name}.txt")
        rc, out = job(0, ["predict", "--model", model_path, "--data", data, "--out", str(files[-1])])
        assert rc == 0, out
    assert files[0].read_bytes() == files[1].read_bytes() and len(files[0].read_text().splitlines()) == 500


@pytest.mark.parametrize("fmt", ["libsvm", "criteo", "vw"])
def test_training_and_eval_refuse_a_row_without_a_label_naming_its_line(trained, fmt, tmp_path):
    model_path, labeled, unlabeled = trained[fmt]
    mixed = tmp_path / f"mixed.{fmt}"
    lines = open(labeled).read().splitlines(keepends=True)
    mixed.write_text("".join(lines[:6]) + open(unlabeled).read().splitlines(keepends=True)[6] + "".join(lines[7:]))
    rc, out = job(0, ["train", *sets(data__train=str(mixed), data__format=fmt, train__epochs=1,
                                     train__progress=False)])
    assert rc == 2 and f"{mixed}:7: a row without a label" in out, out
    rc, out = job(0, ["eval", "--model", model_path, "--data", str(mixed)])
    assert rc == 2 and f"{mixed}:7: a row without a label" in out, out
    rc, out = job(0, ["predict", "--model", model_path, "--data", str(mixed), "--out", str(tmp_path / "p.txt")])
    assert rc == 0, out


CRITEO_LINE = "\t".join(["1", "", "3", "-1", "", "7", "100000"] + [""] * 7 + ["68fd1e64", "a", ""] + ["0123456789"] * 23)


@pytest.mark.parametrize("fmt,labeled,unlabeled", [
    ("libsvm", "1 3:1 7:0.5 qid:2\n-1 2:4\n", "3:1 7:0.5 qid:2\n2:4\n"),
    ("libffm", "1 0:3:1 2:7:0.5\n0 1:2:4\n", "0:3:1 2:7:0.5\n1:2:4\n"),
    ("vw", "1 |f a b:2 |g c\n-1 'tag|f d\n", "|f a b:2 |g c\n'tag|f d\n"),
    ("criteo", CRITEO_LINE + "\n" + CRITEO_LINE.replace("1", "0", 1) + "\r\n",
     CRITEO_LINE[2:] + "\n" + CRITEO_LINE[2:] + "\r\n"),
])
def test_a_line_without_a_label_parses_to_the_keys_of_the_line_with_one(fmt, labeled, unlabeled):
    reader = {"libsvm": parse.parse_libsvm, "libffm": parse.parse_libffm, "vw": parse.parse_vw,
              "criteo": parse.parse_criteo}[fmt]
    kw = {"bits": 24} if fmt != "libsvm" else {}
    want = reader(writable(labeled.encode()), **kw)
    got = reader(writable(unlabeled.encode()), need_labels=False, **kw)
    assert not got[0].any() and want[0].shape == got[0].shape == (2,)
    for a, b in zip(want[1:4], got[1:4]):
        assert np.array_equal(a, b)
    with pytest.raises(parse.ParseError, match="^t:1: a row without a label"):
        reader(writable(unlabeled.encode()), source="t", **kw)
    assert reader(writable(unlabeled.encode()), skip_bad=True, **kw)[4] == 2


def test_a_bad_criteo_line_keeps_the_error_of_its_40_columns():
    """A line read as 39 or 41 columns only when 40 fail: a bad label is still a bad label."""
    with pytest.raises(parse.ParseError, match="bad label"):
        parse.parse_criteo(writable(("2" + CRITEO_LINE[1:] + "\n").encode()), need_labels=False, with_weights=True)
    with pytest.raises(parse.ParseError, match="expected 40 tab-separated columns"):
        parse.parse_criteo(writable((CRITEO_LINE + "\tx\tx\n").encode()), need_labels=False, with_weights=True)


def test_load_part_reads_rows_without_labels_only_when_asked(trained, tmp_path):
    _, _, unlabeled = trained["libsvm"]
    ds = tdata.load_part(unlabeled, 0, 1, "libsvm", need_labels=False, cache_dir=str(tmp_path))
    assert ds.rows == 500 and not ds.labels.any()
    # (the reason once: its own ': ' made the line say it twice)
    with pytest.raises(tdata.DataError, match=r":1: a row without a label: training and evaluation need labels "
                                              r"\(hpcps predict reads rows without them\): '[^']+'$"):
        tdata.load_part(unlabeled, 0, 1, "libsvm", cache_dir=str(tmp_path))  # (not the unlabeled parse's cache)


# -- weights: a row of weight 2 trains as the row twice ---------------------------------------------

def weighted_copies(path: str, fmt: str, d) -> tuple[str, str]:
    """Two files of the rows of ``path``: every 7th row given weight 2 (VW: ``label 2 |...``;
    Criteo: a weight column after the label), and the same rows with every 7th row repeated."""
    weighted, repeated = d / f"weighted.{fmt}", d / f"repeated.{fmt}"
    with open(path) as f, open(weighted, "w") as w, open(repeated, "w") as r:
        for i, line in enumerate(f):
            twice = i % 7 == 0
            label, rest = line.split("\t" if fmt == "criteo" else " ", 1)
            sep = "\t" if fmt == "criteo" else " "
            w.write(f"{label}{sep}2{sep}{rest}" if twice else line)
            r.write(line * (2 if twice else 1))
    return str(weighted), str(repeated)


def model_tables(path: str) -> dict:
    from hpcps.train.model_file import ServingModel

    m = ServingModel(path)
    return {name: (t.keys, t.values) for name, t in m.tables.items()}


@pytest.mark.parametrize("kind,fmt,compute", [("lr", "vw", "workers"), ("fm", "criteo", "workers"),
                                              ("deepfm", "criteo", "workers"), ("ffm", "criteo", "workers"),
                                              ("fm", "vw", "servers")])
def test_a_weight_of_2_trains_as_the_row_repeated_under_bsp(kind, fmt, compute, tmp_path):
    """Under BSP, one step of plain SGD over every row (a batch as large as the file, 2 workers;
    DeepFM's MLP by SGD too): every row's gradient is taken at the same parameters, so the
    weighted file and the file with the rows repeated give the same model but for the order of
    float32 sums."""
    info = synth.generate(str(tmp_path / "data"), 700, 100, fields=6, seed=3, formats=(fmt,))
    files = {"plain": info.files[f"train_{fmt}"]}
    files["weighted"], files["repeated"] = weighted_copies(files["plain"], fmt, tmp_path)
    models = {}
    for name, path in files.items():
        models[name] = str(tmp_path / f"{name}.h5")
        rc, out = job(3, ["train", *sets(data__train=path, data__format=fmt, model__type=kind, model__factors=4,
                                         model__bias_init="zero", optimizer__name="sgd", cluster__staleness=0,
                                         model__hidden=[8], model__dense_optimizer="sgd", model__compute=compute,
                                         train__epochs=1, train__batch_size=1000, train__progress=False,
                                         train__model_out=models[name])])
        assert rc == 0, out
    plain, weighted, repeated = (model_tables(models[n]) for n in ("plain", "weighted", "repeated"))
    for name, (keys, values) in repeated.items():
        assert np.array_equal(weighted[name][0], keys)
        np.testing.assert_allclose(weighted[name][1], values, rtol=1e-5, atol=1e-7)
        assert not np.allclose(plain[name][1], values, rtol=1e-3, atol=1e-5)  # (the weights did something)


@pytest.mark.parametrize("fmt", ["vw", "criteo"])
def test_weights_come_through_streaming_shuffling_and_the_cache(fmt, tmp_path):
    info = synth.generate(str(tmp_path / "data"), 600, 10, fields=6, seed=4, formats=(fmt,))
    weighted, _ = weighted_copies(info.files[f"train_{fmt}"], fmt, tmp_path)
    whole = tdata.load_part(weighted, 0, 1, fmt, cache_dir=str(tmp_path / "cache"))
    assert whole.weights is not None and whole.weights.sum() == 600 + len(range(0, 600, 7))
    cached = tdata.load_part(weighted, 0, 1, fmt, cache_dir=str(tmp_path / "cache"))
    assert np.array_equal(cached.weights, whole.weights) and isinstance(cached.weights, np.memmap)
    stream = tdata.PartStream(weighted, 0, 1, fmt, block_bytes=1 << 12).open()
    got = [b for _, b in zip(range(7), stream.batches(97))]
    assert np.array_equal(np.concatenate([b.weights for b in got if b.rows]), whole.weights)
    shuffled = tdata.PartStream(weighted, 0, 1, fmt, block_bytes=1 << 12, shuffle_rows=50, shuffle_seed=1).open()
    b = next(shuffled.batches(600))
    order = tdata.window_order(600, 50, 1)
    assert np.array_equal(b.weights, whole.weights[order]) and np.array_equal(b.labels, whole.labels[order])
    plain = tdata.load_part(info.files[f"train_{fmt}"], 0, 1, fmt)
    assert plain.weights is None  # (every weight 1: the kernels' unweighted path)


# -- weighted metrics, scikit-learn's definitions -----------------------------------------------------

def test_weighted_metrics_are_scikit_learns():
    from sklearn.metrics import log_loss, roc_auc_score, root_mean_squared_error

    from hpcps_kernels import metrics

    rng = np.random.default_rng(5)
    y = (rng.random(4000) < 0.3).astype(np.float64)
    margins = np.round(rng.normal(size=4000) + y, 1)  # (rounded: many ties)
    w = rng.random(4000) * 3
    w[::11] = 0.0
    p = 1.0 / (1.0 + np.exp(-margins))
    assert metrics.auc(y, margins, w) == pytest.approx(roc_auc_score(y, margins, sample_weight=w), abs=1e-12)
    assert metrics.logloss(y, margins, w) == pytest.approx(log_loss(y, p, sample_weight=w), abs=1e-12)
    assert metrics.rmse(y, margins, w) == pytest.approx(root_mean_squared_error(y, margins, sample_weight=w), abs=1e-12)
    ones = np.ones(4000)  # weights of 1: exactly the unweighted figures
    assert metrics.auc(y, margins, ones) == metrics.auc(y, margins) and \
        metrics.logloss(y, margins, ones) == metrics.logloss(y, margins)
    assert np.isnan(metrics.auc(y, margins, np.where(y > 0, 0.0, 1.0)))  # (positives that weigh nothing)


def test_eval_weighs_the_rows_of_a_weighted_file(trained, tmp_path):
    import json

    from sklearn.metrics import log_loss, roc_auc_score

    model_path, labeled, _ = trained["vw"]
    weighted, _ = weighted_copies(labeled, "vw", tmp_path)
    rc, out = job(0, ["eval", "--model", model_path, "--data", weighted])
    assert rc == 0, out
    got = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    model = hpcps.load_model(model_path)
    p = model.predict_proba(labeled)[:, 1]
    y = tdata.load_part(labeled, 0, 1, "vw", binary=True).labels
    w = np.where(np.arange(500) % 7 == 0, 2.0, 1.0)
    assert got["auc"] == pytest.approx(roc_auc_score(y, p, sample_weight=w), abs=1e-9)
    assert got["logloss"] == pytest.approx(log_loss(y, p, sample_weight=w), abs=1e-6)
    assert got["auc"] != pytest.approx(roc_auc_score(y, p), abs=1e-9)


# -- the estimators' sample_weight ---------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: hpcps.SparseClassifier(model="fm", optimizer="sgd", epochs=1),
                                  lambda: hpcps.SparseRegressor(optimizer="sgd", epochs=1)], ids=["fm", "lr"])
def test_sample_weight_of_2_fits_as_the_row_repeated(make):
    import scipy.sparse as sp

    rng = np.random.default_rng(2)
    X = sp.random(300, 50, density=0.1, format="csr", random_state=2)
    y = (rng.random(300) < 0.4).astype(np.int64)
    twice = np.arange(300) % 5 == 0
    w = np.where(twice, 2.0, 1.0)
    rows = np.repeat(np.arange(300), w.astype(int))
    one_step = dict(batch_size=rows.shape[0])  # every row in one step, both ways
    weighted = make().set_params(**one_step).fit(X, y, sample_weight=w)
    repeated = make().set_params(**one_step).fit(X[rows], y[rows])
    np.testing.assert_allclose(weighted.coef_, repeated.coef_, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(weighted.intercept_, repeated.intercept_, rtol=1e-5)
    plain = make().set_params(**one_step).fit(X, y)
    assert not np.allclose(plain.coef_, repeated.coef_, rtol=1e-3, atol=1e-6)
    ones = make().set_params(**one_step).fit(X, y, sample_weight=np.ones(300))
    assert np.array_equal(ones.coef_, plain.coef_)  # (weights of 1: bit for bit the unweighted fit)
    again = make().set_params(**one_step)
    again.partial_fit(X, y, sample_weight=w, **({"classes": [0, 1]} if hasattr(again, "predict_proba") else {}))
    np.testing.assert_allclose(again.coef_, repeated.coef_, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="[Nn]egative"):
        make().fit(X, y, sample_weight=-w)
