"""``fusedres lesion RUN [RUN ...]``: the lesion study of Veit et al. (2016), "Residual
Networks Behave Like Ensembles of Relatively Shallow Networks".

Test error of a trained network with each residual unit deleted alone, and with k random units
deleted together (k = 2 .. --max-deleted, --draws subsets each; every subset when there are no
more than --draws of them; the row k = 1 is every unit alone). Deleting a unit replaces it by
the identity, so only units whose output has their input's shape can be deleted (Veit et al.
delete the identity-shortcut units); units that change the width or the resolution are kept and
listed. A plain network (no shortcuts) given beside a residual one is the contrast: deleting any
of its layer pairs should destroy it.

The first unit is left out of the deletions by default (``--keep-first-unit``; its error deleted
alone is still measured and shown, flagged): in a pre-activation network it holds the only
normalisation of the stem's output (its BN-ReLU plays the part of the BN-ReLU after the first
conv in He et al.'s code), so deleting it removes more than a unit, and every random subset that
draws it looks like a failure of the ensemble. ``--no-keep-first-unit`` deletes it like the
others, as Veit et al. count every unit.

Deletion touches no model code: the unit's entry in its stage ``nn.Sequential`` is swapped for an
``nn.Identity`` and put back afterwards (:func:`deleted_units`). The model only has to list its
residual units (``model.units()``, in forward order) and its stages (``model.stage_names``).
BatchNorm runs in eval mode (running statistics); the test set is the run's, normalised as the
trainer normalises it.

Writes ``lesion.json``, ``lesion.md`` and ``lesion.png`` to --out (default RUN/lesion, the first
RUN's when several).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from fusedres import BackendUnavailableError
from fusedres.apps.cli import UsageError
from fusedres.apps.train.seeds import derived_seed

from . import figures, runs

__all__ = ["Study", "Unit", "build_parser", "deleted_units", "draw_subsets", "figure", "lesion",
           "main", "plan", "plot", "unit_slots", "units_of"]

DEFAULT_MAX_DELETED = 10


# --------------------------------------------------------------------------- deleting units

def unit_slots(model: nn.Module) -> list[tuple[nn.Sequential, int]]:
    """Where each residual unit sits: (its stage ``nn.Sequential``, its position there), in the
    order of ``model.units()``."""
    stages = getattr(model, "stage_names", None)
    if stages is None or not callable(getattr(model, "units", None)):
        raise TypeError(f"{type(model).__name__} does not list its residual units "
                        "(model.units() and model.stage_names)")
    where = {}
    for name in stages:
        seq = getattr(model, name)
        for pos, module in enumerate(seq):
            where[id(module)] = (seq, pos)
    slots = []
    for i, unit in enumerate(model.units()):
        if id(unit) not in where:
            raise TypeError(f"unit {i} of {type(model).__name__}.units() is in none of its "
                            f"stages {', '.join(stages)}")
        slots.append(where[id(unit)])
    return slots


@contextlib.contextmanager
def deleted_units(model: nn.Module, indices: Sequence[int]) -> Iterator[None]:
    """Inside the block, the units ``indices`` (positions in ``model.units()``) are replaced by
    ``nn.Identity``; the originals are put back on exit, whatever happens."""
    slots = unit_slots(model)
    removed: list[tuple[nn.Sequential, int, nn.Module]] = []
    try:
        for i in sorted(set(indices)):
            seq, pos = slots[i]
            removed.append((seq, pos, seq[pos]))
            seq[pos] = nn.Identity()
        yield
    finally:
        for seq, pos, unit in reversed(removed):
            seq[pos] = unit


@dataclass
class Unit:
    index: int                  # position in model.units()
    name: str                   # "layer2.3": stage and position
    input_shape: tuple          # (C, H, W) of one image
    output_shape: tuple

    @property
    def deletable(self) -> bool:
        return self.input_shape == self.output_shape


@torch.no_grad()
def units_of(model: nn.Module, x: Tensor) -> list[Unit]:
    """The residual units with their input and output shapes, seen in a forward pass of
    ``x`` (forward hooks; nothing about the units' insides is assumed)."""
    slots = unit_slots(model)
    names = {}
    for stage in model.stage_names:
        for pos, module in enumerate(getattr(model, stage)):
            names[id(module)] = f"{stage}.{pos}"
    shapes: dict[int, tuple[tuple, tuple]] = {}
    handles = []
    for i, unit in enumerate(model.units()):
        def hook(module, args, out, i=i):
            y = out[0] if isinstance(out, tuple) else out
            shapes[i] = (tuple(args[0].shape[1:]), tuple(y.shape[1:]))
        handles.append(unit.register_forward_hook(hook))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    units = []
    for i, unit in enumerate(model.units()):
        if i not in shapes:
            raise TypeError(f"unit {i} ({names[id(unit)]}) did not run in the forward pass")
        units.append(Unit(i, names[id(unit)], *shapes[i]))
    assert len(units) == len(slots)
    return units


def draw_subsets(pool: Sequence[int], k: int, draws: int, seed: int) -> list[tuple[int, ...]]:
    """``draws`` distinct random k-subsets of ``pool`` (sorted tuples), or every k-subset when
    there are no more than ``draws``. A function of (pool, k, draws, seed) alone."""
    if math.comb(len(pool), k) <= draws:
        return list(itertools.combinations(sorted(pool), k))
    rng = random.Random(derived_seed(seed, "lesion", k))
    seen: set[tuple[int, ...]] = set()
    out = []
    while len(out) < draws:
        subset = tuple(sorted(rng.sample(list(pool), k)))
        if subset not in seen:
            seen.add(subset)
            out.append(subset)
    return out


# --------------------------------------------------------------------------- the study

@dataclass
class Study:
    """One run's lesion study, planned: its units, the deletable ones (``pool``), the subsets
    to delete for each k and the distinct subsets to evaluate (``todo``, nothing deleted
    first)."""
    run: runs.LoadedRun
    test: list[tuple[Tensor, Tensor]]
    units: list[Unit]
    pool: list[int]
    excluded: list[int]         # deletable units left out of the subsets (--keep-first-unit)
    plan: dict[int, list[tuple[int, ...]]]
    todo: list[tuple[int, ...]]
    draws: int
    seed: int


def plan(run: runs.LoadedRun, max_deleted: int | None, draws: int, seed: int,
         batch_size: int, keep_first: bool = True) -> Study:
    test = run.test_batches(batch_size)
    with run.use_backend():
        units = units_of(run.model, test[0][0][:2])
    excluded = [units[0].index] if keep_first and units and units[0].deletable else []
    pool = [u.index for u in units if u.deletable and u.index not in excluded]
    k_max = min(DEFAULT_MAX_DELETED if max_deleted is None else max_deleted, len(pool))
    # k = 1: every single unit (evaluated anyway for the single-unit errors).
    subsets = {k: [(i,) for i in pool] if k == 1 else draw_subsets(pool, k, draws, seed)
               for k in range(1, k_max + 1)}
    wanted = ([()] + [(u.index,) for u in units if u.deletable]
              + [s for k in subsets for s in subsets[k]])
    todo = list(dict.fromkeys(wanted))  # each distinct subset evaluated once
    return Study(run, test, units, pool, excluded, subsets, todo, draws, seed)


def lesion(study: Study, bar=None) -> dict[str, Any]:
    """Evaluate a planned study; the record lesion.json holds for its run."""
    run, model, units, pool = study.run, study.run.model, study.units, study.pool
    if bar is not None:
        bar.set_description(run.label)
    results: dict[tuple[int, ...], runs.Evaluation] = {}
    with run.use_backend():
        for subset in study.todo:
            with deleted_units(model, subset):
                results[subset] = runs.evaluate(model, study.test, run.amp_dtype)
            if bar is not None:
                bar.update(1)
    base = results[()]
    by_index = {u.index: u for u in units}
    by_k = [{"k": 0, "draws": 1, "subsets": [[]], "errors": [base.error], "mean": base.error,
             "std": 0.0, "min": base.error, "max": base.error}]
    for k, subsets in study.plan.items():
        errors = np.array([results[s].error for s in subsets])
        by_k.append({"k": k, "draws": len(subsets),
                     "all_subsets": len(subsets) == math.comb(len(pool), k),
                     "subsets": [[by_index[i].name for i in s] for s in subsets],
                     "errors": errors.tolist(), "mean": float(errors.mean()),
                     "std": float(errors.std()), "min": float(errors.min()),
                     "max": float(errors.max())})
    return {
        "run": str(run.directory), "checkpoint": str(run.checkpoint),
        "iteration": run.iteration, "label": run.label, "model": run.model_name,
        "dataset": run.cfg["dataset"], "num_classes": run.data.num_classes,
        "plain": run.cfg["shortcut"] == "none",
        "fused": run.cfg["fused"], "device": str(run.device),
        "test_images": base.n, "baseline": {"error": base.error, "loss": base.loss},
        "units": [{"index": u.index, "name": u.name, "input_shape": list(u.input_shape),
                   "output_shape": list(u.output_shape), "deletable": u.deletable,
                   "excluded": u.index in study.excluded,
                   "error": results[(u.index,)].error if u.deletable else None,
                   "loss": results[(u.index,)].loss if u.deletable else None}
                  for u in units],
        "deletable": len(pool), "kept": [u.name for u in units if not u.deletable],
        "excluded": [by_index[i].name for i in study.excluded],
        "max_deleted": len(study.plan), "draws": study.draws, "seed": study.seed,
        "by_k": by_k,
        "notes": list(run.notes),
    }


# --------------------------------------------------------------------------- outputs

def _pct(v: float) -> str:
    return f"{100 * v:.2f}"


def table(record: dict[str, Any]) -> str:
    """The markdown section of one run: the curve, the single-unit errors, what was kept."""
    units = record["units"]
    kept = [u for u in units if not u["deletable"]]
    what = "units (layer pairs, no shortcut)" if record.get("plain") else "residual units"
    excluded = record.get("excluded") or []
    lines = [f"## {record['label']}", "",
             f"{record['run']}, checkpoint {Path(record['checkpoint']).name} (iteration "
             f"{record['iteration']}); {record['dataset']} test set, {record['test_images']} "
             f"images; baseline error {_pct(record['baseline']['error'])} %.",
             f"{len(units)} {what}, {record['deletable']} deleted in the subsets (output shape "
             "= input shape)" + ("; kept, as they change the shape: "
                                 + ", ".join(f"{u['name']} ({_shape(u)})" for u in kept)
                                 if kept else "")
             + (f"; left out of the subsets: {', '.join(excluded)} (--keep-first-unit: the "
                "first unit's BatchNorm also normalises the stem)" if excluded else "") + ".",
             "",
             "| units deleted | subsets | mean error (%) | std | min | max |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in record["by_k"]:
        n = f"{row['draws']}" + (" (all)" if row.get("all_subsets") and row["k"] else "")
        lines.append(f"| {row['k']} | {n} | {_pct(row['mean'])} | {_pct(row['std'])} | "
                     f"{_pct(row['min'])} | {_pct(row['max'])} |")
    lines += ["", "| unit | shape | error deleted alone (%) | change (points) |",
              "|---|---|---:|---:|"]
    base = record["baseline"]["error"]
    for u in units:
        if u["deletable"]:
            flag = " (left out of the subsets)" if u.get("excluded") else ""
            lines.append(f"| {u['name']}{flag} | {_shape(u)} | {_pct(u['error'])} | "
                         f"{100 * (u['error'] - base):+.2f} |")
        else:
            lines.append(f"| {u['name']} | {_shape(u)} | kept (changes the shape) | |")
    return "\n".join(lines)


def _shape(u: dict[str, Any]) -> str:
    a = "x".join(map(str, u["input_shape"]))
    b = "x".join(map(str, u["output_shape"]))
    return a if a == b else f"{a} -> {b}"


def figure(records: list[dict[str, Any]]):
    """The lesion figure, one column wide (None without matplotlib). Top: test error against
    the number of units deleted together, every draw a dot, the median over the draws a line and
    the min-max band (k = 1: every unit alone). Bottom: the error with each unit deleted alone,
    against its position; a unit left out of the subsets (--keep-first-unit) an open marker.
    One colour a run, named by what differs between the runs; chance error dashed."""
    plt = figures.pyplot()
    if plt is None:
        return None
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    common, shorts = figures.common_and_short([r["model"] for r in records])
    with figures.column():
        fig, (ax, ax2) = plt.subplots(2, 1, layout="constrained",
                                      figsize=(figures.COLUMN_WIDTH,
                                               3.3 + 0.13 * (len(records) + 4)))
        handles = []
        for i, (r, short) in enumerate(zip(records, shorts)):
            color = f"C{i % 10}"
            ks = [row["k"] for row in r["by_k"]]
            med, lo, hi = figures.spread([row["errors"] for row in r["by_k"]])
            for row in r["by_k"]:
                ax.plot([row["k"]] * len(row["errors"]), [100 * e for e in row["errors"]], ".",
                        color=color, ms=2.5, alpha=0.6)
            ax.plot(ks, 100 * med, "-", color=color)
            ax.fill_between(ks, 100 * lo, 100 * hi, color=color, alpha=0.15, lw=0)
            # Kept units break the line (NaN); a unit left out of the subsets: open marker.
            ax2.plot([u["index"] + 1 for u in r["units"]],
                     [100 * u["error"] if u["deletable"] else float("nan") for u in r["units"]],
                     "o-", color=color, ms=3)
            out = [u for u in r["units"] if u.get("excluded")]
            ax2.plot([u["index"] + 1 for u in out], [100 * u["error"] for u in out], "o",
                     mfc="white", color=color, ms=5)
            ax2.axhline(100 * r["baseline"]["error"], color=color, ls=":", lw=1.0)
            seed = r["label"].split("; ")[-1].split(" (")[0]
            handles.append(Line2D([], [], color=color, marker="o", ms=3,
                                  label=f"{short or 'the run'}: {seed}" if short else seed))
        classes = sorted({r["num_classes"] for r in records if r.get("num_classes")})
        for a in (ax, ax2):
            for c in classes:
                a.axhline(100 * (1 - 1 / c), color="0.4", ls="--", lw=0.8)
        if classes:
            handles.append(Line2D([], [], color="0.4", ls="--", lw=0.8,
                                  label="chance error (1 - 1/classes)"))
        handles.append(Line2D([], [], color="0.3", marker=".", ls="-", ms=2.5,
                              label="top: dots each draw, line median, band min-max"))
        handles.append(Line2D([], [], color="0.3", ls=":", lw=1.0,
                              label="bottom: error with nothing deleted"))
        if any(u.get("excluded") for r in records for u in r["units"]):
            handles.append(Line2D([], [], color="0.3", marker="o", mfc="white", ls="none",
                                  ms=5, label="bottom: unit left out of the subsets "
                                              "(--keep-first-unit)"))
        ax.set_xlabel("units deleted together, k (each replaced by the identity)")
        ax.set_ylabel("test error (%)")
        ax2.set_xlabel("the unit deleted alone (1: nearest the input)")
        ax2.set_ylabel("test error (%)")
        for a in (ax, ax2):
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
            a.grid(alpha=0.3)
            a.set_ylim(0, 100)
        fig.suptitle(figures.wrap(f"Lesion study (Veit et al. 2016), {common}: test error "
                                  "with units deleted at test time"))
        figures.column_legend(fig, handles)
        figures.small_ticks(fig)
    return fig


def plot(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Write :func:`figure` to ``path``; None without matplotlib."""
    fig = figure(records)
    return None if fig is None else figures.save(fig, path, layout=False)


# --------------------------------------------------------------------------- command line

def build_parser() -> runs.Parser:
    p = runs.Parser(prog="fusedres lesion",
                    description="Lesion study (Veit et al. 2016): test error with residual "
                                "units deleted (replaced by the identity) from trained runs.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directory of fusedres train, or one of its checkpoint files; "
                        "several give one plot with a curve each (e.g. a residual and a plain "
                        "network)")
    p.add_argument("--max-deleted", type=int, metavar="K",
                   help=f"delete up to K units together (default: the deletable units, at "
                        f"most {DEFAULT_MAX_DELETED}; larger K is cut to the deletable units)")
    p.add_argument("--draws", type=int, default=5,
                   help="random subsets per number of deleted units k >= 2 (5; every subset "
                        "when there are no more; k = 1 is every unit alone)")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsets (0)")
    p.add_argument("--keep-first-unit", action=argparse.BooleanOptionalAction, default=True,
                   help="leave the first unit out of the deletions (default on: in a "
                        "pre-activation network its BatchNorm is the stem's only "
                        "normalisation); its error deleted alone is still measured, flagged")
    p.add_argument("--out", help="output directory (default: RUN/lesion of the first RUN)")
    runs.add_run_options(p)
    return p


def _check(args) -> None:
    runs.at_least(args.max_deleted, 1, "--max-deleted", "K >= 1 units")
    runs.at_least(args.draws, 1, "--draws", "at least 1 subset")
    runs.at_least(args.seed, 0, "--seed")
    runs.at_least(args.batch_size, 1, "--batch-size", "a positive batch")
    runs.at_least(args.threads, 1, "--threads", "at least 1 thread")
    if args.checkpoint is not None and len(args.runs) > 1:
        raise UsageError("--checkpoint: only with one RUN (give checkpoint files as RUNs)")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} exists and is not a directory")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        _check(args)
        with runs.threads(args.threads):
            return _run(args, argv)
    except (UsageError, BackendUnavailableError) as e:
        print(f"fusedres lesion: error: {e}", file=sys.stderr)
        return 2


def _run(args, argv: list[str]) -> int:
    # Everything is loaded and checked before the output directory is made.
    loaded = [runs.open_run(r, args.checkpoint, args.device, args.backend, args.data_dir)
              for r in args.runs]
    for run in loaded:
        try:
            unit_slots(run.model)
        except TypeError as e:
            raise UsageError(f"RUN: {run.directory}: {e}") from None
    out = Path(args.out) if args.out else loaded[0].directory / "lesion"
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
    from tqdm import tqdm

    studies = [plan(run, args.max_deleted, args.draws, args.seed,
                    args.batch_size or run.cfg["eval_batch_size"], args.keep_first_unit)
               for run in loaded]
    with tqdm(total=sum(len(s.todo) for s in studies), file=sys.stderr,
              disable=not args.progress, dynamic_ncols=True, unit="eval") as bar:
        records = [lesion(s, bar) for s in studies]
    out.mkdir(parents=True, exist_ok=True)
    for r in records:
        for note in r["notes"]:
            print(f"fusedres lesion: note: {r['label']}: {note}", file=sys.stderr)
        if args.max_deleted is not None and args.max_deleted > r["max_deleted"]:
            print(f"fusedres lesion: note: {r['label']}: --max-deleted {args.max_deleted} cut to "
                  f"its {r['deletable']} deletable units", file=sys.stderr)
    doc = {"command": "fusedres lesion " + shlex.join(argv), "runs": records}
    (out / "lesion.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = "# Lesion study (Veit et al. 2016)\n\n" + "\n\n".join(table(r) for r in records)
    (out / "lesion.md").write_text(text + "\n")
    png = plot(records, out / "lesion.png")
    print(text)
    print(f"\nwritten: {out / 'lesion.json'}, {out / 'lesion.md'}"
          + (f", {png}" if png else " (no plot: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
