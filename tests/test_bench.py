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
from fusedres.apps.bench.measure import summarize, time_interleaved
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
    (["gpu-report", "--parts", "warp"], "--parts: unknown 'warp'; expected some of decisive,"),
    (["gpu-report", "--parts", ","], "--parts: none given"),
    (["gpu-report", "--slots", "decisive=soon"], "--slots: expected PART=SECONDS"),
    (["gpu-report", "--slots", "units=-1"], "--slots: expected PART=SECONDS"),
    (["gpu-report", "--slots", "warp=10"], "--slots: expected PART=SECONDS"),
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


class FakeClock:
    """A clock that each step advances by its own cost: times without a wall clock."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def step(self, name, cost, calls):
        def run():
            calls.append(name)
            self.t += cost
        return run


def test_time_interleaved_samples_several_calls_in_a_row():
    calls, clock = [], FakeClock()
    unit = 2.0 ** -9  # binary fractions: the clock's sums are exact
    steps = {"A": clock.step("A", unit, calls), "B": clock.step("B", 3 * unit, calls)}
    times = time_interleaved(steps, torch.device("cpu"), warmup=1, reps=3,
                             min_sample_s=5 * unit, clock=clock)
    # 1 warm-up call each, then samples of ceil(min_sample_s / cost) calls in a row: 5 of A,
    # 2 of B; rounds in the orders AB, BA, BA.
    assert calls[:2] == ["A", "B"]
    assert calls[2:] == ["A"] * 5 + ["B"] * 2 + ["B"] * 2 + ["A"] * 5 + ["B"] * 2 + ["A"] * 5
    assert times == {"A": [unit] * 3, "B": [3 * unit] * 3}


def test_time_interleaved_reads_the_clock_it_is_given():
    import inspect

    steps = {"sleep": lambda: None}
    ticks = iter(range(100))
    fake = time_interleaved(steps, torch.device("cpu"), warmup=0, reps=3,
                            clock=lambda: 10.0 * next(ticks))
    assert fake["sleep"] == [10.0, 10.0, 10.0]
    # The wall clock unless told otherwise (a thread's own CPU time is an option).
    assert inspect.signature(time_interleaved).parameters["clock"].default is time.perf_counter


def test_time_interleaved_stops_at_the_deadline_with_its_minimum():
    calls, clock = [], FakeClock()
    steps = {"A": clock.step("A", 1.0, calls), "B": clock.step("B", 1.0, calls)}
    times = time_interleaved(steps, torch.device("cpu"), warmup=0, reps=10, clock=clock,
                             deadline=2.5, min_reps=3, now=clock)
    # Past the deadline after the second round; the third is the minimum, then no more.
    assert {k: len(v) for k, v in times.items()} == {"A": 3, "B": 3}
    times = time_interleaved(steps, torch.device("cpu"), warmup=0, reps=4, clock=clock,
                             deadline=None, min_reps=3, now=clock)
    assert {k: len(v) for k, v in times.items()} == {"A": 4, "B": 4}


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
    """``make gpu-report``'s command on CPU: the parts in order (the answer first), one
    directory with one Markdown file, the PNGs and a JSON."""
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
    assert list(doc["parts"]) == ["decisive", "replay", "selftest", "cuda", "units", "fit",
                                  "compile"]
    # Printed as each part finished, in order.
    text = proc.stdout
    marks = ["[decisive:", "[replay:", "[selftest:", "[cuda:", "[units:", "[fit:",
             "[compile:", "gpu-report finished"]
    assert all(m in text for m in marks), text[-2000:]
    assert [text.index(m) for m in marks] == sorted(text.index(m) for m in marks)
    md = (out / "report.md").read_text()
    assert md.startswith("# fusedres GPU report\n\n## The answer: the fused training step")
    for section in ("## Training steps, every row", "## Self-test", "## Units",
                    "## What fits in"):
        assert section in md
    st = doc["parts"]["selftest"]
    if "skipped" not in st:
        assert st["failed"] == 0 and st["passed"] > 0
    units_rows = _check_units_rows(doc["parts"]["units"]["rows"])
    assert {"channels_last", "checkpoint"} <= {r["impl"] for r in units_rows}
    compiled = [r for r in doc["parts"]["compile"]["rows"] if r.get("impl") == "compile"]
    assert compiled and compiled[0]["ratio"] > 0
    decisive = doc["parts"]["decisive"]
    assert decisive["final"] and all("median_s" in r for r in decisive["rows"])
    summary = {(s["amp"], s["mode"]): s for s in decisive["summary"]}
    assert set(summary) == {(a, m) for a in ("fp32", "bf16") for m in ("eager", "graphed")}
    assert all(s["peak_x_best_plain"] < 1 for s in summary.values())
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
    """kernel_columns' sum (GPU: self device time of every op and kernel, per step): the
    profile's self times (microseconds) summed and divided by the steps, from a stand-in
    profile whose events are known."""
    import types

    calls = []

    class FakeProfile:
        def __init__(self, activities):
            self.activities = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return [types.SimpleNamespace(self_cpu_time_total=t) for t in (300.0, 500.0)]

    from torch.profiler import ProfilerActivity

    per_step = units_mod.profiled_seconds(lambda: calls.append(1), 4, [ProfilerActivity.CPU],
                                          "self_cpu_time_total", profile=FakeProfile)
    assert calls == [1, 1, 1, 1] and per_step == pytest.approx(800e-6 / 4)


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


def test_eager_and_graphed_trainers_run_the_same_step():
    """Like for like: the eager row and the graphed row run fusedres.apps.train's own step with
    the same optimizer (fused SGD, tensor lr) and loss; with the capture a stand-in that runs
    the captured function itself (CPU), the same steps give the same weights to the bit. The
    graphed trainer's warm-up and capture happen in ``prepare`` (one entry per call, the last
    the capture's)."""
    from fusedres.apps.train import step as train_step

    device = torch.device("cpu")
    eager = step_mod.make_trainer("preact_resnet20", 4, device, fused=True, image_size=16)
    graphed = step_mod.make_trainer("preact_resnet20", 4, device, fused=True, image_size=16,
                                    graphed=True, capture=lambda fn: fn)
    for tr in (eager, graphed):
        assert isinstance(tr.opt, torch.optim.SGD) and tr.opt.defaults["fused"]
        assert torch.is_tensor(tr.opt.param_groups[0]["lr"])
        assert isinstance(tr.train_step, train_step.TrainStep)
    assert len(eager.prepare(device)) == 1
    calls = graphed.prepare(device)
    assert len(calls) == train_step.WARMUP_STEPS + 1 and graphed.graphed.captured
    for _ in range(train_step.WARMUP_STEPS + 1 - 1):
        eager.step()
    for _ in range(2):
        eager.step()
        graphed.step()
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        step_mod.build_variant("preact_resnet20", "fused+graph", 2, torch.device("cpu"))


