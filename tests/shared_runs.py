"""Data and jobs that several test modules use, made once per test session.

Under pytest-xdist (``tests/run.py``) each module runs in one of several processes, so a
module-scoped fixture that two modules import (``test_checkpoint``'s reference run, used by
``test_deltas`` too) was made once in each. :func:`once` makes a thing once per session, in the
session's cache directory (``HPCPS_TEST_CACHE_DIR``, which ``tests/conftest.py`` makes and the
pytest-xdist workers share), behind a file lock: the first test to ask makes it, one that asks
meanwhile waits for it asleep (``flock``), and the later ones read it.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
from typing import Callable

import numpy as np


def once(name: str, make: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The directory ``name`` of this session's shared cache, filled by ``make(directory)`` the
    first time it is asked for. A ``make`` that raised leaves nothing behind: the next one asking
    makes it again (and fails the same way, in its own test)."""
    where = pathlib.Path(os.environ["HPCPS_TEST_CACHE_DIR"]) / "shared" / name
    where.parent.mkdir(parents=True, exist_ok=True)
    done = where.with_name(name + ".done")
    with open(where.with_name(name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)  # what a failed attempt left
            where.mkdir()
            make(where)
            done.touch()
    return where


def writable(text: bytes) -> np.ndarray:
    """``text`` as the data loader hands it to the parsers: a writable uint8 array. Given bytes
    (a read-only array), numba compiles each parser once more, a variant that training never
    runs: 7-14 CPU-s a parser on a clean clone, in each test process that reaches it first.
    (``test_parsed_form`` parses read-only arrays and bytes, as a user may.)"""
    return np.frombuffer(bytearray(text), np.uint8)
