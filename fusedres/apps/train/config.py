"""Command line and YAML configuration of ``fusedres train``.

Precedence, lowest first: the defaults below (He et al.'s CIFAR recipe), the run directory's
saved ``config.yaml`` when resuming, a ``--config`` YAML file, flags given on the command line.
An option also replaces the options it conflicts with from lower layers (``--max-iters`` over a
config's ``epochs``, a named ``--model`` over its ``depth``); giving both of such a pair as
flags is an error (exit 2). See :func:`_apply`.
The resolved configuration is written beside each run as ``config.yaml``, a file ``--config``
reads back (the file the run was given is named in its header comment, not as a key: a config
file cannot name another).

``channels_last`` is ``"auto"`` (the default), true or false; the run resolves ``auto`` with
:func:`resolve_channels_last` once its device is known, and saves the resolved value.
``compile`` is false or a torch.compile mode (:data:`COMPILE_MODES`); true, as older configs and
the bare ``--compile`` say, is ``"default"``.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

import torch
import yaml

from fusedres.apps.cli import UsageError, parse_bytes

from .step import WARMUP_STEPS

__all__ = ["UsageError", "build_parser", "channels_last_setting", "parse_bytes", "resolve",
           "resolve_channels_last"]

# Named configs ship inside the package (fusedres/apps/configs/*.yaml): `--config digits`.
PACKAGE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
    """The names ``--config`` takes for the configs in :data:`PACKAGE_CONFIGS`, sorted."""
    return sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))


# He et al. (2016), "Identity Mappings in Deep Residual Networks", CIFAR recipe.
DEFAULTS: dict[str, Any] = {
    "model": "preact_resnet110",
    "depth": None,
    "variant": None,
    "zero_init_last": False,
    "unit": "preact",
    "shortcut": "identity",
    "shortcut_scale": None,
    "scale_branch": None,
    "gate_bias": None,
    "shortcut_dropout": None,
    "norm": "batch",
    "drop_path_rate": 0.0,
    "drop_path_mode": "row",
    "fused": True,
    "backend": "auto",
    "dataset": "cifar10",
    "data_dir": "data",
    "download": True,
    "batch_size": 128,
    "eval_batch_size": 500,
    "lr": 0.1,
    "momentum": 0.9,
    "nesterov": False,
    "weight_decay": 1e-4,
    "bn_weight_decay": False,
    "bias_weight_decay": False,
    "optimizer": "sgd",
    "betas": [0.9, 0.999],
    "schedule": "step",
    "min_lr": 0.0,
    "poly_power": 1.0,
    "label_smoothing": 0.0,
    "ema_decay": None,
    "accum_steps": 1,
    "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0,
    "warmup_iters": 400,
    # --warmup-lr: None ramps linearly to --lr over the warm-up; a rate holds it constant there
    # (He et al. 2015/2016's 0.01 for 400 iterations, then 0.1). fusedres.apps.train.schedule.
    "warmup_lr": None,
    "milestones": [32000, 48000],
    "lr_decay": 0.1,
    "max_iters": 64000,
    "epochs": None,
    "pad": 4,
    "flip": True,
    "out": None,
    "resume": None,
    "seed": 0,
    "threads": None,
    "device": "auto",
    "memory_budget": None,
    "activation_budget": None,
    "amp": "none",
    "channels_last": "auto",
    "compile": False,
    "cuda_graphs": False,
    "sync_bn": False,
    "checkpoint_every": 1000,
    "keep_checkpoints": 2,
    "eval_every": None,
    "log_every": 50,
    # --log-grad-norms [N]: per-unit gradient norms every N iterations (a multiple of
    # --log-every; the flag alone: every --log-every); None: off. fusedres.apps.train.gradnorms.
    "log_grad_norms": None,
    "log_format": "jsonl",
    "tensorboard": True,
    "progress": True,
    # --dataset imagefolder (streamed from disk): None is the dataset's default, which the
    # resolved configuration records (:func:`_check_imagefolder`).
    "workers": None,
    "crop_size": None,
    "scale_range": None,
    "eval_resize": None,
    "eval_crop": None,
    "ten_crop": False,
}

# He et al. (2016) [1]'s ImageNet augmentation and testing (fusedres.apps.train.data explains).
IMAGEFOLDER_DEFAULTS = {"crop_size": 224, "scale_range": [256, 480]}
IMAGEFOLDER_OPTIONS = ("workers", "crop_size", "scale_range", "eval_resize", "eval_crop",
                       "ten_crop")

CHOICES = {
    "dataset": ("cifar10", "cifar100", "digits", "synthetic", "imagefolder"),
    "amp": ("none", "bf16", "fp16"),
    "optimizer": ("sgd", "adamw"),
    "schedule": ("step", "cosine", "poly"),  # fusedres.apps.train.schedule.SCHEDULES
    "device": ("auto", "cpu", "cuda"),
    "log_format": ("jsonl", "csv"),
    "backend": ("auto", "reference", "portable", "cpu", "triton", "cuda"),
    "variant": (None, "cifar", "imagenet"),
    # fusedres.modules.UNITS, SHORTCUTS, NORMS, DROP_PATH_MODES (not imported: the parser
    # loads without torch's model code).
    "unit": ("preact", "original", "bn_after_add", "relu_before_add", "relu_only_preact"),
    "shortcut": ("identity", "scale", "exclusive_gate", "shortcut_gate", "conv1x1", "dropout",
                 "none"),
    "norm": ("batch", "none"),
    "drop_path_mode": ("batch", "row", "batch_skip"),
}
# torch.compile's modes that --compile takes ("default" is torch.compile's mode=None).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse's own is two lines)
        raise UsageError(message)


def _int_list(text: str) -> list:
    try:
        values = [float(v) if "." in v else int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated iterations (or fractions of the run), got {text!r}"
        ) from None
    return values


_ON = ("on", "true", "yes", "1")
_OFF = ("off", "false", "no", "0")


def channels_last_setting(value: Any) -> bool | str:
    """``--channels-last``'s value as the configuration holds it: ``"auto"``, True or False.
    Accepts those, and on/off, true/false, yes/no, 1/0 as text (any case); raises
    :class:`UsageError` naming the flag for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise UsageError(f"--channels-last: expected auto, on or off (or true/false), got {value!r}")


