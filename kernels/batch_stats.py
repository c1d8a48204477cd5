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

from ..ops.opdefs import stats_dtype as _stats_dtype
from ._common import (
    KernelConfig,
    Launch,
    cdiv,
    dummy,
    interpreting,
    launcher,
    named,
    plan_cache,
    sm_count,
)
from .reductions import (
    STATS_COMBINE_CONFIG,
    bn_prepare_channels,
    bn_prepare_kernel,
    stats_combine,
)

# Configs by name; each entry's comment is the rule ``pick_config`` picks it by, and why. A
# tile's own reduction (three sums over its rows across the threads, the float64 merge) is paid
# per tile: tall tiles amortise it. Figures: kernels/TUNING.md, "Batch statistics".
CONFIGS = named({
    # channels_last with >= 32 channels: 32 contiguous channels a row; 128 rows (256 spill).
    "channels_last": KernelConfig.of(BLOCK_M=128, BLOCK_C=32, num_warps=4, num_stages=1),
    # The rest (NCHW, or < 32 channels): as tall as it holds channels_last's elements a thread.
    "tall_c16": KernelConfig.of(BLOCK_M=256, BLOCK_C=16, num_warps=4, num_stages=1),
    # <= 8 channels: 8 columns, 256 rows on 8 warps.
    "few_channels": KernelConfig.of(BLOCK_M=256, BLOCK_C=8, num_warps=8, num_stages=1),
})
INTERPRET_CONFIG = KernelConfig.of(BLOCK_M=128, BLOCK_C=32, num_warps=4, num_stages=1)


@triton.jit
def batch_stats_kernel(
    x_ptr, mean_ptr, m2_ptr,
    C, HW, W, M,
    sxn, sxc, sxh, sxw,
    tiles_per_split,
    count_ptr, bmean_ptr, invstd_ptr, rm_ptr, rv_ptr, nbt_ptr, gamma_ptr, beta_ptr, scale_ptr,
    shift_ptr, keep, factor, unbias, eps,
    FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    DENSE: tl.constexpr = False, PREPARE: tl.constexpr = False, UPDATE: tl.constexpr = False,
    CUMULATIVE: tl.constexpr = False, COUNT: tl.constexpr = False, AFFINE: tl.constexpr = False,
    HAS_GAMMA: tl.constexpr = False, HAS_BETA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
):
    """Program (channel block, split): partial mean and M2 of its tiles -> row ``split``.

    PREPARE: then the last program of the channel block to finish merges the block's rows and
    does the BatchNorm's preparation for its channels (reductions.bn_prepare_channels: the
    arguments after ``tiles_per_split``, as bn_prepare_kernel takes them): the statistics and
    the preparation in one launch. Which program is last is counted in ``count_ptr`` (an int32
    a channel block, zero between launches: the last program sets it back). Ordering: every
    thread's partial stores, then a barrier of the program's threads, then the count as an
    acquire-release atomic at GPU scope (the rows this program stored are released with it; the
    last program's increment acquires every other program's), and the merge reads the rows past
    L1. The pattern of torch Inductor's grid barrier (triton_helpers.x_grid_barrier), without
    the wait: no program waits for another, so it is safe whatever the number of programs
    resident. Launches of one plan must not run concurrently (two streams): they share the
    counts."""
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
    if PREPARE:
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_c, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.store(count_ptr + pid_c, 0)
            _prepare_block(pid_c, C, mean_ptr, m2_ptr, bmean_ptr, invstd_ptr, rm_ptr, rv_ptr,
                           nbt_ptr, gamma_ptr, beta_ptr, scale_ptr, shift_ptr,
                           tl.num_programs(1), M, tiles_per_split * BLOCK_M, keep, factor,
                           unbias, eps, UPDATE, CUMULATIVE, COUNT, BLOCK_R, BLOCK_C, AFFINE,
                           HAS_GAMMA, HAS_BETA)


