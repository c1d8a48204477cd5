"""Memory planning: choose which residual units to checkpoint so one training step fits a budget.

``budget_bytes`` bounds the peak of the whole training step on the device: parameters and
buffers, gradients, optimizer state, the batch, saved activations and the largest transient
(the segment recomputed during backward, the gradients in flight, the optimizer step's
temporaries, the evaluation forward at its batch size), plus the cpu backend's kernel
workspace and whatever the caller keeps resident (:mod:`fusedres.memory.accounting` itemises and
simulates it). ``activation_budget`` keeps the older, narrower meaning: saved activations only,
as described below. ``process=True`` (training on CPU) makes ``budget_bytes`` bound the
process instead: the peak of the memory it allocates above a baseline, the step's peak plus the
allocator's slack (:mod:`fusedres.memory.allocator`: glibc told to return freed memory, the
slack measured; the pages of mapped files, which the resident set also holds, are not bounded).
With ``predict_cuda`` the plan also replays the step through the CUDA caching allocator's
rules (:mod:`fusedres.memory.cuda_memory`): reserved memory with and without expandable segments,
and what the GPU holds beside it.

The planner measures, for the given input shape and dtype, what every residual unit saves for
backward (a count of storages, :mod:`fusedres.memory`'s rule) and its forward FLOPs, on the
meta device by default (no real memory is touched, so ResNet-1001 at batch 128 plans on a
laptop); a unit with stochastic depth saves its (N,) branch scale beside x, counted the same way
(N * 4 bytes in float32), and a checkpointed one redraws the same scale on recompute
(:func:`fusedres.memory.activation_checkpoint.checkpoint` preserves the RNG state). It then picks
contiguous segments of units to checkpoint with :mod:`fusedres.memory.activation_checkpoint`
(BatchNorm-safe), minimising the recomputed FLOPs, and applies the choice with
``model.set_grad_checkpointing(ranges)``.

The activation model the search uses (bytes of saved activations, excluding parameters,
gradients and the gradient of the activation flowing back):

* ``saved_bytes``: what is saved when the forward pass ends: every storage the stem, the head
  and the non-checkpointed units save, plus the input of each checkpointed segment.
* ``peak_bytes``: the most that is alive at once during the step. Backward recomputes one
  segment at a time, so while segment j is recomputed the live set is what was saved before
  it plus everything the segment saves. ``peak_bytes = max(saved_bytes, max_j (before_j +
  segment_j))``; the plan keeps ``peak_bytes <= budget``.
* ``recompute_flops``: forward FLOPs of the checkpointed units (each recomputed once), against
  ``step_flops``, the FLOPs of a plain forward plus backward (convolutions and matmuls, as
  ``torch.utils.flop_counter`` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .. import settings
from ..ops import _backend
from . import allocator, cuda_memory
from .accounting import (
    LiveTensorTracker,
    StepMemory,
    format_bytes,
    saved_bytes,
    simulate_step,
    storage_key,
)
from .activation_checkpoint import RestoreBuffers

__all__ = ["MemoryPlan", "PlanError", "UnitProfile", "measure_step", "plan", "profile_units"]

GiB = 2 ** 30


_size = format_bytes


class PlanError(ValueError):
    """The budget cannot be met; ``min_budget_bytes`` is the smallest one the planner meets."""

    def __init__(self, message: str, min_budget_bytes: int):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


@dataclass
class UnitProfile:
    """Per-unit measurements for one input shape and dtype.

    ``saved[i]``: bytes unit i saves for backward (its input included, when it saves it);
    ``input_bytes[i]``: bytes of unit i's input (what a segment starting at i keeps);
    ``flops[i]``: unit i's forward FLOPs. ``stem_bytes`` / ``head_bytes``: saved before the
    first unit / after the last. ``step_flops``: forward plus backward of the whole model.
    """

    saved: list[int]
    input_bytes: list[int]
    flops: list[int]
    stem_bytes: int
    head_bytes: int
    step_flops: int

    @property
    def total_saved(self) -> int:
        return self.stem_bytes + self.head_bytes + sum(self.saved)


@dataclass
class MemoryPlan:
    """What :func:`plan` chose, and what it predicts.

    ``budget_bytes``: the whole-step budget (None when only ``activation_budget_bytes`` was
    given). ``step``: the simulated whole step with the chosen checkpointing, itemised
    (:class:`fusedres.memory.accounting.StepMemory`); ``peak_bytes`` is its peak, the figure the
    budget bounds, unless ``process`` (a :class:`fusedres.memory.allocator.ProcessMemory`, with
    ``process=True``): then the budget bounds ``process.above_baseline``, the peak plus the
    allocator's slack (``budgeted_bytes`` is whichever applies). ``cuda_step``: the same step
    counted as the CUDA caching allocator would (what ``torch.cuda.max_memory_allocated``
    reports), when asked for; ``cuda``: its replay through the allocator's rules
    (:class:`fusedres.memory.cuda_memory.CudaMemory`: reserved memory, workspaces, the context).
    ``saved_bytes`` / ``activation_peak_bytes`` / ``unplanned_bytes``: saved activations after
    the forward, at their peak during backward, and without checkpointing (the activation
    model).
    """

    budget_bytes: int | None
    segments: list[tuple[int, int]]
    n_units: int
    saved_bytes: int
    activation_peak_bytes: int
    unplanned_bytes: int
    recompute_flops: int
    step_flops: int
    profile: UnitProfile = field(repr=False)
    step: StepMemory | None = None
    cuda_step: StepMemory | None = None
    activation_budget_bytes: int | None = None
    process: allocator.ProcessMemory | None = None
    cuda: cuda_memory.CudaMemory | None = None

    @property
    def budgeted_bytes(self) -> int:
        """The figure the budget bounds: the process above its baseline (``process=True``),
        else the step's peak."""
        return self.process.above_baseline if self.process is not None else self.peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Predicted peak of the whole training step (the activation peak when the step was
        not simulated)."""
        return self.step.peak_bytes if self.step is not None else self.activation_peak_bytes

    @property
    def n_checkpointed(self) -> int:
        return sum(b - a for a, b in self.segments)

    @property
    def recompute_fraction(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def __str__(self) -> str:
        longest = max((b - a for a, b in self.segments), default=0)
        if self.budget_bytes is not None and self.process is not None:
            head = (f"memory plan for a budget of {_size(self.budget_bytes)} (the memory the "
                    f"process allocates above its baseline):")
        elif self.budget_bytes is not None:
            head = f"memory plan for a budget of {_size(self.budget_bytes)} (whole step):"
        else:
            head = (f"memory plan for an activation budget of "
                    f"{_size(self.activation_budget_bytes)} (saved activations only):")
        lines = [
            head,
            f"  checkpointed {self.n_checkpointed} of {self.n_units} units in "
            f"{len(self.segments)} segments (longest {longest} units)",
            f"  saved activations after forward {_size(self.saved_bytes)}, at most "
            f"{_size(self.activation_peak_bytes)} during backward (without checkpointing "
            f"{_size(self.unplanned_bytes)})",
            f"  recompute {self.recompute_flops / 1e9:.2f} GFLOP = "
            f"{100 * self.recompute_fraction:.1f}% of the step's {self.step_flops / 1e9:.2f} "
            f"GFLOP",
        ]
        if self.step is not None:
            lines += ["  predicted " + line.strip() if i == 0 else "  " + line
                      for i, line in enumerate(self.step.lines())]
        if self.process is not None:
            lines += ["  predicted " + line.strip() if i == 0 else "  " + line
                      for i, line in enumerate(self.process.lines())]
        if self.cuda_step is not None and self.cuda is None:
            c = self.cuda_step
            lines.append(f"  predicted on a GPU (torch.cuda.max_memory_allocated; 512-byte "
                         f"blocks, no cuDNN/cuBLAS workspace): {_size(c.peak_bytes)} during the "
                         f"{c.phase}")
        if self.cuda is not None:
            lines += ["  predicted " + line.strip() if i == 0 else "  " + line
                      for i, line in enumerate(self.cuda.lines())]
        return "\n".join(lines)


# --------------------------------------------------------------------------- measurement

def _units_of(model: nn.Module) -> list[nn.Module]:
    if not (callable(getattr(model, "units", None))
            and callable(getattr(model, "set_grad_checkpointing", None))):
        raise TypeError(
            f"model: expected a model with units() and set_grad_checkpointing(ranges) (e.g. "
            f"fusedres.models.preact_resnet), got {type(model).__name__}")
    units = list(model.units())
    if not units:
        raise ValueError("model: units() is empty; there is nothing to checkpoint")
    return units


def _meta_state(model: nn.Module, device, dtype: torch.dtype,
                autocast: bool = False) -> dict[str, torch.Tensor]:
    """Empty copies of the parameters and buffers on ``device`` (floating ones in ``dtype``;
    with ``autocast`` only the conv and linear weights and biases, as autocast casts them)."""
    cast_names = None
    if autocast:
        cast_names = {f"{name}.{p}" if name else p
                      for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
                      for p in ("weight", "bias")}
    state = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        cast = t.is_floating_point() and (cast_names is None or name in cast_names)
        e = torch.empty(t.shape, dtype=dtype if cast else t.dtype, device=device)
        if device != torch.device("meta"):
            e.copy_(t.detach())  # real values for a real-device measurement
        if t.is_floating_point():
            e.requires_grad_(t.requires_grad)
        state[name] = e
    return state


def _input(input_shape, device, dtype) -> torch.Tensor:
    x = torch.empty(tuple(input_shape), dtype=dtype, device=device)
    if device != torch.device("meta"):
        x.normal_()
    return x


def _cast_weight_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the ``dtype`` copies autocast makes of the conv and linear weights of
    ``module``; autograd saves them for backward (the biases' copies are not saved). Not the
    weights of a unit's stacked shortcut and conv1 (``stacked_shortcut``): the one stacked
    copy is saved instead, and the imitated step already counts it."""
    stacked = {id(c) for m in module.modules() if getattr(m, "stacked_shortcut", False)
               for c in (m.shortcut, m.convs[0])}
    return sum(m.weight.numel() * dtype.itemsize for m in module.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear)) and m.weight.dtype != dtype
               and id(m) not in stacked)


