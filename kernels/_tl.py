"""Device helpers shared by the kernels."""

import triton
import triton.language as tl

from ._compat import DOT_MIN_K

# The least K of a dot per operand width on this Triton (kernels/_compat.py): 16 for all on
# triton 3.6; 8 for float32 and 4 for float64 on triton 3.8.
DOT_MIN_K16 = tl.constexpr(DOT_MIN_K[16])
DOT_MIN_K32 = tl.constexpr(DOT_MIN_K[32])
DOT_MIN_K64 = tl.constexpr(DOT_MIN_K[64])


@triton.jit
def mma(acc, a, b, TF32: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + a @ b with float32 (float64) accumulation.

    ``INTERP_BF16`` (bfloat16 under the interpreter only, whose dot multiplies the raw bits)
    widens the operands to float32 first, which is exact for bfloat16. A K narrower than this
    Triton's dot takes is padded with zeros (:func:`fit_k`).
    """
    a, b = fit_k(a, b)
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif TF32:
        return tl.dot(round_tf32(a), round_tf32(b), acc, input_precision="tf32",
                      out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)


@triton.jit
def widen_k(a, b):
    """``[a, 0]`` (M, 2K) and ``[b; 0]`` (2K, N): twice the reduction, the same product (each
    added term is 0 * 0)."""
    a2 = tl.reshape(tl.permute(tl.join(a, tl.zeros_like(a)), (0, 2, 1)),
                    (a.shape[0], 2 * a.shape[1]))
    b2 = tl.reshape(tl.permute(tl.join(b, tl.zeros_like(b)), (2, 0, 1)),
                    (2 * b.shape[0], b.shape[1]))
    return a2, b2


@triton.jit
def fit_k(a, b):
    """``a`` (M, K) and ``b`` (K, N) widened with zeros until K reaches the least K of this
    Triton's dot for their width (``DOT_MIN_K*``); unchanged when it does already (always on
    triton 3.8 for the kernels' configs, whose K is >= 8, and >= 16 below 32 bits). Static:
    nothing is emitted when no padding is needed. triton 3.6 pads the float32 (``ieee``)
    forward's K = 8 tile and the float64 data gradient's to 16: twice the FMAs of that tile,
    in exchange for compiling at all."""
    if a.dtype.primitive_bitwidth == 64:
        MIN_K: tl.constexpr = DOT_MIN_K64
    elif a.dtype.primitive_bitwidth == 32:
        MIN_K: tl.constexpr = DOT_MIN_K32
    else:
        MIN_K: tl.constexpr = DOT_MIN_K16
    if a.shape[1] < MIN_K:
        a, b = widen_k(a, b)
    if a.shape[1] < MIN_K:
        a, b = widen_k(a, b)
    if a.shape[1] < MIN_K:
        a, b = widen_k(a, b)
    return a, b


@triton.jit
def round_tf32(v):
    """float32 ``v`` rounded to TF32 (10 mantissa bits; to nearest, ties away from zero, as
    ``cvt.rna.tf32.f32``), still as float32. A TF32 dot hands the fp32 operands to the tensor
    cores, which ignore the low 13 bits: truncation, an error of one sign that adds up over a
    long reduction (on an H100 the weight-gradient GEMMs gave 4x cuDNN's TF32 error, which
    rounds; triton-lang/triton#4574). Infinities stay infinite. A NaN is passed as it is: the
    GPU's canonical NaN, 0x7FFFFFFF, would carry into the sign bit and round to -0."""
    if v.dtype == tl.float32:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.where(v == v, rounded, v)
    else:
        return v


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



@triton.jit
def _grid_round(t, XT: tl.constexpr, UP: tl.constexpr, INTERP_BF16: tl.constexpr):
    """The least value of the 16-bit dtype ``XT`` >= float32 ``t`` (``UP``), or the greatest <=
    ``t``, as a float32 (exact). bfloat16 steps on its float32 image's bits (a bfloat16 is the
    top half of its float32), float16 on its own."""
    if XT == tl.bfloat16:
        rf = cast(t, tl.bfloat16, INTERP_BF16).to(tl.float32)
        bits = rf.to(tl.int32, bitcast=True)
        step = 0x10000
        tiny = tl.full(bits.shape, 0x10000, tl.int32)         # the least positive bfloat16
        ntiny = tl.full(bits.shape, -2147418112, tl.int32)    # 0x80010000: its negative
    else:
        r = t.to(tl.float16)
        rf = r.to(tl.float32)
        bits = r.to(tl.int16, bitcast=True)
        step = 1
        tiny = tl.full(bits.shape, 1, tl.int16)
        ntiny = tl.full(bits.shape, -32767, tl.int16)         # 0x8001
    if UP:  # rounded below t: the next value up
        nxt = tl.where(rf == 0, tiny, tl.where(rf > 0, bits + step, bits - step))
        done = rf >= t
    else:
        nxt = tl.where(rf == 0, ntiny, tl.where(rf > 0, bits - step, bits + step))
        done = rf <= t
    nxt = nxt.to(bits.dtype)  # int16 + a Python int is int32 in Triton
    if XT == tl.bfloat16:
        nf = nxt.to(tl.float32, bitcast=True)
    else:
        nf = nxt.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(done, rf, nf)


@triton.jit
def relu_window(sc, sh, XT: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Per channel (lo, hi) in the 16-bit dtype ``XT`` such that, for every ``x`` of that dtype,
    the ReLU of ``sc * x + sh`` (float32) is on (> 0, or NaN) exactly when ``not x <= lo and
    not x >= hi``. The threshold t = -sh / sc goes onto x's grid: lo = the greatest value <= t
    for sc > 0, hi = the least >= t for sc < 0; the other bound NaN (no compare with NaN is
    true); both NaN for sc = 0 and sh > 0, lo = +inf and hi = -inf for sc = 0 and sh <= 0.
    Two compares a 16-bit element then, no conversion or FMA. The only slack is t's float32
    division (~1e-7 relative) against the 16-bit grid (1e-3): an x that close to t has
    sc * x + sh ~1e-7 * |sh|, the rounding noise of the FMA itself."""
    zero = sc == 0
    t = -sh / tl.where(zero, 1.0, sc)
    floor = _grid_round(t, XT, False, INTERP_BF16)
    ceil = _grid_round(t, XT, True, INTERP_BF16)
    inf = float("inf")
    nan = float("nan")
    off = zero & ~(sh > 0)
    lo = tl.where(sc > 0, floor, tl.where(off, inf, nan))
    hi = tl.where(sc < 0, ceil, tl.where(off, -inf, nan))
    return cast(lo, XT, INTERP_BF16), cast(hi, XT, INTERP_BF16)
