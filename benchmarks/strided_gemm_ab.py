"""Whether a strided 1x1 projection shortcut beside conv1 should run as GEMMs: each unit's
fused training step with the cpu backend's rule (``FUSEDRES_CPU_GEMM_STRIDED`` unset: the
strided GEMM route of csrc/cpu/bn_relu_conv2d.cpp where it applies) and with the route off
(``=0``: oneDNN's strided convolution), each over plain PyTorch's step in the same layout,
interleaved in one process (``fusedres.apps.bench.measure.time_interleaved``, samples of at least
50 ms, glibc keeping freed memory, as ``fusedres bench`` runs).

    python benchmarks/strided_gemm_ab.py [--set cifar,resnet50] [--rounds 9] [--threads 2]
                                         [--clock wall|thread] [--models 20,56 --batch 128]
                                         [--layout channels_last|nchw]

The default set is the four units of the bottleneck set that have such a shortcut (ResNet-50's
three strided first units, stride on the 3x3; ResNet-20's 16-32 /2 basic unit).

``--models``: whole training steps of those zoo models instead (``fusedres bench step``'s
trainers, fused and plain, in ``--layout``). ``--clock thread`` (1 thread only) times the step's
own CPU time, for a machine that is not quiet. Units without a strided 1x1 beside another
convolution run the same code either way: their two fused columns differ by the run's noise
alone. The figures are in benchmarks/RESULTS-history.md
("Strided 1x1 shortcuts as GEMMs").
"""

from __future__ import annotations

import argparse
import time

import torch

from benchutil import ab_row
from fusedres.apps.bench.measure import with_env
from fusedres.apps.bench.step import build_variant, model_name
from fusedres.apps.bench.units import make_case, make_step
from fusedres.memory import allocator
from fusedres.models.unit_shapes import select

VAR = "FUSEDRES_CPU_GEMM_STRIDED"
AFFECTED = ("r50 s2-first 256-128-512 /2 @56,r50 s3-first 512-256-1024 /2 @28,"
            "r50 s4-first 1024-512-2048 /2 @14,c20 s2-first 16-32 /2 @32")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default=AFFECTED)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--models", default=None, help="comma-separated zoo depths, e.g. 20,56")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--layout", choices=("channels_last", "nchw"), default="channels_last")
    args = p.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread: needs --threads 1 (other threads' work is not counted)")
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, "
          f"{args.layout}; fused step over plain {args.layout} (medians of {args.rounds} "
          "interleaved samples)")
    print(f"{'shape':36s} {'plain ms':>9s} {'rule':>7s} {'oneDNN':>7s}")
    if args.models:
        cases = {}
        for m in args.models.split(","):
            name = model_name(m)
            cases[f"{name} b{args.batch}"] = tuple(
                build_variant(name, v, args.batch, cpu, layout=args.layout).step
                for v in ("fused", "plain"))
    else:
        cl = args.layout == "channels_last"
        cases = {shape.name: (make_step(make_case(shape, "cpu channels_last" if cl else "cpu",
                                                  cpu)),
                              make_step(make_case(shape, "channels_last" if cl else "plain",
                                                  cpu)))
                 for shape in select(args.set, False, args.set)}
    for name, (fused, plain) in cases.items():
        steps = {"plain": plain, "rule": with_env(fused, VAR, None),
                 "onednn": with_env(fused, VAR, "0")}
        print(ab_row(name, steps, args.rounds, [36, 9, 7, 7], clock), flush=True)


if __name__ == "__main__":
    main()
