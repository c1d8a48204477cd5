"""The Triton kernels' launches as the JIT specialises them, captured and compiled without a GPU.

Triton's JIT compiles a kernel per *specialisation* of its arguments, not per source: an int
argument equal to 1 becomes a constexpr, an int or pointer divisible by 16 gets the
``tt.divisibility`` attribute (vectorised loads, cheaper address arithmetic), an int past
int32 becomes ``i64``, the pointer dtypes come from the tensors. A compile that types every
argument ``i32`` (the old kernels/aot.py) describes another kernel: for the forward, fp16, sm_90,
242 registers against the 123 of the kernel a GPU runs. This module gives the kernels as they
run:

* :func:`unit_launches` runs the host side of one training step of a fused unit (the Triton
  backend's batch statistics, forward and backward entry points, ``fusedres/backends/triton/``)
  on ``meta`` tensors, with every kernel module's ``launcher`` replaced by a recorder: each
  launch is kept as (jit function, grid, positional args, keyword args) instead of run, and the
  host code between launches runs on ``meta`` tensors. ``sm_count``
  is replaced in every module that imported it (grids and split-K depend on it), and
  ``torch.backends.cudnn.allow_tf32`` is set for the step (it selects the ``TF32`` variant).
* :func:`specialise` turns one launch into the (signature, constexprs, attrs, options) that
  ``JITFunction.run`` gives ``ASTSource``: it calls Triton's own binder
  (``triton.runtime.jit.create_function_from_signature``, whose ``native_specialize_impl``
  makes the per-argument decisions) and ``JITFunction._pack_args``, on the recorded values.
  Tensors are passed as objects with a ``dtype`` and the ``data_ptr()`` a CUDA tensor of that
  view would have: PyTorch's CUDA caching allocator hands out blocks rounded to 512 bytes
  (``kMinBlockSize = 512`` in c10/cuda/CUDACachingAllocator.cpp), so a tensor's base address
  is 512-aligned and a view's pointer is base + storage_offset * itemsize; only the offset
  decides divisibility by 16.
* :func:`compile_launch` compiles a specialised launch with ``triton.compile`` for an arch and
  reads registers, spills (ptxas's log) and shared memory; results are cached on disk under
  ``<TRITON_CACHE_DIR>/fusedres-jit-spec``, keyed by Triton's own compile key
  (``triton.runtime.cache.get_cache_key``: source and dependency hashes, signature,
  constexprs, attrs, options, backend and ptxas version, cache-invalidating environment
  variables). Triton's cache keys correctly but keeps no ptxas log, hence a cache of our own.

The kernels must be imported with ``TRITON_INTERPRET=0`` (``triton.jit`` gives interpreter
objects otherwise); nothing here needs a GPU or initialises CUDA.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from fusedres.kernels import _common
from fusedres.kernels._common import KernelConfig

__all__ = ["Compiled", "DevicePointer", "Launch", "compile_launch", "specialise", "unit_launches",
           "with_config"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp64": torch.float64}
BACKWARDS = ("sums", "store")
_CACHE_VERSION = "1"  # bump when Compiled's fields or the log parsing change

# Role names (as tools/triton_aot.py prints them) of the kernels with one launch form.
_ROLE_OF_FN = {"batch_stats_kernel": "batch_stats", "bn_relu_conv2d_fwd_kernel":
               "bn_relu_conv2d_fwd", "dx_kernel": "dx"}


def role_of(fn_name: str, params: dict) -> str:
    """The role name of a launch of jit function ``fn_name`` with bound arguments ``params``:
    the data-gradient kernel by what it writes, the weight-gradient kernel by ``SUMS``."""
    if fn_name == "dgrad_kernel":
        if params.get("WRITE_DZ"):
            return "dgrad_store"
        return "dgrad_dx" if params.get("WRITE_DX") else "dgrad_sums"
    if fn_name == "wgrad_kernel":
        return "wgrad_sums" if params.get("SUMS") else "wgrad"
    return _ROLE_OF_FN.get(fn_name, fn_name.removesuffix("_kernel"))


# --------------------------------------------------------------------------- pointers

class DevicePointer:
    """What the JIT reads of a tensor argument: its ``dtype`` and ``data_ptr()``.

    ``data_ptr`` is ``base + storage_offset * itemsize`` with ``base`` 512-aligned, as a CUDA
    caching-allocator tensor's (see the module docstring); ``nbytes`` the bytes of the view."""

    __slots__ = ("dtype", "ptr", "nbytes")

    def __init__(self, dtype: torch.dtype, ptr: int, nbytes: int):
        self.dtype, self.ptr, self.nbytes = dtype, ptr, nbytes

    @classmethod
    def of(cls, t: torch.Tensor, base: int) -> DevicePointer:
        if base % 512:
            raise ValueError(f"base: expected a 512-byte aligned address, got {base:#x}")
        return cls(t.dtype, base + t.storage_offset() * t.element_size(),
                   t.numel() * t.element_size())

    def data_ptr(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"DevicePointer({self.dtype}, {self.ptr:#x})"


# Distinct, 512-aligned, far apart: one address range per tensor argument of a launch.
_BASE = 0x7F00_0000_0000
_BASE_STEP = 1 << 34


def _as_device_args(args, kwargs):
    n = 0

    def conv(v):
        nonlocal n
        if isinstance(v, torch.Tensor):
            n += 1
            return DevicePointer.of(v, _BASE + n * _BASE_STEP)
        return v

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


# --------------------------------------------------------------------------- specialisation

@cache
def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", arch, 32))


_BINDERS: dict = {}


def _binder(fn, arch: int):
    """Triton's binder for ``fn`` (what ``JITFunction.create_binder`` builds for a device)."""
    from triton.runtime.jit import create_function_from_signature

    key = (id(fn), arch)
    if key not in _BINDERS:
        _BINDERS[key] = (fn, create_function_from_signature(fn.signature, fn.params,
                                                            _backend(arch)))
    return _BINDERS[key][1]


def _check_jit(fn) -> None:
    if not hasattr(fn, "_pack_args") or "Interpreted" in type(fn).__name__:
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)}: a Triton interpreter function; the kernels must be "
            "imported with TRITON_INTERPRET=0 (run this in a fresh process)")


