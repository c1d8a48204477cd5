"""He et al.'s unit orderings and shortcut variants, plain networks, units without BatchNorm and
stochastic depth: the fused and the plain layer against oracles written from the papers'
formulas (tests/oracles.py), keys, saved bytes, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import unit_oracle

import fusedres
from fusedres import models
from fusedres.modules import FUSED, PLAIN, SHORTCUTS, UNITS, BasicBlock, Bottleneck

F64 = torch.float64
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero"}


def _block(cls, cin, planes, stride, layer, **kw):
    args = (cin, planes, stride)
    return cls(*args, layer=layer, **kw).to(F64)


def _compare(block, oracle, x, seed=0, steps=2, train=True):
    """Forward, backward and running statistics of ``block`` and ``oracle`` agree (same seed
    before each forward, so random draws agree)."""
    block.train(train)
    oracle.train(train)
    for step in range(steps):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(seed + step)
        ya = block(xa)
        torch.manual_seed(seed + step)
        yb = oracle(xb)
        torch.testing.assert_close(ya, yb, rtol=1e-10, atol=1e-10)
        gy = torch.randn_like(ya)
        ya.backward(gy)
        yb.backward(gy)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-10)
        pb = dict(oracle.named_parameters())
        for name, p in block.named_parameters():
            if p.grad is None:
                assert pb[name].grad is None or not pb[name].grad.any(), name
            else:
                torch.testing.assert_close(p.grad, pb[name].grad, rtol=1e-10, atol=1e-10,
                                           msg=name)
        block.zero_grad()
        oracle.zero_grad()
        x = x * 1.3 + 0.2
    bb = dict(oracle.named_buffers())
    for name, b in block.named_buffers():
        torch.testing.assert_close(b, bb[name], rtol=1e-12, atol=1e-12, msg=name)


SHAPES = [  # (class, in_planes, planes, stride): identity and projection units
    (BasicBlock, 6, 6, 1),
    (BasicBlock, 4, 6, 2),
    (Bottleneck, 12, 3, 1),
    (Bottleneck, 4, 3, 2),
]
SHAPE_IDS = ["basic", "basic_proj", "bottleneck", "bottleneck_proj"]


def _check_ordering(unit, shape, layer):
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, layer, unit=unit)
    x = torch.randn(3, cin, 7, 7, dtype=F64)
    _compare(block, unit_oracle(block), x)
    _compare(block, unit_oracle(block), x, train=False, steps=1)


# The fused layer on every backend for the units with a projection (every chain kind: shared
# BN-ReLU, residual epilogue, ReLU-only); the rest on the default backend.
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=[SHAPE_IDS[1], SHAPE_IDS[3]])
@pytest.mark.parametrize("unit", UNITS)
def test_unit_orderings_every_backend(backend, unit, shape):
    _check_ordering(unit, shape, FUSED)


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("unit", UNITS)
def test_unit_orderings_match_oracle(unit, shape, layer):
    _check_ordering(unit, shape, layer)


SHORTCUT_ARGS = [
    ("identity", {}),
    ("scale", {"scale": 0.5}),
    ("scale", {"scale": 0.5, "scale_branch": True}),
    ("exclusive_gate", {"gate_bias": -2.0}),
    ("shortcut_gate", {"gate_bias": -2.0}),
    ("conv1x1", {}),
    ("dropout", {"shortcut_dropout": 0.5}),
    ("none", {}),
]


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("unit", ["preact", "original"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("shortcut,kw", SHORTCUT_ARGS,
                         ids=[f"{s}{'_b' if k.get('scale_branch') else ''}"
                              for s, k in SHORTCUT_ARGS])
def test_shortcut_variants_match_oracle(shortcut, kw, shape, unit, layer):
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, layer, unit=unit, shortcut=shortcut, **kw)
    if stride == 1 and shortcut not in ("none",):
        assert block.path == shortcut  # the variant applies where the shape is kept
    elif shortcut != "none":
        assert block.path == "projection"
    x = torch.randn(3, cin, 7, 7, dtype=F64)
    _compare(block, unit_oracle(block), x)
    _compare(block, unit_oracle(block), x, train=False, steps=1)


@pytest.mark.parametrize("unit", ["preact", "relu_only_preact"])
def test_units_without_batchnorm_every_backend(backend, unit):
    block = _block(BasicBlock, 4, 6, 2, FUSED, unit=unit, norm="none")
    _compare(block, unit_oracle(block), torch.randn(3, 4, 7, 7, dtype=F64))


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("unit", UNITS)
def test_units_without_batchnorm_match_oracle(unit, layer):
    block = _block(BasicBlock, 4, 6, 2, layer, unit=unit, norm="none")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in block.modules())
    assert all(c.bias is not None for c in block.convs)
    _compare(block, unit_oracle(block), torch.randn(3, 4, 7, 7, dtype=F64))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_row_drop_path_every_backend(backend, shape):
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, FUSED, drop_path=0.5, drop_path_mode="row")
    x = torch.randn(8, cin, 5, 5, dtype=F64)
    _compare(block, unit_oracle(block), x, seed=3, steps=2)


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("unit", ["preact", "original", "relu_only_preact"])
def test_row_drop_path_matches_torchvision(unit, shape, layer):
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, layer, unit=unit, drop_path=0.5,
                   drop_path_mode="row")
    x = torch.randn(8, cin, 5, 5, dtype=F64)
    _compare(block, unit_oracle(block), x, seed=3, steps=3)
    _compare(block, unit_oracle(block), x, train=False, steps=1)


def _seed_for(batch_kept: bool, p: float) -> int:
    """A seed whose first draw keeps (or drops) the branch in batch mode."""
    for seed in range(100):
        torch.manual_seed(seed)
        if bool(torch.empty(1, 1, 1, 1, dtype=F64).bernoulli_(1 - p)) == batch_kept:
            return seed
    raise AssertionError("no seed found")


@pytest.mark.parametrize("mode", ["batch", "batch_skip"])
@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_batch_drop_path_kept(shape, layer, mode):
    # Kept: as torchvision's stochastic_depth(mode="batch"), the branch scaled by 1 / keep.
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, layer, drop_path=0.5, drop_path_mode=mode)
    x = torch.randn(4, cin, 5, 5, dtype=F64)
    _compare(block, unit_oracle(block), x, seed=_seed_for(True, 0.5), steps=1)


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_batch_skip_drop_path_computes_nothing(shape, layer):
    cls, cin, planes, stride = shape
    block = _block(cls, cin, planes, stride, layer, drop_path=0.5, drop_path_mode="batch_skip")
    x = torch.randn(4, cin, 5, 5, dtype=F64)
    # Dropped: the shortcut alone; the branch computes nothing, its BatchNorms are untouched.
    before = copy.deepcopy(block.state_dict())
    xa = x.clone().requires_grad_()
    torch.manual_seed(_seed_for(False, 0.5))
    counter = fusedres.memory.SavedTensorCounter(exclude=block)
    with counter:
        y = block(xa)
    y.sum().backward()
    if block.shortcut is None:
        assert torch.equal(y, xa) or torch.equal(y, x)
        assert counter.total_bytes == 0
        assert all(p.grad is None for p in block.parameters())
    else:  # a projection: its BN-ReLU (pre-activation) and 1x1 conv run, nothing else
        assert block.conv1.weight.grad is None and block.shortcut.weight.grad is not None
    after = block.state_dict()
    for name in before:
        if name.startswith(("bn2", "bn3")) or (block.shortcut is None and name.startswith("bn1")):
            assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_batch_drop_path_dropped_on_the_device(shape, layer):
    """Dropped in "batch" mode: the output and the input's gradient are batch_skip's (the
    branch scaled by an exact 0); the branch still runs, so its parameters get zero gradients
    where batch_skip leaves none and its BatchNorms count the batch. No value is read on the
    host (no sync op in the profile)."""
    from torch.profiler import ProfilerActivity, profile

    cls, cin, planes, stride = shape
    device = _block(cls, cin, planes, stride, layer, drop_path=0.5, drop_path_mode="batch")
    skip = copy.deepcopy(device)
    skip.drop_path_mode = "batch_skip"
    x = torch.randn(4, cin, 5, 5, dtype=F64)
    before = copy.deepcopy(device.state_dict())
    out = {}
    for name, block in (("device", device), ("skip", skip)):
        xa = x.clone().requires_grad_()
        torch.manual_seed(_seed_for(False, 0.5))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = block(xa)
            y.backward(torch.ones_like(y))
        syncs = [e.name for e in prof.events() if e.name in SYNC_OPS]
        out[name] = (y.detach(), xa.grad, dict(block.named_parameters()), syncs)
    (y_d, gx_d, p_d, syncs_d), (y_s, gx_s, p_s, syncs_s) = out["device"], out["skip"]
    assert syncs_d == [] and "aten::is_nonzero" in syncs_s
    if device.shortcut is None:  # the shortcut alone, to the bit
        assert torch.equal(y_d, y_s) and torch.equal(gx_d, gx_s)
    else:  # the projection's convolution runs with conv1 (stacked/paired) in "batch" mode
        torch.testing.assert_close(y_d, y_s, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx_d, gx_s, rtol=1e-12, atol=1e-12)
    for name, p in p_d.items():
        if p_s[name].grad is None:
            assert p.grad is not None and not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, p_s[name].grad, rtol=1e-12, atol=1e-12,
                                       msg=name)
    for name, b in device.state_dict().items():
        if name.startswith(("bn2", "bn3")) and name.endswith("num_batches_tracked"):
            assert b == before[name] + 1, name  # the batch counted, as in a kept unit


def test_drop_path_linear_rule_and_eval():
    m = models.preact_resnet(20, num_classes=3, drop_path_rate=0.3)
    rates = [u.drop_path for u in m.units()]
    assert rates == pytest.approx([0.3 * (i + 1) / 9 for i in range(9)])
    m.eval()
    ref = models.preact_resnet(20, num_classes=3)
    ref.load_state_dict(m.state_dict())
    ref.eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))  # eval: every unit, unscaled


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("shortcut", SHORTCUTS)
def test_models_fused_and_plain_agree(unit, shortcut):
    kw = dict(num_classes=3, unit=unit, shortcut=shortcut)
    if shortcut == "dropout":
        kw["shortcut_dropout"] = 0.2
    fused = models.preact_resnet(8, **kw).double()
    plain = models.preact_resnet(8, fused=False, **kw).double()
    assert list(fused.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 3, 8, 8, dtype=F64)
    for model in (fused, plain):
        torch.manual_seed(0)
        model.zero_grad()
        model(x).square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)
    for (name, a), b in zip(fused.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("depth", [8, 20, 56, 110])
def test_plain_networks_have_no_shortcuts(depth):
    m = models.preact_resnet(depth, shortcut="none", norm="none")
    assert all(u.shortcut is None and u.path == "none" for u in m.units())
    assert not any(isinstance(x, torch.nn.BatchNorm2d) for x in m.modules())
    assert len(m.units()) == (depth - 2) // 2


def test_stem_and_head_follow_the_unit():
    pre = models.preact_resnet(8, unit="preact")
    post = models.preact_resnet(8, unit="original")
    assert pre.stem_bn is None and pre.bn is not None
    assert post.stem_bn is not None and post.bn is None
    keys = set(post.state_dict())
    assert "layer1.0.bn1.weight" in keys and post.layer1[0].bn1.num_features == 16


def _saved(block, x):
    return fusedres.memory.saved_bytes(block, x)


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fused_saves_less_in_every_ordering(unit, shape):
    cls, cin, planes, stride = shape
    fused = cls(cin, planes, stride, unit=unit)
    plain = cls(cin, planes, stride, unit=unit, fused=False)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(4, cin, 8, 8)
    s_f, s_p = _saved(fused, x), _saved(plain, x)
    # Each fused chain stops storing one activated copy: relu(bn(t)) has t's size.
    assert fused.fused_chains >= 1
    assert s_f < s_p, (s_f, s_p)


def test_saved_bytes_of_preact_basic_unit_exact():
    # Fused: x, conv1's output (bn2's input) and the per-channel vectors; plain also keeps
    # both activated copies and bn's normalised inputs (float32, batch 4, 8x8).
    x = torch.randn(4, 6, 8, 8)
    fused = BasicBlock(6, 6)
    plain = BasicBlock(6, 6, fused=False)
    n = x.numel() * 4
    s_f, s_p = _saved(fused, x), _saved(plain, x)
    assert s_f - 2 * n < 1024  # two activations of n bytes, plus (C,) vectors
    assert s_p >= 4 * n


@pytest.mark.parametrize("kwargs,match", [
    ({"unit": "postact"}, "unit: expected one of"),
    ({"shortcut": "gated"}, "shortcut: expected one of"),
    ({"norm": "layer"}, "norm: expected one of"),
    ({"drop_path": 1.0}, r"drop_path: expected a probability in \[0, 1\)"),
    ({"drop_path": -0.1}, "drop_path"),
    ({"drop_path_mode": "sample"}, "drop_path_mode: expected one of"),
    ({"gate_bias": -6.0}, "gate_bias: only the shortcut 'exclusive_gate' or 'shortcut_gate'"),
    ({"shortcut": "scale", "gate_bias": 1.0}, "gate_bias"),
    ({"scale": 0.5}, "scale: only the shortcut 'scale'"),
    ({"shortcut": "dropout", "shortcut_dropout": 1.0}, "shortcut_dropout: expected"),
    ({"shortcut": "none", "drop_path": 0.1}, "drop_path: a unit without shortcut"),
])
def test_bad_unit_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BasicBlock(4, 4, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"unit": "x"}, "unit"),
    ({"drop_path_rate": 1.0}, "drop_path_rate"),
    ({"drop_path_rate": True}, "drop_path_rate"),
    ({"shortcut": "none", "drop_path_rate": 0.2}, "drop_path_rate"),
])
def test_bad_model_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.preact_resnet(20, **kwargs)


def test_bad_input_leaves_running_stats_alone():
    block = BasicBlock(4, 8, 2, unit="original")
    before = copy.deepcopy(block.state_dict())
    with pytest.raises((ValueError, RuntimeError)):
        block(torch.randn(2, 5, 6, 6))  # wrong channel count
    for k, v in block.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_planner_takes_stochastic_depth(mode):
    # The planner's simulated step has no values: a batch-mode unit is planned as kept (the
    # worst case), a row-mode one keeps its (N,) draw.
    net = models.preact_resnet(20, num_classes=3, drop_path_rate=0.5, drop_path_mode=mode)
    ref = models.preact_resnet(20, num_classes=3)
    shape = (8, 3, 16, 16)
    plan = fusedres.memory.plan(net, shape, budget_bytes=2**30)
    base = fusedres.memory.plan(ref, shape, budget_bytes=2**30)
    extra = plan.step.saved_after_forward - base.step.saved_after_forward
    assert extra == 9 * 4 * (8 if mode == "row" else 1)  # one draw per unit: (N,) or (1,)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_model_with_stochastic_depth_fused_matches_plain(backend, mode):
    # Units hand their output's statistics to the next one through the fused op's epilogue,
    # with the branch scale applied: the fused and plain networks draw alike and agree.
    kw = dict(num_classes=3, drop_path_rate=0.6, drop_path_mode=mode)
    fused = models.preact_resnet(8, **kw).double()
    plain = models.preact_resnet(8, fused=False, **kw).double()
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(6, 3, 6, 6, dtype=F64)
    for step in range(2):
        for model in (fused, plain):
            torch.manual_seed(step)
            model.zero_grad()
            model(x).square().sum().backward()
        for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
            if a.grad is None:
                assert b.grad is None, name
            else:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)
    for (name, a), b in zip(fused.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
