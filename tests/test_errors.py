"""Bad input: a clear error naming the argument, raised before running statistics change."""

import pytest
import torch
import torch.nn as nn

import fusedres
from fusedres import functional as FR

C, CO = 4, 6


def _inference(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an inference tensor (made in inference mode, used outside it)."""
    with torch.inference_mode():
        return t.clone()


def _good():
    return dict(
        x=torch.randn(2, C, 7, 7), weight=torch.randn(CO, C, 3, 3), bias=torch.randn(CO),
        bn_weight=torch.rand(C), bn_bias=torch.randn(C), running_mean=torch.zeros(C),
        running_var=torch.ones(C), num_batches_tracked=torch.tensor(0),
        training=True, padding=1, residual=torch.randn(2, CO, 7, 7),
    )


BAD = [
    ("x_rank", dict(x=torch.randn(2, C, 7)), ValueError, "x: expected a 4-D"),
    ("x_dtype", dict(x=torch.randint(0, 3, (2, C, 7, 7))), TypeError, "x: expected float"),
    ("weight_channels", dict(weight=torch.randn(CO, C + 1, 3, 3)), ValueError,
     r"weight: expected shape \(out_channels, 4"),
    ("weight_grouped", dict(weight=torch.randn(CO, C // 2, 3, 3)), ValueError, "groups=1"),
    ("weight_rank", dict(weight=torch.randn(CO, C)), ValueError, "weight: expected a 4-D"),
    ("weight_dtype", dict(weight=torch.randn(CO, C, 3, 3, dtype=torch.float64)), TypeError,
     "weight: expected dtype torch.float32"),
    ("bias_shape", dict(bias=torch.randn(CO + 1)), ValueError, r"bias: expected shape \(6,\)"),
    ("bn_weight_shape", dict(bn_weight=torch.rand(C + 1)), ValueError,
     r"bn_weight: expected shape \(4,\)"),
    ("bn_bias_shape", dict(bn_bias=torch.rand(C - 1)), ValueError, "bn_bias: expected shape"),
    ("running_mean_shape", dict(running_mean=torch.zeros(C + 2)), ValueError,
     "running_mean: expected shape"),
    ("running_var_shape", dict(running_var=torch.ones(1)), ValueError,
     "running_var: expected shape"),
    ("running_var_missing", dict(running_var=None), ValueError, "running_mean, running_var"),
    ("residual_shape", dict(residual=torch.randn(2, CO, 8, 7)), ValueError,
     r"residual: expected shape \(2, 6, 7, 7\)"),
    ("residual_channels", dict(residual=torch.randn(2, C, 7, 7)), ValueError, "residual"),
    ("one_value_per_channel", dict(x=torch.randn(1, C, 1, 1), padding=0,
                                   weight=torch.randn(CO, C, 1, 1),
                                   residual=torch.randn(1, CO, 1, 1)),
     ValueError, "more than 1 value per channel"),
    ("stride_zero", dict(stride=0), ValueError, r"stride: expected values in \[1, 2\^31\)"),
    ("padding_negative", dict(padding=-1), ValueError, "padding"),
    ("padding_string", dict(padding="full"), ValueError, "padding: expected an int"),
    ("padding_same_strided", dict(padding="same", stride=2, residual=None), ValueError,
     "'same' needs stride 1"),
    ("padding_same_uneven", dict(padding="same", weight=torch.randn(CO, C, 2, 2)), ValueError,
     "pads unevenly"),
    ("dilation_triple", dict(dilation=(1, 1, 1)), ValueError, "dilation"),
    ("kernel_too_big", dict(weight=torch.randn(CO, C, 11, 11), padding=0, residual=None),
     ValueError, "too small"),
    ("cumulative_without_count", dict(num_batches_tracked=None), ValueError,
     "num_batches_tracked: required", {"momentum": None}),
    ("bn_weight_not_tensor", dict(bn_weight=[1.0] * C), TypeError, "bn_weight: expected a Tensor"),
    # Once refused only after the running statistics had changed, or not at all (issue 38).
    ("padding_2^31", dict(padding=2**31), ValueError, r"padding: expected values in \[0, 2\^31\)"),
    ("padding_2^30", dict(padding=2**30), ValueError, "padding: x's height 7 padded by"),
    ("dilation_2^30", dict(dilation=2**30), ValueError,
     "dilation: a kernel of 3 taps dilated by"),
    ("running_var_expanded", dict(running_var=torch.ones(1).expand(C)), ValueError,
     "running_var: expected a tensor whose elements do not share memory"),
    ("running_var_is_running_mean", dict(running_var="running_mean"), ValueError,
     "running_var: expected memory of its own"),
    ("running_mean_requires_grad", dict(running_mean=torch.zeros(C, requires_grad=True)),
     ValueError, "running_mean: expected a buffer that does not require grad"),
    ("running_var_requires_grad", dict(running_var=torch.ones(C, requires_grad=True)),
     ValueError, "running_var: expected a buffer that does not require grad"),
    ("eps_zero", {}, ValueError, r"eps: expected a value > 0 in training", {"eps": 0.0}),
    ("eps_negative_eval", dict(training=False), ValueError, "eps: expected a value >= 0",
     {"eps": -1e-5}),
    ("eps_nan", {}, ValueError, "eps: expected a value > 0", {"eps": float("nan")}),
    ("count_float", dict(num_batches_tracked=torch.tensor(0.0)), TypeError,
     "num_batches_tracked: expected an integer tensor"),
    ("count_two", dict(num_batches_tracked=torch.tensor([0, 0])), ValueError,
     "num_batches_tracked: expected one element"),
    # Refused by the C++ routes first; the portable route updated the buffers before them
    # (num_batches_tracked, running_mean), then raised (issue 48).
    ("running_mean_inference", dict(running_mean=_inference(torch.zeros(C))), RuntimeError,
     "running_mean: an inference tensor cannot be updated in place outside InferenceMode"),
    ("running_var_inference", dict(running_var=_inference(torch.ones(C))), RuntimeError,
     "running_var: an inference tensor cannot be updated in place outside InferenceMode"),
    ("count_inference", dict(num_batches_tracked=_inference(torch.tensor(0))), RuntimeError,
     "num_batches_tracked: an inference tensor cannot be updated in place"),
    ("weight_no_output_channel", dict(weight=torch.randn(0, C, 3, 3), bias=None, residual=None),
     ValueError, r"weight: expected at least one output channel \(as conv2d\)"),
]

# The cases issue 38 found refused late or not at all; every backend runs them (below).
LATE = ["padding_2^31", "padding_2^30", "dilation_2^30", "running_var_expanded",
        "running_var_is_running_mean", "running_mean_requires_grad", "running_var_requires_grad",
        "eps_zero", "eps_negative_eval", "eps_nan", "count_float", "count_two",
        "running_mean_inference", "running_var_inference", "count_inference"]


def _bad_args(change: dict) -> dict:
    args = _good()
    args.update(change)
    if args["running_var"] == "running_mean":  # the same tensor for both
        args["running_var"] = args["running_mean"]
    return args


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_argument_and_leaves_state(bad):
    _, change, exc, pattern, *extra = bad
    args = _bad_args(change)
    kwargs = extra[0] if extra else {}
    rm, rv, nbt = args["running_mean"], args["running_var"], args["num_batches_tracked"]
    before = [t.detach().clone() if t is not None else None for t in (rm, rv, nbt)]
    with pytest.raises(exc, match=pattern):
        FR.bn_relu_conv2d(
            args["x"], args["weight"], args["bias"], args["bn_weight"], args["bn_bias"], rm, rv,
            nbt, training=args["training"], padding=args["padding"],
            stride=args.get("stride", 1), dilation=args.get("dilation", 1),
            residual=args["residual"], **kwargs)
    for t, b in zip((rm, rv, nbt), before):
        if t is not None:
            assert torch.equal(t, b), "running statistics changed before the error"


@pytest.mark.parametrize("name", LATE)
def test_late_refusals_come_first_on_every_backend_and_route(backend, name):
    """Issue 38's cases through the public API on every backend: the functional call and the
    module (whose one-call route, fusedres.ops._backend's module_unit, runs first where a
    backend has one): the error names the argument, no running statistic or count changes."""
    _, change, exc, pattern, *extra = next(b for b in BAD if b[0] == name)
    kwargs = extra[0] if extra else {}
    args = _bad_args(change)
    m = fusedres.BNReLUConv2d(C, CO, 3, stride=args.get("stride", 1),
                              padding=args["padding"], dilation=args.get("dilation", 1),
                              eps=kwargs.get("eps", 1e-5))
    m.train(args["training"])
    with torch.no_grad():
        m.conv.weight.copy_(args["weight"])
    for buffer in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(m.bn, buffer, args[buffer])
    state = [t.detach().clone() for t in (args["running_mean"], args["running_var"],
                                          args["num_batches_tracked"])]
    with pytest.raises(exc, match=pattern):
        m(args["x"], args["residual"])
    for t, b in zip((m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked), state):
        assert torch.equal(t, b), "state changed before the error"


def test_mismatched_devices_named():
    args = _good()
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        FR.bn_relu_conv2d(args["x"], args["weight"].to("meta"), None, None, None, None, None,
                          training=True)
    with pytest.raises(ValueError, match="running_mean: expected device"):
        FR.bn_relu_conv2d(args["x"], args["weight"], None, None, None,
                          args["running_mean"].to("meta"), args["running_var"], training=True)


def _op_args(op: str) -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    args = dict(x=r(2, C, 7, 7), weight=r(CO, C, 3, 3), bias=r(CO), bn_weight=r(C).abs(),
                bn_bias=r(C), mean=r(C), invstd=r(C).abs() + 0.5, residual=r(2, CO, 7, 7),
                stride=[1, 1], padding=[1, 1], dilation=[1, 1], batch_stats=True,
                branch_scale=torch.tensor([1.0, 0.5]))
    if op == "bn_relu_conv2d_backward":
        args = {"grad_out": args.pop("residual"), **args, "output_mask": [True] * 5}
        args["branch_scale"] = args.pop("branch_scale")
        del args["bias"]
    return args


@pytest.mark.parametrize("op, arg", [
    ("bn_relu_conv2d", "weight"), ("bn_relu_conv2d", "mean"), ("bn_relu_conv2d", "residual"),
    ("bn_relu_conv2d", "branch_scale"), ("bn_relu_conv2d_genstats", "bias"),
    ("bn_relu_conv2d_backward", "grad_out"), ("bn_relu_conv2d_backward", "invstd")])
def test_a_meta_argument_of_a_public_op_is_refused_by_name(backend, op, arg):
    """One argument on meta, the others on CPU: the dispatcher picks the op's fake kernel,
    which refused nothing and returned an uninitialised CPU tensor (issue 48); it runs the
    op's checks first now."""
    args = _op_args(op)
    args[arg] = args[arg].to("meta")
    with pytest.raises(ValueError, match=rf"fusedres::{op}: {arg}: expected device cpu \(the "
                                         r"device of x\), got meta"):
        getattr(torch.ops.fusedres, op)(*args.values())


def test_the_fake_kernels_check_every_argument():
    """All on meta (the planner's simulated step): a stride of 0 is refused by name, as on
    CPU, where it divided by zero."""
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
            for k, v in _op_args("bn_relu_conv2d").items()}
    args["stride"] = [0, 0]
    with pytest.raises(ValueError, match=r"stride: expected values in \[1, 2\^31\)"):
        torch.ops.fusedres.bn_relu_conv2d(*args.values())
    args["stride"] = [1, 1]
    assert torch.ops.fusedres.bn_relu_conv2d(*args.values()).shape == (2, CO, 7, 7)


