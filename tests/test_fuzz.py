"""Fuzzing the readers: libsvm, Criteo TSV and TOML configs, fed mutated input.

Every case must end in a parsed row, a counted skip or a clear error naming file and line; never a
crash, a hang or a silently wrong row. Rows are checked against strict Python readers of the
documented grammars (below), so a row the kernel accepts but should not, or reads differently, fails.
The Criteo reader hashes with the xxHash project's C implementation (PyPI ``xxhash``), not the
kernels' own; most Criteo cases hold valid rows, and the tests count that they do.

The number of cases is set by ``HPCPS_FUZZ_EXAMPLES`` (default 300 per test; the closing note of
the reliability issue reports a run's count).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import resource
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcps import config
from hpcps.train import data as tdata
from hpcps.train import inputs
from hpcps_kernels import parse
from shared_runs import writable

EXAMPLES = int(os.environ.get("HPCPS_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
FLOAT = re.compile(rb"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
F32_MAX = 3.4028234663852886e38


# -- strict Python readers of the documented grammars --------------------------------------------

def _number(tok: bytes):
    if not FLOAT.fullmatch(tok):
        return None
    v = float(tok)
    return v if math.isfinite(v) and abs(v) <= F32_MAX else None


def libsvm_line(raw: bytes, binary: bool, seen: list):
    """None for a blank/comment line, "bad", or (label, [(index, value), ...])."""
    line = raw[:-1] if raw.endswith(b"\r") else raw
    line = line.split(b"#", 1)[0]
    body = line.lstrip(b" \t")
    if not body:
        return None
    toks = [t for t in re.split(rb"[ \t]+", body) if t]
    label = _number(toks[0])
    if label is None:
        return "bad"
    which = None
    if binary:
        if label == -1.0:
            which, label = 1, 0.0
        elif label == 0.0:
            which = 0
        elif label != 1.0:
            return "bad"
        if which is not None and seen[1 - which]:
            return "bad"
    feats = []
    pos = len(toks[0])
    rest = body[pos:]
    for tok in toks[1:]:
        at = rest.index(tok)
        if tok.startswith(b"qid:") and len(rest[at:]) > 4:
            rest = rest[at + len(tok):]
            continue
        rest = rest[at + len(tok):]
        if b":" not in tok:
            return "bad"
        k, v = tok.split(b":", 1)
        if not re.fullmatch(rb"\d+", k) or int(k) >= 2**64:
            return "bad"
        value = _number(v)
        if value is None:
            return "bad"
        feats.append((int(k), value))
    if which is not None:
        seen[which] = True
    return label, feats


def criteo_key(col: int, field: bytes) -> int:
    """The key of a non-empty Criteo column 1..39 as the format documents it (hpcps_kernels.parse),
    hashed by the xxHash project's own C implementation: an integer column's bucket (``v`` up to
    2, else ``floor(log(v)**2)``) as 8 little-endian bytes, a category's bytes; the seed is the
    column's index from 0."""
    if col <= 13:
        v = int(field)
        bucket = v if v <= 2 else math.floor(math.log(v) ** 2)
        field = bucket.to_bytes(8, "little", signed=True)
    return xxhash.xxh64_intdigest(field, seed=col - 1)


def criteo_line(raw: bytes):
    """None for a blank line, "bad", or (label, [key, ...]): label 0/1, 13 integer columns, 26
    categories (any bytes but a tab), tab-separated; an empty column is a missing value."""
    line = raw[:-1] if raw.endswith(b"\r") else raw
    if not line:
        return None
    cols = line.split(b"\t")
    if len(cols) != 40 or cols[0] not in (b"0", b"1"):
        return "bad"
    keys = []
    for c in range(1, 40):
        f = cols[c]
        if not f:
            continue
        if c <= 13:
            if not re.fullmatch(rb"-?\d+", f):
                return "bad"
            digits, v = f.lstrip(b"-"), 0
            for d in digits:  # the documented saturation: digits stop counting past 10**17
                if v < 10**17:
                    v = v * 10 + d - 48
            keys.append(criteo_key(c, str(-v if f.startswith(b"-") else v).encode()))
        else:
            keys.append(criteo_key(c, f))
    return float(cols[0]), keys


