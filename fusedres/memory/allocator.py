"""The process's memory as the system sees it: glibc's allocator told to hand freed blocks back,
and the resident set (current and peak) read from Linux.

Why: a budget planned over live tensors (:mod:`fusedres.memory.planner`) bounds the process only if
freed memory leaves it. glibc's malloc serves large blocks with mmap, but its threshold is
dynamic: once a block of size s is freed it raises the threshold to s (and the trim threshold
to 2s), so later blocks of that size come from the heap and stay resident after ``free``. A
training step frees and reallocates activations of every size each step; the process then
holds the freed blocks as well as the live ones. Setting both thresholds explicitly turns the
dynamic adjustment off (``mallopt(3)``).
"""

from __future__ import annotations

import ctypes
import os
import resource
from dataclasses import dataclass

__all__ = ["IMPORT_BASELINE_BYTES", "MMAP_THRESHOLD_BYTES", "SLACK_BYTES",
           "SLACK_BYTES_PER_UNIT", "SLACK_FRACTION", "SLACK_FRACTION_UNRELEASED",
           "TRIM_THRESHOLD_BYTES", "ProcessMemory", "ResidentPeaks", "allocator_slack_bytes",
           "keep_freed_memory", "peak_rss_bytes", "release_freed_memory", "released",
           "reset_peak_rss", "rss_bytes", "rss_parts"]

MiB = 2 ** 20

# glibc's malloc.h: #define M_TRIM_THRESHOLD -1, #define M_MMAP_THRESHOLD -3.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's malloc.h: #define M_MMAP_MAX -4; its default, DEFAULT_MMAP_MAX (malloc.c).
_M_MMAP_MAX, _GLIBC_MMAP_MAX = -4, 65536
# Blocks of 64 KiB and up are mmapped (unmapped at free); the heap's top is given back once
# 128 KiB of it is free (glibc's own starting values are 128 KiB and 256 KiB).
MMAP_THRESHOLD_BYTES = 64 * 2 ** 10
TRIM_THRESHOLD_BYTES = 128 * 2 ** 10

_applied = False
_kept = False  # keep_freed_memory() applied

# The process a budget counts from, and what it holds beyond the step's tensors
# (benchmarks/MEMORY.md, "The process under a CPU budget", has the runs behind each figure).
#
# IMPORT_BASELINE_BYTES: VmRSS of a fresh ``python -c "import torch, fusedres"`` on the machine
# the figures were taken on (torch 2.14.1+cu130, Python 3.11, glibc 2.36; the CUDA build of
# torch maps its CUDA libraries whether or not a GPU is there). Another build or machine has
# another baseline: pass the process's own (``rss_bytes()``) where it matters.
IMPORT_BASELINE_BYTES = 658 * MiB
# The slack under a budget, with the thresholds above set: the peak resident set above the
# baseline minus the step's predicted peak (tensors, the cpu backend's workspace, the data),
# over trainer runs of several sizes (tools/tables/process_memory.py), bounded by three terms:
# a constant (code paged in at the first step, oneDNN's and OpenMP's per-thread state), a
# share per residual unit (the model's Python objects, the autograd graph, what planning it
# leaves in Python's arenas: ResNet-1001's 333 units hold ~70 MiB of them before the first
# step, ResNet-164's 54 units ~20 MiB) and a share of the step's peak (blocks under the mmap
# threshold on the heap, page rounding).
# The constant: 22 MiB bounded the developer machine's runs; a clean clone's CI run of the same
# ResNet-20 test measured 36.5 MiB of slack (its baseline 875 MiB against 661 here: more of the
# libraries resident, more of their pages touched in the first step), so 40 MiB.
SLACK_BYTES = 40 * MiB
SLACK_BYTES_PER_UNIT = 192 * 2 ** 10
SLACK_FRACTION = 0.005
# Without the thresholds (release_freed_memory not applied) glibc keeps freed blocks resident
# and serves later requests from them: the slack then grows with what the step frees, from
# 0.5x to 1.44x the step's peak in the runs measured. An estimate: the largest seen, rounded up.
SLACK_FRACTION_UNRELEASED = 1.5


def released() -> bool:
    """Whether :func:`release_freed_memory` has set glibc's thresholds in this process."""
    return _applied


