"""What a training run is built from, as functions of its configuration: the model
(:func:`build_model`, the variants' arguments and their errors under the trainer's flags), the
device and backend checks, the optimizer's parameter groups and the optimizer, MixUp/CutMix and
the EMA. :class:`fusedres.apps.train.loop.Run`'s set-up (run_setup.py) calls them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import fusedres
from fusedres import models

from .config import UsageError
from .step import adamw, sgd

_AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


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
