"""The memory-efficient algorithm written with PyTorch ops. Runs on any device.

Forward and backward build the activation ``a = relu((x - mean) * scale + beta)`` as a temporary
that dies inside the call; only ``x`` and per-channel vectors live between forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.opdefs import (
    BackwardArgs,
    UnitArgs,
    backward_outputs,
    out_memory_format,
    scale_shift,
    stats_dtype,
)

_REDUCE = (0, 2, 3)


def unavailable_reason(device: torch.device) -> str | None:
    return None


def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    xs = x.to(stats_dtype(x.dtype))
    if xs.numel() == 0:  # no values: NaN mean and variance, as torch.mean and torch.var give
        nan = xs.new_full((x.shape[1],), float("nan"))
        return nan, nan.clone()
    # The mean as a (pairwise) sum, as BatchNorm does: an inf input gives an inf mean, not the
    # NaN a Welford update would produce. That sum rounds at |mean|'s scale, an error a few
    # times float32's epsilon times |mean| / std in units of the spread (4x the rounding of
    # an exact mean, where BatchNorm's and the CPU kernels' double sums round once): corrected
    # by the mean of the centred x, whose terms are the spread's size. The variance of the
    # centred x (Welford's) is the variance of x.
    m0 = xs.mean(dim=_REDUCE)
    var, dm = torch.var_mean(xs - m0.view(1, -1, 1, 1), dim=_REDUCE, correction=0)
    return torch.where(m0.isfinite(), m0 + dm, m0), var


def _preactivation(x: Tensor, bn, scale: Tensor) -> Tensor:
    """``(x - mean) * scale + beta``, centred first as nn.BatchNorm2d is: the folded form
    ``scale * x + shift`` rounds ``scale * x`` and ``shift`` (each as large as ``mean * scale``)
    before they cancel, an error of float32's epsilon times ``|mean| / std`` in units of the
    output, which a channel whose mean is large against its spread (an ImageNet network's last
    stages at small input) turns into gradients several times further from float64 than
    plain PyTorch's (tests/test_bn_relu_conv.py, the last stages' regime). The CPU and CUDA
    kernels fold with a fused multiply-add, one rounding; ATen's addcmul is not one."""
    c = x.shape[1]
    z = x.to(scale.dtype) - bn.mean.view(1, c, 1, 1)
    if bn.bn_bias is None:
        return z.mul_(scale.view(1, c, 1, 1))
    return torch.addcmul(bn.bn_bias.view(1, c, 1, 1), z, scale.view(1, c, 1, 1))


def _per_sample(branch_scale: Tensor) -> Tensor:
    """The (N,) branch scale as an (N, 1, 1, 1) factor."""
    return branch_scale.view(-1, 1, 1, 1)


def bn_relu_conv2d(*inputs) -> Tensor:
    u = UnitArgs(*inputs)
    scale, _ = scale_shift(u)
    a = _preactivation(u.x, u, scale).relu_().to(u.weight.dtype)
    y = F.conv2d(a, u.weight, u.bias, list(u.stride), list(u.padding), list(u.dilation))
    del a
    y = y.contiguous(memory_format=out_memory_format(u.x, u.weight))
    if u.branch_scale is not None:  # in place: computed in float32 for half y, then rounded
        y.mul_(_per_sample(u.branch_scale))
    if u.residual is not None:
        y.add_(u.residual)
    return y


def bn_relu_conv2d_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    y = bn_relu_conv2d(*inputs)
    return (y, *batch_stats(y))


def bn_relu_conv2d_backward(*inputs) -> tuple[Tensor, ...]:
    b = BackwardArgs(*inputs)
    grad_out, x, weight, mean, invstd = b.grad_out, b.x, b.weight, b.mean, b.invstd
    stride, padding, dilation = b.stride, b.padding, b.dilation
    want_x, want_w, want_b, want_g, want_beta = b.output_mask
    outs = list(backward_outputs(x, weight, mean, b.output_mask))
    scale, _ = scale_shift(b)
    if b.branch_scale is not None:  # the conv branch's gradient: branch_scale[n] * grad_out[n]
        grad_out = grad_out * _per_sample(b.branch_scale)
    z = _preactivation(x, b, scale)
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
        if b.batch_stats:
            m = x.numel() // c
            dz.sub_(sum_dz.view(1, c, 1, 1) / m)
            dz.sub_(xhat * (sum_dz_xhat.view(1, c, 1, 1) / m))
        outs[0].copy_(dz.mul_(scale.view(1, c, 1, 1)))
    return tuple(outs)
