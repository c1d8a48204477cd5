"""The cpu backend (csrc/cpu) against plain PyTorch on CPU: forward+backward of pre-activation
bottleneck units, of single BN-ReLU-conv units (the convs of the CIFAR bottlenecks, and
``BASIC_SWEEP``: basic 3x3 units over channels, strides and residual), and a whole ResNet-164
training step.

Each group times, in the same run: ``reference`` (the plain unit: ``nn.BatchNorm2d`` + ReLU +
``nn.Conv2d`` on oneDNN), ``cpu`` (the fused unit on the cpu backend), ``checkpoint``
(``torch.utils.checkpoint`` of the plain unit, which saves as little as the fused one) and
``compile`` (``torch.compile`` of the plain unit, inductor). Medians, IQR and ratios to the
reference print at the end (benchmarks/conftest.py); saved-activation bytes
(``fusedres.memory.saved_bytes``) and, for the whole step, the peak RSS of a fresh subprocess
sit beside them. Nothing is asserted about speed.

Run: ``pytest benchmarks/test_bench_cpu.py --benchmark-only`` (``-k unit``, ``-k conv``,
``-k basic``, ``-k step`` for one part). Environment: ``FUSEDRES_BENCH_QUICK=1`` tiny shapes (CI
smoke run in seconds); ``FUSEDRES_BENCH_THREADS`` sets torch's thread count;
``FUSEDRES_BENCH_COMPILE=0`` leaves out the torch.compile rows (inductor compiles each shape for
tens of seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fusedres
from benchutil import QUICK
from fusedres import settings
from fusedres.memory import saved_bytes
from fusedres.models import unit_shapes as shapes

THREADS = settings.get("FUSEDRES_BENCH_THREADS")
if THREADS is not None:
    torch.set_num_threads(THREADS)

pytestmark = pytest.mark.skipif(
    fusedres.unavailable_reason("cpu") is not None,
    reason=f"cpu backend unavailable: {fusedres.unavailable_reason('cpu')}",
)

COMPILE = settings.get("FUSEDRES_BENCH_COMPILE")
IMPLS = ["reference", "cpu", "checkpoint"] + (["compile"] if COMPILE else [])
ROUNDS = 2 if QUICK else 7

# The shapes are fusedres.models.unit_shapes' (the `fusedres bench units` CLI measures the same
# ones): CIFAR ResNet-164/1001 bottlenecks (stride on the first 1x1) at N=128 and ResNet-50 ones
# (stride on the 3x3) at N=32, the BN-ReLU-conv units inside the CIFAR bottlenecks, and issue 10's
# sweep of basic 3x3 units (C 16..256, stride 1/2, +-residual, N=64 @16).
UNITS = shapes.CIFAR_BOTTLENECKS + shapes.R50_BOTTLENECKS
CONVS = shapes.CIFAR_CONVS
BASIC_SWEEP = shapes.BASIC_SWEEP
STEP_DEPTH, STEP_N = (20, 4) if QUICK else (164, 64)
if QUICK:
    UNITS = [shapes.BlockUnit("quick 16-8-32 /2 @8", "bottleneck", 4, 16, 8, 8, 2, "conv2")]
    CONVS = [shapes.ConvUnit("quick 8>8 3x3 @8", 4, 8, 8, 8)]
    BASIC_SWEEP = [shapes.ConvUnit("quick basic C=8 s2 +res", 4, 8, 8, 8, 3, 2, True)]


def _wrap(module: nn.Module, impl: str):
    """The callable timed for ``impl`` (module is fused for ``cpu``, plain otherwise)."""
    if impl == "checkpoint":
        return lambda x: checkpoint(module, x, use_reentrant=False)
    if impl == "compile":
        return torch.compile(module)
    return module


def _forward_backward(fn, x):
    """One timed step: forward and backward with a fixed random output gradient."""
    gy = None

    def step():
        nonlocal gy
        x.grad = None
        y = fn(x)
        if gy is None:
            gy = torch.randn_like(y)
        y.backward(gy)

    return step


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_unit_forward_backward(benchmark, report, unit, impl):
    """One pre-activation bottleneck unit (three BN-ReLU-convs, shortcut, residual add)."""
    torch.manual_seed(0)
    block = fusedres.PreActBottleneck(unit.cin, unit.planes, unit.stride, fused=impl == "cpu",
                                      stride_on=unit.stride_on)
    x = torch.randn(unit.n, unit.cin, unit.hw, unit.hw, requires_grad=True)
    fn = _wrap(block, impl)
    backend = "cpu" if impl == "cpu" else "reference"
    warmup = 2 if impl == "compile" else 1
    step = _forward_backward(fn, x)

    benchmark.group = f"unit N={unit.n} {unit.name}"
    with fusedres.use_backend(backend):
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=warmup)
        extra = {} if impl == "compile" else {"saved_MiB": saved_bytes(fn, x) / 2**20}
    report(benchmark, group=benchmark.group, impl=impl, **extra)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("conv", CONVS, ids=[c.name for c in CONVS])
def test_conv_unit_forward_backward(benchmark, report, conv, impl):
    """One BN-ReLU-conv (``BNReLUConv2d``) against ``BatchNorm2d`` + ``ReLU`` + ``Conv2d``:
    where inside a bottleneck the time goes."""
    torch.manual_seed(0)
    fused = fusedres.BNReLUConv2d(conv.cin, conv.cout, conv.k, stride=conv.stride,
                                  padding=conv.padding)
    module = fused if impl == "cpu" else nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
    x = torch.randn(conv.n, conv.cin, conv.hw, conv.hw, requires_grad=True)
    step = _forward_backward(module, x)

    benchmark.group = f"conv N={conv.n} {conv.name}"
    with fusedres.use_backend("cpu" if impl == "cpu" else "reference"):
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)
        nbytes = saved_bytes(module, x)
    report(benchmark, group=benchmark.group, impl=impl, saved_MiB=nbytes / 2**20)


def basic_units(shape: shapes.ConvUnit):
    """(fused, plain, x, residual) for ``shape``: the fused ``BNReLUConv2d`` and the plain
    ``BatchNorm2d-ReLU-Conv2d`` sharing its parameters, a random input and residual (or None)."""
    fused = fusedres.BNReLUConv2d(shape.cin, shape.cout, shape.k, stride=shape.stride,
                                  padding=shape.padding)
    plain = nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
    x = torch.randn(shape.n, shape.cin, shape.hw, shape.hw, requires_grad=True)
    out = (shape.n, shape.cout, shape.ho, shape.ho)
    residual = torch.randn(out) if shape.residual else None
    return fused, plain, x, residual


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("shape", BASIC_SWEEP, ids=[b.name for b in BASIC_SWEEP])
def test_basic_unit_forward_backward(benchmark, report, shape, impl):
    """One basic 3x3 unit of ``BASIC_SWEEP``, fused (``BNReLUConv2d(x, residual)``) against the
    plain unit plus the residual add."""
    torch.manual_seed(0)
    fused, plain, x, residual = basic_units(shape)
    if impl == "cpu":
        def module(t):
            return fused(t, residual)
    elif residual is None:
        module = plain
    else:
        def module(t):
            return plain(t) + residual
    step = _forward_backward(module, x)

    benchmark.group = f"{shape.name} N={shape.n} @{shape.hw}"
    with fusedres.use_backend("cpu" if impl == "cpu" else "reference"):
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)
        nbytes = saved_bytes(module, x)
    report(benchmark, group=benchmark.group, impl=impl, saved_MiB=nbytes / 2**20)


# --------------------------------------------------------------------------- whole step

_PEAK_SCRIPT = r"""
import json, sys, torch, fusedres
from fusedres.models import preact_resnet

