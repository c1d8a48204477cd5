"""The GPU check's first table: does the fused training step cost time, and what does it save?

Whole training steps of ResNet-164 and ResNet-1001 at batch 128 (``fusedres.apps.train``'s own
step: the trainer's fused SGD, float32 loss; :class:`~.step.Trainer`), in float32 and under
bf16 autocast, each row eager and replayed from a CUDA graph:

* ``plain``: plain PyTorch, NCHW; ``plain-cl``: plain PyTorch, channels_last (the faster of the
  two is *best plain*);
* ``ckpt-all``: plain NCHW with every residual unit checkpointed (timm's
  ``set_grad_checkpointing()``); ``ckpt-mem``: plain NCHW with the fewest units checkpointed
  (spread evenly) that bring its saved activations down to the fused model's, counted on the
  meta device (:func:`matched_checkpointing`): plain PyTorch at the fused step's memory;
* ``fused``: the fused model on the backend ``auto`` picks, NCHW.

Rows run in groups, each group's rows built one after the other (each in its own
:class:`~.measure.MemoryWindow`: peak allocated and reserved, a graph's pool included) and then
timed interleaved. The groups come in the order of importance (:func:`schedule`), so a time slot
that ends early cuts the least important: fused against plain in float32 on ResNet-164 eager,
then graphed, then ResNet-1001, then the checkpoint rows, then bf16. A group is not started
when the time it is expected to take (the last group's of the same model, or the first model's
scaled by depth) would pass the deadline. One-time costs are reported apart from the step
times: a row's first eager step over its median (the Triton JIT, cuDNN's and the allocator's
first-time work), a graph's capture, the matched-memory count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import fusedres
from fusedres import models
from fusedres.memory import saved_bytes

from .measure import MemoryWindow, graph_pool_bytes, summarize, time_interleaved
from .report import Column, fmt_bytes
from .step import Trainer, make_trainer

__all__ = ["Group", "VARIANTS", "matched_checkpointing", "run", "schedule", "summary_rows"]

# Row kinds: (name, plain or fused, layout, checkpointing).
VARIANTS = {"plain": (False, "nchw", None), "plain-cl": (False, "channels_last", None),
            "ckpt-all": (False, "nchw", True), "ckpt-mem": (False, "nchw", "matched"),
            "fused": (True, "nchw", None)}
MAIN = ("plain", "plain-cl", "fused")
CHECKPOINTED = ("ckpt-all", "ckpt-mem")
AMP = {"fp32": None, "bf16": torch.bfloat16}
MIN_REPS = 3  # samples a row keeps however close the deadline (a median of 3)


@dataclass(frozen=True)
class Group:
    """Rows timed together: one model, dtype and kind of step."""

    model: str
    amp: str  # a key of AMP
    graphed: bool
    variants: tuple[str, ...]

    @property
    def mode(self) -> str:
        return "graphed" if self.graphed else "eager"


def schedule(model_names, amps=("fp32", "bf16")) -> list[Group]:
    """The groups in the order they run, the most important first: per dtype, each model's
    plain/fused rows eager then graphed, then the checkpoint rows the same way."""
    out = []
    for amp in amps:
        for variants in (MAIN, CHECKPOINTED):
            for name in model_names:
                out += [Group(name, amp, graphed, variants) for graphed in (False, True)]
    return out


def _spread(n: int, m: int) -> list[bool]:
    """``m`` of ``n`` units chosen evenly: unit i when floor((i+1) m / n) > floor(i m / n)."""
    return [(i + 1) * m // n > i * m // n for i in range(n)]


def _unit_key(unit: torch.nn.Module) -> tuple:
    """What a unit's saved bytes depend on besides its input: its modules' kinds, parameter
    shapes and convolution strides (units alike in these save alike on alike inputs)."""
    return tuple((type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)),
                  getattr(m, "stride", None)) for m in unit.modules())


def _twin(name: str, fused: bool) -> torch.nn.Module | None:
    """A model with the same kinds of unit, two a stage (a CIFAR bottleneck ResNet of 9n+2
    layers: the one of 20), whose profile gives the units of ``name`` in seconds instead of
    minutes; None for the others (profiled whole)."""
    depth = int(name.replace("preact_resnet", ""))
    if depth < 164 or (depth - 2) % 9:
        return None
    return models.preact_resnet(20, fused=fused, block="bottleneck")


def unit_saved(name: str, shape, dtype, autocast: bool, fused: bool
               ) -> tuple[list[int], list[int], int]:
    """(saved bytes, input bytes) per unit of model ``name`` and the bytes the stem and head
    save, for a training step on ``shape`` (:func:`fusedres.memory.planner.profile_units`, on
    the meta device; fused models as the portable backend saves, which every fused backend
    shares). Deep CIFAR models are counted on their :func:`_twin`, each unit by its twin's
    alike one in the same stage position."""
    from fusedres.memory.planner import profile_units

    with torch.device("meta"):
        model = models.MODELS[name](fused=fused)
        twin = _twin(name, fused)
    with fusedres.use_backend("portable" if fused else "reference"):
        prof = profile_units(twin or model, shape, dtype, autocast=autocast, flops=False)
    base = prof.stem_bytes + prof.head_bytes
    if twin is None:
        return prof.saved, prof.input_bytes, base
    known = {}
    for u, saved, inp in zip(twin.units(), prof.saved, prof.input_bytes):
        known.setdefault(_unit_key(u), (saved, inp))
    pairs = [known[_unit_key(u)] for u in model.units()]
    return [a for a, _ in pairs], [b for _, b in pairs], base


def matched_checkpointing(name: str, batch: int, image_size: int, amp: str
                          ) -> tuple[list[tuple[int, int]], dict]:
    """The units of plain ``name`` to checkpoint so that its saved activations are at most the
    fused model's: the fewest (each on its own, spread evenly over the network) that do it (a
    checkpointed unit keeps only its input), counted by :func:`unit_saved`. Returns the unit
    ranges for ``set_grad_checkpointing`` and the figures (``ckpt_units``, ``units``,
    ``plain_saved``, ``fused_saved``, ``ckpt_saved``)."""
    dtype, autocast = (AMP[amp], True) if AMP[amp] is not None else (torch.float32, False)
    shape = (batch, 3, image_size, image_size)
    saved, inputs, base = unit_saved(name, shape, dtype, autocast, fused=False)
    f_saved, _, f_base = unit_saved(name, shape, dtype, autocast, fused=True)
    n, target = len(saved), f_base + sum(f_saved)
    for m in range(n + 1):
        chosen = _spread(n, m)
        total = base + sum(inputs[i] if c else saved[i] for i, c in enumerate(chosen))
        if total <= target or m == n:
            ranges = [(i, i + 1) for i, c in enumerate(chosen) if c]
            return ranges, {"ckpt_units": m, "units": n, "plain_saved": base + sum(saved),
                            "fused_saved": target, "ckpt_saved": total}
    raise AssertionError("unreachable: m == n returns")


def _trainer(group: Group, variant: str, batch: int, device, image_size: int, ranges,
             capture) -> Trainer:
    fused, layout, ckpt = VARIANTS[variant]
    return make_trainer(group.model, batch, device, fused=fused, layout=layout,
                        amp_dtype=AMP[group.amp], graphed=group.graphed,
                        checkpoint=ranges if ckpt == "matched" else ckpt,
                        image_size=image_size, capture=capture,
                        info={"variant": variant, "amp": group.amp, "mode": group.mode})


def _row_of(group: Group, variant: str, batch: int) -> dict:
    return {"model": group.model, "amp": group.amp, "mode": group.mode, "variant": variant,
            "batch": batch}


class _Estimates:
    """How long a group will take: the last group's time of the same model, else the last
    group's scaled by the models' depths (ResNet-1001 ~ 6x ResNet-164)."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.any: tuple[str, float] | None = None

    def add(self, model: str, seconds: float) -> None:
        self.last[model] = seconds
        self.any = (model, seconds)

    def of(self, model: str) -> float:
        if model in self.last:
            return self.last[model]
        if self.any is None:
            return 0.0
        other, seconds = self.any
        return seconds * _depth(model) / _depth(other)


