"""fusedres.fuse through the rewriters registered per block class (fusedres/convert/rewriters.py):
timm's ResNetV2, torchvision's ResNet blocks and DenseNet, fusedres's own zoo.

Each model: fused in place (the same object and class; fused blocks are subclasses of their
class with every method), the same training step as the plain model in float64 (outputs,
parameter gradients, running statistics) and eval outputs, state_dicts both ways, the report's
counts, and the memory: fewer saved activations, and with the model's own checkpointing on a
lower whole-step peak than checkpointing alone (fusedres.memory.simulate_step, the same
accounting the planner uses: the recomputed segment is what fusing shrinks there).
"""

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import fusedres
from fusedres import models
from fusedres.convert.rewriters import Chain, Rewriter, is_fused, register_rewriter
from fusedres.memory import saved_bytes, simulate_step

timm = pytest.importorskip("timm")  # in requirements-dev.txt; the library never needs it
torchvision = pytest.importorskip("torchvision")
from timm.layers import BatchNormAct2d, create_conv2d  # noqa: E402
from timm.models.resnetv2 import PreActBasic, PreActBottleneck, ResNetStage, ResNetV2  # noqa: E402


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _assert_same_step(fused, ref, x, tol=1e-10):
    """One training step and an eval forward of ``fused`` and ``ref`` agree (float64)."""
    out_f, g_f = _step(fused, x)
    out_r, g_r = _step(ref, x)
    torch.testing.assert_close(out_f, out_r, rtol=tol, atol=tol)
    assert g_f.keys() == g_r.keys()
    for k in g_r:
        torch.testing.assert_close(g_f[k], g_r[k], rtol=tol, atol=tol, msg=lambda m, k=k: k + m)
    for (k, b_r), b_f in zip(ref.named_buffers(), fused.buffers()):
        torch.testing.assert_close(b_f, b_r, rtol=tol, atol=tol, msg=lambda m, k=k: k + m)
    fused.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), rtol=tol, atol=tol)
    fused.train()
    ref.train()


