"""The process under a CPU budget: the allocator's slack, measured over trainer runs.

Each configuration runs ``fusedres train`` (synthetic CIFAR-shaped data, ``--memory-budget``) in
a fresh process and reads its summary.json: the plan's predicted step peak (tensors, the cpu
backend's workspace, what the data load added), the live-tensor tracker's measured peak, and
the process's peak resident set above its baseline (torch and fusedres imported, before the
data and the model). The slack is the last minus the first. Each row shows it
beside what ``fusedres.memory.allocator.allocator_slack_bytes`` predicts for the run (a constant, a
share per residual unit, a share of the step: the bound fitted on these runs); *margin* is the
model's figure minus the measured one (negative: the model was short). Resident-set figures
do not depend on the machine's load; no timing is taken.

    python -m tools.tables.process_memory --runs 20:64:4GiB,56:128:4GiB,164:128:1GiB
    python -m tools.tables.process_memory --runs 164:128:1GiB --no-release   # glibc left alone
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
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_one(depth: int, batch: int, budget: str, threads: int, release: bool,
            iters: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    env["FUSEDRES_RELEASE_FREED_MEMORY"] = "1" if release else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fusedres.apps.train", "--dataset", "synthetic", "--model",
               "preact_resnet", "--depth", str(depth), "--batch-size", str(batch),
               "--memory-budget", budget, "--max-iters", str(iters), "--threads", str(threads),
               "--no-progress", "--log-every", "1", "--out", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    step = s["predicted_peak_bytes"]
    rss = s["peak_rss_above_baseline_bytes"]
    units = int(s["memory_plan"].split(" units in ")[0].split(" of ")[-1])
    from fusedres.memory.allocator import allocator_slack_bytes

    return {"units": units, "model_slack": allocator_slack_bytes(step, units, release),
            "depth": depth, "batch": batch, "budget": budget, "release": release,
            "predicted_step": step, "predicted_process": s["predicted_process_bytes"],
            "measured_tensors": s["measured_peak_bytes"], "rss_above_baseline": rss,
            "rss_above_pre_step": s["peak_rss_above_pre_step_bytes"],
            "rss_baseline": s["rss_baseline_bytes"], "slack": rss - step,
            "plan": s["memory_plan"].splitlines()[1].strip()}


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
    print("| depth (units) | batch | budget | units checkpointed | predicted step MiB | "
          "tracker MiB | RSS above baseline MiB | slack MiB | model's slack MiB | margin MiB |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for spec in args.runs.split(","):
        depth, batch, budget = spec.split(":")
        r = run_one(int(depth), int(batch), budget, args.threads, not args.no_release,
                    args.iters)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(r) + "\n")
        ckpt = r["plan"].split("checkpointed ")[1].split(" units")[0]
        print(f"| {r['depth']} ({r['units']}) | {r['batch']} | {r['budget']} | {ckpt} | "
              f"{r['predicted_step'] / MiB:.1f} | {r['measured_tensors'] / MiB:.1f} | "
              f"{r['rss_above_baseline'] / MiB:.1f} | {r['slack'] / MiB:.1f} | "
              f"{r['model_slack'] / MiB:.1f} | {(r['model_slack'] - r['slack']) / MiB:+.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
