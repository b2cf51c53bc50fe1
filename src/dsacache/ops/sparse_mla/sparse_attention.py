"""Triton kernel of the sparse MLA decode: one query row's heads attend over its selected cache slots.

One program owns one query row (``b * s_q + s``), one block of ``BH`` heads and one split of
the row's top-k list. It walks its slots ``BLOCK_N`` at a time: gathers those entries from
the layer's pages, dequantizes them into a bf16 key tile in registers (the first ``RANK``
values are also the value tile), scores ``q_nope . k_nope + q_rope . k_rope`` on the tensor
cores in fp32, and keeps an online softmax in base 2 (``log2(e)`` folded into the scale).
With one split it writes ``out`` (bf16) and the natural-log ``lse``; with several it writes
each split's normalized partial output (fp32) and its base-2 LSE for ``merge_splits``.

Entry kinds (compile-time ``KIND``) and their byte offsets are those of
:class:`dsacache.formats.mla_entry.MlaEntryFormat`: 0 ``bfloat16``, 1 ``fp8`` (one per-tensor
``k_scale``, folded into the score scale and the output instead of the tile), 2
``fp8_ds_mla`` (one fp32 scale a 128-value tile, applied to the tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.triton_utils import INTERPRET, loop_bound

KIND_BF16 = tl.constexpr(0)
KIND_FP8 = tl.constexpr(1)
KIND_DS_MLA = tl.constexpr(2)

#: ln(2): the kernels keep LSEs in base 2, the public ``lse`` is a natural log.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mma(a, b, acc):
    """``acc + a @ b`` for bf16 ``a``, ``b`` on the tensor cores; the interpreter multiplies bf16
    operands as their raw bits (Triton 3.6), so there they go in as fp32 (the same values)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16, rounded to nearest even; the interpreter's cast truncates, so there the
    rounding is done on the bits first (finite values)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _entries(idx_row, offs_n, end, num_slots, pages_ptr, page_stride, ENTRY: tl.constexpr,
             PAGE: tl.constexpr):
    """Byte pointers [BLOCK_N] of the entries at slots ``idx_row[offs_n]`` and whether each is valid.

    A slot is valid iff ``offs_n < end`` and ``0 <= slot < num_slots``; an invalid one points at
    slot 0 and is never loaded. Page offsets are int64 (page strides may pass 2**31 bytes).
    """
    slot = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = (slot // PAGE).to(tl.int64)
    return pages_ptr + page * page_stride + (slot % PAGE) * ENTRY, valid


@triton.jit
def _key_tile(entry, valid, RANK: tl.constexpr, ROPE: tl.constexpr, KIND: tl.constexpr, TILE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """(k_nope [BLOCK_N, BLOCK_R], k_rope [BLOCK_N, BLOCK_P]) bf16 of the entries, 0 where not valid.

    ``fp8`` tiles come back unscaled (the caller folds ``k_scale`` in); ``fp8_ds_mla`` tiles
    are multiplied by their tile scale in fp32, then rounded to bf16 once. e4m3 values are
    loaded as [BLOCK_N, chunks, 128] (one chunk a tile scale): that layout compiles without
    register spills at 64 heads, where a flat [BLOCK_N, BLOCK_R] load spilled.
    """
    if KIND == KIND_BF16:
        offs_r = tl.arange(0, BLOCK_R)
        k_nope = tl.load(entry.to(tl.pointer_type(tl.bfloat16))[:, None] + offs_r[None, :],
                         mask=valid[:, None] & (offs_r < RANK)[None, :], other=0.0)
        rope_ptr = (entry + 2 * RANK).to(tl.pointer_type(tl.bfloat16))
    else:
        CHUNK: tl.constexpr = min(TILE, BLOCK_R)
        offs_t = tl.arange(0, BLOCK_R // CHUNK)
        col = offs_t[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        codes = tl.load(entry.to(tl.pointer_type(tl.float8e4nv))[:, None, None] + col[None, :, :],
                        mask=valid[:, None, None] & (col < RANK)[None, :, :], other=0.0)
        if KIND == KIND_DS_MLA:
            scales = tl.load((entry + RANK).to(tl.pointer_type(tl.float32))[:, None] + offs_t[None, :],
                             mask=valid[:, None] & (offs_t < RANK // TILE)[None, :], other=0.0)
            k_nope = to_bf16(codes.to(tl.float32) * scales[:, :, None])
            rope_at: tl.constexpr = RANK + 4 * (RANK // TILE)
            rope_ptr = (entry + rope_at).to(tl.pointer_type(tl.bfloat16))
        else:
            k_nope = codes.to(tl.bfloat16)
            rope_ptr = (entry + RANK).to(tl.pointer_type(tl.float8e4nv))
        k_nope = tl.reshape(k_nope, [BLOCK_N, BLOCK_R])
    if ROPE > 0:
        offs_p = tl.arange(0, BLOCK_P)
        k_rope = tl.load(rope_ptr[:, None] + offs_p[None, :], mask=valid[:, None] & (offs_p < ROPE)[None, :],
                         other=0.0).to(tl.bfloat16)
    else:
        k_rope = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.bfloat16)
    return k_nope, k_rope


@triton.jit
def sparse_mla_attention_kernel(
    q_ptr,          # [B, s_q, H, RANK + ROPE] bf16, strides (stride_qb, stride_qs, stride_qh, 1)
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, ENTRY], page stride page_stride
    idx_ptr,        # [B, s_q, topk] int32 slots, strides (stride_ib, stride_is, 1); -1 = none
    k_scale_ptr,    # fp32 per-tensor scale (read only for KIND_FP8)
    out_ptr,        # SPLIT: fp32 [rows, num_splits, H, RANK]; else bf16 [rows, H, RANK] (contiguous)
    lse_ptr,        # SPLIT: fp32 [rows, num_splits, H] base 2; else fp32 [rows, H] natural log
    num_heads, s_q, topk, keys_per_split, num_splits, num_slots, page_stride,
    stride_qb, stride_qs, stride_qh, stride_ib, stride_is,
    qk_scale,       # softmax_scale * log2(e)
    RANK: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, KIND: tl.constexpr, PAGE: tl.constexpr,
    TILE: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, SPLIT: tl.constexpr,
):
    # Head blocks vary fastest, so the programs that read one row's slots run side by side (L2).
    pid = tl.program_id(0)
    num_hb = tl.cdiv(num_heads, BH)
    hb = pid % num_hb
    split = (pid // num_hb) % num_splits
    row = pid // (num_hb * num_splits)
    b = row // s_q
    s = row % s_q

    heads = hb * BH + tl.arange(0, BH)
    head_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_r[None, :], mask=head_ok[:, None] & (offs_r < RANK)[None, :], other=0.0)
    if ROPE > 0:
        q_rope = tl.load(q_row + RANK + offs_p[None, :], mask=head_ok[:, None] & (offs_p < ROPE)[None, :],
                         other=0.0)
    else:
        q_rope = tl.zeros([BH, BLOCK_P], dtype=tl.bfloat16)
    if KIND == KIND_FP8:
        k_scale = tl.load(k_scale_ptr)
        qk_scale = qk_scale * k_scale

    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + s.to(tl.int64) * stride_is
    begin = split * keys_per_split
    end = tl.minimum(begin + keys_per_split, topk)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BLOCK_R], dtype=tl.float32)
    for start in range(loop_bound(begin), loop_bound(end), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        entry, valid = _entries(idx_row, offs_n, end, num_slots, pages_ptr, page_stride, ENTRY, PAGE)
        k_nope, k_rope = _key_tile(entry, valid, RANK, ROPE, KIND, TILE, BLOCK_N, BLOCK_R, BLOCK_P)
        scores = tl.zeros([BH, BLOCK_N], dtype=tl.float32)
        if ROPE > 0:
            scores = _mma(q_rope, tl.trans(k_rope), scores)
        scores = _mma(q_nope, tl.trans(k_nope), scores)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with no valid slot yet keeps m = -inf; subtracting 0 there keeps p = 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(scores - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _mma(to_bf16(p), k_nope, acc * alpha[:, None])
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KIND == KIND_FP8:
        o = o * k_scale
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_mask = head_ok[:, None] & (offs_r < RANK)[None, :]
    if SPLIT:
        part = row.to(tl.int64) * num_splits + split
        tl.store(out_ptr + (part * num_heads + heads)[:, None] * RANK + offs_r[None, :], o, mask=out_mask)
        tl.store(lse_ptr + part * num_heads + heads, lse2, mask=head_ok)
    else:
        tl.store(out_ptr + (row.to(tl.int64) * num_heads + heads)[:, None] * RANK + offs_r[None, :],
                 to_bf16(o), mask=out_mask)
        tl.store(lse_ptr + row.to(tl.int64) * num_heads + heads, lse2 * LN2, mask=head_ok)
