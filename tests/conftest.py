"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter here, and the CUDA C++ kernels through
their CPU execution layer; the variables must be set before any kernel module is imported, so
they are set first thing (an explicit TRITON_INTERPRET=0 or FUSEDRES_CUDA_ON_CPU=0 in the
environment keeps them off, e.g. on a GPU machine).
"""

import fnmatch
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# The cuda backend's kernels (csrc/cuda) run on CPU tensors through their CPU execution layer, so
# the whole op matrix runs them too (fusedres/backends/cuda.py reads this at import).
os.environ.setdefault("FUSEDRES_CUDA_ON_CPU", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fusedres  # noqa: E402

# Exact float32 on a GPU: the Triton kernels and cuDNN both honour these (TF32 is the default).
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Backends that run the fused ops (reference is the oracle, not a backend under test).
FUSED_BACKENDS = [b for b in fusedres.available_backends(DEVICE) if b != "reference"]


@pytest.fixture(params=FUSED_BACKENDS)
def backend(request):
    """Runs the test once per fused backend that can run here."""
    with fusedres.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test builds the Triton launch plans it uses (a test may patch what they are built
    from: a config rule, the SM count)."""
    try:
        from fusedres.kernels._common import clear_plans
    except ImportError:  # triton missing
        yield
        return
    clear_plans()
    yield


# A finished tiny training run for the experiments on runs (tests/test_lesion.py,
# tests/test_landscape.py): digits, pre-activation ResNet-14 (6 units, 4 of them keep their
# input's shape), 6 iterations, checkpoints at iterations 3 and 6. About 10 s on 2 cores.
TINY_RUN = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "14", "--threads",
            "1", "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones", "0.5",
            "--no-progress", "--no-tensorboard", "--log-every", "3", "--checkpoint-every", "3",
            "--max-iters", "6"]


