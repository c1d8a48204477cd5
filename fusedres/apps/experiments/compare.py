"""``fusedres compare RUN [RUN ...]``: runs of ``fusedres train`` side by side.

He et al. (2015), Fig. 1 and 6 (plain against residual networks of several depths): training
loss, training error and test error against iterations, one curve per variant, the median over
its seeds with the interquartile band; and a table of the final and best test error per variant,
median and spread (min-max, and the interquartile range in the JSON) over seeds.

Runs are grouped by what was trained: two runs are one variant when their saved configurations
agree on everything but the seed and the options that do not change the training (where the run
is written, threads, device, backend, logging, checkpoints, memory budgets, layout; ``IGNORED``).
Each group is named by :func:`fusedres.apps.train.naming.variant_label` (depth, unit, shortcut,
normalisation, drop-path) and, when the groups differ in anything else, by that too ("lr 0.05").

A run is read from its directory only (config.yaml, metrics.jsonl or metrics.csv, summary.json
when finished; the latest checkpoint's classifier for the number of classes, the chance line):
an unfinished run is compared as far as it got, and said to be unfinished. A run whose training
loss stops being finite is diverged from that iteration: it counts as infinitely bad in the
medians (:func:`fusedres.apps.experiments.figures.quantile`) and is marked where it diverged.

Runs trained with ``--log-grad-norms`` also give ``grad_norms.png``: each unit's gradient norms
(at its input, of its parameters) against its depth, log-scale, per variant the median over its
seeds and logged iterations with the interquartile band, and each run's first record dotted
(:func:`grad_norm_figure`; what the norms are: :mod:`fusedres.apps.train.gradnorms`).

Writes ``compare.md``, ``compare.json`` and ``compare.png`` to --out (default: ``compare`` in the
runs' common parent directory).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusedres.apps.cli import UsageError
from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train.naming import VARIANT_KEYS, variant_label

from . import figures, runs

__all__ = ["Group", "RunCurves", "build_parser", "grad_norm_figure", "grad_norm_profile",
           "group_runs", "load_run", "main", "plot", "summarise"]

# Options that do not change what is trained: runs differing only in these (and the seed) are
# seeds of one variant.
IGNORED = frozenset({
    "seed", "out", "resume", "threads", "device", "backend", "data_dir", "download",
    "eval_batch_size", "memory_budget", "activation_budget", "channels_last", "compile",
    "checkpoint_every", "keep_checkpoints", "eval_every", "log_every", "log_format",
    "tensorboard", "progress", "workers", "config", "log_grad_norms"})

# The two norms of a grad_norms record (fusedres.apps.train.gradnorms), with their axis labels.
GRAD_NORMS = {"input_grad_norm": "||dL/dx||, gradient at the unit's input (L2, whole batch)",
              "param_grad_norm": "||dL/dθ||, gradient of the unit's parameters (L2)"}


@dataclass
class RunCurves:
    """One run's logged curves: ``train`` rows (iteration, loss, error), ``evals`` rows
    (iteration, test_loss, test_error)."""
    directory: Path
    cfg: dict[str, Any]
    train: list[dict[str, float]]
    evals: list[dict[str, float]]
    finished: bool
    target_iterations: int | None
    num_classes: int | None
    # --log-grad-norms records: iteration, units, input_grad_norm, param_grad_norm (lists).
    grad_norms: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seed(self) -> int:
        return int(self.cfg["seed"])

    @property
    def diverged_at(self) -> int | None:
        """The first logged iteration whose training loss is not finite."""
        for r in self.train:
            if not math.isfinite(r["loss"]):
                return int(r["iteration"])
        return None

    @property
    def iterations(self) -> int:
        return max([int(r["iteration"]) for r in self.train + self.evals], default=0)

    def final(self) -> dict[str, float | None]:
        """Final and best test error, final training loss (None where nothing was logged)."""
        out: dict[str, float | None] = {"final_test_error": None, "best_test_error": None,
                                        "best_iteration": None, "final_train_loss": None}
        if self.evals:
            out["final_test_error"] = self.evals[-1]["test_error"]
            best = min(self.evals, key=lambda r: figures.quantile([r["test_error"]], 0.5))
            out["best_test_error"] = best["test_error"]
            out["best_iteration"] = int(best["iteration"])
        if self.train:
            out["final_train_loss"] = self.train[-1]["loss"]
        return out


@dataclass
class Group:
    """The runs of one variant (seeds), with the label that names it."""
    key: tuple
    label: str
    runs: list[RunCurves] = field(default_factory=list)


# --------------------------------------------------------------------------- reading runs

def _number(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    return float(text)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    jsonl, csv_path = run_dir / "metrics.jsonl", run_dir / "metrics.csv"
    if jsonl.is_file():
        out = []
        for n, line in enumerate(jsonl.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise UsageError(f"RUN: {str(jsonl)!r} line {n} is not JSON (a log cut short? "
                                 "its last line may be, the others not)") from None
        return out
    if csv_path.is_file():
        with open(csv_path, newline="") as f:
            return [{k: (v if k == "kind" else _number(v)) for k, v in row.items()}
                    for row in csv.DictReader(f)]
    raise UsageError(f"RUN: no metrics.jsonl or metrics.csv in {str(run_dir)!r} (has it logged "
                     "an iteration yet?)")


def _num_classes(run_dir: Path) -> int | None:
    """The classifier's outputs in the run's latest checkpoint (memory-mapped: nothing else of
    it is read); None without a readable one."""
    path = ckpt.latest(run_dir)
    if path is None:
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(state["model"]["fc.weight"].shape[0])
    except Exception:  # a checkpoint being written, or another layout: no chance line
        return None


def load_run(path: str | Path) -> RunCurves:
    run_dir = Path(path)
    cfg = runs.read_config(run_dir)
    records = _records(run_dir)
    train = [{"iteration": int(r["iteration"]), "loss": _float(r.get("loss")),
              "error": _float(r.get("error"))} for r in records if r.get("kind") == "train"]
    evals = [{"iteration": int(r["iteration"]), "test_loss": _float(r.get("test_loss")),
              "test_error": _float(r.get("test_error"))} for r in records
             if r.get("kind") == "eval"]
    if not train and not evals:
        raise UsageError(f"RUN: {str(run_dir)!r} has logged no training or test record yet")
    summary = run_dir / "summary.json"
    target = None
    if summary.is_file():
        target = json.loads(summary.read_text()).get("iterations")
    grad_norms = [{"iteration": int(r["iteration"]), "units": list(r["units"]),
                   **{k: [_float(v) for v in r[k]] for k in GRAD_NORMS}}
                  for r in records if r.get("kind") == "grad_norms"]
    return RunCurves(run_dir, cfg, train, evals, summary.is_file(), target,
                     _num_classes(run_dir), grad_norms)


def _float(v) -> float:
    return math.nan if v is None else float(v)


# --------------------------------------------------------------------------- grouping

def _key(cfg: dict[str, Any]) -> tuple:
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in cfg.items()
                        if k not in IGNORED))


def _describe(key: str, value: Any) -> str:
    return f"{key.replace('_', ' ')} {value}" if not isinstance(value, bool) else (
        key.replace("_", " ") if value else f"no {key.replace('_', ' ')}")


def group_runs(loaded: list[RunCurves]) -> list[Group]:
    """The runs by variant, in the order their first run was given. Labels: the variant label,
    the dataset when the groups' datasets differ, and any other option the groups differ in."""
    groups: dict[tuple, Group] = {}
    for run in loaded:
        key = _key(run.cfg)
        groups.setdefault(key, Group(key, "")).runs.append(run)
    out = list(groups.values())
    cfgs = [dict(g.runs[0].cfg) for g in out]
    differing = sorted({k for k in cfgs[0] if k not in IGNORED and k not in VARIANT_KEYS
                        and len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1})
    for g, cfg in zip(out, cfgs):
        extra = [_describe(k, cfg[k]) for k in differing]
        g.label = variant_label(cfg) + (f"; {', '.join(extra)}" if extra else "")
    return out


