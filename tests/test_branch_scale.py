"""The per-sample branch scale (stochastic depth / drop-path) of the fused op, on every backend.

Oracle: the plain unit followed by ``torchvision.ops.stochastic_depth(branch, p, mode="row",
training=True)`` and the residual add, with the same random draws: outputs, every gradient and
the running statistics agree. ``test_torchvision_draw_is_the_formula`` pins that torchvision's
op is ``branch * s[n]`` with ``s`` the draw of :func:`draw_branch_scale`.
"""

import pytest
import torch
from torchvision.ops import stochastic_depth

import fusedres
from fusedres import functional as FR
from fusedres.ops import reference
from helpers import Case, assert_autocast_close, assert_within_twice_torch, make_inputs

TOL = {torch.float32: (2e-4, 2e-4), torch.float64: (1e-9, 1e-9)}
GRAD_NAMES = ["x", "weight", "bias", "bn_weight", "bn_bias", "residual"]

# Every route of every backend: a 3x3 with bias (the spatial conv), a strided 1x1, a 1x1
# stride 1 on 8x8 maps (the cpu backend's batched GEMMs, NCHW, and whole-tile GEMM,
# channels_last), a 3x3 on 8x8 maps (the cpu backend's NHWC tiles of an NCHW unit: the
# transposes), an asymmetric kernel with stride (1, 2), and a unit without a residual.
CASES = [
    Case(3, 3, 7, 7, 5, k=3, padding=1, bias=True, residual=True),
    Case(3, 5, 9, 9, 7, k=1, stride=2, residual=True),
    Case(3, 6, 8, 8, 5, k=1, bias=True, residual=True),
    Case(3, 4, 8, 8, 6, k=3, padding=1, residual=True),
    Case(4, 5, 8, 8, 3, k=(3, 1), stride=(1, 2), padding=(1, 0), bias=True, residual=True),
    Case(3, 4, 7, 7, 6, k=3, padding=1, bias=True),
]
IDS = ["3x3", "1x1s2", "1x1", "3x3-8x8", "3x1s12", "nores"]


def draw_branch_scale(n: int, p: float, dtype=torch.float32) -> torch.Tensor:
    """Stochastic depth's per-sample factor, drawn exactly as torchvision draws its noise for a
    (n, ...) input of ``dtype`` under the current generator state: Bernoulli(1 - p) / (1 - p)."""
    survival = 1.0 - p
    noise = torch.empty((n, 1, 1, 1), dtype=dtype).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return noise.view(n)


def mixed_seed(n: int, p: float) -> int:
    """The first seed whose draw drops some samples and keeps others."""
    for seed in range(1000):
        torch.manual_seed(seed)
        s = draw_branch_scale(n, p)
        if (s == 0).any() and (s != 0).any():
            return seed
    raise AssertionError("no mixed draw")


def _leaves(inp):
    return [getattr(inp, n) for n in GRAD_NAMES if getattr(inp, n) is not None]


def _names(inp):
    return [n for n in GRAD_NAMES if getattr(inp, n) is not None]


def _args(case):
    return dict(stride=case.stride, padding=case.padding, dilation=case.dilation)


def run_fused(case, inp, branch_scale, *, training=True, grad_out=None):
    y = FR.bn_relu_conv2d(inp.x, inp.weight, inp.bias, inp.bn_weight, inp.bn_bias,
                          inp.running_mean, inp.running_var, inp.num_batches_tracked,
                          training=training, residual=inp.residual, branch_scale=branch_scale,
                          **_args(case))
    grad_out = torch.randn_like(y) if grad_out is None else grad_out
    return y, torch.autograd.grad(y, _leaves(inp), grad_out), grad_out


