"""The CPU backend's elementwise kernels timed alone (csrc/cpu/bn_relu.cpp, batch_stats.cpp):
the batch statistics, the BN-ReLU, the backward's first pass (ReLU mask and BatchNorm sums,
with and without writing dz) and its second (the data gradient), each against ATen's
``clamp_min`` over the same tensor (one read, one write: the memory floor of a pass). The
kernels are C++ functions of ``fusedres._C`` with no op of their own, so this script compiles a
small extension that calls them (``torch.utils.cpp_extension.load_inline``, ~30 s the first
time). Medians of 15 samples of 20 calls on the same tensors, microseconds.

    python benchmarks/cpu_kernels.py [--threads 2] [--layout channels_last|nchw]
        [--shapes 64x16x16x16,64x64x8x8]

The figures are in benchmarks/RESULTS-history.md ("NHWC kernels with their sums in registers").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import fusedres

SHAPES = "64x16x16x16,64x32x16x16,64x16x32x32,64x64x8x8,64x24x16x16,64x48x8x8,64x256x8x8"

_CSRC_CPU = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
# The kernels' declarations are csrc/cpu/kernels.h's own (the source checkout's): the functions
# that forward to the CPU capability fusedres._C chose at load (csrc/cpu/dispatch.cpp).
_SOURCE = r"""
#include <torch/extension.h>
#include "kernels.h"
using fusedres::cpu::Layout;
static Layout layout(const at::Tensor& x) {
  return x.is_contiguous() ? Layout::NCHW : Layout::NHWC;
}
std::tuple<at::Tensor, at::Tensor> stats(at::Tensor x) {
  return fusedres::cpu::batch_stats_kernel(x, layout(x));
}
void bn_relu(at::Tensor x, at::Tensor s, at::Tensor t, at::Tensor a) {
  fusedres::cpu::bn_relu_kernel(x, s, t, a, layout(x), layout(a));
}
void reduce(at::Tensor da, at::Tensor x, at::Tensor s, at::Tensor t, at::Tensor m, at::Tensor o,
            at::Tensor sums, std::optional<at::Tensor> dz) {
  fusedres::cpu::bn_relu_backward_reduce_kernel(da, x, s, t, m, o, sums, dz ? &*dz : nullptr,
                                                layout(x), layout(da), false);
}
void apply(at::Tensor dz, at::Tensor x, at::Tensor m, at::Tensor k1, at::Tensor k2,
           at::Tensor k3, at::Tensor gx) {
  fusedres::cpu::bn_backward_apply_kernel(dz, x, m, k1, k2, k3, gx, layout(x), nullptr);
}
"""


def _extension():
    so = fusedres._C.__file__
    # One name per fusedres._C file: torch's cache rebuilds a name whose flags changed.
    tag = zlib.crc32(os.path.realpath(so).encode())
    return load_inline(f"fusedres_cpu_kernels_bench_{tag}", [_SOURCE],
                       functions=["stats", "bn_relu", "reduce", "apply"],
                       extra_ldflags=[so, f"-Wl,-rpath,{os.path.dirname(so)}"],
                       extra_include_paths=[str(_CSRC_CPU)], extra_cflags=["-O2"])


def _median_us(fn, calls: int = 20, samples: int = 15) -> float:
    for _ in range(calls):
        fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layout", choices=("channels_last", "nchw"), default="channels_last")
    p.add_argument("--shapes", default=SHAPES, help="comma-separated NxCxHxW")
    args = p.parse_args(argv)
    if not fusedres.ops._extension.LOADED:
        raise SystemExit(f"fusedres._C is not built: {fusedres.ops._extension.LOAD_ERROR}")
    torch.set_num_threads(args.threads)
    kb = _extension()
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    cols = ("statistics", "BN-ReLU", "pass 1", "pass 1 + dz", "pass 2", "clamp_min")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layout}, float32; "
          "us a call (median)")
    print(f"{'shape':>14s} {'MiB':>5s} " + " ".join(f"{c:>11s}" for c in cols))
    for spec in args.shapes.split(","):
        n, c, h, w = (int(v) for v in spec.lower().split("x"))
        x = torch.randn(n, c, h, w).contiguous(memory_format=fmt)
        row = _row(kb, x)
        print(f"{spec:>14s} {x.numel() * 4 / 2**20:5.1f} "
              + " ".join(f"{v:11.1f}" for v in row), flush=True)


def kernel_calls(kb, x: torch.Tensor) -> dict:
    """One call of each kernel on tensor x (and ATen's clamp_min, the memory floor), by the
    column names of main's table."""
    c = x.shape[1]
    da, a, dz, gx = (torch.randn_like(x) for _ in range(4))
    s, t, m, o, k = (torch.randn(c) for _ in range(5))
    sums = torch.zeros(torch.get_num_threads(), 2, c, dtype=torch.float64)
    return {"statistics": lambda: kb.stats(x),
            "BN-ReLU": lambda: kb.bn_relu(x, s, t, a),
            "pass 1": lambda: kb.reduce(da, x, s, t, m, o, sums, None),
            "pass 1 + dz": lambda: kb.reduce(da, x, s, t, m, o, sums, dz),
            "pass 2": lambda: kb.apply(dz, x, m, k, s, t, gx),
            "clamp_min": lambda: torch.clamp_min(x, 0, out=a)}


def _row(kb, x: torch.Tensor) -> list[float]:
    """The six timings of one tensor (cols of main), us."""
    return [_median_us(fn) for fn in kernel_calls(kb, x).values()]

if __name__ == "__main__":
    main()
