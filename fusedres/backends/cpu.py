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
