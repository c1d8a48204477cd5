"""The GPU check: one command for a bare GPU machine (``make gpu-check OUT=dir``).

Such a machine has its own python3 (torch, triton, nvcc; no pip index, no network) and starts
bare (no build, no Triton cache), so nothing is installed and no venv is made: this script runs
with that python3, uses only the standard library, and spends its time limit (``--time-limit``,
default 530 s: done in <= 9 minutes) in the order of what matters most (:data:`PLAN`):

1. probe: versions (torch, triton, numpy, CUDA), the GPU and its compute capability, in a short
   child process; a prepared fusedres._C (``make gpu-prepare`` on a CPU machine: built against
   the device's torch for its GPU, carried in) is put in place and loaded in a second child;
2. decisive: ``python3 -m fusedres.apps.bench gpu-report --parts decisive``: the training step
   of ResNet-164 and ResNet-1001 at batch 128, fused against plain PyTorch, eager and
   CUDA-graphed, float32 and bf16 (fusedres/apps/bench/decisive.py). It runs on the Triton
   backend, which needs no build, and is written to report.md and results.json as each group
   of rows finishes; its slot ends by 285 s (the table in <= 5 minutes);
3. replay, selftest: the per-unit kernel times beside the MODELED ones, the kernels against the
   reference (the report's next parts, ``--append``);
4. build: ``fusedres._C`` in place for the visible GPU only, with every core
   (``TORCH_CUDA_ARCH_LIST`` from the capability, ``MAX_JOBS`` = cores,
   ``FUSEDRES_BUILD_EXT=1 FUSEDRES_BUILD_CUDA=1 FUSEDRES_BUILD_TEST_EXT=0 python3 setup.py -q
   build_ext --inplace``); skipped when the prepared one loaded; a failed build is reported
   and the rest still runs (without the cuda backend);
5. cuda, units, fit, compile: the report's last parts, the cuda backend's among them;
6. pack: the device machine returns at most 8 files of at most 16 MiB, two folders deep, so the
   folder holds at most four: report.md, results.json (with a ``gpu_check`` entry: versions,
   the plan, each phase's time, what was cut off), gpu-check.log (this script's progress, the
   build's output, the report's output) and plots.zip (the PNGs report.md shows).

Every phase ends by its planned end (the sum of the slots up to it, scaled to the time limit):
a report process is stopped there, with its process group, and what it wrote before is kept;
a phase that finishes early leaves its time to the ones after it, and the build, when the
prepared library loaded, leaves its slot to the self-test. The plan is printed first.

``--device cpu --quick`` is the dry run CI makes (.ci/run): the same phases on CPU (the build
without CUDA: ninja finds it done after ``make install``; the report's quick shapes). Exit
status: 0 when every phase passed, 1 when one failed or was cut off, 2 for bad usage (an
argument, or ``--device cuda`` without a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILES = 8  # what the device machine returns from its output folder
MAX_FILE_BYTES = 16 * 2 ** 20
OURS = ("report.md", "results.json", "gpu-check.log", "plots.zip")
LOG_KEEP_BYTES = 4 * 2 ** 20  # the log's size cap (head and tail kept)
# The phases in the order they run, which is the order of importance, with the seconds each
# may take (scaled to --time-limit). A phase ends by the sum of the slots up to it. The report's
# parts (fusedres.apps.bench.runner.GPU_PARTS) run in three processes: "decisive" alone, then
# "replay" and "selftest", then, after the build, the rest.
PLAN = (("probe", 20.0), ("decisive", 265.0), ("replay", 50.0), ("selftest", 45.0),
        ("build", 95.0), ("cuda", 20.0), ("units", 10.0), ("fit", 10.0), ("compile", 5.0),
        ("pack", 10.0))
REPORT_PROCESSES = (("decisive",), ("replay", "selftest"), ("cuda", "units", "fit", "compile"))
DEFAULT_TIME_LIMIT = sum(s for _, s in PLAN)  # 530 s, everything included: <= 9 minutes
DECISIVE_BY_S = 300.0  # the bound on the decisive table, at the default limit
MIN_TIME_LIMIT = 5.0
QUIET_S = 30.0  # a progress line when a step has printed nothing for this long
BUILD_MIN_S = 10.0  # a build with less left of its slot is not started
PREPARED = ROOT / "build" / "gpu-prepare"  # make gpu-prepare's folder, carried to the device

PROBE = r"""
import json, os, sys
info = {"python": sys.version.split()[0], "executable": sys.executable, "cores": os.cpu_count()}
try:
    import torch
    info.update(torch=torch.__version__, cuda_runtime=torch.version.cuda,
                cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=[p.major, p.minor], gpu_memory_bytes=p.total_memory,
                    gpu_count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version())
