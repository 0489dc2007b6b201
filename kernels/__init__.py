"""hpcps_kernels: the numba kernels that do hpcps's heavy work (installed from the folder kernels/).

Pure functions on NumPy arrays: no MPI, nothing from ``hpcps``, so they can be tested and
profiled alone on any node (``python -m hpcps_kernels bench``). Nothing is compiled at import:
each kernel compiles on first call, into numba's on-disk cache (``NUMBA_CACHE_DIR``).

Modules: ``keys`` (batch unique keys, segment reduce, merge, radix sort), ``models`` (LR and FM
forward/backward), ``optim`` (SGD, AdaGrad, FTRL, Adam on slot rows), ``hashtable`` (uint64 → slot
index), ``fused`` (a request's lookups with its rows' reads or updates, in one pass), ``hashing`` (XXH64 feature hashing, keys' shards), ``copies`` (a push's keys to every copy of their shards, and a server's primary part), ``parse`` (libsvm, Criteo TSV), ``metrics`` (AUC,
logloss), ``reference`` (NumPy/SciPy references), ``profiler``; ``tuning`` holds every tuned number (prefetch distances, thresholds) with its environment override.
"""

import importlib.util
import os
import sys


def _answer_numba_blas_probe_from_files() -> bool:
    """Let numba learn that SciPy's BLAS exists without importing it at start-up.

    When numba's CPU target first loads (the first compiled call of any kernel, cached or not) it
    asks whether a BLAS is there by importing ``scipy.linalg.cython_blas`` (``ensure_blas``, called
    as ``numba.np.arraymath`` is imported). With SciPy 1.17 that import pulls in its array-API
    layer, a noticeable part of every hpcps process's start-up, though no hpcps kernel calls a BLAS (the deep
    models' matrix products are NumPy's). This answers the probe from SciPy's files instead, keeping
    numba's check that SciPy's BLAS integer width is the one numba was built for; numba's C helper
    still imports the module itself at the first BLAS call. Nothing is changed when numba has
    already loaded that module, when its ``ensure_blas`` is not where this expects it (another
    numba), or with ``HPCPS_LAZY_BLAS=0``. Returns whether the probe is now answered here."""
    if os.environ.get("HPCPS_LAZY_BLAS", "1") == "0":
        return False
    try:
        import numba.np.linalg as nl
    except ImportError:
        return False
    real = getattr(nl, "ensure_blas", None)
    if "numba.np.arraymath" in sys.modules or real is None or getattr(real, "hpcps_lazy", False):
        return False

    def ensure_blas():
        spec = importlib.util.find_spec("scipy")
        where = list(spec.submodule_search_locations or []) if spec else []
        linalg = os.path.join(where[0], "linalg") if where else ""
        if not (os.path.isdir(linalg) and any(f.startswith("cython_blas") for f in os.listdir(linalg))):
            return real()  # raises numba's own ImportError
        check = getattr(nl, "_check_lapack_int_width", None)
        if check is not None:
            check()

    ensure_blas.hpcps_lazy = True
    nl.ensure_blas = ensure_blas
    return True


_answer_numba_blas_probe_from_files()


def _compile_tuned_kernels_apart() -> str:
    """Where a compiled knob of :mod:`hpcps_kernels.tuning` is overridden, point numba's on-disk
    cache at a directory of its own for that set of overrides: numba freezes a kernel's global
    constants when it compiles and its cache does not see them change, so a kernel cached with the
    defaults would otherwise run with them. Runs before any kernel module is imported (numba picks
    a function's cache directory when it is decorated). Returns the directory, or '' when the
    defaults hold."""
    try:
        from . import tuning
    except ValueError as e:  # a malformed HPCPS_TUNE_* value: one line, a configuration error
        sys.stderr.write(f"hpcps: {e}\n")
        raise SystemExit(2) from None
    suffix = tuning.compiled_cache_suffix()
    if not suffix:
        return ""
    import tempfile

    from numba.core import config

    config.CACHE_DIR = os.path.join(config.CACHE_DIR or os.path.join(tempfile.gettempdir(), "hpcps-numba"), suffix)
    return config.CACHE_DIR


_compile_tuned_kernels_apart()
