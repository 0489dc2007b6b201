"""How a failure reaches the user: one line, and the traceback only with ``HPCPS_DEBUG=1``.

An error class that knows what it means to the user carries an ``exit_status`` (2: bad input or
config, the user must change something; 1: a run-time failure such as a full disk, a stall or
non-finite numbers); its message is the whole story. An ``OSError`` names its file and cause and
is a run-time failure too. Anything else is a bug: its line says how to see the traceback.
Pure (no MPI): the abort handler (:mod:`hpcps.ps.transport`) and the CLI's ``main`` both use it.
"""

from __future__ import annotations

import os
import sys
import traceback


def debugging() -> bool:
    """``HPCPS_DEBUG=1``: a failure prints its traceback too, not only its one line."""
    return os.environ.get("HPCPS_DEBUG", "") not in ("", "0")


def one_line(exc: BaseException, explained: tuple[str, str] | None = None) -> tuple[str, int]:
    """(the line that reports ``exc``, the exit status). ``explained``: a clearer (type name,
    message) found for it by the caller (an HDF5 write failure, say): a known failure."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    if explained is not None:
        return f"{explained[0]}: {explained[1]}", int(getattr(exc, "exit_status", 1))
    status = getattr(exc, "exit_status", None)
    if isinstance(status, int):
        return f"{type(exc).__name__}: {first}", status
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {first}", 1
    if isinstance(exc, MemoryError):  # (a run-time failure the user can act on, not a bug)
        return f"MemoryError: out of memory{': ' + first if first else ''}{memory_limit()}", 1
    hint = "" if debugging() else " (unexpected: HPCPS_DEBUG=1 prints the traceback)"
    return f"{type(exc).__name__}: {first}{hint}", 1


def memory_limit() -> str:
    """What bounds this process's memory where a limit does (``ulimit -v``: RLIMIT_AS), and what
    lowers a job's need, for a MemoryError's line; '' where no limit is set."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return ""
    if limit == resource.RLIM_INFINITY:
        return ""
    return (f" (this process's address space is limited to {limit / 2**20:,.0f} MiB, ulimit -v; "
            f"data.memory_mb bounds the parsed rows a worker holds, more workers share them)")


def print_traceback(exc: BaseException) -> None:
    """The traceback of ``exc`` to stderr, under ``HPCPS_DEBUG=1`` only."""
    if debugging():
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        sys.stderr.flush()
