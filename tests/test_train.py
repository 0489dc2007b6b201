"""Training end to end: against scikit-learn, FM against LR, BSP against single-process, bad input.

MPI tests call the training loop in-process under mpiexec; CLI tests launch ``hpcps train`` jobs
of different sizes in subprocesses (with timeouts) and compare what they write.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps import config
from hpcps.train import data as tdata
from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]


def hpcps_job(n: int, args: list[str], timeout: float = 240, check: bool = True):
    start = time.monotonic()
    proc = subprocess.run([*mpiexec(), "-n", str(n), *HPCPS, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"hpcps {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - start


def sets(**kv) -> list[str]:
    out = []
    for k, v in kv.items():
        out += ["--set", f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"]
    return out


# -- against scikit-learn ------------------------------------------------------------------------

def small_problem(n=400, d=10, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    y = (rng.random(n) < 1 / (1 + np.exp(-(X @ w + 0.3)))).astype(int)
    return X, y


@pytest.mark.mpi(min_size=2)
def test_lr_matches_scikit_learn_on_the_same_l2_objective(mpi_tmp_path):
    from mpi4py import MPI

    from hpcps.train import loop

    sklearn = pytest.importorskip("sklearn.linear_model")
    X, y = small_problem()
    n, d = X.shape
    path = mpi_tmp_path / "small.svm"
    if MPI.COMM_WORLD.rank == 0:
        with open(path, "w") as f:
            for row, label in zip(X, y):
                f.write(f"{label} " + " ".join(f"{j}:{v:.9g}" for j, v in enumerate(row)) + "\n")
    MPI.COMM_WORLD.Barrier()
    lam = 0.05
    cfg = config.from_dict({
        "cluster": {"servers": 1}, "data": {"train": str(path), "hash_bits": 64},
        "optimizer": {"name": "sgd", "lr": 2.0, "l2": lam},
        "train": {"epochs": 400, "batch_size": n, "gradient": "mean", "progress": False,
                  "model_out": str(mpi_tmp_path / "m.h5")}})
    loop.run(cfg, MPI.COMM_WORLD)
    model = ServingModel(str(mpi_tmp_path / "m.h5"))
    keys = np.array(list(range(d)) + [int(tdata.BIAS_KEY)], dtype=np.uint64)
    ours = model.pull(keys)[:, 0].astype(np.float64)
    # same objective: mean logloss + lam/2 ||w||^2 (bias included)  <=>  C = 1 / (n lam)
    Xb = np.hstack([X, np.ones((n, 1))])
    ref = sklearn.LogisticRegression(C=1 / (n * lam), fit_intercept=False, tol=1e-10, max_iter=10_000).fit(Xb, y)

    def objective(w):
        m = Xb @ w
        return np.mean(np.logaddexp(0, m) - y * m) + lam / 2 * w @ w

    np.testing.assert_allclose(ours, ref.coef_[0], atol=2e-4)
    assert objective(ours) == pytest.approx(objective(ref.coef_[0]), rel=1e-6)


# -- CLI jobs ------------------------------------------------------------------------------------

def test_fm_beats_lr_on_ratings_with_a_user_item_interaction(tmp_path):
    """Ratings = biases + <user factors, item factors> + noise: LR can only learn the biases.
    (50,000 rows, 3 epochs: test RMSE LR 0.790, FM 0.669, the noise's 0.487; 100,000 rows and 5
    epochs gave 0.781 and 0.624.)"""
    d = synth.ratings(str(tmp_path / "r"), 50_000, 10_000, seed=3)
    common = sets(data__train=d["train"], data__test=d["test"], model__loss="squared", train__epochs=3,
                  train__progress=False, optimizer__name="adagrad", optimizer__lr=0.1, model__factors=4,
                  model__init_scale=0.1)
    rmse = {}
    for model in ("lr", "fm"):
        out = tmp_path / f"{model}.json"
        hpcps_job(3, ["train", *common, *sets(model__type=model), "--summary-json", str(out)])
        rmse[model] = json.loads(out.read_text())["test_rmse"]
    assert rmse["fm"] < rmse["lr"] - 0.05, rmse
    assert rmse["fm"] > d["best_rmse"] - 0.01, rmse  # and no better than the noise allows


def interleave_for_one_worker(path: str, workers: int, batch: int, out: str) -> None:
    """The file a single worker must read to see, step by step, the union of what ``workers``
    workers of one group see: their step-k batches one after the other."""
    raw = open(path, "rb").read()
    parts = []
    for i in range(workers):
        start, end = tdata.byte_range(path, i, workers)
        parts.append(raw[start:end].split(b"\n")[:-1])
    steps = max(-(-len(p) // batch) for p in parts)
    with open(out, "wb") as f:
        for k in range(steps):
            for p in parts:
                for line in p[k * batch:(k + 1) * batch]:
                    f.write(line + b"\n")


@pytest.mark.parametrize("optimizer", ["ftrl", "adagrad"])
def test_bsp_group_of_two_equals_single_process_on_the_same_data_order(tmp_path, optimizer):
    d = synth.generate(str(tmp_path / "d"), 6000, 500, fields=10, seed=9, formats=("libsvm",))
    # pad every line to one length: the two workers' byte ranges then hold exactly 3000 rows each,
    # 12 full batches, which a single worker's 500-row batches can reproduce
    lines = open(d.files["train_libsvm"], "rb").read().split(b"\n")[:-1]
    width = max(map(len, lines))
    train = str(tmp_path / "padded.svm")
    open(train, "wb").write(b"".join(line.ljust(width) + b"\n" for line in lines))
    batch = 250
    single = str(tmp_path / "single.svm")
    interleave_for_one_worker(train, 2, batch, single)
    params = {"ftrl": dict(optimizer__alpha=0.3), "adagrad": dict(optimizer__lr=0.1)}[optimizer]
    # the bias starts at 0 in both: "auto" starts it from the first rows of each worker's part,
    # which are not the same rows in the two layouts
    common = sets(train__epochs=2, train__progress=False, optimizer__name=optimizer, cluster__staleness=0,
                  model__bias_init="zero", **params)
    hpcps_job(3, ["train", *common, *sets(data__train=train, cluster__worker_groups=1,
                                          train__batch_size=batch, train__model_out=str(tmp_path / "multi.h5"))])
    hpcps_job(2, ["train", *common, *sets(data__train=single, train__batch_size=2 * batch,
                                          train__model_out=str(tmp_path / "single.h5"))])
    a, b = ServingModel(str(tmp_path / "multi.h5")), ServingModel(str(tmp_path / "single.h5"))
    np.testing.assert_array_equal(a.keys, b.keys)
    # equal up to the order of the float32 additions inside a step's gradient (one sum of 500 rows
    # against two sums of 250 added together)
    np.testing.assert_allclose(a.values, b.values, rtol=1e-4, atol=5e-5)
    assert np.abs(a.values).max() > 0.01


@pytest.mark.parametrize("model", ["lr", "fm"])
def test_batches_kept_across_epochs_train_what_a_streamed_part_trains(small_data, tmp_path, model):
    """With the part in memory and several epochs, a worker keeps each batch after its first
    epoch as unique keys and int32 positions (deduplicated once); under a memory budget it parses
    and deduplicates every epoch, also on a thread of its own (data.parse_thread, slices of 64 kB).
    All train the same model, bit for bit. (One worker and two servers: with kept batches the
    worker marks the keys each pull reads, and the servers update the others after replying.)"""
    data = sets(data__train=small_data.files["train_libsvm"], data__test=small_data.files["test_libsvm"],
                train__progress=False, train__batch_size=200, train__epochs=3, model__type=model, cluster__servers=2)
    got = {}
    for memory_mb, thread in ((0, False), (64, False), (0.5, True)):
        out = tmp_path / f"{memory_mb}.json"
        hpcps_job(3, ["train", *data, *sets(data__memory_mb=memory_mb, data__parse_thread=thread,
                                            train__model_out=str(tmp_path / f"{memory_mb}.h5")),
                      "--summary-json", str(out)])
        got[memory_mb] = json.loads(out.read_text())
    assert got[0]["kept_batches_mb"] > 0 and "kept_batches_mb" not in got[64]
    for other in (64, 0.5):
        assert (got[0]["test_logloss"], got[0]["train_loss"]) == (got[other]["test_logloss"], got[other]["train_loss"])
        a, b = ServingModel(str(tmp_path / "0.h5")), ServingModel(str(tmp_path / f"{other}.h5"))
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.values, b.values)


def test_auto_batch_size_takes_at_least_128_steps_an_epoch_between_50_and_1000_or_4000_rows(tmp_path):
    from hpcps.train.plan import auto_batch_size
    sizes = [(3000, 2), (30_000, 2), (64_000, 1), (128_001, 1), (1_500_000, 1), (0, 1), (500_000, 4), (4_000_000, 2)]
    assert [auto_batch_size(r, w, "fm") for r, w in sizes] == [50, 118, 500, 1000, 1000, 50, 977, 1000]
    assert [auto_batch_size(r, w, "lr") for r, w in sizes] == [50, 118, 500, 1001, 4000, 50, 977, 4000]
    # the rows are counted as far as it matters: a last line without a newline counts
    path = tmp_path / "t.txt"
    for text, enough, want in [(b"a\nb\nc\n", 10, 3), (b"a\nb\nc", 10, 3), (b"a\nb\nc\n", 2, 2), (b"", 5, 0)]:
        path.write_bytes(text)
        assert tdata.rows_at_least(str(path), enough) == want
    assert tdata.rows_at_least(str(tmp_path / "missing"), 5) == tdata.rows_at_least(str(tmp_path), 5) == 0


def test_the_bias_starts_where_it_predicts_the_mean_label():
    from hpcps.train.loading import BIAS_P, bias_for
    assert bias_for(0.25, "logistic") == pytest.approx(math.log(1 / 3))
    assert bias_for(0.5, "logistic") == 0.0
    edge = math.log(BIAS_P / (1 - BIAS_P))  # a part of one class: clipped, finite
    assert bias_for(0.0, "logistic") == pytest.approx(edge) and bias_for(1.0, "logistic") == pytest.approx(-edge)
    assert bias_for(3.5, "squared") == 3.5 and bias_for(-2.0, "squared") == -2.0


def test_a_small_set_trains_better_in_the_automatic_batches_than_in_1000_rows(tmp_path):
    """4,000 rows on one worker: 4 steps an epoch of 1000 rows undertrain in 2 epochs (FTRL moves
    a key about once a step); the automatic size takes 80 steps of 50 rows."""
    d = synth.generate(str(tmp_path / "d"), 4000, 1001, fields=8, seed=2, formats=("libsvm",))
    data = sets(data__train=d.files["train_libsvm"], data__test=d.files["test_libsvm"], train__progress=False)
    got = {}
    for batch in (0, 1000):
        out = tmp_path / f"{batch}.json"
        _, text, _ = hpcps_job(2, ["train", *data, *sets(train__batch_size=batch), "--summary-json", str(out)])
        got[batch] = json.loads(out.read_text())["test_logloss"]
        assert ("80 steps/epoch of 50 rows (auto)" if batch == 0 else "4 steps/epoch of 1000 rows\n") in text
    assert got[0] < got[1000] - 0.003, got  # 0.0049 here since the bias starts at the log-odds


def test_pull_early_is_bit_identical_under_bsp_and_within_the_staleness_under_ssp(small_data, tmp_path):
    """train.pull_early: under SSP a step's push-pull pulls the batch after the next one, for the
    clock after the next, so one worker's reads are exactly one clock stale (none without it); no
    read is staler than the staleness allows. Under BSP it changes nothing: an FM in a worker
    group of 2 trains the same model bit for bit."""
    data = sets(data__train=small_data.files["train_libsvm"], data__test=small_data.files["test_libsvm"],
                train__progress=False, train__batch_size=200)
    for early in (False, True):
        hpcps_job(3, ["train", *data, *sets(model__type="fm", cluster__worker_groups=1, train__pull_early=early,
                                            train__model_out=str(tmp_path / f"bsp_{early}.h5"))])
    a, b = ServingModel(str(tmp_path / "bsp_False.h5")), ServingModel(str(tmp_path / "bsp_True.h5"))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)
    got = {}
    for early in (False, True):
        out = tmp_path / f"one_{early}.json"
        hpcps_job(2, ["train", *data, *sets(cluster__staleness=1, train__pull_early=early), "--summary-json", str(out)])
        got[early] = json.loads(out.read_text())
    assert (got[False]["max_staleness"], got[True]["max_staleness"]) == (0, 1), got
    assert abs(got[True]["test_logloss"] - got[False]["test_logloss"]) < 0.02, got
    out = tmp_path / "ssp2.json"  # two workers, SSP 2
    hpcps_job(3, ["train", *data, *sets(cluster__staleness=2, train__pull_early=True), "--summary-json", str(out)])
    two = json.loads(out.read_text())
    assert two["max_staleness"] <= 2
    assert abs(two["test_logloss"] - got[False]["test_logloss"]) < 0.02, (two, got)
    # pulls two clocks ahead in flight through what waits for every request: checkpoints within
    # and between epochs, the holdout's evaluation and an early stop, two workers
    out = tmp_path / "stops.json"
    _, text, _ = hpcps_job(3, ["train", *data, *sets(cluster__staleness=1, train__pull_early=True, train__epochs=30,
                                                     train__holdout=5, train__early_stop=1,
                                                     checkpoint__dir=str(tmp_path / "ck"), checkpoint__every_steps=3),
                               "--summary-json", str(out)], timeout=120)
    s = json.loads(out.read_text())
    assert s["max_staleness"] <= 1 and "(periodic)" in text and s["examples"] < 30 * 3000, s
    with pytest.raises(config.ConfigError, match="train.pull_early"):
        config.from_dict({"train": {"pull_early": True}, "model": {"compute": "servers"}})


def test_predict_writes_one_score_per_row_in_input_order(tmp_path):
    d = synth.generate(str(tmp_path / "d"), 4000, 1001, fields=8, seed=2, formats=("libsvm", "criteo"))
    scores = tmp_path / "scores.txt"
    hpcps_job(4, ["train", *sets(data__train=d.files["train_criteo"], train__progress=False,
                                 train__model_out=str(tmp_path / "m.h5"), data__predict=d.files["test_criteo"],
                                 data__predict_out=str(scores))])
    distributed = np.loadtxt(scores)
    assert distributed.shape == (1001,)
    # the same model served without MPI, on the same file: identical scores, row by row
    served = tmp_path / "served.txt"
    subprocess.run([*HPCPS, "predict", "--model", str(tmp_path / "m.h5"), "--data", d.files["test_criteo"],
                    "--out", str(served)], check=True, capture_output=True, timeout=120)
    np.testing.assert_allclose(distributed, np.loadtxt(served), atol=2e-6)
    # (the generated libsvm file holds the Criteo file's keys, which eval refuses unless told)
    out = subprocess.run([*HPCPS, "eval", "--model", str(tmp_path / "m.h5"), "--data", d.files["test_libsvm"],
                          "--allow-other-hashing"], check=True, capture_output=True, text=True, timeout=120).stdout
    assert 0.5 < json.loads(out)["auc"] < 1


# -- bad input -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return synth.generate(str(d), 3000, 300, fields=6, seed=4, formats=("libsvm",))


def _with_bad_line(small_data, tmp_path, bad: bytes, at: int = 2000) -> str:
    lines = open(small_data.files["train_libsvm"], "rb").read().split(b"\n")
    lines[at - 1] = bad
    path = tmp_path / "bad.svm"
    path.write_bytes(b"\n".join(lines))
    return str(path)


@pytest.mark.parametrize("bad,reason", [(b"1 4:zz", "bad number"), (b"0 4:1e999", "NaN or infinite"),
                                        (b"1 4", "expected index:value")])
def test_malformed_line_stops_every_rank_naming_file_and_line(small_data, tmp_path, bad, reason):
    path = _with_bad_line(small_data, tmp_path, bad)
    rc, out, elapsed = hpcps_job(3, ["train", *sets(data__train=path, train__progress=False)], check=False)
    assert rc != 0 and elapsed < 60
    for rank in range(3):
        assert f"hpcps: rank {rank}: error: cannot load data" in out, out[-2000:]
    assert f"{path}:2000: " in out and reason in out


def test_skip_bad_lines_counts_them(small_data, tmp_path):
    path = _with_bad_line(small_data, tmp_path, b"1 4:zz")
    summary = tmp_path / "s.json"
    hpcps_job(3, ["train", "--skip-bad-lines", *sets(data__train=path, train__progress=False, train__epochs=1),
                  "--summary-json", str(summary)])
    s = json.loads(summary.read_text())
    assert s["bad_lines_skipped"] == 1 and s["examples"] == 2999


def test_missing_file_and_empty_byte_range_are_errors_on_every_rank(small_data, tmp_path):
    rc, out, _ = hpcps_job(3, ["train", *sets(data__train=str(tmp_path / "nope.svm"))], check=False)
    assert rc != 0 and out.count("nope.svm not found") >= 3
    one = tmp_path / "one.svm"
    one.write_text("1 3:1\n")
    rc, out, _ = hpcps_job(3, ["train", *sets(data__train=str(one))], check=False)
    assert rc != 0 and "byte range holds no rows" in out and out.count("error: cannot load data") == 3


def test_bad_config_key_is_named_once_and_every_rank_exits_2():
    """Every rank finds a bad configuration alike: the first says it, once, with no rank number
    (not one identical line per rank)."""
    rc, out, _ = hpcps_job(3, ["train", "--set", "train.epochz=2"], check=False)
    assert rc == 2 and out.count("unknown config key train.epochz") == 1, out
    assert "hpcps: error: unknown config key train.epochz" in out and "rank" not in out.split("epochz")[0][-40:]


def test_a_trainer_dedups_hashed_formats_keys_without_remixing_them(tmp_path):
    """Criteo and VW keys are hash values: the trainer tells its model so (its batches' dedup
    skips remixing them, the same result); libsvm's raw indices are mixed."""
    from hpcps.train.loop import Trainer

    d = synth.generate(str(tmp_path / "d"), 300, 30, fields=4, seed=1, formats=("libsvm", "criteo"))
    for fmt, hashed in (("criteo", True), ("libsvm", False)):
        cfg = config.from_dict({"data": {"train": d.files[f"train_{fmt}"]}, "train": {"progress": False}})
        t = Trainer(cfg)
        t.agree_on_plan()
        t.connect_and_load()  # the context, the data streams and the model
        try:
            assert t.train.fmt == fmt and t.model.hashed_keys is hashed
        finally:
            t.ctx.finalize()
    assert tdata.HASHED_FORMATS == ("criteo", "vw")