def _channels_last_arg(text: str) -> bool | str:
    try:
        return channels_last_setting(text)
    except UsageError:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}") from None


def resolve_channels_last(setting: bool | str, device: torch.device,
                          dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """The memory layout of a run: (channels_last, why), the reason one line.

    ``setting`` True or False is the user's choice and is kept. ``"auto"``: channels_last on
    a CPU with oneDNN (``torch.backends.mkldnn.is_available()``) for float32 or bfloat16
    activations (``dtype``: the autocast dtype, else the parameters'), since oneDNN's
    convolutions run NHWC natively and plain PyTorch's fastest CPU step is often the
    channels_last one; NCHW everywhere else, on CUDA because it is the layout fusedres's GPU
    kernels are built and modelled for.
    """
    setting = channels_last_setting(setting)
    if setting is not True and setting is not False:  # "auto"
        if device.type == "cpu":
            if not torch.backends.mkldnn.is_available():
                return False, ("auto: NCHW, this torch has no oneDNN "
                               "(torch.backends.mkldnn.is_available() is False)")
            if dtype not in (torch.float32, torch.bfloat16):
                return False, (f"auto: NCHW, channels_last is picked on CPU for float32 and "
                               f"bfloat16 activations only, not {str(dtype)[6:]}")
            return True, ("auto: on CPU oneDNN's convolutions run NHWC natively; whole-step "
                          "comparison of the two layouts: benchmarks/RESULTS.md")
        if device.type == "cuda":
            return False, ("auto: NCHW on CUDA, the layout fusedres's GPU kernels are built and "
                           "modelled for (--channels-last on to change it)")
        return False, f"auto: NCHW on {device.type}"
    return setting, f"asked for (--channels-last {'on' if setting else 'off'})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fusedres train",
        description="Train a pre-activation ResNet (He et al. 2016) with fused BN-ReLU-conv. "
                    "Defaults are the paper's CIFAR recipe; a YAML --config sets defaults, "
                    "flags win.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the config
    )
    add = p.add_argument
    add("--config", help="YAML file of defaults (keys are flag names, - or _), or the name of "
                         "one shipped in fusedres/apps/configs: " + ", ".join(shipped_configs()))
    _add_model_group(p)
    _add_data_group(p)
    _add_imagefolder_group(p)
    _add_optimisation_group(p)
    _add_memory_group(p)
    _add_run_group(p)
    return p


