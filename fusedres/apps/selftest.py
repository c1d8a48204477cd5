"""``python -m fusedres.apps.selftest``: the GPU kernels against the reference, with a table.

What a user with a GPU runs first. For each case (shape x dtype x layout) it runs one fused
unit, forward and backward, on every GPU backend that runs (``triton``, ``cuda``) and on
``reference`` (plain BatchNorm2d -> ReLU -> Conv2d), and prints pass/fail, the worst relative
error over the output, every gradient and the output's batch statistics as the forward's
genstats epilogue hands them to the next BatchNorm, the fused/reference time ratio of a
training step and the ratio of their saved-activation bytes (plus peak CUDA memory on a GPU).

Without a GPU it sets ``TRITON_INTERPRET=1`` (unless set) and runs small shapes on CPU through
the interpreter: numerics only, the times are the interpreter's and mean nothing. Exit status 0
when every case passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

import torch

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when the fusedres package is
# imported, which `python -m fusedres.apps.selftest` does before this module runs: the __main__
# block below starts the process again with it set.
_NEEDS_INTERPRETER = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusedres  # noqa: E402
from fusedres import functional as FR  # noqa: E402
from fusedres.memory import saved_bytes  # noqa: E402
from fusedres.models.unit_shapes import SELFTEST_CPU, SELFTEST_GPU, ConvUnit  # noqa: E402

# Relative error bound (max |err| / max |ref|) per dtype against a float64 reference; the
# reference backend's own error at that dtype is printed beside ours.
TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 5e-2}


# The cases are the shared shape table's (fusedres.models.unit_shapes): one BN-ReLU-conv each.
Case = ConvUnit
GPU_CASES = SELFTEST_GPU
CPU_CASES = SELFTEST_CPU


def _inputs(case: Case, dtype, device, channels_last: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case.n, case.cin, case.hw, case.hw, generator=g)
    w = torch.randn(case.cout, case.cin, case.k, case.k, generator=g) / (
        case.cin * case.k ** 2) ** 0.5
    ho = case.ho
    res = torch.randn(case.n, case.cout, ho, ho, generator=g) if case.residual else None
    gamma = 1 + 0.1 * torch.randn(case.cin, generator=g)
    beta = 0.1 * torch.randn(case.cin, generator=g)
    gy = torch.randn(case.n, case.cout, ho, ho, generator=g)
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
             backend: str = "triton") -> dict:
    args, exact = _inputs(case, dtype, device, channels_last)
    with fusedres.use_backend("reference"):
        y64, g64 = _step(case, exact)
        y_ref, g_ref = _step(case, args)
    with fusedres.use_backend(backend):
        y, gr = _step(case, args)
        stats = _output_stats(case, args)  # genstats: reduced in the forward's epilogue
    stats64 = _batch_moments(y64)
    err = max(_rel_err(a, b) for a, b in zip((y, *gr, *stats), (y64, *g64, *stats64)))
    err_torch = max(_rel_err(a, b) for a, b in zip((y_ref, *g_ref, *_batch_moments(y_ref)),
                                                   (y64, *g64, *stats64)))
    # Pass: within the dtype's bound, or within twice the reference's own error.
    ok = err <= max(TOL[dtype], 2 * err_torch)
    row = dict(backend=backend, case=case.name, dtype=str(dtype).replace("torch.", ""),
               layout="nhwc" if channels_last else "nchw", ok=ok, err=err, err_torch=err_torch)

    def fwd_only(backend):
        with fusedres.use_backend(backend):
            return saved_bytes(lambda: _step_forward(case, args))
    row["saved_ratio"] = fwd_only(backend) / max(fwd_only("reference"), 1)
    if reps:
        timing = {}
        for name, b in (("fused", backend), ("reference", "reference")):
            with fusedres.use_backend(b):
                timing[name] = _time(lambda: _step(case, args), device, reps)
                row[f"peak_{name}"] = _peak(lambda: _step(case, args), device)
        row["time_ratio"] = timing["fused"] / timing["reference"]
        row["time_ms"] = timing["fused"] * 1e3
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
    head = (f"{'backend':<8}{'case':<24}{'dtype':<9}{'layout':<7}{'result':<7}{'max rel err':>12}"
            f"{'torch err':>11}{'saved':>7}{'time':>8}{'ms':>9}{'peak':>7}")
    lines = [f"fusedres selftest on {device} (torch {torch.__version__}"
             + (", TRITON_INTERPRET=1: times are the interpreter's" if device.type == "cpu"
                else f", {torch.cuda.get_device_name(device)}") + ")",
             "saved = saved-activation bytes fused/reference; time = step time fused/reference; "
             "peak = peak CUDA memory fused/reference", head, "-" * len(head)]
    for r in rows:
        t = f"{r['time_ratio']:>8.2f}{r['time_ms']:>9.2f}" if "time_ratio" in r else " " * 17
        peak = (f"{r['peak_fused'] / max(r['peak_reference'], 1):>7.2f}"
                if r.get("peak_reference") else " " * 7)
        lines.append(f"{r.get('backend', 'triton'):<8}{r['case']:<24}{r['dtype']:<9}"
                     f"{r['layout']:<7}{'pass' if r['ok'] else 'FAIL':<7}{r['err']:>12.2e}"
                     f"{r['err_torch']:>11.2e}{r['saved_ratio']:>7.2f}{t}{peak}")
        if "error" in r:
            lines.append(f"        raised {r['error']}")
    return "\n".join(lines)


GPU_BACKENDS = ("triton", "cuda")
# The cuda backend on its CUTLASS kernels (FUSEDRES_CUDA_KERNELS=cutlass), a row set of its own
# on a GPU whose fusedres._C has them: how they pass the GPU self-test that the switch's default
# waits for, and their times beside the native kernels'.
CUTLASS = "cuda:cutlass"


def gpu_backends(device) -> list[str]:
    """The GPU backends that run on ``device`` (on CPU: triton under the interpreter), and
    ``cuda:cutlass`` on a GPU whose build has the CUTLASS kernels."""
    device = torch.device(device)
    found = [b for b in GPU_BACKENDS if fusedres.unavailable_reason(b, device) is None]
    if device.type == "cuda" and "cuda" in found and "cutlass" in fusedres.cuda_kernel_sets():
        found.append(CUTLASS)
    return found


def _kernels_env(backend: str):
    """(the backend run_case takes, FUSEDRES_CUDA_KERNELS for it): the cuda rows pinned to the
    native kernels, whatever the caller's environment says."""
    if backend == CUTLASS:
        return "cuda", "cutlass"
    return backend, "native" if backend == "cuda" else None


