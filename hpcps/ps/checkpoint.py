"""HDF5 checkpoints: the on-disk format, atomic commit, integrity, re-sharding. No MPI here.

A checkpoint is a directory ``<dir>/ckpt-<step, 10 digits>/`` holding:

* ``server-<s>.h5``, one per server, written by that server alone (no rank gathers the model):
  for every table, group ``tables/<name>`` with datasets ``keys`` (uint64) and ``rows`` (float32,
  ``n x width``: parameters then optimizer state, see :mod:`hpcps_kernels.optim`), straight from
  the server's arrays (slot order: no reordering at checkpoint time). A key's virtual shard is a
  function of the key (:mod:`hpcps.ps.placement`), so files need no shard index. Attributes:
  ``format``, ``version``, ``server``, ``servers``, ``num_shards``.
* ``manifest.json``, written last: format version, config fingerprint, step, epoch, clock,
  layout (servers, workers, worker groups, shards), table declarations, the workers' data
  position, and for every server file its size and XXH64 checksum (of the whole file; a
  non-cryptographic hash that detects truncation and damage at memory speed).

It is first written as ``ckpt-<step>.tmp`` and renamed when the manifest is in place, so a
checkpoint directory without ``.tmp`` is complete.

Checkpoints belong to a run: the manifest's ``run_id`` is drawn when a run starts fresh and
inherited by every run resumed from one of its checkpoints (its lineage). A checkpoint directory
holds one lineage (:func:`claim`, before training), and retention (:func:`prune`) only ever
deletes complete checkpoints of the lineage that writes, older than the newest ``keep`` good ones.
Nothing else is deleted: a damaged checkpoint is moved under ``damaged/``, another run's under
``replaced/`` (``checkpoint.existing = "replace"``), and the checkpoints of the lineage past the
one a run resumes from under ``superseded/``. Durability: every server file is fsync'ed by
its writer, the manifest is fsync'ed, and so are the checkpoint directory before the rename and
its parent after it, so a committed checkpoint survives a power loss or node crash, not only a
process crash. The manifest carries its own XXH64 (``manifest_xxh64``, over its canonical JSON),
so a damaged manifest is detected too. Reading verifies every checksum; a checkpoint
that fails is reported and the previous one is used. The newest ``keep`` complete checkpoints
are kept. Restoring with the same layout, each server reads its own file; onto another number
of servers, each server reads every file and keeps the keys of the shards the new placement gives
it (whole shards move; keys never change shard).

Delta snapshots (:mod:`hpcps.ps.deltas`) are directories ``delta-<step>`` of the same form, whose
server files hold only the rows changed since the snapshot before (and the keys removed); the
manifest (``"snapshot": "delta"``) names its base full checkpoint and the deltas before it, each
with its manifest's checksum. Such a chain is restored whole; retention counts full checkpoints
and deletes a delta with its base.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass

import numpy as np

from hpcps.outputs import fsync_path, h5_failure  # (fsync_path: also hpcps.ps.checkpoint's)
from hpcps_kernels.hashing import shard_of, xxh64, xxh64_words

FORMAT = "hpcps-checkpoint"
VERSION = 2            # 2: the manifest carries its own checksum (version 1 is still read)
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_NAME = re.compile(r"^(ckpt|delta)-(\d{10})$")  # a full checkpoint, or a delta snapshot
# where checkpoints that are not deleted go, inside a checkpoint directory
DAMAGED, REPLACED, SUPERSEDED = "damaged", "replaced", "superseded"
UNNAMED_RUN = "unnamed"  # the lineage of checkpoints written before manifests named their run


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged; the message says which and why."""

    exit_status = 1  # (a write that failed: a run-time failure; see hpcps.errors)


def say(line: str) -> None:
    """The default ``report`` of this module's functions: a line on standard output, at once."""
    print(line, flush=True)


def new_run_id() -> str:
    """A fresh run's id (16 hex digits), written in every checkpoint of its lineage."""
    return uuid.uuid4().hex[:16]


def run_of(manifest: dict) -> str:
    """The run (lineage) a manifest belongs to."""
    return manifest.get("run_id") or UNNAMED_RUN