except Exception as e:
    info["torch_error"] = f"{type(e).__name__}: {e}"
for name in ("triton", "numpy"):
    try:
        info[name] = __import__(name).__version__
    except Exception:
        info[name] = None
print(json.dumps(info))
"""


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 through main (argparse's is two lines)
        raise UsageError(message)


def load_versions():
    """fusedres/_versions.py by path (as setup.py loads settings.py): the supported-version
    rule, without importing fusedres (and so torch) in this process."""
    spec = importlib.util.spec_from_file_location("_fusedres_versions",
                                                  ROOT / "fusedres" / "_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arch_list(capability) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for one GPU: its compute capability, (9, 0) -> "9.0"."""
    major, minor = (int(v) for v in capability)
    return f"{major}.{minor}"


def build_env(base: dict, device: str, capability=None, cores: int | None = None) -> dict:
    """The environment of the in-place build: the extension required, CUDA for the visible GPU
    only (none on CPU), no test extension, every core."""
    env = dict(base)
    env.update(FUSEDRES_BUILD_EXT="1", FUSEDRES_BUILD_TEST_EXT="0",
               MAX_JOBS=str(cores or os.cpu_count() or 1))
    if device == "cuda":
        env.update(FUSEDRES_BUILD_CUDA="1", TORCH_CUDA_ARCH_LIST=arch_list(capability))
    else:
        env["FUSEDRES_BUILD_CUDA"] = "0"
    return env


def plan_ends(time_limit: float) -> dict[str, float]:
    """Each phase's planned end, in seconds from the start: the running sum of :data:`PLAN`'s
    slots, scaled so that the last ends at ``time_limit``."""
    scale = time_limit / DEFAULT_TIME_LIMIT
    ends, t = {}, 0.0
    for name, seconds in PLAN:
        t += seconds * scale
        ends[name] = t
    return ends


def plan_lines(time_limit: float) -> list[str]:
    """The plan as printed first: each phase's slot and its end."""
    ends, before = plan_ends(time_limit), 0.0
    out = []
    for name, _ in PLAN:
        out.append(f"  {name:<9} {ends[name] - before:5.0f} s, ends by {ends[name]:4.0f} s")
        before = ends[name]
    return out


class Check:
    """One run: the clock, the log, the progress lines, the plan's deadlines."""

    def __init__(self, out: Path, time_limit: float, clock=time.monotonic):
        self.out = out
        self.clock = clock
        self.start = clock()
        self.time_limit = time_limit
        self.ends = plan_ends(time_limit)
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu-check.log"
        self.log = open(self.log_path, "w", buffering=1)
        self.facts: dict = {"time_limit_s": time_limit, "steps": {},
                            "plan": {k: round(v, 1) for k, v in self.ends.items()}}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def drop(self, phase: str) -> None:
        """``phase`` will not run: its slot goes to the phase before it. The build, when the
        prepared library loaded, gives its time to the self-test: its cuda and cuda:cutlass
        rows are what FUSEDRES_CUDA_KERNELS's default waits for."""
        names = [name for name, _ in PLAN]
        if names.index(phase) == 0:
            raise ValueError(f"drop: {phase!r} is the first phase; no phase before it")
        before = names[names.index(phase) - 1]
        self.ends[before] = self.ends[phase]
        self.facts["plan"][before] = round(self.ends[before], 1)

    def until(self, phase: str) -> float:
        """Seconds left until ``phase``'s planned end."""
        return self.start + self.ends[phase] - self.clock()

    def say(self, text: str) -> None:
        """A progress line, on stdout and in the log."""
        line = f"gpu-check [{self.elapsed():4.0f} s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def record(self, text: str) -> None:
        """Into the log only (the build's output)."""
        self.log.write(text if text.endswith("\n") else text + "\n")


