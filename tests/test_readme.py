"""The README is an entrance, its figures current, its links alive: at most 300 lines, every
relative link of README.md, CONTRIBUTING.md and docs/ points at a file, and the demo's accuracy
is what the demo prints (slow: it trains the demo, ~25 s)."""

from __future__ import annotations

import json
import re
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


@pytest.mark.slow
def test_the_demo_reaches_the_accuracy_the_readme_states(tmp_path):
    from fusedres.apps.train import main

    stated = re.search(r"reaches\s+([0-9.]+)% final test accuracy",
                       (ROOT / "README.md").read_text())
    assert stated, "README.md states no demo accuracy"
    out = tmp_path / "digits"
    assert main(["--config", "digits", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    printed = f"{100 * (1 - summary['final_test_error']):.2f}"
    assert printed == stated.group(1), f"the demo prints {printed}%, README says {stated.group(1)}%"
