"""Helpers the benchmark files share (imported by name; pytest puts benchmarks/ on sys.path)."""

from __future__ import annotations

import os
import platform

import torch

import fusedres

# FUSEDRES_BENCH_QUICK=1: tiny shapes and few rounds, so CI can smoke-run every benchmark file.
QUICK = os.environ.get("FUSEDRES_BENCH_QUICK") == "1"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> str:
    return (f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), fusedres {fusedres.__version__}, "
            f"backends {', '.join(fusedres.available_backends('cpu'))}")
