"""Many files and compressed ones: a directory of part files, a glob, a list, gzip/zstd/bzip2/xz
streams; which worker reads what; the same rows give the same model bit for bit, and a gzipped
directory trained by 2 workers resumes exactly."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from hpcps.ps import checkpoint
from hpcps.train import data, inputs, synth
from hpcps.train.model_file import ServingModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_checkpoint import rank_pids  # noqa: E402
from test_faults import job, sets, start, wait_for  # noqa: E402
from test_fuzz import _address_space_bounded  # noqa: E402

COMPRESS = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}


def zstd_compress(text: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard", reason="the zstd extra (zstandard) is not installed")
    return zstandard.ZstdCompressor().compress(text)


def write_parts(directory, lines: list[bytes], parts: int, compress=None, suffix: str = "") -> list[str]:
    """``lines`` cut into ``parts`` part files in ``directory`` (as Spark writes them, with a
    ``_SUCCESS`` marker and a hidden checksum file beside them); their paths, in order."""
    os.makedirs(directory, exist_ok=True)
    paths, q = [], -(-len(lines) // parts)
    for i in range(parts):
        text = b"".join(lines[i * q:(i + 1) * q])
        path = os.path.join(directory, f"part-{i:05d}{suffix}")
        with open(path, "wb") as f:
            f.write(compress(text) if compress else text)
        paths.append(path)
    open(os.path.join(directory, "_SUCCESS"), "w").close()
    with open(os.path.join(directory, ".part-00000.crc"), "wb") as f:
        f.write(b"\x00garbage")
    return paths


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """A Criteo-format training file of 8,000 rows, its test file, and the same rows as 4 part files,
    plain and gzipped."""
    d = tmp_path_factory.mktemp("inputs")
    info = synth.generate(str(d), 8_000, 1_000, fields=39, seed=11, formats=("criteo",))
    train = info.files["train_criteo"]
    lines = open(train, "rb").read().splitlines(keepends=True)
    plain = write_parts(d / "plain", lines, 4)
    packed = write_parts(d / "gz", lines, 4, gzip.compress, ".gz")
    test_gz = d / "test.tsv.gz"
    test_gz.write_bytes(gzip.compress(open(info.files["test_criteo"], "rb").read()))
    return {"train": train, "test": info.files["test_criteo"], "test_gz": str(test_gz), "lines": lines,
            "plain": plain, "gz": packed, "dir": str(d)}


# -- which files -----------------------------------------------------------------------------------

def test_a_directory_is_its_part_files_in_name_order_without_markers_or_hidden_files(criteo):
    d = os.path.dirname(criteo["plain"][0])
    assert inputs.data_files(d, "data.train") == criteo["plain"]
    assert inputs.data_files(os.path.join(d, "part-*"), "data.train") == criteo["plain"]
    assert inputs.data_files([criteo["plain"][2], d + "/part-0000[01]"]) == [criteo["plain"][2], *criteo["plain"][:2]]


def test_a_pattern_or_directory_without_files_is_an_error_naming_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").touch()
    with pytest.raises(data.DataError, match=r"^data.test = '.*empty': the directory holds no data file"):
        inputs.data_files(str(tmp_path / "empty"), "data.test")
    with pytest.raises(data.DataError, match=r"^data.train = '.*day_\*\.gz': no data file matches the pattern"):
        inputs.data_files(str(tmp_path / "day_*.gz"), "data.train")


def test_whole_files_with_enough_files_else_byte_ranges_and_compressed_files_whole(criteo):
    plain, packed = criteo["plain"], criteo["gz"]
    two = [[p.path for p in inputs.part_of(plain, w, 2)] for w in range(2)]
    assert two == [plain[:2], plain[2:]]
    three = [[p.path for p in inputs.part_of(packed, w, 3)] for w in range(3)]
    assert three == [packed[:1], packed[1:2], packed[2:]]
    assert all(p.compression == "gzip" for w in range(3) for p in inputs.part_of(packed, w, 3))
    # fewer files than workers: the files end to end in byte ranges, cut at line starts
    for workers in (5, 7):
        rows = [data.load_part(plain, w, workers, binary=True) for w in range(workers)]
        whole = data.load_part(criteo["train"], 0, 1, binary=True)
        np.testing.assert_array_equal(np.concatenate([r.indices for r in rows]), whole.indices)
        np.testing.assert_array_equal(np.concatenate([r.labels for r in rows]), whole.labels)
    with pytest.raises(data.DataError, match=r"^data.train: .*4 gzip-compressed file\(s\) among 4 for 5 workers: "
                                             r"a compressed file cannot be split.*use at most 4 workers"):
        inputs.part_of(packed, 0, 5, "data.train")
    # a test file's rows are gathered: the last workers may read nothing
    test = [data.load_part(packed, w, 6, binary=True, idle_ok=True) for w in range(6)]
    assert [t.rows for t in test] == [2000] * 4 + [0, 0]


# -- compressed streams ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gzip", "gzip-zlib", "bzip2", "xz", "zstd"])
def test_a_compressed_file_reads_as_its_text(criteo, tmp_path, kind, monkeypatch):
    if kind == "gzip-zlib":  # read by Python's gzip (zlib), as without the isal extra
        monkeypatch.setitem(sys.modules, "isal", None)
        kind = "gzip"
    text = b"".join(criteo["lines"][:3000])
    path = tmp_path / "rows"  # (no suffix: told by its magic bytes)
    path.write_bytes(zstd_compress(text) if kind == "zstd" else COMPRESS[kind](text))
    plain = tmp_path / "rows.txt"
    plain.write_bytes(text)
    assert inputs.compression(str(path)) == kind and data.detect_format(str(path), "auto") == "criteo"
    want = data.load_part(str(plain), 0, 1, binary=True)
    with _address_space_bounded(768 << 20):  # (a stream's block is STREAM_BLOCK_BYTES: each took a GiB before)
        got = data.load_part(str(path), 0, 1, binary=True)
    np.testing.assert_array_equal(got.indices, want.indices)
    stream = data.PartStream(str(path), 0, 1, binary=True, block_bytes=1 << 13, memory_mb=0.2).open()
    assert stream.rows_bound == 3000
    batches = stream.batches(1000)
    for i in range(3):
        np.testing.assert_array_equal(next(batches).labels, want.labels[i * 1000:(i + 1) * 1000])


def test_a_bad_line_in_a_gzipped_part_names_its_file_and_line(criteo, tmp_path):
    lines = list(criteo["lines"][:2000])
    lines[1234] = b"x\tbad\n"
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(b"".join(lines)))
    with pytest.raises(data.DataError, match=rf"^{path}:1235: "):
        data.load_part(str(path), 0, 1, "criteo")


@pytest.mark.parametrize("inflate", ["isal", "zlib"])
def test_a_cut_gzip_stream_is_named_by_every_reader(criteo, tmp_path, inflate, monkeypatch):
    if inflate == "zlib":  # (inflated slowly: the first pass parses the text the line count inflates, a Tee)
        monkeypatch.setitem(sys.modules, "isal", None)
    else:
        pytest.importorskip("isal", reason="the isal extra is not installed")
    assert inputs.inflates_slowly("gzip") == (inflate == "zlib")
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gzip.compress(b"".join(criteo["lines"][:2000]))[:-5000])
    said = rf"^data file {cut}: its compressed stream is damaged or cut short \([^(]*\)$"
    with pytest.raises(data.DataError, match=said):
        data.load_part(str(cut), 0, 1, "criteo")
    stream = data.PartStream(str(cut), 0, 1, "criteo", block_bytes=1 << 13)
    with pytest.raises(data.DataError, match=said):
        next(stream.open().batches(10_000))  # (at open, or where the training reaches it)
    with pytest.raises(data.DataError, match=said):
        stream.rows_bound
    assert data.rows_at_least(str(cut), 10**9) == 0  # (the loading says why)


def test_zip_and_lz4_are_refused_with_the_command_that_decompresses_them(tmp_path):
    path = tmp_path / "rows.zip"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(data.DataError, match=rf"{path} is zip-compressed: .*\(unzip {path}\)"):
        data.detect_format(str(path), "auto")


# -- whole jobs: the same rows, the same model -----------------------------------------------------

def train(spec, tmp, name: str, n: int = 0, said: str = "", without_isal: bool = False, **kv) -> ServingModel:
    """The model ``hpcps train`` makes of ``spec`` in ``n`` ranks (0: one process), whose output
    says ``said``; ``without_isal``: gzip read through zlib, as without the isal extra (a package
    of that name that fails to import comes first on the job's path)."""
    model = os.path.join(tmp, f"{name}.h5")
    kv = {"train__epochs": 2, "train__batch_size": 100, "train__progress": False, "train__model_out": model, **kv}
    args = ["train", *sets(**kv), "--set", f"data.train={_toml(spec)}"]
    if without_isal:
        hide = os.path.join(tmp, "without-isal")
        os.makedirs(os.path.join(hide, "isal"), exist_ok=True)
        with open(os.path.join(hide, "isal", "__init__.py"), "w") as f:
            f.write("raise ImportError('the isal extra, left out')\n")
        proc = subprocess.run([sys.executable, "-m", "hpcps.cli", *args], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, PYTHONPATH=hide))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        rc, out = job(n, args, timeout=300)
    assert rc == 0 and said in out, out[-3000:]
    return ServingModel(model)


