"""python -m hpcps_kernels {warmup,bench,tuning}"""
import os
import sys

# One BLAS thread, as a training rank runs (hpcps/__init__.py): the MLP's timing and the sgemm
# roofline it is held against are one core's, like every other figure of the profiler.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

if __name__ == "__main__":
    from hpcps_kernels.profiler import main

    sys.exit(main(sys.argv[1:]))
