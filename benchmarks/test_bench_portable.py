"""Forward+backward of one pre-activation bottleneck unit at CIFAR shapes (N=128): the portable
backend against the plain-PyTorch unit, with saved-activation bytes beside the times.

Shapes: ``fusedres.models.unit_shapes.CIFAR_BOTTLENECKS``; the timed step:
``fusedres.apps.bench.units.make_step`` (what ``fusedres bench units --backends portable`` times).

Run: ``make bench`` (or ``pytest benchmarks/test_bench_portable.py --benchmark-only``).
"""

from __future__ import annotations

import pytest
import torch

from benchutil import QUICK
from fusedres.apps.bench.units import make_case, make_step, saved_bytes_of
from fusedres.models.unit_shapes import CIFAR_BOTTLENECKS, QUICK_BLOCKS

SHAPES = QUICK_BLOCKS if QUICK else CIFAR_BOTTLENECKS


@pytest.mark.parametrize("impl", ["plain", "portable"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_unit_forward_backward(benchmark, report, shape, impl):
    case = make_case(shape, impl, torch.device("cpu"))
    benchmark.pedantic(make_step(case), rounds=3 if QUICK else 10, warmup_rounds=1)
    benchmark.group = f"N={shape.n} {shape.name}"
    report(benchmark, group=benchmark.group, impl="reference" if impl == "plain" else impl,
           saved_MiB=saved_bytes_of(case) / 2**20)
