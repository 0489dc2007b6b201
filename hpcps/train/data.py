"""Data for training: each worker reads only its own byte range of a file, parsed into CSR.

* :func:`byte_range`: part ``i`` of ``n`` of a file, cut at line starts (a line belongs to the part
  in which it starts), so no rank reads the whole file.
* :func:`load_part`: read and parse one part (libsvm or Criteo TSV), with a binary cache of the
  parsed arrays (``.npy`` files, memory-mapped on later epochs and runs; keyed by the file's path,
  size and modification time, the part and the parse settings).
* A malformed line raises :class:`~hpcps_kernels.parse.ParseError` naming the file and the line's
  number in the file (the newlines before the part are counted only then, on the error path).
* Every row gets the bias feature ``BIAS_KEY`` with value 1.
* :class:`Dataset`: the CSR arrays and batches of rows, in file order.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass

import numpy as np

from hpcps_kernels import parse

# feature_key(0xB1A5, "bias"), written out so that importing this module compiles nothing
BIAS_KEY = np.uint64(871999724124195170)
BLOCK = 1 << 30  # a worker's part is parsed in blocks of at most this many bytes (one, usually)


class DataError(ValueError):
    """Bad or missing input data; the message names the file (and line)."""


def detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    with open(path, "rb") as f:
        head = f.read(4096)
    return "criteo" if b"\t" in head.split(b"\n", 1)[0] else "libsvm"


def byte_range(path: str, part: int, parts: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of part ``part`` of ``parts``, both at line starts."""
    size = os.path.getsize(path)

    def line_start(pos: int) -> int:
        if pos <= 0:
            return 0
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
    return line_start(size * part // parts), line_start(size * (part + 1) // parts)


def fingerprint(path: str, span: int = 1 << 20) -> dict:
    """What identifies a data file's contents cheaply: its size and the XXH64 of its first and
    last ``span`` bytes (recorded in checkpoints, compared when resuming)."""
    from hpcps_kernels.hashing import xxh64

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(span)
        f.seek(max(0, size - span))
        tail = f.read(span)
    raw = np.frombuffer(head + tail, dtype=np.uint8)
    return {"path": os.path.abspath(path), "bytes": size,
            "head_tail_xxh64": f"{int(xxh64(raw, 0, raw.shape[0], np.uint64(0))):016x}"}


def _count_newlines(path: str, start: int, end: int) -> tuple[int, bytes]:
    """(newlines in ``path[start:end]``, its last byte), read in small pieces: this must not hold
    the part in memory."""
    n, last = 0, b""
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(4 << 20, left))
            if not chunk:
                break
            n += chunk.count(b"\n")
            last = chunk[-1:]
            left -= len(chunk)
    return n, last


@dataclass
class Dataset:
    labels: np.ndarray      # float32 (rows,)
    indptr: np.ndarray      # int64 (rows + 1,)
    indices: np.ndarray     # uint64 (nnz,)
    values: np.ndarray      # float32 (nnz,)
    skipped: int = 0
    source: str = ""

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    def batch(self, lo: int, hi: int) -> "Dataset":
        """Rows ``[lo, hi)`` (views, indptr rebased)."""
        lo, hi = min(lo, self.rows), min(hi, self.rows)
        a, b = self.indptr[lo], self.indptr[hi]
        return Dataset(self.labels[lo:hi], self.indptr[lo:hi + 1] - a, self.indices[a:b], self.values[a:b])

    def check_finite(self) -> None:
        if not np.isfinite(self.labels).all():
            raise DataError(f"{self.source}: a label is NaN or infinite")


def _parse_blocks(path: str, start: int, end: int, fmt: str, hash_bits: int, skip_bad: bool, binary: bool,
                  block_bytes: int = 0):
    """Parse ``path[start:end]`` block by block: each block is read into one reusable buffer after
    the previous block's unfinished line, and parsed in place (no copies of the text). Yields
    ``(labels, indptr, indices, values, skipped)`` per block (new arrays: the buffer is reused)."""
    block_bytes = block_bytes or BLOCK
    buf = bytearray(min(block_bytes, end - start) + (1 << 16))
    view = memoryview(buf)
    seen = np.zeros(2, dtype=np.int64)  # binary labels: a 0 / a -1 met in an earlier block
    carry = 0          # bytes of an unfinished line at the front of buf
    block_start = start  # file offset of buf[0]
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end or carry:
            want = min(block_bytes, end - pos)
            if len(buf) < carry + want:  # a line longer than the spare room: grow
                del view
                buf = buf + bytearray(carry + want - len(buf))
                view = memoryview(buf)
            got = f.readinto(view[carry:carry + want]) if want > 0 else 0
            pos += got
            n = carry + got
            cut = n if pos >= end else buf.rfind(b"\n", 0, n) + 1
            if cut == 0:  # no line end yet: read more
                carry = n
                continue
            block = np.frombuffer(view[:cut], dtype=np.uint8)
            try:
                if fmt == "criteo":
                    out = parse.parse_criteo(block, source=path, first_line=1, skip_bad=skip_bad, bits=hash_bits,
                                             bias=int(BIAS_KEY))
                else:
                    out = parse.parse_libsvm(block, source=path, first_line=1, skip_bad=skip_bad,
                                             binary=binary, seen=seen, bias=int(BIAS_KEY), bits=hash_bits)
            except parse.ParseError as e:
                line = _count_newlines(path, 0, block_start)[0] + e.line
                text = str(e).split(": ", 2)[-1] if str(e).count(": ") >= 2 else ""
                raise DataError(f"{path}:{line}: {e.reason}" + (f": {text}" if text else "")) from None
            finally:
                del block
            carry = n - cut
            buf[:carry] = buf[cut:n]
            block_start += cut
            yield out


