"""Forward of the fused unit: y = residual + s[n] * (conv2d(relu(scale * x + shift), weight) +
bias), s the optional per-sample branch scale (stochastic depth).

Implicit GEMM: rows are output pixels (M = N*Ho*Wo), columns output channels (Co), the reduction
runs over the kernel taps and then the input channels (K = kh*kw*C), so each A tile is a
(pixels, channels) slice of x at one tap: contiguous in channels for channels_last x. The A
operand load applies the BatchNorm affine and the ReLU in registers and zeroes out-of-image taps
after the activation (zero padding of ``a``, never of ``x``); ``a`` never reaches memory. Bias
and residual are added in the epilogue. The branch scale (``HAS_BSCALE``: one factor per row's
sample, y = residual + s[n] * (conv + bias)) is applied where the config's ``BSCALE_AT`` says
(0 when absent): 0, the accumulator rows in the epilogue; 1, the activation rows in the operand
load, which computes them in registers anyway (s[n] * conv(a) = conv(s[n] * a) for a row of one
sample), and the bias in the epilogue; 2, the epilogue with the factors loaded as a broadcast
tile in the accumulator's layout. The kernel is at the register limit in most configs and
ptxas spills one form or another depending on config and arch (tools/triton_aot.py checks every
config with the scale on): 1 for the fp16/bf16 64x64 w=8 tile (0 spills 8 bytes on sm_80),
2 for float64 (0 spills on sm_80, 1 on sm_90), 0 elsewhere (1 spills fp32 128x32 on sm_90).

``genstats``: the epilogue also reduces each output tile to per-channel (mean, M2) over its
valid rows, so the next BatchNorm's batch statistics need no pass over y, merged with Chan's
formula as in batch_stats: by the last row tile of each column tile to finish (``MERGE``), or
by reductions.stats_combine_kernel's launch in a traced graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.opdefs import ConvGeometry, out_memory_format, stats_dtype
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
from ._tl import cast, load_tile, load_vec, mma
from .reductions import STATS_COMBINE_CONFIG, chan_merge, stats_combine_launch

# Configs by name: each entry's comment is the rule the host picks it by (``pick_config``) and
# why the tile is shaped so. The dict order is the order ``configs_for`` gives the autotuner and
# tools/triton_aot.py. The SASS and model figures behind each tile: kernels/TUNING.md, "Forward".
# Tensor-core tiles (fp16, bf16) are wgmma-sized (m64 a warpgroup). The BatchNorm-ReLU of the A
# tile costs the same per K-step whatever BLOCK_N, so wide tiles are what make the loop
# tensor-bound. ``ALIGNED`` tiles run only on aligned operands (vector loads; scalar gathers at
# these sizes spill); the others are the fallback. Wider tiles (128x256x64, 128x128x64, 64x128x64
# on 4 warps) spill in the unspecialised compile tools/triton_aot.py checks.
CONFIGS = named({
    # Co > 128, C >= 64 with a full wave: the A-tile BatchNorm-ReLU amortised over 256 columns.
    "big_n256": KernelConfig.of(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3,
                                ALIGNED=1),
    # Co >= 128, C >= 32 with a full wave of 128x128 tiles.
    "wide_n128": KernelConfig.of(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8,
                                 num_stages=3, ALIGNED=1),
    # 64-channel units with many pixels (C >= 32, a full wave of 256x64 tiles).
    "tall_n64": KernelConfig.of(BLOCK_M=256, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3,
                                ALIGNED=1),
    # The fallback: 64-channel units with few pixels, C < 64, and every unaligned operand.
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4,
                           BSCALE_AT=1),
    # Co <= 32 (N = Co, no padded columns); K = C = 32 is one channel block a tap (ONE_CB:
    # scale and shift load once); 2 warps, twice the blocks, each warp its own 32 rows.
    "narrow_n32": KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, num_warps=2,
                                  num_stages=2),
    # Co <= 16: 256 rows tall, the per-row address work amortised over the 16 columns.
    "narrow_n16": KernelConfig.of(BLOCK_M=256, BLOCK_N=16, BLOCK_K=16, num_warps=4,
                                  num_stages=2),
    # Co <= 32 with C <= 16: K 16, no padded half K-step.
    "narrow_n32_k16": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=16, num_warps=4,
                                      num_stages=3),
    # Few pixels with C >= 64, aligned (CIFAR 64@8): K 64, one channel block (ONE_CB), 2 stages.
    "few_pixels_k64": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4,
                                      num_stages=2, BSCALE_AT=1),
    # few_pixels_k64 half as tall, where it ends the last wave sooner (short_rows_fill_better).
    "few_pixels_k64_short": KernelConfig.of(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=2,
                                            num_stages=2, BSCALE_AT=1),
})
# float32 with TF32 products.
FP32_CONFIGS = named({
    # Many pixels (M * Co >= 128 * 64 * 264, two waves of 128x64 tiles on 132 SMs).
    "many_pixels": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8,
                                   num_stages=3),
    # The fallback; 4 warps, not 8 (CIFAR 64@8 modeled faster).
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    # Co <= 32: N = Co, no padded columns.
    "narrow": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
    # Co >= 128 with a full wave: the activation tile staged once per 128 columns, not 64.
    "wide": KernelConfig.of(BLOCK_M=128, BLOCK_N=128, BLOCK_K=16, num_warps=8, num_stages=3),
    # mid half as tall, where it ends the last wave sooner (short_rows_fill_better).
    "mid_short": KernelConfig.of(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=2),
})
# float32 without TF32 (``ieee`` products: FMA), the same rules; an FMA tile holds
# BLOCK_M*BLOCK_N / threads accumulators a thread, so the tiles are smaller.
IEEE_CONFIGS = named({
    # Many pixels; K 16 keeps the broadcast operands in registers.
    "many_pixels": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16, num_warps=8,
                                   num_stages=3),
    # The fallback; 2 stages (3 spill on sm_80).
    "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2),
    # Co <= 32; 8 channels a K-step (16 spilled with the genstats epilogue on sm_90).
    "narrow": KernelConfig.of(BLOCK_M=128, BLOCK_N=32, BLOCK_K=8, num_warps=4, num_stages=2),
    # Co >= 128 with a full wave: many_pixels' tile (128x128 would be 64 accumulators a thread).
    "wide": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=3),
})
# float64 (FMA / DMMA, twice the registers an accumulator): smaller tiles; the branch scale in
# the epilogue as a broadcast tile (BSCALE_AT=2: the other forms spill).
FP64_CONFIGS = named({
    # Many pixels (M >= 64 * 264, two waves of 64-row tiles on 132 SMs).
    "many_pixels": KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=8,
                                   num_stages=3, BSCALE_AT=2),
    # Fewer pixels: smaller blocks, more of them to fill the SMs.
    "few_pixels": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4,
                                  num_stages=3, BSCALE_AT=2),
})
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1)


@triton.jit
def bn_relu_tile(x_ptr, row_off, row_ok, c, C, sxc, scale_ptr, shift_ptr, out_dtype,
                 INTERP_BF16: tl.constexpr):
    """relu(scale * x + shift) for a (rows, channels) tile, 0 where the row or channel is out."""
    c_ok = c < C
    return bn_relu_ptrs(x_ptr + row_off[:, None] + c[None, :] * sxc, row_ok, c_ok,
                        scale_ptr + c, shift_ptr + c, out_dtype, INTERP_BF16, False)


@triton.jit
def bn_relu_ptrs(x_ptrs, row_ok, c_ok, sc_ptrs, sh_ptrs, out_dtype, INTERP_BF16: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """relu(scale * x + shift) of the (rows, channels) tile at ``x_ptrs`` (scale and shift at
    ``sc_ptrs``, ``sh_ptrs`` per channel), in float32 (float64), zero where the row (padding,
    past the end) or the channel is out, then cast to ``out_dtype``. ``EVEN_K``: every
    channel of the tile is in (``c_ok`` unused)."""
    xv = load_tile(x_ptrs, row_ok, c_ok, False, EVEN_K)
    sc = load_vec(sc_ptrs, c_ok, EVEN_K)
    sh = load_vec(sh_ptrs, c_ok, EVEN_K)
    return _bn_relu(xv, row_ok, sc, sh, out_dtype, INTERP_BF16)


@triton.jit
def _bn_relu(xv, row_ok, sc, sh, out_dtype, INTERP_BF16: tl.constexpr):
    # NaN stays NaN through the ReLU, as torch.relu does. A channel past C reads x = scale =
    # shift = 0, so its a is 0 already; a row out of the image (zero padding of a) is zeroed by
    # a float multiply by 0 in float32, before the ReLU (which then fuses into the packing
    # convert, F2FP.RELU) and the cast: a select there is sunk past the cast by LLVM and done
    # per 16-bit half (unpack, select, repack: twice the instructions).
    a = tl.maximum((xv.to(sc.dtype) * sc[None, :] + sh[None, :]) * row_ok.to(sc.dtype)[:, None],
                   0.0, propagate_nan=tl.PropagateNan.ALL)
    return cast(a, out_dtype, INTERP_BF16)


@triton.jit
def _activation(x_ptrs, row_ok, c_ok, sc_ptrs, sh_ptrs, sc, sh, bsc, op_t, acc_t,
                SCALED: tl.constexpr, INTERP_BF16: tl.constexpr, EVEN_K: tl.constexpr,
                LOADED: tl.constexpr):
    """The A operand: the activation tile, times each row's branch scale when ``SCALED``.
    ``LOADED``: scale and shift are the values ``sc``, ``sh`` (else loaded at the pointers)."""
    if LOADED:
        xv = load_tile(x_ptrs, row_ok, c_ok, False, EVEN_K)
        if SCALED:
            a = _bn_relu(xv, row_ok, sc, sh, acc_t, False)
            return cast(a * bsc[:, None], op_t, INTERP_BF16)
        else:
            return _bn_relu(xv, row_ok, sc, sh, op_t, INTERP_BF16)
    else:
        if SCALED:
            a = bn_relu_ptrs(x_ptrs, row_ok, c_ok, sc_ptrs, sh_ptrs, acc_t, False, EVEN_K)
            return cast(a * bsc[:, None], op_t, INTERP_BF16)
        else:
            return bn_relu_ptrs(x_ptrs, row_ok, c_ok, sc_ptrs, sh_ptrs, op_t, INTERP_BF16,
                                EVEN_K)


@triton.jit
def bn_relu_conv2d_fwd_kernel(
    x_ptr, w_ptr, scale_ptr, shift_ptr, bias_ptr, res_ptr, bscale_ptr, y_ptr, smean_ptr, sm2_ptr,
    C, H, W, Co, Ho, Wo, M, KH, KW,
    SH, SW, PH, PW, DH, DW,
    sxn, sxc, sxh, sxw,
    swo, swc, swh, sww,
    syn, syc, syh, syw,
    srn, src, srh, srw,
    count_ptr, mean_ptr, var_ptr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GENSTATS: tl.constexpr,
    FP64: tl.constexpr, TF32: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BSCALE: tl.constexpr = False, BSCALE_AT: tl.constexpr = 0,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, ALIGNED: tl.constexpr = False,
    ONE_CB: tl.constexpr = False, MERGE: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    # EVEN_K: C % BLOCK_K == 0, EVEN_N: Co % BLOCK_N == 0 (host-checked): the channel masks
    # of the loop's loads are left out (see _tl.load_tile). ALIGNED (a config's meta, launched
    # only when ``is_aligned``): unit channel strides, and the channel runs of the tiles told
    # to the compiler as 16-byte aligned (tl.multiple_of / max_contiguous): what the JIT infers
    # by itself from its divisibility-16 specialisation, stated so that an unspecialised
    # compile (tools/triton_aot.py) builds the same vector loads. ONE_CB (C <= BLOCK_K, host-set):
    # one channel block, so the scale and shift vectors are loaded once, before the loop (in
    # the loop they are staged through shared memory every K-step, and every thread reads
    # its channels' back: most of the shared traffic of a 16-channel unit's K-step).
    if ALIGNED:
        sxc = 1
        swc = 1
        syc = 1
        src = 1
    # Column tiles of one row block run back to back, so its x tiles are read from DRAM once
    # and then hit L2.
    num_n = tl.cdiv(Co, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    acc_t = tl.float64 if FP64 else tl.float32
    op_t = w_ptr.dtype.element_ty
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    co_ok = co < Co
    hw = Ho * Wo
    n = m // hw
    r = m % hw
    oh = r // Wo
    ow = r % Wo
    kk = tl.arange(0, BLOCK_K)
    bsc = tl.zeros((BLOCK_M,), dtype=acc_t)  # unused unless the scale goes on the operand
    if HAS_BSCALE:
        if BSCALE_AT == 1:  # the rows' samples' branch scales, for the operand load
            bsc = tl.load(bscale_ptr + n, mask=m_ok, other=0.0).to(acc_t)
    # Address arithmetic hoisted out of the loop: the tap (0, 0) pixel of each row and its
    # offset, the channel offsets of the x and weight tiles; an iteration adds scalars.
    ih0 = oh * SH - PH
    iw0 = ow * SW - PW
    x_tile = x_ptr + (n * sxn + ih0 * sxh + iw0 * sxw)[:, None] + kk[None, :] * sxc
    w_tile = w_ptr + co[None, :] * swo + kk[:, None] * swc
    # One pipelined loop over taps x channel blocks (the tap (i, j) and the channel block cb
    # advance as counters, no division): the pipeline does not drain at each tap.
    nkb = tl.cdiv(C, BLOCK_K)
    cb = tl.program_id(0) * 0
    i = cb
    j = cb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
    sc = tl.zeros((BLOCK_K,), dtype=acc_t)
    sh = sc
    if ONE_CB:
        sc = load_vec(scale_ptr + kk, kk < C, EVEN_K)
        sh = load_vec(shift_ptr + kk, kk < C, EVEN_K)
    for _ in tl.range(0, KH * KW * nkb):
        c0 = cb * BLOCK_K
        ih = ih0 + i * DH
        iw = iw0 + j * DW
        row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        c_ok = (c0 + kk) < C
        x_ptrs = x_tile + (i * DH * sxh + j * DW * sxw + c0 * sxc)
        w_ptrs = w_tile + (c0 * swc + i * swh + j * sww)
        sc_ptrs = scale_ptr + c0 + kk
        sh_ptrs = shift_ptr + c0 + kk
        if ALIGNED:  # hints inline: through a helper's return they are lost
            x_ptrs = tl.max_contiguous(tl.multiple_of(x_ptrs, [16, 16]), [1, BLOCK_K])
            w_ptrs = tl.max_contiguous(tl.multiple_of(w_ptrs, [16, 16]), [BLOCK_K, 1])
            sc_ptrs = tl.max_contiguous(tl.multiple_of(sc_ptrs, [16]), [BLOCK_K])
            sh_ptrs = tl.max_contiguous(tl.multiple_of(sh_ptrs, [16]), [BLOCK_K])
        a = _activation(x_ptrs, row_ok, c_ok, sc_ptrs, sh_ptrs, sc, sh, bsc, op_t, acc_t,
                        HAS_BSCALE and BSCALE_AT == 1, INTERP_BF16, EVEN_K, ONE_CB)
        b = load_tile(w_ptrs, c_ok, co_ok, EVEN_K, EVEN_N)
        acc = mma(acc, a, b, TF32, INTERP_BF16)
        cb += 1
        nxt = cb == nkb
        cb = tl.where(nxt, 0, cb)
        j = tl.where(nxt, j + 1, j)
        nxt = j == KW
        j = tl.where(nxt, 0, j)
        i = tl.where(nxt, i + 1, i)
    mask = m_ok[:, None] & co_ok[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + co, mask=co_ok, other=0.0).to(acc_t)
        if HAS_BSCALE:
            if BSCALE_AT == 1:
                acc += bsc[:, None] * bias[None, :]
            else:
                acc += bias[None, :]
        else:
            acc += bias[None, :]
    if HAS_BSCALE:
        if BSCALE_AT == 0:
            acc *= tl.load(bscale_ptr + n, mask=m_ok, other=0.0).to(acc_t)[:, None]
        elif BSCALE_AT == 2:
            acc *= tl.load(bscale_ptr + n[:, None] + 0 * co[None, :], mask=mask,
                           other=0.0).to(acc_t)
    if HAS_RES:
        r_off = n * srn + oh * srh + ow * srw
        r_ptrs = res_ptr + r_off[:, None] + co[None, :] * src
        if ALIGNED:
            r_ptrs = tl.max_contiguous(tl.multiple_of(r_ptrs, [16, 16]), [1, BLOCK_N])
        acc += tl.load(r_ptrs, mask=mask, other=0.0).to(acc_t)
    y = cast(acc, y_ptr.dtype.element_ty, INTERP_BF16)
    y_off = n * syn + oh * syh + ow * syw
    y_ptrs = y_ptr + y_off[:, None] + co[None, :] * syc
    if ALIGNED:
        y_ptrs = tl.max_contiguous(tl.multiple_of(y_ptrs, [16, 16]), [1, BLOCK_N])
    tl.store(y_ptrs, y, mask=mask)
    if GENSTATS:
        # Statistics of y as stored (rounded), the values the next BatchNorm will read.
        yv = tl.where(mask, y.to(acc_t), 0.0)
        cnt = tl.maximum(tl.sum(m_ok.to(tl.int32), axis=0).to(acc_t), 1.0)
        t_mean0 = tl.sum(yv, axis=0) / cnt
        d = tl.where(mask, yv - t_mean0[None, :], 0.0)
        sd = tl.sum(d, axis=0)
        t_mean = tl.where(t_mean0 - t_mean0 == 0, t_mean0 + sd / cnt, t_mean0)  # inf stays
        tl.store(smean_ptr + pid_m * Co + co, t_mean, mask=co_ok)
        tl.store(sm2_ptr + pid_m * Co + co, tl.sum(d * d, axis=0) - sd * sd / cnt, mask=co_ok)
        if MERGE:
            # The last row tile of a column tile to finish merges its rows into (mean, var):
            # batch_stats_kernel's PREPARE pattern (a count a column tile, back to zero after).
            tl.debug_barrier()
            rows = tl.cdiv(M, BLOCK_M)
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == rows - 1:
                tl.store(count_ptr + pid_n, 0)
                _genstats_merge(smean_ptr, sm2_ptr, mean_ptr, var_ptr, pid_n, Co, M, rows,
                                BLOCK_M, BLOCK_R, BLOCK_N)


@triton.jit
def _genstats_merge(smean_ptr, sm2_ptr, mean_ptr, var_ptr, pid_n, Co, M, rows, ROW_ELEMS,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column tile ``pid_n``'s (mean, biased var) from the genstats rows, as
    reductions.stats_combine_kernel merges them."""
    co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = co < Co
    mean, var = chan_merge(smean_ptr, sm2_ptr, co, ok, rows, Co, M, ROW_ELEMS, BLOCK_R,
                            BLOCK_N)
    tl.store(mean_ptr + co, mean, mask=ok)
    tl.store(var_ptr + co, var, mask=ok)


