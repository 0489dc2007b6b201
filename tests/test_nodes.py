"""slurm/train.sbatch on a cluster of 3 "hosts": network namespaces with their own hostnames and
addresses, one slurmd each, started by ``slurm/local-cluster.sh start --nodes 3``. MPI between hosts
goes over TCP (checked from what UCX reports), and the layouts slurm/README.md recommends are
checked from where each rank ran. Then preemption and the loss of a host, each ending exactly like
an uninterrupted run. Select with ``python tests/run.py -k nodes``; skipped, with the reason, where
namespaces or Slurm cannot be had."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slurm_jobs import (CLUSTER, assert_same_as_reference, cluster, job_state, reference_job,  # noqa: E402
                        run_interrupted, sbatch)

NODES = 3
SMALL = "--set synth.rows=20000 --set synth.test_rows=2000 --set train.epochs=1"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    yield from cluster(tmp_path_factory.mktemp("nodes"), "--nodes", str(NODES))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return reference_job(tmp_path_factory.mktemp("nodesjob"))


def run_layout(hosts, tmp_path, args, extra_env):
    rc, _, err = sbatch(hosts, tmp_path, [*args, "--output=out.txt"],
                        {"HPCPS_ARGS": f"{SMALL} --summary-json {tmp_path}/summary.json", **extra_env})
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, err + out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_auc"] > 0.6
    return summary, out


def test_nodes_servers_on_one_node_workers_on_the_other_talking_tcp(hosts, tmp_path):
    summary, out = run_layout(hosts, tmp_path, ["-N", "2", "--ntasks=4", "--ntasks-per-node=2"],
                              {"HPCPS_SERVERS": "2", "UCX_PROTO_INFO": "y"})
    assert summary["servers"] + summary["workers"] == 4
    # Slurm picks any 2 of the 3 nodes: hosts are named by it, listed in the order of their ranks
    (a, b), roles = list(summary["hosts"]), list(summary["hosts"].values())
    assert a != b and a.startswith("hpcps-node") and b.startswith("hpcps-node")
    assert roles == [{"ranks": [0, 1], "servers": [0, 1], "workers": [], "groups": []},
                     {"ranks": [2, 3], "servers": [], "workers": [0, 1], "groups": [0, 1]}]
    assert f"2 hosts: {a}: servers 0-1; {b}: workers 0-1 (groups 0-1)" in out
    # What the network layer chose between ranks (UCX, MPICH's netmod): every path over TCP on
    # the host's own interface, some between hosts UCX itself calls "inter-node". Without the
    # cluster's UCX_TLS, the same run shows sysv/cma shared memory here: the hosts share a kernel.
    assert "inter-node cfg" in out, out[-3000:]
    transports = set(re.findall(r"\|\s+(\w+/\w+)\s+\|\s*$", out, re.M)) - {"self/memory"}
    assert transports == {"tcp/eth0"}, transports


@pytest.mark.parametrize("launch", ["mpiexec", "srun"])
def test_nodes_one_server_per_node(hosts, tmp_path, launch):
    summary, out = run_layout(hosts, tmp_path, ["-N", "2", "--ntasks=4", "--ntasks-per-node=2",
                                                "--distribution=cyclic"],
                              {"HPCPS_SERVERS": "2", "HPCPS_LAUNCH": launch})
    assert list(summary["hosts"].values()) == [
        {"ranks": [0, 2], "servers": [0], "workers": [0], "groups": [0]},
        {"ranks": [1, 3], "servers": [1], "workers": [1], "groups": [1]}]


def test_nodes_preemption_checkpoints_requeues_and_resumes_exactly(hosts, tmp_path, job):
    def preempt(jid):  # every CPU of every node, in the partition that preempts "low"
        subprocess.run(["sbatch", "-p", "high", "-N", str(NODES), f"--ntasks={8 * NODES}", "--output=/dev/null",
                        "--wrap", "sleep 2"], env=hosts, check=True, capture_output=True, cwd=tmp_path)

    state, out = run_interrupted(hosts, tmp_path, job, preempt, args=("-N", "2", "--ntasks=3"))
    assert state == "COMPLETED", out[-4000:]
    assert out.count("hpcps train: 2 hosts:") == 2, out[-4000:]  # both runs spanned two hosts
    assert "SIGUSR1: asking the trainer to checkpoint" in out and "resuming from" in out, out[-4000:]
    assert_same_as_reference(tmp_path, job)


def test_nodes_losing_a_host_fails_the_job_and_it_resumes_on_the_others_exactly(hosts, tmp_path, job):
    """Last in this module: the host stays down."""
    lost = []

    def power_cut(jid):  # the host of the job that is not the batch host: its slurmd and ranks die
        text = job_state(hosts, jid)[1]
        batch = re.search(r"BatchHost=(\S+)", text).group(1)
        nodes = subprocess.run(["scontrol", "show", "hostnames", re.search(r" NodeList=(\S+)", text).group(1)],
                               env=hosts, capture_output=True, text=True, check=True).stdout.split()
        lost.append(next(n for n in nodes if n != batch))
        subprocess.run([CLUSTER, "kill-node", lost[0]], env=hosts, check=True, capture_output=True)

    state, out = run_interrupted(hosts, tmp_path, job, power_cut, args=("-N", "2", "--ntasks=3"),
                                 extra_env={"HPCPS_RESTART_BACKOFF": "1"})
    assert state == "COMPLETED", out[-4000:]
    text = job_state(hosts, job_id(out))[1]
    assert "Restarts=1" in text, text  # Slurm requeued it after the node failure ...
    runs = re.findall(r"hpcps-sbatch: job \d+ restart (\d) on (\S+),", out)
    assert runs[0][0] == "0" and runs[-1][0] == "1", out[-4000:]
    assert lost[0] not in expand(hosts, runs[-1][1]), runs  # ... onto nodes that are up
    assert "resuming from" in out, out[-4000:]
    assert_same_as_reference(tmp_path, job)


def job_id(out: str) -> str:
    return re.search(r"hpcps-sbatch: job (\d+)", out).group(1)


def expand(env, nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True,
                          check=True).stdout.split()
