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
if argv[0] == "-c" and "_extension" in argv[1]:  # the prepared library's load check
    with open(state / "calls.txt", "a") as f:
        f.write("load\n")
    ok = os.environ.get("FAKE_LOAD", "ok") == "ok"
    print(json.dumps({{"loaded": ok, "error": None if ok else "undefined symbol: x",
                      "cuda": None}}))
elif argv[0] == "-c":  # the probe
    print(json.dumps({{"python": "3.12.3", "cores": 16, "torch": os.environ.get("FAKE_TORCH",
                      "2.11.0+cu130"), "cuda_runtime": "13.0",
                      "cuda_available": mode != "nogpu", "gpu": "NVIDIA H200",
                      "capability": [9, 0], "gpu_memory_bytes": 139 * 2 ** 30, "gpu_count": 1,
                      "triton": "3.6.0", "numpy": "2.4.6"}}))
elif argv[0] == "setup.py":  # the build
    with open(state / "calls.txt", "a") as f:
        f.write("build\n")
    keys = ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "FUSEDRES_BUILD_EXT", "FUSEDRES_BUILD_CUDA",
            "FUSEDRES_BUILD_TEST_EXT")
    (state / "build.json").write_text(json.dumps({{"argv": argv, **{{k: os.environ.get(k)
                                                   for k in keys}}}}))
    print("[1/2] nvcc a.cu", flush=True)
    print("[2/2] c++ -shared", flush=True)
    sys.exit(3 if mode == "buildfail" else 0)
