"""What the host does for one fused BN-ReLU-conv chain's training step, route by route, with
plain PyTorch's chain beside it: Python calls, kernel launches, top-level ops, and host time
with the kernels as no-ops.

    python benchmarks/hostcost.py [--rounds 15] [--reps 50] [--routes plain,cpu,cuda,triton]
                                  [--unit chain|block|down]

The chain is ``BNReLUConv2d(16, 16, 3, padding=1)`` on a 2x16x8x8 batch in training mode
(plain: ``nn.BatchNorm2d``, ``nn.ReLU``, ``nn.Conv2d`` called in turn), forward and backward;
``--unit block`` times a ``PreActBasicBlock(16, 16)`` instead (two chains and the identity
shortcut, the unit a deep pre-activation ResNet repeats; plain: the same block with
``fused=False``); ``--unit down`` a ``PreActBasicBlock(16, 32, stride=2)`` (the projection
shortcut and the first convolution of one BN-ReLU: the eager pair).
Every count is a count of the host's own work, the same on any machine with these versions:

- *Python calls*: function calls ``sys.setprofile`` sees while the step runs, torch's own
  included (``Module.__call__``, ``Tensor.backward``); nothing inside Triton's package is
  counted, and a kernel launch counts once (the no-op that stands for it).
- *own calls*: those of them outside torch's package and the standard library: the route's.
- *launches*: Triton kernels launched (their ``run`` replaced by a counting no-op: the
  interpreter never executes them), or CUDA kernels launched through the CPU execution layer
  (its launch counter; ``stub_launches`` skips running them while timing).
- *ATen kernels* (the GPU routes): the ATen ops with device work the step runs besides the
  route's kernels, gradient accumulation left out (:func:`inner_kernels`), which the launch
  counter does not see: on a GPU, launches too. A step's kernel launches are the two columns'
  sum.
- *top-level ops*: profiler events of ops (names with ``::``) that no other op encloses: what
  the dispatcher is asked from Python or from the autograd engine.
- *host us*: median wall time of the step with the kernels as no-ops (plain: PyTorch's CPU
  kernels run, so its figure includes its kernels' time: a ceiling of its host work).

The routes run on CPU tensors: triton under ``TRITON_INTERPRET=1``, cuda through the test
extension ``fusedres._C_cuda_on_cpu`` (``FUSEDRES_CUDA_ON_CPU=1``): the script sets both before
fusedres is imported; a process that imports this module sets them itself (tests/conftest.py
does; :func:`available` says why a route cannot run). tests/test_host_cost.py asserts the
counts; benchmarks/test_bench_host.py times the routes with pytest-benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

if __name__ == "__main__":  # set before fusedres reads them (a default; not a read)
    for _name in ("TRITON_INTERPRET", "FUSEDRES_CUDA_ON_CPU"):
        os.environ.setdefault(_name, "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fusedres  # noqa: E402

ROUTES = ("plain", "cpu", "cuda", "triton", "portable")
# The routes whose kernels are GPU kernels (on a GPU each launch, and each ATen op with device
# work inside their ops, is a kernel launch); the others' ATen ops are CPU work.
GPU_ROUTES = ("cuda", "triton")
SHAPE = (2, 16, 8, 8)  # N, C, H, W: small, so that the host's work is the step


def available(route: str) -> str | None:
    """None when ``route`` can run here, on CPU tensors with its kernels as no-ops, else why
    not."""
    if route == "plain":
        return None
    if route == "triton":
        try:
            from fusedres.kernels._common import INTERPRET
        except ImportError as exc:
            return f"triton's kernels do not import ({exc})"
        if not INTERPRET:
            return "the kernels were imported without TRITON_INTERPRET=1 (run on CPU tensors)"
    return fusedres.unavailable_reason(route, "cpu")


def make_step(route: str, unit: str = "chain"):
    """The training step of ``unit`` on ``route``: a callable, run inside :func:`using`.
    ``unit``: "chain" (one BN-ReLU-conv), "block" (``PreActBasicBlock(16, 16)``: He et al.'s
    full pre-activation unit with the identity shortcut, two chains; plain: ``fused=False``,
    PyTorch's modules in the same block) or "down" (``PreActBasicBlock(16, 32, stride=2)``: the
    projection shortcut and the first convolution of one BN-ReLU, the eager pair)."""
    torch.manual_seed(0)
    n, c, h, w = SHAPE
    x = torch.randn(n, c, h, w, requires_grad=True)
    g = torch.randn(n, c, h, w) if unit != "down" else torch.randn(n, 2 * c, h // 2, w // 2)
    if unit in ("block", "down"):
        block = fusedres.PreActBasicBlock(c, c if unit == "block" else 2 * c,
                                          stride=1 if unit == "block" else 2,
                                          fused=route != "plain")

        def step():
            block(x).backward(g)
    elif route == "plain":
        bn, relu, conv = nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False)

        def step():
            conv(relu(bn(x))).backward(g)
    else:
        unit = fusedres.BNReLUConv2d(c, c, 3, padding=1)

        def step():
            unit(x).backward(g)
    return step


class _Launches:
    """Counts the launches of the route in force; with ``stub``, its kernels do not run."""

    def __init__(self):
        self.triton = 0
        self._cuda0 = 0

    def _noop(self, *args, **kwargs):
        self.triton += 1

    @contextlib.contextmanager
    def patched(self, stub: bool):
        from triton.runtime.interpreter import InterpretedFunction

        real = InterpretedFunction.run
        layer = _cuda_layer()
        InterpretedFunction.run = lambda fn, *a, **k: self._noop()
        before = layer.stub_launches(stub) if layer is not None else None
        try:
            yield self
        finally:
            InterpretedFunction.run = real
            if layer is not None:
                layer.stub_launches(before)

    def reset(self):
        self.triton = 0
        layer = _cuda_layer()
        self._cuda0 = layer.launches() if layer is not None else 0

    def count(self) -> int:
        layer = _cuda_layer()
        cuda = layer.launches() - self._cuda0 if layer is not None else 0
        return self.triton + cuda


def _cuda_layer():
    from fusedres.ops import _extension

    if _extension.load_cuda_on_cpu() is not None:
        return None
    layer = torch.ops.fusedres_cuda_layer_test
    return layer if hasattr(layer, "launches") else None


@contextlib.contextmanager
def using(route: str, stub: bool = True):
    """The backend of ``route`` in force and the launches counted (``stub``: not run)."""
    launches = _Launches()
    backend = "reference" if route == "plain" else route
    with fusedres.use_backend(backend), launches.patched(stub):
        yield launches


def python_calls(fn) -> tuple[int, dict[str, int]]:
    """Python function calls made while ``fn()`` runs (see the module's docstring): the count
    and, per ``file:function``, where they were made."""
    import triton

    triton_dir = os.path.dirname(triton.__file__)
    here = _Launches._noop.__code__
    counts: dict[str, int] = {}
    depth = 0  # inside Triton's package

    def profile(frame, event, arg):
        nonlocal depth
        code = frame.f_code
        inside = code.co_filename.startswith(triton_dir)
        if event == "call":
            if code is here:
                counts["<launch>"] = counts.get("<launch>", 0) + 1
            elif inside:
                depth += 1
            elif depth == 0:
                key = f"{code.co_filename}:{code.co_name}"
                counts[key] = counts.get(key, 0) + 1
        elif event == "return" and inside:
            depth -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    counts.pop(f"{__file__}:step", None)  # the step closure itself
    return sum(counts.values()), counts


def own_calls(where: dict[str, int]) -> int:
    """The calls of ``where`` made outside torch's package and the standard library: what a
    route adds (fusedres's files, or anything planted), whatever torch's version."""
    import sysconfig

    skip = (os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep,
            "<")  # <frozen ...>, <string> (namedtuple constructors count: they are the route's)
    return sum(n for k, n in where.items()
               if k == "<launch>" or not k.startswith(skip) or k.startswith("<string>"))


def _events(fn, shapes: bool = False):
    """The profiler's CPU events of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as p:
        fn()
    return p.events()


def _enclosed(e, by) -> bool:
    """Whether an event enclosing ``e`` has a name for which ``by`` holds."""
    parent = e.cpu_parent
    while parent is not None and not by(parent.name):
        parent = parent.cpu_parent
    return parent is not None


def top_level_ops(fn) -> list[str]:
    """Names of the ops the step runs that no other op encloses."""
    return [e.name for e in _events(fn)
            if "::" in e.name and not _enclosed(e, lambda name: "::" in name)]


# ATen ops that launch no kernel on a GPU: allocations, views, metadata, and the conversions
# that return their input.
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "alias", "select",
    "slice", "narrow", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
    "detach", "lift_fresh", "contiguous", "to", "_to_copy_noop", "item", "_local_scalar_dense",
    "size", "stride", "numel", "is_nonzero", "result_type", "resolve_conj", "resolve_neg",
    "set_", "squeeze_", "unsqueeze_", "as_strided_"))


