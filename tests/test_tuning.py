"""The tuned knobs (``hpcps_kernels.tuning``): defined once, documented from that definition,
overridable per run, and never changing what a run computes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import golden
from hpcps_kernels import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=timeout)


def test_docs_table_is_generated_from_the_definitions():
    with open(os.path.join(ROOT, "docs", "tuning.md")) as f:
        text = f.read()
    assert tuning.markdown() in text, "docs/tuning.md is stale: regenerate with `python -m hpcps_kernels tuning`"


def test_each_knob_is_defined_once():
    """No module of the library or the kernels assigns a knob's name (or the old per-module
    prefetch distance ``AHEAD``) itself: it imports it from the tuning module."""
    names = [k.name for k in tuning.KNOBS] + ["AHEAD"]
    pattern = re.compile(r"^\s*(%s)\s*(:[^=]*)?=[^=]" % "|".join(names), re.M)
    found = []
    for top in ("hpcps", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and not path.endswith(os.path.join("kernels", "tuning.py")):
                    with open(path) as f:
                        found += [f"{os.path.relpath(path, ROOT)}: {m.group(0).strip()}" for m in pattern.finditer(f.read())]
    assert not found, found
    assert len(set(names)) == len(names)
    for k in tuning.KNOBS:
        assert k.reason and k.benchmark and k.default >= k.minimum, k
        assert getattr(tuning, k.name) == k.default  # (this test runs with no override set)


@pytest.mark.parametrize("value, words", [("x", "expected an integer"), ("0", "must be at least 1"),
                                          ("1.5", "expected an integer")])
def test_a_malformed_override_is_one_line_naming_the_variable(value, words):
    r = _python("import hpcps_kernels", {"HPCPS_TUNE_PREFETCH_KEYS": value}, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpcps: HPCPS_TUNE_PREFETCH_KEYS={value!r}: {words}"), r.stderr


def test_a_misspelt_knob_is_one_line_naming_it_and_the_knob_meant():
    r = _python("import hpcps_kernels", {"HPCPS_TUNE_PREFETCH_KEY": "8"}, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == "hpcps: HPCPS_TUNE_PREFETCH_KEY: no such knob (did you mean HPCPS_TUNE_PREFETCH_KEYS?); the " \
                       "knobs are in docs/tuning.md", r.stderr


def test_a_bad_server_threads_setting_is_one_line_before_the_job_starts(tmp_path):
    """It was a ValueError 'unexpected' (exit 1) once the server made its tables, after start-up."""
    data = tmp_path / "d.svm"
    data.write_text("1 3:1\n0 4:1\n")
    r = subprocess.run([sys.executable, "-m", "hpcps.cli", "train", "--set", f"data.train={str(data)!r}"],
                       env=dict(os.environ, HPCPS_SERVER_THREADS="3"), capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and out.strip() == "hpcps: error: HPCPS_SERVER_THREADS must be 1 or 2 (got '3')", out


def test_a_float_knob_takes_a_float_and_overrides_are_listed():
    env = {"HPCPS_TUNE_STATUS_EVERY_S": "0.5", "HPCPS_TUNE_PREFETCH_KEYS": "16"}  # (the second is its default)
    assert tuning.overridden(env) == {"STATUS_EVERY_S": 0.5}
    assert tuning.compiled_cache_suffix(env) == ""
    assert tuning.compiled_cache_suffix({"HPCPS_TUNE_PREFETCH_KEYS": "8"}).startswith("tuned-")
    assert (tuning.compiled_cache_suffix({"HPCPS_TUNE_PREFETCH_KEYS": "8"})
            != tuning.compiled_cache_suffix({"HPCPS_TUNE_PREFETCH_KEYS": "4"}))


LOOKUP = """
import json, numpy as np, numba.core.config as config
from hpcps_kernels import hashtable
keys = np.random.default_rng(3).integers(1, 2**40, 5000).astype(np.uint64)
idx = hashtable.KeyIndex()
idx.lookup_or_insert(keys)
slots = idx.lookup(np.concatenate([keys[::7], keys[:50] + np.uint64(1)]))
print(json.dumps({"prefetch": hashtable.PREFETCH_KEYS, "cache": config.CACHE_DIR, "slots": slots.tolist()}))
"""


def test_a_compiled_knob_compiles_apart_and_finds_the_same_slots(tmp_path):
    """A compiled knob overridden: the kernels see the new value (not the cache's stale one) and
    compile into a directory of their own; the results are the defaults' results."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    default = json.loads(_python(LOOKUP, env).stdout)
    tuned = json.loads(_python(LOOKUP, dict(env, HPCPS_TUNE_PREFETCH_KEYS="3")).stdout)
    again = json.loads(_python(LOOKUP, env).stdout)  # the defaults' cache is untouched
    assert (default["prefetch"], tuned["prefetch"], again["prefetch"]) == (16, 3, 16)
    assert default["cache"] == again["cache"] == str(tmp_path)
    assert os.path.dirname(tuned["cache"]) == str(tmp_path) and os.path.basename(tuned["cache"]).startswith("tuned-")
    assert default["slots"] == tuned["slots"] == again["slots"]
    assert -1 in default["slots"]


def test_runtime_knobs_at_their_extremes_train_the_golden_model(tmp_path, monkeypatch):
    """Every push and pull split over the server's two threads, every reply's payload apart,
    every gradient sent apart and every message placed and pooled, hash indexes instead of direct
    ones, waits that never spin, scoring a row at a time: the golden LR run's model, unchanged."""
    for name, value in {"PARALLEL_MIN_KEYS": 2, "PARALLEL_MIN_VALUES": 2, "PARALLEL_MIN_PULL_WORK": 2,
                        "EVAL_BATCH_ROWS": 1, "PARSE_BLOCK_BYTES": 1 << 20, "GRADS_APART_BYTES": 1,
                        "PLACED_BYTES": 1, "POOL_MIN_BYTES": 1, "DIRECT_MAX_BITS": 0, "POLL_SPIN_S": 0.0,
                        "POLL_MAX_SLEEP_S": 1e-5}.items():
        monkeypatch.setenv(tuning.ENV_PREFIX + name, str(value))
    monkeypatch.setenv("HPCPS_SERVER_THREADS", "2")
    name = "lr-bsp-1s2w"
    with open(golden.golden_path(name)) as f:
        want = json.load(f)
    problems = golden.compare(name, golden.run(name, str(tmp_path)), want)
    assert not problems, "\n".join(problems)
