"""The Triton backend: kernels/ (importable as ``fusedres.kernels``).

Each backend entry point goes through an op of the ``fusedres_triton`` namespace defined with
``torch.library.triton_op``, whose body launches the kernels through ``wrap_triton``: called from
a torch.compile'd graph on a GPU, Inductor sees the Triton kernels themselves. Under
``TRITON_INTERPRET=1`` (CPU tensors) the same ops run eagerly; they cannot be traced with fake
tensors there, so torch.compile is tested through the other backends' ops.
"""

import os
from typing import Optional

import torch
from torch import Tensor

from ..ops import (
    backward_empty_outputs,
    conv_out_size,
    out_memory_format,
    stats_dtype,
    unit_backward,
    unit_setup_context,
)
from . import portable

_KERNELS_ERROR: Optional[str] = None
try:
    from ..kernels import bn_relu_conv2d_dgrad as _dgrad
    from ..kernels import bn_relu_conv2d_wgrad as _wgrad
    from ..kernels._common import fits_int32 as _fits_int32
    from ..kernels.batch_stats import batch_stats as _batch_stats
    from ..kernels.bn_relu_conv2d import bn_relu_conv2d_fwd as _fwd
except ImportError as exc:  # triton missing, or a kernels/ install problem
    _KERNELS_ERROR = f"{type(exc).__name__}: {exc}"


def unavailable_reason(device: torch.device) -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if _KERNELS_ERROR is not None:
        return f"the Triton kernels failed to import ({_KERNELS_ERROR})"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu":
        return None if interpret else "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"it runs on CUDA tensors, not {device.type}"
    if not interpret and not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _scale_shift(bn_weight, bn_bias, mean, invstd) -> tuple[Tensor, Tensor]:
    scale = invstd if bn_weight is None else bn_weight * invstd
    shift = -mean * scale if bn_bias is None else bn_bias - mean * scale
    return scale.contiguous(), shift.contiguous()


# --------------------------------------------------------------------------- triton ops

@torch.library.triton_op("fusedres_triton::batch_stats", mutates_args=())
def batch_stats_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _batch_stats(x)


@torch.library.triton_op("fusedres_triton::bn_relu_conv2d", mutates_args=())
def forward_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Tensor, shift: Tensor,
               residual: Optional[Tensor], stride: list[int], padding: list[int],
               dilation: list[int], channels_last: bool) -> Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return _fwd(x, weight, bias, scale, shift, residual, stride, padding, dilation, fmt)


@torch.library.triton_op("fusedres_triton::bn_relu_conv2d_genstats", mutates_args=())
def forward_genstats_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Tensor,
                        shift: Tensor, residual: Optional[Tensor], stride: list[int],
                        padding: list[int], dilation: list[int],
                        channels_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Forward that also returns (mean, biased var) of y per output channel."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return _fwd(x, weight, bias, scale, shift, residual, stride, padding, dilation, fmt,
                genstats=True)


@torch.library.triton_op("fusedres_triton::bn_relu_conv2d_backward", mutates_args=())
def backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, bn_weight: Optional[Tensor],
                bn_bias: Optional[Tensor], mean: Tensor, invstd: Tensor, stride: list[int],
                padding: list[int], dilation: list[int], batch_stats: bool,
                output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    want_x, want_w, want_b, want_g, want_beta = output_mask
    outs = list(backward_empty_outputs(x, weight, mean, output_mask))
    scale, shift = _scale_shift(bn_weight, bn_bias, mean, invstd)
    grad_out = grad_out.to(weight.dtype)
    mean, invstd = mean.contiguous(), invstd.contiguous()
    need_sums = want_g or want_beta or (want_x and batch_stats)
    if backward_strategy(grad_out, x, weight, stride) == "store":
        return _backward_store(grad_out, x, weight, scale, shift, mean, invstd, stride, padding,
                               dilation, batch_stats, output_mask, outs, need_sums)
    sums = None
    if want_w or want_b or need_sums:
        # One pass over dy and x: weight and bias gradients, and the BatchNorm backward sums.
        affine = None
        if need_sums:
            affine = (bn_weight if bn_weight is not None else torch.ones_like(mean),
                      bn_bias if bn_bias is not None else torch.zeros_like(mean))
        _, gb, sums = _wgrad.bn_relu_conv2d_wgrad(
            grad_out, x, weight, scale, shift, stride, padding, dilation, want_weight=want_w,
            want_bias=want_b, bn_affine=affine, mean=mean, invstd=invstd,
            out=outs[1] if want_w else None)
        if want_b:
            outs[2].copy_(gb)
        if sums is not None:
            if want_g:
                outs[3].copy_(sums[1])
            if want_beta:
                outs[4].copy_(sums[0])
    if want_x:
        # Second pass: dx written directly (the sums are known).
        _dgrad.bn_relu_conv2d_dgrad(
            grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
            batch_stats=batch_stats, grad_x=outs[0], want_sums=False, sums=sums)
    return tuple(outs)