# Out of line: inlined, its float64 divisions (subroutine calls in SASS) made ptxas keep values
# of the statistics loop in local memory across them (16 bytes spilled, sm_90, 128 x 32 fp32).
@triton.jit(noinline=True)
def _prepare_block(pid_c, C, mean_ptr, m2_ptr, bmean_ptr, invstd_ptr, rm_ptr, rv_ptr, nbt_ptr,
                   gamma_ptr, beta_ptr, scale_ptr, shift_ptr, rows, M, ROW_ELEMS, keep, factor,
                   unbias, eps, UPDATE: tl.constexpr, CUMULATIVE: tl.constexpr,
                   COUNT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   AFFINE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr):
    """batch_stats_kernel's PREPARE tail for channel block ``pid_c``: its rows merged, the
    BatchNorm prepared (reductions.bn_prepare_channels)."""
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    bn_prepare_channels(c, c < C, pid_c == 0, mean_ptr, m2_ptr, bmean_ptr, invstd_ptr, rm_ptr,
                        rv_ptr, nbt_ptr, gamma_ptr, beta_ptr, scale_ptr, shift_ptr, rows, C, M,
                        ROW_ELEMS, keep, factor, unbias, eps, True, UPDATE, CUMULATIVE, COUNT,
                        BLOCK_R, BLOCK_C, AFFINE, HAS_GAMMA, HAS_BETA)


def configs_for(dtype) -> list[KernelConfig]:
    return list(CONFIGS.values())


def pick_config(x: torch.Tensor) -> KernelConfig:
    if interpreting():
        return INTERPRET_CONFIG
    c = x.shape[1]
    if x.is_contiguous(memory_format=torch.channels_last) and c >= 32:
        return CONFIGS["channels_last"]
    return CONFIGS["few_channels" if c <= 8 else "tall_c16"]


def pick_split(tiles: int, c_blocks: int, sms: int) -> int:
    """Programs a channel block: enough for ~4 waves on ``sms`` SMs, but no fewer than 2 tiles
    a program and no more than 128 partial rows a channel (stats_combine merges them one block
    of rows at a time), so a program's float64 merge is amortised over fewer tiles
    (kernels/TUNING.md has the figure). kernels/traffic.py counts the partials with it."""
    return max(1, min(cdiv(4 * sms, c_blocks), cdiv(tiles, 2), 128))


def _partials(x: torch.Tensor, config: KernelConfig | None = None, split: int | None = None):
    """batch_stats_kernel's launch: (partial mean, partial M2, M, elements a row)."""
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
        *(dummy(mean_p),) * 10, 0.0, 0.0, 0.0, 0.0,  # the preparation's: unused here
        FP64=sdt == torch.float64,
        DENSE=x.stride(0) == h * w * x.stride(3) and x.stride(2) == w * x.stride(3),
        # Every constexpr passed, defaults included: torch.library.wrap_triton's analysis of
        # which tensors a kernel writes needs them all (else it assumes every input written).
        PREPARE=False, UPDATE=False, CUMULATIVE=False, COUNT=False, AFFINE=False,
        HAS_GAMMA=False, HAS_BETA=False, BLOCK_R=STATS_COMBINE_CONFIG.meta["BLOCK_R"],
        **cfg.launch_kwargs,
    )
    # Split r holds min(tps * bm, m - r * tps * bm) elements (the last may be short).
    return mean_p, m2_p, m, tps * bm


def batch_stats(x: torch.Tensor, config: KernelConfig | None = None, split: int | None = None):
    """(mean, biased var) per channel of x (N, C, H, W), in the statistics dtype."""
    mean_p, m2_p, m, row_elems = _partials(x, config, split)
    return stats_combine(mean_p, m2_p, m, row_elems, _stats_dtype(x.dtype))


# Running statistics the one-launch preparation updates (its arithmetic is float32; bfloat16
# ones stay with the PyTorch ops: the interpreter, which tests this kernel here, rounds
# bfloat16 as float32).
PREPARE_RUNNING_DTYPES = (torch.float32, torch.float16)


def prepare_unsupported(x: torch.Tensor, running_mean, running_var,
                        training: bool) -> str | None:
    """Why :func:`prepare_batch_norm` cannot take this BatchNorm (an error message naming the
    argument), or None: float64 x, or running statistics it would update in place that are not
    contiguous float32 / float16 (fusedres.backends.triton.prepares routes those to the PyTorch
    ops)."""
    if _stats_dtype(x.dtype) != torch.float32:
        return f"x: the one-launch preparation takes 16- or 32-bit x, got {x.dtype}"
    if running_mean is None or not training:
        return None
    if (running_mean.dtype not in PREPARE_RUNNING_DTYPES
            or running_var.dtype not in PREPARE_RUNNING_DTYPES):
        return ("running_mean, running_var: the one-launch preparation updates float32 or "
                f"float16 statistics, got {running_mean.dtype}, {running_var.dtype}")
    if not (running_mean.is_contiguous() and running_var.is_contiguous()):
        return ("running_mean, running_var: the one-launch preparation updates contiguous "
                "statistics in place")
    return None


