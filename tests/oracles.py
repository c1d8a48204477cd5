"""Plain-PyTorch oracles of He et al.'s residual units, written for the tests from the papers'
formulas (He et al. 2016 Fig. 2, Fig. 4, Table 1; Huang et al. 2016 via torchvision's
``stochastic_depth``), independent of fusedres.modules' code paths.

``unit_oracle(block)`` returns a module holding deep copies of ``block``'s convolutions and
BatchNorms (same state_dict keys) whose forward is the paper's formula in plain ops; each
BatchNorm is called exactly once per forward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import stochastic_depth


def _bn(m, t):
    return t if m is None else m(t)


class UnitOracle(nn.Module):
    def __init__(self, block):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, copy.deepcopy(child))
        for name in ("bn1", "bn2", "bn3", "shortcut_bn", "gate", "shortcut"):
            if not hasattr(self, name):
                setattr(self, name, None)
        self.k = block.num_convs
        self.unit, self.path = block.unit, block.path
        self.scale, self.scale_branch = block.scale, block.scale_branch
        self.p_drop_short = block.shortcut_dropout
        self.drop_path, self.drop_path_mode = block.drop_path, block.drop_path_mode

    def conv(self, i):
        return getattr(self, f"conv{i}")

    def bn(self, i):
        return getattr(self, f"bn{i}")

    def forward(self, x):
        k, unit = self.k, self.unit
        a1 = F.relu(_bn(self.bn1, x)) if unit == "preact" else None
        # h(x)
        if self.path in ("identity", "exclusive_gate", "shortcut_gate"):
            h = x
        elif self.path == "scale":
            h = self.scale * x
        elif self.path == "dropout":
            h = F.dropout(x, self.p_drop_short, self.training)
        elif self.path == "none":
            h = None
        elif unit == "preact":
            h = self.shortcut(a1)
        else:
            h = _bn(self.shortcut_bn, self.shortcut(x))
        # F(x)
        if unit == "preact":
            t = self.conv1(a1)
            for i in range(2, k + 1):
                t = self.conv(i)(F.relu(_bn(self.bn(i), t)))
            f = t
        else:
            t = self.conv1(F.relu(x) if unit == "relu_only_preact" else x)
            for i in range(2, k + 1):
                t = self.conv(i)(F.relu(_bn(self.bn(i - 1), t)))
            if unit in ("original", "relu_only_preact"):
                f = _bn(self.bn(k), t)
            elif unit == "relu_before_add":
                f = F.relu(_bn(self.bn(k), t))
            else:
                f = t
        if self.path == "scale" and self.scale_branch:
            f = (1 - self.scale) * f
        if self.drop_path:
            # "batch" and "batch_skip" draw as torchvision's mode="batch" (they differ in what
            # a dropped unit still computes, not in the result).
            mode = "row" if self.drop_path_mode == "row" else "batch"
            f = stochastic_depth(f, self.drop_path, mode, self.training)
        # combine
        if self.gate is not None:
            g = torch.sigmoid(self.gate(x))
            y = (1 - g) * x + (g * f if self.path == "exclusive_gate" else f)
        else:
            y = f if h is None else h + f
        if unit == "original":
            return F.relu(y)
        if unit == "bn_after_add":
            return F.relu(_bn(self.bn(k), y))
        return y


def unit_oracle(block) -> UnitOracle:
    return UnitOracle(block)
