"""What a checkpoint must hold before a run resumes from it, field by field.

A checkpoint is data from disk: a damaged file (its digest catches a changed byte, see
:mod:`.checkpoint`), one written by another version, or one edited by hand. Nothing of it is
applied before all of it is checked, because what the libraries do with a malformed field is
worse than an error: ``torch.optim.Optimizer.load_state_dict`` checks no shapes, and the fused
SGD step then writes past a momentum buffer of the wrong size (SIGSEGV); a scheduler's
``load_state_dict`` takes any dict; an iteration past the run's end trains nothing and exits 0;
a negative running variance makes every evaluation NaN.

Two stages, each raising :class:`FieldError` naming the field and what was expected:

* :func:`check_payload` (run by ``checkpoint.load``, for every reader: the trainer, evaluate,
  lesion, landscape): every field on its own, by type: the iteration, the config, the model's
  and the EMA's tensors, the optimizer's structure, the metrics records, the epoch
  accumulators, the random generators' states (each tried on a throwaway generator of its
  library, which checks it as it would check the real one), the scheduler's and the scaler's
  dicts.
* Against what the run built, before anything is loaded into it (resuming only: a diverged
  run's weights may still be evaluated): :func:`check_tensors` (the model's and the EMA's state
  against theirs: keys, shapes, dtypes, finite values, running variances and counts >= 0),
  :func:`check_optimizer` (each per-parameter state tensor against its parameter, mapped as
  torch.optim maps them: the i-th saved id of a group is the group's i-th parameter),
  :func:`check_like` (a dict of plain values against the one the live object gives: the
  scheduler, the scaler, the optimizer's hyperparameters), :func:`check_iteration` (within the
  run's length).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["FieldError", "check_iteration", "check_like", "check_optimizer", "check_payload",
           "check_tensors"]

# The kinds of metrics records and the numbers each must hold (what the summary, the curves
# and `fusedres compare` read from them).
RECORD_FIELDS = {"train": ("loss", "error", "lr"), "eval": ("test_loss", "test_error"),
                 "epoch": (), "grad_norms": ()}
# Per-parameter optimizer state that is a second moment (AdamW's): a mean of squares, >= 0.
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


class FieldError(ValueError):
    """A checkpoint field that cannot be used: ``"<field>: expected ..., got ..."``."""


def _kind(v: Any) -> str:
    return type(v).__name__


def _int(v: Any, field: str, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FieldError(f"{field}: expected an integer, got {_kind(v)} {v!r:.60}")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise FieldError(f"{field}: expected an integer {bound}, got {v}")
    return v


def _number(v: Any, field: str, *, finite: bool = True,
            minimum: float | None = None) -> int | float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FieldError(f"{field}: expected a number, got {_kind(v)} {v!r:.60}")
    # A finite float, or an int a float holds (torch converts hyperparameters to float).
    if finite and not (abs(v) < 2**63 if isinstance(v, int) else math.isfinite(v)):
        raise FieldError(f"{field}: expected a finite number, got {v!r:.40}")
    if minimum is not None and v < minimum:
        raise FieldError(f"{field}: expected a number >= {minimum}, got {v}")
    return v


def _mapping(v: Any, field: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise FieldError(f"{field}: expected a mapping, got {_kind(v)} {v!r:.60}")
    return v


def _sequence(v: Any, field: str, length: int | None = None) -> list | tuple:
    if not isinstance(v, (list, tuple)):
        raise FieldError(f"{field}: expected a list, got {_kind(v)} {v!r:.60}")
    if length is not None and len(v) != length:
        raise FieldError(f"{field}: expected {length} items, got {len(v)}")
    return v


def _values(t: Tensor, field: str, name: str = "") -> None:
    """Finite floating values; counts and running variances (by their state-dict ``name``)
    >= 0."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise FieldError(f"{field}: expected finite values, got "
                             f"{int((~torch.isfinite(t)).sum())} of {t.numel()} not finite")
    if name.endswith(("running_var", "num_batches_tracked", "n_averaged")) and t.numel():
        low = t.min().item()
        if low < 0:
            what = "a variance" if name.endswith("running_var") else "a count"
            raise FieldError(f"{field}: expected values >= 0 ({what}), got {low}")


