"""Build of fusedres, its optional product extension ``fusedres._C`` and the test extension
``fusedres._C_cuda_on_cpu``.

Switches: FUSEDRES_BUILD_EXT, FUSEDRES_BUILD_CUDA and FUSEDRES_BUILD_TEST_EXT, declared
(values, defaults, meaning) in fusedres/settings.py, which this script loads by path;
`fusedres settings` and README's Settings table list them. Also read:
  TORCH_CUDA_ARCH_LIST    honoured as given (architectures below 8.0 refused: csrc/cuda uses
                          sm_80 instructions); unset with no GPU visible: DEFAULT_CUDA_ARCHS;
                          unset with a GPU visible: torch's default, the visible cards'
  CUDA_HOME               where nvcc is not on PATH
  CUTLASS_PATH            a CUTLASS checkout whose include/ the cuda backend's CUTLASS kernels
                          compile against; unset: the installed nvidia-cutlass package's headers
                          (fusedres.settings.cutlass_include_dir); neither: the CUDA part is
                          built without its CUTLASS kernels (a message says so)
  MAX_JOBS                default: the number of cores, capped by available memory (2 GiB a job)

The CPU kernels of csrc/cpu/vec/ are compiled once per CPU capability (cpu_capabilities()), the
rest once for the compiler's default target; fusedres._C runs the best copy the CPU supports
(csrc/cpu/capability.h). No -march=native: a wheel and an in-place build run the same code on
the same CPU.

The extension is built against the torch this script imports. A build in an isolated
environment (`pip install .`) may import another torch than the one that will load the
extension, and a binary built against one torch does not load into another: such a build
stops with a message (`pip install --no-build-isolation .` builds against the installed torch).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import re
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_settings():
    # fusedres/settings.py by path: importing the package here would need torch and the
    # extension this script builds.
    spec = importlib.util.spec_from_file_location(
        "_fusedres_settings", os.path.join(ROOT, "fusedres", "settings.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while it executes
    spec.loader.exec_module(module)
    return module


_SETTINGS = _load_settings()


def _version() -> str:
    # fusedres/_version.py, the one place the version is spelled.
    with open(os.path.join(ROOT, "fusedres", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


# With no GPU visible: the common data-centre and workstation cards that the kernels run on
# (A100, RTX 30xx/A6000, L4/L40/RTX 40xx, H100), and PTX of the newest so that later
# architectures JIT-compile it. csrc/cuda uses sm_80 instructions (mma.sync on bfloat16,
# cp.async): 7.5 (T4, RTX 20xx) cannot be built.
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"
MIN_CUDA_ARCH = (8, 0)


# The CPU kernels compiled once per capability (csrc/cpu/capability.h states the rules), lowest
# first: the features each needs, by __builtin_cpu_supports's names, compiled with -m<feature>
# for each. csrc/cpu/dispatch.cpp checks the same lists at load (tests/test_cpu_capability.py
# compares them). Baseline is x86-64-v2, the level current Linux distributions require; AVX-512
# is at::vec's set (F, BW, DQ, VL).
CPU_KERNEL_SOURCES = "csrc/cpu/vec/*.cpp"
_X86_BASELINE = ("sse3", "ssse3", "sse4.1", "sse4.2", "popcnt")
_X86_AVX2 = _X86_BASELINE + ("avx", "avx2", "fma", "f16c", "bmi", "bmi2")
_X86_AVX512 = _X86_AVX2 + ("avx512f", "avx512bw", "avx512dq", "avx512vl")


def cpu_capabilities(machine: str | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """``(name, features)`` of each capability the CPU kernels are compiled for on ``machine``
    (default: this one, ``platform.machine()``), lowest first: baseline, avx2 and avx512 on
    x86-64; elsewhere (aarch64) baseline only, with no feature required."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return [("baseline", _X86_BASELINE), ("avx2", _X86_AVX2), ("avx512", _X86_AVX512)]
    return [("baseline", ())]


