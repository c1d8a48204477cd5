"""Activation checkpointing that leaves BatchNorm running statistics alone on recomputation.

``torch.utils.checkpoint`` recomputes a segment's forward during backward. A training-mode
BatchNorm in that segment updates its running statistics a second time (and increments
``num_batches_tracked``), so a checkpointed network drifts from the same network trained
without checkpointing. Here the recomputation runs inside a context that snapshots every buffer
of the segment's modules and writes the snapshot back when the recomputation ends: the forward
pass counts the batch once, the recomputation not at all. The recomputed values themselves are
unaffected (training-mode BatchNorm normalises with batch statistics, not running ones).

Works for fused and plain modules alike (it restores buffers, it does not look at classes).

(Activation checkpoints, recomputed in backward: not the trainer's run checkpoints, which are
``fusedres.apps.train.checkpoint``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as _torch_checkpoint
from torch import Tensor

__all__ = ["RestoreBuffers", "checkpoint", "checkpoint_segments", "draws_random",
           "even_segments"]


class RestoreBuffers:
    """Context manager: snapshot the buffers of ``modules`` on enter, restore them on exit.

    Exit also runs when the recomputation stops early (PyTorch raises inside the context once
    it has every tensor it needs), so the buffers are restored in every case.
    """

    def __init__(self, modules: Iterable[nn.Module]):
        seen: set[int] = set()
        self._buffers: list[Tensor] = []
        for m in modules:
            for b in m.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    self._buffers.append(b)
        self._saved: list[Tensor] = []

    def __enter__(self):
        with torch.no_grad():
            self._saved = [b.clone() for b in self._buffers]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, s in zip(self._buffers, self._saved):
                b.copy_(s)
        self._saved = []
        return False


def checkpoint(fn: Callable[..., Any], *args, modules: Iterable[nn.Module] | None = None,
               preserve_rng_state: bool = True, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` without keeping its intermediate activations; they are recomputed
    in backward. Non-reentrant (``torch.utils.checkpoint`` with ``use_reentrant=False``), so
    ``torch.autograd.grad`` and inputs that do not require grad work.

    ``modules``: the modules whose buffers the recomputation must not change (BatchNorm running
    statistics); default ``[fn]`` when ``fn`` is an ``nn.Module``. Give them explicitly when
    ``fn`` is a plain function that calls modules.
    """
    if modules is None:
        modules = [fn] if isinstance(fn, nn.Module) else []
    modules = list(modules)
    if torch.compiler.is_compiling():
        # Dynamo traces the segment once into a checkpoint region and the compiled backward
        # recomputes it from that graph, in which buffer updates happen once, in the forward
        # (tests/test_planner.py checks the running statistics); it rejects a custom
        # context_fn.
        return _torch_checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                            preserve_rng_state=preserve_rng_state, **kwargs)
    return _torch_checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
        context_fn=lambda: (contextlib.nullcontext(), RestoreBuffers(modules)), **kwargs)


def _run(units: Sequence[nn.Module]) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        for u in units:
            x = u(x)
        return x
    return run


def draws_random(modules: Iterable[nn.Module]) -> bool:
    """Whether running ``modules`` in training can draw random numbers: torch's dropout layers
    with ``p > 0``, units with ``drop_path`` or a ``"dropout"`` shortcut."""
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                return True
            if getattr(sub, "drop_path", 0) > 0 or (
                    getattr(sub, "shortcut_kind", None) == "dropout"
                    and getattr(sub, "shortcut_dropout", 0) > 0):
                return True
    return False


def checkpoint_segments(units: Sequence[nn.Module], x: Tensor,
                        segments: Sequence[tuple[int, int]]) -> Tensor:
    """Run ``units`` in order on ``x``; each ``(start, stop)`` range in ``segments`` (sorted,
    disjoint, indices into ``units``) runs as one checkpointed segment, the rest normally.

    Saved for backward: the input of each segment, and everything the other units save.
    During backward one segment at a time is recomputed.

    Under CUDA graph capture a segment that draws no random numbers (:func:`draws_random`)
    keeps no RNG state: reading a CUDA generator's state is an error during a capture, and a
    recomputation that draws nothing needs none. Outside a capture, or when it draws, the state
    is kept as ``torch.utils.checkpoint`` keeps it.
    """
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    i = 0
    for start, stop in segments:
        for u in units[i:start]:
            x = u(x)
        seg = list(units[start:stop])
        x = checkpoint(_run(seg), x, modules=seg,
                       preserve_rng_state=not capturing or draws_random(seg))
        i = stop
    for u in units[i:]:
        x = u(x)
    return x


def even_segments(n_units: int, n_segments: int) -> list[tuple[int, int]]:
    """``n_segments`` contiguous ranges covering ``range(n_units)`` with sizes differing by at
    most one (``n_segments`` larger than ``n_units`` gives one unit per segment)."""
    if n_segments <= 0 or n_units == 0:
        return []
    n_segments = min(n_segments, n_units)
    base, extra = divmod(n_units, n_segments)
    out, start = [], 0
    for k in range(n_segments):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out
