"""Sparse MLA decode as a warp-specialized Gluon kernel for Hopper: 64 query heads of one row a
program, 656-B ``fp8_ds_mla`` entries (kv_lora_rank 512 + rope 64), wgmma throughout.

Three partitions of one warpgroup each share a program's shared memory:

* the gatherer (a worker) reads a tile's 64 entries straight into registers, GATHER_ROWS at a
  time, the next group's loads in flight while it dequantizes the latent values of one
  (``e4m3 * tile scale``, rounded to bf16 once) into the tile's stage of a two-stage ring, copies
  the bf16 rope part beside them and records which slots are valid (an additive 0 / -inf score
  bias);
* the score partition (the default one) multiplies the queries (in shared memory for the whole
  program) with the tile's keys, ``S = q @ k^T`` (64 x 64, K = 576, five wgmmas), runs the online
  softmax in base 2 on S in registers, hands the bf16 weights and the rescale factors to the
  value partition through shared memory and accumulates value chunks 0-1 (``out[:, :256]``) with
  the weights as the wgmma's register operand;
* the value partition (a worker) accumulates value chunks 2-3 (``out[:, 256:]``) with the same
  weights read from shared memory; while its products run it bulk-prefetches into L2 the entries
  of the tile ``L2_AHEAD + 1`` ahead, so the gatherer's loads of it wait on L2, not HBM (the
  gatherer has no registers to spare for that, and a prefetch that waits on its slot load stalls
  whichever partition issues it: the slots are loaded a tile earlier).

A stage of the ring is free again once both accumulating partitions are past their products on
it. The value partition gets the final ``1 / l`` the same way as the per-tile factors. With
``SPLIT`` a program writes its normalized fp32 partial and base-2 LSE, merged by the Triton
``merge_splits_kernel``, as the Triton kernel's are. Keys are rounded to bf16 once (the Triton
kernel keeps them exact and scales the scores instead: that needs an accumulator a chunk, more
registers than a warpgroup beside the [64, 256] value accumulator has). ``launch.py`` says
when this kernel runs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

HEADS = gl.constexpr(64)        # query heads a program: the wgmma M of one warpgroup
CHUNK = gl.constexpr(128)       # latent values a chunk (one fp8_ds_mla scale tile)
GATHER_ROWS = gl.constexpr(16)  # slots the gatherer loads at a time (32, or more groups in flight, spill)
ROPE = gl.constexpr(64)
RANK = gl.constexpr(512)
ENTRY = gl.constexpr(656)
LN2 = gl.constexpr(0.6931471805599453)

# Bulk-prefetch the 656-B entry at $1 into L2 when $2 is non-zero.
_PREFETCH_ASM = gl.constexpr("""{
.reg .pred p;
setp.ne.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], 656;
mov.b32 $0, 0;
}""")


@gluon.constexpr_function
def _score_layout(block_n):
    """S [64 heads, block_n slots] fp32: one warpgroup, N = block_n a wgmma."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@gluon.constexpr_function
