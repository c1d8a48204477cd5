"""The GPU a budget runs on: what the CUDA caching allocator reserves for a planned step, and
what the process holds on the device beside it (the CUDA context, cuBLAS's and cuDNN's
workspaces). Everything here runs without a GPU.

Reserved memory. ``torch.cuda.max_memory_allocated`` counts blocks; the allocator holds more:
it gets memory from the driver in segments and keeps freed blocks cached, so
``torch.cuda.max_memory_reserved`` (what the device must have) is the peak of the segments.
:class:`CachingAllocatorModel` replays a step's allocations and frees (recorded by
:func:`fusedres.memory.accounting.simulate_step` with ``cuda_rules=True``) through the rules of
PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (the native backend; one stream, no CUDA graphs,
``max_split_size_mb`` and ``garbage_collection_threshold`` unset, no out-of-memory retries):

* every request rounded up to 512 bytes; up to 1 MiB from the small pool, larger from the large;
* best fit among cached free blocks (smallest size, then lowest address);
* default segments: 2 MiB for the small pool; 20 MiB for requests under 10 MiB, else the
  request rounded up to 2 MiB; a block is split when the remainder is at least 512 bytes (small
  pool) or more than 1 MiB (large pool), else handed out whole (and counted whole);
* ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``): one growing segment per pool,
  mapped in 2 MiB (small) or 20 MiB (large) pages at its end; blocks split whenever 512 bytes
  remain; a free block at the end is extended rather than a new segment made;
* freed blocks merge with free neighbours of the same segment; segments are never returned.

Expandable segments are what the plan recommends: the large pool then grows by what the step
needs beyond its free tail instead of by whole new segments sized for one request.

The replay sees one steady-state step (parameters, optimizer state and batch allocated first,
then the step and the evaluation forward). Not modelled: the first step's order (the
optimizer state is then created after the backward, between the step's blocks), blocks freed
on other streams, the allocator's behaviour near a full device (it frees cached segments and
retries), and allocations outside the tracked tensors: cuDNN's workspaces (allocated through
the caching allocator per convolution call) and cuBLAS's (one per handle and stream, kept).

Beside the allocator. The CUDA context (driver state, the kernels loaded into it) and the
cuBLAS and cuDNN workspaces are stated below with their sources; the context is an estimate,
not measured here (no GPU on this machine).
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CUDA_CONTEXT_BYTES", "CUDNN_WORKSPACE_BYTES", "CachingAllocatorModel", "CudaMemory",
           "cublas_workspace_bytes", "device_fit_warning", "expandable_segments_enabled",
           "predict"]

MiB = 2 ** 20

# c10/cuda/CUDACachingAllocator.cpp (and c10/core/AllocatorConfig.h in newer torch).
MIN_BLOCK = 512            # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 1 * MiB       # kSmallSize: the largest "small" request
SMALL_BUFFER = 2 * MiB     # kSmallBuffer: small-pool segments; expandable small-pool pages
LARGE_BUFFER = 20 * MiB    # kLargeBuffer: segments for 1-10 MiB requests; expandable pages
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB      # kRoundLarge: larger requests' segments are rounded up to this

# The CUDA context on the device: an estimate, rounded up from reports with lazy module
# loading (CUDA >= 11.7, PyTorch's default since 1.13): 287 MB measured when PyTorch turned it
# on (pytorch/pytorch#86509, 2022; 667 MB without), "around 400MB" (pytorch/pytorch#109888,
# 2023), 426 MiB on an RTX 6000 Ada with torch 2.10 + CUDA 13.0 (unslothai/unsloth-zoo#1053,
# 2026). Kernels loaded later (cuDNN's, cuBLAS's, this library's) add to it. Not measured on
# an H100: this machine has no GPU.
CUDA_CONTEXT_BYTES = 512 * MiB
# cuDNN's per-call workspace (the stem convolution of a fused model, every convolution of a
# plain one): an allowance, not a prediction. The trainer sets cudnn.benchmark, which may pick
# an algorithm with any workspace that fits; 64 MiB covers the implicit-GEMM algorithms on
# CIFAR shapes (workspaces of a few MiB) with room for a larger one.
CUDNN_WORKSPACE_BYTES = 64 * MiB


def cublas_workspace_bytes(capability: tuple[int, int] = (9, 0),
                           env: dict[str, str] | None = None) -> int:
    """cuBLAS's workspace, one per handle and stream (the trainer has one), allocated through
    the caching allocator at the first matmul and kept: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` terms, summed) when set, else 32 MiB on compute capability 9.x, 10.x
    and 12.x (Hopper, Blackwell) and ``:4096:2:16:8`` (8 MiB + 128 KiB) before. cuBLASLt
    shares it (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default). Source: PyTorch's
    ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (``parseChosenWorkspaceSize``)."""
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        terms = re.findall(r":([0-9]+):([0-9]+)", config)
        if terms:
            return sum(int(size) * 1024 * int(count) for size, count in terms)
    if capability[0] in (9, 10, 12):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def expandable_segments_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``, its newer name) turns on
    ``expandable_segments``."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    m = re.search(r"expandable_segments\s*:\s*(\w+)", conf)
    return bool(m) and m.group(1).lower() in ("true", "1")


# --------------------------------------------------------------------------- the allocator

class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "small")

    def __init__(self, addr: int, size: int, small: bool, mapped: bool = True):
        self.addr, self.size, self.small, self.mapped = addr, size, small, mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """Free mapped blocks sorted by (size, address), as the allocator's ``BlockPool``."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}

    def add(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i]
        del self.blocks[key]

    def first_fit_index(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator, reduced to its sizes (see the module docstring):
    :meth:`malloc` and :meth:`free` update :attr:`allocated_bytes` (the blocks handed out, what
    ``torch.cuda.memory_allocated`` counts) and :attr:`reserved_bytes` (segments or mapped
    pages, ``torch.cuda.memory_reserved``), and their peaks."""

    _SPACE = 1 << 50  # the address space of one expandable segment (never exhausted here)

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self._next_addr = 0
        self._tails: dict[bool, _Block] = {}  # expandable: each pool's unmapped tail

    @staticmethod
    def round_size(size: int) -> int:
        return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _reserve(self, n: int) -> None:
        self.reserved_bytes += n
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        n = self.allocation_size(size)
        b = _Block(self._next_addr, n, pool.small)
        self._next_addr += n + SMALL_BUFFER  # segments are never adjacent
        self._reserve(n)
        return b

    # ---- expandable segments
    def _expandable_size(self, b: _Block) -> int:
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def _tail(self, pool: _Pool) -> _Block:
        if pool.small not in self._tails:
            base = self._next_addr
            self._next_addr += self._SPACE
            self._tails[pool.small] = _Block(base, self._SPACE, pool.small, mapped=False)
        return self._tails[pool.small]

    def _map(self, pool: _Pool, b: _Block, size: int) -> None:
        """Map the first ``size`` bytes of the unmapped block ``b`` (in whole pages) and merge
        it with a free block before it; the mapped block goes to the free pool."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        n = -(-size // page) * page
        if n < b.size:
            rest = _Block(b.addr + n, b.size - n, pool.small, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = n
            self._tails[pool.small] = rest
        b.mapped = True
        self._reserve(n)
        prev = b.prev
        if prev is not None and not prev.allocated and prev.mapped:
            pool.remove(prev)
            b.addr, b.size, b.prev = prev.addr, b.size + prev.size, prev.prev
            if b.prev is not None:
                b.prev.next = b
        pool.add(b)

    def _grow(self, pool: _Pool, size: int) -> _Block:
        tail = self._tail(pool)
        prev = tail.prev
        if prev is not None and not prev.allocated:  # a free block before the tail: extend it
            self._map(pool, tail, size - prev.size)
        else:
            self._map(pool, tail, size)
        b = self._tails[pool.small].prev
        pool.remove(b)
        return b

    # ---- the public calls
    def malloc(self, nbytes: int) -> _Block:
        size = self.round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        i = pool.first_fit_index(size)
        b = None
        if i < len(pool.keys):
            if self.expandable:
                # Best fit counts a block followed by unmapped space at what it can grow to.
                while (i + 1 < len(pool.keys)
                       and self._expandable_size(pool.blocks[pool.keys[i + 1]])
                       < self._expandable_size(pool.blocks[pool.keys[i]])):
                    i += 1
            b = pool.blocks[pool.keys[i]]
            pool.remove(b)
        elif self.expandable:
            b = self._grow(pool, size)
        else:
            b = self._new_segment(pool, size)
        if self._should_split(b, size):
            rest = _Block(b.addr + size, b.size - size, pool.small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            pool.add(rest)
        b.allocated = True
        self.allocated_bytes += b.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return b

    def free(self, b: _Block) -> None:
        pool = self.pools[b.small]
        b.allocated = False
        self.allocated_bytes -= b.size
        for other in (b.prev, b.next):
            if other is None or other.allocated or not other.mapped:
                continue
            pool.remove(other)
            if other is b.prev:
                b.addr, b.prev = other.addr, other.prev
                if b.prev is not None:
                    b.prev.next = b
            else:
                b.next = other.next
                if b.next is not None:
                    b.next.prev = b
            b.size += other.size
        pool.add(b)

    def replay(self, events: Iterable[tuple]) -> CachingAllocatorModel:
        """Run ``("alloc", key, nbytes)`` / ``("free", key)`` events (frees of keys never
        allocated are ignored); returns self."""
        live: dict = {}
        for ev in events:
            if ev[0] == "alloc":
                if ev[2] > 0:  # an empty tensor allocates nothing
                    live[ev[1]] = self.malloc(ev[2])
            else:
                b = live.pop(ev[1], None)
                if b is not None:
                    self.free(b)
        return self


# --------------------------------------------------------------------------- the prediction

@dataclass
class CudaMemory:
    """A planned step on a GPU, predicted (bytes).

    ``allocated``: the peak of blocks handed out (``torch.cuda.max_memory_allocated``);
    ``reserved_expandable`` / ``reserved_default``: ``torch.cuda.max_memory_reserved`` with
    ``expandable_segments:True`` (recommended) and without; ``expandable``: which one is in
    force in this process's environment. Beside the allocator: ``cublas_workspace`` (for
    ``capability``), ``cudnn_workspace`` (an allowance) and ``context`` (an estimate)."""

    allocated: int
    reserved_expandable: int
    reserved_default: int
    expandable: bool
    cublas_workspace: int
    cudnn_workspace: int
    context: int
    capability: tuple[int, int]

    @property
    def reserved(self) -> int:
        """``max_memory_reserved`` with the allocator setting in force."""
        return self.reserved_expandable if self.expandable else self.reserved_default

    def device_bytes(self, budget: int | None = None) -> int:
        """What the process needs on the device: the larger of ``budget`` and the predicted
        reserved memory, plus cuDNN's workspace allowance and the CUDA context."""
        return max(budget or 0, self.reserved) + self.cudnn_workspace + self.context

    def lines(self) -> list[str]:
        from .accounting import format_bytes as size

        setting = "expandable_segments:True" if self.expandable else "default segments"
        return [
            f"on a GPU (compute capability {self.capability[0]}.{self.capability[1]}): "
            f"max_memory_allocated {size(self.allocated)}, max_memory_reserved "
            f"{size(self.reserved_expandable)} with PYTORCH_CUDA_ALLOC_CONF="
            f"expandable_segments:True (recommended), {size(self.reserved_default)} without "
            f"(in force here: {setting}); both with cuBLAS's workspace "
            f"{size(self.cublas_workspace)}",
            f"  outside the allocator's figures: cuDNN workspace allowance "
            f"{size(self.cudnn_workspace)}, CUDA context ~{size(self.context)} (an estimate): "
            f"the device needs {size(self.device_bytes())} for this step",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def predict(events: Sequence[tuple], resident_bytes: int = 0,
            capability: tuple[int, int] = (9, 0), env: dict[str, str] | None = None,
            context_bytes: int = CUDA_CONTEXT_BYTES,
            cudnn_bytes: int = CUDNN_WORKSPACE_BYTES) -> CudaMemory:
    """Replay a step's allocation ``events`` (``StepMemory.events`` of a ``cuda_rules``
    simulation) after ``resident_bytes`` the caller keeps on the device (one block, allocated
    first: the trainer loads its dataset before the model) and cuBLAS's workspace for a device
    of compute ``capability`` (allocated at the first matmul and kept: placed first too), with
    and without expandable segments; cuDNN's allowance and the CUDA context are stated beside.
    """
    cublas = cublas_workspace_bytes(capability, env)
    head = [("alloc", "resident", int(resident_bytes)), ("alloc", "cublas workspace", cublas)]
    runs = {flag: CachingAllocatorModel(flag).replay([*head, *events]) for flag in (True, False)}
    return CudaMemory(
        allocated=runs[True].peak_allocated_bytes,
        reserved_expandable=runs[True].peak_reserved_bytes,
        reserved_default=runs[False].peak_reserved_bytes,
        expandable=expandable_segments_enabled(env),
        cublas_workspace=cublas, cudnn_workspace=int(cudnn_bytes), context=int(context_bytes),
        capability=tuple(capability))


def device_fit_warning(cuda: CudaMemory, budget: int | None, total_bytes: int) -> str | None:
    """A warning naming the figures when ``budget`` (or the predicted reserved memory, when
    larger) plus cuDNN's allowance and the CUDA context exceeds the device's ``total_bytes``;
    None when it fits."""
    from .accounting import format_bytes as size

    need = cuda.device_bytes(budget)
    if need <= total_bytes:
        return None
    held = max(budget or 0, cuda.reserved)
    what = (f"--memory-budget {size(budget)}" if budget is not None and budget >= cuda.reserved
            else f"the predicted max_memory_reserved {size(cuda.reserved)}")
    return (f"{what} + cuDNN workspace allowance {size(cuda.cudnn_workspace)} + CUDA context "
            f"~{size(cuda.context)} (an estimate) = {size(need)} exceeds the device's "
            f"{size(total_bytes)} by {size(need - total_bytes)}; the allocator may fail or the "
            f"run share the device (held {size(held)})")
