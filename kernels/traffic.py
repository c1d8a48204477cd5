"""A model of DRAM traffic and FLOPs of one training step of a BN -> ReLU -> conv (+ add) unit:
the fused Triton kernels against the unfused sequence (BatchNorm, ReLU, cuDNN-style conv, add,
and their backward passes). A model, not a measurement.

Rules, the same for both sides:

* DRAM bytes: every tensor a kernel reads is read once and every tensor it writes is written
  once. Re-reads inside a kernel (the kh*kw taps' halo of an implicit GEMM, the column tiles of
  a row block, the weight) are served by L2: the fused kernels launch the column tiles of a row
  block back to back, the weight-gradient programs of one reduction split together, and a conv
  weight of these nets is at most a few MB.
* Per-tile partial results (statistics, split-K partials) and their host reductions count.
* FLOPs: the fused kernels' GEMMs are counted on their padded tiles (the configs the host rule
  picks on a GPU), so a small channel count pays for its padding; the unfused conv is counted
  at its exact 2*M*N*K (cuDNN picks fitted tiles). Elementwise FLOPs are ignored.
* Modeled time: each kernel max(bytes / (bandwidth x e_dram), FLOPs / (tensor-core rate x
  e_tensor)), summed (H100 SXM: 3.35 TB/s; 989 TFLOP/s 16-bit, 494 TF32, 67 float64). The
  efficiencies are an :class:`Efficiency`: ``ROOFLINE`` (1.0, 1.0: every kernel at 100% of the
  roofline) or the calibrated GPU model's DRAM efficiency and sustained tensor fraction
  (tools/perfmodel/traffic.py, a developer tool), with per-kernel tensor fractions where the
  SASS model gives them (benchmarks/GPU_MODEL.md has the kernel-by-kernel model).

The fused step: batch statistics (dropped when the producer's epilogue ``genstats`` made them),
forward, the weight-gradient pass (which also yields the BatchNorm backward sums: two GEMMs),
and the data-gradient pass writing dx. The "store" backward (one GEMM each, dz stored by the
data-gradient pass and an elementwise dx pass) is modeled too: it moves ~3 more activation
passes and saves one GEMM, so it wins where the GEMMs are compute-bound (wide channels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from . import batch_stats as _bs
from . import bn_relu_conv2d as _fwd
from . import bn_relu_conv2d_dgrad as _dgrad
from . import bn_relu_conv2d_wgrad as _wgrad
from ._common import cdiv

H100_BANDWIDTH = 3.35e12
H100_FLOPS = {2: 989e12, 4: 494e12, 8: 67e12}  # by element size: 16-bit, TF32, float64
H100_SMS = 132


@dataclass(frozen=True)
class Unit:
    """One BN -> ReLU -> conv (+ residual) unit: x (n, c, h, w), weight (co, c, k, k)."""

    name: str
    n: int
    c: int
    h: int
    co: int
    k: int = 3
    stride: int = 1
    residual: bool = False
    elem: int = 2  # bytes per activation element (2: fp16/bf16, 4: fp32)

    @property
    def padding(self) -> int:
        return self.k // 2

    @property
    def ho(self) -> int:
        return (self.h + 2 * self.padding - self.k) // self.stride + 1

    def act_in(self) -> int:
        return self.n * self.c * self.h * self.h * self.elem

    def act_out(self) -> int:
        return self.n * self.co * self.ho * self.ho * self.elem

    def weight(self) -> int:
        return self.co * self.c * self.k * self.k * self.elem

    def gemm_flops(self) -> int:
        return 2 * self.n * self.ho * self.ho * self.co * self.c * self.k * self.k


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the H100's peaks a kernel reaches: ``dram`` of the bandwidth, ``tensor`` of
    the tensor-core rate; ``per_kernel``: (kernel name, tensor fraction) pairs overriding
    ``tensor`` for those kernels."""

    dram: float = 1.0
    tensor: float = 1.0
    per_kernel: tuple[tuple[str, float], ...] = ()

    def tensor_for(self, name: str) -> float:
        return dict(self.per_kernel).get(name, self.tensor)

    @property
    def is_roofline(self) -> bool:
        return self.dram == 1.0 and self.tensor == 1.0 and not self.per_kernel


