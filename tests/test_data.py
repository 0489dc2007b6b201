"""Data readers: byte ranges, errors naming file and line, the cache, the generator."""

import itertools
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcps.train import data, synth
from hpcps_kernels import parse
from shared_runs import writable


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=60), st.integers(1, 9))
def test_byte_ranges_cover_every_line_exactly_once(tmp_path_factory, lengths, parts):
    path = tmp_path_factory.mktemp("br") / "f.txt"
    lines = [b"x" * n for n in lengths]
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    got = []
    prev_end = 0
    for i in range(parts):
        start, end = data.byte_range(str(path), i, parts)
        assert start == prev_end and start <= end
        prev_end = end
        chunk = path.read_bytes()[start:end]
        assert chunk == b"" or chunk.endswith(b"\n")
        got += chunk.split(b"\n")[:-1]
    assert prev_end == path.stat().st_size
    assert got == lines


def test_a_stream_counts_its_lines_on_a_thread_and_knows_an_empty_part(tmp_path, monkeypatch):
    # the count runs beside the start-up; has_rows needs it only when the first slice is empty
    path = tmp_path / "two.svm"
    path.write_bytes(b"1 3:1\n\n0 4:1\n")
    whole = data.PartStream(str(path), 0, 1, binary=True).open()
    assert whole.has_rows and whole.rows_bound == 3  # lines, the blank one included
    sizes = [data.PartStream(str(path), i, 5, binary=True).open() for i in range(5)]
    empty = [s for s in sizes if all(p.start == p.end for p in s.pieces)]
    assert empty and all(not s.has_rows and s.rows_bound == 0 for s in empty)
    assert sum(s.rows_bound for s in sizes) == 3

    def unreadable(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(data, "rows_bound", unreadable)  # a count that fails is raised where it is read
    broken = data.PartStream(str(path), 0, 1, binary=True).open()
    assert broken.has_rows  # the first slice says so, without the count
    with pytest.raises(OSError, match="disk gone"):
        broken.rows_bound


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn")
    return synth.generate(str(d), 3000, 500, fields=10, seed=3, formats=("libsvm", "criteo", "vw"))


def test_libsvm_and_criteo_files_parse_to_the_same_rows(dataset):
    a = data.load_part(dataset.files["train_libsvm"], 0, 1)
    b = data.load_part(dataset.files["train_criteo"], 0, 1)
    for x, y in zip((a.labels, a.indptr, a.indices, a.values), (b.labels, b.indptr, b.indices, b.values)):
        np.testing.assert_array_equal(x, y)
    assert np.all(a.indices[a.indptr[1:] - 1] == data.BIAS_KEY)  # every row ends with the bias


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_parts_concatenate_to_the_whole_file(dataset, parts):
    whole = data.load_part(dataset.files["train_criteo"], 0, 1)
    pieces = [data.load_part(dataset.files["train_criteo"], i, parts) for i in range(parts)]
    np.testing.assert_array_equal(np.concatenate([p.labels for p in pieces]), whole.labels)
    np.testing.assert_array_equal(np.concatenate([p.indices for p in pieces]), whole.indices)


def test_error_names_the_line_number_in_the_file(dataset, tmp_path):
    lines = open(dataset.files["train_libsvm"], "rb").read().split(b"\n")
    lines[2500] = b"1 17:nan"
    path = tmp_path / "bad.svm"
    path.write_bytes(b"\n".join(lines))
    for parts in (1, 3):
        errors = []
        for i in range(parts):
            try:
                data.load_part(str(path), i, parts)
            except data.DataError as e:
                errors.append(str(e))
        assert errors == [f"{path}:2501: bad number: '1 17:nan'"]
    skipped = sum(data.load_part(str(path), i, 3, skip_bad=True).skipped for i in range(3))
    assert skipped == 1


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.load_part(str(tmp_path / "none.svm"), 0, 1)


def test_cache_returns_the_same_rows_without_parsing(dataset, tmp_path):
    a = data.load_part(dataset.files["train_criteo"], 1, 2, cache_dir=str(tmp_path))
    b = data.load_part(dataset.files["train_criteo"], 1, 2, cache_dir=str(tmp_path))
    assert isinstance(b.indices, np.memmap)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.labels, b.labels)


def test_vw_file_holds_the_same_features(dataset):
    first = open(dataset.files["train_vw"]).readline().split()
    a = data.load_part(dataset.files["train_libsvm"], 0, 1)
    keys = [int(t[1:]) for t in first[2:]]
    assert keys == a.indices[a.indptr[0]:a.indptr[1] - 1].tolist()
    assert (first[0] == "1") == (a.labels[0] == 1)


def test_generator_best_metrics_are_those_of_the_true_model(dataset):
    assert 0.5 < dataset.best_test_auc < 1 and 0 < dataset.best_test_logloss < 0.69