def run_plain_stochastic_depth(case, inp, p, seed, grad_out, *, training=True):
    """The plain unit, torchvision's stochastic_depth on its branch (drawn after seeding with
    ``seed``), then the residual."""
    bn = FR.BatchNormArgs(inp.bn_weight, inp.bn_bias, inp.running_mean, inp.running_var,
                          inp.num_batches_tracked, training, 0.1, 1e-5)
    branch = reference.bn_relu_conv2d(inp.x, inp.weight, inp.bias, bn, **_args(case))
    torch.manual_seed(seed)
    y = stochastic_depth(branch, p, mode="row", training=True)
    if inp.residual is not None:
        y = inp.residual + y
    return y, torch.autograd.grad(y, _leaves(inp), grad_out)


def assert_close(actual, expected, dtype, what):
    atol, rtol = TOL[dtype]
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def test_torchvision_draw_is_the_formula():
    """torchvision's stochastic_depth(mode="row") is branch * s[n], s drawn by
    draw_branch_scale from the same generator state, dropped samples exactly 0."""
    branch = torch.randn(8, 3, 5, 5)
    seed = mixed_seed(8, 0.5)
    torch.manual_seed(seed)
    theirs = stochastic_depth(branch, 0.5, mode="row", training=True)
    torch.manual_seed(seed)
    s = draw_branch_scale(8, 0.5)
    assert set(s.tolist()) == {0.0, 2.0}
    assert torch.equal(theirs, branch * s[:, None, None, None])
    assert torch.equal(reference.scale_branch(branch, s), theirs)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_torchvision_stochastic_depth(backend, case, dtype, channels_last):
    """Outputs, all gradients and running statistics of the fused op with branch_scale equal
    the plain unit + torchvision's stochastic_depth + residual, same draws."""
    p = 0.4
    seed = mixed_seed(case.n, p)
    inp = make_inputs(case, dtype, channels_last=channels_last)
    ref = inp.clone()
    torch.manual_seed(seed)
    s = draw_branch_scale(case.n, p, dtype)
    y, grads, gy = run_fused(case, inp, s)
    y_ref, grads_ref = run_plain_stochastic_depth(case, ref, p, seed, gy)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert_close(y, y_ref, dtype, "output")
    for name, g, g_ref in zip(_names(inp), grads, grads_ref):
        assert_close(g, g_ref, dtype, f"grad of {name}")
    assert_close(inp.running_mean, ref.running_mean, dtype, "running_mean")
    assert_close(inp.running_var, ref.running_var, dtype, "running_var")
    assert int(inp.num_batches_tracked) == int(ref.num_batches_tracked) == 1
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_dropped_samples_keep_only_the_residual(backend, channels_last):
    """s[n] = 0: y[n] is the residual exactly; in eval mode x[n] takes no gradient and
    grad_residual is grad_out whatever the scale."""
    case = CASES[0]
    inp = make_inputs(case, channels_last=channels_last)
    s = torch.tensor([0.0, 1.25, 0.0])
    y, grads, gy = run_fused(case, inp, s, training=False)
    assert torch.equal(y[0], inp.residual[0].detach()) and torch.equal(y[2], inp.residual[2])
    gx, g_res = grads[0], grads[-1]
    assert torch.equal(gx[0], torch.zeros_like(gx[0])) and torch.equal(gx[2], gx[0])
    assert gx[1].abs().sum() > 0
    assert torch.equal(g_res, gy)
    # Every sample dropped: the branch contributes nothing, its parameters get zero gradients.
    inp = make_inputs(case, channels_last=channels_last)
    y, grads, gy = run_fused(case, inp, torch.zeros(3), training=True)
    assert torch.equal(y, inp.residual.detach())
    for name, g in zip(_names(inp), grads):
        if name != "residual":
            assert torch.count_nonzero(g) == 0, name


