# Every target installs what it needs into .venv first (idempotent: a stamp file per step).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
DEPS    := $(VENV)/.deps-stamp
INSTALL := $(VENV)/.install-stamp
EXT_SRC := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h csrc/cuda/*.cuh)
EXT     := $(VENV)/.ext-stamp
# Build the C++ extension; a failure is an error here (setup.py alone would fall back).
export FUSEDRES_BUILD_EXT ?= 1
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu bench lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U "pip>=25" "setuptools>=77" wheel

$(DEPS): $(PY) requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $@

$(INSTALL): $(DEPS) setup.py
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# Rebuild fusedres._C in place (incremental with ninja) when a C++/CUDA source changed.
$(EXT): $(INSTALL) $(EXT_SRC)
	$(PY) setup.py -q build_ext --inplace
	touch $@

install: $(EXT)

demo: install
	$(PY) -m fusedres.demo

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) -m pytest benchmarks --benchmark-only $(PYTEST_ARGS)

lint: $(DEPS)
	$(VENV)/bin/ruff check fusedres kernels tests benchmarks setup.py

format: $(DEPS)
	$(VENV)/bin/ruff format fusedres kernels tests benchmarks setup.py

clean:
	rm -rf build *.egg-info fusedres/_C*.so $(INSTALL) $(EXT)
