"""Data gradient of the fused unit, and the BatchNorm reductions it needs.

``dgrad_kernel`` is an implicit-GEMM transposed convolution: rows are input pixels
(M = N*H*W), columns input channels (C), the reduction runs over the taps and the output
channels (K = kh*kw*Co). A tap contributes to an input pixel when (ih + ph - i*dh) is a multiple
of the stride inside the output; other rows of that tap load nothing (masked). Its epilogue
loads the x tile, recomputes the ReLU mask from ``scale * x + shift``, and reduces per channel
``sum dz`` and ``sum dz * xhat`` over the tile's rows (partials per row block, summed on the
host). With a branch scale (stochastic depth) the conv branch's gradient is s[n] * dy: a row is
an input pixel of one sample, so the epilogue scales the row's accumulator (s[n] *
conv_transpose(dy) = conv_transpose(s[n] * dy)); float64 scales dy as it loads it instead.
What it writes is chosen by constexprs:

* ``WRITE_DZ``: dz into the grad_x buffer; ``dx_kernel`` then turns it into dx in place once
  the sums are complete (training: dx depends on the batch-wide sums).
* ``WRITE_DX``: dx directly, given the sums: eval mode (dx = scale * dz) in one pass, or the
  second pass of the "recompute" strategy (a sums-only pass first), which trades a second GEMM
  for not writing and re-reading dz.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import settings
from ._common import (
    KernelConfig,
    Launch,
    acc_is_fp64,
    allow_tf32,
    autotune_enabled,
    autotuned,
    cdiv,
    check_usable,
    config_variant,
    dummy,
    interp_bf16,
    interpreting,
    is_aligned,
    named,
    plan_cache,
    short_rows_fill_better,
    sm_count,
    tf32_allowed,
    usable,
)
from ._tl import cast, load_tile, mma
from .reductions import ReducePlan

# Configs by name: each entry's comment is the rule the host picks it by (``pick_config``) and
# why the tile is shaped so; the dict order is the order ``configs_for`` gives the autotuner and
# tools/triton_aot.py. The SASS and model figures behind each tile: kernels/TUNING.md, "Data
# gradient". No 128x128 tile: the WRITE_DX epilogue (x tile, ReLU mask, xhat, sums, dx) on top
# of its accumulator spills. ``ALIGNED`` tiles run only on aligned operands, as the forward's.
CONFIGS = named({
    # C >= 128, Co >= 64 with a full wave: K 64 = four k16 steps a K-step.
    "big_n128": KernelConfig.of(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3,
                                ALIGNED=1),
    # C >= 64, Co >= 64 with a full wave of 128x64 tiles.
    "wide_n64": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3,
                                ALIGNED=1),
    # The fallback: 64-channel units with few pixels, Co < 64, and every unaligned operand.
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
    # C <= 32 with Co < 32: N = C, K 16.
    "narrow_n32": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=16, num_warps=4,
                                  num_stages=3),
    # C <= 16: 256 pixels tall, the per-row address and mask work amortised over 16 columns.
    "narrow_n16": KernelConfig.of(BLOCK_M=256, BLOCK_N=16, BLOCK_K=16, num_warps=4,
                                  num_stages=2),
    # Few pixels with C and Co >= 64, aligned (CIFAR 64@8), as the forward's: K 64, 2 stages.
    "few_pixels_k64": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4,
                                      num_stages=2),
    # few_pixels_k64 half as tall, where it ends the last wave sooner (short_rows_fill_better).
    "few_pixels_k64_short": KernelConfig.of(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=2,
                                            num_stages=2),
    # C <= 32 with Co >= 32: K 32, a tap's whole reduction in one K-step at Co = 32; 2 warps,
    # twice narrow_n32's blocks.
    "narrow_n32_k32": KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=2,
                                      num_stages=2),
})
# float32 with TF32 products.
FP32_CONFIGS = named({
    # Many pixels (M * C >= 128 * 64 * 264, two waves of 128x64 tiles on 132 SMs).
    "many_pixels": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8,
                                   num_stages=2),
    # The fallback, on 4 warps (CIFAR 64@8 modeled faster than 8).
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
    # C <= 32: N = C, no padded columns.
    "narrow": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
    # mid half as tall, where it ends the last wave sooner (short_rows_fill_better).
    "mid_short": KernelConfig.of(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=2),
})
# float32 without TF32 (``ieee`` products: FMA), the same rules.
IEEE_CONFIGS = named({
    # Many pixels; K 16 (128x64 at K 32 spills here: 255 registers).
    "many_pixels": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16, num_warps=8,
                                   num_stages=2),
    # The fallback.
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2),
    # C <= 32: N = C, no padded columns.
    "narrow": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
})
# float64.
FP64_CONFIGS = named({
    # Many pixels (M >= 64 * 264); K 8 (K 16 on 8 warps spills the WRITE_DX variant on sm_80).
    "many_pixels": KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=8, num_warps=8,
                                   num_stages=3),
    # Fewer pixels: smaller blocks, more of them to fill the SMs.
    "few_pixels": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4,
                                  num_stages=3),
})
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1)

# dx_kernel (dz -> dx in place, elementwise): tiles along the contiguous axis.
DX_CONFIGS = named({
    # channels_last: 32 channels contiguous a row, 64 pixels.
    "channels_last": KernelConfig.of(BLOCK_M=64, BLOCK_C=32, num_warps=4, num_stages=1),
    # NCHW: pixels contiguous, so 256 pixels by 8 channels.
    "nchw": KernelConfig.of(BLOCK_M=256, BLOCK_C=8, num_warps=4, num_stages=1),
})
DX_INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=128, BLOCK_C=32, num_warps=4, num_stages=1)


@triton.jit
def _dx_from_dz(dz, xv, c, c_ok, scale_ptr, mean_ptr, invstd_ptr, m1_ptr, m2_ptr,
                TRAIN: tl.constexpr):
    """dx = scale * (dz - mean(dz) - xhat * mean(dz * xhat)) (training) or scale * dz."""
    sc = tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(dz.dtype)
    if TRAIN:
        mu = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
        inv = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
        m1 = tl.load(m1_ptr + c, mask=c_ok, other=0.0).to(dz.dtype)
        m2 = tl.load(m2_ptr + c, mask=c_ok, other=0.0).to(dz.dtype)
        xhat = ((xv.to(mu.dtype) - mu[None, :]) * inv[None, :]).to(dz.dtype)
        return sc[None, :] * (dz - m1[None, :] - xhat * m2[None, :])
    else:
        return sc[None, :] * dz


@triton.jit
def dgrad_kernel(
    dy_ptr, w_ptr, x_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, m1_ptr, m2_ptr,
    gx_ptr, s1_ptr, s2_ptr, bscale_ptr,
    C, H, W, Co, Ho, Wo, M,
    SH, SW, PH, PW, DH, DW,
    PA, PB, HP, WP, ROW0,
    TI0, TIS, TIN, TJ0, TJS, TJN,
    sdn, sdc, sdh, sdw,
    swo, swc, swh, sww,
    sxn, sxc, sxh, sxw,
    sgn, sgc, sgh, sgw,
    WRITE_DZ: tl.constexpr, WRITE_DX: tl.constexpr, STATS: tl.constexpr, TRAIN: tl.constexpr,
    FP64: tl.constexpr, TF32: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BSCALE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, ALIGNED: tl.constexpr = False,
):
    # EVEN_K: Co % BLOCK_K == 0, EVEN_N: C % BLOCK_N == 0 (host-checked): the channel masks
    # of the loop's loads are left out (see _tl.load_tile). ALIGNED: as the forward's (unit
    # channel strides, 16-aligned channel runs stated to the compiler).
    if ALIGNED:
        sdc = 1
        swc = 1
        sxc = 1
        sgc = 1
    num_n = tl.cdiv(C, BLOCK_N)  # column tiles of a row block back to back (L2 reuse of dy)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    acc_t = tl.float64 if FP64 else tl.float32
    op_t = w_ptr.dtype.element_ty
    p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = p < M
    c_ok = c < C
    # Rows are the pixels of one stride phase: ih = PA + SH*k, iw = PB + SW*l. The taps that
    # feed them, those with (ih + PH - i*DH) divisible by SH, are i = TI0 + TIS*u (u < TIN),
    # likewise j (host-computed): the loop runs over those only (no masked MMA), and each
    # step u moves the output row by TIS*DH/SH.
    hwp = HP * WP
    n = p // hwp
    rem = p % hwp
    ih = PA + SH * (rem // WP)
    iw = PB + SW * (rem % WP)
    oh0 = (ih + PH - TI0 * DH) // SH  # exact: a multiple of SH (negative rows masked)
    ow0 = (iw + PW - TJ0 * DW) // SW
    doh = TIS * DH // SH
    dow = TJS * DW // SW
    kk = tl.arange(0, BLOCK_K)
    if HAS_BSCALE:
        if FP64:  # float64: applied to dy as it is loaded (see the epilogue)
            bsc = tl.load(bscale_ptr + n, mask=p_ok, other=0.0).to(acc_t)
    # Hoisted address arithmetic: per-row dy offsets at the first tap, the channel offsets of
    # both tiles; an iteration adds scalars.
    dy_tile = dy_ptr + (n * sdn + oh0 * sdh + ow0 * sdw)[:, None] + kk[None, :] * sdc
    w_tile = w_ptr + kk[:, None] * swo + c[None, :] * swc + TI0 * swh + TJ0 * sww
    # One pipelined loop over the feeding taps x output-channel blocks (counters, no
    # division): the pipeline does not drain at each tap.
    nkb = tl.cdiv(Co, BLOCK_K)
    kb = tl.program_id(0) * 0
    u = kb
    v = kb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
    for _ in tl.range(0, TIN * TJN * nkb):
        k0 = kb * BLOCK_K
        oh = oh0 - u * doh
        ow = ow0 - v * dow
        row_ok = p_ok & (oh >= 0) & (ow >= 0) & (oh < Ho) & (ow < Wo)
        co_ok = (k0 + kk) < Co
        dy_ptrs = dy_tile + (k0 * sdc - u * doh * sdh - v * dow * sdw)
        w_ptrs = w_tile + (k0 * swo + u * TIS * swh + v * TJS * sww)
        if ALIGNED:
            dy_ptrs = tl.max_contiguous(tl.multiple_of(dy_ptrs, [16, 16]), [1, BLOCK_K])
            w_ptrs = tl.max_contiguous(tl.multiple_of(w_ptrs, [16, 16]), [1, BLOCK_N])
        a = load_tile(dy_ptrs, row_ok, co_ok, False, EVEN_K).to(op_t)
        if HAS_BSCALE:
            if FP64:
                a = a * bsc[:, None]
        b = load_tile(w_ptrs, co_ok, c_ok, EVEN_K, EVEN_N)
        acc = mma(acc, a, b, TF32, INTERP_BF16)
        kb += 1
        nxt = kb == nkb
        kb = tl.where(nxt, 0, kb)
        v = tl.where(nxt, v + 1, v)
        nxt = v == TJN
        v = tl.where(nxt, 0, v)
        u = tl.where(nxt, u + 1, u)
    mask = p_ok[:, None] & c_ok[None, :]
    x_off = n * sxn + ih * sxh + iw * sxw
    x_ptrs = x_ptr + x_off[:, None] + c[None, :] * sxc
    if ALIGNED:
        x_ptrs = tl.max_contiguous(tl.multiple_of(x_ptrs, [16, 16]), [1, BLOCK_N])
    xv = tl.load(x_ptrs, mask=mask, other=0.0)
    sc = tl.load(scale_ptr + c, mask=c_ok, other=0.0)
    sh = tl.load(shift_ptr + c, mask=c_ok, other=0.0)
    z = xv.to(sc.dtype) * sc[None, :] + sh[None, :]
    # Gradient passes unless z <= 0 (a NaN z passes it, as torch's ReLU backward does).
    if HAS_BSCALE:
        if not FP64:
            # The row's sample's factor: s[n] * conv_transpose(dy), once per output value, and
            # dy goes from memory to the MMA untouched. (float64 scales dy in the loop instead:
            # there, ptxas allocates the epilogue form 128 registers and spills 8 bytes, sm_90.)
            acc = acc * tl.load(bscale_ptr + n, mask=p_ok, other=0.0).to(acc_t)[:, None]
    dz = tl.where(mask & ~(z <= 0), acc, 0.0)
    if STATS:
        mu = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
        inv = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
        xhat = ((xv.to(mu.dtype) - mu[None, :]) * inv[None, :]).to(acc_t)
        row = ROW0 + pid_m
        tl.store(s1_ptr + row * C + c, tl.sum(dz, axis=0), mask=c_ok)
        tl.store(s2_ptr + row * C + c, tl.sum(dz * xhat, axis=0), mask=c_ok)
    g_off = n * sgn + ih * sgh + iw * sgw
    g_ptrs = gx_ptr + g_off[:, None] + c[None, :] * sgc
    if ALIGNED:
        g_ptrs = tl.max_contiguous(tl.multiple_of(g_ptrs, [16, 16]), [1, BLOCK_N])
    if WRITE_DZ:
        tl.store(g_ptrs, cast(dz, gx_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    if WRITE_DX:
        dx = _dx_from_dz(dz, xv, c, c_ok, scale_ptr, mean_ptr, invstd_ptr, m1_ptr, m2_ptr, TRAIN)
        tl.store(g_ptrs, cast(dx, gx_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


@triton.jit
def dx_kernel(
    g_ptr, x_ptr, scale_ptr, mean_ptr, invstd_ptr, m1_ptr, m2_ptr,
    C, HW, W, M,
    sxn, sxc, sxh, sxw,
    sgn, sgc, sgh, sgw,
    FP64: tl.constexpr, INTERP_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """In place: grad_x holds dz on entry and dx on exit (training-mode BatchNorm backward)."""
    acc_t = tl.float64 if FP64 else tl.float32
    p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < M
    c_ok = c < C
    mask = p_ok[:, None] & c_ok[None, :]
    n = p // HW
    rem = p % HW
    h = rem // W
    w = rem % W
    xv = tl.load(x_ptr + (n * sxn + h * sxh + w * sxw)[:, None] + c[None, :] * sxc, mask=mask,
                 other=0.0)
    g_ptrs = g_ptr + (n * sgn + h * sgh + w * sgw)[:, None] + c[None, :] * sgc
    dz = tl.load(g_ptrs, mask=mask, other=0.0).to(acc_t)
    dx = _dx_from_dz(dz, xv, c, c_ok, scale_ptr, mean_ptr, invstd_ptr, m1_ptr, m2_ptr, True)
    tl.store(g_ptrs, cast(dx, g_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


def configs_for(dtype, interpret: bool | None = None) -> list[KernelConfig]:
    """As the forward's ``configs_for``."""
    return list(named_configs(dtype, interpret).values())


