"""Build of fusedres and its optional extension ``fusedres._C``.

Switches (environment variables):
  FUSEDRES_BUILD_EXT   auto (default: build when a C++ compiler is found; a failed build warns
                       and installs Python-only) | 1 (build, failure is fatal) | 0 (Python-only)
  FUSEDRES_BUILD_CUDA  auto (default: when nvcc is found, torch has CUDA and csrc/cuda has
                       sources) | 1 | 0
  TORCH_CUDA_ARCH_LIST default "8.0;9.0" when no GPU is visible
  FUSEDRES_CPU_NATIVE  1 (default): compile the CPU kernels with -march=native
  MAX_JOBS             default: the number of cores, capped by free memory (2 GiB a job)
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _switch(name: str, default: str = "auto") -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("auto", "0", "1"):
        sys.exit(f"{name}: expected auto, 0 or 1, got {value!r}")
    return value


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


def _max_jobs() -> None:
    if "MAX_JOBS" in os.environ:
        return
    jobs = os.cpu_count() or 1
    try:
        free_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        jobs = max(1, min(jobs, int(free_gib // 2)))
    except (ValueError, OSError):
        pass
    os.environ["MAX_JOBS"] = str(jobs)


def extensions():
    build_ext_switch = _switch("FUSEDRES_BUILD_EXT")
    if build_ext_switch == "0":
        print("fusedres: FUSEDRES_BUILD_EXT=0, installing Python-only")
        return [], {}
    if build_ext_switch == "auto" and shutil.which(os.environ.get("CXX", "c++")) is None:
        print("fusedres: no C++ compiler found, installing Python-only")
        return [], {}
    import torch

    _max_jobs()
    # csrc/cuda/host/*.cpp: the CUDA kernels compiled by the host compiler through the CPU
    # execution layer (always built: the `cuda` backend's CPU test vehicle, fusedres_cuda on CPU).
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp")
                     + glob.glob("csrc/cuda/host/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    cuda_switch = _switch("FUSEDRES_BUILD_CUDA")
    cuda_home = _cuda_home()
    use_cuda = cuda_switch == "1" or (
        cuda_switch == "auto" and cuda_sources and cuda_home and torch.version.cuda
    )
    if use_cuda:
        # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, and would derive
        # it from the folder of the nvcc wrapper script otherwise.
        os.environ.setdefault("CUDA_HOME", cuda_home)
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cxx = ["-O3", "-fopenmp", "-Wno-unknown-pragmas"]
    if os.environ.get("FUSEDRES_CPU_NATIVE", "1") == "1":
        cxx.append("-march=native")
    kwargs = {"extra_compile_args": {"cxx": cxx}, "extra_link_args": ["-fopenmp"]}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        include = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu13", "include")
        kwargs["include_dirs"] = [os.path.abspath(include)] if os.path.isdir(include) else []
        kwargs["extra_compile_args"]["nvcc"] = ["-O3"]
        kwargs["extra_compile_args"]["cxx"].append("-DFUSEDRES_WITH_CUDA")
        ext = CUDAExtension("fusedres._C", sources + cuda_sources, **kwargs)
    else:
        ext = CppExtension("fusedres._C", sources, **kwargs)
    print(f"fusedres: building fusedres._C ({'CPU+CUDA' if use_cuda else 'CPU'})")

    class OptionalBuildExt(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any build failure
                if build_ext_switch == "1":
                    raise
                print(f"fusedres: building fusedres._C failed ({exc}); installing Python-only. "
                      "Set FUSEDRES_BUILD_EXT=1 to make this an error.")

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()

setup(
    name="fusedres",
    version="0.1.0",
    description="Fused BatchNorm-ReLU-Conv2d kernels and drop-in modules for deep "
    "pre-activation ResNets",
    python_requires=">=3.9",
    packages=find_packages(include=["fusedres", "fusedres.*"])
    + ["fusedres.kernels"] + [f"fusedres.kernels.{p}" for p in find_packages("kernels")],
    package_dir={"fusedres": "fusedres", "fusedres.kernels": "kernels"},
    package_data={"fusedres": ["configs/*.yaml"]},
    install_requires=["torch>=2.6", "numpy", "tqdm", "pyyaml"],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "pytest-timeout", "hypothesis", "ruff"],
        "train": ["torchvision", "matplotlib", "scikit-learn"],
        "triton": ["triton"],
    },
    entry_points={"console_scripts": ["fusedres = fusedres.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
