"""Argument checks, each raising an error that names the argument and what was expected,
touching nothing.

Two layers:

* The fused functions' (``fusedres.functional``): :func:`check_batch_norm_args`,
  :func:`check_conv_args` and the pieces they share. Callers run them before any state
  (running statistics) changes; the backends' one-call routes run them once per arguments'
  metadata (fusedres.backends.triton.module_unit).
* The ops' contract (:func:`check_op_args`): every argument of a call of an op of
  :data:`fusedres.ops.opdefs.SCHEMAS`, for the ops registered in Python (``fusedres::``,
  ``fusedres_triton::``). It is csrc/checks.h's contract, which the C++ namespaces
  (``fusedres_cpu::``, ``fusedres_cuda::``) run, in the same words: stricter than the functions'
  (the BatchNorm vectors, bias and residual in the dtypes the functions cast them to), since the
  kernels read what they are given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .opdefs import BatchNormArgs, ConvGeometry, arg_names, out_shape, stats_dtype

__all__ = ["autocast_dtype", "check_batch_norm_args", "check_branch_scale", "check_conv_args",
           "check_devices", "check_op_args", "check_x"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)

# The kernels index a padded row or column (H + 2 * padding) and a dilated kernel's extent
# (dilation * (k - 1) + 1) in 32-bit integers (csrc/cuda's ConvGeom, kernels/): each, and every
# geometry value, is below 2^31 (csrc/checks.h's kIndexLimit).
INDEX_LIMIT = 2**31


def _pair(value, name: str, *, minimum: int) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value) if isinstance(
        value, (tuple, list, torch.Size)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ValueError(f"{name}: expected an int or a pair of ints, got {value!r}")
    if not all(minimum <= v < INDEX_LIMIT for v in pair):
        raise ValueError(f"{name}: expected values in [{minimum}, 2^31), got {value!r}")
    return pair


def _check_extents(x: Tensor, kernel: tuple[int, int], padding, dilation, *,
                   where: str = "", names=("padding", "dilation")) -> None:
    """The padded input and the dilated kernel within the kernels' 32-bit indexing."""
    for i, side in enumerate(("height", "width")):
        size = x.shape[2 + i]
        if size + 2 * padding[i] >= INDEX_LIMIT:
            raise ValueError(f"{where}{names[0]}: x's {side} {size} padded by {padding[i]} on "
                             "both sides reaches 2^31 (the kernels index it in 32 bits)")
        if dilation[i] * (kernel[i] - 1) + 1 >= INDEX_LIMIT:
            raise ValueError(f"{where}{names[1]}: a kernel of {kernel[i]} taps dilated by "
                             f"{dilation[i]} spans 2^31 or more (the kernels index it in 32 "
                             "bits)")


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


def _overlaps_itself(t: Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a stride-0 expanded vector): an in-place
    update of one would overwrite another. ATen's test (at::has_internal_overlap's "yes": a
    dimension of more than one element and stride 0), on sizes and strides alone, which a
    traced graph sees too."""
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _share_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: one storage, element spans that meet
    (csrc/checks.h's may_share_memory, which is exact for dense tensors as this is). False
    while torch.compile traces: a traced tensor has no storage to compare."""
    if torch.compiler.is_compiling():
        return False
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False  # meta tensors (fusedres.memory.planner's simulated step) have no memory
    ptr = a.untyped_storage().data_ptr()
    if ptr == 0 or ptr != b.untyped_storage().data_ptr():
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.storage_offset(), last + 1

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_writable(t: Tensor, name: str, where: str) -> None:
    """A buffer the update writes in place: not an inference tensor outside inference mode
    (csrc/checks.h's check_writable). The in-place op would refuse it itself, but only once the
    buffers updated before it were written. Not while torch.compile traces: a traced graph
    holds no inference tensor (torch.compile refuses them as inputs)."""
    if torch.compiler.is_compiling():
        return
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{where}{name}: an inference tensor cannot be updated in place "
                           "outside InferenceMode")


