"""Memory planning: choose which residual units to checkpoint so one training step fits a budget.

The planner measures, for the given input shape and dtype, what every residual unit saves for
backward (a count of storages, :mod:`fusedres.memory`'s rule) and its forward FLOPs, on the
meta device by default (no real memory is touched, so ResNet-1001 at batch 128 plans on a
laptop). It then picks contiguous segments of units to checkpoint with
:mod:`fusedres.checkpoint` (BatchNorm-safe), minimising the recomputed FLOPs, and applies the
choice with ``model.set_grad_checkpointing(ranges)``.

What the budget bounds (all figures are bytes of saved activations, excluding parameters,
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

from . import _backend
from .memory import LiveTensorTracker, _storage_key, saved_bytes

__all__ = ["MemoryPlan", "PlanError", "UnitProfile", "measure_step", "plan", "profile_units"]

GiB = 2 ** 30


def _size(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.2f} MiB"


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
    """What :func:`plan` chose, and what it predicts. Bytes are saved-activation bytes."""

    budget_bytes: int
    segments: list[tuple[int, int]]
    n_units: int
    saved_bytes: int
    peak_bytes: int
    unplanned_bytes: int
    recompute_flops: int
    step_flops: int
    profile: UnitProfile = field(repr=False)

    @property
    def n_checkpointed(self) -> int:
        return sum(b - a for a, b in self.segments)

    @property
    def recompute_fraction(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def __str__(self) -> str:
        longest = max((b - a for a, b in self.segments), default=0)
        return "\n".join([
            f"memory plan for a budget of {_size(self.budget_bytes)}:",
            f"  checkpointed {self.n_checkpointed} of {self.n_units} units in "
            f"{len(self.segments)} segments (longest {longest} units)",
            f"  saved after forward {_size(self.saved_bytes)}, peak during backward "
            f"{_size(self.peak_bytes)} (without checkpointing {_size(self.unplanned_bytes)})",
            f"  recompute {self.recompute_flops / 1e9:.2f} GFLOP = "
            f"{100 * self.recompute_fraction:.1f}% of the step's {self.step_flops / 1e9:.2f} "
            f"GFLOP",
        ])


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
    ``module``; autograd saves them for backward (the biases' copies are not saved)."""
    return sum(m.weight.numel() * dtype.itemsize for m in module.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear)) and m.weight.dtype != dtype)


def profile_units(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "meta", autocast: bool = False) -> UnitProfile:
    """Measure every unit's saved bytes, input bytes and forward FLOPs for one training step on
    an input of ``input_shape`` in ``dtype`` (parameters cast to ``dtype`` too), on
    ``device`` (``"meta"``: no memory is allocated; the counts are exact storage sizes).
    The model itself is not modified: a copy of its parameters on ``device`` is used.

    ``autocast=True``: the step will run under ``torch.autocast(dtype=dtype)`` with float32
    parameters (autocast does not run on the meta device, so it is imitated): the conv and
    linear weights and the input are measured in ``dtype``, BatchNorm in float32, and
    autocast's ``dtype`` copies of the weights, which autograd saves, are added to each unit's
    count."""
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
        key = _storage_key(t)
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
        excluded = {_storage_key(t) for t in state.values()}
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
        state = _meta_state(model, device, dtype, autocast)
        with _backend.use_backend("reference"), counter:
            out = torch.func.functional_call(model, state, (_input(input_shape, device, dtype),))
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
    from .checkpoint import _RestoreBuffers

    with _RestoreBuffers([model]):
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


def plan(model: nn.Module, input_shape: Sequence[int], budget_bytes: int,
         dtype: torch.dtype = torch.float32, *, autocast: bool = False,
         device: str | torch.device = "meta", apply: bool = True,
         verbose: bool = False) -> MemoryPlan:
    """Choose where to checkpoint ``model`` so the saved activations of one training step on
    an input of ``input_shape`` (N, C, H, W) in ``dtype`` stay within ``budget_bytes``.

    ``dtype`` is the dtype of the activations: the count casts the parameters and the input to
    it (pure half-precision training). For training under ``torch.autocast`` pass the autocast
    dtype and ``autocast=True``: autocast's half copies of the weights, saved for backward,
    are then counted too (tests/test_planner.py checks the count against a real autocast step).

    The model must expose ``units()`` and ``set_grad_checkpointing(ranges)``, as
    :mod:`fusedres.models` do. Per-unit saved bytes and FLOPs are measured on ``device``
    (default meta: nothing is allocated). The choice minimises recomputed FLOPs subject to
    ``peak_bytes <= budget_bytes`` (see this module's docstring) and is applied to the model
    unless ``apply=False``. Returns a :class:`MemoryPlan` (``print`` it for a summary).

    Raises :class:`PlanError` (a ``ValueError``) naming the smallest budget the planner can
    meet when even checkpointing every unit does not fit.
    """
    if not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0 or math.isnan(
            budget_bytes):
        raise ValueError(f"budget_bytes: expected a positive number of bytes, got "
                         f"{budget_bytes!r}")
    if len(tuple(input_shape)) != 4:
        raise ValueError(f"input_shape: expected (N, C, H, W), got {tuple(input_shape)}")
    prof = profile_units(model, input_shape, dtype, device, autocast=autocast)
    unplanned = prof.total_saved
    if unplanned <= budget_bytes:
        chosen = ([], unplanned, unplanned, 0)
    else:
        best, min_peak = _choose(prof, int(budget_bytes))
        if best is None:
            raise PlanError(
                f"budget_bytes: {budget_bytes} bytes ({_size(budget_bytes)}) cannot be met for "
                f"input {tuple(input_shape)} in {dtype} even with every unit checkpointed; the "
                f"smallest budget that works is {min_peak} bytes ({_size(min_peak)}); without "
                f"checkpointing the step saves {unplanned} bytes ({_size(unplanned)})",
                min_peak)
        _, segs, saved, peak, cost = best
        chosen = (segs, saved, peak, cost)
    segs, saved, peak, cost = chosen
    result = MemoryPlan(int(budget_bytes), list(segs), len(prof.saved), saved, peak, unplanned,
                        cost, prof.step_flops, prof)
    if apply:
        model.set_grad_checkpointing(result.segments)
    if verbose:
        print(result)
    return result
