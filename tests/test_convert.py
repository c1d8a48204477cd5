"""fusedres.fuse on models written the way users write them, in different styles (code no
rewriter knows: the torch.fx fallback; tests/test_fuse_rewriters.py has the rewriters).

Each model is checked for: fusing in place (the same object, an instance of its class), the
same state_dict (keys and values), the same outputs, parameter gradients and running
statistics after a training step, the same eval outputs, the report's counts, and that fusing
lowers the saved activations where a chain was fused.
"""

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedres
from fusedres import models
from fusedres.convert import FuseReport, fuse
from fusedres.memory import saved_bytes

# The graph rewriting does not depend on the backend: the tests run on the default one, and
# one model runs on each backend (Triton runs under its interpreter here, at Python speed).
NET_BACKENDS = [b for b in fusedres.available_backends() if b != "reference"]

try:  # the real thing when it is installed; never a dependency
    from timm.layers import BatchNormAct2d as TimmBatchNormAct2d
except ImportError:  # pragma: no cover - depends on the environment
    TimmBatchNormAct2d = None


# --------------------------------------------------------------------------- user models

class KuangliuPreActBlock(nn.Module):
    """Style of the popular pytorch-cifar repository: F.relu, optional Sequential shortcut
    created conditionally and tested with hasattr, ``out += shortcut``."""

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False))

    def forward(self, x):
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if hasattr(self, "shortcut") else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out += shortcut
        return out


class KuangliuNet(nn.Module):
    """Also: a module that forward never calls (its weights stay in the state_dict) and a bare
    parameter used in forward (a learnable output scale)."""

    def __init__(self, num_classes=5):
        super().__init__()
        self.aux_head = nn.Linear(17, 2)  # used by another training script, not by forward
        self.logit_scale = nn.Parameter(torch.tensor(1.5))
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layers = nn.Sequential(KuangliuPreActBlock(8, 8), KuangliuPreActBlock(8, 17, 2),
                                    KuangliuPreActBlock(17, 17))
        self.bn = nn.BatchNorm2d(17)
        self.linear = nn.Linear(17, num_classes)

    def forward(self, x):
        out = self.layers(self.conv1(x))
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out) * self.logit_scale


