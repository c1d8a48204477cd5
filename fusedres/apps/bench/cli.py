"""``fusedres bench {units,step,fit,gpu-report}``: argument parsing, the runs, and their output
(terminal table; with ``--out DIR`` a JSON of every figure, a Markdown report and PNG plots)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fusedres.memory
from fusedres.apps.cli import UsageError, parse_bytes
from fusedres.models import unit_shapes as S

from .measure import resolve_device
from .runner import GPU_PARTS, run
from .step import ALL_VARIANTS, LAYOUTS, default_layouts, model_name
from .units import BASELINES, fused_backends

__all__ = ["UsageError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the flag, exit 2 (argparse's is two)
        raise UsageError(message)


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") \
                from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
        return v
    parse.__name__ = flag
    return parse


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _size(text: str) -> int:
    try:
        return parse_bytes(text, flag=None)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _common(p: argparse.ArgumentParser, reps: int | None, warmup: int | None) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when a GPU is visible")
    p.add_argument("--threads", type=_positive_int("--threads"),
                   help="torch CPU threads (default: torch's)")
    if reps is not None:
        p.add_argument("--reps", type=_positive_int("--reps"), default=None,
                       help=f"timed repetitions per candidate (default {reps}; --quick 2)")
        p.add_argument("--warmup", type=_nonneg_int, default=None,
                       help=f"untimed calls per candidate first (default {warmup}; --quick 1)")
    else:
        p.set_defaults(reps=None, warmup=None)
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and few repetitions: a smoke run in seconds (on CPU one "
                        "thread unless --threads)")
    p.add_argument("--out", help="directory for report.md, results.json and the PNG plots")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new shape / model / probe after this many seconds")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="CPU: keep, glibc keeps freed blocks for reuse (no mmap, no trim: "
                        "no page faults from one step to the next, whose count otherwise "
                        "depends on what ran before in the process); default, glibc's own "
                        "dynamic thresholds (fusedres.memory.keep_freed_memory)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fusedres bench",
                description="How much time and memory the fused units save on this machine, "
                            "against what you would use instead. Every ratio is between rows "
                            "measured in the same run, in interleaved order.")
    sub = p.add_subparsers(dest="command", metavar="{units,step,fit,gpu-report}")
    u = sub.add_parser("units", help="forward+backward of single units, fused vs plain, "
                                     "channels_last, torch.compile, checkpoint")
    _common(u, reps=7, warmup=2)
    u.add_argument("--set", default=None,
                   help=f"comma-separated shape sets ({', '.join(S.SETS)}) or shape names "
                        "(see --list); default cifar,resnet50")
    u.add_argument("--list", action="store_true", help="print the shape sets and exit")
    u.add_argument("--shapes", action="append", default=[], metavar="SPEC",
                   help="your own shape (repeatable), e.g. conv:N=64,C=48,K=3,CO=48,HW=16,S=2,"
                        "res or bottleneck:N=32,C=256,P=64,HW=56,S=2 (replaces --set)")
    u.add_argument("--baselines", default="plain,channels_last,compile,checkpoint",
                   help="which plain variants to time (plain, NCHW, is always timed: `x "
                        "plain` is to it); with channels_last, each fused backend is timed on "
                        "channels_last tensors too, and the report adds `x plain same layout` "
                        "(fused / plain in the same layout) and `best x best plain` (the "
                        "backend's faster layout / the faster of plain NCHW and plain "
                        "channels_last), with a summary per backend")
    u.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                   help="run the forwards under torch.autocast to this dtype (float32 "
                        "parameters, as mixed-precision training does)")
    u.add_argument("--backends", default=None,
                   help="fused backends to time (default: every one that runs on the device)")
    s = sub.add_parser("step", help="whole training steps of zoo models in NCHW and/or "
                                    "channels_last: images/s, peak memory, saved "
                                    "activations, ratios to the faster plain layout")
    _common(s, reps=5, warmup=1)
    s.add_argument("--models", default="20,56,164",
                   help="zoo models by depth: 20,56,110,164,1001 (CIFAR), 18..200 (ImageNet)")
    s.add_argument("--batch", type=_positive_int("--batch"), default=128)
    s.add_argument("--variants", default="plain,fused,fused+plan,plain+ckpt",
                   help="comma-separated, some of plain, fused, fused+plan, plain+ckpt, "
                        "plain+graph, fused+graph (CUDA graphs: a GPU only; plain "
                        "is always run: the ratios are to it)")
    s.add_argument("--layouts", default=None,
                   help="memory layouts to run each variant in, comma-separated: nchw, "
                        "channels_last (default both on CPU, where oneDNN's convolutions run "
                        "NHWC natively; nchw on CUDA); the ratios are to the faster plain "
                        "layout")
    s.add_argument("--plan-budget", type=_size, default=None,
                   help="budget for fused+plan, e.g. 1GiB (default: half the fused model's "
                        "saved activations)")
    s.add_argument("--image-size", type=_positive_int("--image-size"), default=None,
                   help="input size (default 32 for CIFAR models, 224 for ImageNet ones)")
    f = sub.add_parser("fit", help="the largest batch and the deepest CIFAR ResNet that train "
                                   "within --budget, plain vs fused vs fused + planner")
    _common(f, reps=None, warmup=None)  # fit counts memory: nothing is timed
    f.add_argument("--budget", type=_size, default=None,
                   help="memory budget, e.g. 8GiB (default 8GiB on CUDA, 512MiB on CPU; --quick "
                        "12MiB)")
    f.add_argument("--depth", type=_positive_int("--depth"), default=None,
                   help="model of the batch search, a CIFAR bottleneck depth 9n+2 (default 164"
                        "; --quick 29)")
    f.add_argument("--batch", type=_positive_int("--batch"), default=None,
                   help="batch of the depth search (default 128 on CUDA, 16 on CPU; --quick 4)")
    f.add_argument("--max-batch", type=_positive_int("--max-batch"), default=None,
                   help="cap of the batch search (default 4096; --quick 8)")
    f.add_argument("--max-depth", type=_positive_int("--max-depth"), default=None,
                   help="cap of the depth search (default 1001; --quick 29)")
    g = sub.add_parser("gpu-report", help="the training-step answer, kernel times, self-test, "
                                          "units, fit: one report directory (make gpu-report)")
    _common(g, reps=7, warmup=2)
    g.add_argument("--budget", type=_size, default=None,
                   help="budget of the fit part (default 8GiB; --quick 12MiB)")
    g.add_argument("--parts", default=None,
                   help="the parts to run, comma-separated, in the report's order (default: "
                        f"all of {', '.join(GPU_PARTS)})")
    g.add_argument("--slots", default=None, metavar="PART=SECONDS,...",
                   help="when each part must end, in seconds from the start (default: "
                        "--time-limit for every part)")
    g.add_argument("--append", action="store_true",
                   help="keep the parts an earlier run wrote to --out (the GPU check runs the "
                        "report in several processes)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise UsageError("expected a command: units, step, fit or gpu-report")
    if args.time_limit is not None and args.time_limit <= 0:
        raise UsageError(f"--time-limit: expected a positive number of seconds, got "
                         f"{args.time_limit}")
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out: {args.out!r} exists and is not a directory")
    if args.command == "units" and args.list:
        return args
    if args.command == "units":
        _check_units(args)
    elif args.command == "step":
        _check_step(args)
    elif args.command == "gpu-report":
        _check_gpu_report(args)
    elif args.command == "fit":
        if args.depth is not None and (args.depth < 11 or (args.depth - 2) % 9):
            raise UsageError(f"--depth: expected a CIFAR bottleneck depth 9n+2 >= 11 (29, 164, "
                             f"1001, ...), got {args.depth}")
    return args


def _check_gpu_report(args) -> None:
    if args.parts is not None:
        parts = _split(args.parts)
        bad = [k for k in parts if k not in GPU_PARTS]
        if bad or not parts:
            raise UsageError(f"--parts: {'unknown ' + repr(bad[0]) if bad else 'none given'}; "
                             f"expected some of {', '.join(GPU_PARTS)} (comma-separated)")
        args.parts = [k for k in GPU_PARTS if k in parts]  # the report's order
    slots = {}
    for item in _split(args.slots or ""):
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if name not in GPU_PARTS or not seconds > 0 or seconds == float("inf"):
            raise UsageError(f"--slots: expected PART=SECONDS with PART one of "
                             f"{', '.join(GPU_PARTS)} and SECONDS a positive number, got "
                             f"{item!r}")
        slots[name] = seconds
    args.slots = slots


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _check_units(args) -> None:
    baselines = _split(args.baselines)
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise UsageError(f"--baselines: unknown {bad[0]!r}; expected some of "
                         f"{', '.join(BASELINES)}")
    args.baselines = ["plain"] + [b for b in baselines if b != "plain"]
    runnable = fused_backends(args.device)
    if args.backends is None:
        args.backends = runnable
    else:
        wanted = _split(args.backends)
        for b in wanted:
            if b not in runnable:
                raise UsageError(f"--backends: {b!r} cannot be timed on {args.device.type}; "
                                 f"expected some of {', '.join(runnable) or '(none)'}")
        args.backends = wanted
    try:
        args.units = ([S.parse_shape(t) for t in args.shapes] if args.shapes and not args.quick
                      else S.select(args.set, args.quick, "cifar,resnet50"))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_step(args) -> None:
    try:
        args.models = [model_name(m) for m in _split(args.models)]
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not args.models:
        raise UsageError("--models: expected at least one model")
    variants = _split(args.variants)
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad or not variants:
        raise UsageError(f"--variants: unknown {bad[0] if bad else ''!r}; expected some of "
                         f"{', '.join(ALL_VARIANTS)}")
    args.variants = ["plain"] + [v for v in variants if v != "plain"]
    if args.layouts is None:
        args.layouts = list(default_layouts(args.device))
    else:
        layouts = _split(args.layouts)
        bad = [v for v in layouts if v not in LAYOUTS]
        if bad or not layouts:
            raise UsageError(f"--layouts: {'unknown ' + repr(bad[0]) if bad else 'none given'}"
                             f"; expected some of {', '.join(LAYOUTS)} (comma-separated)")
        args.layouts = list(dict.fromkeys(layouts))
    if args.quick:
        args.models, args.batch, args.image_size = ["preact_resnet20"], 4, 16


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False,
                file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"fusedres bench: error: {e}", file=sys.stderr)
        return 2
    args.argv = list(argv)
    if args.command == "units" and args.list:
        for name, units in S.SETS.items():
            print(f"{name}:")
            for u in units:
                print(f"  {u.name}")
        return 0
    args.allocator = None
    if args.device.type == "cpu" and args.malloc == "keep" and args.command in ("units", "step"):
        applied, why = fusedres.memory.keep_freed_memory()
        args.allocator = why if applied else f"glibc defaults ({why})"
        if not applied:
            print(f"fusedres bench: note: --malloc keep not applied: {why}", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.quick and args.device.type == "cpu":
        # Smoke runs of tiny ops: one thread, or a busy machine descheduling the second
        # OpenMP thread makes every op wait (seen here: 20-40x slower steps at load 5-8).
        torch.set_num_threads(1)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
