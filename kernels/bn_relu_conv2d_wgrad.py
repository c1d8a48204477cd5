"""Weight (and bias) gradient of the fused unit, and the BatchNorm backward sums.

dW[co, c, i, j] = sum over (n, oh, ow) of dy[n, co, oh, ow] * a[n, c, oh*sh - ph + i*dh, ...]
with ``a = relu(scale * x + shift)`` recomputed in the operand load (zero outside the image).
Implicit GEMM per tap: rows are output channels, columns input channels, the reduction runs
over the output pixels (K = N*Ho*Wo). Small Co*C*kh*kw gives few tiles, so the reduction is
split over ``SPLIT`` programs writing float32 (float64) partials, summed on the host. The conv
bias gradient (sum of dy) is reduced by the programs of the first column block and tap, from
the dy tiles they load anyway. With a branch scale (stochastic depth) every result is linear in
s[n] * dy per pixel, so the factor goes on the x-side operand, which is computed in registers
anyway (the activation, or the SUMS variant's mask and mask * xhat), and on the bias sum; dy
tiles still go from memory to the MMA untouched.

``SUMS`` variant. With m = [scale*x + shift > 0] and xhat = (x - mean) * invstd, the activation
is a = m * (gamma * xhat + beta), so two correlations of dy,

    G1[co, c, i, j] = sum dy * m          G2[co, c, i, j] = sum dy * m * xhat

(both at the tap's shifted pixel) give the weight gradient, dW = gamma * G2 + beta * G1, and,
contracted with the weight, the sums BatchNorm backward needs:

    sum_p dz[p, c] = sum_{co,i,j} W * G1        sum_p dz * xhat = sum_{co,i,j} W * G2

(dz = m * conv_transpose(dy, W)). So this one pass over dy and x yields everything the data
gradient needs to write dx directly, in one more pass: no dz round trip through memory. It
costs a second GEMM of the weight-gradient size.

Taps form (``BLOCK_T`` > 1, ``_wgrad_taps``; unit stride, several taps, no bias, few channels:
``use_taps``). Per tap, a 16-channel unit's tiles are 16 x 16 and every program re-forms the
same x tile; instead, with the reduction over the input pixels q, one program forms the
x-side operands of a pixel tile once for BLOCK_T taps, its GEMM rows (tap, co), and gathers
dy per tap at q's output pixel (zero outside grad_out). Its BN sums' partials are summed over
the program's taps: (SPLIT, Co blocks, tap groups, C).
"""

from __future__ import annotations

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
    config_variant,
    dummy,
    interp_bf16,
    interpreting,
    named,
    plan_cache,
    sm_count,
    tf32_allowed,
)
from ._tl import cast, mma, relu_window
from .bn_relu_conv2d import bn_relu_tile
from .reductions import ReducePlan

# The configs, one table keyed by (dtype, variant): the dtype as ``config_variant`` names it
# (float16 and bfloat16 share theirs; "fp32" with TF32 products, "fp32-ieee" without) and the
# kernel variant, "plain" or "sums" (the BatchNorm sums beside dW). Each list names its configs:
# the per-tap tiles "mid", "big", "small" (and the sums lists' "tiny", but float64's), then
# the taps form's "taps" and "taps_wide" (``use_taps``: unit stride, no bias, <= 32 channels
# each side). Each entry's comment is the rule the host picks it by (``pick_config``) and why
# the tile is shaped so; the order is the order ``configs_for`` gives the autotuner and
# tools/triton_aot.py. The SASS and model figures behind each tile: kernels/TUNING.md, "Weight
# gradient". M is Co, N is C, K the output pixels. Each K-step splits its pixel indices into
# (n, oh, ow) for both operand tiles: the loop is issue-bound, so the big tiles take a long K
# (that index work paid once for more MMAs). 16-bit tiles are wgmma-sized (M 64 a warpgroup);
# wider ones (64x128 on 4 warps, K 64) spill in the unspecialised compile
# (tools/triton_aot.py).
_PER_TAP = {
    ("16bit", "plain"): {
        # The fallback: more than 32 channels each side, not both wide.
        "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
        # Co >= 128 and C >= 64: K 64 in 2 stages, the index work amortised over twice the
        # MMAs.
        "big": KernelConfig.of(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2),
        # <= 32 channels on either side: no padded rows or columns past 32.
        "small": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2),
    },
    # float32 with TF32 products: the same rules.
    ("fp32", "plain"): {
        # The fallback.
        "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
        # Co >= 128 and C >= 64: 128x128 for the same reason as 16-bit's big, K 32 in 2 stages.
        "big": KernelConfig.of(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=2),
        # <= 32 channels on either side.
        "small": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
    },
    # float32 without TF32 (``ieee`` products: FMA, no tensor cores), the same rules. An FMA
    # tile keeps BLOCK_M*BLOCK_N / threads accumulators and, per K-step, the broadcast operand
    # rows of its fragment in registers: the TF32 tiles spill here. K 16 and 2 stages: none
    # spill.
    ("fp32-ieee", "plain"): {
        # The fallback: 16 accumulators a thread.
        "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=2),
        # Co >= 128 and C >= 64: 32 accumulators a thread.
        "big": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=2),
        # <= 32 channels on either side: 8 accumulators a thread.
        "small": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
    },
    # float64: one per-tap tile for every shape (every per-tap launch).
    ("fp64", "plain"): {
        "mid": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=3),
    },
    # The sums variant carries two accumulators: 8 warps (two warpgroups) for the wide ones.
    # Each x element it loads is recomputed (mask, m * x) once and used by BLOCK_M output
    # channels: the wide tile is tall (128 output channels x 64 input), not wide.
    ("16bit", "sums"): {
        # The fallback, on 4 warps: with 8, sm_80's mma.sync layout repeats each product on two.
        "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
        # Co >= 128 and C >= 64: tall, 128 output channels x 64 input.
        "big": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3),
        # <= 32 channels on either side.
        "small": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
        # <= 16 channels each side: 16x16, no padded rows or columns in either GEMM.
        "tiny": KernelConfig.of(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
    },
    # float32 (TF32), tall for the same reason.
    ("fp32", "sums"): {
        # The fallback, on 4 warps as 16-bit's.
        "mid": KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
        # Co >= 128 and C >= 64: tall (64x128 is issue-bound, 128x64 tensor-bound).
        "big": KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=2),
        # <= 32 channels on either side.
        "small": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
        # <= 16 channels each side: no padded rows or columns.
        "tiny": KernelConfig.of(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2),
    },
    # float64: one per-tap tile for every shape (every per-tap launch).
    ("fp64", "sums"): {
        "mid": KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
    },
}
# float32 without TF32, sums: the TF32 per-tap tiles are spill-free with ieee products too.
_PER_TAP["fp32-ieee", "sums"] = _PER_TAP["fp32", "sums"]

