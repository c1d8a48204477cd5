"""Build and run the CUDA kernels under a sanitizer on the CPU (csrc/cuda/on_cpu/tsan).

``python -m tools.cuda_tsan [--asan] [--build-only] [case ...]`` compiles the host copy of every
kernel in csrc/cuda with one OS thread per CUDA thread (``FUSEDRES_HOST_THREADS``) into a
standalone driver (no Python), then runs its cases (default: ``all``): with
``-fsanitize=thread`` (make tsan; build/tsan/), or with ``--asan`` AddressSanitizer +
UndefinedBehaviorSanitizer, ``-fsanitize=address,undefined -fno-sanitize-recover=all`` (make
asan; build/asan/): an out-of-bounds access or undefined behaviour ends the run with a report.
Exit status 0 only when every case passed and the sanitizer reported nothing. Objects are
rebuilt when a source or a header under csrc/cuda changed. ``--build-only`` builds the driver
and runs nothing.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "tsan")
BINARY = os.path.join(BUILD, "cuda_on_cpu_tsan")
TSAN_EXIT = 66  # TSAN_OPTIONS exitcode: the run had reports
REPORT = "WARNING: ThreadSanitizer:"
ASAN_BUILD = os.path.join(ROOT, "build", "asan")
ASAN_BINARY = os.path.join(ASAN_BUILD, "cuda_on_cpu_asan")
ASAN_EXIT = 67  # ASAN_OPTIONS / UBSAN_OPTIONS exitcode
# AddressSanitizer's and UndefinedBehaviorSanitizer's report lines.
ASAN_REPORTS = ("ERROR: AddressSanitizer:", "runtime error:")


def sources() -> list[str]:
    """The test extension's sources (csrc/cuda/on_cpu) less its Python module, plus the driver."""
    host = os.path.join(ROOT, "csrc", "cuda", "on_cpu")
    layer = [p for p in glob.glob(os.path.join(host, "*.cpp"))
             if os.path.basename(p) != "module.cpp"]
    return sorted(layer + glob.glob(os.path.join(host, "tsan", "*.cpp")))


def _headers() -> list[str]:
    base = os.path.join(ROOT, "csrc", "cuda")
    return glob.glob(os.path.join(ROOT, "csrc", "*.h")) + [
        p for ext in ("h", "cuh", "cu") for p in glob.glob(f"{base}/**/*.{ext}", recursive=True)]


def _sanitize(asan: bool) -> list[str]:
    return (["-fsanitize=address,undefined", "-fno-sanitize-recover=all"] if asan
            else ["-fsanitize=thread"])


def _flags(asan: bool = False) -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = ["-std=c++20", "-O1", "-g1", *_sanitize(asan), "-fno-omit-frame-pointer",
              "-DFUSEDRES_HOST_THREADS", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              "-Wno-unknown-pragmas"]
    cflags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    ldflags = [*_sanitize(asan), *[f"-L{p}" for p in libs],
               *[f"-Wl,-rpath,{p}" for p in libs], "-ltorch", "-ltorch_cpu", "-lc10",
               "-lpthread"]
    return cflags, ldflags


def compile_objects(cxx: str, cflags: list[str], stale: list[tuple[str, str]],
                    jobs: int | None, verbose: bool, tag: str) -> None:
    """Compile each (source, object) of ``stale`` with ``cxx cflags -c``, ``jobs`` at a time
    (None: one per core); the first failure raises with the compiler's message."""
    def compile_one(item):
        src, obj = item
        if verbose:
            print(f"{tag}: compiling {os.path.relpath(src, ROOT)}", flush=True)
        res = subprocess.run([cxx, *cflags, "-c", src, "-o", obj], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{res.stderr[-4000:]}")

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, stale))


def build(jobs: int | None = None, verbose: bool = True, asan: bool = False) -> str:
    """Compile what changed and link the driver (ThreadSanitizer, or ASan + UBSan with
    ``asan``); returns its path."""
    cxx = os.environ.get("CXX", "g++")
    build_dir, binary = (ASAN_BUILD, ASAN_BINARY) if asan else (BUILD, BINARY)
    tag = "asan" if asan else "tsan"
    os.makedirs(build_dir, exist_ok=True)
    cflags, ldflags = _flags(asan)
    newest_header = max((os.path.getmtime(p) for p in _headers()), default=0)
    objects, stale = [], []
    for src in sources():
        rel = os.path.relpath(src, os.path.join(ROOT, "csrc", "cuda", "on_cpu"))
        obj = os.path.join(build_dir, rel.replace(os.sep, "_").replace(".cpp", ".o"))
        objects.append(obj)
        if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src),
                                                                    newest_header):
            stale.append((src, obj))

    compile_objects(cxx, cflags, stale, jobs, verbose, tag)
    if stale or not os.path.exists(binary):
        res = subprocess.run([cxx, *objects, "-o", binary, *ldflags], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking the {tag} driver failed:\n{res.stderr[-4000:]}")
    return binary


def run(cases=("all",), timeout: float | None = None,
        asan: bool = False) -> subprocess.CompletedProcess:
    """Run the driver (built) on ``cases``; stdout and stderr (the reports) together."""
    env = dict(os.environ)
    if asan:
        # libtorch is not instrumented and keeps allocations to the end: no leak check.
        env["ASAN_OPTIONS"] = f"exitcode={ASAN_EXIT} detect_leaks=0 " + env.get(
            "ASAN_OPTIONS", "")
        env["UBSAN_OPTIONS"] = f"exitcode={ASAN_EXIT} print_stacktrace=1 " + env.get(
            "UBSAN_OPTIONS", "")
    else:
        env["TSAN_OPTIONS"] = f"exitcode={TSAN_EXIT} halt_on_error=0 history_size=4 " + env.get(
            "TSAN_OPTIONS", "")
    return subprocess.run([ASAN_BINARY if asan else BINARY, *cases], capture_output=True,
                          text=True, env=env, timeout=timeout)


def count_reports(text: str, asan: bool = False) -> int:
    return sum(text.count(r) for r in (ASAN_REPORTS if asan else (REPORT,)))


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    asan = "--asan" in args
    build_only = "--build-only" in args  # CI builds here; its slow tests run the cases
    cases = [a for a in args if a not in ("--asan", "--build-only")] or ["all"]
    name = "AddressSanitizer/UndefinedBehaviorSanitizer" if asan else "ThreadSanitizer"
    start = time.perf_counter()
    build(asan=asan)
    built = time.perf_counter()
    if build_only:
        print(f"{'asan' if asan else 'tsan'}: driver built in {built - start:.0f} s")
        return 0
    res = run(cases, asan=asan)
    print(res.stdout + res.stderr, end="")
    reports = count_reports(res.stdout + res.stderr, asan)
    print(f"{'asan' if asan else 'tsan'}: build {built - start:.0f} s, run "
          f"{time.perf_counter() - built:.0f} s, {reports} {name} reports, exit status "
          f"{res.returncode}")
    return res.returncode if res.returncode else (1 if reports else 0)


if __name__ == "__main__":
    sys.exit(main())