def profile_units(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "meta", autocast: bool = False,
                  flops: bool = True) -> UnitProfile:
    """Measure every unit's saved bytes, input bytes and forward FLOPs for one training step on
    an input of ``input_shape`` in ``dtype`` (parameters cast to ``dtype`` too), on
    ``device`` (``"meta"``: no memory is allocated; the counts are exact storage sizes).
    The model itself is not modified: a copy of its parameters on ``device`` is used.

    ``autocast=True``: the step will run under ``torch.autocast(dtype=dtype)`` with float32
    parameters (autocast does not run on the meta device, so it is imitated): the conv and
    linear weights and the input are measured in ``dtype``, BatchNorm in float32, and
    autocast's ``dtype`` copies of the weights, which autograd saves, are added to each unit's
    count. ``flops=False`` leaves the FLOPs at 0 (they take a forward and backward under
    torch's FLOP counter, most of the time on a deep model)."""
    device = torch.device(device)
    units = _units_of(model)
    index = {id(u): i for i, u in enumerate(units)}
    n = len(units)
    saved, inputs, flops = [0] * n, [0] * n, [0] * n
    where = {"unit": None, "after": False}
    stem_head = [0, 0]
    seen: set[int] = set()
    kept: list[torch.Tensor] = []
    counter = FlopCounterMode(display=False)
    flops_at: dict[int, int] = {}

    def pre(mod, args):
        i = index[id(mod)]
        where["unit"] = i
        inputs[i] = args[0].untyped_storage().nbytes()
        flops_at[i] = counter.get_total_flops()

    def post(mod, args, out):
        i = index[id(mod)]
        where["unit"] = None
        where["after"] = i == n - 1
        flops[i] = counter.get_total_flops() - flops_at[i]

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        key = storage_key(t)
        if key in excluded or key in seen:
            return t
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        if where["unit"] is not None:
            saved[where["unit"]] += nbytes
        else:
            stem_head[1 if where["after"] else 0] += nbytes
        return t

    handles = [h for u in units for h in (u.register_forward_pre_hook(pre),
                                          u.register_forward_hook(post))]
    ranges = list(getattr(model, "checkpoint_ranges", []))
    was_training = model.training
    try:
        model.set_grad_checkpointing(0)
        model.train()
        # Pass 1: saved storages, with the backend in force (fused ops or plain modules). Every
        # fused backend saves the same tensors (the autograd rule is shared), so on the meta
        # device the portable one stands in for whichever will run.
        state = _meta_state(model, device, dtype, autocast)
        excluded = {storage_key(t) for t in state.values()}
        name = _backend.get_backend()
        if device.type == "meta" and name not in ("reference", "auto"):
            name = "portable"
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                _backend.use_backend(name):
            out = torch.func.functional_call(model, state, (_input(input_shape, device,
                                                                   dtype),))
        del out
        kept.clear()
        # Pass 2: FLOPs of the plain computation (the fused op does the same convolutions).
        step_flops = 0
        if flops:
            state = _meta_state(model, device, dtype, autocast)
            with _backend.use_backend("reference"), counter:
                out = torch.func.functional_call(model, state,
                                                 (_input(input_shape, device, dtype),))
                out.float().sum().backward()
            step_flops = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
        model.set_grad_checkpointing(ranges)
        model.train(was_training)
    if autocast:
        for i, u in enumerate(units):
            saved[i] += _cast_weight_bytes(u, dtype)
        in_units = sum(_cast_weight_bytes(u, dtype) for u in units)
        # Weights outside the units: the stem before them, the head after them.
        rest = _cast_weight_bytes(model, dtype) - in_units
        head = _cast_weight_bytes(model.get_classifier(), dtype) if callable(
            getattr(model, "get_classifier", None)) else 0
        stem_head[0] += rest - head
        stem_head[1] += head
    return UnitProfile(saved, inputs, flops, stem_head[0], stem_head[1], step_flops)


