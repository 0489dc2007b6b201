"""A job that goes on without a lost rank (``cluster.fault_tolerance = "ulfm"``): the "rank lost"
events of the servers and the workers.

Under ULFM (Open MPI launched with ``mpiexec --with-ft ulfm``) a rank that dies makes the MPI calls
that involve it fail, and :mod:`hpcps.ps.transport` raises :class:`~hpcps.ps.transport.RankFailed`
with the world ranks lost. What happens then:

* **A server learns it first**, in its serving loop (a probe for requests from any rank fails at
  once). :meth:`ServerRecovery.ranks_lost` is its "rank lost" event. A lost *worker*: the servers
  agree on its last complete clock (the smallest of their views), each drops it from its worker
  clocks (:meth:`hpcps.ps.consistency.WorkerClocks.lose`: the others no longer wait for it; its
  pushes of later clocks and its reads are dropped), forgets its replies in flight, and the first
  server tells every surviving worker (a :data:`TAG_LOST` message: the worker and that clock). A
  lost *server* calls :attr:`ServerRecovery.on_server_lost`: without replicas it ends the job (one
  line naming the rank, exit status 1; ``hpcps supervise`` restarts it from the last checkpoint);
  a server with replicas plugs its failover in there.
* **The workers** go on meanwhile (under BSP the clock the lost worker missed completes without
  it). At their next agreement point (the end of an epoch, :meth:`WorkerRecovery.lost_workers`,
  which the context's :meth:`~hpcps.ps.context.Context.lost_workers` calls) they shrink their
  communicators to the survivors and read the first server's notices: which workers were lost and
  where their data stood, so that training takes over their rows (:mod:`hpcps.train.takeover`).
  A collective among the workers that meets a lost member before that shrinks the communicator
  and is done again among the survivors (:class:`hpcps.ps.collectives.Collectives`).

Messages keep the world communicator and its rank numbers for the job's life; only the collective
communicators are replaced by the survivors' (:meth:`hpcps.ps.transport.Transport.shrink`).
"""

from __future__ import annotations

import numpy as np

from hpcps.ps import protocol, transport

TAG_LOST = 3  # a server's notice of a lost worker (protocol's tags: 1 and 2, and the replies' from 16)
assert TAG_LOST not in (protocol.TAG_REQUEST, protocol.TAG_GRADS) and TAG_LOST < protocol.TAG_REPLY_BASE
NOTICE = 2    # int64 words of a notice: the lost worker's index, its last complete clock


class ServerRecovery:
    """A server's "rank lost" event (:meth:`ranks_lost`) and what it knows of the ranks lost.

    ``on_server_lost(rank)``: what a lost server does to this one (default: end the job, saying
    which server was lost); a server with replicas replaces it by its failover."""

    def __init__(self, server):
        self.server = server
        self.lost: dict[int, int] = {}  # world rank lost -> its last complete clock (-1: a server)
        self.on_server_lost = self.end_job

    def ranks_lost(self, failure: transport.RankFailed) -> None:
        """The world ranks a :class:`~hpcps.ps.transport.RankFailed` names: drop each worker, fail
        over (or end the job) for each server. A reply to a worker known lost already is
        forgotten; a failure that names no rank is raised again (MPI fails for another reason)."""
        server = self.server
        if not failure.ranks:
            raise failure
        new = [r for r in failure.ranks if r not in self.lost and r != server.net.rank]
        server.replies.sending = [p for p in server.replies.sending if p.peer not in self.lost]
        for rank in new:
            if rank < server.worker_rank0:
                self.lost[rank] = -1
                self.on_server_lost(rank)
        workers = [r - server.worker_rank0 for r in new if r >= server.worker_rank0]
        if workers:
            self.workers_lost(workers)

    def end_job(self, rank: int) -> None:
        raise transport.RankFailed([rank], "serving")

    def workers_lost(self, workers: list[int]) -> None:
        """Lost workers: the servers agree on their last complete clocks (collective over the
        servers: each comes here on its own detection), drop them and tell the survivors."""
        server = self.server
        n = server.workers.num_workers
        view = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        for w in workers:
            view[w] = server.workers.clocks[w]
        for rank, clock in self.lost.items():  # (what this server dropped already stays dropped)
            if rank >= server.worker_rank0:
                view[rank - server.worker_rank0] = clock
        if server.placement.num_servers > 1:
            view = transport.allreduce(server.net.servers, view, "min", server.stall_timeout_s,
                                       "agreement of the servers on the workers lost")
        dropped = [(w, int(view[w])) for w in np.flatnonzero(view < np.iinfo(np.int64).max).tolist()
                   if w + server.worker_rank0 not in self.lost]
        for w, clock in dropped:
            self.lost[w + server.worker_rank0] = clock
            server.lose_worker(w, clock)
        if server.index == 0 and dropped:
            self.tell_the_survivors(dropped)

    def tell_the_survivors(self, dropped: list[tuple[int, int]]) -> None:
        """The first server: a notice of each lost worker to every worker still there."""
        server = self.server
        for rank in range(server.worker_rank0, server.worker_rank0 + server.workers.num_workers):
            if rank in self.lost:
                continue
            for w, clock in dropped:
                notice = np.array([w, clock], dtype=np.int64)
                server.replies.sending += server.net.start_send(notice, rank, TAG_LOST, f"notice of worker {w} lost")


class WorkerRecovery:
    """A worker's side of lost workers: the notices of the first server, read when the workers
    agree to look (:meth:`lost_workers`)."""

    def __init__(self, net: transport.Transport, worker_rank0: int, timeout: float | None):
        self.net = net
        self.worker_rank0 = worker_rank0
        self.timeout = timeout
        self.known: set[int] = set()  # world ranks of the workers lost whose takeover was decided
        self.read: dict[int, int] = {}  # world rank -> last complete clock, of the notices read

    def notices(self, ranks: list[int]) -> list[tuple[int, int]]:
        """(worker index, last complete clock) of each lost worker of world ``ranks`` not taken
        over yet, from the first server's notices (waits for them: the first server sends one per
        lost worker as soon as the servers agree). A notice of a worker lost later is kept for
        the call that names it."""
        new = sorted(r for r in ranks if r >= self.worker_rank0 and r not in self.known)
        while any(r not in self.read for r in new):
            notice = np.empty(NOTICE, dtype=np.int64)
            transport.wait(self.net.start_recv(notice, 0, TAG_LOST, "the first server's notice of a lost worker"),
                           self.timeout)
            self.read[int(notice[0]) + self.worker_rank0] = int(notice[1])
        self.known.update(new)
        return [(r - self.worker_rank0, self.read[r]) for r in new]


class ContextRecovery:
    """What a worker's context does under ULFM (a mixin of :class:`hpcps.ps.context.Context`):
    ``recovery`` is its :class:`WorkerRecovery`, set by ``hpcps.ps.init`` where
    ``fault_tolerant``."""

    fault_tolerant = False  # under ULFM: the job goes on without a lost worker

    def lost_workers(self) -> list[tuple[int, int]]:
        """Workers (collective over those alive): under ULFM, the workers lost since the last call,
        as (worker index, last complete clock), their communicators shrunk to the survivors
        (this module); else none."""
        if not self.fault_tolerant or not self.is_worker:
            return []
        self.among_workers.total(1, "roll call of the workers")  # (a lost member: shrunk, then again)
        self.within_group.total(1, "roll call of the worker group")
        return self.recovery.notices(sorted(self.net.lost))
