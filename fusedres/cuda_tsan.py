"""Build and run the CUDA kernels under ThreadSanitizer on the CPU (csrc/cuda/host/tsan).

``python -m fusedres.cuda_tsan [case ...]`` compiles the host copy of every kernel in csrc/cuda
with one OS thread per CUDA thread (``FUSEDRES_HOST_THREADS``) and ``-fsanitize=thread`` into a
standalone driver (no Python), then runs its cases (default: ``all``). Exit status 0 only when
every case passed and ThreadSanitizer reported nothing. Objects are rebuilt when a source or a
header under csrc/cuda changed (build/tsan/).
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
BINARY = os.path.join(BUILD, "cuda_host_tsan")
TSAN_EXIT = 66  # TSAN_OPTIONS exitcode: the run had reports
REPORT = "WARNING: ThreadSanitizer:"


def sources() -> list[str]:
    """The test extension's sources (csrc/cuda/host) less its Python module, plus the driver."""
    host = os.path.join(ROOT, "csrc", "cuda", "host")
    layer = [p for p in glob.glob(os.path.join(host, "*.cpp"))
             if os.path.basename(p) != "module.cpp"]
    return sorted(layer + glob.glob(os.path.join(host, "tsan", "*.cpp")))


def _headers() -> list[str]:
    base = os.path.join(ROOT, "csrc", "cuda")
    return [os.path.join(ROOT, "csrc", "common.h")] + [
        p for ext in ("h", "cuh", "cu") for p in glob.glob(f"{base}/**/*.{ext}", recursive=True)]


def _flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = ["-std=c++20", "-O1", "-g", "-fsanitize=thread", "-fno-omit-frame-pointer",
              "-DFUSEDRES_HOST_THREADS", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              "-Wno-unknown-pragmas"]
    cflags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    ldflags = ["-fsanitize=thread", *[f"-L{p}" for p in libs],
               *[f"-Wl,-rpath,{p}" for p in libs], "-ltorch", "-ltorch_cpu", "-lc10",
               "-lpthread"]
    return cflags, ldflags


def build(jobs: int | None = None, verbose: bool = True) -> str:
    """Compile what changed and link the driver; returns its path."""
    cxx = os.environ.get("CXX", "g++")
    os.makedirs(BUILD, exist_ok=True)
    cflags, ldflags = _flags()
    newest_header = max((os.path.getmtime(p) for p in _headers()), default=0)
    objects, stale = [], []
    for src in sources():
        rel = os.path.relpath(src, os.path.join(ROOT, "csrc", "cuda", "host"))
        obj = os.path.join(BUILD, rel.replace(os.sep, "_").replace(".cpp", ".o"))
        objects.append(obj)
        if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src),
                                                                    newest_header):
            stale.append((src, obj))

    def compile_one(item):
        src, obj = item
        if verbose:
            print(f"tsan: compiling {os.path.relpath(src, ROOT)}", flush=True)
        res = subprocess.run([cxx, *cflags, "-c", src, "-o", obj], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{res.stderr[-4000:]}")

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, stale))
    if stale or not os.path.exists(BINARY):
        res = subprocess.run([cxx, *objects, "-o", BINARY, *ldflags], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking the ThreadSanitizer driver failed:\n{res.stderr[-4000:]}")
    return BINARY


def run(cases=("all",), timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run the driver (built) on ``cases``; stdout and stderr (the reports) together."""
    env = dict(os.environ)
    env["TSAN_OPTIONS"] = f"exitcode={TSAN_EXIT} halt_on_error=0 history_size=4 " + env.get(
        "TSAN_OPTIONS", "")
    return subprocess.run([BINARY, *cases], capture_output=True, text=True, env=env,
                          timeout=timeout)


def main(argv=None) -> int:
    cases = (argv if argv is not None else sys.argv[1:]) or ["all"]
    start = time.perf_counter()
    build()
    built = time.perf_counter()
    res = run(cases)
    print(res.stdout + res.stderr, end="")
    reports = res.stderr.count(REPORT) + res.stdout.count(REPORT)
    print(f"tsan: build {built - start:.0f} s, run {time.perf_counter() - built:.0f} s, "
          f"{reports} ThreadSanitizer reports, exit status {res.returncode}")
    return res.returncode if res.returncode else (1 if reports else 0)


if __name__ == "__main__":
    sys.exit(main())
