"""hpcps_kernels: the numba kernels that do hpcps's heavy work (installed from the folder kernels/).

Pure functions on NumPy arrays: no MPI, nothing from ``hpcps``, so they can be tested and
profiled alone on any node (``python -m hpcps_kernels bench``). Nothing is compiled at import:
each kernel compiles on first call, into numba's on-disk cache (``NUMBA_CACHE_DIR``).

Modules: ``keys`` (batch unique keys, segment reduce, merge, radix sort), ``models`` (LR and FM
forward/backward), ``optim`` (SGD, AdaGrad, FTRL, Adam on slot rows), ``hashtable`` (uint64 → slot
index), ``hashing`` (XXH64 feature hashing), ``parse`` (libsvm, Criteo TSV), ``metrics`` (AUC,
logloss), ``reference`` (NumPy/SciPy references), ``profiler``.
"""
