"""``hpcps bench vw``: hpcps against Vowpal Wabbit on the same synthetic Criteo-shaped rows.

One command, one run: generates the data set (39 fields, keys in 2**hash_bits) as Criteo TSV (what
hpcps reads) and VW text (the same features, what VW reads), then times, as whole jobs from text
input to a trained model and a test evaluation:

* ``mpiexec -n R hpcps train`` with FTRL for each R in ``--ranks`` (a job is 1 server + R-1
  workers, so R = 2 is the smallest: one worker), each epoch count in ``--epochs`` and each
  staleness in ``--staleness`` (0: BSP, the default consistency; s > 0: SSP s with
  ``train.pull_early``, the pipelined step); the summary gives its training loop's rate, the
  share of the loop the workers waited, and peak memory;
* ``python -m vowpalwabbit --ftrl`` on one core, 1 pass, and 3 passes over its cache file.

Examples/s = rows x epochs / wall time of the job (startup, parsing and evaluation included; the
training loop's own rate is printed beside it). Test logloss and AUC are computed the same way for
both (exact, :mod:`hpcps_kernels.metrics`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from hpcps import outputs
from hpcps.train import synth
from hpcps.train.progress import vm_hwm_mb
from hpcps_kernels import metrics


def mpiexec_command() -> str:
    """The mpiexec that starts the benchmarks' jobs: ``HPCPS_MPIEXEC``, else the one beside this
    Python (the virtual environment's), else the first on the path."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return os.environ.get("HPCPS_MPIEXEC") or (beside if os.path.exists(beside) else shutil.which("mpiexec") or "mpiexec")


def timed_run(cmd: list[str], timeout: float) -> tuple[float, str]:
    """Run ``cmd``; returns (wall seconds, output)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:g} s") from None
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-2000:]}")
    return wall, out


def _timed_rss(cmd: list[str], timeout: float) -> tuple[float, float]:
    """Run ``cmd`` (one process); returns (wall seconds, its peak resident memory in MiB, read as
    VmHWM while it runs: rusage's maxrss would count what this process held when it forked)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    peak = 0.0
    while True:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, vm_hwm_mb(proc.pid) or 0.0)  # zombie-free while running; monotonic
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:g} s")
        time.sleep(0.005)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode(errors='replace')[-2000:]}")
    return wall, peak


