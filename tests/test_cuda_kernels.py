"""The CUDA C++ kernels (csrc/cuda) through their ``fusedres_cuda`` ops, against float64 PyTorch:
what the generic backend matrix does not reach. On a machine without a GPU the ops run on CPU
tensors through the execution layer (the same kernel source, compiled by the host compiler);
on a GPU, on CUDA tensors. Covered here: the tensor-core (WMMA) paths for float16/bfloat16 and
the mixed autocast pair under the rule "error at most twice PyTorch's own against float64",
float32 without TF32, every ``output_mask`` with and without batch statistics, split-K of the
weight gradient, strides larger than the kernel (stride phases no tap feeds), the native
genstats epilogue, and the int64 index helpers."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedres.backends import portable
from fusedres.ops import _extension, opdefs
from helpers import host_knobs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_KEY = "CUDA" if DEVICE.type == "cuda" else "CPU"
# On CPU the kernels are the test extension's (fusedres._C_cuda_on_cpu), on a GPU fusedres._C's.
_WHY_NOT = _extension.load_cuda_on_cpu() if DEVICE.type == "cpu" else _extension.LOAD_ERROR
pytestmark = pytest.mark.skipif(
    not _extension.has_kernels("fusedres_cuda", _KEY, *opdefs.SCHEMAS),
    reason=f"no {_KEY} kernels of the fusedres_cuda ops ({_WHY_NOT or 'not built'})")

OPS = torch.ops.fusedres_cuda
HALF = (torch.float16, torch.bfloat16)
# The host copy's knobs (csrc/cuda/common.cuh): the SM count its tile and split rules size for,
# and a forced split of the weight gradient's reduction; not in the nvcc copy.
HAS_HOST_KNOBS = DEVICE.type == "cpu" and hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "set_sm_count")


TILE_SMS = {"64": 10**6, "128": 1}  # the SM counts that make either mma.sync tile the rule's
# The knobs that make each mma.sync data-gradient tile the rule's (the wide one: C > 64 only;
# sm_90's, where the 128-row tile is sm_80's).
DGRAD_TILE_KNOBS = {"64": dict(sms=TILE_SMS["64"]), "128": dict(sms=TILE_SMS["128"], major=8),
                    "wide": dict(sms=1, major=9)}
# Relative error bounds (max |err| / max |ref|) against float64 for the full-precision dtypes,
# from measured errors (float32 ~3e-7 with no TF32, float64 ~1e-15).
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

# (n, c, h, w, co, (kh, kw), stride, padding, dilation, bias, residual): sizes that are not
# multiples of any tile; strides larger than the kernel leave stride phases no tap feeds.
CASES = [
    (2, 3, 7, 7, 5, (3, 3), (1, 1), (1, 1), (1, 1), True, True),
    (1, 17, 13, 7, 4, (3, 3), (2, 2), (1, 1), (1, 1), False, False),
    (2, 4, 9, 11, 6, (5, 3), (1, 2), (2, 1), (2, 1), True, False),
    (2, 5, 8, 7, 3, (1, 1), (3, 2), (0, 0), (1, 1), False, True),
    (1, 6, 5, 6, 70, (2, 2), (3, 3), (1, 1), (2, 2), True, True),
]
IDS = [f"c{i}" for i in range(len(CASES))]


def _sdt(dtype):
    return torch.float32 if dtype in HALF else dtype


def make(case, xdt=torch.float32, wdt=None, channels_last=False, seed=0):
    """Inputs of one unit (opdefs.UnitArgs order): x, weight, bias, gamma, beta, mean, invstd,
    residual, conv args, batch_stats."""
    n, c, h, w, co, (kh, kw), s, p, d, has_bias, has_res = case
    wdt = wdt or xdt
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    x = (r(n, c, h, w) * 2 + 0.5).to(DEVICE, xdt).contiguous(memory_format=fmt)
    weight = (r(co, c, kh, kw) / (c * kh * kw) ** 0.5).to(DEVICE, wdt)
    weight = weight.contiguous(memory_format=fmt)
    sdt = _sdt(xdt)
    gamma = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(DEVICE, sdt)
    beta = (r(c) * 0.5).to(DEVICE, sdt)
    mean = (r(c) * 0.3 + 0.5).to(DEVICE, sdt)
    invstd = (torch.rand(c, generator=g, dtype=torch.float64) * 0.5 + 0.3).to(DEVICE, sdt)
    ho = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    wo = (w + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    bias = r(co).to(DEVICE, wdt) if has_bias else None
    res = r(n, co, ho, wo).to(DEVICE, wdt).contiguous(memory_format=fmt) if has_res else None
    return x, weight, bias, gamma, beta, mean, invstd, res, list(s), list(p), list(d), True


def ref_forward(*args):
    """The portable backend's forward (PyTorch ops), the same arguments as the op."""
    return portable.bn_relu_conv2d(*args)


def ref_backward(*args):
    return portable.bn_relu_conv2d_backward(*args)


def as64(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) else a for a in args)


def rel_err(a, b) -> float:
    b = b.double()
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def abs_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------- forward

@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_forward_and_genstats_full_precision(case, dtype, channels_last):
    """float32 (FMA, no TF32) and float64 against float64; genstats' statistics of y."""
    args = make(case, dtype, channels_last=channels_last)
    y = OPS.bn_relu_conv2d(*args)
    y2, mean, var = OPS.bn_relu_conv2d_genstats(*args)
    ref = ref_forward(*as64(args))
    assert y.dtype == dtype and y.shape == ref.shape
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last
                           else torch.contiguous_format)
    assert rel_err(y, ref) <= TOL[dtype]
    assert torch.equal(y, y2)
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    assert mean.dtype == var.dtype == dtype
    assert rel_err(mean, mean64) <= TOL[dtype] and rel_err(var, var64) <= TOL[dtype]


# The tensor-core path (16-bit weights) and the autocast pair (float32 x, 16-bit weights).
HALF_PAIRS = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
              (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
              (torch.bfloat16, torch.float32)]
HALF_IDS = ["f16", "bf16", "f32x-f16w", "f32x-bf16w", "bf16x-f32w"]


def _torch_own(args):
    """PyTorch's own result at the inputs' dtypes (the unfused sequence, portable's ops)."""
    return ref_forward(*args)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=["c0", "c2", "c4"])
@pytest.mark.parametrize("pair", HALF_PAIRS, ids=HALF_IDS)
def test_forward_half_within_twice_torch_error(pair, case, channels_last):
    xdt, wdt = pair
    args = make(case, xdt, wdt, channels_last=channels_last)
    y, mean, var = OPS.bn_relu_conv2d_genstats(*args)
    exact = ref_forward(*as64(args))
    own = _torch_own(args)
    assert y.dtype == wdt
    floor = 1e-3 * exact.abs().max().item()
    assert abs_err(y, exact) <= 2 * abs_err(own, exact) + floor
    # Statistics of y as stored (rounded), reduced in float32.
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    assert mean.dtype == var.dtype == _sdt(wdt)
    assert rel_err(mean, mean64) <= 1e-5 and rel_err(var, var64) <= 1e-5


