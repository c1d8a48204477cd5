"""benchmarks/NATIVE.md's figures for the fusedres._C importable now: the cpu backend's
elementwise kernels (benchmarks/cpu_kernels.py's columns, two shapes; microseconds a call) and
whole fused training steps of two CIFAR units (fusedres.apps.bench.units, cpu backend,
channels_last; milliseconds), each a pytest-benchmark median. benchmarks/cpu_dispatch_ab.sh runs
this file against each build, alternating, and writes the table from the JSON files:

    pytest benchmarks/cpu_dispatch_ab.py --benchmark-only --benchmark-json=OUT.json
    python benchmarks/cpu_dispatch_ab.py --table DIR     # the table of DIR/<side>-<round>.json

Not a test_ file: the CI benchmark smoke run does not collect it (it needs two builds).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import pytest
import torch

import fusedres

# One torch thread, timed in process CPU time (the .sh passes --benchmark-timer): on a machine
# other jobs load, a two-thread kernel waits for whichever thread is descheduled, and wall-clock
# medians came out 10-100x the quiet figures; CPU time counts only this process's work.
THREADS = 1
KERNEL_SHAPES = ("64x16x32x32", "64x64x8x8")
KERNEL_COLS = ("statistics", "BN-ReLU", "pass 1", "pass 1 + dz", "pass 2")
UNITS = ("c20 s1 16-16 @32", "c164 s1 64-16-64 @32")
ROUNDS = 15


def _capability() -> str:
    # A build from before run-time dispatch has no cpu_capability: its kernels are the
    # compiler target's (-march).
    get = getattr(fusedres, "cpu_capability", None)
    return get() if get else "compile-time"


@pytest.fixture(scope="module")
def kernels():
    from cpu_kernels import _extension

    torch.set_num_threads(THREADS)
    return _extension()


@pytest.mark.parametrize("col", KERNEL_COLS)
@pytest.mark.parametrize("spec", KERNEL_SHAPES)
def test_kernel(benchmark, kernels, spec, col):
    from cpu_kernels import kernel_calls

    torch.manual_seed(0)
    n, c, h, w = (int(v) for v in spec.split("x"))
    x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
    benchmark.extra_info["cpu_capability"] = _capability()
    benchmark.pedantic(kernel_calls(kernels, x)[col], rounds=ROUNDS, iterations=20,
                       warmup_rounds=1)


@pytest.mark.parametrize("name", UNITS)
def test_step(benchmark, name):
    from fusedres.apps.bench.units import make_case, make_step
    from fusedres.models.unit_shapes import select

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    (unit,) = select(name, False, "")
    step = make_step(make_case(unit, "cpu channels_last", torch.device("cpu")))
    benchmark.extra_info["cpu_capability"] = _capability()
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=2)


def _figure(test_name: str) -> tuple[str, str, float]:
    """(figure, unit, scale from seconds) of a test's name."""
    params = re.search(r"\[(.*)\]$", test_name).group(1)
    if test_name.startswith("test_kernel"):
        spec, col = params.split("-", 1)
        return f"{spec} {col}", "us", 1e6
    return f"step {params}", "ms", 1e3


def table(directory: str, pairs: list[tuple[str, str]]) -> str:
    """Per figure, each side's lowest median over its rounds (DIR/<side>-<round>.json), and each
    pair's ratio (second side over first)."""
    best: dict[tuple[str, str], dict[str, float]] = {}
    capability: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        side = os.path.basename(path).rsplit("-", 1)[0]
        for bench in json.load(open(path))["benchmarks"]:
            name, unit, scale = _figure(bench["name"])
            cell = best.setdefault((name, unit), {})
            cell[side] = min(bench["stats"]["median"] * scale, cell.get(side, float("inf")))
            capability[side] = bench["extra_info"].get("cpu_capability", "?")
    sides = [s for pair in pairs for s in pair]
    head = "| figure | unit | " + " | ".join(f"{s} ({capability.get(s, '?')})" for s in sides)
    head += " | " + " | ".join(f"{b} / {a}" for a, b in pairs) + " |"
    lines = [head, "|---|---|" + "---:|" * (len(sides) + len(pairs))]
    for (name, unit), cell in best.items():
        vals = " | ".join(f"{cell[s]:,.1f}" for s in sides)
        ratios = " | ".join(f"{cell[b] / cell[a]:.3f}" for a, b in pairs)
        lines.append(f"| {name} | {unit} | {vals} | {ratios} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", metavar="DIR", required=True)
    p.add_argument("--pair", nargs=2, action="append", metavar=("REF", "SIDE"), required=True,
                   help="a column pair: SIDE's figures over REF's")
    args = p.parse_args(argv)
    print(table(args.table, [tuple(x) for x in args.pair]))


if __name__ == "__main__":
    sys.exit(main())
