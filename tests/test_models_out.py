"""Models out (issue 38): ``hpcps.load_model`` scores in this process, no MPI, as ``hpcps predict``
does, on data files and on SciPy matrices; ``hpcps export --format text|npz`` writes a model's
tables for other tools, exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hpcps
from hpcps.config import ConfigError
from hpcps.train import synth
from hpcps.train.model_file import ServingModel
from test_estimator import read_libsvm
from test_faults import job, sets


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3,000-row data set, an LR and an FM model trained on its libsvm file in one process, and
    the FM run's checkpoint directory."""
    d = tmp_path_factory.mktemp("models_out")
    info = synth.generate(str(d / "data"), 3_000, 1_000, fields=8, seed=7, formats=("libsvm", "criteo"))
    out = {**info.files, "dir": d}
    for kind in ("lr", "fm"):
        out[kind] = str(d / f"{kind}.h5")
        extra = dict(checkpoint__dir=str(d / "ck")) if kind == "fm" else {}
        rc, text = job(0, ["train", *sets(data__train=info.files["train_libsvm"], train__epochs=1, train__progress=False,
                                          model__type=kind, train__model_out=out[kind], **extra)])
        assert rc == 0, text
    return out


def _libsvm_matrix(path: str, n_features: int = 1 << 24):
    """A libsvm file's rows as a CSR matrix whose column j is the feature index j, each row's
    entries in the file's order (read here by Python, not by hpcps), and its labels."""
    return read_libsvm(path, n_features)


@pytest.mark.parametrize("kind", ["lr", "fm"])
def test_load_model_scores_files_and_matrices_as_predict_does(trained, kind, tmp_path):
    model = hpcps.load_model(trained[kind])
    test = trained["test_libsvm"]
    margins = model.decision_function(test)
    X, y = _libsvm_matrix(test)
    assert np.array_equal(model.decision_function(X), margins)  # a matrix's rows are the file's rows, bit for bit
    proba = model.predict_proba(test)
    assert proba.shape == (1_000, 2) and np.allclose(proba.sum(axis=1), 1.0)
    assert np.array_equal(model.predict(X), (proba[:, 1] >= 0.5).astype(np.int64))
    scores = tmp_path / "scores.txt"
    rc, out = job(0, ["predict", "--model", trained[kind], "--data", test, "--out", str(scores)])
    assert rc == 0, out
    assert np.abs(np.loadtxt(scores) - proba[:, 1]).max() <= 5e-7  # (predict writes 6 decimals)
    from hpcps_kernels import metrics

    rc, out = job(0, ["eval", "--model", trained[kind], "--data", test])
    assert rc == 0, out
    evaluated = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert evaluated["auc"] == pytest.approx(metrics.auc(y, margins), abs=1e-12)
    assert 0.6 < evaluated["auc"] < 1.0  # (1 epoch on 3,000 rows: a weak but real model)


def test_load_model_refuses_what_it_cannot_do(trained, tmp_path):
    model = hpcps.load_model(trained["lr"])
    with pytest.raises(ConfigError, match="trained on libsvm rows"):
        model.rows_of_file(trained["test_criteo"])  # another format's keys
    bad = tmp_path / "bad.h5"
    raw = bytearray(open(trained["lr"], "rb").read())
    raw[-100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="damaged|checksum|HDF5"):
        hpcps.load_model(str(bad))
    with pytest.raises(FileNotFoundError):
        hpcps.load_model(str(tmp_path / "none.h5"))


def _read_text_model(path: str) -> tuple[dict, dict]:
    attrs, tables, name = {}, {}, None
    with open(path) as f:
        for line in f:
            if line.startswith("# table "):
                name = line[len("# table "):].split(":")[0]
                tables[name] = ([], [])
            elif line.startswith("# ") and " = " in line:
                k, v = line[2:].rstrip("\n").split(" = ", 1)
                attrs[k] = json.loads(v)
            elif not line.startswith("#"):
                key, values = line.rstrip("\n").split("\t")
                tables[name][0].append(int(key))
                tables[name][1].append([float(x) for x in values.split(" ")])
    return attrs, {n: (np.array(k, dtype=np.uint64), np.array(v, dtype=np.float32)) for n, (k, v) in tables.items()}


@pytest.mark.parametrize("kind", ["lr", "fm"])
def test_export_text_and_npz_hold_the_models_tables_exactly(trained, kind, tmp_path):
    model = ServingModel(trained[kind])
    text, npz = str(tmp_path / "m.txt"), str(tmp_path / "m.npz")
    for fmt, path in (("text", text), ("npz", npz)):
        rc, out = job(0, ["export", trained[kind], "--out", path, "--format", fmt])
        assert rc == 0 and f"({fmt})" in out, out
    attrs, tables = _read_text_model(text)
    arrays = np.load(npz)
    assert attrs["model"] == kind and json.loads(str(arrays["attrs"]))["model"] == kind
    assert list(tables) == list(model.tables)
    for name, t in model.tables.items():
        keys, values = tables[name]
        assert np.array_equal(keys, t.keys) and np.all(np.diff(keys.astype(np.float64)) > 0)
        assert np.array_equal(values, t.values.reshape(len(t.keys), -1))  # float32, bit for bit
        assert np.array_equal(arrays[f"{name}.keys"], t.keys) and np.array_equal(arrays[f"{name}.values"], t.values)
    width = len(tables[next(iter(tables))][1][0])
    assert width == 1 if kind == "lr" else width > 1  # (w, or w and the factors)


def test_export_from_a_checkpoint_and_what_it_refuses(trained, tmp_path):
    from hpcps.ps import checkpoint

    ck = checkpoint.complete_checkpoints(str(trained["dir"] / "ck"))[-1]
    npz = str(tmp_path / "ck.npz")
    rc, out = job(0, ["export", ck, "--out", npz, "--format", "npz"])
    assert rc == 0, out
    arrays, model = np.load(npz), ServingModel(trained["fm"])
    name = next(iter(model.tables))
    assert np.array_equal(arrays[f"{name}.keys"], model.tables[name].keys)  # the end's checkpoint is the model
    assert np.array_equal(arrays[f"{name}.values"], model.tables[name].values)
    rc, out = job(0, ["export", trained["lr"], "--out", str(tmp_path / "again.h5")])
    assert rc == 2 and "is a model file already" in out, out
    rc, out = job(0, ["export", trained["lr"], "--out", str(tmp_path / "t.txt"), "--format", "text", "--table", "nope"])
    assert rc == 2 and "no table 'nope'" in out, out
