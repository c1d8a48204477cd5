"""``fusedres landscape RUN``: loss landscapes of Li et al. (2018), "Visualizing the Loss
Landscape of Neural Nets".

The loss and accuracy of ``theta + x d1`` (1-D) or ``theta + x d1 + y d2`` (2-D) over a grid,
``theta`` the trained weights and ``d1``, ``d2`` random filter-normalised directions: each drawn
from N(0, 1) in the weight's shape, then every filter (output row of a conv or linear weight)
rescaled to the norm of the same filter in ``theta``. Parameters of one dimension (biases and
BatchNorm's weight and bias) are not perturbed (zero in the directions) unless
``--no-ignore-biasbn``, which then moves them along themselves as the reference code's
``--xignore`` off does. BatchNorm runs in eval mode with the trained running statistics, which
are never perturbed. The loss is the mean cross-entropy on the run's training set, normalised,
not augmented, in the dataset's order (``--batches B``: its first B batches).

The directions are drawn on CPU from ``torch.Generator``s seeded by ``--seed`` (direction i from
``derived_seed(seed, "landscape-direction", i)``), so every device and process gets the same
ones, and a 1-D landscape follows the 2-D one's x direction.

``--interpolate A B``: the 1-D path ``(1 - t) A + t B`` between two checkpoints (every floating
entry of the state, BatchNorm's running statistics included, as the reference code's ``states``
directions), t over ``--range`` (default -0.5 1.5).

``--trajectory``: Li et al.'s section 7 plot. The run's checkpoints before the final one (its
latest, or ``--checkpoint``), each minus the final weights, flattened over the parameters (1-D
ones left out with ``--ignore-biasbn``, the default); their first two principal directions
(centred PCA, :func:`pca_directions`) are the axes, each labelled with the share of the
variance it explains; the surface is computed over them around the final weights (unit-norm
directions, not filter-normalised: the path's own scale), on a range that holds the projected
path (``--range`` overrides), and the path is drawn on the contours.

BatchNorm statistics (``--bn-stats``): ``keep`` evaluates with the running statistics the state
holds at the point: the trained ones along random directions (Li et al.), the interpolated ones
along a path. Outside [0, 1] an interpolated running variance can go below zero, and the loss
there is NaN; so ``--interpolate`` defaults to ``recompute`` (and so does ``--trajectory``, whose
points are no trained weights either): at every point the running
statistics are reset and recomputed from the same training batches the loss is measured on
(BatchNorm alone in training mode, ``momentum=None``: the exact average over the batches, as
``torch.optim.swa_utils.update_bn``), then the loss is evaluated with them. A point whose loss is
not finite all the same is reported (stdout and the JSON) and left out of the plots, never drawn
as a number; its accuracy is recorded as NaN (the argmax of NaN logits means nothing).

The surface is saved (``<name>.npz``) after every row, written to a temporary file and renamed,
with the settings it was computed with: a rerun with the same settings continues from the rows
missing, other settings are an error naming the option (``--overwrite`` starts again). Under
torchrun the rows are split over the processes (process r computes rows r, r + W, ... of those
missing), each writes its own part file, and process 0 merges them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from fusedres import BackendUnavailableError
from fusedres.apps.cli import UsageError
from fusedres.apps.train.checkpoint import write_atomically
from fusedres.apps.train.seeds import derived_seed

from . import figures, hessian, landscape_plots, runs
from .landscape_plots import figures_of, plot

__all__ = ["SurfaceFile", "batch_norms", "build_parser", "directions", "figures_of", "grid_rows",
           "main", "perturbable_parameters", "plot", "recompute_batch_norm", "split_rows"]

FORMAT = "fusedres-landscape"
VERSION = 1
DEFAULT_GRID = {1: 51, 2: 51, "interpolate": 41}  # 41 over [-0.5, 1.5]: t = 0 and 1 on the grid
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
DEFAULT_RANGE = {"directions": (-1.0, 1.0), "interpolate": (-0.5, 1.5)}


# --------------------------------------------------------------------------- directions

def perturbable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters in ``named_parameters`` order (the order directions are drawn)."""
    return list(model.named_parameters())


