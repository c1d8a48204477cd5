"""Every registered op of every fused namespace refuses a malformed argument before it reads or
writes anything: called directly with one malformed argument at a time (the table
tools.opfuzz generates from the ops' schemas), each case raises an exception naming the
argument, changes no tensor argument (running statistics, num_batches_tracked) and never ends
the process (cases run in subprocesses, ~400 a process; when one dies, the case it was running
runs alone). Each tensor argument strided (not contiguous) gives the valid call's answer bit for
bit. The harness itself is shown to catch each kind of fault on planted ops. CI runs the
fusedres_cpu cases again under AddressSanitizer (`make asan`). About 1 minute on 2 shared
cores.
"""

from __future__ import annotations

import pytest
import torch

from fusedres import functional as FR
from fusedres.ops import _extension
from tools import opfuzz

pytestmark = pytest.mark.skipif(not _extension.LOADED, reason=f"no fusedres._C: "
                                f"{_extension.LOAD_ERROR}")


@pytest.fixture(scope="module")
def table():
    opfuzz._setup()
    return opfuzz.cases()


@pytest.fixture(scope="module")
def results(table):
    return opfuzz.run(table, jobs=2)


def test_the_table_covers_every_op_and_every_argument(table):
    """Every op the dispatcher holds in a fused namespace (but the test extension's probes) has
    cases, and every argument of a kind that can be malformed has some: a new op or argument
    is covered without an edit here (or fails the table: no valid value for it)."""
    ops = opfuzz.op_names()
    namespaces = {op.split("::")[0] for op in ops}
    expected = {"fusedres", "fusedres_cpu"}
    if _extension.load_cuda_on_cpu() is None:
        expected.add("fusedres_cuda")
    try:
        import fusedres.backends.triton  # noqa: F401

        expected.add("fusedres_triton")
    except ImportError:
        pass
    assert expected <= namespaces, namespaces
    covered = {(c.op, c.arg) for c in table}
    for op in ops:
        for a in opfuzz._schema(op).arguments:
            if str(a.type) in ("bool", "Optional[float]") or a.name == "momentum":
                continue  # nothing malformed: any bool, any momentum (nn.BatchNorm2d's)
            assert (op, a.name) in covered, (op, a.name)
    assert len(table) > 1500, len(table)


def test_every_valid_call_returns(table, results):
    """The valid call of each op returns: the malformed cases differ from it in one argument."""
    bad = {op: opfuzz.failure(f"{op}:valid", results.get(f"{op}:valid"))
           for op in {c.op for c in table}}
    assert not {op: why for op, why in bad.items() if why}


def test_every_malformed_argument_is_refused_by_name(table, results):
    failures = {c.id: opfuzz.failure(c.id, results.get(c.id)) for c in table}
    failures = {i: why for i, why in failures.items() if why}
    assert not failures, "\n".join(f"{i}: {why}" for i, why in sorted(failures.items())[:40])


def test_the_harness_catches_each_kind_of_fault(monkeypatch):
    """Planted ops that, given an int64 weight, return normally, end the process with SIGSEGV,
    raise without naming the weight, or change x before raising, run as one batch: each case
    fails; the process dies at the second, which fails again alone (the culprit), the first's
    result stands and the last two run as a batch of their own."""
    opfuzz.plant()
    monkeypatch.setenv("FUSEDRES_OPFUZZ_PLANT", "1")
    table = [c for c in opfuzz.cases([f"{opfuzz.PLANTED}::{k}" for k in opfuzz.PLANTED_KINDS])
             if c.arg == "weight" and c.label == "int64"]
    assert [c.op.split("::")[1] for c in table] == list(opfuzz.PLANTED_KINDS)
    results = opfuzz.run(table, jobs=2)
    why = {c.op.split("::")[1]: opfuzz.failure(c.id, results.get(c.id)) for c in table}
    assert why["returns"] == "returned normally"
    assert why["signals"].startswith("the process ended: exit status -11"), why["signals"]
    assert why["unnamed"].startswith("the message does not name 'weight'"), why["unnamed"]
    assert why["changes_x"] == "changed x"
    for c in table:  # the valid calls ran (first, in the batch that died) and returned
        assert opfuzz.failure(f"{c.op}:valid", results.get(f"{c.op}:valid")) is None


