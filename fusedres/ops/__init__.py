"""The public ``fusedres`` operators: registered from :data:`fusedres.ops.opdefs.SCHEMAS`, with
their fake kernels and the fused unit's autograd rule.

* ``fusedres::batch_stats(x) -> (mean, var)``: per-channel batch mean and biased variance over
  (N, H, W), in the statistics dtype (float32 for half inputs, else ``x.dtype``). Not
  differentiable: the fused backward accounts for the statistics' dependence on ``x``.
* ``fusedres::bn_relu_conv2d(...) -> y``: ``residual + branch_scale[n] * conv2d(relu(scale * x
  + shift), weight, bias)`` with ``scale = bn_weight * invstd`` and ``shift = bn_bias - mean *
  scale``. ``branch_scale`` (optional, (N,), floating): the per-sample factor of stochastic
  depth / drop-path (a Bernoulli draw divided by the keep probability), applied in the
  convolution's epilogue; it takes no gradient (the autograd rule returns None for it).
* ``fusedres::bn_relu_conv2d_genstats(...) -> (y, mean, var)``: the same ``y`` and, per output
  channel, its mean and biased variance: what the next BatchNorm needs (reduced in the
  convolution's epilogue on the triton and cuda backends). Not differentiable statistics.
* ``fusedres::bn_relu_conv2d_backward(...)``: gradients of x, weight, bias, bn_weight, bn_bias,
  recomputing the activation from ``x``. With ``batch_stats=True`` the gradient of ``x``
  includes the path through the batch statistics (training-mode BatchNorm). With
  ``branch_scale`` every gradient sees ``branch_scale[n] * grad_out[n]``.

Every op routes at run time to the backend in force (:mod:`fusedres.ops._backend`), whose module
implements the op under the same name with the same arguments. The autograd rule
(:func:`unit_setup_context`, :func:`unit_backward`) saves ``x``, the conv weight, the BN
parameters, the per-channel statistics and the (N,) branch scale when there is one, never the
normalised or activated tensor. The eager routes (:mod:`fusedres.ops._backend` decides which runs)
share that rule: the C++ backends' nodes (csrc/eager.h; :func:`eager_unit_of`), the triton
backend's ``EagerTritonUnit``, and :func:`direct_unit` for a backend's own ops (the traced
triton unit).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _backend, _extension  # noqa: F401 - fusedres._C loads before the ops are defined
from ._backend import backend_for, is_eager
from .checks import check_op_args
from .opdefs import (
    SCHEMAS,
    BackwardArgs,
    UnitArgs,
    arg_names,
    backward_outputs,
    out_memory_format,
    out_shape,
    stats_dtype,
)

__all__ = ["batch_stats", "bn_relu_conv2d", "bn_relu_conv2d_backward",
           "bn_relu_conv2d_genstats", "direct_unit", "eager_unit_of", "unit_backward",
           "unit_setup_context"]


def _define(name: str, routing_arg: str):
    """The public op ``fusedres::<name>``: checks every argument (the ops' contract,
    :func:`fusedres.ops.checks.check_op_args`), then runs the op of the same name of the backend in
    force for the device of the argument ``routing_arg`` (:func:`fusedres.ops._backend.backend_for`;
    the portable code for an empty batch: nothing for a kernel to do)."""
    index = arg_names(name).index(routing_arg)

    def impl(*args):
        check_op_args(name, args)
        x = args[index]
        ops = backend_for(x.device).ops if x.numel() else _backend.load("portable").ops
        return getattr(ops, name)(*args)

    impl.__name__ = name
    return torch.library.custom_op(f"fusedres::{name}", impl, mutates_args=(),
                                   schema=SCHEMAS[name])


batch_stats = _define("batch_stats", "x")
bn_relu_conv2d = _define("bn_relu_conv2d", "x")
bn_relu_conv2d_genstats = _define("bn_relu_conv2d_genstats", "x")
bn_relu_conv2d_backward = _define("bn_relu_conv2d_backward", "x")


# --------------------------------------------------------------------------- fake kernels
# Each checks every argument first, as the op does (check_op_args, in the op's words). A fake
# kernel runs for tracing and for meta tensors, and the dispatcher also picks it for a call
# whose arguments mix devices when one of them is on meta: without the checks such a call
# returned an uninitialised tensor on x's device (and a stride of 0 divided by zero).

@batch_stats.register_fake
def _(x):
    check_op_args("batch_stats", (x,))
    dt = stats_dtype(x.dtype)
    return x.new_empty((x.shape[1],), dtype=dt), x.new_empty((x.shape[1],), dtype=dt)


def _forward_fake(*inputs, op: str = "bn_relu_conv2d") -> Tensor:
    check_op_args(op, inputs)
    a = UnitArgs(*inputs)
    y = a.x.new_empty(out_shape(a.x, a.weight, a.stride, a.padding, a.dilation),
                      dtype=a.weight.dtype)
    return y.contiguous(memory_format=out_memory_format(a.x, a.weight))


bn_relu_conv2d.register_fake(_forward_fake)


@bn_relu_conv2d_genstats.register_fake
def _(*inputs):
    y = _forward_fake(*inputs, op="bn_relu_conv2d_genstats")
    dt = stats_dtype(y.dtype)
    return y, y.new_empty((y.shape[1],), dtype=dt), y.new_empty((y.shape[1],), dtype=dt)


@bn_relu_conv2d_backward.register_fake
def _(*inputs):
    check_op_args("bn_relu_conv2d_backward", inputs)
    a = BackwardArgs(*inputs)
    return backward_outputs(a.x, a.weight, a.mean, a.output_mask)


# --------------------------------------------------------------------------- autograd

def unit_setup_context(ctx, inputs, output, *extra: Tensor) -> None:
    """What the autograd rule keeps: x, the conv weight, the BN parameters and statistics, and
    the (N,) branch scale when there is one; then ``extra`` (a route's own, after them in
    ``ctx.saved_tensors``)."""
    a = inputs if type(inputs) is UnitArgs else UnitArgs(*inputs)
    ctx.save_for_backward(a.x, a.weight, a.bn_weight, a.bn_bias, a.mean, a.invstd,
                          a.branch_scale, *extra)
    ctx.geometry = (a.stride, a.padding, a.dilation)
    ctx.batch_stats = a.batch_stats
    ctx.has_bias = a.bias is not None
    ctx.has_residual = a.residual is not None


# Where each gradient goes among the op's inputs (UnitArgs order), looked up once.
_SLOT = {name: UnitArgs._fields.index(name)
         for name in ("x", "weight", "bias", "bn_weight", "bn_bias", "residual")}
_BACKWARD_SLOTS = tuple(_SLOT[n] for n in ("x", "weight", "bias", "bn_weight", "bn_bias"))


def unit_backward(ctx, grad_out, backward_op) -> tuple[Tensor | None, ...]:
    """The autograd rule of the fused unit for a ``ctx`` filled by :func:`unit_setup_context`:
    the gradients of its inputs (in :class:`UnitArgs` order), computed by ``backward_op`` (an
    op with the schema of ``bn_relu_conv2d_backward``).

    This and :func:`unit_setup_context` are the rule's one statement. The public ops and
    :func:`direct_unit` run it; two eager routes state it again in their own code, where a
    Python frame here would cost host time a step: the C++ backends' nodes (csrc/eager.h's
    UnitNode, PairNode, ShortcutNode) and the triton backend's ``EagerTritonUnit``. Tests pin
    each to it: tests/test_eager_cxx.py (the C++ unit node against the public op, bit for bit;
    the pair and shortcut nodes against their kernels and the public units) and
    tests/test_backend.py (EagerTritonUnit against the public ops, bit for bit, for each set of
    inputs that ask for a gradient)."""
    x, weight, bn_weight, bn_bias, mean, invstd, branch_scale = ctx.saved_tensors[:7]
    need = ctx.needs_input_grad
    mask = [need[_SLOT["x"]], need[_SLOT["weight"]], need[_SLOT["bias"]] and ctx.has_bias,
            need[_SLOT["bn_weight"]] and bn_weight is not None,
            need[_SLOT["bn_bias"]] and bn_bias is not None]
    grads: list[Tensor | None] = [None] * len(UnitArgs._fields)
    if any(mask):
        stride, padding, dilation = ctx.geometry
        outs = backward_op(*BackwardArgs(grad_out, x, weight, bn_weight, bn_bias, mean, invstd,
                                         stride, padding, dilation, ctx.batch_stats, mask,
                                         branch_scale))
        for slot, g, m in zip(_BACKWARD_SLOTS, outs, mask):
            if m:
                grads[slot] = g
    # mean and invstd are functions of x when batch_stats is set; their contribution is folded
    # into grad_x, so they take no gradient of their own. The residual's gradient is grad_out
    # (not scaled). branch_scale takes none: a random draw over the keep probability.
    if ctx.has_residual and need[_SLOT["residual"]]:
        grads[_SLOT["residual"]] = grad_out
    return tuple(grads)


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


# --------------------------------------------------------------------------- the direct route

def direct_unit(name: str, forward, forward_genstats, backward, *,
                eager: bool = False) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` class called ``name`` running the fused unit on one backend's ops
    (``forward``, ``forward_genstats``, ``backward``: ops with the schemas of
    ``bn_relu_conv2d``, ``_genstats`` and ``_backward``) with the public ops' autograd rule.
    ``eager``: ``forward`` and ``backward`` run the kernels bare, for eager tensors (the caller
    checks the inputs: fusedres.ops._backend.route); the backward then calls ``backward`` only on a
    plain gradient with grad mode off, else the public backward op.
    ``apply(*UnitArgs, genstats)`` returns ``y``, or ``(y, mean, var)`` when ``genstats`` (last,
    so that ``ctx.needs_input_grad`` lines up with :class:`UnitArgs`)."""

    def forward_fn(ctx, *inputs_and_genstats):
        *inputs, genstats = inputs_and_genstats
        # The ctx-first form: with a separate setup_context, apply() binds the arguments with
        # inspect.signature on every call (~20 us).
        unit_setup_context(ctx, inputs, None)
        if not genstats:
            return forward(*inputs)
        y, mean, var = forward_genstats(*inputs)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    def backward_fn(ctx, grad_out, *_stats_grads):
        # With ``eager``, ``backward`` runs the kernels bare only where :func:`_bare` allows.
        op = backward
        if eager and not bare_gradients(grad_out):
            op = torch.ops.fusedres.bn_relu_conv2d_backward
        return (*unit_backward(ctx, grad_out, op), None)  # genstats takes no gradient

    # Built with type() so that the class, and its grad_fn (``<name>Backward``), carry the name.
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward_fn), "backward": staticmethod(backward_fn),
        "__doc__": f"The fused unit on {forward} and its backward (fusedres.ops.direct_unit)."})


def eager_unit_of(op):
    """The route's ``unit(args, genstats, affine)`` over ``op``, a C++ backend's ``eager_unit``
    op (csrc/eager.h: the rule of :func:`unit_setup_context` and :func:`unit_backward` as a
    C++ autograd node, no Python frame in forward or backward): ``y``, or ``(y, mean, var)`` of
    y when ``genstats``; ``affine`` is not used (the C++ kernels make it)."""
    def unit(args: UnitArgs, genstats: bool, affine=None):
        y, mean, var = op(*args, genstats)
        return (y, mean, var) if genstats else y
    return unit


def bare_gradients(*grads: Tensor | None) -> bool:
    """Whether an eager route's backward may run the backend's kernels on ``grads`` bare: grad
    mode off (not a backward that builds a graph, ``create_graph=True``: the kernels' outputs
    would have none) and eager tensors (:func:`fusedres.ops._backend.is_eager`: not the batched
    gradients of ``is_grads_batched`` or vmap, no dispatch mode). Otherwise the public backward
    op runs it: its layers batch, trace, and refuse a double backward as the public route does."""
    if torch.is_grad_enabled():
        return False
    for g in grads:
        if g is not None and not is_eager(g):
            return False
    return True
