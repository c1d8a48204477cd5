"""``python -m fusedres.selftest``: the GPU kernels (Triton, CUDA C++) against the reference,
with a table.

What a user with a GPU runs first. For each case (shape x dtype x layout) it runs one fused
unit, forward and backward, on each GPU backend that can run (``triton``, ``cuda``; or those
named by ``--backends``) and on ``reference`` (plain BatchNorm2d -> ReLU -> Conv2d: cuDNN on a
GPU), and prints pass/fail, each backend's worst relative error over the output, every
gradient and the output's batch statistics as the forward's genstats epilogue hands them to the
next BatchNorm, the milliseconds of a training step (forward + backward) of each backend and of
the reference side by side, the first backend's step time and saved-activation bytes against
the reference's (plus peak CUDA memory on a GPU).

Without a GPU it sets ``TRITON_INTERPRET=1`` (unless set) and runs small shapes on CPU through
the interpreter (and, with ``FUSEDRES_CUDA_ON_CPU=1``, the CUDA kernels through their CPU
execution layer): numerics only, those times mean nothing. Exit status 0 when every case
passes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusedres  # noqa: E402
from fusedres import functional as FR  # noqa: E402
from fusedres.memory import saved_bytes  # noqa: E402

# Relative error bound (max |err| / max |ref|) per dtype against a float64 reference; the
# reference backend's own error at that dtype is printed beside ours.
TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class Case:
    name: str
    n: int
    c: int
    h: int
    co: int
    k: int = 3
    stride: int = 1
    padding: int = 1
    residual: bool = True


GPU_CASES = [
    Case("cifar 16ch 32x32", 128, 16, 32, 16),
    Case("cifar 64ch 8x8 s2", 128, 32, 16, 64, stride=2, residual=False),
    Case("imagenet 64ch 56x56", 32, 64, 56, 64),
    Case("imagenet 1x1 256->64", 32, 256, 56, 64, k=1, padding=0, residual=False),
    Case("imagenet 256ch 14x14", 32, 256, 14, 256),
]
CPU_CASES = [
    Case("tiny 5ch 7x7", 2, 5, 7, 6),
    Case("tiny 3->17 s2", 1, 3, 9, 17, stride=2, residual=False),
]


def _inputs(case: Case, dtype, device, channels_last: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case.n, case.c, case.h, case.h, generator=g)
    w = torch.randn(case.co, case.c, case.k, case.k, generator=g) / (case.c * case.k ** 2) ** 0.5
    ho = (case.h + 2 * case.padding - case.k) // case.stride + 1
    res = torch.randn(case.n, case.co, ho, ho, generator=g) if case.residual else None
    gamma = 1 + 0.1 * torch.randn(case.c, generator=g)
    beta = 0.1 * torch.randn(case.c, generator=g)
    gy = torch.randn(case.n, case.co, ho, ho, generator=g)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make(dt):
        def t(v, grad=True):
            if v is None:
                return None
            v = v.to(device=device, dtype=dt)
            if v.dim() == 4:
                v = v.contiguous(memory_format=fmt)
            return v.requires_grad_(grad)
        pdt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        return dict(x=t(x), weight=t(w), residual=t(res), bn_weight=gamma.to(device, pdt)
                    .requires_grad_(), bn_bias=beta.to(device, pdt).requires_grad_(),
                    grad=t(gy, False))
    return make(dtype), make(torch.float64)


def _step(case: Case, args: dict):
    """One training step of the unit: forward, backward; returns (y, grads)."""
    leaves = [args[k] for k in ("x", "weight", "bn_weight", "bn_bias", "residual")
              if args[k] is not None]
    y = FR.bn_relu_conv2d(args["x"], args["weight"], None, args["bn_weight"], args["bn_bias"],
                          None, None, training=True, stride=case.stride, padding=case.padding,
                          residual=args["residual"])
    grads = torch.autograd.grad(y, leaves, args["grad"])
    return y, grads


def _rel_err(a, ref) -> float:
    return (a.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _time(fn, device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak(fn, device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def run_case(case: Case, dtype, device, channels_last: bool, reps: int,
             backends: tuple[str, ...] = ("triton",)) -> dict:
    args, exact = _inputs(case, dtype, device, channels_last)
    with fusedres.use_backend("reference"):
        y64, g64 = _step(case, exact)
        y_ref, g_ref = _step(case, args)
    stats64 = _batch_moments(y64)
    err_torch = max(_rel_err(a, b) for a, b in zip((y_ref, *g_ref, *_batch_moments(y_ref)),
                                                   (y64, *g64, *stats64)))
    errs = {}
    for backend in backends:
        with fusedres.use_backend(backend):
            y, gr = _step(case, args)
            stats = _output_stats(case, args)  # genstats: reduced in the forward's epilogue
        errs[backend] = max(_rel_err(a, b) for a, b in zip((y, *gr, *stats),
                                                            (y64, *g64, *stats64)))
    # Pass: within the dtype's bound, or within twice the reference's own error.
    bound = max(TOL[dtype], 2 * err_torch)
    row = dict(case=case.name, dtype=str(dtype).replace("torch.", ""),
               layout="nhwc" if channels_last else "nchw",
               ok=all(e <= bound for e in errs.values()), errs=errs, err_torch=err_torch)

    def fwd_only(backend):
        with fusedres.use_backend(backend):
            return saved_bytes(lambda: _step_forward(case, args))
    row["saved_ratio"] = fwd_only(backends[0]) / max(fwd_only("reference"), 1)
    if reps:
        timing = {}
        for backend in (*backends, "reference"):
            with fusedres.use_backend(backend):
                timing[backend] = _time(lambda: _step(case, args), device, reps)
                row[f"peak_{backend}"] = _peak(lambda: _step(case, args), device)
        row["time_ratio"] = timing[backends[0]] / timing["reference"]
        row["ms"] = {b: t * 1e3 for b, t in timing.items()}
    return row


def _batch_moments(y):
    """Per-channel mean and biased variance of ``y``, as the next BatchNorm computes them."""
    y = y.detach().float() if y.dtype in (torch.float16, torch.bfloat16) else y.detach()
    return y.mean((0, 2, 3)), y.var((0, 2, 3), correction=0)


def _output_stats(case: Case, args: dict):
    """The statistics of the unit's output as the forward hands them to the next BatchNorm."""
    with torch.no_grad():
        state = FR.prepare_batch_norm(args["x"], args["bn_weight"], args["bn_bias"], None, None,
                                      training=True)
        _, stats = FR.conv2d_from_prepared(state, args["weight"], stride=case.stride,
                                           padding=case.padding, residual=args["residual"],
                                           return_stats=True)
    return stats


