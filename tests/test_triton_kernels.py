"""The Triton kernels through their host launchers, under TRITON_INTERPRET=1 on CPU (set by
conftest), against float64 PyTorch: every GPU config on a small case, the split and strategy
paths the interpreter's default config does not take, layouts, dtypes, and the selftest."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import fusedres  # noqa: E402
from fusedres.backends import portable  # noqa: E402
from fusedres.backends import triton as triton_backend  # noqa: E402
from fusedres.kernels import batch_stats as bs  # noqa: E402
from fusedres.kernels import bn_relu_conv2d as fwd  # noqa: E402
from fusedres.kernels import bn_relu_conv2d_dgrad as dg  # noqa: E402
from fusedres.kernels import bn_relu_conv2d_wgrad as wg  # noqa: E402
from fusedres.kernels._common import KernelConfig  # noqa: E402
from helpers import TRITON_TRACE_PRELUDE  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = (torch.float16, torch.bfloat16)
# Relative error bounds (max |err| / max |ref|) against float64, from measured errors:
# fp32 ~3e-7, fp64 ~1e-15, fp16 ~5e-4, bf16 ~6e-3 (inputs rounded to the dtype).
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def rel_err(a, b) -> float:
    b = b.double()
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _sdt(dtype):
    return torch.float32 if dtype in HALF else dtype


def make(n=2, c=5, h=7, w=9, co=6, k=3, dtype=torch.float32, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(n, c, h, w, generator=g) * 2 + 0.5).to(DEVICE, dtype)
    wt = (torch.randn(co, c, k, k, generator=g) / (c * k * k) ** 0.5).to(DEVICE, dtype)
    gamma = (torch.rand(c, generator=g) + 0.5).to(DEVICE, _sdt(dtype))
    beta = (torch.randn(c, generator=g) * 0.5).to(DEVICE, _sdt(dtype))
    return (x.contiguous(memory_format=fmt), wt.contiguous(memory_format=fmt), gamma, beta)


def _scale_shift(gamma, beta, mean, invstd):
    scale = gamma * invstd
    return scale, beta - mean * scale


# --------------------------------------------------------------------------- availability

def test_unavailable_reason(monkeypatch):
    assert triton_backend.unavailable_reason(torch.device("cpu")) is None or DEVICE.type == "cuda"
    assert "CUDA tensors" in triton_backend.unavailable_reason(torch.device("meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in triton_backend.unavailable_reason(torch.device("cpu"))


# --------------------------------------------------------------------------- launch routes

def _noop_jit_kernel(monkeypatch):
    """A compiled-mode (not interpreted) JITFunction whose launch only records its grid: the
    host-side launch path of a GPU, here."""
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(X, n, BLOCK: tl.constexpr):
        pass

    kernel = JITFunction(body)
    launched = []
    kernel.run = lambda *args, grid=None, **kwargs: launched.append(grid)
    from fusedres.kernels import _common
    monkeypatch.setattr(_common, "INTERPRET", False)
    assert isinstance(kernel, JITFunction) and triton is not None
    return kernel, launched


def test_eager_launch_bypasses_wrap_triton(monkeypatch):
    """On a GPU an eager launch outside a triton_op (the BatchNorm preparation) goes to the kernel
    itself; through ``torch.library.wrap_triton`` it would run the mutation higher-order op and
    leave an entry in torch's kernel side table per launch, never freed. While a graph is traced
    (a dispatch mode active) the launcher wraps, so the trace records the launch."""
    from torch._higher_order_ops.triton_kernel_wrap import (
        TraceableTritonKernelWrapper,
        kernel_side_table,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusedres.kernels._common import launcher

    kernel, launched = _noop_jit_kernel(monkeypatch)
    x = torch.zeros(4)
    entries = len(kernel_side_table.constant_args)
    for _ in range(3):
        launcher(kernel)[(2,)](x, 4, BLOCK=4)
    assert len(kernel_side_table.constant_args) == entries
    assert launched == [(2,)] * 3  # the launch itself (the wrapper's would be (2, 1, 1))
    # What the launcher avoids: the wrapper's eager launch grows the side table.
    torch.library.wrap_triton(kernel)[(2,)](x, 4, BLOCK=4)
    assert len(launched) == 4 and len(kernel_side_table.constant_args) == entries + 1

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert isinstance(launcher(kernel), TraceableTritonKernelWrapper)



def test_triton_ops_are_registered():
    for name in ("batch_stats", "bn_relu_conv2d", "bn_relu_conv2d_genstats",
                 "bn_relu_conv2d_backward"):
        assert hasattr(torch.ops.fusedres_triton, name)


# --------------------------------------------------------------------------- batch statistics

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_batch_stats(dtype, channels_last):
    x = make(n=2, c=3, h=7, w=13, dtype=dtype, channels_last=channels_last)[0]
    mean, var = bs.batch_stats(x)
    assert mean.dtype == var.dtype == _sdt(dtype)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert rel_err(mean, mean64) < tol and rel_err(var, var64) < tol


@pytest.mark.parametrize("split", [1, 3])
def test_batch_stats_large_mean_every_config(split):
    """x = 1000 + noise: the tile two-pass + Chan merge keeps the variance (naive E[x^2]-E[x]^2
    in float32 would lose it), for every config and a reduction split over programs."""
    x = (1000 + torch.randn(3, 5, 23, 19)).to(DEVICE)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    for cfg in bs.configs_for(torch.float32):
        mean, var = bs.batch_stats(x, config=cfg, split=split)
        assert (mean.double() - mean64).abs().max() < 1e-4  # ~1 ulp at 1000
        assert rel_err(var, var64) < 1e-4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_batch_stats_nan_inf_as_torch():
    x = torch.randn(2, 3, 7, 7).to(DEVICE)
    x[0, 1, 2, 3] = float("inf")
    x[1, 2, 0, 0] = float("nan")
    mean, var = bs.batch_stats(x)
    # As F.batch_norm: an inf gives mean inf (not var_mean's NaN) and variance NaN.
    ref_mean, ref_var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), correction=0)
    assert torch.equal(mean.isinf(), ref_mean.isinf()) and torch.equal(mean.isnan(),
                                                                         ref_mean.isnan())
    assert torch.equal(var.isnan(), ref_var.isnan())


# --------------------------------------------------------------------------- forward

def _ref_forward(x, wt, bias, scale, shift, residual, stride, padding, dilation):
    c = x.shape[1]
    a = torch.relu(x.double() * scale.double().view(1, c, 1, 1) + shift.double().view(1, c, 1, 1))
    y = F.conv2d(a, wt.double(), None if bias is None else bias.double(), stride, padding,
                 dilation)
    return y if residual is None else y + residual.double()


def _forward_case(dtype, channels_last, cfg, k=3, stride=(2, 1), padding=(1, 2), dilation=(1, 2),
                  c=5, co=17):
    x, wt, gamma, beta = make(n=1, c=c, h=9, w=7, co=co, k=k, dtype=dtype,
                              channels_last=channels_last)
    mean = torch.randn(c).to(DEVICE, _sdt(dtype)) * 0.1
    invstd = (torch.rand(c) + 0.5).to(DEVICE, _sdt(dtype))
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    bias = torch.randn(co).to(DEVICE, dtype)
    y_ref = _ref_forward(x, wt, bias, scale, shift, None, stride, padding, dilation)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    residual = torch.randn(y_ref.shape).to(DEVICE, dtype).contiguous(memory_format=fmt)
    y, m, v = fwd.bn_relu_conv2d_fwd(x, wt, bias, scale, shift, residual, stride, padding,
                                     dilation, fmt, genstats=True, config=cfg)
    assert y.dtype == dtype and y.is_contiguous(memory_format=fmt)
    assert rel_err(y, y_ref + residual.double()) < TOL[dtype]
    # genstats: the statistics of y as stored.
    var64, mean64 = torch.var_mean(y.double(), dim=(0, 2, 3), correction=0)
    assert rel_err(m, mean64) < 1e-5 and rel_err(v, var64) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_forward_genstats(dtype, channels_last):
    _forward_case(dtype, channels_last, None)


def gpu_configs(configs_for, dtype, **kwargs) -> list[KernelConfig]:
    """Every config ``configs_for`` gives a GPU for ``dtype``: for float32 those with TF32
    products and those without (the ``ieee`` ones, the only products the interpreter runs),
    each once."""
    names = ["fp32", "fp32-ieee"] if dtype == torch.float32 else [dtype]
    return list(dict.fromkeys(cfg for name in names for cfg in configs_for(name, **kwargs)))


def test_fp32_configs_follow_tf32(monkeypatch):
    """float32 launches from the TF32 configs when cuDNN may use TF32 on a GPU, from the
    ``ieee`` ones otherwise (and always under the interpreter, which runs ieee products)."""
    from fusedres.kernels._common import config_variant

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert config_variant(torch.float32, interpret=False) == "fp32"
    assert config_variant(torch.float32, interpret=True) == "fp32-ieee"
    assert config_variant(torch.float32) == "fp32-ieee"  # TRITON_INTERPRET=1 here
    assert config_variant(torch.float16, interpret=False) == "fp16"
    assert config_variant("fp32-ieee") == "fp32-ieee"
    with pytest.raises(ValueError, match="dtype"):
        config_variant("fp8")
    roles = {"mid": (64, 64), "big": (256, 256), "small": (32, 256)}
    tiles = wg.CONFIGS["fp32", "plain"]
    assert {name: wg.pick_config(co, c, torch.float32, interpret=False)
            for name, (co, c) in roles.items()} == {name: tiles[name] for name in roles}
    assert [wg.pick_config(co, c, torch.float32, interpret=False, taps=True)
            for co, c in [(16, 16), (32, 16)]] == [tiles["taps"], tiles["taps_wide"]]
    assert wg.configs_for(torch.float32, interpret=False) == list(tiles.values())
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ieee = wg.CONFIGS["fp32-ieee", "plain"]
    assert {name: wg.pick_config(co, c, torch.float32, interpret=False)
            for name, (co, c) in roles.items()} == {name: ieee[name] for name in roles}
    assert wg.configs_for(torch.float32, interpret=False) == list(ieee.values())
    assert not set(ieee.values()) & set(tiles.values())
    assert fwd.pick_config(64, 64, 64, torch.float32, interpret=False) == fwd.IEEE_CONFIGS["mid"]
    assert dg.pick_config(10**6, 64, 16, torch.float32,
                          interpret=False) == dg.IEEE_CONFIGS["many_pixels"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_every_gpu_config(dtype):
    for cfg in gpu_configs(fwd.configs_for, dtype):
        # ALIGNED configs run on channels-last operands with channel counts multiples of 16.
        c, co = (16, 48) if cfg.meta.get("ALIGNED") else (5, 17)
        _forward_case(dtype, True, cfg, k=3, stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                      c=c, co=co)


def test_aligned_config_refuses_unaligned_operands():
    """An ALIGNED config (vector loads stated to the compiler) on channel counts that are
    not multiples of 16, or on NCHW operands, is an error naming the config, not a wrong
    result; the host rule never picks one there."""
    cfg = next(c for c in fwd.configs_for(torch.float16) if c.meta.get("ALIGNED"))
    x, wt, gamma, beta = make(n=1, c=16, h=5, w=5, co=17, dtype=torch.float16,
                              channels_last=True)
    scale, shift = gamma, beta
    with pytest.raises(ValueError, match="ALIGNED"):
        fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                               torch.channels_last, config=cfg)
    x, wt, gamma, beta = make(n=1, c=16, h=5, w=5, co=16, dtype=torch.float16)
    with pytest.raises(ValueError, match="ALIGNED"):
        fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                               torch.contiguous_format, config=cfg)
    assert not fwd.pick_config(10**6, 256, 256, torch.float16, interpret=False,
                               aligned=False).meta.get("ALIGNED")
    assert fwd.pick_config(10**6, 256, 256, torch.float16, interpret=False).meta.get("ALIGNED")
    assert not dg.pick_config(10**6, 256, 256, torch.float16, interpret=False,
                              aligned=False).meta.get("ALIGNED")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_even_channels_unmasked_loads(dtype):
    """C and Co multiples of the interpreter's blocks (K 16, N 32): the forward and the data
    gradient drop their channel masks (EVEN_K, EVEN_N) and still match float64, padding,
    stride 2 phases and tap skipping included. (~2 s)"""
    x, wt, gamma, beta = make(n=2, c=32, h=7, w=6, co=32, dtype=dtype, channels_last=True)
    cfg = fwd.INTERPRET_CONFIG
    assert 32 % cfg.meta["BLOCK_K"] == 0 and 32 % cfg.meta["BLOCK_N"] == 0
    mean, var = bs.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    for stride in ((1, 1), (2, 2)):
        y = fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, stride, (1, 1), (1, 1),
                                   torch.channels_last)
        y_ref = _ref_forward(x, wt, None, scale, shift, None, stride, (1, 1), 1)
        assert rel_err(y, y_ref) < TOL[dtype]
        dy = torch.randn(y.shape).to(DEVICE, dtype).contiguous(memory_format=torch.channels_last)
        ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, stride, (1, 1), (1, 1), False)
        gx = torch.empty_like(x)
        dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, stride, (1, 1), (1, 1),
                                batch_stats=False, grad_x=gx, want_sums=False)
        assert rel_err(gx, ref[0]) < TOL[dtype] * (4 if dtype in HALF else 1)


def test_forward_noncontiguous_input():
    """A sliced x (no standard layout) goes through its strides."""
    x, wt, gamma, beta = make(n=2, c=4, h=9, w=18, co=3)
    x = x[:, :, :, ::2]
    assert not x.is_contiguous()
    mean, var = bs.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert rel_err(mean, mean64) < 1e-6 and rel_err(var, var64) < 1e-6
    invstd = torch.rsqrt(var + 1e-5)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    y = fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                               torch.contiguous_format)
    assert rel_err(y, _ref_forward(x, wt, None, scale, shift, None, 1, 1, 1)) < 1e-5


# --------------------------------------------------------------------------- backward

def _backward_inputs(dtype, channels_last, k=3, co=6, c=5):
    x, wt, gamma, beta = make(n=2, c=c, h=7, w=9, co=co, k=k, dtype=dtype,
                              channels_last=channels_last)
    mean, var = bs.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    return x, wt, gamma, beta, mean, invstd


def _portable64(dy, x, wt, gamma, beta, mean, invstd, stride, padding, dilation, train):
    d = lambda t: t.double()
    return portable.bn_relu_conv2d_backward(d(dy), d(x), d(wt), d(gamma), d(beta), d(mean),
                                            d(invstd), stride, padding, dilation, train,
                                            [True] * 5)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("strategy", ["sums", "store", "recompute"])
def test_dgrad_strategies(strategy, train):
    """dx from the weight-gradient pass's sums (default), from dz stored + the dx pass, or from
    a sums-only GEMM pass then a dx-writing one: all equal the float64 reference."""
    stride, padding, dilation = (2, 1), (1, 1), (1, 2)
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float32, True)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    ho = (7 + 2 - 3) // 2 + 1
    wo = (9 + 2 - 2 * 2 - 1) // 1 + 1
    dy = torch.randn(2, 6, ho, wo).to(DEVICE)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, stride, padding, dilation, train)
    gx = torch.empty_like(x)
    if strategy == "sums":
        _, _, sums = wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, stride, padding, dilation,
                                             want_bias=False, bn_affine=(gamma, beta),
                                             mean=mean, invstd=invstd)
        dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, stride, padding,
                                dilation, batch_stats=train, grad_x=gx, want_sums=False,
                                sums=sums)
    else:
        sums = dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, stride, padding,
                                       dilation, batch_stats=train, grad_x=gx, want_sums=True,
                                       strategy=strategy)
    assert rel_err(gx, ref[0]) < 1e-5
    assert rel_err(sums[0], ref[4]) < 1e-5 and rel_err(sums[1], ref[3]) < 1e-5


def test_dgrad_sums_only():
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float64, False)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    dy = torch.randn(2, 6, 7, 9, dtype=torch.float64).to(DEVICE)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, (1, 1), (1, 1), (1, 1), True)
    s1, s2 = dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, (1, 1), (1, 1),
                                     (1, 1), batch_stats=True, grad_x=None, want_sums=True)
    assert rel_err(s1, ref[4]) < 1e-12 and rel_err(s2, ref[3]) < 1e-12


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("sums", [False, True], ids=["plain", "sums"])
def test_wgrad_split_and_sums(split, sums):
    """The split-K partials and the SUMS decomposition dW = gamma*G2 + beta*G1 give the
    reference weight and bias gradients; written into ``out`` directly when unsplit."""
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float32, False, co=7)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    dy = torch.randn(2, 7, 4, 9).to(DEVICE)
    stride, padding = (2, 1), (1, 1)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, stride, padding, (1, 1), True)
    out = torch.empty_like(wt)
    gw, gb, s = wg.bn_relu_conv2d_wgrad(
        dy, x, wt, scale, shift, stride, padding, (1, 1), want_bias=True,
        bn_affine=(gamma, beta) if sums else None, mean=mean, invstd=invstd, out=out,
        split=split)
    assert gw is out
    assert rel_err(gw, ref[1]) < 1e-5 and rel_err(gb, ref[2]) < 1e-5
    if sums:
        assert rel_err(s[0], ref[4]) < 1e-5 and rel_err(s[1], ref[3]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_backward_every_gpu_config(dtype):
    """Each GPU config of dgrad, dx, wgrad and wgrad-sums on a case with partial tiles."""
    x, wt, gamma, beta, mean, invstd = _backward_inputs(dtype, True, co=17)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    dy = torch.randn(2, 17, 7, 9).to(DEVICE, dtype)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, (1, 1), (1, 1), (1, 1), True)
    tol = TOL[dtype] * (4 if dtype in HALF else 1)
    for cfg in gpu_configs(wg.configs_for, dtype):
        gw, _, _ = wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, (1, 1), (1, 1), (1, 1),
                                           want_bias=False, config=cfg, split=2)
        assert rel_err(gw, ref[1]) < tol, str(cfg)
    sums = None
    for cfg in gpu_configs(wg.configs_for, dtype, sums=True):
        _, _, sums = wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, (1, 1), (1, 1), (1, 1),
                                             want_bias=False, bn_affine=(gamma, beta),
                                             mean=mean, invstd=invstd, config=cfg)
        assert rel_err(sums[0], ref[4]) < tol and rel_err(sums[1], ref[3]) < tol, str(cfg)
    # ALIGNED configs on an aligned case (16 channels each side, channels-last), eval mode.
    xa, wa, ga, ba, mua, inva = _backward_inputs(dtype, True, co=16, c=16)
    sca, sha = _scale_shift(ga, ba, mua, inva)
    dya = torch.randn(2, 16, 7, 9).to(DEVICE, dtype).contiguous(memory_format=torch.channels_last)
    refa = _portable64(dya, xa, wa, ga, ba, mua, inva, (1, 1), (1, 1), (1, 1), False)
    for cfg in gpu_configs(dg.configs_for, dtype):
        if cfg.meta.get("ALIGNED"):
            gx = torch.empty_like(xa)
            dg.bn_relu_conv2d_dgrad(dya, xa, wa, sca, sha, mua, inva, (1, 1), (1, 1), (1, 1),
                                    batch_stats=False, grad_x=gx, want_sums=False, config=cfg)
            assert rel_err(gx, refa[0]) < tol, str(cfg)
            continue
        gx = torch.empty_like(x)
        dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, (1, 1), (1, 1), (1, 1),
                                batch_stats=True, grad_x=gx, want_sums=False, sums=sums,
                                config=cfg)
        assert rel_err(gx, ref[0]) < tol, str(cfg)
    for cfg in dg.dx_configs_for(dtype)[:1]:
        gx = torch.empty_like(x)
        dg.DX_INTERPRET_CONFIG, saved = cfg, dg.DX_INTERPRET_CONFIG
        try:
            dg.bn_relu_conv2d_dgrad(dy, x, wt, scale, shift, mean, invstd, (1, 1), (1, 1),
                                    (1, 1), batch_stats=True, grad_x=gx, want_sums=True,
                                    strategy="store")
        finally:
            dg.DX_INTERPRET_CONFIG = saved
        assert rel_err(gx, ref[0]) < tol, str(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", [[True, False, False, False, False],
                                  [False, True, True, False, False],
                                  [False, False, False, True, True],
                                  [True, True, False, True, False]],
                         ids=["x", "w+b", "bn", "mixed"])
def test_backend_backward_output_mask(dtype, mask):
    """Masked-out outputs are empty; the others match the float64 reference at the dtype."""
    x, wt, gamma, beta, mean, invstd = _backward_inputs(dtype, False)
    dy = torch.randn(2, 6, 7, 9).to(DEVICE, dtype)
    outs = triton_backend.bn_relu_conv2d_backward(dy, x, wt, gamma, beta, mean, invstd, (1, 1),
                                                  (1, 1), (1, 1), True, mask)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, (1, 1), (1, 1), (1, 1), True)
    for want, got, exp in zip(mask, outs, ref):
        if not want:
            assert got.numel() == 0
        else:
            assert got.shape == exp.shape
            assert rel_err(got, exp) < TOL[dtype] * (4 if dtype in HALF else 1)


@pytest.mark.parametrize("strategy", ["sums", "store", "auto"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_backend_backward_strategies(monkeypatch, strategy, train):
    monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", strategy)
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float32, True)
    dy = torch.randn(2, 6, 4, 5).to(DEVICE)
    args = (x, wt, gamma, beta, mean, invstd, (2, 2), (1, 1), (1, 1), train)
    ref = _portable64(dy, *args)
    for mask in ([True] * 5, [True, False, False, False, False], [False, False, False, True,
                                                                   True]):
        outs = triton_backend.bn_relu_conv2d_backward(dy, *args, mask)
        for want, got, exp in zip(mask, outs, ref):
            assert got.numel() == 0 if not want else rel_err(got, exp) < 1e-5


def test_backend_backward_auto_strategy(monkeypatch):
    """auto: "store" where wide channels make the extra GEMM of "sums" cost more (model)."""
    monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", "auto")
    meta = lambda *s: torch.empty(s, device="meta", dtype=torch.bfloat16)
    wide = triton_backend.backward_strategy(meta(256, 512, 7, 7), meta(256, 512, 7, 7),
                                            meta(512, 512, 3, 3), (1, 1))
    narrow = triton_backend.backward_strategy(meta(128, 16, 32, 32), meta(128, 16, 32, 32),
                                              meta(16, 16, 3, 3), (1, 1))
    assert (wide, narrow) == ("store", "sums")


def test_backend_backward_strategy_is_checked(monkeypatch):
    monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", "fast")
    with pytest.raises(ValueError, match="FUSEDRES_TRITON_BACKWARD"):
        triton_backend.backward_strategy()


def test_backend_forward_genstats_interface():
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float32, True)
    y, m, v = triton_backend.bn_relu_conv2d_genstats(x, wt, None, gamma, beta, mean, invstd,
                                                     None, (1, 1), (1, 1), (1, 1), True)
    m2, v2 = triton_backend.batch_stats(y)
    assert rel_err(m, m2) < 1e-5 and rel_err(v, v2) < 1e-5


def test_interpreter_bf16_rounds_to_nearest():
    """The interpreter truncates float32 -> bfloat16; the kernels round by hand there."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter-only workaround")
    x = torch.full((1, 1, 1, 1), 1.0 + 3 * 2 ** -9)  # between two bf16 values, nearer the top
    w = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16)
    one, zero = torch.ones(1), torch.zeros(1)
    y = fwd.bn_relu_conv2d_fwd(x, w, None, one, zero, None, (1, 1), (0, 0), (1, 1),
                               torch.contiguous_format)
    assert y.item() == x.bfloat16().item()