def test_step_plans_only_for_the_fused_plan_variant(monkeypatch):
    """The planner's pass (minutes on ResNet-1001) runs only where a row uses its budget."""
    def refuse(*a, **k):
        raise AssertionError("planned without a fused+plan row")

    monkeypatch.setattr(step_mod, "default_plan_budget", refuse)
    rows = step_mod.run_steps(["preact_resnet20"], 2, torch.device("cpu"),
                              variants=("plain", "fused"), reps=1, image_size=8)
    assert [r["variant"] for r in rows] == ["plain", "fused"]
    assert all(r["peak_bytes"] > 0 and r["peak_reserved_bytes"] is None for r in rows)


def test_memory_window_counts_what_is_built_inside_it():
    from fusedres.apps.bench.measure import MemoryWindow

    keep = torch.zeros(1000)  # made before: not the window's
    with MemoryWindow(torch.device("cpu")) as mem:
        a = torch.zeros(256)  # 1 KiB, alive at the end
        b = torch.zeros(1024)  # 4 KiB, freed inside
        del b
    assert mem.peak_allocated == 5 * 1024 and mem.allocated == 1024
    assert mem.peak_reserved is None and keep.numel() == a.numel() * 1000 // 256


# --------------------------------------------------------------------------- the answer

def _drow(model, amp, mode, variant, median_s, peak):
    return {"model": model, "amp": amp, "mode": mode, "variant": variant, "median_s": median_s,
            "peak_bytes": peak}


