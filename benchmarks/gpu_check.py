"""The GPU check: one command for a bare GPU machine (``make gpu-check OUT=dir``).

Such a machine has its own python3 (torch, triton, nvcc; no pip index, no network), so nothing
is installed and no venv is made: this script runs with that python3 and uses only the standard
library, then, within one time limit (``--time-limit``, default 530 s: done in <= 9 minutes):

1. probe: versions (torch, triton, numpy, CUDA), the GPU and its compute capability, in a short
   child process (the CUDA context it opens is gone before the build and the report start);
2. build: ``fusedres._C`` in place for the visible GPU only, with every core
   (``TORCH_CUDA_ARCH_LIST`` from the capability, ``MAX_JOBS`` = cores,
   ``FUSEDRES_BUILD_EXT=1 FUSEDRES_BUILD_CUDA=1 FUSEDRES_BUILD_TEST_EXT=0 python3 setup.py -q
   build_ext --inplace``); ninja's ``[n/N]`` shown as it goes. A failed build is reported and
   the report still runs (without the cuda backend);
3. report: ``python3 -m fusedres.apps.bench gpu-report`` (self-test, units, steps of every kind in
   fusedres.apps.bench.runner.STEP_KINDS, fit) with the time that is left less a margin as its own
   limit (its parts stop starting new work at their shares of it), and killed, with its
   process group, at the check's deadline if it overruns: it rewrites report.md and
   results.json after each part, so what finished is kept, and its progress lines (each
   shape's and model's row as it finishes) are in the log;
4. pack: the device machine returns at most 8 files of at most 16 MiB, two folders deep, so the
   folder holds at most four: report.md, results.json (with a ``gpu_check`` entry: versions,
   build, times, what was cut off), gpu-check.log (this script's progress, the build's output,
   the report's output) and plots.zip (the PNGs report.md shows; unzip it beside report.md).

``--device cpu --quick`` is the dry run CI makes (.ci/run): the same steps on CPU (the build
without CUDA: ninja finds it done after ``make install``; the report's quick shapes under the
Triton interpreter). Exit status: 0 when every step passed, 1 when one failed or was cut off,
2 for bad usage (an argument, or ``--device cuda`` without a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
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
DEFAULT_TIME_LIMIT = 530.0  # seconds, everything included: <= 9 minutes
REPORT_MIN_S = 120.0  # the build stops in time to leave the report at least this
REPORT_MARGIN_S = 45.0  # the report's own limit ends this long before the hard stop
FINISH_S = 8.0  # packing and writing after the report, before the deadline
BUILD_CAP_S = 300.0
QUIET_S = 30.0  # a progress line when a step has printed nothing for this long

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


class Check:
    """One run: the clock, the log, the progress lines."""

    def __init__(self, out: Path, time_limit: float):
        self.out = out
        self.start = time.monotonic()
        self.deadline = self.start + time_limit
        self.time_limit = time_limit
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu-check.log"
        self.log = open(self.log_path, "w", buffering=1)
        self.facts: dict = {"time_limit_s": time_limit, "steps": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - time.monotonic()

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
                              timeout=min(90.0, max(5.0, check.left() - REPORT_MIN_S)), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"probe_error": "the probe timed out"}
    if proc.stderr.strip():
        check.record(proc.stderr)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"probe_error": (proc.stdout + proc.stderr)[-500:]}


def step_build(check: Check, python: str, device: str, info: dict) -> bool:
    env = build_env(os.environ, device, info.get("capability"), info.get("cores"))
    limit = min(BUILD_CAP_S, check.left() - REPORT_MIN_S - FINISH_S)
    what = (f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} " if device == "cuda" else "") \
        + f"MAX_JOBS={env['MAX_JOBS']} FUSEDRES_BUILD_CUDA={env['FUSEDRES_BUILD_CUDA']}"
    facts = check.facts["steps"]["build"] = {"env": what, "limit_s": round(limit)}
    if limit < 10:
        check.say(f"build: skipped, {check.left():.0f} s left is too little")
        facts["status"] = "skipped"
        return False
    check.say(f"build: fusedres._C in place ({what}), at most {limit:.0f} s")
    t0 = time.monotonic()
    seen = {"step": "", "said": t0}

    def on_line(line: str) -> None:
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if m:
            seen["step"] = f"{m.group(1)}/{m.group(2)}"
        if time.monotonic() - seen["said"] >= 20:
            seen["said"] = time.monotonic()
            check.say(f"build: ninja step {seen['step'] or '-'}, {time.monotonic() - t0:.0f} s")

    def on_quiet(seconds: float) -> None:
        seen["said"] = time.monotonic()
        check.say(f"build: ninja step {seen['step'] or '-'}, {time.monotonic() - t0:.0f} s")

    code, timed_out = run_child(check, [python, "setup.py", "-q", "build_ext", "--inplace"],
                                env, limit, echo=False, on_line=on_line, on_quiet=on_quiet,
                                quiet_s=20.0)
    seconds = time.monotonic() - t0
    ok = code == 0
    facts.update(seconds=round(seconds, 1), exit_status=code, timed_out=timed_out,
                 status="ok" if ok else ("timed out" if timed_out else "failed"))
    check.say(f"build: {facts['status']} in {seconds:.0f} s"
              + ("" if ok else " (the report runs without it; the output is in gpu-check.log)"))
    return ok


def step_report(check: Check, python: str, device: str, quick: bool, extra: list[str]) -> dict:
    hard = check.left() - FINISH_S
    soft = max(30.0, hard - REPORT_MARGIN_S)
    cmd = [python, "-m", "fusedres.apps.bench", "gpu-report", "--out", str(check.out),
           "--time-limit", f"{soft:.0f}", "--no-progress", "--device", device,
           *(["--quick"] if quick else []), *extra]
    facts = check.facts["steps"]["report"] = {"command": " ".join(cmd[1:]),
                                             "time_limit_s": round(soft),
                                             "hard_limit_s": round(hard)}
    check.say(f"report: fusedres bench gpu-report, its limit {soft:.0f} s, stopped at "
              f"{hard:.0f} s")
    started: list[str] = []

    def on_line(line: str) -> None:
        m = re.match(r"\[([\w-]+): started at", line)
        if m:
            started.append(m.group(1))

    t0 = time.monotonic()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    def on_quiet(seconds: float) -> None:
        check.say(f"report: in part {started[-1] if started else '-'}, nothing printed for "
                  f"{seconds:.0f} s")

    code, timed_out = run_child(check, cmd, env, hard, echo=True, on_line=on_line,
                                on_quiet=on_quiet)
    seconds = time.monotonic() - t0
    facts.update(seconds=round(seconds, 1), exit_status=code, timed_out=timed_out,
                 parts_started=started)
    if timed_out:
        facts["cut_off_in"] = started[-1] if started else None
        check.say(f"report: stopped at the time limit after {seconds:.0f} s, in part "
                  f"{facts['cut_off_in']}: the parts before it are in report.md and "
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
    """The check's facts into results.json (key ``gpu_check``) and a short section at the top
    of report.md (written by the report; absent if it never got that far)."""
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
    build = facts["steps"].get("build", {})
    rep = facts["steps"].get("report", {})
    lines = ["## GPU check", "",
             f"`make gpu-check` (benchmarks/gpu_check.py), {facts['elapsed_s']:.0f} s of its "
             f"{facts['time_limit_s']:.0f} s limit; python {facts['probe'].get('python')}, "
             f"torch {facts['probe'].get('torch')}, triton {facts['probe'].get('triton')}, "
             f"numpy {facts['probe'].get('numpy')}"
             + (f", {facts['probe']['gpu']} (compute capability "
                f"{arch_list(facts['probe']['capability'])})" if facts['probe'].get('gpu')
                else "") + ".", "",
             f"- build of fusedres._C: {build.get('status', 'not run')}"
             + (f" in {build['seconds']:.0f} s ({build['env']})" if "seconds" in build else ""),
             "- report: " + ("cut off at the time limit in part "
                              f"`{rep.get('cut_off_in')}`: the parts below finished; the rows "
                              "of the cut part so far are in gpu-check.log"
                              if rep.get("timed_out") else
                              f"exit status {rep.get('exit_status')} in "
                              f"{rep.get('seconds', 0):.0f} s"),
             "- plots: in plots.zip (the device returns at most 8 files): unzip it here and "
             "the images below show.", ""]
    if facts.get("version_problems"):
        lines[4:4] = [f"- unsupported: {p}" for p in facts["version_problems"]]
    text = report.read_text()
    head, sep, rest = text.partition("\n\n")  # after the title line
    report.write_text(head + sep + "\n".join(lines) + "\n" + rest)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the report (made if missing)")
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                    help=f"seconds for everything, the build included (default "
                         f"{DEFAULT_TIME_LIMIT:.0f})")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when a GPU is visible")
    ap.add_argument("--quick", action="store_true",
                    help="the report's quick shapes (the CPU dry run)")
    ap.add_argument("--no-build", dest="build", action="store_false",
                    help="use fusedres._C as it is")
    ap.add_argument("--step-kinds", default=None,
                    help="passed to gpu-report (default: every kind of training step)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that builds and runs the report (default: this one)")
    args = ap.parse_args(argv)
    if args.time_limit < REPORT_MIN_S:
        raise UsageError(f"--time-limit: expected at least {REPORT_MIN_S:.0f} seconds, got "
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


def _run(check: Check, args, python: str) -> int:
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
    build_ok = True
    if args.build:
        build_ok = step_build(check, python, device, info)
    else:
        check.facts["steps"]["build"] = {"status": "not asked (--no-build)"}
    extra = ["--step-kinds", args.step_kinds] if args.step_kinds else []
    rep = step_report(check, python, device, args.quick, extra)
    check.facts["elapsed_s"] = check.elapsed()
    annotate(check.out, check.facts)
    pngs = sorted(p.name for p in check.out.iterdir() if p.suffix == ".png")
    check.say(f"pack: {', '.join(pngs)} -> plots.zip" if pngs else "pack: no plots")
    check.log.flush()
    problems = pack(check.out)
    for p in problems:
        check.say(f"pack: over the device's budget: {p}")
    files = sorted(p.name for p in check.out.iterdir())
    ok = build_ok and rep.get("exit_status") == 0 and not problems
    check.say(f"{'done' if ok else 'finished with a failure'} in {check.elapsed():.0f} s "
              f"(limit {check.time_limit:.0f} s): {len(files)} files in {check.out}: "
              + ", ".join(files))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