def backward_strategy(grad_out=None, x=None, weight=None, stride=(1, 1)) -> str:
    """``FUSEDRES_TRITON_BACKWARD``: "sums" (default: the weight-gradient pass also yields the
    BatchNorm sums, then one pass writes dx; two passes over dy and x, one more GEMM), "store"
    (one GEMM each; the data-gradient epilogue reduces the sums and stores dz, then an
    elementwise pass writes dx: ~3 more activation passes, one GEMM fewer), or "auto" (the one
    with the lower modeled H100 time, kernels/traffic.py: "store" where wide channels make the
    GEMMs compute-bound)."""
    value = os.environ.get("FUSEDRES_TRITON_BACKWARD", "sums")
    if value not in ("sums", "store", "auto"):
        raise ValueError(f"FUSEDRES_TRITON_BACKWARD: expected sums, store or auto, got {value!r}")
    if value != "auto" or x is None:
        return "sums" if value == "auto" else value
    from ..kernels import traffic

    n, c, h, w = x.shape
    co, _, kh, kw = weight.shape
    elem = weight.element_size()
    unit = traffic.Unit("auto", n, c, max(1, round((h * w) ** 0.5)), co,
                        k=max(1, round((kh * kw) ** 0.5)), stride=stride[0],
                        elem=elem if elem in (2, 4, 8) else 4)
    times = {s: traffic.fused_step(unit, strategy=s).seconds(unit.elem)
             for s in ("sums", "store")}
    return min(times, key=times.get)


def _backward_store(grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
                    batch_stats, output_mask, outs, need_sums):
    want_x, want_w, want_b, want_g, want_beta = output_mask
    if want_w or want_b:
        _, gb, _ = _wgrad.bn_relu_conv2d_wgrad(
            grad_out, x, weight, scale, shift, stride, padding, dilation, want_weight=want_w,
            want_bias=want_b, out=outs[1] if want_w else None)
        if want_b:
            outs[2].copy_(gb)
    if want_x or need_sums:
        sum_dz, sum_dzx = _dgrad.bn_relu_conv2d_dgrad(
            grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
            batch_stats=batch_stats, grad_x=outs[0] if want_x else None,
            want_sums=want_g or want_beta, strategy="store")
        if want_g:
            outs[3].copy_(sum_dzx)
        if want_beta:
            outs[4].copy_(sum_dz)
    return tuple(outs)


# --------------------------------------------------------------------------- backend interface

def _portable_case(*tensors) -> bool:
    """Empty tensors, or offsets past int32 (the kernels' index type): the portable code runs
    those (torch's own kernels, same algorithm)."""
    return any(t is not None and t.numel() == 0 for t in tensors) or not _fits_int32(*tensors)


def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    if _portable_case(x):
        return portable.batch_stats(x)
    return torch.ops.fusedres_triton.batch_stats(x)