ROOFLINE = Efficiency()


@dataclass
class Kernel:
    name: str
    read: int
    write: int
    flops: int = 0
    programs: int = 0  # a GEMM's grid (0: not counted)

    @property
    def bytes(self) -> int:
        return self.read + self.write

    def seconds(self, elem: int, eff: Efficiency = ROOFLINE, waves: bool = False) -> float:
        """The roofline time; with ``waves``, a GEMM's tensor time over the whole waves its
        grid takes on the H100's SMs (one program an SM: 27 programs run at 27/132 of peak)."""
        fill = 1.0
        if waves and self.programs:
            fill = self.programs / (cdiv(self.programs, H100_SMS) * H100_SMS)
        return max(self.bytes / (H100_BANDWIDTH * eff.dram),
                   self.flops / (H100_FLOPS[elem] * eff.tensor_for(self.name) * fill))


@dataclass
class Step:
    kernels: list[Kernel] = field(default_factory=list)

    def add(self, *args, **kw) -> None:
        self.kernels.append(Kernel(*args, **kw))

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    def seconds(self, elem: int, eff: Efficiency = ROOFLINE, waves: bool = False) -> float:
        return sum(k.seconds(elem, eff, waves) for k in self.kernels)


def _dtype_name(elem: int) -> str:
    return {2: "fp16", 4: "fp32", 8: "fp64"}[elem]


def _dgrad_flops(u: Unit, cfg) -> int:
    """Padded-tile FLOPs of the data gradient: one launch per stride phase, each running only
    the taps that feed its pixels."""
    bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
    p, s = u.padding, u.stride
    total = 0
    for pa in range(min(s, u.h)):
        for pb in range(min(s, u.h)):
            taps = (sum((pa + p - i) % s == 0 for i in range(u.k))
                    * sum((pb + p - j) % s == 0 for j in range(u.k)))
            rows = u.n * cdiv(u.h - pa, s) * cdiv(u.h - pb, s)
            total += 2 * cdiv(rows, bm) * bm * cdiv(u.c, bn) * bn * taps * cdiv(u.co, bk) * bk
    return total


@functools.lru_cache(maxsize=4096)
def auto_strategy(u: Unit) -> str:
    """The backward plan ``FUSEDRES_TRITON_BACKWARD=auto`` (the default) runs for ``u``: the one
    whose :func:`fused_step` is the shorter on an H100 roofline whose GEMMs run in whole waves
    of their grids, "sums" on a tie. "store" where wide channels make the GEMMs compute-bound
    (the "sums" plan's weight-gradient pass runs a second GEMM for the BatchNorm sums) or where
    the "sums" weight gradient's grid is small (CIFAR's 64-channel 8x8 unit: 27 programs, its
    partials capped), "sums" where activation passes cost more (the "store" plan makes ~3
    more). Neither holds more memory: "store" writes dz into the x gradient's own
    buffer and turns it into dx in place. Cached: one decision per shape."""
    times = {s: fused_step(u, strategy=s).seconds(u.elem, waves=True) for s in ("sums", "store")}
    return min(times, key=times.get)