# The taps form's tiles, the same in both variants: "taps" (<= 16 channels each side; GEMM
# rows (tap, co), 4 taps x 16 = a wgmma m64) and "taps_wide" (up to 32 output channels: 4 taps
# x 32 rows), 4 warps, 2 stages. Only K differs, by dtype: 64 on 16-bit; TF32's wide tile
# K 32; without tensor cores (ieee, float64) K 16 (ieee's K 64 takes 255 registers and spills).
_TAPS_K = {"16bit": (64, 64), "fp32": (64, 32), "fp32-ieee": (16, 16), "fp64": (16, 16)}


def _taps_form(dtype: str) -> dict[str, KernelConfig]:
    k, k_wide = _TAPS_K[dtype]
    return {"taps": KernelConfig.of(BLOCK_M=16, BLOCK_N=16, BLOCK_K=k, BLOCK_T=4, num_warps=4,
                                    num_stages=2),
            "taps_wide": KernelConfig.of(BLOCK_M=32, BLOCK_N=16, BLOCK_K=k_wide, BLOCK_T=4,
                                         num_warps=4, num_stages=2)}


def _table() -> dict[tuple[str, str], dict[str, KernelConfig]]:
    out = {}
    for (dtype, variant), per_tap in _PER_TAP.items():
        configs = named({**per_tap, **_taps_form(dtype)})
        for name in (("fp16", "bf16") if dtype == "16bit" else (dtype,)):
            out[name, variant] = configs
    return out


# (config_variant's dtype name, "plain" | "sums") -> the configs by name.
CONFIGS = _table()
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)
INTERPRET_TAPS_CONFIG = KernelConfig.of(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, BLOCK_T=16,
                                        num_warps=4, num_stages=1)
# The taps form (_wgrad_taps) takes the units whose per-tap tiles are too small to feed the
# MMA: the program computes BLOCK_T taps (GEMM rows (tap, co): M = BLOCK_T * BLOCK_M, a
# wgmma m64 at 4 x 16), the x-side operands (mask, m * x) once per pixel tile for all of
# them, and gathers dy per tap. 3x3 taps in groups of 4 (4, 4, 1): 25% padded rows; 16 (one
# group) pads 44% and needs ~3x the split to fill the SMs (more partials to reduce). At 64
# channels the per-tap tiles are faster (modeled; kernels/TUNING.md, "Weight gradient").
TAPS_MAX_CHANNELS = 32


@triton.jit
def _x_operands(x_ptr, row_off, row_ok, c, c_ok, C, sxc, scale_ptr, shift_ptr, bsc, sc, sh, mu,
                inv, lo, hi, op_t, acc_t, SUMS: tl.constexpr, X16: tl.constexpr,
                INTERP_BF16: tl.constexpr, HAS_BSCALE: tl.constexpr):
    """The x-side operands of a (pixels, channels) tile: with ``SUMS`` the mask m and m * xhat
    (16-bit x: m * x), else the activation; times the pixel's branch scale ``bsc``."""
    if SUMS:
        mask = row_ok[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + row_off[:, None] + c[None, :] * sxc, mask=mask, other=0.0)
        if X16:
            if INTERP_BF16:
                xf = xv.to(tl.float32)
                on = mask & ~(xf <= lo.to(tl.float32)[None, :]) \
                    & ~(xf >= hi.to(tl.float32)[None, :])
            else:
                on = mask & ~(xv <= lo[None, :]) & ~(xv >= hi[None, :])
            if HAS_BSCALE:
                b1 = cast(tl.where(on, bsc[:, None], 0.0), op_t, INTERP_BF16)
                b2 = cast(tl.where(on, xv.to(acc_t) * bsc[:, None], 0.0), op_t, INTERP_BF16)
            else:
                b1 = tl.where(on, 1.0, 0.0).to(op_t)
                b2 = tl.where(on, xv, 0.0).to(op_t)
        else:
            xs = xv.to(sc.dtype)
            on = mask & ~(xs * sc[None, :] + sh[None, :] <= 0)  # NaN passes, as in torch
            xhat = (xs - mu[None, :]) * inv[None, :]
            if HAS_BSCALE:
                b1 = cast(tl.where(on, bsc[:, None], 0.0), op_t, INTERP_BF16)
                b2 = cast(tl.where(on, xhat * bsc[:, None], 0.0), op_t, INTERP_BF16)
            else:
                b1 = tl.where(on, 1.0, 0.0).to(op_t)
                b2 = cast(tl.where(on, xhat, 0.0), op_t, INTERP_BF16)
        return b1, b2
    else:
        if HAS_BSCALE:
            a = bn_relu_tile(x_ptr, row_off, row_ok, c, C, sxc, scale_ptr, shift_ptr, acc_t,
                             False)
            a = cast(a * bsc[:, None], op_t, INTERP_BF16)
        else:
            a = bn_relu_tile(x_ptr, row_off, row_ok, c, C, sxc, scale_ptr, shift_ptr, op_t,
                             INTERP_BF16)
        return a, a


