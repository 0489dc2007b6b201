"""Parquet files and CSV files with a header, read through pyarrow (the ``parquet`` extra).

A table's columns are named in ``[data]``: ``label_column``, ``weight_column`` ("" = every row's
weight 1) and ``feature_columns`` (comma-separated; "" = every other column). A row's features,
in the order of ``feature_columns`` (else the table's), each column ``c`` being its position in
the file's columns (from 0):

* a floating-point column: key ``c``, its value (a libsvm ``c:value``);
* any other column (strings, integers, booleans: categorical, as Avazu's ids): key
  ``xxh64(str(value) as UTF-8, seed=c)`` masked to ``data.hash_bits``, value 1 (as Criteo's
  categorical columns are hashed per field);
* a null is no feature.

Then the bias feature, as in every format. For the fielded models (FFM, W&D, DeepFM) a key
carries its column's position among the feature columns above the hash bits, as libffm's. Which worker reads what: with at least as many files
as workers, whole files (as the text formats); else the rows of the files taken end to end, cut
in equal ranges (of a Parquet file, only the row groups that hold a worker's rows are read, one
at a time). A :class:`~hpcps.train.inputs.Piece` of a table is rows ``[start, end)`` of its
file, with ``compression`` :data:`TABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcps.train.inputs import DataError, Piece, check_file, data_files
from hpcps_kernels.hashing import xxh64

FORMATS = ("parquet", "csv")
PARQUET_MAGIC = b"PAR1"
TABLE = "table"  # the Piece.compression of rows of a table
BLOCK_ROWS = 1 << 16  # rows converted at a time


@dataclass(frozen=True)
class Columns:
    """The columns ``[data]`` names: the label, the weight ("" = none), the features (() = the rest)."""

    label: str = "label"
    weight: str = ""
    features: tuple = ()

    @classmethod
    def of(cls, data) -> "Columns":
        """The columns of a config's ``[data]``."""
        return cls.named(data.label_column, data.weight_column, data.feature_columns)

    @classmethod
    def named(cls, label: str = "label", weight: str = "", features: str = "") -> "Columns":
        """The columns ``[data]``'s keys name (``features`` comma-separated)."""
        return cls(label, weight, tuple(n.strip() for n in features.split(",") if n.strip()))


def pyarrow_modules():
    """(pyarrow, pyarrow.parquet, pyarrow.csv); their absence is a :class:`DataError` saying what to install."""
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading Parquet and CSV needs pyarrow: pip install 'hpcps[parquet]'") from None
    return pyarrow, pyarrow.parquet, pyarrow.csv


def read(path: str, fmt: str):
    """The whole table of ``path`` (a DataError naming the file if it is not one)."""
    pa, pq, pcsv = pyarrow_modules()
    try:
        if fmt == "parquet":
            return pq.read_table(path)
        # (an empty field is a null, a missing value, in a string column as in the others)
        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(strings_can_be_null=True))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {path}: not a readable {fmt} file: {e}") from None


def rows_of(path: str, fmt: str) -> int:
    """The rows of the table ``path`` (a Parquet file's from its footer)."""
    if fmt == "parquet":
        pa, pq, _ = pyarrow_modules()
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data file {path}: not a readable parquet file: {e}") from None
    return read(path, fmt).num_rows


