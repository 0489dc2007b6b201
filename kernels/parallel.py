"""Large requests in two threads: the kernels a server updates and reads rows with (the one-pass
lookup and update, the rules' kernels, the one-pass lookup and gather of a pull, the gather after a
hash lookup) release the GIL (``nogil=True``) and touch only the rows of their own keys, which
are distinct within a request, so the two halves of a request's keys can run at once.

A server rank has a second core only while its workers wait for it without polling (see
``hpcps.ps.transport.wait``), as they do on a large request. Handing a half to another thread costs
about 0.1-0.3 ms, so pushes of fewer than ``PARALLEL_MIN_KEYS`` keys and ``PARALLEL_MIN_VALUES``
values (keys x values a key: a training step's pushes) stay on one thread. Pulls gain only when
the worker sleeps through the server's work instead of spinning for the reply's transfer from the
start (the server then sends the reply's header apart, ``hpcps.ps.protocol.PAYLOAD_APART``).
``hpcps bench ps`` measures both, with ``HPCPS_SERVER_THREADS`` 1 against 2.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .tuning import PARALLEL_MIN_KEYS, PARALLEL_MIN_PULL_WORK, PARALLEL_MIN_VALUES, PULL_KEY_VALUES


def server_threads_setting() -> str:
    """``HPCPS_SERVER_THREADS``: "2" (the default), a server runs the halves of a large push or
    pull at once; "1", it does not; anything else is :func:`server_threads_problem`'s."""
    return os.environ.get("HPCPS_SERVER_THREADS", "2").strip()


def server_threads_problem() -> str | None:
    """What is wrong with ``HPCPS_SERVER_THREADS``, or None; the command line says it before a
    job starts."""
    value = server_threads_setting()
    return None if value in ("1", "2") else f"HPCPS_SERVER_THREADS must be 1 or 2 (got {value!r})"


class TwoThreads:
    """Runs ``call(lo, hi)`` over the two halves of ``range(n)`` at once: one half on a helper
    thread, the other on the caller's (for requests that :func:`worth_splitting` says are large
    enough)."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None  # started by the first large request

    def run(self, n: int, call: Callable[[int, int], object]) -> list:
        """The two calls' results, in the order of the halves."""
        m = n // 2
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="hpcps-half")
        other = self.pool.submit(call, m, n)
        first = call(0, m)
        return [first, other.result()]  # (an exception in either half is raised here)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def run_split(threads: TwoThreads | None, n: int, call: Callable[[int, int], object], width: int = 1,
              pull: bool = False) -> list:
    """``call(lo, hi)`` over ``range(n)``: on its two halves at once where :func:`worth_splitting`
    says so, else once; the results, in order."""
    return threads.run(n, call) if worth_splitting(threads, n, width, pull) else [call(0, n)]


def splits_pull(n: int, width: int) -> bool:
    """Whether a server (with two threads) runs a pull of ``n`` keys of ``width`` values in two
    halves; the server then sends its reply's header apart (``hpcps.ps.protocol.PAYLOAD_APART``),
    so that the worker sleeps through it rather than spinning (a split pull is slower while the
    worker spins)."""
    return n * (width + PULL_KEY_VALUES) >= PARALLEL_MIN_PULL_WORK


def worth_splitting(threads: TwoThreads | None, n: int, width: int = 1, pull: bool = False) -> bool:
    """Whether a push (or a ``pull``, see :func:`splits_pull`) of ``n`` keys of ``width`` values
    goes to :meth:`TwoThreads.run` (else its kernel runs once, on the caller's thread)."""
    if threads is None or n < 2:
        return False
    if pull:
        return splits_pull(n, width)
    return n * width >= PARALLEL_MIN_VALUES or n >= PARALLEL_MIN_KEYS
