"""What a pass over memory right before oneDNN's convolution backward costs that call: the same
``aten::convolution_backward`` (data and weight gradients, channels_last, the sweep's N=64 16x16
3x3 unit) timed alone, after a pass that writes its own input activation (what the fused
backward's recompute of relu(bn(x)) does), and after a pass that writes another tensor of that
size. Interleaved samples, medians; run on a quiet machine.

    python benchmarks/conv_backward_cache.py [--channels 16] [--stride 1] [--threads 2]

The figures are in benchmarks/RESULTS-history.md ("Fewer small ops around the kernels").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusedres.memory import allocator


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    cl, c, s = torch.channels_last, args.channels, args.stride
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, c, 16, 16, generator=g).contiguous(memory_format=cl)
    a = torch.relu(x)
    other = torch.empty_like(a)
    w = torch.randn(c, c, 3, 3, generator=g).contiguous(memory_format=cl)
    ho = (16 - 1) // s + 1
    gy = torch.randn(64, c, ho, ho, generator=g).contiguous(memory_format=cl)

    def backward():
        torch.ops.aten.convolution_backward(gy, a, w, None, [s, s], [1, 1], [1, 1], False,
                                            [0, 0], 1, [True, True, False])

    def after_own_input():
        torch.clamp_min(x, 0, out=a)
        backward()

    def after_other():
        torch.clamp_min(x, 0, out=other)
        backward()

    def the_pass():
        torch.clamp_min(x, 0, out=other)

    variants = {"convolution_backward alone": backward,
                "after a pass writing its input": after_own_input,
                "after a pass writing another tensor": after_other,
                "the pass alone": the_pass}
    for fn in variants.values():
        for _ in range(10):
            fn()
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, fn in variants.items():
            t = time.perf_counter()
            for _ in range(args.reps):
                fn()
            times[k].append((time.perf_counter() - t) / args.reps * 1e6)
    print(f"C={c} stride {s}, N=64 16x16 channels_last, {args.threads} threads; medians of "
          f"{args.rounds} samples of {args.reps} calls, us")
    for k, v in times.items():
        print(f"  {k:38s} {statistics.median(v):8.1f}")


if __name__ == "__main__":
    main()
