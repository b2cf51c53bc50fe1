"""Triton pieces of the key codecs that the store kernels share: scale arithmetic, e4m3 and e2m1 encoding,
and the rules of the fused LayerNorm's statistics (raw moments, their guard, the two ``rstd``).

Scales are chosen by the same integer arithmetic on fp32 bits as the reference codecs in
:mod:`dsacache.formats.indexer_key`, so scales and MXFP4 codes are bit-identical to them.

MXFP4 kernels hold keys as pairs: elements ``2q`` and ``2q + 1`` of a row, pair
``q = 16 g + 4 j + l``, live at ``[g, t, j, l]`` of two ``[G, T, 4, 4]`` tensors (even, odd),
so one thread owns whole 32-value groups and the 4 bytes of ``l`` pack into one 32-bit word.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(exp):
    """``2.0 ** exp`` for integer ``-126 <= exp <= 127``, built from its fp32 bits."""
    return ((exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def finite_abs(x, INTERPRET: tl.constexpr):
    """``|x|`` for finite ``x``, a value that ``tl.max`` skips for NaN and inf.

    On the GPU that is one FMA: ``inf * 0`` is NaN and ``max.f32`` returns its other operand,
    so one bad element never sets a block's scale (and an all-NaN block's max is NaN, which the
    callers' ``tl.maximum``/``amax > 0`` turn into the floor). The interpreter's maximum
    propagates NaN, so there non-finite values become 0 instead.
    """
    if INTERPRET:
        a = tl.abs(x)
        return tl.where(a < float("inf"), a, 0.0)
    else:
        return x * 0.0 + tl.abs(x)


@triton.jit
def ceil_pow2_exponent(amax, MANTISSA_LIMIT: tl.constexpr, SHIFT: tl.constexpr):
    """Smallest ``e`` with ``amax <= (1 + MANTISSA_LIMIT / 2**23) * 2**SHIFT * 2**e`` (exact)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return biased - 127 - SHIFT + (frac > MANTISSA_LIMIT).to(tl.int32)


