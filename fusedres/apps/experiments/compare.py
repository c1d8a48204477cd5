"""``fusedres compare RUN [RUN ...]``: runs of ``fusedres train`` side by side.

He et al. (2015), Fig. 1 and 6 (plain against residual networks of several depths): training
loss, training error and test error against iterations, one curve per variant with every run
drawn, the median over its runs and the min-max band (:mod:`.compare_plots`); and a table of the
final and best test error per variant, median (min-max) over seeds.

What a reader needs to trust a difference comes first: a retraining-noise line (within each
variant, how far its seeds' final test errors lie apart: what training the same configuration
again does), then, for every pair of variants, their paired-by-seed difference with a bootstrap
95 % interval and the verdict "separated" or "not separated" (:mod:`.stats`), then where the runs
came from (commit, uncommitted changes, package versions, device: :mod:`fusedres.apps.train.
provenance`), with a warning when the runs differ in any of these.

Runs are grouped by what was trained: two runs are one variant when their saved configurations
agree on everything but the seed and the options that do not change the training (where the run
is written, threads, device, backend, logging, checkpoints, memory budgets, layout; ``IGNORED``).
Each group is named by :func:`fusedres.apps.train.naming.variant_label` (depth, unit, shortcut,
normalisation, drop-path) and, when the groups differ in anything else, by that too ("lr 0.05").
Two runs of one variant with the same seed are one experiment run twice: they are refused
(``--allow-duplicates`` takes them, each counted as a run, and says so), since counting them as
two seeds would narrow every spread and interval by a copy.

A run is read from its directory only (config.yaml, metrics.jsonl or metrics.csv, summary.json
when finished; the latest checkpoint's classifier for the number of classes, the chance line):
an unfinished run is compared as far as it got, and said to be unfinished. A run whose training
loss stops being finite is diverged from that iteration: it counts as infinitely bad in the
medians (:func:`fusedres.apps.experiments.figures.quantile`) and is marked where it diverged.

Runs trained with ``--log-grad-norms`` also give ``grad_norms.png``: each unit's gradient norms
(at its input, of its parameters) against its depth, pooled over the records of each run or
(``--grad-norm-profile per-iteration``) one curve per logged iteration (what the norms are:
:mod:`fusedres.apps.train.gradnorms`).

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

import numpy as np
import torch

from fusedres.apps.cli import UsageError
from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import provenance as prov
from fusedres.apps.train.naming import VARIANT_KEYS, variant_label

from . import figures, runs, stats
from .compare_plots import GRAD_NORMS, PROFILES, grad_norm_figure
from .compare_plots import curves_figure as figure

__all__ = ["Group", "RunCurves", "build_parser", "figure", "grad_norm_figure",
           "grad_norm_profile", "group_runs", "load_run", "main", "pairs", "plot",
           "provenance_report", "summarise"]

# Options that do not change what is trained: runs differing only in these (and the seed) are
# seeds of one variant.
IGNORED = frozenset({
    "seed", "out", "resume", "threads", "device", "backend", "data_dir", "download",
    "eval_batch_size", "memory_budget", "activation_budget", "channels_last", "compile",
    "checkpoint_every", "keep_checkpoints", "eval_every", "log_every", "log_format",
    "tensorboard", "progress", "workers", "config", "log_grad_norms"})



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
    # fusedres.apps.train.provenance's list (None: a run from before it was recorded).
    provenance: list[dict[str, Any]] | None = None

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
                     _num_classes(run_dir), grad_norms, prov.read(run_dir))


def _float(v) -> float:
    return math.nan if v is None else float(v)


# --------------------------------------------------------------------------- grouping

def _key(cfg: dict[str, Any]) -> tuple:
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in cfg.items()
                        if k not in IGNORED))


def _describe(key: str, value: Any) -> str:
    return f"{key.replace('_', ' ')} {value}" if not isinstance(value, bool) else (
        key.replace("_", " ") if value else f"no {key.replace('_', ' ')}")


def group_runs(loaded: list[RunCurves], allow_duplicates: bool = False) -> list[Group]:
    """The runs by variant, in the order their first run was given. Labels: the variant label,
    the dataset when the groups' datasets differ, and any other option the groups differ in.
    Two runs of one variant with the same seed are a UsageError unless ``allow_duplicates``."""
    groups: dict[tuple, Group] = {}
    for run in loaded:
        key = _key(run.cfg)
        groups.setdefault(key, Group(key, "")).runs.append(run)
    out = list(groups.values())
    for g in out:
        first: dict[int, RunCurves] = {}
        for r in g.runs:
            if r.seed in first and not allow_duplicates:
                raise UsageError(
                    f"RUN: {str(first[r.seed].directory)!r} and {str(r.directory)!r} are the "
                    f"same configuration and seed {r.seed} (one experiment run twice, not two "
                    "seeds); give one of them, or --allow-duplicates to count both")
            first.setdefault(r.seed, r)
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
    """Median, minimum and maximum over the runs at every iteration any of them logged."""
    at: dict[int, list[float]] = {}
    for rows in rows_by_run:
        for r in rows:
            at.setdefault(int(r["iteration"]), []).append(r[key])
    its = sorted(at)
    med, lo, hi = figures.spread([at[i] for i in its])
    return {"iteration": its, "median": med.tolist(), "min": lo.tolist(), "max": hi.tolist(),
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
    """Per unit (forward order), each norm over the group's runs: every run's median over its
    grad_norms records (``per_run``), their median, minimum and maximum; the same over each run's
    first record (``first``: the start of training, where a plain network's gradients are
    already off); and per logged iteration the median over the runs (``by_iteration``, one list
    per entry of ``iterations``). None when no run logged any."""
    logged = [r for r in g.runs if r.grad_norms]
    if not logged:
        return None
    units = logged[0].grad_norms[0]["units"]
    n = len(units)
    its = sorted({rec["iteration"] for r in logged for rec in r.grad_norms})
    out: dict[str, Any] = {"units": units, "records": sum(len(r.grad_norms) for r in logged),
                           "runs": len(logged), "iterations": its}
    for key in GRAD_NORMS:
        per_run = [figures.spread([[rec[key][u] for rec in r.grad_norms if len(rec[key]) == n]
                                   for u in range(n)])[0].tolist() for r in logged]
        med, lo, hi = figures.spread([[row[u] for row in per_run] for u in range(n)])
        first = [r.grad_norms[0][key] for r in logged if len(r.grad_norms[0][key]) == n]
        fmed, flo, fhi = figures.spread([[row[u] for row in first] for u in range(n)])
        by_it = []
        for it in its:
            recs = [rec[key] for r in logged for rec in r.grad_norms
                    if rec["iteration"] == it and len(rec[key]) == n]
            by_it.append(figures.spread([[v[u] for v in recs] for u in range(n)])[0].tolist())
        out[key] = {"per_run": per_run, "median": med.tolist(), "min": lo.tolist(),
                    "max": hi.tolist(), "by_iteration": by_it,
                    "first": {"median": fmed.tolist(), "min": flo.tolist(), "max": fhi.tolist()}}
    return out


def pairs(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every two variants (in the order given, A before B): B's final test error minus A's,
    in points, paired by seed, with its bootstrap interval and verdict
    (:func:`.stats.paired_difference`). A seed run more than once counts as the mean of its
    runs."""
    def by_seed(g):
        values: dict[int, list[float]] = {}
        for r in g["runs"]:
            if r["final_test_error"] is not None:
                values.setdefault(r["seed"], []).append(100 * r["final_test_error"])
        return {s: sum(v) / len(v) for s, v in values.items()}

    out = []
    for i, a in enumerate(summary):
        for b in summary[i + 1:]:
            out.append({"a": a["label"], "b": b["label"],
                        **stats.paired_difference(by_seed(a), by_seed(b))})
    return out


