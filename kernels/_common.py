"""Helpers shared by the Triton kernels' host launchers.

Configs are chosen on the host: by a deterministic rule per kernel (``pick_config``) by default,
or, with ``FUSEDRES_TRITON_AUTOTUNE=1``, by timing every config of the kernel once per shape key
(``autotuned``; cached for the process). Not ``triton.autotune``: the kernels write per-tile
partial results whose row count depends on the tile size, so a config is timed through the
whole host launcher. The rule is what runs on fake tensors (torch.compile tracing) and under the
interpreter. Every config of every kernel is compiled ahead of time (tools/triton_aot.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from .. import settings

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when kernels/ is imported (with
# this module): what it read then is what the kernels are, whatever the environment says later.
# INTERPRET is that, for the launchers' hot paths (a name read, not a call).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` when the
    kernels were defined): :data:`INTERPRET`."""
    return INTERPRET


@dataclass(frozen=True)
class KernelConfig:
    """Meta-parameters of one kernel launch: block sizes (constexprs), warps and stages.
    ``name``: the key of the kernel's config table that holds it (:func:`named`), for people
    and tests; not part of equality, hashing or ``str`` (tools/triton_aot.py keys on ``str``)."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3
    name: str = field(default="", compare=False)

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **blocks: int) -> KernelConfig:
        return cls(tuple(blocks.items()), num_warps, num_stages)

    # Built once a config (a launch reads them ~5 times): read them, never mutate them.
    @cached_property
    def meta(self) -> dict:
        return dict(self.blocks)

    @cached_property
    def launch_kwargs(self) -> dict:
        """The keyword arguments of a launch: the block sizes, warps and stages."""
        return {**self.meta, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        b = " ".join(f"{k.replace('BLOCK_', '')}={v}" for k, v in self.blocks)
        return f"{b} w={self.num_warps} s={self.num_stages}"


def named(configs: dict[str, KernelConfig]) -> dict[str, KernelConfig]:
    """A kernel's config table: name -> config, each config given its name. The order is the
    order ``configs_for`` lists them in (the autotuner's and tools/triton_aot.py's); a host rule
    picks by name."""
    return {name: dataclasses.replace(cfg, name=name) for name, cfg in configs.items()}


def dtype_name(dtype) -> str:
    """'fp16' | 'bf16' | 'fp32' | 'fp64' for a torch dtype (or that name itself)."""
    if isinstance(dtype, str):
        return dtype
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
            torch.float64: "fp64"}[dtype]


def acc_is_fp64(dtype: torch.dtype) -> bool:
    return dtype == torch.float64


# torch.backends.cudnn.allow_tf32 as its getter reads it (a C call; the property is a Python
# one): plans key on it.
tf32_allowed = torch._C._get_cudnn_allow_tf32


def allow_tf32(dtype: torch.dtype) -> bool:
    """TF32 products only for float32 operands and only when cuDNN is allowed them too."""
    return dtype == torch.float32 and bool(torch.backends.cudnn.allow_tf32) and not interpreting()


VARIANTS = ("fp16", "bf16", "fp32", "fp32-ieee", "fp64")


def config_variant(dtype, interpret: bool | None = None) -> str:
    """Which config list a GEMM kernel launches from for operands of ``dtype``: the dtype's
    name, and for float32 "fp32" with TF32 products or "fp32-ieee" without (FMA tiles keep
    BLOCK_M*BLOCK_N / threads accumulators and the broadcast operands in registers: they
    need their own configs). TF32 as :func:`allow_tf32` decides it, ``interpret`` (default:
    :func:`interpreting`) standing for the interpreter; a variant name passes through."""
    if isinstance(dtype, str):
        if dtype not in VARIANTS:
            raise ValueError(f"dtype: expected a torch dtype or one of {', '.join(VARIANTS)}, "
                             f"got {dtype!r}")
        return dtype
    name = dtype_name(dtype)
    if name != "fp32":
        return name
    interp = interpreting() if interpret is None else interpret
    return "fp32" if torch.backends.cudnn.allow_tf32 and not interp else "fp32-ieee"


def interp_bf16(*dtypes: torch.dtype) -> bool:
    """bfloat16 under the interpreter, whose dot reads bfloat16 as raw integers and whose
    float32 -> bfloat16 cast truncates: the kernels work around both (see ``_tl``)."""
    return torch.bfloat16 in dtypes and interpreting()


def tracing() -> bool:
    """True while a graph is being traced around the caller: torch.compile's Dynamo, or a
    dispatch mode (AOTAutograd's functionalisation and fake tensors, make_fx, export)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


_dispatch_depth = torch._C._len_torch_dispatch_stack


def launcher(kernel):
    """What ``launcher(kernel)[grid](...)`` launches through: ``torch.library.wrap_triton`` while
    a graph is traced (:func:`tracing`: inside a ``triton_op`` that torch.compile decomposes,
    the trace records the launch), the kernel itself otherwise, and always under the
    interpreter. An eager launch outside a ``triton_op`` (fusedres.backends.triton's
    BatchNorm preparation) must not go through ``wrap_triton``: its wrapper then runs the
    ``triton_kernel_wrapper_mutation`` higher-order op, ~100 us of host time a launch, and
    adds an entry to torch's kernel side table that is never freed (measured:
    benchmarks/report-gpu-h100/README.md, "After the run")."""
    if INTERPRET or not (torch.compiler.is_compiling() or _dispatch_depth()):  # tracing()
        return kernel
    return torch.library.wrap_triton(kernel)


_DUMMIES: dict[tuple, torch.Tensor] = {}


def dummy(t: torch.Tensor) -> torch.Tensor:
    """A 1-element tensor of ``t``'s dtype and device for a pointer argument the kernel never
    reads or writes (an absent bias, residual or output): one per (device, dtype), made once,
    for plain tensors; a new one for the fake tensors of a trace (a real tensor must not enter
    it)."""
    if type(t) is not torch.Tensor:
        return t.new_empty((1,))
    key = (t.device, t.dtype)
    d = _DUMMIES.get(key)
    if d is None:
        d = _DUMMIES[key] = t.new_empty((1,))
    return d


_PLAN_CACHES: list[dict] = []


def plan_cache() -> dict:
    """A new cache of launch plans (one a host launcher), cleared by :func:`clear_plans`."""
    cache: dict = {}
    _PLAN_CACHES.append(cache)
    return cache


def clear_plans() -> None:
    """Forget every cached launch plan: after a change to what the plans were built from (the
    config rules, the SM count, a setting a test patches); the next call of each key builds its
    plan again."""
    for cache in _PLAN_CACHES:
        cache.clear()


class Launch:
    """One launch of a plan (a host launcher's work for one key of shapes, strides, dtypes and
    alignments, done once): kernel, grid, constexprs and options fixed; ``launch.go(*args)``
    runs it on the kernel's runtime arguments, given positionally (every kernel here declares
    its constexprs after them).

    ``go`` starts as the JIT's launch (``kernel[grid](*args, **kwargs)``: it specialises, and
    compiles on first use). On a GPU, after the first launch it becomes a call of the compiled
    kernel's launcher with the constexprs appended: Triton's per-launch argument binding,
    specialisation key, cache lookup and launch-metadata build are skipped (public figures:
    ~10 us a launch at 20 arguments; these kernels take 30-60). That is sound because the plan's
    key fixes what the JIT keys on: every integer argument (shapes and strides: equal to 1,
    divisible by 16), every pointer's dtype and 16-byte alignment, and the constexprs. Under
    the interpreter, while a graph is traced (``wrap_triton`` must see the launch), with fake
    tensors, or with a launch hook installed (a profiler reads its metadata), ``go`` stays the
    JIT's launch."""

    __slots__ = ("kernel", "grid", "kwargs", "go", "fast")

    def __init__(self, kernel, grid: tuple[int, ...], kwargs: dict, fast: bool = True):
        """``fast``: the plan is for real tensors (not fake or meta ones), so its later launches
        may skip the JIT once one has gone through it."""
        self.kernel = kernel
        self.grid = grid
        self.kwargs = kwargs
        self.fast = fast and not INTERPRET and torch.cuda.is_available()
        if INTERPRET:  # the interpreter launches the kernel itself, traced or not
            self.go = functools.partial(kernel[grid], **kwargs)
        else:
            self.go = self._first if self.fast else self._jit

    def _jit(self, *args):
        return launcher(self.kernel)[self.grid](*args, **self.kwargs)

    def _first(self, *args):
        compiled = self._jit(*args)
        if not tracing() and not _hooked():
            self.go = _direct(self.kernel, compiled, self.grid, len(args), self.kwargs,
                              torch.cuda.current_device(), self._jit)
        return compiled


def _hooked() -> bool:
    """A launch hook is installed (Triton's knobs): the direct launch would not feed it."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def launch_tail(kernel, n_args: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after its first ``n_args`` (its constexprs, then
    their defaults where ``kwargs`` has none), in signature order: what Triton's binder appends
    to the runtime arguments of a launch. Options (``num_warps``, ``num_stages``) are not
    parameters."""
    import inspect

    params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters.values())
    tail = []
    for p in params[n_args:]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            raise TypeError(f"{p.name}: a launch of {getattr(kernel, '__name__', kernel)} "
                            "gives no value for this parameter")
    return tuple(tail)


