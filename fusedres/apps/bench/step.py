"""``fusedres bench step``: whole training steps (forward, cross-entropy, backward, SGD step) of
the zoo's models for plain / fused / fused + planner / plain + checkpointing, and on a GPU
plain and fused replayed from a CUDA graph (the trainer's ``--cuda-graphs`` step), each in every
memory layout asked for (NCHW, channels_last): images/s, peak memory of the step, saved
activations, and time and peak over the best plain row of the model (the faster of plain NCHW
and plain channels_last)."""

from __future__ import annotations

import gc
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedres
from fusedres import models
from fusedres.memory import saved_bytes

from .measure import peak_bytes, summarize, sync, time_interleaved
from .report import Column, fmt_bytes, mem_unit, pyplot

__all__ = ["ALL_VARIANTS", "GRAPHED_VARIANTS", "LAYOUTS", "VARIANTS", "build_variant",
           "default_layouts", "model_input", "run_steps"]

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
    """One variant of one model, with its optimizer and a fixed batch."""

    def __init__(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                 backend: str, info: dict):
        self.model, self.x, self.target, self.backend, self.info = model, x, target, backend, info
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with fusedres.use_backend(self.backend):
            F.cross_entropy(self.model(self.x), self.target).backward()
        self.opt.step()


class GraphedTrainer(Trainer):
    """:class:`Trainer` whose step is the trainer's, captured in a CUDA graph after its warm-up
    steps (made here, so that timing starts at the replays): fused SGD reading a device
    learning rate, cross-entropy in float32 (fusedres.apps.train.step)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                 backend: str, info: dict):
        from ..train import step as train_step

        self.model, self.x, self.target, self.backend, self.info = model, x, target, backend, info
        lr = train_step.lr_tensor(0.01, x.device)
        self.opt = train_step.sgd([{"params": list(model.parameters())}], lr, 0.9, False)
        scaler = torch.amp.GradScaler(x.device.type, enabled=False)
        self.graphed = train_step.GraphedStep(train_step.TrainStep(model, self.opt, scaler, None,
                                                                   x.device.type))
        for _ in range(self.graphed.warmup + 1):  # the warm-up, then the capture's first replay
            self.step()

    def step(self) -> None:
        with fusedres.use_backend(self.backend):
            self.graphed(self.x, self.target)


def fused_backend(device: torch.device) -> str:
    """The backend the fused variants run on: what ``auto`` picks for ``device``."""
    return fusedres.resolve_backend(device)


def build_variant(name: str, variant: str, batch: int, device: torch.device, *,
                  plan_budget: int | None = None, image_size: int | None = None,
                  depth: int | None = None, layout: str = "nchw") -> Trainer:
    """A :class:`Trainer` for ``variant`` of zoo model ``name`` (or of the CIFAR ResNet of
    ``depth`` bottleneck layers when ``depth`` is given), model and batch in ``layout``
    (``nchw`` or ``channels_last``: ``.to(memory_format=torch.channels_last)``). ``fused+plan``
    calls ``fusedres.memory.plan(model, input_shape, budget_bytes=plan_budget)``, which raises
    ``fusedres.memory.planner.PlanError`` when the budget cannot be met."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(ALL_VARIANTS)}, got {variant!r}")
    graphed = variant in GRAPHED_VARIANTS
    if graphed and device.type != "cuda":
        raise ValueError(f"variant: {variant} replays a CUDA graph and needs a CUDA device, "
                         f"got {device.type}")
    fmt = memory_format(layout)
    fused = variant.startswith("fused")
    torch.manual_seed(0)
    if depth is not None:
        model = models.preact_resnet(depth, fused=fused, block="bottleneck")
        size, classes = 32, 10
    else:
        model = models.MODELS[name](fused=fused)
        size, classes = model_input(name, image_size)
    model = model.to(device).to(memory_format=fmt)
    info: dict = {"variant": variant, "layout": layout}
    shape = (batch, 3, size, size)
    if variant == "fused+plan":
        if plan_budget is None:
            raise ValueError("plan_budget: needed for the fused+plan variant")
        plan = fusedres.memory.plan(model, shape, budget_bytes=plan_budget,
                                    channels_last=layout == "channels_last")
        info.update(plan_budget_bytes=int(plan_budget), units_checkpointed=plan.n_checkpointed,
                    segments=len(plan.segments), recompute_fraction=plan.recompute_fraction)
    elif variant == "plain+ckpt":
        model.set_grad_checkpointing(True)  # every unit its own segment (timm's default)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(device).contiguous(memory_format=fmt)
    target = torch.randint(0, classes, (batch,), generator=g).to(device)
    backend = fused_backend(device) if fused else "reference"
    info["backend"] = backend
    return (GraphedTrainer if graphed else Trainer)(model, x, target, backend, info)


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
    ``peak_bytes``, ``saved_bytes``; the planner's choices for ``fused+plan`` (budget:
    ``plan_budget``, or half the fused model's saved bytes); the ratios of
    :func:`best_plain_ratios`."""
    rows: list[dict] = []
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            rows.append({"model": name, "batch": batch, "variant": None,
                         "skipped": "time limit reached"})
            continue
        budget = plan_budget or default_plan_budget(name, batch, image_size)
        trainers, model_rows = {}, []
        for v in variants:
            for layout in layouts:
                if v in GRAPHED_VARIANTS and device.type != "cuda":
                    model_rows.append({"model": name, "batch": batch, "variant": v,
                                       "layout": layout, "skipped": "needs a CUDA device"})
                    continue
                try:
                    trainers[v, layout] = build_variant(name, v, batch, device,
                                                        plan_budget=budget,
                                                        image_size=image_size, layout=layout)
                except fusedres.memory.planner.PlanError as e:
                    model_rows.append({"model": name, "batch": batch, "variant": v,
                                       "layout": layout,
                                       "skipped": f"planner: {str(e).splitlines()[0]}"})
        try:
            times = time_interleaved({k: t.step for k, t in trainers.items()}, device,
                                     warmup=warmup, reps=reps,
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
                   "images_per_s_max": batch / stats["min_s"]}
            with fusedres.use_backend(tr.backend):
                row["saved_bytes"] = saved_bytes(tr.model, tr.x)
            row["peak_bytes"] = step_peak(tr, device)
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
