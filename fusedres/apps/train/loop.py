"""The training run: set-up (everything checked before anything is written), the loop,
checkpoints on a schedule and on SIGTERM/SIGINT, evaluation, the final report."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml

import fusedres
from fusedres import distributed as fdist
from fusedres import models, settings
from fusedres.memory import LiveTensorTracker, PlanError, SavedTensorCounter

from . import checkpoint as ckpt
from . import data as data_mod
from . import metrics as M
from . import provenance, resume_checks
from .config import UsageError, merge_saved, parse_bytes, resolve_channels_last
from .gradnorms import GradNormProbe
from .naming import variant_label
from .runlock import RunLock, RunLocked
from .schedule import LRSchedule
from .seeds import seed_python_and_numpy
from .step import (
    WARMUP_STEPS,
    GraphedStep,
    TrainStep,
    adamw,
    float_lr_state,
    lr_tensor,
    sgd,
    start_momentum,
    use_lr,
)

_AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Stopped(SystemExit):
    """The run ended at once by a signal (:meth:`Run._on_signal`): ``code`` is 128 + its
    number. A SystemExit, so that no ``except Exception`` on the way out takes it."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --------------------------------------------------------------------------- set-up

# Model arguments of the variants, by the trainer option that sets them.
_SHORTCUT_ARGS = {"shortcut_scale": "scale", "scale_branch": "scale_branch",
                  "gate_bias": "gate_bias", "shortcut_dropout": "shortcut_dropout"}
_VARIANT_FLAGS = {"unit": "--unit", "shortcut": "--shortcut", "norm": "--norm",
                  "drop_path_rate": "--drop-path-rate", "drop_path_mode": "--drop-path-mode",
                  "drop_path": "--drop-path-rate", "scale": "--shortcut-scale",
                  "scale_branch": "--scale-branch", "gate_bias": "--gate-bias",
                  "shortcut_dropout": "--shortcut-dropout"}


def _flagged(message: str) -> str | None:
    """A variant's model error ``"name: ..."`` as the trainer's ``"--flag: ..."``, else None."""
    name, sep, rest = message.partition(":")
    return f"{_VARIANT_FLAGS[name]}:{rest}" if sep and name in _VARIANT_FLAGS else None


def _variant_line(cfg: dict[str, Any]) -> str:
    """The banner's line for a model that is not the default He et al. 2016 network ('' if it
    is)."""
    parts = []
    if cfg["unit"] != "preact":
        parts.append(f"unit {cfg['unit']}")
    if cfg["shortcut"] != "identity":
        args = ", ".join(f"{arg} {cfg[opt]}" for opt, arg in _SHORTCUT_ARGS.items()
                         if cfg[opt] is not None)
        parts.append(f"shortcut {cfg['shortcut']}" + (f" ({args})" if args else ""))
    if cfg["norm"] != "batch":
        parts.append(f"norm {cfg['norm']}")
    if cfg["drop_path_rate"]:
        parts.append(f"stochastic depth {cfg['drop_path_rate']:g} (last unit; linear in depth, "
                     f"{cfg['drop_path_mode']} mode)")
    return "variant: " + "; ".join(parts) if parts else ""


