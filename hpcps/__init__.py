"""hpcps: an MPI parameter server for huge sparse models."""

__version__ = "0.1.0"