def _direct(kernel, compiled, grid, n_args: int, kwargs: dict, device: int, jit):
    """The launch of ``compiled`` (the CompiledKernel the JIT returned for these arguments)
    without the JIT: ``run(grid, stream, function, metadata, launch metadata, hooks, *args,
    *constexprs)``, as JITFunction.run calls it (Triton 3.6 to 3.8), on the current stream of
    ``device``. Under a dispatch mode (a trace over real tensors: wrap_triton must see the
    launch) the JIT's launch ``jit`` instead."""
    from triton import knobs

    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    g0, g1, g2 = (*grid, 1, 1)[:3]
    tail = launch_tail(kernel, n_args, kwargs)
    stream = torch._C._cuda_getCurrentRawStream

    def go(*args):
        if _dispatch_depth():
            return jit(*args)
        run(g0, g1, g2, stream(device), function, packed, None, enter, exit_, *args, *tail)
    return go


def fits_int32(*tensors) -> bool:
    """The kernels index with int32: every element offset of every tensor must fit."""
    for t in tensors:
        if t is None:
            continue
        last = 0
        for n, s in zip(t.shape, t.stride()):
            if n > 0:
                last += (n - 1) * abs(s)
        if last >= 2**31:
            return False
    return True


def is_aligned(channels, *tensors) -> bool:
    """Operands the ``ALIGNED`` configs may run on: every channel count in ``channels`` a
    multiple of 16, every 4-D tensor with unit channel stride (channels-last, or any layout
    whose channel axis is innermost), every data pointer 16-byte aligned (None skipped)."""
    for ch in channels:
        if ch % 16:
            return False
    for t in tensors:
        if t is None:
            continue
        if t.dim() == 4 and t.stride(1) != 1:
            return False
        if _byte_offset(t) % 16:
            return False
    return True