# --------------------------------------------------------------------------- the summary

def _stats(values: list[float | None]) -> dict[str, Any]:
    present = [v for v in values if v is not None]
    if not present:
        return {"n": 0}
    return {"n": len(present),
            "median": figures.finite_or_none(figures.quantile(present, 0.5)),
            "q1": figures.finite_or_none(figures.quantile(present, 0.25)),
            "q3": figures.finite_or_none(figures.quantile(present, 0.75)),
            "min": figures.finite_or_none(figures.quantile(present, 0.0)),
            "max": figures.finite_or_none(figures.quantile(present, 1.0)),
            "not_finite": sum(not math.isfinite(v) for v in present)}


def _curve(rows_by_run: list[list[dict[str, float]]], key: str) -> dict[str, list]:
    """Median and quartiles over the runs at every iteration any of them logged."""
    at: dict[int, list[float]] = {}
    for rows in rows_by_run:
        for r in rows:
            at.setdefault(int(r["iteration"]), []).append(r[key])
    its = sorted(at)
    med, q1, q3 = figures.band([at[i] for i in its])
    return {"iteration": its, "median": med.tolist(), "q1": q1.tolist(), "q3": q3.tolist(),
            "runs": [len(at[i]) for i in its]}


def summarise(groups: list[Group]) -> list[dict[str, Any]]:
    """Per group: its runs' final figures and their statistics, and the median curves."""
    out = []
    for g in groups:
        finals = [r.final() for r in g.runs]
        out.append({
            "label": g.label,
            "config": {k: json.loads(v) for k, v in g.key},
            "runs": [{"run": str(r.directory), "seed": r.seed, "finished": r.finished,
                      "iterations": r.iterations, "diverged_at": r.diverged_at,
                      **{k: (figures.finite_or_none(v) if isinstance(v, float) else v)
                         for k, v in f.items()}}
                     for r, f in zip(g.runs, finals)],
            "final_test_error": _stats([f["final_test_error"] for f in finals]),
            "best_test_error": _stats([f["best_test_error"] for f in finals]),
            "final_train_loss": _stats([f["final_train_loss"] for f in finals]),
            "diverged": sum(r.diverged_at is not None for r in g.runs),
            "unfinished": sum(not r.finished for r in g.runs),
            "grad_norms": grad_norm_profile(g),
            "curves": {"train_loss": _curve([r.train for r in g.runs], "loss"),
                       "train_error": _curve([r.train for r in g.runs], "error"),
                       "test_error": _curve([r.evals for r in g.runs], "test_error")},
        })
    return out


