"""fusedres.memory.keep_freed_memory: glibc keeps freed blocks (no page faults from one step to
the next); release_freed_memory afterwards wins, keep after release is refused; the user's
MALLOC_* settings kept. Each case
runs in a fresh process: mallopt's settings are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fusedres.memory.allocator import _glibc_version

GLIBC = (_glibc_version() or "").startswith("glibc")


def _run(code: str, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt's settings are glibc's")
def test_keep_stops_faults_and_a_later_release_wins():
    r = _run("""
import json, resource, torch
import fusedres.memory as M
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def faults_of_ten_blocks(numel):
    for _ in range(3):
        torch.ones(numel).sum()  # allocated and freed
    f0 = faults()
    for _ in range(10):
        torch.ones(numel).sum()
    return faults() - f0
ok, why = M.keep_freed_memory()
again = M.keep_freed_memory()
kept = faults_of_ten_blocks(8 << 20)  # 32 MiB
rel = M.release_freed_memory()
# 64 MiB: larger than any block the kept heap holds, which glibc would reuse without a fault.
released = faults_of_ten_blocks(16 << 20)
print(json.dumps({"ok": ok, "why": why, "again": again, "rel": rel, "faults": kept,
                  "faults_released": released}))
""")
    assert r["ok"] and "M_MMAP_MAX 0" in r["why"]
    assert r["again"] == [True, "already set"]
    # A budget later in the process (release_freed_memory) turns keeping off.
    assert r["rel"][0] is True and "M_MMAP_THRESHOLD" in r["rel"][1], r["rel"]
    # 10 blocks of 32 MiB, each 8192 pages if faulted in again: the heap serves them resident.
    assert r["faults"] < 200, r
    assert r["faults_released"] > 10 * 16000, r  # each block mapped and faulted in again


@pytest.mark.skipif(not GLIBC, reason="mallopt's settings are glibc's")
def test_release_then_keep_is_refused_and_the_environment_wins():
    r = _run("""
import json
import fusedres.memory as M
print(json.dumps({"rel": M.release_freed_memory(), "keep": M.keep_freed_memory()}))
""")
    assert r["rel"][0] is True
    assert r["keep"][0] is False and "release_freed_memory" in r["keep"][1]
    r = _run("""
import json
import fusedres.memory as M
print(json.dumps({"keep": M.keep_freed_memory()}))
""", MALLOC_MMAP_MAX_="65536")
    assert r["keep"][0] is False and "MALLOC_MMAP_MAX_" in r["keep"][1]


@pytest.mark.skipif(not GLIBC, reason="mallopt's settings are glibc's")
def test_bench_records_the_allocator(tmp_path):
    """`fusedres bench units` keeps freed memory on CPU by default and says so; --malloc
    default leaves glibc's thresholds."""
    for flag, want in (([], "M_MMAP_MAX 0"), (["--malloc", "default"], None)):
        out = tmp_path / (flag[-1] if flag else "keep")
        subprocess.run([sys.executable, "-m", "fusedres.apps.bench", "units", "--quick",
                        "--device", "cpu", "--backends", "cpu", "--baselines", "plain",
                        "--no-progress", "--out", str(out), *flag],
                       check=True, capture_output=True, timeout=600)
        doc = json.loads((out / "results.json").read_text())
        got = doc["machine"]["allocator"]
        assert (want in got) if want else got is None, got
        report = (out / "report.md").read_text()
        assert "C allocator: " + ("glibc" if want else "glibc defaults") in report
