"""The figures of ``fusedres landscape``, one paper column wide (:data:`figures.COLUMN_WIDTH`).

1-D (a direction, or the path between two checkpoints): the loss (left axis, log scale when it
spans more than a factor of 10) and the accuracy (right axis) against the coordinate, the legend
below the plot. 2-D: loss contours above the accuracy's filled contours, each with its colour
bar, the trained weights (or the training path) marked, and a 3-D surface of the loss.

Colour ranges are clipped where a surface explodes: the loss contours are log-spaced from the
grid's minimum up to :func:`loss_top` (Li et al. draw their contours up to a loss of 10), and a
colour bar says when it stops short of the grid's maximum; its ticks are contour levels (a log
scale has no 0). ``--hessian``'s map of |lambda_min / lambda_max| (:func:`hessian_figure`) is
drawn on [0, 1], values above clipped to the top colour.

A point whose loss is not finite is left out (a gap) and marked x; it is never drawn as a value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from . import figures

__all__ = ["DIRECTION_LABELS", "LOSS_CLIP", "LOSS_LABEL", "RATIO_LABEL", "figures_of",
           "hessian_figure", "loss_levels", "loss_panel", "loss_top", "plot", "ratio_panel",
           "trajectory_labels"]

LOSS_CLIP = 10.0  # nats: the top of the colour range, and the 3-D plot's loss axis
LOSS_LABEL = "training loss (nats)"
RATIO_LABEL = "|λmin / λmax| of the loss Hessian"
DIRECTION_LABELS = ("α (filter-normalised direction 1)", "β (filter-normalised direction 2)")
BAD_LABEL = "loss not finite here (not drawn)"


def trajectory_labels(path: dict[str, Any]) -> tuple[str, str]:
    """The axis labels of a trajectory plot: each PCA direction with the share of the path's
    variance it explains."""
    return tuple(f"PC{k + 1} ({100 * r:.1f} % of the variance)"
                 for k, r in enumerate(path["explained_variance"]))


def loss_top(lo: float, hi: float) -> float:
    """Where the colour range stops: the grid's maximum, but no higher than :data:`LOSS_CLIP`
    nats, or 10 x the minimum when that is higher (a surface that never gets below the clip
    still gets a decade of levels)."""
    return min(hi, max(LOSS_CLIP, 10 * lo))


def loss_levels(finite: np.ndarray, count: int = 21) -> tuple[np.ndarray, bool, float]:
    """Log-spaced contour levels over the finite losses, clipped (:func:`loss_top`): (levels,
    whether clipped, the grid's maximum)."""
    lo = max(float(finite.min()), 1e-6) if finite.size else 1e-3
    hi = float(finite.max()) if finite.size else 1.0
    top = loss_top(lo, hi)
    if not top > lo:
        top = lo * 1.01
    return np.geomspace(lo, top, count), hi > top * (1 + 1e-9), hi


def _bn_text(s: dict[str, Any]) -> str:
    return ("BatchNorm statistics recomputed at each point" if s.get("bn_stats") == "recompute"
            else "BatchNorm running statistics of the state")


def _one_d(plt, surface, title: str):
    s = surface.settings
    ok = np.isfinite(surface.loss)
    loss = np.where(ok, surface.loss, np.nan)
    acc = np.where(ok, 100 * surface.accuracy, np.nan)
    x = surface.coords[0]
    fig, ax = plt.subplots(figsize=(figures.COLUMN_WIDTH, 3.3), layout="constrained")
    ax.plot(x, loss, "b-", marker=".", ms=2.5, label="training loss (left axis)")
    finite = loss[ok]
    if finite.size and finite.min() > 0 and finite.max() > 10 * finite.min():
        ax.set_yscale("log")
    ax.set_ylabel(LOSS_LABEL, color="b")
    ax2 = ax.twinx()
    ax2.plot(x, acc, "r--", marker=".", ms=2.5, label="training accuracy (right axis)")
    ax2.set_ylabel("training accuracy (%)", color="r")
    ax2.set_ylim(0, 100)
    if not ok.all():
        ax.plot(x[~ok], np.zeros((~ok).sum()), "x", color="k", ms=6, mew=1.5,
                transform=ax.get_xaxis_transform(), clip_on=False, label=BAD_LABEL)
    if s["mode"] == "interpolate":
        a, b = (Path(p).name for p in s.get("interpolate", ["A", "B"]))
        ax.set_xlabel("t: weights (1 - t) A + t B")
        for t in (0, 1):
            ax.axvline(t, color="gray", lw=0.8, ls=":")
        ax.plot([], [], ":", color="gray", lw=0.8, label=f"t = 0: A = {a}; t = 1: B = {b}")
    else:
        ax.set_xlabel(DIRECTION_LABELS[0])
        ax.axvline(0, color="gray", lw=0.8, ls=":", label="trained weights (α = 0)")
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    figures.column_legend(fig, h1 + h2, l1 + l2)
    fig.suptitle(figures.wrap(f"{title}; {_bn_text(s)}, {s['samples']} training images"))
    return {"": fig}


def loss_panel(ax, x, y, loss, levels, clipped: bool, hi: float, fig, bar: bool = True):
    """Log-spaced loss contours on ``ax`` (``loss`` [y, x], NaN where not finite), on the
    colour scale of ``levels``, and (``bar``) the colour bar: its ticks contour levels."""
    from matplotlib.colors import LogNorm

    norm = LogNorm(levels[0], levels[-1])
    X, Y = np.meshgrid(x, y)
    cs = ax.contour(X, Y, np.ma.masked_invalid(loss), levels=levels, cmap="viridis", norm=norm,
                    linewidths=0.8)
    if bar:
        cb = fig.colorbar(cs, ax=ax, label=LOSS_LABEL + (f"\n(clipped at {levels[-1]:.3g}; max "
                                                        f"{hi:.3g})" if clipped else ""))
        ticks, text = figures.log_ticks(levels)
        cb.set_ticks(ticks, labels=text)
        cb.ax.minorticks_off()
    return cs


def ratio_panel(ax, x, y, ratio, fig, bar: bool = True):
    """|lambda_min / lambda_max| as filled contours on [0, 1] (above 1: the top colour, the
    colour bar's arrow), NaN left blank."""
    X, Y = np.meshgrid(x, y)
    cs = ax.contourf(X, Y, np.ma.masked_invalid(np.asarray(ratio, dtype=float)),
                     levels=np.linspace(0, 1, 11), cmap="coolwarm", extend="max")
    if bar:
        fig.colorbar(cs, ax=ax, label=RATIO_LABEL + "\n(0: convex; above 1 clipped)",
                     ticks=[0, 0.25, 0.5, 0.75, 1])
    return cs


def _two_d(plt, surface, title: str):
    s = surface.settings
    ok = np.isfinite(surface.loss)
    loss = np.where(ok, surface.loss, np.nan)
    acc = np.where(ok, 100 * surface.accuracy, np.nan)
    x, y = surface.coords
    X, Y = np.meshgrid(x, y)
    path = s.get("trajectory") if s["mode"] == "trajectory" else None
    labels = trajectory_labels(path) if path else DIRECTION_LABELS
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(figures.COLUMN_WIDTH, 5.9), sharex=True,
                                  layout="constrained")
    levels, clipped, hi = loss_levels(loss[ok])
    loss_panel(ax, x, y, loss, levels, clipped, hi, fig)
    cs2 = ax2.contourf(X, Y, np.ma.masked_invalid(acc), levels=np.linspace(0, 100, 11),
                       cmap="viridis")
    fig.colorbar(cs2, ax=ax2, label="training accuracy (%)")
    for a, what in ((ax, "training loss"), (ax2, "training accuracy")):
        if path:
            its = path["iterations"]
            a.plot(path["x"], path["y"], "-o", color="tab:red", ms=2, lw=1.0,
                   label=f"training path: {len(its)} checkpoints, iterations {its[0]}-{its[-1]}")
            a.plot(path["x"][:1], path["y"][:1], "s", color="tab:red", ms=4,
                   label=f"first checkpoint (iteration {its[0]})")
            a.plot([0], [0], "r*", ms=8, label=f"final weights (iteration {its[-1]})")
        else:
            a.plot([0], [0], "r*", ms=8, label="trained weights (α = β = 0)")
        if not ok.all():
            a.plot(X[~ok], Y[~ok], "kx", ms=4, label=BAD_LABEL)
        a.set_ylabel(labels[1])
        a.set_title(what)
        # PCA coordinates: the second direction's extent is often a fraction of the first's.
        a.set_aspect("auto")
    ax2.set_xlabel(labels[0])
    figures.column_legend(fig, *ax.get_legend_handles_labels())
    fig.suptitle(figures.wrap(f"{title}; {_bn_text(s)}, {s['samples']} training images"))
    return fig


