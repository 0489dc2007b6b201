"""Computation on the servers (``model.compute = "servers"``): workers send a batch's nonzeros,
servers return each row's partial margin and apply the gradients from each row's residual. Under
BSP this must train the model the pull-based path trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcps import config
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402


def _job(tmp_path, ranks, compute, *sets):
    name = f"{compute}-{ranks}"
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", "train", "--set", "synth.rows=12000", "--set", "synth.test_rows=3000",
           "--set", f"synth.dir={json.dumps(str(tmp_path / 'data'))}", "--set", "train.progress=false",
           "--set", f'model.compute="{compute}"', "--set", f"train.model_out={json.dumps(str(tmp_path / name) + '.h5')}",
           *[x for kv in sets for x in ("--set", kv)], "--summary-json", str(tmp_path / f"{name}.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.load(open(tmp_path / f"{name}.json")), ServingModel(str(tmp_path / f"{name}.h5"))


@pytest.mark.parametrize("model,ranks,servers", [("lr", 3, 1), ("fm", 4, 2)])  # each model, each sum
def test_margins_on_the_servers_train_the_model_the_pull_path_trains(tmp_path, ranks, servers, model):
    sets = (f"cluster.servers={servers}", "cluster.staleness=0", 'optimizer.name="ftrl"', f'model.type="{model}"',
            "model.factors=4", "model.init_scale=0.05")
    pulled, a = _job(tmp_path, ranks, "workers", *sets)
    computed, b = _job(tmp_path, ranks, "servers", *sets)
    np.testing.assert_array_equal(a.keys, b.keys)
    if servers == 1:  # the same sums in the same order
        np.testing.assert_array_equal(a.values, b.values)
    else:             # a row's margin adds two servers' partial sums
        np.testing.assert_allclose(a.values, b.values, rtol=1e-5, atol=1e-7)
    assert abs(pulled["test_logloss"] - computed["test_logloss"]) < 1e-6
    assert computed["bytes_sent"] > 0 and computed["bytes_received"] > 0


def test_margins_on_the_servers_need_one_worker_per_group():
    with pytest.raises(config.ConfigError, match="needs one worker per group"):
        config.from_dict({"model": {"compute": "servers"}, "cluster": {"worker_groups": 1}})
