"""hpcps: an MPI parameter server for huge sparse models.

    import hpcps
    ctx = hpcps.init(servers=1)          # collective; nothing happens at import

See :mod:`hpcps.context`. Layers, each importing only those before it: ``hpcps_kernels`` (numba,
pure) → ``hpcps.transport`` (the only MPI module) → ``hpcps.server`` / ``hpcps.client`` →
``hpcps.train`` → ``hpcps.cli``.
"""

__version__ = "0.1.0"


def init(*args, **kwargs):
    """See :func:`hpcps.context.init`."""
    from hpcps.context import init as _init

    return _init(*args, **kwargs)
