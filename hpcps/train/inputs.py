"""Which files a data key names, how each is read, and which worker reads what.

* :func:`data_files`: ``data.train``, ``data.test`` and ``data.predict`` name a file, a list of
  files, a glob (``day_*.gz``) or a directory of part files, as Spark and Hadoop write them. A
  directory's files are taken in name order, less hidden ones and markers (names starting with
  ``.`` or ``_``: ``_SUCCESS``, ``.part-0.crc``), as Hadoop's input formats skip them; so are a
  glob's matches. A glob or directory that matches no file is an error naming the key.
* :func:`compression`: a file compressed with gzip, zstd, bzip2 or xz is told by its first bytes
  (not its name) and read as a stream (:func:`open_stream`; zstd needs the ``zstandard``
  package, the ``zstd`` extra; gzip is read by ISA-L (the ``isal`` dependency) where it is installed, else
  by zlib); zip and lz4 are refused with the command that decompresses them.
* :func:`split`: the pieces each worker reads. With at least as many files as workers, each
  worker reads whole files: worker ``w`` of ``W`` the files ``[w * n // W, (w + 1) * n // W)``
  of the ``n`` in order (as LightGBM's pre-partitioned data and a Spark task per file). With
  fewer files, the files' bytes taken end to end are cut in ``W`` byte ranges at line starts (one
  file: the byte ranges of a single file, as ever); a compressed file cannot be cut, so fewer
  compressed files than workers is an error that says so for training data (a worker without
  rows is one anyway), and gives the last workers nothing of a test or prediction file.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import os
import stat
import threading
from collections import deque
from dataclasses import dataclass


class DataError(ValueError):
    """Bad or missing input data; the message names the file (and line)."""

    exit_status = 2  # the user must change something (see hpcps.errors)


class DataChanged(DataError):
    """A data file changed (its size, modification time or inode) while a job reads it."""


def check_file(path: str, what: str = "data") -> None:
    """Raise :class:`DataError` unless ``path`` is a regular file: say what it is instead (missing,
    a directory, a FIFO...). A FIFO is never opened: that would wait for a writer for ever, and a
    part is read in byte ranges, by several ranks, once an epoch."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if path == "-":
            raise DataError(f"{what} file '-': hpcps reads {what} from a file, not from standard input (it reads "
                            f"a file in byte ranges, on several ranks): save it to a file first") from None
        raise DataError(f"{what} file {path} not found") from None
    except OSError as e:
        raise DataError(f"{what} file {path}: {e.strerror}") from None
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise DataError(f"{what} file {path} is a directory, not a file")
    kind = ("a FIFO (a named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "not a regular file")
    raise DataError(f"{what} file {path} is {kind}, not a regular file: a job reads its data in byte ranges, "
                    f"once an epoch")


def file_state(path: str) -> tuple[int, int, int, int]:
    """(size, modification time in ns, inode, device) of ``path``: what tells that it changed."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def check_unchanged(path: str, then: tuple) -> None:
    """Raise :class:`DataChanged` when ``path`` is no longer the file of :func:`file_state` ``then``
    (one ``stat``: cheap enough for every slice read)."""
    try:
        now = file_state(path)
    except FileNotFoundError:
        how = "removed"
    except OSError as e:
        how = f"unreadable: {e.strerror or e}"
    else:
        if now == then:
            return
        how = (f"{then[0]} bytes when the job started, {now[0]} now" if now[0] != then[0] else
               "replaced by another file" if now[2:] != then[2:] else "rewritten: a new modification time")
    raise DataChanged(f"data file {path} changed while this job read it ({how}); a job reads its training file "
                      f"again each epoch, so it must stay as it was: copy it before changing it")


# -- which files ---------------------------------------------------------------------------------

def hidden(name: str) -> bool:
    """A file a directory of part files holds beside its data: a marker (``_SUCCESS``,
    ``_committed_...``), a checksum or other hidden file (``.part-00000.crc``)."""
    return name.startswith((".", "_"))


def data_files(spec, key: str = "data") -> list[str]:
    """The files ``spec`` names (a path, a glob, a directory, or a list of them), in order: each
    directory's and glob's files by name, hidden ones left out (:func:`hidden`). A path that is
    none of these is kept as it is (loading it says what is wrong). A directory or glob with no
    data file, or an empty list, is a :class:`DataError` naming ``key``."""
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        raise DataError(f"{key} = []: an empty list of data files")
    out: list[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, n) for n in os.listdir(item) if not hidden(n))
            found = [p for p in found if os.path.isfile(p)]
            if not found:
                raise DataError(f"{key} = {item!r}: the directory holds no data file (hidden files and markers "
                                f"such as _SUCCESS are skipped)")
        elif glob.has_magic(item) and not os.path.exists(item):
            found = sorted(p for p in glob.glob(item) if os.path.isfile(p) and not hidden(os.path.basename(p)))
            if not found:
                raise DataError(f"{key} = {item!r}: no data file matches the pattern")
        else:
            found = [item]
        out += found
    return out


def describe(files: list[str]) -> str:
    """How messages name a data set of ``files``: the file, or the first and how many."""
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more file(s)"


# -- compressed files ----------------------------------------------------------------------------

# the first bytes of compressed files, their kind, and the command that decompresses one
COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"), (b"BZh", "bzip2", "bunzip2"),
              (b"\xfd7zXZ\x00", "xz", "unxz"), (b"PK\x03\x04", "zip", "unzip"), (b"\x04\x22\x4d\x18", "lz4", "unlz4"))
STREAMED = ("gzip", "zstd", "bzip2", "xz")  # the kinds read as streams; the others are refused


def compression(path: str, head: bytes | None = None) -> str:
    """The compression of ``path`` told by its first bytes (``head``, read if not given): a kind
    of :data:`STREAMED`, or "" for plain text. A kind hpcps cannot read is a :class:`DataError`
    with the command that decompresses it."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(8)
    for magic, kind, command in COMPRESSED:
        if head.startswith(magic):
            if kind not in STREAMED:
                raise DataError(f"data file {path} is {kind}-compressed: hpcps reads plain text and gzip, zstd, "
                                f"bzip2 or xz streams; decompress it first ({command} {path})")
            return kind
    return ""


def open_stream(path: str, kind: str):
    """``path`` opened for reading its decompressed bytes (a binary file object with ``readinto``)."""
    if kind == "gzip":
        try:  # ISA-L's inflate (the isal dependency) reads gzip 3-4 times as fast as zlib, the same bytes
            from isal import igzip
        except ImportError:
            return gzip.open(path, "rb")
        return igzip.open(path, "rb")
    if kind == "bzip2":
        return bz2.open(path, "rb")
    if kind == "xz":
        return lzma.open(path, "rb")
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"data file {path} is zstd-compressed: reading it needs the zstandard package "
                            f"(pip install 'hpcps[zstd]'), or decompress it first (unzstd {path})") from None
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def inflates_slowly(kind: str) -> bool:
    """Whether reading a ``kind`` stream costs more than parsing its text: bzip2 and xz, and
    gzip through zlib (ISA-L, the ``isal`` dependency, inflates 3-4 times as fast, zstd faster still).
    A part kept in memory inflates such a file once, not twice (see :class:`Tee`)."""
    if kind != "gzip":
        return kind in ("bzip2", "xz")
    try:
        import isal  # noqa: F401
    except ImportError:
        return True
    return False