def step_of(ckpt: str) -> int:
    """The step in a checkpoint directory's name."""
    return int(_NAME.match(os.path.basename(os.path.normpath(ckpt)))[2])


def is_delta(ckpt: str) -> bool:
    """Whether a snapshot directory (or its ``.tmp``) is a delta snapshot, by its name."""
    return os.path.basename(os.path.normpath(ckpt)).startswith("delta-")


def _order(name: str) -> tuple:
    """Snapshots in the order they were taken: by step (a full checkpoint before a delta of the
    same step)."""
    m = _NAME.match(name)
    return int(m[2]), m[1] == "delta"


def move_aside(path: str, under: str) -> str:
    """Move ``path`` into the directory ``under`` (made if missing) under a name not taken there
    yet, durably; returns its new path. A rename: nothing is copied and nothing deleted."""
    os.makedirs(under, exist_ok=True)
    name = os.path.basename(os.path.normpath(path))
    target, n = os.path.join(under, name), 1
    while os.path.exists(target):
        n += 1
        target = os.path.join(under, f"{name}.{n}")
    os.replace(path, target)
    fsync_path(under)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    return target


def step_dir(root: str, step: int, kind: str = "ckpt") -> str:
    """``root/ckpt-<step>`` (kind ``"delta"``: ``root/delta-<step>``)."""
    return os.path.join(root, f"{kind}-{step:010d}")


def begin(root: str, step: int, kind: str = "ckpt") -> str:
    """The empty directory ``root/ckpt-<step>.tmp`` (or ``delta-``) that a checkpoint is written
    into (what an interrupted write left under that name is removed: it was never a checkpoint)."""
    tmp = step_dir(root, step, kind) + ".tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def server_file(ckpt: str, server: int) -> str:
    return os.path.join(ckpt, f"server-{server}.h5")


