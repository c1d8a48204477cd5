"""The residual unit's variants beside the full pre-activation unit (He et al. 2016, Fig. 4
and Table 1): the other orderings' forward, the shortcuts other than identity and projection
(scale, gates, 1x1 convolution, dropout, none), the branch scale, and what a unit runs as
plain PyTorch. :class:`fusedres.modules.ResidualBlock` builds the submodules and calls these
functions with itself as ``block``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def scaled(y: Tensor, scale: Tensor | None) -> Tensor:
    """``y`` scaled per sample by ``scale`` (N,), or ``y`` when None."""
    return y if scale is None else y * scale.view(-1, *([1] * (y.dim() - 1))).to(y.dtype)


def branch_scale(block, drawn: Tensor | None, x: Tensor) -> Tensor | None:
    """The branch's per-sample factor: the drop-path draw ``drawn``, times ``1 - scale`` for
    the scale shortcut with ``scale_branch``."""
    if block.path == "scale" and block.scale_branch:
        s = x.new_full((x.shape[0],), 1.0 - block.scale)
        return s if drawn is None else s * drawn
    return drawn


def shortcut(block, x: Tensor, a) -> Tensor | None:
    """h(x) for the additive shortcuts (gates are combined in :func:`combine`); ``a`` the
    first BN-ReLU that a pre-activation unit's projection reads."""
    kind = block.path
    if kind == "identity" or kind in ("exclusive_gate", "shortcut_gate"):
        return x
    if kind == "scale":
        return x * block.scale
    if kind == "dropout":
        return F.dropout(x, block.shortcut_dropout, block.training)
    if kind == "none":
        return None
    if block.unit == "preact":  # the projection shares the first BN-ReLU
        return block.layer.conv(a, block.shortcut)
    h = block.shortcut(x)
    return block.shortcut_bn(h) if block.shortcut_bn is not None else h


def combine(block, x: Tensor, short: Tensor | None, f: Tensor | None) -> Tensor:
    """h(x) + F for a branch ``f`` already scaled (None: dropped, zero)."""
    if block.gate is not None:
        g = torch.sigmoid(block.gate(x))
        kept = (1 - g) * x
        if f is None:
            return kept
        return kept + (g * f if block.path == "exclusive_gate" else f)
    if f is None:
        return short if short is not None else torch.zeros_like(x)
    return f if short is None else short + f


def forward_post(block, x: Tensor, dropped: bool, drawn: Tensor | None) -> Tensor:
    """The forward of the orderings other than full pre-activation (its convolutions already
    checked, the drop-path draw made): conv-BN-ReLU ... conv, then each ordering's last
    BatchNorm and ReLU around the addition."""
    L = block.layer
    convs, bns = block.convs, block.bns
    k = block.num_convs
    short = shortcut(block, x, None)
    if dropped:
        f = None
    else:
        first_relu = block.unit == "relu_only_preact"
        t = L.conv(L.act(None, x), convs[0]) if first_relu else convs[0](x)
        if k > 1:
            a = L.act(bns[0], t)
            for i in range(1, k - 1):
                a = L.conv_into(a, convs[i], bns[i])
            t = L.conv(a, convs[-1])
        bn = bns[-1]
        if block.unit in ("original", "relu_only_preact"):
            f = bn(t) if bn is not None else t
        elif block.unit == "relu_before_add":
            f = F.relu(bn(t) if bn is not None else t)
        else:  # bn_after_add: the BatchNorm comes after the addition
            f = t
        f = scaled(f, branch_scale(block, drawn, x))
    y = combine(block, x, short, f)
    if block.unit == "original":
        return F.relu(y)
    if block.unit == "bn_after_add":
        bn = bns[-1]
        return F.relu(bn(y) if bn is not None else y)
    return y


def plain_parts(block) -> list[str]:
    """What ``block`` runs as plain PyTorch whatever the layer (no BN-ReLU -> conv chain)."""
    parts = []
    k = block.num_convs
    if block.unit in ("original", "bn_after_add", "relu_before_add"):
        parts.append("conv1 (reads the unit's input, no BN-ReLU before it)")
    if block.unit != "preact":
        if block.shortcut is not None:
            parts.append("shortcut (1x1 conv of the unit's input)"
                         + (" and shortcut_bn" if block.shortcut_bn is not None else ""))
        last = {"original": f"bn{k} and the ReLU after the addition",
                "bn_after_add": f"the addition's bn{k} and ReLU",
                "relu_before_add": f"bn{k}-ReLU before the addition",
                "relu_only_preact": f"bn{k} before the addition"}[block.unit]
        parts.append(last if block.norm == "batch" else last.replace(f"bn{k} and ", "")
                     .replace(f"bn{k}-", "").replace(f"the addition's bn{k} and ", ""))
    if block.unit == "relu_only_preact":
        parts.append("the first ReLU -> conv1 (no BatchNorm: fusing would save nothing)")
    if block.norm == "none":
        parts.append("every ReLU -> conv (no BatchNorm: fusing would save nothing)")
    if block.gate is not None:
        parts.append("gate (sigmoid of a 1x1 conv) and the gated sum")
    return parts
