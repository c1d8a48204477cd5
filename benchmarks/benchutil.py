"""Helpers the benchmark files share (imported by name; pytest puts benchmarks/ on sys.path).

The shapes and the measuring code are ``fusedres.apps.bench``'s (one copy for these files, the
``fusedres bench`` CLI and the self-test): ``fusedres.models.unit_shapes`` holds the tables,
``fusedres.apps.bench.units.make_case``/``make_step`` build the timed step of each candidate.
"""

from __future__ import annotations

import torch

from fusedres import settings
from fusedres.apps.bench.report import machine, machine_line

__all__ = ["QUICK", "machine_info"]

# FUSEDRES_BENCH_QUICK=1: tiny shapes and few rounds, so CI can smoke-run every benchmark file.
QUICK = settings.get("FUSEDRES_BENCH_QUICK")


def machine_info() -> str:
    return machine_line(machine(torch.device("cpu")))

