"""torch.library contract: opcheck on every op and backend; torch.compile with no graph break."""

import re

import pytest
import torch
import torch.nn as nn

import fusedres
from conftest import FUSED_BACKENDS
from fusedres.ops import opdefs
from helpers import CASES, make_inputs


def _fwd_args(case, inp, batch_stats=True):
    mean, var = torch.ops.fusedres.batch_stats(inp.x.detach())
    invstd = torch.rsqrt(var + 1e-5)
    pair = lambda v: list(v) if isinstance(v, tuple) else [v, v]
    return (inp.x, inp.weight, inp.bias, inp.bn_weight, inp.bn_bias, mean, invstd, inp.residual,
            pair(case.stride), pair(case.padding), pair(case.dilation), batch_stats)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=["c0", "c2", "c5"])
def test_opcheck(backend, case, channels_last):
    inp = make_inputs(case, channels_last=channels_last)
    torch.library.opcheck(torch.ops.fusedres.batch_stats, (inp.x.detach(),))
    args = _fwd_args(case, inp)
    torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d, args)
    y = torch.ops.fusedres.bn_relu_conv2d(*args)
    gy = torch.randn_like(y)
    mask = [True, True, inp.bias is not None, inp.bn_weight is not None, inp.bn_bias is not None]
    d = lambda t: None if t is None else t.detach()
    bwd_args = (gy, inp.x.detach(), inp.weight.detach(), d(inp.bn_weight), d(inp.bn_bias),
                *args[5:7], *args[8:12], mask)
    torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d_backward, bwd_args)
    torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d_genstats, args)
    if case is CASES[0]:  # with a branch scale (stochastic depth), one sample dropped
        s = torch.tensor([0.0, 1.25][:case.n] + [0.8] * (case.n - 2))
        torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d, (*args, s))
        torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d_genstats, (*args, s))
        torch.library.opcheck(torch.ops.fusedres.bn_relu_conv2d_backward, (*bwd_args, s))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=["c0", "c2", "c5"])
def test_genstats_gives_the_output_and_its_statistics(backend, case, channels_last):
    inp = make_inputs(case, channels_last=channels_last)
    args = _fwd_args(case, inp)
    y, mean, var = torch.ops.fusedres.bn_relu_conv2d_genstats(*args)
    ref = torch.ops.fusedres.bn_relu_conv2d(*args)
    torch.testing.assert_close(y, ref, atol=0, rtol=0)
    assert y.stride() == ref.stride()
    ref_mean, ref_var = torch.ops.fusedres.batch_stats(ref.detach())
    tol = dict(atol=1e-5, rtol=1e-5) if y.dtype == torch.float32 else {}
    torch.testing.assert_close(mean, ref_mean, **tol)
    torch.testing.assert_close(var, ref_var, **tol)
    assert not mean.requires_grad and not var.requires_grad
    # The gradients are those of the plain op (the statistics take none).
    gy = torch.randn_like(y)
    leaves = [t for t in (inp.x, inp.weight, inp.bias, inp.bn_weight, inp.bn_bias, inp.residual)
              if t is not None and t.requires_grad]
    ours = torch.autograd.grad(y, leaves, gy)
    theirs = torch.autograd.grad(ref, leaves, gy)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def _tiny_net(fused: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        fusedres.PreActBasicBlock(8, 8, fused=fused),
        fusedres.PreActBasicBlock(8, 16, stride=2, fused=fused),
        fusedres.PreActBottleneck(16, 4, stride=2, fused=fused),
    )


def _step(model, x):
    y = model(x)
    y.square().mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


# Inductor on every backend but Triton-under-the-interpreter, whose kernels run inside the op at
# run time either way: aot_eager covers its graph capture.
COMPILE_CASES = [(b, "aot_eager") for b in FUSED_BACKENDS] + [
    (b, "inductor") for b in FUSED_BACKENDS if b != "triton"]


@pytest.mark.parametrize("backend_name,compiler", COMPILE_CASES,
                         ids=[f"{b}-{c}" for b, c in COMPILE_CASES])
def test_compile_fullgraph_matches_eager(backend_name, compiler):
    with fusedres.use_backend(backend_name):
        _check_compile_matches_eager(compiler)


def _check_compile_matches_eager(compiler):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _tiny_net(fused=True)
    compiled_model = _tiny_net(fused=True)
    compiled_model.load_state_dict(eager.state_dict())
    x = torch.randn(2, 3, 12, 12)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=compiler)
    for _ in range(2):  # two steps: running stats feed the second one
        y_e, g_e = _step(eager, x)
        y_c, g_c = _step(compiled, x)
        torch.testing.assert_close(y_c, y_e, atol=1e-4, rtol=1e-4)
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        for m in (eager, compiled_model):
            m.zero_grad()
    for (name, b_e), b_c in zip(eager.named_buffers(), compiled_model.buffers()):
        torch.testing.assert_close(b_c, b_e, atol=1e-5, rtol=1e-5, msg=name)


def test_compile_momentum_none_has_no_graph_break():
    torch._dynamo.reset()
    m = fusedres.BNReLUConv2d(3, 4, 3, padding=1, momentum=None)
    ref = fusedres.BNReLUConv2d(3, 4, 3, padding=1, momentum=None)
    ref.load_state_dict(m.state_dict())
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(compiled(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.bn.running_var, ref.bn.running_var)
    assert int(m.bn.num_batches_tracked) == 3


def test_export_sees_the_ops():
    m = fusedres.BNReLUConv2d(3, 4, 3, padding=1).eval()
    ep = torch.export.export(m, (torch.randn(2, 3, 6, 6),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "fusedres.bn_relu_conv2d.default" in targets


@pytest.mark.parametrize("op", sorted(opdefs.SCHEMAS))
def test_python_signature_infers_the_schema(op):
    """torch 2.11's triton_op infers each fusedres_triton op's schema from the function's
    signature (it ignores ``schema=``; on a real H100 the backend failed to import on
    ``*inputs``): the signature the backend gives its functions must infer SCHEMAS, list sizes
    aside."""
    from torch._library.infer_schema import infer_schema

    def fn(*inputs):
        return inputs
    fn.__signature__ = opdefs.python_signature(op)
    inferred = infer_schema(fn, mutates_args=())
    expected = re.sub(r"(SymInt|bool)\[\d\]", r"\1[]", opdefs.SCHEMAS[op])
    assert inferred == expected


def test_python_signature_rejects_a_type_it_cannot_annotate(monkeypatch):
    monkeypatch.setitem(opdefs.SCHEMAS, "odd", "(Tensor x, str mode) -> Tensor")
    with pytest.raises(NotImplementedError, match="odd: no Python annotation for schema type str"):
        opdefs.python_signature("odd")
