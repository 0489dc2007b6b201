"""A custom model on the library API: linear regression with a sparse table and a dense table.

run: mpiexec -n 3 python examples/custom_model.py

1 server + 2 workers. Each worker owns half of a synthetic regression problem y = x . w_true + b
over 1000 sparse features; per-feature weights live in a sparse table, the shared offset in a
dense table. Each step pulls the batch's keys, computes the squared-loss gradient, pushes it and
clocks (BSP). Prints the final mean squared error on the first worker.
"""

import numpy as np

import hpcps

ctx = hpcps.init(servers=1, staleness=0)
weights = ctx.sparse_table("w", dim=1, optimizer="sgd", params={"lr": 0.5})
offset = ctx.dense_table("b", size=1, optimizer="sgd", params={"lr": 0.25})  # both workers push to it

if ctx.is_server:
    ctx.serve()
else:
    rng = np.random.default_rng(ctx.worker_index)
    w_true = np.random.default_rng(42).normal(size=1000)
    rows, per_row = 2000, 5
    keys = rng.integers(0, 1000, (rows, per_row)).astype(np.uint64)
    y = w_true[keys.astype(np.int64)].sum(axis=1) + 3.0
    for step in range(1000):
        batch = slice((step * 100) % rows, (step * 100) % rows + 100)
        k = keys[batch]
        uniq, pos = np.unique(k, return_inverse=True)
        w = weights.pull(uniq)[:, 0]
        b = offset.pull()[0]
        err = w[pos.reshape(k.shape)].sum(axis=1) + b - y[batch]      # d loss / d prediction
        grad = np.zeros(len(uniq), dtype=np.float32)
        np.add.at(grad, pos.reshape(-1), np.repeat(err, per_row) / len(err))
        weights.wait(weights.push(uniq, grad))
        offset.push(np.array([err.mean()], dtype=np.float32))
        ctx.clock()
    w = weights.pull(np.arange(1000, dtype=np.uint64))[:, 0]
    mse = float(np.mean((w[keys.astype(np.int64)].sum(axis=1) + offset.pull()[0] - y) ** 2))
    if ctx.worker_index == 0:
        print(f"custom_model: final mean squared error {mse:.4f}")
ctx.finalize()
