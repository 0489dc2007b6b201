"""Reading data and reporting failures: no read spins, empty data is an error, a data file is a
regular file, a count of zero is never shown as a number, and every failure reaches the user as
one line (the traceback only with ``HPCPS_DEBUG=1``).

Jobs run as a user runs them (``mpiexec -n N hpcps ...`` or one process, under a timeout), with the
helpers of ``tests/test_faults.py``; the fault tests themselves (files changed under a job,
non-finite numbers, a full disk) are there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hpcps import errors
from hpcps.train import data as tdata

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402
from test_faults import ENV, job, sets, small, start, wait_for  # noqa: E402,F401 (small: a fixture)


# -- one line, the traceback only with HPCPS_DEBUG=1 -----------------------------------------------------

def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the rank ``rank`` of a job whose command line holds ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmd and b"hpcps.cli" in cmd and f"PMI_RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.parametrize("debug", [False, True])
def test_the_stall_timeout_is_one_line_and_the_traceback_is_for_hpcps_debug(small, tmp_path, debug):
    """A server that stops answering (SIGSTOP): the worker's stall timeout ends the job with one
    line naming who never answered, exit 1; it printed the whole traceback. ``HPCPS_DEBUG=1``
    prints the traceback too."""
    metrics = tmp_path / "m.jsonl"
    env = dict(ENV, HPCPS_DEBUG="1") if debug else ENV
    cmd = [*mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.cli", "train",
           *sets(data__train=small[0], train__epochs=100_000, train__progress=False, train__metrics=str(metrics),
                 cluster__stall_timeout_s=3, cluster__stall_warn_s=2)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    server = None
    try:
        assert wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120, proc)
        server = _rank_pid(str(metrics), 0)
        assert server is not None
        os.kill(server, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=60)
    finally:
        if server is not None:
            with contextlib.suppress(OSError):  # (gone with the job, usually)
                os.kill(server, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]
    lines = [ln for ln in out.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and re.fullmatch(r"hpcps: rank 1/2: error: StallError: rank 1/2: no answer after 3 s: "
                                            r".+ \(from rank 0\)", lines[0]), out[-3000:]
    assert ("Traceback (most recent call last)" in out) == debug, out[-3000:]


SCRIPT = """
    import threading, time
    from mpi4py import MPI
    from hpcps import transport
    transport.install_abort_handler()
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        time.sleep(0.3)
        def fail():
            {{}}["a key that is not there"]
        if {thread}:
            t = threading.Thread(target=fail, name="reader")
            t.start()
            t.join()  # (the handler aborts from the thread: this rank never reaches the barrier)
            time.sleep(30)
        else:
            fail()
    req = comm.Ibarrier()
    while not req.Test():  # the others wait for rank 1 for ever without the handler
        time.sleep(0.01)
    print("UNREACHABLE")
"""


@pytest.mark.parametrize("thread", [False, True])
@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_error_on_a_rank_is_one_line_that_says_how_to_see_the_traceback(tmp_path, thread, debug):
    """The abort handler appended the whole traceback to every abort, from the main thread or
    any other. Now a rank's error is one line (the rank, the error), ended by how to see the
    traceback when the error is a bug (an exception type no layer expects)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(thread=thread)))
    env = dict(os.environ, HPCPS_DEBUG="1" if debug else "0")
    proc = subprocess.run([*mpiexec(), "-n", "3", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "UNREACHABLE" not in out, out
    where = "error in thread reader" if thread else "error"
    hint = "" if debug else r" \(unexpected: HPCPS_DEBUG=1 prints the traceback\)"
    lines = [ln for ln in out.splitlines() if ln.startswith("hpcps:")]
    assert len(lines) == 1 and re.fullmatch(rf"hpcps: rank 1/3: {where}: KeyError: 'a key that is not there'{hint}",
                                            lines[0]), out
    assert ("Traceback (most recent call last)" in out) == debug, out
