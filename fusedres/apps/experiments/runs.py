"""A run of ``fusedres train`` loaded for analysis: its configuration, its model with a
checkpoint's weights (BatchNorm in eval mode: running statistics), its dataset and normalisation.

Nothing here copies the trainer: the configuration is the run's saved ``config.yaml`` layered
over the trainer's defaults as a resume layers it (``merge_saved``), the model comes from the
trainer's ``build_model`` (so a model variant the trainer learns to build loads here too), the
weights from ``fusedres.apps.train.checkpoint``, the data and its normalisation from
``fusedres.apps.train.data``. Every problem is a :class:`~fusedres.apps.cli.UsageError` naming the
option.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import fusedres
from fusedres.apps.cli import UsageError
from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import data as data_mod
from fusedres.apps.train.build import build_model
from fusedres.apps.train.config import DEFAULTS, load_yaml, merge_saved
from fusedres.apps.train.naming import variant_label

__all__ = ["Evaluation", "LoadedRun", "Parser", "add_run_options", "at_least", "check_checkpoint",
           "evaluate", "load_checkpoint", "locate", "open_run", "pick_device", "rank_and_world",
           "read_config", "state_mismatch", "threads"]

_AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse's own is two lines)
        raise UsageError(message)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options every experiment takes to load and evaluate a run."""
    p.add_argument("--checkpoint", help="checkpoint file to load (default: the run's latest)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available")
    p.add_argument("--backend", choices=("auto", *fusedres.BACKENDS),
                   help="fusedres backend of a fused model (default: the run's)")
    p.add_argument("--batch-size", type=int,
                   help="images per forward pass (default: the run's --eval-batch-size)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--data-dir", help="where the run's dataset is (default: where the run "
                                      "found it)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar on stderr (on)")


def at_least(value, minimum: int | float, flag: str, what: str = "") -> None:
    """UsageError naming ``flag`` when ``value`` (not None) is below ``minimum``."""
    if value is not None and value < minimum:
        raise UsageError(f"{flag}: expected {what or f'a value >= {minimum}'}, got {value}")


def check_checkpoint(path: str | Path, flag: str) -> Path:
    """``path`` as a checkpoint file that exists; else a UsageError naming ``flag``."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UsageError(f"{flag}: {str(p)!r} {what} (expected a checkpoint file, "
                         "RUN/checkpoints/iter_N.pt)")
    return p


def locate(run: str | Path, checkpoint: str | Path | None = None, flag: str = "--checkpoint"
           ) -> tuple[Path, Path]:
    """(run directory, checkpoint file) for ``RUN`` (a run directory, or one of its checkpoint
    files) and ``checkpoint`` given by option ``flag`` (default: the run's latest). Only looks
    at paths."""
    path = Path(run)
    if not path.exists():
        raise UsageError(f"RUN: {str(path)!r} does not exist (expected the directory of a "
                         "fusedres train run, or one of its checkpoint files)")
    if path.is_file():
        if checkpoint is not None:
            raise UsageError(f"{flag}: RUN {str(path)!r} is a checkpoint file already; give a "
                             f"run directory with {flag}")
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return run_dir, path
    if checkpoint is not None:
        return path, check_checkpoint(checkpoint, flag)
    latest = ckpt.latest(path)
    if latest is None:
        raise UsageError(f"RUN: no checkpoint in {str(ckpt.checkpoint_dir(path))!r} (expected a "
                         "run directory of fusedres train holding checkpoints/iter_N.pt; or give "
                         "--checkpoint)")
    return path, latest


def load_checkpoint(path: Path, flag: str) -> dict[str, Any]:
    try:
        return ckpt.load(path)
    except ckpt.CheckpointError as e:
        raise UsageError(f"{flag}: {e}") from None


def _config(run_dir: Path, state: dict[str, Any] | None) -> dict[str, Any]:
    """The run's saved config.yaml (else the checkpoint's copy) over the trainer's defaults."""
    path = run_dir / "config.yaml"
    if not path.is_file() and state is None:
        raise UsageError(f"RUN: {str(run_dir)!r} is not a run directory of fusedres train (no "
                         "config.yaml in it)")
    saved = load_yaml(path, "RUN") if path.is_file() else dict(state["config"])
    try:
        return merge_saved(dict(DEFAULTS), set(), saved)
    except UsageError as e:
        raise UsageError(f"RUN: the saved configuration {str(path)!r} is invalid ({e})") from None


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's configuration (its config.yaml over the trainer's defaults), without
    loading a checkpoint."""
    path = Path(run_dir)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise UsageError(f"RUN: {str(path)!r} {what} (expected the directory of a fusedres "
                         "train run)")
    return _config(path, None)


def state_mismatch(reference: dict[str, Tensor], state: dict[str, Tensor]) -> str | None:
    """How the weights ``state`` differ from a model's ``reference`` state dict, in full (the
    counts and the first key of each kind), or None when every key and shape matches."""
    missing = sorted(set(reference) - set(state))
    extra = sorted(set(state) - set(reference))
    bad = [k for k in reference
           if k in state and tuple(state[k].shape) != tuple(reference[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) missing, first {missing[0]}")
    if extra:
        parts.append(f"{len(extra)} unexpected key(s), first {extra[0]}")
    if bad:
        parts.append(f"{len(bad)} shape(s) differ, first {bad[0]}: "
                     f"{tuple(state[bad[0]].shape)} in the checkpoint, "
                     f"{tuple(reference[bad[0]].shape)} in the model")
    return "; ".join(parts) or None


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``n`` inside the block (nothing when None)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Evaluation:
    loss: float     # mean cross-entropy
    error: float    # fraction misclassified
    n: int          # images


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
             amp_dtype: torch.dtype | None = None) -> Evaluation:
    """Loss and error of ``model`` (as it is: call ``model.eval()`` for running statistics) over
    ``batches``, summed as the trainer's evaluation sums them."""
    loss_sum, correct, n, device = None, None, 0, None
    for x, y in batches:
        if device is None:
            device = x.device
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            correct = torch.zeros((), dtype=torch.int64, device=device)
        ctx = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            out = model(x)
        loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double()
        correct += (out.argmax(1) == y).sum()
        n += len(y)
    if n == 0:
        raise ValueError("evaluate: no batches")
    return Evaluation(loss_sum.item() / n, 1.0 - correct.item() / n, n)


