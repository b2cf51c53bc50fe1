"""Sparse MLA decode for up to 16 query heads (K3.1's 12 a rank at TP 8) as a warp-specialized Gluon
kernel for Hopper: 656-B ``fp8_ds_mla`` entries, the keys as the wgmma M, the heads as its N.

With 16 heads, heads as the M of a wgmma (64 rows) would pay for 64; here every product is
turned around so that the 64 slots of a tile are the M and the 16 heads the N:

* scores ``S^T [64 slots, 16 heads] = K @ q^T``, one accumulator a 128-value latent chunk (and
  one for the rope part), so each chunk's tile scale multiplies its rows in fp32 and the keys stay
  the exact e4m3 codes (no key is ever rounded; ``lse`` is as exact as the Triton kernel's);
* values ``out^T [512, 16] += codes^T @ (P^T * scale)``, a chunk at a time: the A operand is the
  same bf16 tile read transposed from shared memory, the B operand the weights times that chunk's
  tile scale, rounded to bf16 (as the Triton kernel does).

Three partitions share a program's shared memory:

* two gatherers (workers of one warpgroup each) take the tiles in turn (gatherer ``g`` tiles
  ``g, g + 2, ...``, stage ``g`` of a two-stage ring). Each loads its next tile's 64 entries into
  registers (codes, tile scales, rope part) *before* it waits for its stage to be free, so a tile's
  gathers are in flight while the tile before it is attended; with ``L2_AHEAD`` it also
  bulk-prefetches the entries of the tile after that into L2 (their slots, loaded a round earlier,
  have arrived, so the prefetch never waits). Then it converts the codes to bf16 (exact), stores
  them, and records the scales and which slots are valid (an additive 0 / -inf score bias);
* the attender (the default partition) runs the score products, the online softmax in base 2 over
  the slots (axis 0 of ``S^T``), writes the four scaled weight tiles and issues the value products,
  which run while it waits for the next tile and its scores.

With ``SPLIT`` a program writes its normalized fp32 partial and base-2 LSE for the Triton
``merge_splits_kernel``, as the other kernels do. ``launch.py`` says when this kernel runs.
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

from dsacache.ops.sparse_mla.decode_gluon import (
    CHUNK,
    LN2,
    RANK,
    ROPE,
    _load_entries,
    _prefetch_entries,
    _queries_in_smem,
    _row_split,
    _tile_slots,
)

HEADS = gl.constexpr(16)    # query heads a program: the wgmma N
TILE = gl.constexpr(64)     # slots a tile: the wgmma M
STAGES = gl.constexpr(2)    # tiles in the ring, one a gatherer


@gluon.constexpr_function
def _score_layout():
    """A chunk's scores S^T [64 slots, 16 heads] fp32: one warpgroup, M = 64, N = 16."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])


@gluon.constexpr_function
def _out_layout():
    """A value chunk's accumulator out^T [128 values, 16 heads] fp32: two M = 64 wgmmas."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])


@gluon.jit
def _codes_bf16(codes):
    """e4m3 codes (raw bytes) as bf16: exact, every e4m3 value is a bf16 value."""
    return codes.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)


@gluon.jit
def _gather_partition(k_smem, rope_smem, scale_smem, bias_smem, k_ready, k_empty, idx_row, start, stop, n_tiles,
                      num_slots, pages_ptr, page_stride, FIRST: gl.constexpr, L2_AHEAD: gl.constexpr):
    s: gl.constexpr = FIRST  # one gatherer a stage
    slot = _tile_slots(idx_row, start, stop, FIRST, TILE)
    ahead = _tile_slots(idx_row, start, stop, FIRST + STAGES, TILE)
    for t in range(FIRST, n_tiles, STAGES):
        c0, c1, c2, c3, s0, s1, s2, s3, rope, valid = _load_entries(slot, num_slots, pages_ptr, page_stride)
        if L2_AHEAD:
            # This gatherer's next tile, whose slots arrived during the last round: into L2 now, so its
            # loads next round wait on L2, not HBM.
            _prefetch_entries(ahead, num_slots, pages_ptr, page_stride)
        # The slots two rounds ahead load beside these entries.
        slot = ahead
        ahead = _tile_slots(idx_row, start, stop, t + 2 * STAGES, TILE)
        # The loads above are in flight while the attender finishes this stage's previous tile.
        mbarrier.wait(k_empty.index(s), ((t // STAGES) & 1) ^ 1)
        k_smem.index(4 * s).store(_codes_bf16(c0))
        k_smem.index(4 * s + 1).store(_codes_bf16(c1))
        k_smem.index(4 * s + 2).store(_codes_bf16(c2))
        k_smem.index(4 * s + 3).store(_codes_bf16(c3))
        rope_smem.index(s).store(rope)
        scale_smem.index(4 * s).store(s0)
        scale_smem.index(4 * s + 1).store(s1)
        scale_smem.index(4 * s + 2).store(s2)
        scale_smem.index(4 * s + 3).store(s3)
        bias_smem.index(s).store(gl.where(valid, 0.0, float("-inf")))
        fence_async_shared()
        mbarrier.arrive(k_ready.index(s), count=1)


@gluon.jit
def _scaled_weights(p_smem, c: gl.constexpr, p, scale):
    """Weight tile ``c`` of the value product: ``bf16(P^T * scale)`` [64 slots, 16 heads]."""
    p_smem.index(c).store((p * scale[:, None]).to(gl.bfloat16))


@gluon.jit
def _store_out(acc, inv, rows_out, h_ok, c: gl.constexpr, OUT_BF16: gl.constexpr):
    """Store chunk ``c`` of out^T [128, 16] times ``inv`` [16] into each head's row (``rows_out`` [16])."""
    OL: gl.constexpr = _out_layout()
    j = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, OL))
    value = acc * inv[None, :]
    ptrs = rows_out[None, :] + j[:, None]
    if OUT_BF16:
        gl.store(ptrs, value.to(gl.bfloat16), mask=h_ok[None, :])
    else:
        gl.store(ptrs, value, mask=h_ok[None, :])


