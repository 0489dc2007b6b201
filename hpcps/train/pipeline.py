"""A training step's messages, in order: the pulls of a batch's rows, the pushes of its gradients,
the pulls ahead and the clocks, around a model's pure forward/backward (:mod:`hpcps.train.models`).

:meth:`StepPipeline.step` is one iteration: pull the batch's rows, compute, push the gradients,
end the clock. Given the batches this worker trains on next (``upcoming``, the same objects the
next steps get), it pipelines (the seeds' pipelining, one level down): the push of this step,
the clock and the pull of the next batch's rows go in one push-pull round trip, and the keys of
a later batch are deduplicated while the servers work. With batches kept from an earlier epoch
(nothing to parse or deduplicate: the worker waits on the servers) the worker also marks, while
they work, which keys of its next push the next pull reads: the servers update the others after
their reply. Under BSP the numbers are those of the unpipelined step, bit for bit.

With ``train.pull_early`` under SSP and ASP the push-pull pulls the rows of the batch after the
next one, for the clock after the next (the next batch's rows came with the step before): the
servers apply this step's push and gather those rows while the worker computes the next step,
and a step reads rows that miss the push of the step just before it (staleness 1). Under BSP it
changes nothing: the servers could answer such a pull only after the next step.

A deep model's MLP (:class:`DenseSync`) is kept in step here too: its gradient is allreduced in
the worker group as soon as the model has it, the group's first rank pushes the sum before the
step's clock, and the replica is pulled every ``model.dense_sync_steps`` steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from hpcps.ps import protocol
from hpcps.train.flush import refetch
from hpcps.train.models import NonFiniteError, tick
from hpcps_kernels import keys as kkeys


@dataclass
class PreparedBatch:
    """A batch whose unique keys are known, and whose rows of every sparse table may be on their
    way (``pulls``, a timestamp per table) or here (``params``)."""

    batch: object
    uniq: np.ndarray
    pos: np.ndarray
    pulls: list | None = None
    params: list | None = None
    # (the batch pulled with this one's push, whether each of uniq is among its keys): see step
    in_pull: tuple | None = None
    from_earlier_epoch: bool = False  # deduplicated in an earlier epoch (a batch kept compacted)


class DenseSync:
    """A deep model's MLP replica kept in step with its dense table on the servers (see
    :class:`hpcps.train.models.DeepModel`): the pull due at a step is finished at its start, the
    gradient allreduced in the group from the moment the model has it, the sum pushed by the
    group's first rank before the clock, the next pull started right behind that push."""

    def __init__(self, ctx, model):
        self.ctx = ctx
        self.model = model
        self.pull: tuple | None = ("due", None)  # a pull of the MLP to finish: at the first step
        self.allreduce: tuple | None = None

    def take(self) -> None:
        """Group collective: finish the MLP's pull (started after an earlier clock)."""
        if self.pull is not None:
            kind, ts = self.pull
            dense = self.model.dense
            self.model.mlp = dense.finish_pull(dense.ipull() if kind == "due" else ts)
            self.pull = None

    def start_allreduce(self, grad: np.ndarray) -> None:
        self.allreduce = self.model.dense.start_allreduce(grad)

    def push_sum(self, pending: list) -> None:
        """The allreduce finished and its sum pushed (added to ``pending``), before the clock."""
        t = time.perf_counter()
        total, started = self.allreduce
        self.ctx.within_group.complete(started)
        self.allreduce = None
        t = tick(self.model.stages, "allreduce", t)
        ts = self.model.dense.ipush_summed(total)
        if ts is not None:
            pending.append((self.model.dense.sparse, ts))
        # the MLP's pull for the next step goes right behind its push, for the next clock: the
        # servers answer it after that clock under BSP (the same rows as a pull sent after it),
        # at once under SSP, instead of behind the sparse tables' push-pull (where the worker
        # waited for it). One process: after the clock (see after_clock).
        if not self.ctx.local and self._due(self.ctx.clock_value + 1):
            self.pull = ("started", self.model.dense.ipull(ahead=1))
        tick(self.model.stages, "push", t)

    def _due(self, clock: int) -> bool:
        # the step's clock counts steps since the start of training (checkpoints keep it), so a
        # resumed run pulls at the steps the uninterrupted run pulls at
        return clock % self.model.sync_every == 0

    def after_clock(self) -> None:
        if self.ctx.local and self._due(self.ctx.clock_value):
            self.pull = ("started", self.model.dense.ipull())

    def finish(self) -> None:
        """Group collective: the replica the servers' MLP (pulled now, after every push: what
        evaluation and the exported model use)."""
        if self.pull is not None and self.pull[0] == "started":
            self.take()
        self.pull = ("due", None)
        self.take()


