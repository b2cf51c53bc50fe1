"""Paged decode logits as Gluon kernels for Hopper, 1-4 query rows a request (next_n):
MXFP4 keys (``paged_decode_mxfp4_kernel``) and FP8 keys (``paged_decode_fp8_kernel``).

MXFP4: the same math as ``_paged_decode_kernel`` with its "table" decode (see ``triton_kernels``),
written with explicit layouts so that nothing moves through shared memory but the queries:

* each thread loads the packed words it decodes straight into registers, in the order the
  wgmma A operand wants them (thread ``4 g + c`` of a warp: token rows ``g`` and ``g + 8``,
  group ``c`` of each), and the next page's words, scales and the page id after it are
  loaded while the current page is scored, so no load latency sits inside a tile;
* the group scales are loaded the same way (a byte a row), their per-token maximum is a
  reduction over the 4 lanes of a quad;
* ``relu(x) = (x + |x|) / 2`` with the half folded into the head weights (the add runs on
  the FP32 pipe, a max would run on the integer pipe the decode already fills);
* rows past a request's length and unreadable pages are masked with scalar predicates,
  the stores go straight from the accumulator layout.

One difference from the Triton kernel: a token whose four group scales are all 2**-127 (keys
under 2**-124) scores 0 instead of its tiny value. Loads of a page that is never scored, or
scores -inf, are left undefined (no zero fill).

FP8 (``paged_decode_fp8_kernel``): the keys need no decode, so they go from the pool to shared
memory by TMA, in a ring of pages started ahead (a descriptor over the layer's pages; a -1 or
out-of-range block-table entry is fetched at a page index past the tensor, which reads nothing
and fills zeros), and the wgmma reads them there. All query rows of a request share one product
of N = rows x H columns, so each page is read once for all of them; its per-row sums over the
heads are a reshape and a reduction of the accumulator. Selected per next_n by
``DECODE_CONFIG["fp8_kernel"]`` (next_n 2-4 by default).

With several query rows the MXFP4 kernel scores them all in one product of N = rows x H
columns and sums each row's heads as the FP8 kernel does; with one row it keeps a scalar length
and row pointer (the [64, rows] bookkeeping costs ~26 registers at H = 64, one program an SM).

MXFP4 is selected with ``MXFP4_DECODE_CONFIG["kernel"] = "gluon"`` (the default); the CPU interpreter,
other GPUs and ``"kernel": "triton"`` use ``_paged_decode_kernel``. H200, B = 64, 128K, next_n = 1:
248 -> 213 us at H = 32, 318 -> 267 us at H = 64 (SASS loop body per 64-token page and warp:
279 -> 236 instructions, 140 -> 95 on the integer pipe, H = 32); next_n = 2: 386 -> 304 us at
H = 32, 568 -> 402 us at H = 64.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsacache.ops.indexer_logits.triton_kernels import group_tables_ptx, table_lookup_ptx

# One register of e4m3 bytes from half s of a packed word: $1 the word, $5 the half's shift
# (0 or 16), $9 the group's t (< 0: dropped). Tables and sign trick as in _TABLE_ASM
# (triton_kernels.py); pack=4 hands each input over four times, only the first is read.
_HALF_ASM = gl.constexpr("""
{
.reg .pred kept;
.reg .b32 pl, ph, nl, nh, sel, flip, pos, neg;
""" + group_tables_ptx("$9") + """shr.u32 sel, $1, $5;
xor.b32 flip, sel, 0x8888;
""" + table_lookup_ptx("$0", "sel") + """}
""")


@gluon.constexpr_function
def _key_layout():
    """[64 tokens, 4 words, 2 halves, 4 groups, 4 bytes] -> the wgmma A operand registers
    (reshaped to [64, 128]: column 32 w + 16 s + 4 g + j, see ``_table_columns``)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                   [0, 2, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]],
        block_bases=[],
        shape=[64, 4, 2, 4, 4],
    )