def _add_model_group(p: argparse.ArgumentParser) -> None:
    """The model: depth, family, unit ordering, shortcut, norm, drop-path, backend."""
    g = p.add_argument_group("model")
    g.add_argument("--model", help="a fusedres.models name (preact_resnet110, ...), or "
                                   "preact_resnet with --depth (default preact_resnet110)")
    g.add_argument("--depth", type=int, help="depth for --model preact_resnet")
    g.add_argument("--variant", choices=("cifar", "imagenet"),
                   help="network family for --model preact_resnet (default cifar)")
    g.add_argument("--zero-init-last", action=argparse.BooleanOptionalAction,
                   help="zero the last BN/conv of each residual branch")
    g.add_argument("--unit", choices=CHOICES["unit"],
                   help="residual unit ordering (He et al. 2016, Fig. 4): preact (default, full "
                        "pre-activation), original, bn_after_add, relu_before_add, "
                        "relu_only_preact")
    g.add_argument("--shortcut", choices=CHOICES["shortcut"],
                   help="shortcut of the units that keep their shape (He et al. 2016, Table 1): "
                        "identity (default), scale, exclusive_gate, shortcut_gate, conv1x1, "
                        "dropout, or none (a plain network)")
    g.add_argument("--shortcut-scale", type=float,
                   help="--shortcut scale: the factor on the shortcut (0.5)")
    g.add_argument("--scale-branch", action=argparse.BooleanOptionalAction,
                   help="--shortcut scale: scale the branch by 1 - factor too (off)")
    g.add_argument("--gate-bias", type=float,
                   help="gate shortcuts: initial bias of the 1x1 gate conv (-6)")
    g.add_argument("--shortcut-dropout", type=float,
                   help="--shortcut dropout: dropout probability on the shortcut (0.5)")
    g.add_argument("--norm", choices=CHOICES["norm"],
                   help="batch (default) or none: no BatchNorm (convolutions get biases)")
    g.add_argument("--drop-path-rate", type=float,
                   help="stochastic depth: the last unit's drop probability, linear in depth "
                        "(Huang et al. 2016; default 0)")
    g.add_argument("--drop-path-mode", choices=CHOICES["drop_path_mode"],
                   help="row (per sample, default); batch (one draw for the whole batch, "
                        "applied on the device: a dropped unit's branch still runs, scaled by "
                        "0; no device-to-host sync); batch_skip (one draw read on the host: a "
                        "dropped unit computes nothing; one sync per unit a step, not with "
                        "--cuda-graphs)")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction,
                   help="fused BN-ReLU-conv blocks (default) or plain PyTorch ones")
    g.add_argument("--backend", choices=CHOICES["backend"], help="fusedres backend (auto)")


def _add_data_group(p: argparse.ArgumentParser) -> None:
    """The dataset and its augmentation."""
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=CHOICES["dataset"],
                   help="cifar10 (default), cifar100, or digits (scikit-learn's 8x8 "
                        "handwritten digits, shipped with the package: works offline), or "
                        "synthetic (random CIFAR-shaped images: speed and memory only), or "
                        "imagefolder (ImageNet and the like: --data-dir holds train/ and val/ "
                        "in torchvision's ImageFolder layout, streamed from disk)")
    g.add_argument("--data-dir", help="where the CIFAR files are or go; for imagefolder the "
                                      "folder holding train/ and val/ (default data)")
    g.add_argument("--download", action=argparse.BooleanOptionalAction,
                   help="download CIFAR when missing (default on)")
    g.add_argument("--pad", type=int, help="random-translation padding in pixels (4)")
    g.add_argument("--flip", action=argparse.BooleanOptionalAction,
                   help="random horizontal flips (on)")


