"""Published measured GEMM throughput (TFLOP/s) the model is checked against: Triton's matmul
tutorial (03-matrix-multiplication, fp16 inputs, fp32 accumulation, fp16 output) and cuBLAS,
as printed by the tutorial's benchmark in public bug reports. Data, not code: each entry says
where it was published and which Triton ran it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    device: str       # "a100" | "h100" (devices.py)
    m: int
    n: int
    k: int
    triton_tflops: float
    cublas_tflops: float
    source: str
    triton_version: str


MEASURED = [
    Measured("h100", 2048, 2048, 2048, 195.0, 511.0,
             "triton-lang/triton issue 3672 (2024)", "3.0-era main (2024)"),
    Measured("h100", 3072, 3072, 3072, 525.0, 585.0,
             "triton-lang/triton issue 3672 (2024)", "3.0-era main (2024)"),
    Measured("a100", 2048, 2048, 2048, 101.1, 143.4,
             "triton-lang/triton issue 6523 (comment, 2025-11-25)", "3.5.1"),
    Measured("a100", 2944, 2944, 2944, 170.1, 176.1,
             "triton-lang/triton issue 6523 (comment, 2025-11-25)", "3.5.1"),
    Measured("h100", 2048, 8192, 8192, 370.0, 722.0,
             "triton-lang/triton issue 2339 (2023, wgmma)", "2.1-era main (2023)"),
]


def sustained_fraction(arch_device: str, peak_tflops: float) -> float:
    """The best cuBLAS figure of the set on ``arch_device`` over its dense fp16 peak: the one
    constant per device the model takes from measurement (model.TENSOR_SUSTAINED)."""
    best = max(m.cublas_tflops for m in MEASURED if m.device == arch_device)
    return best / peak_tflops