class Tee:
    """A compressed file's decompressed bytes inflated once for two readers: the first (a part's
    line count) hands each piece it reads to :meth:`put` and ends with :meth:`finish`; the second
    (the first pass's parse) reads them with :meth:`readinto`, waiting for what the first has not
    read yet. Holds what the first has read and the second not, up to the whole text: for a part
    kept in memory anyway (``data.memory_mb = 0``), whose parsed arrays are larger."""

    def __init__(self):
        self.chunks: deque = deque()
        self.at = 0  # bytes of chunks[0] already read
        self.done, self.error = False, None
        self.ready = threading.Condition()

    def put(self, chunk: bytes) -> None:
        with self.ready:
            self.chunks.append(chunk)
            self.ready.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """No more pieces (``error``: the first reader failed; the second raises it)."""
        with self.ready:
            if not self.done:
                self.done, self.error = True, error
            self.ready.notify_all()

    def readinto(self, view) -> int:
        with self.ready:
            while not self.chunks and not self.done:
                self.ready.wait()
            if not self.chunks:
                if self.error is not None:
                    raise self.error
                return 0
            chunk = self.chunks[0]
            n = min(len(view), len(chunk) - self.at)
            view[:n] = chunk[self.at:self.at + n]
            self.at += n
            if self.at == len(chunk):
                self.chunks.popleft()
                self.at = 0
            return n

    def __enter__(self) -> "Tee":
        return self

    def __exit__(self, *exc) -> None:
        with self.ready:  # (the rest is not read: let it go)
            self.chunks.clear()


