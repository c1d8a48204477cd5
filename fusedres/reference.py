"""The oracle: plain ``F.batch_norm`` -> ReLU -> ``F.conv2d`` (+ residual), exactly as a block of
``nn.BatchNorm2d``, ``nn.ReLU`` and ``nn.Conv2d`` computes it. Tests and benchmarks import this
one; it saves every intermediate for backward, which is what fusedres removes."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def batch_norm_relu(x, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, *,
                    training, momentum, eps) -> Tensor:
    """``relu(batch_norm(x))`` with ``nn.BatchNorm2d.forward``'s bookkeeping, line for line."""
    factor = 0.0 if momentum is None else momentum
    if training and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
    use_batch = training or (running_mean is None and running_var is None)
    return F.relu(
        F.batch_norm(x, running_mean, running_var, bn_weight, bn_bias, use_batch, factor, eps)
    )


def conv2d(a, weight, bias, *, stride, padding, dilation, residual=None) -> Tensor:
    y = F.conv2d(a, weight, bias, stride, padding, dilation)
    return y if residual is None else y + residual


def bn_relu_conv2d(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                   num_batches_tracked=None, *, training, momentum=0.1, eps=1e-5, stride=1,
                   padding=0, dilation=1, residual=None) -> Tensor:
    a = batch_norm_relu(x, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                        training=training, momentum=momentum, eps=eps)
    return conv2d(a, weight, bias, stride=stride, padding=padding, dilation=dilation,
                  residual=residual)
