"""The MPI library's settings for a job whose ranks all run on one host, chosen before MPI starts.

:mod:`hpcps.ps.transport` calls :func:`before_library` before it imports mpi4py's MPI. On one host
MPICH moves every message between its ranks through shared memory, and its network module
(``netmod``) only starts up and shuts down; one of its start-up costs can then go, where the user
has set nothing:

* ``UCX_MEM_EVENTS=no``, before the library is loaded: MPICH from PyPI links UCX, whose library
  constructor otherwise patches the process's ``mmap`` and ``munmap`` (UCX's memory events, for its
  registration cache of network memory) at every rank's start, a noticeable part of it
  (docs/benchmarks.md). Set for any MPI, as an unused variable of a library not there is harmless.
* Messages under 32 KiB sent eagerly, through MPICH's shared-memory cells (:data:`EAGER`): by
  default a message over about 8 KiB goes by its cross-memory (CMA) rendezvous, which completes
  only once the receiver has matched it and the sender has made progress again, and a server then
  pays that handshake on each such request (a 1,000-key push is 12 KB, a push-pull 20 KB: more
  to receive than an 8 KB pull, docs/benchmarks.md). The cells are made larger than the threshold
  (a message just under it fits one, with its header), and MPICH's pack buffer as large as a cell
  (it must be); larger messages keep the rendezvous, a single copy. The cells are shared memory,
  each rank's 5x the default (2.6 MB against 0.5), mapped by every rank it sends to: only for at
  most :data:`EAGER_MAX_LOCAL_RANKS` ranks on the host (a node of many ranks keeps MPICH's sizes,
  and a container's small ``/dev/shm`` its room), and only where the user set none of MPICH's
  settings of these cells or of its CMA rendezvous.

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
# MPICH's settings for eager messages up to 32 KiB on one host (see above): the rendezvous's
# threshold, the cells' size, the pack buffer's (at least a cell's)
EAGER = {"MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD": "32768", "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE": "40960",
         "MPIR_CVAR_CH4_PACK_BUFFER_SIZE": "40960"}
EAGER_MAX_LOCAL_RANKS = 16  # (16 ranks' cells: 42 MB of shared memory in all, against 8 MB)
# a user's setting of any of these (under any of MPICH's spellings) leaves EAGER unset
_EAGER_FAMILIES = ("CH4_IPC_CMA_", "CH4_SHM_POSIX_IQUEUE_", "CH4_PACK_BUFFER_", "CH4_SHM_POSIX_EAGER")
_SPELLINGS = ("MPIR_CVAR_", "MPICH_", "MPIR_PARAM_")


def one_host(environ: MutableMapping[str, str]) -> bool:
    """Every rank of this job runs on this host, as MPICH's launcher says, and their messages go
    through shared memory (the user has not set ``MPIR_CVAR_NOLOCAL``)."""
    local, size = environ.get("MPI_LOCALNRANKS", ""), environ.get("PMI_SIZE", "")
    return bool(local) and local == size and not any(name in environ for name in NOLOCAL_VARIABLES)


def _eager_set_by_user(environ: MutableMapping[str, str]) -> bool:
    """Whether the user set any of MPICH's settings of its cells, its pack buffers or its CMA
    rendezvous (``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS``, ``MPICH_CH4_IPC_CMA_ENABLE``, ...)."""
    return any(name.startswith(prefix + family) for name in environ for prefix in _SPELLINGS
               for family in _EAGER_FAMILIES)


def before_library(environ: MutableMapping[str, str]) -> list[str]:
    """Settings read as the MPI library is loaded (on one host: UCX's memory events off, messages
    under 32 KiB eager). Returns the names set (none where the user set them or the job spans
    hosts)."""
    if not one_host(environ):
        return []
    chosen = {} if "UCX_MEM_EVENTS" in environ else {"UCX_MEM_EVENTS": "no"}
    local = environ["MPI_LOCALNRANKS"]
    if local.isdigit() and int(local) <= EAGER_MAX_LOCAL_RANKS and not _eager_set_by_user(environ):
        chosen.update(EAGER)
    environ.update(chosen)
    return list(chosen)