def _surface_3d(plt, surface, title: str):
    s = surface.settings
    ok = np.isfinite(surface.loss)
    loss = np.where(ok, surface.loss, np.nan)
    finite = loss[ok]
    x, y = surface.coords
    X, Y = np.meshgrid(x, y)
    path = s.get("trajectory") if s["mode"] == "trajectory" else None
    fig = plt.figure(figsize=(figures.COLUMN_WIDTH, 3.9), layout="constrained")
    ax = fig.add_subplot(projection="3d")
    # Far from the minimum the loss explodes and would flatten the bowl: clipped at Li et al.'s
    # plotting limit (10) when it goes above.
    clipped = bool(finite.size) and finite.max() > LOSS_CLIP
    z = np.minimum(loss, LOSS_CLIP) if clipped else loss
    surf = ax.plot_surface(X, Y, np.ma.masked_invalid(z), cmap="viridis", linewidth=0,
                           antialiased=True, vmin=np.nanmin(z) if finite.size else 0,
                           vmax=np.nanmax(z) if finite.size else 1)
    clip_text = f", clipped at {LOSS_CLIP:g}" if clipped else ""
    fig.colorbar(surf, ax=ax, shrink=0.55, pad=0.12, location="bottom",
                 label=LOSS_LABEL + clip_text)
    short = ([f"PC{k + 1}" for k in range(2)] if path else ["α", "β"])
    ax.set_xlabel(short[0], labelpad=-6)
    ax.set_ylabel(short[1], labelpad=-6)
    ax.set_zlabel("loss", labelpad=-6)
    ax.tick_params(pad=-3)
    bad = "" if ok.all() else f"; {(~ok).sum()} points not finite, left out"
    fig.suptitle(figures.wrap(f"{title}; {_bn_text(s)}{bad}"))
    return fig


