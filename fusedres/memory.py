"""Saved-activation accounting: what autograd keeps between forward and backward.

A count, not a timing: exact and the same on every machine, so tests can assert it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["SavedTensor", "plan", "saved_bytes", "saved_tensors"]


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl pointer identifies a storage on every device, meta included.
    return t.untyped_storage()._cdata


def saved_tensors(fn: Callable[..., Any], *args, **kwargs) -> list[SavedTensor]:
    """Distinct storages saved for backward while ``fn(*args, **kwargs)`` runs, one entry per
    storage (views of one storage count once). When ``fn`` is an ``nn.Module`` its parameters
    and buffers are not counted: they are kept whether or not autograd saves them."""
    excluded = set()
    if isinstance(fn, nn.Module):
        excluded = {_storage_key(t) for t in (*fn.parameters(), *fn.buffers())}
    kept: list[torch.Tensor] = []  # hold references so no storage address is reused mid-count
    found: dict[int, SavedTensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        kept.append(t)
        if key not in excluded and key not in found:
            found[key] = SavedTensor(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out
    kept.clear()
    return list(found.values())


def saved_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Bytes of the distinct storages saved for backward by ``fn(*args, **kwargs)``."""
    return sum(s.storage_bytes for s in saved_tensors(fn, *args, **kwargs))


def plan(*args, **kwargs):
    """Choose activation checkpointing so one training step fits a memory budget; see
    :func:`fusedres.planner.plan` (imported lazily: the planner imports the flop counter)."""
    from .planner import plan as _plan
    return _plan(*args, **kwargs)