def test_unit_scale_is_the_plain_op(backend):
    """branch_scale of ones gives the op without one, bit for bit."""
    case = CASES[0]
    inp = make_inputs(case)
    other = inp.clone()
    y, grads, gy = run_fused(case, inp, torch.ones(3))
    y2, grads2, _ = run_fused(case, other, None, grad_out=gy)
    torch.testing.assert_close(y, y2, atol=0, rtol=0)
    torch.testing.assert_close(grads, grads2, atol=0, rtol=0)


@pytest.mark.parametrize("name,env,split", [
    ("cpu", {"FUSEDRES_CPU_TILE_BYTES": "1"}, None),  # one sample a tile: every tile's offset
    ("cuda", {}, 3),  # the host copy's weight gradient split in three
    ("triton", {"FUSEDRES_TRITON_BACKWARD": "store"}, None),
], ids=["cpu-tiles", "cuda-split", "triton-store"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_other_plans(monkeypatch, request, name, env, split, channels_last):
    """The backends' other tilings and backward plans, against the oracle. (The cuda backend's
    store plan, which runs where the weight gradient is not asked for, with a branch scale:
    tests/test_cuda_kernels.py.)"""
    if name not in fusedres.available_backends("cpu"):
        pytest.skip(f"{name} does not run here")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if split is not None:
        testing = torch.ops.fusedres_cuda_testing
        if not hasattr(testing, "set_wgrad_split"):
            pytest.skip("the split hook is built with the host copy")
        old = testing.set_wgrad_split(split)
        request.addfinalizer(lambda: testing.set_wgrad_split(old))
    for case in (CASES[0], CASES[2], CASES[3]):
        p = 0.4
        seed = mixed_seed(case.n, p)
        inp = make_inputs(case, channels_last=channels_last)
        ref = inp.clone()
        torch.manual_seed(seed)
        s = draw_branch_scale(case.n, p)
        with fusedres.use_backend(name):
            y, grads, gy = run_fused(case, inp, s)
        y_ref, grads_ref = run_plain_stochastic_depth(case, ref, p, seed, gy)
        assert_close(y, y_ref, torch.float32, "output")
        for gname, g, g_ref in zip(_names(inp), grads, grads_ref):
            assert_close(g, g_ref, torch.float32, f"grad of {gname}")


@pytest.mark.parametrize("name", ["portable", "cpu"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_gradcheck_f64(name, channels_last):
    if name not in fusedres.available_backends("cpu"):
        pytest.skip(f"{name} does not run here")
    case = Case(3, 3, 5, 5, 4, k=3, padding=1, bias=True, residual=True)
    inp = make_inputs(case, torch.float64, channels_last=channels_last)
    s = torch.tensor([1.25, 0.0, 2.5], dtype=torch.float64)

    def f(x, weight, bias, bn_weight, bn_bias, residual):
        return FR.bn_relu_conv2d(x, weight, bias, bn_weight, bn_bias, None, None, training=True,
                                 padding=1, residual=residual, branch_scale=s)

    leaves = [t.detach().requires_grad_() for t in _leaves(inp)]
    with fusedres.use_backend(name):
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_within_twice_torch_error(backend, dtype):
    """Half precision: error against a float64 reference at most twice that of PyTorch's own
    plain block with torchvision's stochastic_depth at that dtype (plus a floor for zeros)."""
    case = Case(4, 16, 8, 8, 16, k=3, padding=1, residual=True)
    p = 0.3
    seed = mixed_seed(case.n, p)
    inp = make_inputs(case, dtype)
    exact = inp.float64()
    torch_half = inp.clone()
    torch.manual_seed(seed)
    s = draw_branch_scale(case.n, p)  # float32: the statistics dtype of half inputs
    y, grads, gy = run_fused(case, inp, s)
    y64, grads64 = run_plain_stochastic_depth(case, exact, p, seed, gy.double())
    yt, grads_t = run_plain_stochastic_depth(case, torch_half, p, seed, gy)
    assert y.dtype == dtype
    assert_within_twice_torch(["output"] + _names(inp), [y, *grads], [yt, *grads_t],
                              [y64, *grads64])


def test_prepared_two_step_form_and_reference_backend():
    """conv2d_from_prepared takes branch_scale (the blocks' entry point), on the reference
    backend too; a float64 scale for float32 inputs is cast to the statistics dtype."""
    case = CASES[0]
    s = torch.tensor([2.0, 0.0, 1.25], dtype=torch.float64)
    outs = {}
    base = make_inputs(case)
    for name in ("reference", "portable"):
        inp = base.clone()
        with fusedres.use_backend(name):
            state = FR.prepare_batch_norm(inp.x, inp.bn_weight, inp.bn_bias, inp.running_mean,
                                          inp.running_var, training=True)
            outs[name] = FR.conv2d_from_prepared(state, inp.weight, inp.bias, padding=1,
                                                 residual=inp.residual, branch_scale=s)
    assert outs["portable"].dtype == torch.float32
    torch.testing.assert_close(outs["portable"], outs["reference"], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("bad,error", [
    (torch.ones(4), r"branch_scale: expected shape \(3,\)"),
    (torch.ones(3, 1), r"branch_scale: expected shape \(3,\)"),
    (torch.ones(3, dtype=torch.int64), "branch_scale: expected a floating-point tensor"),
    (torch.ones(3, device="meta"), "branch_scale: expected device cpu"),
], ids=["length", "2-D", "int", "device"])
def test_bad_branch_scale_is_rejected_before_any_state_changes(backend, bad, error):
    case = CASES[0]
    inp = make_inputs(case)
    mean0, var0 = inp.running_mean.clone(), inp.running_var.clone()
    with pytest.raises(ValueError, match=error):
        run_fused(case, inp, bad)
    assert torch.equal(inp.running_mean, mean0) and torch.equal(inp.running_var, var0)
    assert int(inp.num_batches_tracked) == 0
    with pytest.raises(TypeError, match="branch_scale: expected a Tensor or None"):
        run_fused(case, inp, [1.0, 1.0, 1.0])


def test_branch_scale_takes_no_gradient(backend):
    """A branch_scale that requires grad is used as a constant: no gradient flows to it."""
    case = CASES[0]
    inp = make_inputs(case)
    s = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    y = FR.bn_relu_conv2d(inp.x, inp.weight, inp.bias, inp.bn_weight, inp.bn_bias,
                          inp.running_mean, inp.running_var, training=True, padding=1,
                          residual=inp.residual, branch_scale=s)
    y.sum().backward()
    assert s.grad is None and inp.x.grad is not None


@pytest.mark.parametrize("name", ["portable", "cpu"])
def test_checkpointed_recompute_redraws_the_same_scale(name):
    """Under activation checkpointing the recomputed forward draws the same branch scale (the
    RNG state is preserved), so the gradients are those of the uncheckpointed unit."""
    if name not in fusedres.available_backends("cpu"):
        pytest.skip(f"{name} does not run here")
    from fusedres.memory.activation_checkpoint import checkpoint

    case = CASES[0]
    base = make_inputs(case)

    def unit(x, weight, residual):
        s = draw_branch_scale(case.n, 0.5)
        return FR.bn_relu_conv2d(x, weight, None, base.bn_weight.detach(),
                                 base.bn_bias.detach(), None, None, training=True, padding=1,
                                 residual=residual, branch_scale=s)

    grads = []
    for use_checkpoint in (False, True):
        inp = base.clone()
        leaves = [inp.x, inp.weight, inp.residual]
        torch.manual_seed(mixed_seed(case.n, 0.5))
        with fusedres.use_backend(name):
            y = checkpoint(unit, *leaves) if use_checkpoint else unit(*leaves)
            grads.append(torch.autograd.grad(y, leaves, torch.ones_like(y)))
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["portable", "cpu"])
def test_compile_fullgraph_with_branch_scale(name):
    """torch.compile sees through the ops with a branch scale (fake kernels), no graph break."""
    if name not in fusedres.available_backends("cpu"):
        pytest.skip(f"{name} does not run here")
    case = CASES[0]
    inp = make_inputs(case)
    s = torch.tensor([0.0, 1.25, 2.5])

    def f(x, weight, residual):
        return FR.bn_relu_conv2d(x, weight, None, inp.bn_weight, inp.bn_bias, None, None,
                                 training=True, padding=1, residual=residual, branch_scale=s)

    leaves = [inp.x, inp.weight, inp.residual]
    with fusedres.use_backend(name):
        y = f(*leaves)
        g = torch.autograd.grad(y, leaves, torch.ones_like(y))
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        yc = compiled(*leaves)
        gc = torch.autograd.grad(yc, leaves, torch.ones_like(yc))
    torch.testing.assert_close(yc, y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gc, g, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64],
                         ids=["f16", "f32", "f64"])
def test_triton_forward_every_config_placement(dtype):
    """The Triton forward applies the branch scale where each config says (BSCALE_AT: epilogue,
    operand load, broadcast tile; chosen per config so that none spills, tools/triton_aot.py): every
    config of the dtype, run under the interpreter, against the portable op."""
    if "triton" not in fusedres.available_backends("cpu"):
        pytest.skip("triton does not run here")
    from fusedres.backends import portable
    from fusedres.kernels import bn_relu_conv2d as fwd

    case = Case(3, 16, 6, 6, 16, k=3, padding=1, bias=True, residual=True)
    inp = make_inputs(case, dtype)
    x, w, b, res = (t.detach() for t in (inp.x, inp.weight, inp.bias, inp.residual))
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    mean, var = (torch.rand(case.c, dtype=sdt) for _ in range(2))
    invstd = torch.rsqrt(var + 0.5)
    gamma, beta = inp.bn_weight.detach().to(sdt), inp.bn_bias.detach().to(sdt)
    s = torch.tensor([1.25, 0.0, 2.5], dtype=sdt)
    want = portable.bn_relu_conv2d(x, w, b, gamma, beta, mean, invstd, res, [1, 1], [1, 1],
                                   [1, 1], True, s)
    scale = gamma * invstd
    shift = beta - mean * scale
    tol = {torch.float16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-10}[dtype]
    places = set()
    for cfg in fwd.configs_for(dtype):
        places.add(cfg.meta.get("BSCALE_AT", 0))
        # ALIGNED configs run on channels-last operands only (16 channels: aligned).
        fmt = torch.channels_last if cfg.meta.get("ALIGNED") else torch.contiguous_format
        xf, wf, rf = (t.contiguous(memory_format=fmt) for t in (x, w, res))
        y = fwd.bn_relu_conv2d_fwd(xf, wf, b, scale, shift, rf, [1, 1], [1, 1], [1, 1], fmt,
                                   config=cfg, branch_scale=s)
        torch.testing.assert_close(y, want, atol=tol, rtol=tol, msg=lambda m, c=cfg: f"{c}: {m}")
    assert places == {torch.float16: {0, 1}, torch.float32: {0},
                      torch.float64: {2}}[dtype]


def test_autocast_bf16_matches_plain_stochastic_depth(backend):
    """Under bf16 autocast (BN in float32, the conv in bfloat16, a float32 residual added in
    float32) the branch scale applies as on the plain block."""
    case = CASES[0]
    p = 0.4
    seed = mixed_seed(case.n, p)
    inp = make_inputs(case, torch.float32)
    ref = inp.clone()
    torch.manual_seed(seed)
    s = draw_branch_scale(case.n, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads, gy = run_fused(case, inp, s)
        y_ref, grads_ref = run_plain_stochastic_depth(case, ref, p, seed, gy)
    assert_autocast_close(_names(inp), y, grads, y_ref, grads_ref)
    torch.testing.assert_close(inp.running_mean, ref.running_mean)
