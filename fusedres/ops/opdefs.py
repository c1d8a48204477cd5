"""The fused ops' signatures, and the rules every backend shares: defined once, here.

:data:`SCHEMAS` is the one definition of each op's signature. Every registration is made from
it: the public ``fusedres::`` custom ops (:mod:`fusedres.ops`), the C++ kernels' namespaces
``fusedres_cpu::`` and ``fusedres_cuda::`` (:func:`define_namespace`, called by
:mod:`fusedres.ops._extension` right after ``fusedres._C`` loads: csrc/ registers implementations
only, and the dispatcher checks each C++ function against the schema it implements then), and
the Triton backend's ``fusedres_triton::`` triton_ops. A backend implements the ops under the
same names with the same arguments.

Above the op layer the arguments travel as named tuples built from the same table
(:class:`UnitArgs`, :class:`BackwardArgs`), so no caller reads them by position, and a
BatchNorm travels as one value, :class:`BatchNormArgs`;
:func:`bind` names the arguments of an op call seen by a dispatch mode.

The shared rules: :func:`stats_dtype`, :func:`conv_out_size`, :func:`out_shape`,
:func:`out_memory_format`, :func:`scale_shift`, :func:`backward_outputs`.
"""

from __future__ import annotations

import inspect
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["NAMESPACE_SCHEMAS", "SCHEMAS", "BackwardArgs", "BatchNormArgs", "ConvGeometry",
           "UnitArgs", "arg_names",
           "backward_outputs", "bind", "conv_out_size", "define_namespace", "out_memory_format",
           "out_shape", "python_signature", "scale_shift", "stats_dtype",
           "suggests_channels_last"]

# The fused unit's inputs (shared/design.md): the BatchNorm's input, the convolution, the
# BatchNorm's affine and statistics (mean, 1/sqrt(var + eps)), the residual, the conv geometry,
# and whether the statistics are this batch's (then the backward differentiates through them);
# last, the per-sample factor of the conv branch (stochastic depth / drop-path): (N,), one
# factor per sample, applied in the accumulator dtype (float32 for half operands); no gradient.
_UNIT = ("Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, "
         "Tensor mean, Tensor invstd, Tensor? residual, SymInt[2] stride, SymInt[2] padding, "
         "SymInt[2] dilation, bool batch_stats, Tensor? branch_scale=None")

class BatchNormArgs(NamedTuple):
    """A BatchNorm as the fused calls take it: ``nn.BatchNorm2d``'s parameters, running
    statistics and settings, under its attribute names, in the order of the eager ops'
    schemas (:data:`NAMESPACE_SCHEMAS`: ``module_unit(x, weight, bias, *bn, residual, stride,
    padding, dilation)``, ``prepare_batch_norm(x, *bn[2:], mean, var)``; the triton
    backend's ``prepare_affine(x, *bn, mean, var)``). The ops' schemas keep the tensors loose
    (a schema takes no struct); Python passes this one value and unpacks it into the call.
    ``weight``, ``bias``: (C,) or None (``affine=False``); ``running_mean``, ``running_var``:
    (C,), both or neither; ``num_batches_tracked``: one integer element or None; ``momentum``
    None: the cumulative average."""

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    training: bool
    momentum: float | None
    eps: float


SCHEMAS: dict[str, str] = {
    # Per-channel batch mean and biased variance over (N, H, W), in the statistics dtype.
    "batch_stats": "(Tensor x) -> (Tensor, Tensor)",
    # y = residual + branch_scale[n] * (conv2d(relu(scale * x + shift), weight) + bias).
    "bn_relu_conv2d": f"({_UNIT}) -> Tensor",
    # The same y and its per-channel (mean, biased var): what the next BatchNorm needs.
    "bn_relu_conv2d_genstats": f"({_UNIT}) -> (Tensor, Tensor, Tensor)",
    # (grad_x, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias), recomputing the
    # activation from x; an output whose output_mask entry is False is empty. The conv branch's
    # incoming gradient is branch_scale[n] * grad_out[n] (the residual's gradient is grad_out).
    "bn_relu_conv2d_backward": (
        "(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, "
        "Tensor mean, Tensor invstd, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, "
        "bool batch_stats, bool[5] output_mask, Tensor? branch_scale=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"),
}


