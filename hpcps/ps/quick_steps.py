"""A push that takes the slots its worker's pull before it resolved, in the fewest steps: a
push-pull's push (the same keys pulled, then pushed: ``hpcps bench ps``'s push-pull, a kept
batch's step under ASP or SSP; the whole request in one method, :meth:`QuickSteps.push_pull`),
a training step's push-pull with in-pull marks, whose pulled part is updated before the reply
and the rest after it (:meth:`QuickSteps.step`), and a push after a pull of its keys.

The general way (:meth:`hpcps.ps.replication.ServerCopies.push_now`,
:meth:`hpcps.ps.server_table.ServerTable.push`, :meth:`hpcps.ps.store.RowStore.slots_of_pull`,
``Optimizer.run``) goes through five or six Python frames and numba's dispatch of each kernel
(the slots' check, the split by the in-pull marks, the rule: a microsecond or more each). Here the
same kernels run through the compiled versions found once (:func:`hpcps_kernels.entry.run_and_find`)
on the same arrays, in the same order, so the rows, the slots kept and the reply are the same, bit
for bit. It declines (returns False, nothing changed) where the general way does more than that:
whatever :meth:`hpcps.ps.quick_requests.QuickRequests.pushable` declines (replicas, eviction,
admission, tracked changes, a large push split over two threads, ...), no pull of the same keys
by the same worker kept, or keys of that pull absent then (the general way inserts them).
"""

from __future__ import annotations

import numpy as np

from hpcps.ps import protocol
from hpcps.ps.store import find_pull, given_initial_values
from hpcps_kernels import fused as kfused
from hpcps_kernels import keys as kkeys
from hpcps_kernels.entry import run_and_find
from hpcps_kernels.parallel import splits_pull

REPLY_BYTES = protocol.REPLY_BYTES


