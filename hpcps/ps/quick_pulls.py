"""A server's commonest read in the fewest steps: a pull of one table answered by one call of the
compiled lookup-and-gather kernel, writing the rows straight into the reply.

The general answer (:meth:`hpcps.ps.server.ServerReads.answer_pull`) goes through the reply's
making, the table, its store and the kernel's numba dispatch, about ten Python frames and the
typing of the kernel's 12 arguments: microseconds a request beside about a microsecond of work
at 100 keys. Here the kernel's compiled version is found once per table and index
(:func:`hpcps_kernels.entry.run_and_find`) and called with the same arguments, so the rows, the
slots kept for the next push and the reply are the same, bit for bit. Anything else takes the
general way (:meth:`QuickPulls.answer` returns False): a wire type other than float32, a pull
split over two threads, a table with given initial values for some keys, an empty pull, keys not
a C-contiguous uint64 array, a backlog of backups' pushes (hpcps.ps.failover applies it
first where the read needs it).
"""

from __future__ import annotations

import weakref

import numpy as np

from hpcps.ps import protocol, signals
from hpcps_kernels import fused as kfused
from hpcps_kernels.entry import run_and_find
from hpcps_kernels.parallel import splits_pull

UINT64 = np.dtype(np.uint64)
REPLY_BYTES = protocol.REPLY_BYTES
_WHAT = {op: f"{name} reply" for op, name in protocol.OP_NAMES.items()}


class QuickPulls:
    """The quick way of a :class:`~hpcps.ps.server.Server`'s pulls (its tables, replies, clocks)."""

    def __init__(self, server):
        self.server = server
        # (table, the keys aligned, writeable) -> (the index's arrays and the rows it was found for,
        # the pull kernel's compiled version for them); weak references, so that the arrays a
        # table replaces as it grows are freed at once (and never mistaken for others)
        self.kernels: dict[tuple, tuple] = {}

    def answer(self, source: int, op: int, req_id: int, table: int, keys: np.ndarray) -> bool:
        """Answer request ``req_id`` (a pull or a push-pull, ``op``) from rank ``source`` with the
        float32 rows of ``keys`` in table ``table``, as ``answer_pull`` does; False: not done here."""
        server = self.server
        t = server.tables[table]
        store, n = t.store, keys.shape[0]
        spec = store.spec
        dim = spec.dim
        flags = keys.flags
        if not n or server.backlog or store.init_keys or keys.dtype is not UINT64 or not flags.c_contiguous \
                or splits_pull(n, dim):
            return False
        replies = server.replies
        nbytes = REPLY_BYTES + 4 * n * dim
        buf = replies.take(nbytes)
        out = buf[REPLY_BYTES:].view(np.float32).reshape(n, dim)
        if not out.flags.carray:
            return False
        idx, rows, slots = store.index, store.rows, np.empty(n, dtype=np.int64)
        direct, index, index_keys = idx.direct, idx.index, idx.keys
        policies = t.policies
        protocol.REPLY_HEADER.pack_into(buf, 0, req_id, protocol.stop_status(signals.requested()),
                                        server.workers.min_clock(), replies.index, idx.size, policies.admitted,
                                        policies.evicted, 0)
        args = (direct, index, index_keys, keys, idx.tag_bits, rows, dim, store.init_kind, spec.init_scale, spec.seed,
                slots, out)
        # (a push-pull's pulled keys follow its gradients: not 8-byte aligned where it pushes an odd
        # number of values, and numba compiles a version for such keys of its own)
        kind = (table, flags.aligned, flags.writeable)
        got = self.kernels.get(kind)
        if got is not None and got[0]() is direct and got[1]() is index and got[2]() is index_keys \
                and got[3]() is rows:
            got[4](*args)
        else:  # (the first pull of its kind, or the table's arrays replaced: through numba's dispatch)
            self.kernels[kind] = (*map(weakref.ref, (direct, index, index_keys, rows)),
                                  run_and_find(kfused.pull, args)[1])
        worker = source - server.worker_rank0
        if worker >= 0 and policies.reuses_slots:
            store.remember_pull(worker, keys, slots)
        replies.sending += replies.net.start_send(buf, source, protocol.reply_tag(req_id, replies.tag_ub), _WHAT[op])
        replies.posted_bytes += nbytes
        return True