def bind(fn, args, kwargs, arch: int):
    """(options, signature, constexprs, attrs, params) of ``fn[grid](*args, **kwargs)`` as
    ``JITFunction.run`` computes them for a device of compute capability ``arch`` (its first
    steps, verbatim: the debug and instrumentation options it adds, its binder, its
    ``_pack_args``). ``args`` hold :class:`DevicePointer` (or anything with ``dtype`` and
    ``data_ptr()``) for tensors."""
    from triton import knobs

    _check_jit(fn)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = _binder(fn, arch)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(_backend(arch), kwargs, bound,
                                                          specialization, options)
    return options, signature, constexprs, attrs, dict(bound)


def _configs_in(value, depth: int = 2) -> list[KernelConfig]:
    """The KernelConfigs a module-level value holds: itself, or those of a list, a named table
    (name -> config) or a table of tables (wgrad's ``CONFIGS[dtype, variant]``)."""
    if isinstance(value, KernelConfig):
        return [value]
    if depth == 0 or not isinstance(value, (dict, list, tuple)):
        return []
    items = value.values() if isinstance(value, dict) else value
    return [cfg for item in items for cfg in _configs_in(item, depth - 1)]


def _config_of(fn, params: dict, options) -> KernelConfig:
    """The :class:`KernelConfig` the launch came from: the one of ``fn``'s module whose block
    sizes, warps and stages the launch carries (the most specific when several do)."""
    module = sys.modules.get(fn.__module__)
    found = [cfg for value in (vars(module).values() if module else ())
             for cfg in _configs_in(value)
             if cfg.num_warps == options.num_warps and cfg.num_stages == options.num_stages
             and all(params.get(k) == v for k, v in cfg.blocks)]
    if found:
        return max(found, key=lambda c: len(c.blocks))
    blocks = {k: v for k, v in params.items() if k.startswith("BLOCK_")}
    return KernelConfig.of(options.num_warps, options.num_stages, **blocks)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT compiles and runs it.

    ``signature``, ``constexprs`` and ``attrs`` are exactly what ``JITFunction.run`` passes to
    ``ASTSource`` (constexprs and attrs keyed by argument path, ``(index,)``); ``options`` the
    backend options (``CUDAOptions`` fields) it compiles with. ``args``/``kwargs`` are the
    launch's values with tensors as :class:`DevicePointer` (re-specialise for another arch with
    :func:`specialise`); ``tensor_bytes`` the bytes of each tensor argument's view."""

    kernel: str
    fn: object
    config: KernelConfig
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    signature: dict
    constexprs: dict
    attrs: dict
    tensor_bytes: dict
    arch: int = 90
    options: dict = field(default_factory=dict)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def constexprs_by_name(self) -> dict:
        names = self.fn.arg_names
        return {names[k[0]]: v for k, v in self.constexprs.items() if len(k) == 1}

    @property
    def constexprs_from_values(self) -> dict:
        """The arguments declared as runtime values that the JIT made constexprs (ints equal to
        1, None), by name."""
        params = self.fn.params
        return {params[k[0]].name: v for k, v in self.constexprs.items()
                if len(k) == 1 and not params[k[0]].is_constexpr}

    @property
    def divisible(self) -> tuple[str, ...]:
        """The arguments with the ``tt.divisibility = 16`` attribute, in order."""
        names = self.fn.arg_names
        return tuple(names[k[0]] for k, v in sorted(self.attrs.items())
                     if ["tt.divisibility", 16] in v)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def key(self) -> tuple:
        """What decides the compiled code: kernel, arch, specialisation, options."""
        return (self.fn.__module__, self.fn.__name__, self.arch,
                tuple(sorted(self.signature.items())),
                tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.options.items())))

    def __reduce__(self):  # the jit function travels as (module, name): process pools
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "fn"}
        return (_rebuild_launch, (self.fn.__module__, self.fn.__name__, fields))


