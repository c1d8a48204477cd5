"""Deprecated name of :mod:`fusedres.activation_checkpoint` (BatchNorm-safe activation
checkpointing), renamed so that it is not mistaken for the trainer's run checkpoints
(``fusedres.train.checkpoint``). Importing it warns; it goes in a later release."""

from __future__ import annotations

import warnings

from .activation_checkpoint import checkpoint, checkpoint_segments, even_segments

__all__ = ["checkpoint", "checkpoint_segments", "even_segments"]

warnings.warn("fusedres.checkpoint is renamed fusedres.activation_checkpoint; import it from there",
              DeprecationWarning, stacklevel=2)