@triton.jit
def _wgrad_store(dw_ptr, off, out_mask, w_ptr, w_off, s1_ptr, s2_ptr, row, gamma_ptr, beta_ptr,
                 c, c_ok, C, acc1, acc2, acc_t, SUMS: tl.constexpr, INTERP_BF16: tl.constexpr):
    """The finish of a weight-gradient program: its tile into ``dw_ptr + off`` (float32
    partials per split, or the weight gradient itself when SPLIT is 1). With SUMS, dW = gamma *
    G2 + beta * G1, and the BN sums' partials, W * G1 and W * G2 summed over the program's
    output channels (and taps), into row ``row`` of s1 and s2: everything is linear in G1, G2,
    so they are reduced here, per split, instead of stored."""
    out_t = dw_ptr.dtype.element_ty
    if SUMS:
        wt = tl.load(w_ptr + w_off, mask=out_mask, other=0.0).to(acc_t)
        tl.store(s1_ptr + row * C + c, tl.sum(wt * acc1, axis=0), mask=c_ok)
        tl.store(s2_ptr + row * C + c, tl.sum(wt * acc2, axis=0), mask=c_ok)
        gam = tl.load(gamma_ptr + c, mask=c_ok, other=0.0).to(acc_t)
        bet = tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(acc_t)
        tl.store(dw_ptr + off, cast(gam[None, :] * acc2 + bet[None, :] * acc1, out_t,
                                    INTERP_BF16), mask=out_mask)
    else:
        tl.store(dw_ptr + off, cast(acc1, out_t, INTERP_BF16), mask=out_mask)