def build_model(cfg: dict[str, Any], in_chans: int, num_classes: int) -> nn.Module:
    name = cfg["model"]
    kwargs = {"num_classes": num_classes, "fused": cfg["fused"], "in_chans": in_chans,
              "zero_init_last": cfg["zero_init_last"]}
    variant = {k: cfg[k] for k in ("unit", "shortcut", "norm", "drop_path_rate",
                                   "drop_path_mode")}
    for option, arg in _SHORTCUT_ARGS.items():
        if cfg[option] is not None:
            variant[arg] = cfg[option]
    kwargs.update(variant)
    if name == "preact_resnet":
        if cfg["depth"] is None:
            raise UsageError("--model preact_resnet: give the depth with --depth")
        kwargs.update(depth=cfg["depth"], variant=cfg["variant"] or "cifar")
        ctor = models.preact_resnet
    elif name in models.MODELS:
        ctor = models.MODELS[name]
        if cfg["depth"] is not None:
            raise UsageError(f"--depth: only with --model preact_resnet ({name} fixes it)")
        if cfg["variant"] is not None:
            raise UsageError(f"--variant: only with --model preact_resnet ({name} fixes it)")
    else:
        known = ", ".join(["preact_resnet"] + sorted(k for k in models.MODELS
                                                     if k != "preact_resnet"))
        raise UsageError(f"--model: unknown model {name!r}; known: {known}")
    try:
        return ctor(**kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        flagged = _flagged(_first_line(e))
        if flagged is not None:
            raise UsageError(flagged) from None
        what = f"--depth {cfg['depth']}" if name == "preact_resnet" else f"--model {name}"
        raise UsageError(f"{what}: {_first_line(e)}") from None


def _device(cfg, local_rank: int) -> torch.device:
    if cfg["device"] == "cpu" or (cfg["device"] == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device("cuda", local_rank)


def _check_cuda_graphs(cfg, device: torch.device, world: int) -> None:
    """``--cuda-graphs`` needs a CUDA device and one process (the options it cannot capture are
    refused with the configuration: ``config._check_cuda_graphs``)."""
    if not cfg["cuda_graphs"]:
        return
    if device.type != "cuda":
        why = ("--device is cpu" if cfg["device"] == "cpu"
               else "none is available here (torch.cuda.is_available() is False)")
        raise UsageError(f"--cuda-graphs: needs a CUDA device; {why}")
    if world > 1:
        raise UsageError(f"--cuda-graphs: one process only, this run has {world} (torchrun): "
                         "DistributedDataParallel's gradient all-reduce is not captured here")


def _check_backend(cfg, device: torch.device) -> None:
    if not cfg["fused"]:
        return
    reason = fusedres.unavailable_reason(cfg["backend"], device)
    if reason is not None:
        raise UsageError(f"--backend {cfg['backend']}: cannot run on {device.type}: {reason}")


# The training recipe's options, recorded together in summary.json.
RECIPE_KEYS = ("optimizer", "lr", "momentum", "nesterov", "betas", "weight_decay",
               "bn_weight_decay", "bias_weight_decay", "schedule", "warmup_iters", "warmup_lr",
               "milestones", "lr_decay", "min_lr", "poly_power", "label_smoothing", "ema_decay",
               "accum_steps", "mixup_alpha", "cutmix_alpha")

# The layers whose parameters are a normalisation's scale and shift.
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
          nn.modules.instancenorm._InstanceNorm)


def _param_groups(model: nn.Module, cfg) -> list[dict[str, Any]]:
    """Weight decay on every parameter but the normalisation layers' (unless
    --bn-weight-decay) and the other layers' biases (unless --bias-weight-decay): decay pulls
    a weight towards 0 to limit the function's scale, which a norm's scale and shift and a
    bias do not set (Goyal et al. 2017 and timm's recipes leave them undecayed)."""
    norm_params, biases = set(), set()
    for m in model.modules():
        if isinstance(m, _NORMS):
            norm_params.update(id(p) for p in m.parameters(recurse=False))
        else:
            biases.update(id(p) for n, p in m.named_parameters(recurse=False) if n == "bias")
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        keep = ((id(p) in norm_params and not cfg["bn_weight_decay"])
                or (id(p) in biases and not cfg["bias_weight_decay"]))
        (no_decay if keep else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _state_like_params(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer's per-parameter tensors of a parameter's shape (SGD's momentum) that
    parameter's strides. ``load_state_dict`` keeps a checkpoint's strides: resumed in the other
    layout (channels_last vs NCHW) they would differ from the parameters', which is correct but
    can keep the fused/foreach update off its fast path. Values are copied exactly."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, value in state.items():
                if (torch.is_tensor(value) and value.shape == p.shape
                        and value.stride() != p.stride()):
                    state[name] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def milestones(cfg, max_iters: int) -> list[int]:
    return sorted(int(round(m * max_iters)) if m < 1 else int(m) for m in cfg["milestones"])


def _optimizer(param_groups: list[dict[str, Any]], lr: torch.Tensor, cfg
               ) -> torch.optim.Optimizer:
    """--optimizer: torch's SGD or AdamW, fused, reading the device learning rate ``lr``."""
    if cfg["optimizer"] == "adamw":
        return adamw(param_groups, lr, cfg["betas"], capturable=cfg["cuda_graphs"])
    return sgd(param_groups, lr, cfg["momentum"], cfg["nesterov"])


def _mixer(cfg, num_classes: int):
    """--mixup-alpha / --cutmix-alpha: torchvision.transforms.v2's MixUp and CutMix of a batch
    and its labels (soft targets out), one of the two at random per batch when both are on
    (as torchvision's classification reference does); None when both are 0. They draw from
    torch's global generator, which checkpoints save."""
    from torchvision.transforms import v2

    mixers = []
    if cfg["mixup_alpha"]:
        mixers.append(v2.MixUp(alpha=cfg["mixup_alpha"], num_classes=num_classes))
    if cfg["cutmix_alpha"]:
        mixers.append(v2.CutMix(alpha=cfg["cutmix_alpha"], num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


# --ema-decay's warm-up: the decay at an update after t earlier ones is
# min(decay, 1 - (1 + t) ** -EMA_WARMUP_POWER), the rule timm's ModelEmaV3 and diffusers' EMA
# use (2/3, their default). A fixed decay of 0.999 averages over ~1000 steps from the first
# weights on: in a short run the EMA is mostly the untrained network, and evaluating it reports
# that network. With the warm-up the average spans about (1 + t) ** (2/3) recent steps until
# that reaches 1 / (1 - decay).
EMA_WARMUP_POWER = 2 / 3


def ema_decay_at(decay: float, updates: int) -> float:
    """--ema-decay ``decay``'s value at the update that follows ``updates`` earlier ones."""
    return min(decay, 1.0 - (1.0 + updates) ** -EMA_WARMUP_POWER)


def _ema(model: nn.Module, decay: float) -> torch.optim.swa_utils.AveragedModel:
    """--ema-decay: torch's AveragedModel of ``model`` with the exponential moving average
    (weights and buffers: BatchNorm's running statistics are averaged too, as timm's EMA
    does). Its first ``update_parameters`` copies the model; each later one moves the
    average by 1 - :func:`ema_decay_at` towards it (floating tensors by lerp, others rounded
    toward zero), the warm-up's count being AveragedModel's ``n_averaged``, which checkpoints
    carry."""
    from torch.optim.swa_utils import AveragedModel

    def update(averaged: list[torch.Tensor], current: list[torch.Tensor],
               n_averaged: torch.Tensor) -> None:
        # AveragedModel calls this per device and dtype; the count is read on the host (the
        # update already reads it there once a step).
        d = ema_decay_at(decay, int(n_averaged))
        if averaged[0].is_floating_point() or averaged[0].is_complex():
            torch._foreach_lerp_(averaged, current, 1.0 - d)
            return
        for a, c in zip(averaged, current):
            a.copy_(a * d + c * (1.0 - d))

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def crop_average(model: nn.Module, x: torch.Tensor,
                 autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
    """Several crops per image, x (B, crops, C, H, W): the log of the mean over the crops of
    ``model``'s softmax, (B, classes) float32. Krizhevsky et al.'s 10-crop testing averages
    the softmax outputs (not the logits); the log is taken stably, as a logsumexp of
    log-softmaxes. The model as it is: call in eval mode, without grad."""
    b, k = x.shape[:2]
    with autocast if autocast is not None else contextlib.nullcontext():
        out = model(x.flatten(0, 1))
    log_p = out.float().log_softmax(1).view(b, k, -1)
    return torch.logsumexp(log_p, 1) - math.log(k)


AUTO_MARGIN_FRACTION, AUTO_MARGIN_BYTES = 0.05, 256 * 2 ** 20


def auto_budget(device: torch.device) -> int:
    """``--memory-budget auto``: the free GPU memory (on CPU, MemAvailable) minus a margin of
    5% of the device's total + 256 MiB: headroom for what the budget does not bound (cuDNN's
    workspaces, the caching allocator's reserved but unallocated blocks; on a GPU the plan
    states both, ``plan.cuda``; the CUDA context is already out of the free figure)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, value = line.split(":", 1)
                    info[key] = int(value.split()[0]) * 1024
        except (OSError, ValueError):
            raise UsageError("--memory-budget auto: cannot read the available memory "
                             "(/proc/meminfo); give a size such as 4GiB") from None
        free, total = info.get("MemAvailable", 0), info.get("MemTotal", 0)
    budget = int(free - AUTO_MARGIN_FRACTION * total - AUTO_MARGIN_BYTES)
    if budget <= 0:
        raise UsageError(f"--memory-budget auto: only {free / 2 ** 30:.2f} GiB free on "
                         f"{device.type}, less than the margin")
    return budget


# --------------------------------------------------------------------------- the run

def _rss_figures(run) -> tuple[int | None, int | None, int | None, int | None]:
    """Of ``run`` (a :class:`Run`) on CPU under a budget: (the peak resident set above the
    baseline, its rise over the pre-step resident set, the figure the budget bounds: the peak
    allocated memory above the baseline's, or the resident set's where Linux does not tell the
    two apart, the mapped files' pages added since the baseline or None); all None
    elsewhere."""
    if run.device.type != "cpu" or run.rss_baseline is None:
        return None, None, None, None
    peaks = run.rss_peaks
    if peaks is None:
        peak = fusedres.memory.peak_rss_bytes()
        rss = max(peak, run.rss_setup_peak or 0) - run.rss_baseline
        steps = None if run.rss_pre_step is None else peak - run.rss_pre_step
        return rss, steps, rss, None
    peaks.mark()
    rss = peaks.peak_total - run.rss_baseline
    steps = (None if run.rss_pre_step is None
             else max(peaks.window_peaks[1:], default=run.rss_pre_step) - run.rss_pre_step)
    return rss, steps, peaks.allocated_above_baseline, peaks.file_above_baseline


class Run:
    def __init__(self, cfg: dict[str, Any], explicit: set[str],
                 scope: contextlib.ExitStack | None = None):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.stop_signal: int | None = None
        self._graceful = False  # see _on_signal
        self._pid = os.getpid()
        self.scope = scope if scope is not None else contextlib.ExitStack()
        self._catch_signals()
        self._setup(cfg, explicit)

    # ------------------------------------------------------------------ set-up
    def _resolve_resume(self, cfg, explicit):
        cfg, out, state = self._resume_state(cfg, explicit)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
        parent = next((p for p in (out, *out.parents) if p.exists()), Path("."))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"--out: {str(parent)!r} is not writable")
        return cfg, out, state

    def _resume_state(self, cfg, explicit):
        out = Path(cfg["out"] or f"runs/{cfg['dataset']}-{cfg['model']}")
        resume, state = cfg["resume"], None
        self.resume_path = None
        if resume is None:
            if ckpt.list_checkpoints(out):
                raise UsageError(f"--out: {str(out)!r} already holds a run (checkpoints); "
                                 "continue it with --resume, or choose another --out")
            return cfg, out, None
        if resume in ("latest", "auto"):
            found = ckpt.list_checkpoints(out)
            if not found:
                if resume == "auto":
                    return cfg, out, None
                raise UsageError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}")
            path, state = self._newest_intact(found)
        else:
            path = Path(resume)
            if "out" not in explicit:
                out = path.parent.parent if not path.is_dir() else path
            if path.is_dir() and ckpt.list_checkpoints(path):
                path, state = self._newest_intact(ckpt.list_checkpoints(path))
            else:
                path = path / "checkpoints" if path.is_dir() else path
                state = self._load_named(path)
        self.resume_path = path
        cfg = merge_saved(cfg, explicit, state["config"])
        return cfg, out, state

    def _newest_intact(self, found: list[Path]) -> tuple[Path, dict[str, Any]]:
        """The newest of the checkpoints ``found`` that loads (its digest and fields checked:
        ckpt.load). Each newer one refused is said on one warning line naming it and why;
        none intact is a UsageError naming the newest's fault."""
        refused = []
        for path in reversed(found):
            try:
                state = ckpt.load(path)
            except ckpt.CheckpointError as e:
                refused.append(str(e))
                continue
            if self.rank == 0:
                for why in refused:
                    print(f"fusedres train: warning: {why}; resuming from the newest intact "
                          f"checkpoint, {str(path)!r}", file=sys.stderr)
            return path, state
        more = f" ({len(found) - 1} older refused too)" if len(found) > 1 else ""
        raise UsageError(f"--resume: no intact checkpoint: {refused[0]}{more}")

    @staticmethod
    def _load_named(path: Path) -> dict[str, Any]:
        """``--resume FILE``: that checkpoint, or a UsageError naming the newest intact one
        beside it."""
        try:
            return ckpt.load(path)
        except ckpt.CheckpointError as e:
            msg = str(e)
            good = [p for p in ckpt.list_checkpoints(path.parent.parent) if p != path]
            for prev in reversed(good):
                try:
                    ckpt.load(prev)
                except ckpt.CheckpointError:
                    continue
                msg += f"; the previous checkpoint {str(prev)!r} is intact: --resume {prev}"
                break
            raise UsageError(msg) from None

    def _setup(self, cfg, explicit):
        cfg, out, state = self._resolve_resume(cfg, explicit)
        self.cfg, self.out, self.resume_state = cfg, out, state
        self._setup_process(cfg, explicit)
        self._open_data(cfg, explicit)
        model = self._build_model(cfg)
        model = self._build_optimizer(model, cfg)
        if state is not None:
            self._restore(state)
        self._build_step(model, cfg)
        self._open_run(cfg, state)

    def _setup_process(self, cfg, explicit) -> None:
        """Threads, the device, the backend and glibc's allocator, before anything allocates."""
        if cfg["threads"]:
            self.scope.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(cfg["threads"])
        self.device = _device(cfg, self.local_rank)
        _check_cuda_graphs(cfg, self.device, self.world)
        _check_backend(cfg, self.device)
        self.scope.enter_context(fusedres.use_backend(cfg["backend"]))
        # On CPU a budget bounds the process only if freed blocks leave it: set glibc's
        # thresholds before the data, the model and the optimizer allocate.
        self.allocator = None
        self.rss_baseline = None
        self.rss_peaks = None
        if self.device.type == "cpu" and cfg["memory_budget"] is not None:
            if settings.get("FUSEDRES_RELEASE_FREED_MEMORY"):
                applied, self.allocator = fusedres.memory.release_freed_memory()
                if not applied:
                    print(f"fusedres train: note: freed memory is not returned to the system: "
                          f"{self.allocator}", file=sys.stderr)
            # What the budget counts from: the memory the process has allocated with torch and
            # fusedres imported, before the data and the model exist (the plan adds to it every
            # tensor, the kernel workspace and the allocator's slack). The peak is reset to it
            # where Linux allows, so that the report's peak is this run's, not the imports'.
            try:
                self.rss_peaks = fusedres.memory.ResidentPeaks()
            except OSError:  # no RssAnon/RssFile: the whole resident set is measured
                fusedres.memory.reset_peak_rss()
            self.rss_baseline = fusedres.memory.rss_bytes()
        elif self.device.type == "cpu":
            # No budget: glibc keeps freed blocks for the next step instead of unmapping them
            # and faulting them in again (fusedres.memory.keep_freed_memory).
            applied, why = fusedres.memory.keep_freed_memory()
            self.allocator = why if applied else None
        if cfg["amp"] == "fp16" and self.device.type == "cpu" and cfg["compile"]:
            raise UsageError("--amp fp16 with --compile: not supported on CPU; use --amp bf16")
        self._resolve_layout(explicit)

    def _open_data(self, cfg, explicit) -> None:
        """The data, its batches and the schedule that follows from their count."""
        # In memory on the device, or streamed from disk (--dataset imagefolder).
        self.data, self.batches = data_mod.open_data(cfg, "data_dir" in explicit, self.device,
                                                     self.rank, self.world)
        # What loading the data added to the process: its tensors, and what the loader left
        # (scikit-learn's modules for digits); the plan counts the larger as resident. The
        # memory allocated, where Linux tells it apart from the pages of mapped files.
        self.data_rss = (None if self.rss_baseline is None
                         else self.rss_peaks.allocated_now() if self.rss_peaks is not None
                         else fusedres.memory.rss_bytes() - self.rss_baseline)
        ipe = self.batches.iters_per_epoch
        if self.batches.local % cfg["accum_steps"]:
            raise UsageError(f"--accum-steps {cfg['accum_steps']}: this process's batch of "
                             f"{self.batches.local} (--batch-size {cfg['batch_size']}"
                             + (f" over {self.world} processes" if self.world > 1 else "")
                             + ") does not split into equal micro-batches")
        self.max_iters = cfg["epochs"] * ipe if cfg["epochs"] else cfg["max_iters"]
        self.milestones = milestones(cfg, self.max_iters)
        self.schedule = LRSchedule(cfg, self.max_iters, self.milestones)
        self.mix = _mixer(cfg, self.data.num_classes)

    def _build_model(self, cfg) -> nn.Module:
        """The seeded model and its memory plan (the checkpoint's weights: :meth:`_restore`)."""
        torch.manual_seed(cfg["seed"])
        seed_python_and_numpy(cfg["seed"])
        in_chans = self.data.image_shape[0]
        model = build_model(cfg, in_chans, self.data.num_classes).to(self.device)
        if cfg["channels_last"]:
            model = model.to(memory_format=torch.channels_last)
        self.plan_summary = None
        self.memory_budget = None
        self.live: LiveTensorTracker | None = None
        self.device_warning = None
        if cfg["memory_budget"] is not None or cfg["activation_budget"] is not None:
            self.plan_summary = self._plan(model)
            if self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                self.device_warning = self._device_fit(total)
        self.model = model  # unwrapped: what checkpoints hold
        self.parameters = sum(p.numel() for p in model.parameters())
        return model

    def _build_optimizer(self, model: nn.Module, cfg) -> nn.Module:
        """--sync-bn, the optimizer, EMA and scaler (restored on --resume by
        :meth:`_restore`); returns the model the step trains (SyncBatchNorm converted)."""
        if self.world > 1 and cfg["sync_bn"]:
            # On GPUs torch's own SyncBatchNorm serves the plain BatchNorms (the fused ones are
            # routed to fusedres.distributed either way); it does not run on CPU tensors.
            model = (nn.SyncBatchNorm.convert_sync_batchnorm(model)
                     if self.device.type == "cuda" else fdist.convert_sync_batchnorm(model))
        # The learning rate lives on the device and is filled in place each step (the step
        # reads no value on the host: fusedres.apps.train.step).
        self.lr = lr_tensor(cfg["lr"], self.device)
        self.optimizer = _optimizer(_param_groups(model, cfg), self.lr, cfg)
        # --ema-decay: updated after each step, outside the step (and its CUDA graph):
        # AveragedModel's update reads its count on the host.
        # Of the unwrapped model (self.model: what checkpoints hold, before --sync-bn).
        self.ema = (_ema(self.model, cfg["ema_decay"]) if cfg["ema_decay"] is not None
                    else None)
        self.amp_dtype = _AMP[cfg["amp"]]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg["amp"] == "fp16")
        return model

    def _restore(self, state) -> None:
        """--resume: the checkpoint's fields checked against what the run built (each tensor
        against the model's, the optimizer state against its parameters, the scheduler's and
        the scaler's against theirs, the iteration within the run: resume_checks), then loaded.
        Nothing is loaded unless all of it fits; a misfit is one UsageError naming the file and
        the field."""
        try:
            self._check_restorable(state)
        except resume_checks.FieldError as e:
            diverged = (state.get("accum") or {}).get("diverged_at")
            hint = (f" (the run diverged at iteration {diverged})"
                    if diverged is not None and "not finite" in str(e) else "")
            raise UsageError(f"--resume: checkpoint {str(self.resume_path)!r} does not fit this "
                             f"run (--model {self.cfg['model']}): {e}{hint}") from None
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            use_lr(self.optimizer, self.lr)
            start_momentum(self.optimizer)  # a parameter that had no gradient yet
            _state_like_params(self.optimizer)
            if state.get("scaler") and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None:
                self.ema.load_state_dict(state["ema"])
            if "lr_scheduler" in state:
                self.schedule.load_state_dict(state["lr_scheduler"])
            else:  # a checkpoint of an older fusedres: run the schedule up to it
                for _ in range(state["iteration"]):
                    self.schedule.step()
        except (ValueError, KeyError, RuntimeError, TypeError) as e:  # what the checks missed
            raise UsageError(f"--resume: checkpoint {str(self.resume_path)!r} does not fit this "
                             f"run (--model {self.cfg['model']}): {_first_line(e)}") from None

    def _check_restorable(self, state) -> None:
        rc = resume_checks
        for key in ("metrics", "rng"):
            if key not in state:
                raise rc.FieldError(f"{key}: expected in a checkpoint of fusedres train, found "
                                    "none")
        rc.check_iteration(state["iteration"], self.max_iters)
        rc.check_tensors(state["model"], self.model.state_dict(), "model")
        names = {id(p): n for n, p in self.model.named_parameters()}
        rc.check_optimizer(state["optimizer"], self.optimizer, names)
        if self.ema is not None:
            if "ema" not in state:
                raise rc.FieldError("ema: the checkpoint holds no EMA weights (its run had no "
                                    "--ema-decay)")
            rc.check_tensors(state["ema"], self.ema.state_dict(), "ema")
        if state.get("scaler") and self.scaler.is_enabled():
            live = self.scaler.state_dict()
            missing = [k for k in live if k not in state["scaler"]]
            if missing:
                raise rc.FieldError(f"scaler: expected {', '.join(missing)}, found none")
            rc.check_like(state["scaler"], live, "scaler")
        if "lr_scheduler" in state:
            saved = state["lr_scheduler"]["scheduler"]
            rc.check_like(saved, self.schedule.scheduler.state_dict(),
                          "lr_scheduler['scheduler']")
            # The scheduler steps once an iteration: its count is the checkpoint's iteration.
            if saved.get("last_epoch", state["iteration"]) != state["iteration"]:
                raise rc.FieldError(f"lr_scheduler['scheduler']['last_epoch']: expected "
                                    f"{state['iteration']} (the checkpoint's iteration), got "
                                    f"{saved['last_epoch']}")

    def _build_step(self, model: nn.Module, cfg) -> None:
        """The training step: DDP, torch.compile and CUDA graphs around ``model``."""
        self.saved_bytes = None
        if cfg["compile"] and cfg["amp"] == "none":
            # The first step's count (below) cannot see inside a compiled graph: count the
            # eager model on the meta device instead (the same count, nothing allocated).
            self.saved_bytes = self._saved_bytes_on_meta(model)
        train_model = model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if cfg["compile"]:
            mode = cfg["compile"]
            train_model = torch.compile(train_model, mode=None if mode == "default" else mode)
        self.train_model = train_model
        self.probe = None
        if cfg["log_grad_norms"]:
            try:
                self.probe = GradNormProbe(self.model)
            except ValueError as e:
                raise UsageError(f"--log-grad-norms: --model {cfg['model']} "
                                 f"{_first_line(e).partition(': ')[2]}") from None
        self.step = TrainStep(train_model, self.optimizer, self.scaler, self.amp_dtype,
                              self.device.type, mark_step=cfg["compile"] == "reduce-overhead",
                              label_smoothing=cfg["label_smoothing"],
                              accum_steps=cfg["accum_steps"], probe=self.probe)
        self.run_step = GraphedStep(self.step) if cfg["cuda_graphs"] else self.step
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    def _open_run(self, cfg, state) -> None:
        """Everything is checked: lock and write the run directory, restore the counters."""
        # From here on the run directory may be written.
        if self.world > 1:
            dist.barrier()
        self._lock_out()
        if self.rank == 0:
            stale = ckpt.remove_stale_temporaries(self.out)
            if stale:
                print(f"fusedres train: removed {len(stale)} temporary file(s) a stopped run "
                      f"left in {str(self.out)!r}", file=sys.stderr)
        self.iteration = state["iteration"] if state is not None else 0
        self.history = list(state["metrics"]) if state is not None else []
        self.accum = dict(state.get("accum", {})) if state is not None else {}
        if state is not None and self.saved_bytes is None:
            self.saved_bytes = state.get("saved_activation_bytes")
        self.elapsed = state.get("elapsed_s", 0.0) if state is not None else 0.0
        # The first iteration whose training loss was not finite (kept across resumes).
        self.diverged_at = self.accum.get("diverged_at")
        if state is not None:
            ckpt.set_rng_state(state["rng"])
        self.log = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_config()
            self.log = M.MetricsLog(self.out, cfg["log_format"], self.history,
                                    cfg["tensorboard"])
        self.last_saved = self.iteration if state is not None else -1
        if self.rank == 0:
            self._banner()

    def _lock_out(self) -> None:
        """Rank 0 (the one that writes) holds ``--out``'s lock until the run ends: released
        when ``self.scope`` closes, or by the kernel if the process dies. Every rank learns the
        outcome, so that a refusal ends them all with the same exit code 2."""
        error = None
        if self.rank == 0:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                lock = RunLock(self.out)
            except RunLocked as e:
                error = str(e)
            except OSError as e:
                error = f"--out: cannot lock {str(self.out)!r}: {e.strerror or e}"
            else:
                self.scope.callback(lock.release)
                # The checkpoint check in _resume_state ran before the lock: a run that started,
                # wrote and ended in between is seen here.
                if self.cfg["resume"] is None and ckpt.list_checkpoints(self.out):
                    error = (f"--out: {str(self.out)!r} already holds a run (checkpoints); "
                             "continue it with --resume, or choose another --out")
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise UsageError(error)

    RESUMED = "as the run it resumes: "

    def _resolve_layout(self, explicit) -> None:
        """channels_last or NCHW, and why (``self.layout``), before anything is built.

        The resolved value replaces ``auto`` in ``self.cfg``, so config.yaml and the
        checkpoints hold it: a resumed run keeps its layout unless this command line sets
        --channels-last (its checkpoint's ``layout`` says where the value came from)."""
        cfg, state = self.cfg, self.resume_state
        if state is not None and "channels_last" not in explicit \
                and cfg["channels_last"] != "auto":
            saved = state.get("layout") or {}  # absent in checkpoints of older versions
            on = cfg["channels_last"]
            origin = saved.get("origin", "set")
            reason = saved.get("reason", f"its config's channels_last: {str(on).lower()}")
            if not reason.startswith(self.RESUMED):
                reason = self.RESUMED + reason
        else:
            dtype = _AMP[cfg["amp"]] or torch.float32
            on, reason = resolve_channels_last(cfg["channels_last"], self.device, dtype)
            origin = "auto" if cfg["channels_last"] == "auto" else "set"
        cfg["channels_last"] = on
        self.layout = {"channels_last": on, "origin": origin, "reason": reason}

    def layout_line(self) -> str:
        """The banner's layout line: ``layout: channels_last (auto: ...)``."""
        name = "channels_last" if self.layout["channels_last"] else "NCHW"
        return f"layout: {name} ({self.layout['reason']})"

    def _banner(self) -> None:
        cfg, d = self.cfg, self.data
        backend = (fusedres.resolve_backend(self.device) if cfg["fused"] else "plain PyTorch")
        c, h, w = d.image_shape
        ipe = self.batches.iters_per_epoch
        lines = [
            f"model {cfg['model']}{'' if cfg['depth'] is None else ' depth ' + str(cfg['depth'])}"
            f" ({self.parameters / 1e6:.3f} M parameters, "
            f"{'fused' if cfg['fused'] else 'plain'} blocks, backend {backend})",
            f"data {d.name}: {d.num_train} train / {d.num_test} test images {c}x{h}x{w}; "
            f"{self.max_iters} iterations = {self.max_iters / ipe:.1f} epochs of {ipe}, "
            f"batch {cfg['batch_size']}"
            + (f" over {self.world} processes" if self.world > 1 else ""),
            f"device {self.device}, {torch.get_num_threads()} threads, amp {cfg['amp']}; "
            f"run directory {self.out}",
            self.layout_line(),
        ]
        left = d.num_train - ipe * cfg["batch_size"]
        if left:
            lines.append(f"each epoch drops its last partial batch: {left} of the {d.num_train} "
                         f"training images (a different random subset each epoch), so that "
                         f"every step has the batch's shape")
        if cfg["cuda_graphs"]:
            lines.append(f"CUDA graphs: the whole training step (forward, loss, backward, SGD "
                         f"step) captured after {WARMUP_STEPS} eager warm-up steps on a side "
                         f"stream, then replayed; evaluation eager")
        if cfg["compile"]:
            lines.append(f"torch.compile, mode {cfg['compile']}")
        lines.append(self.recipe_line())
        if self.batches.describe() is not None:
            lines.append(self.batches.describe())
        if self.resume_state is not None:
            lines.append(f"resumed at iteration {self.iteration}")
        variant = _variant_line(cfg)
        if variant:
            lines.insert(1, variant)
        if cfg["sync_bn"]:
            lines.append("BatchNorm statistics synchronised over all processes" if self.world > 1
                         else "--sync-bn: one process, nothing to synchronise")
        if self.plan_summary is not None:
            lines += str(self.plan_summary).splitlines()
        if self.device_warning is not None:
            lines.append(f"warning: {self.device_warning}")
        for line in lines:
            print(f"fusedres train: {line}", file=sys.stderr)

    def recipe_line(self) -> str:
        """The banner's line for the optimiser, the schedule and the regularisers."""
        cfg = self.cfg
        opt = (f"AdamW betas {cfg['betas'][0]:g} {cfg['betas'][1]:g}"
               if cfg["optimizer"] == "adamw"
               else f"SGD momentum {cfg['momentum']:g}" + (" nesterov" if cfg["nesterov"]
                                                            else ""))
        skip = [w for w, on in (("norms", not cfg["bn_weight_decay"]),
                                ("biases", not cfg["bias_weight_decay"])) if on]
        sched = {"step": f"step x{cfg['lr_decay']:g} at {self.milestones}",
                 "cosine": f"cosine to {cfg['min_lr']:g}",
                 "poly": f"poly power {cfg['poly_power']:g}"}[cfg["schedule"]]
        warm = ("" if cfg["warmup_lr"] is None or not cfg["warmup_iters"]
                else f" at {cfg['warmup_lr']:g}")
        line = (f"recipe: {opt}, lr {cfg['lr']:g}, {cfg['warmup_iters']} warm-up iterations"
                f"{warm} then {sched}; weight decay {cfg['weight_decay']:g}"
                + (f" (not on {' and '.join(skip)})" if skip else ""))
        if cfg["label_smoothing"]:
            line += f"; label smoothing {cfg['label_smoothing']:g}"
        if cfg["ema_decay"] is not None:
            line += f"; EMA decay {cfg['ema_decay']:g} (evaluated)"
        mix = [f"{name} alpha {cfg[key]:g}" for name, key in (("MixUp", "mixup_alpha"),
                                                               ("CutMix", "cutmix_alpha"))
               if cfg[key]]
        if mix:
            line += "; " + " or ".join(mix) + (" (one per batch at random)" if len(mix) > 1
                                               else "")
        if cfg["accum_steps"] > 1:
            line += (f"; gradients accumulated over {cfg['accum_steps']} micro-batches of "
                     f"{self.batches.local // cfg['accum_steps']}")
        return line

    def _device_fit(self, total_bytes: int) -> str | None:
        """On a GPU, before the first step: whether --memory-budget (or the plan's predicted
        max_memory_reserved, when larger) + cuDNN's workspace allowance + the CUDA context fit
        the device's ``total_bytes``; the warning naming the figures when they do not."""
        p = self.plan_summary
        if p is None or p.cuda is None:
            return None
        return fusedres.memory.device_fit_warning(p.cuda, self.memory_budget, total_bytes)

    def _data_bytes(self) -> int:
        """Bytes of the dataset this process keeps on the device (one count per storage)."""
        d = self.data
        tensors = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in d.resident_tensors()}
        return sum(tensors.values())

    def _resident_bytes(self) -> int:
        """What the plan counts as resident beside the step: the dataset's tensors; on CPU
        with --memory-budget, what loading it added to the resident set when that is more
        (the loader's imports, its freed buffers that stay mapped)."""
        return max(self._data_bytes(), self.data_rss or 0)

    def _plan(self, model):
        cfg = self.cfg
        budget, flag = None, "--activation-budget"
        if cfg["memory_budget"] is not None:
            flag = "--memory-budget"
            budget = (auto_budget(self.device) if cfg["memory_budget"] == "auto"
                      else parse_bytes(cfg["memory_budget"]))
        activation = (None if cfg["activation_budget"] is None
                      else parse_bytes(cfg["activation_budget"], "--activation-budget"))
        self.memory_budget = budget
        # One micro-batch's activations at a time under --accum-steps.
        shape = (self.batches.local // cfg["accum_steps"], *self.data.image_shape)
        # The trainer's optimizer, as the planner simulates it (class and hyperparameters).
        if cfg["optimizer"] == "adamw":
            spec = torch.optim.AdamW(_param_groups(model, cfg), lr=cfg["lr"],
                                     betas=tuple(cfg["betas"]))
        else:
            spec = torch.optim.SGD(_param_groups(model, cfg), lr=cfg["lr"],
                                   momentum=cfg["momentum"], nesterov=cfg["nesterov"])
        n_eval = min(cfg["eval_batch_size"], math.ceil(self.data.num_test / self.world))
        # Ten crops, or crops larger than the training one (imagefolder): the evaluation
        # forward as a batch of training-sized images (activations scale with the pixels).
        n_eval = math.ceil(n_eval * self.batches.eval_scale)
        try:
            # Under --amp the weights' half copies that autocast saves count too.
            # On CPU the budget bounds the process above its baseline (the allocator's slack
            # included; the plan sets glibc's thresholds, already set above).
            process = self.rss_baseline is not None and budget is not None
            return fusedres.memory.plan(
                model, shape, budget, dtype=self.amp_dtype_for_plan(),
                autocast=_AMP[cfg["amp"]] is not None, activation_budget=activation,
                optimizer=spec, eval_batch_size=n_eval,
                resident_bytes=self._resident_bytes() + self._ema_bytes(model),
                channels_last=cfg["channels_last"], process=process,
                baseline_bytes=self.rss_baseline if process else None,
                cuda_capability=(torch.cuda.get_device_capability(self.device)
                                 if self.device.type == "cuda" else (9, 0)))
        except PlanError as e:
            hint = ("; or lower --eval-batch-size" if "eval forward is the peak" in str(e)
                    else "")
            raise UsageError(f"{flag} {cfg[flag[2:].replace('-', '_')]}: {_first_line(e)}"
                             f"{hint}") from None
        except (ValueError, RuntimeError, MemoryError) as e:
            raise UsageError(f"{flag} {cfg[flag[2:].replace('-', '_')]}: "
                             f"{_first_line(e)}") from None

    def _ema_bytes(self, model: nn.Module) -> int:
        """--ema-decay: the average's copy of the weights and buffers, resident beside the
        step (0 without)."""
        if self.cfg["ema_decay"] is None:
            return 0
        return sum(t.numel() * t.element_size()
                   for t in (*model.parameters(), *model.buffers()))

    def _saved_bytes_on_meta(self, model: nn.Module) -> int | None:
        import copy

        try:
            meta = copy.deepcopy(model).to("meta")
            n = self.batches.local // self.cfg["accum_steps"]  # one micro-batch's forward
            x = torch.empty((n, *self.data.image_shape), device="meta")
            y = torch.zeros(n, dtype=torch.int64, device="meta")
            with SavedTensorCounter(exclude=meta) as counter:
                F.cross_entropy(meta(x), y)
            return counter.total_bytes
        except Exception:  # a model that cannot run on meta: no count, no failure
            return None

    def amp_dtype_for_plan(self):
        return _AMP[self.cfg["amp"]] or torch.float32

    def _write_config(self) -> None:
        # A file --config reads back: options only, the file the run was given a comment.
        resolved = {k: v for k, v in self.cfg.items() if k != "config"}
        resolved["out"] = str(self.out)
        resolved["resume"] = None
        given = f"# --config {self.cfg['config']}\n" if self.cfg.get("config") else ""
        text = ("# fusedres train: the resolved configuration of this run\n"
                f"# {self.layout_line()}\n" + given + yaml.safe_dump(resolved, sort_keys=True)
                + "# what trained it (fusedres.apps.train.provenance; not an option)\n"
                + yaml.safe_dump({provenance.KEY: provenance.entries(
                    self.out, self.device, self.iteration)}, sort_keys=False))
        path = self.out / "config.yaml"
        with ckpt.writing(path):
            ckpt.write_atomically(path, lambda f: f.write(text.encode()))

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict[str, Any]:
        cfg = dict(self.cfg)
        cfg["out"] = str(self.out)
        cfg["resume"] = None
        return {
            "model": self.model.state_dict(),
            "optimizer": float_lr_state(self.optimizer),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "scheduler": {"iteration": self.iteration, "milestones": self.milestones,
                          "warmup_iters": self.cfg["warmup_iters"]},
            "lr_scheduler": self.schedule.state_dict(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            "sampler": {"seed": self.cfg["seed"],
                        "epoch": self.iteration // self.batches.iters_per_epoch,
                        "position": self.iteration % self.batches.iters_per_epoch},
            "rng": ckpt.rng_state(),
            "metrics": self.history,
            "accum": self.accum,
            "config": cfg,
            "layout": dict(self.layout),
            "saved_activation_bytes": self.saved_bytes,
            "elapsed_s": self.elapsed,
            "world_size": self.world,
        }

    def save_checkpoint(self) -> None:
        if self.iteration == self.last_saved:
            return
        if self.rank == 0:
            ckpt.save(self.out, self._state(), self.iteration, self.cfg["keep_checkpoints"])
        self.last_saved = self.iteration

    # ------------------------------------------------------------------ metrics
    def _record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.log is not None:
            self.log.add(record)

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test loss and error of the model, or of its EMA with --ema-decay."""
        model = self.model if self.ema is None else self.ema.module
        if self.rss_peaks is not None:  # the evaluation in a window of its own
            self.rss_peaks.mark()
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        n = 0
        for x, y in self.batches.eval_batches(self.cfg["eval_batch_size"]):
            if x.dim() == 5:  # (B, crops, C, H, W): --ten-crop
                log_probs = crop_average(model, x, self._autocast())
                loss_sum += F.nll_loss(log_probs, y, reduction="sum").double()
                correct += (log_probs.argmax(1) == y).sum()
            else:
                with self._autocast():
                    out = model(x)
                loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double()
                correct += (out.argmax(1) == y).sum()
            n += len(y)
        model.train(was_training)
        if self.rss_peaks is not None:
            self.rss_peaks.mark()
        loss_sum, correct, n = self._all_sum([loss_sum.item(), float(correct.item()), float(n)])
        return loss_sum / n, 1.0 - correct / n

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ------------------------------------------------------------------ signals
    def _catch_signals(self) -> None:
        """SIGTERM and SIGINT go to :meth:`_on_signal` from the start of the set-up until the
        run's scope closes (fusedres train's main: after the last file is written), so that
        the exit code is 128 + the signal's number whenever one comes, however many. Python
        sets handlers in the main thread only (elsewhere a signal keeps its handler)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)

        self.scope.callback(restore)

    def _on_signal(self, signum, frame):
        """The first signal while the run trains (:meth:`train`) asks the loop to stop: it
        checkpoints at the end of the iteration and the run returns 128 + signal. Any other one
        (a second, or one during the set-up, before a step can be saved) ends the run at once:
        :class:`Stopped`, whose temporary files are removed on the way out (write_atomically)
        or by the next start."""
        if os.getpid() != self._pid:
            # A process forked from the run (a DataLoader worker) inherits the handler: it goes on
            # and ends with the run, which stops its workers itself.
            return
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
        if not (first and self._graceful):
            raise Stopped(128 + signum)

    def _stop_requested(self) -> bool:
        flag = 0 if self.stop_signal is None else int(self.stop_signal)
        if self.world > 1:
            t = torch.tensor([flag], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
            if flag and self.stop_signal is None:
                self.stop_signal = flag
        return flag != 0

    # ------------------------------------------------------------------ loop
    def _memory_tracker(self) -> contextlib.AbstractContextManager:
        """On CPU, with a plan to check, the live-tensor tracker over the run (the figure the
        plan predicts); on a GPU the CUDA allocator's own peak serves."""
        if (self.plan_summary is None or self.device.type != "cpu" or self.world > 1
                or self.cfg["compile"]):
            return contextlib.nullcontext()
        self.live = LiveTensorTracker()
        return self.live

    def _rss_pre_step(self) -> None:
        """On CPU with --memory-budget: the resident set once the data, the model and the
        optimizer are built, before the first step, and the peak until then. The peak is
        reset to it where Linux allows, so that the report also gives the rise over the steps
        (else the peak is the process's lifetime one and that figure an upper bound)."""
        self.rss_pre_step, self.rss_setup_peak, self.rss_peak_since_pre_step = None, None, False
        if self.device.type == "cpu" and self.rss_baseline is not None:
            if self.rss_peaks is not None:  # the set-up's window; each step then has its own
                self.rss_peaks.mark()
                self.rss_setup_peak = self.rss_peaks.peak_total
                self.rss_peak_since_pre_step = self.rss_peaks.resettable
            else:
                self.rss_setup_peak = fusedres.memory.peak_rss_bytes()
                self.rss_peak_since_pre_step = fusedres.memory.reset_peak_rss()
            self.rss_pre_step = fusedres.memory.rss_bytes()

    def train(self) -> int:
        """Train to the end (0) or to a stop (128 + the signal's number: also when the signal
        came after the last iteration, as the finish was written)."""
        self._rss_pre_step()
        self._graceful = True
        try:
            with self._memory_tracker():
                if self.live is not None:
                    self.live.count(self.model, self.optimizer, *self.data.resident_tensors())
                code = self._loop()
        finally:
            self.batches.close()
        if code == 0:
            self._finish()
        if self.log is not None:
            self.log.close()
        return 128 + int(self.stop_signal) if self.stop_signal is not None else code

    def mixed(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch through MixUp/CutMix, in the batch's memory layout (their roll makes a
        contiguous copy)."""
        fmt = (torch.channels_last if self.cfg["channels_last"] else torch.contiguous_format)
        x, y = self.mix(x, y)
        return x.contiguous(memory_format=fmt), y

    def _train_step(self, x, y, lr: float):
        """One step at learning rate ``lr``: (loss, correct) as device tensors."""
        if self.rss_peaks is not None:  # a window a step: fusedres.memory.ResidentPeaks
            self.rss_peaks.mark()
        self.lr.fill_(lr)  # in place: a kernel on the device's stream, no host read
        measure = self.saved_bytes is None and not self.cfg["compile"]
        counter = SavedTensorCounter(exclude=self.model) if measure else None
        loss, correct = self.run_step(x, y, counter)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        if measure:
            self.saved_bytes = self._all_sum([float(counter.total_bytes)])[0] / self.world
            self.saved_bytes = int(self.saved_bytes)
        return loss, correct

    def _loop(self) -> int:
        cfg, ipe = self.cfg, self.batches.iters_per_epoch
        n_epochs = math.ceil(self.max_iters / ipe)
        show = cfg["progress"] and self.rank == 0
        self.train_model.train()
        dev = self.device
        a = self.accum
        ep_loss = torch.tensor(a.get("ep_loss", 0.0), dtype=torch.float64, device=dev)
        ep_correct = torch.tensor(a.get("ep_correct", 0), dtype=torch.int64, device=dev)
        ep_seen, ep_time = a.get("ep_seen", 0), a.get("ep_time", 0.0)
        # The window of the next record: its sums, and the time of the part a stop cut short
        # (restored from the checkpoint: :meth:`_stop_between_records`; its sums are over every
        # process, so rank 0 alone takes them back).
        mine = a if self.rank == 0 else {}
        win = [torch.tensor(mine.get("win_loss", 0.0), dtype=torch.float64, device=dev),
               torch.tensor(mine.get("win_correct", 0), dtype=torch.int64, device=dev),
               mine.get("win_seen", 0)]
        win_time = a.get("win_time", 0.0)
        local = self.batches.local

        while self.iteration < self.max_iters:
            epoch = self.iteration // ipe
            bar = None
            if show:
                from tqdm import tqdm
                bar = tqdm(total=min(ipe, self.max_iters - epoch * ipe),
                           initial=self.iteration - epoch * ipe, file=sys.stderr,
                           desc=f"epoch {epoch + 1}/{n_epochs}", dynamic_ncols=True,
                           leave=True)
            t0 = time.perf_counter()
            while self.iteration < self.max_iters and self.iteration // ipe == epoch:
                it = self.iteration
                lr = self.schedule.lr
                x, y = self.batches.train_batch(it)
                if self.mix is not None:
                    x, y = self.mixed(x, y)
                # --log-grad-norms: measured on the steps that end at a multiple of its interval
                # (a multiple of --log-every: read back below with the log record's sync).
                probed = (self.probe is not None
                          and (it + 1) % cfg["log_grad_norms"] == 0)
                if probed:
                    self.probe.arm(self.scaler)
                loss, correct = self._train_step(x, y, lr)
                self.schedule.step()
                win[0] += loss.double() * local
                win[1] += correct
                win[2] += local
                self.iteration += 1
                if bar is not None:
                    bar.update(1)
                epoch_end = self.iteration % ipe == 0 or self.iteration == self.max_iters
                boundary = (self.iteration % cfg["log_every"] == 0 or epoch_end
                            or self.iteration % cfg["checkpoint_every"] == 0
                            or (cfg["eval_every"] and self.iteration % cfg["eval_every"] == 0))
                stop = self._stop_requested()
                if not (boundary or stop):
                    continue
                if not boundary:
                    self._stop_between_records(win, win_time, t0)
                    return self._stopped(bar)
                # Close the timing window (the .item() calls synchronise the device).
                l_sum, c_sum, n = self._all_sum([win[0].item(), float(win[1].item()),
                                                 float(win[2])])
                now = time.perf_counter()
                dt = now - t0 + win_time
                ep_loss += win[0]
                ep_correct += win[1]
                ep_seen += win[2]
                ep_time += dt
                self.elapsed += now - t0
                win_time = 0.0
                win = [torch.zeros_like(win[0]), torch.zeros_like(win[1]), 0]
                rate = n / dt if dt > 0 else float("nan")
                mem = M.peak_memory_bytes(dev)
                record = {"kind": "train", "iteration": self.iteration, "epoch": epoch + 1,
                          "lr": lr, "loss": l_sum / n, "error": 1 - c_sum / n,
                          "images_per_s": rate, "peak_memory_bytes": mem,
                          "time_s": self.elapsed}
                self._record(record)
                if probed:
                    self._record({"kind": "grad_norms", "iteration": self.iteration,
                                  "epoch": epoch + 1, **self.probe.read()})
                if not math.isfinite(record["loss"]) and self.diverged_at is None:
                    self.diverged_at = self.iteration
                    if self.rank == 0:
                        print(f"\nfusedres train: warning: the training loss is "
                              f"{record['loss']} by iteration {self.iteration}: the run has "
                              "diverged (a lower --lr or a longer --warmup-iters may help); "
                              "training goes on to the end", file=sys.stderr)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}",
                                    acc=f"{100 * (1 - record['error']):.1f}%",
                                    img_s=f"{rate:.0f}", mem=M.format_bytes(mem), refresh=False)
                if epoch_end or (cfg["eval_every"] and self.iteration % cfg["eval_every"] == 0):
                    test_loss, test_err = self.evaluate()
                    self._record({"kind": "eval", "iteration": self.iteration,
                                  "epoch": epoch + 1, "test_loss": test_loss,
                                  "test_error": test_err})
                    if bar is not None:
                        bar.set_postfix(loss=f"{record['loss']:.3f}",
                                        acc=f"{100 * (1 - record['error']):.1f}%",
                                        test_acc=f"{100 * (1 - test_err):.1f}%",
                                        img_s=f"{rate:.0f}", mem=M.format_bytes(mem))
                if epoch_end:
                    tot = self._all_sum([ep_loss.item(), float(ep_correct.item()),
                                         float(ep_seen)])
                    self._record({"kind": "epoch", "iteration": self.iteration,
                                  "epoch": epoch + 1, "loss": tot[0] / tot[2],
                                  "error": 1 - tot[1] / tot[2], "test_loss": test_loss,
                                  "test_error": test_err, "epoch_time_s": ep_time,
                                  "images_per_s": tot[2] / ep_time if ep_time else None,
                                  "peak_memory_bytes": mem, "time_s": self.elapsed})
                    ep_loss.zero_()
                    ep_correct.zero_()
                    ep_seen, ep_time = 0, 0.0
                self.accum = {"ep_loss": ep_loss.item(), "ep_correct": int(ep_correct.item()),
                              "ep_seen": ep_seen, "ep_time": ep_time,
                              "diverged_at": self.diverged_at}
                if (epoch_end or stop or self.iteration % cfg["checkpoint_every"] == 0
                        or self.iteration == self.max_iters):
                    self.save_checkpoint()
                if stop:
                    return self._stopped(bar)
                t0 = time.perf_counter()
            if bar is not None:
                bar.close()
        return 0

    def _stop_between_records(self, win: list, win_time: float, t0: float) -> None:
        """A stop at an iteration that writes no record: the window so far (its sums over every
        process and its time) goes into the checkpoint (accum's ``win_*``) instead of a record
        of its own, so that the resumed run writes exactly the records an uninterrupted one
        does."""
        dt = time.perf_counter() - t0
        self.elapsed += dt
        l_sum, c_sum, n = self._all_sum([win[0].item(), float(win[1].item()), float(win[2])])
        self.accum = {**self.accum, "win_loss": l_sum, "win_correct": int(c_sum),
                      "win_seen": int(n), "win_time": win_time + dt}
        self.save_checkpoint()

    def _stopped(self, bar) -> int:
        """The checkpointed stop's end: the message, and 128 + the signal's number."""
        if bar is not None:
            bar.close()
        if self.rank == 0:
            name = signal.Signals(self.stop_signal).name
            print(f"fusedres train: {name} received: checkpoint saved at iteration "
                  f"{self.iteration} in {self.out}; continue with --resume", file=sys.stderr)
        return 128 + int(self.stop_signal)

    # ------------------------------------------------------------------ report
    def _memory_report(self) -> dict[str, Any]:
        """Predicted and measured peak side by side (stderr), a warning when the measured one
        exceeds --memory-budget; the figures for summary.json."""
        p = self.plan_summary
        if p is None or p.step is None:
            return {}
        cuda = self.device.type == "cuda"
        reserved = None
        if cuda:
            # The allocator replay's figure (cuBLAS's workspace included) when there is one.
            pred = p.cuda.allocated if p.cuda is not None else (p.cuda_step or p.step).peak_bytes
            measured, kind = torch.cuda.max_memory_allocated(self.device), "CUDA max allocated"
            reserved = torch.cuda.max_memory_reserved(self.device)
            pred_text = f"{M.format_bytes(pred)}"
        else:
            pred = p.step.peak_bytes
            measured = None if self.live is None else self.live.peak_bytes
            kind = "live tensors (LiveTensorTracker)"
            tensors = p.step.tensor_peak_bytes + p.step.resident
            pred_text = (f"{M.format_bytes(pred)} = tensors {M.format_bytes(tensors)} (the data at "
                         f"what loading it added to the resident set) + kernel workspace "
                         f"{M.format_bytes(p.step.workspace)} (not seen by the tracker)")
        lines = [f"memory: predicted peak {pred_text}; measured {M.format_bytes(measured)} "
                 f"({kind})"]
        if reserved is not None and p.cuda is not None:
            setting = ("expandable_segments:True" if p.cuda.expandable
                       else "default segments; expandable_segments:True is predicted "
                       + M.format_bytes(p.cuda.reserved_expandable))
            lines.append(f"memory: max_memory_reserved predicted {M.format_bytes(p.cuda.reserved)}"
                         f" ({setting}); measured {M.format_bytes(reserved)}")
        # On CPU the process: its peak above the baseline the budget counts from (torch and
        # fusedres imported, before the data and the model: Run._setup), beside the plan's
        # prediction of it (the step's peak + the allocator's slack). The budget bounds the
        # memory allocated; the resident set also holds pages of mapped files, reported beside
        # it (fusedres.memory.ResidentPeaks says why they are told apart).
        rss, rss_steps, bounded, files = _rss_figures(self)
        proc = p.process
        if rss is not None:
            text = "process memory above its baseline: "
            if proc is not None:
                text += (f"predicted {M.format_bytes(proc.above_baseline)} (the step "
                         f"{M.format_bytes(proc.tensors)} + allocator slack "
                         f"{M.format_bytes(proc.slack)}); ")
            text += (f"measured {M.format_bytes(bounded)} "
                     + ("allocated" if files is not None else "of resident set")
                     + f" (baseline {M.format_bytes(self.rss_baseline)} resident: torch and "
                       f"fusedres imported, before the data and the model)")
            if files is not None:
                text += (f"; peak RSS {M.format_bytes(rss)} above the baseline, with "
                         f"{M.format_bytes(files)} more of mapped files' pages (the libraries' "
                         f"code; not bounded)")
            if rss_steps is not None:
                text += (f"; the steps added {M.format_bytes(rss_steps)} to the resident set "
                         f"before the first"
                         + ("" if self.rss_peak_since_pre_step else " (an upper bound)"))
            lines.append(text)
        budget = self.memory_budget
        if budget is not None and measured is not None and measured > budget:
            lines.append(f"warning: the measured peak {M.format_bytes(measured)} exceeds "
                         f"--memory-budget {self.cfg['memory_budget']} "
                         f"({M.format_bytes(budget)})")
        if budget is not None and bounded is not None and bounded > budget:
            released = proc.released if proc is not None else fusedres.memory.released()
            lines.append(f"warning: the process's peak above its baseline, "
                         f"{M.format_bytes(bounded)}, exceeds --memory-budget "
                         f"{self.cfg['memory_budget']} ({M.format_bytes(budget)})"
                         + ("" if released else
                            "; freed blocks stay resident (FUSEDRES_RELEASE_FREED_MEMORY=0, or "
                            "glibc's MALLOC_ thresholds set in the environment)"))
        for line in lines:
            print(f"fusedres train: {line}", file=sys.stderr)
        return {"memory_budget_bytes": budget, "predicted_peak_bytes": pred,
                "predicted_cuda_peak_bytes": None if p.cuda_step is None
                else p.cuda_step.peak_bytes,
                "predicted_cuda_reserved_bytes": None if p.cuda is None else p.cuda.reserved,
                "measured_cuda_reserved_bytes": reserved,
                "device_warning": self.device_warning,
                "measured_peak_bytes": measured, "measured_peak_kind": kind,
                "predicted_process_bytes": None if proc is None else proc.above_baseline,
                "predicted_slack_bytes": None if proc is None else proc.slack,
                "rss_baseline_bytes": None if cuda else self.rss_baseline,
                "peak_rss_above_baseline_bytes": rss,
                "peak_allocated_above_baseline_bytes": bounded if files is not None else None,
                "mapped_files_above_baseline_bytes": files,
                "rss_pre_step_bytes": None if cuda else self.rss_pre_step,
                "peak_rss_above_pre_step_bytes": rss_steps, "allocator": self.allocator}

    def _finish(self) -> None:
        self.save_checkpoint()
        if self.rank != 0:
            return
        extra = {
            "model": self.cfg["model"] if self.cfg["model"] != "preact_resnet"
            else f"preact_resnet (depth {self.cfg['depth']})",
            "label": variant_label(self.cfg),
            "dataset": self.cfg["dataset"], "iterations": self.iteration,
            "fused": self.cfg["fused"],
            "backend": (fusedres.resolve_backend(self.device) if self.cfg["fused"]
                        else "plain PyTorch"),
            "device": str(self.device), "world_size": self.world,
            "batch_size": self.cfg["batch_size"], "amp": self.cfg["amp"],
            "cuda_graphs": self.cfg["cuda_graphs"], "compile": self.cfg["compile"],
            "channels_last": self.layout["channels_last"],
            "channels_last_origin": self.layout["origin"],
            "layout_reason": self.layout["reason"],
            "threads": torch.get_num_threads(),
            "saved_activation_bytes": self.saved_bytes,
            "memory_kind": ("CUDA max allocated" if self.device.type == "cuda"
                            else "process peak RSS"),
            "parameters": self.parameters,
            "variant": {k: self.cfg[k] for k in ("unit", "shortcut", "norm", "drop_path_rate",
                                                 "drop_path_mode", *_SHORTCUT_ARGS)},
            "recipe": {k: self.cfg[k] for k in RECIPE_KEYS},
            "diverged_at_iteration": self.diverged_at,
            "memory_plan": None if self.plan_summary is None else str(self.plan_summary),
            provenance.KEY: provenance.from_config(self.out),
        }
        extra.update(self._memory_report())
        s = M.summary(self.history, extra)
        if s.get("peak_memory_bytes") is None:
            s["peak_memory_bytes"] = M.peak_memory_bytes(self.device)
        table = M.summary_table(s)
        for name, text in (("summary.json", json.dumps(s, indent=2) + "\n"),
                           ("summary.md", table + "\n")):
            with ckpt.writing(self.out / name):
                ckpt.write_atomically(self.out / name, lambda f, t=text: f.write(t.encode()))
        png = M.plot(self.history, self.out / "curves.png",
                     f"{extra['label']} on {self.cfg['dataset']}")
        print(table)
        if png is not None:
            print(f"curves: {png}")
        if self.log is not None and self.log.tb_note:
            print(f"note: {self.log.tb_note}")
