"""Memory of a training step: saved activations, live tensors, whole-step peak, planning.

The public face of :mod:`fusedres.memory.accounting` (the counting rules, the whole-step simulation)
and :mod:`fusedres.memory.planner` (where to checkpoint for a budget), of
:mod:`fusedres.memory.allocator` (glibc told to return freed memory; the process's resident set,
its baseline and the allocator's slack, which a CPU budget bounds) and of
:mod:`fusedres.memory.cuda_memory` (what the CUDA caching allocator reserves for a step; the
context and workspaces beside it). Imports run one way:
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
from .allocator import (
    IMPORT_BASELINE_BYTES,
    ProcessMemory,
    ResidentPeaks,
    allocator_slack_bytes,
    keep_freed_memory,
    peak_rss_bytes,
    release_freed_memory,
    released,
    reset_peak_rss,
    rss_bytes,
    rss_parts,
)
from .cuda_memory import (
    CUDA_CONTEXT_BYTES,
    CUDNN_WORKSPACE_BYTES,
    CachingAllocatorModel,
    CudaMemory,
    cublas_workspace_bytes,
    device_fit_warning,
    expandable_segments_enabled,
)
from .planner import MemoryPlan, PlanError, plan

__all__ = ["CUDA_BLOCK_BYTES", "CUDA_CONTEXT_BYTES", "CUDNN_WORKSPACE_BYTES",
           "CachingAllocatorModel", "CudaMemory", "IMPORT_BASELINE_BYTES", "LiveTensorTracker",
           "MemoryPlan", "PlanError", "ProcessMemory", "ResidentPeaks", "SavedTensor",
           "SavedTensorCounter", "StepMemory", "allocator_slack_bytes", "cpu_op_workspace_bytes",
           "cublas_workspace_bytes", "device_fit_warning", "expandable_segments_enabled",
           "keep_freed_memory", "peak_rss_bytes", "plan", "release_freed_memory", "released",
           "reset_peak_rss", "rss_bytes", "rss_parts", "saved_bytes", "saved_tensors",
           "simulate_step"]
