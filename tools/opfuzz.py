"""Every registered fused op called with one malformed argument at a time, in subprocesses that a
signal cannot take down with the caller (tests/test_op_contracts.py; CI's AddressSanitizer step).

The table is generated from the ops' schemas as the dispatcher holds them (every op of every
namespace ``fusedres*``, less :data:`EXCLUDED`): for each op a valid call of one small problem
(:data:`VALID` gives each argument name its value; an op with a name it lacks fails the table,
so a new op is covered or refused at once), then for each argument the malformed values its
kind has (:func:`_variants`: wrong shape, dtype, device (meta, by the op's own kernel and
through the dispatcher; cuda where a GPU is), overlapping, grad-requiring or inference-mode
buffers, geometry lists of the wrong length or out of range, a bad eps, None for a required
tensor).
Each case must raise an exception whose message names the argument, leave every tensor
argument unchanged (running statistics, num_batches_tracked) and never end the process. And per
tensor argument a well-formed case: its values strided (:data:`STRIDED`), which must give the
valid call's outputs and state bit for bit (the strides the kernels assume).

``python -m tools.opfuzz [--asan] [--namespace NS ...] [--jobs J]`` runs the table and prints
the cases that failed; exit status 0 when none did. ``--asan`` runs the ``fusedres_cpu`` cases
against fusedres._C built with AddressSanitizer (build/asan-ext, :func:`build_asan_extension`),
preloading the ASan runtime: an out-of-bounds access in a CPU kernel ends its case with a report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test extension's own probes of the CPU execution layer (kernels that race or read out of
# bounds on purpose, for the sanitizers to find) and its hooks into kernel rules: test vehicles
# that no install ships (fusedres._C_cuda_on_cpu is built by `make test` only), called by their
# tests with fixed arguments.
EXCLUDED = ("fusedres_cuda_layer_test", "fusedres_cuda_testing")

# The sample problem: x (N, C, H, W), a 3x3 convolution to CO channels, stride 1, padding 1; the
# second convolution of the pair ops a 1x1 to CO2 channels at stride 2.
N, C, H, W, CO, CO2 = 2, 3, 5, 5, 4, 2
OUT = (N, CO, H, W)
OUT2 = (N, CO2, 3, 3)


def _setup(namespaces=None) -> None:
    """Import the ops of ``namespaces`` (None: all): fusedres (fusedres::, fusedres_cpu::), the
    cuda backend's CPU copy (fusedres_cuda:: on CPU tensors) and the Triton backend
    (fusedres_triton::, under the interpreter)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FUSEDRES_CUDA_ON_CPU", "1")
    import fusedres  # noqa: F401
    from fusedres.ops import _extension

    if namespaces is None or "fusedres_cuda" in namespaces:
        _extension.load_cuda_on_cpu()
    if namespaces is None or "fusedres_triton" in namespaces:
        try:
            import fusedres.backends.triton  # noqa: F401
        except ImportError:
            pass
    from fusedres import settings

    if settings.get("FUSEDRES_OPFUZZ_PLANT"):
        plant()


# A namespace of planted faults, for the harness's own test (tests/test_op_contracts.py): ops
# with bn_relu_conv2d's schema that take the valid call and, given a malformed weight, return
# normally, end the process with a signal, raise without naming it, or change x and raise.
PLANTED = "opfuzz_planted"
PLANTED_KINDS = ("returns", "signals", "unnamed", "changes_x")
_planted: list = []


def plant() -> None:
    """Register :data:`PLANTED`'s ops in this process (once)."""
    if _planted:
        return
    import signal

    import torch

    from fusedres.ops.opdefs import SCHEMAS

    lib = torch.library.Library(PLANTED, "DEF")
    _planted.append(lib)

    def make(kind):
        def impl(x, weight, *rest):
            if weight.dtype == torch.float32 and weight.shape == (CO, C, 3, 3):
                return x.new_zeros(OUT)
            if kind == "returns":
                return x.new_zeros(OUT)
            if kind == "signals":
                os.kill(os.getpid(), signal.SIGSEGV)
            if kind == "changes_x":
                x.add_(1)
                raise ValueError("weight: expected a float32 weight")
            raise RuntimeError("something went wrong")
        return impl

    for kind in PLANTED_KINDS:
        lib.define(kind + SCHEMAS["bn_relu_conv2d"])
        lib.impl(kind, make(kind), "CompositeExplicitAutograd")


