"""Paged decode logits as Gluon kernels for Hopper, 1-4 query rows a request (next_n):
MXFP4 keys (``paged_decode_mxfp4_kernel``) and FP8 keys (``paged_decode_fp8_kernel``).

Both score a page as one wgmma of the 64 keys against all query rows of the request (N = rows x
H columns, so each page is read once), then sum the heads with a second wgmma
(``_mma_head_sums``): ``relu(q.k)`` is rounded to bf16 straight into its A registers and
multiplied by the head weights (bf16 plus the bf16 of what that rounding left, so the weights
keep ~16 significant bits), one output column pair per query row. That replaces ~N FP32
instructions a thread and the quad shuffles of a sum over the accumulator. The bf16 rounding
moves a head's term by at most 2**-9 relative (calc-diff against the FP32 reference ~1e-7, far
inside the 1e-3 / 2e-2 tolerances); the Triton kernel keeps FP32 throughout.

A product's rows are a power of two (``ROWS``, a tensor's shape). next_n 3 runs as two products
of 2 and 1 rows on the same keys (``ROWS2``), 3 H columns instead of 4 H: a quarter less tensor
work and fewer accumulators. Their head sums go into one accumulator.

MXFP4: the math of the Triton kernel with the table decode (``mxfp4_e4m3``), written with
explicit layouts so that nothing moves through shared memory but the queries and the head
weights:

* each thread loads the packed words it decodes straight into registers, in the order the
  wgmma A operand wants them (thread ``4 g + c`` of a warp: token rows ``g`` and ``g + 8``,
  group ``c`` of each); page t + 1's words and scales load while page t is scored and page
  t + 2 is copied into L2 by one bulk prefetch, so no load latency sits inside a page (the
  program's block-table entries are read into shared memory once, ``_block_entries``); for
  narrow products (``PAIRS``) the loop takes two pages an iteration, which spares ptxas the
  register copies of a loop-carried page;
* the group scales are loaded the same way (a byte a row), their per-token maximum is a
  reduction over the 4 lanes of a quad;
* rows past a request's length and unreadable pages are masked at the store; a page that is
  -1, past the pool or past the program's last page is read at page 0 (unmasked loads: a
  masked load costs a zero fill a register) and scores -inf.

One difference from the Triton kernel: a token whose four group scales are all 2**-127 (keys
under 2**-124) scores 0 instead of its tiny value. The kernel reads a page's scales right after
its values (the pool's page layout, checked by the launcher).

FP8 (``paged_decode_fp8_kernel``): the keys need no decode, so they go from the pool to shared
memory by TMA, in a ring of pages started ahead (a descriptor over the layer's pages; a -1 or
out-of-range block-table entry is fetched at a page index past the tensor, which reads nothing
and fills zeros), and the wgmma reads them there.

``launch.py`` says when each runs.
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

from dsacache.ops.indexer_logits.mxfp4_e4m3 import (
    group_tables_flag_ptx,
    group_tables_ptx,
    table_columns,
    table_decode_ptx,
    table_lookup_ptx,
)
from dsacache.ops.triton_utils import block_table_page

# One register of e4m3 bytes from half s of a packed word: $1 the word, $5 the half's shift
# (0 or 16), $9 the group's t (< 0: dropped), $13 -1, and for _HALF_FLAG_ASM $17 1. Tables and
# sign trick as in WORD_DECODE_ASM (mxfp4_e4m3.py); the selector's complement is 0xFFFF + (-1) *
# selector, with the -1 a kernel argument: ptxas would turn a multiply by a literal -1 into an
# ALU subtract, and the ALU pipe is what the decode waits on (the FMA pipe has room).
# _HALF_FLAG_ASM zeroes a dropped group's tables by a multiply (group_tables_flag_ptx), more of
# the same trade, where registers allow (launch.py, gluon_flag_columns).
# pack=4 hands each input over four times, only the first is read.
def _half_asm(tables: str) -> str:
    return table_decode_ptx(tables + "shr.u32 sel, $1, $5;\nmad.lo.u32 flip, sel, $13, 65535;\n"
                            + table_lookup_ptx("$0", "sel"))


_HALF_ASM = gl.constexpr(_half_asm(group_tables_ptx("$9")))
_HALF_FLAG_ASM = gl.constexpr(_half_asm(group_tables_flag_ptx("$9", "$17")))


# relu and the bf16 rounding of two accumulators in one instruction ($1 the first, low half).
_RELU_BF16X2_ASM = gl.constexpr("cvt.rn.relu.bf16x2.f32 $0, $2, $1;")


@gluon.constexpr_function
def _sum_mma_layout():
    """The head-sum product [64 tokens, 8 columns] (fp32): column 2r + 1 and 2r of query row r."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])


