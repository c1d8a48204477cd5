"""Per-channel batch statistics (mean, biased variance) of x (N, C, H, W).

Numerically stable: every tile of BLOCK_M values is reduced exactly in two passes over registers
(tile mean, then the sum of squared deviations from it), tiles are merged with Chan's parallel
formula inside a program, and the SPLIT programs of a channel block are merged in float64 by
kernels/reductions.py's stats_combine_kernel. So x = 1000 + noise in float32 keeps its variance,
and N*H*W in the millions is split over enough programs to fill the GPU.

Layout: any strides (channels_last and contiguous NCHW alike); the tile is (pixels, channels) so
the contiguous dimension of either layout is read coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..opdefs import stats_dtype as _stats_dtype
from ._common import KernelConfig, cdiv, interpreting, launcher, sm_count
from .reductions import stats_combine

# Roles by index: channels_last with >= 32 channels, the rest, <= 8 channels. A tile's own
# reduction (three sums over its rows across the threads, the float64 merge) is paid per tile:
# tall tiles amortise it. sm_90 SASS, ImageNet 64@56 batch 256 fp16 (fusedres.perfmodel):
# 64x32 issue-bound at 86 us modeled (34 us of DRAM), 128x32 46 us; 256x32 DRAM-bound at 36 us
# but spills 8 bytes on sm_80 (kernels/aot.py).
CONFIGS = [
    KernelConfig.of(BLOCK_M=128, BLOCK_C=32, num_warps=4, num_stages=1),
    KernelConfig.of(BLOCK_M=128, BLOCK_C=16, num_warps=4, num_stages=1),
    KernelConfig.of(BLOCK_M=256, BLOCK_C=8, num_warps=8, num_stages=1),
]
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=128, BLOCK_C=32, num_warps=4, num_stages=1)


@triton.jit
def batch_stats_kernel(
    x_ptr, mean_ptr, m2_ptr,
    C, HW, W, M,
    sxn, sxc, sxh, sxw,
    tiles_per_split,
    FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    DENSE: tl.constexpr = False,
):
    """Program (channel block, split): partial mean and M2 of its tiles -> row ``split``."""
    pid_c = tl.program_id(0)
    split = tl.program_id(1)
    acc_t = tl.float64 if FP64 else tl.float32
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    # The running merge is per channel, not per element: float64 costs nothing there.
    mean = tl.zeros((BLOCK_C,), dtype=tl.float64)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float64)
    n_run = tl.zeros((), dtype=tl.float64)
    t0 = split * tiles_per_split
    for t in range(t0, t0 + tiles_per_split):
        m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        if DENSE:  # pixels one stride apart (channels_last): no (n, h, w) split per row
            off = m * sxw
        else:
            n = m // HW
            hw = m % HW
            off = n * sxn + (hw // W) * sxh + (hw % W) * sxw
        mask = m_ok[:, None] & c_ok[None, :]
        v = tl.load(x_ptr + off[:, None] + c[None, :] * sxc, mask=mask, other=0.0).to(acc_t)
        # The tile's rows in range (none for the last split's tiles past the end).
        cnt = tl.maximum(tl.minimum(M - t * BLOCK_M, BLOCK_M), 0).to(acc_t)
        cnt_safe = tl.maximum(cnt, 1.0)
        # Exact two-pass over the tile, with the first pass's rounding corrected by the second.
        t_mean0 = tl.sum(v, axis=0) / cnt_safe
        d = tl.where(mask, v - t_mean0[None, :], 0.0)
        sd = tl.sum(d, axis=0)
        t_m2 = (tl.sum(d * d, axis=0) - sd * sd / cnt_safe).to(tl.float64)
        # An inf in the tile makes sd NaN: keep the plain mean (inf) there, as torch does.
        t_mean = tl.where(t_mean0 - t_mean0 == 0,
                          t_mean0.to(tl.float64) + (sd / cnt_safe).to(tl.float64),
                          t_mean0.to(tl.float64))
        cnt64 = cnt.to(tl.float64)
        n_new = n_run + cnt64
        w = cnt64 / tl.maximum(n_new, 1.0)
        delta = t_mean - mean
        finite = (mean - mean == 0) & (t_mean - t_mean == 0)
        mean = tl.where(finite, mean + delta * w, mean * (1.0 - w) + t_mean * w)
        m2 = m2 + t_m2 + delta * delta * (n_run * w)
        n_run = n_new
    tl.store(mean_ptr + split * C + c, mean, mask=c_ok)
    tl.store(m2_ptr + split * C + c, m2, mask=c_ok)


def configs_for(dtype) -> list[KernelConfig]:
    return CONFIGS


def pick_config(x: torch.Tensor) -> KernelConfig:
    if interpreting():
        return INTERPRET_CONFIG
    c = x.shape[1]
    if x.is_contiguous(memory_format=torch.channels_last) and c >= 32:
        return CONFIGS[0]
    return CONFIGS[2] if c <= 8 else CONFIGS[1]


def pick_split(tiles: int, c_blocks: int, sms: int) -> int:
    """Programs a channel block: enough for ~4 waves on ``sms`` SMs, but no fewer than 2 tiles
    a program and no more than 128 partial rows a channel (stats_combine merges them one block
    of rows at a time): CIFAR's 64-channel 8x8 unit, batch 128, 8 -> 32 programs a channel
    block, H100 6.2 -> 3.6 us modeled (the program's float64 merge amortised over fewer
    tiles). kernels/traffic.py counts the partials with it."""
    return max(1, min(cdiv(4 * sms, c_blocks), cdiv(tiles, 2), 128))


def batch_stats(x: torch.Tensor, config: KernelConfig | None = None, split: int | None = None):
    """(mean, biased var) per channel of x (N, C, H, W), in the statistics dtype."""
    n, c, h, w = x.shape
    sdt = _stats_dtype(x.dtype)
    m = n * h * w
    cfg = config or pick_config(x)
    bm, bc = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_C"]
    tiles = cdiv(m, bm)
    c_blocks = cdiv(c, bc)
    if split is None:
        split = 1 if interpreting() else pick_split(tiles, c_blocks, sm_count(x.device))
    split = max(1, min(split, tiles))
    tps = cdiv(tiles, split)
    split = cdiv(tiles, tps)  # no empty splits
    mean_p = torch.empty((split, c), device=x.device, dtype=torch.float64)
    m2_p = torch.empty((split, c), device=x.device, dtype=torch.float64)
    launcher(batch_stats_kernel)[(c_blocks, split)](
        x, mean_p, m2_p, c, h * w, w, m, *x.stride(), tps,
        FP64=sdt == torch.float64,
        DENSE=x.stride(0) == h * w * x.stride(3) and x.stride(2) == w * x.stride(3),
        **cfg.launch_kwargs(),
    )
    # Split r holds min(tps * bm, m - r * tps * bm) elements (the last may be short).
    return stats_combine(mean_p, m2_p, m, tps * bm, sdt)
