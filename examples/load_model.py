"""Scoring in your own Python: a trained model file loaded with ``hpcps.load_model``, no MPI.

run: hpcps gen-data /tmp/hpcps-score --rows 50000 --test-rows 10000 --formats libsvm && hpcps train --set data.train=/tmp/hpcps-score/train.svm --set train.epochs=2 --set train.model_out=/tmp/hpcps-score/model.h5 && python examples/load_model.py /tmp/hpcps-score/model.h5 /tmp/hpcps-score/test.svm

The predictor scores a data file in any format hpcps reads (read with the model's hash bits) or
a SciPy sparse matrix whose column j is the libsvm feature j, with scikit-learn's names:
``predict_proba``, ``predict`` and ``decision_function``.
"""

import sys

import numpy as np

import hpcps
from hpcps_kernels import metrics


def main(model_path: str, test_path: str) -> None:
    model = hpcps.load_model(model_path)
    p = model.predict_proba(test_path)[:, 1]  # P(click) of each row
    labels = np.array([float(line.split(None, 1)[0]) for line in open(test_path)])
    print(f"{model.kind} model, {len(p)} rows scored: mean P(click) {p.mean():.4f}, "
          f"clicks {labels.mean():.4f}")
    print(f"test auc {metrics.auc(labels, model.decision_function(test_path)):.5f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
