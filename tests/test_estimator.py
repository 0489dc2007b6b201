"""The scikit-learn estimators (hpcps.SparseClassifier, hpcps.SparseRegressor): scikit-learn's own
estimator checks, the same model as `hpcps train` in one process, partial_fit and pickling that
continue training exactly, and quality against scikit-learn's linear models."""

from __future__ import annotations

import math
import os
import pickle
import sys

import numpy as np
import pytest
import scipy.sparse

pytest.importorskip("sklearn", minversion="1.6")
from sklearn.linear_model import LogisticRegression, Ridge  # noqa: E402
from sklearn.metrics import log_loss, mean_squared_error  # noqa: E402
from sklearn.utils.estimator_checks import check_estimator  # noqa: E402

import hpcps  # noqa: E402
from hpcps.train import synth  # noqa: E402
from hpcps.train.model_file import ServingModel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_train import hpcps_job, sets  # noqa: E402

# the checks scikit-learn skips by itself here, and why
EXPECTED_SKIPS = {"check_array_api_input",            # needs SCIPY_ARRAY_API=1 and an array library
                  "check_classifier_data_not_an_array",  # pandas is not installed
                  "check_regressor_data_not_an_array", "check_sample_weights_pandas_series"}
# the checks expected to fail, and why (scikit-learn's own SGDClassifier expects them to fail too)
EXPECTED_FAILURES = dict.fromkeys(
    ("check_sample_weight_equivalence_on_dense_data", "check_sample_weight_equivalence_on_sparse_data"),
    "minibatch training on float32 parameters: a row of weight 2 is the row twice within its step, but the "
    "repeated rows make other steps (the automatic batch size counts rows), and the float32 sums differ past "
    "the check's rtol of 1e-7 (tests/test_weights.py checks the equivalence where the steps are the same)")


@pytest.mark.parametrize("make", [lambda: hpcps.SparseClassifier(), lambda: hpcps.SparseClassifier(model="fm"),
                                  lambda: hpcps.SparseRegressor(), lambda: hpcps.SparseRegressor(model="fm")],
                         ids=["classifier-lr", "classifier-fm", "regressor-lr", "regressor-fm"])
def test_passes_scikit_learns_estimator_checks(make):
    results = check_estimator(make(), on_fail=None, expected_failed_checks=EXPECTED_FAILURES)
    failed = [(r["check_name"], repr(r["exception"])[:300]) for r in results if r["status"] == "failed"]
    assert not failed, failed
    skipped = {r["check_name"] for r in results if r["status"] == "skipped"}
    assert skipped <= EXPECTED_SKIPS, skipped
    assert len(results) > 45  # the checks ran


def read_libsvm(path: str, n_features: int):
    """A CSR matrix of a libsvm file, each row's features in the file's order (scikit-learn's
    reader wants them sorted, and the generated rows are not)."""
    labels, indptr, indices, values = [], [0], [], []
    for line in open(path):
        label, *features = line.split()
        labels.append(float(label))
        for f in features:
            i, v = f.split(":")
            indices.append(int(i))
            values.append(float(v))
        indptr.append(len(indices))
    X = scipy.sparse.csr_matrix((np.array(values), np.array(indices), np.array(indptr)),
                                shape=(len(labels), n_features))
    return X, np.array(labels)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("est"))
    s = synth.generate(out, 6000, 3000, fields=10, interactions=True, seed=3, hash_bits=14, formats=("libsvm",))
    X, y = read_libsvm(s.files["train_libsvm"], 1 << 14)
    Xt, yt = read_libsvm(s.files["test_libsvm"], 1 << 14)
    return {"train": s.files["train_libsvm"], "X": X, "y": y, "Xt": Xt, "yt": yt}


@pytest.mark.parametrize("model,batch", [("lr", 500), ("fm", 500), ("lr", 0)])
def test_the_same_model_as_hpcps_train_in_one_process(data, tmp_path, model, batch):
    """Column j is key j, rows end with the bias, the same batches and steps: the estimator's
    parameters are those of the model file `hpcps train` writes (one process, no mpiexec rank).
    Batch size 0: both pick the automatic size (50 rows a step for these 6,000 rows)."""
    est = hpcps.SparseClassifier(model=model, epochs=2, batch_size=batch, learning_rate=0.2, l2=0.5)
    est.fit(data["X"], data["y"])
    out = tmp_path / "model.h5"
    _, text, _ = hpcps_job(1, ["train", *sets(data__train=data["train"], data__hash_bits=14, model__type=model,
                                              optimizer__alpha=0.2, optimizer__l2=0.5, train__epochs=2,
                                              train__model_out=str(out), train__progress=False),
                               *(sets(train__batch_size=batch) if batch else [])])
    assert f"of {batch or 50} rows" in text
    served = ServingModel(str(out))
    params = served.pull(np.arange(1 << 14, dtype=np.uint64))
    np.testing.assert_allclose(est.coef_[0], params[:, 0], rtol=1e-5, atol=1e-6)
    if model == "fm":
        np.testing.assert_allclose(est.factors_, params[:, 1:], rtol=1e-5, atol=1e-6)
    assert np.abs(est.coef_).max() > 0.05  # it trained


