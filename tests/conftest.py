"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter here, and the CUDA C++ kernels through
their CPU execution layer; the variables must be set before any kernel module is imported, so
they are set first thing (an explicit TRITON_INTERPRET=0 or FUSEDRES_CUDA_ON_CPU=0 in the
environment keeps them off, e.g. on a GPU machine).
"""

import os

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
def tiny_run(tmp_path_factory):
    from fusedres.train import main

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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full-matrix"):
        return
    left = [item for item in items if item.get_closest_marker("full_matrix") is not None]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item.get_closest_marker("full_matrix") is None]
