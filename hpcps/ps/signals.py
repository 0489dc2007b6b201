"""Stop signals: SIGINT, SIGTERM and SIGUSR1. Pure Python, no MPI.

Where a checkpoint can be written (``defer``), the first signal only sets a flag, which the
training loop polls at its step boundaries, where the ranks agree to checkpoint together and stop
(exit status 75 after SIGTERM or SIGUSR1, to be requeued; 130 after SIGINT, interrupted). A second
SIGINT or SIGTERM, or any of them where there is nothing to save, stops this process at once with
one line and the exit status 128 + the signal's number, ending the other ranks with it. When ``mpiexec`` forwards a signal to every rank (as it does with Ctrl-C), the
first rank speaks for the job: the others wait a second before they say anything, and are gone
by then.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from hpcps_kernels.tuning import STOP_QUIET_S

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
_PRIORITY = {signal.SIGINT: 3, signal.SIGTERM: 2, signal.SIGUSR1: 1}  # which one a stop reports

_state: dict = {"signal": None, "forwarded": None, "installed": False, "defer": True, "prefix": "hpcps: ", "first": True,
                "why": "", "end": os._exit, "stopping_with": None}


def install(defer: bool = True, prefix: str = "hpcps: ", first: bool | None = None, why: str = "",
            end=None) -> None:
    """Catch SIGINT, SIGTERM and SIGUSR1 (main thread only); may be called again to change the
    settings. ``defer``: a checkpoint can be written, so the first signal sets the flag
    (:func:`requested`); else, and for a second SIGINT or SIGTERM, :func:`stop_now`. ``prefix``
    starts the line printed (the rank); ``first``: this is the rank that speaks for the job (by
    default the one whose ``PMI_RANK`` is 0, or a process outside MPI); ``why``: what the line
    adds when stopping at once (e.g. that no checkpoint is configured); ``end(status)``: ends the
    process, or the whole job (default ``os._exit``: a launcher may report another rank's status,
    as it kills the others)."""
    if first is None:
        first = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0) == 0
    _state.update(defer=defer, prefix=prefix, first=first, why=why, end=end or os._exit, stopping_with=None)
    if threading.current_thread() is not threading.main_thread():
        return  # (only the main thread can catch signals: a training run inside a thread of a program)
    if not _state["installed"]:
        for s in STOPPING:
            signal.signal(s, _handler)
        _state["installed"] = True
    if not defer and _state["signal"] is not None:  # a signal came while that was not known yet
        stop_now(_state["signal"])


def _handler(signum, frame) -> None:
    got = _state["signal"]
    if _state["defer"] and (got is None or signum == signal.SIGUSR1):
        if got is None or _PRIORITY[signum] > _PRIORITY[got]:
            _state["signal"] = signum
        return
    stop_now(signum, again=got is not None)


def stop_now(signum: int, again: bool = False) -> None:
    """Print one line and end the process (or job, see :func:`install`) with the exit status
    128 + ``signum``, without Python's teardown."""
    if not _state["first"]:
        time.sleep(STOP_QUIET_S)
    name = signal.Signals(signum).name
    status = _state["stopping_with"] if again and _state["stopping_with"] else 128 + signum
    why = ("again after the signal's checkpoint was written" if status != 128 + signum
           else "again before the checkpoint was written" if again else _state["why"])
    sys.stdout.flush()
    sys.stderr.write(f"{_state['prefix']}stopped by {name}{': ' + why if why else ''} (exit status {status})\n")
    sys.stderr.flush()
    _state["end"](status)
    os._exit(status)  # (if ``end`` returned)


def checkpoint_written(status: int, committed: bool = True) -> int:
    """The run is stopping with ``status`` (75 or 130), returned, after the signal's checkpoint;
    where it was ``committed``, a second signal from now on still ends it at once with that status
    (the checkpoint is there to resume from, and a scheduler requeues on 75), not 128 + the signal."""
    if committed:
        _state["stopping_with"] = status
    return status


def requested() -> int | None:
    """The stop signal received or forwarded (the one a stop reports: SIGINT before SIGTERM before
    SIGUSR1), or None."""
    own, told = _state["signal"], _state["forwarded"]
    if own is None or told is None:
        return own if told is None else told
    return own if _PRIORITY[own] >= _PRIORITY[told] else told


def forwarded(signum: int) -> None:
    """A stop signal another rank received, reported by this one as if its own (:func:`requested`)
    but not counted as one here: a signal of its own after it is still the first (a server told of
    a worker's SIGTERM before its own SIGTERM comes must not stop at once)."""
    told = _state["forwarded"]
    if told is None or _PRIORITY[signum] > _PRIORITY[told]:
        _state["forwarded"] = signum


def exit_status(signum: int | None) -> int:
    """The exit status of a run stopped after its checkpoint by ``signum``: 130 after SIGINT
    (interrupted), else 75 (EX_TEMPFAIL: stopped, to be requeued and resumed)."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 75


def clear() -> None:
    _state["signal"] = _state["forwarded"] = None
