"""The statistics ``fusedres compare`` puts beside its medians: how far retraining alone moves a
result, and whether two variants differ by more than that.

Two variants trained with the same seeds start from the same initial draw, see the data in the
same order and the same augmentations (``fusedres.apps.train.seeds``), so their difference is
measured per seed: for each seed both were trained with, the second's final test error minus
the first's. :func:`paired_difference` gives the mean of those differences and a percentile
bootstrap interval for it (the seeds resampled with replacement, :data:`RESAMPLES` times, from a
fixed generator: the same runs give the same interval). The verdict is ``"separated"`` when the
interval excludes 0, else ``"not separated"``: a difference the seeds do not agree on is not
claimed. With 3 to 5 seeds the interval is coarse (5 seeds have 126 distinct resamples) and the
percentile bootstrap is known to be narrow at such sizes: a ``separated`` pair is the minimum a
claim needs, not proof.

:func:`retraining_noise` is the yardstick printed first: within each variant, the spread
(max - min) of the final test error over its seeds, i.e. what training the same configuration
again with another seed does to the number.

A diverged run's final test error is still a measured error (its predictions are whatever NaN
logits give); a run with no test error at all (stopped before its first evaluation) is left out
of its pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["LEVEL", "RESAMPLES", "paired_difference", "retraining_noise"]

LEVEL = 0.95
RESAMPLES = 10_000
_SEED = 20160316  # the bootstrap's own generator: fixed, so an interval is a function of the runs


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], level: float = LEVEL,
                      resamples: int = RESAMPLES) -> dict[str, Any]:
    """``b - a`` over the seeds both have (values per seed, e.g. final test error in points).

    Returns ``{"seeds", "n", "differences", "mean", "low", "high", "level", "verdict"}``:
    the mean difference and its bootstrap ``level`` interval (``low``, ``high``; None with
    fewer than 2 common seeds), and the verdict ``"separated"`` (the interval excludes 0),
    ``"not separated"``, or ``"too few seeds"`` (fewer than 2 in common)."""
    seeds = sorted(s for s in set(a) & set(b)
                   if a[s] is not None and b[s] is not None
                   and math.isfinite(a[s]) and math.isfinite(b[s]))
    diffs = np.array([b[s] - a[s] for s in seeds], dtype=float)
    out: dict[str, Any] = {"seeds": seeds, "n": len(seeds), "differences": diffs.tolist(),
                           "mean": float(diffs.mean()) if len(diffs) else None,
                           "low": None, "high": None, "level": level}
    if len(diffs) < 2:
        out["verdict"] = "too few seeds"
        return out
    rng = np.random.default_rng(_SEED)
    picks = rng.integers(0, len(diffs), size=(resamples, len(diffs)))
    means = diffs[picks].mean(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    out.update(low=float(low), high=float(high),
               verdict="separated" if low > 0 or high < 0 else "not separated")
    return out


def retraining_noise(values_by_variant: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """The spread (max - min) of each variant's values over its seeds (finite values only;
    variants with fewer than two are skipped): ``{"variants", "median", "max", "spreads"}``,
    or None when no variant has two seeds."""
    spreads = []
    for values in values_by_variant:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if len(finite) >= 2:
            spreads.append(max(finite) - min(finite))
    if not spreads:
        return None
    return {"variants": len(spreads), "median": float(np.median(spreads)),
            "max": float(max(spreads)), "spreads": spreads}


def jsonable(obj: Any) -> Any:
    """``obj`` (figures in dicts, lists and tuples) with every non-finite float as None: strict
    JSON has no NaN or Infinity, and compare.json and hessian_2d.json are read by other tools."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj

