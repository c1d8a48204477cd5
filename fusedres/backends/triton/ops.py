"""The Triton backend: kernels/ (importable as ``fusedres.kernels``).

The backend's entry points (what the public ops route to) go through ops of the
``fusedres_triton`` namespace defined with ``torch.library.triton_op``: in a graph that
torch.compile traces on a GPU, their bodies' launches are recorded through ``wrap_triton``
(``kernels._common.launcher`` wraps only while tracing) and Inductor sees the Triton kernels
themselves. Eager code (fusedres.ops.route) takes a shorter route to the same launches:
:class:`EagerTritonUnit` (an ``autograd.Function`` over them), :func:`prepare_affine` and
:func:`module_unit`; every launch through its plan (kernels/: config, grid and arguments fixed
per shapes, strides, dtypes and alignments; on a GPU, straight to the compiled launcher after
the JIT's first launch). Under ``TRITON_INTERPRET=1`` (CPU tensors) the ops run eagerly; they
cannot be traced with fake tensors there, so torch.compile is tested through the other
backends' ops.
"""

import math
import os
from typing import Optional

import torch
from torch import Tensor

from .. import settings
from ..ops import direct_unit
from ..ops._backend import is_eager
from ..ops.checks import check_op_args
from ..ops.opdefs import (
    SCHEMAS,
    BackwardArgs,
    UnitArgs,
    arg_names,
    backward_outputs,
    out_shape,
    python_signature,
)
from . import portable

_KERNELS_ERROR: Optional[str] = None
try:
    from ..kernels import bn_relu_conv2d_dgrad as _dgrad
    from ..kernels import bn_relu_conv2d_wgrad as _wgrad
    from ..kernels._common import fits_int32 as _fits_int32
    from ..kernels._common import plan_cache as _plan_cache
    from ..kernels._common import tf32_allowed as _tf32_allowed
    from ..kernels.batch_stats import batch_stats as _batch_stats
    from ..kernels.batch_stats import prepare_affine as _prepare_affine
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
# The schemas of fusedres.ops.opdefs; the bodies launch the kernels through kernels._common.launcher
# (wrap_triton while a graph is traced, the kernel itself in eager code).

# The devices the triton ops take x on. kernels/jit_spec.capturing adds "meta" while it records
# a step's launches (its recorder stands in for every launch: no kernel reads a meta tensor).
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")


def _triton_op(op: str):
    """``torch.library.triton_op("fusedres_triton::<op>")`` with the schema of SCHEMAS. The
    function also carries that schema as its Python signature: torch 2.11 infers the schema
    from the signature whatever ``schema=`` says (and ``*inputs`` cannot be inferred)."""
    x_at = arg_names(op).index("x")

    def register(fn):
        def checked(*args):  # every argument first: the ops' contract (fusedres.ops.checks)
            check_op_args(op, args, f"fusedres_triton::{op}", DEVICE_TYPES)
            if args[x_at].numel() == 0:  # an empty batch: nothing to launch (docs/api.md)
                return getattr(portable, op)(*args)
            return fn(*args)

        checked.__name__ = fn.__name__
        checked.__signature__ = python_signature(op)
        return torch.library.triton_op(f"fusedres_triton::{op}", mutates_args=(),
                                       schema=SCHEMAS[op])(checked)
    return register


@_triton_op("batch_stats")
def _batch_stats_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _batch_stats(x)


def _launch_forward(u: UnitArgs, genstats: bool, scale=None, shift=None, merge=None):
    """The forward's launches (its plan cached per shapes, strides, dtypes and alignments);
    ``scale``, ``shift``: the BatchNorm's affine when the preparation made it (else one
    launch makes it here). ``merge``: the genstats rows merged in the forward's launch (None:
    on plain and meta tensors; False: by a launch of their own, what the triton_ops' bodies
    run, eager or traced: a graph cannot hold the counts the in-kernel merge needs)."""
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
                     u.dilation, None, genstats, bscale, merge)
    return plan.run(u.x, u.weight, scale, shift, bias, residual, bscale)