@torch.no_grad()
def directions(model: nn.Module, seed: int, count: int = 2, ignore_biasbn: bool = True
               ) -> list[dict[str, Tensor]]:
    """``count`` filter-normalised random directions for ``model``'s parameters (CPU float32
    tensors in each parameter's shape, keyed by parameter name).

    Direction i: every parameter's entries drawn from N(0, 1) by a generator seeded by
    ``derived_seed(seed, "landscape-direction", i)`` (one draw per parameter, in
    ``named_parameters`` order, whatever is kept of it), then for a parameter of two or more
    dimensions each filter ``d[j]`` rescaled to ``||w[j]|| / (||d[j]|| + 1e-10)`` (Li et al.);
    a parameter of one dimension is zero with ``ignore_biasbn``, else the parameter itself.
    """
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(derived_seed(seed, "landscape-direction", i))
        d_all = {}
        for name, p in perturbable_parameters(model):
            w = p.detach().to("cpu", torch.float32)
            d = torch.randn(tuple(p.shape), generator=g)
            if p.dim() <= 1:
                d = torch.zeros_like(d) if ignore_biasbn else w.clone()
            else:
                scale = w.flatten(1).norm(dim=1) / (d.flatten(1).norm(dim=1) + 1e-10)
                d = d * scale.view(-1, *([1] * (d.dim() - 1)))
            d_all[name] = d.contiguous()
        out.append(d_all)
    return out


# --------------------------------------------------------------------------- the trajectory

TRAJECTORY_MARGIN = 0.25  # of the path's extent on each axis, added on both sides


