"""``fusedres bench fit``: what fits in a memory budget, found by running training steps.

For plain, fused, and fused + planner: the largest batch of one CIFAR ResNet, and the deepest
CIFAR ResNet (bottleneck units, depth 9n+2) at one batch, whose training step's peak memory
(:func:`fusedres.apps.bench.measure.peak_bytes`, two steps so the optimizer state exists) stays
within ``budget``. The search grows the size geometrically until a step does not fit (or a cap),
then bisects; every probe is kept, so the plot shows depth (or batch) against peak memory.

A probe that does not fit is one whose measured peak exceeds the budget, that runs out of
device memory, or for which the planner says the budget cannot be met.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from fusedres.memory.planner import PlanError

from .measure import sync
from .report import Column, fmt_bytes, mem_unit, pyplot
from .step import build_variant, step_peak

__all__ = ["FIT_VARIANTS", "probe", "search", "run_fit"]

FIT_VARIANTS = ("plain", "fused", "fused+plan")


def depth_of(n: int) -> int:
    """CIFAR bottleneck ResNet depth with n units per stage (He et al.: 164 is n=18)."""
    return 9 * n + 2


def probe(variant: str, depth: int, batch: int, budget: int, device: torch.device,
          plan_tries: int = 3) -> dict:
    """Build ``variant`` of the CIFAR ResNet-``depth`` at ``batch``, run two training steps,
    measure the second's peak; ``fits`` when it is within ``budget``.

    ``fused+plan`` hands ``budget`` to ``fusedres.memory.plan``; when the measured step still
    goes over (a planner that bounds only the activations leaves out the parameters, their
    gradients and the optimizer state), the planner is asked again with the budget lowered by
    the overshoot, up to ``plan_tries`` plans in all, as a user would.
    """
    row = {"variant": variant, "depth": depth, "batch": batch, "budget_bytes": budget}
    t0 = time.monotonic()
    plan_budget = budget
    try:
        for attempt in range(1, plan_tries + 1):
            tr = build_variant("", variant, batch, device, plan_budget=plan_budget, depth=depth)
            row.update({k: v for k, v in tr.info.items() if k != "variant"})
            tr.step()
            row["peak_bytes"] = step_peak(tr, device)
            del tr
            _free(device)
            row["fits"] = row["peak_bytes"] <= budget
            over = row["peak_bytes"] - budget
            if variant != "fused+plan" or row["fits"] or attempt == plan_tries:
                break
            plan_budget = int(plan_budget - 1.1 * over)
            if plan_budget <= 0:
                break
            row["plan_tries"] = attempt + 1
    except PlanError as e:
        row.update(fits=False, reason=f"planner: {str(e).splitlines()[0][:160]}")
    except torch.cuda.OutOfMemoryError:
        row.update(fits=False, reason="out of device memory")
    finally:
        _free(device)
    row["seconds"] = time.monotonic() - t0
    return row


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()


def search(fits: Callable[[int], bool], start: int, cap: int, deadline: float | None = None
           ) -> tuple[int | None, str]:
    """The largest integer k in [start, cap] with ``fits(k)``, assuming fitting is monotone
    (fits up to some k, not beyond): doubling from ``start``, then bisection. Returns (k or
    None when ``start`` does not fit, how the search ended)."""
    if not fits(start):
        return None, "the smallest size does not fit"
    lo, hi = start, None
    while hi is None:
        if deadline is not None and time.monotonic() > deadline:
            return lo, "time limit: a lower bound"
        if lo >= cap:
            return lo, "cap reached: a lower bound"
        k = min(2 * lo, cap)
        if fits(k):
            lo = k
        else:
            hi = k
    while hi - lo > 1:
        if deadline is not None and time.monotonic() > deadline:
            return lo, "time limit: a lower bound"
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, "exact"


def run_fit(budget: int, device: torch.device, *, depth: int, batch: int, max_batch: int,
            max_depth: int, variants=FIT_VARIANTS, deadline: float | None = None,
            progress=None, on_result=None) -> dict:
    """Both searches for every variant. Returns ``{"results": [...], "probes": [...]}``:
    one result per (variant, search) with the answer, and every probe run."""
    probes: list[dict] = []
    results: list[dict] = []

    def run_probe(variant, d, b, what):
        r = probe(variant, d, b, budget, device)
        r["search"] = what
        probes.append(r)
        if progress is not None:
            progress.set_postfix_str(f"{variant} depth {d} batch {b}: "
                                     + ("fits" if r["fits"] else "no"))
            progress.update(1)
        return r["fits"]

    for variant in variants:
        best, how = search(lambda b, v=variant: run_probe(v, depth, b, "batch"), 2,
                           max_batch, deadline)
        results.append(_result(variant, "batch", depth, best, how, probes))
        if on_result is not None:
            on_result(results[-1])
        best_n, how = search(lambda n, v=variant: run_probe(v, depth_of(n), batch, "depth"),
                             1, max(1, (max_depth - 2) // 9), deadline)
        results.append(_result(variant, "depth", batch, None if best_n is None
                               else depth_of(best_n), how, probes))
        if on_result is not None:
            on_result(results[-1])
    return {"budget_bytes": budget, "depth": depth, "batch": batch, "max_batch": max_batch,
            "max_depth": max_depth, "results": results, "probes": probes}


def _result(variant, what, fixed, best, how, probes) -> dict:
    key = "batch" if what == "batch" else "depth"
    match = [p for p in probes if p["variant"] == variant and p["search"] == what
             and p[key] == best and p["fits"]]
    return {"variant": variant, "search": what,
            "fixed": f"depth {fixed}" if what == "batch" else f"batch {fixed}",
            "largest": best, "how": how,
            "peak_bytes": match[-1]["peak_bytes"] if match else None,
            "probes": sum(p["variant"] == variant and p["search"] == what for p in probes)}


# --------------------------------------------------------------------------- output

def columns():
    return [Column("variant", "variant", right=False),
            Column("largest", lambda r: (r["search"], r["largest"]),
                   lambda v: f"{v[0]} {v[1]}" if v[1] is not None else f"{v[0]}: none"),
            Column("at", "fixed", right=False),
            Column("its peak", "peak_bytes", fmt_bytes),
            Column("search", "how", right=False), Column("probes", "probes")]


def plot(doc: dict, path, title: str) -> None:
    """Depth vs peak memory and batch vs peak memory, one line per variant, the budget as a
    horizontal line; probes that did not fit in the budget are drawn hollow."""
    plt = pyplot()
    probes = [p for p in doc["probes"] if p.get("peak_bytes") is not None]
    if not probes:
        return
    colors = dict(zip(FIT_VARIANTS, ("tab:gray", "tab:blue", "tab:green")))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    gib, unit = mem_unit(max(doc["budget_bytes"], *(p["peak_bytes"] for p in probes)))
    styles = {"plain": ("-", "o"), "fused": ("-", "o"), "fused+plan": ("--", "s")}
    for ax, what, fixed in ((axes[0], "depth", f"batch {doc['batch']}"),
                            (axes[1], "batch", f"ResNet-{doc['depth']}")):
        for v in FIT_VARIANTS:
            pts = sorted((p[what], p["peak_bytes"] / gib, p["fits"]) for p in probes
                         if p["variant"] == v and p["search"] == what)
            if not pts:
                continue
            xs, ys, ok = zip(*pts)
            ls, mk = styles[v]
            ax.plot(xs, ys, ls, color=colors[v], label=v, lw=1.5)
            ax.scatter([x for x, f in zip(xs, ok) if f], [y for y, f in zip(ys, ok) if f],
                       color=colors[v], s=22, zorder=3, marker=mk)
            ax.scatter([x for x, f in zip(xs, ok) if not f], [y for y, f in zip(ys, ok) if not f],
                       facecolors="white", edgecolors=colors[v], s=22, zorder=3, marker=mk)
            best = next((r["largest"] for r in doc["results"]
                         if r["variant"] == v and r["search"] == what), None)
            if best is not None:
                ax.axvline(best, color=colors[v], ls=":", lw=1)
        ax.axhline(doc["budget_bytes"] / gib, color="red", ls="--", lw=1, label="budget")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(("CIFAR ResNet depth (bottleneck, 9n+2)" if what == "depth"
                       else "batch size") + f", {fixed}")
        ax.set_ylabel(f"peak memory of a training step, {unit}")
        from matplotlib.ticker import ScalarFormatter
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title + "\n(dotted: the largest that fits; hollow: probes over the budget)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
