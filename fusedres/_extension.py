"""Loads the compiled extension ``fusedres._C`` if it was built; never raises.

``LOAD_ERROR`` says why it is missing (used in backend error messages).
"""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (torch's libraries must be loaded before fusedres._C links to them)

LOADED = False
LOAD_ERROR: str | None = None

try:
    importlib.import_module("fusedres._C")  # registers its ops with the dispatcher
    LOADED = True
except ImportError as exc:  # not built (Python-only install) or built for another torch
    LOAD_ERROR = f"the compiled extension fusedres._C is not available ({exc})"


def has_kernels(namespace: str, dispatch_key: str, *names: str) -> bool:
    """Whether every op ``<namespace>::<name>`` has a kernel for ``dispatch_key``."""
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", dispatch_key)
        for name in names
    )