else:  # python -m fusedres.apps.bench gpu-report --out DIR --parts A,B ...
    parts = argv[argv.index("--parts") + 1].split(",")
    with open(state / "calls.txt", "a") as f:
        f.write("report " + ",".join(parts) + "\n")
    with open(state / "reports.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")
    out = Path(argv[argv.index("--out") + 1])
    results = out / "results.json"
    earlier = "--append" in argv and results.exists()
    doc = json.loads(results.read_text()) if earlier else {{"parts": {{}}}}
    md = (out / "report.md").read_text() if earlier else "# fusedres GPU report\n"
    for part in parts:
        print(f"[{{part}}: started at 0 s]", flush=True)
        print(f"{{part}} row  plain  1.00", flush=True)
        if mode == "hang" and part == "decisive":  # after writing its first rows
            doc["parts"][part] = {{"final": False}}
            results.write_text(json.dumps(doc))
            (out / "report.md").write_text(md + "\n## decisive (partial)\n")
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            (state / "grandchild").write_text(str(child.pid))
            time.sleep(120)
        doc["parts"][part] = {{"failed": 0}}
        md += f"\n## {{part}}\n"
        (out / f"{{part}}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + part.encode())
        results.write_text(json.dumps(doc))
        (out / "report.md").write_text(md)
        print(f"[{{part}}: 0 s]", flush=True)
    (out / "results.json.tmp").write_text("{{")  # cut off mid-write
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(path of the stand-in python, its state folder); no prepared library unless a test
    makes one."""
    state = tmp_path / "state"
    state.mkdir()
    py = tmp_path / "python3"
    py.write_text(FAKE.format(python=sys.executable))
    py.chmod(0o755)
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.setattr(gc, "PREPARED", tmp_path / "no-prepared")
    return str(py), state


def _calls(state) -> list[str]:
    return (state / "calls.txt").read_text().splitlines()


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


def _check(py, out, *args):
    return gc.main(["--out", str(out), "--python", py, "--prepared", str(out.parent / "none"),
                    *args])


def test_the_plan_puts_the_decisive_table_first_and_adds_up():
    """The order of importance (issue: the decisive table, then the per-unit replay, the
    self-test, the cuda backend after its build, units, fit, compile), the decisive table
    written by 300 s and everything within 9 minutes at the default limit; every report part
    in exactly one report process, in the report's own order."""
    from fusedres.apps.bench.runner import GPU_PARTS

    names = [name for name, _ in gc.PLAN]
    assert names == ["probe", "decisive", "replay", "selftest", "build", "cuda", "units",
                     "fit", "compile", "pack"]
    ends = gc.plan_ends(gc.DEFAULT_TIME_LIMIT)
    assert ends["decisive"] <= gc.DECISIVE_BY_S <= 300
    assert ends["pack"] == gc.DEFAULT_TIME_LIMIT <= 540
    assert all(seconds > 0 for _, seconds in gc.PLAN)
    flat = [p for group in gc.REPORT_PROCESSES for p in group]
    assert flat == list(GPU_PARTS) == [n for n in names if n in GPU_PARTS]
    # Scaled to another limit, the same proportions.
    half = gc.plan_ends(gc.DEFAULT_TIME_LIMIT / 2)
    assert all(abs(half[k] - ends[k] / 2) < 1e-9 for k in ends)
    lines = gc.plan_lines(gc.DEFAULT_TIME_LIMIT)
    assert lines[1].split() == ["decisive", "265", "s,", "ends", "by", "285", "s"]


def test_builds_for_the_visible_gpu_and_packs_the_report(fake, tmp_path, capsys):
    py, state = fake
    out = tmp_path / "out"
    assert _check(py, out, "--time-limit", "60") == 0
    # The decisive table before anything else, the build between the self-test and the cuda
    # part (the parts that can use fusedres._C built for the GPU).
    assert _calls(state) == ["report decisive", "report replay,selftest", "build",
                             "report cuda,units,fit,compile"]
    build = json.loads((state / "build.json").read_text())
    assert build == {"argv": ["setup.py", "-q", "build_ext", "--inplace"],
                     "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16",
                     "FUSEDRES_BUILD_EXT": "1", "FUSEDRES_BUILD_CUDA": "1",
                     "FUSEDRES_BUILD_TEST_EXT": "0"}
    reports = [json.loads(line) for line in (state / "reports.jsonl").read_text().splitlines()]
    first = reports[0]
    assert first[:5] == ["-m", "fusedres.apps.bench", "gpu-report", "--out", str(out)]
    assert first[first.index("--device") + 1] == "cuda"
    assert "--no-progress" in first and "--quick" not in first and "--append" not in first
    assert all("--append" in r for r in reports[1:])
    # Each part's end: the plan scaled to 60 s, counted from the report's launch.
    ends = gc.plan_ends(60.0)
    slots = dict(kv.split("=") for kv in first[first.index("--slots") + 1].split(","))
    assert list(slots) == ["decisive"] and 0 < float(slots["decisive"]) <= ends["decisive"]
    last = dict(kv.split("=") for kv in reports[2][reports[2].index("--slots") + 1].split(","))
    assert list(last) == ["cuda", "units", "fit", "compile"]
    assert [float(v) for v in last.values()] == sorted(float(v) for v in last.values())
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.log", "plots.zip", "report.md", "results.json"]
    with zipfile.ZipFile(out / "plots.zip") as z:
        assert sorted(z.namelist()) == sorted(f"{p}.png" for p in gc.REPORT_PROCESSES[0]
                                              + gc.REPORT_PROCESSES[1] + gc.REPORT_PROCESSES[2])
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["parts"]) == ["decisive", "replay", "selftest", "cuda", "units", "fit",
                                  "compile"]
    facts = doc["gpu_check"]
    assert facts["steps"]["build"]["status"] == "ok"
    assert facts["steps"]["report:decisive"]["exit_status"] == 0
    assert facts["steps"]["report:decisive"]["parts_started"] == ["decisive"]
    assert facts["probe"]["gpu"] == "NVIDIA H200"
    assert facts["plan"]["decisive"] == round(ends["decisive"], 1)
    md = (out / "report.md").read_text()
    assert md.startswith("# fusedres GPU report\n\n## decisive\n")  # the answer first
    assert md.index("## decisive") < md.index("## compile") < md.index("## GPU check")
    assert "torch 2.11.0+cu130, triton 3.6.0" in md and "compute capability 9.0" in md
    log = (out / "gpu-check.log").read_text()
    assert "[1/2] nvcc a.cu" in log and "decisive row  plain  1.00" in log  # build, report
    assert "ends by" in log.splitlines()[2]  # the plan, printed first
    printed = capsys.readouterr().out
    steps = [line.split("] ", 1)[1].split()[0].rstrip(":") for line in printed.splitlines()
             if line.startswith("gpu-check [") and " ends by " not in line]
    assert steps == ["plan", "probe", "probe", "prepared", "report", "report", "report",
                     "report", "build", "build", "report", "report", "pack", "done"]
    assert "decisive row  plain  1.00" in printed  # the report's lines stream through