def test_kernel_config_str():
    cfg = KernelConfig.of(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    assert str(cfg) == "M=64 N=32 w=4 s=2"
    assert cfg.launch_kwargs == {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4,
                                   "num_stages": 2}


# --------------------------------------------------------------------------- selftest

def test_selftest_runs_and_passes(capsys):
    from fusedres.apps import selftest

    assert selftest.main([]) == 0
    out = capsys.readouterr().out
    assert "passed" in out and "FAIL" not in out


# --------------------------------------------------------------------------- torch.compile

_CAPTURE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from torch._dynamo.backends.common import aot_autograd
import fusedres.backends.triton  # noqa: F401  (defines the fusedres_triton ops)

graphs = []

from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table


def kernel_names(gs):  # the Triton kernels of the graphs, in graph order
    return [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
            for g in gs for n in g.graph.nodes
            if str(n.target) == "triton_kernel_wrapper_functional"]


def capture(gm, example_inputs):
    graphs.append(gm)
    def stop(*args):
        raise RuntimeError("captured")  # no GPU here: the graph is what we want
    return stop

x = torch.randn(2, 5, 7, 9).contiguous(memory_format=torch.channels_last)
w = torch.randn(6, 5, 3, 3)
sc, sh = torch.rand(5), torch.randn(5)
dy = torch.randn(2, 6, 7, 9)
fns = {
    "forward": lambda: torch.ops.fusedres_triton.bn_relu_conv2d(
        x, w, None, sc, sh, sh, sc, None, [1, 1], [1, 1], [1, 1], True),
    "backward": lambda: torch.ops.fusedres_triton.bn_relu_conv2d_backward(
        dy, x, w, sc, sh, sc, sh, [1, 1], [1, 1], [1, 1], True, [True] * 5),
    "batch_stats": lambda: torch.ops.fusedres_triton.batch_stats(x),
}
for name, fn in fns.items():
    graphs.clear()
    try:
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)()
    except RuntimeError as exc:
        if "captured" not in str(exc):
            raise
    print(name, *kernel_names(graphs))
