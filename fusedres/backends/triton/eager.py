"""The Triton backend's eager route: the kernels launched from an ``autograd.Function``
through their plans, with no custom-op layer between.

The triton record's eager fields (fusedres.ops._backend): :class:`EagerTritonUnit` (the
unit's autograd rule over the kernels), :func:`eager_unit` (the record's unit),
:func:`prepare_affine` (the BatchNorm's preparation with the fused affine in its launch) and
:func:`module_unit` (a ``BNReLUConv2d``'s forward: that preparation, then the unit); every
launch through its plan (kernels/: config, grid and arguments fixed per shapes, strides, dtypes
and alignments; on a GPU, straight to the compiled launcher after the JIT's first launch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import settings
from ...kernels._common import fits_int32 as _fits_int32
from ...kernels._common import plan_cache as _plan_cache
from ...kernels._common import tf32_allowed as _tf32_allowed
from ...kernels.batch_stats import prepare_affine as _prepare_affine
from ...kernels.batch_stats import prepare_plan as _prepare_plan
from ...kernels.bn_relu_conv2d import forward_plan as _fwd_plan
from ...kernels.reductions import scale_shift as _scale_shift
from ...ops._backend import is_eager
from ...ops.opdefs import BackwardArgs, BatchNormArgs, UnitArgs
from .. import portable
from .plans import (
    BackwardPlan,
    backward_with,
    branch_scale_for_kernels,
    forward_portable_case,
    launch_forward,
    prepares,
)

# --------------------------------------------------------------------------- the eager route
# What the host does per step is counted (benchmarks/hostcost.py, tests/test_host_cost.py):
# each layer here is a Python call a step.

# The settings a backward plan depends on, read raw for its key (fusedres.settings.raw_lookup).
_ENV_GET, _ENV_KEYS = settings.raw_lookup("FUSEDRES_TRITON_BACKWARD", "FUSEDRES_TRITON_AUTOTUNE")
_MISSING = object()


class EagerTritonUnit(torch.autograd.Function):
    """The fused unit in eager mode: ``apply(plan, x, weight, bias, bn_weight, bn_bias, mean,
    invstd, residual, branch_scale, scale, shift, batch_stats)`` -> ``y`` or ``(y, mean, var)``
    (``plan.genstats``), with ``plan`` the forward's (kernels/bn_relu_conv2d.py's
    ``forward_plan`` for these tensors), ``residual`` in the weight's dtype, ``branch_scale``
    as the kernels read it (:func:`.plans.branch_scale_for_kernels`) and ``scale``, ``shift``
    the BatchNorm's affine.

    The autograd rule of fusedres.ops (:func:`fusedres.ops.unit_setup_context`,
    :func:`fusedres.ops.unit_backward`), with the affine kept beside what it keeps. Its
    backward runs the kernels bare on a plain gradient with grad mode off, through a
    :class:`BackwardPlan` the forward's plan keeps per gradient layout; else the public
    backward op (a double backward, batched gradients: fusedres.ops.bare_gradients's rule)."""

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
            # The statistics never take a gradient; materialised, each would be a zero fill
            # launched every backward (two a PreActBasicBlock step). None instead, as is y's
            # where nothing took it.
            ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad_out, *_stats_grads):
        if grad_out is None:  # nothing took y
            return (None,) * 13
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
        if forward_portable_case(args):
            return _public_unit(args, genstats)
        scale, shift = _scale_shift(args)
    else:
        scale, shift = affine
    if residual is not None and residual.dtype != weight.dtype:
        residual = residual.to(weight.dtype)  # differentiable: the gradient casts back
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read bias[co] at unit stride; differentiable
    if bscale is not None:
        bscale = branch_scale_for_kernels(bscale, weight)
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
        plan = _UNIT_PLANS[key] = None if forward_portable_case(args) else _fwd_plan(
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
_UNIT_PLANS: dict[tuple, object] = _plan_cache()


def eager_launches(args: UnitArgs, genstats: bool, affine, backward: BackwardArgs):
    """The launches of :class:`EagerTritonUnit`'s forward and backward for ``args`` and ``backward``
    given the preparation's ``affine``, without autograd (tools/jit_spec.py records them on
    meta tensors)."""
    launch_forward(args, genstats, *affine)
    return backward_with(backward, *affine)


# prepare_affine(x, *bn, mean=None, var=None) -> (mean, invstd, scale, shift), bn a
# BatchNormArgs: prepare_batch_norm that also makes the fused BatchNorm's (scale, shift) from
# bn.weight, bn.bias (in the statistics dtype, or None) in its launch (kernels/batch_stats.py's,
# with no layer here).
prepare_affine = _prepare_affine


class _ModuleCase:
    """What :func:`module_unit` runs for one key: the preparation's plan and the forward's."""

    __slots__ = ("prepare", "forward")

    def __init__(self, prepare, forward):
        self.prepare, self.forward = prepare, forward


# key -> _ModuleCase, or False for arguments left to the checked route. Cleared with the plans.
_MODULE_CASES: dict[tuple, object] = _plan_cache()


def _module_case(x, weight, bias, bn: BatchNormArgs, residual, stride, padding, dilation):
    """A :class:`_ModuleCase` for these arguments, or False for those :func:`module_unit`
    leaves to the checked route: after the checks of the Python route (fusedres.functional,
    whose errors name the argument: raised here, before anything is touched), what the
    preparation and the kernels take: statistics of 16- or 32-bit x, the BatchNorm's affine in
    the statistics dtype, a residual in the weight's dtype, autocast off, offsets the kernels
    index."""
    from ...ops.checks import check_batch_norm_args, check_conv_args

    check_conv_args(x, weight, bias, residual, stride, padding, dilation)
    check_batch_norm_args(x, bn)
    sdt = torch.float32
    takes = (not torch.is_autocast_enabled(x.device.type) and x.dtype != torch.float64
             and all(t is None or t.dtype == sdt for t in (bn.weight, bn.bias))
             and (residual is None or residual.dtype == weight.dtype)
             and prepares(x, bn.running_mean, bn.running_var, bn.training)
             and not forward_portable_case(UnitArgs(x, weight, bias, bn.weight, bn.bias, x, x,
                                                     residual, stride, padding, dilation, True)))
    if not takes:
        return False
    prepare = _prepare_plan(x, *bn[2:], False, bn.weight, bn.bias, True)
    # The preparation's scale and shift are new (C,) tensors a step: allocator-aligned, as these.
    affine = torch.empty((2, x.shape[1]), device=x.device, dtype=sdt)
    forward = _fwd_plan(x, weight, bias, affine[0], affine[1], residual, stride, padding,
                        dilation, None, False, None)
    return _ModuleCase(prepare, forward)


def module_unit(x, weight, bias, *args) -> list[Tensor]:
    """A ``BNReLUConv2d``'s forward on the triton backend (the triton record's module_unit),
    with the C++ backends' ``module_unit`` arguments (fusedres.ops.opdefs.NAMESPACE_SCHEMAS):
    ``args`` the BatchNorm's :class:`BatchNormArgs` fields, then residual, stride, padding,
    dilation. The BatchNorm's preparation with its affine (one launch), then
    :class:`EagerTritonUnit`: ``[y]``, or ``[]`` with nothing touched for arguments it leaves
    to the checked route. The checks and the plans are made once per arguments' types, shapes,
    strides, dtypes, alignments and flags (:func:`_module_case`)."""
    # The BatchNorm by position: a BatchNormArgs made here would be a Python call a step.
    bn, (residual, stride, padding, dilation) = args[:8], args[8:]
    bn_affine, running, training = bn[:2], bn[2:5], bn[5]  # running: mean, var, count
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read bias[co] at unit stride; differentiable
    # Every type, shape, stride, dtype, device, alignment and flag the checks and the plans
    # read, in a loop (a helper function a tensor would be a Python call each a step).
    key = [*bn[5:], stride, padding, dilation, torch.is_autocast_enabled(x.device.type),
           _tf32_allowed(), torch.is_inference_mode_enabled()]
    for t in (x, weight, bias, residual, *bn[:5]):
        key.append(None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device,
                                           t.data_ptr() % 16, t.requires_grad,
                                           t.is_inference()))
    key = tuple(key)
    case = _MODULE_CASES.get(key)
    if case is None:
        case = _MODULE_CASES[key] = _module_case(x, weight, bias, BatchNormArgs(*bn), residual,
                                                 stride, padding, dilation)
    if case is False:
        return []
    mean, invstd, scale, shift = case.prepare.run(x, *running, None, None, *bn_affine)
    plan = case.forward
    if not torch.is_grad_enabled():
        return [plan.run(x, weight, scale, shift, bias, residual, None)]
    return [EagerTritonUnit.apply(plan, x, weight, bias, *bn_affine, mean, invstd, residual, None,
                                  scale, shift, training or running[0] is None)]