# The eager routes' ops, which the C++ backends (fusedres_cpu, fusedres_cuda) define beyond
# SCHEMAS with the same signatures, from one C++ layer (csrc/eager.h):
# eager_unit: bn_relu_conv2d with its autograd rule as a C++ node, then genstats: (y, mean of y,
# biased var of y), the statistics empty unless genstats (fusedres.ops.eager_unit_of).
# prepare_batch_norm: nn.BatchNorm2d's statistics and running-stats update in one call, (mean,
# invstd) (fusedres.functional.prepare_batch_norm).
# module_unit: prepare_batch_norm then eager_unit, a BNReLUConv2d's forward in one call: [y], or
# [] (nothing touched) for arguments it leaves to the Python checks (fusedres.ops._backend).
# eager_pair: two convolutions of one BN-ReLU (a pre-activation unit's projection shortcut and
# first convolution) as one C++ autograd node saving x once: (y, y2, mean of y2, biased var of
# y2), the statistics empty unless genstats; no residual, no branch scale.
_EAGER_SCHEMAS: dict[str, str] = {
    "eager_unit": f"({_UNIT}, bool genstats=False) -> (Tensor, Tensor, Tensor)",
    "prepare_batch_norm": (
        "(Tensor x, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
        "Tensor(c!)? num_batches_tracked, bool training, float? momentum, float eps, "
        "Tensor? mean=None, Tensor? var=None) -> (Tensor, Tensor)"),
    "module_unit": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, "
        "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
        "bool training, float? momentum, float eps, Tensor? residual, SymInt[2] stride, "
        "SymInt[2] padding, SymInt[2] dilation) -> Tensor[]"),
    "eager_pair": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor weight2, Tensor? bias2, "
        "Tensor? bn_weight, Tensor? bn_bias, Tensor mean, Tensor invstd, SymInt[2] stride, "
        "SymInt[2] padding, SymInt[2] dilation, SymInt[2] stride2, SymInt[2] padding2, "
        "SymInt[2] dilation2, bool batch_stats, bool genstats) "
        "-> (Tensor, Tensor, Tensor, Tensor)"),
}

# Ops that one C++ namespace defines beyond SCHEMAS, used by that backend's own routes only.
# fusedres_cpu::bn_relu_conv2d_pair: two convolutions of one BN-ReLU (a pre-activation unit's
# projection shortcut and first convolution), the activation computed once per tile:
# (y, y2, mean of y2, biased var of y2), the statistics empty unless stats2.
# fusedres_cpu::bn_relu_conv2d_pair_backward: their backward in one pass over x:
# (grad_x, grad_weight, grad_bias, grad_weight2, grad_bias2, grad_bn_weight, grad_bn_bias);
# output_mask: x, both weights, both biases, bn_weight, bn_bias (the cpu eager_pair's kernels).
NAMESPACE_SCHEMAS: dict[str, dict[str, str]] = {
    "fusedres_cpu": {
        **_EAGER_SCHEMAS,
        "bn_relu_conv2d_pair": (
            "(Tensor x, Tensor weight, Tensor? bias, Tensor weight2, Tensor? bias2, "
            "Tensor? bn_weight, Tensor? bn_bias, Tensor mean, Tensor invstd, SymInt[2] stride, "
            "SymInt[2] padding, SymInt[2] dilation, SymInt[2] stride2, SymInt[2] padding2, "
            "SymInt[2] dilation2, bool stats2) -> (Tensor, Tensor, Tensor, Tensor)"),
        "bn_relu_conv2d_pair_backward": (
            "(Tensor grad_out, Tensor grad_out2, Tensor x, Tensor weight, Tensor weight2, "
            "Tensor? bn_weight, Tensor? bn_bias, Tensor mean, Tensor invstd, SymInt[2] stride, "
            "SymInt[2] padding, SymInt[2] dilation, SymInt[2] stride2, SymInt[2] padding2, "
            "SymInt[2] dilation2, bool batch_stats, bool[5] output_mask) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"),
        # eager_unit with x handed on for a pre-activation unit's identity shortcut (the next
        # unit's residual): (y, x as a view, mean of y, biased var of y), no residual, no branch
        # scale; x's two gradients summed in bn_relu_conv2d_backward_add's pass
        # (fusedres.ops._backend: the cpu record's unit_with_shortcut).
        "eager_unit_with_shortcut": (
            f"({_UNIT.replace('Tensor x,', 'Tensor(a) x,', 1)}, bool genstats=False) "
            "-> (Tensor, Tensor(a), Tensor, Tensor)"),
        # bn_relu_conv2d_backward with grad_x_add (x's shape) added to grad_x in its pass:
        # the gradient a pre-activation unit's identity shortcut brings to x.
        "bn_relu_conv2d_backward_add": (
            "(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, "
            "Tensor mean, Tensor invstd, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, "
            "bool batch_stats, bool[5] output_mask, Tensor? branch_scale, Tensor grad_x_add) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"),
    },
    "fusedres_cuda": dict(_EAGER_SCHEMAS),
}


