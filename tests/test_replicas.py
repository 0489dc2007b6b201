"""Replicated shards (``cluster.replicas``): where the copies go (pure, exact), and whole jobs whose
backups equal their primaries and whose models equal a run without replicas, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpcps.config import ConfigError, from_dict, load_raw
from hpcps.ps import checkpoint, deltas, failover, protocol, transport
from hpcps.ps.placement import Placement, new_copies
from hpcps.ps.replication import Replication
from hpcps.ps.rereplication import insert_rows
from hpcps.ps.server import Server, write_checkpoint_file
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import Features, TableSpec
from hpcps.train import synth
from hpcps.train.model_file import ServingModel
from hpcps_kernels import reference as ref
from hpcps_kernels.copies import primary_prefix, split_primary
from hpcps_kernels.tuning import PUSH_SLICE_SCAN_SERVERS

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]


# -- placement ---------------------------------------------------------------------------------------

def test_copies_of_a_small_ring_exactly():
    p = Placement(4, num_shards=12, replicas=1)
    assert p.copies.tolist() == [[0, 1], [2, 3], [2, 1], [0, 1], [0, 1], [0, 3], [3, 2], [3, 2], [0, 1], [0, 3],
                                 [2, 3], [1, 3]]
    # losing server 1: its shards' first backup is primary, the ring gives the new backup; others stay
    assert p.after_loss(1).copies.tolist() == [[0, 2], [2, 3], [2, 3], [0, 2], [0, 2], [0, 3], [3, 2], [3, 2],
                                               [0, 3], [0, 3], [2, 3], [3, 2]]
    # two hosts of two servers, 3 copies: both hosts before either holds two
    hosts = ("a", "a", "b", "b")
    assert Placement(4, num_shards=12, replicas=2, hosts=hosts).copies.tolist()[:4] == \
        [[0, 2, 1], [2, 0, 3], [2, 1, 3], [0, 2, 1]]


@pytest.mark.parametrize("servers,replicas,hosts", [(2, 1, ()), (5, 2, ()), (6, 1, ("a", "a", "a", "b", "b", "b")),
                                                    (6, 2, ("a", "b", "c", "a", "b", "c")), (3, 1, ("a", "a", "a"))])
def test_copies_are_distinct_servers_on_distinct_hosts_and_spread_evenly(servers, replicas, hosts):
    p = Placement(servers, replicas=replicas, hosts=hosts)
    c = p.copies
    assert c.shape == (p.num_shards, replicas + 1)
    np.testing.assert_array_equal(c[:, 0], Placement(servers).shard_server)  # the primaries do not move
    assert all(len(set(row)) == replicas + 1 for row in c.tolist())
    distinct_hosts = min(replicas + 1, len(set(hosts)))
    if hosts:  # as many distinct hosts as there are, up to the copies
        assert all(len({hosts[s] for s in row}) == distinct_hosts for row in c.tolist())
    held = np.bincount(c.reshape(-1), minlength=servers)
    assert held.max() <= 1.6 * held.mean(), held
    for s in range(servers):
        np.testing.assert_array_equal(p.holds(s), (c == s).any(axis=1))


def test_losing_servers_promotes_the_first_backup_and_moves_nothing_else():
    p = Placement(5, replicas=2, hosts=("a", "a", "b", "b", "c"))
    q = p.after_loss(3)
    r = q.after_loss(0)
    for before, after, lost in ((p, q, 3), (q, r, 0)):
        had = before.holds(lost)
        np.testing.assert_array_equal(after.copies[~had], before.copies[~had])  # shards without a copy there
        assert not after.holds(lost).any()
        for old, new in zip(before.copies[had].tolist(), after.copies[had].tolist()):
            survivors = [s for s in old if s != lost]
            assert new[:len(survivors)] == survivors and len(set(new)) == 3  # order kept, one new copy
        moves = new_copies(before.copies, after.copies)
        assert len(moves) == had.sum()
        for shard, source, target in moves:
            assert source == after.copies[shard, 0] and target == after.copies[shard, -1] and target != lost
    assert r.lost == (3, 0) and r.live_servers == [1, 2, 4]  # (where workers send requests and clocks)
    s = r.after_loss(1)  # (2 servers left for 3 copies: each shard keeps the 2 it can, one on each)
    assert s.replicas == 1 and s.live_servers == [2, 4]
    assert (np.sort(s.copies, axis=1) == [2, 4]).all()


def test_a_push_goes_to_every_copy_in_key_order_and_a_pull_to_the_primary():
    keys = np.unique(np.random.default_rng(3).integers(0, 2**64, 4000, dtype=np.uint64))
    p = Placement(4, replicas=1)
    order, offsets = p.push_slice(keys)
    copies = p.copies[p.shard_of(keys)]
    assert offsets[-1] == 2 * keys.shape[0]
    for s in range(4):  # each once: the keys it is primary of, then those it backs up, each in order
        part = order[offsets[s]:offsets[s + 1]]
        mine = copies[:, 0] == s
        np.testing.assert_array_equal(part, np.concatenate([np.flatnonzero(mine), np.flatnonzero(copies[:, 1] == s)]))
        # the server finds where its own end, and says when they do not come first
        assert primary_prefix(keys[part], p.num_shards, p.shard_server, s) == mine.sum()
        assert primary_prefix(keys[np.sort(part)], p.num_shards, p.shard_server, s) == -1
        assert primary_prefix(keys[part][mine.sum():], p.num_shards, p.shard_server, s) == 0
    plain = Placement(4)
    for a, b in zip(plain.push_slice(keys), plain.slice(keys)):
        np.testing.assert_array_equal(a, b)
    # both ways of the kernel (a scan a server up to PUSH_SLICE_SCAN_SERVERS, else a counting
    # sort), with shard counts a power of two (a mask) and not (a division), against NumPy's
    for servers, replicas, shards in ((2, 1, 1024), (3, 1, 100), (PUSH_SLICE_SCAN_SERVERS + 2, 2, 1024),
                                      (PUSH_SLICE_SCAN_SERVERS + 1, 1, 999)):
        q = Placement(servers, num_shards=shards, replicas=replicas)
        got, want = q.push_slice(keys), ref.push_slice(keys, shards, q.copies, servers)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        order, offsets = got
        for s in range(servers):
            part = keys[order[offsets[s]:offsets[s + 1]]]
            assert primary_prefix(part, shards, q.shard_server, s) == \
                ref.primary_prefix(part, shards, q.shard_server, s) == (q.server_of(part) == s).sum()
        np.testing.assert_array_equal(q.shard_of(keys), ref.shard_of(keys, shards))


@pytest.mark.parametrize("dim", [1, 3])
def test_a_server_splits_a_push_into_the_part_it_is_primary_of_and_the_rest(dim):
    """What a server applies before its reply (its primary part, with the in-pull bits of its
    keys) and after (the backups' part), each in the push's order, as NumPy's masks give them."""
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, 2**64, 1001, dtype=np.uint64))
    grads = rng.normal(size=(keys.shape[0], dim)).astype(np.float32)
    bits = np.packbits(rng.random(keys.shape[0]) < 0.5, bitorder="little")
    for shards in (1024, 100):
        p = Placement(3, num_shards=shards, replicas=1)
        for server in range(3):
            for b in (bits, bits[:0]):
                got = split_primary(keys, grads, b, shards, p.shard_server, server)
                want = ref.split_primary(keys, grads, b, shards, p.shard_server, server)
                for x, y in zip(got, want):
                    np.testing.assert_array_equal(x, y)
                assert got[0].shape[0] + got[3].shape[0] == keys.shape[0] and 0 < got[0].shape[0] < keys.shape[0]


