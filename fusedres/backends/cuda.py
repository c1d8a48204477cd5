"""The CUDA C++ backend: ``torch.ops.fusedres_cuda.*`` from ``fusedres._C`` (csrc/cuda/)."""

from __future__ import annotations

import torch

from .. import _extension


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it runs on CUDA tensors only, not {device.type}"
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    if not _extension.has_kernels("fusedres_cuda", "CUDA", "bn_relu_conv2d"):
        return "fusedres._C was built without CUDA kernels (FUSEDRES_BUILD_CUDA=0 or no nvcc)"
    return None
