"""The fused op against the plain-PyTorch reference, on every backend that runs here."""

import pytest
import torch

import fusedres
from fusedres import functional as FR
from helpers import (
    CASES,
    Case,
    Inputs,
    assert_autocast_close,
    assert_within_twice_torch,
    make_inputs,
    run,
    run_reference,
    run_with_grads,
)

# (atol, rtol) per dtype, from measured error against the reference (fp32: ~1e-6 relative).
TOL = {torch.float32: (2e-4, 2e-4), torch.float64: (1e-9, 1e-9)}
GRAD_NAMES = ["x", "weight", "bias", "bn_weight", "bn_bias", "residual"]


def _names(inp):
    return [n for n in GRAD_NAMES if getattr(inp, n) is not None]


def assert_close(actual, expected, dtype, what):
    atol, rtol = TOL[dtype]
    # Scale atol by the tensor's magnitude: gradients of sums over N*H*W grow with the count.
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_reference(backend, case, dtype, channels_last, training):
    inp = make_inputs(case, dtype, channels_last=channels_last)
    ref = inp.clone()
    y, grads, gy = run_with_grads(case, inp, training=training)
    y_ref, grads_ref, _ = run_reference(case, ref, gy, training=training)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert_close(y, y_ref, dtype, "output")
    for name, g, g_ref in zip(_names(inp), grads, grads_ref):
        assert_close(g, g_ref, dtype, f"grad of {name}")
    assert_close(inp.running_mean, ref.running_mean, dtype, "running_mean")
    assert_close(inp.running_var, ref.running_var, dtype, "running_var")
    assert int(inp.num_batches_tracked) == int(ref.num_batches_tracked) == int(training)
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("momentum", [0.1, 0.5, None], ids=["m0.1", "m0.5", "cumulative"])
def test_running_stats_over_steps(backend, momentum):
    case = CASES[0]
    inp = make_inputs(case)
    ref = inp.clone()
    for step in range(4):
        x = torch.randn_like(inp.x) * (step + 1) + step
        for i in (inp, ref):
            i.x = x.clone().requires_grad_()
        run(case, inp, training=True, momentum=momentum)
        with fusedres.use_backend("reference"):
            run(case, ref, training=True, momentum=momentum)
    assert int(inp.num_batches_tracked) == int(ref.num_batches_tracked) == 4
    torch.testing.assert_close(inp.running_mean, ref.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inp.running_var, ref.running_var, atol=1e-5, rtol=1e-5)
    # Eval then uses them.
    y, grads, gy = run_with_grads(case, inp, training=False)
    y_ref, grads_ref, _ = run_reference(case, ref, gy, training=False)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_no_running_stats_uses_batch_stats_in_eval(backend):
    """track_running_stats=False: batch statistics in train and eval alike, as nn.BatchNorm2d."""
    case = CASES[2]
    for training in (True, False):
        inp = make_inputs(case)
        inp.running_mean = inp.running_var = inp.num_batches_tracked = None
        ref = inp.clone()
        y, grads, gy = run_with_grads(case, inp, training=training)
        y_ref, grads_ref, _ = run_reference(case, ref, gy, training=training)
        torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradcheck_float64(backend, training):
    case = Case(2, 3, 5, 6, 2, k=3, stride=2, padding=1, bias=True, residual=True)
    inp = make_inputs(case, torch.float64)

    def fn(x, weight, bias, bn_weight, bn_bias, residual):
        # No running stats in training: gradcheck calls this many times.
        rm = None if training else inp.running_mean
        rv = None if training else inp.running_var
        return FR.bn_relu_conv2d(x, weight, bias, bn_weight, bn_bias, rm, rv, training=training,
                                 stride=case.stride, padding=case.padding, residual=residual)

    assert torch.autograd.gradcheck(fn, tuple(inp.leaves()), fast_mode=True)