def check_running_stats(x: Tensor, bn: BatchNormArgs, where: str = "") -> None:
    """The running statistics and hyperparameters of ``bn``, a BatchNorm of ``x`` (csrc/checks.h's
    check_running_stats): a one-element integer ``num_batches_tracked`` on x's device, buffers
    the update writes writable (no inference tensor outside inference mode) and apart, and
    nn.BatchNorm2d's refusals: ``eps`` > 0 in
    training (>= 0 in eval), no running statistic that requires grad while grad mode is on.
    The vectors' shapes, dtypes and devices are the caller's to check first."""
    nbt, training, momentum, eps = bn.num_batches_tracked, bn.training, bn.momentum, bn.eps
    stats = (bn.running_mean, "running_mean"), (bn.running_var, "running_var")
    tracked = bn.running_mean is not None
    if (bn.running_mean is None) != (bn.running_var is None):
        raise ValueError(f"{where}running_mean, running_var: give both or neither")
    if tracked and torch.is_grad_enabled():
        for t, name in stats:
            if t.requires_grad:
                raise ValueError(f"{where}{name}: expected a buffer that does not require grad "
                                 "(nn.BatchNorm2d refuses one that does while grad mode is on)")
    if nbt is not None:
        if not isinstance(nbt, Tensor):
            raise TypeError(f"{where}num_batches_tracked: expected a Tensor or None, got "
                            f"{type(nbt).__name__}")
        if nbt.device != x.device:
            raise ValueError(f"{where}num_batches_tracked: expected device {x.device} (the "
                             f"device of x), got {nbt.device}")
        if nbt.numel() != 1:
            raise ValueError(f"{where}num_batches_tracked: expected one element, got shape "
                             f"{tuple(nbt.shape)}")
        if nbt.dtype.is_floating_point or nbt.dtype.is_complex or nbt.dtype == torch.bool:
            raise TypeError(f"{where}num_batches_tracked: expected an integer tensor (a count), "
                            f"got {nbt.dtype}")
    if training and tracked:
        if momentum is None and nbt is None:
            raise ValueError(f"{where}num_batches_tracked: required when momentum is None "
                             "(cumulative moving average)")
        for t, name in stats:
            _check_writable(t, name, where)
            if _overlaps_itself(t):
                raise ValueError(f"{where}{name}: expected a tensor whose elements do not share "
                                 f"memory (it is updated in place), got strides {t.stride()}")
        if _share_memory(bn.running_mean, bn.running_var):
            raise ValueError(f"{where}running_var: expected memory of its own, got a tensor "
                             "that overlaps running_mean")
    if training and nbt is not None:  # counted in training, tracked or not
        _check_writable(nbt, "num_batches_tracked", where)
    if momentum is not None and not isinstance(momentum, (int, float)):
        raise TypeError(f"{where}momentum: expected a float or None, got "
                        f"{type(momentum).__name__}")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"{where}eps: expected a float, got {type(eps).__name__}")
    if not (eps > 0 if training else eps >= 0):
        raise ValueError(f"{where}eps: expected a value {'> 0 in training' if training else '>= 0'}"
                         f" (as nn.BatchNorm2d), got {eps}")


def check_batch_norm_args(x: Tensor, bn: BatchNormArgs,
                          stats: tuple[Tensor, Tensor] | None = None) -> None:
    """Raise the error :func:`fusedres.functional.prepare_batch_norm` raises for ``x`` and the
    BatchNorm ``bn`` (and the batch statistics ``stats`` given), touching nothing. The errors
    name the functional API's arguments (``bn_weight``, ``running_mean``...)."""
    check_x(x)
    c = x.shape[1]
    for t, name in ((bn.weight, "bn_weight"), (bn.bias, "bn_bias"),
                    (bn.running_mean, "running_mean"), (bn.running_var, "running_var")):
        _check_vector(t, name, c, x)
    if stats is not None:
        _check_stats(stats, x)
    check_running_stats(x, bn)
    use_batch = bn.training or bn.running_mean is None
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
    if kh < 1 or kw < 1:
        raise ValueError(f"weight: expected a kernel of at least 1x1, got {tuple(weight.shape)}")
    if co < 1:
        raise ValueError(f"weight: expected at least one output channel (as conv2d), got "
                         f"{tuple(weight.shape)}")
    _check_extents(x, (kh, kw), padding, dilation)
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


# --------------------------------------------------------------------------- the ops' contract
# csrc/checks.h in Python, in its words ("<op>: <argument>: expected ..., got ..."): for the ops
# registered in Python (fusedres::, fusedres_triton::), which run it first (check_op_args).

