"""``fusedres landscape RUN --hessian``: the curvature maps of Li et al. (2018), section 6.

At each point of the surface's 2-D grid (every ``--hessian-every``-th point of each axis), the
extreme eigenvalues lambda_max and lambda_min of the Hessian of the training loss with respect
to every parameter of the network, and the map of |lambda_min / lambda_max|: near 0 where the
surface is locally convex (the negative curvature, if any, is negligible beside the positive),
large where it is not. A 2-D contour plot can look like a bowl and still hide directions of
negative curvature in the other dimensions; this map is how Li et al. back the word "convex".

How it is computed:

* Hessian-vector products with ``torch.func``: the loss as a function of the parameters
  (``functional_call``), its gradient (``grad``) dotted with the vector, differentiated again
  (reverse over reverse; on these networks it measured faster on CPU than ``jvp`` over
  ``grad``), summed over the same training batches as the surface, each weighted by its size.
* The fused BatchNorm-ReLU-conv ops define a first derivative only, so the products run on a
  plain PyTorch twin of the network (``fused=False``: the same layers and state_dict keys), into
  which the surface's weights at the point are copied.
* BatchNorm as the surface has it: evaluation mode with the running statistics of the state
  (``--bn-stats keep``), or statistics recomputed at the point (``recompute``) and then held
  fixed, as Li et al.'s code differentiates the network in evaluation mode.
* The extreme eigenvalues by the Lanczos iteration with full reorthogonalisation
  (:func:`lanczos_extremes`), at most ``--hessian-iters`` products, from the same start vector
  at every point (drawn from ``--seed``); it stops early once the residual bound of both extreme
  Ritz values is within ``--hessian-tol`` of the larger magnitude. Extreme Ritz values lie
  inside the spectrum: an unconverged lambda_min is too close to 0 and the ratio too small, so
  each point records its iterations and residuals (``converged`` in the JSON).

Files: ``hessian_2d.npz`` (lambda_min, lambda_max, iterations, residuals, the sub-grid, the
settings; rewritten after every row, so an interrupted map continues), ``hessian_2d.json``,
``hessian_2d.png``. One process only (the rows are not split under torchrun).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fusedres.apps.cli import UsageError
from fusedres.apps.train.build import build_model
from fusedres.apps.train.checkpoint import write_atomically
from fusedres.apps.train.seeds import derived_seed

from . import figures, stats
from .landscape_plots import hessian_figure

__all__ = ["DEFAULT_ITERS", "DEFAULT_TOL", "HessianMap", "hessian_vector_product",
           "lanczos_extremes", "map_over", "plain_twin"]

DEFAULT_ITERS = 20
DEFAULT_TOL = 1e-2  # Li et al.'s eigsh tolerance
_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- the products

def hessian_vector_product(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]
                           ) -> tuple[Callable[[Tensor], Tensor], int]:
    """``(hvp, n)``: ``hvp(v)`` is H v for a flat float64 vector ``v`` of the ``n`` parameters
    of ``model`` (``named_parameters`` order), H the Hessian of the mean cross-entropy over
    ``batches`` with the model as it is (call ``model.eval()`` for running statistics)."""
    from torch.func import functional_call, grad

    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    total = sum(len(y) for _, y in batches)

    def unflatten(v: Tensor) -> dict[str, Tensor]:
        parts = torch.split(v, sizes)
        return {n: part.view(shape).to(params[n].dtype)
                for n, part, shape in zip(names, parts, shapes)}

    def hvp(v: Tensor) -> Tensor:
        vec = unflatten(v)
        out = torch.zeros_like(v)
        for x, y in batches:
            def loss(p, x=x, y=y):
                out = functional_call(model, {**p, **buffers}, (x,))
                return F.cross_entropy(out.float() if out.dtype in _HALF else out, y)

            def along(p):
                g = grad(loss)(p)
                return sum((g[n] * vec[n]).sum() for n in names)

            hv = grad(along)(params)
            out += (len(y) / total) * torch.cat([hv[n].reshape(-1) for n in names]).to(v.dtype)
        return out

    return hvp, sum(sizes)


def lanczos_extremes(hvp: Callable[[Tensor], Tensor], n: int, iters: int, tol: float,
                     start: Tensor) -> dict[str, Any]:
    """The smallest and largest eigenvalues of the symmetric operator ``hvp`` on R^n by at most
    ``iters`` Lanczos steps from ``start``, each new vector orthogonalised against all before it
    (float64). Stops when both extreme Ritz pairs have a residual ||H y - theta y|| (=
    beta_j |s_j|) within ``tol`` x max(|theta_min|, |theta_max|), or when the Krylov space is
    exhausted (then exact). Returns ``{"min", "max", "iterations", "residual_min",
    "residual_max", "converged"}``."""
    q = start.to(torch.float64).reshape(-1)
    q = q / q.norm()
    basis: list[Tensor] = []
    alphas: list[float] = []
    betas: list[float] = []
    result: dict[str, Any] = {}
    for j in range(min(iters, n)):
        w = hvp(q).to(torch.float64)
        alpha = float(w @ q)
        w = w - alpha * q - (betas[-1] * basis[-1] if betas else 0.0)
        for _ in range(2):  # full reorthogonalisation; twice is enough (Kahan, Parlett)
            for prev in [*basis, q]:
                w = w - float(w @ prev) * prev
        basis.append(q)
        alphas.append(alpha)
        beta = float(w.norm())
        T = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
        theta, s = np.linalg.eigh(T)
        r_min, r_max = abs(beta * float(s[-1, 0])), abs(beta * float(s[-1, -1]))
        scale = max(abs(float(theta[0])), abs(float(theta[-1])), 1e-30)
        exhausted = beta <= 1e-10 * scale
        converged = exhausted or (r_min <= tol * scale and r_max <= tol * scale)
        result = {"min": float(theta[0]), "max": float(theta[-1]), "iterations": j + 1,
                  "residual_min": 0.0 if exhausted else r_min,
                  "residual_max": 0.0 if exhausted else r_max, "converged": bool(converged)}
        if converged:
            break
        betas.append(beta)
        q = w / beta
    return result


def plain_twin(run) -> nn.Module:
    """The run's network built with plain PyTorch layers (``fused=False``: same state_dict
    keys), on the run's device, in evaluation mode."""
    cfg = {**run.cfg, "fused": False}
    model = build_model(cfg, run.data.image_shape[0], run.data.num_classes).to(run.device)
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model.eval()


