"""Compact Markdown table of a `fusedres bench units` run in both layouts (results.json):
per shape the plain NCHW median and, as multiples of it, plain channels_last, fused NCHW and
fused channels_last; then fused over plain in the same layout and best fused over best plain.

Usage: ``python benchmarks/layout_table.py RUN_DIR [--backend cpu]``
(RUN_DIR: an ``--out`` directory of ``fusedres bench units --baselines plain,channels_last``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def table(rows: list[dict], backend: str) -> str:
    by: dict[str, dict[str, float]] = {}
    for r in rows:
        by.setdefault(r["shape"], {})[r["impl"]] = r["median_s"] * 1e3
    out = ["| shape | plain NCHW ms | plain cl | fused NCHW | fused cl | fused / plain, NCHW "
           "| fused / plain, cl | best fused / best plain |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    same_n, same_c, best = [], [], []
    for shape, v in by.items():
        p, pc = v["plain"], v["channels_last"]
        f, fc = v[backend], v[f"{backend} channels_last"]
        sn, sc, b = f / p, fc / pc, min(f, fc) / min(p, pc)
        same_n.append((sn, shape)), same_c.append((sc, shape)), best.append((b, shape))
        bold = (lambda x: f"**{x:.2f}**" if x > 1.0 else f"{x:.2f}")
        out.append(f"| {shape} | {p:.2f} | {pc / p:.2f}x | {f / p:.2f}x | {fc / p:.2f}x | "
                   f"{bold(sn)} | {bold(sc)} | {bold(b)} |")
    out.append("")
    for name, vals in (("fused / plain, NCHW", same_n), ("fused / plain, channels_last", same_c),
                       ("best fused / best plain", best)):
        r = [x for x, _ in vals]
        worst = max(vals)
        out.append(f"- {name}: median {statistics.median(r):.2f}, at or below 1.0 on "
                   f"{sum(x <= 1.0 for x in r)} of {len(r)}, worst {worst[1]} ({worst[0]:.2f})")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--backend", default="cpu")
    a = p.parse_args()
    doc = json.loads((a.run_dir / "results.json").read_text())
    print(table(doc["parts"]["units"]["rows"], a.backend))


if __name__ == "__main__":
    main()
