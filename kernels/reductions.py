"""The small kernels between the big ones: they finish what the GEMM and statistics kernels
leave as per-program partial results, and make the per-channel BatchNorm vectors, so a training
step runs no PyTorch op on the host between its kernels.

* ``stats_combine_kernel``: Chan's parallel merge of per-row partial (mean, M2) of a (rows, C)
  pair into the per-channel mean and biased variance, in float64 (batch_stats' splits and the
  forward's genstats epilogue rows). Row r holds min(ROW_ELEMS, M - r * ROW_ELEMS) elements:
  the counts are computed in the kernel.
* ``bn_prepare_kernel``: ``nn.BatchNorm2d``'s preparation of a step after batch_stats'
  partials (or from given statistics, or the running ones in eval): the merge above, the
  running-statistics update and ``invstd = rsqrt(var + eps)`` in one launch, where
  fusedres.functional's PyTorch ops are ~10 (kernels/batch_stats.py's ``prepare_batch_norm``).
* ``scale_shift_kernel``: the fused BatchNorm's affine ``scale = gamma * invstd``,
  ``shift = beta - mean * scale`` (gamma 1, beta 0 where BatchNorm has none).
* ``partials_reduce_kernel``: the weight-gradient pass's partials summed over its splits: the
  weight gradient (into the caller's tensor, any strides), the bias gradient, the BatchNorm
  backward sums (sum dz, sum dz * xhat) and their means over the M pixels (what the
  data-gradient pass reads). One launch; its programs are split between the three parts.

Each is one launch over a few vectors or a (split, K) matrix: DRAM-bound, a few microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelConfig, Launch, cdiv, dummy, interp_bf16, launcher, plan_cache
from ._tl import cast

STATS_COMBINE_CONFIG = KernelConfig.of(BLOCK_R=16, BLOCK_C=64, num_warps=4, num_stages=1)
SCALE_SHIFT_CONFIG = KernelConfig.of(BLOCK_C=256, num_warps=4, num_stages=1)
REDUCE_CONFIG = KernelConfig.of(BLOCK_K=1024, BLOCK_R=16, BLOCK_C=64, num_warps=4, num_stages=1)


def stats_combine_configs_for(dtype) -> list[KernelConfig]:
    return [STATS_COMBINE_CONFIG]


def prepare_configs_for(dtype) -> list[KernelConfig]:
    """bn_prepare_kernel's: none for float64 (its scalars are float32: float64 statistics stay
    with fusedres.functional's PyTorch ops)."""
    return [] if dtype in ("fp64", torch.float64) else [STATS_COMBINE_CONFIG]


def scale_shift_configs_for(dtype) -> list[KernelConfig]:
    return [SCALE_SHIFT_CONFIG]


def reduce_configs_for(dtype) -> list[KernelConfig]:
    return [REDUCE_CONFIG]