def test_decisive_summary_from_known_rows():
    from fusedres.apps.bench import decisive

    rows = [_drow("preact_resnet164", "fp32", "eager", "plain", 0.10, 1000),
            _drow("preact_resnet164", "fp32", "eager", "plain-cl", 0.08, 1100),
            _drow("preact_resnet164", "fp32", "eager", "fused", 0.09, 500),
            _drow("preact_resnet164", "fp32", "eager", "ckpt-mem", 0.18, 520),
            _drow("preact_resnet164", "fp32", "graphed", "plain", 0.05, 1000),
            {"model": "preact_resnet164", "amp": "fp32", "mode": "graphed", "variant": "fused",
             "skipped": "the time slot ended"}]
    eager, graphed = decisive.summary_rows(rows)
    assert eager["best_plain"] == "plain-cl" and eager["best_plain_s"] == 0.08
    assert eager["time_x_best_plain"] == pytest.approx(0.09 / 0.08)
    assert eager["peak_x_best_plain"] == pytest.approx(500 / 1100)
    assert eager["ckpt_mem_x_fused"] == pytest.approx(2.0)
    assert eager["peak_x_ckpt_mem"] == pytest.approx(500 / 520)
    assert graphed["fused_s"] is None and "time_x_best_plain" not in graphed
    md = _md(decisive.summary_rows(rows), decisive.summary_columns())
    assert md[2].startswith("| ResNet-164 | fp32 | eager | 90.0 | 80.0 | plain-cl | 1.12 |")


def _md(rows, cols):
    from fusedres.apps.bench import report as R
    return R.markdown_table(rows, cols).splitlines()


def test_decisive_schedule_puts_the_important_rows_first():
    from fusedres.apps.bench import decisive

    groups = decisive.schedule(["preact_resnet164", "preact_resnet1001"])
    head = [(g.model[13:], g.amp, g.mode, g.variants) for g in groups[:6]]
    main, ckpt = decisive.MAIN, decisive.CHECKPOINTED
    assert head == [("164", "fp32", "eager", main), ("164", "fp32", "graphed", main),
                    ("1001", "fp32", "eager", main), ("1001", "fp32", "graphed", main),
                    ("164", "fp32", "eager", ckpt), ("164", "fp32", "graphed", ckpt)]
    assert [g.amp for g in groups] == ["fp32"] * 8 + ["bf16"] * 8
    assert "fused" in main and {"plain", "plain-cl"} <= set(main)


def test_matched_checkpointing_counts_deep_models_on_their_twin():
    """ResNet-164's units counted on the 2-units-a-stage twin give the same per-unit bytes as
    counting ResNet-164 itself; the matched count brings plain's saved activations to at most
    the fused model's, and one unit fewer would not."""
    from fusedres.apps.bench import decisive
    from fusedres.memory.planner import profile_units

    shape = (2, 3, 32, 32)
    for fused in (False, True):
        saved, inputs, base = decisive.unit_saved("preact_resnet164", shape, torch.float32,
                                                  False, fused)
        with torch.device("meta"):
            model = decisive.models.MODELS["preact_resnet164"](fused=fused)
        with decisive.fusedres.use_backend("portable" if fused else "reference"):
            direct = profile_units(model, shape, flops=False)
        assert saved == direct.saved and inputs == direct.input_bytes
        assert base == direct.stem_bytes + direct.head_bytes
    ranges, info = decisive.matched_checkpointing("preact_resnet164", 2, 32, "fp32")
    assert info["units"] == 54 and len(ranges) == info["ckpt_units"]
    assert info["ckpt_saved"] <= info["fused_saved"] < info["plain_saved"]
    saved, inputs, base = decisive.unit_saved("preact_resnet164", shape, torch.float32, False,
                                              False)
    fewer = decisive._spread(54, info["ckpt_units"] - 1)
    assert base + sum(inputs[i] if c else saved[i] for i, c in enumerate(fewer)) \
        > info["fused_saved"]


