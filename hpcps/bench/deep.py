"""``hpcps bench deep``: Wide & Deep on Criteo-shaped data, as whole ``mpiexec`` jobs from text,
beside one process running the same step in vectorised NumPy/SciPy.

The data: the Zipf-shaped synthetic Criteo set of ``bench vw`` (39 fields, one key per field).
The model: W&D, embeddings of 8 per field, MLP 312 → 64 → 32 → 1 (ReLU), AdaGrad on the
sparse tables, Adam on the MLP, batches of 1000 rows per worker, BSP, 1 epoch. Jobs:

* 2 ranks: 1 server, 1 worker;
* 4 ranks, one group: 1 server, 3 workers in a group (the MLP's gradients allreduced in it);
* 4 ranks, three groups: 1 server, 3 groups of 1 (the MLP synchronised through the server).

Each job reports what a user sees, examples over the wall time from the command to its exit
(start-up, parsing and compilation cache loads included), beside its loop's examples/s (what the
summary prints) and the per-stage seconds of the first worker's steps (pull, embed, mlp,
allreduce, push). The reference: the same step (the same batch size, tables indexed by key in
NumPy arrays, the same optimizers) written as a competent NumPy/SciPy user would, in one process;
its whole figure counts parsing the text (with hpcps's parser, the fastest at hand) and its
loop figure does not.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from hpcps import outputs
from hpcps.bench.vw import mpiexec_command, timed_run
from hpcps.train import synth

HASH_BITS = 16
K = 8
HIDDEN = (64, 32)


def run_job(train: str, ranks: int, groups: int, batch: int, out_dir: str) -> dict:
    tag = f"deep-{ranks}-{groups}"
    summary = os.path.join(out_dir, f"{tag}.json")
    metrics = os.path.join(out_dir, f"{tag}.jsonl")
    cmd = [mpiexec_command(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", "train",
           "--set", f"data.train={json.dumps(train)}", "--set", 'data.format="criteo"',
           "--set", f"data.hash_bits={HASH_BITS}", "--set", "train.epochs=1", "--set", "train.progress=false",
           "--set", f"train.batch_size={batch}", "--set", 'model.type="wdl"', "--set", f"model.factors={K}",
           "--set", f"model.hidden={list(HIDDEN)}", "--set", "model.init_scale=0.05",
           "--set", 'optimizer.name="adagrad"', "--set", "optimizer.lr=0.05",
           "--set", f"cluster.worker_groups={groups}", "--set", f"train.metrics={json.dumps(metrics)}",
           "--summary-json", summary]
    wall, _ = timed_run(cmd, 1800)
    s = json.load(open(summary))
    epoch = [json.loads(line) for line in open(metrics) if '"kind": "epoch"' in line][-1]
    stages = {k[len("stage_"):-2]: v for k, v in epoch.items() if k.startswith("stage_")}
    return {"ranks": ranks, "workers": ranks - 1, "groups": groups or ranks - 1, "wall_s": wall,
            "job_examples_per_s": s["examples"] / wall, "examples_per_s": s["examples_per_s"],
            "train_loss": s["train_loss"], "stages_s": stages}


def numpy_reference(train: str, batch: int, max_rows: int) -> dict:
    """One process: the W&D step in NumPy/SciPy over in-memory rows (see the module's text)."""
    import scipy.sparse as sp

    from hpcps.train import data as tdata
    from hpcps_kernels import deep as kdeep
    from hpcps_kernels import reference as ref

    t_parse = time.perf_counter()
    ds = tdata.load_part(train, 0, 1, "criteo", HASH_BITS, binary=True, fields=True)
    parse_s = time.perf_counter() - t_parse
    n = min(ds.rows, max_rows)
    F = 39
    space = F << HASH_BITS
    rng = np.random.default_rng(0)
    w = np.zeros(space + 1, np.float32)                  # the last slot: the bias key
    w_acc = np.full(space + 1, 0.1, np.float32)
    E = rng.normal(0, 0.05, (space, K)).astype(np.float32)
    E_acc = np.full((space, K), 0.1, np.float32)
    layers, size = kdeep.mlp_layout(F * K, HIDDEN)
    mlp = kdeep.mlp_init(F * K, HIDDEN, "relu", 0)
    m1, m2 = np.zeros(size, np.float32), np.zeros(size, np.float32)
    lr, lr_dense = 0.05, 0.001
    t0 = time.perf_counter()
    total = 0.0
    for step, lo in enumerate(range(0, n, batch), 1):
        b = ds.batch(lo, lo + batch)
        rows = b.rows
        keys = b.indices.copy()
        keys[keys == tdata.BIAS_KEY] = space
        uniq, inv = np.unique(keys, return_inverse=True)
        row = np.repeat(np.arange(rows), np.diff(b.indptr))
        X = sp.csr_matrix((b.values, (row, inv)), shape=(rows, uniq.shape[0]))
        emb = uniq < space
        field = (keys >> np.uint64(HASH_BITS)).astype(np.int64)
        Xf = sp.csr_matrix((b.values[keys < space], (row[keys < space] * F + field[keys < space], inv[keys < space])),
                           shape=(rows * F, uniq.shape[0]))
        Eb = np.zeros((uniq.shape[0], K), np.float32)
        Eb[emb] = E[uniq[emb]]
        x = (Xf @ Eb).reshape(rows, F * K).astype(np.float32)
        deep, grad = ref.mlp(mlp, F * K, HIDDEN, x, "relu", np.float32)
        m = X @ w[uniq] + deep
        p = 1.0 / (1.0 + np.exp(-m))
        y = b.labels
        total += float(np.sum(np.logaddexp(0.0, m) - y * m))
        dm = (p - y).astype(np.float32)
        g_mlp, dx = grad(dm)
        g_w = X.T @ dm
        g_E = Xf.T @ dx.reshape(rows * F, K)
        w_acc[uniq] += g_w * g_w
        w[uniq] -= lr * g_w / np.sqrt(w_acc[uniq])
        ue = uniq[emb]
        E_acc[ue] += g_E[emb] ** 2
        E[ue] -= lr * g_E[emb] / np.sqrt(E_acc[ue])
        m1 = 0.9 * m1 + 0.1 * g_mlp
        m2 = 0.999 * m2 + 0.001 * g_mlp * g_mlp
        mlp = mlp - lr_dense * (m1 / (1 - 0.9 ** step)) / (np.sqrt(m2 / (1 - 0.999 ** step)) + 1e-8)
    elapsed = time.perf_counter() - t0
    return {"examples_per_s": n / elapsed, "job_examples_per_s": n / (elapsed + parse_s * n / ds.rows),
            "train_loss": total / n, "rows": n}


def run(out_dir: str, rows: int, batch: int = 1000) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    train = synth.generate(synth.bench_dir(out_dir, rows, 10, 24), rows, 10, 39, False, 1, 24, formats=("criteo",),
                           overwrite=True).files["train_criteo"]
    results = {"rows": rows, "jobs": []}
    for ranks, groups in ((2, 0), (4, 1), (4, 0)):
        r = run_job(train, ranks, groups, batch, out_dir)
        results["jobs"].append(r)
        print(outputs.dumps(r), flush=True)
    results["numpy"] = numpy_reference(train, batch, min(rows, 300_000))
    print(outputs.dumps({"numpy": results["numpy"]}), flush=True)
    return results


def format_results(results: dict) -> str:
    ref = results["numpy"]
    out = [f"W&D, {results['rows']:,} Criteo-shaped (Zipf) rows, k={K}, MLP 312-{'-'.join(map(str, HIDDEN))}-1, "
           f"batch 1000/worker, BSP, 1 epoch; whole = from text to exit, loop = the training loop",
           f"{'job':<24} {'whole ex/s':>10} {'vs NumPy':>9} {'loop ex/s':>10} {'vs NumPy':>9} {'wall s':>7}"
           f"  stage seconds (first worker)"]

    def row(name, r, rest):
        return (f"{name:<24} {r['job_examples_per_s']:>10,.0f} {r['job_examples_per_s'] / ref['job_examples_per_s']:>8.2f}x "
                f"{r['examples_per_s']:>10,.0f} {r['examples_per_s'] / ref['examples_per_s']:>8.2f}x {rest}")

    for r in results["jobs"]:
        st = " ".join(f"{k} {v:.2f}" for k, v in r["stages_s"].items())
        out.append(row(f"{r['ranks']} ranks, {r['groups']} group(s)", r, f"{r['wall_s']:>7.1f}  {st}"))
    out.append(row("NumPy/SciPy, 1 process", ref, f"{'':>7}  ({ref['rows']:,} rows; whole = parse + loop)"))
    return "\n".join(out)
