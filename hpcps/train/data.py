"""Data for training: each worker reads only its own byte range of a file, parsed into CSR.

* :func:`byte_range`: part ``i`` of ``n`` of a file, cut at line starts (a line belongs to the part
  in which it starts), so no rank reads the whole file.
* :func:`load_part`: read and parse one part (libsvm or Criteo TSV), with a binary cache of the
  parsed arrays (``.npy`` files, memory-mapped on later epochs and runs; keyed by the file's path,
  size, modification time, inode and status-change time, the part and the parse settings; a cache
  that cannot be read or written is a warning, never the job's end).
* A malformed line raises :class:`~hpcps_kernels.parse.ParseError` naming the file and the line's
  number in the file (the newlines before the part are counted only then, on the error path).
* Every row gets the bias feature ``BIAS_KEY`` with value 1.
* :class:`Dataset`: the CSR arrays and batches of rows, in file order.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import sys
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from hpcps.train import inputs, tables
from hpcps.train.inputs import BOM, DataChanged, DataError, Piece, check_file, check_unchanged, file_state
from hpcps_kernels import parse
from hpcps_kernels.tuning import PARSE_AHEAD_BYTES, PARSE_BLOCK_BYTES, STREAM_BLOCK_BYTES

# feature_key(0xB1A5, "bias"), written out so that importing this module compiles nothing
BIAS_KEY = np.uint64(871999724124195170)


def _short_read(path: str, at: int, end: int) -> DataChanged:
    """The error of a read that met the end of ``path`` at byte ``at``, before ``end``: the file
    shrank since its byte ranges were cut."""
    try:
        size = f"{os.path.getsize(path)} bytes now"
    except OSError:
        size = "removed"
    return DataChanged(f"data file {path} changed while this job read it (it ends before byte {end}: {size}); "
                       f"a job reads its training file again each epoch, so it must stay as it was: copy it "
                       f"before changing it")


# formats whose keys are hash values (XXH64 of a token, masked to data.hash_bits, with a field's
# bits above them when asked): uniform in their low bits
HASHED_FORMATS = ("criteo", "vw")


def check_text(path: str, head: bytes) -> None:
    """Raise :class:`DataError` when ``head`` (a file's first bytes) opens a compressed file
    hpcps cannot read as a stream (:func:`hpcps.train.inputs.compression`)."""
    inputs.compression(path, head)


def detect_format(spec, fmt: str, key: str = "data") -> str:
    """``fmt``, or with ``"auto"`` the format of the files ``spec`` names (a path, a glob, a
    directory or a list: :func:`hpcps.train.inputs.data_files`) from their first file's first
    line; a Parquet file by its magic bytes, a CSV file by its ``.csv`` name (``key``: the
    configuration key an error names). Raises DataError for what is not a regular file (see
    :func:`check_file`) and for a compressed file hpcps cannot read (:func:`check_text`); a gzip,
    zstd, bzip2 or xz file is read through its decompressed first bytes.

    A first line with a ``|`` is VW; with a tab, Criteo TSV, unless its fields are ``index:value``
    pairs (libsvm or libffm with tabs between the fields, which their parsers take)."""
    path = inputs.data_files(spec, key)[0]
    check_file(path)
    with open(path, "rb") as f:
        head = f.read(4096)
    if fmt in tables.FORMATS or (fmt == "auto" and head.startswith(tables.PARQUET_MAGIC)):
        return "parquet" if fmt == "auto" else fmt
    kind = inputs.compression(path, head)
    if fmt != "auto":
        return fmt
    if kind:
        with inputs.open_stream(path, kind) as f:
            head = f.read(4096)
    first = head.split(b"\n", 1)[0]
    name = path.rsplit(".", 1)[0] if kind and path.endswith((".gz", ".zst", ".bz2", ".xz")) else path
    if name.endswith(".csv") and not kind:
        return "csv"
    if b"|" in first or name.endswith(".vw"):
        return "vw"
    tokens = first.split()
    pairs = len(tokens) > 1 and all(b":" in t for t in tokens[1:])
    if b"\t" in first and not pairs:
        return "criteo"
    return "libffm" if name.endswith(".ffm") or (len(tokens) > 1 and tokens[1].count(b":") == 2) else "libsvm"


def byte_range(path: str, part: int, parts: int, size: int | None = None) -> tuple[int, int]:
    """Bytes ``[start, end)`` of part ``part`` of ``parts``, both at line starts (of a file of
    ``size`` bytes: its size now unless given); see :func:`hpcps.train.inputs.line_start`."""
    size = os.path.getsize(path) if size is None else size
    return tuple(inputs.line_start(path, size * k // parts, size) for k in (part, part + 1))


def fingerprint(spec, span: int = 1 << 20) -> dict:
    """What identifies the contents of the files ``spec`` names cheaply: their size and the XXH64
    of each file's first and last ``span`` bytes (recorded in checkpoints, compared when
    resuming). One file: its path; several: the first's, and the number of files (each read
    ``span / files`` bytes at each end, at least 4 KiB: thousands of part files cost what a few do)."""
    from hpcps_kernels.hashing import xxh64

    files = inputs.data_files(spec)
    span = max(1 << 12, span // len(files))
    raw, size = b"", 0
    for path in files:
        check_file(path)
        n = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(span)
            f.seek(max(0, n - span))
            raw += head + f.read(span)
        size += n
    raw = np.frombuffer(bytearray(raw), dtype=np.uint8)  # (writable: the parsers' compiled signature)
    out = {"path": os.path.abspath(files[0]), "bytes": size,
           "head_tail_xxh64": f"{int(xxh64(raw, 0, raw.shape[0], np.uint64(0))):016x}"}
    if len(files) > 1:
        out["files"] = len(files)
    return out


def _count_newlines(path: str, start: int, end: int | None, kernel: bool = True, kind: str = "",
                    tee: inputs.Tee | None = None) -> tuple[int, bytes]:
    """(newlines in ``path[start:end]``, its last byte), read in 4 MiB pieces into one reused
    buffer and counted by the nogil count kernel: this must not hold the part in memory (a memory
    map of it would count in the process's resident memory). ``kernel`` False: counted by
    ``bytearray.count`` instead, which holds the GIL and is 5x slower here but needs no numba
    call, whose first in a process costs about 0.2 s (see :func:`rows_at_least`). ``kind``: the
    file's compression; its decompressed bytes are counted (``start`` 0), to ``end`` or, None,
    to their end; ``tee``: each piece read is handed to it too (then its end or the error)."""
    try:
        n, last = _count_read(path, start, end, kernel, kind, tee)
    except BaseException as e:
        if tee is not None:
            tee.finish(e)
        raise
    if tee is not None:
        tee.finish()
    return n, last


def _count_read(path: str, start: int, end: int | None, kernel: bool, kind: str, tee) -> tuple[int, bytes]:
    """See :func:`_count_newlines`."""
    n, last = 0, b""
    buf = bytearray(min(4 << 20, max(end - start, 1)) if end is not None else 4 << 20)
    view = memoryview(buf)
    with inputs.open_stream(path, kind) as f:
        if start:
            f.seek(start)
        left = end - start if end is not None else 1 << 62
        while left > 0:
            got = _read_into(f, view[:min(len(buf), left)], path)
            if not got and end is None:
                break
            if not got:  # the file shrank since ``end`` was known
                raise _short_read(path, end - left, end)
            if kernel:
                chunk = np.frombuffer(view[:got], dtype=np.uint8)
                n += int(parse.count_byte(chunk, 10))
                del chunk
            else:
                n += buf.count(b"\n", 0, got)
            last = bytes(view[got - 1:got])
            left -= got
            if tee is not None:
                tee.put(bytes(view[:got]))
    return n, last


ones = parse.ones  # (``n`` float32 ones: views of one shared array, never written)


def values_if_any(values: np.ndarray) -> np.ndarray | None:
    """``values``, or None when they are a view of a shared array of ones (a compacted batch's,
    or a format whose every value is 1: :func:`hpcps_kernels.parse.ones`): a kernel then reads
    none (:func:`hpcps_kernels.models.lr_forward_backward`). A batch of ones in an array of its
    own is read as it is (the same figures)."""
    return None if parse.is_ones(values) else values


class CompactKeys:
    """A kept batch's unique keys and each nonzero's position among them, in the narrowest form
    that holds them exactly: keys as uint32 when at most a quarter of them need more bits (those,
    such as the bias key, kept apart with their places), positions as uint16 when the batch has at
    most 65,536 unique keys. :meth:`wide` gives back (uint64 keys, int32 positions), equal to the
    pair kept, for a step (a copy of a batch's keys: microseconds against its step).

    ``in_next``: (the CompactKeys of the batch pulled with this one's push, which of this batch's
    keys are among that batch's, one bit a key): what :meth:`in_pull` gives back in the next
    epochs for the same pair of batches, instead of probing every key again each epoch."""

    __slots__ = ("keys", "high_at", "high", "pos", "in_next")
    NARROW_POSITIONS = 1 << 16  # unique keys a batch may have for uint16 positions

    def __init__(self, uniq: np.ndarray, pos: np.ndarray):
        high_at = np.flatnonzero(uniq > np.uint64(0xFFFFFFFF))
        if 4 * high_at.shape[0] > uniq.shape[0]:  # mostly keys of more bits (hash_bits > 32): as they are
            self.keys, self.high_at, self.high = uniq, None, None
        else:
            self.keys, self.high_at, self.high = uniq.astype(np.uint32), high_at, uniq[high_at]
        self.pos = pos.astype(np.uint16 if uniq.shape[0] <= self.NARROW_POSITIONS else np.int32)
        self.in_next = None

    def in_pull(self, following: "CompactKeys", mask_of) -> np.ndarray:
        """Whether each of this batch's unique keys is among ``following``'s (bool, in their
        order): ``mask_of()``'s answer, computed for a pair of batches once, then kept as bits."""
        if self.in_next is not None and self.in_next[0] is following:
            n = self.keys.shape[0]
            return np.unpackbits(self.in_next[1], count=n, bitorder="little").view(np.bool_)
        mask = mask_of()
        self.in_next = (following, np.packbits(mask, bitorder="little"))
        return mask

    def wide(self, narrow: bool = False) -> tuple:
        """(unique keys as uint64, positions as int32; with ``narrow``, as kept: uint16 or int32)."""
        if self.high_at is None:
            uniq = self.keys
        else:
            uniq = self.keys.astype(np.uint64)
            uniq[self.high_at] = self.high
        return uniq, self.pos if narrow else self.pos.astype(np.int32)

    @property
    def nbytes(self) -> int:
        bits = self.in_next[1] if self.in_next is not None else None
        return sum(a.nbytes for a in (self.keys, self.high_at, self.high, self.pos, bits) if a is not None)


@dataclass
class Dataset:
    labels: np.ndarray      # float32 (rows,)
    indptr: np.ndarray      # int64 (rows + 1,)
    indices: np.ndarray | None  # uint64 (nnz,); None once compacted (see compact)
    values: np.ndarray      # float32 (nnz,)
    skipped: int = 0
    source: str = ""
    # a batch the training keeps for its next epochs: its unique keys and each nonzero's position
    # among them, set by compact(), which then drops ``indices``
    compacted: CompactKeys | None = None
    keep_prepared: bool = False
    state: dict | None = None  # its files' part_states when they were read (a loaded part)
    weights: np.ndarray | None = None  # float32 (rows,): each row's importance weight; None: all 1
    row_lengths: np.ndarray | None = None  # uint8/uint16 (rows,): a narrowed batch's rows (indptr None)

    @property
    def prepared(self) -> tuple | None:
        """A compacted batch's (unique keys uint64, int32 position of each nonzero among them)."""
        return self.prepared_for(False)

    def prepared_for(self, narrow: bool) -> tuple | None:
        """:attr:`prepared`, its positions as kept (uint16 where the batch allows) with ``narrow``
        (for a model whose kernels read any integer type: no copy a step)."""
        return None if self.compacted is None else self.compacted.wide(narrow)

    def compact(self, uniq: np.ndarray, pos: np.ndarray, narrow: bool = False) -> tuple:
        """Keep the batch's keys as its unique keys and each nonzero's position among them
        (``uniq[pos] == indices``; :class:`CompactKeys`: 2 bytes a nonzero and 4 a unique key at
        most 2**32 where the batch allows, instead of 8 a nonzero), and drop ``indices``: no
        deduplication in the next epochs. Values that are all 1 (Criteo, binary features) become
        a view of one shared array of ones. Returns (uniq, int32 pos) for this step (``narrow``:
        the positions as kept, see :meth:`prepared_for`)."""
        self.compacted = CompactKeys(uniq, pos)
        self.indices = None
        self.values = _shared_ones(self.values)
        return uniq, self.compacted.pos if narrow else pos.astype(np.int32)

    def narrow_rows(self) -> None:
        """A batch kept between its epochs: its row offsets as each row's length, uint8 where no
        row has more than 255 nonzeros (uint16 up to 65,535): 1 byte a row instead of 8 (see
        :meth:`for_a_step`)."""
        if self.indptr is None:
            return
        lengths = np.diff(self.indptr)
        longest = int(lengths.max()) if lengths.shape[0] else 0
        if longest <= 0xFFFF:
            self.row_lengths = lengths.astype(np.uint8 if longest <= 0xFF else np.uint16)
            self.indptr = None

    def for_a_step(self) -> "Dataset":
        """The batch as a step reads it: itself, or a narrowed one (:meth:`narrow_rows`) with its
        int64 row offsets back (the same offsets) on a new Dataset sharing the rest."""
        if self.indptr is not None:
            return self
        indptr = np.zeros(self.row_lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.row_lengths, out=indptr[1:])
        return Dataset(self.labels, indptr, self.indices, self.values, self.skipped, self.source, self.compacted,
                       self.keep_prepared, self.state, self.weights)

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    def batch(self, lo: int, hi: int) -> "Dataset":
        """Rows ``[lo, hi)`` (views, indptr rebased)."""
        lo, hi = min(lo, self.rows), min(hi, self.rows)
        a, b = self.indptr[lo], self.indptr[hi]
        return Dataset(self.labels[lo:hi], self.indptr[lo:hi + 1] - a, self.indices[a:b], self.values[a:b],
                       weights=None if self.weights is None else self.weights[lo:hi])

    def take_rows(self, rows: np.ndarray) -> "Dataset":
        """A copy of the rows ``rows`` (row numbers, in any order)."""
        lengths = np.diff(self.indptr)[rows]
        indptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        starts = self.indptr[:-1][rows]
        at = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return Dataset(self.labels[rows], indptr, self.indices[at], self.values[at], 0, self.source,
                       weights=None if self.weights is None else self.weights[rows])

    def split_every(self, n: int, first_row: int, phase: int = -1) -> tuple["Dataset", "Dataset"]:
        """(the rows kept, every ``n``-th row held out), counting rows from ``first_row`` (this
        batch's first row's number in its part): row r is held out when ``r % n == phase % n``
        (``n - 1`` unless given; ``hpcps tune``'s folds use the other phases)."""
        r = np.arange(first_row, first_row + self.rows)
        held = (r % n) == phase % n
        return self.take_rows(np.flatnonzero(~held)), self.take_rows(np.flatnonzero(held))

    @property
    def nbytes(self) -> int:
        keys = self.indices.nbytes if self.indices is not None else getattr(self.compacted, "nbytes", 0)
        values = self.values.nbytes if values_if_any(self.values) is not None else 0
        rows = self.indptr if self.indptr is not None else self.row_lengths
        return self.labels.nbytes + rows.nbytes + keys + values + getattr(self.weights, "nbytes", 0)

    def check_finite(self) -> None:
        self.label_range()

    def label_range(self) -> tuple[float, float]:
        """(smallest, largest) label (0, 0 without rows); :class:`DataError` for a NaN or
        infinite one (min and max carry it: no pass of its own)."""
        if not self.rows:
            return 0.0, 0.0
        lo, hi = float(self.labels.min()), float(self.labels.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise DataError(f"{self.source}: a label is NaN or infinite")
        return lo, hi


# A label this many spans beyond the first rows' labels (their 1st to 99th percentile; the span
# at least their magnitude and 1) gets a warning under the squared loss: an outlier like that
# dominates the loss, and one of 1e19 or more overflows the optimizers' float32 state into NaN.
FAR_LABEL_SPANS = 100


def far_label_bounds(first: np.ndarray) -> tuple[float, float, float, float] | None:
    """(low, high, the first rows' 1st and 99th percentile): a label below low or above high is
    far from ``first`` (the first rows' labels); None without rows."""
    if not first.shape[0]:
        return None
    lo, hi = (float(x) for x in np.percentile(first.astype(np.float64), [1, 99]))
    span = max(hi - lo, abs(lo), abs(hi), 1.0) * FAR_LABEL_SPANS
    return lo - span, hi + span, lo, hi


class LabelWatch:
    """The range of the labels read so far, and one warning for a label far from the first
    rows' (:data:`FAR_LABEL_SPANS`), for the squared loss. Costs no pass of its own: a slice's
    range comes from :meth:`Dataset.label_range`, which also checks the labels are finite."""

    def __init__(self, source: str, warn: bool):
        self.source, self.warn = source, warn
        self.range: tuple[float, float] | None = None
        self.bounds: tuple | None = None
        self.warned = False

    def see(self, ds: "Dataset") -> None:
        """A slice's labels, in file order (the first rows with labels set what is far)."""
        lo, hi = ds.label_range()
        if not ds.rows:
            return
        self.range = (lo, hi) if self.range is None else (min(lo, self.range[0]), max(hi, self.range[1]))
        if self.warn and self.bounds is None:
            self.bounds = far_label_bounds(ds.labels[:4096])
        b = self.bounds
        if b is not None and not self.warned and (lo < b[0] or hi > b[1]):
            self.warned = True
            sys.stderr.write(f"hpcps: warning: {self.source}: a label of {lo if lo < b[0] else hi:g} is far outside "
                             f"the first rows' labels (1st to 99th percentile: {b[2]:g} to {b[3]:g}); under the "
                             f"squared loss such a label swamps the others and can overflow the training into "
                             f"NaN: check or scale the labels\n")
            sys.stderr.flush()


def _parse_blocks(piece: Piece, fmt: str, hash_bits: int, skip_bad: bool, binary: bool,
                  block_bytes: int = 0, fields: bool = False, state: tuple | None = None, stream=None,
                  need_labels: bool = True):
    """Parse ``piece`` (bytes ``[start, end)`` of a file, or a compressed file's whole stream)
    block by block: each block is read into one reusable buffer after the previous block's
    unfinished line, and parsed in place (no copies of the text). Yields ``(labels, indptr,
    indices, values, skipped)`` per block (new arrays: the buffer is reused).

    A read that ends before ``end`` (the file shrank) raises :class:`DataChanged`; so does, with
    ``state`` (:func:`file_state` when the ranges were cut), a file changed in any way, checked
    before each block (one ``stat``). ``stream``: where a compressed piece's text is read from
    (an :class:`hpcps.train.inputs.Tee`), if not from the file. ``need_labels`` False: rows without
    a label are read (label 0; a registered format's parser is not asked)."""
    path, kind = piece.path, piece.compression
    block_bytes = block_bytes or (STREAM_BLOCK_BYTES if kind else PARSE_BLOCK_BYTES)
    end = piece.end if not kind else 1 << 62  # (a stream: read to its end, its size unknown)
    buf = bytearray(min(block_bytes, end - piece.start) + (1 << 16))
    view = memoryview(buf)
    seen = np.zeros(2, dtype=np.int64)  # binary labels: a 0 / a -1 met in an earlier block
    carry = 0          # bytes of an unfinished line at the front of buf
    block_start = pos = piece.start  # offset of buf[0], and of the next byte read (decompressed, in a stream)
    try:
        f = stream if stream is not None else inputs.open_stream(path, kind)
    except OSError as e:
        if state is not None:
            check_unchanged(path, state)  # (removed or replaced: says so)
        raise DataError(f"data file {path}: {e.strerror or e}") from None
    with f:
        if pos:
            f.seek(pos)
        while pos < end or carry:
            want = min(block_bytes, end - pos)
            if len(buf) < carry + want:  # a line longer than the spare room: grow
                del view
                buf = buf + bytearray(carry + want - len(buf))
                view = memoryview(buf)
            if state is not None:
                check_unchanged(path, state)
            got = _read_into(f, view[carry:carry + want], path) if want > 0 else 0
            if got < want and not kind:  # (a regular file reads short only at its end)
                raise _short_read(path, pos + got, end)
            if got < want:
                end = pos + got
            pos += got
            if kind and pos == got and buf[:len(BOM)] == BOM:  # a stream's BOM is no label (as line_start's)
                buf[:got - len(BOM)] = buf[len(BOM):got]
                got -= len(BOM)
            n = carry + got
            cut = n if pos >= end else buf.rfind(b"\n", 0, n) + 1
            if cut == 0:  # no line end yet: read more
                carry = n
                continue
            block = np.frombuffer(view[:cut], dtype=np.uint8)
            try:
                out = _parse_block(block, path, fmt, hash_bits, skip_bad, binary, fields, seen, need_labels)
            except parse.ParseError as e:
                line = _count_newlines(path, 0, block_start, kind=kind)[0] + e.line
                text = f"{e.text[:120]!r}" if e.text else ""  # (as ParseError says it: a reason may hold ': ')
                raise DataError(f"{path}:{line}: " + (_other_format(fmt, e.text) or e.reason
                                                       + (f": {text}" if text else ""))) from None
            except ValueError as e:  # settings the format cannot take (hash bits for fields)
                raise DataError(f"{path}: {e}") from None
            finally:
                del block
            carry = n - cut
            buf[:carry] = buf[cut:n]
            block_start += cut
            yield out


def _read_into(f, view, path: str) -> int:
    """``f.readinto(view)`` until ``view`` is full or the file ends (a stream may return less);
    a damaged compressed stream is a :class:`DataError` naming the file."""
    got = 0
    try:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    except Exception as e:  # noqa: BLE001 - each decompressor has its own (zlib.error, ZstdError, EOFError...)
        if isinstance(e, DataError) or (isinstance(e, OSError) and e.errno is not None):
            raise  # said already (by the line count, through a Tee); or a failing disk, not a damaged stream
        raise DataError(f"data file {path}: its compressed stream is damaged or cut short ({e})") from None
    return got


def _parse_block(block, path: str, fmt: str, hash_bits: int, skip_bad: bool, binary: bool, fields: bool, seen,
                 need_labels: bool = True):
    """One block of whole lines of ``path``, parsed as ``fmt`` (the built-in formats' rows with
    their weights, and without labels unless ``need_labels``)."""
    rows = {"with_weights": True} if need_labels else {"need_labels": False, "with_weights": True}
    if fmt == "criteo":
        return parse.parse_criteo(block, source=path, first_line=1, skip_bad=skip_bad, bits=hash_bits,
                                  bias=int(BIAS_KEY), fields=fields, **rows)
    reader = TEXT_PARSERS.get(fmt, parse.parse_libsvm)
    return reader(block, source=path, first_line=1, skip_bad=skip_bad, binary=binary, seen=seen,
                  bias=int(BIAS_KEY), bits=hash_bits, **(rows if fmt in BUILT_IN_FORMATS else {}))


def _shared_ones(values: np.ndarray) -> np.ndarray:
    """A streamed slice's values, or where they are all 1 (binary features: libsvm's ``key:1``) a
    view of the shared ones (:func:`ones`), as Criteo's are: the slice and the batches joined
    across slices carry no values (4 bytes a nonzero of memory and copying), and the LR kernel
    reads none (:func:`values_if_any`; the same figures). Not for a part loaded whole: the
    shared array would grow to its size for the rest of the run (a batch of it once compacted:
    :meth:`Dataset.compact`)."""
    if values.shape[0] and values_if_any(values) is not None and (values == 1.0).all():
        return ones(values.shape[0])
    return values


# data.format -> its parser, ``parse(block, *, source, first_line, skip_bad, binary, seen, bias,
# bits)`` returning ``(labels, indptr, indices, values, skipped)``: see :func:`register_format`
# (Criteo, whose parser takes its fields instead of labels' settings, is called apart)
TEXT_PARSERS = {"libsvm": parse.parse_libsvm, "vw": parse.parse_vw, "libffm": parse.parse_libffm}
BUILT_IN_FORMATS = ("auto", "libsvm", "criteo", "vw", "libffm", *tables.FORMATS)


def register_format(name: str, parser, replace: bool = False):
    """Read ``data.format = name`` files with ``parser`` (on every rank, before the configuration
    is read), called on blocks of whole lines of a worker's part of the file, as
    :func:`hpcps_kernels.parse.parse_libsvm` is:

    ``parser(block, *, source, first_line, skip_bad, binary, seen, bias, bits)``: ``block`` the
    lines' bytes (uint8; the last line may lack its newline), ``source`` the file's name and
    ``first_line`` the block's first line's number (for messages), ``skip_bad`` skip bad lines
    (counting them) instead of raising, ``binary`` labels for the logistic loss (0/1), ``seen``
    (int64[2]) which of the labels 0 and -1 blocks so far held, ``bias`` the key to append to
    every row (value 1; not masked), ``bits`` the hash bits (mask keys to them). Returns
    ``(labels float32 (rows,), indptr int64 (rows + 1,), indices uint64 (nnz,), values float32
    (nnz,), skipped int)``. A bad line raises :class:`hpcps_kernels.parse.ParseError` with its
    number in the block (the message gets its number in the file) or ValueError."""
    if name in BUILT_IN_FORMATS or (name in TEXT_PARSERS and not replace):
        raise ValueError(f"data format {name!r} is already registered")
    if not callable(parser):
        raise TypeError(f"register_format({name!r}, ...): the parser must be callable, got {parser!r}")
    from hpcps import config  # (imported here: reading data needs no configuration)

    TEXT_PARSERS[name] = parser
    config.add_choice("data", "format", name)
    return parser


CRITEO_COLUMNS = 40  # a label, 13 integer and 26 categorical columns, tab-separated


def _other_format(fmt: str, line: str) -> str | None:
    """What to say of a bad ``line`` read as ``fmt`` when it is plainly a line of another format
    (a Criteo line has 40 tab-separated columns; libsvm's fields are index:value pairs), or None."""
    if not line:
        return None
    columns = line.count("\t") + 1
    tokens = line.split()
    pairs = len(tokens) > 1 and all(":" in t for t in tokens[1:])
    criteo = abs(columns - CRITEO_COLUMNS) <= 1  # (39: no label; 41: a weight after the label)
    if fmt == "criteo" and not criteo:
        return (f"not a Criteo line: {columns} tab-separated column(s), where Criteo has {CRITEO_COLUMNS} (a label, "
                f"13 integer and 26 categorical columns; 39 without the label, 41 with a weight after it)"
                + ("; its fields are index:value pairs, as in libsvm: read it as libsvm (or auto)" if pairs else ""))
    if fmt != "criteo" and criteo and not pairs:
        return (f"not a {fmt} line: it has Criteo's {columns} tab-separated columns: read it as criteo "
                f"(or auto)" + _ONE_FORMAT)
    if fmt != "vw" and "|" in line and not pairs:
        return f"not a {fmt} line: it has VW's '|' before its features: read it as vw (or auto)" + _ONE_FORMAT
    return None


# (auto detects a data set's format from its first file: another file of a directory or list in
# another format fails at its first line)
_ONE_FORMAT = "; with auto, every file of a data set is read in its first file's format"


def _concat(pieces: list) -> tuple:
    """One CSR part from consecutive (labels, indptr, indices, values[, weights]) pieces: (labels,
    indptr, indices, values, weights), the weights None when no piece has any."""
    if not pieces:
        return np.zeros(0, np.float32), np.zeros(1, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.float32), None
    if len(pieces) == 1:
        return (*pieces[0][:4], _weights_of(pieces[0]))
    labels = np.concatenate([p[0] for p in pieces])
    offsets = np.cumsum([0] + [p[1][-1] - p[1][0] for p in pieces[:-1]])
    indptr = np.concatenate([[0]] + [p[1][1:] - p[1][0] + o for p, o in zip(pieces, offsets)]).astype(np.int64)
    indices = np.concatenate([p[2] for p in pieces])
    ones_only = all(values_if_any(p[3]) is None for p in pieces)  # (Criteo's: one shared array of ones)
    values = parse.ones(indices.shape[0]) if ones_only else np.concatenate([p[3] for p in pieces])
    weighted = [_weights_of(p) for p in pieces]
    weights = None if all(w is None for w in weighted) else \
        np.concatenate([np.ones(p[0].shape[0], np.float32) if w is None else w for p, w in zip(pieces, weighted)])
    return labels, indptr, indices, values, weights


def _weights_of(piece: tuple):
    """The weights of a (labels, indptr, indices, values[, weights]) piece (None: every row's 1)."""
    return piece[4] if len(piece) > 4 else None


def concatenate(parts: list) -> "Dataset":
    """The rows of the Datasets ``parts``, in order, as one (without their keys' compaction)."""
    return _joined([(p.labels, p.indptr, p.indices, p.values, p.weights) for p in parts])


def _joined(pieces: list) -> "Dataset":
    """The rows of (labels, indptr, indices, values[, weights]) pieces as one Dataset."""
    *csr, weights = _concat(pieces)
    return Dataset(*csr, weights=weights)


def part_states(pieces: list[Piece]) -> dict:
    """The :func:`file_state` of each file of ``pieces``, by path: what their reads are checked against."""
    return {p.path: file_state(p.path) for p in pieces}


def check_part_unchanged(states: dict) -> None:
    """Raise :class:`DataChanged` if a file of :func:`part_states` ``states`` changed."""
    for path, state in states.items():
        check_unchanged(path, state)


def part_source(pieces: list[Piece]) -> str:
    """How messages name a part read from ``pieces`` (:func:`hpcps.train.inputs.describe`)."""
    return inputs.describe(list(dict.fromkeys(p.path for p in pieces)))


def _parse_pieces(pieces: list[Piece], fmt: str, hash_bits: int, skip_bad: bool, binary: bool,
                  block_bytes: int = 0, fields: bool = False, states: dict | None = None, streams: dict | None = None,
                  need_labels: bool = True, columns: tables.Columns = tables.Columns()):
    """:func:`_parse_blocks` over each of ``pieces`` in turn (``states``: their files'
    :func:`part_states`, checked before each block; ``streams``: by piece number, where a
    compressed piece's text is read from; ``columns``: a table's, :mod:`hpcps.train.tables`)."""
    for i, p in enumerate(pieces):
        if p.compression == tables.TABLE:
            yield from tables.blocks(p, fmt, hash_bits, binary, int(BIAS_KEY), columns, need_labels, fields)
            continue
        yield from _parse_blocks(p, fmt, hash_bits, skip_bad, binary, block_bytes, fields,
                                 states.get(p.path) if states else None, (streams or {}).get(i), need_labels)


def load_part(path, part: int, parts: int, fmt: str = "auto", hash_bits: int = 24, skip_bad: bool = False,
              cache_dir: str = "", binary: bool = False, fields: bool = False, key: str = "data",
              idle_ok: bool = False, need_labels: bool = True, columns: tables.Columns = tables.Columns()) -> Dataset:
    """Parse this worker's part of the files ``path`` names (a path, glob, directory or list:
    :func:`hpcps.train.inputs.part_of`), with the bias feature, through the cache if set.

    ``binary``: the labels are for the logistic loss; libsvm labels -1/+1 become 0/1, and any
    label other than 0, 1, -1, +1 is an error naming the line (Criteo labels are 0/1 anyway).
    ``fields``: keys carry their field above the hash bits (Criteo: the column; libffm keys
    always do; libsvm and VW keys are all field 0). ``key``: the configuration key messages name;
    ``idle_ok``: this worker may read nothing (:func:`hpcps.train.inputs.split`).
    ``need_labels`` False (rows to score): a row without a label is read, with label 0 (libsvm
    and libffm lines that start with a feature, VW lines that start with ``|`` or a tag, Criteo
    lines of 39 columns); else it is an error. ``columns``: the columns of a Parquet or CSV table
    (:mod:`hpcps.train.tables`).
    """
    fmt = detect_format(path, fmt, key)
    pieces = part_of(path, part, parts, fmt, key, idle_ok)
    state = part_states(pieces)
    source = part_source(pieces)
    cache = None
    if cache_dir and fmt not in tables.FORMATS:  # (a table is read through pyarrow, uncached)
        cache = _cache_entry(cache_dir, pieces, part, parts, fmt, hash_bits, skip_bad, binary,
                             fields and fmt == "criteo", need_labels)
        ds = _read_cache(cache, source, part, parts, state)
        if ds is not None:
            return ds
    blocks = list(_parse_pieces(pieces, fmt, hash_bits, skip_bad, binary, fields=fields, states=state,
                                need_labels=need_labels, columns=columns))
    *csr, weights = _concat([b[:4] + b[5:] for b in blocks])
    ds = Dataset(*csr, sum(b[4] for b in blocks), source, state=state, weights=weights)
    ds.check_finite()
    if cache:
        _write_cache(cache, ds, part, parts)
    return ds


CACHE_ARRAYS = ("labels", "indptr", "indices", "values")


def _cache_entry(cache_dir: str, pieces: list[Piece], part: int, parts: int, fmt: str, hash_bits: int,
                 skip_bad: bool, binary: bool, fields: bool, need_labels: bool = True) -> str:
    """The cache directory of a part parsed with these settings from ``pieces`` of files as they
    are now.

    A file is told by its path, size and modification time, and by its device, inode and
    status-change time (``st_ctime_ns``): a file rewritten in place with its size and modification
    time kept (``os.utime``, ``touch -r``, ``rsync -t``) still gets a new ctime, which no call can
    set back, and a file replaced by another gets another inode. A hash of the contents would tell
    it too but read the whole file on every start, which the cache is there to avoid; a change of
    ctime alone (``chmod``, a new hard link) costs one parse, never a wrong row."""
    tag = ""
    for p in pieces:
        st = os.stat(p.path)
        tag += (f"{os.path.abspath(p.path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_dev}|{st.st_ino}|{st.st_ctime_ns}|"
                f"{p.start}-{p.end}|")
    tag += (f"{part}/{parts}|{fmt}|{hash_bits}|{skip_bad}|{binary}" + ("|fields" if fields else "")
            + ("" if need_labels else "|unlabeled"))
    return os.path.join(cache_dir, hashlib.sha256(tag.encode()).hexdigest()[:20])


def _cache_warning(message: str, e: BaseException, where: str = "") -> None:
    """One warning line: ``message`` with ``{why}`` as the failure's reason (numpy's short write
    of an array on a full disk carries no errno: the free space in ``where`` says so)."""
    why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
    if where and getattr(e, "errno", None) is None:
        with contextlib.suppress(OSError):
            if shutil.disk_usage(where).free < 1 << 20:
                why = f"the disk is full ({why})"
    sys.stderr.write(f"hpcps: warning: data.cache_dir: {message.format(why=why)}\n")
    sys.stderr.flush()


def _read_cache(cache: str, path: str, part: int, parts: int, state: dict) -> Dataset | None:
    """The part from its cache entry (memory-mapped), or None when there is none. A damaged entry
    (cut short, unreadable, arrays that do not fit together) is one warning and removed, so that
    the part is parsed and cached again instead of failing every start the same way."""
    done = os.path.join(cache, "done")
    if not os.path.exists(done):
        return None
    try:
        with open(done) as f:
            skipped, *digest = (f.read() or "0").split()
        skipped = int(skipped)
        labels, indptr, indices, values = (np.load(os.path.join(cache, f"{n}.npy"), mmap_mode="r")
                                           for n in CACHE_ARRAYS)
        weighted = os.path.join(cache, "weights.npy")
        weights = np.load(weighted, mmap_mode="r") if os.path.exists(weighted) else None
        if weights is not None and weights.shape != labels.shape:
            raise ValueError(f"{weights.shape[0]} weights for {labels.shape[0]} rows")
        if digest and digest[0] != _cache_digest((labels, indptr, indices, values, weights)):
            raise ValueError("its arrays fail their XXH64 checksum")  # (a flipped bit: keys or values changed)
        rows, nnz = labels.shape[0], indices.shape[0]
        if (labels.ndim, indptr.ndim, indices.ndim, values.ndim) != (1, 1, 1, 1) or indptr.shape[0] != rows + 1 \
                or values.shape[0] != nnz or int(indptr[0]) != 0 or int(indptr[-1]) != nnz:
            raise ValueError(f"its arrays do not fit together ({rows} labels, {indptr.shape[0]} row offsets "
                             f"ending at {int(indptr[-1]) if indptr.shape[0] else '?'}, {nnz} keys, "
                             f"{values.shape[0]} values)")
    except (OSError, ValueError, EOFError) as e:
        _cache_warning(f"the cache of {path} (part {part + 1} of {parts}) in {cache} is damaged ({{why}}): "
                       f"removed; the part is parsed from its text (and cached again)", e)
        shutil.rmtree(cache, ignore_errors=True)
        return None
    return Dataset(labels, indptr, indices, values, skipped=skipped, source=path, state=state, weights=weights)


def _cache_digest(arrays) -> str:
    """XXH64 of a cache entry's arrays, in order (None skipped): what its ``done`` file records
    beside the rows skipped, checked when the entry is read (an entry without it is trusted)."""
    import xxhash
    h = xxhash.xxh64()
    for a in arrays:
        if a is not None:
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def _write_cache(cache: str, ds: Dataset, part: int, parts: int) -> None:
    """Save the parsed part as its cache entry: written in a temporary directory beside it, then
    renamed. A write that fails (a full disk, no permission) is one warning and leaves nothing
    behind: the cache only saves later starts a parse."""
    tmp = cache + f".tmp{os.getpid()}"
    try:
        os.makedirs(tmp, exist_ok=True)
        for n in CACHE_ARRAYS + (("weights",) if ds.weights is not None else ()):
            np.save(os.path.join(tmp, f"{n}.npy"), getattr(ds, n))
        with open(os.path.join(tmp, "done"), "w") as f:
            f.write(f"{ds.skipped} {_cache_digest(tuple(getattr(ds, n) for n in CACHE_ARRAYS + ('weights',)))}")
    except (OSError, ValueError) as e:  # (numpy raises ValueError for a short write)
        _cache_warning(f"cannot cache {ds.source} (part {part + 1} of {parts}) in {os.path.dirname(cache) or '.'}: "
                       f"{{why}}; the job goes on with the part as parsed, uncached", e, os.path.dirname(cache) or ".")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        os.replace(tmp, cache)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)


def rows_at_least(spec, enough: int, fmt: str = "auto") -> int:
    """The lines of the files ``spec`` names, counted until ``enough`` (then ``enough``; 0 for
    files it cannot read): reads at most as far as the ``enough``-th line (of a compressed file,
    of its decompressed stream). Counted without numba: the first rank counts for the others (the
    auto batch size) while they wait, and a first numba call there cost 0.2 s of that wait, which
    each rank pays anyway, at the same time, when it starts its context. Tables (``fmt`` or
    detected: :func:`detect_format`) count their rows, not lines."""
    n = 0
    try:
        table = detect_format(spec, fmt)
        for path in inputs.data_files(spec):
            check_file(path)  # (a FIFO is never opened: that would wait for a writer)
            if table in tables.FORMATS:
                n += tables.rows_of(path, table)
            else:
                n += _lines_at_least(path, enough - n, inputs.compression(path))
            if n >= enough:
                break
    except (OSError, DataError):  # (loading the part says what is wrong with it, on every rank)
        return 0
    return min(n, enough)


def _lines_at_least(path: str, enough: int, kind: str) -> int:
    """The lines of ``path`` (compressed as ``kind`` says), counted until ``enough``."""
    n, last = 0, b""
    buf = bytearray(4 << 20)
    with inputs.open_stream(path, kind) as f:
        while n < enough:
            got = _read_into(f, memoryview(buf), path)
            if not got:
                return n + (1 if last not in (b"", b"\n") else 0)
            n += buf.count(b"\n", 0, got)
            last = bytes(buf[got - 1:got])
    return n


def part_of(path, part: int, parts: int, fmt: str, key: str = "data", idle_ok: bool = False) -> list[Piece]:
    """The pieces worker ``part`` of ``parts`` reads of the files ``path`` names, read as ``fmt``
    (row ranges of tables, :func:`hpcps.train.tables.part_of`; else :func:`hpcps.train.inputs.part_of`)."""
    if fmt in tables.FORMATS:
        return tables.part_of(path, part, parts, fmt, key, idle_ok)
    return inputs.part_of(path, part, parts, key, idle_ok)


def rows_bound(pieces: list[Piece], tees: dict | None = None) -> int:
    """At most how many rows ``pieces`` hold (their lines; blank, comment and skipped lines make
    it an upper bound). ``tees``: by piece number, where a compressed piece's text goes too."""
    total = 0
    for i, p in enumerate(pieces):
        if p.compression == tables.TABLE:  # (rows of a table)
            total += p.end - p.start
            continue
        n, last = _count_newlines(p.path, p.start, None if p.compression else p.end, kind=p.compression,
                                  tee=(tees or {}).get(i))
        total += n + (1 if last not in (b"", b"\n") else 0)
    return total


class _Pass:
    """The state of one pass over a part: its block generator, the blocks parsed ahead of the
    training, and (``memory_mb`` = 0) every block parsed so far, kept for the next passes."""

    def __init__(self, blocks, first: "Dataset | None", keep: bool):
        self.blocks = blocks
        self.ahead: deque = deque([first] if first is not None else [])
        self.ahead_bytes = first.nbytes if first is not None else 0
        self.keep = ([first] if first is not None else []) if keep else None
        self.skipped = first.skipped if first is not None else 0
        self.done = False
        self.error: DataError | None = None


class SlicesAhead:
    """The parsed slices of a part's passes, parsed ahead of the training that reads them (see
    :class:`PartStream`): by :meth:`pump`, one slice at a time, or by a thread of its own
    (:meth:`start_thread`). ``generator()`` starts a pass's slice generator, ``dataset(out)``
    makes a slice's Dataset; ``keep``: every parsed slice is kept for the next passes (the part
    is held in memory); ``ahead_limit``: bytes of parsed rows held ahead at most."""

    THREAD_AHEAD_BYTES = PARSE_AHEAD_BYTES  # parsed rows a parse thread holds ahead at most (start_thread)

    def __init__(self, generator, dataset, keep: bool, ahead_limit: float):
        self.generator, self.dataset = generator, dataset
        self.keep = keep
        self.keep_slices = keep  # False: the training keeps its own batches (keep_no_slices)
        self.ahead_limit = ahead_limit
        self.for_next_passes: list[Dataset] | None = None  # every slice of a whole pass (keep)
        self.skipped = 0          # lines skipped so far (all of them after a whole pass)
        self.first: Dataset | None = None  # the first slice, parsed at open
        self.blocks = None        # the slice generator of the pass opened, after its first slice
        self.current: _Pass | None = None
        # data.parse_thread (start_thread): a thread parses ahead. Whoever parses a slice holds
        # parsing (the pass's generator) and appends the slice before letting go, so slices stay
        # in order; state guards what the training pops (ahead, done, error, keep)
        self.parsing: threading.Lock | contextlib.nullcontext = contextlib.nullcontext()
        self.state = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False

    def open(self) -> None:
        """Start the first pass and parse its first slice now (raises DataError for a bad line)."""
        self.blocks = self.generator()
        try:
            self.first = self.dataset(next(self.blocks))
        except StopIteration:
            self.first = None

    def pump(self, force: bool = False) -> bool:
        """Parse one more slice of the current pass, if there is one and (unless ``force``) the
        rows parsed ahead are within the budget. Returns whether it parsed anything. Never
        raises (it runs inside the waits for the servers): a bad line is raised by
        :meth:`PartStream.batches` when the training reaches it, a changed file
        (:class:`DataChanged`) or any other failure at the training's next read."""
        p = self.current
        if p is None or p.done or (not force and p.ahead_bytes >= self.ahead_limit):
            return False
        with self.parsing:
            if p.done:  # the other thread parsed the last slice meanwhile
                return False
            try:
                ds = self.dataset(next(p.blocks))
            except StopIteration:
                with self.state:
                    p.done = True
                    self.skipped = p.skipped
                    if p.keep is not None:
                        self.for_next_passes = p.keep
                    self.state.notify_all()
                return False
            except Exception as e:  # noqa: BLE001 - kept for the training, which raises it where it reads
                with self.state:
                    p.done, p.error = True, e
                    self.state.notify_all()
                return False
            with self.state:
                p.ahead.append(ds)
                p.ahead_bytes += ds.nbytes
                p.skipped += ds.skipped
                if p.keep is not None:
                    p.keep.append(ds)
                self.state.notify_all()
        return True

    def start_thread(self) -> None:
        """See :meth:`PartStream.start_thread`."""
        if self.thread is not None:
            return
        # Without a budget, pumps parse the whole part ahead only as fast as the waits allow; a
        # thread would hold it all at once (the parsed slices of bench vw's rows: peak memory
        # about 1.5 times higher), so it stays THREAD_AHEAD_BYTES ahead
        self.ahead_limit = min(self.ahead_limit, self.THREAD_AHEAD_BYTES)
        self.parsing = threading.Lock()
        self.stopping = False
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.thread = threading.Thread(target=self._parse_ahead, name="hpcps-parse", daemon=True)
        self.thread.start()

    def stop_thread(self) -> None:
        """End the parsing thread (after the slice it is parsing, if any)."""
        if self.thread is None:
            return
        with self.state:
            self.stopping = True
            self.state.notify_all()
        self.thread.join(timeout=60)
        self.thread = None

    def _parse_ahead(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while not self.stopping:
            p = self.current
            try:
                did = self.pump()
            except Exception as e:  # not a bad line (those pump keeps): the training raises it where it reads
                with self.state:
                    if p is not None:
                        p.done, p.error = True, e
                    self.state.notify_all()
                return
            if not did:  # nothing to parse now (no pass, its end, the budget): wait for a change
                with self.state:
                    if not self.stopping:
                        self.state.wait(0.05)

    def _finish_pass(self) -> None:
        """Parse the rest of the current pass (its last rows unasked); raise its error, if any."""
        while self.pump(force=True):
            pass
        if self.current.error is not None:
            raise self.current.error

    def epoch_blocks(self):
        """The parsed slices of one pass, in order."""
        if self.current is not None and self.keep:
            self._finish_pass()
        if self.for_next_passes is not None:
            yield from self.for_next_passes
            return
        blocks = self.blocks if self.blocks is not None else self.generator()
        with self.parsing:  # a pass the thread may still be parsing is left to it first
            p = _Pass(blocks, self.first, self.keep_slices)
            with self.state:
                self.current = p
                self.state.notify_all()
        self.first, self.blocks = None, None
        while True:
            with self.state:
                ds = None
                if p.error is not None and type(p.error) is not DataError:
                    raise p.error  # at once (a bad line waits for its rows): the rows ahead may be of either file
                if p.ahead:
                    ds = p.ahead.popleft()
                    p.ahead_bytes -= ds.nbytes
                    self.state.notify_all()  # room under the budget again
                elif p.error is not None:
                    raise p.error
                elif p.done:
                    return
            if ds is not None:
                yield ds
            else:  # nothing parsed ahead: parse it here (with a thread, after the slice it is on)
                self.pump(force=True)

    def forget(self) -> None:
        """See :meth:`PartStream.forget`."""
        if self.current is not None and not self.current.done:
            self._finish_pass()
        with self.parsing:
            self.for_next_passes, self.current, self.first, self.blocks = None, None, None, None


class PartStream:
    """A worker's part of a training file, read as consecutive batches while it trains.

    The part is parsed in slices of ``block_bytes`` on the training thread itself: :meth:`pump`
    parses the next slice ahead of the training, and the training loop calls it while a step waits
    for the servers (:attr:`hpcps.ps.context.Context.background`), so parsing fills time the worker
    would otherwise sleep. By default there is no second thread: a parsing thread competes with
    the training thread for the GIL and, on a busy node, for a core, and each wake-up of a step's
    wait was late by a scheduler time slice (milliseconds, against answers due in microseconds).
    :meth:`start_thread` (``data.parse_thread``) parses on a thread anyway, for a node with a core
    to spare. When the training needs rows nothing has parsed yet, it parses them there and then
    (the slices parsed ahead: :class:`SlicesAhead`).

    The first slice is parsed at :meth:`open`, where its errors are reported like any loading
    error; a bad line further on raises :class:`DataError` (file and line) from :meth:`batches`.

    ``memory_mb`` = 0 keeps every parsed slice for the next epochs (the part must fit in memory,
    as parsed arrays), and pumps may parse the whole part ahead. ``memory_mb`` > 0 never holds more
    parsed rows than that: pumps stop at half the budget ahead; each epoch reads and parses the
    part again.
    """

    PUMP_BYTES = 1 << 19  # text parsed per pump: ~2,000 Criteo rows, about a millisecond

    def __init__(self, path, part: int, parts: int, fmt: str = "auto", hash_bits: int = 24,
                 skip_bad: bool = False, binary: bool = False, memory_mb: float = 0.0, block_bytes: int = 0,
                 fields: bool = False, shuffle_rows: int = 0, shuffle_seed: int = 0, warn_labels: bool = False,
                 key: str = "data", columns: tables.Columns = tables.Columns()):
        self.fmt = detect_format(path, fmt, key)
        self.pieces = part_of(path, part, parts, self.fmt, key)  # (path: a file, glob, directory or list of them)
        self.state = part_states(self.pieces)  # what the byte ranges were cut from: checked at every read
        self.path = part_source(self.pieces)
        self.labels = LabelWatch(self.path, warn_labels)  # (warn_labels: the squared loss)
        self.columns = columns
        self.hash_bits, self.skip_bad, self.binary, self.fields = hash_bits, skip_bad, binary, fields
        # the part's lines are counted on a thread (reading and counting release the GIL) while
        # the rest of the start-up goes on, needed only for the number of steps (see rows_bound). A
        # part kept in memory inflates a slow stream once: the first pass parses the text the count
        # inflated, held until then (a fast one is inflated twice rather than held)
        self.keep = memory_mb <= 0
        tees = {i: inputs.Tee() for i, p in enumerate(self.pieces)
                if self.keep and inputs.inflates_slowly(p.compression)}
        self._first_pass_streams = tees
        self._rows_bound: int | BaseException | None = None
        self._counting = threading.Thread(target=self._count_rows, args=(tees,), name="hpcps-count-rows", daemon=True)
        self._counting.start()
        budget = memory_mb * (1 << 20)
        # a parsed byte of text takes up to about 3 bytes in arrays (Criteo: 40 keys of 8 bytes, values
        # of 4, per line of ~250 characters): slices of a tenth of the budget, at most half of it ahead
        self.block_bytes = block_bytes or (self.PUMP_BYTES if self.keep else
                                           max(1 << 16, min(self.PUMP_BYTES, int(budget) // 10)))
        self.budget = budget
        self.shuffle_rows, self.shuffle_seed = shuffle_rows, shuffle_seed
        self.slices = SlicesAhead(self._generator, self._dataset, self.keep,
                                  float("inf") if self.keep else budget / 2)

    def _count_rows(self, tees: dict) -> None:
        try:
            self._rows_bound = rows_bound(self.pieces, tees)
        except BaseException as e:  # (raised where the count is read)
            self._rows_bound = e
            for tee in tees.values():  # (a piece not reached: its reader gets the error, not a wait)
                tee.finish(e)

    @property
    def rows_bound(self) -> int:
        """At most how many rows the part holds (its lines), counted at construction on a thread
        (this waits for it)."""
        self._counting.join()
        if isinstance(self._rows_bound, BaseException):
            raise self._rows_bound
        return self._rows_bound

    @property
    def has_rows(self) -> bool:
        """Whether the part holds a row: its first slice has one (no wait for the count), or
        the count says so; exactly when the first slice was the whole part (else a part of
        blank and comment lines reads as having rows: the training counts them after a pass).
        Call after :meth:`open`."""
        first = self.slices.first
        if first is not None and first.rows > 0:
            return True
        one = self.pieces[0]
        if len(self.pieces) == 1 and not one.compression and one.end - one.start <= self.block_bytes:
            return False
        return self.rows_bound > 0

    @property
    def skipped(self) -> int:
        """Lines skipped so far (all of them after a whole pass)."""
        return self.slices.skipped

    @property
    def kept(self) -> list | None:
        """Every parsed slice of a whole pass, kept for the next passes (None: not kept)."""
        return self.slices.for_next_passes

    @property
    def ahead_limit(self) -> float:
        """Bytes of parsed rows held ahead of the training at most."""
        return self.slices.ahead_limit

    @property
    def _pass(self):
        return self.slices.current

    def _dataset(self, out) -> Dataset:
        ds = Dataset(*out[:3], _shared_ones(out[3]), out[4], self.path, weights=_weights_of(out[:4] + out[5:]))
        self.labels.see(ds)  # (finite, their range)
        return ds

    def _generator(self):
        """A pass's slices: the first reads the compressed pieces' text the count inflates."""
        streams, self._first_pass_streams = self._first_pass_streams, None
        return _parse_pieces(self.pieces, self.fmt, self.hash_bits, self.skip_bad, self.binary, self.block_bytes,
                             self.fields, self.state, streams, columns=self.columns)

    def check_unchanged(self) -> None:
        """Raise :class:`DataChanged` if the file is no longer the one the job opened (the
        training calls it at each epoch: a part kept in memory reads no block to check)."""
        check_part_unchanged(self.state)

    def open(self) -> "PartStream":
        """Parse the first slice now (raises DataError for a bad line in it)."""
        self.slices.open()
        return self

    def head_labels(self, n: int) -> np.ndarray:
        """The labels of the first ``n`` rows a pass gives (fewer if the part has fewer; shuffled,
        the first rows of the shuffled windows), parsed apart from the training's pass."""
        w = self.shuffle_rows
        want = -(-n // w) * w if w else n  # the whole windows that hold the first n rows
        got, have = [], 0
        blocks = self._generator()
        try:
            for out in blocks:
                got.append(out[0])
                have += out[0].shape[0]
                if have >= want:
                    break
        finally:
            blocks.close()
        labels = np.concatenate(got)[:want] if got else np.zeros(0, np.float32)
        return (labels[window_order(labels.shape[0], w, self.shuffle_seed)] if w else labels)[:n]

    def pump(self, force: bool = False) -> bool:
        """Parse one more slice of the current pass ahead of the training (:meth:`SlicesAhead.pump`);
        returns whether it parsed anything. Never raises."""
        return self.slices.pump(force)

    def start_thread(self) -> None:
        """Parse ahead on a thread of its own (``data.parse_thread``) rather than in the training's
        waits (:meth:`pump` through :attr:`hpcps.ps.context.Context.background`). The thread runs at
        a lower priority (nice +10 on Linux), so on a full node it takes the cycles the training
        thread and the servers leave; the parse kernels release the GIL, and so do the training's
        dedup and gradient kernels. The same rows come in the same order: a run trains the same
        model with or without it. Python's switch interval drops to 0.5 ms, so that a training
        thread whose reply has come does not wait 5 ms for the GIL."""
        self.slices.start_thread()

    def stop_thread(self) -> None:
        """End the parsing thread (after the slice it is parsing, if any)."""
        self.slices.stop_thread()

    def keep_no_slices(self) -> None:
        """Keep no parsed slice for the next passes: the training keeps its batches itself
        (compacted, see :meth:`Dataset.compact`), or has one pass. A slice's memory goes once
        its batches are trained on (or compacted), and pumps hold at most ``PARSE_AHEAD_BYTES``
        of parsed rows ahead (kernels/tuning.py): the whole part parsed ahead in the wide form
        was the worker's peak memory (about 3 times VW's on 1.6 M libsvm rows) for no speed."""
        self.slices.keep_slices = False
        self.slices.ahead_limit = min(self.slices.ahead_limit, PARSE_AHEAD_BYTES)

    def forget(self) -> None:
        """Drop the parsed slices (the training keeps its own batches from here on); a later
        pass parses the file again. Finishes the current pass first, so the skipped lines are
        all counted (raises its DataError, if any)."""
        self.slices.forget()

    def batches(self, batch_size: int, skip: int = 0):
        """One pass over the part as batches of ``batch_size`` consecutive rows (the last may be
        shorter; then empty batches for ever), after skipping the first ``skip`` batches; the
        rows shuffled in windows first with ``shuffle_rows`` (:func:`shuffled`)."""
        blocks, to_skip = self.slices.epoch_blocks(), skip * batch_size
        if self.shuffle_rows:
            blocks = shuffled(blocks, self.shuffle_rows, self.shuffle_seed, to_skip, self.budget, self.path)
        else:
            blocks = _skip_rows(blocks, to_skip)
        yield from _pieces(blocks, batch_size)
        empty = _joined([])
        while True:
            yield empty


def _skip_rows(blocks, n: int):
    """``blocks`` (Datasets in order) less their first ``n`` rows."""
    for block in blocks:
        if n:
            cut = min(n, block.rows)
            n -= cut
            block = block.batch(cut, block.rows)
        yield block


def _pieces(blocks, n: int):
    """The rows of ``blocks`` (Datasets in order) as consecutive pieces of ``n`` rows, the last
    one shorter if the rows run out (:func:`_take`: views where a piece lies in one block)."""
    pending: list[Dataset] = []   # the rows not yet given, in order
    have = 0
    for block in blocks:
        if not block.rows:
            continue
        pending.append(block)
        have += block.rows
        while have >= n:
            piece, pending, have = _take(pending, n, have)
            yield piece
    if have:
        yield _take(pending, have, have)[0]


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
        pieces.append((b.labels, b.indptr, b.indices, b.values, b.weights))
        got += take
        i += 1
    last = pending[i - 1]
    used = take
    rest = ([last.batch(used, last.rows)] if used < last.rows else []) + pending[i:]
    return _joined(pieces), rest, have - n


def window_order(rows: int, window: int, seed: int, first: int = 0) -> np.ndarray:
    """The order of ``rows`` consecutive rows starting at row ``first`` (a multiple of
    ``window``) shuffled in windows: window ``k`` of the part (rows ``k * window`` on) is permuted
    by ``numpy.random.default_rng((seed, k))``, the last one by its own length."""
    out = np.empty(rows, dtype=np.int64)
    for lo in range(0, rows, window):
        n = min(window, rows - lo)
        out[lo:lo + n] = lo + np.random.default_rng((seed, (first + lo) // window)).permutation(n)
    return out


def shuffled(blocks, window: int, seed: int, skip_rows: int = 0, budget: float = 0.0, source: str = ""):
    """The rows of ``blocks`` (Datasets in order: a pass over a part) in windows of ``window``
    consecutive rows, each window's rows permuted (:func:`window_order`: the same order every
    pass, on every reader of the part), less the first ``skip_rows`` rows of the result (a
    resumed epoch: the windows before them are skipped unpermuted). A window is held whole: with a
    ``budget`` (bytes, ``data.memory_mb``) a window larger than it raises :class:`DataError`."""
    skip_whole, skip_in = divmod(skip_rows, window)
    for k, win in enumerate(_pieces(_skip_rows(blocks, skip_whole * window), window), skip_whole):
        if budget and win.nbytes > budget:
            raise DataError(f"{source}: data.shuffle_rows = {window}: a window of {win.rows} rows takes "
                            f"{win.nbytes / 2**20:.1f} MB here, more than data.memory_mb "
                            f"({budget / 2**20:g} MB); shuffle fewer rows or raise the budget")
        out = win.take_rows(window_order(win.rows, window, seed, k * window))
        yield out.batch(skip_in, out.rows) if skip_in else out
        skip_in = 0


class LoadedPart:
    """A part loaded whole (:func:`load_part`) behind the interface of :class:`PartStream`
    (its rows shuffled in windows as a stream's are, with ``shuffle_rows``)."""

    def __init__(self, ds: Dataset, shuffle_rows: int = 0, shuffle_seed: int = 0, warn_labels: bool = False):
        skipped = ds.skipped
        self.path, self.state = ds.source, ds.state
        self.labels = LabelWatch(ds.source, warn_labels)
        self.labels.see(ds)
        if shuffle_rows:
            ds = ds.take_rows(window_order(ds.rows, shuffle_rows, shuffle_seed))
        self.ds = ds
        self.rows_bound = ds.rows
        self.skipped = skipped

    def head_labels(self, n: int) -> np.ndarray:
        return self.ds.labels[:n]

    def check_unchanged(self) -> None:
        """As :meth:`PartStream.check_unchanged` (the part is in memory: a changed file would
        not be read again, but the job's record of its data would be wrong)."""
        if self.state is not None:
            check_part_unchanged(self.state)

    def batches(self, batch_size: int, skip: int = 0):
        lo = skip * batch_size
        while True:
            yield self.ds.batch(lo, lo + batch_size)
            lo += batch_size
