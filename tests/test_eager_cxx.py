"""The eager routes' C++ layer (csrc/eager.h) on both C++ backends: ``module_unit``,
``prepare_batch_norm``, ``eager_unit`` and ``eager_pair`` of ``fusedres_cpu`` and
``fusedres_cuda`` (here the cuda backend's kernels run on CPU tensors through the host layer:
FUSEDRES_CUDA_ON_CPU=1, tests/conftest.py), each against the route it replaces: the public ops
``torch.ops.fusedres.*`` with their Python autograd rule, after the Python rule of
``fusedres.functional.prepare_batch_norm``. The kernels are the same on both routes, so every
output, gradient, running statistic and count must be the same bits (torch.equal). Tiny shapes:
the host layer runs a CUDA thread as a fibre."""

from __future__ import annotations

import copy

import pytest
import torch

import fusedres
from fusedres import functional as FR
from fusedres.backends import cpu as cpu_backend
from fusedres.backends import cuda as cuda_backend
from fusedres.ops.opdefs import UnitArgs

BACKENDS = {"cpu": cpu_backend, "cuda": cuda_backend}
NODE = {"cpu": "EagerCpu", "cuda": "EagerCuda"}
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _backend(name):
    why = fusedres.unavailable_reason(name, "cpu")
    if why is not None:
        pytest.skip(f"the {name} backend does not run on CPU tensors here: {why}")
    module = BACKENDS[name]
    if module.module_unit is None:
        pytest.skip(f"{module.NAMESPACE} has no eager ops here")
    return module


@pytest.fixture(params=["cpu", "cuda"])
def name(request):
    _backend(request.param)
    return request.param


@pytest.fixture
def python_prepare(monkeypatch):
    """fusedres.functional.prepare_batch_norm's Python rule on every backend (the C++ backends'
    preparation switched off in their routes): batch_stats, ~10 ATen ops, torch.rsqrt."""
    from fusedres.ops import _backend

    for name in ("cpu", "cuda"):
        monkeypatch.setitem(_backend.TABLE, name,
                            _backend.load(name)._replace(prepare_batch_norm=None))


def _sdt(dtype):
    return F32 if dtype in (F16, BF16) else dtype


def _bn(c, dtype, *, affine=True, track=True, momentum=0.1, seed=1):
    bn = torch.nn.BatchNorm2d(c, momentum=momentum, affine=affine, track_running_stats=track,
                              dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if affine:
            bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
            bn.bias.copy_(torch.randn(c, generator=g))
        if track:
            bn.running_mean.copy_(torch.randn(c, generator=g))
            bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            bn.num_batches_tracked.fill_(5)
    return bn


def _x(shape, dtype, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g, dtype=F64) * 2 + 0.7).to(dtype)
    return x.contiguous(memory_format=torch.channels_last if channels_last else
                        torch.contiguous_format)


def _buffers(bn):
    return [bn.running_mean, bn.running_var, bn.num_batches_tracked]