def figures_of(surface, title: str) -> dict[str, Any]:
    """The surface's figures by file suffix ('' for 1-D; '_contour', '_surface' for 2-D), not
    yet saved; empty without matplotlib."""
    plt = figures.pyplot()
    if plt is None:
        return {}
    with figures.column():
        if surface.settings["dims"] == 1:
            out = _one_d(plt, surface, title)
        else:
            out = {"_contour": _two_d(plt, surface, title),
                   "_surface": _surface_3d(plt, surface, title)}
        for fig in out.values():
            figures.small_ticks(fig)
    return out


def plot(surface, out: Path, name: str, title: str) -> list[Path]:
    """1-D: loss and accuracy against the coordinate; 2-D: contours of loss and accuracy, and
    a 3-D surface of the loss. Returns the files written (none without matplotlib)."""
    return [figures.save(fig, out / f"{name}{suffix}.png")
            for suffix, fig in figures_of(surface, title).items()]


def hessian_figure(x, y, ratio, lam_max, centre: tuple[float, float], labels: tuple[str, str],
                   title: str):
    """|lambda_min / lambda_max| over the grid (top) and lambda_max (bottom, log scale where
    positive); None without matplotlib."""
    plt = figures.pyplot()
    if plt is None:
        return None
    from matplotlib.colors import LogNorm

    with figures.column():
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(figures.COLUMN_WIDTH, 5.4), sharex=True,
                                      layout="constrained")
        ratio_panel(ax, x, y, ratio, fig)
        lam = np.where(np.isfinite(lam_max) & (np.asarray(lam_max) > 0), lam_max, np.nan)
        X, Y = np.meshgrid(x, y)
        if np.isfinite(lam).any():
            lo, hi = float(np.nanmin(lam)), float(np.nanmax(lam))
            levels = np.geomspace(lo, hi if hi > lo else lo * 1.01, 11)
            cs = ax2.contourf(X, Y, np.ma.masked_invalid(lam), levels=levels, cmap="viridis",
                              norm=LogNorm(levels[0], levels[-1]))
            cb = fig.colorbar(cs, ax=ax2, label="λmax (largest Hessian eigenvalue)")
            ticks, text = figures.log_ticks(levels)
            cb.set_ticks(ticks, labels=text)
            cb.ax.minorticks_off()
        for a, what in ((ax, "curvature ratio (Li et al. 2018, Fig. 7)"),
                        (ax2, "sharpness: the largest eigenvalue")):
            a.plot([centre[0]], [centre[1]], "k*", ms=8, label="trained weights")
            a.set_ylabel(labels[1])
            a.set_title(what)
        ax2.set_xlabel(labels[0])
        figures.column_legend(fig, *ax.get_legend_handles_labels())
        fig.suptitle(figures.wrap(title))
        figures.small_ticks(fig)
    return fig
