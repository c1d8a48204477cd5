"""Where a fused call runs: the one decision, for every entry point.

Every caller of the fused ops (``BNReLUConv2d.forward``, ``functional.prepare_batch_norm``, the
fused convolutions of :mod:`fusedres.functional`: a unit, a projection shortcut paired with
conv1, conv1 with its identity shortcut, and the batch statistics) asks :func:`route` with the
tensor it is about to run on and gets a :class:`Route`: a record of callables, one field a kind
of call, ``None`` where the route has no short form and the caller composes the call from the
fields that remain (a pair from two units, a shortcut from ``x`` and a unit, a preparation from
PyTorch ops, a module's forward from checks, preparation and unit).

=================  ===========  ==========  ===========  ==========  ==========  ===========
route              module_unit  prepare     unit         pair        shortcut    batch_stats
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
arguments' metadata, *triton_ops* the
``fusedres_triton`` ops that torch.compile decomposes into their kernels on a GPU
(``CompiledUnit``), *public op* ``fusedres::<op>`` (its autograd rule, then the backend's op).
*Compiled* is a graph that torch.compile traces with the triton backend in force on a GPU;
*public* every other call: the portable backend, and tracing, dispatch modes, torch.func
transforms, empty batches and weights that are tensor subclasses on every backend.

*Eager* is a plain, non-empty tensor outside any trace, dispatch mode or torch.func
transform, with a plain weight (a tensor or ``nn.Parameter``, not a subclass such as DTensor,
whose data a kernel would read raw). The reference backend's BatchNorm never reaches the ops
(fusedres.functional keeps its activation). The backend is the
one in force for the tensor's device (:mod:`fusedres.ops._backend`); a backend asked for by name
that cannot run raises there. The routes per backend are data (:data:`EAGER`), so a test or a
benchmark compares two routes by replacing one field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from . import _backend, _extension
from ._backend import is_eager

__all__ = ["EAGER", "PUBLIC", "Route", "eager_route", "route"]


class Route(NamedTuple):
    """The callables of one route; see the module's table for which run where.

    - ``module_unit(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
      num_batches_tracked, training, momentum, eps, residual, stride, padding, dilation)``: a
      ``BNReLUConv2d``'s forward in one call, ``[y]``, or ``[]`` with nothing touched for
      arguments it leaves to the checked route (whose errors name the argument).
    - ``prepare_batch_norm(x, running_mean, running_var, num_batches_tracked, training,
      momentum, eps, mean, var) -> (mean, invstd)``, for checked arguments; ``prepares(x,
      running_mean, running_var, training)`` says whether it takes them (None: all of them).
    - ``prepare_affine(x, bn_weight, bn_bias, running_mean, ..., var) -> (mean, invstd, scale,
      shift)``: ``prepare_batch_norm`` that also makes the fused affine (the unit takes it).
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
    unit: Callable
    batch_stats: Callable
    module_unit: Callable | None = None
    prepare_batch_norm: Callable | None = None
    prepare_affine: Callable | None = None
    prepares: Callable | None = None
    pair: Callable | None = None
    unit_with_shortcut: Callable | None = None


def _public_unit(args, genstats: bool, affine=None):
    if genstats:
        return torch.ops.fusedres.bn_relu_conv2d_genstats(*args)
    return torch.ops.fusedres.bn_relu_conv2d(*args)


def _public_batch_stats(x: Tensor):
    return tuple(torch.ops.fusedres.batch_stats(x))


PUBLIC = Route("public", _public_unit, _public_batch_stats)


def _compiled_triton_route() -> Route:
    from ..backends import triton as tb

    return Route("triton-compiled", tb.compiled_unit, tb.compiled_batch_stats)


def _cpu_route() -> Route | None:
    if not _extension.LOADED:  # the namespace may then lack the ops
        return None
    from .. import ops
    from ..backends import cpu

    return Route("cpu", ops.EagerCpuUnit, cpu.batch_stats_tuple, module_unit=cpu.module_unit,
                 prepare_batch_norm=cpu.prepare_batch_norm, pair=cpu.eager_pair,
                 unit_with_shortcut=cpu.eager_unit_with_shortcut)


