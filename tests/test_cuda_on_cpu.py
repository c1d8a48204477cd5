"""The CUDA kernels' CPU execution layer (csrc/cuda/on_cpu): batch_stats.cu run on CPU tensors
through it, the constructs it emulates, the mistakes it must catch (a missing barrier under
ThreadSanitizer, a wrong lane mask), the nvcc compile table, and the cuda backend's switch."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fusedres
from fusedres.backends import cuda
from fusedres.ops import _backend, _extension
from tools import cuda_aot, cuda_tsan

# The CPU copy of the kernels and the layer's test ops are the test extension's.
_WHY_NOT = _extension.load_cuda_on_cpu()
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None or not _extension.has_kernels("fusedres_cuda", "CPU", "batch_stats"),
    reason=f"no CPU copy of the CUDA kernels: {_WHY_NOT}")

LT = torch.ops.fusedres_cuda_layer_test if _WHY_NOT is None else None
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
IDS = ["f32", "f64", "f16", "bf16"]


# --------------------------------------------------------------------------- batch_stats.cu

# Awkward on purpose: C = 1, 3, 17, 33, 40 (NHWC tiles of 32 channels plus a tail), planes of
# 1, 13 * 7 and 181 * 97 values (several splits), N = 1.
SHAPES = [(5, 17, 13, 7), (2, 33, 1, 1), (1, 3, 64, 64), (3, 40, 9, 11), (1, 1, 181, 97)]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_batch_stats_matches_float64(dtype, channels_last):
    for shape in SHAPES:
        x = (torch.randn(*shape, dtype=torch.float64) * 3 + 2).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        mean, var = cuda.batch_stats(x)
        var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
        assert mean.dtype == var.dtype == fusedres.ops.stats_dtype(dtype)
        assert mean.shape == var.shape == (shape[1],)
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(mean.double(), mean64, atol=tol, rtol=tol)
        torch.testing.assert_close(var.double(), var64, atol=tol, rtol=tol)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_batch_stats_large_offset_keeps_the_variance(channels_last):
    """x = 1000 + noise in float32: E[x^2] - E[x]^2 would lose every digit of the variance."""
    x = 1000 + torch.randn(4, 3, 64, 64)
    x[:, 1] = x[:, 1] * 0.01 - 990
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    mean, var = cuda.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean.double(), mean64, atol=0, rtol=1e-7)
    torch.testing.assert_close(var.double(), var64, atol=0, rtol=1e-4)


def test_batch_stats_strided_input_and_empty_planes():
    x = torch.randn(4, 6, 10, 10)[:, ::2, 1:8, ::3]  # not dense: made contiguous first
    mean, var = cuda.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean.double(), mean64, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(var.double(), var64, atol=1e-6, rtol=1e-6)
    mean, var = cuda.batch_stats(torch.randn(0, 3, 4, 4))  # no values: NaN (docs/api.md)
    assert mean.isnan().all() and var.isnan().all()


def test_batch_stats_rejects_bad_input():
    with pytest.raises(ValueError, match=r"x: expected a 4-D \(N, C, H, W\) tensor"):
        cuda.batch_stats(torch.randn(3, 4, 5))
    with pytest.raises(TypeError, match="x: expected float16, bfloat16, float32 or float64"):
        cuda.batch_stats(torch.ones(2, 3, 4, 4, dtype=torch.int32))


# --------------------------------------------------------------------------- the layer


def test_warp_shuffles_votes_and_block_reductions():
    out = LT.warp_ops()
    lane = torch.arange(32)
    assert torch.equal(out[:, 0], ((lane + 3) % 32) * 10)
    assert torch.equal(out[:, 1], lane ^ 5)
    assert torch.equal(out[:, 2], torch.where(lane >= 3, lane - 3, lane))
    seg = lane % 8
    assert torch.equal(out[:, 3], torch.where(seg + 3 < 8, lane + 3, lane))
    ballot = sum(1 << i for i in range(0, 32, 3))
    assert (out[:, 4].view(torch.int32).to(torch.int64) & 0xffffffff).eq(ballot).all()
    assert out[:, 5].eq(1).all() and out[:, 6].eq(0).all()
    assert out[:, 7].eq(16 + 100 + 0).all()  # count of odd lanes, all lanes >= 0, no lane 40


def test_block_barrier_reduction_and_dynamic_shared_memory():
    x = torch.randn(64)
    torch.testing.assert_close(LT.block_sum(x, True), x.sum().reshape(1), rtol=1e-6, atol=1e-6)
    x = torch.arange(96.0)
    assert torch.equal(LT.reverse_blocks(x, 32), x.view(3, 32).flip(1).reshape(96))


def test_atomics_across_blocks():
    sum_, max_index = LT.atomics(torch.ones(1000), 128)
    assert sum_.item() == 1000 and max_index.item() == 999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_wmma_half_fragments_multiply_in_float(dtype):
    a, b = torch.randn(16, 16).to(dtype), torch.randn(16, 16).to(dtype)
    c = LT.wmma_matmul(a, b, False)
    assert c.dtype == torch.float32
    torch.testing.assert_close(c.double(), a.double() @ b.double(), atol=1e-5, rtol=1e-5)


def test_wmma_tf32_and_double():
    a, b = torch.randn(16, 8), torch.randn(8, 16)
    c = LT.wmma_matmul(a, b, True)
    # tf32 operands: the top 19 bits of each float (the tensor cores ignore the rest).
    trunc = [(t.view(torch.int32) & -8192).view(torch.float32) for t in (a, b)]
    torch.testing.assert_close(c.double(), trunc[0].double() @ trunc[1].double(),
                               atol=1e-5, rtol=1e-5)
    assert (c - a @ b).abs().max() > 0  # tf32 is not float32
    a, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(LT.wmma_matmul(a, b, False), a @ b, atol=1e-14, rtol=1e-14)


def test_warp_sum_with_the_right_masks():
    x = torch.randn(32)
    out = LT.warp_sum(x, 0xffffffff, 32, 16)
    torch.testing.assert_close(out[0], x.sum(), rtol=1e-6, atol=1e-6)
    out = LT.warp_sum(x, 0xffff, 16, 8)  # the lower half-warp on its own
    torch.testing.assert_close(out[0], x[:16].sum(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask,lanes,first,message", [
    (0xffff, 32, 16, r"lane 16 is not in its mask 0xffff"),
    (0xffffffff, 16, 16, r"(returned|have returned)"),
], ids=["lane-outside-mask", "mask-names-exited-lanes"])
def test_wrong_lane_mask_is_an_error(mask, lanes, first, message):
    """On a GPU each of these is undefined behaviour (often a wrong sum); the layer stops."""
    with pytest.raises(RuntimeError, match=message):
        LT.warp_sum(torch.ones(32), mask, lanes, first)


def test_reading_a_lane_outside_the_mask_gives_a_wrong_answer():
    """Half a warp (mask 0xffff) shuffling down by 16 reads lanes 16-31, which take no part: CUDA
    leaves the value undefined, the layer returns NaN, so the sum is visibly wrong."""
    out = LT.warp_sum(torch.ones(32), 0xffff, 16, 16)
    assert out[:16].isnan().all()


# --------------------------------------------------------------------------- ThreadSanitizer


@pytest.fixture(scope="module")
def tsan_driver():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for the ThreadSanitizer build")
    try:
        return cuda_tsan.build(verbose=False)
    except RuntimeError as exc:
        if "tsan" in str(exc).lower() and "cannot find" in str(exc).lower():
            pytest.skip(f"libtsan is not installed: {exc}")
        raise


def test_tsan_every_kernel_runs_without_reports(tsan_driver):
    res = cuda_tsan.run(["all"])
    out = res.stdout + res.stderr
    assert cuda_tsan.REPORT not in out, out[-6000:]
    assert res.returncode == 0, out[-6000:]
    listed = cuda_tsan.run(["list"]).stdout.split("\n")
    cases = [c for c in listed if c and "(demo)" not in c]
    assert len(re.findall(r"^ok ", res.stdout, re.M)) == len(cases) >= 7


def test_tsan_reports_the_missing_barrier(tsan_driver):
    res = cuda_tsan.run(["racy_block_sum"])
    assert "WARNING: ThreadSanitizer: data race" in res.stderr
    assert "block_sum_kernel" in res.stderr and "layer_kernels.cu" in res.stderr
    assert res.returncode == cuda_tsan.TSAN_EXIT


def test_tsan_build_reports_the_wrong_mask(tsan_driver):
    res = cuda_tsan.run(["wrong_mask"])
    assert res.returncode == 1
    assert re.search(r"FAIL wrong_mask: .*lane \d+ is not in its mask 0xffff", res.stdout)


# --------------------------------------------------------------------------- nvcc


def _kernel_names() -> set[str]:
    """The kernels of every translation unit cuda_aot compiles (csrc/cuda/*.cu, and
    csrc/cuda/cutlass_conv/*.cu) and of the headers they include (csrc/cuda/*.cuh:
    bn_relu_conv2d_backward.cu's kernel families; cutlass_conv/common.cuh: the CUTLASS
    kernels' one __global__)."""
    names = set()
    headers = glob.glob(os.path.join(cuda_aot.ROOT, "csrc", "cuda", "*.cuh"))
    headers += glob.glob(os.path.join(cuda_aot.ROOT, "csrc", "cuda", "cutlass_conv", "*.cuh"))
    for src in cuda_aot.sources() + sorted(headers):
        code = re.sub(r"//[^\n]*", "", open(src).read())  # not the examples in comments
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)",
                                code))
    return names


@pytest.mark.skipif(cuda_aot.find_nvcc() is None, reason="nvcc not found: csrc/cuda cannot be "
                    "compiled for sm_80/sm_90 on this machine")
def test_nvcc_compiles_every_kernel_for_sm80_and_sm90(tmp_path):
    """The CI compile of csrc/cuda: every kernel for both architectures, none of them spilling,
    and the committed table (csrc/cuda/COMPILE.md) lists every kernel the compile reports."""
    # CI compiles the CUTLASS kernels too (requirements-dev.txt installs their headers).
    assert cuda_aot.cutlass_include() is not None, "nvidia-cutlass is not installed"
    out = tmp_path / "COMPILE.md"
    res = subprocess.run([sys.executable, "-m", "tools.cuda_aot", "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| csrc/")]
    seen = {(re.search(r"`(\w+)", r).group(1), re.search(r"sm_(\d+)", r).group(1)) for r in rows}
    for name in _kernel_names():
        assert (name, "80") in seen and (name, "90") in seen, name
    # Spills are reported in the table, and there are none (issue 16's goal; the WMMA / FMA
    # backward kernels' resident-block hints in bn_relu_conv2d_backward.cu say how).
    assert all(re.search(r"\| \d+/\d+ \|", row) for row in rows), rows
    spilling = [row for row in rows if not re.search(r"\| 0/0 \|", row)]
    assert not spilling, spilling
    # The mma.sync kernels keep their state in registers: no stack frame (an array indexed by a
    # per-thread value lands in local memory without a spill being reported).
    framed = [row for row in rows
              if "_mma_kernel<" in row and not re.search(r"\| 0/0 \| 0 \|", row)]
    assert not framed, framed
    committed = open(os.path.join(cuda_aot.ROOT, "csrc", "cuda", "COMPILE.md")).read()
    for row in rows:
        kernel = re.search(r"`([^`]+)`", row).group(1)
        assert f"`{kernel}`" in committed, f"{kernel} missing from csrc/cuda/COMPILE.md"


# --------------------------------------------------------------------------- the backend


def test_cuda_backend_on_cpu_only_when_switched_on(monkeypatch):
    monkeypatch.setattr(cuda, "ON_CPU", False)
    assert "FUSEDRES_CUDA_ON_CPU=1" in cuda.unavailable_reason(torch.device("cpu"))
    monkeypatch.setattr(cuda, "ON_CPU", True)
    missing = cuda.missing_ops("CPU")
    reason = cuda.unavailable_reason(torch.device("cpu"))
    assert (reason is None) == (not missing)
    if missing:
        assert all(op in reason for op in missing)
    # A test vehicle: auto never takes it for CPU tensors.
    assert "cuda" not in _backend.auto_order("cpu")


def test_cuda_backend_says_why_it_cannot_run_on_cuda_tensors():
    reason = cuda.unavailable_reason(torch.device("cuda"))
    if torch.cuda.is_available() and not cuda.missing_ops("CUDA"):
        assert reason is None
    elif _extension.has_kernels("fusedres_cuda", "CUDA", "batch_stats"):
        assert "no CUDA device is visible" in reason or "no CUDA kernel" in reason
    else:
        assert "built without CUDA kernels" in reason


def test_switch_is_read_at_import():
    code = ("import fusedres, torch; from fusedres.backends import cuda; "
            "print(cuda.ON_CPU, cuda.unavailable_reason(torch.device('cpu')))")
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, FUSEDRES_CUDA_ON_CPU=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.startswith(expected), out.stdout


def test_missing_test_extension_is_named():
    """Without fusedres._C_cuda_on_cpu (a `pip install .`), the backend on CPU says how to get
    it."""
    code = ("import sys; sys.modules['fusedres._C_cuda_on_cpu'] = None\n"
            "import torch; from fusedres.backends import cuda\n"
            "print(cuda.unavailable_reason(torch.device('cpu')))")
    env = dict(os.environ, FUSEDRES_CUDA_ON_CPU="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert ("the test extension fusedres._C_cuda_on_cpu is not built (make test builds it; "
            "FUSEDRES_BUILD_TEST_EXT=1)") in out.stdout, out.stdout
