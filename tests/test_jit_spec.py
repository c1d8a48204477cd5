"""tools/jit_spec.py: the Triton kernels' launches captured on meta tensors and specialised as
Triton's JIT specialises them (divisibility by 16, ints equal to 1 as constexprs, dtypes).

Everything runs in one subprocess with TRITON_INTERPRET=0 (under the interpreter ``triton.jit``
gives interpreter objects that cannot be specialised or compiled); no GPU. Cost: ~10 s (two
small compiles, the rest is capture on meta tensors).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_PROBE = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from tools import jit_spec
from fusedres.models.unit_shapes import ConvUnit

out = {}


class FakeDriver:
    # What JITFunction.run asks of the driver before it compiles: device, stream, target.
    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target


def jit_run_specialisation(launch):
    # JITFunction.run itself, stopped by its jit_cache_hook before compiling.
    seen = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        seen.update(signature=compile["signature"], constants=compile["constants"],
                    attrs=compile["configs"][0], num_warps=compile["num_warps"],
                    num_stages=compile["num_stages"])
        return True  # skip the compile

    driver.set_active(FakeDriver(launch.arch))
    knobs.runtime.jit_cache_hook = hook
    launch.fn.device_caches.clear()
    try:
        launch.fn.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
    finally:
        knobs.runtime.jit_cache_hook = None
        launch.fn.device_caches.clear()
    return seen


def show(launch):
    return {"kernel": launch.kernel, "grid": list(launch.grid), "config": str(launch.config),
            "divisible": list(launch.divisible),
            "constexprs": {k: repr(v) for k, v in launch.constexprs_by_name.items()},
            "signature": launch.signature}


cifar = ConvUnit("c 16>16 3x3 @32", 128, 16, 16, 32)
same = []
for arch in (80, 90):
    for backward in ("sums", "store"):
        for launch in jit_spec.unit_launches(cifar, "fp16", arch=arch, backward=backward):
            ref = jit_run_specialisation(launch)
            same.append([launch.kernel, arch, ref["signature"] == launch.signature,
                         ref["constants"] == launch.constexprs, ref["attrs"] == launch.attrs,
                         ref["num_warps"] == launch.num_warps,
                         ref["num_stages"] == launch.num_stages])
out["same_as_jit_run"] = same
out["h100"] = {b: [show(l) for l in jit_spec.unit_launches(cifar, "fp16", backward=b)]
               for b in ("sums", "store")}
out["a100"] = [show(l) for l in jit_spec.unit_launches(cifar, "fp16", arch=80, sm_count=108)]
out["odd"] = [show(l) for l in jit_spec.unit_launches(
    ConvUnit("c 24>24 3x3 @14", 128, 24, 24, 14), "fp16")]
out["nchw"] = [show(l) for l in jit_spec.unit_launches(cifar, "fp16", channels_last=False)]
# A view's pointer: base (512-aligned) + storage_offset * itemsize.
base = torch.empty(64, device="meta", dtype=torch.float16)
out["view_ptr"] = [jit_spec.DevicePointer.of(base[k:], 1 << 20).data_ptr() % 16
                   for k in (0, 3, 8)]
# fp32 with and without TF32: the ieee variant compiles, with no TF32 MMA in its PTX.
ieee = {}
for tf32 in (True, False):
    fwd = [l for l in jit_spec.unit_launches(cifar, "fp32", arch=80, tf32=tf32)
           if l.kernel == "bn_relu_conv2d_fwd"][0]
    c = jit_spec.compile_launch(fwd, use_cache=False)
    again = jit_spec.compile_launch(fwd)
    ieee[str(tf32)] = {"TF32": fwd.constexprs_by_name["TF32"], "registers": c.registers,
                       "tf32_mma": ".tf32" in c.ptx, "name": c.name, "cubin": len(c.cubin),
                       "cached": again.cached, "cached_registers": again.registers}
out["fp32"] = ieee
import contextlib, io
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    jit_spec.main(["conv:N=128,C=16,K=3,CO=16,HW=32", "--backward", "store"])
out["cli"] = buf.getvalue()
out["from_values"] = {k: repr(v) for k, v in jit_spec.unit_launches(cifar, "fp16")[1]
                      .constexprs_from_values.items()}
# The PyTorch ops the host runs between the kernels (tools.perfmodel's count), both plans.
from tools.perfmodel.launches import unit_step
out["host_ops"] = {b: [h.name for h in unit_step(cifar, "fp16", arch=90, sms=132, backward=b)[1]]
                   for b in ("sums", "store")}
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def test_specialisation_equals_triton_jit_run(probe):
    """Every launch of a training step, both backward plans, sm_80 and sm_90: signature,
    constexprs, attrs, warps and stages equal what JITFunction.run computes for the same
    arguments (run with a stand-in driver, stopped before compiling)."""
    rows = probe["same_as_jit_run"]
    assert len(rows) == 2 * (5 + 6)  # sm_80 and sm_90, the sums and store plans
    for row in rows:
        assert all(row[2:]), row


def test_launch_order_and_grids_of_a_known_shape(probe):
    """x (128, 16, 32, 32) fp16 channels_last, 3x3 16 -> 16, H100 (132 SMs). By the host rules:
    batch_stats (C <= 32, channels_last: 256 x 16 tiles): 512 tiles, split min(4 * 132,
    512 / 2, 128) = 128; forward and data gradient (16 channels: 256 x 16 tiles, no padding
    column; the forward's K = C) 131072 / 256 programs; the weight gradient in the
    taps form (unit stride, no bias, <= 16 channels: 16 x 16 tiles of 4 taps, so 3 tap groups
    for the 9 taps; K-steps of 64 input pixels, 2048): split the least modeled time of
    pick_split, wgrad_sums up to 2 * cdiv(132, 3) = 88: 44 (132 programs of 47 K-steps), wgrad
    42 (126 of 49); the dx pass 64 x 32 tiles."""
    sums = [(r["kernel"], r["grid"], r["config"]) for r in probe["h100"]["sums"]]
    # batch_stats in its PREPARE mode: the last of a channel block's programs merges the
    # splits' statistics with the running statistics' update, invstd and the fused affine
    # (the BatchNorm's whole preparation, no host op; the forward and backward read its
    # affine). Then the small kernels of kernels/reductions.py: the weight-gradient partials
    # reduced (the 16 * 16 * 9 weight gradient, 16 splits a step over 1024 / 16 = 64 columns:
    # 36 programs, the 16 channels' sums in 1). Five launches; the store plan's six reduce the
    # weight gradient's split and the data gradient's sums in one launch.
    assert sums == [
        ("batch_stats", [1, 128, 1], "M=256 C=16 w=4 s=1"),
        ("bn_relu_conv2d_fwd", [512, 1, 1], "M=256 N=16 K=16 w=4 s=2"),
        ("wgrad_sums", [1, 3, 44], "M=16 N=16 K=64 T=4 w=4 s=2"),
        ("partials_reduce", [37, 1, 1], "K=1024 R=16 C=64 w=4 s=1"),
        ("dgrad_dx", [512, 1, 1], "M=256 N=16 K=16 w=4 s=2"),
    ]
    store = [(r["kernel"], r["grid"], r["config"]) for r in probe["h100"]["store"]]
    assert store == [
        ("batch_stats", [1, 128, 1], "M=256 C=16 w=4 s=1"),
        ("bn_relu_conv2d_fwd", [512, 1, 1], "M=256 N=16 K=16 w=4 s=2"),
        ("wgrad", [1, 3, 42], "M=16 N=16 K=64 T=4 w=4 s=2"),
        ("dgrad_store", [512, 1, 1], "M=256 N=16 K=16 w=4 s=2"),
        ("partials_reduce", [37, 1, 1], "K=1024 R=16 C=64 w=4 s=1"),
        ("dx", [2048, 1, 1], "M=64 C=32 w=4 s=1"),
    ]
    # A100's 108 SMs: 36 ways fill them in one wave (3 x 36 = 108 programs).
    assert [r["grid"] for r in probe["a100"] if r["kernel"] == "wgrad_sums"] == [[1, 3, 36]]


def test_no_host_op_between_the_kernels(probe):
    """A training step runs no PyTorch op between the backend's kernels: the partials' merges
    and reductions, the BatchNorm affine and the BatchNorm's preparation (running-statistics
    update, invstd = rsqrt(var + eps): batch_stats' PREPARE mode, bn_prepare for given
    statistics) are the backend's launches."""
    assert probe["host_ops"] == {"sums": [], "store": []}


