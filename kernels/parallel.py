"""Large requests in two threads: the kernels a server runs on a request's keys (lookups, pulls,
update rules) release the GIL (``nogil=True``) and touch only the rows of their own keys, which
are distinct within a request, so the halves of a request's keys can run at once.

A server rank has a second core only while its workers wait for it without polling (see
``hpcps.transport.wait``), as they do on a large request. Requests of fewer than
``PARALLEL_MIN_VALUES`` values (keys x values a key) stay on one thread: handing a half to another
thread costs about 0.1-0.3 ms here (gVisor), so on this 2-core machine a push of 100 k keys at
dim 1 (1 ms of the server's work) gained nothing in 3 alternating runs of ``hpcps bench ps``,
while at 1 M keys the push took 9.7-10.0 against 14.1-14.7 ms (the server's own time 5.3
against 9.7 ms), and at dim 64 a push of 100 k keys 11.3-13.3 against 15.2-15.4 ms.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

PARALLEL_MIN_VALUES = 1 << 19  # requests of fewer values (keys x width) run on one thread


class Halves:
    """Runs ``call(lo, hi)`` over the two halves of ``range(n)``: one on a helper thread, one on
    the caller's, when ``n * width >= PARALLEL_MIN_VALUES``; else ``call(0, n)`` alone."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None  # started by the first large request

    def run(self, n: int, call: Callable[[int, int], object], width: int = 1) -> list:
        """The results of the calls, in the order of the ranges (one or two)."""
        if not worth(self, n, width):
            return [call(0, n)]
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


def worth(halves: Halves | None, n: int, width: int = 1) -> bool:
    """Whether :meth:`Halves.run` would split a request of ``n`` keys of ``width`` values (the
    callers call their kernel directly otherwise, without the closure)."""
    return halves is not None and n >= 2 and n * width >= PARALLEL_MIN_VALUES