def fused_step(u: Unit, genstats: bool = False, strategy: str = "sums") -> Step:
    """The fused kernels' traffic, from the tiles the GPU host rules pick. ``strategy`` is the
    backend's FUSEDRES_TRITON_BACKWARD: "sums" (default) or "store". float32 is modelled with
    TF32 products (``H100_FLOPS``): the rules pick the TF32 tiles whatever cuDNN's switch."""
    import torch

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        return _fused_step(u, genstats, strategy)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def _fused_step(u: Unit, genstats: bool, strategy: str) -> Step:
    import torch

    dt = {2: torch.float16, 4: torch.float32, 8: torch.float64}[u.elem]
    s = Step()
    vec = u.c * 4  # a per-channel float32 vector
    m_in, m_out = u.n * u.h * u.h, u.n * u.ho * u.ho
    if not genstats:
        splits = _bs.pick_split(cdiv(m_in, 128), cdiv(u.c, 16), H100_SMS)
        s.add("batch_stats", u.act_in() + 2 * splits * u.c * 8, 2 * splits * u.c * 8 + 2 * vec)
    cfg = _fwd.pick_config(m_out, u.co, u.c, dt, interpret=False)
    bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
    flops = 2 * cdiv(m_out, bm) * bm * cdiv(u.co, bn) * bn * u.k * u.k * cdiv(u.c, bk) * bk
    stats = 2 * cdiv(m_out, bm) * u.co * 4 if genstats else 0  # the next unit's statistics
    s.add("fwd", u.act_in() + u.weight() + (u.act_out() if u.residual else 0) + 2 * vec,
          u.act_out() + 2 * stats, flops, cdiv(m_out, bm) * cdiv(u.co, bn))
    if strategy == "store":
        return _store_backward(s, u, dt, vec, m_in, m_out)
    # Weight gradient + BN sums: two GEMMs (dy x mask, dy x mask*xhat) reduced in the epilogue
    # to a dW partial and the sums' partials per split.
    cfg, split, groups, programs, flops = _wgrad_launch(u, dt, m_in, m_out, sums=True)
    # the BN sums' partials: (split, Co blocks, tap groups) rows of C
    sums = 2 * split * cdiv(u.co, cfg.meta["BLOCK_M"]) * groups * vec
    partials = (split * u.co * u.c * u.k * u.k * 4 if split > 1 else 0) + sums
    s.add("wgrad+sums", u.act_out() + u.act_in() + u.weight() + 6 * vec,
          partials + (u.weight() if split == 1 else 0), flops, programs)
    s.add("wgrad reduce", partials, (u.weight() if split > 1 else 0) + 2 * vec)
    # Data gradient writing dx directly.
    cfg = _dgrad.pick_config(m_in, u.c, u.co, dt, interpret=False)
    s.add("dgrad+dx", u.act_out() + u.weight() + u.act_in() + 6 * vec, u.act_in(),
          _dgrad_flops(u, cfg))
    return s


def _wgrad_launch(u: Unit, dt, m_in: int, m_out: int, sums: bool):
    """(config, split, tap groups, programs, MMA flops) of the weight-gradient launch as the
    host picks them (kernels/bn_relu_conv2d_wgrad.py, no conv bias): per tap, rows Co and
    the reduction over the output pixels; or the taps form (``use_taps``), rows (tap, Co)
    BLOCK_T taps a program, the reduction over the input pixels."""
    taps = _wgrad.use_taps(u.co, u.c, u.k, u.k, (u.stride, u.stride), want_bias=False)
    cfg = _wgrad.pick_config(u.co, u.c, dt, interpret=False, sums=sums, taps=taps)
    bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
    bt = _wgrad.taps_of(cfg)
    m = m_in if bt > 1 else m_out
    split = _wgrad.pick_split(u.co, u.c, u.k, u.k, m, cfg, H100_SMS, gemms=2 if sums else 1)
    groups = cdiv(u.k * u.k, bt)
    programs = cdiv(u.co, bm) * cdiv(u.c, bn) * groups * split
    flops = (2 if sums else 1) * 2 * cdiv(u.co, bm) * bm * bt * cdiv(u.c, bn) * bn * groups \
        * cdiv(m, bk) * bk
    return cfg, split, groups, programs, flops


def _store_backward(s: Step, u: Unit, dt, vec: int, m_in: int, m_out: int) -> Step:
    """Weight gradient (one GEMM); data gradient storing dz with the sums in its epilogue;
    the elementwise dx pass."""
    _, split, _, programs, flops = _wgrad_launch(u, dt, m_in, m_out, sums=False)
    partials = split * u.co * u.c * u.k * u.k * 4 if split > 1 else 0
    s.add("wgrad", u.act_out() + u.act_in() + 2 * vec,
          partials + (u.weight() if split == 1 else 0), flops, programs)
    if split > 1:
        s.add("wgrad reduce", partials, u.weight())
    cfg = _dgrad.pick_config(m_in, u.c, u.co, dt, interpret=False)
    rows = cdiv(m_in, cfg.meta["BLOCK_M"])
    s.add("dgrad+sums (dz)", u.act_out() + u.weight() + u.act_in() + 4 * vec,
          u.act_in() + 2 * rows * vec, _dgrad_flops(u, cfg))
    s.add("sums reduce", 2 * rows * vec, 2 * vec)
    s.add("dx", 2 * u.act_in() + 5 * vec, u.act_in())
    return s


