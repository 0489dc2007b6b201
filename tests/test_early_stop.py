"""Early stopping on a holdout (``train.holdout``, ``train.early_stop``): held-out rows never
train, the holdout loss is evaluated after every epoch, and the job keeps the best epoch's model
(the servers snapshot it and go back to it), which is the one exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcps import config

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]


def _run(tmp_path, ranks, *sets):
    metrics, model, summary = tmp_path / "m.jsonl", tmp_path / "model.h5", tmp_path / "s.json"
    cmd = ["train", "--set", "synth.rows=16000", "--set", "synth.test_rows=4000", "--set", f"synth.dir={json.dumps(str(tmp_path / 'd'))}",
           "--set", "train.progress=false", "--set", f"train.metrics={json.dumps(str(metrics))}",
           "--set", f"train.model_out={json.dumps(str(model))}", *[x for kv in sets for x in ("--set", kv)],
           "--summary-json", str(summary)]
    proc = subprocess.run(HPCPS + cmd if ranks == 1 else [*mpiexec(), "-n", str(ranks), *HPCPS, *cmd],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    epochs = [json.loads(line) for line in open(metrics) if '"kind": "epoch"' in line]
    return json.load(open(summary)), epochs, model, tmp_path / "d" / "test.svm"


@pytest.mark.parametrize("ranks", [1, 3])
def test_early_stopping_keeps_the_best_epochs_model(tmp_path, ranks):
    # alpha 1 overfits 16 k rows within a few epochs: the holdout loss turns up
    s, epochs, model, test = _run(tmp_path, ranks, "train.epochs=10", "train.holdout=10", "train.early_stop=1",
                                  "optimizer.alpha=1.0")
    assert s["stopped_early"] and s["epochs_trained"] == len(epochs) < 10
    losses = [e["holdout_logloss"] for e in epochs]
    best_at = s["best_epoch"]
    assert best_at == 1 + losses.index(min(losses)) < s["epochs_trained"]
    # early_stop = 1: every epoch up to the best improved on the one before; the first that did
    # not (the one after the best) was the last
    assert all(a > b for a, b in zip(losses[:best_at - 1], losses[1:best_at])), losses
    assert s["epochs_trained"] == best_at + 1 and losses[best_at] >= losses[best_at - 1], losses
    best = epochs[s["best_epoch"] - 1]
    assert s["test_logloss"] == pytest.approx(best["test_logloss"], abs=1e-12)  # the summary is the kept model's
    proc = subprocess.run(HPCPS + ["eval", "--model", str(model), "--data", str(test)], capture_output=True, text=True,
                          timeout=120)
    assert json.loads(proc.stdout)["logloss"] == pytest.approx(best["test_logloss"], abs=1e-9)  # and it was exported


def test_held_out_rows_never_train(tmp_path):
    s, epochs, _, _ = _run(tmp_path, 1, "train.epochs=1", "train.holdout=4")
    assert s["examples"] == 16000 - 16000 // 4 and "holdout_logloss" in epochs[0]
    assert "stopped_early" in s and not s["stopped_early"]


def test_holdout_settings_are_checked():
    with pytest.raises(config.ConfigError, match="train.early_stop needs a holdout"):
        config.from_dict({"train": {"early_stop": 2}})
    with pytest.raises(config.ConfigError, match="train.holdout = 1 would hold out every row"):
        config.from_dict({"train": {"holdout": 1}})


def test_a_held_out_run_keeps_its_batches_compacted_and_trains_the_same(tmp_path):
    # kept: each batch split once, its training rows kept compacted for the next epochs; streamed
    # (a memory budget): every epoch parses and splits the part again. The same model, bit for bit.
    sets = ("train.epochs=4", "train.holdout=5", "train.early_stop=3", "train.batch_size=500")
    kept, kept_epochs, _, _ = _run(tmp_path / "kept", 2, *sets)
    streamed, streamed_epochs, _, _ = _run(tmp_path / "streamed", 2, *sets, "data.memory_mb=1")
    assert kept["kept_batches_mb"] > 0 and "kept_batches_mb" not in streamed
    assert kept["examples"] == streamed["examples"] == 4 * (16000 - 16000 // 5)
    for a, b in zip(kept_epochs, streamed_epochs, strict=True):
        assert (a["holdout_logloss"], a["test_logloss"], a["train_loss"]) == \
            (b["holdout_logloss"], b["test_logloss"], b["train_loss"])


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_holdout_with_no_rows_stops_the_job_in_one_line(tmp_path, ranks):
    """A part too small for train.holdout holds out nothing: the job stops saying so, where the
    holdout loss of no row would read 0 (and early stopping would trust it)."""
    path = tmp_path / "tiny.svm"
    path.write_text("".join(f"{i % 2} {i + 1}:1\n" for i in range(15)))
    cmd = ["train", "--set", f"data.train={json.dumps(str(path))}", "--set", "train.progress=false",
           "--set", "train.holdout=20", "--set", "train.early_stop=1"]
    proc = subprocess.run(HPCPS + cmd if ranks == 1 else [*mpiexec(), "-n", str(ranks), *HPCPS, *cmd],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "train.holdout = 20 holds out no row: every worker's part has fewer than 20 rows" \
        in errors[0], proc.stderr
