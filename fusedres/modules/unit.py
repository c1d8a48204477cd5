"""The fused unit: ``conv(relu(bn(x))) + residual`` as one op, and the layers blocks run it by.

:class:`BNReLUConv2d` is the drop-in module (submodules ``bn`` and ``conv``, the plain modules'
state_dict keys). The functions below run a BatchNorm -> ReLU -> conv chain on a block's own
``nn.BatchNorm2d`` and ``nn.Conv2d`` submodules: :func:`prepare` (the statistics pass and
running-statistics update, once), :func:`conv` and :func:`conv_into` (the fused convolution),
the pairs that run a unit's shortcut beside its first convolution, and the checks that refuse
what the fused op cannot run before any state changes. :data:`FUSED` and :data:`PLAIN` are
the swappable layers (:class:`BNReLUConvLayer`) a residual block
(:mod:`fusedres.modules.blocks`) runs its chains through.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import functional as FR
from ..distributed import prepare_batch_norm_sync
from ..ops._backend import route
from ..ops.opdefs import suggests_channels_last
from .variants import scaled


def _synchronised(bn: nn.BatchNorm2d) -> bool:
    return isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized()


def wants_stats(bn: nn.BatchNorm2d | None) -> bool:
    """Whether ``prepare(bn, x, stats)`` would use the local batch statistics of ``x`` (a
    training-mode BatchNorm that is not synchronised): then the producer of ``x`` should return
    them (``conv(..., return_stats=True)``)."""
    return (bn is not None and (bn.training or bn.running_mean is None)
            and getattr(bn, "fused_prepare", None) is None and not _synchronised(bn))


def prepare(bn: nn.BatchNorm2d, x: Tensor, stats=None) -> FR.BatchNormState:
    """Statistics and running-stats update of ``bn`` for input ``x`` (one pass, once).

    ``stats``: the batch (mean, biased variance) of ``x`` when its producer computed them
    (:func:`conv` with ``return_stats=True``); then no statistics pass runs.
    A BatchNorm with a ``fused_prepare(x)`` method (``fusedres.distributed.SyncBatchNorm2d``)
    prepares itself; an ``nn.SyncBatchNorm`` in a running process group synchronises its
    statistics across processes (``fusedres.distributed.prepare_batch_norm_sync``); both ignore
    ``stats``.
    """
    custom = getattr(bn, "fused_prepare", None)
    if custom is not None:
        return custom(x)
    if _synchronised(bn):
        return prepare_batch_norm_sync(x, bn, bn.process_group)
    return FR.prepare(FR.batch_norm_args(bn), x, stats)


def check_convs(*convs: nn.Conv2d | None) -> None:
    """Refuse convolutions the fused op cannot run, before any BatchNorm state changes."""
    for c in convs:
        if c is None:
            continue
        if c.groups != 1:
            raise ValueError(f"conv.groups: fusedres supports groups=1, got {c.groups}")
        if c.padding_mode != "zeros":
            raise ValueError(
                f"conv.padding_mode: fusedres supports 'zeros', got {c.padding_mode!r}")


def check_inputs(x: Tensor, *convs: nn.Conv2d | None) -> None:
    """Everything that could make ``conv(prepare(bn, x), c)`` fail for the convs ``x`` feeds,
    checked before ``prepare`` touches the running statistics."""
    check_convs(*convs)
    for c in convs:
        if c is not None:
            FR.check_conv_args(x, c.weight, c.bias, None, c.stride, c.padding, c.dilation)


def conv(state: FR.BatchNormState, conv: nn.Conv2d, residual: Tensor | None = None,
         return_stats: bool = False, branch_scale: Tensor | None = None):
    """``branch_scale[n] * conv(relu(bn(x))) + residual`` through the fused op (the per-sample
    scale applied in its residual epilogue and its backward), for a prepared BatchNorm; with
    ``return_stats`` also the batch statistics of the output (see
    :func:`fusedres.functional.conv2d_from_prepared`)."""
    check_convs(conv)
    return FR.conv2d_from_prepared(state, conv.weight, conv.bias, stride=conv.stride,
                                   padding=conv.padding, dilation=conv.dilation,
                                   residual=residual, return_stats=return_stats,
                                   branch_scale=branch_scale)


def conv_into(state: FR.BatchNormState, c: nn.Conv2d, bn: nn.BatchNorm2d) -> FR.BatchNormState:
    """``prepare(bn, conv(state, c))``: the output's statistics come from the convolution
    (its epilogue on the Triton backend) whenever ``bn`` uses local batch statistics."""
    if wants_stats(bn):
        out, stats = conv(state, c, return_stats=True)
        return prepare(bn, out, stats)
    return prepare(bn, conv(state, c))


def concatenable(a: nn.Conv2d, b: nn.Conv2d) -> bool:
    """Whether two convolutions of one input can run as one, on their weights stacked along the
    output channels: the same kernel, stride, padding and dilation, both with or both without
    a bias, one dtype and device."""
    return (a.kernel_size == b.kernel_size and a.stride == b.stride and a.padding == b.padding
            and a.dilation == b.dilation and (a.bias is None) == (b.bias is None)
            and a.weight.dtype == b.weight.dtype and a.weight.device == b.weight.device)


def shared_conv_into(state: FR.BatchNormState, short: nn.Conv2d, first: nn.Conv2d,
                     bn: nn.BatchNorm2d) -> tuple[Tensor, FR.BatchNormState]:
    """``(short(a), prepare(bn, first(a)))`` for ``a = relu(bn_in(x))`` prepared in ``state``, as
    ONE fused convolution on the two weights stacked (:func:`concatenable` convolutions: the
    strided projection shortcut and first 1x1 of a bottleneck with the stride on conv1, He et
    al.'s CIFAR units). One BN-ReLU of ``x``, one backward over ``x`` (recompute,
    ReLU mask and BatchNorm sums, data gradient) instead of two and their sum; the gradients of
    both weights come back through ``torch.cat``. ``first``'s output is copied out of the
    stacked one (it is what the next fused op saves, and a view would keep the shortcut's
    channels alive with it); the shortcut's stays a view, read once as the last convolution's
    residual. ``bn``'s statistics come from the stacked convolution, as in :func:`conv_into`."""
    w = torch.cat([short.weight, first.weight])
    bias = None if short.bias is None else torch.cat([short.bias, first.bias])
    stats = wants_stats(bn)
    y = FR.conv2d_from_prepared(state, w, bias, stride=first.stride, padding=first.padding,
                                dilation=first.dilation, return_stats=stats)
    if stats:
        y, stats = y
    cs = short.out_channels
    h, f = torch.split(y, [cs, first.out_channels], dim=1)
    fmt = torch.channels_last if suggests_channels_last(y) else torch.contiguous_format
    f = f.contiguous(memory_format=fmt)
    return h, prepare(bn, f, None if not stats else (stats[0][cs:], stats[1][cs:]))