def grad_norm_profile(g: Group) -> dict[str, Any] | None:
    """Per unit (forward order), each norm's median and quartiles over every grad_norms record
    of the group's runs (seeds x logged iterations), and over the first record of each run (the
    start of training, where a plain network's gradients are already off); None when no run
    logged any."""
    logged = [r for r in g.runs if r.grad_norms]
    if not logged:
        return None
    units = logged[0].grad_norms[0]["units"]
    out: dict[str, Any] = {"units": units, "records": sum(len(r.grad_norms) for r in logged),
                           "runs": len(logged),
                           "iterations": sorted({rec["iteration"] for r in logged
                                                 for rec in r.grad_norms})}
    for key in GRAD_NORMS:
        for name, recs in (("all", [rec for r in logged for rec in r.grad_norms]),
                           ("first", [r.grad_norms[0] for r in logged])):
            cols = [[rec[key][u] for rec in recs if len(rec[key]) == len(units)]
                    for u in range(len(units))]
            med, q1, q3 = figures.band(cols)
            out.setdefault(key, {})[name] = {"median": med.tolist(), "q1": q1.tolist(),
                                             "q3": q3.tolist()}
    return out


def _jsonable(obj: Any) -> Any:
    """``obj`` with every non-finite float as None (strict JSON has no NaN or Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _pct_cell(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "n/a"
    if s["median"] is None:
        return "not finite"
    text = f"{100 * s['median']:.2f}"
    if s["n"] > 1:
        hi = "inf" if s["max"] is None else f"{100 * s['max']:.2f}"
        text += f" ({100 * s['min']:.2f}-{hi})"
    return text


def _loss_cell(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "n/a"
    if s["median"] is None:
        return "not finite" + (f" ({s['not_finite']} of {s['n']})" if s["n"] > 1 else "")
    text = f"{s['median']:.3g}"
    if s["n"] > 1:
        hi = "not finite" if s["max"] is None else f"{s['max']:.3g}"
        text += f" ({s['min']:.3g}-{hi})"
    return text


def table(summary: list[dict[str, Any]]) -> str:
    lines = ["| variant | seeds | final test error (%) | best test error (%) | final training "
             "loss | diverged | unfinished |", "|---|---|---:|---:|---:|---:|---:|"]
    for g in summary:
        seeds = ", ".join(str(r["seed"]) for r in g["runs"])
        lines.append(f"| {g['label']} | {seeds} | {_pct_cell(g['final_test_error'])} | "
                     f"{_pct_cell(g['best_test_error'])} | {_loss_cell(g['final_train_loss'])} | "
                     f"{g['diverged']} of {len(g['runs'])} | {g['unfinished']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the figure

def _finite(values) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]


def plot(groups: list[Group], summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Training loss, training error and test error against iterations: per variant the median
    over its seeds (line) and the interquartile band; a diverged run marked (x at the top of
    each panel) at the iteration its training loss stopped being finite; chance error dashed."""
    fig = figure(groups, summary)
    if fig is None:
        return None
    return figures.save(fig, path, layout=False)


