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


_3672 = "triton-lang/triton issue 3672 (2024-04, tutorial 03)"
_6523 = "triton-lang/triton issue 6523 (comment 2025-11-25, tutorial 03)"
_7085 = "triton-lang/triton issue 7085 (2025-06, tutorial 03, Triton 3.2 column)"
_2339 = "triton-lang/triton issue 2339 (2023-09, tutorial 10: wgmma + TMA store)"

MEASURED = [
    Measured("h100", 2048, 2048, 2048, 194.9, 511.3, _3672, "main of 2024-04"),
    Measured("h100", 2560, 2560, 2560, 375.4, 533.4, _3672, "main of 2024-04"),
    Measured("h100", 2816, 2816, 2816, 500.7, 616.5, _3672, "main of 2024-04"),
    Measured("h100", 3072, 3072, 3072, 524.7, 584.7, _3672, "main of 2024-04"),
    Measured("h100", 2048, 2048, 2048, 295.1, 515.2, _2339, "main of 2023-09"),
    Measured("h100", 2048, 4096, 4096, 346.3, 613.7, _2339, "main of 2023-09"),
    Measured("h100", 2048, 8192, 8192, 369.8, 721.6, _2339, "main of 2023-09"),
    Measured("a100", 1024, 1024, 1024, 97.5, 99.9, _7085, "3.2"),
    Measured("a100", 1536, 1536, 1536, 52.8, 141.6, _6523, "3.5.1"),
    Measured("a100", 2048, 2048, 2048, 101.1, 143.4, _6523, "3.5.1"),
    Measured("a100", 2432, 2432, 2432, 168.2, 176.7, _6523, "3.5.1"),
    Measured("a100", 2944, 2944, 2944, 170.1, 176.1, _6523, "3.5.1"),
]


def sustained_fraction(arch_device: str, peak_tflops: float) -> float:
    """The best cuBLAS figure of the set on ``arch_device`` over its dense fp16 peak: the one
    constant per device the model takes from measurement (model.TENSOR_SUSTAINED)."""
    best = max(m.cublas_tflops for m in MEASURED if m.device == arch_device)
    return best / peak_tflops
