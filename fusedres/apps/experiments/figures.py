"""What every figure of the experiments shares: matplotlib set up headless, the rules a figure
must meet to be read without its caption (:func:`unlabelled` checks them on the figure's own
artists), medians with interquartile bands that treat a diverged run as infinitely bad, and one
way to save.

The rules: every visible axis has a label (units in it where the quantity has them), every
panel a title (or the figure one), every colour mapping a labelled colour bar, every panel with
several labelled curves a legend. Tests build each figure and call :func:`unlabelled`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DPI", "band", "finite_or_none", "leave_room_for_legend", "pyplot", "quantile", "save",
           "unlabelled"]

DPI = 150


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or None when matplotlib is
    not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics, numpy's default),
    with a non-finite value counted as +inf: a diverged run ranks above every finite one, and
    an interpolation that touches +inf is +inf (numpy's own gives NaN there). NaN for no
    values."""
    v = sorted(math.inf if not math.isfinite(x) else float(x) for x in values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    if frac == 0.0:
        return v[lo]
    a, b = v[lo], v[lo + 1]
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return a + (b - a) * frac


def band(columns: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(median, 25th, 75th percentile) of each column: the values the runs have at one point
    (a run not logged there has none; a diverged run's NaN or inf counts as +inf,
    :func:`quantile`). A column with no value gives NaN."""
    med = np.array([quantile(c, 0.5) for c in columns])
    q1 = np.array([quantile(c, 0.25) for c in columns])
    q3 = np.array([quantile(c, 0.75) for c in columns])
    return med, q1, q3


def _is_colorbar(ax) -> bool:
    return ax.get_label() == "<colorbar>"  # the label matplotlib gives a colour bar's axes


def unlabelled(fig) -> list[str]:
    """What keeps ``fig`` from being read without a caption; empty when nothing.

    Checked on the artists: every visible x, y (and 3-D z) axis of every panel has a label; a
    panel has a title unless the figure has one (twin axes share their panel's); a contour set,
    image or coloured surface (a colour mapping) has a colour bar, its own or one on the same
    scale (normalisation and colour map) elsewhere in the figure, and a colour bar has a label;
    a panel with two or more labelled lines or collections has a legend (its own or the
    figure's)."""
    problems = []
    suptitle = fig.get_suptitle()
    # Scales that a colour bar in the figure shows: panels on one shared scale need one bar.
    shown = {_scale(m) for ax in fig.axes for m in [*ax.collections, *ax.images]
             if _maps_colour(m) and getattr(m, "colorbar", None) is not None}
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        where = f"panel {i} ({ax.get_title() or 'untitled'})"
        if _is_colorbar(ax):
            label = ax.get_ylabel() or ax.get_xlabel()
            if not label:
                problems.append(f"{where}: colour bar without a label")
            continue
        axes = [("x", ax.xaxis), ("y", ax.yaxis)]
        if hasattr(ax, "zaxis"):
            axes.append(("z", ax.zaxis))
        for name, axis in axes:
            if axis.get_visible() and not axis.get_label_text().strip():
                problems.append(f"{where}: {name} axis without a label")
        # A twin (twinx/twiny) shares its panel's title.
        twins = [a for a in fig.axes if a is not ax and
                 tuple(a.get_position().bounds) == tuple(ax.get_position().bounds)]
        titled = any(a.get_title().strip() for a in [ax, *twins])
        if not titled and not suptitle.strip():
            problems.append(f"{where}: no title (nor a figure title)")
        for mappable in [*ax.collections, *ax.images]:
            if (_maps_colour(mappable) and getattr(mappable, "colorbar", None) is None
                    and _scale(mappable) not in shown):
                problems.append(f"{where}: a colour mapping ({type(mappable).__name__}) "
                                "without a colour bar")
        labelled = [a for a in [*ax.lines, *ax.collections, *ax.patches]
                    if a.get_label() and not a.get_label().startswith("_")]
        if len(labelled) >= 2 and ax.get_legend() is None and not fig.legends:
            problems.append(f"{where}: {len(labelled)} labelled curves and no legend")
    return problems


def _scale(mappable) -> tuple:
    """What a colour bar shows of a mapping: its normalisation and colour map."""
    norm = mappable.norm
    return type(norm).__name__, norm.vmin, norm.vmax, mappable.get_cmap().name


def _maps_colour(artist) -> bool:
    """A contour set, image or surface coloured by value through a colour map."""
    from matplotlib.contour import ContourSet
    from matplotlib.image import AxesImage

    if isinstance(artist, (ContourSet, AxesImage)):
        return True
    try:
        from mpl_toolkits.mplot3d.art3d import Poly3DCollection
    except ImportError:  # pragma: no cover - mplot3d ships with matplotlib
        return False
    return isinstance(artist, Poly3DCollection) and artist.get_array() is not None


def leave_room_for_legend(fig, entries: int) -> None:
    """Lay the panels out above a figure legend of ``entries`` lines (``loc="lower center"``,
    one entry a line, font size 8)."""
    height = fig.get_figheight()
    bottom = min(0.6, (0.17 * entries + 0.15) / height)
    fig.tight_layout(rect=(0, bottom, 1, 1))


def save(fig, path: Path, check: bool = True, layout: bool = True) -> Path:
    """Lay out (unless ``layout`` is False or the figure has a layout engine: the caller has
    laid it out), write ``path`` at :data:`DPI`
    and close ``fig``. With ``check``, a figure :func:`unlabelled` finds fault with is a
    programming error (ValueError, nothing written)."""
    plt = pyplot()
    if check:
        problems = unlabelled(fig)
        if problems:
            plt.close(fig)
            raise ValueError(f"figure {path.name} is not readable on its own: "
                             + "; ".join(problems))
    if layout and fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float for JSON, or None when it is not finite (JSON has no NaN)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