@gluon.constexpr_function
def _score_mma_layout(n):
    """The score product [64 tokens, n = rows x heads] (fp32), K = 32 a wgmma instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.jit
def _query_operand(q_ptr, b, ROW0: gl.constexpr, NEXT_N: gl.constexpr, H: gl.constexpr, N: gl.constexpr,
                   TABLE_ORDER: gl.constexpr):
    """Request ``b``'s queries from query row ``ROW0`` on, [N, 128] e4m3, as the B operand of a
    score product, in shared memory (row n: query row ROW0 + n // H, head n % H; rows past NEXT_N
    zero), columns in the key order of the table decode (``table_columns``) when ``TABLE_ORDER``
    (MXFP4 keys), in element order otherwise."""
    D: gl.constexpr = 128
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    QS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    n = gl.arange(0, N, layout=gl.SliceLayout(1, QL))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    if TABLE_ORDER:
        d = table_columns(d, D // 32)
    q_bytes = q_ptr.to(gl.pointer_type(gl.uint8)) + ((b * NEXT_N + ROW0) * H).to(gl.int64) * D
    q = gl.load(q_bytes + n[:, None] * D + d[None, :], mask=(n < (NEXT_N - ROW0) * H)[:, None], other=0)
    return gl.allocate_shared_memory(gl.float8e4nv, [N, D], QS, q.to(gl.float8e4nv, bitcast=True))


@gluon.jit
def _head_weight_operand(w_ptr, b, scale, ROW0: gl.constexpr, NEXT_N: gl.constexpr, H: gl.constexpr,
                         N: gl.constexpr):
    """The head weights (times ``scale``) of the score product from query row ``ROW0`` on
    (``_query_operand``) as the B operand [8, N] bf16 of its head-sum product, in shared memory:
    column 2r holds row r's weights rounded to bf16, column 2r + 1 what that rounding left (so the
    pair keeps ~16 significant bits), every other entry 0."""
    WL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    j = gl.arange(0, 8, layout=gl.SliceLayout(1, WL))[:, None]
    n = gl.arange(0, N, layout=gl.SliceLayout(0, WL))[None, :]
    w = gl.load(w_ptr + (b * NEXT_N + ROW0) * H + n + 0 * j,
                mask=(n < (NEXT_N - ROW0) * H) & (j // 2 == ROW0 + n // H), other=0.0) * scale
    hi = w.to(gl.bfloat16)
    part = gl.where(j % 2 == 0, hi, (w - hi.to(gl.float32)).to(gl.bfloat16))
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, N], gl.bfloat16)
    return gl.allocate_shared_memory(gl.bfloat16, [8, N], layout, part)


@gluon.jit
def _head_sum_product(acc, w_smem, sums, USE_ACC: gl.constexpr):
    """``sums (+)= relu(acc) . w`` for a score product ``acc`` [64, N] (fp32, columns = rows x
    heads) and its head weights (``_head_weight_operand``), issued as a wgmma: relu(acc) rounded
    to bf16 straight into its A registers (the accumulator layout is the A operand layout). Per
    page that is N / 4 conversions a thread (two values each, on the ALU pipe) and N / 16 wgmmas
    instead of ~N FP32 instructions a thread and the quad shuffles. (Measured against it and
    slower at nearly every shape, docs/benchmarks.md: TF32 products straight from the
    accumulators, relu as x + |x| on the FMA pipe, twice the wgmmas; and those FP32 sums with
    the shuffles, ~18 registers more.)"""
    S: gl.constexpr = _sum_mma_layout()
    p = gl.inline_asm_elementwise(_RELU_BF16X2_ASM, "=r,r,r", [acc], dtype=gl.bfloat16, is_pure=True, pack=2)
    p = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=S, k_width=2), assert_trivial=True)
    return warpgroup_mma(p, w_smem.permute((1, 0)), sums, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _mma_head_sums(acc, w_smem, acc2, w2_smem, TWO: gl.constexpr):
    """Scores [64 tokens, 4 rows]: the head sums of the score product ``acc`` (``_head_sum_product``)
    and, when ``TWO``, of the second product ``acc2`` added in the same accumulator (each row's
    weights sit in its own column pair, so the two products' sums do not overlap)."""
    sums = _head_sum_product(acc, w_smem, gl.zeros([64, 8], gl.float32, _sum_mma_layout()), False)
    if TWO:
        sums = _head_sum_product(acc2, w2_smem, sums, True)
    sums = warpgroup_mma_wait(num_outstanding=0, deps=(sums, ))
    return gl.sum(gl.reshape(sums, [64, 4, 2]), axis=2)


@gluon.constexpr_function
def _second_columns(ROWS2, ROWS, H):
    """Columns of the second score product (``ROWS2`` query rows; a placeholder the width of the
    first when there is none, so that the unused operands still have a shape)."""
    return (ROWS2 if ROWS2 > 0 else ROWS) * H


@gluon.jit
def _products_operands(q_ptr, w_ptr, b, scale, NEXT_N: gl.constexpr, H: gl.constexpr, ROWS: gl.constexpr,
                       ROWS2: gl.constexpr, TABLE_ORDER: gl.constexpr):
    """Queries and head weights in shared memory for the score products of a page: query rows
    [0, ROWS) in the first and, when ``ROWS2`` > 0, rows [ROWS, ROWS + ROWS2) in a second (next_n 3
    as 2 + 1 rows: 3 H columns of products instead of 4 H). Without a second product its operands
    are the first's, unused."""
    N: gl.constexpr = ROWS * H
    q_smem = _query_operand(q_ptr, b, 0, NEXT_N, H, N, TABLE_ORDER)
    w_smem = _head_weight_operand(w_ptr, b, scale, 0, NEXT_N, H, N)
    if ROWS2 > 0:
        q2_smem = _query_operand(q_ptr, b, ROWS, NEXT_N, H, ROWS2 * H, TABLE_ORDER)
        w2_smem = _head_weight_operand(w_ptr, b, scale, ROWS, NEXT_N, H, ROWS2 * H)
    else:
        q2_smem = q_smem
        w2_smem = w_smem
    return q_smem, w_smem, q2_smem, w2_smem


@gluon.constexpr_function
def _key_layout():
    """[64 tokens, 4 words, 2 halves, 4 groups, 4 bytes] -> the wgmma A operand registers
    (reshaped to [64, 128]: column 32 w + 16 s + 4 g + j, see ``table_columns``)."""
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
def _decode(words, scale, minus_one, KEYS: gl.constexpr, A: gl.constexpr, FLAG: gl.constexpr):
    """Words [64, 4, 4] and scales [64, 4] -> (e4m3 A operand [64, 128], top scale byte [64]);
    ``minus_one``: the kernel's -1 argument; ``FLAG``: dropped groups zeroed by a multiply
    (``_HALF_FLAG_ASM``) instead of selects (``_HALF_ASM``)."""
    top = gl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, KEYS)))))
    shift = (half * 16)[None, None, :, None, None]
    w5 = gl.broadcast(words[:, :, None, :, None], gl.zeros([64, 4, 2, 4, 4], gl.int32, KEYS))[0]
    t5 = t[:, None, None, :, None]
    m1 = gl.full([64, 4, 2, 4, 4], minus_one, gl.int32, KEYS)
    if FLAG:
        one = gl.full([64, 4, 2, 4, 4], minus_one * minus_one, gl.int32, KEYS)
        byte = gl.inline_asm_elementwise(_HALF_FLAG_ASM, "=r" + ",r" * 20, [w5, shift, t5, m1, one], dtype=gl.uint8,
                                         is_pure=True, pack=4)
    else:
        byte = gl.inline_asm_elementwise(_HALF_ASM, "=r" + ",r" * 16, [w5, shift, t5, m1], dtype=gl.uint8,
                                         is_pure=True, pack=4)
    keys = gl.reshape(byte, [64, 128])
    keys = gl.convert_layout(keys, A, assert_trivial=True)
    return keys.to(gl.float8e4nv, bitcast=True), top


