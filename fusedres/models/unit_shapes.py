"""The unit shapes every benchmark and the self-test measure: one table, imported by
``fusedres bench``, the pytest-benchmark files in ``benchmarks/`` and ``fusedres.apps.selftest``
(a library module, so that those apps share it without importing each other; plain data, it
imports nothing).

Two kinds of unit:

* :class:`ConvUnit`: one BN -> ReLU -> Conv2d(k x k, padding k // 2, no bias), with an optional
  residual of the output's shape (``fusedres.BNReLUConv2d`` against ``BatchNorm2d`` + ``ReLU``
  + ``Conv2d`` [+ add]).
* :class:`BlockUnit`: one pre-activation residual unit of He et al. (``PreActBasicBlock``,
  two 3x3s; or ``PreActBottleneck``, 1x1/3x3/1x1 to ``4 * planes``), with a 1x1 projection
  shortcut when the stride or width changes.

Names are the ids the benchmarks print; ``QUICK_*`` are tiny shapes for smoke runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BASIC_SWEEP", "BlockUnit", "CIFAR_BASIC_BLOCKS", "CIFAR_BOTTLENECKS", "CIFAR_CONVS",
           "ConvUnit", "GPU_CONVS", "QUICK_BLOCKS", "QUICK_CONVS", "R50_BOTTLENECKS", "R50_CONVS",
           "SELFTEST_CPU", "SELFTEST_GPU", "SETS", "conv_units", "parse_shape", "select"]


@dataclass(frozen=True)
class ConvUnit:
    """BN(cin) -> ReLU -> Conv2d(cin -> cout, k x k, stride, padding k // 2, no bias) [+ residual
    (n, cout, ho, ho)]; input (n, cin, hw, hw)."""

    name: str
    n: int
    cin: int
    cout: int
    hw: int
    k: int = 3
    stride: int = 1
    residual: bool = False

    @property
    def padding(self) -> int:
        return self.k // 2

    @property
    def ho(self) -> int:
        return (self.hw + 2 * self.padding - self.k) // self.stride + 1

    @property
    def kind(self) -> str:
        return f"conv{self.k}x{self.k}"


@dataclass(frozen=True)
class BlockUnit:
    """A pre-activation ``block`` ("basic" or "bottleneck") unit: input (n, cin, hw, hw),
    ``planes`` (a bottleneck outputs ``4 * planes``), ``stride``; ``stride_on`` is the
    bottleneck's strided conv ("conv1": He et al.'s CIFAR code; "conv2": torchvision/timm)."""

    name: str
    block: str
    n: int
    cin: int
    planes: int
    hw: int
    stride: int = 1
    stride_on: str = "conv1"

    @property
    def cout(self) -> int:
        return self.planes * (4 if self.block == "bottleneck" else 1)

    @property
    def projection(self) -> bool:
        return self.stride != 1 or self.cin != self.cout

    @property
    def kind(self) -> str:
        return self.block + (" +proj" if self.projection else "")


def conv_units(block: BlockUnit, n: int | None = None, prefix: str = "") -> list[ConvUnit]:
    """The BN-ReLU-conv units of ``block`` (batch ``n``, default the block's), in forward
    order: a bottleneck's 1x1 reduce, 3x3 and 1x1 expand (+ residual), a basic block's two 3x3s
    (the second + residual), then the 1x1 projection shortcut when there is one (it reads the
    same BN-ReLU output as the first conv). Names as :data:`CIFAR_CONVS`'s, after ``prefix``."""
    n = block.n if n is None else n
    p, s = block.planes, block.stride

    def unit(cin, cout, hw, k, stride=1, residual=False):
        name = (f"{prefix + ' ' if prefix else ''}{cin}>{cout} {k}x{k}"
                f"{f' /{stride}' if stride > 1 else ''} @{hw}{' +res' if residual else ''}")
        return ConvUnit(name, n, cin, cout, hw, k, stride, residual)

    if block.block == "bottleneck":
        s1, s2 = (s, 1) if block.stride_on == "conv1" else (1, s)
        first = unit(block.cin, p, block.hw, 1, s1)
        mid = unit(p, p, first.ho, 3, s2)
        units = [first, mid, unit(p, block.cout, mid.ho, 1, residual=True)]
    else:
        first = unit(block.cin, p, block.hw, 3, s)
        units = [first, unit(p, p, first.ho, 3, residual=True)]
    if block.projection:
        units.append(unit(block.cin, block.cout, block.hw, 1, s))
    return units


# CIFAR ResNet-164/1001 bottleneck units (He et al.: stride on the first 1x1) at N=128;
# "first" is a stage's stride-2 / projection unit.
CIFAR_BOTTLENECKS = [
    BlockUnit("c164 s1 64-16-64 @32", "bottleneck", 128, 64, 16, 32),
    BlockUnit("c164 s2-first 64-32-128 /2 @32", "bottleneck", 128, 64, 32, 32, 2),
    BlockUnit("c164 s2 128-32-128 @16", "bottleneck", 128, 128, 32, 16),
    BlockUnit("c164 s3-first 128-64-256 /2 @16", "bottleneck", 128, 128, 64, 16, 2),
    BlockUnit("c164 s3 256-64-256 @8", "bottleneck", 128, 256, 64, 8),
]
# ResNet-50 ImageNet bottleneck units (torchvision/timm: stride on the 3x3) at N=32.
R50_BOTTLENECKS = [
    BlockUnit("r50 s1-first 64-64-256 @56", "bottleneck", 32, 64, 64, 56, 1, "conv2"),
    BlockUnit("r50 s1 256-64-256 @56", "bottleneck", 32, 256, 64, 56, 1, "conv2"),
    BlockUnit("r50 s2-first 256-128-512 /2 @56", "bottleneck", 32, 256, 128, 56, 2, "conv2"),
    BlockUnit("r50 s2 512-128-512 @28", "bottleneck", 32, 512, 128, 28, 1, "conv2"),
    BlockUnit("r50 s3-first 512-256-1024 /2 @28", "bottleneck", 32, 512, 256, 28, 2, "conv2"),
    BlockUnit("r50 s3 1024-256-1024 @14", "bottleneck", 32, 1024, 256, 14, 1, "conv2"),
    BlockUnit("r50 s4-first 1024-512-2048 /2 @14", "bottleneck", 32, 1024, 512, 14, 2, "conv2"),
    BlockUnit("r50 s4 2048-512-2048 @7", "bottleneck", 32, 2048, 512, 7, 1, "conv2"),
]
# CIFAR ResNet-20/56/110 basic units at N=128.
CIFAR_BASIC_BLOCKS = [
    BlockUnit("c20 s1 16-16 @32", "basic", 128, 16, 16, 32),
    BlockUnit("c20 s2-first 16-32 /2 @32", "basic", 128, 16, 32, 32, 2),
    BlockUnit("c20 s3 64-64 @8", "basic", 128, 64, 64, 8),
]
# The single BN-ReLU-conv units inside the CIFAR bottlenecks, at N=128.
CIFAR_CONVS = [
    ConvUnit("64>16 1x1 @32", 128, 64, 16, 32, k=1),
    ConvUnit("16>16 3x3 @32", 128, 16, 16, 32),
    ConvUnit("16>64 1x1 @32", 128, 16, 64, 32, k=1),
    ConvUnit("64>32 1x1 /2 @32", 128, 64, 32, 32, k=1, stride=2),
    ConvUnit("128>32 1x1 @16", 128, 128, 32, 16, k=1),
    ConvUnit("32>32 3x3 @16", 128, 32, 32, 16),
    ConvUnit("32>128 1x1 @16", 128, 32, 128, 16, k=1),
    ConvUnit("256>64 1x1 @8", 128, 256, 64, 8, k=1),
    ConvUnit("64>64 3x3 @8", 128, 64, 64, 8),
    ConvUnit("64>256 1x1 @8", 128, 64, 256, 8, k=1),
]
# The distinct BN-ReLU-conv units of the ResNet-50 bottlenecks at the ImageNet batch of 256
# (the performance model's and tools/triton_aot.py's ImageNet shapes).
R50_CONVS = list(dict.fromkeys(u for b in R50_BOTTLENECKS for u in conv_units(b, 256, "r50")))
# Single fused basic units: BN -> ReLU -> Conv3x3(C -> C, stride s, padding 1, no bias),
# optional residual of the output's shape, N=64, H=W=16, float32 (issue 10's sweep: channel
# counts that are not only powers of two, strides 1 and 2, with and without residual).
BASIC_SWEEP = [
    ConvUnit(f"basic C={c} s{s}{' +res' if res else ''}", 64, c, c, 16, 3, s, res)
    for c in (16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
    for s in (1, 2)
    for res in (False, True)
]
# Single units measured on a GPU against the plain unit (3x3 with residual), N=64.
GPU_CONVS = [
    ConvUnit("cifar 16@32 3x3 +res", 64, 16, 16, 32, residual=True),
    ConvUnit("cifar 64@8 3x3 +res", 64, 64, 64, 8, residual=True),
    ConvUnit("imagenet 64@56 3x3 +res", 64, 64, 64, 56, residual=True),
]
# The self-test's cases: on a GPU realistic shapes, which between them take every tile of the
# CUTLASS kernels' table on 108- and 132-SM parts (csrc/cuda/cutlass_conv/plan.h;
# tests/test_cutlass.py checks); on CPU (the Triton interpreter) tiny ones with channel counts
# and sizes that are not multiples of the tile sizes.
SELFTEST_GPU = [
    ConvUnit("cifar 16ch 32x32", 128, 16, 16, 32, residual=True),
    ConvUnit("cifar 32ch 16x16", 128, 32, 32, 16, residual=True),
    ConvUnit("cifar 1x1 64->16", 128, 64, 16, 32, k=1),
    ConvUnit("cifar 64ch 8x8 s2", 128, 32, 64, 16, stride=2),
    ConvUnit("imagenet 64ch 56x56 n64", 64, 64, 64, 56, residual=True),
    ConvUnit("imagenet 1x1 256->64", 32, 256, 64, 56, k=1),
    ConvUnit("imagenet 256ch 14x14 n64", 64, 256, 256, 14, residual=True),
]
SELFTEST_CPU = [
    ConvUnit("tiny 5ch 7x7", 2, 5, 6, 7, residual=True),
    ConvUnit("tiny 3->17 s2", 1, 3, 17, 9, stride=2),
]
# Smoke-run shapes (CI, --quick): one of each kind, seconds on a CPU.
QUICK_BLOCKS = [
    BlockUnit("quick bottleneck 16-8-32 /2 @8", "bottleneck", 4, 16, 8, 8, 2, "conv2"),
    BlockUnit("quick basic 8-8 @8", "basic", 4, 8, 8, 8),
]
QUICK_CONVS = [
    ConvUnit("quick 8>8 3x3 @8 +res", 4, 8, 8, 8, residual=True),
    ConvUnit("quick 8>16 1x1 /2 @8", 4, 8, 16, 8, k=1, stride=2),
]

# Named sets for ``fusedres bench units --set``.
SETS = {
    "cifar": CIFAR_BOTTLENECKS + CIFAR_BASIC_BLOCKS,
    "resnet50": R50_BOTTLENECKS,
    "convs": CIFAR_CONVS,
    "basic-sweep": BASIC_SWEEP,
    "gpu-convs": GPU_CONVS,
    "quick": QUICK_BLOCKS + QUICK_CONVS,
}

_SPEC = re.compile(
    r"(?P<kind>conv|basic|bottleneck):N=(?P<n>\d+),C=(?P<cin>\d+),(?:K=(?P<k>\d+),)?"
    r"(?:CO|P)=(?P<co>\d+),HW=(?P<hw>\d+)(?:,S=(?P<s>\d+))?(?P<res>,res)?")


def parse_shape(text: str) -> ConvUnit | BlockUnit:
    """One ``--shapes`` entry. ``conv:N=64,C=48,K=3,CO=48,HW=16,S=2,res`` is a single
    BN-ReLU-conv (``K`` default 3, ``S`` default 1, ``res`` adds a residual);
    ``basic:N=128,C=16,P=32,HW=32,S=2`` and ``bottleneck:N=32,C=256,P=64,HW=56`` are whole
    pre-activation units (``P``: planes). Raises ``ValueError`` naming the entry."""
    spec = text.replace(" ", "")
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(
            f"--shapes: cannot read {text!r}; expected e.g. conv:N=64,C=48,K=3,CO=48,HW=16,S=2,res "
            f"or bottleneck:N=32,C=256,P=64,HW=56,S=1")
    kind, n, cin, co, hw = m["kind"], int(m["n"]), int(m["cin"]), int(m["co"]), int(m["hw"])
    s = int(m["s"] or 1)
    if min(n, cin, co, hw, s) < 1 or n < 2:
        raise ValueError(f"--shapes: {text!r}: expected N >= 2 and C, CO/P, HW, S >= 1")
    if kind == "conv":
        if m["co"] is not None and "P=" in spec:
            raise ValueError(f"--shapes: {text!r}: a conv unit takes CO=, not P=")
        return ConvUnit(spec, n, cin, co, hw, int(m["k"] or 3), s, bool(m["res"]))
    if m["k"] is not None or m["res"]:
        raise ValueError(f"--shapes: {text!r}: K= and res are for conv units only")
    return BlockUnit(spec, kind, n, cin, co, hw, s, "conv2")


def _all_named() -> dict[str, ConvUnit | BlockUnit]:
    return {u.name: u for units in SETS.values() for u in units}


def select(names: str | None, quick: bool, default: str) -> list[ConvUnit | BlockUnit]:
    """The units of comma-separated names, each a set of ``SETS`` or one unit's name from any
    set (``"c164 s1 64-16-64 @32"``, ``"basic C=48 s2 +res"``); ``quick`` gives the quick set.
    Raises ``ValueError`` naming ``--set`` for an unknown name."""
    if quick:
        return list(SETS["quick"])
    named = _all_named()
    out: list[ConvUnit | BlockUnit] = []
    for name in (names or default).split(","):
        name = name.strip()
        if name in SETS:
            out += SETS[name]
        elif name in named:
            out.append(named[name])
        else:
            raise ValueError(f"--set: unknown set or shape {name!r}; expected one of "
                             f"{', '.join(SETS)} or a shape name (fusedres bench units "
                             "--list)")
    return list(dict.fromkeys(out))
