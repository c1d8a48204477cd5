"""``fusedres evaluate RUN``: a trained run's checkpoint on its test set (or another data
directory), a table of loss and top-1/top-5 error, for the model's weights and, when the run
kept one (``fusedres train --ema-decay``), for its EMA weights.

The evaluation is the trainer's: the same normalisation, batches and float64 sums
(``fusedres.apps.experiments.runs``), so a final checkpoint gives the run's last evaluation.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fusedres import BackendUnavailableError
from fusedres.apps.cli import UsageError

from . import runs

WEIGHTS = ("auto", "model", "ema", "both")


def build_parser() -> runs.Parser:
    p = runs.Parser(prog="fusedres evaluate",
                    description="Evaluate a fusedres train run's checkpoint: test loss, top-1 "
                                "and top-5 error, as a table.")
    p.add_argument("run", metavar="RUN", help="run directory of fusedres train, or one of its "
                                              "checkpoint files")
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="which weights: model, ema (the run's --ema-decay average), both, or "
                        "auto (default: both when the checkpoint holds an EMA, else model)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    runs.add_run_options(p)
    return p


@torch.no_grad()
def evaluate(model: nn.Module, batches, amp_dtype: torch.dtype | None = None
             ) -> dict[str, Any]:
    """Mean cross-entropy, top-1 and top-5 error of ``model`` (in eval mode) over ``batches``
    (top-5 is top-k with k the number of classes when there are fewer than 5)."""
    loss_sum = top1 = top5 = None
    n = 0
    for x, y in batches:
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
            top1 = torch.zeros((), dtype=torch.int64, device=x.device)
            top5 = torch.zeros((), dtype=torch.int64, device=x.device)
        ctx = (torch.autocast(x.device.type, dtype=amp_dtype) if amp_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            out = model(x)
        loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double()
        top1 += (out.argmax(1) == y).sum()
        k = min(5, out.shape[1])
        top5 += (out.topk(k, 1).indices == y[:, None]).any(1).sum()
        n += len(y)
    if n == 0:
        raise UsageError("RUN: its test set is empty")
    return {"images": n, "test_loss": loss_sum.item() / n, "top1_error": 1 - top1.item() / n,
            "top5_error": 1 - top5.item() / n}


def ema_model(model: nn.Module, state: dict[str, Any], path: Path) -> nn.Module:
    """A copy of ``model`` with the checkpoint's EMA weights (AveragedModel's ``module.*``)."""
    ema = state.get("ema")
    if ema is None:
        raise UsageError(f"--weights ema: {str(path)!r} holds no EMA weights (its run had no "
                         "--ema-decay)")
    weights = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}
    why = runs.state_mismatch(model.state_dict(), weights)
    if why is not None:
        raise UsageError(f"--weights ema: the EMA of {str(path)!r} does not fit the model "
                         f"({why})")
    out = copy.deepcopy(model)
    out.load_state_dict(weights)
    return out.eval()


def table(run: runs.LoadedRun, rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"# {run.label}, {run.cfg['dataset']} test set, checkpoint at iteration "
             f"{run.iteration}", "",
             "| weights | images | test loss | top-1 error | top-5 error |",
             "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['images']} | {r['test_loss']:.4f} | "
                     f"{100 * r['top1_error']:.2f}% | {100 * r['top5_error']:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        runs.at_least(args.batch_size, 1, "--batch-size", "a positive batch")
        runs.at_least(args.threads, 1, "--threads", "at least 1 thread")
        if args.json is not None and Path(args.json).is_dir():
            raise UsageError(f"--json: {args.json!r} is a directory")
        with runs.threads(args.threads):
            return _run(args, argv)
    except (UsageError, BackendUnavailableError) as e:
        print(f"fusedres evaluate: error: {e}", file=sys.stderr)
        return 2


def _run(args, argv: list[str]) -> int:
    run = runs.open_run(args.run, args.checkpoint, args.device, args.backend, args.data_dir)
    state = runs.load_checkpoint(run.checkpoint, "RUN")
    has_ema = state.get("ema") is not None
    which = args.weights
    if which == "auto":
        which = "both" if has_ema else "model"
    models = {}
    if which in ("model", "both"):
        models["model"] = run.model
    if which in ("ema", "both"):
        models["ema"] = ema_model(run.model, state, run.checkpoint).to(run.device)
    batches = run.test_batches(args.batch_size or run.cfg["eval_batch_size"])
    rows = {}
    with run.use_backend():
        for name, model in models.items():
            rows[name] = evaluate(model, batches, run.amp_dtype)
    for note in run.notes:
        print(f"fusedres evaluate: note: {note}", file=sys.stderr)
    text = table(run, rows)
    print(text)
    if args.json is not None:
        doc = {"command": "fusedres evaluate " + shlex.join(argv), "run": str(run.directory),
               "checkpoint": str(run.checkpoint), "iteration": run.iteration,
               "dataset": run.cfg["dataset"], "results": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
