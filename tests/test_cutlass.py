"""The cuda backend's CUTLASS kernels (csrc/cuda/cutlass_conv, FUSEDRES_CUDA_KERNELS=cutlass): the
switch at every layer, the build's header lookup and build requirement, and what nvcc makes of
the kernels.

No CUTLASS kernel runs here: the CPU execution layer cannot run CUTLASS's PTX, so on this machine
the switch must refuse (before any state is touched), and the kernels are checked as compiled
code (tests/test_cuda_on_cpu.py's table: every instantiation for sm_80 and sm_90, no spills; the
SASS test below: the BatchNorm-ReLU in the main loop in each dtype's own instruction). On a GPU,
`fusedres selftest` runs them against the reference (its ``cuda:cutlass`` rows)."""

from __future__ import annotations

import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import build_backend
import fusedres
from fusedres import settings
from fusedres.ops import _extension
from helpers import host_knobs
from tools import cuda_aot

ROOT = cuda_aot.ROOT
_WHY_NOT = _extension.load_cuda_on_cpu()
needs_layer = pytest.mark.skipif(
    _WHY_NOT is not None or not _extension.has_kernels("fusedres_cuda", "CPU", "bn_relu_conv2d"),
    reason=f"no CPU copy of the CUDA kernels: {_WHY_NOT}")
OPS = torch.ops.fusedres_cuda


def _unit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 5, 5, generator=g)
    w = torch.randn(8, 8, 3, 3, generator=g) / 8
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    invstd = (var + 1e-5).rsqrt()
    gamma, beta = 1 + 0.1 * torch.randn(8, generator=g), 0.1 * torch.randn(8, generator=g)
    return x, w, gamma, beta, mean, invstd


def _forward(x, w, gamma, beta, mean, invstd):
    return OPS.bn_relu_conv2d(x, w, None, gamma, beta, mean, invstd, None, [1, 1], [1, 1],
                              [1, 1], True, None)


def _backward(x, w, gamma, beta, mean, invstd):
    gy = torch.ones(2, 8, 5, 5)
    return OPS.bn_relu_conv2d_backward(gy, x, w, gamma, beta, mean, invstd, [1, 1], [1, 1],
                                       [1, 1], True, [True, True, False, True, True], None)


@needs_layer
@pytest.mark.parametrize("value", ["cutlass", " CUTLASS "])
def test_cutlass_on_the_cpu_layer_is_refused_before_any_state(monkeypatch, value):
    x, w, gamma, beta, mean, invstd = _unit()
    rm, rv, nbt = torch.zeros(8), torch.ones(8), torch.zeros((), dtype=torch.long)
    monkeypatch.setenv("FUSEDRES_CUDA_KERNELS", value)
    why = r"FUSEDRES_CUDA_KERNELS=cutlass: the CUTLASS kernels run only on a GPU"
    with pytest.raises(RuntimeError, match=why):
        OPS.prepare_batch_norm(x, rm, rv, nbt, True, 0.1, 1e-5)
    assert torch.equal(rm, torch.zeros(8)) and torch.equal(rv, torch.ones(8)) and nbt.item() == 0
    with pytest.raises(RuntimeError, match=why):
        _forward(x, w, gamma, beta, mean, invstd)
    with pytest.raises(RuntimeError, match=why):
        _backward(x, w, gamma, beta, mean, invstd)


