"""The MPI test harness itself: a failing rank ends the job quickly, and ranks agree on verdicts.

These launch real ``mpiexec`` jobs in subprocesses with a timeout and look at how they end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

LIMIT_S = 30


def launch(tmp_path, n: int, args: list[str], env_extra: dict | None = None, timeout: float = 90):
    env = {k: v for k, v in os.environ.items() if k != "HPCPS_TEST_REPORT_DIR"}
    env.update(PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    start = time.monotonic()
    proc = subprocess.run([*mpiexec(), "-n", str(n), sys.executable, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start, proc.stdout + proc.stderr


def test_unhandled_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        from mpi4py import MPI
        from hpcps.ps import transport
        transport.install_abort_handler()
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            time.sleep(0.5)
            raise ValueError("rank one fails on purpose")
        comm.Barrier()          # the others wait for rank 1 forever without the handler
        print("UNREACHABLE")
    """))
    proc, elapsed, out = launch(tmp_path, 3, [str(script)])
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert "rank 1/3" in out and "ValueError: rank one fails on purpose" in out
    assert "UNREACHABLE" not in out


def test_failed_assertion_in_mpi_test_ends_pytest_job(tmp_path):
    (tmp_path / "test_fails.py").write_text(textwrap.dedent("""
        import numpy as np
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_one_rank_fails_while_other_waits():
            comm = MPI.COMM_WORLD
            if comm.rank == 1:
                assert 2 + 2 == 5, "rank one's assertion fails on purpose"
            buf = np.zeros(1)
            comm.Recv(buf, source=1)   # never sent: rank 0 is stuck until the job is aborted
    """))
    proc, elapsed, out = launch(
        tmp_path, 2, ["-m", "pytest", "-p", "mpi_harness", "--with-mpi", "-q", "test_fails.py"],
        {"HPCPS_TEST_FAIL_GRACE": "3"})
    assert proc.returncode != 0, out
    assert elapsed < LIMIT_S, out
    assert "rank 1/2" in out and "rank one's assertion fails on purpose" in out, out


def test_deadlocked_mpi_test_is_ended_by_the_timeout(tmp_path):
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent("""
        import numpy as np
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        @pytest.mark.timeout(4)
        def test_both_ranks_receive_first():
            buf = np.zeros(1)
            MPI.COMM_WORLD.Recv(buf, source=1 - MPI.COMM_WORLD.rank)
    """))
    proc, elapsed, out = launch(
        tmp_path, 2, ["-m", "pytest", "-p", "mpi_harness", "--with-mpi", "-q",
                      "-o", "timeout_method=thread", "test_hangs.py"])
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert "Timeout" in out


def test_ranks_agree_on_verdict_and_the_session_goes_on(tmp_path):
    (tmp_path / "test_agree.py").write_text(textwrap.dedent("""
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_fails_on_rank_one_only():
            assert MPI.COMM_WORLD.rank != 1, "only rank one disagrees"

        @pytest.mark.mpi(min_size=2)
        def test_passes_everywhere():
            assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size

        @pytest.mark.mpi(min_size=2)
        def test_skips_saying_why():
            pytest.skip("nothing to see on rank %d" % MPI.COMM_WORLD.rank)
    """))
    report = tmp_path / "report"
    proc, elapsed, out = launch(
        tmp_path, 2, ["-m", "pytest", "-p", "mpi_harness", "--with-mpi", "-q", "test_agree.py"],
        {"HPCPS_TEST_REPORT_DIR": str(report)})
    assert proc.returncode != 0
    for rank in (0, 1):
        result = json.loads((report / f"rank{rank}.json").read_text())
        assert result["counts"]["failed"] == 1, (rank, result)
        assert result["counts"]["passed"] == 1, (rank, result)
        assert result["failed"] == ["test_agree.py::test_fails_on_rank_one_only"]
        assert result["skipped"] == [["test_agree.py::test_skips_saying_why", f"nothing to see on rank {rank}"]]
    assert "failed on rank(s) 1" in out and "only rank one disagrees" in out


