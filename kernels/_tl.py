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
