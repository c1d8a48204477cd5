"""fusedres bench: argument errors, the measuring helpers, the report's ratios from known
medians, and quick runs of units, step, fit and the whole gpu-report on CPU (JSON, Markdown
and PNG written, figures consistent). No wall-clock assertions: times are only checked to be
positive and ratios to be computed from the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fusedres.apps.bench import main
from fusedres.apps.bench import step as step_mod
from fusedres.apps.bench import units as units_mod
from fusedres.apps.bench.fit import search
from fusedres.apps.bench.measure import summarize, time_interleaved, with_env
from fusedres.apps.bench.runner import QUICK_FIT, Report
from fusedres.models import unit_shapes as S

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(*argv, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "fusedres.apps.bench", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)
    return proc


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("argv, flag", [
    ([], "expected a command"),
    (["units", "--reps", "0"], "--reps"),
    (["units", "--warmup", "-1"], "--warmup"),
    (["units", "--set", "nonesuch"], "--set"),
    (["units", "--shapes", "conv:N=1,C=8,CO=8,HW=8"], "--shapes"),
    (["units", "--shapes", "resnet"], "--shapes"),
    (["units", "--baselines", "eager"], "--baselines"),
    (["units", "--backends", "triton"], "--backends"),
    (["units", "--amp", "fp8"], "--amp"),
    (["units", "--bogus"], "--bogus"),
    (["units", "--device", "tpu"], "--device"),
    (["step", "--models", "21"], "--models"),
    (["step", "--variants", "fast"], "--variants"),
    (["step", "--layouts", "nhwc"], "--layouts: unknown 'nhwc'; expected some of nchw, "
                                    "channels_last"),
    (["step", "--layouts", ","], "--layouts: none given"),
    (["step", "--batch", "ten"], "--batch"),
    (["step", "--plan-budget", "lots"], "--plan-budget"),
    (["fit", "--budget", "0GiB"], "--budget"),
    (["fit", "--depth", "21"], "--depth"),
    (["gpu-report", "--time-limit", "-5"], "--time-limit"),
    (["gpu-report", "--step-kinds", "warp"], "--step-kinds: unknown 'warp'; expected some of"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fusedres bench: error: ") and flag in err, err
    assert captured.out == ""  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_and_out_that_is_a_file(tmp_path, capsys):
    assert main(["units", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err
    path = tmp_path / "file"
    path.write_text("mine")
    assert main(["units", "--quick", "--out", str(path)]) == 2
    assert "--out" in capsys.readouterr().err and path.read_text() == "mine"


def test_parse_shape_and_select():
    u = S.parse_shape("conv:N=64,C=48,K=3,CO=48,HW=16,S=2,res")
    assert (u.n, u.cin, u.cout, u.hw, u.k, u.stride, u.residual) == (64, 48, 48, 16, 3, 2, True)
    assert u.ho == 8 and u.padding == 1
    b = S.parse_shape("bottleneck:N=32,C=256,P=64,HW=56,S=2")
    assert (b.block, b.cout, b.projection, b.stride_on) == ("bottleneck", 256, True, "conv2")
    assert not S.parse_shape("basic:N=8,C=16,P=16,HW=32").projection
    with pytest.raises(ValueError, match="--shapes"):
        S.parse_shape("bottleneck:N=32,C=256,P=64,HW=56,res")
    assert S.select("basic C=48 s2 +res,cifar", False, "x")[0].name == "basic C=48 s2 +res"
    assert S.select(None, True, "cifar") == S.SETS["quick"]


def test_conv_units_of_blocks():
    """A block's BN-ReLU-conv units: torchvision's bottleneck strides its 3x3, He et al.'s CIFAR
    one its first 1x1; the expand conv takes the residual; the projection reads the block's
    input. R50_CONVS: the 23 distinct units of ResNet-50's bottlenecks at batch 256."""
    r50 = S.conv_units(S.parse_shape("bottleneck:N=32,C=256,P=128,HW=56,S=2"), 256, "r")
    assert [(u.name, u.n, u.ho) for u in r50] == [
        ("r 256>128 1x1 @56", 256, 56), ("r 128>128 3x3 /2 @56", 256, 28),
        ("r 128>512 1x1 @28 +res", 256, 28), ("r 256>512 1x1 /2 @56", 256, 28)]
    cifar = S.conv_units(S.CIFAR_BOTTLENECKS[1])
    assert [u.name for u in cifar] == ["64>32 1x1 /2 @32", "32>32 3x3 @16",
                                       "32>128 1x1 @16 +res", "64>128 1x1 /2 @32"]
    basic = S.conv_units(S.CIFAR_BASIC_BLOCKS[0])
    assert [u.name for u in basic] == ["16>16 3x3 @32", "16>16 3x3 @32 +res"]
    assert len(S.R50_CONVS) == len(set(S.R50_CONVS)) == 23
    assert {u.n for u in S.R50_CONVS} == {256}


