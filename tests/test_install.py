"""A non-editable, Python-only install into a fresh virtual environment imports from outside the
repository, kernels (``fusedres.kernels``, mapped from ``kernels/``) included."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

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
        "print(fusedres._extension.LOADED, sorted(fusedres.available_backends('cpu')))\n"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    pkg, kernels, backends = out.stdout.strip().splitlines()
    site_dir = str(venv)
    assert pkg.startswith(site_dir) and kernels.startswith(site_dir), out.stdout
    assert kernels.endswith(os.path.join("fusedres", "kernels", "__init__.py"))
    # Python-only: no extension, and importing still works with the portable backend.
    assert backends.startswith("False") and "'portable'" in backends