def checksum(path: str) -> str:
    """XXH64 of the whole file (hex), through a memory map."""
    size = os.path.getsize(path)
    if size == 0:
        return f"{int(xxh64(np.zeros(0, np.uint8), 0, 0, np.uint64(0))):016x}"
    populate = getattr(mmap, "MAP_POPULATE", 0)  # fault the mapping in at once, not page by page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ) as mm:
        whole = size // 8 * 8
        words = np.frombuffer(mm, dtype=np.uint64, count=whole // 8)
        tail = np.frombuffer(mm, dtype=np.uint8, offset=whole)
        try:
            return f"{int(xxh64_words(words, tail, np.uint64(0))):016x}"
        finally:
            del words, tail


def warm_checksums() -> None:
    """Load the checksum kernels (from numba's cache) now, so that a process that verifies
    checkpoints later (``hpcps supervise`` after a crash, on the restart's path) does not wait for it then."""
    xxh64_words(np.zeros(0, np.uint64), np.zeros(0, np.uint8), np.uint64(0))
    manifest_digest({})


def write_failure(path: str, e: OSError, who: str) -> CheckpointError:
    """The one-line error of a checkpoint write that failed (a full disk, say: with the room it
    needed and the room there was, where known)."""
    why = os.strerror(e.errno) if e.errno else str(e).splitlines()[0]  # h5py's own text is long
    room = getattr(e, "room", None)
    if room:
        why += f" ({_bytes_text(room[0])} needed, {_bytes_text(room[1])} free)"
    return CheckpointError(f"{who} cannot write {path}: {why}; the checkpoints committed before it are intact")


def _bytes_text(n: int) -> str:
    """``n`` bytes in three significant figures of the unit that fits (a shortfall stays visible)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


_H5_WRITE_FAILED = re.compile(r"file write failed: .*?filename = '([^']+)'.*?errno = (\d+)", re.S)


def explain_write_failure(exc: BaseException) -> tuple[str, str] | None:
    """HDF5 may report a checkpoint file's failed write (a full disk) only when one of the file's
    objects is freed, later and outside the code that wrote it, as a bare RuntimeError that names
    neither the checkpoint nor the cause plainly (seen once in about ten runs of the disk-full
    test). Registered with :data:`hpcps.ps.transport.EXPLAINERS`, this gives it the one line a write
    failure has (:func:`write_failure`)."""
    m = _H5_WRITE_FAILED.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if not m or ".tmp" + os.sep not in m.group(1):
        return None
    server = re.fullmatch(r"server-(\d+)\.h5", os.path.basename(m.group(1)))
    who = f"server {int(server.group(1))}" if server else "this rank"
    e = write_failure(m.group(1), OSError(int(m.group(2)), os.strerror(int(m.group(2)))), who)
    return type(e).__name__, str(e)


def _write_tables(path: str, server: int, servers: int, num_shards: int, tables: list[tuple]) -> None:
    import h5py  # (on first use: a job that writes and reads no checkpoint never loads HDF5)

    with h5py.File(path, "w") as f:
        f.attrs.update(format=FORMAT, version=VERSION, server=server, servers=servers, num_shards=num_shards)
        for name, keys, rows, *state in tables:
            g = f.create_group(f"tables/{name}")
            g.create_dataset("keys", data=np.ascontiguousarray(keys))
            g.create_dataset("rows", data=np.ascontiguousarray(rows))
            for k, v in (state[0] if state else {}).items():
                if isinstance(v, np.ndarray):
                    g.create_dataset(k, data=np.ascontiguousarray(v))
                else:
                    g.attrs[k] = v


def write_server_file(path: str, server: int, servers: int, num_shards: int, tables: list[tuple]) -> tuple[int, str]:
    """Write one server's tables: (name, keys, rows) or (name, keys, rows, state), as they are,
    and fsync the file. ``state``: the table's admission and eviction state (see
    :func:`read_state_for_server`), arrays written beside the rows and integers as attributes.
    Returns (bytes, checksum). Raises OSError (with its errno) when the file cannot be written,
    ENOSPC before writing anything when the disk has not room for the arrays.

    h5py reports a full disk met while closing as a RuntimeError, and its objects of the failed
    file raise again when they are freed; they are freed here, where that is caught, so that the
    failure surfaces once, as the OSError."""
    need = sum(a.nbytes for _, keys, rows, *state in tables for a in (keys, rows, *(
        v for v in (state[0] if state else {}).values() if isinstance(v, np.ndarray))))
    need += (64 << 10) + need // 100  # HDF5's metadata
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if free < need:
        # refused before HDF5 meets the full disk (see below): a clean error, no partial file
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        full.room = (need, free)  # (see write_failure)
        raise full
    failure = None
    try:
        _write_tables(path, server, servers, num_shards, tables)
    except (OSError, RuntimeError) as e:
        failure = h5_failure(e)  # (the failed file's objects freed here)
    if failure:
        raise failure
    fsync_path(path)
    return os.path.getsize(path), checksum(path)


def manifest_digest(manifest: dict) -> str:
    """XXH64 (hex) of the manifest's canonical JSON, without its own ``manifest_xxh64`` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_xxh64"}
    raw = np.frombuffer(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), dtype=np.uint8)
    return f"{int(xxh64(raw, 0, raw.shape[0], np.uint64(0))):016x}"


