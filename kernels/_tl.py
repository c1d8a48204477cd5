"""Device helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def mma(acc, a, b, TF32: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + a @ b with float32 (float64) accumulation.

    ``INTERP_BF16`` (bfloat16 under the interpreter only, whose dot multiplies the raw bits)
    widens the operands to float32 first, which is exact for bfloat16.
    """
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif TF32:
        return tl.dot(a, b, acc, input_precision="tf32", out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)


@triton.jit
def cast(v, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``v.to(dtype)``, rounding to nearest even. The interpreter truncates float32 ->
    bfloat16 instead (``INTERP_BF16``): round the float32 bits by hand there first."""
    if INTERP_BF16:
        if dtype == tl.bfloat16:
            bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dtype)
        else:
            return v.to(dtype)
    else:
        return v.to(dtype)


@triton.jit
def load_tile(ptrs, row_ok, col_ok, ROWS_ALL: tl.constexpr, COLS_ALL: tl.constexpr):
    """A (rows, cols) tile, 0 where ``row_ok[:, None] & col_ok[None, :]`` is false. A mask the
    host knows to be all-true (``ROWS_ALL``/``COLS_ALL``: the dimension divides by the block)
    is left out: no predicate to build per vector, and cp.async copies with no zero-fill
    operand (the sm_90 SASS of the conv loops spent about a third of their instructions on
    predicates)."""
    if ROWS_ALL:
        if COLS_ALL:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        if COLS_ALL:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def load_vec(ptrs, ok, ALL: tl.constexpr):
    """A vector, 0 where ``ok`` is false; unmasked when the host knows ``ok`` all-true."""
    if ALL:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=ok, other=0.0)