def part_of(spec, part: int, parts: int, fmt: str, key: str = "data", idle_ok: bool = False) -> list[Piece]:
    """The row ranges worker ``part`` of ``parts`` reads of the tables ``spec`` names."""
    files = data_files(spec, key)
    for f in files:
        check_file(f)
    n = len(files)
    if n >= parts:
        return [Piece(f, 0, rows_of(f, fmt), TABLE) for f in files[part * n // parts:(part + 1) * n // parts]]
    sizes = [rows_of(f, fmt) for f in files]
    total = sum(sizes)
    lo, hi = total * part // parts, total * (part + 1) // parts
    out, at = [], 0
    for f, size in zip(files, sizes):
        a, b = max(lo, at), min(hi, at + size)
        if b > a:
            out.append(Piece(f, a - at, b - at, TABLE))
        at += size
    if not out and not idle_ok and total:
        raise DataError(f"{key}: {files[0]}: {total} rows for {parts} workers: a worker would read none")
    return out or [Piece(files[0], 0, 0, TABLE)]


def blocks(piece: Piece, fmt: str, hash_bits: int, binary: bool, bias: int, columns: Columns,
           need_labels: bool = True, fields: bool = False):
    """Rows ``[start, end)`` of the table ``piece.path`` in blocks of :data:`BLOCK_ROWS`, as the
    text parsers yield them: ``(labels, indptr, indices, values, skipped, weights)``. ``fields``:
    a key carries its feature column's position among the feature columns above the hash bits (as
    libffm's ``field << bits | index``)."""
    if piece.end <= piece.start:
        return
    if fields and not 1 <= hash_bits <= 48:
        raise DataError(f"data file {piece.path}: keys with fields need data.hash_bits between 1 and 48 "
                        f"(got {hash_bits})")
    mask = np.uint64((1 << hash_bits) - 1) if hash_bits < 64 else np.uint64(2 ** 64 - 1)
    chosen = None
    for first, table in _row_ranges(piece, fmt):
        if chosen is None:
            names = table.column_names
            chosen = _columns(piece.path, names, columns, need_labels)
        for lo in range(0, table.num_rows, BLOCK_ROWS):
            yield _block(piece.path, table.slice(lo, BLOCK_ROWS), names, *chosen, mask, binary, bias,
                         hash_bits if fields else -1, first + lo)


def _row_ranges(piece: Piece, fmt: str):
    """``(first row's index in the file, table)`` of rows ``[start, end)`` of ``piece.path``, in
    order: of a Parquet file, one a row group that holds some (the other row groups are not read),
    of a CSV file the whole range."""
    if fmt != "parquet":
        yield piece.start, read(piece.path, fmt).slice(piece.start, piece.end - piece.start)
        return
    pa, pq, _ = pyarrow_modules()
    try:
        f = pq.ParquetFile(piece.path)
        at = 0
        for g in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            a, b = max(piece.start, at), min(piece.end, at + n)
            if b > a:
                yield a, f.read_row_group(g).slice(a - at, b - a)
            at += n
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {piece.path}: not a readable parquet file: {e}") from None


def _columns(path: str, names: list, columns: Columns, need_labels: bool):
    """(label, weight, features) of a table with columns ``names``: names, a missing one an error naming it."""
    missing = [c for c in (columns.label if need_labels else "", columns.weight, *columns.features)
               if c and c not in names]
    if missing:
        raise DataError(f"data file {path}: no column {missing[0]!r} (data.label_column, data.weight_column or "
                        f"data.feature_columns); its columns: {', '.join(names)}")
    label = columns.label if columns.label in names else ""
    features = columns.features or tuple(n for n in names if n not in (columns.label, columns.weight))
    return label, columns.weight, features


def _block(path, t, names, label, weight, features, mask, binary, bias, shift, first=0):
    """One block of a table's rows in CSR, with the bias key last in each row (``shift`` >= 0: each
    key with its feature column's position above that bit; ``first``: the block's first row's
    index in the file, for errors)."""
    pa = pyarrow_modules()[0]
    rows = t.num_rows
    labels = _floats(t.column(label), path, label) if label else np.zeros(rows, np.float32)
    if binary and label:
        if not np.isin(labels, (0, 1, -1)).all():
            bad = labels[~np.isin(labels, (0, 1, -1))][0]
            raise DataError(f"data file {path}: column {label!r}: label {bad:g} for the logistic loss "
                            f"(expected 0/1 or -1/+1)")
        labels = np.where(labels == -1, np.float32(0), labels).astype(np.float32)
    keys, vals, present = [], [], []
    for field, name in enumerate(features):
        c = names.index(name)
        col = t.column(name)
        if pa.types.is_nested(col.type):
            raise DataError(f"data file {path}: column {name!r} holds {col.type} values: a feature column holds "
                            f"one number or one category a row (leave it out with data.feature_columns)")
        if pa.types.is_floating(col.type):
            v = col.to_numpy(zero_copy_only=False).astype(np.float32)
            _finite_or_missing(v, path, name, first)
            keys.append(np.full(rows, np.uint64(c) & mask, np.uint64))
            vals.append(v)
            present.append(~np.isnan(v) & np.asarray(col.is_valid()))
        else:
            keys.append(_hashed(col, c, mask))
            vals.append(np.ones(rows, np.float32))
            present.append(np.asarray(col.is_valid()))
        if shift >= 0:
            keys[-1] |= np.uint64(field) << np.uint64(shift)
    keys.append(np.full(rows, np.uint64(bias), np.uint64))
    vals.append(np.ones(rows, np.float32))
    present.append(np.ones(rows, bool))
    k, v, p = np.stack(keys, 1), np.stack(vals, 1), np.stack(present, 1)  # (rows, features + 1), row-major
    indptr = np.zeros(rows + 1, np.int64)
    np.cumsum(p.sum(1), out=indptr[1:])
    weights = _floats(t.column(weight), path, weight) if weight else None
    if weights is not None and (weights < 0).any():
        raise DataError(f"data file {path}: column {weight!r}: weight {weights[weights < 0][0]:g} (a weight is a "
                        f"number >= 0)")
    return labels, indptr, k[p], v[p], 0, weights


def _finite_or_missing(values: np.ndarray, path: str, name: str, first: int) -> None:
    """A numeric feature's values as float32 are each a number or NaN (missing): an infinite one
    (or one past float32's range) is an error naming the column and the row (from 1, the header
    not counted), as a text format's ``index:inf`` names its line."""
    bad = np.isinf(values)
    if bad.any():
        row = int(np.argmax(bad))
        raise DataError(f"data file {path}: column {name!r}, row {first + row + 1}: value is infinite or "
                        f"past float32's range ({values[row]})")


def _floats(col, path: str, name: str) -> np.ndarray:
    """A label or weight column as float32; a null or non-number is an error naming the column."""
    pa = pyarrow_modules()[0]
    if col.null_count or not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)
                              or pa.types.is_boolean(col.type)):
        raise DataError(f"data file {path}: column {name!r} must hold numbers without nulls (it is {col.type}, "
                        f"{col.null_count} null(s))")
    out = col.to_numpy(zero_copy_only=False).astype(np.float32)
    if not np.isfinite(out).all():
        raise DataError(f"data file {path}: column {name!r} holds a value that is not finite")
    return out


def _hashed(col, c: int, mask) -> np.ndarray:
    """``xxh64(str(value) as UTF-8, seed=c) & mask`` of each value of a categorical column (each
    distinct value hashed once); nulls get 0 (and are left out by the caller)."""
    pa = pyarrow_modules()[0]
    enc = col.combine_chunks().dictionary_encode() if not isinstance(col, pa.Array) else col.dictionary_encode()
    words = enc.dictionary.to_pylist()
    table = np.zeros(len(words) + 1, np.uint64)
    for i, w in enumerate(words):
        b = np.frombuffer(key_text(w).encode(), np.uint8)
        table[i] = xxh64(b, 0, b.shape[0], np.uint64(c)) & mask
    idx = enc.indices.fill_null(len(words)).to_numpy(zero_copy_only=False).astype(np.int64)
    return table[idx]


def key_text(value) -> str:
    """The text a categorical value is hashed as: ``str(value)``, booleans as ``true``/``false``."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
