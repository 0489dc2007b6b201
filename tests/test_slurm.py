"""slurm/train.sbatch against a real local Slurm (slurmctld + slurmd started by
slurm/local-cluster.sh): world size, a wrong launch detected, and USR1 → checkpoint → requeue →
resume ending exactly like an uninterrupted run. Skipped, with the reason, where Slurm cannot run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SBATCH = os.path.join(ROOT, "slurm", "train.sbatch")
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, HPCPS_SLURM_DIR=str(state))
    script = os.path.join(ROOT, "slurm", "local-cluster.sh")
    try:
        proc = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 3:
            pytest.skip(proc.stderr.strip())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        env["SLURM_CONF"] = str(state / "slurm.conf")
        env["HPCPS_VENV"] = os.path.dirname(os.path.dirname(sys.executable))
        env.setdefault("NUMBA_CACHE_DIR", os.path.join(ROOT, ".numba_cache"))
        yield env
    finally:  # whatever started, even if the start failed half-way, is stopped
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)


def sbatch(env, cwd, args, extra_env, wait=True, timeout=300):
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args, SBATCH]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(env, **extra_env), capture_output=True, text=True, timeout=timeout)
    job = proc.stdout.strip().split(";")[0] if proc.stdout.strip() else ""
    return proc.returncode, job, proc.stderr


def job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "UNKNOWN", out


@pytest.mark.parametrize("launch", ["mpiexec", "srun"])
def test_train_job_gets_the_mpi_world_it_asked_for(slurm, tmp_path, launch):
    args = "--set synth.rows=20000 --set synth.test_rows=2000 --set train.epochs=1 " \
           f"--summary-json {tmp_path}/summary.json"
    rc, job, err = sbatch(slurm, tmp_path, ["--ntasks=4", "--output=out.txt"],
                          {"HPCPS_ARGS": args, "HPCPS_LAUNCH": launch})
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, err + out[-3000:]
    assert "1 server(s) (ranks 0-0), 3 worker(s)" in out  # the MPI world has the 4 tasks asked for
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["test_auc"] > 0.6


def test_srun_without_the_mpi_plugin_is_detected(slurm, tmp_path):
    rc, job, err = sbatch(slurm, tmp_path, ["--ntasks=3", "--output=out.txt"],
                          {"HPCPS_LAUNCH": "srun-no-mpi-plugin", "HPCPS_ARGS": "--set synth.rows=1000"})
    out = (tmp_path / "out.txt").read_text()
    assert rc != 0
    assert out.count("this MPI world has 1 rank but Slurm started 3 tasks") == 3, out[-3000:]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Data, the common arguments, and the model of the same job run uninterrupted (directly)."""
    tmp = tmp_path_factory.mktemp("slurmjob")
    info = synth.generate(str(tmp / "data"), 60_000, 5_000, fields=10, seed=8, formats=("libsvm",))
    sets = {"data.train": json.dumps(info.files["train_libsvm"]), "data.test": json.dumps(info.files["test_libsvm"]),
            # 6,000 small steps: several seconds, so a preemption is scheduled before the job ends
            "train.batch_size": "10", "train.epochs": "2", "cluster.staleness": "0"}
    common = " ".join(f"--set {k}={v}" for k, v in sets.items())
    ref = tmp / "ref.h5"
    cmd = [*mpiexec(), "-n", "3", sys.executable, "-m", "hpcps.cli", "train", "--set", f'train.model_out="{ref}"',
           "--set", "train.progress=false"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return common, ServingModel(str(ref))


def run_interrupted(slurm, tmp_path, job, interrupt):
    """Submit the job, wait for its first checkpoint, ``interrupt(job_id)``, wait for the end."""
    common, _ = job
    ckpt = tmp_path / "ck"
    env = {"HPCPS_ARGS": common + f" --set train.model_out=\"{tmp_path}/model.h5\"", "HPCPS_CKPT_DIR": str(ckpt),
           "HPCPS_CKPT_EVERY": "200"}
    rc, jid, err = sbatch(slurm, tmp_path, ["--ntasks=3", "--output=out.txt"], env, wait=False)
    assert rc == 0 and jid, err
    deadline = time.monotonic() + 240
    while not (ckpt.exists() and any(p.name.startswith("ckpt-") and not p.name.endswith(".tmp") for p in ckpt.iterdir())):
        assert time.monotonic() < deadline, job_state(slurm, jid)[1]
        time.sleep(0.2)
    interrupt(jid)
    while True:
        state, text = job_state(slurm, jid)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        assert time.monotonic() < deadline + 300, text
        time.sleep(1)
    return state, (tmp_path / "out.txt").read_text()


def assert_same_as_reference(tmp_path, job):
    a, b = ServingModel(str(tmp_path / "model.h5")), job[1]
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)


def test_usr1_checkpoints_requeues_and_resumes_exactly(slurm, tmp_path, job):
    state, out = run_interrupted(slurm, tmp_path, job, lambda jid: subprocess.run(
        ["scancel", "--signal=USR1", "--batch", jid], env=slurm, check=True))
    assert state == "COMPLETED", out[-4000:]
    assert "requeueing job" in out and "restart 1" in out and "resuming from" in out, out[-4000:]
    assert_same_as_reference(tmp_path, job)


def test_preemption_by_a_high_priority_job_checkpoints_and_resumes_exactly(slurm, tmp_path, job):
    def preempt(jid):  # every CPU of the node, in the partition that preempts "low"
        subprocess.run(["sbatch", "-p", "high", "--ntasks=8", "--output=/dev/null", "--wrap", "sleep 2"],
                       env=slurm, check=True, capture_output=True, cwd=tmp_path)

    state, out = run_interrupted(slurm, tmp_path, job, preempt)
    assert state == "COMPLETED", out[-4000:]
    assert "SIGUSR1: asking the trainer to checkpoint" in out and "resuming from" in out, out[-4000:]
    assert_same_as_reference(tmp_path, job)
