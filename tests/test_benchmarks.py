"""The benchmarks run and print what they promise (small sizes; speed is not asserted here)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402


def test_kernel_profiler_reports_speedups_and_rooflines():
    out = subprocess.run([sys.executable, "-m", "hpcps_kernels", "bench", "--quick", "--rows", "4000", "--repeat", "1",
                          "--json", "--kernel", "lr", "--kernel", "unique", "--kernel", "parse", "--kernel", "metrics", "--kernel", "deep"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows[0]["roofline"]["seq_read_gb_s"] > 0 and rows[0]["roofline"]["random_access_m_s"] > 0
    names = [r["kernel"] for r in rows[1:]]
    assert any(n.startswith("lr_grad") for n in names) and "parse libsvm" in names and "auc" in names
    assert {"embed_pool/39 fields k=8", "embed_scatter/39 fields k=8", "mlp fwd+bwd/312-400-400-1"} <= set(names)
    for r in rows[1:]:
        assert r["time_s"] > 0 and (r["speedup"] is None or r["speedup"] > 0)


# Rank 0 runs the MPI benchmark's measurement against rank 1, the test's own peer: it counts the
# bytes of every message from MPI's status, holds each ping DELAY_S before it answers, and rank 0
# times each size on its own clock. (The peer follows bench_mpi.run's exchanges: a warm-up and
# REPS ping-pongs with blocking calls, tags 5/6, then with the sleeping wait, tags 1/2; a barrier.
# Any other exchange ends in the subprocess's timeout.)
PEER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    from hpcps.bench import mpi as bench_mpi

    sizes, reps, delay = json.loads(sys.argv[1])
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        rows = []
        for n in sizes:
            t = time.perf_counter()
            rows += bench_mpi.run(comm, sizes=[n], reps=reps)
            rows[-1]["elapsed_s"] = time.perf_counter() - t
        open("rows.json", "w").write(json.dumps(rows))  # (a file each: the ranks' printed lines can interleave)
    else:
        counted, status = [], MPI.Status()
        for n in sizes:
            buf = np.empty(n + 4096, np.uint8)  # room for more than the size asked for
            for ping, pong in ((5, 6), (1, 2)):
                for _ in range(reps + 1):
                    comm.Recv(buf, source=0, tag=ping, status=status)
                    counted.append(status.Get_count(MPI.BYTE))
                    time.sleep(delay)
                    comm.Send(buf[:counted[-1]], dest=0, tag=pong)
            comm.Ibarrier().Wait()  # (a nonblocking barrier matches only a nonblocking one)
        open("counted.json", "w").write(json.dumps(counted))
""")
DELAY_S = 0.005


