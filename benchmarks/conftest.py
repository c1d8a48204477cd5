"""Shared benchmark plumbing: machine/version header, quick mode, and a ratio table.

Every benchmark calls ``report(benchmark, group=..., impl=..., **extra)`` after timing; at the end
of the session a table prints each implementation's median (with IQR) and its ratio to the
``reference`` implementation measured in the same run and group, plus the extra columns (saved
bytes...). ``FUSEDRES_BENCH_QUICK=1`` shrinks shapes so CI can smoke-run the files in seconds.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

import fusedres.memory
from benchutil import QUICK, machine_info

_RESULTS: dict[str, dict[str, dict]] = defaultdict(dict)
# glibc keeps freed blocks (no mmap, no trim), as `fusedres bench` does on CPU: with its dynamic
# thresholds a candidate's page faults depend on what ran before it in the process.
_ALLOCATOR: list[str] = []


def pytest_configure(config):
    applied, why = fusedres.memory.keep_freed_memory()
    _ALLOCATOR.append(why if applied else f"glibc defaults ({why})")


def pytest_report_header(config):
    return [f"fusedres bench: {machine_info()}" + ("  [QUICK shapes]" if QUICK else ""),
            f"C allocator: {_ALLOCATOR[0] if _ALLOCATOR else 'glibc defaults'}"]


@pytest.fixture
def report():
    def _report(benchmark, *, group: str, impl: str, **extra):
        stats = benchmark.stats.stats if benchmark.stats is not None else None
        if stats is None:  # --benchmark-disable: ran once, nothing timed
            return
        row = {"median": stats.median, "iqr": stats.iqr, "rounds": stats.rounds, **extra}
        benchmark.extra_info.update(extra)
        _RESULTS[group][impl] = row

    return _report


def results() -> dict[str, dict[str, dict]]:
    return _RESULTS


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    tr = terminalreporter
    tr.section("fusedres: medians and ratios against the reference in this run")
    tr.write_line(machine_info())
    extra_keys = sorted({k for g in _RESULTS.values() for r in g.values() for k in r}
                        - {"median", "iqr", "rounds"})
    head = f"{'group':44} {'impl':14} {'median ms':>10} {'IQR ms':>8} {'x ref':>6}"
    tr.write_line(head + "".join(f" {k:>14}" for k in extra_keys))
    for group, rows in _RESULTS.items():
        ref = rows.get("reference")
        for impl, r in rows.items():
            ratio = f"{r['median'] / ref['median']:6.2f}" if ref else "     -"
            line = (f"{group:44} {impl:14} {r['median'] * 1e3:10.2f} {r['iqr'] * 1e3:8.2f} "
                    f"{ratio}")
            line += "".join(f" {r.get(k, ''):>14}" if not isinstance(r.get(k), float)
                            else f" {r[k]:14.3g}" for k in extra_keys)
            tr.write_line(line)