# -- input generators ----------------------------------------------------------------------------

SPECIAL = [b"nan", b"inf", b"-inf", b"1e999", b"-1e40", b"3.5e38", b"1e-999", b"0x10", b"1_0", b"", b" ",
           b"-1", b"+1", b"2", b"0.5", b"qid:3", b"qid:", b"#", b"\r", b"\xff\xfe", b"\xc3\x28", b":", b"1:",
           b":1", b"18446744073709551615:1", b"18446744073709551616:1", b"00012:1", b"1:1:1", b"\t", b"1.", b".5",
           b".", b"1e", b"1e+", b"-.5e-3", b"0000000000000000000000012:1", b"99999999999999999999:1",
           b"1844674407370955161:1", b"1#", b"1\r", b"7:1#x"]


@st.composite
def libsvm_text(draw):
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 9))
        if kind <= 4:  # a valid row, maybe mutated below
            label = draw(st.sampled_from([b"0", b"1", b"-1", b"+1", b"1.0", b"0.000", b"2", b"-3.25"]))
            feats = [b"%d:%s" % (draw(st.integers(0, 2**64 - 1)),
                                 draw(st.sampled_from([b"1", b"0.5", b"-2e-3", b"7", b"1e5", b".25"])))
                     for _ in range(draw(st.integers(0, 5)))]
            line = draw(st.sampled_from([b" ", b"\t", b"  "])).join([label, *feats])
        elif kind <= 6:
            line = b" ".join(draw(st.lists(st.sampled_from(SPECIAL), max_size=5)))
        elif kind == 7:
            line = draw(st.binary(max_size=30)).replace(b"\n", b"")
        elif kind == 8:
            line = b"# a comment" if draw(st.booleans()) else b""
        else:
            line = b"1 qid:7 3:1 # tail"
        if draw(st.booleans()) and line:  # mutate one byte
            i = draw(st.integers(0, len(line) - 1))
            line = line[:i] + bytes([draw(st.integers(0, 255))]).replace(b"\n", b"") + line[i + 1:]
        lines.append(line + (b"\r" if draw(st.integers(0, 5)) == 0 else b""))
    text = b"\n".join(lines)
    return text + (b"\n" if draw(st.booleans()) else b"")


def _expected(text: bytes, read_line, skip_bad: bool):
    """(rows the strict reader accepts, 1-based numbers of the lines it rejects), up to the first
    rejected line unless ``skip_bad``."""
    expect, bad = [], []
    for n, raw in enumerate(text.split(b"\n"), 1):
        r = read_line(raw)
        if r == "bad":
            bad.append(n)
        elif r is not None:
            expect.append(r)
        if bad and not skip_bad:
            break
    return expect, bad


def _check_libsvm(text: bytes, binary: bool, skip_bad: bool):
    seen = [False, False]
    expect, bad = _expected(text, lambda raw: libsvm_line(raw, binary, seen), skip_bad)
    try:
        labels, indptr, indices, values, skipped = parse.parse_libsvm(writable(text), source="f.svm", skip_bad=skip_bad,
                                                                      binary=binary)
    except parse.ParseError as e:
        assert not skip_bad and bad and e.line == bad[0], (text, bad, str(e))
        assert str(e).startswith(f"f.svm:{bad[0]}: ")
        return
    assert not bad or skip_bad, (text, bad)
    assert skipped == len(bad), (text, bad, skipped)
    assert len(labels) == len(expect), (text, expect, labels)
    for r, (label, feats) in enumerate(expect):
        assert labels[r] == np.float32(label)
        got = list(zip(indices[indptr[r]:indptr[r + 1]].tolist(), values[indptr[r]:indptr[r + 1]].tolist()))
        assert [k for k, _ in got] == [k for k, _ in feats], text
        np.testing.assert_allclose([v for _, v in got], np.float32([v for _, v in feats]), rtol=1e-6)


@FUZZ
@given(libsvm_text(), st.booleans(), st.booleans())
def test_libsvm_reader_on_mutated_input(text, binary, skip_bad):
    _check_libsvm(text, binary, skip_bad)


