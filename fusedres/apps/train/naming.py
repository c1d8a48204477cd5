"""What a run is called: its network and every variant option, from its configuration.

``"preact_resnet20"`` names a pre-activation network, a network without shortcuts and a
post-activation one alike; a figure, legend or summary that names only the model cannot be read
without its command line. :func:`variant_label` names all five things the trainer's variants
change (depth, unit, shortcut, normalisation, stochastic depth), every time, defaults included,
so two labels differ exactly where the networks do. The trainer's summary and curves use it, and
so do the experiments on finished runs (``fusedres compare``, ``lesion``, ``landscape``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["VARIANT_KEYS", "depth_of", "variant_fields", "variant_label"]

# How each option reads in a label.
_UNITS = {"preact": "full pre-activation unit", "original": "original (post-activation) unit",
          "bn_after_add": "BN-after-addition unit", "relu_before_add": "ReLU-before-addition unit",
          "relu_only_preact": "ReLU-only pre-activation unit"}
_NORMS = {"batch": "BatchNorm", "none": "no normalisation"}
_IMAGENET = {f"preact_resnet{d}" for d in (18, 34, 50, 101, 152, 200)}  # the zoo's named ones
# The options that make a run's variant (the trainer's build_model reads them), in label order.
VARIANT_KEYS = ("model", "depth", "unit", "shortcut", "shortcut_scale", "scale_branch",
                "gate_bias", "shortcut_dropout", "norm", "drop_path_rate", "drop_path_mode")


def depth_of(cfg: dict[str, Any]) -> int | None:
    """The network's depth: ``--depth``, else the number in a named model (preact_resnet110)."""
    if cfg.get("depth") is not None:
        return int(cfg["depth"])
    m = re.search(r"(\d+)$", str(cfg.get("model", "")))
    return int(m.group(1)) if m else None


def _shortcut(cfg: dict[str, Any]) -> str:
    kind = cfg.get("shortcut", "identity")
    if kind == "none":
        return "no shortcut (plain)"
    if kind == "scale":
        factor = 0.5 if cfg.get("shortcut_scale") is None else cfg["shortcut_scale"]
        branch = " (branch 1 - it)" if cfg.get("scale_branch") else ""
        return f"shortcut scaled {factor:g}{branch}"
    if kind in ("exclusive_gate", "shortcut_gate"):
        bias = -6 if cfg.get("gate_bias") is None else cfg["gate_bias"]
        return f"{kind.replace('_', '-')} shortcut (gate bias {bias:g})"
    if kind == "dropout":
        p = 0.5 if cfg.get("shortcut_dropout") is None else cfg["shortcut_dropout"]
        return f"dropout shortcut (p {p:g})"
    if kind == "conv1x1":
        return "1x1-conv shortcut"
    return f"{kind} shortcut"


def _drop_path(cfg: dict[str, Any]) -> str:
    rate = cfg.get("drop_path_rate") or 0.0
    if not rate:
        return "no drop-path"
    return f"drop-path {rate:g} ({cfg.get('drop_path_mode', 'row')})"


def variant_fields(cfg: dict[str, Any]) -> dict[str, str]:
    """The label's parts by name: network, unit, shortcut, norm, drop_path."""
    depth = depth_of(cfg)
    model = str(cfg.get("model", "?"))
    network = f"ResNet-{depth}" if depth is not None else model
    if cfg.get("variant") == "imagenet" or model in _IMAGENET:
        network += " (ImageNet layout)"
    unit = cfg.get("unit", "preact")
    return {"network": network, "unit": _UNITS.get(unit, f"{unit} unit"),
            "shortcut": _shortcut(cfg), "norm": _NORMS.get(cfg.get("norm", "batch"),
                                                           str(cfg.get("norm"))),
            "drop_path": _drop_path(cfg)}


def variant_label(cfg: dict[str, Any]) -> str:
    """'ResNet-56: full pre-activation unit, identity shortcut, BatchNorm, no drop-path'."""
    f = variant_fields(cfg)
    return f"{f['network']}: {f['unit']}, {f['shortcut']}, {f['norm']}, {f['drop_path']}"
