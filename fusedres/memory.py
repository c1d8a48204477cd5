"""Saved-activation accounting: what autograd keeps between forward and backward.

A count, not a timing: exact and the same on every machine, so tests can assert it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorTracker", "SavedTensor", "SavedTensorCounter", "plan", "saved_bytes",
           "saved_tensors"]


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl pointer identifies a storage on every device, meta included.
    return t.untyped_storage()._cdata


class SavedTensorCounter:
    """Context manager recording the distinct storages autograd saves inside the block.

    ``exclude``: a module whose parameters and buffers are not counted (they are kept whether or
    not autograd saves them). After the block, :attr:`saved` lists one :class:`SavedTensor` per
    storage and :attr:`total_bytes` sums them. Usable around a real training step: the counted
    tensors are released when the block ends, the graph keeps what it needs.
    """

    def __init__(self, exclude: nn.Module | None = None):
        self._excluded = set()
        if exclude is not None:
            self._excluded = {_storage_key(t) for t in (*exclude.parameters(), *exclude.buffers())}
        self._found: dict[int, SavedTensor] = {}
        self._kept: list[torch.Tensor] = []  # no storage address is reused while counting
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        self._kept.append(t)
        if key not in self._excluded and key not in self._found:
            self._found[key] = SavedTensor(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._kept.clear()

    @property
    def saved(self) -> list[SavedTensor]:
        return list(self._found.values())

    @property
    def total_bytes(self) -> int:
        return sum(s.storage_bytes for s in self._found.values())


class LiveTensorTracker(TorchDispatchMode):
    """Context manager measuring the bytes of tensor storages created inside the block that are
    alive at once, on any device (meta and fake tensors included).

    Every storage an op run under it returns is counted from its creation until it is freed
    (a finalizer on the storage), each storage once however many views share it. Storages that
    existed before the block (parameters, the input) are not counted unless handed to
    :meth:`count`; buffers a kernel allocates and frees inside one op are never counted (they
    do not reach the dispatcher).

    The whole-step peak of a training step, on any device::

        with LiveTensorTracker() as live:
            live.count(model, optimizer, x)       # parameters, buffers, grads, optimizer state
            loss_fn(model(x), y).backward(); optimizer.step()
        live.peak_bytes

    :attr:`current_bytes` is what is alive now, :attr:`peak_bytes` the most that was alive at
    any point since entering; :meth:`reset_peak` restarts the peak from the current figure.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until it is freed (once per storage)."""
        st = t.untyped_storage()
        key = _storage_key(t)
        if key in self._live:
            return
        self._live[key] = st.nbytes()
        self.current_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(st, self._free, key)

    def count(self, *objs: torch.Tensor | nn.Module | torch.optim.Optimizer) -> None:
        """Count storages that already exist: tensors, a module's parameters, buffers and
        gradients, an optimizer's state tensors (each storage once, until freed)."""
        for obj in objs:
            if isinstance(obj, torch.Tensor):
                tensors = [obj]
            elif isinstance(obj, nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
                tensors += [p.grad for p in obj.parameters() if p.grad is not None]
            elif isinstance(obj, torch.optim.Optimizer):
                tensors = [v for state in obj.state.values() for v in tree_flatten(state)[0]
                           if isinstance(v, torch.Tensor)]
            else:
                raise TypeError(f"count(*objs): expected tensors, modules or optimizers, got "
                                f"{type(obj).__name__}")
            for t in tensors:
                self.track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def saved_tensors(fn: Callable[..., Any], *args, **kwargs) -> list[SavedTensor]:
    """Distinct storages saved for backward while ``fn(*args, **kwargs)`` runs, one entry per
    storage (views of one storage count once). When ``fn`` is an ``nn.Module`` its parameters
    and buffers are not counted: they are kept whether or not autograd saves them."""
    counter = SavedTensorCounter(fn if isinstance(fn, nn.Module) else None)
    with counter:
        out = fn(*args, **kwargs)
        del out
    return counter.saved


def saved_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Bytes of the distinct storages saved for backward by ``fn(*args, **kwargs)``."""
    return sum(s.storage_bytes for s in saved_tensors(fn, *args, **kwargs))


def plan(*args, **kwargs):
    """Choose activation checkpointing so one training step fits a memory budget; see
    :func:`fusedres.planner.plan` (imported lazily: the planner imports the flop counter)."""
    from .planner import plan as _plan
    return _plan(*args, **kwargs)
