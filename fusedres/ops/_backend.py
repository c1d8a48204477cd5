"""The backends, one record each in one table, and the route: which backend runs a fused call,
and how.

A *backend* implements the ops of :data:`fusedres.ops.opdefs.SCHEMAS` (batch statistics, fused
forward, fused backward) for some devices, in its module ``fusedres.backends.<name>``.
``reference`` is special: it is the plain PyTorch composition and bypasses the ops entirely (it
saves the activations, it is the oracle); called directly, the ops run the portable code there.

Selection: ``use_backend`` context > ``set_backend`` > env ``FUSEDRES_BACKEND`` > ``auto``.
``auto`` takes, for the tensor's device, the first backend of :data:`TABLE` that serves that
device type and can run, warning once when it had to skip a compiled one. A backend asked for
by name that cannot run raises :class:`BackendUnavailableError` with the reason.

The route: every fused call (``BNReLUConv2d.forward``, ``functional.prepare_batch_norm``, the
fused convolutions of :mod:`fusedres.functional`, the public ops) asks :func:`route` (eager
callers) or :func:`backend_for` (the public ops) with the tensor it is about to run on, and
gets the :class:`Backend` record in force: its ``ops``, and its eager fast path, one field a
kind of call, ``None`` where the backend has no short form and the caller composes the call
from the fields that remain (a pair from two units, a shortcut from ``x`` and a unit, a
preparation from PyTorch ops, a module's forward from checks, preparation and unit).

=================  ===========  ==========  ===========  ==========  ==========  ===========
record             module_unit  prepare     unit         pair        shortcut    batch_stats
=================  ===========  ==========  ===========  ==========  ==========  ===========
cpu, eager         C++ call     C++ call    C++ node     C++ node    C++ node    C++ call
cuda, eager        C++ call     C++ call    C++ node     C++ node    --          public op
triton, eager      1 + autog.F  1 launch    autograd.F   --          --          public op
triton, compiled   --           --          triton_ops   --          --          triton_op
public             --           --          public op    --          --          public op
=================  ===========  ==========  ===========  ==========  ==========  ===========

The names: *C++ call* an op of the backend's namespace (``fusedres_cpu::module_unit``,
``prepare_batch_norm``, ``batch_stats``), *C++ node* one whose autograd node is C++
(csrc/eager.h: ``eager_unit``, ``eager_pair``, ``eager_unit_with_shortcut``), *autograd.F* a
Python ``autograd.Function`` launching the backend's kernels through their plans
(fusedres.backends.triton's ``EagerTritonUnit``), *1 launch* the statistics and the
preparation with the fused affine (batch_stats_kernel's last program of a channel block
merges), *1 + autog.F* that launch then the autograd.Function, plans and checks cached per
arguments' metadata, *triton_ops* the ``fusedres_triton`` ops that torch.compile decomposes
into their kernels on a GPU (``CompiledUnit``), *public op* ``fusedres::<op>`` (its autograd
rule, then the backend's op). *Compiled* is a graph that torch.compile traces with the triton
backend in force on a GPU; *public* every other call: the portable and reference backends, and
tracing, dispatch modes, torch.func transforms, empty batches and weights that are tensor
subclasses on every backend.

*Eager* is a plain, non-empty tensor outside any trace, dispatch mode or torch.func
transform, with a plain weight (a tensor or ``nn.Parameter``, not a subclass such as DTensor,
whose data a kernel would read raw). The records are data, so a test or a benchmark compares
two routes by replacing one field of a record in :data:`TABLE`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from .. import settings

BACKENDS = ("reference", "portable", "cpu", "triton", "cuda")
_VALID_NAMES = ("auto",) + BACKENDS


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name and cannot run here; the message says why."""


def _public_unit(args, genstats: bool, affine=None):
    if genstats:
        return torch.ops.fusedres.bn_relu_conv2d_genstats(*args)
    return torch.ops.fusedres.bn_relu_conv2d(*args)


def _public_batch_stats(x: Tensor):
    return tuple(torch.ops.fusedres.batch_stats(x))


