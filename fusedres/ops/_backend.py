"""Backend registry and selection.

A *backend* is an implementation of the three ``fusedres`` ops (batch statistics, fused forward,
fused backward) for some devices. ``reference`` is special: it is the plain PyTorch composition
and bypasses the ops entirely (it saves the activations, it is the oracle).

Selection order: ``use_backend`` context > ``set_backend`` > env ``FUSEDRES_BACKEND`` > ``auto``.
``auto`` takes, for the tensor's device, the first backend in ``AUTO_ORDER`` that can run, warning
once when it had to skip a compiled one. A backend asked for by name that cannot run raises
:class:`BackendUnavailableError` with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Iterator

import torch

from .. import settings

BACKENDS = ("reference", "portable", "cpu", "triton", "cuda")
# Best first. The compiled backends fill in through later issues; portable always runs.
AUTO_ORDER = {
    "cpu": ("cpu", "portable"),
    "cuda": ("triton", "cuda", "portable"),
}
_VALID_NAMES = ("auto",) + BACKENDS


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name and cannot run here; the message says why."""


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or name not in _VALID_NAMES:
        raise ValueError(f"{what}: expected one of {', '.join(_VALID_NAMES)}, got {name!r}")
    return name


# Plain module globals (no thread-local): torch.compile guards on them, so switching backends
# after compiling retraces instead of silently keeping the old choice.
_global_name = settings.get("FUSEDRES_BACKEND")
_stack: list[str] = []
_warned: set[str] = set()


def backend_module(name: str):
    """The Python module implementing backend ``name`` (not ``reference``)."""
    return importlib.import_module(f"fusedres.backends.{name}")


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
    if name != "auto":
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise BackendUnavailableError(
                f"fusedres backend {name!r} cannot run on {device}: {reason}")
        return name
    skipped = []
    for candidate in AUTO_ORDER.get(device.type, ("portable",)):
        reason = unavailable_reason(candidate, device)
        if reason is None:
            break
        skipped.append(f"{candidate}: {reason}")
    if skipped and device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(
            f"fusedres: using backend {candidate!r} for {device.type} tensors; skipped "
            + "; ".join(skipped),
            stacklevel=3,
        )
    return candidate


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
