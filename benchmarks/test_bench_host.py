"""The host's time for one fused BN-ReLU-conv chain's training step, and a pre-activation basic
block's, route by route, with the kernels as no-ops, against plain PyTorch's in the same run
(benchmarks/hostcost.py: what is counted and how; its Python calls and launches sit beside the
times).

Run: ``TRITON_INTERPRET=1 FUSEDRES_CUDA_ON_CPU=1 pytest benchmarks/test_bench_host.py
--benchmark-only`` (without them the triton and cuda routes are skipped, saying why). The
committed table: benchmarks/HOST.md.
"""

from __future__ import annotations

import pytest

import hostcost
from benchutil import QUICK

GROUPS = {"chain": "host: one 2x16x8x8 3x3 chain step",
          "block": "host: one 2x16x8x8 PreActBasicBlock step"}


@pytest.mark.parametrize("unit", sorted(GROUPS))
@pytest.mark.parametrize("route", hostcost.ROUTES)
def test_host_step(benchmark, report, route, unit):
    why = hostcost.available(route)
    if why is not None:
        pytest.skip(f"{route}: {why}")
    c = hostcost.counts(route, unit=unit)
    step = hostcost.make_step(route, unit)
    with hostcost.using(route):
        benchmark.pedantic(step, rounds=3 if QUICK else 30, iterations=5 if QUICK else 50,
                           warmup_rounds=2)
    benchmark.group = GROUPS[unit]
    report(benchmark, group=benchmark.group, impl="reference" if route == "plain" else route,
           python_calls=c["python_calls"], launches=c["launches"])