def op_names() -> list[str]:
    """Every registered op ``<namespace>::<name>`` of a fused namespace, less :data:`EXCLUDED`."""
    import torch

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedres")]
    return sorted(n for n in names if n.split("::")[0] not in EXCLUDED)


def _schema(op: str):
    import torch

    ns, name = op.split("::")
    return getattr(getattr(torch.ops, ns), name).default._schema


# --------------------------------------------------------------------------- valid values

def _valid_values() -> dict[str, Callable[[], Any]]:
    import torch

    g = torch.Generator().manual_seed(0)

    def r(*shape, lo=None):
        t = torch.randn(*shape, generator=g)
        return t.abs() + lo if lo is not None else t

    return {
        "x": lambda: r(N, C, H, W), "weight": lambda: r(CO, C, 3, 3), "bias": lambda: r(CO),
        "bn_weight": lambda: r(C, lo=0.5), "bn_bias": lambda: r(C), "mean": lambda: r(C),
        "invstd": lambda: r(C, lo=0.5), "var": lambda: r(C, lo=0.5),
        "residual": lambda: r(*OUT), "grad_out": lambda: r(*OUT),
        "stride": lambda: [1, 1], "padding": lambda: [1, 1], "dilation": lambda: [1, 1],
        "weight2": lambda: r(CO2, C, 1, 1), "bias2": lambda: r(CO2),
        "stride2": lambda: [2, 2], "padding2": lambda: [0, 0], "dilation2": lambda: [1, 1],
        "grad_out2": lambda: r(*OUT2), "grad_x_add": lambda: r(N, C, H, W),
        "branch_scale": lambda: torch.tensor([1.0, 0.5]), "output_mask": lambda: [True] * 5,
        "batch_stats": lambda: True, "genstats": lambda: True, "stats2": lambda: True,
        "training": lambda: True, "momentum": lambda: 0.1, "eps": lambda: 1e-5,
        "running_mean": lambda: r(C), "running_var": lambda: r(C, lo=0.5),
        "num_batches_tracked": lambda: torch.tensor(3),
    }


# Arguments a valid call of the op must leave out (the unit that hands x on as the next unit's
# residual takes neither a residual nor a branch scale).
NONE_IN_VALID = {"eager_unit_with_shortcut": ("residual", "branch_scale")}


def valid_call(op: str) -> dict[str, Any]:
    """Op ``op``'s valid arguments by name, in schema order (an argument the table has no value
    for: KeyError, naming it)."""
    values = _valid_values()
    name = op.split("::")[1]
    out = {}
    for a in _schema(op).arguments:
        if a.name not in values:
            raise KeyError(f"{op}: no valid value for argument {a.name!r} in "
                           "tools.opfuzz._valid_values: add one (and its kind, _KIND)")
        out[a.name] = None if a.name in NONE_IN_VALID.get(name, ()) else values[a.name]()
    return out


# --------------------------------------------------------------------------- malformed values

# The kind of each argument, which decides its malformed values: "x" the input; "float" a tensor
# of any float dtype; "strict" one whose dtype the op fixes (the statistics dtype for per-channel
# vectors, the weight's for bias and residual); "buffer" a running statistic updated in place.
_KIND = {
    "x": "x", "weight": "weight", "weight2": "weight", "bias": "strict", "bias2": "strict",
    "bn_weight": "strict", "bn_bias": "strict", "mean": "strict", "invstd": "strict",
    "var": "strict", "residual": "strict", "grad_out": "float", "grad_out2": "float",
    "grad_x_add": "float", "branch_scale": "float", "running_mean": "buffer",
    "running_var": "buffer", "num_batches_tracked": "count",
}
# module_unit takes what fusedres.functional takes: BatchNorm vectors, bias and residual of any
# float dtype (cast, or added with PyTorch's promotion), a weight of another float dtype than x's
# (autocast): those it leaves to the Python route, which casts them.
_MODULE_KIND = {"bias": "float", "bn_weight": "float", "bn_bias": "float", "residual": "float",
                "weight": "any_float_weight"}

