"""``hpcps bench margins``: when does computing on the servers win?

Trains the same LR (FTRL, BSP) twice on each of two data sets, as whole ``mpiexec`` jobs from text:
``model.compute = "workers"`` (pull the batch's unique keys' weights, push their gradients:
24 bytes per unique key a step, plus the headers) and ``"servers"`` (send every nonzero's key,
value and row: 16 bytes per nonzero and 8 per row out, 8 per row back, and 8 per row of residuals:
weights never travel). It reports the bytes the workers sent and received per example and the
examples/s of each, side by side:

* **zipf**: the Criteo-shaped Zipf set of ``bench vw`` (popular keys repeat within a batch, so a
  batch has far fewer unique keys than nonzeros: the pull path sends less);
* **rare**: the same number of nonzeros per row drawn uniformly from 2^26 keys (almost every
  nonzero is a key of its own in the batch: the margins path sends less, and the servers do the
  gradient work).

On one node the bytes are not the bottleneck (MPI moves GB/s through shared memory); across a
network, where bytes are, the bytes column is what carries over.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from hpcps import outputs
from hpcps.bench.vw import mpiexec_command, timed_run
from hpcps.train import synth


def _rare(path: str, rows: int, nnz: int, bits: int, seed: int) -> None:
    """A libsvm file whose rows have ``nnz`` keys drawn uniformly from 2**bits (ascending); written
    whole or not at all (a file cut short by a killed run is not reused)."""
    rng = np.random.default_rng(seed)
    with outputs.replacing(path) as tmp, open(tmp, "w") as f:
        for lo in range(0, rows, 50_000):
            n = min(50_000, rows - lo)
            keys = np.sort(rng.integers(0, 2**bits, (n, nnz)), axis=1)
            w = np.where(keys % 7 == 0, 0.3, -0.05)
            labels = (rng.random(n) < 1 / (1 + np.exp(-w.sum(axis=1)))).astype(int)
            f.write("".join(f"{y} " + " ".join(f"{k}:1" for k in row) + "\n" for y, row in zip(labels, keys)))


def run_job(train: str, fmt: str, compute: str, hash_bits: int, ranks: int, batch: int, out_dir: str) -> dict:
    summary = os.path.join(out_dir, f"margins-{os.path.basename(train)}-{compute}.json")
    cmd = [mpiexec_command(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", "train",
           "--set", f"data.train={json.dumps(train)}", "--set", f'data.format="{fmt}"',
           "--set", f"data.hash_bits={hash_bits}", "--set", "train.epochs=1", "--set", "train.progress=false",
           "--set", f"train.batch_size={batch}", "--set", f'model.compute="{compute}"',
           "--set", 'optimizer.name="ftrl"', "--summary-json", summary]
    wall, _ = timed_run(cmd, 1800)
    s = json.load(open(summary))
    return {"compute": compute, "wall_s": wall, "examples_per_s": s["examples"] / wall,
            "loop_examples_per_s": s["examples_per_s"], "bytes_per_example":
            (s["bytes_sent"] + s["bytes_received"]) / s["examples"], "train_loss": s["train_loss"]}


def run(out_dir: str, rows: int, ranks: int = 2, batch: int = 1000) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    zipf = synth.generate(synth.bench_dir(out_dir, rows, 10, 24), rows, 10, 39, False, 1, 24, formats=("criteo",),
                          overwrite=True).files["train_criteo"]
    rare = os.path.join(out_dir, f"rare-{rows}.svm")  # (another --rows: another file)
    if not os.path.exists(rare):
        _rare(rare, rows, 39, 26, 2)
    results = []
    for name, path, fmt, bits in (("zipf", zipf, "criteo", 24), ("rare", rare, "libsvm", 26)):
        for compute in ("workers", "servers"):
            r = {"data": name, **run_job(path, fmt, compute, bits, ranks, batch, out_dir)}
            results.append(r)
            print(outputs.dumps(r), flush=True)
    return results


def format_results(results: list[dict], rows: int) -> str:
    out = [f"{rows:,} rows a set, 39 nonzeros a row, LR + FTRL, BSP, 1 epoch; bytes = what the workers sent and "
           f"received, per example",
           f"{'data':<5} {'compute':<8} {'wall s':>7} {'ex/s':>10} {'loop ex/s':>10} {'bytes/ex':>9} {'vs workers':>11}"]
    base = {r["data"]: r for r in results if r["compute"] == "workers"}
    for r in results:
        b = base[r["data"]]
        rel = (f"{r['bytes_per_example'] / b['bytes_per_example']:.2f}x bytes, "
               f"{r['examples_per_s'] / b['examples_per_s']:.2f}x speed") if r is not b else ""
        out.append(f"{r['data']:<5} {r['compute']:<8} {r['wall_s']:>7.1f} {r['examples_per_s']:>10,.0f} "
                   f"{r['loop_examples_per_s']:>10,.0f} {r['bytes_per_example']:>9.0f} {rel:>11}")
    return "\n".join(out)
