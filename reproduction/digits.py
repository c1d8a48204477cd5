"""The paper experiments of issue 15 on the shipped digits data, with the CLI, resumable.

    python reproduction/digits.py run [--only orderings,shortcuts,...] [--jobs 2]
    python reproduction/digits.py report            # reproduction/RESULTS.md and the plots

    python reproduction/digits.py recipes --seeds 0,1,2,3,4 [--only table2,li] [--runs DIR]
    python reproduction/digits.py recipes --seeds 0,1 --smoke      # their digits versions

``recipes`` trains the papers' CIFAR recipes (the shipped configs, one run per variant and seed,
resumable as ``run``) and compares each paper's runs with ``fusedres compare`` (per variant the
median over the seeds and the spread); ``--smoke`` runs the same commands on digits for a few
iterations (what CI checks), and trainer options after ``--`` are added to every run.
``run`` trains every missing run (a run with a summary.json is done; an interrupted one resumes
from its checkpoint) as ``python -m fusedres.apps.train --config digits --out reproduction/runs/NAME
--seed S --threads 1 ...``, then the lesion studies and loss landscapes; ``report`` reads the run
directories and writes reproduction/results.json, RESULTS.md and the PNGs. Run directories are
not committed (reproduction/runs is ignored); results.json keeps every figure the tables use.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"
SEEDS = (0, 1, 2)

# name -> (extra flags, seeds)
ORDERINGS = {f"order-{u}": (["--depth", "56", "--unit", u], SEEDS)
             for u in ("original", "bn_after_add", "relu_before_add", "relu_only_preact",
                       "preact")}
# He et al. 2016 Table 1 was run on the original unit (ResNet-110); here depth 56. The identity
# shortcut's row is order-original.
SHORTCUTS = {
    "short-scale": (["--depth", "56", "--unit", "original", "--shortcut", "scale",
                     "--shortcut-scale", "0.5", "--scale-branch"], SEEDS),
    "short-exclusive_gate": (["--depth", "56", "--unit", "original", "--shortcut",
                              "exclusive_gate", "--gate-bias", "-6"], SEEDS),
    "short-shortcut_gate": (["--depth", "56", "--unit", "original", "--shortcut",
                             "shortcut_gate", "--gate-bias", "-6"], SEEDS),
    "short-conv1x1": (["--depth", "56", "--unit", "original", "--shortcut", "conv1x1"], SEEDS),
    "short-dropout": (["--depth", "56", "--unit", "original", "--shortcut", "dropout",
                       "--shortcut-dropout", "0.5"], SEEDS),
}
DEPTHS = (8, 20, 56, 110)
DEPTH_STUDY = {}
for _d in DEPTHS:
    for _short, _sname in (("identity", "res"), ("none", "plain")):
        for _norm, _nname in (("batch", "bn"), ("none", "nobn")):
            DEPTH_STUDY[f"depth-{_sname}-{_nname}-{_d}"] = (
                ["--depth", str(_d), "--shortcut", _short, "--norm", _norm], SEEDS)
DEEPEST = {"depth-res-bn-1001": (["--depth", "1001"], (0,))}
# Huang et al.: linear rule to p_L = 0.5, whole mini-batches skip a unit. Without: depth-res-bn-110.
STOCHASTIC = {
    "sd-batch-110": (["--depth", "110", "--drop-path-rate", "0.5", "--drop-path-mode",
                      "batch"], SEEDS),
}
# Why plain networks fail: the depth study's BatchNorm networks at 20 and 56 layers again, with
# each unit's gradient norms logged every 44 iterations (10 records a run).
GRADNORMS = {f"grad-{_sname}-bn-{_d}": (["--depth", str(_d), "--shortcut", _short,
                                         "--log-grad-norms", "44"], SEEDS)
             for _d in (20, 56) for _short, _sname in (("identity", "res"), ("none", "plain"))}
# Li et al.'s trajectory plot: the residual ResNet-20 with a checkpoint every 2 epochs, all kept.
TRAJECTORY = {"traj-res-bn-20": (["--depth", "20", "--checkpoint-every", "22",
                                  "--keep-checkpoints", "100"], (0,))}
EXPERIMENTS = {"orderings": ORDERINGS, "shortcuts": SHORTCUTS, "depth": DEPTH_STUDY,
               "stochastic": STOCHASTIC, "deepest": DEEPEST, "gradnorms": GRADNORMS,
               "trajectory": TRAJECTORY}
# Rows the tables share: the identity shortcut on the original unit, training without
# stochastic depth.
SAME_AS = {"short-identity": "order-original", "sd-none-110": "depth-res-bn-110"}
# Analyses on finished runs: (kind, runs, extra flags, out folder).
# Depth 20: the deepest plain network with BatchNorm that trains here (plain-56 stays at
# 47-63 % test error, so deleting its units shows nothing).
LESION = ("lesion", ["depth-res-bn-20-s0", "depth-plain-bn-20-s0"],
          ["--max-deleted", "7", "--draws", "5"], "lesion-20")
# He et al. 2015 Fig. 6: plain against residual (BatchNorm), depths 20 and 56, every seed.
COMPARE = ("compare", [f"depth-{kind}-bn-{d}-s{s}" for d in (20, 56) for kind in ("plain", "res")
                       for s in SEEDS], [], "compare-depth")
# fusedres compare over the gradnorms runs: grad_norms.png (norm against unit depth).
COMPARE_GRAD = ("compare", [f"{name}-s{s}" for name in GRADNORMS for s in SEEDS], [],
                "compare-gradnorms")
TRAJECTORY_PLOT = ("landscape", ["traj-res-bn-20-s0"],
                   ["--trajectory", "--grid", "21", "--batches", "2"], "trajectory-res-bn-20")
ANALYSES = ("lesion", "landscape", "compare")
LANDSCAPES = [("landscape", [run], ["--grid", "15", "--batches", "2"], f"landscape-{run}")
              for run in ("depth-res-bn-56-s0", "depth-plain-bn-56-s0")]


# The papers' CIFAR recipes (fusedres/apps/configs), by paper: run name -> (config, variant flags).
# The seed loop of `recipes` trains each over --seeds; `fusedres compare` then groups each
# paper's runs by variant (median over the seeds, min-max, interquartile range).
RECIPES = {
    "table2": {f"t2-{d}-{u}": ("he2016_cifar10_resnet110", ["--unit", u] + (
        ["--model", "preact_resnet164"] if d == 164 else []))
        for d in (110, 164) for u in ("original", "bn_after_add", "relu_before_add",
                                       "relu_only_preact", "preact")},
    "table1": {f"t1-{sc}": ("he2016_cifar10_shortcuts", flags[4:]) for sc, flags in (
        ("identity", ["", "", "", "", "--shortcut", "identity"]),
        *((k[len("short-"):], f) for k, (f, _) in SHORTCUTS.items()))},
    "huang": {"huang-sd-110": ("huang2016_cifar10_resnet110_sd", []),
              "huang-constant-110": ("huang2016_cifar10_resnet110_sd",
                                     ["--drop-path-rate", "0"])},
    "li": {"li-56": ("li2018_cifar10_resnet56", []),
           "li-56-noshort": ("li2018_cifar10_resnet56", ["--shortcut", "none"])},
    "cifar100": {"c100-164": ("cifar100_resnet164", [])},
}
# --smoke: the recipes' digits versions (their networks and variants, a few iterations).
SMOKE = ["--dataset", "digits", "--max-iters", "2", "--batch-size", "16", "--eval-batch-size",
         "64", "--warmup-iters", "0", "--milestones", "1", "--log-every", "1", "--threads", "1",
         "--no-tensorboard"]


def recipe_command(config: str, flags: list[str], seed: int, out: Path,
                   extra: list[str]) -> list[str]:
    return [_python(), "-m", "fusedres.apps.train", "--config", config, *flags, "--seed", str(seed),
            "--no-progress", *extra, "--out", str(out)]


def recipes(only: list[str], seeds: list[int], runs_dir: Path, jobs: int,
            extra: list[str], dry_run: bool = False) -> int:
    """Train every recipe of ``only`` (papers of RECIPES) over ``seeds`` into ``runs_dir``
    (NAME-sSEED; a finished run is kept, an interrupted one resumed), then one
    ``fusedres compare`` per paper over all its runs into ``runs_dir/compare-PAPER``."""
    todo, compares = [], []
    for paper in only:
        dirs = []
        for name, (config, flags) in RECIPES[paper].items():
            for seed in seeds:
                out = runs_dir / f"{name}-s{seed}"
                dirs.append(out)
                if not _done(out):
                    cmd = recipe_command(config, flags, seed, out, extra)
                    if (out / "checkpoints").is_dir():
                        cmd.append("--resume")
                    todo.append((cmd, out / "train.log"))
        target = runs_dir / f"compare-{paper}"
        compares.append(([_python(), "-m", "fusedres.apps.cli", "compare", *map(str, dirs),
                          "--out", str(target)], target / "compare.log"))
    if dry_run:
        for cmd, _ in todo + compares:
            print(" ".join(cmd[2:] if cmd[1] == "-m" else cmd))
        return 0
    print(f"{len(todo)} runs to train ({len(seeds)} seeds), {jobs} at a time", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(lambda job: _run(*job), todo))
    if any(codes):
        print("some runs failed (their train.log says why): no comparison", flush=True)
        return 1
    for cmd, log in compares:
        codes.append(_run(cmd, log))
    return 1 if any(codes) else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def _python() -> str:
    return sys.executable


def train_command(name: str, flags: list[str], seed: int) -> list[str]:
    return [_python(), "-m", "fusedres.apps.train", "--config", "digits", "--model",
            "preact_resnet", *flags, "--seed", str(seed), "--threads", "1", "--no-progress",
            "--out", str(RUNS / f"{name}-s{seed}")]


def _done(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def _run(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"[{time.strftime('%H:%M:%S')}] exit {code} in {time.time() - start:.0f} s: "
          f"{log.parent.name}", flush=True)
    return code


def run(only: list[str], jobs: int, match: str = "*") -> int:
    todo = []
    for group in only:
        if group in ANALYSES:
            continue
        for name, (flags, seeds) in EXPERIMENTS[group].items():
            if not fnmatch.fnmatch(name, match):
                continue
            for seed in seeds:
                out = RUNS / f"{name}-s{seed}"
                if not _done(out):
                    cmd = train_command(name, flags, seed)
                    if (out / "checkpoints").is_dir():
                        cmd.append("--resume")
                    todo.append((cmd, out / "train.log"))
    print(f"{len(todo)} runs to train, {jobs} at a time", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(lambda job: _run(*job), todo))
    analyses = []
    if "lesion" in only:
        analyses.append(LESION)
    if "compare" in only:
        analyses.append(COMPARE)
    if "gradnorms" in only:
        analyses.append(COMPARE_GRAD)
    if "trajectory" in only:
        analyses.append(TRAJECTORY_PLOT)
    if "landscape" in only:
        analyses += LANDSCAPES
    for kind, runs, flags, out in analyses:
        if not all(_done(RUNS / r) for r in runs):
            print(f"skipping {kind} {out}: runs not finished", flush=True)
            continue
        target = RUNS / out
        if any((target / f).exists() for f in ("lesion.json", "landscape_2d_contour.png",
                                                   "compare.json", "trajectory_contour.png")):
            continue
        options = [] if kind == "compare" else ["--threads", "2", "--no-progress"]
        cmd = [_python(), "-m", "fusedres.apps.cli", kind, *[str(RUNS / r) for r in runs], *flags,
               *options, "--out", str(target)]
        codes.append(_run(cmd, target / f"{kind}.log"))
    return 1 if any(codes) else 0


# --------------------------------------------------------------------------- report

def _final_train_loss(run_dir: Path) -> float:
    loss = float("nan")
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "epoch":
                loss = rec["loss"]
    return loss


def _relative(command: str) -> str:
    """A command as run from the repository's root (no absolute paths of this checkout)."""
    return command.replace(str(HERE.parent) + "/", "")


