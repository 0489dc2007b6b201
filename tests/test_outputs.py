"""What hpcps writes for its users (issue 36): outputs never overwrite inputs (by the same file,
not the same string), every file is written whole or not at all, a model file knows what it was
trained on and is refused when damaged or given other keys, empty inputs and bad ``gen-data``
options are one-line errors, and JSON output never holds NaN.

Each test runs ``hpcps`` as a user would (one process, or ``mpiexec``) on a 3,000-row data set and
checks the exit status, the one line the user reads and what is left on the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading

import h5py
import numpy as np
import pytest

from hpcps.train import synth
from test_faults import job, sets


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def last_json(out: str):
    """The last JSON line of a command's output (stdout, then stderr)."""
    return strict_json([line for line in out.splitlines() if line.startswith("{")][-1])


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A 3,000-row data set in libsvm, Criteo and VW (the same rows), and an LR model trained on
    its libsvm file in one process (24 hash bits)."""
    d = tmp_path_factory.mktemp("outputs")
    info = synth.generate(str(d / "data"), 3_000, 1_000, fields=8, seed=5, formats=("libsvm", "criteo", "vw"))
    model = str(d / "model.h5")
    rc, out = job(0, ["train", *sets(data__train=info.files["train_libsvm"], train__epochs=1, train__progress=False,
                                     train__model_out=model)])
    assert rc == 0, out
    return {**info.files, "model": model, "dir": str(d)}


def copy(src: str, dst) -> str:
    shutil.copyfile(src, dst)
    return str(dst)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- inputs are never outputs ------------------------------------------------------------------------

def test_predict_out_equal_to_its_data_is_refused(data, tmp_path):
    rows = copy(data["test_libsvm"], tmp_path / "rows.svm")
    before = read(rows)
    os.link(rows, tmp_path / "hard.svm")
    os.symlink(rows, tmp_path / "soft.svm")
    for out in (rows, str(tmp_path / "hard.svm"), str(tmp_path / "soft.svm"), str(tmp_path / "." / "rows.svm")):
        rc, text = job(0, ["predict", "--model", data["model"], "--data", rows, "--out", out])
        assert rc == 2 and len(error_lines(text)) == 1 and "--out" in text and "--data" in text, text
        assert read(rows) == before  # (it held scores after the old predict)
    rc, text = job(0, ["predict", "--model", data["model"], "--data", rows, "--out", data["model"]])
    assert rc == 2 and "--model" in text, text


def test_train_outputs_that_are_its_inputs_are_refused_before_training(data, tmp_path):
    train = copy(data["train_libsvm"], tmp_path / "train.svm")
    test = copy(data["test_libsvm"], tmp_path / "test.svm")
    os.link(train, tmp_path / "train-link.svm")
    config = tmp_path / "run.toml"
    config.write_text("[train]\nepochs = 1\nprogress = false\n")
    before = {p: read(p) for p in (train, test, config)}
    base = dict(data__train=train, data__test=test)
    cases = [(dict(train__model_out=train), "train.model_out = ", "data.train = "),
             (dict(train__model_out=str(tmp_path / "train-link.svm")), "train.model_out", "data.train"),
             (dict(train__metrics=test), "train.metrics = ", "data.test = "),
             (dict(data__predict=test, data__predict_out=test), "data.predict_out", "data.test"),
             (dict(train__model_out=str(config)), "train.model_out", "the config file"),
             (dict(train__model_out=str(tmp_path / "o"), train__metrics=str(tmp_path / "o")), "train.model_out",
              "train.metrics"),
             (dict(checkpoint__dir=train), "checkpoint.dir", "data.train")]
    for extra, *named in cases:
        rc, out = job(0, ["train", str(config), *sets(**base, **extra)])
        assert rc == 2 and len(error_lines(out)) == 1 and all(n in out for n in named), (extra, out)
        assert "hpcps train: one process" not in out  # refused before training
    rc, out = job(0, ["train", str(config), *sets(**base, train__model_out=str(tmp_path / "m.h5")),
                      "--summary-json", str(tmp_path / "m.h5")])
    assert rc == 2 and "--summary-json" in out and "train.model_out" in out, out
    assert {p: read(p) for p in before} == before
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "m.h5")


def test_an_output_that_is_a_generated_input_is_refused(tmp_path):
    gen = dict(synth__dir=str(tmp_path / "sd"), synth__rows=3000, synth__test_rows=500, train__epochs=1,
               train__progress=False)
    rc, out = job(0, ["train", *sets(**gen, train__model_out=str(tmp_path / "sd" / "train.svm"))])
    assert rc == 2 and "data.train" in out and "train.model_out" in out, out
    assert (tmp_path / "sd" / "train.svm").read_text().startswith(("0 ", "1 "))


def test_an_input_inside_a_checkpoint_of_checkpoint_dir_is_refused(data, tmp_path):
    inside = tmp_path / "ck" / "ckpt-0000000060"
    inside.mkdir(parents=True)
    train = copy(data["train_libsvm"], inside / "train.svm")
    rc, out = job(0, ["train", *sets(data__train=train, checkpoint__dir=str(tmp_path / "ck"), train__epochs=1,
                                     train__progress=False)])
    assert rc == 2 and "retention" in out and "checkpoint.dir" in out, out
    assert os.path.exists(train) and os.listdir(tmp_path / "ck") == ["ckpt-0000000060"]


def test_the_out_of_export_tune_and_plot_is_never_an_input(data, tmp_path):
    ck = tmp_path / "ck"
    rc, out = job(0, ["train", *sets(data__train=data["train_libsvm"], checkpoint__dir=str(ck), train__epochs=1,
                                     train__progress=False, train__metrics=str(tmp_path / "run.jsonl"))])
    assert rc == 0, out
    (ckpt,) = [str(ck / n) for n in os.listdir(ck)]
    server = os.path.join(ckpt, "server-0.h5")
    before = read(server)
    rc, out = job(0, ["export", ckpt, "--out", server])
    assert rc == 2 and "--out" in out and "the checkpoint" in out, out
    assert read(server) == before and sorted(os.listdir(ckpt)) == ["manifest.json", "server-0.h5"]
    config = tmp_path / "tune.toml"
    config.write_text(f"[data]\ntrain = {json.dumps(data['train_libsvm'])}\n")
    text = config.read_text()
    rc, out = job(0, ["tune", str(config), "--grid", "optimizer.alpha=0.1,0.3", "--out", str(config)])
    assert rc == 2 and "--out" in out and "the config file" in out, out
    assert config.read_text() == text
    metrics = read(tmp_path / "run.jsonl")
    rc, out = job(0, ["plot", str(tmp_path / "run.jsonl"), "-o", str(tmp_path / "run.jsonl")])
    assert rc == 2 and "-o" in out and "metrics file" in out, out
    assert read(tmp_path / "run.jsonl") == metrics


# -- written whole or not at all ---------------------------------------------------------------------

def test_predict_into_a_fifo_writes_into_it_and_keeps_the_mode_of_a_file_it_replaces(data, tmp_path):
    fifo = tmp_path / "scores.fifo"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo) as f:
            got["text"] = f.read()
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc, out = job(0, ["predict", "--model", data["model"], "--data", data["test_libsvm"], "--out", str(fifo)],
                  timeout=120)
    if rc != 0:  # (the old predict replaced the FIFO with a regular file: the reader never returned)
        with open(fifo, "w"):
            pass
    t.join(30)
    assert rc == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode), out
    assert len(got["text"].split()) == 1000
    scores = tmp_path / "scores.txt"
    scores.write_text("old\n")
    os.chmod(scores, 0o600)
    rc, out = job(0, ["predict", "--model", data["model"], "--data", data["test_libsvm"], "--out", str(scores)])
    assert rc == 0 and len(scores.read_text().split()) == 1000, out
    assert stat.S_IMODE(os.stat(scores).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["scores.fifo", "scores.txt"]  # no temporary file left


def test_metrics_file_holds_whole_lines_after_a_torn_one(data, tmp_path):
    metrics = tmp_path / "run.jsonl"
    metrics.write_text('{"kind": "step", "epoch": 1, "st')  # a run killed in the middle of a line
    rc, out = job(0, ["train", *sets(data__train=data["train_libsvm"], data__test=data["test_libsvm"],
                                     train__epochs=1, train__progress=False, train__metrics=str(metrics))])
    assert rc == 0, out
    lines = metrics.read_text().split("\n")  # a fresh run's file starts anew (a resumed run's: test_trial)
    assert lines[-1] == ""
    records = [strict_json(line) for line in lines[:-1]]
    assert records[-1]["kind"] == "epoch" and sum(r["kind"] == "step" for r in records) >= 2


def test_metrics_on_a_full_disk_end_the_run_in_one_line_and_keep_whole_records(data, small_disk):
    metrics = small_disk / "run.jsonl"
    metrics.write_text('{"kind": "step", "epoch": 1, "step": 1}\n')  # an earlier run's
    with open(small_disk / "fill", "wb") as f:  # leave 8 KiB: less than an epoch's records
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - (8 << 10)))
    rc, out = job(0, ["train", *sets(data__train=data["train_libsvm"], train__epochs=1, train__progress=False,
                                     train__metrics=str(metrics))])
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1 and str(metrics) in errors[0] and "No space left" in errors[0], out
    assert "Traceback" not in out, out
    text = metrics.read_text()  # (a fresh run's file starts anew: the earlier run's record is gone)
    assert "step\": 1}" not in text and all(strict_json(line) for line in text.splitlines())
    assert not text or text.endswith("\n")


def test_an_appender_on_a_full_disk_keeps_only_whole_records(small_disk):
    from hpcps import outputs

    path = small_disk / "metrics.jsonl"
    with open(small_disk / "fill", "wb") as f:  # leave about 40 KiB
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - (40 << 10)))
    metrics = outputs.Appender(str(path), flush_bytes=3000)
    with pytest.raises(outputs.OutputError, match="No space left on device") as e:
        for i in range(100_000):
            metrics.write({"kind": "step", "step": i, "loss": 0.5, "pad": "x" * 100})
    assert e.value.exit_status == 1 and str(path) in str(e.value)
    text = path.read_text()
    assert text.endswith("\n") and [strict_json(line)["step"] for line in text.splitlines()] == list(range(
        len(text.splitlines())))


# -- a model knows what it was trained on -------------------------------------------------------------

def test_eval_with_other_hash_bits_is_refused_unless_asked(data):
    rc, out = job(0, ["eval", "--model", data["model"], "--data", data["test_libsvm"], "--hash-bits", "16"])
    assert rc == 2 and len(error_lines(out)) == 1 and "24 hash bits" in out and "--allow-other-hashing" in out, out
    rc, out = job(0, ["eval", "--model", data["model"], "--data", data["test_libsvm"], "--hash-bits", "16",
                      "--allow-other-hashing"])
    assert rc == 0 and last_json(out)["rows"] == 1000, out


def test_eval_and_predict_of_another_formats_keys_are_refused(data, tmp_path):
    for fmt in ("vw", "criteo"):
        rc, out = job(0, ["eval", "--model", data["model"], "--data", data[f"test_{fmt}"]])
        assert rc == 2 and len(error_lines(out)) == 1 and "libsvm" in out and f"as {fmt}" in out, out
    rc, out = job(0, ["predict", "--model", data["model"], "--data", data["test_vw"], "--out", str(tmp_path / "s")])
    assert rc == 2 and not os.path.exists(tmp_path / "s"), out
    rc, out = job(0, ["eval", "--model", data["model"], "--data", data["test_libsvm"]])
    assert rc == 0 and last_json(out)["auc"] > 0.6, out


def test_training_with_a_test_or_predict_file_of_another_formats_keys_is_refused(data, tmp_path):
    """As eval and predict refuse them: a test file in Criteo TSV beside libsvm training rows gave
    test metrics of a model that knows none of its keys, exit 0."""
    base = sets(data__train=data["train_libsvm"], train__progress=False, train__model_out=str(tmp_path / "m.h5"))
    for extra, key in ((sets(data__test=data["test_criteo"]), "data.test"),
                       (sets(data__predict=data["test_vw"], data__predict_out=str(tmp_path / "s")), "data.predict")):
        rc, out = job(0, ["train", *base, *extra])
        assert rc == 2 and len(error_lines(out)) == 1 and f"{key} = " in out and "in libsvm format" in out, out
    assert os.listdir(tmp_path) == []  # (refused before training: no model, no scores)
    # gen-data's Criteo keys are its libsvm keys: asked for, that test file scores as the libsvm one
    rc, out = job(0, ["train", *base, *sets(data__test=data["test_criteo"], data__allow_other_hashing=True,
                                            train__epochs=1)])
    assert rc == 0 and "test logloss" in out, out


def test_export_and_predict_do_not_overwrite_the_models_training_data(data, tmp_path):
    """A mistyped --out naming the file the model was trained on: refused in one line, exit 2 (export
    overwrote it with the model, exit 0); another path is written."""
    before = read(data["train_libsvm"])
    for cmd in (["export", data["model"], "--format", "text"], ["predict", "--model", data["model"],
                                                                 "--data", data["test_libsvm"]]):
        rc, out = job(0, [*cmd, "--out", data["train_libsvm"]])
        assert rc == 2 and len(error_lines(out)) == 1 and "data.train" in out and "would overwrite an input" in out, out
    assert read(data["train_libsvm"]) == before
    # another path is written, its directory made as train.model_out's is (they failed after the
    # work, "No such file or directory", exit 2)
    rc, out = job(0, ["export", data["model"], "--format", "text", "--out", str(tmp_path / "new" / "m.txt")])
    assert rc == 0 and (tmp_path / "new" / "m.txt").stat().st_size > 0, out
    rc, out = job(0, ["predict", "--model", data["model"], "--data", data["test_libsvm"], "--out",
                      str(tmp_path / "new2" / "s.txt")])
    assert rc == 0 and len((tmp_path / "new2" / "s.txt").read_text().splitlines()) == 1000, out


def test_an_export_or_prediction_may_write_beside_the_part_files_a_model_was_trained_on(tmp_path):
    """A model trained on a directory of part files: an --out that is one of them is refused, one
    beside them is not (the directory was refused whole, as if it were being read)."""
    import json

    from hpcps import cli, outputs

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part-0.svm").write_text("1 3:1\n")
    model = tmp_path / "m.h5"
    with h5py.File(model, "w") as f:  # (what _trained_on reads of a model file: its config's data)
        f.attrs["config"] = json.dumps({"data": {"train": str(parts), "test": [str(tmp_path / "gone")]}})
    trained_on = cli._trained_on(str(model))
    assert (f"{model}'s data.train", str(parts / "part-0.svm")) in trained_on
    assert str(parts) not in [p for _, p in trained_on]
    assert outputs.clash([("--out", str(parts / "scores.txt"))], trained_on) is None
    assert "would overwrite an input" in outputs.clash([("--out", str(parts / "part-0.svm"))], trained_on)


def test_a_damaged_model_file_is_refused_and_inspect_says_so(data, tmp_path):
    raw = bytearray(read(data["model"]))
    with h5py.File(data["model"], "r") as f:
        at = f["tables/w/values"].id.get_offset()
    raw[at + 40] ^= 0x10  # one bit of one weight
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(raw)
    for cmd in (["eval"], ["predict", "--out", str(tmp_path / "s.txt")]):
        rc, out = job(0, [*cmd, "--model", str(damaged), "--data", data["test_libsvm"]])
        assert rc == 1 and len(error_lines(out)) == 1 and "damaged" in out and "XXH64" in out, out
    rc, out = job(0, ["inspect", str(damaged)])
    assert rc == 1 and "DAMAGED" in out, out
    assert not os.path.exists(tmp_path / "s.txt")


def test_inspect_describes_a_model_file_and_tells_other_files_apart(data, tmp_path):
    rc, out = job(0, ["inspect", data["model"]])
    assert rc == 0 and "OK" in out and "model file" in out and "24 hash bits" in out and "libsvm" in out, out
    assert "table 'w'" in out and "checksum verified" in out
    (tmp_path / "empty").mkdir()
    for other in (data["train_libsvm"], str(tmp_path / "empty")):
        rc, out = job(0, ["inspect", other])
        assert rc == 2 and "not an hpcps" in out and "DAMAGED" not in out, out
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros(3)
    rc, out = job(0, ["inspect", str(tmp_path / "other.h5")])
    assert rc == 2 and "not an hpcps" in out, out
    (tmp_path / "ck" / "ckpt-0000000005.tmp").mkdir(parents=True)  # a checkpoint.dir with an unfinished write only
    rc, out = job(0, ["inspect", str(tmp_path / "ck")])
    assert rc == 1 and "DAMAGED" in out and "ckpt-0000000005.tmp" in out, out


def test_a_reader_that_stops_early_ends_inspect_and_predict_quietly(data):
    """``hpcps inspect | head`` and ``hpcps predict --out - | head``: the reader gone before the
    writer writes (a pipe whose reading end is closed) is no error message, and the status of a
    writer killed by SIGPIPE (141), for every command that writes to standard output."""
    from test_faults import ENV, HPCPS
    for args in (["inspect", data["model"]],
                 ["predict", "--model", data["model"], "--data", data["test_libsvm"], "--out", "-"]):
        r, w = os.pipe()
        os.close(r)
        try:
            proc = subprocess.run([*HPCPS, *args], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, env=ENV)
        finally:
            os.close(w)
        assert proc.returncode == 128 + 13 and "error" not in proc.stderr.lower(), (args, proc.returncode, proc.stderr)


def test_serving_commands_tell_a_wrong_path_from_a_damaged_file(data, tmp_path):
    ck = tmp_path / "ck"
    rc, out = job(0, ["train", *sets(data__train=data["train_libsvm"], checkpoint__dir=str(ck), train__epochs=1,
                                     train__progress=False)])
    assert rc == 0, out
    (ckpt,) = [str(ck / n) for n in os.listdir(ck)]
    (tmp_path / "dir").mkdir()
    rc, out = job(0, ["predict", "--model", data["model"], "--data", data["test_libsvm"], "--out", str(tmp_path / "dir")])
    assert rc == 2 and "is a directory" in out and sorted(os.listdir(tmp_path)) == ["ck", "dir"], out
    rc, out = job(0, ["eval", "--model", data["model"], "--data", data["test_libsvm"], "--format", "avro"])
    assert rc == 2 and "--format 'avro'" in out, out  # (it was read as libsvm; parquet is a format now)
    rc, out = job(0, ["eval", "--model", ckpt, "--data", data["test_libsvm"]])
    assert rc == 2 and "checkpoint directory" in out and "export" in out, out
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "cut.h5").write_bytes(read(data["model"])[:4096])
    rc, out = job(0, ["inspect", str(tmp_path / "empty.h5")])
    assert rc == 2 and "not an hpcps" in out, out
    rc, out = job(0, ["inspect", str(tmp_path / "cut.h5")])
    assert rc == 1 and "damaged hpcps model file" in out, out
    with open(os.path.join(ckpt, "server-0.h5"), "ab") as f:
        f.write(b"x")
    rc, out = job(0, ["export", ckpt, "--out", str(tmp_path / "m.h5")])
    assert rc == 1 and "manifest says" in out and not os.path.exists(tmp_path / "m.h5"), out


def _legacy_copy(model: str, path) -> None:
    """``model`` as the model files of version 2 were written: no checksum, no recorded hash bits
    or format (the config holds ``data.hash_bits``; its format says "auto")."""
    shutil.copyfile(model, path)
    with h5py.File(path, "r+") as f:
        for k in ("xxh64", "hash_bits", "input_format", "key_hashing"):
            del f.attrs[k]
        f.attrs["version"] = 2


def test_a_model_file_of_version_2_still_loads_and_says_what_is_not_checked(data, tmp_path):
    old = tmp_path / "old.h5"
    _legacy_copy(data["model"], old)
    rc, out = job(0, ["eval", "--model", str(old), "--data", data["test_libsvm"]])
    assert rc == 0 and "cannot be checked" in out and last_json(out)["rows"] == 1000, out
    rc, out = job(0, ["eval", "--model", str(old), "--data", data["test_libsvm"], "--hash-bits", "16"])
    assert rc == 2 and "24 hash bits" in out, out  # (from its config)
    rc, out = job(0, ["inspect", str(old)])
    assert rc == 0 and "OK" in out and "cannot be checked" in out, out


def test_export_records_what_the_checkpoint_was_trained_on(data, tmp_path):
    ck = tmp_path / "ck"
    rc, out = job(0, ["train", *sets(data__train=data["train_criteo"], data__hash_bits=20, checkpoint__dir=str(ck),
                                     train__epochs=1, train__progress=False)])
    assert rc == 0, out
    (ckpt,) = [str(ck / n) for n in os.listdir(ck)]
    model = str(tmp_path / "exported.h5")
    rc, out = job(0, ["export", ckpt, "--out", model])
    assert rc == 0, out
    rc, out = job(0, ["inspect", model])
    assert rc == 0 and "20 hash bits" in out and "criteo rows" in out, out
    rc, out = job(0, ["eval", "--model", model, "--data", data["test_vw"]])
    assert rc == 2 and "criteo" in out, out
    rc, out = job(0, ["eval", "--model", model, "--data", data["test_criteo"]])
    assert rc == 0, out


# -- empty is an error; JSON never holds NaN ----------------------------------------------------------

def test_eval_and_predict_of_no_rows_is_one_line(data, tmp_path):
    (tmp_path / "empty.svm").write_text("")
    (tmp_path / "comments.svm").write_text("# a comment\n\n   \n# another\n")
    for name in ("empty.svm", "comments.svm"):
        rows = str(tmp_path / name)
        rc, out = job(0, ["eval", "--model", data["model"], "--data", rows])
        assert rc == 2 and len(error_lines(out)) == 1 and "no rows" in out and "NaN" not in out, out
        rc, out = job(0, ["predict", "--model", data["model"], "--data", rows, "--out", str(tmp_path / "s.txt")])
        assert rc == 2 and "no rows" in out and not os.path.exists(tmp_path / "s.txt"), out
    (tmp_path / "bad.svm").write_text("x y z\nfoo\n")
    rc, out = job(0, ["eval", "--model", data["model"], "--data", str(tmp_path / "bad.svm"), "--skip-bad-lines"])
    assert rc == 2 and "no rows" in out and "2 lines" in out, out


def test_json_outputs_write_null_where_a_number_is_not_finite(data, tmp_path):
    one_class = tmp_path / "ones.svm"  # (the AUC of rows of one class is not a number)
    one_class.write_text("".join(line for line in open(data["test_libsvm"]) if line.startswith("1 ")))
    rc, out = job(0, ["eval", "--model", data["model"], "--data", str(one_class)])
    assert rc == 0 and last_json(out)["auc"] is None, out
    summary, metrics = tmp_path / "new" / "summary.json", tmp_path / "run.jsonl"  # (its directory is made)
    rc, out = job(0, ["train", *sets(data__train=data["train_libsvm"], data__test=str(one_class), train__epochs=1,
                                     train__progress=False, train__metrics=str(metrics)),
                      "--summary-json", str(summary)])
    assert rc == 0, out
    assert strict_json(summary.read_text())["test_auc"] is None
    epochs = [r for r in map(strict_json, metrics.read_text().splitlines()) if r["kind"] == "epoch"]
    assert epochs and epochs[-1]["test_auc"] is None
    from hpcps import outputs

    assert outputs.dumps({"a": [float("nan"), np.float32("inf"), 1.5]}) == '{"a": [null, null, 1.5]}'


@pytest.mark.parametrize("options, named", [
    (["--formats", "parquet"], "parquet"), (["--formats", "libsvm,parquet"], "parquet"), (["--formats", ""], "--formats"),
    (["--rows", "0"], "--rows"), (["--test-rows", "-5"], "--test-rows"), (["--test-rows", "0"], "--test-rows"),
    (["--fields", "0"], "--fields"), (["--fields", "40"], "--fields"), (["--hash-bits", "0"], "--hash-bits"),
    (["--hash-bits", "65"], "--hash-bits"), (["--seed", "-1"], "--seed"), (["--ratings", "--deep"], "--deep"),
    (["--deep", "--formats", "vw"], "--formats")])
def test_gen_data_refuses_what_it_cannot_make(tmp_path, options, named):
    out_dir = tmp_path / "d"
    rc, out = job(0, ["gen-data", str(out_dir), "--rows", "300", "--test-rows", "100", *options])
    assert rc == 2 and len(error_lines(out)) == 1 and named in out and "Traceback" not in out, out
    assert not out_dir.exists() or not os.listdir(out_dir)