@pytest.fixture(scope="session")
def setup_py():
    """The repository's setup.py as a module (its build rules, without running setup())."""
    path = Path(__file__).resolve().parents[1] / "setup.py"
    spec = importlib.util.spec_from_file_location("_fusedres_setup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    from fusedres.apps.train import main

    out = tmp_path_factory.mktemp("tiny_run") / "run"
    assert main([*TINY_RUN, "--out", str(out)]) == 0
    return out


# The full matrices (every zoo model on every backend that runs here, every variant compiled
# whole) take minutes: CI runs them in a step of their own (`pytest tests -m full_matrix
# --full-matrix`); `make test` runs each one's representative subset and leaves them out.
def pytest_addoption(parser):
    parser.addoption("--full-matrix", action="store_true",
                     help="also run the tests marked full_matrix (CI's own step)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full_matrix: a full model/backend/variant matrix, run only with "
                   "--full-matrix (CI's own step); its subset runs in the quick suite")


# The slow tests (tens of seconds to minutes each on 2 cores: compiles, sanitizer drivers, whole
# trainings, fresh installs, multi-process runs), marked ``slow`` here in one table: `make test`
# leaves them out (-m "not slow"), CI runs them in a step of their own, `make test-all` runs
# everything. A pattern matches a test's node id as fnmatch matches, but a "[" is itself (a
# parametrised id's bracket), not the start of a character set.
SLOW = (
    "tests/test_cuda_mma.py::test_asan_*",                 # builds and runs the ASan driver
    "tests/test_cuda_on_cpu.py::test_nvcc_*",              # nvcc for sm_80 and sm_90
    "tests/test_cutlass.py::test_nvcc_*",                  # the CUTLASS kernels' SASS
    "tests/test_cuda_on_cpu.py::test_tsan_*",              # the TSan driver
    "tests/test_triton_aot.py::*",                         # every config compiled for a GPU
    "tests/test_perfmodel.py::test_compiled_counts_and_committed_table",
    "tests/test_install.py::*",                            # fresh venvs and installs
    "tests/test_memory.py::test_predicted_step_peak_matches_measured[r1001-*",
    "tests/test_planner.py::test_resnet1001_goals",
    "tests/test_bench.py::test_gpu_report_quick_end_to_end_on_cpu",
    "tests/test_bench.py::test_decisive_run_on_cpu_measures_every_row",  # 12 rows built
    "tests/test_bench.py::test_fit_quick_*",
    "tests/test_allocator_keep.py::test_bench_records_the_allocator",
    "tests/test_ops.py::test_compile_fullgraph_matches_eager[triton-*",
    "tests/test_ops.py::test_opcheck[triton-*",            # the interpreter, every opcheck
    "tests/test_models.py::test_units_hand_their_output_statistics_to_the_next[triton-*",
    "tests/test_train_compile.py::test_triton_model_compiles_whole_*",
    "tests/test_train_distributed.py::*",                  # torchrun, two processes
    "tests/test_landscape.py::test_torchrun_*",
    "tests/test_train_resume.py::test_killed_and_resumed_run_is_bit_exact",
    "tests/test_train_imagefolder.py::test_sigterm_*",
    # the 30k-pixel reduction under the Triton interpreter and the CUDA-on-CPU layer (~1 min each)
    "tests/test_bn_relu_conv.py::test_gradients_within_twice_*[triton-long-*",
    "tests/test_bn_relu_conv.py::test_gradients_within_twice_*[cuda-long-*",
    "tests/test_recipes.py::test_the_recipe_seed_loop_trains_*",  # four trainings, compared
    "tests/test_docs.py::test_python_blocks_run[heavy]",   # plans ResNet-1001 at batch 128
    "tests/test_docs.py::test_shell_blocks_run[*",         # the docs' trainings, at CI's scale
)

# CI's slow step runs with --dist loadgroup (pytest-xdist): every test stays with its file's group
# (module fixtures built once, in one process), except these, the longest of that step (1-4 min
# each on 2 quiet cores), which go first, each alone, longest first, so that the two workers finish
# together instead of one running a file of them after the other has finished.
LONGEST_FIRST = (
    "tests/test_cuda_on_cpu.py::test_nvcc_*",
    "tests/test_memory.py::test_predicted_step_peak_matches_measured[r1001-*",
    "tests/test_bn_relu_conv.py::test_gradients_within_twice_*[triton-long-*",
    "tests/test_docs.py::test_shell_blocks_run[*",
    "tests/test_bench.py::test_gpu_report_quick_end_to_end_on_cpu",
    "tests/test_bench.py::test_decisive_run_on_cpu_measures_every_row",
    "tests/test_cpu_capability.py::test_cpu_backend_numerics_under_each_capability[*",
)
_SLOW_PATTERNS = {p: p.replace("[", "[[]") for p in SLOW}
_FIRST_PATTERNS = [p.replace("[", "[[]") for p in LONGEST_FIRST]


def _spread_longest_first(items) -> None:
    """For --dist loadgroup: the file as each test's group, but LONGEST_FIRST's tests ungrouped
    and moved to the front in that table's order (xdist keeps the order with
    --no-loadscope-reorder)."""
    def rank(item) -> int:
        for i, pattern in enumerate(_FIRST_PATTERNS):
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                return i
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        return len(_FIRST_PATTERNS)

    ranks = {id(item): rank(item) for item in items}
    items.sort(key=lambda item: ranks[id(item)])


def pytest_collection_modifyitems(config, items):
    unmatched = set(SLOW)
    for item in items:
        hits = [p for p, m in _SLOW_PATTERNS.items() if fnmatch.fnmatchcase(item.nodeid, m)]
        if hits:
            item.add_marker(pytest.mark.slow)
            unmatched.difference_update(hits)
    # A pattern that matches nothing in a file that was collected (a renamed test, a bracket
    # read as a set) would leave its slow test in the quick suite: refused when the whole suite
    # is collected. (A file skipped whole, as test_triton_aot.py without triton, is not asked.)
    whole = [os.path.abspath(a) for a in config.args] == [os.path.dirname(__file__)]
    files = {item.nodeid.split("::")[0] for item in items}
    unmatched = sorted(p for p in unmatched if p.split("::")[0] in files)
    if unmatched and whole and not config.option.keyword:
        raise pytest.UsageError(f"tests/conftest.py SLOW: no test matches {unmatched}")
    if getattr(config.option, "dist", None) == "loadgroup":
        _spread_longest_first(items)
    if config.getoption("--full-matrix"):
        return
    left = [item for item in items if item.get_closest_marker("full_matrix") is not None]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item.get_closest_marker("full_matrix") is None]
