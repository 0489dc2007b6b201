"""A lost server's shards promoted (``cluster.replicas`` under ``cluster.fault_tolerance =
"ulfm"``): the job goes on with the copies left, its model unchanged.

Each virtual shard is kept on ``r + 1`` servers, and a worker sends every copy its part of each
push inside the message it sends every server anyway (:mod:`hpcps.ps.replication`). So when a
server dies, every push a worker sent reached the survivors' copies already; what is missing is
only the lost server's *replies*: the rows a worker pulled from it. Hence:

* **A server** learns of the loss in its serving loop (:class:`hpcps.ps.recovery.ServerRecovery`
  calls :func:`promote`): where every shard of the lost server has a copy left, each shard's first
  backup becomes its primary (:meth:`hpcps.ps.replication.Replication.rank_lost`); its backlog of
  backup pushes is applied first, so that each key's updates keep their order. Its clocks are
  unchanged (a server is not a worker). Where a shard has no copy left, the job ends as without
  replicas, in one line. Where shards are left with fewer than ``r + 1`` copies (three servers
  or more), new backups are copied over the wire meanwhile (:mod:`hpcps.ps.rereplication`).
* **A worker** learns of it in a wait for a reply (or the start of a transfer):
  :func:`wait_replies` moves its context to the placement after the loss
  (:meth:`hpcps.ps.context.Context.server_lost`: no request or clock to the lost server from
  then on), waits for the other servers' replies, and asks the new primaries for the rows the
  lost server did not send (:func:`ask_again`), read at the same clock as the request that lost
  them: a pull is idempotent, and no push is sent again (the survivors got theirs already).
* Under BSP a read at clock c waits for every worker's pushes of clock c, so the rows asked again
  are those the lost server would have sent, and the model is bit-identical to a run without the
  loss. The server serves a read asked again only once the backups' pushes of its clock are
  applied (:func:`before_read`: the backlog applied before a read of rows it backs up).

Which server was lost and when (the worker's clock, the seconds since the job's start) is kept in
the context's ``failovers`` for the run's summary.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from hpcps.ps import protocol, transport
from hpcps.ps.replication import primary_rows_mask
from hpcps.ps.rereplication import Rereplication

_STARTED = time.monotonic()


def copies_left(placement, server: int) -> bool:
    """Whether every shard ``server`` keeps has a copy on a server still there."""
    gone = set(placement.lost) | {server}
    held = placement.copies[placement.holds(server)]
    return bool(held.size == 0 or (~np.isin(held, list(gone))).any(axis=1).all())


# -- servers -----------------------------------------------------------------------------------

def promote(server, rank: int) -> None:
    """A server's ``on_server_lost`` under replicas: server ``rank`` is gone; its shards' first
    backups are primaries from now on, or the job ends (one line) where that cannot keep the model."""
    placement = server.placement
    if not copies_left(placement, rank):
        server.recovery.end_job(rank)
    if server.copying.busy:  # (a copy awaited here counts as a copy in the placement, not landed yet)
        raise transport.RankFailed([rank], "serving", "a second server lost while new backups were being copied")
    server.apply_backlog()  # (each key's updates in their order, before its copy is primary)
    moves = server.replication.rank_lost(rank)
    server.copying.check_promoted(rank)
    if moves:  # (new backups on the survivors, copied over the wire: hpcps.ps.rereplication)
        server.copying.plan(rank, moves)
    promoted(server, rank)


def promoted(server, rank: int) -> None:
    """Server ``rank``'s shards promoted on ``server``: its loss recorded, and said by the first
    server left."""
    server.failovers.append((rank, round(time.monotonic() - _STARTED, 3)))
    if server.index == min(server.placement.live_servers):
        sys.stderr.write(f"hpcps: server {rank} (rank {rank}) lost: its shards' backups are primary now "
                         f"(server {server.index} serving {int(server.placement.holds(server.index).sum())} "
                         f"of {server.placement.num_shards} shards)\n")


def plug(server) -> None:
    """Make ``server`` (a :class:`hpcps.ps.server.Server` keeping copies, under ULFM) promote a
    lost server's shards instead of ending the job."""
    server.failover_on = True
    server.failovers = []  # (server lost, seconds from the start)
    server.recovery.on_server_lost = lambda rank: promote(server, rank)
    server.copying = Rereplication(server)
    server.handlers[protocol.PLACED] = lambda source, r: placed(server, r.worker, r)  # (a group's for its members too)
    server.handlers[protocol.COPY] = lambda source, r: server.copying.take(r)


def placed(server, worker: int, r: protocol.Placed) -> None:
    """Worker ``worker``'s ``PLACED``: it sends under the placement without server ``r.lost``
    from now on. A loss this server did not know of yet is handled first (the worker's pushes
    that follow may hold rows of the new backups awaited here)."""
    if r.lost not in server.recovery.lost:
        server.recovery.ranks_lost(transport.RankFailed([r.lost], "a worker's notice of a lost server"))
    server.copying.placed_by(worker, r.clock, r.lost)


