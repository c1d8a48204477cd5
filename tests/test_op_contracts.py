"""Every registered op of every fused namespace refuses a malformed argument before it reads or
writes anything: called directly with one malformed argument at a time (the table
fusedres.opfuzz generates from the ops' schemas), each case raises an exception naming the
argument, changes no tensor argument (running statistics, num_batches_tracked) and never ends
the process (cases run in subprocesses, ~150 a process; a process that dies has its cases run
again one a process). The harness itself is shown to catch each kind of fault on planted ops.
CI runs the fusedres_cpu cases again under AddressSanitizer (`make asan`). About 40 s on 2 cores.
"""

from __future__ import annotations

import pytest

from fusedres import _extension, opfuzz

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
    if _extension.load_cuda_host() is None:
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
    """Planted ops that, given an int64 weight, return normally, raise without naming the
    weight, or change x before raising: each case fails; one that ends its process with
    SIGSEGV fails too, and the harness goes on (its batch runs again one case a process)."""
    opfuzz.plant()
    cases = {c.op.split("::")[1]: c for c in opfuzz.cases(
        [f"{opfuzz.PLANTED}::{k}" for k in opfuzz.PLANTED_KINDS])
        if c.arg == "weight" and c.label == "int64"}
    why = {kind: opfuzz.failure(c.id, opfuzz.run_case(c)) for kind, c in cases.items()
           if kind != "signals"}
    assert why["returns"] == "returned normally"
    assert why["unnamed"].startswith("the message does not name 'weight'"), why["unnamed"]
    assert why["changes_x"] == "changed x"
    for kind in why:  # their valid calls return
        assert opfuzz.failure(f"{cases[kind].op}:valid", opfuzz.run_valid(cases[kind].op)) is None
    monkeypatch.setenv("FUSEDRES_OPFUZZ_PLANT", "1")
    signals = cases["signals"]
    results = opfuzz.run([signals], jobs=1, valid=False)
    assert opfuzz.failure(signals.id, results[signals.id]).startswith(
        "the process ended: exit status -11"), results


def test_an_argument_is_named_as_a_word():
    assert opfuzz.names_argument("op: bias: expected shape (4,)", "bias")
    assert not opfuzz.names_argument("op: bn_bias: expected shape (4,)", "bias")
    assert not opfuzz.names_argument("op: weight2: expected", "weight")
    assert opfuzz.names_argument("Expected a value of type 'Tensor' for argument 'x'", "x")
