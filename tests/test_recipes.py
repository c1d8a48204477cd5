"""The shipped configs (fusedres/apps/configs): each resolves as the trainer reads it, and each
paper's recipe trains on digits as a smoke run (slow: CI's own step), its network and schedule
kept."""

from __future__ import annotations

import json

import pytest

from fusedres.apps.train import main
from fusedres.apps.train.config import PACKAGE_CONFIGS, resolve

CONFIGS = sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
PAPERS = [c for c in CONFIGS if c.startswith(("he2016", "huang2016", "li2018", "cifar100"))]


def test_the_paper_recipes_are_shipped():
    assert set(PAPERS) == {"he2016_cifar10_resnet110", "he2016_cifar10_shortcuts",
                           "huang2016_cifar10_resnet110_sd", "li2018_cifar10_resnet56",
                           "cifar100_resnet164"}


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_resolves(name, tmp_path):
    cfg, explicit = resolve(["--config", name, "--out", str(tmp_path)])
    assert {"model", "batch_size", "lr"} <= explicit
    assert all(m < cfg["max_iters"] for m in cfg["milestones"])


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPERS)
def test_each_paper_recipe_trains_on_digits(name, tmp_path):
    out = tmp_path / "run"
    assert main(["--config", name, "--dataset", "digits", "--max-iters", "2",
                 "--batch-size", "16", "--eval-batch-size", "64", "--warmup-iters", "0",
                 "--milestones", "1", "--threads", "1", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cfg, _ = resolve(["--config", name, "--out", str(out)])
    assert summary["model"] == cfg["model"] and summary["iterations"] == 2
    assert summary["variant"]["unit"] == cfg["unit"]


def _driver():
    """reproduction/digits.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "reproduction" / "digits.py"
    spec = importlib.util.spec_from_file_location("reproduction_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_seed_loop_lists_one_run_per_variant_and_seed(tmp_path, capsys):
    digits = _driver()
    assert digits.main(["recipes", "--seeds", "2,0", "--only", "li,table2", "--runs",
                        str(tmp_path), "--dry-run", "--smoke", "--", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    train = [ln for ln in lines if ln.startswith("python -m fusedres.apps.train")]
    compares = [ln for ln in lines if ln.startswith("python -m fusedres.apps.cli compare")]
    assert len(train) == (6 + 10) * 2 and len(compares) == 2
    outs = [ln.split("--out ")[1] for ln in train]
    assert len(set(outs)) == len(outs)
    assert outs[:4] == [str(tmp_path / n) for n in ("li-20-s0", "li-20-s2", "li-20-noshort-s0",
                                                    "li-20-noshort-s2")]
    assert "--config li2018_cifar10_resnet56 --model preact_resnet110 --shortcut none" in \
        " ".join(train)
    assert all("--dataset digits" in ln and ln.endswith(out) for ln, out in zip(train, outs))
    assert all(ln.rstrip().split("--out")[0].endswith("--threads 1 ") for ln in train)
    assert "--unit relu_only_preact --model preact_resnet164 --seed 2" in " ".join(train)
    # One comparison per paper over all its runs (compare groups them by variant).
    assert compares[0].split()[4:-2] == outs[:12]
    for argv, match in ((["--seeds", "a"], "--seeds: expected comma-separated integers"),
                        (["--seeds", "-1"], "--seeds: expected at least one seed >= 0"),
                        (["--only", "table9"], "--only: unknown papers ['table9']")):
        with pytest.raises(SystemExit) as e:
            digits.main(["recipes", *argv, "--dry-run"])
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_the_seed_loop_covers_he_tables_1_to_3_huang_and_li(capsys):
    digits = _driver()
    assert digits.main(["recipes", "--seeds", "0", "--dry-run"]) == 0
    train = [ln for ln in capsys.readouterr().out.splitlines() if "fusedres.apps.train" in ln]
    names = [ln.split("--out ")[1].rsplit("/", 1)[1] for ln in train]
    assert len(names) == 10 + 6 + 6 + 2 + 6 and len(set(names)) == len(names)
    table3 = [ln for ln in train if "/t3-" in ln]
    assert {ln.split("--config ")[1].split()[0] for ln in table3} == {
        "cifar10_resnet1001", "cifar100_resnet164"}
    assert sum("--model preact_resnet1001" in ln for ln in table3) == 2
    assert sum("--unit original" in ln for ln in table3) == 3


def test_a_printed_command_runs_when_pasted(tmp_path, capsys):
    """--dry-run prints shell commands (python -m ..., quoted): one of them, run as a shell
    would, trains its 2 smoke iterations."""
    import shlex
    import subprocess
    import sys

    digits = _driver()
    assert digits.main(["recipes", "--seeds", "3", "--only", "huang", "--runs", str(tmp_path),
                        "--smoke", "--dry-run"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    argv = shlex.split(first)
    assert argv[:3] == ["python", "-m", "fusedres.apps.train"]
    subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True, timeout=600)
    out = tmp_path / "huang-sd-110-s3"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["variant"]["drop_path_rate"] == 0.5
    assert summary["recipe"]["nesterov"] and summary["recipe"]["bn_weight_decay"]


def test_the_zoos_original_unit_is_the_post_activation_resnet_li_et_al_trained():
    """Li et al.'s CIFAR ResNet written out here with plain layers (their models/resnet.py:
    conv-BN-ReLU stem; units conv-BN-ReLU-conv-BN plus the shortcut, a 1x1 conv and BatchNorm
    where the width changes, then ReLU; average pooling, linear; "noshort": no shortcut in any
    unit) takes the zoo's preact_resnet(unit="original") state_dict key for key and computes
    the same outputs: the recipe configs name it instead of adding a model."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from fusedres import models

    class Unit(nn.Module):
        def __init__(self, cin, cout, stride, shortcut):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.has_shortcut = shortcut
            if shortcut and (stride != 1 or cin != cout):
                self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)
                self.shortcut_bn = nn.BatchNorm2d(cout)

        def forward(self, x):
            out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
            if self.has_shortcut:
                out = out + (self.shortcut_bn(self.shortcut(x)) if hasattr(self, "shortcut")
                             else x)
            return F.relu(out)

    class LiResNet(nn.Module):
        def __init__(self, n, shortcut):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.stem_bn = nn.BatchNorm2d(16)
            cin = 16
            for i, (width, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
                units = []
                for j in range(n):
                    units.append(Unit(cin, width, stride if j == 0 else 1, shortcut))
                    cin = width
                self.add_module(f"layer{i + 1}", nn.Sequential(*units))
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            x = F.relu(self.stem_bn(self.conv1(x)))
            x = self.layer3(self.layer2(self.layer1(x)))
            return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    for shortcut in ("identity", "none"):
        torch.manual_seed(0)
        zoo = models.preact_resnet(20, unit="original", shortcut=shortcut, fused=False)
        with torch.no_grad():  # BatchNorm statistics of their own, not the identity
            for m in zoo.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.2, 0.2)
                    m.running_var.uniform_(0.5, 1.5)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
        theirs = LiResNet(3, shortcut == "identity")
        theirs.load_state_dict(zoo.state_dict())  # strict: the same keys and shapes
        x = torch.randn(4, 3, 8, 8)
        zoo.eval(), theirs.eval()
        assert torch.allclose(zoo(x), theirs(x), atol=1e-5)


