"""What every figure of the experiments shares: matplotlib set up headless, the rules a figure
must meet to be read without its caption (:func:`unlabelled` checks them on the figure's own
artists), the rules of its layout (:func:`overlaps` checks them on the rendered figure),
medians and spreads that treat a diverged run as infinitely bad, and one way to save.

The rules: every visible axis has a label (units in it where the quantity has them), every
panel a title (or the figure one), every colour mapping a labelled colour bar, every panel with
several labelled curves a legend. The layout: a figure is one paper column wide
(:data:`COLUMN_WIDTH`, 3.5 in, at :data:`COLUMN_RC`'s font sizes), its legend below the panels
or short enough to sit inside one, and no text (axis labels, tick labels, titles, legends,
colour bars) runs into another or off the figure. Tests build each figure and call both checks.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["COLUMN_RC", "COLUMN_WIDTH", "DPI", "band", "column", "column_legend",
           "common_and_short",
           "finite_or_none", "leave_room_for_legend", "log_ticks", "overlaps", "pyplot",
           "quantile", "save", "small_ticks", "spread", "unlabelled", "wrap"]

DPI = 150
# One column of a two-column paper (and the width at which a reader first sees a figure).
COLUMN_WIDTH = 3.5
# Font sizes that stay legible at that width once printed (points).
COLUMN_RC = {"font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "legend.fontsize": 6,
             "xtick.labelsize": 6, "ytick.labelsize": 6, "figure.titlesize": 7.5,
             "legend.title_fontsize": 6, "lines.linewidth": 1.0, "lines.markersize": 3,
             "legend.handlelength": 1.5, "legend.borderaxespad": 0.3}
TICK_SIZE = COLUMN_RC["xtick.labelsize"]


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


def spread(columns: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(median, min, max) of each column, a non-finite value counted as +inf
    (:func:`quantile`); NaN for a column with no value. The figures draw min-max bands: with 3
    to 5 seeds every run is an extreme or the median, and a quartile is an interpolation."""
    med = np.array([quantile(c, 0.5) for c in columns])
    lo = np.array([quantile(c, 0.0) for c in columns])
    hi = np.array([quantile(c, 1.0) for c in columns])
    return med, lo, hi


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
            if (axis.get_visible() and not axis.get_label_text().strip()
                    and not _labelled_by_sibling(ax, name)):
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


def _labelled_by_sibling(ax, name: str) -> bool:
    """A shared axis whose tick labels are hidden (stacked panels, ``sharex=True``) is read off
    the panel that labels it."""
    if name not in ("x", "y"):
        return False
    shared = ax.get_shared_x_axes() if name == "x" else ax.get_shared_y_axes()
    ticks = ax.get_xticklabels() if name == "x" else ax.get_yticklabels()
    if ticks:  # matplotlib lists the visible tick labels only
        return False
    label = (lambda a: a.get_xlabel()) if name == "x" else (lambda a: a.get_ylabel())
    return any(a is not ax and label(a).strip() for a in shared.get_siblings(ax))


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


@contextlib.contextmanager
def column() -> Iterator[None]:
    """Build a figure inside this block to get :data:`COLUMN_RC`'s font sizes (call
    :func:`small_ticks` on it before leaving: tick labels are made when it is drawn)."""
    plt = pyplot()
    with plt.rc_context(COLUMN_RC):
        yield


def small_ticks(fig) -> None:
    """Every axes' tick labels (colour bars' too) at :data:`TICK_SIZE` points; on a log axis
    only the major ticks labelled (1, 2, 5 of each decade when it spans less than two), as
    matplotlib's labelled minor ticks collide in a short panel."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=TICK_SIZE)
        if hasattr(ax, "zaxis") or _is_colorbar(ax):  # a colour bar's ticks are chosen
            continue
        for axis, limits in ((ax.xaxis, ax.get_xlim), (ax.yaxis, ax.get_ylim)):
            if axis.get_scale() != "log":
                continue
            lo, hi = sorted(limits())
            if lo > 0 and hi / lo < 100:
                # Enough digits that neighbouring labels differ on a narrow range.
                digits = max(2, 2 + math.ceil(math.log10(hi / max(hi - lo, 1e-300 * hi))))
                axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                axis.set_major_formatter(FuncFormatter(lambda v, _, p=digits: f"{v:.{p}g}"))
            axis.set_minor_formatter(NullFormatter())


def wrap(text: str, fontsize: float = COLUMN_RC["figure.titlesize"],
         width_in: float = COLUMN_WIDTH) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``fontsize`` points (a
    character taken as 0.55 em wide, a little wider than the average of a proportional font);
    existing line breaks are kept."""
    chars = max(10, int(width_in * 72 / (0.55 * fontsize)) - 2)
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False)
                     for line in text.split("\n"))


