"""Drop-in modules: same keys as the plain blocks, same outputs, gradients and running stats."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedres
from fusedres import functional as FR
from helpers import OpCounter

BLOCKS = [
    ("basic_identity", lambda fused: fusedres.PreActBasicBlock(8, 8, fused=fused)),
    ("basic_projection", lambda fused: fusedres.PreActBasicBlock(8, 16, stride=2, fused=fused)),
    ("bottleneck_identity", lambda fused: fusedres.PreActBottleneck(16, 4, fused=fused)),
    ("bottleneck_conv1", lambda fused: fusedres.PreActBottleneck(8, 4, stride=2, fused=fused)),
    ("bottleneck_conv2", lambda fused: fusedres.PreActBottleneck(
        8, 4, stride=2, fused=fused, stride_on="conv2")),
]


def _in_channels(block):
    return block.bn1.num_features


def _compare(a: nn.Module, b: nn.Module, x: torch.Tensor, steps: int = 3, atol=1e-4):
    """Train both for ``steps`` forward+backward passes, then eval; everything must agree."""
    for _ in range(steps):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        torch.testing.assert_close(ya, yb, atol=atol, rtol=atol)
        gy = torch.randn_like(ya)
        ya.backward(gy)
        yb.backward(gy)
        torch.testing.assert_close(xa.grad, xb.grad, atol=atol, rtol=atol)
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, atol=atol, rtol=atol, msg=name)
        a.zero_grad()
        b.zero_grad()
        x = x * 1.5 + 0.1
    for (name, ba), bb in zip(a.named_buffers(), b.buffers()):
        torch.testing.assert_close(ba, bb, atol=1e-5, rtol=1e-5, msg=name)
    a.eval()
    b.eval()
    torch.testing.assert_close(a(x), b(x), atol=atol, rtol=atol)


@pytest.mark.parametrize("name,make", BLOCKS, ids=[n for n, _ in BLOCKS])
def test_fused_block_matches_plain_twin(backend, name, make):
    fused, plain = make(True), make(False)
    assert list(fused.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, _in_channels(fused), 9, 9)
    _compare(fused, plain, x)


@pytest.mark.parametrize("name,make", BLOCKS, ids=[n for n, _ in BLOCKS])
def test_state_dict_round_trip_both_ways(name, make):
    fused, plain = make(True), make(False)
    # Train the plain one a little so its buffers are not the defaults.
    x = torch.randn(2, _in_channels(fused), 9, 9)
    plain(x).sum().backward()
    fused.load_state_dict(plain.state_dict())
    back = make(False)
    back.load_state_dict(fused.state_dict())
    for (k, v), v2 in zip(plain.state_dict().items(), back.state_dict().values()):
        assert torch.equal(v, v2), k
    _compare(fused, back, x)


def test_block_keys_are_he_et_al():
    keys = {k.split(".")[0] for k in fusedres.PreActBottleneck(8, 4, stride=2).state_dict()}
    assert keys == {"bn1", "conv1", "bn2", "conv2", "bn3", "conv3", "shortcut"}
    keys = {k.split(".")[0] for k in fusedres.PreActBasicBlock(8, 8).state_dict()}
    assert keys == {"bn1", "conv1", "bn2", "conv2"}
    b = fusedres.PreActBottleneck(8, 4, stride=2, stride_on="conv1")
    assert b.conv1.stride == (2, 2) and b.conv2.stride == (1, 1)
    b = fusedres.PreActBottleneck(8, 4, stride=2, stride_on="conv2")
    assert b.conv1.stride == (1, 1) and b.conv2.stride == (2, 2)
    with pytest.raises(ValueError, match="stride_on"):
        fusedres.PreActBottleneck(8, 4, stride_on="conv3")


def test_shared_preactivation_costs_one_stats_pass_and_one_update(backend):
    block = fusedres.PreActBottleneck(8, 4, stride=2)
    with OpCounter() as ops:
        block(torch.randn(2, 8, 8, 8))
    # bn1 feeds conv1 and the shortcut: one pass. bn2 and bn3 take the statistics of their
    # inputs from the convolutions that make them (genstats), with no pass of their own.
    assert ops.calls.count(("batch_stats", (2, 8, 8, 8))) == 1
    assert ops.count("batch_stats") == 1
    # The shortcut and conv1 (both 1x1, stride 2) run as one op on their stacked weights,
    # which also gives bn2's statistics; conv2 -> bn3 as before.
    assert ops.calls.count(("bn_relu_conv2d_genstats", (2, 8, 8, 8))) == 1
    assert ops.count("bn_relu_conv2d_genstats") == 2
    assert ops.count("bn_relu_conv2d") == 1  # conv3
    assert all(int(bn.num_batches_tracked) == 1 for bn in (block.bn1, block.bn2, block.bn3))
    # With the stride on conv2 the shortcut (1x1 /2) and conv1 (1x1 /1) differ: two ops.
    block = fusedres.PreActBottleneck(8, 4, stride=2, stride_on="conv2")
    with OpCounter() as ops:
        block(torch.randn(2, 8, 8, 8))
    assert ops.count("batch_stats") == 1
    assert ops.count("bn_relu_conv2d_genstats") == 2 and ops.count("bn_relu_conv2d") == 2
    # Unstrided (a widening projection) they would share a geometry, but are not stacked.
    assert fusedres.PreActBottleneck(8, 4, stride=2).stacked_shortcut
    assert not fusedres.PreActBottleneck(8, 4, stride=1).stacked_shortcut
    assert not fusedres.PreActBottleneck(8, 4, stride=2, fused=False).stacked_shortcut


def _graph(y):
    """Every autograd node behind ``y``, and how many edges reach each one."""
    edges, todo, seen = {}, [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for f, _ in node.next_functions:
            if f is not None:
                edges[f] = edges.get(f, 0) + 1
                todo.append(f)
    return seen, edges


IDENTITY_UNITS = {  # name: (block class, kwargs)
    "bottleneck": (fusedres.PreActBottleneck, dict(planes=2)),
    "basic": (fusedres.PreActBasicBlock, dict(planes=8)),
    "bottleneck, drop_path": (fusedres.PreActBottleneck, dict(planes=2, drop_path=0.5)),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("name", IDENTITY_UNITS)
def test_identity_unit_matches_plain(backend, name, channels_last):
    """An identity unit takes its shortcut from conv1's fused op (shortcut_from_conv1): the
    plain unit's output, every gradient and the running statistics, in both layouts, training
    (with a per-sample branch scale too) and eval. On the cpu backend x has one consumer, the
    conv1 node, which sums the shortcut's gradient into x's (autograd adds nothing)."""
    block, kwargs = IDENTITY_UNITS[name]
    torch.manual_seed(0)
    fused = block(8, **kwargs).double()
    plain = block(8, **kwargs, fused=False).double()
    assert fused.shortcut_from_conv1 and not plain.shortcut_from_conv1
    plain.load_state_dict(fused.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64).to(memory_format=fmt)
    if backend == "cpu":
        leaf = x.clone().requires_grad_()
        nodes, edges = _graph(copy.deepcopy(fused)(leaf))  # a copy: its running stats move
        assert sum("EagerCpuUnitWithShortcut" in n.name() for n in nodes) == 1
        (acc,) = [n for n in nodes if type(n).__name__ == "AccumulateGrad"
                  and n.variable is leaf]
        assert edges[acc] == 1
    for training in (True, False):
        fused.train(training), plain.train(training)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        torch.manual_seed(1)
        yf = fused(xs[0])
        torch.manual_seed(1)
        yp = plain(xs[1])
        g = torch.randn_like(yp)
        yf.backward(g), yp.backward(g)
        torch.testing.assert_close(yf, yp)
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        for (pname, p), q in zip(fused.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=pname)
            p.grad = q.grad = None
        for (bname, b), c in zip(fused.named_buffers(), plain.buffers()):
            torch.testing.assert_close(b, c, msg=bname)


def test_shortcut_from_conv1_either_gradient_alone():
    """conv2d_with_shortcut_from_prepared on the cpu backend: x's gradient when only the
    convolution's output, or only the shortcut, reaches the loss, as without the route."""
    conv = torch.nn.Conv2d(6, 5, 3, padding=1).double()
    bn = torch.nn.BatchNorm2d(6).double()
    with fusedres.use_backend("cpu"):
        for use in ("y", "shortcut"):
            grads = []
            for route in (True, False):
                x = torch.randn(3, 6, 5, 5, dtype=torch.float64, generator=torch.Generator()
                                .manual_seed(2)).requires_grad_()
                state = fusedres.modules.prepare(bn, x)
                geometry = FR.check_conv_args(x, conv.weight, conv.bias, None, conv.stride,
                                              conv.padding, conv.dilation)
                if route:
                    short, y = FR.conv2d_with_shortcut_from_prepared(state, conv.weight,
                                                                     conv.bias, geometry)
                    assert short._base is x
                else:
                    short, y = x, FR.conv2d_from_prepared(state, conv.weight, conv.bias,
                                                          geometry=geometry)
                ((y if use == "y" else short) * 3).sum().backward()
                grads.append(x.grad)
            torch.testing.assert_close(grads[0], grads[1], msg=use)