@gluon.jit
def paged_decode_mxfp4_kernel(
    q_ptr,            # [B * NEXT_N * H, D] e4m3, D = 128
    w_ptr,            # [B * NEXT_N, H] fp32
    lens_ptr,         # [B, NEXT_N] int32 (PER_ROW) or [B] int32; clamped here to [0, max_model_len]
    pages_ptr,        # [P, 4352] uint8 pages (page stride page_stride, 16-byte aligned), P >= 1: the
                      # packed e2m1 [64, 64] then the UE8M0 scales [64, 4]
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [B * NEXT_N, max_model_len] fp32
    num_pages, max_blocks, bt_stride, page_stride, max_model_len, out_stride,
    minus_one,        # -1, a multiplier ptxas cannot see (_HALF_ASM, _HALF_FLAG_ASM)
    NEXT_N: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, PER_ROW: gl.constexpr, TILES: gl.constexpr,
    ROWS2: gl.constexpr = 0,  # query rows of a second score product after the ROWS of the first (0: none)
    PAIRS: gl.constexpr = False,  # two pages an iteration (launch.py: for narrow products only)
    FLAG: gl.constexpr = False,   # dropped groups' tables zeroed by a multiply, not selects (_HALF_FLAG_ASM)
):
    PAGE: gl.constexpr = 64
    MMA: gl.constexpr = _score_mma_layout(ROWS * H)
    N2: gl.constexpr = _second_columns(ROWS2, ROWS, H)
    MMA2: gl.constexpr = _score_mma_layout(N2)

    b = gl.program_id(1)
    col0 = gl.program_id(0) * (TILES * PAGE)
    ncol, len_col, num_scored = _program_rows(lens_ptr, b, col0, max_model_len, NEXT_N, PER_ROW, TILES)

    # The 2**-6 of the token factor 2**(top - 133) is folded into the weights.
    operands = _products_operands(q_ptr, w_ptr, b, 0.015625, NEXT_N, H, ROWS, ROWS2, True)
    entries = _block_entries(bt_ptr + b * bt_stride, col0 // PAGE, num_scored, max_blocks, num_pages, TILES, 2)
    fence_async_shared()
    gl.thread_barrier()

    tok2, len2, out_rows, row_ok = _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, NEXT_N)
    offs = _page_offsets()
    pages = (pages_ptr, page_stride)
    zeros = (gl.zeros([PAGE, ROWS * H], gl.float32, MMA), gl.zeros([PAGE, N2], gl.float32, MMA2))
    out_args = (out_rows, row_ok, tok2, len2, col0, max_model_len)
    # Page t + 1's words and scales load into registers while page t is scored and page t + 2
    # is copied into L2, so no load waits inside a page (more pages ahead was slower). A page
    # that is -1, past the pool or past num_scored is read at page 0 (a masked load costs a
    # zero fill a register) and scores -inf.
    base_a, ok_a = _page_base(_entry(entries, 0), *pages)
    words_a, scales_a = _load_page(base_a, offs)
    base_b, ok_b = _page_base(_entry(entries, 1), *pages)
    if PAIRS:
        # Two pages an iteration, each in its own registers: with one, ptxas copies the
        # loop-carried words and pointers into place every page. The look-ahead reaches entry
        # num_scored + 1 at most, inside the two slots past num_scored that _block_entries fills with -1.
        for t in range(0, num_scored - 1, 2):
            words_b, scales_b, base_c, ok_c = _next_pages(base_b, entries, t + 2, pages, offs)
            _score_page(words_a, scales_a, ok_a, t * PAGE, zeros, operands, minus_one, ROWS2 > 0, FLAG, *out_args)
            ok_page = ok_b
            words_a, scales_a, base_b, ok_b = _next_pages(base_c, entries, t + 3, pages, offs)
            _score_page(words_b, scales_b, ok_page, (t + 1) * PAGE, zeros, operands, minus_one, ROWS2 > 0, FLAG,
                        *out_args)
            ok_a = ok_c
        if num_scored % 2 == 1:
            _score_page(words_a, scales_a, ok_a, (num_scored - 1) * PAGE, zeros, operands, minus_one, ROWS2 > 0,
                        FLAG, *out_args)
    else:
        for t in range(num_scored):
            words, scales, ok = words_a, scales_a, ok_a
            ok_a = ok_b
            words_a, scales_a, base_b, ok_b = _next_pages(base_b, entries, t + 2, pages, offs)
            _score_page(words, scales, ok, t * PAGE, zeros, operands, minus_one, ROWS2 > 0, FLAG, *out_args)
    _fill_blank(out_rows, row_ok, tok2, col0, num_scored, max_model_len, TILES)