def _cpu_has(flag: str) -> bool:
    """Whether this machine's CPU reports ``flag`` (Linux's /proc/cpuinfo; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def cpu_capability_builds(machine: str | None = None,
                          only: str | None = None) -> tuple[list[str], list[tuple]]:
    """How fusedres._C's CPU kernels are compiled: ``(defines, builds)``. ``defines``: the
    flags every translation unit gets (FUSEDRES_CPU_HAS_<NAME> for each capability above the
    baseline, which csrc/cpu/dispatch.cpp reads); ``builds``: one ``(name, sources, flags)`` a
    capability, lowest first, its sources (csrc/cpu/vec/) compiled with ``flags`` into objects
    of their own. ``only``: the baseline (which dispatch.cpp always needs) and that capability
    alone (the AddressSanitizer build: tools/opfuzz.py).
    The objects are linked in that order, after the rest: the linker keeps the first copy of an
    inline function that several objects define, so a copy any code may call is never one
    compiled for a higher capability (csrc/cpu/vec/vec.h)."""
    caps = [c for c in cpu_capabilities(machine)
            if only is None or c[0] in ("baseline", only)]
    sources = sorted(glob.glob(os.path.join(ROOT, CPU_KERNEL_SOURCES)))
    sources = [os.path.relpath(p, ROOT) for p in sources]
    defines = [f"-DFUSEDRES_CPU_HAS_{name.upper()}" for name, _ in caps[1:]]
    # -g0: no debug information for the copies (the rest has line tables, -g1): three copies of it
    # doubled the extension (23 -> 44 MB) and took a quarter of the copies' compile time.
    builds = [(name, sources,
               [f"-m{f}" for f in features] + [f"-DFUSEDRES_VEC_{name.upper()}", "-g0"])
              for name, features in caps]
    return defines, builds


def cuda_arch_list(env: dict, gpu_visible: bool) -> str | None:
    """The TORCH_CUDA_ARCH_LIST to build with: the environment's (checked), else
    DEFAULT_CUDA_ARCHS when no GPU is visible, else None (torch's default: the visible cards').
    Raises ValueError naming the variable for an entry below MIN_CUDA_ARCH or one not of the
    form 8.0, 8.6+PTX, 9.0a."""
    given = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not given:
        return None if gpu_visible else DEFAULT_CUDA_ARCHS
    for entry in given.replace(" ", ";").split(";"):
        if not entry:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)[af]?(\+PTX)?", entry)
        if m is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: expected entries like 8.0, 8.6+PTX or 9.0a "
                             f"separated by ';', got {entry!r} in {given!r}")
        if (int(m.group(1)), int(m.group(2))) < MIN_CUDA_ARCH:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: csrc/cuda needs compute capability 8.0 or "
                             f"newer (mma.sync on bfloat16, cp.async), got {entry!r} in {given!r}")
    return given


def cuda_include_dirs(cuda_home: str | None, torch_dir: str) -> list[str]:
    """The CUDA header folders found: the toolkit's (CUDA_HOME/include, and the targets/*/include
    of a split install), then those of the NVIDIA pip wheels beside torch (nvidia/<pkg>/include:
    cu13's one folder, or cu12's per-library ones), which carry headers a pip-installed nvcc's
    toolkit may lack. Only folders that exist."""
    candidates = []
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "include"))
        candidates += sorted(glob.glob(os.path.join(cuda_home, "targets", "*", "include")))
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch_dir), "nvidia", "*",
                                                "include")))
    # Where this Python imports them from, when that is elsewhere (.venv-compat's torch loads
    # .venv's CUDA wheels through a .pth file: .ci/compat).
    for folder in _nvidia_package_dirs():
        candidates += sorted(glob.glob(os.path.join(folder, "*", "include")))
    found = []
    for path in map(os.path.abspath, candidates):
        if os.path.isdir(path) and path not in found:
            found.append(path)
    return found


def _nvidia_package_dirs() -> list[str]:
    """The folders of the ``nvidia`` namespace package (NVIDIA's CUDA wheels) on sys.path."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def _target_paths() -> list[str]:
    # Where the installed package will find torch: the target environment's site-packages
    # (sysconfig's paths, which an isolated build environment does not change) and the user's.
    import site

    paths = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    return [os.path.realpath(p) for p in dict.fromkeys(paths)]


def _installed_torch_versions(paths: list[str]) -> list[str]:
    from importlib import metadata

    return sorted({d.version for d in metadata.distributions(name="torch", path=paths)})


def _imported_torch_version(torch) -> str:
    # The imported torch's distribution version, as _installed_torch_versions reads the
    # installed one's: torch.__version__ may carry a local label (+cu130) that the wheel's
    # metadata does not. torch.__version__ where no metadata sits beside it.
    site_dir = os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__)))
    found = _installed_torch_versions([site_dir])
    return found[0] if len(found) == 1 else torch.__version__