def test_a_slot_stops_its_report_and_the_next_phases_run(fake, tmp_path, monkeypatch):
    """A report process that overruns its slot is stopped there with its process group (its
    own child too), what it wrote is kept, and the phases after it still run in theirs."""
    py, state = fake
    monkeypatch.setenv("FAKE_MODE", "hang")
    monkeypatch.setattr(gc, "QUIET_S", 1.0)
    monkeypatch.setattr(gc, "BUILD_MIN_S", 0.5)
    out = tmp_path / "out"
    assert _check(py, out, "--time-limit", "12") == 1
    grandchild = int((state / "grandchild").read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the report's own child outlived its slot"
    assert _calls(state)[0] == "report decisive" and "build" in _calls(state)
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.log", "plots.zip", "report.md", "results.json"]  # no .tmp left
    facts = json.loads((out / "results.json").read_text())["gpu_check"]
    decisive = facts["steps"]["report:decisive"]
    assert decisive["timed_out"] and decisive["exit_status"] is None
    assert decisive["cut_off_in"] == "decisive"
    assert decisive["hard_limit_s"] <= round(gc.plan_ends(12.0)["decisive"])
    md = (out / "report.md").read_text()
    assert "stopped at the end of its slot in part `decisive`" in md
    log = (out / "gpu-check.log").read_text()
    assert "decisive row  plain  1.00" in log
    assert "report: in part decisive, nothing printed for 1 s" in log  # the heartbeat


def _prepared(tmp_path, torch="2.11.0+cu130", arch=("9.0",), sources=None):
    folder = tmp_path / "prep"
    folder.mkdir()
    (folder / "_C.fake-prepared.so").write_bytes(b"\x7fELF")
    (folder / "manifest.json").write_text(json.dumps(
        {"file": "_C.fake-prepared.so", "torch": torch, "arch_list": list(arch),
         "sources": gc.sources_digest() if sources is None else sources, "commit": "0" * 40}))
    return folder


@pytest.mark.parametrize("case", ["loads", "other-torch", "other-sources", "fails-to-load"])
def test_a_prepared_library_replaces_the_build_when_it_loads(fake, tmp_path, monkeypatch, case):
    py, state = fake
    folder = _prepared(tmp_path, torch="2.12.0" if case == "other-torch" else "2.11.0+cu130",
                       sources="stale" if case == "other-sources" else None)
    if case == "fails-to-load":
        monkeypatch.setenv("FAKE_LOAD", "fail")
    target = gc.ROOT / "fusedres" / "_C.fake-prepared.so"
    out = tmp_path / "out"
    try:
        assert gc.main(["--out", str(out), "--python", py, "--prepared", str(folder),
                        "--time-limit", "60"]) == 0
        facts = json.loads((out / "results.json").read_text())["gpu_check"]["steps"]
        if case == "loads":
            assert _calls(state) == ["load", "report decisive", "report replay,selftest",
                                     "report cuda,units,fit,compile"]  # no build
            assert facts["prepared"]["status"] == "loaded" and target.exists()
            assert facts["build"]["status"] == "not needed (the prepared library)"
            # the build's slot went to the self-test: its process runs until the build's end
            ends = gc.plan_ends(60.0)
            second = json.loads((state / "reports.jsonl").read_text().splitlines()[1])
            slots = dict(s.split("=") for s in second[second.index("--slots") + 1].split(","))
            # it was ends["selftest"] - now (now: the seconds before this process started)
            assert float(slots["selftest"]) > ends["selftest"] + 1
            assert facts["report:replay,selftest"]["hard_limit_s"] > ends["selftest"] + 1
            assert json.loads((out / "results.json").read_text())["gpu_check"]["plan"][
                "selftest"] == round(ends["build"], 1)
        else:
            assert "build" in _calls(state) and not target.exists()
            assert _calls(state)[0] == ("load" if case == "fails-to-load" else "report decisive")
            status = facts["prepared"]["status"]
            assert status == {
                "fails-to-load": "failed to load",
                "other-torch": "not used: built against torch 2.12.0, this machine has torch "
                               "2.11.0+cu130",
                "other-sources": "not used: built from other sources (commit 000000000000): "
                                 "csrc/ or setup.py changed since; make gpu-prepare again",
            }[case]
    finally:
        target.unlink(missing_ok=True)


def test_a_failed_build_is_reported_and_the_report_still_runs(fake, tmp_path, monkeypatch):
    py, state = fake
    monkeypatch.setenv("FAKE_MODE", "buildfail")
    out = tmp_path / "out"
    assert _check(py, out, "--time-limit", "60") == 1
    facts = json.loads((out / "results.json").read_text())["gpu_check"]
    assert facts["steps"]["build"]["status"] == "failed"
    assert facts["steps"]["build"]["exit_status"] == 3
    assert facts["steps"]["report:cuda,units,fit,compile"]["exit_status"] == 0
    assert "- build: failed in " in (out / "report.md").read_text()


def test_cpu_dry_run_builds_without_cuda(fake, tmp_path):
    py, state = fake
    out = tmp_path / "out"
    assert _check(py, out, "--time-limit", "60", "--device", "cpu", "--quick") == 0
    build = json.loads((state / "build.json").read_text())
    assert build["FUSEDRES_BUILD_CUDA"] == "0" and build["TORCH_CUDA_ARCH_LIST"] is None
    for line in (state / "reports.jsonl").read_text().splitlines():
        argv = json.loads(line)
        assert argv[argv.index("--device") + 1] == "cpu" and "--quick" in argv
    assert "load" not in _calls(state)  # no prepared library on CPU


def test_an_unsupported_torch_is_named(fake, tmp_path, monkeypatch):
    py, _ = fake
    monkeypatch.setenv("FAKE_TORCH", "2.10.0")
    out = tmp_path / "out"
    _check(py, out, "--time-limit", "60")
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
    (["--time-limit", "2"], "--time-limit: expected at least 5 seconds, got 2"),
    (["--time-limit", "nan"], "--time-limit: expected at least 5 seconds, got nan"),
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


def test_gpu_report_runs_its_parts_in_order_each_by_its_slot(tmp_path, monkeypatch):
    """fusedres bench gpu-report's side of the plan: the parts asked for, in the report's
    order, each with a deadline a margin before the end its slot gives (5% of what it has, at
    least 3 s); a part whose slot ended before it could start is listed as not run. Stand-in
    parts and a stand-in clock here (the whole report runs on CPU in tests/test_bench.py)."""
    import torch

    from fusedres.apps.bench import runner

    calls = []
    now = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])

    def part(name, takes):
        def run(rep, args, deadline):
            calls.append((name, None if deadline is None else round(deadline - 1000.0, 3)))
            now[0] += takes
            return 0
        return run

    monkeypatch.setattr(runner, "GPU_PARTS", {"decisive": part("decisive", 50.0),
                                              "replay": part("replay", 10.0),
                                              "selftest": part("selftest", 200.0),
                                              "fit": part("fit", 1.0)})
    args = types_args(time_limit=None, quick=True, budget=None, parts=None,
                      slots={"decisive": 100.0, "replay": 140.0, "selftest": 200.0,
                             "fit": 210.0})
    rep = runner.Report(None, "t", torch.device("cpu"), [])
    assert runner.gpu_report(rep, args, 1000.0) == 0
    # decisive: 100 s left, ends 5 s early; replay (starts at 50): 90 s left, 4.5 s early;
    # selftest at 60: 140 s, 7 s early; fit would start at 260 s, after its end (210 s).
    assert calls == [("decisive", 95.0), ("replay", 135.5), ("selftest", 193.0)]
    assert rep.doc["parts"]["fit"] == {"skipped": "its time slot ended before it could start"}
    calls.clear()
    now[0] = 1000.0
    args.parts, args.slots, args.time_limit = ["replay"], {}, None
    runner.gpu_report(rep, args, 1000.0)
    assert calls == [("replay", None)]  # no slot, no limit


