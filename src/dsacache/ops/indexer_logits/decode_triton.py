"""Paged decode logits in Triton: one program scores ``TILES`` pages of one request's keys
against all of its ``next_n`` query rows (``tiles_triton`` for the tile math).

Every program owns a fixed range of output columns and writes all of them: scored pages
first, then ``-inf`` for the pages past the longest row, so no separate fill pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.indexer_logits.tiles_triton import (
    head_sum,
    key_columns,
    key_tile,
    load_queries,
    load_scales,
    store_tile,
)
from dsacache.ops.triton_utils import block_table_page, loop_bound


@triton.jit
def _query_row(q_ptr, w_ptr, lens_ptr, row0, b, r: tl.constexpr, d, NEXT_N: tl.constexpr, H: tl.constexpr,
               D: tl.constexpr, PER_ROW: tl.constexpr, max_model_len):
    """Query row ``r`` of request ``b`` (global row ``row0 + r``): its queries [H, D] (columns
    ``d``), head weights [H] and visible length (clamped to ``[0, max_model_len]``)."""
    h = tl.arange(0, H)
    q = tl.load(q_ptr + (row0 + r).to(tl.int64) * H * D + h[:, None] * D + d[None, :])
    w = tl.load(w_ptr + (row0 + r) * H + h)
    if PER_ROW:
        length = tl.load(lens_ptr + row0 + r)
    else:
        length = tl.load(lens_ptr + b) - NEXT_N + r + 1
    return q, w, tl.minimum(tl.maximum(length, 0), max_model_len)


@triton.jit
def _score_row(keys, q, w, factor, live, cols, length, out_row, num_cols):
    """One query row's logits for a tile: sum_h w * relu(keys . q[h]) * factor, -inf where not
    visible, stored at out_row[cols]."""
    scores = tl.sum(tl.maximum(tl.dot(keys, tl.trans(q)), 0.0) * w[None, :], axis=1) * factor
    scores = tl.where(live & (cols < length), scores, float("-inf"))
    tl.store(out_row + cols, scores, mask=cols < num_cols)


@triton.jit
def _page_row(page):
    """A page id from ``block_table_page`` as an int64 row index; an unusable page (-1) reads
    page 0, so the masked loads of its tile keep an address inside the pool."""
    return tl.maximum(page, 0).to(tl.int64)


@triton.jit
def paged_decode_kernel(
    q_ptr,            # [B * NEXT_N * H, D] e4m3
    w_ptr,            # [B * NEXT_N, H] fp32
    lens_ptr,         # [B, NEXT_N] int32 (PER_ROW) or [B] int32; clamped here to [0, max_model_len]
    values_ptr,       # FP8: [P, 64, D] e4m3; MXFP4: [P, 64, D/2] uint8   (page stride page_stride)
    scales_ptr,       # FP8: [P, 64] fp32;    MXFP4: [P, 64, D/32] uint8  (page stride scale_stride)
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [B * NEXT_N, max_model_len] fp32
    num_pages, max_blocks, bt_stride, page_stride, scale_stride, max_model_len, out_stride,
    NEXT_N: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PER_ROW: tl.constexpr,
    MXFP4: tl.constexpr, ALIGNED: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(1)
    col0 = tl.program_id(0) * (TILES * BLOCK_N)

    r = tl.arange(0, ROWS)
    row_ok = r < NEXT_N
    rows = b * NEXT_N + r
    if PER_ROW:
        lens = tl.load(lens_ptr + rows, mask=row_ok, other=0)
    else:  # one length a request: row r sees ctx - NEXT_N + r + 1 positions
        lens = tl.load(lens_ptr + b + 0 * r) - NEXT_N + r + 1
    lens = tl.where(row_ok, tl.minimum(tl.maximum(lens, 0), max_model_len), 0)
    longest = tl.max(lens, axis=0)

    d = key_columns(D, MXFP4, ALIGNED)
    if SPLIT:
        # One product per query row (N = H each) instead of one of N = NEXT_N * H: a quarter or
        # half the accumulator registers, so more programs an SM (up to 4 rows).
        row0 = b * NEXT_N
        q0, w0, len0 = _query_row(q_ptr, w_ptr, lens_ptr, row0, b, 0, d, NEXT_N, H, D, PER_ROW, max_model_len)
        q1, w1, len1 = _query_row(q_ptr, w_ptr, lens_ptr, row0, b, 1, d, NEXT_N, H, D, PER_ROW, max_model_len)
        if NEXT_N > 2:
            q2, w2, len2 = _query_row(q_ptr, w_ptr, lens_ptr, row0, b, 2, d, NEXT_N, H, D, PER_ROW, max_model_len)
        if NEXT_N > 3:
            q3, w3, len3 = _query_row(q_ptr, w_ptr, lens_ptr, row0, b, 3, d, NEXT_N, H, D, PER_ROW, max_model_len)
    else:
        m = tl.arange(0, ROWS * H)
        m_ok = (m // H) < NEXT_N
        w = tl.load(w_ptr + b * NEXT_N * H + m, mask=m_ok, other=0.0)
        q = load_queries(q_ptr + b * NEXT_N * H * D, m, m_ok, d, D)

    num_scored = loop_bound(tl.minimum(tl.maximum(tl.cdiv(longest - col0, BLOCK_N), 0), TILES))
    # A tile is one page. Its scales are loaded a tile ahead and their page id two ahead, so no
    # load in the loop waits for another (the key values are prefetched by Triton's pipeliner):
    # otherwise the scale load follows the block-table load and both latencies stall every tile.
    tok = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b * bt_stride
    blk0 = col0 // BLOCK_N  # a tile is one page
    page, ok = block_table_page(bt_row, blk0, num_scored > 0, max_blocks, num_pages)
    scales_next = load_scales(scales_ptr + _page_row(page) * scale_stride + tok * SCALES_PER_TOKEN,
                              ok & (col0 + tok < longest), SCALES_PER_TOKEN, MXFP4)
    page_ahead, ok_ahead = block_table_page(bt_row, blk0 + 1, num_scored > 1, max_blocks, num_pages)
    for t in range(num_scored):
        cols = col0 + t * BLOCK_N + tok
        scales = scales_next
        scales_next = load_scales(scales_ptr + _page_row(page_ahead) * scale_stride + tok * SCALES_PER_TOKEN,
                                  ok_ahead & (cols + BLOCK_N < longest), SCALES_PER_TOKEN, MXFP4)
        page_ahead, ok_ahead = block_table_page(bt_row, blk0 + t + 2, t + 2 < num_scored, max_blocks, num_pages)
        page, ok = block_table_page(bt_row, blk0 + t, True, max_blocks, num_pages)
        live = ok & (cols < longest)
        keys, factor = key_tile(values_ptr + _page_row(page) * page_stride + tok * VALUE_BYTES, scales, live, D,
                                MXFP4, ALIGNED)
        if SPLIT:
            out_row = out_ptr + (b * NEXT_N).to(tl.int64) * out_stride
            _score_row(keys, q0, w0, factor, live, cols, len0, out_row, max_model_len)
            _score_row(keys, q1, w1, factor, live, cols, len1, out_row + out_stride, max_model_len)
            if NEXT_N > 2:
                _score_row(keys, q2, w2, factor, live, cols, len2, out_row + 2 * out_stride, max_model_len)
            if NEXT_N > 3:
                _score_row(keys, q3, w3, factor, live, cols, len3, out_row + 3 * out_stride, max_model_len)
        else:
            scores = head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
            visible = live[:, None] & (cols[:, None] < lens[None, :])
            scores = tl.where(visible, scores, float("-inf"))
            store_tile(out_ptr, out_stride, rows, row_ok, cols, max_model_len, scores)

    blank = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
    for t in range(num_scored, TILES):
        cols = col0 + t * BLOCK_N + tok
        store_tile(out_ptr, out_stride, rows, row_ok, cols, max_model_len, blank)
