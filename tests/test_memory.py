"""Peak memory per rank does not depend on the training file's size under a memory budget.

A worker streams its part under ``data.memory_mb``: it never holds more parsed rows than the
budget, whatever the file. The test trains on a file at least 10x the budget and compares every
rank's peak resident memory with the same job on a file of a few hundred rows: a worker may
exceed it by at most the budget plus SLACK_MB (allocator and queue noise); a server by the model's
growth (its rows, keys and index) plus SLACK_MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcps.train import synth

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]
BUDGET_MB = 6
SLACK_MB = 24


def _train(path: str, out: str, memory_mb: float, epochs: int = 2, env: dict | None = None) -> dict:
    cmd = [*mpiexec(), "-n", "2", *HPCPS, "train", "--set", f"data.train={json.dumps(path)}",
           "--set", 'data.format="criteo"', "--set", "data.hash_bits=20", "--set", f"train.epochs={epochs}",
           "--set", "train.progress=false", "--set", f"data.memory_mb={memory_mb}", "--summary-json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.load(open(out))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A Criteo file of 260,000 rows and one of 500 (the two tests' data, made once)."""
    d = tmp_path_factory.mktemp("memory")
    return tuple(synth.generate(str(d / name), rows, 10, fields=39, seed=5, hash_bits=20, formats=("criteo",))
                 for name, rows in (("big", 260_000), ("tiny", 500)))


def test_worker_peak_memory_stays_within_the_budget_on_a_file_ten_times_larger(files, tmp_path):
    big, tiny = files
    size_mb = os.path.getsize(big.files["train_criteo"]) / 2**20
    assert size_mb >= 10 * BUDGET_MB, size_mb
    small = _train(tiny.files["train_criteo"], str(tmp_path / "tiny.json"), BUDGET_MB)
    large = _train(big.files["train_criteo"], str(tmp_path / "big.json"), BUDGET_MB)
    assert large["examples"] == 2 * 260_000
    growth = large["peak_rss_mb_worker"] - small["peak_rss_mb_worker"]
    if os.environ.get("SHOW"):
        print(f"file {size_mb:.0f} MB, budget {BUDGET_MB} MB: worker peak {small['peak_rss_mb_worker']:.0f} -> "
              f"{large['peak_rss_mb_worker']:.0f} MB, server {small['peak_rss_mb_server']:.0f} -> "
              f"{large['peak_rss_mb_server']:.0f} MB")
    assert growth <= BUDGET_MB + SLACK_MB, (size_mb, small["peak_rss_mb_worker"], large["peak_rss_mb_worker"])
    # the server holds the model: up to 2**20 keys of FTRL rows (12 bytes) and keys (8 bytes),
    # allocated with room to grow (x 1.5), plus the index
    model_mb = 2**20 * (12 + 8) * 1.5 / 2**20
    assert large["peak_rss_mb_server"] - small["peak_rss_mb_server"] <= model_mb + SLACK_MB


def test_one_epoch_at_the_defaults_holds_no_more_than_its_parse_ahead_whatever_the_file(files, tmp_path):
    """data.memory_mb = 0 (the default) keeps a part in memory for later epochs; with one epoch
    nothing is kept, and the rows parsed ahead are held to PARSE_AHEAD_BYTES (here 4 MiB)."""
    big, tiny = files
    ahead = {"HPCPS_TUNE_PARSE_AHEAD_BYTES": str(4 << 20)}
    small = _train(tiny.files["train_criteo"], str(tmp_path / "tiny.json"), 0, 1, ahead)
    large = _train(big.files["train_criteo"], str(tmp_path / "big.json"), 0, 1, ahead)
    assert large["examples"] == 260_000
    parsed_mb = 260_000 * 40 * 8 / 2**20  # the part's keys alone, parsed: 79 MiB
    growth = large["peak_rss_mb_worker"] - small["peak_rss_mb_worker"]
    assert growth <= 4 + SLACK_MB < parsed_mb, (small["peak_rss_mb_worker"], large["peak_rss_mb_worker"])


def _malloc_tuned(env: dict) -> str:
    code = "from hpcps.malloc import keep_freed_memory; print(keep_freed_memory())"
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "HPCPS_MALLOC_TUNE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_freed_memory_is_kept_unless_the_user_sets_the_allocator():
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert _malloc_tuned({}) == "True"
    assert _malloc_tuned({"HPCPS_MALLOC_TUNE": "0"}) == "False"
    assert _malloc_tuned({"MALLOC_ARENA_MAX": "2"}) == "False"  # the user's own glibc settings win
