"""The CUDA C++ backend: ``torch.ops.fusedres_cuda.*``, kernels from csrc/cuda/.

The kernels in csrc/cuda are compiled twice: by nvcc (sm_80 and newer) into the product extension
``fusedres._C`` (when built with ``FUSEDRES_BUILD_CUDA``), registered for the CUDA dispatch key;
and by the host C++ compiler through the CPU execution layer (csrc/cuda/on_cpu) into the test
extension ``fusedres._C_cuda_on_cpu`` (built with ``FUSEDRES_BUILD_TEST_EXT=1``: ``make test``,
CI), registered for the CPU key. The CPU copy is a test vehicle, not a product: with
``FUSEDRES_CUDA_ON_CPU=1`` in the environment when this module is imported, this backend loads
it and runs CPU tensors through it (``auto`` never picks it for CPU tensors).

The op handles are named as the ops and take exactly the arguments of
:data:`fusedres.ops.opdefs.SCHEMAS`; statistics come back in the statistics dtype.
"""

from __future__ import annotations

import sys

import torch

from .. import settings
from ..ops import _extension, opdefs
from ..ops.opdefs import UnitArgs

NAMESPACE = "fusedres_cuda"
OPS = tuple(opdefs.SCHEMAS)

# Read once, at import: availability is cached per device type (fusedres.ops._backend).
ON_CPU: bool = settings.get("FUSEDRES_CUDA_ON_CPU")

# csrc/cuda is built for sm_80 and newer (bf16 mma.sync, cp.async, ldmatrix); an older GPU has
# no image to load, so it is reported unavailable instead of failing at the first launch.
MIN_CAPABILITY = (8, 0)


def missing_ops(dispatch_key: str) -> list[str]:
    """The ``fusedres_cuda`` ops with no kernel for ``dispatch_key`` ("CUDA" or "CPU")."""
    return [op for op in OPS if not _extension.has_kernels(NAMESPACE, dispatch_key, op)]


def unavailable_reason(device: torch.device) -> str | None:
    if device.type not in ("cuda", "cpu"):
        return f"it runs on CUDA tensors, not {device.type}"
    if device.type == "cpu":
        if not ON_CPU:
            return ("it runs on CUDA tensors; on CPU tensors only with FUSEDRES_CUDA_ON_CPU=1 "
                    "(the CUDA kernels executed by the CPU layer, a test vehicle)")
        error = _extension.load_cuda_on_cpu()
        if error is not None:
            return error
        missing = missing_ops("CPU")
        if missing:
            return (f"{_extension.CUDA_ON_CPU_MODULE} has no CPU kernel for "
                    f"{NAMESPACE}::{', '.join(missing)}")
        return None
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    missing = missing_ops("CUDA")
    if len(missing) == len(OPS):
        return "fusedres._C was built without CUDA kernels (FUSEDRES_BUILD_CUDA=0 or no nvcc)"
    if missing:
        return f"fusedres._C has no CUDA kernel for {NAMESPACE}::{', '.join(missing)}"
    if not torch.cuda.is_available():
        return "fusedres._C has the CUDA kernels but no CUDA device is visible"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        have, need = (".".join(map(str, c)) for c in (capability, MIN_CAPABILITY))
        return (f"the GPU ({torch.cuda.get_device_name(device)}) has compute capability {have}; "
                f"the CUDA kernels need {need} or newer")
    return None


_EAGER_UNIT = None


def eager_unit(args: UnitArgs, genstats: bool, affine=None):
    """The fused unit in eager mode where the extension lacks the C++ node (``eager_unit_op``):
    an ``autograd.Function`` over this backend's ops, without the public op's layers. Returns
    ``y``, or ``(y, mean, var)`` of y when ``genstats``."""
    global _EAGER_UNIT
    if _EAGER_UNIT is None:  # the op handles exist once the extension has loaded them
        from ..ops import direct_unit

        ns = getattr(torch.ops, NAMESPACE)
        _EAGER_UNIT = direct_unit("EagerCudaUnit", ns.bn_relu_conv2d, ns.bn_relu_conv2d_genstats,
                                  ns.bn_relu_conv2d_backward, eager=True)
    return _EAGER_UNIT.apply(*args, genstats)


# The eager routes' ops (csrc/eager.h via csrc/cuda/eager.cu; schemas:
# fusedres.ops.opdefs.NAMESPACE_SCHEMAS), as op handles ``torch.ops.fusedres_cuda.<op>.default``: a
# call is the dispatcher's, no Python frame of ours. None where no extension has their kernels
# (fusedres._C built with CUDA; with FUSEDRES_CUDA_ON_CPU=1 the test extension). Each is looked up
# on first use (the test extension loads then), then kept in the module.
#   module_unit(x, weight, bias, *bn, residual, stride, padding, dilation) -> [y], or [] with
#     nothing touched: the arguments are left to the Python route (bn a BatchNormArgs).
#   prepare_batch_norm(x, *bn[2:], mean=None, var=None) -> (mean, invstd)
#   eager_unit_op(*UnitArgs, genstats) -> (y, mean of y, var of y): the C++ autograd node.
#   eager_pair(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd, stride,
#     padding, dilation, stride2, padding2, dilation2, batch_stats, genstats) -> (y, y2, mean2,
#     var2)
_EAGER_HANDLES = {"module_unit": "module_unit", "prepare_batch_norm": "prepare_batch_norm",
                  "eager_unit_op": "eager_unit", "eager_pair": "eager_pair"}


def _eager_handle(op: str):
    if _extension.LOADED and _extension.has_kernels(NAMESPACE, "CUDA", op):
        return getattr(getattr(torch.ops, NAMESPACE), op).default
    if ON_CPU and _extension.load_cuda_on_cpu() is None and _extension.has_kernels(
            NAMESPACE, "CPU", op):
        return getattr(getattr(torch.ops, NAMESPACE), op).default
    return None


_op_handle = _extension.op_handles(__name__, globals(), NAMESPACE)


def fast_path() -> dict:
    """The fields of this backend's record (fusedres.ops._backend.Backend) for eager calls: the
    C++ layer's calls and autograd node (csrc/eager.h), or :func:`eager_unit` where the
    extension lacks the node."""
    from ..ops import eager_unit_of

    this = sys.modules[__name__]  # its op handles are looked up on first use (__getattr__)
    node = this.eager_unit_op
    return {"unit": eager_unit if node is None else eager_unit_of(node),
            "module_unit": this.module_unit, "prepare_batch_norm": this.prepare_batch_norm,
            "pair": this.eager_pair}


def __getattr__(name: str):
    if name in _EAGER_HANDLES:
        handle = _eager_handle(_EAGER_HANDLES[name])
        globals()[name] = handle  # later lookups find it directly
        return handle
    return _op_handle(name)
