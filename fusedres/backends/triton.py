"""The Triton backend: kernels/ (importable as ``fusedres.kernels``).

The backend's entry points (what the public ops route to) go through ops of the
``fusedres_triton`` namespace defined with ``torch.library.triton_op``: in a graph that
torch.compile traces on a GPU, their bodies' launches are recorded through ``wrap_triton``
(``kernels._common.launcher`` wraps only while tracing) and Inductor sees the Triton kernels
themselves. Eager code (fusedres.route) takes a shorter route to the same launches:
:class:`EagerTritonUnit` (an ``autograd.Function`` over them), :func:`prepare_affine` and
:func:`module_unit`; every launch through its plan (kernels/: config, grid and arguments fixed
per shapes, strides, dtypes and alignments; on a GPU, straight to the compiled launcher after
the JIT's first launch). Under ``TRITON_INTERPRET=1`` (CPU tensors) the ops run eagerly; they
cannot be traced with fake tensors there, so torch.compile is tested through the other
backends' ops.
"""

import functools
import math
import os
from typing import Optional

import torch
from torch import Tensor

from .. import settings
from ..checks import check_op_args
from ..opdefs import (
    SCHEMAS,
    BackwardArgs,
    UnitArgs,
    backward_outputs,
    out_shape,
    python_signature,
)
from ..ops import bare_gradients, direct_unit, unit_backward, unit_setup_context
from . import portable

_KERNELS_ERROR: Optional[str] = None
try:
    from ..kernels import bn_relu_conv2d_dgrad as _dgrad
    from ..kernels import bn_relu_conv2d_wgrad as _wgrad
    from ..kernels._common import fits_int32 as _fits_int32
    from ..kernels.batch_stats import batch_stats as _batch_stats
    from ..kernels.batch_stats import prepare_batch_norm as _prepare_batch_norm
    from ..kernels.batch_stats import prepare_plan as _prepare_plan
    from ..kernels.batch_stats import prepare_unsupported as _prepare_unsupported
    from ..kernels.bn_relu_conv2d import forward_plan as _fwd_plan
    from ..kernels.reductions import scale_shift as _scale_shift
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


def _branch_scale(branch_scale: Optional[Tensor], weight: Tensor) -> Optional[Tensor]:
    """The (N,) branch scale as the kernels read it: contiguous, in the accumulator dtype."""
    if branch_scale is None:
        return None
    return branch_scale.to(torch.float64 if weight.dtype == torch.float64
                           else torch.float32).contiguous()


# --------------------------------------------------------------------------- triton ops
# The schemas of fusedres.opdefs; the bodies launch the kernels through kernels._common.launcher
# (wrap_triton while a graph is traced, the kernel itself in eager code).

def _triton_op(op: str):
    """``torch.library.triton_op("fusedres_triton::<op>")`` with the schema of SCHEMAS. The
    function also carries that schema as its Python signature: torch 2.11 infers the schema
    from the signature whatever ``schema=`` says (and ``*inputs`` cannot be inferred)."""
    def register(fn):
        def checked(*args):  # every argument first: the ops' contract (fusedres.checks)
            check_op_args(op, args, f"fusedres_triton::{op}", ("cuda", "cpu"))
            return fn(*args)

        checked.__name__ = fn.__name__
        checked.__signature__ = python_signature(op)
        return torch.library.triton_op(f"fusedres_triton::{op}", mutates_args=(),
                                       schema=SCHEMAS[op])(checked)
    return register


@_triton_op("batch_stats")
def _batch_stats_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _batch_stats(x)


