"""Fused LayerNorm + MXFP4 store for large batches of bf16 keys: programs loop over tiles of tokens.

The same layout and encoder as the one-tile kernel of ``store_mxfp4.py`` (one thread a 32-value
group), as a loop over tiles of ``BLOCK_T`` tokens. Weight and bias stay in registers across the
tiles (reloading them each tile was a third of the L1 requests), and the next tile's keys load
while this one is computed. The LayerNorm statistics come from the tensor cores (raw moments;
the bytes of the one-tile kernel but for LayerNorm last bits, ~2e-7 of the codes on random
keys); a tile where they would cancel or meet NaN/inf takes the exact two-pass LayerNorm.
Preconditions (``launch.py`` checks them): bf16 keys with contiguous, 4-byte aligned rows;
fp32, 8-byte aligned weight and bias; ``D`` a power of two and a multiple of 128; fewer
than ``2**31`` slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.indexer_k_cache.codecs import (
    bf16_pair_halves,
    exact_rstd,
    load_pair_halves,
    mxfp4_norm_codes,
    pack_e2m1_words,
    page_and_row32,
    raw_moment_stats,
    row_moments,
    row_sum,
    rsqrt_approx,
)
from dsacache.ops.triton_utils import loop_bound


@triton.jit
def _load_key_pairs(k_ptr, slot_ptr, offs_t, pair, num_tokens, stride_kt):
    """Rows ``offs_t`` of contiguous bf16 keys as 32-bit pairs ``[G, T, 4, 4]`` and their slots
    (rows past ``num_tokens``: no load, slot -1)."""
    mask_t = offs_t < num_tokens
    rows = k_ptr + offs_t.to(tl.int64)[None, :, None, None] * stride_kt
    bits = tl.load(rows.to(tl.pointer_type(tl.int32)) + pair, mask=mask_t[None, :, None, None], other=0)
    return bits, tl.load(slot_ptr + offs_t, mask=mask_t, other=-1)


@triton.jit
def _encode_store_tile(
    even, odd, slot, pages_ptr, num_slots, page_stride,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, FINITE: tl.constexpr,
):
    """LayerNorm outputs ``[G, T, 4, 4]`` (even and odd elements) -> MXFP4 words and scales at their slots."""
    offs_g = tl.arange(0, D // 32)
    valid = (slot >= 0) & (slot < num_slots)
    exp, v_even, v_odd = mxfp4_norm_codes(even, odd, True, INTERPRET, FINITE)
    words = pack_e2m1_words(v_even, v_odd, even, odd, INTERPRET)                   # [G, BLOCK_T, 4]
    page_ptr, row = page_and_row32(pages_ptr, slot, page_stride, PAGE)
    word_ptr = (page_ptr + row * (D // 2)).to(tl.pointer_type(tl.int32))[None, :, None]
    offs_w = offs_g[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    tl.store(word_ptr + offs_w, words, mask=valid[None, :, None])
    # Each thread stores its group's scale byte: a token's 4 bytes leave in one instruction
    # (same sectors as one 32-bit store, without the shared-memory gather and its barrier);
    # kept in L2 until the page's other tokens fill their sectors.
    scale_ptr = page_ptr + PAGE * (D // 2) + row * (D // 32)
    tl.store(scale_ptr[None, :] + offs_g[:, None], (exp + 127).to(tl.uint8), mask=valid[None, :],
             eviction_policy="evict_last")


@triton.jit
def _two_pass_tile(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, FINITE: tl.constexpr,
):
    """One tile: keys as bf16 pairs ``[G, T, 4, 4]`` and their slots ``[T]`` (-1 or past the pool:
    skipped) -> exact LayerNorm (mean, then the variance of the centred values), encode, store."""
    even, odd = bf16_pair_halves(bits)
    mean = (row_sum(even + odd) / D)[None, :, None, None]
    even = even - mean
    odd = odd - mean
    rstd = exact_rstd(row_sum(even * even + odd * odd) / D, eps)[None, :, None, None]
    even = even * rstd * w_even + b_even
    odd = odd * rstd * w_odd + b_odd
    _encode_store_tile(even, odd, slot, pages_ptr, num_slots, page_stride, D, PAGE, INTERPRET, FINITE)


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
        total, squares = row_moments(*bf16_pair_halves(bits))
        return total[None, :], squares[None, :]
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
def _moments_tile(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """:func:`_two_pass_tile` with the variance from raw moments taken on the tensor cores
    (``var = E[x**2] - mean**2``, ``rsqrt.approx``) and ``y = (x * rstd - mean * rstd) * w + b``:
    two FMAs an element for the whole LayerNorm instead of five. A tile with a token the raw
    moments cannot serve (``codecs.raw_moment_stats``: cancellation, NaN, inf) takes the two-pass
    tile instead. Only for LayerNorm parameters that keep every output finite (the loop's
    ``FINITE`` copy): its encoder has no inf guards, and the shift form leaves a rounding residue
    where ``x == mean``, which an infinite weight would turn into inf instead of the reference's NaN."""
    total, squares = _row_moments(bits, INTERPRET)
    mean, var, well = raw_moment_stats(total, squares, D)
    if tl.min(well.to(tl.int32)) == 1:
        rstd = rsqrt_approx(var + eps, INTERPRET)
        shift = (-mean * rstd)[:, :, None, None]
        rstd = rstd[:, :, None, None]
        even, odd = bf16_pair_halves(bits)
        even = (even * rstd + shift) * w_even + b_even
        odd = (odd * rstd + shift) * w_odd + b_odd
        _encode_store_tile(even, odd, slot, pages_ptr, num_slots, page_stride, D, PAGE, INTERPRET, True)
    else:
        _two_pass_tile(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
                       D, PAGE, INTERPRET, True)