# The tensor-core forward on mma.sync + ldmatrix + cp.async (16-bit x and weight of one dtype,
# channels-last x, C a multiple of 8): C = 16 (one partial K chunk of 32), 40 (two chunks per
# tap, the second partial), Co = 70 (two column tiles, the packed weight padded to 72); padding
# taps (BatchNorm-ReLU must not reach them), stride, dilation, bias, residual and branch scale.
MMA_CASES = [
    (2, 16, 7, 7, 5, (3, 3), (1, 1), (1, 1), (1, 1), True, True),
    (1, 40, 9, 6, 70, (3, 3), (2, 1), (1, 1), (1, 1), True, True),
    (2, 8, 5, 6, 9, (2, 3), (1, 2), (0, 1), (2, 1), False, False),
]


@pytest.mark.parametrize("case", MMA_CASES, ids=["c16", "c40-co70", "c8-dil"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_forward_mma_path(dtype, case):
    """The mma.sync path (the default for these inputs) within twice PyTorch's own error, its
    genstats statistics those of its y, and the WMMA path (which an NCHW x takes) on the same
    values within the same bound. About 1 s on CPU for the six."""
    args = list(make(case, dtype, channels_last=True))
    n = args[0].shape[0]
    bscale = torch.tensor([1.25, 0.0][:n], dtype=torch.float32, device=DEVICE)
    y, mean, var = OPS.bn_relu_conv2d_genstats(*args, branch_scale=bscale)
    y_wmma = OPS.bn_relu_conv2d_genstats(args[0].contiguous(), *args[1:],
                                         branch_scale=bscale)[0]
    exact = ref_forward(*as64(args), bscale.double())
    own = ref_forward(*args, bscale)
    res = args[7]
    floor = 1e-3 * exact.abs().max().item()
    assert abs_err(y, exact) <= 2 * abs_err(own, exact) + floor
    assert abs_err(y_wmma, exact) <= 2 * abs_err(own, exact) + floor
    if n > 1:
        assert y[1].eq(0 if res is None else res[1]).all()  # the dropped sample: residual only
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    assert rel_err(mean, mean64) <= 1e-5 and rel_err(var, var64) <= 1e-5


# The mma.sync forward's tiles: 64 or 128 rows (the host copy's SM count picks: 64 rows of
# 2 x 2 warps or 4 x 1, 128 of 4 x 1 warps, each warp's A rows its own) by 16, 32 or 64 columns
# (by Co: mma_cols), 16 or 32 deep (by C too: mma_depth). Shapes: M = 2 * 12 * 11 = 264
# rows (three 128-row tiles, the last partial; five 64-row ones), C = 40 (a partial second K
# chunk per tap), Co = 70 (two column tiles, the packed weight padded to 72), Co = 24 (a partial
# 32-column tile), 8 and 9 (16 columns: some threads copy none of the weight's pieces; 9: the
# packed weight padded to 16), C = 8 and 16 under 16 columns (16-deep chunks); 3 x 3 with
# padding at stride 1 and 2, 1 x 1 at stride 2, a dilated 2 x 3 kernel.
TILE_CASES = [
    (2, 40, 12, 11, 70, (3, 3), (1, 1), (1, 1), (1, 1), True, True),
    (3, 16, 15, 13, 24, (3, 3), (2, 2), (1, 1), (1, 1), False, True),
    (2, 24, 21, 17, 8, (1, 1), (2, 2), (0, 0), (1, 1), True, False),
    (1, 8, 13, 14, 9, (2, 3), (1, 2), (0, 1), (2, 1), False, False),
    (2, 16, 12, 11, 16, (3, 3), (1, 1), (1, 1), (1, 1), True, True),
]


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the tile hooks are built with the host copy")
@pytest.mark.parametrize("case", TILE_CASES,
                         ids=["c40-co70", "s2", "1x1-s2", "dil", "c16-co16"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_forward_mma_tiles(dtype, case):
    """Both mma.sync forward tile heights at the columns and depth Co and C take (the hooks say
    which runs) within twice PyTorch's own error against float64, genstats from the y each
    stores, and equal to each other bit for bit: every output element runs the same m16n8k16
    steps in the same order in either tile."""
    c, co = case[1], case[4]
    cols = 16 if co <= 16 else 32 if co <= 32 else 64
    assert torch.ops.fusedres_cuda_testing.mma_cols(co) == cols
    assert torch.ops.fusedres_cuda_testing.mma_depth(co, c) == (
        16 if cols == 16 and c <= 16 else 32)
    args = list(make(case, dtype, channels_last=True))
    n = args[0].shape[0]
    bscale = torch.tensor([1.25, 0.0, 0.5][:n], dtype=torch.float32, device=DEVICE)
    exact = ref_forward(*as64(args), bscale.double())
    own = ref_forward(*args, bscale)
    floor = 1e-3 * exact.abs().max().item()
    m_rows = exact.shape[0] * exact.shape[2] * exact.shape[3]
    out = {}
    for tile in ("64", "128"):
        with host_knobs(sms=TILE_SMS[tile]):
            assert torch.ops.fusedres_cuda_testing.forward_mma_rows(m_rows, case[4]) == int(tile)
            y, mean, var = OPS.bn_relu_conv2d_genstats(*args, branch_scale=bscale)
        assert abs_err(y, exact) <= 2 * abs_err(own, exact) + floor, tile
        var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
        assert rel_err(mean, mean64) <= 1e-5 and rel_err(var, var64) <= 1e-5, tile
        out[tile] = y
    assert torch.equal(out["64"], out["128"])


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the tile hooks are built with the host copy")
def test_forward_mma_tile_choice():
    """forward_mma_rows: the 128-row tile where its tiles fill every SM once (the host copy
    counts 132 SMs unless a test sets another count), else the 64-row one."""
    rows = torch.ops.fusedres_cuda_testing.forward_mma_rows
    assert rows(128 * 132, 64) == 128 and rows(128 * 132 - 128, 64) == 64
    assert rows(128 * 66, 65) == 128 and rows(128 * 66, 64) == 64
    assert rows(100, 8) == 64
    with host_knobs(sms=1):
        assert rows(100, 8) == 128
    assert rows(100, 8) == 64
    # A thin tile's columns hold Co (at most 32): as many column tiles as a 64-wide one.
    assert rows(128 * 132, 16) == 128 and rows(128 * 131, 32) == 64
    cols = torch.ops.fusedres_cuda_testing.mma_cols
    assert [cols(co) for co in (8, 16, 24, 32, 40, 64, 512)] == [16, 16, 32, 32, 64, 64, 64]
    # 16 deep where the tile is 16 columns and C <= 16 (a 32-deep chunk: half zeros), else 32.
    depth = torch.ops.fusedres_cuda_testing.mma_depth
    assert [depth(co, c) for c, co in ((16, 16), (8, 8), (24, 16), (16, 24), (16, 64))] == [
        16, 16, 32, 32, 32]
    with pytest.raises(RuntimeError, match="set_sm_count: expected a positive count"):
        torch.ops.fusedres_cuda_testing.set_sm_count(0)


def test_forward_mma_weight_view_off_16_bytes():
    """A weight whose (kh, kw, C, Co) permutation is a contiguous view two bytes into its
    storage: the packed copy must not be that view (16-byte cp.async sources)."""
    case = (1, 16, 6, 5, 8, (3, 3), (1, 1), (1, 1), (1, 1), False, False)
    args = list(make(case, torch.float16, channels_last=True))
    w = args[1]
    flat = torch.zeros(w.numel() + 1, dtype=w.dtype, device=DEVICE)
    base = flat[1:].view(3, 3, 16, 8)
    base.copy_(w.permute(2, 3, 1, 0))
    args[1] = base.permute(3, 2, 0, 1)
    assert torch.equal(args[1], w) and args[1].data_ptr() % 16 != 0
    y = OPS.bn_relu_conv2d(*args)
    args[1] = w
    assert torch.equal(y, OPS.bn_relu_conv2d(*args))


# --------------------------------------------------------------------------- backward

MASKS = list(itertools.product([False, True], repeat=5))


@pytest.mark.parametrize("batch_stats", [True, False], ids=["train", "eval"])
def test_backward_every_output_mask(batch_stats):
    """All 32 output_mask combinations (both backward strategies: "sums" where the weight
    gradient runs and the BatchNorm sums are wanted, "store" otherwise): the metadata of
    opdefs.backward_outputs, and every requested gradient equal to the float64 reference."""
    args = make(CASES[1], torch.float64, channels_last=False)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn_like(ref_forward(*args))
    for mask in MASKS:
        got = OPS.bn_relu_conv2d_backward(gy, x, weight, gamma, beta, mean, invstd, s, p, d,
                                          batch_stats, list(mask))
        ref = ref_backward(gy, x, weight, gamma, beta, mean, invstd, s, p, d, batch_stats,
                           list(mask))
        expect = opdefs.backward_outputs(x, weight, mean, mask)
        for i, (g, r, e) in enumerate(zip(got, ref, expect)):
            assert (g.shape, g.dtype, g.stride()) == (e.shape, e.dtype, e.stride()), (mask, i)
            if mask[i]:
                assert rel_err(g, r) <= TOL[torch.float64], (mask, i)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_backward_full_precision(case, dtype, channels_last):
    """Both BatchNorm modes (sums strategy, the default)."""
    args = make(case, dtype, channels_last=channels_last)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    for batch_stats in (True, False):
        got = OPS.bn_relu_conv2d_backward(gy, x, weight, gamma, beta, mean, invstd, s, p, d,
                                          batch_stats, [True] * 5)
        ref = ref_backward(*as64((gy, x, weight, gamma, beta, mean, invstd)), s, p, d,
                           batch_stats, [True] * 5)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g.dtype == (dtype if i < 3 else _sdt(dtype))
            assert rel_err(g, r) <= TOL[dtype], (batch_stats, i)
        assert got[0].stride() == x.stride() and got[1].stride() == weight.stride()


@pytest.mark.parametrize("mask", [[True] * 5, [True, False, False, True, True]],
                         ids=["sums", "store"])
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=["c0", "c4"])
@pytest.mark.parametrize("pair", HALF_PAIRS, ids=HALF_IDS)
def test_backward_half_within_twice_torch_error(pair, case, mask):
    """Either strategy (the mask without the weight gradient runs "store")."""
    xdt, wdt = pair
    args = make(case, xdt, wdt, channels_last=True)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, wdt)
    bargs = (gy, x, weight, gamma, beta, mean, invstd, s, p, d, True, mask)
    got = OPS.bn_relu_conv2d_backward(*bargs)
    own = ref_backward(*bargs)
    exact = ref_backward(*as64(bargs[:7]), s, p, d, True, mask)
    for i, (g, o, e) in enumerate(zip(got, own, exact)):
        if not mask[i]:
            continue
        assert g.dtype == o.dtype
        floor = 1e-3 * e.abs().max().item()
        assert abs_err(g, e) <= 2 * abs_err(o, e) + floor, i


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the split hook is built with the host copy")
@pytest.mark.parametrize("split", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_weight_gradient_split_k(split, dtype):
    """The weight-gradient reduction split over blockIdx.z (partials summed after) gives the
    same gradients for any split count (more than the K-steps is clamped)."""
    case = (2, 6, 12, 10, 9, (3, 3), (1, 1), (1, 1), (1, 1), True, False)
    args = make(case, dtype, channels_last=False)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    mask = [False, True, True, False, False]
    with host_knobs(split=split):
        got = OPS.bn_relu_conv2d_backward(gy, x, weight, gamma, beta, mean, invstd, s, p, d,
                                          True, mask)
    exact = ref_backward(*as64((gy, x, weight, gamma, beta, mean, invstd)), s, p, d, True,
                         mask)
    tol = TOL[dtype] if dtype in TOL else 1e-2
    assert rel_err(got[1], exact[1]) <= tol and rel_err(got[2], exact[2]) <= tol


HAS_SPLIT_HOOK = hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "wgrad_split")


@pytest.mark.skipif(not HAS_SPLIT_HOOK, reason="the split hook is built with the host copy")
def test_weight_gradient_split_rule():
    """pick_split (csrc/cuda, through the host copy's hook) and kernels/traffic.cuda_pick_split
    (the performance model's copy) choose the same split for every tile size the kernels use,
    over a grid of shapes on an A100's 108 and an H100's 132 SMs. The split keeps the partials
    within half the operands' bytes, fills the SMs within two resident blocks an SM where that
    cap allows, never leaves an empty split, and leaves a reduction of 4 K-steps whole; the
    host copy's forced split overrides it (clamped to the K-steps)."""
    from fusedres.kernels import traffic

    split = torch.ops.fusedres_cuda_testing.wgrad_split
    seen = set()
    for (bm, bn, bk), elem, acc in (((64, 64, 32), 2, 4), ((64, 64, 16), 4, 4),
                                    ((32, 32, 16), 8, 8)):
        for co, c, taps, m, sms, fold in itertools.product(
                (8, 16, 64, 200, 512), (16, 64, 256), (1, 9), (128, 8192, 131072, 401408),
                (108, 132), (False, True)):
            tiles = -(-co // bm) * (-(-taps * c // bn) if fold else -(-c // bn) * taps)
            ops = m * (c + co) * elem
            got = split(tiles, co, c, taps, m, bk, sms, ops, acc)
            assert got == traffic.cuda_pick_split(tiles, co, c, taps, m, bk, sms, ops, acc), (
                co, c, taps, m, bm, sms, fold)
            # The partials (written and read) within half the operands' bytes.
            assert got == 1 or 4 * got * co * c * taps * acc <= ops
            k_steps = -(-m // bk)
            per = -(-k_steps // got)
            assert 1 <= got <= k_steps and (got - 1) * per < k_steps  # no empty split
            seen.add(got)
    assert len(seen) > 20  # the grid exercises the rule, not one constant
    # ImageNet 64@56 at batch 256 (401408 pixels, 9 blocks): one wave of two blocks an SM,
    # none left over (the rule it replaced: 270 blocks for 264 slots); ImageNet 256@14 (144
    # blocks, which the rule it replaced left unsplit on 132 SMs) split; 4 K-steps stay whole.
    got = split(9, 64, 64, 9, 401408, 32, 132, 401408 * 128 * 2, 4)
    assert 132 < 9 * got <= 2 * 132
    assert split(144, 256, 256, 9, 50176, 32, 132, 50176 * 512 * 2, 4) > 1
    assert split(3, 16, 16, 9, 128, 32, 132, 128 * 32 * 2, 4) == 1
    if HAS_HOST_KNOBS:
        with host_knobs(split=7):
            assert split(9, 64, 64, 9, 8192, 32, 132, 8192 * 128 * 2, 4) == 7
        with host_knobs(split=100000):
            assert split(9, 64, 64, 9, 8192, 32, 132, 8192 * 128 * 2, 4) == 256
        with pytest.raises(RuntimeError, match="set_wgrad_split: expected 0 or more"):
            torch.ops.fusedres_cuda_testing.set_wgrad_split(-1)


HAS_AFFINE_HOOK = hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "bn_affine")


@pytest.mark.skipif(not HAS_AFFINE_HOOK, reason="the affine hook is built with the host copy")
@pytest.mark.parametrize("sdt,half", [(torch.float32, None), (torch.float32, torch.float16),
                                      (torch.float32, torch.bfloat16), (torch.float64, None)],
                         ids=["f32", "f32-f16", "f32-bf16", "f64"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_bn_affine_is_the_aten_rule_bit_for_bit(sdt, half, affine):
    """The native ops' one-launch BatchNorm affine (conv_tiles.cuh) computes what the three ATen
    ops it replaced computed, bit for bit: scale = bn_weight * invstd, shift = bn_bias - mean *
    scale (-mean * scale without bias), each rounded on its own (a contracted FMA differs in the
    last place on a few of 4,099 random channels); vectors read at their strides. With ``half``,
    each block of the CUTLASS forward's prologue (block_affine16, which cannot run here inside
    CUTLASS's kernel: the same device function in a launch of its own) writes both rounded as
    Tensor.to, to its own row, whatever its block size."""
    g = torch.Generator().manual_seed(3)
    c = 4099  # more than one block, and past a grid-stride step

    def vec(scale=1.0):
        return (torch.randn(2 * c, generator=g, dtype=torch.float64) * scale).to(sdt)[::2]

    mean, invstd = vec(40.0), vec().abs() + 0.1
    w, b = (vec(), vec()) if affine else (None, None)
    scale = w * invstd if affine else invstd
    shift = b - mean * scale if affine else -mean * scale
    for blocks, threads in ([(1, 64)] if half is None else [(1, 64), (3, 256), (2, 96)]):
        got = torch.ops.fusedres_cuda_testing.bn_affine(w, b, mean, invstd, half, blocks,
                                                        threads)
        want = [scale, shift]
        if half is not None:
            want += [scale.to(half).expand(blocks, c), shift.to(half).expand(blocks, c)]
        assert len(got) == len(want)
        for gv, wv in zip(got, want):
            assert gv.dtype == wv.dtype and torch.equal(gv, wv), (blocks, threads)
        assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.skipif(not HAS_AFFINE_HOOK, reason="the affine hook is built with the host copy")
def test_bn_affine_refuses_a_float64_affine_in_16_bits():
    one = torch.ones(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="16-bit copies of a Double affine"):
        torch.ops.fusedres_cuda_testing.bn_affine(None, None, one, one, torch.float16)


@pytest.mark.skipif(not HAS_AFFINE_HOOK, reason="the partials hook is built with the host copy")
@pytest.mark.parametrize("split", [1, 3, 8, 9, 21])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("co", [5, 40], ids=["co5", "co40"])
def test_wgrad_partials_sum_adds_in_a_fixed_order(split, dtype, channels_last, co):
    """The launch both weight gradients end with (the native split reduction, CUTLASS's parallel
    split-K): the (split, Co, kh, kw, C) partials added in the order the split alone fixes (slice
    k into group k % 8 in slice order, then the 8 groups in order), rounded once to the weight's
    dtype and written in its layout (strides kept), bit for bit as those loops in ATen; dW of 180
    elements (a part-filled block of 32) and of 1,440 (45 blocks)."""
    g = torch.Generator().manual_seed(split)
    c, kh, kw = 6, 3, 2
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    parts = torch.randn(split, co, kh, kw, c, generator=g, dtype=acc) * 100
    weight = torch.empty(co, c, kh, kw, dtype=dtype)
    if channels_last:
        weight = weight.to(memory_format=torch.channels_last)
    got = torch.ops.fusedres_cuda_testing.wgrad_partials_sum(parts, weight)
    groups = []
    for first in range(min(split, 8)):
        s = parts[first].clone()
        for k in range(first + 8, split, 8):
            s += parts[k]
        groups.append(s)
    total = groups[0]
    for s in groups[1:]:
        total += s
    want = total.permute(0, 3, 1, 2).to(dtype)
    assert got.stride() == weight.stride() and torch.equal(got, want)
    # fewer blocks than 32-element column blocks: each loops over several (past 2^21 elements
    # CUDA's grid limit makes it so), reusing its shared sums between them
    for blocks in (1, 2, 7):
        assert torch.equal(torch.ops.fusedres_cuda_testing.wgrad_partials_sum(
            parts, weight, blocks), want), blocks
    if split >= 9:  # the order is not slice order: the values tell them apart
        serial = parts[0].clone()
        for k in range(1, split):
            serial += parts[k]
        assert not torch.equal(serial, total)
    with pytest.raises(RuntimeError, match="parts must be contiguous"):
        torch.ops.fusedres_cuda_testing.wgrad_partials_sum(parts.transpose(2, 3), weight)


HAS_DX_HOOK = hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "dx_with_partials")


@pytest.mark.skipif(not (HAS_DX_HOOK and HAS_HOST_KNOBS),
                    reason="the dx hook is built with the host copy")
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("co", [5, 700], ids=["co5", "co700"])
def test_dx_launch_sums_the_weight_gradient_partials(co, channels_last, dtype, split):
    """The dx launch of the CUTLASS weight gradient's route: its first blocks write dx as the dx
    pass alone does (and as the rule gives it, within one rounding), the blocks past them the
    weight gradient summed from the partials as the partials' own launch does (every element,
    bit for bit), from a weight small or large against the dx blocks' share of the grid; on a
    GPU of 1 SM (8 dx blocks), so that each dx thread strides over several elements. 16-bit
    only (the CUTLASS route's dtypes): a float32 call with partials is refused."""
    t = torch.ops.fusedres_cuda_testing
    case = (4, 16, 9, 8, co, (3, 2), (1, 1), (1, 1), (1, 1), False, False)  # 4,608 elements
    x, weight, _, gamma, beta, mean, invstd, *_ = make(case, dtype, channels_last=channels_last)
    g = torch.Generator().manual_seed(split)
    dz = torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    dz = dz.contiguous(memory_format=torch.channels_last if channels_last else
                       torch.contiguous_format)
    m1, m2 = (torch.randn(x.shape[1], generator=g).to(DEVICE, mean.dtype) for _ in range(2))
    parts = torch.randn(split, co, 3, 2, x.shape[1], generator=g).to(DEVICE) * 100
    if dtype not in HALF:
        with pytest.raises(RuntimeError, match="16-bit weight gradients only"):
            t.dx_with_partials(dz, x, gamma, beta, mean, invstd, m1, m2, parts, weight)
        return
    with host_knobs(sms=1):
        dx, gw = t.dx_with_partials(dz, x, gamma, beta, mean, invstd, m1, m2, parts, weight)
        dx0, gw0 = t.dx_with_partials(dz, x, gamma, beta, mean, invstd, m1, m2, None, weight)
    assert torch.equal(dx, dx0) and dx.stride() == dz.stride()
    v = lambda u: u.view(1, -1, 1, 1)  # noqa: E731
    xhat = (x.float() - v(mean)) * v(invstd)
    want = (v(gamma * invstd) * (dz.float() - v(m1) - xhat * v(m2))).to(dtype)
    eps = torch.finfo(dtype).eps
    assert ((dx.double() - want.double()).abs() <= eps * want.double().abs() + 1e-5).all()
    assert gw0.isnan().all()  # without partials the launch leaves the weight's gradient alone
    assert gw.stride() == weight.stride() and torch.equal(gw, t.wgrad_partials_sum(parts, weight))


@pytest.mark.skipif(not HAS_AFFINE_HOOK, reason="the sums hook is built with the host copy")
@pytest.mark.parametrize("rows,c", [(1, 3), (2048, 70), (2049, 5), (40000, 64)])
@pytest.mark.parametrize("pdt,sdt", [(torch.float32, torch.float32),
                                     (torch.float64, torch.float64)], ids=["f32", "f64"])
def test_bn_sums_reduce_the_partials_in_float64(rows, c, pdt, sdt):
    """The BatchNorm sums' one-launch reduction (two past 2,048 rows: sliced over blockIdx.y,
    the slices merged in order) gives dbeta, dgamma and dx's terms as float64 sums of the
    partials rounded to the statistics dtype, the same bits on every call."""
    g = torch.Generator().manual_seed(rows)
    pdz = torch.randn(rows, c, generator=g, dtype=torch.float64).to(pdt)
    pdzx = (torch.randn(rows, c, generator=g, dtype=torch.float64) * 1e3).to(pdt)
    inv_m = 1.0 / 12345.0
    got = torch.ops.fusedres_cuda_testing.bn_sums(pdz, pdzx, inv_m, sdt)
    s_dz, s_dzx = pdz.double().sum(0), pdzx.double().sum(0)
    want = [s_dz, s_dzx, s_dz * inv_m, s_dzx * inv_m]
    tol = 1e-6 if sdt == torch.float32 else 1e-12
    for gv, wv in zip(got, want):
        assert gv.dtype == sdt
        torch.testing.assert_close(gv, wv.to(sdt), rtol=tol, atol=tol * wv.abs().max().item())
    again = torch.ops.fusedres_cuda_testing.bn_sums(pdz, pdzx, inv_m, sdt)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


# (case, grad_out channels-last): inputs the mma.sync weight gradient takes (16-bit, x and
# grad_out channels-last, C and Co multiples of 8): 3x3 padded (padding taps at every border),
# strided, 1x1, a Co past one 64-row tile and a C past one 64-column tile (partial tiles).
WGRAD_MMA_CASES = [
    (2, 16, 7, 7, 24, (3, 3), (1, 1), (1, 1), (1, 1), True, False),
    (1, 40, 9, 6, 72, (3, 3), (2, 1), (1, 1), (1, 1), True, False),
    (2, 8, 5, 6, 16, (1, 1), (2, 2), (0, 0), (1, 1), False, False),
    (1, 72, 5, 5, 8, (3, 3), (1, 1), (2, 2), (2, 2), False, False),
]
HAS_HOOK = hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "wgrad_kernel_for")


def _wgrad_kernel_for(gy, x, weight):
    return torch.ops.fusedres_cuda_testing.wgrad_kernel_for(gy, x, weight)


def _dgrad_kernel_for(gy, x, weight):
    return torch.ops.fusedres_cuda_testing.dgrad_kernel_for(gy, x, weight)


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the hooks are built with the host copy")
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("case", WGRAD_MMA_CASES, ids=["c16", "c40-co72-s2", "c8-1x1", "c72-dil"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_backward_mma_path(dtype, case, split):
    """The mma.sync weight and data gradients (the default for these inputs: the hooks say
    which kernels run) in both strategies (store: no weight gradient asked for) and both
    BatchNorm modes, with a branch scale (one sample dropped) and without, split-K on and off:
    every gradient within twice PyTorch's own error against float64, and equal to the WMMA
    kernels' (which an NCHW grad_out takes) up to float32 summation order (and the roundings
    that follow)."""
    args = make(case, dtype, channels_last=True)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    gy = gy.contiguous(memory_format=torch.channels_last)
    gy_nchw = gy.contiguous()
    assert _wgrad_kernel_for(gy, x, weight) == "mma"
    assert _dgrad_kernel_for(gy, x, weight) == "mma"
    assert _wgrad_kernel_for(gy_nchw, x, weight) == _dgrad_kernel_for(gy_nchw, x, weight) == "wmma"
    n = x.shape[0]
    store = [True, False, False, True, True]
    for bscale in (None, torch.tensor([1.25, 0.0][:n], dtype=torch.float32, device=DEVICE)):
        for strategy, batch_stats, mask in (("sums", True, [True] * 5),
                                            ("sums", False, [True] * 5), ("store", True, store)):
            bargs = (gy, x, weight, gamma, beta, mean, invstd, s, p, d, batch_stats, mask)
            with host_knobs(split=split):
                got = OPS.bn_relu_conv2d_backward(*bargs, branch_scale=bscale)
                wmma = OPS.bn_relu_conv2d_backward(gy_nchw, *bargs[1:], branch_scale=bscale)
            own = ref_backward(*bargs, bscale)
            exact = ref_backward(*as64(bargs[:7]), s, p, d, batch_stats, mask,
                                 None if bscale is None else bscale.double())
            what = (strategy, batch_stats, bscale is not None)
            for i, (g, w, o, e) in enumerate(zip(got, wmma, own, exact)):
                if not mask[i]:
                    continue
                assert g.dtype == o.dtype and g.stride() == w.stride(), (what, i)
                floor = 1e-3 * e.abs().max().item()
                assert abs_err(g, e) <= 2 * abs_err(o, e) + floor, (what, i)
                # 16-bit outputs (grad_x, grad_weight) to a rounding, the float32 ones closer.
                assert rel_err(g, w) <= (1e-2 if i < 2 else 1e-5), (what, i)


# The mma.sync data gradient's tiles: 64 or 128 rows (the host copy's SM count picks: 64 rows
# of 2 x 2 warps or 4 x 1, 128 of 4 x 1 warps, its epilogue in two 64-row passes, each its own
# partials' row) by 16, 32 or 64 columns (by C: mma_cols), 16 or 32 deep (by Co too:
# mma_depth). Largest stride phase:
# 2 * 11 * 12 = 264 rows (stride 1; three 128-row tiles, the last partial), 3 * 8 * 7 = 168
# (stride 2, 3 x 3: phases fed by 4, 2 and 1 taps), 2 * 11 * 9 = 198 (1 x 1 at stride 2: three
# phases no tap feeds); C = 72 and 40 (a partial 64-column tile), 16 and 8 (16 columns: some
# threads copy none of the weight's pieces), 24 (a partial 32-column tile), Co = 40 (a partial
# 32-deep K chunk), Co = 16 and 8 under 16 columns (16-deep chunks, the second partial), a
# dilated 2 x 3 kernel.
DGRAD_TILE_CASES = [
    (2, 72, 11, 12, 40, (3, 3), (1, 1), (1, 1), (1, 1), False, False),
    (3, 16, 15, 13, 24, (3, 3), (2, 2), (1, 1), (1, 1), False, False),
    (2, 40, 21, 17, 8, (1, 1), (2, 2), (0, 0), (1, 1), False, False),
    (1, 8, 13, 14, 16, (2, 3), (1, 1), (0, 1), (2, 1), False, False),
    (2, 24, 11, 12, 40, (3, 3), (1, 1), (1, 1), (1, 1), False, False),
    (2, 16, 9, 10, 8, (3, 3), (1, 1), (1, 1), (1, 1), False, False),
]


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the tile hooks are built with the host copy")
@pytest.mark.parametrize("case", DGRAD_TILE_CASES,
                         ids=["c72-co40", "s2", "1x1-s2", "dil", "c24-co40", "c16-co8"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_backward_mma_dgrad_tiles(dtype, case):
    """Both mma.sync data-gradient tile heights at the columns C takes (the 64-row one on
    sm_90, with paired taps where C and Co are at most 16; the 128-row one on sm_80, one tap a
    chunk), and for C > 64 the wide 128 x 128 tile (the hooks say which runs), in both
    strategies (sums:
    grad_x from the weight gradient's sums; store, no weight gradient asked for: dz and the
    sums from the data gradient's partials), with a branch scale: every gradient within twice
    PyTorch's own error against float64, and grad_x of the two tiles equal bit for bit in the
    sums strategy (the same m16n8k16 steps in the same order per element), to float32
    summation order in the store strategy (the partials' rows differ)."""
    args = make(case, dtype, channels_last=True)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    gy = gy.contiguous(memory_format=torch.channels_last)
    assert _dgrad_kernel_for(gy, x, weight) == "mma"
    c, co = case[1], case[4]
    cols = 16 if c <= 16 else 32 if c <= 32 else 64
    assert torch.ops.fusedres_cuda_testing.mma_cols(c) == cols
    assert torch.ops.fusedres_cuda_testing.mma_depth(c, co) == (
        16 if cols == 16 and co <= 16 else 32)
    n = x.shape[0]
    phases = min(s[0], x.shape[2]) * min(s[1], x.shape[3])
    rows = n * -(-x.shape[2] // s[0]) * -(-x.shape[3] // s[1])
    bscale = torch.tensor([1.25, 0.0, 0.5][:n], dtype=torch.float32, device=DEVICE)
    for strategy, mask in (("sums", [True] * 5), ("store", [True, False, False, True, True])):
        bargs = (gy, x, weight, gamma, beta, mean, invstd, s, p, d, True, mask)
        own = ref_backward(*bargs, bscale)
        exact = ref_backward(*as64(bargs[:7]), s, p, d, True, mask, bscale.double())
        got = {}
        # (rows, columns) of each tile and the knobs that make it the rule's: the wide tile
        # (128 x 128) is sm_90's, for C > 64.
        plans = {"64": ((64, cols), DGRAD_TILE_KNOBS["64"]),
                 "128": ((128, cols), DGRAD_TILE_KNOBS["128"])}
        if c > 64:
            plans["wide"] = ((128, 128), DGRAD_TILE_KNOBS["wide"])
        for tile, (shape, knobs) in plans.items():
            with host_knobs(**knobs):
                testing = torch.ops.fusedres_cuda_testing
                assert (testing.dgrad_mma_rows(rows, c, phases),
                        testing.dgrad_mma_cols(rows, c, phases)) == shape
                got[tile] = OPS.bn_relu_conv2d_backward(*bargs, branch_scale=bscale)
            for i, (g, o, e) in enumerate(zip(got[tile], own, exact)):
                if not mask[i]:
                    continue
                floor = 1e-3 * e.abs().max().item()
                assert abs_err(g, e) <= 2 * abs_err(o, e) + floor, (strategy, tile, i)
        for tile in plans.keys() - {"64"}:
            if strategy == "sums":
                assert torch.equal(got["64"][0], got[tile][0]), tile
            else:
                for i, (a, b) in enumerate(zip(got["64"], got[tile])):
                    if mask[i]:
                        assert rel_err(a, b) <= (1e-2 if i < 2 else 1e-5), (tile, i)


# C and Co at most 16 with more than one tap: the paired-tap data gradient (two taps' 16 output
# channels a 32-deep K chunk). Stride 2 gives phases of 4, 2, 2 and 1 taps (a last chunk of
# one tap), the dilated 2 x 3 one 6 taps, Co = 8 half of each tap's channels zero-filled.
PAIRED_CASES = [
    (3, 16, 15, 13, 16, (3, 3), (2, 2), (1, 1), (1, 1), False, False),
    DGRAD_TILE_CASES[3],
    DGRAD_TILE_CASES[5],
]


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the tile hooks are built with the host copy")
@pytest.mark.parametrize("case", PAIRED_CASES, ids=["c16-co16-s2", "dil", "c16-co8"])
@pytest.mark.parametrize("tile", ["64", "128"])
def test_backward_mma_dgrad_paired_taps(case, tile):
    """The paired-tap data gradient gives the one-tap kernel's results bit for bit (each
    element's sum: the same m16n8k16 steps in the same order), every gradient, in both
    strategies, on both tile heights; the rule pairs on sm_90 where C and Co are at most 16 and
    the filter has more than one tap."""
    testing = torch.ops.fusedres_cuda_testing
    c, co = case[1], case[4]
    k = testing.dgrad_phase_taps(list(case[5]), list(case[6]), list(case[7]), list(case[8]),
                                 case[2], case[3])
    assert k > 1
    assert testing.dgrad_mma_taps(c, co, k) == 2  # on sm_90, the host copy's default
    assert testing.dgrad_mma_taps(c, co, 1) == 1 and testing.dgrad_mma_taps(24, co, k) == 1
    assert testing.dgrad_mma_taps(c, 24, k) == 1
    with host_knobs(major=8):
        assert testing.dgrad_mma_taps(c, co, k) == 1
    dtype = torch.float16
    args = make(case, dtype, channels_last=True)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    gy = gy.contiguous(memory_format=torch.channels_last)
    for mask in ([True] * 5, [True, False, False, True, True]):
        bargs = (gy, x, weight, gamma, beta, mean, invstd, s, p, d, True, mask)
        got = {}
        for taps in (0, 1):
            old = testing.set_dgrad_taps(taps)
            try:
                with host_knobs(sms=TILE_SMS[tile], major=9):
                    assert testing.dgrad_mma_taps(c, co, k) == 2 - taps
                    got[taps] = OPS.bn_relu_conv2d_backward(*bargs)
            finally:
                testing.set_dgrad_taps(old)
        for i, (a, b) in enumerate(zip(got[0], got[1])):
            if mask[i]:
                assert torch.equal(a, b), (mask, i)


@pytest.mark.skipif(not HAS_HOOK, reason="the kernel-choice hook is built with the host copy")
@pytest.mark.parametrize("case", [DGRAD_TILE_CASES[i] for i in (0, 1, 3)],
                         ids=["c72-co40", "s2", "dil"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_backward_mma_dgrad_reads_a_channels_last_weight_in_place(dtype, case):
    """The mma.sync data gradient reads a channels-last weight (KRSC: what a channels-last
    model holds) in place and packs any other to (kh*kw*Co, C): the same values in the same
    order, so every gradient is equal bit for bit, in both strategies, whatever the weight's
    layout (grad_weight in its weight's)."""
    args = make(case, dtype, channels_last=True)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    gy = gy.contiguous(memory_format=torch.channels_last)
    w_cl = weight.contiguous(memory_format=torch.channels_last)
    w_nchw = weight.contiguous()
    assert not w_nchw.is_contiguous(memory_format=torch.channels_last)
    assert _dgrad_kernel_for(gy, x, w_cl) == _dgrad_kernel_for(gy, x, w_nchw) == "mma"
    for mask in ([True] * 5, [True, False, False, True, True]):
        got = [OPS.bn_relu_conv2d_backward(gy, x, w, gamma, beta, mean, invstd, s, p, d, True,
                                           mask) for w in (w_nchw, w_cl)]
        for i, (a, b) in enumerate(zip(*got)):
            assert torch.equal(a, b), (mask, i)
        if mask[1]:
            assert got[1][1].is_contiguous(memory_format=torch.channels_last)


HAS_ACT_HOOK = hasattr(torch.ops, "fusedres_cuda_testing") and hasattr(
    torch.ops.fusedres_cuda_testing, "dgrad_with_activation")


@pytest.mark.skipif(not HAS_ACT_HOOK, reason="the activation hook is built with the host copy")
@pytest.mark.parametrize("dtype,cl,case,tile", [
    *[(dt, True, c, t) for dt in HALF for c in DGRAD_TILE_CASES[:4] for t in ("64", "128")],
    *[(dt, True, DGRAD_TILE_CASES[0], "wide") for dt in HALF],
    *[(dt, cl, c, t) for dt, cl, c in ((torch.float16, False, DGRAD_TILE_CASES[1]),
                                       (torch.float32, True, CASES[1]),
                                       (torch.float32, False, CASES[3])) for t in ("64", "128")]],
    ids=[*[f"{d}-{c}-{t}" for d in ("f16", "bf16") for c in ("c72-co40", "s2", "1x1-s2", "dil")
           for t in ("64", "128")], "f16-c72-co40-wide", "bf16-c72-co40-wide",
         *[f"{c}-{t}" for c in ("f16-nchw-s2", "f32-s2", "f32-nchw-1x1-s3x2")
           for t in ("64", "128")]])
def test_data_gradient_writes_the_activation(dtype, cl, case, tile):
    """The data gradient's epilogue writes a = relu(scale * x + shift) where the CUTLASS
    weight gradient asks for it (the mma.sync kernel's three tiles, the WMMA one for NCHW, the
    FMA one for float32; strides whose phases no tap feeds): every element written (the buffer
    starts as NaN), each a rounding of the float32 rule (the forward's operand), and dz and the
    BatchNorm sums' partials bit for bit those of the same launch without it."""
    args = make(case, dtype, channels_last=cl)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = args
    gy = torch.randn(ref_forward(*args).shape, dtype=torch.float64).to(DEVICE, dtype)
    gy = gy.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    kernel = "mma" if cl and dtype in HALF else "wmma"
    assert _dgrad_kernel_for(gy, x, weight) == kernel
    hook = torch.ops.fusedres_cuda_testing.dgrad_with_activation
    with host_knobs(**DGRAD_TILE_KNOBS[tile]):
        if tile == "wide":
            n = x.shape[0] * x.shape[2] * x.shape[3]
            assert torch.ops.fusedres_cuda_testing.dgrad_mma_cols(n, case[1], 1) == 128
        dz, pdz, pdzx, act = hook(gy, x, weight, gamma, beta, mean, invstd, s, p, d, True)
        dz0, pdz0, pdzx0, none = hook(gy, x, weight, gamma, beta, mean, invstd, s, p, d, False)
    assert none.numel() == 0
    assert torch.equal(dz, dz0) and torch.equal(pdz, pdz0) and torch.equal(pdzx, pdzx0)
    assert act.dtype == x.dtype and act.stride() == x.stride()
    assert not act.isnan().any(), "an element of a the epilogue did not write"
    sdt = torch.float32 if dtype in HALF else dtype
    scale = (gamma * invstd).to(sdt)
    shift = (beta - mean * scale).to(sdt)
    ref = torch.relu(x.to(sdt) * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)).to(dtype)
    # One rounding to x's dtype of the float32 rule (a fused multiply-add may round the product
    # once less than the reference's two operations).
    eps = torch.finfo(dtype).eps
    assert ((act.double() - ref.double()).abs()
            <= eps * ref.double().abs() + 1e-6 * shift.abs().max().item()).all()
    assert (act == ref).double().mean().item() > 0.99


@pytest.mark.skipif(not HAS_ACT_HOOK, reason="the activation hook is built with the host copy")
@pytest.mark.parametrize("affine", [(False, False), (True, False), (False, True)],
                         ids=["none", "weight", "bias"])
def test_data_gradient_activation_without_the_affine(affine):
    """A BatchNorm without weight or bias (or one of them): the data gradient computes each
    channel's scale as invstd (times the weight) and shift as -mean * scale (plus the bias),
    as bn_affine does; a within one rounding of that rule."""
    case = DGRAD_TILE_CASES[0]
    x, weight, _, gamma, beta, mean, invstd, *_, s, p, d, _ = make(case, torch.float16,
                                                                  channels_last=True)
    gamma = gamma if affine[0] else None
    beta = beta if affine[1] else None
    gy = torch.randn(2, case[4], case[2], case[3], dtype=torch.float64).to(DEVICE, torch.float16)
    gy = gy.contiguous(memory_format=torch.channels_last)
    act = torch.ops.fusedres_cuda_testing.dgrad_with_activation(
        gy, x, weight, gamma, beta, mean, invstd, s, p, d, True)[3]
    scale = invstd * gamma if gamma is not None else invstd
    shift = -mean * scale + (beta if beta is not None else 0)
    ref = torch.relu(x.float() * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)).half()
    eps = torch.finfo(torch.float16).eps
    assert ((act.double() - ref.double()).abs()
            <= eps * ref.double().abs() + 1e-6 * shift.abs().max().item()).all()


@pytest.mark.skipif(not HAS_HOST_KNOBS, reason="the tile hooks are built with the host copy")
def test_backward_mma_dgrad_tile_choice():
    """dgrad_mma_rows: the 128-row tile where its tiles (over every stride phase) fill the 132
    SMs the host copy counts (unless a test sets another count) once, else the 64-row one."""
    rows = torch.ops.fusedres_cuda_testing.dgrad_mma_rows
    assert rows(128 * 132, 64, 1) == 128 and rows(128 * 131, 64, 1) == 64
    assert rows(128 * 33, 64, 4) == 128 and rows(128 * 32, 64, 4) == 64
    assert rows(128 * 16, 128, 4) == 64 and rows(128 * 17, 128, 4) == 128
    with host_knobs(sms=1):
        assert rows(100, 8, 1) == 128
    assert rows(100, 8, 1) == 64
    # A thin tile's columns hold C (at most 32): as many column tiles as a 64-wide one.
    assert rows(128 * 132, 16, 1) == 128 and rows(128 * 131, 32, 1) == 64
    # (mma_cols and mma_depth, the forward's rules too: test_forward_mma_tile_choice.)
    # dgrad_mma_cols: on sm_90 (the host copy's default), 128 columns for C > 64 where the wide
    # tiles fill the SMs, else mma_cols; on sm_80 mma_cols.
    cols = torch.ops.fusedres_cuda_testing.dgrad_mma_cols
    assert cols(128 * 132, 72, 1) == 128 and cols(128 * 131, 72, 1) == 64
    assert cols(128 * 66, 256, 1) == 128 and cols(128 * 65, 256, 1) == 64
    assert cols(128 * 33, 72, 4) == 128 and cols(128 * 132, 64, 1) == 64
    assert cols(128 * 132, 24, 1) == 32
    with host_knobs(major=8):
        assert cols(128 * 132, 72, 1) == 64 and cols(128 * 10**3, 512, 1) == 64
    with host_knobs(major=10):
        assert cols(128 * 132, 72, 1) == 128


@pytest.mark.skipif(not HAS_HOOK, reason="the kernel-choice hook is built with the host copy")
def test_backward_kernel_choice():
    """Which inputs the mma.sync weight and data gradients take (wgrad_uses_mma,
    dgrad_uses_mma): 16-bit x, grad_out and weight of one dtype, x and grad_out channels-last,
    C and Co multiples of 8, 16-byte aligned data (the data gradient: at most 64 taps too);
    every other input the WMMA kernels, whose results they must then give."""
    case = (2, 16, 5, 6, 16, (3, 3), (1, 1), (1, 1), (1, 1), False, False)
    x, weight, _, gamma, beta, mean, invstd, _, s, p, d, _ = make(case, torch.float16,
                                                                  channels_last=True)
    gy = torch.randn(2, 16, 5, 6, dtype=torch.float16, device=DEVICE)
    cl = gy.contiguous(memory_format=torch.channels_last)
    assert _wgrad_kernel_for(cl, x, weight) == "mma"
    assert _wgrad_kernel_for(gy, x, weight) == "wmma"  # grad_out NCHW
    assert _wgrad_kernel_for(cl, x.contiguous(), weight) == "wmma"  # x NCHW
    assert _wgrad_kernel_for(cl, x.float(), weight) == "wmma"  # mixed pair
    assert _wgrad_kernel_for(cl.float(), x, weight) == "mma"  # grad_out is cast to the weight's
    assert _wgrad_kernel_for(cl.bfloat16(), x.bfloat16(), weight.bfloat16()) == "mma"
    # C = 12: not a multiple of 8; Co = 12 likewise.
    x12 = x[:, :12].contiguous(memory_format=torch.channels_last)
    assert _wgrad_kernel_for(cl, x12, weight[:, :12]) == "wmma"
    cl12 = cl[:, :12].contiguous(memory_format=torch.channels_last)
    assert _wgrad_kernel_for(cl12, x, weight[:12]) == "wmma"
    # A channels-last view 8 bytes into its storage: off the 16-byte boundary.
    flat = torch.zeros(x.numel() + 4, dtype=x.dtype, device=DEVICE)
    off = flat[4:].view(2, 5, 6, 16).permute(0, 3, 1, 2)
    off.copy_(x)
    assert off.stride() == x.stride() and off.data_ptr() % 16 != 0
    assert _wgrad_kernel_for(cl, off, weight) == "wmma"
    # The data gradient: the same rule, and at most 64 taps (9 x 9 is 81).
    assert _dgrad_kernel_for(cl, x, weight) == "mma"
    assert _dgrad_kernel_for(gy, x, weight) == "wmma"
    assert _dgrad_kernel_for(cl, off, weight) == "wmma"
    assert _dgrad_kernel_for(cl, x, weight.new_zeros(16, 16, 9, 9)) == "wmma"
    assert _wgrad_kernel_for(cl, x, weight.new_zeros(16, 16, 9, 9)) == "mma"
    off_args = (cl, off, weight, gamma, beta, mean, invstd, s, p, d, True, [True] * 5)
    got = OPS.bn_relu_conv2d_backward(*off_args)
    want = OPS.bn_relu_conv2d_backward(cl, x, *off_args[2:])
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w) <= (1e-2 if i < 2 else 1e-5), i
    mask = [False, True, True, False, False]
    got = OPS.bn_relu_conv2d_backward(cl, off, weight, gamma, beta, mean, invstd, s, p, d, True,
                                      mask)
    want = OPS.bn_relu_conv2d_backward(cl, x, weight, gamma, beta, mean, invstd, s, p, d, True,
                                       mask)
    assert rel_err(got[1], want[1]) <= 1e-2 and rel_err(got[2], want[2]) <= 1e-5


def test_unsupported_dtype_pair_is_a_clear_error():
    args = list(make(CASES[0], torch.float64))
    args[1] = args[1].float()
    args[2] = args[2].float()
    args[7] = args[7].float()
    with pytest.raises(TypeError, match=r"weight: expected dtype Double \(x's; or float32"):
        OPS.bn_relu_conv2d(*args)


# --------------------------------------------------------------------------- index helpers

@pytest.mark.skipif(not hasattr(torch.ops, "fusedres_cuda_testing")
                    or not hasattr(torch.ops.fusedres_cuda_testing, "pixel_offsets"),
                    reason="the index-helper test op is built with the host copy only")
def test_index_helpers_use_int64():
    """Row -> (n, h, w) -> element offset, as the kernels compute them, for rows and offsets
    past 2^31 (a batch of more than 2^31 pixels; strides of a tensor of 2^40 elements)."""
    height, width = 1000, 3000
    sizes = [2**20, 7, height, width]
    strides = [7 * height * width, 1, 7 * width, 7]  # channels_last
    rows = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 12345, 3 * 2**31 + 7, 2**40 + 5])
    channel = 5
    got = torch.ops.fusedres_cuda_testing.pixel_offsets(rows, height, width, sizes, strides,
                                                        channel)
    expect = []
    for r in rows.tolist():
        n, rem = divmod(r, height * width)
        h, w = divmod(rem, width)
        expect.append(n * strides[0] + channel * strides[1] + h * strides[2] + w * strides[3])
    assert got.dtype == torch.int64
    assert got.tolist() == expect
    assert max(expect) > 2**40


# --------------------------------------------------------------------------- selftest

@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU `make selftest` runs it for real")
def test_selftest_runs_the_cuda_backend(monkeypatch, capsys):
    """`python -m fusedres.apps.selftest --backends cuda` on CPU tensors through the CPU layer (the
    backend made available as FUSEDRES_CUDA_ON_CPU=1 at import would): every case passes and
    every row of the table is the cuda backend's."""
    from fusedres.apps import selftest
    from fusedres.backends import cuda as cuda_backend
    from fusedres.ops import _backend

    monkeypatch.setattr(cuda_backend, "ON_CPU", True)
    _backend._unavailable_reason.cache_clear()
    try:
        assert selftest.main(["--backends", "cuda", "--reps", "1"]) == 0
    finally:
        monkeypatch.undo()
        _backend._unavailable_reason.cache_clear()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("cuda ", "triton "))]
    assert rows and all(line.startswith("cuda ") and " pass " in line for line in rows), out
    assert "max rel err" in out and "FAIL" not in out


@pytest.mark.parametrize("capability, ok", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_backend_reports_a_gpu_older_than_sm80_unavailable(monkeypatch, capability, ok):
    # A machine with the kernels built and a visible GPU: the capability decides, before any
    # launch (a Turing card has no sm_80 image to run).
    from fusedres.backends import cuda as cuda_backend
    from fusedres.ops import _extension

    monkeypatch.setattr(_extension, "LOADED", True)
    monkeypatch.setattr(cuda_backend, "missing_ops", lambda key: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    reason = cuda_backend.unavailable_reason(torch.device("cuda"))
    if ok:
        assert reason is None
    else:
        assert reason == ("the GPU (Tesla T4) has compute capability 7.5; "
                          "the CUDA kernels need 8.0 or newer")
