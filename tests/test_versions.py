"""The supported torch / Triton range (fusedres/_versions.py) and what keeps the older end
working (kernels/_compat.py): the refusal of an older version in one sentence, triton 3.6's
interpreter scalar rule, and the zero-padding of a dot narrower than the installed Triton takes.
CI's compat step (``make compat``) runs the Triton tests with torch 2.11 / triton 3.6 as well;
these tests run on whatever is installed."""

import os
import subprocess
import sys
import types

import pytest
import torch

import fusedres
from fusedres import _versions as V


@pytest.mark.parametrize("text, numbers", [
    ("2.11.0+cu130", (2, 11, 0)), ("2.14.1", (2, 14, 1)), ("2.12.0.dev20260101", (2, 12, 0)),
    ("2.11.0a0+git1234", (2, 11, 0)), ("3.6.0", (3, 6, 0)), ("3", (3,)), ("", ())])
def test_release_numbers(text, numbers):
    assert V.release(text) == numbers


def test_problems_name_the_supported_versions_in_one_sentence():
    for ok in ("2.11.0", "2.11.0+cu130", "2.14.1", "3.0.0"):
        assert V.torch_problem(ok) is None, ok
    for ok in ("3.6.0", "3.8.0", "4.0.0"):
        assert V.triton_problem(ok) is None, ok
    for old in ("2.10.0", "2.6.0+cpu", "1.13.1"):
        text = V.torch_problem(old)
        assert text.startswith("fusedres supports torch >= 2.11 (tested: 2.11.0 and 2.14.1)")
        assert "triton >= 3.6" in text and text.endswith(f"this is torch {old}.")
        assert text.count(". ") == 0  # one sentence
    text = V.triton_problem("3.5.1")
    assert "triton >= 3.6 (tested: 3.6.0 and 3.8.0)" in text
    assert text.endswith("this is triton 3.5.1.")


def test_installed_versions_are_supported():
    assert V.torch_problem(torch.__version__) is None
    triton = pytest.importorskip("triton")
    assert V.triton_problem(triton.__version__) is None


def test_tested_ends_match_the_pins():
    """The upper tested end is what requirements-dev.txt installs and what an isolated build
    (pyproject.toml's build requirement) compiles fusedres._C against; the lower what `make
    compat` installs (its defaults in the Makefile)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    reqs = open(os.path.join(root, "requirements-dev.txt")).read()
    assert f"torch=={V.TESTED['torch'][1]}\n" in reqs
    makefile = open(os.path.join(root, "Makefile")).read()
    assert f"COMPAT_TORCH  ?= {V.TESTED['torch'][0]}\n" in makefile
    assert f"COMPAT_TRITON ?= {V.TESTED['triton'][0]}\n" in makefile
    setup = open(os.path.join(root, "setup.py")).read()
    floor = ".".join(map(str, V.TORCH_MIN))
    assert f'"torch>={floor}"' in setup
    assert f'"triton>={".".join(map(str, V.TRITON_MIN))}"' in setup
    pyproject = open(os.path.join(root, "pyproject.toml")).read()
    pinned = V.TESTED["torch"][1]
    assert f'"torch=={pinned}"' in pyproject


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})


def test_import_refuses_an_older_torch_in_one_sentence():
    proc = _run("import torch\ntorch.__version__ = '2.10.0'\nimport fusedres")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: {V.torch_problem('2.10.0')}", proc.stderr[-2000:]


def test_older_triton_makes_the_triton_backend_unavailable_saying_why():
    pytest.importorskip("triton")
    proc = _run("import triton\ntriton.__version__ = '3.5.1'\nimport fusedres\n"
                "print(fusedres.unavailable_reason('triton', 'cpu'))\n"
                "print(fusedres.available_backends('cpu'))\n"
                "import fusedres.kernels")
    out = proc.stdout.splitlines()
    assert out[0] == ("the Triton kernels failed to import (ImportError: "
                      f"{V.triton_problem('3.5.1')})"), proc.stdout + proc.stderr[-2000:]
    assert "triton" not in out[1] and "portable" in out[1]
    assert proc.stderr.strip().splitlines()[-1] == f"ImportError: {V.triton_problem('3.5.1')}"


# --------------------------------------------------------------------------- kernels/_compat

def test_interpreter_index_patch_applies_only_to_the_unsqueezed_rule(monkeypatch):
    """triton 3.6's interpreter converts a scalar with ``int(self.handle.data)`` (1-element 1-d
    arrays, refused by numpy >= 2.4); the patch wraps the function that sets it, and only
    when the installed one has that line (triton 3.8 squeezes, and is left alone)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    from fusedres.kernels import _compat

    installed = interpreter._patch_lang_tensor
    if not getattr(installed, "fusedres_index_patch", False):
        assert not _compat.patch_interpreter_index()  # nothing to fix here: left as it is
    calls = []
    ns: dict = {}
    exec("def _patch_lang_tensor(tensor, scope):\n"
         "    calls.append(tensor)\n"
         "    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data))\n",
         {"calls": calls}, ns)
    old = ns["_patch_lang_tensor"]
    monkeypatch.setattr(_compat.inspect, "getsource", lambda fn: (
        "def _patch_lang_tensor(tensor, scope):\n"
        "    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data))\n"))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old)
    assert _compat.patch_interpreter_index()
    assert not _compat.patch_interpreter_index()  # once
    patched = interpreter._patch_lang_tensor
    assert patched is not old and patched.fusedres_index_patch

    class Scope:
        def __init__(self):
            self.attrs = []

        def set_attr(self, obj, name, value):
            self.attrs.append((name, value))
            setattr(obj, name, value)

    class Tensor:
        pass

    scope = Scope()
    patched(Tensor, scope)
    assert calls == [Tensor] and [n for n, _ in scope.attrs] == ["__index__", "__index__"]
    t = Tensor()
    t.handle = types.SimpleNamespace(data=np.array([7], dtype=np.int32))
    assert range(t)[-1] == 6  # what `for i in range(n)` does with a kernel argument n
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        with pytest.raises(TypeError, match="0-dimensional"):
            scope.attrs[0][1](t)  # the unsqueezed rule: what failed


