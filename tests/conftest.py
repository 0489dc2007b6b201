"""Shared fixtures. The MPI harness (verdict agreement, abort on a stuck failure) is a plugin."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ["mpi_harness"]