@triton.jit
def _wgrad_taps(
    dy_ptr, x_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, w_ptr, gamma_ptr, beta_ptr,
    dw_ptr, s1_ptr, s2_ptr, bscale_ptr,
    C, H, W, Co, Ho, Wo, M, KH, KW, PH, PW, DH, DW,
    sdn, sdc, sdh, sdw,
    sxn, sxc, sxh, sxw,
    swo, swc, swh, sww,
    sgs, sgo, sgc, sgh, sgw,
    iters_per_split,
    SUMS: tl.constexpr, FP64: tl.constexpr, TF32: tl.constexpr,
    INTERP_BF16: tl.constexpr, X16: tl.constexpr, HAS_BSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The taps form (stride 1, no bias): one program computes BLOCK_T taps of a BLOCK_M x
    BLOCK_N (output x input channels) block, its GEMM rows (tap, co), the reduction over the
    input pixels q (M = N*H*W). The x-side operands are computed once per pixel tile for all
    its taps; the dy operand is gathered per tap at q's output pixel (oh, ow) = (ih + PH -
    i*DH, iw + PW - j*DW), zero outside grad_out, and goes from memory to the MMA untouched."""
    pid_m = tl.program_id(0)
    pid_nt = tl.program_id(1)
    split = tl.program_id(2)
    taps = KH * KW
    groups = tl.cdiv(taps, BLOCK_T)
    pid_n = pid_nt // groups
    tg = pid_nt % groups
    acc_t = tl.float64 if FP64 else tl.float32
    r = tl.arange(0, BLOCK_T * BLOCK_M)
    t = tg * BLOCK_T + r // BLOCK_M
    co = pid_m * BLOCK_M + r % BLOCK_M
    i = t // KW
    j = t % KW
    r_ok = (co < Co) & (t < taps)
    dh = PH - i * DH
    dwo = PW - j * DW
    r_off = co * sdc + dh * sdh + dwo * sdw
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < C
    kk = tl.arange(0, BLOCK_K)
    hw = H * W
    acc1 = tl.zeros((BLOCK_T * BLOCK_M, BLOCK_N), dtype=acc_t)
    acc2 = tl.zeros((BLOCK_T * BLOCK_M, BLOCK_N), dtype=acc_t)
    sc = tl.load(scale_ptr + c, mask=c_ok, other=0.0)
    sh = tl.load(shift_ptr + c, mask=c_ok, other=0.0)
    mu = sc
    inv = sc
    lo = sc
    hi = sc
    if SUMS:
        mu = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
        inv = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
        if X16:
            lo, hi = relu_window(sc, sh, x_ptr.dtype.element_ty, INTERP_BF16)
    # Row r's dy is in bounds at the input pixels with ih in [ih_lo, ih_hi), iw likewise (an
    # empty range for the rows past the taps or the output channels).
    ih_lo = tl.where(r_ok, -dh, H)
    ih_hi = Ho - dh
    iw_lo = -dwo
    iw_hi = Wo - dwo
    k_begin = split * iters_per_split * BLOCK_K
    # The input pixel (n, ih, iw) of each column. ROWS (H*W a multiple of BLOCK_K, BLOCK_K of
    # W): a K-step is whole image rows of one image, so n is a scalar and (ih - its first row,
    # iw) the same each step. Else advanced by BLOCK_K with one carry each.
    q = k_begin + kk
    n = q // hw
    ih = (q % hw) // W
    iw = q % W
    qn = BLOCK_K // hw
    qh = (BLOCK_K % hw) // W
    qw = BLOCK_K % W
    for k0 in range(k_begin, k_begin + iters_per_split * BLOCK_K, BLOCK_K):
        if ROWS:
            pn = k0 // hw
            pih = (k0 % hw) // W + kk // W
            piw = kk % W
            q_ok = kk < M - k0
        else:
            pn = n
            pih = ih
            piw = iw
            q_ok = k0 + kk < M
        g_ok = (q_ok[None, :] & (pih[None, :] >= ih_lo[:, None]) & (pih[None, :] < ih_hi[:, None])
                & (piw[None, :] >= iw_lo[:, None]) & (piw[None, :] < iw_hi[:, None]))
        g = tl.load(dy_ptr + r_off[:, None] + (pn * sdn + pih * sdh + piw * sdw)[None, :],
                    mask=g_ok, other=0.0)
        bsc = q_ok
        if HAS_BSCALE:
            if ROWS:
                bsc = tl.load(bscale_ptr + pn).to(acc_t) + tl.zeros((BLOCK_K,), dtype=acc_t)
            else:
                bsc = tl.load(bscale_ptr + pn, mask=q_ok, other=0.0).to(acc_t)
        b1, b2 = _x_operands(x_ptr, pn * sxn + pih * sxh + piw * sxw, q_ok, c, c_ok, C, sxc,
                             scale_ptr, shift_ptr, bsc, sc, sh, mu, inv, lo, hi, g.dtype, acc_t,
                             SUMS, X16, INTERP_BF16, HAS_BSCALE)
        acc1 = mma(acc1, g, b1, TF32, INTERP_BF16)
        if SUMS:
            acc2 = mma(acc2, g, b2, TF32, INTERP_BF16)
        if not ROWS:
            iw += qw
            carry = iw >= W
            iw = tl.where(carry, iw - W, iw)
            ih += qh + carry.to(tl.int32)
            carry = ih >= H
            ih = tl.where(carry, ih - H, ih)
            n += qn + carry.to(tl.int32)
    off = split * sgs + co[:, None] * sgo + c[None, :] * sgc + (i * sgh + j * sgw)[:, None]
    out_mask = r_ok[:, None] & c_ok[None, :]
    if SUMS:
        if X16:
            acc2 = (acc2 - mu.to(acc_t)[None, :] * acc1) * inv.to(acc_t)[None, :]
    # The BN sums' partials, summed over the program's output channels and taps.
    w_off = co[:, None] * swo + c[None, :] * swc + (i * swh + j * sww)[:, None]
    row = (split * tl.num_programs(0) + pid_m) * groups + tg
    _wgrad_store(dw_ptr, off, out_mask, w_ptr, w_off, s1_ptr, s2_ptr, row, gamma_ptr, beta_ptr,
                 c, c_ok, C, acc1, acc2, acc_t, SUMS, INTERP_BF16)


@triton.jit
def wgrad_kernel(
    dy_ptr, x_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, w_ptr, gamma_ptr, beta_ptr,
    dw_ptr, s1_ptr, s2_ptr, db_ptr, bscale_ptr,
    C, H, W, Co, Ho, Wo, M, KH, KW,
    SH, SW, PH, PW, DH, DW,
    sdn, sdc, sdh, sdw,
    sxn, sxc, sxh, sxw,
    swo, swc, swh, sww,
    sgs, sgo, sgc, sgh, sgw,
    iters_per_split,
    SUMS: tl.constexpr, HAS_DB: tl.constexpr, FP64: tl.constexpr, TF32: tl.constexpr,
    INTERP_BF16: tl.constexpr, X16: tl.constexpr, DY_DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BSCALE: tl.constexpr = False, BLOCK_T: tl.constexpr = 1, ROWS: tl.constexpr = False,
):
    """dW partials (SPLIT, Co, C, KH, KW); with SUMS also the BN sums' partials
    (SPLIT, Co blocks, KH*KW, C): sum over the block's co of W * G1 and W * G2.
    ``BLOCK_T`` > 1: the taps form (_wgrad_taps), its sums' partials (SPLIT, Co blocks,
    tap groups, C)."""
    if BLOCK_T > 1:
        _wgrad_taps(dy_ptr, x_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, w_ptr, gamma_ptr,
                    beta_ptr, dw_ptr, s1_ptr, s2_ptr, bscale_ptr,
                    C, H, W, Co, Ho, Wo, M, KH, KW, PH, PW, DH, DW,
                    sdn, sdc, sdh, sdw, sxn, sxc, sxh, sxw, swo, swc, swh, sww,
                    sgs, sgo, sgc, sgh, sgw, iters_per_split,
                    SUMS, FP64, TF32, INTERP_BF16, X16, HAS_BSCALE,
                    BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T, ROWS)
    else:
        pid_m = tl.program_id(0)
        pid_nt = tl.program_id(1)
        split = tl.program_id(2)
        taps = KH * KW
        pid_n = pid_nt // taps
        t = pid_nt % taps
        i = t // KW
        j = t % KW
        acc_t = tl.float64 if FP64 else tl.float32
        co = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        co_ok = co < Co
        c_ok = c < C
        kk = tl.arange(0, BLOCK_K)
        hw = Ho * Wo
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
        db = tl.zeros((BLOCK_M,), dtype=acc_t)
        if SUMS:
            sc = tl.load(scale_ptr + c, mask=c_ok, other=0.0)
            sh = tl.load(shift_ptr + c, mask=c_ok, other=0.0)
            mu = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
            inv = tl.load(invstd_ptr + c, mask=c_ok, other=0.0)
            if X16:
                lo, hi = relu_window(sc, sh, x_ptr.dtype.element_ty, INTERP_BF16)
        k_begin = split * iters_per_split * BLOCK_K
        # The pixel indices (n, oh, ow) of the x tile's rows, advanced by BLOCK_K pixels a K-step
        # with one carry each (no integer division in the loop): BLOCK_K = qn*hw + qh*Wo + qw.
        o = k_begin + kk
        n = o // hw
        oh = (o % hw) // Wo
        ow = o % Wo
        qn = BLOCK_K // hw
        qh = (BLOCK_K % hw) // Wo
        qw = BLOCK_K % Wo
        for k0 in range(k_begin, k_begin + iters_per_split * BLOCK_K, BLOCK_K):
            o = k0 + kk
            o_ok = o < M
            if DY_DENSE:  # grad_out's pixels one stride apart (channels_last): no (n, oh, ow)
                g = tl.load(dy_ptr + co[:, None] * sdc + o[None, :] * sdw,
                            mask=co_ok[:, None] & o_ok[None, :], other=0.0)
            else:
                dy_off = n * sdn + oh * sdh + ow * sdw
                g = tl.load(dy_ptr + co[:, None] * sdc + dy_off[None, :],
                            mask=co_ok[:, None] & o_ok[None, :], other=0.0)
            if HAS_BSCALE:
                bsc = tl.load(bscale_ptr + n, mask=o_ok, other=0.0).to(acc_t)
            if HAS_DB:
                if pid_nt == 0:
                    if HAS_BSCALE:
                        db += tl.sum(g.to(acc_t) * bsc[None, :], axis=1)
                    else:
                        db += tl.sum(g.to(acc_t), axis=1)
            ih = oh * SH - PH + i * DH
            iw = ow * SW - PW + j * DW
            row_ok = o_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            row_off = n * sxn + ih * sxh + iw * sxw
            if SUMS:
                mask = row_ok[:, None] & c_ok[None, :]
                xv = tl.load(x_ptr + row_off[:, None] + c[None, :] * sxc, mask=mask, other=0.0)
                if X16:
                    # 16-bit x: the mask from two compares in x's dtype (relu_window), and the
                    # second operand m * x, exact, so G3 = sum dy * m * x and G2 = invstd * (G3 -
                    # mean * G1) in the epilogue: no conversion, FMA or rounding per element.
                    if INTERP_BF16:
                        xf = xv.to(tl.float32)
                        on = mask & ~(xf <= lo.to(tl.float32)[None, :]) \
                            & ~(xf >= hi.to(tl.float32)[None, :])
                    else:
                        on = mask & ~(xv <= lo[None, :]) & ~(xv >= hi[None, :])
                    if HAS_BSCALE:
                        b1 = cast(tl.where(on, bsc[:, None], 0.0), g.dtype, INTERP_BF16)
                        b2 = cast(tl.where(on, xv.to(acc_t) * bsc[:, None], 0.0), g.dtype,
                                  INTERP_BF16)
                    else:
                        b1 = tl.where(on, 1.0, 0.0).to(g.dtype)
                        b2 = tl.where(on, xv, 0.0).to(g.dtype)
                else:
                    xs = xv.to(sc.dtype)
                    on = mask & ~(xs * sc[None, :] + sh[None, :] <= 0)  # NaN passes, as in torch
                    xhat = (xs - mu[None, :]) * inv[None, :]
                    if HAS_BSCALE:  # the pixel's factor on the operand computed in registers
                        b1 = cast(tl.where(on, bsc[:, None], 0.0), g.dtype, INTERP_BF16)
                        b2 = cast(tl.where(on, xhat * bsc[:, None], 0.0), g.dtype, INTERP_BF16)
                    else:
                        b1 = tl.where(on, 1.0, 0.0).to(g.dtype)
                        b2 = cast(tl.where(on, xhat, 0.0), g.dtype, INTERP_BF16)
                acc1 = mma(acc1, g, b1, TF32, INTERP_BF16)
                acc2 = mma(acc2, g, b2, TF32, INTERP_BF16)
            else:
                if HAS_BSCALE:
                    a = bn_relu_tile(x_ptr, row_off, row_ok, c, C, sxc, scale_ptr, shift_ptr, acc_t,
                                     False)
                    a = cast(a * bsc[:, None], g.dtype, INTERP_BF16)
                else:
                    a = bn_relu_tile(x_ptr, row_off, row_ok, c, C, sxc, scale_ptr, shift_ptr,
                                     g.dtype, INTERP_BF16)
                acc1 = mma(acc1, g, a, TF32, INTERP_BF16)
            ow += qw
            carry = ow >= Wo
            ow = tl.where(carry, ow - Wo, ow)
            oh += qh + carry.to(tl.int32)
            carry = oh >= Ho
            oh = tl.where(carry, oh - Ho, oh)
            n += qn + carry.to(tl.int32)
        if SUMS:
            if X16:
                acc2 = (acc2 - mu.to(acc_t)[None, :] * acc1) * inv.to(acc_t)[None, :]
        # dW: float32 partials (split, Co, C, KH, KW), or the weight gradient itself when SPLIT
        # is 1.
        off = split * sgs + co[:, None] * sgo + c[None, :] * sgc + i * sgh + j * sgw
        out_mask = co_ok[:, None] & c_ok[None, :]
        w_off = co[:, None] * swo + c[None, :] * swc + i * swh + j * sww
        row = (split * tl.num_programs(0) + pid_m) * taps + t
        _wgrad_store(dw_ptr, off, out_mask, w_ptr, w_off, s1_ptr, s2_ptr, row, gamma_ptr,
                     beta_ptr, c, c_ok, C, acc1, acc2, acc_t, SUMS, INTERP_BF16)
        if HAS_DB:
            if pid_nt == 0:
                tl.store(db_ptr + split * Co + co, db, mask=co_ok)


def configs_for(dtype, sums: bool = False, interpret: bool | None = None) -> list[KernelConfig]:
    """The configs of the plain (``sums``: SUMS) variant for operands of ``dtype``, a torch
    dtype (float32: with or without TF32 as it runs now, see ``config_variant``) or a variant
    name ("fp32-ieee": float32 without TF32)."""
    return list(named_configs(dtype, sums, interpret).values())


def named_configs(dtype, sums: bool = False,
                  interpret: bool | None = None) -> dict[str, KernelConfig]:
    """:func:`configs_for`'s configs by name (the rules ``pick_config`` picks them by)."""
    return CONFIGS[config_variant(dtype, interpret), "sums" if sums else "plain"]