def _draw_curves(panels, groups: list[Group], summary: list[dict[str, Any]]) -> list:
    """Each variant's median curves, interquartile bands and divergence marks: the legend's
    handles, one a variant."""
    from matplotlib.lines import Line2D

    handles = []
    for i, (g, s) in enumerate(zip(groups, summary)):
        colour = f"C{i % 10}"
        n = len(g.runs)
        for name, ax, _, pct in panels:
            c = s["curves"][name]
            scale = 100.0 if pct else 1.0
            x = c["iteration"]
            med = [scale * v for v in _finite(c["median"])]
            ax.plot(x, med, "-" if name != "test_error" else ".-", color=colour, lw=1.5)
            if n > 1:
                q1 = [scale * v for v in _finite(c["q1"])]
                q3 = [scale * v for v in _finite(c["q3"])]
                ax.fill_between(x, q1, q3, color=colour, alpha=0.2, lw=0)
            for r in g.runs:
                if r.diverged_at is not None:
                    ax.plot([r.diverged_at], [0.97], marker="x", ms=9, mew=2, color=colour,
                            transform=ax.get_xaxis_transform(), clip_on=False)
        what = f"median of {n} seeds, interquartile band" if n > 1 else "1 seed"
        handles.append(Line2D([], [], color=colour, lw=1.5, label=f"{g.label} ({what})"))
    return handles


def _draw_chance(panels, summary: list[dict[str, Any]], classes: list[int]) -> bool:
    """Chance error on the error panels, dashed where it fits the scale, else named in a
    note: whether a dashed line was drawn."""
    drawn = False
    for name, ax, _, _ in panels[1:]:
        top = max([100 * v for s in summary for key in ("median", "q3")
                   for v in s["curves"][name][key] if math.isfinite(v)], default=0.0)
        for c in classes:
            chance = 100 * (1 - 1 / c)
            if chance <= 1.5 * top:
                ax.axhline(chance, color="0.4", ls="--", lw=1)
                drawn = True
            else:  # the curves would be squashed against zero: say where chance is
                ax.set_ylim(0, 1.1 * top if top > 0 else 1)
                ax.text(0.99, 0.98, f"chance error {chance:.0f} % (above the scale)",
                        transform=ax.transAxes, ha="right", va="top", fontsize=8, color="0.4")
    return drawn


