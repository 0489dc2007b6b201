"""hpcps tune: a grid trained at once as several tables on the same servers, ranked on held-out
rows; the best configuration it writes trains that member's model again exactly."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

from hpcps import config
from hpcps.train import synth, tune

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_train import hpcps_job, sets  # noqa: E402


@pytest.fixture(scope="module")
def tune_data(tmp_path_factory):
    s = synth.generate(str(tmp_path_factory.mktemp("tune")), 30_000, 5_000, fields=10, interactions=True, seed=4,
                       hash_bits=16, formats=("libsvm",))
    return s.files["train_libsvm"], s.files["test_libsvm"]


def test_grid_ranks_its_members_and_the_best_trains_again_identically(tune_data, tmp_path):
    """1 server + 2 workers in one group (every member's pushes merged in one gather): 6 members,
    each with its own early stopping; `hpcps train best.toml` on the same layout reaches the
    ranked best's holdout and test logloss exactly."""
    train, test = tune_data
    common = sets(data__train=train, data__test=test, data__hash_bits=16, cluster__worker_groups=1,
                  train__progress=False, train__batch_size=500, train__epochs=6)
    _, out, _ = hpcps_job(3, ["tune", *common, "--grid", "optimizer.alpha=0.03,0.1,0.5", "--grid", "model.type=lr,fm",
                              "--folds", "1", "--out", str(tmp_path / "best.toml"),
                              "--summary-json", str(tmp_path / "tune.json")])
    ranking = json.loads((tmp_path / "tune.json").read_text())["ranking"]
    assert len(ranking) == 6 and "6 models in one pass" in out
    losses = [r["holdout_logloss"] for r in ranking]
    assert losses == sorted(losses) and losses[-1] > losses[0] + 0.005  # the grid matters
    assert {(r["optimizer.alpha"], r["model.type"]) for r in ranking} == {(a, t) for a in (0.03, 0.1, 0.5)
                                                                           for t in ("lr", "fm")}
    best = ranking[0]
    assert 1 <= best["best_epoch"] <= 6
    written = config.load_raw(str(tmp_path / "best.toml"), [])
    assert written["optimizer"]["alpha"] == best["optimizer.alpha"]
    assert written["model"]["type"] == best["model.type"]
    assert written["train"]["epochs"] == best["best_epoch"] and written["train"]["holdout"] == 10
    hpcps_job(3, ["train", str(tmp_path / "best.toml"), "--summary-json", str(tmp_path / "again.json")])
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["holdout_logloss"] == pytest.approx(best["holdout_logloss"], abs=1e-9)
    assert again["test_logloss"] == pytest.approx(best["test_logloss"], abs=1e-9)


@pytest.mark.parametrize("grid, extra, message", [
    (["optimizer.alpha=0.1,-1"], [], "grid point alpha=-1: optimizer.alpha"),
    (["optimizer.alpha=0.1"], ["--folds", "11"], "--folds 11: between 1 and train.holdout (10)"),
    (["model.type=lr,deepfm"], [], "a grid's models are all lr/fm or all wdl/deepfm"),
    (["data.hash_bits=10,12"], [], "--grid data.hash_bits: a grid varies optimizer.*"),
    (["optimizer.alpha=" + ",".join(str(0.01 * i) for i in range(1, 10)),
      "optimizer.l2=" + ",".join(map(str, range(8)))], [], "the grid has 72 points"),
    (["optimizer.alpha=0.1"], sets(train__holdout=0), "train.holdout = 0"),
    ([], [], "at least one --grid"),
])
def test_bad_grids_are_one_clear_line(tune_data, grid, extra, message):
    args = ["tune", *sets(data__train=tune_data[0]), *extra]
    for g in grid:
        args += ["--grid", g]
    rc, out, _ = hpcps_job(1, args, check=False)
    assert rc == 2, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], out