# ----------------------------------------------------------------------------- CUDA C++ kernels

# Tiles of the CUDA C++ kernels (csrc/cuda/conv_tiles.cuh, TilesFor): (BM, BN, BK) by operand
# size; the same tile for the forward, the data gradient and the weight gradient.
CUDA_TILES = {2: (64, 64, 32), 4: (64, 64, 16), 8: (32, 32, 16)}


# pick_split's resident blocks an SM (csrc/cuda/bn_relu_conv2d_wgrad.cuh, kResident).
CUDA_WGRAD_RESIDENT = 2


def cuda_mma_operands(u: Unit) -> bool:
    """Whether unit ``u``'s channels-last x and grad_out are what csrc/cuda's mma.sync backward
    kernels take (wgrad_mma_operands: 16-bit, C and Co multiples of 8); else the weight and
    data gradients run the WMMA or FMA ones."""
    return u.elem == 2 and u.c % 8 == 0 and u.co % 8 == 0


def cuda_wgrad_tiles(u: Unit, mma: bool | None = None) -> int:
    """The weight gradient's blocks a split (launch_wgrad): the mma.sync kernel's columns run
    on across taps, cdiv(Co, BM) * cdiv(taps * C, BN); the WMMA kernel's are one tap's,
    cdiv(Co, BM) * cdiv(C, BN) * taps. ``mma`` None: the kernel that runs (cuda_mma_operands)."""
    bm, bn, _ = CUDA_TILES[u.elem]
    taps = u.k * u.k
    if cuda_mma_operands(u) if mma is None else mma:
        return cdiv(u.co, bm) * cdiv(taps * u.c, bn)
    return cdiv(u.co, bm) * cdiv(u.c, bn) * taps


def cuda_wgrad_split(u: Unit, sms: int = H100_SMS, mma: bool | None = None) -> int:
    """The weight gradient's split-K count for unit ``u`` on a GPU of ``sms`` SMs:
    :func:`cuda_pick_split` with the kernel's blocks (:func:`cuda_wgrad_tiles`) and the unit's
    16-bit (or float32, float64) dy and x: the rule csrc/cuda runs."""
    _, _, bk = CUDA_TILES[u.elem]
    m = u.n * u.ho * u.ho
    return cuda_pick_split(cuda_wgrad_tiles(u, mma), u.co, u.c, u.k * u.k, m, bk, sms,
                           m * (u.c + u.co) * u.elem, 8 if u.elem == 8 else 4)


