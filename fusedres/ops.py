"""The ``fusedres`` operators: schemas, fake kernels and the autograd rule, in one place.

Three ops implement the unit of shared/design.md:

* ``fusedres::batch_stats(x) -> (mean, var)``: per-channel batch mean and biased variance over
  (N, H, W), in the statistics dtype (float32 for half inputs, else ``x.dtype``). Not
  differentiable: the fused backward accounts for the statistics' dependence on ``x``.
* ``fusedres::bn_relu_conv2d(...) -> y``: ``conv2d(relu(scale * x + shift), weight, bias) +
  residual`` with ``scale = bn_weight * invstd`` and ``shift = bn_bias - mean * scale``.
* ``fusedres::bn_relu_conv2d_genstats(...) -> (y, mean, var)``: the same ``y`` and, per output
  channel, its mean and biased variance over (N, H, W) in the statistics dtype: what the next
  BatchNorm needs. The Triton backend reduces them in the convolution's epilogue ("genstats"),
  saving the next statistics pass over ``y``; the others run ``batch_stats(y)``. The statistics
  are not differentiable (their consumer, a fused op with ``batch_stats=True``, accounts for
  them).
* ``fusedres::bn_relu_conv2d_backward(...)``: gradients of x, weight, bias, bn_weight, bn_bias,
  recomputing the activation from ``x``. With ``batch_stats=True`` the gradient of ``x`` includes
  the path through the batch statistics (training-mode BatchNorm).

Every op routes at run time to the backend in force (see :mod:`fusedres._backend`); a backend
module provides ``batch_stats``, ``forward`` and ``backward`` with these signatures. Eager units
on plain CPU tensors with the cpu backend in force skip the custom-op layers
(:class:`EagerCpuUnit`: the same kernels and autograd rule). The
autograd rule saves ``x``, the conv weight, the BN parameters and the per-channel statistics,
never the normalised or activated tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _backend

_HALF = (torch.float16, torch.bfloat16)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of BN statistics and of the normalisation arithmetic for inputs of ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


def conv_out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _suggests_channels_last(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def out_memory_format(x: Tensor, weight: Tensor) -> torch.memory_format:
    """Layout of the op's output: channels_last when ``x`` or ``weight`` is, as conv2d does.

    Every backend returns exactly this layout so that real and fake kernels agree on strides.
    """
    if _suggests_channels_last(x) or _suggests_channels_last(weight):
        return torch.channels_last
    return torch.contiguous_format


def _impl(x: Tensor):
    name = _backend.resolve_backend(x.device)
    # The reference backend never reaches the ops; called directly they run the portable code,
    # as does an empty batch on every backend (nothing for a kernel to do).
    if name == "reference" or x.numel() == 0:
        name = "portable"
    return _backend.backend_module(name)


# --------------------------------------------------------------------------- batch_stats

@torch.library.custom_op(
    "fusedres::batch_stats", mutates_args=(), schema="(Tensor x) -> (Tensor, Tensor)"
)
def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    return _impl(x).batch_stats(x)


@batch_stats.register_fake
def _(x):
    torch._check(x.dim() == 4, lambda: f"batch_stats: x must be 4-D, got {x.dim()}-D")
    c = x.shape[1]
    dt = stats_dtype(x.dtype)
    return x.new_empty((c,), dtype=dt), x.new_empty((c,), dtype=dt)


# --------------------------------------------------------------------------- forward

_FWD_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, Tensor mean, "
    "Tensor invstd, Tensor? residual, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, "
    "bool batch_stats) -> Tensor"
)


@torch.library.custom_op("fusedres::bn_relu_conv2d", mutates_args=(), schema=_FWD_SCHEMA)
def bn_relu_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    bn_weight: Tensor | None,
    bn_bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    residual: Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    batch_stats: bool,
) -> Tensor:
    return _impl(x).forward(
        x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation
    )


def out_shape(x: Tensor, weight: Tensor, stride, padding, dilation) -> tuple[int, ...]:
    n, _, h, w = x.shape
    co, _, kh, kw = weight.shape
    return (
        n,
        co,
        conv_out_size(h, kh, stride[0], padding[0], dilation[0]),
        conv_out_size(w, kw, stride[1], padding[1], dilation[1]),
    )


@bn_relu_conv2d.register_fake
def _forward_fake(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                  dilation, batch_stats):
    torch._check(x.dim() == 4 and weight.dim() == 4, lambda: "x and weight must be 4-D")
    torch._check(weight.shape[1] == x.shape[1], lambda: "weight.shape[1] must equal x.shape[1]")
    shape = out_shape(x, weight, stride, padding, dilation)
    y = x.new_empty(shape, dtype=weight.dtype)
    return y.contiguous(memory_format=out_memory_format(x, weight))


# --------------------------------------------------------------------------- genstats

_GENSTATS_SCHEMA = _FWD_SCHEMA.replace("-> Tensor", "-> (Tensor, Tensor, Tensor)")


@torch.library.custom_op(
    "fusedres::bn_relu_conv2d_genstats", mutates_args=(), schema=_GENSTATS_SCHEMA
)
def bn_relu_conv2d_genstats(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    bn_weight: Tensor | None,
    bn_bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    residual: Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    batch_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    backend = _impl(x)
    args = (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
            dilation)
    native = getattr(backend, "forward_genstats", None)
    if native is not None:
        return native(*args)
    y = backend.forward(*args)
    return (y, *_impl(y).batch_stats(y))


@bn_relu_conv2d_genstats.register_fake
def _(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation,
      batch_stats):
    y = _forward_fake(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                      padding, dilation, batch_stats)
    dt = stats_dtype(y.dtype)
    return y, y.new_empty((y.shape[1],), dtype=dt), y.new_empty((y.shape[1],), dtype=dt)


# --------------------------------------------------------------------------- backward

_BWD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, Tensor mean, "
    "Tensor invstd, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, bool batch_stats, "
    "bool[5] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op(
    "fusedres::bn_relu_conv2d_backward", mutates_args=(), schema=_BWD_SCHEMA
)
def bn_relu_conv2d_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bn_weight: Tensor | None,
    bn_bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    batch_stats: bool,
    output_mask: Sequence[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (grad_x, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias); an output whose
    ``output_mask`` entry is False is an empty tensor (0 elements)."""
    return _impl(x).backward(
        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
        batch_stats, output_mask,
    )