def measure_step(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Run one training step (forward, ``sum`` loss, backward) of ``model`` on ``x`` and
    measure memory by storage, on any device (meta included):

    ``saved``: bytes saved for backward when the forward ends (:func:`fusedres.memory.
    saved_bytes`'s count, checkpointed segments' inputs included); ``peak``: the most bytes of
    tensors created during the step alive at once (activations, recomputed activations,
    gradients, temporaries visible between ops), parameters and ``x`` excluded; ``grads``:
    bytes of the parameter gradients (alive at the end, part of ``peak``).

    ``saved`` comes from a separate forward whose buffer updates are undone (saved-tensor hooks
    keep what they saw alive until the graph dies, which would distort ``peak``); the step that
    ``peak`` measures is the only one that counts for the running statistics.
    """
    with RestoreBuffers([model]):
        saved = saved_bytes(model, x)
    for p in model.parameters():
        p.grad = None
    live = LiveTensorTracker()
    with live:
        model(x).float().sum().backward()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                if p.grad is not None)
    return {"saved": saved, "peak": live.peak_bytes, "grads": grads}


# --------------------------------------------------------------------------- choice

def _evaluate(p: UnitProfile, chosen: Sequence[bool], limit: int):
    """Segments formed from runs of chosen units, each at most ``limit`` saved bytes (at least
    one unit); returns (segments, saved_after_forward, peak)."""
    segments: list[tuple[int, int]] = []
    n = len(chosen)
    i = 0
    while i < n:
        if not chosen[i]:
            i += 1
            continue
        start, total = i, p.saved[i]
        i += 1
        while i < n and chosen[i] and total + p.saved[i] <= limit:
            total += p.saved[i]
            i += 1
        segments.append((start, i))
    before = p.stem_bytes
    peak = 0
    seg_iter = iter(segments)
    seg = next(seg_iter, None)
    i = 0
    while i < n:
        if seg is not None and i == seg[0]:
            peak = max(peak, before + sum(p.saved[seg[0]:seg[1]]))
            before += p.input_bytes[seg[0]]
            i = seg[1]
            seg = next(seg_iter, None)
        else:
            before += p.saved[i]
            i += 1
    saved = before + p.head_bytes
    return segments, saved, max(peak, saved)


def _choose(p: UnitProfile, budget: int):
    n = len(p.saved)
    # Checkpoint first the units that free the most memory per recomputed FLOP.
    order = sorted(range(n), key=lambda i: (-p.saved[i] / max(p.flops[i], 1), i))
    lo_s, hi_s = max(min(p.saved), 1), max(sum(p.saved), 1)
    steps = 48
    limits = sorted({int(lo_s * (hi_s / lo_s) ** (k / steps)) for k in range(steps + 1)})
    best = None
    min_peak = None
    for limit in limits:
        def feasible(m, limit=limit):
            chosen = [False] * n
            for i in order[:m]:
                chosen[i] = True
            return _evaluate(p, chosen, limit), chosen

        (segs, saved, peak), chosen = feasible(n)
        min_peak = peak if min_peak is None else min(min_peak, peak)
        if peak > budget:
            continue
        lo, hi = 0, n  # smallest m that fits (fitting is monotone in m in practice)
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(mid)[0][2] <= budget:
                hi = mid
            else:
                lo = mid + 1
        (segs, saved, peak), chosen = feasible(lo)
        cost = sum(p.flops[i] for i in range(n) if chosen[i])
        key = (cost, peak)
        if best is None or key < best[0]:
            best = (key, segs, saved, peak, cost)
    return best, min_peak



def _min_peak_segments(p: UnitProfile):
    """The segments of the smallest activation peak the search can reach."""
    n = len(p.saved)
    order = sorted(range(n), key=lambda i: (-p.saved[i] / max(p.flops[i], 1), i))
    lo_s, hi_s = max(min(p.saved), 1), max(sum(p.saved), 1)
    steps = 48
    best = None
    for limit in sorted({int(lo_s * (hi_s / lo_s) ** (k / steps)) for k in range(steps + 1)}):
        chosen = [False] * n
        for i in order:
            chosen[i] = True
        segs, saved, peak = _evaluate(p, chosen, limit)
        if best is None or peak < best[2]:
            best = (segs, saved, peak, sum(p.flops))
    return best


def _activation_choice(prof: UnitProfile, budget: int):
    """(segments, saved, activation peak, recompute flops) for an activation budget, or None."""
    if prof.total_saved <= budget:
        return [], prof.total_saved, prof.total_saved, 0
    best, _ = _choose(prof, int(budget))
    if best is None:
        return None
    _, segs, saved, peak, cost = best
    return list(segs), saved, peak, cost


def _fit_step(prof: UnitProfile, budget: int, act_cap: float, choice, simulate, total,
              what: str, process: bool):
    """The checkpoint choice whose simulated step fits ``budget`` (the step's peak, or the
    process's with ``process``), starting from ``choice`` (the activation budget's, or None:
    no checkpointing): (choice, its simulated step). Raises :class:`PlanError` naming the
    smallest budget that works when even checkpointing every unit does not fit."""
    unplanned = prof.total_saved
    first = choice if choice is not None else ([], unplanned, unplanned, 0)
    step = simulate(first[0])
    if total(step) > budget:
        # Saved activations get what the rest of the step leaves; the simulation checks
        # each choice and the shortfall tightens the next one.
        target = min(act_cap, first[2] - (total(step) - budget))
        choice = None
        for _ in range(8):
            if target <= 0:
                break
            c = _activation_choice(prof, target)
            if c is None:
                break
            s = simulate(c[0])
            if total(s) <= budget:
                choice, step = c, s
                break
            target = min(target - (total(s) - budget) - (budget >> 10), c[2] - 1)
        if choice is None:
            c = _min_peak_segments(prof)
            s = simulate(c[0])
            if total(s) > budget or c[2] > act_cap:
                smallest = total(s)
                slack = (f" (the step's {_size(s.peak_bytes)} + the allocator's slack "
                         f"{_size(smallest - s.peak_bytes)})" if process else "")
                raise PlanError(
                    f"budget_bytes: {budget} bytes ({_size(budget)}) cannot be met for "
                    f"{what}; the smallest budget that works is {smallest} bytes "
                    f"({_size(smallest)}){slack}, with every unit checkpointed; without "
                    f"checkpointing the step peaks at {_size(step.peak_bytes)} "
                    + ("(the eval forward, which checkpointing does not shrink, is the "
                       "peak: a smaller eval batch lowers it: " if s.phase == "eval forward"
                       else f"(the {s.phase} is the peak: ") + "; ".join(
                        " ".join(line.split()) for line in s.lines()[1:]) + ")",
                    smallest)
            choice, step = c, s
    else:
        choice = first
    return choice, step


def _check_plan_args(input_shape, budget_bytes, activation_budget, eval_batch_size, process,
                     baseline_bytes, cuda_capability, optimizer) -> None:
    """:func:`plan`'s arguments, checked before anything is set."""
    for name, value in (("budget_bytes", budget_bytes), ("activation_budget", activation_budget)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or math.isnan(value) or value <= 0):
            raise ValueError(f"{name}: expected a positive number of bytes, got {value!r}")
    if budget_bytes is None and activation_budget is None:
        raise ValueError("budget_bytes: give budget_bytes (whole step) or activation_budget "
                         "(saved activations only)")
    if len(tuple(input_shape)) != 4:
        raise ValueError(f"input_shape: expected (N, C, H, W), got {tuple(input_shape)}")
    if eval_batch_size is not None and (not isinstance(eval_batch_size, int)
                                        or eval_batch_size <= 0):
        raise ValueError(f"eval_batch_size: expected a positive int, got {eval_batch_size!r}")
    if not isinstance(process, bool):
        raise TypeError(f"process: expected True or False, got {process!r}")
    if process and budget_bytes is None:
        raise ValueError("process: bounds the process with budget_bytes; give budget_bytes")
    if baseline_bytes is not None and (isinstance(baseline_bytes, bool)
                                       or not isinstance(baseline_bytes, int)
                                       or baseline_bytes < 0):
        raise ValueError(f"baseline_bytes: expected a non-negative int or None, got "
                         f"{baseline_bytes!r}")
    if baseline_bytes is not None and not process:
        raise ValueError("baseline_bytes: only with process=True")
    if (not isinstance(cuda_capability, (tuple, list)) or len(cuda_capability) != 2
            or not all(isinstance(v, int) and v >= 0 for v in cuda_capability)):
        raise ValueError(f"cuda_capability: expected (major, minor), e.g. (9, 0), got "
                         f"{cuda_capability!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}")


def plan(model: nn.Module, input_shape: Sequence[int], budget_bytes: int | None = None,
         dtype: torch.dtype = torch.float32, *, autocast: bool = False,
         activation_budget: int | None = None, optimizer: torch.optim.Optimizer | None = None,
         eval_batch_size: int | None = None, resident_bytes: int = 0,
         channels_last: bool = False, predict_cuda: bool = True,
         process: bool = False, baseline_bytes: int | None = None,
         cuda_capability: tuple[int, int] = (9, 0),
         device: str | torch.device = "meta", apply: bool = True,
         verbose: bool = False) -> MemoryPlan:
    """Choose where to checkpoint ``model`` so that one whole training step on an input of
    ``input_shape`` (N, C, H, W) peaks at no more than ``budget_bytes``.

    The peak bounded is the device's: parameters and buffers, gradients, the state of
    ``optimizer`` (any ``torch.optim`` optimizer, simulated by class and hyperparameters; None:
    SGD with momentum, as the trainer), the batch, saved activations and the largest transient
    (the recomputed segment, gradients in flight, the optimizer step, the evaluation forward at
    ``eval_batch_size`` when given), the cpu backend's kernel workspace, and
    ``resident_bytes`` the caller keeps on the device (e.g. a dataset). The step is simulated on
    fake tensors (:func:`fusedres.memory.accounting.simulate_step`), so the prediction is the peak
    :class:`fusedres.memory.LiveTensorTracker` measures on the real step.

    ``activation_budget``: instead of (or with) ``budget_bytes``, bound only the saved
    activations alive at once, the planner's older meaning.

    ``dtype`` is the dtype of the activations: the count casts the parameters and the input to
    it (pure half-precision training). For training under ``torch.autocast`` pass the autocast
    dtype and ``autocast=True``. ``predict_cuda``: also simulate the step as the CUDA caching
    allocator counts it (``plan.cuda_step``) and replay it through the allocator's rules
    (``plan.cuda``, a :class:`fusedres.memory.CudaMemory`: ``max_memory_allocated`` and
    ``max_memory_reserved`` with and without ``expandable_segments``, cuBLAS's workspace for a
    GPU of compute capability ``cuda_capability``, cuDNN's allowance and the CUDA context).

    ``process=True`` (training on CPU): ``budget_bytes`` bounds the process instead, the peak
    of the memory it allocates above ``baseline_bytes`` (:class:`fusedres.memory.ResidentPeaks`
    measures it): the step's peak as above (the tensors, the kernel
    workspace, ``resident_bytes``) plus the allocator's slack
    (:func:`fusedres.memory.allocator_slack_bytes`, measured). The plan first calls
    :func:`fusedres.memory.release_freed_memory` (glibc returns freed blocks; without it the
    slack is larger and only estimated; ``FUSEDRES_RELEASE_FREED_MEMORY=0`` leaves glibc
    alone): make the plan before the data and the model allocate, as the trainer does.
    ``baseline_bytes``: the resident set the budget counts from, reported with the prediction
    (``plan.process``); None: ``fusedres.memory.IMPORT_BASELINE_BYTES``, a fresh process that
    has imported torch and fusedres; ``fusedres.memory.rss_bytes()`` taken before the data and
    the model exist: this process's own.

    The model must expose ``units()`` and ``set_grad_checkpointing(ranges)``, as
    :mod:`fusedres.models` do. The choice minimises recomputed FLOPs and is applied to the model
    unless ``apply=False``. Returns a :class:`MemoryPlan` (``print`` it for the itemised plan).

    Raises :class:`PlanError` (a ``ValueError``) naming the smallest budget the planner can meet
    (``min_budget_bytes``) when even checkpointing every unit does not fit.
    """
    _check_plan_args(input_shape, budget_bytes, activation_budget, eval_batch_size, process,
                     baseline_bytes, cuda_capability, optimizer)
    _units_of(model)  # a model the planner cannot work on fails here, before anything is set
    released, allocator_note = False, "not asked"
    if process:
        # The slack model holds with glibc's thresholds set; set them before anything here
        # allocates (the caller's data and model should come after the plan, too).
        if settings.get("FUSEDRES_RELEASE_FREED_MEMORY"):
            released, allocator_note = allocator.release_freed_memory()
        else:
            released, allocator_note = allocator.released(), "FUSEDRES_RELEASE_FREED_MEMORY=0"
    prof = profile_units(model, input_shape, dtype, device, autocast=autocast)
    unplanned = prof.total_saved
    ranges = list(getattr(model, "checkpoint_ranges", []))
    sim_kwargs = dict(amp_dtype=dtype if autocast else None,
                      param_dtype=None if autocast or dtype == torch.float32 else dtype,
                      optimizer=optimizer, eval_batch_size=eval_batch_size,
                      channels_last=channels_last, resident_bytes=resident_bytes)

    def simulate(segs, cuda=False) -> StepMemory:
        model.set_grad_checkpointing(list(segs))
        try:
            return simulate_step(model, input_shape, cuda_rules=cuda, **sim_kwargs)
        finally:
            model.set_grad_checkpointing(ranges)

    def total(s: StepMemory) -> int:
        """What the budget bounds: the step's peak, plus the allocator's slack (process)."""
        if not process:
            return s.peak_bytes
        return s.peak_bytes + allocator.allocator_slack_bytes(s.peak_bytes, len(prof.saved),
                                                              released)

    what = f"input {tuple(input_shape)} in {dtype}" + (" autocast" if autocast else "")
    act_cap = activation_budget if activation_budget is not None else float("inf")
    choice = step = None
    if activation_budget is not None:
        choice = _activation_choice(prof, int(activation_budget))
        if choice is None:
            smallest = _min_peak_segments(prof)[2]
            raise PlanError(
                f"activation_budget: {activation_budget} bytes ({_size(activation_budget)}) "
                f"cannot be met for {what} even with every unit checkpointed; the smallest "
                f"activation budget that works is {smallest} bytes ({_size(smallest)})",
                smallest)
    if budget_bytes is not None:
        choice, step = _fit_step(prof, int(budget_bytes), act_cap, choice, simulate, total,
                                 what, process)
    segs, saved, peak, cost = choice
    if step is None:
        step = simulate(segs)
    cuda_step = simulate(segs, cuda=True) if predict_cuda else None
    cuda = (None if cuda_step is None
            else cuda_memory.predict(cuda_step.events, resident_bytes=resident_bytes,
                                     capability=tuple(cuda_capability)))
    proc = None
    if process:
        proc = allocator.ProcessMemory(
            baseline=allocator.IMPORT_BASELINE_BYTES if baseline_bytes is None
            else baseline_bytes,
            baseline_source="torch and fusedres imported" if baseline_bytes is None
            else "this process, measured",
            tensors=step.peak_bytes, slack=total(step) - step.peak_bytes, released=released,
            allocator=allocator_note)
    result = MemoryPlan(None if budget_bytes is None else int(budget_bytes), list(segs),
                        len(prof.saved), saved, peak, unplanned, cost, prof.step_flops, prof,
                        step, cuda_step,
                        None if activation_budget is None else int(activation_budget), proc,
                        cuda)
    if apply:
        model.set_grad_checkpointing(result.segments)
    if verbose:
        print(result)
    return result