def _add_optimisation_group(p: argparse.ArgumentParser) -> None:
    """Batch, optimizer, regularisation, schedule and length."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, help="global batch, split over processes (128)")
    g.add_argument("--eval-batch-size", type=int, help="batch for evaluation (500)")
    g.add_argument("--lr", type=float, help="peak learning rate (0.1)")
    g.add_argument("--optimizer", choices=CHOICES["optimizer"],
                   help="sgd (default: torch.optim.SGD, --momentum, --nesterov) or adamw "
                        "(torch.optim.AdamW, --betas; decoupled --weight-decay)")
    g.add_argument("--momentum", type=float, help="SGD momentum (0.9)")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction)
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"),
                   help="--optimizer adamw: Adam's beta1 beta2 (0.9 0.999)")
    g.add_argument("--weight-decay", type=float, help="weight decay (1e-4): L2 for sgd, "
                                                      "decoupled for adamw")
    g.add_argument("--bn-weight-decay", action=argparse.BooleanOptionalAction,
                   help="also decay the normalisation layers' weights and biases (off)")
    g.add_argument("--bias-weight-decay", action=argparse.BooleanOptionalAction,
                   help="also decay the biases of convolutions and linear layers (off)")
    g.add_argument("--label-smoothing", type=float,
                   help="the training loss's label smoothing, in [0, 1) "
                        "(nn.CrossEntropyLoss(label_smoothing=); default 0)")
    g.add_argument("--ema-decay", type=float,
                   help="keep an exponential moving average of the weights and buffers "
                        "(torch.optim.swa_utils.AveragedModel, get_ema_multi_avg_fn) with this "
                        "decay in (0, 1), e.g. 0.999; evaluation uses it (default: none)")
    g.add_argument("--accum-steps", type=int,
                   help="gradient accumulation: each iteration's batch (--batch-size) runs as "
                        "this many equal micro-batches, their gradients summed before the one "
                        "optimizer step (less activation memory; BatchNorm sees the "
                        "micro-batches; default 1)")
    g.add_argument("--mixup-alpha", type=float,
                   help="MixUp (torchvision.transforms.v2.MixUp) of each training batch, its "
                        "Beta(alpha, alpha) mixing weight; 0 off (default). With "
                        "--cutmix-alpha too, one of the two per batch at random")
    g.add_argument("--cutmix-alpha", type=float,
                   help="CutMix (torchvision.transforms.v2.CutMix) of each training batch; 0 "
                        "off (default)")
    g.add_argument("--schedule", choices=CHOICES["schedule"],
                   help="learning-rate schedule after the warm-up (torch.optim.lr_scheduler): "
                        "step (default, MultiStepLR at --milestones by --lr-decay), cosine "
                        "(CosineAnnealingLR to --min-lr), poly (PolynomialLR, --poly-power)")
    g.add_argument("--min-lr", type=float, help="--schedule cosine: the final rate (0)")
    g.add_argument("--poly-power", type=float, help="--schedule poly: the power (1)")
    g.add_argument("--warmup-iters", type=int, help="warm-up iterations (400)")
    g.add_argument("--warmup-lr", type=float,
                   help="a constant learning rate for the warm-up iterations, at most --lr "
                        "(He et al.: 0.01, then 0.1); default: a linear ramp to --lr")
    g.add_argument("--milestones", type=_int_list,
                   help="iterations where the lr is multiplied by --lr-decay (32000,48000); "
                        "values below 1 are fractions of the run")
    g.add_argument("--lr-decay", type=float, help="lr factor at each milestone (0.1)")
    g.add_argument("--max-iters", type=int, help="stop after this many iterations (64000)")
    g.add_argument("--epochs", type=int, help="stop after this many epochs (replaces "
                                               "--max-iters; not both)")
    g.add_argument("--seed", type=int, help="seed of initialisation, data order and "
                                            "augmentation (0)")


def _add_memory_group(p: argparse.ArgumentParser) -> None:
    """Device, threads, memory budgets, precision, layout, compile, graphs."""
    g = p.add_argument_group("memory and speed")
    g.add_argument("--device", choices=CHOICES["device"], help="auto: cuda when available")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    g.add_argument("--memory-budget",
                   help="peak device memory of a whole training step, e.g. 4GiB: parameters, "
                        "gradients, optimizer state, activations, the recomputation and other "
                        "transients, the evaluation forward and the dataset on the device; the "
                        "planner checkpoints to fit it. On CPU it bounds the process: the peak of "
                        "the memory it allocates above what it held with torch imported (the "
                        "allocator's slack included; the libraries' mapped files are not "
                        "counted). auto: the free GPU memory (CPU: the available memory) minus "
                        "a margin of 5%% of the total + 256 MiB")
    g.add_argument("--activation-budget",
                   help="bound only the saved activations alive at once, e.g. 4GiB (the "
                        "planner's older, narrower budget)")
    g.add_argument("--amp", choices=CHOICES["amp"], help="autocast dtype (none)")
    g.add_argument("--channels-last", nargs="?", const=True, type=_channels_last_arg,
                   metavar="{auto,on,off}",
                   help="memory layout of the model and the batches: on (also the flag alone) "
                        "channels_last, off NCHW, auto (default) channels_last on a CPU with "
                        "oneDNN for float32/bf16, NCHW on CUDA; the run prints which and why, "
                        "and saves the resolved value (a resumed run keeps it)")
    g.add_argument("--no-channels-last", dest="channels_last", action="store_const",
                   const=False, help="NCHW (as --channels-last off)")
    g.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES,
                   help="torch.compile the model in this mode (the flag alone: default)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                   help="no torch.compile (the default)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="capture the whole training step (forward, loss, backward, SGD step) "
                        f"in a CUDA graph after {WARMUP_STEPS} eager warm-up steps and replay "
                        "it (needs a CUDA device and one process; evaluation stays eager)")
    g.add_argument("--sync-bn", action=argparse.BooleanOptionalAction,
                   help="BatchNorm statistics over all processes (torchrun)")


def _add_run_group(p: argparse.ArgumentParser) -> None:
    """The run directory, resuming, checkpoints and logging."""
    g = p.add_argument_group("run")
    g.add_argument("--out", help="run directory (default runs/<dataset>-<model>)")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the latest checkpoint of --out, from a checkpoint "
                        "file, or 'auto' (resume when one exists, else start)")
    g.add_argument("--checkpoint-every", type=int, help="iterations between checkpoints (1000)")
    g.add_argument("--keep-checkpoints", type=int, help="checkpoints kept (2)")
    g.add_argument("--eval-every", type=int, help="iterations between evaluations "
                                                   "(default: each epoch end)")
    g.add_argument("--log-every", type=int, help="iterations between metric records (50)")
    g.add_argument("--log-format", choices=CHOICES["log_format"], help="metrics file (jsonl)")
    g.add_argument("--log-grad-norms", nargs="?", const=True, type=int, metavar="N",
                   help="log each residual unit's gradient norms (of its input and of its "
                        "parameters) every N iterations, a multiple of --log-every (the flag "
                        "alone: every --log-every), as 'grad_norms' records in metrics.jsonl; "
                        "fusedres compare plots them against depth")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="TensorBoard events when tensorboard is installed (on)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="a progress bar per epoch (on)")


def _add_imagefolder_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "imagefolder", "--dataset imagefolder only: He et al.'s ImageNet augmentation (shorter "
                       "side resized to a random size in --scale-range, a random --crop-size "
                       "crop, --flip) and testing (shorter side to --eval-resize, the centre "
                       "--eval-crop crop, or ten crops)")
    g.add_argument("--workers", type=int, help="DataLoader worker processes per training "
                   "process (default: the CPUs this process may use / processes on this "
                   "machine - 1, at most 8)")
    g.add_argument("--crop-size", type=int, help="training crop, pixels square (224)")
    g.add_argument("--scale-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="shorter side resized to a random size in [MIN, MAX] before the "
                        "crop (256 480)")
    g.add_argument("--eval-resize", type=int, help="evaluation: shorter side resized to this "
                   "(default: the --scale-range minimum, 256)")
    g.add_argument("--eval-crop", type=int, help="evaluation crop (default: --crop-size, 224; "
                   "the paper's Table 5 tests 320 crops of --eval-resize 320)")
    g.add_argument("--ten-crop", action=argparse.BooleanOptionalAction,
                   help="evaluate on ten crops (4 corners and centre, and their mirror "
                        "images), averaging the softmax (off: the centre crop)")


def _check_imagefolder(cfg: dict[str, Any], resuming: bool = False) -> None:
    """The imagefolder options: only with --dataset imagefolder, where their defaults are
    filled in (so that the saved configuration says what the run did). ``workers`` stays
    None (auto): it depends on the machine, never on the result. ``resuming``: the command
    line of a resumed run, whose dataset is the saved configuration's (checked again once
    merged with it)."""
    if cfg["dataset"] != "imagefolder":
        if resuming:
            return
        for name in IMAGEFOLDER_OPTIONS:
            if cfg[name] not in (None, False):
                raise UsageError(f"{_flag(name)}: only with --dataset imagefolder")
        return
    for name, value in IMAGEFOLDER_DEFAULTS.items():
        if cfg[name] is None:
            cfg[name] = list(value) if isinstance(value, list) else value
    scale = cfg["scale_range"]
    if (not isinstance(scale, (list, tuple)) or len(scale) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in scale)):
        raise UsageError(f"--scale-range: expected two integers MIN MAX, got {scale!r}")
    cfg["scale_range"] = list(scale)
    if cfg["eval_resize"] is None:
        cfg["eval_resize"] = scale[0]
    if cfg["eval_crop"] is None:
        cfg["eval_crop"] = cfg["crop_size"]
    for name in ("crop_size", "eval_resize", "eval_crop", "workers"):
        value = cfg[name]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{_flag(name)}: expected an integer, got {value!r}")
        if value < (0 if name == "workers" else 1):
            raise UsageError(f"{_flag(name)}: expected a value >= "
                             f"{0 if name == 'workers' else 1}, got {value}")
    if not cfg["crop_size"] <= scale[0] <= scale[1]:
        raise UsageError(f"--scale-range: expected --crop-size ({cfg['crop_size']}) <= MIN <= "
                         f"MAX, got {scale[0]} {scale[1]}")
    if cfg["eval_crop"] > cfg["eval_resize"]:
        raise UsageError(f"--eval-crop: {cfg['eval_crop']} is larger than --eval-resize "
                         f"{cfg['eval_resize']}")


def load_yaml(path: str | Path, what: str) -> dict[str, Any]:
    path = Path(path)
    if not path.suffix and not path.exists() and (PACKAGE_CONFIGS / f"{path}.yaml").exists():
        path = PACKAGE_CONFIGS / f"{path}.yaml"
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"{what}: cannot read {str(path)!r}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{what}: {path} is not valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what}: {path} must hold a mapping of option: value")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "provenance":  # a run's record of its commit and machine, not an option
            continue
        if name == "config":
            raise UsageError(f"{what}: {path} sets 'config': a config file cannot include "
                             "another (a config.yaml saved by an older fusedres records its "
                             "run's --config there: delete that line)")
        if name not in DEFAULTS:
            raise UsageError(f"{what}: unknown option {key!r} in {path}")
        out[name] = value
    return out


def compile_setting(value: Any) -> str | bool:
    """``compile``'s value as the configuration holds it: False, or one of
    :data:`COMPILE_MODES` (True is ``"default"``); raises :class:`UsageError` naming the flag."""
    if value is True:
        return "default"
    if value is False or value is None:
        return False
    if value in COMPILE_MODES:
        return value
    raise UsageError(f"--compile: expected one of {', '.join(COMPILE_MODES)} (or true/false), "
                     f"got {value!r}")


# Integers travel as C++ int64 (torch.set_num_threads, tensor shapes, padding) and the seed as
# torch's uint64: beyond these they overflow inside torch (a traceback, not an error naming the
# flag). Every number option is finite: argparse's float() takes "nan" and "inf", which no
# comparison below refuses (nan <= 0 is False) and training then spreads.
INT_LIMIT, SEED_LIMIT = 2**63, 2**64


def _check_range(name: str, value: Any) -> None:
    """An option's value, when a number (or each number of a list, as --betas): finite, and an
    integer within the bounds torch takes (:data:`INT_LIMIT`, :data:`SEED_LIMIT` for --seed).
    Other values pass: the type checks name them."""
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_range(name, v)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # not a number: the type checks name it
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{_flag(name)}: expected a finite number, got {value}")
    limit = SEED_LIMIT if name == "seed" else INT_LIMIT
    if isinstance(value, int) and not -limit < value < limit:
        bound = "2^64" if name == "seed" else "2^63"
        raise UsageError(f"{_flag(name)}: expected a value whose magnitude is below {bound}, "
                         f"got {value}")


def _check_types(cfg: dict[str, Any]) -> None:
    cfg["channels_last"] = channels_last_setting(cfg["channels_last"])  # "auto", True, False
    cfg["compile"] = compile_setting(cfg["compile"])
    for name, default in DEFAULTS.items():
        value = cfg[name]
        if value is None or name == "compile":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UsageError(f"{flag}: expected true or false, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{flag}: expected an integer, got {value!r}")
        if isinstance(default, float) and (isinstance(value, bool)
                                           or not isinstance(value, (int, float))):
            raise UsageError(f"{flag}: expected a number, got {value!r}")
        _check_range(name, value)
        if name in CHOICES and value not in CHOICES[name]:
            allowed = ", ".join(str(c) for c in CHOICES[name] if c is not None)
            raise UsageError(f"{flag}: expected one of {allowed}, got {value!r}")
    for name in ("lr", "momentum", "weight_decay", "lr_decay", "min_lr", "poly_power",
                 "label_smoothing", "mixup_alpha", "cutmix_alpha"):
        cfg[name] = float(cfg[name])
    betas = cfg["betas"]
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
        raise UsageError(f"--betas: expected two numbers B1 B2, got {betas!r}")
    cfg["betas"] = [float(b) for b in betas]
    ema = cfg["ema_decay"]
    if ema is not None and (isinstance(ema, bool) or not isinstance(ema, (int, float))):
        raise UsageError(f"--ema-decay: expected a number, got {ema!r}")


def _check_values(cfg: dict[str, Any]) -> None:
    positive = ("batch_size", "eval_batch_size", "max_iters", "epochs", "checkpoint_every",
                "accum_steps",
                "keep_checkpoints", "eval_every", "log_every", "threads", "lr")
    for name in positive:
        if cfg[name] is not None and cfg[name] <= 0:
            raise UsageError(f"--{name.replace('_', '-')}: expected a positive value, "
                             f"got {cfg[name]}")
    for name in ("warmup_iters", "pad", "weight_decay", "momentum", "seed", "min_lr",
                 "mixup_alpha", "cutmix_alpha"):
        if cfg[name] < 0:
            raise UsageError(f"--{name.replace('_', '-')}: expected a value >= 0, "
                             f"got {cfg[name]}")
    for name in ("shortcut_scale", "gate_bias", "shortcut_dropout"):
        value = cfg[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"{_flag(name)}: expected a number, got {value!r}")
    if cfg["scale_branch"] is not None and not isinstance(cfg["scale_branch"], bool):
        raise UsageError(f"--scale-branch: expected true or false, got {cfg['scale_branch']!r}")
    if cfg["poly_power"] <= 0:
        raise UsageError(f"--poly-power: expected a positive value, got {cfg['poly_power']}")
    warm = cfg["warmup_lr"]
    if warm is not None and (isinstance(warm, bool) or not isinstance(warm, (int, float))
                             or not 0 < warm <= cfg["lr"]):
        raise UsageError(f"--warmup-lr: expected a rate in (0, --lr = {cfg['lr']:g}], got "
                         f"{warm!r}")
    if cfg["min_lr"] > cfg["lr"]:
        raise UsageError(f"--min-lr: expected a value <= --lr ({cfg['lr']}), got "
                         f"{cfg['min_lr']}")
    if not 0 <= cfg["label_smoothing"] < 1:
        raise UsageError(f"--label-smoothing: expected a value in [0, 1), got "
                         f"{cfg['label_smoothing']}")
    if cfg["ema_decay"] is not None and not 0 < cfg["ema_decay"] < 1:
        raise UsageError(f"--ema-decay: expected a decay in (0, 1), got {cfg['ema_decay']}")
    if cfg["optimizer"] == "adamw" and cfg["nesterov"]:
        raise UsageError("--nesterov: only with --optimizer sgd (AdamW has no Nesterov "
                         "momentum here)")
    if not all(0 <= b < 1 for b in cfg["betas"]):
        raise UsageError(f"--betas: expected two values in [0, 1), got {cfg['betas']}")
    if not 0 <= cfg["drop_path_rate"] < 1:
        raise UsageError(f"--drop-path-rate: expected a rate in [0, 1), got "
                         f"{cfg['drop_path_rate']}")
    ms = cfg["milestones"]
    if not isinstance(ms, list) or not all(
            isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in ms):
        raise UsageError(f"--milestones: expected positive iterations (or fractions), got {ms!r}")
    if cfg["memory_budget"] is not None and cfg["memory_budget"] != "auto":
        parse_bytes(cfg["memory_budget"])
    if cfg["activation_budget"] is not None:
        parse_bytes(cfg["activation_budget"], "--activation-budget")
    _check_cuda_graphs(cfg)
    _check_grad_norms(cfg)


def _check_grad_norms(cfg: dict[str, Any]) -> None:
    """--log-grad-norms: resolved to its interval (the flag alone, or ``true`` in a config
    file: --log-every), which must be a multiple of --log-every so that the norms are read back
    at a log record, where the loop synchronises anyway."""
    n = cfg["log_grad_norms"]
    if n is None or n is False:
        cfg["log_grad_norms"] = None
        return
    if n is True:
        n = cfg["log_every"]
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise UsageError(f"--log-grad-norms: expected a positive number of iterations N (or the "
                         f"flag alone), got {n!r}")
    if n % cfg["log_every"]:
        raise UsageError(f"--log-grad-norms {n}: expected a multiple of --log-every "
                         f"({cfg['log_every']}): the norms are read back at a log record")
    if cfg["log_format"] != "jsonl":
        raise UsageError(f"--log-grad-norms: needs --log-format jsonl (a record holds a list per "
                         f"unit, which metrics.csv's fixed columns cannot), got "
                         f"{cfg['log_format']!r}")
    if cfg["cuda_graphs"]:
        raise UsageError("--log-grad-norms: not with --cuda-graphs (a replayed step runs no "
                         "Python, so the gradient hooks cannot be armed on the logged steps "
                         "only); train without --cuda-graphs to log gradient norms")
    if cfg["compile"]:
        raise UsageError(f"--log-grad-norms: not with --compile {cfg['compile']} (the tensor "
                         "hooks on each unit's input are not compiled); train eagerly to log "
                         "gradient norms")
    cfg["log_grad_norms"] = n


def _check_cuda_graphs(cfg: dict[str, Any]) -> None:
    """The options a captured step cannot have, refused with ``--cuda-graphs``. (The device
    and the number of processes are checked by the run, once it knows them.)"""
    if not cfg["cuda_graphs"]:
        return
    if cfg["compile"]:
        raise UsageError(f"--compile {cfg['compile']}: not with --cuda-graphs, choose one "
                         "(--compile reduce-overhead is torch.compile's own CUDA graphs)")
    if cfg["drop_path_mode"] == "batch_skip" and cfg["drop_path_rate"]:
        raise UsageError("--drop-path-mode batch_skip: not with --cuda-graphs (it reads each "
                         "unit's draw on the host and skips dropped branches, so every step "
                         "would run other kernels); --drop-path-mode batch decides on the device")
    for name in ("mixup_alpha", "cutmix_alpha"):
        if cfg[name]:
            raise UsageError(f"{_flag(name)}: not with --cuda-graphs (torchvision's MixUp and "
                             "CutMix draw their weight and box on the host each batch: a "
                             "captured step would replay the first batch's)")
    for name in ("memory_budget", "activation_budget"):
        if cfg[name] is not None:
            raise UsageError(f"{_flag(name)}: not with --cuda-graphs (the activation "
                             "checkpointing it plans is not captured by the trainer)")


# Named zoo models of the CIFAR family (the others are ImageNet ones): what a --depth or
# --variant given over a named model keeps of it.
_CIFAR_DEPTHS = (20, 56, 110, 164, 1001)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _apply(cfg: dict[str, Any], layer: dict[str, Any], source: str) -> set[str]:
    """Put ``layer`` (the options one source sets: ``"flags"``, ``"--config"``) over ``cfg``.

    An option replaces the options it conflicts with that lower layers set: ``--max-iters``
    drops a lower ``epochs`` (``--epochs`` replaces ``--max-iters`` anyway); a named
    ``--model`` drops a lower ``depth`` and ``variant``; ``--depth`` or ``--variant`` over a
    lower named model turns it into ``preact_resnet`` of that depth and variant. Both options
    of a pair in one layer is an error for flags (``--epochs`` and ``--max-iters``; a named
    ``--model`` with ``--depth``/``--variant``); a file may set ``epochs`` and ``max_iters``
    (a saved run's config does; ``epochs`` wins). Returns the option names changed beyond
    ``layer``'s own.
    """
    changed: set[str] = set()
    given = {k for k, v in layer.items() if v is not None}
    if {"epochs", "max_iters"} <= given and source == "flags":
        raise UsageError("--epochs and --max-iters: give one of them (--epochs replaces "
                         "--max-iters)")
    if "max_iters" in given and "epochs" not in layer:
        cfg["epochs"] = None
        changed.add("epochs")
    model = layer.get("model")
    # An unknown model name is left to the model builder's error.
    if model is not None and re.fullmatch(r"preact_resnet\d+", str(model)):
        for name in ("depth", "variant"):
            if name in given:
                where = "" if source == "flags" else f" (both set by {source})"
                raise UsageError(f"{_flag(name)}: only with --model preact_resnet ({model} "
                                 f"fixes the {name}){where}")
            cfg[name] = None
            changed.add(name)
    elif model is None and given & {"depth", "variant"}:
        lower = str(cfg.get("model"))
        m = re.fullmatch(r"preact_resnet(\d+)", lower)
        if m is not None:
            depth = int(m.group(1))
            cfg.update(model="preact_resnet", depth=depth,
                       variant="cifar" if depth in _CIFAR_DEPTHS else "imagenet")
            changed |= {"model", "depth", "variant"}
    cfg.update(layer)
    return changed


def resolve(argv: list[str] | None) -> tuple[dict[str, Any], set[str]]:
    """Parse ``argv``; returns the configuration and the names set explicitly.

    Explicit names are the flags given, the keys of the --config file, and the options these
    replaced (see :func:`_apply`). The run directory's saved config (when resuming) is
    layered in by the caller through :func:`merge_saved`, since the run directory itself is a
    flag.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    config_file = ns.pop("config", None)
    cfg = dict(DEFAULTS)
    from_file = load_yaml(config_file, "--config") if config_file is not None else {}
    changed = _apply(cfg, from_file, "--config")
    changed |= _apply(cfg, ns, "flags")
    _check_types(cfg)
    _check_values(cfg)
    if "drop_path_mode" in ns and not cfg["drop_path_rate"]:
        raise UsageError("--drop-path-mode: only with a --drop-path-rate above 0 (without one no "
                         "unit is dropped and the mode changes nothing)")
    _check_imagefolder(cfg, resuming=cfg["resume"] is not None)
    cfg["config"] = str(config_file) if config_file is not None else None
    return cfg, set(ns) | set(from_file) | changed


def merge_saved(cfg: dict[str, Any], explicit: set[str], saved: dict[str, Any]) -> dict[str, Any]:
    """Resume: the saved run configuration, with what this command line (flags and its
    --config file, and what they replaced) set explicitly on top."""
    merged = dict(DEFAULTS)
    merged.update({k: v for k, v in saved.items() if k in DEFAULTS})
    for k in explicit:
        if k in DEFAULTS:
            merged[k] = cfg[k]
    merged["config"] = cfg.get("config")
    _check_types(merged)
    _check_values(merged)
    _check_imagefolder(merged)
    return merged
