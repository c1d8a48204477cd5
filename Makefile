# Every target installs what it needs into .venv first (idempotent: a stamp file per step).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
DEPS    := $(VENV)/.deps-stamp
INSTALL := $(VENV)/.install-stamp
# The product extension fusedres._C: csrc/cpu (csrc/cpu/vec/ compiled once per CPU capability, the
# best the CPU supports chosen at load: the same code as a wheel's), and csrc/cuda by nvcc
# (FUSEDRES_BUILD_CUDA).
EXT_SRC := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cpu/vec/*.cpp csrc/cpu/vec/*.h csrc/cuda/*.cu csrc/cuda/*.h csrc/cuda/*.cuh)
EXT     := $(VENV)/.ext-stamp
# The test extension fusedres._C_cuda_on_cpu: csrc/cuda by the host compiler through the CPU
# execution layer (csrc/cuda/on_cpu), the cuda backend's CPU test vehicle; `make test` builds it.
TEST_EXT_SRC := $(wildcard csrc/*.h csrc/cuda/*.cu csrc/cuda/*.h csrc/cuda/*.cuh csrc/cuda/cutlass_conv/*.h csrc/cuda/on_cpu/*.cpp csrc/cuda/on_cpu/*.h csrc/cuda/on_cpu/tests/*.cu)
TEST_EXT     := $(VENV)/.test-ext-stamp
# Build the C++ extension; a failure is an error here (setup.py alone would fall back).
export FUSEDRES_BUILD_EXT ?= 1
# The nvcc copy of csrc/cuda only runs on a GPU: off without one (the test extension runs the
# same kernels on CPU; `make cuda-table` and tests/test_cuda_on_cpu.py compile csrc/cuda with nvcc
# for sm_80/sm_90). Where a GPU is visible (nvidia-smi -L) the nvcc copy is built too (auto).
export FUSEDRES_BUILD_CUDA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo auto || echo 0)
PYTEST_ARGS ?=
# pytest-xdist spreads the test files over the machine's cores (a file's tests stay together, with
# their module-scoped fixtures); PYTEST_JOBS=0 runs everything in one process (for -x, --pdb).
PYTEST_JOBS ?= auto
PYTEST_XDIST = -n $(PYTEST_JOBS) --dist loadfile
# No second copy of what pip downloads in its cache: the venv is ~5.8 GB (torch's CUDA build), and
# a CI run once ran out of disk while installing it.
export PIP_NO_CACHE_DIR ?= 1
.PHONY: wheel-check test-all install test-ext demo compare test selftest bench gpu-report gpu-check gpu-prepare gpu-model gpu-model-cuda lint format clean tsan asan cuda-table compat

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U "pip>=25" "setuptools>=77" wheel

$(DEPS): $(PY) requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $@

# The editable install itself is Python-only: $(EXT) builds the extension right after, in place
# and incrementally (an extension built by pip's editable build, in a temporary folder, would be
# compiled from scratch there and then again here).
$(INSTALL): $(DEPS) setup.py
	FUSEDRES_BUILD_EXT=0 $(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# Rebuild fusedres._C in place (incremental with ninja) when a C++/CUDA source changed.
$(EXT): $(INSTALL) $(EXT_SRC)
	$(PY) setup.py -q build_ext --inplace
	touch $@

install: $(EXT)

# Both extensions in place (ninja: fusedres._C is rebuilt only if its sources changed).
$(TEST_EXT): $(EXT) $(TEST_EXT_SRC)
	FUSEDRES_BUILD_TEST_EXT=1 $(PY) setup.py -q build_ext --inplace
	touch $@

test-ext: $(TEST_EXT)

# The main job: train and evaluate a pre-activation ResNet-20 on scikit-learn's digits (shipped
# with the package, no download). A second run reprints the finished run's summary.
# DEMO_ENV pins the CPU code whose rounding the run depends on to AVX2, which every x86-64 CPU of
# the kind has: oneDNN's convolutions, MKL's GEMMs and fusedres's kernels pick their kernels by
# the instruction set, and a kernel of another vector width sums in another order, which 440
# SGD steps turn into another final accuracy. ATen's own kernels give the same bits at AVX2 and
# AVX-512 (the loss is taken in float64). So every such CPU prints the README's figure;
# tests/test_readme.py runs the demo with these variables.
DEMO_ENV := ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2 FUSEDRES_CPU_CAPABILITY=avx2
demo: install
	env $(DEMO_ENV) $(PY) -m fusedres.apps.train --config digits --out runs/digits --resume auto

# The fused unit against plain PyTorch: agreement and saved bytes on every backend here.
compare: install
	$(PY) -m fusedres.apps.demo

# With the test extension: the cuda backend's kernels run on CPU tensors (tests/conftest.py).
# The quick suite: the tests marked slow (tests/conftest.py's SLOW table: compiles, sanitizer
# drivers, whole trainings, installs) and the full matrices are left to test-all and CI.
test: install $(TEST_EXT)
	$(PY) -m pytest tests -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS)

# Everything pytest runs in CI: the quick suite, the slow tests and the full matrices.
test-all: install $(TEST_EXT)
	$(PY) -m pytest tests --full-matrix $(PYTEST_XDIST) $(PYTEST_ARGS)

# On a GPU: the kernels against the reference, with a table (on CPU: interpreter, small shapes).
selftest: install
	$(PY) -m fusedres.apps.selftest

# The CUDA kernels on CPU under ThreadSanitizer (one OS thread per CUDA thread): zero reports.
# The test extension's sources built into a standalone driver (build/tsan), not the extension.
tsan: install
	$(PY) -m tools.cuda_tsan $(TSAN_ARGS)

# The same kernel matrix under AddressSanitizer + UndefinedBehaviorSanitizer (build/asan): an
# out-of-bounds access (global, or past a static __shared__ array) or undefined behaviour fails.
# Then the fusedres_cpu ops' malformed-argument cases (tools.opfuzz, tests/test_op_contracts.py)
# against fusedres._C built with AddressSanitizer (build/asan-ext, the ASan runtime preloaded).
asan: install
	$(PY) -m tools.cuda_tsan --asan
	$(PY) -m tools.opfuzz --asan

# nvcc compiles csrc/cuda for sm_80 and sm_90; registers, spills, shared memory, occupancy.
cuda-table: install
	$(PY) -m tools.cuda_aot --out csrc/cuda/COMPILE.md

bench: install
	$(PY) -m pytest benchmarks --benchmark-only $(PYTEST_ARGS)

# On a GPU, one command: the training-step answer (ResNet-164 and -1001 at batch 128, fused vs
# plain, eager and CUDA-graphed, fp32 and bf16), the kernels' times beside the MODELED ones, the
# self-test, units, fit (8 GiB) and torch.compile, written as each part finishes to
# $(GPU_REPORT_DIR)/: report.md, results.json, PNGs.
GPU_REPORT_DIR ?= gpu-report
GPU_REPORT_ARGS ?=
gpu-report: install
	$(PY) -m fusedres.apps.bench gpu-report --out $(GPU_REPORT_DIR) $(GPU_REPORT_ARGS)

# On a bare GPU machine (its own python3, no pip index: no venv, nothing installed): the
# training-step answer first (Triton, no build), then the kernels' times and the self-test,
# fusedres._C built in place for the visible GPU with every core (or make gpu-prepare's, carried
# in), the rest of gpu-report, each phase in its time slot, all within <= 9 minutes, into $(OUT)
# (at most 4 files: report.md, results.json, gpu-check.log, plots.zip). OUT may come from the
# environment (the device machine's $OUT). CI dry-runs it on CPU:
# GPU_PYTHON=.venv/bin/python GPU_CHECK_ARGS="--device cpu --quick".
GPU_PYTHON     ?= python3
OUT            ?= gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)

# Before a GPU session, on this machine: fusedres._C built against the GPU machines' torch
# (.venv-compat, make compat's venv) for sm_90 (GPU_PREPARE_ARCH), portable CPU code, into
# build/gpu-prepare/ (<= 60 MiB): the GPU run carries that folder and make gpu-check loads the
# library instead of building one (tools/gpu_prepare.py: what it prepares and what not).
GPU_PREPARE_ARCH ?= 9.0
gpu-prepare: $(DEPS)
	COMPAT_TORCH=$(COMPAT_TORCH) COMPAT_TRITON=$(COMPAT_TRITON) COMPAT_VENV_ONLY=1 bash .ci/compat
	$(PY) -m tools.gpu_prepare --python .venv-compat/bin/python --arch $(GPU_PREPARE_ARCH)

# What `pip install` gives a user (.ci/wheel-check): a wheel built by `pip wheel .` in build
# isolation (torch pinned as pyproject.toml's build requirement), installed into a fresh venv and
# run from outside the checkout: the same CPU capability as the in-place build, `python -m
# fusedres selftest`, the demo's first epoch. Needs ~9 GiB of disk while it runs (the build
# environment's and the venv's torch), freed at the end; the wheel stays in build/wheel-check.
wheel-check: install
	bash .ci/wheel-check

# The oldest supported versions (fusedres/_versions.py), the GPU machines' own: torch 2.11.0 and
# triton 3.6.0 in a second venv (.venv-compat; torch and triton only, the rest from .venv),
# fusedres._C built against them in a copy of the tree (build/compat), the Triton, version and
# cpu-backend tests there under the interpreter, every kernel config compiled for sm_90 by
# triton 3.6 (.ci/compat says how).
COMPAT_TORCH  ?= 2.11.0
COMPAT_TRITON ?= 3.6.0
compat: $(DEPS)
	COMPAT_TORCH=$(COMPAT_TORCH) COMPAT_TRITON=$(COMPAT_TRITON) bash .ci/compat

# No GPU needed: the performance model read from the kernels' sm_80/sm_90 SASS, calibrated on
# published GEMM figures, and the CUDA C++ kernels' SASS (nvcc); every figure MODELED
# (benchmarks/GPU_MODEL.md; ~10 min on 2 cores).
gpu-model: install
	TRITON_INTERPRET=0 $(PY) -m tools.perfmodel --cuda --out benchmarks/GPU_MODEL.md

# Only GPU_MODEL.md's CUDA C++ section (nvcc + the plain sequence's model; no Triton compile).
gpu-model-cuda: install
	TRITON_INTERPRET=0 $(PY) -m tools.perfmodel --cuda-only --out benchmarks/GPU_MODEL.md

lint: $(DEPS)
	$(VENV)/bin/ruff check fusedres kernels tools tests benchmarks setup.py build_backend.py

format: $(DEPS)
	$(VENV)/bin/ruff format fusedres kernels tests benchmarks setup.py

clean:
	rm -rf build *.egg-info fusedres/_C*.so $(INSTALL) $(EXT) $(TEST_EXT) .venv-compat
