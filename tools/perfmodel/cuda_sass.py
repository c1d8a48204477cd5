"""The CUDA C++ kernels (csrc/cuda) through the same SASS reading: nvcc compiles each .cu for
sm_80 and sm_90 with the extension's flags (tools/cuda_aot.py), cuobjdump disassembles the
object, and each 16-bit tensor-core (WMMA or mma.sync) kernel's main loop is read: the loop
carrying the HMMA instructions with no such loop inside it.

The WMMA kernels stage their operands through loops nested in the main loop (``for (e = tid;
e < BM * BK; e += THREADS)``), which nvcc leaves rolled: their trip counts are not in the SASS.
(The mma.sync kernels copy with unrolled 16-byte cp.async: no nested loop, both ends equal.)
The table gives both ends: the main loop's own instructions plus each nested loop's body once
(a lower bound on one K chunk's issue), and plus each nested body times T = BM*BK/THREADS, the
tile elements a thread stages (an estimate: every nested loop a staging loop that runs). Per
K chunk and SM, issue cycles = ceil(warps/4) x instructions and tensor cycles = the chunk's
multiply-adds / the per-SM rate (devices.py); the ceiling on the fraction of tensor peak is
tensor / max(issue, tensor). No per-shape time: the launches of csrc/cuda are not captured.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

from . import sass
from .devices import A100, H100

_TILE = re.compile(r"TileILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb([01])E")
# The mma.sync kernels whose tile is a template argument MmaFwd<BM, BN, WARPS_M, WARPS_N, BK>
# (csrc/cuda/bn_relu_conv2d.cu) or MmaDgrad<BM, BN, WARPS_M, WARPS_N, BK>
# (bn_relu_conv2d_dgrad.cuh), BK defaulted to 32 (a demangled name states it; a name without it
# reads as 32), the data gradient's taps a K chunk covers (TAPS) after it, 1 unless stated;
# 32 * WARPS_M * WARPS_N threads; demangled.
_MMA_TILE = re.compile(r"Mma(?:Fwd|Dgrad)<(\d+), (\d+), (\d+), (\d+)(?:, (\d+))?(?:, (\d+))?\s*>")
_MMA_TILE_BK = 32
# Kernels whose tile is fixed in their source rather than a Tile<> argument: name ->
# (BM, BN, BK, THREADS), kept equal to the source (csrc/cuda/bn_relu_conv2d_wgrad.cuh,
# struct MmaWgrad).
_FIXED_TILES = {"wgrad_mma_kernel": (64, 64, 16, 128)}
# The CUTLASS kernels (csrc/cuda/cutlass_conv): cutlass_conv_kernel<Fprop|Wgrad<element,
# ConvTile<BM, BN, WM, WN, STAGES, Launch<THREADS, SMEM> > > >, BK = 32; demangled.
_CUTLASS = re.compile(r"cutlass_conv_kernel<(Fprop|Wgrad)<cutlass::(half_t|bfloat16_t), "
                      r"ConvTile<(\d+), (\d+), (\d+), (\d+), (\d+), Launch<(\d+), (\d+)>")
CUTLASS_BK = 32


# The weight gradient's split unit (pixels; pick_split and launch_wgrad's K-step, both kernels):
# a split runs cdiv(cdiv(M, 32), split) of them, in chunks of the kernel's BK.
WGRAD_KSTEP = 32


@dataclass
class CudaKernelRow:
    file: str
    name: str            # demangled, shortened
    arch: int
    bm: int
    bn: int
    bk: int
    threads: int
    registers: int
    spill: int
    smem: int
    own: int             # main-loop instructions outside nested loops
    nested: int          # nested loops inside the main loop
    nested_body: int     # their bodies' instructions, summed
    mma: dict            # SASS tensor instruction shape -> count per warp per K chunk
    fma_cta: int         # multiply-adds per CTA per K chunk
    taps: int = 1        # taps a K chunk covers (the data gradient's MmaDgradPaired: 2)

    @property
    def stage_trips(self) -> int:
        return max(1, self.bm * self.bk // self.threads)

    def issue_cycles(self, upper: bool) -> float:
        per_warp = self.own + self.nested_body * (self.stage_trips if upper else 1)
        return math.ceil(self.threads / 32 / 4) * per_warp

    def tensor_cycles(self) -> float:
        dev = A100 if self.arch == 80 else H100
        return self.fma_cta / dev.tensor_fma_clk_sm["fp16"]

    def ceiling(self, upper: bool) -> float:
        t = self.tensor_cycles()
        return t / max(t, self.issue_cycles(upper)) if t else 0.0


def _split_by_arch(text: str) -> dict[int, str]:
    out: dict[int, list[str]] = {}
    arch = None
    for line in text.splitlines():
        m = re.search(r"code for sm_(\d+)|arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1) or m.group(2))
            out.setdefault(arch, [])
            continue
        if arch is not None:
            out[arch].append(line)
    return {a: "\n".join(v) for a, v in out.items()}


def _short(demangled: str) -> str:
    s = re.sub(r"fusedres::(cuda|cutlass_conv)::\(anonymous namespace\)::", "", demangled)
    s = s.replace("c10::", "").replace("fusedres::cuda::", "").replace(
        "fusedres::cutlass_conv::", "")
    return s.split("(")[0]


def compile_object(src: str, archs=(80, 90)) -> bytes:
    """nvcc's object for ``src`` (csrc/cuda/*.cu), sm_80 and sm_90 code, the one
    tools/cuda_aot.py's table reads (cached in build/nvcc-cache); raises FileNotFoundError when
    nvcc is missing, RuntimeError when it fails."""
    from .. import cuda_aot

    nvcc = cuda_aot.find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH or under CUDA_HOME")
    return cuda_aot.compile_cached(nvcc, src, tuple(archs)).obj


def cuobjdump(obj: bytes, *flags: str) -> list[str]:
    """cuobjdump's output for each of ``flags`` (one run each) on an nvcc object."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.o")
        with open(path, "wb") as f:
            f.write(obj)
        return [subprocess.run([sass.tool("cuobjdump"), flag, path], capture_output=True,
                               text=True, check=False).stdout for flag in flags]


