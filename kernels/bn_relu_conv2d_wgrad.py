"""Weight (and bias) gradient of the fused unit.

dW[co, c, i, j] = sum over (n, oh, ow) of dy[n, co, oh, ow] * a[n, c, oh*sh - ph + i*dh, ...]
with ``a = relu(scale * x + shift)`` recomputed in the operand load (zero outside the image).
Implicit GEMM per tap: rows are output channels, columns input channels, the reduction runs
over the output pixels (K = N*Ho*Wo). Small Co*C*kh*kw gives few tiles, so the reduction is
split over ``SPLIT`` programs writing float32 (float64) partials, summed on the host. The conv
bias gradient (sum of dy) is reduced by the programs of the first column block and tap, from
the dy tiles they load anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    KernelConfig,
    acc_is_fp64,
    allow_tf32,
    cdiv,
    dtype_name,
    interp_bf16,
    interpreting,
    launcher,
    sm_count,
)
from ._tl import mma
from .bn_relu_conv2d import _bn_relu_tile

CONFIGS = [
    KernelConfig.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    KernelConfig.of(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3),
    KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
]
FP64_CONFIGS = [
    KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=3),
]
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)


@triton.jit
def wgrad_kernel(
    dy_ptr, x_ptr, scale_ptr, shift_ptr, dw_ptr, db_ptr,
    C, H, W, Co, Ho, Wo, M, KH, KW,
    SH, SW, PH, PW, DH, DW,
    sdn, sdc, sdh, sdw,
    sxn, sxc, sxh, sxw,
    iters_per_split,
    HAS_DB: tl.constexpr, FP64: tl.constexpr, TF32: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
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
    kk = tl.arange(0, BLOCK_K)
    hw = Ho * Wo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
    db = tl.zeros((BLOCK_M,), dtype=acc_t)
    k_begin = split * iters_per_split * BLOCK_K
    for k0 in range(k_begin, k_begin + iters_per_split * BLOCK_K, BLOCK_K):
        o = k0 + kk
        o_ok = o < M
        n64 = o // hw
        rem = o % hw
        oh = rem // Wo
        ow = rem % Wo
        dy_off = n64 * sdn + oh * sdh + ow * sdw
        g = tl.load(dy_ptr + co[:, None] * sdc + dy_off[None, :],
                    mask=co_ok[:, None] & o_ok[None, :], other=0.0)
        if HAS_DB:
            if pid_nt == 0:
                db += tl.sum(g.to(acc_t), axis=1)
        ih = oh * SH - PH + i * DH
        iw = ow * SW - PW + j * DW
        row_ok = o_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = _bn_relu_tile(x_ptr, n64 * sxn + ih * sxh + iw * sxw, row_ok, c, C, sxc,
                          scale_ptr, shift_ptr, g.dtype, INTERP_BF16)
        acc = mma(acc, g, a, TF32, INTERP_BF16)
    c_ok = c < C
    # Partials: (SPLIT, Co, C, KH, KW) contiguous.
    off = split * (Co * C * taps) + co[:, None] * (C * taps) + c[None, :] * taps + t
    tl.store(dw_ptr + off, acc, mask=co_ok[:, None] & c_ok[None, :])
    if HAS_DB:
        if pid_nt == 0:
            tl.store(db_ptr + split * Co + co, db, mask=co_ok)


def configs_for(dtype) -> list[KernelConfig]:
    return FP64_CONFIGS if dtype_name(dtype) == "fp64" else CONFIGS


def pick_config(co: int, c: int, dtype: torch.dtype) -> KernelConfig:
    if interpreting():
        return INTERPRET_CONFIG
    if dtype == torch.float64:
        return FP64_CONFIGS[0]
    if co >= 128 and c >= 64:
        return CONFIGS[1]
    if co <= 32 or c <= 32:
        return CONFIGS[2]
    return CONFIGS[0]


def bn_relu_conv2d_wgrad(grad_out, x, weight_shape, scale, shift, stride, padding, dilation, *,
                         want_bias: bool, config: KernelConfig | None = None,
                         split: int | None = None):
    """(grad_weight (Co, C, kh, kw) contiguous, grad_bias (Co,) or None) in the accumulation
    dtype (float32, float64 for float64). grad_out (N, Co, Ho, Wo) already in the weight dtype;
    x (N, C, H, W); scale, shift (C,) in the statistics dtype."""
    n, c, h, w = x.shape
    co, _, kh, kw = weight_shape
    ho, wo = grad_out.shape[2], grad_out.shape[3]
    m = n * ho * wo
    cfg = config or pick_config(co, c, grad_out.dtype)
    bm, bn, bk = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_N"], cfg.meta["BLOCK_K"]
    tiles = cdiv(co, bm) * cdiv(c, bn) * kh * kw
    k_iters = cdiv(m, bk)
    if split is None:
        # Split the reduction until ~2 waves of programs, keeping >= 4 K-steps per program.
        split = 1 if interpreting() else min(cdiv(2 * sm_count(x.device), tiles),
                                             max(1, k_iters // 4))
    split = max(1, min(split, k_iters))
    ips = cdiv(k_iters, split)
    split = cdiv(k_iters, ips)
    fp64 = acc_is_fp64(grad_out.dtype)
    acc = torch.float64 if fp64 else torch.float32
    dw = torch.empty((split, co, c, kh, kw), device=x.device, dtype=acc)
    db = torch.empty((split, co), device=x.device, dtype=acc) if want_bias else dw
    grid = (cdiv(co, bm), cdiv(c, bn) * kh * kw, split)
    launcher(wgrad_kernel)[grid](
        grad_out, x, scale, shift, dw, db,
        c, h, w, co, ho, wo, m, kh, kw, *stride, *padding, *dilation,
        *grad_out.stride(), *x.stride(), ips,
        HAS_DB=want_bias, FP64=fp64, TF32=allow_tf32(grad_out.dtype),
        INTERP_BF16=interp_bf16(grad_out.dtype), **cfg.launch_kwargs(),
    )
    return dw.sum(0), (db.sum(0) if want_bias else None)
