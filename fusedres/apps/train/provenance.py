"""Where a run came from: the commit of the code that trained it and whether that code had
uncommitted changes, the versions of the packages it ran on, and the device.

The trainer writes the record under the key ``provenance`` of ``config.yaml`` (where
:func:`fusedres.apps.train.config.load_yaml` skips it: it is a record, not an option) and of
``summary.json``: a list with one entry per process that trained the run, each with the
iteration it started from. A run resumed at another commit, or on another machine, shows both;
an entry from a later iteration than the resume point (the history of an abandoned branch of
the run) is dropped. :func:`read` reads the list back (``fusedres compare`` prints it and warns
when runs differ; reproduction/digits.py records it in results.json).

The commit is ``git rev-parse HEAD`` of the repository that holds the imported ``fusedres``
package (an editable install or a checkout on the path); an installed wheel has none (None).
``dirty`` says whether the code that ran differs from that commit: uncommitted changes, or
files git neither tracks nor ignores, under :data:`SOURCE` (the package, its kernels and C++
sources, setup.py). Documents and results elsewhere in the tree do not count, as they do not
change what was trained; ``changed`` names the first few paths that do.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import yaml

__all__ = ["KEY", "SOURCE", "describe", "device_name", "entries", "from_config", "git_state",
           "read", "record", "versions"]

KEY = "provenance"
# The repository paths whose changes change what a run computes.
SOURCE = ("fusedres", "kernels", "csrc", "setup.py")
# Distributions whose version is recorded (those installed; torch also with its CUDA build).
PACKAGES = ("fusedres", "torch", "triton", "numpy", "scikit-learn")
_SHOWN_CHANGES = 10


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(package_dir: Path | None = None) -> dict[str, Any]:
    """``{"commit", "dirty", "changed"}`` of the repository holding ``package_dir`` (default:
    the imported fusedres package); all None when it is not in a git work tree."""
    if package_dir is None:
        import fusedres

        package_dir = Path(fusedres.__file__).resolve().parent
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    commit = _git(package_dir, "rev-parse", "HEAD")
    if not top or not commit:
        return {"commit": None, "dirty": None, "changed": None}
    root = Path(top.strip())
    status = _git(root, "status", "--porcelain", "--", *SOURCE)
    if status is None:
        return {"commit": commit.strip(), "dirty": None, "changed": None}
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit.strip(), "dirty": bool(changed),
            "changed": changed[:_SHOWN_CHANGES]}


def versions() -> dict[str, str]:
    """Python's version and those of :data:`PACKAGES` that are installed (read from their
    metadata, nothing imported); torch's own version string, and its CUDA and cuDNN builds when
    it has them."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    out["torch"] = str(torch.__version__)  # with its build tag (+cu130), which the metadata drops
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """``"cuda: NVIDIA H200"`` or ``"cpu: <model>, N CPUs"``."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {_cpu_name()}, {os.cpu_count()} CPUs"


def record(device: torch.device, iteration: int = 0) -> dict[str, Any]:
    """This process's entry: the iteration it trains from, the code's commit and state, the
    package versions, the device and the time (UTC)."""
    return {"from_iteration": int(iteration), **git_state(), "versions": versions(),
            "device": device_name(device),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def from_config(run_dir: Path) -> list[dict[str, Any]] | None:
    """The list in a run's config.yaml (None without one)."""
    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    found = data.get(KEY) if isinstance(data, dict) else None
    return found if isinstance(found, list) else None


def entries(run_dir: Path, device: torch.device, iteration: int) -> list[dict[str, Any]]:
    """The list config.yaml holds once this process starts training ``run_dir`` from
    ``iteration``: the entries already there that started before it, then this one."""
    earlier = [e for e in from_config(Path(run_dir)) or []
               if isinstance(e, dict) and int(e.get("from_iteration", 0)) < iteration]
    return [*earlier, record(device, iteration)]


def read(run_dir: str | Path) -> list[dict[str, Any]] | None:
    """A run's provenance list: summary.json's when it finished, else config.yaml's; None for
    a run written before the trainer recorded one."""
    run_dir = Path(run_dir)
    try:
        found = json.loads((run_dir / "summary.json").read_text()).get(KEY)
    except (OSError, ValueError, AttributeError):
        found = None
    if isinstance(found, list):
        return found
    return from_config(run_dir)


def describe(entry: dict[str, Any]) -> str:
    """One line: ``commit 1a2b3c4 (uncommitted changes), torch 2.14.1, ..., on cpu: ...``."""
    commit = entry.get("commit")
    state = {True: " (uncommitted changes)", False: "", None: " (state unknown)"}[
        entry.get("dirty")]
    head = f"commit {commit[:10]}{state}" if commit else "no git commit (an installed package)"
    pkgs = ", ".join(f"{k} {v}" for k, v in (entry.get("versions") or {}).items())
    return f"{head}; {pkgs}; on {entry.get('device', 'an unknown device')}"
