"""Chaos: a supervised run whose ranks are killed (kill -9) at random steps finishes by itself, and
under BSP its final model equals an uninterrupted run's bit for bit.

The schedule is seeded: three kills, each of a random rank (server or worker) at a random step of
its own attempt. Checkpoints every 200 steps; ``hpcps supervise`` restarts the job with
``--resume auto`` each time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from hpcps.train import synth
from hpcps.train.model_file import ServingModel
from hpcps.train.progress import read_status

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_checkpoint import rank_pids  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]
SEED = 20261122
RANKS = 3


def train_args(data, ckpt_dir, model_out, extra=None):
    sets = {"data.train": json.dumps(data[0]), "data.test": json.dumps(data[1]), "train.batch_size": 10,
            "train.epochs": 3, "train.progress": "false", "cluster.servers": 1, "cluster.staleness": 0,
            "checkpoint.dir": json.dumps(str(ckpt_dir)), "checkpoint.every_steps": 200,
            "train.model_out": json.dumps(str(model_out)), **(extra or {})}
    return ["train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def test_supervised_run_survives_three_random_kill_9s_bit_identical(tmp_path):
    chaos_run(tmp_path)


def logloss_of(out: str) -> float:
    """The test logloss of a run's (last) summary table."""
    return float(re.findall(r"^test logloss\s+([0-9.]+)", out, re.M)[-1])


def close_model(model, ref_model, out: str, ref_out: str) -> None:
    """A :func:`chaos_run` check for runs that need not be bit-identical: the model finite and its
    test logloss within 0.005 of the uninterrupted run's."""
    assert np.isfinite(model.values).all()
    assert abs(logloss_of(out) - logloss_of(ref_out)) < 0.005, (logloss_of(out), logloss_of(ref_out))


def chaos_run(tmp_path, extra=None, ref_extra=None, check=None, kills: int = 3) -> str:
    """The seeded schedule of three kill -9s (the first ``kills`` of them) under ``supervise`` (job
    settings ``extra`` on top), checked bit for bit against an uninterrupted run (with ``ref_extra``
    on top), or by ``check(model, reference model, output, reference output)`` (e.g.
    :func:`close_model`); returns the supervised run's output."""
    info = synth.generate(str(tmp_path / "data"), 20_000, 2_000, fields=10, seed=11, formats=("libsvm",))
    data = info.files["train_libsvm"], info.files["test_libsvm"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = subprocess.run([*mpiexec(), "-n", str(RANKS), *HPCPS, *train_args(data, tmp_path / "ref-ck", tmp_path / "ref.h5", ref_extra)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]

    # 2 workers x 10,000 rows / 10 = 1,000 steps an epoch, 3,000 in all (a few seconds): one kill
    # in each of three windows, the last ending 1,000 steps before the run does
    rng = np.random.default_rng(SEED)
    schedule = [(int(rng.integers(lo, lo + 300)), int(rng.integers(0, RANKS))) for lo in (300, 1000, 1700)]
    ck = tmp_path / "ck"
    status = tmp_path / "status.json"
    cmd = [*HPCPS, "supervise", "--max-restarts", "5", "--backoff", "0.5", "--",
           *mpiexec(), "-n", str(RANKS), *HPCPS, *train_args(data, ck, tmp_path / "model.h5", extra)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env, HPCPS_STATUS_FILE=str(status)))
    killed_pids: set[int] = set()
    try:
        for step, rank in schedule[:kills]:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None, f"the run ended before the kill at step {step}:\n{proc.stdout.read()}"
                assert time.monotonic() < deadline, f"step {step} never reached: {read_status(str(status))}"
                pids = rank_pids(str(ck))
                s = read_status(str(status))
                if len(pids) == RANKS and not set(pids.values()) & killed_pids and s.get("global_step", -1) >= step:
                    break
                time.sleep(0.02)
            os.kill(pids[rank], signal.SIGKILL)
            killed_pids |= set(pids.values())
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    restarts = [ln for ln in out.splitlines() if "hpcps supervise: job failed" in ln]
    if os.environ.get("SHOW"):
        print("\n".join(restarts))
    assert len(restarts) == kills, out[-4000:]
    assert all("restart" in ln and "--resume auto" in ln and "work lost" in ln for ln in restarts), restarts
    assert f"job finished (exit status 0) after {kills} restart(s)" in out
    a, b = ServingModel(str(tmp_path / "model.h5")), ServingModel(str(tmp_path / "ref.h5"))
    if check is not None:
        check(a, b, out, ref.stdout)
        return out
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)  # bit for bit
    return out
