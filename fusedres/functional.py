"""Functional API: fused BatchNorm -> ReLU -> Conv2d (+ residual), optionally with a per-sample
branch scale (stochastic depth / drop-path): ``y = residual + branch_scale[n] * conv(...)``.

``bn_relu_conv2d`` is the one-call form. A BatchNorm-ReLU that feeds two convolutions (the
projection shortcut of He et al.'s dimension-changing unit) uses the two-step form:
``prepare_batch_norm`` (one statistics pass, one running-stats update) and then
``conv2d_from_prepared`` once per convolution; no activation is stored for either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _backend, reference
from .opdefs import ConvGeometry, UnitArgs, out_shape, stats_dtype
from .route import route

__all__ = [
    "BatchNormState",
    "ConvGeometry",
    "bn_relu_conv2d",
    "check_branch_scale",
    "check_conv_args",
    "check_x",
    "conv2d_from_prepared",
    "conv2d_pair_from_prepared",
    "prepare_batch_norm",
]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _pair(value, name: str, *, minimum: int) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value) if isinstance(
        value, (tuple, list, torch.Size)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ValueError(f"{name}: expected an int or a pair of ints, got {value!r}")
    if min(pair) < minimum:
        raise ValueError(f"{name}: expected values >= {minimum}, got {value!r}")
    return pair


def _check_vector(t: Tensor | None, name: str, c: int, x: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a Tensor or None, got {type(t).__name__}")
    if t.shape != (c,):
        raise ValueError(f"{name}: expected shape ({c},) (one value per channel of x), "
                         f"got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (the device of x), got {t.device}")
    if t.dtype not in _FLOAT:
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def _check_stats(stats, x: Tensor) -> None:
    c, sdt = x.shape[1], stats_dtype(x.dtype)
    if not (isinstance(stats, (tuple, list)) and len(stats) == 2
            and all(isinstance(t, Tensor) for t in stats)):
        raise TypeError("stats: expected a pair of tensors (mean, biased variance) or None, got "
                        f"{type(stats).__name__}")
    for t, name in zip(stats, ("stats[0] (mean)", "stats[1] (variance)")):
        if t.shape != (c,) or t.dtype != sdt or t.device != x.device:
            raise ValueError(f"{name}: expected shape ({c},), dtype {sdt} and device {x.device} "
                             f"(the statistics of x), got shape {tuple(t.shape)}, dtype "
                             f"{t.dtype}, device {t.device}")


def _autocast_dtype(x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype autocast runs this conv in, or None when it leaves it alone (autocast off, or
    float64 operands, which autocast never casts)."""
    device_type = x.device.type
    if not (torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)):
        return None
    if x.dtype == torch.float64 or weight.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)


def check_branch_scale(branch_scale, x: Tensor) -> None:
    """Raise the error the fused functions raise for a ``branch_scale`` that is not a floating
    (N,) tensor on the device of ``x``."""
    if branch_scale is None:
        return
    if not isinstance(branch_scale, Tensor):
        raise TypeError(f"branch_scale: expected a Tensor or None, got "
                        f"{type(branch_scale).__name__}")
    n = x.shape[0]
    if tuple(branch_scale.shape) != (n,):
        raise ValueError(f"branch_scale: expected shape ({n},) (one factor per sample of x), "
                         f"got {tuple(branch_scale.shape)}")
    if branch_scale.device != x.device:
        raise ValueError(f"branch_scale: expected device {x.device} (the device of x), got "
                         f"{branch_scale.device}")
    if branch_scale.dtype not in _FLOAT:
        raise ValueError(f"branch_scale: expected a floating-point tensor, got "
                         f"{branch_scale.dtype}")