def named_configs(dtype, interpret: bool | None = None) -> dict[str, KernelConfig]:
    """:func:`configs_for`'s configs by name (the rules ``pick_config`` picks them by)."""
    return {"fp64": FP64_CONFIGS, "fp32": FP32_CONFIGS, "fp32-ieee": IEEE_CONFIGS}.get(
        config_variant(dtype, interpret), CONFIGS)


def dx_configs_for(dtype) -> list[KernelConfig]:
    return list(DX_CONFIGS.values())


def pick_config(m: int, c: int, co: int, dtype: torch.dtype,
                interpret: bool | None = None, sms: int = 132,
                aligned: bool = True) -> KernelConfig:
    """Host rule (16-bit operands; the configs by name in CONFIGS): C <= 16 / <= 32 the
    narrow tiles (for C <= 32 with Co >= 32 the one with K 32); aligned
    operands with Co >= 64 and C >= 128 / >= 64 the big / wide tile when it gives a full wave
    on ``sms`` SMs, else the 64x64x64 tile or its 32-row half where that ends the grid's last
    wave sooner (``short_rows_fill_better``); otherwise 64x64x32. float32 and float64 keep
    their own lists (same roles as before; float32's mid tile also has its 32-row half)."""
    if interpreting() if interpret is None else interpret:
        return INTERPRET_CONFIG
    if dtype == torch.float64:
        return FP64_CONFIGS["many_pixels" if m >= 64 * 264 else "few_pixels"]
    configs = named_configs(dtype, interpret=False)
    if dtype == torch.float32:
        if c <= 32:
            return configs["narrow"]
        if m * c >= 128 * 64 * 264:
            return configs["many_pixels"]
        if "mid_short" in configs and short_rows_fill_better(m, cdiv(c, 64), sms, 64, 32):
            return configs["mid_short"]
        return configs["mid"]
    if c <= 16:
        return configs["narrow_n16"]
    if c <= 32:
        return configs["narrow_n32_k32" if co >= 32 else "narrow_n32"]
    if aligned and co >= 64:
        if c >= 128 and cdiv(m, 64) * cdiv(c, 128) >= sms:
            return configs["big_n128"]
        if cdiv(m, 128) * cdiv(c, 64) >= sms:
            return configs["wide_n64"]
        short = short_rows_fill_better(m, cdiv(c, 64), sms, 64, 32)
        return configs["few_pixels_k64_short" if short else "few_pixels_k64"]
    return configs["mid"]