def figure(groups: list[Group], summary: list[dict[str, Any]]):
    plt = figures.pyplot()
    if plt is None:
        return None
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6 + 0.17 * (len(groups) + 2)))
    panels = [("train_loss", axes[0], "training loss (cross-entropy, nats)", False),
              ("train_error", axes[1], "training error (%)", True),
              ("test_error", axes[2], "test error (%)", True)]
    handles = _draw_curves(panels, groups, summary)
    classes = sorted({r.num_classes for g in groups for r in g.runs if r.num_classes})
    drawn = _draw_chance(panels, summary, classes)
    if drawn:
        handles.append(Line2D([], [], color="0.4", ls="--", lw=1,
                              label="chance error (1 - 1/classes: "
                                    + ", ".join(f"{c} classes" for c in classes) + ")"))
    if any(r.diverged_at is not None for g in groups for r in g.runs):
        handles.append(Line2D([], [], color="k", marker="x", ls="none", ms=8, mew=2,
                              label="a run diverged here (training loss not finite)"))
    batch = sorted({int(g.runs[0].cfg["batch_size"]) for g in groups})
    xlabel = "iteration (SGD steps" + (f" of {batch[0]} images)" if len(batch) == 1 else ")")
    loss_values = [v for s in summary for v in s["curves"]["train_loss"]["median"]
                   if math.isfinite(v)]
    for _, ax, ylabel, pct in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if pct and ax.get_ylim()[0] != 0:
            ax.set_ylim(bottom=0)
    if loss_values and min(loss_values) > 0:
        axes[0].set_yscale("log")
    axes[0].set_title("training loss (mean of each logging window)")
    axes[1].set_title("training error (augmented batches)")
    axes[2].set_title("test error")
    datasets = sorted({g.runs[0].cfg["dataset"] for g in groups})
    fig.suptitle(f"{len(groups)} variant(s), {sum(len(g.runs) for g in groups)} run(s) on "
                 f"{', '.join(datasets)}")
    fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=8, frameon=False)
    figures.leave_room_for_legend(fig, len(handles))
    return fig


def grad_norm_figure(groups: list[Group], summary: list[dict[str, Any]]):
    """Gradient norm against unit depth (--log-grad-norms runs), log-scale y: one panel per
    norm, one curve per variant (the median over its seeds and logged iterations, interquartile
    band; dotted: the median of each run's first record). None without matplotlib or when no
    run logged gradient norms."""
    plt = figures.pyplot()
    drawn = [(g, s) for g, s in zip(groups, summary) if s.get("grad_norms")]
    if plt is None or not drawn:
        return None
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8 + 0.17 * (2 * len(drawn) + 1)))
    handles = []
    for i, (g, s) in enumerate(zip(groups, summary)):
        prof = s.get("grad_norms")
        if not prof:
            continue
        colour = f"C{i % 10}"
        depth = list(range(1, len(prof["units"]) + 1))
        for ax, key in zip(axes, GRAD_NORMS):
            allr, first = prof[key]["all"], prof[key]["first"]
            ax.plot(depth, _finite(allr["median"]), ".-", color=colour, lw=1.5)
            if prof["records"] > 1:
                ax.fill_between(depth, _finite(allr["q1"]), _finite(allr["q3"]),
                                color=colour, alpha=0.2, lw=0)
            ax.plot(depth, _finite(first["median"]), ":", color=colour, lw=1.2)
        its = prof["iterations"]
        handles.append(Line2D([], [], color=colour, lw=1.5, marker=".",
                              label=f"{g.label}: median of {prof['records']} records "
                                    f"({prof['runs']} run(s), iterations {its[0]}-{its[-1]}), "
                                    "interquartile band"))
        handles.append(Line2D([], [], color=colour, lw=1.2, ls=":",
                              label=f"{g.label}: first record (iteration {its[0]})"))
    for ax, ylabel in zip(axes, GRAD_NORMS.values()):
        ax.set_yscale("log")
        ax.set_xlabel("residual unit, in forward order (1 = nearest the input)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_title("gradient reaching each unit's input")
    axes[1].set_title("gradient of each unit's parameters")
    fig.suptitle("gradient norms against depth (fusedres train --log-grad-norms)")
    fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=8, frameon=False)
    figures.leave_room_for_legend(fig, len(handles))
    return fig