def check_x(x: Tensor) -> None:
    """Raise the error the fused functions raise for an ``x`` that is not a 4-D float tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x: expected a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"x: expected float16, bfloat16, float32 or float64, got {x.dtype}")


def check_batch_norm_args(x: Tensor, bn_weight: Tensor | None, bn_bias: Tensor | None,
                          running_mean: Tensor | None, running_var: Tensor | None,
                          num_batches_tracked: Tensor | None = None, *, training: bool,
                          momentum: float | None = 0.1,
                          stats: tuple[Tensor, Tensor] | None = None) -> None:
    """Raise the error :func:`prepare_batch_norm` raises for these arguments, touching
    nothing."""
    check_x(x)
    c = x.shape[1]
    for t, name in ((bn_weight, "bn_weight"), (bn_bias, "bn_bias"),
                    (running_mean, "running_mean"), (running_var, "running_var")):
        _check_vector(t, name, c, x)
    if stats is not None:
        _check_stats(stats, x)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean, running_var: give both or neither")
    if momentum is None and training and running_mean is not None and num_batches_tracked is None:
        raise ValueError("num_batches_tracked: required when momentum is None (cumulative "
                         "moving average)")
    if momentum is not None and not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum: expected a float or None, got {type(momentum).__name__}")
    use_batch = training or running_mean is None
    count = x.numel() // c if c else 0
    if use_batch and count == 1:
        raise ValueError("x: expected more than 1 value per channel when training, got input "
                         f"size {tuple(x.shape)}")


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
    :func:`conv2d_from_prepared`.
    """
    check_batch_norm_args(x, bn_weight, bn_bias, running_mean, running_var,
                          num_batches_tracked, training=training, momentum=momentum,
                          stats=stats)
    c = x.shape[1]
    use_batch = training or running_mean is None
    count = x.numel() // c if c else 0

    if _backend.get_backend() == "reference":
        a = reference.batch_norm_relu(x, bn_weight, bn_bias, running_mean, running_var,
                                      num_batches_tracked, training=training,
                                      momentum=momentum, eps=eps)
        return BatchNormState(x, bn_weight, bn_bias, None, None, use_batch, a)

    sdt = stats_dtype(x.dtype)
    if use_batch and count == 0:
        # An empty batch, as nn.BatchNorm2d: counted, running statistics unchanged, empty output.
        if training and num_batches_tracked is not None:
            with torch.no_grad():
                num_batches_tracked.add_(1)
        mean, var = x.new_zeros((c,), dtype=sdt), x.new_ones((c,), dtype=sdt)
    else:
        r = route(x)
        if r.prepare_batch_norm is not None and (
                r.prepares is None or r.prepares(x, running_mean, running_var, training)):
            # The rule below in the backend's own call (C++, or two launches): ~10 ops fewer.
            given = stats if stats is not None and use_batch else (None, None)
            bn_weight, bn_bias = _cast(bn_weight, sdt), _cast(bn_bias, sdt)
            affine = None
            if r.prepare_affine is not None:  # and the affine, in the same launch
                mean, invstd, *affine = r.prepare_affine(
                    x, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                    training, momentum, eps, *given)
            else:
                mean, invstd = r.prepare_batch_norm(
                    x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                    *given)
            if given[0] is not None:  # the caller's tensor (an op returns a copy)
                mean = given[0]
            return BatchNormState(x, bn_weight, bn_bias, mean, invstd, use_batch, None, affine)
        if use_batch:
            mean, var = stats if stats is not None else _batch_stats(x.detach())
            if training and running_mean is not None:
                _update_running_stats(running_mean, running_var, num_batches_tracked, mean, var,
                                      momentum, count)
        else:
            mean, var = running_mean.detach().to(sdt), running_var.detach().to(sdt)
    invstd = torch.rsqrt(var + eps)
    return BatchNormState(x, _cast(bn_weight, sdt), _cast(bn_bias, sdt), mean, invstd, use_batch)


