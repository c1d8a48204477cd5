"""The Triton backend's ops: the ops of fusedres.ops.opdefs under their names, and the
``fusedres_triton`` triton_ops they run.

The backend's entry points (what the public ops route to) go through ops of the
``fusedres_triton`` namespace defined with ``torch.library.triton_op``: in a graph that
torch.compile traces on a GPU, their bodies' launches are recorded through ``wrap_triton``
(``kernels._common.launcher`` wraps only while tracing) and Inductor sees the Triton kernels
themselves (:data:`CompiledUnit`, the unit a traced graph runs). Under ``TRITON_INTERPRET=1``
(CPU tensors) the ops run eagerly; they cannot be traced with fake tensors there, so
torch.compile is tested through the other backends' ops.
"""

import torch
from torch import Tensor

from ...kernels.batch_stats import batch_stats as _batch_stats
from ...kernels.batch_stats import prepare_batch_norm as _prepare_batch_norm
from ...kernels.reductions import scale_shift
from ...ops import direct_unit
from ...ops.checks import check_op_args
from ...ops.opdefs import SCHEMAS, BackwardArgs, UnitArgs, arg_names, python_signature
from .. import portable
from .plans import backward_with, forward_portable_case, launch_forward, portable_case

# --------------------------------------------------------------------------- triton ops
# The schemas of fusedres.ops.opdefs; the bodies launch the kernels through kernels._common.launcher
# (wrap_triton while a graph is traced, the kernel itself in eager code).

# The devices the triton ops take x on. kernels/jit_spec.capturing adds "meta" while it records
# a step's launches (its recorder stands in for every launch: no kernel reads a meta tensor).
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")


def _triton_op(op: str):
    """``torch.library.triton_op("fusedres_triton::<op>")`` with the schema of SCHEMAS. The
    function also carries that schema as its Python signature: torch 2.11 infers the schema
    from the signature whatever ``schema=`` says (and ``*inputs`` cannot be inferred)."""
    x_at = arg_names(op).index("x")

    def register(fn):
        def checked(*args):  # every argument first: the ops' contract (fusedres.ops.checks)
            check_op_args(op, args, f"fusedres_triton::{op}", DEVICE_TYPES)
            if args[x_at].numel() == 0:  # an empty batch: nothing to launch (docs/api.md)
                return getattr(portable, op)(*args)
            return fn(*args)

        checked.__name__ = fn.__name__
        checked.__signature__ = python_signature(op)
        return torch.library.triton_op(f"fusedres_triton::{op}", mutates_args=(),
                                       schema=SCHEMAS[op])(checked)
    return register


@_triton_op("batch_stats")
def _batch_stats_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _batch_stats(x)


def _forward(*inputs) -> Tensor:
    return launch_forward(UnitArgs(*inputs), genstats=False, merge=False)


def _forward_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """Forward that also returns (mean, biased var) of y per output channel, reduced in the
    convolution's epilogue."""
    return launch_forward(UnitArgs(*inputs), genstats=True, merge=False)


def _backward(*inputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b = BackwardArgs(*inputs)
    return backward_with(b, *scale_shift(b))


# The same three bodies as triton_ops (what torch.compile traces, CompiledUnit below); the eager
# route (EagerTritonUnit) launches through the same plans.
_forward_op = _triton_op("bn_relu_conv2d")(_forward)
_forward_genstats_op = _triton_op("bn_relu_conv2d_genstats")(_forward_genstats)
_backward_op = _triton_op("bn_relu_conv2d_backward")(_backward)

# --------------------------------------------------------------------------- backend interface
# The ops of fusedres.ops.opdefs under their names; cases the kernels leave to the portable code
# (plans.portable_case, plans.forward_portable_case) go there.

def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    if portable_case(x):
        return portable.batch_stats(x)
    return torch.ops.fusedres_triton.batch_stats(x)


# prepare_batch_norm(x, *bn[2:], mean=None, var=None) -> (mean, invstd), bn a BatchNormArgs:
# fusedres.functional.prepare's statistics, running-statistics update and invstd in one or two
# launches (kernels/batch_stats.py's, with no layer here) instead of its ~10 PyTorch ops. Eager
# tensors only (fusedres.ops._backend.route); plans.prepares says which.
prepare_batch_norm = _prepare_batch_norm


def bn_relu_conv2d(*inputs) -> Tensor:
    if forward_portable_case(UnitArgs(*inputs)):
        return portable.bn_relu_conv2d(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d(*inputs)


def bn_relu_conv2d_genstats(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """``bn_relu_conv2d`` plus the (mean, biased var) of its output per channel, in the
    statistics dtype of y: what the next unit's BatchNorm needs, without a pass over y."""
    if forward_portable_case(UnitArgs(*inputs)):
        return portable.bn_relu_conv2d_genstats(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d_genstats(*inputs)


def bn_relu_conv2d_backward(*inputs) -> tuple[Tensor, ...]:
    b = BackwardArgs(*inputs)
    if portable_case(b.grad_out, b.x, b.weight):
        return portable.bn_relu_conv2d_backward(*inputs)
    return torch.ops.fusedres_triton.bn_relu_conv2d_backward(*inputs)


# The fused unit over the fusedres_triton ops, for graphs that torch.compile traces on a GPU
# (fusedres.functional routes there): the public fusedres ops are opaque to Inductor, these
# triton_ops decompose into their Triton kernels, forward and backward.
CompiledUnit = direct_unit("CompiledUnit", torch.ops.fusedres_triton.bn_relu_conv2d,
                           torch.ops.fusedres_triton.bn_relu_conv2d_genstats,
                           torch.ops.fusedres_triton.bn_relu_conv2d_backward)


def compiled_unit(args: UnitArgs, genstats: bool, affine=None):
    """:data:`CompiledUnit` on ``args``, or the public op for the cases the kernels leave to the
    portable code."""
    if forward_portable_case(args):
        op = (torch.ops.fusedres.bn_relu_conv2d_genstats if genstats
              else torch.ops.fusedres.bn_relu_conv2d)
        return op(*args)
    return CompiledUnit.apply(*args, genstats)


def compiled_batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """``batch_stats`` through the triton_op, for traced graphs (see :data:`CompiledUnit`)."""
    if portable_case(x):
        return tuple(torch.ops.fusedres.batch_stats(x))
    return tuple(torch.ops.fusedres_triton.batch_stats(x))

