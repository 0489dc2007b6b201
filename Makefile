# The two commands:
#   make demo   set up everything (virtual environment, MPI from PyPI) and run the main job
#   make test   set up everything and run the whole test suite (serial + MPI)
# PYTHON picks the interpreter used to create the environment; NP the number of ranks of the demo.
#   make install-ft   a second environment, .venv-ft, with Open MPI instead of MPICH: the fault-tolerant
#                     mode (cluster.fault_tolerance = "ulfm", launched with `mpiexec --with-ft ulfm`);
#                     `make test` sets it up too and runs tests/test_ulfm.py's jobs in it

PYTHON ?= python3
VENV   ?= .venv
NP     ?= 4
PY     := $(VENV)/bin/python
VENV_FT ?= .venv-ft
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: demo test install install-ft bench clean bytecode

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpi,test,docs]'
	touch $@

install: $(VENV)/.installed bytecode

# Open MPI's wheel cannot share .venv with MPICH's (both install mpiexec). Where it cannot install,
# the file .install-failed says why and tests/test_ulfm.py skips with that reason.
$(VENV_FT)/.installed: pyproject.toml
	rm -f $(VENV_FT)/.install-failed
	$(PYTHON) -m venv $(VENV_FT)
	$(VENV_FT)/bin/python -m pip install --quiet -e '.[ft]' > $(VENV_FT)/.install-log 2>&1 \
		|| (tail -3 $(VENV_FT)/.install-log > $(VENV_FT)/.install-failed; cat $(VENV_FT)/.install-failed)
	touch $@

install-ft: $(VENV_FT)/.installed

# The modules compiled once: where PYTHONDONTWRITEBYTECODE is set, every rank of every job would
# otherwise compile them again (about 0.1 s of each rank's start-up).
bytecode: $(VENV)/.installed
	$(PY) -m compileall -q hpcps kernels

demo: $(VENV)/.installed bytecode
	$(PY) -m hpcps_kernels warmup
	$(VENV)/bin/mpiexec -n $(NP) $(VENV)/bin/hpcps train --set train.model_out='"demo/model.h5"' \
		--set checkpoint.dir='"demo/ckpt"' --set train.metrics='"demo/metrics.jsonl"' $(ARGS)

test: $(VENV)/.installed $(VENV_FT)/.installed bytecode
	$(PY) tests/run.py $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m hpcps_kernels bench
	$(VENV)/bin/mpiexec -n 2 $(VENV)/bin/hpcps bench mpi

clean:
	rm -rf $(VENV) $(VENV_FT) .numba_cache build *.egg-info