@gluon.jit
def _page_offsets():
    """Per-thread offsets of the packed words [64, 4 words, 4 groups] and the group scales
    [64, 4 groups] a thread loads, inside a page (``_word_load_layout`` and the decode's scales)."""
    WL: gl.constexpr = _word_load_layout()
    SCALES: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, _key_layout())))
    tok_w = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    group_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    tok_s = gl.arange(0, 64, layout=gl.SliceLayout(1, SCALES))
    group_s = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES))
    words = tok_w[:, None, None] * 16 + word[None, :, None] + group_w[None, None, :] * 4
    return words, tok_s[:, None] * 4 + group_s[None, :]


# Thread 0 starts a bulk copy of the 4352-byte page at $2 into L2 (TMA unit, no registers).
_PREFETCH_ASM = gl.constexpr("""{
.reg .pred p;
setp.eq.s32 p, $1, 0;
@p cp.async.bulk.prefetch.L2.global [$2], 4352;
mov.b32 $0, 0;
}""")


@gluon.constexpr_function
def _power_of_two_at_least(n):
    return 1 << (n - 1).bit_length()


@gluon.jit
def _block_entries(bt_row, blk0, num_scored, max_blocks, num_pages, TILES: gl.constexpr, AHEAD: gl.constexpr):
    """The program's pages in shared memory, read once at the start: ``block_table_page`` of each
    block, -1 where it is unusable and past num_scored (which covers the AHEAD look-ahead slots
    past the last page). An entry loaded from global memory inside the page loop made every page
    wait for it (ptxas moves the loop-carried entry into a uniform register at the end of the
    iteration that loads it)."""
    SLOTS: gl.constexpr = _power_of_two_at_least(TILES + AHEAD)
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, SLOTS, layout=L)
    entry, _ = block_table_page(bt_row, blk0 + i, i < num_scored, max_blocks, num_pages)
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    smem = gl.allocate_shared_memory(gl.int32, [SLOTS], layout, entry)
    # The same bytes as [SLOTS, 1] rows, so that .index(t) (a dynamic index) gives entry t.
    return smem._reinterpret(gl.int32, [SLOTS, 1], layout)


