"""The C++ CPU backend: ``torch.ops.fusedres_cpu.*`` from ``fusedres._C`` (csrc/cpu/)."""

from __future__ import annotations

import torch

from .. import _extension

_OPS = ("batch_stats", "bn_relu_conv2d", "bn_relu_conv2d_backward")


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"it runs on CPU tensors only, not {device.type}"
    if not _extension.LOADED:
        return _extension.LOAD_ERROR
    if not _extension.has_kernels("fusedres_cpu", "CPU", *_OPS):
        return "fusedres._C was built without the CPU kernels"
    return None


def batch_stats(x):
    return tuple(torch.ops.fusedres_cpu.batch_stats(x))


def forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation):
    return torch.ops.fusedres_cpu.bn_relu_conv2d(
        x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation)


def backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
             batch_stats, output_mask):
    return tuple(torch.ops.fusedres_cpu.bn_relu_conv2d_backward(
        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
        batch_stats, output_mask))