def run_child(check: Check, cmd: list[str], env: dict, limit: float, *, echo: bool,
              on_line=None, on_quiet=None, quiet_s: float | None = None,
              cwd: Path = ROOT) -> tuple[int | None, bool]:
    """Runs ``cmd`` in its own process group, its output line by line into the log (and to
    stdout when ``echo``); ``on_quiet(seconds)`` when it has printed nothing for ``quiet_s``
    (a heartbeat); after ``limit`` seconds SIGTERM to the group, SIGKILL 5 s later. Returns
    (exit status, or None when the limit stopped it; whether the limit stopped it)."""
    quiet_s = QUIET_S if quiet_s is None else quiet_s
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    last = [time.monotonic()]

    def pump():
        for line in proc.stdout:
            last[0] = time.monotonic()
            check.record(line)
            if echo:
                print(line, end="", flush=True)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    end = time.monotonic() + max(1.0, limit)
    timed_out = False
    while True:
        now = time.monotonic()
        if now >= end:
            timed_out = True
            break
        try:
            proc.wait(timeout=min(1.0, end - now))
            break
        except subprocess.TimeoutExpired:
            if on_quiet is not None and time.monotonic() - last[0] >= quiet_s:
                on_quiet(time.monotonic() - last[0])
                last[0] = time.monotonic()
    if timed_out:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5.0)
    return (None if timed_out else proc.returncode), timed_out


def probe(check: Check, python: str) -> dict:
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                              timeout=max(5.0, check.until("probe")), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"probe_error": "the probe timed out"}
    if proc.stderr.strip():
        check.record(proc.stderr)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"probe_error": (proc.stdout + proc.stderr)[-500:]}


LOAD_CHECK = r"""
import json
import fusedres
from fusedres.ops import _extension
print(json.dumps({"loaded": _extension.LOADED, "error": _extension.LOAD_ERROR,
                  "cuda": fusedres.unavailable_reason("cuda", "cuda"),
                  "kernel_sets": list(fusedres.cuda_kernel_sets())}))
"""


def load_check(python: str, cwd: Path, timeout: float | None = None) -> dict:
    """fusedres._C imported by ``python`` in ``cwd`` (LOAD_CHECK's facts: loaded, the load
    error, why the cuda backend cannot run, the kernel sets), or ``{"loaded": False, "error":
    ...}`` when the child gave no answer. Here for the prepared library on the GPU machine;
    tools/gpu_prepare.py runs it on the library it built."""
    try:
        proc = subprocess.run([str(python), "-c", LOAD_CHECK], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"loaded": False, "error": f"{type(e).__name__}"}