def _op_tensor(where: str, name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}{name}: expected a Tensor, got {type(t).__name__}")


def _op_device(where: str, name: str, t: Tensor, x: Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{where}{name}: expected device {x.device} (the device of x), "
                         f"got {t.device}")


def _op_dtype(where: str, name: str, t: Tensor, dtype: torch.dtype | None) -> None:
    if dtype is None:
        if t.dtype not in _FLOAT:
            raise TypeError(f"{where}{name}: expected a floating-point tensor, got {t.dtype}")
    elif t.dtype != dtype:
        raise TypeError(f"{where}{name}: expected dtype {dtype}, got {t.dtype}")


def _op_shaped(where: str, name: str, t, x: Tensor, shape: tuple, what: str,
               dtype: torch.dtype | None) -> None:
    """A tensor of exactly ``shape`` on x's device, of ``dtype`` (None: any float dtype)."""
    _op_tensor(where, name, t)
    _op_device(where, name, t, x)
    if tuple(t.shape) != tuple(shape):
        shown = f"({shape[0]},)" if len(shape) == 1 else str(tuple(shape))
        raise ValueError(f"{where}{name}: expected shape {shown} ({what}), got "
                         f"{tuple(t.shape)}")
    _op_dtype(where, name, t, dtype)


def _op_x(where: str, x, name: str = "x") -> None:
    _op_tensor(where, name, x)
    if x.dim() != 4:
        raise ValueError(f"{where}{name}: expected a 4-D (N, C, H, W) tensor, got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{where}{name}: expected float16, bfloat16, float32 or float64, got "
                        f"{x.dtype}")


def _op_pair(where: str, name: str, value, minimum: int) -> tuple[int, int]:
    """A geometry list (the schema's SymInt[2]): two ints, each in [minimum, 2^31)."""
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) != 2:
        got = f"{len(value)} values" if isinstance(value, (tuple, list)) else repr(value)
        raise ValueError(f"{where}{name}: expected a list of 2 ints, got {got}")
    pair = tuple(value)
    if not all(isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"{where}{name}: expected a list of 2 ints, got {value!r}")
    if not all(minimum <= v < INDEX_LIMIT for v in pair):
        raise ValueError(f"{where}{name}: expected values in [{minimum}, 2^31), got "
                         f"[{pair[0]}, {pair[1]}]")
    return pair


def _op_conv(where: str, x: Tensor, weight, stride, padding, dilation,
             names=("weight", "stride", "padding", "dilation")) -> tuple[int, ...]:
    """The weight against x, the geometry; returns the output's shape (N, Co, Ho, Wo)."""
    w_name, s_name, p_name, d_name = names
    _op_tensor(where, w_name, weight)
    _op_device(where, w_name, weight, x)
    c = x.shape[1]
    if weight.dim() != 4 or weight.shape[1] != c:
        raise ValueError(f"{where}{w_name}: expected shape (out_channels, {c}, kh, kw) to match "
                         f"the {c} channels of x, got {tuple(weight.shape)}")
    kh, kw = weight.shape[2], weight.shape[3]
    if kh < 1 or kw < 1:
        raise ValueError(f"{where}{w_name}: expected a kernel of at least 1x1, got "
                         f"{tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"{where}{w_name}: expected at least one output channel (as conv2d), "
                         f"got {tuple(weight.shape)}")
    geometry = ConvGeometry(_op_pair(where, s_name, stride, 1),
                            _op_pair(where, p_name, padding, 0),
                            _op_pair(where, d_name, dilation, 1))
    _check_extents(x, (kh, kw), geometry.padding, geometry.dilation, where=where,
                   names=(p_name, d_name))
    ho, wo = geometry.out_hw(x.shape[2], x.shape[3], kh, kw)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"{where}x: spatial size {tuple(x.shape[2:])} is too small for a "
                         f"{kh}x{kw} kernel with padding {geometry.padding} and dilation "
                         f"{geometry.dilation}")
    return (x.shape[0], weight.shape[0], ho, wo)