def test_generated_data_is_reused_while_its_parameters_and_files_stand(tmp_path):
    a = synth.generate(str(tmp_path), 300, 50, fields=10, seed=3, formats=("libsvm",))
    path = a.files["train_libsvm"]
    text, mtime = open(path, "rb").read(), os.stat(path).st_mtime_ns
    b = synth.generate(str(tmp_path), 300, 50, fields=10, seed=3, formats=("libsvm",))
    assert b.reused and not a.reused and b.files == a.files and os.stat(path).st_mtime_ns == mtime
    assert b.best_test_logloss == a.best_test_logloss
    c = synth.generate(str(tmp_path), 300, 50, fields=10, seed=3, formats=("libsvm", "vw"))  # a format more
    assert not c.reused and open(path, "rb").read() == text and os.path.isfile(c.files["train_vw"])
    with pytest.raises(synth.SynthError, match="seed 3, not 4"):  # another data set is never replaced unasked
        synth.generate(str(tmp_path), 300, 50, fields=10, seed=4, formats=("libsvm",))
    assert open(path, "rb").read() == text
    assert not synth.generate(str(tmp_path), 300, 50, fields=10, seed=4, formats=("libsvm",), overwrite=True).reused
    assert open(path, "rb").read() != text
    synth.generate(str(tmp_path), 300, 50, fields=10, seed=3, formats=("libsvm",), overwrite=True)
    with open(path, "r+b") as f:  # a file cut short (a copy interrupted) is written again
        f.truncate(1000)
    d = synth.generate(str(tmp_path), 300, 50, fields=10, seed=3, formats=("libsvm",))
    assert not d.reused and open(path, "rb").read() == text
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_keys_are_written_in_exact_decimal_up_to_two_to_the_64():
    from hpcps_kernels import textgen

    keys = np.array([[2**53 + 1, 2**63 + 12345, 2**64 - 1, 0, 10**19, 7]], dtype=np.uint64)
    buf = np.zeros(200, np.uint8)
    n = textgen.write_libsvm(np.array([1.0], np.float32), keys, np.ones(keys.shape, bool), 0, buf)
    assert bytes(buf[:n]).decode().split() == ["1", *[f"{int(k)}:1" for k in keys[0]]]


def test_ratings_are_in_range(tmp_path):
    out = synth.ratings(str(tmp_path), 500, 100)
    labels = parse.parse_libsvm(writable(open(out["train"], "rb").read()))[0]
    assert labels.min() >= 1 and labels.max() <= 5 and 0 < out["best_rmse"] < 1


def test_bias_key_is_the_documented_hash():
    from hpcps_kernels.hashing import feature_key

    assert int(data.BIAS_KEY) == feature_key(0xB1A5, "bias")


def test_parsing_in_small_blocks_gives_the_same_rows_and_line_numbers(dataset, tmp_path, monkeypatch):
    whole = data.load_part(dataset.files["train_criteo"], 0, 1)
    monkeypatch.setattr(data, "PARSE_BLOCK_BYTES", 777)  # many blocks, lines cut at every block edge
    for parts in (1, 3):
        pieces = [data.load_part(dataset.files["train_criteo"], i, parts) for i in range(parts)]
        np.testing.assert_array_equal(np.concatenate([p.indices for p in pieces]), whole.indices)
        np.testing.assert_array_equal(np.concatenate([p.labels for p in pieces]), whole.labels)
    lines = open(dataset.files["train_libsvm"], "rb").read().split(b"\n")
    lines[1234] = b"0 5:"
    path = tmp_path / "bad.svm"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(data.DataError, match=rf"^{path}:1235: bad number"):
        for i in range(3):
            data.load_part(str(path), i, 3)


# -- streaming: batches while the next block parses in the background ---------------------------------

