"""fusedres.models: the pre-activation ResNet zoo, fused vs plain, checkpointing."""

import copy

import pytest
import torch
import torch.nn as nn

import fusedres
from conftest import FUSED_BACKENDS
from fusedres import models
from fusedres.modules import PreActBasicBlock, PreActBottleneck
from helpers import OpCounter

# Whole networks on every compiled/portable backend. Triton runs here under its interpreter
# (Python speed), so it gets the smallest net only; tests/test_ops.py covers its numerics.
NET_BACKENDS = [b for b in FUSED_BACKENDS if b != "triton"]


@pytest.fixture(params=NET_BACKENDS)
def backend(request):
    with fusedres.use_backend(request.param):
        yield request.param


@pytest.fixture(params=FUSED_BACKENDS)
def any_backend(request):
    with fusedres.use_backend(request.param):
        yield request.param

# Parameter counts of the CIFAR nets (10 classes). He et al. report ResNet-164 as 1.7M and
# ResNet-1001 as 10.2M; these are the exact counts of the architecture they describe.
CIFAR_PARAMS = {20: 272_282, 56: 855_578, 110: 1_730_522, 164: 1_703_258, 1001: 10_327_706}


@pytest.mark.parametrize("depth", sorted(CIFAR_PARAMS))
def test_cifar_param_counts(depth):
    m = models.MODELS[f"preact_resnet{depth}"]()
    assert m.num_params() == CIFAR_PARAMS[depth]
    assert f"params={CIFAR_PARAMS[depth] / 1e6:.3f}M" in repr(m)


def test_paper_param_counts():
    assert round(models.preact_resnet164().num_params() / 1e6, 1) == 1.7
    assert abs(models.preact_resnet1001().num_params() / 1e6 - 10.2) < 0.15


def test_imagenet_param_counts():
    # torchvision's (post-activation) ResNet-18 / 50 have 11.69M / 25.56M; the pre-activation
    # nets differ only in where the BNs sit (no BN after the stem; one final BN instead).
    assert models.preact_resnet18().num_params() == 11_687_720
    assert models.preact_resnet50().num_params() == 25_549_352


def test_cifar_architecture_164():
    m = models.preact_resnet164()
    units = m.units()
    assert len(units) == 54 and all(isinstance(u, PreActBottleneck) for u in units)
    assert m.conv1.weight.shape == (16, 3, 3, 3)
    assert [getattr(m, f"layer{i}")[-1].conv3.out_channels for i in (1, 2, 3)] == [64, 128, 256]
    first2 = m.layer2[0]
    assert first2.conv1.stride == (2, 2) and first2.conv2.stride == (1, 1)  # stride on the 1x1
    assert first2.shortcut is not None and first2.shortcut.stride == (2, 2)
    assert m.layer1[0].shortcut is not None  # 16 -> 64
    assert all(u.shortcut is None for u in units if u not in (m.layer1[0], m.layer2[0],
                                                              m.layer3[0]))
    assert m.bn.num_features == 256 and m.fc.in_features == 256


def test_cifar_architecture_basic():
    m = models.preact_resnet20()
    assert all(isinstance(u, PreActBasicBlock) for u in m.units())
    assert [getattr(m, f"layer{i}")[0].conv1.out_channels for i in (1, 2, 3)] == [16, 32, 64]
    assert m.layer1[0].shortcut is None and m.layer2[0].shortcut is not None


def test_init():
    m = models.preact_resnet20()
    conv = m.layer2[0].conv1
    fan_out = conv.out_channels * 9
    assert abs(conv.weight.std().item() - (2 / fan_out) ** 0.5) < 0.1 * (2 / fan_out) ** 0.5
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            assert torch.all(mod.weight == 1) and torch.all(mod.bias == 0)
    z = models.preact_resnet20(zero_init_last=True)
    assert all(torch.all(u.conv2.weight == 0) for u in z.units())
    z = models.preact_resnet164(zero_init_last=True)
    assert all(torch.all(u.conv3.weight == 0) for u in z.units())
    assert not torch.all(z.layer1[0].conv2.weight == 0)