def test_basic_sweep_is_the_issue_sweep():
    """40 single basic units: C in 16..256 (not only powers of two), s in 1, 2, +-residual,
    N=64, 16x16, 3x3 C -> C, padding 1."""
    sweep = S.BASIC_SWEEP
    assert len(sweep) == 40 and len({u.name for u in sweep}) == 40
    assert {u.cin for u in sweep} == {16, 24, 32, 48, 64, 96, 128, 160, 192, 256}
    assert all(u.cin == u.cout and u.n == 64 and u.hw == 16 and u.k == 3 and u.padding == 1
               for u in sweep)
    assert {(u.stride, u.residual) for u in sweep} == {(1, False), (1, True), (2, False),
                                                       (2, True)}
    assert any(u.name == "basic C=48 s2 +res" for u in sweep)


# --------------------------------------------------------------------------- measuring

def test_time_interleaved_warms_up_then_alternates_the_order():
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in "ABC"}
    times = time_interleaved(steps, torch.device("cpu"), warmup=2, reps=4)
    assert calls[:6] == ["A", "A", "B", "B", "C", "C"]
    rounds = [calls[6 + 3 * r: 9 + 3 * r] for r in range(4)]
    assert rounds[0] == ["A", "B", "C"] and rounds[1] == ["C", "B", "A"]
    assert all(sorted(r) == ["A", "B", "C"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 2  # not the same two orders over and over
    assert {k: len(v) for k, v in times.items()} == {"A": 4, "B": 4, "C": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_time_interleaved_samples_several_calls_in_a_row():
    calls = []

    def slow(name):
        calls.append(name)
        time.sleep(0.002)

    steps = {"A": lambda: slow("A"), "B": lambda: slow("B")}
    times = time_interleaved(steps, torch.device("cpu"), warmup=1, reps=3, min_sample_s=0.01)
    # 1 warm-up call each, then samples of ceil(0.01 / ~0.002) <= 5 calls in a row
    timed = len(calls) - 2  # 3 rounds of k_A + k_B calls, 2 <= k <= 5
    assert timed % 3 == 0 and 3 * 4 <= timed <= 3 * 10, timed
    assert {k: len(v) for k, v in times.items()} == {"A": 3, "B": 3}
    assert all(0.0019 < t < 0.05 for v in times.values() for t in v)  # seconds per call


def test_time_interleaved_reads_the_clock_it_is_given():
    # A sleep costs wall time, not this thread's CPU time; a fake clock is read as given.
    steps = {"sleep": lambda: time.sleep(0.01)}
    cpu = torch.device("cpu")
    wall = time_interleaved(steps, cpu, warmup=0, reps=2)
    own = time_interleaved(steps, cpu, warmup=0, reps=2, clock=time.thread_time)
    assert min(wall["sleep"]) > 0.009 and max(own["sleep"]) < 0.005, (wall, own)
    ticks = iter(range(100))
    fake = time_interleaved(steps, cpu, warmup=0, reps=3, clock=lambda: 10.0 * next(ticks))
    assert fake["sleep"] == [10.0, 10.0, 10.0]


def test_with_env_sets_then_restores(monkeypatch):
    seen = []

    def read():
        seen.append(os.environ.get("FUSEDRES_TEST_AB"))
        return "ok"

    monkeypatch.setenv("FUSEDRES_TEST_AB", "before")
    assert with_env(read, "FUSEDRES_TEST_AB", "1")() == "ok"
    with_env(read, "FUSEDRES_TEST_AB", None)()
    assert seen == ["1", None] and os.environ["FUSEDRES_TEST_AB"] == "before"
    monkeypatch.delenv("FUSEDRES_TEST_AB")

    def fail():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        with_env(fail, "FUSEDRES_TEST_AB", "1")()
    assert "FUSEDRES_TEST_AB" not in os.environ


def test_summarize():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median_s"], s["min_s"], s["max_s"], s["reps"]) == (3.0, 1.0, 5.0, 5)
    assert (s["q25_s"], s["q75_s"], s["iqr_s"]) == (2.0, 4.0, 2.0)


def test_search_finds_the_largest_size_that_fits():
    probed = []

    def fits(k):
        probed.append(k)
        return k <= 37

    assert search(fits, 2, 4096) == (37, "exact")
    assert len(probed) == len(set(probed)) < 14  # doubling, then bisection; no repeats
    assert search(lambda k: k <= 37, 2, 20) == (20, "cap reached: a lower bound")
    assert search(lambda k: False, 2, 20) == (None, "the smallest size does not fit")


def test_report_writes_each_part_as_it_finishes(tmp_path, capsys):
    rep = Report(str(tmp_path), "t", torch.device("cpu"), ["units"])
    rep.add("first", {"a": 1}, "table one", "## One")
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["parts"] == {"first": {"a": 1}} and doc["machine"]["torch"] == torch.__version__
    assert "## One" in (tmp_path / "report.md").read_text()
    rep.add("second", {"b": 2}, "table two", "## Two")
    md = (tmp_path / "report.md").read_text()
    assert md.index("## One") < md.index("## Two")
    assert list(json.loads((tmp_path / "results.json").read_text())["parts"]) == ["first",
                                                                                 "second"]
    assert capsys.readouterr().out.splitlines() == ["table one", "table two"]


def _unit_row(shape, impl, backend, layout, median_s):
    return {"shape": shape, "impl": impl, "backend": backend, "layout": layout,
            "median_s": median_s}


def test_layout_ratios_from_known_medians():
    """Same-layout and best-vs-best ratios of the units report, from given medians: shape A
    has plain channels_last faster than plain NCHW, shape B the other way round."""
    rows = [
        _unit_row("A", "plain", "reference", "nchw", 10.0),
        _unit_row("A", "channels_last", "reference", "channels_last", 6.0),
        _unit_row("A", "checkpoint", "reference", "nchw", 13.0),
        _unit_row("A", "cpu", "cpu", "nchw", 8.0),
        _unit_row("A", "cpu channels_last", "cpu", "channels_last", 6.6),
        _unit_row("B", "plain", "reference", "nchw", 4.0),
        _unit_row("B", "channels_last", "reference", "channels_last", 5.0),
        _unit_row("B", "cpu", "cpu", "nchw", 2.8),
        _unit_row("B", "cpu channels_last", "cpu", "channels_last", 5.25),
    ]
    for shape in "AB":
        units_mod.layout_ratios([r for r in rows if r["shape"] == shape])
    a_nchw, a_cl, b_nchw, b_cl = (r for r in rows if r["backend"] == "cpu")
    assert a_nchw["same_layout_ratio"] == pytest.approx(0.8)        # 8 / 10
    assert a_cl["same_layout_ratio"] == pytest.approx(1.1)          # 6.6 / 6
    assert b_nchw["same_layout_ratio"] == pytest.approx(0.7)        # 2.8 / 4
    assert b_cl["same_layout_ratio"] == pytest.approx(1.05)         # 5.25 / 5
    # A: the fused unit's faster layout is channels_last (6.6), plain's too (6): 1.1, on
    # both rows of the backend; the channels_last row is marked as the faster one.
    assert a_nchw["best_ratio"] == a_cl["best_ratio"] == pytest.approx(1.1)
    assert (a_cl["best_fused_layout"], a_cl["best_plain_layout"]) == ("channels_last",
                                                                      "channels_last")
    assert a_cl["is_best_layout"] and not a_nchw["is_best_layout"]
    # B: fused NCHW (2.8) against plain NCHW (4).
    assert b_cl["best_ratio"] == pytest.approx(0.7) and b_nchw["is_best_layout"]
    assert b_nchw["best_plain_layout"] == "nchw"
    # The plain rows get no layout ratios; the table shows best x best once per backend.
    assert all("same_layout_ratio" not in r for r in rows if r["backend"] == "reference")
    cells = [units_mod.columns(layouts=True)[6].cell(r) for r in rows]
    assert [c for c in cells if c != "-"] == ["1.10 (vs cl)", "0.70 (vs nchw)"]

    summary = {s["comparison"]: s for s in units_mod.layout_summary(rows)}
    assert set(summary) == {"nchw", "channels_last", "best"}
    assert summary["nchw"]["median_ratio"] == pytest.approx(0.75)
    assert (summary["nchw"]["above_1"], summary["nchw"]["shapes"]) == (0, 2)
    assert (summary["channels_last"]["above_1"], summary["channels_last"]["worst_shape"]) == (
        2, "A")
    assert summary["channels_last"]["worst_ratio"] == pytest.approx(1.1)
    assert summary["best"]["median_ratio"] == pytest.approx((1.1 + 0.7) / 2)
    assert (summary["best"]["above_1"], summary["best"]["worst_shape"]) == (1, "A")
    lines = units_mod.summary_lines(units_mod.layout_summary(rows))
    assert lines[2] == ("cpu, best fused / best plain: median 0.90, above 1.0 on 1 of 2 shapes,"
                        " worst A (1.10)")


def test_layout_ratios_without_plain_channels_last():
    """Plain timed in NCHW only (``--baselines plain``, or a GPU's fused channels_last rows):
    the same-layout ratio exists for NCHW, best-vs-best does not."""
    rows = [_unit_row("A", "plain", "reference", "nchw", 10.0),
            _unit_row("A", "cpu", "cpu", "nchw", 8.0),
            _unit_row("A", "cpu channels_last", "cpu", "channels_last", 7.0)]
    units_mod.layout_ratios(rows)
    assert rows[1]["same_layout_ratio"] == pytest.approx(0.8)
    assert rows[2]["same_layout_ratio"] is None
    assert rows[1]["best_ratio"] is None and rows[2]["best_ratio"] is None
    assert [s["comparison"] for s in units_mod.layout_summary(rows)] == ["nchw"]


def test_step_ratios_are_to_the_best_plain_row():
    rows = [{"variant": "plain", "layout": "nchw", "median_s": 2.0, "peak_bytes": 100},
            {"variant": "plain", "layout": "channels_last", "median_s": 1.6, "peak_bytes": 90},
            {"variant": "fused", "layout": "nchw", "median_s": 1.8, "peak_bytes": 50},
            {"variant": "fused", "layout": "channels_last", "median_s": 1.2, "peak_bytes": 45},
            {"variant": "fused+plan", "layout": "channels_last", "skipped": "planner: ..."}]
    step_mod.best_plain_ratios(rows)
    plain_nchw, plain_cl, fused_nchw, fused_cl, skipped = rows
    assert {r["best_plain_layout"] for r in rows[:4]} == {"channels_last"}
    assert plain_cl["time_ratio"] == 1.0 and plain_nchw["time_ratio"] == pytest.approx(1.25)
    assert fused_nchw["time_ratio"] == pytest.approx(1.125)
    assert fused_cl["time_ratio"] == pytest.approx(0.75)
    assert fused_cl["peak_ratio"] == pytest.approx(0.5)
    assert fused_nchw["same_layout_time_ratio"] == pytest.approx(0.9)
    assert fused_cl["same_layout_time_ratio"] == pytest.approx(0.75)
    assert "time_ratio" not in skipped
    # One layout: the best plain row is the only one, the old "x plain".
    one = [dict(r) for r in rows[::2] if "median_s" in r]
    step_mod.best_plain_ratios(one)
    assert one[1]["time_ratio"] == pytest.approx(0.9) and one[0]["time_ratio"] == 1.0


# --------------------------------------------------------------------------- quick runs


def test_step_quick_in_both_layouts(tmp_path):
    out = tmp_path / "step"
    proc = _cli("step", "--quick", "--layouts", "nchw,channels_last", "--variants",
                "plain,fused", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    rows = {(r["variant"], r["layout"]): r for r in doc["parts"]["step"]["rows"]}
    assert set(rows) == {(v, lay) for v in ("plain", "fused")
                         for lay in ("nchw", "channels_last")}
    best = min(rows["plain", "nchw"], rows["plain", "channels_last"],
               key=lambda r: r["median_s"])
    for r in rows.values():
        assert r["images_per_s"] > 0 and r["best_plain_layout"] == best["layout"]
        assert r["time_ratio"] == r["median_s"] / best["median_s"]
        assert r["peak_ratio"] == r["peak_bytes"] / best["peak_bytes"]
    for layout in ("nchw", "channels_last"):  # counted, not timed: same in either layout
        assert rows["fused", layout]["saved_bytes"] < rows["plain", layout]["saved_bytes"]
    md = (out / "report.md").read_text()
    assert "| variant | layout |" in md and "time x best plain" in md
    assert "channels_last" in proc.stdout and (out / "step.png").read_bytes()[:8] == PNG_MAGIC


# --------------------------------------------------------------------------- quick runs

UNIT_ROW_KEYS = {"shape", "kind", "impl", "backend", "layout", "median_s", "iqr_s", "q25_s",
                 "q75_s", "min_s", "max_s", "reps", "ratio", "saved_bytes", "peak_bytes"}


def _check_units_rows(rows):
    measured = [r for r in rows if r.get("impl") is not None]
    assert measured
    for shape in {r["shape"] for r in measured}:
        group = [r for r in measured if r["shape"] == shape]
        plain = [r for r in group if r["impl"] == "plain"]
        assert len(plain) == 1 and plain[0]["ratio"] == 1.0
        for r in group:
            assert UNIT_ROW_KEYS <= set(r), set(r) ^ UNIT_ROW_KEYS
            assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
            # The ratio is to the plain row of the same shape in the same run.
            assert r["ratio"] == r["median_s"] / plain[0]["median_s"]
        fused = [r for r in group if r["backend"] not in ("reference",)]
        assert fused, "no fused backend timed"
        for r in fused:  # the fused unit keeps less for backward (x, not relu(bn(x)))
            assert r["saved_bytes"] < plain[0]["saved_bytes"]
            assert r["peak_bytes"] < plain[0]["peak_bytes"]
        ckpt = [r for r in group if r["impl"] == "checkpoint"]
        assert ckpt and ckpt[0]["saved_bytes"] < plain[0]["saved_bytes"]
    return measured


def test_units_quick_writes_json_markdown_and_png(tmp_path):
    out = tmp_path / "units"
    proc = _cli("units", "--quick", "--baselines", "plain,channels_last,checkpoint",
                "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert {"title", "command", "machine", "parts"} <= set(doc)
    assert {"cpu", "cores", "torch_threads", "torch", "fusedres", "backends", "device",
            "python"} <= set(doc["machine"])
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["torch_threads"] == 1
    rows = _check_units_rows(doc["parts"]["units"]["rows"])
    assert {r["shape"] for r in rows} == {u.name for u in S.SETS["quick"]}
    # with the plain channels_last unit, the fused one on channels_last tensors too
    assert {r["impl"] for r in rows} >= {"plain", "channels_last", "checkpoint", "cpu",
                                         "cpu channels_last"}
    # Same-layout and best-vs-best ratios: on every fused row, from the medians of the run.
    for r in rows:
        if r["backend"] == "reference":
            continue
        group = {g["impl"]: g for g in rows if g["shape"] == r["shape"]}
        same = group["plain" if r["layout"] == "nchw" else "channels_last"]
        assert r["same_layout_ratio"] == r["median_s"] / same["median_s"]
        mine = [g for g in group.values() if g["backend"] == r["backend"]]
        best_plain = min(group["plain"]["median_s"], group["channels_last"]["median_s"])
        assert r["best_ratio"] == min(g["median_s"] for g in mine) / best_plain
    summary = doc["parts"]["units"]["summary"]
    assert {(s["backend"], s["comparison"]) for s in summary} >= {
        ("cpu", "nchw"), ("cpu", "channels_last"), ("cpu", "best")}
    assert all(s["shapes"] == len(S.SETS["quick"]) for s in summary)
    md = (out / "report.md").read_text()
    assert "| shape | impl | median ms |" in md and "![units](units-ratio.png)" in md
    assert "| x plain same layout | best x best plain |" in md
    assert "cpu, best fused / best plain: median" in md
    assert (out / "units-ratio.png").read_bytes()[:8] == PNG_MAGIC
    assert "x plain" in proc.stdout and "quick basic 8-8 @8" in proc.stdout
    assert "cpu, fused channels_last / plain channels_last: median" in proc.stdout


def test_fit_quick_finds_a_budget_bound_answer(tmp_path):
    proc = _cli("fit", "--quick", "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    fit = json.loads((tmp_path / "results.json").read_text())["parts"]["fit"]
    budget = QUICK_FIT["budget"]
    assert fit["budget_bytes"] == budget
    _check_fit(fit, budget)
    assert (tmp_path / "fit.png").read_bytes()[:8] == PNG_MAGIC


def _check_fit(fit, budget):
    res = {(r["variant"], r["search"]): r for r in fit["results"]}
    plain = res["plain", "batch"]
    # Bound by the budget, not by a cap: the answer fits, one more does not.
    assert plain["how"] == "exact" and plain["largest"] is not None
    assert plain["peak_bytes"] <= budget
    over = [p for p in fit["probes"] if p["variant"] == "plain" and p["search"] == "batch"
            and p["batch"] == plain["largest"] + 1]
    assert over and not over[0]["fits"] and over[0]["peak_bytes"] > budget
    for p in fit["probes"]:
        if "peak_bytes" in p:
            assert p["fits"] == (p["peak_bytes"] <= budget)
    # Peaks are counted (LiveTensorTracker), not timed: fused fits at least plain's batch.
    assert res["fused", "batch"]["largest"] >= plain["largest"]
    assert res["fused", "depth"]["largest"] >= res["plain", "depth"]["largest"]


def test_gpu_report_quick_end_to_end_on_cpu(tmp_path):
    """``make gpu-report``'s command on CPU: the parts in order, one directory with one
    Markdown file, <= 6 PNGs and a JSON."""
    out = tmp_path / "report"
    proc = _cli("gpu-report", "--quick", "--device", "cpu", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    pngs = [f for f in files if f.endswith(".png")]
    assert [f for f in files if not f.endswith(".png")] == ["report.md", "results.json"]
    assert 3 <= len(pngs) <= 6
    for p in pngs:
        assert (out / p).read_bytes()[:8] == PNG_MAGIC
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["parts"]) == ["selftest", "units", "convs", "compile", "step",
                                  "step-graphed", "fit"]
    # Printed as each part finished, in order.
    text = proc.stdout
    marks = ["[self-test:", "[units:", "[convs:", "[compile:", "[step:", "[step-graphed:",
             "[fit:", "gpu-report finished"]
    assert all(m in text for m in marks), text[-2000:]
    assert [text.index(m) for m in marks] == sorted(text.index(m) for m in marks)
    md = (out / "report.md").read_text()
    for section in ("## Self-test", "## Units", "## Whole training steps", "## What fits in"):
        assert section in md
    st = doc["parts"]["selftest"]
    if "skipped" not in st:
        assert st["failed"] == 0 and st["passed"] > 0
    units_rows = _check_units_rows(doc["parts"]["units"]["rows"])
    assert {"channels_last", "checkpoint"} <= {r["impl"] for r in units_rows}
    _check_units_rows(doc["parts"]["convs"]["rows"])
    compiled = [r for r in doc["parts"]["compile"]["rows"] if r.get("impl") == "compile"]
    assert compiled and compiled[0]["ratio"] > 0
    # On CPU every variant in both layouts (the NCHW rows checked here).
    step_rows = doc["parts"]["step"]["rows"]
    assert {(r["variant"], r["layout"]) for r in step_rows} == {
        (v, lay) for v in step_mod.VARIANTS for lay in ("nchw", "channels_last")}
    steps = {r["variant"]: r for r in step_rows if r["layout"] == "nchw"}
    assert all(r["images_per_s"] > 0 for r in steps.values())
    assert steps["fused"]["saved_bytes"] < steps["plain"]["saved_bytes"]
    assert steps["fused+plan"]["saved_bytes"] <= steps["fused"]["saved_bytes"]
    assert steps["fused+plan"]["units_checkpointed"] > 0  # default budget: half of fused
    assert steps["plain+ckpt"]["saved_bytes"] < steps["plain"]["saved_bytes"]
    assert steps["fused"]["peak_bytes"] < steps["plain"]["peak_bytes"]
    # The graphed kind: plain and fused eager timed, the CUDA-graph rows skipped off a GPU.
    graphed = {r["variant"]: r for r in doc["parts"]["step-graphed"]["rows"]}
    assert set(graphed) == {"plain", "plain+graph", "fused", "fused+graph"}
    assert graphed["fused"]["images_per_s"] > 0
    assert graphed["fused+graph"]["skipped"] == "needs a CUDA device"
    _check_fit(doc["parts"]["fit"], QUICK_FIT["budget"])


def test_python_m_fusedres_bench_and_fusedres_bench_are_one_command():
    from fusedres.apps.cli import COMMANDS
    assert COMMANDS["bench"][0] == "fusedres.apps.bench"
    proc = _cli("--help")
    assert proc.returncode == 0 and "units" in proc.stdout and "gpu-report" in proc.stdout


def test_bandwidth_columns_leave_rows_without_them_blank():
    """On a GPU the convs table has bandwidth columns that only triton rows fill (a plain row
    beside them broke the H100 report with a KeyError): the other rows show "-"."""
    from fusedres.apps.bench import report as R
    base = dict(shape="s", median_s=1e-3, iqr_s=1e-4, ratio=1.0)
    rows = [dict(base, impl="plain"),
            dict(base, impl="triton", modeled_bytes=5e6, achieved_Bps=5e9,
                 bandwidth_fraction=0.25)]
    md = R.markdown_table(rows, units_mod.columns() + units_mod.bandwidth_cols()).splitlines()
    assert md[2].endswith("| - | - | - |") and md[3].endswith("| 5.0 | 5 | 25% |")


def test_profiled_seconds_sums_self_times_per_step():
    """kernel_columns' sum (GPU: self device time of every op and kernel, per step), checked on
    CPU with the CPU times: positive, and at most the wall time of the profiled steps."""
    from torch.profiler import ProfilerActivity
    a = torch.randn(256, 256)

    def step():
        (a @ a).relu_().sum()

    t0 = time.perf_counter()
    per_step = units_mod.profiled_seconds(step, 4, [ProfilerActivity.CPU],
                                          "self_cpu_time_total")
    wall = time.perf_counter() - t0
    assert 0 < per_step * 4 <= wall


def test_kernel_columns_only_on_a_gpu_row_with_a_model():
    row = {"shape": "s", "impl": "plain", "modeled_s": 1e-4}
    units_mod.kernel_columns(row, lambda: None, torch.device("cpu"))
    assert "kernel_s" not in row
    md = _modeled_table([dict(row, median_s=1e-3, iqr_s=0, ratio=1.0, kernel_s=2e-4)])
    assert md.splitlines()[2].endswith("| 0.100 | 10.00 | 0.200 | 2.00 | - | - |")


def test_replay_seconds_warms_up_captures_once_and_times_the_replays():
    """The replay timing's bookkeeping on CPU with a stand-in capture: the warm-up steps, one
    capture of the step, one untimed replay, then the timed ones; only GPU rows with a model
    get the column (what a GPU adds: the capture itself and CUDA events, not run here)."""
    calls, captured = [], []

    def step():
        calls.append("step")

    def capture(fn):
        captured.append(fn)
        return lambda: calls.append("replay")

    t = units_mod.replay_seconds(step, torch.device("cpu"), reps=5, warmup=3, capture=capture)
    assert captured == [step] and calls == ["step"] * 3 + ["replay"] * 6 and t >= 0
    row = {"shape": "s", "impl": "plain", "modeled_s": 1e-4}
    units_mod.replay_columns(row, step, torch.device("cpu"))
    assert "replay_s" not in row
    md = _modeled_table([dict(row, median_s=1e-3, iqr_s=0, ratio=1.0, replay_s=1.5e-4)])
    assert md.splitlines()[2].endswith("| - | - | 0.150 | 1.50 |")


def _modeled_table(rows):
    from fusedres.apps.bench import report as R
    return R.markdown_table(rows, units_mod.columns() + units_mod.modeled_cols())


def test_graphed_trainer_steps_from_its_capture(monkeypatch):
    """The bench's graphed step (the trainer's GraphedStep) on CPU, its capture a stand-in that
    runs the captured function itself: warm-up and capture at build, then each step trains
    (the loss on the fixed batch falls), with the fused SGD's state as the trainer keeps it."""
    from fusedres.apps.train import step as train_step

    monkeypatch.setattr(train_step, "cuda_graph_capture", lambda fn: fn)
    torch.manual_seed(0)
    from fusedres import models

    model = models.preact_resnet20(fused=True)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    tr = step_mod.GraphedTrainer(model, x, y, "cpu", {})
    assert tr.graphed.captured
    losses = []
    for _ in range(4):
        tr.step()
        losses.append(float(tr.graphed.loss))
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        step_mod.build_variant("preact_resnet20", "fused+graph", 2, torch.device("cpu"))
