"""Drop-in modules. Parameters, buffers and state_dict keys are those of the plain PyTorch blocks
(``nn.BatchNorm2d`` and ``nn.Conv2d`` submodules), so checkpoints move both ways.

The package by role: :mod:`~fusedres.modules.unit` the fused unit (:class:`BNReLUConv2d`, the
layers :data:`FUSED` and :data:`PLAIN`, the chain functions blocks and ``fusedres.fuse`` run),
:mod:`~fusedres.modules.blocks` the residual blocks and their arguments,
:mod:`~fusedres.modules.variants` what He et al.'s variants add to a block's forward, and
:mod:`~fusedres.modules.lean` a fused pre-activation unit's route without re-checks. This file
only re-exports: every name is imported from ``fusedres.modules``.
"""

from __future__ import annotations

from .blocks import (
    DROP_PATH_MODES,
    NORMS,
    SHORTCUTS,
    UNITS,
    BasicBlock,
    Bottleneck,
    PreActBasicBlock,
    PreActBottleneck,
    ResidualBlock,
)

# The chain functions (check_convs ... wants_stats, noqa: re-exported) are the fusers'
# (convert/) and the tests', not in __all__.
from .unit import (
    FUSED,
    PLAIN,
    BNReLUConv2d,
    BNReLUConvLayer,
    FusedBNReLUConv,
    PlainBNReLUConv,
    check_convs,  # noqa: F401
    check_inputs,  # noqa: F401
    concatenable,  # noqa: F401
    conv,  # noqa: F401
    conv_into,  # noqa: F401
    paired_conv_into,  # noqa: F401
    prepare,  # noqa: F401
    shared_conv_into,  # noqa: F401
    shortcut_conv_into,  # noqa: F401
    wants_stats,  # noqa: F401
)

__all__ = ["BNReLUConv2d", "BasicBlock", "Bottleneck", "BNReLUConvLayer", "DROP_PATH_MODES",
           "FUSED", "FusedBNReLUConv", "NORMS", "PLAIN", "PlainBNReLUConv",
           "PreActBasicBlock", "PreActBottleneck", "ResidualBlock", "SHORTCUTS", "UNITS"]

# The classes keep the module path they had before the split into rooms: pickles of whole
# models and fused classes name them by it, and so do fusedres.fuse's registry keys
# ("fusedres.modules.ResidualBlock", convert/rewriters.py).
for _cls in (BasicBlock, Bottleneck, BNReLUConv2d, BNReLUConvLayer, FusedBNReLUConv,
             PlainBNReLUConv, ResidualBlock):
    _cls.__module__ = __name__
del _cls

