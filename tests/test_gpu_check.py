"""The GPU check's logic (benchmarks/gpu_check.py, ``make gpu-check``) without a GPU: a stand-in
Python plays the device machine's (its probe answers as an H100 with torch 2.11 would, its build
records the environment it was given, its report writes a partial report and then hangs or
ends), so the build switches, the time limit, the cut-off, the packing into the files the device
returns and the errors are checked in seconds. CI also dry-runs the real thing on CPU (.ci/run:
``make gpu-check ... --device cpu --quick``)."""

import importlib.util
import json
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)

FAKE = r'''#!{python}
"""A stand-in for the device machine's python3 (tests/test_gpu_check.py)."""
import json, os, subprocess, sys, time
from pathlib import Path

state = Path(os.environ["FAKE_STATE"])
mode = os.environ.get("FAKE_MODE", "ok")
argv = sys.argv[1:]
if argv[0] == "-c":  # the probe
    print(json.dumps({{"python": "3.12.3", "cores": 16, "torch": os.environ.get("FAKE_TORCH",
                      "2.11.0+cu130"), "cuda_runtime": "13.0",
                      "cuda_available": mode != "nogpu", "gpu": "NVIDIA H100 80GB HBM3",
                      "capability": [9, 0], "gpu_memory_bytes": 80 * 2 ** 30, "gpu_count": 1,
                      "triton": "3.6.0", "numpy": "2.4.6"}}))
elif argv[0] == "setup.py":  # the build
    keys = ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "FUSEDRES_BUILD_EXT", "FUSEDRES_BUILD_CUDA",
            "FUSEDRES_BUILD_TEST_EXT")
    (state / "build.json").write_text(json.dumps({{"argv": argv, **{{k: os.environ.get(k)
                                                   for k in keys}}}}))
    print("[1/2] nvcc a.cu", flush=True)
    print("[2/2] c++ -shared", flush=True)
    sys.exit(3 if mode == "buildfail" else 0)
else:  # python -m fusedres.apps.bench gpu-report --out DIR ...
    (state / "report.json").write_text(json.dumps(argv))
    out = Path(argv[argv.index("--out") + 1])
    (out / "report.md").write_text("# fusedres GPU report\n\nCommand: `x`\n\n## Self-test\n")
    (out / "results.json").write_text(json.dumps({{"parts": {{"selftest": {{"failed": 0}}}}}}))
    for name in ("units-ratio.png", "step.png"):
        (out / name).write_bytes(b"\x89PNG\r\n\x1a\n" + name.encode())
    (out / "results.json.tmp").write_text("{{")  # cut off mid-write
    print("[self-test: started at 0 s]", flush=True)
    print("[self-test: 0 s]", flush=True)
    print("[units: started at 0 s]", flush=True)
    print("quick 16ch  plain  1.00", flush=True)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        (state / "grandchild").write_text(str(child.pid))
        time.sleep(120)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(path of the stand-in python, its state folder); the check's margins shrunk so that a
    time limit of seconds works."""
    state = tmp_path / "state"
    state.mkdir()
    py = tmp_path / "python3"
    py.write_text(FAKE.format(python=sys.executable))
    py.chmod(0o755)
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.setattr(gc, "REPORT_MIN_S", 2.0)
    monkeypatch.setattr(gc, "REPORT_MARGIN_S", 1.0)
    monkeypatch.setattr(gc, "FINISH_S", 1.0)
    return str(py), state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_builds_for_the_visible_gpu_and_packs_the_report(fake, tmp_path, capsys):
    py, state = fake
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--python", py, "--time-limit", "60"]) == 0
    build = json.loads((state / "build.json").read_text())
    assert build == {"argv": ["setup.py", "-q", "build_ext", "--inplace"],
                     "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16",
                     "FUSEDRES_BUILD_EXT": "1", "FUSEDRES_BUILD_CUDA": "1",
                     "FUSEDRES_BUILD_TEST_EXT": "0"}
    report_argv = json.loads((state / "report.json").read_text())
    assert report_argv[:5] == ["-m", "fusedres.apps.bench", "gpu-report", "--out", str(out)]
    assert report_argv[report_argv.index("--device") + 1] == "cuda"
    assert "--no-progress" in report_argv and "--quick" not in report_argv
    # The report's own limit: what was left, less the margin.
    assert 50 <= float(report_argv[report_argv.index("--time-limit") + 1]) <= 60
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.log", "plots.zip", "report.md", "results.json"]
    with zipfile.ZipFile(out / "plots.zip") as z:
        assert sorted(z.namelist()) == ["step.png", "units-ratio.png"]
        assert z.read("step.png").endswith(b"step.png")
    doc = json.loads((out / "results.json").read_text())
    assert doc["parts"] == {"selftest": {"failed": 0}}
    facts = doc["gpu_check"]
    assert facts["steps"]["build"]["status"] == "ok"
    assert facts["steps"]["report"]["exit_status"] == 0
    assert facts["steps"]["report"]["parts_started"] == ["self-test", "units"]
    assert facts["probe"]["gpu"] == "NVIDIA H100 80GB HBM3"
    md = (out / "report.md").read_text()
    assert md.startswith("# fusedres GPU report\n\n## GPU check\n")
    assert "torch 2.11.0+cu130, triton 3.6.0" in md and "compute capability 9.0" in md
    assert md.index("## GPU check") < md.index("Command:") < md.index("## Self-test")
    log = (out / "gpu-check.log").read_text()
    assert "[1/2] nvcc a.cu" in log and "quick 16ch  plain  1.00" in log  # build, report
    printed = capsys.readouterr().out
    steps = [line.split("] ", 1)[1].split()[0].rstrip(":") for line in printed.splitlines()
             if line.startswith("gpu-check [")]
    assert steps == ["probe", "probe", "build", "build", "report", "report", "pack", "done"]
    assert "quick 16ch  plain  1.00" in printed  # the report's lines stream through


def test_time_limit_stops_the_report_and_keeps_what_it_wrote(fake, tmp_path, monkeypatch):
    py, state = fake
    monkeypatch.setenv("FAKE_MODE", "hang")
    monkeypatch.setattr(gc, "QUIET_S", 1.5)
    out = tmp_path / "out"
    t0 = time.monotonic()
    assert gc.main(["--out", str(out), "--python", py, "--time-limit", "6"]) == 1
    took = time.monotonic() - t0
    assert took < 6 + 1, took  # ended by the limit, with its 1 s of finishing left
    grandchild = int((state / "grandchild").read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the report's own child outlived the limit"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.log", "plots.zip", "report.md", "results.json"]  # no .tmp left
    facts = json.loads((out / "results.json").read_text())["gpu_check"]
    report = facts["steps"]["report"]
    assert report["timed_out"] and report["exit_status"] is None
    assert report["cut_off_in"] == "units"
    md = (out / "report.md").read_text()
    assert "cut off at the time limit in part `units`" in md
    log = (out / "gpu-check.log").read_text()
    assert "quick 16ch  plain  1.00" in log
    assert "report: in part units, nothing printed for 2 s" in log  # the heartbeat


def test_a_failed_build_is_reported_and_the_report_still_runs(fake, tmp_path, monkeypatch):
    py, state = fake
    monkeypatch.setenv("FAKE_MODE", "buildfail")
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--python", py, "--time-limit", "60"]) == 1
    facts = json.loads((out / "results.json").read_text())["gpu_check"]
    assert facts["steps"]["build"]["status"] == "failed"
    assert facts["steps"]["build"]["exit_status"] == 3
    assert facts["steps"]["report"]["exit_status"] == 0
    assert "- build of fusedres._C: failed" in (out / "report.md").read_text()


def test_cpu_dry_run_builds_without_cuda(fake, tmp_path):
    py, state = fake
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--python", py, "--time-limit", "60", "--device", "cpu",
                    "--quick"]) == 0
    build = json.loads((state / "build.json").read_text())
    assert build["FUSEDRES_BUILD_CUDA"] == "0" and build["TORCH_CUDA_ARCH_LIST"] is None
    argv = json.loads((state / "report.json").read_text())
    assert argv[argv.index("--device") + 1] == "cpu" and "--quick" in argv


def test_an_unsupported_torch_is_named(fake, tmp_path, monkeypatch):
    py, _ = fake
    monkeypatch.setenv("FAKE_TORCH", "2.10.0")
    out = tmp_path / "out"
    gc.main(["--out", str(out), "--python", py, "--time-limit", "60"])
    md = (out / "report.md").read_text()
    assert "- unsupported: fusedres supports torch >= 2.11" in md
    assert "this is torch 2.10.0." in (out / "gpu-check.log").read_text()


def test_cuda_asked_for_without_a_gpu_exits_2(fake, tmp_path, monkeypatch):
    py, state = fake
    monkeypatch.setenv("FAKE_MODE", "nogpu")
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--python", py, "--device", "cuda"]) == 2
    assert "--device cuda, but torch sees no CUDA device" in (out / "gpu-check.log").read_text()
    assert not (state / "build.json").exists()  # nothing built


@pytest.mark.parametrize("argv, message", [
    (["--time-limit", "50"], "--time-limit: expected at least 120 seconds, got 50"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, capsys, argv, message):
    assert gc.main(["--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: error: ") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_out_must_be_a_new_or_earlier_checks_folder(tmp_path, capsys, fake):
    py, _ = fake
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert gc.main(["--out", str(afile)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert gc.main(["--out", str(other)]) == 2
    assert "holds 'notes.txt', which no GPU check wrote" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"
    again = tmp_path / "again"  # an earlier check's folder: its files are replaced
    again.mkdir()
    (again / "report.md").write_text("old")
    (again / "old-plot.png").write_bytes(b"old")
    assert gc.main(["--out", str(again), "--python", py, "--time-limit", "60"]) == 0
    with zipfile.ZipFile(again / "plots.zip") as z:
        assert "old-plot.png" not in z.namelist()
    assert (again / "report.md").read_text() != "old"


def test_budget_and_log_cap(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    for i in range(gc.MAX_FILES):
        (out / f"f{i}.txt").write_text("x")
    assert gc.budget_problems(out) == []
    (out / "one-more.txt").write_text("x")
    assert gc.budget_problems(out) == [f"9 entries in {out}, the device returns 8"]
    (out / "one-more.txt").unlink()
    (out / "sub").mkdir()
    assert gc.budget_problems(out) == [f"9 entries in {out}, the device returns 8",
                                       "sub: not a plain file"]
    log = tmp_path / "big.log"
    log.write_bytes(b"a" * 1000 + b"b" * 1000)
    gc.cap_log(log, keep=400)
    data = log.read_bytes()
    assert data.startswith(b"a" * 100) and data.endswith(b"b" * 300)
    assert b"[... 1600 bytes cut ...]" in data and len(data) < 450


def test_arch_list_and_build_env():
    assert gc.arch_list((9, 0)) == "9.0" and gc.arch_list([8, 6]) == "8.6"
    env = gc.build_env({"PATH": "/bin", "FUSEDRES_BUILD_CUDA": "auto"}, "cuda", (9, 0), 16)
    assert env == {"PATH": "/bin", "FUSEDRES_BUILD_EXT": "1", "FUSEDRES_BUILD_TEST_EXT": "0",
                   "MAX_JOBS": "16", "FUSEDRES_BUILD_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0"}
    env = gc.build_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}, "cpu", None, 2)
    assert env["FUSEDRES_BUILD_CUDA"] == "0" and env["MAX_JOBS"] == "2"


def test_make_target_runs_the_script_with_python3_and_no_venv():
    """`make gpu-check` depends on nothing (no venv, no install: the device has no registry)
    and runs the script with the machine's python3; OUT may come from the environment."""
    text = (ROOT / "Makefile").read_text()
    rule = text[text.index("\ngpu-check:") + 1:].split("\n\n")[0]
    assert rule.splitlines()[1:] == [
        "\t$(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)"]
    assert rule.splitlines()[0] == "gpu-check:"
    assert "GPU_PYTHON     ?= python3" in text and "OUT            ?= gpu-check" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make gpu-check" in ci and "--device cpu --quick" in ci


def test_gpu_report_runs_every_step_kind_in_its_slice(tmp_path, monkeypatch):
    """The hook for more kinds of training step (fusedres.apps.bench.runner.STEP_KINDS): each
    registered kind runs after the eager one, in an equal slice of the step share of the time
    limit, and ``--step-kinds`` selects among them. The parts are stand-ins here (the whole
    report runs on CPU in tests/test_bench.py)."""
    import torch

    from fusedres.apps.bench import runner

    calls = []

    def part(name):
        def run(rep, args, *a, deadline=None, **kw):
            calls.append((name, None if deadline is None else round(deadline - 1000.0, 3)))
            return 0 if name == "self-test" else []
        return run

    monkeypatch.setattr(runner, "part_selftest", part("self-test"))
    monkeypatch.setattr(runner, "part_units", lambda rep, args, units, name="units", **kw:
                        part(name)(rep, args, deadline=kw["deadline"]))
    monkeypatch.setattr(runner, "part_fit", part("fit"))
    monkeypatch.setattr(runner, "STEP_KINDS", [("eager", part("step")),
                                               ("graphed", part("step-graphed"))])
    args = types_args(time_limit=100.0, quick=True, step_kinds=None, budget=None)
    rep = runner.Report(None, "t", torch.device("cpu"), [])
    assert runner.gpu_report(rep, args, 1000.0) == 0
    assert calls == [("self-test", None), ("units", 35.0), ("convs", 45.0), ("compile", 58.0),
                     ("step", 64.0), ("step-graphed", 70.0), ("fit", 97.0)]
    calls.clear()
    args.step_kinds = ["graphed"]
    runner.gpu_report(rep, args, 1000.0)
    assert [c for c in calls if c[0].startswith("step")] == [("step-graphed", 70.0)]


def types_args(**kw):
    import types

    import torch

    return types.SimpleNamespace(device=torch.device("cpu"), out=None, progress=False,
                                 reps=None, warmup=None, **kw)