def _rebuild_launch(module: str, name: str, fields: dict) -> Launch:
    return Launch(fn=getattr(importlib.import_module(module), name), **fields)


def _grid3(grid) -> tuple[int, int, int]:
    g = tuple(int(v) for v in grid) + (1, 1, 1)
    return g[:3]


def specialise(fn, grid, args, kwargs, arch: int = 90, kernel: str | None = None,
               config: KernelConfig | None = None) -> Launch:
    """The :class:`Launch` of ``fn[grid](*args, **kwargs)`` on a GPU of compute capability
    ``arch``. Tensors (real, meta or fake) or :class:`DevicePointer` for the pointers."""
    args, kwargs = _as_device_args(args, kwargs)
    options, signature, constexprs, attrs, params = bind(fn, args, kwargs, arch)
    return Launch(
        kernel=kernel or role_of(fn.__name__, params), fn=fn,
        config=config or _config_of(fn, params, options), grid=_grid3(grid),
        num_warps=options.num_warps, num_stages=options.num_stages, signature=signature,
        constexprs=constexprs, attrs=attrs,
        tensor_bytes={k: v.nbytes for k, v in params.items() if isinstance(v, DevicePointer)},
        arch=arch, options=dict(options.__dict__), args=args, kwargs=kwargs)


# --------------------------------------------------------------------------- capture

class _Recorder:
    """Stands in for ``kernels._common.launcher``: ``launcher(k)[grid](*a, **kw)`` records."""

    def __init__(self):
        self.launches: list[tuple] = []

    def __call__(self, kernel):
        return _RecordingKernel(self, kernel)


class _RecordingKernel:
    def __init__(self, recorder: _Recorder, kernel):
        self.recorder, self.kernel = recorder, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.recorder.launches.append((self.kernel, grid, args, dict(kwargs)))
        return launch


def _kernel_modules() -> list:
    prefix = _common.__package__ + "."  # fusedres.kernels
    return [m for name, m in list(sys.modules.items()) if name.startswith(prefix) and m]


@contextlib.contextmanager
def capturing(sms: int, tf32: bool, backward: str):
    """Within: every kernel module's ``launcher`` records, ``sm_count`` is ``sms``, cuDNN's
    TF32 switch is ``tf32``, the Triton backend's ``backward_strategy`` (what
    ``FUSEDRES_TRITON_BACKWARD`` selects) returns ``backward`` and its ops take meta tensors.
    Yields the recorder."""
    if _common.interpreting():
        raise RuntimeError("TRITON_INTERPRET=1: launches can only be captured with "
                           "TRITON_INTERPRET=0 (the kernels compile for a GPU then)")
    # Every kernel module is imported before patching: one imported within would bind the
    # recorder for good (``from ._common import launcher``).
    from fusedres.backends.triton import ops, plans

    recorder = _Recorder()
    swaps = [(m, name, orig, new) for m in _kernel_modules()
             for name, orig, new in (("launcher", _common.launcher, recorder),
                                     ("sm_count", _common.sm_count, lambda device: sms))
             if getattr(m, name, None) is orig]
    swaps.append((plans, "backward_strategy", plans.backward_strategy,
                  lambda *args, **kwargs: backward))
    swaps.append((ops, "DEVICE_TYPES", ops.DEVICE_TYPES,
                  (*ops.DEVICE_TYPES, "meta")))  # the step's tensors are meta tensors
    old_tf32 = torch.backends.cudnn.allow_tf32
    for m, name, _, new in swaps:
        setattr(m, name, new)
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield recorder
    finally:
        for m, name, orig, _ in swaps:
            setattr(m, name, orig)
        torch.backends.cudnn.allow_tf32 = old_tf32