class PreparePlan:
    """:func:`prepare_batch_norm`'s launch for one key (:func:`prepare_plan`): with batch
    statistics to compute, batch_stats_kernel in its PREPARE mode (statistics and preparation
    in one launch; its config, split, grid and per-channel-block counts fixed), else
    bn_prepare_kernel on the given or running statistics; :meth:`run` on the tensors of a
    call. ``split``: the statistics' programs a channel block (None: the rule's; the
    interpreter's is 1, tests give more to exercise the merge)."""

    def __init__(self, x, running_mean, running_var, counted: bool, training: bool,
                 momentum, eps: float, given: bool, gamma, beta, affine: bool,
                 split: int | None = None):
        n, c, h, w = x.shape
        sdt = _stats_dtype(x.dtype)
        tracked = running_mean is not None
        self.use_batch = training or not tracked
        self.update = training and tracked
        self.cumulative = self.update and momentum is None
        count = self.update and counted and not self.cumulative
        self.merge = self.use_batch and not given
        self.c, self.sdt, self.affine = c, sdt, affine
        m = x.numel() // c
        real = type(x) is torch.Tensor and x.device.type != "meta"
        factor = 0.0 if momentum is None else float(momentum)
        self.floats = (1.0 - factor, factor, m / (m - 1) if m > 1 else 1.0, float(eps))
        self.counts = self.cumulative or count
        flags = dict(UPDATE=self.update, CUMULATIVE=self.cumulative, COUNT=count, AFFINE=affine,
                     HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None)
        if self.merge:
            cfg = pick_config(x)
            bm, bc = cfg.meta["BLOCK_M"], cfg.meta["BLOCK_C"]
            tiles, c_blocks = cdiv(m, bm), cdiv(c, bc)
            if split is None:
                split = 1 if interpreting() else pick_split(tiles, c_blocks, sm_count(x.device))
            split = max(1, min(split, tiles))
            tps = cdiv(tiles, split)
            split = cdiv(tiles, tps)  # no empty splits
            self.partial_shape = (split, c)
            # The last program of each channel block merges; zero between launches (a plan for
            # meta or fake tensors, made anew each call, launches nothing: no zeros kernel).
            self.arrivals = (torch.zeros if real else torch.empty)((c_blocks,), device=x.device,
                                                                  dtype=torch.int32)
            self.launch = Launch(batch_stats_kernel, (c_blocks, split), dict(
                FP64=sdt == torch.float64,
                DENSE=x.stride(0) == h * w * x.stride(3) and x.stride(2) == w * x.stride(3),
                PREPARE=True, BLOCK_R=STATS_COMBINE_CONFIG.meta["BLOCK_R"], **flags,
                **cfg.launch_kwargs), fast=real)
            self.ints = (c, h * w, w, m, *x.stride(), tps)
        else:
            cfg = STATS_COMBINE_CONFIG
            self.launch = Launch(bn_prepare_kernel, (cdiv(c, cfg.meta["BLOCK_C"]),), dict(
                MERGE=False, **flags, **cfg.launch_kwargs), fast=real)
            self.ints = (0, c, m, 1)

    def run(self, x, running_mean, running_var, num_batches_tracked, mean=None, var=None,
            gamma=None, beta=None):
        """(mean, invstd), and with ``affine`` (scale, shift) after them."""
        c, sdt, dev = self.c, self.sdt, x.device
        if self.cumulative:
            num_batches_tracked.add_(1)
        invstd = torch.empty((c,), device=dev, dtype=sdt)
        if self.affine:
            scale = torch.empty((c,), device=dev, dtype=sdt)
            shift = torch.empty((c,), device=dev, dtype=sdt)
        else:
            scale = shift = invstd
        update = self.update
        prepared = (running_mean if update else invstd, running_var if update else invstd,
                    num_batches_tracked if self.counts else invstd,
                    invstd if gamma is None else gamma, invstd if beta is None else beta,
                    scale, shift)
        if self.merge:
            mean = torch.empty((c,), device=dev, dtype=sdt)
            self.launch.go(x, torch.empty(self.partial_shape, device=dev, dtype=torch.float64),
                           torch.empty(self.partial_shape, device=dev, dtype=torch.float64),
                           *self.ints, self.arrivals, mean, invstd, *prepared, *self.floats)
        else:
            if not self.use_batch:  # eval: the running statistics
                mean = running_mean.detach().to(sdt)
                src0, src1 = mean.contiguous(), running_var.detach().contiguous()
            else:  # the producer's statistics, read with unit strides
                src0, src1 = mean.contiguous(), var.contiguous()
            self.launch.go(src0, src1, mean, invstd, *prepared, *self.ints, *self.floats)
        # The in-kernel writes are in-place updates: their version counters move as add_'s do
        # (torch._C's own function: autograd.graph.increment_version is a Python layer on it).
        if update:
            _increment_version((running_mean, running_var))
        if self.counts and not self.cumulative:
            _increment_version((num_batches_tracked,))
        return (mean, invstd, scale, shift) if self.affine else (mean, invstd)


