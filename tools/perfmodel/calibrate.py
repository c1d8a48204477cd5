"""Calibration: the model's prediction for Triton's matmul tutorial kernel (gemm.py, compiled
here with the tutorial's fp16 configs, specialised as the JIT specialises them) against the
published measured TFLOP/s (published.py).

For each published size the model predicts every config and keeps the fastest (what the
tutorial's autotuner keeps). The error is (modeled - measured) / measured. One constant per
device comes from this set (model.TENSOR_SUSTAINED, from the cuBLAS column); the Triton column is
not fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import model, sass
from .devices import device
from .gemm import TUTORIAL_CONFIGS, matmul_kernel
from .published import MEASURED, Measured


@dataclass
class GemmPrediction:
    case: Measured
    config: tuple
    prediction: model.Prediction
    registers: int
    shared: int
    per_iter: sass.Counts

    @property
    def tflops(self) -> float:
        c = self.case
        return 2 * c.m * c.n * c.k / self.prediction.time_s / 1e12

    @property
    def error(self) -> float:
        return (self.tflops - self.case.triton_tflops) / self.case.triton_tflops


def gemm_launch(m: int, n: int, k: int, cfg: tuple, arch: int):
    """The tutorial launch on row-major fp16 A (m, k), B (k, n), C (m, n), specialised by
    tools/jit_spec.py as Triton's JIT would (the unit strides become constexprs, the rest
    are marked divisible by 16 when they are)."""
    import torch

    from ..jit_spec import DevicePointer, specialise

    bm, bn, bk, gm, nw, ns = cfg
    half = torch.float16
    a = DevicePointer(half, 0x7F00_0000_0000, 2 * m * k)
    b = DevicePointer(half, 0x7F04_0000_0000, 2 * k * n)
    c = DevicePointer(half, 0x7F08_0000_0000, 2 * m * n)
    grid = (-(-m // bm) * -(-n // bn),)
    return specialise(matmul_kernel, grid, (a, b, c, m, n, k, k, 1, n, 1, n, 1),
                      dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw,
                           num_stages=ns), arch)


def predict_gemm(case: Measured, cfg: tuple) -> GemmPrediction:
    from ..jit_spec import compile_launch

    dev = device(case.device)
    bm, bn, bk, _, nw, _ = cfg
    launch = gemm_launch(case.m, case.n, case.k, cfg, dev.arch)
    comp = compile_launch(launch)
    k = sass.analyse(comp.name, sass.parse(sass.disassemble(comp.cubin))[comp.name])
    dram = 2 * (case.m * case.k + case.k * case.n + case.m * case.n)
    ml = model.Launch(f"matmul {case.m}x{case.n}x{case.k}", k,
                      model.Resources(comp.registers, comp.shared, nw), launch.programs,
                      model.Trips(-(-case.k // bk)), dram, flops=2 * case.m * case.n * case.k)
    return GemmPrediction(case, cfg, model.predict(ml, dev), comp.registers, comp.shared,
                          k.per_iter)


def calibrate(cases=MEASURED, configs=TUTORIAL_CONFIGS) -> list[tuple[GemmPrediction, list]]:
    """Per case: the fastest modeled config, and every config's prediction."""
    out = []
    for case in cases:
        preds = []
        for cfg in configs:
            try:
                preds.append(predict_gemm(case, cfg))
            except ValueError:  # does not fit on this device's SM
                continue
        out.append((max(preds, key=lambda p: p.tflops), preds))
    return out
