"""The oracle: plain ``F.batch_norm`` -> ReLU -> ``F.conv2d`` (+ residual), exactly as a block of
``nn.BatchNorm2d``, ``nn.ReLU`` and ``nn.Conv2d`` computes it. Tests and benchmarks import this
one; it saves every intermediate for backward, which is what fusedres removes.

``branch_scale`` (N,): the per-sample factor of stochastic depth, applied as
``torchvision.ops.stochastic_depth(branch, p, mode="row")`` applies its noise: the branch times
the factor in the branch's dtype, then the residual added."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .opdefs import BatchNormArgs


def batch_norm_relu(x, bn: BatchNormArgs) -> Tensor:
    """``relu(batch_norm(x))`` with ``nn.BatchNorm2d.forward``'s bookkeeping, line for line."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    return F.relu(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                               use_batch, factor, bn.eps))


def scale_branch(branch: Tensor, branch_scale: Tensor | None) -> Tensor:
    """``branch * branch_scale[n]`` per sample, in the branch's dtype (torchvision's noise)."""
    if branch_scale is None:
        return branch
    return branch * branch_scale.to(branch.dtype).view(-1, 1, 1, 1)


def conv2d(a, weight, bias, *, stride, padding, dilation, residual=None,
           branch_scale=None) -> Tensor:
    y = scale_branch(F.conv2d(a, weight, bias, stride, padding, dilation), branch_scale)
    return y if residual is None else y + residual


def bn_relu_conv2d(x, weight, bias, bn: BatchNormArgs, *, stride=1, padding=0, dilation=1,
                   residual=None, branch_scale=None) -> Tensor:
    a = batch_norm_relu(x, bn)
    return conv2d(a, weight, bias, stride=stride, padding=padding, dilation=dilation,
                  residual=residual, branch_scale=branch_scale)
