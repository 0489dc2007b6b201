"""``hpcps bench inputs``: a whole training job from gzip-compressed text beside the same job from
plain text, in one run.

Generates synthetic Criteo-shaped rows (TSV) and a gzip copy of the training file (level 6, as
``gzip`` writes by default), then runs ``mpiexec -n R hpcps train`` (FTRL, no parse cache: every
job parses its text) on each, alternating plain and gzip ``--repeats`` times so that both meet
the same load on the machine. Reports each job's wall time, the medians and their ratio (gzip
over plain), the largest process's peak memory, and which inflate read the gzip file (ISA-L with
the ``isal`` extra, else zlib).
"""

from __future__ import annotations

import gzip
import os
import resource
import shutil
import statistics

from hpcps import outputs
from hpcps.bench.vw import run_hpcps
from hpcps.train import synth


def gzip_copy(path: str, out: str) -> str:
    """``out``, a gzip copy of ``path`` (made again unless it is newer than ``path``)."""
    if not (os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(path)):
        with open(path, "rb") as src, gzip.open(out + ".tmp", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(out + ".tmp", out)
    return out


def inflate() -> str:
    """What reads the gzip files (:func:`hpcps.train.inputs.open_stream`)."""
    try:
        import isal  # noqa: F401
    except ImportError:
        return "zlib (Python's gzip)"
    return "ISA-L (isal)"


def run(out_dir: str, rows: int, test_rows: int, ranks: int, repeats: int, epochs: int = 1,
        hash_bits: int = 24) -> dict:
    """The jobs' wall times, alternating plain and gzip, and the medians' ratio."""
    os.makedirs(out_dir, exist_ok=True)
    info = synth.generate(synth.bench_dir(out_dir, rows, test_rows, hash_bits), rows, test_rows, 39, False, 1,
                          hash_bits, formats=("criteo",), overwrite=True)
    plain = info.files["train_criteo"]
    files = {"plain": plain, "gzip": gzip_copy(plain, os.path.join(out_dir, "train.tsv.gz"))}
    walls: dict[str, list[float]] = {"plain": [], "gzip": []}
    rss: dict[str, list[float]] = {"plain": [], "gzip": []}
    cpu: dict[str, list[float]] = {"plain": [], "gzip": []}
    for i in range(repeats):
        for kind, path in files.items():
            before = _children_cpu_s()
            r = run_hpcps({"train_criteo": path, "test_criteo": info.files["test_criteo"]}, ranks, epochs, 0.1,
                          hash_bits, out_dir)
            cpu[kind].append(_children_cpu_s() - before)
            walls[kind].append(r["wall_s"])
            rss[kind].append(r["peak_rss_mb"])
            print(outputs.dumps({"repeat": i + 1, "input": kind, "wall_s": round(r["wall_s"], 3),
                                 "cpu_s": round(cpu[kind][-1], 3),
                                 "test_logloss": r["test_logloss"]}), flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"rows": rows, "ranks": ranks, "epochs": epochs, "repeats": repeats, "inflate": inflate(),
            "bytes": {k: os.path.getsize(p) for k, p in files.items()}, "wall_s": walls, "median_s": med,
            "peak_rss_mb": {k: max(v) for k, v in rss.items()},
            "gzip_over_plain": med["gzip"] / med["plain"], "cpu_s": cpu, "median_cpu_s": cpu_med,
            "cpu_gzip_over_plain": cpu_med["gzip"] / cpu_med["plain"]}


def _children_cpu_s() -> float:
    """User and system seconds of the jobs this process has run and waited for (every rank)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def format_results(r: dict) -> str:
    out = [f"{r['rows']:,} Criteo rows, mpiexec -n {r['ranks']} hpcps train, {r['epochs']} epoch(s), from text "
           f"(no parse cache); gzip read by {r['inflate']}; {r['repeats']} runs each, alternating",
           f"{'input':<6} {'MB':>8} {'wall s (each)':>24} {'median s':>9} {'CPU s (median)':>15} {'peak RSS MB':>12}"]
    for kind in ("plain", "gzip"):
        each = " ".join(f"{w:.2f}" for w in r["wall_s"][kind])
        out.append(f"{kind:<6} {r['bytes'][kind] / 2**20:>8.1f} {each:>24} {r['median_s'][kind]:>9.2f} "
                   f"{r['median_cpu_s'][kind]:>15.2f} {r['peak_rss_mb'][kind]:>12.0f}")
    out.append(f"gzip / plain (medians): {r['gzip_over_plain']:.2f}x wall, {r['cpu_gzip_over_plain']:.2f}x CPU time "
               f"(every rank's user + system: what a loaded machine's wall time does not show)")
    return "\n".join(out)
