"""Metrics: the log file (JSON lines or CSV, TensorBoard when installed), curves, summary.

Every record is a dict with ``kind`` ("train", "eval" or "epoch": flat; "grad_norms" with
``--log-grad-norms``: lists per unit, jsonl only) and ``iteration``. The
full history also travels in each checkpoint, so a resumed run rewrites the log from it and no
record after the checkpoint's iteration is kept twice.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import resource
from pathlib import Path
from typing import Any

import torch

from .checkpoint import writing

__all__ = ["MetricsLog", "format_bytes", "peak_memory_bytes", "plot", "summary"]

CSV_FIELDS = ("kind", "iteration", "epoch", "lr", "loss", "error", "test_loss", "test_error",
              "images_per_s", "epoch_time_s", "peak_memory_bytes", "time_s")


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on a GPU; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class MetricsLog:
    def __init__(self, run_dir: Path, fmt: str, history: list[dict[str, Any]],
                 tensorboard: bool):
        self.fmt = fmt
        self.path = run_dir / ("metrics.jsonl" if fmt == "jsonl" else "metrics.csv")
        self.records = list(history)
        # Rewrite from the checkpoint's history (atomic), then append.
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with writing(self.path):
            try:
                with open(tmp, "w", newline="") as f:
                    self._write_header(f)
                    for r in self.records:
                        self._write(f, r)
                os.replace(tmp, self.path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            self._file = open(self.path, "a", newline="")
        self.tb = None
        self.tb_note = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self.tb_note = "tensorboard is not installed: no event files"

    def _write_header(self, f) -> None:
        if self.fmt == "csv":
            csv.writer(f).writerow(CSV_FIELDS)

    def _write(self, f, record: dict[str, Any]) -> None:
        if self.fmt == "jsonl":
            f.write(json.dumps(record) + "\n")
        else:
            csv.writer(f).writerow(["" if record.get(k) is None else record.get(k)
                                    for k in CSV_FIELDS])

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with writing(self.path):
            try:
                self._write(self._file, record)
                self._file.flush()
            except OSError:
                # Closed now, the unwritten rest dropped, so that the file's finaliser does not
                # report the same error again at exit.
                with contextlib.suppress(OSError):
                    self._file.close()
                raise
        if self.tb is not None:
            for k, v in record.items():
                if k not in ("kind", "iteration", "epoch") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{record['kind']}/{k}", v, record["iteration"])

    def close(self) -> None:
        if not self._file.closed:
            with writing(self.path):
                self._file.close()
        if self.tb is not None:
            self.tb.close()


def plot(records: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """PNG with three panels: loss, error (train and test), learning rate, against iteration."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    it = [r["iteration"] for r in train]
    ev = [r["iteration"] for r in evals]
    axes[0].plot(it, [r["loss"] for r in train], label="train")
    axes[0].plot(ev, [r["test_loss"] for r in evals], "o-", label="test")
    axes[0].set_ylabel("cross-entropy loss")
    axes[1].plot(it, [100 * r["error"] for r in train], label="train")
    axes[1].plot(ev, [100 * r["test_error"] for r in evals], "o-", label="test")
    axes[1].set_ylabel("error (%)")
    axes[2].plot(it, [r["lr"] for r in train])
    axes[2].set_ylabel("learning rate")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        if train or evals:
            ax.legend()
    if any(r["loss"] > 0 for r in train):
        axes[0].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        with writing(path):
            fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def summary(records: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """Best and final test error, time per epoch, images/s, memory."""
    evals = [r for r in records if r["kind"] == "eval"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    out: dict[str, Any] = {}
    if evals:
        best = min(evals, key=lambda r: r["test_error"])
        out.update(final_test_error=evals[-1]["test_error"], best_test_error=best["test_error"],
                   best_iteration=best["iteration"], final_test_loss=evals[-1]["test_loss"])
    if epochs:
        times = [r["epoch_time_s"] for r in epochs if r.get("epoch_time_s")]
        rates = [r["images_per_s"] for r in epochs if r.get("images_per_s")]
        out["epochs"] = len(epochs)
        out["time_per_epoch_s"] = sum(times) / len(times) if times else None
        out["images_per_s"] = sum(rates) / len(rates) if rates else None
        out["peak_memory_bytes"] = max(r.get("peak_memory_bytes") or 0 for r in epochs)
    out.update(extra)
    return out


def summary_table(s: dict[str, Any]) -> str:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.2f} %"

    def num(v, fmt="{:.1f}"):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    rows = [
        ("model", s.get("model")),
        ("network", s.get("label", "n/a")),
        ("dataset", s.get("dataset")),
        ("iterations", s.get("iterations")),
        ("final test error", pct(s.get("final_test_error"))),
        ("best test error", f"{pct(s.get('best_test_error'))} (iteration "
                            f"{s.get('best_iteration')})"),
        ("final test accuracy", pct(None if s.get("final_test_error") is None
                                    else 1 - s["final_test_error"])),
        ("time per epoch", num(s.get("time_per_epoch_s"), "{:.2f} s")),
        ("images/s (training)", num(s.get("images_per_s"))),
        ("saved activations / step", format_bytes(s.get("saved_activation_bytes"))),
        ("peak memory", f"{format_bytes(s.get('peak_memory_bytes'))} ({s.get('memory_kind')})"),
        ("parameters", f"{s.get('parameters', 0) / 1e6:.3f} M"),
    ]
    if s.get("diverged_at_iteration") is not None:
        rows.insert(3, ("diverged", f"training loss not finite by iteration "
                                    f"{s['diverged_at_iteration']}"))
    if s.get("channels_last") is not None:
        rows.append(("layout", ("channels_last" if s["channels_last"] else "NCHW")
                     + f" ({s.get('channels_last_origin')})"))
    width = max(len(k) for k, _ in rows)
    lines = ["| " + "quantity".ljust(width) + " | value |", "|" + "-" * (width + 2) + "|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)
