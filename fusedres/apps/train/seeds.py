"""Seeds derived from the run's seed: one stream per purpose (data order, augmentation,
directions of a landscape...), the same on every machine, Python and process count."""

from __future__ import annotations

import hashlib
import random

import numpy as np

__all__ = ["derived_seed", "seed_python_and_numpy"]


def derived_seed(seed: int, stream: str, index: int) -> int:
    """A 63-bit seed for (seed, stream, index), the same on every machine and Python."""
    digest = hashlib.sha256(f"{seed}:{stream}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_python_and_numpy(seed: int) -> None:
    """Seed Python's ``random`` and NumPy's global generator from the run's ``--seed`` (torch's
    is seeded beside it), so that code drawing from them (a user's augmentation, a library)
    is reproducible; their states go into checkpoints (checkpoint.rng_state)."""
    random.seed(seed)
    # NumPy's legacy seed takes 32-bit words: a small seed as itself (what users expect of
    # np.random.seed(0)), a larger one as all of its words, never truncated.
    if seed < 2**32:
        np.random.seed(seed)
    else:
        np.random.seed([(seed >> (32 * i)) & 0xFFFFFFFF
                        for i in range((seed.bit_length() + 31) // 32)])