@triton.jit
def _tile(
    bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, FINITE: tl.constexpr,
):
    """One tile: the tensor-core moments on the ``FINITE`` copy, the two-pass LayerNorm on the other."""
    if FINITE:
        _moments_tile(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
                      D, PAGE, INTERPRET)
    else:
        _two_pass_tile(bits, slot, pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd,
                       D, PAGE, INTERPRET, False)


@triton.jit
def _tile_loop(
    k_ptr, slot_ptr, pages_ptr, num_tokens, num_slots, stride_kt, page_stride, eps,
    w_even, w_odd, b_even, b_odd, pair,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, FINITE: tl.constexpr,
):
    """The tile loop of :func:`norm_store_mxfp4_loop_kernel` (tiles program_id, + programs, ...).

    Unrolled by two, tiles a and b: b's keys load while a is computed and the next a's while b
    is, so each load lands in registers that just went free (a loop-carried "next tile" needs
    ~30 register moves a tile). Past the last tile the loads are masked off and the slots are
    -1, so an odd tile count needs no tail.
    """
    offs_tt = tl.arange(0, BLOCK_T)
    tile = loop_bound(tl.program_id(0))
    step = loop_bound(tl.num_programs(0))
    num_tiles = loop_bound(tl.cdiv(num_tokens, BLOCK_T))
    params = (pages_ptr, num_slots, page_stride, eps, w_even, w_odd, b_even, b_odd)
    bits_a, slot_a = _load_key_pairs(k_ptr, slot_ptr, tile * BLOCK_T + offs_tt, pair, num_tokens, stride_kt)
    for t in range(tile, num_tiles, loop_bound(2 * step)):
        bits_b, slot_b = _load_key_pairs(k_ptr, slot_ptr, (t + step) * BLOCK_T + offs_tt, pair, num_tokens,
                                         stride_kt)
        _tile(bits_a, slot_a, *params, D, PAGE, INTERPRET, FINITE)
        bits_a, slot_a = _load_key_pairs(k_ptr, slot_ptr, (t + 2 * step) * BLOCK_T + offs_tt, pair, num_tokens,
                                         stride_kt)
        _tile(bits_b, slot_b, *params, D, PAGE, INTERPRET, FINITE)


@triton.jit
def norm_store_mxfp4_loop_kernel(
    k_ptr,          # [num_tokens, D] bf16, rows contiguous and 4-byte aligned, row stride stride_kt
    w_ptr, b_ptr,   # [D] fp32 LayerNorm weight and bias, 8-byte aligned
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], 4-byte aligned
    num_tokens, num_slots, stride_kt, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # With |weight|, |bias| <= 2**100 and eps >= 2**-100 no LayerNorm output is inf
    # (|(k - mean) * rstd| <= sqrt(D), or tiny when the variance underflows), so the encoder drops
    # its inf guards (2 instructions an element) and the moments apply; checked once a program,
    # and a separate copy of the loop for each answer keeps the branch out of the loop (and the
    # registers of both paths out of each other's way).
    offs_g4 = tl.arange(0, D // 32)[:, None, None, None]
    pair = offs_g4 * 16 + tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    wb_pair = pair + 0 * tl.arange(0, BLOCK_T)[None, :, None, None]                       # [G, BLOCK_T, 4, 4]
    w_even, w_odd = load_pair_halves(w_ptr, wb_pair, wb_pair >= 0, True)
    b_even, b_odd = load_pair_halves(b_ptr, wb_pair, wb_pair >= 0, True)
    args = (k_ptr, slot_ptr, pages_ptr, num_tokens, num_slots, stride_kt, page_stride, eps,
            w_even, w_odd, b_even, b_odd, pair)
    wb_max = tl.maximum(tl.maximum(tl.abs(w_even), tl.abs(w_odd)), tl.maximum(tl.abs(b_even), tl.abs(b_odd)))
    wb_max = tl.max(tl.max(tl.max(tl.max(wb_max, axis=3), axis=2), axis=1), axis=0)
    finite = (wb_max <= 2.0 ** 100) & (eps >= 2.0 ** -100)
    if finite:
        _tile_loop(*args, D, PAGE, INTERPRET, BLOCK_T, True)
    else:
        _tile_loop(*args, D, PAGE, INTERPRET, BLOCK_T, False)