_GEOMETRY_MIN = {"stride": 1, "padding": 0, "dilation": 1}


@dataclass(frozen=True)
class Case:
    op: str         # "<namespace>::<name>"
    arg: str        # the malformed argument
    label: str      # what is wrong with it
    index: int      # its place among the op's cases of this argument (to rebuild the value)

    @property
    def id(self) -> str:
        return f"{self.op}:{self.arg}:{self.label}"


def _shape_variants(t, shape: tuple) -> list[tuple[str, Callable]]:
    """Shapes that differ from ``shape`` in one way: one dimension more or less, a size off by
    one, a single element (which would broadcast)."""
    import torch

    out = [("rank+1", lambda: torch.ones(*shape, 1, dtype=t.dtype)),
           ("numel1", lambda: torch.ones(1, dtype=t.dtype))]
    if len(shape) > 1:
        out.append(("rank-1", lambda: torch.ones(*shape[1:], dtype=t.dtype)))
    for i in range(len(shape)):
        bigger = list(shape)
        bigger[i] += 1
        out.append((f"dim{i}+1", lambda s=tuple(bigger): torch.ones(*s, dtype=t.dtype)))
        if shape[i] > 1:
            smaller = list(shape)
            smaller[i] -= 1
            out.append((f"dim{i}-1", lambda s=tuple(smaller): torch.ones(*s, dtype=t.dtype)))
    return out


def _variants(op: str, arg, valid: dict[str, Any]) -> list[tuple[str, Callable, str]]:
    """The malformed values of argument ``arg`` (a schema argument) of ``op``: (label, a factory
    of the value, how to call: "call" through the dispatcher, "redispatch" to the kernel of the
    op's device key, for a tensor on another device: the dispatcher would pick the meta
    kernel)."""
    import torch

    ns, name = op.split("::")
    t = str(arg.type)
    v = valid[arg.name]
    kind = (_MODULE_KIND.get(arg.name) if name == "module_unit" else None) or _KIND.get(arg.name)
    out: list[tuple[str, Callable, str]] = []
    if t == "List[int]":  # SymInt[2] geometry
        base = arg.name.rstrip("2")
        minimum = _GEOMETRY_MIN[base]
        bad = [("len1", [1]), ("len3", [1, 1, 1]), ("empty", []),
               ("below_min", [minimum - 1] * 2), ("2^31", [2**31] * 2)]
        weight = valid.get("weight2" if arg.name.endswith("2") else "weight")
        spans = base == "padding" or (weight is not None and min(weight.shape[2:]) > 1)
        if base in ("padding", "dilation") and spans:  # a 32-bit index span reaching 2^31
            bad.append(("2^30", [2**30] * 2))
        return [(label, lambda b=b: list(b), "call") for label, b in bad]
    if t == "List[bool]":
        return [("len3", lambda: [True] * 3, "call"), ("len6", lambda: [True] * 6, "call")]
    if t == "float" and arg.name == "eps":
        return [("zero", lambda: 0.0, "call"), ("negative", lambda: -1.0, "call"),
                ("nan", lambda: math.nan, "call")]
    if t in ("bool", "Optional[float]", "float", "int"):
        return []
    if t not in ("Tensor", "Optional[Tensor]"):
        raise NotImplementedError(f"{op}: no malformed values for type {t} of {arg.name!r}")
    if v is None:  # an argument the valid call must leave out: given, it is refused
        if arg.name in NONE_IN_VALID.get(name, ()):
            return [("given", _valid_values()[arg.name], "call")]
        return []
    if t == "Tensor":
        out.append(("none", lambda: None, "call"))
    out += _device_variants(ns, arg.name, v)
    if kind in ("buffer", "count"):  # updated in place: made in inference mode, used outside it
        out.append(("inference", lambda: _inference(v), "call"))
    if kind == "count":
        out += [("float", lambda: torch.tensor(3.0), "call"),
                ("two", lambda: torch.tensor([3, 3]), "call")]
        return out
    out.append(("int64", lambda: v.long(), "call"))
    if kind in ("weight", "strict") and not (kind == "weight" and name == "module_unit"):
        # Another float dtype than the one the op fixes (x's for the weight).
        out.append(("float64", lambda: v.double(), "call"))
    shape = tuple(v.shape)
    if kind == "x":
        out += [("rank3", lambda: v[0].clone(), "call"),
                ("rank5", lambda: v.unsqueeze(0).clone(), "call")]
    elif kind in ("weight", "any_float_weight"):
        out += [("channels+1", lambda: torch.ones(shape[0], C + 1, *shape[2:]), "call"),
                ("rank2", lambda: torch.ones(shape[0], C), "call"),
                ("empty_kernel", lambda: torch.ones(shape[0], C, 0, shape[3]), "call")]
    else:
        out += [(label, f, "call") for label, f in _shape_variants(v, shape)]
    if kind == "buffer":
        out += [("expanded", lambda: torch.ones(1).expand(C), "call"),
                ("requires_grad", lambda: v.clone().requires_grad_(), "call")]
        if arg.name == "running_var":
            out.append(("is_running_mean", lambda: valid["running_mean"], "call"))
    return out