def types_args(**kw):
    import types

    import torch

    return types.SimpleNamespace(device=torch.device("cpu"), out=None, progress=False,
                                 reps=None, warmup=None, **kw)


def test_the_sources_digest_changes_with_any_extension_source(tmp_path):
    """A prepared library is stale when a csrc/ source or setup.py changed: the digest sees
    a one-byte edit to each, and ignores files the build does not compile."""
    for name, text in (("csrc/a.cpp", "int a;"), ("csrc/cuda/k.cuh", "//"), ("setup.py", "#")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    base = gc.sources_digest(tmp_path)
    (tmp_path / "csrc" / "README.md").write_text("notes")
    assert gc.sources_digest(tmp_path) == base
    for name in ("csrc/a.cpp", "csrc/cuda/k.cuh", "setup.py"):
        before = (tmp_path / name).read_text()
        (tmp_path / name).write_text(before + " ")
        assert gc.sources_digest(tmp_path) != base, name
        (tmp_path / name).write_text(before)
    assert gc.sources_digest(tmp_path) == base


def test_gpu_prepare_copies_the_tracked_tree_and_drops_what_was_removed(tmp_path):
    """make gpu-prepare builds in a copy kept between runs: a source removed or renamed here
    since its last run must not stay there (setup.py globs csrc/, and a stale CPU source once
    linked every CPU kernel twice); its build outputs and the built library stay (a second run
    rebuilds only what changed). The copy's sources digest is then the tree's."""
    from tools import gpu_prepare

    src = tmp_path / "src"
    stale = [src / "csrc" / "cpu" / "removed.cpp", src / "fusedres" / "gone.py"]
    kept = [src / "build" / "temp" / "csrc" / "module.o", src / "fusedres" / "_C.abi3.so"]
    for p in stale + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    gpu_prepare.copy_tree(src)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)
    assert (src / "csrc" / "module.cpp").read_bytes() == (gc.ROOT / "csrc" / "module.cpp"
                                                          ).read_bytes()
    assert gc.sources_digest(src) == gc.sources_digest()


def test_a_dropped_phase_gives_its_slot_to_the_one_before(tmp_path):
    check = gc.Check(tmp_path / "out", 60.0)
    ends = gc.plan_ends(60.0)
    check.drop("build")
    assert check.ends["selftest"] == ends["build"] and check.ends["replay"] == ends["replay"]
    assert check.facts["plan"]["selftest"] == round(ends["build"], 1)
    with pytest.raises(ValueError, match="first phase"):
        check.drop("probe")
    check.log.close()