def _training_step(shape, dtype: torch.dtype, fmt, training: bool, genstats: bool,
                   during=contextlib.nullcontext, route: str = "eager") -> None:
    """One fwd+bwd of the fused unit ``shape`` through the Triton backend's eager route, on
    meta tensors, as fusedres.functional and the autograd rule (fusedres.ops) call them: the
    BatchNorm's preparation of an ``nn.BatchNorm2d`` with running statistics (momentum 0.1:
    batch statistics and the running-statistics update in training, the running statistics in
    eval) with the fused affine in its launch (fusedres.backends.triton.prepare_affine), the
    forward and the backward reading that affine (``eager_launches``), the backward with the
    gradients of x, the weight and the BatchNorm affine (the unit has no conv bias); float64,
    and ``route="public"``, through the public ops' bodies (what a traced graph runs: the
    affine made by a launch of its own, forward and backward). ``during()``: a context entered
    once the inputs exist, around every call of the step (tools.perfmodel counts the host
    ops in it)."""
    from fusedres.backends import triton as backend
    from fusedres.ops.opdefs import BackwardArgs, UnitArgs, stats_dtype

    sdt = stats_dtype(dtype)
    k, s, p = shape.k, shape.stride, shape.padding

    def act(n, c, hw):
        return torch.empty((n, c, hw, hw), device="meta", dtype=dtype).contiguous(
            memory_format=fmt)

    x = act(shape.n, shape.cin, shape.hw)
    weight = torch.empty((shape.cout, shape.cin, k, k), device="meta", dtype=dtype).contiguous(
        memory_format=fmt)
    residual = act(shape.n, shape.cout, shape.ho) if shape.residual else None
    grad_out = act(shape.n, shape.cout, shape.ho)
    # prepare_batch_norm casts the affine to the statistics dtype.
    bn_weight = torch.empty((shape.cin,), device="meta", dtype=sdt)
    bn_bias = torch.empty((shape.cin,), device="meta", dtype=sdt)
    running_mean = torch.empty((shape.cin,), device="meta", dtype=sdt)
    running_var = torch.empty((shape.cin,), device="meta", dtype=sdt)
    num_batches_tracked = torch.empty((), device="meta", dtype=torch.int64)
    with during():
        affine = None
        if sdt == torch.float64 or route == "public":  # not the eager route's preparation
            if sdt != torch.float64:  # the public route's one-launch preparation
                mean, invstd = backend.prepare_batch_norm(x, running_mean, running_var,
                                                          num_batches_tracked, training, 0.1,
                                                          1e-5)
            elif training:
                mean, var = backend.batch_stats(x)
                invstd = torch.rsqrt(var + 1e-5)
            else:
                mean, var = running_mean, running_var
                invstd = torch.rsqrt(var + 1e-5)
        else:  # the eager route's: the affine made in the preparation's launch
            mean, invstd, *affine = backend.prepare_affine(
                x, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, training,
                0.1, 1e-5)
        geometry = dict(stride=[s, s], padding=[p, p], dilation=[1, 1])
        args = UnitArgs(x=x, weight=weight, bias=None, bn_weight=bn_weight, bn_bias=bn_bias,
                        mean=mean, invstd=invstd, residual=residual, batch_stats=training,
                        **geometry)
        b = BackwardArgs(
            grad_out=grad_out, x=x, weight=weight, bn_weight=bn_weight, bn_bias=bn_bias, mean=mean,
            invstd=invstd, batch_stats=training, output_mask=[True, True, False, True, True],
            **geometry)
        if affine is None:
            (backend.bn_relu_conv2d_genstats if genstats else backend.bn_relu_conv2d)(*args)
            backend.bn_relu_conv2d_backward(*b)
        else:
            backend.eager_launches(args, genstats, affine, b)
            if genstats:  # the next unit's BatchNorm, prepared from these statistics
                co = shape.cout
                vec = [torch.empty((co,), device="meta", dtype=sdt) for _ in range(5)]
                backend.prepare_affine(act(shape.n, co, shape.ho), vec[0], vec[1], vec[2],
                                       vec[3], num_batches_tracked, training, 0.1, 1e-5,
                                       mean=vec[4], var=vec[4])


