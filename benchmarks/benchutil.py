"""Helpers the benchmark files share (imported by name; pytest puts benchmarks/ on sys.path).

The shapes and the measuring code are ``fusedres.apps.bench``'s (one copy for these files, the
``fusedres bench`` CLI and the self-test): ``fusedres.models.unit_shapes`` holds the tables,
``fusedres.apps.bench.units.make_case``/``make_step`` build the timed step of each candidate.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from fusedres import settings
from fusedres.apps.bench.measure import time_interleaved
from fusedres.apps.bench.report import cpu_model, machine, machine_line

__all__ = ["QUICK", "ab_row", "cpu_model", "machine_info"]

# FUSEDRES_BENCH_QUICK=1: tiny shapes and few rounds, so CI can smoke-run every benchmark file.
QUICK = settings.get("FUSEDRES_BENCH_QUICK")


def machine_info() -> str:
    return machine_line(machine(torch.device("cpu")))


def ab_row(name: str, steps: dict[str, Callable[[], object]], rounds: int, widths: list[int],
           clock: Callable[[], float] = time.perf_counter) -> str:
    """One row of an A/B script (conv_layout_ab.py, strided_gemm_ab.py): ``steps`` timed
    interleaved on CPU (samples of at least 50 ms, 2 warm-up calls each, ``rounds`` samples),
    then ``name``, the first step's median in ms and every other step's median over it, in
    columns of ``widths`` (name's, then one per step)."""
    times = time_interleaved(steps, torch.device("cpu"), warmup=2, reps=rounds,
                             min_sample_s=0.05, clock=clock)
    med = [statistics.median(v) for v in times.values()]
    cells = [f"{name:{widths[0]}s}", f"{med[0] * 1e3:{widths[1]}.2f}"]
    cells += [f"{m / med[0]:{w}.3f}" for m, w in zip(med[1:], widths[2:])]
    return " ".join(cells)


def with_route(backend: str, fn: Callable[[], object], **fields) -> Callable[[], object]:
    """``fn`` run with backend ``backend``'s eager route (fusedres.ops.route.EAGER) given ``fields``
    (e.g. ``module_unit=None``: the checked Python route instead of the one call); ``public=
    True`` for the public ops throughout."""
    from fusedres.ops import route

    def run():
        saved = route.EAGER.get(backend)
        base = route.eager_route(backend)
        if fields.get("public"):
            route.EAGER[backend] = route.PUBLIC
        else:
            route.EAGER[backend] = base._replace(**fields)
        try:
            return fn()
        finally:
            if saved is None:
                route.EAGER.pop(backend, None)
            else:
                route.EAGER[backend] = saved
    return run