def _step_forward(case: Case, args: dict):
    return FR.bn_relu_conv2d(args["x"], args["weight"], None, args["bn_weight"],
                             args["bn_bias"], None, None, training=True, stride=case.stride,
                             padding=case.padding, residual=args["residual"])


def format_rows(rows: list[dict], device) -> str:
    backends = list(rows[0]["errs"]) if rows else []
    first = backends[0] if backends else "fused"
    err_cols = "".join(f"{'err ' + b:>13}" for b in backends)
    ms_cols = "".join(f"{'ms ' + b:>14}" for b in (*backends, "reference"))
    head = (f"{'case':<24}{'dtype':<9}{'layout':<7}{'result':<7}{err_cols}"
            f"{'torch err':>11}{'saved':>7}{'time':>7}{ms_cols}{'peak':>7}")
    ref = "cuDNN" if device.type == "cuda" else "PyTorch CPU"
    lines = [f"fusedres selftest on {device} (torch {torch.__version__}"
             + (", on CPU: the times are the interpreter's / the CPU layer's and mean nothing"
                if device.type == "cpu" else f", {torch.cuda.get_device_name(device)}") + ")",
             f"err = max relative error vs float64 (output, gradients, genstats); saved = "
             f"saved-activation bytes {first}/reference; time = step time {first}/reference; "
             f"ms = forward+backward of one unit (reference: {ref}); peak = peak CUDA memory "
             f"{first}/reference", head, "-" * len(head)]
    for r in rows:
        errs = "".join(f"{r['errs'][b]:>13.2e}" for b in backends)
        if "ms" in r:
            t = f"{r['time_ratio']:>7.2f}" + "".join(f"{r['ms'][b]:>14.2f}"
                                                     for b in (*backends, "reference"))
        else:
            t = " " * (7 + 14 * (len(backends) + 1))
        peak = (f"{r[f'peak_{first}'] / max(r['peak_reference'], 1):>7.2f}"
                if r.get("peak_reference") else " " * 7)
        lines.append(f"{r['case']:<24}{r['dtype']:<9}{r['layout']:<7}"
                     f"{'pass' if r['ok'] else 'FAIL':<7}{errs}{r['err_torch']:>11.2e}"
                     f"{r['saved_ratio']:>7.2f}{t}{peak}")
    return "\n".join(lines)


GPU_BACKENDS = ("triton", "cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="The GPU kernels (Triton, CUDA C++) vs the reference, with a table.")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per case (default: 10 on a GPU, 0 on CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated fused backends to check (default: those of "
                         f"{', '.join(GPU_BACKENDS)} that can run on the device)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reasons = {b: fusedres._backend.unavailable_reason(b, device) for b in GPU_BACKENDS}
    if args.backends is None:
        backends = tuple(b for b in GPU_BACKENDS if reasons[b] is None)
        if not backends:
            for b, reason in reasons.items():
                print(f"fusedres selftest: the {b} backend cannot run on {device}: {reason}")
            return 2
        for b in GPU_BACKENDS:
            if reasons[b] is not None:
                print(f"fusedres selftest: skipping the {b} backend: {reasons[b]}")
    else:
        backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
        for b in backends:
            reason = fusedres._backend.unavailable_reason(b, device)
            if reason is not None:
                print(f"fusedres selftest: the {b} backend cannot run on {device}: {reason}")
                return 2
    gpu = device.type == "cuda"
    reps = args.reps if args.reps is not None else (10 if gpu else 0)
    cases = GPU_CASES if gpu else CPU_CASES
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if gpu else [torch.float32,
                                                                        torch.bfloat16]
    rows = []
    for case in cases:
        for dtype in dtypes:
            for cl in (True, False):
                if not gpu and dtype != torch.float32 and not cl:
                    continue  # keep the CPU run short
                rows.append(run_case(case, dtype, device, cl, reps, backends))
    print(format_rows(rows, device))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