def _device_variants(ns: str, name: str, v) -> list[tuple[str, Callable, str]]:
    """The argument on another device than the others: meta, by the kernel of the op's own
    device key ("meta": its own checks) and through the dispatcher ("meta_dispatched": which
    picks the Meta key, the fake kernel for the Python ops); on a GPU, cuda. The public ops'
    x decides their device: a meta or cuda x is valid there."""
    import torch

    if name == "x" and ns == "fusedres":
        return []
    out = [("meta", lambda: v.to("meta"), "redispatch"),
           ("meta_dispatched", lambda: v.to("meta"), "call")]
    if torch.cuda.is_available():
        out.append(("cuda", lambda: v.to("cuda"), "call"))
    return out


def _inference(v):
    """A copy of ``v`` made in inference mode: an inference tensor, which no in-place update
    outside inference mode may write."""
    import torch

    with torch.inference_mode():
        return v.clone()


# Device-mixing labels whose refusal may name x instead of the argument: the dispatcher sends a
# call with a cuda tensor to the CUDA kernel, whose first check is that x is a cuda tensor.
X_MAY_ANSWER = ("cuda",)


# The label of a well-formed case: the argument's values in a tensor of other strides (every
# other element of a larger one), which the op must take and answer exactly as the valid call:
# the kernels read a tensor through its strides, or a contiguous copy, whatever they assume.
STRIDED = "strided"


def _strided(t):
    """``t``'s values in a tensor whose last dimension has stride 2 (not contiguous)."""
    buf = t.new_empty(*t.shape[:-1], 2 * t.shape[-1])
    view = buf[..., ::2]
    view.copy_(t)
    return view


def cases(ops: list[str] | None = None) -> list[Case]:
    """The table: one case per malformed value of each argument of each op, and one
    :data:`STRIDED` case per tensor argument of the valid call."""
    import torch

    out = []
    for op in ops if ops is not None else op_names():
        valid = valid_call(op)
        for a in _schema(op).arguments:
            for i, (label, _, _) in enumerate(_variants(op, a, valid)):
                out.append(Case(op, a.name, label, i))
            v = valid[a.name]
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() > 1:
                out.append(Case(op, a.name, STRIDED, -1))
    return out


# --------------------------------------------------------------------------- running a case

def _snapshot(values: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: v.detach().clone() for k, v in values.items()
            if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def _changed(before: dict[str, Any], values: dict[str, Any]) -> list[str]:
    import torch

    return [k for k, v in before.items() if not torch.equal(values[k].detach(), v)]


def _call(op: str, args: list, how: str):
    import torch

    ns, name = op.split("::")
    overload = getattr(getattr(torch.ops, ns), name).default
    if how == "redispatch":
        return overload.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)
    return overload(*args)


