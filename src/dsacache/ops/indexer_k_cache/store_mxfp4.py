"""MXFP4 store kernel, one tile of tokens a program: keys (LayerNorm first when ``NORM``) -> packed
e2m1 values and one UE8M0 scale byte a 32-value group.

Small batches (up to 64 tokens) run it as one-warp programs of 2 tokens, where its time is a
launch plus a chain of dependent steps; the LayerNorm's part of that chain is kept short by
taking the mean and variance from raw moments (``MOMENTS``, as in ``store_fp8.py``). The fused
LayerNorm store of large bf16 batches runs the tile loop of ``store_mxfp4_loop.py`` instead;
``launch.py`` picks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.dispatch import interpreting
from dsacache.ops.indexer_k_cache.codecs import (
    bf16_pair_halves,
    clamped_magnitude,
    e2m1_code_bits,
    exact_rstd,
    load_pair_halves,
    mxfp4_norm_codes,
    mxfp4_scale,
    pack_e2m1_words,
    page_and_row32,
    raw_moment_stats,
    row_moments,
    row_sum,
    rsqrt_approx,
)

if not interpreting():  # the PDL instructions exist only compiled
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def store_mxfp4_kernel(
    k_ptr,          # [num_tokens, D] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    w_ptr, b_ptr,   # [D] LayerNorm weight and bias (read only when NORM)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], 4-byte aligned
    num_tokens, num_slots, stride_kt, stride_kd, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, PAIRS: tl.constexpr, NORM_PAIRS: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, EXACT: tl.constexpr,
    SLOTS64: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with PDL: the next kernel may start now; wait for the last one's writes
    MOMENTS: tl.constexpr = "two_pass",  # LayerNorm statistics (launch.STORE_MOMENTS): "raw" or "two_pass"
):
    # Pairs [BLOCK_G, BLOCK_T, 4, 4] (codecs.py): l is one 16-byte vector and the load layout
    # spreads lanes over g, then t, so j is a register repeat: one thread owns whole 32-value
    # groups (no shuffles for the group max), both nibbles of each byte (no split), and the
    # 4 bytes of l pack into one 32-bit word.
    # SLOTS64: a pool of 2**31 slots or more; page and row then take 64-bit math.
    # MOMENTS: the LayerNorm statistics, as in store_fp8_kernel.
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    offs_g = tl.arange(0, BLOCK_G)
    offs_g4 = offs_g[:, None, None, None]
    pair = offs_g4 * 16 + tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    mask_g4 = offs_g4 < D // 32
    mask = mask_t[None, :, None, None] & mask_g4
    rows = k_ptr + offs_t.to(tl.int64)[None, :, None, None] * stride_kt
    if PAIRS:
        # bf16 keys with contiguous rows: one 32-bit load per pair, bf16 -> fp32 is a shift or a mask.
        bits = tl.load(rows.to(tl.pointer_type(tl.int32)) + pair, mask=mask, other=0)
        even, odd = bf16_pair_halves(bits)
    else:
        even = tl.load(rows + (2 * pair) * stride_kd, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(rows + (2 * pair + 1) * stride_kd, mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1)
    if SLOTS64:
        slot = slot.to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    if NORM:
        # weight and bias in the keys' shape (every row reads the same addresses), hence the
        # same layout: no conversion. Small programs load them first, so the loads overlap the
        # reductions; with two rows a thread that costs 40 registers and occupancy, so large
        # ones load them last.
        wb_pair = pair + 0 * offs_t[None, :, None, None]
        if BLOCK_T <= 16:
            w_even, w_odd = load_pair_halves(w_ptr, wb_pair, mask_g4, NORM_PAIRS)
            b_even, b_odd = load_pair_halves(b_ptr, wb_pair, mask_g4, NORM_PAIRS)
        if MOMENTS == "raw":
            total, squares = row_moments(even, odd)          # masked pairs load as 0: no effect
            mean, var, well = raw_moment_stats(total, squares, D)
            # Issued before the guard's verdict, so the program-wide test runs beside it.
            rstd = rsqrt_approx(var + eps, INTERPRET)
        else:
            mean = row_sum(even + odd) / D
        even = even - mean[None, :, None, None]
        odd = odd - mean[None, :, None, None]
        if D != BLOCK_G * 32:
            even = tl.where(mask_g4, even, 0.0)
            odd = tl.where(mask_g4, odd, 0.0)
        if MOMENTS == "raw":
            if tl.min(well.to(tl.int32), axis=0) == 0:
                rstd = exact_rstd(row_sum(even * even + odd * odd) / D, eps)
        else:
            rstd = exact_rstd(row_sum(even * even + odd * odd) / D, eps)
        rstd = rstd[None, :, None, None]
        if BLOCK_T > 16:
            w_even, w_odd = load_pair_halves(w_ptr, wb_pair, mask_g4, NORM_PAIRS)
            b_even, b_odd = load_pair_halves(b_ptr, wb_pair, mask_g4, NORM_PAIRS)
        even = even * rstd * w_even + b_even
        odd = odd * rstd * w_odd + b_odd
        # The LayerNorm output is an FFMA result (canonical NaN): it gives the signs.
        exp, v_even, v_odd = mxfp4_norm_codes(even, odd, EXACT, INTERPRET, False)
    else:
        exp, inv_scale = mxfp4_scale(even, odd, INTERPRET, False)
        # Raw keys may hold -NaN: the signs come from the scaled values (an FMUL) instead.
        even = even * inv_scale[:, :, None, None]
        odd = odd * inv_scale[:, :, None, None]
        v_even = e2m1_code_bits(clamped_magnitude(even, INTERPRET), 0, EXACT, INTERPRET)
        v_odd = e2m1_code_bits(clamped_magnitude(odd, INTERPRET), 0, EXACT, INTERPRET)
    words = pack_e2m1_words(v_even, v_odd, even, odd, INTERPRET)           # [BLOCK_G, BLOCK_T, 4 (j)]
    if SLOTS64:
        page_ptr = pages_ptr + (slot // PAGE) * page_stride
        row = slot % PAGE
    else:
        page_ptr, row = page_and_row32(pages_ptr, slot, page_stride, PAGE)
    word_ptr = (page_ptr + row * (D // 2)).to(tl.pointer_type(tl.int32))[None, :, None]
    offs_w = offs_g[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    tl.store(word_ptr + offs_w, words, mask=valid[None, :, None] & (offs_g < D // 32)[:, None, None])
    # Scales are pieces of 32-byte sectors that other tokens of the page fill later: kept in
    # L2, a page's sectors leave it whole instead of as partial writes.
    if D % 128 == 0 and BLOCK_G == D // 32:
        # A token's scale bytes are whole 4-byte aligned words: one 32-bit store per 4 groups.
        shifted = (exp + 127) << (8 * (offs_g % 4))[:, None]
        scale_words = tl.sum(tl.reshape(shifted, (BLOCK_G // 4, 4, BLOCK_T)), axis=1)   # [BLOCK_G / 4, BLOCK_T]
        scale_ptr = (page_ptr + PAGE * (D // 2) + row * (D // 32)).to(tl.pointer_type(tl.int32))
        tl.store(scale_ptr[None, :] + tl.arange(0, BLOCK_G // 4)[:, None], scale_words,
                 mask=valid[None, :], eviction_policy="evict_last")
    else:
        scale_ptr = page_ptr[None, :] + PAGE * (D // 2) + row[None, :] * (D // 32) + offs_g[:, None]
        tl.store(scale_ptr, (exp + 127).to(tl.uint8), mask=valid[None, :] & (offs_g < D // 32)[:, None],
                 eviction_policy="evict_last")