def hwm_mib():  # this process's peak RSS (VmHWM; ru_maxrss would include the parent's at fork)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

depth, n, fused, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = preact_resnet(depth, fused=fused)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, t = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
before = hwm_mib()
with fusedres.use_backend("cpu" if fused else "reference"):
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), t).backward()
        opt.step()
print(json.dumps({"before_MiB": before, "peak_MiB": hwm_mib()}))
"""


def _peak_rss(fused: bool) -> dict:
    """Peak RSS of a fresh process that builds the model and runs two training steps."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(STEP_DEPTH), str(STEP_N), str(int(fused)),
         str(torch.get_num_threads())],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_resnet164_training_step(benchmark, report, impl):
    """Forward, cross-entropy, backward and an SGD step of pre-activation ResNet-164 (CIFAR,
    32x32) at N=64, fused on the cpu backend vs the plain model with the same parameters."""
    from fusedres.models import preact_resnet

    torch.manual_seed(0)
    fused = impl == "cpu"
    model = preact_resnet(STEP_DEPTH, fused=fused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, t = torch.randn(STEP_N, 3, 32, 32), torch.randint(0, 10, (STEP_N,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), t).backward()
        opt.step()

    benchmark.group = f"step preact_resnet{STEP_DEPTH} N={STEP_N}"
    with fusedres.use_backend("cpu" if fused else "reference"):
        benchmark.pedantic(step, rounds=2 if QUICK else 5, warmup_rounds=1)
        nbytes = saved_bytes(model, x)
    peak = _peak_rss(fused)
    report(benchmark, group=benchmark.group, impl=impl, saved_MiB=nbytes / 2**20,
           peak_rss_MiB=peak["peak_MiB"], rss_before_step_MiB=peak["before_MiB"])
