"""``hpcps train`` without mpiexec: one process holds a server and a worker and sends no message
(``hpcps.ps.context.LocalContext``). It must train exactly what 1 server + 1 worker under BSP train,
and checkpoint, resume, export, eval and predict must work as they do under mpiexec."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpcps.ps import checkpoint
from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    s = synth.generate(str(d), 20_000, 2_000, fields=10, seed=4, formats=("libsvm",))
    return s.files["train_libsvm"], s.files["test_libsvm"]


def train(data, tmp, name, *sets, ranks=1, extra=()):
    args = ["train", "--set", f"data.train={json.dumps(data[0])}", "--set", f"data.test={json.dumps(data[1])}",
            "--set", "train.progress=false", "--set", "train.batch_size=100",
            "--set", f"train.model_out={json.dumps(str(tmp / (name + '.h5')))}",
            *[x for kv in sets for x in ("--set", kv)], "--summary-json", str(tmp / (name + ".json")), *extra]
    cmd = HPCPS + args if ranks == 1 else [*mpiexec(), "-n", str(ranks), *HPCPS, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.load(open(tmp / (name + ".json"))), ServingModel(str(tmp / (name + ".h5"))), proc.stdout


def same(a, b):
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)


@pytest.mark.parametrize("model", ['model.type="lr"', 'model.type="fm"'])
def test_one_process_trains_exactly_what_one_server_and_one_worker_train(data, tmp_path, model):
    one, m1, out = train(data, tmp_path, "one", model)
    two, m2, _ = train(data, tmp_path, "two", model, ranks=2)
    assert "one process (a server and a worker inside it, no messages)" in out
    same(m1, m2)
    assert one["test_logloss"] == two["test_logloss"] and one["table_keys"] == two["table_keys"] > 0


def test_one_process_checkpoints_resume_and_interchange_with_mpiexec(data, tmp_path):
    sets = ("checkpoint.every_steps=100", "checkpoint.keep=10", "features.admit_count=2",
            "features.evict_after_steps=50", "features.evict_every_steps=25")
    _, whole, _ = train(data, tmp_path, "whole", f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}", *sets)
    for ranks in (1, 2):  # the mid-way checkpoint of the one-process run, resumed either way
        ck = tmp_path / f"ck{ranks}"
        ck.mkdir()
        src = checkpoint.step_dir(str(tmp_path / "ck"), 200)
        shutil.copytree(src, ck / os.path.basename(src))
        _, resumed, out = train(data, tmp_path, f"resumed{ranks}", f"checkpoint.dir={json.dumps(str(ck))}", *sets,
                                ranks=ranks, extra=("--resume", "auto"))
        assert "resuming from" in out
        same(resumed, whole)


def test_a_label_sorted_file_trains_well_shuffled_and_resumes_in_its_order(data, tmp_path):
    """A training file sorted by label (every negative row, then every positive one): in file
    order one epoch ends fitted to the last rows; with data.shuffle_rows it trains as well as on
    the shuffled file. The part loaded whole (data.cache_dir) shuffles it the same; a run resumed
    from a checkpoint inside a window ends with the same model; resuming with another shuffle is
    refused, naming it."""
    lines = open(data[0], "rb").readlines()
    (tmp_path / "sorted.svm").write_bytes(b"".join(sorted(lines, key=lambda line: float(line.split()[0]))))
    sorted_data = (str(tmp_path / "sorted.svm"), data[1])
    plain, _, _ = train(sorted_data, tmp_path, "plain", "train.epochs=1")
    given, _, _ = train(data, tmp_path, "given", "train.epochs=1")
    mixed, m_mixed, _ = train(sorted_data, tmp_path, "mixed", "train.epochs=1", "data.shuffle_rows=20000")
    assert plain["test_logloss"] > given["test_logloss"] + 0.05  # the sorted file's damage
    assert mixed["test_logloss"] < given["test_logloss"] + 0.005
    cached, m_cached, _ = train(sorted_data, tmp_path, "cached", "train.epochs=1", "data.shuffle_rows=20000",
                                f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}")
    same(m_mixed, m_cached)
    sets = ("train.epochs=2", "data.shuffle_rows=3000", "checkpoint.every_steps=70", "checkpoint.keep=10")
    ck = json.dumps(str(tmp_path / "ck"))
    _, whole, _ = train(sorted_data, tmp_path, "whole", f"checkpoint.dir={ck}", *sets)
    again = tmp_path / "again"
    again.mkdir()
    src = checkpoint.step_dir(str(tmp_path / "ck"), 70)  # 7,000 rows: inside the third window
    shutil.copytree(src, again / os.path.basename(src))
    _, resumed, out = train(sorted_data, tmp_path, "resumed", f"checkpoint.dir={json.dumps(str(again))}", *sets,
                            extra=("--resume", "auto"))
    assert "resuming from" in out
    same(resumed, whole)
    proc = subprocess.run(HPCPS + ["train", "--set", f"data.train={json.dumps(sorted_data[0])}",
                                   "--set", "train.batch_size=100", "--set", "train.progress=false",
                                   "--set", f"checkpoint.dir={json.dumps(str(again))}", "--set", "data.shuffle_rows=500",
                                   "--resume", "auto"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and ("data.shuffle_rows/shuffle_seed were shuffle_rows 3000, seed 0, now "
                                     "shuffle_rows 500, seed 0") in proc.stderr, proc.stdout + proc.stderr


def test_export_eval_and_predict_after_a_one_process_run(data, tmp_path):
    summary, _, _ = train(data, tmp_path, "m", f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}")
    newest, _ = checkpoint.newest_good(str(tmp_path / "ck"))
    exported = tmp_path / "exported.h5"
    for cmd in (["export", newest, "--out", str(exported)],
                ["predict", "--model", str(exported), "--data", data[1], "--out", str(tmp_path / "p.txt")]):
        proc = subprocess.run(HPCPS + cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    same(ServingModel(str(exported)), ServingModel(str(tmp_path / "m.h5")))
    proc = subprocess.run(HPCPS + ["eval", "--model", str(exported), "--data", data[1]], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["logloss"] == pytest.approx(summary["test_logloss"], abs=1e-9)
    assert len(open(tmp_path / "p.txt").read().split()) == 2_000


def test_the_command_exits_quickly_with_its_code_and_output_but_not_under_a_profiler(tmp_path):
    # hpcps.cli.entry: os._exit after main returns; the code and the flushed output survive it,
    # and a profiler (which writes at the interpreter's exit) still gets to write
    bad = HPCPS + ["eval", "--model", str(tmp_path / "none.h5"), "--data", str(tmp_path / "none.svm")]
    for quick in ("1", "0"):
        proc = subprocess.run(bad, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, HPCPS_QUICK_EXIT=quick))
        assert proc.returncode == 2 and "none.h5 not found" in proc.stderr, (quick, proc.stderr)
    prof = tmp_path / "gen.prof"
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "hpcps.cli", "gen-data",
                           "--rows", "200", "--test-rows", "50", str(tmp_path / "g")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and prof.stat().st_size > 0, proc.stderr
    assert open(tmp_path / "g" / "train.svm").read().count("\n") == 200


def test_one_process_asked_for_more_servers_says_how_in_one_line(data, tmp_path):
    proc = subprocess.run(HPCPS + ["train", "--set", "cluster.servers=2", "--set", "synth.rows=100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "one process runs 1 server and 1 worker inside it" in lines[0] \
        and "mpiexec -n N" in lines[0], lines


def test_vowpal_wabbit_text_trains_like_the_same_rows_in_criteo_form(tmp_path):
    s = synth.generate(str(tmp_path / "d"), 30_000, 3_000, fields=39, seed=6, formats=("criteo", "vw"))
    got = {}
    for fmt in ("criteo", "vw"):
        files = (s.files[f"train_{fmt}"], s.files[f"test_{fmt}"])
        summary, model, out = train(files, tmp_path, fmt, "data.format=\"auto\"")
        got[fmt] = summary["test_logloss"]
    # the same features hashed two ways (VW: xxh64 of the token, seeded by the namespace)
    assert abs(got["vw"] - got["criteo"]) < 0.01, got


def test_a_run_ends_saying_where_things_went_and_the_next_commands_work(data, tmp_path):
    metrics = tmp_path / "run.jsonl"
    _, _, out = train(data, tmp_path, "m", f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}",
                      f"train.metrics={json.dumps(str(metrics))}")
    tail = out[out.index("where things went:"):].splitlines()
    said = {line.split()[0]: line.split(None, 1)[1] for line in tail if line.startswith("  ")}
    assert said["model"] == str(tmp_path / "m.h5") and said["metrics"] == str(metrics)
    assert said["checkpoints"] == checkpoint.newest_good(str(tmp_path / "ck"))[0]
    assert "--resume auto" in said["resume"]
    for what in ("export", "evaluate", "predict", "plot"):  # each printed command runs as printed
        cmd = said[what].split()
        assert cmd[0] == "hpcps"
        if what == "plot":
            pytest.importorskip("matplotlib")
        proc = subprocess.run(HPCPS + cmd[1:], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, (what, proc.stdout + proc.stderr)


def test_a_job_without_data_generates_it_once_into_the_cache_and_reuses_it(tmp_path):
    env = dict(os.environ, HPCPS_CACHE_DIR=str(tmp_path / "cache"))
    said, metrics = [], []
    for run in range(2):
        proc = subprocess.run(HPCPS + ["train", "--set", "synth.rows=3000", "--set", "synth.test_rows=500",
                                       "--set", "train.progress=false", "--summary-json", str(tmp_path / "s.json")],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        said.append(next(line for line in proc.stdout.splitlines() if line.startswith("  data ")))
        metrics.append(json.load(open(tmp_path / "s.json"))["test_logloss"])
    where = str(tmp_path / "cache" / synth.dir_name(3000, 500, 39, False, 1, 24))
    assert said == [f"  data         {where} (synthetic; the next run reuses it)",
                    f"  data         {where} (synthetic; reused from an earlier run)"]
    assert metrics[0] == metrics[1] and sorted(os.listdir(where)) == ["info.json", "test.svm", "train.svm"]


def test_a_classifier_starts_its_bias_at_the_base_rates_log_odds(data, tmp_path):
    """model.bias_init = "auto": the bias starts at the log-odds of the first 4096 labels' mean.
    SGD at a negligible rate leaves every weight where it started, so the model file shows the
    start and every test row is predicted at the base rate."""
    from hpcps.train.data import BIAS_KEY
    first = np.array([float(line.split(None, 1)[0]) for _, line in zip(range(4096), open(data[0]))])
    test_y = np.array([float(line.split(None, 1)[0]) for line in open(data[1])])
    p = float(first.mean())
    assert 0.05 < p < 0.45  # a base rate away from a half, so the two starts differ
    for init, want in (("auto", math.log(p / (1 - p))), ("zero", 0.0)):
        s, model, _ = train(data, tmp_path, init, 'optimizer.name="sgd"', "optimizer.lr=1e-12",
                            f'model.bias_init="{init}"')
        bias = float(model.values[model.keys == np.uint64(BIAS_KEY)][0, 0])
        assert bias == pytest.approx(want, abs=1e-6), (init, bias, want)
        q = 1 / (1 + math.exp(-want))
        base = -float(np.mean(test_y * math.log(q) + (1 - test_y) * math.log(1 - q)))
        assert s["test_logloss"] == pytest.approx(base, abs=1e-5), (init, s["test_logloss"], base)
        assert np.abs(model.values[model.keys != np.uint64(BIAS_KEY)]).max() < 1e-6


def test_a_regression_starts_its_bias_at_the_label_mean_and_beats_predicting_the_mean(tmp_path):
    d = tmp_path / "ratings"
    proc = subprocess.run(HPCPS + ["gen-data", "--ratings", "--rows", "60000", "--test-rows", "6000", str(d)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = (str(d / "train.svm"), str(d / "test.svm"))
    train_y = np.array([float(line.split()[0]) for line in open(files[0])])
    test_y = np.array([float(line.split()[0]) for line in open(files[1])])
    mean_rmse = float(np.sqrt(np.mean((test_y - train_y.mean()) ** 2)))
    rmse = {}
    for init in ("auto", "zero"):  # default AdaGrad, default learning rate, 2 epochs
        s, _, _ = train(files, tmp_path, init, 'model.loss="squared"', 'optimizer.name="adagrad"',
                        f'model.bias_init="{init}"')
        rmse[init] = s["test_rmse"]
    assert rmse["auto"] < 0.95 * mean_rmse < rmse["zero"], (rmse, mean_rmse)
