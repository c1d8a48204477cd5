"""Backend choice: names, precedence, the auto fallback and errors for backends that can't run."""

import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fusedres
from fusedres.backends import cuda as backend_cuda
from fusedres.ops import _backend
from helpers import CASES, make_inputs, run


def test_available_backends_here():
    names = fusedres.available_backends("cpu")
    assert names[:2] == ["reference", "portable"]
    assert set(names) <= set(fusedres.BACKENDS)


def test_use_backend_nests_and_restores():
    outer = fusedres.get_backend()
    with fusedres.use_backend("portable"):
        assert fusedres.get_backend() == "portable"
        with fusedres.use_backend("reference"):
            assert fusedres.get_backend() == "reference"
        assert fusedres.get_backend() == "portable"
    assert fusedres.get_backend() == outer


def test_set_backend_and_bad_names():
    try:
        fusedres.set_backend("portable")
        assert fusedres.get_backend() == "portable"
    finally:
        fusedres.set_backend("auto")
    with pytest.raises(ValueError, match="set_backend"):
        fusedres.set_backend("cudnn")
    with pytest.raises(ValueError, match="use_backend"):
        with fusedres.use_backend("fast"):
            pass


def test_auto_picks_the_first_that_runs():
    expected = next(b for b in _backend.auto_order("cpu")
                    if _backend.unavailable_reason(b, "cpu") is None)
    with fusedres.use_backend("auto"):
        assert _backend.resolve_backend(torch.device("cpu")) == expected


def test_named_backend_that_cannot_run_raises_before_state_changes(monkeypatch):
    inp = make_inputs(CASES[0])
    before = inp.running_mean.clone()
    # The cuda backend without FUSEDRES_CUDA_ON_CPU (conftest switches it on for the matrix).
    monkeypatch.setattr(backend_cuda, "ON_CPU", False)
    monkeypatch.setattr(_backend, "_unavailable_reason",
                        functools.cache(_backend._unavailable_reason.__wrapped__))
    with fusedres.use_backend("cuda"):
        with pytest.raises(fusedres.BackendUnavailableError, match="'cuda' cannot run on cpu: "
                           "it runs on CUDA tensors"):
            run(CASES[0], inp, training=True)
    assert torch.equal(inp.running_mean, before)
    assert int(inp.num_batches_tracked) == 0


