"""The benchmark commands (``hpcps bench ...``): each prints its throughput beside a reference
(raw MPI, NumPy, Vowpal Wabbit) measured in the same run. Tools, not the runtime: nothing in
``hpcps.ps`` or ``hpcps.train`` imports them."""
