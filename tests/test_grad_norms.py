"""fusedres train --log-grad-norms and its figure in fusedres compare: per residual unit, the
gradient norms against depth, plain against residual (fusedres.apps.train.gradnorms).

The trained pair: digits, 20 layers (9 units), without BatchNorm (where a plain 20-layer network
stops training here: docs/experiments.md), 10 iterations, norms every 5. About 20 s on 2 cores
for both."""

from __future__ import annotations

import json

import pytest

from fusedres.apps.experiments import compare, figures
from fusedres.apps.train import main

ARGS = ["--dataset", "digits", "--model", "preact_resnet", "--depth", "20", "--norm", "none",
        "--threads", "1", "--pad", "1", "--no-flip", "--warmup-iters", "2", "--milestones",
        "0.5", "--no-progress", "--no-tensorboard", "--log-every", "5", "--checkpoint-every",
        "100", "--max-iters", "10"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("grad_norms")
    assert main([*ARGS, "--log-grad-norms", "--out", str(base / "res")]) == 0
    assert main([*ARGS, "--log-grad-norms", "--shortcut", "none", "--out",
                 str(base / "plain")]) == 0
    return base


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "grad_norms"]


def test_norms_are_logged_per_unit_every_n_iterations(pair):
    for name in ("res", "plain"):
        recs = _records(pair / name)
        assert [r["iteration"] for r in recs] == [5, 10]
        for r in recs:
            assert r["units"] == [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)]
            for key in ("input_grad_norm", "param_grad_norm"):
                assert len(r[key]) == 9 and all(0 < v < float("inf") for v in r[key])
    # Why the plain network fails: its gradient shrinks on the way down to the first unit
    # (measured: about 25x from unit 9 to unit 1), where the shortcuts carry the residual
    # network's (within 2x of the last unit's).
    for r in _records(pair / "plain"):
        g = r["input_grad_norm"]
        assert g[0] < 0.2 * g[-1]
        assert all(a < b for a, b in zip(g, g[1:]))  # every unit on the way down shrinks it
    for r in _records(pair / "res"):
        g = r["input_grad_norm"]
        assert g[0] > 0.5 * g[-1]


def test_compare_plots_them_against_depth_with_labels(pair, tmp_path):
    loaded = [compare.load_run(pair / n) for n in ("res", "plain")]
    groups = compare.group_runs(loaded)
    summary = compare.summarise(groups)
    fig = compare.grad_norm_figure(groups, summary)
    assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    top, bottom = fig.axes[:2]  # one above the other, one paper column wide
    assert fig.get_figwidth() == figures.COLUMN_WIDTH
    assert top.get_yscale() == bottom.get_yscale() == "log"
    assert top.get_ylabel().startswith("||dL/dx||") and bottom.get_ylabel().startswith("||dL/dθ||")
    assert bottom.get_xlabel().startswith("residual unit")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("identity shortcut") for t in legend)
    assert any(t.startswith("no shortcut (plain)") for t in legend)
    # The median curve of each variant is its two records' median, unit by unit (one run: the
    # median over the runs of each run's median is that run's).
    plain_recs = _records(pair / "plain")
    want = [sorted(r["input_grad_norm"][u] for r in plain_recs) for u in range(9)]
    medians = [(a + b) / 2 for a, b in want]
    drawn = top.lines[2].get_ydata()  # res: median, first; plain: median, first
    assert list(drawn) == pytest.approx(medians)
    figures.pyplot().close(fig)
    # Per iteration: one row per variant, one curve per logged iteration, coloured by it.
    fig = compare.grad_norm_figure(groups, summary, "per-iteration")
    assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    rows = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(rows) == 4 and [len(ax.lines) for ax in rows] == [2, 2, 2, 2]
    assert list(rows[2].lines[1].get_ydata()) == pytest.approx(
        plain_recs[1]["input_grad_norm"])
    figures.pyplot().close(fig)
    out = tmp_path / "c"
    assert compare.main([str(pair / "res"), str(pair / "plain"), "--out", str(out)]) == 0
    doc = json.loads((out / "compare.json").read_text())
    assert doc["files"]["grad_norms"] == "grad_norms.png" and (out / "grad_norms.png").is_file()
    profile = doc["groups"][1]["grad_norms"]["input_grad_norm"]
    assert profile["median"] == pytest.approx(medians) == profile["per_run"][0]
    assert profile["by_iteration"] == [pytest.approx(r["input_grad_norm"]) for r in plain_recs]
    assert "![gradient norms](grad_norms.png)" in (out / "compare.md").read_text()


@pytest.mark.parametrize("flags,match", [
    (["--log-grad-norms", "--cuda-graphs"], "--log-grad-norms: not with --cuda-graphs"),
    (["--log-grad-norms", "--compile"], "--log-grad-norms: not with --compile"),
    (["--log-grad-norms", "--log-format", "csv"], "--log-grad-norms: needs --log-format jsonl"),
    (["--log-grad-norms", "7"], "--log-grad-norms 7: expected a multiple of --log-every (5)"),
    (["--log-grad-norms", "0"], "--log-grad-norms: expected a positive number"),
])
def test_refused_at_argument_time(flags, match, tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*ARGS, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_checkpointed_units_are_measured_once(tmp_path):
    """Under an activation budget the plan recomputes units in backward (their forward runs
    again, inside the autograd engine): the norms are the unplanned run's, not counted twice.

    Equal to the bit, on every CPU: a recomputed unit runs its first forward's kernels on the
    same tensors (tests/test_planner.py). The unplanned run is planned too, for a budget that
    checkpoints nothing: on CPU a run with a plan steps under the live-tensor tracker, a dispatch
    mode, so its fused calls take the public ops, which sum a projection's and an identity
    shortcut's gradients in another order than the eager route of a run without a plan (1e-7
    apart after one step here; 2e-4 after two on AVX2 and on an AVX-512 Xeon, issue 49)."""
    tiny = [*ARGS[:ARGS.index("--norm")], *ARGS[ARGS.index("--norm") + 2:]]
    tiny[tiny.index("--max-iters") + 1] = "2"
    tiny[tiny.index("--log-every") + 1] = "2"
    got, plans = [], []
    for name, budget in (("unplanned", "1GiB"), ("checkpointed", "2.8MiB")):
        out = tmp_path / name
        assert main([*tiny, "--log-grad-norms", "--activation-budget", budget, "--out",
                     str(out)]) == 0
        (rec,) = _records(out)
        got.append(rec)
        plans.append(json.loads((out / "summary.json").read_text())["memory_plan"])
    assert "checkpointed 0 of 9 units" in plans[0]
    assert "checkpointed 5 of 9 units" in plans[1]
    for key in ("input_grad_norm", "param_grad_norm"):
        assert got[1][key] == got[0][key]
