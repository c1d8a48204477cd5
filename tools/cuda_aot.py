"""Compile every CUDA kernel in csrc/cuda with nvcc for sm_80 and sm_90 and print their resources.

``python -m tools.cuda_aot [--out csrc/cuda/COMPILE.md]``: each ``csrc/cuda/*.cu`` is compiled
by nvcc (no GPU needed) with the flags of the extension build, once for all architectures, with
``-Xptxas -v``; the table lists per kernel instantiation and architecture: registers, spill
bytes (goal 0), static shared memory, threads per block (the kernel's ``__launch_bounds__``, read
from the PTX), and the resident blocks per SM and occupancy that follow from the per-SM limits.

A kernel that uses dynamic shared memory declares its largest launch for the table with a comment
in its .cu file, or in a .cuh header beside it (a kernel family's file, included by the .cu):
``// cuda_aot: <kernel name> dynamic_smem=<bytes>``, the name a base name (every instantiation) or
an ``fnmatch`` pattern of demangled instantiations. The CUTLASS kernels (csrc/cuda/cutlass_conv,
compiled where nvidia-cutlass's headers are found: fusedres.settings.cutlass_include_dir) carry
both figures in their name instead, ``Launch<threads, dynamic smem bytes>``, which their
kernel file pins to CUTLASS's own with static_asserts.

nvcc's outputs are kept in build/nvcc-cache (:func:`compile_cached`): the performance model
(tools/perfmodel/cuda_sass.py) reads the SASS of the same objects, and CI's slow step runs both.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = (80, 90)

# Per-SM limits (CUDA C Programming Guide, compute capability 8.0 and 9.0).
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
MAX_REGS_PER_THREAD = 255
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SMEM_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
SMEM_RESERVED_PER_BLOCK = 1024  # the runtime's reservation per resident block (sm_80+)


def find_nvcc() -> str | None:
    """The real nvcc: nvcc on PATH may be a wrapper script that execs it (shared/design.md)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        home = os.environ.get("CUDA_HOME")
        cand = os.path.join(home, "bin", "nvcc") if home else None
        return cand if cand and os.path.isfile(cand) else None
    real = os.path.realpath(nvcc)
    with open(real, "rb") as f:
        is_script = f.read(2) == b"#!"
    if is_script:
        for token in open(real).read().split():
            if token.endswith("/nvcc") and os.path.isfile(token) and token != real:
                return os.path.realpath(token)
    return real


@functools.cache
def settings():
    """fusedres/settings.py loaded by path as setup.py loads it (no torch, no fusedres import):
    the build's rules (the CUTLASS headers and flags) for the tools that mirror the build."""
    import importlib.util

    name = "_fusedres_settings_tools"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "fusedres", "settings.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cutlass_include() -> str | None:
    """The CUTLASS headers the build would use (fusedres/settings.py's rule)."""
    return settings().cutlass_include_dir()


def sources(root: str = ROOT) -> list[str]:
    """csrc/cuda's .cu files, and csrc/cuda/cutlass_conv's where CUTLASS's headers are found."""
    found = glob.glob(os.path.join(root, "csrc", "cuda", "*.cu"))
    if cutlass_include() is not None:
        found += glob.glob(os.path.join(root, "csrc", "cuda", "cutlass_conv", "*.cu"))
    else:
        print("tools.cuda_aot: CUTLASS headers not found (pip install nvidia-cutlass): "
              "csrc/cuda/cutlass_conv left out", file=sys.stderr)
    return sorted(found)


