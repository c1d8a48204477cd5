"""Loads the compiled extension ``fusedres._C`` if it was built; never raises.

The C++ kernels' op namespaces (``fusedres_cpu``, ``fusedres_cuda``) are defined here from
:data:`fusedres.ops.opdefs.SCHEMAS` whether or not the extension is built; the extension registers
implementations only. It is loaded first, then the schemas defined: the dispatcher checks each
registered C++ function against its schema then, and a mismatch (an extension built from other
sources) becomes ``LOAD_ERROR`` instead of an abort inside the library's loader. Each op also
gets a ``Meta`` kernel here that refuses the call by name (:func:`refuse_meta`).

``LOAD_ERROR`` says why the extension is missing (used in backend error messages).

The test extension ``fusedres._C_cuda_on_cpu`` (csrc/cuda executed on CPU: the ``fusedres_cuda``
ops' CPU kernels, and the layer's test ops) is loaded on demand by :func:`load_cuda_on_cpu`, after
the schemas exist; it registers from its module initialiser, so a mismatch there is an
ImportError too.

:func:`cpu_tile_samples` is the CPU kernels' batch tiling rule, from the extension itself;
:func:`cpu_capability` the CPU capability its kernels run with (csrc/cpu/capability.h), chosen
when it was loaded; ``CPU_CAPABILITY_ERROR`` why there is none (FUSEDRES_CPU_CAPABILITY names
one this CPU or build lacks), which makes the cpu backend unavailable.
"""

from __future__ import annotations

import importlib

import torch

from . import opdefs
from .checks import check_devices

LOADED = False
LOAD_ERROR: str | None = None
NAMESPACES = ("fusedres_cpu", "fusedres_cuda")

try:
    importlib.import_module("fusedres._C")  # registers its kernels with the dispatcher
    LOADED = True
except ImportError as exc:  # not built (Python-only install) or built for another torch
    LOAD_ERROR = f"the compiled extension fusedres._C is not available ({exc})"


CPU_CAPABILITY_ERROR: str | None = None
if LOADED:
    try:
        importlib.import_module("fusedres._C").cpu_capability()
    except AttributeError:  # built from older sources
        LOADED = False
        LOAD_ERROR = "fusedres._C is older than these sources (no cpu_capability): rebuild it"
    except RuntimeError as exc:
        CPU_CAPABILITY_ERROR = str(exc)


def _schema_error(exc: Exception) -> str:
    # The dispatcher's message: a headline, then "operator:", the two schemas and "reason:".
    lines = [line.strip() for line in str(exc).splitlines()]
    keep = [line for line in lines[1:] if line.startswith(("operator:", "reason:"))]
    return " ".join(lines[:1] + keep)


def refuse_meta(lib: torch.library.Library, namespace: str) -> None:
    """Give each op of ``namespace`` (defined in ``lib``) a ``Meta`` kernel: the refusal
    :func:`fusedres.ops.checks.check_devices`. The dispatcher picks that key for a call with a
    meta tensor among its arguments, and the C++ kernels never take one (they read memory):
    without it such a call ended in the dispatcher's "no fake impl or Meta kernel", naming no
    argument. An op the extension implements as a composite keeps that (its C++ function runs
    for every key and checks every device first)."""
    for name, schema in {**opdefs.SCHEMAS, **opdefs.NAMESPACE_SCHEMAS.get(namespace, {})}.items():
        qualified = f"{namespace}::{name}"
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
            continue
        names = [a.name for a in torch._C.parse_schema(qualified + schema).arguments]

        def refuse(*args, _where=f"{namespace}.{name}", _names=names, **kwargs):
            check_devices(_where, _names, args, kwargs)

        lib.impl(name, refuse, "Meta")


_LIBRARIES = []
for _namespace in NAMESPACES:
    try:
        _LIBRARIES.append(opdefs.define_namespace(_namespace))
        refuse_meta(_LIBRARIES[-1], _namespace)
    except RuntimeError as exc:  # a kernel of fusedres._C does not match its schema
        LOADED = False
        LOAD_ERROR = (f"fusedres._C does not match the op schemas of fusedres/ops/opdefs.py "
                      f"(rebuild it): {_schema_error(exc)}")


def op_handles(module_name: str, module_globals: dict, namespace: str):
    """A module ``__getattr__`` giving, under the names of :data:`fusedres.ops.opdefs.SCHEMAS`, the
    op handles ``torch.ops.<namespace>.<op>``, each looked up on first use and then kept in the
    module: a namespace whose definition failed (``LOAD_ERROR``) must not break importing the
    backend module."""

    def __getattr__(name: str):
        if name in opdefs.SCHEMAS:
            op = getattr(getattr(torch.ops, namespace), name)
            module_globals[name] = op  # later lookups find it directly
            return op
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def has_kernels(namespace: str, dispatch_key: str, *names: str) -> bool:
    """Whether every op ``<namespace>::<name>`` has a kernel for ``dispatch_key``."""
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", dispatch_key)
        for name in names
    )