def torch_mismatch(build_torch: str | None, installed: list[str]) -> str | None:
    """Why the extension must not be built against the torch this script imports (None: build).
    ``build_torch`` is that torch's version (None: not importable); ``installed`` the versions
    of torch in the environment the package is installed into."""
    how = ("Install torch first, then build against it with `pip install --no-build-isolation "
           ".`; or set FUSEDRES_BUILD_EXT=0 for the Python-only package.")
    if build_torch is None:
        return f"fusedres: torch is not importable here, so fusedres._C cannot be built. {how}"
    if build_torch not in installed:
        where = (f"torch {', '.join(installed)} is installed" if installed
                 else "no torch is installed")
        return (f"fusedres: this build imports torch {build_torch} (an isolated build "
                f"environment?) but {where} where fusedres goes: fusedres._C built against one "
                f"torch does not load into another. {how}")
    return None


def _setting(name: str):
    try:
        return _SETTINGS.get(name)
    except ValueError as exc:
        sys.exit(str(exc))



def _cuda_home() -> str | None:
    # nvcc on PATH may be a wrapper script: ask the real binary where it lives.
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return os.environ.get("CUDA_HOME")
    real = os.path.realpath(nvcc)
    with open(real, "rb") as f:
        head = f.read(2)
    if head == b"#!":  # a script: find the exec'd path
        for token in open(real).read().split():
            if token.endswith("/nvcc") and os.path.isfile(token) and token != real:
                real = os.path.realpath(token)
                break
    return os.path.dirname(os.path.dirname(real))


