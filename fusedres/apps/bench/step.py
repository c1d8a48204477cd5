"""``fusedres bench step``: whole training steps (the trainer's own: forward, float32
cross-entropy, backward, fused SGD) of the zoo's models for plain / fused / fused + planner /
plain + checkpointing, and on a GPU plain and fused replayed from a CUDA graph (the trainer's
``--cuda-graphs`` step), each in every memory layout asked for (NCHW, channels_last):
images/s, peak memory, saved activations, and time and peak over the best plain row of the
model (the faster of plain NCHW and plain channels_last). The GPU check's training-step table
(``decisive.py``) builds its rows here too."""

from __future__ import annotations

import gc
import time

import torch
import torch.nn as nn

import fusedres
from fusedres import models
from fusedres.memory import saved_bytes

from .measure import MemoryWindow, peak_bytes, summarize, sync, time_interleaved
from .report import Column, fmt_bytes, mem_unit, pyplot

__all__ = ["ALL_VARIANTS", "GRAPHED_VARIANTS", "LAYOUTS", "VARIANTS", "Trainer", "build_variant",
           "default_layouts", "make_trainer", "model_input", "run_steps"]

VARIANTS = ("plain", "fused", "fused+plan", "plain+ckpt")
# The step replayed from a CUDA graph (fusedres.apps.train.step.GraphedStep: the host launches
# nothing between the kernels): plain and fused, on a CUDA device only.
GRAPHED_VARIANTS = ("plain+graph", "fused+graph")
ALL_VARIANTS = VARIANTS + GRAPHED_VARIANTS
LAYOUTS = ("nchw", "channels_last")


def default_layouts(device: torch.device) -> tuple[str, ...]:
    """Both layouts on CPU (oneDNN's convolutions run NHWC natively: plain PyTorch in
    channels_last is often a CPU user's fastest step); NCHW on CUDA, the layout the GPU
    kernels are built and modelled for."""
    return LAYOUTS if device.type == "cpu" else ("nchw",)