def names_argument(message: str, arg: str) -> bool:
    """Whether ``message`` names ``arg`` as a word of its own (``bias`` is not ``bn_bias``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])", message) is not None


def _flat(out) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else [out]


def _run_strided(case: Case) -> dict[str, Any]:
    """The valid call, and again with ``case.arg`` strided: "same" when every output and every
    tensor argument after the call (running statistics) are equal, bit for bit."""
    import torch

    result: dict[str, Any] = {"id": case.id}
    ref = valid_call(case.op)
    want = _flat(_call(case.op, list(ref.values()), "call"))
    values = valid_call(case.op)
    values[case.arg] = _strided(values[case.arg])
    try:
        got = _flat(_call(case.op, list(values.values()), "call"))
    except Exception as exc:  # noqa: BLE001
        return {**result, "outcome": "raised", "type": type(exc).__name__,
                "message": str(exc).split("\nException raised from")[0][:600]}
    differ = [f"output {i}" for i, (a, b) in enumerate(zip(got, want))
              if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)]
    differ += [k for k, v in values.items() if isinstance(v, torch.Tensor)
               and not torch.equal(v.detach(), ref[k].detach())]
    return {**result, "outcome": "differs" if differ or len(got) != len(want) else "same",
            "changed": differ}


def run_case(case: Case) -> dict[str, Any]:
    """Call the op with the case's malformed argument: a dict with "outcome" ("raised" or
    "returned"), the exception's type and message, and the tensor arguments it changed. A
    :data:`STRIDED` case: "same", "differs" (and what) or "raised"."""
    if case.label == STRIDED:
        return _run_strided(case)
    valid = valid_call(case.op)
    arg = next(a for a in _schema(case.op).arguments if a.name == case.arg)
    label, make, how = _variants(case.op, arg, valid)[case.index]
    assert label == case.label, (case, label)
    values = dict(valid)
    values[case.arg] = make()
    before = _snapshot(values)
    result: dict[str, Any] = {"id": case.id}
    try:
        _call(case.op, list(values.values()), how)
        result["outcome"] = "returned"
    except Exception as exc:  # noqa: BLE001 - any exception is the expected outcome
        result.update(outcome="raised", type=type(exc).__name__,
                      message=str(exc).split("\nException raised from")[0][:600])
    result["changed"] = _changed(before, values)
    return result


def run_valid(op: str) -> dict[str, Any]:
    """The op's valid call: it must return (else the table's malformed cases prove nothing)."""
    values = valid_call(op)
    try:
        _call(op, list(values.values()), "call")
        return {"id": f"{op}:valid", "outcome": "returned"}
    except Exception as exc:  # noqa: BLE001
        return {"id": f"{op}:valid", "outcome": "raised", "type": type(exc).__name__,
                "message": str(exc)[:600]}


# The one refusal that comes before any kernel, from the dispatcher, and cannot name the
# argument: None for the only tensor argument of an op (batch_stats's x). The dispatcher takes
# None for a Tensor as an undefined tensor and, with no tensor to take a device from, finds no
# kernel to call: NotImplementedError "There were no tensor arguments to this function".
NO_TENSOR_ARGUMENTS = "There were no tensor arguments to this function"


def _only_tensor(op: str, arg: str) -> bool:
    tensors = [a.name for a in _schema(op).arguments if "Tensor" in str(a.type)]
    return tensors == [arg]


def failure(case_id: str, result: dict[str, Any] | None) -> str | None:
    """Why a case's result breaks the contract (None when it holds)."""
    if result is None:
        return "no result"
    if case_id.endswith(":valid"):
        return None if result["outcome"] == "returned" else (
            f"the valid call raised {result.get('type')}: {result.get('message')}")
    arg = case_id.rsplit(":", 2)[1]
    if result["outcome"] == "signal":
        return f"the process ended: {result.get('detail')}"
    if case_id.endswith(f":{STRIDED}"):
        if result["outcome"] == "same":
            return None
        if result["outcome"] == "differs":
            return f"strided {arg}: differs in {', '.join(result['changed'])}"
        return f"strided {arg}: raised {result.get('type')}: {result.get('message')}"
    if result["outcome"] == "returned":
        return "returned normally"
    if (result.get("type") == "NotImplementedError" and case_id.endswith(":none")
            and NO_TENSOR_ARGUMENTS in result.get("message", "")
            and _only_tensor(_op_of(case_id), arg)):
        return None  # the dispatcher's refusal: no kernel ran (NO_TENSOR_ARGUMENTS)
    message = result.get("message", "")
    named = names_argument(message, arg) or (
        case_id.rsplit(":", 1)[1] in X_MAY_ANSWER and names_argument(message, "x"))
    if not named:
        return f"the message does not name {arg!r}: {result.get('type')}: {result.get('message')}"
    if result.get("changed"):
        return f"changed {', '.join(result['changed'])}"
    return None