def test_an_argument_is_named_as_a_word():
    assert opfuzz.names_argument("op: bias: expected shape (4,)", "bias")
    assert not opfuzz.names_argument("op: bn_bias: expected shape (4,)", "bias")
    assert not opfuzz.names_argument("op: weight2: expected", "weight")
    assert opfuzz.names_argument("Expected a value of type 'Tensor' for argument 'x'", "x")


def test_strided_arguments_give_the_contiguous_answer_on_every_backend(backend):
    """Through the public API, every tensor argument strided (every other element of a larger
    tensor) gives the contiguous call's output and running statistics, on every backend: the
    triton backend's forward read a strided bias at unit stride (an error of 1.7 here)."""
    g = torch.Generator().manual_seed(0)
    c, co = 3, 4

    def args():
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        return dict(x=r(2, c, 5, 5), weight=r(co, c, 3, 3), bias=r(co), bn_weight=r(c).abs(),
                    bn_bias=r(c), running_mean=r(c), running_var=r(c).abs() + 0.5,
                    residual=r(2, co, 5, 5))

    def call(a):
        return FR.bn_relu_conv2d(a["x"], a["weight"], a["bias"], a["bn_weight"], a["bn_bias"],
                                 a["running_mean"], a["running_var"], training=True, padding=1,
                                 residual=a["residual"])

    want = args()
    got = {k: opfuzz._strided(v) for k, v in want.items()}  # the same values, strided
    y = call(want)
    assert not any(v.is_contiguous() for v in got.values())
    torch.testing.assert_close(call(got), y, rtol=1e-5, atol=1e-5)
    for k in ("running_mean", "running_var"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ns", ["fusedres", "fusedres_cpu", "fusedres_cuda", "fusedres_triton"])
def test_an_empty_batch_has_one_answer_in_every_namespace(ns):
    """docs/api.md's rule for an empty batch (N = 0), the same from every op of every
    namespace: statistics NaN (the mean and variance of no values: fusedres_cpu's batch_stats
    gave a mean of 0), an empty output, an empty x gradient and zero gradients for the rest
    (fusedres_cpu's backward raised IndexError; fusedres_triton's divided by zero). A weight
    with no output channel is refused by name everywhere (the portable code refused it, the
    cpu kernels returned an empty output)."""
    opfuzz._setup([ns])
    if f"{ns}::batch_stats" not in opfuzz.op_names():
        pytest.skip(f"no {ns} ops here")
    ops = getattr(torch.ops, ns)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(0, 3, 5, 5, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    mean, invstd = torch.zeros(3), torch.ones(3)
    geometry = ([1, 1], [1, 1], [1, 1])
    m, v = ops.batch_stats(x)
    assert m.shape == v.shape == (3,) and m.isnan().all() and v.isnan().all()
    y = ops.bn_relu_conv2d(x, w, torch.ones(4), None, None, mean, invstd, None, *geometry, True)
    assert y.shape == (0, 4, 5, 5)
    grads = ops.bn_relu_conv2d_backward(torch.zeros(0, 4, 5, 5), x, w, torch.ones(3),
                                        torch.zeros(3), mean, invstd, *geometry, True, [True] * 5)
    assert grads[0].shape == x.shape
    for grad, like in zip(grads[1:], (w, torch.ones(4), mean, mean)):
        assert torch.equal(grad, torch.zeros_like(like))
    with pytest.raises(ValueError, match=rf"{ns}(::|\.)bn_relu_conv2d: weight: expected at "
                                         r"least one output channel \(as conv2d\)"):
        ops.bn_relu_conv2d(torch.randn(2, 3, 5, 5), torch.randn(0, 3, 3, 3), None, None, None,
                           mean, invstd, None, *geometry, True)