# --------------------------------------------------------------------------- the map file

class HessianMap:
    """The saved map: ``lam_min``, ``lam_max``, ``iterations``, ``residual`` ((ny, nx), [y, x];
    the residual the larger of the two ends'), ``done`` (one flag a row), the sub-grid's
    coordinates and the settings that made it."""

    FIELDS = ("lam_min", "lam_max", "iterations", "residual")

    def __init__(self, settings: dict[str, Any], x: np.ndarray, y: np.ndarray):
        self.settings, self.x, self.y = settings, x, y
        shape = (len(y), len(x))
        self.arrays = {k: np.full(shape, np.nan) for k in self.FIELDS}
        self.done = np.zeros(len(y), dtype=bool)

    def save(self, path: Path) -> None:
        arrays = {**self.arrays, "done": self.done, "x": self.x, "y": self.y,
                  "settings": np.array(json.dumps(self.settings, sort_keys=True))}
        write_atomically(path, lambda f: np.savez(f, **arrays))

    def resume_from(self, path: Path, overwrite: bool) -> int:
        """Take the rows done in ``path`` when it was made with the same settings; a file made
        with others is a UsageError unless ``overwrite``. Returns the rows taken."""
        if overwrite or not path.exists():
            return 0
        try:
            with np.load(path, allow_pickle=False) as z:
                saved = json.loads(str(z["settings"]))
                arrays = {k: z[k].copy() for k in self.FIELDS}
                done = z["done"].copy()
        except Exception as e:
            raise UsageError(f"--hessian: {str(path)!r} is not a readable Hessian map "
                             f"({type(e).__name__}); --overwrite starts again") from None
        if saved != self.settings:
            diff = sorted(k for k in set(saved) | set(self.settings)
                          if saved.get(k) != self.settings.get(k))
            raise UsageError(f"--hessian: the map in {str(path)!r} was computed with other "
                             f"settings ({', '.join(diff)}); rerun with the same ones to "
                             "continue it, or give --overwrite to start again")
        self.arrays, self.done = arrays, done
        return int(done.sum())

    @property
    def ratio(self) -> np.ndarray:
        lo, hi = self.arrays["lam_min"], self.arrays["lam_max"]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.abs(lo / hi)


# --------------------------------------------------------------------------- the command