def cuda_pick_split(tiles: int, co: int, c: int, taps: int, m: int, bk: int, sms: int,
                    operand_bytes: int, acc_bytes: int) -> int:
    """pick_split of csrc/cuda/bn_relu_conv2d_wgrad.cuh, the same integers: the split of the
    reduction over ``tiles`` blocks with the least estimated time in K-steps of one block.
    Waves of CUDA_WGRAD_RESIDENT blocks an SM, each as long as its blocks' K-steps (+ 2 a block
    for the prologue and epilogue); once split, + the partials (``acc_bytes``: a K-step per MiB,
    written and read) and the reduction's launch (8 K-steps). The partials' bytes are capped at
    half ``operand_bytes`` (dy and x), as the Triton rule caps them; splits up to 8 an SM are
    tried, ties go to the smaller."""
    mib = 1 << 20
    k_steps = cdiv(m, bk)
    limit = min(k_steps, 65535)
    partial = 2 * co * c * taps * acc_bytes
    cap = max(1, operand_bytes // (2 * partial))
    split, best = 1, None
    for s in range(1, min(limit, 8 * sms, cap) + 1):
        steps = cdiv(k_steps, s)
        if cdiv(k_steps, steps) != s:
            continue
        cost = cdiv(tiles * s, sms * CUDA_WGRAD_RESIDENT) * CUDA_WGRAD_RESIDENT * (steps + 2) * mib
        if s > 1:
            cost += s * partial + 8 * mib
        if best is None or cost < best:
            split, best = s, cost
    return cdiv(k_steps, cdiv(k_steps, max(1, min(split, limit))))


def cuda_fused_step(u: Unit, genstats: bool = False) -> Step:
    """The CUDA C++ kernels' traffic (csrc/cuda, default "sums" backward): batch statistics
    (dropped with genstats), forward (genstats partials per row tile), the weight-gradient pass
    with the BatchNorm sums (two GEMMs; float32 partials of dW when the reduction is split, and of
    the sums, then reduced), and the data gradient writing dx."""
    from ._common import KernelConfig

    bm, bn, bk = CUDA_TILES[u.elem]
    s = Step()
    vec = u.c * 4
    m_out = u.n * u.ho * u.ho
    acc = 8 if u.elem == 8 else 4
    if not genstats:
        # csrc/cuda/batch_stats.cu: (count, mean, M2) partials per channel and split.
        values = u.n * u.h * u.h
        splits = max(min(1024, max(1, cdiv(values, 256 * 16))), cdiv(values, 1 << 22))
        s.add("batch_stats", u.act_in() + 3 * splits * u.c * acc, 3 * splits * u.c * acc + 2 * vec)
    flops = 2 * cdiv(m_out, bm) * bm * cdiv(u.co, bn) * bn * u.k * u.k * cdiv(u.c, bk) * bk
    stats = 2 * cdiv(m_out, bm) * u.co * acc if genstats else 0
    s.add("fwd", u.act_in() + u.weight() + (u.act_out() if u.residual else 0) + 2 * vec,
          u.act_out() + stats, flops)
    if genstats:
        s.add("genstats merge", stats, 2 * u.co * 4)
    split = cuda_wgrad_split(u)
    taps = u.k * u.k
    sums = 2 * split * cdiv(u.co, bm) * taps * vec
    dw_partials = split * u.co * u.c * taps * acc if split > 1 else 0
    flops = 2 * 2 * cuda_wgrad_tiles(u) * bm * bn * cdiv(m_out, bk) * bk
    s.add("wgrad+sums", u.act_out() + u.act_in() + 2 * u.weight() + 6 * vec,
          dw_partials + sums + (0 if dw_partials else u.weight()), flops)
    s.add("wgrad reduce", dw_partials + sums, (u.weight() if dw_partials else 0) + 2 * vec)
    cfg = KernelConfig.of(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    s.add("dgrad+dx", u.act_out() + u.weight() + u.act_in() + 6 * vec, u.act_in(),
          _dgrad_flops(u, cfg))
    return s


def unfused_step(u: Unit) -> Step:
    """BatchNorm (stats + normalise), ReLU, conv, add; backward of each (cuDNN-style)."""
    s = Step()
    x, y, w, vec = u.act_in(), u.act_out(), u.weight(), u.c * 4
    s.add("bn stats", x, 2 * vec)
    s.add("bn normalise", x + 2 * vec, x)
    s.add("relu", x, x)
    s.add("conv fwd", x + w, y, u.gemm_flops())
    if u.residual:
        s.add("add", 2 * y, y)
    # add backward: the gradient passes through to both inputs, no traffic.
    s.add("conv dgrad", y + w, x, u.gemm_flops())
    s.add("conv wgrad", y + x, w, u.gemm_flops())
    s.add("relu backward", 2 * x, x)
    s.add("bn backward reduce", 2 * x, 2 * vec)
    s.add("bn backward dx", 2 * x + 4 * vec, x)
    return s


# Units of the nets in the paper: pre-activation ResNets on CIFAR (batch 128) and ImageNet
# (batch 256), 16-bit activations.
CIFAR_UNITS = [
    Unit("cifar basic 16@32", 128, 16, 32, 16, residual=True),
    Unit("cifar basic 32@16", 128, 32, 16, 32, residual=True),
    Unit("cifar basic 64@8", 128, 64, 8, 64, residual=True),
    Unit("cifar bottleneck 3x3 16@32", 128, 16, 32, 16),
    Unit("cifar bottleneck 1x1 64->16@32", 128, 64, 32, 16, k=1),
]
IMAGENET_UNITS = [
    Unit("imagenet basic 64@56", 256, 64, 56, 64, residual=True),
    Unit("imagenet basic 128@28", 256, 128, 28, 128, residual=True),
    Unit("imagenet basic 256@14", 256, 256, 14, 256, residual=True),
    Unit("imagenet basic 512@7", 256, 512, 7, 512, residual=True),
    Unit("imagenet bottleneck 3x3 64@56", 256, 64, 56, 64),
    Unit("imagenet bottleneck 1x1 256->64@56", 256, 256, 56, 64, k=1),
]
# The expanding 1x1 of a bottleneck (c -> 4c, + residual): its traffic is dominated by the 4x
# larger output side (y, dy, residual), which fusion does not touch; see bottleneck_blocks().
EXPANDING_UNITS = [
    Unit("cifar bottleneck 1x1 16->64@32", 128, 16, 32, 64, k=1, residual=True),
    Unit("imagenet bottleneck 1x1 64->256@56", 256, 64, 56, 256, k=1, residual=True),
]


def bottleneck_blocks() -> list[tuple[str, list[Unit]]]:
    """Whole pre-activation bottleneck blocks (1x1 reduce, 3x3, 1x1 expand + residual)."""
    out = []
    for name, n, c, h in (("cifar bottleneck block 64@32", 128, 16, 32),
                          ("imagenet bottleneck block 256@56", 256, 64, 56)):
        out.append((name, [Unit(f"{name} a", n, 4 * c, h, c, k=1), Unit(f"{name} b", n, c, h, c),
                           Unit(f"{name} c", n, c, h, 4 * c, k=1, residual=True)]))
    return out


def report(units=None, genstats: bool = False, strategy: str = "sums",
           kernels: str = "triton", eff: Efficiency = ROOFLINE) -> str:
    """A table: bytes and modeled H100 time of the fused and unfused training step, for the
    Triton kernels (``strategy``: their backward) or the CUDA C++ kernels (``kernels="cuda"``),
    at the efficiencies ``eff`` (default: 100% of the roofline)."""
    units = units or CIFAR_UNITS + IMAGENET_UNITS + EXPANDING_UNITS
    if kernels == "cuda":
        def fused_step_(u, genstats, strategy):  # noqa: ARG001 - one strategy ("sums")
            return cuda_fused_step(u, genstats)
        title = "CUDA C++ kernels (csrc/cuda), "
    else:
        fused_step_ = fused_step
        title = "Triton kernels, "
    head = (f"{'unit':<38}{'unfused MB':>11}{'fused MB':>10}{'bytes':>7}"
            f"{'unfused us':>11}{'fused us':>10}{'time':>7}")
    at = "" if eff.is_roofline else (f", at {eff.dram:.0%} of DRAM bandwidth and "
                                     f"{eff.tensor:.0%} of tensor peak (modeled efficiency)")
    lines = [f"MODEL (not measured): DRAM bytes and H100 time of one training step, {title}"
             f"{'with' if genstats else 'without'} genstats, backward strategy {strategy}{at}",
             head, "-" * len(head)]
    for u in units:
        a, b = unfused_step(u), fused_step_(u, genstats, strategy)
        ta, tb = a.seconds(u.elem, eff), b.seconds(u.elem, eff)
        lines.append(f"{u.name:<38}{a.bytes / 1e6:>11.1f}{b.bytes / 1e6:>10.1f}"
                     f"{b.bytes / a.bytes:>7.2f}{ta * 1e6:>11.1f}{tb * 1e6:>10.1f}{tb / ta:>7.2f}")
    for name, block in bottleneck_blocks():
        a = sum(unfused_step(u).bytes for u in block)
        b = sum(fused_step_(u, genstats, strategy).bytes for u in block)
        ta = sum(unfused_step(u).seconds(u.elem, eff) for u in block)
        tb = sum(fused_step_(u, genstats, strategy).seconds(u.elem, eff) for u in block)
        lines.append(f"{name:<38}{a / 1e6:>11.1f}{b / 1e6:>10.1f}{b / a:>7.2f}"
                     f"{ta * 1e6:>11.1f}{tb * 1e6:>10.1f}{tb / ta:>7.2f}")
    return "\n".join(lines)