def _cast(p: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return p if p is None or p.dtype == dtype else p.to(dtype)


@torch.no_grad()
def _update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, momentum,
                          count):
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if momentum is None:  # cumulative average; a tensor factor keeps torch.compile graphs whole
        factor = 1.0 / num_batches_tracked.to(running_mean.dtype)
    else:
        factor = momentum
    unbiased = var * (count / (count - 1))
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype) * factor)
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype) * factor)


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

    dt = _autocast_dtype(x, weight)
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
    if (pair is not None and _autocast_dtype(x, weight) is None
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
    if with_shortcut is not None and _autocast_dtype(x, weight) is None:
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


def _resolve_padding(padding, kernel: tuple[int, int], stride, dilation) -> tuple[int, int]:
    """``nn.Conv2d``'s padding: ints, or ``'valid'`` / ``'same'`` (symmetric cases)."""
    if not isinstance(padding, str):
        return _pair(padding, "padding", minimum=0)
    if padding == "valid":
        return (0, 0)
    if padding != "same":
        raise ValueError(f"padding: expected an int, a pair of ints, 'valid' or 'same', "
                         f"got {padding!r}")
    if stride != (1, 1):
        raise ValueError(f"padding: 'same' needs stride 1 (as nn.Conv2d), got stride {stride}")
    total = tuple(d * (k - 1) for d, k in zip(dilation, kernel))
    if any(t % 2 for t in total):
        raise ValueError(f"padding: 'same' for a {kernel[0]}x{kernel[1]} kernel with dilation "
                         f"{dilation} pads unevenly, which the fused op does not support; give "
                         "explicit padding")
    return (total[0] // 2, total[1] // 2)


def _check_conv(x, weight, bias, residual, stride, padding, dilation) -> tuple[int, int]:
    """Check the convolution's arguments; returns the padding as a pair of ints."""
    c = x.shape[1]
    if not isinstance(weight, Tensor) or weight.dim() != 4:
        raise ValueError("weight: expected a 4-D (out_channels, in_channels, kh, kw) tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else weight!r}")
    if weight.shape[1] != c:
        grouped = weight.shape[1] and c % weight.shape[1] == 0
        raise ValueError(
            f"weight: expected shape (out_channels, {c}, kh, kw) to match the {c} channels of x, "
            f"got {tuple(weight.shape)}" + (" (grouped convolution is not supported; groups=1)"
                                            if grouped else ""))
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device} (the device of x), "
                         f"got {weight.device}")
    if weight.dtype not in _FLOAT:
        raise TypeError(f"weight: expected a floating-point tensor, got {weight.dtype}")
    autocast = _autocast_dtype(x, weight) is not None
    if not autocast and weight.dtype != x.dtype:
        raise TypeError(f"weight: expected dtype {x.dtype} (the dtype of x), got {weight.dtype}")
    co, _, kh, kw = weight.shape
    padding = _resolve_padding(padding, (kh, kw), stride, dilation)
    if bias is not None:
        if bias.shape != (co,):
            raise ValueError(f"bias: expected shape ({co},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias: expected device {x.device}, got {bias.device}")
        if not autocast and bias.dtype != weight.dtype:
            raise TypeError(f"bias: expected dtype {weight.dtype} (the dtype of weight), "
                            f"got {bias.dtype}")
    shape = out_shape(x, weight, stride, padding, dilation)
    if shape[2] <= 0 or shape[3] <= 0:
        raise ValueError(
            f"x: spatial size {tuple(x.shape[2:])} is too small for a {kh}x{kw} kernel with "
            f"padding {padding} and dilation {dilation}")
    if residual is not None:
        if not isinstance(residual, Tensor) or tuple(residual.shape) != shape:
            got = tuple(residual.shape) if isinstance(residual, Tensor) else residual
            raise ValueError(f"residual: expected shape {shape} (the conv output), got {got}")
        if residual.device != x.device:
            raise ValueError(f"residual: expected device {x.device}, got {residual.device}")
        if residual.dtype not in _FLOAT:
            raise TypeError(f"residual: expected a floating-point tensor, got {residual.dtype}")
    return padding


def check_conv_args(x, weight, bias=None, residual=None, stride=1, padding=0,
                    dilation=1, *, branch_scale=None) -> ConvGeometry:
    """Raise the error :func:`conv2d_from_prepared` would raise, without computing anything.
    Callers run it before :func:`prepare_batch_norm` so that bad arguments leave state alone.
    Returns the :class:`ConvGeometry` (stride, padding, dilation as pairs of ints), which
    ``conv2d_from_prepared(..., geometry=)`` takes to skip checking again (the branch scale
    alone is checked again there, a few attribute reads)."""
    check_x(x)
    check_branch_scale(branch_scale, x)
    stride = _pair(stride, "stride", minimum=1)
    dilation = _pair(dilation, "dilation", minimum=1)
    padding = _check_conv(x, weight, bias, residual, stride, padding, dilation)
    return ConvGeometry(stride, padding, dilation)


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
    state = prepare_batch_norm(x, bn_weight, bn_bias, running_mean, running_var,
                               num_batches_tracked, training=training, momentum=momentum,
                               eps=eps)
    return conv2d_from_prepared(state, weight, bias, residual=residual, geometry=geometry,
                                branch_scale=branch_scale)
