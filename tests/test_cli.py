"""The command line's conventions: --version, the examples in train --help, a data file given
where a configuration is expected, --help-config as TOML that can be pasted."""

from __future__ import annotations

import gzip
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest

import hpcps
from hpcps import cli, config

HPCPS = [sys.executable, "-m", "hpcps.cli"]


def hpcps_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*HPCPS, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_version_is_the_installed_distributions():
    proc = hpcps_run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"hpcps {metadata.version('hpcps')}"
    assert metadata.version("hpcps") == hpcps.__version__  # (the module's copy has not drifted)


def test_train_help_shows_examples_that_are_valid_command_lines():
    proc = hpcps_run("train", "--help")
    assert proc.returncode == 0 and "examples:" in proc.stdout
    lines = [line.split("#")[0].split(">")[0] for line in cli.TRAIN_EXAMPLES.splitlines()[1:] if line.strip()]
    assert len(lines) >= 4 and all("hpcps train" in line for line in lines)
    parser = cli.build_parser()
    for line in lines:
        argv = shlex.split(line)
        argv = argv[argv.index("hpcps") + 1:]
        args = parser.parse_args(argv)  # (exits 2 on an option train does not have)
        # each example's overrides make a valid configuration (the file named is the user's)
        config.from_dict(config.load_raw(None, args.set))


@pytest.mark.parametrize("name,content", [
    ("train.txt", b"1 3:1 4:0.5\n0 2:1\n"),                      # libsvm
    ("day_0", b"0\t1\t\t5\tab12\n"),                            # Criteo TSV
    ("data.txt", b"# a comment\n1 |user a b |ad c\n"),          # VW
    ("rows.txt", b"| a b\n"),                                    # VW, unlabeled
    ("rows2.txt", b"3:1 7:1\n"),                                 # libsvm, unlabeled
    ("x.ffm", b"1 0:3:1 1:5:1\n"),                               # libffm
    ("data.csv", b"label,a,b\n1,x,y\n"),                         # CSV with a header (by its name)
    ("day_1", gzip.compress(b"1 3:1\n", mtime=0)),                      # gzip (by its magic bytes)
])
def test_a_data_file_given_as_the_config_gets_the_set_form(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(config.ConfigError) as e:
        config.load_raw(str(path), [])
    message = str(e.value)
    assert "\n" not in message and "looks like a data file" in message
    hint = re.search(r"`hpcps train (--set \S+)`", message).group(1)
    # the form it shows works as it is printed
    assert config.load_raw(None, [hint.split(" ", 1)[1]])["data"]["train"] == str(path)


def test_a_broken_toml_file_keeps_its_toml_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nepochs 3\n")
    with pytest.raises(config.ConfigError, match=r"run\.toml: Expected '=' after a key"):
        config.load_raw(str(path), [])


def test_hpcps_train_data_file_exits_2_with_one_line(tmp_path):
    path = tmp_path / "train.svm"
    path.write_text("1 3:1 4:1\n0 2:1\n")
    proc = hpcps_run("train", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--set data.train={path}" in lines[0] and "Expected '='" not in lines[0]


def test_help_config_is_toml_that_reads_back_to_the_defaults():
    proc = hpcps_run("train", "--help-config")
    assert proc.returncode == 0, proc.stderr
    raw = config.tomllib.loads(proc.stdout)  # (tomli before Python 3.11)
    assert config.from_dict(raw) == config.Config()
    # every key is there, set to its default, with its description above it
    expected = {}
    for section, key, default, _ in config.keys():
        expected.setdefault(section, {})[key] = list(default) if isinstance(default, tuple) else default
    assert raw == expected
    lines = proc.stdout.splitlines()
    for section, key, _, text in config.keys():
        at = lines.index(f"[{section}]")
        at += next(i for i, line in enumerate(lines[at:]) if line.startswith(f"{key} = "))
        assert lines[at - 1].startswith("# ") and lines[at - 1][2:] in text, (section, key)


def test_every_key_is_described_where_it_is_defined():
    import dataclasses

    for section, key, _, text in config.keys():
        assert len(text) > 10, (section, key)
    assert set(config.FEATURES_HELP) == {f.name for f in dataclasses.fields(config.Features)}
    for cls in (config.Cluster, config.Data, config.Synth, config.Model, config.Optimizer, config.Train,
                config.Checkpoint):
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), cls.__name__


def test_a_benchmark_that_starts_its_own_jobs_refuses_to_run_under_mpiexec(tmp_path):
    """`mpiexec -n 2 hpcps bench deep` would start two drivers writing the same directory: the
    first rank says why in one line, every rank exits 2, and nothing is written."""
    from hpcps.bench.vw import mpiexec_command

    out = subprocess.run([mpiexec_command(), "-n", "2", *HPCPS, "bench", "deep", "--dir", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if "error" in l]
    assert lines == ["hpcps: error: hpcps bench deep starts its own mpiexec jobs: run it without mpiexec "
                     "(it was started as one of 2 ranks)"], out.stderr
    assert not (tmp_path / "b").exists()


def test_the_next_commands_a_run_prints_are_runnable_with_spaces_in_its_paths():
    """A run's outputs named 'my model.h5' (as a user's 'Run 1/' folder): each printed command
    parses back to the paths, as README says of them ("each runnable as printed")."""
    from hpcps.train import report
    cfg = config.from_dict(config.load_raw(None, ["train.model_out='my model.h5'", "train.metrics='run ü.jsonl'"]))
    text = report.next_steps(cfg, {"test": "te st.svm"}, "ck pt/step-1")
    commands = {line.split()[0]: shlex.split(line)[1:] for line in text.split("next:")[1].splitlines() if line.strip()}
    assert commands["export"] == ["hpcps", "export", "ck pt/step-1", "--out", "model.h5"], text
    assert commands["evaluate"] == ["hpcps", "eval", "--model", "my model.h5", "--data", "te st.svm"], text
    assert commands["predict"][3] == "my model.h5" and commands["plot"][2] == "run ü.jsonl", text
