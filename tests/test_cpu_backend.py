"""CPU-backend specifics (csrc/cpu): the shared matrix in test_bn_relu_conv.py covers the unit
against the reference; here, what only the C++ kernels can get wrong: batch tiling, thread
counts, layouts and strides, mixed dtypes, and statistics accuracy at large counts."""

from __future__ import annotations

import copy

import pytest
import torch

import fusedres
from fusedres.backends import portable
from fusedres.ops import _backend, _extension, opdefs

pytestmark = pytest.mark.skipif(
    fusedres.ops._backend.unavailable_reason("cpu") is not None,
    reason=f"cpu backend unavailable: {fusedres.ops._backend.unavailable_reason('cpu')}",
)

OPS = torch.ops.fusedres_cpu
HALF = (torch.bfloat16, torch.float16)


def _stats_dtype(dtype):
    return torch.float32 if dtype in HALF else dtype


def _inputs(n=3, c=5, h=7, w=13, co=6, k=(3, 3), dtype=torch.float32, wdtype=None,
            x_format=torch.contiguous_format, w_format=torch.contiguous_format, bias=True,
            residual=True, stride=(1, 1), padding=(1, 1), dilation=(1, 1), affine=True):
    """Arguments of fusedres_cpu.bn_relu_conv2d (opdefs.UnitArgs order); BN statistics come
    from the batch."""
    wdtype = wdtype or dtype
    sdt = _stats_dtype(dtype)
    x = (torch.randn(n, c, h, w) * 2 + 0.5).to(dtype).contiguous(memory_format=x_format)
    weight = (torch.randn(co, c, *k) / (c * k[0] * k[1]) ** 0.5).to(wdtype)
    weight = weight.contiguous(memory_format=w_format)
    b = torch.randn(co).to(wdtype) if bias else None
    gamma = (torch.rand(c) + 0.5).to(sdt) if affine else None
    beta = torch.randn(c).to(sdt) if affine else None
    var, mean = torch.var_mean(x.to(sdt), dim=(0, 2, 3), correction=0)
    invstd = torch.rsqrt(var + 1e-5)
    shape = opdefs.out_shape(x, weight, stride, padding, dilation)
    res = torch.randn(shape).to(wdtype) if residual else None
    return [x, weight, b, gamma, beta, mean, invstd, res, list(stride), list(padding),
            list(dilation), True]


def ref_forward(*args):
    """The portable backend's forward (PyTorch ops), the same arguments as the op."""
    return portable.bn_relu_conv2d(*args)


def ref_backward(*args):
    return portable.bn_relu_conv2d_backward(*args)


def _backward_args(fwd_args, grad_out, batch_stats, mask=None):
    x, weight, b, gamma, beta, mean, invstd, _, stride, padding, dilation, _ = fwd_args
    if mask is None:
        mask = [True, True, b is not None, gamma is not None, beta is not None]
    return (grad_out, x, weight, gamma, beta, mean, invstd, stride, padding, dilation,
            batch_stats, mask)


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2,
            torch.float16: 4e-3}[dtype]


def _assert_same(actual, expected, dtype, what):
    """Same metadata (shape, dtype, strides) and values within tol x magnitude."""
    assert actual.shape == expected.shape, what
    assert actual.dtype == expected.dtype, what
    if actual.numel() > 1:
        assert actual.stride() == expected.stride(), f"{what}: {actual.stride()} vs " \
                                                     f"{expected.stride()}"
    if actual.numel():
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual.double(), expected.double(),
                                   atol=_tol(dtype) * scale, rtol=_tol(dtype), msg=what)


def _compare_with_portable(args, dtype, batch_stats=True, mask=None):
    y = OPS.bn_relu_conv2d(*args)
    y_ref = ref_forward(*args)
    _assert_same(y, y_ref, dtype, "output")
    gy = torch.randn_like(y_ref)
    bargs = _backward_args(args, gy, batch_stats, mask)
    names = ["grad_x", "grad_weight", "grad_bias", "grad_bn_weight", "grad_bn_bias"]
    for name, g, g_ref in zip(names, OPS.bn_relu_conv2d_backward(*bargs),
                              ref_backward(*bargs)):
        _assert_same(g, g_ref, dtype, name)


def test_available_and_picked_by_auto():
    assert "cpu" in fusedres.available_backends("cpu")
    with fusedres.use_backend("auto"):
        assert _backend.resolve_backend(torch.device("cpu")) == "cpu"


def test_backend_handles_are_the_ops():
    """The backend module's op handles are the fusedres_cpu ops, named as the ops, with the
    schemas of opdefs.SCHEMAS (what the public ops call with the same arguments)."""
    from fusedres.backends import cpu

    for name, schema in opdefs.SCHEMAS.items():
        handle = getattr(cpu, name)
        assert handle is getattr(torch.ops.fusedres_cpu, name)
        assert str(handle.default._schema) == f"fusedres_cpu::{name}{schema}"


# --------------------------------------------------------------------------- genstats