"""


def test_triton_ops_decompose_into_kernels_under_compile():
    """torch.compile sees the Triton kernels inside the triton_ops (AOTDispatcher decomposes
    them into triton_kernel_wrapper_functional nodes). Traced on CPU with TRITON_INTERPRET=0 in
    a subprocess: under the interpreter a triton_op cannot be traced with fake tensors. The
    "sums" backward plan, named (for this toy shape, 5 -> 6 channels at 7x9, the modeled
    "auto" choice is "store")."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "FUSEDRES_TRITON_BACKWARD": "sums"}
    proc = subprocess.run([sys.executable, "-c", _CAPTURE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
               if line.strip()}
    # The BatchNorm's scale and shift, then the convolution.
    assert kernels["forward"] == ["scale_shift_kernel", "bn_relu_conv2d_fwd_kernel"]
    # The partial statistics, then Chan's merge of them.
    assert kernels["batch_stats"] == ["batch_stats_kernel", "stats_combine_kernel"]
    # Scale and shift, the weight-gradient (+ BN sums) pass, their reduction, the dx pass.
    assert kernels["backward"] == ["scale_shift_kernel", "wgrad_kernel", "partials_reduce_kernel",
                                   "dgrad_kernel"]


_CAPTURE_BLOCK = TRITON_TRACE_PRELUDE + r"""
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table


def kernel_names(gs):  # the Triton kernels of the graphs, in graph order
    return [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
            for g in gs for n in g.graph.nodes
            if str(n.target) == "triton_kernel_wrapper_functional"]


block = fusedres.PreActBasicBlock(8, 16, stride=2)
x = torch.randn(2, 8, 9, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
fn = torch.compile(block, fullgraph=True,
                   backend=aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw")))
# auto (-> triton), then portable (the guard on the backend name retraces: opaque public ops).
for phase in ("auto", "portable"):
    for gs in graphs.values():
        gs.clear()
    with fusedres.use_backend(phase):
        try:
            fn(x)
        except RuntimeError as exc:
            if "captured" not in str(exc):
                raise
    for kind, gs in graphs.items():
        nodes = [n for g in gs for n in g.graph.nodes if n.op == "call_function"]
        opaque = sum("fusedres" in str(n.target) for n in nodes)
        print(phase, kind, len(gs), opaque, *kernel_names(gs))
"""


def test_compiled_block_traces_down_to_the_triton_kernels():
    """Under torch.compile on a GPU with the triton backend, a fused block is built from the
    fusedres_triton triton_ops (fusedres.backends.triton.CompiledUnit), so the forward and the
    backward graphs hold the Triton kernels themselves and no opaque fusedres op. Traced on CPU
    in a subprocess (TRITON_INTERPRET=0, sm_80 as the target of the kernels' analysis). The
    "sums" backward plan, named (for this toy block's 16-channel 5x5 3x3 the modeled "auto"
    choice is "store", whose dx pass is a kernel of its own)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "FUSEDRES_TRITON_BACKWARD": "sums"}
    proc = subprocess.run([sys.executable, "-c", _CAPTURE_BLOCK], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {}
    for line in proc.stdout.splitlines():
        if line.strip():
            phase, kind, graphs, opaque, *kernels = line.split()
            counts[phase, kind] = (int(graphs), int(opaque), kernels)
    graphs, opaque, kernels = counts["auto", "fw"]
    assert (graphs, opaque) == (1, 0)
    # bn1's statistics (partials, merge); conv1 (scale and shift, the convolution with bn2's
    # partial statistics in its epilogue); the shortcut; bn2's merge; conv2.
    conv = ["scale_shift_kernel", "bn_relu_conv2d_fwd_kernel"]
    assert kernels == (["batch_stats_kernel", "stats_combine_kernel"] + conv + conv
                       + ["stats_combine_kernel"] + conv)
    graphs, opaque, kernels = counts["auto", "bw"]
    assert graphs == 1 and opaque == 0
    # Per convolution: scale and shift, the weight gradient (+ BN sums), their reduction, and
    # the dx pass (one launch per stride phase of a strided convolution).
    assert kernels.count("wgrad_kernel") == kernels.count("partials_reduce_kernel") == 3
    assert kernels.count("scale_shift_kernel") == 3 and kernels.count("dgrad_kernel") >= 3
    assert set(kernels) == {"scale_shift_kernel", "wgrad_kernel", "partials_reduce_kernel",
                            "dgrad_kernel"}
    # Another backend in force after compiling: retraced, through the public (opaque) ops.
    graphs, opaque, kernels = counts["portable", "fw"]
    assert graphs == 1 and kernels == [] and opaque == 4


@pytest.mark.parametrize("genstats", [False, True])
def test_compiled_unit_matches_the_public_op(genstats):
    """CompiledUnit (the traced form) gives the public op's outputs and gradients, eagerly."""
    torch.manual_seed(3)
    x = (torch.randn(2, 5, 7, 7) * 2 + 1).to(DEVICE).requires_grad_()
    w = torch.randn(6, 5, 3, 3).to(DEVICE).requires_grad_()
    gamma = (torch.rand(5) + 0.5).to(DEVICE).requires_grad_()
    beta = torch.randn(5).to(DEVICE).requires_grad_()
    res = torch.randn(2, 6, 7, 7).to(DEVICE).requires_grad_()
    mean, var = triton_backend.batch_stats(x.detach())
    invstd = torch.rsqrt(var + 1e-5)
    args = (x, w, None, gamma, beta, mean, invstd, res, [1, 1], [1, 1], [1, 1], True)
    with fusedres.use_backend("triton"):
        ours = triton_backend.CompiledUnit.apply(*args, genstats)
        theirs = (torch.ops.fusedres.bn_relu_conv2d_genstats(*args) if genstats
                  else torch.ops.fusedres.bn_relu_conv2d(*args))
    y, y_ref = (ours[0], theirs[0]) if genstats else (ours, theirs)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    if genstats:
        torch.testing.assert_close(ours[1:], theirs[1:], atol=0, rtol=0)
        assert not ours[1].requires_grad
    gy = torch.randn_like(y)
    leaves = (x, w, gamma, beta, res)
    with fusedres.use_backend("triton"):  # the public op's backward runs the backend in force
        grads = torch.autograd.grad(y, leaves, gy), torch.autograd.grad(y_ref, leaves, gy)
    for name, g, g_ref in zip(("x", "weight", "bn_weight", "bn_bias", "residual"), *grads):
        torch.testing.assert_close(g, g_ref, atol=0, rtol=0, msg=name)


def test_empty_and_huge_tensors_take_the_portable_path():
    from fusedres.kernels._common import fits_int32

    assert fits_int32(torch.empty(2, 3, 4, 5))
    assert not fits_int32(torch.empty(2**16, 2**15 + 1, device="meta"))
    x = torch.randn(0, 3, 5, 5).to(DEVICE)
    wt = torch.randn(4, 3, 3, 3).to(DEVICE)
    one, zero = torch.ones(3).to(DEVICE), torch.zeros(3).to(DEVICE)
    y = triton_backend.bn_relu_conv2d(x, wt, None, one, zero, zero, one, None, (1, 1), (1, 1),
                                      (1, 1), True)
    assert y.shape == (0, 4, 5, 5)
    outs = triton_backend.bn_relu_conv2d_backward(torch.randn(0, 4, 5, 5).to(DEVICE), x, wt, one,
                                                  zero, zero, one, (1, 1), (1, 1), (1, 1), False,
                                                  [True] * 5)
    assert outs[0].shape == x.shape and torch.equal(outs[1], torch.zeros_like(wt))


def test_autotune_times_every_config_and_caches(monkeypatch):
    """FUSEDRES_TRITON_AUTOTUNE=1: each config runs once through the launcher, the fastest is
    kept per shape key (the timer is faked here: the interpreter's times mean nothing)."""
    from fusedres.kernels import _common

    monkeypatch.setenv("FUSEDRES_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(_common, "_TUNED", {})
    seen = []

    def fake_bench(fn):
        before = len(seen)
        fn()
        seen.append(before)
        return -len(seen)  # the last config timed is the "fastest"
    monkeypatch.setattr(_common, "_bench", fake_bench)
    x, wt, gamma, beta, mean, invstd = _backward_inputs(torch.float32, True)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    y = fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                               torch.channels_last)
    configs = fwd.configs_for(torch.float32)
    assert len(seen) == len(configs)
    assert list(_common._TUNED.values()) == [configs[-1]]
    assert rel_err(y, _ref_forward(x, wt, None, scale, shift, None, 1, 1, 1)) < 1e-5
    fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                           torch.channels_last)
    assert len(seen) == len(configs)  # cached: no second tuning
    # The backward launchers tune too, and stay correct.
    dy = torch.randn(2, 6, 7, 9).to(DEVICE)
    outs = triton_backend.bn_relu_conv2d_backward(dy, x, wt, gamma, beta, mean, invstd, (1, 1),
                                                  (1, 1), (1, 1), True, [True] * 5)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, (1, 1), (1, 1), (1, 1), True)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(outs, ref))
    assert len(_common._TUNED) == 3