@pytest.mark.parametrize("depth,variant,match", [
    (21, "cifar", "6n\\+2"), (2, "cifar", "depth 2"), (165, "cifar", "9n\\+2"),
    (19, "imagenet", "18, 34, 50, 101, 152, 200"),
])
def test_invalid_depth(depth, variant, match):
    with pytest.raises(ValueError, match=match):
        models.preact_resnet(depth, variant=variant)


def test_block_choice():
    assert models.preact_resnet(29).block == "bottleneck"  # 9n+2 only
    assert models.preact_resnet(56).block == "basic"
    assert models.preact_resnet(56, block="bottleneck").block == "bottleneck"
    with pytest.raises(ValueError, match="depth 14 with bottleneck"):
        models.preact_resnet(14, block="bottleneck")
    with pytest.raises(ValueError, match="variant"):
        models.preact_resnet(20, variant="mnist")


def test_named_constructors_take_kwargs():
    m = models.preact_resnet56(num_classes=100, fused=False, in_chans=1, zero_init_last=True)
    assert m.fc.out_features == 100 and m.conv1.in_channels == 1 and not m.fused
    assert models.preact_resnet50().fc.out_features == 1000
    assert models.preact_resnet50(stride_on="conv2").layer2[0].conv2.stride == (2, 2)


def test_reset_classifier():
    m = models.preact_resnet20()
    m.reset_classifier(7)
    assert m.get_classifier().out_features == 7 and m(torch.randn(2, 3, 8, 8)).shape == (2, 7)


def _pair(depth, dtype, **kw):
    fused = models.preact_resnet(depth, fused=True, **kw).to(dtype)
    plain = models.preact_resnet(depth, fused=False, **kw).to(dtype)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out.float() ** 2).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_same_step(fused, plain, x, rtol, atol):
    out_f, g_f = _step(fused, x)
    out_p, g_p = _step(plain, x)
    torch.testing.assert_close(out_f, out_p, rtol=rtol, atol=atol)
    for name in g_p:
        scale = g_p[name].abs().max().item() + 1e-30
        torch.testing.assert_close(g_f[name] / scale, g_p[name] / scale, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for (name, b_f), b_p in zip(fused.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b_f, b_p, rtol=rtol, atol=atol, msg=lambda m, n=name: n + m)


@pytest.mark.parametrize("depth,shape", [(20, (2, 3, 13, 13)), (164, (2, 3, 7, 7))])
def test_fused_matches_plain_float64(backend, depth, shape):
    fused, plain = _pair(depth, torch.float64)
    _assert_same_step(fused, plain, torch.randn(shape, dtype=torch.float64), 1e-9, 1e-10)


def test_fused_matches_plain_float32_eval_and_train(backend):
    fused, plain = _pair(20, torch.float32, num_classes=5, in_chans=5)
    x = torch.randn(2, 5, 13, 13)
    _assert_same_step(fused, plain, x, 1e-4, 1e-5)  # measured max ~1e-6 relative
    fused.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-5)


def test_smallest_nets_every_backend(any_backend):
    for depth in (8, 11):  # one basic and one bottleneck unit per stage
        fused, plain = _pair(depth, torch.float64, num_classes=3)
        _assert_same_step(fused, plain, torch.randn(2, 3, 5, 5, dtype=torch.float64), 1e-9,
                          1e-10)


def test_imagenet_fused_matches_plain(backend):
    fused, plain = _pair(18, torch.float64, variant="imagenet", num_classes=7)
    # A 3x3x33x33 input: 2x2 in the last stage, 12 values per channel for its BNs.
    _assert_same_step(fused, plain, torch.randn(3, 3, 33, 33, dtype=torch.float64), 1e-9,
                      1e-10)


def test_fused_matches_plain_56_default_backend():
    fused, plain = _pair(56, torch.float64)
    _assert_same_step(fused, plain, torch.randn(3, 3, 8, 8, dtype=torch.float64), 1e-9, 1e-10)


