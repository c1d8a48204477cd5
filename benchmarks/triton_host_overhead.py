"""What the host (Python, dispatch, launch wrappers) costs per fused unit on the triton backend,
measured on CPU: Triton's interpreter with every kernel replaced by a no-op, so that only the
host's work is timed (the GPU's launch latency and kernel time are not in it). Medians over
interleaved rounds; run on a quiet machine.

    python benchmarks/triton_host_overhead.py [--rounds 15] [--reps 100] [--shape 2,16,8]

Two measurements:

- a unit's training step (forward + backward through ``fusedres.BNReLUConv2d``) by the eager
  route (``fusedres.backends.triton.EagerUnit``, the kernels launched from an
  ``autograd.Function``) and by the public ops (``fusedres::bn_relu_conv2d``, its autograd
  wrapper and the ``fusedres_triton`` triton_op under it), with the number of kernel launches;
- one kernel launch from eager code, straight and through ``torch.library.wrap_triton`` (what
  the launchers did outside a triton_op before ``kernels._common.tracing``), on a compiled-mode
  ``JITFunction`` whose launch is a no-op, and how many entries that leaves in torch's kernel
  side table.

The figures are in benchmarks/report-gpu-h100/README.md ("After the run").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton and fusedres: the kernels are interpreted

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import fusedres  # noqa: E402
from benchutil import with_route  # noqa: E402

LAUNCHES = []


def _noop_launch(self, *args, **kwargs):
    LAUNCHES.append(getattr(self, "__name__", "?"))


def _median_us(fn, reps: int, rounds: int, others=()) -> float:
    def sample(f):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps * 1e6
    out = []
    for _ in range(rounds):
        out.append(sample(fn))
        for o in others:
            sample(o)
    return statistics.median(out)


def unit_step(shape: tuple[int, int, int], reps: int, rounds: int) -> None:
    n, c, hw = shape
    torch.manual_seed(0)
    m = fusedres.BNReLUConv2d(c, c, 3, padding=1)
    x = torch.randn(n, c, hw, hw, requires_grad=True)
    g = torch.randn(n, c, hw, hw)

    def step():
        m(x).backward(g)

    def forward():
        m(x)

    def public(fn):
        return with_route("triton", fn, public=True)

    variants = {"eager route, step": step, "public ops, step": public(step),
                "eager route, forward": forward, "public ops, forward": public(forward)}
    with fusedres.use_backend("triton"):
        launches = {}
        for name, fn in variants.items():
            for _ in range(10):
                fn()
            LAUNCHES.clear()
            fn()
            launches[name] = len(LAUNCHES)
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name].append(_median_us(fn, reps, 1))
    print(f"unit N,C,HW = {n},{c},{hw}, 3x3, training mode; {rounds} rounds x {reps} calls")
    print(f"{'route':24s} {'median us':>10s} {'launches':>9s}")
    for name, v in times.items():
        print(f"{name:24s} {statistics.median(v):10.1f} {launches[name]:9d}")


def launch(reps: int, rounds: int) -> None:
    import triton.language as tl
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.jit import JITFunction

    def body(X, Y, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    kernel = JITFunction(body)  # compiled mode, as on a GPU (the interpreter's is another class)
    kernel.run = lambda *args, **kwargs: None
    x, y = torch.zeros(16), torch.zeros(16)

    def straight():
        kernel[(4,)](x, y, 16, BLOCK=16, FLAG=True, num_warps=4, num_stages=1)

    def wrapped():
        torch.library.wrap_triton(kernel)[(4,)](x, y, 16, BLOCK=16, FLAG=True, num_warps=4,
                                                 num_stages=1)

    before = len(kernel_side_table.constant_args)
    s = _median_us(straight, reps, rounds, others=(wrapped,))
    w = _median_us(wrapped, reps, rounds, others=(straight,))
    grown = len(kernel_side_table.constant_args) - before
    calls = 2 * rounds * reps
    print(f"one eager launch (no-op JITFunction.run), {rounds} rounds x {reps} calls")
    print(f"  straight kernel[grid](...):          {s:8.1f} us")
    print(f"  through torch.library.wrap_triton:   {w:8.1f} us")
    print(f"  kernel side-table entries left by {calls} wrapped launches: {grown}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=100, help="calls per timed sample")
    p.add_argument("--shape", default="2,16,8", help="N,C,HW of the unit (default: tiny)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    InterpretedFunction.run = _noop_launch
    print(f"fusedres from {fusedres.__file__}; torch {torch.__version__}; "
          f"{args.threads} thread(s); kernels are no-ops (host time only)")
    unit_step(tuple(int(v) for v in args.shape.split(",")), args.reps, args.rounds)
    launch(args.reps, args.rounds)


if __name__ == "__main__":
    main()
