"""Triton kernels of fusedres (installed as ``fusedres.kernels``)."""