def _available_gib() -> float:
    # MemAvailable (what can be allocated without swapping: free memory plus the page cache the
    # kernel can drop), where Linux reports it; free memory alone counted a machine whose RAM
    # sat in the page cache as full, and built one object at a time.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def _max_jobs() -> None:
    if "MAX_JOBS" in os.environ:
        return
    jobs = os.cpu_count() or 1
    try:
        jobs = max(1, min(jobs, int(_available_gib() // 2)))
    except (ValueError, OSError):
        pass
    os.environ["MAX_JOBS"] = str(jobs)


def limited_api_tag() -> str:
    """``cpXY`` of torch's ``min_supported_cpython`` (the Py_LIMITED_API value its build uses
    for a ``py_limited_api`` extension), ``cp310`` when torch does not say."""
    try:
        from torch.utils.cpp_extension import min_supported_cpython
        version = int(min_supported_cpython, 16)
    except (ImportError, ValueError, TypeError):
        return "cp310"
    return f"cp{version >> 24}{(version >> 16) & 0xFF}"


def remove_shadowing_builds(outputs) -> list[str]:
    """Removes, beside each extension just built in place, its copies built under another
    suffix (``_C.cpython-311-x86_64-linux-gnu.so`` beside ``_C.abi3.so``): Python imports the
    version-specific one first, so an older build would shadow the new one. Returns what it
    removed."""
    removed = []
    for out in outputs:
        folder, name = os.path.split(out)
        stem = name.split(".", 1)[0]
        for other in glob.glob(os.path.join(folder or ".", f"{stem}.*")):
            if os.path.basename(other) != name and other.endswith((".so", ".pyd")):
                os.remove(other)
                removed.append(other)
    return removed


def _in_place() -> bool:
    return any(a in ("--inplace", "-i", "develop") for a in sys.argv[1:])


def extensions():
    build_ext_switch = _setting("FUSEDRES_BUILD_EXT")
    if build_ext_switch == "0":
        print("fusedres: FUSEDRES_BUILD_EXT=0, installing Python-only")
        return [], {}
    if build_ext_switch == "auto" and shutil.which(os.environ.get("CXX", "c++")) is None:
        print("fusedres: no C++ compiler found, installing Python-only")
        return [], {}
    try:
        import torch
    except ImportError:
        torch = None
    targets = _target_paths()
    torch_file = os.path.realpath(torch.__file__) if torch else ""
    if not any(torch_file.startswith(p + os.sep) for p in targets):
        # Not the installed torch (an isolated build environment's, or none): build only
        # against the same version.
        problem = torch_mismatch(_imported_torch_version(torch) if torch else None,
                                 _installed_torch_versions(targets))
        if problem:
            sys.exit(problem)

    _max_jobs()
    # The product: the CPU kernels (csrc/cpu/vec/ once per capability: CapabilityBuildExt), and
    # the nvcc copy of csrc/cuda when CUDA is built.
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cpu_defines, cpu_builds = cpu_capability_builds()
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    cuda_switch = _setting("FUSEDRES_BUILD_CUDA")
    cuda_home = _cuda_home()
    use_cuda = cuda_switch == "1" or (
        cuda_switch == "auto" and cuda_sources and cuda_home and torch.version.cuda
    )
    if use_cuda:
        # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, and would derive
        # it from the folder of the nvcc wrapper script otherwise.
        os.environ.setdefault("CUDA_HOME", cuda_home)
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # -g1 over Python's -g: line tables only, what a backtrace or a sanitizer report needs, no
    # variable records (PyTorch's own wheels carry none). The template-heavy translation units
    # compile in ~60% of the time (csrc/cuda/on_cpu/bn_relu_conv2d_backward.cpp, g++ 12: 44 s
    # of CPU at -g, 27 s at -g1): the install, the test extension, compat and the wheel.
    cxx = ["-O3", "-g1", "-fopenmp", "-Wno-unknown-pragmas"]
    # Python's stable ABI (csrc/module.cpp uses only the limited C API): one build serves every
    # Python from 3.10 on, so a library built here for another machine's torch (make
    # gpu-prepare: the GPU machines run Python 3.12) loads there, and a wheel is cp310-abi3.
    kwargs = {"extra_compile_args": {"cxx": cxx + cpu_defines}, "extra_link_args": ["-fopenmp"],
              "depends": sorted(glob.glob("csrc/**/*.h", recursive=True)),
              "py_limited_api": True}
    if use_cuda:
        try:
            archs = cuda_arch_list(os.environ, torch.cuda.is_available())
        except ValueError as exc:
            sys.exit(str(exc))
        if archs is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        print(f"fusedres: CUDA architectures {archs or 'of the visible GPUs'}")
        kwargs["include_dirs"] = cuda_include_dirs(os.environ.get("CUDA_HOME"),
                                                   os.path.dirname(torch.__file__))
        kwargs["extra_compile_args"]["nvcc"] = ["-O3"]
        # The CUTLASS kernels (csrc/cuda/cutlass_conv, FUSEDRES_CUDA_KERNELS=cutlass) where
        # nvidia-cutlass's headers are found; without them the backend is built with its native
        # kernels only, and asking for cutlass is an error at the call that names the reason.
        cutlass_inc = _SETTINGS.cutlass_include_dir()
        if cutlass_inc is None:
            print("fusedres: CUTLASS headers not found (pip install nvidia-cutlass, or set "
                  "CUTLASS_PATH to a CUTLASS checkout): building the cuda backend without its "
                  "CUTLASS kernels")
        else:
            print(f"fusedres: CUTLASS kernels built against {cutlass_inc}")
            cuda_sources += sorted(glob.glob("csrc/cuda/cutlass_conv/*.cu"))
            kwargs["include_dirs"].append(cutlass_inc)
            kwargs["extra_compile_args"]["nvcc"] += list(_SETTINGS.CUTLASS_NVCC_FLAGS)
            kwargs["extra_compile_args"]["cxx"].append("-DFUSEDRES_WITH_CUTLASS")  # module.cpp
        exts = [CUDAExtension("fusedres._C", sources + cuda_sources, **kwargs)]
    else:
        exts = [CppExtension("fusedres._C", sources, **kwargs)]
    exts[0].cpu_builds = cpu_builds  # read by CapabilityBuildExt
    caps = "/".join(name for name, _, _ in cpu_builds)
    built = [f"fusedres._C ({'CPU+CUDA' if use_cuda else 'CPU'}; CPU kernels {caps})"]

    # The test extension: csrc/cuda compiled by the host compiler through the CPU execution layer
    # (the cuda backend's CPU test vehicle, fusedres_cuda on the CPU key) and the layer's tests.
    # Self-contained: it links against libtorch, not fusedres._C.
    test_switch = _setting("FUSEDRES_BUILD_TEST_EXT")
    if test_switch == "1" or (test_switch == "auto" and _in_place()):
        # -mf16c where the building CPU has it (the test extension runs where it is built):
        # c10::Half then converts with one instruction. Without it every float16 conversion of
        # the emulated kernels is ~20 integer and float operations, and their float16 runs took
        # 10x their bfloat16 twins' time (a bfloat16 conversion is a shift); the same rounding
        # (to nearest even) either way.
        f16c = ["-mf16c"] if _cpu_has("f16c") else []
        exts.append(CppExtension("fusedres._C_cuda_on_cpu",
                                 sorted(glob.glob("csrc/cuda/on_cpu/*.cpp")),
                                 extra_compile_args={"cxx": list(cxx) + f16c},
                                 extra_link_args=["-fopenmp"]))
        built.append("fusedres._C_cuda_on_cpu (test extension)")
    print(f"fusedres: building {', '.join(built)}")

    class CapabilityBuildExt(BuildExtension):
        """BuildExtension that also compiles an extension's ``cpu_builds`` (name, sources,
        flags), each into build_temp/cpu-<name>/ with its own flags, and links their objects
        after the extension's own, lowest capability first (cpu_capability_builds)."""

        def build_extension(self, ext):
            builds = getattr(ext, "cpu_builds", None)
            if not builds:
                return super().build_extension(ext)
            compile_sources = self.compiler.compile

            def compile_with_capabilities(sources, output_dir=None, extra_postargs=None,
                                          **kw):
                objects = compile_sources(sources, output_dir=output_dir,
                                          extra_postargs=extra_postargs, **kw)
                for name, cap_sources, flags in builds:
                    post = ({k: list(v) + (flags if k == "cxx" else []) for k, v in
                             extra_postargs.items()} if isinstance(extra_postargs, dict)
                            else list(extra_postargs or []) + flags)
                    objects += compile_sources(
                        cap_sources, output_dir=os.path.join(output_dir, f"cpu-{name}"),
                        extra_postargs=post, **kw)
                return objects

            self.compiler.compile = compile_with_capabilities
            try:
                return super().build_extension(ext)
            finally:
                self.compiler.compile = compile_sources

    class OptionalBuildExt(CapabilityBuildExt):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any build failure
                if build_ext_switch == "1":
                    raise
                print(f"fusedres: building the extensions failed ({exc}); installing "
                      "Python-only. Set FUSEDRES_BUILD_EXT=1 to make this an error.")
                return
            if self.inplace:  # the in-place paths (get_outputs gives build/'s)
                remove_shadowing_builds([self.get_ext_fullpath(e.name) for e in self.extensions])

    return exts, {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


if __name__ == "__main__":  # pip, build and `python setup.py` run it so; tests import it
    ext_modules, cmdclass = extensions()

    setup(
        name="fusedres",
        version=_version(),
        license="BSD-3-Clause",
        license_files=["LICENSE"],
        description="Fused BatchNorm-ReLU-Conv2d kernels and drop-in modules for deep "
        "pre-activation ResNets",
        python_requires=">=3.9",
        # tools/ (the developer tools) is not installed: run from a checkout (tools/__init__.py).
        packages=find_packages(include=["fusedres", "fusedres.*"])
        + ["fusedres.kernels"] + [f"fusedres.kernels.{p}" for p in find_packages("kernels")],
        package_dir={"fusedres": "fusedres", "fusedres.kernels": "kernels"},
        package_data={"fusedres": ["apps/configs/*.yaml", "py.typed"]},
        install_requires=["torch>=2.11", "numpy", "tqdm", "pyyaml"],  # fusedres/_versions.py
        extras_require={
            "test": ["pytest", "pytest-benchmark", "pytest-timeout", "hypothesis", "ruff"],
            "train": ["torchvision", "pillow", "matplotlib", "scikit-learn"],
            "triton": ["triton>=3.6"],
        },
        entry_points={"console_scripts": ["fusedres = fusedres.apps.cli:main"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        # The wheel's tag says what fusedres._C is built for: the stable ABI of the oldest
        # CPython torch's build defines Py_LIMITED_API for (3.10 for torch 2.11 to 2.14).
        options={"bdist_wheel": {"py_limited_api": limited_api_tag()}} if ext_modules else {},
    )