# --------------------------------------------------------------------------- subprocesses

def _op_of(case_id: str) -> str:
    return case_id.rsplit(":", 2)[0]


def _child(ids: list[str], out_path: str, valid_ops: list[str]) -> None:
    """Run the cases ``ids`` (and the valid calls of ``valid_ops``), one JSON line each into
    ``out_path``, a "start" line before each: what a killed process was running."""
    import torch

    ops = sorted({_op_of(i) for i in ids} | set(valid_ops))
    _setup({op.split("::")[0] for op in ops})
    from fusedres import settings

    asan = settings.get("FUSEDRES_ASAN_EXTENSION")
    if asan:  # the cases must reach the instrumented build
        from fusedres.ops import _extension

        loaded = getattr(sys.modules.get("fusedres._C"), "__file__", None)
        if not (_extension.LOADED and loaded == asan):
            raise RuntimeError(f"fusedres._C is {loaded}, not the ASan build {asan} "
                               f"({_extension.LOAD_ERROR})")
    torch.set_num_threads(1)
    by_id = {c.id: c for c in cases(sorted({_op_of(i) for i in ids}))}
    with open(out_path, "a", buffering=1) as out:
        for op in valid_ops:
            out.write(json.dumps({"start": f"{op}:valid"}) + "\n")
            out.write(json.dumps(run_valid(op)) + "\n")
        for i in ids:
            out.write(json.dumps({"start": i}) + "\n")
            out.write(json.dumps(run_case(by_id[i])) + "\n")