def _fuse_copy(model):
    """(plain reference, fused copy, report), float64."""
    ref = model.double()
    target = copy.deepcopy(ref)
    fused, report = fusedres.fuse(target, return_report=True)
    assert fused is target and type(fused) is type(ref)
    assert list(fused.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(fused.state_dict()[k], v), k
    return ref, fused, report


def _peak(model, shape):
    """Whole-step tensor peak (bytes) of a training step, simulated (no kernel workspace: the
    tensors autograd and the step keep, as the planner counts them)."""
    return simulate_step(model, shape, workspace=False).tensor_peak_bytes


# --------------------------------------------------------------------------- timm

def _small_resnetv2(basic=False, **kw):
    # timm's resnetv2_50 / resnetv2_18 layers (create_conv2d, BatchNormAct2d), fewer and
    # narrower stages: the same block and stage classes.
    return ResNetV2(layers=[2, 2], channels=(32, 64) if not basic else (16, 32), stem_chs=16,
                    conv_layer=create_conv2d, norm_layer=BatchNormAct2d, basic=basic,
                    num_classes=5, **kw)


@pytest.mark.parametrize("basic", [False, True], ids=["bottleneck", "basic"])
def test_timm_resnetv2_same_step_every_method(basic):
    torch.manual_seed(0)
    ref, fused, report = _fuse_copy(_small_resnetv2(basic))
    block_cls = PreActBasic if basic else PreActBottleneck
    blocks = [b for s in fused.stages for b in s.blocks]
    assert len(blocks) == 4 and all(isinstance(b, block_cls) and is_fused(b) for b in blocks)
    assert all(type(b) is not block_cls for b in blocks)
    assert all(is_fused(s) and isinstance(s, ResNetStage) for s in fused.stages)
    k = 2 if basic else 3
    assert report.fused == 4 * k and report.fused_residual_adds == 4
    # The projection shortcuts share norm1 (PreActBasic projects only where the shape changes).
    assert report.fused_convs == 4 * k + (1 if basic else 2)
    assert [c.path for c in report.left] == ["norm"]  # feeds the pooling
    assert {by for _, by in report.rewritten} == {"timm.PreAct", "timm.ResNetStage"}
    x = torch.randn(2, 3, 20, 20, dtype=torch.float64)
    _assert_same_step(fused, ref, x)
    # timm's methods, on the fused model and its blocks.
    feats = fused.forward_features(x)
    torch.testing.assert_close(fused.forward_head(feats), ref.forward_head(ref.forward_features(x)))
    _, inter = fused.forward_intermediates(x)
    assert len(inter) == 3
    blocks[0].zero_init_last()
    assert not blocks[0].conv3.weight.any() if not basic else not blocks[0].conv2.weight.any()
    ref.load_state_dict(fused.state_dict())
    fused.load_state_dict(ref.state_dict())
    fused.reset_classifier(3)
    assert fused(x).shape == (2, 3)
    assert fused.get_classifier() is fused.head.fc


def test_timm_create_model_two_lines():
    # The goal: timm.create_model + fusedres.fuse give a timm model with every method,
    # at most 0.55x the saved activations (float32, counted exactly).
    torch.manual_seed(0)
    plain = timm.create_model("resnetv2_50", num_classes=10)
    model = timm.create_model("resnetv2_50", num_classes=10)
    model.load_state_dict(plain.state_dict())
    fused = fusedres.fuse(model)
    assert fused is model and type(model) is ResNetV2
    assert model.pretrained_cfg == plain.pretrained_cfg
    for name in ("set_grad_checkpointing", "forward_features", "forward_head", "reset_classifier",
                 "get_classifier", "group_matcher", "forward_intermediates"):
        assert callable(getattr(model, name)), name
    assert model.fuse_report.fused == 48 and len(model.fuse_report.left) == 1
    x = torch.randn(2, 3, 64, 64)
    ratio = saved_bytes(model, x) / saved_bytes(plain, x)
    assert ratio <= 0.55, ratio


def test_timm_checkpointing_kept_counted_once_and_smaller():
    torch.manual_seed(0)
    ref, fused, _ = _fuse_copy(_small_resnetv2())
    ck = copy.deepcopy(fused)
    ck.set_grad_checkpointing(True)  # timm's method sets each stage's grad_checkpointing
    assert all(s.grad_checkpointing for s in ck.stages)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    # The fused stages recompute with fusedres's checkpoint: the same step as the plain model
    # without checkpointing, running statistics included (counted once) ...
    _assert_same_step(ck, ref, x)
    assert int(ck.stages[0].blocks[0].norm1.num_batches_tracked) == 1
    # ... where timm's own checkpoint_seq counts the batch twice.
    plain_ck = copy.deepcopy(ref)
    plain_ck.set_grad_checkpointing(True)
    counted = plain_ck.stages[0].blocks[0].norm1.num_batches_tracked
    before = int(counted)
    plain_ck(x).sum().backward()
    assert int(counted) == before + 2
    # Memory (float32): fused + checkpointing below either alone.
    plain32 = _small_resnetv2()
    fused32 = fusedres.fuse(copy.deepcopy(plain32))
    shape = (4, 3, 32, 32)
    x32 = torch.randn(shape)
    peaks, saved = {}, {}
    for ck_on in (False, True):
        for name, m in (("plain", plain32), ("fused", fused32)):
            m.set_grad_checkpointing(ck_on)
            peaks[name, ck_on] = _peak(m, shape)
            saved[name, ck_on] = saved_bytes(m, x32)
    assert peaks["fused", True] < peaks["plain", True] < peaks["plain", False]
    assert peaks["fused", True] < peaks["fused", False] < peaks["plain", False]
    # Saved after the forward: a checkpointed block keeps only its input, fused or not.
    assert saved["fused", True] == saved["plain", True] < saved["fused", False]


def test_timm_drop_path_draws_as_timm():
    torch.manual_seed(0)
    ref, fused, _ = _fuse_copy(_small_resnetv2(drop_path_rate=0.5))
    assert fused.stages[1].blocks[1].drop_path.drop_prob > 0
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for seed in range(3):  # the same draws: the same samples dropped, the same step
        torch.manual_seed(seed)
        out_f, g_f = _step(fused, x)
        torch.manual_seed(seed)
        out_r, g_r = _step(ref, x)
        torch.testing.assert_close(out_f, out_r, rtol=1e-10, atol=1e-10)
        for k in g_r:
            torch.testing.assert_close(g_f[k], g_r[k], rtol=1e-10, atol=1e-10)


def test_timm_blocks_that_do_not_fuse_are_declined_with_reasons():
    # BiT's layers (GroupNormAct, weight-standardised StdConv2d): nothing to fuse, said why;
    # avg_down's strided DownsampleAvg (the BN-ReLU feeds a pooling): the block is declined
    # and the fx fallback fuses the chains it can (norm2 -> conv2, norm3 -> conv3); unstrided
    # (no pooling) it is a projection like DownsampleConv's.
    bit = ResNetV2(layers=[1, 1], channels=(128, 256), stem_chs=32, num_classes=3)
    _, fused, report = _fuse_copy(bit)
    assert report.fused == 0 and not any(is_fused(b) for s in fused.stages for b in s.blocks)
    assert {r.split(",")[0] for _, name, r in report.declined if name == "timm.PreAct"} == {
        "norm1 is a GroupNormAct"}
    torch.manual_seed(0)
    ref, fused, report = _fuse_copy(_small_resnetv2(avg_down=True))
    declined = [(p, r) for p, name, r in report.declined if name == "timm.PreAct"]
    assert [p for p, _ in declined] == ["stages.1.blocks.0"]
    assert "DownsampleAvg with a pooling" in declined[0][1]
    by = {c.path: (c.by, c.fused) for c in report.chains}
    assert by["stages.0.blocks.0.norm1"] == ("timm.PreAct", True)
    assert by["stages.1.blocks.0.norm1"] == ("torch.fx", False)
    assert by["stages.1.blocks.0.norm2"] == by["stages.1.blocks.0.norm3"] == ("torch.fx", True)
    assert report.fused == 11
    _assert_same_step(fused, ref, torch.randn(2, 3, 16, 16, dtype=torch.float64))


def test_timm_fused_model_deepcopies_and_pickles():
    torch.manual_seed(0)
    _, fused, _ = _fuse_copy(_small_resnetv2())
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    fused.eval()
    want = fused(x)
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert type(clone) is ResNetV2 and is_fused(clone.stages[0].blocks[0])
        assert isinstance(clone.stages[0].blocks[0], PreActBottleneck)
        torch.testing.assert_close(clone(x), want, rtol=0, atol=0)
    again, report = fusedres.fuse(fused, return_report=True)
    assert again is fused and report.fused == 0 and len(report.already) == 2  # the stages


# --------------------------------------------------------------------------- torchvision

def test_torchvision_bottleneck_resnet():
    from torchvision.models.resnet import Bottleneck, ResNet

    torch.manual_seed(0)
    ref, fused, report = _fuse_copy(ResNet(Bottleneck, [1, 1, 1, 1], num_classes=4))
    assert all(is_fused(getattr(fused, f"layer{i}")[0]) for i in range(1, 5))
    assert report.fused == 8 and report.fused_residual_adds == 0  # bn1, bn2 of each block
    assert {by for _, by in report.rewritten} == {"torchvision.Bottleneck"}
    _assert_same_step(fused, ref, torch.randn(2, 3, 33, 33, dtype=torch.float64), 1e-9)
    x = torch.randn(2, 3, 64, 64)
    assert saved_bytes(fused.float(), x) < 0.9 * saved_bytes(ref.float(), x)


def _densenet(memory_efficient=False):
    return torchvision.models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                                       bn_size=2, num_classes=3, memory_efficient=memory_efficient)


