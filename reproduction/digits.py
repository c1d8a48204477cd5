"""The papers' experiments on the shipped digits data, with the CLI, resumable.

    python reproduction/digits.py run [--only orderings,shortcuts,...] [--jobs 2]
    python reproduction/digits.py report            # reproduction/RESULTS.md and the plots

    python reproduction/digits.py recipes [--seeds 0,1,2,3,4] [--only table2,li] [--runs DIR]
    python reproduction/digits.py recipes --smoke   # their digits versions, 2 iterations each
    python reproduction/digits.py recipes --dry-run # the commands, to paste

``run`` trains every missing run (a run with a summary.json is done; an interrupted one resumes
from its checkpoint) as ``python -m fusedres.apps.train --config digits --out reproduction/runs/
NAME-sSEED --seed S --threads 1 ...``, 5 seeds each (He et al. 2016 report the median of 5), then
the comparisons (``fusedres compare``: medians, min-max, every pair of variants paired by seed
with a bootstrap interval), the lesion study and the loss landscapes with their Hessian maps.
``report`` reads the run directories and writes reproduction/results.json, RESULTS.md and the
PNGs (digits_report.py). Run directories are not committed (reproduction/runs is ignored);
results.json keeps every figure the tables use, and each run's provenance (commit, versions,
device) as its config.yaml recorded it.

``recipes`` is the seed loop of the papers' CIFAR recipes (the shipped configs, one run per
variant and seed, then one ``fusedres compare`` per paper): He et al. 2016 Tables 1-3 (Table 3:
ResNet-164 and 1001, original and pre-activation units, CIFAR-10 and CIFAR-100), Huang et al.'s
ResNet-110 with and without stochastic depth, Li et al.'s ResNet-20/56/110 with and without
shortcuts. ``--smoke`` runs the same commands on digits for 2 iterations (what CI checks): the
networks and recipes are the papers', the data are digits' 10 classes, so the CIFAR-100 rows
check their network and recipe, not a 100-way classifier. Trainer options after ``--`` are added
to every run; ``--dry-run`` prints the commands as they run when pasted (``python -m ...``).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"
SEEDS = (0, 1, 2, 3, 4)

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
# The BatchNorm networks of 20 and 56 layers also log each unit's gradient norms every 44 of
# their 440 iterations (10 records a run): measuring them changes nothing trained, so the depth
# study's runs are the gradient-norm runs too.
GRAD_NORM_FLAGS = ["--log-grad-norms", "44"]
DEPTH_STUDY = {}
for _d in DEPTHS:
    for _short, _sname in (("identity", "res"), ("none", "plain")):
        for _norm, _nname in (("batch", "bn"), ("none", "nobn")):
            DEPTH_STUDY[f"depth-{_sname}-{_nname}-{_d}"] = (
                ["--depth", str(_d), "--shortcut", _short, "--norm", _norm]
                + (GRAD_NORM_FLAGS if _norm == "batch" and _d in (20, 56) else []), SEEDS)
# ResNet-1001 on digits: about 25 s an epoch on one thread, 17 minutes a run.
DEEPEST = {"depth-res-bn-1001": (["--depth", "1001"], (0, 1, 2))}
# Huang et al.: linear rule to p_L = 0.5, whole mini-batches skip a unit. Without: depth-res-bn-110.
STOCHASTIC = {
    "sd-batch-110": (["--depth", "110", "--drop-path-rate", "0.5", "--drop-path-mode",
                      "batch"], SEEDS),
}
# Li et al.'s networks for the loss landscapes: their original (post-activation) unit, with and
# without shortcuts, and their optimiser (Nesterov, weight decay on every parameter; the digits
# recipe's 5e-4 is theirs), at 56 layers, on the digits schedule.
LI_FLAGS = ["--depth", "56", "--unit", "original", "--nesterov", "--bn-weight-decay",
            "--bias-weight-decay"]
LI = {"li-res-56": (LI_FLAGS + ["--shortcut", "identity"], SEEDS),
      "li-plain-56": (LI_FLAGS + ["--shortcut", "none"], SEEDS)}
# Li et al.'s trajectory plot: the residual ResNet-20 with a checkpoint every 2 epochs, all kept.
TRAJECTORY = {"traj-res-bn-20": (["--depth", "20", "--checkpoint-every", "22",
                                  "--keep-checkpoints", "100"], (0,))}
EXPERIMENTS = {"orderings": ORDERINGS, "shortcuts": SHORTCUTS, "depth": DEPTH_STUDY,
               "stochastic": STOCHASTIC, "deepest": DEEPEST, "li": LI,
               "trajectory": TRAJECTORY}
# Rows the tables share: the identity shortcut on the original unit, training without
# stochastic depth.
SAME_AS = {"short-identity": "order-original", "sd-none-110": "depth-res-bn-110"}

# `fusedres compare` per study: its experiments (every seed), out folder runs/compare-STUDY.
COMPARES = {
    "orderings": list(ORDERINGS),
    "shortcuts": ["order-original", *SHORTCUTS],
    # He et al. 2015 Fig. 6: plain against residual (BatchNorm), 20 and 56 layers; these runs
    # logged their gradient norms: grad_norms.png too.
    "depth": [f"depth-{k}-bn-{d}" for d in (20, 56) for k in ("plain", "res")],
    "stochastic": ["depth-res-bn-110", "sd-batch-110"],
    "li": list(LI),
    # Deeper and without BatchNorm: plain against residual at 110 layers; the residual network
    # with and without BatchNorm, and the plain one without, at 20 layers (the depth where a
    # network without BatchNorm still trains here); ResNet-1001 against ResNet-110 (1001's
    # three seeds paired with 110's first three).
    "depth-110": ["depth-plain-bn-110", "depth-res-bn-110"],
    "no-bn": ["depth-res-bn-20", "depth-res-nobn-20", "depth-plain-nobn-20"],
    "deepest": ["depth-res-bn-110", "depth-res-bn-1001"],
}
# Analyses on finished runs: (kind, runs, extra flags, out folder).
# Depth 20: the deepest plain network with BatchNorm that trains here.
LESION = ("lesion", ["depth-res-bn-20-s0", "depth-plain-bn-20-s0"],
          ["--max-deleted", "7", "--draws", "5"], "lesion-20")
GRAD_PROFILE = ("compare", [f"{n}-s{s}" for n in COMPARES["depth"] for s in SEEDS],
                ["--grad-norm-profile", "per-iteration"], "compare-depth-per-iteration")
TRAJECTORY_PLOT = ("landscape", ["traj-res-bn-20-s0"],
                   ["--trajectory", "--grid", "21", "--batches", "2"], "trajectory-res-bn-20")
# Li et al.'s surfaces and curvature maps: 13 x 13 over [-1, 1] on 256 training images, the
# Hessian's extreme eigenvalues at every second point (7 x 7, the centre included).
LANDSCAPE_FLAGS = ["--grid", "13", "--batches", "1", "--batch-size", "256", "--hessian",
                   "--hessian-every", "2"]
LANDSCAPES = [("landscape", [run], LANDSCAPE_FLAGS, f"landscape-{run}")
              for run in ("li-res-56-s0", "li-plain-56-s0")]
ANALYSES = ("compare", "lesion", "landscape")


# The papers' CIFAR recipes (fusedres/apps/configs), by paper: run name -> (config, variant
# flags). The seed loop of `recipes` trains each over --seeds; `fusedres compare` then groups
# each paper's runs by variant. Table 3's CIFAR-10 ResNet-164 rows are Table 2's runs.
_UNITS = ("original", "bn_after_add", "relu_before_add", "relu_only_preact", "preact")
RECIPES = {
    "table2": {f"t2-{d}-{u}": ("he2016_cifar10_resnet110", ["--unit", u] + (
        ["--model", "preact_resnet164"] if d == 164 else [])) for d in (110, 164)
        for u in _UNITS},
    "table1": {f"t1-{sc}": ("he2016_cifar10_shortcuts", flags[4:]) for sc, flags in (
        ("identity", ["", "", "", "", "--shortcut", "identity"]),
        *((k[len("short-"):], f) for k, (f, _) in SHORTCUTS.items()))},
    "table3": {**{f"t3-c10-1001-{u}": ("cifar10_resnet1001", ["--unit", u])
                  for u in ("original", "preact")},
               **{f"t3-c100-{d}-{u}": ("cifar100_resnet164", ["--unit", u] + (
                   ["--model", "preact_resnet1001"] if d == 1001 else []))
                  for d in (164, 1001) for u in ("original", "preact")}},
    "huang": {"huang-sd-110": ("huang2016_cifar10_resnet110_sd", []),
              "huang-constant-110": ("huang2016_cifar10_resnet110_sd",
                                     ["--drop-path-rate", "0"])},
    "li": {f"li-{d}{suffix}": ("li2018_cifar10_resnet56",
                               (["--model", f"preact_resnet{d}"] if d != 56 else []) + flags)
           for d in (20, 56, 110) for suffix, flags in (("", []),
                                                        ("-noshort", ["--shortcut", "none"]))},
}
# Runs of another paper's loop a comparison includes (Table 3 compares the 164-layer units of
# Table 2 on CIFAR-10 beside its own).
SHARED = {"table3": ["t2-164-original", "t2-164-preact"]}
# --smoke: the recipes' digits versions (their networks and variants, a few iterations).
SMOKE = ["--dataset", "digits", "--max-iters", "2", "--batch-size", "16", "--eval-batch-size",
         "64", "--warmup-iters", "0", "--milestones", "1", "--log-every", "1", "--threads", "1",
         "--no-tensorboard"]


def _python() -> str:
    return sys.executable


def shown(cmd: list[str]) -> str:
    """A command as it runs when pasted into a shell where ``python`` is the environment's
    (``python -m fusedres.apps.train ...``), quoted."""
    return shlex.join(["python", *cmd[1:]] if cmd and cmd[0] == _python() else cmd)


def recipe_command(config: str, flags: list[str], seed: int, out: Path,
                   extra: list[str]) -> list[str]:
    return [_python(), "-m", "fusedres.apps.train", "--config", config, *flags, "--seed", str(seed),
            "--no-progress", *extra, "--out", str(out)]


def _recipe_job(name: str, seed: int, runs_dir: Path, extra: list[str]):
    """(command, log) training recipe run NAME at ``seed`` (resumed when it has checkpoints),
    None when it is done."""
    out = runs_dir / f"{name}-s{seed}"
    if _done(out):
        return None
    config, flags = next(runs[name] for runs in RECIPES.values() if name in runs)
    cmd = recipe_command(config, flags, seed, out, extra)
    if (out / "checkpoints").is_dir():
        cmd.append("--resume")
    return cmd, out / "train.log"


def _recipe_jobs(only: list[str], seeds: list[int], runs_dir: Path, extra: list[str]):
    """The training jobs of the papers ``only`` and one comparison per paper. A run another
    paper's comparison shares (SHARED) is trained by its own paper's loop, or by the sharing
    one's when its own paper is not asked for."""
    todo, compares = [], []
    for paper in only:
        names = list(RECIPES[paper])
        borrowed = [n for n in SHARED.get(paper, [])
                    if not any(n in RECIPES[p] for p in only)]
        jobs = [_recipe_job(n, s, runs_dir, extra) for n in names + borrowed for s in seeds]
        todo += [j for j in jobs if j is not None]
        dirs = [runs_dir / f"{n}-s{s}" for n in names + SHARED.get(paper, []) for s in seeds]
        target = runs_dir / f"compare-{paper}"
        compares.append(([_python(), "-m", "fusedres.apps.cli", "compare", *map(str, dirs),
                          "--out", str(target)], target / "compare.log"))
    return todo, compares


