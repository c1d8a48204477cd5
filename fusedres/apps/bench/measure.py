"""Measuring: device-aware timing with interleaved order, peak memory of one step, statistics.

On CUDA a step is timed with CUDA events and its peak memory is ``torch.cuda.
max_memory_allocated``; on CPU the clock is ``time.perf_counter`` and the peak is that of live
tensor storages (:class:`fusedres.memory.LiveTensorTracker`), not the process RSS. Both peaks
mean the same thing: the bytes of the objects named (model, optimizer state, inputs) plus
everything the step allocates and holds at its worst moment.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Iterable
from typing import Callable

import torch

from fusedres.memory import LiveTensorTracker

__all__ = ["MemoryWindow", "graph_pool_bytes", "peak_bytes", "process_start", "resolve_device",
           "summarize", "sync", "time_interleaved"]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu. Raises ``ValueError`` naming
    ``--device`` when CUDA is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    return torch.device(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], object], device: torch.device,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call of ``fn``: CUDA events on a GPU, ``clock`` on CPU (the wall clock
    by default)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = clock()
    fn()
    return clock() - t0


def _repeated(fn: Callable[[], object], k: int) -> Callable[[], object]:
    """``fn`` called ``k`` times in a row (``fn`` itself when ``k`` is 1)."""
    if k == 1:
        return fn

    def run():
        for _ in range(k):
            fn()
    return run


def time_interleaved(steps: dict[str, Callable[[], object]], device: torch.device, *,
                     warmup: int, reps: int, on_round: Callable[[], None] | None = None,
                     min_sample_s: float = 0.0,
                     clock: Callable[[], float] = time.perf_counter,
                     deadline: float | None = None, min_reps: int = 1,
                     now: Callable[[], float] = time.monotonic) -> dict[str, list[float]]:
    """Time each of ``steps`` ``reps`` times, after ``warmup`` untimed calls each.

    Rounds interleave the candidates (A B C, then C B A, then B C A ...): a slow phase of a
    shared machine falls on all of them instead of on whichever ran during it. A sample is
    ``k`` consecutive calls of one candidate divided by ``k``, ``k`` the fewest calls lasting
    ``min_sample_s`` (from the last warm-up call's time; 1 when ``min_sample_s`` is 0): on a
    CPU a single millisecond call right after another candidate's runs with that candidate's
    data in the caches and its freed blocks in the allocator, which measured up to 2x slower
    than the same call in a training loop; a few calls in a row time the steady state.
    Returns the seconds per call of every sample per name; ``on_round`` is called after each
    round (progress). ``clock`` (CPU): ``time.thread_time`` times one thread's own CPU time,
    which other processes on a busy machine disturb less than the wall clock (single-threaded
    steps only: work on other threads is not counted).

    ``deadline`` (a value of ``now()``, ``time.monotonic`` by default): no round starts after it
    once every candidate has ``min_reps`` samples, so a time slot bounds the timing without
    leaving a candidate with fewer samples than its median needs.
    """
    names = list(steps)
    calls = {}
    for name in names:
        last = 0.0
        for _ in range(warmup):
            last = _time_once(steps[name], device, clock)
        if min_sample_s > 0 and warmup == 0:
            last = _time_once(steps[name], device, clock)
        calls[name] = 1
        if min_sample_s > 0 and last > 0:
            calls[name] = max(1, min(64, math.ceil(min_sample_s / last)))
        sync(device)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        if deadline is not None and r >= min_reps and now() > deadline:
            break
        shift = (r // 2) % len(names)
        order = names[shift:] + names[:shift]
        if r % 2:
            order.reverse()
        for name in order:
            k = calls[name]
            out[name].append(_time_once(_repeated(steps[name], k), device, clock) / k)
        if on_round is not None:
            on_round()
    return out


def summarize(times: Iterable[float]) -> dict[str, float]:
    """Median, quartiles (their difference is the IQR), minimum and maximum, in seconds."""
    ts = sorted(times)
    if not ts:
        raise ValueError("summarize: no times")
    if len(ts) >= 2:
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
    else:
        q1 = q3 = ts[0]
    return {"median_s": statistics.median(ts), "q25_s": q1, "q75_s": q3, "iqr_s": q3 - q1,
            "min_s": ts[0], "max_s": ts[-1], "reps": len(ts)}


def held_bytes(*objs) -> int:
    """Bytes of the distinct storages of ``objs`` (tensors, modules with their parameters,
    buffers and grads, optimizers' state), each storage once."""
    tracker = LiveTensorTracker()
    tracker.count(*(o for o in objs if o is not None))
    return tracker.current_bytes


def peak_bytes(step: Callable[[], object], device: torch.device, *held) -> int:
    """Peak memory of one call of ``step``: the bytes of ``held`` (model, optimizer, inputs)
    plus the most that the step allocated and held at once (``None`` in ``held`` is skipped).

    CUDA: ``max_memory_allocated`` during the step, less what was allocated before it, plus
    ``held``'s bytes (so other objects alive in the process do not count). CPU: the peak of
    :class:`~fusedres.memory.LiveTensorTracker` with ``held`` counted.
    """
    held = tuple(o for o in held if o is not None)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before + held_bytes(*held)
    with LiveTensorTracker() as live:
        live.count(*held)
        step()
    return live.peak_bytes


class MemoryWindow:
    """The memory of what runs inside the block, as a row's own: build a model, its optimizer
    and batch inside it, run its warm-up (and a CUDA graph's capture), and read
    ``peak_allocated`` / ``peak_reserved`` (bytes) after it.

    CUDA: the caching allocator's peak allocated and peak reserved bytes above what was
    allocated and reserved on entry. The cache is emptied on entry, so what other rows keep
    alive is in the entry figures and this block's blocks are new: the reserved figure is this
    block's own segments (a CUDA graph's private pool included), which a step after a warm-up
    on the same allocator would not show (a replay allocates nothing: its peak read after the
    capture would leave the pool out). ``allocated`` / ``reserved``: what the block still holds
    at its end. CPU: the peak of the live CPU tensor storages created inside
    (:class:`~fusedres.memory.LiveTensorTracker`; ``peak_reserved`` is None: no caching
    allocator to read)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_allocated = self.peak_reserved = self.allocated = self.reserved = None

    def __enter__(self) -> MemoryWindow:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._alloc0 = torch.cuda.memory_allocated(self.device)
            self._reserved0 = torch.cuda.memory_reserved(self.device)
        else:
            self._live = LiveTensorTracker(device_type=self.device.type).__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            d = self.device
            self.peak_allocated = torch.cuda.max_memory_allocated(d) - self._alloc0
            self.peak_reserved = torch.cuda.max_memory_reserved(d) - self._reserved0
            self.allocated = torch.cuda.memory_allocated(d) - self._alloc0
            self.reserved = torch.cuda.memory_reserved(d) - self._reserved0
        else:
            self._live.__exit__(*exc)
            self.peak_allocated = self._live.peak_bytes
            self.allocated = self._live.current_bytes
        return False


def graph_pool_bytes(replay) -> int | None:
    """Bytes the CUDA caching allocator reserved for the private memory pool of the graph whose
    ``replay`` (a ``torch.cuda.CUDAGraph.replay`` bound method) is given: the segments of the
    allocator's snapshot that belong to ``graph.pool()``. None when it cannot be read (not a
    CUDA graph: a CPU stand-in capture)."""
    graph = getattr(replay, "__self__", None)
    if not isinstance(graph, torch.cuda.CUDAGraph):
        return None
    pool = tuple(graph.pool())
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


def process_start(clock: Callable[[], float] = time.monotonic) -> float:
    """When this process started, on ``clock`` (``time.monotonic``, which Linux counts from
    boot as /proc does): the GPU check gives a report process its time slots in seconds from
    its start, and importing torch takes seconds of them. ``clock()`` where /proc cannot be
    read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return clock()
    return clock() - max(0.0, age)
