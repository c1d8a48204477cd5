"""csrc/cuda/mma.cuh (mma.sync m16n8k16, ldmatrix, cp.async) and the execution layer's rules, each
shown catching a planted bug as a GPU would: a wrong fragment layout or a missing cp.async wait
gives a wrong answer, a misaligned ldmatrix/cp.async or a launch past __launch_bounds__ or the
48 KiB dynamic shared-memory default without the opt-in is an error, shared memory not written
in the block reads NaN. Plus the nvcc compile of the same header for sm_80 and sm_90.
The AddressSanitizer + UBSan driver (make asan, which CI runs on the whole case matrix) is shown
catching a planted out-of-bounds read. Cost: about 5 s on CPU (one-warp kernels, two nvcc
compiles of one small file, two runs of the sanitizer driver once built)."""

import os
import re
import shutil
import subprocess

import pytest
import torch

from fusedres.ops import _extension
from tools import cuda_aot, cuda_tsan

_WHY_NOT = _extension.load_cuda_on_cpu()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no test extension: {_WHY_NOT}")
LT = torch.ops.fusedres_cuda_layer_test if _WHY_NOT is None else None
HALF = [torch.float16, torch.bfloat16]
IDS = ["f16", "bf16"]
RIGHT, WRONG_LAYOUT, MISSING_WAIT = 0, 1, 2


def _small_ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_gemm_tile_on_mma_ldmatrix_cp_async_is_exact(dtype):
    """16 x 32 x 16 on two cp.async stages, ldmatrix.x4 (A) and .x4.trans (B), 4 mma.sync:
    small integers, so the product is exact in float32."""
    for seed in range(3):
        a = _small_ints(16, 32, seed=seed).to(dtype)
        b = _small_ints(32, 16, seed=seed + 9).to(dtype)
        c = LT.mma_gemm(a, b, RIGHT)
        assert c.dtype == torch.float32
        assert torch.equal(c.double(), a.double() @ b.double())


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_wrong_fragment_layout_gives_a_wrong_answer(dtype):
    a, b = _small_ints(16, 32, seed=1).to(dtype), _small_ints(32, 16, seed=2).to(dtype)
    c = LT.mma_gemm(a, b, WRONG_LAYOUT)
    assert c.isfinite().all()
    wrong = (c.double() != a.double() @ b.double()).sum().item()
    assert wrong > 128, wrong  # rows 0-7 and 8-15 mix: nearly every element is off


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_missing_cp_async_wait_gives_a_wrong_answer(dtype):
    """The first stage is consumed before its cp.async.wait_group: its data has not landed."""
    a, b = _small_ints(16, 32, seed=3).to(dtype), _small_ints(32, 16, seed=4).to(dtype)
    assert LT.mma_gemm(a, b, MISSING_WAIT).isnan().all()


def test_ldmatrix_delivers_the_documented_elements():
    """Table value r * 24 + c at (row r, column c); lane l gives row l's address."""
    table = torch.arange(32 * 24, dtype=torch.int16).view(32, 24)
    lane = torch.arange(32)
    for num in (1, 2, 4):
        for trans in (False, True):
            regs = LT.ldmatrix_probe(table, num, trans, 0, False)
            for i in range(num):
                if trans:  # (2 (l % 4) + j, l / 4) of matrix i, whose rows are 8i .. 8i + 7
                    r, c = 8 * i + 2 * (lane % 4), lane // 4
                    lo, hi = r * 24 + c, (r + 1) * 24 + c
                else:      # (l / 4, 2 (l % 4) + j)
                    r, c = 8 * i + lane // 4, 2 * (lane % 4)
                    lo, hi = r * 24 + c, r * 24 + c + 1
                assert torch.equal(regs[:, i], lo + (hi << 16)), (num, trans, i)
            assert regs[:, num:].eq(0).all()


@pytest.mark.parametrize("offset,from_global,message", [
    (4, False, r"row address of lane 0 .* is not 16-byte aligned"),
    (0, True, r"row address of lane 0 .* is not 16 bytes of the block's shared memory"),
], ids=["misaligned", "global-address"])
def test_bad_ldmatrix_address_is_an_error(offset, from_global, message):
    table = torch.zeros(32, 24, dtype=torch.int16)
    with pytest.raises(RuntimeError, match=message):
        LT.ldmatrix_probe(table, 4, False, offset, from_global)


def test_cp_async_lands_at_the_wait_with_its_zero_fill():
    src = torch.arange(64, dtype=torch.uint8)
    assert torch.equal(LT.cp_async_probe(src, 16, True, 16, 0, 16, True), src[16:32])
    # Before the wait the destination holds garbage (0xff), not the copy.
    assert LT.cp_async_probe(src, 16, True, 16, 0, 16, False).eq(255).all()
    got = LT.cp_async_probe(src, 8, False, 8, 16, 5, True)  # 8-byte .ca, src-size 5
    assert got[:5].tolist() == [8, 9, 10, 11, 12] and got[5:8].eq(0).all()
    got = LT.cp_async_probe(src, 4, False, 4, 4, 0, True)  # src-size 0: four zeros
    assert got[:4].eq(0).all()


@pytest.mark.parametrize("bytes_,cg,src_offset,dst_offset,src_size,message", [
    (16, True, 8, 0, 16, r"global source .* is not 16-byte aligned"),
    (16, False, 0, 8, 16, r"shared destination .* is not 16-byte aligned"),
    (8, False, 4, 0, 8, r"global source .* is not 8-byte aligned"),
    (4, False, 0, 0, 5, r"src-size 5 is outside \[0, 4\]"),
], ids=["cg-src", "ca16-dst", "ca8-src", "src-size"])
def test_bad_cp_async_is_an_error(bytes_, cg, src_offset, dst_offset, src_size, message):
    src = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=message):
        LT.cp_async_probe(src, bytes_, cg, src_offset, dst_offset, src_size, True)


