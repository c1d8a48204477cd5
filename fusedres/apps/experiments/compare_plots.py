"""The figures of ``fusedres compare``, one paper column wide (:data:`figures.COLUMN_WIDTH`).

``compare.png``: training loss, training error and test error against iterations, one panel
above the other; per variant every run's own curve (thin), the median over its runs (thick) and
the min-max band; a diverged run marked x where its loss stopped being finite; chance error
dashed. The error axes are linear to 1 % and logarithmic above (``symlog``) when the curves
span more than a factor of 10, so that curves at 1-2 % do not merge under one at 90 %.

``grad_norms.png`` (``--log-grad-norms`` runs): each unit's gradient norms against its depth,
log scale. ``pooled`` (default): per variant the median over its runs of each run's median over
its records (line), every run's own value (dots), the min-max band over the runs, and the first
record's median (dotted). ``per-iteration``: one row per variant, one curve per logged
iteration (the median over the runs), coloured by iteration: how the profile moves as training
goes on.

Legends sit below the panels and name only what differs between the variants; what they share
is said once, in the figure title (:func:`figures.common_and_short`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import figures

__all__ = ["GRAD_NORMS", "PROFILES", "curves_figure", "grad_norm_figure"]

# The two norms of a grad_norms record (fusedres.apps.train.gradnorms), with their axis labels.
GRAD_NORMS = {"input_grad_norm": "||dL/dx||, unit input",
              "param_grad_norm": "||dL/dθ||, unit params"}
PROFILES = ("pooled", "per-iteration")
PANEL_HEIGHT = 1.55  # inches per panel at column width


def _finite(values) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]


def _seeds_text(runs) -> str:
    seeds = [r.seed for r in runs]
    text = ", ".join(str(s) for s in sorted(set(seeds)))
    n = len(runs)
    return (f"{n} run{'s' if n > 1 else ''}, seed{'s' if len(set(seeds)) > 1 else ''} {text}"
            + (" (a seed repeated)" if len(set(seeds)) < n else ""))


def _legend(fig, handles, ncol: int = 1) -> None:
    figures.column_legend(fig, handles, ncol=ncol)


def _error_scale(ax, values: list[float]) -> None:
    """Linear from 0 when the error curves stay within a factor of 10 of each other; else
    linear to 1 % and logarithmic above, so that low curves stay apart."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if positive and max(positive) > 10 * min(positive) and max(positive) > 2:
        from matplotlib.ticker import FixedLocator, FuncFormatter

        ax.set_yscale("symlog", linthresh=1.0, linscale=0.4)
        ticks = [t for t in (0, 1, 2, 5, 10, 20, 50, 100) if t <= 1.2 * max(positive)]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(FixedLocator([]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylim(0, 1.3 * max(positive))
    else:
        ax.set_ylim(bottom=0)


def _draw_curves(panels, groups, summary, colours) -> None:
    for g, s, colour in zip(groups, summary, colours):
        for name, ax, _, pct in panels:
            scale = 100.0 if pct else 1.0
            key = "evals" if name == "test_error" else "train"
            field = {"train_loss": "loss", "train_error": "error", "test_error": "test_error"}[name]
            if len(g.runs) > 1:
                for r in g.runs:
                    rows = getattr(r, key)
                    ax.plot([row["iteration"] for row in rows],
                            [scale * v for v in _finite([row[field] for row in rows])],
                            "-", color=colour, lw=0.5, alpha=0.45)
            c = s["curves"][name]
            x = c["iteration"]
            ax.plot(x, [scale * v for v in _finite(c["median"])],
                    ".-" if name == "test_error" else "-", color=colour, lw=1.4)
            if len(g.runs) > 1:
                ax.fill_between(x, [scale * v for v in _finite(c["min"])],
                                [scale * v for v in _finite(c["max"])], color=colour,
                                alpha=0.15, lw=0)
            for r in g.runs:
                if r.diverged_at is not None:
                    ax.plot([r.diverged_at], [0.95], marker="x", ms=6, mew=1.5, color=colour,
                            transform=ax.get_xaxis_transform(), clip_on=False)


def _draw_chance(panels, classes: list[int], top: float) -> bool:
    """Chance error dashed on the error panels where it fits the scale, else named in a note:
    whether a dashed line was drawn."""
    drawn = False
    for _, ax, _, _ in panels[1:]:
        for c in classes:
            chance = 100 * (1 - 1 / c)
            if chance <= 1.5 * top:
                ax.axhline(chance, color="0.4", ls="--", lw=0.8)
                drawn = True
            else:  # the curves would be squashed against zero: say where chance is
                ax.text(0.99, 0.96, f"chance: {chance:.0f} %, off the scale",
                        transform=ax.transAxes, ha="right", va="top", color="0.4")
    return drawn


def curves_figure(groups, summary: list[dict[str, Any]]):
    """The comparison figure (None without matplotlib); ``groups``: compare's Groups, in the
    order of ``summary``."""
    plt = figures.pyplot()
    if plt is None:
        return None
    from matplotlib.lines import Line2D

    common, shorts = figures.common_and_short([g.label for g in groups])
    with figures.column():
        fig, axes = plt.subplots(3, 1, sharex=True, layout="constrained",
                                 figsize=(figures.COLUMN_WIDTH,
                                          3 * PANEL_HEIGHT + 0.5 + 0.13 * (len(groups) + 3)))
        panels = [("train_loss", axes[0], "training loss (nats)", False),
                  ("train_error", axes[1], "training error (%)", True),
                  ("test_error", axes[2], "test error (%)", True)]
        colours = [f"C{i % 10}" for i in range(len(groups))]
        _draw_curves(panels, groups, summary, colours)
        handles = [Line2D([], [], color=c, lw=1.4, label=f"{short or 'all runs'} "
                          f"({_seeds_text(g.runs)})")
                   for g, short, c in zip(groups, shorts, colours)]
        handles.append(Line2D([], [], color="0.5", lw=1.4, label="thick: median over the runs; "
                              "thin: each run; band: min-max"))
        errors = [100 * v for s in summary for name in ("train_error", "test_error")
                  for key in ("median", "max") for v in s["curves"][name][key]
                  if math.isfinite(v)]
        classes = sorted({r.num_classes for g in groups for r in g.runs if r.num_classes})
        if _draw_chance(panels, classes, max(errors, default=0.0)):
            handles.append(Line2D([], [], color="0.4", ls="--", lw=0.8,
                                  label="chance error (1 - 1/classes)"))
        if any(r.diverged_at is not None for g in groups for r in g.runs):
            handles.append(Line2D([], [], color="k", marker="x", ls="none", ms=6, mew=1.5,
                                  label="a run diverged here (loss not finite)"))
        for _, ax, ylabel, pct in panels:
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if pct:
                _error_scale(ax, errors)
        loss = [v for s in summary for v in s["curves"]["train_loss"]["median"]
                if math.isfinite(v)]
        if loss and min(loss) > 0 and max(loss) > 10 * min(loss):
            axes[0].set_yscale("log")
        batch = sorted({int(g.runs[0].cfg["batch_size"]) for g in groups})
        axes[2].set_xlabel("iteration (SGD steps" + (f" of {batch[0]} images)"
                                                      if len(batch) == 1 else ")"))
        datasets = sorted({g.runs[0].cfg["dataset"] for g in groups})
        fig.suptitle(figures.wrap(f"{common or 'the runs'} on {', '.join(datasets)}: "
                                  "training loss, training error, test error"))
        _legend(fig, handles)
        figures.small_ticks(fig)
    return fig


def _pooled(fig_axes, drawn, colours):
    for (_, s), colour in zip(drawn, colours):
        prof = s["grad_norms"]
        depth = np.arange(1, len(prof["units"]) + 1)
        for ax, key in zip(fig_axes, GRAD_NORMS):
            p = prof[key]
            ax.plot(depth, _finite(p["median"]), "-", color=colour, lw=1.4)
            if prof["runs"] > 1:
                ax.fill_between(depth, _finite(p["min"]), _finite(p["max"]), color=colour,
                                alpha=0.15, lw=0)
                for values in p["per_run"]:
                    ax.plot(depth, _finite(values), ".", color=colour, ms=2.5, alpha=0.7)
            ax.plot(depth, _finite(p["first"]["median"]), ":", color=colour, lw=1.0)


def grad_norm_figure(groups, summary: list[dict[str, Any]], profile: str = "pooled"):
    """Gradient norm against unit depth (``--log-grad-norms`` runs), log scale; ``profile``:
    one of :data:`PROFILES`. None without matplotlib or when no run logged gradient norms."""
    plt = figures.pyplot()
    drawn = [(g, s) for g, s in zip(groups, summary) if s.get("grad_norms")]
    if plt is None or not drawn:
        return None
    if profile == "per-iteration":
        return _per_iteration_figure(plt, drawn)
    from matplotlib.lines import Line2D

    common, shorts = figures.common_and_short([g.label for g, _ in drawn])
    with figures.column():
        fig, axes = plt.subplots(2, 1, sharex=True, layout="constrained",
                                 figsize=(figures.COLUMN_WIDTH,
                                          2 * PANEL_HEIGHT + 0.5 + 0.13 * (len(drawn) + 3)))
        colours = [f"C{i % 10}" for i in range(len(drawn))]
        _pooled(axes, drawn, colours)
        handles = [Line2D([], [], color=c, lw=1.4, label=f"{short or 'all runs'} "
                          f"({_seeds_text(g.runs)}, {s['grad_norms']['records']} records)")
                   for (g, s), short, c in zip(drawn, shorts, colours)]
        its = sorted({i for _, s in drawn for i in s["grad_norms"]["iterations"]})
        handles += [Line2D([], [], color="0.5", lw=1.4, marker=".", ms=2.5,
                           label="line: median over runs of each run's median over its "
                                 "records; dots: each run; band: min-max"),
                    Line2D([], [], color="0.5", lw=1.0, ls=":",
                           label=f"dotted: first record (iteration {its[0]}), median")]
        for ax, ylabel in zip(axes, GRAD_NORMS.values()):
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="major")
            ax.xaxis.get_major_locator().set_params(integer=True)
        axes[1].set_xlabel("residual unit in forward order (1: nearest the input)")
        fig.suptitle(figures.wrap(f"{common or 'the runs'}: gradient norms against depth "
                                  f"(iterations {its[0]}-{its[-1]})"))
        _legend(fig, handles)
        figures.small_ticks(fig)
    return fig


def _per_iteration_figure(plt, drawn):
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    common, shorts = figures.common_and_short([g.label for g, _ in drawn])
    its = sorted({i for _, s in drawn for i in s["grad_norms"]["iterations"]})
    cmap = colormaps["viridis"]
    norm = Normalize(its[0], its[-1] if its[-1] > its[0] else its[0] + 1)
    with figures.column():
        fig, axes = plt.subplots(len(drawn), 2, sharex=True, squeeze=False,
                                 layout="constrained",
                                 figsize=(figures.COLUMN_WIDTH, 1.35 * len(drawn) + 1.2))
        for row, ((_, s), short) in enumerate(zip(drawn, shorts)):
            prof = s["grad_norms"]
            depth = np.arange(1, len(prof["units"]) + 1)
            for ax, key in zip(axes[row], GRAD_NORMS):
                for it, values in zip(prof["iterations"], prof[key]["by_iteration"]):
                    ax.plot(depth, _finite(values), "-", color=cmap(norm(it)), lw=0.9)
                ax.set_yscale("log")
                ax.grid(alpha=0.3)
                ax.set_title(figures.wrap(short or "all runs", 7, figures.COLUMN_WIDTH / 2),
                             fontsize=6.5)
                ax.xaxis.get_major_locator().set_params(integer=True)
            axes[row][0].set_ylabel("||dL/dx||")
            axes[row][1].set_ylabel("||dL/dθ||")
        for ax in axes[-1]:
            ax.set_xlabel("unit (1: input side)")
        bar = fig.colorbar(ScalarMappable(norm, cmap), ax=axes, location="bottom",
                           shrink=0.8, aspect=30)
        bar.set_label("iteration logged (a curve: median over the runs)")
        fig.suptitle(figures.wrap(f"{common or 'the runs'}: gradient norms against depth, "
                                  "per logged iteration (left: at each unit's input; right: "
                                  "of its parameters)"))
        figures.small_ticks(fig)
    return fig