def _launch_forward(u: UnitArgs, genstats: bool, scale=None, shift=None):
    """The forward's launches (its plan cached per shapes, strides, dtypes and alignments);
    ``scale``, ``shift``: the BatchNorm's affine when the preparation made it (else one
    launch makes it here)."""
    if scale is None:
        scale, shift = _scale_shift(u)
    residual = u.residual
    if residual is not None and residual.dtype != u.weight.dtype:
        residual = residual.to(u.weight.dtype)
    bscale = u.branch_scale
    if bscale is not None:
        bscale = _branch_scale(bscale, u.weight)
    bias = u.bias  # the kernels read bias[co] at unit stride (a strided one read other values)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    plan = _fwd_plan(u.x, u.weight, bias, scale, shift, residual, u.stride, u.padding,
                     u.dilation, None, genstats, bscale)
    return plan.run(u.x, u.weight, scale, shift, bias, residual, bscale)


def _forward(*inputs) -> Tensor:
    return _launch_forward(UnitArgs(*inputs), genstats=False)


def _forward_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """Forward that also returns (mean, biased var) of y per output channel, reduced in the
    convolution's epilogue."""
    return _launch_forward(UnitArgs(*inputs), genstats=True)


def _backward(*inputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b = BackwardArgs(*inputs)
    return _backward_with(b, *_scale_shift(b))


def _backward_with(b: BackwardArgs, scale: Tensor, shift: Tensor, strategy: str | None = None):
    """The backward's launches for ``b`` given the BatchNorm's affine (``scale``, ``shift``)
    and, when known, the strategy (:func:`backward_strategy`)."""
    x, weight, mean, invstd = b.x, b.weight, b.mean.contiguous(), b.invstd.contiguous()
    stride, padding, dilation = b.stride, b.padding, b.dilation
    want_x, want_w, want_b, want_g, want_beta = b.output_mask
    outs = list(backward_outputs(x, weight, b.mean, b.output_mask))
    grad_out = b.grad_out.to(weight.dtype)
    bscale = b.branch_scale
    if bscale is not None:
        bscale = _branch_scale(bscale, weight)
    need_sums = want_g or want_beta or (want_x and b.batch_stats)
    if strategy is None:
        strategy = backward_strategy(grad_out, x, weight, stride)
    if strategy == "store":
        return _backward_store(grad_out, x, weight, scale, shift, mean, invstd, stride, padding,
                               dilation, b.batch_stats, b.output_mask, outs, need_sums, bscale)
    sums = means = None
    if want_w or want_b or need_sums:
        # One pass over dy and x: weight and bias gradients, and the BatchNorm backward sums;
        # one launch reduces its partials into the outputs (and the sums' means dx needs).
        affine = out_sums = None
        if need_sums:
            affine = (b.bn_weight if b.bn_weight is not None else torch.ones_like(mean),
                      b.bn_bias if b.bn_bias is not None else torch.zeros_like(mean))
            out_sums = (outs[4] if want_beta else torch.empty_like(mean),
                        outs[3] if want_g else torch.empty_like(mean))
            if want_x and b.batch_stats:
                means = (torch.empty_like(scale), torch.empty_like(scale))
        _, _, sums = _wgrad.bn_relu_conv2d_wgrad(
            grad_out, x, weight, scale, shift, stride, padding, dilation, want_weight=want_w,
            want_bias=want_b, bn_affine=affine, mean=mean, invstd=invstd,
            out=outs[1] if want_w else None, branch_scale=bscale,
            out_bias=outs[2] if want_b else None, out_sums=out_sums, out_means=means)
    if want_x:
        # Second pass: dx written directly (the sums are known).
        _dgrad.bn_relu_conv2d_dgrad(
            grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
            batch_stats=b.batch_stats, grad_x=outs[0], want_sums=False, sums=sums,
            branch_scale=bscale, means=means)
    return tuple(outs)



# The same three bodies as triton_ops (what torch.compile traces, CompiledUnit below); the eager
# route (EagerTritonUnit) launches through the same plans.
_forward_op = _triton_op("bn_relu_conv2d")(_forward)
_forward_genstats_op = _triton_op("bn_relu_conv2d_genstats")(_forward_genstats)
_backward_op = _triton_op("bn_relu_conv2d_backward")(_backward)

def backward_strategy(grad_out=None, x=None, weight=None, stride=(1, 1)) -> str:
    """``FUSEDRES_TRITON_BACKWARD``: "sums" (the weight-gradient pass also yields the BatchNorm
    sums, then one pass writes dx; two passes over dy and x, one more GEMM), "store" (one GEMM
    each; the data-gradient epilogue reduces the sums and stores dz in the x gradient's buffer,
    then an elementwise pass turns it into dx: ~3 more activation passes, one GEMM fewer), or
    "auto" (the default: the one with the lower modeled H100 time,
    ``kernels/traffic.auto_strategy``: "store" where wide channels make the GEMMs
    compute-bound or where the "sums" weight gradient's grid is small; without the tensors,
    "sums")."""
    value = settings.get("FUSEDRES_TRITON_BACKWARD")
    if value != "auto" or x is None:
        return "sums" if value == "auto" else value
    n, c, h, w = x.shape
    co, _, kh, kw = weight.shape
    key = (n, c, h, w, co, kh, kw, stride[0], weight.element_size())
    picked = _AUTO_STRATEGY.get(key)
    if picked is None:
        from ..kernels import traffic

        elem = weight.element_size()
        picked = _AUTO_STRATEGY[key] = traffic.auto_strategy(traffic.Unit(
            "auto", int(n), int(c), max(1, round((h * w) ** 0.5)), int(co),
            k=max(1, round((kh * kw) ** 0.5)), stride=int(stride[0]),
            elem=elem if elem in (2, 4, 8) else 4))
    return picked


_AUTO_STRATEGY: dict[tuple, str] = {}  # the model's pick per shape (a pure function of it)


def _backward_store(grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
                    batch_stats, output_mask, outs, need_sums, bscale=None):
    """The "store" strategy: the weight gradient's pass, the data gradient's (dz stored, the
    sums' partials), ONE reduction for the weight gradient's split partials and the sums, the
    dx pass."""
    want_x, want_w, want_b, want_g, want_beta = output_mask
    want_sums = want_g or want_beta
    out_sums = (outs[4] if want_beta else torch.empty_like(mean),
                outs[3] if want_g else torch.empty_like(mean)) if want_sums else None
    dx = want_x or need_sums
    if settings.get("FUSEDRES_TRITON_AUTOTUNE") or not (want_w or want_b) or not dx:
        # Each pass by its own entry (autotuned configs; or one pass alone).
        if want_w or want_b:
            _wgrad.bn_relu_conv2d_wgrad(
                grad_out, x, weight, scale, shift, stride, padding, dilation,
                want_weight=want_w, want_bias=want_b, out=outs[1] if want_w else None,
                branch_scale=bscale, out_bias=outs[2] if want_b else None)
        if dx:
            _dgrad.bn_relu_conv2d_dgrad(
                grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
                batch_stats=batch_stats, grad_x=outs[0] if want_x else None,
                want_sums=want_sums, strategy="store", branch_scale=bscale,
                out_sums=out_sums)
        return tuple(outs)
    wplan = _wgrad.wgrad_plan(grad_out, x, weight, scale, stride, padding, dilation,
                              want_weight=want_w, want_bias=want_b, sums=False,
                              out=outs[1] if want_w else None, branch_scale=bscale,
                              out_bias=outs[2] if want_b else None, out_sums=None,
                              out_means=None)
    grad_x = outs[0] if want_x else None
    dplan = _dgrad.dgrad_plan(grad_out, x, weight, scale, shift, mean, invstd, grad_x, stride,
                              padding, dilation, batch_stats=batch_stats, want_sums=want_sums,
                              sums_given=False, strategy="store", branch_scale=bscale,
                              means_given=False)
    joined = dplan.joined_reduce(wplan.reduce)
    deferred = [joined] if joined is not None else None
    wplan.run(grad_out, x, weight, scale, shift, out=outs[1] if want_w else None,
              branch_scale=bscale, out_bias=outs[2] if want_b else None, deferred=deferred)
    dplan.run(grad_out, x, weight, scale, shift, mean, invstd, grad_x, None, bscale, None,
              out_sums, deferred)
    return tuple(outs)


# --------------------------------------------------------------------------- backend interface
# The ops of fusedres.opdefs under their names; cases the kernels leave to the portable code
# (empty tensors, offsets past int32, the kernels' index type) go there.

def _portable_case(*tensors) -> bool:
    return any(t is not None and t.numel() == 0 for t in tensors) or not _fits_int32(*tensors)


def _forward_portable_case(u: UnitArgs) -> bool:
    # y is dense (either layout): its largest element offset is numel - 1.
    return (_portable_case(u.x, u.weight, u.residual)
            or math.prod(out_shape(u.x, u.weight, u.stride, u.padding, u.dilation)) > 2**31)


def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    if _portable_case(x):
        return portable.batch_stats(x)
    return torch.ops.fusedres_triton.batch_stats(x)


def prepares(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
             training: bool) -> bool:
    """Whether :func:`prepare_batch_norm` takes ``x``'s BatchNorm (16- or 32-bit x the kernels
    index, contiguous running statistics of a dtype it updates); else fusedres.functional's
    PyTorch ops do."""
    return (not _portable_case(x)
            and _prepare_unsupported(x, running_mean, running_var, training) is None)


def prepare_batch_norm(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                       num_batches_tracked: Optional[Tensor], training: bool,
                       momentum: Optional[float], eps: float, mean: Optional[Tensor] = None,
                       var: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """fusedres.functional.prepare_batch_norm's statistics, running-statistics update and
    ``invstd`` in one or two launches (kernels/batch_stats.py's ``prepare_batch_norm``) instead
    of its ~10 PyTorch ops: (mean, invstd). Eager tensors only (fusedres.route);
    :func:`prepares` says which."""
    return _prepare_batch_norm(x, running_mean, running_var, num_batches_tracked, training,
                               momentum, eps, mean, var)


def bn_relu_conv2d(*inputs) -> Tensor:
    if _forward_portable_case(UnitArgs(*inputs)):
        return portable.bn_relu_conv2d(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d(*inputs)


def bn_relu_conv2d_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """``bn_relu_conv2d`` plus the (mean, biased var) of its output per channel, in the
    statistics dtype of y: what the next unit's BatchNorm needs, without a pass over y."""
    if _forward_portable_case(UnitArgs(*inputs)):
        return portable.bn_relu_conv2d_genstats(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d_genstats(*inputs)


def bn_relu_conv2d_backward(*inputs) -> tuple[Tensor, ...]:
    b = BackwardArgs(*inputs)
    if _portable_case(b.grad_out, b.x, b.weight):
        return portable.bn_relu_conv2d_backward(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d_backward(*inputs)


# The fused unit over the fusedres_triton ops, for graphs that torch.compile traces on a GPU
# (fusedres.functional routes there): the public fusedres ops are opaque to Inductor, these
# triton_ops decompose into their Triton kernels, forward and backward.
CompiledUnit = direct_unit("CompiledUnit", torch.ops.fusedres_triton.bn_relu_conv2d,
                           torch.ops.fusedres_triton.bn_relu_conv2d_genstats,
                           torch.ops.fusedres_triton.bn_relu_conv2d_backward)


def compiled_unit(args: UnitArgs, genstats: bool, affine=None):
    """:data:`CompiledUnit` on ``args``, or the public op for the cases the kernels leave to the
    portable code."""
    if _forward_portable_case(args):
        op = (torch.ops.fusedres.bn_relu_conv2d_genstats if genstats
              else torch.ops.fusedres.bn_relu_conv2d)
        return op(*args)
    return CompiledUnit.apply(*args, genstats)


def compiled_batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """``batch_stats`` through the triton_op, for traced graphs (see :data:`CompiledUnit`)."""
    if _portable_case(x):
        return tuple(torch.ops.fusedres.batch_stats(x))
    return tuple(torch.ops.fusedres_triton.batch_stats(x))


# --------------------------------------------------------------------------- the eager route
# fusedres.route's "triton, eager": the kernels launched from an autograd.Function through their
# plans (kernels/: config, grid and integer arguments cached per shapes, strides, dtypes and
# alignments), with no custom-op layer between; the BatchNorm's affine (scale, shift) made by the
# preparation's launch and kept for the backward.

def _eager_backward(scale: Tensor, shift: Tensor, *inputs) -> tuple[Tensor, ...]:
    """The backward body for :class:`EagerTritonUnit`: x and the weight were checked by the forward
    (:func:`eager_unit`), the gradient is checked here (a strided view, e.g. of a ``torch.cat``
    output's gradient, can reach offsets past int32 where y did not)."""
    if not _fits_int32(inputs[0]):
        return portable.bn_relu_conv2d_backward(*inputs)
    return _backward_with(BackwardArgs(*inputs), scale, shift)


class EagerTritonUnit(torch.autograd.Function):
    """The fused unit in eager mode: ``apply(*UnitArgs, genstats, scale, shift)`` -> ``y`` or
    ``(y, mean, var)``; ``scale``, ``shift`` the BatchNorm's affine when the preparation made
    it (None: one launch makes it here). The autograd rule of fusedres.ops (unit_setup_context,
    unit_backward), with the affine saved beside it. Its backward runs the kernels bare on a
    plain gradient with grad mode off, else the public backward op (a double backward, batched
    gradients: fusedres.ops.bare_gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                padding, dilation, batch_stats, branch_scale, genstats, scale, shift):
        u = UnitArgs(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                     padding, dilation, batch_stats, branch_scale)
        if scale is None:
            scale, shift = _scale_shift(u)
        unit_setup_context(ctx, u, None, scale, shift)
        out = _launch_forward(u, genstats, scale, shift)
        if genstats:
            ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, grad_out, *_stats_grads):
        if bare_gradients(grad_out):
            scale, shift = ctx.saved_tensors[-2:]
            op = functools.partial(_eager_backward, scale, shift)
        else:
            op = torch.ops.fusedres.bn_relu_conv2d_backward
        return (*unit_backward(ctx, grad_out, op), None, None, None)  # genstats, affine


def eager_unit(args: UnitArgs, genstats: bool, affine=None):
    """:class:`EagerTritonUnit` on ``args`` (eager tensors), or the public op for the cases the
    kernels leave to the portable code. Returns ``y``, or ``(y, mean, var)`` of y when ``genstats``.
    ``affine``: (scale, shift) from the preparation, or None."""
    if _forward_portable_case(args):
        op = (torch.ops.fusedres.bn_relu_conv2d_genstats if genstats
              else torch.ops.fusedres.bn_relu_conv2d)
        return op(*args)
    scale, shift = affine if affine is not None else (None, None)
    return EagerTritonUnit.apply(*args, genstats, scale, shift)


def eager_launches(args: UnitArgs, genstats: bool, affine, backward: BackwardArgs):
    """The launches of :class:`EagerTritonUnit`'s forward and backward for ``args`` and ``backward``
    given the preparation's ``affine``, without autograd (kernels/jit_spec.py records them on
    meta tensors)."""
    _launch_forward(args, genstats, *affine)
    return _backward_with(backward, *affine)


def prepare_affine(x: Tensor, bn_weight, bn_bias, running_mean, running_var,
                   num_batches_tracked, training: bool, momentum, eps: float, mean=None,
                   var=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`prepare_batch_norm` that also makes the fused BatchNorm's (scale, shift) from
    ``bn_weight``, ``bn_bias`` (in the statistics dtype, or None) in its launch: (mean, invstd,
    scale, shift)."""
    return _prepare_batch_norm(x, running_mean, running_var, num_batches_tracked, training,
                               momentum, eps, mean, var, bn_weight, bn_bias, True)


_MODULE_CASES: dict[tuple, bool] = {}


def _module_case_key(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                     num_batches_tracked, training, momentum, eps, residual, stride, padding,
                     dilation) -> tuple:
    # Every type, shape, stride, dtype and device the checks read, written out: a helper
    # function a tensor would cost ~10 Python calls a step.
    return (type(x), x.shape, x.stride(), x.dtype, x.device,
            type(weight), weight.shape, weight.stride(), weight.dtype, weight.device,
            None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device),
            None if bn_weight is None else (type(bn_weight), bn_weight.shape, bn_weight.dtype,
                                            bn_weight.device),
            None if bn_bias is None else (type(bn_bias), bn_bias.shape, bn_bias.dtype,
                                          bn_bias.device),
            None if running_mean is None else (type(running_mean), running_mean.shape,
                                               running_mean.stride(), running_mean.dtype,
                                               running_mean.device, running_mean.requires_grad),
            None if running_var is None else (type(running_var), running_var.shape,
                                              running_var.stride(), running_var.dtype,
                                              running_var.device, running_var.requires_grad),
            None if num_batches_tracked is None else (type(num_batches_tracked),
                                                      num_batches_tracked.dtype),
            None if residual is None else (type(residual), residual.shape, residual.stride(),
                                           residual.dtype, residual.device),
            training, momentum, eps, stride, padding, dilation,
            torch.is_autocast_enabled(x.device.type), torch.is_grad_enabled())


def _module_takes(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                  num_batches_tracked, training, momentum, eps, residual, stride, padding,
                  dilation) -> bool:
    """Whether :func:`module_unit` runs these arguments: after the checks of the Python route
    (fusedres.functional, whose errors name the argument: raised here, before anything is
    touched), what the preparation and the kernels take: statistics of 16- or 32-bit x, the
    BatchNorm's affine in the statistics dtype, a residual in the weight's dtype, autocast off,
    offsets the kernels index."""
    from ..checks import check_batch_norm_args, check_conv_args

    check_conv_args(x, weight, bias, residual, stride, padding, dilation)
    check_batch_norm_args(x, bn_weight, bn_bias, running_mean, running_var,
                             num_batches_tracked, training=training, momentum=momentum, eps=eps)
    sdt = torch.float32
    return (not torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64
            and all(t is None or t.dtype == sdt for t in (bn_weight, bn_bias))
            and (residual is None or residual.dtype == weight.dtype)
            and prepares(x, running_mean, running_var, training)
            and not _forward_portable_case(UnitArgs(x, weight, bias, bn_weight, bn_bias, x, x,
                                                    residual, stride, padding, dilation, True)))


def module_unit(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                num_batches_tracked, training, momentum, eps, residual, stride, padding,
                dilation) -> list[Tensor]:
    """A ``BNReLUConv2d``'s forward on the triton backend (fusedres.route's module_unit): the
    BatchNorm's preparation with its affine (two launches, one with the batch statistics
    given), then :class:`EagerTritonUnit`: ``[y]``, or ``[]`` with nothing touched for arguments it
    leaves to the checked route. The checks run once per arguments' shapes, strides, dtypes
    and flags (:func:`_module_takes`)."""
    key = _module_case_key(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                           num_batches_tracked, training, momentum, eps, residual, stride,
                           padding, dilation)
    takes = _MODULE_CASES.get(key)
    if takes is None:
        takes = _MODULE_CASES[key] = _module_takes(
            x, weight, bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
            training, momentum, eps, residual, stride, padding, dilation)
    if not takes:
        return []
    mean, invstd, scale, shift = _prepare_plan(
        x, running_mean, running_var, num_batches_tracked, training, momentum, eps, False,
        bn_weight, bn_bias, True).run(x, running_mean, running_var, num_batches_tracked, None,
                                      None, bn_weight, bn_bias)
    batch_stats = training or running_mean is None
    args = UnitArgs(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                    padding, dilation, batch_stats)
    if not torch.is_grad_enabled():
        return [_launch_forward(args, False, scale, shift)]
    return [EagerTritonUnit.apply(*args, False, scale, shift)]
