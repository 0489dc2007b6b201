"""Text parsing into CSR: libsvm/svmlight, libffm, Vowpal Wabbit text, and Criteo-format TSV
hashed into uint64 keys.

Every parser reads a uint8 array of whole lines (a chunk of a file) and fills preallocated arrays.
Its kernel is one loop over the lines (:func:`text_kernel`) around the format's line reader. The
kernels release the GIL, so a reader thread parses while the training thread runs. A malformed
line stops the parse with an error code and the line's number; with ``skip_bad`` it is skipped and
counted instead. The Python wrappers (:func:`parse_libsvm`, :func:`parse_libffm`,
:func:`parse_vw`, :func:`parse_criteo`) allocate, call the kernel and raise :class:`ParseError`
naming the source and line.

libsvm: ``label idx:val idx:val ... [# comment]``; indices are decimal integers taken as uint64
keys (not hashed); an optional ``qid:N`` is ignored; blank lines and ``#`` lines are skipped but
counted in the line numbers. Values and labels must be finite decimal numbers. With ``binary``
(the logistic loss) a label must be 0 or 1, or -1 or +1 (svmlight's convention, mapped to 0 and 1
as liblinear and Vowpal Wabbit do); any other label, or a file that mixes 0 and -1, is an error.

Criteo TSV: 40 tab-separated columns: label (0/1), 13 integer features, 26 categorical tokens;
empty columns are missing values (no feature). Keys (see :mod:`hpcps_kernels.hashing`):

* integer column ``i`` (0..12) with value ``v``: bucket ``b = v`` if ``v <= 2`` else
  ``floor(log(v)**2)`` (the log-squared bucketing of the Criteo competition's winners); key =
  ``xxh64(int64 b as 8 little-endian bytes, seed=i)``;
* categorical column ``j`` (0..25) with token ``t``: key = ``xxh64(t's bytes, seed=13 + j)``;

then ``key & mask``. Every value is 1.0.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
from numba import njit
from numba.extending import register_jitable

from .hashing import read64, xxh64, xxh64_u64

OK = 0
BAD_LABEL = 1
BAD_INDEX = 2
MISSING_COLON = 3
BAD_VALUE = 4
NOT_FINITE = 5
BAD_COLUMNS = 6
NOT_BINARY = 7
MIXED_LABELS = 8
BAD_WEIGHT = 9
NO_BAR = 10
BAD_FIELD = 11
NO_LABEL = 12
NO_WEIGHTS = 13
MESSAGES = {
    BAD_LABEL: "bad label",
    BAD_INDEX: "bad feature index (expected a non-negative integer below 2**64)",
    MISSING_COLON: "expected index:value",
    BAD_VALUE: "bad number",
    NOT_FINITE: "value is NaN or infinite",
    BAD_COLUMNS: "expected 40 tab-separated columns (label, 13 integers, 26 categories; 39 without the label, "
                 "41 with a weight after it)",
    NOT_BINARY: "label must be 0 or 1 (or -1 or +1) for the logistic loss",
    MIXED_LABELS: "labels mix 0 and -1: a file is either 0/1 or -1/+1 for the logistic loss",
    BAD_WEIGHT: "bad importance weight (a number >= 0 after the label) or a stray token before '|'",
    NO_BAR: "expected 'label [weight] [\'tag]|namespace features' (no '|')",
    BAD_FIELD: "expected field:index:value with a field id below 65536",
    NO_LABEL: "a row without a label: training and evaluation need labels (hpcps predict reads rows without them)",
    NO_WEIGHTS: "an importance weight other than 1, where the caller takes no weights (with_weights=False)",
}

SPACE, TAB, NL, CR, HASH, COLON, BAR, QUOTE = 32, 9, 10, 13, 35, 58, 124, 39


class ParseError(ValueError):
    """A malformed line; ``source`` and ``line`` (1-based) say where."""

    def __init__(self, source: str, line: int, reason: str, text: str = ""):
        self.source, self.line, self.reason, self.text = source, line, reason, text
        msg = f"{source}:{line}: {reason}"
        if text:
            msg += f": {text[:120]!r}"
        super().__init__(msg)


@njit(inline="always")
def _is_digit(c):
    return 48 <= c <= 57


# The helpers that the line readers call without inlining them are register_jitable functions,
# compiled into each kernel that calls them, not njit dispatchers of their own: a kernel made by
# text_kernel reaches them only through the reader it closes over, where the warm-up's check that
# every kernel is compiled (tests/test_warmup.py) does not follow its calls.

@register_jitable
def _parse_float(buf, i, end):
    """Parse a decimal float at ``buf[i:end]``; returns (value, next index, status)."""
    neg = False
    if i < end and (buf[i] == 45 or buf[i] == 43):  # - +
        neg = buf[i] == 45
        i += 1
    mant = 0
    digits = 0
    exp10 = 0
    start = i
    while i < end and _is_digit(buf[i]):
        if digits < 18:
            mant = mant * 10 + (buf[i] - 48)
            digits += 1 if (mant > 0) else 0
        else:
            exp10 += 1
        i += 1
    if i < end and buf[i] == 46:  # .
        i += 1
        while i < end and _is_digit(buf[i]):
            if digits < 18:
                mant = mant * 10 + (buf[i] - 48)
                digits += 1 if (mant > 0) else 0
                exp10 -= 1
            i += 1
    if i == start or (i == start + 1 and buf[start] == 46):
        return 0.0, i, BAD_VALUE
    if i < end and (buf[i] == 101 or buf[i] == 69):  # e E
        i += 1
        eneg = False
        if i < end and (buf[i] == 45 or buf[i] == 43):
            eneg = buf[i] == 45
            i += 1
        if i >= end or not _is_digit(buf[i]):
            return 0.0, i, BAD_VALUE
        e = 0
        while i < end and _is_digit(buf[i]):
            if e < 100000:
                e = e * 10 + (buf[i] - 48)
            i += 1
        exp10 += -e if eneg else e
    if mant == 0:
        v = 0.0
    elif exp10 >= 0:
        v = mant * (10.0 ** exp10) if exp10 < 400 else math.inf
    else:
        v = mant / (10.0 ** (-exp10)) if exp10 > -400 else 0.0
    if neg:
        v = -v
    if not math.isfinite(v) or abs(v) > 3.4028234663852886e38:  # also inf once stored as float32
        return v, i, NOT_FINITE
    return v, i, OK


@register_jitable
def _line_end(buf, i, n):
    while i < n and buf[i] != NL:
        i += 1
    return i


@njit(inline="always")
def _line_bounds(buf, i, n):
    """The line starting at ``i``: (its newline's index, the end of its text without a CR)."""
    end = _line_end(buf, i, n)
    stop = end
    if stop > i and buf[stop - 1] == CR:
        stop -= 1
    return end, stop


@njit(inline="always")
def _skip_blanks(buf, j, stop):
    while j < stop and (buf[j] == SPACE or buf[j] == TAB):
        j += 1
    return j


@njit(inline="always")
def _binary_label(lab, seen):
    """A logistic-loss label: (label stored, which of ``seen`` it marks (0: a 0, 1: a -1), status)."""
    if lab == -1.0:
        return 0.0, 1, MIXED_LABELS if seen[0] else OK
    if lab == 0.0:
        return 0.0, 0, MIXED_LABELS if seen[1] else OK
    if lab != 1.0:
        return lab, -1, NOT_BINARY
    return lab, -1, OK


@njit(inline="always")
def _ends_token(c, bar):
    """Whether byte ``c`` ends a token: a blank, or with ``bar`` (VW) also a ``|``."""
    return c == SPACE or c == TAB or (bar and c == BAR)


@njit(inline="always")
def _read_label(buf, j, stop, binary, seen, bar):
    """The label at ``buf[j]`` (libsvm, VW: a decimal number ending a token, see :func:`_ends_token`):
    (label, which of ``seen`` it marks with ``binary`` (see :func:`_binary_label`) or -1, the
    position after it, status)."""
    lab, j, st = _parse_float(buf, j, stop)
    which = -1
    status = OK
    if st != OK or (j < stop and not _ends_token(buf[j], bar)):
        status = BAD_LABEL if st != NOT_FINITE else NOT_FINITE
    elif binary:
        lab, which, status = _binary_label(lab, seen)
    return lab, which, j, status


@njit(inline="always")
def _parse_uint(buf, j, stop):
    """A decimal uint64 at ``buf[j]``: (value, position after it, ok: digits and no overflow).
    Up to 19 digits cannot pass 2**64 - 1, so only longer numbers (or leading zeros) are read
    again with the test for overflow on each digit."""
    key = np.uint64(0)
    start = j
    while j < stop and _is_digit(buf[j]):
        key = key * np.uint64(10) + np.uint64(buf[j] - 48)
        j += 1
    if j - start <= 19:
        return key, j, j > start
    key = np.uint64(0)
    overflow = False
    j = start
    while j < stop and _is_digit(buf[j]):
        d = np.uint64(buf[j] - 48)
        if key > np.uint64(1844674407370955161) or (key == np.uint64(1844674407370955161) and d > np.uint64(5)):
            overflow = True
        key = key * np.uint64(10) + d
        j += 1
    return key, j, not overflow


@njit(inline="always")
def _parse_value(buf, j, stop):
    """:func:`_parse_float` with the common value ``1`` (hashed features) read without a call."""
    if buf[j] == 49 and (j + 1 == stop or buf[j + 1] == SPACE or buf[j + 1] == TAB):
        return 1.0, j + 1, OK
    return _parse_float(buf, j, stop)


# -- the kernels: one loop over the lines, and a reader per format ---------------------------------
#
# A format's line reader, ``read_line(buf, i, n, indices, values, nnz, binary, seen, mask,
# field_shift)``, parses the line that starts at ``buf[i]``: its keys (and values) go to
# ``indices[nnz:]`` (``values[nnz:]``). It returns ``(end, status, label, which, row_nnz, weight)``:
# the index of the line's newline (``n`` for a last line without one), ``OK``, ``UNLABELED`` (a row
# without a label, label 0), ``BLANK`` (no row: a blank or comment line) or an error code, the
# label, which of ``seen`` the label marks (-1: none), where the row's keys end, and the row's
# importance weight (1 unless the line gives one). A format may also read runs of its common lines faster
# (``read_common_lines``, see :func:`_criteo_common_lines`). :func:`text_kernel` makes a kernel from
# them: the loop that counts lines, skips or reports bad ones and finishes each row, in one place.

BLANK = -1  # a line reader's status for a line without a row (never reported)
UNLABELED = -2  # a line reader's status for a row without a label (OK, or NO_LABEL where labels are needed)


@register_jitable(inline="always")
def _no_common_lines(buf, i, labels, weights, indptr, indices, values, rows, nnz, mask, with_bias, bias, field_shift,
                     binary, seen):
    return i, rows, nnz, 0


def text_kernel(name: str, read_line, read_common_lines=_no_common_lines, with_values: bool = True):
    """The parse kernel ``name(buf, labels, weights, indptr, indices, values, skip_bad, binary, seen,
    with_bias, bias, mask, field_shift, need_labels, weighted)`` of the format that ``read_line``
    reads (see above): the rows of the whole lines in ``buf`` into the preallocated CSR arrays, and
    each row's importance weight into ``weights``. Returns ``(rows, nnz, status, bad line index
    (0-based), lines skipped)``.

    ``need_labels``: a row without a label is an error (``NO_LABEL``; else its label is 0);
    ``weighted`` False: so is a weight other than 1 (``NO_WEIGHTS``).

    ``binary``: labels for the logistic loss, in {0, 1} or {-1, +1}, -1 stored as 0; ``seen``
    (int64[2]) says whether a label 0 / -1 was met, here or in an earlier chunk of the same file
    (updated). ``with_bias``: every row ends with the key ``bias`` (not masked), value 1. Keys are
    masked with ``mask``; ``field_shift >= 0``: a key carries its field above that bit (libffm,
    Criteo). ``with_values`` False: a format whose every value is 1 writes no values.

    ``read_line`` and ``read_common_lines`` must be register_jitable functions, not njit
    dispatchers: numba's disk cache keys a closure by its pickled cells, and a pickled dispatcher
    carries an id of its process, so a kernel closing over one would compile again in every process."""
    def kernel(buf, labels, weights, indptr, indices, values, skip_bad, binary, seen, with_bias, bias, mask,
               field_shift, need_labels, weighted):
        n = buf.shape[0]
        i = 0
        line = 0
        rows = 0
        nnz = 0
        skipped = 0
        indptr[0] = 0
        while i < n:
            i, rows, nnz, lines = read_common_lines(buf, i, labels, weights, indptr, indices, values, rows, nnz,
                                                    mask, with_bias, bias, field_shift, binary, seen)
            line += lines
            if i >= n:
                break
            end, status, lab, which, row_nnz, wt = read_line(buf, i, n, indices, values, nnz, binary, seen, mask,
                                                             field_shift)
            if status == UNLABELED:
                status = NO_LABEL if need_labels else OK
            if status == OK and wt != 1.0 and not weighted:
                status = NO_WEIGHTS
            if status == OK:
                if with_bias:
                    indices[row_nnz] = bias
                    if with_values:
                        values[row_nnz] = 1.0
                    row_nnz += 1
                labels[rows] = lab
                weights[rows] = wt
                rows += 1
                nnz = row_nnz
                indptr[rows] = nnz
                if which >= 0:
                    seen[which] = 1
            elif status != BLANK:
                if not skip_bad:
                    return rows, nnz, status, line, skipped
                skipped += 1
            i = end + 1
            line += 1
        return rows, nnz, OK, -1, skipped

    kernel.__name__ = kernel.__qualname__ = name
    return njit(cache=True, nogil=True)(kernel)


@register_jitable
def _starts_with_feature(buf, j, stop):
    """Whether the token at ``buf[j]`` holds a colon: a feature, where a libsvm line has its label
    (a row without one)."""
    while j < stop and buf[j] != SPACE and buf[j] != TAB:
        if buf[j] == COLON:
            return True
        j += 1
    return False


@register_jitable(inline="always")
def _libsvm_line(buf, i, n, indices, values, nnz, binary, seen, mask, field_shift):
    """A libsvm line, ``label idx:val ... [# comment]`` (``qid:N`` skipped); with ``field_shift >= 0``
    a libffm line, ``label field:index:value ...``, whose key is ``field << field_shift | (index &
    mask)`` (a field id is below 65536)."""
    # the line's end, and where a comment starts (one pass)
    end, comment = i, -1
    while end < n and buf[end] != NL:
        if buf[end] == HASH and comment < 0:
            comment = end
        end += 1
    stop = end
    if stop > i and buf[stop - 1] == CR:
        stop -= 1
    if comment >= 0:
        stop = comment
    j = _skip_blanks(buf, i, stop)
    if j >= stop:
        return end, BLANK, 0.0, -1, nnz, 1.0
    unlabeled = _starts_with_feature(buf, j, stop)
    if unlabeled:
        lab, which, status = 0.0, -1, OK
    else:
        lab, which, j, status = _read_label(buf, j, stop, binary, seen, False)
    row_nnz = nnz
    while status == OK:
        j = _skip_blanks(buf, j, stop)
        if j >= stop:
            break
        # qid:N is skipped
        if stop - j > 4 and buf[j] == 113 and buf[j + 1] == 105 and buf[j + 2] == 100 and buf[j + 3] == COLON:
            j += 4
            while j < stop and buf[j] != SPACE and buf[j] != TAB:
                j += 1
            continue
        key, j, ok = _parse_uint(buf, j, stop)
        if not ok:
            status = BAD_FIELD if field_shift >= 0 else BAD_INDEX
            break
        if j >= stop or buf[j] != COLON:
            status = MISSING_COLON
            break
        j += 1
        if field_shift >= 0:  # libffm: that was the field; the index follows
            if key > np.uint64(65535):
                status = BAD_FIELD
                break
            field = key
            key, j, ok = _parse_uint(buf, j, stop)
            if not ok:
                status = BAD_INDEX
                break
            if j >= stop or buf[j] != COLON:
                status = BAD_FIELD
                break
            j += 1
            key = (key & mask) | (field << np.uint64(field_shift))
        else:
            key = key & mask
        if j >= stop:
            status = BAD_VALUE
            break
        v, j, st = _parse_value(buf, j, stop)
        if st != OK:
            status = st
            break
        if j < stop and buf[j] != SPACE and buf[j] != TAB:
            status = BAD_VALUE
            break
        indices[row_nnz] = key
        values[row_nnz] = v
        row_nnz += 1
    return end, UNLABELED if unlabeled and status == OK else status, lab, which, row_nnz, 1.0


@register_jitable(inline="always")
def _libsvm_common_lines(buf, i, labels, weights, indptr, indices, values, rows, nnz, mask, with_bias, bias,
                         field_shift, binary, seen):
    """Parse lines of the common libsvm shape from ``i`` on, as :func:`_libsvm_line` would, in one
    pass over their bytes: a label ``0`` or ``1``, then ``index:value`` pairs (an index of at most
    19 digits) each after one space, the last ending at a newline. Stops at the first line of any
    other kind (a comment, ``qid``, a CR, tabs or runs of blanks, a label of another form, a bad
    or last unfinished line), which the line reader reads. Returns ``(i, rows, nnz, lines)``.

    The general reader first finds the line's end and any comment, then reads the tokens: two
    passes, the second with a test for a comment's end and ``qid`` per token (half the speed)."""
    n, lines = buf.shape[0], 0
    if field_shift >= 0:  # libffm: the general reader
        return i, rows, nnz, 0
    i, rows, nnz = max(i, 0), max(rows, 0), max(nnz, 0)  # (known non-negative: no wrap-around tests)
    while i + 2 < n:
        c = buf[i]
        if not (c == 48 or c == 49) or buf[i + 1] != SPACE or (binary and c == 48 and seen[1]):
            break  # (a 0 after a -1: the reader says so)
        j = i + 2
        row_nnz = nnz
        ok = True
        while True:  # at an index's first digit
            start = j
            key = np.uint64(0)
            while j < n and _is_digit(buf[j]):
                key = key * np.uint64(10) + np.uint64(buf[j] - 48)
                j += 1
            if j == start or j - start > 19 or j + 1 >= n or buf[j] != COLON:
                ok = False
                break
            j += 1
            if buf[j] == 49 and (buf[j + 1] == SPACE or buf[j + 1] == NL):
                v = 1.0
                j += 1
            else:
                v, j, st = _parse_float(buf, j, n)
                if st != OK or j >= n or not (buf[j] == SPACE or buf[j] == NL):
                    ok = False
                    break
            indices[row_nnz] = key & mask
            values[row_nnz] = v
            row_nnz += 1
            if buf[j] == NL:
                break
            j += 1
            if j >= n or not _is_digit(buf[j]):  # a blank more, a comment, qid, a trailing blank
                ok = False
                break
        if not ok:
            break
        if with_bias:
            indices[row_nnz] = bias
            values[row_nnz] = 1.0
            row_nnz += 1
        labels[rows] = np.float32(c - 48)
        weights[rows] = 1.0
        if binary and c == 48:
            seen[0] = 1
        nnz = row_nnz
        rows += 1
        indptr[rows] = nnz
        lines += 1
        i = j + 1
    return i, rows, nnz, lines


libsvm_kernel = text_kernel("libsvm_kernel", _libsvm_line, _libsvm_common_lines)


@register_jitable(inline="always")
def _vw_line(buf, i, n, indices, values, nnz, binary, seen, mask, field_shift):
    """A Vowpal Wabbit text line: ``label [weight] ['tag]|ns[:scale] f[:v] ... |ns2 ...``.

    A feature's key is ``xxh64(name, seed=xxh64(namespace))`` masked with ``mask`` (the namespace's
    whole name, empty for ``| f``); its value is ``v`` (default 1) times the namespace's scale. The
    importance weight (default 1) is a finite number >= 0; a tag is ignored. A line that starts with
    ``|`` or a tag has no label."""
    end, stop = _line_bounds(buf, i, n)
    j = _skip_blanks(buf, i, stop)
    if j >= stop:
        return end, BLANK, 0.0, -1, nnz, 1.0
    unlabeled = buf[j] == BAR or buf[j] == QUOTE
    if unlabeled:
        lab, which, status = 0.0, -1, OK
    else:
        lab, which, j, status = _read_label(buf, j, stop, binary, seen, True)
    # before the first bar: an optional weight (after a label) and an optional 'tag
    n_before = 1 if unlabeled else 0
    weight = 1.0
    while status == OK:
        j = _skip_blanks(buf, j, stop)
        if j >= stop:
            status = NO_BAR
            break
        if buf[j] == BAR:
            break
        if buf[j] == QUOTE:
            while j < stop and not _ends_token(buf[j], True):
                j += 1
            continue
        weight, j, st = _parse_float(buf, j, stop)
        n_before += 1
        if st != OK or weight < 0.0 or n_before > 1 or (j < stop and not _ends_token(buf[j], True)):
            status = BAD_WEIGHT
    row_nnz = nnz
    seed = np.uint64(0)
    scale = 1.0
    while status == OK and j < stop:
        c = buf[j]
        if c == SPACE or c == TAB:
            j += 1
            continue
        if c == BAR:  # a namespace: |name[:scale]
            j += 1
            a = j
            while j < stop and not _ends_token(buf[j], True) and buf[j] != COLON:
                j += 1
            seed = xxh64(buf, a, j, np.uint64(0))
            scale = 1.0
            if j < stop and buf[j] == COLON:
                scale, j, st = _parse_float(buf, j + 1, stop)
                if st != OK or (j < stop and not _ends_token(buf[j], True)):
                    status = BAD_VALUE
            continue
        a = j
        while j < stop and not _ends_token(buf[j], True) and buf[j] != COLON:
            j += 1
        key = xxh64(buf, a, j, seed) & mask
        v = 1.0
        if j < stop and buf[j] == COLON:
            v, j, st = _parse_float(buf, j + 1, stop)
            if st != OK:
                status = st
                break
            if j < stop and not _ends_token(buf[j], True):
                status = BAD_VALUE
                break
        indices[row_nnz] = key
        values[row_nnz] = v * scale
        row_nnz += 1
    return end, UNLABELED if unlabeled and status == OK else status, lab, which, row_nnz, weight


vw_kernel = text_kernel("vw_kernel", _vw_line)


@register_jitable
def int_bucket(v):
    """A Criteo integer's bucket: ``v`` if ``v <= 2``, else ``floor(log(v)**2)``."""
    if v <= 2:
        return v
    lv = math.log(v)
    return np.int64(math.floor(lv * lv))


def _bucket_table(n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    for v in range(n):
        out[v] = v if v <= 2 else int(math.floor(math.log(v) ** 2))
    return out


# the bucket of every small integer (Criteo's counts are mostly small): a load instead of a log
_BUCKETS = _bucket_table(4096)


@njit(inline="always")
def _integer_bucket(v, neg, buckets):
    """The bucket of the integer column whose digits read ``v`` (``neg``: a minus before them)."""
    if neg:
        return -v
    if v < buckets.shape[0]:
        return buckets[v]
    return int_bucket(v)


# the bytes of a word: 0x01 and 0x80 in each, and a tab and a newline in each
_LOW_BITS, _HIGH_BITS = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_TABS, _NEWLINES = np.uint64(0x0909090909090909), np.uint64(0x0A0A0A0A0A0A0A0A)


@njit(inline="always")
def _tab_or_newline_in(w):
    """Nonzero when one of the 8 bytes of ``w`` is a tab or a newline (the zero-byte test on
    ``w ^ 0x0909...`` and ``w ^ 0x0A0A...``)."""
    x, y = w ^ _TABS, w ^ _NEWLINES
    return (((x - _LOW_BITS) & ~x) | ((y - _LOW_BITS) & ~y)) & _HIGH_BITS


@register_jitable
def _criteo_common_lines(buf, i, labels, weights, indptr, indices, values, rows, nnz, mask, with_bias, bias,
                         field_shift, binary, seen):
    """Parse lines of the common Criteo shape from ``i`` on, as :func:`_criteo_line` would: a
    label 0 or 1, 13 integer columns (empty or ``-?digits``), 26 categories, the last ending at a
    newline with no CR before it. Stops at the first line of any other kind (malformed, a CR,
    the file's last line without a newline, a blank line), which :func:`_criteo_line` then
    parses, so errors and odd lines (without a label, with a weight) keep its exact handling. Returns ``(i, rows, nnz, lines)``:
    where it stopped, the counts so far, and the lines it parsed.

    The same keys as :func:`_criteo_line`, faster: no search for each column's end nor a branch
    on the column's kind per column, and a category of 8 bytes is one word read, checked for a
    tab or newline in one test, with its end byte at a known place."""
    n, buckets, lines = buf.shape[0], _BUCKETS, 0
    # Known non-negative, the indices need no wrap-around test for negative values (numba's
    # indexing of a value that might be negative slowed the loop down by half)
    i, rows, nnz = max(i, 0), max(rows, 0), max(nnz, 0)
    while i < n:
        if i + 1 >= n or not (buf[i] == 48 or buf[i] == 49) or buf[i + 1] != TAB:
            break
        j = i + 2
        row_nnz = nnz
        ok = True
        for f in range(13):  # the integers: fields 0-12
            fbits = np.uint64(f) << np.uint64(field_shift) if field_shift >= 0 else np.uint64(0)
            if j >= n:
                ok = False
                break
            c = buf[j]
            if c == TAB:  # missing
                j += 1
                continue
            k = j + 1 if c == 45 else j
            start = k
            v = 0
            while k < n and _is_digit(buf[k]):
                if v < 10**17:
                    v = v * 10 + (buf[k] - 48)
                k += 1
            if k == start or k >= n or buf[k] != TAB:
                ok = False
                break
            bucket = _integer_bucket(v, c == 45, buckets)
            indices[row_nnz] = xxh64_u64(np.uint64(bucket), np.uint64(f)) & mask | fbits
            row_nnz += 1
            j = k + 1
        if not ok:
            break
        for f in range(13, 39):  # the categories: fields 13-38
            stop = TAB if f < 38 else NL
            fbits = np.uint64(f) << np.uint64(field_shift) if field_shift >= 0 else np.uint64(0)
            if j + 8 < n:
                w = read64(buf, j)
                if buf[j + 8] == stop and _tab_or_newline_in(w) == 0 and (f < 38 or buf[j + 7] != CR):
                    indices[row_nnz] = xxh64_u64(w, np.uint64(f)) & mask | fbits
                    row_nnz += 1
                    j += 9
                    continue
            a = j
            while j < n and buf[j] != TAB and buf[j] != NL:
                j += 1
            if j >= n or buf[j] != stop or (f == 38 and j > a and buf[j - 1] == CR):
                ok = False
                break
            if j > a:
                indices[row_nnz] = xxh64(buf, a, j, np.uint64(f)) & mask | fbits
                row_nnz += 1
            j += 1
        if not ok:
            break
        if with_bias:
            indices[row_nnz] = bias
            row_nnz += 1
        labels[rows] = np.float32(buf[i] - 48)
        weights[rows] = 1.0
        nnz = row_nnz
        rows += 1
        indptr[rows] = nnz
        lines += 1
        i = j
    return i, rows, nnz, lines


@register_jitable
def _criteo_columns(buf, i, n, indices, nnz, mask, field_shift, lead):
    """The columns of the Criteo line at ``buf[i]`` in one pass over its bytes, read with ``lead``
    columns before the 39 of the features: 0 (no label), 1 (the label) or 2 (the label and an
    importance weight). A column ends at a tab or at the line's end (a CR before the newline is
    not part of the line); keys as the module says. Returns ``(end, status, label, row_nnz,
    weight)``."""
    buckets = _BUCKETS
    status = OK
    row_nnz = nnz
    col = 0
    j = i
    lab = 0.0
    weight = 1.0
    eol = False
    while True:
        a = j
        c = np.uint8(0)
        while j < n:
            c = buf[j]
            if c == TAB or c == NL:
                break
            j += 1
        b = j
        if j >= n or c == NL:  # the line's last column (without a CR before the newline)
            eol = True
            if b > a and buf[b - 1] == CR:
                b -= 1
        f = col - lead  # the feature's column: fields 0-12 the integers, 13-38 the categories
        fbits = np.uint64(f) << np.uint64(field_shift) if field_shift >= 0 and f >= 0 else np.uint64(0)
        if f < 0 and col == 0:
            if b - a == 1 and (buf[a] == 48 or buf[a] == 49):
                lab = float(buf[a] - 48)
            else:
                status = BAD_LABEL
                break
        elif f < 0:
            weight, k, st = _parse_float(buf, a, b)
            if st != OK or k != b or weight < 0.0:
                status = BAD_WEIGHT
                break
        elif f <= 12:
            if b > a:
                neg = buf[a] == 45
                k = a + 1 if neg else a
                if k >= b:
                    status = BAD_VALUE
                    break
                v = 0
                while k < b and _is_digit(buf[k]):
                    if v < 10**17:
                        v = v * 10 + (buf[k] - 48)
                    k += 1
                if k != b:
                    status = BAD_VALUE
                    break
                bucket = _integer_bucket(v, neg, buckets)
                indices[row_nnz] = xxh64_u64(np.uint64(bucket), np.uint64(f)) & mask | fbits
                row_nnz += 1
        elif f <= 38:
            if b - a == 8:  # Criteo's categories: 8 hex digits, hashed as one 64-bit word
                indices[row_nnz] = xxh64_u64(read64(buf, a), np.uint64(f)) & mask | fbits
                row_nnz += 1
            elif b > a:
                indices[row_nnz] = xxh64(buf, a, b, np.uint64(f)) & mask | fbits
                row_nnz += 1
        else:
            status = BAD_COLUMNS
            break
        col += 1
        if eol:
            break
        j += 1  # skip the tab
    if status == OK and col != lead + 39:
        status = BAD_COLUMNS
    end = j if eol else _line_end(buf, j, n)  # after an error: the rest of the line
    return end, status, lab, row_nnz, weight


@register_jitable(inline="always")
def _criteo_line(buf, i, n, indices, values, nnz, binary, seen, mask, field_shift):
    """A Criteo TSV line (see :func:`_criteo_columns`): 40 columns, a label and the features; 39,
    the features of a row without a label (as Criteo's own test files); 41, a label, an importance
    weight (a number >= 0) and the features (the weight after the label, as in VW's ``label
    weight |...``). The line is read as 40 columns, and only when that fails as 39 or 41: the
    other counts cost a second read, and an error is that of the first."""
    c0 = buf[i]
    if c0 == NL or (c0 == CR and (i + 1 == n or buf[i + 1] == NL)):  # blank line
        return (i if c0 == NL else i + 1), BLANK, 0.0, -1, nnz, 1.0
    end, status, lab, row_nnz, weight = _criteo_columns(buf, i, n, indices, nnz, mask, field_shift, 1)
    if status != OK:
        for lead in (0, 2):
            e, st, lb, r, w = _criteo_columns(buf, i, n, indices, nnz, mask, field_shift, lead)
            if st == OK:
                return e, UNLABELED if lead == 0 else OK, lb, -1, r, w
    return end, status, lab, -1, row_nnz, weight


# Criteo's keys are hashed, every value is 1 (the wrapper returns shared ones)
criteo_kernel = text_kernel("criteo_kernel", _criteo_line, _criteo_common_lines, with_values=False)


@njit(cache=True, nogil=True)
def count_byte(buf, value):
    """How many times ``value`` occurs in ``buf`` (no temporary array)."""
    n = 0
    for i in range(buf.shape[0]):
        if buf[i] == value:
            n += 1
    return n


@njit(cache=True, nogil=True)
def count_bytes(buf, first, second):
    """How many times ``first`` and ``second`` occur in ``buf``: one pass for the two counts that
    bound a block's rows and keys."""
    a = 0
    b = 0
    for i in range(buf.shape[0]):
        c = buf[i]
        a += c == first
        b += c == second
    return a, b


_ONES = np.ones(0, dtype=np.float32)
_EARLIER_ONES: list = []  # weak references to the arrays _ONES was before it grew (views of them remain)


def ones(n: int) -> np.ndarray:
    """``n`` float32 ones: a view of one shared array (the values of a format whose every value is
    1, which would otherwise take 4 bytes per key of memory and bandwidth). Never written: the
    views are not flagged read-only only because numba would compile every kernel again for
    read-only arrays."""
    global _ONES
    if _ONES.shape[0] < n:
        _EARLIER_ONES[:] = [r for r in _EARLIER_ONES if r() is not None] + [weakref.ref(_ONES)]
        _ONES = np.ones(max(n, 2 * _ONES.shape[0]), dtype=np.float32)
    return _ONES[:n]


def ones_base() -> np.ndarray:
    """The array the views :func:`ones` gives now are views of."""
    return _ONES


def is_ones(values: np.ndarray) -> bool:
    """Whether ``values`` is a view :func:`ones` gave, now or before its shared array grew."""
    base = values.base
    return base is not None and (base is _ONES or any(r() is base for r in _EARLIER_ONES))


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.view(np.uint8).reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def _line_text(buf: np.ndarray, line: int) -> str:
    lines = bytes(buf).split(b"\n")
    return lines[line].decode(errors="replace") if line < len(lines) else ""


def _mask(bits: int) -> np.uint64:
    return np.uint64(2**bits - 1) if bits < 64 else np.uint64(2**64 - 1)


def parse_libsvm(data, *, source: str = "<bytes>", first_line: int = 1, skip_bad: bool = False,
                 binary: bool = False, seen: np.ndarray | None = None, bias: int | None = None, bits: int = 64,
                 need_labels: bool = True, with_weights: bool = False):
    """Parse libsvm text. Returns ``(labels f32, indptr i64, indices u64, values f32, skipped)``
    (views of arrays sized for the worst case: no copy); with ``with_weights``, then each row's
    importance weight (f32), or None when every row's is 1 (a libsvm line has none: VW and
    Criteo lines may).

    ``first_line`` is the number of the chunk's first line in its file (for error messages).
    ``binary``: labels for the logistic loss, {0, 1} or {-1, +1} (stored as 0/1); ``seen`` carries
    which of 0 and -1 earlier chunks of the same file had (int64[2], updated in place).
    ``bias``: a key appended to every row with value 1. Indices are reduced to ``bits`` bits (the
    bias key is not). ``need_labels`` False: a line may start with its first feature (a row to
    score, label 0); else that is an error naming the line.
    """
    buf = _as_bytes(data)
    newlines, colons = count_bytes(buf, NL, COLON)
    max_rows = int(newlines) + 1
    max_nnz = int(colons) + (max_rows if bias is not None else 0)
    return _parse_text(libsvm_kernel, buf, max_rows, max_nnz, source, first_line, skip_bad, binary, seen, bias, bits,
                       need_labels=need_labels, with_weights=with_weights)


def _parse_text(kernel, buf, max_rows, max_nnz, source, first_line, skip_bad, binary, seen, bias, bits,
                field_shift=-1, with_values=True, need_labels=True, with_weights=False):
    """Run a parse kernel (see :func:`text_kernel`) on ``buf`` into arrays of the given bounds."""
    labels = np.empty(max_rows, dtype=np.float32)
    weights = np.empty(max_rows, dtype=np.float32)
    indptr = np.empty(max_rows + 1, dtype=np.int64)
    indices = np.empty(max_nnz, dtype=np.uint64)
    values = np.empty(max_nnz if with_values else 0, dtype=np.float32)
    if seen is None:
        seen = np.zeros(2, dtype=np.int64)
    rows, nnz, status, bad, skipped = kernel(buf, labels, weights, indptr, indices, values, skip_bad, binary, seen,
                                             bias is not None, np.uint64(bias or 0), _mask(bits), field_shift,
                                             need_labels, with_weights)
    if status != OK:
        raise ParseError(source, first_line + bad, MESSAGES[status], _line_text(buf, bad))
    out = labels[:rows], indptr[: rows + 1], indices[:nnz], values[:nnz] if with_values else ones(nnz), int(skipped)
    if not with_weights:
        return out
    weights = weights[:rows]
    return (*out, None if (weights == 1.0).all() else weights)


def parse_libffm(data, *, source: str = "<bytes>", first_line: int = 1, skip_bad: bool = False,
                 binary: bool = False, seen: np.ndarray | None = None, bias: int | None = None, bits: int = 24,
                 need_labels: bool = True, with_weights: bool = False):
    """Parse libffm text, ``label field:index:value ...``: a key is ``field << bits | (index &
    mask)`` (so ``key >> bits`` is its field; ``bits`` at most 48). Otherwise as :func:`parse_libsvm`."""
    if not 1 <= bits <= 48:
        raise ValueError(f"libffm keys need hash bits between 1 and 48 to hold the field above them (got {bits})")
    buf = _as_bytes(data)
    newlines, colons = count_bytes(buf, NL, COLON)
    max_rows = int(newlines) + 1
    max_nnz = int(colons) // 2 + 1 + (max_rows if bias is not None else 0)
    return _parse_text(libsvm_kernel, buf, max_rows, max_nnz, source, first_line, skip_bad, binary, seen, bias,
                       bits, bits, need_labels=need_labels, with_weights=with_weights)


def parse_vw(data, *, source: str = "<bytes>", first_line: int = 1, skip_bad: bool = False,
             binary: bool = False, seen: np.ndarray | None = None, bias: int | None = None, bits: int = 64,
             need_labels: bool = True, with_weights: bool = False):
    """Parse Vowpal Wabbit text (see :func:`_vw_line`); arguments and result as
    :func:`parse_libsvm`. Without ``with_weights`` an importance weight other than 1 is an error."""
    buf = _as_bytes(data)
    max_rows = int(count_byte(buf, NL)) + 1
    max_nnz = int(count_byte(buf, SPACE)) + int(count_byte(buf, TAB)) + int(count_byte(buf, BAR)) + 2 * max_rows
    return _parse_text(vw_kernel, buf, max_rows, max_nnz, source, first_line, skip_bad, binary, seen, bias, bits,
                       need_labels=need_labels, with_weights=with_weights)


def parse_criteo(data, *, source: str = "<bytes>", first_line: int = 1, skip_bad: bool = False,
                 bits: int = 64, bias: int | None = None, fields: bool = False, need_labels: bool = True,
                 with_weights: bool = False):
    """Parse Criteo TSV. Returns ``(labels f32, indptr i64, indices u64, values f32, skipped)``
    (views, no copy); keys are reduced to ``bits`` bits; ``bias``: a key appended to every row.
    ``fields``: a key carries its column's field (0..38) above the ``bits`` (``key >> bits``).
    ``need_labels``, ``with_weights``: as :func:`parse_libsvm` (a line of 39 columns has no label,
    one of 41 a weight after its label: see :func:`_criteo_line`)."""
    if fields and not 1 <= bits <= 48:
        raise ValueError(f"Criteo keys with fields need hash bits between 1 and 48 (got {bits})")
    buf = _as_bytes(data)
    max_rows = int(count_byte(buf, NL)) + 1
    max_nnz = max_rows * (40 if bias is not None else 39)
    return _parse_text(criteo_kernel, buf, max_rows, max_nnz, source, first_line, skip_bad, False, None, bias, bits,
                       bits if fields else -1, with_values=False, need_labels=need_labels, with_weights=with_weights)


@njit(cache=True)
def append_feature(indptr, indices, values, key, value):
    """A copy of a CSR batch with ``key: value`` appended to every row."""
    rows = indptr.shape[0] - 1
    new_indptr = np.empty(rows + 1, dtype=np.int64)
    new_indices = np.empty(indices.shape[0] + rows, dtype=np.uint64)
    new_values = np.empty(indices.shape[0] + rows, dtype=np.float32)
    new_indptr[0] = 0
    o = 0
    for r in range(rows):
        for j in range(indptr[r], indptr[r + 1]):
            new_indices[o] = indices[j]
            new_values[o] = values[j]
            o += 1
        new_indices[o] = key
        new_values[o] = value
        o += 1
        new_indptr[r + 1] = o
    return new_indptr, new_indices, new_values