def paired_conv_into(state: FR.BatchNormState, short: nn.Conv2d, first: nn.Conv2d,
                     bn: nn.BatchNorm2d) -> tuple[Tensor, FR.BatchNormState]:
    """``(short(a), prepare(bn, first(a)))`` for ``a = relu(bn_in(x))`` prepared in ``state``,
    through :func:`fusedres.functional.conv2d_pair_from_prepared`: on the cpu backend one
    autograd node whose backward passes over ``x`` once (for the convolutions that cannot be
    stacked: a 1x1 projection beside a 3x3, or beside an unstrided 1x1 when the shortcut
    strides); elsewhere the two fused convolutions."""
    x = state.x
    geometry = [FR.check_conv_args(x, c.weight, c.bias, None, c.stride, c.padding, c.dilation)
                for c in (short, first)]
    stats = wants_stats(bn)
    h, f = FR.conv2d_pair_from_prepared(state, short.weight, short.bias, geometry[0],
                                        first.weight, first.bias, geometry[1],
                                        return_stats=stats)
    return h, (prepare(bn, *f) if stats else prepare(bn, f))


def shortcut_conv_into(state: FR.BatchNormState, first: nn.Conv2d,
                       bn: nn.BatchNorm2d) -> tuple[Tensor, FR.BatchNormState]:
    """``(x, prepare(bn, first(a)))`` for ``a = relu(bn_in(x))`` prepared in ``state``: a
    pre-activation unit's identity shortcut and first convolution, through
    :func:`fusedres.functional.conv2d_with_shortcut_from_prepared` (on the cpu backend the
    shortcut's gradient is summed into x's in the convolution's data-gradient pass)."""
    geometry = FR.check_conv_args(state.x, first.weight, first.bias, None, first.stride,
                                  first.padding, first.dilation)
    stats = wants_stats(bn)
    short, f = FR.conv2d_with_shortcut_from_prepared(state, first.weight, first.bias, geometry,
                                                     return_stats=stats)
    return short, (prepare(bn, *f) if stats else prepare(bn, f))


# --------------------------------------------------------------------------- the layers