def test_decisive_run_on_cpu_measures_every_row():
    """The whole table on CPU at a tiny size, graphed rows through the stand-in capture: every
    row measured, in the schedule's order, the memory counts consistent."""
    from fusedres.apps.bench import decisive

    rows = decisive.run(["preact_resnet20"], 2, torch.device("cpu"), amps=("fp32",),
                        image_size=8, reps=1, capture=lambda fn: fn)
    assert [(r["mode"], r["variant"]) for r in rows] == [
        (m, v) for vs in (decisive.MAIN, decisive.CHECKPOINTED) for m in ("eager", "graphed")
        for v in vs]
    assert all("median_s" in r and r["peak_bytes"] > 0 for r in rows)
    eager = {r["variant"]: r for r in rows if r["mode"] == "eager"}
    assert eager["fused"]["saved_bytes"] < eager["plain"]["saved_bytes"]
    assert eager["ckpt-mem"]["saved_bytes"] <= eager["fused"]["saved_bytes"] \
        < eager["ckpt-mem"]["plain_saved"]
    assert eager["ckpt-all"]["saved_bytes"] < eager["ckpt-mem"]["saved_bytes"]
    assert all("capture_s" in r for r in rows if r["mode"] == "graphed")


def test_decisive_run_stops_at_its_deadline_and_keeps_what_finished():
    """A stand-in clock whose deadline passes in the first group: that group keeps its minimum
    of samples, the groups after it are listed as not run."""
    from fusedres.apps.bench import decisive

    clock = [0.0]

    def now():
        clock[0] += 1.0
        return clock[0]

    # Read before the first group (1), at its start (2), after its third round (3: past the
    # deadline, so no fourth), at its end (4), before the second group (5: past it).
    rows = decisive.run(["preact_resnet20"], 2, torch.device("cpu"), amps=("fp32",),
                        image_size=8, reps=5, capture=lambda fn: fn, deadline=2.5, now=now)
    measured = [r for r in rows if "median_s" in r]
    assert [(r["mode"], r["variant"]) for r in measured] == [("eager", v)
                                                            for v in decisive.MAIN]
    assert all(r["reps"] == decisive.MIN_REPS for r in measured)
    assert len(rows) == 3 + 3 + 2 + 2 and all(r["skipped"] == "the time slot ended"
                                          for r in rows if r not in measured)


def test_report_appends_to_an_earlier_run_and_puts_the_answer_first(tmp_path):
    first = Report(str(tmp_path), "t", torch.device("cpu"), ["gpu-report", "--parts", "a"])
    first.lead("## The answer\n\n| x |")
    first.add("a", {"a": 1}, None, "## A")
    second = Report(str(tmp_path), "t", torch.device("cpu"), ["gpu-report", "--parts", "b"],
                    append=True)
    second.add("b", {"b": 2}, "b", "## B")
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["parts"]) == ["a", "b"] and len(doc["commands"]) == 2
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# t\n\n## The answer\n\n| x |\n\nCommands: ")
    assert md.index("## A") < md.index("## B")
    fresh = Report(str(tmp_path), "t", torch.device("cpu"), ["x"])
    fresh.add("c", {}, None, "## C")
    assert list(json.loads((tmp_path / "results.json").read_text())["parts"]) == ["c"]