def phase_taps(pa: int, pad: int, dil: int, stride: int, k: int) -> tuple[int, int, int]:
    """(first, step, count) of the taps i < k that feed the input pixels ih = pa + stride*t:
    those with (pa + pad - i*dil) divisible by the stride, an arithmetic progression of step
    stride / gcd(stride, dil) (so a step moves the output pixel by step*dil/stride)."""
    valid = [i for i in range(k) if (pa + pad - i * dil) % stride == 0]
    step = stride // math.gcd(stride, dil)
    return (valid[0] if valid else 0), step, len(valid)


def pick_dx_config(x: torch.Tensor) -> KernelConfig:
    if interpreting():
        return DX_INTERPRET_CONFIG
    cl = x.is_contiguous(memory_format=torch.channels_last)
    return DX_CONFIGS["channels_last" if cl else "nchw"]


class DgradPlan:
    """:func:`bn_relu_conv2d_dgrad`'s launches for one key (:func:`dgrad_plan`): the config,
    the stride phases' grids and integer arguments, each pass's constexprs, the reductions and
    the dx pass fixed; :meth:`run` on the tensors of a call."""

    def __init__(self, grad_out, x, weight, scale, grad_x, stride, padding, dilation, *,
                 batch_stats: bool, want_sums: bool, sums_given: bool, strategy: str,
                 branch: bool, means_given: bool, config: KernelConfig | None = None,
                 aligned: bool):
        n, c, h, w = x.shape
        co, _, kh, kw = weight.shape
        ho, wo = grad_out.shape[2], grad_out.shape[3]
        self.m = m = n * h * w
        cfg = config or pick_config(m, c, co, weight.dtype, sms=sm_count(x.device),
                                    aligned=aligned)
        check_usable(cfg, aligned)
        bm, col_tiles = cfg.meta["BLOCK_M"], cdiv(c, cfg.meta["BLOCK_N"])
        # One launch per stride phase (pixels with ih % sh, iw % sw fixed), see dgrad_kernel.
        phases = []
        rows = 0
        for pa in range(min(stride[0], h)):
            for pb in range(min(stride[1], w)):
                hp, wp = cdiv(h - pa, stride[0]), cdiv(w - pb, stride[1])
                taps = (*phase_taps(pa, padding[0], dilation[0], stride[0], kh),
                        *phase_taps(pb, padding[1], dilation[1], stride[1], kw))
                phases.append((cdiv(n * hp * wp, bm) * col_tiles,
                               (c, h, w, co, ho, wo, n * hp * wp, *stride, *padding, *dilation,
                                pa, pb, hp, wp, rows, *taps)))
                rows += cdiv(n * hp * wp, bm)
        fp64 = acc_is_fp64(weight.dtype)
        self.acc = acc = torch.float64 if fp64 else torch.float32
        self.c, self.rows = c, rows
        self.has_grad_x, self.train = grad_x is not None, batch_stats and grad_x is not None
        self.sums_given, self.means_given, self.want_sums = sums_given, means_given, want_sums
        self.strategy = strategy
        self.strides = (*grad_out.stride(), *weight.stride(), *x.stride(),
                        *(grad_x.stride() if grad_x is not None else (0, 0, 0, 0)))
        real = type(x) is torch.Tensor and x.device.type != "meta"
        flags = dict(FP64=fp64, TF32=allow_tf32(weight.dtype),
                     INTERP_BF16=interp_bf16(weight.dtype, x.dtype), HAS_BSCALE=branch,
                     EVEN_K=co % cfg.meta["BLOCK_K"] == 0, EVEN_N=c % cfg.meta["BLOCK_N"] == 0,
                     TRAIN=batch_stats,
                     # every constexpr passed: wrap_triton's write analysis needs them all
                     **{"ALIGNED": 0, **cfg.launch_kwargs})

        def passes(write_dz, write_dx, stats):
            return [(Launch(dgrad_kernel, (programs,), dict(
                WRITE_DZ=write_dz, WRITE_DX=write_dx, STATS=stats, **flags), fast=real), ints)
                for programs, ints in phases]

        self.pass_dx = self.pass_sums = self.pass_dz = None
        self.reduce = self.reduce_means = self.dx = None
        train = self.train
        if sums_given:
            if grad_x is not None:
                self.pass_dx = passes(False, True, False)
        elif grad_x is None:  # only dgamma / dbeta
            self.pass_sums = passes(False, False, True)
        elif not train:  # eval: dx = scale * dz, one pass
            self.pass_dx = passes(False, True, want_sums)
        elif strategy == "recompute":
            self.pass_sums = passes(False, False, True)
            self.pass_dx = passes(False, True, False)
        else:
            self.pass_dz = passes(True, False, True)
            dcfg = pick_dx_config(x)
            self.dx = Launch(dx_kernel, (cdiv(m, dcfg.meta["BLOCK_M"]),
                                         cdiv(c, dcfg.meta["BLOCK_C"])), dict(
                FP64=fp64, INTERP_BF16=interp_bf16(x.dtype), **dcfg.launch_kwargs), fast=real)
            self.dx_ints = (c, h * w, w, m, *x.stride(), *grad_x.stride())
        if not sums_given and (grad_x is None or train or want_sums):
            out_dtype = scale.dtype
            self.reduce = ReducePlan(None, None, None, (rows, c), False, m, acc, (out_dtype,),
                                     fast=real)
            self.reduce_means = ReducePlan(None, None, None, (rows, c), True, m, acc,
                                           (out_dtype,), fast=real)
        self.unused = dummy(scale)  # never read (m1, m2 outside training) nor written
        self.unused_x = dummy(x)
        self.unused_acc = dummy(torch.empty((0,), device=x.device, dtype=acc))


    def _reduced(self, plan, s1, s2, scale, out_sums, with_means, joined=None):
        """The sums (and their means) from the per-row partials: one launch, which with
        ``joined`` (a :class:`~fusedres.kernels.reductions.ReducePlan` and the weight
        gradient's ``dw_p, dw, db_p, db``) sums those partials too."""
        c = self.c
        out = out_sums if out_sums is not None else (scale.new_empty((c,)),
                                                     scale.new_empty((c,)))
        mm = (scale.new_empty((c,)), scale.new_empty((c,))) if with_means else None
        if joined is not None:
            joined[0].run(self.unused_acc, *joined[1:], s1, s2, out, mm)
        else:
            plan.run(self.unused_acc, s1_p=s1, s2_p=s2, sums=out, means=mm)
        return out, mm

    def joined_reduce(self, wgrad_reduce) -> ReducePlan | None:
        """The reduction of the store strategy's sums joined with a weight gradient's (its
        :class:`~fusedres.kernels.reductions.ReducePlan`, which sums dw and db partials): one
        launch for both; None when this plan reduces no sums with their means."""
        if self.pass_dz is None or wgrad_reduce is None:
            return None
        return ReducePlan.joined(wgrad_reduce, self.reduce_means)

    def run(self, grad_out, x, weight, scale, shift, mean, invstd, grad_x, sums=None,
            branch_scale=None, means=None, out_sums=None, joined=None):
        """(sum dz, sum dz * xhat) or (None, None): see :func:`bn_relu_conv2d_dgrad`.
        ``joined``: the store strategy's one reduction for the sums and a weight gradient's
        partials, ``(joined_reduce(...), dw_p, dw, db_p, db)``."""
        s1 = torch.empty((self.rows, self.c), device=x.device, dtype=self.acc)
        s2 = torch.empty((self.rows, self.c), device=x.device, dtype=self.acc)
        unused = self.unused
        g = grad_x if grad_x is not None else self.unused_x
        bscale = branch_scale if branch_scale is not None else unused
        common = (grad_out, weight, x, scale, shift, mean, invstd)
        sum_dz = sum_dzx = None
        if sums is not None:
            sum_dz, sum_dzx = sums
            if grad_x is not None:
                if not self.train:
                    m1, m2 = unused, unused
                elif means is not None:
                    m1, m2 = means
                else:
                    m1, m2 = (sum_dz / self.m).to(scale.dtype), (sum_dzx / self.m).to(scale.dtype)
                for launch, ints in self.pass_dx:
                    launch.go(*common, m1, m2, g, s1, s2, bscale, *ints, *self.strides)
        elif grad_x is None:
            for launch, ints in self.pass_sums:
                launch.go(*common, unused, unused, g, s1, s2, bscale, *ints, *self.strides)
            (sum_dz, sum_dzx), _ = self._reduced(self.reduce, s1, s2, scale, out_sums, False)
        elif not self.train:
            for launch, ints in self.pass_dx:
                launch.go(*common, unused, unused, g, s1, s2, bscale, *ints, *self.strides)
            if self.want_sums:
                (sum_dz, sum_dzx), _ = self._reduced(self.reduce, s1, s2, scale, out_sums,
                                                     False)
        elif self.pass_sums is not None:  # recompute
            for launch, ints in self.pass_sums:
                launch.go(*common, unused, unused, g, s1, s2, bscale, *ints, *self.strides)
            (sum_dz, sum_dzx), (m1, m2) = self._reduced(self.reduce_means, s1, s2, scale,
                                                        out_sums, True)
            for launch, ints in self.pass_dx:
                launch.go(*common, m1, m2, g, s1, s2, bscale, *ints, *self.strides)
        else:  # store
            for launch, ints in self.pass_dz:
                launch.go(*common, unused, unused, g, s1, s2, bscale, *ints, *self.strides)
            (sum_dz, sum_dzx), (m1, m2) = self._reduced(self.reduce_means, s1, s2, scale,
                                                        out_sums, True, joined)
            self.dx.go(grad_x, x, scale, mean, invstd, m1, m2, *self.dx_ints)
        if sum_dz is None:
            return None, None
        if out_sums is not None:
            return sum_dz, sum_dzx
        return sum_dz.to(scale.dtype), sum_dzx.to(scale.dtype)


