"""``fusedres bench units``: forward+backward of single units, fused on every backend that runs
here, against the plain unit (NCHW and channels_last), ``torch.compile`` of the plain unit and
``torch.utils.checkpoint`` of it, measured in the same interleaved run.

The builders here (:func:`make_case`, :func:`make_step`) are the ones the pytest-benchmark
files in ``benchmarks/`` time too.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fusedres
from fusedres.memory import saved_bytes
from fusedres.models.unit_shapes import BlockUnit, ConvUnit

from .measure import peak_bytes, summarize, time_interleaved
from .report import Column, fmt_bytes, pyplot

__all__ = ["BASELINES", "Case", "PlainConvUnit", "bandwidth_columns", "device_peak_bandwidth",
           "fused_backends", "layout_ratios", "layout_summary", "make_case", "make_step",
           "run_units", "saved_bytes_of"]

# The plain unit in other clothes: the ratios of every row are to "plain" (NCHW, eager).
BASELINES = ("plain", "channels_last", "compile", "checkpoint")
# Seconds a timed sample lasts at least on CPU (measure.time_interleaved's min_sample_s).
CPU_MIN_SAMPLE_S = 0.05


class PlainConvUnit(nn.Module):
    """``conv(relu(bn(x))) [+ residual]`` with ``nn.BatchNorm2d`` and ``nn.Conv2d`` (oneDNN on
    CPU, cuDNN on CUDA): what a user writes without fusedres."""

    def __init__(self, bn: nn.BatchNorm2d, conv: nn.Conv2d):
        super().__init__()
        self.bn, self.conv = bn, conv

    def forward(self, x, residual=None):
        y = self.conv(F.relu(self.bn(x)))
        return y if residual is None else y + residual


def build_module(shape: ConvUnit | BlockUnit, fused: bool) -> nn.Module:
    """The unit of ``shape``, fused or plain, with seed-0 parameters (the same either way)."""
    torch.manual_seed(0)
    if isinstance(shape, ConvUnit):
        unit = fusedres.BNReLUConv2d(shape.cin, shape.cout, shape.k, stride=shape.stride,
                                     padding=shape.padding)
        return unit if fused else PlainConvUnit(unit.bn, unit.conv)
    if shape.block == "basic":
        return fusedres.PreActBasicBlock(shape.cin, shape.planes, shape.stride, fused=fused)
    return fusedres.PreActBottleneck(shape.cin, shape.planes, shape.stride, fused=fused,
                                     stride_on=shape.stride_on)


@dataclass
class Case:
    """One candidate on one shape: the module, its inputs, and how it is called."""

    impl: str
    backend: str
    layout: str
    module: nn.Module
    fn: Callable
    x: torch.Tensor
    residual: torch.Tensor | None
    grad: torch.Tensor
    amp: torch.dtype | None = None


def make_case(shape: ConvUnit | BlockUnit, impl: str, device: torch.device,
              dtype: torch.dtype = torch.float32, amp: torch.dtype | None = None) -> Case:
    """``impl``: one of :data:`BASELINES`, or a fused backend's name (optionally with
    ``" channels_last"``). Inputs are seeded, so every candidate of a shape sees the same.
    ``amp``: run the forward under ``torch.autocast`` to that dtype (float32 parameters)."""
    backend, _, layout = impl.partition(" ")
    fused = impl not in BASELINES
    if impl == "channels_last":
        layout = "channels_last"
    layout = layout or "nchw"
    module = build_module(shape, fused).to(device=device, dtype=dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    module = module.to(memory_format=fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape.n, shape.cin, shape.hw, shape.hw, generator=g)
    ho = shape.ho if isinstance(shape, ConvUnit) else -(-shape.hw // shape.stride)
    gy = torch.randn(shape.n, shape.cout, ho, ho, generator=g)
    res = None
    if isinstance(shape, ConvUnit) and shape.residual:
        res = torch.randn(shape.n, shape.cout, ho, ho, generator=g)

    def put(t, grad):
        if t is None:
            return None
        return t.to(device=device, dtype=dtype).contiguous(memory_format=fmt).requires_grad_(grad)

    x, res, gy = put(x, True), put(res, True), put(gy, False)
    if impl == "checkpoint":
        def fn(*a):
            return checkpoint(module, *a, use_reentrant=False)
    elif impl == "compile":
        fn = torch.compile(module)
    else:
        fn = module
    if amp is not None:
        gy = gy.to(amp)
    return Case(impl, backend if fused else "reference", layout, module, fn, x, res, gy, amp)


def _backend_ctx(case: Case):
    return fusedres.use_backend(case.backend)


def _call(case: Case):
    amp = (torch.autocast(case.x.device.type, dtype=case.amp) if case.amp is not None
           else contextlib.nullcontext())
    with amp:
        return case.fn(case.x) if case.residual is None else case.fn(case.x, case.residual)


def make_step(case: Case) -> Callable[[], None]:
    """One training step of the unit: forward, backward with a fixed output gradient; the
    gradients of the previous step are dropped first (as ``zero_grad(set_to_none=True)``)."""
    def step():
        case.x.grad = None
        if case.residual is not None:
            case.residual.grad = None
        for p in case.module.parameters():
            p.grad = None
        with _backend_ctx(case):
            _call(case).backward(case.grad)
    return step


def fused_backends(device: torch.device) -> list[str]:
    """The fused backends that run on ``device``, for timing: the Triton interpreter on CPU is
    left out (its times mean nothing)."""
    out = []
    for b in fusedres.available_backends(device):
        if b == "reference" or (b == "triton" and device.type != "cuda"):
            continue
        out.append(b)
    return out


def device_peak_bandwidth(device: torch.device) -> float | None:
    """Peak DRAM bandwidth of a CUDA device in bytes/s (2 x memory clock x bus width), or None."""
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def modeled_bytes(shape: ConvUnit | BlockUnit, dtype: torch.dtype) -> int | None:
    """DRAM bytes of one fused training step of a single unit as kernels/traffic.py models the
    Triton kernels (None for whole blocks, or when the kernels are not installed)."""
    if not isinstance(shape, ConvUnit):
        return None
    try:
        from fusedres.kernels import traffic
    except Exception:  # triton missing: no model
        return None
    elem = torch.tensor([], dtype=dtype).element_size()
    unit = traffic.Unit(shape.name, shape.n, shape.cin, shape.hw, shape.cout, shape.k,
                        shape.stride, shape.residual, elem)
    return traffic.fused_step(unit).bytes


def bandwidth_columns(row: dict, shape, dtype, peak_bw: float | None) -> None:
    """Adds ``modeled_bytes``, ``achieved_Bps`` and ``bandwidth_fraction`` to a triton row on
    CUDA (modeled bytes / measured median; fraction of the device's peak bandwidth)."""
    if not row["impl"].startswith("triton") or peak_bw is None:
        return
    nbytes = modeled_bytes(shape, dtype)
    if nbytes is None:
        return
    row["modeled_bytes"] = nbytes
    row["achieved_Bps"] = nbytes / row["median_s"]
    row["bandwidth_fraction"] = row["achieved_Bps"] / peak_bw


_MODELED: dict[tuple, tuple[float, float] | None] = {}


def modeled_columns(row: dict, shape, dtype: torch.dtype, device: torch.device) -> None:
    """Adds ``modeled_s`` (tools.perfmodel's MODELED step time: the fused Triton kernels for
    a triton channels_last row, the plain sequence for the plain row) on an sm_80 / sm_90 GPU,
    so each measured time has the model's prediction beside it. Single conv units only."""
    if device.type != "cuda" or not isinstance(shape, ConvUnit):
        return
    if row["impl"] not in ("plain", "triton channels_last"):
        return
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)
    if name is None:
        return
    key = (shape, name, device.index)
    if key not in _MODELED:
        try:
            from tools.perfmodel.units import device_for, model_conv_unit

            p = torch.cuda.get_device_properties(device)
            um = model_conv_unit(shape, name, device_for((p.major, p.minor),
                                                         p.multi_processor_count))
            _MODELED[key] = (um.fused_s, um.plain_s)
        except Exception as exc:  # noqa: BLE001 - no prediction, the measurement stands
            warnings.warn(f"tools.perfmodel: no prediction for {shape.name}: {exc}",
                          stacklevel=2)
            _MODELED[key] = None
    if _MODELED[key] is not None:
        fused_s, plain_s = _MODELED[key]
        row["modeled_s"] = plain_s if row["impl"] == "plain" else fused_s


