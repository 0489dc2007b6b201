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


def _count_lines_before(path: str, offset: int) -> int:
    n = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            chunk = f.read(min(BLOCK, left))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


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


def _with_bias(indptr, indices, values):
    return parse.append_feature(indptr, indices, values, BIAS_KEY, np.float32(1.0))


def _parse_part(path: str, start: int, end: int, fmt: str, hash_bits: int, skip_bad: bool, binary: bool):
    """Parse ``path[start:end]`` block by block: each block is read into one reusable buffer after
    the previous block's unfinished line, and parsed in place (no copies of the text)."""
    pieces = []
    skipped = 0
    buf = bytearray(min(BLOCK, end - start) + (1 << 20))
    view = memoryview(buf)
    seen = np.zeros(2, dtype=np.int64)  # binary labels: a 0 / a -1 met in an earlier block
    carry = 0          # bytes of an unfinished line at the front of buf
    block_start = start  # file offset of buf[0]
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end or carry:
            want = min(BLOCK, end - pos)
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
                    out = parse.parse_criteo(block, source=path, first_line=1, skip_bad=skip_bad, bits=hash_bits)
                else:
                    out = parse.parse_libsvm(block, source=path, first_line=1, skip_bad=skip_bad,
                                             binary=binary, seen=seen)
            except parse.ParseError as e:
                line = _count_lines_before(path, block_start) + e.line
                text = str(e).split(": ", 2)[-1] if str(e).count(": ") >= 2 else ""
                raise DataError(f"{path}:{line}: {e.reason}" + (f": {text}" if text else "")) from None
            finally:
                del block
            labels, indptr, indices, values, sk = out
            skipped += sk
            if fmt == "libsvm" and hash_bits < 64 and indices.size:
                indices &= np.uint64(2**hash_bits - 1)
            pieces.append((labels, indptr, indices, values))
            carry = n - cut
            buf[:carry] = buf[cut:n]
            block_start += cut
    if not pieces:
        return (np.zeros(0, np.float32), np.zeros(1, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.float32)), skipped
    if len(pieces) == 1:
        return pieces[0], skipped
    labels = np.concatenate([p[0] for p in pieces])
    offsets = np.cumsum([0] + [p[1][-1] for p in pieces[:-1]])
    indptr = np.concatenate([[0]] + [p[1][1:] + o for p, o in zip(pieces, offsets)]).astype(np.int64)
    indices = np.concatenate([p[2] for p in pieces])
    values = np.concatenate([p[3] for p in pieces])
    return (labels, indptr, indices, values), skipped


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
    indptr, indices, values = _with_bias(indptr, indices, values)
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
