"""The fused unit's Triton launches for one shape, captured from the host launchers as they run,
and each compiled as Triton's JIT would compile it for that launch.

Capture: kernels/ host functions (batch_stats, forward, weight gradient with the BatchNorm sums,
data gradient writing dx: the default "sums" backward of fusedres/backends/triton.py) run on
``meta`` tensors with the kernel launcher replaced by a recorder, and the SM count of the
modeled device; every launch's grid, arguments and config are kept (no data, no GPU).

Compile: the JIT's specialisation of each argument (``triton.runtime.jit``'s
``native_specialize_impl``: an int equal to 1 becomes a constexpr, an int divisible by 16 and
every pointer get ``tt.divisibility=16``), the launch's constexprs, its warps and stages,
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``. Registers, spills and
static shared memory are read from the cubin (cuobjdump -res-usage), dynamic shared memory from
Triton's metadata.

A minimal stand-in for kernels/jit_spec.py (branch jit-spec, not merged when this was written):
the same idea, kept to what the model needs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from ..unit_shapes import ConvUnit

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Captured:
    """One recorded launch: kernel (JITFunction), grid, bound arguments by name, options."""

    kernel: object
    grid: tuple
    args: dict
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__

    @property
    def ctas(self) -> int:
        n = 1
        for g in self.grid:
            n *= int(g)
        return n


@dataclass
class Compiled:
    name: str
    cubin: bytes
    registers: int
    spill_bytes: int
    shared: int
    num_warps: int
    key: tuple = field(default=(), repr=False)


class _Recorder:
    def __init__(self, kernel, sink):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            fn = self.kernel
            names = fn.arg_names
            bound = dict(zip(names, args))
            num_warps = kwargs.pop("num_warps", 4)
            num_stages = kwargs.pop("num_stages", 3)
            bound.update(kwargs)
            for p in fn.params:  # defaults of constexpr parameters not passed
                if p.name not in bound and p.default is not p.default.__class__ and \
                        p.has_default:
                    bound[p.name] = p.default
            self.sink.append(Captured(fn, tuple(grid), bound, num_warps, num_stages))
        return run


# aten ops that launch no kernel (allocation, views, metadata).
_NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view",
              "as_strided", "detach", "t", "transpose", "permute", "expand", "alias",
              "unsqueeze", "squeeze", "select", "slice", "reshape", "_to_copy_noop", "lift_fresh",
              "clone_noop")


@dataclass
class HostOp:
    """A PyTorch op the host launcher runs between the kernels (a reduction of partials, a
    per-channel vector op): one kernel launch moving ``bytes`` (inputs + outputs)."""

    name: str
    bytes: int


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class _HostOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL and not (name == "_to_copy" and _same(args, out)):
            self.sink.append(HostOp(name, _tensor_bytes(args) + _tensor_bytes(out)))
        return out


def _same(args, out) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype == out.dtype


@contextlib.contextmanager
def recording(sms: int):
    """Inside: every kernels/ launch is recorded (not run); ``sm_count`` answers ``sms``."""
    from ..kernels import batch_stats as bs
    from ..kernels import bn_relu_conv2d as fwd
    from ..kernels import bn_relu_conv2d_dgrad as dg
    from ..kernels import bn_relu_conv2d_wgrad as wg

    sink: list[Captured] = []
    saved = []
    for mod in (bs, fwd, dg, wg):
        saved.append((mod, "launcher", mod.launcher))
        mod.launcher = lambda k, sink=sink: _Recorder(k, sink)
        if hasattr(mod, "sm_count"):
            saved.append((mod, "sm_count", mod.sm_count))
            mod.sm_count = lambda device, sms=sms: sms
    try:
        yield sink
    finally:
        for mod, name, val in saved:
            setattr(mod, name, val)


def _require_compiler_mode() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("fusedres.perfmodel: TRITON_INTERPRET=1 is set; the kernels must be "
                           "compiled, run it in a process with TRITON_INTERPRET=0")


def unit_launches(unit: ConvUnit, dtype: str, *, sms: int, training: bool = True,
                  genstats: bool = False) -> tuple[list[tuple[str, Captured]], list[HostOp]]:
    """(role, launch) of one fused unit's forward and backward (channels_last, TF32 for
    fp32), in order: batch_stats (unless ``genstats``), fwd, wgrad+sums, dgrad+dx; and the
    PyTorch ops the host launchers run between them."""
    _require_compiler_mode()
    from ..kernels import batch_stats as bs
    from ..kernels import bn_relu_conv2d as fwd
    from ..kernels import bn_relu_conv2d_dgrad as dg
    from ..kernels import bn_relu_conv2d_wgrad as wg

    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    dt = DTYPES[dtype]
    cl = torch.channels_last
    meta = "meta"
    n, c, co, h, k, s = unit.n, unit.cin, unit.cout, unit.hw, unit.k, unit.stride
    ho = unit.ho
    x = torch.empty((n, c, h, h), dtype=dt, device=meta).to(memory_format=cl)
    w = torch.empty((co, c, k, k), dtype=dt, device=meta).to(memory_format=cl)
    st = torch.float32
    scale = torch.empty((c,), dtype=st, device=meta)
    shift, mean, invstd = torch.empty_like(scale), torch.empty_like(scale), \
        torch.empty_like(scale)
    res = torch.empty((n, co, ho, ho), dtype=dt, device=meta).to(memory_format=cl) \
        if unit.residual else None
    dy = torch.empty((n, co, ho, ho), dtype=dt, device=meta).to(memory_format=cl)
    pad = [unit.padding] * 2
    out: list[tuple[str, Captured]] = []
    host: list[HostOp] = []
    with recording(sms) as sink, _HostOps(host):
        if training and not genstats:
            bs.batch_stats(x)
            out += [("batch_stats", c) for c in sink]
            sink.clear()
        fwd.bn_relu_conv2d_fwd(x, w, None, scale, shift, res, [s, s], pad, [1, 1], cl,
                               genstats=genstats)
        out += [("fwd", c) for c in sink]
        sink.clear()
        gw = torch.empty_like(w)
        _, _, sums = wg.bn_relu_conv2d_wgrad(
            dy, x, w, scale, shift, [s, s], pad, [1, 1], want_weight=True, want_bias=False,
            bn_affine=(torch.empty_like(scale), torch.empty_like(scale)), mean=mean,
            invstd=invstd, out=gw)
        out += [("wgrad+sums", c) for c in sink]
        sink.clear()
        gx = torch.empty_like(x)
        dg.bn_relu_conv2d_dgrad(dy, x, w, scale, shift, mean, invstd, [s, s], pad, [1, 1],
                                batch_stats=training, grad_x=gx, want_sums=False, sums=sums)
        out += [("dgrad+dx", c) for c in sink]
    return out, host


def specialise(cap: Captured) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as the JIT builds them for this launch's arguments."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    fn = cap.kernel
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = cap.args[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = v
            continue
        ty, spec = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        sig[p.name] = ty
        if ty == "constexpr":
            consts[p.name] = spec
        elif isinstance(spec, str) and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


_CACHE: dict[tuple, Compiled] = {}


def compile_launch(fn, sig: dict, consts: dict, attrs: dict, arch: int, num_warps: int,
                   num_stages: int) -> Compiled:
    """Compile one specialisation for sm_``arch`` (cached per process)."""
    _require_compiler_mode()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .sass import resource_usage

    key = (fn.__name__ if hasattr(fn, "__name__") else str(fn), tuple(sorted(sig.items())),
           tuple(sorted((k, str(v)) for k, v in consts.items())),
           tuple(sorted(attrs)), arch, num_warps, num_stages)
    if key in _CACHE:
        return _CACHE[key]
    ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = ck.asm["cubin"]
    usage = resource_usage(cubin)
    name = ck.metadata.name
    u = usage.get(name) or next(iter(usage.values()))
    out = Compiled(name, cubin, u.get("REG", 0), u.get("LOCAL", 0),
                   int(ck.metadata.shared) + u.get("SHARED", 0), num_warps, key)
    _CACHE[key] = out
    return out


def compile_captured(cap: Captured, arch: int) -> Compiled:
    sig, consts, attrs = specialise(cap)
    return compile_launch(cap.kernel, sig, consts, attrs, arch, cap.num_warps, cap.num_stages)