@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["f32", "f64", "bf16"])
def test_genstats_is_the_forward_and_its_statistics(dtype, channels_last):
    """bn_relu_conv2d_genstats: the forward's y exactly, and y's per-channel mean and biased
    variance (as stored) in the statistics dtype, as the cuda backend's genstats returns."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    args = _inputs(n=3, c=17, h=9, w=7, co=11, dtype=dtype, x_format=fmt)
    y = OPS.bn_relu_conv2d(*args)
    y2, mean, var = OPS.bn_relu_conv2d_genstats(*args)
    assert torch.equal(y, y2) and y.stride() == y2.stride()
    assert mean.dtype == var.dtype == opdefs.stats_dtype(y.dtype)
    assert mean.shape == var.shape == (y.shape[1],)
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(mean.double(), mean64, atol=tol, rtol=tol)
    torch.testing.assert_close(var.double(), var64, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(5, 19, 44, 45, 24), (5, 19, 9, 10, 24), (2, 260, 3, 5, 256)],
                         ids=["many-chunks", "one-chunk", "batch-tiles"])
def test_genstats_of_pixel_chunks(dtype, residual, shape):
    """A channels_last 1x1 unit on the pixel-chunk route reduces y's statistics chunk by chunk
    (no pass over y afterwards): the same y as the forward, and y's mean and biased variance
    as float64 computes them over the whole of y, with a mean far from zero (1000 + noise
    through the residual: no E[y^2] - E[y]^2 cancellation). Chunks of 256 KiB of rows: 9900
    pixels of 43 channels are several, the last one short; a weight over 256 KiB runs in batch
    tiles instead."""
    n, c, h, w, co = shape
    cl = torch.channels_last
    args = _inputs(n=n, c=c, h=h, w=w, co=co, k=(1, 1), padding=(0, 0), dtype=dtype,
                   x_format=cl, w_format=cl, residual=residual)
    if residual:
        args[7] = (args[7] + 1000).contiguous(memory_format=cl)
    y = OPS.bn_relu_conv2d(*args)
    y2, mean, var = OPS.bn_relu_conv2d_genstats(*args)
    assert torch.equal(y, y2) and y.stride() == y2.stride()
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(mean.double(), mean64, atol=0, rtol=tol)
    torch.testing.assert_close(var.double(), var64, atol=0, rtol=tol * 10)


# --------------------------------------------------------------------------- tiling rule

def _tile_rule(n, bytes_per_sample, weight_bytes, tile_bytes, weight_x=4):
    """csrc/cpu/bn_relu_conv2d.cpp's tile_samples, restated for the test."""
    if tile_bytes <= 0 or n <= 0:
        return max(n, 1)
    budget = max(tile_bytes, weight_x * weight_bytes)
    nb = min(max(budget // max(bytes_per_sample, 1), 1), n)
    tiles = -(-n // nb)
    return -(-n // tiles)


def test_tile_rule_is_exported_from_the_extension(monkeypatch):
    """_extension.cpu_tile_samples runs the kernels' own rule, reading the environment and the
    thread count at the call: 4 MiB per thread for NCHW inputs, 16 MiB for channels_last (32
    MiB at least)."""
    threads = torch.get_num_threads()
    for channels_last, default in ((False, threads * 4 * 2**20),
                                   (True, max(threads, 2) * 16 * 2**20)):
        for n, per_sample, weight in [(128, 131072, 9216), (7, 300_000, 0), (1, 10, 10),
                                      (64, 1 << 20, 1 << 22), (5, 0, 0), (128, 81920, 65536)]:
            assert _extension.cpu_tile_samples(n, per_sample, weight, channels_last) == _tile_rule(
                n, per_sample, weight, default), (n, per_sample, weight, channels_last)
    assert _extension.cpu_tile_samples(128, 81920, 65536) < _extension.cpu_tile_samples(
        128, 81920, 65536, True)
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", "300000")
    assert _extension.cpu_tile_samples(7, 100_000, 0) == 3  # 3 fit: tiles of 3, 3 and 1
    assert _extension.cpu_tile_samples(7, 100_000, 0, True) == 3  # the variable sets both
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", "0")
    assert _extension.cpu_tile_samples(7, 100_000, 0) == 7
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", "1000")
    assert _extension.cpu_tile_samples(10, 1000, 2500) == _tile_rule(10, 1000, 2500, 1000)


# --------------------------------------------------------------------------- batch statistics

@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_batch_stats_million_values_large_offset(channels_last):
    """M = N*H*W = 1,048,576 per channel around 1000: float32 sums would lose the variance."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (1000 + torch.randn(16, 3, 256, 256)).contiguous(memory_format=fmt)
    x[:, 1] = x[:, 1] * 0.01 - 990  # small variance on a large offset
    mean, var = OPS.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert mean.dtype == var.dtype == torch.float32
    torch.testing.assert_close(mean.double(), mean64, atol=0, rtol=1e-7)
    torch.testing.assert_close(var.double(), var64, atol=0, rtol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16],
                         ids=["f64", "bf16", "f16"])
def test_batch_stats_dtypes(dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    # C = 17 and 33: vector widths plus a tail; 16 and 48: whole vectors (the NHWC register
    # walks); HW = 13 * 7 a prime-ish plane.
    for c in (17, 33, 16, 48):
        x = (torch.randn(5, c, 13, 7) * 3 + 2).to(dtype).contiguous(memory_format=fmt)
        mean, var = OPS.batch_stats(x)
        var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
        assert mean.dtype == _stats_dtype(dtype)
        rtol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(mean.double(), mean64, atol=rtol, rtol=rtol)
        torch.testing.assert_close(var.double(), var64, atol=rtol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_batch_stats_small_nchw_planes_by_channel(dtype):
    """NCHW planes under one chunk are reduced by channel, a chunk's worth of samples at a time:
    7x7 planes (49 values, a vector tail) of 400 samples make 3 such groups a channel
    (167 + 167 + 66 samples), on a large offset."""
    x = (torch.randn(400, 3, 7, 7) * torch.tensor([1.0, 0.01, 5.0]).view(1, 3, 1, 1) + 300)
    x = x.to(dtype)
    mean, var = OPS.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(mean.double(), mean64, atol=0, rtol=tol)
    torch.testing.assert_close(var.double(), var64, atol=0, rtol=100 * tol)


def test_batch_stats_long_planes_are_chunked():
    """Planes longer than one chunk (8192 values) are merged with Chan's formula."""
    x = torch.randn(2, 2, 181, 97) * torch.linspace(0, 5, 181).view(1, 1, 181, 1) + 7
    mean, var = OPS.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean.double(), mean64, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(var.double(), var64, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- the fused ops

@pytest.mark.parametrize("batch_stats", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype,wdtype", [
    (torch.float32, torch.float32), (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32)],
    ids=["f32", "f64", "bf16", "f32x-bf16w", "bf16x-f32w"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "x-nchw-w-nhwc", "x-nhwc-w-nchw"])
@pytest.mark.parametrize("k", [3, 1], ids=["3x3", "1x1"])  # 1x1 NCHW runs as batched GEMMs
def test_ops_match_portable(k, layout, dtype, wdtype, batch_stats):
    cl, cf = torch.channels_last, torch.contiguous_format
    x_format, w_format = {"nchw": (cf, cf), "nhwc": (cl, cl), "x-nchw-w-nhwc": (cf, cl),
                          "x-nhwc-w-nchw": (cl, cf)}[layout]
    args = _inputs(n=3, c=17, h=7, w=13, co=5, k=(k, k), padding=(k // 2, k // 2), dtype=dtype,
                   wdtype=wdtype, x_format=x_format, w_format=w_format)
    _compare_with_portable(args, dtype if dtype in HALF else wdtype, batch_stats)


def test_ops_refuse_a_float64_x_with_a_16bit_weight():
    """The pairs the kernels take are autocast's (float32 with a 16-bit float, either way); a
    float64 x with a bfloat16 weight is refused by name, as the Python API refuses it."""
    args = _inputs(n=2, c=3, h=5, w=5, co=4, k=(3, 3), padding=(1, 1), dtype=torch.float64,
                   wdtype=torch.bfloat16, x_format=torch.contiguous_format,
                   w_format=torch.contiguous_format)
    with pytest.raises(TypeError, match="weight: expected dtype Double"):
        OPS.bn_relu_conv2d(*args)


@pytest.mark.parametrize("k,stride,padding,dilation", [
    ((1, 1), (2, 2), (0, 0), (1, 1)),
    ((3, 3), (2, 1), (2, 0), (2, 1)),
    ((5, 2), (1, 3), (1, 1), (1, 2)),
    ((7, 7), (1, 1), (0, 0), (1, 1)),  # kernel covers the whole 7x7 input: 1x1 output
])
def test_conv_geometry(k, stride, padding, dilation):
    args = _inputs(n=2, c=3, h=7, w=7, co=4, k=k, stride=stride, padding=padding,
                   dilation=dilation)
    _compare_with_portable(args, torch.float32)


@pytest.mark.parametrize("mask", [
    [True, False, False, False, False], [False, True, True, False, False],
    [False, False, False, True, True], [True, True, False, False, True],
    [False, False, False, False, False]])
def test_output_mask(mask):
    args = _inputs(affine=True, bias=True)
    _compare_with_portable(args, torch.float32, mask=mask)


def test_no_affine_no_bias_no_residual():
    args = _inputs(affine=False, bias=False, residual=False)
    _compare_with_portable(args, torch.float32)


def test_non_dense_input_and_grad():
    """x as a strided view (neither layout) and a non-contiguous grad_out."""
    args = _inputs(n=2, c=4, h=9, w=9, co=3)
    base = torch.randn(2, 9, 4, 9 * 2)
    args[0] = base[..., ::2].transpose(1, 2)  # (2, 4, 9, 9), neither contiguous nor NHWC
    assert not args[0].is_contiguous() and not args[0].is_contiguous(
        memory_format=torch.channels_last)
    y = OPS.bn_relu_conv2d(*args)
    _assert_same(y, ref_forward(*args), torch.float32, "output")
    gy = torch.randn(y.shape[0], y.shape[2], y.shape[1], y.shape[3]).transpose(1, 2)
    bargs = _backward_args(args, gy, True)
    for g, g_ref in zip(OPS.bn_relu_conv2d_backward(*bargs), ref_backward(*bargs)):
        _assert_same(g, g_ref, torch.float32, "grad")


@pytest.mark.parametrize("c", [17, 48], ids=["c17", "c48"])
@pytest.mark.parametrize("tile_bytes", ["1", "300000", "0"], ids=["one-sample", "some", "one"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("k", [1, 3])
def test_batch_tiling_is_invisible(monkeypatch, k, tile_bytes, channels_last, c):
    """Any tile size (one sample per tile, a few, the whole batch) and either layout of the
    convolution's tiles gives the same results; the last tile is shorter (N = 7). NCHW 3x3
    units convolve on NHWC tiles under 48 channels (c17) and on NCHW ones from 48 (c48)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    args = _inputs(n=7, c=c, h=15, w=16, co=24, k=(k, k), padding=(k // 2, k // 2),
                   x_format=fmt)
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", tile_bytes)
    _compare_with_portable(args, torch.float32)
    if k == 3:  # bfloat16 through the same paths (transposes of 2-byte tiles)
        bf = [a.bfloat16() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 and
              a.dim() == 4 else a for a in args]
        bf[2] = bf[2].bfloat16()
        _compare_with_portable(bf, torch.bfloat16)


@pytest.mark.parametrize("residual", ["nhwc", "nchw", "none"])
@pytest.mark.parametrize("tile_bytes", ["300000", "0"], ids=["tiles", "one"])
@pytest.mark.parametrize("shape", [(7, 19, 9, 10, 24), (7, 19, 9, 10, 12), (3, 19, 40, 41, 24),
                                   (3, 19, 40, 41, 12), (2, 250, 3, 5, 270), (2, 270, 3, 5, 250)],
                         ids=["widening", "narrowing", "widening-chunks", "narrowing-chunks",
                              "widening-batch-tiles", "narrowing-batch-tiles"])
def test_channels_last_1x1_as_one_gemm(monkeypatch, residual, tile_bytes, shape):
    """A channels_last 1x1 unit runs as one GEMM per pixel chunk of each thread (256 KiB of
    rows: 4920 pixels of 31-43 channels are several chunks, the last one short), the residual
    added by the GEMM when it is channels_last too, afterwards when not; the weight gradient
    accumulated as gw^T for a widening convolution, as gw for a narrowing one; a weight over
    256 KiB as one GEMM per batch tile instead; and gives what the portable backend (oneDNN's
    convolution) gives."""
    n, c, h, w, co = shape
    cl = torch.channels_last
    args = _inputs(n=n, c=c, h=h, w=w, co=co, k=(1, 1), padding=(0, 0), x_format=cl,
                   w_format=cl, residual=residual != "none")
    if residual == "nhwc":
        args[7] = args[7].contiguous(memory_format=cl)
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", tile_bytes)
    _compare_with_portable(args, torch.float32)
    _compare_with_portable(args, torch.float32, mask=[True, True, True, False, False])
    f64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    _compare_with_portable(f64, torch.float64)


PAIRS = {  # name: ((k, stride, padding) of the first conv, of the second)
    "1x1/2 + 3x3/2": ((1, 2, 0), (3, 2, 1)),     # a basic unit's shortcut and conv1
    "1x1/2 + 1x1": ((1, 2, 0), (1, 1, 0)),       # a bottleneck's, stride on conv2
    "1x1 + 1x1": ((1, 1, 0), (1, 1, 0)),         # a widening bottleneck's (GEMM routes)
}


@pytest.mark.parametrize("tile_bytes", ["300000", "0"], ids=["tiles", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("pair", PAIRS)
def test_pair_is_two_units(monkeypatch, pair, channels_last, dtype, tile_bytes):
    """bn_relu_conv2d_pair_backward (the projection shortcut and conv1 of one BN-ReLU, one
    pass over x) gives each convolution's weight and bias gradients as its own backward does,
    and the sums of the two x and BatchNorm gradients; training and eval statistics, every
    output mask, tiles of a few samples or one (channels_last GEMM pairs run by one pixel
    chunk; test_channels_last_1x1_as_one_gemm runs several).
    bn_relu_conv2d_pair gives both forwards."""
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", tile_bytes)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    (k1, s1, p1), (k2, s2, p2) = PAIRS[pair]
    args = _inputs(n=7, c=17, h=10, w=9, co=12, k=(k1, k1), dtype=dtype, x_format=fmt,
                   stride=(s1, s1), padding=(p1, p1), residual=False)
    x, w1, b1, gamma, beta, mean, invstd = args[:7]
    w2 = (torch.randn(5, 17, k2, k2) / (17 * k2 * k2) ** 0.5).to(dtype)
    geo1 = ([s1, s1], [p1, p1], [1, 1])
    geo2 = ([s2, s2], [p2, p2], [1, 1])
    g1 = torch.randn(opdefs.out_shape(x, w1, *geo1)).to(dtype).contiguous(memory_format=fmt)
    g2 = torch.randn(opdefs.out_shape(x, w2, *geo2)).to(dtype).contiguous(memory_format=fmt)
    for batch_stats in (True, False):
        for mask in ([True] * 5, [True, False, False, True, True], [False, True, True, False,
                                                                      False]):
            pair_out = OPS.bn_relu_conv2d_pair_backward(
                g1, g2, x, w1, w2, gamma, beta, mean, invstd, *geo1, *geo2, batch_stats, mask)
            one = OPS.bn_relu_conv2d_backward(g1, x, w1, gamma, beta, mean, invstd, *geo1,
                                              batch_stats, mask)
            two = OPS.bn_relu_conv2d_backward(g2, x, w2, gamma, beta, mean, invstd, *geo2,
                                              batch_stats, mask)
            gx, gw1, gb1, gw2, gb2, gg, gbeta = pair_out
            expected = {"grad_x": one[0].double() + two[0].double(), "grad_weight": one[1],
                        "grad_bias": one[2], "grad_weight2": two[1], "grad_bias2": two[2],
                        "grad_bn_weight": one[3].double() + two[3].double(),
                        "grad_bn_bias": one[4].double() + two[4].double()}
            actual = dict(zip(expected, pair_out))
            for name, want in expected.items():
                got = actual[name]
                assert got.shape == want.shape, (name, mask)
                if got.numel():
                    assert got.dtype in (want.dtype, dtype, _stats_dtype(dtype)), name
                    if name == "grad_x":
                        assert got.stride() == x.stride()
                    scale = max(1.0, want.abs().max().item())
                    tol = 2 * _tol(dtype) if name == "grad_x" else _tol(dtype)
                    torch.testing.assert_close(got.double(), want.double(), atol=tol * scale,
                                               rtol=tol, msg=f"{name} {mask} {batch_stats}")
            assert gx.numel() == (x.numel() if mask[0] else 0)
            assert gw2.numel() == (w2.numel() if mask[1] else 0)
    # The forward of the pair: each output as its own forward gives it (tiles sized for both
    # outputs, so oneDNN may block differently: within rounding), y2's statistics as genstats.
    b2 = torch.randn(5).to(dtype)
    for stats2 in (True, False):
        y1, y2, m2, v2 = OPS.bn_relu_conv2d_pair(x, w1, b1, w2, b2, gamma, beta, mean, invstd,
                                                 *geo1, *geo2, stats2)
        want1 = OPS.bn_relu_conv2d(x, w1, b1, gamma, beta, mean, invstd, None, *geo1, True)
        want2, wm, wv = OPS.bn_relu_conv2d_genstats(x, w2, b2, gamma, beta, mean, invstd, None,
                                                    *geo2, True)
        _assert_same(y1, want1, dtype, "y")
        _assert_same(y2, want2, dtype, "y2")
        if stats2:
            _assert_same(m2, wm, dtype, "mean of y2")
            _assert_same(v2, wv, dtype, "var of y2")
        else:
            assert m2.numel() == v2.numel() == 0
    with pytest.raises(TypeError, match="weight2: expected dtype"):
        OPS.bn_relu_conv2d_pair(x, w1, b1, w2.double() if dtype != torch.float64 else w2.float(),
                                None, gamma, beta, mean, invstd, *geo1, *geo2, True)
    with pytest.raises(TypeError, match="weight2: expected dtype"):
        OPS.bn_relu_conv2d_pair_backward(g1, g2, x, w1, w2.double() if dtype != torch.float64
                                         else w2.float(), gamma, beta, mean, invstd, *geo1,
                                         *geo2, True, [True] * 5)


def _aten_calls(fn) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("tile_bytes", ["6000", "0"], ids=["tiles", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("pair", ["1x1/2 + 3x3/2", "1x1/2 + 1x1"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_strided_1x1_beside_another_is_a_gemm(monkeypatch, layout, pair, dtype, tile_bytes):
    """A pair's strided 1x1 shortcut runs as GEMMs on the pixels it reads, its data gradient
    added into the other convolution's (no oneDNN convolution for it, forward or backward), and
    gives what the two convolutions' own ops give (a strided 1x1 alone is oneDNN's), every
    output of forward and backward, in tiles of a few samples or one, on channels_last tiles
    (pixel rows) and NCHW ones (channel-major columns: the NCHW 1x1 + 1x1 pair, and float64's
    3x3 pair; float32 NCHW tensors beside a 3x3 run on NHWC tiles, and keep oneDNN's there).
    A strided 1x1 unit alone keeps oneDNN's convolution (strided_beside_dense)."""
    monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", tile_bytes)
    cl = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    (k1, s1, p1), (k2, s2, p2) = PAIRS[pair]
    args = _inputs(n=5, c=16, h=12, w=11, co=12, k=(k1, k1), dtype=dtype, x_format=cl,
                   w_format=cl, stride=(s1, s1), padding=(p1, p1), residual=False)
    x, w1, b1, gamma, beta, mean, invstd = args[:7]
    w2 = (torch.randn(5, 16, k2, k2) / (16 * k2 * k2) ** 0.5).to(dtype).contiguous(
        memory_format=cl)
    geo1, geo2 = ([s1, s1], [p1, p1], [1, 1]), ([s2, s2], [p2, p2], [1, 1])
    g1 = torch.randn(opdefs.out_shape(x, w1, *geo1)).to(dtype).contiguous(memory_format=cl)
    g2 = torch.randn(opdefs.out_shape(x, w2, *geo2)).to(dtype).contiguous(memory_format=cl)
    out = {}

    def run():
        fwd = OPS.bn_relu_conv2d_pair(x, w1, b1, w2, None, gamma, beta, mean, invstd, *geo1,
                                      *geo2, True)
        bwd = OPS.bn_relu_conv2d_pair_backward(g1, g2, x, w1, w2, gamma, beta, mean, invstd,
                                               *geo1, *geo2, True, [True] * 5)
        out["pair"] = (*fwd, *bwd)

    calls = _aten_calls(run)
    convs = [calls.get(f"aten::{op}", 0) for op in ("convolution", "convolution_backward")]
    # Per tile, one convolution forward and one backward by oneDNN for each convolution that
    # is not a GEMM: none for 1x1 + 1x1 with the strided route, the 3x3's alone beside it;
    # float32 NCHW tensors beside a 3x3 (NHWC tiles) keep oneDNN's for both.
    route = not (layout == "nchw" and k2 == 3 and dtype == torch.float32)
    for count in convs:
        if route and k2 == 1:
            assert count == 0, convs
        elif tile_bytes == "0":  # one tile
            assert count == (1 if route else 2), convs
        else:
            assert count > 0, convs
    y1 = OPS.bn_relu_conv2d(x, w1, b1, gamma, beta, mean, invstd, None, *geo1, True)
    y2, mean2, var2 = OPS.bn_relu_conv2d_genstats(x, w2, None, gamma, beta, mean, invstd, None,
                                                  *geo2, True)
    one = OPS.bn_relu_conv2d_backward(g1, x, w1, gamma, beta, mean, invstd, *geo1, True,
                                      [True] * 5)
    two = OPS.bn_relu_conv2d_backward(g2, x, w2, gamma, beta, mean, invstd, *geo2, True,
                                      [True] * 5)
    want = (y1, y2, mean2, var2, one[0] + two[0], one[1], one[2], two[1], two[2],
            one[3] + two[3], one[4] + two[4])
    names = ["y1", "y2", "mean2", "var2", "gx", "gw1", "gb1", "gw2", "gb2", "gg", "gbeta"]
    for name, got, w in zip(names, out["pair"], want):
        assert got.shape == w.shape, name
        if name in ("y1", "y2", "gx"):
            assert got.stride() == w.stride(), name
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        torch.testing.assert_close(got, w.to(got.dtype), atol=2 * _tol(dtype) * scale,
                                   rtol=2 * _tol(dtype), msg=name)
    # Alone, the strided 1x1 is oneDNN's convolution.
    calls = _aten_calls(lambda: OPS.bn_relu_conv2d_backward(
        g1, x, w1, gamma, beta, mean, invstd, *geo1, True, [True] * 5))
    assert calls.get("aten::convolution_backward", 0) >= 1, calls


@pytest.mark.parametrize("add_as", ["x", "other layout", "other dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("c", [16, 17], ids=["c16", "c17"])
def test_backward_add_is_backward_plus_add(c, channels_last, dtype, add_as):
    """bn_relu_conv2d_backward_add (a unit's identity-shortcut gradient summed into x's) gives
    bn_relu_conv2d_backward's gradients with grad_x_add added to grad_x, in x's dtype and
    strides: an addend laid out as x joins the data-gradient pass, one in another layout or
    dtype is added after; training and eval statistics (eval's first pass writes the result
    itself); 17 channels take the NHWC period rows; the other outputs are untouched."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    args = _inputs(n=5, c=c, h=6, w=7, co=8, dtype=dtype, x_format=fmt, residual=False)
    x = args[0]
    g = torch.randn(opdefs.out_shape(x, args[1], [1, 1], [1, 1], [1, 1])).to(dtype)
    g = g.contiguous(memory_format=fmt)
    add = torch.randn(x.shape).to(dtype)
    add = {"x": add.contiguous(memory_format=fmt),
           "other layout": add.contiguous(memory_format=torch.contiguous_format if channels_last
                                          else torch.channels_last),
           "other dtype": add.to(torch.float64 if dtype != torch.float64 else torch.float32)
           .contiguous(memory_format=fmt)}[add_as]
    before = add.clone()
    for batch_stats in (True, False):
        for mask in ([True] * 5, [True, False, False, False, False]):
            bargs = _backward_args(args, g, batch_stats, mask)
            want = OPS.bn_relu_conv2d_backward(*bargs)
            got = OPS.bn_relu_conv2d_backward_add(*bargs, None, add)
            expected = want[0].double() + add.double()
            assert got[0].dtype == x.dtype and got[0].stride() == x.stride()
            tol = 2 * _tol(dtype) * max(1.0, expected.abs().max().item())
            torch.testing.assert_close(got[0].double(), expected, atol=tol, rtol=2 * _tol(dtype),
                                       msg=f"grad_x, {mask} {batch_stats}")
            for name, a, b in zip(("weight", "bias", "bn_weight", "bn_bias"), got[1:], want[1:]):
                torch.testing.assert_close(a, b, msg=name)
    assert torch.equal(add, before)  # read, never written
    bargs = _backward_args(args, g, True)
    with pytest.raises(ValueError, match="grad_x_add: expected shape"):
        OPS.bn_relu_conv2d_backward_add(*bargs, None, add[:1])
    with pytest.raises(ValueError, match=r"output_mask: expected output_mask\[0\] \(x\) set"):
        OPS.bn_relu_conv2d_backward_add(*bargs[:-1], [False, True, True, True, True], None, add)


@pytest.mark.parametrize("c,hw", [(64, 32), (24, 32), (16, 33)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_large_dz_streams_past_the_cache(monkeypatch, c, hw, channels_last):
    """A dz of more than 8 MiB a thread is written with streaming stores where its rows are
    whole aligned vectors (64 channels; 24 channels walked as 48-value rows; 33 x 33 planes and
    16-channel rows) and with ordinary ones elsewhere: the same gradients either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        n = (8 << 20) // (c * hw * hw * 4) + 1  # just over 8 MiB of float32 dz
        args = _inputs(n=n, c=c, h=hw, w=hw, co=8, k=(1, 1), padding=(0, 0), x_format=fmt,
                       residual=False)
        assert args[0].numel() * 4 > 8 << 20
        monkeypatch.setenv("FUSEDRES_CPU_TILE_BYTES", "1000000")  # several tiles
        _compare_with_portable(args, torch.float32)
        _compare_with_portable(args, torch.float32, batch_stats=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("c,pixels", [(24, (3, 5, 5)), (17, (2, 9, 9)), (40, (1, 3, 3)),
                                      (3, (2, 7, 5)), (1000, (2, 3, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nhwc_channels_off_the_vector_width(c, pixels, dtype):
    """NHWC tensors whose channel count is not a multiple of the vector width are walked in
    rows of lcm(C, lanes) values, the leftover pixels (here 75 = 2 * 36 + 3 of 24 channels;
    fewer pixels than one period for C=40 at 1x3x3) as ordinary rows: statistics, forward
    and backward agree with the portable backend."""
    n, h, w = pixels
    args = _inputs(n=n, c=c, h=h, w=w, co=5, k=(1, 1), padding=(0, 0), dtype=dtype,
                   x_format=torch.channels_last)
    _compare_with_portable(args, dtype)
    x = args[0]
    mean, var = OPS.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(mean.double(), mean64, atol=tol, rtol=tol)
    torch.testing.assert_close(var.double(), var64, atol=tol, rtol=tol)


@pytest.mark.parametrize("c", [8, 16, 32, 48, 112, 128, 144, 272])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nhwc_rows_of_whole_vectors(c, dtype):
    """NHWC rows of up to 8 whole vectors run with the per-channel vectors and the sums in
    registers (1 to 8 vectors: 8..128 float channels, 8..64 double; the statistics also in
    column groups of 8 vectors past that: 144 and 272 channels; 8 float channels through the
    periods): 3 x 11 x 13 = 429 pixels, more than one 256-row block. Statistics, forward and
    backward agree with float64 and the portable backend."""
    args = _inputs(n=3, c=c, h=11, w=13, co=5, k=(1, 1), padding=(0, 0), dtype=dtype,
                   x_format=torch.channels_last)
    _compare_with_portable(args, dtype)
    x = args[0]
    mean, var = OPS.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(mean.double(), mean64, atol=tol, rtol=tol)
    torch.testing.assert_close(var.double(), var64, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts(threads):
    """Per-thread reduction buffers are sized by torch.get_num_threads(); results do not depend
    on it beyond rounding."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fmt in (torch.contiguous_format, torch.channels_last):
            args = _inputs(n=4, c=33, h=11, w=11, co=9, x_format=fmt)
            _compare_with_portable(args, torch.float32)
    finally:
        torch.set_num_threads(old)


def test_unit_through_modules_with_cpu_backend():
    """A bottleneck unit (projection shortcut, stride 2) through the public modules, fused on
    the cpu backend against the plain block with the same parameters."""
    torch.manual_seed(1)
    fused = fusedres.PreActBottleneck(12, 5, stride=2, fused=True)
    plain = fusedres.PreActBottleneck(12, 5, stride=2, fused=False)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 12, 11, 11)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with fusedres.use_backend("cpu"):
        y = fused(xs[0])
    y_ref = plain(xs[1])
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    gy = torch.randn_like(y)
    y.backward(gy)
    y_ref.backward(gy)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
    for (name, b), c in zip(fused.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, c, msg=name)


# name: (BNReLUConv2d kwargs, BatchNorm2d kwargs, x dtype, channels_last, residual)
MODULE_CASES = {
    "default": ({}, {}, torch.float32, False, False),
    "residual+bias": ({"bias": True}, {}, torch.float32, False, True),
    "cumulative": ({"momentum": None}, {}, torch.float32, False, False),
    "no-running-stats": ({}, {"track_running_stats": False}, torch.float32, False, False),
    "no-affine": ({}, {"affine": False}, torch.float32, False, False),
    "strided+cl": ({"stride": 2}, {}, torch.float32, True, True),
    "f64": ({}, {}, torch.float64, False, True),
    "bf16 (declined)": ({}, {}, torch.bfloat16, False, False),
}


@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "inference"])
@pytest.mark.parametrize("case", MODULE_CASES)
def test_module_forward_in_one_call_is_the_python_route(monkeypatch, case, mode):
    """BNReLUConv2d's forward on the cpu backend is one C++ call (the cpu record's module_unit: the
    BatchNorm preparation, then the unit with its C++ autograd node) where it accepts the
    arguments, and gives what the Python route gives, to the bit: outputs, every gradient,
    running statistics and the batch count, over two steps; in training and eval (forward and
    backward), no_grad and inference mode. bfloat16 is left to the Python route (the op
    returns [])."""
    from fusedres.ops import _backend as routes

    unit_kw, bn_kw, dtype, cl, residual = MODULE_CASES[case]
    fmt = torch.channels_last if cl else torch.contiguous_format
    torch.manual_seed(0)
    ref = fusedres.BNReLUConv2d(6, 5, 3, padding=1, **unit_kw)
    ref.bn = torch.nn.BatchNorm2d(6, momentum=unit_kw.get("momentum", 0.1), **bn_kw)
    ref = ref.to(dtype).to(memory_format=fmt)
    if mode != "train":
        ref.eval() if bn_kw.get("track_running_stats", True) else None
    fast = copy.deepcopy(ref)
    stride = unit_kw.get("stride", 1)
    xs = [(torch.randn(4, 6, 7, 7) * 2 + 1).to(dtype).contiguous(memory_format=fmt)
          for _ in range(2)]
    rs = [torch.randn(4, 5, -(-7 // stride), -(-7 // stride)).to(dtype) if residual else None
          for _ in range(2)]
    calls = []

    def counted(*args):
        out = module_unit(*args)
        calls.append(len(out))
        return out

    cpu_route = routes.load("cpu")
    module_unit = cpu_route.module_unit
    results = {}
    for name, unit in (("python", ref), ("one call", fast)):
        monkeypatch.setitem(routes.TABLE, "cpu", cpu_route._replace(
            module_unit=counted if name == "one call" else None))
        outs = []
        for x, r in zip(xs, rs):
            grads = mode in ("train", "eval")
            x = x.clone().requires_grad_(grads)
            rr = None if r is None else r.clone().requires_grad_(grads)
            if mode == "inference":
                with torch.inference_mode():
                    y = unit(x, rr)
            elif mode == "no_grad":
                with torch.no_grad():
                    y = unit(x, rr)
            else:
                y = unit(x, rr)
            outs.append(y.detach().clone())
            if grads:
                y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
                           .to(dtype))
                outs += [x.grad] + ([rr.grad] if rr is not None else [])
        outs += [p.grad for p in unit.parameters() if p.grad is not None]
        outs += list(unit.buffers())
        results[name] = outs
    taken = dtype != torch.bfloat16
    assert calls == [1 if taken else 0] * 2, calls
    assert len(results["python"]) == len(results["one call"])
    for i, (a, b) in enumerate(zip(results["python"], results["one call"])):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), i
        assert torch.equal(a, b), i


def test_module_forward_in_one_call_leaves_bad_input_to_the_python_checks():
    """Arguments the one-call route does not take reach the Python checks: the same errors,
    naming the argument, and no running statistic changed."""
    cases = [
        (lambda m: setattr(m.conv, "weight", torch.nn.Parameter(m.conv.weight.double())),
         torch.randn(2, 4, 6, 6), TypeError, "weight: expected dtype torch.float32"),
        (lambda m: setattr(m.conv, "stride", (0, 1)), torch.randn(2, 4, 6, 6), ValueError,
         r"stride: expected values in \[1, 2\^31\)"),
        (lambda m: setattr(m.bn, "num_batches_tracked", None) or setattr(m.bn, "momentum", None),
         torch.randn(2, 4, 6, 6), ValueError, "num_batches_tracked: required"),
        (lambda m: setattr(m.bn, "running_var", torch.ones(5)), torch.randn(2, 4, 6, 6),
         ValueError, "running_var: expected shape"),
        (lambda m: setattr(m.conv, "weight", torch.nn.Parameter(torch.randn(3, 4, 1, 1))),
         torch.randn(1, 4, 1, 1), ValueError, "more than 1 value per channel"),
        (lambda m: None, torch.randn(2, 5, 6, 6), ValueError, "to match the 5 channels of x"),
        (lambda m: None, torch.randn(2, 4, 1, 1), ValueError, "too small"),
    ]
    for change, x, exc, match in cases:
        m = fusedres.BNReLUConv2d(4, 3, 3)
        change(m)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with fusedres.use_backend("cpu"), pytest.raises(exc, match=match):
            m(x)
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), (match, k)
    m = fusedres.BNReLUConv2d(4, 3, 3, padding=1)
    with fusedres.use_backend("cpu"), pytest.raises(ValueError, match=r"residual: expected shape"):
        m(torch.randn(2, 4, 6, 6), torch.randn(2, 3, 5, 6))
    assert int(m.bn.num_batches_tracked) == 0


def test_saves_half_the_bytes_of_the_plain_unit():
    m = fusedres.BNReLUConv2d(16, 16, 3, padding=1)
    plain = torch.nn.Sequential(m.bn, torch.nn.ReLU(), m.conv)
    x = torch.randn(4, 16, 16, 16, requires_grad=True)
    with fusedres.use_backend("cpu"):
        fused_bytes = fusedres.memory.saved_bytes(m, x)
    plain_bytes = fusedres.memory.saved_bytes(plain, x)
    # The plain unit keeps x and relu(bn(x)); the fused one x and per-channel vectors only.
    assert plain_bytes >= 2 * x.nbytes
    assert x.nbytes <= fused_bytes < x.nbytes + 1024


@pytest.mark.parametrize("affine,bias,residual,x_grad", [
    (False, True, True, True), (True, True, False, False), (False, False, False, True)],
    ids=["no-affine+bias+res", "bias-no-x-grad", "bare"])
def test_eager_node_gradients_line_up_with_its_inputs(affine, bias, residual, x_grad):
    """The C++ autograd node (fusedres_cpu::eager_unit) finds each input's gradient among the
    tensor inputs that are present (an absent bias, BatchNorm affine or residual shifts them):
    every gradient equals the public op's, none is given where none is wanted; under
    inference_mode its forward alone runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    unit = fusedres.BNReLUConv2d(6, 5, 3, padding=1, stride=2, bias=bias, dtype=torch.float64)
    unit.bn = torch.nn.BatchNorm2d(6, affine=affine, dtype=torch.float64)
    x = torch.randn(3, 6, 7, 7, dtype=torch.float64, requires_grad=x_grad)
    r = torch.randn(3, 5, 4, 4, dtype=torch.float64, requires_grad=True) if residual else None
    wrt = [t for t in (x, r, *unit.parameters()) if t is not None and t.requires_grad]
    with fusedres.use_backend("cpu"):
        y = unit(x, r)
        assert "EagerCpuUnit" in y.grad_fn.name()
        g = torch.autograd.grad(y.square().sum(), wrt)
        with Passthrough():
            y_op = unit(x, r)
        g_op = torch.autograd.grad(y_op.square().sum(), wrt)
        with torch.inference_mode():
            y_inf = unit(x.detach())
    torch.testing.assert_close(y, y_op, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y_inf, y_op.detach() - (0 if r is None else r.detach()),
                               rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g_op, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eager_route_is_taken_and_agrees_with_the_public_op():
    """Eager units on CPU tensors take the cpu record's unit, EagerCpuUnit (no custom-op
    layers, a C++ autograd node: fusedres_cpu::eager_unit); under a dispatch
    mode (as under the memory tracker) they take the public op. Same kernels, same results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    unit = fusedres.BNReLUConv2d(8, 5, 3, padding=1, dtype=torch.float64)
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 5, 6, 6, dtype=torch.float64, requires_grad=True)
    wrt = [x, r, *unit.parameters()]
    with fusedres.use_backend("cpu"):
        y = unit(x, r)
        assert y.grad_fn.name().endswith("::EagerCpuUnit>"), y.grad_fn.name()  # CppNode<...>
        g = torch.autograd.grad(y.square().sum(), wrt)
        with Passthrough():
            y_op = unit(x, r)
        assert "EagerCpu" not in y_op.grad_fn.name()
        g_op = torch.autograd.grad(y_op.square().sum(), wrt)
    torch.testing.assert_close(y, y_op, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g_op):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert unit.bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("momentum", [0.1, None], ids=["m0.1", "cumulative"])
@pytest.mark.parametrize("mode", ["train", "train_given_stats", "eval", "no_running_stats"])
@pytest.mark.parametrize("dtype,stats_dtype", [
    (torch.float32, torch.float32), (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32), (torch.float32, torch.float64),
], ids=["f32", "f64", "bf16_x", "f64_running"])
@pytest.mark.parametrize("c", [6, 37])
def test_prepare_batch_norm_in_one_call_is_the_python_rule(monkeypatch, momentum, mode, dtype,
                                                            stats_dtype, c):
    """prepare_batch_norm on eager CPU tensors is one C++ call (the cpu record's
    prepare_batch_norm): the same statistics, running statistics and count, bit for bit, as
    the Python sequence it replaces (37 channels: ATen's vectorised kernels and their tails,
    against the C++ loop that updates float running statistics); the given mean kept, never
    running_mean; the running statistics' version counters bumped as by in-place ops."""
    from fusedres import functional as FR
    from fusedres.ops import _backend as routes

    cpu_route = routes.load("cpu")
    assert cpu_route.prepare_batch_norm is not None
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, c, 7, 9, generator=g) * 3 + 2).to(dtype).requires_grad_()
    gamma, beta = torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)
    given = None
    if mode == "train_given_stats":
        var, mean = torch.var_mean(x.detach().to(_stats_dtype(dtype)), dim=(0, 2, 3),
                                   correction=0)
        given = (mean, var)

    def run(route):
        rm = torch.randn(c, generator=torch.Generator().manual_seed(4)).to(stats_dtype)
        rv = torch.rand(c, generator=torch.Generator().manual_seed(5)).to(stats_dtype) + 0.5
        nbt = torch.tensor(6)
        if mode == "no_running_stats":
            rm = rv = nbt = None
        calls = []
        op = cpu_route.prepare_batch_norm if route == "c++" else None
        monkeypatch.setitem(routes.TABLE, "cpu", cpu_route._replace(
            prepare_batch_norm=None if op is None else (lambda *a: calls.append(a) or op(*a))))
        versions = None if rm is None else (rm._version, rv._version)
        with fusedres.use_backend("cpu"):
            state = FR.prepare_batch_norm(x, gamma, beta, rm, rv, nbt, training=mode != "eval",
                                          momentum=momentum, eps=1e-3, stats=given)
        assert len(calls) == (route == "c++")
        return state, rm, rv, nbt, versions

    new, rm, rv, nbt, versions = run("c++")
    old, rm0, rv0, nbt0, _ = run("python")
    assert new.batch_stats == old.batch_stats == (mode != "eval")
    for a, b in ((new.mean, old.mean), (new.invstd, old.invstd), (rm, rm0), (rv, rv0),
                 (nbt, nbt0)):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a, b)
    assert not new.mean.requires_grad and not new.invstd.requires_grad
    if given is not None:  # the caller's statistics are kept (they may be a view of another's)
        assert new.mean is given[0]
    if rm is not None:
        assert new.mean.data_ptr() != rm.data_ptr()
        assert int(nbt) == 6 + (mode != "eval")
        moved = mode != "eval"
        assert (rm._version > versions[0]) == moved and (rv._version > versions[1]) == moved


# The NHWC period walk (csrc/cpu/vec/vec.h, nhwc_periods) of a channels_last 1x1 unit that runs
# as one pixel chunk (csrc/cpu/bn_relu_conv2d.cpp, backward_by_chunks): there the chunk's
# kernels open their own parallel region, and the first backward pass, handed one thread's row
# of sums, sized its period sums by it while its threads wrote a row each: heap corruption
# (glibc's abort) for C % L == L / 2 under avx512 (C=24, 40) and avx2 (C=20, 28). A child per
# capability, so that an abort fails the test: every C of 1..40 that is not whole vectors of
# 8 or 16 lanes, over 257 period rows and one pixel more (two blocks of 256 rows, so two
# threads, and a rest row), float32 and float64, with and without a residual.
_PERIOD_CHUNK = """
import math, sys
sys.path.insert(0, {tests!r})
import torch
import fusedres
from test_cpu_backend import _compare_with_portable, _inputs
torch.set_num_threads(2)
torch.manual_seed(0)
print("in use:", fusedres.cpu_capability(), flush=True)
lanes = 16 if fusedres.cpu_capability() == "avx512" else 8  # float lanes; double: half
for dtype in (torch.float32, torch.float64):
    L = lanes if dtype == torch.float32 else lanes // 2
    for c in [c for c in range(1, 41) if c % 16]:
        per = L // math.gcd(c, L)  # pixels per period row
        for residual in (False, True):
            args = _inputs(n=1, c=c, h=1, w=257 * per + 1, co=4, k=(1, 1), padding=(0, 0),
                           dtype=dtype, x_format=torch.channels_last,
                           w_format=torch.channels_last, residual=residual)
            _compare_with_portable(args, dtype)
print("agree")
"""


def _cpu_runs() -> list[str]:
    """The capabilities fusedres._C has copies of and this CPU runs."""
    import importlib

    ext = importlib.import_module("fusedres._C")
    have = set(ext.cpu_features())
    return [name for name, need in ext.cpu_capabilities() if set(need) <= have]


@pytest.mark.parametrize("pin", ["baseline", "avx2", "avx512"])
def test_nhwc_period_walk_in_one_pixel_chunk(pin):
    if pin not in _cpu_runs():
        pytest.skip(f"this CPU or build does not run {pin} (it runs: {', '.join(_cpu_runs())})")
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", _PERIOD_CHUNK.format(tests=str(tests))],
                         capture_output=True, text=True, cwd=tests.parent, timeout=600,
                         env=dict(os.environ, FUSEDRES_CPU_CAPABILITY=pin))
    assert out.returncode == 0, f"exit status {out.returncode}\n" + out.stdout[-2000:] + \
        out.stderr[-4000:]
    assert out.stdout == f"in use: {pin}\nagree\n", out.stdout