@gluon.constexpr_function
def _word_load_layout():
    """[64 tokens, 4 words, 4 groups] with a thread's 4 words of a group in consecutive
    registers (one 16-byte load); the same threads as ``_key_layout``."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [8, 0, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 4, 4],
    )


@gluon.jit
def _load_words(page_values, offs, pred):
    """A page's packed words [64 tokens, 4 words, 4 groups] int32 (undefined where not pred:
    such a page is never scored or scores -inf)."""
    return gl.load(page_values.to(gl.pointer_type(gl.int32)) + offs, mask=pred)


@gluon.jit
def _load_group_scales(page_scales, offs, pred):
    """A page's UE8M0 group scales [64 tokens, 4 groups] as int32 (undefined where not pred)."""
    return gl.load(page_scales + offs, mask=pred).to(gl.int32)


@gluon.jit
def _decode(words, scale, KEYS: gl.constexpr, A: gl.constexpr):
    """Words [64, 4, 4] and scales [64, 4] -> (e4m3 A operand [64, 128], top scale byte [64])."""
    top = gl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, KEYS)))))
    shift = (half * 16)[None, None, :, None, None]
    w5 = gl.broadcast(words[:, :, None, :, None], gl.zeros([64, 4, 2, 4, 4], gl.int32, KEYS))[0]
    t5 = t[:, None, None, :, None]
    byte = gl.inline_asm_elementwise(_HALF_ASM, "=r" + ",r" * 12, [w5, shift, t5], dtype=gl.uint8,
                                     is_pure=True, pack=4)
    keys = gl.reshape(byte, [64, 128])
    keys = gl.convert_layout(keys, A, assert_trivial=True)
    return keys.to(gl.float8e4nv, bitcast=True), top