FIRST_COMMIT = "4507d9f"  # the commit the first full set of runs was made at


def _revision() -> str:
    return subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def collect() -> dict:
    """Every experiment's runs: from reproduction/runs where they are there (finished), else
    the figures committed in results.json (a partial rerun keeps the others)."""
    saved_path = HERE / "results.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    out = {}
    for group, runs in EXPERIMENTS.items():
        for name, (flags, seeds) in runs.items():
            if not any(_done(RUNS / f"{name}-s{seed}") for seed in seeds) and name in saved:
                # Entries older than this field were all made at FIRST_COMMIT.
                out[name] = {"commit": FIRST_COMMIT, **saved[name]}
                continue
            rows = []
            for seed in seeds:
                d = RUNS / f"{name}-s{seed}"
                if not _done(d):
                    continue
                s = json.loads((d / "summary.json").read_text())
                rows.append({"seed": seed, "test_error": s["final_test_error"],
                             "train_loss": _final_train_loss(d),
                             "time_per_epoch_s": s["time_per_epoch_s"],
                             "parameters": s["parameters"],
                             "command": _relative(" ".join(
                                 ["fusedres train"] + train_command(name, flags, seed)[3:]))})
            out[name] = {"group": group, "flags": flags, "runs": rows, "commit": _revision()}
    return out