def cpu_tile_samples(n: int, bytes_per_sample: int, weight_bytes: int,
                     channels_last: bool = False) -> int | None:
    """Samples per batch tile of the cpu backend's fused unit, for a batch of ``n`` samples of
    ``bytes_per_sample`` bytes each (activation + output, in the weight's dtype), a weight of
    ``weight_bytes`` and an input in channels_last (``channels_last``) or NCHW: the rule
    csrc/cpu/bn_relu_conv2d.cpp runs, evaluated now (it reads FUSEDRES_CPU_TILE_BYTES
    and torch's thread count). None when ``fusedres._C`` is not
    loaded."""
    if not LOADED:
        return None
    return importlib.import_module("fusedres._C").cpu_tile_samples(
        int(n), int(bytes_per_sample), int(weight_bytes), bool(channels_last))


def cpu_capability() -> str | None:
    """The CPU capability the cpu backend's kernels run with: ``"baseline"`` (x86-64-v2, or
    any other architecture), ``"avx2"`` or ``"avx512"``; ``FUSEDRES_CPU_CAPABILITY``'s when it
    is set, else the best this CPU supports. None when ``fusedres._C`` is not loaded; raises
    RuntimeError (why) when the variable names a capability this CPU or build lacks."""
    if not LOADED:
        return None
    return importlib.import_module("fusedres._C").cpu_capability()


def cuda_kernel_sets() -> tuple[str, ...]:
    """The values of ``FUSEDRES_CUDA_KERNELS`` the loaded ``fusedres._C``'s cuda backend
    honours: ``("native",)``, or ``("native", "cutlass")`` when it was built with the CUTLASS
    kernels (csrc/cuda/cutlass_conv); ``()`` when the extension is not loaded."""
    if not LOADED:
        return ()
    ext = importlib.import_module("fusedres._C")
    return tuple(ext.cuda_kernel_sets()) if hasattr(ext, "cuda_kernel_sets") else ("native",)


def cutlass_launches() -> int:
    """The cuda backend's CUTLASS kernels launched in this process so far (0 without the
    extension or without those kernels): a cuda:cutlass self-test case checks it grew, so a
    case that fell back to the native kernels is not taken for a CUTLASS result."""
    if not LOADED:
        return 0
    ext = importlib.import_module("fusedres._C")
    return int(ext.cutlass_launches()) if hasattr(ext, "cutlass_launches") else 0


def describe_cpu_capability() -> str:
    """One line for people (``fusedres settings``): the capability in use, those built into
    ``fusedres._C`` and those this CPU runs; or why there is none."""
    if not LOADED:
        return f"none ({LOAD_ERROR})"
    ext = importlib.import_module("fusedres._C")
    features = set(ext.cpu_features())
    built = [name for name, _ in ext.cpu_capabilities()]
    runs = [name for name, need in ext.cpu_capabilities() if set(need) <= features]
    where = f"built: {', '.join(built)}; this CPU runs: {', '.join(runs) or '(none)'}"
    if CPU_CAPABILITY_ERROR is not None:
        return f"none ({CPU_CAPABILITY_ERROR}; {where})"
    return f"{ext.cpu_capability()} ({where})"


CUDA_ON_CPU_MODULE = "fusedres._C_cuda_on_cpu"
_cuda_on_cpu_error: list[str | None] = []  # filled by the first load_cuda_on_cpu()


def load_cuda_on_cpu() -> str | None:
    """Import the test extension ``fusedres._C_cuda_on_cpu`` once; None when it is loaded, else
    why not. It registers the ``fusedres_cuda`` CPU kernels against the schemas defined above."""
    if not _cuda_on_cpu_error:
        try:
            importlib.import_module(CUDA_ON_CPU_MODULE)
            error = None
        except ModuleNotFoundError as exc:
            if exc.name != CUDA_ON_CPU_MODULE:
                raise
            error = (f"the test extension {CUDA_ON_CPU_MODULE} is not built (make test builds it; "
                     "FUSEDRES_BUILD_TEST_EXT=1)")
        except ImportError as exc:  # built for another torch, or from other sources
            error = f"the test extension {CUDA_ON_CPU_MODULE} cannot be loaded ({exc})"
        _cuda_on_cpu_error.append(error)
    return _cuda_on_cpu_error[0]