@torch.no_grad()
def pca_directions(deltas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The first two principal directions of the rows of ``deltas`` (n, P): the checkpoints'
    weights minus the final ones, flattened (Li et al. 2018, section 7; their code fits
    sklearn's PCA, which centres the rows first: so does this).

    Returns (directions (2, P), unit vectors; explained-variance ratio of each (2,); the
    projections of the rows on them (n, 2), uncentred, so that the final weights are the
    origin). Each direction's sign is chosen so that the first row projects to a coordinate
    <= 0 (the path runs towards +x and +y)."""
    if deltas.shape[0] < 2:
        raise ValueError(f"deltas: need at least 2 rows for 2 directions, got {deltas.shape[0]}")
    d = deltas.double()
    centred = d - d.mean(0, keepdim=True)
    _, sv, vh = torch.linalg.svd(centred, full_matrices=False)
    var = sv.square()
    ratio = var[:2] / var.sum()
    dirs = vh[:2].clone()
    if dirs.shape[0] < 2:  # 2 rows: the centred rows span one direction only
        raise ValueError("deltas: the checkpoints span fewer than 2 directions")
    proj = d @ dirs.T
    flip = torch.where(proj[0] > 0, -1.0, 1.0).to(d.dtype)
    return dirs * flip[:, None], ratio, proj * flip


def trajectory(run, ignore_biasbn: bool = True) -> tuple[dict[str, Any], list[dict[str, Tensor]]]:
    """The PCA directions of ``run``'s checkpoints before its selected one (its final weights
    theta_n): rows theta_i - theta_n over the parameters (every 1-D parameter, biases and
    BatchNorm's, left out with ``ignore_biasbn``, as Li et al.'s ``ignore='biasbn'``).

    Returns the path (``{"checkpoints", "iterations", "x", "y", "explained_variance"}``, the
    final weights at the origin and last in the lists) and the two directions as
    ``{name: tensor}`` dicts in each parameter's shape (CPU float32), for :class:`_Weights`."""
    from fusedres.apps.train import checkpoint as ckpt

    names = [n for n, p in perturbable_parameters(run.model)
             if not (ignore_biasbn and p.dim() <= 1)]
    theta = {n: p.detach().to("cpu", torch.float64).flatten()
             for n, p in run.model.named_parameters()}
    reference = run.model.state_dict()
    final = run.checkpoint.resolve()
    earlier, rows = [], []
    for path in ckpt.list_checkpoints(run.directory):
        if path.resolve() == final:
            continue
        state = runs.load_checkpoint(path, "--trajectory")
        if int(state["iteration"]) >= run.iteration:
            continue
        why = runs.state_mismatch(reference, state["model"])
        if why is not None:
            raise UsageError(f"--trajectory: {str(path)!r} does not fit the run's model "
                             f"{run.model_name} ({why})")
        earlier.append((path, int(state["iteration"])))
        rows.append(torch.cat([state["model"][n].to("cpu", torch.float64).flatten() - theta[n]
                               for n in names]))
    if len(earlier) < 3:
        raise UsageError(
            f"--trajectory: {len(earlier)} checkpoint(s) of {str(run.directory)!r} before "
            f"iteration {run.iteration}; the PCA of the path needs at least 3: train with "
            "--checkpoint-every N and --keep-checkpoints above the number of checkpoints")
    deltas = torch.stack(rows)
    try:
        dirs, ratio, proj = pca_directions(deltas)
    except ValueError as e:
        raise UsageError(f"--trajectory: {str(e).partition(': ')[2]}") from None
    out = []
    for k in range(2):
        d, at = {}, 0
        for n, p in run.model.named_parameters():
            if n in names:
                d[n] = dirs[k, at:at + p.numel()].view(p.shape).float().contiguous()
                at += p.numel()
            else:
                d[n] = torch.zeros(tuple(p.shape))
        out.append(d)
    path_info = {"checkpoints": [p.name for p, _ in earlier] + [run.checkpoint.name],
                 "iterations": [it for _, it in earlier] + [run.iteration],
                 "x": proj[:, 0].tolist() + [0.0], "y": proj[:, 1].tolist() + [0.0],
                 "explained_variance": ratio.tolist()}
    return path_info, out


def path_extent(values: Sequence[float]) -> tuple[float, float]:
    """An axis range holding every value and 0 (the final weights), widened on both sides by
    :data:`TRAJECTORY_MARGIN` of the extent."""
    lo, hi = min(0.0, *values), max(0.0, *values)
    pad = TRAJECTORY_MARGIN * (hi - lo) if hi > lo else 1.0
    return lo - pad, hi + pad


# --------------------------------------------------------------------------- the grid

def _axis(lo: float, hi: float, n: int) -> np.ndarray:
    """``n`` points from ``lo`` to ``hi``; those within rounding of 0 and 1 made exact, so that
    the trained weights (and an interpolation's end points) are evaluated as they are."""
    axis = np.linspace(lo, hi, n)
    for exact in (0.0, 1.0):
        axis[np.abs(axis - exact) <= 1e-9 * (hi - lo)] = exact
    return axis


def grid_rows(dims: int, coords: Sequence[np.ndarray]) -> list[list[tuple[float, ...]]]:
    """The points of each row: 1-D, one point a row; 2-D, row j holds (x_i, y_j) for every i."""
    if dims == 1:
        return [[(float(x),)] for x in coords[0]]
    return [[(float(x), float(y)) for x in coords[0]] for y in coords[1]]


def split_rows(missing: Sequence[int], rank: int, world: int) -> list[int]:
    """The rows process ``rank`` of ``world`` computes: every world-th of those missing."""
    return list(missing[rank::world])


@dataclass
class SurfaceFile:
    """The saved surface: ``loss`` and ``accuracy`` (1-D: (n,); 2-D: (ny, nx), [y, x]), ``done``
    (one flag a row), the grid's coordinates and the settings that made it (a JSON object)."""
    settings: dict[str, Any]
    coords: list[np.ndarray]
    loss: np.ndarray
    accuracy: np.ndarray
    done: np.ndarray

    @classmethod
    def empty(cls, settings: dict[str, Any], coords: list[np.ndarray]) -> SurfaceFile:
        shape = tuple(len(c) for c in reversed(coords))  # (ny, nx) or (n,)
        return cls(settings, coords, np.full(shape, np.nan), np.full(shape, np.nan),
                   np.zeros(shape[0], dtype=bool))

    def set_row(self, row: int, loss: Sequence[float], accuracy: Sequence[float]) -> None:
        self.loss.reshape(len(self.done), -1)[row] = loss
        self.accuracy.reshape(len(self.done), -1)[row] = accuracy
        self.done[row] = True

    def merge(self, other: SurfaceFile) -> None:
        rows = np.flatnonzero(other.done & ~self.done)
        for r in rows:
            self.set_row(r, other.loss.reshape(len(other.done), -1)[r],
                         other.accuracy.reshape(len(other.done), -1)[r])

    def save(self, path: Path) -> None:
        """Atomically: a temporary file in the same folder, renamed over ``path``."""
        arrays = {"loss": self.loss, "accuracy": self.accuracy, "done": self.done,
                  "x": self.coords[0],
                  "settings": np.array(json.dumps(self.settings, sort_keys=True))}
        if len(self.coords) > 1:
            arrays["y"] = self.coords[1]
        write_atomically(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: Path) -> SurfaceFile:
        try:
            with np.load(path, allow_pickle=False) as z:
                settings = json.loads(str(z["settings"]))
                coords = [z["x"]] + ([z["y"]] if "y" in z.files else [])
                return cls(settings, coords, z["loss"].copy(), z["accuracy"].copy(),
                           z["done"].copy())
        except Exception as e:  # missing, truncated, not an npz, keys missing
            raise UsageError(f"--out: {str(path)!r} is not a readable surface file "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "--overwrite starts again") from None


# The option each setting comes from, for the message when a rerun asks for other settings.
_FLAGS = {"format": "--overwrite", "mode": "--interpolate or --trajectory",
          "range_y": "--range", "trajectory": "--trajectory (the run's checkpoints)",
          "dims": "--dims", "grid": "--grid",
          "bn_stats": "--bn-stats",
          "range": "--range", "seed": "--seed", "ignore_biasbn": "--ignore-biasbn",
          "samples": "--batches", "checkpoint": "--checkpoint",
          "interpolate": "--interpolate", "dataset": "RUN", "model": "RUN"}


def _conflict(saved: dict[str, Any], wanted: dict[str, Any], path: Path) -> str | None:
    for key in wanted:
        if saved.get(key) != wanted[key]:
            flag = _FLAGS.get(key, key)
            hint = " (with --batch-size)" if key == "samples" else ""
            return (f"{flag}: the surface in {str(path)!r} was computed with {key} "
                    f"{saved.get(key)!r}{hint}, this command asks for {wanted[key]!r}; rerun "
                    f"with the same settings to continue it, or give --overwrite to start again")
    extra = sorted(set(saved) - set(wanted))
    if extra:
        return (f"--overwrite: the surface in {str(path)!r} has settings this fusedres does not "
                f"know ({', '.join(extra)}); give --overwrite to start again")
    return None


# --------------------------------------------------------------------------- command line

def build_parser() -> runs.Parser:
    p = runs.Parser(prog="fusedres landscape",
                    description="Loss landscape (Li et al. 2018) around a run's trained weights "
                                "along random filter-normalised directions, or between two "
                                "checkpoints.")
    p.add_argument("run", metavar="RUN",
                   help="run directory of fusedres train, or one of its checkpoint files")
    p.add_argument("--dims", type=int, choices=(1, 2), default=None,
                   help="1-D curve or 2-D surface (default 2; --interpolate is 1-D)")
    p.add_argument("--grid", type=int,
                   help="points per axis (default 51; 41 with --interpolate, which puts t = 0 "
                        "and 1 on the grid)")
    p.add_argument("--range", type=float, nargs="+", metavar="BOUND",
                   help="the axes' range: A B, or R for [-R, R] (default -1 1; with "
                        "--interpolate -0.5 1.5; with --trajectory each axis the path's extent "
                        "and a quarter of it on both sides)")
    p.add_argument("--batches", type=int, metavar="B",
                   help="use the first B training batches of --batch-size (default: the whole "
                        "training set)")
    p.add_argument("--seed", type=int, default=0, help="seed of the directions (0)")
    p.add_argument("--ignore-biasbn", action=argparse.BooleanOptionalAction, default=True,
                   help="leave biases and BatchNorm parameters (every 1-D parameter) "
                        "unperturbed (default on; off moves them along themselves, as the "
                        "reference code)")
    p.add_argument("--interpolate", nargs=2, metavar=("CKPT_A", "CKPT_B"),
                   help="the 1-D path (1 - t) A + t B between two checkpoints of the run's "
                        "model instead of random directions")
    p.add_argument("--trajectory", action="store_true",
                   help="Li et al.'s trajectory plot: the 2-D surface over the first two PCA "
                        "directions of the run's checkpoints (each minus the final weights), "
                        "the training path projected onto them and drawn on the contours "
                        "(BatchNorm statistics recomputed at each point by default)")
    p.add_argument("--bn-stats", choices=("keep", "recompute"),
                   help="BatchNorm running statistics at each point: keep those of the state "
                        "(default along random directions: the trained ones) or recompute them "
                        "on the loss's training batches (default with --interpolate, where "
                        "extrapolated variances can go below zero)")
    p.add_argument("--hessian", action="store_true",
                   help="also map |lambda_min / lambda_max| of the loss Hessian over the 2-D "
                        "grid (Li et al. 2018, section 6): hessian_2d.npz, .json, .png")
    p.add_argument("--hessian-every", type=int, default=1, metavar="K",
                   help="--hessian: every K-th point of each axis of the grid (1); K dividing "
                        "(grid - 1) / 2 keeps the centre")
    p.add_argument("--hessian-iters", type=int, default=hessian.DEFAULT_ITERS, metavar="N",
                   help=f"--hessian: at most N Lanczos steps (Hessian-vector products) a point "
                        f"({hessian.DEFAULT_ITERS})")
    p.add_argument("--hessian-tol", type=float, default=hessian.DEFAULT_TOL,
                   help=f"--hessian: stop once both extreme eigenvalues' residuals are within "
                        f"this fraction of the larger one ({hessian.DEFAULT_TOL:g})")
    p.add_argument("--out", help="output directory (default RUN/landscape)")
    p.add_argument("--overwrite", action="store_true",
                   help="start again when --out holds a surface computed with other settings")
    runs.add_run_options(p)
    return p


def _range(args, mode: str) -> tuple[float, float]:
    if args.range is None:
        return DEFAULT_RANGE[mode]
    what = "R > 0 (the range [-R, R]) or A B with A < B" + (
        " (default: the path's extent on each axis, and a margin)" if mode == "trajectory"
        else "")
    r = args.range
    if len(r) == 1:
        if not r[0] > 0:
            raise UsageError(f"--range: expected {what}, got {r[0]:g}")
        return (-r[0], r[0])
    if len(r) != 2:
        raise UsageError(f"--range: expected A B or R, got {len(r)} values")
    if not r[0] < r[1]:
        raise UsageError(f"--range: expected A < B, got {r[0]:g} {r[1]:g}")
    return (r[0], r[1])


def _check(args) -> dict[str, Any]:
    """What the command line asks for, checked; nothing is read from disk."""
    if args.trajectory and args.interpolate:
        raise UsageError("--trajectory: not with --interpolate (choose one path)")
    mode = "interpolate" if args.interpolate else (
        "trajectory" if args.trajectory else "directions")
    if mode == "trajectory":
        if args.dims == 1:
            raise UsageError("--dims: --trajectory gives a 2-D surface; leave --dims out")
    if mode == "interpolate":
        if args.dims == 2:
            raise UsageError("--dims: --interpolate gives a 1-D path; leave --dims out")
        if args.checkpoint is not None:
            raise UsageError("--checkpoint: not with --interpolate (its two checkpoints are the "
                             "weights)")
    dims = 1 if mode == "interpolate" else (args.dims or 2)
    runs.at_least(args.grid, 2, "--grid", "at least 2 points per axis (one point is no curve "
                  "nor surface)")
    runs.at_least(args.batches, 1, "--batches", "at least 1 batch")
    runs.at_least(args.batch_size, 1, "--batch-size", "a positive batch")
    runs.at_least(args.threads, 1, "--threads", "at least 1 thread")
    runs.at_least(args.seed, 0, "--seed")
    lo, hi = _range(args, mode) if mode != "trajectory" or args.range else (None, None)
    grid = args.grid or DEFAULT_GRID["interpolate" if mode == "interpolate" else dims]
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
    if mode == "interpolate":
        for path in args.interpolate:
            runs.check_checkpoint(path, "--interpolate")
    if args.hessian:
        if dims != 2:
            raise UsageError("--hessian: maps the 2-D grid; not with --dims 1 or --interpolate")
        if runs.rank_and_world()[1] > 1:
            raise UsageError("--hessian: one process only (the map's rows are not split)")
    runs.at_least(args.hessian_every, 1, "--hessian-every", "K >= 1")
    runs.at_least(args.hessian_iters, 1, "--hessian-iters", "at least 1 step")
    if not args.hessian_tol > 0:
        raise UsageError(f"--hessian-tol: expected a tolerance > 0, got {args.hessian_tol:g}")
    bn_stats = args.bn_stats or ("keep" if mode == "directions" else "recompute")
    return {"mode": mode, "dims": dims, "grid": grid, "range": [lo, hi], "bn_stats": bn_stats}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    joined = False
    try:
        args = build_parser().parse_args(argv)
        asked = _check(args)
        joined = _join_processes(args.device)
        with runs.threads(args.threads):
            return _run(args, asked, argv)
    except (UsageError, BackendUnavailableError) as e:
        if runs.rank_and_world()[0] == 0:
            print(f"fusedres landscape: error: {e}", file=sys.stderr)
        return 2
    finally:
        if joined:
            dist.destroy_process_group()
            time.sleep(0.05)  # see fusedres.apps.train's _leave_distributed: let gloo's threads go


def _join_processes(device: str) -> bool:
    """Join torchrun's process group (gloo on CPU, nccl on GPUs) when WORLD_SIZE > 1."""
    rank, world, local = runs.rank_and_world()
    if world <= 1 or dist.is_initialized():
        return False
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class _Weights:
    """Sets the model's weights to a point of the grid. Directions: ``theta + sum c_i d_i``
    over the parameters; interpolation: ``(1 - t) A + t B`` over every floating state entry."""

    def __init__(self, model: nn.Module, base: dict[str, Tensor], dirs: list[dict[str, Tensor]]
                 | None = None, target: dict[str, Tensor] | None = None):
        state = model.state_dict(keep_vars=True)
        if target is None:  # random directions: the parameters only
            names = [n for n, _ in perturbable_parameters(model)]
        else:
            names = [n for n, v in state.items() if v.is_floating_point()]
        self.slots = [state[n] for n in names]
        dev = self.slots[0].device if self.slots else torch.device("cpu")
        self.base = [base[n].to(dev, self.slots[i].dtype) for i, n in enumerate(names)]
        self.dirs = None if dirs is None else [
            [d[n].to(dev, self.slots[i].dtype) for i, n in enumerate(names)] for d in dirs]
        self.target = None if target is None else [
            target[n].to(dev, self.slots[i].dtype) for i, n in enumerate(names)]
        # The state's own BatchNorm statistics, put back after --bn-stats recompute.
        self.buffers = [(v, v.detach().clone()) for v in state.values()
                        if not isinstance(v, nn.Parameter)]

    @torch.no_grad()
    def restore_batch_norm(self) -> None:
        """Every buffer (BatchNorm's running statistics and batch counts) as it was built."""
        for slot, value in self.buffers:
            slot.copy_(value)

    @torch.no_grad()
    def set(self, point: tuple[float, ...]) -> None:
        for i, slot in enumerate(self.slots):
            if self.target is not None:
                (t,) = point
                value = self.base[i] * (1.0 - t) + self.target[i] * t
            else:
                value = self.base[i].clone()
                for c, d in zip(point, self.dirs):
                    if c != 0.0:
                        value.add_(d[i], alpha=c)
            slot.copy_(value)


def _run(args, asked: dict[str, Any], argv: list[str]) -> int:
    rank, world, local = runs.rank_and_world()
    mode, dims, grid = asked["mode"], asked["dims"], asked["grid"]
    checkpoint = args.interpolate[0] if mode == "interpolate" else args.checkpoint
    run = runs.open_run(args.run, checkpoint, args.device, args.backend, args.data_dir,
                        local_rank=local,
                        flag="--interpolate" if mode == "interpolate" else "--checkpoint")
    batch_size = args.batch_size or run.cfg["eval_batch_size"]
    data = run.train_batches(batch_size, args.batches)
    samples = sum(len(y) for _, y in data)
    lo, hi = asked["range"]
    path_info = None
    if mode == "trajectory":
        path_info, dirs = trajectory(run, args.ignore_biasbn)
        if lo is None:
            (lo, hi), (ylo, yhi) = (path_extent(path_info[a]) for a in ("x", "y"))
        else:
            ylo, yhi = lo, hi
        coords = [_axis(lo, hi, grid), _axis(ylo, yhi, grid)]
    else:
        coords = [_axis(lo, hi, grid) for _ in range(dims)]
    settings: dict[str, Any] = {"format": VERSION, "mode": mode, "dims": dims, "grid": grid,
                                "range": [lo, hi], "samples": samples,
                                "bn_stats": asked["bn_stats"],
                                "dataset": run.cfg["dataset"], "model": run.model_name}
    if mode == "trajectory":
        settings.update(range_y=[ylo, yhi], trajectory=path_info,
                        ignore_biasbn=args.ignore_biasbn,
                        checkpoint=f"{run.checkpoint.resolve()} (iteration {run.iteration})")
        base = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        weights = _Weights(run.model, base, dirs)
    elif mode == "interpolate":
        a, b = (Path(p).resolve() for p in args.interpolate)
        target = run.model_state(b, "--interpolate")
        settings["interpolate"] = [str(a), str(b)]
        base = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        weights = _Weights(run.model, base, target=target)
    else:
        settings.update(seed=args.seed, ignore_biasbn=args.ignore_biasbn,
                        checkpoint=f"{run.checkpoint.resolve()} (iteration {run.iteration})")
        dirs = directions(run.model, args.seed, dims, args.ignore_biasbn)
        base = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        weights = _Weights(run.model, base, dirs)

    out = Path(args.out) if args.out else run.directory / "landscape"
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
    name = {"interpolate": "interpolation", "trajectory": "trajectory"}.get(
        mode, f"landscape_{dims}d")
    main_file = out / f"{name}.npz"
    parts = sorted(out.glob(f"{name}.rank*.npz")) if out.is_dir() else []
    surface = SurfaceFile.empty(settings, coords)
    if not args.overwrite:
        for path in ([main_file] if main_file.exists() else []) + parts:
            saved = SurfaceFile.load(path)
            why = _conflict(saved.settings, settings, path)
            if why is not None:
                raise UsageError(why)
            surface.merge(saved)
    # Everything is checked: from here on files are written.
    _barrier()  # every process has read the old files before any writes
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if args.overwrite:
            for path in [main_file, *parts]:
                path.unlink(missing_ok=True)
    _barrier()
    mine = split_rows(np.flatnonzero(~surface.done).tolist(), rank, world)
    resumed = int(surface.done.sum())
    own_file = main_file if world == 1 else out / f"{name}.rank{rank}.npz"
    rows = grid_rows(dims, coords)

    from tqdm import tqdm

    total = sum(len(rows[r]) for r in mine)
    with run.use_backend(), tqdm(total=total, file=sys.stderr, dynamic_ncols=True,
                                 disable=not args.progress or rank != 0, unit="point",
                                 desc=f"{name} rows {len(mine)}" + (f" (of {len(rows)}, "
                                      f"{resumed} done)" if resumed else "")) as bar:
        recompute = asked["bn_stats"] == "recompute"
        centre = _centre(run, data, weights, mode, recompute)
        for r in mine:
            losses, accs = [], []
            for point in rows[r]:
                ev = _evaluate_at(run, data, weights, point, recompute)
                losses.append(ev.loss)
                accs.append(1.0 - ev.error if math.isfinite(ev.loss) else math.nan)
                bar.update(1)
            surface.set_row(r, losses, accs)
            surface.save(own_file)
    weights.set((0.0,) * dims)  # the trained weights (A) again, their own statistics too
    weights.restore_batch_norm()
    _barrier()
    if rank != 0:
        return 0
    if world > 1 or parts:  # merge every part into the surface file
        for path in sorted(out.glob(f"{name}.rank*.npz")):
            surface.merge(SurfaceFile.load(path))
        surface.save(main_file)
        for path in sorted(out.glob(f"{name}.rank*.npz")):
            path.unlink()
    def negative_variances(point: tuple[float, ...]) -> int:
        weights.set(point)
        try:
            return sum(int((bn.running_var < 0).sum()) for bn in batch_norms(run.model)
                       if bn.running_var is not None)
        finally:
            weights.set((0.0,) * dims)

    code = _report(args, argv, run, surface, centre, out, name, world, resumed,
                   negative_variances)
    if args.hessian:
        with run.use_backend():
            _hessian(args, argv, run, data, weights, coords, surface.settings, out)
    return code


def _hessian(args, argv, run, data, weights, coords, settings, out: Path) -> None:
    """The curvature map over the surface's grid (:mod:`.hessian`)."""
    recompute = None
    if settings["bn_stats"] == "recompute":
        def recompute():
            recompute_batch_norm(run.model, data, run.amp_dtype)
    path = settings.get("trajectory")
    labels = (landscape_plots.trajectory_labels(path) if path
              else landscape_plots.DIRECTION_LABELS)
    hessian.map_over(run, data, weights, coords, settings, out, args, recompute, argv, labels,
                     args.progress)


def _evaluate_at(run, data, weights: _Weights, point: tuple[float, ...], recompute: bool
                 ) -> runs.Evaluation:
    weights.set(point)
    if recompute:
        recompute_batch_norm(run.model, data, run.amp_dtype)
    return runs.evaluate(run.model, data, run.amp_dtype)


def _centre(run, data, weights: _Weights, mode: str, recompute: bool) -> dict[str, Any]:
    """The loss and accuracy at the trained weights (interpolation: at A and at B), as the
    grid's points are evaluated (``recompute``: BatchNorm statistics recomputed)."""
    points = {"A": (0.0,), "B": (1.0,)} if mode == "interpolate" else {
        "trained": (0.0,) * len(weights.dirs)}
    out = {}
    for key, point in points.items():
        ev = _evaluate_at(run, data, weights, point, recompute)
        out[key] = {"loss": figures.finite_or_none(ev.loss),
                    "accuracy": 1.0 - ev.error if math.isfinite(ev.loss) else None}
    return out


def batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _BATCH_NORMS)]


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, batches, amp_dtype: torch.dtype | None = None
                         ) -> None:
    """Every BatchNorm's running statistics recomputed from ``batches`` for the model's weights
    as they are: reset, then one forward pass of each batch with the BatchNorms alone in
    training mode and ``momentum=None`` (the cumulative average: every batch weighs the same),
    as ``torch.optim.swa_utils.update_bn`` does; but everything else stays in eval mode (a
    drop-path unit keeps every sample). The model is left in eval mode."""
    norms = batch_norms(model)
    if not norms:
        return
    momenta = [bn.momentum for bn in norms]
    model.eval()
    try:
        for bn in norms:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        for x, _ in batches:
            ctx = (torch.autocast(x.device.type, dtype=amp_dtype) if amp_dtype is not None
                   else contextlib.nullcontext())
            with ctx:
                model(x)
    finally:
        for bn, m in zip(norms, momenta):
            bn.momentum = m
        model.eval()


