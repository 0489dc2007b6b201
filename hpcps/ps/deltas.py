"""Delta snapshots: only the rows changed since the snapshot before, written while training goes on.
No MPI here (the server and the first worker call it; the on-disk form is :mod:`hpcps.ps.checkpoint`'s).

A full checkpoint written with deltas to follow holds the file :data:`TRACK`: from it on, each
server marks the rows a push changes and remembers the keys evicted (:meth:`RowStore.track_changes
<hpcps.ps.store.RowStore.track_changes>`). A delta snapshot ``delta-<step>`` is taken at the same
consistent point as a full checkpoint (the same request, the same position in the manifest):

* each server copies its changed rows (with their optimizer state, and their last update where
  rows age), the keys removed since, and its admission counts whole, then replies at once, and
  writes its file on a thread (:class:`DeltaWriter`); a file ``server-<s>.h5.written`` beside it
  says its size and checksum, or why it could not be written;
* the first worker's :class:`Commits` waits for those on a thread of its own, writes the manifest
  (its base full checkpoint and the deltas before it, each with its manifest's checksum) and
  renames the directory (:func:`hpcps.ps.checkpoint.commit`). A write that failed is reported in
  one line, nothing is committed, and the next snapshot is a full one.

The next snapshot waits for the previous write (on the servers and on the first worker).
:func:`restore` reads a chain: the base's rows, then each delta's in order (a key in a delta
replaces its row, a removed key goes), sharded for the current placement like a full checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np

from hpcps.ps import checkpoint
from hpcps.ps.server_table import ServerTable, count_non_finite_rows
from hpcps_kernels.hashing import shard_of
from hpcps_kernels.hashtable import KeyIndex

TRACK = "deltas-follow"  # in a full checkpoint: delta snapshots are taken over it
WRITTEN = ".written"     # beside a delta's server file: its size and checksum, or its error


def begin(root: str, step: int, kind: str, track: bool) -> str:
    """The directory a snapshot is written into (:func:`hpcps.ps.checkpoint.begin`), marked
    :data:`TRACK` when deltas follow it."""
    tmp = checkpoint.begin(root, step, kind)
    if track:
        open(os.path.join(tmp, TRACK), "w").close()
    return tmp


def tracked(ckpt: str) -> bool:
    """Whether the servers track changes from this snapshot on (a delta, or a full checkpoint
    with deltas to follow)."""
    return checkpoint.is_delta(ckpt) or os.path.exists(os.path.join(ckpt, TRACK))


def track_changes(tables: list[ServerTable]) -> None:
    for table in tables:
        table.store.track_changes()


# -- the server's side ------------------------------------------------------------------------


def changed_part(table: ServerTable) -> tuple:
    """(name, keys, rows, state) of the rows of ``table`` changed since the last snapshot (copies):
    ``state`` holds the keys removed since, each changed row's last update (rows that age) and the
    admission counts and counters whole."""
    keys, rows, slots, removed = table.store.take_changes()
    state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in table.state_arrays().items() if k != "last"}
    if table.last is not None:
        state["last"] = table.last[slots]
    return table.spec.name, keys, rows, {**state, "removed": removed}


class DeltaWriter:
    """A server's delta snapshots: the changed rows copied when asked (:meth:`take`), their file
    written on a thread; one write at a time (:meth:`wait`)."""

    def __init__(self, server: int, servers: int, num_shards: int):
        self.server, self.servers, self.num_shards = server, servers, num_shards
        self.thread: threading.Thread | None = None
        self.narrow = lambda part: part  # what of a table's changes this server writes (replicas: its primaries')

    def wait(self) -> None:
        """Until the previous delta's file is written."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def snapshot(self, path: str, clock: int, tables: list[ServerTable], placement, write_full) -> tuple[int, str]:
        """The snapshot of ``clock`` into ``path``: a delta (:meth:`take`; its size and checksum
        come later, beside its file: (0, "") now), or a full one, ``write_full(path, tables,
        server, placement, clock)``, once the delta before it is written; changes are tracked
        from a full one marked :data:`TRACK` on. Returns (bytes, checksum) of the file."""
        if checkpoint.is_delta(path):
            self.take(path, tables)
            return 0, ""
        self.wait()
        written = write_full(path, tables, self.server, placement, clock)
        if tracked(path):
            track_changes(tables)
        return written

    def take(self, path: str, tables: list[ServerTable]) -> None:
        """Copy the rows changed since the last snapshot now, and write them into ``path`` (the
        delta's directory) on a thread."""
        self.wait()
        parts = [self.narrow(changed_part(t)) for t in tables]
        self.thread = threading.Thread(target=self._write, args=(path, parts), name="delta write", daemon=True)
        self.thread.start()

    def _write(self, ckpt: str, parts: list[tuple]) -> None:
        path = checkpoint.server_file(ckpt, self.server)
        try:
            bad = sum(count_non_finite_rows(rows) for _, _, rows, _ in parts)
            if bad:
                raise ValueError(f"{bad:,} changed rows hold NaN or infinite numbers")
            size, digest = checkpoint.write_server_file(path, self.server, self.servers, self.num_shards, parts)
            result = {"bytes": size, "xxh64": digest}
        except OSError as e:
            result = {"error": str(checkpoint.write_failure(path, e, f"server {self.server}"))}
        except (ValueError, RuntimeError) as e:
            result = {"error": f"server {self.server} cannot write {path}: {e}"}
        try:
            with open(path + WRITTEN + ".part", "w") as f:
                json.dump(result, f)
            os.replace(path + WRITTEN + ".part", path + WRITTEN)
        except OSError:
            pass  # (the first worker times out waiting, and says so)


