#!/usr/bin/env python
"""Run the whole test suite: serial tests with pytest, then each MPI test under mpiexec.

    python tests/run.py [pytest options, e.g. -k name or a path]

1. Compiles the numba kernels once into the cache (so ranks do not compile them concurrently), in
   two processes at once (``warmup``'s default).
2. Runs the tests not marked ``mpi`` with pytest, in as many processes as cores (pytest-xdist, see
   :func:`streams`); the Slurm tests (``WAITING``), which mostly wait on Slurm, in a second pytest
   beside the others unless a path was given.
3. Lists the tests marked ``@pytest.mark.mpi(min_size=N)`` and runs each group of equal N as
   ``mpiexec -n N python -m pytest --with-mpi ...`` under a timeout, so a hung job cannot outlast
   its budget (and the harness in ``mpi_harness.py`` aborts a job whose rank failed).
4. Lists every skipped test with its reason (from each pytest above, every MPI rank 0 included),
   then prints one closing line ``N passed, N failed, N skipped`` over everything and exits
   non-zero if anything failed. pytest's "no tests collected" (exit 5) counts as zero tests, not as
   a failure.

Environment: ``HPCPS_MPIEXEC`` (launcher, default: the ``mpiexec`` beside this Python, then the one
on PATH), ``HPCPS_MPIEXEC_ARGS`` (extra launcher arguments, e.g. ``--oversubscribe`` for Open MPI),
``HPCPS_MPI_GROUP_TIMEOUT`` (seconds per mpiexec run, default 900), ``HPCPS_TEST_STREAMS`` (pytest-xdist
processes for the serial tests, default the cores up to 4; 1 for one pytest),
``HPCPS_REQUIRE_CLUSTER`` (``1``, as CI sets it: a Slurm, multi-host or disk-full test that cannot
run here fails, saying why, instead of skipping; see :func:`cannot_run`).

Everything the tests and their jobs write through the system's temporary directory (``TMPDIR``:
pytest's ``tmp_path``, the synthetic data of jobs without data, files of ``hpcps supervise``)
goes under one directory of this run, removed at its end unless something failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAITING = ["tests/test_slurm.py", "tests/test_nodes.py"]  # run beside the other serial tests (see main)
KEYS = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
REQUIRE_CLUSTER = "HPCPS_REQUIRE_CLUSTER"


def cannot_run(reason: str) -> None:
    """What a test does when what it needs cannot be had here (Slurm, network namespaces, a tmpfs
    to fill): skip, saying why; under ``HPCPS_REQUIRE_CLUSTER=1`` (CI) fail, saying why, so that a
    run cannot pass with these tests skipped."""
    import pytest

    if os.environ.get(REQUIRE_CLUSTER, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_CLUSTER}={os.environ[REQUIRE_CLUSTER]} and this test cannot run here: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def mpiexec() -> list[str]:
    exe = os.environ.get("HPCPS_MPIEXEC")
    if not exe:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        exe = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not exe:
        sys.exit("tests/run.py: no mpiexec found; install the 'mpi' extra or set HPCPS_MPIEXEC")
    return [exe, *shlex.split(os.environ.get("HPCPS_MPIEXEC_ARGS", ""))]


def streams(argv: list[str]) -> list[str]:
    """pytest-xdist options running the serial tests in ``HPCPS_TEST_STREAMS`` processes (default:
    the cores, at most 4), each module's tests in one of them (its module-scoped data made once),
    the modules in the order ``tests/conftest.py`` gives them (the costliest first; xdist's own
    order, by number of tests, had started the cheap modules first and left one stream alone at
    the end with ``test_train``).
    Most of these tests wait on jobs they start, each job's ranks importing numpy, numba and mpi4py
    one after the other: one stream kept 1.4 of 2 cores busy here, two keep both."""
    n = int(os.environ.get("HPCPS_TEST_STREAMS", min(4, os.cpu_count() or 1)))
    if n <= 1 or any(a.startswith(("-n", "--numprocesses")) or a.endswith("no:xdist") for a in argv):
        return []
    if importlib.util.find_spec("xdist") is None:
        return []
    # (tests/conftest.py orders the modules; a worker that dies -- the kernel's OOM killer -- ends the
    # run, its test named, rather than being replaced: xdist's loadscope scheduler then waited for ever)
    return ["-n", str(n), "--dist", "loadscope", "--no-loadscope-reorder", "--max-worker-restart=0"]


def run(cmd: list[str], env: dict, timeout: float | None = None) -> int:
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"tests/run.py: TIMEOUT after {timeout:g} s: {' '.join(cmd)}", flush=True)
        return 124


def read_report(report_dir: str) -> dict:
    """Rank 0's report (``tests/mpi_harness.py``): counts and skipped tests; {} if none was written."""
    path = os.path.join(report_dir, "rank0.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def add_report(report: dict, totals: dict, skipped: list) -> None:
    for k in KEYS:
        totals[k] += report.get("counts", {}).get(k, 0)
    skipped += [tuple(s) for s in report.get("skipped", [])]


def add_serial(rdir: str, rc: int, what: str, totals: dict, problems: list, skipped: list) -> None:
    add_report(read_report(rdir), totals, skipped)
    if rc not in (0, 5):
        problems.append(f"{what} exited {rc}")


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(ROOT, ".numba_cache"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Every job of the suite starts Python processes that import hpcps from source. Where
    # PYTHONDONTWRITEBYTECODE is set (this machine sets it) each of them compiled hpcps's 35 modules
    # again: 0.15 s of a process's 1 s of imports. The suite writes them once into __pycache__.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    py = sys.executable
    totals = dict.fromkeys(KEYS, 0)
    problems: list[str] = []
    skipped: list[tuple[str, str]] = []  # (test id, reason)
    t0 = time.time()

    # 1. Compile the kernels once, serially, into the shared cache.
    if run([py, "-m", "hpcps_kernels", "warmup"], env, timeout=900) != 0:
        problems.append("kernel warm-up failed")

    env["TMPDIR"] = scratch = tempfile.mkdtemp(prefix="hpcps-tests-tmp-")  # (see the module's docstring)
    with tempfile.TemporaryDirectory(prefix="hpcps-tests-") as tmp:
        # 2. Serial tests. The Slurm ones mostly wait on Slurm (16% of a core over their 3 minutes
        # here) and start their own clusters, so unless a path was asked for they run beside the
        # rest, in a second pytest whose output is printed when it ends.
        waiting = None
        if not any(os.path.exists(os.path.join(ROOT, a.split("::")[0])) for a in argv if not a.startswith("-")):
            wdir, wlog = os.path.join(tmp, "serial-slurm"), open(os.path.join(tmp, "serial-slurm.log"), "w+")
            cmd = [py, "-m", "pytest", "-m", "not mpi", "--durations=10", *argv, *WAITING]
            print("+ (beside the rest)", " ".join(shlex.quote(c) for c in cmd), flush=True)
            waiting = (subprocess.Popen(cmd, env=dict(env, HPCPS_TEST_REPORT_DIR=wdir), cwd=ROOT, stdout=wlog,
                                        stderr=subprocess.STDOUT), wdir, wlog)
        rdir = os.path.join(tmp, "serial")
        ignore = [f"--ignore={w}" for w in WAITING] if waiting else []
        rc = run([py, "-m", "pytest", "-m", "not mpi", "--durations=25", *streams(argv), *argv, *ignore],
                 dict(env, HPCPS_TEST_REPORT_DIR=rdir),  # (the slowest tests, for the log)
                 timeout=float(os.environ.get("HPCPS_SERIAL_TIMEOUT", "3600")))  # (each test has its own, 300 s)
        add_serial(rdir, rc, "serial pytest", totals, problems, skipped)

        # 3. MPI tests, grouped by world size.
        listing = os.path.join(tmp, "mpi-tests.json")
        rc = subprocess.run(
            [py, "-m", "pytest", "--collect-only", "-q", "-m", "mpi", "--with-mpi", *argv],
            env=dict(env, HPCPS_LIST_MPI_TESTS=listing), cwd=ROOT, stdout=subprocess.DEVNULL,
        ).returncode
        if rc not in (0, 5):
            problems.append(f"collecting the MPI tests exited {rc}")
        tests = json.load(open(listing)) if os.path.exists(listing) else []
        groups: dict[int, list[str]] = {}
        for t in tests:
            groups.setdefault(max(t["size"], 1), []).append(t["nodeid"])
        timeout = float(os.environ.get("HPCPS_MPI_GROUP_TIMEOUT", "900"))
        for size in sorted(groups):
            rdir = os.path.join(tmp, f"mpi{size}")
            ids = groups[size]
            print(f"\n=== {len(ids)} MPI test(s) at {size} ranks ===", flush=True)
            cmd = [*mpiexec(), "-n", str(size), py, os.path.join(ROOT, "tests", "rank_output.py"), "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", *ids]
            rc = run(cmd, dict(env, HPCPS_TEST_REPORT_DIR=rdir), timeout=timeout)
            report = read_report(rdir)
            add_report(report, totals, skipped)
            if rc not in (0, 5):
                problems.append(f"MPI tests at {size} ranks exited {rc}")
                if not report:
                    totals["failed"] += len(ids)  # the job died before it could report
                for r in range(1, size):
                    log = os.path.join(rdir, f"rank{r}.log")
                    if os.path.exists(log):
                        print(f"--- tail of rank {r}'s output ---")
                        print("".join(open(log).readlines()[-30:]))

        if waiting:
            proc, wdir, wlog = waiting
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                print(f"tests/run.py: TIMEOUT after {timeout:g} s: the Slurm tests", flush=True)
            wlog.seek(0)
            print(f"\n=== the Slurm tests, run beside the rest ===\n{wlog.read()}", flush=True)
            wlog.close()
            add_serial(wdir, rc, "Slurm tests' pytest", totals, problems, skipped)

    print(f"\n=== whole suite in {time.time() - t0:.0f} s ===")
    if skipped:
        print(f"{len(skipped)} skipped:")
        for test, reason in sorted(skipped):
            print(f"  SKIPPED {test}: {' '.join(reason.split())}")  # (one line each)
    for p in problems:
        print("problem:", p)
    failed = totals["failed"] + totals["error"]
    if problems and failed == 0:
        failed = 1
    if sum(totals.values()) == 0:
        print("no tests collected")
    if failed or problems:
        print(f"what the tests wrote is kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
