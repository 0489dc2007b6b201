"""The MPI settings chosen for a job on one host (hpcps.ps.mpi_env): never over the user's own, only
where MPICH's launcher says every rank is on this host. (A 2-rank job's ranks getting them:
tests/test_startup.py.)"""

from __future__ import annotations

import os

import pytest

from hpcps.ps import mpi_env

ONE_HOST = {"PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "PMI_RANK": "0"}


def chosen(environ: dict) -> dict:
    """What is set in a copy of ``environ``."""
    env = dict(environ)
    return {name: env[name] for name in mpi_env.before_library(env)}


def test_one_host_gets_no_ucx_memory_events_and_eager_messages_under_32_kib():
    assert chosen(ONE_HOST) == {"UCX_MEM_EVENTS": "no", **mpi_env.EAGER}
    assert int(mpi_env.EAGER["MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE"]) > 32768  # (a message under it fits a cell)


def test_many_ranks_on_a_host_keep_mpichs_cells():
    # (each rank's cells 5x larger, mapped by every rank it sends to: not for a node of many ranks)
    many = str(mpi_env.EAGER_MAX_LOCAL_RANKS + 1)
    assert chosen({"PMI_SIZE": many, "MPI_LOCALNRANKS": many}) == {"UCX_MEM_EVENTS": "no"}
    n = str(mpi_env.EAGER_MAX_LOCAL_RANKS)
    assert chosen({"PMI_SIZE": n, "MPI_LOCALNRANKS": n}) == {"UCX_MEM_EVENTS": "no", **mpi_env.EAGER}


def test_nothing_where_the_job_spans_hosts_or_another_launcher_started_it():
    assert chosen({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}) == {}
    assert chosen({"PMI_SIZE": "2", "PMI_RANK": "1"}) == {}  # (Slurm's PMI: no local count)
    assert chosen({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == {}
    assert chosen({}) == {}


def test_the_users_settings_are_never_overridden():
    assert chosen({**ONE_HOST, "UCX_MEM_EVENTS": "yes"}) == mpi_env.EAGER
    for name in ("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE", "MPICH_CH4_IPC_CMA_P2P_THRESHOLD",  # (any spelling,
                 "MPIR_PARAM_CH4_PACK_BUFFER_SIZE", "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS",  # any setting of
                 "MPICH_CH4_IPC_CMA_ENABLE", "MPIR_CVAR_CH4_SHM_POSIX_EAGER"):  # the cells or the rendezvous)
        assert chosen({**ONE_HOST, name: "16384"}) == {"UCX_MEM_EVENTS": "no"}
    for name in mpi_env.NOLOCAL_VARIABLES:  # local messages through the network module
        assert chosen({**ONE_HOST, name: "1"}) == {}


def test_mpi_start_up_is_watched_under_ulfm_only():
    # (a plain job starts nothing; the watch itself: tests/test_ulfm.py, a rank lost in start-up)
    from hpcps.ps import start_up

    assert start_up.watch({"PMI_RANK": "0"}) is None and start_up.watch({"OMPI_MCA_mpi_ft_enable": "0"}) is None
    w = start_up.watch({"OMPI_MCA_mpi_ft_enable": "1", "OMPI_COMM_WORLD_RANK": "3"}, seconds=60)
    assert w is not None
    start_up.started(w)  # (cancelled and reaped: no child left)
    with pytest.raises(ChildProcessError):
        os.waitpid(w.pid, os.WNOHANG)
    assert "rank 3: error: MPI start-up did not finish within 60 s" in start_up.timed_out_line("3", 60)