@dataclass
class GroupPull:
    """A pull made for a worker group (``train.group_pull``): on its first rank, the push-pull's
    (what waits for it, timestamp), the union of the members' keys and each member's keys; on
    the others, nothing but this member's number of keys."""

    rows: int
    waits: tuple | None = None
    union: np.ndarray | None = None
    members: list | None = None


class GroupPulls:
    """``train.group_pull`` (KunPeng's aggregation): the group's first rank pushes the group's
    merged gradients and pulls the rows of the union of its members' next keys, in one request per
    server that carries every member's clock (``clock_workers``); it then hands each member its
    rows inside the group. The other members send the servers nothing during the steps. Under
    BSP every row is the one a member's own pull would read (the same clock), so the numbers do
    not change."""

    def __init__(self, ctx, requests: "StepRequests"):
        self.ctx = ctx
        self.requests = requests
        self.size = ctx.group_comm.Get_size()
        self.leader = ctx.group_comm.Get_rank() == 0
        self.widths = [t.dim for t in requests.sparse]
        if self.leader:  # (after a lost server it tells the servers of the new placement for its group)
            ctx.carried_workers = self.size

    def push_and_pull(self, keys, grads: list, pull_keys: np.ndarray, ahead: int) -> tuple:
        """Group collective: the step's push, clock and pull of ``pull_keys`` (each member's);
        returns (the GroupPull, the pushes to wait for: none, the reply is the acknowledgement)."""
        members = self.ctx.gather_keys_to_leader(pull_keys)
        if not self.leader:
            self.ctx.advance_clock()
            return GroupPull(pull_keys.shape[0]), []
        union = kkeys.unique_keys(np.concatenate(members))[0]
        waits = self.requests.push_pull(keys, grads, union, ahead, clock_workers=self.size)
        return GroupPull(pull_keys.shape[0], waits, union, members), []

    def push_and_clock(self, keys, grads: list) -> list:
        """The group's push and every member's clock (the first rank sends them)."""
        if not self.leader:
            self.ctx.advance_clock()
            return []
        return [self.requests.push_pull(keys, grads, protocol.NO_KEYS, clock_workers=self.size)]

    def rows(self, p: GroupPull) -> list:
        """Group collective: this member's rows of every table."""
        width = sum(self.widths)
        parts = None
        if p.waits is not None:
            waiter, ts = p.waits
            got = waiter.wait(ts)
            got = [got] if isinstance(got, np.ndarray) else got
            union_rows = got[0] if len(got) == 1 else np.hstack(got)
            parts = [union_rows[np.searchsorted(p.union, k)] for k in p.members]
        mine = self.ctx.scatter_rows_from_leader(parts, p.rows, width)
        if len(self.widths) == 1:
            return [mine]
        return [np.ascontiguousarray(x) for x in np.split(mine, np.cumsum(self.widths)[:-1], axis=1)]


