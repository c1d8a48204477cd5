"""The zoo where timm and torch.hub users look: timm's registry (fusedres/models/timm_registry.py)
and torch.hub (hubconf.py at the repository root)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedres import models
from fusedres.models import timm_registry

REPO = Path(__file__).resolve().parents[1]
timm = pytest.importorskip("timm")  # in requirements-dev.txt; the library never needs it


def test_timm_create_model_builds_the_zoo():
    timm_registry.install()  # timm is imported: registers at once (idempotent)
    names = timm_registry.register()
    assert sorted(timm.list_models("fusedres_*")) == sorted(names) == sorted(
        "fusedres_" + n for n in models.MODELS)
    model = timm.create_model("fusedres_preact_resnet164")
    assert isinstance(model, models.PreActResNet) and model.depth == 164 and model.fused
    assert model.num_classes == 10 and model.pretrained_cfg["input_size"] == (3, 32, 32)
    assert model.state_dict().keys() == models.preact_resnet164().state_dict().keys()
    data = timm.data.resolve_data_config({}, model=model)
    assert data["mean"] == timm_registry.CIFAR10_MEAN and data["input_size"] == (3, 32, 32)
    # timm's keyword arguments reach the constructor; ImageNet variants get ImageNet's config.
    plain = timm.create_model("fusedres_preact_resnet18", num_classes=3, fused=False,
                              drop_path_rate=0.1, in_chans=1)
    assert not plain.fused and plain.num_classes == 3 and plain.conv1.in_channels == 1
    assert plain.pretrained_cfg["input_size"] == (3, 224, 224)
    assert plain(torch.randn(2, 1, 32, 32)).shape == (2, 3)
    with pytest.raises(ValueError, match="pretrained: fusedres publishes no weights"):
        timm.create_model("fusedres_preact_resnet20", pretrained=True)


def test_timm_registry_when_fusedres_is_imported_first():
    # A fresh interpreter: importing fusedres does not import timm; timm's import then
    # registers the zoo.
    code = ("import sys, fusedres\n"
            "assert 'timm' not in sys.modules\n"
            "import timm\n"
            "m = timm.create_model('fusedres_preact_resnet20', num_classes=4)\n"
            "n = len(timm.list_models('fusedres_*'))\n"
            "print(type(m).__name__, m.depth, m.num_classes, n)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PreActResNet", "20", "4", str(len(models.MODELS))]


def test_torch_hub_load_local():
    model = torch.hub.load(str(REPO), "preact_resnet164", source="local", num_classes=7)
    assert isinstance(model, models.PreActResNet) and model.depth == 164
    assert model.fc.out_features == 7 and model.fused
    plain = torch.hub.load(str(REPO), "preact_resnet20", source="local", fused=False)
    assert not plain.fused
    with pytest.raises(ValueError, match="pretrained: fusedres publishes no weights"):
        torch.hub.load(str(REPO), "preact_resnet20", source="local", pretrained=True)
    for name, build in models.MODELS.items():  # the zoo itself, as timm's and hub's
        with pytest.raises(ValueError, match=f"pretrained: fusedres publishes no weights for "
                                             f"{name};"):
            build(pretrained=True)
    assert models.preact_resnet20(pretrained=False).depth == 20
    # Every zoo model is an entry point, and nothing else is.
    spec = importlib.util.spec_from_file_location("fusedres_hubconf", REPO / "hubconf.py")
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    public = {n for n in dir(hub) if not n.startswith("_") and callable(getattr(hub, n))}
    assert public == set(models.MODELS) and hub.dependencies == ["torch"]
