"""Every example runs with the one command written at its top, and reaches a sane result."""

import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def command_of(name: str) -> str:
    text = open(os.path.join(EXAMPLES, name)).read()
    return re.search(r"run: (.+)", text).group(1).strip()


def run(cmd: str, timeout: float = 300) -> str:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{cmd}\n{out[-3000:]}"
    return out


def test_every_example_has_a_run_line():
    names = [n for n in os.listdir(EXAMPLES) if n.endswith((".toml", ".py"))]
    assert sorted(names) == ["criteo.toml", "custom_model.py", "custom_optimizer.py", "deepfm.toml", "fm_ratings.toml",
                            "quickstart.toml"]
    for n in names:
        assert command_of(n)


def _metric(out: str, name: str) -> float:
    return float(re.search(rf"^{name}\s+([0-9.]+)", out, re.M).group(1))


def test_quickstart():
    out = run(command_of("quickstart.toml"))
    auc, best = _metric(out, "test auc"), _metric(out, "best achievable AUC")
    assert 0.75 < auc < best


def test_fm_ratings():
    out = run(command_of("fm_ratings.toml"))
    assert _metric(out, "test rmse") < 0.56  # 0.545 measured; predicting the mean gives 0.92


def test_criteo():
    out = run(command_of("criteo.toml"))
    assert _metric(out, "test auc") > 0.7
    assert os.path.exists("/tmp/hpcps-criteo/model.h5")


def test_deepfm():
    out = run(command_of("deepfm.toml"))
    best = float(re.search(r"best achievable test logloss ([0-9.]+)", out).group(1))
    assert best - 0.002 < _metric(out, "test logloss") < best + 0.04


def test_custom_optimizer():
    out = run(command_of("custom_optimizer.py"))
    assert float(re.search(r"mean squared error ([0-9.]+)", out).group(1)) < 0.05


def test_custom_model():
    out = run(command_of("custom_model.py"))
    assert float(re.search(r"mean squared error ([0-9.]+)", out).group(1)) < 0.05