def _median(values):
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


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
    return f"{fmt(_median(finite))}{spread}" + (f", {lost} diverged" if lost else "")


# The papers' CIFAR-10 test errors (%), for reference.
PAPER_ORDERINGS = {  # He et al. 2016 Table 2: ResNet-110, ResNet-164
    "original": (6.61, 5.93), "bn_after_add": (8.17, 6.50), "relu_before_add": (7.84, 6.14),
    "relu_only_preact": (6.71, 5.91), "preact": (6.37, 5.46)}
PAPER_SHORTCUTS = {  # He et al. 2016 Table 1, ResNet-110 (original units)
    "identity": "6.61", "scale": "12.35 (0.5 / 0.5)", "exclusive_gate": "8.70 (b_g = -6)",
    "shortcut_gate": "6.91 (b_g = -6)", "conv1x1": "12.22", "dropout": "fails (p = 0.5)"}
PAPER_DEPTH = {20: (7.37, 8.18), 56: (5.89, 13.31), 110: (5.79, 16.44)}  # Li et al. 2018


def _entry(data, name):
    return data.get(SAME_AS.get(name, name))


def _plot_depth(data, path: Path) -> None:
    """Final training loss and test error against depth: the median over the seeds with the
    interquartile range as error bars, a run whose loss is not finite counted as +inf and
    marked x at the top; chance error dashed."""
    from fusedres.apps.experiments import figures

    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    plotted = 0
    series = {("res", "bn"): "o-", ("plain", "bn"): "s-", ("res", "nobn"): "o--",
              ("plain", "nobn"): "s--"}
    for i, ((short, norm), style) in enumerate(series.items()):
        xs, loss, err, diverged = [], [], [], []
        for d in DEPTHS + (1001,):
            e = data.get(f"depth-{short}-{norm}-{d}")
            if not e or not e["runs"]:
                continue
            xs.append(d)
            loss.append([r["train_loss"] for r in e["runs"]])
            err.append([100 * r["test_error"] for r in e["runs"]])
            diverged += [d] * sum(not math.isfinite(r["train_loss"]) for r in e["runs"])
        label = (f"{'residual' if short == 'res' else 'plain (no shortcut)'}, "
                 f"{'BatchNorm' if norm == 'bn' else 'no normalisation'}")
        plotted += len(xs)
        for ax, values in zip(axes, (loss, err)):
            med, q1, q3 = figures.band(values)
            shown = np.where(np.isfinite(med), med, np.nan)
            lower = np.where(np.isfinite(med), med - q1, np.nan)
            upper = np.where(np.isfinite(q3), q3 - med, 0.0)
            ax.errorbar(xs, shown, yerr=[lower, upper], fmt=style, color=f"C{i}", capsize=3,
                        label=label)
        if diverged:
            axes[0].plot(diverged, [0.97] * len(diverged), "x", color=f"C{i}", ms=8, mew=2,
                         transform=axes[0].get_xaxis_transform(), clip_on=False)
    if not plotted:
        plt.close(fig)
        return
    axes[1].axhline(90.0, color="0.4", ls="--", lw=1, label="chance error (10 classes)")
    axes[0].plot([], [], "kx", ms=8, mew=2, label="a seed whose loss is not finite")
    for ax, what, ylabel in zip(
            axes, ("final training loss (last epoch, augmented batches)", "final test error"),
            ("training loss (cross-entropy, nats)", "test error (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("depth (layers)")
        ax.set_ylabel(ylabel)
        ax.set_title(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle("Depth on digits: median of 3 seeds, interquartile bars (1001 layers: 1 seed)")
    figures.save(fig, path)


def _depth_label(run: str) -> str:
    """'depth-plain-bn-56-s0' -> the variant label of that network."""
    from fusedres.apps.train.naming import variant_label

    _, short, norm, depth, _ = run.split("-")
    return variant_label({"model": "preact_resnet", "depth": int(depth),
                          "shortcut": "none" if short == "plain" else "identity",
                          "norm": "batch" if norm == "bn" else "none"})


def _plot_landscapes(runs: list[str], path: Path) -> bool:
    """The runs' 2-D loss surfaces side by side on one scale: the same log-spaced contour
    levels, one colour bar, the same axes."""
    from fusedres.apps.experiments import figures

    files = [RUNS / f"landscape-{r}" / "landscape_2d.npz" for r in runs]
    if not all(f.exists() for f in files):
        return False
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, len(files), figsize=(6.2 * len(files), 6.2), sharex=True,
                             sharey=True, layout="constrained", squeeze=False)
    surfaces = [np.load(f) for f in files]
    finite = [z["loss"][np.isfinite(z["loss"])] for z in surfaces]
    lo = min(float(v.min()) for v in finite)
    hi = max(float(v.max()) for v in finite)
    levels = np.geomspace(max(lo, 1e-4), hi, 30)
    from matplotlib.colors import LogNorm

    norm = LogNorm(levels[0], levels[-1])
    for ax, z, name in zip(axes[0], surfaces, runs):
        X, Y = np.meshgrid(z["x"], z["y"])
        cs = ax.contour(X, Y, np.ma.masked_invalid(z["loss"]), levels=levels, cmap="viridis",
                        norm=norm, linewidths=1)
        ax.plot([0], [0], "r*", ms=12, label="trained weights (α = β = 0)")
        ax.set_aspect("equal")
        ax.set_xlabel("α: step along direction 1 (filter-normalised)")
        ax.set_ylabel("β: step along direction 2 (filter-normalised)")
        ax.set_title(_depth_label(name).replace(": ", ":\n") + ", seed 0", fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
    bar = fig.colorbar(cs, ax=list(axes[0]), label="training loss (cross-entropy, nats), the "
                                                   "same log-spaced contours in every panel")
    ticks = levels[::4]
    bar.set_ticks(ticks, labels=[f"{v:.3g}" for v in ticks])
    bar.ax.minorticks_off()
    fig.suptitle("Training loss around the trained weights (Li et al. 2018)")
    figures.save(fig, path)
    return True


def gradnorms_section() -> list[str]:
    """RESULTS.md's section on the gradnorms runs (and reproduction/grad_norms.png), from their
    `fusedres compare`; [] before it exists."""
    import shutil

    compared = RUNS / COMPARE_GRAD[3]
    if not (compared / "grad_norms.png").exists():
        return []
    shutil.copy(compared / "grad_norms.png", HERE / "grad_norms.png")
    doc = json.loads((compared / "compare.json").read_text())
    L = ["", "## Gradient norms against depth (why plain networks fail)", "",
         "![gradient norms against unit depth](grad_norms.png)", "",
         "||dL/dx|| at each unit's input (`--log-grad-norms 44`: 10 records a run over the 440 "
         "iterations), median over the records of seeds 0, 1, 2 (interquartile range), at the "
         "first unit, the last, and their ratio; then the first records alone (iteration 44). "
         "The runs are the depth study's BatchNorm networks trained again with the norms "
         "logged (`python reproduction/digits.py run --only gradnorms`):", "",
         "| network | unit 1 | last unit | unit 1 / last | at iteration 44: unit 1 / last | "
         "test error (%) |", "|---|---|---|---|---|---|"]
    for g in doc["groups"]:
        prof = g["grad_norms"]["input_grad_norm"]
        a, f = prof["all"], prof["first"]
        err = g["final_test_error"]
        L.append(f"| {g['label']} | {a['median'][0]:.3g} ({a['q1'][0]:.3g}-{a['q3'][0]:.3g}) | "
                 f"{a['median'][-1]:.3g} ({a['q1'][-1]:.3g}-{a['q3'][-1]:.3g}) | "
                 f"{a['median'][0] / a['median'][-1]:.3g} | "
                 f"{f['median'][0] / f['median'][-1]:.3g} | "
                 f"{100 * err['median']:.2f} ({100 * err['min']:.2f}-{100 * err['max']:.2f}) |")
    L += ["", f"`{_relative(doc['command'])}`"]
    return L


def trajectory_section() -> list[str]:
    """RESULTS.md's section on Li et al.'s trajectory plot (and reproduction/trajectory.png);
    [] before the plot exists."""
    import shutil

    out = RUNS / TRAJECTORY_PLOT[3]
    if not (out / "trajectory_contour.png").exists():
        return []
    shutil.copy(out / "trajectory_contour.png", HERE / "trajectory.png")
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
            f"`{_relative(doc['command'])}`"]


def report() -> None:
    import shutil

    data = collect()
    (HERE / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    L = ["# Paper experiments on digits (issue 15)", "",
         "scikit-learn's 8x8 digits (1433 train / 364 test images), the shipped `digits` recipe "
         "(40 epochs, batch 128, SGD 0.1 with steps at 50% and 75%), one CPU thread per run, "
         "every run through `fusedres train` with fused blocks. Cells: test error (%), median "
         "over seeds 0, 1, 2 with (min-max). Exact commands: `results.json` (`command` of every "
         "run); all of it: `python reproduction/digits.py run` then `report`. The papers' "
         "CIFAR-10 figures are beside them for reference only: digits is small and easy, so "
         "differences within the seeds' spread mean the variants do not separate here.", ""]
    L += ["## Unit orderings (He et al. 2016, Table 2), depth 56", "",
          "| unit | digits, depth 56 | paper CIFAR-10 ResNet-110 | paper ResNet-164 |",
          "|---|---|---|---|"]
    for u, (p110, p164) in PAPER_ORDERINGS.items():
        L.append(f"| {u} | {_cell(_entry(data, f'order-{u}'))} | {p110:.2f} | {p164:.2f} |")
    L += ["", "## Shortcuts (He et al. 2016, Table 1), original units, depth 56", "",
          "| shortcut | digits, depth 56 | paper CIFAR-10 ResNet-110 |", "|---|---|---|"]
    for sc, paper in PAPER_SHORTCUTS.items():
        L.append(f"| {sc} | {_cell(_entry(data, f'short-{sc}'))} | {paper} |")
    L += ["", "## Depth: residual and plain networks, with and without BatchNorm", "",
          "![depth study](depth.png)", "",
          "| depth | residual + BN | plain + BN | residual, no BN | plain, no BN | "
          "Li et al. CIFAR-10 ResNet / noshort |", "|---|---|---|---|---|---|"]
    for d in DEPTHS + (1001,):
        cells = [_cell(data.get(f"depth-{a}-{b}-{d}")) for a, b in
                 (("res", "bn"), ("plain", "bn"), ("res", "nobn"), ("plain", "nobn"))]
        ref = " / ".join(f"{v:.2f}" for v in PAPER_DEPTH[d]) if d in PAPER_DEPTH else ""
        L.append(f"| {d} | " + " | ".join(cells) + f" | {ref} |")
    L += ["", "Final training loss (last epoch's mean, augmented batches):", "",
          "| depth | residual + BN | plain + BN | residual, no BN | plain, no BN |",
          "|---|---|---|---|---|"]
    for d in DEPTHS + (1001,):
        cells = [_cell(data.get(f"depth-{a}-{b}-{d}"), "train_loss", pct=False) for a, b in
                 (("res", "bn"), ("plain", "bn"), ("res", "nobn"), ("plain", "nobn"))]
        L.append(f"| {d} | " + " | ".join(cells) + " |")
    L += ["", "## Stochastic depth (Huang et al. 2016), depth 110", "",
          "| training | digits, depth 110 | paper CIFAR-10 ResNet-110 |", "|---|---|---|",
          f"| constant depth | {_cell(_entry(data, 'sd-none-110'))} | 6.41 |",
          f"| stochastic depth, p_L = 0.5, batch mode | {_cell(data.get('sd-batch-110'))} | "
          "5.25 |"]
    lesion = RUNS / LESION[3]
    if (lesion / "lesion.json").exists():
        shutil.copy(lesion / "lesion.png", HERE / "lesion.png")
        (HERE / "lesion.json").write_text(_relative((lesion / "lesion.json").read_text()))
        doc = json.loads((lesion / "lesion.json").read_text())
        from fusedres.apps.experiments import figures

        L += ["", "## Lesion study (Veit et al. 2016), depth 20, seed 0", "",
              "![lesion](lesion.png)", "",
              "Test error (%) with k units deleted (k = 1: every deletable unit alone; k >= 2: "
              f"{LESION[2][3]} random subsets): median over the subsets (min-max). Depth 20, as "
              "the plain network with BatchNorm does not train at 56 layers here (47-63 % test "
              "error): deleting its units would show nothing.", "",
              "| k | " + " | ".join(_depth_label(r["run"].split("/")[-1]) for r in doc["runs"])
              + " |", "|---|" + "---|" * len(doc["runs"])]
        for i, row in enumerate(doc["runs"][0]["by_k"]):
            cells = [f"{100 * figures.quantile(r['by_k'][i]['errors'], 0.5):.2f} "
                     f"({100 * r['by_k'][i]['min']:.2f}-{100 * r['by_k'][i]['max']:.2f})"
                     for r in doc["runs"] if i < len(r["by_k"])]
            L.append(f"| {row['k']} | " + " | ".join(cells) + " |")
        L += ["", f"`{_relative(doc['command'])}`; every error is in `lesion.json`."]
    compared = RUNS / COMPARE[3]
    if (compared / "compare.json").exists():
        shutil.copy(compared / "compare.png", HERE / "compare-depth.png")
        md = (compared / "compare.md").read_text().splitlines()
        table = [line for line in md if line.startswith("|")]
        L += ["", "## Plain against residual over training (He et al. 2015, Fig. 6)", "",
              "![training curves of plain and residual networks](compare-depth.png)", "",
              "Test error (%) per variant, median over seeds 0, 1, 2 (min-max):", "", *table, "",
              f"`{_relative(json.loads((compared / 'compare.json').read_text())['command'])}`"]
    L += gradnorms_section()
    L += trajectory_section()
    if _plot_landscapes([r[1][0] for r in LANDSCAPES], HERE / "landscapes.png"):
        L += ["", "## Loss landscapes (Li et al. 2018), depth 56, seed 0", "",
              "![landscapes](landscapes.png)", ""]
        for kind, runs, flags, out in LANDSCAPES:
            L.append(f"`fusedres {kind} reproduction/runs/{runs[0]} {' '.join(flags)} --out "
                     f"reproduction/runs/{out}`  ")
    commits: dict[str, list[str]] = {}
    for name, entry in data.items():
        if entry["runs"]:
            commits.setdefault(entry.get("commit", FIRST_COMMIT), []).append(name)
    where = "; ".join(f"at {c}: {', '.join(names) if len(commits) > 1 else 'all'}"
                      for c, names in commits.items())
    L += ["", f"Runs read with fusedres (`results.json` records each experiment's commit) {where};"
          f" 2-core Xeon (no GPU), torch {_torch_version()}."]
    L += ["", "## The same experiments on CIFAR-10 (a GPU)", "",
          "Each paper's recipe is a shipped config (fusedres/apps/configs; its comments give the "
          "recipe and the paper's figures); the option picks the variant. Test error (%) the "
          "papers report beside each command; run each over seeds, as the papers' medians "
          "are (He et al. 2016: 5 runs):", "",
          "| experiment | `fusedres train --config ...` | paper |", "|---|---|---|"]
    for unit, (p110, p164) in PAPER_ORDERINGS.items():  # Table 2
        L.append(f"| Table 2, {unit}, ResNet-110 / 164 | `he2016_cifar10_resnet110 --unit "
                 f"{unit}` (add `--model preact_resnet164`) | {p110:.2f} / {p164:.2f} |")
    for sc, paper in PAPER_SHORTCUTS.items():  # Table 1, original ResNet-110
        flags = SHORTCUTS.get(f"short-{sc}", (["", "", "", "", "--shortcut", "identity"], None))[0]
        L.append(f"| Table 1, {sc} | `he2016_cifar10_shortcuts {' '.join(flags[4:])}` "
                 f"| {paper} |")
    L += ["| Huang et al., stochastic depth p_L = 0.5, ResNet-110 | "
          "`huang2016_cifar10_resnet110_sd` (constant depth: `--drop-path-rate 0`) | "
          "5.25 (constant depth 6.41) |",
          "| Li et al., ResNet-56 / ResNet-56-noshort | `li2018_cifar10_resnet56` "
          "(`--shortcut none`) | 5.89 / 13.31 |",
          "| He et al. 2016 Table 3, CIFAR-100, ResNet-164 | `cifar100_resnet164` | 24.33 |",
          "", "The seed loop: every row above over 5 seeds, then one `fusedres compare` per "
          "paper (per variant the median over the seeds, min-max and interquartile range; "
          "`compare-PAPER/compare.md`). The same commands on digits for 2 iterations "
          "(`--smoke`) are CI's check of the loop.", "", "```bash",
          "python reproduction/digits.py recipes --seeds 0,1,2,3,4     # all papers: "
          + ", ".join(RECIPES),
          "python reproduction/digits.py recipes --only table2 --seeds 0,1,2,3,4 --runs runs "
          "-- --threads 8",
          "python reproduction/digits.py recipes --dry-run             # the commands only",
          "fusedres lesion runs/t2-110-original-s0",
          "fusedres landscape runs/li-56-s0 --trajectory   # its checkpoints' path: train it "
          "with `-- --keep-checkpoints 200`",
          "```"]
    _plot_depth(data, HERE / "depth.png")
    (HERE / "RESULTS.md").write_text("\n".join(L) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}, results.json and the plots")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="reproduction/digits.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--only", default=",".join([*EXPERIMENTS, *ANALYSES]),
                   help="comma-separated: " + ",".join([*EXPERIMENTS, *ANALYSES]))
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--match", default="*",
                   help="train only the experiments whose name matches this glob "
                        "(depth-*-bn-20: the residual and plain ResNet-20s)")
    sub.add_parser("report")
    c = sub.add_parser("recipes", help="the papers' CIFAR recipes over seeds, then compared")
    c.add_argument("--only", default=",".join(RECIPES),
                   help="comma-separated papers: " + ",".join(RECIPES))
    c.add_argument("--seeds", default="0,1,2,3,4",
                   help="comma-separated seeds (default 0,1,2,3,4: He et al. 2016's 5 runs)")
    c.add_argument("--runs", default=str(RUNS / "recipes"),
                   help="where the runs and comparisons go (default reproduction/runs/recipes)")
    c.add_argument("--jobs", type=int, default=1)
    c.add_argument("--smoke", action="store_true",
                   help="the digits versions: the same networks for 2 iterations on digits")
    c.add_argument("--dry-run", action="store_true", help="print the commands only")
    c.add_argument("extra", nargs=argparse.REMAINDER,
                   help="-- then trainer options added to every run (--threads 4 ...)")
    args = p.parse_args(argv)
    if args.cmd == "recipes":
        only = [g for g in args.only.split(",") if g]
        unknown = sorted(set(only) - set(RECIPES))
        if unknown:
            p.error(f"--only: unknown papers {unknown}; known: {', '.join(RECIPES)}")
        try:
            seeds = sorted({int(v) for v in args.seeds.split(",") if v.strip()})
        except ValueError:
            p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
        if not seeds or min(seeds) < 0:
            p.error(f"--seeds: expected at least one seed >= 0, got {args.seeds!r}")
        if args.jobs < 1:
            p.error(f"--jobs: expected at least 1, got {args.jobs}")
        extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
        if extra and not extra[0].startswith("-"):
            p.error(f"unrecognised arguments: {' '.join(extra)} (trainer options go after --)")
        return recipes(only, seeds, Path(args.runs), args.jobs,
                       (SMOKE if args.smoke else []) + extra, args.dry_run)
    if args.cmd == "run":
        only = [g for g in args.only.split(",") if g]
        unknown = set(only) - set(EXPERIMENTS) - set(ANALYSES)
        if unknown:
            p.error(f"--only: unknown {sorted(unknown)}")
        return run(only, args.jobs, args.match)
    report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