def _depth(name: str) -> int:
    return int(name.replace("preact_resnet", ""))


def run(model_names, batch: int, device: torch.device, *, amps=("fp32", "bf16"),
        image_size: int | None = None, reps: int = 10, deadline: float | None = None,
        capture=None, on_group=None, now=time.monotonic) -> list[dict]:
    """Every group of :func:`schedule` that the deadline allows, in order; one row per
    (group, variant). A row has ``median_s`` (and the spread, :func:`~.measure.summarize`),
    ``images_per_s``, ``peak_bytes`` / ``peak_reserved_bytes`` (build, warm-up and capture),
    ``graph_pool_bytes`` (graphed: the graph's private pool), ``first_step_s`` (eager: the
    first call less the median), ``capture_s`` (graphed: the capture and first replay),
    ``saved_bytes`` (eager); or ``skipped`` with the reason. ``capture``: the CUDA graph
    capture's stand-in (CPU dry runs: graphed rows then run the captured function eagerly).
    ``on_group(rows)`` after each group."""
    image = image_size or 32
    rows: list[dict] = []
    est = _Estimates()
    matched: dict[tuple[str, str], tuple] = {}
    for group in schedule(model_names, amps):
        if deadline is not None and now() + est.of(group.model) > deadline:
            rows += [{**_row_of(group, v, batch), "skipped": "the time slot ended"}
                     for v in group.variants]
            continue
        t0 = now()
        ranges = None
        if "ckpt-mem" in group.variants:
            key = (group.model, group.amp)
            if key not in matched:
                t1 = time.perf_counter()
                found = matched_checkpointing(group.model, batch, image, group.amp)
                matched[key] = (*found, time.perf_counter() - t1)
            ranges = matched[key][0]
        group_rows = _run_group(group, batch, device, image, ranges, capture, reps, deadline,
                                now)
        for r in group_rows:
            if r["variant"] == "ckpt-mem" and "skipped" not in r:
                ranges, info, seconds = matched[group.model, group.amp]
                r.update(info, matching_s=seconds)
        est.add(group.model, now() - t0)
        rows += group_rows
        if on_group is not None:
            on_group(group_rows)
    return rows


