"""Triton kernels for the indexer key cache: quantize + store, gather, dequantize.

Each kernel has a launcher (``launch_*``) that checks strides and dtypes and sets the
grid; input validation and docstrings live in the public functions (``api.py``).
Scales are chosen by the same integer arithmetic on fp32 bits as the reference codecs
in :mod:`dsacache.formats.indexer_key`, so scales and MXFP4 codes are bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.dispatch import interpreting
from dsacache.formats.key_format import MXFP4_GROUP_SIZE
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.triton_utils import loop_bound, sm_count

FORMAT_IDS = {"fp8": 0, "mxfp4": 1}

# About 2K elements a program: enough bytes in flight per SM, few registers a thread.
_ELEMENTS_PER_PROGRAM = 2048
#: From this many tokens on, the MXFP4 store gives each thread two rows.
_LARGE_BATCH = 32768


@triton.jit
def _pow2(exp):
    """``2.0 ** exp`` for integer ``-126 <= exp <= 127``, built from its fp32 bits."""
    return ((exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs(x, INTERPRET: tl.constexpr):
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
def _ceil_pow2_exponent(amax, MANTISSA_LIMIT: tl.constexpr, SHIFT: tl.constexpr):
    """Smallest ``e`` with ``amax <= (1 + MANTISSA_LIMIT / 2**23) * 2**SHIFT * 2**e`` (exact)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return biased - 127 - SHIFT + (frac > MANTISSA_LIMIT).to(tl.int32)


@triton.jit
def _e4m3_encode_int(y):
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


#: L2 hints of the stores (``HINTS``): 0 none; 1 scales ``evict_last``; 2 also keys read and values
#: written ``evict_first``. Scales are 4-byte (FP8) or 4 x 1-byte (MXFP4) pieces of 32-byte sectors
#: that other tokens of the same page fill later: kept in L2, a page's sectors leave it whole
#: instead of as partial writes.
STORE_HINTS = 1


@triton.jit
def _store_fp8_kernel(
    k_ptr,          # [num_tokens, D] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    w_ptr, b_ptr,   # [D] LayerNorm weight and bias (read only when NORM)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], page stride page_stride
    num_tokens, num_slots, stride_kt, stride_kd, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HINTS: tl.constexpr,
):
    STREAM: tl.constexpr = "evict_first" if HINTS >= 2 else ""
    KEEP: tl.constexpr = "evict_last" if HINTS >= 1 else ""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_t = offs_t < num_tokens
    # The key load does not wait for the slot load: both are in flight at once.
    k_rows = k_ptr + offs_t.to(tl.int64)[:, None] * stride_kt + offs_d[None, :] * stride_kd
    x = tl.load(k_rows, mask=mask_t[:, None] & mask_d[None, :], other=0.0,
                eviction_policy=STREAM).to(tl.float32)  # [BLOCK_T, BLOCK_D]
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    if NORM:
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        centered = x - mean[:, None]
        if D != BLOCK_D:
            centered = tl.where(mask_d[None, :], centered, 0.0)
        var = tl.sum(centered * centered, axis=1) / D
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        x = centered * rstd[:, None] * w[None, :] + b[None, :]
    amax = tl.maximum(tl.max(_finite_abs(x, INTERPRET), axis=1), 1e-4)
    # 448 = 1.75 * 2**8: mantissa limit 0x600000, shift 8.
    exp = _ceil_pow2_exponent(amax, 0x600000, 8)
    y = x * _pow2(-exp)[:, None]
    if INTERPRET:
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
        codes = _e4m3_encode_int(y).to(tl.uint8)
    else:
        # The hardware cast (cvt.rn.satfinite) saturates inf to +-448 and keeps NaN: no clamp.
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    page_ptr = pages_ptr + (slot // PAGE) * page_stride
    row = slot % PAGE
    tl.store(page_ptr[:, None] + row[:, None] * D + offs_d[None, :], codes, mask=valid[:, None] & mask_d[None, :],
             eviction_policy=STREAM)
    scale_ptr = (page_ptr + PAGE * D + row * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, _pow2(exp), mask=valid, eviction_policy=KEEP)


@triton.jit
def _e2m1_encode(y, INTERPRET: tl.constexpr):
    """fp32 ``y`` (already divided by its scale: ``|y| <= 6``, inf or NaN) -> e2m1 codes (int32 0..15).

    Round half to even by the magic-number trick: with ``E`` the exponent of ``a = |y|``,
    ``M = 2**(22 + max(E, 0))`` has an ulp of exactly the e2m1 step at ``a`` (0.5, 1 or 2),
    so ``(a + M) - M`` is ``a`` rounded to the grid, and ``r * 2**-126`` then holds e2m1's
    own bit pattern (exponent bias 1, one mantissa bit) in bits 22..24. Mostly FMA-pipe
    work: the integer/compare pipe runs at half rate on Hopper and limits this kernel.
    inf saturates to 6, NaN -> +0 (arithmetic on NaN yields the positive canonical NaN).
    """
    if INTERPRET:
        a = tl.where(y == y, tl.minimum(tl.abs(y), 6.0), 0.0)
    else:
        # max/min return the operand that is not NaN: NaN -> 0, inf -> 6.
        a = tl.minimum(tl.maximum(tl.abs(y), 0.0), 6.0)
    exponent = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    magic = exponent.to(tl.float32, bitcast=True) * 4194304.0
    r = (a + magic) - magic
    bits = (r * 1.1754943508222875e-38).to(tl.int32, bitcast=True)
    if INTERPRET:
        sign = tl.where(y == y, (y.to(tl.int32, bitcast=True) >> 28) & 8, 0)
        return (bits >> 22) | sign
    else:
        # The two right shifts as high halves of multiplies (x >> 22 == umulhi(x, 2**10)): they
        # run on the FMA pipe, which has room, instead of the integer pipe, which has none.
        return tl.umulhi(bits, 1024) | (tl.umulhi(y.to(tl.int32, bitcast=True), 16) & 8)


@triton.jit
def _row_sum(x):
    # [BLOCK_G, BLOCK_T, 4, 4] -> [BLOCK_T]
    return tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=0)