@pytest.mark.parametrize("thread", [False, True], ids=["pumped", "parse_thread"])
@pytest.mark.parametrize("block_bytes,memory_mb", [(1 << 12, 0), (1 << 14, 1.0), (1 << 30, 0)])
@pytest.mark.parametrize("fmt", ["libsvm", "criteo"])
def test_stream_batches_equal_the_loaded_part(dataset, fmt, block_bytes, memory_mb, thread):
    path = dataset.files[f"train_{fmt}"]
    whole = data.load_part(path, 1, 3, binary=True)
    stream = data.PartStream(path, 1, 3, binary=True, memory_mb=memory_mb, block_bytes=block_bytes).open()
    if thread:  # parsing ahead on its own thread (data.parse_thread): the same batches
        stream.start_thread()
    assert stream.has_rows and stream.rows_bound == whole.rows  # (counted on a thread)
    bs = 97
    steps = -(-whole.rows // bs)
    for epoch in range(2):  # kept blocks (memory_mb 0) or read again (a budget)
        for skip in (0, 5) if epoch == 0 else (0,):
            it = stream.batches(bs, skip=skip)
            for i in range(skip, steps + 2):
                b = next(it)
                ref = whole.batch(i * bs, (i + 1) * bs)
                np.testing.assert_array_equal(b.labels, ref.labels)
                np.testing.assert_array_equal(b.indptr, ref.indptr)
                np.testing.assert_array_equal(b.indices, ref.indices)
                np.testing.assert_array_equal(b.values, ref.values)
            it.close()
    stream.stop_thread()
    assert (stream.kept is not None) == (memory_mb == 0)


@pytest.mark.parametrize("thread", [False, True], ids=["pumped", "parse_thread"])
@pytest.mark.parametrize("block_bytes,memory_mb", [(1 << 12, 0), (1 << 14, 4.0), (1 << 30, 0)])
def test_a_shuffled_stream_is_the_loaded_part_shuffled_in_the_same_windows(dataset, block_bytes, memory_mb, thread):
    """data.shuffle_rows: each window of 250 consecutive rows permuted, the same order every pass
    and whichever reader (a stream in blocks of any size, within a budget or not; the part loaded
    whole), and a resumed pass (skipped batches, inside a window too) goes on in that order."""
    path = dataset.files["train_libsvm"]
    whole = data.load_part(path, 1, 3, binary=True)
    window, seed = 250, 7
    order = data.window_order(whole.rows, window, seed)
    for lo in range(0, whole.rows, window):
        assert sorted(order[lo:lo + window]) == list(range(lo, min(lo + window, whole.rows)))
    assert (order != np.arange(whole.rows)).mean() > 0.9
    assert not np.array_equal(order, data.window_order(whole.rows, window, seed + 1))
    loaded = data.LoadedPart(whole, window, seed).ds
    np.testing.assert_array_equal(loaded.labels, whole.labels[order])
    stream = data.PartStream(path, 1, 3, binary=True, memory_mb=memory_mb, block_bytes=block_bytes,
                             shuffle_rows=window, shuffle_seed=seed).open()
    if thread:
        stream.start_thread()
    np.testing.assert_array_equal(stream.head_labels(300), loaded.labels[:300])  # (the initial bias's rows)
    bs = 97
    steps = -(-whole.rows // bs)
    for epoch in range(2):
        for skip in (0, 5, 8) if epoch == 0 else (0,):  # 485 and 776 rows: inside windows 1 and 3
            it = stream.batches(bs, skip=skip)
            for i in range(skip, steps):
                b, ref = next(it), loaded.batch(i * bs, (i + 1) * bs)
                for name in ("labels", "indptr", "indices", "values"):
                    np.testing.assert_array_equal(getattr(b, name), getattr(ref, name))
            assert next(it).rows == 0
            it.close()
    stream.stop_thread()


def test_a_shuffle_window_over_the_memory_budget_is_one_clear_error(dataset):
    path = dataset.files["train_libsvm"]
    stream = data.PartStream(path, 0, 1, memory_mb=0.05, block_bytes=1 << 12, shuffle_rows=2000).open()
    with pytest.raises(data.DataError, match=r"train.svm: data.shuffle_rows = 2000: a window of 2000 rows takes "
                                             r"[\d.]+ MB here, more than data.memory_mb \(0.05 MB\)"):
        next(stream.batches(100))


def test_a_compacted_batch_keeps_its_keys_as_unique_keys_and_int32_positions(dataset):
    from hpcps_kernels import keys as kkeys
    whole = data.load_part(dataset.files["train_criteo"], 0, 1, binary=True)
    b = whole.batch(100, 400)
    indices = b.indices.copy()
    before = b.nbytes
    uniq, pos = b.compact(*kkeys.dedup_keys(b.indices))
    assert b.indices is None and pos.dtype == np.int32
    np.testing.assert_array_equal(uniq[pos], indices)
    kept_uniq, kept_pos = b.prepared  # the compact form widened: the same pair
    assert kept_uniq.dtype == np.uint64 and kept_pos.dtype == np.int32
    np.testing.assert_array_equal(kept_uniq, uniq)
    np.testing.assert_array_equal(kept_pos, pos)
    assert b.compacted.keys.dtype == np.uint32 and b.compacted.pos.dtype == np.uint16  # 24 bits, < 65,536 keys
    assert (b.values == 1).all() and b.values.base is data.ones(1).base  # Criteo's ones: one shared array
    assert b.nbytes == b.labels.nbytes + b.indptr.nbytes + b.compacted.nbytes < before
    c = whole.batch(0, 50)  # values other than 1 stay
    values = np.linspace(0.5, 2.0, c.values.shape[0]).astype(np.float32)
    c = data.Dataset(c.labels, c.indptr, c.indices, values.copy())
    c.compact(*kkeys.dedup_keys(c.indices))
    np.testing.assert_array_equal(c.values, values)


def test_a_stream_keeping_no_slices_parses_again_and_forgets(dataset):
    path = dataset.files["train_criteo"]
    whole = data.load_part(path, 0, 1, binary=True)
    stream = data.PartStream(path, 0, 1, binary=True, block_bytes=1 << 13).open()
    stream.keep_no_slices()
    for epoch in range(2):  # nothing kept: each pass parses the file again, the same rows
        got = list(itertools.islice(stream.batches(64), -(-whole.rows // 64)))
        np.testing.assert_array_equal(np.concatenate([b.indices for b in got]), whole.indices)
        assert stream.kept is None
    stream.forget()
    assert stream._pass is None


def test_pumps_parse_ahead_within_half_the_budget_and_batches_are_unchanged(dataset):
    path = dataset.files["train_criteo"]
    whole = data.load_part(path, 0, 1, binary=True)
    stream = data.PartStream(path, 0, 1, binary=True, memory_mb=0.25, block_bytes=1 << 13).open()
    it = stream.batches(50)
    got = [next(it)]
    assert stream.pump() is True  # a pass is under way: there is more to parse
    while stream.pump():
        pass
    block = max(b.nbytes for b in stream._pass.ahead)
    assert stream.ahead_limit <= stream._pass.ahead_bytes <= stream.ahead_limit + block
    got += [next(it) for _ in range(-(-whole.rows // 50) - 1)]
    rows = np.concatenate([b.labels for b in got])
    np.testing.assert_array_equal(rows, whole.labels)
    np.testing.assert_array_equal(np.concatenate([b.indices for b in got]), whole.indices)


def test_a_bad_line_met_by_a_pump_is_raised_when_the_training_reaches_it(dataset, tmp_path):
    lines = open(dataset.files["train_libsvm"], "rb").read().splitlines(keepends=True)
    lines[1500] = b"1 4:zz\n"
    path = tmp_path / "bad.svm"
    path.write_bytes(b"".join(lines))
    stream = data.PartStream(str(path), 0, 1, block_bytes=1 << 14).open()
    it = stream.batches(100)
    first = next(it)
    while stream.pump():  # never raises: the error waits for the rows before it to be trained
        pass
    rows = first.rows
    with pytest.raises(data.DataError, match=rf"{path}:1501: bad number"):
        while True:
            rows += next(it).rows
    assert 1000 < rows <= 1500  # the rows before the bad line's slice were all trained


@pytest.mark.parametrize("thread", [False, True], ids=["pumped", "parse_thread"])
def test_a_bad_line_in_a_later_block_stops_the_stream_naming_it(dataset, tmp_path, thread):
    lines = open(dataset.files["train_libsvm"], "rb").read().splitlines(keepends=True)
    lines[1500] = b"1 4:zz\n"
    path = tmp_path / "bad.svm"
    path.write_bytes(b"".join(lines))
    stream = data.PartStream(str(path), 0, 1, block_bytes=1 << 14).open()  # the first block is fine
    if thread:
        stream.start_thread()
    rows = 0
    with pytest.raises(data.DataError, match=rf"{path}:1501: bad number"):
        for b in stream.batches(100):
            rows += b.rows
    assert 1000 < rows <= 1500  # the rows before the bad line's slice, all of them
    stream.stop_thread()


def test_a_parse_thread_parses_ahead_within_half_the_budget(dataset):
    """data.parse_thread: the thread parses while the training is elsewhere, stops at half the
    budget (plus the slice that crossed it), and goes on as the training takes slices."""
    path = dataset.files["train_criteo"]
    whole = data.load_part(path, 0, 1, binary=True)
    stream = data.PartStream(path, 0, 1, binary=True, memory_mb=0.25, block_bytes=1 << 13).open()
    stream.start_thread()
    it = stream.batches(50)
    got = [next(it)]
    p = stream._pass
    deadline = time.monotonic() + 30
    while p.ahead_bytes < stream.ahead_limit and not p.done:  # the thread fills the budget by itself
        assert time.monotonic() < deadline, (p.ahead_bytes, stream.ahead_limit)
        time.sleep(0.01)
    time.sleep(0.2)  # and then stops
    block = max(b.nbytes for b in p.ahead)
    assert stream.ahead_limit <= p.ahead_bytes <= stream.ahead_limit + block
    got += [next(it) for _ in range(-(-whole.rows // 50) - 1)]
    stream.stop_thread()
    np.testing.assert_array_equal(np.concatenate([b.labels for b in got]), whole.labels)
    np.testing.assert_array_equal(np.concatenate([b.indices for b in got]), whole.indices)
