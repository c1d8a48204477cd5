"""Ahead-of-time compile of every Triton kernel as its JIT specialises it, for given CUDA archs.

``python -m tools.triton_aot --arch 80 90`` captures the launches of one training step
(forward and both backward plans) of each representative unit shape (tools/jit_spec.py: the
host launchers on meta tensors, Triton's own binder for the specialisation: ints equal to 1 as
constexprs, divisibility by 16, the dtypes of each tensor), for each dtype variant (fp16, bf16,
fp32 with TF32, fp32 without TF32 = ``ieee`` products, fp64) on an A100 (108 SMs) for sm_80 and
an H100 (132 SMs) for sm_90. Each distinct specialisation is compiled once with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` - no GPU needed. A config
of a kernel that no captured launch uses (the host rule picks it for other shapes or layouts;
the autotuner may pick any) is compiled swapped into a captured launch of that kernel (same
arguments, that config's block sizes, warps and stages): every config is checked.

Prints kernel, dtype, config, arch, shared memory, registers, spilled bytes (ptxas's log), the
unit shapes that launch it, and exits non-zero when a compile fails, shared memory exceeds the
arch's per-block limit, registers spill, or a launch leaves an argument to its default
(:func:`defaulted`). Shape sets: ``benchmark`` (default: the ResNet-164
CIFAR units at batch 128, the ResNet-50 ImageNet units at batch 256, channels_last; 1262
compiles, ~16 min on two cores, ~15 s from the cache), ``ci`` (a CIFAR 3x3 unit and an ImageNet
1x1 unit with a residual, and the witness shapes of :data:`KNOWN_SPILLS`, the spills allowed and
why). Compiles are cached (tools/jit_spec.py's cache).

Needs ``TRITON_INTERPRET=0`` before the kernels are imported (``main`` sets it; a process that
already imported them under the interpreter must start this as a subprocess).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

# Max dynamic shared memory per block (opt-in), bytes.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Dtype variants: (operand dtype, torch.backends.cudnn.allow_tf32).
VARIANTS = {"fp16": ("fp16", True), "bf16": ("bf16", True), "fp32": ("fp32", True),
            "fp32-ieee": ("fp32", False), "fp64": ("fp64", True)}
DTYPES = tuple(VARIANTS)
BACKWARDS = ("sums", "store")
KERNELS = ("batch_stats", "bn_relu_conv2d_fwd", "dgrad_store", "dgrad_dx", "dx", "wgrad",
           "wgrad_sums", "stats_combine", "bn_prepare", "scale_shift", "partials_reduce")


def shape_set(name: str) -> list:
    """The unit shapes (fusedres.models.unit_shapes.ConvUnit) of set ``name``."""
    from fusedres.models.unit_shapes import CIFAR_BOTTLENECKS, R50_CONVS, conv_units

    cifar = list(dict.fromkeys(u for b in CIFAR_BOTTLENECKS for u in conv_units(b, 128, "c164")))
    if name == "benchmark":
        return cifar + R50_CONVS
    if name == "ci":
        # A 3x3 (taps loop) and a 1x1 + residual (KH = KW = 1: constexprs), whose first
        # launches the other configs are swapped into; then the witnesses of KNOWN_SPILLS, the
        # units that launch the two-warp tiles' spills (22 compiles more).
        witnesses = list(dict.fromkeys(a.witness for a in KNOWN_SPILLS.values() if a.witness))
        return [next(u for u in cifar if u.k == 3),
                next(u for u in R50_CONVS if u.k == 1 and u.residual)] + [
                    u for w in witnesses for u in cifar if u.name == w]
    raise ValueError(f"--set: expected benchmark or ci, got {name!r}")


def role_configs() -> dict:
    """Each kernel role's ``configs_for(variant)``: the configs it may launch with for a dtype
    variant (a name of ``VARIANTS``: "fp32-ieee" has its own configs)."""
    from fusedres.kernels import batch_stats as bs
    from fusedres.kernels import bn_relu_conv2d as fwd
    from fusedres.kernels import bn_relu_conv2d_dgrad as dg
    from fusedres.kernels import bn_relu_conv2d_wgrad as wg
    from fusedres.kernels import reductions as red

    return {"batch_stats": bs.configs_for, "bn_relu_conv2d_fwd": fwd.configs_for,
            "dgrad_store": dg.configs_for, "dgrad_dx": dg.configs_for,
            "dx": dg.dx_configs_for, "wgrad": wg.configs_for,
            "wgrad_sums": wg.sums_configs_for, "stats_combine": red.stats_combine_configs_for,
            "bn_prepare": red.prepare_configs_for, "scale_shift": red.scale_shift_configs_for,
            "partials_reduce": red.reduce_configs_for}


@dataclass
class Job:
    """One distinct specialisation to compile: the launch, its dtype variant, the shapes that
    launch it (``swapped``: the config was swapped into the first one's launch)."""

    launch: object
    dtype: str
    shapes: list = field(default_factory=list)
    swapped: bool = False

    @property
    def where(self) -> str:
        if self.swapped:
            return f"swapped into {self.shapes[0]}"
        more = f" +{len(self.shapes) - 1}" if len(self.shapes) > 1 else ""
        return f"{self.shapes[0]}{more}"


# Spills ptxas reports for the benchmark set, each allowed up to the bytes a thread it spilled
# when it was found; any other spill, or more bytes, fails. Found with triton 3.8.0 (python -m
# tools.triton_aot --arch 80 90, 2026-11-28: 26 of 1,114 compiles of the three GEMM kernels)
# and triton 3.6.0 (--arch 90: 8 of 882, and one more the ci set swaps in; its spills differ,
# and are allowed with 3.6 only).
# Keyed by (kernel, config, arch). The ``ci`` set holds the witness units (shape_set) of the
# two-warp sm_80 entries and of 3.6's float64 one, so CI compiles them and sees one grow or a
# new one appear there; the float32 ones (4-12 bytes) and the swapped-in sm_90 ones only the
# full set compiles (22 compiles in CI against ~190 for every witness). Not measured on a
# GPU: what a spill costs there. The way out, for the two-warp tiles: the host rules could keep
# them to units with one K block (what they were made for), which no GPU_MODEL.md row changes.
class Allowed(NamedTuple):
    """A known spill: the dtypes, the bytes a thread allowed, why, the triton releases it is
    allowed with (None: any), and the unit of the ``ci`` set that launches it (None: only the
    full set compiles it)."""

    dtypes: tuple
    bytes: int
    why: str
    tritons: tuple | None = None
    witness: str | None = None


_TWO_WARP_16BIT = (
    "the 2-warp 32x64x64 tile (the half-height tile the host rule picks for few-pixel units "
    "with C or Co >= 64, made for CIFAR's 64@8 units, one K block, which do not spill): with "
    "more than one K block (a 1x1 unit with C >= 128, or the data gradient's Co = 256) 64 "
    "threads hold the fp32 accumulator and a K-step's operand fragments in 255 registers")
KNOWN_SPILLS = {
    ("bn_relu_conv2d_fwd", "M=32 N=64 K=64 BSCALE_AT=1 w=2 s=2", 80): Allowed(
        ("fp16", "bf16"), 84, _TWO_WARP_16BIT + "; launched by c164 256>64 1x1 @8 and "
        "128>64 1x1 /2 @16 on an A100; 52 bytes, 84 where the kernel also merges the "
        "statistics of its output (GENSTATS with MERGE; a noinline merge spills more, and "
        "spills on other tiles)", witness="c164 256>64 1x1 @8"),
    ("dgrad_store", "M=32 N=64 K=64 w=2 s=2", 80): Allowed(
        ("fp16", "bf16"), 44, _TWO_WARP_16BIT + "; launched by c164 64>256 1x1 @8 +res",
        witness="c164 64>256 1x1 @8 +res"),
    ("dgrad_dx", "M=32 N=64 K=64 w=2 s=2", 80): Allowed(
        ("fp16", "bf16"), 48, _TWO_WARP_16BIT + "; launched by c164 64>256 1x1 @8 +res",
        witness="c164 64>256 1x1 @8 +res"),
    ("dgrad_store", "M=32 N=64 K=64 w=2 s=2", 90): Allowed(
        ("fp16", "bf16"), 144, _TWO_WARP_16BIT + "; no H100 launch picks it (the host rule "
        "takes the 64-row tile there), only the autotuner could"),
    ("dgrad_dx", "M=32 N=64 K=64 w=2 s=2", 90): Allowed(
        ("fp16", "bf16"), 148, _TWO_WARP_16BIT + "; no H100 launch picks it, only the "
        "autotuner could"),
    ("bn_relu_conv2d_fwd", "M=32 N=64 K=64 BSCALE_AT=1 w=2 s=2", 90): Allowed(
        ("fp16", "bf16"), 56, _TWO_WARP_16BIT + "; no H100 launch picks it, only the "
        "autotuner could (triton 3.8: no spill)", tritons=("3.6",)),
    ("dgrad_dx", "M=128 N=64 K=32 w=8 s=2", 80): Allowed(
        ("fp32",), 12, "the float32 (TF32) data gradient's big tile writing dx in its "
        "epilogue, strided units (c164 64>32 1x1 /2 @32, r50 3x3 /2): 4-12 bytes past 128 "
        "registers"),
    ("bn_relu_conv2d_fwd", "M=64 N=64 K=32 w=8 s=2", 80): Allowed(
        ("fp32-ieee",), 4, "the float32 FMA (no TF32) forward's mid tile on c164 64>64 3x3 @8: "
        "4 bytes past 80 registers"),
    ("bn_relu_conv2d_fwd", "M=128 N=32 K=8 w=4 s=2", 90): Allowed(
        ("fp32-ieee",), 4, "triton 3.6's dot takes no K below 16: this K = 8 tile is padded "
        "to 16 (kernels/_tl.fit_k), twice its operand registers, on c164 64>16 1x1 @32",
        tritons=("3.6",)),
    ("bn_relu_conv2d_fwd", "M=32 N=64 K=32 w=2 s=2", 90): Allowed(
        ("fp32",), 4, "the float32 (TF32) forward's 2-warp narrow tile as triton 3.6 compiles "
        "it (3.8: no spill) swapped into the ci set's c164 16>16 3x3 @32 (the compat step): "
        "4 bytes past 168 registers", tritons=("3.6",)),
    ("dgrad_store", "M=32 N=32 K=16 w=4 s=3", 90): Allowed(
        ("fp64",), 16, "the float64 data gradient's small tile as triton 3.6 compiles it "
        "(3.8: no spill), on c164 64>256 1x1 @8 +res and three more units", tritons=("3.6",),
        witness="c164 64>256 1x1 @8 +res"),
}


def _triton_release() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return ".".join(triton.__version__.split(".")[:2])


def allowed_spill(kernel: str, dtype: str, config: str, arch: int) -> int:
    """The spill bytes :data:`KNOWN_SPILLS` allows this compile with the installed triton (0:
    none)."""
    entry = KNOWN_SPILLS.get((kernel, config, arch))
    if entry is None or dtype not in entry.dtypes or (
            entry.tritons is not None and _triton_release() not in entry.tritons):
        return 0
    return entry.bytes


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
    where: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and 0 <= self.spill_bytes <= self.allowed_spill
                and 0 <= self.shared <= SMEM_LIMIT.get(self.arch, 0))

    @property
    def allowed_spill(self) -> int:
        return allowed_spill(self.kernel, self.dtype, self.config, self.arch)

    @property
    def status(self) -> str:
        """ok | allowed (a spill within :data:`KNOWN_SPILLS`) | error (did not compile) |
        spills | smem (over the arch's shared memory)."""
        if self.ok and self.spill_bytes > 0:
            return "allowed"
        if self.ok:
            return "ok"
        if self.error:
            return "error"
        return "spills" if self.spill_bytes > self.allowed_spill else "smem"