class QuickSteps:
    """The quick pushes to a pull's slots of a :class:`~hpcps.ps.server.Server` (its tables and,
    through ``quick``, its :class:`~hpcps.ps.quick_requests.QuickRequests`' checks)."""

    def __init__(self, server, quick):
        self.server = server
        self.quick = quick
        # (kernel's name, table, the arguments' alignment and writeability) -> its compiled version:
        # each argument's type is fixed by these (dtypes, dimensions and layout checked before)
        self.found: dict[tuple, object] = {}

    def _call(self, kind: tuple, kernel, args: tuple):
        f = self.found.get(kind)
        if f is not None:
            return f(*args)
        result, self.found[kind] = run_and_find(kernel, args)
        return result

    def _pulled_slots(self, worker: int, table: int, keys: np.ndarray) -> np.ndarray | None:
        """The slots of ``keys`` one of ``worker``'s last pulls of table ``table`` resolved, every
        key present then (the pull's record then taken, as :meth:`RowStore.slots_of_pull` takes
        it); None where that is not so (nothing changed)."""
        store = self.server.tables[table].store
        pulls = store.resolved.get(worker)
        if not pulls:
            return None
        n = keys.shape[0]
        i, m = find_pull(pulls, store.index, keys, np.empty(n, dtype=np.int64), self._reusable)
        if i < 0 or m > 0:
            return None  # (m > 0: keys absent then, which the general way inserts)
        store.reused += n
        return pulls.pop(i)[1]

    def _reusable(self, got_keys: np.ndarray, got_slots: np.ndarray, keys: np.ndarray, absent: np.ndarray):
        """``reusable_slots`` through its compiled version; None where a pull's keys are not of the
        push's type or not contiguous (look no further)."""
        gf, kf = got_keys.flags, keys.flags
        if got_keys.dtype is not keys.dtype or not gf.c_contiguous:
            return None
        return self._call(("reusable_slots", gf.aligned, gf.writeable, kf.aligned, kf.writeable),
                          kkeys.reusable_slots, (got_keys, got_slots, keys, absent))

    def _rule(self, table: int, slots: np.ndarray, grads: np.ndarray) -> None:
        """The table's rule over the rows at ``slots`` (``Optimizer.run`` on one thread; its
        compiled version takes the hyper-parameters as one tuple)."""
        t = self.server.tables[table]
        gf = grads.flags
        kind = ("rule", table, gf.aligned, gf.writeable)
        f = self.found.get(kind)
        if f is not None:
            f(t.store.rows, slots, grads, t.rule_args)
            return
        _, self.found[kind] = run_and_find(t.opt.kernel, (t.store.rows, slots, grads, t.rule_args), packed=True)

    def push(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray) -> bool:
        """Apply a push (ASP, SSP) by ``worker`` of the keys its pull before resolved, as
        ``push_now`` does; False: not done here (nothing applied). Checked by
        :meth:`QuickRequests.pushable` before."""
        slots = self._pulled_slots(worker, table, keys)
        if slots is None:
            return False
        self._rule(table, slots, grads)
        return True

    def push_pull(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """A push-pull without marks under ASP or SSP (request ``buf``, its header's ``words``)
        whose push takes the slots the worker's pull before resolved (``hpcps bench ps``'s, a
        kept batch's step without marks), with nothing waiting and the pull readable at once: the
        clock advanced, the push applied, the pull answered, as ``plain_requests``' way does
        them, without the calls that do nothing here; False: not done here (nothing applied:
        the clock's advance, which the general way then repeats, is all)."""
        _, table, req_id, n_push, n_pull, clock, _, ahead, flags = words
        server = self.server
        workers = server.workers
        if flags or not n_push or not n_pull or not server.staleness or workers.waiting:
            return False
        worker = source - server.worker_rank0
        keys, grads, pull_keys = protocol.plain_pushed(buf, n_push, n_pull, server.dims[table])
        if not self.quick.pushable(worker, table, keys, grads):
            return False
        workers.advance(worker, clock + 1)
        if not workers.readable(clock + 1 + ahead):
            return False
        if self._push_pull_at_once(source, worker, table, req_id, keys, grads, pull_keys):
            return True
        slots = self._pulled_slots(worker, table, keys)
        if slots is None:
            return False
        self._rule(table, slots, grads)
        server.answer_pull(source, protocol.PUSHPULL, req_id, table, pull_keys)
        return True

    def _push_pull_at_once(self, source: int, worker: int, table: int, req_id: int, keys: np.ndarray,
                           grads: np.ndarray, pull_keys: np.ndarray) -> bool:
        """:meth:`push_pull`'s push to the slots of the worker's last pull and its pull, by one call
        of the rule's push-pull kernel (:data:`hpcps_kernels.fused.PUSH_PULL`): the same kernels'
        work, in the same order, as the push to those slots, then ``answer_pull``; False where
        that last pull was not of the same keys, each found then, or the pull is not one
        ``QuickRequests.answer_pull`` takes (nothing changed: the slower steps look further)."""
        server = self.server
        t = server.tables[table]
        store = t.store
        pulls = store.resolved.get(worker)
        if not pulls or server.backlog:
            return False
        got_keys, got_slots, index = pulls[0]
        n, dim = pull_keys.shape[0], store.spec.dim
        if index is not store.index or got_keys.dtype is not keys.dtype or got_keys.shape[0] != keys.shape[0] \
                or splits_pull(n, dim):
            return False
        gf, kf, pf, sf = got_keys.flags, keys.flags, pull_keys.flags, grads.flags
        if not (gf.c_contiguous and pf.c_contiguous):
            return False
        buf = server.replies.take(REPLY_BYTES + 4 * n * dim)
        out = buf[REPLY_BYTES:].view(np.float32).reshape(n, dim)
        if not out.flags.carray:
            return False
        idx, slots = store.index, np.empty(n, dtype=np.int64)
        # (found per table and for the index's and rows' arrays, as the quick pull's: an index widened
        # in place, or another table's initial scale of another type, takes another compiled version)
        absent = self.quick.run(("push_pull", table, gf.aligned, gf.writeable, kf.aligned, kf.writeable, sf.aligned,
                                 sf.writeable, pf.aligned, pf.writeable), kfused.PUSH_PULL[t.fused],
                                (idx.direct, idx.index, idx.keys, store.rows),
                                (idx.direct, idx.index, idx.keys, idx.tag_bits, store.rows, got_keys, got_slots, keys,
                                 grads, pull_keys, store.init_kind, store.spec.init_scale, store.spec.seed, slots, out,
                                 t.fused_params), packed=True)
        if absent < 0:
            return False
        del pulls[0]
        store.reused += keys.shape[0]
        if absent and store.init_keys:
            given_initial_values(store.init_keys, pull_keys, slots, out)
        self.quick.header(buf, req_id, t)
        if t.policies.reuses_slots:
            store.remember_pull(worker, pull_keys, slots)
        server.replies.post(buf, source, req_id, "push-pull reply", False)
        return True

    def step(self, source: int, op: int, req_id: int, table: int, keys: np.ndarray, grads: np.ndarray,
             in_pull: np.ndarray, pull_keys: np.ndarray) -> bool:
        """A training step's push-pull answered at once (``plain_requests``' in-pull way): the
        pushed keys the pull reads updated, the pull answered, then the others updated, as
        ``push_now`` with its in-pull marks, ``answer_pull`` and ``apply_after_reply`` do them;
        False: not done here (nothing applied)."""
        server = self.server
        worker = source - server.worker_rank0
        if not self.quick.pushable(worker, table, keys, grads):
            return False
        slots = self._pulled_slots(worker, table, keys)
        if slots is None:
            return False
        gf, bf = grads.flags, in_pull.flags
        s_set, g_set, s_rest, g_rest = self._call(("split_by_bits", bf.aligned, bf.writeable, gf.aligned,
                                                   gf.writeable), kkeys.split_by_bits, (in_pull, slots, grads))
        self._rule(table, s_set, g_set)
        server.answer_pull(source, op, req_id, table, pull_keys)
        if s_rest.shape[0]:
            self._rule(table, s_rest, g_rest)
        return True
