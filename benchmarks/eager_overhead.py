"""What the Python layers cost per fused unit on the cpu backend: a small unit's forward+backward
through the module (the eager route), through the public ops (the custom-op layers), and the C++
kernels called bare (the floor); beside them plain PyTorch's unit on the same parameters
(``nn.BatchNorm2d``, ReLU, ``nn.Conv2d``), whose host work the fused route's is held against.
Medians over interleaved rounds; run on a quiet machine.

    python benchmarks/eager_overhead.py [--rounds 30] [--threads 1]

The figures are in benchmarks/RESULTS-history.md ("eager CPU overhead").
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

import fusedres
from benchutil import with_route


def _unit(n: int, c: int, hw: int):
    torch.manual_seed(0)
    m = fusedres.BNReLUConv2d(c, c, 3, padding=1)
    x = torch.randn(n, c, hw, hw, requires_grad=True)
    return m, x


def _step_module(m, x):
    y = m(x)
    y.backward(torch.ones_like(y))


def _kernels_only(m, x):
    """The same work as one training unit, by the C++ ops directly: statistics, forward,
    backward (no autograd, no Python layers beyond the calls)."""
    cpu = torch.ops.fusedres_cpu
    mean, var = cpu.batch_stats(x.detach())
    invstd = torch.rsqrt(var + 1e-5)
    args = [x.detach(), m.conv.weight.detach(), None, m.bn.weight.detach(), m.bn.bias.detach(),
            mean, invstd, None, [1, 1], [1, 1], [1, 1]]
    if len(cpu.bn_relu_conv2d.default._schema.arguments) >= 12:
        args.append(True)
    y = cpu.bn_relu_conv2d(*args)
    cpu.bn_relu_conv2d_backward(torch.ones_like(y), x.detach(), m.conv.weight.detach(),
                                m.bn.weight.detach(), m.bn.bias.detach(), mean, invstd,
                                [1, 1], [1, 1], [1, 1], True, [True] * 5)


def _timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=50, help="calls per timed sample")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shape", default="2,8,8", help="N,C,HW of the unit (default: tiny)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fusedres.set_backend("cpu")
    n, c, hw = (int(v) for v in args.shape.split(","))
    m, x = _unit(n, c, hw)
    public = with_route("cpu", lambda: _step_module(m, x), public=True)

    plain = torch.nn.Sequential(m.bn, torch.nn.ReLU(), m.conv)  # the same parameters
    variants = {"module (eager route)": lambda: _step_module(m, x),
                "module (public ops)": public,
                "kernels only": lambda: _kernels_only(m, x),
                "plain PyTorch": lambda: _step_module(plain, x)}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        _timed(fn, 5)
    for _ in range(args.rounds):
        for name, fn in variants.items():
            samples[name].append(_timed(fn, args.reps))
    floor = statistics.median(samples["kernels only"])
    src = inspect.getsourcefile(fusedres)
    print(f"fusedres from {src}; torch {torch.__version__}; {args.threads} thread(s); "
          f"unit N,C,HW = {n},{c},{hw}; {args.rounds} rounds x {args.reps} calls")
    print(f"{'route':<24}{'median us':>12}{'IQR us':>10}{'above kernels us':>18}")
    for name, xs in samples.items():
        q = statistics.quantiles(xs, n=4)
        med = statistics.median(xs)
        print(f"{name:<24}{med * 1e6:>12.1f}{(q[2] - q[0]) * 1e6:>10.1f}"
              f"{(med - floor) * 1e6:>18.1f}")


if __name__ == "__main__":
    main()