@triton.jit
def chan_merge(mean_p_ptr, m2_p_ptr, c, c_ok, rows, C, M, ROW_ELEMS,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(mean, biased var) in float64 of the channels ``c`` from the (rows, C) partial mean and
    M2: mean = sum_r n_r mean_r / M, then var = sum_r (M2_r + n_r (mean_r - mean)^2) / M (two
    passes over the rows). The partials are read past L1 (``.cg``): batch_stats_kernel's last
    program of a channel block reads rows other SMs wrote in the same launch, and a line of
    them (a neighbouring channel block's) may already sit in this SM's L1."""
    # (M may arrive as a constexpr 1: through a tensor so that .to applies either way)
    total = (tl.zeros((), dtype=tl.int64) + M).to(tl.float64)
    # 1 / M without a float64 division, which ptxas makes a subroutine call: in a GEMM
    # kernel's epilogue (bn_relu_conv2d's genstats merge) a call anywhere costs registers in
    # the main loop (spills). A float32 reciprocal refined twice by Newton's method: relative
    # error 2^-22 -> 2^-44 -> below float64's rounding; the products below round once.
    inv_total = (1.0 / total.to(tl.float32)).to(tl.float64)
    inv_total = inv_total * (2.0 - total * inv_total)
    inv_total = inv_total * (2.0 - total * inv_total)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float64)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        cnt = tl.minimum(M - r.to(tl.int64) * ROW_ELEMS, ROW_ELEMS)
        cnt = tl.where(r_ok, tl.maximum(cnt, 0), 0).to(tl.float64)
        mask = r_ok[:, None] & c_ok[None, :]
        mu = tl.load(mean_p_ptr + r[:, None] * C + c[None, :], mask=mask, other=0.0,
                     cache_modifier=".cg")
        acc += tl.sum(cnt[:, None] * mu.to(tl.float64), axis=0)
    gmean = acc * inv_total
    acc2 = tl.zeros((BLOCK_C,), dtype=tl.float64)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        cnt = tl.minimum(M - r.to(tl.int64) * ROW_ELEMS, ROW_ELEMS)
        cnt = tl.where(r_ok, tl.maximum(cnt, 0), 0).to(tl.float64)
        mask = r_ok[:, None] & c_ok[None, :]
        off = r[:, None] * C + c[None, :]
        mu = tl.load(mean_p_ptr + off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float64)
        m2 = tl.load(m2_p_ptr + off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float64)
        d = mu - gmean[None, :]
        acc2 += tl.sum(tl.where(mask, m2 + cnt[:, None] * (d * d), 0.0), axis=0)
    return gmean, acc2 * inv_total


@triton.jit
def stats_combine_kernel(
    mean_p_ptr, m2_p_ptr, mean_ptr, var_ptr,
    rows, C, M, ROW_ELEMS,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (channel block): Chan's merge of the partial rows (``chan_merge``)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    mean, var = chan_merge(mean_p_ptr, m2_p_ptr, c, c_ok, rows, C, M, ROW_ELEMS, BLOCK_R,
                            BLOCK_C)
    tl.store(mean_ptr + c, mean, mask=c_ok)
    tl.store(var_ptr + c, var, mask=c_ok)


@triton.jit
def bn_prepare_kernel(
    src0_ptr, src1_ptr, mean_ptr, invstd_ptr, rm_ptr, rv_ptr, nbt_ptr,
    gamma_ptr, beta_ptr, scale_ptr, shift_ptr,
    rows, C, M, ROW_ELEMS, keep, factor, unbias, eps,
    MERGE: tl.constexpr, UPDATE: tl.constexpr, CUMULATIVE: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, AFFINE: tl.constexpr = False,
    HAS_GAMMA: tl.constexpr = False, HAS_BETA: tl.constexpr = False,
):
    """Program (channel block): nn.BatchNorm2d's preparation of a step, what
    fusedres.functional.prepare_batch_norm does with PyTorch ops, in one launch
    (:func:`bn_prepare_channels` on the program's channels). batch_stats_kernel does the same
    in its own launch (its PREPARE mode) when it computes the statistics."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    bn_prepare_channels(c, c < C, tl.program_id(0) == 0, src0_ptr, src1_ptr, mean_ptr,
                        invstd_ptr, rm_ptr, rv_ptr, nbt_ptr, gamma_ptr, beta_ptr, scale_ptr,
                        shift_ptr, rows, C, M, ROW_ELEMS, keep, factor, unbias, eps, MERGE,
                        UPDATE, CUMULATIVE, COUNT, BLOCK_R, BLOCK_C, AFFINE, HAS_GAMMA,
                        HAS_BETA)


@triton.jit
def bn_prepare_channels(
    c, ok, first, src0_ptr, src1_ptr, mean_ptr, invstd_ptr, rm_ptr, rv_ptr, nbt_ptr,
    gamma_ptr, beta_ptr, scale_ptr, shift_ptr,
    rows, C, M, ROW_ELEMS, keep, factor, unbias, eps,
    MERGE: tl.constexpr, UPDATE: tl.constexpr, CUMULATIVE: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, AFFINE: tl.constexpr,
    HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
):
    """nn.BatchNorm2d's preparation of a step for the channels ``c`` (``ok``: in range).

    MERGE: the batch mean and biased variance from batch_stats' partial rows (src0, src1 =
    partial mean, M2), merged as stats_combine_kernel, stored at ``mean_ptr``; else src0, src1
    are the statistics themselves (given by the producer, or the running statistics in eval)
    and nothing is stored at ``mean_ptr`` (read for its dtype only). Always: ``invstd = rsqrt(var
    + eps)``, in the statistics dtype (``mean_ptr``'s, float32). UPDATE: the running statistics
    move toward the batch's as functional._update_running_stats does, in its order and dtypes:
    ``running = running * keep + stat * factor``, each product and the sum rounded to the
    running statistics' dtype, the variance unbiased first (``var * unbias``, unbias = M/(M-1));
    the host's float ``keep`` = 1 - momentum and ``factor`` = momentum, or CUMULATIVE: factor =
    1 / num_batches_tracked (incremented by the host first), keep = 1 - factor, in the running
    statistics' dtype. COUNT: the caller whose ``first`` is true adds 1 to num_batches_tracked
    (no program reads it). AFFINE: also the fused BatchNorm's ``scale = gamma * invstd`` and
    ``shift = beta - mean * scale`` (gamma 1 and beta 0 without HAS_GAMMA / HAS_BETA), as
    scale_shift_kernel makes them from the stored mean and invstd: the unit's kernels read
    them, so a step needs no launch of its own for them."""
    sdt = mean_ptr.dtype.element_ty
    if MERGE:
        mean64, var64 = chan_merge(src0_ptr, src1_ptr, c, ok, rows, C, M, ROW_ELEMS, BLOCK_R,
                                    BLOCK_C)
        mean = mean64.to(sdt)
        var = var64.to(sdt)
        tl.store(mean_ptr + c, mean, mask=ok)
    else:
        mean = tl.load(src0_ptr + c, mask=ok, other=0.0).to(sdt)
        var = tl.load(src1_ptr + c, mask=ok, other=1.0).to(sdt)
    invstd = tl.math.rsqrt(var + eps)
    tl.store(invstd_ptr + c, invstd, mask=ok)
    if AFFINE:
        _affine(gamma_ptr, beta_ptr, mean, invstd.to(sdt), scale_ptr, shift_ptr, c, ok,
                HAS_GAMMA, HAS_BETA)
    if UPDATE:
        rmt = rm_ptr.dtype.element_ty
        rvt = rv_ptr.dtype.element_ty
        if CUMULATIVE:
            n = tl.load(nbt_ptr)
            f_m = (1.0 / n.to(rmt).to(tl.float32)).to(rmt).to(tl.float32)
            k_m = (1.0 - f_m).to(rmt).to(tl.float32)
            f_v = (1.0 / n.to(rvt).to(tl.float32)).to(rvt).to(tl.float32)
            k_v = (1.0 - f_v).to(rvt).to(tl.float32)
        else:
            f_m = factor
            k_m = keep
            f_v = factor
            k_v = keep
        rm = tl.load(rm_ptr + c, mask=ok, other=0.0).to(tl.float32)
        rv = tl.load(rv_ptr + c, mask=ok, other=0.0).to(tl.float32)
        unbiased = var * unbias
        new_m = ((rm * k_m).to(rmt).to(tl.float32)
                 + (mean.to(rmt).to(tl.float32) * f_m).to(rmt).to(tl.float32))
        new_v = ((rv * k_v).to(rvt).to(tl.float32)
                 + (unbiased.to(rvt).to(tl.float32) * f_v).to(rvt).to(tl.float32))
        tl.store(rm_ptr + c, new_m.to(rmt), mask=ok)
        tl.store(rv_ptr + c, new_v.to(rvt), mask=ok)
    if COUNT:
        if first:
            tl.store(nbt_ptr, tl.load(nbt_ptr) + 1)


def stats_combine(mean_p: torch.Tensor, m2_p: torch.Tensor, m: int, row_elems: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased var) per channel, in ``dtype``, of M = ``m`` elements whose per-row partial
    mean and M2 are ``mean_p``, ``m2_p`` (rows, C) contiguous (float32 or float64), row r
    holding min(row_elems, m - r * row_elems) of them (every row at least one)."""
    rows, c = mean_p.shape
    if m2_p.shape != mean_p.shape:
        raise ValueError(f"m2_p: expected the shape of mean_p {tuple(mean_p.shape)}, got "
                         f"{tuple(m2_p.shape)}")
    if rows < 1 or cdiv(m, row_elems) != rows:
        raise ValueError(f"row_elems: {rows} rows of {row_elems} elements do not hold m = {m}")
    mean = torch.empty((c,), device=mean_p.device, dtype=dtype)
    var = torch.empty((c,), device=mean_p.device, dtype=dtype)
    cfg = STATS_COMBINE_CONFIG
    launcher(stats_combine_kernel)[(cdiv(c, cfg.meta["BLOCK_C"]),)](
        mean_p, m2_p, mean, var, rows, c, m, row_elems, **cfg.launch_kwargs)
    return mean, var


def stats_combine_launch(c: int, fast: bool = True) -> Launch:
    """:func:`stats_combine`'s launch for C channels: ``go(mean_p, m2_p, mean, var, rows, C, m,
    row_elems)``."""
    cfg = STATS_COMBINE_CONFIG
    return Launch(stats_combine_kernel, (cdiv(c, cfg.meta["BLOCK_C"]),), cfg.launch_kwargs,
                  fast=fast)


@triton.jit
def scale_shift_kernel(
    gamma_ptr, beta_ptr, mean_ptr, invstd_ptr, scale_ptr, shift_ptr, C,
    HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """scale = gamma * invstd, shift = beta - mean * scale (per channel; the operations and
    their order as fusedres.ops.opdefs.scale_shift)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    invstd = tl.load(invstd_ptr + c, mask=ok, other=0.0)
    mean = tl.load(mean_ptr + c, mask=ok, other=0.0)
    _affine(gamma_ptr, beta_ptr, mean, invstd, scale_ptr, shift_ptr, c, ok, HAS_GAMMA,
            HAS_BETA)


@triton.jit
def _affine(gamma_ptr, beta_ptr, mean, invstd, scale_ptr, shift_ptr, c, ok,
            HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr):
    """scale = gamma * invstd, shift = beta - mean * scale for channels ``c`` (the operations
    and their order as fusedres.ops.opdefs.scale_shift)."""
    if HAS_GAMMA:
        scale = tl.load(gamma_ptr + c, mask=ok, other=0.0) * invstd
    else:
        scale = invstd
    if HAS_BETA:
        shift = tl.load(beta_ptr + c, mask=ok, other=0.0) - mean * scale
    else:
        shift = -mean * scale
    tl.store(scale_ptr + c, scale, mask=ok)
    tl.store(shift_ptr + c, shift, mask=ok)


def scale_shift(bn) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fusedres.ops.opdefs.scale_shift` in one launch: (scale, shift) (C,) contiguous, in the
    dtype PyTorch's promotion gives the same expression. ``bn`` has ``bn_weight``, ``bn_bias``
    (C,) or None, ``mean`` and ``invstd`` (C,)."""
    gamma, beta, mean, invstd = bn.bn_weight, bn.bn_bias, bn.mean, bn.invstd
    dtype = invstd.dtype if gamma is None else torch.promote_types(gamma.dtype, invstd.dtype)
    shift_dtype = torch.promote_types(mean.dtype, dtype)
    if beta is not None:
        shift_dtype = torch.promote_types(beta.dtype, shift_dtype)
    c = invstd.shape[0]
    scale = torch.empty((c,), device=invstd.device, dtype=dtype)
    shift = torch.empty((c,), device=invstd.device, dtype=shift_dtype)
    vecs = [t.contiguous() if t is not None else None for t in (gamma, beta, mean, invstd)]
    cfg = SCALE_SHIFT_CONFIG
    launcher(scale_shift_kernel)[(cdiv(c, cfg.meta["BLOCK_C"]),)](
        vecs[0] if gamma is not None else invstd, vecs[1] if beta is not None else invstd,
        vecs[2], vecs[3], scale, shift, c, HAS_GAMMA=gamma is not None,
        HAS_BETA=beta is not None, **cfg.launch_kwargs)
    return scale, shift


@triton.jit
def partials_reduce_kernel(
    dw_p_ptr, dw_ptr, db_p_ptr, db_ptr, s1_p_ptr, s2_p_ptr, sum1_ptr, sum2_ptr, m1_ptr, m2_ptr,
    split, K, Cin, KH, KW, sw0, sw1, sw2, sw3, Co, rows, C, M, n_dw, n_db,
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, HAS_SUMS: tl.constexpr,
    HAS_MEANS: tl.constexpr, FP64: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT_R: tl.constexpr = 1,
):
    """Programs [0, n_dw): columns of the (split, K = Co*Cin*KH*KW) weight-gradient partials,
    summed over the splits and stored at (co, ci, i, j) with the strides sw*; [n_dw, n_dw +
    n_db): the (split, Co) bias partials; the rest: channel blocks of the (rows, C) BatchNorm
    sums partials -> sum1 = sum dz, sum2 = sum dz * xhat and, with HAS_MEANS, sum / M (tiles of
    BLOCK_R rows x BLOCK_C channels: the partial rows number split x Co blocks x taps, hundreds,
    summed BLOCK_R a step). The weight and bias programs sum SPLIT_R splits a step (host-set:
    1, or up to 16 for a small weight gradient split many ways), over BLOCK_K // SPLIT_R
    columns each: more, shorter programs."""
    pid = tl.program_id(0)
    acc_t = tl.float64 if FP64 else tl.float32
    BK: tl.constexpr = BLOCK_K // SPLIT_R
    sr = tl.arange(0, SPLIT_R)
    if pid < n_dw:
        if HAS_DW:
            e = pid * BK + tl.arange(0, BK)
            ok = e < K
            acc = tl.zeros((BK,), dtype=acc_t)
            if SPLIT_R == 1:
                for s in range(0, split):
                    acc += tl.load(dw_p_ptr + s * K + e, mask=ok, other=0.0)
            else:
                for s0 in range(0, split, SPLIT_R):
                    s = s0 + sr
                    acc += tl.sum(tl.load(dw_p_ptr + s[:, None] * K + e[None, :],
                                          mask=(s < split)[:, None] & ok[None, :], other=0.0),
                                  axis=0)
            j = e % KW
            i = (e // KW) % KH
            ci = (e // (KW * KH)) % Cin
            co = e // (KW * KH * Cin)
            tl.store(dw_ptr + co * sw0 + ci * sw1 + i * sw2 + j * sw3,
                     cast(acc, dw_ptr.dtype.element_ty, INTERP_BF16), mask=ok)
    elif pid < n_dw + n_db:
        if HAS_DB:
            e = (pid - n_dw) * BK + tl.arange(0, BK)
            ok = e < Co
            acc = tl.zeros((BK,), dtype=acc_t)
            if SPLIT_R == 1:
                for s in range(0, split):
                    acc += tl.load(db_p_ptr + s * Co + e, mask=ok, other=0.0)
            else:
                for s0 in range(0, split, SPLIT_R):
                    s = s0 + sr
                    acc += tl.sum(tl.load(db_p_ptr + s[:, None] * Co + e[None, :],
                                          mask=(s < split)[:, None] & ok[None, :], other=0.0),
                                  axis=0)
            tl.store(db_ptr + e, cast(acc, db_ptr.dtype.element_ty, INTERP_BF16), mask=ok)
    else:
        if HAS_SUMS:
            c = (pid - n_dw - n_db) * BLOCK_C + tl.arange(0, BLOCK_C)
            ok = c < C
            acc1 = tl.zeros((BLOCK_C,), dtype=acc_t)
            acc2 = tl.zeros((BLOCK_C,), dtype=acc_t)
            for r0 in range(0, rows, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                mask = (r < rows)[:, None] & ok[None, :]
                off = r[:, None] * C + c[None, :]
                acc1 += tl.sum(tl.load(s1_p_ptr + off, mask=mask, other=0.0), axis=0)
                acc2 += tl.sum(tl.load(s2_p_ptr + off, mask=mask, other=0.0), axis=0)
            tl.store(sum1_ptr + c, acc1, mask=ok)
            tl.store(sum2_ptr + c, acc2, mask=ok)
            if HAS_MEANS:
                tl.store(m1_ptr + c, acc1 / M, mask=ok)
                tl.store(m2_ptr + c, acc2 / M, mask=ok)


class ReducePlan:
    """:func:`reduce_partials`'s launch for one layout of partials: ``run(dw_p, dw, db_p, db,
    s1_p, s2_p, sums, means)`` with the parts it was planned for (the others None)."""

    def __init__(self, dw_shape, dw_strides, db_shape, s_shape, has_means: bool, m: int,
                 acc: torch.dtype, out_dtypes: tuple, fast: bool = True):
        self.parts = (dw_shape, dw_strides, db_shape, s_shape, has_means, m, acc, out_dtypes,
                      fast)
        cfg = REDUCE_CONFIG
        split, k, co, cin, kh, kw, sw, n_dw = 1, 0, 0, 0, 1, 1, (0, 0, 0, 0), 0
        if dw_shape is not None:
            split, co, cin, kh, kw = dw_shape
            k = co * cin * kh * kw
            sw = dw_strides
        if db_shape is not None:
            split, co = db_shape
        # A small weight gradient (fewer than 16 column blocks: 16- and 32-channel 3x3s)
        # split many ways (the taps form's 36-44 splits) sums up to 16 splits a step, over
        # BLOCK_K / 16 columns: more, shorter programs. Larger ones keep BLOCK_K columns a
        # split a step: the (16, 64) tile's sum over its rows would run through shared
        # memory. Figures: kernels/TUNING.md, "Splits and their reduce".
        split_r = min(16, triton.next_power_of_2(split)) \
            if cdiv(max(k, co), cfg.meta["BLOCK_K"]) < 16 else 1
        bk = cfg.meta["BLOCK_K"] // split_r
        if dw_shape is not None:
            n_dw = cdiv(k, bk)
        n_db = cdiv(co, bk) if db_shape is not None else 0
        rows, c, n_c = 0, 0, 0
        if s_shape is not None:
            rows, c = s_shape
            n_c = cdiv(c, cfg.meta["BLOCK_C"])
        self.ints = (split, k, cin, kh, kw, *sw, co, rows, c, m, n_dw, n_db)
        self.launch = Launch(partials_reduce_kernel, (n_dw + n_db + n_c,), dict(
            HAS_DW=dw_shape is not None, HAS_DB=db_shape is not None,
            HAS_SUMS=s_shape is not None, HAS_MEANS=has_means, FP64=acc == torch.float64,
            INTERP_BF16=interp_bf16(*out_dtypes), SPLIT_R=split_r, **cfg.launch_kwargs),
            fast=fast)

    @classmethod
    def joined(cls, weights: ReducePlan, sums: ReducePlan) -> ReducePlan:
        """One launch doing what ``weights`` (dw and db partials) and ``sums`` (BatchNorm sums
        partials, and their means) do: the kernel's programs are split between the parts."""
        key = (weights.parts, sums.parts)
        plan = _JOINED.get(key)
        if plan is None:
            plan = _JOINED[key] = cls(*weights.parts[:3], sums.parts[3], sums.parts[4],
                                      sums.parts[5], weights.parts[6],
                                      weights.parts[7] + sums.parts[7], weights.parts[8])
        return plan

    def run(self, unused, dw_p=None, dw=None, db_p=None, db=None, s1_p=None, s2_p=None,
            sums=None, means=None) -> None:
        """``unused``: a tensor of the partials' dtype for the absent pointers."""
        sum1, sum2 = sums if sums is not None else (unused, unused)
        m1, m2 = means if means is not None else (unused, unused)
        self.launch.go(unused if dw_p is None else dw_p, unused if dw_p is None else dw,
                       unused if db_p is None else db_p, unused if db_p is None else db,
                       unused if s1_p is None else s1_p, unused if s1_p is None else s2_p,
                       sum1, sum2, m1, m2, *self.ints)


_JOINED: dict[tuple, ReducePlan] = plan_cache()  # joined plans by their parts' parts


def reduce_plan(*, dw_p=None, dw=None, db_p=None, db=None, s1_p=None, s2_p=None, means=None,
                m: int = 1) -> ReducePlan:
    """The :class:`ReducePlan` for these partials (see :func:`reduce_partials`)."""
    parts = [t for t in (dw_p, db_p, s1_p) if t is not None]
    if not parts:
        raise ValueError("reduce_partials: no partials given (dw_p, db_p, s1_p all None)")
    ref = parts[0]
    return ReducePlan(
        None if dw_p is None else tuple(dw_p.shape), None if dw_p is None else dw.stride(),
        None if db_p is None else tuple(db_p.shape),
        None if s1_p is None else tuple(s1_p.shape), means is not None, m, ref.dtype,
        tuple(t.dtype for t in (dw, db) if t is not None),
        fast=type(ref) is torch.Tensor and ref.device.type != "meta")


def reduce_partials(*, dw_p=None, dw=None, db_p=None, db=None, s1_p=None, s2_p=None,
                    sums=None, means=None, m: int = 1) -> None:
    """One launch of :func:`partials_reduce_kernel`. ``dw_p`` (split, Co, Cin, KH, KW)
    contiguous -> ``dw`` (Co, Cin, KH, KW) any strides; ``db_p`` (split, Co) -> ``db`` (Co,);
    ``s1_p``, ``s2_p`` (rows, C) -> ``sums = (sum1, sum2)`` (C,) each and, with ``means``
    (C,) each, the sums over ``m``. Partials in the accumulation dtype (float32, float64);
    destinations in any float dtype (the store rounds to nearest, under the interpreter too).
    Parts passed as None are skipped."""
    plan = reduce_plan(dw_p=dw_p, dw=dw, db_p=db_p, db=db, s1_p=s1_p, s2_p=s2_p, means=means,
                       m=m)
    ref = next(t for t in (dw_p, db_p, s1_p) if t is not None)
    plan.run(dummy(ref), dw_p, dw, db_p, db, s1_p, s2_p, sums, means)