def _arguments(op: str) -> list[tuple[str, str | None]]:
    """(name, default as written in the schema, or None) for each argument of ``op``."""
    inner = SCHEMAS[op].split(") ->")[0].lstrip("(")
    out = []
    for arg in inner.split(","):
        decl, _, default = arg.partition("=")
        out.append((decl.split()[-1], default.strip() or None))
    return out


def arg_names(op: str) -> tuple[str, ...]:
    """The argument names of ``op`` (a key of :data:`SCHEMAS`), in order."""
    return tuple(name for name, _ in _arguments(op))


def _defaults(op: str) -> tuple:
    """The Python defaults of ``op``'s trailing arguments that have one (``None`` only)."""
    defaults = [d for _, d in _arguments(op) if d is not None]
    if any(d != "None" for d in defaults):
        raise NotImplementedError(f"{op}: only None defaults are supported, got {defaults}")
    return (None,) * len(defaults)


class UnitArgs(namedtuple("UnitArgs", arg_names("bn_relu_conv2d"),
                          defaults=_defaults("bn_relu_conv2d"))):
    """The inputs of ``bn_relu_conv2d`` (and ``_genstats``) by name, in schema order:
    ``op(*args)`` calls the op."""

    __slots__ = ()

    @property
    def geometry(self) -> ConvGeometry:
        return ConvGeometry(tuple(self.stride), tuple(self.padding), tuple(self.dilation))


class BackwardArgs(namedtuple("BackwardArgs", arg_names("bn_relu_conv2d_backward"),
                              defaults=_defaults("bn_relu_conv2d_backward"))):
    """The inputs of ``bn_relu_conv2d_backward`` by name, in schema order."""

    __slots__ = ()

    @property
    def geometry(self) -> ConvGeometry:
        return ConvGeometry(tuple(self.stride), tuple(self.padding), tuple(self.dilation))


class ConvGeometry(NamedTuple):
    """A convolution's stride, padding and dilation, each a pair of ints."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    def out_hw(self, h: int, w: int, kh: int, kw: int) -> tuple[int, int]:
        """The output's (height, width) for an input of h x w and a kh x kw kernel."""
        return (conv_out_size(h, kh, self.stride[0], self.padding[0], self.dilation[0]),
                conv_out_size(w, kw, self.stride[1], self.padding[1], self.dilation[1]))


_ARG_NAMES = {op: arg_names(op) for op in SCHEMAS}