def allocator_slack_bytes(tensor_bytes: int, units: int = 0, released: bool = True) -> int:
    """Predicted resident bytes beyond ``tensor_bytes`` (a training step's predicted peak of
    tensors and kernel workspace) that a process training a model of ``units`` residual units
    holds at its peak: ``SLACK_BYTES + SLACK_BYTES_PER_UNIT * units + SLACK_FRACTION *
    tensor_bytes`` with glibc's thresholds set (``released``); else ``SLACK_FRACTION_UNRELEASED
    * tensor_bytes`` more (an estimate: glibc then keeps freed blocks)."""
    for name, value in (("tensor_bytes", tensor_bytes), ("units", units)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    fraction = SLACK_FRACTION if released else SLACK_FRACTION + SLACK_FRACTION_UNRELEASED
    return int(SLACK_BYTES + SLACK_BYTES_PER_UNIT * units + fraction * tensor_bytes)


@dataclass
class ProcessMemory:
    """The process under a CPU budget, predicted (bytes).

    ``baseline``: the resident set the budget counts from (a process that has imported torch
    and fusedres); ``tensors``: the training step's predicted peak (tensors, the cpu backend's
    workspace, the data kept resident: :attr:`fusedres.memory.MemoryPlan.peak_bytes`);
    ``slack``: the allocator's (:func:`allocator_slack_bytes`). ``above_baseline`` (tensors +
    slack) is the figure a budget bounds and the trainer measures (the peak of the memory the
    process allocates above the baseline's: :class:`ResidentPeaks`); ``total`` adds the
    baseline. ``released``/``allocator``: whether glibc was told
    to return freed memory, and what :func:`release_freed_memory` said."""

    baseline: int
    baseline_source: str
    tensors: int
    slack: int
    released: bool
    allocator: str

    @property
    def above_baseline(self) -> int:
        return self.tensors + self.slack

    @property
    def total(self) -> int:
        return self.baseline + self.above_baseline

    def lines(self) -> list[str]:
        from .accounting import format_bytes as size

        terms = [(f"baseline ({self.baseline_source})", self.baseline),
                 ("the step's peak (above)", self.tensors),
                 ("allocator slack (predicted)", self.slack)]
        out = [f"process peak {size(self.total)}, {size(self.above_baseline)} above the "
               f"baseline (the figure the budget bounds):"]
        out += [f"  {name:<44} {size(n):>12}" for name, n in terms]
        if not self.released:
            out.append(f"  freed memory is not returned to the system ({self.allocator}): "
                       f"the slack is an estimate")
        return out


def _glibc_version() -> str | None:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"; absent or None elsewhere
    except (AttributeError, ValueError, OSError):
        return None


def _mallopt(env_vars: tuple[str, ...], settings) -> tuple[bool, str]:
    """Apply ``settings`` ((param, value, name), ...) with glibc's ``mallopt``, in order.
    ``(True, glibc's version)``, or ``(False, why not)``: the environment sets one of
    ``env_vars`` (the user's choice is kept), not glibc, no ``mallopt``, or a call refused."""
    own = [v for v in env_vars if v in os.environ]
    if own:
        return False, f"the environment sets {', '.join(own)}: glibc keeps those"
    version = _glibc_version()
    if not version or not version.startswith("glibc"):
        return False, "not glibc (mallopt's settings are glibc's)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:
        return False, f"mallopt not found ({e})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, value, name in settings:
        if mallopt(param, value) != 1:  # mallopt returns 1 on success
            return False, f"mallopt({name}, {value}) failed"
    return True, version


def release_freed_memory() -> tuple[bool, str]:
    """Make glibc return freed memory to the system: ``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` and
    ``mallopt(M_TRIM_THRESHOLD, 128 KiB)``, which also turn off its dynamic thresholds.

    Affects blocks allocated from now on (allocate the model after calling it), for the whole
    process. Idempotent. Returns ``(True, what was set)``, or ``(False, why not)`` on a platform
    without glibc, when ``mallopt`` refuses, or when the environment already sets glibc's
    ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (the user's choice is kept);
    nothing is changed then. After :func:`keep_freed_memory` (a run without a budget earlier in
    the process) it turns that off too (``M_MMAP_MAX`` back to glibc's 65536): a budget wins."""
    global _applied, _kept
    if _applied:
        return True, "already set"
    settings = [(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES, "M_MMAP_THRESHOLD"),
                (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES, "M_TRIM_THRESHOLD")]
    if _kept:
        settings.insert(0, (_M_MMAP_MAX, _GLIBC_MMAP_MAX, "M_MMAP_MAX"))
    ok, version = _mallopt(("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"), settings)
    if not ok:
        return False, version
    _applied, _kept = True, False
    return True, (f"{version}: M_MMAP_THRESHOLD {MMAP_THRESHOLD_BYTES} B, "
                  f"M_TRIM_THRESHOLD {TRIM_THRESHOLD_BYTES} B")


def rss_bytes() -> int | None:
    """The process's resident set now, in bytes (``/proc/self/statm``); None where there is no
    /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def rss_parts() -> tuple[int, int] | None:
    """The process's resident set now, in bytes, as (allocated, file-backed): ``RssAnon`` +
    ``RssShmem`` (heap, tensors, stacks, shared memory: what the process allocated) and
    ``RssFile`` (pages of mapped files: the libraries' code and data) of ``/proc/self/status``;
    None where there is no such file (Linux before 4.5, no /proc)."""
    parts = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    parts[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(parts) != 3:
        return None
    return parts["RssAnon"] + parts["RssShmem"], parts["RssFile"]


class ResidentPeaks:
    """The peak of the memory this process allocates above a baseline (taken at construction),
    measured over consecutive windows; ``mark()`` ends one and starts the next.

    Why not the peak resident set: it also counts the pages of mapped files (the libraries'
    code), which the process did not allocate, shares with every process that maps them and the
    kernel drops under pressure, and whose count depends on what else runs (on a fault the
    kernel also maps the neighbouring pages that other processes have read into the page
    cache) and on the CPU (which code paths of MKL and oneDNN run). A budget bounds the
    allocated part; the file-backed part is reported beside it.

    Linux keeps one high-water mark, of the sum (``VmHWM``). In a window the allocated peak
    is that mark minus the file-backed pages mapped when it was reached: at most the pages at
    the window's end, at least those at its start (mapped pages are not unmapped during a
    run). ``allocated_peak`` takes the end's, exact for a window that mapped no file page
    and otherwise short by the pages mapped after its peak: mark each training step, since the
    first step maps the step's code and every later one repeats its allocations exactly.
    Where the mark cannot be reset (``reset_peak_rss``) a window spans the process's life and
    the figure is a lower bound."""

    def __init__(self):
        parts = rss_parts()
        if parts is None:
            raise OSError("/proc/self/status gives no RssAnon/RssFile: no allocated/file split")
        self.base_allocated, self.base_file = parts
        self.peak_total = self.base_allocated + self.base_file
        self.allocated_peak = self.base_allocated
        self.file = self.base_file
        self.window_peaks: list[int] = []  # each window's peak resident set, in order
        self.resettable = reset_peak_rss()

    def allocated_now(self) -> int:
        """The allocated bytes now above the baseline's."""
        parts = rss_parts()
        return (self.base_allocated if parts is None else parts[0]) - self.base_allocated

    def mark(self) -> None:
        """End the window: fold its peak into the figures; start the next."""
        hwm = peak_rss_bytes()
        parts = rss_parts()
        if parts is None:
            return
        allocated, self.file = parts
        self.window_peaks.append(hwm)
        self.peak_total = max(self.peak_total, hwm)
        self.allocated_peak = max(self.allocated_peak, hwm - self.file, allocated)
        self.resettable = reset_peak_rss() and self.resettable

    @property
    def allocated_above_baseline(self) -> int:
        """The peak allocated bytes above the baseline's (what a CPU budget bounds)."""
        return self.allocated_peak - self.base_allocated

    @property
    def file_above_baseline(self) -> int:
        """The file-backed pages mapped since the baseline, as of the last mark."""
        return self.file - self.base_file


def peak_rss_bytes() -> int:
    """The process's peak resident set, in bytes: ``VmHWM`` from ``/proc/self/status`` (this
    address space's high-water mark, which :func:`reset_peak_rss` can lower), else
    ``getrusage``'s ``ru_maxrss`` (KiB on Linux; a lifetime peak that can also hold the
    pre-exec image's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Reset the peak resident set to the current one (Linux >= 4.0: ``5`` written to
    ``/proc/self/clear_refs``), so that :func:`peak_rss_bytes` then reads the peak since now.
    False where that is not allowed; the peak stays the lifetime one."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# The largest trim threshold mallopt takes (an int): the heap's top is kept until 2 GiB of it
# is free.
_KEEP_TRIM_BYTES = 2 ** 31 - 1


def keep_freed_memory() -> tuple[bool, str]:
    """The opposite of :func:`release_freed_memory`, for speed: glibc keeps freed blocks for
    reuse, ``mallopt(M_MMAP_MAX, 0)`` (every block from the heap, none mmapped and unmapped at
    free) and ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)`` (the heap is not given back).

    Why: with glibc's defaults a training step's large blocks are mmapped or trimmed and then
    faulted in again on the next step, depending on the history of the process (its dynamic
    thresholds), so the same step is timed with or without page faults (docs/results-cpu.md
    has a measured case). Memory freed stays with the process (its RSS holds the peak), so use
    it where speed, not the resident set, is bounded: benchmarks, or training without a memory
    budget.

    Process-wide, idempotent, affects blocks allocated from now on. Returns ``(True, what was
    set)``, or ``(False, why not)`` without glibc, when ``mallopt`` refuses, when
    :func:`release_freed_memory` was applied, or when the environment sets glibc's
    ``MALLOC_MMAP_MAX_``, ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (kept)."""
    global _kept
    if _kept:
        return True, "already set"
    if _applied:
        return False, "release_freed_memory() was applied: freed memory is returned"
    ok, version = _mallopt(("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                            "MALLOC_TRIM_THRESHOLD_"),
                           ((_M_MMAP_MAX, 0, "M_MMAP_MAX"),
                            (_M_TRIM_THRESHOLD, _KEEP_TRIM_BYTES, "M_TRIM_THRESHOLD")))
    if not ok:
        return False, version
    _kept = True
    return True, f"{version}: M_MMAP_MAX 0, M_TRIM_THRESHOLD {_KEEP_TRIM_BYTES} B"

