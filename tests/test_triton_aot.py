"""Every config of every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU
needed) as the JIT specialises it (tools/jit_spec.py), fits the architecture's shared memory
and spills no registers.

Run in a subprocess with TRITON_INTERPRET=0: under the interpreter ``triton.jit`` gives
interpreter objects that cannot be compiled. CI compiles the ``ci`` shape set (a CIFAR 3x3 unit
and an ImageNet 1x1 unit with a residual, both backward plans; every config that their
launches do not pick swapped into one of them) for fp16, fp32 with and without TF32, and fp64,
then the witness shapes of tools/triton_aot.py's KNOWN_SPILLS (the spills allowed, with why): a
spill beyond them fails.
bfloat16 shares the float16 code path; it and the full benchmark shape set are left to
the command line (``python -m tools.triton_aot``, ~1260 compiles).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tools import triton_aot as aot  # noqa: E402

DTYPES = ["fp16", "fp32", "fp32-ieee", "fp64"]


@pytest.fixture(scope="module")
def table():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.triton_aot", "--arch", "80", "90", "--set", "ci",
         "--dtype", *DTYPES],
        capture_output=True, text=True, env=env, timeout=900)
    return proc, proc.stdout + proc.stderr, aot.parse_table(proc.stdout)


def test_table_covers_every_config_dtype_and_arch(table):
    proc, out, rows = table
    summary = [line for line in proc.stdout.splitlines() if " compiles, " in line]
    assert summary, out
    total, failed = int(summary[0].split()[0]), int(summary[0].split()[2])
    assert len(rows) == total, out
    bad = [r for r in rows if r["status"] not in ("ok", "allowed")]
    assert len(bad) == failed
    assert proc.returncode == (1 if failed else 0), out
    seen = {(r["kernel"], r["dtype"], r["config"], r["arch"]) for r in rows}
    from fusedres.kernels import _common

    for kernel, configs_for in aot.role_configs().items():
        for dtype in DTYPES:
            for cfg in configs_for(dtype):
                assert isinstance(cfg, _common.KernelConfig)
                for arch in ("sm_80", "sm_90"):
                    assert (kernel, dtype, str(cfg), arch) in seen, (kernel, dtype, cfg, arch)
    # Launched by the shapes themselves, not only swapped in: the JIT's specialisations.
    assert sum("swapped" not in r["launched by"] for r in rows) > len(rows) // 2
    # With TF32 off the host rules launch float32's ieee configs (captured, not swapped in).
    from fusedres.kernels import bn_relu_conv2d_wgrad as wg

    launched = {r["config"] for r in rows if r["kernel"] == "wgrad"
                and r["dtype"] == "fp32-ieee" and "swapped" not in r["launched by"]}
    ieee = wg.CONFIGS["fp32-ieee", "plain"]
    assert launched and launched <= {str(c) for c in ieee.values()}, launched


def test_every_config_compiles_spill_free_within_shared_memory(table):
    """Every row ok (compiled, no spills, shared memory in the limit): fp16, fp32 with TF32,
    fp32 without (``ieee`` products, what runs whenever TF32 is off: its own wgrad configs),
    fp64; every kernel on both archs."""
    _, out, rows = table
    configs = aot.role_configs()
    assert {(r["dtype"], r["kernel"], r["arch"]) for r in rows} == {
        (d, k, a) for d in DTYPES for k in aot.KERNELS for a in ("sm_80", "sm_90")
        if configs[k](d)}, out  # bn_prepare: no float64 variant
    assert not configs["bn_prepare"]("fp64") and configs["bn_prepare"]("fp32")
    assert all(r["status"] in ("ok", "allowed") for r in rows), out
    # Spills only where tools/triton_aot.py's KNOWN_SPILLS allows them, and each sm_80 entry's
    # witness shape (the ci set) compiles it: a spill that grows fails.
    allowed = {(r["kernel"], r["config"], int(r["arch"][3:])) for r in rows
               if r["status"] == "allowed"}
    assert allowed <= set(aot.KNOWN_SPILLS)
    for r in rows:
        assert (r["status"] == "allowed") == (int(r["spill"]) > 0), r
    witnessed = {k for k, a in aot.KNOWN_SPILLS.items() if a.witness and a.tritons is None
                 and any(d in DTYPES for d in a.dtypes)}
    assert witnessed and allowed >= witnessed, witnessed - allowed
    for r in rows:  # each allowed spill on a witness's own launch
        if r["status"] == "allowed" and (r["kernel"], r["config"], 80) in witnessed:
            assert r["launched by"].startswith(
                aot.KNOWN_SPILLS[r["kernel"], r["config"], 80].witness), r


def test_result_checks_limits():
    ok = aot.Result("dx", "fp16", "cfg", 80, shared=1024, registers=128, spill_bytes=0)
    assert ok.ok
    assert not aot.Result("k", "fp16", "cfg", 80, shared=200_000, spill_bytes=0).ok  # > sm_80
    assert aot.Result("k", "fp16", "cfg", 90, shared=200_000, spill_bytes=0).ok
    assert not aot.Result("k", "fp16", "cfg", 90, shared=0, spill_bytes=8).ok
    assert not aot.Result("k", "fp16", "cfg", 90, shared=0, spill_bytes=0, error="boom").ok
    # A spill within KNOWN_SPILLS passes ("allowed"); one byte more, or another dtype, fails.
    (kernel, config, arch), (dtypes, limit, why, _, _) = next(iter(aot.KNOWN_SPILLS.items()))
    assert why and limit > 0
    within = aot.Result(kernel, dtypes[0], config, arch, shared=0, spill_bytes=limit)
    assert within.ok and within.status == "allowed"
    assert aot.Result(kernel, dtypes[0], config, arch, shared=0, spill_bytes=limit + 1).status \
        == "spills"
    assert aot.Result(kernel, "fp64", config, arch, shared=0, spill_bytes=4).status == "spills"
    # An entry seen with triton 3.6 only is allowed with that release only.
    (kernel, config, arch), (dtypes, limit, _, tritons, _) = next(
        (k, v) for k, v in aot.KNOWN_SPILLS.items() if v.tritons == ("3.6",))
    one = aot.Result(kernel, dtypes[0], config, arch, shared=0, spill_bytes=limit)
    assert one.ok == (aot._triton_release() == "3.6")
    bad = aot.Result("wgrad", "fp16", "cfg", 90, error="CompilationError: x", where="unit a")
    table = aot.format_table([ok, bad])
    assert [(r["arch"], r["status"], r["regs"]) for r in aot.parse_table(table)] == [
        ("sm_80", "ok", "128"), ("sm_90", "error", "-1")]
    assert table.splitlines()[-1].endswith("unit a  (CompilationError: x)")


def test_shape_sets():
    """The ci set is a CIFAR 3x3 unit (batch 128) and an ImageNet 1x1 unit with a residual
    (batch 256), then the witnesses of KNOWN_SPILLS (ResNet-164 units); the benchmark set
    every distinct unit of the ResNet-164 and ResNet-50 bottlenecks."""
    ci = aot.shape_set("ci")
    assert [(u.n, u.k, u.residual) for u in ci[:2]] == [(128, 3, False), (256, 1, True)]
    assert [u.name for u in ci[2:]] == ["c164 256>64 1x1 @8", "c164 64>256 1x1 @8 +res"]
    bench = aot.shape_set("benchmark")
    assert len(bench) == len(set(bench)) == 13 + 23
    assert {u.n for u in bench} == {128, 256}
    with pytest.raises(ValueError, match="--set"):
        aot.shape_set("nope")