@gluon.jit
def paged_decode_mxfp4_kernel(
    q_ptr,            # [B * NEXT_N * H, D] e4m3, D = 128
    w_ptr,            # [B * NEXT_N, H] fp32
    lens_ptr,         # [B, NEXT_N] int32 (PER_ROW) or [B] int32; clamped here to [0, max_model_len]
    values_ptr,       # [P, 64, 64] uint8 packed e2m1 (page stride page_stride)
    scales_ptr,       # [P, 64, 4] uint8 UE8M0 (page stride scale_stride)
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [B * NEXT_N, max_model_len] fp32
    num_pages, max_blocks, bt_stride, page_stride, scale_stride, max_model_len, out_stride,
    NEXT_N: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, PER_ROW: gl.constexpr, TILES: gl.constexpr,
):
    D: gl.constexpr = 128
    PAGE: gl.constexpr = 64
    N: gl.constexpr = ROWS * H
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    KEYS: gl.constexpr = _key_layout()
    WORDS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(4, KEYS))          # [64, word, group]
    SCALES: gl.constexpr = gl.SliceLayout(1, WORDS)                           # [64, group]
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])      # [N, D] queries
    QS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

    b = gl.program_id(1)
    col0 = gl.program_id(0) * (TILES * PAGE)
    ncol = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    len_col, longest = _row_lengths(lens_ptr, b, ncol, max_model_len, NEXT_N, H, PER_ROW)

    # Queries [N, D] in the key column order (_table_columns), as the B operand in shared memory
    # (row n: query row n // H, head n % H; rows past NEXT_N zero).
    n = gl.arange(0, N, layout=gl.SliceLayout(1, QL))
    col = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    d = 32 * ((col // 4) % 4) + 8 * (col // 32) + 4 * ((col // 16) % 2) + col % 4
    q_bytes = q_ptr.to(gl.pointer_type(gl.uint8)) + (b * NEXT_N * H).to(gl.int64) * D
    q = gl.load(q_bytes + n[:, None] * D + d[None, :], mask=(n < NEXT_N * H)[:, None], other=0)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, D], QS, q.to(gl.float8e4nv, bitcast=True))
    fence_async_shared()
    gl.thread_barrier()
    # relu(x) * w = (x + |x|) * (w / 2); the 2**-6 of the token factor 2**(top - 133) is folded in too.
    w = gl.load(w_ptr + b * NEXT_N * H + ncol, mask=ncol < NEXT_N * H, other=0.0) * 0.0078125

    num_scored = gl.minimum(gl.maximum(gl.cdiv(longest - col0, PAGE), 0), TILES)
    # Per-thread offsets of the words and scales it loads, inside a page.
    WL: gl.constexpr = _word_load_layout()
    tok_w = gl.arange(0, PAGE, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    group_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    word_offs = tok_w[:, None, None] * 16 + word[None, :, None] + group_w[None, None, :] * 4
    tok_s = gl.arange(0, PAGE, layout=gl.SliceLayout(1, SCALES))
    group_s = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES))
    scale_offs = tok_s[:, None] * 4 + group_s[None, :]

    if ROWS == 1:
        # One query row: scalar length and row pointer, scores in the accumulator's row layout
        # (the [64, ROWS] tensors below cost ~26 registers at H = 64 and an SM program).
        TOK: gl.constexpr = gl.SliceLayout(1, MMA)
        tok = gl.arange(0, PAGE, layout=TOK)
        out_row = out_ptr + b.to(gl.int64) * out_stride + col0
    else:
        tok2, len2, out_rows, row_ok = _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, MMA, NEXT_N, ROWS,
                                                    H)
        TOK: gl.constexpr = gl.SliceLayout(1, tok2.type.layout)
    bt_row = bt_ptr + b * bt_stride
    blk0 = col0 // PAGE
    zero = gl.zeros([PAGE, N], gl.float32, MMA)
    page = gl.load(bt_row + blk0, mask=(num_scored > 0) & (blk0 < max_blocks), other=-1)
    ok_next = (page >= 0) & (page < num_pages)
    page = gl.where(ok_next, page, 0).to(gl.int64)
    words_next = _load_words(values_ptr + page * page_stride, word_offs, ok_next)
    scales_next = _load_group_scales(scales_ptr + page * scale_stride, scale_offs, ok_next)
    page_ahead = gl.load(bt_row + blk0 + 1, mask=(num_scored > 1) & (blk0 + 1 < max_blocks), other=-1)
    for t in range(num_scored):
        words = words_next
        scales = scales_next
        ok = ok_next
        # Next page's loads first: they complete while this page is scored.
        ok_next = (page_ahead >= 0) & (page_ahead < num_pages)
        more = ok_next & (t + 1 < num_scored)
        page = gl.where(ok_next, page_ahead, 0).to(gl.int64)
        words_next = _load_words(values_ptr + page * page_stride, word_offs, more)
        scales_next = _load_group_scales(scales_ptr + page * scale_stride, scale_offs, more)
        page_ahead = gl.load(bt_row + blk0 + t + 2, mask=(t + 2 < num_scored) & (blk0 + t + 2 < max_blocks),
                             other=-1)

        keys, top = _decode(gl.convert_layout(words, WORDS), scales, KEYS, A)
        acc = warpgroup_mma(keys, q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # 2**(top - 127) from its bits (the 2**-6 is in w); top 0 gives 0 instead of 2**-127.
        factor = gl.convert_layout((top << 23).to(gl.float32, bitcast=True), TOK)
        if ROWS == 1:
            scores = gl.sum((acc + gl.abs(acc)) * w[None, :], axis=1) * factor
            # Scalar bounds: visible tokens of this page (0 if unreadable) and tokens inside out.
            seen = gl.where(ok, longest - col0 - t * PAGE, 0)
            scores = gl.where(tok < seen, scores, float("-inf"))
            gl.store(out_row + t * PAGE + tok, scores, mask=tok < max_model_len - col0 - t * PAGE)
        else:
            scores = _row_sums((acc + gl.abs(acc)) * w[None, :], ROWS, H) * factor[:, None]
            _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, t * PAGE, max_model_len)

    if ROWS == 1:
        blank = gl.full([PAGE], float("-inf"), gl.float32, TOK)
        for t in range(num_scored, TILES):
            gl.store(out_row + t * PAGE + tok, blank, mask=tok < max_model_len - col0 - t * PAGE)
    else:
        _fill_blank(out_rows, row_ok, tok2, col0, num_scored, max_model_len, TILES)


