"""pytest plugin: MPI tests that cannot hang and whose ranks agree on a verdict.

Loaded by ``tests/conftest.py`` (or ``-p mpi_harness``). It only acts under ``--with-mpi`` (the
pytest-mpi option) in a world of more than one rank, on tests marked ``@pytest.mark.mpi``.

After every phase (setup, call, teardown) of such a test the ranks agree on the verdict with a
nonblocking allreduce on a private communicator:

* if every rank gets there, a failure on any rank fails the test on every rank, and the ranks that
  passed report which rank failed and why; the session goes on with the next test;
* a rank that failed waits at most ``HPCPS_TEST_FAIL_GRACE`` seconds (default 10) for the others;
  if some never arrive (they are blocked waiting for the failed rank) it prints its rank and error
  and calls ``MPI_Abort``, which ends the whole job within seconds;
* a rank that passed waits without spinning until pytest-timeout (thread method) ends the job.

Environment:
    HPCPS_TEST_REPORT_DIR: each rank writes ``rank<R>.json`` there at the end of the session (the
        counts, the failed test ids, and each skipped test's id and reason).
        ``tests/rank_output.py`` sends the stdout of ranks > 0 to ``rank<R>.log`` there, so the
        console shows rank 0's report and every rank's errors.
    HPCPS_LIST_MPI_TESTS: with ``--collect-only``, write the MPI tests and their world sizes
        (the marker's ``min_size``) as JSON to this file (used by ``tests/run.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

FAIL_GRACE_S = float(os.environ.get("HPCPS_TEST_FAIL_GRACE", "10"))

_state: dict = {"comm": None}


def _mpi_enabled(config) -> bool:
    return bool(config.getoption("with_mpi", default=False)) and _state["comm"] is not None


def _world_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.getoption("with_mpi", default=False):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            _state["comm"] = MPI.COMM_WORLD.Dup()


def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get("HPCPS_LIST_MPI_TESTS")
    if not path or _world_rank() != 0:
        return
    listed = []
    for item in items:
        mark = item.get_closest_marker("mpi")
        if mark is not None:
            listed.append({"nodeid": item.nodeid, "size": int(mark.kwargs.get("min_size", 1))})
    with open(path, "w") as f:
        json.dump(listed, f)


def _poll(request, timeout: float | None) -> bool:
    """Test ``request`` until it completes (True) or ``timeout`` seconds pass (False); sleeps."""
    start = time.monotonic()
    sleep = 1e-4
    while not request.Test():
        if timeout is not None and time.monotonic() - start > timeout:
            return False
        time.sleep(sleep)
        sleep = min(2 * sleep, 0.01)
    return True


def _short(rep) -> str:
    text = rep.longreprtext or ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")]
    return "\n".join(errors[-15:] or lines[-15:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not _mpi_enabled(item.config) or item.get_closest_marker("mpi") is None:
        return
    rep = outcome.get_result()
    import numpy as np
    from mpi4py import MPI

    comm = _state["comm"]
    rank = comm.Get_rank()
    failed = bool(rep.failed)
    send = np.array([int(failed)], dtype=np.int64)
    recv = np.zeros(1, dtype=np.int64)
    req = comm.Iallreduce(send, recv, MPI.SUM)
    if not _poll(req, FAIL_GRACE_S if failed else None):
        sys.stderr.write(
            f"\nhpcps-test: rank {rank}/{comm.Get_size()}: {item.nodeid} failed in {call.when} and "
            f"the other ranks did not reach the verdict within {FAIL_GRACE_S:g} s "
            f"(they are probably waiting for this rank); aborting the job.\n"
            f"{rep.longreprtext}\n"
        )
        sys.stderr.flush()
        time.sleep(0.3)  # let the launcher forward this output before the job is torn down
        MPI.COMM_WORLD.Abort(1)
    if recv[0] == 0:
        return
    # Every rank is here, so a (pickled, small) allgather cannot hang.
    messages = comm.allgather((rank, _short(rep)) if failed else None)
    bad = [m for m in messages if m is not None]
    if not failed:
        ranks = ", ".join(str(r) for r, _ in bad)
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in bad)
        rep.outcome = "failed"
        rep.longrepr = f"failed on rank(s) {ranks} in {call.when}:\n{detail}"


def _skip_reason(rep) -> str:
    """The reason of a skip report: pytest keeps it as (file, line, "Skipped: reason")."""
    text = rep.longrepr[2] if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3 else str(rep.longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def pytest_sessionfinish(session, exitstatus):
    report_dir = os.environ.get("HPCPS_TEST_REPORT_DIR")
    if not report_dir or hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller, which saw every worker's reports, writes it
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "skipped", "error", "xfailed", "xpassed")}
    failed_ids = sorted({r.nodeid for k in ("failed", "error") for r in stats.get(k, [])})
    skipped = sorted({(r.nodeid, _skip_reason(r)) for r in stats.get("skipped", [])})
    rank = _state["comm"].Get_rank() if _state["comm"] is not None else _world_rank()
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"counts": counts, "failed": failed_ids, "skipped": skipped, "exitstatus": int(exitstatus)}, f)