def inner_kernels(fn) -> list[str]:
    """The ATen ops with device work the step runs besides the route's own kernels: the leaves
    (ops enclosing no op), :data:`NO_KERNEL`, ops on tensors of no elements and the autograd
    engine's gradient accumulation (every route's, plain's too) left out. On a GPU route each
    is a kernel launch that the launch counter does not see: a C++ op's ``at::`` calls, a
    Python plan's torch calls. Counted on CPU tensors, so a count of the CPU's ATen calls: an op
    whose CPU kernel calls another op counts as its leaves (CPU's mean is a sum and a division,
    one kernel on CUDA), and one with a kernel of its own that also calls an op counts as
    that op alone."""
    out = []
    for e in _events(fn, shapes=True):
        if not e.name.startswith("aten::") or e.name in NO_KERNEL:
            continue
        if any("::" in ch.name for ch in e.cpu_children):
            continue
        if e.input_shapes and e.input_shapes[0] and 0 in e.input_shapes[0]:
            continue  # no elements: ATen launches nothing (the engine's zeros for empty grads)
        if not _enclosed(e, lambda name: "AccumulateGrad" in name):
            out.append(e.name)
    return out


def counts(route: str, warmup: int = 3, unit: str = "chain") -> dict:
    """Python calls, launches and top-level ops of one step of ``unit`` on ``route`` (after
    ``warmup``)."""
    step = make_step(route, unit)
    with using(route) as launches:
        for _ in range(warmup):
            step()
        launches.reset()
        calls, where = python_calls(step)
        n_launches = launches.count()
        ops = top_level_ops(step)
        inner = inner_kernels(step) if route in GPU_ROUTES else []
    return {"route": route, "python_calls": calls, "launches": n_launches,
            "inner_kernels": len(inner), "inner": inner,
            "top_level_ops": len(ops), "ops": ops, "where": where}