def _forward_portable_case(x, weight, residual, stride, padding, dilation) -> bool:
    n, _, h, w = x.shape
    out = (n, weight.shape[0], conv_out_size(h, weight.shape[2], stride[0], padding[0],
                                             dilation[0]),
           conv_out_size(w, weight.shape[3], stride[1], padding[1], dilation[1]))
    return _portable_case(x, weight, residual) or not _fits_int32(torch.empty(out, device="meta"))


def _forward_args(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                  dilation):
    scale, shift = _scale_shift(bn_weight, bn_bias, mean, invstd)
    channels_last = out_memory_format(x, weight) == torch.channels_last
    if residual is not None and residual.dtype != weight.dtype:
        residual = residual.to(weight.dtype)
    return (x, weight, bias, scale, shift, residual, list(stride), list(padding), list(dilation),
            channels_last)


def forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation) -> Tensor:
    args = (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation)
    if _forward_portable_case(x, weight, residual, stride, padding, dilation):
        return portable.forward(*args)
    return torch.ops.fusedres_triton.bn_relu_conv2d(*_forward_args(*args))


def forward_genstats(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                     padding, dilation) -> tuple[Tensor, Tensor, Tensor]:
    """``forward`` plus the (mean, biased var) of its output per channel, in the statistics
    dtype of y: what the next unit's BatchNorm needs, without a pass over y."""
    args = (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation)
    if _forward_portable_case(x, weight, residual, stride, padding, dilation):
        y = portable.forward(*args)
        return (y, *portable.batch_stats(y))
    y, m, v = torch.ops.fusedres_triton.bn_relu_conv2d_genstats(*_forward_args(*args))
    return y, m.to(stats_dtype(y.dtype)), v.to(stats_dtype(y.dtype))


class CompiledUnit(torch.autograd.Function):
    """The fused unit over the ``fusedres_triton`` ops, for graphs that torch.compile traces on a
    GPU (:func:`fusedres.functional` routes there): the public ``fusedres`` ops are opaque to
    Inductor, these triton_ops decompose into their Triton kernels, forward and backward.
    Same arguments, outputs and autograd rule as ``fusedres::bn_relu_conv2d`` (with
    ``genstats``: ``fusedres::bn_relu_conv2d_genstats``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                dilation, batch_stats, genstats):
        inputs = (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                  dilation)
        unit_setup_context(ctx, (*inputs, batch_stats), None)
        args = _forward_args(*inputs)
        if not genstats:
            return torch.ops.fusedres_triton.bn_relu_conv2d(*args)
        y, m, v = torch.ops.fusedres_triton.bn_relu_conv2d_genstats(*args)
        m, v = m.to(stats_dtype(y.dtype)), v.to(stats_dtype(y.dtype))
        ctx.mark_non_differentiable(m, v)
        return y, m, v

    @staticmethod
    def backward(ctx, grad_out, *_stats_grads):
        grads = unit_backward(ctx, grad_out, torch.ops.fusedres_triton.bn_relu_conv2d_backward)
        return (*grads, None)  # genstats takes no gradient


def compiled_unit(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                  dilation, batch_stats, genstats: bool):
    """:class:`CompiledUnit`, or the public op for the cases the kernels leave to the portable
    code (empty tensors, int32 overflow)."""
    args = (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation, batch_stats)
    if _forward_portable_case(x, weight, residual, stride, padding, dilation):
        op = (torch.ops.fusedres.bn_relu_conv2d_genstats if genstats
              else torch.ops.fusedres.bn_relu_conv2d)
        return op(*args)
    return CompiledUnit.apply(*args, genstats)


def compiled_batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """``batch_stats`` through the triton_op, for traced graphs (see :class:`CompiledUnit`)."""
    if _portable_case(x):
        return tuple(torch.ops.fusedres.batch_stats(x))
    return tuple(torch.ops.fusedres_triton.batch_stats(x))


def backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
             batch_stats, output_mask):
    if _portable_case(grad_out, x, weight):
        return portable.backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride,
                                 padding, dilation, batch_stats, output_mask)
    return torch.ops.fusedres_triton.bn_relu_conv2d_backward(
        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, list(stride), list(padding),
        list(dilation), batch_stats, list(output_mask))
