"""Builders and comparisons shared by the tests: one unit's inputs, run through a backend or the
reference, with every gradient and the running statistics collected."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedres
from fusedres import functional as FR


@dataclass(frozen=True)
class Case:
    n: int
    c: int
    h: int
    w: int
    co: int
    k: int | tuple[int, int] = 3
    stride: int | tuple[int, int] = 1
    padding: int | tuple[int, int] = 0
    dilation: int | tuple[int, int] = 1
    bias: bool = False
    residual: bool = False
    affine: bool = True

    def out_hw(self) -> tuple[int, int]:
        pair = lambda v: v if isinstance(v, tuple) else (v, v)
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = map(
            pair, (self.k, self.stride, self.padding, self.dilation))
        return ((self.h + 2 * ph - dh * (kh - 1) - 1) // sh + 1,
                (self.w + 2 * pw - dw * (kw - 1) - 1) // sw + 1)


# Awkward on purpose: channel counts and sizes that are not multiples of any tile.
CASES = [
    Case(2, 3, 7, 7, 5, k=3, padding=1, bias=True, residual=True),
    Case(1, 5, 13, 13, 17, k=1, stride=2, residual=True),
    Case(2, 17, 13, 7, 4, k=3, stride=2, padding=1, bias=True),
    Case(2, 4, 9, 11, 6, k=5, padding=2, dilation=2),
    Case(2, 5, 8, 8, 3, k=(3, 1), stride=(1, 2), padding=(1, 0), bias=True, residual=True),
    Case(1, 3, 7, 7, 4, k=3, affine=False),
]


@dataclass
class Inputs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    bn_weight: torch.Tensor | None
    bn_bias: torch.Tensor | None
    residual: torch.Tensor | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor = field(default_factory=lambda: torch.tensor(0))

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in (self.x, self.weight, self.bias, self.bn_weight, self.bn_bias,
                            self.residual) if t is not None]

    def clone(self) -> Inputs:
        def c(t):
            if t is None:
                return None
            return t.detach().clone(memory_format=torch.preserve_format).requires_grad_(
                t.requires_grad)
        return Inputs(*(c(getattr(self, f)) for f in (
            "x", "weight", "bias", "bn_weight", "bn_bias", "residual", "running_mean",
            "running_var", "num_batches_tracked")))

    def float64(self) -> Inputs:
        """A float64 copy (the exact reference of the half-precision tests)."""
        exact = self.clone()
        for f in ("x", "weight", "bias", "bn_weight", "bn_bias", "residual", "running_mean",
                  "running_var"):
            t = getattr(exact, f)
            if t is not None:
                setattr(exact, f, t.detach().double().requires_grad_(t.requires_grad))
        return exact


def make_inputs(case: Case, dtype=torch.float32, device="cpu", channels_last=False,
                param_dtype=None) -> Inputs:
    """Random inputs for ``case``; BN parameters in ``param_dtype`` (default: ``dtype``)."""
    pdt = param_dtype or dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    kh, kw = case.k if isinstance(case.k, tuple) else (case.k, case.k)
    g = lambda *s, dt=dtype: torch.randn(*s, dtype=dt, device=device)
    x = (g(case.n, case.c, case.h, case.w) * 2 + 0.5).contiguous(memory_format=fmt)
    weight = (g(case.co, case.c, kh, kw) / (case.c * kh * kw) ** 0.5).contiguous(memory_format=fmt)
    ho, wo = case.out_hw()
    inp = Inputs(
        x=x,
        weight=weight,
        bias=g(case.co) if case.bias else None,
        bn_weight=(torch.rand(case.c, dtype=pdt, device=device) + 0.5) if case.affine else None,
        bn_bias=g(case.c, dt=pdt) * 0.5 if case.affine else None,
        residual=(g(case.n, case.co, ho, wo).contiguous(memory_format=fmt)
                  if case.residual else None),
        running_mean=g(case.c, dt=pdt) * 0.1,
        running_var=torch.rand(case.c, dtype=pdt, device=device) + 0.5,
    )
    for t in inp.leaves():
        t.requires_grad_(True)
    return inp


def run(case: Case, inp: Inputs, *, training: bool, momentum=0.1, eps=1e-5):
    """Forward through the backend in force; returns the output."""
    return FR.bn_relu_conv2d(
        inp.x, inp.weight, inp.bias, inp.bn_weight, inp.bn_bias, inp.running_mean,
        inp.running_var, inp.num_batches_tracked, training=training, momentum=momentum, eps=eps,
        stride=case.stride, padding=case.padding, dilation=case.dilation, residual=inp.residual)


def run_with_grads(case: Case, inp: Inputs, grad_out=None, **kw):
    """Output, gradients of every leaf (same order as ``inp.leaves()``) and ``grad_out``."""
    y = run(case, inp, **kw)
    if grad_out is None:
        grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, inp.leaves(), grad_out)
    return y, grads, grad_out


def run_reference(case: Case, inp: Inputs, grad_out=None, **kw):
    with fusedres.use_backend("reference"):
        return run_with_grads(case, inp, grad_out, **kw)


class OpCounter(TorchDispatchMode):
    """Counts the calls of each ``fusedres`` op (with its first argument's shape)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedres":
            self.calls.append((func._opname, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(n == name for n, _ in self.calls)


def assert_within_twice_torch(names, ours, theirs, exact) -> None:
    """Each of ``ours`` is within twice the error of PyTorch's own (``theirs``) against the
    float64 ``exact``, plus a floor of 1e-3 of its magnitude (shared/design.md's rule)."""
    for name, o, t, e in zip(names, ours, theirs, exact):
        err = (o.double() - e).abs().max().item()
        err_torch = (t.double() - e).abs().max().item()
        floor = 1e-3 * e.abs().max().item()
        assert err <= 2 * err_torch + floor, f"{name}: error {err:.3g} vs torch {err_torch:.3g}"


def assert_autocast_close(names, y, grads, y_ref, grads_ref) -> None:
    """Under bf16 autocast: same output dtype, output and each gradient close to the plain
    block's (gradients relative to their largest value)."""
    assert y.dtype == y_ref.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=5e-2, rtol=2e-2)
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.dtype == g_ref.dtype, name
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g, g_ref, atol=3e-2 * scale, rtol=5e-2, msg=name)


# The start of a subprocess script that traces fused code under torch.compile for a GPU that is
# not there (TRITON_INTERPRET=0, an sm_80 target for Inductor's mutation analysis, the traced
# "cpu" units routed through the triton_ops, triton counted as runnable and preferred by
# auto), with ``capture(kind)``: an aot_autograd compiler that keeps the forward ("fw") or
# backward ("bw") graph in ``graphs`` and stops the run (nothing runs: the graphs are the
# result). tests/test_triton_kernels.py and tests/test_train_compile.py append their bodies.
TRITON_TRACE_PRELUDE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
import torch._functorch.config as fconfig
import triton
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget

import fusedres
from fusedres.backends import triton as triton_backend


class Sm80:  # the target Inductor's mutation analysis lowers the kernels for (nothing runs)
    def get_current_target(self):
        return GPUTarget("cuda", 80, 32)


triton.runtime.driver.set_active(Sm80())
# What a GPU's tensors select, for CPU tensors: traced "cpu" units go through the triton_ops,
# triton counts as runnable (nothing runs), and auto prefers it.
fusedres.ops._backend._TRACED_DEVICE_TYPE = "cpu"
triton_backend.unavailable_reason = lambda device: None
_table = fusedres.ops._backend.TABLE  # triton is its first record
_table["triton"] = _table["triton"]._replace(devices=("cuda", "cpu"))
fconfig.force_non_lazy_backward_lowering = True  # trace the backward graph now
graphs = {"fw": [], "bw": []}


def capture(kind):
    def compiler(gm, example_inputs):
        graphs[kind].append(gm)

        def stop(*args):
            raise RuntimeError("captured")  # no GPU here: the graphs are what we want
        return stop
    return compiler
"""


@contextlib.contextmanager
def host_knobs(sms: int | None = None, split: int | None = None, major: int | None = None):
    """The CUDA kernels' host copy (the test extension, csrc/cuda/common.cuh) run as on a GPU
    of ``sms`` SMs (1: every mma.sync tile the 128-row one; 10**6: the 64-row one) and compute
    capability ``major`` (9 unless set: the data gradient's wide tile is sm_90's), with the
    weight gradient's reduction split ``split`` ways (clamped to its K-steps; 0: the rule);
    each knob set is restored afterwards, even when a later one fails."""
    testing = torch.ops.fusedres_cuda_testing
    restore = []  # each knob's setter and previous value, once set
    try:
        for setter, value in ((testing.set_sm_count, sms), (testing.set_wgrad_split, split),
                              (testing.set_sm_major, major)):
            if value is not None:
                restore.append((setter, setter(value)))
        yield
    finally:
        for setter, old in reversed(restore):
            setter(old)