def configs_for(dtype, interpret: bool | None = None) -> list[KernelConfig]:
    """The configs this kernel may launch with for operands of ``dtype`` (all compiled AOT): a
    torch dtype (float32: with or without TF32 as it runs now, see ``config_variant``) or a
    variant name ("fp32-ieee": float32 without TF32)."""
    return list(named_configs(dtype, interpret).values())


def named_configs(dtype, interpret: bool | None = None) -> dict[str, KernelConfig]:
    """:func:`configs_for`'s configs by name (the rules ``pick_config`` picks them by)."""
    return {"fp64": FP64_CONFIGS, "fp32": FP32_CONFIGS, "fp32-ieee": IEEE_CONFIGS}.get(
        config_variant(dtype, interpret), CONFIGS)


def pick_config(m: int, co: int, c: int, dtype: torch.dtype,
                interpret: bool | None = None, sms: int = 132,
                aligned: bool = True) -> KernelConfig:
    """Host rule (16-bit operands; the configs by name in CONFIGS):

    * Co <= 16 / <= 32: the narrow tiles (N = Co, no padded columns), whatever the pixels;
      for Co <= 32 with C <= 16 the one with K 16.
    * Co > 128 with C >= 64 when 64x256 tiles still give a full wave on ``sms`` SMs: the big
      tile (the A-tile BatchNorm-ReLU amortised over 256 columns).
    * Co >= 128 (and C >= 32) with a full wave of 128x128 tiles: the wide tile.
    * C >= 32 with a full wave of 256x64 tiles: 256x64x32 (64-channel units, many pixels).
    * C >= 64: the 64x64x64 tile (few pixels: more, smaller blocks to fill the SMs), or its
      32-row half where that ends the grid's last wave sooner on ``sms`` SMs.
    * otherwise the 64x64x32 tile.

    The first three only when ``aligned`` (see ``is_aligned``).
    """
    if interpreting() if interpret is None else interpret:
        return INTERPRET_CONFIG
    if dtype == torch.float64:
        return FP64_CONFIGS["many_pixels" if m >= 64 * 264 else "few_pixels"]
    configs = named_configs(dtype, interpret=False)
    if dtype == torch.float32:
        if co <= 32:
            return configs["narrow"]
        if co >= 128 and cdiv(m, 128) * cdiv(co, 128) >= sms:
            return configs["wide"]
        if m * co >= 128 * 64 * 264:
            return configs["many_pixels"]
        if "mid_short" in configs and short_rows_fill_better(m, cdiv(co, 64), sms, 64, 32):
            return configs["mid_short"]
        return configs["mid"]
    if co <= 16:
        return configs["narrow_n16"]
    if co <= 32:
        return configs["narrow_n32_k16" if c <= 16 else "narrow_n32"]
    if not aligned:
        return configs["mid"]
    if co > 128 and c >= 64 and cdiv(m, 64) * cdiv(co, 256) >= sms:
        return configs["big_n256"]
    if co >= 128 and c >= 32 and cdiv(m, 128) * cdiv(co, 128) >= sms:
        return configs["wide_n128"]
    if c >= 32 and cdiv(m, 256) * cdiv(co, 64) >= sms:
        return configs["tall_n64"]
    if c >= 64:
        short = short_rows_fill_better(m, cdiv(co, 64), sms, 64, 32)
        return configs["few_pixels_k64_short" if short else "few_pixels_k64"]
    return configs["mid"]


