"""A non-editable, Python-only install into a fresh virtual environment imports from outside the
repository, kernels (``fusedres.kernels``, mapped from ``kernels/``) included, and carries its
version, py.typed and LICENSE."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fresh_venv_non_editable_install(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Reuse this environment's torch (and setuptools for the build) instead of downloading GBs.
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    parent = sysconfig.get_paths()["purelib"]
    Path(purelib.stdout.strip(), "parent-env.pth").write_text(parent + "\n")
    env = dict(os.environ, FUSEDRES_BUILD_EXT="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
         "--no-build-isolation", "--no-deps", str(ROOT)],
        check=True, env=env, cwd=tmp_path)
    code = (
        "import fusedres, fusedres.kernels, torch, os\n"
        "print(fusedres.__file__)\n"
        "print(fusedres.kernels.__file__)\n"
        "m = fusedres.BNReLUConv2d(3, 4, 3, padding=1)\n"
        "m(torch.randn(2, 3, 5, 5)).sum().backward()\n"
        "print(fusedres.ops._extension.LOADED, sorted(fusedres.available_backends('cpu')))\n"
        "from importlib import metadata\n"
        "dist = metadata.distribution('fusedres')\n"
        "files = {str(f).replace(os.sep, '/') for f in dist.files}\n"
        "print(dist.version == fusedres.__version__, 'fusedres/py.typed' in files,\n"
        "      any(f.endswith('LICENSE') for f in files), dist.metadata['License'])\n"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    pkg, kernels, backends, packaging = out.stdout.strip().splitlines()
    # One version, the typing marker and the licence in the installed distribution.
    assert packaging == "True True True BSD-3-Clause", packaging
    site_dir = str(venv)
    assert pkg.startswith(site_dir) and kernels.startswith(site_dir), out.stdout
    assert kernels.endswith(os.path.join("fusedres", "kernels", "__init__.py"))
    # Python-only: no extension, and importing still works with the portable backend.
    assert backends.startswith("False") and "'portable'" in backends


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the self-test runs the kernels for real")
@pytest.mark.parametrize("command", [["fusedres.apps.selftest"], ["fusedres", "selftest"]],
                         ids=["module", "cli"])
def test_selftest_runs_without_triton_interpret_set(command):
    """`python -m fusedres.apps.selftest` (what `make selftest` runs) and `python -m fusedres
    selftest` (the CLI; what make wheel-check runs from the installed wheel) on a machine without
    a GPU and without TRITON_INTERPRET in the environment: each must turn the interpreter on
    itself (the package defines its Triton kernels at import, before the command's code runs;
    through the CLI every kernel once raised "Cannot call @triton.jit'd outside of the scope of
    a kernel")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", *command, "--backends", "triton"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "6/6 passed" in out.stdout


@pytest.mark.parametrize("switch", ["0", "1", "auto"])
def test_test_extension_is_built_only_when_asked(switch):
    """`pip install .` (FUSEDRES_BUILD_TEST_EXT unset: 0) builds the product extension only;
    the test extension fusedres._C_cuda_on_cpu when asked, or with auto for an in-place build."""
    env = dict(os.environ, FUSEDRES_BUILD_EXT="1", FUSEDRES_BUILD_TEST_EXT=switch)
    plans = {}
    for args in (["--name"], ["build_ext", "--inplace", "--help"]):
        out = subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        plans[args[0]] = next(line for line in out.stdout.splitlines()
                              if line.startswith("fusedres: building"))
    for command, plan in plans.items():
        assert "fusedres._C (" in plan, plan
        want = switch == "1" or (switch == "auto" and command == "build_ext")
        assert ("fusedres._C_cuda_on_cpu" in plan) == want, (command, plan)


_MISMATCH = """
import importlib.util, sys
# fusedres/ops/opdefs.py loaded first, with one schema changed: the C++ functions no longer
# match it.
spec = importlib.util.spec_from_file_location("fusedres.ops.opdefs", {opdefs!r})
opdefs = importlib.util.module_from_spec(spec)
sys.modules["fusedres.ops.opdefs"] = opdefs
spec.loader.exec_module(opdefs)
opdefs.SCHEMAS["bn_relu_conv2d"] = opdefs.SCHEMAS["bn_relu_conv2d"].replace(
    ", bool batch_stats", "")
import torch
from fusedres.ops import _extension
print("LOADED", _extension.LOADED)
print("LOAD_ERROR", _extension.LOAD_ERROR)
print("CUDA_ON_CPU", _extension.load_cuda_on_cpu())
"""


def test_kernel_that_does_not_match_its_schema_is_a_load_error():
    """A C++ function whose signature differs from fusedres/ops/opdefs.py's schema (an extension
    built from other sources) is reported, not an abort: fusedres._C (registered first, then the
    schema defined) as LOAD_ERROR, the test extension (registered after) as an ImportError."""
    code = _MISMATCH.format(opdefs=str(ROOT / "fusedres" / "ops" / "opdefs.py"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    if "not available" in lines["LOAD_ERROR"]:
        pytest.skip("fusedres._C is not built")
    assert lines["LOADED"] == "False"
    assert "does not match the op schemas" in lines["LOAD_ERROR"]
    assert "operator: fusedres_cpu::bn_relu_conv2d" in lines["LOAD_ERROR"]
    if "not built" not in lines["CUDA_ON_CPU"]:
        assert "registering the fusedres_cuda kernels failed" in lines["CUDA_ON_CPU"]


def test_source_checkout_used_in_place_imports_the_kernels():
    """A checkout built in place and run from its root, with no install's mapping (the H100 run
    had none: no pip index there): ``fusedres.kernels`` is the checkout's ``kernels/``, and the
    Triton backend imports. Here the editable install's finder is taken off ``sys.meta_path``
    first, so that only the checkout can answer."""
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import fusedres, fusedres.kernels\n"
        "from fusedres.kernels import _tl\n"
        "print(fusedres.kernels.__file__)\n"
        "print(fusedres.unavailable_reason('triton', 'cpu'))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kernels, reason = out.stdout.strip().splitlines()[-2:]
    assert kernels == str(ROOT / "kernels" / "__init__.py")
    assert reason == "None"


def test_source_checkout_finder_only_where_needed(tmp_path, monkeypatch):
    """The finder maps one name, and only a checkout without an installed fusedres/kernels
    needs it."""
    from fusedres.ops import _source_checkout as sc
    assert sc.KernelsFinder().find_spec("fusedres.other") is None
    spec = sc.KernelsFinder().find_spec("fusedres.kernels")
    assert spec.submodule_search_locations == [str(ROOT / "kernels")]
    assert sc.needed()
    monkeypatch.setattr(sc, "PACKAGE_DIR", str(tmp_path))
    (tmp_path / "kernels").mkdir()
    assert not sc.needed()  # an installed copy: nothing to do
