"""What the Slurm tests share: a throw-away cluster started by slurm/local-cluster.sh (one node on
localhost, or N namespace hosts), submitting slurm/train.sbatch, following a job, and a job
interrupted after its first checkpoint and compared with the same job run uninterrupted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from hpcps.train import synth
from hpcps.train.model_file import ServingModel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SBATCH = os.path.join(ROOT, "slurm", "train.sbatch")
CLUSTER = os.path.join(ROOT, "slurm", "local-cluster.sh")
sys.path.insert(0, HERE)
from run import cannot_run, mpiexec  # noqa: E402


def cluster(state, *start_args):
    """Start a cluster (a generator for a fixture): yields the environment its clients need. Where
    Slurm cannot run (the script's exit 3) the tests skip with its reason, or fail with it under
    HPCPS_REQUIRE_CLUSTER=1 (CI); stops whatever started, even half-way."""
    env = dict(os.environ, HPCPS_SLURM_DIR=str(state))
    try:
        proc = subprocess.run([CLUSTER, "start", *start_args], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 3:
            cannot_run(proc.stderr.strip())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        env["SLURM_CONF"] = str(state / "slurm.conf")
        env["HPCPS_VENV"] = os.path.dirname(os.path.dirname(sys.executable))
        env.setdefault("NUMBA_CACHE_DIR", os.path.join(ROOT, ".numba_cache"))
        yield env
    finally:
        subprocess.run([CLUSTER, "stop"], env=env, capture_output=True, timeout=120)


def sbatch(env, cwd, args, extra_env, wait=True, timeout=300):
    """Submit slurm/train.sbatch: (exit code, job id, stderr). With ``wait``, follow the job to its
    end (polling, which ends sooner than ``sbatch --wait``'s 10-second checks) and return its
    exit code."""
    cmd = ["sbatch", "--parsable", *args, SBATCH]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(env, **extra_env), capture_output=True, text=True, timeout=timeout)
    job = proc.stdout.strip().split(";")[0] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not wait:
        return proc.returncode, job, proc.stderr
    deadline = time.monotonic() + timeout
    while True:
        state, text = job_state(env, job)
        if state in ENDED:
            code = re.search(r" ExitCode=(\d+):(\d+)", text)
            return (int(code.group(1)) or int(code.group(2)) if code else 1), job, proc.stderr + text
        assert time.monotonic() < deadline, text
        time.sleep(0.3)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "UNKNOWN", out


def reference_job(tmp):
    """Data, the common arguments, and the model of the same job run uninterrupted (directly)."""
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


def run_interrupted(slurm, tmp_path, job, interrupt, args=("--ntasks=3",), extra_env=None):
    """Submit the job, wait for its first checkpoint, ``interrupt(job_id)``, wait for the end."""
    common, _ = job
    ckpt = tmp_path / "ck"
    env = {"HPCPS_ARGS": common + f" --set train.model_out=\"{tmp_path}/model.h5\"", "HPCPS_CKPT_DIR": str(ckpt),
           "HPCPS_CKPT_EVERY": "200", **(extra_env or {})}
    rc, jid, err = sbatch(slurm, tmp_path, [*args, "--output=out.txt"], env, wait=False)
    assert rc == 0 and jid, err
    deadline = time.monotonic() + 240
    while not (ckpt.exists() and any(p.name.startswith("ckpt-") and not p.name.endswith(".tmp") for p in ckpt.iterdir())):
        assert time.monotonic() < deadline, job_state(slurm, jid)[1]
        time.sleep(0.2)
    interrupt(jid)
    while True:
        state, text = job_state(slurm, jid)
        if state in ENDED:
            break
        assert time.monotonic() < deadline + 300, text
        time.sleep(1)
    return state, (tmp_path / "out.txt").read_text()


def assert_same_as_reference(tmp_path, job):
    a, b = ServingModel(str(tmp_path / "model.h5")), job[1]
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)