def backward_empty_outputs(x, weight, mean, output_mask):
    """Allocate backward outputs with the exact metadata every backend must return."""
    co = weight.shape[0]
    c = x.shape[1]
    want_x, want_w, want_b, want_g, want_beta = output_mask
    return (
        torch.empty_like(x) if want_x else x.new_empty((0,)),
        torch.empty_like(weight) if want_w else weight.new_empty((0,)),
        weight.new_empty((co,)) if want_b else weight.new_empty((0,)),
        mean.new_empty((c,)) if want_g else mean.new_empty((0,)),
        mean.new_empty((c,)) if want_beta else mean.new_empty((0,)),
    )


@bn_relu_conv2d_backward.register_fake
def _(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
      batch_stats, output_mask):
    return backward_empty_outputs(x, weight, mean, output_mask)


# --------------------------------------------------------------------------- autograd

def unit_setup_context(ctx, inputs, output):
    """What the autograd rule keeps: x, the conv weight, the BN parameters and statistics."""
    (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation,
     batch_stats) = inputs
    ctx.save_for_backward(x, weight, bn_weight, bn_bias, mean, invstd)
    ctx.conv_args = (stride, padding, dilation)
    ctx.batch_stats = batch_stats
    ctx.has_bias = bias is not None
    ctx.has_residual = residual is not None


def unit_backward(ctx, grad_out, backward_op) -> tuple[Tensor | None, ...]:
    """The autograd rule of the fused unit for a ``ctx`` filled by ``unit_setup_context``: the
    gradients of its 12 inputs, computed by ``backward_op`` (an op with the schema of
    ``fusedres::bn_relu_conv2d_backward``)."""
    x, weight, bn_weight, bn_bias, mean, invstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [
        need[0],
        need[1],
        need[2] and ctx.has_bias,
        need[3] and bn_weight is not None,
        need[4] and bn_bias is not None,
    ]
    grads: list[Tensor | None] = [None] * 5
    if any(mask):
        outs = backward_op(
            grad_out, x, weight, bn_weight, bn_bias, mean, invstd, *ctx.conv_args,
            ctx.batch_stats, mask,
        )
        grads = [g if m else None for g, m in zip(outs, mask)]
    # mean and invstd are functions of x when batch_stats is set; their contribution is folded
    # into grad_x, so they take no gradient of their own. The residual's gradient is grad_out.
    grad_residual = grad_out if ctx.has_residual and need[7] else None
    return (*grads, None, None, grad_residual, None, None, None, None)


def _backward(ctx, grad_out):
    return unit_backward(ctx, grad_out, torch.ops.fusedres.bn_relu_conv2d_backward)


bn_relu_conv2d.register_autograd(_backward, setup_context=unit_setup_context)


def _setup_context_genstats(ctx, inputs, output):
    unit_setup_context(ctx, inputs, output[0])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward_genstats(ctx, grad_out, grad_mean, grad_var):
    return _backward(ctx, grad_out)


bn_relu_conv2d_genstats.register_autograd(_backward_genstats,
                                          setup_context=_setup_context_genstats)


# --------------------------------------------------------------------------- eager cpu route

class EagerCpuUnit(torch.autograd.Function):
    """The fused unit on the cpu backend, for eager calls on plain CPU tensors: the same kernels
    (``torch.ops.fusedres_cpu``) and the same autograd rule as ``fusedres::bn_relu_conv2d``,
    without the custom-op layers in between (argument normalisation, the autograd wrapper's
    redispatch, the run-time backend routing), which cost ~0.15 ms a unit: a tenth of a small
    unit's work. :func:`eager_cpu` says when it may be used; everything else (torch.compile,
    fake and meta tensors, dispatch modes, torch.func) goes through the public ops."""

    @staticmethod
    def forward(ctx, *inputs):
        # The ctx-first form: with a separate setup_context, apply() binds the arguments with
        # inspect.signature on every call (~20 us).
        unit_setup_context(ctx, inputs, None)
        return torch.ops.fusedres_cpu.bn_relu_conv2d(*inputs[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        return unit_backward(ctx, grad_out, torch.ops.fusedres_cpu.bn_relu_conv2d_backward)


def eager_cpu(x: Tensor) -> bool:
    """True when a unit on ``x`` may take :class:`EagerCpuUnit`: a plain CPU tensor, eager mode
    (no tracing, no dispatch mode, no torch.func transform), a non-empty batch and the cpu
    backend in force (by name or by ``auto``)."""
    return (not torch.compiler.is_compiling()  # first: nothing below becomes a guard
            and type(x) is Tensor and x.is_cpu and x.numel() > 0
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and _backend.resolve_backend(x.device) == "cpu")
