"""The Triton backend's launches, planned: what a call launches, fixed once per its tensors'
shapes, strides, dtypes and alignments (kernels/: config, grid and integer arguments).

:func:`launch_forward` and :func:`backward_with` are the forward's and the backward's launches
for one call, what the ``fusedres_triton`` ops' bodies run (:mod:`.ops`); :class:`BackwardPlan`
fixes the backward's for a key, which the eager route (:mod:`.eager`) keeps per gradient layout;
:func:`backward_strategy` chooses the backward's form; :func:`prepares` says whether the
preparation's kernel takes a BatchNorm; the cases the kernels leave to the portable code
(empty tensors, offsets past int32) are :func:`portable_case` and
:func:`forward_portable_case`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import settings
from ...kernels import bn_relu_conv2d_dgrad as _dgrad
from ...kernels import bn_relu_conv2d_wgrad as _wgrad
from ...kernels._common import fits_int32
from ...kernels.batch_stats import prepare_unsupported as _prepare_unsupported
from ...kernels.bn_relu_conv2d import forward_plan
from ...kernels.reductions import scale_shift
from ...ops.opdefs import BackwardArgs, UnitArgs, backward_outputs, out_shape


def branch_scale_for_kernels(branch_scale: Tensor | None, weight: Tensor) -> Tensor | None:
    """The (N,) branch scale as the kernels read it: contiguous, in the accumulator dtype."""
    if branch_scale is None:
        return None
    return branch_scale.to(torch.float64 if weight.dtype == torch.float64
                           else torch.float32).contiguous()


def launch_forward(u: UnitArgs, genstats: bool, scale=None, shift=None, merge=None):
    """The forward's launches (its plan cached per shapes, strides, dtypes and alignments);
    ``scale``, ``shift``: the BatchNorm's affine when the preparation made it (else one
    launch makes it here). ``merge``: the genstats rows merged in the forward's launch (None:
    on plain and meta tensors; False: by a launch of their own, what the triton_ops' bodies
    run, eager or traced: a graph cannot hold the counts the in-kernel merge needs)."""
    if scale is None:
        scale, shift = scale_shift(u)
    residual = u.residual
    if residual is not None and residual.dtype != u.weight.dtype:
        residual = residual.to(u.weight.dtype)
    bscale = u.branch_scale
    if bscale is not None:
        bscale = branch_scale_for_kernels(bscale, u.weight)
    bias = u.bias  # the kernels read bias[co] at unit stride (a strided one read other values)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    plan = forward_plan(u.x, u.weight, bias, scale, shift, residual, u.stride, u.padding,
                     u.dilation, None, genstats, bscale, merge)
    return plan.run(u.x, u.weight, scale, shift, bias, residual, bscale)


def backward_with(b: BackwardArgs, scale: Tensor, shift: Tensor, strategy: str | None = None):
    """The backward's launches for ``b`` given the BatchNorm's affine (``scale``, ``shift``)
    and, when known, the strategy (:func:`backward_strategy`): a :class:`BackwardPlan` built for
    this call (the eager route keeps its plans, :class:`EagerTritonUnit`)."""
    bscale = b.branch_scale
    if bscale is not None:
        bscale = branch_scale_for_kernels(bscale, b.weight)
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
        from ...kernels import traffic

        elem = weight.element_size()
        picked = _AUTO_STRATEGY[key] = traffic.auto_strategy(traffic.Unit(
            "auto", int(n), int(c), max(1, round((h * w) ** 0.5)), int(co),
            k=max(1, round((kh * kw) ** 0.5)), stride=int(stride[0]),
            elem=elem if elem in (2, 4, 8) else 4))
    return picked


_AUTO_STRATEGY: dict[tuple, str] = {}  # the model's pick per shape (a pure function of it)


# --------------------------------------------------------------------------- the portable cases
# Cases the kernels leave to the portable code (empty tensors, offsets past int32, the kernels'
# index type).

def portable_case(*tensors) -> bool:
    return any(t is not None and t.numel() == 0 for t in tensors) or not fits_int32(*tensors)


def forward_portable_case(u: UnitArgs) -> bool:
    # y is dense (either layout): its largest element offset is numel - 1.
    return (portable_case(u.x, u.weight, u.residual)
            or math.prod(out_shape(u.x, u.weight, u.stride, u.padding, u.dilation)) > 2**31)


def prepares(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
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
            not portable_case(x)
            and _prepare_unsupported(x, running_mean, running_var, training) is None)
    return takes


_PREPARES: dict[tuple, bool] = {}  # a pure function of its key