def test_module_wrong_channels_named():
    m = fusedres.BNReLUConv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"to match the 5 channels of x"):
        m(torch.randn(2, 5, 6, 6))
    assert int(m.bn.num_batches_tracked) == 0


@pytest.mark.parametrize("make", [
    lambda: fusedres.PreActBasicBlock(4, 8, stride=2),
    lambda: fusedres.PreActBottleneck(4, 2),
    lambda: fusedres.fuse(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))),
], ids=["basic", "bottleneck", "fused_graph"])
def test_blocks_check_before_running_stats_change(make):
    block = make()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(TypeError, match="weight: expected dtype torch.float64"):
        block(torch.randn(2, 4, 8, 8, dtype=torch.float64))
    for k, v in block.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed before the error"


@pytest.mark.parametrize("stats, exc, match", [
    ((torch.zeros(C + 1), torch.ones(C)), ValueError, r"stats\[0\] \(mean\): expected shape"),
    ((torch.zeros(C), torch.ones(C, dtype=torch.float64)), ValueError,
     r"stats\[1\] \(variance\): expected shape \(4,\), dtype torch.float32"),
    (torch.zeros(C), TypeError, "stats: expected a pair of tensors"),
], ids=["mean_shape", "var_dtype", "not_a_pair"])
def test_bad_precomputed_stats_named_before_state_changes(stats, exc, match):
    g = _good()
    with pytest.raises(exc, match=match):
        FR.prepare_batch_norm(g["x"], g["bn_weight"], g["bn_bias"], g["running_mean"],
                              g["running_var"], g["num_batches_tracked"], training=True,
                              stats=stats)
    assert torch.equal(g["running_mean"], torch.zeros(C))
    assert int(g["num_batches_tracked"]) == 0


def test_precomputed_stats_update_running_stats_as_a_stats_pass(backend):
    g = _good()
    x = g["x"] * 3 + 1
    computed = [t.clone() for t in (g["running_mean"], g["running_var"])]
    FR.prepare_batch_norm(x, g["bn_weight"], g["bn_bias"], *computed, training=True)
    given = [t.clone() for t in (g["running_mean"], g["running_var"])]
    stats = (x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0))
    FR.prepare_batch_norm(x, g["bn_weight"], g["bn_bias"], *given, training=True, stats=stats)
    torch.testing.assert_close(given, computed)