class Backend(NamedTuple):
    """One backend, as every fused call reads it (see the module's table for which field runs
    where).

    - ``name``; ``devices``: the device types ``auto`` takes it for (``"*"``: every one), in
      the order of :data:`TABLE`.
    - ``ops``: its module, ``fusedres.backends.<name>`` (the portable one for ``reference``):
      ``unavailable_reason(device)`` and the ops of SCHEMAS under their names. None until the
      backend first runs (:func:`load`); the module's ``fast_path()``, where it has one, gives
      the fields below.
    - ``compiled``: the record of a graph that torch.compile traces on a GPU with this backend
      in force, where its ops have a form Inductor sees into (triton's triton_ops); None: the
      public ops.

    The eager fast path; without one, the public ops:

    ``bn`` below is a :class:`fusedres.ops.opdefs.BatchNormArgs`, unpacked into the call (the
    ops' schemas keep the tensors loose):

    - ``module_unit(x, weight, bias, *bn, residual, stride, padding, dilation)``: a
      ``BNReLUConv2d``'s forward in one call, ``[y]``, or ``[]`` with nothing touched for
      arguments it leaves to the checked route (whose errors name the argument).
    - ``prepare_batch_norm(x, *bn[2:], mean, var) -> (mean, invstd)`` (from the running
      statistics on), for checked arguments; ``prepares(x, bn.running_mean, bn.running_var,
      bn.training)`` says whether it takes them (None: all of them).
    - ``prepare_affine(x, *bn, mean, var) -> (mean, invstd, scale, shift)``:
      ``prepare_batch_norm`` that also makes the fused affine (the unit takes it).
    - ``unit(args, genstats, affine)``: ``args`` a :class:`fusedres.ops.opdefs.UnitArgs`,
      ``affine`` a preparation's (scale, shift) or None; ``y``, or ``(y, mean, var)`` of y
      when ``genstats``.
    - ``pair(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd, stride, padding,
      dilation, stride2, padding2, dilation2, batch_stats, genstats) -> (y, y2, mean2, var2)``
      (statistics of y2, empty unless genstats).
    - ``unit_with_shortcut(args, genstats)``: ``(y, x)`` or ``(y, x, mean, var)``, x a view the
      unit hands out (its gradient is summed in the unit's backward).
    - ``batch_stats(x) -> (mean, var)``.
    """

    name: str
    devices: tuple[str, ...] = ()
    ops: ModuleType | None = None
    unit: Callable = _public_unit
    batch_stats: Callable = _public_batch_stats
    module_unit: Callable | None = None
    prepare_batch_norm: Callable | None = None
    prepare_affine: Callable | None = None
    prepares: Callable | None = None
    pair: Callable | None = None
    unit_with_shortcut: Callable | None = None
    compiled: Backend | None = None

    def without_fast_path(self) -> Backend:
        """This backend with every call through the public ops (what a test compares the fast
        path against)."""
        return Backend(self.name, self.devices, self.ops)


# The backends, best first: auto takes the first that serves the device type and can run.
# reference serves none (asked for by name only); portable serves every device type.
TABLE: dict[str, Backend] = {
    "triton": Backend("triton", ("cuda",)),
    "cuda": Backend("cuda", ("cuda",)),
    "cpu": Backend("cpu", ("cpu",)),
    "portable": Backend("portable", ("*",)),
    "reference": Backend("reference"),
}
PUBLIC = Backend("public")  # the route of traced calls (see the module's table)


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or name not in _VALID_NAMES:
        raise ValueError(f"{what}: expected one of {', '.join(_VALID_NAMES)}, got {name!r}")
    return name


# Plain module globals (no thread-local): torch.compile guards on them, so switching backends
# after compiling retraces instead of silently keeping the old choice.
_global_name = settings.get("FUSEDRES_BACKEND")
_stack: list[str] = []
_warned: dict[str, bool] = {}  # the device types auto warned for


def backend_module(name: str) -> ModuleType:
    """The Python module implementing backend ``name`` (the portable one for ``reference``)."""
    return importlib.import_module(
        f"fusedres.backends.{'portable' if name == 'reference' else name}")


def load(name: str) -> Backend:
    """:data:`TABLE`'s record of backend ``name`` with its ops and eager fast path, loaded once
    (importing a backend's module loads its kernels)."""
    b = TABLE[name]
    if b.ops is None:
        ops = backend_module(name)
        fast_path = getattr(ops, "fast_path", None) if name != "reference" else None
        b = TABLE[name] = b._replace(ops=ops, **(fast_path() if fast_path else {}))
    return b


def auto_order(device_type: str) -> tuple[str, ...]:
    """The backends ``auto`` tries for tensors of ``device_type``, best first."""
    return tuple(b.name for b in TABLE.values() if device_type in b.devices or "*" in b.devices)


def unavailable_reason(name: str, device: torch.device | str = "cpu") -> str | None:
    """None when backend ``name`` can run on ``device``; otherwise a sentence saying why not."""
    _check_name(name, "backend")
    if name in ("auto", "reference"):
        return None
    return _unavailable_reason(name, torch.device(device).type)


@functools.cache
def _unavailable_reason(name: str, device_type: str) -> str | None:
    # Cached per device type: availability is a property of the build and the machine.
    return backend_module(name).unavailable_reason(torch.device(device_type))


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: CPU, plus CUDA when a GPU is visible)."""
    devices = [torch.device(device)] if device is not None else [torch.device("cpu")]
    if device is None and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return [b for b in BACKENDS if any(unavailable_reason(b, d) is None for d in devices)]


def set_backend(name: str) -> None:
    """Set the process-wide backend: ``auto`` or one of :data:`BACKENDS`."""
    global _global_name
    _global_name = _check_name(name, "set_backend(name)")


def get_backend() -> str:
    """The backend name in force (may be ``auto``)."""
    return _stack[-1] if _stack else _global_name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: use backend ``name`` inside the block."""
    _check_name(name, "use_backend(name)")
    _stack.append(name)
    try:
        yield
    finally:
        _stack.pop()