def commit(tmp_dir: str, manifest: dict, keep: int, report=say) -> str:
    """Write the manifest into ``tmp_dir`` (``.../ckpt-N.tmp``), rename it to ``ckpt-N`` and prune
    the run's older checkpoints beyond ``keep`` (:func:`prune`, for the manifest's ``run_id``).
    A checkpoint already named ``ckpt-N`` is moved under ``superseded/``. Returns the final path."""
    final = tmp_dir[:-4] if tmp_dir.endswith(".tmp") else tmp_dir
    path = os.path.join(tmp_dir, MANIFEST)
    manifest = {**manifest, "manifest_xxh64": manifest_digest(manifest)}
    with open(path + ".part", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    fsync_path(tmp_dir)  # the server files' and the manifest's directory entries
    root = os.path.dirname(os.path.normpath(final)) or "."
    if os.path.exists(final) and _same_run(final, manifest) and _exchange(tmp_dir, final):
        # this run's own checkpoint of this step, written again (a resumed run that trained nothing
        # new but its data changed): the new one took its place in one step; the old one goes
        fsync_path(root)
        shutil.rmtree(tmp_dir, ignore_errors=True)
    else:
        if os.path.exists(final):
            moved = move_aside(final, os.path.join(root, SUPERSEDED))
            report(f"hpcps: checkpoint {final} existed already: moved to {moved}")
        os.replace(tmp_dir, final)
        fsync_path(root)  # the rename itself
    _remember_verified(final, manifest)  # its writers checksummed the files as they are
    prune(root, keep, run_of(manifest), report)
    return final


def _same_run(ckpt: str, manifest: dict) -> bool:
    try:
        return run_of(read_manifest(ckpt)) == run_of(manifest)
    except CheckpointError:
        return False


def _exchange(a: str, b: str) -> bool:
    """Swap two directories atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where
    the system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    found = sorted((n for n in os.listdir(root) if _NAME.match(n)), key=_order)
    return [os.path.join(root, n) for n in found]


def newest_of(root: str, run_id: str) -> str | None:
    """The newest complete checkpoint of the run ``run_id`` in ``root`` (its manifest read, its
    files not verified), or None."""
    for ckpt in reversed(complete_checkpoints(root)):
        try:
            if run_of(read_manifest(ckpt)) == run_id:
                return ckpt
        except CheckpointError:
            continue
    return None


def quarantine(ckpt: str, why: str, report=say) -> str:
    """Move a damaged checkpoint under ``damaged/`` of its directory, saying so; its new path."""
    moved = move_aside(ckpt, os.path.join(os.path.dirname(os.path.normpath(ckpt)), DAMAGED))
    report(f"hpcps: checkpoint {ckpt} is damaged ({why}): moved to {moved}")
    return moved


def prune(root: str, keep: int, run_id: str, report=say) -> list[str]:
    """Retention: of the complete full checkpoints of the run ``run_id`` in ``root``, keep the
    newest ``keep`` that are good and delete the older ones, each with the delta snapshots taken
    over it; returns those deleted. Checkpoints of other runs are never touched. Only when there
    is something to delete are the kept ones verified (:func:`verify`, once per checkpoint as long
    as its files are unchanged): a damaged one is moved under ``damaged/`` and does not count.
    Unfinished writes (``.tmp``) older than the run's newest checkpoint are removed."""
    ours, unreadable, deltas = [], [], {}
    for ckpt in complete_checkpoints(root):
        try:
            m = read_manifest(ckpt)
        except CheckpointError as e:
            unreadable.append((ckpt, str(e)))
            continue
        if run_of(m) == run_id and is_delta(ckpt):
            deltas.setdefault(m["base"]["name"], []).append(ckpt)
        elif run_of(m) == run_id:
            ours.append(ckpt)
    deleted: list[str] = []
    if len(ours) > keep:
        for ckpt, why in unreadable:  # (in a directory a run has claimed: damaged, not another run's)
            quarantine(ckpt, why.split(": ", 1)[-1], report)
        kept = 0
        for ckpt in reversed(ours):
            if kept >= keep:
                for gone in [*deltas.get(os.path.basename(ckpt), []), ckpt]:  # (its deltas first)
                    shutil.rmtree(gone, ignore_errors=True)
                    deleted.append(gone)
                continue
            try:
                verify(ckpt, trust_unchanged=True)
                kept += 1
            except CheckpointError as e:
                quarantine(ckpt, str(e).split(": ", 1)[-1], report)
    if ours:
        newest = _order(os.path.basename(ours[-1]))
        for n in os.listdir(root):
            if n.endswith(".tmp") and _NAME.match(n[:-4]) and _order(n[:-4]) < newest:
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return deleted


_held: dict[str, int] = {}  # checkpoint.dir -> an open descriptor of it, locked for the process's life


def hold(root: str) -> str | None:
    """Lock ``root`` for this process: an exclusive ``flock`` on the directory itself (no file
    added to it), released by the kernel when the process ends however it ends, so a killed job
    leaves no stale lock. Returns why it cannot (another running job holds it), else None. Where
    the file system has no such locks (NFS, some parallel file systems), nothing is locked."""
    if os.path.realpath(root) in _held:
        return None
    os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return (f"checkpoint.dir {root} is in use by another running job (it holds the directory's lock): "
                    f"two jobs writing checkpoints into one directory would replace each other's; wait for "
                    f"it to end or write to another checkpoint.dir")
        return None  # no locks on this file system (ENOLCK, ENOSYS, EOPNOTSUPP, EBADF)
    _held[os.path.realpath(root)] = fd
    return None


def release(root: str) -> None:
    """Unlock ``root`` (:func:`hold`) where this process is done with it before it ends."""
    fd = _held.pop(os.path.realpath(root), None)
    if fd is not None:
        os.close(fd)


def claim(root: str, run_id: str, resumed: str | None, existing: str = "error", report=say) -> str | None:
    """Before a run writes into ``root``: make it hold checkpoints of the run ``run_id`` only.
    Returns why it cannot (None when it can): ``root`` holds checkpoints of another run, and
    ``existing`` is not ``"replace"``, which moves them under ``replaced/<time>/`` instead.
    A resumed run (``resumed``, the checkpoint it resumes from) moves its own lineage's checkpoints
    named past that one under ``superseded/`` (they would be mistaken for its newest), and damaged
    checkpoints (an unreadable manifest) under ``damaged/``; for a fresh run those are another
    run's. The checkpoint resumed from is never moved. Nothing is deleted. ``root`` stays locked
    (:func:`hold`) for this process's life: a second job into it is refused while this one runs."""
    busy = hold(root)
    if busy:
        return busy
    others, later = [], []
    resumed_step = step_of(resumed) if resumed and _NAME.match(os.path.basename(os.path.normpath(resumed))) else None
    for ckpt in complete_checkpoints(root):
        if resumed and os.path.exists(resumed) and os.path.samefile(ckpt, resumed):
            continue
        try:
            lineage = run_of(read_manifest(ckpt))
        except CheckpointError as e:
            if resumed:
                quarantine(ckpt, str(e).split(": ", 1)[-1], report)
            else:
                others.append((ckpt, "damaged"))
            continue
        if lineage != run_id:
            others.append((ckpt, lineage))
        elif resumed_step is not None and step_of(ckpt) > resumed_step:
            later.append(ckpt)
    if others and existing != "replace":
        runs = sorted({r for _, r in others if r != "damaged"})
        damaged = sum(r == "damaged" for _, r in others)
        what = (f"run {', '.join(runs)}" if runs else "") + (" and " if runs and damaged else "") + (
            f"{damaged} damaged" if damaged else "")
        ways = ("" if resumed else "continue that run with --resume auto, ") + (
            "write to another checkpoint.dir, or set checkpoint.existing = \"replace\" to move them aside (to "
            f"{os.path.join(root, REPLACED)}/); nothing was deleted")
        return (f"checkpoint.dir {root} holds {len(others)} checkpoint(s) of another run ({what}; newest "
                f"{os.path.basename(others[-1][0])})" + (f" besides the one resumed ({resumed})" if resumed else "")
                + f": {ways}")
    if others:
        where = os.path.join(root, REPLACED, time.strftime("%Y%m%dT%H%M%S"))
        for ckpt, _ in others:
            move_aside(ckpt, where)
        report(f"hpcps train: moved {len(others)} checkpoint(s) of another run from {root} to {where} "
               f"(checkpoint.existing = \"replace\")")
    for ckpt in later:
        moved = move_aside(ckpt, os.path.join(root, SUPERSEDED))
        report(f"hpcps train: {ckpt} is past the checkpoint resumed from ({resumed}): moved to {moved}")
    return None


def read_manifest(ckpt: str) -> dict:
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{ckpt}: no such checkpoint directory" if not os.path.exists(ckpt)
                              else f"{ckpt}: not a checkpoint (a file; a checkpoint is a directory ckpt-<step>)")
    if not os.path.exists(path):
        raise CheckpointError(f"{ckpt}: no {MANIFEST} (incomplete checkpoint)")
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable manifest: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{ckpt}: not a {FORMAT} checkpoint of version {' or '.join(map(str, READABLE_VERSIONS))}")
    if m["version"] >= 2 and m.get("manifest_xxh64") != manifest_digest(m):
        raise CheckpointError(f"{ckpt}: {MANIFEST} fails its XXH64 checksum (damaged)")
    return m