def sums_configs_for(dtype, interpret: bool | None = None) -> list[KernelConfig]:
    return configs_for(dtype, sums=True, interpret=interpret)


def pick_config(co: int, c: int, dtype: torch.dtype, interpret: bool | None = None,
                sums: bool = False, taps: bool = False) -> KernelConfig:
    """The configs by name in every list: "mid", "big" (wide channels), "small" (<= 32
    channels); the SUMS lists (but float64's) also "tiny" (16 channels or fewer each side).
    ``taps`` (``use_taps``): the taps form's "taps" (<= 16 channels each side), else
    "taps_wide"."""
    if interpreting() if interpret is None else interpret:
        return INTERPRET_TAPS_CONFIG if taps else INTERPRET_CONFIG
    configs = named_configs(dtype, sums, interpret=False)
    if taps:
        return configs["taps" if co <= 16 and c <= 16 else "taps_wide"]
    if dtype == torch.float64:
        return configs["mid"]
    if co >= 128 and c >= 64:
        return configs["big"]
    if sums and co <= 16 and c <= 16:
        return configs["tiny"]
    if co <= 32 or c <= 32:
        return configs["small"]
    return configs["mid"]


def use_taps(co: int, c: int, kh: int, kw: int, stride, want_bias: bool) -> bool:
    """Whether the weight gradient runs in the taps form (``_wgrad_taps``): a unit-stride
    convolution with more than one tap, no conv bias, and at most ``TAPS_MAX_CHANNELS``
    channels each side (wider ones fill the grid with per-tap tiles already)."""
    return (tuple(stride) == (1, 1) and kh * kw > 1 and not want_bias
            and co <= TAPS_MAX_CHANNELS and c <= TAPS_MAX_CHANNELS)