def _byte_offset(t: torch.Tensor) -> int:
    """The data pointer modulo the allocator's alignment: the pointer itself for real
    tensors; for fake and meta ones (torch.compile tracing: the config chosen there is baked
    into the graph) the storage offset, the storage base being allocator-aligned."""
    from torch._subclasses.fake_tensor import is_fake

    if t.device.type == "meta" or is_fake(t):
        return int(t.storage_offset()) * t.element_size()
    return t.data_ptr()


def usable(cfg: KernelConfig, aligned: bool) -> bool:
    """A config with ``ALIGNED`` in its meta runs only on aligned operands."""
    return aligned or not cfg.meta.get("ALIGNED", False)


def check_usable(cfg: KernelConfig, aligned: bool) -> None:
    if not usable(cfg, aligned):
        raise ValueError(f"config {cfg} (ALIGNED) needs channels-last operands with channel "
                         "counts and data pointers multiples of 16")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def short_rows_fill_better(m: int, col_tiles: int, sms: int, tall: int, short: int) -> bool:
    """Whether tiles ``short`` rows tall finish a grid of ``m`` rows x ``col_tiles`` column
    tiles sooner than tiles ``tall`` rows tall on ``sms`` SMs, by grid quantisation alone: the
    busiest SM runs cdiv(tiles, sms) tiles of ``rows`` rows each. A small grid just over one
    wave (CIFAR 64@8, batch 128: 128 tiles of 64 rows on an A100's 108 SMs, 20 SMs run two
    while 88 idle) ends sooner on half-height tiles (256 on 108: 3 x 32 rows against 2 x 64);
    ties keep the tall tile (its operand tiles are reused over more rows)."""
    def busiest(rows: int) -> int:
        return cdiv(cdiv(m, rows) * col_tiles, sms) * rows
    return busiest(short) < busiest(tall)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


_TUNED: dict[tuple, KernelConfig] = {}


def autotune_enabled(*tensors) -> bool:
    """FUSEDRES_TRITON_AUTOTUNE=1, on real (not fake, not meta) tensors."""
    if not settings.get("FUSEDRES_TRITON_AUTOTUNE"):
        return False
    from torch._subclasses.fake_tensor import is_fake

    return all(t is None or (not is_fake(t) and t.device.type != "meta") for t in tensors)


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench on a GPU; a wall clock otherwise)."""
    if torch.cuda.is_available() and not interpreting():
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=20)
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def autotuned(key: tuple, configs: list[KernelConfig],
              run: Callable[[KernelConfig], object]) -> KernelConfig:
    """The fastest of ``configs`` for ``key`` (timed once through ``run(config)``, cached)."""
    if key not in _TUNED:
        times = {cfg: _bench(lambda cfg=cfg: run(cfg)) for cfg in configs}
        _TUNED[key] = min(times, key=times.get)
    return _TUNED[key]
