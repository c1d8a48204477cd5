"""A/B of the cpu backend's BatchNorm preparation: the fused BN-ReLU-conv unit (the sweep's
basic 3x3 unit, N=64, 16x16) with the cpu route's ``prepare_batch_norm`` (one C++ call) and
without it (the Python rule), beside plain PyTorch, channels_last then NCHW, interleaved in one
process (61 rounds after 5 of warm-up, medians of single steps). Run on a quiet machine:

    python benchmarks/prepare_ab.py C STRIDE RESIDUAL(0|1) [THREADS]

The figures are in benchmarks/RESULTS-history.md ("BatchNorm preparation in one C++ call").
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchutil import with_route
from fusedres.apps.bench.units import build_module
from fusedres.memory import allocator
from fusedres.models.unit_shapes import ConvUnit


def _measure(shape: ConvUnit, fmt: torch.memory_format) -> dict[str, float]:
    """Median ms of a step: the fused unit through the new and the old route, plain PyTorch."""
    c, res = shape.cin, shape.residual
    fused = build_module(shape, True).to(memory_format=fmt)
    plain = build_module(shape, False).to(memory_format=fmt)
    x = torch.randn(64, c, 16, 16).contiguous(memory_format=fmt).requires_grad_()
    out = (64, c, shape.ho, shape.ho)
    r = torch.randn(out).contiguous(memory_format=fmt).requires_grad_() if res else None
    gy = torch.randn(out).contiguous(memory_format=fmt)

    def step(m):
        y = m(x, r) if res else m(x)
        y.backward(gy)

    cands = {"new": lambda: step(fused),
             "old": with_route("cpu", lambda: step(fused), prepare_batch_norm=None),
             "plain": lambda: step(plain)}
    for _ in range(5):
        for run in cands.values():
            run()
    times = {k: [] for k in cands}
    for _ in range(61):
        for k, run in cands.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str]) -> None:
    allocator.keep_freed_memory()  # as fusedres bench does
    torch.set_num_threads(int(argv[3]) if len(argv) > 3 else 2)
    c, stride, res = int(argv[0]), int(argv[1]), argv[2] == "1"
    shape = ConvUnit("ab", 64, c, c, 16, 3, stride, res)
    for fmt in (torch.channels_last, torch.contiguous_format):
        ms = _measure(shape, fmt)
        layout = "cl" if fmt == torch.channels_last else "nchw"
        print(f"C={c} s{stride} res={res} {layout}: "
              + " ".join(f"{k} {v:.3f}" for k, v in ms.items())
              + f" | new/plain {ms['new'] / ms['plain']:.3f}"
              f" old/plain {ms['old'] / ms['plain']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
