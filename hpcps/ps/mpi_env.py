"""The MPI library's settings for a job whose ranks all run on one host, chosen before MPI starts.

:mod:`hpcps.ps.transport` starts MPI and calls these first. On one host MPICH moves every message
between its ranks through shared memory, and its network module (``netmod``) only starts up and
shuts down; two of its start-up costs can then go, each only where the user has set nothing:

* ``UCX_MEM_EVENTS=no``, before the library is loaded: MPICH from PyPI links UCX, whose library
  constructor otherwise patches the process's ``mmap`` and ``munmap`` (UCX's memory events, for its
  registration cache of network memory) at every rank's start, a noticeable part of it
  (docs/benchmarks.md). Set for any MPI, as an unused variable of a library not there is harmless.
* ``MPIR_CVAR_CH4_NETMOD=ofi``, before ``MPI_Init``: where the MPICH loaded was built with both
  UCX and libfabric (OFI) network modules, OFI's starts faster than UCX's, the default. Only
  where the library says it has that module (an MPICH without it crashes at ``MPI_Init`` when
  asked for it) and where this host can reach its loopback address (OFI's TCP provider, the one
  it finds on a host without a fast network, needs an address: without any, MPICH's
  ``MPI_Finalize`` fails).

One host is what MPICH's launcher (Hydra) says: as many ranks on this host
(``MPI_LOCALNRANKS``) as in the job (``PMI_SIZE``). Other launchers set neither: nothing is done.
Nothing is done either where the user sent local messages through the network module
(``MPIR_CVAR_NOLOCAL``), and the network module is left alone where any ``UCX_`` setting says the
user configured UCX.
"""

from __future__ import annotations

import socket
from typing import Callable, MutableMapping

# the names MPICH reads its netmod choice under (a control variable takes any of these prefixes)
NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")
NOLOCAL_VARIABLES = ("MPIR_CVAR_NOLOCAL", "MPICH_NOLOCAL", "MPIR_PARAM_NOLOCAL")
FAST_NETMOD = "ofi"


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


def mpich_netmods(library_version: str) -> tuple[str, ...]:
    """The network modules of an MPICH ch4 library, from its ``MPI_Get_library_version`` text
    (its line ``MPICH Device:    ch4:ucx ofi``); empty for any other library."""
    for line in library_version.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MPICH Device":
            device = value.strip()
            return tuple(device[4:].replace(",", " ").split()) if device.startswith("ch4:") else ()
    return ()


def loopback_reachable() -> bool:
    """This host can reach its loopback address (a UDP socket's connect finds a route to
    127.0.0.1; nothing is sent). A host without a network of its own (a fresh network namespace:
    its loopback interface down) cannot."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("127.0.0.1", 9))
        return True
    except OSError:
        return False


def before_init(environ: MutableMapping[str, str], library_version: str,
                reachable: Callable[[], bool] = loopback_reachable) -> list[str]:
    """Settings read by ``MPI_Init`` (OFI's network module on one host, where the library has it
    and the host can reach its loopback address). Returns the names set (none where the user
    chose a netmod or configured UCX)."""
    chosen = any(name in environ for name in NETMOD_VARIABLES)
    ucx_configured = any(name.startswith("UCX_") and name != "UCX_MEM_EVENTS" for name in environ)
    if not one_host(environ) or chosen or ucx_configured:
        return []
    if FAST_NETMOD not in mpich_netmods(library_version) or not reachable():
        return []
    environ[NETMOD_VARIABLES[0]] = FAST_NETMOD
    return [NETMOD_VARIABLES[0]]
