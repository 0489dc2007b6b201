"""``hpcps bench vw``: hpcps against Vowpal Wabbit on the same synthetic Criteo-shaped rows.

One command, one run: generates the data set (``hpcps gen-data``'s Zipf rows: 39 fields, keys in
2**hash_bits) as libsvm text (``key:1`` for each present field), Criteo TSV (the same rows; hpcps
hashes them to the same keys) and VW text (the same features, what VW reads), then times, as
whole processes from text input to a trained model and a test evaluation:

* ``mpiexec -n R hpcps train`` with FTRL for each input format in ``--formats``, each R in
  ``--ranks`` (a job is 1 server + R-1 workers, so R = 2 is the smallest: one worker), each epoch
  count in ``--epochs`` and each staleness in ``--staleness`` (0: BSP, the default consistency;
  s > 0: SSP s with ``train.pull_early``, the pipelined step); the summary gives its training
  loop's rate, the share of the loop the workers waited, and the largest process's peak memory;
* ``python -m vowpalwabbit --ftrl`` on one core, 1 pass, and 3 passes over its cache file; its
  peak memory is read while it runs.

``--repeat N`` rounds: in each, every hpcps job of an epoch count runs, then VW's of that count,
so each hpcps job has its VW reference from the same round (a pair). The table gives medians over
the rounds, and the ratio to VW as the median of the pairs' ratios (the machine's load moves both
sides of a pair alike). Examples/s = rows x epochs / wall time of the job (start-up, parsing and
evaluation included; the training loop's own rate is printed beside it). Test logloss and AUC are
computed the same way for both (exact, :mod:`hpcps_kernels.metrics`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
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
              staleness: int = 0, fmt: str = "criteo") -> dict:
    summary = os.path.join(out_dir, f"hpcps-{fmt}-{ranks}-{epochs}{f'-ssp{staleness}' if staleness else ''}.json")
    cmd = [mpiexec_command(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", "train",
           "--set", f'data.train="{files["train_" + fmt]}"', "--set", f'data.test="{files["test_" + fmt]}"',
           "--set", f'data.format="{fmt}"', "--set", f"data.hash_bits={hash_bits}",
           "--set", f"train.epochs={epochs}", "--set", "train.progress=false",
           "--set", 'optimizer.name="ftrl"', "--set", f"optimizer.alpha={alpha}", "--summary-json", summary]
    if staleness:
        cmd += ["--set", f"cluster.staleness={staleness}", "--set", "train.pull_early=true"]
    wall, _ = timed_run(cmd, 1800)
    s = json.load(open(summary))
    return {"system": "hpcps", "format": fmt, "ranks": ranks, "workers": ranks - 1, "epochs": epochs, "staleness": staleness,
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
    return {"system": "vw", "format": "vw", "ranks": 1, "workers": 1, "epochs": passes, "wall_s": wall_train + wall_test,
            "examples_per_s": rows * passes / (wall_train + wall_test), "loop_examples_per_s": None,
            "loop_wait_fraction": None, "peak_rss_mb": rss,
            "test_logloss": metrics.logloss(y, np.log(p) - np.log1p(-p)), "test_auc": metrics.auc(y, p)}


FORMATS = ("libsvm", "criteo")  # the text formats hpcps is timed on (VW reads its own text of the same rows)


def run(out_dir: str, rows: int, test_rows: int, ranks: list[int], epochs: list[int], alpha: float,
        vw_alpha: float, hash_bits: int = 24, staleness: list[int] = (0,), formats: list[str] = FORMATS,
        repeat: int = 3) -> list[dict]:
    """Every job of ``repeat`` rounds (see the module's docstring), each record with its ``round``;
    printed as it ends. VW's jobs are left out, said once, where it cannot run."""
    os.makedirs(out_dir, exist_ok=True)
    info = synth.generate(synth.bench_dir(out_dir, rows, test_rows, hash_bits), rows, test_rows, 39, False, 1,
                          hash_bits, formats=(*formats, "vw"), overwrite=True)
    results, vw_runs = [], True
    for rnd in range(repeat):
        for e in epochs:
            for fmt in formats:
                for s in staleness:
                    for r in ranks:
                        results.append({**run_hpcps(info.files, r, e, alpha, hash_bits, out_dir, s, fmt), "round": rnd})
                        print(outputs.dumps(results[-1]), flush=True)
            if not vw_runs:
                continue
            try:
                results.append({**run_vw(info.files, rows, e, vw_alpha, hash_bits, out_dir), "round": rnd})
                print(outputs.dumps(results[-1]), flush=True)
            except (RuntimeError, FileNotFoundError) as err:
                vw_runs = False
                print(f"vowpalwabbit could not run ({str(err).splitlines()[0]}); install it: pip install vowpalwabbit",
                      flush=True)
    return results


def _config(r: dict) -> tuple:
    return (r["system"], r["format"], r["ranks"], r.get("staleness", 0), r["epochs"])


def compare(results: list[dict]) -> list[dict]:
    """One row per configuration (system, format, ranks, staleness, epochs): the medians of its
    rounds, and for hpcps, against VW's job of the same epochs in the same round: the median of
    the pairs' speed ratios (VW's wall time over hpcps's: the same rows and epochs) with each
    pair's, and the peak memory ratio (hpcps's largest process over VW's, medians)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(_config(r), []).append(r)
    vw = {(r["epochs"], r["round"]): r for r in results if r["system"] == "vw"}
    rows = []
    for key, runs in groups.items():
        med = {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None
               for k in ("wall_s", "examples_per_s", "loop_examples_per_s", "loop_wait_fraction", "peak_rss_mb",
                         "test_logloss", "test_auc")}
        row = {"system": key[0], "format": key[1], "ranks": key[2], "staleness": key[3], "epochs": key[4],
               "rounds": len(runs), **med}
        refs = [(r, vw[(r["epochs"], r["round"])]) for r in runs if (r["epochs"], r["round"]) in vw]
        if key[0] != "vw" and refs:
            pair_ratios = [v["wall_s"] / r["wall_s"] for r, v in refs]
            vw_rss = statistics.median(v["peak_rss_mb"] for _, v in refs)
            row.update({"vs_vw": statistics.median(pair_ratios), "pair_ratios": pair_ratios,
                        "vw_wall_s": statistics.median(v["wall_s"] for _, v in refs), "vw_peak_rss_mb": vw_rss,
                        "rss_vs_vw": med["peak_rss_mb"] / vw_rss if vw_rss else None,
                        "dlogloss": med["test_logloss"] - statistics.median(v["test_logloss"] for _, v in refs)})
        rows.append(row)
    return rows


def format_results(results: list[dict], rows: int) -> str:
    """The medians table (one line per configuration) from :func:`compare`'s rows."""
    out = [f"{rows:,} training rows, 39 fields, FTRL; whole processes from text; medians of the rounds; "
           f"ex/s = rows x epochs / job wall time; vs VW = median of the pairs' ratios (VW's wall time over "
           f"hpcps's, the same round); RSS = the largest process's peak; sync: BSP, or SSP s with train.pull_early",
           f"{'system':<7} {'format':>6} {'ranks':>5} {'sync':>6} {'epochs':>6} {'n':>2} {'wall s':>7} {'ex/s':>10} "
           f"{'loop ex/s':>10} {'wait':>5} {'logloss':>8} {'AUC':>7} {'dlogloss':>9} {'vs VW':>6} {'pairs':>17} "
           f"{'RSS MB':>7} {'VW MB':>6} {'RSS/VW':>6}"]
    for r in compare(results):
        ours = "vs_vw" in r
        loop = f"{r['loop_examples_per_s']:,.0f}" if r["loop_examples_per_s"] else "-"
        wait = f"{100 * r['loop_wait_fraction']:.0f}%" if r["loop_wait_fraction"] is not None else "-"
        sync = "" if r["system"] == "vw" else f"SSP {r['staleness']}" if r["staleness"] else "BSP"
        pairs = "/".join(f"{x:.2f}" for x in r["pair_ratios"]) if ours else ""
        dll = f"{r['dlogloss']:+.4f}" if ours else ""
        speed = f"{r['vs_vw']:.2f}x" if ours else ""
        vw_mb = f"{r['vw_peak_rss_mb']:.0f}" if ours else ""
        mem = f"{r['rss_vs_vw']:.2f}x" if ours and r["rss_vs_vw"] else ""
        out.append(f"{r['system']:<7} {r['format']:>6} {r['ranks']:>5} {sync:>6} {r['epochs']:>6} {r['rounds']:>2} "
                   f"{r['wall_s']:>7.2f} {r['examples_per_s']:>10,.0f} {loop:>10} {wait:>5} {r['test_logloss']:>8.4f} "
                   f"{r['test_auc']:>7.4f} {dll:>9} {speed:>6} {pairs:>17} {r['peak_rss_mb']:>7.0f} {vw_mb:>6} {mem:>6}")
    return "\n".join(out)
