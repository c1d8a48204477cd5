"""Every config of every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU
needed), fits the architecture's shared memory and spills no registers.

Run in a subprocess with TRITON_INTERPRET=0: under the interpreter ``triton.jit`` gives
interpreter objects that cannot be compiled. bfloat16 shares the float16 code path and is left to
the command line (``python -m fusedres.kernels.aot --arch 80 90`` compiles all four dtypes) to
keep this under two minutes on two cores.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from fusedres.kernels import aot  # noqa: E402


def test_every_config_compiles_for_sm80_and_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "fusedres.kernels.aot", "--arch", "80", "90",
         "--dtype", "fp16", "fp32", "fp64"],
        capture_output=True, text=True, env=env, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(" ok")]
    expected = len(aot.jobs([80, 90], ["fp16", "fp32", "fp64"]))
    assert len(rows) == expected, out
    # Every kernel and both archs appear; the tensor-core kernels use shared memory.
    for name in ("batch_stats", "bn_relu_conv2d_fwd", "dgrad_store", "dgrad_dx", "dx", "wgrad",
                 "wgrad_sums"):
        assert any(r.startswith(name + " ") for r in rows), name
    assert any("sm_80" in r for r in rows) and any("sm_90" in r for r in rows)
    assert f"{expected} compiles, 0 failed" in proc.stdout


def test_result_checks_limits():
    ok = aot.Result("k", "fp16", "cfg", 80, shared=1024, registers=128, spill_bytes=0)
    assert ok.ok
    assert not aot.Result("k", "fp16", "cfg", 80, shared=200_000, spill_bytes=0).ok  # > sm_80
    assert aot.Result("k", "fp16", "cfg", 90, shared=200_000, spill_bytes=0).ok
    assert not aot.Result("k", "fp16", "cfg", 90, shared=0, spill_bytes=8).ok
    assert not aot.Result("k", "fp16", "cfg", 90, shared=0, spill_bytes=0, error="boom").ok
    table = aot.format_table([ok])
    assert "sm_80" in table and "ok" in table