def sub_grid(coords: Sequence[np.ndarray], every: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ``every``-th point of each axis of the surface's grid."""
    return coords[0][::every], coords[1][::every]


def _settings(surface_settings: dict[str, Any], args, every: int) -> dict[str, Any]:
    keep = {k: v for k, v in surface_settings.items() if k != "format"}
    return {**keep, "hessian_iters": args.hessian_iters, "hessian_tol": args.hessian_tol,
            "hessian_every": every, "hessian_seed": args.seed,
            "hessian_parameters": "all (Li et al.)"}


def map_over(run, data, weights, coords, surface_settings: dict[str, Any], out: Path, args,
             recompute: Callable[[], None] | None, argv: Sequence[str],
             labels: tuple[str, str], progress: bool) -> dict[str, Any]:
    """Compute (or continue) the map over ``coords``'s sub-grid: ``weights.set(point)`` puts the
    surface's weights at a point into ``run.model``, ``recompute`` (None with --bn-stats keep)
    recomputes its BatchNorm statistics there. Writes the files, returns the JSON document."""
    every = args.hessian_every
    x, y = sub_grid(coords, every)
    settings = _settings(surface_settings, args, every)
    hmap = HessianMap(settings, x, y)
    path = out / "hessian_2d.npz"
    resumed = hmap.resume_from(path, args.overwrite)
    twin = plain_twin(run)
    n = sum(p.numel() for p in twin.parameters())
    g = torch.Generator().manual_seed(derived_seed(args.seed, "hessian-start", 0))
    start = torch.randn(n, generator=g, dtype=torch.float64)
    from tqdm import tqdm

    todo = [r for r in range(len(y)) if not hmap.done[r]]
    with tqdm(total=len(todo) * len(x), file=sys.stderr, disable=not progress, unit="point",
              desc=f"hessian rows {len(todo)}", dynamic_ncols=True) as bar:
        for r in todo:
            for c in range(len(x)):
                found = _at(run, data, weights, twin, (float(x[c]), float(y[r])), recompute,
                            start.to(run.device), args)
                hmap.arrays["lam_min"][r, c] = found["min"]
                hmap.arrays["lam_max"][r, c] = found["max"]
                hmap.arrays["iterations"][r, c] = found["iterations"]
                hmap.arrays["residual"][r, c] = max(found["residual_min"],
                                                    found["residual_max"])
                bar.update(1)
            hmap.done[r] = True
            hmap.save(path)
    weights.set((0.0, 0.0))
    weights.restore_batch_norm()
    return _report(hmap, run, out, argv, labels, resumed)


def _at(run, data, weights, twin, point, recompute, start, args) -> dict[str, Any]:
    weights.set(point)
    if recompute is not None:
        recompute()
    twin.load_state_dict(run.model.state_dict())
    twin.eval()
    hvp, n = hessian_vector_product(twin, data)
    return lanczos_extremes(lambda v: hvp(v.to(start.dtype)), n, args.hessian_iters,
                            args.hessian_tol, start)


def _report(hmap: HessianMap, run, out: Path, argv, labels, resumed: int) -> dict[str, Any]:
    ratio = hmap.ratio
    finite = ratio[np.isfinite(ratio)]
    cx = int(np.argmin(np.abs(hmap.x)))
    cy = int(np.argmin(np.abs(hmap.y)))
    converged = hmap.arrays["residual"] <= hmap.settings["hessian_tol"] * np.maximum(
        np.abs(hmap.arrays["lam_min"]), np.abs(hmap.arrays["lam_max"]))
    doc = {"command": "fusedres landscape " + shlex.join(argv), "settings": hmap.settings,
           "run": str(run.directory), "label": run.label,
           "centre": {"x": float(hmap.x[cx]), "y": float(hmap.y[cy]),
                      "lam_min": figures.finite_or_none(hmap.arrays["lam_min"][cy, cx]),
                      "lam_max": figures.finite_or_none(hmap.arrays["lam_max"][cy, cx]),
                      "ratio": figures.finite_or_none(ratio[cy, cx])},
           "ratio": {"median": figures.finite_or_none(np.median(finite)) if finite.size
                     else None,
                     "max": figures.finite_or_none(finite.max()) if finite.size else None,
                     "below_0.1": int((finite < 0.1).sum()), "points": int(ratio.size)},
           "converged": {"points": int(converged.sum()), "of": int(converged.size)},
           "rows_resumed": resumed, "files": {"map": "hessian_2d.npz"}}
    title = (f"{run.model_name}, seed {run.cfg['seed']}: Hessian of the training loss over "
             f"{hmap.settings['samples']} images, every parameter; {doc['converged']['points']} "
             f"of {converged.size} points converged")
    fig = hessian_figure(hmap.x, hmap.y, ratio, hmap.arrays["lam_max"],
                         (float(hmap.x[cx]), float(hmap.y[cy])), labels, title)
    if fig is not None:
        doc["files"]["plot"] = figures.save(fig, out / "hessian_2d.png", layout=False).name
    (out / "hessian_2d.json").write_text(json.dumps(stats.jsonable(doc), indent=2) + "\n")
    c = doc["centre"]
    print(f"hessian_2d: {len(hmap.y)} x {len(hmap.x)} points; at the centre lambda_min "
          f"{_g(c['lam_min'])}, lambda_max {_g(c['lam_max'])}, |ratio| {_g(c['ratio'])}; "
          f"median |ratio| {_g(doc['ratio']['median'])}, {doc['ratio']['below_0.1']} of "
          f"{ratio.size} points below 0.1; {doc['converged']['points']} converged"
          f"\n  written: {out / 'hessian_2d.npz'}, {out / 'hessian_2d.json'}"
          + (f", {out / doc['files']['plot']}" if "plot" in doc["files"] else ""))
    return doc


def _g(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"
