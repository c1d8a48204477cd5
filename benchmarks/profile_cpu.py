"""Where the time of one fused unit goes on the cpu backend, next to the plain unit.

Usage: ``python benchmarks/profile_cpu.py CIN COUT K STRIDE HW N [--threads T] [--rows R]``
(e.g. ``64 64 3 1 8 128``). Prints torch.profiler's self-CPU table for forward+backward of the
fused unit (``BNReLUConv2d`` on the cpu backend) and of the plain ``BatchNorm2d-ReLU-Conv2d``
with the same parameters. The ATen calls inside the C++ kernels (convolution per tile,
convolution_backward, add, sum) show up as their own rows; the rest of the fused op's self time
is our elementwise kernels (BN-ReLU, the fused mask + reductions pass, the dx pass).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fusedres


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("cin", "cout", "k", "stride", "hw", "n"):
        p.add_argument(name, type=int)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--channels-last", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    unit = fusedres.BNReLUConv2d(a.cin, a.cout, a.k, stride=a.stride, padding=a.k // 2)
    plain = nn.Sequential(unit.bn, nn.ReLU(), unit.conv)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    x = torch.randn(a.n, a.cin, a.hw, a.hw).contiguous(memory_format=fmt).requires_grad_()
    gy = torch.randn_like(plain(x))

    def step(m):
        x.grad = None
        m(x).backward(gy)

    for name, m in (("fused (cpu backend)", unit), ("plain PyTorch", plain)):
        with fusedres.use_backend("cpu"):
            for _ in range(2):
                step(m)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(m)
        print(f"== {name}: {a.cin}->{a.cout} k{a.k} s{a.stride} {a.hw}x{a.hw} N={a.n}, "
              f"{a.threads} threads, 5 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
