"""Report writers: machine facts, terminal and Markdown tables, JSON, PNG plots (matplotlib,
Agg backend: no display needed)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import fusedres

__all__ = ["Column", "cpu_model", "fmt_bytes", "machine", "machine_line", "markdown_table",
           "text_table", "write_json"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(device: torch.device | None = None) -> dict[str, Any]:
    """What ran the figures: CPU, cores, threads, load, torch/triton/fusedres versions, GPU."""
    info: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "fusedres": fusedres.__version__,
        "cuda_runtime": torch.version.cuda,
        "backends": fusedres.available_backends(device),
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    try:
        info["load_average_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device is not None:
        info["device"] = str(device)
        if device.type == "cuda":
            p = torch.cuda.get_device_properties(device)
            info.update(gpu=p.name, gpu_memory_bytes=p.total_memory,
                        gpu_capability=f"{p.major}.{p.minor}")
    return info


def machine_line(m: dict[str, Any]) -> str:
    dev = m.get("gpu") or m["cpu"]
    return (f"{dev}; {m['cores']} cores, {m['torch_threads']} torch threads; torch {m['torch']}, "
            f"fusedres {m['fusedres']}; backends {', '.join(m['backends'])}"
            + (f"; load {m['load_average_1m']:.1f}" if "load_average_1m" in m else ""))


def short_machine(m: dict[str, Any]) -> str:
    """For plot titles: the device, threads, torch."""
    dev = m.get("gpu") or f"{m['cpu']}, {m['torch_threads']} threads"
    load = f", load {m['load_average_1m']:.1f}" if "load_average_1m" in m and not m.get("gpu") \
        else ""
    return f"{dev}{load}; torch {m['torch'].split('+')[0]}"


def mem_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) to plot byte counts up to ``largest``: GiB from 1 GiB, else MiB."""
    return (2 ** 30, "GiB") if largest >= 2 ** 30 else (2 ** 20, "MiB")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Column:
    """A table column: ``header``, the row key or a function of the row, and a format."""

    def __init__(self, header: str, key, fmt: str = "{}", right: bool = True):
        self.header, self.key, self.fmt, self.right = header, key, fmt, right

    def cell(self, row: dict) -> str:
        v = self.key(row) if callable(self.key) else row.get(self.key)
        if v is None:
            return "-"
        return self.fmt.format(v) if isinstance(self.fmt, str) else self.fmt(v)


def text_table(rows: Sequence[dict], cols: Sequence[Column]) -> str:
    cells = [[c.cell(r) for c in cols] for r in rows]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def line(values):
        return "  ".join(v.rjust(w) if c.right else v.ljust(w)
                         for v, w, c in zip(values, widths, cols)).rstrip()
    out = [line([c.header for c in cols]), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def markdown_table(rows: Sequence[dict], cols: Sequence[Column]) -> str:
    out = ["| " + " | ".join(c.header for c in cols) + " |",
           "|" + "|".join("---:" if c.right else "---" for c in cols) + "|"]
    out += ["| " + " | ".join(c.cell(r) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: Path, doc: dict) -> None:
    """Atomically (write then rename): a cut-off run leaves the previous complete file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def command_line() -> str:
    return "fusedres bench " + " ".join(sys.argv[1:]) if sys.argv else "fusedres bench"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only; works without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