def test_batch_stats_are_stable_for_large_mean(backend):
    """x = 1000 + noise in float32: naive E[x^2] - E[x]^2 loses every digit of the variance."""
    x = 1000 + torch.randn(4, 3, 64, 64)
    mean, var = torch.ops.fusedres.batch_stats(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean.double(), mean64, atol=1e-4, rtol=0)
    torch.testing.assert_close(var.double(), var64, atol=0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_within_twice_torch_error(backend, dtype):
    """Half precision: the fused unit's error against a float64 reference is at most twice the
    error of PyTorch's own plain block at that dtype (plus a floor for exact zeros)."""
    case = Case(2, 16, 8, 8, 16, k=3, padding=1, residual=True)
    inp = make_inputs(case, dtype)
    exact = inp.float64()
    torch_half = inp.clone()
    y, grads, gy = run_with_grads(case, inp, training=True)
    y64, grads64, _ = run_reference(case, exact, gy.double(), training=True)
    yt, grads_t, _ = run_reference(case, torch_half, gy, training=True)
    assert y.dtype == dtype
    assert_within_twice_torch(["output"] + _names(inp), [y, *grads], [yt, *grads_t],
                              [y64, *grads64])


def test_autocast_bf16_matches_plain_block(backend):
    """Under autocast the BN runs in float32, the conv in bfloat16, and a float32 residual is
    added in float32 (type promotion), as in the plain block."""
    case = Case(2, 8, 9, 9, 12, k=3, padding=1, bias=True, residual=True)
    inp = make_inputs(case, torch.float32)
    ref = inp.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads, gy = run_with_grads(case, inp, training=True)
        y_ref, grads_ref, _ = run_reference(case, ref, gy, training=True)
    assert_autocast_close(_names(inp), y, grads, y_ref, grads_ref)
    torch.testing.assert_close(inp.running_mean, ref.running_mean)
    # A bfloat16 residual keeps the output in bfloat16.
    inp2 = make_inputs(case, torch.float32)
    inp2.residual = inp2.residual.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run(case, inp2, training=True).dtype == torch.bfloat16


def test_empty_batch_as_batchnorm(backend):
    """N=0: an empty output, num_batches_tracked counts it, running statistics unchanged."""
    case = Case(0, 3, 5, 5, 4, k=3, padding=1, bias=True)
    inp = make_inputs(case)
    ref = inp.clone()
    y, grads, gy = run_with_grads(case, inp, training=True)
    y_ref, grads_ref, _ = run_reference(case, ref, gy, training=True)
    assert y.shape == y_ref.shape == (0, 4, 5, 5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)
    assert torch.equal(inp.running_mean, ref.running_mean)
    assert torch.equal(inp.running_var, ref.running_var)
    assert int(inp.num_batches_tracked) == int(ref.num_batches_tracked) == 1


def test_autocast_leaves_float64_alone(backend):
    """Autocast never casts float64: a float64 unit stays float64, as the plain one does."""
    case = CASES[0]
    inp = make_inputs(case, torch.float64)
    ref = inp.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(case, inp, training=True)
        with fusedres.use_backend("reference"):
            y_ref = run(case, ref, training=True)
    assert y.dtype == y_ref.dtype == torch.float64
    torch.testing.assert_close(y, y_ref)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_and_inf_propagate_as_in_pytorch(backend, value):
    case = CASES[0]
    inp = make_inputs(case)
    with torch.no_grad():
        inp.x[0, 1, 2, 3] = value
    ref = inp.clone()
    y = run(case, inp, training=True)
    with fusedres.use_backend("reference"):
        y_ref = run(case, ref, training=True)
    assert torch.equal(y.isnan(), y_ref.isnan())
    assert torch.equal(y.isinf(), y_ref.isinf())
    assert torch.equal(inp.running_mean.isnan(), ref.running_mean.isnan())


# The regime of an ImageNet-style network's last stages at small input (issue 38): few pixels a
# channel (batch 8 of 1x1 and 2x2 maps), activations whose channel means are large against their
# spread, and the other end, long reductions (tens of thousands of pixels a channel).
REGIME = {
    "1px": (Case(8, 64, 1, 1, 48, k=1, residual=True), 0.0),
    "1px_mean": (Case(8, 64, 1, 1, 48, k=3, padding=1, bias=True), 30.0),
    "4px_mean": (Case(8, 32, 2, 2, 40, k=3, padding=1, residual=True), 30.0),
    "4px_s2": (Case(8, 32, 2, 2, 24, k=1, stride=2), 10.0),
    "long": (Case(4, 3, 80, 96, 4, k=3, padding=1), 5.0),
}


def _regime_inputs(case: Case, mean_spread: float, dtype) -> Inputs:
    """Inputs of ``case`` whose channels sit at means drawn with spread ``mean_spread`` (in units
    of their own standard deviation), no BN output nearer the ReLU's threshold than 1e-3 of
    its spread. A pre-activation that float32 rounding could move across zero flips one ReLU
    decision and changes the gradients by far more than any summation error (a float64 network
    perturbed by 1e-7 moves its gradients by up to 2e-2 at this size): accumulation is what
    is measured here, and that tie is not what it is about."""
    inp = make_inputs(case, torch.float32)
    with torch.no_grad():
        x = inp.x.double()
        x += mean_spread * x.std() * torch.randn(1, case.c, 1, 1, dtype=torch.float64)
        var, mean = torch.var_mean(x, dim=(0, 2, 3), keepdim=True, correction=0)
        scale = inp.bn_weight.double().view(1, -1, 1, 1) / (var + 1e-5).sqrt()
        z = (x - mean) * scale + inp.bn_bias.double().view(1, -1, 1, 1)
        near = z.abs() < 2e-3
        x += torch.where(near, (4e-3 * z.sign().where(z != 0, torch.ones_like(z))) / scale, 0)
        inp.x = x.to(dtype).requires_grad_()
        for name in ("weight", "bias", "bn_weight", "bn_bias", "residual"):
            t = getattr(inp, name)
            if t is not None:
                setattr(inp, name, t.detach().to(dtype).requires_grad_())
        inp.running_mean = inp.running_mean.to(dtype)
        inp.running_var = inp.running_var.to(dtype)
    return inp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("regime", list(REGIME))
def test_gradients_within_twice_torch_error_in_the_last_stages_regime(backend, regime, dtype):
    """Every gradient's error against float64 at most twice plain PyTorch's at that dtype (the
    floor: 1e-6 of the largest value in float32, 1e-3 in half precision)."""
    case, mean_spread = REGIME[regime]
    if dtype == torch.float16 and mean_spread > 10:
        mean_spread = 10.0  # float16 keeps 11 bits: x near 30 sigma has ~1.5% of its spread
    inp = _regime_inputs(case, mean_spread, dtype)
    exact = inp.float64()
    torch_own = inp.clone()
    y, grads, gy = run_with_grads(case, inp, training=True)
    y64, grads64, _ = run_reference(case, exact, gy.double(), training=True)
    yt, grads_t, _ = run_reference(case, torch_own, gy, training=True)
    floor = 1e-6 if dtype == torch.float32 else 1e-3
    for name, o, t, e in zip(["output"] + _names(inp), [y, *grads], [yt, *grads_t],
                             [y64, *grads64]):
        err = (o.double() - e).abs().max().item()
        err_torch = (t.double() - e).abs().max().item()
        assert err <= 2 * err_torch + floor * e.abs().max().item(), (
            f"{name}: error {err:.3g} vs torch {err_torch:.3g}")