def profiled_seconds(step, reps: int, activities, attr: str, profile=None) -> float:
    """Seconds per step of ``attr`` (a FunctionEventAvg total: ``self_device_time_total``,
    ``self_cpu_time_total``) summed over every op and kernel torch.profiler records in
    ``reps`` calls of ``step``. Self times add up without counting a nested op twice.
    ``profile``: torch.profiler.profile, or a stand-in with its interface (tests)."""
    if profile is None:
        from torch.profiler import profile

    with profile(activities=activities) as prof:
        for _ in range(reps):
            step()
        if any(a.name == "CUDA" for a in activities):
            torch.cuda.synchronize()
    return sum(getattr(e, attr) for e in prof.key_averages()) * 1e-6 / reps


def kernel_columns(row: dict, step, device: torch.device, reps: int = 3) -> None:
    """Adds ``kernel_s`` to a row that has a MODELED time: the GPU time of one step's kernels
    (torch.profiler's device time, copies and memsets included), what the model prices, without
    the host time between launches that a step's wall time also holds (the 2026-11-25 H100 run:
    single units host-bound, 34-55x their modeled kernels). A profiler failure is a warning."""
    if device.type != "cuda" or "modeled_s" not in row:
        return
    from torch.profiler import ProfilerActivity

    try:
        step()
        torch.cuda.synchronize(device)
        t = profiled_seconds(step, reps, [ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             "self_device_time_total")
    except Exception as exc:  # noqa: BLE001 - the wall time stands without it
        warnings.warn(f"torch.profiler: no kernel time for {row['shape']} {row['impl']}: {exc}",
                      stacklevel=2)
        return
    if t > 0:
        row["kernel_s"] = t


def replay_seconds(step, device: torch.device, reps: int = 20, warmup: int = 3,
                   capture=None) -> float:
    """Seconds per step of ``step`` replayed from a CUDA graph: its kernels back to back on the
    device with no host work between launches, timed by CUDA events around ``reps`` replays.
    The warm-up steps run on a side stream first (Triton compiles and picks its configs there,
    the gradients' buffers exist), as fusedres.apps.train.step.GraphedStep does. ``capture``: how a
    function becomes its replay (default: fusedres.apps.train.step.cuda_graph_capture); on CPU a
    stand-in (``lambda fn: fn``) runs the same bookkeeping with a wall clock."""
    from ..train.step import cuda_graph_capture

    capture = cuda_graph_capture if capture is None else capture
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    if cuda:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        for _ in range(warmup):
            step()
    if cuda:
        torch.cuda.current_stream(device).wait_stream(side)
    replay = capture(step)
    replay()  # the capture recorded; this runs it once before the timed replays
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            replay()
        return (time.perf_counter() - t0) / reps
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / reps


def replay_columns(row: dict, step, device: torch.device, reps: int = 20) -> None:
    """Adds ``replay_s`` to a row that has a MODELED time: the step replayed from a CUDA graph
    (:func:`replay_seconds`), the kernels' time with the gaps between them but no host time,
    the measurement the performance model's prediction is checked against. A capture that
    fails (an op that cannot be captured) is a warning; the other columns stand."""
    if device.type != "cuda" or "modeled_s" not in row:
        return
    try:
        row["replay_s"] = replay_seconds(step, device, reps)
    except Exception as exc:  # noqa: BLE001 - the wall and profiler times stand without it
        warnings.warn(f"CUDA graph: no replay time for {row['shape']} {row['impl']}: {exc}",
                      stacklevel=2)


def modeled_cols():
    return [Column("MODELED ms", lambda r: _scaled(r, "modeled_s", 1e-3), "{:.3f}"),
            Column("measured / MODELED", lambda r: r["median_s"] / r["modeled_s"]
                   if "modeled_s" in r else None, "{:.2f}"),
            Column("kernels ms", lambda r: _scaled(r, "kernel_s", 1e-3), "{:.3f}"),
            Column("kernels / MODELED", lambda r: r["kernel_s"] / r["modeled_s"]
                   if "kernel_s" in r and "modeled_s" in r else None, "{:.2f}"),
            Column("replay ms", lambda r: _scaled(r, "replay_s", 1e-3), "{:.3f}"),
            Column("replay / MODELED", lambda r: r["replay_s"] / r["modeled_s"]
                   if "replay_s" in r and "modeled_s" in r else None, "{:.2f}")]


def _impls(device: torch.device, baselines, backends) -> list[str]:
    impls = [b for b in BASELINES if b in baselines]
    for b in backends:
        impls.append(b)
        # The fused unit on channels_last tensors: on a GPU always; on CPU when the plain
        # channels_last unit is timed, so that it meets the fused unit in its own layout.
        if device.type == "cuda" or "channels_last" in baselines:
            impls.append(f"{b} channels_last")
    return impls


def shape_info(shape: ConvUnit | BlockUnit) -> dict:
    info = {"shape": shape.name, "kind": shape.kind, "n": shape.n, "cin": shape.cin,
            "cout": shape.cout, "hw": shape.hw, "stride": shape.stride}
    if isinstance(shape, ConvUnit):
        info.update(k=shape.k, residual=shape.residual)
    return info


def run_units(shapes, device: torch.device, *, baselines=BASELINES, backends=None,
              warmup: int = 2, reps: int = 7, dtype: torch.dtype = torch.float32,
              amp: torch.dtype | None = None, deadline: float | None = None, progress=None,
              on_shape=None, min_sample_s: float | None = None) -> list[dict]:
    """Measure every shape; returns one row per (shape, impl) with the median and spread of
    the step time, ``ratio`` to the plain row of the same shape and run, ``saved_bytes``
    (autograd's saved activations) and ``peak_bytes`` (see :func:`measure.peak_bytes`).

    ``min_sample_s``: see :func:`measure.time_interleaved` (default: 0.05 s on CPU, where a
    sample is then the steady state of a few calls in a row; single calls on CUDA).
    ``deadline`` (a ``time.monotonic()`` value): shapes not started by then are skipped and
    listed in a row with ``skipped``. ``on_shape(rows_of_shape)`` is called as each finishes.
    """
    backends = fused_backends(device) if backends is None else list(backends)
    impls = _impls(device, baselines, backends)
    peak_bw = device_peak_bandwidth(device)
    if min_sample_s is None:
        min_sample_s = CPU_MIN_SAMPLE_S if device.type == "cpu" else 0.0
    rows: list[dict] = []
    for shape in shapes:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({**shape_info(shape), "impl": None, "skipped": "time limit reached"})
            if progress is not None:
                progress.update(reps)
            continue
        cases = {impl: make_case(shape, impl, device, dtype, amp) for impl in impls}
        steps = {impl: make_step(c) for impl, c in cases.items()}
        times = time_interleaved(steps, device, warmup=warmup, reps=reps,
                                 min_sample_s=min_sample_s,
                                 on_round=progress.update if progress is not None else None)
        shape_rows = []
        for impl, case in cases.items():
            row = {**shape_info(shape), "impl": impl, "backend": case.backend,
                   "layout": case.layout, "dtype": str(dtype).replace("torch.", ""),
                   "amp": str(amp).replace("torch.", "") if amp is not None else None,
                   **summarize(times[impl])}
            row["saved_bytes"] = _saved(case)
            row["peak_bytes"] = _peak(steps[impl], device, case)
            shape_rows.append(row)
        plain = next((r for r in shape_rows if r["impl"] == "plain"), None)
        for row in shape_rows:
            row["ratio"] = row["median_s"] / plain["median_s"] if plain else None
            bandwidth_columns(row, shape, amp or dtype, peak_bw)
            modeled_columns(row, shape, amp or dtype, device)
            kernel_columns(row, steps[row["impl"]], device)
            replay_columns(row, steps[row["impl"]], device)
        layout_ratios(shape_rows)
        rows += shape_rows
        if on_shape is not None:
            on_shape(shape_rows)
        del cases, steps
    return rows


# The plain unit in each layout, by the impl name its row carries.
PLAIN_BY_LAYOUT = {"nchw": "plain", "channels_last": "channels_last"}


def layout_ratios(shape_rows: list[dict]) -> None:
    """Adds to the fused rows of one shape (in place) the two comparisons a user who picks
    the faster layout cares about:

    * ``same_layout_ratio``: the fused unit over the plain unit in the same layout (fused
      NCHW / plain NCHW, fused channels_last / plain channels_last); None when the plain unit
      was not timed in that layout.
    * ``best_ratio``: the backend's faster layout over plain PyTorch's faster layout (the
      faster of plain NCHW and plain channels_last), on both rows of the backend, with
      ``best_fused_layout`` and ``best_plain_layout``; None unless both plain layouts were
      timed. ``is_best_layout`` marks the row whose layout is the backend's faster one.

    Ratios of medians measured in the same run; ``x plain`` (``ratio``) is left as it is.
    """
    measured = [r for r in shape_rows if r.get("median_s") is not None]
    plain = {layout: next((r for r in measured if r["impl"] == impl), None)
             for layout, impl in PLAIN_BY_LAYOUT.items()}
    best_plain = None
    if all(plain.values()):
        best_plain = min(plain.values(), key=lambda r: r["median_s"])
    fused = [r for r in measured if r["impl"] not in BASELINES]
    for backend in dict.fromkeys(r["backend"] for r in fused):
        rows = [r for r in fused if r["backend"] == backend]
        best = min(rows, key=lambda r: r["median_s"])
        for r in rows:
            same = plain.get(r["layout"])
            r["same_layout_ratio"] = r["median_s"] / same["median_s"] if same else None
            r["is_best_layout"] = r is best
            if best_plain is None:
                r["best_ratio"] = r["best_fused_layout"] = r["best_plain_layout"] = None
                continue
            r["best_ratio"] = best["median_s"] / best_plain["median_s"]
            r["best_fused_layout"] = best["layout"]
            r["best_plain_layout"] = best_plain["layout"]


def layout_summary(rows: list[dict]) -> list[dict]:
    """Per fused backend and comparison (``nchw``: fused NCHW / plain NCHW, ``channels_last``:
    fused channels_last / plain channels_last, ``best``: best fused / best plain), over the
    shapes that have it: the median ratio, how many shapes are above 1.0 (fused slower), and
    the worst shape. Rows as :func:`layout_ratios` leaves them."""
    out = []
    fused = [r for r in table_rows(rows) if r["impl"] not in BASELINES]
    for backend in dict.fromkeys(r["backend"] for r in fused):
        mine = [r for r in fused if r["backend"] == backend]
        for comparison in ("nchw", "channels_last", "best"):
            if comparison == "best":
                pts = [(r["shape"], r["best_ratio"]) for r in mine
                       if r.get("is_best_layout") and r.get("best_ratio") is not None]
            else:
                pts = [(r["shape"], r["same_layout_ratio"]) for r in mine
                       if r["layout"] == comparison and r.get("same_layout_ratio") is not None]
            if not pts:
                continue
            ratios = [v for _, v in pts]
            worst = max(pts, key=lambda p: p[1])
            out.append({"backend": backend, "comparison": comparison,
                        "median_ratio": statistics.median(ratios), "shapes": len(pts),
                        "above_1": sum(v > 1.0 for v in ratios),
                        "worst_shape": worst[0], "worst_ratio": worst[1]})
    return out


COMPARISON_TEXT = {"nchw": "fused NCHW / plain NCHW",
                   "channels_last": "fused channels_last / plain channels_last",
                   "best": "best fused / best plain"}


def summary_lines(summary: list[dict]) -> list[str]:
    """One line per entry of :func:`layout_summary`."""
    return [f"{s['backend']}, {COMPARISON_TEXT[s['comparison']]}: median {s['median_ratio']:.2f}"
            f", above 1.0 on {s['above_1']} of {s['shapes']} shapes, worst {s['worst_shape']} "
            f"({s['worst_ratio']:.2f})" for s in summary]


def saved_bytes_of(case: Case) -> int | None:
    """Bytes autograd saves for backward in one forward of the case (None for compile)."""
    return _saved(case)


def _saved(case: Case) -> int | None:
    if case.impl == "compile":
        return None  # compiled graphs save through AOTAutograd, not autograd's hooks
    with _backend_ctx(case):
        return saved_bytes(lambda: _call(case))


def _peak(step, device, case: Case) -> int | None:
    if case.impl == "compile" and device.type != "cuda":
        # The live-tensor tracker is a dispatch mode: under it the compiled graph would not be
        # what runs, so its peak would be the eager unit's. CUDA's allocator sees the real one.
        return None
    return peak_bytes(step, device, case.module, case.x, case.residual, case.grad)


# --------------------------------------------------------------------------- output

LAYOUT_SHORT = {"nchw": "nchw", "channels_last": "cl"}


def columns(layouts: bool = False):
    """The table's columns; ``layouts``: with the same-layout and best-vs-best ratios (when
    the plain unit is timed in both layouts)."""
    cols = [Column("shape", "shape", right=False), Column("impl", "impl", right=False),
            Column("median ms", lambda r: r["median_s"] * 1e3, "{:.2f}"),
            Column("IQR ms", lambda r: r["iqr_s"] * 1e3, "{:.2f}"),
            Column("x plain", "ratio", "{:.2f}")]
    if layouts:
        cols += [Column("x plain same layout", "same_layout_ratio", "{:.2f}"),
                 Column("best x best plain",
                        lambda r: (r["best_ratio"], r["best_plain_layout"])
                        if r.get("is_best_layout") and r.get("best_ratio") is not None
                        else None,
                        lambda v: f"{v[0]:.2f} (vs {LAYOUT_SHORT[v[1]]})")]
    return cols + [Column("saved", "saved_bytes", fmt_bytes),
                   Column("peak", "peak_bytes", fmt_bytes)]


def _scaled(row: dict, key: str, unit: float) -> float | None:
    return None if row.get(key) is None else row[key] / unit


def bandwidth_cols():
    # Only triton rows on a GPU have them; the other rows of the table show "-".
    return [Column("modeled MB", lambda r: _scaled(r, "modeled_bytes", 1e6), "{:.1f}"),
            Column("GB/s", lambda r: _scaled(r, "achieved_Bps", 1e9), "{:.0f}"),
            Column("of peak", "bandwidth_fraction", "{:.0%}")]


def table_rows(rows: list[dict]) -> list[dict]:
    """Measured rows, then one per skipped shape."""
    return [r for r in rows if r.get("impl") is not None]


def plot_ratios(rows: list[dict], path, title: str) -> None:
    """Dot plot: one line per shape, the ratio to the plain unit of every other candidate (log
    scale; left of 1 is faster than plain). When the plain unit was timed in both layouts, a
    second panel: each fused backend's faster layout over plain PyTorch's faster layout."""
    plt = pyplot()
    rows = table_rows(rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "plain"]
    if not shapes or not impls:
        return
    series = []
    for impl in impls:
        pts = [(r["ratio"], shapes.index(r["shape"])) for r in rows
               if r["impl"] == impl and r.get("ratio")]
        if pts:
            series.append((impl + (" (fused)" if impl not in BASELINES else ""),
                           impl not in BASELINES, pts))
    best = []
    for backend in dict.fromkeys(r["backend"] for r in rows if r["impl"] not in BASELINES):
        pts = [(r["best_ratio"], shapes.index(r["shape"])) for r in rows
               if r["backend"] == backend and r.get("is_best_layout") and r.get("best_ratio")]
        if pts:
            best.append((f"{backend} (fused, faster layout)", True, pts))
    height = 1.6 + 0.28 * len(shapes)
    panels = [(series, "step time / plain NCHW unit's step time (same run; < 1 is faster)")]
    if best:
        panels.append((best, "best fused / best plain (each in its faster layout; < 1: the "
                             "fused unit is faster)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(9 if len(panels) == 1 else 14, height),
                             sharey=True, squeeze=False)
    for ax, (data, xlabel) in zip(axes[0], panels):
        _dot_panel(ax, data, shapes, xlabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _dot_panel(ax, series, shapes, xlabel) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator
    from matplotlib.transforms import offset_copy
    markers = "oDs^v<>P*X"
    for j, (label, fused, pts) in enumerate(series):
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, marker=markers[j % len(markers)], s=46 if fused else 30,
                   label=label, zorder=3, edgecolors="black" if fused else "none",
                   linewidths=0.6)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_yticks(range(len(shapes)))
    ax.set_yticklabels(shapes, fontsize=8)
    if not ax.yaxis_inverted():  # shared y axes: the first panel's inversion holds for all
        ax.invert_yaxis()
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.grid(axis="y", alpha=0.15)
    ax.set_xlabel(xlabel, fontsize=8)
    # Below the tick labels and the axis label, whatever the figure's height.
    below = offset_copy(ax.transAxes, fig=ax.figure, y=-36, units="points")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
              ncol=min(len(series), 4), fontsize=8, frameon=False)
    values = [x for _, _, pts in series for x, _ in pts] + [1.0]
    lo, hi = min(values), max(values)
    ticks = [t * 10.0 ** e for e in range(-3, 4) for t in (1, 1.5, 2, 3, 5, 7)
             if lo / 1.15 <= t * 10.0 ** e <= hi * 1.15] or [1.0]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_bandwidth(rows: list[dict], path, title: str) -> bool:
    """Bars: achieved bandwidth of each fused Triton unit as a fraction of the device's peak."""
    pts = [r for r in table_rows(rows) if r.get("bandwidth_fraction") is not None]
    if not pts:
        return False
    plt = pyplot()
    labels = [f"{r['shape']} [{r['layout']}]" for r in pts]
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.3 * len(pts)))
    ax.barh(range(len(pts)), [100 * r["bandwidth_fraction"] for r in pts], color="tab:green")
    ax.set_yticks(range(len(pts)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("modeled DRAM bytes / measured time, % of the device's peak bandwidth")
    ax.set_xlim(0, 100)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
