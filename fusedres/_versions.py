"""The torch and Triton versions fusedres supports, and the checks that say so.

Supported: torch >= 2.11 and, for the triton backend, triton >= 3.6. The floor is the oldest
pair that is tested: torch 2.11.0 with triton 3.6.0, the GPU machines' own packages, in CI's
compat step (``make compat``: fusedres._C built against torch 2.11, the Triton kernel tests
under the interpreter, every kernel config compiled for sm_90 by triton 3.6); the top is the
pinned pair of requirements-dev.txt (torch 2.14.1, triton 3.8.0), which the rest of CI runs.
Older releases are refused rather than half-working: nothing below the floor was ever run.

``import fusedres`` raises ImportError on an older torch (:func:`check_torch`); the Triton
kernels (``fusedres.kernels``) raise it on an older triton (:func:`check_triton`), which the
triton backend reports as its reason to be unavailable, so the other backends still work.
"""

from __future__ import annotations

import re

TORCH_MIN = (2, 11)
TRITON_MIN = (3, 6)
# The two ends CI runs (the compat step's, and requirements-dev.txt's pins).
TESTED = {"torch": ("2.11.0", "2.14.1"), "triton": ("3.6.0", "3.8.0")}


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the front of a version string: ``"2.11.0+cu130"`` -> (2, 11, 0),
    ``"2.12.0.dev20260101"`` -> (2, 12, 0), ``"3.6.0"`` -> (3, 6, 0)."""
    numbers = []
    for part in str(version).split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        numbers.append(int(m.group()))
        if m.end() != len(part):  # "0+cu130", "0a0": the rest is no release number
            break
    return tuple(numbers)


def supported() -> str:
    """The supported range, as :func:`check_torch` and :func:`check_triton` state it."""
    t, tr = TESTED["torch"], TESTED["triton"]
    return (f"fusedres supports torch >= {'.'.join(map(str, TORCH_MIN))} (tested: {t[0]} and "
            f"{t[1]}) and, for its triton backend, triton >= {'.'.join(map(str, TRITON_MIN))} "
            f"(tested: {tr[0]} and {tr[1]})")


def torch_problem(version: str) -> str | None:
    """One sentence when torch ``version`` is below the floor, else None."""
    if release(version)[:2] >= TORCH_MIN:
        return None
    return f"{supported()}; this is torch {version}."


def triton_problem(version: str) -> str | None:
    """One sentence when triton ``version`` is below the floor, else None."""
    if release(version)[:2] >= TRITON_MIN:
        return None
    return f"{supported()}; this is triton {version}."


def check_torch() -> None:
    """ImportError naming the supported versions when the installed torch is too old."""
    import torch

    problem = torch_problem(torch.__version__)
    if problem is not None:
        raise ImportError(problem)


def check_triton() -> None:
    """ImportError naming the supported versions when the installed triton is too old (none
    when triton is missing: importing a kernel module says that itself)."""
    try:
        import triton
    except ImportError:
        return
    problem = triton_problem(triton.__version__)
    if problem is not None:
        raise ImportError(problem)
