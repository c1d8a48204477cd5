"""Forward+backward of one pre-activation bottleneck unit at CIFAR shapes (N=128): the portable
backend against the plain-PyTorch unit, with saved-activation bytes beside the times.

Run: ``make bench`` (or ``pytest benchmarks/test_bench_portable.py --benchmark-only``).
"""

from __future__ import annotations

import pytest
import torch

import fusedres
from benchutil import QUICK
from fusedres.memory import saved_bytes

N = 8 if QUICK else 128
# (name, in_planes, planes, stride, spatial): ResNet-164/1001 CIFAR units, incl. the stride-2 ones.
SHAPES = [
    ("stage1 64-16-64 @32", 64, 16, 1, 32),
    ("stage2 first 64-32-128 /2 @32", 64, 32, 2, 32),
    ("stage2 128-32-128 @16", 128, 32, 1, 16),
    ("stage3 first 128-64-256 /2 @16", 128, 64, 2, 16),
    ("stage3 256-64-256 @8", 256, 64, 1, 8),
]
if QUICK:
    SHAPES = SHAPES[:2]


def _unit(in_planes, planes, stride, fused):
    torch.manual_seed(0)
    return fusedres.PreActBottleneck(in_planes, planes, stride, fused=fused)


def _step(block, x):
    y = block(x)
    y.backward(torch.ones_like(y))


@pytest.mark.parametrize("impl", ["reference", "portable"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_unit_forward_backward(benchmark, report, shape, impl):
    name, cin, planes, stride, hw = shape
    block = _unit(cin, planes, stride, fused=impl != "reference")
    x = torch.randn(N, cin, hw, hw, requires_grad=True)
    with fusedres.use_backend("portable"):
        benchmark.pedantic(_step, args=(block, x), rounds=3 if QUICK else 10, warmup_rounds=1)
        nbytes = saved_bytes(block, x)
    benchmark.group = f"N={N} {name}"
    report(benchmark, group=benchmark.group, impl=impl, saved_MiB=nbytes / 2**20)
