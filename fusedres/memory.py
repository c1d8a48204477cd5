"""Memory of a training step: saved activations, live tensors, whole-step peak, planning.

The public face of :mod:`fusedres.accounting` (the counting rules, the whole-step simulation)
and :mod:`fusedres.planner` (where to checkpoint for a budget), and of
:mod:`fusedres.allocator` (glibc told to return freed memory; the process's resident set, which
a budget bounds only with that). Imports run one way:
``accounting`` <- ``planner`` <- ``memory``; the trainer and the benchmarks read the same
accounting.

Counts, not timings: exact and the same on every machine, so tests can assert them.
"""

from __future__ import annotations

from .accounting import (
    CUDA_BLOCK_BYTES,
    LiveTensorTracker,
    SavedTensor,
    SavedTensorCounter,
    StepMemory,
    cpu_op_workspace_bytes,
    saved_bytes,
    saved_tensors,
    simulate_step,
)
from .allocator import (keep_freed_memory, peak_rss_bytes, release_freed_memory, reset_peak_rss,
                        rss_bytes)
from .planner import MemoryPlan, PlanError, plan

__all__ = ["CUDA_BLOCK_BYTES", "LiveTensorTracker", "MemoryPlan", "PlanError", "SavedTensor",
           "SavedTensorCounter", "StepMemory", "cpu_op_workspace_bytes", "keep_freed_memory",
           "peak_rss_bytes", "plan", "release_freed_memory", "reset_peak_rss", "rss_bytes",
           "saved_bytes", "saved_tensors", "simulate_step"]