def _cutlass_eligible(case: Case, dtype, channels_last: bool) -> bool:
    """Whether the CUTLASS kernels take this case (csrc/cuda/cutlass_conv/README.md): 16-bit,
    channels-last, C and Co multiples of 8 (the self-test's units have no conv bias)."""
    return (dtype in (torch.float16, torch.bfloat16) and channels_last
            and case.cin % 8 == 0 and case.cout % 8 == 0)


def unavailable(device) -> str | None:
    """Why no GPU backend can run on ``device``, or None."""
    if gpu_backends(device):
        return None
    return "; ".join(f"{b}: {fusedres.unavailable_reason(b, torch.device(device))}"
                     for b in GPU_BACKENDS)


def run(device, reps: int, backends: list[str] | None = None, on_row=None) -> list[dict]:
    """Every case on ``device`` for each GPU backend that runs there (or those of
    ``backends``): on a GPU all dtypes and both layouts; on CPU (the interpreter, the cuda
    backend's CPU layer) the tiny cases, float32 in both layouts and bfloat16 channels_last.
    Case by case, every backend in turn on each: a run stopped by a time limit (the GPU
    check's) has all the backends' rows of the cases it reached, side by side.
    ``on_row(rows)`` after each case, with the rows so far."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    cases = GPU_CASES if gpu else CPU_CASES
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if gpu else [torch.float32,
                                                                        torch.bfloat16]
    labels = backends or gpu_backends(device)
    rows = []
    for case in cases:
        for label in labels:
            backend, kernels = _kernels_env(label)
            # The variable is read by every cuda op call; the environment is restored after.
            with mock.patch.dict(os.environ,
                                 {"FUSEDRES_CUDA_KERNELS": kernels} if kernels else {}):
                _run_backend(rows, label, backend, [case], dtypes, device, gpu, reps, on_row)
    return rows


def _run_backend(rows, label, backend, cases, dtypes, device, gpu, reps, on_row) -> None:
    """One backend's rows (``label`` in them; ``backend`` the one it runs), appended to rows."""
    for case in cases:
        for dtype in dtypes:
            for cl in (True, False):
                if not gpu and dtype != torch.float32 and not cl:
                    continue  # keep the CPU run short
                try:
                    before = fusedres.cutlass_launches()
                    row = {**run_case(case, dtype, device, cl, reps, backend), "backend": label}
                    if label == CUTLASS:
                        # A case the CUTLASS kernels take must have launched them: a silent
                        # fall back to the native ones is not a CUTLASS pass.
                        row["cutlass_launches"] = fusedres.cutlass_launches() - before
                        if _cutlass_eligible(case, dtype, cl) and not row["cutlass_launches"]:
                            row.update(ok=False, error="no CUTLASS kernel ran")
                    rows.append(row)
                except Exception as e:  # a kernel that raises fails its case, not the run
                    rows.append(dict(backend=label, case=case.name,
                                     dtype=str(dtype).replace("torch.", ""),
                                     layout="nhwc" if cl else "nchw", ok=False,
                                     err=float("nan"), err_torch=float("nan"),
                                     saved_ratio=float("nan"),
                                     error=f"{type(e).__name__}: {str(e)[:200]}"))
                if on_row is not None:
                    on_row(rows)


