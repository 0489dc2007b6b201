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

# What numba's own import loads only to look at, and why it is not needed here (_import_numba).
_NUMBA_LOOKS_AT = {
    "scipy": "numba imports SciPy only to check that its version is at least 1.0 (hpcps requires 1.10)",
    "yaml": "numba imports PyYAML only to read a .numba_config.yaml in the current directory",
}


def _import_numba() -> tuple[str, ...]:
    """Import numba without the two packages its import loads for nothing here: SciPy (a version
    check, ``numba._ensure_critical_deps``) and PyYAML (``numba.core.config``, for a
    ``.numba_config.yaml`` file in the current directory). Both imports are optional to numba (it
    catches their ImportError), and together they were a noticeable part of every rank's start-up.
    For the length of numba's import only, each is marked not importable (``sys.modules[name] =
    None``, Python's own way to say so) unless it is loaded already; the marks are then taken away,
    so a later ``import scipy`` works as usual (the kernel profiler's references; numba's first BLAS
    call). PyYAML is left importable where the current directory has a ``.numba_config.yaml``, which
    numba then reads as always. Nothing is done where numba is loaded already or with
    ``HPCPS_LEAN_NUMBA=0``. Returns the names held back."""
    if "numba" in sys.modules or os.environ.get("HPCPS_LEAN_NUMBA", "1") == "0":
        return ()
    held = tuple(name for name in _NUMBA_LOOKS_AT if name not in sys.modules
                 and not (name == "yaml" and os.path.isfile(".numba_config.yaml")))
    for name in held:
        sys.modules[name] = None
    try:
        import numba  # noqa: F401
    finally:
        for name in held:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return held


_import_numba()


def _answer_numba_blas_probe_from_files() -> bool:
    """Let numba learn that SciPy's BLAS exists without importing it at start-up.

    When numba's CPU target first loads (the first compiled call of any kernel, cached or not) it
    asks whether a BLAS is there by importing ``scipy.linalg.cython_blas`` (``ensure_blas``, called
    as ``numba.np.arraymath`` is imported). With SciPy 1.17 that import pulls in its array-API
    layer, a noticeable part of every hpcps process's start-up, though no hpcps kernel calls a BLAS (the deep
    models' matrix products are NumPy's). This answers that one probe from SciPy's files instead,
    and hands ``ensure_blas`` back to numba as it does: every later call (a numba function that
    uses a BLAS, being typed) is numba's own, which imports the module and checks that SciPy's BLAS
    integer width is the one numba was built for (that check imports SciPy itself, so it waits for
    a BLAS to be used too). Nothing is changed when numba has already loaded that module, when its
    ``ensure_blas`` is not where this expects it (another numba), or with ``HPCPS_LAZY_BLAS=0``.
    Returns whether the probe is now answered here."""
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
        nl.ensure_blas = real  # (numba.np.arraymath's probe is the first call: the later ones are numba's)
        spec = importlib.util.find_spec("scipy")
        where = list(spec.submodule_search_locations or []) if spec else []
        linalg = os.path.join(where[0], "linalg") if where else ""
        if not (os.path.isdir(linalg) and any(f.startswith("cython_blas") for f in os.listdir(linalg))):
            return real()  # raises numba's own ImportError

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