def test_the_recipe_seed_loop_trains_and_compares_the_digits_versions(tmp_path):
    """Huang et al.'s two recipes (ResNet-110 with and without stochastic depth), 2 seeds
    each, on digits for 2 iterations (slow: four trainings), aggregated by fusedres compare."""
    digits = _driver()
    assert digits.main(["recipes", "--seeds", "0,1", "--only", "huang", "--runs",
                        str(tmp_path), "--smoke"]) == 0
    doc = json.loads((tmp_path / "compare-huang" / "compare.json").read_text())
    groups = doc["groups"]
    assert [sorted(r["seed"] for r in g["runs"]) for g in groups] == [[0, 1], [0, 1]]
    assert "drop-path 0.5" in groups[0]["label"] and "no drop-path" in groups[1]["label"]
    for g in groups:
        assert g["final_test_error"]["n"] == 2
        errors = sorted(r["final_test_error"] for r in g["runs"])
        assert g["final_test_error"]["min"] == errors[0]
        assert g["final_test_error"]["max"] == errors[1]
        assert all(r["iterations"] == 2 and r["finished"] for r in g["runs"])
    (pair,) = doc["pairs"]
    assert pair["seeds"] == [0, 1] and pair["verdict"] in ("separated", "not separated")
    # Each run records where it came from.
    assert all(runs for runs in doc["provenance"]["runs"].values())
    # A second call keeps the finished runs and only compares again.
    before = (tmp_path / "huang-sd-110-s0" / "summary.json").stat().st_mtime_ns
    assert digits.main(["recipes", "--seeds", "0,1", "--only", "huang", "--runs",
                        str(tmp_path), "--smoke"]) == 0
    assert (tmp_path / "huang-sd-110-s0" / "summary.json").stat().st_mtime_ns == before
