"""``make gpu-prepare``: what a bare GPU machine would otherwise build in its own time, built here.

A GPU machine is lent for minutes at a time and starts bare; building fusedres._C there (nvcc,
every core) took 97 s of them on 2026-11-25. Its torch (2.11.0+cu130) is the one ``make compat``
installs in ``.venv-compat``, and fusedres._C uses only Python's stable ABI (setup.py:
``py_limited_api``), so the library built here against that torch, for that GPU's architecture,
loads in the machine's Python 3.12. This writes ``build/gpu-prepare/`` (carried into the GPU
run; benchmarks/gpu_check.py puts the library in place and loads it, and builds only when that
fails):

* ``_C.abi3.so``: fusedres._C, the CPU kernels (each CPU capability's copy, the best chosen at load
  is another) and csrc/cuda by nvcc for ``--arch`` (default 9.0, the H200/H100);
* ``manifest.json``: the torch and triton it was built against, the architectures, the commit
  and whether the tree was dirty, the file's size and sha256.

The build runs in a copy of the tracked tree (``build/gpu-prepare-src``, timestamps kept so a
second run rebuilds only what changed), with ``.venv-compat``'s Python, which ``make compat``
(or this target's first step) creates.

What it does not prepare: the Triton kernels' JIT. Triton keys its compile cache by a hash
that includes its own shared library, which differs between the wheels for Python 3.11 (here)
and 3.12 (the device), so a cache compiled here would not be found there (the device compiles
the kernels the decisive table uses as it first runs them; the report gives that time apart).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / ".venv-compat" / "bin" / "python"
SRC = ROOT / "build" / "gpu-prepare-src"
OUT = ROOT / "build" / "gpu-prepare"
MAX_BYTES = 60 * 2 ** 20  # what a GPU run carries beside the tree (64 MiB in all)


def copy_tree(src: Path) -> None:
    """The tracked files as they are in the work tree, timestamps kept (a second run rebuilds
    what changed). Any other file of an earlier copy is removed first, outside build/ and the
    built library: setup.py globs csrc/, so a source removed or renamed here since would
    still be compiled and linked there (seen: two definitions of every CPU kernel)."""
    names = [n for n in subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                                       capture_output=True).stdout.decode().split("\0") if n]
    tracked = {n for n in names if (ROOT / n).is_file()}  # not one deleted here, unstaged
    for old in list(src.rglob("*")) if src.exists() else ():
        rel = old.relative_to(src)
        if (old.is_file() and rel.parts[0] != "build" and rel.as_posix() not in tracked
                and not (rel.parts[0] == "fusedres" and rel.name.startswith("_C."))):
            old.unlink()
    for name in names:
        path = ROOT / name
        if path.is_file():
            target = src / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def _gpu_check():
    """benchmarks/gpu_check.py (standard library only), whose digest of the sources the GPU
    check compares with the manifest's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit() -> tuple[str | None, bool]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=ROOT, check=True, capture_output=True,
                                    text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head, dirty


def versions(python: Path) -> dict:
    out = subprocess.run([str(python), "-c", "import json, torch, triton; print(json.dumps("
                          "{'torch': torch.__version__, 'triton': triton.__version__, "
                          "'cuda': torch.version.cuda}))"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def cutlass_path() -> str | None:
    """CUTLASS_PATH for the build: the CUTLASS headers this machine has (fusedres/settings.py's
    rule; .venv's nvidia-cutlass), whose folder above include/ is what CUTLASS_PATH names, so
    that .venv-compat's build compiles the CUTLASS kernels too (the GPU machines have no
    nvidia-cutlass: the library carries them)."""
    from tools import cuda_aot

    inc = cuda_aot.cutlass_include()
    return os.path.dirname(inc) if inc else None


def build(python: Path, src: Path, arch: str, jobs: int) -> Path:
    env = dict(os.environ, FUSEDRES_BUILD_EXT="1", FUSEDRES_BUILD_CUDA="1",
               FUSEDRES_BUILD_TEST_EXT="0",
               TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=str(jobs),
               PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    if "CUTLASS_PATH" not in env and (path := cutlass_path()) is not None:
        env["CUTLASS_PATH"] = path
    subprocess.run([str(python), "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                   env=env, check=True)
    built = sorted((src / "fusedres").glob("_C.abi3.*"))
    if len(built) != 1:
        raise SystemExit(f"gpu-prepare: expected one fusedres/_C.abi3.* in {src}, found "
                         f"{[p.name for p in built] or 'none'}")
    return built[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_prepare",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="9.0",
                    help="TORCH_CUDA_ARCH_LIST of the GPU machine (default 9.0: H100, H200)")
    ap.add_argument("--python", type=Path, default=COMPAT,
                    help="the Python with the GPU machine's torch (default .venv-compat's)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    args.python = args.python.absolute()  # the build runs in another folder
    if not args.python.exists():
        print(f"gpu-prepare: error: --python: {args.python} does not exist (make compat "
              "creates .venv-compat with the GPU machines' torch)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    have = versions(args.python)
    copy_tree(SRC)
    library = build(args.python, SRC, args.arch, args.jobs)
    # Imported by the GPU machines' Python in the copy it was built in (no GPU needed): a library
    # that does not load, or lacks the CUTLASS kernels the headers were found for, is refused
    # before a GPU minute is spent on it.
    loaded = _gpu_check().load_check(args.python, SRC)
    want = ["native", "cutlass"] if (os.environ.get("CUTLASS_PATH") or cutlass_path()) else \
        ["native"]
    if not loaded.get("loaded") or loaded.get("kernel_sets") != want:
        print(f"gpu-prepare: error: {library} does not serve a GPU run: it loaded "
              f"{bool(loaded.get('loaded'))} ({loaded.get('error')}), kernel sets "
              f"{loaded.get('kernel_sets')}, expected {want}", file=sys.stderr)
        return 1
    size = library.stat().st_size
    if size > MAX_BYTES:
        print(f"gpu-prepare: error: {library.name} is {size} bytes, over the {MAX_BYTES} a GPU "
              "run carries", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.iterdir():
        old.unlink()
    shutil.copy2(library, args.out / library.name)
    head, dirty = commit()
    manifest = {"file": library.name, **have, "arch_list": args.arch.replace(",", ";").split(";"),
                "bytes": size, "sha256": hashlib.sha256(library.read_bytes()).hexdigest(),
                "sources": _gpu_check().sources_digest(SRC), "commit": head, "dirty": dirty,
                "built_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                "build_seconds": round(time.monotonic() - t0, 1),
                # the CUTLASS kernels (FUSEDRES_CUDA_KERNELS=cutlass) compiled in, from these
                # headers; None: built without them
                "cutlass_path": os.environ.get("CUTLASS_PATH") or cutlass_path(),
                "kernel_sets": loaded["kernel_sets"]}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"gpu-prepare: {args.out}/{library.name} ({size / 2 ** 20:.1f} MiB) for torch "
          f"{have['torch']}, compute capability {args.arch}, in {manifest['build_seconds']:.0f} s;"
          f" carry {args.out.relative_to(ROOT)} into the GPU run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