_increment_version = torch._C._increment_version


_PLANS: dict[tuple, PreparePlan] = plan_cache()


def _plan_key(x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
              given: bool, gamma, beta, affine: bool) -> tuple:
    # Everything the plan and prepare_unsupported read: shapes, strides, dtypes, the device,
    # every pointer's 16-byte alignment (the JIT specialises on it), flags and scalars.
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16,
            None if running_mean is None else (running_mean.dtype, running_mean.stride(),
                                               running_mean.data_ptr() % 16),
            None if running_var is None else (running_var.dtype, running_var.stride(),
                                              running_var.data_ptr() % 16),
            None if num_batches_tracked is None else num_batches_tracked.data_ptr() % 16,
            training, momentum, eps, given,
            None if gamma is None else (gamma.dtype, gamma.data_ptr() % 16),
            None if beta is None else (beta.dtype, beta.data_ptr() % 16), affine)


def prepare_plan(x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                 given: bool, gamma=None, beta=None, affine: bool = False) -> PreparePlan:
    """The cached :class:`PreparePlan` for these arguments (checked by the caller; raises
    prepare_unsupported's error for those it cannot take)."""
    key = _plan_key(x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                    given, gamma, beta, affine)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _new_plan(key, x, running_mean, running_var, num_batches_tracked, training,
                         momentum, eps, given, gamma, beta, affine)
    return plan


def _new_plan(key, x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
              given, gamma, beta, affine) -> PreparePlan:
    reason = prepare_unsupported(x, running_mean, running_var, training)
    if reason is not None:
        raise ValueError(reason)
    plan = PreparePlan(x, running_mean, running_var, num_batches_tracked is not None, training,
                       momentum, eps, given, gamma, beta, affine)
    if type(x) is torch.Tensor and x.device.type != "meta":
        _PLANS[key] = plan
    return plan


def prepare_affine(x: torch.Tensor, gamma, beta, running_mean, running_var,
                   num_batches_tracked, training: bool, momentum: float | None, eps: float,
                   mean=None, var=None):
    """:func:`prepare_batch_norm` with ``affine``: (mean, invstd, scale, shift); the eager
    route's every BatchNorm, so with no layer between it and the plan's run."""
    given = mean is not None and (training or running_mean is None)
    key = _plan_key(x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                    given, gamma, beta, True)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _new_plan(key, x, running_mean, running_var, num_batches_tracked, training,
                         momentum, eps, given, gamma, beta, True)
    return plan.run(x, running_mean, running_var, num_batches_tracked, mean, var, gamma, beta)


def prepare_batch_norm(x: torch.Tensor, running_mean, running_var, num_batches_tracked,
                       training: bool, momentum: float | None, eps: float, mean=None, var=None,
                       gamma=None, beta=None, affine: bool = False):
    """nn.BatchNorm2d's statistics, running-statistics update and ``invstd`` for x in one
    launch (batch_stats_kernel in its PREPARE mode; reductions.bn_prepare_kernel when the batch
    statistics are given, ``mean``, ``var``: the producer's, or the running ones are used in
    eval): (mean, invstd) in the statistics dtype, float32 (x of 16 or 32 bits); with
    ``affine`` also the fused BatchNorm's (scale, shift) from ``gamma``, ``beta`` (C,) or None,
    made in the same launch. The rule of fusedres.functional.prepare_batch_norm, whose PyTorch
    ops are ~10 launches (the update, var + eps, rsqrt); the caller has checked the arguments.
    With ``mean`` given, the mean returned is that tensor. Running statistics float32 or
    float16 (``PREPARE_RUNNING_DTYPES``); float64 x or statistics stay with the PyTorch ops
    (this kernel's scalars are float32).

    ``momentum`` None (cumulative average) costs one more launch, ``num_batches_tracked.add_(1)``
    before the kernel reads it; else the kernel counts the step itself. The running statistics'
    and the counter's version counters are bumped, as their in-place PyTorch updates do."""
    given = mean is not None and (training or running_mean is None)
    plan = prepare_plan(x, running_mean, running_var, num_batches_tracked, training, momentum,
                        eps, given, gamma, beta, affine)
    return plan.run(x, running_mean, running_var, num_batches_tracked, mean, var, gamma, beta)
