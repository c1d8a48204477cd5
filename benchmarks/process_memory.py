"""The process under a CPU budget: the allocator's slack, measured over trainer runs.

Each configuration runs ``fusedres train`` (synthetic CIFAR-shaped data, ``--memory-budget``) in
a fresh process and reads its summary.json: the plan's predicted step peak (tensors, the cpu
backend's workspace, what the data load added), the live-tensor tracker's measured peak, and
the process's peak resident set above its baseline (torch and fusedres imported, before the
data and the model). The slack is the last minus the first; the fit ``slack = a + f * step``
(least squares, then ``a`` raised until no run is above the line) is what
``fusedres.allocator`` models (``SLACK_BYTES``, ``SLACK_FRACTION``). Resident-set figures do
not depend on the machine's load; no timing is taken.

    python benchmarks/process_memory.py --runs 20:64:4GiB,56:128:4GiB,164:128:1GiB
    python benchmarks/process_memory.py --runs 164:128:1GiB --no-release   # glibc left alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2 ** 20
ROOT = Path(__file__).resolve().parent.parent


def run_one(depth: int, batch: int, budget: str, threads: int, release: bool,
            iters: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    env["FUSEDRES_RELEASE_FREED_MEMORY"] = "1" if release else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fusedres.train", "--dataset", "synthetic", "--model",
               "preact_resnet", "--depth", str(depth), "--batch-size", str(batch),
               "--memory-budget", budget, "--max-iters", str(iters), "--threads", str(threads),
               "--no-progress", "--log-every", "1", "--out", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    step = s["predicted_peak_bytes"]
    rss = s["peak_rss_above_baseline_bytes"]
    return {"depth": depth, "batch": batch, "budget": budget, "release": release,
            "predicted_step": step, "predicted_process": s["predicted_process_bytes"],
            "measured_tensors": s["measured_peak_bytes"], "rss_above_baseline": rss,
            "rss_above_pre_step": s["peak_rss_above_pre_step_bytes"],
            "rss_baseline": s["rss_baseline_bytes"], "slack": rss - step,
            "plan": s["memory_plan"].splitlines()[1].strip()}


def fit(rows: list[dict]) -> tuple[float, float]:
    """(a, f): least-squares slope f of slack over the step's peak, a the intercept raised so
    that every run lies on or under the line."""
    xs = [r["predicted_step"] for r in rows]
    ys = [r["slack"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    f = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    a = max(y - f * x for x, y in zip(xs, ys))
    return a, f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="20:64:4GiB,56:128:4GiB,110:128:1GiB,164:64:4GiB",
                    help="depth:batch:budget, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--no-release", action="store_true",
                    help="FUSEDRES_RELEASE_FREED_MEMORY=0: glibc keeps freed blocks")
    ap.add_argument("--json", type=Path, help="append each run's figures here (JSON lines)")
    args = ap.parse_args()
    rows = []
    print("| depth | batch | budget | plan | predicted step MiB | tracker MiB | RSS above "
          "baseline MiB | slack MiB | slack / step |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for spec in args.runs.split(","):
        depth, batch, budget = spec.split(":")
        r = run_one(int(depth), int(batch), budget, args.threads, not args.no_release,
                    args.iters)
        rows.append(r)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(r) + "\n")
        print(f"| {r['depth']} | {r['batch']} | {r['budget']} | {r['plan']} | "
              f"{r['predicted_step'] / MiB:.1f} | {r['measured_tensors'] / MiB:.1f} | "
              f"{r['rss_above_baseline'] / MiB:.1f} | {r['slack'] / MiB:.1f} | "
              f"{r['slack'] / r['predicted_step']:.3f} |", flush=True)
    if len(rows) > 1:
        a, f = fit(rows)
        print(f"\nslack <= {a / MiB:.1f} MiB + {f:.4f} x step peak (over {len(rows)} runs; "
              f"glibc thresholds {'left alone' if args.no_release else 'set'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