def recipes(only: list[str], seeds: list[int], runs_dir: Path, jobs: int,
            extra: list[str], dry_run: bool = False) -> int:
    """Train every recipe of ``only`` (papers of RECIPES) over ``seeds`` into ``runs_dir``
    (NAME-sSEED; a finished run is kept, an interrupted one resumed), then one
    ``fusedres compare`` per paper over all its runs into ``runs_dir/compare-PAPER``."""
    todo, compares = _recipe_jobs(only, seeds, runs_dir, extra)
    if dry_run:
        for cmd, _ in todo + compares:
            print(shown(cmd))
        return 0
    return _train_then(todo, compares, jobs, f"{len(seeds)} seeds")


def _train_then(todo, after, jobs: int, what: str) -> int:
    print(f"{len(todo)} runs to train ({what}), {jobs} at a time", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(lambda job: _run(*job), todo))
    if any(codes):
        print("some runs failed (their train.log says why): no comparison", flush=True)
        return 1
    for cmd, log in after:
        codes.append(_run(cmd, log))
    return 1 if any(codes) else 0


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
        f.write("$ " + shown(cmd) + "\n")
        f.flush()
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"[{time.strftime('%H:%M:%S')}] exit {code} in {time.time() - start:.0f} s: "
          f"{log.parent.name}", flush=True)
    return code


