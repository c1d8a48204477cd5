"""What the kernels need from the Triton they run on, across the supported versions (triton >=
3.6; fusedres/_versions.py says why that floor and how both ends are tested).

Imported by ``kernels/__init__.py``, so before any kernel is defined or launched:

* an older triton is refused with one sentence naming the supported versions (ImportError;
  the triton backend reports it as its reason to be unavailable);
* triton 3.6's interpreter turns a scalar into a Python int with ``int(handle.data)``, and its
  scalars are 1-element 1-d numpy arrays, which numpy >= 2.4 refuses to convert ("only
  0-dimensional arrays can be converted to Python scalars"): every loop whose bound is a kernel
  argument or comes from ``tl.program_id`` failed under ``TRITON_INTERPRET=1``. Triton 3.8
  squeezes the array first; :func:`patch_interpreter_index` gives triton 3.6 the same rule;
* :data:`DOT_MIN_K`: the least K of a ``tl.dot`` per operand bit width for the CUDA target, as
  the installed Triton's own rule says (``min_dot_size``): triton 3.6 asks K >= 16 whatever
  the dtype, triton 3.8 K >= 8 for float32 and K >= 4 for float64. ``_tl.mma`` pads a narrower
  tile with zeros, so every config compiles on both (the fp32-ieee forward's K = 8 tile and the
  float64 data gradient's failed to compile with triton 3.6, tools/triton_aot.py).
"""

from __future__ import annotations

import inspect

from .._versions import check_triton

check_triton()

# The line of triton 3.6's interpreter that converts a scalar tensor with int() as it is.
_UNSQUEEZED_INDEX = "int(self.handle.data))"


def _dot_min_k() -> dict[int, int]:
    """{operand bit width: least K of a dot} for the CUDA target (16 where the rule cannot be
    read: padding to 16 compiles on every version)."""
    widths = {16: 16, 32: 16, 64: 16}
    try:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import min_dot_size
    except ImportError:
        return widths
    rule = min_dot_size(GPUTarget("cuda", 90, 32))
    for dtype in (tl.float16, tl.float32, tl.float64):
        widths[dtype.primitive_bitwidth] = int(rule(dtype, dtype)[2])
    return widths


DOT_MIN_K = _dot_min_k()


def patch_interpreter_index() -> bool:
    """Make the interpreter's ``tensor.__index__`` squeeze the 1-element array before ``int()``
    (as triton 3.8's does), on an interpreter that does not; True when it patched. It wraps the
    interpreter's ``_patch_lang_tensor`` (which sets ``__index__`` for each interpreted launch
    and restores it after), so nothing changes outside a launch."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "fusedres_index_patch", False):
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if _UNSQUEEZED_INDEX not in source:
        return False

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor.fusedres_index_patch = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


INTERPRETER_PATCHED = patch_interpreter_index()

__all__ = ["DOT_MIN_K", "INTERPRETER_PATCHED", "patch_interpreter_index"]
