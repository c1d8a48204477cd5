"""One side of the -march=native question (setup.py's FUSEDRES_CPU_NATIVE): the fusedres._C
loaded now, timed on the CPU backend's elementwise kernels (benchmarks/cpu_kernels.py's columns,
two shapes) and on whole fused training steps of two CIFAR units (fusedres.apps.bench.units, cpu
backend, channels_last). Prints one JSON line; benchmarks/cpu_native_ab.sh runs it against a
portable and a native build, alternating, and writes the table.

    python benchmarks/cpu_native_ab.py --label native=0 [--threads 2] [--samples 15]
    python benchmarks/cpu_native_ab.py --table build/native-ab/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from cpu_kernels import _extension, _row

import fusedres
from fusedres.apps.bench.units import make_case, make_step
from fusedres.models.unit_shapes import select

KERNEL_SHAPES = ("64x16x32x32", "64x64x8x8")
KERNEL_COLS = ("statistics", "BN-ReLU", "pass 1", "pass 1 + dz", "pass 2")
UNITS = ("c20 s1 16-16 @32", "c164 s1 64-16-64 @32")


def _median_ms(fn, samples: int) -> float:
    fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def table(path: str) -> str:
    """The markdown table of a runs file: per figure, the lower median of each build's rounds,
    and native's over portable's."""
    best: dict[tuple[str, str], dict[str, float]] = {}
    for line in open(path):
        run = json.loads(line)
        figures = {(f"{spec} {col}", "us"): v for spec, row in run["us"].items()
                   for col, v in row.items()}
        figures.update({(f"step {name}", "ms"): v for name, v in run["ms"].items()})
        for key, v in figures.items():
            side = best.setdefault(key, {})
            side[run["label"]] = min(v, side.get(run["label"], float("inf")))
    lines = ["| figure | unit | portable | native | native / portable |",
             "|---|---|---:|---:|---:|"]
    for (name, unit), side in best.items():
        p, n = side["native=0"], side["native=1"]
        lines.append(f"| {name} | {unit} | {p:,.1f} | {n:,.1f} | {n / p:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", metavar="RUNS_JSONL", help="print the table of a runs file")
    p.add_argument("--label")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--samples", type=int, default=15)
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return
    if not args.label:
        p.error("--label is required unless --table is given")
    if not fusedres.ops._extension.LOADED:
        raise SystemExit(f"fusedres._C is not built: {fusedres.ops._extension.LOAD_ERROR}")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    kb = _extension()
    out = {"label": args.label, "us": {}, "ms": {}}
    for spec in KERNEL_SHAPES:
        n, c, h, w = (int(v) for v in spec.split("x"))
        x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
        out["us"][spec] = dict(zip(KERNEL_COLS, _row(kb, x)))
    for unit in select(",".join(UNITS), False, ""):
        step = make_step(make_case(unit, "cpu channels_last", torch.device("cpu")))
        out["ms"][unit.name] = _median_ms(step, args.samples)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
