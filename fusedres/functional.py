"""Functional API: fused BatchNorm -> ReLU -> Conv2d (+ residual), optionally with a per-sample
branch scale (stochastic depth / drop-path): ``y = residual + branch_scale[n] * conv(...)``.

``bn_relu_conv2d`` is the one-call form. A BatchNorm-ReLU that feeds two convolutions (the
projection shortcut of He et al.'s dimension-changing unit) uses the two-step form:
``prepare_batch_norm`` (one statistics pass, one running-stats update) and then
``conv2d_from_prepared`` once per convolution; no activation is stored for either. Inside,
a BatchNorm travels as one value, :class:`BatchNormArgs` (``prepare`` takes it;
``batch_norm_args`` reads it from a module).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from .ops import _backend, reference
from .ops._backend import route
from .ops.checks import (
    autocast_dtype,
    check_batch_norm_args,
    check_branch_scale,
    check_conv_args,
    check_x,
)
from .ops.opdefs import BatchNormArgs, ConvGeometry, UnitArgs, stats_dtype

__all__ = [
    "BatchNormArgs",
    "BN_BUFFERS",
    "BN_PARAMETERS",
    "BatchNormState",
    "batch_norm_args",
    "ConvGeometry",
    "bn_relu_conv2d",
    "check_branch_scale",
    "check_conv_args",
    "check_x",
    "conv2d_from_prepared",
    "conv2d_pair_from_prepared",
    "prepare",
    "prepare_batch_norm",
]

class BatchNormState(NamedTuple):
    """What a fused convolution needs from its BatchNorm, computed once per forward.

    ``mean``/``invstd`` are per-channel (C,) in the statistics dtype (float32 for half inputs);
    ``batch_stats`` says whether they are this batch's (training-mode BatchNorm). On the
    ``reference`` backend ``activated`` holds ``relu(bn(x))`` and the other fields are unused.
    """

    x: Tensor
    bn_weight: Tensor | None
    bn_bias: Tensor | None
    mean: Tensor | None
    invstd: Tensor | None
    batch_stats: bool
    activated: Tensor | None = None
    # The fused affine (scale, shift) (C,) when the preparation made it (the triton route's
    # launch does): the unit's kernels read it instead of making it again.
    affine: tuple[Tensor, Tensor] | None = None


def prepare_batch_norm(x: Tensor, bn_weight: Tensor | None, bn_bias: Tensor | None,
                       running_mean: Tensor | None, running_var: Tensor | None,
                       num_batches_tracked: Tensor | None = None, *, training: bool,
                       momentum: float | None = 0.1, eps: float = 1e-5,
                       stats: tuple[Tensor, Tensor] | None = None) -> BatchNormState:
    """Batch statistics and running-stats update of ``nn.BatchNorm2d``, once.

    Args are those of ``F.batch_norm`` plus ``num_batches_tracked`` (incremented in training;
    needed when ``momentum`` is None, the cumulative average) and ``stats``: the batch mean and
    biased variance of ``x`` per channel when they are already known, as
    ``conv2d_from_prepared(..., return_stats=True)`` gives them for its output (then no
    statistics pass runs; ignored when the BatchNorm uses its running statistics). All checks
    run before any state is touched. Returns a :class:`BatchNormState` for
    :func:`conv2d_from_prepared`. :func:`prepare` is the same for a :class:`BatchNormArgs`.
    """
    bn = BatchNormArgs(bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                       training, momentum, eps)
    return prepare(bn, x, stats)


# An nn.BatchNorm2d's tensors (a subclass's too: it registers all five, None where it has
# none) as Module.__getattr__ finds them, read from its dicts without a Python call each: with
# training, momentum and eps after them, BatchNormArgs's fields in order. The eager routes,
# where each Python call counts a step, unpack these into the op call (fusedres.modules); they
# run outside torch.compile's traces, which do not read through itemgetter.
BN_PARAMETERS = operator.itemgetter("weight", "bias")
BN_BUFFERS = operator.itemgetter("running_mean", "running_var", "num_batches_tracked")


def batch_norm_args(bn: nn.Module) -> BatchNormArgs:
    """The :class:`BatchNormArgs` of ``bn``, an ``nn.BatchNorm2d`` or any module with its
    attributes (read as attributes: torch.compile traces them, and a subclass may define them
    otherwise)."""
    return BatchNormArgs(bn.weight, bn.bias, bn.running_mean, bn.running_var,
                         bn.num_batches_tracked, bn.training, bn.momentum, bn.eps)


def prepare(bn: BatchNormArgs, x: Tensor,
            stats: tuple[Tensor, Tensor] | None = None) -> BatchNormState:
    """:func:`prepare_batch_norm` for the BatchNorm ``bn`` (:func:`batch_norm_args` of a
    module): its statistics for ``x`` and its running-statistics update, once, every argument
    checked before any state is touched."""
    check_batch_norm_args(x, bn, stats)
    c = x.shape[1]
    use_batch = bn.training or bn.running_mean is None
    count = x.numel() // c if c else 0

    if _backend.get_backend() == "reference":
        a = reference.batch_norm_relu(x, bn)
        return BatchNormState(x, bn.weight, bn.bias, None, None, use_batch, a)

    sdt = stats_dtype(x.dtype)
    if use_batch and count == 0:
        # An empty batch, as nn.BatchNorm2d: counted, running statistics unchanged, empty output.
        if bn.training and bn.num_batches_tracked is not None:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
        mean, var = x.new_zeros((c,), dtype=sdt), x.new_ones((c,), dtype=sdt)
    else:
        r = route(x)
        if r.prepare_batch_norm is not None and (
                r.prepares is None
                or r.prepares(x, bn.running_mean, bn.running_var, bn.training)):
            # The rule below in the backend's own call (C++, or two launches): ~10 ops fewer.
            given = stats if stats is not None and use_batch else (None, None)
            weight, bias = _cast(bn.weight, sdt), _cast(bn.bias, sdt)
            affine = None
            if r.prepare_affine is not None:  # and the affine, in the same launch
                mean, invstd, *affine = r.prepare_affine(x, weight, bias, *bn[2:], *given)
            else:
                mean, invstd = r.prepare_batch_norm(x, *bn[2:], *given)
            if given[0] is not None:  # the caller's tensor (an op returns a copy)
                mean = given[0]
            return BatchNormState(x, weight, bias, mean, invstd, use_batch, None, affine)
        if use_batch:
            mean, var = stats if stats is not None else r.batch_stats(x.detach())
            if bn.training and bn.running_mean is not None:
                _update_running_stats(bn, mean, var, count)
        else:
            mean = bn.running_mean.detach().to(sdt)
            var = bn.running_var.detach().to(sdt)
    invstd = torch.rsqrt(var + bn.eps)
    return BatchNormState(x, _cast(bn.weight, sdt), _cast(bn.bias, sdt), mean, invstd, use_batch)


def _cast(p: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return p if p is None or p.dtype == dtype else p.to(dtype)


@torch.no_grad()
def _update_running_stats(bn: BatchNormArgs, mean: Tensor, var: Tensor, count: int) -> None:
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if bn.momentum is None:  # cumulative average; a tensor factor keeps torch.compile graphs whole
        factor = 1.0 / bn.num_batches_tracked.to(bn.running_mean.dtype)
    else:
        factor = bn.momentum
    unbiased = var * (count / (count - 1))
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype) * factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype) * factor)


def conv2d_from_prepared(state: BatchNormState, weight: Tensor, bias: Tensor | None = None, *,
                         stride=1, padding=0, dilation=1, residual: Tensor | None = None,
                         return_stats: bool = False, geometry: ConvGeometry | None = None,
                         branch_scale: Tensor | None = None):
    """``residual + branch_scale[n] * conv2d(relu(bn(x)), weight, bias, stride, padding,
    dilation)`` for the BatchNorm prepared in ``state``. Shapes: weight (Co, C, kh, kw), bias
    (Co,), residual (N, Co, Ho, Wo), branch_scale (N,). groups=1 only.

    ``branch_scale``: stochastic depth / drop-path's per-sample factor (0 for a dropped sample,
    1 / keep-probability for a kept one, as ``torchvision.ops.stochastic_depth(..., mode="row")``
    draws it), any floating dtype on x's device; cast here to the statistics dtype (float32 for
    half inputs). The kernels apply it inside the convolution, no extra pass (forward: the
    epilogue or the operand load; backward: where grad_out is loaded or in the data gradient's
    epilogue). The residual is not scaled and its gradient is grad_out. ``branch_scale`` takes
    no gradient: it is a random draw, not a parameter. A caller passing ``geometry`` checks the
    branch scale too (``check_conv_args(..., branch_scale=)``) before preparing the BatchNorm, so
    that a bad one leaves the running statistics alone.

    ``return_stats=True`` returns ``(y, stats)``, ``stats`` being the per-channel batch mean and
    biased variance of ``y`` for the ``prepare_batch_norm`` of the BatchNorm that ``y`` feeds
    (None on the reference backend, which keeps no statistics). The Triton backend reduces them
    in the convolution's epilogue, so the next BatchNorm reads ``y`` once fewer.

    ``geometry``: the :class:`ConvGeometry` that :func:`check_conv_args` returned for these
    arguments (a module that checked them before preparing its BatchNorm); then they are not
    checked again and ``stride``, ``padding``, ``dilation`` are ignored."""
    if geometry is None:
        geometry = check_conv_args(state.x, weight, bias, residual, stride, padding, dilation,
                                   branch_scale=branch_scale)
    elif branch_scale is not None:
        check_branch_scale(branch_scale, state.x)
    x = state.x
    if state.activated is not None:
        y = reference.conv2d(state.activated, weight, bias, stride=geometry.stride,
                             padding=geometry.padding, dilation=geometry.dilation,
                             residual=residual, branch_scale=branch_scale)
        return (y, None) if return_stats else y
    if branch_scale is not None:
        sdt = stats_dtype(x.dtype)
        branch_scale = branch_scale.detach()
        if branch_scale.dtype != sdt:
            branch_scale = branch_scale.to(sdt)

    dt = autocast_dtype(x, weight)
    if dt is not None:
        # As the plain block under autocast: BN in float32, the conv in the autocast dtype.
        weight = weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    # A residual of another dtype is added outside, following PyTorch's type promotion.
    inner = residual if residual is not None and residual.dtype == weight.dtype else None
    args = UnitArgs(x=x, weight=weight, bias=bias, bn_weight=state.bn_weight,
                    bn_bias=state.bn_bias, mean=state.mean, invstd=state.invstd, residual=inner,
                    stride=geometry.stride, padding=geometry.padding,
                    dilation=geometry.dilation, batch_stats=state.batch_stats,
                    branch_scale=branch_scale)
    if return_stats and (residual is None or inner is not None):
        y, mean, var = _unit(args, True, state.affine)
        return y, (mean, var)
    y = _unit(args, False, state.affine)
    if residual is not None and inner is None:
        y = y + residual
    if return_stats:  # the residual was added outside: the statistics of the sum
        return y, _batch_stats(y.detach())
    return y


def conv2d_pair_from_prepared(state: BatchNormState, weight: Tensor, bias: Tensor | None,
                              geometry: ConvGeometry, weight2: Tensor, bias2: Tensor | None,
                              geometry2: ConvGeometry, *, return_stats: bool = False):
    """``(conv2d(a, weight, bias), conv2d(a, weight2, bias2))`` for ``a = relu(bn(x))`` prepared
    in ``state``: two convolutions of one BN-ReLU, as a pre-activation unit's projection
    shortcut and first convolution (geometries from :func:`check_conv_args`, already checked).
    ``return_stats``: the second is ``(y2, stats of y2)`` as
    :func:`conv2d_from_prepared` gives them.

    On the cpu backend in eager mode the two are one autograd node (its ``eager_pair``):
    its backward recomputes the activation once and makes one pass over x for the ReLU mask
    and BatchNorm sums and one for the data gradient, as plain PyTorch's one BatchNorm-ReLU
    backward does, instead of two of each. Elsewhere (other backends, autocast, tracing) two
    :func:`conv2d_from_prepared` calls."""
    x = state.x
    pair = route(x, weight).pair if state.activated is None else None
    if (pair is not None and autocast_dtype(x, weight) is None
            and weight.dtype == weight2.dtype
            and all(b is None or b.dtype == weight.dtype for b in (bias, bias2))):
        y, y2, mean2, var2 = pair(x, weight, bias, weight2, bias2, state.bn_weight, state.bn_bias,
                                  state.mean, state.invstd, *geometry, *geometry2,
                                  state.batch_stats, return_stats)
        return y, ((y2, (mean2, var2)) if return_stats else y2)
    y = conv2d_from_prepared(state, weight, bias, geometry=geometry)
    return y, conv2d_from_prepared(state, weight2, bias2, geometry=geometry2,
                                   return_stats=return_stats)


def conv2d_with_shortcut_from_prepared(state: BatchNormState, weight: Tensor,
                                       bias: Tensor | None, geometry: ConvGeometry, *,
                                       return_stats: bool = False):
    """``(x, conv2d(a, weight, bias))`` for ``a = relu(bn(x))`` prepared in ``state`` (geometry
    from :func:`check_conv_args`, already checked): a pre-activation unit's first convolution
    and its identity shortcut ``x``, the last convolution's residual. ``return_stats``: the
    second is ``(y, stats of y)`` as :func:`conv2d_from_prepared` gives them.

    On the cpu backend in eager mode the ``x`` returned is a view that the fused op hands out
    (its ``eager_unit_with_shortcut``), so that the two gradients of x, the shortcut's and the
    convolution's, are summed in the op's data-gradient pass instead of by autograd in a pass
    of its own. Elsewhere ``x`` itself and :func:`conv2d_from_prepared`."""
    x = state.x
    with_shortcut = route(x, weight).unit_with_shortcut if state.activated is None else None
    if with_shortcut is not None and autocast_dtype(x, weight) is None:
        args = UnitArgs(x=x, weight=weight, bias=bias, bn_weight=state.bn_weight,
                        bn_bias=state.bn_bias, mean=state.mean, invstd=state.invstd,
                        residual=None, stride=geometry.stride, padding=geometry.padding,
                        dilation=geometry.dilation, batch_stats=state.batch_stats,
                        branch_scale=None)
        out = with_shortcut(*args, return_stats)
        return out[1], ((out[0], (out[2], out[3])) if return_stats else out[0])
    return x, conv2d_from_prepared(state, weight, bias, geometry=geometry,
                                   return_stats=return_stats)


def _unit(args: UnitArgs, genstats: bool, affine=None):
    return route(args.x, args.weight).unit(args, genstats, affine)


def _batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    return route(x).batch_stats(x)


def bn_relu_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, bn_weight: Tensor | None,
                   bn_bias: Tensor | None, running_mean: Tensor | None,
                   running_var: Tensor | None, num_batches_tracked: Tensor | None = None, *,
                   training: bool, momentum: float | None = 0.1, eps: float = 1e-5,
                   stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                   dilation: int | Sequence[int] = 1,
                   residual: Tensor | None = None,
                   branch_scale: Tensor | None = None) -> Tensor:
    """``residual + branch_scale[n] * conv2d(relu(batch_norm(x)), weight, bias, stride, padding,
    dilation)`` (no residual: 0; no branch_scale: 1).

    Shapes: x (N, C, H, W); weight (Co, C, kh, kw); bias (Co,); BN tensors (C,); residual
    (N, Co, Ho, Wo); branch_scale (N,), stochastic depth's per-sample factor (see
    :func:`conv2d_from_prepared`; no gradient). BatchNorm semantics are ``nn.BatchNorm2d``'s
    (running statistics updated in training, used in eval; batch statistics when there are
    none). Backward keeps ``x``, per-channel statistics and the (N,) branch scale only and
    recomputes the activation. Every argument is checked before the running statistics are
    touched.
    """
    # Check the convolution's arguments first too: nothing may change if they are wrong.
    geometry = check_conv_args(x, weight, bias, residual, stride, padding, dilation,
                               branch_scale=branch_scale)
    bn = BatchNormArgs(bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                       training, momentum, eps)
    return conv2d_from_prepared(prepare(bn, x), weight, bias, residual=residual,
                                geometry=geometry, branch_scale=branch_scale)