def _concat(pieces: list) -> tuple:
    """One CSR part from consecutive (labels, indptr, indices, values) pieces."""
    if not pieces:
        return np.zeros(0, np.float32), np.zeros(1, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.float32)
    if len(pieces) == 1:
        return tuple(pieces[0][:4])
    labels = np.concatenate([p[0] for p in pieces])
    offsets = np.cumsum([0] + [p[1][-1] - p[1][0] for p in pieces[:-1]])
    indptr = np.concatenate([[0]] + [p[1][1:] - p[1][0] + o for p, o in zip(pieces, offsets)]).astype(np.int64)
    indices = np.concatenate([p[2] for p in pieces])
    values = np.concatenate([p[3] for p in pieces])
    return labels, indptr, indices, values


def _parse_part(path: str, start: int, end: int, fmt: str, hash_bits: int, skip_bad: bool, binary: bool):
    """The whole of ``path[start:end]``, parsed: ((labels, indptr, indices, values), skipped)."""
    pieces = list(_parse_blocks(path, start, end, fmt, hash_bits, skip_bad, binary))
    return _concat(pieces), sum(p[4] for p in pieces)


def load_part(path: str, part: int, parts: int, fmt: str = "auto", hash_bits: int = 24,
              skip_bad: bool = False, cache_dir: str = "", binary: bool = False) -> Dataset:
    """Parse this worker's part of ``path`` (with the bias feature), through the cache if set.

    ``binary``: the labels are for the logistic loss; libsvm labels -1/+1 become 0/1, and any
    label other than 0, 1, -1, +1 is an error naming the line (Criteo labels are 0/1 anyway).
    """
    if not os.path.isfile(path):
        raise DataError(f"data file {path} not found")
    fmt = detect_format(path, fmt)
    start, end = byte_range(path, part, parts)
    cache = None
    if cache_dir:
        st = os.stat(path)
        tag = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{part}/{parts}|{fmt}|{hash_bits}|{skip_bad}|{binary}"
        cache = os.path.join(cache_dir, hashlib.sha256(tag.encode()).hexdigest()[:20])
        if os.path.exists(os.path.join(cache, "done")):
            arrays = [np.load(os.path.join(cache, f"{n}.npy"), mmap_mode="r") for n in ("labels", "indptr", "indices", "values")]
            skipped = int(open(os.path.join(cache, "done")).read() or 0)
            return Dataset(*arrays, skipped=skipped, source=path)
    (labels, indptr, indices, values), skipped = _parse_part(path, start, end, fmt, hash_bits, skip_bad, binary)
    ds = Dataset(labels, indptr, indices, values, skipped, path)
    ds.check_finite()
    if cache:
        tmp = cache + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        for n in ("labels", "indptr", "indices", "values"):
            np.save(os.path.join(tmp, f"{n}.npy"), getattr(ds, n))
        with open(os.path.join(tmp, "done"), "w") as f:
            f.write(str(skipped))
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race: use theirs
            pass
    return ds


def rows_bound(path: str, start: int, end: int) -> int:
    """At most how many rows ``path[start:end]`` holds (its lines; blank, comment and skipped
    lines make it an upper bound)."""
    n, last = _count_newlines(path, start, end)
    return n + (1 if last not in (b"", b"\n") else 0)