@needs_layer
def test_module_route_refuses_before_the_running_statistics(monkeypatch):
    """A BNReLUConv2d on the cuda backend (its module_unit: prepare, then the unit): the refusal
    leaves the running statistics and the batch count as they were."""
    m = fusedres.BNReLUConv2d(8, 8, 3, padding=1, bias=False).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    monkeypatch.setenv("FUSEDRES_CUDA_KERNELS", "cutlass")
    with fusedres.use_backend("cuda"), pytest.raises(RuntimeError, match="FUSEDRES_CUDA_KERNELS"):
        m(torch.randn(2, 8, 5, 5))
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@needs_layer
def test_a_malformed_value_names_the_variable(monkeypatch):
    x, w, gamma, beta, mean, invstd = _unit()
    monkeypatch.setenv("FUSEDRES_CUDA_KERNELS", "cutlas")
    with pytest.raises(RuntimeError, match=r"FUSEDRES_CUDA_KERNELS: expected one of native, "
                                           r"cutlass, got 'cutlas'"):
        _forward(x, w, gamma, beta, mean, invstd)
    with pytest.raises(ValueError, match="FUSEDRES_CUDA_KERNELS"):
        settings.get("FUSEDRES_CUDA_KERNELS")


@needs_layer
@pytest.mark.parametrize("value", ["native", " Native ", ""])
def test_native_is_the_default_in_any_spelling(monkeypatch, value):
    args = _unit()
    monkeypatch.delenv("FUSEDRES_CUDA_KERNELS", raising=False)
    y, grads = _forward(*args), _backward(*args)
    monkeypatch.setenv("FUSEDRES_CUDA_KERNELS", value)
    assert torch.equal(_forward(*args), y)
    assert all(torch.equal(a, b) for a, b in zip(_backward(*args), grads))


def test_the_build_says_which_kernel_sets_it_has():
    sets = _extension.cuda_kernel_sets()
    assert sets[0] == "native" and set(sets) <= {"native", "cutlass"}
    # This machine builds fusedres._C without CUDA (no GPU): no CUTLASS kernels in it.
    if not torch.cuda.is_available() and os.environ.get("FUSEDRES_BUILD_CUDA", "0") == "0":
        assert sets == ("native",)
    out = subprocess.run([sys.executable, "-m", "fusedres", "settings"], capture_output=True,
                         text=True, check=True).stdout
    assert f"cuda kernel sets built (FUSEDRES_CUDA_KERNELS): {', '.join(sets)}" in out


# --------------------------------------------------------------------------- the build


def test_cutlass_headers_from_cutlass_path_then_the_package(tmp_path):
    inc = tmp_path / "include" / "cutlass"
    inc.mkdir(parents=True)
    # A CUTLASS_PATH without the headers is passed over.
    assert settings.cutlass_include_dir({"CUTLASS_PATH": str(tmp_path)}) != str(
        tmp_path / "include")
    (inc / "cutlass.h").write_text("// a CUTLASS checkout's header\n")
    assert settings.cutlass_include_dir({"CUTLASS_PATH": str(tmp_path)}) == str(
        tmp_path / "include")
    # Without CUTLASS_PATH: the installed nvidia-cutlass (requirements-dev.txt installs it).
    found = settings.cutlass_include_dir({})
    assert found is not None, "nvidia-cutlass is not installed (requirements-dev.txt)"
    assert found.endswith(os.path.join("cutlass_library", "source", "include"))
    assert os.path.isfile(os.path.join(found, "cutlass", "conv", "kernel",
                                       "default_conv2d_fprop_fusion.h"))


@pytest.mark.parametrize("env,builds", [
    ({"FUSEDRES_BUILD_CUDA": "0"}, False),
    ({"FUSEDRES_BUILD_CUDA": "1"}, True),
    ({"FUSEDRES_BUILD_CUDA": "auto", "PATH": ""}, False),  # no nvcc to be found
])
def test_the_build_asks_for_cutlass_only_when_it_compiles_cuda(monkeypatch, env, builds):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUTLASS_PATH", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert build_backend.builds_cuda() is builds
    assert build_backend._cutlass() == ([build_backend.CUTLASS_REQUIREMENT] if builds else [])
    monkeypatch.setenv("CUTLASS_PATH", tempfile.gettempdir())  # the headers given: none asked
    assert build_backend._cutlass() == []


