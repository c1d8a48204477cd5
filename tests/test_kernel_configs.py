"""The kernels' configs are named tables (kernels/*.py): a picker returns a config by its name,
never by its place in a list, and every config of a table has a name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def positional_picks(paths) -> list[str]:
    """``file:line`` of every subscript of a name ending in ``CONFIGS`` or named ``configs`` with
    an integer (or a slice of integers): a config picked by its position."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Subscript):
                continue
            base = node.value
            name = base.id if isinstance(base, ast.Name) else (
                base.attr if isinstance(base, ast.Attribute) else "")
            if not (name == "configs" or name.endswith("CONFIGS")):
                continue
            index = node.slice
            parts = [index.lower, index.upper] if isinstance(index, ast.Slice) else [index]
            if any(isinstance(p, ast.Constant) and isinstance(p.value, int) or
                   isinstance(p, ast.UnaryOp) and isinstance(p.operand, ast.Constant)
                   for p in parts if p is not None):
                rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{rel}:{node.lineno}")
    return out


def test_no_config_is_picked_by_position():
    assert positional_picks(sorted((ROOT / "kernels").glob("*.py"))) == []


def test_the_check_finds_a_positional_pick(tmp_path):
    planted = tmp_path / "k.py"
    planted.write_text("def pick(configs):\n    return configs[6]\n"
                       "def pick2():\n    return FP32_CONFIGS[-1], m.IEEE_CONFIGS[:3]\n")
    assert len(positional_picks([planted])) == 3


def test_every_config_a_picker_chooses_among_has_a_name():
    """Roles with one config a variant (the reductions, scale_shift) have nothing to pick."""
    pytest.importorskip("triton")
    from tools import triton_aot as aot

    tables = 0
    for role, configs_for in aot.role_configs().items():
        for variant in ("fp16", "fp32", "fp32-ieee", "fp64"):
            configs = configs_for(variant)
            if len(configs) > 1:
                tables += 1
                assert all(c.name for c in configs), f"{role} {variant}: unnamed configs"
    assert tables >= 12
