"""A/B of one of the blocks' routes on the cpu backend: the fused unit with the route on and
off, beside plain PyTorch in the same layout, interleaved in one process, medians.

Usage: ``python benchmarks/route_ab.py ROUTE [--threads T] [--shapes "name;name"] [--reps R]``
where ROUTE is a boolean property of :class:`fusedres.modules.ResidualBlock` that picks a route
(``shortcut_from_conv1``, ``stacked_shortcut``, ``paired_shortcut``); "off" forces it False
for that candidate's calls only. Shapes: names from ``fusedres.models.unit_shapes`` (default: the
CIFAR and ResNet-50 units where the route is taken). Prints one row per shape and layout:
ms on, off, plain, and the ratios. Run on a quiet machine (glibc keeps freed memory, as
``fusedres bench`` does).
"""

from __future__ import annotations

import argparse
import time

import torch

import fusedres.memory.allocator
from fusedres.apps.bench.units import build_module, make_case, make_step
from fusedres.models import unit_shapes
from fusedres.modules import ResidualBlock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("route")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default=None, help="names separated by ';'")
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if not isinstance(getattr(ResidualBlock, a.route, None), property):
        p.error(f"route: expected a property of ResidualBlock, got {a.route!r}")
    torch.set_num_threads(a.threads)
    fusedres.memory.allocator.keep_freed_memory()
    blocks = (unit_shapes.CIFAR_BOTTLENECKS + unit_shapes.R50_BOTTLENECKS
              + unit_shapes.CIFAR_BASIC_BLOCKS)
    named = {s.name: s for s in blocks}
    if a.shapes:
        unknown = [n for n in a.shapes.split(";") if n not in named]
        if unknown:
            p.error(f"--shapes: unknown {unknown}; expected names from {list(named)}")
        shapes = [named[n] for n in a.shapes.split(";")]
    else:
        shapes = [s for s in blocks if getattr(build_module(s, True), a.route)]
    on = getattr(ResidualBlock, a.route)
    off = property(lambda self: False)
    cpu = torch.device("cpu")

    def with_route(step, prop):
        def run():
            setattr(ResidualBlock, a.route, prop)
            try:
                step()
            finally:
                setattr(ResidualBlock, a.route, on)
        return run

    print(f"{a.route}, {a.threads} threads, median of {a.reps} (interleaved)")
    for shape in shapes:
        for impl, plain in (("cpu channels_last", "channels_last"), ("cpu", "plain")):
            steps = {"on": with_route(make_step(make_case(shape, impl, cpu)), on),
                     "off": with_route(make_step(make_case(shape, impl, cpu)), off),
                     "plain": make_step(make_case(shape, plain, cpu))}
            times = {k: [] for k in steps}
            for f in steps.values():
                f(), f()
            for _ in range(a.reps):
                for k, f in steps.items():
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
            ms = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
            layout = "channels_last" if "channels_last" in impl else "nchw"
            print(f"{shape.name:34s} {layout:13s} on {ms['on']:8.2f}  off {ms['off']:8.2f}  "
                  f"plain {ms['plain']:8.2f}  on/off {ms['on'] / ms['off']:.3f}  "
                  f"on/plain {ms['on'] / ms['plain']:.3f}  off/plain "
                  f"{ms['off'] / ms['plain']:.3f}", flush=True)


if __name__ == "__main__":
    main()