@gluon.jit
def _row_sums(x, ROWS: gl.constexpr, H: gl.constexpr):
    """[64, ROWS * H] -> [64, ROWS]: each query row's sum over its heads."""
    return gl.sum(gl.reshape(x, [64, ROWS, H]), axis=2)


@gluon.jit
def _per_row(x, ROWS: gl.constexpr, H: gl.constexpr):
    """[64, ROWS * H] int32, constant over each query row's heads -> [64, ROWS] in the layout of
    ``_row_sums``."""
    return gl.max(gl.reshape(x, [64, ROWS, H]), axis=2)


@gluon.jit
def _row_lengths(lens_ptr, b, ncol, max_model_len, NEXT_N: gl.constexpr, H: gl.constexpr, PER_ROW: gl.constexpr):
    """(the clamped length of each product column's query row [N], the longest of them)."""
    row_of_col = ncol // H
    if PER_ROW:
        len_col = gl.load(lens_ptr + b * NEXT_N + row_of_col, mask=row_of_col < NEXT_N, other=0)
    else:  # one length a request: row r sees ctx - NEXT_N + r + 1 positions
        len_col = gl.load(lens_ptr + b + 0 * row_of_col) - NEXT_N + row_of_col + 1
    len_col = gl.where(row_of_col < NEXT_N, gl.minimum(gl.maximum(len_col, 0), max_model_len), 0)
    return len_col, gl.max(len_col, axis=0)


