"""Pre-activation ResNets (He et al., "Identity Mappings in Deep Residual Networks", 2016).

CIFAR variant, as the authors' reference code builds it: a 3x3 conv to 16 channels, three
stages of residual units, a final BatchNorm-ReLU, global average pooling and a linear layer.
Depth 6n+2 with basic units (widths 16/32/64: ResNet-20, 56, 110) or 9n+2 with bottleneck
units (widths 16 -> 64/128/256: ResNet-164, 1001). The stride of a dimension-changing
bottleneck sits on its first 1x1 conv, and that unit's BatchNorm-ReLU feeds both the residual
branch and the 1x1 projection shortcut (the blocks in :mod:`fusedres.modules` do this; fused, it
is one statistics pass and no stored activation). The first unit's pre-activation plays the role
of the BatchNorm-ReLU after the first conv in the reference code.

ImageNet variant: a 7x7/2 conv to 64 channels and a 3x3/2 max pool, four stages (widths
64/128/256/512, times 4 for bottlenecks), final BatchNorm-ReLU, pooling, linear.

``fused=False`` builds the same network from plain PyTorch modules with identical state_dict
keys, so weights move between the two.

He et al.'s variants (:mod:`fusedres.modules`): ``unit=`` the unit ordering (``"preact"``, the
default; ``"original"``, ``"bn_after_add"``, ``"relu_before_add"``, ``"relu_only_preact"``),
``shortcut=`` the shortcut (``"identity"``; ``"scale"``, the gates, ``"conv1x1"``,
``"dropout"``; ``"none"``: a plain network), ``norm="none"`` without BatchNorm, and stochastic
depth (``drop_path_rate=``, Huang et al.'s linear rule: unit l of L drops with probability
``rate * l / L``). The stem and head follow the unit: pre-activation units have a bare stem conv
and a final BN-ReLU (``relu_only_preact``: a stem conv-BN and a final ReLU); post-activation
units (``original``, ``bn_after_add``, ``relu_before_add``) a stem conv-BN-ReLU and no final
BN-ReLU, as in He et al. 2015.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..memory.activation_checkpoint import checkpoint_segments, even_segments
from ..modules import (
    DROP_PATH_MODES,
    NORMS,
    SHORTCUTS,
    UNITS,
    BasicBlock,
    Bottleneck,
    ResidualBlock,
    wants_stats,
)

__all__ = ["PreActResNet", "check_variant", "preact_resnet", "valid_depths"]

IMAGENET_LAYERS = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
    200: ("bottleneck", (3, 24, 36, 3)),
}
_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


def _no_global_hooks() -> bool:
    m = nn.modules.module
    return not (m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def _hands_over(unit: nn.Module, nxt: nn.Module | None) -> bool:
    """Whether ``unit`` returns its output's statistics for ``nxt``: both fused, ``nxt``'s first
    BatchNorm uses local batch statistics, and no hook could tell: a forward or backward hook on
    ``unit`` would see the (y, stats) pair, a forward pre-hook on ``nxt`` could replace the input
    that the statistics describe. Hooked units run as usual and compute their own."""
    return (nxt is not None and getattr(unit, "fused", False) and getattr(nxt, "fused", False)
            and getattr(unit, "unit", None) == "preact" and getattr(unit, "gate", None) is None
            and not (unit._forward_hooks or unit._backward_hooks or unit._backward_pre_hooks)
            and not nxt._forward_pre_hooks and _no_global_hooks()
            and wants_stats(getattr(nxt, "bn_in", None)))


def _run_units(units: Sequence[nn.Module], x: Tensor) -> Tensor:
    """The units in order. A fused unit feeding another fused unit whose first BatchNorm uses
    batch statistics returns the statistics of its output with it (reduced in its last
    convolution's epilogue on the Triton backend), and the next unit takes them instead of
    running a statistics pass over its input."""
    stats = None
    for i, unit in enumerate(units):
        nxt = units[i + 1] if i + 1 < len(units) else None
        kwargs = {} if stats is None else {"stats": stats}
        if _hands_over(unit, nxt):
            x, stats = unit(x, return_stats=True, **kwargs)
        else:
            x, stats = unit(x, **kwargs), None
    return x


def valid_depths(variant: str) -> str:
    """A sentence naming the depths ``variant`` can build (for error messages)."""
    if variant == "cifar":
        return ("6n+2 with basic units (8, 14, 20, 56, 110, ...) or 9n+2 with bottleneck units "
                "(11, 29, 164, 1001, ...), n >= 1")
    return "one of " + ", ".join(str(d) for d in IMAGENET_LAYERS)


def check_variant(*, unit: str = "preact", shortcut: str = "identity", norm: str = "batch",
                  drop_path_rate: float = 0.0, drop_path_mode: str = "row") -> None:
    """Raise ``ValueError`` naming the argument when a variant's names or rate are invalid."""
    for value, name, options in ((unit, "unit", UNITS), (shortcut, "shortcut", SHORTCUTS),
                                 (norm, "norm", NORMS),
                                 (drop_path_mode, "drop_path_mode", DROP_PATH_MODES)):
        if value not in options:
            raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, "
                             f"got {value!r}")
    if (isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float))
            or not 0 <= drop_path_rate < 1):
        raise ValueError(f"drop_path_rate: expected a rate in [0, 1), got {drop_path_rate!r}")
    if shortcut == "none" and drop_path_rate > 0:
        raise ValueError("drop_path_rate: a network without shortcuts (shortcut='none') cannot "
                         "drop units; expected 0")