@triton.jit
def e4m3_encode_int(y):
    """fp32 ``y`` in [-448, 448] or NaN -> e4m3 byte (int32), round half to even.

    Integer twin of the hardware cast, for the Triton interpreter, whose fp8 cast drops
    the carry when rounding up into the next binade (125.1 -> 64 instead of 128).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    # Normal e4m3 (|y| >= 2**-6): keep 3 mantissa bits, rebias the exponent from 127 to 7.
    normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal e4m3: multiples of 2**-9; adding 2**23 rounds to an integer, half to even.
    tiny = tl.where(mag_bits < 0x3C800000, tl.abs(y), 0.0)
    sub = ((tiny * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag_bits < 0x3C800000, sub, normal)
    return tl.where(y != y, 0x7F, code) | sign


@triton.jit
def row_sum(x):
    """Per-token sum of pairs ``[G, T, 4, 4]`` -> ``[T]``."""
    return tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=0)


@triton.jit
def _add_pairs(total_a, squares_a, total_b, squares_b):
    return total_a + total_b, squares_a + squares_b


@triton.jit
def sums_and_squares(x, axis: tl.constexpr):
    """(sum, sum of squares) of ``x`` along ``axis`` as one reduction: the two are independent, so
    each step of the warp reduction shuffles both at once instead of one chain after the other."""
    return tl.reduce((x, x * x), axis, _add_pairs)


@triton.jit
def row_moments(even, odd):
    """Per-token (sum, sum of squares) of pairs ``[G, T, 4, 4]`` -> two ``[T]``: the in-thread
    sums, then one reduction over the groups for both (as :func:`sums_and_squares`)."""
    total = tl.sum(tl.sum(even + odd, axis=3), axis=2)
    squares = tl.sum(tl.sum(even * even + odd * odd, axis=3), axis=2)
    return tl.reduce((total, squares), 0, _add_pairs)


@triton.jit
def raw_moment_stats(total, squares, D: tl.constexpr):
    """LayerNorm statistics from a token's raw moments: ``(mean, var, well)``, ``var = E[x**2] - mean**2``.

    The subtraction loses about ``log2(mean**2 / var)`` bits of the variance to cancellation, so
    ``well`` (the raw variance may be used) is False past ``mean**2 > 16 var`` (4 bits lost at most)
    and where the sum of squares is not finite (NaN or inf keys, squares past fp32); there the
    caller takes the exact two-pass statistics (:func:`exact_rstd` of the centred values).
    """
    mean = total * (1.0 / D)
    var = squares * (1.0 / D) - mean * mean
    well = (var * 16.0 >= mean * mean) & (squares <= 3.0e38)
    return mean, var, well


@triton.jit
def rsqrt_approx(x, INTERPRET: tl.constexpr):
    """``1 / sqrt(x)``: one ``rsqrt.approx`` (relative error under 2**-22.9; without ``.ftz`` a
    subnormal ``x``, a variance under eps = 0, is scaled into range instead of read as 0)."""
    if INTERPRET:
        return 1.0 / tl.sqrt(x)
    else:
        return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def exact_rstd(var, eps):
    """``1 / sqrt(var + eps)`` rounded as the reference computes it (IEEE square root and division)."""
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def bf16_pair_halves(bits):
    """32-bit words of two bf16 values -> (the low one, the high one) as fp32 (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True), (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def load_pair_halves(ptr, pair, mask, FP32_PAIRS: tl.constexpr):
    """Elements ``2 * pair`` and ``2 * pair + 1`` of a contiguous vector, as fp32.

    ``FP32_PAIRS`` (fp32, 8-byte aligned): one 64-bit load a pair instead of two scalar loads.
    """
    if FP32_PAIRS:
        bits = tl.load(ptr.to(tl.pointer_type(tl.int64)) + pair, mask=mask, other=0)
        return bits.to(tl.int32).to(tl.float32, bitcast=True), (bits >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        even = tl.load(ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
        return even, tl.load(ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)


# |y| of a LayerNorm output goes through ``mul.sat`` at 1/8 scale: [0, 0.75] for finite values,
# inf -> 1, NaN -> 0 (the clamp's NaN half for free).
_SAT_MUL_ASM = tl.constexpr("{ .reg .f32 m; abs.f32 m, $1; mul.rn.sat.f32 $0, m, $2; }")


# max(bits - K, 23 << 23) with K = (104 - DOMAIN) << 23, for DOMAIN 0 and 3 (see e2m1_code_bits).
_MAGIC_ASM = tl.constexpr("{ .reg .s32 t; add.s32 t, $1, -872415232; max.s32 $0, t, 192937984; }")
_MAGIC_ASM_SAT = tl.constexpr("{ .reg .s32 t; add.s32 t, $1, -847249408; max.s32 $0, t, 192937984; }")


@triton.jit
def sat_magnitude(y, inv_scale8, INTERPRET: tl.constexpr, FINITE: tl.constexpr = False):
    """``min(|y| * inv_scale8, 0.75)``, NaN -> 0 (``inv_scale8`` = 1/8 of the inverse scale).

    ``FINITE``: ``y`` holds no inf, so ``|y| * inv_scale8 <= 0.75`` already (the scale covers
    the group's maximum) and the clamp goes.
    """
    if INTERPRET:
        return tl.where(y == y, tl.minimum(tl.abs(y) * inv_scale8, 0.75), 0.0)
    else:
        a = tl.inline_asm_elementwise(_SAT_MUL_ASM, "=f,f,f", [y, inv_scale8], dtype=tl.float32,
                                      is_pure=True, pack=1)
        if FINITE:
            return a
        else:
            return tl.minimum(a, 0.75)


@triton.jit
def clamped_magnitude(y, INTERPRET: tl.constexpr):
    """``min(|y|, 6)``, NaN -> 0 (max/min return the operand that is not NaN)."""
    if INTERPRET:
        return tl.where(y == y, tl.minimum(tl.abs(y), 6.0), 0.0)
    else:
        return tl.minimum(tl.maximum(tl.abs(y), 0.0), 6.0)


@triton.jit
def e2m1_code_bits(a, DOMAIN: tl.constexpr, EXACT: tl.constexpr, INTERPRET: tl.constexpr):
    """Magnitudes ``a`` in ``[0, 6 / 2**DOMAIN]`` -> ``code << 22`` (int32) of ``a * 2**DOMAIN``
    rounded to the e2m1 grid, half to even.

    ``M = 2**(22 + max(E, 0))`` (``E`` the exponent of ``a * 2**DOMAIN``) has an ulp of the
    e2m1 step there, so ``(a + M) - M`` rounds; kept as ``M' = M * 2**-126`` the subtraction
    also lands the result ``r * 2**-126``, whose bits are e2m1's own (bias 1, one mantissa
    bit) at bits 22..24: two FFMA and no multiply. ``EXACT=False`` keeps the mantissa of
    ``a`` in ``M`` (one op less): right for inputs of at most 21 significant bits (bf16, fp16
    keys scaled by a power of two) since ``a + M`` then stays in ``M``'s binade, and ties,
    having short mantissas, still see an even ``M``.
    """
    bits = a.to(tl.int32, bitcast=True)
    if EXACT:
        bits = bits & 0x7F800000
    # Exponent field of M': max(E, 0) - 104 + 127, with a's own exponent offset by DOMAIN.
    offset: tl.constexpr = -((104 - DOMAIN) << 23)
    if INTERPRET:
        magic = tl.maximum(bits + offset, 23 << 23)
    else:
        # As written (add, then max) ptxas fuses it into one VIADDMNMX; LLVM would turn
        # max(x - K, F) into max(x, F + K) - K, two instructions.
        asm: tl.constexpr = _MAGIC_ASM_SAT if DOMAIN == 3 else _MAGIC_ASM
        magic = tl.inline_asm_elementwise(asm, "=r,r", [bits], dtype=tl.int32, is_pure=True, pack=1)
    magic = magic.to(tl.float32, bitcast=True)
    up: tl.constexpr = 2.0 ** (126 - DOMAIN)
    down: tl.constexpr = 2.0 ** (DOMAIN - 126)
    t = magic * up + a
    return (t * down - magic).to(tl.int32, bitcast=True)


@triton.jit
def pack_e2m1_words(v_even, v_odd, y_even, y_odd, INTERPRET: tl.constexpr):
    """e2m1 ``code << 22`` of even and odd elements ``[G, T, 4 (j), 4 (l)]`` plus the signs
    of ``y`` -> the 32-bit words ``[G, T, 4]`` (byte l: even nibble low, odd nibble high).

    With the sign OR-ed in at bit 31, one ``umulhi`` by ``2**(p + 10)`` moves an element's code
    to bits p..p+2 and its sign to p+9; two accumulators (l = 0, 2 and l = 1, 3) hold codes at
    p = 0, 4, 16, 20 and signs at 9, 13, 25, 29, so a shift by 6 and one LOP3 complete bytes
    0 and 2 of each, and a byte permute interleaves the two: ~2.6 instructions an element.
    NaN (any sign) is stored as +0.
    """
    if INTERPRET:
        sign_even = tl.where(y_even == y_even, y_even.to(tl.int32, bitcast=True), 0) & -2147483648
        sign_odd = tl.where(y_odd == y_odd, y_odd.to(tl.int32, bitcast=True), 0) & -2147483648
    else:
        # y comes out of an FMUL/FFMA: NaN is the positive canonical NaN.
        sign_even = y_even.to(tl.int32, bitcast=True) & -2147483648
        sign_odd = y_odd.to(tl.int32, bitcast=True) & -2147483648
    u_even = v_even | sign_even
    u_odd = v_odd | sign_odd
    lh = tl.arange(0, 4)[None, None, None, :] >> 1
    if INTERPRET:
        shift = 22 - 16 * lh
        terms = ((u_even.to(tl.uint32, bitcast=True) >> shift) +
                 (u_odd.to(tl.uint32, bitcast=True) >> (shift - 4))).to(tl.int32, bitcast=True)
    else:
        terms = tl.umulhi(u_even, 1024 << (16 * lh)) + tl.umulhi(u_odd, 16384 << (16 * lh))
    G: tl.constexpr = terms.shape[0]
    T: tl.constexpr = terms.shape[1]
    # l = 2 lh + ll: summing over lh leaves the accumulators of ll = 0 and ll = 1.
    acc = tl.sum(tl.reshape(terms, (G, T, 4, 2, 2)), axis=3)
    acc_a, acc_b = tl.split(acc)
    half_a = (acc_a & 0x77777777) | ((acc_a >> 6) & -2004318072)   # 0x88888888
    half_b = (acc_b & 0x77777777) | ((acc_b >> 6) & -2004318072)
    if INTERPRET:
        return (half_a & 0x00FF00FF) | ((half_b << 8) & -16711936)  # 0xFF00FF00
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6240;", "=r,r,r", [half_a, half_b],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def mxfp4_scale(even, odd, INTERPRET: tl.constexpr, FINITE: tl.constexpr):
    """Group exponents ``[G, T]`` (int32) and inverse scales ``2**-exp`` of ``[G, T, 4, 4]`` pairs.

    ``FINITE`` (no inf in the values, compiled only): the plain ``max.f32`` of ``|x|`` already
    skips NaN, one instruction an element instead of two.
    """
    if FINITE and not INTERPRET:
        group_max = tl.maximum(tl.abs(even), tl.abs(odd))
    else:
        group_max = tl.maximum(finite_abs(even, INTERPRET), finite_abs(odd, INTERPRET))
    amax = tl.max(tl.max(group_max, axis=3), axis=2)
    # 6 = 1.5 * 2**2: mantissa limit 0x400000, shift 2; an all-zero group gets the smallest scale.
    exp = ceil_pow2_exponent(amax, 0x400000, 2)
    exp = tl.where(amax > 0, exp, -127)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    return exp, pow2(-exp)


@triton.jit
def mxfp4_norm_codes(even, odd, EXACT: tl.constexpr, INTERPRET: tl.constexpr, FINITE: tl.constexpr):
    """LayerNorm outputs (FFMA results: NaN is the positive canonical NaN) -> group exponents and
    the e2m1 ``code << 22`` of even and odd elements (signs not included).

    ``mul.sat`` gives the clamped magnitudes at 1/8 scale in one op (the 1/8 may be subnormal).
    """
    exp, inv_scale = mxfp4_scale(even, odd, INTERPRET, FINITE)
    inv_scale8 = (inv_scale * 0.125)[:, :, None, None]
    v_even = e2m1_code_bits(sat_magnitude(even, inv_scale8, INTERPRET, FINITE), 3, EXACT, INTERPRET)
    v_odd = e2m1_code_bits(sat_magnitude(odd, inv_scale8, INTERPRET, FINITE), 3, EXACT, INTERPRET)
    return exp, v_even, v_odd


@triton.jit
def page_and_row32(pages_ptr, slot, page_stride, PAGE: tl.constexpr):
    """(page base pointer, row) of slots in a pool of fewer than ``2**31`` slots: the page and row
    of a valid slot in 32-bit unsigned math (an invalid slot's answer is never dereferenced)."""
    slot32 = slot.to(tl.int32).to(tl.uint32, bitcast=True)
    return pages_ptr + (slot32 // PAGE).to(tl.int64) * page_stride, (slot32 % PAGE).to(tl.int32)
