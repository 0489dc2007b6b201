"""Every bad input and every failure found is named: one test per defect of the reliability issue.

Unit tests call the library; job tests run ``hpcps`` as a user would (``mpiexec -n N hpcps ...``
in a subprocess under a timeout) and check the exit status and the one line the user reads.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from hpcps import config
from hpcps.ps import checkpoint
from hpcps.ps.layout import Layout, LayoutError
from hpcps.ps.placement import Placement
from hpcps.train import data as tdata
from hpcps.train import synth
from hpcps_kernels import parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from shared_runs import writable  # noqa: E402
from test_faults import job, sets  # noqa: E402 - one way to run hpcps as a user would


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel")
    info = synth.generate(str(d), 6_000, 2_000, fields=8, seed=3, formats=("libsvm",))
    return info.files["train_libsvm"], info.files["test_libsvm"]


def as_plus_minus(src: str, dst: str) -> None:
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            label, rest = line.split(" ", 1)
            g.write(("+1" if label == "1" else "-1") + " " + rest)


# -- 1. svmlight labels -1/+1 ---------------------------------------------------------------------

def test_plus_minus_one_labels_map_to_zero_one_under_the_logistic_loss():
    text = b"+1 1:1\n-1 2:1\n1 3:1\n# comment\n-1 4:1\n"
    labels = parse.parse_libsvm(writable(text), binary=True)[0]
    np.testing.assert_array_equal(labels, [1, 0, 1, 0])
    # the squared loss keeps labels as they are
    np.testing.assert_array_equal(parse.parse_libsvm(writable(text))[0], [1, -1, 1, -1])


@pytest.mark.parametrize("text,line,reason", [
    (b"1 1:1\n0 2:1\n2 3:1\n", 3, "label must be 0 or 1"),
    (b"1 1:1\n0.5 2:1\n", 2, "label must be 0 or 1"),
    (b"0 1:1\n1 2:1\n-1 3:1\n", 3, "labels mix 0 and -1"),
    (b"-1 1:1\n\n0 3:1\n", 3, "labels mix 0 and -1"),
])
def test_other_labels_under_the_logistic_loss_name_the_line(text, line, reason):
    with pytest.raises(parse.ParseError, match=reason) as e:
        parse.parse_libsvm(writable(text), source="d.svm", binary=True)
    assert e.value.line == line
    assert parse.parse_libsvm(writable(text), binary=True, skip_bad=True)[4] == 1  # or a counted skip


def test_mixed_labels_are_found_across_blocks(tmp_path, monkeypatch):
    path = tmp_path / "mixed.svm"
    path.write_bytes(b"".join(b"0 1:1\n" if i < 500 else b"-1 1:1\n" for i in range(1000)))
    monkeypatch.setattr(tdata, "PARSE_BLOCK_BYTES", 256)  # many blocks: the 0s and the -1s are in different ones
    with pytest.raises(tdata.DataError, match=rf"{path}:501: labels mix 0 and -1"):
        tdata.load_part(str(path), 0, 1, binary=True)


def test_a_plus_minus_one_file_trains_the_same_model_as_its_zero_one_copy(small, tmp_path):
    pm_train, pm_test = str(tmp_path / "train.pm"), str(tmp_path / "test.pm")
    as_plus_minus(small[0], pm_train)
    as_plus_minus(small[1], pm_test)
    results = []
    for train, test in (small, (pm_train, pm_test)):
        out_json = tmp_path / f"summary-{len(results)}.json"
        rc, out = job(2, ["train", *sets(data__train=train, data__test=test, data__format="libsvm",
                                         train__epochs=1, train__progress=False),
                          "--summary-json", str(out_json)])
        assert rc == 0, out[-2000:]
        results.append(json.load(open(out_json)))
    assert results[0]["test_logloss"] == results[1]["test_logloss"]
    assert 0 < results[1]["test_logloss"] < 0.7


def test_a_label_two_stops_the_job_naming_file_and_line(small, tmp_path):
    bad = tmp_path / "bad.svm"
    lines = open(small[0]).read().splitlines(keepends=True)
    lines[1234] = "2" + lines[1234][1:]
    bad.write_text("".join(lines))
    rc, out = job(2, ["train", *sets(data__train=str(bad), train__progress=False)])
    assert rc == 2 and f"{bad}:1235: label must be 0 or 1" in out, out[-2000:]


# -- 2. layout errors: one line, exit 2, before any data ------------------------------------------

@pytest.mark.parametrize("n,extra,match", [
    (1, {"cluster__servers": 2}, "one process runs 1 server and 1 worker inside it"),
    (2, {"cluster__servers": 3}, "too small for 3 server"),
    (3, {"cluster__servers": 2, "cluster__num_shards": 1}, "1 virtual shard"),
    (3, {"cluster__worker_groups": 5}, "cluster.worker_groups must be between 1"),
    # (these two were said by every rank)
    (3, {"cluster__backup_workers": 2}, "less than the number of workers (2)"),
    (3, {"cluster__layout": "auto", "cluster__replicas": 2}, "run 4 ranks or more"),
    (4, {"cluster__worker_groups": 2, "cluster__backup_workers": 1}, "got 2 groups of 3 workers"),
])
def test_layout_errors_are_one_line_exit_2_before_any_data(tmp_path, n, extra, match):
    synth_dir = tmp_path / "synth"
    rc, out = job(n, ["train", *sets(synth__dir=str(synth_dir), synth__rows=1000, **extra)], timeout=120)
    assert rc == 2, out[-2000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("hpcps: ") and ": error: " in ln]
    assert len(errors) == 1 and match in errors[0], out[-2000:]  # (once, by the first rank)
    assert "Traceback" not in out
    assert not synth_dir.exists() or not os.listdir(synth_dir)  # nothing was generated


def test_auto_layout_with_backup_workers_keeps_a_worker_a_group_and_more_workers_than_backups():
    # it chose groups of several workers (3 groups of 6 on 8 ranks of 8 cores), which the backup
    # workers' check then refused; with cluster.worker_groups set, as many workers as groups
    from hpcps.train import plan, scaling

    def chosen(ranks, cores, hosts, **cluster):
        cfg = config.from_dict({"cluster": {"layout": "auto", **cluster}})
        servers, groups, *_ = plan.decide_layout(cfg, ranks, hosts, cores, scaling.KeyCurve(), 10 ** 7)
        assert plan.backup_of(cfg).check(ranks - servers, 0, groups or ranks - servers) is None
        return servers, groups

    assert chosen(8, 8, 1)[1] not in (0, 6)  # (without backups: groups of several workers)
    assert chosen(8, 8, 1, backup_workers=1) == (2, 0)
    assert chosen(1600, 1600, 100, backup_workers=2)[1] == 0
    assert chosen(8, 8, 1, backup_workers=1, worker_groups=3) == (5, 3)
    assert chosen(4, 2, 1, backup_workers=2) == (1, 0)


def test_auto_layout_takes_worker_groups_with_backup_workers_that_one_server_would_not_fit(tmp_path):
    # 4 ranks, 2 groups, a backup: the check before the layout refused it (3 workers with one
    # server, not one a group); auto gives 2 servers and 2 workers, a group each
    rc, out = job(4, ["train", *sets(synth__dir=str(tmp_path / "synth"), synth__rows=1000, train__epochs=1,
                                     train__progress=False, cluster__layout="auto", cluster__worker_groups=2,
                                     cluster__backup_workers=1)], timeout=120)
    assert rc == 0 and "layout auto: 2 server(s), 2 group(s) of 1" in out, out[-2000:]


def test_layout_plan_checks_shards_against_servers():
    with pytest.raises(LayoutError, match="3 servers"):
        Layout.plan(5, 3, None, num_shards=2)
    assert Layout.plan(5, 3, None, num_shards=3).servers == 3


# -- 3. eval/predict/inspect on the wrong file ----------------------------------------------------

def test_eval_and_predict_on_a_file_that_is_not_a_model(small, tmp_path):
    for cmd in (["eval"], ["predict", "--out", str(tmp_path / "s.txt")]):
        rc, out = job(0, [*cmd, "--model", small[0], "--data", small[1]])
        assert rc == 2 and "is not an hpcps model file" in out and "Traceback" not in out, out
    h5 = tmp_path / "other.h5"
    import h5py
    with h5py.File(h5, "w") as f:
        f["x"] = np.zeros(3)
    rc, out = job(0, ["eval", "--model", str(h5), "--data", small[1]])
    assert rc == 2 and "is not an hpcps model file" in out, out


def test_inspect_of_a_missing_path_is_an_error_not_damaged(tmp_path):
    rc, out = job(0, ["inspect", str(tmp_path / "nope")])
    assert rc == 2 and "no such checkpoint" in out and "DAMAGED" not in out, out


# -- 4. resume over different data -----------------------------------------------------------------

def test_resume_over_other_data_is_an_error_unless_allowed(small, tmp_path):
    ck = tmp_path / "ck"
    base = dict(data__train=small[0], train__epochs=1, train__progress=False, checkpoint__dir=str(ck),
                train__batch_size=100)
    rc, out = job(2, ["train", *sets(**base)])
    assert rc == 0, out[-2000:]
    other = tmp_path / "other.svm"
    lines = open(small[0]).read().splitlines(keepends=True)
    other.write_text("".join(lines[1:] + lines[:1]))  # same size, other order
    for change, what in ((dict(train__batch_size=50), "train.batch_size was 100, now 50"),
                         (dict(data__train=str(other)), "the training file differs")):
        rc, out = job(2, ["train", *sets(**{**base, **change}), "--resume", "auto"])
        assert rc == 2 and what in out and "allow_other_data" in out, out[-2000:]
    # the automatic batch size resumes at the checkpoint's rows a step (the rule may give others)
    rc, out = job(2, ["train", *sets(**{**base, "train__batch_size": 0}), "--resume", "auto"])
    assert rc == 0 and "resuming from" in out and "of 100 rows (auto)" in out, out[-2000:]
    rc, out = job(2, ["train", *sets(**{**base, "train__batch_size": 50, "checkpoint__allow_other_data": True}),
                      "--resume", "auto"])
    assert rc == 0 and "resuming from" in out, out[-2000:]
    manifest = checkpoint.newest_good(str(ck))[1]
    assert manifest["data"]["train"]["bytes"] == os.path.getsize(small[0])
    assert manifest["data"]["batch_size"] == 50 and manifest["data"]["workers"] == 1


# -- 5. ranges ------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,match", [
    ("optimizer.alpha=0", r"optimizer\.alpha must be greater than 0"),
    ("optimizer.alpha=-0.1", r"optimizer\.alpha must be greater than 0"),
    ("optimizer.beta=-1", r"optimizer\.beta must be at least 0"),
    ("optimizer.alpha=nan", r"optimizer\.alpha must be a finite number"),
    ("train.eval_every=-1", r"train\.eval_every must be at least 0"),
    ("checkpoint.every_s=-5", r"checkpoint\.every_s must be at least 0"),
    ("checkpoint.every_steps=-1", r"checkpoint\.every_steps must be at least 0"),
    ("cluster.stall_timeout_s=0", r"cluster\.stall_timeout_s must be greater than 0"),
    ("cluster.stall_warn_s=-1", r"cluster\.stall_warn_s must be greater than 0"),
    ("cluster.stall_warn_s=400", r"cluster\.stall_warn_s \(400\) must not exceed cluster\.stall_timeout_s"),
    ("cluster.staleness=-2", r"cluster\.staleness must be at least -1"),
    ("model.init_scale=-0.1", r"model\.init_scale must be at least 0"),
    ("model.seed=-1", r"model\.seed must be at least 0"),
    ("synth.fields=40", r"synth\.fields must be between 2 and 39"),
])
def test_numeric_keys_are_range_checked_naming_key_and_range(override, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(config.load_raw(None, [override]))


@pytest.mark.parametrize("opt,key,value,match", [
    ("sgd", "lr", -0.1, "greater than 0"), ("adagrad", "eps", 0, "greater than 0"),
    ("adam", "beta1", 1.0, r"in \[0, 1\)"), ("adam", "beta2", -0.5, r"in \[0, 1\)"),
])
def test_optimizer_ranges_hold_for_the_library_api_too(opt, key, value, match):
    from hpcps.ps.tables import TableSpec
    with pytest.raises(ValueError, match=match):
        TableSpec("w", 1, opt, {key: value})
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict({"optimizer": {"name": opt, key: value}})


def test_fm_needs_a_positive_init_scale():
    with pytest.raises(config.ConfigError, match="init_scale must be greater than 0 for an fm"):
        config.from_dict({"model": {"type": "fm", "init_scale": 0.0}})


def test_unwritable_outputs_are_found_before_training(small, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for key in ("train__model_out", "train__metrics", "checkpoint__dir"):
        target = str(blocker / "sub" / "x.h5") if key != "checkpoint__dir" else str(blocker / "ck")
        rc, out = job(2, ["train", *sets(data__train=small[0], train__progress=False, **{key: target})], timeout=120)
        assert rc == 2 and key.replace("__", ".") in out and "hpcps train: " not in out, out[-2000:]


def test_check_paths_names_a_directory_given_as_model_out(tmp_path):
    cfg = config.from_dict({"train": {"model_out": str(tmp_path)}})
    assert "train.model_out" in config.check_paths(cfg) and "is a directory" in config.check_paths(cfg)
    assert config.check_paths(config.from_dict({"train": {"model_out": str(tmp_path / "m.h5")}})) is None


# -- 6. metrics without the progress bar -----------------------------------------------------------

def test_metrics_are_written_when_progress_is_off(small, tmp_path):
    metrics = tmp_path / "m.jsonl"
    rc, out = job(3, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1,
                                     train__progress=False, train__metrics=str(metrics), train__batch_size=500)])
    assert rc == 0, out[-2000:]
    records = [json.loads(ln) for ln in open(metrics)]
    steps = [r for r in records if r["kind"] == "step"]
    # about 3000 rows per worker (byte ranges, so not exactly) in batches of 500
    assert len(steps) in (6, 7) and [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert [r["kind"] for r in records].count("epoch") == 1 and "test_logloss" in records[-1]
    assert "epoch 1 [" not in out  # and no progress bar


# -- 7. durability ---------------------------------------------------------------------------------

def _tiny_checkpoint(root, step=10):
    tmp = checkpoint.step_dir(str(root), step) + ".tmp"
    os.makedirs(tmp)
    keys = np.arange(100, dtype=np.uint64)
    size, digest = checkpoint.write_server_file(checkpoint.server_file(tmp, 0), 0, 1, 8,
                                                [("w", keys, np.ones((100, 3), np.float32))])
    manifest = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "clock": step,
                "files": [{"name": "server-0.h5", "bytes": size, "xxh64": digest}],
                "tables": [{"name": "w", "dim": 1, "width": 3}], "layout": {"num_shards": 8, "servers": 1}}
    return tmp, manifest


def test_checkpoint_files_manifest_and_directories_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    tmp, manifest = _tiny_checkpoint(tmp_path)
    final = checkpoint.commit(tmp, manifest, keep=3)
    assert os.path.join(tmp, "server-0.h5") in synced          # by its writer
    assert os.path.join(tmp, "manifest.json.part") in synced   # the manifest, before its rename
    assert tmp in synced                                       # the directory's entries, before the rename
    assert str(tmp_path) == synced[-1] and final.startswith(str(tmp_path))  # the rename itself


def test_a_manifest_edited_into_other_valid_json_fails_its_checksum(tmp_path):
    tmp, manifest = _tiny_checkpoint(tmp_path)
    final = checkpoint.commit(tmp, manifest, keep=3)
    assert checkpoint.verify(final)["clock"] == 10
    path = os.path.join(final, "manifest.json")
    m = json.load(open(path))
    m["clock"] = 11  # a flipped digit: still valid JSON
    json.dump(m, open(path, "w"))
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json fails its XXH64 checksum"):
        checkpoint.verify(final)


# -- 9. a server that owns no shard ----------------------------------------------------------------

def test_restore_onto_a_server_that_owns_no_shard(tmp_path):
    tmp, manifest = _tiny_checkpoint(tmp_path)
    manifest["layout"] = {"num_shards": 4, "servers": 2}
    keys = np.arange(1000, dtype=np.uint64)
    place2 = Placement(2, 4)
    files = []
    for s in range(2):
        mine = place2.server_of(keys) == s
        size, digest = checkpoint.write_server_file(checkpoint.server_file(tmp, s), s, 2, 4,
                                                    [("w", keys[mine], np.ones((mine.sum(), 3), np.float32))])
        files.append({"name": f"server-{s}.h5", "bytes": size, "xxh64": digest})
    manifest["files"] = files
    final = checkpoint.commit(tmp, manifest, keep=3)
    m = checkpoint.verify(final)
    # 3 servers over 4 shards, the third owning none: its shard_server has no 2 in it
    shard_server = np.array([0, 1, 0, 1])
    got = [checkpoint.read_for_server(final, m, "w", s, shard_server, 3)[0] for s in range(3)]
    assert got[2].size == 0 and got[0].size + got[1].size == 1000


def test_resume_auto_into_a_locked_checkpoint_dir_touches_nothing_there(small, tmp_path):
    """A second job with --resume auto into the directory of a running job (here: this process holds
    its lock) is refused before it looks for a checkpoint: the search would take one the running job
    is deleting (retention) for damaged, move it aside, or fail on it (it did: FileNotFoundError,
    exit 1)."""
    ck = tmp_path / "ck"
    (ck / "ckpt-0000000010").mkdir(parents=True)
    (ck / "ckpt-0000000010" / "manifest.json").write_text("half-deleted")
    assert checkpoint.hold(str(ck)) is None
    try:
        rc, out = job(0, ["train", *sets(data__train=small[0], train__progress=False, checkpoint__dir=str(ck)),
                          "--resume", "auto"], timeout=120)
    finally:
        checkpoint.release(str(ck))
    errors = [ln for ln in out.splitlines() if ": error: " in ln]
    assert rc == 2 and len(errors) == 1 and f"checkpoint.dir {ck} is in use by another running job" in errors[0], out
    assert os.listdir(ck) == ["ckpt-0000000010"] and "skipped" not in out, out
