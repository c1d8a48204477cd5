"""Ahead-of-time compile of every config of every Triton kernel, for given CUDA archs.

``python -m fusedres.kernels.aot --arch 80 90`` compiles each kernel's configs (each dtype it
is launched with, the widest variant of its constexpr flags) with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` - no GPU needed - and
prints kernel, dtype, config, arch, shared memory, registers and spilled bytes (from the ptxas
log). It exits non-zero when a compile fails, shared memory exceeds the arch's per-block limit,
or registers spill.

Needs ``TRITON_INTERPRET=0`` before the kernels are imported (``main`` sets it; a process that
already imported them under the interpreter must start this as a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Max dynamic shared memory per block (opt-in), bytes.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = ("fp16", "bf16", "fp32", "fp64")


@dataclass
class Result:
    kernel: str
    dtype: str
    config: str
    arch: int
    shared: int = -1
    registers: int = -1
    spill_bytes: int = -1
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and self.spill_bytes == 0
                and 0 <= self.shared <= SMEM_LIMIT.get(self.arch, 0))


def _types(dtype: str) -> dict[str, str]:
    """Element types by role: x / weight operand, statistics, accumulators / partials."""
    stat = "fp64" if dtype == "fp64" else "fp32"
    return {"x": dtype, "w": dtype, "stat": stat, "acc": stat, "f64": "fp64"}


def kernel_specs():
    """(name, jit function, configs per dtype, pointer roles, constexprs per dtype)."""
    from . import batch_stats as bs
    from . import bn_relu_conv2d as fwd
    from . import bn_relu_conv2d_dgrad as dg
    from . import bn_relu_conv2d_wgrad as wg

    def flags(dtype):
        return {"FP64": dtype == "fp64", "TF32": dtype == "fp32", "INTERP_BF16": False}

    dgrad_roles = {
        "dy_ptr": "w", "w_ptr": "w", "x_ptr": "x", "scale_ptr": "stat", "shift_ptr": "stat",
        "mean_ptr": "stat", "invstd_ptr": "stat", "m1_ptr": "stat", "m2_ptr": "stat",
        "gx_ptr": "x", "s1_ptr": "acc", "s2_ptr": "acc", "bscale_ptr": "acc"}
    wgrad_roles = {
        "dy_ptr": "w", "x_ptr": "x", "scale_ptr": "stat", "shift_ptr": "stat",
        "mean_ptr": "stat", "invstd_ptr": "stat", "w_ptr": "w", "gamma_ptr": "stat",
        "beta_ptr": "stat", "dw_ptr": "w", "s1_ptr": "acc", "s2_ptr": "acc", "db_ptr": "acc",
        "bscale_ptr": "acc"}
    return [
        ("batch_stats", bs.batch_stats_kernel, bs.configs_for,
         {"x_ptr": "x", "mean_ptr": "f64", "m2_ptr": "f64"},
         lambda d: {"FP64": d == "fp64"}),
        ("bn_relu_conv2d_fwd", fwd.bn_relu_conv2d_fwd_kernel, fwd.configs_for,
         {"x_ptr": "x", "w_ptr": "w", "scale_ptr": "stat", "shift_ptr": "stat", "bias_ptr": "w",
          "res_ptr": "w", "bscale_ptr": "acc", "y_ptr": "w", "smean_ptr": "acc", "sm2_ptr": "acc"},
         lambda d: {"HAS_BIAS": True, "HAS_RES": True, "GENSTATS": True, "HAS_BSCALE": True,
                    **flags(d)}),
        # Launch variants: dz stored for the dx pass (training), or dx written directly.
        ("dgrad_store", dg.dgrad_kernel, dg.configs_for, dgrad_roles,
         lambda d: {"WRITE_DZ": True, "WRITE_DX": False, "STATS": True, "TRAIN": True,
                    "HAS_BSCALE": True, **flags(d)}),
        ("dgrad_dx", dg.dgrad_kernel, dg.configs_for, dgrad_roles,
         lambda d: {"WRITE_DZ": False, "WRITE_DX": True, "STATS": True, "TRAIN": True,
                    "HAS_BSCALE": True, **flags(d)}),
        ("dx", dg.dx_kernel, dg.dx_configs_for,
         {"g_ptr": "x", "x_ptr": "x", "scale_ptr": "stat", "mean_ptr": "stat",
          "invstd_ptr": "stat", "m1_ptr": "stat", "m2_ptr": "stat"},
         lambda d: {"FP64": d == "fp64", "INTERP_BF16": False}),
        ("wgrad", wg.wgrad_kernel, wg.configs_for, wgrad_roles,
         lambda d: {"SUMS": False, "HAS_DB": True, "HAS_BSCALE": True, **flags(d)}),
        ("wgrad_sums", wg.wgrad_kernel, wg.sums_configs_for, wgrad_roles,
         lambda d: {"SUMS": True, "HAS_DB": True, "HAS_BSCALE": True, **flags(d)}),
    ]


def jobs(archs, dtypes, kernels=None):
    out = []
    for name, _, configs_for, _, _ in kernel_specs():
        if kernels and name not in kernels:
            continue
        for dtype in dtypes:
            for idx, _cfg in enumerate(configs_for(dtype)):
                for arch in archs:
                    out.append((name, dtype, idx, arch))
    return out


def compile_one(job) -> Result:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, dtype, idx, arch = job
    spec = {s[0]: s for s in kernel_specs()}[name]
    _, fn, configs_for, roles, constexprs = spec
    cfg = configs_for(dtype)[idx]
    res = Result(name, dtype, str(cfg), arch)
    types = _types(dtype)
    consts = {**constexprs(dtype), **cfg.meta}
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in roles:
            sig[a] = "*" + types[roles[a]]
        else:
            sig[a] = "i32"
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # the ptxas log is only printed on a real compile
    t0 = time.perf_counter()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": cfg.num_warps,
                                         "num_stages": cfg.num_stages})
    except Exception as exc:  # noqa: BLE001 - reported per config
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return res
    res.seconds = time.perf_counter() - t0
    log = buf.getvalue()
    res.shared = int(ck.metadata.shared)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    if not regs or not spills:
        res.error = "no ptxas resource log"
    else:
        res.registers = max(int(r) for r in regs)
        res.spill_bytes = max(int(s) for s in spills)
    return res


def run(archs, dtypes, workers: int | None = None, kernels=None) -> list[Result]:
    todo = jobs(archs, dtypes, kernels)
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        return [compile_one(j) for j in todo]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, todo))


def format_table(results: list[Result]) -> str:
    head = f"{'kernel':<20}{'dtype':<6}{'config':<42}{'arch':>5}{'smem':>8}{'regs':>6}" \
           f"{'spill':>7}{'sec':>6}  status"
    lines = [head, "-" * len(head)]
    for r in results:
        status = "ok" if r.ok else (r.error or (
            "spills" if r.spill_bytes else "shared memory over the limit"))
        lines.append(f"{r.kernel:<20}{r.dtype:<6}{r.config:<42}{'sm_' + str(r.arch):>5}"
                     f"{r.shared:>8}{r.registers:>6}{r.spill_bytes:>7}{r.seconds:>6.1f}  {status}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--kernel", nargs="+", default=None,
                    help="only these kernels (default: all)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: cores)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    from .bn_relu_conv2d import bn_relu_conv2d_fwd_kernel
    if not hasattr(bn_relu_conv2d_fwd_kernel, "arg_names") or "Interpreted" in type(
            bn_relu_conv2d_fwd_kernel).__name__:
        print("the kernels were imported under TRITON_INTERPRET=1: run this in a fresh process")
        return 2
    t0 = time.perf_counter()
    results = run(args.arch, args.dtype, args.jobs, args.kernel)
    print(format_table(results))
    bad = [r for r in results if not r.ok]
    print(f"{len(results)} compiles, {len(bad)} failed, {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
