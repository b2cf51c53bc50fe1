"""Triton pieces both Triton logits kernels use: a tile of keys as e4m3, the head sum, the store.

Both kernels score one tile of ``BLOCK_N`` keys against every head of a small block of
query rows with one tensor-core product, keys as the left operand:

    acc[j, m] = key[j] . q[m]          [BLOCK_N, ROWS * H]  (m = row * H + head)
    logit[j, row] = sum_h w[row, h] * relu(acc[j, row * H + h])

FP8 keys: e4m3 x e4m3 products, the per-token scale applied after the head sum (it is a
positive power of two, so it commutes with ``relu``). MXFP4 keys are rewritten to e4m3 first
(``mxfp4_e4m3``), by the table decode, or a byte at a time where the key rows are not 4-byte
aligned and cannot be read as words.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.indexer_logits.mxfp4_e4m3 import (
    DROPPED_GROUP,
    GROUP,
    PTX_AVAILABLE,
    WORD_DECODE_ASM,
    nibble_to_e4m3,
    table_columns,
)

_PTX = tl.constexpr(PTX_AVAILABLE)


@triton.jit
def head_sum(acc, w, ROWS: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, ROWS*H] fp32, w [ROWS*H] -> sum_h w * relu(acc) as [BLOCK_N, ROWS]."""
    acc = tl.maximum(acc, 0.0) * w[None, :]
    return tl.sum(tl.reshape(acc, [BLOCK_N, ROWS, H]), axis=2)


@triton.jit
def _mxfp4_token_factor(top):
    """A token's largest scale byte -> its fp32 factor 2**(top - 133)."""
    # 2**(top - 127) built from its bits (top 0 -> 2**-127), then 2**-6.
    unit = (tl.maximum(top, 1) << 23).to(tl.float32, bitcast=True) * tl.where(top == 0, 0.5, 1.0)
    return unit * 0.015625