def analyses(only: list[str]) -> list[tuple[str, list[str], list[str], str]]:
    """The analyses of ``only``: (kind, runs, flags, out folder)."""
    out = []
    if "compare" in only:
        for study, names in COMPARES.items():
            out.append(("compare", [f"{n}-s{s}" for n in names
                                    for s in EXPERIMENTS_BY_NAME[n][1]], [],
                        f"compare-{study}"))
        out.append(GRAD_PROFILE)
    if "lesion" in only:
        out.append(LESION)
    if "trajectory" in only:
        out.append(TRAJECTORY_PLOT)
    if "landscape" in only:
        out += LANDSCAPES
    return out


EXPERIMENTS_BY_NAME = {name: spec for group in EXPERIMENTS.values()
                       for name, spec in group.items()}
_WRITTEN = ("lesion.json", "landscape_2d_contour.png", "compare.json", "trajectory_contour.png")


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
    code = _train_then(todo, [], jobs, "digits")
    for cmd, log in _analysis_jobs(only):  # planned once the runs they read are trained
        code |= _run(cmd, log)
    return code


def _analysis_jobs(only: list[str]) -> list[tuple[list[str], Path]]:
    out = []
    for kind, names, flags, folder in analyses(only):
        if not all(_done(RUNS / r) for r in names):
            print(f"skipping {kind} {folder}: runs not finished", flush=True)
            continue
        target = RUNS / folder
        if kind != "landscape" and any((target / f).exists() for f in _WRITTEN):
            continue
        if kind == "landscape" and (target / "hessian_2d.json").exists():
            continue
        options = [] if kind == "compare" else ["--threads", "1", "--no-progress"]
        out.append(([_python(), "-m", "fusedres.apps.cli", kind, *[str(RUNS / r) for r in names],
                     *flags, *options, "--out", str(target)], target / f"{kind}.log"))
    return out


def report() -> None:
    """reproduction/RESULTS.md, results.json and the PNGs (digits_report.py)."""
    spec = importlib.util.spec_from_file_location("digits_report", HERE / "digits_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.report(sys.modules[__name__])


def _recipes_args(p, args) -> int:
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
    c.add_argument("--seeds", default=",".join(map(str, SEEDS)),
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
        return _recipes_args(p, args)
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
