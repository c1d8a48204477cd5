"""The C++ CPU backend: ``torch.ops.fusedres_cpu.*``, kernels from ``fusedres._C`` (csrc/cpu/).

The op handles are named as the ops and take exactly the arguments of
:data:`fusedres.opdefs.SCHEMAS` (``bn_relu_conv2d``, ``bn_relu_conv2d_genstats``,
``bn_relu_conv2d_backward``, ``batch_stats``); statistics come back in the statistics dtype.
"""

from __future__ import annotations

import torch

from .. import _extension, opdefs

NAMESPACE = "fusedres_cpu"
OPS = tuple(opdefs.SCHEMAS)


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"it runs on CPU tensors only, not {device.type}"
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    missing = [op for op in OPS if not _extension.has_kernels(NAMESPACE, "CPU", op)]
    if missing:
        return f"fusedres._C has no CPU kernel for {NAMESPACE}::{', '.join(missing)}"
    return None


__getattr__ = _extension.op_handles(__name__, globals(), NAMESPACE)


# The eager route's entry points (fusedres.route): op handles, no Python layer between.
module_unit = prepare_batch_norm = batch_stats_op = None
if _extension.LOADED:  # else the cpu backend never runs (and its namespace may lack the ops)
    _ns = torch.ops.fusedres_cpu
    module_unit = _ns.module_unit.default
    prepare_batch_norm = _ns.prepare_batch_norm.default
    batch_stats_op = _ns.batch_stats.default


def batch_stats_tuple(x):
    """``(mean, var)`` of x from the C++ kernel, as a tuple."""
    return tuple(batch_stats_op(x))


def eager_pair(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd, stride,
               padding, dilation, stride2, padding2, dilation2, batch_stats, genstats):
    """Two convolutions of one BN-ReLU as one autograd node (fusedres.ops.EagerCpuPair):
    ``(y, y2, mean of y2, var of y2)``, the statistics None unless ``genstats``."""
    from ..ops import EagerCpuPair

    out = EagerCpuPair.apply(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd,
                             (stride, padding, dilation), (stride2, padding2, dilation2),
                             batch_stats, genstats)
    return out if genstats else (out[0], out[1], None, None)


def eager_unit_with_shortcut(args, genstats):
    """The unit handing out a view of x as the identity shortcut, whose gradient its backward
    adds into x's in the data-gradient pass (fusedres.ops.EagerCpuUnitWithShortcut)."""
    from ..ops import EagerCpuUnitWithShortcut

    return EagerCpuUnitWithShortcut.apply(*args, genstats)
