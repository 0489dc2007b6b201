"""python -m hpcps_kernels {warmup,bench,tuning}"""
import sys

if __name__ == "__main__":
    from hpcps_kernels.profiler import main

    sys.exit(main(sys.argv[1:]))