@FUZZ
@given(st.binary(max_size=200), st.booleans())
def test_libsvm_reader_on_random_bytes(text, binary):
    _check_libsvm(text, binary, skip_bad=False)
    _check_libsvm(text, binary, skip_bad=True)


def _criteo_fields(seed: int = 36) -> tuple[list[bytes], list[bytes]]:
    """Fields as the format allows them, drawn from once per field (cheaper for hypothesis than a
    strategy per field, and the rows stay short): integers small, around the bucket table's end
    (4,096), negative, with leading zeros and past the saturation (10**17); categories empty, of
    Criteo's 8 hex digits (read as one word), of other lengths, of any bytes but a tab or a newline
    (a CR too, and one at a field's end)."""
    rng = random.Random(seed)
    ints = [b"", b"0", b"1", b"2", b"3", b"-1", b"-5", b"4095", b"4096", b"4097", b"007", b"-0", b"00",
            b"99999999999999999", b"100000000000000000", b"123456789012345678901234567", b"-123456789012345678901"]
    ints += [str(rng.randint(-3, 10 ** rng.randint(1, 12))).encode() for _ in range(40)]
    other = bytes(b for b in range(256) if b not in b"\t\n")
    cats = [b"", b"\r", b"abc\r", b"1234567\r", b"12345678\r", b"\r2345678"]
    cats += [b"%08x" % rng.getrandbits(32) for _ in range(30)]
    cats += [bytes(rng.choice(other) for _ in range(rng.randint(1, 12))) for _ in range(30)]
    return ints, cats


CRITEO_INTS, CRITEO_CATS = _criteo_fields()
CRITEO_INT, CRITEO_CAT = st.sampled_from(CRITEO_INTS), st.sampled_from(CRITEO_CATS)
CRITEO_BAD_FIELD = [b"-", b"1a", b"99999999999999999999999x", b"+3", b" 4", b"1.5", b"0x1f"]


@st.composite
def criteo_row(draw):
    """A valid row (without its line end)."""
    return b"\t".join([draw(st.sampled_from([b"0", b"1"])), *(draw(CRITEO_INT) for _ in range(13)),
                       *(draw(CRITEO_CAT) for _ in range(26))])


@st.composite
def criteo_broken(draw):
    """A row made invalid, or maybe so (a changed byte): the reference reader decides."""
    cols = draw(criteo_row()).split(b"\t")
    how = draw(st.integers(0, 4))
    if how == 0:
        cols = cols[:draw(st.integers(0, 39))]
    elif how == 1:
        cols.append(draw(CRITEO_CAT))
    elif how == 2:
        cols[0] = draw(st.sampled_from([b"2", b"", b"x", b"00", b"1 "]))
    elif how == 3:
        cols[draw(st.integers(1, 13))] = draw(st.sampled_from(CRITEO_BAD_FIELD))
    line = b"\t".join(cols)
    if how == 4 and line:
        i = draw(st.integers(0, len(line) - 1))
        line = line[:i] + bytes([draw(st.integers(0, 255))]).replace(b"\n", b"") + line[i + 1:]
    return line


def criteo_lines(rows: list[bytes], draw) -> bytes:
    """``rows`` as lines: each ends in LF or CRLF, a blank line now and then, the last newline
    optional."""
    lines = []
    for row in rows:
        lines.append(row + (b"\r" if draw(st.integers(0, 5)) == 0 else b""))
        if draw(st.integers(0, 9)) == 0:
            lines.append(b"")
    return b"\n".join(lines) + (b"\n" if lines and draw(st.booleans()) else b"")


@st.composite
def criteo_text(draw):
    """Valid rows, in most cases all of them, else with one or two broken rows among them."""
    rows = [draw(criteo_row()) for _ in range(draw(st.integers(1, 8)))]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        rows[draw(st.integers(0, len(rows) - 1))] = draw(criteo_broken())
    return criteo_lines(rows, draw)


@st.composite
def bytes_among_criteo_rows(draw):
    """Random bytes (any number of lines) between valid rows."""
    before, after = draw(st.lists(criteo_row(), max_size=3)), draw(st.lists(criteo_row(), max_size=3))
    junk = draw(st.binary(max_size=300))
    return criteo_lines(before, draw) + (b"\n" if before else b"") + junk + b"\n" + criteo_lines(after, draw)


