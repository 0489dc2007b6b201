"""``hpcps bench checkpoint``: checkpoint write and read throughput and the time to resume, beside a
plain file copy of the same bytes on the same disk, measured in the same run (no MPI: one server's
file, written and read through the same code the servers use).

For each size: an FTRL table of N keys (rows of 3 float32: weight, z, n) is written as a server
file (HDF5 + XXH64 checksum of the file), verified, read back and indexed (what a server does
to resume with the same layout). The reference is ``shutil.copyfile`` of the file just written
(copy throughput = bytes / time); writes and copies alternate, ``repeat`` times, and the medians
are compared, so both see the same page-cache and disk conditions.

The delta row: the same table as a server holds it (an FTRL :class:`~hpcps.ps.server_table.ServerTable`
tracking its changes), ``DELTA_SHARE`` of its rows changed; the pause training sees (the changed rows
copied, :func:`hpcps.ps.deltas.changed_part`) and the delta file's write (on the server's thread),
medians of ``repeat``.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

from hpcps.ps import checkpoint, deltas
from hpcps.ps.placement import Placement
from hpcps.ps.server_table import ServerTable
from hpcps.ps.tables import TableSpec
from hpcps_kernels.hashtable import KeyIndex


DELTA_SHARE = 0.01  # of the rows changed between two delta snapshots


def measure_delta(keys: np.ndarray, rows: np.ndarray, directory: str, shards: int, repeat: int) -> dict:
    """A delta snapshot of ``DELTA_SHARE`` of the table's rows: the copy (training's pause) and
    the write, medians of ``repeat``."""
    table = ServerTable(TableSpec("w", optimizer="ftrl"))
    table.load(keys, rows)
    table.store.track_changes()
    rng = np.random.default_rng(1)
    path = checkpoint.server_file(directory, 1)
    copies, writes, size = [], [], 0
    for _ in range(repeat):
        table.store.mark_changed(rng.choice(keys.shape[0], max(1, int(keys.shape[0] * DELTA_SHARE)), replace=False))
        t = time.perf_counter()
        part = deltas.changed_part(table)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        size, _ = checkpoint.write_server_file(path, 1, 1, shards, [part])
        writes.append(time.perf_counter() - t)
        os.remove(path)
    return {"delta_bytes": size, "delta_copy_s": float(np.median(copies)), "delta_write_s": float(np.median(writes))}


def measure(n: int, directory: str, shards: int = 1024, repeat: int = 3) -> dict:
    if n > 1000:
        measure(1000, directory, shards, 1)  # warm up h5py, the kernels and the disk path first
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 2**64, n, dtype=np.uint64)
    rows = rng.random((n, 3), dtype=np.float32)
    ckpt = os.path.join(directory, f"bench-{n}")
    shutil.rmtree(ckpt, ignore_errors=True)
    os.makedirs(ckpt)
    path = checkpoint.server_file(ckpt, 0)
    writes, copies = [], []
    for _ in range(repeat):  # alternate, so both see the same page-cache and disk conditions
        if os.path.exists(path):
            os.remove(path)
        t = time.perf_counter()
        size, digest = checkpoint.write_server_file(path, 0, 1, shards, [("w", keys, rows)])
        writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        shutil.copyfile(path, path + ".copy")
        copies.append(time.perf_counter() - t)
        os.remove(path + ".copy")
    t_write, t_copy = float(np.median(writes)), float(np.median(copies))
    delta = measure_delta(keys, rows, ckpt, shards, repeat)
    del keys, rows
    manifest = {"files": [{"name": os.path.basename(path), "bytes": size, "xxh64": digest}],
                "tables": [{"name": "w", "width": 3}], "layout": {"servers": 1, "num_shards": shards}}
    t = time.perf_counter()
    ok = checkpoint.checksum(path) == digest
    t_verify = time.perf_counter() - t
    t = time.perf_counter()
    k, r = checkpoint.read_for_server(ckpt, manifest, "w", 0, Placement(1, shards).shard_server, 1)
    t_read = time.perf_counter() - t
    t = time.perf_counter()
    KeyIndex.from_keys(k)
    t_index = time.perf_counter() - t
    shutil.rmtree(ckpt, ignore_errors=True)
    copy = size / t_copy / 1e9
    return {"keys": n, "bytes": size, "ok": ok, "write_gb_s": size / t_write / 1e9, "copy_gb_s": copy,
            "write_vs_copy": size / t_write / 1e9 / copy, "read_gb_s": size / t_read / 1e9,
            "read_vs_copy": size / t_read / 1e9 / copy, "verify_s": t_verify, "resume_s": t_verify + t_read + t_index,
            "write_s": t_write, **delta}


def format_rows(rows: list[dict]) -> str:
    out = [f"{'keys':>11} {'MB':>8} {'write GB/s':>10} {'read GB/s':>9} {'copy GB/s':>9} {'write/copy':>10} "
           f"{'read/copy':>9} {'resume s':>8}"]
    for r in rows:
        out.append(f"{r['keys']:>11,} {r['bytes'] / 1e6:>8.0f} {r['write_gb_s']:>10.2f} {r['read_gb_s']:>9.2f} "
                   f"{r['copy_gb_s']:>9.2f} {r['write_vs_copy']:>10.0%} {r['read_vs_copy']:>9.0%} {r['resume_s']:>8.1f}")
    out.append("write = HDF5 + checksum of the file; resume = verify the checksum + read + build the key index")
    out.append(f"delta snapshots ({DELTA_SHARE:.0%} of the rows changed):")
    out.append(f"{'keys':>11} {'MB':>8} {'pause s':>10} {'write s':>9} {'full write s':>12} {'delta/full':>10}")
    for r in rows:
        out.append(f"{r['keys']:>11,} {r['delta_bytes'] / 1e6:>8.1f} {r['delta_copy_s']:>10.4f} {r['delta_write_s']:>9.3f} "
                   f"{r['write_s']:>12.3f} {(r['delta_copy_s'] + r['delta_write_s']) / r['write_s']:>10.1%}")
    out.append("pause = the changed rows copied (training waits); write = the delta file, on the server's thread")
    return "\n".join(out)