def analyse_object(obj: bytes, file: str,
                   declared: dict[str, int] | None = None) -> list[CudaKernelRow]:
    """One row per 16-bit tensor-core kernel instantiation (WMMA: X == W == Half or BFloat16;
    the mma.sync kernels: Half, BFloat16) and arch. ``declared``: the file's declared dynamic
    shared memory (tools.cuda_aot.declared_dynamic_smem), added to a kernel's static bytes."""
    from .. import cuda_aot

    dump, usage = cuobjdump(obj, "-sass", "-res-usage")
    res_by_arch: dict[int, dict[str, dict[str, int]]] = {}
    for arch, text in _split_by_arch(usage).items():
        cur = None
        for line in text.splitlines():
            m = re.match(r"\s*Function\s+(\S+):", line)
            if m:
                cur = m.group(1)
            elif cur and "REG:" in line:
                res_by_arch.setdefault(arch, {})[cur] = {
                    k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    declared = declared or {}
    rows = []
    for arch, text in sorted(_split_by_arch(dump).items()):
        funcs = sass.parse(text)
        names = cuda_aot.demangle(sorted(funcs))
        for mangled, code in funcs.items():
            tile = _TILE.search(mangled)
            dem = names.get(mangled, mangled)
            fixed = next((t for n, t in _FIXED_TILES.items() if f"{n}<" in dem), None)
            mt = _MMA_TILE.search(dem)
            ct = _CUTLASS.search(_short(dem))
            if ct is not None:  # both 16-bit types
                fixed = (int(ct.group(3)), int(ct.group(4)), CUTLASS_BK, int(ct.group(8)))
                bm, bn, bk, threads = fixed
            elif mt is not None:
                wm, wn = int(mt.group(3)), int(mt.group(4))
                fixed = (int(mt.group(1)), int(mt.group(2)), int(mt.group(5) or _MMA_TILE_BK),
                         32 * wm * wn)
            if ct is not None:
                pass
            elif fixed is not None:
                if not re.search(r"<(Half|BFloat16)[,>]", dem.replace("c10::", "")):
                    continue
                bm, bn, bk, threads = fixed
            elif tile is None or tile.group(5) != "1":
                continue  # FMA tiles (float32 / float64): no tensor-core loop
            elif not re.search(r"<(Half|BFloat16), \1,", dem.replace("c10::", "")):
                continue
            else:
                bm, bn, bk, threads = (int(tile.group(i)) for i in range(1, 5))
            k = sass.analyse(mangled, code)
            if k.main is None or not k.per_iter.mma_shapes:
                continue
            nested = [lp for lp in k.loops if lp.parent is k.main]
            own = sass.count(code, k.main.head, k.main.tail, nested)
            warps = threads // 32
            fma_cta = sum(v * warps for v in k.per_iter.mma_warp.values())
            u = res_by_arch.get(arch, {}).get(mangled, {})
            rows.append(CudaKernelRow(
                file, _short(dem), arch, bm, bn, bk, threads, u.get("REG", 0),
                u.get("LOCAL", 0),
                # a CUTLASS kernel's shared memory is dynamic: its Launch<> states it
                int(ct.group(9)) if ct is not None else
                u.get("SHARED", 0) + cuda_aot.dynamic_smem(_short(dem), declared),
                own.total, len(nested),
                sum(sass.count(code, lp.head, lp.tail).total for lp in nested),
                dict(k.per_iter.mma_shapes), fma_cta,
                int(mt.group(6) or 1) if ct is None and mt is not None else 1))
    return rows


def cuda_rows(root: str) -> list[CudaKernelRow]:
    from .. import cuda_aot

    srcs = cuda_aot.sources(root)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # nvcc runs in its own processes
        objs = list(pool.map(compile_object, srcs))
    return [row for src, obj in zip(srcs, objs)
            for row in analyse_object(obj, os.path.relpath(src, root),
                                      cuda_aot.declared_dynamic_smem(src))]


def table(rows: list[CudaKernelRow]) -> list[str]:
    lines = ["| file | kernel | GPU | tile BMxBNxBK / threads | regs | spill B | smem B "
             "| main loop own instrs | nested loops (body instrs) | MMA/warp/K chunk | issue "
             "cycles/K chunk (low - est.) | tensor cycles/K chunk | MODELED tensor-peak ceiling "
             "(est. - high) |",
             "|---|---|---|---|---:|---:|---:|---:|---|---|---|---:|---|"]
    for r in rows:
        mma = ", ".join(f"{s}x{n}" for s, n in sorted(r.mma.items()))
        lines.append(
            f"| {r.file} | {r.name} | {'A100' if r.arch == 80 else 'H100'} | {r.bm}x{r.bn}x"
            f"{r.bk} / {r.threads} | {r.registers} | {r.spill} | {r.smem} | {r.own} | "
            f"{r.nested} ({r.nested_body}) | {mma} | {r.issue_cycles(False):.0f} - "
            f"{r.issue_cycles(True):.0f} | {r.tensor_cycles():.0f} | "
            f"{100 * r.ceiling(True):.0f}% - {100 * r.ceiling(False):.0f}% |")
    return lines


# ----------------------------------------------------------------------------- per unit


@dataclass
class CudaUnitModel:
    """The CUDA C++ backend's fused step (16-bit) on one device: (kernel, low s, high s,
    bound at high) per launch, a RANGE (see :func:`model_cuda_unit`)."""

    unit: object
    dtype: str
    arch: int
    kernels: list
    # The launches on the forward side (the forward GEMM, its weight copies, the batch
    # statistics, the forward's affine): model_cutlass_unit keeps the rest when it prices the
    # native backward after the CUTLASS forward.
    forward: frozenset = frozenset()

    @property
    def low_s(self) -> float:
        return sum(k[1] for k in self.kernels)

    @property
    def high_s(self) -> float:
        return sum(k[2] for k in self.kernels)


def _row(rows: list[CudaKernelRow], arch: int, kernel: str, dtype: str,
         sums: bool | None = None, bm: int | None = None, bn: int | None = None,
         bk: int | None = None, taps: int = 1) -> CudaKernelRow:
    t = "Half" if dtype == "fp16" else "BFloat16"
    for r in rows:
        # <X, W, Tile...> instantiations, the fixed-tile kernels' <W> and <W, SUMS>
        # (_FIXED_TILES), or <W, MmaFwd<...> > (_MMA_TILE) with ``bm`` rows.
        if r.arch == arch and (r.name.startswith((f"{kernel}<{t}, {t},", f"{kernel}<{t}, Mma"))
                               or r.name in (f"{kernel}<{t}>", f"{kernel}<{t}, true>",
                                             f"{kernel}<{t}, false>")) and (
                sums is None or r.name.rstrip(" >").endswith("true" if sums else "false")) and (
                bm is None or r.bm == bm) and (bn is None or r.bn == bn) and (
                bk is None or r.bk == bk) and r.taps == taps:
            return r
    raise ValueError(f"no {kernel} <{t}> instantiation (bm {bm}, bn {bn}, bk {bk}) for "
                     f"sm_{arch} in the CUDA rows")


def _launch(r: CudaKernelRow, label: str, ctas: int, chunks: float, dram: float,
            upper: bool):
    """A model.Launch whose main loop issues, a K chunk, the row's own instructions plus each
    nested body once (``upper`` False) or T times (True), and its MMA work; prologue and
    epilogue not counted."""
    from . import model

    per_iter = sass.Counts()
    per_iter.instrs["other"] = r.own + (r.stage_trips if upper else 1) * r.nested_body
    per_iter.mma_warp["fp16"] = r.fma_cta // (r.threads // 32)
    k = sass.KernelSass(label, [], [], sass.Loop(0, 0), per_iter, sass.Counts(), sass.Counts())
    return model.Launch(label, k, model.Resources(r.registers, r.smem, r.threads // 32), ctas,
                        model.Trips(chunks), dram)


def forward_kernel(u, forward: str = "mma", channels_last: bool = True) -> str:
    """The forward kernel csrc/cuda runs for 16-bit unit ``u`` (use_mma_forward in
    csrc/cuda/bn_relu_conv2d.cu): the mma.sync one for channels-last x with C % 8 == 0 unless
    ``forward`` is "wmma" (the WMMA kernel priced for the same unit), else the WMMA one."""
    if forward not in ("mma", "wmma"):
        raise ValueError(f"forward: 'mma' or 'wmma', not {forward!r}")
    if forward == "mma" and channels_last and u.c % 8 == 0:
        return "bn_relu_conv2d_fwd_mma_kernel"
    return "bn_relu_conv2d_fwd_kernel"


def mma_cols(n: int) -> int:
    """The mma.sync forward's and data gradient's tile columns for n channels on the output side
    (the forward's Co, the data gradient's C; mma_cols in csrc/cuda/mma_tiles.cuh): 16 or 32
    (the thin tiles, MmaFwd / MmaDgrad<BM, 16 or 32, 4, 1, BK>) for n <= 16 or 32, else 64."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


def mma_depth(n: int, k: int) -> int:
    """Their K chunk for n output-side and k reduced channels (the forward's C, the data
    gradient's Co; mma_depth in csrc/cuda/mma_tiles.cuh): 16 where the tile is 16 columns and
    k <= 16, else 32."""
    return 16 if mma_cols(n) == 16 and k <= 16 else 32


def forward_mma_rows(m: int, co: int, sms: int) -> int:
    """The mma.sync forward's tile rows for m output pixels and co output channels on a GPU of
    ``sms`` SMs (forward_mma_rows in csrc/cuda/bn_relu_conv2d.cu): 128 when
    cdiv(m, 128) * cdiv(co, mma_cols(co)) >= sms, else 64 (for co > 32:
    MmaFwd<128, 64, 4, 1>, MmaFwd<64, 64, 2, 2>)."""
    return 128 if -(-m // 128) * -(-co // mma_cols(co)) >= sms else 64


def dgrad_mma_rows(rows: int, c: int, phases: int, sms: int) -> int:
    """The mma.sync data gradient's tile rows for ``rows`` pixels of the largest stride phase,
    c input channels and ``phases`` phases on a GPU of ``sms`` SMs (dgrad_mma_rows in
    csrc/cuda/bn_relu_conv2d_dgrad.cuh): 128 when
    cdiv(rows, 128) * cdiv(c, mma_cols(c)) * phases >= sms, else 64 (for c > 32:
    MmaDgrad<128, 64, 4, 1>, MmaDgrad<64, 64, 2, 2>)."""
    return 128 if -(-rows // 128) * -(-c // mma_cols(c)) * phases >= sms else 64


def dgrad_mma_cols(rows: int, c: int, phases: int, sms: int, arch: int) -> int:
    """The mma.sync data gradient's tile columns (dgrad_mma_cols in
    csrc/cuda/bn_relu_conv2d_dgrad.cuh): on sm_90 and newer (``arch`` 90), 128
    (MmaDgrad<128, 128, 2, 2>, the wide tile) for c > 64 where
    cdiv(rows, 128) * cdiv(c, 128) * phases >= sms, else :func:`mma_cols`."""
    if arch >= 90 and c > 64 and -(-rows // 128) * -(-c // 128) * phases >= sms:
        return 128
    return mma_cols(c)


def phase_tap_counts(k: int, s: int, p: int, h: int, d: int = 1) -> list[int]:
    """Along one axis of a k-tap filter at stride s, padding p, dilation d over h pixels: how
    many taps feed each stride phase a (tap i feeds it where (a + p - i * d) % s == 0, the
    test of csrc/cuda/bn_relu_conv2d_dgrad.cuh's tap loops and dgrad_phase_taps)."""
    return [sum((a + p - i * d) % s == 0 for i in range(k)) for a in range(min(s, h))]


def dgrad_phase_taps(k: int, s: int, p: int, h: int, d: int = 1) -> int:
    """The most taps feeding one stride phase of a square k x k data gradient at stride s,
    padding p, dilation d over an h x h input (dgrad_phase_taps in
    csrc/cuda/bn_relu_conv2d_dgrad.cuh)."""
    per = phase_tap_counts(k, s, p, h, d)
    return max(per) ** 2 if per else 0


def dgrad_mma_taps(c: int, co: int, phase_taps: int, arch: int) -> int:
    """Taps a K chunk of the mma.sync data gradient covers (dgrad_mma_taps in
    csrc/cuda/bn_relu_conv2d_dgrad.cuh): on sm_90 and newer (``arch`` 90), 2
    (MmaDgrad<BM, 16, 4, 1, 32, 2>, 32-deep chunks of two taps' 16 channels) where its tile is
    16 columns and 16 deep and some stride phase has more than one tap (``phase_taps``:
    :func:`dgrad_phase_taps`), else 1."""
    return 2 if (arch >= 90 and mma_cols(c) == 16 and mma_depth(c, co) == 16
                 and phase_taps > 1) else 1


def wgrad_kernel(u, wgrad: str = "mma", channels_last: bool = True) -> str:
    """The weight-gradient kernel csrc/cuda runs for 16-bit unit ``u`` (wgrad_uses_mma in
    csrc/cuda/bn_relu_conv2d_wgrad.cuh): the mma.sync one for channels-last x and grad_out
    with C and Co multiples of 8 unless ``wgrad`` is "wmma", else the WMMA one."""
    from fusedres.kernels import traffic

    if wgrad not in ("mma", "wmma"):
        raise ValueError(f"wgrad: 'mma' or 'wmma', not {wgrad!r}")
    if wgrad == "mma" and channels_last and traffic.cuda_mma_operands(u):
        return "wgrad_mma_kernel"
    return "wgrad_kernel"


def dgrad_kernel(u, dgrad: str = "mma", channels_last: bool = True) -> str:
    """The data-gradient kernel csrc/cuda runs for 16-bit unit ``u`` (dgrad_uses_mma in
    csrc/cuda/bn_relu_conv2d_dgrad.cuh): the mma.sync one for channels-last x and grad_out
    with C and Co multiples of 8 and at most 64 taps unless ``dgrad`` is "wmma", else
    the WMMA one."""
    from fusedres.kernels import traffic

    if dgrad not in ("mma", "wmma"):
        raise ValueError(f"dgrad: 'mma' or 'wmma', not {dgrad!r}")
    if dgrad == "mma" and channels_last and traffic.cuda_mma_operands(u) and u.k * u.k <= 64:
        return "dgrad_mma_kernel"
    return "dgrad_kernel"


def _dgrad_grid(u, dtype: str, dev, rows: list[CudaKernelRow],
                name: str) -> tuple[CudaKernelRow, int, float]:
    """The data-gradient kernel ``name``'s row (the mma.sync one's tile by
    :func:`dgrad_mma_rows`, :func:`dgrad_mma_cols` and :func:`dgrad_mma_taps`), its blocks over
    every stride phase (cdiv(rows, BM) x cdiv(C, BN) each) and their mean K chunks (the phase's
    taps, or pairs of them, x cdiv(Co, the channels a tap has in a chunk))."""
    from fusedres.kernels._common import cdiv

    p, s = u.padding, u.stride
    mma = name == "dgrad_mma_kernel"
    phase_rows, phases = u.n * cdiv(u.h, s) * cdiv(u.h, s), min(s, u.h) ** 2
    per = phase_tap_counts(u.k, s, p, u.h)  # taps a phase along each axis
    pair = dgrad_mma_taps(u.c, u.co, max(per) ** 2, dev.arch) if mma else 1
    dg = _row(rows, dev.arch, name, dtype,
              bm=dgrad_mma_rows(phase_rows, u.c, phases, dev.sms) if mma else None,
              bn=dgrad_mma_cols(phase_rows, u.c, phases, dev.sms, dev.arch) if mma else None,
              bk=mma_depth(u.c, u.co) * pair if mma else None, taps=pair)
    ctas, work = 0, 0.0
    for pa in range(min(s, u.h)):
        for pb in range(min(s, u.h)):
            ph_taps = per[pa] * per[pb]
            tiles = cdiv(u.n * cdiv(u.h - pa, s) * cdiv(u.h - pb, s), dg.bm) * cdiv(u.c, dg.bn)
            ctas += tiles
            work += tiles * cdiv(ph_taps, pair) * cdiv(u.co, dg.bk // pair)
    return dg, ctas, work / ctas


def model_cuda_unit(u, dtype: str, dev, rows: list[CudaKernelRow], forward: str = "mma",
                    channels_last: bool = True, wgrad: str = "mma",
                    dgrad: str = "mma", weight_channels_last: bool = True) -> CudaUnitModel:
    """The CUDA C++ backend's training step of unit ``u`` (kernels/traffic.Unit, 16-bit) on
    ``dev``, as csrc/cuda launches it ("sums" backward; 128 threads and 64x64 tiles for every
    16-bit kernel here but the mma.sync forward's and data gradient's per-shape tiles):

    * fwd: the kernel that runs (:func:`forward_kernel`): for channels-last x with C % 8 == 0,
      the benchmark units, the mma.sync kernel bn_relu_conv2d_fwd_mma_kernel (struct MmaFwd:
      128 rows where they fill the SMs, else 64, :func:`forward_mma_rows`; 16, 32 or 64
      columns by Co, :func:`mma_cols`; BK = 16 or 32 by C, :func:`mma_depth`), after a
      DRAM-bound launch packing the weight to (kh*kw*C, Co8); ``forward="wmma"``
      or NCHW x prices the WMMA kernel bn_relu_conv2d_fwd_kernel
      instead. Grid cdiv(M, BM) x cdiv(Co, BN); K chunks: kh*kw taps x cdiv(C, BK);
    * wgrad (SUMS): the kernel that runs (:func:`wgrad_kernel`): for channels-last x and
      grad_out with C and Co multiples of 8, the benchmark units, the mma.sync kernel
      wgrad_mma_kernel (struct MmaWgrad); ``wgrad="wmma"`` or NCHW
      prices the WMMA kernel wgrad_kernel. Grid cdiv(Co, BM) x cdiv(taps*C, BN) (mma.sync: the
      columns run on across taps) or cdiv(C, BN)*taps (WMMA) x split (pick_split with the
      device's SMs); K chunks: cdiv(cdiv(M, 32), split) K-steps of 32
      pixels, each 32 / BK chunks (BK = 16 for the mma.sync kernel, 32 for the WMMA one);
    * dgrad writing dx: the kernel that runs (:func:`dgrad_kernel`): for the same units the
      mma.sync kernel dgrad_mma_kernel (struct MmaDgrad: 128 rows where they fill the SMs,
      else 64, :func:`dgrad_mma_rows`; 16, 32, 64 or 128 columns, :func:`dgrad_mma_cols`;
      BK = 16 or 32 by Co, :func:`mma_depth`), reading a channels-last weight in place, else
      after a DRAM-bound launch packing it to (kh*kw*Co, C) (:func:`weight_copied`;
      ``weight_channels_last``, True by default: what a channels-last model holds);
      ``dgrad="wmma"`` or NCHW the WMMA
      kernel dgrad_kernel. Grid per stride phase cdiv(rows, BM) x cdiv(C, BN); K chunks: the
      phase's taps x cdiv(Co, BK);
    * batch statistics (the partials and the finalize), the BatchNorm affine (one launch in
      the forward and one in the backward), the split's dW partials summed into the weight
      (wgrad_partials_sum) and the BatchNorm sums reduced (bn_sums): DRAM-bound launches at
      least the launch gap each; every launch the host makes for the step (benchmarks/HOST.md
      counts them; tests/test_cutlass.py::test_nvcc_model_prices_every_launch_the_host_makes
      holds this list to the host's count). Priced by their bytes: where few blocks each add
      a long run of values in order (bn_sums' one-block reduction, up to 2,048 rows a
      channel, 256 a thread), memory latency may bound the launch above that price, which
      the model does not see.

    DRAM bytes: kernels/traffic.cuda_fused_step. A RANGE: issue per K chunk counts each nested
    staging loop once (low) or T = BM*BK/THREADS times (high), no prologue or epilogue (the
    mma.sync kernels have no nested loop: their cp.async copies are unrolled, low = high)."""
    from fusedres.kernels import traffic
    from fusedres.kernels._common import cdiv

    from . import model

    if dtype not in ("fp16", "bf16"):
        raise ValueError(f"dtype: the CUDA estimate covers fp16 and bf16, not {dtype!r}")
    tu = traffic.Unit(u.name, u.n, u.c, u.h, u.co, u.k, u.stride, u.residual, 2)
    dram = {k.name: k.bytes for k in traffic.cuda_fused_step(tu).kernels}
    taps = u.k * u.k
    m_out = u.n * u.ho * u.ho
    out = []
    fwd_name = forward_kernel(u, forward, channels_last)
    fwd_mma = fwd_name == "bn_relu_conv2d_fwd_mma_kernel"
    fwd = _row(rows, dev.arch, fwd_name, dtype,
               bm=forward_mma_rows(m_out, u.co, dev.sms) if fwd_mma else None,
               bn=mma_cols(u.co) if fwd_mma else None,
               bk=mma_depth(u.co, u.c) if fwd_mma else None)
    out.append(("fwd", fwd, cdiv(m_out, fwd.bm) * cdiv(u.co, fwd.bn),
                taps * cdiv(u.c, fwd.bk), dram["fwd"]))
    wg_name = wgrad_kernel(u, wgrad, channels_last)
    wg_mma = wg_name == "wgrad_mma_kernel"
    wg = _row(rows, dev.arch, wg_name, dtype, sums=True)
    split = traffic.cuda_wgrad_split(tu, dev.sms, mma=wg_mma)
    out.append(("wgrad+sums", wg, traffic.cuda_wgrad_tiles(tu, mma=wg_mma) * split,
                cdiv(cdiv(m_out, WGRAD_KSTEP), split) * WGRAD_KSTEP // wg.bk,
                dram["wgrad+sums"]))
    dg_name = dgrad_kernel(u, dgrad, channels_last)
    dg, ctas, chunks = _dgrad_grid(u, dtype, dev, rows, dg_name)
    out.append(("dgrad+dx", dg, ctas, chunks, dram["dgrad+dx"]))
    kernels = []
    for name, r, n, chunks, nbytes in out:
        low = model.predict(_launch(r, name, n, chunks, nbytes, False), dev)
        high = model.predict(_launch(r, name, n, chunks, nbytes, True), dev)
        kernels.append((name, low.time_s, high.time_s, high.bound))
    fwd_side_names = {"fwd"}

    def dram_launch(name: str, nbytes: float, fwd_side: bool = False):
        t = nbytes / (dev.dram_bytes_s * model.DRAM_EFFICIENCY) + model.LAUNCH_S
        kernels.append((name, t, t, "dram"))
        if fwd_side:
            fwd_side_names.add(name)

    if fwd_name == "bn_relu_conv2d_fwd_mma_kernel":
        # pack_weight: the permuted copy (kh*kw*C, Co), then zero columns up to Co8 if needed.
        w, w8 = tu.weight(), tu.weight() // u.co * (cdiv(u.co, 8) * 8)
        dram_launch("weight pack", 2 * w, fwd_side=True)
        if w8 != w:  # constant_pad_nd: a fill, then the copy
            dram_launch("weight pad (fill)", w8, fwd_side=True)
            dram_launch("weight pad (copy)", w + w, fwd_side=True)
    if dg_name == "dgrad_mma_kernel" and weight_copied(u, weight_channels_last):
        # the permuted copy (kh*kw*Co, C)
        dram_launch("weight pack (dgrad)", 2 * tu.weight())
    vec32 = 4 * u.c
    dram_launch("batch_stats", dram["batch_stats"], fwd_side=True)
    dram_launch("batch_stats finalize", 2 * vec32, fwd_side=True)
    dram_launch("bn affine", 6 * vec32, fwd_side=True)
    dram_launch("bn affine (backward)", 6 * vec32)
    # "wgrad reduce" in kernels/traffic: the split's dW partials (csrc/cuda's
    # wgrad_partials_sum: one launch) and the BatchNorm sums' (bn_sums: one launch, two past
    # SUMS_ONE_BLOCK_ROWS rows).
    dw_partials = split * u.co * u.c * taps * 4 if split > 1 else 0
    if dw_partials:
        dram_launch("dW partials sum", dw_partials + tu.weight())
    sums_rows = split * cdiv(u.co, wg.bm) * taps
    for name in bn_sums_launches(sums_rows):
        dram_launch(name, 2 * sums_rows * vec32 / len(bn_sums_launches(sums_rows)))
    return CudaUnitModel(u, dtype, dev.arch, kernels, frozenset(fwd_side_names))


def weight_copied(u, weight_channels_last: bool) -> bool:
    """Whether the host copies unit ``u``'s weight into the layout the mma.sync data gradient
    and CUTLASS's forward read (C contiguous: KRSC or (kh*kw*Co, C)): not for a channels-last
    weight (``weight_channels_last``: what a channels-last model holds, module.to(
    memory_format=torch.channels_last) converting its 4-D weights too), which both read in
    place, nor for a 1 x 1 filter, whose (Co, C, 1, 1) weight is channels-last either way."""
    return u.k > 1 and not weight_channels_last


SUMS_ONE_BLOCK_ROWS = 2048


def bn_sums_launches(rows: int) -> list[str]:
    """The launches of csrc/cuda's bn_sums for ``rows`` partial rows: one up to
    SUMS_ONE_BLOCK_ROWS (kSumsOneBlockRows), else the sliced pass and the merge."""
    if rows <= SUMS_ONE_BLOCK_ROWS:
        return ["BatchNorm sums"]
    return ["BatchNorm sums (slices)", "BatchNorm sums (merge)"]


def cutlass_fprop_tile(m: int, co: int, sms: int, arch: int) -> tuple[int, int]:
    """The CUTLASS forward's tile (BM, BN) (csrc/cuda/cutlass_conv/plan.h's fprop_tile;
    tests/test_cutlass.py holds this copy to it): on sm_80 (``arch`` 80) 64 x 64 for Co > 32;
    otherwise for Co <= 16, 128 x 16, for Co <= 32,
    128 x 32, where its tiles fill every SM once; for Co <= 64, 256 x 64 where cdiv(m, 256) x
    cdiv(co, 64) tiles fill every SM 4 times, else 128 x 64 where its tiles fill every SM once;
    for Co > 64, 128 x 128 where its tiles do; else 64 x 64."""
    def fills(bm: int, bn: int, times: int = 1) -> bool:
        return -(-m // bm) * -(-co // bn) >= times * sms

    if arch < 90 and co > 32:
        return (64, 64)

    if co <= 16:
        return (128, 16) if fills(128, 16) else (64, 64)
    if co <= 32:
        return (128, 32) if fills(128, 32) else (64, 64)
    if co <= 64:
        return (256, 64) if fills(256, 64, 4) else (128, 64) if fills(128, 64) else (64, 64)
    return (128, 128) if fills(128, 128) else (64, 64)


CUTLASS_MIN_SLICE_PIXELS = 512
CUTLASS_MAX_SLICES = 256
CUTLASS_MAX_PARTIAL_BYTES = 64 << 20


def cutlass_wgrad_plan(co: int, columns: int, pixels: int,
                       resident: Callable[[int, int], int]) -> tuple[int, int, int]:
    """The CUTLASS weight gradient's (BM, BN, split) (csrc/cuda/cutlass_conv/plan.h's
    wgrad_tile and wgrad_split; tests/test_cutlass.py holds this copy to them): 64 x 64 for at
    most 64 columns, else 32 x 64 (Co <= 32), 64 x 128 (Co <= 64) or 128 x 128;
    ``resident(BM, BN)``: the tile's blocks the GPU holds at once. The split: of
    1 .. min(256, pixels // 512, 64 MiB // the float32 partial's bytes), the fewest waves per
    slice, cdiv(tiles * split, resident) / split, the smallest on ties."""
    bm, bn = ((64, 64) if columns <= 64 else (32, 64) if co <= 32 else (64, 128) if co <= 64
              else (128, 128))
    tiles = -(-co // bm) * -(-columns // bn)
    slots = max(1, resident(bm, bn))
    most = max(1, min(CUTLASS_MAX_SLICES, pixels // CUTLASS_MIN_SLICE_PIXELS,
                      CUTLASS_MAX_PARTIAL_BYTES // (co * columns * 4)))
    split = min(range(1, most + 1), key=lambda k: (Fraction(-(-tiles * k // slots), k), k))
    return bm, bn, split


def _cutlass_row(rows: list[CudaKernelRow], arch: int, kind: str, dtype: str,
                 bm: int, bn: int) -> CudaKernelRow:
    elem = "half_t" if dtype == "fp16" else "bfloat16_t"
    for r in rows:
        if r.arch == arch and (r.bm, r.bn) == (bm, bn) and r.name.startswith(
                f"cutlass_conv_kernel<{kind}<cutlass::{elem},"):
            return r
    raise ValueError(f"no CUTLASS {kind} <{elem}> kernel of {bm}x{bn} tiles for sm_{arch}")


def cutlass_wgrad_on(kh: int, kw: int) -> bool:
    """Whether FUSEDRES_CUDA_KERNELS=cutlass takes a kh x kw unit's weight gradient with the
    "store" backward, else the native "sums" one (csrc/cuda/cutlass_conv/plan.h's
    wgrad_on_cutlass; tests/test_cutlass.py holds this copy to it and the rule to the model):
    filters larger than 1 x 1."""
    return kh * kw > 1


def model_cutlass_unit(u, dtype: str, dev, rows: list[CudaKernelRow],
                       backward: str = "rule", weight_channels_last: bool = True) -> CudaUnitModel:
    """The CUDA C++ backend's training step of 16-bit channels-last unit ``u`` with
    FUSEDRES_CUDA_KERNELS=cutlass on ``dev`` (csrc/cuda/cutlass_conv/README.md), with the "store"
    backward where the weight gradient is CUTLASS's:

    * fwd: the CUTLASS forward (cutlass_conv_kernel<Fprop<...>>: 128x128x32 tiles of 4 warps
      or, for Co <= 64, 256x64x32 of 8 or 128x64x32 of 4, for Co <= 32 128x32x32 of 4, for
      Co <= 16 128x16x32 of 2, where they fill the SMs, else 64x64x32,
      :func:`cutlass_fprop_tile`); grid
      cdiv(M, BM) x cdiv(Co, BN); K chunks: kh*kw taps x cdiv(C, 32); each block computes the
      BatchNorm affine for itself (no launch: its 16-bit scale and shift, 4 B a channel written
      per block, in the DRAM count; the cdiv(C, threads) round trips before its pipeline
      starts are prologue, not counted); for a weight that is not channels-last
      (``weight_channels_last`` False; :func:`weight_copied`), after a DRAM-bound launch
      copying it to KRSC;
    * dgrad writing dz and a: the native mma.sync data gradient (as :func:`model_cuda_unit`
      picks its tile; each channel's scale and shift computed where it reads them, no affine
      launch in the backward) (for a strided unit after two
      launches zeroing the BatchNorm sums' partials), its epilogue writing dz (x's dtype, into
      the x gradient), the partials and the activation a = relu(scale * x + shift) (x's dtype:
      the weight gradient's operand);
    * wgrad: the CUTLASS weight gradient of a (cutlass_conv_kernel<Wgrad<...>>, CUTLASS's plain
      wgrad: 128x128x32 tiles of 8 warps, 64x128x32 (Co 33..64) or 64x64x32 (<= 64 columns) of
      4, 32x64x32 (Co <= 32) of 2, parallel split-K, :func:`cutlass_wgrad_plan` with the tile's
      resident blocks by :func:`model.blocks_per_sm`); grid cdiv(Co, BM) x cdiv(taps*C, BN) x
      split; K chunks: cdiv(cdiv(M, 32), split); DRAM: dy and a once, each slice's float32
      partial dW written once;
    * the sums' reduction (bn_sums) and the dx pass in place (read dz and x, write dx), whose
      blocks past dx's add dW's slices (PartialsSum's fixed order) and round dW to the
      weight's dtype and layout: DRAM-bound launches;
    * batch statistics (partials and finalize): as the native step.

    ``backward``: "rule" (:func:`cutlass_wgrad_on`: the above for filters larger than 1 x 1,
    else the native "sums" backward of :func:`model_cuda_unit` after the CUTLASS forward),
    "store" or "sums" (that backward whatever the filter).

    Prologue and epilogue not counted (as for the native kernels); CUTLASS's main loop has no
    nested staging loop (its cp.async copies are unrolled): low = high."""
    from fusedres.kernels import traffic
    from fusedres.kernels._common import cdiv

    from . import model

    if dtype not in ("fp16", "bf16"):
        raise ValueError(f"dtype: the CUTLASS kernels are fp16 and bf16, not {dtype!r}")
    tu = traffic.Unit(u.name, u.n, u.c, u.h, u.co, u.k, u.stride, u.residual, 2)
    taps, m_out = u.k * u.k, u.n * u.ho * u.ho
    vec16, vec32 = 2 * u.c, 4 * u.c
    kernels = []

    def launch(label, r, ctas, chunks, nbytes):
        t = model.predict(_launch(r, label, ctas, chunks, nbytes, True), dev)
        kernels.append((label, t.time_s, t.time_s, t.bound))

    def dram_launch(name: str, nbytes: float):
        t = nbytes / (dev.dram_bytes_s * model.DRAM_EFFICIENCY) + model.LAUNCH_S
        kernels.append((name, t, t, "dram"))

    for k in traffic.cuda_fused_step(tu).kernels:
        if k.name == "batch_stats":
            dram_launch(k.name, k.bytes)
    dram_launch("batch_stats finalize", 2 * vec32)
    # forward: the weight copied to KRSC (a 1x1 weight is its own KRSC view: no copy); the
    # kernel's blocks each read the float32 BatchNorm vectors and write their own 16-bit scale
    # and shift (the BlockAffine prologue of fprop.cu's Fprop::run)
    if weight_copied(u, weight_channels_last):
        dram_launch("weight to KRSC", 2 * tu.weight())
    fwd = _cutlass_row(rows, dev.arch, "Fprop", dtype,
                       *cutlass_fprop_tile(m_out, u.co, dev.sms, dev.arch))
    fwd_ctas = cdiv(m_out, fwd.bm) * cdiv(u.co, fwd.bn)
    launch("fwd (CUTLASS)", fwd, fwd_ctas, taps * cdiv(u.c, fwd.bk),
           tu.act_in() + tu.weight() + 4 * vec32 + fwd_ctas * 2 * vec16
           + tu.act_out() * (2 if u.residual else 1))
    if backward not in ("rule", "store", "sums"):
        raise ValueError(f"backward: expected 'rule', 'store' or 'sums', got {backward!r}")
    if backward == "sums" or (backward == "rule" and not cutlass_wgrad_on(u.k, u.k)):
        native = model_cuda_unit(u, dtype, dev, rows,
                                 weight_channels_last=weight_channels_last)
        kernels += [k for k in native.kernels if k[0] not in native.forward]
        return CudaUnitModel(u, dtype, dev.arch, kernels)
    # data gradient ("store": dz in x's dtype, in the x gradient's buffer; a beside it)
    dg, ctas, chunks = _dgrad_grid(u, dtype, dev, rows, "dgrad_mma_kernel")
    # the sums' partials, (rows, C) each: a row per 64 pixels of a row tile, every phase sized
    # by the largest (csrc/cuda's backward_store)
    phases = min(u.stride, u.h) ** 2
    sums_rows = phases * cdiv(u.n * cdiv(u.h, u.stride) ** 2, dg.bm) * (dg.bm // 64)
    parts = sums_rows * vec32 * 2
    if weight_copied(u, weight_channels_last):
        dram_launch("weight pack (dgrad)", 2 * tu.weight())
    if phases > 1:  # a smaller phase's idle blocks leave rows that must read 0
        dram_launch("zero the sums' partials (dz)", parts / 2)
        dram_launch("zero the sums' partials (dzx)", parts / 2)
    launch("dgrad+dz+a", dg, ctas, chunks,
           tu.act_out() + tu.weight() + tu.act_in() + 2 * vec32 + 2 * tu.act_in() + parts)
    # weight gradient, of a
    def resident(bm: int, bn: int) -> int:
        r = _cutlass_row(rows, dev.arch, "Wgrad", dtype, bm, bn)
        res = model.Resources(r.registers, r.smem, r.threads // 32)
        return dev.sms * model.blocks_per_sm(res, dev)[0]

    bm, bn, split = cutlass_wgrad_plan(u.co, taps * u.c, m_out, resident)
    wg = _cutlass_row(rows, dev.arch, "Wgrad", dtype, bm, bn)
    dw32 = u.co * taps * u.c * 4
    launch("wgrad (CUTLASS)", wg, cdiv(u.co, wg.bm) * cdiv(taps * u.c, wg.bn) * split,
           cdiv(cdiv(m_out, CUTLASS_BK), split), tu.act_out() + tu.act_in() + split * dw32)
    for name in bn_sums_launches(sums_rows):
        dram_launch(name, (parts + 4 * vec32) / len(bn_sums_launches(sums_rows)))
    # read dz and x, write dx; its blocks past dx's add dW's slices and round it
    dram_launch("dx + dW partials sum", 3 * tu.act_in() + 6 * vec32 + split * dw32 + tu.weight())
    return CudaUnitModel(u, dtype, dev.arch, kernels)


def slowest(m: CudaUnitModel) -> str:
    """The launch that bounds ``m`` (its high end): name, time, share of the step, bound."""
    name, _, high, bound = max(m.kernels, key=lambda k: k[2])
    return f"{name} {high * 1e6:.0f} us ({100 * high / m.high_s:.0f}%): {bound}"


def unit_table(models: list[CudaUnitModel], plain: dict) -> list[str]:
    """``plain``: (unit name, dtype, arch) -> the plain sequence's modeled seconds. The last
    two columns: each GPU's slowest launch (:func:`slowest`)."""
    lines = ["| unit | dtype | A100 CUDA fused us (low - high) | A100 plain us | A100 fused/plain "
             "| H100 CUDA fused us (low - high) | H100 plain us | H100 fused/plain "
             "| A100 slowest launch | H100 slowest launch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    by_key: dict[tuple, dict] = {}
    for m in models:
        by_key.setdefault((m.unit.name, m.dtype), {})[m.arch] = m
    for (name, dtype), d in by_key.items():
        cells, bounds = [], []
        for arch in (80, 90):
            m, p = d.get(arch), plain.get((name, dtype, arch))
            bounds.append("-" if m is None else slowest(m))
            if m is None or p is None:
                cells += ["-"] * 3
                continue
            cells += [f"{m.low_s * 1e6:.0f} - {m.high_s * 1e6:.0f}", f"{p * 1e6:.1f}",
                      f"{m.low_s / p:.1f} - {m.high_s / p:.1f}"]
        cells += bounds
        lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return lines