@pytest.mark.parametrize("defines", [[], ["-DFUSEDRES_WITH_CUTLASS"]], ids=["native", "cutlass"])
def test_the_module_compiles_with_and_without_the_cutlass_switch(defines):
    """csrc/module.cpp as setup.py compiles it for a CUDA build, with FUSEDRES_WITH_CUTLASS where
    the CUTLASS headers were found: no other check compiles that host code (CI builds the CPU
    extension, and tools.cuda_aot the .cu files alone), and a CUTLASS build of fusedres._C once
    failed there for a declaration inside the file's anonymous namespace."""
    import shutil
    import sysconfig

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    proc = subprocess.run([cxx, "-fsyntax-only", "-std=c++17", "-Wall", "-Werror", *defines,
                           "-I", sysconfig.get_paths()["include"], "-I", os.path.join(ROOT, "csrc"),
                           os.path.join(ROOT, "csrc", "module.cpp")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cutlass_pins_agree():
    """The build requirement (build_backend.py) and the dev install (requirements-dev.txt) ask
    for the same nvidia-cutlass, whose headers the compile table was made with."""
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        pins = [line.strip() for line in f if line.startswith("nvidia-cutlass")]
    assert pins == [build_backend.CUTLASS_REQUIREMENT]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert 'build-backend = "build_backend"' in text and 'backend-path = ["."]' in text
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:
        assert "build_backend.py" in f.read()  # an sdist builds with it too


# --------------------------------------------------------------------------- the host rules


TESTING = torch.ops.fusedres_cuda_testing
# The weight gradient's tiles (BM, BN) in plan.h's WgradTile order: large, narrow, thin, small.
WGRAD_TILES = [(128, 128), (64, 128), (32, 64), (64, 64)]


def _plan_cases():
    """The model's units (traffic.CIFAR_UNITS, IMAGENET_UNITS) on A100 and H100 SM counts, and
    a sweep of shapes past the units (narrow and wide Co, one tile to thousands, small and
    large pixel counts, resident counts from 1 block a GPU to 6 an SM)."""
    from fusedres.kernels import traffic

    for u in traffic.CIFAR_UNITS + traffic.IMAGENET_UNITS:
        for sms in (108, 132):
            yield u.co, u.k * u.k * u.c, u.n * u.ho * u.ho, sms
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        co = 8 * int(torch.randint(1, 129, (), generator=g))
        columns = 8 * int(torch.randint(1, 1153, (), generator=g))
        pixels = int(torch.randint(1, 1 << 22, (), generator=g))
        yield co, columns, pixels, int(torch.randint(1, 200, (), generator=g))


@needs_layer
def test_the_models_tile_and_split_rules_are_the_kernels():
    """tools/perfmodel's copies of fprop_tile and the weight gradient's plan give what
    csrc/cuda/cutlass_conv/plan.h (the header the GPU build compiles, run here through the test
    extension) gives, on the model's units and a sweep past them."""
    from tools.perfmodel import cuda_sass

    for co, columns, pixels, sms in _plan_cases():
        m = pixels
        for major in (8, 9, 10):
            assert tuple(TESTING.cutlass_fprop_tile(m, co, sms, major)) == (
                cuda_sass.cutlass_fprop_tile(m, co, sms, 10 * major)), (m, co, sms, major)
        resident = [sms * k for k in (1, 2, 6, 4)]  # per tile: large, narrow, thin, small
        want = cuda_sass.cutlass_wgrad_plan(
            co, columns, pixels, lambda bm, bn, r=resident: r[WGRAD_TILES.index((bm, bn))])
        assert tuple(TESTING.cutlass_wgrad_plan(co, columns, pixels, resident)) == want, (
            co, columns, pixels, sms)


@needs_layer
def test_the_models_data_gradient_tile_rules_are_the_kernels():
    """tools/perfmodel's copies of the native data gradient's tile rules give the host copy's
    answers over a sweep: the most taps a stride phase has (dgrad_phase_taps), the paired-tap
    rule (dgrad_mma_taps) and the columns (dgrad_mma_cols) on sm_80 and sm_90."""
    from tools.perfmodel import cuda_sass

    for k, s, p, h in itertools.product(range(1, 5), range(1, 4), range(3), (1, 2, 5, 8)):
        assert TESTING.dgrad_phase_taps([k, k], [s, s], [p, p], [1, 1], h, h) == (
            cuda_sass.dgrad_phase_taps(k, s, p, h)), (k, s, p, h)
    # 2 x 2 and 3 x 3 at their own stride: one tap a phase (no pairing there)
    assert cuda_sass.dgrad_phase_taps(2, 2, 0, 8) == cuda_sass.dgrad_phase_taps(3, 3, 1, 9) == 1
    for major, sms in itertools.product((8, 9), (1, 108, 132)):
        with host_knobs(sms=sms, major=major):
            for c, co, taps in itertools.product((8, 16, 24, 72), (8, 16, 40), (1, 2, 9)):
                assert TESTING.dgrad_mma_taps(c, co, taps) == cuda_sass.dgrad_mma_taps(
                    c, co, taps, 10 * major), (major, c, co, taps)
            for rows, c, phases in itertools.product((100, 128 * 66, 128 * 132, 10**5),
                                                     (16, 64, 72, 256, 512), (1, 4)):
                assert TESTING.dgrad_mma_cols(rows, c, phases) == cuda_sass.dgrad_mma_cols(
                    rows, c, phases, sms, 10 * major), (major, sms, rows, c, phases)


@needs_layer
def test_the_weight_gradient_split_keeps_its_limits():
    """Every split: at least 512 pixels a slice (or 1), at most 256 slices and 64 MiB of
    float32 partials (or 1), and no other split within the limits has fewer waves per slice."""
    for co, columns, pixels, sms in _plan_cases():
        resident = [sms, 2 * sms, 6 * sms, 4 * sms]
        bm, bn, split = TESTING.cutlass_wgrad_plan(co, columns, pixels, resident)
        most = max(1, min(256, pixels // 512, (64 << 20) // (co * columns * 4)))
        assert 1 <= split <= most, (co, columns, pixels, split)
        slots = resident[WGRAD_TILES.index((bm, bn))]
        tiles = -(-co // bm) * -(-columns // bn)
        per = [-(-tiles * k // slots) / k for k in range(1, most + 1)]
        assert per[split - 1] == min(per) and per.index(min(per)) == split - 1


@needs_layer
def test_which_units_take_the_cutlass_weight_gradient_is_plan_h():
    """tools/perfmodel's copy of wgrad_on_cutlass gives plan.h's answer: filters larger than
    1 x 1 take CUTLASS's weight gradient ("store"), 1 x 1 ones keep the native "sums" plan."""
    from tools.perfmodel import cuda_sass

    for kh, kw in itertools.product(range(1, 8), repeat=2):
        assert TESTING.cutlass_wgrad_on(kh, kw) is cuda_sass.cutlass_wgrad_on(kh, kw), (kh, kw)
    assert not cuda_sass.cutlass_wgrad_on(1, 1) and cuda_sass.cutlass_wgrad_on(3, 3)


def test_the_gpu_selftest_takes_every_tile():
    """On an H100's or H200's 132 SMs (and on sm_90 with an A100's 108), the GPU self-test's
    cases (16-bit, channels-last) take every forward and weight-gradient tile of the table,
    and split the weight gradient's pixels: a GPU run of `fusedres selftest` runs every CUTLASS
    kernel the build has, and the native data gradient's wide tile. On an A100 (sm_80) the
    forward takes its 64 x 64 tile for Co > 32, and the thin tiles below."""
    from fusedres.apps import selftest
    from tools.perfmodel import cuda_sass

    a100 = {cuda_sass.cutlass_fprop_tile(c.n * c.ho * c.ho, c.cout, 108, 80)
            for c in selftest.GPU_CASES}
    assert a100 == {(64, 64), (128, 32), (128, 16)}, a100
    # The native data gradient's wide tile (sm_90, C > 64) runs in the self-test too.
    for sms in (108, 132):
        wide = [c.name for c in selftest.GPU_CASES
                if cuda_sass.dgrad_mma_cols(c.n * (-(-c.hw // c.stride)) ** 2, c.cin,
                                            min(c.stride, c.hw) ** 2, sms, 90) == 128]
        assert wide, sms
    # resident blocks an SM: from 1 to 8 (the most any tile's registers allow: COMPILE.md)
    for sms, per_sm in itertools.product((108, 132), (1, 8)):
        fprop, wgrad, splits = set(), set(), set()
        for c in selftest.GPU_CASES:
            m = c.n * c.ho * c.ho
            fprop.add(cuda_sass.cutlass_fprop_tile(m, c.cout, sms, 90))
            bm, bn, split = cuda_sass.cutlass_wgrad_plan(c.cout, c.k * c.k * c.cin, m,
                                                         lambda bm, bn, r=sms * per_sm: r)
            wgrad.add((bm, bn))
            splits.add(split > 1)
        assert fprop == {(128, 128), (256, 64), (128, 64), (128, 32), (64, 64), (128, 16)}, (
            sms, fprop)
        assert wgrad == set(WGRAD_TILES), (sms, wgrad)
        assert True in splits, (sms, per_sm)


# --------------------------------------------------------------------------- nvcc


def _functions(obj: bytes) -> dict[str, str]:
    """SASS text per (demangled, shortened) kernel and arch of an nvcc object."""
    from tools.perfmodel import cuda_sass

    (dump,) = cuda_sass.cuobjdump(obj, "-sass")
    assert "Function : " in dump, "cuobjdump -sass printed no function"
    chunks = re.split(r"\n\s*(?=Function : )", dump)
    mangled = [re.match(r"Function : (\S+)", c).group(1) for c in chunks[1:]]
    names = cuda_aot.demangle(mangled)
    out: dict[str, str] = {}
    for m, chunk in zip(mangled, chunks[1:]):
        out[names[m]] = out.get(names[m], "") + chunk
    return out


@pytest.mark.skipif(cuda_aot.find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("src", ["fprop.cu", "wgrad.cu"])
def test_nvcc_cutlass_kernels_transform_in_their_dtype(src):
    """Each CUTLASS kernel: HMMA of its dtype. The forward's main loop applies the
    BatchNorm-ReLU as packed fused multiply-adds with ReLU of that dtype: HFMA2.RELU (CUTLASS's
    float16 transform) or HFMA2.BF16_V2.RELU (this project's bfloat16 one, common.cuh); a
    bfloat16 kernel that took the float16 transform would compute on the wrong format. The
    weight gradient reads the activation the data gradient wrote: no transform at all."""
    assert cuda_aot.cutlass_include() is not None, "nvidia-cutlass is not installed"
    path = os.path.join(ROOT, "csrc", "cuda", "cutlass_conv", src)
    obj = cuda_aot.compile_cached(cuda_aot.find_nvcc(), path, cuda_aot.ARCHS).obj
    kernels = {n: t for n, t in _functions(obj).items() if "cutlass_conv_kernel" in n}
    tiles = 6 if src == "fprop.cu" else 4
    assert len(kernels) == 2 * tiles, sorted(kernels)  # {half, bfloat16} x the tiles
    for name, text in kernels.items():
        bf16 = "bfloat16_t" in name
        assert re.search(r"HMMA\.16816\.F32\.BF16" if bf16 else r"HMMA\.16816\.F32 ", text), name
        fp16_relu = re.findall(r"HFMA2\.RELU", text)
        bf16_relu = re.findall(r"HFMA2\.BF16_V2\.RELU", text)
        if src == "wgrad.cu":
            assert not fp16_relu and not bf16_relu, name
        else:
            assert (bf16_relu and not fp16_relu) if bf16 else (fp16_relu and not bf16_relu), name


@pytest.mark.skipif(cuda_aot.find_nvcc() is None, reason="nvcc not found")
def test_nvcc_model_prefers_the_backward_the_rule_picks():
    """On every unit of the model (A100 and H100, both 16-bit dtypes), the backward
    wgrad_on_cutlass picks for FUSEDRES_CUDA_KERNELS=cutlass ("store" with CUTLASS's weight
    gradient, or the native "sums") is the one the model prices lower (MODELED: the rule's
    reason, not a measurement)."""
    from fusedres.kernels import traffic
    from tools.perfmodel import cuda_sass
    from tools.perfmodel.devices import A100, H100

    rows = cuda_sass.cuda_rows(ROOT)
    for u, dev, dtype in itertools.product(traffic.CIFAR_UNITS + traffic.IMAGENET_UNITS,
                                           (A100, H100), ("fp16", "bf16")):
        t = {b: cuda_sass.model_cutlass_unit(u, dtype, dev, rows, b).high_s
             for b in ("store", "sums", "rule")}
        picked = "store" if cuda_sass.cutlass_wgrad_on(u.k, u.k) else "sums"
        assert t["rule"] == t[picked] == min(t["store"], t["sums"]), (u.name, dev.name, t)


# --------------------------------------------------------------------------- the self-test


def test_selftest_pins_the_kernel_sets():
    from fusedres.apps import selftest

    assert selftest._kernels_env("cuda") == ("cuda", "native")
    assert selftest._kernels_env(selftest.CUTLASS) == ("cuda", "cutlass")
    assert selftest._kernels_env("triton") == ("triton", None)


def test_selftest_runs_every_backend_on_a_case_before_the_next(monkeypatch):
    """Case-major: a self-test stopped by the GPU check's time limit has every backend's rows,
    cuda:cutlass's among them, for each case it reached, each with the kernel set it names."""
    from fusedres.apps import selftest

    seen = []

    def fake_case(case, dtype, device, cl, reps, backend):
        seen.append((case.name, backend, os.environ.get("FUSEDRES_CUDA_KERNELS")))
        return dict(case=case.name, dtype=str(dtype), layout="nhwc" if cl else "nchw", ok=True)

    monkeypatch.setattr(selftest, "run_case", fake_case)
    monkeypatch.setattr(fusedres, "cutlass_launches", itertools.count().__next__)
    monkeypatch.delenv("FUSEDRES_CUDA_KERNELS", raising=False)
    labels = ["triton", "cuda", selftest.CUTLASS]
    rows = selftest.run("cuda", 0, labels)
    per_case = 3 * 2  # dtypes x layouts on a GPU
    expect = [(c.name, b, k) for c in selftest.GPU_CASES
              for b, k in (("triton", None), ("cuda", "native"), ("cuda", "cutlass"))
              for _ in range(per_case)]
    assert seen == expect
    assert [r["backend"] for r in rows[:3 * per_case]] == [b for b in labels
                                                           for _ in range(per_case)]


def test_selftest_fails_a_cutlass_case_that_launched_nothing(monkeypatch):
    """A cuda:cutlass case the CUTLASS kernels take passes only if it launched one of them; the
    cases they do not take (float32, NCHW) pass on the native kernels."""
    from fusedres.apps import selftest

    case = next(c for c in selftest.GPU_CASES if c.cin % 8 == 0 and c.cout % 8 == 0)
    monkeypatch.setattr(selftest, "run_case", lambda case, dtype, device, cl, reps, backend: dict(
        backend=backend, case=case.name, dtype=str(dtype), layout="nhwc" if cl else "nchw",
        ok=True))
    for step, bf16_nhwc_ok in ((0, False), (1, True)):
        # the counter as each case reads it: constant (nothing launched) or one more each read
        reads = itertools.count(0, step) if step else itertools.repeat(0)
        monkeypatch.setattr(fusedres, "cutlass_launches", functools.partial(next, reads))
        rows: list[dict] = []
        selftest._run_backend(rows, selftest.CUTLASS, "cuda", [case],
                              [torch.bfloat16, torch.float32], torch.device("cuda"), True, 0, None)
        got = {(r["dtype"], r["layout"]): r["ok"] for r in rows}
        assert got == {("torch.bfloat16", "nhwc"): bf16_nhwc_ok, ("torch.bfloat16", "nchw"): True,
                       ("torch.float32", "nhwc"): True, ("torch.float32", "nchw"): True}
        assert all(r["backend"] == selftest.CUTLASS for r in rows)


# --------------------------------------------------------------------------- the launch count


@pytest.mark.skipif(cuda_aot.find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("n,h,k,w_cl", [(2, 8, 3, False), (8, 32, 3, False), (2, 8, 1, False),
                                          (2, 8, 3, True)],
                         ids=["unsplit", "split", "1x1", "weight-channels-last"])
def test_nvcc_model_prices_every_launch_the_host_makes(n, h, k, w_cl):
    """The native step the model prices (tools/perfmodel/cuda_sass.model_cuda_unit: one entry a
    launch) makes as many launches as the host: the cuda backend's own (the CPU execution
    layer's counter) and the ATen kernels inside its ops (benchmarks/hostcost.inner_kernels),
    for a 16-bit channels-last unit's statistics, forward and backward on an H100's 132 SMs
    (the host copy's default): 3x3 with the weight gradient unsplit and split, 1x1 (whose
    weight is its own data-gradient layout: no copy), and 3x3 with a channels-last weight
    (which the data gradient reads in place: no copy either)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import hostcost
    from fusedres.kernels import traffic
    from tools.perfmodel import cuda_sass
    from tools.perfmodel.devices import H100

    why = _extension.load_cuda_on_cpu()
    if why is not None:
        pytest.skip(f"the CPU execution layer's extension: {why}")
    ops, layer = torch.ops.fusedres_cuda, torch.ops.fusedres_cuda_layer_test
    c = co = 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, h, generator=g).half().to(memory_format=torch.channels_last)
    w = (torch.randn(co, c, k, k, generator=g) * 0.1).half()
    if w_cl:
        w = w.to(memory_format=torch.channels_last)
    gamma, beta = torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)
    rm, rv, nbt = torch.zeros(c), torch.ones(c), torch.zeros((), dtype=torch.long)
    gy = torch.randn(n, co, h, h, generator=g).half().to(memory_format=torch.channels_last)
    geo = ([1, 1], [k // 2, k // 2], [1, 1])

    def step():
        mean, invstd = ops.prepare_batch_norm(x, rm, rv, nbt, True, 0.1, 1e-5)
        ops.bn_relu_conv2d(x, w, None, gamma, beta, mean, invstd, x, *geo, True)
        ops.bn_relu_conv2d_backward(gy, x, w, gamma, beta, mean, invstd, *geo, True,
                                    [True, True, False, True, True])

    step()
    before = layer.launches()
    aten = hostcost.inner_kernels(step)
    host = layer.launches() - before + len(aten)
    unit = traffic.Unit("probe", n, c, h, co, k, 1, True, 2)
    modeled = cuda_sass.model_cuda_unit(unit, "fp16", H100, cuda_sass.cuda_rows(ROOT),
                                        weight_channels_last=w_cl)
    names = [k[0] for k in modeled.kernels]
    assert len(names) == host, (names, aten)
    assert ("dW partials sum" in names) == (n == 8), names  # the split case is split
    assert ("weight pack (dgrad)" in names) == (k > 1 and not w_cl), names
