"""fusedres: fused BatchNorm -> ReLU -> Conv2d (+ residual) for deep pre-activation ResNets.

Importing never initialises CUDA and never fails for a missing compiled backend; it fails, in one
sentence naming the supported versions, on a torch older than fusedres supports (_versions.py).
"""

# ruff: noqa: E402 - the version check runs before the imports that need a supported torch
from __future__ import annotations

from . import _versions

_versions.check_torch()  # an older torch: ImportError, one sentence naming the supported versions

from . import (
    distributed,
    functional,
    memory,
    models,
    ops,  # registers the torch.library ops
    settings,
)
from ._version import __version__  # noqa: F401 - re-exported
from .convert import fuse
from .memory import activation_checkpoint
from .models import timm_registry as _timm_registry
from .models import unit_shapes
from .modules import (
    BasicBlock,
    BNReLUConv2d,
    Bottleneck,
    PreActBasicBlock,
    PreActBottleneck,
    ResidualBlock,
)
from .ops import (
    _extension,  # loads fusedres._C (its load error is reported, not raised)  # noqa: F401
    _source_checkout,  # fusedres.kernels in a checkout used in place, not installed  # noqa: F401
    opdefs,
)
from .ops._backend import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    get_backend,
    resolve_backend,
    set_backend,
    unavailable_reason,
    use_backend,
)
from .ops._extension import cpu_capability, cuda_kernel_sets, cutlass_launches

# The zoo in timm's registry when timm is installed (timm.create_model("fusedres_" + name)),
# without importing timm here (fusedres/models/timm_registry.py).
try:
    _timm_registry.install()
except Exception as _e:  # noqa: BLE001 - an optional integration never breaks the import
    import warnings

    warnings.warn(f"fusedres: timm registration skipped ({type(_e).__name__}: {_e})",
                  stacklevel=2)

__all__ = [
    "BACKENDS",
    "BNReLUConv2d",
    "BackendUnavailableError",
    "BasicBlock",
    "Bottleneck",
    "PreActBasicBlock",
    "PreActBottleneck",
    "ResidualBlock",
    "activation_checkpoint",
    "available_backends",
    "cpu_capability",
    "cuda_kernel_sets",
    "cutlass_launches",
    "distributed",
    "functional",
    "fuse",
    "get_backend",
    "memory",
    "models",
    "opdefs",
    "ops",
    "resolve_backend",
    "set_backend",
    "settings",
    "unavailable_reason",
    "unit_shapes",
    "use_backend",
]
