"""A data format of your own: categorical CSV, ``label,id,id,...`` (an id per column), read by your parser.

run: python examples/custom_format.py --write /tmp/hpcps-catcsv && mpiexec -n 3 python examples/custom_format.py /tmp/hpcps-catcsv

A format is one function that turns a block of whole lines (bytes) into CSR rows: labels,
indptr, keys and values. Registered under a name, it is ``data.format = "catcsv"``: every worker
parses its own byte range of the file with it, through the parse cache and the checks on labels,
like a built-in format. Its loop runs over every byte of the data, so it is a numba kernel; the
function around it only sizes the arrays. The first command writes a training and a test file
whose labels come from a known logistic model (and prints that model's test AUC); the second
trains LR on them with 1 server + 2 workers.
"""

import os
import sys

import numba
import numpy as np

import hpcps
from hpcps.cli import main
from hpcps_kernels.metrics import auc
from hpcps_kernels.parse import ParseError

COLUMN_SHIFT = np.uint64(20)  # a key is column << 20 | id (masked to data.hash_bits)


@numba.njit(cache=True)
def read_lines(buf, labels, indptr, indices, bias, mask):
    """The rows of ``buf``'s lines, each ending with the bias key: (rows, nnz, first bad line or -1)."""
    rows, nnz, line, column, number, digits = 0, 0, 0, 0, 0, 0
    indptr[0] = 0
    for i in range(buf.shape[0] + 1):
        c = buf[i] if i < buf.shape[0] else 10  # (the file's last line may lack its newline)
        if 48 <= c <= 57:
            number, digits = number * 10 + c - 48, digits + 1
        elif c == 44 or c == 10:  # a comma or a newline ends a number
            if digits == 0 and c == 10 and column == 0:  # a blank line
                line += 1
                continue
            if digits == 0 or (column == 0 and number > 1):  # an empty column, or a label not 0/1
                return rows, nnz, line
            if column > 0:
                indices[nnz] = ((np.uint64(column) << COLUMN_SHIFT) | np.uint64(number)) & mask
                nnz += 1
            else:
                labels[rows] = number
            column, number, digits = column + 1, 0, 0
            if c == 10:
                indices[nnz] = bias
                nnz, rows, line, column = nnz + 1, rows + 1, line + 1, 0
                indptr[rows] = nnz
        elif c != 13:  # (a CR before the newline is fine)
            return rows, nnz, line
    return rows, nnz, -1


def parse_catcsv(block, *, source, first_line, skip_bad, binary, seen, bias, bits):
    """The parser's contract (as hpcps_kernels.parse.parse_libsvm's); a bad line is an error even
    with skip_bad, and labels are 0/1 whatever ``binary`` says."""
    max_rows = int(np.count_nonzero(block == 10)) + 1
    max_nnz = int(np.count_nonzero(block == 44)) + max_rows
    labels, indptr = np.empty(max_rows, np.float32), np.empty(max_rows + 1, np.int64)
    indices = np.empty(max_nnz, np.uint64)
    rows, nnz, bad = read_lines(block, labels, indptr, indices, np.uint64(bias), np.uint64(2**bits - 1))
    if bad >= 0:
        text = bytes(block).split(b"\n")[bad].decode(errors="replace")
        raise ParseError(source, first_line + bad, "expected label,id,id,... (a 0/1 label, then digits)", text)
    return labels[:rows], indptr[:rows + 1], indices[:nnz], np.ones(nnz, np.float32), 0


def write_data(directory, columns=8, ids=50, rows=(100_000, 20_000)):
    """train.csv and test.csv, labels drawn from a logistic model over the columns' ids."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(7)
    weights = rng.normal(0, 0.8, (columns, ids))
    for name, n in zip(("train.csv", "test.csv"), rows):
        x = rng.integers(0, ids, (n, columns))
        p = 1 / (1 + np.exp(1.0 - weights[np.arange(columns), x].sum(axis=1)))
        y = (rng.random(n) < p).astype(int)
        np.savetxt(os.path.join(directory, name), np.column_stack([y, x]), fmt="%d", delimiter=",")
    print(f"true model's test AUC {auc(y, p):.4f}")


hpcps.register_format("catcsv", parse_catcsv)  # on every rank, before the configuration is read

if sys.argv[1] == "--write":
    write_data(sys.argv[2])
else:
    d = sys.argv[1]
    sys.exit(main(["train", "--set", "data.format=catcsv", "--set", f"data.train={d}/train.csv",
                   "--set", f"data.test={d}/test.csv", "--set", "train.epochs=3", "--set", "train.batch_size=1000"]))