def _run_group(group: Group, batch: int, device, image: int, ranges, capture, reps: int,
               deadline, now) -> list[dict]:
    trainers: dict[str, Trainer] = {}
    out: list[dict] = []
    for v in group.variants:
        row = _row_of(group, v, batch)
        try:
            with MemoryWindow(device) as mem:
                tr = _trainer(group, v, batch, device, image, ranges, capture)
                calls = tr.prepare(device)
        except torch.cuda.OutOfMemoryError as e:
            out.append({**row, "skipped": f"out of memory: {str(e).splitlines()[0]}"})
            _free(device)
            continue
        except RuntimeError as e:  # a capture that fails (e.g. an op torch cannot capture)
            out.append({**row, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
            _free(device)
            continue
        row.update(backend=tr.backend, layout=tr.info["layout"],
                   peak_bytes=mem.peak_allocated, peak_reserved_bytes=mem.peak_reserved)
        if group.graphed:
            row.update(capture_s=calls[-1],
                       graph_pool_bytes=graph_pool_bytes(tr.graphed.replay))
        else:
            row["first_step_s"] = calls[0]
        tr.row = row
        trainers[v] = tr
    if not trainers:
        return out
    times = time_interleaved({v: t.step for v, t in trainers.items()}, device, warmup=0,
                             reps=reps, deadline=deadline, min_reps=MIN_REPS, now=now)
    for v, tr in trainers.items():
        stats = summarize(times[v])
        row = {**tr.row, **stats, "images_per_s": batch / stats["median_s"]}
        if not group.graphed:
            row["first_step_s"] = max(0.0, row["first_step_s"] - stats["median_s"])
            with fusedres.use_backend(tr.backend), tr.train_step.autocast():
                row["saved_bytes"] = saved_bytes(tr.model, tr.x)
        out.append(row)
    order = {v: i for i, v in enumerate(group.variants)}
    out.sort(key=lambda r: order[r["variant"]])
    del trainers
    _free(device)
    return out


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the answer

def summary_rows(rows: list[dict]) -> list[dict]:
    """The answer per (model, dtype, mode), from the measured rows: the fused row against the
    best plain row (the faster of plain NCHW and channels_last) and against plain at the fused
    step's memory (``ckpt-mem``): ``time_x_best_plain``, ``peak_x_best_plain`` (fused /
    best plain), ``ckpt_mem_x_fused`` (that row's time / fused's: how much faster fused is at
    the same memory), ``peak_x_ckpt_mem`` (fused / that row's peak)."""
    measured = [r for r in rows if "median_s" in r]
    keys = list(dict.fromkeys((r["model"], r["amp"], r["mode"]) for r in measured))
    out = []
    for key in keys:
        of = {r["variant"]: r for r in measured if (r["model"], r["amp"], r["mode"]) == key}
        fused = of.get("fused")
        plain = [of[v] for v in ("plain", "plain-cl") if v in of]
        best = min(plain, key=lambda r: r["median_s"]) if plain else None
        ckpt = of.get("ckpt-mem")
        s = {"model": key[0], "amp": key[1], "mode": key[2],
             "fused_s": fused and fused["median_s"], "fused_peak": fused and fused["peak_bytes"],
             "best_plain": best and best["variant"], "best_plain_s": best and best["median_s"],
             "ckpt_mem_s": ckpt and ckpt["median_s"]}
        if fused and best:
            s["time_x_best_plain"] = fused["median_s"] / best["median_s"]
            s["peak_x_best_plain"] = fused["peak_bytes"] / best["peak_bytes"]
        if fused and ckpt:
            s["ckpt_mem_x_fused"] = ckpt["median_s"] / fused["median_s"]
            s["peak_x_ckpt_mem"] = fused["peak_bytes"] / ckpt["peak_bytes"]
        if fused or best or ckpt:
            out.append(s)
    return out


def _ms(key):
    return lambda r: None if r.get(key) is None else r[key] * 1e3


def _model(r: dict) -> str:
    return r["model"].replace("preact_resnet", "ResNet-")


def summary_columns() -> list[Column]:
    return [Column("model", _model, right=False), Column("dtype", "amp", right=False),
            Column("step", "mode", right=False),
            Column("fused ms", _ms("fused_s"), "{:.1f}"),
            Column("best plain ms", _ms("best_plain_s"), "{:.1f}"),
            Column("(which)", "best_plain", right=False),
            Column("fused time x best plain", "time_x_best_plain", "{:.2f}"),
            Column("fused peak x best plain", "peak_x_best_plain", "{:.2f}"),
            Column("ckpt at fused memory ms", _ms("ckpt_mem_s"), "{:.1f}"),
            Column("its time x fused", "ckpt_mem_x_fused", "{:.2f}"),
            Column("fused peak x its peak", "peak_x_ckpt_mem", "{:.2f}")]


def row_columns() -> list[Column]:
    return [Column("model", _model, right=False), Column("dtype", "amp", right=False),
            Column("step", "mode", right=False), Column("variant", "variant", right=False),
            Column("backend", "backend", right=False),
            Column("ms", _ms("median_s"), "{:.1f}"),
            Column("(min-max)", lambda r: (r["min_s"], r["max_s"]) if "min_s" in r else None,
                   lambda v: f"{v[0] * 1e3:.1f}-{v[1] * 1e3:.1f}"),
            Column("n", "reps"), Column("images/s", "images_per_s", "{:.0f}"),
            Column("peak alloc", "peak_bytes", fmt_bytes),
            Column("peak reserved", "peak_reserved_bytes", fmt_bytes),
            Column("graph pool", "graph_pool_bytes", fmt_bytes),
            Column("saved", "saved_bytes", fmt_bytes)]


def once_columns() -> list[Column]:
    return [Column("model", _model, right=False), Column("dtype", "amp", right=False),
            Column("step", "mode", right=False), Column("variant", "variant", right=False),
            Column("first step - median, s", "first_step_s", "{:.2f}"),
            Column("capture s", "capture_s", "{:.2f}"),
            Column("units ckpt", lambda r: (r["ckpt_units"], r["units"])
                   if "ckpt_units" in r else None, lambda v: f"{v[0]} of {v[1]}"),
            Column("counting s", "matching_s", "{:.1f}")]