@triton.jit
def _mxfp4_key_tile_unaligned(packed_rows, scale, ok, D: tl.constexpr):
    """MXFP4 keys at byte pointers packed_rows [BLOCK_N] with their scale bytes [BLOCK_N, D/32]
    -> (e4m3 [BLOCK_N, D] in element order, fp32 [BLOCK_N]), read a byte at a time: the decode
    for key rows that are not 4-byte aligned, where ``_mxfp4_key_tile`` cannot read words."""
    G: tl.constexpr = D // GROUP
    g = tl.arange(0, G)
    byte = tl.arange(0, GROUP // 2)
    packed = tl.load(packed_rows[:, None, None] + (GROUP // 2 * g[None, :, None] + byte[None, None, :]),
                     mask=ok[:, None, None], other=0)
    scale = scale.to(tl.int32)
    top = tl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    offset = tl.where(t >= 0, 8 * t, DROPPED_GROUP)[:, :, None]
    codes = packed.to(tl.int32)
    lo = nibble_to_e4m3(codes & 15, offset).to(tl.uint8)
    hi = nibble_to_e4m3(codes >> 4, offset).to(tl.uint8)
    keys = tl.reshape(tl.join(lo, hi), [packed.shape[0], D]).to(tl.float8e4nv, bitcast=True)
    return keys, _mxfp4_token_factor(top)


@triton.jit
def _mxfp4_key_tile(packed_rows, scale, ok, D: tl.constexpr):
    """MXFP4 keys -> (e4m3 [BLOCK_N, D] in the column order of ``table_columns``, fp32 [BLOCK_N]).

    At D = 128 the columns are exactly the registers a thread holds in the wgmma operand
    layout (4 consecutive columns a register, columns 4-15 of each 16 on the other lanes of
    its quad), so each thread reads one whole 16-byte group of a token and decodes it in
    place, no byte shuffles. Nothing computed from ``tl.arange`` may enter the chain after the
    loads (Triton then stops propagating the operand layout back to them and goes through
    shared memory), hence the broadcasts.
    """
    G: tl.constexpr = D // GROUP
    g = tl.arange(0, G)
    w = tl.arange(0, 4)[None, :, None, None]
    word_rows = packed_rows.to(tl.pointer_type(tl.int32))[:, None, None, None]
    words = tl.load(word_rows + (4 * g[None, None, :, None] + w), mask=ok[:, None, None, None], other=0)
    words = tl.broadcast_to(words, [words.shape[0], 4, G, 4])  # [BLOCK_N, word, group, byte]
    scale = scale.to(tl.int32)
    top = tl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    if _PTX:
        lo, hi = tl.inline_asm_elementwise(
            WORD_DECODE_ASM, "=r,=r" + ",r" * 8, [words, t[:, None, :, None]],
            dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        j = tl.arange(0, 4)[None, None, None, :]
        offset = tl.where(t >= 0, 8 * t, DROPPED_GROUP)[:, None, :, None]
        lo = nibble_to_e4m3((words >> (4 * j)) & 15, offset).to(tl.uint8)
        hi = nibble_to_e4m3((words >> (4 * j + 16)) & 15, offset).to(tl.uint8)
    keys = tl.permute(tl.join(lo, hi), (0, 1, 4, 2, 3))  # [BLOCK_N, word, half, group, byte]
    keys = tl.reshape(keys, [keys.shape[0], D]).to(tl.float8e4nv, bitcast=True)
    return keys, _mxfp4_token_factor(top)


@triton.jit
def key_columns(D: tl.constexpr, MXFP4: tl.constexpr, ALIGNED: tl.constexpr):
    """Key element each column of ``key_tile`` holds [D]; the queries are loaded in this order."""
    if MXFP4 and ALIGNED:
        d = table_columns(tl.arange(0, D), D // GROUP)
    else:
        d = tl.arange(0, D)
    return d


@triton.jit
def load_scales(scale_rows, ok, SCALES_PER_TOKEN: tl.constexpr, MXFP4: tl.constexpr):
    """A tile's scales at scale_rows [BLOCK_N]: fp32 [BLOCK_N] (FP8) or UE8M0 bytes [BLOCK_N, D/32]."""
    if MXFP4:
        g = tl.arange(0, SCALES_PER_TOKEN)
        scales = tl.load(scale_rows[:, None] + g[None, :], mask=ok[:, None], other=0)
    else:
        scales = tl.load(scale_rows, mask=ok, other=0.0)
    return scales


@triton.jit
def key_tile(value_rows, scales, ok, D: tl.constexpr, MXFP4: tl.constexpr, ALIGNED: tl.constexpr):
    """Keys of one tile and its loaded scales (``load_scales``) as (e4m3 [BLOCK_N, D] in
    ``key_columns`` order, per-token fp32 factor [BLOCK_N]); rows not ok read 0. ``ALIGNED``:
    MXFP4 key rows are 4-byte aligned (the table decode reads words)."""
    if MXFP4 and ALIGNED:
        keys, factor = _mxfp4_key_tile(value_rows, scales, ok, D)
    elif MXFP4:
        keys, factor = _mxfp4_key_tile_unaligned(value_rows, scales, ok, D)
    else:
        d = tl.arange(0, D)
        keys = tl.load(value_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        factor = scales
    return keys, factor


@triton.jit
def load_queries(q_ptr, m, m_ok, d, D: tl.constexpr):
    """Rows m [M] of a [*, D] e4m3 query matrix; rows outside m_ok read as 0."""
    return tl.load(q_ptr + m[:, None].to(tl.int64) * D + d[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def store_tile(out_ptr, out_stride, rows, row_ok, cols, num_cols, scores):
    """scores [BLOCK_N, ROWS] -> out[rows, cols]."""
    ptrs = out_ptr + rows[None, :].to(tl.int64) * out_stride + cols[:, None]
    tl.store(ptrs, scores, mask=row_ok[None, :] & (cols[:, None] < num_cols))
