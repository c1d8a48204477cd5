"""The C++ CPU backend: ``torch.ops.fusedres_cpu.*``, kernels from ``fusedres._C`` (csrc/cpu/).

The op handles are named as the ops and take exactly the arguments of
:data:`fusedres.ops.opdefs.SCHEMAS` (``bn_relu_conv2d``, ``bn_relu_conv2d_genstats``,
``bn_relu_conv2d_backward``, ``batch_stats``); statistics come back in the statistics dtype.
"""

from __future__ import annotations

import torch

from ..ops import _extension, opdefs

NAMESPACE = "fusedres_cpu"
OPS = tuple(opdefs.SCHEMAS)


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"it runs on CPU tensors only, not {device.type}"
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    if _extension.CPU_CAPABILITY_ERROR is not None:
        return _extension.CPU_CAPABILITY_ERROR
    missing = [op for op in OPS if not _extension.has_kernels(NAMESPACE, "CPU", op)]
    if missing:
        return f"fusedres._C has no CPU kernel for {NAMESPACE}::{', '.join(missing)}"
    return None


def _handle(op: str, dispatch_key: str = "CPU"):
    """``torch.ops.fusedres_cpu.<op>.default`` when fusedres._C has its kernel, else None."""
    if not (_extension.LOADED and _extension.has_kernels(NAMESPACE, dispatch_key, op)):
        return None
    return getattr(getattr(torch.ops, NAMESPACE), op).default


# The eager routes' ops (csrc/eager.h, schemas: fusedres.ops.opdefs.NAMESPACE_SCHEMAS), bound as op
# handles: a call is the dispatcher's, no Python frame of ours. None where fusedres._C lacks them.
# module_unit(x, weight, bias, *bn, residual, stride, padding, dilation) -> [y], or [] with
#   nothing touched: the arguments are left to the Python route (its checks word the error);
#   bn a fusedres.ops.opdefs.BatchNormArgs.
module_unit = _handle("module_unit", "CompositeImplicitAutograd")
# prepare_batch_norm(x, *bn[2:], mean=None, var=None) -> (mean, invstd)
prepare_batch_norm = _handle("prepare_batch_norm")
# eager_unit_op(*UnitArgs, genstats) -> (y, mean of y, var of y): the unit's C++ autograd node.
eager_unit_op = _handle("eager_unit")
# eager_pair(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd, stride, padding,
#   dilation, stride2, padding2, dilation2, batch_stats, genstats) -> (y, y2, mean2, var2)
eager_pair = _handle("eager_pair")
# eager_unit_with_shortcut(*UnitArgs (no residual, no branch_scale), genstats) -> (y, x as a view,
#   mean of y, var of y): x's two gradients summed in the backward's data-gradient pass.
eager_unit_with_shortcut = _handle("eager_unit_with_shortcut")

__getattr__ = _extension.op_handles(__name__, globals(), NAMESPACE)


def batch_stats_tuple(x):
    """``(mean, var)`` of x from the C++ kernel, as a tuple (the eager path's batch_stats)."""
    return tuple(torch.ops.fusedres_cpu.batch_stats.default(x))


def fast_path() -> dict:
    """The fields of this backend's record (fusedres.ops._backend.Backend) for eager calls: the
    C++ layer's calls and autograd nodes (csrc/eager.h). None of them where fusedres._C is not
    loaded (the namespace may then lack the ops; the backend does not run)."""
    if not _extension.LOADED:
        return {}
    from ..ops import eager_unit_of

    return {"unit": eager_unit_of(eager_unit_op), "batch_stats": batch_stats_tuple,
            "module_unit": module_unit, "prepare_batch_norm": prepare_batch_norm,
            "pair": eager_pair, "unit_with_shortcut": eager_unit_with_shortcut}
