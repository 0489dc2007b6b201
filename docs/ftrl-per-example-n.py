"""Would FTRL learn more per step if its ``n`` summed each example's squared gradient?

hpcps's FTRL adds the square of a step's summed gradient to ``n`` (``n += (sum_i g_i)**2``), as
any per-key optimizer behind a parameter server does; sequential FTRL adds one square per example
(``n += sum_i g_i**2``), which needs a second number per key in every push. This prototype (plain
numba, outside hpcps; test logloss matches hpcps's LR runs to about 0.0005) trains both on the
sweep's LR sets at the automatic batch size and at 2,000-row steps, and prints the test logloss.

    .venv/bin/python docs/ftrl-per-example-n.py
"""

import os
import sys
import tempfile

import numba as nb
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcps.train import synth  # noqa: E402


@nb.njit(cache=True)
def train(indptr, idx, vals, y, bs, epochs, alpha, beta, per_example, D):
    w, z, n = np.zeros(D), np.zeros(D), np.zeros(D)
    g, g2 = np.zeros(D), np.zeros(D)
    touched, mark = np.zeros(D, np.int64), np.zeros(D, np.bool_)
    rows = y.size
    for _ in range(epochs):
        for s in range(0, rows, bs):
            nt = 0
            for r in range(s, min(rows, s + bs)):
                m = w[D - 1]  # the bias
                for j in range(indptr[r], indptr[r + 1]):
                    m += w[idx[j]] * vals[j]
                d = 1 / (1 + np.exp(-m)) - y[r]
                for j in range(indptr[r], indptr[r + 1] + 1):
                    k, v = (idx[j], vals[j]) if j < indptr[r + 1] else (D - 1, 1.0)
                    if not mark[k]:
                        mark[k], touched[nt], nt = True, k, nt + 1
                    g[k] += d * v
                    g2[k] += (d * v) ** 2
            for q in range(nt):
                k = touched[q]
                nn = n[k] + (g2[k] if per_example else g[k] * g[k])
                z[k] += g[k] - (np.sqrt(nn) - np.sqrt(n[k])) / alpha * w[k]
                n[k] = nn
                w[k] = -z[k] / ((beta + np.sqrt(nn)) / alpha)
                g[k], g2[k], mark[k] = 0.0, 0.0, False
    return w


def load(path):
    ys, ks, vs, ip = [], [], [], [0]
    for line in open(path):
        t = line.split()
        ys.append(float(t[0]) > 0)
        for kv in t[1:]:
            k, v = kv.split(":")
            ks.append(int(k))
            vs.append(float(v))
        ip.append(len(ks))
    return np.array(ys, float), np.array(ks), np.array(vs), np.array(ip)


def main():
    sets = [("s3k-f6", 3000, 300, dict(fields=6, seed=4)), ("s6k-f10", 6000, 500, dict(fields=10, seed=9)),
            ("s30k-f39", 30000, 3000, dict(fields=39, seed=6)), ("s60k-f10", 60000, 5000, dict(fields=10, seed=8))]
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows, test, kw in sets:
            f = synth.generate(os.path.join(tmp, name), rows, test, formats=("libsvm",), **kw).files
            (ya, ka, va, ia), (yb, kb, vb, ib) = load(f["train_libsvm"]), load(f["test_libsvm"])
            _, inv = np.unique(np.concatenate([ka, kb]), return_inverse=True)
            D = inv.max() + 2
            auto = max(50, min(1000, rows // 2 // 128)) * 2  # 2 workers' steps, as the sweep's 3 ranks
            for bs in (auto, 2000):
                cells = []
                for per_example in (False, True):
                    for alpha in (0.1, 0.3):
                        w = train(ia, inv[:ka.size], va, ya, bs, 2, alpha, 1.0, per_example, D)
                        m = np.add.reduceat(w[inv[ka.size:]] * vb, ib[:-1]) * (np.diff(ib) > 0) + w[D - 1]
                        p = np.clip(1 / (1 + np.exp(-m)), 1e-15, 1 - 1e-15)
                        ll = -np.mean(yb * np.log(p) + (1 - yb) * np.log(1 - p))
                        cells.append(f"{'per example' if per_example else 'per step'} alpha {alpha}: {ll:.4f}")
                print(f"{name}, {bs} rows a step, 2 epochs: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
