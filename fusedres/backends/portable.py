"""The memory-efficient algorithm written with PyTorch ops. Runs on any device.

Forward and backward build the activation ``a = relu(scale * x + shift)`` as a temporary that dies
inside the call; only ``x`` and per-channel vectors live between forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import backward_empty_outputs, out_memory_format, stats_dtype

_REDUCE = (0, 2, 3)


def unavailable_reason(device: torch.device) -> str | None:
    return None


def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    xs = x.to(stats_dtype(x.dtype))
    # The mean as a (pairwise) sum, as BatchNorm does: an inf input gives an inf mean, not the
    # NaN a Welford update would produce. The variance is Welford's (stable for large means).
    return xs.mean(dim=_REDUCE), torch.var(xs, dim=_REDUCE, correction=0)


def scale_shift(bn_weight, bn_bias, mean, invstd) -> tuple[Tensor, Tensor]:
    """Per-channel affine of the fused BatchNorm: ``bn(x) = scale * x + shift``."""
    scale = invstd if bn_weight is None else bn_weight * invstd
    shift = -mean * scale if bn_bias is None else bn_bias - mean * scale
    return scale, shift


def _preactivation(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    c = x.shape[1]
    return torch.addcmul(shift.view(1, c, 1, 1), x.to(scale.dtype), scale.view(1, c, 1, 1))


def forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation) -> Tensor:
    scale, shift = scale_shift(bn_weight, bn_bias, mean, invstd)
    a = _preactivation(x, scale, shift).relu_().to(weight.dtype)
    y = F.conv2d(a, weight, bias, list(stride), list(padding), list(dilation))
    del a
    y = y.contiguous(memory_format=out_memory_format(x, weight))
    if residual is not None:
        y.add_(residual)
    return y


def backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
             batch_stats, output_mask):
    want_x, want_w, want_b, want_g, want_beta = output_mask
    outs = list(backward_empty_outputs(x, weight, mean, output_mask))
    scale, shift = scale_shift(bn_weight, bn_bias, mean, invstd)
    z = _preactivation(x, scale, shift)
    a = z.relu().to(weight.dtype)
    need_da = want_x or want_g or want_beta
    grad_a, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad_out.to(weight.dtype), a, weight, [weight.shape[0]] if want_b else None,
        list(stride), list(padding), list(dilation), False, [0, 0], 1,
        [need_da, want_w, want_b],
    )
    del a
    if want_w:
        outs[1].copy_(grad_w)
    if want_b:
        outs[2].copy_(grad_b)
    if not need_da:
        return tuple(outs)
    # dz = da * relu'(z): the ReLU mask is recomputed from x, never stored.
    dz = grad_a.to(z.dtype).masked_fill_(z <= 0, 0)
    del z, grad_a
    c = x.shape[1]
    xhat = (x.to(mean.dtype) - mean.view(1, c, 1, 1)) * invstd.view(1, c, 1, 1)
    sum_dz = dz.sum(_REDUCE)
    sum_dz_xhat = (dz * xhat).sum(_REDUCE)
    if want_g:
        outs[3].copy_(sum_dz_xhat)
    if want_beta:
        outs[4].copy_(sum_dz)
    if want_x:
        if batch_stats:
            m = x.numel() // c
            dz.sub_(sum_dz.view(1, c, 1, 1) / m)
            dz.sub_(xhat * (sum_dz_xhat.view(1, c, 1, 1) / m))
        outs[0].copy_(dz.mul_(scale.view(1, c, 1, 1)))
    return tuple(outs)