def _check_criteo(text: bytes, skip_bad: bool) -> int:
    """Parse ``text`` and compare every row with the reference reader's; returns the rows compared."""
    expect, bad = _expected(text, criteo_line, skip_bad)
    try:
        labels, indptr, indices, _, skipped = parse.parse_criteo(writable(text), source="day.tsv", skip_bad=skip_bad)
    except parse.ParseError as e:
        assert not skip_bad and bad and e.line == bad[0], (text, bad, str(e))
        return 0
    assert not bad or skip_bad, (text, bad)
    assert skipped == len(bad) and len(labels) == len(expect), (text, bad, expect)
    for r, (label, keys) in enumerate(expect):
        assert labels[r] == label and indices[indptr[r]:indptr[r + 1]].tolist() == keys, text
    return len(expect)


def _rows_and_lines(text: bytes) -> tuple[int, int]:
    """(valid rows, lines that are not blank) by the reference reader."""
    read = [criteo_line(raw) for raw in text.split(b"\n")]
    return sum(r not in (None, "bad") for r in read), sum(r is not None for r in read)


def test_criteo_reader_on_mutated_input():
    """Most cases hold valid rows, each compared with the reference reader's (counted here)."""
    tally = Counter()

    @FUZZ
    @given(criteo_text(), st.booleans())
    def case(text, skip_bad):
        compared = _check_criteo(text, skip_bad)
        valid, lines = _rows_and_lines(text)
        tally.update(cases=1, compared=compared, with_rows_compared=compared > 0, valid=valid, lines=lines)

    case()
    assert tally["with_rows_compared"] >= tally["cases"] / 2, tally
    assert tally["valid"] >= tally["lines"] / 2 and tally["compared"] >= tally["lines"] / 2, tally


def test_criteo_reader_on_random_bytes():
    """Random bytes alone, and between valid rows: every valid row (skipping the bad lines) is
    compared with the reference's, in at least half of the cases."""
    tally = Counter()

    @FUZZ
    @given(st.one_of(st.binary(max_size=300), bytes_among_criteo_rows()))
    def case(text):
        _check_criteo(text, False)
        tally.update(cases=1, with_rows_compared=_check_criteo(text, True) > 0)

    case()
    assert tally["with_rows_compared"] >= tally["cases"] / 2, tally


