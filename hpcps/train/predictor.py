"""A trained model in this process, for scoring: :func:`load_model` (``hpcps.load_model``).

No MPI and no servers: the model file's tables are looked up in memory, and a row's margin is
computed as training computes it (:class:`hpcps.train.models.Scorer`). Rows come as a SciPy
sparse matrix (its columns are libsvm feature indices) or as a data file in any format hpcps
reads; ``hpcps eval`` and ``hpcps predict`` score through the same class.
"""

from __future__ import annotations

import os

import numpy as np

from hpcps import config
from hpcps.train import data as tdata
from hpcps.train import tables
from hpcps.train.data import BIAS_KEY, Dataset
from hpcps.train.model_file import KEY_HASHING, ServingModel
from hpcps.train.models import Scorer

BATCH_ROWS = 100_000  # rows scored at once: bounds the memory of one batch's unique keys and rows


def matrix_rows(X, labels=None, columns=None, bias=BIAS_KEY, key_dtype=np.uint64) -> Dataset:
    """The rows of a CSR matrix as a Dataset whose every row ends with the ``bias`` key (value 1):
    a row's keys are its ``columns`` (default: its column numbers), its values ``X.data``."""
    n = X.shape[0]
    lengths = np.diff(X.indptr) + 1
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    last = indptr[1:] - 1
    is_column = np.ones(indptr[-1], dtype=bool)
    is_column[last] = False
    indices = np.empty(indptr[-1], dtype=key_dtype)
    indices[is_column] = X.indices if columns is None else columns
    indices[last] = bias
    values = np.ones(indptr[-1], dtype=np.float32)
    values[is_column] = X.data
    labels = np.zeros(n, dtype=np.float32) if labels is None else np.asarray(labels, dtype=np.float32)
    return Dataset(labels, indptr, indices, values)


class Predictor:
    """A model file loaded for scoring, scikit-learn style: :meth:`decision_function` (margins),
    :meth:`predict_proba` and :meth:`predict`. ``loss`` is "logistic" (a classifier of labels 0
    and 1) or "squared" (a regressor)."""

    def __init__(self, path: str):
        self.model = ServingModel(path)
        self.scorer = Scorer(self.model)
        self.path, self.kind, self.loss = path, self.model.kind, self.model.loss
        self.hash_bits = self.model.hash_bits or 24
        self.fielded = self.kind in config.FIELDED  # (its rows need their fields)

    def rows_of_file(self, path: str, fmt: str = "auto", skip_bad_lines: bool = False,
                     allow_other_hashing: bool = False, hash_bits: int = 0, need_labels: bool = False) -> Dataset:
        """The rows of a data file, read as the model's training read its rows (its hash bits,
        unless ``hash_bits``); a file whose keys would not be the model's (other hash bits,
        another format's key hashing) is refused unless ``allow_other_hashing``. Rows may come
        without labels (label 0: libsvm lines that start with a feature, VW lines that start
        with ``|``, Criteo lines of 39 columns), unless ``need_labels`` (to evaluate). A Parquet
        or CSV table's columns are those the training named ([data] label_column, weight_column,
        feature_columns)."""
        fmt = tdata.detect_format(path, fmt or "auto")  # (what the file is, if not a regular file)
        if fmt not in KEY_HASHING:
            raise tdata.DataError(f"--format {fmt!r}: expected one of {sorted(KEY_HASHING)}")
        if hash_bits and not 1 <= hash_bits <= 64:
            raise config.ConfigError(f"--hash-bits {hash_bits}: must be between 1 and 64")
        hash_bits = hash_bits or self.hash_bits
        problem = None if allow_other_hashing else self.model.mismatch(path, fmt, hash_bits)
        if problem:
            raise config.ConfigError(problem)
        d = self.model.config.get("data", {})  # (a table's columns: those the training named)
        columns = tables.Columns.named(d.get("label_column", "label"), d.get("weight_column", ""),
                                       d.get("feature_columns", ""))
        ds = tdata.load_part(path, 0, 1, fmt, hash_bits, skip_bad_lines, binary=self.loss == "logistic",
                             fields=self.fielded, need_labels=need_labels, columns=columns)
        if ds.rows == 0:
            why = (f"each of its {ds.skipped} lines with data was skipped as bad" if ds.skipped
                   else "the file is empty or holds only blank and comment lines")
            raise tdata.DataError(f"{path}: no rows to score: {why}")
        return ds

    def rows_of_matrix(self, X) -> Dataset:
        """The rows of a SciPy sparse matrix (or a dense array): column ``j`` is the libsvm
        feature ``j``, masked to the model's hash bits, and every row gets the bias feature."""
        import scipy.sparse as sp

        if self.fielded:
            raise ValueError(f"a {self.kind} model scores rows with fields: give a libffm or Criteo file, not a matrix")
        X = sp.csr_matrix(X)  # (its rows as they are: a column twice in a row is two features, as in a file)
        mask = np.uint64(2**self.hash_bits - 1) if self.hash_bits < 64 else np.uint64(2**64 - 1)
        return matrix_rows(X, columns=X.indices.astype(np.uint64) & mask)

    def _rows(self, X) -> Dataset:
        if isinstance(X, Dataset):
            return X
        if isinstance(X, (str, bytes)) or hasattr(X, "__fspath__"):
            return self.rows_of_file(os.fsdecode(X))
        return self.rows_of_matrix(X)

    def decision_function(self, X) -> np.ndarray:
        """Each row's margin (float64): the logit of a classifier, the prediction of a regressor.
        ``X``: a sparse matrix, an array, or a data file's path."""
        ds = self._rows(X)
        out = []
        for lo in range(0, ds.rows, BATCH_ROWS):
            try:
                out.append(self.scorer.margins(ds.batch(lo, lo + BATCH_ROWS)))
            except ValueError as e:  # rows the model cannot take (a field it has not)
                raise ValueError(f"{ds.source or 'the rows'}: {e}") from None
        return np.concatenate(out) if out else np.zeros(0)

    def scores(self, X) -> np.ndarray:
        """What ``hpcps predict`` writes: a classifier's probability of label 1, a regressor's
        prediction."""
        m = self.decision_function(X)
        return 1.0 / (1.0 + np.exp(-m)) if self.loss == "logistic" else m

    def predict_proba(self, X) -> np.ndarray:
        """A classifier's probabilities of labels 0 and 1, ``(rows, 2)``."""
        if self.loss != "logistic":
            raise AttributeError(f"{self.path} is a regressor (squared loss): it has predict, not predict_proba")
        p = self.scores(X)
        return np.column_stack([1.0 - p, p])

    def predict(self, X) -> np.ndarray:
        """A classifier's labels (0 or 1: probability at least 0.5), a regressor's predictions."""
        m = self.decision_function(X)
        return (m >= 0).astype(np.int64) if self.loss == "logistic" else m


def load_model(path: str) -> Predictor:
    """A model file written by ``hpcps train`` (``train.model_out``) or ``hpcps export``, loaded
    for scoring in this process; its checksum is verified (a damaged file raises
    :class:`hpcps.train.model_file.ModelFileError`)."""
    return Predictor(path)
