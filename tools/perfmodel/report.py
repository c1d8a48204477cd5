"""benchmarks/GPU_MODEL.md: the calibration table, the per-unit fused-vs-plain table and the
per-kernel table, every figure MODELED (nothing here ran on a GPU)."""

from __future__ import annotations

from . import model
from .calibrate import GemmPrediction
from .devices import A100, H100
from .units import UnitModel


def _us(s: float) -> str:
    return f"{s * 1e6:.1f}"


def calibration_table(results: list[tuple[GemmPrediction, list]]) -> list[str]:
    lines = [
        "| device | M x N x K | measured Triton TFLOP/s | measured cuBLAS | MODELED TFLOP/s "
        "| error vs Triton | error vs cuBLAS | modeled best config (BM,BN,BK,G,w,s) | bound "
        "| source (Triton version) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    errs, errs_c = [], []
    for best, _ in results:
        c = best.case
        e_c = (best.tflops - c.cublas_tflops) / c.cublas_tflops
        errs.append(best.error)
        errs_c.append(e_c)
        lines.append(
            f"| {c.device.upper()} | {c.m}x{c.n}x{c.k} | {c.triton_tflops:.0f} | "
            f"{c.cublas_tflops:.0f} | {best.tflops:.0f} | {100 * best.error:+.0f}% | "
            f"{100 * e_c:+.0f}% | {best.config} | {best.prediction.bound} | {c.source} "
            f"({c.triton_version}) |")
    mean_abs = sum(abs(e) for e in errs) / len(errs)
    median = sorted(abs(e) for e in errs)[len(errs) // 2]
    lines.append("")
    lines.append(f"Mean absolute error against the measured Triton figures: "
                 f"{100 * mean_abs:.0f}% (median {100 * median:.0f}%; the model is below the "
                 f"measured Triton figure in {sum(e < 0 for e in errs)} of {len(errs)} cases, "
                 f"by at most {100 * -min(min(errs), 0):.0f}%). Against cuBLAS on the same "
                 f"sizes: mean absolute error {100 * sum(map(abs, errs_c)) / len(errs_c):.0f}%, "
                 f"from {100 * min(errs_c):+.0f}% to {100 * max(errs_c):+.0f}%.")
    return lines


def auto_plan(um: UnitModel) -> str:
    """The backward plan the Triton backend's default (``FUSEDRES_TRITON_BACKWARD=auto``) runs
    for ``um``'s unit and dtype, on either GPU: kernels/traffic.auto_strategy (an H100
    roofline)."""
    from fusedres.kernels import traffic

    from .units import traffic_unit

    return traffic.auto_strategy(traffic_unit(um.unit, um.dtype))


def default_models(models: list[UnitModel],
                   store: list[UnitModel] | None = None) -> list[UnitModel]:
    """Per (unit, dtype, GPU) the model of the plan the default runs (:func:`auto_plan`):
    from ``store`` where it picks "store" (when modeled), else from ``models`` ("sums")."""
    alt = {(um.unit.name, um.dtype, um.device.arch): um for um in store or []}
    return [alt.get((um.unit.name, um.dtype, um.device.arch), um)
            if auto_plan(um) == "store" else um for um in models]


def unit_table(models: list[UnitModel], store: list[UnitModel] | None = None) -> list[str]:
    """Per (unit, dtype): each device's fused and plain times and their ratio for the plan the
    default backward runs (``auto``: the plan column), the ratio of each plan ("sums" from
    ``models``, "store" from ``store``), host ops, and the launch that bounds the unit (the
    slowest of the default plan, its bound and % of tensor peak)."""
    by_key: dict[tuple, dict] = {}
    for um in models:
        by_key.setdefault((um.unit.name, um.dtype), {})[um.device.arch] = um
    alt = {(um.unit.name, um.dtype, um.device.arch): um for um in store or []}
    head = "| unit | dtype "
    rule = "|---|---"
    for gpu in ("A100", "H100"):
        head += (f"| {gpu} fused us | {gpu} plain us | {gpu} fused/plain | {gpu} plan "
                 f"| {gpu} sums: fused/plain | {gpu} store: fused/plain | {gpu} host ops "
                 f"| {gpu} bound by ")
        rule += "|---:|---:|---:|---|---:|---:|---:|---"
    lines = [head + "|", rule + "|"]
    for (name, dtype), d in by_key.items():
        cells = []
        for arch in (80, 90):
            sums = d.get(arch)
            if sums is None:
                cells += ["-"] * 8
                continue
            st = alt.get((name, dtype, arch))
            plan = auto_plan(sums)
            um = st if plan == "store" and st is not None else sums
            k = um.slowest
            cells += [_us(um.fused_s), _us(um.plain_s), f"{um.fused_s / um.plain_s:.2f}",
                      um.backward, f"{sums.fused_s / sums.plain_s:.2f}",
                      f"{st.fused_s / st.plain_s:.2f}" if st is not None else "-",
                      f"{len(um.host)} ({_us(um.host_s)} us)",
                      f"{k.role} {_us(k.pred.time_s)} us: {k.pred.bound}, "
                      f"{k.pred.pct_tensor_peak:.0f}% tensor"]
        lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return lines


# The fused step's launches that are convolutions (GEMMs), by role, and the plain sequence's.
GEMM_ROLES = ("bn_relu_conv2d_fwd", "wgrad_sums", "wgrad", "dgrad_dx", "dgrad_store")
PLAIN_GEMMS = ("conv fwd", "conv dgrad", "conv wgrad")


def losses(models: list[UnitModel], store: list[UnitModel] | None = None) -> list[str]:
    """Per (unit, dtype, GPU) whose default plan is slower than the plain sequence, what the
    difference is made of: the GEMM launches against the plain convolutions (their time, their
    share of dense tensor peak, the slowest GEMM's bound) and every other launch (statistics,
    affine, partials, dx, host ops) against the plain BatchNorm / ReLU / add passes (their
    count, at LAUNCH_S each at least)."""
    lines = []
    for um in default_models(models, store):
        if um.fused_s <= um.plain_s:
            continue
        gemms = [k for k in um.kernels if k.role in GEMM_ROLES]
        if not gemms:
            raise ValueError(f"{um.unit.name}: no GEMM launch among {[k.role for k in um.kernels]}")
        g_f = sum(k.pred.time_s for k in gemms)
        flops = sum(k.pred.flops for k in gemms)
        peak = um.device.tensor_peak_flops(
            max(gemms[0].pred.mma_fma_cta, key=gemms[0].pred.mma_fma_cta.get)
            if gemms[0].pred.mma_fma_cta else "fp16")
        g_p = sum(t for n, t, _ in um.plain if n in PLAIN_GEMMS)
        o_f, o_p = um.fused_s - g_f, um.plain_s - g_p
        n_f = len(um.kernels) - len(gemms) + len(um.host)
        n_p = len(um.plain) - sum(n in PLAIN_GEMMS for n, _, _ in um.plain)
        worst = max(gemms, key=lambda k: k.pred.time_s)
        gpu = "A100" if um.device is A100 else "H100"
        lines.append(
            f"- {um.unit.name}, {um.dtype}, {gpu} ({um.backward}): {_us(um.fused_s)} us against "
            f"{_us(um.plain_s)} ({um.fused_s / um.plain_s:.2f}x). GEMMs {_us(g_f)} us, "
            f"{100 * flops / g_f / peak:.0f}% of tensor peak (slowest {worst.role}: "
            f"{worst.pred.bound}), against the plain convolutions' {_us(g_p)} at "
            f"{100 * model.TENSOR_SUSTAINED[um.device.arch]:.0f}%: {(g_f - g_p) * 1e6:+.1f} us; "
            f"the other {n_f} launches {_us(o_f)} us against the plain sequence's {n_p} "
            f"BatchNorm / ReLU / add passes, {_us(o_p)} us: {(o_f - o_p) * 1e6:+.1f} us.")
    return lines


def kernel_table(models: list[UnitModel], store: list[UnitModel] | None = None) -> list[str]:
    """Per launch of the "sums" plan (``models``), and of the "store" plan (``store``) those
    launches it alone makes (roles wgrad, dgrad_store, dx) where the default runs it."""
    picked = {(um.unit.name, um.dtype, um.device.arch) for um in default_models(models, store)
              if um.backward == "store"}
    extra = {}
    for um in store or []:
        if (um.unit.name, um.dtype, um.device.arch) in picked:
            extra[(um.unit.name, um.dtype, um.device.arch)] = um
    lines = ["| unit | dtype | GPU | kernel | config | regs | spill B | smem KiB | CTAs/SM "
             "(limit) | instrs/iter | MMA/iter | LDG+STG B/thr/iter | bar+wait/iter | trips "
             "(inner x outer) | CTAs | waves (tail) | issue us | tensor us | shared us | "
             "DRAM us | bound | % tensor peak | MODELED us |",
             "|" + "---|" * 4 + "---|" + "---:|" * 13 + "---|---:|---:|"]
    for um in models:
        dev = "A100" if um.device is A100 else "H100"
        kernels = list(um.kernels)
        st = extra.get((um.unit.name, um.dtype, um.device.arch))
        if st is not None:
            roles = {k.role for k in um.kernels}
            kernels += [k for k in st.kernels if k.role not in roles]
        for k in kernels:
            p, it = k.pred, k.sass.per_iter
            cfg = str(k.cap.config)
            mma = ", ".join(f"{s}x{n}" for s, n in sorted(it.mma_shapes.items())) or "-"
            lines.append(
                f"| {um.unit.name} | {um.dtype} | {dev} | {k.role} | {cfg} | {k.comp.registers}"
                f" | {k.comp.spill_bytes} | {k.comp.shared / 1024:.1f} | {p.blocks_sm} "
                f"({p.occupancy_limit}) | {it.total} | {mma} | "
                f"{it.global_load + it.global_store} | {it.barriers}+{it.waits} | "
                f"{k.trips.inner:g} x {k.trips.outer:g} | {k.cap.programs} | {p.waves} "
                f"({p.tail_factor:.2f}) | {_us(p.issue_s)} | {_us(p.tensor_s)} | "
                f"{_us(p.shared_s)} | {_us(p.dram_s)} | {p.bound} | {p.pct_tensor_peak:.0f} | "
                f"{_us(p.time_s)} |")
    return lines


HEADER = """# GPU performance model (MODELED, not measured)

Generated by `{command}` (`make gpu-model`; {runtime}).
**Every time and throughput below is MODELED** from the compiled SASS: no GPU ran any of it.
Compiler: Triton {triton} (sm_80 cubins for the A100, sm_90a for the H100).

How (tools/perfmodel): each kernel launch of the fused unit (Triton backend, both
backward plans, channels_last, fp32 with TF32) is captured from the host launchers on meta tensors,
compiled as the JIT specialises it (ints equal to 1 as constexprs, divisibility by 16 of ints and
pointers), disassembled (cuobjdump -sass), and its steady-state main loop found (the innermost
loop carrying the tensor-core instructions; backward branches). Per iteration: issued warp
instructions by class, HMMA/HGMMA shapes -> tensor-pipe cycles at the per-SM rate of the spec
sheet, global/shared bytes from access widths, barriers and waits; registers and shared memory
-> CTAs per SM. Per launch: issue, tensor, shared-memory and DRAM bounds, waves with the tail
(grid-quantisation) factor; modeled time = max(compute over waves, DRAM) + launch. The plain
sequence (BatchNorm, ReLU, cuDNN conv, add, their backward) is modeled from
kernels/traffic.py's unfused_step: conv at the calibrated sustained tensor rate (an upper bound
on cuDNN, which favours the plain side), the rest at DRAM speed.

Devices (tools/perfmodel/devices.py, cited there): {devices}.

Constants (global, tools/perfmodel/model.py): DRAM efficiency {dram:.2f} of the spec
bandwidth; {launch:.0f} us per launch; {fill} cycles of pipeline fill + drain per wave; sustained
tensor fraction (fitted: the best published cuBLAS figure of the calibration set over the spec
peak) A100 {s80:.3f}, H100 {s90:.3f}. Nothing else is fitted; nothing is per case.

Host ops: the PyTorch ops the fused backend's host launchers run between the kernels (partials'
reductions, per-channel vectors), counted on meta tensors, one DRAM-bound launch each.
"""


def markdown(calib, models, runtime_s: float, cuda=None,
             command: str = "python -m tools.perfmodel", store=None) -> str:
    import triton

    devs = "; ".join(f"{d.name}: {d.sms} SMs, {d.clock_hz / 1e9:.2f} GHz, dense fp16/bf16 "
                     f"{d.tensor_peak_flops() / 1e12:.0f} TFLOP/s, TF32 "
                     f"{d.tensor_peak_flops('tf32') / 1e12:.0f}, "
                     f"{d.dram_bytes_s / 1e12:.2f} TB/s" for d in (A100, H100))
    out = [HEADER.format(command=command, runtime=f"this run took {runtime_s:.0f} s on 2 CPU cores",
                         triton=triton.__version__, devices=devs,
                         dram=model.DRAM_EFFICIENCY, launch=model.LAUNCH_S * 1e6,
                         fill=model.FILL_CYCLES, s80=model.TENSOR_SUSTAINED[80],
                         s90=model.TENSOR_SUSTAINED[90])]
    out += ["## Calibration: Triton's matmul tutorial kernel (tools/perfmodel/gemm.py)", "",
            "The tutorial's fp16 configs compiled here (Triton of this checkout, not the "
            "versions that were measured: see the source column), the fastest MODELED config "
            "kept, against published measured TFLOP/s. The cuBLAS column is what the "
            "sustained-tensor constant was fitted on; the Triton column is not fitted.", ""]
    out += calibration_table(calib) if calib else ["Not run (--no-calibration)."]
    out += ["", "## Fused unit forward + backward vs the plain sequence (MODELED)", "",
            "Training step of one BN -> ReLU -> conv (+ residual) unit: the fused Triton "
            "kernels (batch statistics, forward, weight gradient + BN sums, data gradient "
            "writing dx) and their host ops, against BatchNorm + ReLU + cuDNN conv (+ add) and "
            "their backward. Ratio < 1: fused faster. Two backward plans: \"sums\" (the "
            "weight-gradient pass's second GEMM gives the BatchNorm sums, then one pass writes "
            "dx) and \"store\" (one GEMM fewer; the data gradient stores dz in dx's buffer, an "
            "elementwise pass turns it into dx). The first three columns per GPU are the "
            "default's, FUSEDRES_TRITON_BACKWARD=auto, which runs the plan named in \"plan\" "
            "(kernels/traffic.auto_strategy: an H100 roofline, the same choice on both GPUs); "
            "each plan's ratio follows. \"bound by\": the slowest launch of the default's plan, "
            "what bounds it and its share of dense tensor peak (the per-kernel table below has "
            "the rest).", ""]
    out += unit_table(models, store)
    out += ["", "### Where the default is slower than the plain sequence (MODELED)", "",
            "Each row above 1.0x split in two: the convolutions (the fused GEMM launches, "
            "BatchNorm-ReLU in their operand loads, against cuDNN at the calibrated sustained "
            "tensor rate) and everything else (the fused step's statistics, affine, partials' "
            "reductions, dx pass and host ops, against the BatchNorm, ReLU and add passes it "
            "replaces, each at least a launch). A positive difference is time the fused step "
            "loses there.", ""]
    out += losses(models, store) or ["None."]
    out += ["", "## Per kernel (MODELED)", "",
            "Per main-loop iteration counts are per warp (instructions) and per thread (bytes); "
            "MMA/iter lists SASS tensor instructions per warp per iteration. Bound: the largest "
            "of issue, tensor, shared and DRAM time.", ""]
    out += kernel_table(models, store)
    if cuda is not None:
        runs = [(um.unit, um.dtype, um.device) for um in models if um.dtype in ("fp16", "bf16")]
        plain = {(um.unit.name, um.dtype, um.device.arch): um.plain_s for um in models}
        out += [""] + cuda_section(cuda, runs, plain)
    return "\n".join(out) + "\n"


def cuda_section(cuda, runs, plain: dict) -> list[str]:
    """The report's CUDA C++ section: the kernel table of ``cuda`` (cuda_sass.cuda_rows, or why
    it was not read) and model_cuda_unit for each (unit, 16-bit dtype, device) of ``runs``
    beside the plain sequence's modeled seconds, ``plain[(unit name, dtype, arch)]``."""
    from . import cuda_sass

    out = ["## CUDA C++ kernels (csrc/cuda, nvcc -O3): main-loop SASS (MODELED)", "",
           cuda_sass.__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(), ""]
    out += cuda_sass.table(cuda) if isinstance(cuda, list) else [f"Not read: {cuda}."]
    if isinstance(cuda, list):
        cuda_models = [cuda_sass.model_cuda_unit(u, dtype, dev, cuda) for u, dtype, dev in runs]
        out += ["", "### CUDA C++ backend: fused unit forward + backward (MODELED range)", "",
                " ".join(cuda_sass.model_cuda_unit.__doc__.split()), ""]
        out += cuda_sass.unit_table(cuda_models, plain)
        cut = [cuda_sass.model_cutlass_unit(u, dtype, dev, cuda) for u, dtype, dev in runs]
        ratios = [m.high_s / plain[(m.unit.name, m.dtype, m.arch)] for m in cut
                  if (m.unit.name, m.dtype, m.arch) in plain]
        out += ["", "### CUDA C++ backend on CUTLASS (FUSEDRES_CUDA_KERNELS=cutlass): fused "
                "unit forward + backward (MODELED)", "",
                " ".join(cuda_sass.model_cutlass_unit.__doc__.split()), ""]
        out += cuda_sass.unit_table(cut, plain)
        if ratios:
            out += ["", f"CUTLASS path, fused/plain over the {len(ratios)} rows: "
                    f"{min(ratios):.2f} - {max(ratios):.2f} (median "
                    f"{sorted(ratios)[len(ratios) // 2]:.2f}); rows <= 1.0: "
                    f"{sum(r <= 1.0 for r in ratios)} of {len(ratios)}. MODELED, never run."]
    return out