@gluon.jit
def _attend_partition(q_smem, q_rope_smem, k_smem, rope_smem, scale_smem, bias_smem, p_smem, k_ready, k_empty,
                      n_tiles, qk_scale, out_ptr, lse_ptr, row, split, num_heads, num_splits, SPLIT: gl.constexpr):
    SL: gl.constexpr = _score_layout()
    OL: gl.constexpr = _out_layout()
    slots: gl.constexpr = gl.SliceLayout(1, SL)
    heads: gl.constexpr = gl.SliceLayout(0, SL)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, heads)
    l_i = gl.zeros([HEADS], gl.float32, heads)
    acc0 = warpgroup_mma_init(gl.zeros([CHUNK, HEADS], gl.float32, OL))
    acc1 = warpgroup_mma_init(gl.zeros([CHUNK, HEADS], gl.float32, OL))
    acc2 = warpgroup_mma_init(gl.zeros([CHUNK, HEADS], gl.float32, OL))
    acc3 = warpgroup_mma_init(gl.zeros([CHUNK, HEADS], gl.float32, OL))
    zero = gl.zeros([TILE, HEADS], gl.float32, SL)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(k_ready.index(s), (t // STAGES) & 1)
        k0 = k_smem.index(4 * s)
        k1 = k_smem.index(4 * s + 1)
        k2 = k_smem.index(4 * s + 2)
        k3 = k_smem.index(4 * s + 3)
        sc0 = warpgroup_mma(k0, q_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        sc1 = warpgroup_mma(k1, q_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
        sc2 = warpgroup_mma(k2, q_smem.index(2).permute((1, 0)), zero, use_acc=False, is_async=True)
        sc3 = warpgroup_mma(k3, q_smem.index(3).permute((1, 0)), zero, use_acc=False, is_async=True)
        scr = warpgroup_mma(rope_smem.index(s), q_rope_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        # One wait for all nine: the previous tile's value products (issued first, so done first on the
        # tensor cores) and these scores. ptxas serializes every wgmma of the kernel when an accumulator
        # is read after a partial wait (num_outstanding > 0) across the loop's back edge.
        acc0, acc1, acc2, acc3, sc0, sc1, sc2, sc3, scr = warpgroup_mma_wait(
            num_outstanding=0, deps=(acc0, acc1, acc2, acc3, sc0, sc1, sc2, sc3, scr))
        mbarrier.arrive(k_empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
        f0 = scale_smem.index(4 * s).load(slots)
        f1 = scale_smem.index(4 * s + 1).load(slots)
        f2 = scale_smem.index(4 * s + 2).load(slots)
        f3 = scale_smem.index(4 * s + 3).load(slots)
        bias = bias_smem.index(s).load(slots)
        sc = sc0 * f0[:, None] + sc1 * f1[:, None] + sc2 * f2[:, None] + sc3 * f3[:, None] + scr
        sc = sc * qk_scale + bias[:, None]

        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep p = 0, not NaN
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new

        _scaled_weights(p_smem, 0, p, f0)
        _scaled_weights(p_smem, 1, p, f1)
        _scaled_weights(p_smem, 2, p, f2)
        _scaled_weights(p_smem, 3, p, f3)
        fence_async_shared()
        gl.thread_barrier()
        # Every accumulator rescaled before the first product is issued (a rescale between two issues
        # makes ptxas wait for the first).
        a = gl.convert_layout(alpha, gl.SliceLayout(0, OL))[None, :]
        acc0 = acc0 * a
        acc1 = acc1 * a
        acc2 = acc2 * a
        acc3 = acc3 * a
        acc0 = warpgroup_mma(k0.permute((1, 0)), p_smem.index(0), acc0, is_async=True)
        acc1 = warpgroup_mma(k1.permute((1, 0)), p_smem.index(1), acc1, is_async=True)
        acc2 = warpgroup_mma(k2.permute((1, 0)), p_smem.index(2), acc2, is_async=True)
        acc3 = warpgroup_mma(k3.permute((1, 0)), p_smem.index(3), acc3, is_async=True)
    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))

    # l >= 1 once a slot is valid (the largest score adds exp2(0)); l = 0 only for none at all.
    seen = l_i > 0
    l_safe = gl.maximum(l_i, 1.0)
    inv = gl.convert_layout(gl.where(seen, 1.0 / l_safe, 0.0), gl.SliceLayout(0, OL))
    lse2 = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))  # base 2: what the merge of splits reads
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(0, OL))
    h_ok = h < num_heads
    if SPLIT:
        base = (row.to(gl.int64) * num_splits + split) * num_heads + h
    else:
        base = row.to(gl.int64) * num_heads + h
    rows_out = out_ptr + base * RANK
    _store_out(acc0, inv, rows_out, h_ok, 0, not SPLIT)
    _store_out(acc1, inv, rows_out, h_ok, 1, not SPLIT)
    _store_out(acc2, inv, rows_out, h_ok, 2, not SPLIT)
    _store_out(acc3, inv, rows_out, h_ok, 3, not SPLIT)
    h_s = gl.arange(0, HEADS, layout=heads)
    lse_at = lse_ptr + gl.convert_layout(base, heads)
    if SPLIT:
        gl.store(lse_at, lse2, mask=h_s < num_heads)
    else:
        gl.store(lse_at, lse2 * LN2, mask=h_s < num_heads)


@gluon.jit
def sparse_mla_decode_gluon16_kernel(
    q_ptr,          # [B, s_q, H, 576] bf16 (H <= 16), strides (stride_qb, stride_qs, stride_qh, 1)
    pages_ptr,      # uint8 [num_pages, 64, 656], page stride page_stride (16-byte aligned)
    idx_ptr,        # [B, s_q, topk] int32 slots, strides (stride_ib, stride_is, 1); -1 = none
    out_ptr,        # SPLIT: fp32 [rows, num_splits, H, 512]; else bf16 [rows, H, 512] (contiguous)
    lse_ptr,        # SPLIT: fp32 [rows, num_splits, H] base 2; else fp32 [rows, H] natural log
    num_heads, s_q, topk, keys_per_split, num_splits, num_slots, page_stride,
    stride_qb, stride_qs, stride_qh, stride_ib, stride_is,
    qk_scale,       # softmax_scale * log2(e)
    SPLIT: gl.constexpr, L2_AHEAD: gl.constexpr, GATHER_REGS: gl.constexpr,
):
    pid = gl.program_id(0)
    split = pid % num_splits
    row = pid // num_splits
    b, sq, start, stop, n_tiles, idx_row = _row_split(row, split, s_q, topk, keys_per_split, idx_ptr, stride_ib,
                                                      stride_is, TILE)
    head_l: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    h = gl.arange(0, HEADS, layout=head_l)
    # One layout for every bf16 operand tile of 128- or 256-byte rows (128-byte swizzle); a leading
    # ring or chunk index is outside it. The weight tiles have 32-byte rows.
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem, q_rope_smem = _queries_in_smem(q_ptr, b, sq, h, num_heads, stride_qb, stride_qs, stride_qh, wide)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, TILE, CHUNK], wide)
    rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE, ROPE], wide)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEADS], gl.bfloat16)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [4, TILE, HEADS], p_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_smem = gl.allocate_shared_memory(gl.float32, [4 * STAGES, TILE], flat)
    bias_smem = gl.allocate_shared_memory(gl.float32, [STAGES, TILE], flat)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=1)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize([
        (_attend_partition, (q_smem, q_rope_smem, k_smem, rope_smem, scale_smem, bias_smem, p_smem, k_ready, k_empty,
                             n_tiles, qk_scale, out_ptr, lse_ptr, row, split, num_heads, num_splits, SPLIT)),
        (_gather_partition, (k_smem, rope_smem, scale_smem, bias_smem, k_ready, k_empty, idx_row, start, stop,
                             n_tiles, num_slots, pages_ptr, page_stride, 0, L2_AHEAD)),
        (_gather_partition, (k_smem, rope_smem, scale_smem, bias_smem, k_ready, k_empty, idx_row, start, stop,
                             n_tiles, num_slots, pages_ptr, page_stride, 1, L2_AHEAD)),
    ], [4, 4], [GATHER_REGS, GATHER_REGS])
