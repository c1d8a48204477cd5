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
    train = [ln for ln in lines if ln.startswith("fusedres.apps.train")]
    compares = [ln for ln in lines if ln.startswith("fusedres.apps.cli compare")]
    assert len(train) == (2 + 10) * 2 and len(compares) == 2
    outs = [ln.split("--out ")[1] for ln in train]
    assert len(set(outs)) == len(outs)
    assert outs[:4] == [str(tmp_path / n) for n in ("li-56-s0", "li-56-s2", "li-56-noshort-s0",
                                                    "li-56-noshort-s2")]
    assert all("--dataset digits" in ln and ln.endswith(out) for ln, out in zip(train, outs))
    assert all(ln.rstrip().split("--out")[0].endswith("--threads 1 ") for ln in train)
    assert "--unit relu_only_preact --model preact_resnet164 --seed 2" in " ".join(train)
    # One comparison per paper over all its runs (compare groups them by variant).
    assert compares[0].split()[2:-2] == outs[:4]
    for argv, match in ((["--seeds", "a"], "--seeds: expected comma-separated integers"),
                        (["--seeds", "-1"], "--seeds: expected at least one seed >= 0"),
                        (["--only", "table9"], "--only: unknown papers ['table9']")):
        with pytest.raises(SystemExit) as e:
            digits.main(["recipes", *argv, "--dry-run"])
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_the_recipe_seed_loop_trains_and_compares_the_digits_versions(tmp_path):
    """Li et al.'s two recipes (ResNet-56 with and without shortcuts), 2 seeds each, on digits
    for 2 iterations (slow: four trainings), aggregated by fusedres compare."""
    digits = _driver()
    assert digits.main(["recipes", "--seeds", "0,1", "--only", "li", "--runs", str(tmp_path),
                        "--smoke"]) == 0
    doc = json.loads((tmp_path / "compare-li" / "compare.json").read_text())
    groups = doc["groups"]
    assert [sorted(r["seed"] for r in g["runs"]) for g in groups] == [[0, 1], [0, 1]]
    assert "identity shortcut" in groups[0]["label"]
    assert "no shortcut (plain)" in groups[1]["label"]
    for g in groups:
        assert g["final_test_error"]["n"] == 2
        errors = sorted(r["final_test_error"] for r in g["runs"])
        assert g["final_test_error"]["min"] == errors[0]
        assert g["final_test_error"]["max"] == errors[1]
        assert all(r["iterations"] == 2 and r["finished"] for r in g["runs"])
    # A second call keeps the finished runs and only compares again.
    before = (tmp_path / "li-56-s0" / "summary.json").stat().st_mtime_ns
    assert digits.main(["recipes", "--seeds", "0,1", "--only", "li", "--runs", str(tmp_path),
                        "--smoke"]) == 0
    assert (tmp_path / "li-56-s0" / "summary.json").stat().st_mtime_ns == before