class PartStream:
    """A worker's part of a training file, read as consecutive batches while it trains.

    Blocks of the part are parsed in a background thread (the parse kernels release the GIL)
    while the current block trains, so parsing overlaps training instead of preceding it. The
    first block is parsed at :meth:`open`, where its errors are reported like any loading error;
    a bad line further on stops the job from the reader, naming the file and line.

    ``memory_mb`` = 0 keeps every parsed block for the next epochs (the part must fit in memory,
    as parsed arrays). ``memory_mb`` > 0 never holds more parsed rows than that: blocks of about a
    tenth of the budget, one parsed ahead; each epoch reads and parses the part again.
    """

    def __init__(self, path: str, part: int, parts: int, fmt: str = "auto", hash_bits: int = 24,
                 skip_bad: bool = False, binary: bool = False, memory_mb: float = 0.0, block_bytes: int = 0):
        if not os.path.isfile(path):
            raise DataError(f"data file {path} not found")
        self.path, self.fmt = path, detect_format(path, fmt)
        self.hash_bits, self.skip_bad, self.binary = hash_bits, skip_bad, binary
        self.start, self.end = byte_range(path, part, parts)
        self.rows_bound = rows_bound(path, self.start, self.end)
        self.keep = memory_mb <= 0
        # a parsed byte of text takes up to about 3 bytes in arrays (Criteo: 40 keys of 8 bytes, values
        # of 4, per line of ~250 characters) plus the text buffer: ten blocks fit the budget
        self.block_bytes = block_bytes or (32 << 20 if self.keep else max(1 << 16, int(memory_mb * (1 << 20)) // 10))
        self.kept: list[Dataset] | None = None
        self.skipped = 0          # lines skipped so far (all of them after a whole pass)
        self._first: Dataset | None = None
        self._blocks = None
        self._reader: threading.Thread | None = None

    def _dataset(self, out) -> Dataset:
        labels, indptr, indices, values, sk = out
        ds = Dataset(labels, indptr, indices, values, sk, self.path)
        ds.check_finite()
        return ds

    def _generator(self):
        return _parse_blocks(self.path, self.start, self.end, self.fmt, self.hash_bits, self.skip_bad,
                             self.binary, self.block_bytes)

    def open(self) -> "PartStream":
        """Parse the first block now (raises DataError for a bad line in it)."""
        self._blocks = self._generator()
        try:
            self._first = self._dataset(next(self._blocks))
        except StopIteration:
            self._first = None
        return self

    def _epoch_blocks(self):
        """The parsed blocks of one pass, the next one parsed in a background thread. The reader
        keeps the blocks for later passes itself (``memory_mb`` = 0), so a pass whose last rows
        the training did not ask for is complete all the same."""
        if self._reader is not None:
            self._reader.join()  # the previous pass's reader: done once all its rows were taken
        if self.kept is not None:
            yield from self.kept
            return
        first, blocks = self._first, self._blocks if self._blocks is not None else self._generator()
        self._first, self._blocks = None, None
        ahead: queue.Queue = queue.Queue(maxsize=1)

        def read():
            keep = [] if self.keep else None
            skipped = first.skipped if first is not None else 0
            try:
                for out in blocks:
                    ds = self._dataset(out)
                    skipped += ds.skipped
                    if keep is not None:
                        keep.append(ds)
                    ahead.put(("block", ds))
                self.skipped = skipped
                if keep is not None:
                    self.kept = ([first] if first is not None else []) + keep
                ahead.put(("end", None))
            except BaseException as e:  # handed to the training thread, which raises it
                ahead.put(("error", e))

        self._reader = threading.Thread(target=read, name=f"reader of {os.path.basename(self.path)}", daemon=True)
        self._reader.start()
        if first is not None:
            yield first
        while True:
            kind, item = ahead.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item

    def batches(self, batch_size: int, skip: int = 0):
        """One pass over the part as batches of ``batch_size`` consecutive rows (the last may be
        shorter; then empty batches for ever), after skipping the first ``skip`` batches."""
        pending: list[Dataset] = []   # the rows not yet batched, in order
        have = 0
        to_skip = skip * batch_size
        for block in self._epoch_blocks():
            if to_skip:
                cut = min(to_skip, block.rows)
                to_skip -= cut
                block = block.batch(cut, block.rows)
            pending.append(block)
            have += block.rows
            while have >= batch_size:
                b, pending, have = _take(pending, batch_size, have)
                yield b
        if have:
            b, pending, have = _take(pending, have, have)
            yield b
        empty = Dataset(*_concat([]))
        while True:
            yield empty


def _take(pending: list, n: int, have: int):
    """The first ``n`` rows of the blocks in ``pending`` as one batch (a view when they lie in one
    block, a copy when they straddle two), and what is left."""
    first = pending[0]
    if first.rows >= n:
        rest = [first.batch(n, first.rows)] if first.rows > n else []
        return first.batch(0, n), rest + pending[1:], have - n
    pieces, got, i = [], 0, 0
    while got < n:
        p = pending[i]
        take = min(p.rows, n - got)
        b = p.batch(0, take)
        pieces.append((b.labels, b.indptr, b.indices, b.values))
        got += take
        i += 1
    last = pending[i - 1]
    used = take
    rest = ([last.batch(used, last.rows)] if used < last.rows else []) + pending[i:]
    return Dataset(*_concat(pieces)), rest, have - n


class LoadedPart:
    """A part loaded whole (:func:`load_part`) behind the interface of :class:`PartStream`."""

    def __init__(self, ds: Dataset):
        self.ds = ds
        self.rows_bound = ds.rows
        self.skipped = ds.skipped

    def batches(self, batch_size: int, skip: int = 0):
        lo = skip * batch_size
        while True:
            yield self.ds.batch(lo, lo + batch_size)
            lo += batch_size
