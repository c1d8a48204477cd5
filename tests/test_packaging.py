"""Packaging: one version string, `python -m fusedres`, and setup.py's build rules (the CUDA
architecture list, the CUDA include folders, the guard against building against another torch
than the installed one). setup.py is imported as a module: it runs setup() only as __main__."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fusedres

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_spelled_once(setup_py):
    from fusedres import _version

    assert fusedres.__version__ == _version.__version__ == setup_py._version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", fusedres.__version__)
    # No other spelling in the build files, and the changelog has the version's entry.
    assert "version=" not in (ROOT / "setup.py").read_text().replace("version=_version()", "")
    assert "version" not in (ROOT / "pyproject.toml").read_text().split("[tool.")[0]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(fusedres.__version__)}\b", changelog, re.M)


def test_package_data_has_py_typed_and_license(setup_py):
    assert (ROOT / "fusedres" / "py.typed").is_file()
    text = (ROOT / "setup.py").read_text()
    assert '"py.typed"' in text and 'license_files=["LICENSE"]' in text
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    assert 'license="BSD-3-Clause"' in text


def test_python_m_fusedres_runs_the_cli(capsys):
    out = subprocess.run([sys.executable, "-m", "fusedres", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: fusedres {") and "train" in out.stdout
    # The module is cli.main itself: its exit status and errors are the command's.
    import runpy

    from fusedres.apps import cli

    assert runpy.run_module("fusedres.__main__", run_name="not_main")["main"] is cli.main
    assert cli.main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_cuda_arch_list_default_and_environment(setup_py):
    f = setup_py.cuda_arch_list
    # No GPU visible: the common cards, 8.0 to 9.0, PTX of the newest for later ones.
    assert f({}, gpu_visible=False) == "8.0;8.6;8.9;9.0+PTX" == setup_py.DEFAULT_CUDA_ARCHS
    assert f({"TORCH_CUDA_ARCH_LIST": "  "}, gpu_visible=False) == setup_py.DEFAULT_CUDA_ARCHS
    # A GPU visible: torch's own default (the visible cards').
    assert f({}, gpu_visible=True) is None
    # The environment's list is honoured, GPU or not.
    for visible in (False, True):
        assert f({"TORCH_CUDA_ARCH_LIST": "9.0a"}, gpu_visible=visible) == "9.0a"
        assert f({"TORCH_CUDA_ARCH_LIST": "8.0 8.6+PTX"}, visible) == "8.0 8.6+PTX"
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST: csrc/cuda needs compute "
                                         r"capability 8.0 .* got '7.5'"):
        f({"TORCH_CUDA_ARCH_LIST": "7.5;8.0"}, gpu_visible=False)
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST: expected entries like .* "
                                         r"got 'sm_90'"):
        f({"TORCH_CUDA_ARCH_LIST": "8.0;sm_90"}, gpu_visible=False)


def test_cuda_include_dirs_are_found_not_named(setup_py, tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    site = tmp_path / "site-packages"
    made = [home / "include", home / "targets" / "x86_64-linux" / "include",
            site / "nvidia" / "cu13" / "include", site / "nvidia" / "cuda_runtime" / "include"]
    for path in made:
        path.mkdir(parents=True)
    (site / "nvidia" / "nccl").mkdir()  # no include folder: left out
    (site / "torch").mkdir()
    monkeypatch.setattr(setup_py, "_nvidia_package_dirs", lambda: [])
    found = setup_py.cuda_include_dirs(str(home), str(site / "torch"))
    assert found == [str(made[0]), str(made[1]), str(made[2]), str(made[3])]
    assert setup_py.cuda_include_dirs(None, str(tmp_path / "nowhere" / "torch")) == []
    # Wheels that Python imports from elsewhere (.venv-compat's torch loads .venv's through a
    # .pth file) come after those beside torch.
    other = tmp_path / "other" / "nvidia"
    (other / "cu13" / "include").mkdir(parents=True)
    monkeypatch.setattr(setup_py, "_nvidia_package_dirs", lambda: [str(other)])
    assert setup_py.cuda_include_dirs(None, str(tmp_path / "nowhere" / "torch")) == [
        str(other / "cu13" / "include")]


def test_build_against_another_torch_is_refused(setup_py):
    f = setup_py.torch_mismatch
    assert f("2.14.1+cu130", ["2.14.1+cu130"]) is None
    different = f("2.15.0+cpu", ["2.14.1+cu130"])
    assert "torch 2.15.0+cpu" in different and "torch 2.14.1+cu130 is installed" in different
    assert "pip install --no-build-isolation ." in different
    assert "no torch is installed" in f("2.14.1", [])
    assert "torch is not importable" in f(None, ["2.14.1"])


def _run_setup(args, tmp_path, **env):
    return subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **env))


def test_setup_stops_on_a_torch_other_than_the_installed_one(tmp_path):
    """A torch imported from elsewhere (as pip's isolated build environment provides) whose
    version is not the installed one: setup.py exits before building, saying how to build."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.0.1"\n')
    out = _run_setup(["--name"], tmp_path, FUSEDRES_BUILD_EXT="auto", PYTHONPATH=str(tmp_path))
    assert out.returncode != 0
    assert "this build imports torch 0.0.1" in out.stderr
    assert "pip install --no-build-isolation ." in out.stderr
    # Python-only needs no torch: the same environment goes through.
    out = _run_setup(["--name"], tmp_path, FUSEDRES_BUILD_EXT="0", PYTHONPATH=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip().endswith("fusedres"), out.stderr


def test_setup_builds_against_the_installed_torch(tmp_path):
    out = _run_setup(["--version"], tmp_path, FUSEDRES_BUILD_EXT="1")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == fusedres.__version__
    assert any(line.startswith("fusedres: building fusedres._C (") for line in lines)


def test_sdist_carries_what_a_build_from_it_needs(tmp_path):
    """The source distribution has the extension's headers (setuptools adds only the .cpp/.cu
    sources it is told of), the licence, the changelog and py.typed (MANIFEST.in)."""
    import tarfile

    out = _run_setup(["-q", "egg_info", "-e", str(tmp_path), "sdist", "-d", str(tmp_path)],
                     tmp_path, FUSEDRES_BUILD_EXT="0")
    assert out.returncode == 0, out.stderr[-2000:]
    (archive,) = tmp_path.glob("fusedres-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(archive).getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    headers = [p for p in tracked if p.endswith((".h", ".cuh"))]
    assert headers and not set(headers) - names, sorted(set(headers) - names)
    assert {"LICENSE", "CHANGELOG.md", "fusedres/py.typed", "setup.py"} <= names
    assert archive.name == f"fusedres-{fusedres.__version__}.tar.gz"


def test_imported_torch_version_is_its_distribution_version(setup_py):
    """The comparison is between like spellings: the imported torch's metadata version (a wheel
    may say 2.14.1 where torch.__version__ says 2.14.1+cu130), as the installed one's is read."""
    import torch

    installed = setup_py._installed_torch_versions(setup_py._target_paths())
    assert setup_py._imported_torch_version(torch) in installed


def test_the_extension_uses_only_the_stable_abi(setup_py):
    """fusedres._C is built with Py_LIMITED_API (setup.py: py_limited_api), so one build loads
    in any Python 3 from the one torch's build names: make gpu-prepare's library, built by this
    Python 3.11, serves the GPU machines' 3.12; a wheel is tagged cpXY-abi3 accordingly."""
    from fusedres.ops import _extension

    if not _extension.LOADED:
        pytest.skip(f"fusedres._C is not built here: {_extension.LOAD_ERROR}")
    import fusedres._C

    assert fusedres._C.__file__.endswith(".abi3.so"), fusedres._C.__file__
    from torch.utils.cpp_extension import min_supported_cpython

    version = int(min_supported_cpython, 16)
    assert setup_py.limited_api_tag() == f"cp{version >> 24}{(version >> 16) & 0xFF}"
    if shutil.which("readelf") is None:
        return
    # Built with Py_LIMITED_API (a call outside the limited API would not compile), and not
    # linked to libtorch_python, which is built for one Python.
    needed = subprocess.run(["readelf", "-d", fusedres._C.__file__], capture_output=True,
                            text=True, check=True).stdout
    assert "libtorch_cpu.so" in needed and "torch_python" not in needed


def test_an_in_place_build_removes_the_copies_it_would_be_shadowed_by(setup_py, tmp_path):
    """Python imports ``_C.cpython-311-x86_64-linux-gnu.so`` before ``_C.abi3.so``: an older
    build under the version-specific name would shadow the new one."""
    pkg = tmp_path / "fusedres"
    pkg.mkdir()
    for name in ("_C.abi3.so", "_C.cpython-311-x86_64-linux-gnu.so", "_C_cuda_on_cpu.so",
                 "_C.py", "_C_cuda_on_cpu.cpython-311-x86_64-linux-gnu.so"):
        (pkg / name).write_bytes(b"x")
    removed = setup_py.remove_shadowing_builds([str(pkg / "_C.abi3.so")])
    assert [os.path.basename(p) for p in removed] == ["_C.cpython-311-x86_64-linux-gnu.so"]
    assert sorted(p.name for p in pkg.iterdir()) == [
        "_C.abi3.so", "_C.py", "_C_cuda_on_cpu.cpython-311-x86_64-linux-gnu.so",
        "_C_cuda_on_cpu.so"]