def _op_weight_dtype(where: str, name: str, weight: Tensor, x: Tensor) -> None:
    xt, wt = x.dtype, weight.dtype
    if not (wt in _FLOAT and (wt == xt or (xt == torch.float32 and wt in _HALF)
                              or (xt in _HALF and wt == torch.float32))):
        raise TypeError(f"{where}{name}: expected dtype {xt} (x's; or float32 with a 16-bit "
                        f"float either way), got {wt}")


def _op_bn(where: str, a, x: Tensor) -> None:
    """bn_weight, bn_bias (when given), mean and invstd: (C,) in the statistics dtype."""
    c, sdt = x.shape[1], stats_dtype(x.dtype)
    for name in ("bn_weight", "bn_bias", "mean", "invstd"):
        t = a[name]
        if t is not None or name in ("mean", "invstd"):
            _op_shaped(where, name, t, x, (c,), "one value per channel of x", sdt)


def _op_bias(where: str, name: str, bias, x: Tensor, weight: Tensor) -> None:
    if bias is not None:
        _op_shaped(where, name, bias, x, (weight.shape[0],), "one value per output channel",
                   weight.dtype)


def _op_branch_scale(where: str, branch_scale, x: Tensor) -> None:
    if branch_scale is not None:
        _op_shaped(where, "branch_scale", branch_scale, x, (x.shape[0],),
                   "one factor per sample of x", None)


def _op_output_mask(where: str, mask) -> None:
    if (not isinstance(mask, (tuple, list)) or len(mask) != 5
            or not all(isinstance(m, bool) for m in mask)):
        raise ValueError(f"{where}output_mask: expected a list of 5 bools (x, weight, bias, "
                         f"bn_weight, bn_bias), got {mask!r}")


def check_devices(where: str, names, args, kwargs=None) -> None:
    """Refuse a call of a C++ namespace's op that the dispatcher sent to the ``Meta`` key (a
    meta tensor among its arguments; :func:`fusedres.ops._extension.refuse_meta`), before any
    kernel could read memory that is not there: an ``x`` on meta is not one the kernels run
    on; else the first tensor argument (``names``: the op's argument names, ``args`` and
    ``kwargs`` as called) on another device than x's, in the ops' words."""
    bound = dict(zip(names, args))
    bound.update(kwargs or {})
    x = bound.get("x")
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: x: expected a Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(f"{where}: x: expected a tensor on a device the op's kernels run on, "
                         f"got device {x.device}")
    for name, t in bound.items():
        if isinstance(t, Tensor) and t.device != x.device:
            raise ValueError(f"{where}: {name}: expected device {x.device} (the device of x), "
                             f"got {t.device}")
    raise ValueError(f"{where}: expected every tensor on the device of x ({x.device})")


def check_op_args(op: str, args, where: str | None = None,
                  device_types: tuple[str, ...] | None = None) -> None:
    """Raise the error csrc/checks.h raises for a call of ``op`` (a key of
    :data:`fusedres.ops.opdefs.SCHEMAS`) with ``args`` (positional, in schema order), touching
    nothing: every argument, in the words of the C++ namespaces' ops. ``where``: the op's name
    in the messages (default ``fusedres::<op>``). ``device_types``: those x may be on (None:
    any; the public ops run on x's device, whichever it is)."""
    names = arg_names(op)
    a = dict.fromkeys(names)  # an argument left out: its default, None (opdefs._defaults)
    a.update(zip(names, args))
    where = f"{where or f'fusedres::{op}'}: "
    x = a["x"]
    _op_x(where, x)
    if device_types is not None and x.device.type not in device_types:
        raise ValueError(f"{where}x: expected a tensor on {' or '.join(device_types)}, got "
                         f"device {x.device}")
    if op == "batch_stats":
        return
    out = _op_conv(where, x, a["weight"], a["stride"], a["padding"], a["dilation"])
    weight = a["weight"]
    _op_weight_dtype(where, "weight", weight, x)
    if "bias" in a:
        _op_bias(where, "bias", a["bias"], x, weight)
    _op_bn(where, a, x)
    if op == "bn_relu_conv2d_backward":
        _op_shaped(where, "grad_out", a["grad_out"], x, out, "the convolution's output", None)
        _op_output_mask(where, a["output_mask"])
    elif a.get("residual") is not None:
        _op_shaped(where, "residual", a["residual"], x, out, "the convolution's output",
                   weight.dtype)
    _op_branch_scale(where, a["branch_scale"], x)
