"""The files hpcps writes for its users: never one of its inputs, whole or not at all, and JSON
that every parser reads. Pure: no MPI.

* :func:`clash`: whether an output is an input (or another output) by the same file, not the same
  string: the device and inode when both exist (hard links and symlinks are the same file), else
  the resolved path. Every command runs it before it writes or trains anything.
* :func:`replacing`: a file is written to a temporary file beside it, flushed to the disk and
  renamed over it; on any failure the temporary file is removed and the old file is left as it was.
* :class:`Appender`: a JSON-lines file (``train.metrics``) appended to by whole lines only.
* :func:`dumps`: JSON with ``null`` where a number is NaN or infinite.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import re
import shutil
import stat
import time
import traceback
from contextlib import contextmanager

import numpy as np

_CKPT = re.compile(r"^(ckpt|delta)-\d+(\.tmp)?$")  # a checkpoint, or a delta snapshot


class OutputError(Exception):
    """An output that cannot be written, in one line. ``exit_status``: 2 when the user must choose
    another path (it is an input, a directory), 1 when the write failed (a full disk)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.exit_status = status


def _stat(path: str):
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same file: the same device and inode when both exist,
    else the same resolved path (symlinks followed)."""
    sa, sb = _stat(a), _stat(b)
    if sa is not None and sb is not None:
        return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    return os.path.realpath(a) == os.path.realpath(b)


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` lies below ``directory`` (resolved paths)."""
    d = os.path.realpath(directory).rstrip(os.sep) + os.sep
    return os.path.realpath(path).startswith(d)


# where a checkpoint.dir's checkpoints are moved aside (hpcps.ps.checkpoint's DAMAGED, REPLACED and
# SUPERSEDED; named here, below it in the layers)
CHECKPOINT_ASIDE = ("damaged", "replaced", "superseded")


def _in_checkpoint(path: str, root: str, aside: bool = False) -> str | None:
    """The ``ckpt-*`` (or ``delta-*``) directory under ``root`` that is or holds ``path``, if one does (``aside``:
    or the directory checkpoints are moved aside to, :data:`CHECKPOINT_ASIDE`)."""
    if not inside(path, root):
        return None
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    first = rel.split(os.sep, 1)[0]
    return os.path.join(root, first) if _CKPT.match(first) or (aside and first in CHECKPOINT_ASIDE) else None


def _named(what: str, path: str) -> str:
    """``train.model_out = 'm.h5'``, ``--out 'm.h5'``, ``the config file 'run.toml'``."""
    return f"{what} = {path!r}" if re.match(r"^[a-z_]+\.[a-z_]+$", what) else f"{what} {path!r}"


def clash(outputs: list[tuple[str, str]], inputs: list[tuple[str, str]],
          checkpoint_dirs: list[tuple[str, str]] = ()) -> str | None:
    """The first clash, in one line naming both paths and what each is, or None.

    ``outputs`` and ``inputs`` are ``(what, path)`` pairs (an empty path is skipped). A clash is
    an output that is an input or another output (:func:`same_file`), or that lies inside an
    input directory (a checkpoint being read). ``checkpoint_dirs`` are output directories whose
    old ``ckpt-*`` directories are deleted by retention: one must not be an input or output file,
    and no input or output may lie inside one of its checkpoints."""
    outputs = [(w, p) for w, p in outputs if p]
    inputs = [(w, p) for w, p in inputs if p]
    checkpoint_dirs = [(w, p) for w, p in checkpoint_dirs if p]
    for what, path in outputs:
        for in_what, in_path in inputs:
            if same_file(path, in_path):
                return (f"{_named(what, path)} is the same file as {_named(in_what, in_path)}: an output "
                        f"would overwrite an input; give {what} another path")
            if os.path.isdir(in_path) and inside(path, in_path):
                return (f"{_named(what, path)} lies inside {_named(in_what, in_path)}, which is being read; "
                        f"give {what} another path")
    for i, (what, path) in enumerate(outputs):
        for other_what, other in outputs[i + 1:]:
            if same_file(path, other):
                return (f"{_named(what, path)} and {_named(other_what, other)} are the same file: give "
                        f"each output its own path")
    for what, root in checkpoint_dirs:
        for other_what, other in inputs + outputs:
            if same_file(root, other) and not os.path.isdir(other):
                return (f"{_named(what, root)} is the same path as {_named(other_what, other)}: give "
                        f"{what} a directory of its own")
            ckpt = _in_checkpoint(other, root)
            if ckpt is not None and not same_file(ckpt, other):  # (the checkpoint resumed is read first)
                return (f"{_named(other_what, other)} lies inside the checkpoint {ckpt} of "
                        f"{_named(what, root)}, where retention deletes old checkpoints; move it out of {ckpt}")
        for other_what, other in outputs:  # (a checkpoint's own path: written, or moved aside, later)
            ckpt = _in_checkpoint(other, root, aside=True)
            if ckpt is not None:
                return (f"{_named(other_what, other)} is {'' if same_file(ckpt, other) else 'inside '}{ckpt}, "
                        f"where {_named(what, root)} writes its checkpoints or moves them aside; give "
                        f"{other_what} a path outside {ckpt}")
    return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def _free(path: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return None


def _errno(e: BaseException) -> int | None:
    """The errno of an OSError, or the one h5py writes into a RuntimeError's text."""
    code = getattr(e, "errno", None)
    if isinstance(code, int):
        return code
    m = re.search(r"errno = (\d+)", str(e))
    return int(m.group(1)) if m else None


def _why(path: str, e: BaseException, need: int = 0) -> str:
    """Why a write of ``path`` failed (an OSError, or h5py's RuntimeError that carries the errno in
    its text): the system's reason, and on a full disk how much it needed and had."""
    code = _errno(e)
    why = os.strerror(code) if code else (str(e).splitlines()[0] if str(e) else type(e).__name__)
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = _free(path)
        have = f"{_size(free)} free" if free is not None else "the disk's free space unknown"
        why += f" (needed about {_size(need)}, {have})" if need else f" ({have})"
    return why


# a write refused for its path (no such directory, no permission, a read-only disk): the user must
# give another one (exit status 2); any other failure (a full disk, an I/O error) is the run's (1)
PATH_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG)