@gluon.jit
def _entry(entries, t):
    """Entry ``t`` of ``_block_entries`` as a scalar."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(entries.index(t).load(L), axis=0)


@gluon.jit
def _page_base(page, pages_ptr, page_stride):
    """(the first byte of page ``page`` of ``_block_entries``, page 0's when it is -1; whether it is usable)."""
    ok = page >= 0
    # The page index as a 32-bit zero-extended multiplier.
    row = gl.where(ok, page, 0).to(gl.uint32, bitcast=True)
    return pages_ptr + row.to(gl.uint64) * page_stride.to(gl.uint64, bitcast=False), ok


@gluon.jit
def _prefetch_l2(base):
    """Copy a page (values and scales) into L2 ahead of its register loads."""
    lane = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,r,l", [lane, base + 0 * lane], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _next_pages(base, entries, t, pages, offs):
    """The loop's look-ahead: the page at ``base`` loaded into registers (``_load_page``), and
    entry ``t``'s page found and started into L2; returns (words, scales, entry t's base, whether
    it is usable)."""
    words, scales = _load_page(base, offs)
    base_t, ok_t = _page_base(_entry(entries, t), *pages)
    _prefetch_l2(base_t)
    return words, scales, base_t, ok_t


@gluon.jit
def _load_page(base, offs):
    """A page's packed words [64, 4, 4] int32 and group scales [64, 4] int32 (``_page_offsets``)."""
    words = gl.load(base.to(gl.pointer_type(gl.int32)) + offs[0])
    scales = gl.load(base + 64 * 64 + offs[1]).to(gl.int32)
    return words, scales


@gluon.jit
def _score_page(words, scales, ok, offset, zeros, operands, minus_one, TWO: gl.constexpr, FLAG: gl.constexpr,
                out_rows, row_ok, tok2, len2, col0, max_model_len):
    """Decode a page, score it against the queries and store its [64, rows] logits at columns
    ``col0 + offset + token`` (-inf where unreadable or past a row's length). ``zeros``: [64, N]
    fp32 zeros in the layouts of the score products, ``operands``: ``_products_operands``,
    ``minus_one``: the kernel's -1 argument, ``TWO``: whether there is a second product,
    ``FLAG``: the kernel's (``_decode``)."""
    q_smem, w_smem, q2_smem, w2_smem = operands
    KEYS: gl.constexpr = _key_layout()
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zeros[0].type.layout, k_width=4)
    keys, top = _decode(gl.convert_layout(words, gl.SliceLayout(2, gl.SliceLayout(4, KEYS))), scales, minus_one,
                        KEYS, A, FLAG)
    acc = warpgroup_mma(keys, q_smem.permute((1, 0)), zeros[0], use_acc=False, is_async=True)
    if TWO:
        # The same A registers; the second product's layout differs only in its width.
        keys2 = gl.convert_layout(keys, gl.DotOperandLayout(operand_index=0, parent=zeros[1].type.layout, k_width=4),
                                  assert_trivial=True)
        acc2 = warpgroup_mma(keys2, q2_smem.permute((1, 0)), zeros[1], use_acc=False, is_async=True)
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc2 = acc
    # 2**(top - 127) from its bits (the 2**-6 is in the weights); top 0 gives 0 instead of 2**-127.
    factor = gl.convert_layout((top << 23).to(gl.float32, bitcast=True), gl.SliceLayout(1, tok2.type.layout))
    scores = _mma_head_sums(acc, w_smem, acc2, w2_smem, TWO) * factor[:, None]
    _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, offset, max_model_len)


