"""The traffic model of kernels/traffic.py: its goal, asserted, and its bookkeeping.

Goal: one fused unit's training step (statistics, forward, weight and data gradients) moves at
most half the DRAM bytes of the unfused sequence (BatchNorm, ReLU, cuDNN-style conv, add and
their backward passes) at CIFAR and ImageNet shapes.
"""

import pytest

pytest.importorskip("triton")

from fusedres.kernels import traffic as T  # noqa: E402
from tools.perfmodel import traffic as traffic_report  # noqa: E402


@pytest.mark.parametrize("unit", T.CIFAR_UNITS + T.IMAGENET_UNITS, ids=lambda u: u.name)
@pytest.mark.parametrize("genstats", [False, True], ids=["stats-pass", "genstats"])
def test_fused_step_moves_at_most_half_the_bytes(unit, genstats):
    fused, unfused = T.fused_step(unit, genstats), T.unfused_step(unit)
    assert fused.bytes <= 0.5 * unfused.bytes, (unit.name, fused.bytes / unfused.bytes)


@pytest.mark.parametrize("name,block", T.bottleneck_blocks(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_whole_bottleneck_block_at_most_half(name, block):
    """The expanding 1x1 unit alone is above half (its larger output side is untouched by the
    fusion), but each whole bottleneck block is well under."""
    fused = sum(T.fused_step(u).bytes for u in block)
    unfused = sum(T.unfused_step(u).bytes for u in block)
    assert fused <= 0.5 * unfused, (name, fused / unfused)


@pytest.mark.parametrize("unit", T.EXPANDING_UNITS, ids=lambda u: u.name)
def test_expanding_unit_still_saves(unit):
    ratio = T.fused_step(unit).bytes / T.unfused_step(unit).bytes
    assert 0.5 < ratio < 0.6  # reported as is in the benchmark table


def test_compulsory_traffic_accounting():
    """Equal in/out sizes, 3x3, residual: the unfused step is 22 activation passes (10 forward,
    12 backward); the fused one 9 (stats 1, forward 3, weight-gradient pass 2, data gradient 3),
    plus per-channel vectors, weights and the weight gradient's split-K partials (written, then
    read by the reduce), which the split rule keeps within half that pass's dy and x bytes."""
    u = T.Unit("t", 64, 64, 32, 64, residual=True)
    s = u.act_in()
    unfused, fused = T.unfused_step(u), T.fused_step(u)
    partials = next(k.read for k in fused.kernels if k.name == "wgrad reduce")
    assert unfused.bytes == pytest.approx(22 * s, rel=0.02)
    assert fused.bytes - 2 * partials == pytest.approx(9 * s, rel=0.05)
    assert fused.bytes - 2 * partials >= 9 * s
    assert 0 < 2 * partials <= 1.05 * s  # 64 channels, 9 tiles: split to fill the SMs
    assert T.fused_step(u, genstats=True).bytes < fused.bytes - 0.9 * s


def test_store_strategy_accounting():
    """The "store" backward: 12 activation passes (stats 1, forward 3, wgrad 2, dgrad with dz 3,
    dx 3) and one GEMM fewer than "sums"."""
    u = T.Unit("t", 64, 64, 32, 64, residual=True)
    store, sums = T.fused_step(u, strategy="store"), T.fused_step(u)
    partials = next(k.read for k in store.kernels if k.name == "wgrad reduce")
    assert store.bytes - 2 * partials == pytest.approx(12 * u.act_in(), rel=0.05)
    assert store.flops < sums.flops
    assert "backward strategy store" in traffic_report.full_report()


def test_flops_count_padded_tiles():
    """24 output channels on a 32-wide N tile: the fused GEMMs pay for their padding (16 on
    the 16-wide tile pay none)."""
    u = T.Unit("t", 8, 16, 8, 24)
    fwd = next(k for k in T.fused_step(u).kernels if k.name == "fwd")
    assert 24 * fwd.flops == 32 * u.gemm_flops()
    u = T.Unit("t", 8, 16, 8, 16)
    fwd = next(k for k in T.fused_step(u).kernels if k.name == "fwd")
    assert fwd.flops == u.gemm_flops()


def test_strided_dgrad_runs_only_the_feeding_taps():
    """Stride 2, 3x3: the four stride phases run 4, 2, 2 and 1 of the 9 taps."""
    a, b = T.Unit("s1", 8, 64, 16, 64), T.Unit("s2", 8, 64, 16, 64, stride=2)
    flops = {u.name: next(k.flops for k in T.fused_step(u).kernels if k.name == "dgrad+dx")
             for u in (a, b)}
    assert flops["s2"] == pytest.approx(flops["s1"] * 9 / 36, rel=0.1)


def test_modeled_time_is_roofline():
    k = T.Kernel("k", read=3_350_000_000_000, write=0, flops=10)
    assert k.seconds(2) == pytest.approx(1.0)
    k = T.Kernel("k", read=0, write=0, flops=int(989e12))
    assert k.seconds(2) == pytest.approx(1.0)


def test_report_is_marked_as_a_model():
    text = T.report()
    assert text.startswith("MODEL (not measured)")
    for u in T.CIFAR_UNITS + T.IMAGENET_UNITS:
        assert u.name in text


# --------------------------------------------------------------------------- CUDA C++ kernels

@pytest.mark.parametrize("unit", T.CIFAR_UNITS + T.IMAGENET_UNITS, ids=lambda u: u.name)
@pytest.mark.parametrize("genstats", [False, True], ids=["stats-pass", "genstats"])
def test_cuda_fused_step_moves_at_most_half_the_bytes(unit, genstats):
    """The same goal for the CUDA C++ kernels (csrc/cuda, their own tiles and split rule)."""
    fused, unfused = T.cuda_fused_step(unit, genstats), T.unfused_step(unit)
    assert fused.bytes <= 0.5 * unfused.bytes, (unit.name, fused.bytes / unfused.bytes)


def test_cuda_compulsory_traffic_accounting():
    """As the Triton "sums" backward: 9 activation passes (stats 1, forward 3, weight gradient
    with the BatchNorm sums 2, data gradient writing dx 3), plus the weight gradient's split
    partials (dW's written and read: at most one activation, half the dy and x it reads);
    genstats drops the stats pass."""
    u = T.Unit("t", 64, 64, 32, 64, residual=True)
    s = u.act_in()
    fused = T.cuda_fused_step(u)
    partials = 2 * {k.name: k for k in fused.kernels}["wgrad reduce"].read  # dW and the sums'
    dw = T.cuda_wgrad_split(u) * 64 * 64 * 9 * 4
    assert 0 < 2 * dw <= s and dw < partials / 2 < 1.1 * dw
    assert fused.bytes - partials == pytest.approx(9 * s, rel=0.05)
    assert fused.bytes - partials >= 9 * s
    assert T.cuda_fused_step(u, genstats=True).bytes < fused.bytes - 0.8 * s  # - partials
    names = [k.name for k in fused.kernels]
    assert names == ["batch_stats", "fwd", "wgrad+sums", "wgrad reduce", "dgrad+dx"]


def test_cuda_split_rule_splits_long_reductions():
    """Few output tiles over many pixels (a 1x1 conv with 16 channels): the weight gradient's
    reduction is split; ImageNet's 256@14 unit (144 blocks of 64 x 64 on the H100's 132 SMs) is
    split (the rule it replaced left it whole); CIFAR's 64@8 as far as the partials' cap
    allows (3: its 147 KiB tile a split against 2 MiB of dy and x); four K-steps are not."""
    assert T.cuda_wgrad_split(T.Unit("long", 128, 16, 32, 16, k=1)) > 1
    assert T.cuda_wgrad_split(T.Unit("256@14", 256, 256, 14, 256)) > 1
    assert T.cuda_wgrad_split(T.Unit("64@8", 128, 64, 8, 64)) == 3
    assert T.cuda_wgrad_split(T.Unit("tiny", 2, 16, 8, 16)) == 1
    assert "CUDA C++ kernels" in traffic_report.full_report()


def test_modeled_efficiency_slows_every_kernel():
    """The calibrated model's efficiencies (DRAM and sustained tensor fractions < 1) lengthen
    every kernel's time against the roofline; per-kernel fractions override the default."""
    eff = traffic_report.modeled_efficiency()
    assert 0 < eff.dram < 1 and 0 < eff.tensor < 1 and not eff.is_roofline
    mem = T.Kernel("k", read=3_350_000_000_000, write=0)
    assert mem.seconds(2, eff) == pytest.approx(1.0 / eff.dram)
    gemm = T.Kernel("fwd", read=0, write=0, flops=int(989e12))
    assert gemm.seconds(2, eff) == pytest.approx(1.0 / eff.tensor)
    assert gemm.seconds(2, traffic_report.modeled_efficiency({"fwd": 0.25})) == pytest.approx(4.0)
    u = T.CIFAR_UNITS[0]
    assert T.fused_step(u).seconds(2, eff) > T.fused_step(u).seconds(2)
    assert "modeled efficiency" in traffic_report.full_report()


def test_fp32_modelled_with_tf32_tiles(monkeypatch):
    """float32 is modelled at the TF32 rate, so with the TF32 tiles even when cuDNN's switch
    is off (as in the tests), and the switch is left as it was. 40 pixels, 64 channels each
    side: the wgrad tile is 64x64x32 with TF32 (K padded to 64), 64x64x16 without (48)."""
    import torch

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    u = T.Unit("t", 10, 64, 2, 64, k=1, elem=4)
    wgrad = next(k for k in T.fused_step(u, strategy="store").kernels if k.name == "wgrad")
    assert wgrad.flops == 2 * 64 * 64 * 64
    assert torch.backends.cudnn.allow_tf32 is False


def test_waves_price_a_small_grid():
    """With ``waves`` a GEMM's tensor time counts the whole waves of its grid on the H100's
    SMs (auto_strategy decides so): 27 programs run at 27/132 of peak, 264 at 1, 144 at
    144/264; DRAM-bound kernels and kernels without a grid are unchanged."""
    k = T.Kernel("gemm", 1, 1, flops=10 ** 12, programs=27)
    base = k.seconds(2)
    assert k.seconds(2, waves=True) == pytest.approx(base * T.H100_SMS / 27)
    assert T.Kernel("gemm", 1, 1, 10 ** 12, 2 * T.H100_SMS).seconds(2, waves=True) == \
        pytest.approx(base)
    assert T.Kernel("gemm", 1, 1, 10 ** 12, 144).seconds(2, waves=True) == \
        pytest.approx(base * 2 * T.H100_SMS / 144)
    assert T.Kernel("pass", 10 ** 9, 0).seconds(2, waves=True) == T.Kernel(
        "pass", 10 ** 9, 0).seconds(2)
    # The "sums" weight gradient of CIFAR's 64-channel 8x8 unit has a small grid (its partials
    # capped): auto runs "store" there, "sums" on the 16-channel 32x32 one.
    assert T.auto_strategy(T.CIFAR_UNITS[2]) == "store"
    assert T.auto_strategy(T.CIFAR_UNITS[0]) == "sums"
