"""Which layout the cpu backend's convolutions of an NCHW unit should run in: each shape's fused
training step with the tiles convolved as the rule picks them (``conv_layout`` in
csrc/cpu/bn_relu_conv2d.cpp), forced to x's layout (``FUSEDRES_CPU_CONV_NHWC=0``: oneDNN's NCHW
convolution, its reorders inside) and forced to NHWC (``=1``: the tiles transposed around
oneDNN's NHWC convolution), each over plain PyTorch's NCHW step, all four interleaved in one
run (``fusedres.apps.bench.measure.time_interleaved``, samples of at least 50 ms), glibc keeping
freed memory, as ``fusedres bench`` runs. The variable is read at every call, so one process
times all three. Run on a quiet machine.

    python benchmarks/conv_layout_ab.py [--set basic-sweep] [--rounds 9] [--threads 2]

The figures are in benchmarks/RESULTS-history.md ("NCHW units: the convolution's layout by
stride and width").
"""

from __future__ import annotations

import argparse

import torch

from benchutil import ab_row
from fusedres.apps.bench.measure import with_env
from fusedres.apps.bench.units import make_case, make_step
from fusedres.memory import allocator
from fusedres.models.unit_shapes import select

VAR = "FUSEDRES_CPU_CONV_NHWC"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="basic-sweep")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s), NCHW; fused step over plain "
          f"NCHW (medians of {args.rounds} interleaved samples)")
    print(f"{'shape':36s} {'plain ms':>9s} {'rule':>7s} {'x layout':>9s} {'NHWC':>7s}")
    for shape in select(args.set, False, args.set):
        fused = make_step(make_case(shape, "cpu", cpu))
        steps = {"plain": make_step(make_case(shape, "plain", cpu)),
                 "rule": with_env(fused, VAR, None), "x": with_env(fused, VAR, "0"),
                 "nhwc": with_env(fused, VAR, "1")}
        print(ab_row(shape.name, steps, args.rounds, [36, 9, 7, 9, 7]), flush=True)


if __name__ == "__main__":
    main()
