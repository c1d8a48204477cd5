"""The CUDA C++ backend: ``torch.ops.fusedres_cuda.*`` from ``fusedres._C`` (csrc/cuda/).

The kernels in csrc/cuda are compiled twice into ``fusedres._C``: by nvcc for sm_80/sm_90 (when
built with ``FUSEDRES_BUILD_CUDA``), registered for the CUDA dispatch key, and always by the host
C++ compiler through the CPU execution layer (csrc/cuda/host), registered for the CPU key. The
CPU copy is a test vehicle, not a product: with ``FUSEDRES_CUDA_ON_CPU=1`` in the environment
when this module is imported, this backend runs CPU tensors through it (``auto`` never picks it
for CPU tensors).
"""

from __future__ import annotations

import os

import torch

from .. import _extension
from ..ops import stats_dtype

# Read once, at import: availability is cached per device type (fusedres._backend).
ON_CPU = os.environ.get("FUSEDRES_CUDA_ON_CPU", "0") == "1"

_OPS = ("batch_stats", "bn_relu_conv2d", "bn_relu_conv2d_backward", "bn_relu_conv2d_genstats")


def missing_ops(dispatch_key: str) -> list[str]:
    """The ``fusedres_cuda`` ops with no kernel for ``dispatch_key`` ("CUDA" or "CPU")."""
    return [op for op in _OPS if not _extension.has_kernels("fusedres_cuda", dispatch_key, op)]


def unavailable_reason(device: torch.device) -> str | None:
    if device.type not in ("cuda", "cpu"):
        return f"it runs on CUDA tensors, not {device.type}"
    if device.type == "cpu" and not ON_CPU:
        return ("it runs on CUDA tensors; on CPU tensors only with FUSEDRES_CUDA_ON_CPU=1 "
                "(the CUDA kernels executed by the CPU layer, a test vehicle)")
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    key = "CUDA" if device.type == "cuda" else "CPU"
    missing = missing_ops(key)
    if device.type == "cuda" and len(missing) == len(_OPS):
        return "fusedres._C was built without CUDA kernels (FUSEDRES_BUILD_CUDA=0 or no nvcc)"
    if missing:
        return f"fusedres._C has no {key} kernel for fusedres_cuda::{', '.join(missing)}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "fusedres._C has the CUDA kernels but no CUDA device is visible"
    return None


def batch_stats(x):
    return tuple(torch.ops.fusedres_cuda.batch_stats(x))


def forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation):
    return torch.ops.fusedres_cuda.bn_relu_conv2d(
        x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation)


def forward_genstats(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                     padding, dilation):
    """``forward`` plus the (mean, biased var) of its output per channel, reduced in the
    convolution's epilogue, in the statistics dtype of y."""
    y, m, v = torch.ops.fusedres_cuda.bn_relu_conv2d_genstats(
        x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation)
    return y, m.to(stats_dtype(y.dtype)), v.to(stats_dtype(y.dtype))


def backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
             batch_stats, output_mask):
    return tuple(torch.ops.fusedres_cuda.bn_relu_conv2d_backward(
        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
        batch_stats, output_mask))