def test_batch_stats_a_million_values_per_channel():
    """N*H*W = 2**20 per channel, x = 1000 + noise in float32, split over 8 programs."""
    g = torch.Generator().manual_seed(1)
    x = (1000 + torch.randn(16, 2, 256, 256, generator=g)).to(DEVICE)
    # Big tiles keep the interpreter quick; the merge across tiles and splits is what counts.
    cfg = KernelConfig.of(BLOCK_M=8192, BLOCK_C=2, num_warps=4, num_stages=1)
    mean, var = bs.batch_stats(x, config=cfg, split=8)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert (mean.double() - mean64).abs().max() < 1e-4
    assert rel_err(var, var64) < 1e-5


# ---------------------------------------------------------------- kernels/reductions.py
# The small kernels that replaced the host ops between the big ones (~2 s together).

@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float64])
def test_stats_combine_merges_rows_as_chan_in_float64(part_dtype):
    """Chan's merge of (rows, C) partials whose last row is short, against the float64
    formula on the host; the counts come from M and the row size only."""
    from fusedres.kernels.reductions import stats_combine

    g = torch.Generator().manual_seed(3)
    m, row, c = 1000, 96, 37  # 11 rows, the last of 40 elements; C not a block multiple
    x = (torch.randn(m, c, generator=g, dtype=torch.float64) * 3 + 1000)
    parts = list(x.split(row))
    mean_p = torch.stack([p.mean(0) for p in parts]).to(DEVICE, part_dtype)
    m2_p = torch.stack([((p - p.mean(0)) ** 2).sum(0) for p in parts]).to(DEVICE, part_dtype)
    mean, var = stats_combine(mean_p, m2_p, m, row, torch.float64)
    counts = torch.tensor([len(p) for p in parts], dtype=torch.float64).view(-1, 1)
    mp, m2 = mean_p.double().cpu(), m2_p.double().cpu()
    ref_mean = (counts * mp).sum(0) / m
    ref_var = (m2 + counts * (mp - ref_mean) ** 2).sum(0) / m
    assert mean.dtype == var.dtype == torch.float64
    assert torch.allclose(mean.cpu(), ref_mean, rtol=1e-14, atol=0)
    assert torch.allclose(var.cpu(), ref_var, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="row_elems"):
        stats_combine(mean_p, m2_p, m + row, row, torch.float64)


