"""The MPI settings chosen for a job on one host (hpcps.ps.mpi_env): never over the user's own, only
where MPICH's launcher says every rank is on this host, the network module only where the library
has it. (A 2-rank job's ranks getting them: tests/test_startup.py.)"""

from __future__ import annotations

from hpcps.ps import mpi_env

# MPICH from PyPI (5.0.2), as MPI_Get_library_version says it, and one built with UCX alone
MPICH_BOTH = ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\nMPICH ABI:          18:2:6\n"
              "MPICH Device:       ch4:ucx ofi\nMPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n")
MPICH_UCX = MPICH_BOTH.replace("ch4:ucx ofi", "ch4:ucx")
OPEN_MPI = "Open MPI v5.0.8, package: Open MPI Distribution, ident: 5.0.8, repo rev: v5.0.8, Jun 02, 2025"
ONE_HOST = {"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "PMI_RANK": "0"}


def chosen(environ: dict, version: str = MPICH_BOTH, reachable: bool = True) -> dict:
    """What both steps set in a copy of ``environ``, in the order the transport calls them."""
    env = dict(environ)
    names = mpi_env.before_library(env) + mpi_env.before_init(env, version, lambda: reachable)
    return {name: env[name] for name in names}


def test_one_host_of_mpich_with_both_modules_gets_ofi_and_no_ucx_memory_events():
    assert mpi_env.mpich_netmods(MPICH_BOTH) == ("ucx", "ofi")
    assert chosen(ONE_HOST) == {"UCX_MEM_EVENTS": "no", "MPIR_CVAR_CH4_NETMOD": "ofi"}


def test_nothing_where_the_job_spans_hosts_or_another_launcher_started_it():
    assert chosen({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}) == {}
    assert chosen({"PMI_SIZE": "2", "PMI_RANK": "1"}) == {}  # (Slurm's PMI: no local count)
    assert chosen({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, OPEN_MPI) == {}
    assert chosen({}) == {}


def test_the_users_settings_are_never_overridden():
    for name in mpi_env.NETMOD_VARIABLES:  # a netmod chosen under any of MPICH's prefixes
        assert chosen({**ONE_HOST, name: "ucx"}) == {"UCX_MEM_EVENTS": "no"}
    assert chosen({**ONE_HOST, "UCX_MEM_EVENTS": "yes"}) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert chosen({**ONE_HOST, "UCX_TLS": "tcp,self"}) == {"UCX_MEM_EVENTS": "no"}  # UCX configured: UCX kept
    assert chosen({**ONE_HOST, "MPIR_CVAR_NOLOCAL": "1"}) == {}  # local messages through the network module


def test_the_network_module_only_where_the_library_has_it_and_the_host_an_address_for_it():
    assert chosen(ONE_HOST, MPICH_UCX) == {"UCX_MEM_EVENTS": "no"}
    assert chosen(ONE_HOST, OPEN_MPI) == {"UCX_MEM_EVENTS": "no"}
    assert chosen(ONE_HOST, reachable=False) == {"UCX_MEM_EVENTS": "no"}