def noise(summary: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The retraining noise of :func:`.stats.retraining_noise` over the final test errors (in
    points), with the variant where the spread is largest."""
    values = [[100 * r["final_test_error"] for r in g["runs"]
               if r["final_test_error"] is not None] for g in summary]
    found = stats.retraining_noise(values)
    if found is None:
        return None
    spreads = [max(v) - min(v) if len(v) >= 2 else -1.0 for v in values]
    found["widest"] = summary[int(np.argmax(spreads))]["label"]
    return found


def noise_line(found: dict[str, Any] | None) -> str:
    if found is None:
        return ("Retraining noise: not measured (no variant has two seeds); no difference "
                "below can be told from retraining alone.")
    return (f"Retraining noise (same configuration, other seeds): the final test errors of one "
            f"variant's seeds lie {found['median']:.2f} points apart (median over "
            f"{found['variants']} variants with 2+ seeds; widest {found['max']:.2f}, "
            f"{found['widest']}). A difference between variants is claimed only where the "
            "seeds agree on it: the paired intervals below.")


def _provenance_key(entry: dict[str, Any]) -> str:
    return json.dumps({k: entry.get(k) for k in ("commit", "dirty", "versions", "device")},
                      sort_keys=True)


def provenance_report(loaded: list[RunCurves]) -> tuple[list[str], list[str]]:
    """(lines, warnings): each distinct provenance (commit, uncommitted changes, versions,
    device) with the runs that have it; warnings when the runs do not all share one, when a run
    has none recorded, or when one run was trained across several."""
    where: dict[str, list[str]] = {}
    entries: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    missing = []
    for r in loaded:
        name = r.directory.name
        if not r.provenance:
            missing.append(name)
            continue
        keys = {_provenance_key(e) for e in r.provenance}
        if len(keys) > 1:
            warnings.append(f"{name} was trained in {len(r.provenance)} parts that differ in "
                            "commit, versions or device (it was resumed elsewhere)")
        for e in r.provenance:
            k = _provenance_key(e)
            entries.setdefault(k, e)
            if name not in where.setdefault(k, []):
                where[k].append(name)
    lines = [f"- {prov.describe(entries[k])}: {len(names)} run(s) ({', '.join(names)})"
             for k, names in where.items()]
    if missing:
        lines.append(f"- not recorded (trained before fusedres recorded it): {', '.join(missing)}")
        warnings.append(f"{len(missing)} run(s) record no commit: {', '.join(missing)}")
    if len(where) > 1:
        warnings.append(f"the runs come from {len(where)} different commits, versions or "
                        "devices: a difference between variants may be theirs")
    dirty = [n for k, names in where.items() if entries[k].get("dirty") for n in names]
    if dirty:
        warnings.append(f"{len(dirty)} run(s) were trained from code with uncommitted changes: "
                        "their commit does not say what ran")
    return lines, warnings



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


def _signed(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.2f}"


def pairs_table(found: list[dict[str, Any]]) -> str:
    """One row per pair: B - A in final test error (points), paired by seed."""
    lines = ["| A | B | seeds | B - A, mean (points) | 95 % interval | verdict |",
             "|---|---|---|---:|---:|---|"]
    for p in found:
        interval = ("n/a" if p["low"] is None
                    else f"{_signed(p['low'])} to {_signed(p['high'])}")
        seeds = ", ".join(str(s) for s in p["seeds"]) or "none in common"
        lines.append(f"| {p['a']} | {p['b']} | {seeds} | {_signed(p['mean'])} | {interval} | "
                     f"{p['verdict']} |")
    return "\n".join(lines)


def plot(groups: list[Group], summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Write :func:`figure` to ``path``; None without matplotlib."""
    fig = figure(groups, summary)
    if fig is None:
        return None
    return figures.save(fig, path, layout=False)


# --------------------------------------------------------------------------- command line

def build_parser() -> runs.Parser:
    p = runs.Parser(prog="fusedres compare",
                    description="Runs of fusedres train side by side: training and test curves "
                                "per variant (every run, the median and the min-max band), a "
                                "table of final and best test error, and for every pair of "
                                "variants the paired-by-seed difference with a bootstrap 95%% "
                                "interval (He et al. 2015, Fig. 6).")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories of fusedres train; runs of one variant (differing "
                        "only in --seed) are grouped")
    p.add_argument("--out", help="output directory (default: compare/ in the runs' common "
                                 "parent directory)")
    p.add_argument("--allow-duplicates", action="store_true",
                   help="accept two runs of one variant with the same seed (a retraining), "
                        "each counted as a run; refused by default")
    p.add_argument("--grad-norm-profile", choices=PROFILES, default="pooled",
                   help="grad_norms.png: pooled (default: per run the median over its records, "
                        "then over the runs) or per-iteration (one curve per logged iteration)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        return _run(args, argv)
    except UsageError as e:
        print(f"fusedres compare: error: {e}", file=sys.stderr)
        return 2


def _notes(summary: list[dict[str, Any]]) -> list[str]:
    notes = []
    for g in summary:
        for r in g["runs"]:
            if r["diverged_at"] is not None:
                notes.append(f"{r['run']} diverged at iteration {r['diverged_at']}.")
            if not r["finished"]:
                notes.append(f"{r['run']} is unfinished (iteration {r['iterations']}).")
        seeds = [r["seed"] for r in g["runs"]]
        if len(set(seeds)) < len(seeds):
            notes.append(f"{g['label']}: a seed appears more than once (--allow-duplicates); "
                         "each run counts, so its spread is not over independent seeds.")
    return notes


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
    groups = group_runs(loaded, args.allow_duplicates)
    summary = summarise(groups)
    found_noise, found_pairs = noise(summary), pairs(summary)
    origin, origin_warnings = provenance_report(loaded)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(groups, summary, out / "compare.png")
    grad_fig = grad_norm_figure(groups, summary, args.grad_norm_profile)
    grad_png = (figures.save(grad_fig, out / "grad_norms.png", layout=False)
                if grad_fig is not None else None)
    doc = {"command": "fusedres compare " + shlex.join(argv), "groups": stats.jsonable(summary),
           "retraining_noise": found_noise, "pairs": stats.jsonable(found_pairs),
           "provenance": {"runs": {str(r.directory): r.provenance for r in loaded},
                          "warnings": origin_warnings},
           "null": "a value that is not finite (a median or quartile a diverged run reaches)",
           "files": {"figure": png.name if png else None,
                     "grad_norms": grad_png.name if grad_png else None}}
    (out / "compare.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    notes = _notes(summary)
    head = [noise_line(found_noise)] + [f"warning: {w}" for w in origin_warnings]
    lines = ["# Runs compared", "", f"`{doc['command']}`", "", *head, "",
             "Per variant (runs differing only in the seed): test error in % as the median over "
             "the seeds with (min-max); a diverged run (training loss not finite) counts as "
             "infinitely bad; `compare.json` holds every run's figures and the median curves.",
             "", table(summary), "", f"Every pair of variants, paired by seed (B's final test "
             f"error minus A's; bootstrap {100 * stats.LEVEL:.0f} % interval of the mean over "
             f"{stats.RESAMPLES} resamples of the seeds; separated: the interval excludes 0):",
             "", pairs_table(found_pairs), ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += ["Where the runs come from:", "", *origin, ""]
    if png is not None:
        lines += ["![training curves](compare.png)", ""]
    if grad_png is not None:
        lines += ["Gradient norms against depth (`--log-grad-norms` runs; `compare.json`'s "
                  "`grad_norms` per variant):", "", "![gradient norms](grad_norms.png)", ""]
    (out / "compare.md").write_text("\n".join(lines))
    print("\n".join(head) + "\n")
    print(table(summary) + "\n")
    print(pairs_table(found_pairs) + "\n")
    print("Where the runs come from:\n" + "\n".join(origin))
    for n in notes:
        print(f"note: {n}")
    print(f"\nwritten: {out / 'compare.md'}, {out / 'compare.json'}"
          + (f", {png}" if png else " (no figure: matplotlib is not installed)")
          + (f", {grad_png}" if grad_png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