def test_env_variable_sets_the_default():
    code = "import fusedres; print(fusedres.get_backend())"
    env = dict(os.environ, FUSEDRES_BACKEND="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "portable"
    env["FUSEDRES_BACKEND"] = "bogus"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "FUSEDRES_BACKEND" in bad.stderr


def test_import_does_not_initialise_cuda():
    code = "import torch, fusedres; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_eager_unit_takes_the_backend_route(name, monkeypatch):
    """A module's unit in eager mode runs the backend's own kernels through its eager route
    (fusedres.ops._backend: triton's autograd.Function ``EagerTritonUnit``, cuda's C++ node),
    with no public-op layer: the same kernels as the public op, so the same outputs and
    gradients to the bit."""
    from fusedres.ops import _backend

    why = fusedres.unavailable_reason(name, "cpu")
    if why is not None:
        pytest.skip(f"the {name} backend does not run here: {why}")
    torch.manual_seed(0)
    m = fusedres.BNReLUConv2d(6, 5, 3, padding=1)
    x = torch.randn(2, 6, 5, 5)

    def run():
        xr = x.clone().requires_grad_()
        y = m(xr)
        y.backward(torch.ones_like(y))
        grads = [xr.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return y.detach(), grads, y.grad_fn.name()

    with fusedres.use_backend(name):
        y, grads, node = run()
        monkeypatch.setitem(_backend.TABLE, name, _backend.load(name).without_fast_path())
        y_pub, grads_pub, node_pub = run()
    assert f"Eager{name.capitalize()}Unit" in node  # triton's Python node, cuda's C++ one
    assert "Eager" not in node_pub
    assert torch.equal(y, y_pub)
    for g, gp in zip(grads, grads_pub):
        assert torch.equal(g, gp)


def _eager_backend_or_skip(name):
    why = fusedres.unavailable_reason(name, "cpu")
    if why is not None:
        pytest.skip(f"the {name} backend does not run here: {why}")


# Every eager route's autograd node: cpu's C++ unit (EagerCpuUnit) and its Python pair and
# shortcut nodes (a block with a projection, a block with the identity), triton's and cuda's.
EAGER_ROUTES = [("cpu", "unit"), ("cpu", "projection block"), ("cpu", "identity block"),
                ("triton", "unit"), ("cuda", "unit")]


def _eager_model(kind):
    torch.manual_seed(0)
    if kind == "unit":
        return fusedres.BNReLUConv2d(4, 4, 3, padding=1)
    from fusedres.modules import BasicBlock

    return BasicBlock(4, 6 if kind == "projection block" else 4)


@pytest.mark.parametrize("name,kind", EAGER_ROUTES)
def test_eager_routes_refuse_a_double_backward(name, kind):
    """A backward that builds a graph (create_graph=True) through an eager route gives the same
    gradient through the public ops, whose second backward raises (no second-order formula).
    Running the kernels bare there handed back a gradient with no graph: the unit's
    second-order term silently left the sum below."""
    _eager_backend_or_skip(name)
    m = _eager_model(kind)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with fusedres.use_backend(name):
        y = m(x)
        loss = y.square().sum() + x.pow(3).sum()
        with warnings.catch_warnings():
            # A backend op under autograd's fallback warns ("an autograd kernel was not
            # registered") where the public op raises: an error here.
            warnings.simplefilter("error")
            (g_plain,) = torch.autograd.grad(loss, x, retain_graph=True)
            (g,) = torch.autograd.grad(loss, x, create_graph=True)  # the public ops' route
            torch.testing.assert_close(g, g_plain)
            with pytest.raises(RuntimeError, match="no autograd formula"):
                torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("name,kind", EAGER_ROUTES)
def test_eager_routes_batched_gradients(name, kind):
    """``is_grads_batched`` (a vmap over the backward: what ``autograd.functional.jacobian(...,
    vectorize=True)`` runs) through an eager route: the public op's batching, equal to one
    backward per gradient (eval mode, so that the gradients are independent of the batch)."""
    _eager_backend_or_skip(name)
    m = _eager_model(kind).eval()
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with fusedres.use_backend(name):
        y = m(x)
        gs = torch.randn(2, *y.shape)
        (batched,) = torch.autograd.grad(y, x, gs, retain_graph=True, is_grads_batched=True)
        for g, b in zip(gs, batched):
            (one,) = torch.autograd.grad(y, x, g, retain_graph=True)
            torch.testing.assert_close(b, one)


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_eager_route_wants_a_plain_weight(name):
    """A weight that is a tensor subclass (a wrapper such as DTensor: the Triton launchers
    would read its data raw) keeps the unit on the public ops; a Parameter takes the eager
    route."""
    _eager_backend_or_skip(name)
    from torch.testing._internal.two_tensor import TwoTensor

    from fusedres.ops._backend import route

    x = torch.randn(2, 4, 5, 5)
    w = torch.randn(3, 4, 3, 3)
    with fusedres.use_backend(name):
        assert route(x, torch.nn.Parameter(w)).name == name
        assert route(x, w).name == name
        assert route(x, TwoTensor(w, w.clone())).name == "public"


# What each case asks a gradient of: (x, conv weight, conv bias, bn weight, bn bias, residual),
# with BatchNorm in training (batch statistics) or eval, and a drop-path branch scale or none.
TRITON_RULE_CASES = {
    "all, bias and residual": ((True, True, True, True, True, True), True, False),
    "frozen BatchNorm": ((True, True, False, False, False, False), True, False),
    "no gradient of x": ((False, True, True, True, True, True), True, False),
    "eval": ((True, True, True, True, True, True), False, False),
    "branch scale": ((True, True, False, True, True, True), True, True),
}


@pytest.mark.parametrize("case", sorted(TRITON_RULE_CASES))
def test_eager_triton_unit_follows_the_public_rule(case, monkeypatch):
    """EagerTritonUnit states the unit's autograd rule in code of its own (a Python frame of
    fusedres.ops.unit_backward would cost host time a step); unit_backward is the rule's
    statement. Pinned to it: the output and the gradient of every input that asks for one, bit
    for bit, and no gradient for those that do not, against the public ops' rule over the same
    kernels."""
    _eager_backend_or_skip("triton")
    from fusedres import functional as FR

    wants, training, scaled = TRITON_RULE_CASES[case]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 6, 6, generator=g)
    w = torch.randn(5, 4, 3, 3, generator=g)
    tensors = [x, w, torch.randn(5, generator=g), torch.rand(4, generator=g) + 0.5,
               torch.randn(4, generator=g), torch.randn(3, 5, 6, 6, generator=g)]
    grad_out = torch.randn(3, 5, 6, 6, generator=g)
    scale = torch.tensor([2.0, 0.0, 2.0]) if scaled else None

    def run_once():
        leaves = [t.clone().requires_grad_(want) for t, want in zip(tensors, wants)]
        xs, weight, bias, gamma, beta, residual = leaves
        y = FR.bn_relu_conv2d(xs, weight, bias, gamma, beta, torch.zeros(4), torch.ones(4),
                              torch.tensor(0), training=training, padding=1,
                              residual=residual, branch_scale=scale)
        asked = [t for t in leaves if t.requires_grad]
        return y.detach(), y.grad_fn.name(), torch.autograd.grad(y, asked, grad_out)

    with fusedres.use_backend("triton"):
        y, node, grads = run_once()
        monkeypatch.setitem(_backend.TABLE, "triton",
                            _backend.load("triton").without_fast_path())
        y_pub, node_pub, grads_pub = run_once()
    assert node == "EagerTritonUnitBackward" and "Eager" not in node_pub
    assert torch.equal(y, y_pub)
    assert len(grads) == sum(wants)
    for a, b in zip(grads, grads_pub):
        assert torch.equal(a, b)


def test_eager_triton_backward_plans_per_gradient_layout(monkeypatch):
    """The triton eager route's backward keeps one plan a gradient layout, set of outputs
    wanted and backward setting (``FUSEDRES_TRITON_BACKWARD``, read at every backward): each
    gives the public op's gradients to the bit, and a step like an earlier one reuses its
    plan."""
    _eager_backend_or_skip("triton")
    from fusedres.ops import _backend

    torch.manual_seed(0)
    m = fusedres.BNReLUConv2d(6, 5, 3, padding=1)
    x = torch.randn(2, 6, 5, 5)
    g = torch.randn(2, 5, 5, 5)
    g_cl = g.contiguous(memory_format=torch.channels_last)

    def run(grad, need_x):
        xr = x.clone().requires_grad_(need_x)
        y = m(xr)
        y.backward(grad)
        grads = [xr.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return y.grad_fn, grads

    cases = [("sums", g, True, 1), ("sums", g_cl, True, 2), ("store", g, True, 3),
             ("sums", g, False, 4), ("sums", g, True, 4), ("store", g, True, 4)]
    with fusedres.use_backend("triton"):
        for strategy, grad, need_x, plans in cases:
            monkeypatch.setenv("FUSEDRES_TRITON_BACKWARD", strategy)
            node, grads = run(grad, need_x)
            assert len(node.plan.backwards) == plans, (strategy, need_x)
            with monkeypatch.context() as mp:
                mp.setitem(_backend.TABLE, "triton", _backend.load("triton").without_fast_path())
                _, grads_pub = run(grad, need_x)
            for a, b in zip(grads, grads_pub):
                assert (a is None and b is None) or torch.equal(a, b), (strategy, need_x)


def test_eager_triton_backward_checks_the_gradient_offsets(monkeypatch):
    """The triton eager route's backward sends a gradient whose offsets pass int32 (a strided
    view, e.g. of a torch.cat output's gradient, where y itself fits) to the portable code, as
    the public op does: the kernels index in int32."""
    _eager_backend_or_skip("triton")
    from fusedres.backends import portable
    from fusedres.backends import triton as triton_backend

    torch.manual_seed(0)
    m = fusedres.BNReLUConv2d(4, 3, 3, padding=1)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    g = torch.randn(2, 3, 5, 5)
    calls = []
    fits = triton_backend.eager._fits_int32
    monkeypatch.setattr(triton_backend.eager, "_fits_int32",
                        lambda *ts: fits(*ts) and not any(t is g for t in ts))
    portable_backward = portable.bn_relu_conv2d_backward
    monkeypatch.setattr(portable, "bn_relu_conv2d_backward",
                        lambda *a: calls.append(a[0]) or portable_backward(*a))
    with fusedres.use_backend("triton"):
        y = m(x)
        assert type(y.grad_fn).__name__ == "EagerTritonUnitBackward"
        y.backward(g)
    assert len(calls) == 1 and calls[0] is g
