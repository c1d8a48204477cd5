"""Every tensor argument of the CUDA ops (csrc/cuda) is checked before a launch (csrc/checks.h):
a residual, bias, statistic, BatchNorm parameter, gradient or branch scale on another device, of
another dtype or shape (a (1,)-shaped bn_weight would broadcast) raises an error naming it,
instead of reaching the kernel (every op of every namespace: tests/test_op_contracts.py).
Run through the test extension (the same entry points on the CPU key): a tensor on
another device is a meta tensor, passed by redispatching to the CPU kernel (the dispatcher would
otherwise pick the meta kernel). Cost: under 2 s."""

import pytest
import torch

from fusedres.ops import _extension, opdefs

_WHY_NOT = _extension.load_cuda_on_cpu()
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None or not _extension.has_kernels("fusedres_cuda", "CPU", *opdefs.SCHEMAS),
    reason=f"no CPU copy of the CUDA kernels: {_WHY_NOT}")

OPS = torch.ops.fusedres_cuda
CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
N, C, H, W, CO = 2, 3, 5, 5, 4

# Forward arguments by name, in schema order (opdefs: x, weight, bias, bn_weight, bn_bias, mean,
# invstd, residual, stride, padding, dilation, batch_stats, branch_scale).
FWD = ["x", "weight", "bias", "bn_weight", "bn_bias", "mean", "invstd", "residual", "stride",
       "padding", "dilation", "batch_stats", "branch_scale"]
BWD = ["grad_out", "x", "weight", "bn_weight", "bn_bias", "mean", "invstd", "stride", "padding",
       "dilation", "batch_stats", "output_mask", "branch_scale"]


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "x": r(N, C, H, W), "weight": r(CO, C, 3, 3), "bias": r(CO),
        "bn_weight": torch.rand(C, generator=g).to(sdt) + 0.5,
        "bn_bias": torch.randn(C, generator=g).to(sdt),
        "mean": torch.randn(C, generator=g).to(sdt),
        "invstd": torch.rand(C, generator=g).to(sdt) + 0.5,
        "residual": r(N, CO, H, W), "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
        "batch_stats": True, "branch_scale": torch.tensor([1.0, 0.5]),
        "grad_out": r(N, CO, H, W), "output_mask": [True] * 5,
    }


def _forward(**change):
    a = {**_inputs(), **change}
    return OPS.bn_relu_conv2d.default.redispatch(CPU, *(a[k] for k in FWD))


def _backward(**change):
    a = {**_inputs(), **change}
    return OPS.bn_relu_conv2d_backward.default.redispatch(CPU, *(a[k] for k in BWD))


def _meta(name):
    return _inputs()[name].to("meta")


FORWARD_BAD = [
    ("weight", lambda: _meta("weight"),
     r"weight: expected device cpu \(the device of x\), got meta"),
    ("bias", lambda: _meta("bias"), r"bias: expected device cpu \(the device of x\), got meta"),
    ("bias", lambda: torch.zeros(CO + 1),
     r"bias: expected shape \(4,\) \(one value per output channel\), got \[5\]"),
    ("bias", lambda: torch.zeros(1, CO),
     r"bias: expected shape \(4,\) \(one value per output channel\), got \[1, 4\]"),
    ("bias", lambda: torch.zeros(CO, dtype=torch.float64), r"bias: expected dtype Float"),
    ("bn_weight", lambda: torch.ones(1),
     r"bn_weight: expected shape \(3,\) \(one value per channel of x\), got \[1\]"),
    ("bn_weight", lambda: _meta("bn_weight"), r"bn_weight: expected device cpu"),
    ("bn_bias", lambda: torch.zeros(C, dtype=torch.float16), r"bn_bias: expected dtype Float"),
    ("bn_bias", lambda: torch.zeros(1), r"bn_bias: expected shape \(3,\)"),
    ("mean", lambda: _meta("mean"), r"mean: expected device cpu"),
    ("mean", lambda: torch.zeros(1, C),
     r"mean: expected shape \(3,\) \(one value per channel of x\), got \[1, 3\]"),
    ("invstd", lambda: torch.ones(C, dtype=torch.float64), r"invstd: expected dtype Float"),
    ("invstd", lambda: _meta("invstd"), r"invstd: expected device cpu"),
    ("residual", lambda: _meta("residual"), r"residual: expected device cpu"),
    ("residual", lambda: torch.zeros(N, CO, H, W + 1), r"residual: expected shape \[2, 4, 5, 5\]"),
    ("residual", lambda: torch.zeros(N, CO, H, W, dtype=torch.float64),
     r"residual: expected dtype Float"),
    ("branch_scale", lambda: _meta("branch_scale"), r"branch_scale: expected device cpu"),
    ("branch_scale", lambda: torch.ones(N + 1),
     r"branch_scale: expected shape \(2,\) \(one factor per sample of x\)"),
]


@pytest.mark.parametrize("name,bad,message", FORWARD_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(FORWARD_BAD)])
def test_forward_rejects_a_bad_argument_by_name(name, bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _forward(**{name: bad()})
    with pytest.raises((ValueError, TypeError), match=message):  # genstats: the same entry point
        a = {**_inputs(), name: bad()}
        OPS.bn_relu_conv2d_genstats.default.redispatch(CPU, *(a[k] for k in FWD))


BACKWARD_BAD = [
    ("grad_out", lambda: _meta("grad_out"), r"grad_out: expected device cpu"),
    ("grad_out", lambda: torch.zeros(N, CO, H, W, dtype=torch.int32),
     r"grad_out: expected a floating-point tensor"),
    ("grad_out", lambda: torch.zeros(N, CO + 1, H, W), r"grad_out: expected shape \[2, 4, 5, 5\]"),
    ("bn_weight", lambda: torch.ones(1), r"bn_weight: expected shape \(3,\)"),
    ("bn_bias", lambda: _meta("bn_bias"), r"bn_bias: expected device cpu"),
    ("mean", lambda: torch.zeros(C, dtype=torch.float64), r"mean: expected dtype Float"),
    ("invstd", lambda: torch.ones(C + 1), r"invstd: expected shape \(3,\)"),
    ("weight", lambda: _meta("weight"), r"weight: expected device cpu"),
    ("branch_scale", lambda: _meta("branch_scale"), r"branch_scale: expected device cpu"),
]


@pytest.mark.parametrize("name,bad,message", BACKWARD_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BACKWARD_BAD)])
def test_backward_rejects_a_bad_argument_by_name(name, bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _backward(**{name: bad()})


def test_good_arguments_run_and_a_strided_bias_is_read_correctly():
    """The checks pass the valid call; a bias with stride 2 (the kernel reads bias[co] with unit
    stride) is made contiguous, so it gives the same y as its contiguous copy."""
    y = _forward()
    strided = torch.randn(2 * CO)[::2]
    assert not strided.is_contiguous()
    torch.testing.assert_close(_forward(bias=strided), _forward(bias=strided.contiguous()),
                               rtol=0, atol=0)
    assert y.shape == (N, CO, H, W)
    grads = _backward()
    assert [t.shape for t in grads] == [(N, C, H, W), (CO, C, 3, 3), (CO,), (C,), (C,)]