class BNReLUConvLayer:
    """How a block runs a BatchNorm -> ReLU -> conv chain (``bn`` None: ReLU -> conv).

    ``act(bn, x, stats)`` prepares ``relu(bn(x))`` (the BatchNorm's statistics pass and running
    statistics update, once, however many convolutions read it); ``conv(a, conv, residual,
    branch_scale, return_stats)`` is ``branch_scale[n] * conv(a) + residual``; ``conv_into(a,
    conv, bn)`` is ``act(bn, conv(a))``; ``check(x, *convs)`` raises before ``act`` changes any
    state if the convolutions cannot run on ``x``. ``fused`` says which kind it is.
    """

    fused: bool = False

    def act(self, bn: nn.Module | None, x: Tensor, stats=None):
        raise NotImplementedError

    def conv(self, a, conv: nn.Conv2d, residual: Tensor | None = None,
             branch_scale: Tensor | None = None, return_stats: bool = False):
        raise NotImplementedError

    def conv_into(self, a, conv: nn.Conv2d, bn: nn.Module | None):
        return self.act(bn, self.conv(a, conv))

    def check(self, x: Tensor, *convs: nn.Conv2d | None) -> None:
        pass

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class PlainBNReLUConv(BNReLUConvLayer):
    """``conv(relu(bn(x)))`` as PyTorch runs it: every intermediate is kept for backward."""

    fused = False

    def act(self, bn, x, stats=None):
        return F.relu(bn(x) if bn is not None else x)

    def conv(self, a, conv, residual=None, branch_scale=None, return_stats=False):
        y = scaled(conv(a), branch_scale)
        y = y if residual is None else residual + y
        return (y, None) if return_stats else y


class FusedBNReLUConv(BNReLUConvLayer):
    """The fused op: ``relu(bn(x))`` is never stored; backward recomputes it from ``x``.

    A ReLU -> conv chain without BatchNorm (``bn`` None: ``norm="none"``, the first ReLU of a
    ReLU-only pre-activation unit) runs as PyTorch runs it: PyTorch's ReLU keeps only its
    output, which the convolution keeps anyway, so fusing it would save nothing (measured:
    benchmarks/MEMORY.md, the variants' table) and cost the recomputation."""

    fused = True

    def act(self, bn, x, stats=None):
        return prepare(bn, x, stats) if bn is not None else F.relu(x)

    def conv(self, a, c, residual=None, branch_scale=None, return_stats=False):
        if isinstance(a, Tensor):  # a ReLU without BatchNorm: plain
            return PLAIN.conv(a, c, residual, branch_scale, return_stats)
        return conv(a, c, residual=residual, return_stats=return_stats, branch_scale=branch_scale)

    def conv_into(self, a, c, bn):
        if bn is None:
            return F.relu(self.conv(a, c))
        if isinstance(a, Tensor):
            return prepare(bn, c(a))
        return conv_into(a, c, bn)

    def check(self, x, *convs):
        check_inputs(x, *convs)


FUSED = FusedBNReLUConv()
PLAIN = PlainBNReLUConv()


# --------------------------------------------------------------------------- BNReLUConv2d

class BNReLUConv2d(nn.Module):
    """``conv(relu(bn(x))) + residual`` in one fused op.

    Submodules ``bn`` (``nn.BatchNorm2d(in_channels)``) and ``conv`` (``nn.Conv2d``), with the
    usual meanings of every argument. ``forward(x, residual=None)``: x (N, C, H, W), residual
    (N, out_channels, Ho, Wo).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, bias: bool = False, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.bn = nn.BatchNorm2d(in_channels, eps, momentum, affine, track_running_stats, **kw)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              bias=bias, **kw)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        bn, c = self._modules["bn"], self._modules["conv"]
        if (type(bn) is nn.BatchNorm2d and type(c) is nn.Conv2d and c.groups == 1
                and c.padding_mode == "zeros" and type(c.padding) is tuple
                and (bn.momentum is None or type(bn.momentum) is float)):
            # The backend's forward in one call, where it has one (fusedres.ops._backend), on
            # the plain modules' tensors read from their dicts (Module.__getattr__ would be a
            # Python call each, ten a step); bn's BatchNormArgs unpacked into it, as its schema
            # takes them. It returns [y], or [] with nothing touched for arguments it leaves to
            # the checked route below (whose errors name the argument).
            w = c._parameters["weight"]
            module_unit = route(x, w).module_unit
            if module_unit is not None:
                out = module_unit(x, w, c._parameters["bias"], *FR.BN_PARAMETERS(bn._parameters),
                                  *FR.BN_BUFFERS(bn._buffers), bn.training, bn.momentum, bn.eps,
                                  residual, c.stride, c.padding, c.dilation)
                if out:
                    return out[0]
        # The checked route: the convolution's arguments first, before prepare touches the
        # running statistics (given their geometry, conv2d_from_prepared does not check them
        # again).
        check_convs(c)
        geometry = FR.check_conv_args(x, c.weight, c.bias, residual, c.stride, c.padding,
                                      c.dilation)
        state = prepare(bn, x)
        return FR.conv2d_from_prepared(state, c.weight, c.bias, residual=residual,
                                       geometry=geometry)