@pytest.mark.parametrize("depth", [20, 11])
def test_units_hand_their_output_statistics_to_the_next(any_backend, depth):
    """Training: only the first unit's BatchNorm runs a statistics pass; every other BatchNorm
    of the units gets its statistics from the convolution that produced its input."""
    model = models.preact_resnet(depth, num_classes=3)
    plain = models.preact_resnet(depth, num_classes=3, fused=False)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 5, 5)
    with OpCounter() as ops:
        y = model(x)
    bns = sum(isinstance(m, nn.BatchNorm2d) for u in model.units() for m in u.modules())
    assert ops.count("batch_stats") == 1
    assert ops.count("bn_relu_conv2d_genstats") == bns - 1
    # The same step as the plain network: output and running statistics.
    torch.testing.assert_close(y, plain(x), rtol=1e-4, atol=1e-5)
    for (name, b), pb in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, pb, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: n + m)


def test_hooked_unit_sees_a_tensor_and_computes_its_own_statistics():
    model = models.preact_resnet(20, num_classes=3)
    seen = []
    model.units()[3].register_forward_hook(lambda m, i, o: seen.append(type(o)))
    with OpCounter() as ops:
        model(torch.randn(2, 3, 5, 5))
    assert seen == [torch.Tensor]
    assert ops.count("batch_stats") == 2  # the first unit, and the unit after the hooked one


def test_pre_hook_that_changes_the_input_gets_its_statistics_recomputed():
    """A forward pre-hook on the receiving unit may replace its input: the producer's statistics
    no longer describe it, so none are handed over (fused == plain, running stats included)."""
    fused = models.preact_resnet(20, num_classes=3).double()
    plain = models.preact_resnet(20, num_classes=3, fused=False).double()
    plain.load_state_dict(fused.state_dict())
    for model in (fused, plain):
        model.units()[1].register_forward_pre_hook(lambda m, args: (3 * args[0] + 1,))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    _assert_same_step(fused, plain, x, 1e-9, 1e-10)


def test_backward_hook_sees_one_output_gradient():
    model = models.preact_resnet(20, num_classes=3)
    seen = []
    model.units()[2].register_full_backward_hook(lambda m, gi, go: seen.append(len(go)))
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    assert seen == [1]


def test_global_pre_hook_turns_the_hand_over_off():
    model = models.preact_resnet(20, num_classes=3)
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    try:
        with OpCounter() as ops:
            model(torch.randn(2, 3, 5, 5))
    finally:
        handle.remove()
    assert ops.count("batch_stats") == len(model.units())


def test_state_dict_round_trip():
    plain = models.preact_resnet164(fused=False, num_classes=3)
    x = torch.randn(2, 3, 8, 8)
    plain.train()
    plain(x)  # move the running statistics off their initial values
    fused = models.preact_resnet164(num_classes=3)
    fused.load_state_dict(plain.state_dict())
    back = models.preact_resnet164(fused=False, num_classes=3)
    back.load_state_dict(fused.state_dict())
    for (k, a), b in zip(plain.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    plain.eval()
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-5)


def test_fused_saves_less_than_plain():
    fused, plain = _pair(20, torch.float32)
    x = torch.randn(2, 3, 16, 16)
    s_f = fusedres.memory.saved_bytes(fused, x)
    s_p = fusedres.memory.saved_bytes(plain, x)
    assert s_f < 0.6 * s_p


@pytest.mark.parametrize("segments", [True, 2, 4, [(1, 3), (5, 9)]])
def test_grad_checkpointing_same_step(segments):
    ref = models.preact_resnet20(num_classes=4).double()
    ck = copy.deepcopy(ref)
    ck.set_grad_checkpointing(segments)
    assert ck.checkpoint_ranges
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    _assert_same_step(ck, ref, x, 1e-12, 1e-12)
    ck.set_grad_checkpointing(0)
    assert ck.checkpoint_ranges == []
    ck.set_grad_checkpointing(False)
    assert ck.checkpoint_ranges == []


def test_grad_checkpointing_rejects_bad_ranges():
    m = models.preact_resnet20()
    with pytest.raises(ValueError, match="segments"):
        m.set_grad_checkpointing([(3, 2)])
    with pytest.raises(ValueError, match="segments"):
        m.set_grad_checkpointing([(0, 10)])
    with pytest.raises(ValueError, match="segments"):
        m.set_grad_checkpointing(-1)