def _cifar_layout(depth: int, block: str | None) -> tuple[str, tuple[int, ...]]:
    basic_ok = depth >= 8 and (depth - 2) % 6 == 0
    bottleneck_ok = depth >= 11 and (depth - 2) % 9 == 0
    if block is None:  # He et al.: basic units below 164 layers, bottlenecks from 164 on
        block = ("bottleneck" if bottleneck_ok and (depth >= 164 or not basic_ok)
                 else "basic" if basic_ok else None)
    ok = basic_ok if block == "basic" else bottleneck_ok if block == "bottleneck" else False
    if not ok:
        what = f" with {block} units" if block is not None else ""
        raise ValueError(f"depth: the cifar variant cannot build depth {depth}{what}; valid "
                         f"depths are {valid_depths('cifar')}")
    n = (depth - 2) // (6 if block == "basic" else 9)
    return block, (n, n, n)


class PreActResNet(nn.Module):
    """A pre-activation ResNet; build it with :func:`preact_resnet` or a named constructor.

    Input (N, in_chans, H, W) float; output (N, num_classes) logits. Submodules: ``conv1``
    (stem conv), ``layer1`` .. ``layer3`` (``layer4`` for ImageNet) of residual units, ``bn``
    (final BatchNorm, followed by ReLU), ``fc``. ``units()`` lists the residual units in order;
    ``set_grad_checkpointing`` checkpoints contiguous segments of them.
    """

    def __init__(self, block: str, layers: Sequence[int], widths: Sequence[int], *,
                 variant: str, depth: int, num_classes: int = 10, fused: bool = True,
                 in_chans: int = 3, stem_width: int = 16, stride_on: str = "conv1",
                 zero_init_last: bool = False, unit: str = "preact", shortcut: str = "identity",
                 norm: str = "batch", drop_path_rate: float = 0.0, drop_path_mode: str = "row",
                 **shortcut_args):
        super().__init__()
        if block not in _BLOCKS:
            raise ValueError(f"block: expected 'basic' or 'bottleneck', got {block!r}")
        check_variant(unit=unit, shortcut=shortcut, norm=norm, drop_path_rate=drop_path_rate,
                      drop_path_mode=drop_path_mode)
        self.depth, self.variant, self.block, self.fused = depth, variant, block, fused
        self.unit, self.shortcut, self.norm = unit, shortcut, norm
        self.drop_path_rate, self.drop_path_mode = float(drop_path_rate), drop_path_mode
        self.num_classes = num_classes
        cls = _BLOCKS[block]
        conv_bias = norm == "none"
        if variant == "cifar":
            self.conv1 = nn.Conv2d(in_chans, stem_width, 3, 1, 1, bias=conv_bias)
        else:
            self.conv1 = nn.Conv2d(in_chans, stem_width, 7, 2, 3, bias=conv_bias)
        # Post-activation units read an activated input: the stem ends with BN-ReLU (He et al.
        # 2015); ReLU-only pre-activation units begin with a ReLU: the stem ends with BN.
        self.stem_bn = (nn.BatchNorm2d(stem_width) if unit != "preact" and norm == "batch"
                        else None)
        self.stem_relu = unit not in ("preact", "relu_only_preact")
        self.pool = nn.MaxPool2d(3, 2, 1) if variant != "cifar" else None
        in_planes = stem_width
        self.stage_names: list[str] = []
        total = sum(layers)
        index = 0
        for i, (n, planes) in enumerate(zip(layers, widths)):
            stride = 1 if i == 0 else 2
            units = []
            for j in range(n):
                index += 1
                kw = {"stride_on": stride_on} if block == "bottleneck" else {}
                units.append(cls(in_planes, planes, stride if j == 0 else 1, fused=fused,
                                 unit=unit, shortcut=shortcut, norm=norm,
                                 drop_path=drop_path_rate * index / total,
                                 drop_path_mode=drop_path_mode, **shortcut_args, **kw))
                in_planes = planes * cls.expansion
            name = f"layer{i + 1}"
            self.add_module(name, nn.Sequential(*units))
            self.stage_names.append(name)
        self.num_features = in_planes
        # The final BN-ReLU of pre-activation networks (post-activation units end activated).
        self.bn = nn.BatchNorm2d(in_planes) if unit == "preact" and norm == "batch" else None
        self.head_relu = unit in ("preact", "relu_only_preact")
        self.fc = nn.Linear(in_planes, num_classes)
        self.checkpoint_ranges: list[tuple[int, int]] = []
        self.reset_parameters(zero_init_last)

    # ------------------------------------------------------------------ set-up

    def reset_parameters(self, zero_init_last: bool = False) -> None:
        """He (fan-out) init for convs, BN weight 1 and bias 0, PyTorch's default for ``fc``
        with a zero bias; ``zero_init_last`` zeroes the last conv of every residual branch
        (in a pre-activation unit the branch ends with a conv, so each unit starts as the
        identity)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.fc.reset_parameters()
        nn.init.zeros_(self.fc.bias)
        for u in self.units():
            if u.gate is not None:
                nn.init.constant_(u.gate.bias, u.gate_bias)
        if zero_init_last:
            for u in self.units():
                nn.init.zeros_(u.convs[-1].weight)

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int) -> None:
        """A new, freshly initialised ``fc`` for ``num_classes`` (timm's method name)."""
        fc = nn.Linear(self.num_features, num_classes, device=self.fc.weight.device,
                       dtype=self.fc.weight.dtype)
        nn.init.zeros_(fc.bias)
        self.fc, self.num_classes = fc, num_classes

    def units(self) -> list[ResidualBlock]:
        """The residual units, in forward order (the planner's unit of checkpointing)."""
        return [u for name in self.stage_names for u in getattr(self, name)]

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def extra_repr(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v, d in (
            ("unit", self.unit, "preact"), ("shortcut", self.shortcut, "identity"),
            ("norm", self.norm, "batch"), ("drop_path_rate", self.drop_path_rate, 0.0))
            if v != d)
        return (f"depth={self.depth}, variant={self.variant!r}, block={self.block!r}, "
                f"fused={self.fused}{extra}, params={self.num_params() / 1e6:.3f}M")

    def set_grad_checkpointing(self, segments=True) -> None:
        """Checkpoint the residual units during training (timm's method name).

        ``segments``: ``0``, ``False`` or ``None`` turns checkpointing off; ``True``
        checkpoints every unit on its own; an int k splits the units into k contiguous
        segments of near-equal length, each checkpointed; a list of ``(start, stop)`` unit
        index ranges checkpoints exactly those (what :func:`fusedres.memory.plan` sets).
        Recomputation never updates BatchNorm running statistics a second time.
        """
        n = len(self.units())
        if segments is None or segments is False or (isinstance(segments, int) and
                                                     not isinstance(segments, bool) and
                                                     segments == 0):
            ranges: list[tuple[int, int]] = []
        elif segments is True:
            ranges = [(i, i + 1) for i in range(n)]
        elif isinstance(segments, int):
            if segments < 0:
                raise ValueError(f"segments: expected >= 0, got {segments}")
            ranges = even_segments(n, segments)
        else:
            ranges = [(int(a), int(b)) for a, b in segments]
            prev = 0
            for a, b in ranges:
                if not (prev <= a < b <= n):
                    raise ValueError(f"segments: expected sorted, disjoint, non-empty ranges "
                                     f"within [0, {n}], got {ranges}")
                prev = b
        self.checkpoint_ranges = ranges

    # ------------------------------------------------------------------ forward

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        if self.stem_bn is not None:
            x = self.stem_bn(x)
        if self.stem_relu:
            x = F.relu(x)
        if self.pool is not None:
            x = self.pool(x)
        units = self.units()
        if self.checkpoint_ranges and torch.is_grad_enabled():
            x = checkpoint_segments(units, x, self.checkpoint_ranges)
        else:
            x = _run_units(units, x)
        if self.bn is not None:
            x = self.bn(x)
        return F.relu(x) if self.head_relu else x

    def forward_head(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def preact_resnet(depth: int, num_classes: int = 10, variant: str = "cifar", fused: bool = True,
                  in_chans: int = 3, stride_on: str = "conv1", zero_init_last: bool = False,
                  block: str | None = None, unit: str = "preact", shortcut: str = "identity",
                  norm: str = "batch", drop_path_rate: float = 0.0, drop_path_mode: str = "row",
                  **shortcut_args) -> PreActResNet:
    """A pre-activation ResNet of ``depth`` layers.

    ``variant``: ``"cifar"`` (depth 6n+2 basic or 9n+2 bottleneck; ``block`` picks when both
    fit, default basic below 164 layers) or ``"imagenet"`` (18, 34, 50, 101, 152, 200).
    ``stride_on``: ``"conv1"`` (He et al.) or ``"conv2"`` (stride on the 3x3, as torchvision)
    for bottlenecks. A depth the variant cannot build raises ``ValueError`` naming the valid
    ones.

    ``unit``, ``shortcut`` (with ``scale``, ``scale_branch``, ``gate_bias``,
    ``shortcut_dropout``), ``norm``, ``drop_path_mode``: as :class:`fusedres.modules.
    ResidualBlock`; ``drop_path_rate``: the last unit's drop probability, unit l of L dropping
    with ``drop_path_rate * l / L`` (Huang et al.'s linear rule).
    """
    check_variant(unit=unit, shortcut=shortcut, norm=norm, drop_path_rate=drop_path_rate,
                  drop_path_mode=drop_path_mode)
    if not isinstance(depth, int) or isinstance(depth, bool):
        raise TypeError(f"depth: expected an int, got {type(depth).__name__}")
    if variant == "cifar":
        kind, layers = _cifar_layout(depth, block)
        widths, stem = (16, 32, 64), 16
    elif variant == "imagenet":
        if depth not in IMAGENET_LAYERS:
            raise ValueError(f"depth: the imagenet variant cannot build depth {depth}; valid "
                             f"depths are {valid_depths('imagenet')}")
        kind, layers = IMAGENET_LAYERS[depth]
        if block is not None and block != kind:
            raise ValueError(f"block: imagenet depth {depth} uses {kind} units, got {block!r}")
        widths, stem = (64, 128, 256, 512), 64
    else:
        raise ValueError(f"variant: expected 'cifar' or 'imagenet', got {variant!r}")
    if stride_on not in ("conv1", "conv2"):
        raise ValueError(f"stride_on: expected 'conv1' or 'conv2', got {stride_on!r}")
    return PreActResNet(kind, layers, widths, variant=variant, depth=depth,
                        num_classes=num_classes, fused=fused, in_chans=in_chans,
                        stem_width=stem, stride_on=stride_on, zero_init_last=zero_init_last,
                        unit=unit, shortcut=shortcut, norm=norm, drop_path_rate=drop_path_rate,
                        drop_path_mode=drop_path_mode, **shortcut_args)