def write_failure(path: str, e: BaseException, need: int = 0, kept: bool = False) -> OutputError:
    """The one-line error of a failed write of ``path`` (see :func:`_why`); ``kept``: a file was
    there before, and still is."""
    after = f"the previous {path} is untouched" if kept else "nothing was written there"
    return OutputError(f"cannot write {path}: {_why(path, e, need)}; {after}", 2 if _errno(e) in PATH_ERRNOS else 1)


def fsync_path(path: str) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@contextmanager
def replacing(path: str, need: int = 0):
    """Write ``path`` whole or not at all: yields a temporary path beside it (``PATH.<pid>.tmp``,
    in the same directory, so that the rename is atomic) to write; when the block ends the file
    is flushed to the disk and renamed over ``path`` (a symlink at ``path`` keeps pointing at the
    new file). On any failure (a full disk, an exception, Ctrl-C) the temporary file is removed,
    ``path`` is left as it was, and an OSError (or h5py's RuntimeError of a failed write) becomes
    an :class:`OutputError` naming ``path``. ``need``: about the bytes the file takes; a disk with
    less free is refused before anything is written. A path that exists and is not a regular file
    (a FIFO, ``/dev/stdout``) is written in place: it cannot be replaced."""
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path} is a directory, not a file", 2)
    if st is not None and not stat.S_ISREG(st.st_mode):
        try:
            yield path
        except OSError as e:
            raise write_failure(path, e) from None
        return
    target = os.path.realpath(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    free = _free(target) if need else None
    if free is not None and free < need:
        raise write_failure(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), need, st is not None)
    try:
        yield tmp
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))  # the file it replaces kept its mode
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(os.path.dirname(target))
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, OutputError):
            raise write_failure(path, e, need, st is not None) from None
        raise