# -- the first worker's side ------------------------------------------------------------------


class Commits:
    """The first worker's delta commits, on a thread: :meth:`start` one when its servers have
    copied their rows, :meth:`wait` for it before the next snapshot. :attr:`last` is the newest
    delta committed (path, manifest checksum) and :attr:`done_at` when (``time.monotonic()``);
    :attr:`failed` says why the newest one was not."""

    def __init__(self, report=checkpoint.say):
        self.report = report
        self.thread: threading.Thread | None = None
        self.last: tuple[str, str] | None = None
        self.done_at: float | None = None
        self.failed = ""

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def start(self, tmp: str, manifest: dict, servers: list[int], keep: int, timeout: float,
              lost=lambda: ()) -> str:
        """Commit the delta in ``tmp`` once the files of ``servers`` (those asked: after a server
        was lost under replicas, the survivors) are written; returns the path it will have.
        ``lost()``: the servers lost so far (under ULFM), whose files are not waited for: a
        server lost before it wrote its file fails the delta at once, not after ``timeout``."""
        self.wait()
        self.last, self.done_at, self.failed = None, None, ""
        self.thread = threading.Thread(target=self._commit, args=(tmp, manifest, servers, keep, timeout, lost),
                                       name="delta commit", daemon=True)
        self.thread.start()
        return tmp[:-4]

    def _commit(self, tmp: str, manifest: dict, servers: list[int], keep: int, timeout: float, lost) -> None:
        files, deadline = [], time.monotonic() + timeout
        for server in servers:
            path = checkpoint.server_file(tmp, server)
            result = _wait_for(path + WRITTEN, deadline, lambda: server in lost())
            if result is None:
                return self._fail(tmp, f"server {server} was lost before it wrote {path}")
            if "error" in result:
                return self._fail(tmp, result["error"])
            files.append({"name": os.path.basename(path), "bytes": result["bytes"], "xxh64": result["xxh64"]})
            os.remove(path + WRITTEN)
        try:
            final = checkpoint.commit(tmp, {**manifest, "files": files}, keep, self.report)
            done_at = time.monotonic()
            self.last, self.done_at = (final, checkpoint.read_manifest(final)["manifest_xxh64"]), done_at
        except (OSError, checkpoint.CheckpointError) as e:
            return self._fail(tmp, str(checkpoint.write_failure(os.path.join(tmp, checkpoint.MANIFEST), e, "the first worker")
                                       if isinstance(e, OSError) else e))
        self.report(f"hpcps train: delta snapshot {final} ({manifest.get('reason', '')})")

    def _fail(self, tmp: str, why: str) -> None:
        self.failed = why
        shutil.rmtree(tmp, ignore_errors=True)
        self.report(f"hpcps train: delta snapshot {tmp[:-4]} not written: {why}; the next snapshot is a full one")


def _wait_for(path: str, deadline: float, gone) -> dict | None:
    """The JSON file ``path`` once it is there (polled, sleeping), an error past ``deadline``, or
    None once ``gone()`` (its writer was lost)."""
    pause = 0.002
    while not os.path.exists(path):
        if gone():
            return None
        if time.monotonic() > deadline:
            return {"error": f"{path} not written in time (a server stopped?)"}
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    with open(path) as f:
        return json.load(f)


