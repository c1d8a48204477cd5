"""Saved activations of He et al.'s unit orderings and shortcut variants, fused vs plain.

    python -m tools.tables.variant_memory            # rewrites its section of benchmarks/MEMORY.md
    python -m tools.tables.variant_memory --print    # prints only

A count, not a timing (``fusedres.memory.saved_bytes``: distinct storages saved for backward),
taken on the meta device: CIFAR ResNet-110 (basic units) and ResNet-164 (bottlenecks), batch 128,
32x32, float32, one training forward. The fused model runs every BN-ReLU -> conv chain through
the fused op; what a variant has outside such chains (a post-activation unit's first conv, its
BatchNorm before or after the addition, a gate) is the same in both columns.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from fusedres import models
from fusedres.memory import saved_bytes
from fusedres.modules import UNITS

MiB = 2 ** 20
MEMORY_MD = Path(__file__).resolve().parents[2] / "benchmarks" / "MEMORY.md"
BEGIN, END = "<!-- variant-memory:begin -->", "<!-- variant-memory:end -->"

VARIANTS = ([(u, "identity", {}) for u in UNITS]
            + [("preact", s, kw) for s, kw in (
                ("scale", {"scale": 0.5, "scale_branch": True}),
                ("exclusive_gate", {}), ("shortcut_gate", {}), ("conv1x1", {}),
                ("dropout", {}), ("none", {}))]
            + [("original", "none", {})])


def _saved(depth: int, fused: bool, batch: int, **kw) -> int:
    model = models.preact_resnet(depth, fused=fused, **kw).to(device="meta")
    x = torch.empty((batch, 3, 32, 32), device="meta")
    return saved_bytes(model, x)


def table(batch: int = 128) -> str:
    lines = [f"Batch {batch}, CIFAR 32x32, float32, saved bytes after one training forward "
             f"(`python -m tools.tables.variant_memory`).", "",
             "| depth | unit | shortcut | norm | drop path | plain MiB | fused MiB "
             "| fused / plain |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [(110, u, s, kw, "batch", 0.0) for u, s, kw in VARIANTS]
    rows += [(110, "preact", "identity", {}, "none", 0.0),
             (110, "preact", "none", {}, "none", 0.0),
             (110, "preact", "identity", {}, "batch", 0.5)]
    rows += [(164, u, "identity", {}, "batch", 0.0) for u in UNITS]
    for depth, unit, shortcut, kw, norm, rate in rows:
        args = dict(unit=unit, shortcut=shortcut, norm=norm, drop_path_rate=rate, **kw)
        plain = _saved(depth, False, batch, **args)
        fused = _saved(depth, True, batch, **args)
        dp = f"{rate:g} (row)" if rate else "-"
        lines.append(f"| {depth} | {unit} | {shortcut} | {norm} | {dp} | {plain / MiB:,.1f} | "
                     f"{fused / MiB:,.1f} | {fused / plain:.2f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--print", action="store_true", help="print only, do not edit MEMORY.md")
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    text = table(args.batch)
    if args.print:
        print(text)
        return 0
    section = (f"{BEGIN}\n## Saved activations of the unit and shortcut variants\n\n{text}\n"
               f"{END}")
    doc = MEMORY_MD.read_text()
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, doc,
                     flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + section + "\n"
    MEMORY_MD.write_text(doc)
    print(f"wrote its section of {MEMORY_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
