"""The MPI library's settings for a job whose ranks all run on one host, chosen before MPI starts.

:mod:`hpcps.ps.transport` calls :func:`before_library` before it imports mpi4py's MPI. On one host
MPICH moves every message between its ranks through shared memory, and its network module
(``netmod``) only starts up and shuts down; one of its start-up costs can then go, where the user
has set nothing:

* ``UCX_MEM_EVENTS=no``, before the library is loaded: MPICH from PyPI links UCX, whose library
  constructor otherwise patches the process's ``mmap`` and ``munmap`` (UCX's memory events, for its
  registration cache of network memory) at every rank's start, a noticeable part of it
  (docs/benchmarks.md). Set for any MPI, as an unused variable of a library not there is harmless.

Not chosen: MPICH's OFI network module (``MPIR_CVAR_CH4_NETMOD=ofi``), which starts a little faster
than UCX's but makes every poll for a message costlier (a serving loop's request 1.5-3 µs more,
docs/benchmarks.md's start-up row), for a start-up no faster once UCX's memory events are off.

One host is what MPICH's launcher (Hydra) says: as many ranks on this host
(``MPI_LOCALNRANKS``) as in the job (``PMI_SIZE``). Other launchers set neither: nothing is done.
Nothing is done either where the user sent local messages through the network module
(``MPIR_CVAR_NOLOCAL``).
"""

from __future__ import annotations

from typing import MutableMapping

NOLOCAL_VARIABLES = ("MPIR_CVAR_NOLOCAL", "MPICH_NOLOCAL", "MPIR_PARAM_NOLOCAL")


def one_host(environ: MutableMapping[str, str]) -> bool:
    """Every rank of this job runs on this host, as MPICH's launcher says, and their messages go
    through shared memory (the user has not set ``MPIR_CVAR_NOLOCAL``)."""
    local, size = environ.get("MPI_LOCALNRANKS", ""), environ.get("PMI_SIZE", "")
    return bool(local) and local == size and not any(name in environ for name in NOLOCAL_VARIABLES)


def before_library(environ: MutableMapping[str, str]) -> list[str]:
    """Settings read as the MPI library is loaded (UCX's memory events off on one host). Returns
    the names set (none where the user set them or the job spans hosts)."""
    if not one_host(environ) or "UCX_MEM_EVENTS" in environ:
        return []
    environ["UCX_MEM_EVENTS"] = "no"
    return ["UCX_MEM_EVENTS"]