class ForwardPlan:
    """A forward's launches for one key (:func:`forward_plan`): the config, grid, constexprs
    and integer arguments fixed; :meth:`run` allocates y (and the genstats partials) and
    launches on the tensors of a call."""

    def __init__(self, x, weight, bias, scale, shift, residual, stride, padding, dilation,
                 memory_format, genstats: bool, config: KernelConfig | None, branch_scale,
                 merge: bool | None = None):
        """``merge``: genstats' rows merged in the kernel (None: on plain and meta tensors, not
        the fake ones of a trace; False: by stats_combine's launch)."""
        n, c, h, w = x.shape
        co, _, kh, kw = weight.shape
        ho, wo = ConvGeometry(stride, padding, dilation).out_hw(h, w, kh, kw)
        m = n * ho * wo
        if memory_format is None:
            memory_format = out_memory_format(x, weight)
        self.y_shape, self.y_dtype, self.memory_format = (n, co, ho, wo), weight.dtype, \
            memory_format
        y = torch.empty(self.y_shape, device=x.device, dtype=weight.dtype,
                        memory_format=memory_format)  # its strides (and what autotuning runs)
        aligned = is_aligned((c, co), x, weight, y, residual, scale, shift)
        if config is None and autotune_enabled(x, weight):
            configs = [cfg for cfg in configs_for(weight.dtype) if usable(cfg, aligned)]
            config = autotuned(("fwd", *plan_key(x, weight, bias, scale, shift, residual,
                                                 stride, padding, dilation, memory_format,
                                                 genstats, branch_scale)), configs,
                               lambda cfg: ForwardPlan(
                                   x, weight, bias, scale, shift, residual, stride, padding,
                                   dilation, memory_format, genstats, cfg, branch_scale).run(
                                   x, weight, scale, shift, bias, residual, branch_scale))
        cfg = config or pick_config(m, co, c, weight.dtype, sms=sm_count(x.device),
                                    aligned=aligned)
        check_usable(cfg, aligned)
        bm, bn = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"]
        grid = (cdiv(m, bm), cdiv(co, bn))
        self.genstats = genstats
        self.stats_shape = (grid[0], co)
        self.acc = torch.float64 if acc_is_fp64(weight.dtype) else torch.float32
        self.out_stats_dtype = stats_dtype(weight.dtype)
        self.rows, self.co, self.m, self.bm = grid[0], co, m, bm
        self.unused = dummy(scale)  # the absent optional tensors' pointers: never read
        self.unused_w = dummy(weight)
        self.ints = (c, h, w, co, ho, wo, m, kh, kw, *stride, *padding, *dilation,
                     *x.stride(), *weight.stride(), *y.stride(),
                     *(residual.stride() if residual is not None else (0, 0, 0, 0)))
        real = type(x) is torch.Tensor
        # genstats' rows merged in the kernel (its last row tile of each column tile) on plain
        # and meta tensors; in a traced graph (fake tensors) by stats_combine's launch, as the
        # counts the merge needs would be a buffer of the graph's own, not zero.
        self.merge = genstats and (real if merge is None else merge)
        self.launch = Launch(bn_relu_conv2d_fwd_kernel, (grid[0] * grid[1],), dict(
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, GENSTATS=genstats,
            MERGE=self.merge, BLOCK_R=STATS_COMBINE_CONFIG.meta["BLOCK_R"],
            HAS_BSCALE=branch_scale is not None, FP64=acc_is_fp64(weight.dtype),
            TF32=allow_tf32(weight.dtype), EVEN_K=c % cfg.meta["BLOCK_K"] == 0,
            EVEN_N=co % bn == 0, ONE_CB=c <= cfg.meta["BLOCK_K"],
            INTERP_BF16=interp_bf16(weight.dtype),
            # Every constexpr passed, defaults included: torch.library.wrap_triton's analysis
            # of which tensors a kernel writes needs them all (else it assumes every input
            # written).
            **{"BSCALE_AT": 0, "ALIGNED": 0, **cfg.launch_kwargs}), fast=real)
        self.combine = stats_combine_launch(co, fast=real) if genstats and not self.merge \
            else None
        self.arrivals = None
        if self.merge:  # zero between launches; no kernel for meta tensors (jit_spec)
            self.arrivals = (torch.empty if x.device.type == "meta" else torch.zeros)(
                (grid[1],), device=x.device, dtype=torch.int32)
        # The eager route's backward plans for this forward, by gradient layout and outputs
        # (fusedres.backends.triton.EagerTritonUnit fills it); the geometry they read.
        self.backwards: dict = {}
        self.geometry = (tuple(stride), tuple(padding), tuple(dilation))

    def run(self, x, weight, scale, shift, bias, residual, branch_scale):
        """y, or with genstats ``(y, mean, var)`` of y per channel."""
        y = torch.empty(self.y_shape, device=x.device, dtype=self.y_dtype,
                        memory_format=self.memory_format)
        if self.genstats:
            smean = torch.empty(self.stats_shape, device=x.device, dtype=self.acc)
            sm2 = torch.empty(self.stats_shape, device=x.device, dtype=self.acc)
        else:
            smean = sm2 = self.unused
        if self.merge:
            mean = torch.empty((self.co,), device=x.device, dtype=self.out_stats_dtype)
            var = torch.empty((self.co,), device=x.device, dtype=self.out_stats_dtype)
            merged = (self.arrivals, mean, var)
        else:
            merged = (self.unused,) * 3
        self.launch.go(x, weight, scale, shift, self.unused_w if bias is None else bias,
                       self.unused_w if residual is None else residual,
                       self.unused if branch_scale is None else branch_scale, y, smean, sm2,
                       *self.ints, *merged)
        if not self.genstats:
            return y
        if not self.merge:
            mean = torch.empty((self.co,), device=x.device, dtype=self.out_stats_dtype)
            var = torch.empty((self.co,), device=x.device, dtype=self.out_stats_dtype)
            self.combine.go(smean, sm2, mean, var, self.rows, self.co, self.m, self.bm)
        return y, mean, var