# checkpoint path -> its files' (name, size, mtime, inode) when they last verified
_verified: dict[str, tuple] = {}
VERIFIED_ENV = "HPCPS_VERIFIED_CHECKPOINTS"  # set by `hpcps supervise` for the job it restarts: verified_under's


def _signature(ckpt: str, manifest: dict) -> tuple:
    sig = []
    for name in [MANIFEST, *(e["name"] for e in manifest.get("files", []))]:
        st = os.stat(os.path.join(ckpt, name))
        sig.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


def _remember_verified(ckpt: str, manifest: dict) -> None:
    try:
        _verified[os.path.abspath(ckpt)] = _signature(ckpt, manifest)
    except OSError:
        pass


# the most :func:`verified_under` hands over in one environment variable (Linux refuses a variable
# over 128 KiB at exec: the restart would not start); past it nothing is handed over (the job hashes)
VERIFIED_MAX_BYTES = 96 * 1024


def verified_under(root: str, ckpt: str = "", manifest: dict | None = None) -> str:
    """What this process verified under the checkpoint directory ``root``, as JSON: each
    snapshot's files' (name, size, mtime, inode) when they verified; with ``ckpt``, only that
    snapshot and the chain it is taken over (what a restart from it reads). ``hpcps supervise``
    hands it to the job it restarts (:data:`VERIFIED_ENV`), whose :func:`trust_verified` takes it:
    the snapshot the supervisor found good is not hashed again on the restart's path. '' where
    that would be over :data:`VERIFIED_MAX_BYTES` (thousands of servers' files). ``manifest``:
    ``ckpt``'s, where the caller has read it (else it is read here, for a delta's chain)."""
    under = os.path.join(os.path.abspath(root), "")
    wanted = None
    if ckpt:
        wanted = {os.path.abspath(ckpt)}
        try:
            if is_delta(ckpt):
                wanted |= {os.path.abspath(p) for p, _ in chain_links(ckpt, manifest or read_manifest(ckpt))}
        except (CheckpointError, OSError, ValueError, KeyError):
            pass  # (its chain unreadable now: only the snapshot itself is handed over)
    text = json.dumps({p: sig for p, sig in _verified.items()
                       if p.startswith(under) and os.path.isdir(p) and (wanted is None or p in wanted)})
    return text if len(text) <= VERIFIED_MAX_BYTES else ""


