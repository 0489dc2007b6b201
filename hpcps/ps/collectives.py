"""Collective operations named for what they mean, for the layers above the parameter server.

Training and the command line agree, decide and gather through these, never through
:mod:`hpcps.ps.transport` itself:

* :class:`Collectives`: the operations over one set of ranks (every rank of a job, its workers,
  its servers, a worker group), each waiting with the job's stall timeout and named in the stall
  messages by ``what`` it is for;
* :class:`World`: the same over the whole world before a parameter-server context exists (the
  command line's agreement on its configuration, a run's resume and checkpoint decisions), and the
  end of the job (with a line, or without a word after one was said);
* :class:`ContextCollectives`: what a :class:`hpcps.ps.context.Context` exposes, one
  :class:`Collectives` per set of ranks (``every_rank``, ``among_workers``, ``among_servers``,
  ``within_group``).

Every method is collective over its ranks: each of them must call it, in the same order.

Under ULFM (``cluster.fault_tolerance = "ulfm"``) the operations every rank contributes to
(reductions, sizes, agreements, barriers) meet a lost member as a failure on every rank, which
then shrink the communicator to the survivors and do the operation again among them
(:meth:`Collectives.without_lost`); the first rank's decisions and data (a broadcast, a gather)
end the job instead, as without ULFM.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from hpcps.ps import transport


class Collectives:
    """The collective operations over the ranks of ``comm``, each waiting at most ``timeout``
    seconds (then the job stops, naming the ranks that never came). ``shrink``: under ULFM, makes
    (collective over the survivors) and returns the survivors' communicator."""

    def __init__(self, comm, timeout: float | None, shrink=None):
        self.comm = comm
        self.timeout = timeout
        self.shrink = shrink

    def without_lost(self) -> None:
        """Collective over the ranks alive: these ranks become the survivors (under ULFM)."""
        if self.shrink is not None:
            self.comm = self.shrink()

    def _every_rank(self, operation, *args):
        """``operation(comm, *args)``; where a rank is lost (under ULFM), again among the survivors."""
        while True:
            try:
                return operation(self.comm, *args)
            except transport.RankFailed:
                if self.shrink is None:
                    raise
                self.without_lost()

    @property
    def rank(self) -> int:
        """This rank's number among these ranks."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """How many ranks these are."""
        return self.comm.Get_size()

    @property
    def is_first(self) -> bool:
        """This rank speaks for these ranks (decides, prints, writes)."""
        return self.comm.Get_rank() == 0

    # -- decisions --------------------------------------------------------------------------

    def first_decides(self, value, what: str):
        """The first rank's ``value`` (a small picklable object), on every rank: what it alone
        decided (a checkpoint to resume, a configuration it read) becomes everyone's."""
        return transport.bcast_object(self.comm, value, 0, self.timeout, what)

    def same_everywhere(self, value: int, what: str) -> bool:
        """Whether every rank passed the same integer ``value`` (the same answer on every rank)."""
        return self._every_rank(transport.agree, value, self.timeout, what)

    def failures(self, error: str | None, what: str) -> list[str]:
        """Every rank's error (``"rank r: message"``, in rank order; empty when none failed): the
        same verdict on every rank, so that they fail together with the same message."""
        return self._every_rank(transport.all_ok, error, self.timeout, what)

    # -- reductions -------------------------------------------------------------------------

    def reduce(self, values: np.ndarray, op: str, what: str) -> np.ndarray:
        """``values`` combined element by element over the ranks (``op``: sum, max or min)."""
        return self._every_rank(transport.allreduce, values, op, self.timeout, what)

    def _one(self, value, op: str, what: str):
        got = self._every_rank(transport.allreduce, np.array([value]), op, self.timeout, what)[0]
        return int(got) if isinstance(value, (int, np.integer)) else float(got)

    def total(self, value, what: str):
        """The sum of one number over the ranks (an int stays an int)."""
        return self._one(value, "sum", what)

    def largest(self, value, what: str):
        """The largest of the ranks' numbers (an int stays an int)."""
        return self._one(value, "max", what)

    def smallest(self, value, what: str):
        """The smallest of the ranks' numbers (an int stays an int)."""
        return self._one(value, "min", what)

    # -- data -------------------------------------------------------------------------------

    def sizes(self, value: int, what: str) -> np.ndarray:
        """Every rank's integer ``value``, in rank order (int64), on every rank."""
        return self._every_rank(transport.allgather_int, value, self.timeout, what)

    def gather_to_first(self, array: np.ndarray, counts: np.ndarray, what: str) -> np.ndarray | None:
        """Every rank's ``array`` (``counts[r]`` elements from rank ``r``: see :meth:`sizes`),
        concatenated in rank order on the first rank; None on the others."""
        return transport.gatherv(self.comm, np.ascontiguousarray(array), counts, 0, self.timeout, what)

    def share_from_first(self, array: np.ndarray, what: str) -> None:
        """The first rank's ``array`` into every rank's (in place; the same shape everywhere)."""
        transport.bcast(self.comm, array, 0, self.timeout, what)

    def wait_for_all(self, what: str) -> None:
        """Return once every rank has come here (sleeping meanwhile)."""
        self._every_rank(transport.barrier, self.timeout, what)

    def end_job_by_first(self, line: str, code: int, what: str = "the stop of the job") -> None:
        """End the whole job with exit status ``code``, the first of these ranks printing ``line``
        (the others wait for the end): a failure every one of them knows of, said once."""
        if self.is_first:
            transport.abort(line, code=code)
        self.wait_for_all(what)

    def complete(self, started) -> None:
        """Wait for a collective started without waiting (its Pending), e.g. a dense table's
        :meth:`~hpcps.ps.client.DenseTable.start_allreduce`."""
        transport.finish_collective(self.comm, started, self.timeout)