@contextlib.contextmanager
def _address_space_bounded(extra: int = 4 << 30):
    """The process's soft address-space limit at its size now + ``extra`` within the block: a
    generated file that made the loader take gigabytes fails its case (a MemoryError, the case
    shown) instead of the kernel killing the test process for memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit if soft == resource.RLIM_INFINITY else min(limit, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@settings(max_examples=max(EXAMPLES // 5, 20), deadline=None, suppress_health_check=list(HealthCheck))
@given(libsvm_text(), st.booleans())
def test_a_bad_line_in_a_file_names_the_file_and_its_line(tmp_path_factory, text, binary):
    """Through the data loader (a file on disk, several blocks): the line number is the file's.
    (A text that starts as a compressed stream's magic is read as one, which the compressed files'
    tests cover; a UTF-8 byte-order mark before the first line is no part of it, as for the loader.
    Hypothesis draws both, among the byte strings it finds in the code.)"""
    if text.startswith(tuple(magic for magic, *_ in inputs.COMPRESSED)):
        return
    path = tmp_path_factory.mktemp("fz") / "d.svm"
    path.write_bytes(text)
    text = text[len(inputs.BOM):] if text.startswith(inputs.BOM) else text
    try:
        with _address_space_bounded():
            ds = tdata.load_part(str(path), 0, 1, "libsvm", hash_bits=64, binary=binary)
    except tdata.DataError as e:
        m = re.match(rf"{re.escape(str(path))}:(\d+): ", str(e))
        assert m, str(e)
        seen = [False, False]
        first_bad = next(n for n, raw in enumerate(text.split(b"\n"), 1) if libsvm_line(raw, binary, seen) == "bad")
        assert int(m.group(1)) == first_bad
        return
    seen = [False, False]
    rows = [r for r in (libsvm_line(raw, binary, seen) for raw in text.split(b"\n")) if r is not None]
    assert "bad" not in rows and ds.rows == len(rows)


# -- TOML configs --------------------------------------------------------------------------------

VALID_TOML = b"""[cluster]
servers = 2
staleness = 1
[data]
hash_bits = 20
format = "libsvm"
[model]
type = "fm"
init_scale = 0.01
[optimizer]
name = "adagrad"
lr = 0.05
[train]
epochs = 3
progress = false
"""

values = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                   st.booleans(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
SECTION_NAMES = st.sampled_from(["cluster", "data", "synth", "model", "optimizer", "train", "checkpoint", "bogus"])
KEY_NAMES = st.sampled_from(["servers", "staleness", "hash_bits", "format", "type", "name", "lr", "alpha", "epochs",
                             "batch_size", "every_s", "keep", "init_scale", "fields", "progress", "dir", "x"])


def _load_or_config_error(raw: dict):
    try:
        cfg = config.from_dict(raw)
    except config.ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return None
    assert isinstance(cfg, config.Config)
    return cfg


def _real_keys(section: str) -> list[str]:
    if section == "optimizer":
        return ["name", "lr", "alpha", "beta", "l1", "l2", "eps", "beta1", "beta2", "initial_accumulator"]
    import dataclasses
    return [f.name for f in dataclasses.fields(config._SECTION_CLASSES[section])]


@st.composite
def config_dicts(draw):
    raw = {}
    for section in draw(st.lists(SECTION_NAMES, max_size=4, unique=True)):
        if section == "bogus" or draw(st.integers(0, 9)) == 0:
            raw[section] = draw(values)
            continue
        keys = st.sampled_from(_real_keys(section) + ["x"])
        raw[section] = draw(st.dictionaries(keys, values, max_size=4))
    return raw


@FUZZ
@given(st.dictionaries(SECTION_NAMES, st.one_of(values, st.dictionaries(KEY_NAMES, values, max_size=4)), max_size=4))
def test_config_from_any_nested_values_is_a_config_or_a_config_error(raw):
    _load_or_config_error(raw)


@FUZZ
@given(config_dicts())
def test_config_from_real_keys_with_any_values_is_a_config_or_a_config_error(raw):
    _load_or_config_error(raw)


@FUZZ
@given(st.integers(0, len(VALID_TOML) - 1), st.binary(min_size=0, max_size=4), st.integers(0, 3))
def test_mutated_toml_files_load_or_fail_with_the_file_named(tmp_path_factory, at, insert, cut):
    text = VALID_TOML[:at] + insert + VALID_TOML[at + cut:]
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_bytes(text)
    try:
        raw = config.load_raw(str(path), [])
    except config.ConfigError as e:
        assert str(path) in str(e)
        return
    _load_or_config_error(raw)


@FUZZ
@given(st.lists(st.text(max_size=20), max_size=3))
def test_any_set_override_is_applied_or_named(items):
    try:
        raw = config.load_raw(None, items)
    except config.ConfigError as e:
        assert "--set" in str(e)
        return
    _load_or_config_error(raw)


def test_the_fuzz_readers_accept_what_they_should():
    """The strict readers themselves: a valid line parses the same in both."""
    assert libsvm_line(b"-1 3:0.5 qid:2 7:1e2 # c", True, [False, False]) == (0.0, [(3, 0.5), (7, 100.0)])
    assert libsvm_line(b"1 1e2:1", False, [False, False]) == "bad"
    assert criteo_line(b"\t".join([b"1"] + [b""] * 39)) == (1.0, [])
    with pytest.raises(parse.ParseError):
        parse.parse_libsvm(writable(b"1 1:nan\n"))


@pytest.mark.parametrize("raw,match", [
    ({"optimizer": {"name": []}}, "optimizer.name = \\[\\]"),           # found by the fuzzer
    ({"optimizer": {"lr": 10**400, "name": "sgd"}}, "too large for a float"),
])
def test_config_values_the_fuzzer_found(raw, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(raw)
