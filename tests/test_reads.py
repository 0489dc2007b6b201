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


# -- no read spins ------------------------------------------------------------------------------------

def _ends(fn, timeout: float = 20.0):
    """Run ``fn()`` on a thread; (its result or exception) once it ends, failing if it does not."""
    got: list = []

    def target():
        try:
            got.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001
            got.append(("raised", e))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} still runs after {timeout} s (a read loop spinning on 0 bytes?)"
    return got[0]


def test_reading_a_part_of_a_file_that_shrank_raises_instead_of_spinning(small, tmp_path):
    """``_parse_blocks`` looped ``while pos < end or carry`` and spun for ever once a read gave 0
    bytes (the file shrank after its byte ranges were cut); ``_count_newlines`` stopped short
    and counted too few rows. Both now raise :class:`DataChanged` naming the file."""
    path = str(tmp_path / "t.svm")
    with open(small[0], "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    state = tdata.file_state(path)
    start_, end = tdata.byte_range(path, 0, 1)
    os.truncate(path, end // 3)
    piece = tdata.Piece(path, start_, end)
    for fn in (lambda: list(tdata._parse_blocks(piece, "libsvm", 24, False, True, 1 << 16)),
               lambda: list(tdata._parse_blocks(piece, "libsvm", 24, False, True, 1 << 16, state=state)),
               lambda: tdata._count_newlines(path, start_, end),
               lambda: tdata.rows_bound([piece])):
        how, e = _ends(fn)
        assert how == "raised" and isinstance(e, tdata.DataChanged), (how, e)
        assert str(e).startswith(f"data file {path} changed while this job read it (")


def test_a_stream_checks_its_file_at_every_slice(small, tmp_path):
    """A file rewritten in place (the same size, new bytes) is caught at the next slice read."""
    path = str(tmp_path / "t.svm")
    with open(small[0], "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    stream = tdata.PartStream(path, 0, 1, "libsvm", memory_mb=0.5).open()
    time.sleep(0.01)
    with open(path, "r+b") as f:
        f.write(f.read(1))  # the same byte again: a new modification time
    with pytest.raises(tdata.DataChanged, match="rewritten: a new modification time"):
        for _ in stream.batches(50):
            pass


# -- empty data is an error -----------------------------------------------------------------------------

@pytest.mark.parametrize("text,settings,says", [
    ("# only\n# comments\n", {}, "holds no rows: its lines are all blank or comments"),
    ("\n\n\n", {}, "holds no rows: its lines are all blank or comments"),
    ("", {}, "holds no rows: it is empty"),
    # more comments than a first slice of the stream: found after a pass, at the epoch's end
    ("# a comment of some length, one of many in a file that holds nothing else\n" * 4000,
     {"data__memory_mb": 0.5}, "holds no rows: an epoch of \\d+ steps read none"),
])
def test_a_training_file_without_rows_stops_with_one_line(tmp_path, text, settings, says):
    """A training file of only comments (or blank lines) trained on nothing and exited 0."""
    path = tmp_path / "train.svm"
    path.write_text(text)
    rc, out = job(2, ["train", *sets(data__train=str(path), train__progress=False, **settings)], timeout=120)
    assert rc == 2, out[-2000:]
    assert re.search(rf"error: (cannot load data: )?(the )?training file \S+train\.svm {says}", out), out[-2000:]
    assert "Traceback" not in out and "summary" not in out


@pytest.mark.parametrize("text,says", [("# nothing\n", "its lines are all blank or comments"), ("", "it is empty")])
def test_a_test_file_without_rows_stops_with_one_line(small, tmp_path, text, says):
    path = tmp_path / "test.svm"
    path.write_text(text)
    rc, out = job(2, ["train", *sets(data__train=small[0], data__test=str(path), train__progress=False)])
    assert rc == 2 and f"error: cannot load data: test file {path} holds no rows: {says}" in out, out[-2000:]


def test_a_test_file_with_fewer_rows_than_workers_is_evaluated_whole(small, tmp_path):
    """A worker's part of a test file may be empty (the rows are gathered on the first worker):
    a one-row test file with two workers was an error ("use fewer workers")."""
    path = tmp_path / "test.svm"
    path.write_text(open(small[1]).readline())
    summary = tmp_path / "s.json"
    rc, out = job(3, ["train", *sets(data__train=small[0], data__test=str(path), train__progress=False,
                                     train__epochs=1), "--summary-json", str(summary)])
    assert rc == 0, out[-2000:]
    assert json.loads(summary.read_text())["test_rows"] == 1


# -- a data file is a regular file ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("key", ["data__train", "data__test"])
def test_a_directory_or_a_fifo_as_data_is_named_as_such(small, tmp_path, kind, key):
    """A directory or a FIFO given as a data file was reported "not found"; a FIFO must not hang
    the job either (opening it waits for a writer). A directory is one of part files: an empty one
    is said to be so, naming the key."""
    path = tmp_path / "data.svm"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    given = {"data__train": small[0], key: str(path)}
    rc, out = job(2, ["train", *sets(train__progress=False, **given)], timeout=120)
    said = (f"{key.replace('__', '.')} = '{path}': the directory holds no data file" if kind == "directory" else
            f"data file {path} is a FIFO (a named pipe), not a regular file: a job reads its data in byte ranges, "
            f"once an epoch")
    assert rc == 2 and said in out and "not found" not in out, out[-2000:]


# -- counts of zero and numbers that are not -------------------------------------------------------------

def test_a_resumed_epoch_reports_its_own_train_loss(small, tmp_path):
    """The epoch's train loss divided its loss by the examples of this run over the epoch's
    number: a run resumed at epoch 3 reported three times the loss of the same epoch trained
    without a stop."""
    common = dict(data__train=small[0], train__progress=False, train__batch_size=50)
    whole = tmp_path / "whole.jsonl"
    rc, out = job(2, ["train", *sets(train__epochs=3, train__metrics=str(whole), **common)])
    assert rc == 0, out[-2000:]
    ck, resumed = tmp_path / "ck", tmp_path / "resumed.jsonl"
    rc, out = job(2, ["train", *sets(train__epochs=2, checkpoint__dir=str(ck), **common)])
    assert rc == 0, out[-2000:]
    rc, out = job(2, ["train", *sets(train__epochs=3, checkpoint__dir=str(ck), train__metrics=str(resumed), **common),
                      "--resume", "auto"])
    assert rc == 0, out[-2000:]

    def epoch_losses(path):
        return [r["train_loss"] for r in map(json.loads, open(path)) if "train_loss" in r]

    assert epoch_losses(resumed)[-1] == pytest.approx(epoch_losses(whole)[-1], rel=1e-6)


def test_nothing_left_to_train_says_so(small, tmp_path):
    """Resuming a run that had finished trained nothing and printed 0 examples at 0 examples/s."""
    ck, summary = tmp_path / "ck", tmp_path / "s.json"
    args = ["train", *sets(data__train=small[0], train__progress=False, train__epochs=2, checkpoint__dir=str(ck))]
    rc, out = job(2, args)
    assert rc == 0, out[-2000:]
    final = sorted(os.listdir(ck))[-1]
    rc, out = job(2, args + ["--resume", "auto", "--summary-json", str(summary)])
    assert rc == 0, out[-2000:]
    assert re.search(rf"hpcps train: nothing left to train: \S+{final} is at the end of training \(train\.epochs = 2\); "
                     rf"raise train\.epochs to train on from it", out), out[-2000:]
    assert re.search(r"examples/s +none trained", out), out[-2000:]
    assert json.loads(summary.read_text())["examples_per_s"] is None


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
    from hpcps.ps import transport
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


def test_one_line_tells_a_known_failure_from_a_bug():
    assert errors.one_line(tdata.DataError("f.svm:3: bad number")) == ("DataError: f.svm:3: bad number", 2)
    assert errors.one_line(OSError(28, "No space left on device")) == \
        ("OSError: [Errno 28] No space left on device", 1)
    line, status = errors.one_line(KeyError("x"))
    assert status == 1 and line.startswith("KeyError: 'x'") and "HPCPS_DEBUG=1" in line


def test_out_of_memory_under_an_address_space_limit_is_one_line_that_names_the_limit():
    """A MemoryError is the user's limit (ulimit -v, a batch system's), not a bug: its line says
    so and which limit, without the 'unexpected' of a bug; exit status 1."""
    code = textwrap.dedent("""
        import resource
        import numpy as np
        from hpcps import errors
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            np.empty(4 << 30, np.uint8)
        except MemoryError as e:
            print(*errors.one_line(e), sep="|")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1")).stdout
    assert out.startswith("MemoryError: out of memory: Unable to allocate 4.00 GiB") and "limited to 3,072 MiB" in out, out
    assert "unexpected" not in out and out.rstrip().endswith("|1"), out
    line, status = errors.one_line(MemoryError())
    assert status == 1 and line.startswith("MemoryError: out of memory") and "unexpected" not in line