@contextmanager
def making(directory: str):
    """Create ``directory`` (and its missing parents) for what the block writes there; if the
    block fails (a full disk), remove what it added: the directories it created, or in one that
    was there the entries that were not, so that a failed command leaves the disk as it was."""
    created, d = [], os.path.abspath(directory)
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    before = set(os.listdir(directory)) if not created else set()
    os.makedirs(directory, exist_ok=True)
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        else:
            for name in set(os.listdir(directory)) - before:
                path = os.path.join(directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    _remove(path)
        raise


def h5_failure(e: BaseException) -> OSError:
    """h5py's failed write (an OSError, or a RuntimeError met while closing, with the errno in its
    text) as an OSError with that errno, after freeing the failed file's objects (held by the
    exception's frames), which would raise again, later and out of place, when freed."""
    code = _errno(e) or errno.EIO
    failure = OSError(code, os.strerror(code))
    for _ in range(3):
        try:
            traceback.clear_frames(e.__traceback__)
            gc.collect()
            break
        except RuntimeError:
            continue
    return failure


def write_h5(path: str, fill, need: int = 0) -> None:
    """``path`` replaced by a new HDF5 file (:func:`replacing`) that ``fill(h5py.File)`` writes;
    h5py's failure, wherever it surfaces, becomes the OutputError naming ``path``."""
    import h5py

    with replacing(path, need) as tmp:
        failure = None
        try:
            with h5py.File(tmp, "w") as f:
                fill(f)
        except (OSError, RuntimeError) as e:
            failure = h5_failure(e)  # (the failed file's objects freed here)
        if failure:
            raise failure


def write_text(path: str, text: str) -> None:
    """``path`` replaced by ``text`` (:func:`replacing`)."""
    with replacing(path, len(text)) as tmp, open(tmp, "w") as f:
        f.write(text)


def finite(obj):
    """``obj`` (dicts, lists, numbers) with every NaN or infinite number as None, and NumPy
    scalars as Python's, so that it is valid JSON."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _kept(line: bytes, keep) -> bool:
    """Whether ``keep`` takes the JSON record ``line`` (a line that is no JSON object is kept)."""
    try:
        record = json.loads(line)
    except ValueError:
        return True
    return not isinstance(record, dict) or bool(keep(record))


def dumps(obj, **kw) -> str:
    """JSON text of ``obj`` with ``null`` for NaN and infinities (never the non-standard ``NaN``)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def write_json(path: str, obj, **kw) -> None:
    """``path`` replaced by ``obj`` as JSON (:func:`dumps`, :func:`replacing`)."""
    write_text(path, dumps(obj, **kw) + "\n")


class Appender:
    """A JSON-lines file that a run appends records to, whole lines only.

    Records are buffered and written together (:meth:`flush`, at the latest every ``flush_bytes``
    or ``flush_s`` seconds) with one ``write`` on an ``O_APPEND`` descriptor; when a write fails part-way (a full disk) the
    file is cut back to its length before it, so that it ends with the last whole record, and the
    failure is raised as an :class:`OutputError`.

    ``fresh``: the file is a new run's: an empty file replaces it at once (renamed over it, so
    that a reader sees the old file or the new one), as TensorBoard's or Lightning's logs start
    each run anew. Otherwise (a resumed run) the records are appended to what is there, less
    what ``keep(record)`` refuses (the records an interrupted run wrote past the point it is
    resumed from: TensorBoard's ``purge_step``) and less an unfinished last line (a run killed
    in the middle of one); the file is rewritten (:func:`replacing`) only when that drops
    something. ``dropped``: the records (and unfinished lines) dropped."""

    def __init__(self, path: str, flush_bytes: int = 1 << 16, flush_s: float = 1.0, fresh: bool = False,
                 keep=None):
        self.path, self.flush_bytes, self.flush_s = path, flush_bytes, flush_s
        self.flushed = time.monotonic()
        self.dropped = 0
        st = _stat(path)
        regular = st is None or stat.S_ISREG(st.st_mode)
        try:
            if fresh and regular:
                with replacing(path) as tmp:
                    open(tmp, "wb").close()
            elif regular and st is not None:
                self._keep_only(keep)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise write_failure(path, e) from None
        self.pending: list[str] = []
        self.bytes = 0

    def _keep_only(self, keep) -> None:
        """Drop the records ``keep`` refuses and an unfinished last line (see the class)."""
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a line end
        kept = [ln for ln in lines if keep is None or _kept(ln, keep)]
        self.dropped = len(lines) - len(kept) + (1 if tail else 0)
        if self.dropped:
            data = b"".join(ln + b"\n" for ln in kept)
            with replacing(self.path, len(data)) as tmp, open(tmp, "wb") as f:
                f.write(data)

    def write(self, record: dict) -> None:
        line = dumps(record) + "\n"
        self.pending.append(line)
        self.bytes += len(line)
        if self.bytes >= self.flush_bytes or time.monotonic() - self.flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data = "".join(self.pending).encode()
        self.pending, self.bytes, self.flushed = [], 0, time.monotonic()
        start = os.fstat(self.fd).st_size
        done = 0
        try:
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise OutputError(f"cannot append to {self.path}: {_why(self.path, e, len(data))}; it ends with "
                              f"the last whole record written before", 1) from None

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self.fd)
            self.fd = -1
