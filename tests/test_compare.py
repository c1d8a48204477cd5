"""fusedres compare: runs grouped by variant across seeds, medians and spread over the seeds, a
diverged run ranked last and marked where it diverged, every figure and table naming the
variant; bad input exits 2 before anything is written.

Most runs here are written by hand (config.yaml and metrics.jsonl as the trainer writes them,
with known figures), so the medians can be checked exactly; one test reads conftest's tiny run
as the trainer left it."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from fusedres.apps import cli
from fusedres.apps.experiments import compare, figures

RES = {"model": "preact_resnet", "depth": 20, "variant": "cifar", "dataset": "digits",
       "batch_size": 128}
PLAIN = {**RES, "shortcut": "none"}


def _write_run(path, cfg, final_errors, diverge_at=None, finished=True):
    """A run logged every 10 iterations to 40: training loss 1/iteration, training error
    falling to the final test error, test error every 20 iterations ending at
    ``final_errors``' value; NaN loss from ``diverge_at`` on."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = []
    for it in (10, 20, 30, 40):
        loss = 1.0 / it if diverge_at is None or it < diverge_at else math.nan
        lines.append({"kind": "train", "iteration": it, "epoch": 1, "lr": 0.1, "loss": loss,
                      "error": final_errors + (40 - it) / 100})
        if it % 20 == 0:
            err = final_errors if it == 40 else final_errors / 2  # best at 20
            lines.append({"kind": "eval", "iteration": it, "epoch": 1, "test_loss": 0.5,
                          "test_error": err})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if finished:
        (path / "summary.json").write_text(json.dumps({"iterations": 40}))
    return path


@pytest.fixture
def runs(tmp_path):
    base = tmp_path / "runs"
    res = [_write_run(base / f"res-s{s}", {**RES, "seed": s}, e)
           for s, e in ((0, 0.1), (1, 0.2), (2, 0.4))]
    plain = [_write_run(base / "plain-s0", {**PLAIN, "seed": 0}, 0.5),
             _write_run(base / "plain-s1", {**PLAIN, "seed": 1}, 0.9, diverge_at=30)]
    return base, res, plain


def test_runs_group_by_variant_and_name_it(runs, tmp_path):
    base, res, plain = runs
    other_lr = _write_run(base / "res-lr", {**RES, "seed": 0, "lr": 0.05}, 0.3, finished=False)
    groups = compare.group_runs([compare.load_run(p) for p in [*res, *plain, other_lr]])
    assert [len(g.runs) for g in groups] == [3, 2, 1]
    assert [g.label for g in groups] == [
        "ResNet-20: full pre-activation unit, identity shortcut, BatchNorm, no drop-path; lr 0.1",
        "ResNet-20: full pre-activation unit, no shortcut (plain), BatchNorm, no drop-path; "
        "lr 0.1",
        "ResNet-20: full pre-activation unit, identity shortcut, BatchNorm, no drop-path; "
        "lr 0.05"]
    # Without the lr run nothing else differs: the variant label alone.
    groups = compare.group_runs([compare.load_run(p) for p in [*res, *plain]])
    assert groups[0].label.endswith("no drop-path")


def test_medians_spread_and_the_diverged_run(runs):
    _, res, plain = runs
    groups = compare.group_runs([compare.load_run(p) for p in [*res, *plain]])
    summary = compare.summarise(groups)
    r, p = summary
    assert r["final_test_error"] == {"n": 3, "median": 0.2, "q1": pytest.approx(0.15),
                                     "q3": pytest.approx(0.3), "min": 0.1, "max": 0.4,
                                     "not_finite": 0}
    assert r["best_test_error"]["median"] == pytest.approx(0.1)
    assert [x["best_iteration"] for x in r["runs"]] == [20, 20, 20]
    assert r["diverged"] == 0 and p["diverged"] == 1
    assert [x["diverged_at"] for x in p["runs"]] == [None, 30]
    # The diverged run's loss counts as +inf: the median of two is inf from iteration 30.
    loss = p["curves"]["train_loss"]
    assert loss["iteration"] == [10, 20, 30, 40]
    assert loss["median"][:2] == [0.1, 0.05] and loss["median"][2:] == [math.inf, math.inf]
    assert p["final_train_loss"]["median"] is None and p["final_train_loss"]["not_finite"] == 1
    text = compare.table(summary)
    assert "| 20.00 (10.00-40.00) | 10.00 (5.00-20.00) |" in text
    assert "| 1 of 2 |" in text and "not finite (1 of 2)" in text


