"""``hpcps plot``: runs' metrics side by side in one image."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HPCPS = [sys.executable, "-m", "hpcps.cli"]


def test_plot_draws_runs_side_by_side_and_rejects_what_is_not_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for name, alpha in (("a", 0.1), ("b", 0.3)):  # two short one-process runs
        m = tmp_path / f"{name}.jsonl"
        proc = subprocess.run(HPCPS + ["train", "--set", "synth.rows=4000", "--set", "synth.test_rows=2000", "--set", f"synth.dir={json.dumps(str(tmp_path / 'd'))}",
                                       "--set", "train.progress=false", "--set", f"optimizer.alpha={alpha}",
                                       "--set", f"train.metrics={json.dumps(str(m))}"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        paths.append(str(m))
    out = tmp_path / "run.png"
    proc = subprocess.run(HPCPS + ["plot", *paths, "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"wrote {out}" in proc.stdout, proc.stdout + proc.stderr
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(head[16:20], "big") >= 400  # a real image
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "step"\n')
    proc = subprocess.run(HPCPS + ["plot", str(bad), "-o", str(tmp_path / "x.png")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and f"{bad}:1: not a JSON line" in proc.stderr
