"""Drop-in modules. Parameters, buffers and state_dict keys are those of the plain PyTorch blocks
(``nn.BatchNorm2d`` and ``nn.Conv2d`` submodules), so checkpoints move both ways.

Blocks are built from swappable layers, as timm's take ``norm_layer``: a residual block runs its
BatchNorm -> ReLU -> conv chains through the *layer* it is given, :data:`FUSED` (one fused op per
chain, nothing but the chain's input kept for backward) or :data:`PLAIN` (``nn.BatchNorm2d``,
``F.relu`` and ``nn.Conv2d`` as PyTorch runs them). Fused and plain are one block class with one
forward; ``fused=True/False`` picks the layer.

The blocks implement He et al.'s unit orderings (``unit=``, "Identity Mappings in Deep Residual
Networks", 2016, Fig. 4) and shortcut variants (``shortcut=``, Table 1 / Fig. 2), plain units
without shortcuts (``shortcut="none"``), units without normalisation (``norm="none"``) and
stochastic depth (``drop_path=``, Huang et al. 2016; ``drop_path_mode="row"``, ``"batch"`` or
``"batch_skip"``).
Every BatchNorm -> ReLU -> conv chain of every variant runs through the layer (so fused when the
layer is); the rest of a variant (a BatchNorm with no ReLU -> conv after it, a post-addition
ReLU, a gate) is plain PyTorch: :attr:`ResidualBlock.plain_parts` lists it.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import functional as FR
from ..distributed import prepare_batch_norm_sync
from ..ops.opdefs import UnitArgs, suggests_channels_last
from ..ops.route import route
from . import variants as V
from .variants import scaled

__all__ = ["BNReLUConv2d", "BasicBlock", "Bottleneck", "BNReLUConvLayer", "DROP_PATH_MODES",
           "FUSED", "FusedBNReLUConv", "NORMS", "PLAIN", "PlainBNReLUConv",
           "PreActBasicBlock", "PreActBottleneck", "ResidualBlock", "SHORTCUTS", "UNITS"]

# He et al. 2016, Fig. 4: (a) original, (b) BN after addition, (c) ReLU before addition,
# (d) ReLU-only pre-activation, (e) full pre-activation.
UNITS = ("preact", "original", "bn_after_add", "relu_before_add", "relu_only_preact")
# He et al. 2016, Fig. 2 / Table 1, and "none": no shortcut at all (a plain network).
SHORTCUTS = ("identity", "scale", "exclusive_gate", "shortcut_gate", "conv1x1", "dropout", "none")
# "row": one draw per sample. "batch": one draw per mini-batch, applied on the device (the branch
# runs and is scaled by 0 or 1/keep: no device-to-host sync, so a step can be captured in a CUDA
# graph or compiled whole). "batch_skip": one draw per mini-batch read on the host, and a dropped
# unit computes no branch (Huang et al.'s saving; one device-to-host sync per unit a step).
DROP_PATH_MODES = ("batch", "row", "batch_skip")
NORMS = ("batch", "none")


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
    return FR.prepare_batch_norm(
        x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
        training=bn.training, momentum=bn.momentum, eps=bn.eps, stats=stats,
    )


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


def _concatenable(a: nn.Conv2d, b: nn.Conv2d) -> bool:
    """Whether two convolutions of one input can run as one, on their weights stacked along the
    output channels: the same kernel, stride, padding and dilation, both with or both without
    a bias, one dtype and device."""
    return (a.kernel_size == b.kernel_size and a.stride == b.stride and a.padding == b.padding
            and a.dilation == b.dilation and (a.bias is None) == (b.bias is None)
            and a.weight.dtype == b.weight.dtype and a.weight.device == b.weight.device)


def shared_conv_into(state: FR.BatchNormState, short: nn.Conv2d, first: nn.Conv2d,
                     bn: nn.BatchNorm2d) -> tuple[Tensor, FR.BatchNormState]:
    """``(short(a), prepare(bn, first(a)))`` for ``a = relu(bn_in(x))`` prepared in ``state``, as
    ONE fused convolution on the two weights stacked (:func:`_concatenable` convolutions: the
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


def _has_no_data(x: Tensor) -> bool:
    """A meta or fake tensor (the planner's simulated step): no value to branch on."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


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
        c, bn = self._modules["conv"], self._modules["bn"]
        if (type(bn) is nn.BatchNorm2d and type(c) is nn.Conv2d and c.groups == 1
                and c.padding_mode == "zeros" and type(c.padding) is tuple
                and (bn.momentum is None or type(bn.momentum) is float)):
            # Plain modules: their tensors read from their dicts, as Module.__getattr__ finds
            # them (a Python call each that way, ten a step).
            cp, bp, bb = c._parameters, bn._parameters, bn._buffers
            module_unit = route(x, cp["weight"]).module_unit
            if module_unit is not None:
                # One call (fusedres.ops.route); [] leaves these arguments to the checked route.
                out = module_unit(x, cp["weight"], cp["bias"], bp["weight"], bp["bias"],
                                  bb["running_mean"], bb["running_var"],
                                  bb["num_batches_tracked"], bn.training, bn.momentum, bn.eps,
                                  residual, c.stride, c.padding, c.dilation)
                if out:
                    return out[0]
        check_convs(c)
        geometry = FR.check_conv_args(x, c.weight, c.bias, residual, c.stride, c.padding,
                                      c.dilation)
        # The convolution's arguments are checked (before prepare touches the running stats):
        # given their geometry, conv2d_from_prepared does not check them again.
        return FR.conv2d_from_prepared(prepare(self.bn, x), c.weight, c.bias, residual=residual,
                                       geometry=geometry)


# --------------------------------------------------------------------------- residual blocks

def _choice(value, name: str, options) -> str:
    if value not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, "
                         f"got {value!r}")
    return value


class ResidualBlock(nn.Module):
    """A residual unit of He et al.: a chain of convolutions (the residual branch ``F``) and a
    shortcut ``h``, combined as ``unit`` orders them. Subclasses give the convolutions.

    Arguments (keyword-only after ``stride``):

    - ``unit``: one of :data:`UNITS`. ``"preact"`` (default): (BN-ReLU-conv) x k, then
      ``y = h(x) + F``. ``"original"`` (He et al. 2015): conv-BN-ReLU ... conv-BN, add, ReLU.
      ``"bn_after_add"``: conv-BN-ReLU ... conv, add, BN-ReLU. ``"relu_before_add"``: conv-BN-ReLU
      ... conv-BN-ReLU, add. ``"relu_only_preact"``: ReLU-conv-BN-ReLU ... conv-BN, add.
    - ``shortcut``: one of :data:`SHORTCUTS`, applied in units that keep the input's shape (a
      unit that changes width or stride has the 1x1 projection, except with ``"none"``):
      ``"identity"`` h = x; ``"scale"`` h = ``scale * x`` and, with ``scale_branch``, F scaled by
      ``1 - scale``; ``"exclusive_gate"`` y = (1 - g) x + g F and ``"shortcut_gate"`` y = (1 - g)
      x + F with g = sigmoid(1x1 conv of x, bias initialised to ``gate_bias``); ``"conv1x1"`` h =
      the 1x1 projection; ``"dropout"`` h = dropout(x, ``shortcut_dropout``); ``"none"`` y = F.
      ``scale`` (0.5), ``scale_branch`` (False), ``gate_bias`` (-6.0), ``shortcut_dropout`` (0.5)
      are refused with any other shortcut.
    - ``norm``: ``"batch"`` (BatchNorm) or ``"none"`` (no normalisation; convolutions get a bias).
    - ``drop_path``: probability of dropping the branch in training (stochastic depth);
      ``drop_path_mode`` ``"row"`` draws per sample (timm's DropPath, torchvision's
      ``StochasticDepth(mode="row")``), ``"batch"`` and ``"batch_skip"`` once for the whole
      batch (torchvision's ``mode="batch"``). ``"batch"`` decides on the device: the branch
      always runs and is scaled by the draw, 0 or ``1 / (1 - drop_path)``, so a step has no
      device-to-host sync and issues the same kernels whatever is drawn (CUDA graphs,
      ``torch.compile(fullgraph=True)``). What that costs when the unit is dropped: the
      branch's forward and backward compute and its saved activations (a kept unit's, which
      the memory planner assumes for both modes anyway); its BatchNorms' running statistics
      are updated from the batch; its parameters get zero gradients rather than none, so SGD's
      weight decay and momentum still move them (as in Huang et al.'s Torch code, whose
      optimizer steps every parameter); and a non-finite branch output gives NaN (0 * inf)
      where skipping gives the shortcut. ``"batch_skip"`` reads the draw on the host (one
      device-to-host sync per unit a step) and a dropped unit computes no branch, updates none
      of its BatchNorms and keeps nothing for backward (Huang et al.'s saving; not
      capturable). The kept branch is scaled by ``1 / (1 - drop_path)`` in training, as
      torchvision's ``stochastic_depth`` does, so eval uses the unit unchanged. Draws:
      ``torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1 - drop_path)``, as
      torchvision draws them; the three modes consume the random stream alike.
    - ``layer``: a :class:`BNReLUConvLayer`; default :data:`FUSED` if ``fused`` else
      :data:`PLAIN`.

    Submodules (state_dict keys): pre-activation units ``bn{i}`` before ``conv{i}``; the others
    ``conv{i}`` then ``bn{i}`` (``bn_after_add``: the last ``bn`` after the addition); a
    projection ``shortcut`` (1x1 conv; in post-activation units followed by ``shortcut_bn``), a
    ``gate``. In a pre-activation unit the projection reads the first BN-ReLU (one statistics
    pass for both convolutions).
    """

    expansion = 1

    def __init__(self, convs, in_planes: int, out_planes: int, stride: int, *, fused: bool = True,
                 layer: BNReLUConvLayer | None = None, unit: str = "preact",
                 shortcut: str = "identity", scale: float | None = None,
                 scale_branch: bool | None = None, gate_bias: float | None = None,
                 shortcut_dropout: float | None = None, norm: str = "batch",
                 drop_path: float = 0.0, drop_path_mode: str = "row"):
        super().__init__()
        self.unit = _choice(unit, "unit", UNITS)
        self.shortcut_kind = _choice(shortcut, "shortcut", SHORTCUTS)
        self.norm = _choice(norm, "norm", NORMS)
        self.drop_path_mode = _choice(drop_path_mode, "drop_path_mode", DROP_PATH_MODES)
        if layer is None:
            layer = FUSED if fused else PLAIN
        if not isinstance(layer, BNReLUConvLayer):
            raise TypeError(f"layer: expected a fusedres.modules.BNReLUConvLayer, got "
                            f"{type(layer).__name__}")
        self.layer = layer
        self._check_shortcut_args(scale, scale_branch, gate_bias, shortcut_dropout)
        self.scale = 0.5 if scale is None else float(scale)
        self.scale_branch = bool(scale_branch)
        self.gate_bias = -6.0 if gate_bias is None else float(gate_bias)
        self.shortcut_dropout = 0.5 if shortcut_dropout is None else float(shortcut_dropout)
        self.drop_path = drop_path  # validated by the property setter
        if self.shortcut_kind == "none" and self.drop_path > 0:
            raise ValueError("drop_path: a unit without shortcut (shortcut='none') cannot drop "
                             "its branch; expected 0")

        bias = self.norm == "none"
        preact = self.unit == "preact"
        # Registered in forward order (bn1, conv1, ... pre-activation; conv1, bn1, ... else):
        # the order of parameters() that optimizers' state and initialisation follow.
        for i, (cin, cout, k, s) in enumerate(convs, 1):
            bn = nn.BatchNorm2d(cin if preact else cout) if self.norm == "batch" else None
            if preact:
                setattr(self, f"bn{i}", bn)
            setattr(self, f"conv{i}", nn.Conv2d(cin, cout, k, s, k // 2, bias=bias))
            if not preact:
                setattr(self, f"bn{i}", bn)
        self.num_convs = len(convs)
        # The shortcut: the projection where the shape changes, else the chosen variant.
        self.projects = stride != 1 or in_planes != out_planes
        if self.projects and self.shortcut_kind not in ("none",):
            kind = "projection"
        else:
            kind = self.shortcut_kind
        self.path = kind  # what h(x) does in this unit
        self.shortcut = None
        self.shortcut_bn = None
        self.gate = None
        if kind in ("projection", "conv1x1"):
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride, bias=bias)
            if not preact and self.norm == "batch":
                self.shortcut_bn = nn.BatchNorm2d(out_planes)
        elif kind in ("exclusive_gate", "shortcut_gate"):
            self.gate = nn.Conv2d(in_planes, out_planes, 1, bias=True)
            nn.init.constant_(self.gate.bias, self.gate_bias)

    # ------------------------------------------------------------------ set-up

    def _check_shortcut_args(self, scale, scale_branch, gate_bias, shortcut_dropout) -> None:
        kind = self.shortcut_kind
        for value, name, owner in ((scale, "scale", ("scale",)),
                                   (scale_branch, "scale_branch", ("scale",)),
                                   (gate_bias, "gate_bias", ("exclusive_gate", "shortcut_gate")),
                                   (shortcut_dropout, "shortcut_dropout", ("dropout",))):
            if value is not None and kind not in owner:
                raise ValueError(f"{name}: only the shortcut {' or '.join(map(repr, owner))} "
                                 f"takes it, got shortcut={kind!r}")
        if shortcut_dropout is not None and not 0 <= shortcut_dropout < 1:
            raise ValueError(f"shortcut_dropout: expected a probability in [0, 1), got "
                             f"{shortcut_dropout!r}")

    @property
    def drop_path(self) -> float:
        return self._drop_path

    @drop_path.setter
    def drop_path(self, p: float) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"drop_path: expected a probability in [0, 1), got {p!r}")
        self._drop_path = float(p)

    @property
    def stacked_shortcut(self) -> bool:
        """Whether this unit runs its projection shortcut and conv1 as one fused op on their
        stacked weights (:func:`shared_conv_into`): a :data:`FUSED` pre-activation unit whose
        shortcut and conv1 are :func:`_concatenable`, both after a BatchNorm, and strided. (At
        stride 1 the stacked output, as large as x or larger, costs more in the gradients'
        concatenation than the second pass over x saves; strided, the stack beats the cpu
        backend's paired route too, and peaks lower: benchmarks/RESULTS-history.md.)"""
        return (self._fused_projection_reads_bn1 and self.shortcut.stride != (1, 1)
                and _concatenable(self.shortcut, self.convs[0]))

    @property
    def paired_shortcut(self) -> bool:
        """Whether this unit runs its projection shortcut and conv1 through
        :func:`paired_conv_into` (one backward over x on the cpu backend): a :data:`FUSED`
        pre-activation unit with a projection and both BatchNorms whose convolutions are not
        :attr:`stacked_shortcut`."""
        return self._fused_projection_reads_bn1 and not self.stacked_shortcut

    @property
    def shortcut_from_conv1(self) -> bool:
        """Whether this unit takes its identity shortcut from conv1's fused op
        (:func:`shortcut_conv_into`), so that the shortcut's gradient and the branch's are
        summed in conv1's data-gradient pass on the cpu backend: a :data:`FUSED`
        pre-activation unit with the identity shortcut and BatchNorms before conv1 and conv2.
        (Autograd's own sum reads both gradients and writes a third tensor of x's size; the
        measurement: benchmarks/RESULTS-history.md, "The identity shortcut's gradient".)"""
        return self._fused_conv1_between_bns and self.path == "identity"

    @property
    def _fused_projection_reads_bn1(self) -> bool:
        # The projection reads bn1's BN-ReLU beside conv1: what both projection routes need.
        return self._fused_conv1_between_bns and self.shortcut is not None

    @property
    def _fused_conv1_between_bns(self) -> bool:
        # A FUSED pre-activation unit whose conv1 reads bn1's BN-ReLU and feeds bn2: what every
        # route that runs conv1 beside the shortcut needs.
        return (isinstance(self.layer, FusedBNReLUConv) and self.unit == "preact"
                and self.num_convs > 1 and self.bns[0] is not None and self.bns[1] is not None)

    @property
    def fused(self) -> bool:
        return self.layer.fused

    @property
    def convs(self) -> list[nn.Conv2d]:
        return [getattr(self, f"conv{i}") for i in range(1, self.num_convs + 1)]

    @property
    def bns(self) -> list[nn.BatchNorm2d | None]:
        return [getattr(self, f"bn{i}") for i in range(1, self.num_convs + 1)]

    @property
    def bn_in(self) -> nn.BatchNorm2d | None:
        """The BatchNorm that reads the unit's input (pre-activation units), else None."""
        return self.bn1 if self.unit == "preact" else None

    @property
    def fused_chains(self) -> int:
        """How many BN-ReLU -> conv chains the unit has (each one fused op with a fused
        layer); ReLU -> conv chains without BatchNorm are not counted (they stay plain)."""
        if self.norm == "none":
            return 0
        k = self.num_convs
        if self.unit == "preact":
            return k + (self.shortcut is not None)
        return k - 1

    @property
    def plain_parts(self) -> list[str]:
        """What this unit runs as plain PyTorch whatever the layer (no BN-ReLU -> conv chain)."""
        return V.plain_parts(self)

    def extra_repr(self) -> str:
        bits = [f"unit={self.unit!r}", f"shortcut={self.path!r}", f"layer={self.layer!r}"]
        if self.norm != "batch":
            bits.append(f"norm={self.norm!r}")
        if self.drop_path:
            bits.append(f"drop_path={self.drop_path:g}, drop_path_mode={self.drop_path_mode!r}")
        return ", ".join(bits)

    # ------------------------------------------------------------------ forward

    def _draw(self, x: Tensor):
        """(dropped, branch scale) for this training step: the scale is a (N,) tensor or None."""
        p = self.drop_path
        if not (self.training and p > 0):
            return False, None
        keep = 1.0 - p
        n = x.shape[0]
        if self.drop_path_mode != "row":
            noise = torch.empty([1] * x.dim(), dtype=x.dtype, device=x.device).bernoulli_(keep)
            if self.drop_path_mode == "batch_skip" and not _has_no_data(x):
                # Read on the host (a sync): a dropped unit computes no branch at all. (The
                # planner's meta/fake step has no value and plans for a kept unit.)
                if not bool(noise):
                    return True, None
            # "batch": decided on the device, the branch scaled by 0 or 1 / keep.
            return False, noise.div_(keep).reshape(1).expand(n)
        noise = torch.empty([n] + [1] * (x.dim() - 1), dtype=x.dtype, device=x.device)
        return False, noise.bernoulli_(keep).div_(keep).reshape(n)

    def forward(self, x: Tensor, stats=None, return_stats: bool = False):
        """``x`` (N, in_planes, H, W) -> (N, out_planes, H / stride, W / stride).

        ``stats``/``return_stats`` hand the batch statistics of the unit's output to the next
        unit (:class:`fusedres.models.PreActResNet` does): ``stats`` are the (mean, biased
        variance) of ``x`` when known, and ``return_stats=True`` returns ``(y, stats of y)``
        (stats None when this unit cannot produce them: the next unit computes its own).
        """
        if self.unit == "preact":
            out = _lean_preact(self, x, stats, return_stats)
            y, out_stats = out if out is not None else self._forward_preact(x, stats,
                                                                            return_stats)
        else:
            y, out_stats = self._forward_post(x), None
        return (y, out_stats) if return_stats else y

    def _forward_preact(self, x: Tensor, stats, return_stats: bool):
        L = self.layer
        convs, bns = self.convs, self.bns
        L.check(x, convs[0], self.shortcut)
        check_convs(*convs[1:])
        dropped, drawn = self._draw(x)
        if dropped:  # the shortcut alone: only a projection reads the BN-ReLU
            a = L.act(bns[0], x, stats) if self.path in ("projection", "conv1x1") else None
            return V.combine(self, x, V.shortcut(self, x, a), None), None
        a = L.act(bns[0], x, stats)
        short, a, first = self._shortcut_beside_conv1(x, a)
        for i in range(first, self.num_convs):
            a = L.conv_into(a, convs[i - 1], bns[i])
        scale = V.branch_scale(self, drawn, x)
        if self.gate is None:
            out = L.conv(a, convs[-1], residual=short, branch_scale=scale,
                         return_stats=return_stats)
            return out if return_stats else (out, None)
        return V.combine(self, x, short, L.conv(a, convs[-1], branch_scale=scale)), None

    def _shortcut_beside_conv1(self, x: Tensor, a):
        """(h(x), the chain's activation, the first convolution left to run): conv1 run with
        the shortcut where a route pairs them (stacked, paired, or the identity handed on),
        else the shortcut alone."""
        convs, bns = self.convs, self.bns
        if self.stacked_shortcut:
            return (*shared_conv_into(a, self.shortcut, convs[0], bns[1]), 2)
        if self.paired_shortcut:
            return (*paired_conv_into(a, self.shortcut, convs[0], bns[1]), 2)
        if self.shortcut_from_conv1:
            return (*shortcut_conv_into(a, convs[0], bns[1]), 2)
        return V.shortcut(self, x, a), a, 1

    def _forward_post(self, x: Tensor) -> Tensor:
        if self.unit == "relu_only_preact":
            self.layer.check(x, self.convs[0])
        check_convs(*self.convs[1:])
        dropped, drawn = self._draw(x)
        return V.forward_post(self, x, dropped, drawn)


# --------------------------------------------------------------------------- the lean route
# A fused pre-activation unit with the identity shortcut (most of a deep pre-activation ResNet)
# runs _forward_preact's calls with its checks and its layers' Python between them: ~120
# Python calls a chain on the C++ routes, where plain PyTorch's block makes ~45. Once the
# checked route has run a key's arguments, later calls with the same key skip the checks and
# call the route's fields in the same order on the same tensors (the same kernels, the same
# results to the bit).

# Arguments the checked route ran without error, by what its checks read: the block's
# structure, x's and the statistics' metadata, and every BatchNorm's and convolution's
# settings and tensors' shape, dtype and device (tensors are read afresh at every call).
_LEAN_KEYS: set = set()
_LEAN_NAMES = {k: tuple((f"bn{i}", f"conv{i}") for i in range(1, k + 1)) for k in (2, 3)}
_META = operator.attrgetter("shape", "dtype", "device")


def _lean_preact(block: ResidualBlock, x: Tensor, stats, return_stats: bool):
    """``(y, stats of y or None)`` of ``block._forward_preact(x, stats, return_stats)`` through
    the route's fields without the checks, for arguments whose key the checked route has run;
    None where this route does not apply (then the caller runs the checked one): a
    :data:`FUSED` pre-activation unit with the identity shortcut, two or three chains of plain
    ``nn.BatchNorm2d`` and ``nn.Conv2d`` (explicit padding), no drop-path draw this step, no
    autocast, a backend with a one-call BatchNorm preparation (cpu, cuda, triton), BatchNorm
    parameters in the statistics dtype."""
    names = _LEAN_NAMES.get(block.num_convs)
    if (names is None or type(block.layer) is not FusedBNReLUConv or block.path != "identity"
            or block.gate is not None or (block.training and block._drop_path > 0)):
        return None
    mods = block._modules
    conv1 = mods["conv1"]
    if type(conv1) is not nn.Conv2d:
        return None
    r = route(x, conv1._parameters["weight"])
    if r.prepare_batch_norm is None or torch.is_autocast_enabled(x.device.type):
        return None
    keyed = _lean_key(r, names, mods, x, stats, return_stats)
    if keyed is None:
        return None
    key, chain = keyed
    if key not in _LEAN_KEYS:
        out = block._forward_preact(x, stats, return_stats)  # checks every argument
        _LEAN_KEYS.add(key)
        return out
    return _lean_run(r, chain, x, stats, return_stats)


def _lean_key(r, names, mods, x: Tensor, stats, return_stats: bool):
    """(the key of these arguments, each chain's fields) for :func:`_lean_preact`, or None
    where a BatchNorm or convolution is not one the lean route runs."""
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # opdefs.stats_dtype
    key = [r.name, x.shape, x.stride(), x.dtype, x.device, return_stats,
           None if stats is None else (len(stats), *map(_META, stats)),
           torch.is_inference_mode_enabled()]  # with is_inference(): buffers it may write
    chain = []
    for bn_name, conv_name in names:
        bn, c = mods.get(bn_name), mods[conv_name]  # no bn under norm='none'
        if (type(bn) is not nn.BatchNorm2d or type(c) is not nn.Conv2d
                or type(c.padding) is not tuple or "fused_prepare" in bn.__dict__):
            return None
        bp, bb, cp = bn._parameters, bn._buffers, c._parameters
        g, b, rm, rv = bp["weight"], bp["bias"], bb["running_mean"], bb["running_var"]
        nbt, w, cb = bb["num_batches_tracked"], cp["weight"], cp["bias"]
        if (g is not None and g.dtype != sdt) or (b is not None and b.dtype != sdt):
            return None  # the checked route casts them
        key += (bn.training, bn.momentum, bn.eps, c.stride, c.padding, c.dilation, c.groups,
                c.padding_mode, _META(w), None if cb is None else _META(cb),
                None if g is None else _META(g), None if b is None else _META(b),
                None if rm is None else (_META(rm), rm.stride(), rm.requires_grad,
                                         rm.is_inference()),
                None if rv is None else (_META(rv), rv.stride(), rv.requires_grad,
                                         rv.is_inference()),
                None if nbt is None else (_META(nbt), nbt.is_inference()))
        chain.append((bn.training, bn.momentum, bn.eps, g, b, rm, rv, nbt, w, cb, c.stride,
                      c.padding, c.dilation))
    return tuple(key), chain


def _lean_run(r, chain, x: Tensor, stats, return_stats: bool):
    """The lean route's run of ``chain`` (:func:`_lean_key`'s) on ``x``: ``(y, stats of y
    or None)``."""
    prepare_affine, prepare_bn, prepares = r.prepare_affine, r.prepare_batch_norm, r.prepares
    # What _forward_preact runs for these arguments: each BatchNorm prepared as
    # functional.prepare_batch_norm's route branch does (with the statistics its producer
    # handed over when it uses batch statistics), each unit as functional.conv2d_from_prepared
    # runs it, conv1 handing the shortcut on where the route has that form.
    a = short = x
    last = len(chain) - 1
    for i, (training, momentum, eps, g, b, rm, rv, nbt, w, cb, stride, padding,
            dilation) in enumerate(chain):
        use_batch = training or rm is None
        given = stats if stats is not None and use_batch else (None, None)
        affine = None
        if prepares is not None and not prepares(a, rm, rv, training):
            state = FR.prepare_batch_norm(a, g, b, rm, rv, nbt, training=training,
                                          momentum=momentum, eps=eps,
                                          stats=stats if use_batch else None)
            mean, invstd = state.mean, state.invstd
        else:
            if prepare_affine is not None:
                mean, invstd, *affine = prepare_affine(a, g, b, rm, rv, nbt, training,
                                                       momentum, eps, *given)
            else:
                mean, invstd = prepare_bn(a, rm, rv, nbt, training, momentum, eps, *given)
            if given[0] is not None:
                mean = given[0]
        args = UnitArgs(a, w, cb, g, b, mean, invstd, short if i == last else None, stride,
                        padding, dilation, use_batch)
        if i == last:
            if return_stats:
                y, m, v = r.unit(args, True, affine)
                return y, (m, v)
            return r.unit(args, False, affine), None
        # The next BatchNorm takes this unit's statistics when it uses batch statistics.
        nxt = chain[i + 1]
        want = nxt[0] or nxt[5] is None
        if i == 0 and r.unit_with_shortcut is not None:
            a, short, *stats = r.unit_with_shortcut(*args, want)
        elif want:
            a, *stats = r.unit(args, True, affine)
        else:
            a = r.unit(args, False, affine)
        if not want:
            stats = None
    return None  # unreachable: the last chain returns


class BasicBlock(ResidualBlock):
    """He et al.'s basic unit: two 3x3 convolutions, ``in_planes -> planes -> planes`` (the
    first strided). Default: the full pre-activation unit, as :class:`PreActBasicBlock`."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, fused: bool = True,
                 **kwargs):
        convs = [(in_planes, planes, 3, stride), (planes, planes, 3, 1)]
        super().__init__(convs, in_planes, planes, stride, fused=fused, **kwargs)


class Bottleneck(ResidualBlock):
    """He et al.'s bottleneck: 1x1 to ``planes``, 3x3, 1x1 to ``4 * planes``.

    ``stride_on="conv1"`` strides the first 1x1 conv (He et al.'s code); ``"conv2"`` the 3x3
    (torchvision, timm). Default: the full pre-activation unit, as :class:`PreActBottleneck`.
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, fused: bool = True,
                 stride_on: str = "conv1", **kwargs):
        if stride_on not in ("conv1", "conv2"):
            raise ValueError(f"stride_on: expected 'conv1' or 'conv2', got {stride_on!r}")
        s1, s2 = (stride, 1) if stride_on == "conv1" else (1, stride)
        out_planes = planes * self.expansion
        convs = [(in_planes, planes, 1, s1), (planes, planes, 3, s2), (planes, out_planes, 1, 1)]
        super().__init__(convs, in_planes, out_planes, stride, fused=fused, **kwargs)


# The names of the full pre-activation units (the default unit of both classes).
PreActBasicBlock = BasicBlock
PreActBottleneck = Bottleneck
