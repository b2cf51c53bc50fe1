"""Triton kernel of the MLA latent store: a token's ``kv_c`` and ``k_pe`` -> its entry at its slot.

One program stores ``BLOCK_T`` tokens. The entry kind is a compile-time constant
(``KIND``: 0 ``bfloat16``, 1 ``fp8`` with a per-tensor scale, 2 ``fp8_ds_mla``); byte
offsets inside an entry are those of :class:`dsacache.formats.mla_entry.MlaEntryFormat`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.indexer_k_cache.codecs import e4m3_encode_int

KIND_BF16 = tl.constexpr(0)
KIND_FP8 = tl.constexpr(1)
KIND_DS_MLA = tl.constexpr(2)


@triton.jit
def _to_e4m3_bytes(y, INTERPRET: tl.constexpr):
    """fp32 -> e4m3 bytes (uint8), round to nearest even, saturating at +-448, NaN kept."""
    if INTERPRET:
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
        return e4m3_encode_int(y).to(tl.uint8)
    else:
        # The hardware cast (cvt.rn.satfinite) saturates and keeps NaN.
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def store_mla_kernel(
    kv_ptr,         # [num_tokens, RANK] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    pe_ptr,         # [num_tokens, ROPE] (read only when ROPE > 0), strides (stride_pt, stride_pd)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    scale_ptr,      # fp32 scalar k_scale (read only for KIND_FP8)
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, ENTRY], page stride page_stride
    num_tokens, num_slots, stride_kt, stride_kd, stride_pt, stride_pd, page_stride,
    RANK: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, KIND: tl.constexpr, PAGE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    entry = pages_ptr + (slot // PAGE) * page_stride + (slot % PAGE) * ENTRY  # [BLOCK_T] uint8 pointers

    rows = offs_t.to(tl.int64)
    if KIND == KIND_DS_MLA:
        # fp8_ds_mla: one plain fp32 scale a 128-value tile, max(amax, 1e-4) / 448, then e4m3(x / scale).
        offs_g = tl.arange(0, BLOCK_G)
        offs_c = tl.arange(0, TILE)
        col = offs_g[:, None] * TILE + offs_c[None, :]  # [BLOCK_G, TILE]
        mask_g = offs_g < RANK // TILE
        mask = mask_t[:, None, None] & mask_g[None, :, None]
        tiles = tl.load(kv_ptr + rows[:, None, None] * stride_kt + col[None, :, :] * stride_kd,
                        mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_G, TILE]
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(tiles), axis=2), 1e-4), 448.0)  # [BLOCK_T, BLOCK_G]
        codes = _to_e4m3_bytes(tl.div_rn(tiles, scale[:, :, None]), INTERPRET)
        keep = valid[:, None, None] & mask_g[None, :, None]
        tl.store(entry[:, None, None] + col[None, :, :], codes, mask=keep)
        scale_out = (entry + RANK).to(tl.pointer_type(tl.float32))
        tl.store(scale_out[:, None] + offs_g[None, :], scale, mask=valid[:, None] & mask_g[None, :])
    else:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < RANK
        x = tl.load(kv_ptr + rows[:, None] * stride_kt + offs_r[None, :] * stride_kd,
                    mask=mask_t[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_R]
        keep_r = valid[:, None] & mask_r[None, :]
        if KIND == KIND_BF16:
            tl.store(entry.to(tl.pointer_type(tl.bfloat16))[:, None] + offs_r[None, :], x.to(tl.bfloat16),
                     mask=keep_r)
        else:
            codes = _to_e4m3_bytes(tl.div_rn(x, tl.load(scale_ptr)), INTERPRET)
            tl.store(entry[:, None] + offs_r[None, :], codes, mask=keep_r)
    if ROPE > 0:
        offs_p = tl.arange(0, BLOCK_P)
        mask_p = offs_p < ROPE
        pe = tl.load(pe_ptr + rows[:, None] * stride_pt + offs_p[None, :] * stride_pd,
                     mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        keep_p = valid[:, None] & mask_p[None, :]
        if KIND == KIND_FP8:
            codes = _to_e4m3_bytes(tl.div_rn(pe, tl.load(scale_ptr)), INTERPRET)
            tl.store(entry[:, None] + RANK + offs_p[None, :], codes, mask=keep_p)
        else:
            # bf16 rope after the latent (bfloat16: 2 x RANK bytes in; fp8_ds_mla: after the scales).
            rope_at = 2 * RANK if KIND == KIND_BF16 else RANK + 4 * (RANK // TILE)
            rope_out = (entry + rope_at).to(tl.pointer_type(tl.bfloat16))
            tl.store(rope_out[:, None] + offs_p[None, :], pe.to(tl.bfloat16), mask=keep_p)
