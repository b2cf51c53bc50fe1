"""Ragged prefill logits in Triton: one program scores ``TILES`` tiles of the gathered keys
against ``ROWS`` query rows, each row inside its own key window ``[ks, ke)``
(``tiles_triton`` for the tile math). Every program writes all of its columns.
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
from dsacache.ops.triton_utils import loop_bound


@triton.jit
def ragged_prefill_kernel(
    q_ptr,            # [M * H, D] e4m3
    w_ptr,            # [M, H] fp32
    ks_ptr, ke_ptr,   # [M] int32, already clamped to [0, N]
    values_ptr,       # FP8: [N, D] e4m3; MXFP4: [N, D/2] uint8
    scales_ptr,       # FP8: [N] fp32;    MXFP4: [N, D/32] uint8
    out_ptr,          # [M, N] fp32
    num_rows, num_keys, out_stride,
    ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    MXFP4: tl.constexpr, ALIGNED: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    row0 = tl.program_id(1) * ROWS
    col0 = tl.program_id(0) * (TILES * BLOCK_N)

    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    has_keys = ke > ks
    first = tl.min(tl.where(has_keys, ks, num_keys), axis=0)
    last = tl.max(tl.where(has_keys, ke, 0), axis=0)

    m = tl.arange(0, ROWS * H)
    m_ok = (row0 + m // H) < num_rows
    w = tl.load(w_ptr + row0 * H + m, mask=m_ok, other=0.0)
    q = load_queries(q_ptr + row0.to(tl.int64) * H * D, m, m_ok, key_columns(D, MXFP4, ALIGNED), D)

    # Tiles [lo, hi) of this program meet some row's window; the others are all -inf.
    lo = tl.minimum(tl.maximum((first - col0) // BLOCK_N, 0), TILES)
    hi = loop_bound(tl.minimum(tl.maximum(tl.cdiv(last - col0, BLOCK_N), lo), TILES))
    lo = loop_bound(lo)
    blank = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
    for t in range(0, lo):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, blank)
    for t in range(lo, hi):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < num_keys
        key = cols.to(tl.int64)
        scales = load_scales(scales_ptr + key * SCALES_PER_TOKEN, ok, SCALES_PER_TOKEN, MXFP4)
        keys, factor = key_tile(values_ptr + key * VALUE_BYTES, scales, ok, D, MXFP4, ALIGNED)
        scores = head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        scores = tl.where(inside, scores, float("-inf"))
        store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, scores)
    for t in range(hi, TILES):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, blank)
