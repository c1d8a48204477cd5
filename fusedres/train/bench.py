"""Short training runs, fused vs plain: images/s, saved activations and peak memory.

    python -m fusedres.train.bench [--models 20,56,164] [--iters 6] [--batch-size 128]
                                   [--threads N] [--device cpu|cuda] [-- extra train flags]

Each configuration is a real ``fusedres train`` process on the ``synthetic`` dataset (random
CIFAR-shaped images), so the peak memory is that process's alone. images/s is the median over
the iterations after the first (the first pays for warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .metrics import format_bytes


def run_one(depth: int, fused: bool, args, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fusedres.train", "--dataset", "synthetic", "--model",
               f"preact_resnet{depth}", "--fused" if fused else "--no-fused",
               "--max-iters", str(args.iters), "--batch-size", str(args.batch_size),
               "--log-every", "1", "--eval-batch-size", str(args.batch_size), "--no-progress",
               "--device", args.device, "--out", str(out), *extra]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rates = [r["images_per_s"] for r in records
                 if r["kind"] == "train" and r["iteration"] > 1]
        summary = json.loads((out / "summary.json").read_text())
    return {"depth": depth, "fused": fused, "images_per_s": statistics.median(rates),
            "spread": (min(rates), max(rates)), "backend": summary["backend"],
            "saved_activation_bytes": summary["saved_activation_bytes"],
            "peak_memory_bytes": summary["peak_memory_bytes"],
            "memory_kind": summary["memory_kind"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m fusedres.train.bench")
    p.add_argument("--models", default="20,56,164")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args(argv)
    rows = []
    for depth in (int(d) for d in args.models.split(",")):
        for fused in (False, True):
            r = run_one(depth, fused, args, extra)
            rows.append(r)
            print(f"ResNet-{depth} {'fused' if fused else 'plain'}: "
                  f"{r['images_per_s']:.1f} img/s", file=sys.stderr)
    threads = args.threads or torch.get_num_threads()
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{threads} threads, torch {torch.__version__}, batch {args.batch_size}, "
          f"{args.iters} iterations (median of the last {args.iters - 1})\n")
    print("| model | blocks | backend | images/s (min-max) | saved activations / step | "
          f"peak memory ({rows[0]['memory_kind']}) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["spread"]
        print(f"| ResNet-{r['depth']} | {'fused' if r['fused'] else 'plain'} | {r['backend']} "
              f"| {r['images_per_s']:.1f} ({lo:.1f}-{hi:.1f}) "
              f"| {format_bytes(r['saved_activation_bytes'])} "
              f"| {format_bytes(r['peak_memory_bytes'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