def _non_finite(surface: SurfaceFile) -> list[dict[str, float]]:
    """The grid points whose loss is not finite, by coordinate (t; or x, y)."""
    s = surface.settings
    names = ["t"] if s["mode"] == "interpolate" else ["x", "y"][:s["dims"]]
    out = []
    for idx in zip(*np.nonzero(~np.isfinite(surface.loss))):
        # idx is (i,) for 1-D, (j, i) = (y, x) for 2-D
        out.append({ax: float(surface.coords[k][idx[len(idx) - 1 - k]])
                    for k, ax in enumerate(names)})
    return out


def _report(args, argv, run, surface: SurfaceFile, centre, out: Path, name: str, world: int,
            resumed: int, negative_variances) -> int:
    """Write the JSON and the plots, print the summary. ``negative_variances(point)``: how
    many BatchNorm channels have a running variance below zero at ``point`` (state kept)."""
    s = surface.settings
    loss = surface.loss
    finite = np.isfinite(loss)
    bad = _non_finite(surface)
    axes = ["t"] if s["mode"] == "interpolate" else ["x", "y"][:s["dims"]]
    grid_min = None
    if finite.any():
        i_min = np.unravel_index(np.argmin(np.where(finite, loss, np.inf)), loss.shape)
        grid_min = {"loss": float(loss[i_min]),
                    **{ax: float(surface.coords[k][i_min[len(i_min) - 1 - k]])
                       for k, ax in enumerate(axes)}}
    grid_max = float(loss[finite].max()) if finite.any() else None
    hint = None
    if bad and s["mode"] == "interpolate" and s.get("bn_stats") == "keep":
        negative = [p for p in bad if negative_variances((p["t"],)) > 0]
        if negative:
            hint = (f"at {len(negative)} of them the interpolated BatchNorm running variance is "
                    "below zero in some channel; --bn-stats recompute (the default with "
                    "--interpolate) recomputes the statistics at every point")
    bn_text = ("BatchNorm statistics recomputed at every point on those images"
               if s.get("bn_stats") == "recompute" else
               "BatchNorm statistics as the state holds them"
               + (" (interpolated)" if s["mode"] == "interpolate" else " (the trained ones)"))
    doc = {"command": "fusedres landscape " + shlex.join(argv), "settings": s,
           "run": str(run.directory), "label": run.label, "iteration": run.iteration,
           "training_images": s["samples"], "batch_norm_statistics": bn_text, "at": centre,
           "grid_min": grid_min, "grid_max_loss": grid_max,
           "non_finite": {"points": len(bad), "at": bad, "why": hint},
           "processes": world, "rows_resumed": resumed, "notes": list(run.notes),
           "files": {"surface": f"{name}.npz"}}
    where_text = ("the path between two checkpoints" if s["mode"] == "interpolate"
                  else f"iteration {run.iteration}")
    if s["mode"] == "trajectory":
        t = s["trajectory"]
        where_text = (f"the training path of {len(t['iterations'])} checkpoints to iteration "
                      f"{run.iteration}")
    pngs = plot(surface, out, name, f"{run.model_name}\nseed {run.cfg['seed']} "
                f"({run.directory.resolve().name}), {where_text}")
    doc["files"]["plots"] = [p.name for p in pngs]
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    for note in run.notes:
        print(f"fusedres landscape: note: {note}", file=sys.stderr)
    y_range = (f" x [{s['range_y'][0]:g}, {s['range_y'][1]:g}]" if "range_y" in s else "")
    lines = [f"{name}: {run.label}, {where_text}; {s['grid']} points per axis over "
             f"[{s['range'][0]:g}, {s['range'][1]:g}]{y_range} on {s['samples']} training images; "
             + bn_text + (f"; {resumed} rows resumed" if resumed else "")]
    for key, v in centre.items():
        lines.append(f"  at {key}: " + ("loss not finite" if v["loss"] is None else
                                        f"loss {v['loss']:.4f}, accuracy "
                                        f"{100 * v['accuracy']:.2f} %"))
    if grid_min is not None:
        where = ", ".join(f"{k} = {grid_min[k]:+.3g}" for k in axes)
        lines.append(f"  grid minimum: loss {grid_min['loss']:.4f} at {where}; "
                     f"maximum {grid_max:.4f} (finite points)")
    if bad:
        shown = "; ".join(", ".join(f"{k} = {v:+.3g}" for k, v in p.items()) for p in bad[:10])
        lines.append(f"  loss not finite at {len(bad)} of {loss.size} points (not drawn): "
                     f"{shown}" + ("; ..." if len(bad) > 10 else "")
                     + (f" ({hint})" if hint else ""))
    lines.append(f"  written: {out / (name + '.npz')}, {out / (name + '.json')}"
                 + ("".join(f", {p}" for p in pngs) if pngs
                    else " (no plots: matplotlib is not installed)"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