def test_the_runner_lists_every_skip_and_ci_fails_what_it_needs(tmp_path):
    """tests/run.py ends with each skipped test and its reason. A test that cannot have what it
    needs (``run.cannot_run``: Slurm, namespaces, a tmpfs) skips saying why, or, under
    HPCPS_REQUIRE_CLUSTER=1 as CI runs, fails saying why."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["mpi_harness"]\n')
    (tmp_path / "test_some.py").write_text(textwrap.dedent("""
        import pytest
        from run import cannot_run

        def test_runs():
            pass

        def test_skips_saying_why():
            pytest.skip("no widget here")

        def test_needs_a_cluster():
            cannot_run("no cluster here")
    """))
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), HPCPS_TEST_STREAMS="1",
               TMPDIR=str(tmp_path))  # (where the runner keeps what a failed run wrote)
    env.pop("HPCPS_TEST_REPORT_DIR", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "run.py"), str(tmp_path / "test_some.py")],
                          env=dict(env, HPCPS_REQUIRE_CLUSTER="1"), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "HPCPS_REQUIRE_CLUSTER=1 and this test cannot run here: no cluster here" in out, out
    tail = out[out.index("=== whole suite in"):].splitlines()
    # (the test's id is relative to pytest's rootdir, which depends on where the checkout lies)
    assert tail[1] == "1 skipped:" and tail[2].startswith("  SKIPPED "), tail
    assert tail[2].endswith("test_some.py::test_skips_saying_why: no widget here"), tail
    assert tail[-1] == "1 passed, 1 failed, 1 skipped", tail
    assert tail[-2].startswith(f"what the tests wrote is kept in {tmp_path}/hpcps-tests-tmp-"), tail
    # without it, the same test skips, and says why
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "test_some.py"],
                          cwd=tmp_path, env=dict(env, HPCPS_REQUIRE_CLUSTER=""), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "1 passed, 2 skipped" in proc.stdout, proc.stdout
    assert re.search(r"SKIPPED \[1\] \S+: no cluster here", proc.stdout), proc.stdout


@pytest.mark.mpi(min_size=2)
def test_polling_barrier_and_allreduce_agree_across_ranks():
    import numpy as np
    from mpi4py import MPI

    from hpcps.ps import transport

    comm = MPI.COMM_WORLD
    transport.barrier(comm, timeout=30)
    total = transport.allreduce(comm, np.arange(5, dtype=np.int64) * (comm.rank + 1), timeout=30)
    n = comm.size
    np.testing.assert_array_equal(total, np.arange(5) * n * (n + 1) // 2)


@pytest.mark.mpi(min_size=2)
def test_wait_timeout_names_the_peer_that_never_answered():
    import numpy as np
    from mpi4py import MPI

    from hpcps.ps import transport

    comm = MPI.COMM_WORLD.Dup()
    if comm.rank == 0:
        buf = np.zeros(1)
        req = comm.Irecv(buf, source=1, tag=7)
        with pytest.raises(transport.StallError, match=r"pull reply \(from rank 1\)"):
            transport.wait(transport.Pending(req, "pull reply", peer=1, buffers=(buf,)), timeout=0.3)
        comm.Send(np.zeros(1), dest=1, tag=8)          # release rank 1
        transport.wait(transport.Pending(req, "pull reply", peer=1, buffers=(buf,)), timeout=10)
        assert buf[0] == 42.0
    elif comm.rank == 1:
        comm.Recv(np.zeros(1), source=0, tag=8)
        comm.Send(np.full(1, 42.0), dest=0, tag=7)
    comm.Free()


def test_a_stalled_collective_warns_naming_the_ranks_and_times_out(tmp_path):
    """Collectives go through the transport: a warning names the world ranks the collective waits
    on, the timeout says the same, and waiting does not spin a core."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import numpy as np
        from mpi4py import MPI
        from hpcps.ps import transport
        transport.install_abort_handler()
        transport.set_stall_warning(0.5)
        comm = transport.dup()
        sub = transport.split(comm, 0 if comm.Get_rank() != 1 else -1, comm.Get_rank())  # world ranks 0 and 2
        if comm.Get_rank() == 0:
            cpu = time.process_time()
            try:
                transport.allreduce(sub, np.ones(1), timeout=2.0, what="allreduce of the test")
            except transport.StallError as e:
                print("STALL:", e, flush=True)
            print(f"CPU {time.process_time() - cpu:.3f}", flush=True)
            obj = transport.bcast_object(comm, {"a": [1, 2]}, 0, 30, "broadcast of the test")
        else:
            if comm.Get_rank() == 2:
                time.sleep(4)   # joins the sub-communicator's allreduce late
                transport.allreduce(sub, np.ones(1), timeout=30)
            obj = transport.bcast_object(comm, None, 0, 30, "broadcast of the test")
        assert obj == {"a": [1, 2]}, obj
        errors = transport.all_ok(comm, "bad rank" if comm.Get_rank() == 2 else None, 30)
        assert errors == ["rank 2: bad rank"], errors
        print("DONE", comm.Get_rank(), flush=True)
    """))
    proc, elapsed, out = launch(tmp_path, 3, [str(script)])
    assert proc.returncode == 0, out
    warning = next((ln for ln in out.splitlines() if "rank 0/3: warning: still waiting" in ln), "")
    assert warning.startswith("hpcps: rank 0/3: warning: still waiting after 0.") and \
        "for allreduce of the test (a collective over 2 ranks: waiting on world rank(s) 2;" in warning, out
    assert "STALL:" in out and "no answer after 2 s: allreduce of the test" in out, out
    cpu = float(out.split("CPU ")[1].split()[0])
    assert cpu < 0.5, out  # 2 s of waiting, a small fraction of a core
    assert out.count("DONE") == 3
