"""docs/scaling.py, the scaling model: its bytes and times follow its stated formulas, the
bottleneck moves where docs/scaling.md says, and the script draws its picture."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import scaling  # noqa: E402


def test_one_pair_step_is_its_stated_sum():
    m, job = scaling.Machine(), scaling.Job(servers=1, workers=1)
    r = scaling.step(job, m)
    u = scaling.unique_keys(1000)
    assert r["bytes_per_worker"] == pytest.approx(u * 12 + u * 12)  # pull: keys out, rows back; push
    assert r["messages_per_worker"] == pytest.approx(4)
    worker = 1000 / m.worker_rows_per_s
    own = 4 * 5e-6 + r["bytes_per_worker"] / 10e9 + u / m.server_keys_per_s + 2 * m.request_s
    assert r["worker compute + round trips"] == pytest.approx(worker + own)
    assert r["step_s"] == pytest.approx(max(r["worker compute + round trips"], r["server keys + requests"],
                                            r["CPU shared by ranks"]))
    assert r["stragglers"] == 0  # one worker waits for nobody


def test_the_bottleneck_moves_from_workers_to_server_requests_and_more_keys_per_request_help():
    small, big = scaling.step(*scaling.cluster(1)), scaling.step(*scaling.cluster(1000))
    assert small["bottleneck"].startswith("worker") and big["bottleneck"].startswith("server")
    assert big["keys_per_request"] < 3  # 9,000 keys over 4,000 servers
    grouped = scaling.step(*scaling.cluster(1000, group=12, batch=10_000))
    assert grouped["examples_per_s"] > 10 * big["examples_per_s"]
    bsp, ssp = scaling.step(*scaling.cluster(100)), scaling.step(*scaling.cluster(100, staleness=2))
    assert ssp["stragglers"] == pytest.approx(bsp["stragglers"] / 3)


def test_the_script_prints_its_tables_and_draws_the_measured_points(tmp_path):
    pytest.importorskip("matplotlib")
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps([{"name": "1S+1W", "job": {"servers": 1, "workers": 1}, "examples_per_s": 3e5}]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "scaling.py"), "--measured", str(measured),
                          "--out", str(tmp_path / "s.png")], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "1000 nodes x 16" in out and "measured 1S+1W: 300,000 examples/s" in out
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