def jobs(archs, dtypes, units, kernels=None) -> list[Job]:
    """The distinct specialisations of the launches of ``units`` (one training step each, both
    backward plans, and the step whose forward returns its output's statistics), then every
    config no launch covers, swapped into a launch of its kernel."""
    from . import jit_spec

    found: dict = {}
    for arch in archs:
        for variant in dtypes:
            dtype, tf32 = VARIANTS[variant]
            for unit in units:
                # Both backward plans, and the forward whose epilogue gives the next BatchNorm
                # its statistics (genstats: what the models run; its partials merged by
                # stats_combine_kernel).
                # The genstats step through the public ops' bodies: every kernel a route
                # launches (their own affine launch included) is then compiled; through the
                # eager route: its next BatchNorm prepared from the given statistics.
                for backward, genstats, route in [(b, False, "eager") for b in BACKWARDS] + [
                        ("sums", True, "public"), ("sums", True, "eager")]:
                    for launch in jit_spec.unit_launches(unit, dtype, arch=arch, tf32=tf32,
                                                         backward=backward, genstats=genstats,
                                                         route=route):
                        if kernels and launch.kernel not in kernels:
                            continue
                        job = found.setdefault((variant, launch.key()), Job(launch, variant))
                        if unit.name not in job.shapes:
                            job.shapes.append(unit.name)
    out = list(found.values())
    configs_of = role_configs()
    for arch in archs:
        for variant in dtypes:
            for role, configs_for in configs_of.items():
                mine = [j for j in out if j.launch.kernel == role and j.dtype == variant
                        and j.launch.arch == arch and not j.swapped]
                if not mine:
                    continue
                have = {j.launch.config for j in mine}
                for cfg in configs_for(variant):
                    if cfg not in have:
                        base = mine[0]
                        out.append(Job(jit_spec.with_config(base.launch, cfg), variant,
                                       [base.shapes[0]], swapped=True))
    return out