def run_hpcps(files: dict, ranks: int, epochs: int, alpha: float, hash_bits: int, out_dir: str,
              staleness: int = 0) -> dict:
    summary = os.path.join(out_dir, f"hpcps-{ranks}-{epochs}{f'-ssp{staleness}' if staleness else ''}.json")
    cmd = [mpiexec_command(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", "train",
           "--set", f'data.train="{files["train_criteo"]}"', "--set", f'data.test="{files["test_criteo"]}"',
           "--set", 'data.format="criteo"', "--set", f"data.hash_bits={hash_bits}",
           "--set", f"train.epochs={epochs}", "--set", "train.progress=false",
           "--set", 'optimizer.name="ftrl"', "--set", f"optimizer.alpha={alpha}", "--summary-json", summary]
    if staleness:
        cmd += ["--set", f"cluster.staleness={staleness}", "--set", "train.pull_early=true"]
    wall, _ = timed_run(cmd, 1800)
    s = json.load(open(summary))
    return {"system": "hpcps", "ranks": ranks, "workers": ranks - 1, "epochs": epochs, "staleness": staleness,
            "wall_s": wall,
            "examples_per_s": s["examples"] / wall, "loop_examples_per_s": s["examples_per_s"],
            "loop_wait_fraction": s["max_wait_s"] / s["time_s"] if s["time_s"] else None,
            "peak_rss_mb": max(s.get("peak_rss_mb_worker", 0), s.get("peak_rss_mb_server", 0)),
            "test_logloss": s["test_logloss"], "test_auc": s["test_auc"]}


def run_vw(files: dict, rows: int, passes: int, alpha: float, hash_bits: int, out_dir: str) -> dict:
    vw = [sys.executable, "-m", "vowpalwabbit"]
    model = os.path.join(out_dir, f"vw-{passes}.model")
    cmd = [*vw, "-d", files["train_vw"], "--ftrl", "--ftrl_alpha", str(alpha), "--ftrl_beta", "1",
           "--loss_function", "logistic", "-b", str(hash_bits), "-f", model, "--quiet"]
    if passes > 1:
        cache = os.path.join(out_dir, "vw.cache")
        if os.path.exists(cache):
            os.remove(cache)
        cmd += ["--passes", str(passes), "--cache_file", cache, "--holdout_off"]
    wall_train, rss = _timed_rss(cmd, 1800)
    preds = os.path.join(out_dir, f"vw-{passes}.pred")
    wall_test, _ = _timed_rss([*vw, "-t", "-i", model, "-d", files["test_vw"], "-p", preds, "--link", "logistic",
                               "--quiet"], 600)
    p = np.clip(np.loadtxt(preds), 1e-15, 1 - 1e-15)
    with open(files["test_vw"], "rb") as f:
        y = np.array([1.0 if line.startswith(b"1 ") else 0.0 for line in f])
    return {"system": "vw", "ranks": 1, "workers": 1, "epochs": passes, "wall_s": wall_train + wall_test,
            "examples_per_s": rows * passes / (wall_train + wall_test), "loop_examples_per_s": None,
            "loop_wait_fraction": None, "peak_rss_mb": rss,
            "test_logloss": metrics.logloss(y, np.log(p) - np.log1p(-p)), "test_auc": metrics.auc(y, p)}


def run(out_dir: str, rows: int, test_rows: int, ranks: list[int], epochs: list[int], alpha: float,
        vw_alpha: float, hash_bits: int = 24, staleness: list[int] = (0,)) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    info = synth.generate(synth.bench_dir(out_dir, rows, test_rows, hash_bits), rows, test_rows, 39, False, 1,
                          hash_bits, formats=("criteo", "vw"), overwrite=True)
    results = []
    for e in epochs:
        for s in staleness:
            for r in ranks:
                results.append(run_hpcps(info.files, r, e, alpha, hash_bits, out_dir, s))
                print(outputs.dumps(results[-1]), flush=True)
        try:
            results.append(run_vw(info.files, rows, e, vw_alpha, hash_bits, out_dir))
            print(outputs.dumps(results[-1]), flush=True)
        except (RuntimeError, FileNotFoundError) as err:
            print(f"vowpalwabbit could not run ({str(err).splitlines()[0]}); install it: pip install vowpalwabbit",
                  flush=True)
    return results


def format_results(results: list[dict], rows: int) -> str:
    out = [f"{rows:,} training rows, 39 fields, FTRL; examples/s = rows x epochs / job wall time; "
           f"RSS = the largest process's peak; sync: BSP, or SSP s with train.pull_early",
           f"{'system':<7} {'ranks':>5} {'sync':>6} {'epochs':>6} {'wall s':>7} {'ex/s':>10} {'loop ex/s':>10} {'wait':>5} "
           f"{'RSS MB':>7} {'logloss':>8} {'AUC':>7} {'ex/s vs VW':>10} {'dlogloss':>9}"]
    vw = {r["epochs"]: r for r in results if r["system"] == "vw"}
    for r in results:
        ref = vw.get(r["epochs"])
        ratio = f"{r['examples_per_s'] / ref['examples_per_s']:.2f}x" if ref and r["system"] != "vw" else ""
        dll = f"{r['test_logloss'] - ref['test_logloss']:+.4f}" if ref and r["system"] != "vw" else ""
        loop = f"{r['loop_examples_per_s']:,.0f}" if r["loop_examples_per_s"] else "-"
        wait = f"{100 * r['loop_wait_fraction']:.0f}%" if r.get("loop_wait_fraction") is not None else "-"
        sync = "" if r["system"] == "vw" else f"SSP {r['staleness']}" if r.get("staleness") else "BSP"
        out.append(f"{r['system']:<7} {r['ranks']:>5} {sync:>6} {r['epochs']:>6} {r['wall_s']:>7.1f} {r['examples_per_s']:>10,.0f} "
                   f"{loop:>10} {wait:>5} {r.get('peak_rss_mb', 0):>7.0f} {r['test_logloss']:>8.4f} {r['test_auc']:>7.4f} "
                   f"{ratio:>10} {dll:>9}")
    return "\n".join(out)