def test_divisibility_and_unit_strides(probe):
    """channels_last: the channel stride 1 is a constexpr, C = 16 and every pointer are
    divisible by 16; a unit with C = 24 and 14 x 14 pixels drops the attribute from C and the
    strides that are multiples of C only; NCHW makes the pixel stride the constexpr instead."""
    fwd = probe["h100"]["sums"][1]
    assert fwd["kernel"] == "bn_relu_conv2d_fwd"
    assert fwd["constexprs"]["sxc"] == "1" and fwd["signature"]["sxc"] == "constexpr"
    assert fwd["constexprs"]["SH"] == "1" and fwd["constexprs"]["TF32"] == "False"
    for name in ("x_ptr", "w_ptr", "y_ptr", "C", "Co", "M", "sxw", "sxh", "sxn"):
        assert name in fwd["divisible"], name
    assert "PH" not in fwd["divisible"] and fwd["constexprs"]["PH"] == "1"
    assert fwd["signature"]["x_ptr"] == "*fp16" and fwd["signature"]["scale_ptr"] == "*fp32"
    odd = probe["odd"][1]
    assert odd["kernel"] == "bn_relu_conv2d_fwd"
    for name in ("C", "Co", "sxw", "H", "W"):
        assert name not in odd["divisible"], name
    assert "x_ptr" in odd["divisible"] and "sxn" in odd["divisible"]  # 24 * 14 * 14 = 16 * 294
    nchw = probe["nchw"][1]
    assert nchw["constexprs"]["sxw"] == "1" and "sxc" in nchw["divisible"]
    assert "sxc" not in nchw["constexprs"]
    assert probe["view_ptr"] == [0, 6, 0]  # fp16 views at offsets 0, 3, 8 elements


