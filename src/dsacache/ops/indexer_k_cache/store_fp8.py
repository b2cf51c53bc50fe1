"""FP8 store kernel: keys (LayerNorm first when ``NORM``) -> e4m3 values and one fp32 scale a token.

Small batches (up to 64 tokens) run it as one-warp programs of 2 tokens, where its time is a
launch plus a chain of dependent steps; the LayerNorm's part of that chain is kept short by
taking the mean and variance from raw moments (``MOMENTS``, below; larger batches keep the exact
two passes, ``launch.STORE_MOMENTS``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.dispatch import interpreting
from dsacache.ops.indexer_k_cache.codecs import (
    ceil_pow2_exponent,
    e4m3_encode_int,
    exact_rstd,
    finite_abs,
    pow2,
    raw_moment_stats,
    rsqrt_approx,
    sums_and_squares,
)

if not interpreting():  # the PDL instructions exist only compiled
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def store_fp8_kernel(
    k_ptr,          # [num_tokens, D] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    w_ptr, b_ptr,   # [D] LayerNorm weight and bias (read only when NORM)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], page stride page_stride
    num_tokens, num_slots, stride_kt, stride_kd, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with PDL: the next kernel may start now; wait for the last one's writes
    MOMENTS: tl.constexpr = "two_pass",  # LayerNorm statistics (launch.STORE_MOMENTS): "raw" or "two_pass"
):
    # MOMENTS="raw": the sum and the sum of squares come from one reduction (their shuffles
    # interleave), var = E[x**2] - mean**2 and rsqrt.approx: one reduction and one MUFU op before
    # the output instead of two reductions and the IEEE sqrt and division of "two_pass". A
    # program with a token the raw variance cannot serve (codecs.raw_moment_stats: cancellation,
    # NaN, inf) takes the exact two-pass statistics for all its tokens. Either is applied to the
    # centred keys, not in the tile loop's shift form (x * rstd - mean * rstd): the subtraction
    # runs beside the variance's chain instead of adding a step after rsqrt, and x == mean stays
    # an exact zero (times an infinite weight: NaN, as in the reference), so the raw rule needs no
    # bound on the LayerNorm parameters (the loop's FINITE).
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_t = offs_t < num_tokens
    # The key load does not wait for the slot load: both are in flight at once.
    k_rows = k_ptr + offs_t.to(tl.int64)[:, None] * stride_kt + offs_d[None, :] * stride_kd
    x = tl.load(k_rows, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_D]
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    if NORM:
        if BLOCK_T <= 4:
            # Weight and bias in the keys' shape (every row reads the same addresses), hence in their
            # layout: a [BLOCK_D] vector would reach it through shuffles placed after rstd, in the chain.
            wb_offs = offs_d[None, :] + 0 * offs_t[:, None]
            w = tl.load(w_ptr + wb_offs, mask=mask_d[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptr + wb_offs, mask=mask_d[None, :], other=0.0).to(tl.float32)
        else:
            # A copy a row would cost registers (72 -> 96 a thread at 16 tokens); large programs are not
            # latency-bound.
            w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        if MOMENTS == "raw":
            total, squares = sums_and_squares(x, 1)          # masked elements load as 0: no effect
            mean, var, well = raw_moment_stats(total, squares, D)
            # Issued before the guard's verdict, so the program-wide test runs beside it.
            rstd = rsqrt_approx(var + eps, INTERPRET)
        else:
            mean = tl.sum(x, axis=1) / D
        centered = x - mean[:, None]
        if D != BLOCK_D:
            centered = tl.where(mask_d[None, :], centered, 0.0)
        if MOMENTS == "raw":
            if tl.min(well.to(tl.int32), axis=0) == 0:
                rstd = exact_rstd(tl.sum(centered * centered, axis=1) / D, eps)
        else:
            rstd = exact_rstd(tl.sum(centered * centered, axis=1) / D, eps)
        if BLOCK_T > 4:
            w = w[None, :]
            b = b[None, :]
        x = centered * rstd[:, None] * w + b
    amax = tl.maximum(tl.max(finite_abs(x, INTERPRET), axis=1), 1e-4)
    # 448 = 1.75 * 2**8: mantissa limit 0x600000, shift 8.
    exp = ceil_pow2_exponent(amax, 0x600000, 8)
    y = x * pow2(-exp)[:, None]
    if INTERPRET:
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
        codes = e4m3_encode_int(y).to(tl.uint8)
    else:
        # The hardware cast (cvt.rn.satfinite) saturates inf to +-448 and keeps NaN: no clamp.
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    page_ptr = pages_ptr + (slot // PAGE) * page_stride
    row = slot % PAGE
    tl.store(page_ptr[:, None] + row[:, None] * D + offs_d[None, :], codes, mask=valid[:, None] & mask_d[None, :])
    # Scales are 4-byte pieces of 32-byte sectors that other tokens of the page fill later: kept
    # in L2, a page's sectors leave it whole instead of as partial writes.
    scale_ptr = (page_ptr + PAGE * D + row * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, pow2(exp), mask=valid, eviction_policy="evict_last")