class StepRequests:
    """A step's requests for the rows and gradients of a model's sparse tables: each table's own,
    or, for several tables (a tune grid, a deep model), one message per server carrying every
    table (:class:`hpcps.ps.client.TableSet`: the same keys, the same numbers). What
    :meth:`ipull` and the push-pulls leave in a batch's ``pulls``, :meth:`rows` takes."""

    def __init__(self, ctx, sparse: list, group_pull: bool = False):
        self.ctx = ctx
        self.sparse = sparse
        self.together = ctx.table_set(sparse) if ctx.is_worker and len(sparse) > 1 else None
        self.group_pull = group_pull
        self.group = GroupPulls(ctx, self) if group_pull else None

    def ipull(self, uniq: np.ndarray, ahead: int = 0):
        """Start pulling every table's rows of ``uniq`` (distinct keys)."""
        if self.together is not None:
            return self.together.ipull(uniq, unique=True, ahead=ahead)
        return [t.ipull(uniq, unique=True, ahead=ahead) for t in self.sparse]

    def rows(self, pulls) -> list:
        """Every table's rows of a pull or push-pull started here."""
        if isinstance(pulls, GroupPull):
            return self.group.rows(pulls)
        if self.together is not None:
            return self.together.wait(pulls)
        return [t.wait(x) for t, x in zip(self.sparse, pulls)]

    def push_and_clock(self, keys, grads: list, aggregate: bool) -> list:
        """Every table's push and the clock; returns the (table, timestamp) to wait for."""
        if self.group is not None:
            return self.group.push_and_clock(keys, grads)
        if self.together is not None:
            return [(self.together, self.together.ipushpull(keys, grads, protocol.NO_KEYS))]
        pending = [(tb, tb.push(keys, g, aggregate=aggregate, unique=True, donate=True))
                   for tb, g in zip(self.sparse, grads)]
        self.ctx.clock()
        return pending

    def push_pull(self, keys, grads: list, pull_keys, ahead: int = 0, in_pull=None, clock_workers: int = 1):
        """(what waits for it, the timestamp) of every table's push-pull of distinct keys (of the
        group's merged push: no further aggregation)."""
        if self.together is not None:
            return self.together, self.together.ipushpull(keys, grads, pull_keys, ahead, in_pull, clock_workers)
        head = self.sparse[0]
        return head, head.ipushpull(keys, grads[0], pull_keys, unique=True, ahead=ahead, in_pull=in_pull, donate=True,
                                    clock_workers=clock_workers)

    def push_and_pull(self, keys, grads: list, aggregate: bool, pulls: list, in_pull) -> list:
        """Every table's push, the clock, and the pulls of ``pulls`` ((batch, ahead) each, the
        first in the push's round trip: ``in_pull``, which of ``keys`` it reads, or None); sets
        each batch's ``pulls``, returns the pushes' (table, timestamp) to wait for."""
        (got, ahead), later = pulls[0], pulls[1:]
        if self.group is not None:
            got.pulls, pending = self.group.push_and_pull(keys, grads, got.uniq, ahead)
        elif self.together is not None:
            got.pulls = self.together.ipushpull(keys, grads, got.uniq, ahead=ahead, in_pull=in_pull)
            pending = []
        else:
            head, rest = self.sparse[0], list(zip(self.sparse[1:], grads[1:]))
            # the other tables' pushes go before the clock that the first table's push-pull
            # carries, and their pulls after it (so under BSP they see every push of the step)
            pending = [(tb, tb.push(keys, g, aggregate=aggregate, unique=True, donate=True)) for tb, g in rest]
            ts = head.ipushpull(keys, grads[0], got.uniq, aggregate=aggregate, unique=True, ahead=ahead,
                                in_pull=in_pull, donate=True)
            got.pulls = [ts] + [tb.ipull(got.uniq, unique=True, ahead=ahead) for tb, _ in rest]
        for got, ahead in later:  # (the pipeline filling up: its first step)
            got.pulls = self.ipull(got.uniq, ahead)
        return pending


