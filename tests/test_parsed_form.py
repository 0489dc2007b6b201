"""The parsed form of a worker's rows: libsvm's one-pass reader of common lines, and the compact
form of the batches kept for later epochs, each checked to give exactly the rows of the general
path (bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcps_kernels import parse
from shared_runs import writable

LINES = [
    b"1 3:1 17:1 123456789:1",
    b"0 5:0.25 6:1e-3 7:-2",           # values other than 1
    b"1 00000000000000000042:1 9999999999999999999:1",  # 20 digits (the line reader), and 19 (masked)
    b"0 1:1 ",                          # a trailing blank
    b"1  2:1\t3:1",                     # runs of blanks and a tab
    b"# a comment",
    b"",
    b"1 4:1 # a comment after the features",
    b"0 qid:3 8:1",
    b"1.0 9:1",                          # a label of another form
    b"+1 10:1",
    b"1 11:1\r",                         # a CR
    b"0 12:1.5 13:1",
]


def _rows(text: bytes, **kw):
    return parse.parse_libsvm(np.frombuffer(text, np.uint8), bias=7, bits=24, **kw)


@pytest.mark.parametrize("binary", [False, True])
def test_common_libsvm_lines_parse_as_the_line_reader_reads_them(binary):
    rng = np.random.default_rng(3)
    lines = [LINES[i] for i in rng.integers(0, len(LINES), 400)]
    text = b"\n".join(lines) + b"\n"
    # a blank before each line: no line is of the common shape, the line reader reads them all
    general = b"\n".join(b" " + ln for ln in lines) + b"\n"
    fast, slow = _rows(text, binary=binary), _rows(general, binary=binary)
    for a, b in zip(fast[:4], slow[:4]):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert fast[0].shape[0] == 400 - sum(ln.startswith((b"#", b"\x00")) or not ln for ln in lines)


def test_a_zero_label_after_a_minus_one_is_still_an_error_in_a_common_line():
    with pytest.raises(parse.ParseError, match=r"^f\.svm:2: labels mix 0 and -1"):
        parse.parse_libsvm(b"-1 1:1\n0 2:1\n", source="f.svm", binary=True)  # (bytes, as a user may pass
        # them, and _rows' arrays are read-only: the parser's read-only variant, compiled here only)
    seen = np.zeros(2, np.int64)
    parse.parse_libsvm(writable(b"0 1:1\n1 2:1\n"), binary=True, seen=seen)  # (the common reader marks the 0)
    assert list(seen) == [1, 0]
    with pytest.raises(parse.ParseError, match="labels mix 0 and -1"):
        parse.parse_libsvm(writable(b"-1 1:1\n"), binary=True, seen=seen)


def test_a_last_line_without_its_newline_and_a_bad_line_in_a_run_of_common_ones():
    labels, indptr, indices, values, _ = _rows(b"1 1:1\n0 2:1")
    assert list(labels) == [1, 0] and list(indices) == [1, 7, 2, 7]
    with pytest.raises(parse.ParseError, match=r"^<bytes>:3: bad number"):
        _rows(b"1 1:1\n0 2:1\n1 3:x\n0 4:1\n")


def _compacted(indices: np.ndarray):
    from hpcps.train import data
    from hpcps_kernels import keys as kkeys

    rows = indices.shape[0]
    b = data.Dataset(np.zeros(rows, np.float32), np.arange(rows + 1, dtype=np.int64), indices.copy(),
                     np.ones(rows, np.float32))
    uniq, pos = b.compact(*kkeys.dedup_keys(indices))
    kept_uniq, kept_pos = b.prepared
    np.testing.assert_array_equal(kept_uniq[kept_pos], indices)  # every key back, exactly
    np.testing.assert_array_equal(kept_uniq, uniq)
    np.testing.assert_array_equal(kept_pos, pos)
    assert kept_uniq.dtype == np.uint64 and kept_pos.dtype == np.int32
    return b.compacted


def test_the_compact_form_of_24_bit_keys_and_the_bias_is_32_bit_keys_and_16_bit_positions():
    from hpcps.train.data import BIAS_KEY

    rng = np.random.default_rng(1)
    keys = np.concatenate([rng.integers(0, 2**24, 5000, dtype=np.uint64), [BIAS_KEY] * 100])
    c = _compacted(rng.permutation(keys))
    assert c.keys.dtype == np.uint32 and c.pos.dtype == np.uint16 and list(c.high) == [BIAS_KEY]


def test_a_batch_past_the_narrow_position_limit_keeps_int32_positions():
    keys = np.arange(70_000, dtype=np.uint64) * np.uint64(7)  # 70,000 unique keys > 65,536
    c = _compacted(np.concatenate([keys, keys[:10]]))
    assert c.pos.dtype == np.int32 and c.keys.dtype == np.uint32
    c = _compacted(np.arange(1 << 16, dtype=np.uint64))  # exactly 65,536: still narrow
    assert c.pos.dtype == np.uint16


def test_keys_of_more_than_32_bits_stay_64_bit_keys():
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 2**40, 3000, dtype=np.uint64)  # hash_bits 40: nearly all above 2**32
    c = _compacted(keys)
    assert c.keys.dtype == np.uint64 and c.high_at is None
    few = np.concatenate([rng.integers(0, 2**20, 3000, dtype=np.uint64), rng.integers(2**33, 2**40, 50, dtype=np.uint64)])
    c = _compacted(few)  # a few wide keys: apart, the rest narrow
    assert c.keys.dtype == np.uint32 and c.high.shape[0] == 50


@pytest.mark.parametrize("fmt", ["libsvm", "criteo", "vw"])
def test_the_compact_form_gives_back_every_batch_of_every_format_exactly(tmp_path, fmt):
    from hpcps.train import data, synth

    d = synth.generate(str(tmp_path), 3000, 10, fields=39, seed=4, hash_bits=24, formats=(fmt,))
    whole = data.load_part(d.files[f"train_{fmt}"], 0, 1, fmt, binary=True)
    for lo in range(0, whole.rows, 700):
        b = whole.batch(lo, lo + 700)
        c = _compacted(b.indices)
        assert c.keys.dtype == np.uint32 and c.pos.dtype == np.uint16


def test_a_narrowed_batch_gives_a_step_the_same_row_offsets():
    from hpcps.train import data
    from hpcps_kernels import keys as kkeys

    rng = np.random.default_rng(5)
    for longest in (200, 300, 70_000):  # uint8, uint16 lengths; past 65,535 the offsets stay
        lengths = rng.integers(0, longest, 50)
        lengths[7] = longest
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        nnz = int(indptr[-1])
        b = data.Dataset(np.zeros(50, np.float32), indptr.copy(), np.arange(nnz, dtype=np.uint64) % 977,
                         np.ones(nnz, np.float32))
        b.compact(*kkeys.dedup_keys(b.indices))
        before = b.nbytes
        b.narrow_rows()
        step = b.for_a_step()
        np.testing.assert_array_equal(step.indptr, indptr)
        assert step.indptr.dtype == np.int64 and step.prepared[0].shape == b.prepared[0].shape
        if longest <= 0xFFFF:
            assert b.indptr is None and b.row_lengths.dtype == (np.uint8 if longest <= 255 else np.uint16)
            assert b.nbytes < before
        else:
            assert step is b


def test_a_kept_pair_of_batches_probes_its_keys_once_and_gives_the_same_mask_after():
    from hpcps.train import data
    from hpcps_kernels import keys as kkeys

    rng = np.random.default_rng(6)
    a, b, c = (_compacted(rng.integers(0, 5000, 4000, dtype=np.uint64)) for _ in range(3))
    ua, ub, uc = a.wide()[0], b.wide()[0], c.wide()[0]
    calls = []

    def mask_of(following):
        calls.append(1)
        return kkeys.member_mask(ua, following)

    first = a.in_pull(b, lambda: mask_of(ub))
    np.testing.assert_array_equal(first, np.isin(ua, ub))
    again = a.in_pull(b, lambda: mask_of(ub))  # the next epoch: the same pair, from its bits
    assert len(calls) == 1 and again.dtype == np.bool_
    np.testing.assert_array_equal(again, first)
    other = a.in_pull(c, lambda: mask_of(uc))  # another batch after it: probed again
    assert len(calls) == 2
    np.testing.assert_array_equal(other, np.isin(ua, uc))
    assert a.nbytes == data.CompactKeys(*a.wide()).nbytes + a.in_next[1].nbytes


def test_values_of_shared_ones_are_read_as_none_and_a_criteo_batch_across_blocks_keeps_them():
    from hpcps.train import data

    assert data.values_if_any(parse.ones(10)) is None and data.values_if_any(data.ones(10)[2:]) is None
    own = np.ones(10, np.float32)
    assert data.values_if_any(own) is own  # ones of its own: read as they are (the same figures)
    labels, indptr, idx, values, _ = parse.parse_criteo(b"1\t5" + b"\t" * 38 + b"\n", bits=24)
    piece = data.Dataset(labels, indptr, idx, values)
    joined = data.concatenate([piece, piece])  # (a batch across two parsed blocks)
    assert joined.values.shape[0] == 2 * idx.shape[0] and data.values_if_any(joined.values) is None
    np.testing.assert_array_equal(joined.indices, np.concatenate([idx, idx]))


def test_a_libsvm_stream_of_ones_shares_them_other_values_stay_and_views_outlive_the_shared_array(tmp_path):
    from hpcps.train import data

    (tmp_path / "ones.svm").write_text("1 3:1 7:1\n0 2:1\n")
    (tmp_path / "values.svm").write_text("1 3:1 7:0.5\n0 2:1\n")
    ones, other = (next(data.PartStream(str(tmp_path / name), 0, 1, "libsvm", binary=True).open().batches(2))
                   for name in ("ones.svm", "values.svm"))
    assert data.values_if_any(ones.values) is None and ones.values.shape[0] == 5 and (ones.values == 1).all()
    assert data.values_if_any(other.values) is other.values and other.values[1] == np.float32(0.5)
    earlier = parse.ones(4)
    parse.ones(parse.ones_base().shape[0] + 1)  # the shared array grows: a view of the one before still reads as ones
    assert earlier.base is not parse.ones_base() and data.values_if_any(earlier) is None


def test_a_test_set_kept_for_scoring_holds_each_batch_sorted_keys_once(tmp_path):
    from hpcps.train import data, evaluation, synth

    d = synth.generate(str(tmp_path), 10, 2500, fields=39, seed=4, hash_bits=24, formats=("libsvm",))
    whole = data.load_part(d.files["test_libsvm"], 0, 1, "libsvm", binary=True)
    want = [whole.batch(lo, lo + 1000) for lo in range(0, whole.rows, 1000)]
    kept = evaluation.KeptTestSet(whole, 1000)
    assert kept.rows == whole.rows == 2500 and kept.labels is whole.labels and len(kept.batches) == 3
    for lo, w in zip(range(0, whole.rows, 1000), want):
        b = kept.batch(lo, lo + 1000)
        uniq, pos = b.prepared
        np.testing.assert_array_equal(uniq, np.unique(w.indices))  # (what a pull of the batch asks for)
        np.testing.assert_array_equal(uniq[pos], w.indices)
        np.testing.assert_array_equal(b.indptr, w.indptr)
        assert b.compacted.pos.dtype == np.uint16 and data.values_if_any(b.values) is None
    with pytest.raises(ValueError, match="not a batch"):
        kept.batch(500, 1500)
