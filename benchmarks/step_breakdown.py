"""Where the fused unit's training step differs in time from plain PyTorch's, per shape: the
step's median wall time of each, oneDNN's own execution time of its primitives in the same
steps (``ONEDNN_VERBOSE``'s per-call time, via ``torch.backends.mkldnn.verbose``: the
convolution forward, its data and weight gradients, the weight reorders; the same primitives on
the same shapes in both), and the rest of the step (everything outside oneDNN: BatchNorm and
ReLU work, plain's or the fused unit's kernels, and the host: Python, dispatch, autograd).
Both in the same layout, interleaved samples (``fusedres.apps.bench.measure.time_interleaved``),
glibc keeping freed memory, as ``fusedres bench`` runs; run on a quiet machine.

    python benchmarks/step_breakdown.py [--set "basic C=16 s1,basic C=96 s2"] [--threads 2]
        [--layout channels_last|nchw]

The figures are in benchmarks/RESULTS-history.md ("Where the remaining shapes lose").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

from fusedres.apps.bench.measure import time_interleaved
from fusedres.apps.bench.units import make_case, make_step
from fusedres.memory import allocator
from fusedres.models.unit_shapes import select

COLUMNS = ("conv forward", "conv dgrad", "conv wgrad", "reorders")
_KIND = {"forward_training": "conv forward", "backward_data": "conv dgrad",
         "backward_weights": "conv wgrad"}


def _wall_ms(steps: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per step: ``fusedres bench``'s interleaved rounds, a sample ``reps`` steps."""
    def repeated(step):
        def run():
            for _ in range(reps):
                step()
        return run
    times = time_interleaved({k: repeated(s) for k, s in steps.items()}, torch.device("cpu"),
                             warmup=1, reps=rounds)
    return {k: statistics.median(v) / reps * 1e3 for k, v in times.items()}


def onednn_ms(step, reps: int) -> dict[str, float]:
    """oneDNN's execution time per step by primitive kind (ms), from its verbose lines (the C
    library's stdout, captured at the file descriptor)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                for _ in range(reps):
                    step()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().splitlines()
    out = dict.fromkeys(COLUMNS, 0.0)
    for line in lines:
        f = line.split(",")
        if len(f) < 8 or f[0] != "onednn_verbose" or "exec" not in f:
            continue
        i = f.index("exec")
        kind = "reorders" if f[i + 2] == "reorder" else _KIND.get(f[i + 4])
        if kind is not None:
            out[kind] += float(f[-1]) / reps
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="basic C=16 s1,basic C=16 s1 +res,basic C=16 s2,"
                                    "basic C=16 s2 +res")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layout", choices=("channels_last", "nchw"), default="channels_last")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    cl = args.layout == "channels_last"
    impls = {"plain": "channels_last" if cl else "plain",
             "fused": "cpu channels_last" if cl else "cpu"}
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layout}; ms per step "
          f"(step: median of {args.rounds} interleaved samples of {args.reps} steps; oneDNN: "
          f"its execution time over {4 * args.reps} steps; rest = step - oneDNN)")
    cols = ["step", *COLUMNS, "rest"]
    print(f"{'shape':22s} {'':6s} " + " ".join(f"{c:>12s}" for c in cols))
    for shape in select(args.set, False, args.set):
        steps = {k: make_step(make_case(shape, impl, torch.device("cpu")))
                 for k, impl in impls.items()}
        for step in steps.values():
            for _ in range(3):
                step()
        wall = _wall_ms(steps, args.rounds, args.reps)
        rows = {}
        for k, step in steps.items():
            split = onednn_ms(step, 4 * args.reps)
            rows[k] = [wall[k], *split.values(), wall[k] - sum(split.values())]
        rows["diff"] = [f - q for f, q in zip(rows["fused"], rows["plain"])]
        for k, row in rows.items():
            sign = "+" if k == "diff" else ""
            print(f"{shape.name:22s} {k:6s} " + " ".join(f"{v:{sign}12.3f}" for v in row))
        print(f"{shape.name:22s} fused / plain {wall['fused'] / wall['plain']:.3f}")


if __name__ == "__main__":
    main()
