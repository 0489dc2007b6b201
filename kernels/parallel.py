"""Large requests in two threads: the kernels a server updates and reads rows with (the one-pass
lookup and update, the rules' kernels, the one-pass lookup and gather of a pull, the gather after a
hash lookup) release the GIL (``nogil=True``) and touch only the rows of their own keys, which
are distinct within a request, so the halves of a request's keys can run at once.

A server rank has a second core only while its workers wait for it without polling (see
``hpcps.ps.transport.wait``), as they do on a large request. Handing a half to another thread costs
about 0.1-0.3 ms here (gVisor), so pushes of fewer than ``PARALLEL_MIN_KEYS`` keys and
``PARALLEL_MIN_VALUES`` values (keys x values a key: a training step's pushes) stay on one thread.
``hpcps bench ps`` on this 2-core machine, alternating one thread and two: a push of 100 k keys
at dim 1 1.25-1.29 against 1.53-1.55 ms (3 pairs, quiet machine), of 1 M keys 9.7-10.0 against
14.1-14.7 ms, of 100 k keys at dim 64 11.3-13.3 against 15.2-15.4 ms. Pulls gained only once the
worker slept through the server's work instead of spinning for the reply's transfer from the
start (``hpcps.ps.protocol.announced``): the server's own pull of 1 M keys at dim 64 then took
23-28 against 61 ms (the reply's pages no longer faulted in anew, too), of 100 k 2.8-3.0 against
4.2-4.7 ms, of 1 M keys at dim 1 2.9-3.2 against 5.0-5.4 ms (3 alternating pairs).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

PARALLEL_MIN_KEYS = 1 << 16  # pushes of fewer keys ...
PARALLEL_MIN_VALUES = 1 << 19  # ... and fewer values (keys x width) run on one thread
# A pull runs its halves at once from PARALLEL_MIN_PULL_WORK of ``keys x (values a key +
# PULL_KEY_VALUES)``: a server's pull took here about 5 ns a key plus 0.45 ns a value (a key's
# lookup costs as much as copying 11 values), and two threads paid from about 1.5 ms of it
# (dim 64: 40 k keys 2.9-3.4 against 3.9-4.1 ms; 20 k keys 1.6-1.7 against 1.2-1.3 ms split).
PARALLEL_MIN_PULL_WORK = 1 << 21
PULL_KEY_VALUES = 8


class Halves:
    """Runs ``call(lo, hi)`` over the two halves of ``range(n)``: one on a helper thread, one on
    the caller's (for requests that :func:`worth` says are large enough)."""

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


def over(halves: Halves | None, n: int, call: Callable[[int, int], object], width: int = 1,
         pull: bool = False) -> list:
    """``call(lo, hi)`` over ``range(n)``: on its two halves at once where :func:`worth` says so,
    else once; the results, in order."""
    return halves.run(n, call) if worth(halves, n, width, pull) else [call(0, n)]


def splits_pull(n: int, width: int) -> bool:
    """Whether a server (with two threads) runs a pull of ``n`` keys of ``width`` values in two
    halves; its reply is then announced (``hpcps.ps.protocol.announced``), so that the worker sleeps
    through it rather than spinning (a pull split while the worker spun, 100 k keys at dim 1:
    0.64-0.91 against 0.57-0.58 ms)."""
    return n * (width + PULL_KEY_VALUES) >= PARALLEL_MIN_PULL_WORK


def worth(halves: Halves | None, n: int, width: int = 1, pull: bool = False) -> bool:
    """Whether a push (or a ``pull``, see :func:`splits_pull`) of ``n`` keys of ``width`` values
    goes to :meth:`Halves.run` (else its kernel runs once, on the caller's thread)."""
    if halves is None or n < 2:
        return False
    if pull:
        return splits_pull(n, width)
    return n * width >= PARALLEL_MIN_VALUES or n >= PARALLEL_MIN_KEYS
