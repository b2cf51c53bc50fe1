"""Gather kernel: requests' cached entries, through their block tables, into contiguous rows (bytes copied).

A block that is past the table or whose entry is not a page of the pool gathers as zero bytes
(``block_table_page``, the rule of ``dsacache.runtime.block_table``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.triton_utils import block_table_page


@triton.jit
def gather_kernel(
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
    page, valid = block_table_page(block_table_ptr + lo.to(tl.int64) * bt_stride, position // PAGE, mask_t,
                                   max_pages, num_pages)
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