def _tensor_dict(v: Any, field: str) -> Mapping[str, Tensor]:
    v = _mapping(v, field)
    for key, t in v.items():
        if not isinstance(key, str):
            raise FieldError(f"{field}: expected names as keys, got {_kind(key)} {key!r:.60}")
        if not isinstance(t, Tensor):
            raise FieldError(f"{field}[{key!r}]: expected a tensor, got {_kind(t)}")
    return v


# --------------------------------------------------------------------------- fields on their own

def _check_optimizer_structure(v: Any) -> None:
    v = _mapping(v, "optimizer")
    state = _mapping(v.get("state", {}), "optimizer['state']")
    groups = _sequence(v.get("param_groups", []), "optimizer['param_groups']")
    for i, g in enumerate(groups):
        g = _mapping(g, f"optimizer['param_groups'][{i}]")
        params = _sequence(g.get("params"), f"optimizer['param_groups'][{i}]['params']")
        for p in params:
            _int(p, f"optimizer['param_groups'][{i}]['params'] (a parameter id)")
    for pid, s in state.items():
        _mapping(s, f"optimizer['state'][{pid!r}]")


def _check_metrics(records: Any, iteration: int) -> None:
    for i, r in enumerate(_sequence(records, "metrics")):
        where = f"metrics[{i}]"
        r = _mapping(r, where)
        kind = r.get("kind")
        if kind not in RECORD_FIELDS:
            raise FieldError(f"{where}['kind']: expected one of {', '.join(RECORD_FIELDS)}, got "
                             f"{kind!r:.60}")
        _int(r.get("iteration"), f"{where}['iteration']", 0, iteration)
        # Losses of a diverged run are NaN: numbers, not necessarily finite.
        for key in RECORD_FIELDS[kind]:
            _number(r.get(key), f"{where}[{key!r}]", finite=False)
        for key, value in r.items():
            if not isinstance(key, str):
                raise FieldError(f"{where}: expected names as keys, got {key!r:.60}")
            if not (value is None or isinstance(value, (str, list))):
                _number(value, f"{where}[{key!r}]", finite=False)


def _check_accum(a: Any) -> None:
    a = _mapping(a, "accum")
    for key in ("ep_correct", "ep_seen", "win_correct", "win_seen"):
        if key in a:
            _int(a[key], f"accum[{key!r}]")
    for key in ("ep_loss", "win_loss"):  # sums of losses: NaN once a run diverged
        if key in a:
            _number(a[key], f"accum[{key!r}]", finite=False)
    for key in ("ep_time", "win_time"):
        if key in a:
            _number(a[key], f"accum[{key!r}]", minimum=0)
    if a.get("diverged_at") is not None:
        _int(a["diverged_at"], "accum['diverged_at']")