def test_dot_min_k_is_the_installed_triton_rule():
    triton = pytest.importorskip("triton")
    from fusedres.kernels import _compat

    k = _compat.DOT_MIN_K
    assert k[16] == 16 and k[32] in (8, 16) and k[64] in (4, 16)
    if V.release(triton.__version__)[:2] >= (3, 8):
        assert (k[32], k[64]) == (8, 4)
    if V.release(triton.__version__)[:2] == (3, 6):
        assert (k[32], k[64]) == (16, 16)


try:  # a dot through _tl.mma on a K the test picks (defined as the kernels are: at import)
    import triton
    import triton.language as tl

    from fusedres.kernels._tl import mma
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def narrow_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m = tl.arange(0, M)
        n = tl.arange(0, N)
        k = tl.arange(0, K)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        acc = tl.zeros((M, N), dtype=a.dtype)
        acc = mma(acc, a, b, False, False)
        tl.store(c_ptr + m[:, None] * N + n[None, :], acc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("narrow", [2, 4])
def test_mma_pads_a_k_narrower_than_the_dot_takes(dtype, narrow):
    """``_tl.mma`` on a K of the installed Triton's least dot K / 2 and / 4 (one and two
    widenings with zeros): the exact product, under the interpreter."""
    if triton is None:
        pytest.skip("triton is not installed")
    from fusedres.kernels import _common
    from fusedres.kernels._compat import DOT_MIN_K

    if not _common.interpreting():
        pytest.skip("numerics under TRITON_INTERPRET=1; the GPU compile is the next test's")
    k = max(1, DOT_MIN_K[64 if dtype == torch.float64 else 32] // narrow)
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-8, 8, (16, k), generator=g).to(dtype)  # exact in any order
    b = torch.randint(-8, 8, (k, 16), generator=g).to(dtype)
    c = torch.empty(16, 16, dtype=dtype)
    narrow_dot[(1,)](a, b, c, 16, 16, k)
    assert torch.equal(c, a @ b)


_COMPILE_NARROW = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import sys
sys.path.insert(0, {tests!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from test_versions import narrow_dot as kernel
from fusedres.kernels._compat import DOT_MIN_K

for dtype, width in (("fp32", 32), ("fp64", 64)):
    k = max(1, DOT_MIN_K[width] // 2)
    src = ASTSource(kernel, signature={{"a_ptr": "*" + dtype, "b_ptr": "*" + dtype,
                                        "c_ptr": "*" + dtype, "M": "constexpr",
                                        "N": "constexpr", "K": "constexpr"}},
                    constexprs={{"M": 16, "N": 16, "K": k}})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(dtype, k, "ok" if compiled.asm.get("cubin") else "no cubin")
"""


def test_mma_padding_compiles_for_sm90():
    """The padded dot compiles for sm_90 (no GPU needed), float32 and float64, at half the
    least K of the installed Triton's dot (triton 3.6: 8; 3.8: 4 and 2)."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_NARROW.format(tests=tests)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert [line.split()[0] for line in lines if line] == ["fp32", "fp64"], proc.stdout
    assert all(line.endswith(" ok") for line in lines if line), proc.stdout


def test_fusedres_imports_before_the_extension_checks():
    """The version check runs first: fusedres/__init__.py calls it before importing
    anything that needs a supported torch."""
    src = open(fusedres.__file__).read()
    assert src.index("_versions.check_torch()") < src.index("from . import (")