def test_fp32_ieee_variant_compiles(probe):
    """fp32 without TF32 compiles its own kernel (TF32=False: no TF32 MMA in the PTX); with
    TF32 the products are TF32 MMAs. The second compile comes from the disk cache."""
    tf32, ieee = probe["fp32"]["True"], probe["fp32"]["False"]
    assert tf32["TF32"] is True and ieee["TF32"] is False
    assert tf32["tf32_mma"] and not ieee["tf32_mma"]
    for c in (tf32, ieee):
        assert c["name"] == "bn_relu_conv2d_fwd_kernel" and c["cubin"] > 0
        assert 0 < c["registers"] <= 255
        assert c["cached"] and c["cached_registers"] == c["registers"]


def test_command_lists_the_launches(probe):
    """``python -m tools.jit_spec SHAPE``: one block per launch, with the constexprs
    the JIT made of runtime values (here the unit strides and the 3x3's stride, padding and
    dilation of 1) and the divisible arguments."""
    heads = [line for line in probe["cli"].splitlines() if not line.startswith(" ")]
    assert [h.split()[0] for h in heads] == [
        "batch_stats", "bn_relu_conv2d_fwd", "wgrad", "dgrad_store", "partials_reduce", "dx"]
    assert heads[1].startswith("bn_relu_conv2d_fwd  grid=(512, 1, 1)  M=256 N=16 K=16")
    assert probe["from_values"] == {name: "1" for name in (
        "SH", "SW", "PH", "PW", "DH", "DW", "sxc", "swc", "syc")}