# -- which worker reads what ---------------------------------------------------------------------

BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of a file, both at line starts; a compressed file is read whole,
    as a stream (``start`` 0, ``end`` the compressed file's size)."""

    path: str
    start: int
    end: int
    compression: str = ""


def line_start(path: str, pos: int, size: int) -> int:
    """The first line start at or after byte ``pos`` of ``path`` (``size`` bytes): ``size`` if
    none. The first line starts after a UTF-8 byte-order mark (which some editors write first):
    a BOM is no label."""
    if pos <= 0:
        with open(path, "rb") as f:
            return len(BOM) if f.read(len(BOM)) == BOM and size >= len(BOM) else 0
    if pos >= size:
        return size
    with open(path, "rb") as f:
        f.seek(pos - 1)
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                return size
            i = chunk.find(b"\n")
            if i >= 0:
                return f.tell() - len(chunk) + i + 1


def split(files: list[str], sizes: list[int], kinds: list[str], workers: int, key: str = "data",
          idle_ok: bool = False) -> list[list[Piece]]:
    """The pieces of ``files`` (of ``sizes`` bytes, compressed as ``kinds`` say) each of
    ``workers`` workers reads, in order (see the module's docstring). ``idle_ok``: a worker may
    read nothing (a test or prediction file, whose rows are gathered): fewer compressed files
    than workers go whole to the first workers, and the others read an empty range."""
    n = len(files)
    if n < workers and idle_ok and any(kinds):
        return split(files, sizes, kinds, n, key) + [[Piece(files[0], 0, 0)] for _ in range(workers - n)]
    if n >= workers:
        whole = [Piece(f, 0 if k else line_start(f, 0, size), size, k) for f, size, k in zip(files, sizes, kinds)]
        return [whole[w * n // workers:(w + 1) * n // workers] for w in range(workers)]
    packed = [(f, k) for f, k in zip(files, kinds) if k]
    if packed:
        raise DataError(f"{key}: {describe(files)}: {len(packed)} {packed[0][1]}-compressed file(s) among {n} for "
                        f"{workers} workers: a compressed file cannot be split, so each worker reads whole files; "
                        f"give at least {workers} files (or decompress them) or use at most {n} worker{'s' if n > 1 else ''}")
    total = sum(sizes)
    cuts = [_cut_at(files, sizes, total * w // workers) for w in range(workers)] + [(n, 0)]
    return [_pieces_between(files, sizes, cuts[w], cuts[w + 1]) for w in range(workers)]


def _cut_at(files: list[str], sizes: list[int], pos: int) -> tuple[int, int]:
    """(file, offset) of the first line start at or after byte ``pos`` of the files end to end."""
    for i, size in enumerate(sizes):
        if pos < size or (pos == 0 and i == len(sizes) - 1):
            at = line_start(files[i], pos, size)
            return (i, at) if at < size else (i + 1, 0)
        pos -= size
    return len(files), 0


def _pieces_between(files: list[str], sizes: list[int], a: tuple[int, int], b: tuple[int, int]) -> list[Piece]:
    """The byte ranges from cut ``a`` to cut ``b`` (see :func:`_cut_at`), one a file."""
    out = []
    for i in range(a[0], min(b[0], len(files) - 1) + 1):
        start = a[1] if i == a[0] and a[1] else line_start(files[i], 0, sizes[i])
        end = b[1] if i == b[0] else sizes[i]
        if end > start or (i == a[0] == b[0] and sizes[i] == 0):
            out.append(Piece(files[i], start, end))
    return out or [Piece(files[min(a[0], len(files) - 1)], 0, 0)]


def part_of(spec, part: int, parts: int, key: str = "data", idle_ok: bool = False) -> list[Piece]:
    """The pieces worker ``part`` of ``parts`` reads of the files ``spec`` names (:func:`split`);
    a file that is missing or not a regular file is a :class:`DataError`."""
    files = data_files(spec, key)
    for f in files:
        check_file(f)
    sizes, kinds = [os.path.getsize(f) for f in files], [compression(f) for f in files]
    return split(files, sizes, kinds, parts, key, idle_ok)[part]
