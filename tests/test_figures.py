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


# --------------------------------------------------------------------------- layout

def _column_figure():
    with figures.column():
        fig, (a, b) = plt.subplots(2, 1, figsize=(figures.COLUMN_WIDTH, 4),
                                   layout="constrained")
        for ax in (a, b):
            _labelled(ax)
            ax.plot([0, 1], [1, 2], label="one")
    return fig, a, b


def test_overlaps_passes_a_laid_out_figure_and_a_legend_inside_its_panel():
    fig, a, _ = _column_figure()
    a.legend(loc="upper left")
    assert figures.overlaps(fig) == []
    plt.close(fig)


@pytest.mark.parametrize("fault, expected", [
    ("texts", "text 'here' overlaps text 'here too'"),
    ("off", "runs off the figure"),
    ("colour_bar", "overlaps colour bar"),
    ("tick_labels", "x tick label"),
    ("legend_on_other_panel", "legend overlaps"),
])
def test_overlaps_finds_each_collision(fault, expected):
    fig, a, b = _column_figure()
    if fault == "texts":
        a.text(0.5, 0.5, "here", transform=a.transAxes)
        a.text(0.5, 0.5, "here too", transform=a.transAxes)
    if fault == "off":
        a.set_title("a title far too long for one column of a paper, " * 3)
    if fault == "colour_bar":
        cs = b.contourf(np.arange(9.0).reshape(3, 3))
        bar = fig.colorbar(cs, ax=b, label="loss (nats)")
        fig.canvas.draw()
        # The colour bar dragged onto the panel's labels.
        bar.ax.set_position(b.get_position())
        fig.set_layout_engine("none")
    if fault == "tick_labels":
        a.set_xticks(np.linspace(0, 1, 40))
    if fault == "legend_on_other_panel":
        fig.canvas.draw()
        fig.set_layout_engine("none")  # placed by hand onto the panel below
        a.legend(loc="center", bbox_to_anchor=(0.5, -0.9), bbox_transform=a.transAxes)
    problems = figures.overlaps(fig)
    assert any(expected in p for p in problems), problems
    plt.close(fig)


def test_save_warns_of_collisions(tmp_path):
    fig, a, _ = _column_figure()
    a.text(0.5, 0.5, "here", transform=a.transAxes)
    a.text(0.5, 0.5, "there", transform=a.transAxes)
    with pytest.warns(UserWarning, match="x.png: text 'here' overlaps text 'there'"):
        figures.save(fig, tmp_path / "x.png")
    assert (tmp_path / "x.png").exists()


def test_legends_name_what_differs_and_titles_what_is_shared():
    common, short = figures.common_and_short([
        "ResNet-20: full pre-activation unit, identity shortcut, BatchNorm, no drop-path",
        "ResNet-56: full pre-activation unit, no shortcut (plain), BatchNorm, no drop-path; "
        "lr 0.05"])
    assert common == "full pre-activation unit, BatchNorm, no drop-path"
    assert short == ["ResNet-20, identity shortcut", "ResNet-56, no shortcut (plain), lr 0.05"]
    common, short = figures.common_and_short(["ResNet-20: a, b", "ResNet-20: a, c"])
    assert (common, short) == ("ResNet-20: a", ["b", "c"])
    assert figures.common_and_short(["ResNet-8: a"]) == ("ResNet-8: a", [""])


def test_log_ticks_are_levels_and_wrap_fits_the_column():
    levels = np.geomspace(0.004, 10, 21)
    ticks, labels = figures.log_ticks(levels)
    assert ticks[0] == levels[0] and ticks[-1] == levels[-1] and len(ticks) == 5
    assert labels[0] == "0.004" and "0" not in labels
    text = figures.wrap("word " * 60, fontsize=7.5)
    fig = plt.figure(figsize=(figures.COLUMN_WIDTH, 2))
    t = fig.suptitle(text, fontsize=7.5)
    fig.canvas.draw()
    assert t.get_window_extent().width <= fig.bbox.width
    plt.close(fig)


def _digits_module():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "reproduction"
    mods = []
    for name in ("digits", "digits_report"):
        spec = importlib.util.spec_from_file_location(f"reproduction_{name}", root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        mods.append(module)
    return mods


def test_reproductions_figures_fit_a_column(tmp_path, monkeypatch):
    """reproduction/'s own figures (depth.png, landscapes.png) built from made-up runs: labelled,
    one column wide, nothing colliding, every seed drawn."""
    digits, report = _digits_module()
    rng = np.random.default_rng(0)
    data = {}
    for depth in (*digits.DEPTHS, 1001):
        for kind in ("res-bn", "plain-bn", "res-nobn", "plain-nobn"):
            data[f"depth-{kind}-{depth}"] = {"runs": [
                {"seed": s, "test_error": float(rng.uniform(0.005, 0.9)),
                 "train_loss": float("nan") if (depth, kind, s) == (110, "res-nobn", 1)
                 else float(rng.uniform(0.003, 2.3))} for s in range(5)]}
    report.plot_depth(digits, data, tmp_path / "depth.png")  # save() would warn on a collision
    monkeypatch.setattr(digits, "RUNS", tmp_path)
    x = np.linspace(-1, 1, 13)
    for _, (run,), _, _ in digits.LANDSCAPES:
        out = tmp_path / f"landscape-{run}"
        out.mkdir()
        loss = 0.01 + np.add.outer(x ** 2, x ** 2) * (1e4 if "plain" in run else 3)
        np.savez(out / "landscape_2d.npz", loss=loss, x=x, y=x)
        h = x[::3]
        np.savez(out / "hessian_2d.npz", lam_min=-np.abs(np.add.outer(h, h)),
                 lam_max=np.full((5, 5), 2.0), x=h, y=h)
    seen = []
    real_save = figures.save

    def check_then_save(fig, path, **kw):
        seen.append((figures.unlabelled(fig), figures.overlaps(fig), fig.get_figwidth()))
        return real_save(fig, path, **kw)

    monkeypatch.setattr(figures, "save", check_then_save)
    report.plot_depth(digits, data, tmp_path / "depth.png")
    assert report.plot_landscapes(digits, tmp_path / "landscapes.png")
    assert seen == [([], [], figures.COLUMN_WIDTH)] * 2