def test_shared_memory_not_written_in_the_block_reads_poison():
    out = LT.unwritten_shared(3, False)
    assert torch.equal(out, torch.arange(31.0, -1, -1).expand(3, 32))
    out = LT.unwritten_shared(3, True)  # only block 0 writes: blocks 1, 2 read the poison
    assert torch.equal(out[0], torch.arange(31.0, -1, -1))
    assert out[1:].isnan().all()


def test_launch_past_launch_bounds_is_an_error():
    assert torch.equal(LT.bounded(64), torch.arange(64, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"__launch_bounds__\(64\) but launched with 128"):
        LT.bounded(128)


def test_dynamic_shared_memory_above_48_kib_needs_the_opt_in():
    assert LT.dynamic_smem(48 * 1024, False)[:32].eq(torch.arange(1.0, 33)).all()
    with pytest.raises(RuntimeError, match=r"exceed the 48 KiB default without the opt-in"):
        LT.dynamic_smem(64 * 1024, False)
    out = LT.dynamic_smem(64 * 1024, True)
    assert out[32] == 0 and out[:32].eq(torch.arange(1.0, 33)).all()
    with pytest.raises(RuntimeError, match=r"exceed the 166912 bytes"):
        LT.dynamic_smem(164 * 1024, True)  # past sm_80's limit: refused even with the opt-in


def test_every_bounded_kernel_states_its_bound_to_the_layer():
    """The layer checks __launch_bounds__(X) where the kernel body starts with
    FUSEDRES_LAUNCH_BOUNDS(X): every bounded kernel in csrc/cuda must, with the same X."""
    import glob

    base = os.path.join(cuda_aot.ROOT, "csrc", "cuda")
    kernels = 0
    paths = [*glob.glob(f"{base}/*.cu"), *glob.glob(f"{base}/*.cuh"),
             *glob.glob(f"{base}/on_cpu/tests/*.cu")]
    for path in paths:
        text = open(path).read()
        for m in re.finditer(r"__launch_bounds__\(((?:[^()]|\([^()]*\))*)\)[^{;]*\{\s*(\S[^;]*;)",
                             text):
            kernels += 1
            assert m.group(2) == f"FUSEDRES_LAUNCH_BOUNDS({m.group(1)});", (path, m.group(0)[:200])
    assert kernels >= 18  # 13 in the ops (.cu and .cuh), 5 test kernels (on_cpu/tests)


@pytest.mark.parametrize("mode,message", [
    (1, r"every lane must execute the same \.aligned instruction"),
    (2, r"mma\.sync.*names lanes 0x80000000 that have returned"),
], ids=["different-ldmatrix", "exited-lane"])
def test_warp_collectives_need_the_whole_warp(mode, message):
    with pytest.raises(RuntimeError, match=message):
        LT.divergent_collective(mode)


@pytest.mark.skipif(cuda_aot.find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", [80, 90])
def test_nvcc_compiles_the_primitives(arch, tmp_path):
    """mma.cuh's PTX through ptxas: the test kernels alone (no torch headers), to a cubin."""
    nvcc = cuda_aot.find_nvcc()
    src = os.path.join(cuda_aot.ROOT, "csrc", "cuda", "on_cpu", "tests", "mma_kernels.cu")
    out = tmp_path / f"mma_sm{arch}.cubin"
    res = subprocess.run([nvcc, "-std=c++20", "-cubin", f"-arch=sm_{arch}", "-o", str(out), src,
                          "-Xptxas", "-v"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    # The file instantiates every template the host tests launch (15 kernels).
    assert res.stderr.count("Compiling entry function") == 15, res.stderr[-2000:]
    assert "gemm_tile_kernel" in res.stderr and "cp_async_kernel" in res.stderr
    cuobjdump = _triton_tool("cuobjdump")
    if cuobjdump is None:
        return
    sass = subprocess.run([cuobjdump, "-sass", str(out)], capture_output=True, text=True,
                          check=True).stdout
    # The instructions the PTX is for: tensor-core MMA, matrix loads, asynchronous copies.
    for op in ("HMMA.16816.F32 ", "HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDSM.16.MT88.4",
               "LDGSTS.E.BYPASS.128", "LDGSTS.E.64.ZFILL", "LDGDEPBAR", "DEPBAR.LE SB0"):
        assert op in sass, op


def _triton_tool(name):
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.isfile(path) else None


# --------------------------------------------------------------------------- ASan + UBSan


@pytest.fixture(scope="module")
def asan_driver():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for the sanitizer build")
    try:
        return cuda_tsan.build(verbose=False, asan=True)
    except RuntimeError as exc:
        if "asan" in str(exc).lower() and "cannot find" in str(exc).lower():
            pytest.skip(f"libasan/libubsan is not installed: {exc}")
        raise


def test_asan_runs_the_primitives_without_reports(asan_driver):
    res = cuda_tsan.run(["layer_mma_gemm", "layer_dynamic_shared"], asan=True)
    out = res.stdout + res.stderr
    assert cuda_tsan.count_reports(out, asan=True) == 0, out[-6000:]
    assert res.returncode == 0 and len(re.findall(r"^ok ", res.stdout, re.M)) == 2, out[-6000:]


def test_asan_catches_the_planted_out_of_bounds_read(asan_driver):
    """A 16-byte cp.async from an 8-byte tensor: the copy reads 8 bytes past its end."""
    res = cuda_tsan.run(["oob_read"], asan=True)
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in res.stderr, res.stderr[-4000:]
    assert "cp_async" in res.stderr  # the report's stack names the emulated copy
    assert res.returncode == cuda_tsan.ASAN_EXIT