def column_legend(fig, handles, labels=None, ncol: int = 1):
    """The figure's legend below its panels (constrained layout makes room), every entry
    wrapped to the column's width (less the marker's) at the legend's font size."""
    labels = [h.get_label() for h in handles] if labels is None else list(labels)
    size = COLUMN_RC["legend.fontsize"]
    width = (COLUMN_WIDTH - 0.1) / ncol - 0.4
    return fig.legend(handles, [wrap(t, size, width) for t in labels],
                      loc="outside lower center", ncol=ncol, frameon=False)


def _label_parts(label: str) -> tuple[str, list[str]]:
    """'ResNet-20: a, b, c; d' -> ('ResNet-20', ['a', 'b', 'c', 'd'])."""
    head, _, extra = label.partition("; ")
    network, sep, rest = head.partition(": ")
    parts = [p for p in rest.split(", ") if p] if sep else []
    if not sep:
        network = head
    return network, parts + [p for p in extra.split(", ") if p]


def common_and_short(labels: Sequence[str]) -> tuple[str, list[str]]:
    """What every label shares, and each label with that taken out: legends name what differs,
    the shared part goes to the title once. Labels are :func:`fusedres.apps.train.naming.
    variant_label`'s, possibly with '; other options'. With one label: (it, [''])."""
    split = [_label_parts(lab) for lab in labels]
    networks = {n for n, _ in split}
    common = [p for p in split[0][1] if all(p in parts for _, parts in split)]
    shorts = []
    for network, parts in split:
        own = [p for p in parts if p not in common]
        shorts.append(", ".join(([network] if len(networks) > 1 else []) + own))
    head = next(iter(networks)) if len(networks) == 1 else ""
    shared = ", ".join(common)
    text = f"{head}: {shared}" if head and shared else head or shared
    return text, shorts


def log_ticks(levels: Sequence[float], count: int = 5) -> tuple[list[float], list[str]]:
    """About ``count`` of the log-spaced contour ``levels`` (first and last included) as a
    colour bar's ticks, each labelled with 3 significant digits: no tick at a value the levels
    do not have (a log scale has no 0)."""
    levels = list(levels)
    step = max(1, round((len(levels) - 1) / max(count - 1, 1)))
    picked = levels[::step]
    if picked[-1] != levels[-1]:
        picked.append(levels[-1])
    return picked, [f"{v:.3g}" for v in picked]


def _panel_key(ax, axes) -> int:
    """Twin axes (twinx/twiny) share a panel: the key of the first axes at the same place."""
    for other in axes:
        if tuple(other.get_position().bounds) == tuple(ax.get_position().bounds):
            return id(other)
    return id(ax)


def _visible_text(t) -> bool:
    return t is not None and t.get_visible() and bool(t.get_text().strip())


