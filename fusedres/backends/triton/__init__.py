"""The Triton backend: kernels/ (importable as ``fusedres.kernels``).

Three modules, by role: :mod:`.plans` (what a call launches, fixed once per its tensors'
metadata), :mod:`.ops` (the ops of fusedres.ops.opdefs under their names, through the
``fusedres_triton`` triton_ops that torch.compile sees into) and :mod:`.eager` (the eager
route's ``autograd.Function`` and one-call module forward, launching through the same plans).
This module says whether the backend can run and names what the rest of fusedres reads; it
imports the three only where the kernels import (triton installed, kernels/ whole), so that
``import fusedres`` never fails for a missing backend.
"""

from __future__ import annotations

import os

import torch

_KERNELS_ERROR: str | None = None
try:
    from .eager import (
        EagerTritonUnit,
        eager_launches,
        eager_unit,
        module_unit,
        prepare_affine,
    )
    from .ops import (
        DEVICE_TYPES,
        CompiledUnit,
        batch_stats,
        bn_relu_conv2d,
        bn_relu_conv2d_backward,
        bn_relu_conv2d_genstats,
        compiled_batch_stats,
        compiled_unit,
        prepare_batch_norm,
    )
    from .plans import BackwardPlan, backward_strategy, prepares
except ImportError as exc:  # triton missing, or a kernels/ install problem
    _KERNELS_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["DEVICE_TYPES", "BackwardPlan", "CompiledUnit", "EagerTritonUnit", "backward_strategy",
           "batch_stats", "bn_relu_conv2d", "bn_relu_conv2d_backward", "bn_relu_conv2d_genstats",
           "compiled_batch_stats", "compiled_unit", "eager_launches", "eager_unit",
           "module_unit", "prepare_affine", "prepare_batch_norm", "prepares",
           "fast_path", "unavailable_reason"]


def fast_path() -> dict:
    """The fields of this backend's record (fusedres.ops._backend.Backend) beyond its ops: the
    eager route's unit and one-call module forward, the preparation's launch (:mod:`.eager`),
    and the record of a graph torch.compile traces (:data:`CompiledUnit` over the triton_ops)."""
    from ...ops._backend import Backend

    return {"unit": eager_unit, "module_unit": module_unit,
            "prepare_batch_norm": prepare_batch_norm, "prepare_affine": prepare_affine,
            "prepares": prepares,
            "compiled": Backend("triton-compiled", unit=compiled_unit,
                                batch_stats=compiled_batch_stats)}


def unavailable_reason(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if _KERNELS_ERROR is not None:
        return f"the Triton kernels failed to import ({_KERNELS_ERROR})"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu":
        return None if interpret else "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"it runs on CUDA tensors, not {device.type}"
    if not interpret and not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None
