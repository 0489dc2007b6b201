"""A server's commonest requests in the fewest steps: a pull of one table answered by one call of
the compiled lookup-and-gather kernel writing the rows straight into the reply, and a push of
one table (ASP, SSP) applied by one call of the compiled lookup-and-update kernel, then
acknowledged.

The general ways (:meth:`hpcps.ps.server.ServerReads.answer_pull`, ``push_now`` and
:meth:`hpcps.ps.server_table.ServerTable.push`, ``Replies.ack``) go through the reply's making,
the table, its store and the kernel's numba dispatch: about ten Python frames and the typing of
the kernel's 12-14 arguments, microseconds a request beside about a microsecond of work at 100
keys. Here the kernel's compiled version is found once per table and kind of keys
(:func:`hpcps_kernels.entry.run_and_find`) and called with the same arguments, so the rows, the
slots kept for the next push and the reply are the same, bit for bit. Anything else takes the
general way (the methods return False): a wire type other than float32, a request split over two
threads, keys or gradients not C-contiguous arrays of their type; a backlog of backups' pushes (a pull: hpcps.ps.failover applies it
first where the read needs it); for a push, anything its general way does beside the kernel:
replicas, new backups being copied, eviction, admission or a memory budget, changes tracked for
delta snapshots, a rule without a one-pass kernel; a push of the keys a pull before it resolved
goes to :mod:`hpcps.ps.quick_steps`.
"""

from __future__ import annotations

import weakref

import numpy as np

from hpcps.ps import protocol, signals
from hpcps.ps.quick_steps import QuickSteps
from hpcps.ps.store import given_initial_values
from hpcps_kernels import fused as kfused
from hpcps_kernels.entry import run_and_find
from hpcps_kernels.parallel import splits_pull, worth_splitting

UINT64 = np.dtype(np.uint64)
FLOAT32 = np.dtype(np.float32)
REPLY_BYTES = protocol.REPLY_BYTES
_WHAT = {op: f"{name} reply" for op, name in protocol.OP_NAMES.items()}