def trust_verified(text: str) -> bool:
    """Take another process's :func:`verified_under` as verified here (``verify(...,
    trust_unchanged=True)`` then hashes only the files changed since); returns whether there was
    any. Text that is not such JSON is ignored: the files are hashed."""
    try:
        given = {p: tuple(tuple(f) for f in sig) for p, sig in json.loads(text).items()} if text else {}
    except (ValueError, TypeError, AttributeError):
        return False
    _verified.update(given)
    return bool(given)


def verify(ckpt: str, trust_unchanged: bool = False) -> dict:
    """The manifest, after checking its own checksum and every server file's size and XXH64.
    ``trust_unchanged``: skip the files' checksums when this process has verified (or written)
    them and none of them has changed since (size, modification time, inode)."""
    m = read_manifest(ckpt)
    if trust_unchanged:
        try:
            if _verified.get(os.path.abspath(ckpt)) == _signature(ckpt, m):
                return m
        except (OSError, KeyError, TypeError):
            pass
    for entry in m["files"]:
        path = os.path.join(ckpt, entry["name"])
        if not os.path.exists(path):
            raise CheckpointError(f"{ckpt}: {entry['name']} is missing")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{ckpt}: {entry['name']} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if checksum(path) != entry["xxh64"]:
            raise CheckpointError(f"{ckpt}: {entry['name']} fails its XXH64 checksum (damaged)")
    _remember_verified(ckpt, m)
    return m


