"""Run-time dispatch of the CPU kernels by CPU capability (csrc/cpu/capability.h): the copies
built are setup.py's, the choice follows FUSEDRES_CPU_CAPABILITY or the CPU's features, a pin
the CPU or build lacks is a clear error, each copy the CPU runs agrees with the reference, and
no code outside a capability's own namespace uses AVX registers (the link-order rule of
setup.py's cpu_capability_builds).

The rule itself is tested on made-up feature sets (``choose_cpu_capability``), so that these
tests mean the same on every CPU; the copies are run on the capabilities this CPU supports, and
the others are checked to be refused."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fusedres
from fusedres.ops import _extension

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")

pytestmark = pytest.mark.skipif(not _extension.LOADED,
                                reason=f"fusedres._C not built: {_extension.LOAD_ERROR}")


@pytest.fixture(scope="module")
def ext():
    return importlib.import_module("fusedres._C")


def _runs(ext) -> list[str]:
    """The built capabilities this CPU supports, lowest first."""
    have = set(ext.cpu_features())
    return [name for name, need in ext.cpu_capabilities() if set(need) <= have]


def test_built_capabilities_are_setup_pys(ext, setup_py):
    """The copies in fusedres._C and the features dispatch.cpp checks for each are setup.py's
    list, whose -m flags compiled them: a feature compiled in but not checked would let a CPU
    without it run the copy."""
    assert [(n, list(f)) for n, f in setup_py.cpu_capabilities()] == ext.cpu_capabilities()
    defines, builds = setup_py.cpu_capability_builds()
    for (name, features), (bname, sources, flags) in zip(ext.cpu_capabilities(), builds):
        assert bname == name
        assert flags[:len(features)] == [f"-m{f}" for f in features]
        assert f"-DFUSEDRES_VEC_{name.upper()}" in flags[len(features):]
        assert sources and all(s.startswith(os.path.join("csrc", "cpu", "vec")) for s in sources)
    assert defines == [f"-DFUSEDRES_CPU_HAS_{n.upper()}" for n, _ in ext.cpu_capabilities()[1:]]


@pytest.mark.parametrize("machine,names", [
    ("x86_64", ["baseline", "avx2", "avx512"]), ("AMD64", ["baseline", "avx2", "avx512"]),
    ("aarch64", ["baseline"]), ("arm64", ["baseline"])])
def test_capabilities_per_machine_each_adds_to_the_one_before(setup_py, machine, names):
    caps = setup_py.cpu_capabilities(machine)
    assert [n for n, _ in caps] == names
    for (_, lower), (_, higher) in zip(caps, caps[1:]):
        assert set(lower) < set(higher)
    _, builds = setup_py.cpu_capability_builds(machine, only=names[-1])
    assert [n for n, _, _ in builds] == (names if len(names) == 1 else ["baseline", names[-1]])


def test_in_use_is_the_pin_or_the_best_this_cpu_runs(ext):
    """What a pinned CI run checks first: the capability in use is the one asked for."""
    pin = os.environ.get("FUSEDRES_CPU_CAPABILITY", "").strip().lower()
    want = _runs(ext)[-1] if pin in ("", "auto") else pin
    assert fusedres.cpu_capability() == want
    assert f"cpu capability: {want} (" in subprocess.run(
        [sys.executable, "-m", "fusedres", "settings"], capture_output=True, text=True,
        timeout=300).stdout


ALL = ["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi",
       "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl"]
AVX2_ONLY = ALL[:11]


@pytest.mark.skipif(not X86, reason="x86-64 builds avx2 and avx512 copies; this is not one")
@pytest.mark.parametrize("pin,features,want", [
    ("", ALL, "avx512"), ("auto", ALL, "avx512"), ("", AVX2_ONLY, "avx2"),
    ("", AVX2_ONLY[:5], "baseline"), ("avx2", ALL, "avx2"), (" AVX2 ", ALL, "avx2"),
    ("baseline", ALL, "baseline"), ("avx512", ALL, "avx512"),
    # An AVX2 CPU that lacks BMI2 (some early ones): not the avx2 copy, compiled with -mbmi2.
    ("", [f for f in AVX2_ONLY if f != "bmi2"], "baseline")])
def test_choice_on_x86(ext, pin, features, want):
    assert ext.choose_cpu_capability(pin, features) == want


@pytest.mark.skipif(not X86, reason="x86-64 builds avx2 and avx512 copies; this is not one")
@pytest.mark.parametrize("pin,features,words", [
    ("avx512", AVX2_ONLY, ["FUSEDRES_CPU_CAPABILITY=avx512", "this CPU lacks avx512f, avx512bw,"
                           " avx512dq, avx512vl", "it runs: baseline, avx2", "unset"]),
    ("avx2", AVX2_ONLY[:5], ["FUSEDRES_CPU_CAPABILITY=avx2", "lacks avx, avx2, fma, f16c",
                             "it runs: baseline"]),
    ("avx3", ALL, ["FUSEDRES_CPU_CAPABILITY: expected one of auto, baseline, avx2, avx512, "
                   "got 'avx3'"]),
    ("", ["sse3", "ssse3"], ["this CPU lacks sse4.1, sse4.2, popcnt", "baseline: x86-64-v2"]),
])
def test_refusals_on_x86_say_why(ext, pin, features, words):
    with pytest.raises(ValueError) as info:
        ext.choose_cpu_capability(pin, features)
    for w in words:
        assert w in str(info.value)


@pytest.mark.skipif(X86, reason="on x86-64 every capability is built")
def test_elsewhere_only_the_baseline_is_built(ext):
    assert [n for n, _ in ext.cpu_capabilities()] == ["baseline"]
    assert ext.choose_cpu_capability("", []) == "baseline"
    with pytest.raises(ValueError, match=r"has no avx2 kernels \(built: baseline\)"):
        ext.choose_cpu_capability("avx2", [])


# A child process with FUSEDRES_CPU_CAPABILITY pinned: the pin in force, the cpu backend's ops
# against the portable backend (the PyTorch reference of the same ops) on the shapes that take
# each code path of the copies: whole vectors, a vector tail (C=17), the NHWC period walk (C=24),
# and each dtype's lane count.
_CHECK = """
import sys
sys.path.insert(0, {tests!r})
import torch
import fusedres
from test_cpu_backend import OPS, _compare_with_portable, _inputs, _stats_dtype
print("in use:", fusedres.cpu_capability(), flush=True)
assert fusedres.unavailable_reason("cpu", "cpu") is None
torch.manual_seed(0)
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for fmt in (torch.contiguous_format, torch.channels_last):
        for c in (16, 17, 24):
            args = _inputs(n=3, c=c, h=9, w=9, co=8, dtype=dtype, x_format=fmt)
            _compare_with_portable(args, dtype)
            x = args[0]
            var, mean = torch.var_mean(x.to(_stats_dtype(dtype)), dim=(0, 2, 3), correction=0)
            got_mean, got_var = OPS.batch_stats(x)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(got_mean, mean, atol=tol, rtol=tol)
            torch.testing.assert_close(got_var, var, atol=tol, rtol=tol)