def resolve_backend(device: torch.device) -> str:
    """The concrete backend to run for tensors on ``device``; raises if a named one cannot run."""
    name = get_backend()
    skipped = []
    for candidate in auto_order(device.type) if name == "auto" else (name,):
        reason = _unavailable_reason(candidate, device.type)
        if reason is None:
            break
        skipped.append(f"{candidate}: {reason}")
    else:  # a backend asked for by name that cannot run (auto's last, portable, always runs)
        raise BackendUnavailableError(f"fusedres backend {name!r} cannot run on {device}: {reason}")
    if skipped and device.type not in _warned:
        _warned[device.type] = True
        warnings.warn(
            f"fusedres: using backend {candidate!r} for {device.type} tensors; skipped "
            + "; ".join(skipped),
            stacklevel=3,
        )
    return candidate


# --------------------------------------------------------------------------- the route

# (backend name in force, device type, availability rule) -> the backend that runs there, once
# resolved: which backends can run is a property of the build and the machine (a test that
# replaces the availability rule gets a key of its own).
_RESOLVED: dict[tuple, str] = {}
_TRACED_DEVICE_TYPE = "cuda"  # where torch.compile traces the triton_ops (tests trace "cpu")
_PLAIN = (Tensor, torch.nn.Parameter)


def backend_for(device: torch.device) -> Backend:
    """The record of the backend in force for tensors on ``device``, loaded: the one decision
    of every fused call. Raises :class:`BackendUnavailableError` when the backend asked for by
    name cannot run there; ``auto`` warns once when it skips one."""
    key = (get_backend(), device.type, _unavailable_reason)
    name = _RESOLVED.get(key)
    if name is None:
        name = _RESOLVED[key] = resolve_backend(device)
    return load(name)


def route(x: Tensor, weight: Tensor | None = None) -> Backend:
    """The record a fused call on ``x`` (and the convolution ``weight``, when there is one)
    runs through: :func:`backend_for` for eager tensors, a traced route otherwise (see the
    module's table)."""
    if not is_eager(x) or (weight is not None and type(weight) not in _PLAIN):
        return _traced(x)
    # backend_for's cache, read here: each call is a Python call of every fused call.
    name = _RESOLVED.get((_stack[-1] if _stack else _global_name, x.device.type,
                          _unavailable_reason))
    if name is not None:
        b = TABLE[name]
        if b.ops is not None:
            return b
    return backend_for(x.device)


def _traced(x) -> Backend:
    if isinstance(x, Tensor) and _compiled_triton(x):
        return TABLE["triton"].compiled  # loaded by _triton_runs_traced
    return PUBLIC


@torch.compiler.assume_constant_result
def _auto_traced_backend() -> str:
    # Constant for the process: which backends can run is a property of the build and machine.
    return resolve_backend(torch.device(_TRACED_DEVICE_TYPE))


@torch.compiler.assume_constant_result
def _triton_runs_traced() -> bool:
    # Run outside the trace, once per trace: it loads the record that _traced reads.
    return (unavailable_reason("triton", _TRACED_DEVICE_TYPE) is None
            and load("triton").compiled is not None)


def _compiled_triton(x: Tensor) -> bool:
    """True while torch.compile traces a unit on a GPU with the triton backend in force: then the
    unit is built from the ``fusedres_triton`` triton_ops, which Inductor sees down to their
    kernels (the public ops are opaque to it). The backend name in force is read here, so
    torch.compile guards on it and retraces when it changes."""
    if x.device.type != _TRACED_DEVICE_TYPE or not torch.compiler.is_compiling():
        return False
    name = get_backend()
    if name == "auto":
        name = _auto_traced_backend()
    return name == "triton" and _triton_runs_traced()


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)
_dispatch_depth = torch._C._len_torch_dispatch_stack
_transforms_active = torch._C._are_functorch_transforms_active


def is_eager(x) -> bool:
    """A plain, non-empty tensor in eager mode: no tracing, no dispatch mode, no torch.func
    transform, not a batched gradient (``autograd.grad(..., is_grads_batched=True)`` runs the
    backward on legacy-vmap tensors, with no transform active): what the eager routes need."""
    return not (torch.compiler.is_compiling()  # first: nothing below becomes a guard
                or type(x) is not torch.Tensor or x.numel() == 0 or _dispatch_depth()
                or _transforms_active() or _is_legacy_batched(x))


def cache_clear() -> None:
    """Forget which backend runs where and the loaded records (a test that changes what can
    run)."""
    _RESOLVED.clear()
    for name, b in TABLE.items():
        TABLE[name] = Backend(b.name, b.devices)