def _tick_labels(axis) -> list:
    """The tick labels the axis draws: visible, with text, at a tick inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    pad = 1e-9 * max(abs(lo), abs(hi), 1.0)
    out = []
    for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
        loc = tick.get_loc()
        if loc is None or not lo - pad <= loc <= hi + pad:
            continue
        out += [t for t in (tick.label1, tick.label2) if _visible_text(t)]
    return out


def _boxes(fig, renderer) -> list[tuple[int, str, Any]]:
    """(panel key, what, display bbox) of everything that must not collide."""
    out = []
    axes = [a for a in fig.axes if a.get_visible()]
    for ax in axes:
        if _is_colorbar(ax):
            out.append((id(ax), "colour bar", ax.get_tightbbox(renderer)))
            continue
        key = _panel_key(ax, axes)
        three_d = hasattr(ax, "zaxis")
        titles = [ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)]
        labels = [("x label", ax.xaxis.label), ("y label", ax.yaxis.label)]
        if three_d:
            labels.append(("z label", ax.zaxis.label))
        for what, t in [*(("title", t) for t in titles), *labels,
                        *(("text", t) for t in ax.texts)]:
            if _visible_text(t):
                out.append((key, f"{what} {t.get_text()[:30]!r}", t.get_window_extent(renderer)))
        if not three_d:
            out.append((key, "plot area", ax.bbox))
            for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
                for t in _tick_labels(axis):
                    out.append((key, f"{name} tick label {t.get_text()!r}",
                                t.get_window_extent(renderer)))
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            out.append((key, "legend", legend.get_window_extent(renderer)))
    if fig._suptitle is not None and _visible_text(fig._suptitle):
        out.append((0, "figure title", fig._suptitle.get_window_extent(renderer)))
    for legend in fig.legends:
        out.append((0, "figure legend", legend.get_window_extent(renderer)))
    for t in fig.texts:
        if t is not fig._suptitle and _visible_text(t):
            out.append((0, f"figure text {t.get_text()[:30]!r}", t.get_window_extent(renderer)))
    return out


def _allowed(a: tuple, b: tuple) -> bool:
    """Overlaps a figure may have: a panel's legend or notes inside its own plot area, and
    twin axes' common plot area."""
    if a[0] != b[0] or a[0] == 0:
        return False
    kinds = {a[1].split(" ")[0], b[1].split(" ")[0]}
    return "plot" in kinds and (kinds <= {"plot", "legend", "text"})


def overlaps(fig, tolerance: float = 0.5) -> list[str]:
    """What collides in ``fig`` once drawn, empty when nothing: any two of the axis labels,
    tick labels, titles, legends, notes and colour bars (each with its ticks and label), or one
    of them and another panel's plot area; and anything that runs off the figure. Boxes that
    touch within ``tolerance`` pixels do not count."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = _boxes(fig, renderer)
    frame = fig.bbox
    problems = []
    for _, what, box in boxes:
        if (box.x0 < frame.x0 - tolerance or box.y0 < frame.y0 - tolerance
                or box.x1 > frame.x1 + tolerance or box.y1 > frame.y1 + tolerance):
            problems.append(f"{what} runs off the figure")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if _allowed(a, b):
                continue
            ba, bb = a[2], b[2]
            if (ba.x0 < bb.x1 - tolerance and bb.x0 < ba.x1 - tolerance
                    and ba.y0 < bb.y1 - tolerance and bb.y0 < ba.y1 - tolerance):
                problems.append(f"{a[1]} overlaps {b[1]}")
    return problems


def leave_room_for_legend(fig, entries: int) -> None:
    """Lay the panels out above a figure legend of ``entries`` lines (``loc="lower center"``,
    one entry a line, font size 8)."""
    height = fig.get_figheight()
    bottom = min(0.6, (0.17 * entries + 0.15) / height)
    fig.tight_layout(rect=(0, bottom, 1, 1))


def save(fig, path: Path, check: bool = True, layout: bool = True) -> Path:
    """Lay out (unless ``layout`` is False or the figure has a layout engine: the caller has
    laid it out), write ``path`` at :data:`DPI` and close ``fig``. With ``check``, a figure
    :func:`unlabelled` finds fault with is a programming error (ValueError, nothing written),
    and what :func:`overlaps` finds is a warning (the figure is still written: its data are
    what the command computed, and the test of each figure keeps them apart)."""
    plt = pyplot()
    if check:
        problems = unlabelled(fig)
        if problems:
            plt.close(fig)
            raise ValueError(f"figure {path.name} is not readable on its own: "
                             + "; ".join(problems))
    if layout and fig.get_layout_engine() is None:
        fig.tight_layout()
    if check:
        collisions = overlaps(fig)
        if collisions:
            warnings.warn(f"figure {path.name}: " + "; ".join(collisions[:5])
                          + (f"; and {len(collisions) - 5} more" if len(collisions) > 5
                             else ""), stacklevel=2)
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