def newest_good(root: str, report=say, move_damaged: bool = False,
                trust_unchanged: bool = False) -> tuple[str, dict] | None:
    """The newest checkpoint under ``root`` that verifies; damaged ones are reported and skipped,
    and with ``move_damaged`` moved under ``damaged/`` (:func:`quarantine`). A delta snapshot
    counts with its chain (:func:`good_part_of_chain`): its base and the deltas before it.
    ``trust_unchanged``: :func:`verify`'s, for the newest ones too (a job restarted by ``hpcps
    supervise``, which verified them: :func:`trust_verified`)."""
    bad_bases: set[str] = set()
    for ckpt in reversed(complete_checkpoints(root)):
        if move_damaged and not os.path.isdir(ckpt):
            continue  # (a damaged base already moved under damaged/ by a newer delta's chain, and said)
        try:
            m = verify(ckpt, trust_unchanged)
        except CheckpointError as e:
            moved = quarantine(ckpt, "", lambda line: None) if move_damaged else ""
            report(f"hpcps: checkpoint skipped: {e}" + (f"; moved to {moved}" if moved else ""))
            continue
        if not is_delta(ckpt):
            return ckpt, m
        if m["base"]["name"] not in bad_bases:
            found = good_part_of_chain(ckpt, m, report, move_damaged)
            if found:
                return found
            bad_bases.add(m["base"]["name"])
    return None


def chain_links(ckpt: str, manifest: dict) -> list[tuple[str, str]]:
    """(path, manifest checksum) of the snapshots a delta is taken over, its base first: the
    base full checkpoint, then the deltas before it in order."""
    root = os.path.dirname(os.path.normpath(ckpt))
    return [(os.path.join(root, e["name"]), e["manifest_xxh64"]) for e in [manifest["base"], *manifest["deltas_before"]]]


def good_part_of_chain(ckpt: str, manifest: dict, report=say, move_damaged: bool = False) -> tuple[str, dict] | None:
    """The newest snapshot of a delta's chain (itself verified) that can be restored: itself when
    its base and every delta before it verify and are the snapshots it was taken over; else the
    one before the first damaged delta (which is reported in one line and, with ``move_damaged``,
    moved under ``damaged/``); None when the base is missing or damaged."""
    last, path, why = first_broken_link(ckpt, manifest)
    if not why:
        return ckpt, manifest
    moved = quarantine(path, "", lambda line: None) if move_damaged and os.path.isdir(path) else ""
    then = f"resuming from {last[0]}, the last good one" if last else "its deltas cannot be used"
    report(f"hpcps: delta chain of {ckpt} broken: {why}" + (f" (moved to {moved})" if moved else "") + f"; {then}")
    return last


def first_broken_link(ckpt: str, manifest: dict) -> tuple[tuple[str, dict] | None, str, str]:
    """A delta's chain walked from its base: (the last link that verifies before the first that
    does not, or None; that link's path; why it cannot be used), or (the last link, "", "") when
    every link verifies and is the snapshot ``ckpt`` was taken over."""
    last = None
    for path, digest in chain_links(ckpt, manifest):
        try:
            m = verify(path, trust_unchanged=True)
            if m.get("manifest_xxh64") != digest:
                raise CheckpointError(f"{path}: not the snapshot {os.path.basename(ckpt)} was taken over (its manifest differs)")
        except CheckpointError as e:
            return last, path, str(e)
        last = (path, m)
    return last, "", ""


def _read(path: str, table: str) -> tuple[np.ndarray, np.ndarray]:
    import h5py  # (on first use: a job that writes and reads no checkpoint never loads HDF5)

    with h5py.File(path, "r") as f:
        g = f[f"tables/{table}"]
        keys = np.empty(g["keys"].shape, dtype=np.uint64)
        rows = np.empty(g["rows"].shape, dtype=np.float32)
        if keys.size:
            g["keys"].read_direct(keys)
            g["rows"].read_direct(rows)
    return keys, rows


