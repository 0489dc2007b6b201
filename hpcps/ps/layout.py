"""Which rank does what: servers and worker groups. Pure, so errors come before any communication.

World ranks ``0 .. S-1`` are the servers (server index = rank); the remaining ``W = size - S`` ranks
are workers (worker index = rank - S), cut into ``G`` worker groups of consecutive ranks whose
sizes differ by at most one.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """The world cannot hold the requested servers and worker groups."""


def check_world(world_size: int, servers: int, worker_groups: int | None = None,
                num_shards: int | None = None) -> None:
    """Raise LayoutError if a world of ``world_size`` ranks cannot run the layout. A world of one
    process runs 1 server and 1 worker inside it (``hpcps.ps.context.LocalContext``)."""
    if world_size == 1:
        if servers != 1 or (worker_groups or 1) != 1:
            raise LayoutError(f"one process runs 1 server and 1 worker inside it; for {servers} server(s) and "
                              f"{worker_groups or 1} worker group(s) start more ranks with mpiexec -n N")
        return
    Layout.plan(world_size, servers, worker_groups, num_shards)


@dataclass(frozen=True)
class Layout:
    world_size: int
    servers: int
    worker_groups: int

    @classmethod
    def plan(cls, world_size: int, servers: int, worker_groups: int | None = None,
             num_shards: int | None = None) -> "Layout":
        """Check and build a layout; ``worker_groups=None`` makes one group per worker.

        ``num_shards``, when given, must be at least ``servers`` (every server owns a shard).
        """
        if servers < 1:
            raise LayoutError(f"cluster.servers must be at least 1 (got {servers})")
        workers = world_size - servers
        if workers < 1:
            raise LayoutError(
                f"a world of {world_size} rank(s) is too small for {servers} server(s) and at least one "
                f"worker: run with mpiexec -n {servers + 1} or more, or use fewer servers (cluster.servers)")
        if num_shards is not None and num_shards < servers:
            raise LayoutError(f"{num_shards} virtual shard(s) cannot be spread over {servers} servers: "
                              f"set cluster.num_shards to at least {servers} (default 1024)")
        groups = workers if worker_groups is None else worker_groups
        if groups < 1 or groups > workers:
            raise LayoutError(
                f"cluster.worker_groups must be between 1 and the number of workers ({workers} = {world_size} ranks "
                f"- {servers} servers), got {worker_groups}")
        return cls(world_size, servers, groups)

    @property
    def workers(self) -> int:
        return self.world_size - self.servers

    def is_server(self, rank: int) -> bool:
        return rank < self.servers

    def worker_index(self, rank: int) -> int:
        return rank - self.servers

    def group_of(self, rank: int) -> int:
        """The worker group of a worker rank (-1 for a server)."""
        if self.is_server(rank):
            return -1
        return self.worker_index(rank) * self.worker_groups // self.workers

    def group_ranks(self, group: int) -> list[int]:
        return [r for r in range(self.servers, self.world_size) if self.group_of(r) == group]

    def describe(self) -> str:
        sizes = [len(self.group_ranks(g)) for g in range(self.worker_groups)]
        return (f"{self.servers} server(s) (ranks 0-{self.servers - 1}), {self.workers} worker(s) in "
                f"{self.worker_groups} group(s) of {sizes}")

    def by_host(self, hosts: list[str]) -> dict[str, dict]:
        """Which ranks, servers, workers and worker groups each host holds (``hosts[rank]`` = the
        rank's host), hosts in the order of their first rank."""
        out: dict[str, dict] = {}
        for rank, host in enumerate(hosts):
            h = out.setdefault(host, {"ranks": [], "servers": [], "workers": [], "groups": []})
            h["ranks"].append(rank)
            if self.is_server(rank):
                h["servers"].append(rank)
            else:
                h["workers"].append(self.worker_index(rank))
                if self.group_of(rank) not in h["groups"]:
                    h["groups"].append(self.group_of(rank))
        return out

    def describe_hosts(self, hosts: list[str]) -> str:
        """One line: each host and the roles on it, e.g. ``2 hosts: a: server 0; b: workers 0-2
        (group 0)``."""
        parts = []
        for host, h in self.by_host(hosts).items():
            roles = []
            if h["servers"]:
                roles.append(f"server{'s' if len(h['servers']) > 1 else ''} {_spans(h['servers'])}")
            if h["workers"]:
                groups = f"group{'s' if len(h['groups']) > 1 else ''} {_spans(h['groups'])}"
                roles.append(f"worker{'s' if len(h['workers']) > 1 else ''} {_spans(h['workers'])} ({groups})")
            parts.append(f"{host}: {', '.join(roles)}")
        return f"{len(parts)} hosts: " + "; ".join(parts)


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)
