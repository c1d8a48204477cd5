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
from .launches import compile_launch
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


def _spec(m: int, n: int, k: int, cfg: tuple):
    """(signature, constexprs, attrs) of the tutorial launch on row-major A (m,k), B (k,n),
    C (m,n): the JIT makes the unit strides constexprs and marks the rest divisible by 16 when
    they are."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    bm, bn, bk, gm, _, _ = cfg
    ints = {"M": m, "N": n, "K": k, "stride_am": k, "stride_ak": 1, "stride_bk": n,
            "stride_bn": 1, "stride_cm": n, "stride_cn": 1}
    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    consts = {}
    for i, (name, v) in enumerate(ints.items(), start=3):
        ty, spec = native_specialize_impl(BaseBackend, v, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            consts[name] = spec
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk), ("GROUP_M", gm)):
        sig[name] = "constexpr"
        consts[name] = v
    return sig, consts, attrs


def predict_gemm(case: Measured, cfg: tuple) -> GemmPrediction:
    dev = device(case.device)
    sig, consts, attrs = _spec(case.m, case.n, case.k, cfg)
    bm, bn, bk, _, nw, ns = cfg
    comp = compile_launch(matmul_kernel, sig, consts, attrs, dev.arch, nw, ns)
    k = sass.analyse(comp.name, sass.parse(sass.disassemble(comp.cubin))[comp.name])
    ctas = -(-case.m // bm) * -(-case.n // bn)
    dram = 2 * (case.m * case.k + case.k * case.n + case.m * case.n)
    launch = model.Launch(f"matmul {case.m}x{case.n}x{case.k}", k,
                          model.Resources(comp.registers, comp.shared, nw), ctas,
                          model.Trips(-(-case.k // bk)), dram,
                          flops=2 * case.m * case.n * case.k)
    return GemmPrediction(case, cfg, model.predict(launch, dev), comp.registers, comp.shared,
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