def read_shards(ckpt: str, manifest: dict, table: str, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of ``table`` in the virtual shards ``wanted`` (bool mask over shards), from
    every server file of the checkpoint (whatever server count wrote it)."""
    keys, rows = [], []
    for entry in manifest["files"]:
        k, r = _read(os.path.join(ckpt, entry["name"]), table)
        if not wanted.all():
            keep = wanted[shard_of(k, wanted.shape[0])]
            k, r = k[keep], r[keep]
        keys.append(k)
        rows.append(r)
    width = next(t["width"] for t in manifest["tables"] if t["name"] == table)
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros((0, width), dtype=np.float32)
    return (keys[0], rows[0]) if len(keys) == 1 else (np.concatenate(keys), np.concatenate(rows))


def read_for_server(ckpt: str, manifest: dict, table: str, server: int, shard_server: np.ndarray,
                    num_servers: int):
    """(keys, rows) a server owns under the placement ``shard_server`` of ``num_servers`` servers:
    its own file when the checkpoint was written with the same layout, else the matching shards of
    every file (a server that owns no shard gets none)."""
    layout = manifest["layout"]
    if layout["servers"] == num_servers and layout["num_shards"] == shard_server.shape[0]:
        return _read(server_file(ckpt, server), table)
    return read_shards(ckpt, manifest, table, shard_server == server)


def read_state_for_server(ckpt: str, manifest: dict, table: str, server: int, shard_server: np.ndarray,
                          num_servers: int) -> dict:
    """The admission and eviction state of ``table`` that a server owns, resharded like its rows
    (:func:`read_for_server`): ``last`` (each row's last update, in the order of the rows read),
    ``pending_keys`` / ``pending_counts`` (push counts of keys without a row, exact per key), and
    ``count_buckets`` / ``count_values`` (counters shared by hash: every file's, summed, when the
    layout changed). The counters ``admitted`` and ``evicted`` come back only with the same layout.
    Empty for a checkpoint written without them."""
    import h5py  # (on first use, as in _write_tables)
    same = (manifest["layout"]["servers"] == num_servers and manifest["layout"]["num_shards"] == shard_server.shape[0])
    paths = [server_file(ckpt, server)] if same else [os.path.join(ckpt, e["name"]) for e in manifest["files"]]
    wanted = shard_server == server
    parts: dict[str, list] = {}
    attrs: dict = {}
    for path in paths:
        with h5py.File(path, "r") as f:
            g = f[f"tables/{table}"]
            if same:
                attrs = {k: int(v) for k, v in g.attrs.items()}
            if "last" in g:
                last = g["last"][()]
                if not same:
                    last = last[wanted[shard_of(g["keys"][()], wanted.shape[0])]]
                parts.setdefault("last", []).append(last)
            if "pending_keys" in g:
                pk, pc = g["pending_keys"][()], g["pending_counts"][()]
                if not same:
                    keep = wanted[shard_of(pk, wanted.shape[0])]
                    pk, pc = pk[keep], pc[keep]
                parts.setdefault("pending_keys", []).append(pk)
                parts.setdefault("pending_counts", []).append(pc)
            if "count_buckets" in g:
                parts.setdefault("count_buckets", []).append(g["count_buckets"][()])
                parts.setdefault("count_values", []).append(g["count_values"][()])
    return {**{k: np.concatenate(v) for k, v in parts.items()}, **attrs}


@dataclass
class Summary:
    path: str
    manifest: dict
    ok: bool
    problem: str
    keys: dict
    bytes: int


def inspect(ckpt: str) -> Summary:
    """What a checkpoint holds and whether it is intact."""
    import h5py  # (on first use, as in _write_tables)
    try:
        m = verify(ckpt)
        ok, problem = True, ""
    except CheckpointError as e:
        ok, problem = False, str(e)
        try:
            m = read_manifest(ckpt)
        except CheckpointError:
            return Summary(ckpt, {}, False, problem, {}, 0)
    keys: dict = {}
    total = 0
    for entry in m.get("files", []):
        path = os.path.join(ckpt, entry["name"])
        total += entry["bytes"]
        if not os.path.exists(path):
            continue
        try:
            with h5py.File(path, "r") as f:
                for name in f["tables"]:
                    keys[name] = keys.get(name, 0) + f[f"tables/{name}/keys"].shape[0]
        except Exception:  # a damaged file may fail in any way inside HDF5; the checksum said so
            pass
    return Summary(ckpt, m, ok, problem, keys, total)