class SequentialNet(nn.Module):
    """Everything in nn.Sequential with in-place nn.ReLU modules; a DenseNet-style layer that
    concatenates (no residual add); a conv with a bias."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(5, 12, 3, padding=1)
        self.dense = nn.Sequential(nn.BatchNorm2d(12), nn.ReLU(inplace=True),
                                   nn.Conv2d(12, 6, 3, padding=1, bias=True))
        self.trans = nn.Sequential(nn.BatchNorm2d(18), nn.ReLU(inplace=True),
                                   nn.Conv2d(18, 9, 1, stride=2))
        self.head = nn.Sequential(nn.BatchNorm2d(9), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(9, 3))

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([x, self.dense(x)], 1)
        return self.head(self.trans(x))


class MethodStyleBottleneck(nn.Module):
    """``.relu()`` and ``torch.relu_`` calls, one activation feeding two convs (a projection
    shortcut written out by hand), ``torch.add`` for the residual, momentum=None BN."""

    def __init__(self, c_in=6, mid=5, c_out=11):
        super().__init__()
        self.norm_a = nn.BatchNorm2d(c_in, momentum=None)
        self.reduce = nn.Conv2d(c_in, mid, 1, bias=False)
        self.project = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.norm_b = nn.BatchNorm2d(mid)
        self.spatial = nn.Conv2d(mid, mid, 3, padding=2, dilation=2, bias=False)
        self.norm_c = nn.BatchNorm2d(mid, affine=False)
        self.expand = nn.Conv2d(mid, c_out, 1, bias=False)

    def forward(self, x):
        act = self.norm_a(x).relu()
        skip = self.project(act)
        y = self.spatial(torch.relu_(self.norm_b(self.reduce(act))))
        y = self.expand(F.relu(self.norm_c(y), inplace=True))
        return torch.add(y, skip)


class LookAlikeBatchNormAct2d(nn.BatchNorm2d):
    """A norm+activation module in timm's convention (BatchNorm2d subclass with ``drop`` and
    ``act``), written here so the test runs without timm."""

    def __init__(self, num_features, act_layer=nn.ReLU, apply_act=True):
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = act_layer(inplace=True) if apply_act else nn.Identity()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


NORM_ACTS = [LookAlikeBatchNormAct2d] + ([TimmBatchNormAct2d] if TimmBatchNormAct2d else [])


class NormActNet(nn.Module):
    """timm ResNetV2-style pre-activation bottleneck: norm+act modules, a drop_path Identity
    between the last conv and the residual add."""

    def __init__(self, norm_act):
        super().__init__()
        self.norm1 = norm_act(7)
        self.downsample = nn.Conv2d(7, 12, 1, stride=2, bias=False)
        self.conv1 = nn.Conv2d(7, 3, 1, bias=False)
        self.norm2 = norm_act(3)
        self.conv2 = nn.Conv2d(3, 3, 3, stride=2, padding=1, bias=False)
        self.norm3 = norm_act(3)
        self.conv3 = nn.Conv2d(3, 12, 1, bias=False)
        self.drop_path = nn.Identity()
        self.norm_out = norm_act(12, apply_act=False)

    def forward(self, x):
        x_preact = self.norm1(x)
        shortcut = self.downsample(x_preact)
        x = self.conv1(x_preact)
        x = self.conv2(self.norm2(x))
        x = self.conv3(self.norm3(x))
        return self.norm_out(self.drop_path(x) + shortcut)


class TorchvisionStyleBlock(nn.Module):
    """Post-activation ResNet block: conv-bn-relu-conv-bn, add, relu. The first BN-ReLU feeds a
    conv (fused); the second BN feeds the add (left: not followed by a ReLU)."""

    def __init__(self, c=6):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Unfusable(nn.Module):
    """Chains the fused op cannot take, each for a different reason."""

    def __init__(self):
        super().__init__()
        self.bn_grouped = nn.BatchNorm2d(4)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.bn_leaky = nn.BatchNorm2d(4)
        self.after_leaky = nn.Conv2d(4, 4, 1)
        self.bn_shared = nn.BatchNorm2d(4)
        self.after_shared = nn.Conv2d(4, 4, 1)
        self.bn_reflect = nn.BatchNorm2d(4)
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.bn1d = nn.BatchNorm1d(4)

    def forward(self, x):
        x = self.grouped(F.relu(self.bn_grouped(x)))
        x = self.after_leaky(F.leaky_relu(self.bn_leaky(x)))
        a = F.relu(self.bn_shared(x))
        x = self.after_shared(a) + a.mean()  # the activation also feeds a reduction
        x = self.reflect(F.relu(self.bn_reflect(x)))
        return x + self.bn1d(x.mean((2, 3)))[:, :, None, None]


class NotTraceable(nn.Module):
    """Data-dependent control flow at the top (fx cannot trace it) around a chain of its own;
    traceable children."""

    def __init__(self):
        super().__init__()
        self.a = KuangliuPreActBlock(4, 4)
        self.b = KuangliuPreActBlock(4, 6, 2)
        self.bn = nn.BatchNorm2d(6)
        self.conv = nn.Conv2d(6, 6, 1)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:
            x = x * 1.0
        x = self.b(x)
        return self.conv(F.relu(self.bn(x)))


# --------------------------------------------------------------------------- checks

def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), grads


def _check_equivalent(model, x, rtol=1e-9, atol=1e-11):
    model = copy.deepcopy(model).double()
    x = x.double()
    target = copy.deepcopy(model)
    fused, report = fuse(target, return_report=True)
    assert fused is target and isinstance(fused, type(model))  # in place
    assert isinstance(report, FuseReport) and fused.fuse_report is report
    sd_m, sd_f = model.state_dict(), fused.state_dict()
    assert list(sd_f.keys()) == list(sd_m.keys())
    for k in sd_m:
        assert torch.equal(sd_m[k], sd_f[k]), k
    ref = copy.deepcopy(model)
    out_r, g_r = _step(ref, x)
    out_f, g_f = _step(fused, x)
    torch.testing.assert_close(out_f, out_r, rtol=rtol, atol=atol)
    assert set(g_f) == set(g_r)
    for k in g_r:
        assert (g_f[k] is None) == (g_r[k] is None), k
        if g_r[k] is not None:
            torch.testing.assert_close(g_f[k], g_r[k], rtol=rtol, atol=atol,
                                       msg=lambda m, k=k: k + m)
    for (k, b_r), b_f in zip(ref.named_buffers(), fused.buffers()):
        torch.testing.assert_close(b_f, b_r, rtol=rtol, atol=atol, msg=lambda m, k=k: k + m)
    ref.eval()
    fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), rtol=rtol, atol=atol)
    # The original model loads the fused one's weights and the other way round.
    copy.deepcopy(model).load_state_dict(fused.state_dict())
    fused.load_state_dict(model.state_dict())
    return fused, report


def test_kuangliu_style():
    model = KuangliuNet()
    fused, report = _check_equivalent(model, torch.randn(2, 3, 13, 13))
    assert (report.found, report.fused) == (7, 6)
    assert report.fused_convs == 7 and report.fused_residual_adds == 3
    assert [c.path for c in report.left] == ["bn"]
    assert "adaptive_avg_pool2d" in report.left[0].reason
    assert "aux_head.weight" in fused.state_dict() and "logit_scale" in fused.state_dict()
    x = torch.randn(2, 3, 13, 13)
    assert saved_bytes(fused.float(), x) < 0.7 * saved_bytes(model, x)


def test_sequential_inplace_relu_and_concat():
    fused, report = _check_equivalent(SequentialNet(), torch.randn(2, 5, 7, 7))
    assert (report.found, report.fused, report.fused_convs) == (3, 2, 2)
    assert report.fused_residual_adds == 0
    assert [c.path for c in report.left] == ["head.0"]


def test_method_relu_shared_activation_torch_add():
    fused, report = _check_equivalent(MethodStyleBottleneck(), torch.randn(3, 6, 7, 7))
    assert (report.found, report.fused, report.fused_convs) == (3, 3, 4)
    assert report.fused_residual_adds == 1
    chain_a = next(c for c in report.chains if c.path == "norm_a")
    assert sorted(chain_a.convs) == ["project", "reduce"]
    # One statistics pass for the shared BN-ReLU: num_batches_tracked moves by one per step.
    fused.train()
    before = int(fused.norm_a.num_batches_tracked)
    fused(torch.randn(2, 6, 5, 5, dtype=torch.float64))
    assert int(fused.norm_a.num_batches_tracked) == before + 1


@pytest.mark.parametrize("norm_act", NORM_ACTS, ids=lambda c: c.__module__.split(".")[0])
def test_norm_act_modules(norm_act):
    fused, report = _check_equivalent(NormActNet(norm_act), torch.randn(2, 7, 9, 9))
    assert (report.found, report.fused, report.fused_convs) == (4, 3, 4)
    assert report.fused_residual_adds == 1
    assert [c.path for c in report.left] == ["norm_out"]


def test_torchvision_style_post_activation():
    fused, report = _check_equivalent(TorchvisionStyleBlock(), torch.randn(2, 6, 5, 5))
    assert (report.found, report.fused) == (2, 1)
    assert "not a ReLU" in report.left[0].reason


def test_torchvision_resnet18_if_installed():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=4)
    fused, report = _check_equivalent(model, torch.randn(2, 3, 33, 33), rtol=1e-8, atol=1e-10)
    # Each post-activation BasicBlock has one BN -> ReLU -> conv; bn1 of the stem feeds
    # a max pool; the second BN of each block feeds the add.
    assert report.found == 20 and report.fused == 8


def test_unfusable_chains_are_left_with_reasons():
    model = Unfusable()
    fused, report = _check_equivalent(model, torch.randn(2, 4, 6, 6))
    assert report.fused == 0 and report.found == 5
    reasons = {c.path: c.reason for c in report.left}
    assert "groups=2" in reasons["bn_grouped"]
    assert "leaky_relu" in reasons["bn_leaky"]
    assert "not a Conv2d" in reasons["bn_shared"]
    assert "padding_mode" in reasons["bn_reflect"]
    assert "BatchNorm1d" in reasons["bn1d"]
    text = str(report)
    assert "5 BatchNorm chains found, 0 fused" in text and "groups=2" in text


def test_not_traceable_root_falls_back_to_children():
    model = NotTraceable()
    fused, report = _check_equivalent(model, torch.randn(2, 4, 7, 7))
    assert [p for p, _ in report.untraced] == ["<root>"]
    assert report.fused == 4 and report.fused_residual_adds == 2
    assert {c.path for c in report.chains} == {"a.bn1", "a.bn2", "b.bn1", "b.bn2"}
    assert type(fused) is NotTraceable  # its own forward could not be rewritten: unchanged
    assert [p for p, by in report.rewritten] == ["a", "b"]
    assert "not traceable <root>" in str(report)


def test_zoo_plain_model_fuses_to_the_fused_model():
    plain = models.preact_resnet20(fused=False)
    fused, report = fuse(plain, return_report=True)
    assert report.fused == 18 and report.fused_residual_adds == 9
    native = models.preact_resnet20()
    x = torch.randn(2, 3, 8, 8)
    assert saved_bytes(fused, x) == saved_bytes(native, x)
    # Already-fused modules are left alone: nothing to do, nothing broken.
    again, report = fuse(native, return_report=True)
    assert report.found == 1 and report.fused == 0  # the final BN (feeds the pooling)
    native.load_state_dict(again.state_dict())


def test_fx_fallback_in_place_copies_and_pickles():
    # Children whose forward holds chains get a rewritten forward (a subclass of their class);
    # the root, with no chain of its own that fuses, keeps its class. deepcopy and pickle
    # rebuild the rewritten modules (traced again on load) with the same results and bytes.
    model = KuangliuNet().double()
    model.note = "kept"
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    fused = fuse(model)
    assert fused is model and type(model) is KuangliuNet and model.note == "kept"
    block = model.layers[1]
    assert isinstance(block, KuangliuPreActBlock) and type(block) is not KuangliuPreActBlock
    assert fusedres.convert.rewriters.is_fused(block)
    want, want_bytes = model(x), saved_bytes(model, x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is KuangliuNet and clone.note == "kept"
        assert fusedres.convert.rewriters.is_fused(clone.layers[1])
        torch.testing.assert_close(clone(x), want, rtol=0, atol=0)
        assert saved_bytes(clone, x) == want_bytes
    # Fusing again finds the three blocks fused and changes nothing.
    again, report = fuse(model, return_report=True)
    assert again is model and report.already == ["layers.0", "layers.1", "layers.2"]
    assert report.fused == 0 and [c.path for c in report.chains] == ["bn"]


def test_fx_fallback_on_the_root_own_forward():
    # The model's own forward holds the chains: the model itself becomes a subclass of its
    # class whose forward is the rewritten graph; a pickled copy is rewritten again on load.
    model = MethodStyleBottleneck().double()
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    ref = copy.deepcopy(model)
    fused, report = fuse(model, return_report=True)
    assert fused is model and isinstance(model, MethodStyleBottleneck)
    assert type(model) is not MethodStyleBottleneck
    assert report.rewritten == [("<root>", "torch.fx")]
    loaded = pickle.loads(pickle.dumps(model))
    assert isinstance(loaded, MethodStyleBottleneck) and type(loaded) is not type(ref)
    torch.testing.assert_close(loaded(x), ref(x), rtol=1e-12, atol=1e-12)
    assert saved_bytes(loaded, x) == saved_bytes(model, x) < saved_bytes(ref, x)


def test_verbose_prints_summary(capsys):
    fuse(TorchvisionStyleBlock(), verbose=True)
    out = capsys.readouterr().out
    assert "2 BatchNorm chains found, 1 fused" in out and "left bn2" in out
    with pytest.raises(TypeError, match="nn.Module"):
        fuse(lambda x: x)


@pytest.mark.parametrize("name", NET_BACKENDS)
def test_fused_graph_on_every_backend(name):
    with fusedres.use_backend(name):
        _check_equivalent(MethodStyleBottleneck(), torch.randn(2, 6, 5, 5))


def test_float32_and_bfloat16_under_fuse():
    model = KuangliuNet()
    fused = fuse(copy.deepcopy(model))
    x = torch.randn(2, 3, 13, 13)
    torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fused(x), model(x)
    assert a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
    fusedres.memory.saved_bytes(fused, x)


class _QatChain(nn.Module):
    """BN -> ReLU -> a QAT Conv2d: an nn.Conv2d subclass with its own forward (the weight goes
    through fake quantisation), kept as one call by fx (torch.ao.nn modules are leaves)."""

    def __init__(self):
        super().__init__()
        from torch.ao.nn.qat import Conv2d as QatConv2d
        from torch.ao.quantization import get_default_qat_qconfig
        self.bn = nn.BatchNorm2d(4)
        self.conv = QatConv2d(4, 4, 3, padding=1, bias=False,
                              qconfig=get_default_qat_qconfig("x86"))

    def forward(self, x):
        return self.conv(F.relu(self.bn(x)))


def test_fx_path_refuses_a_conv2d_subclass_with_its_own_forward():
    # The rewriters and the fx fallback share one rule: fusing the QAT conv would run its raw
    # weight and drop the fake quantisation (outputs differ by a quantisation step).
    torch.manual_seed(0)
    model = _QatChain()
    x = torch.randn(2, 4, 6, 6)
    want = copy.deepcopy(model)(x)
    fused, report = fuse(model, return_report=True)
    assert report.found == 1 and report.fused == 0
    (chain,) = report.left
    assert chain.path == "bn" and "Conv2d, not an nn.Conv2d" in chain.reason, chain.reason
    torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
