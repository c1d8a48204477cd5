"""The time model of one kernel launch, from its SASS counts, its launch and a device.

Per launch (a CTA = one program of the grid):

* occupancy: CTAs resident per SM = min over threads, registers, shared memory and the block
  limit (devices.py cites them);
* per CTA: warp instructions = num_warps x (the main loop's per-iteration count x its trips +
  the enclosing loop's own body x its trips + the rest of the kernel once), tensor-core
  multiply-adds likewise (HMMA per warp, HGMMA per warpgroup), shared-memory bytes likewise;
* per SM and wave of ``b`` resident CTAs: issue cycles = ceil(b x num_warps / 4) x warp
  instructions per warp (each scheduler issues one warp instruction a clock; a CTA's warps are
  spread over the four), tensor cycles = b x multiply-adds / the per-SM rate, shared cycles =
  b x bytes / 128 B per clock; the wave takes the largest of the three, plus ``FILL_CYCLES``
  (the pipeline's first loads and the epilogue's last stores, one memory round trip each,
  not hidden behind other CTAs' work when every CTA of the wave starts together);
* waves: full waves of (SMs x b) CTAs, then a partial wave with ceil(left / SMs) CTAs per
  SM: the tail-wave (grid quantisation) factor is CTAs / (waves x SMs x b);
* compute time = the waves' cycles / clock / ``TENSOR_SUSTAINED`` on tensor-bound waves
  (the fraction of the spec-sheet clock x rate a sustained GEMM reaches: fitted on the
  calibration set's cuBLAS figures, see calibrate.py);
* DRAM time = bytes / (peak bandwidth x ``DRAM_EFFICIENCY``);
* modeled time = max(compute, DRAM) + ``LAUNCH_S``.

Constants (global, not per case):

* ``DRAM_EFFICIENCY`` = 0.9: streaming kernels reach ~90% of the HBM spec bandwidth (e.g. the
  ~1.8-1.9 TB/s copy bandwidth reported for the 2.0 TB/s A100 80GB; ~3.0 TB/s on the
  3.35 TB/s H100 SXM).
* ``LAUNCH_S`` = 2 us: the gap between back-to-back dependent kernels on one stream (launch
  latency + grid drain), the order measured for CUDA launches on A100/H100.
* ``FILL_CYCLES`` = 1000: one DRAM round trip (~500-600 ns at 1.4-1.8 GHz) before a CTA's
  first MMA and after its last.
* ``TENSOR_SUSTAINED``: per device, fitted (calibrate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .devices import A100, H100, Device
from .published import sustained_fraction
from .sass import Counts, KernelSass

DRAM_EFFICIENCY = 0.9
LAUNCH_S = 2e-6
FILL_CYCLES = 1000
# Fraction of (spec clock x tensor rate) a sustained GEMM reaches: the best cuBLAS figure of
# the calibration set over the spec peak (calibrate.py, fitted once; see GPU_MODEL.md).
TENSOR_SUSTAINED = {d.arch: sustained_fraction(key, d.tensor_peak_flops() / 1e12)
                    for key, d in (("a100", A100), ("h100", H100))}


@dataclass
class Resources:
    registers: int
    shared: int          # bytes per CTA (dynamic + static)
    num_warps: int


def blocks_per_sm(res: Resources, dev: Device) -> tuple[int, str]:
    """(CTAs resident per SM, the binding limit)."""
    threads = res.num_warps * 32
    regs_per_warp = math.ceil(max(res.registers, 1) * 32 / 256) * 256
    limits = {
        "threads": dev.max_threads_sm // threads,
        "registers": dev.regs_per_sm // (regs_per_warp * res.num_warps),
        "blocks": dev.max_blocks_sm,
    }
    smem = math.ceil(res.shared / 128) * 128 + 1024
    limits["shared"] = dev.smem_per_sm // smem
    name = min(limits, key=limits.get)
    return limits[name], name


@dataclass
class Trips:
    """Trip counts per CTA: the main loop runs ``inner`` times per iteration of its enclosing
    loop, which runs ``outer`` times (1 when there is none)."""

    inner: float
    outer: float = 1.0


@dataclass
class Launch:
    """One kernel launch to model: its SASS, resources, grid size, trips and DRAM bytes."""

    label: str
    sass: KernelSass
    res: Resources
    ctas: int
    trips: Trips
    dram_bytes: float
    flops: float = 0.0           # useful FLOPs (for % of peak), 0: from the MMA counts


@dataclass
class Prediction:
    label: str
    device: str
    blocks_sm: int
    occupancy_limit: str
    waves: int
    tail_factor: float
    warp_instrs_cta: float
    mma_fma_cta: dict
    issue_s: float
    tensor_s: float
    shared_s: float
    dram_s: float
    fill_s: float
    time_s: float
    bound: str
    flops: float
    pct_tensor_peak: float
    extra: dict = field(default_factory=dict)


def cta_totals(k: KernelSass, trips: Trips, num_warps: int) -> tuple[float, dict, float]:
    """(warp instructions per warp, tensor multiply-adds by kind per CTA, shared bytes per
    CTA) of one CTA."""
    parts: list[tuple[Counts, float]] = [(k.rest, 1.0)]
    if k.main is not None:
        parts.append((k.per_iter, trips.inner * trips.outer))
        parts.append((k.outer_own, trips.outer))
    instrs = sum(c.total * n for c, n in parts)
    fma: dict[str, float] = {}
    for c, n in parts:
        for kind, v in c.mma_warp.items():
            fma[kind] = fma.get(kind, 0) + v * n * num_warps
        for kind, v in c.mma_warpgroup.items():
            fma[kind] = fma.get(kind, 0) + v * n * max(1, num_warps // 4)
    shared = sum((c.shared_load + c.shared_store) * n for c, n in parts) * 32 * num_warps
    return instrs, fma, shared


def predict(launch: Launch, dev: Device) -> Prediction:
    nw = launch.res.num_warps
    b, limit = blocks_per_sm(launch.res, dev)
    if b < 1:
        raise ValueError(f"{launch.label}: does not fit on an SM of {dev.name} ({limit})")
    instrs, fma, shared = cta_totals(launch.sass, launch.trips, nw)
    tensor_cycles_cta = sum(v / dev.tensor_fma_clk_sm[kind] for kind, v in fma.items())
    sustained = TENSOR_SUSTAINED.get(dev.arch, 1.0)

    def wave(per_sm: int) -> tuple[float, float, float]:
        issue = math.ceil(per_sm * nw / dev.schedulers) * instrs / dev.issue_per_clk
        tensor = per_sm * tensor_cycles_cta / sustained
        smem = per_sm * shared / dev.smem_bytes_clk
        return issue, tensor, smem

    full, left = divmod(launch.ctas, dev.sms * b)
    waves = full + (1 if left else 0)
    per_wave = [wave(b)] * full + ([wave(math.ceil(left / dev.sms))] if left else [])
    issue_c = sum(w[0] for w in per_wave)
    tensor_c = sum(w[1] for w in per_wave)
    smem_c = sum(w[2] for w in per_wave)
    compute_c = sum(max(w) for w in per_wave) + FILL_CYCLES * waves
    compute_s = compute_c / dev.clock_hz
    dram_s = launch.dram_bytes / (dev.dram_bytes_s * DRAM_EFFICIENCY)
    bounds = {"issue": issue_c / dev.clock_hz, "tensor": tensor_c / dev.clock_hz,
              "shared": smem_c / dev.clock_hz, "dram": dram_s}
    bound = max(bounds, key=bounds.get)
    time_s = max(compute_s, dram_s) + LAUNCH_S
    flops = launch.flops or 2 * sum(fma.values()) * launch.ctas
    kind = max(fma, key=fma.get) if fma else "fp16"
    peak = dev.tensor_peak_flops(kind)
    return Prediction(
        launch.label, dev.name, b, limit, waves, launch.ctas / (waves * dev.sms * b), instrs,
        fma, bounds["issue"], bounds["tensor"], bounds["shared"], dram_s,
        FILL_CYCLES * waves / dev.clock_hz, time_s, bound, flops,
        100 * flops / time_s / peak if fma else 0.0)