def before_read(server, keys: np.ndarray) -> None:
    """Before ``server`` reads ``keys`` for a worker: where a worker knows of a lost server before
    this server does, it may read here keys of shards this server still counts as backups, whose
    pushes wait in the backlog: applied first (the read sees every push of its clock)."""
    if server.backlog and server.failover_on and keys.shape[0] and \
            not primary_rows_mask(server.placement, server.index, keys).all():
        server.apply_backlog()


# -- workers -----------------------------------------------------------------------------------

def servers_lost(ctx, failure: transport.RankFailed) -> None:
    """A worker's event of a lost server (from a wait or the start of a transfer): move to the
    placement after each new loss, or raise ``failure`` where the job cannot go on without it."""
    servers = ctx.layout.servers
    new = [r for r in failure.ranks if r < servers and r not in ctx.placement.lost]
    if not failure.ranks or (not new and not any(r < servers for r in failure.peers | set(failure.ranks))):
        raise failure
    for rank in new:
        if not (ctx.fault_tolerant and ctx.placement.replicas and copies_left(ctx.placement, rank)):
            raise failure
        ctx.server_lost(rank)
        ctx.failovers += ((rank, ctx.clock_value, round(time.monotonic() - _STARTED, 3)),)


def without_lost(ctx, step, pending: list) -> list:
    """``step(pending)`` (a wait or a test of transfers: returns what is left, or None); where a
    server is lost meanwhile (:func:`servers_lost`), again with the transfers left to the others
    (a clock's or a DONE's sends: nothing to ask again)."""
    while True:
        try:
            return step(pending) or []
        except transport.RankFailed as e:
            servers_lost(ctx, e)
            transport.cancel([p for p in e.left + e.failed if p.peer in ctx.placement.lost])
            pending = [p for p in e.left if p.peer not in ctx.placement.lost]


def start_send(ctx, msg: np.ndarray, server: int, tag: int, what: str) -> list:
    """Start sending ``msg`` to ``server`` (a clock or a DONE): none where it is lost (its loss
    handled: :func:`servers_lost`)."""
    try:
        return ctx.net.start_send(msg, server, tag, what)
    except transport.RankFailed as e:
        servers_lost(ctx, e)
        return []


def or_cancel(pending: list, start, *args) -> list:
    """``start(*args)`` (the start of a request's send), the receive of its reply (``pending``)
    cancelled where it fails (its server lost: no reply will come)."""
    try:
        return start(*args)
    except transport.RankFailed:
        transport.cancel(pending)
        raise


def wait_replies(ctx, req, wait) -> None:
    """``wait(req)`` (a request's transfers); where a server is lost meanwhile, its loss handled
    (:func:`servers_lost`), the rest waited for, and the parts it did not answer asked again of
    the new primaries (:func:`ask_again`)."""
    unanswered: set[int] = set(getattr(req, "unanswered", ()))
    while True:
        try:
            wait(req)
            break
        except transport.RankFailed as e:
            servers_lost(ctx, e)
            lost = set(ctx.placement.lost)
            unanswered |= {p.peer for p in e.left if p.peer in lost} | (e.peers & lost)
            transport.cancel([p for p in e.left + e.failed if p.peer in lost])
            req.pending = [p for p in e.left if p.peer not in lost]
    if unanswered:
        ask_again(ctx, req, unanswered, wait)


def send_failed(ctx, req, server: int, failure: transport.RankFailed) -> None:
    """The start of a request's transfer to ``server`` failed: its loss handled; the part is
    asked again of the new primaries once the others are answered."""
    servers_lost(ctx, failure)
    if server not in ctx.placement.lost:
        raise failure
    req.unanswered = set(getattr(req, "unanswered", ())) | {server}


def ask_again(ctx, req, servers: set[int], wait) -> None:
    """The parts of ``req`` that ``servers`` (lost) did not answer: their pull keys read again at
    the same clock from their new primaries (a push's part needs nothing: the survivors got it)."""
    table = req.table
    keep = [i for i, s in enumerate(req.servers) if s not in servers]
    gone = [i for i, s in enumerate(req.servers) if s in servers]
    if req.op not in (protocol.PULL, protocol.PUSH, protocol.PUSHPULL, protocol.PULLS, protocol.PUSHPULLS):
        raise transport.RankFailed(sorted(servers), f"a {protocol.OP_NAMES[req.op]} request (not asked again)")
    again = type(req)(protocol.PULLS if req.op in (protocol.PULLS, protocol.PUSHPULLS) else protocol.PULL, table,
                      clock=protocol.pull_clock(req.op, req.clock, req.ahead), started=time.monotonic())
    for i in gone:
        sel, keys = req.parts[i][0], req.asked[i]
        if keys is None or keys.shape[0] == 0:
            continue
        order, offsets = ctx.placement.slice(keys)
        for server in ctx.placement.live_servers:
            sub = order[offsets[server]:offsets[server + 1]]
            if sub.shape[0]:
                req.table.ask_pull(again, server, sel[sub], keys[sub], req.owner)
    req.parts, req.servers, req.asked = ([req.parts[i] for i in keep], [req.servers[i] for i in keep],
                                         [req.asked[i] for i in keep])
    req.unanswered = set()
    if again.parts:
        wait_replies(ctx, again, wait)
        req.parts += again.parts
        req.servers += again.servers
        req.asked += again.asked


