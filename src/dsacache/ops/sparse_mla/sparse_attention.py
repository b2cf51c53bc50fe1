"""Triton kernel of the sparse MLA decode: one query row's heads attend over its selected cache slots.

One program owns one query row (``b * s_q + s``), one block of ``BH`` heads and one split of
the row's top-k list. It walks its slots ``BLOCK_N`` at a time: gathers those entries from
the layer's pages and scores ``q_nope . k_nope + q_rope . k_rope`` on the tensor cores in
fp32, keeping an online softmax in base 2 (``log2(e)`` folded into the scale), and adds the
softmax-weighted values (the first ``RANK`` values of each entry) into an fp32 accumulator.
With one split it writes ``out`` (bf16) and the natural-log ``lse``; with several it writes
each split's normalized partial output (fp32) and its base-2 LSE for ``merge_splits``.

The latent part is handled in chunks of ``CHUNK`` (128) values, up to four (``RANK <= 512``),
each with its own accumulator. Entries never get rounded: e4m3 values and bf16 values are exact
in bf16, and scales go where fp32 is: an ``fp8_ds_mla`` chunk's tile scale multiplies the
chunk's scores (``sum_t scale_t * (q_t . codes_t)``) and, for the values, the softmax weights
of that chunk's product (``(p * scale_t) @ codes_t``); the per-tensor ``k_scale`` of ``fp8``
entries multiplies the score scale and the output.

Entry kinds (compile-time ``KIND``) and their byte offsets are those of
:class:`dsacache.formats.mla_entry.MlaEntryFormat`: 0 ``bfloat16``, 1 ``fp8``, 2 ``fp8_ds_mla``.
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
def _query_chunk(q_row, head_ok, t: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr):
    """Query values ``[t * CHUNK, (t + 1) * CHUNK)`` of the program's heads [BH, CHUNK] (0 past RANK)."""
    offs = t * CHUNK + tl.arange(0, CHUNK)
    return tl.load(q_row + offs[None, :], mask=head_ok[:, None] & (offs < RANK)[None, :], other=0.0)


@triton.jit
def _value_chunk(entry, valid, t: tl.constexpr, RANK: tl.constexpr, KIND: tl.constexpr, CHUNK: tl.constexpr):
    """Latent values ``[t * CHUNK, (t + 1) * CHUNK)`` of the entries [BLOCK_N, CHUNK], bf16 and exact
    (e4m3 codes unscaled), 0 where not valid.

    Loaded as [BLOCK_N, 1, CHUNK]: a load that feeds two dot operands directly gets no shared-memory
    buffer from the pipeliner for mma.sync, so it would wait for the gather at every step.
    """
    offs = t * CHUNK + tl.arange(0, CHUNK)
    mask = (valid[:, None] & (offs < RANK)[None, :])[:, None, :]
    cols = offs[None, None, :]
    if KIND == KIND_BF16:
        values = tl.load(entry.to(tl.pointer_type(tl.bfloat16))[:, None, None] + cols, mask=mask, other=0.0)
    else:
        values = tl.load(entry.to(tl.pointer_type(tl.float8e4nv))[:, None, None] + cols, mask=mask,
                         other=0.0).to(tl.bfloat16)
    return tl.reshape(values, [valid.shape[0], CHUNK])


