"""Large messages: the buffer pool that reuses them, the packing of a request's gradients, and
replies sent as header then payload (``hpcps.ps.transport``, ``hpcps.ps.protocol``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hpcps.ps import protocol, transport


def test_a_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    from mpi4py import MPI

    pool = transport.BufferPool(min_bytes=1 << 10, max_bytes=1 << 20)
    small = pool.take(100)
    assert pool.held_bytes == 0 and small.nbytes == 100  # below min_bytes: not pooled
    a = pool.take(4000)
    a[:] = 1
    rows = a[:64].view(np.float32).reshape(4, 4)  # a view of a view still holds the buffer
    del a
    b = pool.take(4000)
    assert not np.shares_memory(b, rows) and pool.reused == 0
    del b, rows
    c = pool.take(3000)  # a free buffer of at most twice the size
    other = pool.take(3000)
    assert pool.reused == 2 and c.nbytes == 3000 and not np.shares_memory(c, other)
    # a pending MPI receive holds its buffer too
    req = MPI.COMM_SELF.Irecv(c, source=0, tag=5)
    at = c.ctypes.data
    del c
    d = pool.take(3000)
    assert pool.reused == 2 and d.ctypes.data != at
    req.Cancel()
    req.Wait()
    del req
    assert pool.take(3000).ctypes.data == at and pool.reused == 3
    # too small or too large a free buffer is not used; the budget holds
    del other, d
    assert pool.take(20000).nbytes == 20000 and pool.reused == 3
    big = [pool.take(300_000) for _ in range(4)]
    assert pool.held_bytes <= 1 << 20 and all(x.nbytes == 300_000 for x in big)
    assert all(x.ctypes.data % 4096 == transport.MESSAGE_PAGE_OFFSET for x in big)  # away from a page's edges
    assert len({x.ctypes.data for x in big}) == 4


def test_large_gradients_are_packed_where_copies_run_fast_and_unpack_unchanged(monkeypatch):
    rng = np.random.default_rng(0)
    pool = transport.BufferPool(min_bytes=1 << 10)
    shifts = set()
    monkeypatch.setattr(protocol, "PLACED_BYTES", 1 << 16)  # (placed from 32 MiB: small arrays here)
    for n, dim in ((3, 4), (9000, 8), (20011, 3), *((n, 32) for n in range(600, 1112))):  # (a page's worth of 8n)
        keys = rng.integers(0, 2**63, n, dtype=np.uint64)
        grads = rng.normal(size=(n, dim)).astype(np.float32)
        pull = rng.integers(0, 2**63, 7, dtype=np.uint64)
        for alloc in (None, pool.take):
            msg = protocol.PushPull(2, 11, 5, 1, keys, grads, pull).pack(alloc)
            r = protocol.unpack_request(msg, [1, 1, dim])
            np.testing.assert_array_equal(r.push_keys, keys)
            np.testing.assert_array_equal(r.grads, grads)
            np.testing.assert_array_equal(r.pull_keys, pull)
            assert (r.op, r.table, r.req_id, r.clock, r.worker) == (protocol.PUSHPULL, 2, 11, 5, 1)
            if grads.nbytes >= protocol.PLACED_BYTES:
                past = (r.grads.ctypes.data - grads.ctypes.data) % protocol.PAGE_BYTES
                assert past == 0 or past >= 1024, past
                shifts.add(msg.ctypes.data % protocol.PAGE_BYTES)
            assert msg.nbytes == protocol.request_bytes(n, 7, dim)
    assert shifts == {2048, 3072}  # (3072 where from 2048 the gradients would land 1-1023 bytes past)


@pytest.mark.mpi(min_size=2)
def test_an_announced_reply_is_waited_for_asleep_until_its_header_comes(monkeypatch):
    """A wait on a reply sent as header then payload sleeps while the sender prepares it and
    spins only for the payload's transfer; a reply in one message is spun for as long as its
    size says (the spin rate is lowered here so that this is most of the sender's delay)."""
    from mpi4py import MPI

    monkeypatch.setattr(transport, "SPIN_BYTES_PER_S", 8e6)  # 8 MiB: spin for 1 s
    comm = MPI.COMM_WORLD.Dup()
    n = 8 << 20
    share = {}
    for announced in (True, False):
        if comm.rank == 0:
            out = transport.BufferPool().take(n)
            start = (transport.start_recv_announced(comm, out, 64, 1, 3, "reply") if announced
                     else transport.start_recv(comm, out, 1, 3, "reply"))
            wall, cpu = time.perf_counter(), time.process_time()
            transport.wait(start, timeout=60)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            np.testing.assert_array_equal(out[::4096], (np.arange(n, dtype=np.int64)[::4096] % 251).astype(np.uint8))
            assert wall > 0.8, wall
            share[announced] = cpu / wall
        elif comm.rank == 1:
            buf = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
            time.sleep(1.0)  # the server's work
            sends = (transport.start_send_announced(comm, buf, 64, 0, 3, "reply") if announced
                     else transport.start_send(comm, buf, 0, 3, "reply"))
            transport.wait(sends, timeout=60)
        comm.Barrier()
    if comm.rank == 0:  # (the spinning wait's share depends on the machine's load: compared, not fixed)
        assert share[True] < 0.25 and share[True] < share[False] / 2, share
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_wait_tests_again_after_a_transfer_completes_before_it_would_sleep():
    """A request sent above MPI's eager limit completes once the receiver acknowledges it, and
    the test that sees that acknowledgement can leave the reply that came after it for the next
    pass: the wait tests again at once rather than after a sleep (its ``background`` is called
    where it would sleep: never here, as every transfer is done before the wait begins)."""
    import os
    import tempfile

    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    flag = os.path.join(comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None, root=0), "replied")
    n = 1 << 16  # (above the eager limit of MPICH's and Open MPI's shared memory)
    if comm.rank == 0:
        reply, request = np.zeros(1), np.arange(n, dtype=np.uint8)
        pending = transport.start_recv(comm, reply, 1, 3, "reply") + transport.start_send(comm, request, 1, 5, "request")
        while not os.path.exists(flag):  # (no MPI call meanwhile: the acknowledgement and the reply wait in its queue)
            time.sleep(0.01)
        sleeps = []
        transport.wait(pending, timeout=60, background=lambda: sleeps.append(1) or False)
        assert reply[0] == float(request.astype(np.int64).sum()) and sleeps == [], sleeps
        os.remove(flag)
        os.rmdir(os.path.dirname(flag))
    elif comm.rank == 1:
        got = np.empty(n, dtype=np.uint8)
        comm.Recv(got, source=0, tag=5)
        comm.Send(np.full(1, float(got.astype(np.int64).sum())), dest=0, tag=3)  # (what it received, summed)
        open(flag, "w").close()
    comm.Barrier()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_reply_says_in_its_header_whether_its_payload_comes_apart():
    """The receiver of a reply posts one receive and reads the framing from the header the
    server wrote (``protocol.PAYLOAD_APART``): a reply sent whole and one sent as header then
    payload both arrive complete, with no size threshold on the receiving side."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    for apart, n in ((False, 1000), (True, 1000), (False, 1 << 20), (True, 1 << 20)):
        if comm.rank == 0:
            out = np.empty(protocol.REPLY_BYTES + 4 * n, np.uint8)
            transport.wait(transport.start_recv_framed(comm, out, protocol.REPLY_BYTES, 1, 3, "reply",
                                                       protocol.payload_apart), timeout=60)
            assert protocol.payload_apart(out) == apart
            assert protocol.reply_words(out)[0] == n  # (its req_id)
            np.testing.assert_array_equal(protocol.pulled_values(out, 1)[:, 0], np.arange(n, dtype=np.float32))
        elif comm.rank == 1:
            buf, payload = protocol.pack_reply(n, protocol.OK, 0, 0, 4 * n, apart=apart)
            payload.view(np.float32)[:] = np.arange(n, dtype=np.float32)
            send = transport.start_send_announced if apart else transport.start_send
            args = (comm, buf, protocol.REPLY_BYTES, 0, 3, "reply") if apart else (comm, buf, 0, 3, "reply")
            transport.wait(send(*args), timeout=60)
        comm.Barrier()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_large_pushes_and_pulls_through_pooled_buffers_carry_exact_values():
    """Pushes and pulls of 19 MB each way (pooled buffers on both sides, the gradients sent
    apart, the replies announced, the server's two threads): every pull holds the exact sums so
    far, including the pulls kept while later ones reuse the pool's buffers."""
    import hpcps

    ctx = hpcps.init(servers=1, staleness=0, stall_timeout_s=120)
    n, dim = 150_000, 32
    w = ctx.sparse_table("w", dim=dim, optimizer="sgd", params={"lr": 1.0}, key_bits=24)
    if ctx.is_server:
        ctx.serve()
        assert ctx.server.pool.reused > 0
    elif ctx.worker_index == 0:
        rng = np.random.default_rng(3)
        keys = np.sort(rng.choice(1 << 24, n, replace=False)).astype(np.uint64)
        pattern = rng.integers(-3, 4, (n, dim)).astype(np.float32)
        kept = []
        for r in range(4):
            w.wait(w.push(keys, -(r + 1) * pattern))  # SGD, lr 1: w = the sum of what was pushed
            ctx.clock()
            kept.append(w.pull(keys))
            np.testing.assert_array_equal(w.pull(keys), kept[-1])  # (its buffer is free again at once)
        for r, got in enumerate(kept):
            np.testing.assert_array_equal(got, pattern * ((r + 1) * (r + 2) // 2))
        assert ctx.pool.reused > 0
    ctx.finalize()


def test_a_request_with_its_gradients_apart_unpacks_to_the_same_arrays():
    rng = np.random.default_rng(0)
    keys, pull = np.arange(7, dtype=np.uint64) * 5, np.arange(3, dtype=np.uint64)
    grads = rng.normal(size=(7, 4)).astype(np.float32)
    in_pull = np.isin(keys, pull)
    whole = protocol.PushPull(1, 9, 4, 0, keys, grads, pull, 0, in_pull).pack()
    apart = protocol.PushPull(1, 9, 4, 0, keys, grads, pull, 0, in_pull, grads_apart=True).pack()
    dims = [2, 4]
    assert apart.nbytes == whole.nbytes - grads.nbytes
    assert protocol.apart_grads_bytes(whole, dims) == 0 and protocol.apart_grads_bytes(apart, dims) == grads.nbytes
    a = protocol.unpack_request(whole, dims)
    b = protocol.unpack_request(apart, dims, grads.view(np.uint8).reshape(-1).copy())
    for x, y in ((a.push_keys, b.push_keys), (a.grads, b.grads), (a.pull_keys, b.pull_keys), (a.in_pull, b.in_pull)):
        np.testing.assert_array_equal(x, y)
    assert (a.op, a.table, a.req_id, a.clock) == (b.op, b.table, b.req_id, b.clock) == (protocol.PUSHPULL, 1, 9, 4)


def test_only_large_gradients_away_from_a_page_edge_go_apart():
    raw = np.empty(protocol.GRADS_APART_BYTES + 2 * protocol.PAGE_BYTES, np.uint8)
    base = (-raw.ctypes.data) % protocol.PAGE_BYTES  # the first page boundary in raw
    n = protocol.GRADS_APART_BYTES
    assert protocol.grads_apart(raw[base + 16:base + 16 + n].view(np.float32))
    assert protocol.grads_apart(raw[base + 2048:base + 2048 + n].view(np.float32))
    assert not protocol.grads_apart(raw[base:base + n].view(np.float32))  # where MPICH's copy is slow
    assert not protocol.grads_apart(raw[base + 8:base + 8 + n].view(np.float32))
    assert not protocol.grads_apart(raw[base + 16:base + 16 + n - 4].view(np.float32))  # too small


def _apart_sums(servers: int):
    """Two tables' large pushes (their gradients apart) with a small one between them, then a
    large push-pull, in flight together from every worker, sum exactly on the servers (BSP). A
    push that is not donated has sent its gradients when it returns: overwriting them then
    changes nothing; donated ones are left alone."""
    import hpcps

    ctx = hpcps.init(servers=servers, staleness=0, stall_timeout_s=60)
    dim, n = 64, 10000 * servers  # 2.56 MB of gradients a server
    assert n // servers * dim * 4 >= protocol.GRADS_APART_BYTES
    tables = [ctx.sparse_table(name, dim=dim, optimizer="sgd", params={"lr": 1.0}) for name in ("a", "b")]
    if ctx.is_server:
        ctx.serve()
        assert ctx.server.stats["requests"] > 0
    else:
        me, workers = ctx.worker_index, ctx.layout.workers
        keys = np.arange(n, dtype=np.uint64) * 7 + 3
        small = np.arange(10, dtype=np.uint64) + 10**9

        def grads(w, t, it):
            return np.full((n, dim), (w + 1) * (t + 1) * (it + 1), np.float32)

        def total(t, iters):  # sgd, lr 1: minus the sum of every worker's gradients
            return -float(sum((w + 1) * (t + 1) * (it + 1) for w in range(workers) for it in range(iters)))

        for it in range(3):
            lent = grads(me, 0, it)
            ts = [(tables[0], tables[0].push(keys, lent))]
            lent[:] = 1e9  # after push returned: not what was sent
            ts += [(tables[1], tables[1].push(small, np.ones((10, dim), np.float32))),
                   (tables[1], tables[1].push(keys, grads(me, 1, it), donate=True))]
            for t, x in ts:
                t.wait(x)
            ctx.clock()
        got = tables[0].wait(tables[0].ipushpull(keys, grads(me, 0, 3), keys, unique=True, donate=True))
        np.testing.assert_array_equal(got, np.full((n, dim), total(0, 4), np.float32))
        np.testing.assert_array_equal(tables[1].pull(keys), np.full((n, dim), total(1, 3), np.float32))
        np.testing.assert_array_equal(tables[1].pull(small), np.full((10, dim), -3.0 * workers, np.float32))
    ctx.finalize()


@pytest.mark.mpi(min_size=3)
def test_large_gradients_sent_apart_sum_exactly_with_one_server():
    _apart_sums(1)


@pytest.mark.mpi(min_size=4)
def test_large_gradients_sent_apart_sum_exactly_with_two_servers():
    _apart_sums(2)
