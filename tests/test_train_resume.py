"""Never lose a run: a real training process killed (SIGKILL, then SIGTERM) and resumed ends
with exactly the weights of an uninterrupted run (CPU, same seed and thread count)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from fusedres.apps.train import checkpoint as ckpt

# A small network on the embedded digits; enough iterations that the run is still going when
# the first checkpoints appear. Checkpoints every 4 iterations, evaluations every 7 and at each
# epoch end (11 iterations), milestones inside the run.
ARGS = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "8", "--max-iters", "90",
        "--checkpoint-every", "4", "--eval-every", "7", "--log-every", "3", "--threads", "1",
        "--pad", "1", "--no-flip", "--warmup-iters", "5", "--milestones", "30,60",
        "--no-progress", "--seed", "3"]


def _env():
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusedres.apps.train", *ARGS, "--out", str(out),
                           *extra], capture_output=True, text=True, env=_env(), timeout=300)


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fusedres.apps.train", *ARGS, "--out", str(out),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())


def _iterations(out: Path) -> list[int]:
    return [int(p.stem.split("_")[1]) for p in ckpt.list_checkpoints(out)]


def _kill_after_checkpoint_beyond(proc: subprocess.Popen, out: Path, beyond: int, sig: int):
    """Send ``sig`` as soon as a checkpoint later than ``beyond`` exists; returns its iteration."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        its = _iterations(out)
        if its and its[-1] > beyond:
            proc.send_signal(sig)
            return its[-1]
        assert proc.poll() is None, "the run ended before it could be interrupted:\n" + \
            proc.stderr.read()
        time.sleep(0.01)
    raise AssertionError("no checkpoint appeared")


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    state = ckpt.load(ckpt.latest(out))
    assert state["iteration"] == 90
    return state["model"], state["optimizer"]


def _evals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "eval"]


def test_killed_and_resumed_run_is_bit_exact(tmp_path):
    ref = tmp_path / "uninterrupted"
    done = _run(ref)
    assert done.returncode == 0, done.stderr

    run = tmp_path / "interrupted"
    # 1. SIGKILL: no chance to save; the resume restarts from the last periodic checkpoint.
    proc = _start(run)
    _kill_after_checkpoint_beyond(proc, run, 0, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = _iterations(run)[-1]
    assert killed_at < 90

    # 2. Resume, then SIGTERM: the handler checkpoints the current iteration and exits 143.
    proc = _start(run, "--resume")
    seen = _kill_after_checkpoint_beyond(proc, run, killed_at, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received: checkpoint saved" in err
    stopped_at = _iterations(run)[-1]
    assert seen <= stopped_at < 90

    # 3. Resume to the end.
    last = _run(run, "--resume")
    assert last.returncode == 0, last.stderr

    model, optim = _final_weights(run)
    ref_model, ref_optim = _final_weights(ref)
    assert model.keys() == ref_model.keys()
    for k in ref_model:
        assert torch.equal(model[k], ref_model[k]), k
    for pid, s in ref_optim["state"].items():
        assert torch.equal(optim["state"][pid]["momentum_buffer"], s["momentum_buffer"])
    # The metrics log holds each evaluation once, with the same values.
    assert _evals(run) == _evals(ref)
    assert (run / "curves.png").stat().st_size > 0
    assert len(ckpt.list_checkpoints(run)) <= 2  # --keep-checkpoints default