def host_us(routes, reps: int = 50, rounds: int = 15, unit: str = "chain") -> dict[str, float]:
    """Median microseconds a step, the routes interleaved round by round."""
    steps = {r: make_step(r, unit) for r in routes}
    samples: dict[str, list[float]] = {r: [] for r in routes}
    for r in routes:
        with using(r):
            for _ in range(5):
                steps[r]()
    for _ in range(rounds):
        for r in routes:
            with using(r):
                t = time.perf_counter()
                for _ in range(reps):
                    steps[r]()
                samples[r].append((time.perf_counter() - t) / reps * 1e6)
    return {r: statistics.median(v) for r, v in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--where", action="store_true", help="list where each route's calls go")
    p.add_argument("--unit", default="chain", choices=("chain", "block", "down"),
                   help="one BN-ReLU-conv chain, a pre-activation basic block (two chains), or "
                        "a downsampling one (its projection shortcut: the eager pair)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    routes = [r for r in args.routes.split(",") if available(r) is None]
    for r in args.routes.split(","):
        if r not in routes:
            print(f"# {r}: not run here ({available(r)})")
    rows = [counts(r, unit=args.unit) for r in routes]
    times = host_us(routes, args.reps, args.rounds, args.unit)
    plain = next((row for row in rows if row["route"] == "plain"), None)
    what = {"chain": "3x3 chain", "block": "PreActBasicBlock",
            "down": "PreActBasicBlock(16, 32, stride=2)"}[args.unit]
    print(f"# torch {torch.__version__}, {args.threads} thread(s); one {SHAPE} {what}, "
          f"training step; kernels as no-ops; {args.rounds} rounds x {args.reps} steps")
    print("| route | Python calls | / plain | own calls | launches | ATen kernels "
          "| top-level ops | host us | / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        r = row["route"]
        rc = row["python_calls"] / plain["python_calls"] if plain else float("nan")
        rt = times[r] / times["plain"] if plain else float("nan")
        print(f"| {r} | {row['python_calls']} | {rc:.2f} | {own_calls(row['where'])} | "
              f"{row['launches']} | "
              f"{row['inner_kernels'] if r in GPU_ROUTES else '-'} | "
              f"{row['top_level_ops']} | {times[r]:.1f} | {rt:.2f} |")
    if args.where:
        for row in rows:
            print(f"\n{row['route']}:")
            for k, v in sorted(row["where"].items(), key=lambda kv: -kv[1]):
                print(f"  {v:4d} {os.path.relpath(k) if k.startswith(os.sep) else k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
