"""Keep freed memory for reuse: glibc's allocator settings for an hpcps process.

A training step allocates and frees arrays of 0.1-2 MB (a batch's unique keys and positions,
pulled rows, gradients, messages). With its defaults glibc serves large requests with fresh
mappings and hands memory at the top of its heap back to the kernel once a little of it is free,
so the next step faults the same pages in again (and the kernel zeroes them). Where a page fault
is costly (a sandboxed kernel such as gVisor) that is several percent of a job's time
(``hpcps bench vw``; the figures are in docs/benchmarks.md); a bare-metal kernel faults faster.

:func:`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB), keeps up to
1 GiB free at the top of the heap, and grows the heap 64 MiB at a time. Freed memory then stays
in the process for the next step; the peak RSS does not change, since the peak is what was in use.
``HPCPS_MALLOC_TUNE=0``, or any ``MALLOC_*`` variable of glibc's own, leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import os

ENV = "HPCPS_MALLOC_TUNE"
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))


def keep_freed_memory() -> bool:
    """Apply :data:`SETTINGS` with glibc's ``mallopt``; False where not applied (turned off, the
    user's own ``MALLOC_*`` settings, or a C library without ``mallopt``)."""
    if os.environ.get(ENV, "1") == "0" or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
