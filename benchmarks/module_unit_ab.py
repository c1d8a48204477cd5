"""Whether BNReLUConv2d's forward in one C++ call (the cpu route's ``module_unit``) pays: each
unit's fused training step with the one-call route and with the Python route (the op set to None
for that candidate's calls), over plain PyTorch's step in the same layout, interleaved in one
process (``benchutil.ab_row``: samples of at least 50 ms), glibc keeping freed memory. Run on a
quiet machine.

    python benchmarks/module_unit_ab.py [--set "basic C=16 s1,basic C=16 s2"] [--rounds 11]
                                        [--threads 2] [--layouts channels_last,nchw]

The figures are in benchmarks/RESULTS-history.md ("A module's forward in one call").
"""

from __future__ import annotations

import argparse

import torch

from benchutil import ab_row, with_route
from fusedres.apps.bench.units import make_case, make_step
from fusedres.memory import allocator
from fusedres.models.unit_shapes import select
from fusedres.ops import route

SIXTEEN = "basic C=16 s1,basic C=16 s1 +res,basic C=16 s2,basic C=16 s2 +res"


def _route(step, one_call: bool):
    return step if one_call else with_route("cpu", step, module_unit=None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default=SIXTEEN)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layouts", default="channels_last,nchw")
    args = p.parse_args(argv)
    if route.eager_route("cpu").module_unit is None:
        p.error("the cpu backend's extension is not built (fusedres._C)")
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s); fused step over plain in the "
          f"same layout (medians of {args.rounds} interleaved samples)")
    print(f"{'layout / shape':40s} {'plain ms':>9s} {'one call':>9s} {'Python':>7s}")
    for layout in args.layouts.split(","):
        cl = layout == "channels_last"
        for shape in select(args.set, False, args.set):
            fused = make_step(make_case(shape, "cpu channels_last" if cl else "cpu", cpu))
            steps = {"plain": make_step(make_case(shape, "channels_last" if cl else "plain",
                                                  cpu)),
                     "one call": _route(fused, True), "python": _route(fused, False)}
            print(ab_row(f"{layout} {shape.name}", steps, args.rounds, [40, 9, 9, 7]),
                  flush=True)


if __name__ == "__main__":
    main()
