"""The README is an entrance, its figures current, its links alive: at most 300 lines, every
relative link of README.md, CONTRIBUTING.md and docs/ points at a file, and the demo's accuracy
is what `make demo` prints (slow: it trains the demo, ~40 s)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    missing = [target for target in _LINK.findall(page.read_text())
               if not target.startswith(("http://", "https://", "mailto:"))
               and not (page.parent / target).exists()]
    assert missing == [], f"{page.name}: links to nothing: {missing}"


def demo_env() -> dict[str, str]:
    """The variables `make demo` runs the demo with (the Makefile's DEMO_ENV): the CPU code
    its rounding depends on, pinned (the Makefile says why)."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines()
                if x.startswith("DEMO_ENV :="))
    return dict(item.split("=", 1) for item in line.split(":=", 1)[1].split())


@pytest.mark.slow
def test_the_demo_reaches_the_accuracy_the_readme_states(tmp_path):
    """`make demo`'s command in a fresh process (the pins act at the libraries' start), its
    printed final accuracy to the digit: the same on every capability (CI reruns this test
    under a second one)."""
    stated = re.search(r"reaches\s+([0-9.]+)% final test accuracy",
                       (ROOT / "README.md").read_text())
    assert stated, "README.md states no demo accuracy"
    pins = demo_env()
    assert set(pins) >= {"ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "FUSEDRES_CPU_CAPABILITY"}
    out = tmp_path / "digits"
    proc = subprocess.run([sys.executable, "-m", "fusedres.apps.train", "--config", "digits",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, PYTHONWARNINGS="ignore", **pins))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "preact_resnet20" and summary["iterations"] == 40 * 11
    printed = f"{100 * (1 - summary['final_test_error']):.2f}"
    assert f"| {printed} %" in proc.stdout  # the summary table's row
    assert printed == stated.group(1), f"the demo prints {printed}%, README says {stated.group(1)}%"