# What fusedres._C is compiled from: a prepared library built from other sources is stale.
SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the extension's sources (csrc/, setup.py), path and content of each."""
    h = hashlib.sha256()
    files = [p for p in (root / "csrc").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    for path in sorted(files) + [root / "setup.py"]:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def prepared_problem(manifest: dict, info: dict, sources: str | None = None) -> str | None:
    """Why ``make gpu-prepare``'s library cannot serve this machine (None: it can): it was
    built from other sources than this tree's (``sources``: :func:`sources_digest`), against
    another torch, or for another GPU architecture."""
    if sources is not None and manifest.get("sources") != sources:
        return (f"built from other sources (commit {str(manifest.get('commit'))[:12]}): "
                "csrc/ or setup.py changed since; make gpu-prepare again")
    if manifest.get("torch") != info.get("torch"):
        return (f"built against torch {manifest.get('torch')}, this machine has torch "
                f"{info.get('torch')}")
    arch = arch_list(info["capability"]) if info.get("capability") else None
    if arch not in manifest.get("arch_list", []):
        return (f"built for compute capability {', '.join(manifest.get('arch_list', []))}, "
                f"this GPU is {arch}")
    return None


def step_prepared(check: Check, python: str, info: dict, folder: Path) -> bool:
    """Put ``make gpu-prepare``'s fusedres._C (a stable-ABI library: any Python 3) in place
    and load it in a child; True when it loaded with the cuda backend, else it is removed and
    the build will make one."""
    facts = check.facts["steps"]["prepared"] = {"folder": str(folder)}
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        facts["status"] = f"none ({type(e).__name__})"
        check.say(f"prepared: no prepared library in {folder}; the build makes one")
        return False
    problem = prepared_problem(manifest, info, sources_digest())
    if problem is not None:
        facts["status"] = f"not used: {problem}"
        check.say(f"prepared: not used ({problem}); the build makes one")
        return False
    target = ROOT / "fusedres" / manifest["file"]
    shutil.copy2(folder / manifest["file"], target)
    loaded = load_check(python, ROOT, timeout=max(5.0, check.until("probe")))
    ok = bool(loaded.get("loaded")) and loaded.get("cuda") is None
    facts.update(manifest=manifest, load=loaded, status="loaded" if ok else "failed to load")
    if not ok:
        target.unlink()
        why = loaded.get("error") or loaded.get("cuda")
        check.say(f"prepared: {manifest['file']} did not load ({why}); the build makes one")
    else:
        check.say(f"prepared: {manifest['file']} loaded (torch {manifest['torch']}, "
                  f"{', '.join(manifest['arch_list'])}); no build needed")
    return ok


def step_build(check: Check, python: str, device: str, info: dict) -> bool:
    env = build_env(os.environ, device, info.get("capability"), info.get("cores"))
    limit = check.until("build")
    what = (f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} " if device == "cuda" else "") \
        + f"MAX_JOBS={env['MAX_JOBS']} FUSEDRES_BUILD_CUDA={env['FUSEDRES_BUILD_CUDA']}"
    facts = check.facts["steps"]["build"] = {"env": what, "limit_s": round(limit)}
    if limit < BUILD_MIN_S:
        check.say(f"build: skipped, {limit:.0f} s left of its slot is too little")
        facts["status"] = "skipped"
        return False
    check.say(f"build: fusedres._C in place ({what}), at most {limit:.0f} s")
    t0 = check.clock()
    seen = {"step": "", "said": t0}

    def on_line(line: str) -> None:
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if m:
            seen["step"] = f"{m.group(1)}/{m.group(2)}"
        if check.clock() - seen["said"] >= 20:
            seen["said"] = check.clock()
            check.say(f"build: ninja step {seen['step'] or '-'}, {check.clock() - t0:.0f} s")

    def on_quiet(seconds: float) -> None:
        seen["said"] = check.clock()
        check.say(f"build: ninja step {seen['step'] or '-'}, {check.clock() - t0:.0f} s")

    code, timed_out = run_child(check, [python, "setup.py", "-q", "build_ext", "--inplace"],
                                env, limit, echo=False, on_line=on_line, on_quiet=on_quiet,
                                quiet_s=20.0)
    seconds = check.clock() - t0
    ok = code == 0
    facts.update(seconds=round(seconds, 1), exit_status=code, timed_out=timed_out,
                 status="ok" if ok else ("timed out" if timed_out else "failed"))
    check.say(f"build: {facts['status']} in {seconds:.0f} s"
              + ("" if ok else " (the rest runs without it; the output is in gpu-check.log)"))
    return ok


def step_report(check: Check, python: str, device: str, quick: bool, parts: tuple[str, ...],
                append: bool) -> dict:
    """One report process for ``parts``, each given its planned end (``--slots``, seconds from
    the process's start), stopped with its process group at the last one's."""
    now = check.elapsed()
    slots = {p: check.ends[p] - now for p in parts if check.ends[p] - now > 1.0}
    name = "report:" + ",".join(parts)
    if not slots:
        check.facts["steps"][name] = {"status": "skipped: its time slot ended"}
        check.say(f"report {','.join(parts)}: skipped, its time slot ended")
        return check.facts["steps"][name]
    hard = check.until(parts[-1])
    cmd = [python, "-m", "fusedres.apps.bench", "gpu-report", "--out", str(check.out),
           "--parts", ",".join(slots), "--no-progress", "--device", device,
           "--slots", ",".join(f"{p}={v:.0f}" for p, v in slots.items()),
           *(["--append"] if append else []), *(["--quick"] if quick else [])]
    facts = check.facts["steps"][name] = {"command": " ".join(cmd[1:]),
                                          "hard_limit_s": round(hard)}
    check.say(f"report {','.join(slots)}: " + ", ".join(f"{p} until {check.ends[p]:.0f} s"
                                                        for p in slots))
    started: list[str] = []

    def on_line(line: str) -> None:
        m = re.match(r"\[([\w-]+): started at", line)
        if m:
            started.append(m.group(1))

    def on_quiet(seconds: float) -> None:
        check.say(f"report: in part {started[-1] if started else '-'}, nothing printed for "
                  f"{seconds:.0f} s")

    t0 = check.clock()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    code, timed_out = run_child(check, cmd, env, hard, echo=True, on_line=on_line,
                                on_quiet=on_quiet)
    seconds = check.clock() - t0
    facts.update(seconds=round(seconds, 1), exit_status=code, timed_out=timed_out,
                 parts_started=started)
    if timed_out:
        facts["cut_off_in"] = started[-1] if started else None
        check.say(f"report: stopped at the end of its slot after {seconds:.0f} s, in part "
                  f"{facts['cut_off_in']}: what it wrote before is in report.md and "
                  "results.json, its rows so far in gpu-check.log")
    else:
        check.say(f"report: exit status {code} after {seconds:.0f} s")
    return facts


def pack(out: Path) -> list[str]:
    """The folder within what the device machine returns: leftover temporary files removed,
    the PNGs into plots.zip (stored: PNGs do not compress), the log capped. Returns the
    problems left (files over the count or the size)."""
    for tmp in out.glob("*.tmp"):
        tmp.unlink()
    pngs = sorted(out.glob("*.png"))
    if pngs:
        with zipfile.ZipFile(out / "plots.zip", "w", zipfile.ZIP_STORED) as z:
            for p in pngs:
                z.write(p, p.name)
        for p in pngs:
            p.unlink()
    return budget_problems(out)


def budget_problems(out: Path) -> list[str]:
    problems = []
    entries = sorted(out.iterdir())
    files = [p for p in entries if p.is_file()]
    if len(entries) > MAX_FILES:
        problems.append(f"{len(entries)} entries in {out}, the device returns {MAX_FILES}")
    for p in entries:
        if not p.is_file():
            problems.append(f"{p.name}: not a plain file")
    for p in files:
        if p.stat().st_size > MAX_FILE_BYTES:
            problems.append(f"{p.name}: {p.stat().st_size} bytes, over {MAX_FILE_BYTES}")
    return problems


def cap_log(path: Path, keep: int = LOG_KEEP_BYTES) -> None:
    data = path.read_bytes()
    if len(data) <= keep:
        return
    head, tail = data[:keep // 4], data[-(keep - keep // 4):]
    path.write_bytes(head + f"\n[... {len(data) - keep} bytes cut ...]\n".encode() + tail)


def annotate(out: Path, facts: dict) -> None:
    """The check's facts into results.json (key ``gpu_check``) and a section at the end of
    report.md (written by the report; absent if it never got that far): the versions, the
    plan, what each phase did."""
    results = out / "results.json"
    if results.exists():
        try:
            doc = json.loads(results.read_text())
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            doc["gpu_check"] = facts
            tmp = results.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            os.replace(tmp, results)
    report = out / "report.md"
    if not report.exists():
        return
    probe = facts["probe"]
    lines = ["## GPU check", "",
             f"`make gpu-check` (benchmarks/gpu_check.py), {facts['elapsed_s']:.0f} s of its "
             f"{facts['time_limit_s']:.0f} s limit; python {probe.get('python')}, "
             f"torch {probe.get('torch')}, triton {probe.get('triton')}, "
             f"numpy {probe.get('numpy')}"
             + (f", {probe['gpu']} (compute capability {arch_list(probe['capability'])})"
                if probe.get("gpu") else "") + ".", ""]
    lines += [f"- unsupported: {p}" for p in facts.get("version_problems", [])]
    lines.append("- plan (each phase ends by): " + ", ".join(
        f"{k} {v:.0f} s" for k, v in facts["plan"].items()))
    for name, step in facts["steps"].items():
        lines.append(f"- {name}: {_step_line(step)}")
    lines += ["- plots: in plots.zip (the device returns at most 8 files): unzip it here and "
              "the images above show.", ""]
    report.write_text(report.read_text().rstrip("\n") + "\n\n" + "\n".join(lines))


def _step_line(step: dict) -> str:
    if step.get("timed_out"):
        return (f"stopped at the end of its slot in part `{step.get('cut_off_in')}` after "
                f"{step.get('seconds', 0):.0f} s: what finished before is above")
    if "exit_status" in step:
        return (f"{step.get('status') or 'exit status ' + str(step['exit_status'])} in "
                f"{step.get('seconds', 0):.0f} s" + (f" ({step['env']})" if "env" in step else ""))
    return str(step.get("status", "not run"))


def parse(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the report (made if missing)")
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                    help=f"seconds for everything, the build included (default "
                         f"{DEFAULT_TIME_LIMIT:.0f}); the plan's slots are scaled to it")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when a GPU is visible")
    ap.add_argument("--quick", action="store_true",
                    help="the report's quick shapes (the CPU dry run)")
    ap.add_argument("--no-build", dest="build", action="store_false",
                    help="use fusedres._C as it is")
    ap.add_argument("--prepared", default=str(PREPARED),
                    help="make gpu-prepare's folder (default build/gpu-prepare): its "
                         "fusedres._C is used when it loads, and the build is skipped")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that builds and runs the report (default: this one)")
    args = ap.parse_args(argv)
    if not args.time_limit >= MIN_TIME_LIMIT:
        raise UsageError(f"--time-limit: expected at least {MIN_TIME_LIMIT:.0f} seconds, got "
                         f"{args.time_limit:g}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {args.out!r} exists and is not a folder")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if not is_ours(p)]
        if foreign:
            raise UsageError(f"--out: {args.out!r} holds {foreign[0]!r}, which no GPU check "
                             "wrote (the device returns the whole folder: name an empty, new "
                             "or earlier GPU check's folder)")
    return args


def is_ours(p: Path) -> bool:
    """A file an earlier GPU check of the same folder wrote (replaced by this one)."""
    return p.is_file() and (p.name in OURS or p.suffix in (".png", ".tmp"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    python = args.python
    out = Path(args.out)
    if out.is_dir():
        for p in out.iterdir():  # an earlier check's files (parse refused any other)
            p.unlink()
    check = Check(out, args.time_limit)
    try:
        return _run(check, args, python)
    finally:
        check.log.close()
        cap_log(check.log_path)


def _probe_phase(check: Check, args, python: str) -> tuple[dict, str] | int:
    """The probe; (what it found, the device) or an exit status."""
    check.say(f"probe: {python}")
    info = probe(check, python)
    check.facts["probe"] = info
    if "probe_error" in info or "torch_error" in info:
        check.say(f"probe: failed: {info.get('probe_error') or info.get('torch_error')}")
        return 1
    device = args.device
    if device == "auto":
        device = "cuda" if info.get("cuda_available") else "cpu"
    if device == "cuda" and not info.get("cuda_available"):
        check.say("error: --device cuda, but torch sees no CUDA device")
        return 2
    versions = load_versions()
    problems = [p for p in (versions.torch_problem(info["torch"]),
                            info.get("triton") and versions.triton_problem(info["triton"]))
                if p]
    check.facts["version_problems"] = problems
    check.say(f"probe: python {info['python']}, torch {info['torch']}, triton "
              f"{info.get('triton')}, numpy {info.get('numpy')}, {info['cores']} cores"
              + (f", {info['gpu']} (compute capability {arch_list(info['capability'])}, "
                 f"{info['gpu_memory_bytes'] / 2 ** 30:.0f} GiB)" if device == "cuda" else
                 ", no GPU: the CPU dry run"))
    for p in problems:
        check.say(f"probe: unsupported: {p}")
    return info, device


def _run(check: Check, args, python: str) -> int:
    check.say(f"plan ({check.time_limit:.0f} s in all; the decisive table by "
              f"{check.ends['decisive']:.0f} s):")
    for line in plan_lines(check.time_limit):
        check.say(line)
    found = _probe_phase(check, args, python)
    if isinstance(found, int):
        return found
    info, device = found
    prepared = device == "cuda" and args.build and step_prepared(check, python, info,
                                                                  Path(args.prepared))
    if prepared:
        check.drop("build")
        check.say(f"plan: no build; the selftest runs until {check.ends['selftest']:.0f} s")
    reports = []
    for i, parts in enumerate(REPORT_PROCESSES):
        if "cuda" in parts:  # the build comes before the parts that use fusedres._C
            build_ok = True
            if prepared:
                check.facts["steps"]["build"] = {"status": "not needed (the prepared library)"}
            elif args.build:
                build_ok = step_build(check, python, device, info)
            else:
                check.facts["steps"]["build"] = {"status": "not asked (--no-build)"}
        reports.append(step_report(check, python, device, args.quick, parts, append=i > 0))
    check.facts["elapsed_s"] = check.elapsed()
    annotate(check.out, check.facts)
    pngs = sorted(p.name for p in check.out.iterdir() if p.suffix == ".png")
    check.say(f"pack: {', '.join(pngs)} -> plots.zip" if pngs else "pack: no plots")
    check.log.flush()
    problems = pack(check.out)
    for p in problems:
        check.say(f"pack: over the device's budget: {p}")
    files = sorted(p.name for p in check.out.iterdir())
    ok = build_ok and all(r.get("exit_status") == 0 for r in reports) and not problems
    check.say(f"{'done' if ok else 'finished with a failure'} in {check.elapsed():.0f} s "
              f"(limit {check.time_limit:.0f} s): {len(files)} files in {check.out}: "
              + ", ".join(files))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