@gluon.jit
def _pair_max(x):
    """[64, 8] int32 in the head-sum layout, equal within each column pair -> [64, 4 rows] in the
    layout of ``_mma_head_sums``."""
    return gl.max(gl.reshape(x, [64, 4, 2]), axis=2)


@gluon.jit
def _row_lengths(lens_ptr, b, ncol, max_model_len, NEXT_N: gl.constexpr, PER_ROW: gl.constexpr):
    """The clamped length of the query row of each head-sum column [8] (row = column // 2; 0 past
    NEXT_N)."""
    row = ncol // 2
    if PER_ROW:
        lens = gl.load(lens_ptr + b * NEXT_N + row, mask=row < NEXT_N, other=0)
    else:  # one length a request: row r sees ctx - NEXT_N + r + 1 positions
        lens = gl.load(lens_ptr + b + 0 * row) - NEXT_N + row + 1
    return gl.where(row < NEXT_N, gl.minimum(gl.maximum(lens, 0), max_model_len), 0)


@gluon.jit
def _longest_row(lens_ptr, b, max_model_len, NEXT_N: gl.constexpr, PER_ROW: gl.constexpr):
    """The clamped length of a request's longest query row, from scalar loads (a reduction over
    a lane-spread vector instead made ptxas treat the page loop as divergent: no uniform
    datapath, wgmma descriptors in vector registers, +23 registers at H = 32)."""
    if PER_ROW:
        longest = gl.load(lens_ptr + b * NEXT_N)
        for r in gl.static_range(1, NEXT_N):
            longest = gl.maximum(longest, gl.load(lens_ptr + b * NEXT_N + r))
    else:  # row NEXT_N - 1 sees the whole context
        longest = gl.load(lens_ptr + b)
    return gl.minimum(gl.maximum(longest, 0), max_model_len)


@gluon.jit
def _program_rows(lens_ptr, b, col0, max_model_len, NEXT_N: gl.constexpr, PER_ROW: gl.constexpr,
                  TILES: gl.constexpr):
    """A program's row bookkeeping, in the head-sum product's [64, 4 rows] layout (column pairs
    2r, 2r + 1): (the columns [8], each column's row length, the pages the program scores)."""
    ncol = gl.arange(0, 8, layout=gl.SliceLayout(0, _sum_mma_layout()))
    len_col = _row_lengths(lens_ptr, b, ncol, max_model_len, NEXT_N, PER_ROW)
    longest = _longest_row(lens_ptr, b, max_model_len, NEXT_N, PER_ROW)
    return ncol, len_col, gl.minimum(gl.maximum(gl.cdiv(longest - col0, 64), 0), TILES)


