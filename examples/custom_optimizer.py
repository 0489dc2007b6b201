"""An optimizer of your own: clipped SGD with momentum, a registered server-side update rule.

run: mpiexec -n 3 python examples/custom_optimizer.py

An update rule is a numba kernel that updates a table's rows in place on the servers: each row is
``[w (dim) | state]``, here ``[w | velocity]``, and gradients are clipped to [-clip, clip] before
the momentum step. Registered under a name with its hyper-parameters (defaults and ranges) and
its state width, it is ``optimizer.name = "clipped_momentum"`` for any model, with its own keys
(``optimizer.clip``...) checked like a built-in's. Every rank registers the same definition (the
tables compare its fingerprint). 1 server + 2 workers train logistic regression with it on a
synthetic CTR set made on the fly; the summary ends with the test AUC beside the best achievable.
"""

import sys

import numba
import numpy as np

import hpcps
from hpcps.cli import main


@numba.njit(cache=True)
def clipped_momentum(rows, slots, grads, lr, momentum, clip):
    """rows: float32 (table rows, width 2 * dim); slots: int64, the rows to update, in order;
    grads: float32 (len(slots), dim); then the hyper-parameters, in the order registered."""
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

sys.exit(main(["train", "--set", "optimizer.name=clipped_momentum", "--set", "optimizer.lr=0.001",
               "--set", "optimizer.clip=1", "--set", "synth.rows=200000", "--set", "synth.test_rows=50000",
               "--set", "train.epochs=2", "--set", "train.batch_size=1000"]))