@triton.jit
def _load_pair_halves(ptr, pair, mask, FP32_PAIRS: tl.constexpr):
    """Elements ``2 * pair`` and ``2 * pair + 1`` of a contiguous vector, as fp32.

    ``FP32_PAIRS`` (fp32, 8-byte aligned): one 64-bit load a pair instead of two scalar loads.
    """
    if FP32_PAIRS:
        bits = tl.load(ptr.to(tl.pointer_type(tl.int64)) + pair, mask=mask, other=0)
        return bits.to(tl.int32).to(tl.float32, bitcast=True), (bits >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        even = tl.load(ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
        return even, tl.load(ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)


#: MXFP4 encoders (``ENCODE``): 0 the first one (per-element sign, byte-wise packing, int64 slot
#: math, byte scale stores); 1 the leaner one below (~3.5 fewer instructions an element); 2 the
#: fused LayerNorm store as a tile loop (``_norm_store_mxfp4_loop_kernel``, the encoder of 1; 1M
#: tokens on the H200: 150 -> 133 us, and 133 -> 126 us with the LayerNorm moments on the tensor
#: cores), for batches from ``_LARGE_BATCH`` tokens with bf16 keys and fp32 LayerNorm parameters;
#: otherwise, and for the store without the norm, 2 runs as 1.
MXFP4_ENCODE = 2

# |y| of a LayerNorm output goes through ``mul.sat`` at 1/8 scale: [0, 0.75] for finite values,
# inf -> 1, NaN -> 0 (the clamp's NaN half for free).
_SAT_MUL_ASM = tl.constexpr("{ .reg .f32 m; abs.f32 m, $1; mul.rn.sat.f32 $0, m, $2; }")


# max(bits - K, 23 << 23) with K = (104 - DOMAIN) << 23, for DOMAIN 0 and 3 (see _e2m1_code_bits).
_MAGIC_ASM = tl.constexpr("{ .reg .s32 t; add.s32 t, $1, -872415232; max.s32 $0, t, 192937984; }")
_MAGIC_ASM_SAT = tl.constexpr("{ .reg .s32 t; add.s32 t, $1, -847249408; max.s32 $0, t, 192937984; }")


@triton.jit
def _sat_magnitude(y, inv_scale8, INTERPRET: tl.constexpr, FINITE: tl.constexpr = False):
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
def _clamped_magnitude(y, INTERPRET: tl.constexpr):
    """``min(|y|, 6)``, NaN -> 0 (max/min return the operand that is not NaN)."""
    if INTERPRET:
        return tl.where(y == y, tl.minimum(tl.abs(y), 6.0), 0.0)
    else:
        return tl.minimum(tl.maximum(tl.abs(y), 0.0), 6.0)


@triton.jit
def _e2m1_code_bits(a, DOMAIN: tl.constexpr, EXACT: tl.constexpr, INTERPRET: tl.constexpr):
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
def _pack_e2m1_words(v_even, v_odd, y_even, y_odd, INTERPRET: tl.constexpr):
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
def _store_mxfp4_kernel(
    k_ptr,          # [num_tokens, D] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    w_ptr, b_ptr,   # [D] LayerNorm weight and bias (read only when NORM)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], 4-byte aligned
    num_tokens, num_slots, stride_kt, stride_kd, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, PAIRS: tl.constexpr, NORM_PAIRS: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, HINTS: tl.constexpr,
    ENCODE: tl.constexpr = 0, EXACT: tl.constexpr = True,
):
    # Elements 2q and 2q + 1 of a row, pair q = 16 g + 4 j + l, live at [g, t, j, l] of two
    # [BLOCK_G, BLOCK_T, 4, 4] tensors (even, odd). l is one 16-byte vector and the load
    # layout spreads lanes over g, then t, so j is a register repeat: one thread owns whole
    # 32-value groups (no shuffles for the group max), both nibbles of each byte (no split),
    # and the 4 bytes of l pack into one 32-bit word.
    STREAM: tl.constexpr = "evict_first" if HINTS >= 2 else ""
    KEEP: tl.constexpr = "evict_last" if HINTS >= 1 else ""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_g = tl.arange(0, BLOCK_G)
    offs_g4 = offs_g[:, None, None, None]
    offs_l4 = tl.arange(0, 4)[None, None, None, :]
    pair = offs_g4 * 16 + tl.arange(0, 4)[None, None, :, None] * 4 + offs_l4   # [BLOCK_G, 1, 4, 4]
    mask_g4 = offs_g4 < D // 32
    mask = mask_t[None, :, None, None] & mask_g4
    rows = k_ptr + offs_t.to(tl.int64)[None, :, None, None] * stride_kt
    if PAIRS:
        # bf16 keys with contiguous rows: one 32-bit load per pair, bf16 -> fp32 is a shift or a mask.
        bits = tl.load(rows.to(tl.pointer_type(tl.int32)) + pair, mask=mask, other=0,
                       eviction_policy=STREAM)
        even, odd = _bf16_pair_halves(bits)
    else:
        even = tl.load(rows + (2 * pair) * stride_kd, mask=mask, other=0.0,
                       eviction_policy=STREAM).to(tl.float32)
        odd = tl.load(rows + (2 * pair + 1) * stride_kd, mask=mask, other=0.0,
                      eviction_policy=STREAM).to(tl.float32)
    if ENCODE == 0:
        slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    else:
        slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1)
    valid = (slot >= 0) & (slot < num_slots)
    if NORM:
        # weight and bias in the keys' shape (every row reads the same addresses), hence the
        # same layout: no conversion. Small programs load them first, so the loads overlap the
        # reductions (T=64: 3.1 -> 2.1 us); with two rows a thread that costs 40 registers
        # (128 -> 168) and occupancy (1M tokens: 158 -> 198 us), so large ones load them last.
        wb_pair = pair + 0 * offs_t[None, :, None, None]
        if BLOCK_T <= 16:
            w_even, w_odd = _load_pair_halves(w_ptr, wb_pair, mask_g4, NORM_PAIRS)
            b_even, b_odd = _load_pair_halves(b_ptr, wb_pair, mask_g4, NORM_PAIRS)
        mean = (_row_sum(even + odd) / D)[None, :, None, None]
        even = even - mean
        odd = odd - mean
        if D != BLOCK_G * 32:
            even = tl.where(mask_g4, even, 0.0)
            odd = tl.where(mask_g4, odd, 0.0)
        var = _row_sum(even * even + odd * odd) / D
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[None, :, None, None]
        if BLOCK_T > 16:
            w_even, w_odd = _load_pair_halves(w_ptr, wb_pair, mask_g4, NORM_PAIRS)
            b_even, b_odd = _load_pair_halves(b_ptr, wb_pair, mask_g4, NORM_PAIRS)
        even = even * rstd * w_even + b_even
        odd = odd * rstd * w_odd + b_odd
    group_max = tl.maximum(_finite_abs(even, INTERPRET), _finite_abs(odd, INTERPRET))
    amax = tl.max(tl.max(group_max, axis=3), axis=2)                            # [BLOCK_G, BLOCK_T]
    # 6 = 1.5 * 2**2: mantissa limit 0x400000, shift 2; an all-zero group gets the smallest scale.
    exp = _ceil_pow2_exponent(amax, 0x400000, 2)
    exp = tl.where(amax > 0, exp, -127)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    inv_scale = _pow2(-exp)[:, :, None, None]
    if ENCODE == 0:
        byte = _e2m1_encode(even * inv_scale, INTERPRET) + _e2m1_encode(odd * inv_scale, INTERPRET) * 16
        words = tl.sum(byte * (1 << (8 * offs_l4)), axis=3)                     # [BLOCK_G, BLOCK_T, 4 (j)]
        page_ptr = pages_ptr + (slot // PAGE) * page_stride
        row = slot % PAGE
    else:
        if NORM:
            # The LayerNorm output is an FFMA result (canonical NaN): it gives the signs, and
            # mul.sat the clamped magnitudes at 1/8 scale in one op (the 1/8 may be subnormal).
            inv_scale8 = inv_scale * 0.125
            v_even = _e2m1_code_bits(_sat_magnitude(even, inv_scale8, INTERPRET), 3, EXACT, INTERPRET)
            v_odd = _e2m1_code_bits(_sat_magnitude(odd, inv_scale8, INTERPRET), 3, EXACT, INTERPRET)
        else:
            # Raw keys may hold -NaN: the signs come from the scaled values (an FMUL) instead.
            even = even * inv_scale
            odd = odd * inv_scale
            v_even = _e2m1_code_bits(_clamped_magnitude(even, INTERPRET), 0, EXACT, INTERPRET)
            v_odd = _e2m1_code_bits(_clamped_magnitude(odd, INTERPRET), 0, EXACT, INTERPRET)
        words = _pack_e2m1_words(v_even, v_odd, even, odd, INTERPRET)           # [BLOCK_G, BLOCK_T, 4 (j)]
        # Valid slots are below num_slots < 2**31: page and row in 32-bit unsigned math.
        slot32 = slot.to(tl.int32).to(tl.uint32, bitcast=True)
        page_ptr = pages_ptr + (slot32 // PAGE).to(tl.int64) * page_stride
        row = (slot32 % PAGE).to(tl.int32)
    word_ptr = (page_ptr + row * (D // 2)).to(tl.pointer_type(tl.int32))[None, :, None]
    offs_w = offs_g[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    tl.store(word_ptr + offs_w, words, mask=valid[None, :, None] & (offs_g < D // 32)[:, None, None],
             eviction_policy=STREAM)
    if ENCODE != 0 and D % 128 == 0 and BLOCK_G == D // 32:
        # A token's scale bytes are whole 4-byte aligned words: one 32-bit store per 4 groups.
        shifted = (exp + 127) << (8 * (offs_g % 4))[:, None]
        scale_words = tl.sum(tl.reshape(shifted, (BLOCK_G // 4, 4, BLOCK_T)), axis=1)   # [BLOCK_G / 4, BLOCK_T]
        scale_ptr = (page_ptr + PAGE * (D // 2) + row * (D // 32)).to(tl.pointer_type(tl.int32))
        tl.store(scale_ptr[None, :] + tl.arange(0, BLOCK_G // 4)[:, None], scale_words,
                 mask=valid[None, :], eviction_policy=KEEP)
    else:
        scale_ptr = page_ptr[None, :] + PAGE * (D // 2) + row[None, :] * (D // 32) + offs_g[:, None]
        tl.store(scale_ptr, (exp + 127).to(tl.uint8), mask=valid[None, :] & (offs_g < D // 32)[:, None],
                 eviction_policy=KEEP)


@triton.jit
def _mxfp4_scale(even, odd, INTERPRET: tl.constexpr, FINITE: tl.constexpr):
    """Group exponents ``[G, T]`` (int32) and inverse scales ``2**-exp`` of ``[G, T, 4, 4]`` pairs.

    ``FINITE`` (no inf in the values, compiled only): the plain ``max.f32`` of ``|x|`` already
    skips NaN, one instruction an element instead of two.
    """
    if FINITE and not INTERPRET:
        group_max = tl.maximum(tl.abs(even), tl.abs(odd))
    else:
        group_max = tl.maximum(_finite_abs(even, INTERPRET), _finite_abs(odd, INTERPRET))
    amax = tl.max(tl.max(group_max, axis=3), axis=2)
    # 6 = 1.5 * 2**2: mantissa limit 0x400000, shift 2; an all-zero group gets the smallest scale.
    exp = _ceil_pow2_exponent(amax, 0x400000, 2)
    exp = tl.where(amax > 0, exp, -127)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    return exp, _pow2(-exp)


@triton.jit
def _mxfp4_norm_codes(even, odd, EXACT: tl.constexpr, INTERPRET: tl.constexpr, FINITE: tl.constexpr):
    """LayerNorm outputs (FFMA results: NaN is the positive canonical NaN) -> group exponents and
    the e2m1 ``code << 22`` of even and odd elements (signs not included)."""
    exp, inv_scale = _mxfp4_scale(even, odd, INTERPRET, FINITE)
    inv_scale8 = (inv_scale * 0.125)[:, :, None, None]
    v_even = _e2m1_code_bits(_sat_magnitude(even, inv_scale8, INTERPRET, FINITE), 3, EXACT, INTERPRET)
    v_odd = _e2m1_code_bits(_sat_magnitude(odd, inv_scale8, INTERPRET, FINITE), 3, EXACT, INTERPRET)
    return exp, v_even, v_odd


@triton.jit
def _load_key_pairs(k_ptr, slot_ptr, offs_t, pair, num_tokens, stride_kt, STREAM: tl.constexpr):
    """Rows ``offs_t`` of contiguous bf16 keys as 32-bit pairs ``[G, T, 4, 4]`` and their slots
    (rows past ``num_tokens``: no load, slot -1)."""
    mask_t = offs_t < num_tokens
    rows = k_ptr + offs_t.to(tl.int64)[None, :, None, None] * stride_kt
    bits = tl.load(rows.to(tl.pointer_type(tl.int32)) + pair, mask=mask_t[None, :, None, None], other=0,
                   eviction_policy=STREAM)
    return bits, tl.load(slot_ptr + offs_t, mask=mask_t, other=-1)


@triton.jit
def _bf16_pair_halves(bits):
    """32-bit words of two bf16 values -> (the low one, the high one) as fp32 (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True), (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _norm_store_mxfp4_tile(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
    FINITE: tl.constexpr,
):
    """One tile of :func:`_norm_store_mxfp4_loop_kernel`: keys as bf16 pairs ``[G, T, 4, 4]`` and
    their slots ``[T]`` (-1 or past the pool: skipped) -> LayerNorm (two passes: mean, then the
    variance of the centred values), encode, store."""
    even, odd = _bf16_pair_halves(bits)
    mean = (_row_sum(even + odd) / D)[None, :, None, None]
    even = even - mean
    odd = odd - mean
    var = _row_sum(even * even + odd * odd) / D
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[None, :, None, None]
    even = even * rstd * w_even + b_even
    odd = odd * rstd * w_odd + b_odd
    _encode_store_mxfp4_tile(even, odd, slot, pages_ptr, num_slots, page_stride, D, PAGE, INTERPRET, STREAM, KEEP,
                             FINITE)


@triton.jit
def _encode_store_mxfp4_tile(
    even, odd, slot, pages_ptr, num_slots, page_stride,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
    FINITE: tl.constexpr,
):
    """LayerNorm outputs ``[G, T, 4, 4]`` (even and odd elements) -> MXFP4 words and scales at their slots."""
    offs_g = tl.arange(0, D // 32)
    valid = (slot >= 0) & (slot < num_slots)
    exp, v_even, v_odd = _mxfp4_norm_codes(even, odd, True, INTERPRET, FINITE)
    words = _pack_e2m1_words(v_even, v_odd, even, odd, INTERPRET)                   # [G, BLOCK_T, 4]
    slot32 = slot.to(tl.int32).to(tl.uint32, bitcast=True)
    page_ptr = pages_ptr + (slot32 // PAGE).to(tl.int64) * page_stride
    row = (slot32 % PAGE).to(tl.int32)
    word_ptr = (page_ptr + row * (D // 2)).to(tl.pointer_type(tl.int32))[None, :, None]
    offs_w = offs_g[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    tl.store(word_ptr + offs_w, words, mask=valid[None, :, None], eviction_policy=STREAM)
    # Each thread stores its group's scale byte: a token's 4 bytes leave in one instruction
    # (same sectors as one 32-bit store, without the shared-memory gather and its barrier).
    scale_ptr = page_ptr + PAGE * (D // 2) + row * (D // 32)
    tl.store(scale_ptr[None, :] + offs_g[:, None], (exp + 127).to(tl.uint8), mask=valid[None, :],
             eviction_policy=KEEP)


# Row sums and sums of squares of bf16 keys on the tensor cores. The tile layout puts a token's
# four 32-value groups on the four lanes of a quad (lane = 4 g + c): the A-row layout of an
# m16n8 mma, whose row g (and g + 8) is what quad g holds. With B all ones every column of
# rows g and g + 8 sums quad g's words: four m16n8k16 over a thread's 16 words, $0 = d0 + d2.
# For squares B is a word of the thread's own (B column g = the same word of quad g): an
# m16n8k8 with A = words (2i, 2i + 1) and B = word 2i puts the squares of word 2i on the
# diagonal D[g][g] of one accumulator (q), with B = word 2i + 1 those of word 2i + 1 on
# D[g + 8][g] of another (r); both sit on lane 4 g + g / 2 and a shuffle hands them out ($1).
# A is always a quad or pair of registers as loaded (no moves). bf16 products are exact in
# fp32; only the order of the fp32 sums differs from a serial loop. $2..$17: the thread's 16
# words in load order (16-byte loads: words 4j..4j + 3 in consecutive registers).
_ROW_MOMENTS_ASM = tl.constexpr("""{
.reg .f32 s<4>, q<4>, r<4>, lo, hi;
.reg .b32 one, lane, g, src, odd;
.reg .pred p;
mov.b32 one, 0x3F803F80;
mov.f32 s0, 0f00000000; mov.f32 s1, 0f00000000; mov.f32 s2, 0f00000000; mov.f32 s3, 0f00000000;
mov.f32 q0, 0f00000000; mov.f32 q1, 0f00000000; mov.f32 q2, 0f00000000; mov.f32 q3, 0f00000000;
mov.f32 r0, 0f00000000; mov.f32 r1, 0f00000000; mov.f32 r2, 0f00000000; mov.f32 r3, 0f00000000;
""" + "".join(
    f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{s0,s1,s2,s3}}, {{${i},${i + 1},${i + 2},${i + 3}}}, "
    "{one,one}, {s0,s1,s2,s3};\n" for i in (2, 6, 10, 14)) + "".join(
    f"mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {{q0,q1,q2,q3}}, {{${i},${i + 1}}}, {{${i}}}, "
    "{q0,q1,q2,q3};\n"
    f"mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {{r0,r1,r2,r3}}, {{${i},${i + 1}}}, {{${i + 1}}}, "
    "{r0,r1,r2,r3};\n" for i in range(2, 18, 2)) + """add.f32 $0, s0, s2;
add.f32 lo, q0, r2;
add.f32 hi, q1, r3;
mov.u32 lane, %laneid;
shr.u32 g, lane, 2;
and.b32 odd, g, 1;
setp.ne.u32 p, odd, 0;
selp.f32 lo, hi, lo, p;
shr.u32 odd, g, 1;
shl.b32 g, g, 2;
or.b32 src, g, odd;
shfl.sync.idx.b32 $1, lo, src, 0x1f, 0xffffffff;
}""")


@triton.jit
def _split2(x):
    """[G, T, 2n] -> two [G, T, n]: elements 0, 2, ... and 1, 3, ... (in-thread, no data movement)."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 2, 2)))


@triton.jit
def _split4(x, FLAT: tl.constexpr = False):
    """[G, T, 4n] -> elements 0, 2, 1, 3 (mod 4) as four [G, T, n] (``FLAT``, n = 1: [G, T])."""
    a, b = _split2(x)
    a0, a1 = _split2(a)
    b0, b1 = _split2(b)
    if FLAT:
        shape: tl.constexpr = (x.shape[0], x.shape[1])
        return tl.reshape(a0, shape), tl.reshape(a1, shape), tl.reshape(b0, shape), tl.reshape(b1, shape)
    else:
        return a0, a1, b0, b1


@triton.jit
def _row_moments(bits, INTERPRET: tl.constexpr):
    """Keys as bf16 pairs ``[G, T, 4, 4]`` -> (sum, sum of squares) of each token's D values,
    ``[G, T]`` on the GPU (equal over G) and ``[1, T]`` in the interpreter."""
    if INTERPRET:
        even, odd = _bf16_pair_halves(bits)
        return _row_sum(even + odd)[None, :], _row_sum(even * even + odd * odd)[None, :]
    else:
        a, b, c, d = _split4(tl.reshape(bits, (bits.shape[0], bits.shape[1], 16)))   # words 0, 2, 1, 3 mod 4
        a0, a1, a2, a3 = _split4(a, True)          # words 0, 8, 4, 12
        b0, b1, b2, b3 = _split4(b, True)          # 2, 10, 6, 14
        c0, c1, c2, c3 = _split4(c, True)          # 1, 9, 5, 13
        d0, d1, d2, d3 = _split4(d, True)          # 3, 11, 7, 15
        return tl.inline_asm_elementwise(
            _ROW_MOMENTS_ASM, "=f,=f" + ",r" * 16,
            [a0, c0, b0, d0, a2, c2, b2, d2, a1, c1, b1, d1, a3, c3, b3, d3],     # load order
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _rsqrt(x, INTERPRET: tl.constexpr):
    """``1 / sqrt(x)`` for normal ``x``: one ``rsqrt.approx`` (relative error under 2**-22.9)."""
    if INTERPRET:
        return 1.0 / tl.sqrt(x)
    else:
        return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _norm_store_mxfp4_tile_moments(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
):
    """:func:`_norm_store_mxfp4_tile` with the variance from raw moments taken on the tensor cores
    (``var = E[x**2] - mean**2``) and ``y = (x * rstd - mean * rstd) * w + b``: two FMAs an element
    for the whole LayerNorm instead of five. The raw moments lose about ``log2(mean**2 / var)``
    bits of the variance to cancellation, so a tile with a token past ``mean**2 > 16 var`` (or
    a sum of squares that is not finite) takes the two-pass tile instead. Only for LayerNorm
    parameters that keep every output finite (the loop's ``FINITE`` copy)."""
    total, squares = _row_moments(bits, INTERPRET)
    mean = total * (1.0 / D)
    var = squares * (1.0 / D) - mean * mean
    well = (var * 16.0 >= mean * mean) & (squares <= 3.0e38)
    if tl.min(well.to(tl.int32)) == 1:
        rstd = _rsqrt(var + eps, INTERPRET)
        shift = (-mean * rstd)[:, :, None, None]
        rstd = rstd[:, :, None, None]
        even, odd = _bf16_pair_halves(bits)
        even = (even * rstd + shift) * w_even + b_even
        odd = (odd * rstd + shift) * w_odd + b_odd
        _encode_store_mxfp4_tile(even, odd, slot, pages_ptr, num_slots, page_stride, D, PAGE, INTERPRET, STREAM,
                                 KEEP, True)
    else:
        _norm_store_mxfp4_tile(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
                               D, PAGE, INTERPRET, STREAM, KEEP, True)


@triton.jit
def _norm_store_mxfp4_tile_any(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
    FINITE: tl.constexpr, MOMENTS: tl.constexpr,
):
    """One tile: the tensor-core moments where they apply (``MOMENTS`` on the ``FINITE`` copy), else two passes."""
    if MOMENTS and FINITE:
        _norm_store_mxfp4_tile_moments(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even,
                                       b_odd, D, PAGE, INTERPRET, STREAM, KEEP)
    else:
        _norm_store_mxfp4_tile(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
                               D, PAGE, INTERPRET, STREAM, KEEP, FINITE)


@triton.jit
def _norm_store_mxfp4_tiles(
    k_ptr, slot_ptr, pages_ptr, num_tokens, num_slots, stride_kt, page_stride, eps,
    w_even, w_odd, b_even, b_odd, pair,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr,
    STREAM: tl.constexpr, KEEP: tl.constexpr, PREFETCH: tl.constexpr, FINITE: tl.constexpr,
    MOMENTS: tl.constexpr,
):
    """The tile loop of :func:`_norm_store_mxfp4_loop_kernel` (tiles program_id, + programs, ...).

    With ``PREFETCH`` the loop is unrolled by two, tiles a and b: b's keys load while a is
    computed and the next a's while b is, so each load lands in registers that just went
    free (a loop-carried "next tile" needs ~30 register moves a tile; H200, 1M tokens:
    125.1 -> 122.2 us). Past the last tile the loads are masked off and the slots are -1,
    so an odd tile count needs no tail.
    """
    offs_tt = tl.arange(0, BLOCK_T)
    tile = loop_bound(tl.program_id(0))
    step = loop_bound(tl.num_programs(0))
    num_tiles = loop_bound(tl.cdiv(num_tokens, BLOCK_T))
    params = (pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd)
    if PREFETCH:
        bits_a, slot_a = _load_key_pairs(k_ptr, slot_ptr, tile * BLOCK_T + offs_tt, pair, num_tokens, stride_kt,
                                         STREAM)
        for t in range(tile, num_tiles, loop_bound(2 * step)):
            bits_b, slot_b = _load_key_pairs(k_ptr, slot_ptr, (t + step) * BLOCK_T + offs_tt, pair, num_tokens,
                                             stride_kt, STREAM)
            _norm_store_mxfp4_tile_any(bits_a, slot_a, *params, D, PAGE, INTERPRET, STREAM, KEEP, FINITE, MOMENTS)
            bits_a, slot_a = _load_key_pairs(k_ptr, slot_ptr, (t + 2 * step) * BLOCK_T + offs_tt, pair, num_tokens,
                                             stride_kt, STREAM)
            _norm_store_mxfp4_tile_any(bits_b, slot_b, *params, D, PAGE, INTERPRET, STREAM, KEEP, FINITE, MOMENTS)
    else:
        for t in range(tile, num_tiles, step):
            bits, slot = _load_key_pairs(k_ptr, slot_ptr, t * BLOCK_T + offs_tt, pair, num_tokens, stride_kt, STREAM)
            _norm_store_mxfp4_tile_any(bits, slot, *params, D, PAGE, INTERPRET, STREAM, KEEP, FINITE, MOMENTS)


@triton.jit
def _norm_store_mxfp4_loop_kernel(
    k_ptr,          # [num_tokens, D] bf16, rows contiguous and 4-byte aligned, row stride stride_kt
    w_ptr, b_ptr,   # [D] fp32 LayerNorm weight and bias, 8-byte aligned
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], 4-byte aligned
    num_tokens, num_slots, stride_kt, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr,
    HINTS: tl.constexpr, PREFETCH: tl.constexpr, FAST: tl.constexpr, MOMENTS: tl.constexpr,
):
    # The fused LayerNorm + MXFP4 store of _store_mxfp4_kernel (ENCODE=1: same layout, one
    # thread a 32-value group, and the same encoder) as a loop over tiles of BLOCK_T tokens.
    # Weight and bias stay in registers (reloading them each tile was a third of the L1
    # requests); with PREFETCH the next tile's keys load while this one is computed. MOMENTS
    # (on the FAST copy only): the LayerNorm statistics come from the tensor cores
    # (_norm_store_mxfp4_tile_moments; the bytes of ENCODE=1 but for LayerNorm last bits,
    # ~2e-7 of the codes on random keys).
    # FAST: with |weight|, |bias| <= 2**100 and eps >= 2**-100 no LayerNorm output is inf
    # (|(k - mean) * rstd| <= sqrt(D), or tiny when the variance underflows), so the encoder drops
    # its inf guards (2 instructions an element); checked once a program, and a separate copy of
    # the loop for each answer keeps the branch out of the loop (and the registers of both paths
    # out of each other's way).
    STREAM: tl.constexpr = "evict_first" if HINTS >= 2 else ""
    KEEP: tl.constexpr = "evict_last" if HINTS >= 1 else ""
    offs_g4 = tl.arange(0, D // 32)[:, None, None, None]
    pair = offs_g4 * 16 + tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    wb_pair = pair + 0 * tl.arange(0, BLOCK_T)[None, :, None, None]                       # [G, BLOCK_T, 4, 4]
    w_even, w_odd = _load_pair_halves(w_ptr, wb_pair, wb_pair >= 0, True)
    b_even, b_odd = _load_pair_halves(b_ptr, wb_pair, wb_pair >= 0, True)
    args = (k_ptr, slot_ptr, pages_ptr, num_tokens, num_slots, stride_kt, page_stride, eps,
            w_even, w_odd, b_even, b_odd, pair)
    finite = False
    if FAST:
        wb_max = tl.maximum(tl.maximum(tl.abs(w_even), tl.abs(w_odd)), tl.maximum(tl.abs(b_even), tl.abs(b_odd)))
        wb_max = tl.max(tl.max(tl.max(tl.max(wb_max, axis=3), axis=2), axis=1), axis=0)
        finite = (wb_max <= 2.0 ** 100) & (eps >= 2.0 ** -100)
    if finite:
        _norm_store_mxfp4_tiles(*args, D, PAGE, INTERPRET, BLOCK_T, STREAM, KEEP, PREFETCH, True, MOMENTS)
    else:
        _norm_store_mxfp4_tiles(*args, D, PAGE, INTERPRET, BLOCK_T, STREAM, KEEP, PREFETCH, False, MOMENTS)


def _tokens_per_program(num_tokens: int, block: int) -> int:
    return max(1, min(triton.next_power_of_2(num_tokens), _ELEMENTS_PER_PROGRAM // block, 64))


#: Up to this many tokens a store is one-warp programs of SMALL_TOKENS_PER_PROGRAM tokens: its time is
#: latency (a launch, one memory round trip and the reductions), and one warp keeps the reductions
#: out of shared memory. H200, in a CUDA graph, two runs (``small_store_probe*.log``): MXFP4 fused
#: 1.72-1.75 -> 1.54-1.55 us at 1 token, 1.87-1.89 -> 1.64-1.66 us at 64; FP8 the same or better,
#: within the +-0.15 us that one shape moves between timings.
SMALL_BATCH = 64
SMALL_TOKENS_PER_PROGRAM = 2


def launch_store(k: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor, fmt: str,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 eps: float = 0.0, tokens_per_program: int | None = None, num_warps: int | None = None,
                 hints: int | None = None, mxfp4_variant: int | None = None) -> None:
    """Quantize ``k [T, D]`` (LayerNorm first when ``weight`` is given) into ``pages`` at ``slot_mapping``.

    ``tokens_per_program`` and ``num_warps`` override the launch shape (the benchmark sweeps them;
    at 1M tokens on the H200: FP8 16 tokens and 2 warps, MXFP4 32 tokens and 2 warps; the MXFP4
    tile loop, variant 2, has its own in :func:`launch_norm_mxfp4_loop`; up to :data:`SMALL_BATCH`
    tokens, one warp and :data:`SMALL_TOKENS_PER_PROGRAM` tokens); ``hints`` overrides
    :data:`STORE_HINTS` and ``mxfp4_variant`` :data:`MXFP4_ENCODE`.
    """
    hints = STORE_HINTS if hints is None else hints
    num_tokens, head_dim = k.shape
    if num_tokens == 0:
        return
    if num_tokens <= SMALL_BATCH:
        tokens_per_program = tokens_per_program or SMALL_TOKENS_PER_PROGRAM
        num_warps = num_warps or 1
    num_warps = num_warps or 2
    if pages.stride(1) * KERNEL_PAGE_SIZE > pages.stride(0) and pages.shape[0] > 1:
        raise ValueError("pages overlap: stride(0) is smaller than one page")
    if pages.stride(2) != 1:
        raise ValueError("each page entry must be contiguous (pages.stride(2) == 1)")
    if pages.data_ptr() % 4 or pages.stride(0) % 4:
        raise ValueError("indexer pages must be 4-byte aligned: values and scales are stored as 32-bit words")
    norm = weight is not None
    args = (k, weight if norm else k, bias if norm else k, slot_mapping, pages,
            num_tokens, pages.shape[0] * KERNEL_PAGE_SIZE, k.stride(0), k.stride(1), pages.stride(0), float(eps))
    if fmt == "fp8":
        block_d = triton.next_power_of_2(head_dim)
        block_t = tokens_per_program or _tokens_per_program(num_tokens, block_d)
        _store_fp8_kernel[(triton.cdiv(num_tokens, block_t),)](
            *args, D=head_dim, PAGE=KERNEL_PAGE_SIZE, NORM=norm, INTERPRET=interpreting(),
            BLOCK_T=block_t, BLOCK_D=block_d, HINTS=hints, num_warps=num_warps)
        return
    pairs = k.dtype == torch.bfloat16 and k.stride(1) == 1 and k.stride(0) % 2 == 0 and k.data_ptr() % 4 == 0
    norm_pairs = norm and all(t.dtype == torch.float32 and t.data_ptr() % 8 == 0 for t in (weight, bias))
    block_g = triton.next_power_of_2(head_dim // MXFP4_GROUP_SIZE)
    # Large batches: two rows a thread (32 tokens, 2 warps) was fastest at 1M tokens on the H200;
    # small ones keep one row a thread, the shortest path through a program.
    block_t = tokens_per_program or (32 if num_tokens >= _LARGE_BATCH else
                                     _tokens_per_program(num_tokens, block_g * MXFP4_GROUP_SIZE))
    encode = MXFP4_ENCODE if mxfp4_variant is None else mxfp4_variant
    if args[6] >= 2**31:
        encode = 0  # the lean encoder does page/row math on 32-bit slots
    if encode == 2:
        # Small batches by default keep the one-tile programs (no loop set-up to pay for).
        large = num_tokens >= _LARGE_BATCH or mxfp4_variant == 2
        whole_groups = head_dim % 128 == 0 and block_g * MXFP4_GROUP_SIZE == head_dim
        if large and norm and pairs and norm_pairs and whole_groups:
            launch_norm_mxfp4_loop(k, pages, slot_mapping, weight, bias, eps, hints=hints)
            return
        encode = 1
    _store_mxfp4_kernel[(triton.cdiv(num_tokens, block_t),)](
        *args, D=head_dim, PAGE=KERNEL_PAGE_SIZE, NORM=norm, PAIRS=pairs, NORM_PAIRS=norm_pairs, INTERPRET=interpreting(),
        BLOCK_T=block_t, BLOCK_G=block_g, HINTS=hints, ENCODE=encode,
        EXACT=norm or k.dtype == torch.float32, num_warps=num_warps)


def launch_norm_mxfp4_loop(k: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor, eps: float, *, hints: int,
                           tokens_per_tile: int = 8, num_warps: int = 1, programs_per_sm: int = 20,
                           prefetch: bool = True, fast: bool = True, maxnreg: int | None = None,
                           moments: bool = True) -> None:
    """Fused LayerNorm + MXFP4 store by ``_norm_store_mxfp4_loop_kernel`` (``mxfp4_variant=2``): bf16
    keys with contiguous rows, fp32 ``weight``/``bias``, ``head_dim`` a multiple of 128 and a power
    of two (:func:`launch_store` checks). ``programs_per_sm`` x SMs programs loop over the tiles.

    The defaults were fastest at 1M tokens on the H200 (``kstore_moments_probe*.log``): one warp,
    8-token tiles (the moments' all-tokens-well-conditioned test is then one warp reduction, no
    barrier), 20 programs an SM. ``moments=False`` keeps the two-pass LayerNorm of variant 1
    (16-token tiles and 2 warps were its best shape: pass them too).
    """
    num_tokens, head_dim = k.shape
    grid = (min(triton.cdiv(num_tokens, tokens_per_tile), programs_per_sm * (sm_count(k.device) or 4)),)
    _norm_store_mxfp4_loop_kernel[grid](
        k, weight, bias, slot_mapping, pages,
        num_tokens, pages.shape[0] * KERNEL_PAGE_SIZE, k.stride(0), pages.stride(0), float(eps),
        D=head_dim, PAGE=KERNEL_PAGE_SIZE, INTERPRET=interpreting(), BLOCK_T=tokens_per_tile,
        HINTS=hints, PREFETCH=prefetch, FAST=fast, MOMENTS=moments, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))


@triton.jit
def _gather_kernel(
    pages_ptr,        # uint8 [num_pages, PAGE, entry], page stride page_stride
    block_table_ptr,  # int32 [num_reqs, max_pages], row stride bt_stride
    cu_seqlens_ptr,   # int32 [num_reqs + 1]
    values_ptr,       # uint8 [num_tokens, VALUE_BYTES]
    scales_ptr,       # uint8 [num_tokens, SCALE_BYTES]
    num_tokens, num_reqs, num_pages, max_pages, bt_stride, page_stride,
    SEARCH_STEPS: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    # Request of each token: the last r with cu_seqlens[r] <= t (binary search; empty requests skipped).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens_ptr + mid, mask=mask_t, other=0) <= offs_t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    position = offs_t - tl.load(cu_seqlens_ptr + lo, mask=mask_t, other=0)
    page_index = position // PAGE
    in_table = mask_t & (page_index < max_pages)
    page = tl.load(block_table_ptr + lo.to(tl.int64) * bt_stride + page_index, mask=in_table, other=-1)
    valid = in_table & (page >= 0) & (page < num_pages)
    row = position % PAGE
    page_ptr = pages_ptr + page.to(tl.int64) * page_stride

    offs_v = tl.arange(0, BLOCK_V)
    mask_v = valid[:, None] & (offs_v < VALUE_BYTES)[None, :]
    v = tl.load(page_ptr[:, None] + row[:, None] * VALUE_BYTES + offs_v[None, :], mask=mask_v, other=0)
    out_t = offs_t.to(tl.int64)[:, None]
    tl.store(values_ptr + out_t * VALUE_BYTES + offs_v[None, :], v,
             mask=mask_t[:, None] & (offs_v < VALUE_BYTES)[None, :])

    offs_s = tl.arange(0, BLOCK_S)
    mask_s = valid[:, None] & (offs_s < SCALE_BYTES)[None, :]
    s = tl.load(page_ptr[:, None] + PAGE * VALUE_BYTES + row[:, None] * SCALE_BYTES + offs_s[None, :],
                mask=mask_s, other=0)
    tl.store(scales_ptr + out_t * SCALE_BYTES + offs_s[None, :], s,
             mask=mask_t[:, None] & (offs_s < SCALE_BYTES)[None, :])


def launch_gather(pages: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                  values: torch.Tensor, scales: torch.Tensor) -> None:
    """Copy each token's entry bytes into ``values [T, value_bytes]`` and ``scales [T, scale_bytes]`` (uint8)."""
    num_tokens, value_bytes = values.shape
    scale_bytes = scales.shape[1]
    if num_tokens == 0:
        return
    if not (values.is_contiguous() and scales.is_contiguous()) or values.dtype != torch.uint8:
        raise ValueError("gather outputs must be contiguous uint8 byte views")
    if pages.stride(1) != value_bytes + scale_bytes or pages.stride(2) != 1:
        raise ValueError("pages must have contiguous entries of value_bytes + scale_bytes")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    num_reqs = cu_seqlens.shape[0] - 1
    block_v = triton.next_power_of_2(value_bytes)
    block_t = _tokens_per_program(num_tokens, block_v)
    grid = (triton.cdiv(num_tokens, block_t),)
    _gather_kernel[grid](
        pages, block_table, cu_seqlens, values, scales,
        num_tokens, num_reqs, pages.shape[0], block_table.shape[1], block_table.stride(0), pages.stride(0),
        SEARCH_STEPS=max(1, num_reqs).bit_length(), VALUE_BYTES=value_bytes, SCALE_BYTES=scale_bytes,
        PAGE=KERNEL_PAGE_SIZE,
        BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_S=triton.next_power_of_2(scale_bytes), num_warps=4,
    )


@triton.jit
def _e2m1_decode(code):
    """e2m1 codes (int32 0..15) -> fp32 {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign."""
    c = (code & 7).to(tl.float32)
    mag = tl.where(c < 4.0, c * 0.5, tl.where(c < 6.0, c - 2.0, (c - 4.0) * 2.0))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _dequant_kernel(
    values_ptr,  # uint8 [T, D] (FP8 codes) or [T, D/2] (packed e2m1)
    scales_ptr,  # fp32 [T] (FP8) or uint8 [T, D/32] (UE8M0)
    out_ptr,     # fp32 [T, D]
    num_tokens,
    D: tl.constexpr, FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    rows = offs_t.to(tl.int64)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    if FORMAT == 0:
        codes = tl.load(values_ptr + rows * D + offs_d[None, :], mask=mask, other=0)
        scale = tl.load(scales_ptr + offs_t, mask=mask_t, other=0.0)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    else:
        offs_b = tl.arange(0, BLOCK_D // 2)
        mask_b = mask_t[:, None] & (offs_b < D // 2)[None, :]
        packed = tl.load(values_ptr + rows * (D // 2) + offs_b[None, :], mask=mask_b, other=0)
        packed = packed.to(tl.int32)
        pairs = tl.join(_e2m1_decode(packed & 0xF), _e2m1_decode(packed >> 4))
        offs_g = tl.arange(0, BLOCK_D // 32)
        mask_g = mask_t[:, None] & (offs_g < D // 32)[None, :]
        biased = tl.load(scales_ptr + rows * (D // 32) + offs_g[None, :], mask=mask_g, other=0).to(tl.int32)
        # Biased exponent 0 is 2**-127, an fp32 subnormal with bit pattern 1 << 22.
        scale = tl.where(biased == 0, 1 << 22, biased << 23).to(tl.float32, bitcast=True)
        groups = tl.reshape(pairs, (BLOCK_T, BLOCK_D // 32, 32)) * scale[:, :, None]
        x = tl.reshape(groups, (BLOCK_T, BLOCK_D))
    tl.store(out_ptr + rows * D + offs_d[None, :], x, mask=mask)


def launch_dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: str) -> None:
    """Decode contiguous ``values``/``scales`` rows (uint8 / fp32 views) into ``out [T, D]`` fp32."""
    num_tokens, head_dim = out.shape
    if num_tokens == 0:
        return
    if not (values.is_contiguous() and scales.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequantize needs contiguous values, scales and output")
    block_d = max(triton.next_power_of_2(head_dim), MXFP4_GROUP_SIZE)
    block_t = _tokens_per_program(num_tokens, block_d)
    grid = (triton.cdiv(num_tokens, block_t),)
    _dequant_kernel[grid](values, scales, out, num_tokens, D=head_dim, FORMAT=FORMAT_IDS[fmt],
                          BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
