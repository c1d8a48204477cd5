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