def _equal(a, b, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (what, (a - b).abs().max())


def _grads(outputs, inputs, seed=7):
    """Gradients of sum(out * g) for fixed random g, for the inputs that require grad."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype) for o in outputs]
    wrt = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(outputs, wrt, grads)


# --------------------------------------------------------------------------- prepare_batch_norm

# (x dtype, running-statistics dtype): x's own dtype, the statistics dtype beside a 16-bit x, and
# one that the cuda kernels leave to ATen ops (float64 running statistics beside float32 x).
PREPARE_DTYPES = [(F32, F32), (F64, F64), (F16, F32), (F16, F16), (BF16, BF16), (F32, F64)]


@pytest.mark.parametrize("x_dtype,rs_dtype", PREPARE_DTYPES,
                         ids=[f"{a}-{b}".replace("torch.", "") for a, b in PREPARE_DTYPES])
@pytest.mark.parametrize("mode", ["train", "train_cumulative", "train_given", "eval",
                                  "untracked", "untracked_given"])
def test_prepare_batch_norm_is_the_python_rule(name, python_prepare, x_dtype, rs_dtype, mode):
    """(mean, invstd), running_mean, running_var and num_batches_tracked bit for bit as the
    Python rule computes them on that backend (the cuda one: batch_stats's partials kernel and
    one finalize kernel that also updates the running statistics, each product and sum rounded
    as ATen's separate ops round them); the running statistics' version counters bumped once
    each, as the in-place ops bump them; a given mean copied, never aliased."""
    backend = _backend(name)
    c = 11
    x = _x((3, c, 5, 4), x_dtype, channels_last=mode == "train")
    momentum = None if mode == "train_cumulative" else 0.3
    bn = _bn(c, rs_dtype, track=not mode.startswith("untracked"), momentum=momentum)
    training = mode != "eval"
    given = None
    if mode.endswith("given"):
        var, mean = torch.var_mean(x.to(_sdt(x_dtype)), dim=(0, 2, 3), correction=0)
        given = (mean, var)
    new, old = copy.deepcopy(bn), copy.deepcopy(bn)
    tracked = new.running_mean is not None
    versions = [t._version for t in _buffers(new)] if tracked else None
    mean, invstd = backend.prepare_batch_norm(
        x, new.running_mean, new.running_var, new.num_batches_tracked, training, momentum,
        1e-3, *(given or (None, None)))
    with fusedres.use_backend(name):
        state = FR.prepare_batch_norm(x, old.weight, old.bias, old.running_mean,
                                      old.running_var, old.num_batches_tracked,
                                      training=training, momentum=momentum, eps=1e-3,
                                      stats=given)
    _equal(mean, state.mean, "mean")
    _equal(invstd, state.invstd, "invstd")
    for a, b, what in zip(_buffers(new), _buffers(old), ("running_mean", "running_var", "nbt")):
        _equal(a, b, what)
    if given is not None:
        assert mean.data_ptr() != given[0].data_ptr()
    if tracked:
        assert mean.data_ptr() != new.running_mean.data_ptr()
        moved = [t._version > v for t, v in zip(_buffers(new), versions)]
        assert moved == [training] * 3, moved
        assert int(new.num_batches_tracked) == 5 + training


def test_prepare_batch_norm_inputs_tell_a_separate_rounding_from_a_fused_one(name,
                                                                           python_prepare):
    """The sensitivity of the bit-for-bit checks above: on these inputs the update rounded once
    (rm * (1 - f) + mean * f in float64, then float32: what one FMA-contracted expression
    computes) differs from ATen's separately rounded ops in some channel, so a kernel that let
    the compiler contract its update would fail them."""
    backend = _backend(name)
    c = 11
    x = _x((3, c, 5, 4), F32)
    bn = _bn(c, F32, momentum=0.3)
    rm0 = bn.running_mean.clone()
    mean, _ = backend.prepare_batch_norm(x, bn.running_mean, bn.running_var,
                                         bn.num_batches_tracked, True, 0.3, 1e-3, None, None)
    fused = (rm0.double() * 0.7 + mean.double() * 0.3).float()
    separate = rm0.mul(1 - 0.3).add(mean * 0.3)
    assert torch.equal(bn.running_mean, separate)
    assert not torch.equal(fused, separate)


def test_prepare_batch_norm_takes_strided_running_statistics(name, python_prepare):
    """Running statistics that are views with a stride (the cuda kernels write dense vectors
    only: the ATen route takes these) are updated in place, the same bits."""
    backend = _backend(name)
    c = 6
    x = _x((2, c, 3, 3), F32)
    store = torch.randn(2 * c), torch.rand(2 * c) + 0.5
    rm, rv = store[0][::2], store[1][::2]
    rm0, rv0 = rm.clone(), rv.clone()
    nbt = torch.tensor(2)
    mean, invstd = backend.prepare_batch_norm(x, rm, rv, nbt, True, None, 1e-5, None, None)
    with fusedres.use_backend(name):
        state = FR.prepare_batch_norm(x, None, None, rm0, rv0, torch.tensor(2), training=True,
                                      momentum=None, eps=1e-5)
    _equal(mean, state.mean)
    _equal(invstd, state.invstd)
    _equal(rm, rm0)
    _equal(rv, rv0)
    assert int(nbt) == 3


@pytest.mark.parametrize("bad,message", [
    ("running_var_shape", "running_var"), ("momentum_none_no_count", "num_batches_tracked"),
    ("given_mean_dtype", "mean"), ("one_value", "more than 1 value per channel"),
    ("one_running", "running_mean, running_var")])
def test_prepare_batch_norm_errors_name_the_argument_and_touch_nothing(name, bad, message):
    backend = _backend(name)
    c = 4
    x = _x((1 if bad == "one_value" else 2, c, 1 if bad == "one_value" else 3, 1), F32)
    rm, rv, nbt = torch.zeros(c), torch.ones(c), torch.tensor(3)
    momentum, given = 0.1, (None, None)
    if bad == "running_var_shape":
        rv = torch.ones(c + 1)
    elif bad == "momentum_none_no_count":
        momentum, nbt = None, None
    elif bad == "given_mean_dtype":
        given = (torch.zeros(c, dtype=F64), torch.ones(c))
    elif bad == "one_running":
        rv = None
    before = [t.clone() for t in (rm, rv, nbt) if t is not None]
    with pytest.raises((ValueError, TypeError), match=message):
        backend.prepare_batch_norm(x, rm, rv, nbt, True, momentum, 1e-5, *given)
    for a, b in zip([t for t in (rm, rv, nbt) if t is not None], before):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ module_unit

# (id, x dtype, BatchNorm dtype, training, momentum, bias, residual, affine, track, channels_last)
MODULE_CASES = [
    ("train", F32, F32, True, 0.1, False, False, True, True, False),
    ("train-cl-bias-res", F32, F32, True, 0.1, True, True, True, True, True),
    ("train-cumulative-res", F32, F32, True, None, False, True, True, True, False),
    ("eval-bias", F32, F32, False, 0.1, True, False, True, True, False),
    ("eval-cl-res", F32, F32, False, 0.1, False, True, True, True, True),
    ("no-affine", F32, F32, True, 0.1, True, False, False, True, False),
    ("untracked", F32, F32, True, 0.1, False, True, True, False, False),
    ("untracked-eval-cl", F32, F32, False, 0.1, False, False, True, False, True),
    ("f64-cumulative", F64, F64, True, None, True, True, True, True, False),
    ("f64-eval-cl", F64, F64, False, 0.1, False, True, True, True, True),
    ("f16", F16, F16, True, 0.1, True, True, True, True, False),
    ("f16-bn32-cl", F16, F32, True, None, False, False, True, True, True),
    ("bf16-eval", BF16, BF16, False, 0.1, False, True, True, True, False),
]
HALF_IDS = {c[0] for c in MODULE_CASES if c[1] in (F16, BF16)}


def _module(c, co, dtype, bn_dtype, *, stride, bias, momentum, affine, track):
    torch.manual_seed(3)
    m = fusedres.BNReLUConv2d(c, co, 3, stride=stride, padding=1, bias=bias, momentum=momentum,
                              affine=affine, track_running_stats=track, dtype=dtype)
    m.bn = _bn(c, bn_dtype, affine=affine, track=track, momentum=momentum)
    return m


def _reference_unit(name, m, x, residual):
    """The public-op route a module's forward replaces: the Python prepare (its rule, not a
    C++ call), then torch.ops.fusedres.bn_relu_conv2d and its Python autograd rule."""
    bn, conv = m.bn, m.conv
    with fusedres.use_backend(name):
        state = FR.prepare_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                      bn.num_batches_tracked, training=bn.training,
                                      momentum=bn.momentum, eps=bn.eps)
        return torch.ops.fusedres.bn_relu_conv2d(
            x, conv.weight, conv.bias, state.bn_weight, state.bn_bias, state.mean, state.invstd,
            residual, conv.stride, conv.padding, conv.dilation, state.batch_stats)


@pytest.mark.parametrize("case", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module_unit_is_the_public_route(name, python_prepare, case):
    """module_unit (a BNReLUConv2d's forward in one call: prepare_batch_norm, then the unit's
    C++ node) against the Python prepare and the public op: y, the gradients of x, the
    residual, the weight, bias and BatchNorm parameters, and the running statistics and count,
    bit for bit; y's grad_fn is the backend's C++ node."""
    cid, dtype, bn_dtype, training, momentum, bias, res, affine, track, cl = case
    if name == "cpu" and cid in HALF_IDS:
        pytest.skip("fusedres_cpu::module_unit takes float32 and float64 x")
    backend = _backend(name)
    c, co, stride = 3, 4, (2, 1)
    m = _module(c, co, dtype, bn_dtype, stride=stride, bias=bias, momentum=momentum,
                affine=affine, track=track).train(training)
    m_ref = copy.deepcopy(m)
    x = _x((2, c, 6, 5), dtype, channels_last=cl).requires_grad_()
    residual = None
    if res:
        residual = _x((2, co, 3, 5), dtype, channels_last=cl, seed=4).requires_grad_()
    out = backend.module_unit(x, m.conv.weight, m.conv.bias, m.bn.weight, m.bn.bias,
                              m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked,
                              training, momentum, m.bn.eps, residual, m.conv.stride,
                              m.conv.padding, m.conv.dilation)
    assert len(out) == 1
    (y,) = out
    assert "CppNode" in y.grad_fn.name() and f"{NODE[name]}Unit" in y.grad_fn.name()
    y_ref = _reference_unit(name, m_ref, x, residual)
    _equal(y, y_ref, "y")
    grads = _grads([y], [x, residual, *m.parameters()])
    with fusedres.use_backend(name):  # the public backward op routes by the backend in force
        grads_ref = _grads([y_ref], [x, residual, *m_ref.parameters()])
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        _equal(g, g_ref, "gradient")
    if track:
        for a, b in zip(_buffers(m.bn), _buffers(m_ref.bn)):
            _equal(a, b, "running statistics")


def test_module_unit_without_grad_runs_the_forward_alone(name, python_prepare):
    backend = _backend(name)
    m = _module(3, 4, F32, F32, stride=1, bias=True, momentum=0.1, affine=True, track=True)
    m_ref = copy.deepcopy(m)
    x = _x((2, 3, 4, 4), F32)
    with torch.no_grad():
        (y,) = backend.module_unit(x, m.conv.weight, m.conv.bias, m.bn.weight, m.bn.bias,
                                   m.bn.running_mean, m.bn.running_var,
                                   m.bn.num_batches_tracked, True, 0.1, m.bn.eps, None,
                                   m.conv.stride, m.conv.padding, m.conv.dilation)
        y_ref = _reference_unit(name, m_ref, x, None)
    assert y.grad_fn is None
    _equal(y, y_ref)
    with torch.inference_mode():
        x_inf = x.clone()
        (y_inf,) = backend.module_unit(x_inf, m.conv.weight, m.conv.bias, m.bn.weight,
                                       m.bn.bias, None, None, None, False, 0.1, m.bn.eps, None,
                                       m.conv.stride, m.conv.padding, m.conv.dilation)
    assert y_inf.shape == y.shape


def _refused(name, how):
    """Arguments module_unit does not run (it leaves them to the Python route or refuses
    them); a dict of the call's arguments, changed as `how` says."""
    c, co = 3, 4
    m = _module(c, co, F32, F32, stride=1, bias=True, momentum=0.1, affine=True, track=True)
    a = dict(x=_x((2, c, 4, 4), F32), weight=m.conv.weight, bias=m.conv.bias,
             bn_weight=m.bn.weight, bn_bias=m.bn.bias, running_mean=m.bn.running_mean,
             running_var=m.bn.running_var, num_batches_tracked=m.bn.num_batches_tracked,
             training=True, momentum=0.1, eps=1e-5, residual=None, stride=(1, 1),
             padding=(1, 1), dilation=(1, 1))
    if how == "weight dtype":
        a["weight"] = a["weight"].double()
    elif how == "grouped weight":
        a["weight"] = a["weight"][:, :1].contiguous()
    elif how == "bn_weight shape":
        a["bn_weight"] = torch.ones(c + 1)
    elif how == "residual shape":
        a["residual"] = torch.zeros(2, co, 3, 3)
    elif how == "residual dtype":
        a["residual"] = torch.zeros(2, co, 4, 4, dtype=F64)
    elif how == "momentum None, no count":
        a["momentum"], a["num_batches_tracked"] = None, None
    elif how == "one value a channel":
        a["x"] = _x((1, c, 1, 1), F32)
        a["padding"] = (1, 1)
    elif how == "kernel larger than x":
        a["padding"] = (0, 0)
        a["x"] = _x((2, c, 2, 2), F32)
    elif how == "running_var missing":
        a["running_var"] = None
    elif how == "int x":
        a["x"] = a["x"].to(torch.int32)
    elif how == "half x on cpu":
        a["x"] = a["x"].half()
        a["weight"] = a["weight"].half()
        a["bias"] = a["bias"].half()
    elif how == "meta x":
        a["x"] = a["x"].to("meta")
    elif how == "bias dtype":
        a["bias"] = a["bias"].double()
    elif how == "strided stride":
        a["stride"] = (0, 1)
    return a


# Well-formed arguments the one call does not take (a dtype pairing the Python route casts or
# promotes, autocast, half x on the cpu backend): [] with nothing touched.
LEFT = ["weight dtype", "residual dtype", "half x on cpu", "bias dtype", "autocast"]
# Malformed arguments, which no route takes: refused by module_unit itself (csrc/checks.h's
# check_module_args), naming the argument, before anything is touched.
MALFORMED = {"grouped weight": (ValueError, "weight: expected shape .* to match the 3 channels"),
             "bn_weight shape": (ValueError, r"bn_weight: expected shape \(3,\)"),
             "residual shape": (ValueError, "residual: expected shape"),
             "momentum None, no count": (ValueError, "num_batches_tracked: required"),
             "one value a channel": (ValueError, "x: expected more than 1 value per channel"),
             "kernel larger than x": (ValueError, "x: spatial size .* is too small"),
             "running_var missing": (ValueError, "running_mean, running_var: give both"),
             "int x": (TypeError, "x: expected float16, bfloat16, float32 or float64"),
             "meta x": (ValueError, "x: expected a (CPU|cpu) tensor, got device meta"),
             "strided stride": (ValueError, r"stride: expected values in \[1, 2\^31\)")}


def _untouched(a):
    """A check that the running statistics, count and version counters of ``a`` are as now."""
    kept = [t.clone() for t in (a["running_mean"], a["running_var"]) if t is not None]
    versions = [t._version for t in (a["running_mean"], a["running_var"]) if t is not None]
    nbt = a["num_batches_tracked"]
    count = None if nbt is None else int(nbt)

    def check():
        now = [t for t in (a["running_mean"], a["running_var"]) if t is not None]
        assert all(torch.equal(t, k) for t, k in zip(now, kept))
        assert [t._version for t in now] == versions
        assert count is None or int(nbt) == count
    return check


@pytest.mark.parametrize("how", LEFT)
def test_module_unit_leaves_what_it_does_not_take_and_touches_nothing(name, how):
    """Well-formed arguments the conservative predicate does not take: [] and the running
    statistics, count and version counters untouched (the Python route then runs them)."""
    if how == "half x on cpu" and name == "cuda":
        pytest.skip("the cuda backend takes half x")
    backend = _backend(name)
    a = _refused(name, "autocast" if how == "autocast" else how)
    untouched = _untouched(a)
    if how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = backend.module_unit(*a.values())
    else:
        out = backend.module_unit(*a.values())
    assert out == []
    untouched()


@pytest.mark.parametrize("how", sorted(MALFORMED))
def test_module_unit_refuses_malformed_arguments_by_name_and_touches_nothing(name, how):
    if how == "meta x" and name == "cuda":
        pytest.skip("the dispatcher takes a meta x to the Meta key: this copy registers its "
                    "module_unit for its own device's keys")
    backend = _backend(name)
    a = _refused(name, how)
    untouched = _untouched(a)
    exc, match = MALFORMED[how]
    with pytest.raises(exc, match=match):
        backend.module_unit(*a.values())
    untouched()


# ------------------------------------------------------------------------------- eager_unit

# (id, x dtype, batch_stats, genstats, bias, residual, affine, branch_scale, channels_last)
UNIT_CASES = [
    ("train", F32, True, False, True, True, True, False, False),
    ("train-genstats-cl", F32, True, True, False, False, True, False, True),
    ("eval-genstats", F32, False, True, True, False, False, False, False),
    ("branch-scale", F32, True, False, False, True, True, True, False),
    ("f64-genstats", F64, True, True, True, True, True, False, False),
    ("f64-eval-cl", F64, False, False, False, True, True, False, True),
    ("f16-genstats", F16, True, True, True, False, True, False, True),
]


@pytest.mark.parametrize("case", UNIT_CASES, ids=[c[0] for c in UNIT_CASES])
def test_eager_unit_is_the_public_op(name, case):
    """eager_unit (the unit's C++ autograd node) against the public op (and its genstats form):
    y, y's statistics and every gradient, bit for bit."""
    cid, dtype, batch_stats, genstats, bias, res, affine, bscale, cl = case
    backend = _backend(name)
    if name == "cpu" and dtype == F16:
        pytest.skip("the cpu backend's half units are covered by its own tests")
    n, c, co = 2, 5, 3
    sdt = _sdt(dtype)
    g = torch.Generator().manual_seed(9)
    x = _x((n, c, 5, 6), dtype, channels_last=cl).requires_grad_()
    w = (torch.randn(co, c, 3, 3, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(co, generator=g).to(dtype).requires_grad_() if bias else None
    gamma = (torch.rand(c, generator=g) + 0.5).to(sdt).requires_grad_() if affine else None
    beta = torch.randn(c, generator=g).to(sdt).requires_grad_() if affine else None
    mean = torch.randn(c, generator=g).to(sdt)
    invstd = (torch.rand(c, generator=g) + 0.5).to(sdt)
    r = _x((n, co, 3, 6), dtype, seed=5).requires_grad_() if res else None
    s = torch.tensor([0.0, 1.25], dtype=sdt) if bscale else None
    args = UnitArgs(x, w, b, gamma, beta, mean, invstd, r, (2, 1), (1, 1), (1, 1), batch_stats,
                    s)
    y, ym, yv = backend.eager_unit_op(*args, genstats)
    assert f"{NODE[name]}Unit" in y.grad_fn.name()
    with fusedres.use_backend(name):
        if genstats:
            y_ref, ym_ref, yv_ref = torch.ops.fusedres.bn_relu_conv2d_genstats(*args)
            _equal(ym, ym_ref, "mean of y")
            _equal(yv, yv_ref, "var of y")
        else:
            y_ref = torch.ops.fusedres.bn_relu_conv2d(*args)
            assert ym.numel() == 0 and yv.numel() == 0
        _equal(y, y_ref, "y")
        wrt = [x, w, b, gamma, beta, r]
        for a, b_ in zip(_grads([y], wrt), _grads([y_ref], wrt)):
            _equal(a, b_)


# ------------------------------------------------------------------------------- eager_pair

def _pair_inputs(dtype, *, bias, bias2, affine, cl, seed=11):
    n, c, co, co2 = 2, 4, 5, 3
    sdt = _sdt(dtype)
    g = torch.Generator().manual_seed(seed)
    x = _x((n, c, 6, 5), dtype, channels_last=cl).requires_grad_()
    w = (torch.randn(co, c, 1, 1, generator=g) * 0.4).to(dtype).requires_grad_()
    w2 = (torch.randn(co2, c, 3, 3, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(co, generator=g).to(dtype).requires_grad_() if bias else None
    b2 = torch.randn(co2, generator=g).to(dtype).requires_grad_() if bias2 else None
    gamma = (torch.rand(c, generator=g) + 0.5).to(sdt).requires_grad_() if affine else None
    beta = torch.randn(c, generator=g).to(sdt).requires_grad_() if affine else None
    mean = torch.randn(c, generator=g).to(sdt)
    invstd = (torch.rand(c, generator=g) + 0.5).to(sdt)
    geometry, geometry2 = ((2, 2), (0, 0), (1, 1)), ((2, 2), (1, 1), (1, 1))
    return x, w, b, w2, b2, gamma, beta, mean, invstd, geometry, geometry2


# (id, x dtype, batch_stats, genstats, bias, bias2, affine, channels_last)
PAIR_CASES = [
    ("train", F32, True, False, False, False, True, False),
    ("train-genstats-bias-cl", F32, True, True, True, False, True, True),
    ("eval-no-affine", F32, False, False, False, True, False, False),
    ("f64-genstats", F64, True, True, True, True, True, False),
    ("f16-eval-cl", F16, False, True, False, False, True, True),
]


@pytest.mark.parametrize("case", PAIR_CASES, ids=[c[0] for c in PAIR_CASES])
def test_eager_pair_is_two_units(name, case):
    """eager_pair (two convolutions of one BN-ReLU, one C++ node) against two public-op units
    whose gradients of x and of the BatchNorm parameters autograd sums: on the cuda backend the
    same kernels (two forward and two backward calls), so the same bits; on the cpu backend the
    pair kernels (one recompute and one pass over x for both), so equal to rounding, and bit for
    bit those kernels called directly (what the Python node it replaced ran)."""
    cid, dtype, batch_stats, genstats, bias, bias2, affine, cl = case
    backend = _backend(name)
    if name == "cpu" and dtype == F16:
        pytest.skip("the cpu pair kernels are covered in float32/float64")
    inp = _pair_inputs(dtype, bias=bias, bias2=bias2, affine=affine, cl=cl)
    x, w, b, w2, b2, gamma, beta, mean, invstd, geo, geo2 = inp
    y, y2, m2, v2 = backend.eager_pair(x, w, b, w2, b2, gamma, beta, mean, invstd, *geo, *geo2,
                                       batch_stats, genstats)
    assert f"{NODE[name]}Pair" in y.grad_fn.name() and y.grad_fn is y2.grad_fn
    wrt = [x, w, b, w2, b2, gamma, beta]
    grads = _grads([y, y2], wrt)
    with fusedres.use_backend(name):
        y_ref = torch.ops.fusedres.bn_relu_conv2d(x, w, b, gamma, beta, mean, invstd, None, *geo,
                                                  batch_stats)
        if genstats:
            y2_ref, m2_ref, v2_ref = torch.ops.fusedres.bn_relu_conv2d_genstats(
                x, w2, b2, gamma, beta, mean, invstd, None, *geo2, batch_stats)
        else:
            y2_ref = torch.ops.fusedres.bn_relu_conv2d(x, w2, b2, gamma, beta, mean, invstd,
                                                       None, *geo2, batch_stats)
        grads_ref = _grads([y_ref, y2_ref], wrt)
    if not genstats:
        assert m2.numel() == 0 and v2.numel() == 0
    if name == "cuda":
        _equal(y, y_ref, "y")
        _equal(y2, y2_ref, "y2")
        if genstats:
            _equal(m2, m2_ref, "mean of y2")
            _equal(v2, v2_ref, "var of y2")
        for a, b_ in zip(grads, grads_ref):
            _equal(a, b_)
        return
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y2, y2_ref, **tol)
    for a, b_ in zip(grads, grads_ref):
        torch.testing.assert_close(a, b_, **tol)
    gen = torch.Generator().manual_seed(7)  # _grads's
    gy, gy2 = (torch.randn(t.shape, generator=gen, dtype=F64).to(t.dtype) for t in (y, y2))
    ref = _pair_by_kernels(inp, batch_stats, genstats, gy, gy2, (True,) * 7)
    _equal(y, ref[0])
    _equal(y2, ref[1])
    if genstats:
        _equal(m2, ref[2])
        _equal(v2, ref[3])
    for a, b_ in zip(grads, [g for g, t in zip(ref[4], wrt) if t is not None]):
        _equal(a, b_)


def _pair_by_kernels(inp, batch_stats, genstats, gy, gy2, need):
    """The cpu pair's kernels called directly, as its node runs them on a plain gradient: the
    forward (fusedres_cpu::bn_relu_conv2d_pair) and the backward of the inputs ``need`` asks
    for (x, weight, bias, weight2, bias2, bn_weight, bn_bias) in one pass over x
    (fusedres_cpu::bn_relu_conv2d_pair_backward): (y, y2, mean2, var2, gradients by input,
    None where not asked)."""
    x, w, b, w2, b2, gamma, beta, mean, invstd, geo, geo2 = inp
    cpu = torch.ops.fusedres_cpu
    d = [t.detach() if t is not None else None for t in (x, w, b, w2, b2, gamma, beta)]
    y, y2, m2, v2 = cpu.bn_relu_conv2d_pair(d[0], d[1], d[2], d[3], d[4], d[5], d[6], mean,
                                            invstd, *geo, *geo2, genstats)
    mask = [need[0], need[1] or need[3], (need[2] and b is not None) or (
        need[4] and b2 is not None), need[5] and gamma is not None, need[6] and beta is not None]
    gx, gw, gb, gw2, gb2, gg, gbeta = cpu.bn_relu_conv2d_pair_backward(
        gy, gy2, d[0], d[1], d[3], d[5], d[6], mean, invstd, *geo, *geo2, batch_stats, mask)
    by_input = [gx, gw, gb, gw2, gb2, gg, gbeta]
    present = [True, True, b is not None, True, b2 is not None, gamma is not None,
               beta is not None]
    return y, y2, m2, v2, [g if n and p else None
                           for g, n, p in zip(by_input, need, present)]


PAIR_WANTED = {"all": (0, 1, 2, 3, 4, 5, 6), "x": (0,), "weight2": (3,), "bn": (5, 6)}


@pytest.mark.parametrize("wanted", list(PAIR_WANTED))
def test_eager_pair_gradients_by_input_and_when_not_bare(name, wanted):
    """A node asked for some of its inputs' gradients gives exactly those: on the cpu backend
    its pair kernels' bits; on the cuda one, each convolution's backward asked for its own
    gradients only and the shared ones summed (the kernels' output mask changes their path: with
    batch statistics the data gradient differs in the last bit with and without the weight
    gradient, and a C++ node asks for what this backward needs where a Python autograd.Function
    asks for every input that requires grad), equal to rounding to the public route. A backward
    that builds a graph (create_graph=True) runs the public backward op once per convolution:
    the two public units' bits."""
    backend = _backend(name)
    inp = _pair_inputs(F64, bias=True, bias2=True, affine=True, cl=False)
    x, w, b, w2, b2, gamma, beta, mean, invstd, geo, geo2 = inp
    inputs = [x, w, b, w2, b2, gamma, beta]
    wrt = [inputs[i] for i in PAIR_WANTED[wanted]]
    y, y2, _, _ = backend.eager_pair(x, w, b, w2, b2, gamma, beta, mean, invstd, *geo, *geo2,
                                     True, False)
    gen = torch.Generator().manual_seed(2)
    gy = torch.randn(y.shape, generator=gen, dtype=F64)
    gy2 = torch.randn(y2.shape, generator=gen, dtype=F64)
    with fusedres.use_backend(name):  # the public ops route by the backend in force
        out = [torch.ops.fusedres.bn_relu_conv2d(x, w_, b_, gamma, beta, mean, invstd, None,
                                                 *g_, True)
               for w_, b_, g_ in ((w, b, geo), (w2, b2, geo2))]
        need = [i in PAIR_WANTED[wanted] for i in range(7)]
        for create_graph in (False, True):
            got = torch.autograd.grad([y, y2], wrt, [gy, gy2], retain_graph=True,
                                      create_graph=create_graph)
            if name == "cpu" and not create_graph:  # its kernels, as the node runs them
                ref = [g for g in _pair_by_kernels(inp, True, False, gy, gy2, need)[4]
                       if g is not None]
            else:  # two public-op units (the cpu node's route with create_graph too)
                ref = torch.autograd.grad(list(out), wrt, [gy, gy2], retain_graph=True,
                                          create_graph=create_graph)
            for a, b_ in zip(got, ref, strict=True):
                if name == "cpu" or wanted == "all":
                    _equal(a.detach(), b_.detach())
                else:
                    torch.testing.assert_close(a, b_, rtol=1e-13, atol=1e-13)
    if name != "cuda" or wanted == "all":
        return
    # The cuda node's gradients are its backward kernel's, each convolution asked for its own.
    want = [i in PAIR_WANTED[wanted] for i in range(7)]
    kernel = torch.ops.fusedres_cuda.bn_relu_conv2d_backward
    r1 = kernel(gy, x, w, gamma, beta, mean, invstd, *geo, True,
                [want[0], want[1], want[2], want[5], want[6]])
    r2 = kernel(gy2, x, w2, gamma, beta, mean, invstd, *geo2, True,
                [want[0], want[3], want[4], want[5], want[6]])
    by_input = [r1[0] + r2[0], r1[1], r1[2], r2[1], r2[2], r1[3] + r2[3], r1[4] + r2[4]]
    for a, i in zip(got, PAIR_WANTED[wanted]):
        _equal(a.detach(), by_input[i])


# ----------------------------------------------------------------- eager_unit_with_shortcut

@pytest.mark.parametrize("use", ["both", "y only", "shortcut only", "create_graph"])
@pytest.mark.parametrize("genstats", [False, True])
def test_eager_unit_with_shortcut_is_its_kernels(use, genstats):
    """fusedres_cpu::eager_unit_with_shortcut (the unit handing x on as a view for the next
    unit's residual, one C++ node) against its kernels called directly, as the node runs them
    on a plain gradient (and the public ops with create_graph=True): y, y's statistics and every
    gradient bit for bit, x's two gradients summed in the backward's pass
    (bn_relu_conv2d_backward_add) when both outputs take one; the returned x a view of x that
    refuses in-place changes."""
    backend = _backend("cpu")
    if backend.eager_unit_with_shortcut is None:
        pytest.skip("fusedres_cpu has no eager_unit_with_shortcut")
    c, co = 4, 4
    g = torch.Generator().manual_seed(13)
    x = _x((2, c, 5, 5), F64).requires_grad_()
    w = (torch.randn(co, c, 3, 3, generator=g, dtype=F64) * 0.3).requires_grad_()
    b = torch.randn(co, generator=g, dtype=F64).requires_grad_()
    gamma = (torch.rand(c, generator=g, dtype=F64) + 0.5).requires_grad_()
    beta = torch.randn(c, generator=g, dtype=F64).requires_grad_()
    mean = torch.randn(c, generator=g, dtype=F64)
    invstd = torch.rand(c, generator=g, dtype=F64) + 0.5
    args = UnitArgs(x, w, b, gamma, beta, mean, invstd, None, (1, 1), (1, 1), (1, 1), True)
    y, short, ym, yv = backend.eager_unit_with_shortcut(*args, genstats)
    assert "EagerCpuUnitWithShortcut" in y.grad_fn.name() and short.grad_fn is y.grad_fn
    assert short._base is x and torch.equal(short, x)
    with pytest.raises(RuntimeError, match="view"):
        short.add_(1)
    plain = UnitArgs(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    cpu = torch.ops.fusedres_cpu
    y_ref, ym_ref, yv_ref = (cpu.bn_relu_conv2d_genstats(*plain) if genstats
                             else (cpu.bn_relu_conv2d(*plain), None, None))
    _equal(y, y_ref)
    if genstats:
        _equal(ym, ym_ref)
        _equal(yv, yv_ref)
    else:
        assert ym.numel() == 0 and yv.numel() == 0
    gen = torch.Generator().manual_seed(3)
    gy = torch.randn(y.shape, generator=gen, dtype=F64)
    gs = torch.randn(x.shape, generator=gen, dtype=F64)
    wrt = [x, w, b, gamma, beta]
    outs, gouts = {"both": ([y, short], [gy, gs]), "y only": ([y], [gy]),
                   "shortcut only": ([short], [gs]), "create_graph": ([y, short], [gy, gs])}[use]
    with fusedres.use_backend("cpu"):  # the public backward op routes by the backend in force
        got = torch.autograd.grad(outs, wrt, gouts, allow_unused=True,
                                  create_graph=use == "create_graph")
        bwd = (plain.x, plain.weight, plain.bn_weight, plain.bn_bias, mean, invstd,
               (1, 1), (1, 1), (1, 1), True, [True] * 5)
        if use == "shortcut only":
            ref = [gs, None, None, None, None]
        elif use == "both":
            ref = list(cpu.bn_relu_conv2d_backward_add(gy, *bwd, None, gs))
        elif use == "y only":
            ref = list(cpu.bn_relu_conv2d_backward(gy, *bwd))
        else:  # a graph built: the public backward op, x's two gradients summed by autograd
            ref = list(torch.ops.fusedres.bn_relu_conv2d_backward(gy, *bwd))
            ref[0] = ref[0] + gs
    for a, b_ in zip(got, ref, strict=True):
        _equal(None if a is None else a.detach(), None if b_ is None else b_.detach())


# ----------------------------------------------------------------- checkpointing

@pytest.mark.parametrize("kind", ["unit", "identity block", "projection block"])
def test_nodes_recompute_under_checkpoint(name, kind):
    """torch.utils.checkpoint (non-reentrant) of a module on the eager route: the backward of
    a C++ node unpacks its saved tensors, which recomputes the forward, before it runs its
    kernels below autograd (recomputed under that guard, the nodes saved nothing: "a different
    number of tensors was saved"); the gradients equal the module's without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from fusedres.modules import BasicBlock

    _backend(name)
    torch.manual_seed(0)
    m = (fusedres.BNReLUConv2d(4, 4, 3, padding=1) if kind == "unit"
         else BasicBlock(4, 4 if kind == "identity block" else 6)).double()
    m_ref = copy.deepcopy(m)
    x = _x((2, 4, 5, 5), F64).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    with fusedres.use_backend(name):
        checkpoint(m, x, use_reentrant=False).square().sum().backward()
        m_ref(x_ref).square().sum().backward()
    for a, b in zip([x.grad, *[p.grad for p in m.parameters()]],
                    [x_ref.grad, *[p.grad for p in m_ref.parameters()]]):
        _equal(a, b)


@pytest.mark.parametrize("used", ["y", "y2"])
def test_eager_pair_with_one_output_used(name, used):
    """Only one convolution's output takes a gradient (the node materialises none for the
    other, nor for the statistics): x's and the BatchNorm parameters' gradients are that
    convolution's unit's, and the other convolution's weight and bias get none, as autograd
    gives two separate units."""
    backend = _backend(name)
    inp = _pair_inputs(F64, bias=True, bias2=True, affine=True, cl=False)
    x, w, b, w2, b2, gamma, beta, mean, invstd, geo, geo2 = inp
    wrt = [x, w, b, w2, b2, gamma, beta]
    y, y2, _, _ = backend.eager_pair(x, w, b, w2, b2, gamma, beta, mean, invstd, *geo, *geo2,
                                     True, True)
    out = y if used == "y" else y2
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    got = torch.autograd.grad(out, wrt, g, allow_unused=True)
    with fusedres.use_backend(name):
        ww, bb, gg = (w, b, geo) if used == "y" else (w2, b2, geo2)
        ref_out = torch.ops.fusedres.bn_relu_conv2d(x, ww, bb, gamma, beta, mean, invstd, None,
                                                    *gg, True)
        ref = torch.autograd.grad(ref_out, wrt, g, allow_unused=True)
    for i, (a, r) in enumerate(zip(got, ref, strict=True)):
        assert (a is None) == (r is None), i
        if a is not None:
            torch.testing.assert_close(a, r, rtol=1e-13, atol=1e-13)
    unused = (3, 4) if used == "y" else (1, 2)
    assert all(got[i] is None for i in unused)