def test_an_fm_classifier_is_regularised_by_default(data):
    """FTRL's l2 is 10 by default for the factor models (0 for LR): on these 6,000 rows an FM's
    factors overfit without it, and more so in 5 epochs than in the default 2."""
    got = {}
    for l2 in (None, 0.0):
        for epochs in (2, 5):
            est = hpcps.SparseClassifier(model="fm", l2=l2, epochs=epochs).fit(data["X"], data["y"])
            got[l2, epochs] = log_loss(data["yt"], est.predict_proba(data["Xt"])[:, 1])
    assert got[None, 5] < got[0.0, 5] - 0.02, got
    assert got[None, 2] < got[0.0, 2] - 0.003, got
    assert got[None, 2] < got[None, 5] - 0.01, got  # the defaults (2 epochs, automatic batches)
    assert hpcps.SparseClassifier(model="fm")._config(16).optimizer.params["l2"] == 10.0
    assert "l2" not in hpcps.SparseClassifier(model="lr")._config(16).optimizer.params  # FTRL's 0
    assert "l2" not in hpcps.SparseRegressor(model="fm")._config(16).optimizer.params
    assert hpcps.SparseClassifier(model="fm", l2=0.0)._config(16).optimizer.params["l2"] == 0.0


def test_a_classifier_starts_its_bias_at_the_base_rates_log_odds(data):
    """As model.bias_init = "auto" in hpcps train: SGD at a negligible rate leaves the start."""
    est = hpcps.SparseClassifier(optimizer="sgd", learning_rate=1e-12, epochs=1).fit(data["X"], data["y"])
    p = float(np.mean(data["y"][:4096] == est.classes_[1]))
    assert est.intercept_[0] == pytest.approx(math.log(p / (1 - p)), abs=1e-6)
    assert np.abs(est.coef_).max() < 1e-6


def test_partial_fit_and_pickle_continue_training_exactly(data):
    X, y = data["X"], data["y"]
    full = hpcps.SparseClassifier(model="fm", epochs=3).fit(X, y)
    part = hpcps.SparseClassifier(model="fm", epochs=1).fit(X, y)
    part.partial_fit(X, y)
    part = pickle.loads(pickle.dumps(part))  # the tables and their FTRL state travel with it
    part.partial_fit(X, y)
    np.testing.assert_array_equal(part.decision_function(data["Xt"]), full.decision_function(data["Xt"]))
    # partial_fit from scratch: classes first, then one pass per call
    stream = hpcps.SparseClassifier(model="fm")
    for _ in range(3):
        stream.partial_fit(X, y, classes=[0, 1])
    np.testing.assert_array_equal(stream.decision_function(data["Xt"]), full.decision_function(data["Xt"]))
    with pytest.raises(ValueError, match="classes must be passed"):
        hpcps.SparseClassifier().partial_fit(X, y)


def test_quality_against_scikit_learn_and_clear_errors(data):
    X, y, Xt, yt = data["X"], data["y"], data["Xt"], data["yt"]
    reference = min(log_loss(yt, LogisticRegression(C=C, max_iter=2000).fit(X, y).predict_proba(Xt)[:, 1])
                    for C in (0.1, 1.0))
    lr = log_loss(yt, hpcps.SparseClassifier().fit(X, y).predict_proba(Xt)[:, 1])
    assert lr < reference + 0.01, (lr, reference)
    # labels of any kind: -1/+1 and strings predict the labels given
    signs = hpcps.SparseClassifier().fit(X, 2 * y - 1)
    assert set(signs.predict(Xt)) <= {-1, 1} and list(signs.classes_) == [-1, 1]
    words = hpcps.SparseClassifier().fit(X, np.where(y > 0, "click", "none"))
    assert (words.predict(Xt) == np.where(signs.predict(Xt) > 0, "click", "none")).all()
    with pytest.raises(ValueError, match="Only binary classification"):
        hpcps.SparseClassifier().fit(X[:30], np.arange(30) % 3)
    with pytest.raises(ValueError, match="the sgd optimizer has no l1"):
        hpcps.SparseClassifier(optimizer="sgd", l1=0.1).fit(X, y)
    with pytest.raises(ValueError, match="learning_rate"):
        hpcps.SparseClassifier(learning_rate=-1).fit(X, y)


def test_regressors_lr_matches_ridge_and_fm_finds_the_products():
    """y = 3.5 + a linear part + x0 x1 + x2 x3 + noise (std 0.3): the LR is as good as Ridge (the
    best linear model), the FM reaches the noise."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(6000, 20))
    y = 3.5 + X @ rng.normal(size=20) * 0.5 + X[:, 0] * X[:, 1] + X[:, 2] * X[:, 3] + rng.normal(size=6000) * 0.3
    Xtr, Xte, ytr, yte = X[:5000], X[5000:], y[:5000], y[5000:]
    ridge = mean_squared_error(yte, Ridge(alpha=1.0).fit(Xtr, ytr).predict(Xte)) ** 0.5
    lr = mean_squared_error(yte, hpcps.SparseRegressor().fit(Xtr, ytr).predict(Xte)) ** 0.5
    fm = mean_squared_error(yte, hpcps.SparseRegressor(model="fm").fit(Xtr, ytr).predict(Xte)) ** 0.5
    assert lr < ridge * 1.02, (lr, ridge)
    assert fm < 0.4, (fm, ridge)