# --------------------------------------------------------------------------- command line

def build_parser() -> runs.Parser:
    p = runs.Parser(prog="fusedres compare",
                    description="Runs of fusedres train side by side: training and test curves "
                                "per variant (median over seeds, interquartile band) and a "
                                "table of final and best test error (He et al. 2015, Fig. 6).")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories of fusedres train; runs of one variant (differing "
                        "only in --seed) are grouped")
    p.add_argument("--out", help="output directory (default: compare/ in the runs' common "
                                 "parent directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        return _run(args, argv)
    except UsageError as e:
        print(f"fusedres compare: error: {e}", file=sys.stderr)
        return 2


def _run(args, argv: list[str]) -> int:
    seen: dict[Path, str] = {}
    for r in args.runs:
        resolved = Path(r).resolve()
        if resolved in seen:
            raise UsageError(f"RUN: {r!r} is given twice (as {seen[resolved]!r})")
        seen[resolved] = r
    out = Path(args.out) if args.out else (
        Path(os.path.commonpath([str(p.parent) for p in seen])) / "compare")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
    loaded = [load_run(r) for r in args.runs]  # everything read and checked before writing
    groups = group_runs(loaded)
    summary = summarise(groups)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(groups, summary, out / "compare.png")
    grad_fig = grad_norm_figure(groups, summary)
    grad_png = (figures.save(grad_fig, out / "grad_norms.png", layout=False)
                if grad_fig is not None else None)
    doc = {"command": "fusedres compare " + shlex.join(argv), "groups": _jsonable(summary),
           "null": "a value that is not finite (a median or quartile a diverged run reaches)",
           "files": {"figure": png.name if png else None,
                     "grad_norms": grad_png.name if grad_png else None}}
    (out / "compare.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    lines = ["# Runs compared", "", f"`{doc['command']}`", "",
             "Per variant (runs differing only in the seed): test error in % as the median over "
             "the seeds with (min-max); a diverged run (training loss not finite) counts as "
             "infinitely bad; `compare.json` holds every run's figures, the interquartile "
             "ranges and the median curves.", "", table(summary), ""]
    notes = []
    for g in summary:
        for r in g["runs"]:
            if r["diverged_at"] is not None:
                notes.append(f"{r['run']} diverged at iteration {r['diverged_at']}.")
            if not r["finished"]:
                notes.append(f"{r['run']} is unfinished (iteration {r['iterations']}).")
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    if png is not None:
        lines += ["![training curves](compare.png)", ""]
    if grad_png is not None:
        lines += ["Gradient norms against depth (`--log-grad-norms` runs; `compare.json`'s "
                  "`grad_norms` per variant):", "", "![gradient norms](grad_norms.png)", ""]
    (out / "compare.md").write_text("\n".join(lines))
    print(table(summary))
    for n in notes:
        print(f"note: {n}")
    print(f"\nwritten: {out / 'compare.md'}, {out / 'compare.json'}"
          + (f", {png}" if png else " (no figure: matplotlib is not installed)")
          + (f", {grad_png}" if grad_png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