def plan_key(x, weight, bias, scale, shift, residual, stride, padding, dilation, memory_format,
             genstats, branch_scale, merge=None) -> tuple:
    """What a :class:`ForwardPlan` depends on: every shape, stride, dtype and device, the
    pointers' 16-byte alignment (Triton specialises on it, ALIGNED configs need it), the
    geometry and flags, and the TF32 setting."""
    return (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
            None if bias is None else (bias.dtype, bias.data_ptr() % 16),
            None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                           residual.data_ptr() % 16),
            None if branch_scale is None else (branch_scale.dtype, branch_scale.data_ptr() % 16),
            scale.dtype, shift.dtype, x.data_ptr() % 16, weight.data_ptr() % 16,
            scale.data_ptr() % 16, shift.data_ptr() % 16, tuple(stride), tuple(padding),
            tuple(dilation), memory_format, genstats, tf32_allowed(), merge)


_PLANS: dict[tuple, ForwardPlan] = plan_cache()


def forward_plan(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                 memory_format=None, genstats: bool = False, branch_scale=None,
                 merge: bool | None = None) -> ForwardPlan:
    """The cached :class:`ForwardPlan` for these arguments (fake tensors, under a trace: a new
    one, never cached). ``memory_format`` None: y's layout by fusedres.ops.opdefs'
    ``out_memory_format`` (what the key's strides decide). ``merge``: as ForwardPlan's."""
    if type(x) is not torch.Tensor or x.device.type == "meta":
        return ForwardPlan(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                           memory_format, genstats, None, branch_scale, merge)
    key = plan_key(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                   memory_format, genstats, branch_scale, merge)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = ForwardPlan(x, weight, bias, scale, shift, residual, stride,
                                         padding, dilation, memory_format, genstats, None,
                                         branch_scale, merge)
    return plan


def bn_relu_conv2d_fwd(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                       memory_format, genstats: bool = False, config: KernelConfig | None = None,
                       branch_scale=None):
    """y (N, Co, Ho, Wo) in weight.dtype and ``memory_format``; with ``genstats`` also the
    (mean, biased var) of y per output channel in the statistics dtype of y.

    x: (N, C, H, W) any float dtype and strides; weight (Co, C, kh, kw); scale, shift (C,) in the
    statistics dtype of x; bias (Co,) or None; residual (N, Co, Ho, Wo) in weight.dtype or None;
    branch_scale (N,) contiguous in the accumulator dtype (float32, float64 for float64) or None:
    y = residual + branch_scale[n] * (conv + bias). ``config``: this config (uncached plan).
    """
    if config is not None:
        plan = ForwardPlan(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                           memory_format, genstats, config, branch_scale)
    else:
        plan = forward_plan(x, weight, bias, scale, shift, residual, stride, padding, dilation,
                            memory_format, genstats, branch_scale)
    return plan.run(x, weight, scale, shift, bias, residual, branch_scale)