def write_rows(path: str, rows: list[dict]) -> None:
    """The rows so far as a JSON list, replaced atomically: a run stopped by a time limit (the
    GPU report's) leaves every case it finished."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    if _NEEDS_INTERPRETER:
        # The kernels were defined (by `import fusedres`) without the interpreter this machine
        # needs: the command starts again with it set. Here, not only under __main__: `fusedres
        # selftest` and `python -m fusedres selftest` reach this function through the CLI.
        args = sys.argv[1:] if argv is None else list(argv)
        os.execv(sys.executable, [sys.executable, "-m", "fusedres.apps.selftest", *args])
    ap = argparse.ArgumentParser(description="GPU kernels vs the reference, with a table.")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per case (default: 10 on a GPU, 0 on CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--backends", default=None, metavar="NAMES",
                    help=f"comma-separated, from {', '.join(GPU_BACKENDS)} and {CUTLASS} (the "
                    "cuda backend on its CUTLASS kernels, where built) (default: those that run "
                    "on the device)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the rows to PATH (fusedres bench gpu-report reads them)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reason = unavailable(device)
    if reason is not None:
        print(f"fusedres selftest: no GPU backend can run on {device}: {reason}")
        return 2
    backends = None
    if args.backends is not None:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        running = gpu_backends(device)
        bad = [b for b in backends if b not in running]
        if not backends or bad:
            ap.error(f"--backends: expected names from {', '.join(running) or '(none)'} "
                     f"(the GPU backends that run on {device}), got {args.backends!r}")
    reps = args.reps if args.reps is not None else (10 if device.type == "cuda" else 0)
    rows = run(device, reps, backends,
               on_row=(lambda rows: write_rows(args.json, rows)) if args.json else None)
    print(format_rows(rows, device))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