@gluon.jit
def _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, NEXT_N: gl.constexpr):
    """[64 tokens, 4 rows] tensors in the layout of ``_mma_head_sums``: token index, row length,
    output pointer at the program's first column, and whether the row exists (row < NEXT_N)."""
    S: gl.constexpr = _sum_mma_layout()
    zero = gl.zeros([64, 8], gl.int32, S)
    tok2 = _pair_max(zero + gl.arange(0, 64, layout=gl.SliceLayout(1, S))[:, None])
    row2 = _pair_max(zero + (ncol // 2)[None, :])
    len2 = _pair_max(zero + len_col[None, :])
    out_rows = out_ptr + (b * NEXT_N + row2).to(gl.int64) * out_stride + col0 + tok2
    return tok2, len2, out_rows, row2 < NEXT_N


@gluon.jit
def _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, offset, max_model_len):
    """Store a page's scores [64, 4 rows] at the program's columns ``offset + token``: -inf where a
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
def _fetch_page(k_desc, page, live, num_pages, bar, dest):
    """Start the TMA copy of key page ``page`` (a block-table entry) into ``dest`` (arriving on
    ``bar``) when ``live``. An unusable page (-1, ``_block_entries``) is fetched at page
    ``num_pages``: outside the tensor, so the copy reads nothing and fills zeros."""
    page = gl.where(page >= 0, page, num_pages)
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
    STAGES: gl.constexpr, ROWS2: gl.constexpr = 0,  # as in paged_decode_mxfp4_kernel
):
    D: gl.constexpr = 128
    PAGE: gl.constexpr = 64
    N: gl.constexpr = ROWS * H
    N2: gl.constexpr = _second_columns(ROWS2, ROWS, H)
    MMA: gl.constexpr = _score_mma_layout(N)
    MMA2: gl.constexpr = _score_mma_layout(N2)

    b = gl.program_id(1)
    col0 = gl.program_id(0) * (TILES * PAGE)
    ncol, len_col, num_scored = _program_rows(lens_ptr, b, col0, max_model_len, NEXT_N, PER_ROW, TILES)

    # The key ring: the first STAGES pages start loading before anything else.
    entries = _block_entries(bt_ptr + b * bt_stride, col0 // PAGE, num_scored, max_blocks, num_pages, TILES,
                             STAGES)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 1, PAGE, D], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    gl.thread_barrier()
    for s in gl.static_range(STAGES):
        _fetch_page(k_desc, _entry(entries, s), s < num_scored, num_pages, bars.index(s), k_smem.index(s))

    q_smem, w_smem, q2_smem, w2_smem = _products_operands(q_ptr, w_ptr, b, 1.0, NEXT_N, H, ROWS, ROWS2, False)
    tok2, len2, out_rows, row_ok = _row_outputs(out_ptr, out_stride, b, col0, ncol, len_col, NEXT_N)
    fence_async_shared()
    gl.thread_barrier()

    tok = gl.arange(0, PAGE, layout=gl.SliceLayout(1, tok2.type.layout))
    acc0 = gl.zeros([PAGE, N], gl.float32, MMA)
    acc20 = gl.zeros([PAGE, N2], gl.float32, MMA2)

    page = _entry(entries, 0)
    ok_next = page >= 0
    scales_next = gl.load(scales_ptr + gl.where(ok_next, page, 0).to(gl.int64) * scale_stride + tok, mask=ok_next)
    for t in range(num_scored):
        slot = t % STAGES
        scales = scales_next
        ok = ok_next
        page = _entry(entries, t + 1)
        ok_next = page >= 0
        scales_next = gl.load(scales_ptr + gl.where(ok_next, page, 0).to(gl.int64) * scale_stride + tok,
                              mask=ok_next)

        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        keys = k_smem.index(slot).reshape([PAGE, D])
        acc = warpgroup_mma(keys, q_smem.permute((1, 0)), acc0, use_acc=False, is_async=True)
        if ROWS2 > 0:
            acc2 = warpgroup_mma(keys, q2_smem.permute((1, 0)), acc20, use_acc=False, is_async=True)
            acc, acc2, keys = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2, keys))
        else:
            acc, keys = warpgroup_mma_wait(num_outstanding=0, deps=(acc, keys))
            acc2 = acc
        # Every warp is past its wgmma, so the slot is free for the page STAGES ahead.
        gl.thread_barrier()
        _fetch_page(k_desc, _entry(entries, t + STAGES), t + STAGES < num_scored, num_pages, bars.index(slot),
                    k_smem.index(slot))

        scores = _mma_head_sums(acc, w_smem, acc2, w2_smem, ROWS2 > 0) * scales[:, None]
        _store_page(scores, out_rows, row_ok, tok2, len2, ok, col0, t * PAGE, max_model_len)

    _fill_blank(out_rows, row_ok, tok2, col0, num_scored, max_model_len, TILES)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