def whole_rows(h: int, w: int, block_k: int) -> bool:
    """Whether every K-step of the taps form (``block_k`` input pixels) is whole image rows of
    one image (its ``ROWS`` specialisation: no per-pixel index carries)."""
    return (h * w) % block_k == 0 and block_k % w == 0


def taps_of(cfg: KernelConfig) -> int:
    """BLOCK_T of a config: the taps one program computes (1: the per-tap form)."""
    return cfg.meta.get("BLOCK_T", 1)


# The split rule's device model (H100 SXM public figures: 989 TFLOP/s dense fp16 on 132 SMs,
# 3.35 TB/s HBM3). The loop runs at about a third of the tensor-core rate, issue-bound (sm_90
# SASS, see CONFIGS), hence the per-SM rate used.
SM_FLOPS = 989e12 / 132 / 3
DRAM_BYTES_PER_S = 3.35e12


# The largest split the "store" plan's weight gradient considers (pick_split).
WAVE_SPLITS = 16


def pick_split(co: int, c: int, kh: int, kw: int, m: int, cfg: KernelConfig, sms: int,
               gemms: int = 1) -> int:
    """The split of the reduction with the least modeled time max(compute, DRAM): compute is
    the waves of programs (one an SM) times a program's K-steps at ``SM_FLOPS`` (``gemms``
    products a K-step: 2 for the SUMS variant); DRAM the
    16-bit dy and x the pass reads plus the float32 partials (a (Co, C, kh, kw) tile per
    split, written and read). Splits up to twice the smallest that gives ``sms`` programs,
    >= 4 K-steps a program; the smaller on ties. So the grid fills the SMs where the pass is
    compute-bound. The partials' traffic is capped at half the operand bytes, which keeps a
    step's DRAM bytes under half the plain sequence's (tests/test_traffic_model.py), at some
    time where the grid is small. Worked examples: kernels/TUNING.md, "Splits and their
    reduce"."""
    bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
    bt = taps_of(cfg)
    tiles = cdiv(co, bm) * cdiv(c, bn) * cdiv(kh * kw, bt)
    bm *= bt  # the taps form's GEMM rows are (tap, co)
    k_iters = cdiv(m, bk)
    operands = 2 * m * (c + co)
    if gemms == 1:
        # The "store" plan's weight gradient: no cap on the partials' bytes (that plan trades
        # bytes for a GEMM anyway) and splits up to WAVE_SPLITS, so that a grid of a little
        # more than the SMs is cut finer (kernels/TUNING.md); the partials' read-back is priced
        # as the launch after this one, not overlapped.
        cap = min(max(1, k_iters // 4), max(2 * cdiv(sms, tiles), WAVE_SPLITS))
    else:
        cap = min(2 * cdiv(sms, tiles), max(1, k_iters // 4),
                  max(1, operands // (2 * 8 * co * c * kh * kw)))
    best, best_t = 1, float("inf")
    for s in range(1, cap + 1):
        s, ips = _normalise_split(s, k_iters)
        t_comp = cdiv(tiles * s, sms) * ips * 2 * gemms * bm * bn * bk / SM_FLOPS
        partials = 4 * co * c * kh * kw * s if s > 1 else 0
        if gemms == 1:
            # The reduce that reads the partials back is a launch of its own, after this one.
            t = max(t_comp, (operands + partials) / DRAM_BYTES_PER_S) \
                + partials / DRAM_BYTES_PER_S
        else:
            t = max(t_comp, (operands + 2 * partials) / DRAM_BYTES_PER_S)
        if t < best_t * (1 - 1e-9):
            best, best_t = s, t
    return best


def _normalise_split(split: int, k_iters: int) -> tuple[int, int]:
    """(splits, K-steps per split) with no empty split."""
    split = max(1, min(split, k_iters))
    ips = cdiv(k_iters, split)
    return cdiv(k_iters, ips), ips


class WgradPlan:
    """:func:`bn_relu_conv2d_wgrad`'s launches for one key (:func:`wgrad_plan`): config, split,
    grid, the partials' shapes, constexprs, integer arguments and the reduction's plan fixed;
    :meth:`run` allocates and launches on the tensors of a call."""

    def __init__(self, grad_out, x, weight, stride, padding, dilation, *, want_weight: bool,
                 want_bias: bool, sums: bool, has_out: bool, branch: bool, has_means: bool,
                 out_dtypes: tuple, out_w_strides, config: KernelConfig | None = None,
                 split: int | None = None, run_for_tuning=None):
        n, c, h, w = x.shape
        co, _, kh, kw = weight.shape
        ho, wo = grad_out.shape[2], grad_out.shape[3]
        m = n * ho * wo
        taps_ok = use_taps(co, c, kh, kw, stride, want_bias)
        if config is None and run_for_tuning is not None and autotune_enabled(x, weight):
            key = ("wgrad", x.shape, x.stride(), weight.shape, grad_out.dtype, x.dtype,
                   tuple(stride), tuple(padding), tuple(dilation), want_bias, sums, split,
                   branch)
            config = autotuned(key, [cfg for cfg in configs_for(grad_out.dtype, sums)
                                     if taps_ok or taps_of(cfg) == 1], run_for_tuning)
        cfg = config or pick_config(co, c, grad_out.dtype, sums=sums, taps=taps_ok)
        bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
        bt = taps_of(cfg)
        if bt > 1:
            if not taps_ok:
                raise ValueError(f"config {cfg}: the taps form needs stride 1, more than one tap "
                                 f"and no bias gradient (stride {tuple(stride)}, {kh}x{kw}, "
                                 f"want_bias={want_bias})")
            m = n * h * w  # its reduction runs over the input pixels
        groups = cdiv(kh * kw, bt)
        if split is None:
            split = 1 if interpreting() else pick_split(co, c, kh, kw, m, cfg,
                                                        sm_count(x.device),
                                                        gemms=2 if sums else 1)
        split, ips = _normalise_split(split, cdiv(m, bk))
        fp64 = acc_is_fp64(grad_out.dtype)
        self.acc = acc = torch.float64 if fp64 else torch.float32
        self.sums, self.want_weight, self.want_bias = sums, want_weight, want_bias
        self.direct = direct = has_out and split == 1
        self.split, self.co, self.c, self.kh, self.kw = split, co, c, kh, kw
        dw_strides = (0, *out_w_strides) if direct else \
            torch.empty((split, co, c, kh, kw), device="meta").stride()
        co_blocks = cdiv(co, bm)
        self.s_shape = (split * co_blocks * groups, c)
        real = type(x) is torch.Tensor and x.device.type != "meta"
        self.ints = (c, h, w, co, ho, wo, m, kh, kw, *stride, *padding, *dilation,
                     *grad_out.stride(), *x.stride(), *weight.stride(), *dw_strides, ips)
        self.launch = Launch(wgrad_kernel, (co_blocks, cdiv(c, bn) * groups, split), dict(
            SUMS=sums, HAS_DB=want_bias, HAS_BSCALE=branch, FP64=fp64,
            TF32=allow_tf32(grad_out.dtype), INTERP_BF16=interp_bf16(grad_out.dtype),
            X16=sums and x.dtype in (torch.float16, torch.bfloat16) and grad_out.dtype == x.dtype,
            DY_DENSE=grad_out.stride(0) == ho * wo * grad_out.stride(3)
            and grad_out.stride(2) == wo * grad_out.stride(3),
            ROWS=bt > 1 and whole_rows(h, w, bk),
            # Every constexpr, defaults included: torch 2.11's wrap_triton analysis of what a
            # kernel writes needs them all (else it takes every input as written, and a traced
            # backward fails writing into the weight).
            **{"BLOCK_T": 1, **cfg.launch_kwargs}), fast=real)
        # One launch sums the partials over the splits into the results (none when all are
        # direct).
        self.reduce_w = want_weight and not direct and not (not has_out and split == 1)
        self.take_w0 = want_weight and not direct and not has_out and split == 1
        self.pixels = n * h * w  # x's: the BatchNorm sums' means are over them
        self.unused = dummy(torch.empty((0,), device=x.device, dtype=acc))
        self.reduce = None
        if self.reduce_w or want_bias or sums:
            self.reduce = ReducePlan(
                (split, co, c, kh, kw) if self.reduce_w else None,
                (out_w_strides if has_out else (c * kh * kw, kh * kw, kw, 1))
                if self.reduce_w else None,
                (split, co) if want_bias else None, self.s_shape if sums else None,
                has_means, self.pixels, acc, out_dtypes, fast=real)

    def run(self, grad_out, x, weight, scale, shift, *, bn_affine=None, mean=None, invstd=None,
            out=None, branch_scale=None, out_bias=None, out_sums=None, out_means=None,
            deferred: list | None = None):
        """(grad_weight or None, grad_bias or None, sums or None): see
        :func:`bn_relu_conv2d_wgrad`. ``deferred`` (a list; no BatchNorm sums): the
        reduction is not launched; its partials and destinations are appended to it, as
        :meth:`fusedres.kernels.reductions.ReducePlan.run`'s ``dw_p, dw, db_p, db``, for a
        later reduction that sums other partials in the same launch (the results are written
        then)."""
        dev, acc, split, co, c = x.device, self.acc, self.split, self.co, self.c
        dw = out if self.direct else torch.empty((split, co, c, self.kh, self.kw), device=dev,
                                                 dtype=acc)
        sums = self.sums
        s1 = torch.empty(self.s_shape, device=dev, dtype=acc) if sums else dw
        s2 = torch.empty(self.s_shape, device=dev, dtype=acc) if sums else dw
        db = torch.empty((split, co), device=dev, dtype=acc) if self.want_bias else dw
        gamma, beta = bn_affine if sums else (scale, scale)
        self.launch.go(grad_out, x, scale, shift, mean if sums else scale,
                       invstd if sums else scale, weight, gamma, beta, dw, s1, s2, db,
                       scale if branch_scale is None else branch_scale, *self.ints)
        grad_w = None
        if self.take_w0:
            grad_w = dw[0]
        elif self.reduce_w:
            grad_w = out if out is not None else torch.empty((co, c, self.kh, self.kw),
                                                             device=dev, dtype=acc)
        elif self.direct:
            grad_w = out
        grad_b = None
        if self.want_bias:
            grad_b = out_bias if out_bias is not None else torch.empty((co,), device=dev,
                                                                       dtype=acc)
        reduced = None
        if sums:
            reduced = out_sums if out_sums is not None else (
                torch.empty((c,), device=dev, dtype=acc), torch.empty((c,), device=dev,
                                                                      dtype=acc))
        if deferred is not None:
            deferred += [dw if self.reduce_w else None, grad_w if self.reduce_w else None,
                         db if self.want_bias else None, grad_b]
        elif self.reduce is not None:
            self.reduce.run(self.unused, dw if self.reduce_w else None,
                            grad_w if self.reduce_w else None, db if self.want_bias else None,
                            grad_b,
                            s1 if sums else None, s2 if sums else None, reduced, out_means)
        return grad_w, grad_b, reduced


_PLANS: dict[tuple, WgradPlan] = plan_cache()


def wgrad_plan(grad_out, x, weight, scale, stride, padding, dilation, *, want_weight, want_bias,
               sums, out, branch_scale, out_bias, out_sums, out_means) -> WgradPlan:
    """The cached :class:`WgradPlan` for these arguments (fake and meta tensors: a new one)."""
    out_dtypes = ((out.dtype,) if want_weight and out is not None else ()) + \
        ((out_bias.dtype,) if out_bias is not None else ())
    key = (grad_out.shape, grad_out.stride(), grad_out.dtype, x.shape, x.stride(), x.dtype,
           x.device, weight.shape, weight.stride(), weight.dtype, tuple(stride), tuple(padding),
           tuple(dilation), want_weight, want_bias, sums,
           None if out is None else out.stride(), out_dtypes, branch_scale is not None,
           out_means is not None, tf32_allowed())
    plan = _PLANS.get(key)
    if plan is None:
        plan = WgradPlan(grad_out, x, weight, stride, padding, dilation,
                         want_weight=want_weight, want_bias=want_bias, sums=sums,
                         has_out=out is not None, branch=branch_scale is not None,
                         has_means=out_means is not None, out_dtypes=out_dtypes,
                         out_w_strides=None if out is None else out.stride())
        if type(x) is torch.Tensor and x.device.type != "meta":
            _PLANS[key] = plan
    return plan


def bn_relu_conv2d_wgrad(grad_out, x, weight, scale, shift, stride, padding, dilation, *,
                         want_weight: bool = True, want_bias: bool,
                         bn_affine=None, mean=None, invstd=None, out=None,
                         config: KernelConfig | None = None, split: int | None = None,
                         branch_scale=None, out_bias=None, out_sums=None, out_means=None):
    """Weight and bias gradients; with ``bn_affine`` also the BatchNorm backward sums.

    grad_out (N, Co, Ho, Wo) in the weight dtype; x (N, C, H, W); scale, shift (C,) in the
    statistics dtype. ``bn_affine = (gamma, beta)`` (C,) each (1 and 0 when BN has none) with
    ``mean``, ``invstd`` selects the SUMS variant. Returns (grad_weight (Co, C, kh, kw)
    contiguous or None, grad_bias (Co,) or None, sums) in the accumulation dtype (float32,
    float64 for float64), ``sums = (sum dz, sum dz * xhat)`` per input channel or None. With
    ``out`` (like weight) the weight gradient is written there (directly when unsplit).
    ``branch_scale`` (N,) contiguous in the accumulation dtype, or None: every result sees
    branch_scale[n] * grad_out[n]. ``out_bias`` (Co,), ``out_sums`` (sum dz, sum dz * xhat)
    and ``out_means`` (the sums / (N*H*W), x's pixels) (C,) each, any float dtype: written
    there (and returned) by the one launch that reduces the partials (kernels/reductions.py);
    ``out_means`` only with ``bn_affine``. ``config``, ``split``: these (an uncached plan).
    """
    sums = bn_affine is not None
    if out_means is not None and not sums:
        raise ValueError("out_means: the BatchNorm sums' means need bn_affine")
    if config is not None or split is not None or (
            settings.get("FUSEDRES_TRITON_AUTOTUNE") and autotune_enabled(x, weight)):
        def run_for_tuning(cfg):
            return bn_relu_conv2d_wgrad(
                grad_out, x, weight, scale, shift, stride, padding, dilation,
                want_weight=want_weight, want_bias=want_bias, bn_affine=bn_affine, mean=mean,
                invstd=invstd, out=out, config=cfg, split=split, branch_scale=branch_scale)
        out_dtypes = tuple(t.dtype for t in ((out if want_weight else None), out_bias)
                           if t is not None)
        plan = WgradPlan(grad_out, x, weight, stride, padding, dilation,
                         want_weight=want_weight, want_bias=want_bias, sums=sums,
                         has_out=out is not None, branch=branch_scale is not None,
                         has_means=out_means is not None, out_dtypes=out_dtypes,
                         out_w_strides=None if out is None else out.stride(), config=config,
                         split=split, run_for_tuning=None if config else run_for_tuning)
    else:
        plan = wgrad_plan(grad_out, x, weight, scale, stride, padding, dilation,
                          want_weight=want_weight, want_bias=want_bias, sums=sums, out=out,
                          branch_scale=branch_scale, out_bias=out_bias, out_sums=out_sums,
                          out_means=out_means)
    return plan.run(grad_out, x, weight, scale, shift, bn_affine=bn_affine, mean=mean,
                    invstd=invstd, out=out, branch_scale=branch_scale, out_bias=out_bias,
                    out_sums=out_sums, out_means=out_means)
