"""reproduction/RESULTS.md, results.json and the figures, from the runs of digits.py.

Every number comes from a run directory under reproduction/runs, or, for an experiment not
rerun here, from the committed results.json (its runs' commit kept with it). Comparisons are
``fusedres compare``'s: per variant the median and min-max over the seeds, and for each pair
of variants the paired-by-seed difference with its bootstrap 95 % interval and verdict; the
prose of each section says only what those verdicts say.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
from pathlib import Path

import numpy as np

from fusedres.apps.experiments import figures, stats
from fusedres.apps.train import provenance
from fusedres.apps.train.naming import variant_label

# The papers' CIFAR-10 test errors (%), for reference.
PAPER_ORDERINGS = {  # He et al. 2016 Table 2: ResNet-110, ResNet-164
    "original": (6.61, 5.93), "bn_after_add": (8.17, 6.50), "relu_before_add": (7.84, 6.14),
    "relu_only_preact": (6.71, 5.91), "preact": (6.37, 5.46)}
PAPER_SHORTCUTS = {  # He et al. 2016 Table 1, ResNet-110 (original units)
    "identity": "6.61", "scale": "12.35 (0.5 / 0.5)", "exclusive_gate": "8.70 (b_g = -6)",
    "shortcut_gate": "6.91 (b_g = -6)", "conv1x1": "12.22", "dropout": "fails (p = 0.5)"}
PAPER_DEPTH = {20: (7.37, 8.18), 56: (5.89, 13.31), 110: (5.79, 16.44)}  # Li et al. 2018
PAPER_TABLE3 = {  # He et al. 2016 Table 3: original / pre-activation units
    ("cifar10", 164): (5.93, 5.46), ("cifar10", 1001): (7.61, 4.92),
    ("cifar100", 164): (25.16, 24.33), ("cifar100", 1001): (27.82, 22.71)}
FIRST_COMMIT = "4507d9f"  # the commit the first full set of runs was made at
TEST_IMAGES = 364


def _relative(d, text: str) -> str:
    """Text as run from the repository's root: no absolute paths of this checkout, nor of the
    checkout (a worktree at the runs' commit) whose runs folder an analysis read."""
    text = text.replace(str(d.HERE.parent) + "/", "")
    return re.sub(r"(?<![\w.-])/\S*?/(reproduction/runs/)", r"\1", text)


def _final_train_loss(run_dir: Path) -> float:
    loss = float("nan")
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "epoch":
                loss = rec["loss"]
    return loss


def _commit(run_dir: Path) -> str:
    """The short commit the run was trained at (+dirty when its code had changes); the
    several commits of a run resumed elsewhere joined by '+'."""
    entries = provenance.read(run_dir) or []
    seen = []
    for e in entries:
        c = (e.get("commit") or "unknown")[:7] + ("+dirty" if e.get("dirty") else "")
        if c not in seen:
            seen.append(c)
    return " then ".join(seen) or "unrecorded"


def collect(d) -> dict:
    """Every experiment's runs: from reproduction/runs where they are there (finished), else
    the figures committed in results.json (a partial rerun keeps the others)."""
    saved_path = d.HERE / "results.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    out = {}
    for group, runs in d.EXPERIMENTS.items():
        for name, (flags, seeds) in runs.items():
            done = [s for s in seeds if d._done(d.RUNS / f"{name}-s{s}")]
            if not done:
                if name in saved:
                    out[name] = {"commit": FIRST_COMMIT, "rerun": False, **saved[name]}
                continue
            rows = []
            for seed in done:
                run_dir = d.RUNS / f"{name}-s{seed}"
                s = json.loads((run_dir / "summary.json").read_text())
                rows.append({"seed": seed, "test_error": s["final_test_error"],
                             "train_loss": _final_train_loss(run_dir),
                             "time_per_epoch_s": s["time_per_epoch_s"],
                             "parameters": s["parameters"], "commit": _commit(run_dir),
                             "command": _relative(d, d.shown(d.train_command(name, flags, seed)))})
            commits = sorted({r["commit"] for r in rows})
            out[name] = {"group": group, "flags": flags, "runs": rows, "rerun": True,
                         "commit": ", ".join(commits)}
    return out


def _cell(entry, key="test_error", pct=True) -> str:
    if not entry:
        return ""
    if not entry["runs"]:
        return "not run"
    vals = [r[key] for r in entry["runs"]]
    fmt = (lambda v: f"{100 * v:.2f}") if pct else (lambda v: f"{v:.3g}")
    finite = [v for v in vals if not math.isnan(v)]
    if not finite:
        return "diverged (NaN loss)"
    spread = f" ({fmt(min(finite))}-{fmt(max(finite))})" if len(finite) > 1 else ""
    lost = len(vals) - len(finite)
    n = f", n={len(vals)}" if len(vals) != 5 else ""
    return f"{fmt(statistics.median(finite))}{spread}{n}" + (f", {lost} diverged" if lost
                                                               else "")


def _entry(d, data, name):
    return data.get(d.SAME_AS.get(name, name))


# --------------------------------------------------------------------------- comparisons

def _compare(d, study: str) -> dict | None:
    path = d.RUNS / f"compare-{study}" / "compare.json"
    return json.loads(path.read_text()) if path.exists() else None


def _short(label: str) -> str:
    return label.replace(", BatchNorm, no drop-path", "").replace("full pre-activation unit",
                                                                   "pre-activation")


def pairs_section(doc: dict | None, wanted=None) -> list[str]:
    """The pairs table of a comparison (``wanted(pair)`` filters), then one line per verdict."""
    if doc is None:
        return ["", "(Not compared at this commit: its runs were not rerun with 5 seeds.)"]
    rows = [p for p in doc["pairs"] if wanted is None or wanted(p)]
    lines = ["", "Paired by seed (B's final test error minus A's, in points; bootstrap 95 % "
             "interval of the mean; separated: the interval excludes 0):", "",
             "| A | B | seeds | B - A | 95 % interval | verdict |", "|---|---|---|---:|---:|---|"]
    for p in rows:
        interval = "n/a" if p["low"] is None else f"{p['low']:+.2f} to {p['high']:+.2f}"
        mean = "n/a" if p["mean"] is None else f"{p['mean']:+.2f}"
        lines.append(f"| {_short(p['a'])} | {_short(p['b'])} | {len(p['seeds'])} | {mean} | "
                     f"{interval} | {p['verdict']} |")
    sep = [p for p in rows if p["verdict"] == "separated"]
    lines += ["", f"Separated: {len(sep)} of {len(rows)} pairs"
              + (": " + "; ".join(f"{_short(p['b'] if p['mean'] < 0 else p['a'])} below "
                                  f"{_short(p['a'] if p['mean'] < 0 else p['b'])} "
                                  f"({abs(p['mean']):.2f} points)" for p in sep) if sep else "")
              + "."]
    return lines


def noise_everywhere(data: dict) -> dict | None:
    """The retraining noise over every rerun experiment with 2+ seeds (final test error in
    points)."""
    values = [[100 * r["test_error"] for r in e["runs"]] for e in data.values()
              if e.get("rerun")]
    return stats.retraining_noise(values)


# --------------------------------------------------------------------------- figures

def plot_depth(d, data, path: Path) -> None:
    """Final training loss and test error against depth: every seed a dot, the median a line,
    min-max bars; a run whose loss is not finite marked x at the top; chance error dashed."""
    plt = figures.pyplot()
    series = {("res", "bn"): ("o-", "residual, BatchNorm"),
              ("plain", "bn"): ("s-", "plain, BatchNorm"),
              ("res", "nobn"): ("o--", "residual, no normalisation"),
              ("plain", "nobn"): ("s--", "plain, no normalisation")}
    with figures.column():
        fig, axes = plt.subplots(2, 1, sharex=True, layout="constrained",
                                 figsize=(figures.COLUMN_WIDTH, 4.6))
        for i, ((short, norm), (style, label)) in enumerate(series.items()):
            xs, loss, err, diverged = [], [], [], []
            for depth in (*d.DEPTHS, 1001):
                e = data.get(f"depth-{short}-{norm}-{depth}")
                if not e or not e["runs"]:
                    continue
                xs.append(depth)
                loss.append([r["train_loss"] for r in e["runs"]])
                err.append([100 * r["test_error"] for r in e["runs"]])
                diverged += [depth] * sum(not math.isfinite(r["train_loss"]) for r in e["runs"])
            for ax, values in zip(axes, (loss, err)):
                med, lo, hi = figures.spread(values)
                with np.errstate(invalid="ignore"):  # inf - inf where a seed diverged
                    shown = np.where(np.isfinite(med), med, np.nan)
                    low = np.where(np.isfinite(med), med - lo, np.nan)
                    high = np.where(np.isfinite(hi), hi - med, 0.0)
                ax.errorbar(xs, shown, yerr=[low, high], fmt=style, color=f"C{i}", capsize=2,
                            ms=3, label=label)
                for x, v in zip(xs, values):
                    finite = [u for u in v if math.isfinite(u)]
                    ax.plot([x * (1 + 0.06 * (i - 1.5))] * len(finite), finite, ".",
                            color=f"C{i}", ms=2, alpha=0.6)
            if diverged:
                axes[0].plot(diverged, [0.95] * len(diverged), "x", color=f"C{i}", ms=6,
                             mew=1.5, transform=axes[0].get_xaxis_transform(), clip_on=False)
        axes[1].axhline(90.0, color="0.4", ls="--", lw=0.8, label="chance error (10 classes)")
        axes[0].plot([], [], "kx", ms=6, mew=1.5, label="a seed whose loss is not finite")
        axes[0].plot([], [], "k.", ms=2, label="each seed (dots); bars: min-max")
        axes[0].set_ylabel("final training loss (nats)")
        axes[1].set_ylabel("final test error (%)")
        axes[0].set_yscale("log")
        axes[1].set_yscale("symlog", linthresh=1.0, linscale=0.4)
        from matplotlib.ticker import FixedLocator, FuncFormatter

        axes[1].yaxis.set_major_locator(FixedLocator([0, 1, 2, 5, 10, 20, 50, 100]))
        axes[1].yaxis.set_minor_locator(FixedLocator([]))
        axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axes[1].set_ylim(0, 130)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("depth (layers)")
        for ax in axes:
            ax.grid(alpha=0.3)
        seen: dict[str, object] = {}
        for ax in axes:
            for h, n in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(n, h)
        figures.column_legend(fig, list(seen.values()), list(seen), ncol=2)
        fig.suptitle(figures.wrap("Depth on digits, pre-activation ResNets: median over the "
                                  "seeds, every seed, min-max"))
        figures.small_ticks(fig)
    figures.save(fig, path, layout=False)


def plot_landscapes(d, path: Path) -> bool:
    """Li et al.'s plain-against-residual figure: per network (rows) the loss contours (one
    log scale for both, clipped) and the map of |lambda_min / lambda_max| (the Hessian's),
    where the text speaks of convexity."""
    from fusedres.apps.experiments import landscape_plots as lp

    runs = [r[1][0] for r in d.LANDSCAPES]
    dirs = [d.RUNS / f"landscape-{r}" for r in runs]
    if not all((p / "landscape_2d.npz").exists() and (p / "hessian_2d.npz").exists()
               for p in dirs):
        return False
    plt = figures.pyplot()
    surfaces = [np.load(p / "landscape_2d.npz") for p in dirs]
    maps = [np.load(p / "hessian_2d.npz") for p in dirs]
    finite = np.concatenate([z["loss"][np.isfinite(z["loss"])] for z in surfaces])
    levels, clipped, hi = lp.loss_levels(finite)
    with figures.column():
        fig, axes = plt.subplots(2, 2, layout="constrained", sharex=True, sharey=True,
                                 figsize=(figures.COLUMN_WIDTH, 4.4))
        for row, (z, h, name) in enumerate(zip(surfaces, maps, runs)):
            cs = lp.loss_panel(axes[row, 0], z["x"], z["y"], z["loss"], levels, clipped, hi, fig,
                               bar=False)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.abs(h["lam_min"] / h["lam_max"])
            rs = lp.ratio_panel(axes[row, 1], h["x"], h["y"], ratio, fig, bar=False)
            what = "residual" if "res" in name else "no shortcuts"
            for ax, kind in zip(axes[row], ("loss", "|λmin/λmax|")):
                ax.plot([0], [0], "k*", ms=6)
                ax.set_title(f"{what}: {kind}", fontsize=6.5)
            axes[row, 0].set_ylabel("β")
        for ax in axes[1]:
            ax.set_xlabel("α")
        bar = fig.colorbar(cs, ax=axes[:, 0], location="bottom", shrink=0.9,
                           label="training loss (nats)" + (f"\nclipped at {levels[-1]:.3g}"
                                                          if clipped else ""))
        ticks, text = figures.log_ticks(levels, 4)
        bar.set_ticks(ticks, labels=text)
        bar.ax.minorticks_off()
        fig.colorbar(rs, ax=axes[:, 1], location="bottom", shrink=0.9, ticks=[0, 0.5, 1],
                     label="|λmin / λmax|\n(0: convex)")
        fig.suptitle(figures.wrap("Li et al.'s ResNet-56 (original units) on digits, seed 0: "
                                  "loss around the trained weights (*) and its curvature"))
        figures.small_ticks(fig)
    figures.save(fig, path, layout=False)
    return True


# --------------------------------------------------------------------------- sections

def _intro(data) -> list[str]:
    noise = noise_everywhere(data)
    line = ("" if noise is None else
            f" Retraining noise: the seeds of one configuration lie {noise['median']:.2f} points "
            f"apart in final test error (median over {noise['variants']} configurations rerun "
            f"here; widest {noise['max']:.2f}).")
    return ["# Paper experiments on digits", "",
            "scikit-learn's 8x8 digits (1433 train / 364 test images: one test image is "
            f"{100 / TEST_IMAGES:.2f} points), the shipped `digits` recipe (40 epochs, batch 128, "
            "SGD 0.1 with steps at 50% and 75%), one CPU thread per run, every run through "
            "`fusedres train` with fused blocks. Cells: final test error (%), median over seeds "
            "0-4 with (min-max) (n= where fewer seeds)." + line + " A difference between two "
            "variants is stated only where the seeds agree on it: the paired tables give B - A "
            "per seed pair, its bootstrap 95 % interval and the verdict; \"not separated\" "
            "means digits does not tell the two apart, whatever the medians say. Exact "
            "commands: `results.json` (`command` of every run); all of it: `python "
            "reproduction/digits.py run` then `report`. The papers' CIFAR-10 figures are beside "
            "them for reference only.", ""]


def _orderings(d, data) -> list[str]:
    L = ["## Unit orderings (He et al. 2016, Table 2), depth 56", "",
         "| unit | digits, depth 56 | paper CIFAR-10 ResNet-110 | paper ResNet-164 |",
         "|---|---|---|---|"]
    for u, (p110, p164) in PAPER_ORDERINGS.items():
        L.append(f"| {u} | {_cell(_entry(d, data, f'order-{u}'))} | {p110:.2f} | {p164:.2f} |")
    return L + pairs_section(_compare(d, "orderings"))


def _shortcuts(d, data) -> list[str]:
    L = ["", "## Shortcuts (He et al. 2016, Table 1), original units, depth 56", "",
         "| shortcut | digits, depth 56 | paper CIFAR-10 ResNet-110 |", "|---|---|---|"]
    for sc, paper in PAPER_SHORTCUTS.items():
        L.append(f"| {sc} | {_cell(_entry(d, data, f'short-{sc}'))} | {paper} |")
    return L + pairs_section(_compare(d, "shortcuts"),
                             lambda p: "identity shortcut" in p["a"])


def _depth(d, data) -> list[str]:
    L = ["", "## Depth: residual and plain networks, with and without BatchNorm", "",
         "![depth study](depth.png)", "",
         "| depth | residual + BN | plain + BN | residual, no BN | plain, no BN | "
         "Li et al. CIFAR-10 ResNet / noshort |", "|---|---|---|---|---|---|"]
    kinds = (("res", "bn"), ("plain", "bn"), ("res", "nobn"), ("plain", "nobn"))
    for depth in (*d.DEPTHS, 1001):
        cells = [_cell(data.get(f"depth-{a}-{b}-{depth}")) for a, b in kinds]
        ref = " / ".join(f"{v:.2f}" for v in PAPER_DEPTH[depth]) if depth in PAPER_DEPTH else ""
        L.append(f"| {depth} | " + " | ".join(cells) + f" | {ref} |")
    L += ["", "Final training loss (last epoch's mean, augmented batches):", "",
          "| depth | residual + BN | plain + BN | residual, no BN | plain, no BN |",
          "|---|---|---|---|---|"]
    for depth in (*d.DEPTHS, 1001):
        cells = [_cell(data.get(f"depth-{a}-{b}-{depth}"), "train_loss", pct=False)
                 for a, b in kinds]
        L.append(f"| {depth} | " + " | ".join(cells) + " |")
    L += ["", "Plain against residual, BatchNorm, 20 and 56 layers:"] + pairs_section(
        _compare(d, "depth"))
    L += ["", "Plain against residual, BatchNorm, 110 layers:"] + pairs_section(
        _compare(d, "depth-110"))
    L += ["", "Without BatchNorm, 20 layers (and the residual network with it):"] + pairs_section(
        _compare(d, "no-bn"))
    return L + ["", "ResNet-1001 against ResNet-110 (1001's three seeds, paired with 110's):"] + (
        pairs_section(_compare(d, "deepest")))


def _stochastic(d, data) -> list[str]:
    return ["", "## Stochastic depth (Huang et al. 2016), depth 110", "",
            "| training | digits, depth 110 | paper CIFAR-10 ResNet-110 |", "|---|---|---|",
            f"| constant depth | {_cell(_entry(d, data, 'sd-none-110'))} | 6.41 |",
            f"| stochastic depth, p_L = 0.5, batch mode | {_cell(data.get('sd-batch-110'))} | "
            "5.25 |"] + pairs_section(_compare(d, "stochastic"))


def _li(d, data) -> list[str]:
    return ["", "## Li et al.'s networks: original units, Nesterov, decay on every parameter, "
            "depth 56", "",
            "| network | digits, depth 56 | paper CIFAR-10 ResNet-56 |", "|---|---|---|",
            f"| with shortcuts | {_cell(data.get('li-res-56'))} | 5.89 |",
            f"| without (noshort) | {_cell(data.get('li-plain-56'))} | 13.31 |"] + pairs_section(
        _compare(d, "li"))


def _lesion(d) -> list[str]:
    lesion = d.RUNS / d.LESION[3]
    if not (lesion / "lesion.json").exists():
        return []
    shutil.copy(lesion / "lesion.png", d.HERE / "lesion.png")
    (d.HERE / "lesion.json").write_text(_relative(d, (lesion / "lesion.json").read_text()))
    doc = json.loads((lesion / "lesion.json").read_text())
    L = ["", "## Lesion study (Veit et al. 2016), depth 20, seed 0", "", "![lesion](lesion.png)",
         "", "Test error (%) with k units deleted (k = 1: every unit of the subsets alone; "
         f"k >= 2: {d.LESION[2][3]} random subsets): median over the subsets (min-max). The "
         "first unit is left out of the subsets (`--keep-first-unit`, the default): its "
         "BatchNorm is the only normalisation of the stem's output. Its error deleted alone: "
         + ", ".join(f"{_depth_label(r['run'].split('/')[-1])}: "
                     f"{100 * r['units'][0]['error']:.2f}" for r in doc["runs"]) + ".", "",
         "| k | " + " | ".join(_depth_label(r["run"].split("/")[-1]) for r in doc["runs"]) + " |",
         "|---|" + "---|" * len(doc["runs"])]
    for i, row in enumerate(doc["runs"][0]["by_k"]):
        cells = [f"{100 * figures.quantile(r['by_k'][i]['errors'], 0.5):.2f} "
                 f"({100 * r['by_k'][i]['min']:.2f}-{100 * r['by_k'][i]['max']:.2f})"
                 for r in doc["runs"] if i < len(r["by_k"])]
        L.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    return L + ["", f"`{_relative(d, doc['command'])}`; every error is in `lesion.json`. One "
                "seed of each network: the spread is over the subsets, not over training."]


def _depth_label(run: str) -> str:
    """'depth-plain-bn-56-s0' -> the variant label of that network."""
    _, short, norm, depth, _ = run.split("-")
    return variant_label({"model": "preact_resnet", "depth": int(depth),
                          "shortcut": "none" if short == "plain" else "identity",
                          "norm": "batch" if norm == "bn" else "none"})


def _stat_cell(st: dict, pct: bool = True) -> str:
    if not st.get("n"):
        return "n/a"
    fmt = (lambda v: "inf" if v is None else f"{100 * v:.2f}") if pct else (
        lambda v: "not finite" if v is None else f"{v:.3g}")
    return f"{fmt(st['median'])} ({fmt(st['min'])}-{fmt(st['max'])})"


def _training_curves(d) -> list[str]:
    compared = d.RUNS / "compare-depth"
    if not (compared / "compare.json").exists():
        return []
    shutil.copy(compared / "compare.png", d.HERE / "compare-depth.png")
    doc = json.loads((compared / "compare.json").read_text())
    L = ["", "## Plain against residual over training (He et al. 2015, Fig. 6)", "",
         "![training curves of plain and residual networks](compare-depth.png)", "",
         "Per variant, median over the seeds (min-max):", "",
         "| variant | seeds | final test error (%) | best test error (%) | final training loss |",
         "|---|---|---:|---:|---:|"]
    for g in doc["groups"]:
        seeds = ", ".join(str(r["seed"]) for r in g["runs"])
        L.append(f"| {g['label']} | {seeds} | {_stat_cell(g['final_test_error'])} | "
                 f"{_stat_cell(g['best_test_error'])} | "
                 f"{_stat_cell(g['final_train_loss'], pct=False)} |")
    return L + ["", f"`{_relative(d, doc['command'])}`"]


def _gradnorms(d) -> list[str]:
    compared = d.RUNS / "compare-depth"
    if not (compared / "grad_norms.png").exists():
        return []
    shutil.copy(compared / "grad_norms.png", d.HERE / "grad_norms.png")
    per_it = d.RUNS / d.GRAD_PROFILE[3] / "grad_norms.png"
    if per_it.exists():
        shutil.copy(per_it, d.HERE / "grad_norms_by_iteration.png")
    doc = json.loads((compared / "compare.json").read_text())
    L = ["", "## Gradient norms against depth", "",
         "![gradient norms against unit depth](grad_norms.png)", "",
         "||dL/dx|| at each unit's input (`--log-grad-norms 44`: 10 records a run over the 440 "
         "iterations of the depth study's BatchNorm runs): per run the median over its records, "
         "then the median over the seeds (min-max), at the first unit, the last, and their "
         "ratio; then the first records alone (iteration 44). These are measurements of where "
         "the gradient goes, beside the test errors: they show a correlation with whether a "
         "network trains, not its cause.", "",
         "| network | unit 1 | last unit | unit 1 / last | at iteration 44: unit 1 / last | "
         "test error (%) |", "|---|---|---|---|---|---|"]
    for g in doc["groups"]:
        prof = g["grad_norms"]["input_grad_norm"]
        first = prof["first"]
        err = g["final_test_error"]
        L.append(f"| {g['label']} | {prof['median'][0]:.3g} ({prof['min'][0]:.3g}-"
                 f"{prof['max'][0]:.3g}) | {prof['median'][-1]:.3g} ({prof['min'][-1]:.3g}-"
                 f"{prof['max'][-1]:.3g}) | {prof['median'][0] / prof['median'][-1]:.3g} | "
                 f"{first['median'][0] / first['median'][-1]:.3g} | "
                 f"{100 * err['median']:.2f} ({100 * err['min']:.2f}-{100 * err['max']:.2f}) |")
    L += ["", f"`{_relative(d, doc['command'])}`"]
    if per_it.exists():
        L += ["", "The same profiles per logged iteration (median over the seeds), "
              "`--grad-norm-profile per-iteration`:", "",
              "![gradient norms per iteration](grad_norms_by_iteration.png)"]
    return L


def _trajectory(d) -> list[str]:
    out = d.RUNS / d.TRAJECTORY_PLOT[3]
    if not (out / "trajectory_contour.png").exists():
        return []
    shutil.copy(out / "trajectory_contour.png", d.HERE / "trajectory.png")
    doc = json.loads((out / "trajectory.json").read_text())
    path = doc["settings"]["trajectory"]
    ev = path["explained_variance"]
    return ["", "## Optimisation path on the loss surface (Li et al. 2018, section 7), depth 20, "
            "seed 0", "", "![training path on the loss contours](trajectory.png)", "",
            f"The {len(path['iterations'])} checkpoints (iterations {path['iterations'][0]}-"
            f"{path['iterations'][-1]}) minus the final weights: their first two PCA directions "
            f"explain {100 * ev[0]:.1f} % and {100 * ev[1]:.1f} % of the path's variance; "
            f"loss at the final weights {doc['at']['trained']['loss']:.4f} "
            f"({doc['training_images']} training images, {doc['batch_norm_statistics']}).", "",
            f"`{_relative(d, doc['command'])}`"]


def _landscapes(d) -> list[str]:
    if not plot_landscapes(d, d.HERE / "landscapes.png"):
        return []
    L = ["", "## Loss landscapes and their curvature (Li et al. 2018), depth 56, seed 0", "",
         "![landscapes](landscapes.png)", "",
         "Li et al.'s ResNet-56 with and without shortcuts (original units, their optimiser, "
         "the digits schedule), 13 x 13 points over [-1, 1] along two filter-normalised random "
         "directions, the loss on 256 training images with the trained BatchNorm statistics; "
         "the Hessian's extreme eigenvalues (every parameter, Lanczos, at most 20 products) at "
         "every second point. |λmin / λmax| near 0: locally convex; near or above 1: strong "
         "negative curvature.", "",
         "| network | loss at the centre | grid max | λmax, λmin at the centre | "
         "|λmin/λmax|: centre, median, max | points below 0.1 | converged |",
         "|---|---|---|---|---|---|---|"]
    for *_, out in d.LANDSCAPES:
        surf = json.loads((d.RUNS / out / "landscape_2d.json").read_text())
        h = json.loads((d.RUNS / out / "hessian_2d.json").read_text())
        c, r = h["centre"], h["ratio"]
        L.append(f"| {surf['label'].split(';')[0]} | {surf['at']['trained']['loss']:.4g} | "
                 f"{surf['grid_max_loss']:.3g} | {_g(c['lam_max'])}, {_g(c['lam_min'])} | "
                 f"{_g(c['ratio'])}, {_g(r['median'])}, {_g(r['max'])} | "
                 f"{r['below_0.1']} of {r['points']} | {h['converged']['points']} of "
                 f"{h['converged']['of']} |")
    L.append("")
    for kind, runs, flags, out in d.LANDSCAPES:
        L.append(f"`fusedres {kind} reproduction/runs/{runs[0]} {' '.join(flags)} --out "
                 f"reproduction/runs/{out}`  ")
    return L


def _g(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _provenance(d, data) -> list[str]:
    rerun = sorted(n for n, e in data.items() if e.get("rerun"))
    old = sorted(n for n, e in data.items() if not e.get("rerun") and e.get("runs"))
    commits = sorted({e["commit"] for n, e in data.items() if e.get("rerun")})
    L = ["", "## Where these numbers come from", "",
         f"Rerun here with 5 seeds (3 for depth 1001) at {', '.join(commits) or 'no commit'}: "
         f"{', '.join(rerun) or 'none'}."]
    if old:
        by_commit: dict[str, list[str]] = {}
        for n in old:
            by_commit.setdefault(data[n].get("commit", FIRST_COMMIT), []).append(n)
        L.append("Not rerun (3 seeds, kept from earlier commits: "
                 + "; ".join(f"{c}: {', '.join(ns)}" for c, ns in by_commit.items())
                 + "): their rows are older code and 3 seeds, and no paired comparison is "
                   "made for them.")
    versions = _versions(d)
    if versions:
        L.append(f"Machine and versions of the rerun: {versions}.")
    return L


def _versions(d) -> str:
    for path in sorted(d.RUNS.glob("*/config.yaml")):
        entries = provenance.read(path.parent)
        if entries:
            e = entries[-1]
            return (", ".join(f"{k} {v}" for k, v in e["versions"].items())
                    + f"; {e['device']}")
    return ""


def _cifar(d) -> list[str]:
    L = ["", "## The same experiments on CIFAR (a GPU)", "",
         "Each paper's recipe is a shipped config (fusedres/apps/configs; its comments give the "
         "recipe and what still differs from the paper; docs/experiments.md tabulates it); the "
         "options pick the variant. Test error (%) the papers report beside each command; the "
         "seed loop runs each over 5 seeds, as He et al. 2016 report medians of 5:", "",
         "| experiment | `fusedres train --config ...` | paper |", "|---|---|---|"]
    for unit, (p110, p164) in PAPER_ORDERINGS.items():  # Table 2
        L.append(f"| Table 2, {unit}, ResNet-110 / 164 | `he2016_cifar10_resnet110 --unit "
                 f"{unit}` (add `--model preact_resnet164`) | {p110:.2f} / {p164:.2f} |")
    for sc, paper in PAPER_SHORTCUTS.items():  # Table 1, original ResNet-110
        flags = d.SHORTCUTS.get(f"short-{sc}", (["", "", "", "", "--shortcut", "identity"],
                                                None))[0]
        L.append(f"| Table 1, {sc} | `he2016_cifar10_shortcuts {' '.join(flags[4:])}` "
                 f"| {paper} |")
    for (data, depth), (orig, pre) in PAPER_TABLE3.items():
        config = "cifar10_resnet1001" if data == "cifar10" else "cifar100_resnet164"
        model = (" --model preact_resnet1001" if data == "cifar100" and depth == 1001 else
                 " --model preact_resnet164" if data == "cifar10" and depth == 164 else "")
        L.append(f"| Table 3, {data.upper().replace('CIFAR', 'CIFAR-')}, ResNet-{depth}, "
                 f"original / pre-activation | `{config}{model} --unit original` / `--unit "
                 f"preact` | {orig:.2f} / {pre:.2f} |")
    L += ["| Huang et al., stochastic depth p_L = 0.5, ResNet-110 | "
          "`huang2016_cifar10_resnet110_sd` (constant depth: `--drop-path-rate 0`) | "
          "5.25 (constant depth 6.41) |"]
    for depth, (res, plain) in PAPER_DEPTH.items():
        model = f" --model preact_resnet{depth}" if depth != 56 else ""
        L.append(f"| Li et al., ResNet-{depth} / noshort | `li2018_cifar10_resnet56{model}` "
                 f"(`--shortcut none`) | {res:.2f} / {plain:.2f} |")
    L += ["", "The seed loop: every row above over 5 seeds, then one `fusedres compare` per "
          "paper (per variant the median and min-max over the seeds, every pair of variants "
          "paired by seed with its interval; `compare-PAPER/compare.md`). The same commands on "
          "digits for 2 iterations (`--smoke`: the CIFAR-100 rows then run digits' 10 classes) "
          "are CI's check of the loop; `--dry-run` prints them to paste.", "", "```bash",
          "python reproduction/digits.py recipes                       # all papers: "
          + ", ".join(d.RECIPES) + "; seeds 0-4",
          "python reproduction/digits.py recipes --only table2 --runs runs -- --threads 8",
          "python reproduction/digits.py recipes --dry-run             # the commands only",
          "fusedres lesion runs/t2-110-original-s0",
          "fusedres landscape runs/li-56-s0 --hessian --hessian-every 5   # curvature map",
          "```"]
    return L


def report(d) -> None:
    data = collect(d)
    (d.HERE / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    L = _intro(data)
    L += _orderings(d, data)
    L += _shortcuts(d, data)
    L += _depth(d, data)
    L += _stochastic(d, data)
    L += _li(d, data)
    L += _lesion(d)
    L += _training_curves(d)
    L += _gradnorms(d)
    L += _trajectory(d)
    L += _landscapes(d)
    L += _provenance(d, data)
    L += _cifar(d)
    plot_depth(d, data, d.HERE / "depth.png")
    (d.HERE / "RESULTS.md").write_text("\n".join(L) + "\n")
    print(f"wrote {d.HERE / 'RESULTS.md'}, results.json and the plots")
