"""Seeds derived from the run's seed: one stream per purpose (data order, augmentation,
directions of a landscape...), the same on every machine, Python and process count."""

from __future__ import annotations

import hashlib

__all__ = ["derived_seed"]


def derived_seed(seed: int, stream: str, index: int) -> int:
    """A 63-bit seed for (seed, stream, index), the same on every machine and Python."""
    digest = hashlib.sha256(f"{seed}:{stream}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