def memory_format(layout: str) -> torch.memory_format:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def model_name(depth_or_name: str) -> str:
    """``"164"`` or ``"resnet164"`` or ``"preact_resnet164"`` -> ``"preact_resnet164"``;
    raises ``ValueError`` naming ``--models`` for a model the zoo does not have."""
    text = str(depth_or_name).strip().lower()
    for prefix in ("preact_resnet", "resnet"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    name = f"preact_resnet{text}"
    if name not in models.MODELS:
        raise ValueError(f"--models: unknown model {depth_or_name!r}; expected one of "
                         + ", ".join(k.replace("preact_resnet", "") for k in models.MODELS))
    return name


def model_input(name: str, image_size: int | None = None) -> tuple[int, int]:
    """(image size, classes) of a zoo model: CIFAR 32x32/10, ImageNet 224x224/1000."""
    cifar = int(name.replace("preact_resnet", "")) in (20, 56, 110, 164, 1001)
    return (image_size or (32 if cifar else 224)), (10 if cifar else 1000)


class Trainer:
    """One row's training step on a fixed batch: ``fusedres.apps.train``'s own step
    (:class:`~fusedres.apps.train.step.TrainStep`: the trainer's fused SGD reading a device
    learning rate, cross-entropy in float32, autocast to ``amp_dtype`` when given), run eagerly
    or, ``graphed``, replayed from a CUDA graph (:class:`~fusedres.apps.train.step.GraphedStep`,
    the trainer's ``--cuda-graphs``): the same step and optimizer both ways, so an eager and a
    graphed row differ in the host's work only.

    :meth:`prepare` runs what comes before the timed steps (a graphed step's warm-up and
    capture); ``capture`` replaces the CUDA graph capture (tests on CPU: ``lambda fn: fn``)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                 backend: str, info: dict, *, amp_dtype: torch.dtype | None = None,
                 graphed: bool = False, capture=None):
        from ..train import step as train_step

        self.model, self.x, self.target, self.backend, self.info = model, x, target, backend, info
        lr = train_step.lr_tensor(0.01, x.device)
        self.opt = train_step.sgd([{"params": list(model.parameters())}], lr, 0.9, False)
        scaler = torch.amp.GradScaler(x.device.type, enabled=False)  # no fp16 rows
        self.train_step = train_step.TrainStep(model, self.opt, scaler, amp_dtype, x.device.type)
        self.graphed = (train_step.GraphedStep(self.train_step, capture=capture) if graphed
                        else None)

    def step(self) -> None:
        with fusedres.use_backend(self.backend):
            (self.graphed or self.train_step)(self.x, self.target)

    def prepare(self, device: torch.device) -> list[float]:
        """The untimed calls before the first timed one, each timed (seconds): one eager step
        (the first call pays the JIT, cuDNN's and the allocator's first-time work), or the
        graphed step's warm-up steps and then its capture (with its first replay). The last
        entry of a graphed row is the capture's."""
        calls = 1 if self.graphed is None else self.graphed.warmup + 1
        out = []
        for _ in range(calls):
            sync(device)
            t0 = time.perf_counter()
            self.step()
            sync(device)
            out.append(time.perf_counter() - t0)
        return out


def fused_backend(device: torch.device) -> str:
    """The backend the fused variants run on: what ``auto`` picks for ``device``."""
    return fusedres.resolve_backend(device)


def make_trainer(name: str, batch: int, device: torch.device, *, fused: bool,
                 layout: str = "nchw", amp_dtype: torch.dtype | None = None,
                 graphed: bool = False, checkpoint=None, image_size: int | None = None,
                 depth: int | None = None, info: dict | None = None, capture=None) -> Trainer:
    """A :class:`Trainer` of zoo model ``name`` (or of the CIFAR ResNet of ``depth``
    bottleneck layers when ``depth`` is given), plain or ``fused`` (the backend ``auto`` picks
    for ``device``), model and batch in ``layout`` (``nchw`` or ``channels_last``:
    ``.to(memory_format=torch.channels_last)``), its forward under autocast to ``amp_dtype``;
    ``checkpoint``: what ``model.set_grad_checkpointing`` is given (True: every unit; a list
    of unit ranges); ``graphed``: the step replayed from a CUDA graph (``capture``: see
    :class:`Trainer`). The same seed for every row: the same weights and batch."""
    fmt = memory_format(layout)
    torch.manual_seed(0)
    if depth is not None:
        model = models.preact_resnet(depth, fused=fused, block="bottleneck")
        size, classes = 32, 10
    else:
        model = models.MODELS[name](fused=fused)
        size, classes = model_input(name, image_size)
    model = model.to(device).to(memory_format=fmt)
    if checkpoint:
        model.set_grad_checkpointing(checkpoint)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((batch, 3, size, size), generator=g).to(device).contiguous(memory_format=fmt)
    target = torch.randint(0, classes, (batch,), generator=g).to(device)
    backend = fused_backend(device) if fused else "reference"
    info = {**(info or {}), "layout": layout, "backend": backend}
    return Trainer(model, x, target, backend, info, amp_dtype=amp_dtype, graphed=graphed,
                   capture=capture)


def build_variant(name: str, variant: str, batch: int, device: torch.device, *,
                  plan_budget: int | None = None, image_size: int | None = None,
                  depth: int | None = None, layout: str = "nchw") -> Trainer:
    """A :class:`Trainer` for ``variant`` of ``bench step`` (see :func:`make_trainer` for the
    rest). ``fused+plan`` calls ``fusedres.memory.plan(model, input_shape,
    budget_bytes=plan_budget)``, which raises ``fusedres.memory.planner.PlanError`` when the
    budget cannot be met; ``plain+ckpt`` checkpoints every unit (timm's default)."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(ALL_VARIANTS)}, got {variant!r}")
    graphed = variant in GRAPHED_VARIANTS
    if graphed and device.type != "cuda":
        raise ValueError(f"variant: {variant} replays a CUDA graph and needs a CUDA device, "
                         f"got {device.type}")
    tr = make_trainer(name, batch, device, fused=variant.startswith("fused"), layout=layout,
                      graphed=graphed, checkpoint=variant == "plain+ckpt" or None,
                      image_size=image_size, depth=depth, info={"variant": variant})
    if variant == "fused+plan":
        if plan_budget is None:
            raise ValueError("plan_budget: needed for the fused+plan variant")
        plan = fusedres.memory.plan(tr.model, tuple(tr.x.shape), budget_bytes=plan_budget,
                                    channels_last=layout == "channels_last")
        tr.info.update(plan_budget_bytes=int(plan_budget),
                       units_checkpointed=plan.n_checkpointed, segments=len(plan.segments),
                       recompute_fraction=plan.recompute_fraction)
    return tr


def step_peak(tr: Trainer, device: torch.device) -> int:
    """Peak memory of one training step: parameters, gradients, optimizer state, the batch,
    and everything the step allocates at its worst moment."""
    return peak_bytes(tr.step, device, tr.model, tr.opt, tr.x, tr.target)


def default_plan_budget(name: str, batch: int, image_size: int | None = None) -> int:
    """A whole-step budget that makes the planner checkpoint: the fused model's step peak as
    the planner predicts it (SGD with momentum, on the meta device) less half the activations
    its forward saves, or the smallest budget the planner can meet when that is less."""
    size, _ = model_input(name, image_size)
    with torch.device("meta"):
        model = models.MODELS[name](fused=True)
    shape = (batch, 3, size, size)
    unplanned = fusedres.memory.plan(model, shape, budget_bytes=2**62)
    target = max(1, unplanned.peak_bytes - unplanned.step.saved_after_forward // 2)
    try:
        fusedres.memory.plan(model, shape, budget_bytes=target)
    except fusedres.memory.planner.PlanError as e:
        return e.min_budget_bytes
    return target


def run_steps(names, batch: int, device: torch.device, *, variants=VARIANTS,
              layouts=("nchw",), plan_budget: int | None = None, warmup: int = 1,
              reps: int = 5, image_size: int | None = None, deadline: float | None = None,
              progress=None, on_model=None) -> list[dict]:
    """One row per (model, variant, layout), all of a model timed interleaved:
    ``images_per_s`` (batch / median step time) with the spread of the step times,
    ``peak_bytes`` / ``peak_reserved_bytes`` (:class:`~.measure.MemoryWindow` over the row's
    build, warm-up and, graphed, capture), ``saved_bytes``; the planner's choices for
    ``fused+plan`` (budget: ``plan_budget``, or :func:`default_plan_budget`: planned only when
    that variant is asked for); the ratios of :func:`best_plain_ratios`. ``warmup``: eager
    steps before the timed ones (a graphed row's warm-up and capture are its own).
    ``deadline``: no model starts, and no timing round of a started one, after it."""
    rows: list[dict] = []
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"model": name, "batch": batch, "variant": None,
                         "skipped": "time limit reached"})
            continue
        budget = None
        if "fused+plan" in variants:
            budget = plan_budget or default_plan_budget(name, batch, image_size)
        trainers, model_rows = {}, []
        for v in variants:
            for layout in layouts:
                if v in GRAPHED_VARIANTS and device.type != "cuda":
                    model_rows.append({"model": name, "batch": batch, "variant": v,
                                       "layout": layout, "skipped": "needs a CUDA device"})
                    continue
                try:
                    with MemoryWindow(device) as mem:
                        tr = build_variant(name, v, batch, device, plan_budget=budget,
                                           image_size=image_size, layout=layout)
                        tr.first_calls = tr.prepare(device)
                except fusedres.memory.planner.PlanError as e:
                    model_rows.append({"model": name, "batch": batch, "variant": v,
                                       "layout": layout,
                                       "skipped": f"planner: {str(e).splitlines()[0]}"})
                    continue
                tr.memory = mem
                trainers[v, layout] = tr
        try:
            times = time_interleaved({k: t.step for k, t in trainers.items()}, device,
                                     warmup=max(0, warmup - 1), reps=reps, deadline=deadline,
                                     on_round=progress.update if progress else None)
        except torch.cuda.OutOfMemoryError as e:
            trainers.clear()
            _free(device)
            rows.append({"model": name, "batch": batch, "variant": None,
                         "skipped": f"out of memory: {str(e).splitlines()[0]}"})
            continue
        for k, tr in trainers.items():
            stats = summarize(times[k])
            row = {"model": name, "batch": batch, **tr.info, **stats,
                   "images_per_s": batch / stats["median_s"],
                   "images_per_s_min": batch / stats["max_s"],
                   "images_per_s_max": batch / stats["min_s"],
                   "peak_bytes": tr.memory.peak_allocated,
                   "peak_reserved_bytes": tr.memory.peak_reserved}
            with fusedres.use_backend(tr.backend):
                row["saved_bytes"] = saved_bytes(tr.model, tr.x)
            model_rows.append(row)
        best_plain_ratios(model_rows)
        rows += model_rows
        if on_model is not None:
            on_model(model_rows)
        del trainers
        _free(device)
    return rows


def best_plain_ratios(model_rows: list[dict]) -> None:
    """Adds to the measured rows of one model (in place): ``time_ratio`` and ``peak_ratio``,
    the row's median step time and peak over those of the best plain row (the faster of the
    plain rows, one per layout timed), named by ``best_plain_layout``; and
    ``same_layout_time_ratio``, the time over the plain row of the row's own layout (None
    when that one did not run)."""
    measured = [r for r in model_rows if "median_s" in r]
    plain = {r["layout"]: r for r in measured if r["variant"] == "plain"}
    if not plain:
        return
    best = min(plain.values(), key=lambda r: r["median_s"])
    for r in measured:
        r["time_ratio"] = r["median_s"] / best["median_s"]
        r["peak_ratio"] = r["peak_bytes"] / best["peak_bytes"]
        r["best_plain_layout"] = best["layout"]
        same = plain.get(r["layout"])
        r["same_layout_time_ratio"] = r["median_s"] / same["median_s"] if same else None
    # A graphed row over the plain graphed row of its layout: both steps without the host.
    graphed = {r["layout"]: r for r in measured if r["variant"] == "plain+graph"}
    for r in measured:
        g = graphed.get(r["layout"]) if r["variant"] in GRAPHED_VARIANTS else None
        r["graphed_time_ratio"] = r["median_s"] / g["median_s"] if g else None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- output

def columns():
    return [Column("model", lambda r: r["model"].replace("preact_resnet", "ResNet-"),
                   right=False),
            Column("batch", "batch"), Column("variant", "variant", right=False),
            Column("layout", "layout", right=False),
            Column("backend", "backend", right=False),
            Column("images/s", "images_per_s", "{:.1f}"),
            Column("(min-max)", lambda r: (r["images_per_s_min"], r["images_per_s_max"]),
                   lambda v: f"{v[0]:.1f}-{v[1]:.1f}"),
            Column("ms", lambda r: r["median_s"] * 1e3, "{:.1f}"),
            Column("time x best plain", "time_ratio", "{:.2f}"),
            Column("x plain graphed", "graphed_time_ratio", "{:.2f}"),
            Column("peak", "peak_bytes", fmt_bytes),
            Column("reserved", "peak_reserved_bytes", fmt_bytes),
            Column("peak x best plain", "peak_ratio", "{:.2f}"),
            Column("saved", "saved_bytes", fmt_bytes),
            Column("plan", lambda r: (r["units_checkpointed"], r["plan_budget_bytes"],
                                      r["recompute_fraction"])
                   if "units_checkpointed" in r else None,
                   lambda v: f"{v[0]} units ckpt @ {fmt_bytes(v[1])}, +{v[2]:.0%} FLOPs")]


def plot(rows: list[dict], path, title: str) -> None:
    """Two panels, one group of bars per model: images/s and peak memory of each variant in
    each layout (channels_last bars hatched)."""
    plt = pyplot()
    rows = [r for r in rows if "median_s" in r]
    names = list(dict.fromkeys(r["model"] for r in rows))
    if not names:
        return
    series = [(v, layout) for v in ALL_VARIANTS for layout in LAYOUTS
              if any(r["variant"] == v and r.get("layout", "nchw") == layout for r in rows)]
    several = len({layout for _, layout in series}) > 1
    colors = dict(zip(ALL_VARIANTS, ("tab:gray", "tab:blue", "tab:green", "tab:orange",
                                     "tab:brown", "tab:purple")))
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.8 + 0.55 * len(names) * len(series) / 2))
    width = 0.8 / len(series)
    mem_scale, unit = mem_unit(max(r["peak_bytes"] for r in rows))
    for panel, (key, label, scale) in enumerate(
            (("images_per_s", "images/s (higher is better)", 1),
             ("peak_bytes", f"peak memory of the step, {unit}", mem_scale))):
        ax = axes[panel]
        for j, (v, layout) in enumerate(series):
            ys, xs = [], []
            for i, n in enumerate(names):
                r = next((r for r in rows if r["model"] == n and r["variant"] == v
                          and r.get("layout", "nchw") == layout), None)
                if r is not None:
                    ys.append(i + (j - (len(series) - 1) / 2) * width)
                    xs.append(r[key] / scale)
            cl = layout == "channels_last"
            bars = ax.barh(ys, xs, height=width, color=colors[v], hatch="///" if cl else None,
                           edgecolor="white" if cl else None,
                           label=f"{v} {layout}" if several else v)
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([n.replace("preact_resnet", "ResNet-") for n in names])
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.margins(x=0.18)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    # Below both panels, clear of the bars (saved with the tight bounding box).
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=min(len(series), 4), fontsize=8, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
