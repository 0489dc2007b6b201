"""docs/defaults-sweep.py, how far the defaults land from a tuned model: on the smallest of the
tests' data sets its numbers are the jobs' own (the gap is defaults minus the better of the grid's
best and the tuned model; the pick is the grid's first by holdout loss)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = ["--grid", "optimizer.alpha=0.05,0.2", "optimizer.l2=0,10"]  # 4 members, not the set's 18


def sweep(tmp_path, *args):
    """docs/defaults-sweep.py with ``args``, its data sets and jobs in the test's own temporary
    directory (the script makes them in the system's: TMPDIR)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, os.path.join(ROOT, "docs", "defaults-sweep.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=work, env=dict(os.environ, TMPDIR=str(work)))


def test_the_sweep_reports_what_its_jobs_measured(tmp_path):
    out = tmp_path / "sweep.json"
    p = sweep(tmp_path, "--only", "s3k-f6", "--epochs", "6", "--ranks", "1", "--out", str(out), *GRID)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.load(open(out))["s3k-f6"]
    ranking = r["ranking"]
    assert len(ranking) == 4  # alpha x l2
    assert [x["holdout_logloss"] for x in ranking] == sorted(x["holdout_logloss"] for x in ranking)
    assert r["grid_best"] == min(x["test_logloss"] for x in ranking)
    assert r["pick"] == ranking[0]["test_logloss"] and r["pick_gap"] >= 0
    assert r["gap"] == r["defaults"] - min(r["grid_best"], r["tuned"])
    assert 1 <= r["early_epoch"] <= 6 and 1 <= r["pick_epochs"] <= 6
    assert 0.3 < r["defaults"] < 0.7 and 0.3 < r["tuned"] < 0.7
    row = [line for line in p.stdout.splitlines() if line.startswith("| s3k-f6")]
    assert row and f"{r['defaults']:.4f}" in row[0] and f"{r['gap']:+.4f}" in row[0]
    # --paired: the same two models again (the same numbers), scored row by row on the test set
    p = sweep(tmp_path, "--only", "s3k-f6", "--paired", "--ranks", "1", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    cells = [c.strip() for c in [line for line in p.stdout.splitlines() if line.startswith("| s3k-f6")][0].split("|")]
    assert cells[2] == "300"  # (scores are written with 6 decimals: the losses agree to about 1e-6)
    for got, want in zip(map(float, cells[3:6]), (r["defaults"], r["tuned"], r["defaults"] - r["tuned"])):
        assert abs(got - want) <= 1.5e-4, (cells, r["defaults"], r["tuned"])
    se, (lo, hi) = float(cells[6]), map(float, cells[7].strip("[]").split(", "))
    assert 0 < se < 0.05 and lo < r["defaults"] - r["tuned"] < hi


def test_a_candidate_default_is_measured_against_the_stored_best(tmp_path):
    """--candidate: the job's own test loss, minus the stored best, counted against 0.002."""
    stored = {"s3k-f10": {"grid_best": 0.60, "tuned": 0.59, "gap": 0.01, "metric": "test_logloss"}}
    out = tmp_path / "stored.json"
    out.write_text(json.dumps(stored))
    p = sweep(tmp_path, "--only", "s3k-f10", "--out", str(out), "--candidate", "train.epochs=1", "optimizer.l2=10")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text()) == stored  # nothing written
    row = [line for line in p.stdout.splitlines() if line.startswith("| s3k-f10")][0].split("|")
    loss = float(row[3].split()[0])
    assert 0.3 < loss < 0.8 and row[3].split()[1] == "(-)"  # no early stopping: no best epoch
    assert row[5].strip() == f"{loss - 0.59:+.4f}" and row[6].strip() == "+0.0100"
    within = int(loss - 0.59 <= 0.002)
    assert f"within 0.002 of the best: {within} of 1 (the defaults: 0)" in p.stdout


def test_picks_judge_tunes_pick_on_a_larger_test_set(tmp_path):
    """--picks: tune with one holdout and with folds on the set's rows; every member trained on
    every row for its folds' epochs, and each pick trained so, against the best of them on a test
    set of --pick-test-rows rows (the folds' pick is one of the members: never below the best)."""
    p = sweep(tmp_path, "--only", "s3k-f6", "--picks", "--pick-test-rows", "2000", "--epochs", "2", "--ranks", "1",
              *GRID)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "the grid's best, trained on every row, on 2,000 test rows" in p.stdout
    cells = [c.strip() for c in [line for line in p.stdout.splitlines() if line.startswith("| s3k-f6")][0].split("|")]
    assert cells[2] == "10"  # 300 held-out rows a fold: all ten phases
    assert 0.3 < float(cells[3]) < 0.7 and float(cells[4]) >= -0.05 and float(cells[5]) >= 0