def test_the_figure_is_labelled_and_marks_divergence(runs):
    _, res, plain = runs
    groups = compare.group_runs([compare.load_run(p) for p in [*res, *plain]])
    summary = compare.summarise(groups)
    fig = compare.figure(groups, summary)
    assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    assert fig.get_figwidth() == figures.COLUMN_WIDTH
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    # The legend names what differs; what the variants share is said once, in the title.
    assert legend[0] == "identity shortcut (3 runs, seeds 0, 1, 2)"
    assert legend[1] == "no shortcut (plain) (2 runs, seeds 0, 1)"
    assert legend[-1] == "a run diverged here (loss not finite)"
    assert "ResNet-20: full pre-activation unit, BatchNorm, no drop-path" in \
        fig.get_suptitle().replace("\n", " ")
    # One x per panel at iteration 30, in the plain group's colour (C1).
    marks = [(ln.get_xdata()[0], ln.get_color()) for ax in fig.axes for ln in ax.lines
             if ln.get_marker() == "x"]
    assert marks == [(30, "C1")] * 3
    # Every run's own test-error curve, then the median; the band is min-max.
    test_ax = fig.axes[2]
    own = [list(ln.get_ydata()) for ln in test_ax.lines if ln.get_color() == "C0"]
    assert own[:3] == [[5.0, 10.0], [10.0, 20.0], [20.0, 40.0]]
    assert own[3] == pytest.approx([10.0, 20.0])
    assert summary[0]["curves"]["test_error"]["min"] == [0.05, 0.1]
    assert summary[0]["curves"]["test_error"]["max"] == [0.2, 0.4]
    # No NaN or inf plotted as a value: the median lines break instead.
    loss_lines = [ln for ln in fig.axes[0].lines if ln.get_marker() != "x"]
    assert all(not math.isinf(v) for ln in loss_lines for v in ln.get_ydata())
    figures.pyplot().close(fig)


