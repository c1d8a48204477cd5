"""The Triton backend (kernels/, importable as ``fusedres.kernels``)."""

from __future__ import annotations

import os

import torch


def unavailable_reason(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpret:
        return "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return f"it runs on CUDA tensors, not {device.type}"
    return "the Triton kernels are not written yet"