def bind(func: Any, args: tuple, kwargs: dict | None = None) -> dict[str, Any] | None:
    """The arguments of a call of one of the fused ops (any namespace; an OpOverload as a
    dispatch mode sees it) by name; None for any other function."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    namespace, _, name = schema.name.partition("::")
    if not namespace.startswith("fusedres") or name not in _ARG_NAMES:
        return None
    bound = dict(zip(_ARG_NAMES[name], args))
    bound.update(kwargs or {})
    return bound


# The Python annotation of each schema type torch's schema inference reads back as that type.
_ANNOTATIONS = {"Tensor": Tensor, "Optional[Tensor]": Optional[Tensor], "int": int,
                "List[int]": Sequence[int], "bool": bool, "List[bool]": Sequence[bool],
                "float": float, "Optional[float]": Optional[float]}


def python_signature(op: str) -> inspect.Signature:
    """``op``'s schema (a key of :data:`SCHEMAS`) as an annotated Python signature: what
    ``torch.library.triton_op`` infers a schema from on torch releases that do not take
    ``schema=`` (2.11 reads only the function's annotations). The inferred schema differs from
    SCHEMAS only in list sizes (``SymInt[2]`` reads back as ``SymInt[]``)."""
    parsed = torch._C.parse_schema(f"fusedres::{op}{SCHEMAS[op]}")

    def annotation(t) -> Any:
        try:
            return _ANNOTATIONS[str(t)]
        except KeyError:
            raise NotImplementedError(f"{op}: no Python annotation for schema type {t}") from None

    params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=annotation(a.type),
                                default=a.default_value if a.has_default_value()
                                else inspect.Parameter.empty)
              for a in parsed.arguments]
    returns = [annotation(r.type) for r in parsed.returns]
    ret = returns[0] if len(returns) == 1 else tuple.__class_getitem__(tuple(returns))
    return inspect.Signature(params, return_annotation=ret)


def define_namespace(namespace: str) -> torch.library.Library:
    """Define every op of :data:`SCHEMAS` in ``namespace``, and the namespace's own ops of
    :data:`NAMESPACE_SCHEMAS` (no implementation): the C++
    extension registers its kernels against these definitions. Keep the returned library
    alive for as long as the ops are used."""
    lib = torch.library.Library(namespace, "DEF")
    for name, schema in {**SCHEMAS, **NAMESPACE_SCHEMAS.get(namespace, {})}.items():
        lib.define(name + schema)
    return lib


# --------------------------------------------------------------------------- shared rules

_HALF = (torch.float16, torch.bfloat16)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of BN statistics and of the normalisation arithmetic for inputs of ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


def conv_out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    """One spatial dimension of a convolution's output (``nn.Conv2d``'s formula)."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def out_shape(x: Tensor, weight: Tensor, stride, padding, dilation) -> tuple[int, ...]:
    """(N, Co, Ho, Wo) of the fused op's output."""
    n, _, h, w = x.shape
    co, _, kh, kw = weight.shape
    return (n, co, *ConvGeometry(stride, padding, dilation).out_hw(h, w, kh, kw))


def suggests_channels_last(t: Tensor) -> bool:
    """channels_last-dense and not also plain-contiguous (csrc/common.h's rule): the layout the
    kernels walk ``t`` in."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def out_memory_format(x: Tensor, weight: Tensor) -> torch.memory_format:
    """Layout of the op's output: channels_last when ``x`` or ``weight`` is, as conv2d does.

    Every backend returns exactly this layout so that real and fake kernels agree on strides
    (the C++ kernels' copy of the rule is csrc/common.h's; opcheck compares them).
    """
    if suggests_channels_last(x) or suggests_channels_last(weight):
        return torch.channels_last
    return torch.contiguous_format


def scale_shift(bn) -> tuple[Tensor, Tensor]:
    """Per-channel affine of the fused BatchNorm, ``bn(x) = scale * x + shift``, for ``bn``:
    anything with ``bn_weight``, ``bn_bias``, ``mean`` and ``invstd`` (:class:`UnitArgs`,
    :class:`BackwardArgs`, :class:`fusedres.functional.BatchNormState`)."""
    scale = bn.invstd if bn.bn_weight is None else bn.bn_weight * bn.invstd
    shift = -bn.mean * scale if bn.bn_bias is None else bn.bn_bias - bn.mean * scale
    return scale, shift


def backward_outputs(x: Tensor, weight: Tensor, mean: Tensor,
                     output_mask) -> tuple[Tensor, ...]:
    """The backward's outputs, allocated with the exact metadata every backend returns: an
    output whose ``output_mask`` entry is False is empty (0 elements)."""
    co, c = weight.shape[0], x.shape[1]
    want_x, want_w, want_b, want_g, want_beta = output_mask
    return (
        torch.empty_like(x) if want_x else x.new_empty((0,)),
        torch.empty_like(weight) if want_w else weight.new_empty((0,)),
        weight.new_empty((co,)) if want_b else weight.new_empty((0,)),
        mean.new_empty((c,)) if want_g else mean.new_empty((0,)),
        mean.new_empty((c,)) if want_beta else mean.new_empty((0,)),
    )
