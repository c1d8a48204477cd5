"""The fused unit's training-step launches for the model, through tools/jit_spec.py: each
launch captured from the Triton backend's entry points on meta tensors and specialised as
Triton's JIT specialises it (jit_spec.capturing / specialise), compiled with
jit_spec.compile_launch (registers and spills from ptxas's log, disk cache).

What this module adds: a ``TorchDispatchMode`` entered around the step's calls (jit_spec's
``during``, once the inputs exist) that records every PyTorch op the host side runs between the
kernels (``HostOp``: reductions of partials, per-channel vectors), which the model counts as one
DRAM-bound launch each; and the argument values of a launch by name (trip counts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedres.models.unit_shapes import ConvUnit

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# aten ops that launch no kernel (allocation, views, metadata).
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view",
              "as_strided", "detach", "t", "transpose", "permute", "expand", "alias",
              "unsqueeze", "squeeze", "select", "slice", "reshape", "lift_fresh",
              "promote_types", "result_type"}


@dataclass
class HostOp:
    """A PyTorch op the host side runs between the kernels: one launch moving ``bytes``
    (inputs + outputs)."""

    name: str
    bytes: int


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class _HostOps(TorchDispatchMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            # The backend's own ops (torch.library triton_ops): their Python implementation
            # runs here with the mode back on, so the aten ops inside are what is counted.
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        same_dtype_copy = (name == "_to_copy" and args and isinstance(args[0], torch.Tensor)
                           and isinstance(out, torch.Tensor) and args[0].dtype == out.dtype)
        # An op that hands back its input (``to`` the same dtype, ``contiguous`` of a
        # contiguous tensor) launches nothing.
        passthrough = bool(args) and out is args[0] and not name.endswith("_")
        if name not in _NO_KERNEL and not same_dtype_copy and not passthrough:
            self.sink.append(HostOp(name, _tensor_bytes(args) + _tensor_bytes(out)))
        return out


def _require_compiler_mode() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("tools.perfmodel: TRITON_INTERPRET=1 is set; the kernels must be "
                           "compiled, run it in a process with TRITON_INTERPRET=0")


def unit_step(unit: ConvUnit, dtype: str, *, arch: int, sms: int, training: bool = True,
              tf32: bool = True, backward: str = "sums"):
    """(launches, host ops) of one training step (forward + backward, channels_last) of the
    fused unit through the Triton backend's entry points (jit_spec.unit_launches: batch
    statistics, forward, backward with the gradients of x, the weight and the BatchNorm
    affine), the host ops recorded around the step's calls. ``launches``: jit_spec.Launch,
    specialised for sm_``arch`` with ``sms`` SMs."""
    _require_compiler_mode()
    from .. import jit_spec

    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    host: list[HostOp] = []
    launches = jit_spec.unit_launches(unit, dtype, arch=arch, tf32=tf32, sm_count=sms,
                                      training=training, backward=backward,
                                      during=lambda: _HostOps(host))
    return launches, host

def params(launch) -> dict:
    """A jit_spec.Launch's argument values by name (ints as launched)."""
    values = dict(zip(launch.fn.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items()
                   if k not in ("num_warps", "num_stages")})
    return values