def test_torchvision_densenet_and_its_memory_efficient_recompute():
    torch.manual_seed(0)
    ref, fused, report = _fuse_copy(_densenet())
    # 4 dense layers x 2 chains, 1 transition; norm0 feeds a pool, norm5 the head's pooling.
    assert report.fused == 9 and sorted(c.path for c in report.left) == [
        "features.norm0", "features.norm5"]
    x = torch.randn(2, 3, 24, 24, dtype=torch.float64)
    _assert_same_step(fused, ref, x)
    # memory_efficient: the fused layer recomputes its concatenation and conv1 as torchvision
    # does, counting the batch once in norm1's running statistics (torchvision: twice).
    ck = copy.deepcopy(fused)
    for layer in ck.modules():
        if hasattr(layer, "memory_efficient"):
            layer.memory_efficient = True
    counted = ck.features.denseblock1.denselayer2.norm1.num_batches_tracked
    before = int(counted)
    _assert_same_step(ck, ref, x)
    assert int(counted) == before + 1
    plain_ck = _densenet(memory_efficient=True).double()
    plain_ck.load_state_dict(ref.state_dict())
    counted = plain_ck.features.denseblock1.denselayer2.norm1.num_batches_tracked
    before = int(counted)
    plain_ck(x.requires_grad_()).sum().backward()
    assert int(counted) == before + 2
    # Saved activations (float32): fused + memory_efficient below either alone.
    torch.manual_seed(0)
    x32 = torch.randn(2, 3, 32, 32)
    plain, plain_me = _densenet(), _densenet(True)
    fused32, fused_me = fusedres.fuse(_densenet()), fusedres.fuse(_densenet(True))
    s = {name: saved_bytes(m, x32.requires_grad_()) for name, m in (
        ("plain", plain), ("plain_me", plain_me), ("fused", fused32), ("fused_me", fused_me))}
    assert s["fused_me"] < s["plain_me"] < s["plain"], s
    assert s["fused_me"] < s["fused"] < s["plain"], s


