"""Pure numba kernels (no MPI, no hpcps imports)."""
