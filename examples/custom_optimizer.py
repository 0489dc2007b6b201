"""A server function of your own: a registered update rule (clipped SGD with momentum).

run: mpiexec -n 3 python examples/custom_optimizer.py

Optimizers are one kind of server function: a numba kernel that updates a table's rows in place,
registered under a name with its hyper-parameters and state. Every rank registers the same
definition (the tables compare its fingerprint). Here each row is ``[w | velocity]``; gradients are
clipped to [-clip, clip] before the momentum step. 1 server + 2 workers fit the same regression as
custom_model.py; the first worker prints the final mean squared error.
"""

import numba
import numpy as np

import hpcps


@numba.njit(cache=True)
def clipped_momentum(rows, slots, grads, lr, momentum, clip):
    dim = grads.shape[1]
    for i in range(slots.shape[0]):
        r = rows[slots[i]]
        for d in range(dim):
            g = min(max(np.float64(grads[i, d]), -clip), clip)
            v = momentum * r[dim + d] + g
            r[dim + d] = v
            r[d] -= lr * v


hpcps.register_optimizer("clipped_momentum", {"lr": 0.1, "momentum": 0.9, "clip": 1.0}, clipped_momentum,
                         state_width=lambda dim: dim, ranges={"momentum": (0.0, 1.0, False, True)})

ctx = hpcps.init(servers=1, staleness=0)
weights = ctx.sparse_table("w", dim=1, optimizer="clipped_momentum", params={"lr": 0.05, "clip": 5.0})

if ctx.is_server:
    ctx.serve()
else:
    rng = np.random.default_rng(ctx.worker_index)
    w_true = np.random.default_rng(42).normal(size=1000)
    rows, per_row = 2000, 6
    keys = rng.integers(0, 1000, (rows, per_row)).astype(np.uint64)
    keys[:, -1] = 1000  # a bias feature in every row, learning the offset 3
    y = w_true[keys[:, :-1].astype(np.int64)].sum(axis=1) + 3.0
    for step in range(1000):
        batch = slice((step * 100) % rows, (step * 100) % rows + 100)
        k = keys[batch]
        uniq, pos = np.unique(k, return_inverse=True)
        w = weights.pull(uniq)[:, 0]
        err = w[pos.reshape(k.shape)].sum(axis=1) - y[batch]
        grad = np.zeros(len(uniq), dtype=np.float32)
        np.add.at(grad, pos.reshape(-1), np.repeat(err, per_row) / len(err))
        weights.wait(weights.push(uniq, grad))
        ctx.clock()
    w = weights.pull(np.arange(1001, dtype=np.uint64))[:, 0]
    mse = float(np.mean((w[keys.astype(np.int64)].sum(axis=1) - y) ** 2))
    if ctx.worker_index == 0:
        print(f"custom_optimizer: final mean squared error {mse:.4f}")
ctx.finalize()
