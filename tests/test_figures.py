"""The figure rules of fusedres.apps.experiments.figures: ``unlabelled`` reads a figure's artists
back and finds each kind of fault; ``save`` refuses such a figure; quantiles rank a diverged (non
finite) run above every finite one. The experiments' own figures are checked in their tests
(test_compare, test_lesion, test_landscape) and the trainer's curves here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fusedres.apps.experiments import figures

plt = pytest.importorskip("matplotlib.pyplot")


def _labelled(ax, title="t"):
    ax.set_xlabel("iteration")
    ax.set_ylabel("error (%)")
    ax.set_title(title)


def test_a_labelled_figure_passes():
    fig, (a, b) = plt.subplots(1, 2)
    for ax in (a, b):
        _labelled(ax)
    a.plot([0, 1], [1, 2], label="one")
    a.plot([0, 1], [2, 3], label="two")
    a.legend()
    cs = b.contourf(np.arange(9.0).reshape(3, 3))
    fig.colorbar(cs, ax=b, label="loss (nats)")
    assert figures.unlabelled(fig) == []
    plt.close(fig)


@pytest.mark.parametrize("fault, expected", [
    ("no_ylabel", "y axis without a label"),
    ("no_xlabel", "x axis without a label"),
    ("no_title", "no title (nor a figure title)"),
    ("no_legend", "2 labelled curves and no legend"),
    ("no_colorbar", "colour mapping (QuadContourSet) without a colour bar"),
    ("colorbar_unlabelled", "colour bar without a label"),
    ("no_zlabel", "z axis without a label"),
])
def test_each_fault_is_found(fault, expected):
    fig = plt.figure()
    ax = fig.add_subplot(projection="3d" if fault == "no_zlabel" else None)
    _labelled(ax)
    if fault == "no_ylabel":
        ax.set_ylabel("")
    if fault == "no_xlabel":
        ax.set_xlabel("")
    if fault == "no_title":
        ax.set_title("")
    if fault == "no_legend":
        ax.plot([0, 1], label="a")
        ax.plot([1, 0], label="b")
    if fault in ("no_colorbar", "colorbar_unlabelled"):
        cs = ax.contourf(np.arange(9.0).reshape(3, 3))
        if fault == "colorbar_unlabelled":
            fig.colorbar(cs, ax=ax)
    if fault == "no_zlabel":
        ax.plot([0, 1], [0, 1], [0, 1])
    problems = figures.unlabelled(fig)
    assert len(problems) == 1 and expected in problems[0], problems
    plt.close(fig)


def test_panels_on_one_scale_share_a_colour_bar_and_another_scale_needs_its_own():
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, 3)
    z = np.arange(1.0, 10.0).reshape(3, 3)
    for ax in axes:
        _labelled(ax)
    cs = [ax.contour(z, norm=LogNorm(1, 9), cmap="viridis") for ax in axes[:2]]
    fig.colorbar(cs[1], ax=list(axes[:2]), label="loss (nats)")
    axes[2].contour(z, norm=LogNorm(1, 20), cmap="viridis")  # another scale, no bar
    problems = figures.unlabelled(fig)
    assert len(problems) == 1 and problems[0].startswith("panel 2"), problems
    plt.close(fig)


def test_a_figure_title_stands_for_panel_titles_and_twin_axes_need_no_second_xlabel():
    fig, ax = plt.subplots()
    ax.set_xlabel("t")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.set_ylabel("accuracy (%)")
    fig.suptitle("a run")
    assert figures.unlabelled(fig) == []
    ax2.set_ylabel("")
    assert any("y axis without a label" in p for p in figures.unlabelled(fig))
    plt.close(fig)


def test_save_refuses_an_unlabelled_figure(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    with pytest.raises(ValueError, match="x.png is not readable on its own: panel 0"):
        figures.save(fig, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_quantiles_rank_a_diverged_run_last():
    assert figures.quantile([0.1, 0.2, 0.4], 0.5) == 0.2
    assert figures.quantile([0.1, 0.2, 0.4], 0.25) == pytest.approx(0.15)
    assert figures.quantile([0.1, 0.2, 0.4], 0.75) == pytest.approx(0.3)
    # One diverged run of three: the median is the worse finite one, the upper quartile inf.
    assert figures.quantile([0.1, math.nan, 0.4], 0.5) == 0.4
    assert figures.quantile([0.1, math.nan, 0.4], 0.75) == math.inf
    assert figures.quantile([0.1, math.inf, 0.4], 0.25) == pytest.approx(0.25)
    assert figures.quantile([math.nan, math.nan], 0.0) == math.inf
    assert math.isnan(figures.quantile([], 0.5))
    med, q1, q3 = figures.band([[1.0, 2.0, 3.0], [5.0], []])
    assert med[:2].tolist() == [2.0, 5.0] and math.isnan(med[2])
    assert q1[:2].tolist() == [1.5, 5.0] and q3[:2].tolist() == [2.5, 5.0]


def test_the_trainers_curves_are_labelled(tiny_run, monkeypatch):
    """The curves.png of the trainer, rebuilt from the tiny run's log, read back."""
    from matplotlib.figure import Figure

    from fusedres.apps.train import metrics

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: seen.append(
        figures.unlabelled(self)))
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["label"] == ("ResNet-14: full pre-activation unit, identity shortcut, "
                                "BatchNorm, no drop-path")
    assert "| network " in (tiny_run / "summary.md").read_text()
    metrics.plot(records, tiny_run / "unused.png", f"{summary['label']} on digits")
    assert seen == [[]]