# -- the end of a run --------------------------------------------------------------------------

def after_serving(ctx, work):
    """Collective over every rank once serving is done (the end of a run, under ULFM): the servers
    lost that a rank knows of agreed on, each failed over here (:func:`lost_after_serving`), then
    ``work()`` (the end's reductions: key counts, the replicas' digests), done again where a rank
    is lost during it (a server's counts and digests would be missing from the sums). Returns
    what ``work()`` returned."""
    while True:
        lost_after_serving(ctx)
        size = ctx.every_rank.size
        out = work()
        if ctx.every_rank.size == size:  # (no rank lost meanwhile)
            return out


def lost_after_serving(ctx) -> None:
    """Collective over every rank once serving is done: a server lost where no worker's request
    met its loss (after the last reply it owed a worker, or after serving) is known to the ranks
    only from a collective's shrink, or to the servers alone. Every rank agrees on the servers lost
    (any rank's knowledge), and each one this rank has not failed over yet is failed over here as
    in a step: under replicas its shards' first backups become primary (the model and the key
    counts keep its rows; the workers record it for the summary's "server lost" line); where its
    shards have no copy left, the job ends in one line, exit status 1 (the model would lack its
    rows). Nothing without ULFM (a lost rank ends the job there)."""
    if not ctx.fault_tolerant:
        return
    size = -1
    while size != ctx.every_rank.size:  # (a rank lost during the agreement: again, with it)
        size = ctx.every_rank.size
        known = np.zeros(ctx.layout.servers, dtype=np.int64)
        known[sorted(_servers_known_lost(ctx))] = 1
        known = ctx.every_rank.reduce(known, "max", "agreement on the servers lost")
    placement = ctx.server.placement if ctx.is_server else ctx.placement
    for rank in [r for r in np.flatnonzero(known).tolist() if r not in placement.lost]:
        placement = ctx.server.placement if ctx.is_server else ctx.placement
        if not (placement.replicas and copies_left(placement, rank)):
            ctx.every_rank.end_job_by_first(
                f"error: server {rank} (rank {rank}) was lost (killed, or its node failed) at the end of the run, "
                f"after serving, and its shards have no copy left: the model and its key counts would lack its "
                f"rows, so neither is written; hpcps supervise restarts the job from its last checkpoint", 1,
                "the end of a job that lost a server")
        if ctx.is_server:
            _promote_after_serving(ctx, rank)
        else:
            ctx.placement = placement.after_loss(rank)
            ctx.failovers += ((rank, ctx.clock_value, round(time.monotonic() - _STARTED, 3)),)


def _servers_known_lost(ctx) -> set[int]:
    """The servers this rank knows are lost: from a shrink or a failed transfer, failed over by
    its placement, or (a server) from its serving loop."""
    known = set(ctx.net.lost) | set((ctx.server.placement if ctx.is_server else ctx.placement).lost)
    if ctx.is_server:
        known |= set(ctx.server.recovery.lost)
    return {r for r in known if r < ctx.layout.servers}


def _promote_after_serving(ctx, rank: int) -> None:
    """A server, serving done: server ``rank``'s shards promoted (:func:`promote` without new
    backups: the run is over), and its statistics' key counts those of the shards it holds now."""
    server = ctx.server
    server.apply_backlog()
    server.replication.rank_lost(rank)
    server.recovery.lost[rank] = -1
    promoted(server, rank)
    ctx.server_stats = server.final_stats()


def killed_here_in_tests(ctx, point: str) -> None:
    """Tests only: with ``HPCPS_TEST_KILL = "POINT:RANK"``, world rank RANK kills itself (SIGKILL)
    at ``point``: a loss at a moment a kill from outside rarely hits (tests/test_ulfm.py)."""
    if os.environ.get("HPCPS_TEST_KILL") == f"{point}:{ctx.rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def summary(ctx) -> dict:
    """The summary's record of the servers lost (under replicas): each one's server, the worker's
    clock and the seconds from the start at which this worker learned of it."""
    return {"servers_lost": [{"server": s, "clock": c, "at_s": t} for s, c, t in ctx.failovers]} if ctx.failovers else {}