def _check_rng(rng: Any) -> None:
    """Each generator's state as its library checks it, on a throwaway generator (the global
    ones are set only once the whole checkpoint passed)."""
    rng = _mapping(rng, "rng")
    for key in ("torch", "numpy", "python"):
        if key not in rng:
            raise FieldError(f"rng: expected the state of {key}'s generator, found none")
    try:
        torch.Generator().set_state(rng["torch"])
    except (TypeError, RuntimeError) as e:
        raise FieldError(f"rng['torch']: {str(e).splitlines()[0]}") from None
    kind, keys, pos, has_gauss, cached = _sequence(rng["numpy"], "rng['numpy']", 5)
    if not (isinstance(keys, Tensor) and keys.dtype == torch.int64 and keys.dim() == 1):
        raise FieldError(f"rng['numpy'][1]: expected an int64 vector (MT19937's keys), got "
                         f"{_kind(keys)}")
    if keys.numel() and (keys.min().item() < 0 or keys.max().item() >= 2**32):
        raise FieldError("rng['numpy'][1]: expected 32-bit unsigned keys")
    _int(pos, "rng['numpy'][2] (position)", 0, keys.numel())
    _int(has_gauss, "rng['numpy'][3] (has_gauss)", 0, 1)
    _number(cached, "rng['numpy'][4] (cached gaussian)")
    try:
        np.random.RandomState().set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss,
                                           cached))
    except (TypeError, ValueError, IndexError) as e:
        raise FieldError(f"rng['numpy']: {e}") from None
    version, internal, gauss = _sequence(rng["python"], "rng['python']", 3)
    if gauss is not None:
        _number(gauss, "rng['python'][2] (cached gaussian)")
    try:
        random.Random().setstate((version, tuple(_sequence(internal, "rng['python'][1]")),
                                  gauss))
    except (TypeError, ValueError) as e:
        raise FieldError(f"rng['python']: {e}") from None
    for i, t in enumerate(_sequence(rng.get("cuda", []), "rng['cuda']")):
        if not (isinstance(t, Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
            raise FieldError(f"rng['cuda'][{i}]: expected a torch.ByteTensor, got {_kind(t)}")


def _check_layout(v: Any) -> None:
    v = _mapping(v, "layout")
    if "channels_last" in v and not isinstance(v["channels_last"], bool):
        raise FieldError(f"layout['channels_last']: expected true or false, got "
                         f"{v['channels_last']!r:.60}")
    for key in ("origin", "reason"):
        if key in v and not isinstance(v[key], str):
            raise FieldError(f"layout[{key!r}]: expected a string, got {_kind(v[key])}")


def check_payload(payload: Mapping[str, Any]) -> None:
    """Every field the trainer reads back, on its own, by type (see the module)."""
    iteration = _int(payload["iteration"], "iteration")
    config = _mapping(payload["config"], "config")
    if not all(isinstance(k, str) for k in config):
        raise FieldError("config: expected option names as keys")
    _tensor_dict(payload["model"], "model")
    _check_optimizer_structure(payload["optimizer"])
    if "ema" in payload:
        _tensor_dict(payload["ema"], "ema")
    if "metrics" in payload:
        _check_metrics(payload["metrics"], iteration)
    if "accum" in payload:
        _check_accum(payload["accum"])
    if "rng" in payload:
        _check_rng(payload["rng"])
    if "lr_scheduler" in payload:
        sched = _mapping(payload["lr_scheduler"], "lr_scheduler")
        _mapping(sched.get("scheduler"), "lr_scheduler['scheduler']")
        _number(sched.get("lr"), "lr_scheduler['lr']", minimum=0)
    if "scaler" in payload:
        _mapping(payload["scaler"], "scaler")
    if "layout" in payload:
        _check_layout(payload["layout"])
    if payload.get("saved_activation_bytes") is not None:
        _int(payload["saved_activation_bytes"], "saved_activation_bytes")
    if "elapsed_s" in payload:
        _number(payload["elapsed_s"], "elapsed_s", minimum=0)


# --------------------------------------------------------------------------- against the run

def check_iteration(iteration: int, max_iters: int) -> None:
    """A resumed iteration within the run: at most its length (equal: a finished run)."""
    if iteration > max_iters:
        raise FieldError(f"iteration: {iteration} is beyond this run's {max_iters} iterations")


def check_tensors(saved: Mapping[str, Tensor], reference: Mapping[str, Tensor],
                  field: str) -> None:
    """``saved`` (already checked on its own) against ``reference``, the state dict of what it
    is loaded into: the same names, each tensor of its reference's shape and dtype
    (``load_state_dict`` would convert another dtype without a word), finite, running
    variances and counts >= 0."""
    missing = [k for k in reference if k not in saved]
    extra = [k for k in saved if k not in reference]
    if missing or extra:
        parts = [f"{len(ks)} {what} (first {ks[0]!r})"
                 for ks, what in ((missing, "missing"), (extra, "unexpected")) if ks]
        raise FieldError(f"{field}: expected the names of this run's model, got "
                         + " and ".join(parts))
    for key, ref in reference.items():
        t = saved[key]
        if t.shape != ref.shape:
            raise FieldError(f"{field}[{key!r}]: expected shape {tuple(ref.shape)}, got "
                             f"{tuple(t.shape)}")
        if t.dtype != ref.dtype:
            raise FieldError(f"{field}[{key!r}]: expected dtype {ref.dtype}, got {t.dtype}")
        _values(t, f"{field}[{key!r}]", key)


def check_optimizer(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                    names: Mapping[int, str]) -> None:
    """The saved optimizer state (structure checked on its own) against ``optimizer``: as many
    groups and parameters per group; each group's hyperparameters of the types the live group's
    have (:func:`check_like`); each per-parameter state tensor of its parameter's shape and
    dtype (moments, momentum), or a single value (a step count, >= 0), second moments >= 0.
    Its device is its parameter's: ``load_state_dict`` moves it there. ``names``: id of a
    parameter -> its name in the model, for the message."""
    groups, live = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live):
        raise FieldError(f"optimizer['param_groups']: expected {len(live)} groups (this run's "
                         f"weight-decay split), got {len(groups)}")
    param_of = {}
    for i, (g, lg) in enumerate(zip(groups, live)):
        if len(g["params"]) != len(lg["params"]):
            raise FieldError(f"optimizer['param_groups'][{i}]['params']: expected "
                             f"{len(lg['params'])} parameters, got {len(g['params'])}")
        for key, value in g.items():
            if key != "params" and key in lg:
                check_like(value, lg[key], f"optimizer['param_groups'][{i}][{key!r}]")
        param_of.update(zip(g["params"], lg["params"]))
    for pid, state in saved["state"].items():
        p = param_of.get(pid)
        if p is None:
            raise FieldError(f"optimizer['state'][{pid!r}]: expected the id of a parameter of "
                             "the groups, got one of none")
        name = names.get(id(p))
        where = f"optimizer['state'][{pid!r}]" + (f" (parameter {name!r})" if name else "")
        for key, value in state.items():
            _check_param_state(value, p, f"{where}[{key!r}]", key)


def _check_param_state(value: Any, p: Tensor, field: str, key: str) -> None:
    if value is None:  # SGD's buffer of a parameter that has had no gradient yet
        return
    if not isinstance(value, Tensor):
        _number(value, field, minimum=0)  # a step count kept as a number
        return
    if value.dim() == 0:
        if not value.isfinite().item() or value.item() < 0:
            raise FieldError(f"{field}: expected a finite count >= 0, got {value.item()}")
        return
    if value.shape != p.shape:
        raise FieldError(f"{field}: expected shape {tuple(p.shape)} (its parameter's), got "
                         f"{tuple(value.shape)}")
    if value.dtype != p.dtype:
        raise FieldError(f"{field}: expected dtype {p.dtype} (its parameter's), got "
                         f"{value.dtype}")
    _values(value, field)
    if key in SECOND_MOMENTS and value.numel() and value.min().item() < 0:
        raise FieldError(f"{field}: expected values >= 0 (a mean of squares), got "
                         f"{value.min().item()}")


def check_like(value: Any, reference: Any, field: str) -> None:
    """``value`` against ``reference``, the value the live object gives for the same field: a
    bool for a bool, a finite number for a number (or a one-element tensor), a string for a
    string, a list of as many items each like the reference's, a mapping whose shared keys
    hold values like the reference's (a mapping keyed by numbers, as MultiStepLR's milestones:
    every key a number, every value like the reference's values). None in the reference takes
    anything plain (an unset option)."""
    if reference is None:
        if isinstance(value, (Mapping, list, tuple, Tensor)):
            raise FieldError(f"{field}: expected a single value, got {_kind(value)}")
    elif isinstance(reference, bool):
        if not isinstance(value, bool):
            raise FieldError(f"{field}: expected true or false, got {value!r:.60}")
    elif isinstance(reference, (int, float)) or (isinstance(reference, Tensor)
                                                 and reference.numel() == 1):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        _number(value, field)
    elif isinstance(reference, str):
        if not isinstance(value, str):
            raise FieldError(f"{field}: expected a string, got {_kind(value)}")
    elif isinstance(reference, (list, tuple)):
        _sequence(value, field, len(reference))
        for i, (v, r) in enumerate(zip(value, reference)):
            check_like(v, r, f"{field}[{i}]")
    elif isinstance(reference, Mapping):
        _check_mapping_like(_mapping(value, field), reference, field)


def _check_mapping_like(value: Mapping, reference: Mapping, field: str) -> None:
    if reference and all(isinstance(k, int) for k in reference):
        sample = next(iter(reference.values()))
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, int):
                raise FieldError(f"{field}: expected numbers as keys, got {k!r:.60}")
            check_like(v, sample, f"{field}[{k}]")
        return
    for k, r in reference.items():
        if k in value:
            check_like(value[k], r, f"{field}[{k!r}]")
