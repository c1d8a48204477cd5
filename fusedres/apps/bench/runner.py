"""Runs one ``fusedres bench`` command and writes what it measured as it goes: the terminal
table of each part when it finishes, and with ``--out DIR`` ``results.json`` (every figure,
the machine, versions, device, backends), ``report.md`` and the PNG plots, rewritten after
each part so a cut-off run still leaves what it did."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import fusedres
from fusedres.models import unit_shapes as S

from . import decisive
from . import fit as fit_mod
from . import report as R
from . import step as step_mod
from . import units as units_mod
from .measure import process_start

__all__ = ["Report", "run"]

GIB, MIB = 2 ** 30, 2 ** 20
# fit --quick: ResNet-29's batch search and the depth search at batch 4, capped so that a run
# takes seconds; at 12 MiB some answers are bound by the budget, others by the caps.
QUICK_FIT = {"budget": 12 * MIB, "depth": 29, "batch": 4, "max_batch": 8, "max_depth": 29}


class Report:
    """The output of one run: parts in order, each with its data (JSON), Markdown and plots."""

    def __init__(self, out: str | None, title: str, device: torch.device, argv: list[str],
                 append: bool = False):
        self.out = Path(out) if out is not None else None
        self.title = title
        command = "fusedres bench " + shlex.join(argv)
        self.doc: dict[str, Any] = {"title": title, "command": command,
                                    "machine": R.machine(device), "parts": {},
                                    "markdown": {}, "lead": None}
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            if append:
                self._load_earlier(command)
        self.markdown: dict[str, str] = self.doc["markdown"]

    def _load_earlier(self, command: str) -> None:
        """``append``: an earlier run's parts in the same folder stay (the GPU check runs the
        report in several processes, around the build), in their order, before this run's."""
        try:
            doc = json.loads((self.out / "results.json").read_text())
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("parts"), dict):
            return
        doc.setdefault("markdown", {})
        doc.setdefault("lead", None)
        doc["commands"] = [*doc.get("commands", [doc.get("command")]), command]
        doc["command"] = command
        self.doc = doc

    def lead(self, markdown: str) -> None:
        """The lines that answer the report's question, printed first in report.md, right
        under the title (the GPU report's: the fused step against plain, decisive.py)."""
        self.doc["lead"] = markdown

    def png(self, name: str) -> Path | None:
        return self.out / name if self.out is not None else None

    def add(self, part: str, data: Any, text: str | None, markdown: str) -> None:
        """Record a finished part: print its table (``text``; None: a part's rows so far,
        written, not printed), rewrite the JSON and the Markdown."""
        self.doc["parts"][part] = data
        self.markdown[part] = markdown
        if text is not None:
            print(text, flush=True)
        self.flush()

    def flush(self) -> None:
        if self.out is None:
            return
        self.doc["machine"]["time_utc_end"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        try:
            self.doc["machine"]["load_average_1m_end"] = os.getloadavg()[0]
        except OSError:
            pass
        R.write_json(self.out / "results.json", self.doc)
        m = self.doc["machine"]
        commands = self.doc.get("commands") or [self.doc["command"]]
        head = [f"# {self.title}", ""]
        if self.doc.get("lead"):
            head += [self.doc["lead"], ""]
        head += [("Commands: " if len(commands) > 1 else "Command: ")
                 + ", ".join(f"`{c}`" for c in commands), "",
                f"Machine: {R.machine_line(m)}; Python {m['python']}, triton {m['triton']}; "
                f"{m['time_utc']} to {m['time_utc_end']} UTC"
                + (f"; 1-minute load average {m['load_average_1m']:.1f} at the start, "
                   f"{m['load_average_1m_end']:.1f} at the end" if "load_average_1m_end" in m
                   else "") + ".", ""]
        if m.get("device", "cpu").startswith("cpu"):
            head += ["Times on a CPU are wall clock, and noisy when the machine is shared (this "
                     "one may have been: see the load average): every ratio is between rows "
                     "measured in the same run, in interleaved order. Peak memory on CPU is the "
                     "peak of live tensor bytes (fusedres.memory.LiveTensorTracker), not RSS. "
                     f"C allocator: {m.get('allocator') or 'glibc defaults (--malloc default)'}.",
                     ""]
        else:
            head += ["Times are CUDA events; peak memory is torch.cuda.max_memory_allocated "
                     "during the step, plus the model, optimizer state and inputs.", ""]
        body = "\n\n".join(self.markdown.values())
        R.write_text(self.out / "report.md", "\n".join(head) + "\n" + body + "\n")


def _deadline(args, start: float) -> float | None:
    return start + args.time_limit if args.time_limit else None


def _reps(args, default: int, quick: int) -> int:
    return args.reps if args.reps is not None else (quick if args.quick else default)


def _warmup(args, default: int, quick: int) -> int:
    return args.warmup if args.warmup is not None else (quick if args.quick else default)


# --------------------------------------------------------------------------- parts

def part_units(rep: Report, args, units, *, baselines, name="units", deadline=None,
               title="Single units, forward+backward") -> list[dict]:
    reps, warmup = _reps(args, 7, 2), _warmup(args, 2, 1)
    # Plain PyTorch timed in both layouts: the same-layout and best-vs-best columns.
    layouts = "channels_last" in baselines
    cols = units_mod.columns(layouts=layouts)
    bar = _bar(len(units) * reps, f"bench {name}", args)
    printed_header = []

    def on_shape(rows):
        text = R.text_table(rows, cols).splitlines()
        if not printed_header:
            bar.write("\n".join(text[:2]))
            printed_header.append(True)
        bar.write("\n".join(text[2:]))

    with bar:
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(getattr(args, "amp", "none"))
        rows = units_mod.run_units(units, args.device, baselines=baselines,
                                   backends=args.backends, warmup=warmup, reps=reps, amp=amp,
                                   deadline=deadline, progress=bar, on_shape=on_shape,
                                   min_sample_s=0.0 if args.quick else None)
    measured = units_mod.table_rows(rows)
    skipped = [r["shape"] for r in rows if r.get("skipped")]
    plot_path = rep.png(f"{name}-ratio.png")
    plots = []
    if plot_path is not None and measured:
        units_mod.plot_ratios(rows, plot_path, f"{title}: ratio to the plain unit\n"
                              f"{R.short_machine(rep.doc['machine'])}")
        plots.append(plot_path.name)
    all_cols = cols + (units_mod.bandwidth_cols()
                       if any("bandwidth_fraction" in r for r in measured) else []) \
        + (units_mod.modeled_cols() if any("modeled_s" in r for r in measured) else [])
    bw_path = rep.png(f"{name}-bandwidth.png")
    if bw_path is not None and units_mod.plot_bandwidth(rows, bw_path, f"{title}: achieved "
                                                       "bandwidth of the Triton kernels"):
        plots.append(bw_path.name)
    md = [f"## {title}", "",
          f"`{name}`: {len(units) - len(skipped)} shapes, {warmup} warm-up steps and {reps} "
          "timed samples per candidate, interleaved"
          + (" (a sample: the mean of as many consecutive steps as last "
             f"{units_mod.CPU_MIN_SAMPLE_S * 1e3:.0f} ms, the steady state of a training loop)"
             if args.device.type == "cpu" and not args.quick else "")
          + "; `x plain` is the median step time over the plain "
          "unit's (nn.BatchNorm2d + ReLU + nn.Conv2d, NCHW, eager) in the same run; `saved` "
          "is what autograd keeps for backward (fusedres.memory.saved_bytes), `peak` the peak "
          "memory of the step (unit parameters, inputs and everything the step allocates).",
          ""]
    if layouts:
        md += ["`x plain same layout`: a fused row over the plain unit in its own layout (fused "
               "NCHW / plain NCHW, fused channels_last / plain channels_last). `best x best "
               "plain`, on the row of each backend's faster layout: that row over the faster "
               "of plain NCHW and plain channels_last (named in brackets, `cl` = "
               "channels_last): the fused unit against plain PyTorch in the layout a user "
               "would pick.", ""]
    if any("bandwidth_fraction" in r for r in measured):
        md += ["Bandwidth: modeled DRAM bytes of the fused Triton step (kernels/traffic.py) / "
               "measured median time, and its fraction of the device's peak (2 x memory clock "
               "x bus width).", ""]
    if any("modeled_s" in r for r in measured):
        md += ["MODELED: tools.perfmodel's time for the plain sequence (plain row) and the "
               "fused Triton kernels (triton channels_last row). `kernels ms`: the GPU time of "
               "one step's kernels by torch.profiler (3 profiled steps), what the model prices; "
               "`replay ms`: the step replayed from a CUDA graph (20 replays, CUDA events), its "
               "kernels with the gaps between them and no host time; the median wall time also "
               "holds the host's time between launches.", ""]
    md += [R.markdown_table(measured, all_cols), ""]
    summary = units_mod.layout_summary(rows) if layouts else []
    lines = units_mod.summary_lines(summary)
    if lines:
        md += ["Per backend, over the shapes (median ratio; shapes where the fused unit is "
               "slower; the worst):", ""] + [f"- {line}" for line in lines] + [""]
    if skipped:
        md += [f"Not run (time limit): {', '.join(skipped)}.", ""]
    md += [f"![{name}]({p})" for p in plots]
    text = f"\n{title}\n" + R.text_table(measured, all_cols)
    if lines:
        text += "\n" + "\n".join(lines)
    if skipped:
        text += f"\nnot run (time limit): {', '.join(skipped)}"
    rep.add(name, {"rows": rows, "summary": summary, "plots": plots}, text, "\n".join(md))
    return rows


def part_step(rep: Report, args, models, batch, *, variants, layouts=("nchw",),
              plan_budget=None, image_size=None, deadline=None, name="step") -> list[dict]:
    reps, warmup = _reps(args, 5, 2), _warmup(args, 1, 1)
    cols = step_mod.columns()
    bar = _bar(len(models) * reps, "bench step", args)
    with bar:
        rows = step_mod.run_steps(models, batch, args.device, variants=variants,
                                  layouts=layouts, plan_budget=plan_budget, warmup=warmup,
                                  reps=reps, image_size=image_size, deadline=deadline,
                                  progress=bar,
                                  on_model=lambda rs: bar.write(R.text_table(
                                      [r for r in rs if "median_s" in r], cols)))
    measured = [r for r in rows if "median_s" in r]
    skipped = [f"{r['model']} {r.get('variant') or ''} {r.get('layout') or ''}: "
               f"{r['skipped']}".replace("  ", " ") for r in rows if r.get("skipped")]
    plots = []
    path = rep.png(f"{name}.png")
    if path is not None and measured:
        step_mod.plot(rows, path, f"Training step, batch {batch}: "
                      f"{R.short_machine(rep.doc['machine'])}")
        plots.append(path.name)
    md = ["## Whole training steps", "",
          f"The trainer's step (forward, float32 cross-entropy, backward, fused SGD) at batch "
          f"{batch}; {warmup} warm-up "
          f"and {reps} timed steps per variant and layout ({', '.join(layouts)}: model and "
          "batch `.to(memory_format=...)`), all of a model interleaved. images/s is batch / "
          "median step time (min-max over the steps), `ms` the median; `peak` (and on a GPU "
          "`reserved`) is the most memory the row held while it was built and warmed up "
          "(parameters, gradients, optimizer state, batch and everything the step allocates; "
          "a graphed row's capture and graph pool included); `saved` the activations autograd "
          "keeps. `time x best plain` and `peak x "
          "best plain`: over the model's best plain row, the faster of its plain rows"
          + (" (plain NCHW and plain channels_last)" if len(layouts) > 1 else "")
          + ". `plain+ckpt`: the plain model with every unit checkpointed; `fused+plan`: "
          "fusedres.memory.plan at the budget shown; `+graph`: the step replayed from a CUDA "
          "graph captured after warm-up steps (the trainer's `--cuda-graphs`), `x plain "
          "graphed` over the plain graphed row.", "",
          R.markdown_table(measured, cols), ""]
    if skipped:
        md += ["Not run: " + "; ".join(skipped) + ".", ""]
    md += [f"![step]({p})" for p in plots]
    text = "\nWhole training steps\n" + R.text_table(measured, cols)
    if skipped:
        text += "\nnot run: " + "; ".join(skipped)
    rep.add(name, {"rows": rows, "plots": plots}, text, "\n".join(md))
    return rows


def part_fit(rep: Report, args, budget, depth, batch, max_batch, max_depth,
             deadline=None) -> dict:
    cols = fit_mod.columns()
    bar = _bar(None, "bench fit", args)
    with bar:
        doc = fit_mod.run_fit(budget, args.device, depth=depth, batch=batch,
                              max_batch=max_batch, max_depth=max_depth, deadline=deadline,
                              progress=bar, on_result=lambda r: bar.write(
                                  R.text_table([r], cols).splitlines()[-1]))
    plots = []
    path = rep.png("fit.png")
    if path is not None:
        fit_mod.plot(doc, path, f"What fits in {R.fmt_bytes(budget)}: "
                     f"{R.short_machine(rep.doc['machine'])}")
        if path.exists():
            plots.append(path.name)
    probe_cols = [R.Column("variant", "variant", right=False),
                  R.Column("depth", "depth"), R.Column("batch", "batch"),
                  R.Column("peak", "peak_bytes", R.fmt_bytes),
                  R.Column("fits", "fits", lambda v: "yes" if v else "no"),
                  R.Column("note", "reason", right=False)]
    md = [f"## What fits in {R.fmt_bytes(budget)}", "",
          f"Found by running: the largest batch of CIFAR ResNet-{depth} and the deepest CIFAR "
          f"ResNet (bottleneck units, depth 9n+2) at batch {batch} whose training step's peak "
          f"memory stays within {R.fmt_bytes(budget)} (doubling, then bisection; caps: batch "
          f"{max_batch}, depth {max_depth}). `fused+plan` gives the budget to "
          "fusedres.memory.plan, and plans again with the overshoot taken off (at most 3 "
          "plans) when the step went over it. `search`: exact, or a lower bound when the cap "
          "or the time limit stopped it.", "",
          R.markdown_table(doc["results"], cols), "",
          "<details><summary>every probe</summary>", "",
          R.markdown_table(doc["probes"], probe_cols), "", "</details>", ""]
    md += [f"![fit]({p})" for p in plots]
    text = f"\nWhat fits in {R.fmt_bytes(budget)}\n" + R.text_table(doc["results"], cols)
    rep.add("fit", {**doc, "plots": plots}, text, "\n".join(md))
    return doc


def part_selftest(rep: Report, args, timeout: float = 300.0) -> int:
    """``python -m fusedres.apps.selftest`` in a child process (on CPU under TRITON_INTERPRET=1,
    which must be set before triton is imported; on a GPU a kernel fault cannot poison the
    rest of the report's CUDA context). Its table streams through; the rows come back as
    JSON. Returns the number of failed cases (1 when the self-test could not run at all)."""
    import json
    import subprocess
    import tempfile

    device = args.device
    env = dict(os.environ)
    if device.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    reps = 0 if device.type != "cuda" else (2 if args.quick else 10)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "selftest.json"
        cmd = [sys.executable, "-m", "fusedres.apps.selftest", "--device", device.type,
               "--reps", str(reps), "--json", str(path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            out, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, code = f"{_text(e.stdout)}\ntimed out after {timeout:.0f} s", None
        # Written after every case: a timed-out run keeps the cases it finished.
        rows = json.loads(path.read_text()) if path.exists() else []
    table = "\n".join(line for line in out.splitlines() if "Warning" not in line).strip()
    if code == 2 and not rows:  # the triton backend cannot run here: say why, go on
        rep.add("selftest", {"skipped": table}, f"self-test: skipped ({table})",
                f"## Self-test\n\nSkipped: {table}")
        return 0
    failed = sum(not r["ok"] for r in rows) if rows else 1
    summary = (f"{len(rows) - failed}/{len(rows)} passed" if rows
               else f"the self-test did not finish (exit status {code})")
    if code is None and rows:
        summary += (f" before its time ({timeout:.0f} s) ran out; the cases after them did not "
                    "run")
    rep.add("selftest", {"rows": rows, "passed": len(rows) - failed if rows else 0,
                         "failed": failed, "exit_status": code, "output": out[-4000:]},
            table + ("" if rows else "\n" + summary),
            "## Self-test: the GPU backends against the reference\n\n"
            "`python -m fusedres.apps.selftest`: one fused unit forward and backward on the triton "
            "backend against plain PyTorch, worst relative error against a float64 reference "
            "(and PyTorch's own error at that dtype), per dtype and layout.\n\n```\n"
            + table[-6000:] + "\n```\n\n" + summary)
    return failed


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _bar(total, desc, args):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not args.progress, dynamic_ncols=True,
                leave=False, file=sys.stderr)


# --------------------------------------------------------------------------- commands

def run(args) -> int:
    argv = list(getattr(args, "argv", sys.argv[1:]))
    # --time-limit and --slots count from the process's start (the GPU check's slots are its
    # own, and the imports before this line take seconds of them).
    start = process_start()
    deadline = _deadline(args, start)
    title = {"units": "fusedres bench units", "step": "fusedres bench step",
             "fit": "fusedres bench fit", "gpu-report": "fusedres GPU report"}[args.command]
    rep = Report(args.out, title, args.device, argv, append=getattr(args, "append", False))
    rep.doc["machine"]["allocator"] = getattr(args, "allocator", None)
    print(R.machine_line(rep.doc["machine"]), flush=True)
    if args.command == "units":
        part_units(rep, args, args.units, baselines=args.baselines, deadline=deadline)
    elif args.command == "step":
        part_step(rep, args, args.models, args.batch, variants=args.variants,
                  layouts=args.layouts, plan_budget=args.plan_budget,
                  image_size=args.image_size, deadline=deadline)
    elif args.command == "fit":
        cuda = args.device.type == "cuda"
        q = QUICK_FIT if args.quick else {}
        part_fit(rep, args,
                 args.budget or q.get("budget") or (8 * GIB if cuda else 512 * MIB),
                 args.depth or q.get("depth", 164),
                 args.batch or q.get("batch") or (128 if cuda else 16),
                 args.max_batch or q.get("max_batch", 4096),
                 args.max_depth or q.get("max_depth", 1001), deadline=deadline)
    else:
        return gpu_report(rep, args, start)
    if args.out is not None:
        print(f"\nwritten: {args.out}/report.md, results.json and the plots", flush=True)
    return 0


def part_decisive(rep: Report, args, deadline: float | None) -> int:
    """The answer first (:mod:`.decisive`): ResNet-164 and ResNet-1001 training steps at batch
    128, fused against plain, plain channels_last and plain with checkpointing, eager and
    graphed, float32 and bf16 autocast; the table is written after every group of rows. On
    CPU (the dry run) the graphed rows run the captured function eagerly (no CUDA graph)."""
    quick = args.quick
    names = ["preact_resnet20"] if quick else ["preact_resnet164", "preact_resnet1001"]
    batch = 4 if quick else 128
    cpu = args.device.type != "cuda"
    reps = args.reps if args.reps is not None else (2 if quick else 10)
    done: list[dict] = []

    def write(group_rows):
        done.extend(group_rows)
        print(R.text_table([r for r in group_rows if "median_s" in r],
                           decisive.row_columns()), flush=True)
        _decisive_part(rep, done, batch, cpu, final=False)

    rows = decisive.run(names, batch, args.device, image_size=16 if quick else None, reps=reps,
                        deadline=deadline, capture=(lambda fn: fn) if cpu else None,
                        on_group=write)
    _decisive_part(rep, rows, batch, cpu, final=True)
    return 0


def _decisive_part(rep: Report, rows: list[dict], batch: int, cpu: bool, final: bool) -> None:
    measured = [r for r in rows if "median_s" in r]
    skipped = [r for r in rows if "skipped" in r]
    summary = decisive.summary_rows(rows)
    note = ("CPU dry run: the graphed rows run the captured function eagerly (no CUDA graph); "
            "peak memory is the peak of live CPU tensors, no reserved figure. "
            if cpu else "")
    lead = ["## The answer: the fused training step against plain PyTorch", "",
            f"Training step (forward, float32 cross-entropy, backward, fused SGD) at batch "
            f"{batch}, eager and replayed from a CUDA graph. `fused time x best plain`: the "
            "fused step's median time over the faster of plain NCHW and plain channels_last; "
            "`ckpt at fused memory`: plain NCHW with the fewest units checkpointed that bring "
            "its saved activations to the fused model's; `its time x fused` above 1 means "
            f"fused is that much faster at the same memory. {note}"
            + ("" if final else "(Partial: the groups below finished so far.)"), "",
            R.markdown_table(summary, decisive.summary_columns())]
    rep.lead("\n".join(lead))
    md = ["## Training steps, every row", "",
          "Rows of a group (model, dtype, eager or graphed) built one after the other, each in "
          "its own memory window (`peak alloc`, `peak reserved`: the caching allocator's peaks "
          "over the row's build, warm-up and capture, above what other rows held; a graphed "
          "row's `graph pool` is its private pool), then timed interleaved; `n` samples, "
          "median `ms` (min-max).", "",
          R.markdown_table(measured, decisive.row_columns()), "",
          "One-time costs (not in the step times): an eager row's first step over its median "
          "(the Triton JIT, cuDNN's and the allocator's first-time work), a graphed row's "
          "capture with its first replay, the count behind `ckpt-mem`.", "",
          R.markdown_table(measured, decisive.once_columns()), ""]
    if skipped:
        md += ["Not run: " + "; ".join(
            f"{r['model'].replace('preact_resnet', 'ResNet-')} {r['amp']} {r['mode']} "
            f"{r['variant']} ({r['skipped']})" for r in skipped) + ".", ""]
    text = "\nThe answer\n" + R.text_table(summary, decisive.summary_columns())
    rep.add("decisive", {"rows": rows, "summary": summary, "final": final},
            text if final else None, "\n".join(md))


def part_replay(rep: Report, args, deadline: float | None) -> int:
    """Per-unit kernel time: the single BN-ReLU-convs on the Triton backend and plain PyTorch,
    each step replayed from a CUDA graph beside tools.perfmodel's MODELED time (on CPU, the
    dry run, the quick shape without either column)."""
    convs = S.QUICK_CONVS[:1] if args.quick else S.CIFAR_CONVS + S.GPU_CONVS
    args.backends = [b for b in ("triton",) if b in units_mod.fused_backends(args.device)] \
        or None
    part_units(rep, args, convs, baselines=("plain", "channels_last"), name="replay",
               deadline=deadline, title="Per-unit kernel time against the MODELED figure")
    return 0


def part_cuda(rep: Report, args, deadline: float | None) -> int:
    """The units on every fused backend that runs, the cuda backend's C++ kernels among them
    once fusedres._C is built for the GPU (the GPU check builds it before this part)."""
    reason = fusedres.unavailable_reason("cuda", args.device)
    if reason is not None:
        rep.add("cuda", {"skipped": reason}, f"cuda backend: skipped ({reason})",
                f"## Units on the cuda backend\n\nNot run: {reason}.")
        return 0
    blocks = S.QUICK_BLOCKS[:1] if args.quick else S.R50_BOTTLENECKS + S.CIFAR_BOTTLENECKS
    args.backends = None
    part_units(rep, args, blocks, baselines=("plain", "channels_last"), name="cuda",
               deadline=deadline, title="Units on every GPU backend")
    return 0


def part_blocks(rep: Report, args, deadline: float | None) -> int:
    blocks = S.QUICK_BLOCKS[:1] if args.quick else S.CIFAR_BOTTLENECKS + S.CIFAR_BASIC_BLOCKS
    args.backends = None
    part_units(rep, args, blocks, baselines=("plain", "channels_last", "checkpoint"),
               deadline=deadline, title="Units, forward+backward")
    return 0


def part_compile(rep: Report, args, deadline: float | None) -> int:
    """torch.compile of the plain unit on a few shapes (inductor compiles each for tens of
    seconds): the last part, it takes what time is left."""
    compiled = S.QUICK_CONVS[:1] if args.quick else [
        S.CIFAR_BOTTLENECKS[0], S.CIFAR_BOTTLENECKS[3], S.R50_BOTTLENECKS[1],
        S.R50_BOTTLENECKS[6], S.CIFAR_BASIC_BLOCKS[0]]
    args.backends = None
    part_units(rep, args, compiled, baselines=("plain", "compile"), name="compile",
               deadline=deadline, title="Against torch.compile of the plain unit")
    return 0


def part_gpu_fit(rep: Report, args, deadline: float | None) -> int:
    q = QUICK_FIT if args.quick else {"budget": 8 * GIB, "depth": 164, "batch": 128,
                                      "max_batch": 4096, "max_depth": 1001}
    part_fit(rep, args, args.budget or q["budget"], q["depth"], q["batch"], q["max_batch"],
             q["max_depth"], deadline=deadline)
    return 0


def part_gpu_selftest(rep: Report, args, deadline: float | None) -> int:
    left = 300.0 if deadline is None else max(5.0, deadline - time.monotonic())
    return part_selftest(rep, args, timeout=left)


# The GPU report's parts in the order they run, the order of importance: the answer, the
# kernels' time against the model, the self-test, then what needs fusedres._C built for the
# GPU (the GPU check builds it between the self-test and the cuda part), units, fit, compile.
# Each is called as runner(rep, args, deadline) (``deadline``: a time.monotonic() value by
# which it stops starting work; None: no limit) and returns its failed cases.
GPU_PARTS: dict[str, Callable[..., int]] = {
    "decisive": part_decisive, "replay": part_replay, "selftest": part_gpu_selftest,
    "cuda": part_cuda, "units": part_blocks, "fit": part_gpu_fit, "compile": part_compile}


def gpu_report(rep: Report, args, start: float) -> int:
    """The parts of ``args.parts`` (default: every one of :data:`GPU_PARTS`, in its order),
    each printed and written as it finishes. ``args.slots`` (part -> seconds after ``start``):
    the time by which each part ends; a part without one runs until ``--time-limit``. A part
    stops starting work a margin before its end (5% of what it has, at least 3 s), so that
    writing what it measured fits; one that would start after its end is listed as not run."""
    total = args.time_limit
    slots = getattr(args, "slots", None) or {}
    failed = 0
    for name in getattr(args, "parts", None) or list(GPU_PARTS):
        end = slots.get(name, total)
        deadline = None
        if end is not None:
            now = time.monotonic()
            end_at = start + end
            if now >= end_at:
                rep.add(name, {"skipped": "its time slot ended before it could start"},
                        f"{name}: not run (its time slot ended before it could start)",
                        f"## {name}\n\nNot run: its time slot ended before it could start.")
                continue
            deadline = end_at - max(3.0, 0.05 * (end_at - now))
        failed += _timed(name, lambda name=name, deadline=deadline:
                         GPU_PARTS[name](rep, args, deadline), start) or 0
    elapsed = time.monotonic() - start
    print(f"\ngpu-report finished in {elapsed:.0f} s"
          + (f"; written to {args.out}/ (report.md, results.json, PNGs)" if args.out else ""),
          flush=True)
    rep.doc["elapsed_s"] = elapsed
    rep.flush()
    return 1 if failed else 0


def _timed(what: str, fn: Callable[[], Any], start: float | None = None) -> Any:
    """Runs a part between two progress lines: ``[what: started at N s]`` (seconds since
    ``start``, when given) and ``[what: N s]``; a wrapper (the GPU check) reads the last
    started part from them when it has to cut a run off."""
    t0 = time.monotonic()
    if start is not None:
        print(f"[{what}: started at {t0 - start:.0f} s]", flush=True)
    out = fn()
    print(f"[{what}: {time.monotonic() - t0:.0f} s]", flush=True)
    return out