def test_replicas_need_more_servers_and_no_features_a_copy_would_see_differently():
    with pytest.raises(ConfigError, match=r"cluster.replicas = 2 needs at least 3 servers \(cluster.servers = 2\)"):
        from_dict(load_raw(None, ["cluster.servers=2", "cluster.replicas=2"]))
    with pytest.raises(ConfigError, match="does not go with features.server_memory_mb"):
        from_dict(load_raw(None, ["cluster.servers=2", "cluster.replicas=1", "features.server_memory_mb=10"]))
    with pytest.raises(ConfigError, match="does not go with cluster.backup_workers"):
        from_dict(load_raw(None, ["cluster.servers=2", "cluster.replicas=1", "cluster.backup_workers=1"]))
    with pytest.raises(ValueError, match="need at least 2 servers, 1 given"):
        Placement(1, replicas=1)


def test_layout_auto_picks_servers_for_every_copy_or_says_the_world_is_too_small(tmp_path):
    """cluster.layout = "auto" chose 1 server for 4 ranks and the job failed on an unexpected
    LayoutError (exit 1): the scaling model now picks at least replicas + 1 servers, servers the
    user set are checked as under manual, and a world too small is one line, exit 2."""
    from hpcps.train import scaling

    keys = scaling.KeyCurve(((1000, 9000), (2000, 15000)), "the test")
    job = scaling.Job(keys=keys, requests="worker")
    for r in (1, 2):
        assert scaling.choose(4, job, scaling.Machine(cores=2), min_servers=r + 1).servers >= r + 1
    with pytest.raises(ConfigError, match=r"needs at least 3 servers \(cluster.servers = 2\)"):
        from_dict(load_raw(None, ["cluster.layout='auto'", "cluster.servers=2", "cluster.replicas=2"]))
    data = synth.generate(str(tmp_path), 500, 100, fields=4, seed=1, formats=("libsvm",)).files["train_libsvm"]
    proc = subprocess.run([*HPCPS, "train", "--set", f"data.train={json.dumps(data)}", "--set", "cluster.layout='auto'",
                           "--set", "cluster.replicas=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "cluster.replicas = 1 needs at least 2 servers and a worker: run 3 ranks or more (mpiexec -n 3; this world "
        "has 1)"), proc.stdout[-2000:] + proc.stderr[-2000:]


def test_losing_a_server_promotes_its_backups_and_the_copies_made_restore_every_shard():
    """Three servers' tables fed as a worker feeds them (replicas 1), server 2 lost: the survivors'
    plans agree, and once each sent its copies every shard is whole on both of its new copies,
    every row equal to a table that took every push."""
    spec = TableSpec("w", dim=2, optimizer="ftrl", params={"alpha": 0.1})
    p = Placement(3, num_shards=64, replicas=1)
    rng = np.random.default_rng(4)
    keys = np.unique(rng.integers(0, 2**64, 3000, dtype=np.uint64))
    grads = rng.normal(size=(keys.shape[0], 2)).astype(np.float32)
    tables = [ServerTable(spec) for _ in range(3)]
    order, offsets = p.push_slice(keys)
    for s, table in enumerate(tables):
        sel = order[offsets[s]:offsets[s + 1]]
        table.push(keys[sel], grads[sel])
    whole = ServerTable(spec)
    whole.push(keys, grads)
    survivors = [Replication(p, s) for s in (0, 1)]
    moves = [r.rank_lost(2) for r in survivors]
    assert moves[0] == moves[1] and moves[0] == new_copies(p.copies, p.after_loss(2).copies) and moves[0]
    sent = [r.copy_out([tables[r.server]], moves[0]) for r in survivors]
    for out in sent:
        for target, parts in out.items():
            insert_rows([tables[target]], [(keys, rows) for _, keys, rows, _ in parts])
    after = survivors[0].placement
    for s in (0, 1):
        k, rows = tables[s].items()
        np.testing.assert_array_equal(np.sort(k), keys[after.holds(s)[after.shard_of(keys)]])
        np.testing.assert_array_equal(rows, _rows(whole, k))  # parameters and FTRL state, bit for bit


def test_a_copy_message_carries_its_shards_clock_and_every_tables_rows_exactly():
    """``COPY`` (new backups over the wire): tables of odd widths (rows padded to 8 bytes) and an
    empty one come back as sent."""
    rng = np.random.default_rng(7)
    parts = [(rng.integers(0, 2**64, n, dtype=np.uint64), rng.normal(size=(n, w)).astype(np.float32))
             for n, w in ((5, 3), (0, 2), (7, 1))]
    sent = protocol.Copy(41, 2, 1, np.array([3, 9, 1000], dtype=np.int64), parts, 12.5)
    got = protocol.unpack_request(sent.pack(), dims=[])
    assert isinstance(got, protocol.Copy)
    assert (got.clock, got.source, got.lost, got.cut_at, got.shards.tolist()) == (41, 2, 1, 12.5, [3, 9, 1000])
    for (k, r), (gk, gr) in zip(parts, got.parts):
        assert gk.tobytes() == k.tobytes() and gr.tobytes() == r.tobytes() and gr.shape == r.shape
    placed = protocol.unpack_request(protocol.Placed(17, 1, 2).pack(), dims=[])
    assert (placed.op, placed.clock, placed.worker, placed.lost) == (protocol.PLACED, 17, 1, 2)


@pytest.mark.parametrize("settled", [False, True])
def test_a_second_loss_before_a_landed_copy_has_every_push_before_it_ends_the_job(settled):
    """A server (of 3, 1 replica, BSP, its transport the in-process one) given new backups after
    server 1's loss, their copy landed at clock 5: server 2 lost while pushes of a clock before 5
    may still be kept for their turn here ends the job (as a primary's they would be applied again
    over the copy's rows); once every worker is at clock 5, the loss is survived."""
    server = Server(transport.Loopback(), 0, 1, 1, [TableSpec("w", dim=2)], Placement(3, num_shards=64, replicas=1), 0)
    server.net.deliver = lambda source, buf: None  # (this server's copies to server 2: not followed here)
    failover.plug(server)
    failover.promote(server, 1)
    mine = [shard for shard, _, target in new_copies(Placement(3, 64, replicas=1).copies,
                                                     server.placement.copies) if target == 0]
    server.copying.placed_by(0, 4, 1)
    server.copying.before_push(5)  # (this server's copies cut at clock 5 and sent)
    width = server.tables[0].items()[1].shape[1]
    server.copying.take(protocol.Copy(5, 2, 1, np.array(mine, dtype=np.int64),
                                      [(np.zeros(0, dtype=np.uint64), np.zeros((0, width), dtype=np.float32))]))
    assert mine and not server.copying.busy
    if settled:
        server.handle(1, protocol.Clock(5, 0).pack())
        assert not server.copying.due()
        failover.promote(server, 2)
        assert server.placement.lost == (1, 2)
    else:
        with pytest.raises(transport.RankFailed) as failed:
            failover.promote(server, 2)
        assert failed.value.ranks == (2,) and "second server lost before the new backups" in failed.value.why


def test_under_ssp_a_copy_from_the_shadow_holds_the_pushes_before_the_notices_and_reads_see_every_push(tmp_path):
    """SSP (staleness 2; ASP takes the same path), 3 servers with 1 replica, 2 workers, server 1
    lost: server 0 copies shards to server 2. On server 0 (the source) every push is applied to
    its rows as it comes (g1, g2, g3: a checkpoint and a delta written before the last notice hold
    g2, sent after worker 0's PLACED), and to the shadow only those sent before their worker's
    PLACED (g1, g3): the copy. On server 2 (the new backup) g2 is held until the copy lands and
    then applied on its rows: g1, g3, g2, each once (FTRL: the order and a push applied twice or
    not at all would change them)."""
    spec, placement = TableSpec("w", dim=1, optimizer="ftrl"), Placement(3, num_shards=64, replicas=1)
    moved = [shard for shard, source, target in new_copies(placement.copies, placement.after_loss(1).copies)
             if (source, target) == (0, 2)]
    keys = np.array([k for k in range(1, 4000) if int(placement.shard_of(np.array([k], np.uint64))[0]) in moved][:40],
                    dtype=np.uint64)
    g1, g2, g3 = (np.full((keys.shape[0], 1), v, np.float32) for v in (0.5, -1.5, 0.25))
    servers, sent = {}, []
    for index in (0, 2):
        server = servers[index] = Server(transport.Loopback(), index, 2, 3, [spec], placement, 2)
        server.net.deliver = lambda source, buf: sent.append(protocol.unpack_request(buf.copy(), dims=[]))
        failover.plug(server)

    def push(server, worker, grads):
        server.push_now(worker, 0, keys, grads, 7)
        server.apply_backlog()

    def applied(*grads):
        table = ServerTable(spec)
        for g in grads:
            table.push(keys, g)
        return _rows(table, keys).tobytes()

    source, backup = servers[0], servers[2]
    push(source, 0, g1)
    deltas.track_changes(source.tables)  # (a delta snapshot's marks, from here on)
    failover.promote(source, 1)
    failover.promote(backup, 1)
    source.handle(3, protocol.Placed(7, 0, 1).pack())
    push(source, 0, g2)  # (sent after worker 0's PLACED: its rows, not the shadow)
    push(source, 1, g3)  # (worker 1's, before its PLACED)
    assert not sent and _rows(source.tables[0], keys).tobytes() == applied(g1, g2, g3)
    write_checkpoint_file(str(tmp_path), source.tables, 0, source.replication, 7)
    with h5py.File(checkpoint.server_file(str(tmp_path), 0), "r") as f:
        assert _by_key(f["tables/w/keys"][...], f["tables/w/rows"][...], keys).tobytes() == applied(g1, g2, g3)
    _, delta_keys, delta_rows, _ = deltas.changed_part(source.tables[0])
    assert _by_key(delta_keys, delta_rows, keys).tobytes() == applied(g1, g2, g3)
    source.handle(4, protocol.Placed(7, 1, 1).pack())
    source.copying.due()
    copy = [c for c in sent if c.source == 0]
    assert len(copy) == 1 and copy[0].clock == -1 and source.copying.shadow is None
    assert np.array_equal(np.sort(copy[0].parts[0][0]), np.sort(keys))
    assert _by_key(*copy[0].parts[0], keys).tobytes() == applied(g1, g3)
    for worker in (0, 1):
        backup.handle(3 + worker, protocol.Placed(7, worker, 1).pack())
    backup.copying.due()  # (its own copies to server 0, cut and sent)
    push(backup, 0, g2)  # (held: the copy has not landed)
    assert backup.tables[0].size == 0 and backup.copying.busy
    backup.stall_timeout_s, backup.copying.lost_at = 5.0, time.monotonic() - 6.0  # (a copy that never lands)
    with pytest.raises(transport.StallError, match=r"server 2: the copies of \d+ shards .* never landed from "
                                                   r"server\(s\) 0 in cluster.stall_timeout_s = 5 s"):
        backup.copying.due()
    backup.copying.take(copy[0])
    assert not backup.copying.busy
    assert _rows(backup.tables[0], keys).tobytes() == applied(g1, g3, g2)


# -- the shadow's copy (SSP, ASP): each compared with a table given only the pushes before the notices

def _moved_and_kept(placement):
    """Keys of the shards server 0 copies to server 2 after server 1's loss (``moved``), and of
    shards server 0 holds and copies nowhere (``kept``), 400 of each, in an order mixing none."""
    moved = {shard for shard, source, target in new_copies(placement.copies, placement.after_loss(1).copies)
             if (source, target) == (0, 2)}
    held = {s for s in range(placement.num_shards) if 0 in placement.after_loss(1).copies[s]} - moved
    candidates = np.arange(1, 20_000, dtype=np.uint64)
    shards = placement.shard_of(candidates)
    pick = lambda wanted: candidates[np.isin(shards, sorted(wanted))][:400]  # noqa: E731
    return pick(moved), pick(held)


def _copy_of_the_shadow(specs, staleness, before, placed_first, notices):
    """Server 0 of 3 (1 replica, 2 workers, ``staleness``) applies ``before`` (pushes
    ``(worker, table, keys, grads, clock)``), learns of server 1's loss, gets worker 0's
    ``PLACED``, then ``placed_first`` (worker 0's pushes: after its notice; worker 1's: before),
    then worker 1's ``PLACED``. Returns the shadow's keys per table before that last notice, the
    copy it sends server 2 (a ``protocol.Copy``), and a fresh ServerTable per spec given only the
    pushes sent before the notices, in their order (``notices``: which pushes those are)."""
    placement, sent = Placement(3, num_shards=64, replicas=1), []
    source = Server(transport.Loopback(), 0, 2, 3, specs, placement, staleness)
    source.net.deliver = lambda to, buf: sent.append(protocol.unpack_request(buf.copy(), dims=[]))
    failover.plug(source)
    for worker, table, keys, grads, clock in before:
        source.push_now(worker, table, keys, grads, clock)
        source.apply_backlog()
    failover.promote(source, 1)
    source.handle(3, protocol.Placed(7, 0, 1).pack())
    for worker, table, keys, grads, clock in placed_first:
        source.push_now(worker, table, keys, grads, clock)
        source.apply_backlog()
    shadow_keys = [np.sort(t.items()[0]) for t in source.copying.shadow.tables]
    source.handle(4, protocol.Placed(7, 1, 1).pack())
    source.copying.due()
    assert not source.copying.outgoing and source.copying.shadow is None  # (sent; its own copy from 2 awaited)
    copy, = [c for c in sent if c.source == 0]
    expected = [ServerTable(spec) for spec in specs]
    for worker, table, keys, grads, clock in [*before, *notices]:
        expected[table].push(keys, grads, clock)
    return shadow_keys, copy, expected


def _assert_copy_is(copy, expected, moved):
    """``copy`` holds, per table, exactly the rows of ``expected`` (tables) of the keys of the moved
    shards (``moved``) they hold, bit for bit (parameters and optimizer state)."""
    assert copy.clock == -1 and len(copy.parts) == len(expected)
    for (keys, rows), table in zip(copy.parts, expected):
        held = table.items()[0]
        want = np.sort(held[np.isin(held, moved)])
        assert np.array_equal(np.sort(keys), want) and want.shape[0] > 0
        assert _by_key(keys, rows, want).tobytes() == _rows(table, want).tobytes()


def test_a_push_partly_in_the_moved_shards_gives_the_shadow_only_those_keys():
    """SSP, FTRL: pushes mixing keys of the moved shards with keys server 0 keeps (the shadow's
    ``sel.any()`` branch). The shadow holds only the moved shards' keys, and the copy equals a
    table given the pushes before the notices (worker 1's mixed push), not worker 0's after its
    notice."""
    spec = TableSpec("w", dim=1, optimizer="ftrl")
    moved, kept = _moved_and_kept(Placement(3, num_shards=64, replicas=1))
    mixed = np.concatenate([kept[:100], moved[:100], kept[100:200], moved[100:200]])  # (interleaved)
    grads = lambda v: np.linspace(-v, v, mixed.shape[0], dtype=np.float32).reshape(-1, 1)  # noqa: E731
    before = [(0, 0, mixed, grads(1.0), 3)]
    late, early = (0, 0, mixed[::-1].copy(), grads(2.0), 8), (1, 0, mixed, grads(0.5), 6)
    shadow_keys, copy, expected = _copy_of_the_shadow([spec], 2, before, [late, early], [early])
    assert np.array_equal(shadow_keys[0], np.sort(moved[:200]))  # (none of the kept shards' keys)
    _assert_copy_is(copy, expected, moved)


def test_a_push_of_keys_new_to_the_table_creates_the_shadows_rows_as_the_table_would():
    """SSP: keys first pushed after the loss, in the moved shards and not, to a table whose rows
    start from a seeded uniform initializer, with FTRL's state, admitted by a draw per key and
    clock (``admit_probability``): the shadow creates, and leaves out, exactly the rows the table
    would."""
    spec = TableSpec("w", dim=1, optimizer="ftrl", init="uniform", init_scale=0.5, seed=11,
                     features=Features(admit_probability=0.5))
    moved, kept = _moved_and_kept(Placement(3, num_shards=64, replicas=1))
    old, new = np.concatenate([moved[:50], kept[:50]]), np.concatenate([kept[50:150], moved[50:250]])
    g = lambda keys, v: np.full((keys.shape[0], 1), v, np.float32)  # noqa: E731
    before = [(0, 0, old, g(old, 1.0), 2)]
    early = (1, 0, np.concatenate([new, old]), g(np.concatenate([new, old]), -0.75), 5)
    only_moved = (1, 0, moved[300:400].copy(), g(moved[300:400], 0.25), 6)  # (every key moved: the whole push)
    late = (0, 0, moved[250:300].copy(), g(moved[250:300], 3.0), 9)  # (new too: after the notice, not copied)
    shadow_keys, copy, expected = _copy_of_the_shadow([spec], 2, before, [early, late, only_moved],
                                                      [early, only_moved])
    admitted = expected[0].items()[0]
    for new_moved in (moved[50:250], moved[300:400]):  # (the draw admits some new keys, not all)
        assert 0 < np.isin(new_moved, admitted).sum() < new_moved.shape[0]
    assert not np.isin(moved[250:300], copy.parts[0][0]).any()
    _assert_copy_is(copy, expected, moved)


def test_under_asp_the_shadow_copies_two_tables_one_of_dim_1_plus_k():
    """ASP (staleness -1): a linear table (FTRL, dim 1) and an FM-like one (Adam, dim 1 + 4,
    normal initializer, a direct index on the source): pushes to each, before and after the
    notices, with keys new and old; the copy holds each table's rows as a table given only the
    pushes before the notices."""
    specs = [TableSpec("w", dim=1, optimizer="ftrl"),
             TableSpec("v", dim=5, optimizer="adam", init="normal", init_scale=0.1, seed=3, key_bits=16)]
    moved, kept = _moved_and_kept(Placement(3, num_shards=64, replicas=1))
    both = np.concatenate([moved[:150], kept[:150]])
    g = lambda t, keys, v: np.full((keys.shape[0], specs[t].dim), v, np.float32)  # noqa: E731
    before = [(0, t, both, g(t, both, 0.5), 1) for t in (0, 1)]
    more = np.concatenate([both, moved[150:200]])
    early = [(1, 0, more, g(0, more, -0.25), 4), (1, 1, moved[100:200].copy(), g(1, moved[100:200], 2.0), 4),
             (1, 1, more, g(1, more, 0.75), 5)]
    late = [(0, 1, both, g(1, both, 1.5), 6), (0, 0, both, g(0, both, -1.0), 6)]
    shadow_keys, copy, expected = _copy_of_the_shadow(specs, -1, before, [early[0], late[0], early[1], late[1], early[2]],
                                                      early)
    assert [k.shape[0] for k in shadow_keys] == [200, 200]
    _assert_copy_is(copy, expected, moved)


def _rows(table, keys):
    """The stored rows (parameters and state) of ``keys`` in ``table``."""
    return _by_key(*table.items(), keys)


def _by_key(all_keys, all_rows, keys):
    """The rows of ``keys`` among ``all_rows`` (those of ``all_keys``)."""
    where = {int(k): i for i, k in enumerate(all_keys)}
    return all_rows[[where[int(k)] for k in keys]]


# -- jobs --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica-data")
    info = synth.generate(str(d), 8_000, 1_000, fields=8, seed=5, formats=("libsvm",))
    return info.files["train_libsvm"], info.files["test_libsvm"]


def run_job(n, data, out_dir, servers=2, replicas=0, extra=()):
    sets = {"data.train": json.dumps(data[0]), "data.test": json.dumps(data[1]), "train.batch_size": 100,
            "train.epochs": 2, "train.progress": "false", "cluster.servers": servers,
            "cluster.replicas": replicas, "train.model_out": json.dumps(str(out_dir / "model.h5")),
            "checkpoint.dir": json.dumps(str(out_dir / "ck")), "checkpoint.every_steps": 60}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run([*mpiexec(), "-n", str(n), *HPCPS, "train", *args, *extra,
                           "--summary-json", str(out_dir / "summary.json")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    with open(out_dir / "summary.json") as f:
        return json.load(f)


def assert_same_model(a, b):
    ma, mb = ServingModel(str(a)), ServingModel(str(b))
    np.testing.assert_array_equal(ma.keys, mb.keys)
    np.testing.assert_array_equal(ma.values, mb.values)  # bit-identical


def test_replicated_run_equals_the_plain_one_and_its_backups_their_primaries(data, tmp_path):
    """2 servers + 2 workers (BSP): replicas 1 gives the model of replicas 0 bit for bit, every
    backup's rows equal its primary's at the end, its checkpoints and delta snapshots hold each
    shard once, and a resume from a delta onto 3 servers (resharded, backups restored from the
    primaries' files) ends with the same model and equal copies again."""
    plain, rep, resumed = tmp_path / "plain", tmp_path / "rep", tmp_path / "resumed"
    for d in (plain, rep, resumed):
        d.mkdir()
    base = run_job(4, data, plain)
    got = run_job(4, data, rep, replicas=1, extra=["--set", "checkpoint.delta_every_steps=20"])
    assert_same_model(rep / "model.h5", plain / "model.h5")
    assert got["replica_copies"] == 2 * 1024 and got["replica_shards_differing"] == 0
    assert got["table_keys"] == base["table_keys"] and got["admitted_keys"] == base["admitted_keys"]
    # each shard written once, by its primary: the files' keys are the model's, none twice (and a
    # delta's are the changed rows', none twice)
    final, manifest = checkpoint.newest_good(str(rep / "ck"))
    delta = checkpoint.step_dir(str(rep / "ck"), 40, "delta")
    for snapshot, table_keys in ((final, base["table_keys"]), (delta, None)):
        with open(os.path.join(snapshot, checkpoint.MANIFEST)) as f:
            m = json.load(f)
        keys = np.concatenate([checkpoint.read_for_server(snapshot, m, "w", s, Placement(2).shard_server, 0)[0]
                               for s in range(2)])
        assert keys.shape[0] == np.unique(keys).shape[0] == (table_keys or keys.shape[0]) > 0
    # resumed from the delta (over its chain) onto 3 servers, each shard on all three
    again = run_job(5, data, resumed, servers=3, replicas=2, extra=["--resume", delta])
    assert again["replica_shards_differing"] == 0 and again["replica_copies"] == 3 * 1024
    assert_same_model(resumed / "model.h5", plain / "model.h5")


def test_bench_ps_replication_rows_compare_replicas_1_with_0_on_the_same_servers():
    proc = subprocess.run([*mpiexec(), "-n", "3", sys.executable, "-m", "hpcps.cli", "bench", "ps", "--replicas", "1",
                           "--sizes", "500", "--pairs", "1", "--repeat", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["kind"] for r in rows} == {"push+apply", "push-pull step", "push-pull step, paced"}
    for r in rows:  # one pair: its ratio is the replicated time over the plain one
        assert r["servers"] == 2 and r["replicas"] == 1 and r["keys"] == 500, r
        assert r["ratio"] == pytest.approx(r["replicated_time_s"] / r["time_s"]) and r["time_s"] > 0, r


def test_the_library_refuses_replicas_with_backup_workers_as_the_config_does():
    """hpcps.init(replicas=1, backup=Backup(1)) ran (the config refuses the pair: copies could differ)."""
    import hpcps
    from hpcps.ps.consistency import Backup

    with pytest.raises(ValueError, match="cluster.replicas = 1 does not go with cluster.backup_workers = 1"):
        hpcps.init(servers=2, replicas=1, backup=Backup(1))