def _value_layout():
    """A value chunk's accumulator [64 heads, 128] fp32: one warpgroup, N = 128 a wgmma."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])


@gluon.constexpr_function
def _chunk_load_layout():
    """[slots, 128 bytes] of a chunk: 16 bytes a thread, 8 threads a row, 16 rows a warpgroup."""
    return gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def _rope_load_layout():
    """[slots, 64 bf16] of the rope part: 8 values (16 bytes) a thread, 8 threads a row (the chunk layout's rows)."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _split_slots(idx_row, start, stop, first, ROWS: gl.constexpr, LAYOUT: gl.constexpr):
    """Slots ``first + i`` of the split [ROWS] in ``LAYOUT``, ``-1`` past its end."""
    cols = start + first + gl.arange(0, ROWS, layout=LAYOUT)
    return gl.load(idx_row + cols, mask=cols < stop, other=-1)


@gluon.jit
def _entry_pointers(slot, num_slots, pages_ptr, page_stride):
    """(byte pointers of the entries at ``slot``, valid): a slot ``< 0`` or ``>= num_slots`` is invalid and
    points at entry 0, never read. Page offsets are int64 (page strides may pass 2**31 bytes)."""
    valid = (slot >= 0) & (slot < num_slots)
    slot = gl.where(valid, slot, 0)
    return pages_ptr + (slot // 64).to(gl.int64) * page_stride + (slot % 64) * ENTRY, valid


@gluon.jit
def _load_entries(slot, num_slots, pages_ptr, page_stride):
    """The entries at ``slot`` [rows] (in the chunk layout's rows) loaded into registers, every load
    issued before any is used: the four code chunks [rows, 128] uint8, the four tile scales [rows]
    fp32, the rope part [rows, 64] bf16 (0 where invalid) and which slots are valid (both Gluon
    kernels)."""
    CL: gl.constexpr = _chunk_load_layout()
    RL: gl.constexpr = _rope_load_layout()
    entry, valid = _entry_pointers(slot, num_slots, pages_ptr, page_stride)
    d = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, CL))
    at = entry[:, None] + d[None, :]
    ok = valid[:, None]
    c0 = gl.load(at, mask=ok, other=0)
    c1 = gl.load(at + CHUNK, mask=ok, other=0)
    c2 = gl.load(at + 2 * CHUNK, mask=ok, other=0)
    c3 = gl.load(at + 3 * CHUNK, mask=ok, other=0)
    scales = (entry + RANK).to(gl.pointer_type(gl.float32))
    s0 = gl.load(scales, mask=valid, other=0.0)
    s1 = gl.load(scales + 1, mask=valid, other=0.0)
    s2 = gl.load(scales + 2, mask=valid, other=0.0)
    s3 = gl.load(scales + 3, mask=valid, other=0.0)
    r_entry = gl.convert_layout(entry, gl.SliceLayout(1, RL))
    r_valid = gl.convert_layout(valid, gl.SliceLayout(1, RL))
    e = gl.arange(0, ROPE, layout=gl.SliceLayout(0, RL))
    rope = gl.load((r_entry + (RANK + 16)).to(gl.pointer_type(gl.bfloat16))[:, None] + e[None, :],
                   mask=r_valid[:, None], other=0.0)
    return c0, c1, c2, c3, s0, s1, s2, s3, rope, valid


@gluon.jit
def _dequantized(codes, scale):
    """Latent values ``e4m3 * tile scale`` [rows, 128], rounded to bf16 once (0 where invalid)."""
    return (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]).to(gl.bfloat16)


@gluon.jit
def _group_slots(slot_ptrs, left, group, ROWS: gl.constexpr):
    """Slots of gather group ``group`` (ROWS slots each): ``slot_ptrs`` point at the split's first ROWS
    slots and ``left`` says how many of the split's slots start at each ([ROWS], the chunk layout's rows);
    ``-1`` past the split's end."""
    return gl.load(slot_ptrs + group * ROWS, mask=group * ROWS < left, other=-1)