def test_deep_members_train_as_they_would_alone(tmp_path):
    """DeepFM members, each with its own MLP allreduced in the group (1 server + 2 workers in one
    group): every member's test logloss is that of the same model trained alone, to the bit."""
    d = synth.deep(str(tmp_path / "d"), 20_000, 2_000, seed=3)
    common = sets(data__train=d["train"], data__test=d["test"], data__hash_bits=16, cluster__worker_groups=1,
                  model__type="deepfm", model__fields=8, model__factors=4, model__hidden=[16],
                  train__progress=False, train__epochs=2, train__early_stop=0, train__batch_size=500)
    _, out, _ = hpcps_job(3, ["tune", *common, "--grid", "model.dense_lr=0.001,0.01", "--folds", "1",
                              "--summary-json", str(tmp_path / "tune.json")])
    ranking = json.loads((tmp_path / "tune.json").read_text())["ranking"]
    assert "2 models in one pass" in out and len(ranking) == 2
    assert abs(ranking[0]["test_logloss"] - ranking[1]["test_logloss"]) > 1e-4  # the MLPs differ
    for r in ranking:
        alone = tmp_path / f"alone-{r['member']}.json"
        hpcps_job(3, ["train", *common, *sets(model__dense_lr=r["model.dense_lr"], train__holdout=10,
                                              train__epochs=r["best_epoch"]), "--summary-json", str(alone)])
        assert json.loads(alone.read_text())["test_logloss"] == r["test_logloss"]


def test_folds_hold_out_every_row_once_and_rank_by_their_mean(tmp_path):
    """On 3,000 rows --folds auto trains the grid 10 times, each holding out another tenth: the
    held-out rows of all folds are the file's rows, each member's holdout loss is the mean of its
    folds', its epoch their median, and the first fold is the one pass of --folds 1 exactly."""
    s = synth.generate(str(tmp_path / "d"), 3000, 500, fields=6, seed=4, formats=("libsvm",))
    common = sets(data__train=s.files["train_libsvm"], data__test=s.files["test_libsvm"], train__progress=False,
                  train__epochs=3)
    grid = ["--grid", "optimizer.alpha=0.05,0.5"]
    _, out, _ = hpcps_job(2, ["tune", *common, *grid, "--out", str(tmp_path / "best.toml"),
                              "--summary-json", str(tmp_path / "cv.json")])
    cv = json.loads((tmp_path / "cv.json").read_text())
    assert cv["folds"] == 10 and cv["holdout_rows"] == 3000, out
    assert cv["test_logloss"] > 0 and cv["examples"] > 10 * 2700  # the first fold's test; every fold's rows
    assert "2 models in 10 passes" in out and out.count("hpcps tune: fold ") == 10
    _, _, _ = hpcps_job(2, ["tune", *common, *grid, "--folds", "1", "--summary-json", str(tmp_path / "one.json")])
    one = {r["member"]: r for r in json.loads((tmp_path / "one.json").read_text())["ranking"]}
    for r in cv["ranking"]:
        folds = r["holdout_logloss_folds"]
        assert len(folds) == 10 and len(set(folds)) == 10  # other rows held out each time
        assert r["holdout_logloss"] == pytest.approx(sum(folds) / 10, abs=1e-12)
        assert r["best_epoch"] == max(1, round(statistics.median(r["best_epoch_folds"])))
        assert folds[0] == one[r["member"]]["holdout_logloss"]
    assert [r["holdout_logloss"] for r in cv["ranking"]] == sorted(r["holdout_logloss"] for r in cv["ranking"])
    written = config.load_raw(str(tmp_path / "best.toml"), [])
    assert written["optimizer"]["alpha"] == cv["ranking"][0]["optimizer.alpha"]
    assert written["train"]["epochs"] == cv["ranking"][0]["best_epoch"]


@pytest.mark.parametrize("held, holdout, folds", [(300, 10, 10), (3000, 10, 7), (6000, 10, 3), (19_999, 10, 1),
                                                  (250_000, 10, 1), (5, 3, 3), (0, 10, 10)])
def test_auto_folds_aim_at_20000_held_out_rows(held, holdout, folds):
    assert tune.auto_folds(held, holdout) == folds


def test_toml_written_reads_back(tmp_path):
    raw = {"model": {"type": "fm", "hidden": [64, 32]}, "optimizer": {"name": "ftrl", "alpha": 0.3, "l2": 0},
           "data": {"train": 'a "quoted" päth.txt'}, "train": {"progress": False, "epochs": 3}}
    (tmp_path / "c.toml").write_text(config.to_toml(raw), encoding="utf-8")
    assert config.load_raw(str(tmp_path / "c.toml"), []) == raw


def test_the_keys_a_tune_has_no_use_for_are_named_not_dropped_silently(capsys):
    raw = {"data": {"train": "t.svm"}, "train": {"model_out": "m.h5"}, "checkpoint": {"dir": "ck"}}
    members = tune.member_raws(raw, tune.parse_grid(["optimizer.alpha=0.1,0.3"]))
    assert len(members) == 2 and all("dir" not in r.get("checkpoint", {}) for _, r in members)
    err = capsys.readouterr().err
    assert "hpcps tune: ignoring train.model_out, checkpoint.dir: a tune writes the best configuration" in err, err