_PLANS: dict[tuple, DgradPlan] = plan_cache()


def dgrad_plan(grad_out, x, weight, scale, shift, mean, invstd, grad_x, stride, padding,
               dilation, *, batch_stats, want_sums, sums_given, strategy, branch_scale,
               means_given) -> DgradPlan:
    """The cached :class:`DgradPlan` for these arguments (fake and meta tensors: a new one)."""
    kw = dict(batch_stats=batch_stats, want_sums=want_sums, sums_given=sums_given,
              strategy=strategy, branch=branch_scale is not None, means_given=means_given)
    if type(x) is not torch.Tensor or x.device.type == "meta":
        return DgradPlan(grad_out, x, weight, scale, grad_x, stride, padding, dilation,
                         aligned=is_aligned((x.shape[1], weight.shape[0]), grad_out, weight, x,
                                            grad_x, scale, shift, mean, invstd), **kw)
    key = (grad_out.shape, grad_out.stride(), grad_out.dtype, x.shape, x.stride(), x.dtype,
           x.device, weight.shape, weight.stride(), weight.dtype, scale.dtype,
           None if grad_x is None else (grad_x.stride(), grad_x.dtype, grad_x.data_ptr() % 16),
           grad_out.data_ptr() % 16, weight.data_ptr() % 16, x.data_ptr() % 16,
           scale.data_ptr() % 16, shift.data_ptr() % 16, mean.data_ptr() % 16,
           invstd.data_ptr() % 16, tuple(stride), tuple(padding), tuple(dilation), batch_stats,
           want_sums, sums_given, strategy,
           None if branch_scale is None else (branch_scale.dtype, branch_scale.data_ptr() % 16),
           means_given, tf32_allowed())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = DgradPlan(
            grad_out, x, weight, scale, grad_x, stride, padding, dilation,
            aligned=is_aligned((x.shape[1], weight.shape[0]), grad_out, weight, x, grad_x,
                               scale, shift, mean, invstd), **kw)
    return plan