@dataclass
class LoadedRun:
    """A run ready to evaluate. ``model`` is in eval mode on ``device`` with the checkpoint's
    weights; evaluate it inside ``fusedres.use_backend(run.backend)``."""
    directory: Path
    checkpoint: Path
    iteration: int
    cfg: dict[str, Any]
    model: nn.Module
    data: data_mod.Data
    device: torch.device
    backend: str
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        # The trainer's normalisation and test batches (one process's view of the whole set).
        self._batches = data_mod.Batches(self.data, 1, self.cfg["seed"], 0, False,
                                         channels_last=bool(self.cfg["channels_last"]))

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return _AMP[self.cfg["amp"]]

    @property
    def model_name(self) -> str:
        """The network and its variant (``fusedres.apps.train.naming.variant_label``)."""
        return variant_label(self.cfg)

    @property
    def label(self) -> str:
        return f"{self.model_name}; seed {self.cfg['seed']} ({self.directory.resolve().name})"

    def use_backend(self) -> contextlib.AbstractContextManager:
        return fusedres.use_backend(self.backend)

    def test_batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """The test set, normalised as the trainer evaluates it, in order."""
        return list(self._batches.eval_batches(batch_size))

    def train_batches(self, batch_size: int, limit: int | None = None
                      ) -> list[tuple[Tensor, Tensor]]:
        """The first ``limit`` (default all) training batches in the dataset's order, normalised
        and not augmented."""
        x, y = self.data.train_x, self.data.train_y
        starts = range(0, len(y), batch_size)
        if limit is not None:
            starts = starts[:limit]
        return [(self._batches.normalise(x[s:s + batch_size]), y[s:s + batch_size])
                for s in starts]

    def model_state(self, path: Path, flag: str) -> dict[str, Tensor]:
        """The model weights of checkpoint ``path``, checked to fit this run's model."""
        state = load_checkpoint(path, flag)["model"]
        why = state_mismatch(self.model.state_dict(), state)
        if why is not None:
            raise UsageError(f"{flag}: {str(path)!r} does not fit the run's model "
                             f"{self.model_name} ({why})")
        return state


def open_run(run: str | Path, checkpoint: str | Path | None = None, device: str = "auto",
             backend: str | None = None, data_dir: str | None = None,
             local_rank: int = 0, flag: str | None = None) -> LoadedRun:
    """Load RUN at ``checkpoint`` (default its latest) for evaluation on ``device``.

    ``backend``: fusedres backend for a fused model (default: the run's; when the run's cannot
    run here, ``auto`` with a note). ``data_dir``: where the dataset is, when not where the run
    found it. ``flag``: the option that named ``checkpoint``, for messages (--checkpoint)."""
    flag = flag or "--checkpoint"
    run_dir, path = locate(run, checkpoint, flag)
    if checkpoint is None:
        flag = "RUN"
    state = load_checkpoint(path, flag)
    cfg = _config(run_dir, state)
    dev = pick_device(device, local_rank)
    notes: list[str] = []
    name = backend or cfg["backend"]
    reason = fusedres.unavailable_reason(name, dev) if cfg["fused"] else None
    if reason is not None:
        if backend is not None:
            raise UsageError(f"--backend {name}: cannot run on {dev.type}: {reason}")
        notes.append(f"the run's backend {name} cannot run on {dev.type} ({reason}): using auto")
        name = "auto"
    data = data_mod.load(cfg["dataset"], data_dir or cfg["data_dir"], cfg["download"],
                         explicit_dir=data_dir is not None)
    model = build_model(cfg, data.image_shape[0], data.num_classes)
    why = state_mismatch(model.state_dict(), state["model"])
    if why is not None:  # load_state_dict's own message is many lines, cut it says nothing
        raise UsageError(f"{flag}: {str(path)!r} does not fit the run's model "
                         f"{variant_label(cfg)} ({why})")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UsageError(f"{flag}: {str(path)!r} does not fit the run's model "
                         f"{variant_label(cfg)} ({' '.join(str(e).split())})") from None
    model = model.to(dev)
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    model.eval()
    return LoadedRun(run_dir, path, int(state["iteration"]), cfg, model, data.to(dev), dev,
                     name, notes)


def rank_and_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (0, 1, 0 without it)."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))