print("agree")
"""

_REFUSED = """
import pytest, torch
import fusedres
reason = fusedres.unavailable_reason("cpu", "cpu")
print("reason:", reason)
with pytest.raises(RuntimeError) as info:
    fusedres.cpu_capability()
print("raised:", info.value)
with pytest.raises(RuntimeError) as info:
    torch.ops.fusedres_cpu.batch_stats(torch.randn(2, 3, 4, 4))
print("op raised:", str(info.value).splitlines()[0])
"""


def _child(code: str, pin: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FUSEDRES_CPU_CAPABILITY=pin)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


@pytest.mark.parametrize("pin", ["baseline", "avx2", "avx512"])
def test_each_capability_runs_its_copy_or_is_refused(ext, pin):
    """Under a pin this CPU runs: that copy is in use and agrees with the reference. Under one
    it lacks, or one not built here: the cpu backend is unavailable and every op raises, each
    naming the variable and what is missing (not a silent fallback, nor an illegal
    instruction)."""
    built = [n for n, _ in ext.cpu_capabilities()]
    if pin in _runs(ext):
        out = _child(_CHECK.format(tests=str(ROOT / "tests")), pin)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        assert f"in use: {pin}\n" in out.stdout and out.stdout.endswith("agree\n"), out.stdout
        return
    out = _child(_REFUSED, pin)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    why = ("this CPU lacks" if pin in built else f"has no {pin} kernels")
    for line in ("reason:", "raised:", "op raised:"):
        said = next(s for s in out.stdout.splitlines() if s.startswith(line))
        assert f"FUSEDRES_CPU_CAPABILITY={pin}" in said and why in said, said


def test_a_malformed_pin_is_named_everywhere():
    out = _child(_REFUSED, "avx3")
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("expected one of auto, baseline, avx2, avx512, got 'avx3'") == 3
    settings = subprocess.run([sys.executable, "-m", "fusedres", "settings"], capture_output=True,
                              text=True, env=dict(os.environ, FUSEDRES_CPU_CAPABILITY="avx3"),
                              timeout=300)
    assert settings.returncode == 2
    assert "error: FUSEDRES_CPU_CAPABILITY: expected one of" in settings.stdout
    assert "cpu capability: none (FUSEDRES_CPU_CAPABILITY: expected" in settings.stdout


_FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")


@pytest.mark.skipif(not X86, reason="AVX registers are x86-64's")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_no_avx_code_outside_a_capability(ext):
    """Every function of fusedres._C that uses ymm or zmm registers belongs to the avx2 or
    avx512 copy (its name carries the copy's namespace). A shared inline function (ATen's, the
    standard library's) kept from a copy compiled for AVX would run AVX instructions on a CPU
    the dispatcher gave the baseline: the link order (setup.py) keeps the baseline's."""
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", "-j", ".text",
                          ext.__file__], capture_output=True, text=True, check=True, timeout=600)
    offenders, name, avx_functions = set(), None, 0
    for line in out.stdout.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1)
        elif name and ("%ymm" in line or "%zmm" in line):
            avx_functions += 1
            if "fusedres_avx2" not in name and "fusedres_avx512" not in name:
                offenders.add(name)
    assert avx_functions > 0, "no AVX code found at all: were the avx2/avx512 copies built?"
    assert not offenders, sorted(offenders)[:20]


# The cpu backend's numerics tests that reach the copies' code (the elementwise kernels through
# every op), run under each pin this CPU supports.
_NUMERICS = ("batch_stats or ops_match_portable or backward_add or nhwc_channels_off "
             "or nhwc_rows or large_dz or genstats_is_the_forward or pair_is_two_units")


@pytest.mark.slow
@pytest.mark.parametrize("pin", ["baseline", "avx2", "avx512"])
def test_cpu_backend_numerics_under_each_capability(ext, pin):
    if pin not in _runs(ext):
        pytest.skip(f"this CPU does not run {pin} (it runs: {', '.join(_runs(ext))})")
    env = dict(os.environ, FUSEDRES_CPU_CAPABILITY=pin)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/test_cpu_backend.py", "tests/test_cpu_capability.py::"
         "test_in_use_is_the_pin_or_the_best_this_cpu_runs", "-k",
         f"({_NUMERICS}) or test_in_use_is"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1]