def _toml(spec) -> str:
    return "[" + ", ".join(f'"{p}"' for p in spec) + "]" if isinstance(spec, list) else f'"{spec}"'


def assert_same_model(a: ServingModel, b: ServingModel) -> None:
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)  # bit for bit


def test_a_directory_glob_list_and_gzip_give_the_model_of_one_plain_file(criteo, tmp_path):
    """One worker reads every file in order: the rows of the one plain file, so the same model."""
    reference = train(criteo["train"], tmp_path, "plain")
    plain_dir = os.path.dirname(criteo["plain"][0])
    for name, spec in (("dir", plain_dir), ("glob", os.path.join(plain_dir, "part-*")), ("list", criteo["plain"]),
                       ("gz", os.path.dirname(criteo["gz"][0]))):
        assert_same_model(train(spec, tmp_path, name), reference)
    # through zlib, gzip is inflated once: the first pass parses the text the line count inflated
    assert_same_model(train(os.path.dirname(criteo["gz"][0]), tmp_path, "gz-zlib", without_isal=True), reference)


def stopped_after_checkpoint(proc, ck: str, step: int) -> tuple[int, str]:
    """Wait for the checkpoint of ``step`` in ``ck`` of the 3-rank job ``proc``, then signal a worker
    (rank 2): a checkpoint at the next step, then exit 75. (exit status, output)."""
    try:
        assert wait_for(lambda: os.path.exists(checkpoint.step_dir(ck, step)), 240, proc), "no checkpoint"
        pids = rank_pids(ck)
        assert set(pids) == {0, 1, 2}, pids
        os.kill(pids[2], signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return proc.returncode, out


def test_a_gzipped_criteo_directory_trains_on_two_workers_resumes_exactly_and_scores_unlabeled_rows(criteo, tmp_path):
    """The done-when test of issue 38's inputs: a gzipped directory of 4 Criteo part files trains
    under mpiexec -n 3 (1 server, 2 workers, each reading 2 whole files), is stopped mid-epoch
    after a checkpoint, resumes, and ends with the model of the run never stopped, bit for bit.
    Its test file is one gzip file: the first worker reads it whole, the second nothing. The model
    then scores that test file without its labels through predict and load_model."""
    gz_dir = os.path.dirname(criteo["gz"][0])
    common = dict(data__test=criteo["test_gz"], train__batch_size=20, train__epochs=2, train__progress=False,
                  cluster__servers=1, cluster__staleness=0, checkpoint__every_steps=20)
    reference = train(gz_dir, tmp_path, "reference", n=3, checkpoint__dir=str(tmp_path / "ck-ref"), **common)
    ck = tmp_path / "ck"
    args = ["train", *sets(train__model_out=str(tmp_path / "never.h5"), checkpoint__dir=str(ck), **common),
            "--set", f"data.train={_toml(gz_dir)}"]
    rc, out = stopped_after_checkpoint(start(3, args), str(ck), 60)
    assert rc == 75, out[-3000:]
    newest, manifest = checkpoint.newest_good(str(ck))
    steps_an_epoch = -(-4_000 // 20)  # (2 whole files of 2,000 rows a worker)
    assert manifest["position"]["step"] < steps_an_epoch and manifest["position"]["epoch"] == 1, manifest["position"]
    assert manifest["data"]["train"]["files"] == 4 and manifest["data"]["workers"] == 2, manifest["data"]
    resumed = train(gz_dir, tmp_path, "resumed", n=3, said=f"resuming from {newest}", checkpoint__dir=str(ck),
                    checkpoint__resume="auto", **common)
    assert_same_model(resumed, reference)
    # ... and scores an unlabeled test file (Criteo's test.txt: no label column), gzipped, through
    # hpcps predict and through hpcps.load_model: the scores of the same rows with their labels
    unlabeled = tmp_path / "unlabeled.tsv.gz"
    rows = gzip.decompress(open(criteo["test_gz"], "rb").read()).splitlines(keepends=True)
    unlabeled.write_bytes(gzip.compress(b"".join(r.split(b"\t", 1)[1] for r in rows)))
    model = str(tmp_path / "resumed.h5")
    scores = {}
    for name, rows_file in (("labeled", criteo["test_gz"]), ("unlabeled", str(unlabeled))):
        rc, out = job(0, ["predict", "--model", model, "--data", rows_file, "--out", str(tmp_path / f"{name}.txt")])
        assert rc == 0 and f"{len(rows)} scores written" in out, out
        scores[name] = open(tmp_path / f"{name}.txt").read()
    assert scores["unlabeled"] == scores["labeled"]
    import hpcps

    proba = hpcps.load_model(model).predict_proba(str(unlabeled))[:, 1]
    assert np.abs(proba - np.loadtxt(tmp_path / "unlabeled.txt")).max() <= 5e-7  # (predict writes 6 decimals)


def test_a_gzipped_directory_is_cached_and_streamed_again_each_epoch(criteo, tmp_path):
    gz_dir = os.path.dirname(criteo["gz"][0])
    half = tmp_path / "half.tsv"  # the second worker's rows: files 3 and 4
    half.write_bytes(b"".join(criteo["lines"][4000:]))
    whole = data.load_part(str(half), 0, 1, binary=True)
    for _ in range(2):  # parsed and cached, then read from the cache
        cached = data.load_part(gz_dir, 1, 2, binary=True, cache_dir=str(tmp_path / "cache"))
        np.testing.assert_array_equal(cached.indices, whole.indices)
    assert len(os.listdir(tmp_path / "cache")) == 1
    stream = data.PartStream(gz_dir, 1, 2, binary=True, memory_mb=0.5, block_bytes=1 << 14).open()
    assert stream.rows_bound == 4000
    for _ in range(2):  # a budget: each epoch reads the gzip streams again
        batches = stream.batches(4000)
        np.testing.assert_array_equal(next(batches).indices, whole.indices)
        batches.close()
