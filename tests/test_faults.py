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


# -- a full disk during a checkpoint --------------------------------------------------------------


# -- files that change under a running job ---------------------------------------------------------


# -- non-finite numbers --------------------------------------------------------------------------------
