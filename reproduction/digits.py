"""The paper experiments of issue 15 on the shipped digits data, with the CLI, resumable.

    python reproduction/digits.py run [--only orderings,shortcuts,...] [--jobs 2]
    python reproduction/digits.py report            # reproduction/RESULTS.md and the plots

``run`` trains every missing run (a run with a summary.json is done; an interrupted one resumes
from its checkpoint) as ``python -m fusedres.train --config digits --out reproduction/runs/NAME
--seed S --threads 1 ...``, then the lesion studies and loss landscapes; ``report`` reads the run
directories and writes reproduction/results.json, RESULTS.md and the PNGs. Run directories are
not committed (reproduction/runs is ignored); results.json keeps every figure the tables use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
EXPERIMENTS = {"orderings": ORDERINGS, "shortcuts": SHORTCUTS, "depth": DEPTH_STUDY,
               "stochastic": STOCHASTIC, "deepest": DEEPEST}
# Rows the tables share: the identity shortcut on the original unit, training without
# stochastic depth.
SAME_AS = {"short-identity": "order-original", "sd-none-110": "depth-res-bn-110"}
# Analyses on finished runs: (kind, runs, extra flags, out folder).
LESION = ("lesion", ["depth-res-bn-56-s0", "depth-plain-bn-56-s0"],
          ["--max-deleted", "10", "--draws", "5"], "lesion-56")
LANDSCAPES = [("landscape", [run], ["--grid", "31", "--batches", "4"], f"landscape-{run}")
              for run in ("depth-res-bn-56-s0", "depth-plain-bn-56-s0")]


def _torch_version() -> str:
    import torch

    return torch.__version__


def _python() -> str:
    return sys.executable


def train_command(name: str, flags: list[str], seed: int) -> list[str]:
    return [_python(), "-m", "fusedres.train", "--config", "digits", "--model", "preact_resnet",
            *flags, "--seed", str(seed), "--threads", "1", "--no-progress",
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


def run(only: list[str], jobs: int) -> int:
    todo = []
    for group in only:
        if group in ("lesion", "landscape"):
            continue
        for name, (flags, seeds) in EXPERIMENTS[group].items():
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
    if "landscape" in only:
        analyses += LANDSCAPES
    for kind, runs, flags, out in analyses:
        if not all(_done(RUNS / r) for r in runs):
            print(f"skipping {kind} {out}: runs not finished", flush=True)
            continue
        target = RUNS / out
        if (target / "lesion.json").exists() or (target / "landscape_2d_contour.png").exists():
            continue
        cmd = [_python(), "-m", "fusedres.cli", kind, *[str(RUNS / r) for r in runs], *flags,
               "--threads", "2", "--out", str(target), "--no-progress"]
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


def collect() -> dict:
    out = {}
    for group, runs in EXPERIMENTS.items():
        for name, (flags, seeds) in runs.items():
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
            out[name] = {"group": group, "flags": flags, "runs": rows}
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    plotted = 0
    for (short, norm), style in {("res", "bn"): "o-", ("plain", "bn"): "s-",
                                 ("res", "nobn"): "o--", ("plain", "nobn"): "s--"}.items():
        xs, loss, err = [], [], []
        for d in DEPTHS + (1001,):
            e = data.get(f"depth-{short}-{norm}-{d}")
            if not e or not e["runs"]:
                continue
            xs.append(d)
            loss.append(_median([r["train_loss"] for r in e["runs"]]))
            err.append(100 * _median([r["test_error"] for r in e["runs"]]))
        label = f"{'residual' if short == 'res' else 'plain (no shortcut)'}, " \
                f"{'BatchNorm' if norm == 'bn' else 'no normalisation'}"
        plotted += len(xs)
        axes[0].plot(xs, loss, style, label=label)
        axes[1].plot(xs, err, style, label=label)
    if not plotted:
        plt.close(fig)
        return
    for ax, what in zip(axes, ("final training loss (last epoch, augmented)",
                               "test error (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("depth (layers)")
        ax.set_title(what)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle("Depth study on digits (median of 3 seeds; 1001 layers: 1 seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_landscapes(runs: list[str], path: Path) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = [RUNS / f"landscape-{r}" / "landscape_2d.npz" for r in runs]
    if not all(f.exists() for f in files):
        return False
    fig, axes = plt.subplots(1, len(files), figsize=(5.5 * len(files), 5))
    surfaces = [np.load(f) for f in files]
    lo = min(float(np.nanmin(z["loss"])) for z in surfaces)
    hi = max(float(np.nanmax(z["loss"])) for z in surfaces)
    levels = np.geomspace(max(lo, 1e-4), hi, 30)
    for ax, z, name in zip(np.atleast_1d(axes), surfaces, runs):
        X, Y = np.meshgrid(z["x"], z["y"])
        cs = ax.contour(X, Y, z["loss"], levels=levels, cmap="summer")
        ax.clabel(cs, cs.levels[::4], fontsize=6, fmt="%.2g")
        ax.plot([0], [0], "r*", ms=10)
        ax.set_aspect("equal")
        ax.set_title(name.replace("depth-", "").replace("-s0", "")
                     .replace("res-bn-56", "ResNet-56").replace("plain-bn-56", "ResNet-56-noshort"))
    fig.suptitle("Training loss around the trained weights, filter-normalised directions "
                 "(same contour levels)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


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
        L += ["", "## Lesion study (Veit et al. 2016), depth 56, seed 0", "",
              "![lesion](lesion.png)", "",
              "Test error (%) with k units deleted (k = 1: every deletable unit alone; k >= 2: "
              "the mean of random subsets):", "",
              "| k | " + " | ".join(r["run"].split("/")[-1] for r in doc["runs"]) + " |",
              "|---|" + "---|" * len(doc["runs"])]
        for i, row in enumerate(doc["runs"][0]["by_k"]):
            cells = [f"{100 * r['by_k'][i]['mean']:.2f} ({100 * r['by_k'][i]['min']:.2f}-"
                     f"{100 * r['by_k'][i]['max']:.2f})" for r in doc["runs"]]
            L.append(f"| {row['k']} | " + " | ".join(cells) + " |")
        L += ["", f"`{_relative(doc['command'])}`; every error is in `lesion.json`."]
    if _plot_landscapes([r[1][0] for r in LANDSCAPES], HERE / "landscapes.png"):
        L += ["", "## Loss landscapes (Li et al. 2018), depth 56, seed 0", "",
              "![landscapes](landscapes.png)", ""]
        for kind, runs, flags, out in LANDSCAPES:
            L.append(f"`fusedres {kind} reproduction/runs/{runs[0]} {' '.join(flags)} --out "
                     f"reproduction/runs/{out}`  ")
    rev = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    L += ["", f"Runs made with fusedres at commit {rev}, 2-core Xeon (no GPU), torch "
          f"{_torch_version()}."]
    L += ["", "## The same experiments on CIFAR-10 (a GPU)", "",
          "The papers' settings with the CLI (the trainer's defaults are He et al.'s CIFAR "
          "recipe: 64k iterations, batch 128, lr 0.1 with steps at 32k and 48k; add `--seed S` "
          "per seed):", "", "```bash"]
    for unit in PAPER_ORDERINGS:  # Table 2, ResNet-110 and ResNet-164
        L.append(f"fusedres train --dataset cifar10 --model preact_resnet110 --unit {unit} "
                 f"--out runs/c10-110-{unit}")
    for sc, (flags, _) in SHORTCUTS.items():  # Table 1, original ResNet-110
        extra = " ".join(flags[2:])
        L.append(f"fusedres train --dataset cifar10 --model preact_resnet --depth 110 {extra} "
                 f"--out runs/c10-110-{sc}")
    L += ["fusedres train --dataset cifar10 --model preact_resnet --depth 56 --shortcut none "
          "--out runs/c10-56-noshort          # Li et al.'s noshort",
          "fusedres train --dataset cifar10 --model preact_resnet110 --drop-path-rate 0.5 "
          "--drop-path-mode batch --out runs/c10-110-sd   # Huang et al.",
          "fusedres lesion runs/c10-110-original runs/c10-56-noshort",
          "fusedres landscape runs/c10-56-noshort", "```"]
    _plot_depth(data, HERE / "depth.png")
    (HERE / "RESULTS.md").write_text("\n".join(L) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}, results.json and the plots")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="reproduction/digits.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--only", default="orderings,shortcuts,depth,stochastic,lesion,landscape",
                   help="comma-separated: " + ",".join(list(EXPERIMENTS) +
                                                       ["lesion", "landscape"]))
    r.add_argument("--jobs", type=int, default=2)
    sub.add_parser("report")
    args = p.parse_args(argv)
    if args.cmd == "run":
        only = [g for g in args.only.split(",") if g]
        unknown = set(only) - set(EXPERIMENTS) - {"lesion", "landscape"}
        if unknown:
            p.error(f"--only: unknown {sorted(unknown)}")
        return run(only, args.jobs)
    report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
