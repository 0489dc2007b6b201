"""Key placement and rank layout: pure functions, no MPI."""

import os
import subprocess
import sys

import numpy as np
import pytest

from hpcps.ps import placement
from hpcps.ps.layout import Layout, LayoutError
from hpcps.ps.placement import Placement
from hpcps_kernels.hashing import feature_key


@pytest.mark.parametrize("servers", [1, 2, 3, 5, 8])
def test_sequential_and_random_keys_spread_evenly(servers):
    p = Placement(servers)
    for keys in (np.arange(200_000, dtype=np.uint64),
                 np.random.default_rng(0).integers(0, 2**64, 200_000, dtype=np.uint64)):
        counts = np.bincount(p.server_of(keys), minlength=servers)
        assert counts.min() > 0
        assert counts.max() <= 1.3 * counts.mean(), counts


def test_adding_a_server_moves_few_whole_shards():
    for s in (2, 3, 4, 7):
        a, b = Placement(s), Placement(s + 1)
        moved = a.shard_server != b.shard_server
        # only shards taken over by the new server move; about num_shards / (s + 1) of them
        assert np.all(b.shard_server[moved] == s)
        assert moved.sum() <= 1.5 * a.num_shards / (s + 1)


def test_slice_keeps_sorted_keys_sorted_and_covers_every_key():
    p = Placement(3)
    keys = np.unique(np.random.default_rng(1).integers(0, 2**64, 5000, dtype=np.uint64))
    order, offsets = p.slice(keys)
    assert sorted(order.tolist()) == list(range(len(keys)))
    servers = p.server_of(keys)
    for s in range(3):
        part = order[offsets[s]:offsets[s + 1]]
        assert np.all(servers[part] == s)
        assert np.all(np.diff(keys[part].astype(np.float64)) >= 0)


PLACE = """
import sys
import numpy as np
from hpcps.ps.placement import Placement
p, keys = Placement(4), np.frombuffer(bytes.fromhex(sys.argv[1]), dtype=np.uint64)
print(p.shard_server.tolist(), p.server_of(keys).tolist())
"""


def test_placement_is_the_same_in_every_process():
    """Each rank computes the placement itself: other processes (with other hash seeds) agree."""
    keys = np.concatenate([np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64),
                           np.random.default_rng(2).integers(0, 2**64, 1000, dtype=np.uint64)])
    here = Placement(4)
    assert set(here.server_of(keys).tolist()) == {0, 1, 2, 3}
    said = [subprocess.run([sys.executable, "-c", PLACE, keys.tobytes().hex()], capture_output=True, text=True,
                           timeout=120, check=True, env=dict(os.environ, PYTHONHASHSEED=seed)).stdout
            for seed in ("1", "2")]
    assert said[0] == said[1] == f"{here.shard_server.tolist()} {here.server_of(keys).tolist()}\n"


def test_the_ring_is_feature_keys_of_each_servers_points_and_each_shard():
    """The ring's positions are hpcps_kernels' feature keys (XXH64 of the point's name, seeded by
    the server), though made by the xxhash package: the placement of every checkpoint depends on it."""
    points, owner = placement.ring_points(3, vnodes=5)
    want = sorted((feature_key(s, f"vnode-{v}"), s) for s in range(3) for v in range(5))
    assert list(zip(points.tolist(), owner.tolist())) == want
    assert placement.shard_positions(7).tolist() == [feature_key(0x5EED, f"shard-{s}") for s in range(7)]


def test_layout_splits_workers_into_contiguous_groups():
    lay = Layout.plan(7, servers=2, worker_groups=2)
    assert [lay.group_of(r) for r in range(7)] == [-1, -1, 0, 0, 0, 1, 1]
    assert lay.group_ranks(1) == [5, 6]
    assert Layout.plan(4, servers=1).worker_groups == 3


@pytest.mark.parametrize("size,servers,groups,match", [
    (1, 1, None, "too small"), (2, 2, None, "too small"), (3, 1, 3, "between 1 and"), (3, 0, None, "at least 1"),
])
def test_a_world_too_small_is_an_error_naming_what_to_do(size, servers, groups, match):
    with pytest.raises(LayoutError, match=match):
        Layout.plan(size, servers, groups)


def test_layout_by_host_names_each_hosts_roles_for_the_recommended_slurm_layouts():
    lay = Layout.plan(6, servers=2, worker_groups=2)
    # block placement, servers first: servers on one host, workers on the other
    block = lay.by_host(["a", "a", "b", "b", "b", "b"])
    assert block == {"a": {"ranks": [0, 1], "servers": [0, 1], "workers": [], "groups": []},
                     "b": {"ranks": [2, 3, 4, 5], "servers": [], "workers": [0, 1, 2, 3], "groups": [0, 1]}}
    assert lay.describe_hosts(["a", "a", "b", "b", "b", "b"]) == "2 hosts: a: servers 0-1; b: workers 0-3 (groups 0-1)"
    # cyclic placement: one server per host
    cyc = lay.by_host(["a", "b", "a", "b", "a", "b"])
    assert [h["servers"] for h in cyc.values()] == [[0], [1]]
    assert lay.describe_hosts(["a", "b", "a", "b", "a", "b"]) == \
        "2 hosts: a: server 0, workers 0,2 (groups 0-1); b: server 1, workers 1,3 (groups 0-1)"
