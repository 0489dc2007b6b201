"""A model of your own: a linear SVM (hinge loss), trained by `hpcps train` like a built-in model.

run: mpiexec -n 3 python examples/custom_model.py

A model is a subclass of hpcps.Model with three methods: the sparse tables it declares, the loss
and gradients of a batch given its keys' pulled rows, and a batch's margins. Registered under a
name, it is `model.type = "svm"`: the trainer pulls, pushes, clocks, evaluates, checkpoints and
reports for it. Its maths runs on every batch, so it is a numba kernel. 1 server + 2 workers
train it on a synthetic CTR set made on the fly; the summary ends with the test AUC beside the
best achievable one.
"""

import sys

import numba

import hpcps
from hpcps.cli import main


@numba.njit(cache=True)
def hinge_forward_backward(indptr, pos, values, labels, w, grad, scale):
    """The rows' summed hinge loss max(0, 1 - y m), y = +-1 from labels 0/1, m the row's margin;
    its gradient (times ``scale``) into ``grad``, one value per unique key of the batch."""
    grad[:] = 0.0
    total = 0.0
    for r in range(indptr.shape[0] - 1):
        m = 0.0
        for j in range(indptr[r], indptr[r + 1]):
            m += w[pos[j]] * values[j]
        y = 2.0 * labels[r] - 1.0
        if y * m < 1.0:
            total += 1.0 - y * m
            for j in range(indptr[r], indptr[r + 1]):
                grad[pos[j]] -= scale * y * values[j]
    return total


@numba.njit(cache=True)
def linear_margins(indptr, pos, values, w, out):
    for r in range(indptr.shape[0] - 1):
        m = 0.0
        for j in range(indptr[r], indptr[r + 1]):
            m += w[pos[j]] * values[j]
        out[r] = m


class LinearSVM(hpcps.Model):
    def declare_tables(self, ctx, cfg):
        # one weight per key, updated on the servers by the configured optimizer
        return [ctx.sparse_table("w" + self.suffix, dim=1, optimizer=cfg.optimizer.name, params=cfg.optimizer.params,
                                 key_bits=cfg.data.hash_bits, features=cfg.features)]

    def forward_backward(self, batch, pos, params, grads, scale, dense_ready=None):
        return hinge_forward_backward(batch.indptr, pos, batch.values, batch.labels, params[0][:, 0], grads[0][:, 0],
                                      scale)

    def margins_into(self, batch, pos, params, out):
        linear_margins(batch.indptr, pos, batch.values, params[0][:, 0], out)


hpcps.register_model("svm", LinearSVM)  # on every rank, before the configuration is read

sys.exit(main(["train", "--set", "model.type=svm", "--set", "synth.rows=200000", "--set", "synth.test_rows=50000",
               "--set", "optimizer.name=adagrad", "--set", "optimizer.lr=0.05", "--set", "train.epochs=2",
               "--set", "train.batch_size=1000"]))
