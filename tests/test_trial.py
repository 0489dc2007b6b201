"""Cases a new user's trial of main found mishandled: data sets replaced without a word, stale
caches, failures of an optional cache that ended the job, metrics files that mixed runs, outputs
inside checkpoints, benchmark and plot options, and messages that did not say what was wrong.

Each test runs ``hpcps`` as a user would (one process, or ``mpiexec``) and checks the exit status,
the one line the user reads and what is left on the disk.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hpcps.train import synth
from test_faults import job, sets


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "error:" in line]


def one_error(rc: int, out: str, status: int = 2) -> str:
    """The one error line of a command that failed with ``status``, without a traceback."""
    errors = error_lines(out)
    assert rc == status and len(errors) == 1 and "Traceback" not in out and "unexpected" not in out, (rc, out)
    return errors[0]


def listing(d) -> dict:
    """Each file's bytes under ``d``, by its path relative to ``d``."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = fh.read()
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 3,000-row training file and a 1,000-row test file (libsvm), as ``gen-data`` writes them."""
    d = tmp_path_factory.mktemp("trial")
    info = synth.generate(str(d / "data"), 3_000, 1_000, fields=8, seed=5, formats=("libsvm",))
    return info.files["train_libsvm"], info.files["test_libsvm"]


# -- gen-data never replaces another data set -------------------------------------------------------

def test_gen_data_refuses_to_replace_another_data_set_unless_asked(tmp_path):
    d = tmp_path / "data"
    rc, out = job(0, ["gen-data", str(d), "--rows", "300", "--test-rows", "100"])
    assert rc == 0, out
    before = listing(d)
    rc, out = job(0, ["gen-data", str(d), "--rows", "100", "--test-rows", "10"])
    line = one_error(rc, out)
    assert "other parameters" in line and "rows 300, not 100" in line and "--overwrite" in line, line
    assert f"{d}/info.json" in line and f"{d}/train.svm" in line, line
    for other in (["--deep"], ["--ratings"]):  # another kind of data set: its info.json would go
        rc, out = job(0, ["gen-data", str(d), "--rows", "100", "--test-rows", "10", *other])
        assert "info.json" in one_error(rc, out)
    assert listing(d) == before  # nothing replaced
    rc, out = job(0, ["gen-data", str(d), "--rows", "300", "--test-rows", "100"])  # the same: reused
    assert rc == 0 and "reused" in out and listing(d) == before, out
    rc, out = job(0, ["gen-data", str(d), "--rows", "100", "--test-rows", "10", "--overwrite"])
    assert rc == 0 and "reused" not in out, out
    assert len(open(d / "train.svm").read().splitlines()) == 100


def test_gen_data_refuses_files_of_its_names_it_did_not_write(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "train.svm").write_text("1 3:1\n")
    for kind in ([], ["--ratings"]):
        rc, out = job(0, ["gen-data", str(own), "--rows", "100", "--test-rows", "10", *kind])
        line = one_error(rc, out)
        assert f"{own}/train.svm" in line and "--overwrite" in line, line
    assert listing(own) == {"train.svm": b"1 3:1\n"}


def test_a_deep_or_ratings_data_set_of_the_same_parameters_is_written_again(tmp_path):
    for kind in ("--deep", "--ratings"):
        d = tmp_path / kind[2:]
        for _ in range(2):
            rc, out = job(0, ["gen-data", str(d), "--rows", "200", "--test-rows", "50", kind])
            assert rc == 0, out
        rc, out = job(0, ["gen-data", str(d), "--rows", "201", "--test-rows", "50", kind])
        assert "rows 200, not 201" in one_error(rc, out)


def test_training_into_a_synth_dir_of_another_data_set_is_refused(tmp_path):
    d = tmp_path / "sd"
    synth.generate(str(d), 300, 100, fields=8, seed=5, formats=("libsvm",))
    before = listing(d)
    rc, out = job(0, ["train", *sets(synth__dir=str(d), synth__rows=200, synth__test_rows=100, synth__fields=8,
                                     synth__seed=5, train__epochs=1, train__progress=False)])
    line = one_error(rc, out)
    assert "synth.dir" in line and "rows 300, not 200" in line, line
    assert listing(d) == before


def test_gen_data_on_a_full_disk_leaves_nothing_behind(small_disk):
    for where in (small_disk / "new" / "d", small_disk):  # a directory it made, one that was there
        rc, out = job(0, ["gen-data", str(where), "--rows", "60000", "--test-rows", "1000"])
        line = one_error(rc, out, 1)
        assert "No space left" in line, line
        assert os.listdir(small_disk) == [], os.listdir(small_disk)


# -- the data cache: never stale, never the job's end -----------------------------------------------

def _train_cached(small, cache, *extra, n=0, **kv):
    return job(n, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1, train__progress=False,
                                  data__cache_dir=str(cache), **kv), *extra])


def test_a_file_rewritten_with_its_size_and_mtime_kept_is_not_read_from_the_cache(small, tmp_path):
    from hpcps.train import data

    path = shutil.copyfile(small[0], tmp_path / "train.svm")
    first = data.load_part(str(path), 0, 1, cache_dir=str(tmp_path / "cache"))
    st = os.stat(path)
    text = bytearray(open(path, "rb").read())
    text[0] = ord("1") if text[0] == ord("0") else ord("0")  # the first label, flipped: the same size
    with open(path, "r+b") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as touch -r, rsync -t would
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = data.load_part(str(path), 0, 1, cache_dir=str(tmp_path / "cache"))
    assert again.labels[0] != first.labels[0] and again.labels[0] == data.load_part(str(path), 0, 1).labels[0]


def test_a_cache_entry_with_a_changed_byte_is_parsed_again_not_trained_on(small, tmp_path, capsys):
    # (every array whole and of the right shape: a flipped byte in its keys was read as it was,
    # other keys trained on silently, and in its values a NaN loss blamed on the learning rate)
    import numpy as np

    from hpcps.train import data

    first = data.load_part(small[0], 0, 1, cache_dir=str(tmp_path / "cache"))
    (entry,) = os.listdir(tmp_path / "cache")
    path = tmp_path / "cache" / entry / "indices.npy"
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)
        f.write(b"\x5a" * 4)
    again = data.load_part(small[0], 0, 1, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(again.indices, first.indices)
    err = capsys.readouterr().err
    assert "warning: data.cache_dir" in err and "its arrays fail their XXH64 checksum" in err, err
    assert isinstance(data.load_part(small[0], 0, 1, cache_dir=str(tmp_path / "cache")).indices, np.memmap)


def test_a_damaged_cache_entry_is_one_warning_and_parsed_again(small, tmp_path):
    cache = tmp_path / "cache"
    rc, out = _train_cached(small, cache, "--summary-json", str(tmp_path / "a.json"))
    assert rc == 0, out
    for d in os.listdir(cache):  # every entry cut short, as a full disk or a killed copy leaves it
        os.truncate(cache / d / "indices.npy", 1000)
    rc, out = _train_cached(small, cache, "--summary-json", str(tmp_path / "b.json"))
    warnings = [ln for ln in out.splitlines() if "warning: data.cache_dir" in ln]
    assert rc == 0 and len(warnings) == 2 and all("damaged" in w for w in warnings), out
    a, b = json.load(open(tmp_path / "a.json")), json.load(open(tmp_path / "b.json"))
    assert a["test_logloss"] == b["test_logloss"]
    rc, out = _train_cached(small, cache)  # the entries were written again: a restart is quiet
    assert rc == 0 and "warning" not in out, out


def test_a_cache_on_a_full_disk_is_one_warning_and_leaves_nothing(small, small_disk, tmp_path):
    with open(small_disk / "fill", "wb") as f:  # leave 64 KiB: less than the parsed part
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - (64 << 10)))
    cache = small_disk / "cache"
    for n in (0, 2):
        rc, out = _train_cached(small, cache, n=n, model__type="fm")
        warnings = [ln for ln in out.splitlines() if "warning: data.cache_dir" in ln]
        assert rc == 0 and warnings and all("cannot cache" in w and "full" in w for w in warnings), out
        assert "Traceback" not in out and os.listdir(cache) == [], os.listdir(cache)


# -- metrics files: one run each, resumed runs continue them; plot reads what a run writes ---------

def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def _positions(path) -> tuple[list, list]:
    records = _records(path)
    return ([(r["epoch"], r["step"]) for r in records if r["kind"] == "step"],
            [r["epoch"] for r in records if r["kind"] == "epoch"])


def test_a_fresh_run_starts_its_metrics_anew_and_a_resumed_run_continues_them(small, tmp_path):
    metrics, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    every = [(e, s) for e in (1, 2) for s in range(1, 31)]  # 2 epochs of 30 steps of 100 rows
    args = ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=2, train__batch_size=100,
                           train__progress=False, train__metrics=str(metrics))]
    for _ in range(2):
        rc, out = job(0, args)
        assert rc == 0, out
        assert _positions(metrics) == (every, [1, 2])  # one run's records, not two runs' as one
    ckpt = args + sets(checkpoint__dir=str(ck), checkpoint__every_steps=25, checkpoint__keep=5,
                       checkpoint__existing="replace")
    rc, out = job(0, ckpt)
    assert rc == 0 and (ck / "ckpt-0000000025").is_dir(), out
    with open(metrics, "a") as f:
        f.write('{"kind": "step", "epoch": 2, "st')  # the run killed in the middle of a line
    rc, out = job(0, ckpt + ["--resume", str(ck / "ckpt-0000000025")])
    assert rc == 0, out
    assert f"{metrics}: dropped 38 record(s) from epoch 1, step 26 on" in out, out  # 35 steps, 2 epochs, 1 line
    assert _positions(metrics) == (every, [1, 2])  # the steps before the checkpoint once, then the resumed run's
    rc, out = job(0, ckpt + ["--resume", "auto"])  # nothing left to train: nothing dropped, nothing added
    assert rc == 0 and "dropped" not in out and _positions(metrics) == (every, [1, 2]), out


@pytest.fixture(scope="module")
def metrics_file(small, tmp_path_factory):
    pytest.importorskip("matplotlib")
    path = tmp_path_factory.mktemp("metrics") / "run.jsonl"
    rc, out = job(0, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1,
                                     train__progress=False, train__metrics=str(path))])
    assert rc == 0, out
    return str(path)


def test_plot_of_a_live_run_skips_its_unfinished_last_line(metrics_file, tmp_path):
    live = tmp_path / "live.jsonl"
    text = open(metrics_file).read()
    live.write_text(text[:text.index("\n", 2000) + 40])  # cut inside a record, as a running job's file is
    rc, out = job(0, ["plot", str(live), "-o", str(tmp_path / "p.png")])
    notes = [ln for ln in out.splitlines() if "note:" in ln]
    assert rc == 0 and len(notes) == 1 and "unfinished" in notes[0] and str(live) in notes[0], out
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("record, named", [('{"kind":"step","step":1,"loss":NaN}', "examples_per_s"),
                                           ('{"kind":"step","loss":0.5,"examples_per_s":"fast","wait_s":0,'
                                            '"time_s":1}', "examples_per_s"),
                                           ("[1, 2]", "not a record")])
def test_plot_of_a_record_it_cannot_draw_names_the_file_and_line(metrics_file, tmp_path, record, named):
    bad = tmp_path / "bad.jsonl"
    lines = open(metrics_file).read().splitlines()
    bad.write_text("\n".join(lines[:3] + [record] + lines[3:]) + "\n")
    rc, out = job(0, ["plot", str(bad), "-o", str(tmp_path / "p.png")])
    line = one_error(rc, out)
    assert f"{bad}:4:" in line and named in line, line
    assert not (tmp_path / "p.png").exists()


def test_plot_refuses_labels_that_do_not_match_its_files(metrics_file, tmp_path):
    for labels in (["--label", "a"], ["--label", "a", "--label", "b", "--label", "c"]):
        rc, out = job(0, ["plot", metrics_file, metrics_file, *labels, "-o", str(tmp_path / "p.png")])
        assert "--label" in one_error(rc, out)
    (tmp_path / "d").mkdir()
    rc, out = job(0, ["plot", str(tmp_path / "d"), "-o", str(tmp_path / "p.png")])  # a directory: said so
    assert "is a directory" in one_error(rc, out)


# -- an output where checkpoints go is refused before training ---------------------------------------

@pytest.mark.parametrize("name", ["ckpt-0000000030", "ckpt-0000000030.tmp", "superseded", "damaged/m.h5", "replaced"])
def test_an_output_that_is_a_checkpoints_path_is_refused_before_training(small, tmp_path, name):
    from hpcps import outputs
    from hpcps.ps import checkpoint

    assert set(outputs.CHECKPOINT_ASIDE) == {checkpoint.DAMAGED, checkpoint.REPLACED, checkpoint.SUPERSEDED}
    ck = tmp_path / "ck"
    for key in ("train__model_out", "train__metrics", "data__predict_out"):
        predict = {"data__predict": small[1]} if key == "data__predict_out" else {}
        rc, out = job(0, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1,
                                         train__progress=False, checkpoint__dir=str(ck), **predict,
                                         **{key: str(ck / name)})])
        line = one_error(rc, out)
        assert key.replace("__", ".") in line and f"{ck}/{name.split('/')[0]}" in line, line
        assert "hpcps train: one process" not in out and (not ck.exists() or not os.listdir(ck)), out
    rc, out = job(0, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,
                                     checkpoint__dir=str(ck)), "--summary-json", str(ck / name)])
    assert "--summary-json" in one_error(rc, out)


# -- benchmark options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, named", [
    (["bench", "mpi"], "2 ranks"), (["bench", "ps"], "2 ranks"), (["bench", "ps", "--sizes", "abc"], "--sizes"),
    (["bench", "ps", "--sizes", "1000,"], "--sizes"), (["bench", "ps", "--key-bits", "0"], "--key-bits"),
    (["bench", "ps", "--repeat", "0"], "--repeat"), (["bench", "checkpoint", "--keys", "-5"], "--keys"),
    (["bench", "vw", "--ranks", "1"], "--ranks"), (["bench", "margins", "--rows", "0"], "--rows"),
    (["bench", "deep", "--batch-size", "x"], "--batch-size")])
def test_bench_usage_errors_are_one_line(tmp_path, args, named):
    rc, out = job(0, [*args, *(["--dir", str(tmp_path / "b")] if args[1] in ("checkpoint", "vw") else [])])
    assert named in one_error(rc, out) and len(out.strip().splitlines()) == 1, out  # (no usage lines)
    assert not (tmp_path / "b").exists()


def test_bench_ps_refuses_an_unknown_optimizer_on_every_rank():
    rc, out = job(2, ["bench", "ps", "--optimizer", "nope", "--sizes", "10"], timeout=120)
    errors = error_lines(out)
    assert rc == 2 and errors and all("--optimizer 'nope'" in e for e in errors), out
    assert "unexpected" not in out and "Traceback" not in out, out


def test_bench_checkpoint_on_a_full_disk_is_one_line_and_leaves_nothing(small_disk):
    for where in (small_disk / "new" / "b", small_disk):  # a directory it made, one that was there
        rc, out = job(0, ["bench", "checkpoint", "--keys", "2000000", "--dir", str(where)])
        line = one_error(rc, out, 1)
        assert "No space left" in line and str(where) in line, line
        assert os.listdir(small_disk) == [], os.listdir(small_disk)


# -- messages: what is wrong with the input, in one line -------------------------------------------

@pytest.fixture(scope="module")
def model(small, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model") / "model.h5")
    rc, out = job(0, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,
                                     train__model_out=path)])
    assert rc == 0, out
    return path


def _compressed(kind: str, text: bytes) -> bytes:
    return {"zip": b"PK\x03\x04", "lz4": b"\x04\x22\x4d\x18"}[kind] + text


@pytest.mark.parametrize("kind, command", [("zip", "unzip"), ("lz4", "unlz4")])
def test_a_compressed_data_file_is_named_as_such(small, model, tmp_path, kind, command):
    """gzip, zstd, bzip2 and xz files are read as streams (tests/test_inputs.py); the others are
    named, with the command that decompresses them."""
    path = tmp_path / "train.svm.z"
    path.write_bytes(_compressed(kind, open(small[0], "rb").read()[:100_000]))
    rc, out = job(0, ["train", *sets(data__train=str(path), train__epochs=1, train__progress=False)])
    assert f"{path} is {kind}-compressed" in out and f"({command} {path})" in out and rc == 2, out
    for fmt in ([], ["--format", "libsvm"]):
        rc, out = job(0, ["eval", "--model", model, "--data", str(path), *fmt])
        assert f"is {kind}-compressed: hpcps reads plain text" in one_error(rc, out)


def test_libsvm_with_tabs_trains_as_with_spaces_and_formats_that_do_not_fit_are_named(small, tmp_path):
    tabs = tmp_path / "tabs.svm"
    tabs.write_text(open(small[0]).read().replace(" ", "\t"))
    got = {}
    for name, path in (("spaces", small[0]), ("tabs", str(tabs))):
        rc, out = job(0, ["train", *sets(data__train=path, data__test=small[1], train__epochs=1,
                                         train__progress=False), "--summary-json", str(tmp_path / f"{name}.json")])
        assert rc == 0, out
        got[name] = json.load(open(tmp_path / f"{name}.json"))["test_logloss"]
    assert got["tabs"] == got["spaces"]
    for path, fmt, said in ((str(tabs), "criteo", "not a Criteo line"), (small[0], "criteo", "not a Criteo line"),
                            (small[0], "vw", None)):
        rc, out = job(0, ["train", *sets(data__train=path, data__format=fmt, train__epochs=1, train__progress=False)])
        assert rc == 2, out
        if said:
            assert f"{path}:1: {said}: " in out and "Criteo has 40" in out and "read it as libsvm" in out, out


def test_a_criteo_file_read_as_another_format_says_it_looks_like_criteo(tmp_path, model):
    d = synth.generate(str(tmp_path / "d"), 300, 100, fields=39, seed=2, formats=("criteo",))
    rc, out = job(0, ["eval", "--model", model, "--data", d.files["test_criteo"], "--format", "libsvm",
                      "--allow-other-hashing"])
    line = one_error(rc, out)
    assert f"{d.files['test_criteo']}:1: not a libsvm line: it has Criteo's 40 tab-separated columns" in line, line


def test_a_directory_of_libsvm_and_vw_files_names_the_vw_file_as_vw(tmp_path):
    """A data set's format is detected from its first file: a VW part beside libsvm parts was
    'bad feature index' at its line 1, not that it is VW."""
    d = synth.generate(str(tmp_path / "d"), 300, 100, fields=8, seed=2, formats=("libsvm", "vw"))
    parts = tmp_path / "parts"
    parts.mkdir()
    shutil.copy(d.files["train_libsvm"], parts / "a.svm")
    shutil.copy(d.files["train_vw"], parts / "b.vw")
    rc, out = job(0, ["train", *sets(data__train=str(parts), train__epochs=1, train__progress=False)])
    line = one_error(rc, out)
    assert f"{parts / 'b.vw'}:1: not a libsvm line: it has VW's '|'" in line and "read it as vw" in line, line


def test_serving_commands_name_a_directory_fifo_or_standard_input(model, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for data, said in ((str(tmp_path), f"--data = '{tmp_path}': the directory holds no data file"),
                       (str(fifo), "is a FIFO (a named pipe)"),
                       ("-", "not from standard input")):
        for command in (["eval"], ["predict", "--out", str(tmp_path / "s.txt")]):
            rc, out = job(0, [*command, "--model", model, "--data", data], timeout=60)
            assert said in one_error(rc, out)


def test_predict_out_dash_writes_the_scores_to_standard_output(small, model, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "predict", "--model", model, "--data", small[1],
                           "--out", "-"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    scores = proc.stdout.split()
    assert proc.returncode == 0 and len(scores) == 1000 and all(0 < float(s) < 1 for s in scores), proc.stderr
    assert "1000 scores written to standard output" in proc.stderr and os.listdir(tmp_path) == []


def test_a_config_file_with_a_byte_order_mark_is_read(small, tmp_path):
    config = tmp_path / "run.toml"
    config.write_bytes(b"\xef\xbb\xbf" + f'[data]\ntrain = "{small[0]}"\n[train]\nepochs = 1\nprogress = false\n'
                       .encode())
    rc, out = job(0, ["train", str(config)])
    assert rc == 0 and "train loss" in out, out


def test_blank_lines_make_the_row_count_an_upper_bound_and_no_step_without_rows(small, tmp_path):
    blank = tmp_path / "blank.svm"
    lines = open(small[0]).read().splitlines()
    blank.write_text("".join(line + ("\n\n" if i % 100 == 99 else "\n") for i, line in enumerate(lines)))
    metrics = tmp_path / "run.jsonl"
    rc, out = job(0, ["train", *sets(data__train=str(blank), train__epochs=1, train__progress=False,
                                     train__batch_size=100, train__metrics=str(metrics))])
    assert rc == 0 and "up to 3030 rows (its lines) on this worker, 31 steps/epoch" in out, out
    steps = [r for r in _records(metrics) if r["kind"] == "step"]
    assert len(steps) == 30 and all(r["rows"] > 0 and r["loss"] is not None for r in steps)
    rc, out = job(0, ["train", *sets(data__train=str(blank), train__epochs=1, train__progress=False,
                                     data__cache_dir=str(tmp_path / "cache"))])  # loaded whole: counted
    assert rc == 0 and " 3000 rows on this worker" in out, out


def test_a_data_file_with_a_byte_order_mark_reads_as_without(small, tmp_path):
    bom = tmp_path / "bom.svm"
    bom.write_bytes(b"\xef\xbb\xbf" + open(small[0], "rb").read())
    got = {}
    for name, path in (("plain", small[0]), ("bom", str(bom))):
        rc, out = job(2, ["train", *sets(data__train=path, data__test=small[1], train__epochs=1, train__progress=False),
                          "--summary-json", str(tmp_path / f"{name}.json")])
        assert rc == 0, out
        got[name] = json.load(open(tmp_path / f"{name}.json"))["test_logloss"]
    assert got["bom"] == got["plain"]