def test_mpi_benchmark_reports_blocking_and_sleeping_waits_side_by_side(tmp_path):
    proc = subprocess.run([*mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.cli", "bench", "mpi", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["bytes"] for r in rows] == [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26]
    assert all(r["one_way_s"] > 0 and r["wait_one_way_s"] > 0 and r["wait_cpu_s"] > 0 for r in rows)
    # its figures against what an independent peer counts, and a clock of the test's own
    sizes, reps = [1 << 10, 1 << 20, 1 << 23], 3
    (tmp_path / "peer.py").write_text(PEER_SCRIPT)
    proc = subprocess.run([*mpiexec(), "-n", "2", sys.executable, str(tmp_path / "peer.py"),
                           json.dumps([sizes, reps, DELAY_S])], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows, counted = (json.loads((tmp_path / name).read_text()) for name in ("rows.json", "counted.json"))
    assert counted == [n for n in sizes for _ in range(2 * (reps + 1))]  # every message, exactly its size
    assert [r["bytes"] for r in rows] == sizes and all(r["reps"] == reps for r in rows)
    at_least_median = reps // 2 + 1  # of the ping-pongs of each kind, these take their median or more
    for r in rows:
        for speed in ("gb_per_s", "wait_gb_per_s"):
            # at most the bytes over half the peer's delay, which every round trip holds ...
            assert r[speed] <= r["bytes"] / (DELAY_S / 2) / 1e9, (speed, r)
            # ... and at least the bytes over the part of the time measured here that its median
            # one-way time can take (half a round trip; those of both kinds all fit in it)
            assert r[speed] >= r["bytes"] / (r["elapsed_s"] / (2 * at_least_median)) / 1e9, (speed, r)


def test_ps_benchmark_reports_throughput_beside_raw_mpi():
    proc = subprocess.run([*mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.cli", "bench", "ps", "--sizes",
                           "1000,20000", "--repeat", "2", "--json", "--key-bits", "24"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ops = {(r["op"], r.get("keys")) for r in rows}
    assert {("push+apply", 1000), ("pull", 20000), ("waiting", None), ("requests", 100), ("requests", 1000)} <= ops
    # a server's cost per small request: bursts of each kind at 100 and 1,000 keys, beside raw MPI
    small = [r for r in rows if r["op"] == "requests"]
    assert {(r["request"], r["keys"]) for r in small} == {(k, n) for k in ("pull", "push+apply", "push-pull") for n in (100, 1000)}
    for r in small:  # the server's own time of a request fits in the burst's wall time a request
        assert r["ratio"] == pytest.approx(r["us_per_request"] / r["raw_mpi_us_per_request"]), r
        assert 0 < r["server_us"] <= r["us_per_request"], r
    # a push-pull of n keys (dim 1) with each traffic filter: the wire format's bytes both ways; and of
    # two such tables in one request (a tables push-pull: their numbers and counts, the keys once)
    filtered = {(r["filter"], r["keys"], r["tables"]): r for r in rows if r["op"] == "filter"}
    n = 2000
    for name, size, two in (("none", 136 + 24 * n, 200 + 32 * n), ("wire fp16", 136 + 20 * n, 200 + 24 * n),
                            ("wire bf16", 136 + 20 * n, 200 + 24 * n), ("key_cache", 152 + 8 * n, 216 + 16 * n),
                            ("fp16+key_cache", 152 + 4 * n, 216 + 8 * n)):
        for tables, b, none in ((1, size, 136 + 24 * n), (2, two, 200 + 32 * n)):
            assert filtered[name, n, tables]["bytes_per_request"] == b, filtered[name, n, tables]
            assert filtered[name, n, tables]["bytes_ratio"] == pytest.approx(b / none), filtered[name, n, tables]
    assert filtered["push_threshold", n, 1]["bytes_ratio"] < 1 and filtered["push_threshold", n, 2]["bytes_ratio"] < 1
    rows = [r for r in rows if r["op"] not in ("requests", "filter")]
    assert all(0 < r["roofline_ratio"] and 0 < r["ratio"] for r in rows if r["op"] != "waiting")
    # the server's own time on each request (its clock, another process) is part of its round trip
    assert all(0 < r["server_s"] < r["time_s"] for r in rows if r["op"] != "waiting"), rows
    # GB/s: the bytes of a request and of its reply, as the server received and sent them
    by = {(r["op"], r["keys"]): r for r in rows if r["op"] != "waiting"}
    for r in by.values():
        assert r["gb_per_s"] * r["time_s"] * 1e9 == pytest.approx(r["request_bytes"] + r["reply_bytes"], rel=1e-9), r
    # and those are the wire format's sizes (dim 1): a push carries a key (8 bytes) and a gradient
    # (4) a key, acknowledged by a reply of one size; a pull sends keys and gets 4-byte rows back
    push, pull, more = by["push+apply", 20000], by["pull", 20000], 20000 - 1000
    assert push["request_bytes"] - by["push+apply", 1000]["request_bytes"] == 12 * more
    assert push["reply_bytes"] == by["push+apply", 1000]["reply_bytes"] > 0
    assert pull["request_bytes"] - by["pull", 1000]["request_bytes"] == 8 * more
    assert pull["reply_bytes"] - by["pull", 1000]["reply_bytes"] == 4 * more
    assert push["request_bytes"] - 12 * 20000 == pull["request_bytes"] - 8 * 20000 > 0  # one header's size
    # server GB/s: the memory its kernels move a key (FTRL dim 1: a push reads a 4-byte gradient
    # and reads and writes a row of w, z and n; a pull reads a 4-byte value and writes it out)
    for r in by.values():
        per_key = 4 + 2 * 3 * 4 if r["op"] == "push+apply" else 2 * 4
        assert r["server_gb_per_s"] * r["server_s"] * 1e9 == pytest.approx(r["keys"] * per_key, rel=1e-9), r
    waiting = [r for r in rows if r["op"] == "waiting"][0]
    # the polling wait does not burn a core; a blocking Recv does, as much as it gets of one (on a
    # loaded machine it shares it: 36 % once here), so the two are compared within this run
    assert waiting["hpcps wait"] < 0.2 and 5 * waiting["hpcps wait"] < waiting["blocking Recv"], waiting
    assert "idle server CPU" in proc.stdout


def test_vw_benchmark_runs_both_systems_on_both_formats_in_pairs(tmp_path):
    pytest.importorskip("vowpalwabbit")
    out = tmp_path / "vw.json"
    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "bench", "vw", "--dir", str(tmp_path), "--rows", "20000",
                           "--test-rows", "2000", "--epochs", "1", "--repeat", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    print(proc.stdout[-1500:])
    table = proc.stdout.splitlines()
    header = next(line for line in table if line.startswith("system")).split()
    for column in ("format", "wait", "vs", "pairs", "RSS", "VW", "RSS/VW"):
        assert column in header, header
    ours = [line.split() for line in table if line.startswith("hpcps ")]
    # by default: libsvm text and Criteo TSV, 2 ranks, BSP; 2 rounds, so 2 pairs' ratios each
    assert sorted(r[1] for r in ours) == ["criteo", "libsvm"] and {r[3] for r in ours} == {"BSP"}
    assert all(r[5] == "2" and len(r[-4].split("/")) == 2 for r in ours), ours
    doc = json.loads(out.read_text())
    runs, rows = doc["runs"], doc["table"]
    assert sorted((r["system"], r["format"], r["round"]) for r in runs) == [
        ("hpcps", "criteo", 0), ("hpcps", "criteo", 1), ("hpcps", "libsvm", 0), ("hpcps", "libsvm", 1),
        ("vw", "vw", 0), ("vw", "vw", 1)]
    vw = {r["round"]: r for r in runs if r["system"] == "vw"}
    for row in (r for r in rows if r["system"] == "hpcps"):
        mine = sorted((r for r in runs if r["system"] == "hpcps" and r["format"] == row["format"]),
                      key=lambda r: r["round"])
        # each pair's ratio is VW's wall time over hpcps's in the same round; the row gives their median
        assert row["pair_ratios"] == [vw[r["round"]]["wall_s"] / r["wall_s"] for r in mine]
        assert row["vs_vw"] == pytest.approx(sum(row["pair_ratios"]) / 2)
        assert row["rss_vs_vw"] == pytest.approx(row["peak_rss_mb"] / row["vw_peak_rss_mb"]) and row["vw_peak_rss_mb"] > 0
    # the same rows read from either text train the same model
    assert len({r["test_logloss"] for r in runs if r["system"] == "hpcps"}) == 1


def test_margins_benchmark_compares_bytes_and_speed_of_both_paths(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "bench", "margins", "--dir", str(tmp_path),
                           "--rows", "6000"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(r["data"], r["compute"]) for r in rows} == {(d, c) for d in ("zipf", "rare") for c in ("workers", "servers")}
    by = {(r["data"], r["compute"]): r["bytes_per_example"] for r in rows}
    # what the message sizes imply: Zipf batches repeat keys (the pull path sends less); uniform keys
    # over 2^26 hardly repeat (the margins path sends less)
    assert by[("zipf", "servers")] > by[("zipf", "workers")]
    assert by[("rare", "servers")] < by[("rare", "workers")]
    assert "vs workers" in proc.stdout


def test_deep_benchmark_reports_stages_beside_numpy(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "bench", "deep", "--dir", str(tmp_path),
                           "--rows", "6000"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    jobs = [r for r in lines if "ranks" in r]
    assert [(r["ranks"], r["groups"]) for r in jobs] == [(2, 1), (4, 1), (4, 3)]
    for r in jobs:
        assert r["examples_per_s"] > 0 and {"pull", "embed", "mlp", "allreduce", "push"} <= set(r["stages_s"])
        assert 0.3 < r["train_loss"] < 0.8
    ref = [r["numpy"] for r in lines if "numpy" in r][0]
    assert ref["examples_per_s"] > 0 and 0.3 < ref["train_loss"] < 0.8
    assert "vs NumPy" in proc.stdout


def test_inputs_benchmark_times_gzip_beside_plain_text_alternating(tmp_path):
    out = tmp_path / "inputs.json"
    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "bench", "inputs", "--dir", str(tmp_path), "--rows",
                           "5000", "--test-rows", "500", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.load(open(out))
    assert [len(res["wall_s"][k]) for k in ("plain", "gzip")] == [2, 2]
    assert res["bytes"]["gzip"] < res["bytes"]["plain"] and res["gzip_over_plain"] > 0
    assert all(c > 0 for k in ("plain", "gzip") for c in res["cpu_s"][k]) and res["cpu_gzip_over_plain"] > 0
    order = [json.loads(line)["input"] for line in proc.stdout.splitlines() if line.startswith('{"repeat"')]
    assert order == ["plain", "gzip", "plain", "gzip"]  # alternating: both meet the same load
    assert "gzip / plain (medians):" in proc.stdout
