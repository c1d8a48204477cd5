"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter here; the variable must be set before
any kernel module is imported, so it is set first thing (an explicit TRITON_INTERPRET=0 in the
environment keeps it off, e.g. on a GPU machine).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

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