def defaulted(launch) -> list[str]:
    """The kernel's arguments that ``launch`` leaves to their defaults. torch 2.11's
    ``wrap_triton`` analysis of which tensors a kernel writes needs every argument passed
    (else it takes every input as written, and a traced backward then fails writing into a
    leaf: the weight-gradient kernel's BLOCK_T did this); torch 2.14's fills the defaults in."""
    names = launch.fn.arg_names
    passed = set(names[:len(launch.args)]) | set(launch.kwargs)
    return [n for n in names if n not in passed]


def compile_one(job: Job) -> Result:
    from . import jit_spec

    launch = job.launch
    res = Result(launch.kernel, job.dtype, str(launch.config), launch.arch, where=job.where)
    missing = [] if job.swapped else defaulted(launch)  # a swap replaces the config's keys
    if missing:
        res.error = (f"DefaultedArguments: {', '.join(missing)} not passed (torch 2.11's "
                     "wrap_triton needs every argument)")
        return res
    try:
        c = jit_spec.compile_launch(launch, keep_ptx=False)
    except Exception as exc:  # noqa: BLE001 - reported per config
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return res
    res.shared, res.registers, res.spill_bytes = c.shared, c.registers, c.spill_bytes
    res.seconds = c.seconds
    return res


def run(archs, dtypes, workers: int | None = None, kernels=None, units=None) -> list[Result]:
    todo = jobs(archs, dtypes, units if units is not None else shape_set("benchmark"), kernels)
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if workers <= 1:
        return [compile_one(j) for j in todo]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, todo, chunksize=4))


