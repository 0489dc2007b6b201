"""docs/defaults-sweep.py, how far the defaults land from a tuned model: on the smallest of the
tests' data sets its numbers are the jobs' own (the gap is defaults minus the better of the grid's
best and the tuned model; the pick is the grid's first by holdout loss)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_sweep_reports_what_its_jobs_measured(tmp_path):
    out = tmp_path / "sweep.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "defaults-sweep.py"), "--only", "s3k-f6",
                        "--epochs", "6", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.load(open(out))["s3k-f6"]
    ranking = r["ranking"]
    assert len(ranking) == 18  # alpha x l2
    assert [x["holdout_logloss"] for x in ranking] == sorted(x["holdout_logloss"] for x in ranking)
    assert r["grid_best"] == min(x["test_logloss"] for x in ranking)
    assert r["pick"] == ranking[0]["test_logloss"] and r["pick_gap"] >= 0
    assert r["gap"] == r["defaults"] - min(r["grid_best"], r["tuned"])
    assert 1 <= r["early_epoch"] <= 6 and 1 <= r["pick_epochs"] <= 6
    assert 0.3 < r["defaults"] < 0.7 and 0.3 < r["tuned"] < 0.7
    row = [line for line in p.stdout.splitlines() if line.startswith("| s3k-f6")]
    assert row and f"{r['defaults']:.4f}" in row[0] and f"{r['gap']:+.4f}" in row[0]
