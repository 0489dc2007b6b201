"""A job's start-up: what it loads before training, and the summary's ``startup_s`` (from the
process's start to the first step). No timing bound here (docs/benchmarks.md has the figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from hpcps.ps import mpi_env
from hpcps.train import synth

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402


def test_the_command_and_the_training_loop_load_no_hdf5_or_arrow_until_asked():
    # h5py is loaded by the first checkpoint or model file, pyarrow by the first Parquet or CSV file
    probe = ("import sys, hpcps.cli, hpcps.train.loop; "
             "print(sorted(m for m in ('h5py', 'pyarrow') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


# Loaded by nothing a plain 2-rank training job does: HDF5 (checkpoints, model files), Arrow
# (Parquet, CSV), the synthetic data's generator, the benchmarks and plots, the scaling model (for
# cluster.layout = "auto"), and what numba's import looks at for nothing here (SciPy for a version
# check, PyYAML for a .numba_config.yaml there is none of)
NOT_LOADED = ("h5py", "pyarrow", "hpcps.train.synth", "hpcps_kernels.textgen", "scipy", "yaml", "hpcps.bench",
              "hpcps.plot", "hpcps.train.scaling")
# the MPI settings of a job on one host (hpcps.ps.mpi_env), as each rank ended with them
MPI_ENV = ("UCX_MEM_EVENTS", "MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD")
# the job's command line as `hpcps` runs it (hpcps.cli.main), then the names above it loaded (each
# on a line of its own, in one write: the other rank's summary may be mid-line in mpiexec's merged
# output, and print's separate writes of its arguments let it land between them: 'LOADED-----')
PROBE = ("import json, os, sys; from hpcps.cli import main; code = main(sys.argv[1:]); sys.stdout.flush(); "
         f"os.write(1, ('\\nLOADED ' + json.dumps([m for m in {NOT_LOADED!r} if m in sys.modules]) + '\\n').encode()); "
         f"os.write(1, ('\\nMPI_ENV ' + json.dumps([os.environ.get(n) for n in {MPI_ENV!r}]) + '\\n').encode()); "
         "sys.exit(code)")


def test_a_two_rank_job_says_its_startup_within_its_wall_time_and_loads_nothing_it_does_not_use(tmp_path):
    s = synth.generate(str(tmp_path / "d"), 100, 100, seed=3, formats=("libsvm",))
    summary = tmp_path / "s.json"
    cmd = [*mpiexec(), "-n", "2", sys.executable, "-c", PROBE, "train",
           "--set", f"data.train={json.dumps(s.files['train_libsvm'])}",
           "--set", f"data.test={json.dumps(s.files['test_libsvm'])}",
           "--set", "train.progress=false", "--set", "train.epochs=1", "--summary-json", str(summary)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(summary.read_text())
    # from the first worker's start to its first step: more than nothing, less than the whole job
    # less the training (time_s, from the first step to the summary)
    assert 0 < got["startup_s"] < wall - got["time_s"], (got["startup_s"], got["time_s"], wall)
    assert got["examples"] == 100
    # each role's CPU time in its loop (the largest over its ranks): the worker trained, the server served
    assert got["loop_cpu_s_worker"] > 0 and got["loop_cpu_s_server"] > 0, got
    # each rank (the server and the worker) loaded none of NOT_LOADED
    assert [line for line in proc.stdout.splitlines() if line.startswith("LOADED")] == ["LOADED []"] * 2, proc.stdout
    # and, all on this host, started MPI without UCX's memory hooks and with messages under 32 KiB
    # eager (where the tests' environment did not set them, and local messages go through shared memory)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("MPI_ENV")]
    local = not any(n in os.environ for n in mpi_env.NOLOCAL_VARIABLES)
    eager = None if any(n in os.environ for n in mpi_env.EAGER) else mpi_env.EAGER["MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD"]
    assert ranks == [[os.environ.get("UCX_MEM_EVENTS", "no" if local else None),
                      os.environ.get("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", eager if local else None)]] * 2, proc.stdout
