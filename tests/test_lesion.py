"""fusedres lesion (Veit et al. 2016) on a tiny run trained here (conftest's ``tiny_run``):
nothing deleted reproduces the run's own evaluation, deleting a unit changes the outputs and is
undone, only shape-preserving units are deleted, the outputs are written, bad input exits 2
before anything is."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn as nn

from fusedres.apps import cli
from fusedres.apps.experiments import figures, lesion, runs

FAST = ["--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def study(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("lesion")
    assert lesion.main([str(tiny_run), "--max-deleted", "3", "--draws", "2", "--out", str(out),
                        *FAST]) == 0
    return out, json.loads((out / "lesion.json").read_text())


def test_nothing_deleted_reproduces_the_runs_evaluation(study, tiny_run):
    _, doc = study
    (record,) = doc["runs"]
    summary = json.loads((tiny_run / "summary.json").read_text())
    # The same model, test set, normalisation, layout and backend as the trainer's evaluation.
    assert record["baseline"]["error"] == summary["final_test_error"]
    assert record["baseline"]["loss"] == pytest.approx(summary["final_test_loss"], rel=1e-6)
    assert record["by_k"][0] == {"k": 0, "draws": 1, "subsets": [[]],
                                 "errors": [summary["final_test_error"]],
                                 "mean": summary["final_test_error"], "std": 0.0,
                                 "min": summary["final_test_error"],
                                 "max": summary["final_test_error"]}
    assert record["iteration"] == 6 and record["test_images"] == 364


def test_outputs_are_written(study):
    out, doc = study
    assert {p.name for p in out.iterdir()} == {"lesion.json", "lesion.md", "lesion.png"}
    assert (out / "lesion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["command"].startswith("fusedres lesion ")
    (record,) = doc["runs"]
    # k = 1..3 of the 3 deletable units left once the first is kept (--keep-first-unit, the
    # default): every single unit, then every subset (no more than the 2 draws asked for).
    assert [(r["k"], r["draws"]) for r in record["by_k"]] == [(0, 1), (1, 3), (2, 2), (3, 1)]
    singles = [u["error"] for u in record["units"] if u["deletable"] and not u["excluded"]]
    assert record["by_k"][1]["errors"] == singles
    # The first unit is still measured alone, and flagged.
    assert record["excluded"] == ["layer1.0"] and record["units"][0]["error"] is not None
    for row in record["by_k"][1:]:
        assert all(len(s) == row["k"] for s in row["subsets"])
        assert len({tuple(s) for s in row["subsets"]}) == row["draws"]  # distinct subsets
        assert row["min"] <= row["mean"] <= row["max"]
    text = (out / "lesion.md").read_text()
    assert "| units deleted |" in text and "layer2.0 | 16x8x8 -> 32x4x4 | kept" in text
    assert "| layer1.0 (left out of the subsets) |" in text


def test_the_figure_names_the_variant_and_marks_chance(study):
    _, doc = study
    fig = lesion.figure(doc["runs"])
    assert figures.unlabelled(fig) == []
    assert figures.overlaps(fig) == []
    assert fig.get_figwidth() == figures.COLUMN_WIDTH
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    # One run: the variant is said once, in the title; the legend names the seed.
    assert "ResNet-14: full pre-activation unit, identity shortcut, BatchNorm" in \
        fig.get_suptitle().replace("\n", " ")
    assert legend[0] == "seed 0"
    assert "chance error (1 - 1/classes)" in legend
    for ax in fig.axes[:2]:  # the chance line at 90 % on both panels
        assert any(list(ln.get_ydata()) == [90.0, 90.0] for ln in ax.lines)
    # Every draw a dot at its k, the median a line through them, the min-max band.
    k2 = doc["runs"][0]["by_k"][2]
    dots = [ln for ln in fig.axes[0].lines if ln.get_marker() == "."]
    assert sorted(dots[2].get_ydata()) == pytest.approx(sorted(100 * e for e in k2["errors"]))
    line = next(ln for ln in fig.axes[0].lines if ln.get_linestyle() == "-"
                and ln.get_marker() in ("None", "", None))
    assert line.get_ydata()[2] == pytest.approx(100 * figures.quantile(k2["errors"], 0.5))
    figures.pyplot().close(fig)
    assert doc["runs"][0]["num_classes"] == 10 and doc["runs"][0]["plain"] is False


def test_only_shape_preserving_units_are_deletable(study):
    _, doc = study
    (record,) = doc["runs"]
    units = {u["name"]: u for u in record["units"]}
    assert list(units) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0",
                           "layer3.1"]
    assert [n for n, u in units.items() if u["deletable"]] == ["layer1.0", "layer1.1",
                                                               "layer2.1", "layer3.1"]
    assert record["kept"] == ["layer2.0", "layer3.0"]
    assert units["layer2.0"]["input_shape"] == [16, 8, 8]
    assert units["layer2.0"]["output_shape"] == [32, 4, 4]
    assert units["layer2.0"]["error"] is None and units["layer2.1"]["error"] is not None
    subsets = [name for row in record["by_k"] for s in row["subsets"] for name in s]
    assert not {"layer2.0", "layer3.0", "layer1.0"} & set(subsets)


def test_no_keep_first_unit_deletes_it_too(tiny_run, tmp_path):
    out = tmp_path / "all"
    assert lesion.main([str(tiny_run), "--max-deleted", "1", "--no-keep-first-unit", "--out",
                        str(out), *FAST]) == 0
    (record,) = json.loads((out / "lesion.json").read_text())["runs"]
    assert record["excluded"] == [] and record["deletable"] == 4
    assert ["layer1.0"] in record["by_k"][1]["subsets"]


def test_deleting_a_unit_changes_the_outputs_and_is_undone(tiny_run):
    run = runs.open_run(tiny_run)
    x, _ = run.test_batches(64)[0]
    model = run.model
    before = [id(u) for u in model.units()]
    with run.use_backend(), torch.no_grad():
        y0 = model(x)
        with lesion.deleted_units(model, [1]):
            assert isinstance(model.layer1[1], nn.Identity)
            y1 = model(x)
        assert not torch.allclose(y0, y1)
        assert [id(u) for u in model.units()] == before
        assert torch.equal(model(x), y0)
        with pytest.raises(RuntimeError, match="inside"):  # put back on an error too
            with lesion.deleted_units(model, [0, 3]):
                raise RuntimeError("inside")
        assert [id(u) for u in model.units()] == before


class _PlainNet(nn.Module):
    """A network of another kind: plain conv-ReLU "units" without shortcuts, stages of
    nn.Sequential, the same two attributes the lesion study reads."""

    def __init__(self):
        super().__init__()
        def unit(c_in, c_out, stride=1):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1), nn.ReLU())
        self.stem = nn.Conv2d(1, 4, 3, 1, 1)
        self.layer1 = nn.Sequential(unit(4, 4), unit(4, 4))
        self.layer2 = nn.Sequential(unit(4, 8, 2), unit(8, 8))
        self.stage_names = ["layer1", "layer2"]

    def units(self):
        return [u for name in self.stage_names for u in getattr(self, name)]

    def forward(self, x):
        return self.layer2(self.layer1(self.stem(x))).mean((2, 3))


def test_deletion_needs_only_units_and_stage_names():
    model = _PlainNet().eval()
    x = torch.randn(2, 1, 8, 8)
    units = lesion.units_of(model, x)
    assert [(u.name, u.deletable) for u in units] == [
        ("layer1.0", True), ("layer1.1", True), ("layer2.0", False), ("layer2.1", True)]
    with torch.no_grad(), lesion.deleted_units(model, [0, 3]):
        y = model(x)
    with torch.no_grad():  # the same network without those two units
        expected = model.layer2[0](model.layer1[1](model.stem(x))).mean((2, 3))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_subsets_are_reproducible_distinct_or_all():
    pool = [0, 1, 3, 5, 6, 7]
    a = lesion.draw_subsets(pool, 2, 4, seed=1)
    assert a == lesion.draw_subsets(pool, 2, 4, seed=1)
    assert len(set(a)) == 4 and all(len(s) == 2 and set(s) <= set(pool) for s in a)
    assert a != lesion.draw_subsets(pool, 2, 4, seed=2)
    # 6 subsets of 5 <= 10 draws: every one, once.
    assert lesion.draw_subsets(pool, 5, 10, seed=1) == list(itertools.combinations(pool, 5))


@pytest.mark.parametrize("argv, match", [
    (["--max-deleted", "0"], "--max-deleted: expected K >= 1 units, got 0"),
    (["--draws", "0"], "--draws: expected at least 1 subset, got 0"),
    (["--checkpoint", "/nonexistent/iter_1.pt"], "--checkpoint: '/nonexistent/iter_1.pt' does "
                                                 "not exist"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_bad_input_exits_2_before_writing(tiny_run, tmp_path, capsys, argv, match):
    out = tmp_path / "out"
    assert cli.main(["lesion", str(tiny_run), *argv, "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not out.exists()


def test_a_run_without_checkpoints_or_no_run_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert lesion.main([str(empty), *FAST]) == 2
    assert "RUN: no checkpoint in" in capsys.readouterr().err
    assert lesion.main([str(tmp_path / "missing"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "RUN: '" in err and "missing' does not exist" in err
    assert list(tmp_path.iterdir()) == [empty] and list(empty.iterdir()) == []