def _cuda_route() -> Route:
    from .. import ops
    from ..backends import cuda

    node = cuda.eager_unit_op  # None where the extension lacks the C++ node
    return Route("cuda", cuda.eager_unit if node is None else ops.eager_unit_of(node),
                 _public_batch_stats, module_unit=cuda.module_unit,
                 prepare_batch_norm=cuda.prepare_batch_norm, pair=cuda.eager_pair)


def _triton_route() -> Route:
    from ..backends import triton as tb

    return Route("triton", tb.eager_unit, _public_batch_stats, module_unit=tb.module_unit,
                 prepare_batch_norm=tb.prepare_batch_norm, prepare_affine=tb.prepare_affine,
                 prepares=tb.prepares)


# The eager route of each backend, built on first use (importing a backend module loads its
# kernels); a backend without one (portable) takes the public ops.
_BUILDERS = {"cpu": _cpu_route, "cuda": _cuda_route, "triton": _triton_route}
EAGER: dict[str, Route] = {}
# (backend name in force, device type) -> the backend that runs there, once resolved: which
# backends can run is a property of the build and the machine (fusedres.ops._backend caches it too).
_RESOLVED: dict[tuple, str] = {}
_TRACED_DEVICE_TYPE = "cuda"  # where torch.compile traces the triton_ops (tests trace "cpu")
_PLAIN = (Tensor, torch.nn.Parameter)


def eager_route(name: str) -> Route:
    """Backend ``name``'s eager route (:data:`PUBLIC` for one without)."""
    r = EAGER.get(name)
    if r is None:
        builder = _BUILDERS.get(name)
        r = (builder() if builder is not None else None) or PUBLIC
        EAGER[name] = r
    return r


def route(x: Tensor, weight: Tensor | None = None) -> Route:
    """The route of a fused call on ``x`` (and the convolution ``weight``, when there is one):
    see the module's table. Raises :class:`fusedres.BackendUnavailableError` when the backend
    asked for by name cannot run on ``x``'s device."""
    if not is_eager(x) or (weight is not None and type(weight) not in _PLAIN):
        return _traced(x)
    key = (_backend._stack[-1] if _backend._stack else _backend._global_name, x.device.type,
           _backend._unavailable_reason)  # a test that replaces the availability rule
    name = _RESOLVED.get(key)
    if name is None:
        # Raises for a named backend that cannot run; auto warns once when it skips one.
        name = _RESOLVED[key] = _backend.resolve_backend(x.device)
    r = EAGER.get(name)
    return r if r is not None else eager_route(name)


def _traced(x) -> Route:
    if isinstance(x, Tensor) and _compiled_triton(x):
        r = EAGER.get("triton-compiled")
        if r is None:
            r = EAGER["triton-compiled"] = _compiled_triton_route()
        return r
    return PUBLIC


@torch.compiler.assume_constant_result
def _auto_traced_backend() -> str:
    # Constant for the process: which backends can run is a property of the build and machine.
    return _backend.resolve_backend(torch.device(_TRACED_DEVICE_TYPE))


@torch.compiler.assume_constant_result
def _triton_runs_traced() -> bool:
    return _backend.unavailable_reason("triton", _TRACED_DEVICE_TYPE) is None


def _compiled_triton(x: Tensor) -> bool:
    """True while torch.compile traces a unit on a GPU with the triton backend in force: then the
    unit is built from the ``fusedres_triton`` triton_ops, which Inductor sees down to their
    kernels (the public ops are opaque to it). The backend name in force is read here, so
    torch.compile guards on it and retraces when it changes."""
    if x.device.type != _TRACED_DEVICE_TYPE or not torch.compiler.is_compiling():
        return False
    name = _backend.get_backend()
    if name == "auto":
        name = _auto_traced_backend()
    return name == "triton" and _triton_runs_traced()


def cache_clear() -> None:
    """Forget which backend runs where (a test that changes what can run) and the routes."""
    _RESOLVED.clear()
    EAGER.clear()
