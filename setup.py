"""Build of fusedres, its optional product extension ``fusedres._C`` and the test extension
``fusedres._C_cuda_host``.

Switches: FUSEDRES_BUILD_EXT, FUSEDRES_BUILD_CUDA, FUSEDRES_BUILD_TEST_EXT and
FUSEDRES_CPU_NATIVE, declared (values, defaults, meaning) in fusedres/settings.py, which this
script loads by path; `fusedres settings` and README's Settings table list them. Also read:
  TORCH_CUDA_ARCH_LIST    default "8.0;9.0" when no GPU is visible
  MAX_JOBS                default: the number of cores, capped by free memory (2 GiB a job)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys

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
    import torch

    _max_jobs()
    # The product: the CPU kernels, and the nvcc copy of csrc/cuda when CUDA is built.
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
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

    cxx = ["-O3", "-fopenmp", "-Wno-unknown-pragmas"]
    if _setting("FUSEDRES_CPU_NATIVE"):
        cxx.append("-march=native")
    kwargs = {"extra_compile_args": {"cxx": list(cxx)}, "extra_link_args": ["-fopenmp"]}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        include = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu13", "include")
        kwargs["include_dirs"] = [os.path.abspath(include)] if os.path.isdir(include) else []
        kwargs["extra_compile_args"]["nvcc"] = ["-O3"]
        exts = [CUDAExtension("fusedres._C", sources + cuda_sources, **kwargs)]
    else:
        exts = [CppExtension("fusedres._C", sources, **kwargs)]
    built = [f"fusedres._C ({'CPU+CUDA' if use_cuda else 'CPU'})"]

    # The test extension: csrc/cuda compiled by the host compiler through the CPU execution layer
    # (the cuda backend's CPU test vehicle, fusedres_cuda on the CPU key) and the layer's tests.
    # Self-contained: it links against libtorch, not fusedres._C.
    test_switch = _setting("FUSEDRES_BUILD_TEST_EXT")
    if test_switch == "1" or (test_switch == "auto" and _in_place()):
        exts.append(CppExtension("fusedres._C_cuda_host",
                                 sorted(glob.glob("csrc/cuda/host/*.cpp")),
                                 extra_compile_args={"cxx": list(cxx)},
                                 extra_link_args=["-fopenmp"]))
        built.append("fusedres._C_cuda_host (test extension)")
    print(f"fusedres: building {', '.join(built)}")

    class OptionalBuildExt(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any build failure
                if build_ext_switch == "1":
                    raise
                print(f"fusedres: building the extensions failed ({exc}); installing "
                      "Python-only. Set FUSEDRES_BUILD_EXT=1 to make this an error.")

    return exts, {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


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
    install_requires=["torch>=2.11", "numpy", "tqdm", "pyyaml"],  # fusedres/_versions.py
    extras_require={
        "test": ["pytest", "pytest-benchmark", "pytest-timeout", "hypothesis", "ruff"],
        "train": ["torchvision", "pillow", "matplotlib", "scikit-learn"],
        "triton": ["triton>=3.6"],
    },
    entry_points={"console_scripts": ["fusedres = fusedres.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