@gluon.jit
def _store_group(k_smem, rope_smem, bias_smem, s, row0: gl.constexpr, group):
    """Group ``group`` (what ``_load_entries`` returned) into rows ``row0 ..`` of stage ``s``: the dequantized
    latents, the rope part and the score bias."""
    c0, c1, c2, c3, s0, s1, s2, s3, rope, valid = group
    rows: gl.constexpr = c0.shape[0]
    k_smem[0].index(s).slice(row0, rows).store(_dequantized(c0, s0))
    k_smem[1].index(s).slice(row0, rows).store(_dequantized(c1, s1))
    k_smem[2].index(s).slice(row0, rows).store(_dequantized(c2, s2))
    k_smem[3].index(s).slice(row0, rows).store(_dequantized(c3, s3))
    rope_smem.index(s).slice(row0, rows).store(rope)
    bias_smem.index(s).slice(row0, rows).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _gather_partition(k_smem, rope_smem, bias_smem, k_ready, k_empty, idx_row, start, stop, n_tiles, num_slots,
                      pages_ptr, page_stride, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # A tile is gathered in groups of GATHER_ROWS slots, software-pipelined: group j + 1's loads are in
    # flight while group j is converted and stored (and while its stage is waited for), and group j + 2's
    # slots are loaded before that. (Two groups ahead, or 8-slot groups three ahead, spill at these budgets.)
    ROWS: gl.constexpr = GATHER_ROWS
    GROUPS: gl.constexpr = BLOCK_N // ROWS
    lanes = gl.arange(0, ROWS, layout=gl.SliceLayout(1, _chunk_load_layout()))
    slot_ptrs = idx_row + start + lanes
    left = stop - start - lanes
    cur = _load_entries(_group_slots(slot_ptrs, left, 0, ROWS), num_slots, pages_ptr, page_stride)
    slot = _group_slots(slot_ptrs, left, 1, ROWS)
    for t in range(n_tiles):
        s = t % STAGES
        for g in gl.static_range(GROUPS):
            nxt = _load_entries(slot, num_slots, pages_ptr, page_stride)
            slot = _group_slots(slot_ptrs, left, t * GROUPS + g + 2, ROWS)
            if g == 0:
                # Both accumulating partitions are done with this stage's previous tile.
                mbarrier.wait(k_empty.index(s), ((t // STAGES) & 1) ^ 1)
            _store_group(k_smem, rope_smem, bias_smem, s, g * ROWS, cur)
            cur = nxt
        fence_async_shared()
        mbarrier.arrive(k_ready.index(s), count=1)


@gluon.jit
def _store_rows(acc, inv, rows_out, h_ok, col0, OUT_BF16: gl.constexpr):
    """Store ``acc * inv`` [64 heads, 128] at columns ``col0 + j`` of each head's row (``rows_out`` [64])."""
    VL: gl.constexpr = _value_layout()
    j = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, VL))
    value = acc * inv[:, None]
    ptrs = rows_out[:, None] + (col0 + j)[None, :]
    if OUT_BF16:
        gl.store(ptrs, value.to(gl.bfloat16), mask=h_ok[:, None])
    else:
        gl.store(ptrs, value, mask=h_ok[:, None])


@gluon.jit
def _head_rows(out_ptr, lse_ptr, row, split, hb, num_heads, num_splits, SPLIT: gl.constexpr, LAYOUT: gl.constexpr):
    """(output row pointers [64], LSE pointers [64], which heads exist) of this program's heads in ``LAYOUT``:
    rows of ``out`` / ``lse``, or with SPLIT of the fp32 partials [rows, num_splits, H, 512] and their LSEs."""
    h = hb * HEADS + gl.arange(0, HEADS, layout=LAYOUT)
    if SPLIT:
        base = (row.to(gl.int64) * num_splits + split) * num_heads + h
    else:
        base = row.to(gl.int64) * num_heads + h
    return out_ptr + base * RANK, lse_ptr + base, h < num_heads


@gluon.jit
def _tile_slots(idx_row, start, stop, t, BLOCK_N: gl.constexpr):
    """Slots of tile ``t`` of the split [BLOCK_N] in the chunk layout's rows (``-1`` past the split)."""
    return _split_slots(idx_row, start, stop, t * BLOCK_N, BLOCK_N, gl.SliceLayout(1, _chunk_load_layout()))


@gluon.jit
def _prefetch_entries(slot, num_slots, pages_ptr, page_stride):
    """Bulk-prefetch the valid entries at ``slot`` (in the chunk layout's rows) into L2, one thread of the
    eight holding a row (both Gluon kernels)."""
    PL: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])  # the chunk layout's rows, a lane a column
    entry, valid = _entry_pointers(gl.convert_layout(slot, gl.SliceLayout(1, PL)), num_slots, pages_ptr, page_stride)
    lane = gl.arange(0, 8, layout=gl.SliceLayout(0, PL))
    first = valid[:, None] & (lane == 0)[None, :]
    gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [entry[:, None] + (lane * 0)[None, :], first.to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _value_partition(k_smem, p_smem, factor_smem, k_ready, k_empty, p_ready, p_empty, n_tiles, out_ptr, lse_ptr,
                     row, split, hb, num_heads, num_splits, idx_row, start, stop, num_slots, pages_ptr, page_stride,
                     SPLIT: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, L2_AHEAD: gl.constexpr):
    VL: gl.constexpr = _value_layout()
    rows: gl.constexpr = gl.SliceLayout(1, VL)
    acc2 = gl.zeros([HEADS, CHUNK], gl.float32, VL)
    acc3 = gl.zeros([HEADS, CHUNK], gl.float32, VL)
    if L2_AHEAD > 0:
        # This partition waits on its products most of a tile: it bulk-prefetches the entries of the tile
        # L2_AHEAD ahead into L2 for the gatherer, from slots it loaded a tile earlier (no wait on them).
        for ahead in gl.static_range(1, L2_AHEAD + 1):
            _prefetch_entries(_tile_slots(idx_row, start, stop, ahead, BLOCK_N), num_slots, pages_ptr, page_stride)
        slot = _tile_slots(idx_row, start, stop, L2_AHEAD + 1, BLOCK_N)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(k_ready.index(s), (t // STAGES) & 1)
        mbarrier.wait(p_ready, t & 1)
        alpha = factor_smem.load(rows)
        # Both accumulators rescaled before either product is issued (a rescale between two issues
        # makes ptxas wait for the first).
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        acc2 = warpgroup_mma(p_smem, k_smem[2].index(s), acc2, is_async=True)
        acc3 = warpgroup_mma(p_smem, k_smem[3].index(s), acc3, is_async=True)
        if L2_AHEAD > 0:
            _prefetch_entries(slot, num_slots, pages_ptr, page_stride)  # tile t + L2_AHEAD + 1
            slot = _tile_slots(idx_row, start, stop, t + L2_AHEAD + 2, BLOCK_N)
        acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2, acc3))
        mbarrier.arrive(p_empty, count=1)
        mbarrier.arrive(k_empty.index(s), count=1)
    mbarrier.wait(p_ready, n_tiles & 1)  # the final 1 / l
    inv = factor_smem.load(rows)
    rows_out, _, h_ok = _head_rows(out_ptr, lse_ptr, row, split, hb, num_heads, num_splits, SPLIT, rows)
    _store_rows(acc2, inv, rows_out, h_ok, 2 * CHUNK, not SPLIT)
    _store_rows(acc3, inv, rows_out, h_ok, 3 * CHUNK, not SPLIT)


@gluon.jit
def _score_partition(q_smem, q_rope_smem, k_smem, rope_smem, bias_smem, p_smem, factor_smem, k_ready, k_empty,
                     p_ready, p_empty, n_tiles, qk_scale, out_ptr, lse_ptr, row, split, hb, num_heads, num_splits,
                     SPLIT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    SL: gl.constexpr = _score_layout(BLOCK_N)
    VL: gl.constexpr = _value_layout()
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=VL, k_width=2)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(1, SL))
    acc0 = warpgroup_mma_init(gl.zeros([HEADS, CHUNK], gl.float32, VL))
    acc1 = warpgroup_mma_init(gl.zeros([HEADS, CHUNK], gl.float32, VL))
    zero = gl.zeros([HEADS, BLOCK_N], gl.float32, SL)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(k_ready.index(s), (t // STAGES) & 1)
        sc = warpgroup_mma(q_smem.index(0), k_smem[0].index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_smem.index(1), k_smem[1].index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma(q_smem.index(2), k_smem[2].index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma(q_smem.index(3), k_smem[3].index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma(q_rope_smem, rope_smem.index(s).permute((1, 0)), sc, is_async=True)
        # One wait for all: the previous tile's value products (issued before these five score products,
        # so done first on the tensor cores) and the scores. ptxas serializes every wgmma of the kernel
        # when an accumulator is read after a partial wait (num_outstanding > 0) across the loop's back edge.
        acc0, acc1, sc = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, sc))
        mbarrier.arrive(k_empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
        bias = bias_smem.index(s).load(gl.SliceLayout(0, SL))
        sc = sc * qk_scale + bias[None, :]

        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep p = 0, not NaN
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(gl.bfloat16)

        mbarrier.wait(p_empty, (t & 1) ^ 1)  # the value partition is past the previous weights
        p_smem.store(p16)
        factor_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)

        a = gl.convert_layout(p16, P_OPERAND, assert_trivial=True)
        alpha_v = gl.convert_layout(alpha, gl.SliceLayout(1, VL), assert_trivial=True)
        acc0 = acc0 * alpha_v[:, None]
        acc1 = acc1 * alpha_v[:, None]
        acc0 = warpgroup_mma(a, k_smem[0].index(s), acc0, is_async=True)
        acc1 = warpgroup_mma(a, k_smem[1].index(s), acc1, is_async=True)
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    mbarrier.arrive(k_empty.index((n_tiles + STAGES - 1) % STAGES), count=1, pred=n_tiles > 0)

    # l >= 1 once a slot is valid (the largest score adds exp2(0)); l = 0 only for none at all.
    seen = l_i > 0
    l_safe = gl.maximum(l_i, 1.0)
    inv = gl.where(seen, 1.0 / l_safe, 0.0)
    lse2 = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))  # base 2: what the merge of splits reads
    mbarrier.wait(p_empty, (n_tiles & 1) ^ 1)
    factor_smem.store(inv)
    mbarrier.arrive(p_ready, count=1)

    rows: gl.constexpr = gl.SliceLayout(1, VL)
    rows_out, lse_at, h_ok = _head_rows(out_ptr, lse_ptr, row, split, hb, num_heads, num_splits, SPLIT, rows)
    inv_v = gl.convert_layout(inv, rows)
    _store_rows(acc0, inv_v, rows_out, h_ok, 0, not SPLIT)
    _store_rows(acc1, inv_v, rows_out, h_ok, CHUNK, not SPLIT)
    if SPLIT:
        gl.store(lse_at, gl.convert_layout(lse2, rows), mask=h_ok)
    else:
        gl.store(lse_at, gl.convert_layout(lse2 * LN2, rows), mask=h_ok)


@gluon.jit
def _query_chunk(q_row, h_ok, col0, WIDTH: gl.constexpr):
    """Queries [heads, WIDTH] at columns ``col0 + j`` (0 where ``h_ok`` is false), for an operand of the score
    product in shared memory (both Gluon kernels)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    j = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
    rows = gl.convert_layout(q_row, gl.SliceLayout(1, L))
    ok = gl.convert_layout(h_ok, gl.SliceLayout(1, L))
    return gl.load(rows[:, None] + (col0 + j)[None, :], mask=ok[:, None], other=0.0)


@gluon.jit
def _row_split(row, split, s_q, topk, keys_per_split, idx_ptr, stride_ib, stride_is, BLOCK_N: gl.constexpr):
    """Where a program's query row and split are: (batch index, query index, first and end positions of the
    split in the row's top-k list, tiles of BLOCK_N slots it covers, the row's index pointer)."""
    b = row // s_q
    sq = row % s_q
    start = split * keys_per_split
    stop = gl.minimum(start + keys_per_split, topk)
    idx_row = idx_ptr + b.to(gl.int64) * stride_ib + sq.to(gl.int64) * stride_is
    return b, sq, start, stop, gl.cdiv(stop - start, BLOCK_N), idx_row


@gluon.jit
def _queries_in_smem(q_ptr, b, sq, h, num_heads, stride_qb, stride_qs, stride_qh, layout: gl.constexpr):
    """The queries of heads ``h`` of row ``(b, sq)`` in shared memory, 0 past ``num_heads``: the four latent
    chunks [4, heads, 128] and the rope part [heads, 64], in ``layout``."""
    h_ok = h < num_heads
    q_row = q_ptr + b.to(gl.int64) * stride_qb + sq.to(gl.int64) * stride_qs + h.to(gl.int64) * stride_qh
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, h.shape[0], CHUNK], layout)
    for c in gl.static_range(4):
        q_smem.index(c).store(_query_chunk(q_row, h_ok, c * CHUNK, CHUNK))
    q_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [h.shape[0], ROPE], layout,
                                            _query_chunk(q_row, h_ok, RANK, ROPE))
    return q_smem, q_rope_smem


@gluon.jit
def sparse_mla_decode_gluon_kernel(
    q_ptr,          # [B, s_q, H, 576] bf16, strides (stride_qb, stride_qs, stride_qh, 1)
    pages_ptr,      # uint8 [num_pages, 64, 656], page stride page_stride (16-byte aligned)
    idx_ptr,        # [B, s_q, topk] int32 slots, strides (stride_ib, stride_is, 1); -1 = none
    out_ptr,        # SPLIT: fp32 [rows, num_splits, H, 512]; else bf16 [rows, H, 512] (contiguous)
    lse_ptr,        # SPLIT: fp32 [rows, num_splits, H] base 2; else fp32 [rows, H] natural log
    num_heads, s_q, topk, keys_per_split, num_splits, num_slots, page_stride,
    stride_qb, stride_qs, stride_qh, stride_ib, stride_is,
    qk_scale,       # softmax_scale * log2(e)
    SPLIT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, L2_AHEAD: gl.constexpr,
    GATHER_REGS: gl.constexpr, VALUE_REGS: gl.constexpr,
):
    # Head blocks vary fastest, so the programs that read one row's slots run side by side (L2).
    pid = gl.program_id(0)
    num_hb = gl.cdiv(num_heads, HEADS)
    hb = pid % num_hb
    split = (pid // num_hb) % num_splits
    row = pid // (num_hb * num_splits)
    b, sq, start, stop, n_tiles, idx_row = _row_split(row, split, s_q, topk, keys_per_split, idx_ptr, stride_ib,
                                                      stride_is, BLOCK_N)
    heads: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    h = hb * HEADS + gl.arange(0, HEADS, layout=heads)
    # One layout for every bf16 operand tile (rows of 128 or 256 bytes, 128-byte swizzle); a leading
    # ring or chunk index is outside it.
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem, q_rope_smem = _queries_in_smem(q_ptr, b, sq, h, num_heads, stride_qb, stride_qs, stride_qh, wide)
    # One allocation a latent chunk, so the gatherer's stores into different chunks need no barrier
    # between them (Gluon cannot tell dynamic indices of one allocation apart).
    k_smem = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, CHUNK], wide),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, CHUNK], wide),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, CHUNK], wide),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, CHUNK], wide))
    rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, ROPE], wide)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], gl.bfloat16)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, BLOCK_N], p_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bias_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], flat)
    factor_smem = gl.allocate_shared_memory(gl.float32, [HEADS], flat)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # the score and the value partition
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_empty, count=1)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize([
        (_score_partition, (q_smem, q_rope_smem, k_smem, rope_smem, bias_smem, p_smem, factor_smem, k_ready, k_empty,
                            p_ready, p_empty, n_tiles, qk_scale, out_ptr, lse_ptr, row, split, hb, num_heads,
                            num_splits, SPLIT, BLOCK_N, STAGES)),
        (_gather_partition, (k_smem, rope_smem, bias_smem, k_ready, k_empty, idx_row, start, stop, n_tiles, num_slots,
                             pages_ptr, page_stride, BLOCK_N, STAGES)),
        (_value_partition, (k_smem, p_smem, factor_smem, k_ready, k_empty, p_ready, p_empty, n_tiles, out_ptr, lse_ptr,
                            row, split, hb, num_heads, num_splits, idx_row, start, stop, num_slots, pages_ptr,
                            page_stride, SPLIT, STAGES, BLOCK_N, L2_AHEAD)),
    ], [4, 4], [GATHER_REGS, VALUE_REGS])
