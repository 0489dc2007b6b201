"""A bound on MPI's own start-up under ULFM, where a rank lost before it finished would otherwise
leave the others waiting for ever (pure: no MPI; :mod:`hpcps.ps.transport` calls it around its
import of mpi4py's MPI, which starts MPI).

Under ULFM (``mpiexec --with-ft ulfm``) the launcher does not end a job that lost a rank, and a
rank killed before MPI start-up finished leaves the others inside Open MPI's start-up (a PMIx fence
and ``PMIx_Get``) for good, outside every timeout of hpcps: MPI calls start after it. mpi4py starts
MPI while it holds Python's lock, so no Python thread can watch it. Two things that need no lock:

* ``faulthandler.dump_traceback_later(exit=True)``, a C thread: after ``MPI_START_UP_TIMEOUT_S``
  seconds (a tuned knob, ``HPCPS_TUNE_MPI_START_UP_TIMEOUT_S``) it writes a traceback of every
  thread and ends the rank with exit status 1 (a status ``mpiexec --with-ft ulfm`` reports: it
  takes a rank killed by a signal for a fault it tolerates, and exits 0);
* a watcher, a shell reading the traceback's pipe: at its first line it writes the one line a user
  reads (naming the knob) instead, and throws the traceback away. It ends by itself at the pipe's
  end, when the rank ends in any way.

Both are cancelled (the C thread stopped, the watcher killed and reaped) once MPI has started.
Only under ULFM: elsewhere MPI ends a job that lost a rank, and nothing is started. Python keeps
one such timer a process: one set before (a user's) is replaced, and not set again after. Each
rank that times out says its own line.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from dataclasses import dataclass
from typing import Mapping

from hpcps_kernels.tuning import ENV_PREFIX, MPI_START_UP_TIMEOUT_S

TIMEOUT_VARIABLE = ENV_PREFIX + "MPI_START_UP_TIMEOUT_S"

# $1 the line; its standard input the pipe faulthandler writes to (its end: the rank ended)
_WATCHER = 'if read -r _; then printf "%s\\n" "$1" >&2; fi; exec cat >/dev/null'
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


@dataclass(frozen=True)
class Watch:
    """What :func:`watch` started: the watcher's pid and the write end of its pipe."""

    pid: int
    pipe: int


def under_ulfm(environ: Mapping[str, str]) -> bool:
    """Open MPI launched with ``mpiexec --with-ft ulfm`` (it sets ``OMPI_MCA_mpi_ft_enable``)."""
    return environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")


def launcher_rank(environ: Mapping[str, str]) -> str:
    """This process's rank as its launcher says (before MPI has started), or "?"."""
    return next((environ[v] for v in _RANK_VARIABLES if environ.get(v, "").isdigit()), "?")


def timed_out_line(rank: str, seconds: float) -> str:
    """What a rank whose MPI start-up did not finish in ``seconds`` says."""
    return (f"hpcps: rank {rank}: error: MPI start-up did not finish within {seconds:g} s: under ULFM a rank lost "
            f"before it finished (killed, its node gone) leaves the others waiting in Open MPI's start-up for "
            f"ever, so this rank ends; if start-up is only slow, raise {TIMEOUT_VARIABLE} (seconds)")


def watch(environ: Mapping[str, str], seconds: float = MPI_START_UP_TIMEOUT_S) -> Watch | None:
    """Under ULFM, bound this process's MPI start-up to ``seconds`` (None elsewhere: nothing is
    started). With the tests-only ``HPCPS_TEST_KILL = "start-up:RANK"`` that rank then kills
    itself, as a rank lost before MPI start-up finished (tests/test_ulfm.py)."""
    if not under_ulfm(environ):
        return None
    rank = launcher_rank(environ)
    read_end, write_end = os.pipe()  # (neither inherited by anything else the rank starts)
    try:
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", _WATCHER, "sh", timed_out_line(rank, seconds)], dict(environ),
                             file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0),
                                           (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
    except OSError:  # (no shell to start: MPI starts unwatched, as elsewhere)
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    faulthandler.dump_traceback_later(seconds, exit=True, file=write_end)
    if environ.get("HPCPS_TEST_KILL") == f"start-up:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
    return Watch(pid, write_end)


def started(w: Watch | None) -> None:
    """MPI has started (or failed to): cancel what :func:`watch` started, if anything."""
    if w is None:
        return
    faulthandler.cancel_dump_traceback_later()
    os.close(w.pipe)
    try:
        os.kill(w.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(w.pid, 0)