# -- restore ----------------------------------------------------------------------------------


def _removed_for_server(path: str, table: str, wanted: np.ndarray | None) -> np.ndarray:
    import h5py  # (on first use, as in checkpoint.py)

    with h5py.File(path, "r") as f:
        g = f[f"tables/{table}"]
        removed = g["removed"][()] if "removed" in g else np.zeros(0, dtype=np.uint64)
    if wanted is not None and not wanted.all():
        removed = removed[wanted[shard_of(removed, wanted.shape[0])]]
    return removed


def delta_slots(keys: np.ndarray, dkeys: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """For each of ``keys``: its position in ``dkeys`` (a delta's keys, unique), ``len(dkeys)`` or
    more if it is only among ``removed``, or -1. Through a hash index of the delta's keys (the
    smaller side), not a sort of both as ``np.isin`` would (a 10 M-key table's restore spent most
    of its time sorting the table's keys for each delta)."""
    if not keys.shape[0] or not (dkeys.shape[0] + removed.shape[0]):
        return np.full(keys.shape[0], -1, dtype=np.int64)
    index = KeyIndex(dkeys.shape[0] + removed.shape[0])
    # dkeys take slots 0.. in order; a removed key that is also a delta key keeps its delta slot
    index.lookup_or_insert(np.concatenate([dkeys, removed]).astype(np.uint64, copy=False))
    return index.lookup(keys.astype(np.uint64, copy=False))


def apply_delta(keys: np.ndarray, rows: np.ndarray, last: np.ndarray | None, delta: tuple) -> tuple:
    """(keys, rows, last) after a delta's (keys, rows, last, removed): its keys' rows replace
    theirs (in place: ``rows`` and ``last`` may be changed), its new keys are appended, its
    removed keys go. The same keys and rows as a rebuild, in another order (a table's order
    means nothing: the store indexes what it loads), without copying the whole table when no key
    goes and none comes."""
    dkeys, drows, dlast, removed = delta
    n = dkeys.shape[0]
    at = delta_slots(keys, dkeys, removed)
    both = last is not None and dlast is not None
    hit = np.flatnonzero((at >= 0) & (at < n))
    rows[hit] = drows[at[hit]]
    if both:
        last[hit] = dlast[at[hit]]
    new = np.ones(n, dtype=bool)
    new[at[hit]] = False
    gone = at >= n
    if gone.any():
        keys, rows = keys[~gone], rows[~gone]
        last = last[~gone] if both else last
    if new.any():
        keys, rows = np.concatenate([keys, dkeys[new]]), np.concatenate([rows, drows[new]])
        last = np.concatenate([last, dlast[new]]) if both else last
    return keys, rows, last


def chain_of(ckpt: str, manifest: dict) -> list[tuple[str, dict]]:
    """(path, manifest) of the snapshots a restore of ``ckpt`` reads, in order: itself for a full
    checkpoint; for a delta, its base, the deltas before it, and itself."""
    links = checkpoint.chain_links(ckpt, manifest) if checkpoint.is_delta(ckpt) else []
    return [*((p, checkpoint.read_manifest(p)) for p, _ in links), (ckpt, manifest)]


def changed_since(keys: np.ndarray, rows: np.ndarray, old_keys: np.ndarray, old_rows: np.ndarray) -> tuple:
    """(keys, rows) of a table that are new or differ from its rows ``old_keys``/``old_rows`` (an
    earlier snapshot), and the keys it had then and has no more."""
    order = np.argsort(old_keys, kind="stable")
    old_keys, old_rows = old_keys[order], old_rows[order]
    at = np.minimum(np.searchsorted(old_keys, keys), max(old_keys.shape[0] - 1, 0))
    had = (old_keys[at] == keys) if old_keys.shape[0] else np.zeros(keys.shape[0], dtype=bool)
    same = had.copy()
    same[had] = (old_rows[at[had]].view(np.uint32) == rows[had].view(np.uint32)).all(axis=1)  # (bit for bit)
    removed = old_keys[~np.isin(old_keys, keys)]
    return keys[~same], rows[~same], removed


def read_table(ckpt: str, manifest: dict, table: str) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of every shard of ``table`` in the snapshot ``ckpt`` (a delta: over its chain)."""
    chain = chain_of(ckpt, manifest)
    every = np.ones(manifest["layout"]["num_shards"], dtype=bool)
    keys, rows = checkpoint.read_shards(*chain[0], table, every)
    for path, m in chain[1:]:
        removed = [_removed_for_server(os.path.join(path, e["name"]), table, None) for e in m["files"]]
        dkeys, drows = checkpoint.read_shards(path, m, table, every)
        keys, rows, _ = apply_delta(keys, rows, None, (dkeys, drows, None, np.concatenate(removed)))
    return keys, rows


def _delta_for_server(path: str, manifest: dict, table: str, server: int, shard_server: np.ndarray,
                      num_servers: int) -> tuple:
    """(keys, rows, state, removed) of ``table`` in the delta snapshot ``path`` that server
    ``server`` owns under the placement ``shard_server`` (resharded like a full checkpoint)."""
    where = (server, shard_server, num_servers)
    same = manifest["layout"]["servers"] == num_servers and manifest["layout"]["num_shards"] == shard_server.shape[0]
    files = ([checkpoint.server_file(path, server)] if same
             else [os.path.join(path, e["name"]) for e in manifest["files"]])
    removed = (np.concatenate([_removed_for_server(f, table, None if same else shard_server == server) for f in files])
               if files else np.zeros(0, dtype=np.uint64))
    dkeys, drows = checkpoint.read_for_server(path, manifest, table, *where)
    return dkeys, drows, checkpoint.read_state_for_server(path, manifest, table, *where), removed


def put_delta(table: ServerTable, last: np.ndarray | None, delta: tuple, clock: int) -> np.ndarray | None:
    """A delta's (keys, rows, last, removed) put into ``table`` in place: its keys' rows replace
    theirs, its new keys get rows after the others, its removed keys go; returns ``last`` (each
    row's last update, by slot) updated alike. A lookup per key of the delta in the table's
    index, built once for the chain: the same keys, rows and order as :func:`apply_delta`."""
    dkeys, drows, dlast, removed = delta
    first_new = table.store.size
    slots = table.store.put_rows(dkeys, drows)
    if table.store.size > first_new:
        table.policies.rows_created(table.store.size - first_new, first_new)
    both = last is not None and dlast is not None
    if both:
        last = np.concatenate([last, np.zeros(table.store.size - last.shape[0], dtype=last.dtype)])
        last[slots] = dlast
    removed = removed[~np.isin(removed, dkeys)] if removed.shape[0] else removed
    gone = table.store.lookup(np.ascontiguousarray(removed, dtype=np.uint64)) if removed.shape[0] else removed
    gone = gone[gone >= 0]
    if gone.shape[0]:  # (evicted keys: the others' rows kept in their order, reindexed)
        keys, rows = table.items()
        kept = np.ones(keys.shape[0], dtype=bool)
        kept[gone] = False
        table.load(keys[kept], rows[kept], clock, own=True)  # (the masks' copies: the table's to keep)
        last = last[kept] if both else last
    return last


def restore(tables: list[ServerTable], ckpt: str, manifest: dict, server: int, shard_server: np.ndarray,
            num_servers: int) -> None:
    """Load server ``server``'s shards of every table (under the placement ``shard_server`` of
    ``num_servers`` servers) from the snapshot ``ckpt``: a full checkpoint, or a delta read over
    its chain (the base's rows loaded and indexed once, each delta's put in place:
    :func:`put_delta`); then track changes when deltas follow it."""
    chain = chain_of(ckpt, manifest)
    where = (server, shard_server, num_servers)
    clock = manifest["clock"]
    for table in tables:
        name = table.spec.name
        keys, rows = checkpoint.read_for_server(chain[0][0], chain[0][1], name, *where)
        state = checkpoint.read_state_for_server(chain[0][0], chain[0][1], name, *where)
        table.load(keys, rows, clock, own=True)  # (read for it alone)
        del keys, rows
        for path, m in chain[1:]:
            dkeys, drows, dstate, removed = _delta_for_server(path, m, name, *where)
            last = put_delta(table, state.get("last"), (dkeys, drows, dstate.get("last"), removed), clock)
            state = {**dstate, **({"last": last} if last is not None else {})}
        table.restore_state(state)
        table.policies.resumed_at(clock)
    if tracked(ckpt):
        track_changes(tables)
