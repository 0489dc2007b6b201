"""Faults a running job meets, each ended the way the README's "What survives what" says.

Every test runs ``hpcps`` as a user would (``mpiexec -n N hpcps ...`` in a subprocess under a
timeout, or one process) and checks the exit status, the one line the user reads, and what is
left on the disk: the retention of checkpoints, SIGINT and SIGTERM mid-run, a full disk during a
model write and during a checkpoint (a small tmpfs, ``small_disk``), and a file truncated while a
job reads it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcps import checkpoint
from hpcps.train import synth

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def job(n: int, args: list[str], timeout: float = 180, cwd: str | None = None) -> tuple[int, str]:
    """Run ``hpcps args`` in ``n`` ranks (0: one process without mpiexec); (exit status, output)."""
    cmd = [*mpiexec(), "-n", str(n), *HPCPS, *args] if n else [*HPCPS, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
    return proc.returncode, proc.stdout + proc.stderr


def start(n: int, args: list[str], cwd: str | None = None) -> subprocess.Popen:
    """Start ``hpcps args`` in ``n`` ranks in the background (its output on ``.stdout``), in a
    session of its own so that a test can signal the launcher alone."""
    cmd = [*mpiexec(), "-n", str(n), *HPCPS, *args] if n else [*HPCPS, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=cwd,
                            start_new_session=True)


def wait_for(predicate, timeout: float = 120, proc: subprocess.Popen | None = None) -> bool:
    """Poll ``predicate()`` until it holds (True), ``proc`` ends or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.02)
    return False


def sets(**kv) -> list[str]:
    """``--set`` options from keyword arguments: ``train__epochs=2`` is ``--set train.epochs=2``."""
    out = []
    for k, v in kv.items():
        value = json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v
        out += ["--set", f"{k.replace('__', '.')}={value}"]
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 3,000-row training file and a 1,000-row test file (libsvm)."""
    d = tmp_path_factory.mktemp("faults")
    info = synth.generate(str(d), 3_000, 1_000, fields=8, seed=5, formats=("libsvm",))
    return info.files["train_libsvm"], info.files["test_libsvm"]


# -- checkpoints belong to a run: lineage and retention ---------------------------------------------


# -- signals: SIGINT and SIGTERM mid-run ------------------------------------------------------------


# -- a full disk during a model write -------------------------------------------------------------

def _fill(disk, leave: int = 0) -> None:
    """Fill the small disk up to ``leave`` bytes free."""
    import shutil

    with open(disk / "fill", "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_full_disk_during_the_model_write_is_one_line_and_keeps_the_old_model(small, small_disk, tmp_path, ranks):
    model = small_disk / "model.h5"
    model.write_bytes(b"the previous model")
    _fill(small_disk)
    rc, out = job(ranks, ["train", *sets(data__train=small[0], data__test=small[1], train__epochs=1,
                                         train__progress=False, train__model_out=str(model))])
    errors = [line for line in out.splitlines() if "error:" in line]
    assert rc == 1 and len(errors) == 1 and str(model) in errors[0] and "No space left on device" in errors[0], out
    assert "needed about" in errors[0] and "Traceback" not in out and "where things went" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill", "model.h5"]  # no temporary file left
    assert model.read_bytes() == b"the previous model"


def test_a_full_disk_during_predict_out_is_one_line(small, small_disk, tmp_path):
    rc, out = job(0, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,
                                     train__model_out=str(tmp_path / "m.h5"))])
    assert rc == 0, out
    _fill(small_disk)
    scores = small_disk / "scores.txt"
    rc, out = job(0, ["predict", "--model", str(tmp_path / "m.h5"), "--data", small[1], "--out", str(scores)])
    assert rc == 1 and f"cannot write {scores}: No space left on device" in out and "Traceback" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill"]
    rc, out = job(2, ["train", *sets(data__train=small[0], train__epochs=1, train__progress=False,  # data.predict_out
                                     data__predict=small[1], data__predict_out=str(scores))])
    assert rc == 1 and f"cannot write {scores}: No space left on device" in out and "Traceback" not in out, out
    assert sorted(os.listdir(small_disk)) == ["fill"]


def test_a_model_write_that_fails_inside_hdf5_leaves_no_temporary_file(small_disk):
    """The write's own failure (not the check of the free space before it): HDF5 meets the full
    disk part-way through the file."""
    import numpy as np

    from hpcps import outputs

    model = small_disk / "model.h5"
    model.write_bytes(b"the previous model")
    _fill(small_disk, leave=1 << 20)

    def fill(f):
        f["values"] = np.ones(4 << 20, dtype=np.float32)  # 16 MiB

    with pytest.raises(outputs.OutputError, match="No space left on device") as e:
        outputs.write_h5(str(model), fill)  # (the model file's write, with no size to refuse before)
    assert e.value.status == 1 and "the previous" in str(e.value)
    assert sorted(os.listdir(small_disk)) == ["fill", "model.h5"]
    assert model.read_bytes() == b"the previous model"



# -- a full disk during a checkpoint --------------------------------------------------------------


# -- files that change under a running job ---------------------------------------------------------


# -- non-finite numbers --------------------------------------------------------------------------------