# The table's columns: (name, width, right-aligned); "launched by" takes the rest of the line.
COLUMNS = (("kernel", 20, False), ("dtype", 10, False), ("config", 40, False), ("arch", 6, True),
           ("smem", 8, True), ("regs", 6, True), ("spill", 7, True), ("sec", 6, True),
           ("", 2, False), ("status", 8, False))


def _row(values) -> str:
    return "".join(f"{v:>{w}}" if right else f"{v:<{w}}"
                   for v, (_, w, right) in zip(values, COLUMNS)) + values[-1]


def format_table(results: list[Result]) -> str:
    head = _row([name for name, _, _ in COLUMNS] + ["launched by"])
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(_row([r.kernel, r.dtype, r.config, f"sm_{r.arch}", r.shared, r.registers,
                           r.spill_bytes, f"{r.seconds:.1f}", "", r.status, r.where]))
        if r.error:
            lines[-1] += f"  ({r.error})"
    return "\n".join(lines)


def parse_table(text: str) -> list[dict]:
    """The rows of :func:`format_table`'s table in ``text``, as {column: text}."""
    rows, body = [], False
    for line in text.splitlines():
        if line.startswith("---"):
            body = True
        elif body and line.startswith(KERNELS):
            row, at = {}, 0
            for name, width, _ in COLUMNS:
                row[name] = line[at:at + width].strip()
                at += width
            row["launched by"] = line[at:]
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--kernel", nargs="+", default=None, choices=KERNELS,
                    help="only these kernels (default: all)")
    ap.add_argument("--set", default="benchmark", choices=("benchmark", "ci"),
                    help="unit shapes whose launches are compiled (default: benchmark)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: cores)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    from fusedres.kernels.bn_relu_conv2d import bn_relu_conv2d_fwd_kernel
    if not hasattr(bn_relu_conv2d_fwd_kernel, "arg_names") or "Interpreted" in type(
            bn_relu_conv2d_fwd_kernel).__name__:
        print("the kernels were imported under TRITON_INTERPRET=1: run this in a fresh process")
        return 2
    t0 = time.perf_counter()
    results = run(args.arch, args.dtype, args.jobs, args.kernel, shape_set(args.set))
    print(format_table(results))
    bad = [r for r in results if not r.ok]
    allowed = sum(r.status == "allowed" for r in results)
    print(f"{len(results)} compiles, {len(bad)} failed, {time.perf_counter() - t0:.0f} s"
          + (f" ({allowed} spills within KNOWN_SPILLS)" if allowed else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
