"""A server function of your own: a sparse dot product computed where the weights live, on the library API.

run: mpiexec -n 4 python examples/custom_server_function.py

2 servers + 2 workers. First the library API directly (``init``, a sparse and a dense table,
``push``/``pull``/``clock``): each worker owns half of a synthetic regression problem
y = x . w_true + b over 1000 sparse features, and trains it under BSP. Then a server function: a
request kind that runs on the servers over the keys they own. ``dot`` takes a value per key and
returns the sum of value x weight over the server's keys; the worker gets the sum over the
servers, without pulling a weight. The first worker checks it against NumPy on pulled weights.
"""

import numpy as np

import hpcps


def dot(shard, keys, args):
    """On a server: keys (uint64, the requested keys this server owns) and their arguments
    (float32, (len(keys), in_width)); returns out_width float32 values (a reduction, per_key=False)."""
    rows = np.empty((len(keys), shard.spec.dim), dtype=np.float32)
    shard.pull(keys, rows)  # the keys' current rows
    return np.array([np.dot(rows[:, 0].astype(np.float64), args[:, 0])], dtype=np.float32)


hpcps.register_server_function("dot", dot, out_width=1, in_width=1, per_key=False)  # on every rank

ctx = hpcps.init(servers=2, staleness=0)
weights = ctx.sparse_table("w", dim=1, optimizer="sgd", params={"lr": 0.5})
offset = ctx.dense_table("b", size=1, optimizer="sgd", params={"lr": 0.25})  # both workers push to it
dot_handle = ctx.server_function("dot")  # collective: every rank registered the same definition

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
    every_key = np.arange(1000, dtype=np.uint64)
    w = weights.pull(every_key)[:, 0]
    mse = float(np.mean((w[keys.astype(np.int64)].sum(axis=1) + offset.pull()[0] - y) ** 2))
    x = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    on_servers = float(weights.call(dot_handle, every_key, x.reshape(-1, 1))[0])
    with_numpy = float(np.dot(w.astype(np.float64), x))
    if ctx.worker_index == 0:
        print(f"custom_server_function: final mean squared error {mse:.4f}")
        print(f"dot on the servers {on_servers:.6f}, with NumPy {with_numpy:.6f}, "
              f"relative difference {abs(on_servers - with_numpy) / abs(with_numpy):.2e}")
ctx.finalize()