@gluon.jit
def _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, MMA: gl.constexpr, NEXT_N: gl.constexpr,
                 ROWS: gl.constexpr, H: gl.constexpr):
    """[64 tokens, ROWS] tensors in the layout of ``_row_sums``: token index, row length, output
    pointer at the program's first column, and whether the row exists (row < NEXT_N)."""
    zero = gl.zeros([64, ROWS * H], gl.int32, MMA)
    tok2 = _per_row(zero + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))[:, None], ROWS, H)
    row2 = _per_row(zero + (ncol // H)[None, :], ROWS, H)
    len2 = _per_row(zero + len_col[None, :], ROWS, H)
    out_rows = out_ptr + (b * NEXT_N + row2).to(gl.int64) * out_stride + col0 + tok2
    return tok2, len2, out_rows, row2 < NEXT_N


@gluon.jit
def _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, offset, max_model_len):
    """Store a page's scores [64, ROWS] at the program's columns ``offset + token``: -inf where a
    row does not see the token or the page was unreadable (``ok`` false), nothing past the row."""
    seen = gl.where(ok, len2 - col0 - offset, 0)
    scores = gl.where(tok2 < seen, scores, float("-inf"))
    gl.store(out_rows + offset, scores, mask=row_ok & (tok2 < max_model_len - col0 - offset))


@gluon.jit
def _fill_blank(out_rows, row_ok, tok2, col0, num_scored, max_model_len, TILES: gl.constexpr):
    """-inf in the program's pages past the longest row (every program writes all its columns)."""
    blank = gl.full(tok2.shape, float("-inf"), gl.float32, tok2.type.layout)
    for t in range(num_scored, TILES):
        gl.store(out_rows + t * 64, blank, mask=row_ok & (tok2 < max_model_len - col0 - t * 64))


@gluon.jit
def _fetch_page(k_desc, bt_row, blk, live, max_blocks, num_pages, bar, dest):
    """Start the TMA copy of block ``blk``'s key page into ``dest`` (arriving on ``bar``) when
    ``live``. An entry that is -1, past the table or past the pool is fetched at page
    ``num_pages``: outside the tensor, so the copy reads nothing and fills zeros."""
    page = gl.load(bt_row + blk, mask=live & (blk < max_blocks), other=-1)
    page = gl.where((page >= 0) & (page < num_pages), page, num_pages)
    mbarrier.expect(bar, 64 * 128, pred=live)
    tma.async_copy_global_to_shared(k_desc, [page, 0, 0], bar, dest, pred=live)


@gluon.jit
def paged_decode_fp8_kernel(
    q_ptr,            # [B * NEXT_N * H, D] e4m3, D = 128
    w_ptr,            # [B * NEXT_N, H] fp32
    lens_ptr,         # [B, NEXT_N] int32 (PER_ROW) or [B] int32; clamped here to [0, max_model_len]
    k_desc,           # TMA descriptor of the key values [P, 64, 128] e4m3, block [1, 64, 128]
    scales_ptr,       # [P, 64] fp32 (page stride scale_stride, in floats)
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [B * NEXT_N, max_model_len] fp32
    num_pages, max_blocks, bt_stride, scale_stride, max_model_len, out_stride,
    NEXT_N: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, PER_ROW: gl.constexpr, TILES: gl.constexpr,
    STAGES: gl.constexpr,
):
    D: gl.constexpr = 128
    PAGE: gl.constexpr = 64
    N: gl.constexpr = ROWS * H
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    QS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

    b = gl.program_id(1)
    col0 = gl.program_id(0) * (TILES * PAGE)
    bt_row = bt_ptr + b * bt_stride
    blk0 = col0 // PAGE

    ncol = gl.arange(0, N, layout=COLS)
    len_col, longest = _row_lengths(lens_ptr, b, ncol, max_model_len, NEXT_N, H, PER_ROW)
    num_scored = gl.minimum(gl.maximum(gl.cdiv(longest - col0, PAGE), 0), TILES)

    # The key ring: the first STAGES pages start loading before anything else.
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 1, PAGE, D], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):
        _fetch_page(k_desc, bt_row, blk0 + s, s < num_scored, max_blocks, num_pages, bars.index(s), k_smem.index(s))

    # Queries [N, D] (row n: query row n // H, head n % H; rows past NEXT_N zero) as the B operand.
    n = gl.arange(0, N, layout=gl.SliceLayout(1, QL))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    q_bytes = q_ptr.to(gl.pointer_type(gl.uint8)) + (b * NEXT_N * H).to(gl.int64) * D
    q = gl.load(q_bytes + n[:, None] * D + d[None, :], mask=(n < NEXT_N * H)[:, None], other=0)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, D], QS, q.to(gl.float8e4nv, bitcast=True))
    # relu(x) * w = (x + |x|) * (w / 2)
    w = gl.load(w_ptr + b * NEXT_N * H + ncol, mask=ncol < NEXT_N * H, other=0.0) * 0.5
    fence_async_shared()
    gl.thread_barrier()

    tok2, len2, out_rows, row_ok = _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, MMA, NEXT_N, ROWS, H)
    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, tok2.type.layout))
    acc0 = gl.zeros([PAGE, N], gl.float32, MMA)

    page = gl.load(bt_row + blk0, mask=(num_scored > 0) & (blk0 < max_blocks), other=-1)
    ok_next = (page >= 0) & (page < num_pages)
    scales_next = gl.load(scales_ptr + gl.where(ok_next, page, 0).to(gl.int64) * scale_stride + tok, mask=ok_next)
    for t in range(num_scored):
        slot = t % STAGES
        scales = scales_next
        ok = ok_next
        page = gl.load(bt_row + blk0 + t + 1, mask=(t + 1 < num_scored) & (blk0 + t + 1 < max_blocks), other=-1)
        ok_next = (page >= 0) & (page < num_pages)
        scales_next = gl.load(scales_ptr + gl.where(ok_next, page, 0).to(gl.int64) * scale_stride + tok,
                              mask=ok_next)

        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        keys = k_smem.index(slot).reshape([PAGE, D])
        acc = warpgroup_mma(keys, q_smem.permute((1, 0)), acc0, use_acc=False, is_async=True)
        acc, keys = warpgroup_mma_wait(num_outstanding=0, deps=(acc, keys))
        # Every warp is past its wgmma, so the slot is free for the page STAGES ahead.
        gl.thread_barrier()
        _fetch_page(k_desc, bt_row, blk0 + t + STAGES, t + STAGES < num_scored, max_blocks, num_pages,
                    bars.index(slot), k_smem.index(slot))

        scores = _row_sums((acc + gl.abs(acc)) * w[None, :], ROWS, H) * scales[:, None]
        _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, t * PAGE, max_model_len)

    _fill_blank(out_rows, row_ok, tok2, col0, num_scored, max_model_len, TILES)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
