"""The PEP 517 build backend (pyproject.toml): setuptools', with one dynamic build requirement.

A build that compiles the CUDA part of ``fusedres._C`` compiles the cuda backend's CUTLASS
kernels (csrc/cuda/cutlass_conv) against the headers of the ``nvidia-cutlass`` package, so such a
build asks for that package; a CPU-only build (``FUSEDRES_BUILD_CUDA=0``, or no nvcc) does not
download it. Every other hook is setuptools' own.
"""

from __future__ import annotations

import os
import shutil

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every hook setuptools defines

# The headers' release, pinned as requirements-dev.txt pins it (tests/test_layout.py keeps the
# two equal).
CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"


def builds_cuda(environ=None) -> bool:
    """Whether setup.py may build the CUDA part: FUSEDRES_BUILD_CUDA=1, or auto (the default)
    with nvcc on PATH or under CUDA_HOME (setup.py also needs a CUDA build of torch, which the
    isolated environment has not installed yet when this is asked)."""
    environ = os.environ if environ is None else environ
    switch = environ.get("FUSEDRES_BUILD_CUDA", "auto").strip().lower()
    if switch in ("0", "1"):
        return switch == "1"
    home = environ.get("CUDA_HOME", "")
    return shutil.which("nvcc") is not None or (
        bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")))


def _cutlass(config_settings=None) -> list[str]:
    return [CUTLASS_REQUIREMENT] if builds_cuda() and not os.environ.get("CUTLASS_PATH") else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cutlass()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _cutlass()