def bn_relu_conv2d_dgrad(grad_out, x, weight, scale, shift, mean, invstd, stride, padding,
                         dilation, *, batch_stats: bool, grad_x: torch.Tensor | None,
                         want_sums: bool, sums=None, strategy: str = "store",
                         config: KernelConfig | None = None, branch_scale=None, means=None,
                         out_sums=None):
    """Data gradient of y = conv2d(relu(scale*x + shift), weight) w.r.t. x, and the sums.

    grad_out (N, Co, Ho, Wo); x (N, C, H, W); scale, shift, mean, invstd (C,) in the statistics
    dtype. Writes grad_x (like x) when given; ``batch_stats`` selects training-mode BatchNorm
    (dx through the batch statistics). ``sums = (sum dz, sum dz * xhat)`` when already known
    (from the weight-gradient pass, see bn_relu_conv2d_wgrad): dx is written in one pass.
    Otherwise ``strategy``: "store" (dz written, one elementwise pass) or "recompute" (sums-only
    GEMM pass, then a GEMM pass that writes dx). Returns (sum dz, sum dz * xhat) per channel in
    the statistics dtype (None when not needed). ``branch_scale`` (N,) contiguous in the
    accumulator dtype, or None: the conv branch's gradient is branch_scale[n] * grad_out[n].
    ``means``: the sums / M in the statistics dtype, with ``sums``, when the weight-gradient
    pass's reduction wrote them too (else computed here). ``out_sums``: (C,) each, where the
    sums this pass reduces are written (and returned). ``config``: this config (an uncached
    plan).
    """
    kw = dict(batch_stats=batch_stats, want_sums=want_sums, sums_given=sums is not None,
              strategy=strategy, means_given=means is not None)
    if config is None and settings.get("FUSEDRES_TRITON_AUTOTUNE") and autotune_enabled(x, weight):
        c, co = x.shape[1], weight.shape[0]
        aligned = is_aligned((c, co), grad_out, weight, x, grad_x, scale, shift, mean, invstd)
        key = ("dgrad", x.shape, x.stride(), weight.shape, weight.dtype, x.dtype, tuple(stride),
               tuple(padding), tuple(dilation), batch_stats, grad_x is None, want_sums,
               sums is None, strategy, branch_scale is not None)
        configs = [cfg for cfg in configs_for(weight.dtype) if usable(cfg, aligned)]
        config = autotuned(key, configs, lambda cfg: bn_relu_conv2d_dgrad(
            grad_out, x, weight, scale, shift, mean, invstd, stride, padding, dilation,
            batch_stats=batch_stats, grad_x=grad_x, want_sums=want_sums, sums=sums,
            strategy=strategy, config=cfg, branch_scale=branch_scale))
    if config is not None:
        c, co = x.shape[1], weight.shape[0]
        plan = DgradPlan(grad_out, x, weight, scale, grad_x, stride, padding, dilation,
                         branch=branch_scale is not None, config=config,
                         aligned=is_aligned((c, co), grad_out, weight, x, grad_x, scale, shift,
                                            mean, invstd), **kw)
    else:
        plan = dgrad_plan(grad_out, x, weight, scale, shift, mean, invstd, grad_x, stride,
                          padding, dilation, branch_scale=branch_scale, **kw)
    return plan.run(grad_out, x, weight, scale, shift, mean, invstd, grad_x, sums,
                    branch_scale, means, out_sums)