def _env(asan: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env.setdefault("FUSEDRES_CUDA_ON_CPU", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if asan:
        # libstdc++ beside it: ASan's __cxa_throw interceptor must find the real one before a
        # library loaded later throws (triton's does, as torch imports it).
        env["LD_PRELOAD"] = " ".join(asan_runtime())
        env["FUSEDRES_ASAN_EXTENSION"] = ASAN_EXTENSION
        # libtorch keeps allocations to the end and is not instrumented: no leak check;
        # Python's allocator is: no ODR checks across the two builds of the ops.
        env["ASAN_OPTIONS"] = "detect_leaks=0:detect_odr_violation=0:halt_on_error=1:" + env.get(
            "ASAN_OPTIONS", "")
    return env


# The child's first lines: with AddressSanitizer, its build of fusedres._C is loaded as the
# module before fusedres imports (and would load) the regular one.
_CHILD = """
import importlib.util, json, os, sys
import torch
path = os.environ.get("FUSEDRES_ASAN_EXTENSION")
if path:
    spec = importlib.util.spec_from_file_location("fusedres._C", path)
    sys.modules["fusedres._C"] = importlib.util.module_from_spec(spec)
from tools import opfuzz
opfuzz._child(json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
"""


def _run_batch(ids: list[str], valid_ops: list[str], asan: bool,
               timeout: float) -> tuple[dict[str, dict], str | None, str]:
    """Run a batch in one subprocess: (results by id, the id running when it died or None,
    its output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        path = f.name
    code = _CHILD
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(ids), path,
                               json.dumps(valid_ops)], capture_output=True, text=True,
                              env=_env(asan), timeout=timeout, cwd=ROOT)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", str(exc)
    results, running = {}, None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "start" in rec:
                running = rec["start"]
            else:
                results[rec["id"]] = rec
                running = None
    os.unlink(path)
    if rc == 0:
        return results, None, output
    if running is None:  # died after its last case (at exit), or before the first
        running = "(outside any case)"
    results[running] = {"id": running, "outcome": "signal",
                        "detail": f"exit status {rc}: {_tail(output)}"}
    return results, running, output


def _tail(output: str, lines: int = 12) -> str:
    """The end of a child's output; an AddressSanitizer report's headline and first frames."""
    keep = [ln for ln in output.splitlines() if ln.strip() and "Warning" not in ln]
    for i, line in enumerate(keep):
        if ASAN_REPORT in line:
            return " | ".join(keep[i:i + lines])[:2000]
    return " | ".join(keep[-lines:])[-2000:]


def run(table: list[Case], *, asan: bool = False, batch: int = 400, jobs: int = 2,
        timeout: float = 600, valid: bool = True) -> dict[str, dict]:
    """Run the table, a namespace's cases about ``batch`` a subprocess, ``jobs`` at a time, and
    (``valid``) every op's valid call. When a batch's process dies, the case it was running is
    run alone (the culprit if it dies again; if not, the cases before it run alone each), and
    the cases after it as a batch of their own. Results by case id."""
    batches, valid_for = [], []
    for ns in sorted({c.op.split("::")[0] for c in table}):
        ids = [c.id for c in table if c.op.split("::")[0] == ns]
        ops = sorted({c.op for c in table if c.op.split("::")[0] == ns})
        # A namespace's cases in batches of about `batch` (a process each: ~5 s to start).
        n = max(1, round(len(ids) / batch))
        size = -(-len(ids) // n)
        for i in range(n):
            batches.append(ids[i * size:(i + 1) * size])
            valid_for.append(ops if i == 0 and valid else [])
    results: dict[str, dict] = {}

    def alone(item: str) -> tuple[str, dict | None]:
        valid = item.endswith(":valid")
        r, _, _ = _run_batch([] if valid else [item], [item.removesuffix(":valid")] if valid
                             else [], asan, timeout)
        return item, r.get(item)

    def one(args) -> dict[str, dict]:
        b, v = args
        got, died, _ = _run_batch(b, v, asan, timeout)
        if died is None:
            return got
        ran = [f"{op}:valid" for op in v] + b  # in the order the process ran them
        if died not in ran:  # before its first item or after its last: every item alone
            with ThreadPoolExecutor(jobs) as again:
                return dict(again.map(alone, ran))
        k = ran.index(died)
        # The item running when the process died, alone: the culprit if it dies again. If it
        # does not, an earlier item corrupted the process: each of those alone too. The items
        # after it never ran: a batch of their own (the same procedure).
        out = {i: got[i] for i in ran[:k] if i in got}
        _, out[died] = alone(died)
        if out[died] is None or out[died]["outcome"] != "signal":
            with ThreadPoolExecutor(jobs) as again:
                out.update(again.map(alone, ran[:k]))
        rest = ran[k + 1:]
        if rest:
            out.update(one(([i for i in rest if not i.endswith(":valid")],
                            [i.removesuffix(":valid") for i in rest if i.endswith(":valid")])))
        return out

    with ThreadPoolExecutor(jobs) as pool:
        for got in pool.map(one, zip(batches, valid_for)):
            results.update(got)
    return results


# --------------------------------------------------------------------------- AddressSanitizer

ASAN_BUILD = os.path.join(ROOT, "build", "asan-ext")
ASAN_EXTENSION = os.path.join(ASAN_BUILD, "_C.so")


def asan_runtime() -> list[str]:
    """The compiler's ASan runtime and its libstdc++, to preload (an uninstrumented python
    loads the instrumented extension)."""
    cxx = os.environ.get("CXX", "g++")
    paths = []
    for lib in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True,
                              text=True, check=True).stdout.strip()
        if not os.path.isabs(path):
            raise RuntimeError(f"{cxx} has no {lib} ({path!r})")
        paths.append(path)
    return paths


ASAN_REPORT = "ERROR: AddressSanitizer"


def asan_catches_a_planted_read() -> str | None:
    """Whether this set-up catches an out-of-bounds read: a function compiled with
    -fsanitize=address reads one float past a tensor's storage in a child run as the cases
    are. None when the report came, else what happened (then a clean run proves nothing)."""
    src = os.path.join(ASAN_BUILD, "planted_read.cpp")
    lib = os.path.join(ASAN_BUILD, "planted_read.so")
    os.makedirs(ASAN_BUILD, exist_ok=True)
    with open(src, "w") as f:
        f.write('extern "C" float read_past(const float* p, long n) { return p[n]; }\n')
    subprocess.run([os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O0",
                    "-fsanitize=address", src, "-o", lib], check=True)
    code = ("import ctypes, torch\n"
            "t = torch.ones(16)\n"
            f"f = ctypes.CDLL({lib!r}).read_past\n"
            "f.restype = ctypes.c_float\n"
            "print(f(ctypes.c_void_p(t.data_ptr()), 16))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(True), timeout=300)
    out = res.stdout + res.stderr
    if res.returncode != 0 and ASAN_REPORT in out:
        return None
    return f"exit status {res.returncode}, no report: {_tail(out)}"


def _setup_module():
    # setup.py by path (it runs setup() only as __main__): its CPU capability builds.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fusedres_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_asan_extension(jobs: int | None = None, verbose: bool = True) -> str:
    """fusedres._C (csrc/module.cpp, csrc/cpu) compiled with -fsanitize=address into
    build/asan-ext/_C.so; objects rebuilt when a source or header under csrc/ changed. The CPU
    kernels (csrc/cpu/vec/) for the baseline and for the capability the regular build runs here
    (the one the fuzzed calls take; setup.py compiles every capability), as setup.py compiles
    them."""
    import glob
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    from fusedres.ops import _extension

    os.makedirs(ASAN_BUILD, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    defines, builds = _setup_module().cpu_capability_builds(only=_extension.cpu_capability())
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp"))
                     + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    groups = [("", sources, [])] + [
        (f"{name}_", [os.path.join(ROOT, p) for p in srcs], flags) for name, srcs, flags in builds]
    headers = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)
    newest = max(os.path.getmtime(p) for p in headers)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = ["-std=c++20", "-O1", "-g1", "-fPIC", "-fsanitize=address", "-fno-omit-frame-pointer",
              "-fopenmp", "-Wno-unknown-pragmas", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
              f"-I{sysconfig.get_paths()['include']}", *defines]
    cflags += [f"-I{p}" for p in cpp_extension.include_paths()]

    from tools.cuda_tsan import compile_objects

    # Linked in this order, the capabilities after the rest, lowest first (setup.py's rule:
    # cpu_capability_builds).
    objects, any_stale = [], False
    for prefix, group, flags in groups:
        stale = []
        for src in group:
            obj = os.path.join(ASAN_BUILD, prefix + os.path.relpath(src, os.path.join(ROOT, "csrc"))
                               .replace(os.sep, "_").replace(".cpp", ".o"))
            objects.append(obj)
            if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src),
                                                                      newest):
                stale.append((src, obj))
        compile_objects(cxx, cflags + flags, stale, jobs, verbose, "asan-ext")
        any_stale = any_stale or bool(stale)
    if any_stale or not os.path.exists(ASAN_EXTENSION):
        libs = cpp_extension.library_paths()
        res = subprocess.run([cxx, "-shared", *objects, "-o", ASAN_EXTENSION,
                              "-fsanitize=address", "-fopenmp",
                              *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
                              "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking {ASAN_EXTENSION} failed:\n{res.stderr[-4000:]}")
    return ASAN_EXTENSION


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.opfuzz", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--asan", action="store_true",
                   help="the fusedres_cpu ops against fusedres._C built with AddressSanitizer")
    p.add_argument("--namespace", action="append", help="only these namespaces")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.asan:
        build_asan_extension()
        print(f"asan-ext: built in {time.perf_counter() - start:.0f} s", flush=True)
        missed = asan_catches_a_planted_read()
        if missed is not None:
            print(f"FAIL: AddressSanitizer missed a planted out-of-bounds read ({missed})")
            return 1
        print("asan-ext: a planted out-of-bounds read is reported", flush=True)
    _setup()
    namespaces = args.namespace or (["fusedres_cpu"] if args.asan else None)
    ops = [o for o in op_names() if namespaces is None or o.split("::")[0] in namespaces]
    table = cases(ops)
    results = run(table, asan=args.asan, jobs=args.jobs)
    ids = [c.id for c in table] + [f"{op}:valid" for op in ops]
    bad = {i: failure(i, results.get(i)) for i in ids}
    bad = {i: why for i, why in bad.items() if why}
    for i, why in bad.items():
        print(f"FAIL {i}: {why}")
    print(f"opfuzz{' (asan)' if args.asan else ''}: {len(ops)} ops, {len(table)} cases, "
          f"{len(bad)} failed, {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