# --------------------------------------------------------------------------- fusedres's zoo

def test_fusedres_plain_zoo_with_segment_recompute():
    # The plain zoo model fuses by its layer switch; its set_grad_checkpointing (fusedres's
    # segment recompute) is kept, and fused + segments peaks below either alone.
    torch.manual_seed(0)
    plain = models.preact_resnet20(num_classes=4, fused=False)
    fused, report = fusedres.fuse(copy.deepcopy(plain), return_report=True)
    assert type(fused) is type(plain) and fused.fused and all(u.fused for u in fused.units())
    assert report.fused == 18 and {by for _, by in report.rewritten} == {
        "fusedres.ResidualBlock", "fusedres.PreActResNet"}
    shape = (8, 3, 16, 16)
    peaks = {}
    for segments in (0, 3):
        for name, m in (("plain", plain), ("fused", fused)):
            m.set_grad_checkpointing(segments)
            peaks[name, segments] = _peak(m, shape)
    assert peaks["fused", 3] < peaks["plain", 3] < peaks["plain", 0]
    assert peaks["fused", 3] < peaks["fused", 0] < peaks["plain", 0]
    ref = plain.double()
    ck = copy.deepcopy(fused).double()
    ck.set_grad_checkpointing(3)
    ref.set_grad_checkpointing(0)
    _assert_same_step(ck, ref, torch.randn(2, 3, 9, 9, dtype=torch.float64), 1e-9)


# --------------------------------------------------------------------------- user rewriters

class Unit(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x):
        return x + self.conv(torch.relu(self.bn(x)))

    def scale(self):
        return 2


def _unit_forward(self, x):
    fused_conv = fusedres.modules.conv
    fusedres.modules.check_inputs(x, self.conv)
    return fused_conv(fusedres.modules.prepare(self.bn, x), self.conv, residual=x)


def test_register_rewriter_for_a_user_class():
    rw = Rewriter("test.Unit", lambda m: None, lambda m: [Chain("bn", ("conv",), True)],
                  swap={"forward": _unit_forward})
    register_rewriter(Unit, rw)
    try:
        net = nn.Sequential(Unit(), Unit()).double()
        ref = copy.deepcopy(net)
        fused, report = fusedres.fuse(net, return_report=True)
        assert report.rewritten == [("0", "test.Unit"), ("1", "test.Unit")]
        assert report.fused_residual_adds == 2 and fused[0].scale() == 2
        _assert_same_step(fused, ref, torch.randn(2, 4, 5, 5, dtype=torch.float64))
    finally:
        fusedres.convert.rewriters._REGISTRY.pop(f"{Unit.__module__}.{Unit.__qualname__}")
    with pytest.raises(TypeError, match="rewriter: expected"):
        register_rewriter(Unit, object())
    with pytest.raises(ValueError, match="exactly one of swap= and apply="):
        Rewriter("x", lambda m: None, lambda m: [])