@triton.jit
def _rope_tile(entry, valid, RANK: tl.constexpr, ROPE: tl.constexpr, KIND: tl.constexpr, TILE: tl.constexpr,
               BLOCK_P: tl.constexpr):
    """The rope values of the entries [BLOCK_N, BLOCK_P] bf16 (exact), 0 where not valid."""
    offs = tl.arange(0, BLOCK_P)
    mask = valid[:, None] & (offs < ROPE)[None, :]
    if KIND == KIND_FP8:
        codes = tl.load((entry + RANK).to(tl.pointer_type(tl.float8e4nv))[:, None] + offs[None, :], mask=mask,
                        other=0.0)
        return codes.to(tl.bfloat16)
    else:
        rope_at: tl.constexpr = 2 * RANK if KIND == KIND_BF16 else RANK + 4 * (RANK // TILE)
        return tl.load((entry + rope_at).to(tl.pointer_type(tl.bfloat16))[:, None] + offs[None, :], mask=mask,
                       other=0.0)


@triton.jit
def _chunk_scores(scores, q_t, k_t, entry, valid, t: tl.constexpr, RANK: tl.constexpr, KIND: tl.constexpr):
    """``scores + q_t @ k_t^T``, the product times the chunk's tile scale (one a slot) for
    ``fp8_ds_mla``; returns (scores, that scale [BLOCK_N] or 1)."""
    if KIND == KIND_DS_MLA:
        scale = tl.load((entry + RANK).to(tl.pointer_type(tl.float32)) + t, mask=valid, other=0.0)
        part = _mma(q_t, tl.trans(k_t), tl.zeros(scores.shape, dtype=tl.float32))
        return scores + part * scale[None, :], scale
    else:
        return _mma(q_t, tl.trans(k_t), scores), 1.0


@triton.jit
def _chunk_values(acc, p, alpha, k_t, scale, KIND: tl.constexpr):
    """``acc * alpha + bf16(p * scale) @ k_t``: the chunk's weighted values (its tile scale on the weights)."""
    if KIND == KIND_DS_MLA:
        p = p * scale[None, :]
    return _mma(to_bf16(p), k_t, acc * alpha[:, None])


@triton.jit
def _store_chunk(out_ptr, base, heads, head_ok, o, t: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Chunk ``t`` of the output rows ``base + heads`` (fp32 partials when SPLIT, else bf16)."""
    offs = t * CHUNK + tl.arange(0, CHUNK)
    ptrs = out_ptr + (base + heads)[:, None] * RANK + offs[None, :]
    mask = head_ok[:, None] & (offs < RANK)[None, :]
    if SPLIT:
        tl.store(ptrs, o, mask=mask)
    else:
        tl.store(ptrs, to_bf16(o), mask=mask)


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
    TILE: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr, SPLIT: tl.constexpr,
):
    NT: tl.constexpr = (RANK + CHUNK - 1) // CHUNK   # latent chunks, 1 to 4
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
    q_row = q_ptr + b.to(tl.int64) * stride_qb + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q0 = _query_chunk(q_row, head_ok, 0, RANK, CHUNK)
    q1 = _query_chunk(q_row, head_ok, 1, RANK, CHUNK)
    q2 = _query_chunk(q_row, head_ok, 2, RANK, CHUNK)
    q3 = _query_chunk(q_row, head_ok, 3, RANK, CHUNK)
    offs_p = tl.arange(0, BLOCK_P)
    q_rope = tl.load(q_row + RANK + offs_p[None, :], mask=head_ok[:, None] & (offs_p < ROPE)[None, :], other=0.0)
    if KIND == KIND_FP8:
        k_scale = tl.load(k_scale_ptr)
        qk_scale = qk_scale * k_scale

    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + s.to(tl.int64) * stride_is
    begin = split * keys_per_split
    end = tl.minimum(begin + keys_per_split, topk)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc0 = tl.zeros([BH, CHUNK], dtype=tl.float32)
    acc1 = tl.zeros([BH, CHUNK], dtype=tl.float32)
    acc2 = tl.zeros([BH, CHUNK], dtype=tl.float32)
    acc3 = tl.zeros([BH, CHUNK], dtype=tl.float32)
    for start in range(loop_bound(begin), loop_bound(end), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        entry, valid = _entries(idx_row, offs_n, end, num_slots, pages_ptr, page_stride, ENTRY, PAGE)
        scores = tl.zeros([BH, BLOCK_N], dtype=tl.float32)
        if ROPE > 0:
            scores = _mma(q_rope, tl.trans(_rope_tile(entry, valid, RANK, ROPE, KIND, TILE, BLOCK_P)), scores)
        k0 = _value_chunk(entry, valid, 0, RANK, KIND, CHUNK)
        scores, sc0 = _chunk_scores(scores, q0, k0, entry, valid, 0, RANK, KIND)
        if NT > 1:
            k1 = _value_chunk(entry, valid, 1, RANK, KIND, CHUNK)
            scores, sc1 = _chunk_scores(scores, q1, k1, entry, valid, 1, RANK, KIND)
        if NT > 2:
            k2 = _value_chunk(entry, valid, 2, RANK, KIND, CHUNK)
            scores, sc2 = _chunk_scores(scores, q2, k2, entry, valid, 2, RANK, KIND)
        if NT > 3:
            k3 = _value_chunk(entry, valid, 3, RANK, KIND, CHUNK)
            scores, sc3 = _chunk_scores(scores, q3, k3, entry, valid, 3, RANK, KIND)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with no valid slot yet keeps m = -inf; subtracting 0 there keeps p = 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(scores - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = _chunk_values(acc0, p, alpha, k0, sc0, KIND)
        if NT > 1:
            acc1 = _chunk_values(acc1, p, alpha, k1, sc1, KIND)
        if NT > 2:
            acc2 = _chunk_values(acc2, p, alpha, k2, sc2, KIND)
        if NT > 3:
            acc3 = _chunk_values(acc3, p, alpha, k3, sc3, KIND)
        m_i = m_new

    seen = l_i > 0.0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    if KIND == KIND_FP8:
        inv_l = inv_l * k_scale
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if SPLIT:
        base = (row.to(tl.int64) * num_splits + split) * num_heads
        tl.store(lse_ptr + base + heads, lse2, mask=head_ok)
    else:
        base = row.to(tl.int64) * num_heads
        tl.store(lse_ptr + base + heads, lse2 * LN2, mask=head_ok)
    _store_chunk(out_ptr, base, heads, head_ok, acc0 * inv_l[:, None], 0, RANK, CHUNK, SPLIT)
    if NT > 1:
        _store_chunk(out_ptr, base, heads, head_ok, acc1 * inv_l[:, None], 1, RANK, CHUNK, SPLIT)
    if NT > 2:
        _store_chunk(out_ptr, base, heads, head_ok, acc2 * inv_l[:, None], 2, RANK, CHUNK, SPLIT)
    if NT > 3:
        _store_chunk(out_ptr, base, heads, head_ok, acc3 * inv_l[:, None], 3, RANK, CHUNK, SPLIT)