def _prepare(x, route, running_dtype, training, momentum, tracked, given, counted=True):
    """fusedres.functional.prepare_batch_norm on the triton backend with the one-launch route
    (``route``) or without it (the PyTorch ops): (mean, invstd, running mean, running var,
    num_batches_tracked, the kernels launched)."""
    from fusedres import functional as FR
    from fusedres.ops import _backend as routes

    c = x.shape[1]
    g = torch.Generator().manual_seed(1)
    rm = torch.randn(c, generator=g).to(DEVICE, running_dtype) if tracked else None
    rv = (torch.rand(c, generator=g) + 0.5).to(DEVICE, running_dtype) if tracked else None
    nbt = torch.tensor(3, device=DEVICE) if tracked and counted else None
    stats = (x.float().mean((0, 2, 3)), x.float().var((0, 2, 3), unbiased=False)) if given \
        else None
    launched = []
    from triton.runtime.interpreter import InterpretedFunction

    real, eager = InterpretedFunction.run, routes.TABLE.get("triton")

    def recording(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return real(kernel, *args, **kwargs)

    InterpretedFunction.run = recording  # every launch of the interpreter goes through it
    if not route:
        routes.TABLE["triton"] = routes.load("triton")._replace(prepare_batch_norm=None)
    try:
        with fusedres.use_backend("triton"):
            st = FR.prepare_batch_norm(x, None, None, rm, rv, nbt, training=training,
                                       momentum=momentum, eps=1e-5, stats=stats)
    finally:
        InterpretedFunction.run = real
        if eager is None:
            routes.TABLE.pop("triton", None)
        else:
            routes.TABLE["triton"] = eager
    return st.mean, st.invstd, rm, rv, nbt, launched


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("running_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("training,momentum", [(True, 0.1), (True, None), (False, 0.1)])
def test_bn_prepare_is_the_pytorch_rule_in_one_launch(x_dtype, running_dtype, training,
                                                      momentum):
    """The triton backend's BatchNorm preparation (batch_stats_kernel in its PREPARE mode, or
    bn_prepare_kernel for given or running statistics) against fusedres.functional's
    PyTorch ops: the same mean, invstd, running statistics and step count, bit for bit under
    the interpreter (the kernel rounds each product and sum to the running statistics' dtype,
    in the rule's order), with and without running statistics and given statistics."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 70, 5, 5, generator=g) * 3 + 2).to(DEVICE, x_dtype)
    for tracked in (True, False):
        for given in (False, True):
            *new, launched = _prepare(x, True, running_dtype, training, momentum, tracked,
                                      given)
            *old, _ = _prepare(x, False, running_dtype, training, momentum, tracked, given)
            for name, a, b in zip(("mean", "invstd", "running_mean", "running_var",
                                   "num_batches_tracked"), new, old):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b), (name, tracked, given)
            merges = (training or not tracked) and not given
            assert launched == (["batch_stats_kernel"] if merges else ["bn_prepare_kernel"])
    if training:  # the update happened: the running statistics moved, the step was counted
        *_, rm, rv, nbt, _ = _prepare(x, True, running_dtype, training, momentum, True, False)
        assert int(nbt) == 4
        *_, rm0, rv0, _, _ = _prepare(x, True, running_dtype, False, momentum, True, False)
        assert not torch.equal(rm, rm0) and not torch.equal(rv, rv0)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_bn_prepare_merges_in_the_last_program_of_each_channel_block(momentum):
    """The one-launch preparation split over several programs a channel block (the GPU's
    case; the interpreter's rule is one): the last program to arrive merges the block's rows,
    whichever it is, and sets the count back to zero for the next launch; results equal to one
    program a block's (the float64 merge is exact to the float32 results here) and to
    nn.BatchNorm2d's running statistics."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 40, 20, 20, generator=g) * 3 + 2).to(DEVICE)  # 13 row tiles
    gamma, beta = torch.rand(40, generator=g).to(DEVICE), torch.randn(40, generator=g).to(DEVICE)
    results = {}
    for split in (1, 3, 13):
        rm, rv = torch.zeros(40, device=DEVICE), torch.ones(40, device=DEVICE)
        nbt = torch.tensor(0, device=DEVICE)
        plan = bs.PreparePlan(x, rm, rv, True, True, momentum, 1e-5, False, gamma, beta, True,
                              split=split)
        assert plan.launch.grid == (2, split)  # two channel blocks of 32
        for _ in range(2):  # the counts went back to zero: the second launch merges too
            out = plan.run(x, rm, rv, nbt, gamma=gamma, beta=beta)
            assert plan.arrivals.tolist() == [0, 0]
        results[split] = (*out, rm, rv, nbt)
    for split in (3, 13):
        for a, b in zip(results[1], results[split]):
            assert torch.equal(a, b), split
    bn = torch.nn.BatchNorm2d(40, momentum=momentum).to(DEVICE).train()
    bn(x), bn(x)
    mean, invstd, scale, shift, rm, rv, nbt = results[13]
    torch.testing.assert_close(rm, bn.running_mean)
    torch.testing.assert_close(rv, bn.running_var)
    assert int(nbt) == 2
    torch.testing.assert_close(scale, gamma * invstd)
    torch.testing.assert_close(shift, beta - mean * scale)


def test_genstats_rows_merged_by_the_last_row_tile():
    """The forward's genstats epilogue on plain tensors: the last row tile of each column tile
    to finish merges the rows (the count back to zero, so a second launch merges too), equal
    to stats_combine's merge of the same rows (the traced graph's launch) and to y's own
    statistics."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 20, 20, generator=g).to(DEVICE)
    w = torch.randn(48, 8, 3, 3, generator=g).to(DEVICE)
    scale, shift = torch.rand(8).to(DEVICE), torch.randn(8).to(DEVICE)
    geometry = ((1, 1), (1, 1), (1, 1))
    merged = fwd.ForwardPlan(x, w, None, scale, shift, None, *geometry, None, True, None, None)
    assert merged.merge and merged.combine is None
    assert merged.launch.grid[0] > 2 * merged.arrivals.numel() > 2  # rows and column tiles
    combined = fwd.ForwardPlan(x, w, None, scale, shift, None, *geometry, None, True, None,
                               None, merge=False)
    assert combined.combine is not None
    for _ in range(2):
        y, mean, var = merged.run(x, w, scale, shift, None, None, None)
        assert merged.arrivals.tolist() == [0] * merged.arrivals.numel()
    y2, mean2, var2 = combined.run(x, w, scale, shift, None, None, None)
    assert torch.equal(y, y2) and torch.equal(mean, mean2) and torch.equal(var, var2)
    torch.testing.assert_close(mean, y.mean((0, 2, 3)))
    torch.testing.assert_close(var, y.var((0, 2, 3), unbiased=False))


def test_bn_prepare_bumps_versions_and_leaves_what_it_cannot_take():
    """The in-kernel updates count as in-place writes (version counters, as mul_/add_ do);
    float64 x, bfloat16 running statistics and a batch past int32 offsets stay with the
    PyTorch ops (``prepares``)."""
    x = torch.randn(4, 6, 3, 3, device=DEVICE)
    rm, rv = torch.zeros(6, device=DEVICE), torch.ones(6, device=DEVICE)
    nbt = torch.tensor(0, device=DEVICE)
    versions = (rm._version, rv._version, nbt._version)
    triton_backend.prepare_batch_norm(x, rm, rv, nbt, True, 0.1, 1e-5)
    assert (rm._version, rv._version, nbt._version) > versions
    assert all(a > b for a, b in zip((rm._version, rv._version, nbt._version), versions))
    assert triton_backend.prepares(x, rm, rv, True)
    assert not triton_backend.prepares(x.double(), rm.double(), rv.double(), True)
    assert not triton_backend.prepares(x, rm.bfloat16(), rv.bfloat16(), True)
    assert triton_backend.prepares(x, rm.bfloat16(), rv.bfloat16(), False)  # eval: read only
    strided = torch.zeros(12, device=DEVICE)[::2]
    assert not triton_backend.prepares(x, strided, rv, True)
    # Given statistics of any strides are read as they are.
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    gm, gv = torch.zeros(12, device=DEVICE), torch.zeros(12, device=DEVICE)
    gm[::2], gv[::2] = mean, var
    _, invstd = triton_backend.prepare_batch_norm(x, None, None, None, True, 0.1, 1e-5,
                                                  gm[::2], gv[::2])
    assert torch.allclose(invstd, torch.rsqrt(var + 1e-5))
    with pytest.raises(ValueError, match="running_mean, running_var"):
        bs.prepare_batch_norm(x, rm.double(), rv.double(), nbt, True, 0.1, 1e-5)


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, True), (False, False)])
def test_scale_shift_kernel_equals_the_host_expression(affine):
    """Bit for bit fusedres.ops.opdefs.scale_shift (the same operations in the same dtype)."""
    from fusedres.kernels.reductions import scale_shift
    from fusedres.ops.opdefs import UnitArgs
    from fusedres.ops.opdefs import scale_shift as host_scale_shift

    g = torch.Generator().manual_seed(4)
    c = 300  # two blocks of 256, the second partial
    vec = [torch.randn(c, generator=g).to(DEVICE) for _ in range(4)]
    bn = UnitArgs(x=None, weight=None, bias=None, bn_weight=vec[0] if affine[0] else None,
                  bn_bias=vec[1] if affine[1] else None, mean=vec[2], invstd=vec[3].abs(),
                  residual=None, batch_stats=True, stride=[1, 1], padding=[0, 0],
                  dilation=[1, 1])
    for got, exp in zip(scale_shift(bn), host_scale_shift(bn)):
        assert got.is_contiguous() and got.dtype == exp.dtype
        assert torch.equal(got, exp)


def test_partials_reduce_writes_every_part_in_one_launch():
    """Weight-gradient partials into a channels_last destination, bias partials, and the
    BatchNorm sums with their means over M, against torch's sums over the splits."""
    from fusedres.kernels.reductions import reduce_partials

    g = torch.Generator().manual_seed(5)
    split, co, c, k, rows, m = 3, 5, 70, 3, 19, 123  # K = 3150: 4 programs of 1024
    dw_p = torch.randn(split, co, c, k, k, generator=g).to(DEVICE)
    db_p = torch.randn(split, co, generator=g).to(DEVICE)
    s1, s2 = (torch.randn(rows, c, generator=g).to(DEVICE) for _ in range(2))
    dw = torch.empty(co, c, k, k, device=DEVICE).contiguous(memory_format=torch.channels_last)
    db = torch.empty(co, device=DEVICE)
    sums = (torch.empty(c, device=DEVICE, dtype=torch.float64), torch.empty(c, device=DEVICE))
    means = (torch.empty(c, device=DEVICE), torch.empty(c, device=DEVICE))
    reduce_partials(dw_p=dw_p, dw=dw, db_p=db_p, db=db, s1_p=s1, s2_p=s2, sums=sums,
                    means=means, m=m)
    assert torch.allclose(dw, dw_p.sum(0), rtol=1e-6, atol=1e-6)
    assert torch.allclose(db, db_p.sum(0), rtol=1e-6, atol=1e-6)
    for got, part in zip(sums, (s1, s2)):
        assert torch.allclose(got.float(), part.sum(0), rtol=1e-5, atol=1e-5)
    for got, part in zip(means, (s1, s2)):
        assert torch.allclose(got, part.sum(0) / m, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no partials"):
        reduce_partials()


# --------------------------------------------------------------------------- 16-bit ReLU window

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusedres.kernels._tl import relu_window  # noqa: E402


@triton.jit
def _window_kernel(sc_ptr, sh_ptr, lo_ptr, hi_ptr, XT: tl.constexpr, INTERP_BF16: tl.constexpr,
                   BLOCK: tl.constexpr):
    k = tl.arange(0, BLOCK)
    lo, hi = relu_window(tl.load(sc_ptr + k), tl.load(sh_ptr + k), XT, INTERP_BF16)
    tl.store(lo_ptr + k, lo)
    tl.store(hi_ptr + k, hi)


@pytest.mark.parametrize("dtype", HALF)
def test_relu_window_matches_the_fma_sign_on_every_16bit_value(dtype):
    """For every 16-bit x (all 65,536 bit patterns, NaN and +-inf among them) and (scale, shift)
    pairs of both signs, zero scales, thresholds on and off the grid, past its range and at
    +-0: ``not x <= lo and not x >= hi`` equals the ReLU's "on" (scale * x + shift > 0 in exact
    arithmetic, NaN on), but for x within float32 rounding of the threshold."""
    g = torch.Generator().manual_seed(3)
    sc = torch.cat([torch.randn(40, generator=g) * 3, torch.tensor([
        1.0, -1.0, 0.0, 0.0, 2.0, -0.5, 1e-3, -1e-3, 1.0, 1.0, 3.0, -3.0, 1e-6, 1.0, 1.0, 1.0,
        2.0, 0.25, -4.0, 1.5, 1.0, -1.0, 5.0, 1.0])])
    sh = torch.cat([torch.randn(40, generator=g) * 2, torch.tensor([
        -1.0, 1.0, 1.0, -1.0, -1.0, 0.25, 100.0, 100.0, 0.0, -0.0, 1e5, 1e5, -1.0, -65504.0,
        65504.0, 7.0 / 3.0, -3.0, 0.1, -1.0, -1.5, -1e-30, 1e-30, -4.0, 2.5])])
    sc, sh = sc.float(), sh.float()
    lo = torch.empty(64, dtype=dtype)
    hi = torch.empty_like(lo)
    xt = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    _window_kernel[(1,)](sc, sh, lo, hi, XT=xt, INTERP_BF16=dtype == torch.bfloat16, BLOCK=64)
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    xd, lod, hid = x.double(), lo.double(), hi.double()
    window = ~(xd[:, None] <= lod[None, :]) & ~(xd[:, None] >= hid[None, :])
    exact = xd[:, None] * sc.double()[None, :] + sh.double()[None, :]
    on = ~(exact <= 0)
    on[torch.isnan(xd)] = True  # NaN x passes the ReLU as torch's does
    wrong = window != on
    # scale 0 and an infinite x: 0 * inf is NaN in float32 (on), the window says off; the
    # forward's output is NaN there already.
    wrong &= ~(torch.isinf(xd)[:, None] & (sc[None, :] == 0))
    slack = exact.abs() <= 2.0 ** -20 * torch.maximum(sh.double().abs()[None, :],
                                                    (xd[:, None] * sc.double()[None, :]).abs())
    assert not (wrong & ~slack).any(), (wrong & ~slack).nonzero()[:5]
    assert wrong.sum() <= 2


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("dtype", HALF)
def test_wgrad_sums_16bit_window_path(dtype, layout):
    """The 16-bit SUMS operands (the ReLU mask from the window, m * x exact, G2 = invstd * (G3 -
    mean * G1) after the loop) against float64: gammas of both signs and zero (beta either
    sign), an input whose mean is three standard deviations, split and unsplit, a grad_out
    dense (channels_last) or strided (NCHW)."""
    cl = layout == "channels_last"
    x, wt, gamma, beta, mean, invstd = _backward_inputs(dtype, cl, co=17, c=6)
    x = (x.float() + 3 * x.float().std()).to(dtype)
    mean, var = bs.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    gamma = gamma * torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -2.0], device=DEVICE)
    beta = beta.abs() * torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0], device=DEVICE)
    scale, shift = _scale_shift(gamma, beta, mean, invstd)
    dy = torch.randn(2, 17, 7, 9).to(DEVICE, dtype)
    if cl:
        dy = dy.contiguous(memory_format=torch.channels_last)
    ref = _portable64(dy, x, wt, gamma, beta, mean, invstd, (1, 1), (1, 1), (1, 1), True)
    tol = TOL[dtype] * 4
    for split in (1, 3):
        gw, _, sums = wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, (1, 1), (1, 1), (1, 1),
                                              want_bias=False, bn_affine=(gamma, beta),
                                              mean=mean, invstd=invstd, split=split)
        assert rel_err(gw, ref[1]) < tol, split
        assert rel_err(sums[0], ref[4]) < tol and rel_err(sums[1], ref[3]) < tol, split


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sums", [True, False])
def test_wgrad_taps_form_matches_per_tap_form(dtype, sums):
    """The taps form (one program: every tap of a channel block, GEMM rows (tap, co), the
    reduction over the input pixels, dy gathered per tap) is what a unit-stride 3x3 with few
    channels and no bias runs, and agrees with float64 and with the per-tap form: padding 0,
    1 and 2 (outputs smaller, equal and larger than the input), a dilation, a branch scale,
    odd channel counts, NCHW and channels_last, split and unsplit."""
    assert wg.use_taps(6, 5, 3, 3, (1, 1), want_bias=False)
    assert not wg.use_taps(6, 5, 3, 3, (2, 2), want_bias=False)
    assert not wg.use_taps(6, 5, 3, 3, (1, 1), want_bias=True)
    assert not wg.use_taps(6, 5, 1, 1, (1, 1), want_bias=False)
    assert wg.taps_of(wg.pick_config(6, 5, dtype, sums=sums, taps=True)) > 1
    assert wg.taps_of(wg.pick_config(6, 5, dtype, sums=sums, interpret=False, taps=True)) > 1
    tol = TOL[dtype] * (4 if dtype in HALF else 1)
    # (h, w) = (4, 8): every K-step whole image rows (the ROWS specialisation), else carries.
    bk = wg.INTERPRET_TAPS_CONFIG.meta["BLOCK_K"]
    assert wg.whole_rows(4, 8, bk) and not wg.whole_rows(7, 9, bk)
    cases = [((1, 1), (1, 1), False, 1, (7, 9)), ((0, 0), (1, 1), True, 3, (7, 9)),
             ((2, 1), (2, 1), False, 2, (7, 9)), ((2, 2), (1, 1), True, 1, (7, 9)),
             ((1, 1), (1, 1), True, 1, (4, 8)), ((1, 0), (1, 1), False, 3, (4, 8))]
    for padding, dilation, cl, split, (h, w) in cases:
        x, wt, gamma, beta = make(n=2, c=6, h=h, w=w, co=17, k=3, dtype=dtype, channels_last=cl)
        mean, var = bs.batch_stats(x)
        invstd = torch.rsqrt(var + 1e-5)
        scale, shift = _scale_shift(gamma, beta, mean, invstd)
        ho = h + 2 * padding[0] - 2 * dilation[0]
        wo = w + 2 * padding[1] - 2 * dilation[1]
        dy = torch.randn(2, 17, ho, wo).to(DEVICE, dtype)
        if cl:
            dy = dy.contiguous(memory_format=torch.channels_last)
        bsc = torch.tensor([0.0, 2.0], device=DEVICE, dtype=torch.float64 if dtype ==
                           torch.float64 else torch.float32) if split == 3 else None
        dys = dy if bsc is None else (dy.double() * bsc.double()[:, None, None, None])
        ref = _portable64(dys, x, wt, gamma, beta, mean, invstd, (1, 1), padding, dilation,
                          True)
        kw = dict(want_bias=False, bn_affine=(gamma, beta) if sums else None, mean=mean,
                  invstd=invstd, split=split, branch_scale=bsc)
        tiles = wg.named_configs(dtype, sums)
        for cfg in (None, tiles["taps"], tiles["taps_wide"], tiles["mid"]):
            out = torch.empty_like(wt) if split == 1 else None  # unsplit: written in place
            gw, gb, s = wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, (1, 1), padding,
                                                dilation, config=cfg, out=out, **kw)
            what = (str(cfg), padding, dilation, cl, split, h, w)
            assert gb is None and (out is None or gw is out)
            assert rel_err(gw, ref[1]) < tol, what
            if sums:
                assert rel_err(s[0], ref[4]) < tol and rel_err(s[1], ref[3]) < tol, what
    with pytest.raises(ValueError, match="taps form"):
        wg.bn_relu_conv2d_wgrad(dy, x, wt, scale, shift, (2, 2), (1, 1), (1, 1),
                                want_bias=False, config=wg.configs_for(dtype, sums)[-1])


