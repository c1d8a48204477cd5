"""Triton kernels of fusedres (installed as ``fusedres.kernels``)."""

# First: an older triton is refused by name; triton 3.6's interpreter gets 3.8's scalar rule.
from . import _compat  # noqa: F401