def nvcc_command(nvcc: str, src: str, obj: str, keep_dir: str, archs=ARCHS) -> list[str]:
    import sysconfig

    import torch

    # torch.utils.cpp_extension reads CUDA_HOME at import (else it guesses from the wrapper).
    os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
    from torch.utils import cpp_extension

    includes = list(cpp_extension.include_paths())
    cu13 = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu13", "include")
    if os.path.isdir(cu13):
        includes.append(os.path.abspath(cu13))
    includes.append(sysconfig.get_paths()["include"])
    # --threads 0: the architectures' device compiles run in parallel (one process per arch).
    cmd = [nvcc, "-c", src, "-o", obj, "-std=c++20", "-O3", "-Xptxas", "-v", "--keep",
           "--keep-dir", keep_dir, "--threads", "0", "-Xcompiler", "-fPIC",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]
    cmd += list(cpp_extension.COMMON_NVCC_FLAGS)
    for arch in archs:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    cmd += [f"-I{p}" for p in includes]
    cutlass = cutlass_include()
    if cutlass is not None:  # as setup.py builds the CUDA part
        cmd += [f"-I{cutlass}", *settings().CUTLASS_NVCC_FLAGS]
    return cmd


@dataclass
class Kernel:
    file: str
    mangled: str
    arch: int
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    dynamic_smem: int = 0
    threads: int | None = None
    name: str = ""

    def blocks_per_sm(self) -> tuple[int, str] | None:
        """Resident blocks per SM and the limit that sets it."""
        if not self.threads:
            return None
        warps = -(-self.threads // 32)
        regs_per_warp = -(-max(self.registers, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        limits = {
            "blocks": BLOCKS_PER_SM,
            "threads": THREADS_PER_SM // (warps * 32),
            "registers": (REGS_PER_SM // regs_per_warp) // warps,
        }
        smem = self.smem + self.dynamic_smem
        if smem > SMEM_PER_BLOCK[self.arch]:
            limits["smem"] = 0
        elif smem:
            limits["smem"] = SMEM_PER_SM[self.arch] // (smem + SMEM_RESERVED_PER_BLOCK)
        which = min(limits, key=limits.get)
        return limits[which], which

    def occupancy(self) -> float | None:
        got = self.blocks_per_sm()
        if got is None:
            return None
        warps = -(-self.threads // 32)
        return got[0] * warps / (THREADS_PER_SM // 32)


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_PTX_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\(")
_MAXNTID = re.compile(r"\.(?:maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_DYN = re.compile(r"//\s*cuda_aot:\s*(.+?)\s+dynamic_smem=(\d+)")
# A CUTLASS kernel's block size and dynamic shared memory, in its demangled name.
_LAUNCH = re.compile(r"Launch<(\d+), (\d+)>")


def parse_ptxas(log: str, file: str) -> list[Kernel]:
    kernels: list[Kernel] = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            kernels.append(Kernel(file, m.group(1), int(m.group(2))))
            continue
        if not kernels:
            continue
        k = kernels[-1]
        if m := _SPILL.search(line):
            k.stack, k.spill_stores, k.spill_loads = map(int, m.groups())
        if m := _USED.search(line):
            k.registers = int(m.group(1))
            if s := _SMEM.search(line):
                k.smem = int(s.group(1))
    return kernels


def ptx_threads(keep_dir: str) -> dict[str, int]:
    """Threads per block declared by __launch_bounds__ (.maxntid) per mangled entry."""
    out: dict[str, int] = {}
    for ptx in glob.glob(os.path.join(keep_dir, "*.ptx")):
        entry = None
        for line in open(ptx):
            if m := _PTX_ENTRY.search(line):
                entry = m.group(1)
            elif entry and (m := _MAXNTID.search(line)):
                dims = [int(g) for g in m.groups() if g]
                total = 1
                for d in dims:
                    total *= d
                out[entry] = total
                entry = None
    return out


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    res = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    pretty = res.stdout.splitlines()
    return {n: _short(p) for n, p in zip(names, pretty)}


def _short(name: str) -> str:
    """fusedres::cuda::(anonymous namespace)::k<float>(const float*, ...) -> k<float>."""
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = name.replace("fusedres::cuda::", "").replace("fusedres::cutlass_conv::", "")
    name = name.replace("c10::", "").replace("at::", "")
    depth = 0
    for i, ch in enumerate(name):  # drop the parameter list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            name = name[:i]
            break
    return re.sub(r"^void ", "", name)


@dataclass
class Compiled:
    """nvcc's object for one source (every architecture's code), ptxas's ``-v`` report, the
    threads per block each entry declares (from the PTX) and the compile's seconds."""

    obj: bytes
    log: str
    threads: dict[str, int]
    seconds: float


CACHE_DIR = os.path.join(ROOT, "build", "nvcc-cache")


def _cache_key(nvcc: str, src: str, archs) -> str:
    """What the output depends on: the command (paths of the output left out), nvcc itself, the
    torch headers' version and every source under the csrc/ folder ``src`` is in (a header change
    recompiles every file)."""
    import torch

    h = hashlib.sha256()
    h.update("\0".join(nvcc_command(nvcc, src, "OUT", "KEEP", archs)).encode())
    real = os.path.realpath(nvcc)
    st = os.stat(real)
    h.update(f"{real}:{st.st_size}:{st.st_mtime_ns}:{torch.__version__}".encode())
    csrc = os.path.dirname(os.path.dirname(os.path.abspath(src)))
    for path in sorted(glob.glob(os.path.join(csrc, "**", "*"), recursive=True)):
        if path.endswith((".cu", ".cuh", ".h", ".hpp", ".cpp")):
            h.update(os.path.relpath(path, csrc).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    base = os.path.splitext(os.path.basename(src))[0]
    return f"{base}-sm{'-'.join(map(str, archs))}-{h.hexdigest()[:20]}"


def _compile_into(nvcc: str, src: str, archs, entry: str) -> None:
    """Compile ``src`` into a fresh folder, then rename it to ``entry``: an entry is whole or
    absent. Other entries of the same file and architectures (older sources) are removed."""
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=CACHE_DIR)
    try:
        keep = os.path.join(tmp, "keep")
        os.mkdir(keep)
        start = time.perf_counter()
        res = subprocess.run(nvcc_command(nvcc, src, os.path.join(tmp, "out.o"), keep, archs),
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}:\n{res.stdout}{res.stderr}")
        meta = {"threads": ptx_threads(keep), "seconds": seconds}
        shutil.rmtree(keep)  # the intermediates: PTX, cubins, preprocessed sources
        with open(os.path.join(tmp, "ptxas.log"), "w") as f:
            f.write(res.stdout + res.stderr)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        prefix = os.path.basename(entry).rsplit("-", 1)[0] + "-"
        for old in glob.glob(os.path.join(CACHE_DIR, glob.escape(prefix) + "*")):
            if not old.endswith(".lock"):
                shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compile_cached(nvcc: str, src: str, archs=ARCHS) -> Compiled:
    """nvcc's outputs for ``src``, from build/nvcc-cache when its inputs are unchanged. A lock
    per entry: processes asking for the same one at once (pytest-xdist workers) compile once."""
    os.makedirs(CACHE_DIR, exist_ok=True)
    key = _cache_key(nvcc, src, archs)
    entry = os.path.join(CACHE_DIR, key)
    with open(os.path.join(CACHE_DIR, key.rsplit("-", 1)[0] + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(entry, "meta.json")):
            _compile_into(nvcc, src, archs, entry)
        with open(os.path.join(entry, "out.o"), "rb") as f:
            obj = f.read()
        with open(os.path.join(entry, "ptxas.log")) as f:
            log = f.read()
        with open(os.path.join(entry, "meta.json")) as f:
            meta = json.load(f)
    return Compiled(obj, log, meta["threads"], meta["seconds"])


def declared_dynamic_smem(src: str) -> dict[str, int]:
    """The ``// cuda_aot: <kernel> dynamic_smem=<bytes>`` declarations of ``src`` and the .cuh
    headers beside it (a kernel family's file, included by the .cu): kernel -> bytes."""
    folder = os.path.dirname(os.path.abspath(src))
    texts = [open(p).read() for p in [src, *sorted(glob.glob(os.path.join(folder, "*.cuh")))]]
    return {m.group(1): int(m.group(2)) for t in texts for m in _DYN.finditer(t)}


def dynamic_smem(name: str, declared: dict[str, int]) -> int:
    """The dynamic shared memory declared for demangled kernel ``name``: a declaration of its
    base name (every instantiation), or a pattern of its instantiations (``fnmatch``: ``*`` for
    any part, as ``dgrad_mma_kernel<*, MmaDgrad<128, 128, 2, 2, 32> >``); 0 where none is."""
    for pattern, nbytes in declared.items():
        if fnmatch.fnmatchcase(name, pattern):
            return nbytes
    return declared.get(name.split("<")[0], 0)


def compile_file(nvcc: str, src: str, archs=ARCHS) -> tuple[list[Kernel], float]:
    """The table's rows for ``src`` and its compile's seconds (the first compile's, when cached)."""
    compiled = compile_cached(nvcc, src, archs)
    kernels = parse_ptxas(compiled.log, os.path.relpath(src, ROOT))
    # The .cu and the headers beside it: its kernels may live in a family's .cuh it includes.
    dynamic = declared_dynamic_smem(src)
    names = demangle(sorted({k.mangled for k in kernels}))
    for k in kernels:
        k.name = names[k.mangled]
        k.threads = compiled.threads.get(k.mangled)
        k.dynamic_smem = dynamic_smem(k.name, dynamic)
        if launch := _LAUNCH.search(k.name):
            k.threads = k.threads or int(launch.group(1))
            k.dynamic_smem = int(launch.group(2))
    return kernels, compiled.seconds


def table(kernels: list[Kernel]) -> str:
    head = ("| file | kernel | arch | threads | registers | spills (st/ld B) | stack B | "
            "smem B (static+dynamic) | blocks/SM (limit) | occupancy |")
    rows = [head, "|" + "---|" * 10]
    for k in sorted(kernels, key=lambda k: (k.file, k.name, k.arch)):
        got = k.blocks_per_sm()
        occ = k.occupancy()
        smem = f"{k.smem}" + (f"+{k.dynamic_smem}" if k.dynamic_smem else "")
        rows.append(
            f"| {k.file} | `{k.name}` | sm_{k.arch} | {k.threads or 'no launch bounds'} | "
            f"{k.registers} | {k.spill_stores}/{k.spill_loads} | {k.stack} | {smem} | "
            f"{f'{got[0]} ({got[1]})' if got else '-'} | "
            f"{f'{occ:.0%}' if occ is not None else '-'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table as Markdown to this file")
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found (PATH or CUDA_HOME): cannot compile csrc/cuda", file=sys.stderr)
        return 2
    srcs = sources()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: compile_file(nvcc, s, tuple(args.arch)), srcs))
    kernels = [k for ks, _ in results for k in ks]
    # Every declaration must name a kernel the build has (a template argument added to a kernel
    # changes its demangled name: the declaration would silently drop its bytes).
    declared = {p for s in srcs for p in declared_dynamic_smem(s)}
    stale = sorted(p for p in declared
                   if not any(dynamic_smem(k.name, {p: 1}) for k in kernels))
    if stale:
        print("cuda_aot: dynamic_smem declared for no kernel: " + ", ".join(stale),
              file=sys.stderr)
        return 1
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    version = version.strip().splitlines()[-1] if version.strip() else "?"
    spills = [k for k in kernels if k.spill_stores or k.spill_loads]
    lines = [
        "# CUDA kernels: nvcc resource usage per kernel and architecture",
        "",
        f"Generated by `python -m tools.cuda_aot --out csrc/cuda/COMPILE.md` ({version}; "
        f"sm_{', sm_'.join(map(str, args.arch))}; no GPU needed). Occupancy = resident warps / "
        f"64 from the per-SM limits: {REGS_PER_SM} registers (allocated per warp in units of "
        f"{REG_ALLOC_UNIT}), {THREADS_PER_SM} threads, {BLOCKS_PER_SM} blocks, shared memory "
        + ", ".join(f"{SMEM_PER_SM[a] // 1024} KiB (sm_{a})" for a in args.arch)
        + f" with {SMEM_RESERVED_PER_BLOCK} B reserved per block.",
        "",
        table(kernels),
        "",
        "Compile time per file (both architectures): "
        + ", ".join(f"{os.path.relpath(s, ROOT)} {t:.0f} s" for s, (_, t) in zip(srcs, results)),
        "",
        f"Kernels with spills: {len(spills)} of {len(kernels)}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
