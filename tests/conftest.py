"""Shared fixtures. The MPI harness (verdict agreement, abort on a stuck failure) is a plugin."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Jobs without data generate (and then reuse) synthetic data under HPCPS_CACHE_DIR: one directory
# per test session (its pytest-xdist workers share it), never the user's own (~/.cache or theirs)
if "HPCPS_TEST_CACHE_DIR" not in os.environ:
    os.environ["HPCPS_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="hpcps-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HPCPS_TEST_CACHE_DIR"], True)
os.environ["HPCPS_CACHE_DIR"] = os.environ["HPCPS_TEST_CACHE_DIR"]

pytest_plugins = ["mpi_harness"]


# Under pytest-xdist (tests/run.py) each module runs whole in one process, modules handed out in
# collection order: the modules that take the most CPU go first, so that the last one to start is
# a short one and no stream ends long before the other (measured per module, 2026-11-23: test_train
# 163 CPU-s, test_checkpoint 117, test_deep 103, ... the alphabet had put test_train and test_tune last).
HEAVY_FIRST = ["test_train.py", "test_checkpoint.py", "test_deep.py", "test_examples.py", "test_benchmarks.py",
               "test_one_process.py", "test_reliability.py", "test_tune.py", "test_chaos.py", "test_filters.py", "test_margins.py",
               "test_backup_workers.py", "test_defaults_sweep.py", "test_features.py", "test_early_stop.py"]


def pytest_collection_modifyitems(session, config, items):
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest in order


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (needs root). Where none can be mounted the test skips, saying why, or
    under HPCPS_REQUIRE_CLUSTER=1 (CI) fails (``run.cannot_run``)."""
    from run import cannot_run

    where = tmp_path / "disk"
    where.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True,
                           text=True, timeout=60)
        error = (r.stderr.strip().splitlines() or [f"mount exited {r.returncode}"])[0]
    except OSError as e:  # no mount(8)
        r, error = None, str(e)
    if r is None or r.returncode != 0:
        cannot_run(f"cannot mount a small tmpfs here: {error}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)