def _forward(*inputs) -> Tensor:
    return _launch_forward(UnitArgs(*inputs), genstats=False, merge=False)


def _forward_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """Forward that also returns (mean, biased var) of y per output channel, reduced in the
    convolution's epilogue."""
    return _launch_forward(UnitArgs(*inputs), genstats=True, merge=False)


def _backward(*inputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b = BackwardArgs(*inputs)
    return _backward_with(b, *_scale_shift(b))


def _backward_with(b: BackwardArgs, scale: Tensor, shift: Tensor, strategy: str | None = None):
    """The backward's launches for ``b`` given the BatchNorm's affine (``scale``, ``shift``)
    and, when known, the strategy (:func:`backward_strategy`): a :class:`BackwardPlan` built for
    this call (the eager route keeps its plans, :class:`EagerTritonUnit`)."""
    bscale = b.branch_scale
    if bscale is not None:
        bscale = _branch_scale(bscale, b.weight)
    grad_out = b.grad_out.to(b.weight.dtype)
    mask = tuple(b.output_mask)
    outs = backward_outputs(b.x, b.weight, b.mean, mask)
    plan = BackwardPlan(grad_out, b.x, b.weight, b.bn_weight, b.bn_bias, b.mean, b.invstd,
                        scale, shift, (b.stride, b.padding, b.dilation), b.batch_stats, mask,
                        bscale, strategy, outs)
    return plan.run(grad_out, b.x, b.weight, b.bn_weight, b.bn_bias, b.mean, b.invstd, scale,
                    shift, bscale, outs)


class BackwardPlan:
    """The backward's launches for one key: the strategy (:func:`backward_strategy`), the
    weight- and data-gradient plans (kernels/: configs, splits, grids and integer arguments) and
    the store strategy's joined reduction fixed; :meth:`run` allocates the outputs and launches
    on the tensors of a call. Built from a call's tensors (``grad_out`` in the weight's dtype,
    ``bscale`` the kernels' branch scale or None); its kernels' own plans are cached by their
    keys, and :class:`EagerTritonUnit` keeps the plan itself per gradient layout.

    Three forms: *store* (the weight gradient's pass, the data gradient's with dz stored and
    the sums' partials, one reduction of both passes' partials, the dx pass), *sums* (the
    weight-gradient pass also reduces the BatchNorm sums, then one data-gradient pass writes
    dx) and *passes* (each pass through its own entry: autotuning, or the store strategy with
    one pass alone)."""

    def __init__(self, grad_out, x, weight, bn_weight, bn_bias, mean, invstd, scale, shift,
                 geometry, batch_stats: bool, output_mask: tuple, bscale,
                 strategy: str | None = None, outs=None):
        """``outs``: the outputs of a first :meth:`run` (``backward_outputs``), whose layouts
        the plans read; None: made here for that."""
        stride, padding, dilation = geometry
        want_x, want_w, want_b, want_g, want_beta = output_mask
        self.geometry, self.batch_stats, self.mask = geometry, batch_stats, output_mask
        self.want_sums = want_g or want_beta
        self.need_sums = self.want_sums or (want_x and batch_stats)
        if strategy is None:
            strategy = backward_strategy(grad_out, x, weight, stride)
        self.strategy = strategy
        mean, invstd = mean.contiguous(), invstd.contiguous()
        if outs is None:
            outs = backward_outputs(x, weight, mean, output_mask)
        self.wplan = self.dplan = self.joined = None
        autotune = settings.get("FUSEDRES_TRITON_AUTOTUNE")
        if autotune or (strategy == "store" and not (
                (want_w or want_b) and (want_x or self.need_sums))):
            self.form = "passes"
        elif strategy == "store":
            self.form = "store"
            self.wplan = _wgrad.wgrad_plan(
                grad_out, x, weight, scale, stride, padding, dilation, want_weight=want_w,
                want_bias=want_b, sums=False, out=outs[1] if want_w else None,
                branch_scale=bscale, out_bias=outs[2] if want_b else None, out_sums=None,
                out_means=None)
            self.dplan = _dgrad.dgrad_plan(
                grad_out, x, weight, scale, shift, mean, invstd, outs[0] if want_x else None,
                stride, padding, dilation, batch_stats=batch_stats, want_sums=self.want_sums,
                sums_given=False, strategy="store", branch_scale=bscale, means_given=False)
            self.joined = self.dplan.joined_reduce(self.wplan.reduce)
        else:
            self.form = "sums"
            means = want_x and batch_stats
            if want_w or want_b or self.need_sums:
                self.wplan = _wgrad.wgrad_plan(
                    grad_out, x, weight, scale, stride, padding, dilation, want_weight=want_w,
                    want_bias=want_b, sums=self.need_sums, out=outs[1] if want_w else None,
                    branch_scale=bscale, out_bias=outs[2] if want_b else None,
                    out_sums=(mean, mean) if self.need_sums else None,
                    out_means=(mean, mean) if self.need_sums and means else None)
            if want_x:
                self.dplan = _dgrad.dgrad_plan(
                    grad_out, x, weight, scale, shift, mean, invstd, outs[0], stride, padding,
                    dilation, batch_stats=batch_stats, want_sums=False,
                    sums_given=self.need_sums, strategy="store", branch_scale=bscale,
                    means_given=self.need_sums and means)

    def run(self, grad_out, x, weight, bn_weight, bn_bias, mean, invstd, scale, shift, bscale,
            outs=None):
        """The five outputs of ``bn_relu_conv2d_backward`` (an empty tensor where the mask
        wants none), in ``outs`` when given. ``grad_out`` in the weight's dtype; ``bscale`` as
        the kernels read it."""
        want_x, want_w, want_b, want_g, want_beta = self.mask
        mean, invstd = mean.contiguous(), invstd.contiguous()
        if outs is None:
            outs = backward_outputs(x, weight, mean, self.mask)
        out_sums = None
        if self.want_sums:
            out_sums = (outs[4] if want_beta else torch.empty_like(mean),
                        outs[3] if want_g else torch.empty_like(mean))
        if self.form == "store":
            grad_x = outs[0] if want_x else None
            deferred = [self.joined] if self.joined is not None else None
            self.wplan.run(grad_out, x, weight, scale, shift, out=outs[1] if want_w else None,
                           branch_scale=bscale, out_bias=outs[2] if want_b else None,
                           deferred=deferred)
            self.dplan.run(grad_out, x, weight, scale, shift, mean, invstd, grad_x, None,
                           bscale, None, out_sums, deferred)
        elif self.form == "sums":
            sums = means = None
            if self.wplan is not None:
                affine = None
                if self.need_sums:
                    affine = (bn_weight if bn_weight is not None else torch.ones_like(mean),
                              bn_bias if bn_bias is not None else torch.zeros_like(mean))
                    if out_sums is None:
                        out_sums = (torch.empty_like(mean), torch.empty_like(mean))
                    if want_x and self.batch_stats:
                        means = (torch.empty_like(scale), torch.empty_like(scale))
                _, _, sums = self.wplan.run(
                    grad_out, x, weight, scale, shift, bn_affine=affine, mean=mean,
                    invstd=invstd, out=outs[1] if want_w else None, branch_scale=bscale,
                    out_bias=outs[2] if want_b else None, out_sums=out_sums, out_means=means)
            if want_x:
                self.dplan.run(grad_out, x, weight, scale, shift, mean, invstd, outs[0], sums,
                               bscale, means)
        else:
            self._passes(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, scale, shift,
                         bscale, outs, out_sums)
        return outs

    def _passes(self, grad_out, x, weight, bn_weight, bn_bias, mean, invstd, scale, shift,
                bscale, outs, out_sums):
        """Each pass through its own entry (autotuned configs; or one pass alone)."""
        stride, padding, dilation = self.geometry
        want_x, want_w, want_b, want_g, want_beta = self.mask
        sums = means = None
        if self.strategy != "store" and self.need_sums:
            affine = (bn_weight if bn_weight is not None else torch.ones_like(mean),
                      bn_bias if bn_bias is not None else torch.zeros_like(mean))
            if out_sums is None:
                out_sums = (torch.empty_like(mean), torch.empty_like(mean))
            if want_x and self.batch_stats:
                means = (torch.empty_like(scale), torch.empty_like(scale))
        else:
            affine = None
        if want_w or want_b or affine is not None:
            _, _, sums = _wgrad.bn_relu_conv2d_wgrad(
                grad_out, x, weight, scale, shift, stride, padding, dilation,
                want_weight=want_w, want_bias=want_b, bn_affine=affine, mean=mean,
                invstd=invstd, out=outs[1] if want_w else None, branch_scale=bscale,
                out_bias=outs[2] if want_b else None, out_sums=out_sums if affine else None,
                out_means=means)
        if self.strategy == "store" and (want_x or self.need_sums):
            _dgrad.bn_relu_conv2d_dgrad(
                grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
                batch_stats=self.batch_stats, grad_x=outs[0] if want_x else None,
                want_sums=self.want_sums, strategy="store", branch_scale=bscale,
                out_sums=out_sums)
        elif want_x:
            _dgrad.bn_relu_conv2d_dgrad(
                grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
                batch_stats=self.batch_stats, grad_x=outs[0], want_sums=False, sums=sums,
                branch_scale=bscale, means=means)


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


# --------------------------------------------------------------------------- backend interface
# The ops of fusedres.ops.opdefs under their names; cases the kernels leave to the portable code
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
    PyTorch ops do. Decided once per what it reads."""
    key = (x.shape, x.stride(), x.dtype,
           None if running_mean is None else (running_mean.dtype, running_mean.stride()),
           None if running_var is None else (running_var.dtype, running_var.stride()), training)
    takes = _PREPARES.get(key)
    if takes is None:
        takes = _PREPARES[key] = (
            not _portable_case(x)
            and _prepare_unsupported(x, running_mean, running_var, training) is None)
    return takes


_PREPARES: dict[tuple, bool] = {}  # a pure function of its key


def prepare_batch_norm(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                       num_batches_tracked: Optional[Tensor], training: bool,
                       momentum: Optional[float], eps: float, mean: Optional[Tensor] = None,
                       var: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """fusedres.functional.prepare_batch_norm's statistics, running-statistics update and
    ``invstd`` in one or two launches (kernels/batch_stats.py's ``prepare_batch_norm``) instead
    of its ~10 PyTorch ops: (mean, invstd). Eager tensors only (fusedres.ops.route);
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
# fusedres.ops.route's "triton, eager": the kernels launched from an autograd.Function through their
# plans (kernels/: config, grid and integer arguments cached per shapes, strides, dtypes and
# alignments), with no custom-op layer between; the BatchNorm's affine (scale, shift) made by the
# preparation's launch and kept for the backward. What the host does per step is counted
# (benchmarks/hostcost.py, tests/test_host_cost.py): each layer here is a Python call a step.

# The settings a backward plan depends on, read raw for its key (fusedres.settings.raw_lookup).
_ENV_GET, _ENV_KEYS = settings.raw_lookup("FUSEDRES_TRITON_BACKWARD", "FUSEDRES_TRITON_AUTOTUNE")
_MISSING = object()


class EagerTritonUnit(torch.autograd.Function):
    """The fused unit in eager mode: ``apply(plan, x, weight, bias, bn_weight, bn_bias, mean,
    invstd, residual, branch_scale, scale, shift, batch_stats)`` -> ``y`` or ``(y, mean, var)``
    (``plan.genstats``), with ``plan`` the forward's (kernels/bn_relu_conv2d.py's
    ``forward_plan`` for these tensors), ``residual`` in the weight's dtype and
    ``branch_scale`` as the kernels read it (:func:`_branch_scale`), ``scale``, ``shift`` the
    BatchNorm's affine. The autograd rule of fusedres.ops (x, the weight, the BatchNorm's
    parameters and statistics kept; mean and invstd take no gradient, the residual's is
    ``grad_out``), with the affine kept beside them. Its backward runs the kernels bare on a
    plain gradient with grad mode off, through a :class:`BackwardPlan` the forward's plan keeps
    per gradient layout; else the public backward op (a double backward, batched gradients:
    fusedres.ops.bare_gradients's rule)."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias, bn_weight, bn_bias, mean, invstd, residual,
                branch_scale, scale, shift, batch_stats):
        ctx.save_for_backward(x, weight, bn_weight, bn_bias, mean, invstd, branch_scale, scale,
                              shift)
        ctx.plan, ctx.batch_stats = plan, batch_stats
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        out = plan.run(x, weight, scale, shift, bias, residual, branch_scale)
        if plan.genstats:
            ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, grad_out, *_stats_grads):
        x, weight, bn_weight, bn_bias, mean, invstd, bscale, scale, shift = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = (need[1], need[2], need[3] and ctx.has_bias, need[4] and bn_weight is not None,
                need[5] and bn_bias is not None)
        gx = gw = gb = gg = gbeta = None
        if True in mask:
            plan = ctx.plan
            if torch.is_grad_enabled() or not is_eager(grad_out):
                outs = torch.ops.fusedres.bn_relu_conv2d_backward(
                    grad_out, x, weight, bn_weight, bn_bias, mean, invstd, *plan.geometry,
                    ctx.batch_stats, list(mask), bscale)
            else:
                if grad_out.dtype != weight.dtype:
                    grad_out = grad_out.to(weight.dtype)
                # What the backward's plan depends on beyond the forward plan's key: the
                # gradient's layout, the outputs wanted, the statistics' alignment, the mode,
                # the settings.
                key = (grad_out.stride(), grad_out.data_ptr() % 16, mask, ctx.batch_stats,
                       bn_weight is None, bn_bias is None, mean.data_ptr() % 16,
                       invstd.data_ptr() % 16, *map(_ENV_GET, _ENV_KEYS))
                bplan = plan.backwards.get(key, _MISSING)
                if bplan is _MISSING:
                    # None: offsets past int32 (a strided view of a larger gradient, as a
                    # torch.cat output's): the portable code.
                    bplan = plan.backwards[key] = BackwardPlan(
                        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, scale, shift,
                        plan.geometry, ctx.batch_stats, mask, bscale) \
                        if _fits_int32(grad_out) else None
                if bplan is None:
                    outs = portable.bn_relu_conv2d_backward(
                        grad_out, x, weight, bn_weight, bn_bias, mean, invstd, *plan.geometry,
                        ctx.batch_stats, list(mask), bscale)
                else:
                    outs = bplan.run(grad_out, x, weight, bn_weight, bn_bias, mean, invstd,
                                     scale, shift, bscale)
            gx, gw, gb, gg, gbeta = outs  # (no generator: each of its steps is a Python call)
            gx, gw = gx if mask[0] else None, gw if mask[1] else None
            gb, gg, gbeta = gb if mask[2] else None, gg if mask[3] else None, \
                gbeta if mask[4] else None
        gres = grad_out if ctx.has_residual and need[8] else None
        return None, gx, gw, gb, gg, gbeta, None, None, gres, None, None, None, None


def eager_unit(args: UnitArgs, genstats: bool, affine=None):
    """:class:`EagerTritonUnit` on ``args`` (eager tensors), or the public op for the cases the
    kernels leave to the portable code. Returns ``y``, or ``(y, mean, var)`` of y when ``genstats``.
    ``affine``: (scale, shift) from the preparation, or None (one launch makes it here)."""
    (x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding, dilation,
     batch_stats, bscale) = args
    if affine is None:
        if _forward_portable_case(args):
            return _public_unit(args, genstats)
        scale, shift = _scale_shift(args)
    else:
        scale, shift = affine
    if residual is not None and residual.dtype != weight.dtype:
        residual = residual.to(weight.dtype)  # differentiable: the gradient casts back
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read bias[co] at unit stride; differentiable
    if bscale is not None:
        bscale = _branch_scale(bscale, weight)
    # The forward plan's key (kernels/bn_relu_conv2d.py's plan_key, written out: a call a
    # tensor would cost ~10 Python calls a step); None for the cases the kernels leave to the
    # portable code.
    key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, weight.shape,
           weight.stride(), weight.dtype, weight.data_ptr() % 16,
           None if bias is None else (bias.shape, bias.dtype, bias.data_ptr() % 16),
           None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                          residual.data_ptr() % 16),
           None if bscale is None else (bscale.shape, bscale.dtype, bscale.data_ptr() % 16),
           scale.dtype, shift.dtype, scale.data_ptr() % 16, shift.data_ptr() % 16,
           tuple(stride), tuple(padding), tuple(dilation), genstats, _tf32_allowed())
    plan = _UNIT_PLANS.get(key, _MISSING)
    if plan is _MISSING:
        plan = _UNIT_PLANS[key] = None if _forward_portable_case(args) else _fwd_plan(
            x, weight, bias, scale, shift, residual, stride, padding, dilation, None, genstats,
            bscale)
    if plan is None:
        return _public_unit(args, genstats)
    return EagerTritonUnit.apply(plan, x, weight, bias, bn_weight, bn_bias, mean, invstd,
                                 residual, bscale, scale, shift, batch_stats)


def _public_unit(args: UnitArgs, genstats: bool):
    op = (torch.ops.fusedres.bn_relu_conv2d_genstats if genstats
          else torch.ops.fusedres.bn_relu_conv2d)
    return op(*args)


# eager_unit's forward plans by their key (None: the public op), cleared with the plans.
_UNIT_PLANS: dict[tuple, object] = _plan_cache() if _KERNELS_ERROR is None else {}


def eager_launches(args: UnitArgs, genstats: bool, affine, backward: BackwardArgs):
    """The launches of :class:`EagerTritonUnit`'s forward and backward for ``args`` and ``backward``
    given the preparation's ``affine``, without autograd (tools/jit_spec.py records them on
    meta tensors)."""
    _launch_forward(args, genstats, *affine)
    return _backward_with(backward, *affine)


# prepare_affine(x, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
#                training, momentum, eps, mean=None, var=None) -> (mean, invstd, scale, shift):
# prepare_batch_norm that also makes the fused BatchNorm's (scale, shift) from bn_weight, bn_bias
# (in the statistics dtype, or None) in its launch (kernels/batch_stats.py's, with no layer here).
prepare_affine = _prepare_affine if _KERNELS_ERROR is None else None


class _ModuleCase:
    """What :func:`module_unit` runs for one key: the preparation's plan and the forward's."""

    __slots__ = ("prepare", "forward")

    def __init__(self, prepare, forward):
        self.prepare, self.forward = prepare, forward


# key -> _ModuleCase, or False for arguments left to the checked route. Cleared with the plans.
_MODULE_CASES: dict[tuple, object] = _plan_cache() if _KERNELS_ERROR is None else {}


def _module_case(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                 num_batches_tracked, training, momentum, eps, residual, stride, padding,
                 dilation):
    """A :class:`_ModuleCase` for these arguments, or False for those :func:`module_unit`
    leaves to the checked route: after the checks of the Python route (fusedres.functional,
    whose errors name the argument: raised here, before anything is touched), what the
    preparation and the kernels take: statistics of 16- or 32-bit x, the BatchNorm's affine in
    the statistics dtype, a residual in the weight's dtype, autocast off, offsets the kernels
    index."""
    from ..ops.checks import check_batch_norm_args, check_conv_args

    check_conv_args(x, weight, bias, residual, stride, padding, dilation)
    check_batch_norm_args(x, bn_weight, bn_bias, running_mean, running_var,
                          num_batches_tracked, training=training, momentum=momentum, eps=eps)
    sdt = torch.float32
    takes = (not torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64
             and all(t is None or t.dtype == sdt for t in (bn_weight, bn_bias))
             and (residual is None or residual.dtype == weight.dtype)
             and prepares(x, running_mean, running_var, training)
             and not _forward_portable_case(UnitArgs(x, weight, bias, bn_weight, bn_bias, x, x,
                                                     residual, stride, padding, dilation, True)))
    if not takes:
        return False
    prepare = _prepare_plan(x, running_mean, running_var, num_batches_tracked, training,
                            momentum, eps, False, bn_weight, bn_bias, True)
    # The preparation's scale and shift are new (C,) tensors a step: allocator-aligned, as these.
    affine = torch.empty((2, x.shape[1]), device=x.device, dtype=sdt)
    forward = _fwd_plan(x, weight, bias, affine[0], affine[1], residual, stride, padding,
                        dilation, None, False, None)
    return _ModuleCase(prepare, forward)


def module_unit(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                num_batches_tracked, training, momentum, eps, residual, stride, padding,
                dilation) -> list[Tensor]:
    """A ``BNReLUConv2d``'s forward on the triton backend (fusedres.ops.route's module_unit): the
    BatchNorm's preparation with its affine (one launch), then :class:`EagerTritonUnit`:
    ``[y]``, or ``[]`` with nothing touched for arguments it leaves to the checked route. The
    checks and the plans are made once per arguments' types, shapes, strides, dtypes,
    alignments and flags (:func:`_module_case`)."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read bias[co] at unit stride; differentiable
    # Every type, shape, stride, dtype, device and alignment the checks and the plans read,
    # written out: a helper function a tensor would cost ~10 Python calls a step.
    key = (type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16,
           type(weight), weight.shape, weight.stride(), weight.dtype, weight.device,
           weight.data_ptr() % 16,
           None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device,
                                      bias.data_ptr() % 16),
           None if bn_weight is None else (type(bn_weight), bn_weight.shape, bn_weight.dtype,
                                           bn_weight.device, bn_weight.data_ptr() % 16),
           None if bn_bias is None else (type(bn_bias), bn_bias.shape, bn_bias.dtype,
                                         bn_bias.device, bn_bias.data_ptr() % 16),
           None if running_mean is None else (type(running_mean), running_mean.shape,
                                              running_mean.stride(), running_mean.dtype,
                                              running_mean.device, running_mean.data_ptr() % 16,
                                              running_mean.requires_grad,
                                              running_mean.is_inference()),
           None if running_var is None else (type(running_var), running_var.shape,
                                             running_var.stride(), running_var.dtype,
                                             running_var.device, running_var.data_ptr() % 16,
                                             running_var.requires_grad,
                                             running_var.is_inference()),
           None if num_batches_tracked is None else (type(num_batches_tracked),
                                                     num_batches_tracked.dtype,
                                                     num_batches_tracked.data_ptr() % 16,
                                                     num_batches_tracked.is_inference()),
           None if residual is None else (type(residual), residual.shape, residual.stride(),
                                          residual.dtype, residual.device,
                                          residual.data_ptr() % 16),
           training, momentum, eps, stride, padding, dilation,
           torch.is_autocast_enabled(x.device.type), _tf32_allowed(),
           torch.is_inference_mode_enabled())
    case = _MODULE_CASES.get(key)
    if case is None:
        case = _MODULE_CASES[key] = _module_case(
            x, weight, bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
            training, momentum, eps, residual, stride, padding, dilation)
    if case is False:
        return []
    mean, invstd, scale, shift = case.prepare.run(x, running_mean, running_var,
                                                  num_batches_tracked, None, None, bn_weight,
                                                  bn_bias)
    plan = case.forward
    if not torch.is_grad_enabled():
        return [plan.run(x, weight, scale, shift, bias, residual, None)]
    return [EagerTritonUnit.apply(plan, x, weight, bias, bn_weight, bn_bias, mean, invstd,
                                  residual, None, scale, shift,
                                  training or running_mean is None)]
