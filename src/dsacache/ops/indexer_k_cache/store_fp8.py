"""FP8 store kernel: keys (LayerNorm first when ``NORM``) -> e4m3 values and one fp32 scale a token."""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.dispatch import interpreting
from dsacache.ops.indexer_k_cache.codecs import ceil_pow2_exponent, e4m3_encode_int, finite_abs, pow2

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
):
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
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        centered = x - mean[:, None]
        if D != BLOCK_D:
            centered = tl.where(mask_d[None, :], centered, 0.0)
        var = tl.sum(centered * centered, axis=1) / D
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        x = centered * rstd[:, None] * w[None, :] + b[None, :]
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
