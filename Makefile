# The two commands:
#   make demo   set up everything (virtual environment, MPI from PyPI) and run the main job
#   make test   set up everything and run the whole test suite (serial + MPI)
# PYTHON picks the interpreter used to create the environment; NP the number of ranks of the demo.

PYTHON ?= python3
VENV   ?= .venv
NP     ?= 4
PY     := $(VENV)/bin/python
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: demo test install bench clean bytecode

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpi,test,docs]'
	touch $@

install: $(VENV)/.installed bytecode

# The modules compiled once: where PYTHONDONTWRITEBYTECODE is set, every rank of every job would
# otherwise compile them again (about 0.1 s of each rank's start-up).
bytecode: $(VENV)/.installed
	$(PY) -m compileall -q hpcps kernels

demo: $(VENV)/.installed bytecode
	$(PY) -m hpcps_kernels warmup
	$(VENV)/bin/mpiexec -n $(NP) $(VENV)/bin/hpcps train --set train.model_out='"demo/model.h5"' \
		--set checkpoint.dir='"demo/ckpt"' --set train.metrics='"demo/metrics.jsonl"' $(ARGS)

test: $(VENV)/.installed bytecode
	$(PY) tests/run.py $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m hpcps_kernels bench
	$(VENV)/bin/mpiexec -n 2 $(VENV)/bin/hpcps bench mpi

clean:
	rm -rf $(VENV) .numba_cache build *.egg-info