class World(Collectives):
    """The whole job's ranks (``comm``, default MPI's world) before a parameter-server context
    exists, and the end of the job."""

    def __init__(self, comm=None, timeout: float | None = None):
        super().__init__(comm if comm is not None else transport.world(), timeout)

    @property
    def prefix(self) -> str:
        """``"rank r/n"``: how this rank names itself in its lines."""
        return transport.rank_prefix(self.comm)

    @staticmethod
    def fault_tolerance_missing(mode: str) -> str | None:
        """Why this job cannot run with ``cluster.fault_tolerance = mode`` (None: it can)."""
        return transport.ulfm_missing() if mode == "ulfm" else None

    @staticmethod
    def stop_on_unhandled_errors() -> None:
        """From now on an exception no one catches, on any rank and thread, ends the whole job
        with one line (instead of the other ranks waiting for this one for ever)."""
        transport.install_abort_handler()

    @staticmethod
    def end_job(code: int) -> None:
        """End the whole job at once with exit status ``code``, adding nothing to what was said."""
        transport.end_job(code)

    @staticmethod
    def end_job_with(line: str, code: int) -> None:
        """End the whole job with exit status ``code`` after this rank prints ``line`` (with its
        rank) to standard error: for a failure only this rank knows, while the others serve or
        step and cannot be asked to agree."""
        transport.abort(line, code=code)


class ContextCollectives:
    """What a parameter-server context offers its users for collective work: one
    :class:`Collectives` per set of its ranks. Needs ``net`` (its transport), ``stall_timeout_s``
    and ``fault_tolerant`` (a context's): under ULFM each shrinks the transport's communicator."""

    def _collectives(self, name: str) -> Collectives:
        """The collectives over the transport's communicator ``name``."""
        def shrink():
            self.net.shrink(name, self.stall_timeout_s)
            return getattr(self.net, name)

        return Collectives(getattr(self.net, name), self.stall_timeout_s, shrink if self.fault_tolerant else None)

    @cached_property
    def every_rank(self) -> Collectives:
        """Every rank of the job: servers and workers."""
        return self._collectives("everyone")

    @cached_property
    def among_workers(self) -> Collectives:
        """The workers (on a worker; a server has none)."""
        return self._collectives("workers")

    @cached_property
    def among_servers(self) -> Collectives:
        """The servers (on a server; a worker has none)."""
        return self._collectives("servers")

    @cached_property
    def within_group(self) -> Collectives:
        """This worker's group (the workers whose pushes it merges)."""
        return self._collectives("group")
