"""Exec wrapper for MPI test jobs: ranks > 0 write stdout to ``$HPCPS_TEST_REPORT_DIR/rank<R>.log``.

    mpiexec -n N python tests/rank_output.py -m pytest ...

Rank 0's report stays on the console; every rank's stderr (where the harness prints a rank's
error before it aborts the job) stays there too. Done before pytest starts, because pytest's
output capture saves and later restores the original file descriptor 1.
"""

import os
import sys

rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK") or 0)
report_dir = os.environ.get("HPCPS_TEST_REPORT_DIR")
if report_dir and rank > 0:
    os.makedirs(report_dir, exist_ok=True)
    fd = os.open(os.path.join(report_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