def test_the_command_writes_md_json_png(runs, capsys):
    base, res, plain = runs
    assert cli.main(["compare", *map(str, res + plain)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Retraining noise (same configuration, other seeds)")
    out = base / "compare"
    assert {p.name for p in out.iterdir()} == {"compare.md", "compare.json", "compare.png"}
    doc = json.loads((out / "compare.json").read_text())  # strict JSON: no NaN
    assert [g["final_test_error"]["median"] for g in doc["groups"]] == [0.2, pytest.approx(0.7)]
    md = (out / "compare.md").read_text()
    assert "identity shortcut" in md and "no shortcut (plain)" in md
    assert f"{plain[1]} diverged at iteration 30." in md
    assert "![training curves](compare.png)" in md
    assert "| variant | seeds |" in printed and "| A | B | seeds |" in printed
    # Hand-written runs record no provenance: said, and warned about.
    assert "warning: 5 run(s) record no commit" in md


def test_the_tiny_run_as_the_trainer_wrote_it(tiny_run, tmp_path):
    run = compare.load_run(tiny_run)
    assert run.num_classes == 10 and run.finished and run.diverged_at is None
    assert [r["iteration"] for r in run.train] == [3, 6]
    groups = compare.group_runs([run])
    fig = compare.figure(groups, compare.summarise(groups))
    assert figures.unlabelled(fig) == []
    # The chance line at 90 % error on both error panels.
    chance = [ln for ax in fig.axes[1:] for ln in ax.lines if ln.get_linestyle() == "--"]
    assert [ln.get_ydata()[0] for ln in chance] == [pytest.approx(90.0)] * 2
    figures.pyplot().close(fig)
    assert compare.main([str(tiny_run), "--out", str(tmp_path / "c")]) == 0
    assert "ResNet-14: full pre-activation unit" in (tmp_path / "c" / "compare.md").read_text()


def test_bad_input_exits_2_before_writing(runs, tmp_path, capsys):
    base, res, _ = runs
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("")
    out = tmp_path / "out"
    cases = [
        ([str(tmp_path / "missing")], "RUN: '" + str(tmp_path / "missing") + "' does not exist"),
        ([str(not_a_run)], "is not a run directory of fusedres train (no config.yaml in it)"),
        ([str(res[0]), str(res[0])], "is given twice"),
        ([str(res[0]), "--out", str(a_file)], "--out: '" + str(a_file) + "' exists and is not"),
    ]
    for argv, match in cases:
        assert cli.main(["compare", *argv, *(["--out", str(out)] if "--out" not in argv
                                             else [])]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and match in err, err
        assert not out.exists()
    (res[1] / "metrics.jsonl").write_text('{"kind": "train", "iter')
    assert compare.main([str(res[1]), "--out", str(out)]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err and not out.exists()


def test_logging_gradient_norms_is_not_a_variant(runs):
    """--log-grad-norms changes nothing trained: such a run is a seed of the same variant, and
    without any grad_norms record there is no gradient figure."""
    base, res, _ = runs
    logged = _write_run(base / "res-gn", {**RES, "seed": 5, "log_grad_norms": 10,
                                            "log_every": 10}, 0.3)
    groups = compare.group_runs([compare.load_run(p) for p in [*res, logged]])
    assert [len(g.runs) for g in groups] == [4]
    summary = compare.summarise(groups)
    assert summary[0]["grad_norms"] is None
    assert compare.grad_norm_figure(groups, summary) is None


def test_a_seed_given_twice_is_refused_unless_allowed(runs, tmp_path, capsys):
    """A second run of one configuration and seed is a retraining, not another seed: counting
    it would narrow the spread by a copy."""
    base, res, _ = runs
    again = _write_run(base / "res-s0-again", {**RES, "seed": 0}, 0.15)
    argv = ["compare", str(res[0]), str(res[1]), str(again), "--out", str(tmp_path / "c")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "are the same configuration and seed 0" in err and "--allow-duplicates" in err
    assert not (tmp_path / "c").exists()
    assert cli.main([*argv, "--allow-duplicates"]) == 0
    doc = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert [r["seed"] for r in doc["groups"][0]["runs"]] == [0, 1, 0]
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "a seed appears more than once (--allow-duplicates)" in md


def test_pairs_are_paired_by_seed_with_an_interval_and_a_verdict(tmp_path):
    """B - A per seed: B 5 points worse on every seed is separated (the interval is [5, 5]);
    C, worse on two seeds and better on one, is not; the noise line is the seeds' spread."""
    base = tmp_path / "runs"
    a = [_write_run(base / f"a-s{s}", {**RES, "seed": s}, e)
         for s, e in ((0, 0.10), (1, 0.20), (2, 0.30))]
    b = [_write_run(base / f"b-s{s}", {**RES, "seed": s, "lr": 0.05}, e)
         for s, e in ((0, 0.15), (1, 0.25), (2, 0.35))]
    c = [_write_run(base / f"c-s{s}", {**RES, "seed": s, "lr": 0.2}, e)
         for s, e in ((0, 0.20), (1, 0.10), (2, 0.40))]
    groups = compare.group_runs([compare.load_run(p) for p in [*a, *b, *c]])
    summary = compare.summarise(groups)
    ab, ac, bc = compare.pairs(summary)
    assert ab["seeds"] == [0, 1, 2] and ab["differences"] == pytest.approx([5.0] * 3)
    assert ab["mean"] == pytest.approx(5.0) and ab["verdict"] == "separated"
    assert ab["low"] == pytest.approx(5.0) and ab["high"] == pytest.approx(5.0)
    assert ac["differences"] == pytest.approx([10.0, -10.0, 10.0])
    assert ac["low"] < 0 < ac["high"] and ac["verdict"] == "not separated"
    noise = compare.noise(summary)
    assert noise["spreads"] == pytest.approx([20.0, 20.0, 30.0]) and noise["median"] == 20.0
    assert "lie 20.00 points apart" in compare.noise_line(noise)
    table = compare.pairs_table([ab, ac, bc])
    assert "| +5.00 | +5.00 to +5.00 | separated |" in table


def test_provenance_is_printed_and_differences_warned(runs, tmp_path):
    """Runs that record different commits (or uncommitted changes) are compared with a
    warning: a difference between variants may be the code's."""
    base, res, plain = runs
    for path, commit, dirty in ((res[0], "a" * 40, False), (res[1], "a" * 40, False),
                                (res[2], "b" * 40, True)):
        cfg = yaml.safe_load((path / "config.yaml").read_text())
        cfg["provenance"] = [{"from_iteration": 0, "commit": commit, "dirty": dirty,
                              "versions": {"torch": "2.14.1"}, "device": "cpu: x"}]
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    loaded = [compare.load_run(p) for p in res]
    lines, warnings = compare.provenance_report(loaded)
    assert lines[0].startswith("- commit aaaaaaaaaa; torch 2.14.1; on cpu: x: 2 run(s)")
    assert lines[1].startswith("- commit bbbbbbbbbb (uncommitted changes)")
    assert any("2 different commits" in w for w in warnings)
    assert any("uncommitted changes" in w for w in warnings)
    same, none = compare.provenance_report(loaded[:2])
    assert none == [] and len(same) == 1