class QuickRequests:
    """The quick ways of a :class:`~hpcps.ps.server.Server`'s pulls and pushes (its tables,
    replies, clocks)."""

    def __init__(self, server):
        self.server = server
        # (op, table, the arrays' alignment and writeability) -> (the table's arrays it was found
        # for, the kernel's compiled version for them); weak references, so that the arrays a table
        # replaces as it grows are freed at once (and never mistaken for others)
        self.kernels: dict[tuple, tuple] = {}
        self.steps = QuickSteps(server, self)  # pushes to the slots of a pull before them

    def run(self, kind: tuple, kernel, arrays: tuple, args: tuple, packed: bool = False):
        """``kernel(*args)`` through the version found for ``kind`` while the table's ``arrays``
        are those it was found for; else through numba's dispatch, finding it (``packed``: the
        last of ``args`` is the tuple of the kernel's ``*args``, see ``run_and_find``)."""
        got = self.kernels.get(kind)
        if got is not None and got[0]() is arrays[0] and got[1]() is arrays[1] and got[2]() is arrays[2] \
                and got[3]() is arrays[3]:
            return got[4](*args)
        result, found = run_and_find(kernel, args, packed)
        self.kernels[kind] = (*map(weakref.ref, arrays), found)
        return result

    def header(self, buf: np.ndarray, req_id: int, t) -> None:
        """A reply's header, as ``Replies.new`` writes it: the stop status, the slowest clock,
        the table's counts."""
        server = self.server
        protocol.REPLY_HEADER.pack_into(buf, 0, req_id, protocol.stop_status(signals.requested()),
                                        server.workers.min_clock(), server.index, *t.counts(), 0)

    def answer_pull(self, source: int, op: int, req_id: int, table: int, keys: np.ndarray) -> bool:
        """Answer request ``req_id`` (a pull or a push-pull, ``op``) from rank ``source`` with the
        float32 rows of ``keys`` in table ``table``, as ``answer_pull`` does; False: not done here."""
        server = self.server
        t = server.tables[table]
        store, n = t.store, keys.shape[0]
        spec = store.spec
        dim = spec.dim
        flags = keys.flags
        if not n or server.backlog or keys.dtype is not UINT64 or not flags.c_contiguous \
                or splits_pull(n, dim):
            return False
        buf = server.replies.take(REPLY_BYTES + 4 * n * dim)
        out = buf[REPLY_BYTES:].view(np.float32).reshape(n, dim)
        if not out.flags.carray:
            return False
        self.header(buf, req_id, t)
        idx, rows, slots = store.index, store.rows, np.empty(n, dtype=np.int64)
        # (a push-pull's pulled keys follow its gradients: not 8-byte aligned where it pushes an odd
        # number of values, and numba compiles a version for such keys of its own)
        absent = self.run((protocol.PULL, table, flags.aligned, flags.writeable), kfused.pull,
                           (idx.direct, idx.index, idx.keys, rows),
                           (idx.direct, idx.index, idx.keys, keys, idx.tag_bits, rows, dim, store.init_kind,
                            spec.init_scale, spec.seed, slots, out))
        if absent and store.init_keys:
            given_initial_values(store.init_keys, keys, slots, out)
        worker = source - server.worker_rank0
        if worker >= 0 and t.policies.reuses_slots:
            store.remember_pull(worker, keys, slots)
        server.replies.post(buf, source, req_id, _WHAT[op], False)
        return True

    def pushable(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray) -> bool:
        """Whether a push of ``keys`` to table ``table`` may take a quick way: its general way
        does nothing beside its kernels (see the module's docstring)."""
        server = self.server
        if server.replication.on or server.evicting or server.copying is not None:
            return False
        t = server.tables[table]
        policies = t.policies
        return not (t.fused < 0 or policies.filters_keys or policies.eviction is not None
                    or t.store.changed is not None or keys.dtype is not UINT64 or grads.dtype is not FLOAT32
                    or not keys.flags.c_contiguous or not grads.flags.c_contiguous
                    or worth_splitting(t.threads, keys.shape[0], grads.shape[1]))

    def push(self, worker: int, table: int, keys: np.ndarray, grads: np.ndarray, clock: int) -> bool:
        """Apply a push (ASP, SSP) of ``keys`` by ``worker`` at ``clock`` to table ``table`` now,
        as ``push_now`` does; False: not done here (nothing applied). A push of the keys the
        worker's pull before it resolved takes their slots (:mod:`hpcps.ps.quick_steps`)."""
        if not self.pushable(worker, table, keys, grads):
            return False
        t = self.server.tables[table]
        store, n = t.store, keys.shape[0]
        if store.resolved.get(worker):
            return self.steps.push(worker, table, keys, grads)
        kflags, gflags = keys.flags, grads.flags
        idx, rows = store.index, store.rows
        stop = self.run((protocol.PUSH, table, kflags.aligned, kflags.writeable, gflags.aligned, gflags.writeable),
                         kfused.PUSH[t.fused], (idx.direct, idx.index, idx.keys, rows),
                         (idx.direct, idx.index, idx.keys, keys, idx.tag_bits, rows, grads, np.empty(n, np.int64),
                          t.fused_params), packed=True)  # (its compiled version takes the rule's parameters as a tuple)
        if stop < n:  # (the keys from the first without a row: looked up, inserted, updated, as push does them)
            t.push(keys[stop:], grads[stop:], clock, worker)
        return True

    def ack(self, source: int, req_id: int, table: int) -> None:
        """An empty reply: request ``req_id`` about table ``table`` is done (``Replies.ack``)."""
        buf = np.empty(REPLY_BYTES, dtype=np.uint8)
        self.header(buf, req_id, self.server.tables[table])
        self.server.replies.post(buf, source, req_id, "push ack", False)