def unit_launches(shape, dtype: str, *, arch: int = 90, tf32: bool = True,
                  channels_last: bool = True, sm_count: int | None = None,
                  training: bool = True, backward: str = "sums",
                  genstats: bool = False, during=contextlib.nullcontext,
                  route: str = "eager") -> list[Launch]:
    """The kernel launches of one training step (forward + backward) of the fused unit
    ``shape`` (a :class:`fusedres.models.unit_shapes.ConvUnit`), in launch order, specialised as the
    JIT specialises them on a GPU of compute capability ``arch`` with ``sm_count`` SMs
    (default: A100's 108 for sm_80, H100's 132 otherwise).

    ``dtype``: "fp16" | "bf16" | "fp32" | "fp64", of the activations and the weight (the
    statistics in float32, float64 for fp64). ``tf32``: ``torch.backends.cudnn.allow_tf32``
    (fp32 only: off compiles the ``ieee`` products). ``channels_last``: the layout of the
    activations and the weight. ``training``: training-mode BatchNorm (batch statistics,
    gradients through them). ``backward``: the Triton backward's plan, "sums" or "store"
    (``FUSEDRES_TRITON_BACKWARD``). ``genstats``: the forward also reduces y's statistics;
    on the eager route the next unit's BatchNorm preparation from them (bn_prepare, where
    the next unit would run the statistics kernel) closes the step. ``during``: a context
    manager factory entered around the step's calls (its inputs made).
    ``route``: "eager" (fusedres.ops._backend's triton record) or "public" (the public ops' bodies).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward: expected one of {', '.join(BACKWARDS)}, got {backward!r}")
    for name in ("n", "cin", "cout", "hw", "k", "stride"):
        if not hasattr(shape, name):
            raise TypeError(f"shape: expected a fusedres.models.unit_shapes.ConvUnit, got "
                            f"{type(shape).__name__}")
    sms = sm_count if sm_count is not None else (108 if arch == 80 else 132)
    if sms < 1:
        raise ValueError(f"sm_count: expected a positive SM count, got {sms}")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with capturing(sms, tf32, backward) as recorder:
        _training_step(shape, DTYPES[dtype], fmt, training, genstats, during, route)
    return [specialise(fn, grid, args, kwargs, arch) for fn, grid, args, kwargs
            in recorder.launches]


# --------------------------------------------------------------------------- compile

@dataclass
class Compiled:
    """One compiled launch: the kernel's symbol, its cubin and PTX, registers per thread,
    spilled bytes (ptxas's log: the larger of spill stores and loads), static + dynamic shared
    memory in bytes, warps, stages, compile seconds (0 when read from the cache)."""

    kernel: str
    name: str
    arch: int
    registers: int
    spill_bytes: int
    shared: int
    num_warps: int
    num_stages: int
    cubin: bytes = b""
    ptx: str | None = None
    seconds: float = 0.0
    cached: bool = False


def cache_dir() -> Path:
    from triton import knobs

    return Path(knobs.cache.dir) / "fusedres-jit-spec"


def _source(launch: Launch):
    from triton.compiler import ASTSource

    return ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)


def _cache_key(launch: Launch) -> str:
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    backend = _backend(launch.arch)
    options = backend.parse_options(launch.options)
    key = get_cache_key(_source(launch), backend, options, get_cache_invalidating_env_vars())
    return hashlib.sha256(f"{_CACHE_VERSION}-{launch.arch}-{key}".encode()).hexdigest()


def parse_ptxas_log(log: str) -> tuple[int, int]:
    """(registers, spilled bytes) from ptxas's ``-v`` log; ValueError when it has neither."""
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    if not regs or not spills:
        raise ValueError(f"log: no ptxas resource lines in {log[:200]!r}")
    return max(int(r) for r in regs), max(int(s) for s in spills)


def compile_launch(launch: Launch, arch: int | None = None, *, use_cache: bool = True,
                   keep_ptx: bool = True) -> Compiled:
    """Compile ``launch`` for sm_``arch`` (default: the arch it was specialised for; another
    arch re-specialises it first) with ``triton.compile``; no GPU needed. Raises what Triton
    raises for a kernel that does not compile."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    if arch is not None and arch != launch.arch:
        launch = specialise(launch.fn, launch.grid, launch.args, launch.kwargs, arch,
                            launch.kernel, launch.config)
    key = _cache_key(launch)
    path = cache_dir() / f"{key}.json"
    if use_cache and path.exists():
        meta = json.loads(path.read_text())
        cubin = path.with_suffix(".cubin").read_bytes()
        ptx_path = path.with_suffix(".ptx")
        ptx = ptx_path.read_text() if keep_ptx and ptx_path.exists() else None
        return Compiled(**meta, cubin=cubin, ptx=ptx, cached=True)
    saved = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    # The ptxas log is printed only by a real compile, never on a Triton cache hit.
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(_source(launch), target=GPUTarget("cuda", launch.arch, 32),
                                options=dict(launch.options))
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    seconds = time.perf_counter() - t0
    registers, spills = parse_ptxas_log(buf.getvalue())
    meta = dict(kernel=launch.kernel, name=ck.metadata.name, arch=launch.arch,
                registers=registers, spill_bytes=spills, shared=int(ck.metadata.shared),
                num_warps=int(ck.metadata.num_warps), num_stages=int(ck.metadata.num_stages))
    cubin, ptx = ck.asm["cubin"], ck.asm.get("ptx")
    path.parent.mkdir(parents=True, exist_ok=True)
    files = [(".cubin", cubin), (".json", json.dumps(meta).encode())]
    if ptx is not None:
        files.insert(1, (".ptx", ptx.encode()))
    for suffix, data in files:  # each written whole, then renamed; the .json last: its
        tmp = path.with_suffix(f"{suffix}.tmp{os.getpid()}")  # presence means the entry is
        tmp.write_bytes(data)  # whole, whatever other processes write at the same time
        tmp.replace(path.with_suffix(suffix))
    return Compiled(**meta, cubin=cubin, ptx=ptx if keep_ptx else None, seconds=seconds)


def with_config(launch: Launch, config: KernelConfig) -> Launch:
    """``launch`` with ``config``'s block sizes, warps and stages in place of its own (the
    other arguments unchanged), re-specialised: what the autotuner would compile for a config
    the host rule did not pick."""
    kwargs = {k: v for k, v in launch.kwargs.items()
              if k not in launch.config.meta and k not in ("num_warps", "num_stages")}
    kwargs.update(config.launch_kwargs)
    return specialise(launch.fn, launch.grid, launch.args, kwargs, launch.arch, launch.kernel,
                      config)


def format_launches(launches: list[Launch], compiled: list[Compiled] | None = None) -> str:
    """One block per launch: role, grid, config, the constexprs the JIT made of runtime values
    (ints equal to 1), the arguments with the divisibility attribute; with ``compiled`` also
    registers, spills and shared memory."""
    lines = []
    for i, launch in enumerate(launches):
        made = launch.constexprs_from_values
        head = f"{launch.kernel}  grid={launch.grid}  {launch.config}  sm_{launch.arch}"
        if compiled:
            c = compiled[i]
            head += f"  regs={c.registers} spill={c.spill_bytes} smem={c.shared}"
        lines += [head, f"  constexpr from values: {made}",
                  f"  divisible by 16: {', '.join(launch.divisible)}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="The Triton launches of one training step of a "
                                 "unit, specialised as the JIT specialises them.")
    ap.add_argument("shape", help="a unit, as fusedres bench's --shapes: "
                    "conv:N=128,C=64,K=3,CO=64,HW=56[,S=2][,res]")
    ap.add_argument("--dtype", default="fp16", choices=tuple(DTYPES))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sm-count", type=int, default=None)
    ap.add_argument("--no-tf32", action="store_true", help="fp32 without TF32 (ieee products)")
    ap.add_argument("--nchw", action="store_true", help="contiguous NCHW, not channels_last")
    ap.add_argument("--backward", default="sums", choices=BACKWARDS)
    ap.add_argument("--compile", action="store_true", help="also compile (registers, spills)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    from fusedres.models.unit_shapes import ConvUnit, parse_shape

    # Run as ``-m``, this file is ``__main__``: work through the package's module instead.
    spec = importlib.import_module(f"{__package__}.jit_spec")

    shape = parse_shape(args.shape)
    if not isinstance(shape, ConvUnit):
        ap.error(f"shape: expected a conv: unit, got {args.shape!r}")
    launches = spec.unit_launches(shape, args.dtype, arch=args.arch, tf32=not args.no_tf32,
                                  channels_last=not args.nchw, sm_count=args.sm_count,
                                  backward=args.backward)
    compiled = [spec.compile_launch(launch, keep_ptx=False) for launch in launches] \
        if args.compile else None
    print(spec.format_launches(launches, compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
