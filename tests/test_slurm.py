"""slurm/train.sbatch against a real local Slurm (slurmctld + slurmd started by
slurm/local-cluster.sh): world size, a wrong launch detected, and USR1 → checkpoint → requeue →
resume ending exactly like an uninterrupted run. Skipped, with the reason, where Slurm cannot run.
Several hosts, preemption by a higher partition and the loss of a host: tests/test_nodes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slurm_jobs import (CLUSTER, assert_same_as_reference, cluster, reference_job, run_interrupted,  # noqa: E402
                        sbatch)


def test_a_local_cluster_needs_root_and_says_so_before_starting_anything(tmp_path):
    """Run by another user, slurm/local-cluster.sh exits 3 (Slurm cannot run here: the tests skip,
    or fail under HPCPS_REQUIRE_CLUSTER=1) saying why, whether or not the packages are there."""
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.getuid() == 0 else []
    state = tmp_path / "state"
    proc = subprocess.run([*user, CLUSTER, "start"], env=dict(os.environ, HPCPS_SLURM_DIR=str(state)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Slurm cannot run here: a local cluster runs its daemons as root" in proc.stderr, proc.stderr
    assert not state.exists()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from cluster(tmp_path_factory.mktemp("slurm"))


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
    return reference_job(tmp_path_factory.mktemp("slurmjob"))


def test_usr1_checkpoints_requeues_and_resumes_exactly(slurm, tmp_path, job):
    state, out = run_interrupted(slurm, tmp_path, job, lambda jid: subprocess.run(
        ["scancel", "--signal=USR1", "--batch", jid], env=slurm, check=True))
    assert state == "COMPLETED", out[-4000:]
    assert "requeueing job" in out and "restart 1" in out and "resuming from" in out, out[-4000:]
    assert_same_as_reference(tmp_path, job)