# --------------------------------------------------------------------------- TF32 rounding

from fusedres.kernels._tl import round_tf32  # noqa: E402


@triton.jit
def _round_tf32_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    k = tl.arange(0, BLOCK)
    tl.store(y_ptr + k, round_tf32(tl.load(x_ptr + k)))


def _tf32_oracle(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest value with 10 mantissa bits (ties away from zero), by frexp in
    float64: independent of the kernel's bit trick."""
    d = x.double()
    m, e = torch.frexp(d)  # d = m * 2**e, 0.5 <= |m| < 1
    q = torch.sign(m) * torch.floor(m.abs() * 2.0**11 + 0.5)
    # float32 subnormals keep their absolute grid: 13 bits below their last bit are 2**-136.
    r = torch.where(e < -125, torch.sign(d) * torch.floor(d.abs() * 2.0**136 + 0.5) / 2.0**136,
                    torch.ldexp(q / 2.0**11, e))
    return torch.where(torch.isfinite(d), torch.copysign(r, d), d).float()


def test_round_tf32_rounds_to_nearest_ties_away():
    """The TF32 dots' operand rounding (kernels/_tl.round_tf32): against a frexp oracle on
    random values of every magnitude, exact ties, the largest float32 (-> inf), subnormals,
    +-0, +-inf and NaNs of every payload (each stays NaN)."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(200, generator=g) * torch.exp2(torch.randint(-60, 60, (200,), generator=g))
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 3.0 * (1 + 2**-11)])
    edge = torch.tensor([3.4028235e38, -3.4028235e38, 1e-40, -3e-42, 1.4e-45, 0.0, -0.0,
                         float("inf"), float("-inf"), float("nan"), 1 + 2**-12, 1 - 2**-13])
    # NaNs of every payload: the GPU's canonical 0x7FFFFFFF would carry into the sign bit.
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, 0x7FFFF000],
                        dtype=torch.int32).view(torch.float32)
    x = torch.cat([rand, ties, edge, nans]).float()
    x = torch.cat([x, x.new_zeros(256 - x.numel())])
    y = torch.empty_like(x)
    _round_tf32_kernel[(1,)](x, y, BLOCK=256)
    want = _tf32_oracle(x)
    assert torch.equal(y.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(y[ok], want[ok]), (x[ok][y[ok] != want[ok]], y[ok][y[ok] != want[ok]])
    assert torch.equal(torch.signbit(y[ok]), torch.signbit(want[ok]))
    assert y[len(rand)].item() == 1 + 2**-10  # a tie rounds away from zero
    assert y[len(rand) + len(ties)].item() == float("inf")


def test_tf32_dots_round_both_operands(monkeypatch):
    """With TF32 on (torch's default for fp32 convolutions on a GPU) each dot rounds its fp32
    operands to TF32 first (the tensor cores would truncate them). The interpreter's dot is an
    exact fp32 product, so forcing the TF32 path here shows it: the output is the convolution
    of the rounded BN-ReLU activation and rounded weight, not of the unrounded ones."""
    x, wt, gamma, beta = make(n=2, c=24, h=9, w=9, co=16, k=3)
    mean, var = bs.batch_stats(x)
    scale, shift = _scale_shift(gamma, beta, mean, torch.rsqrt(var + 1e-5))
    monkeypatch.setattr(fwd, "allow_tf32", lambda dtype: dtype == torch.float32)
    y = fwd.bn_relu_conv2d_fwd(x, wt, None, scale, shift, None, (1, 1), (1, 1), (1, 1),
                               torch.contiguous_format).double()
    a = torch.relu(x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1))
    rounded = F.conv2d(_tf32_oracle(a).double(), _tf32_oracle(wt).double(), None, 1, 1)
    exact = F.conv2d(a.double(), wt.double(), None, 1, 1)
    err_rounded = (y - rounded).abs().mean().item()
    err_exact = (y - exact).abs().mean().item()
    assert err_rounded * 20 < err_exact, (err_rounded, err_exact)


# --------------------------------------------------------------------------- launch plans

def _step_launches(monkeypatch, strategy):
    """(kernel function, args, kwargs) of every launch of one training step of a unit on the
    eager route (a 3x3 unit, then a strided 1x1 with a residual and a branch scale)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    real = InterpretedFunction.run

    def recording(kernel, *args, grid=None, warmup=False, **kwargs):
        launches.append((kernel.fn, args, kwargs))
        return real(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", strategy)
    torch.manual_seed(0)
    with fusedres.use_backend("triton"):
        m = fusedres.BNReLUConv2d(5, 6, 3, padding=1)
        x = torch.randn(2, 5, 6, 6, requires_grad=True)
        m(x).sum().backward()
        block = fusedres.modules.BasicBlock(5, 7, stride=2, drop_path=0.5)
        block(torch.randn(3, 5, 6, 6, requires_grad=True)).sum().backward()
    return launches


@pytest.mark.parametrize("strategy", ["sums", "store"])
def test_plan_launch_arguments_are_the_binders(monkeypatch, strategy):
    """Every launch of a step, as a plan passes it (runtime arguments positionally, constexprs
    and options by name), bound by Triton's own binder for an sm_90 target: the values it
    hands the compiled launcher are the runtime arguments then ``launch_tail``'s constexprs,
    in that order: what the direct launch (kernels._common._direct) passes on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from fusedres.kernels._common import launch_tail

    backend = make_backend(GPUTarget("cuda", 90, 32))
    launches = _step_launches(monkeypatch, strategy)
    names = {fn.__name__ for fn, _, _ in launches}
    assert {"batch_stats_kernel", "bn_prepare_kernel", "bn_relu_conv2d_fwd_kernel",
            "wgrad_kernel", "dgrad_kernel"} <= names, names
    for fn, args, kwargs in launches:
        jit = JITFunction(fn)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, _, options = binder(*args, **kwargs)
        assert list(bound.values()) == [*args, *launch_tail(fn, len(args), kwargs)], fn.__name__
        assert set(options) <= {"num_warps", "num_stages"}


def test_direct_launch_calls_the_compiled_launcher(monkeypatch):
    """After the JIT's first launch, a plan's launch goes to the compiled kernel's launcher:
    grid, the current stream of the device, function, packed metadata, no launch metadata, the
    hooks, then the runtime arguments and the constexprs; under a dispatch mode (a trace over
    real tensors) it takes the JIT's launch again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusedres.kernels import _common
    from fusedres.kernels.reductions import stats_combine_kernel as kernel

    calls, jit_calls = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            calls.append(args)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device)
    go = _common._direct(getattr(kernel, "fn", kernel), Compiled(), (3,), 8,
                         {"BLOCK_R": 16, "BLOCK_C": 64, "num_warps": 4, "num_stages": 1}, 2,
                         lambda *a: jit_calls.append(a))
    args = (torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), 1, 4, 16, 16)
    go(*args)
    (got,) = calls
    assert got[:7] == (3, 1, 1, 1002, "fn", "meta", None)
    assert got[9:] == (*args, 16, 64)
    with TorchDispatchMode():
        go(*args)
    assert len(calls) == 1 and len(jit_calls) == 1


@pytest.mark.parametrize("bias", [False, True])
def test_store_strategy_reduces_once(monkeypatch, bias):
    """The "store" backward with the weight gradient split over 3 programs (as on a GPU; 1
    under the interpreter otherwise): the split partials, the bias gradient's and the
    BatchNorm sums are summed by ONE reduction launch, between the data-gradient pass and dx;
    every gradient as the "sums" strategy's, which reduces in its own launch."""
    from triton.runtime.interpreter import InterpretedFunction

    from fusedres.kernels import bn_relu_conv2d_wgrad as wg

    real_pick = wg.pick_config
    monkeypatch.setattr(wg, "pick_split", lambda *a, **k: 3)
    monkeypatch.setattr(wg, "interpreting", lambda: False)
    monkeypatch.setattr(wg, "pick_config", lambda *a, **k: real_pick(*a, **{**k,
                                                                          "interpret": True}))
    launched = []
    real_run = InterpretedFunction.run

    def recording(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return real_run(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    grads = {}
    for strategy in ("sums", "store"):
        monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", strategy)
        torch.manual_seed(0)
        m = fusedres.BNReLUConv2d(6, 5, 3, padding=1, bias=bias)
        x = torch.randn(3, 6, 7, 7, requires_grad=True)
        with fusedres.use_backend("triton"):
            y = m(x)
            launched.clear()
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        grads[strategy] = [x.grad] + [p.grad for p in m.parameters()]
        if strategy == "store":
            assert launched == ["wgrad_kernel", "dgrad_kernel", "partials_reduce_kernel",
                                "dx_kernel"], launched
        else:
            assert launched == ["wgrad_kernel", "partials_reduce_kernel", "dgrad_kernel"]
    assert [p.split for p in wg._PLANS.values()] == [3, 3]  # sums, store: split as asked
    for a, b in zip(grads["sums"], grads["store"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