class StepPipeline:
    """The messages of a model's training steps (the module's docstring says their order), its
    evaluation pulls, and the time of each stage (:meth:`stage_times`)."""

    def __init__(self, ctx, model):
        self.ctx = ctx
        self.model = model
        self.sparse = model.sparse
        cfg = model.cfg
        self.aggregate = cfg.train.aggregate
        self.on_servers = cfg.model.compute == "servers"
        # a batch's keys need sorting only where a worker group merges its pushes
        self.sorted = ctx.is_worker and self.aggregate and ctx.within_group.size > 1
        self.pending: list = []                  # (table, timestamp) of pushes in flight
        self.ahead: list[PreparedBatch] = []     # the next batches, prepared (see step)
        self.refetch: set = set()                # batches whose rows a flush of the filters dropped (flush.py)
        # train.pull_early's pipelined step: under SSP/ASP only (under BSP a pull two clocks
        # ahead would wait on this worker's own next step) and with servers to overlap (one
        # process: its in-process server answers each request when sent)
        self.pulls_ahead = cfg.train.pull_early and cfg.cluster.staleness != 0 and not ctx.local
        self.stages = model.stages  # seconds per stage (the deep models time their own inside)
        self.dense = [DenseSync(ctx, m) for m in model.mlp_models]
        # train.group_pull: the group's first rank pushes and pulls for the group (see StepRequests)
        group_pull = cfg.train.group_pull and self.sorted and not self.on_servers
        self.requests = StepRequests(ctx, self.sparse, group_pull)
        self.dense_of = {id(d.model): d for d in self.dense}

    def _time(self, stage: str, since: float) -> float:
        return tick(self.stages, stage, since)

    def stage_times(self) -> dict:
        """Seconds spent per stage of the steps since the last call: ``pull`` (waiting for the
        rows), ``compute`` (or ``embed``, ``mlp``, ``allreduce`` for the deep models), ``push``
        (sending gradients and the next pulls)."""
        out = {f"{k}_s": round(v, 4) for k, v in self.stages.items()}
        self.stages.clear()
        return out

    def _prepare(self, batch) -> PreparedBatch:
        for p in self.ahead:
            if p.batch is batch:
                return p
        prepared = batch.prepared_for(self.model.narrow_positions)  # (widened from the compact form: once)
        if prepared is not None:  # a batch kept from an earlier epoch: deduplicated then
            return PreparedBatch(batch, *prepared, from_earlier_epoch=True)
        uniq, pos = (kkeys.unique_keys(batch.indices) if self.sorted else
                     kkeys.dedup_keys(batch.indices, self.model.hashed_keys))
        if batch.keep_prepared:  # kept for the next epochs: compact from now on
            uniq, pos = batch.compact(uniq, pos, self.model.narrow_positions)
        return PreparedBatch(batch, uniq, pos)

    def _fetch(self, cur: PreparedBatch) -> None:
        """The rows of every table for ``cur`` (pulls of all tables in flight together)."""
        if cur.params is None:
            cur.params = self.requests.rows(cur.pulls) if cur.pulls is not None else refetch(
                self.ctx, self, cur.batch, lambda: self.requests.rows(self.requests.ipull(cur.uniq)))
            cur.pulls = None

    def _wait_pending(self) -> None:
        for table, ts in self.pending:
            table.wait(ts)
        self.pending = []

    def _dense_ready(self, model, grad: np.ndarray) -> None:
        """A deep model's MLP gradient is complete (before its embeddings' are scattered)."""
        self.dense_of[id(model)].start_allreduce(grad)

    def step(self, batch, scale: float, upcoming=()) -> float:
        """One iteration (see the module's docstring); returns the model's summed loss."""
        if self.on_servers:
            return self._step_on_servers(batch, scale)
        model = self.model
        t = time.perf_counter()
        self._wait_pending()  # at most one step's pushes in flight
        for d in self.dense:
            d.take()
        cur = self._prepare(batch)
        self._fetch(cur)
        self.ahead = [p for p in self.ahead if p is not cur]
        t = self._time("pull", t)
        grads = [np.empty_like(p) for p in cur.params]
        loss = model.forward_backward(batch, cur.pos, cur.params, grads, scale, self._dense_ready) \
            if batch.rows or model.compute_empty else 0.0
        if not math.isfinite(loss):  # (a number the step has anyway: the check costs nothing)
            raise NonFiniteError(loss, model.non_finite_tables(cur.params))
        t = time.perf_counter() if model.times_compute else self._time("compute", t)
        for d in self.dense:  # each MLP's allreduce finished and its sum pushed, in model order
            d.push_sum(self.pending)
        keys, grads, aggregate = self._merge_tables(cur.uniq, grads)
        if upcoming:
            self._push_and_pull_ahead(cur, keys, grads, aggregate, upcoming)
        else:
            self.pending += self.requests.push_and_clock(keys, grads, aggregate)
        for d in self.dense:
            d.after_clock()
        self._time("push", t)
        return loss

    def _push_and_pull_ahead(self, cur: PreparedBatch, keys, grads: list, aggregate: bool, upcoming) -> None:
        """The step's pushes, its clock and the pulls of the batches ahead (the module's
        docstring), and the deduplication of a later batch while the servers work."""
        nxt = self._prepare(upcoming[0])
        early = self.pulls_ahead and len(upcoming) > 1
        pulls = [(nxt, 0)] if nxt.pulls is None and nxt.params is None else []
        if early:  # the batch after the next, for the clock after the next
            pulls.append((self._prepare(upcoming[1]), 1))
        if pulls:
            got = pulls[0][0]
            in_pull = cur.in_pull[1] if cur.in_pull is not None and cur.in_pull[0] is got and keys is cur.uniq \
                else None
            self.pending += self.requests.push_and_pull(keys, grads, aggregate, pulls, in_pull)
        else:  # the rows of every batch left are on their way
            self.pending += self.requests.push_and_clock(keys, grads, aggregate)
        self.ahead = [nxt] + [got for got, _ in pulls if got is not nxt]
        after_pulled = upcoming[1 + early] if len(upcoming) > 1 + early else None
        if after_pulled is not None:  # overlaps the servers' work on the push-pull just sent
            self.ahead.append(self._prepare(after_pulled))
            last = self.ahead[-1]
            if not early and nxt.from_earlier_epoch and last.from_earlier_epoch and not self.ctx.local:
                # (the same pair of kept batches each epoch: probed in the first, kept as bits)
                nxt.in_pull = (last, nxt.batch.compacted.in_pull(last.batch.compacted, lambda: kkeys.member_mask(
                    nxt.uniq, last.uniq, self.model.hashed_keys)))

    def _merge_tables(self, uniq, grads: list) -> tuple:
        """(keys, gradients per table, whether the pushes still aggregate). Several tables whose
        pushes a worker group merges are merged in one gather (their rows side by side: the same
        keys) instead of one per table; the group's first rank then pushes the sums."""
        if not (self.sorted and (len(grads) > 1 or self.requests.group_pull)):
            return uniq, grads, self.aggregate
        widths = [g.shape[1] for g in grads]
        merged = self.ctx.gather_to_leader(uniq, np.hstack(grads).astype(np.float32, copy=False), sum(widths))
        if merged is None:  # not the group's first rank: nothing to push (the clock still goes)
            return np.zeros(0, np.uint64), [np.zeros((0, w), np.float32) for w in widths], False
        keys, sums = merged
        return keys, np.split(sums, np.cumsum(widths)[:-1], axis=1), False

    def _step_on_servers(self, batch, scale: float) -> float:
        """``model.compute = "servers"`` (the seeds' third realm): the batch's nonzeros go to the
        servers, which return each row's partial sums and, given each row's residual, compute and
        apply the gradients themselves. Two round trips a step and no pipelining; weights are
        never pulled. Under BSP it computes what the pull-based step computes (bit for bit with
        one server; with several, partial sums add in another order)."""
        self._wait_pending()
        table, rows = self.model.table, batch.rows
        row_ids = np.repeat(np.arange(rows, dtype=np.int32), np.diff(batch.indptr))
        partials = table.wait(table.imargins(batch.indices, batch.values, row_ids, rows))
        residuals = np.empty((rows, table.dim), dtype=np.float64)
        loss = self.model.residuals(partials, batch.labels, scale, residuals, batch.weights) if rows else 0.0
        if not math.isfinite(loss):
            raise NonFiniteError(loss, [table.name] if not np.isfinite(partials).all() else [])
        self.pending = [(table, table.iresiduals(residuals))]  # ends the step (the clock)
        return loss

    def finish(self) -> None:
        """Wait for every request in flight (pulled rows ahead are kept for their step). Collective
        over the worker group for the deep models (their MLP is brought up to date)."""
        self._wait_pending()
        for p in self.ahead:
            if p.pulls is not None:
                p.params = self.requests.rows(p.pulls)
                p.pulls = None
        for d in self.dense:
            d.finish()

    def forget_ahead(self) -> None:
        """Wait for the requests in flight, then drop the batches prepared ahead (their rows pulled
        already): where steps that were not planned come first (a lost worker's rows,
        :mod:`hpcps.train.takeover`) those rows would be stale, and their steps pull them again;
        a late backup worker skips their steps (:mod:`hpcps.train.stragglers`)."""
        self.finish()
        self.ahead = []
        self.refetch.clear()  # (ids of the batches dropped: a later batch may reuse one)

    def pull_rows(self, batch) -> tuple:
        """(pos, the rows of every table) for a batch outside training (pulls in flight together);
        a batch kept compacted (:class:`hpcps.train.evaluation.KeptTestSet`) is not deduplicated again."""
        if batch.compacted is None:
            uniq, pos = kkeys.unique_keys(batch.indices)
        else:  # (int64 positions, as unique_keys gives: the kernels already compiled for them)
            uniq, kept = batch.compacted.wide(narrow=True)
            pos = kept.astype(np.int64)
        return pos, self.requests.rows(self.requests.ipull(uniq))

    def margins(self, batch) -> np.ndarray:
        """The model's margins of a batch outside training (its rows pulled now)."""
        return self.model.margins(batch, *self.pull_rows(batch))