PROJECTIONS = {  # name: (block class, kwargs, stacked, paired)
    "bottleneck /2 on conv1": (fusedres.PreActBottleneck, dict(planes=4, stride=2), True, False),
    "bottleneck /2 on conv2": (fusedres.PreActBottleneck,
                               dict(planes=4, stride=2, stride_on="conv2"), False, True),
    "bottleneck widening": (fusedres.PreActBottleneck, dict(planes=4), False, True),
    "basic /2": (fusedres.PreActBasicBlock, dict(planes=16, stride=2), False, True),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("name", PROJECTIONS)
def test_projection_unit_matches_plain(backend, name, channels_last):
    """The shortcut + conv1 routes (stacked weights; the paired backward, one node on the cpu
    backend) give the plain unit's output, every gradient and the running statistics, in both
    layouts, training and eval."""
    block, kwargs, stacked, paired = PROJECTIONS[name]
    torch.manual_seed(0)
    fused = block(8, **kwargs).double()
    plain = block(8, **kwargs, fused=False).double()
    assert (fused.stacked_shortcut, fused.paired_shortcut) == (stacked, paired)
    if paired and backend == "cpu":  # one autograd node for both convolutions
        y = fused(torch.randn(2, 8, 8, 8, dtype=torch.float64, requires_grad=True))
        nodes, todo = set(), [y.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and node not in nodes:
                nodes.add(node)
                todo.extend(f for f, _ in node.next_functions)
        assert sum("EagerCpuPair" in n.name() for n in nodes) == 1
    plain.load_state_dict(fused.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 8, 8, 8, dtype=torch.float64).to(memory_format=fmt)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(t) for m, t in zip((fused, plain), xs)]
    g = torch.randn_like(ys[1])
    for y in ys:
        y.backward(g)
    torch.testing.assert_close(ys[0], ys[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(fused.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    fused.eval(), plain.eval()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(t) for m, t in zip((fused, plain), xs)]
    for y in ys:
        y.backward(g)
    torch.testing.assert_close(ys[0], ys[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)


def test_eval_mode_computes_no_statistics(backend):
    block = fusedres.PreActBasicBlock(8, 16, stride=2).eval()
    with OpCounter() as ops:
        block(torch.randn(2, 8, 8, 8))
    assert ops.count("batch_stats") == ops.count("bn_relu_conv2d_genstats") == 0
    assert ops.count("bn_relu_conv2d") == 3


def test_synchronised_batch_norm_gets_no_local_statistics(backend):
    """A BatchNorm that prepares itself (SyncBatchNorm2d) is not handed the producer's local
    statistics: the producing conv runs without genstats."""
    from fusedres import distributed as fdist

    block = fdist.convert_sync_batchnorm(fusedres.PreActBasicBlock(8, 8))
    with OpCounter() as ops:
        block(torch.randn(2, 8, 8, 8))
    assert ops.count("bn_relu_conv2d_genstats") == 0
    assert ops.count("bn_relu_conv2d") == 2


@pytest.mark.parametrize("kwargs", [
    dict(kernel_size=3, padding=1, bias=True),
    dict(kernel_size=1, stride=2),
    dict(kernel_size=3, padding=2, dilation=2, momentum=None),
    dict(kernel_size=3, affine=False),
    dict(kernel_size=3, padding=1, track_running_stats=False),
    dict(kernel_size=5, padding="same", dilation=2),
    dict(kernel_size=3, padding="valid", stride=2),
], ids=["bias", "1x1s2", "dilated_cumulative", "no_affine", "no_running_stats", "same",
        "valid"])
def test_bnreluconv2d_matches_modules(backend, kwargs):
    m = fusedres.BNReLUConv2d(5, 7, **kwargs)
    plain = copy.deepcopy(m)
    x = torch.randn(2, 5, 11, 11)

    class Plain(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.bn, self.conv = inner.bn, inner.conv

        def forward(self, x):
            return self.conv(F.relu(self.bn(x)))

    _compare(m, Plain(plain), x)


def test_bnreluconv2d_residual_and_keys():
    m = fusedres.BNReLUConv2d(3, 4, 3, padding=1)
    assert set(m.state_dict()) == {
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
        "conv.weight"}
    x, r = torch.randn(2, 3, 5, 5), torch.randn(2, 4, 5, 5)
    with fusedres.use_backend("reference"):
        ref = m(x, r)
    m.bn.num_batches_tracked.zero_()
    torch.testing.assert_close(m.eval()(x, r), m(x) + r)
    assert ref.shape == (2, 4, 5, 5)


def test_grouped_conv_is_refused():
    m = fusedres.BNReLUConv2d(4, 4, 3)
    m.conv = nn.Conv2d(4, 4, 3, groups=2)
    before = m.bn.running_mean.clone()
    with pytest.raises(ValueError, match="groups"):
        m(torch.randn(2, 4, 5, 5))
    assert torch.equal(m.bn.running_mean, before)


LEAN_BLOCKS = [
    ("basic", lambda: fusedres.PreActBasicBlock(8, 8)),
    ("bottleneck", lambda: fusedres.PreActBottleneck(16, 4)),
    # the projection beside conv1 through the route's pair (cpu, cuda)
    ("basic-down", lambda: fusedres.PreActBasicBlock(8, 16, stride=2)),
    ("bottleneck-widen", lambda: fusedres.PreActBottleneck(8, 4)),
]


def _lean_runs(block, x, stats, return_stats):
    """Three training steps and two eval steps of ``block`` (the second eval step the lean
    route's where it applies): outputs, statistics, gradients and running statistics, each a
    clone."""
    out = []
    for training in (True, True, True, False, False):
        block.train(training)
        xr = x.clone().requires_grad_()
        y = block(xr, stats=stats, return_stats=return_stats)
        y, ys = y if return_stats else (y, None)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        out += [y.detach().clone(), xr.grad.clone()]
        out += [t.clone() for t in ys or ()]
        out += [p.grad.clone() for p in block.parameters()]
        out += [b.clone() for b in block.buffers()]
        block.zero_grad()
    return out


@pytest.mark.parametrize("name,make", LEAN_BLOCKS, ids=[n for n, _ in LEAN_BLOCKS])
@pytest.mark.parametrize("channels_last,given", [(False, False), (False, True), (True, True)],
                         ids=["nchw", "nchw-stats", "cl-stats"])
def test_lean_preact_route_is_the_checked_route(backend, name, make, given, channels_last,
                                                 monkeypatch):
    """A fused pre-activation unit with the identity shortcut, or with a projection the route
    pairs with conv1, skips its checks once the checked route has run its arguments' key
    (fusedres.modules.lean.preact): the same route calls on the same tensors, so the same
    outputs, statistics handed on, gradients and running statistics to the bit, in training
    and eval, with and without the producer's statistics; and the checked route itself is
    still what a new key runs (an error there touches nothing)."""
    from fusedres import modules

    torch.manual_seed(0)
    block = make()
    x = torch.randn(4, _in_channels(block), 6, 6)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    stats = (x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)) if given else None
    twin = copy.deepcopy(block)
    modules.lean.KEYS.clear()
    calls = []
    checked = modules.ResidualBlock._forward_preact
    monkeypatch.setattr(modules.ResidualBlock, "_forward_preact",
                        lambda *a: calls.append(1) or checked(*a))
    lean = _lean_runs(block, x, stats, True)
    lean_calls = len(calls)
    monkeypatch.setattr(modules.lean, "preact", lambda *a: None)
    plain = _lean_runs(twin, x, stats, True)
    assert len(lean) == len(plain)
    for a, b in zip(lean, plain):
        assert torch.equal(a, b)
    # The checked route ran once per key (training, eval) where the lean route applies: a
    # projection only where the route has a pair.
    assert block.path == ("projection" if name.endswith(("down", "widen")) else "identity")
    applies = backend in (("cpu", "cuda") if block.path == "projection" else
                          ("cpu", "cuda", "triton"))
    assert lean_calls == (2 if applies else 5), (backend, lean_calls)


def test_lean_preact_route_keys_on_what_the_checks_read(monkeypatch):
    """A change the checks would refuse reaches them: a weight of another dtype after the
    key was cached (what ``module.double()`` on one submodule does) makes a new key, so the
    checked route runs and raises its error (the lean route would have launched the kernels
    on a float64 weight)."""
    block = fusedres.PreActBasicBlock(8, 8)
    x = torch.randn(2, 8, 5, 5)
    block(x)
    block(x)
    block.conv2.double()
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        block(x)


def test_lean_preact_route_keys_the_paired_projection():
    """The projection run beside conv1 is keyed too: its weight in another dtype after the key
    was cached reaches the checked route, which refuses it before any state changes."""
    block = fusedres.PreActBasicBlock(8, 16, stride=2)
    x = torch.randn(2, 8, 6, 6)
    block(x)
    block(x)
    block.shortcut.double()
    before = block.bn1.running_mean.clone()
    with pytest.raises(TypeError, match="dtype"):
        block(x)
    assert torch.equal(block.bn1.running_mean, before)


def test_lean_preact_route_survives_a_deep_copy(monkeypatch):
    """A deep copy of a fused block (its layer object copied too) still takes the lean route
    once its key has run."""
    from fusedres import modules

    block = copy.deepcopy(fusedres.PreActBasicBlock(8, 8))
    assert block.layer is not modules.FUSED
    x = torch.randn(2, 8, 5, 5)
    block(x)
    calls = []
    checked = modules.ResidualBlock._forward_preact
    monkeypatch.setattr(modules.ResidualBlock, "_forward_preact",
                        lambda *a: calls.append(1) or checked(*a))
    block(x)
    assert calls == []
