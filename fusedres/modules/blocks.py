"""The residual blocks: :class:`ResidualBlock`, :class:`BasicBlock` and :class:`Bottleneck`.
Their parameters, buffers and state_dict keys are those of the plain PyTorch blocks
(``nn.BatchNorm2d`` and ``nn.Conv2d`` submodules), so checkpoints move both ways.

Blocks are built from swappable layers, as timm's take ``norm_layer``: a residual block runs its
BatchNorm -> ReLU -> conv chains through the *layer* it is given (:mod:`fusedres.modules.unit`),
:data:`FUSED` (one fused op per chain, nothing but the chain's input kept for backward) or
:data:`PLAIN` (``nn.BatchNorm2d``, ``F.relu`` and ``nn.Conv2d`` as PyTorch runs them). Fused and
plain are one block class with one forward; ``fused=True/False`` picks the layer.

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

import torch
import torch.nn as nn
from torch import Tensor

from . import lean
from . import variants as V
from .unit import (
    FUSED,
    PLAIN,
    BNReLUConvLayer,
    FusedBNReLUConv,
    check_convs,
    concatenable,
    paired_conv_into,
    shared_conv_into,
    shortcut_conv_into,
)

__all__ = ["BasicBlock", "Bottleneck", "DROP_PATH_MODES", "NORMS", "PreActBasicBlock",
           "PreActBottleneck", "ResidualBlock", "SHORTCUTS", "UNITS"]

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


def _has_no_data(x: Tensor) -> bool:
    """A meta or fake tensor (the planner's simulated step): no value to branch on."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


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
        shortcut and conv1 are :func:`concatenable`, both after a BatchNorm, and strided. (At
        stride 1 the stacked output, as large as x or larger, costs more in the gradients'
        concatenation than the second pass over x saves; strided, the stack beats the cpu
        backend's paired route too, and peaks lower: benchmarks/RESULTS-history.md at 2e8027e.)"""
        return (self._fused_projection_reads_bn1 and self.shortcut.stride != (1, 1)
                and concatenable(self.shortcut, self.convs[0]))

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
        measurement: benchmarks/RESULTS-history.md at 2e8027e, "The identity shortcut's
        gradient".)"""
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
            out = lean.preact(self, x, stats, return_stats)
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
