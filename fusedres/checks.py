"""The fused functions' argument checks: each raises the error ``fusedres.functional`` raises
for a bad argument, naming it and what was expected, and touches nothing. Callers run them
before any state (running statistics) changes; the backends' one-call routes run them once per
arguments' metadata (fusedres.backends.triton.module_unit).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .opdefs import ConvGeometry, out_shape, stats_dtype

__all__ = ["autocast_dtype", "check_batch_norm_args", "check_branch_scale", "check_conv_args",
           "check_x"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def autocast_dtype(x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype autocast runs this conv in, or None when it leaves it alone (autocast off, or
    float64 operands, which autocast never casts)."""
    device_type = x.device.type
    # cpu and cuda always have autocast; asking only for other devices keeps the call out of
    # traced code (torch 2.11's Dynamo cannot trace torch._C._is_autocast_available).
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
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
    autocast = autocast_dtype(x, weight) is not None
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
