"""Shared fixtures. The MPI harness (verdict agreement, abort on a stuck failure) is a plugin."""

import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

# Jobs without data generate (and then reuse) synthetic data under HPCPS_CACHE_DIR: one directory
# per test session, not the user's ~/.cache
if "HPCPS_CACHE_DIR" not in os.environ:
    os.environ["HPCPS_CACHE_DIR"] = tempfile.mkdtemp(prefix="hpcps-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HPCPS_CACHE_DIR"], True)

pytest_plugins = ["mpi_harness"]
