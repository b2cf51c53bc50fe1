"""Triton kernels for the indexer logits, and their launchers.

Both kernels score one tile of ``BLOCK_N`` keys against every head of a small block of
query rows with one tensor-core product, keys as the left operand:

    acc[j, m] = key[j] . q[m]          [BLOCK_N, ROWS * H]  (m = row * H + head)
    logit[j, row] = sum_h w[row, h] * relu(acc[j, row * H + h])

FP8 keys: e4m3 x e4m3 products, the per-token scale applied after the head sum (it is a
positive power of two, so it commutes with ``relu``).

MXFP4 keys (Hopper has no fp4 tensor cores) become e4m3 in registers, exactly, with
the four per-32 group scales folded in, so a tile is one K=128 fp8 product like FP8:
an e2m1 value ``v`` of a group with scale byte ``s_g`` is written as the e4m3 number
``v * 2**(s_g - s_max + 6)`` (``s_max``: the token's largest scale byte), which e4m3
holds exactly for ``s_g >= s_max - 11`` (encoding tables below); the token then carries
the single scale ``2**(s_max - 133)``, applied after the head sum as for FP8. A group
more than 2**11 below its token's largest group is dropped (its products are under
2**-9 of the largest group's; the reference keeps them). On CUDA the nibble -> byte
rewrite is a byte-permute table lookup (``prmt``), four values an instruction; the
interpreter and other backends use the same math in plain integer ops. Queries stay the
same FP8 tensor as for FP8 keys. The decode builds the lookup tables once per 32-value group
and leaves each thread's values in the order they were packed, which permutes the key columns;
the queries are read in the same permuted order, which leaves the dot products unchanged. It
reads the packed values as 32-bit words; key rows that are not 4-byte aligned are decoded a
byte at a time instead, in element order and plain integer ops.

Every program owns a fixed range of output columns and writes all of them: scored
tiles first, then ``-inf`` for the tiles past the longest row, so no separate fill pass.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.triton_utils import INTERPRET, check_launch, loop_bound

#: The inline-PTX MXFP4 decode needs a compiled NVIDIA kernel.
PTX_AVAILABLE = not INTERPRET and torch.version.hip is None

#: Launch settings for the paged decode kernel (a tile is one 64-token page, TILES tiles a
#: program). Register caps (NVIDIA only, None = no cap) for products of at most ``maxnreg_cols`` columns
#: (next_n rounded up to a power of two, times H): ``maxnreg`` with one query row a request,
#: ``maxnreg_rows`` with several. H200, B=64, 128K: H = 64, next_n = 1: 299 -> 293 us at 64
#: (8 programs an SM instead of 7); H = 32, next_n = 2: 518 -> 366 us at 96 (64 spills there);
#: wider products got slower with any cap tried. ``split_rows`` maps next_n (2-4) to the fewest
#: heads for which each query row gets its own product (N = H) instead of one of N = next_n * H:
#: H200, 128K, next_n = 2, H = 64: 556 -> 481 us; slower at H = 32 and at next_n = 4
#: (docs/bench-results/2026-11-29-h200-pm/logits_split_rows_probe.log).
#: ``fp8_kernel`` (next_n -> "gluon" or "triton"): FP8 keys with several query rows a request run
#: ``gluon_kernels.paged_decode_fp8_kernel`` on Hopper (TMA-fed key pages, ``fp8_stages`` deep,
#: ``fp8_gluon_tiles`` pages a program). H200, B=64, 128K: next_n = 2, H = 64 481 -> 297 us,
#: H = 32 360 -> 283 us; next_n = 4, H = 64 1000 -> 557 us. At next_n = 1 it is even with this
#: module's kernel at 128K and slower at 32K, H = 32 (82 against 78 us), so that one stays
#: (docs/bench-results/2026-11-29-h200-stop12/head_sum_mma_probe.log).
DECODE_CONFIG = {"BLOCK_N": 64, "TILES": 8, "num_warps": 4, "num_stages": 2, "maxnreg": 64, "maxnreg_rows": 96,
                 "maxnreg_cols": 64, "split_rows": {2: 64},
                 "fp8_kernel": {2: "gluon", 3: "gluon", 4: "gluon"}, "fp8_gluon_tiles": 32, "fp8_stages": 4}
#: What MXFP4 keys change in DECODE_CONFIG (tuned on their own; the table decode keeps its keys
#: in registers only while the tile is 16 * num_warps tokens). The register cap helps at H = 32
#: (256 -> 248 us) and hurts at H = 64 (319 -> 348 us). ``kernel``: "gluon" runs
#: ``gluon_kernels.paged_decode_mxfp4_kernel`` where it applies (``_gluon_decode``), "triton" this
#: module's kernel.
MXFP4_DECODE_CONFIG: dict = {"TILES": 16, "maxnreg_cols": 32, "maxnreg_rows": None, "kernel": "gluon"}
#: Launch settings for the ragged prefill kernel (ROWS query rows a program).
PREFILL_CONFIG = {"BLOCK_N": 64, "TILES": 8, "ROWS": 4, "num_warps": 4, "num_stages": 3}


@triton.jit
def _head_sum(acc, w, ROWS: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, ROWS*H] fp32, w [ROWS*H] -> sum_h w * relu(acc) as [BLOCK_N, ROWS]."""
    acc = tl.maximum(acc, 0.0) * w[None, :]
    return tl.sum(tl.reshape(acc, [BLOCK_N, ROWS, H]), axis=2)


#: Group offset byte marking a dropped group (``t < 0``); otherwise the byte is ``8 * t``.
DROPPED_GROUP = tl.constexpr(0x80)

@triton.jit
def _nibble_to_e4m3(code, offset):
    """One e2m1 code (int32 0..15) and its group offset byte -> e4m3 byte (int32), plain ops."""
    mag = code & 7
    base = tl.where(mag == 1, 8, 4 * mag + 8)
    byte = tl.where(mag == 0, 0, base + offset) | ((code & 8) << 4)
    return tl.where(offset >= DROPPED_GROUP, 0, byte)


@triton.jit
def _mxfp4_key_tile_bytes(packed_rows, scale, ok, D: tl.constexpr):
    """MXFP4 keys at byte pointers packed_rows [BLOCK_N] with their scale bytes [BLOCK_N, D/32]
    -> (e4m3 [BLOCK_N, D] in element order, fp32 [BLOCK_N]), read a byte at a time: the decode
    for key rows that are not 4-byte aligned, where ``_mxfp4_key_tile_table`` cannot read words."""
    G: tl.constexpr = D // 32
    g = tl.arange(0, G)
    byte = tl.arange(0, 16)
    packed = tl.load(packed_rows[:, None, None] + (16 * g[None, :, None] + byte[None, None, :]),
                     mask=ok[:, None, None], other=0)
    scale = scale.to(tl.int32)
    top = tl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    offset = tl.where(t >= 0, 8 * t, DROPPED_GROUP)[:, :, None]
    codes = packed.to(tl.int32)
    lo = _nibble_to_e4m3(codes & 15, offset).to(tl.uint8)
    hi = _nibble_to_e4m3(codes >> 4, offset).to(tl.uint8)
    keys = tl.reshape(tl.join(lo, hi), [packed.shape[0], D]).to(tl.float8e4nv, bitcast=True)
    return keys, _mxfp4_token_factor(top)


@triton.jit
def _mxfp4_token_factor(top):
    """A token's largest scale byte -> its fp32 factor 2**(top - 133)."""
    # 2**(top - 127) built from its bits (top 0 -> 2**-127), then 2**-6.
    unit = (tl.maximum(top, 1) << 23).to(tl.float32, bitcast=True) * tl.where(top == 0, 0.5, 1.0)
    return unit * 0.015625


# The "table" decode. $0/$1: e4m3 bytes of codes 0-3 / 4-7 of the packed word $2 (code i in
# bits 4i..4i+3, low nibble first as stored); $6: the group's t = s_g - s_max + 11 (< 0:
# dropped). pack=4 hands each input over as four copies (one per output byte), only the
# first is read. Per group, two prmt tables: bytes 0..7 of (pl, ph) are the e4m3 codes of the
# magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 times 2**(t - 5) (the offset 8 t of ``_nibble_to_e4m3``
# is added to the nonzero codes once a group here), and (nl, nh) hold (that byte | 0x80) >> 1; a dropped group
# gets all-zero tables. The table math repeats in every word of a group; ptxas computes it once.
# Per value, the selector nibbles are the codes themselves: bits 0-2 pick a table byte and
# bit 3, the sign, makes prmt replicate that byte's msb (0 here) instead. So `pos` holds the
# magnitudes of the positive codes and 0 for the negative ones; with the sign bits flipped
# first, the second table gives the negative ones, and pos + 2 neg is the signed byte (every
# magnitude is a multiple of 4, so nothing is lost by the halving, and -0 stays 0x80 as in
# `_nibble_to_e4m3`). 9 instructions a word, 8 values.
def group_tables_ptx(t: str) -> str:
    """PTX that builds a group's four prmt tables (pl, ph, nl, nh; all zero for a dropped
    group) from its t in operand ``t``, for the "table" decodes (here and ``gluon_kernels``)."""
    return f"""setp.ge.s32 kept, {t}, 0;
mad.lo.s32 pl, {t}, 0x08080800, 0x14100800;
mad.lo.s32 ph, {t}, 0x08080808, 0x24201C18;
mad.lo.s32 nl, {t}, 0x04040400, 0x4A484440;
mad.lo.s32 nh, {t}, 0x04040404, 0x52504E4C;
selp.b32 pl, pl, 0, kept;
selp.b32 ph, ph, 0, kept;
selp.b32 nl, nl, 0, kept;
selp.b32 nh, nh, 0, kept;
"""


def table_lookup_ptx(out: str, sel: str) -> str:
    """PTX: the four signed e4m3 bytes of the codes selected by ``sel`` (flip: ``sel`` with its
    sign bits flipped) from the group's tables, into ``out``."""
    return f"""prmt.b32 pos, pl, ph, {sel};
prmt.b32 neg, nl, nh, flip;
shl.b32 neg, neg, 1;
add.u32 {out}, pos, neg;
"""


_TABLE_ASM = tl.constexpr("""
{
.reg .pred kept;
.reg .b32 pl, ph, nl, nh, sel, flip, pos, neg;
""" + group_tables_ptx("$6") + "xor.b32 flip, $2, 0x88888888;\n" + table_lookup_ptx("$0", "$2") + """shr.u32 sel, $2, 16;
shr.u32 flip, flip, 16;
""" + table_lookup_ptx("$1", "sel") + """}
""")


@triton.jit
def _table_columns(D: tl.constexpr):
    """Element of a key each column of ``_mxfp4_key_tile_table`` holds [D]."""
    G: tl.constexpr = D // 32
    col = tl.arange(0, D)
    j = col % 4
    g = (col // 4) % G
    s = (col // (4 * G)) % 2
    w = col // (8 * G)
    return 32 * g + 8 * w + 4 * s + j


@triton.jit
def _mxfp4_key_tile_table(packed_rows, scale, ok, D: tl.constexpr, ASM: tl.constexpr):
    """MXFP4 keys -> (e4m3 [BLOCK_N, D] in the column order of ``_table_columns``, fp32 [BLOCK_N]).

    The values of ``_mxfp4_key_tile``, columns permuted: word w (8 codes) of group g gives two
    4-byte registers, its low and high half s, stored as columns ``((2 w + s) G + g) 4 + j``.
    At D = 128 these are exactly the registers a thread holds in the wgmma operand layout
    (4 consecutive columns a register, columns 4-15 of each 16 on the other lanes of its quad),
    so each thread reads one whole 16-byte group of a token and decodes it in place, no byte
    shuffles; the queries are loaded in the same column order. Nothing computed from
    ``tl.arange`` may enter the chain after the loads (Triton then stops propagating the
    operand layout back to them and goes through shared memory), hence the broadcasts.
    """
    G: tl.constexpr = D // 32
    g = tl.arange(0, G)
    w = tl.arange(0, 4)[None, :, None, None]
    word_rows = packed_rows.to(tl.pointer_type(tl.int32))[:, None, None, None]
    words = tl.load(word_rows + (4 * g[None, None, :, None] + w), mask=ok[:, None, None, None], other=0)
    words = tl.broadcast_to(words, [words.shape[0], 4, G, 4])  # [BLOCK_N, word, group, byte]
    scale = scale.to(tl.int32)
    top = tl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _TABLE_ASM, "=r,=r" + ",r" * 8, [words, t[:, None, :, None]],
            dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        j = tl.arange(0, 4)[None, None, None, :]
        offset = tl.where(t >= 0, 8 * t, DROPPED_GROUP)[:, None, :, None]
        lo = _nibble_to_e4m3((words >> (4 * j)) & 15, offset).to(tl.uint8)
        hi = _nibble_to_e4m3((words >> (4 * j + 16)) & 15, offset).to(tl.uint8)
    keys = tl.permute(tl.join(lo, hi), (0, 1, 4, 2, 3))  # [BLOCK_N, word, half, group, byte]
    keys = tl.reshape(keys, [keys.shape[0], D]).to(tl.float8e4nv, bitcast=True)
    return keys, _mxfp4_token_factor(top)


@triton.jit
def _key_columns(D: tl.constexpr, MXFP4: tl.constexpr, TABLE: tl.constexpr):
    """Key element each column of ``_key_tile`` holds [D]; the queries are loaded in this order."""
    if MXFP4 and TABLE:
        d = _table_columns(D)
    else:
        d = tl.arange(0, D)
    return d


@triton.jit
def _load_scales(scale_rows, ok, D: tl.constexpr, MXFP4: tl.constexpr):
    """A tile's scales at scale_rows [BLOCK_N]: fp32 [BLOCK_N] (FP8) or UE8M0 bytes [BLOCK_N, D/32]."""
    if MXFP4:
        g = tl.arange(0, D // 32)
        scales = tl.load(scale_rows[:, None] + g[None, :], mask=ok[:, None], other=0)
    else:
        scales = tl.load(scale_rows, mask=ok, other=0.0)
    return scales


@triton.jit
def _key_tile(value_rows, scales, ok, D: tl.constexpr, MXFP4: tl.constexpr, ASM: tl.constexpr,
              TABLE: tl.constexpr):
    """Keys of one tile and its loaded scales (``_load_scales``) as (e4m3 [BLOCK_N, D] in
    ``_key_columns`` order, per-token fp32 factor [BLOCK_N]); rows not ok read 0."""
    if MXFP4 and TABLE:
        keys, factor = _mxfp4_key_tile_table(value_rows, scales, ok, D, ASM)
    elif MXFP4:
        keys, factor = _mxfp4_key_tile_bytes(value_rows, scales, ok, D)
    else:
        d = tl.arange(0, D)
        keys = tl.load(value_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        factor = scales
    return keys, factor


@triton.jit
def _load_queries(q_ptr, m, m_ok, d, D: tl.constexpr):
    """Rows m [M] of a [*, D] e4m3 query matrix; rows outside m_ok read as 0."""
    return tl.load(q_ptr + m[:, None].to(tl.int64) * D + d[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_cols, scores):
    """scores [BLOCK_N, ROWS] -> out[rows, cols]."""
    ptrs = out_ptr + rows[None, :].to(tl.int64) * out_stride + cols[:, None]
    tl.store(ptrs, scores, mask=row_ok[None, :] & (cols[:, None] < num_cols))


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
def _tile_page(bt_row, block, live, max_blocks, num_pages):
    """(page id as int64, readable): block table entry ``block`` (a scalar); entries past the
    table, negative or past the pool are unreadable and give page 0."""
    page = tl.load(bt_row + block, mask=live & (block < max_blocks), other=-1)
    ok = (page >= 0) & (page < num_pages)
    return tl.where(ok, page, 0).to(tl.int64), ok


@triton.jit
def _paged_decode_kernel(
    q_ptr,            # [B * NEXT_N * H, D] e4m3
    w_ptr,            # [B * NEXT_N, H] fp32
    lens_ptr,         # [B, NEXT_N] int32 (PER_ROW) or [B] int32; clamped here to [0, max_model_len]
    values_ptr,       # FP8: [P, 64, D] e4m3; MXFP4: [P, 64, D/2] uint8   (page stride page_stride)
    scales_ptr,       # FP8: [P, 64] fp32;    MXFP4: [P, 64, D/32] uint8  (page stride scale_stride)
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [B * NEXT_N, max_model_len] fp32
    num_pages, max_blocks, bt_stride, page_stride, scale_stride, max_model_len, out_stride,
    NEXT_N: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PER_ROW: tl.constexpr,
    MXFP4: tl.constexpr, ASM: tl.constexpr, TABLE: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    SPLIT: tl.constexpr,
):
    PAGE: tl.constexpr = 64
    VALUE_BYTES: tl.constexpr = D // 2 if MXFP4 else D
    SCALES_PER_TOKEN: tl.constexpr = D // 32 if MXFP4 else 1
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

    d = _key_columns(D, MXFP4, TABLE)
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
        q = _load_queries(q_ptr + b * NEXT_N * H * D, m, m_ok, d, D)

    num_scored = loop_bound(tl.minimum(tl.maximum(tl.cdiv(longest - col0, BLOCK_N), 0), TILES))
    # A tile is one page. Its scales are loaded a tile ahead and their page id two ahead, so no
    # load in the loop waits for another (the key values are prefetched by Triton's pipeliner):
    # otherwise the scale load follows the block-table load and both latencies stall every tile
    # (H200, B=64, 128K, H=64: 320 -> 291 us).
    tok = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b * bt_stride
    blk0 = col0 // PAGE
    page, ok = _tile_page(bt_row, blk0, num_scored > 0, max_blocks, num_pages)
    scales_next = _load_scales(scales_ptr + page * scale_stride + tok * SCALES_PER_TOKEN,
                               ok & (col0 + tok < longest), D, MXFP4)
    page_ahead = tl.load(bt_row + blk0 + 1, mask=(num_scored > 1) & (blk0 + 1 < max_blocks), other=-1)
    for t in range(num_scored):
        cols = col0 + t * BLOCK_N + tok
        scales = scales_next
        ok_ahead = (page_ahead >= 0) & (page_ahead < num_pages)
        scales_next = _load_scales(
            scales_ptr + tl.where(ok_ahead, page_ahead, 0).to(tl.int64) * scale_stride + tok * SCALES_PER_TOKEN,
            ok_ahead & (cols + BLOCK_N < longest), D, MXFP4)
        page_ahead = tl.load(bt_row + blk0 + t + 2, mask=(t + 2 < num_scored) & (blk0 + t + 2 < max_blocks), other=-1)
        page, ok = _tile_page(bt_row, blk0 + t, True, max_blocks, num_pages)
        live = ok & (cols < longest)
        keys, factor = _key_tile(values_ptr + page * page_stride + tok * VALUE_BYTES, scales, live, D, MXFP4, ASM, TABLE)
        if SPLIT:
            out_row = out_ptr + (b * NEXT_N).to(tl.int64) * out_stride
            _score_row(keys, q0, w0, factor, live, cols, len0, out_row, max_model_len)
            _score_row(keys, q1, w1, factor, live, cols, len1, out_row + out_stride, max_model_len)
            if NEXT_N > 2:
                _score_row(keys, q2, w2, factor, live, cols, len2, out_row + 2 * out_stride, max_model_len)
            if NEXT_N > 3:
                _score_row(keys, q3, w3, factor, live, cols, len3, out_row + 3 * out_stride, max_model_len)
        else:
            scores = _head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
            visible = live[:, None] & (cols[:, None] < lens[None, :])
            scores = tl.where(visible, scores, float("-inf"))
            _store_tile(out_ptr, out_stride, rows, row_ok, cols, max_model_len, scores)

    blank = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
    for t in range(num_scored, TILES):
        cols = col0 + t * BLOCK_N + tok
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, max_model_len, blank)


@triton.jit
def _ragged_prefill_kernel(
    q_ptr,            # [M * H, D] e4m3
    w_ptr,            # [M, H] fp32
    ks_ptr, ke_ptr,   # [M] int32, already clamped to [0, N]
    values_ptr,       # FP8: [N, D] e4m3; MXFP4: [N, D/2] uint8
    scales_ptr,       # FP8: [N] fp32;    MXFP4: [N, D/32] uint8
    out_ptr,          # [M, N] fp32
    num_rows, num_keys, out_stride,
    ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    MXFP4: tl.constexpr, ASM: tl.constexpr, TABLE: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    VALUE_BYTES: tl.constexpr = D // 2 if MXFP4 else D
    SCALES_PER_TOKEN: tl.constexpr = D // 32 if MXFP4 else 1
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
    q = _load_queries(q_ptr + row0.to(tl.int64) * H * D, m, m_ok, _key_columns(D, MXFP4, TABLE), D)

    # Tiles [lo, hi) of this program meet some row's window; the others are all -inf.
    lo = tl.minimum(tl.maximum((first - col0) // BLOCK_N, 0), TILES)
    hi = loop_bound(tl.minimum(tl.maximum(tl.cdiv(last - col0, BLOCK_N), lo), TILES))
    lo = loop_bound(lo)
    blank = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
    for t in range(0, lo):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, blank)
    for t in range(lo, hi):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < num_keys
        key = cols.to(tl.int64)
        scales = _load_scales(scales_ptr + key * SCALES_PER_TOKEN, ok, D, MXFP4)
        keys, factor = _key_tile(values_ptr + key * VALUE_BYTES, scales, ok, D, MXFP4, ASM, TABLE)
        scores = _head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        scores = tl.where(inside, scores, float("-inf"))
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, scores)
    for t in range(hi, TILES):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, blank)


def _table_decode(values: torch.Tensor) -> bool:
    """Whether MXFP4 keys take the table decode, which reads 32-bit words: key rows 4-byte
    aligned (cache pages always are); otherwise the byte-wise decode runs."""
    return values.data_ptr() % 4 == 0 and values.stride(0) % 4 == 0


def _split_rows(cfg: dict, next_n: int, num_heads: int) -> bool:
    """Whether the decode kernel runs one product per query row (``cfg["split_rows"]``: next_n ->
    the fewest heads for it). The kernel handles 2-4 rows that way."""
    least = (cfg.get("split_rows") or {}).get(next_n)
    return least is not None and 2 <= next_n <= 4 and num_heads >= least


def _gluon_decode(cfg: dict, q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether an MXFP4 launch runs the Gluon kernel (``gluon_kernels``): ``cfg["kernel"]`` says
    so, a Hopper GPU, D = 128, 16-128 heads, at most 256 product columns (next_n rounded up to a
    power of two, times H), and the pool's page layout: each page's scales right after its values
    (as ``mxfp4_page_views`` cuts them), pages 16-byte aligned, at least one page."""
    if cfg.get("kernel", "triton") != "gluon" or not PTX_AVAILABLE or not q.is_cuda:
        return False
    batch, next_n, num_heads, head_dim = q.shape
    packed_pages = (scales.data_ptr() == values.data_ptr() + values.shape[1] * values.shape[2]
                    and scales.stride(0) == values.stride(0) and scales.stride(1) == scales.shape[2]
                    and values.data_ptr() % 16 == 0 and values.stride(0) % 16 == 0 and values.shape[0] > 0)
    return (torch.cuda.get_device_capability(q.device)[0] == 9 and head_dim == 128
            and num_heads in (16, 32, 64, 128) and triton.next_power_of_2(next_n) * num_heads <= 256
            and packed_pages and _table_decode(values))


def _gluon_fp8_decode(cfg: dict, q: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether an FP8 launch runs the Gluon kernel (``gluon_kernels.paged_decode_fp8_kernel``):
    ``cfg["fp8_kernel"]`` says so for this next_n, a Hopper GPU, D = 128, 16-128 heads, at most 256
    product columns (next_n rounded up to a power of two, times H), 16-byte aligned key pages."""
    if next_n_kernel(cfg.get("fp8_kernel"), q.shape[1]) != "gluon" or not PTX_AVAILABLE or not q.is_cuda:
        return False
    batch, next_n, num_heads, head_dim = q.shape
    return (torch.cuda.get_device_capability(q.device)[0] == 9 and head_dim == 128
            and num_heads in (16, 32, 64, 128) and triton.next_power_of_2(next_n) * num_heads <= 256
            and values.data_ptr() % 16 == 0 and values.stride(0) % 16 == 0)


def _launch_gluon_fp8_decode(cfg, q, weights, context_lens, values, scales, block_table, out) -> None:
    """``gluon_kernels.paged_decode_fp8_kernel``: key pages by TMA (a descriptor over the pool's
    pages), ``fp8_gluon_tiles`` pages a program, a ring of ``fp8_stages`` pages."""
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsacache.ops.indexer_logits.gluon_kernels import paged_decode_fp8_kernel

    batch, next_n, num_heads, head_dim = q.shape
    max_model_len, tiles = out.shape[1], cfg["fp8_gluon_tiles"]
    k_desc = TensorDescriptor(values, list(values.shape), list(values.stride()), [1, KERNEL_PAGE_SIZE, head_dim],
                              NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
    paged_decode_fp8_kernel[(triton.cdiv(max_model_len, KERNEL_PAGE_SIZE * tiles), batch)](
        q, weights, context_lens, k_desc, scales, block_table, out,
        values.shape[0], block_table.shape[1], block_table.stride(0), scales.stride(0), max_model_len, out.stride(0),
        NEXT_N=next_n, ROWS=triton.next_power_of_2(next_n), H=num_heads, PER_ROW=context_lens.dim() == 2,
        TILES=tiles, STAGES=cfg["fp8_stages"], num_warps=4,
    )


def next_n_kernel(choice, next_n: int) -> str:
    """The kernel a config entry picks for next_n: a name, or a dict next_n -> name ("triton" if absent)."""
    if isinstance(choice, dict):
        return choice.get(next_n, "triton")
    return choice or "triton"


def decode_kernel(q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mxfp4: bool,
                  config: dict | None = None) -> str:
    """Which kernel ``launch_paged_decode`` runs for these inputs: "gluon" or "triton" (for reports)."""
    cfg = {**DECODE_CONFIG, **(MXFP4_DECODE_CONFIG if mxfp4 else {}), **(config or {})}
    if mxfp4:
        return "gluon" if _gluon_decode(cfg, q, values, scales) else "triton"
    return "gluon" if _gluon_fp8_decode(cfg, q, values) else "triton"


def launch_paged_decode(
    q: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    mxfp4: bool,
    config: dict | None = None,
) -> None:
    """Fill ``out [B*next_n, max_model_len]``; ``values``/``scales`` are the page views of the format,
    ``context_lens`` is per row ``[B, next_n]`` or per request ``[B]`` (unclamped)."""
    cfg = {**DECODE_CONFIG, **(MXFP4_DECODE_CONFIG if mxfp4 else {}), **(config or {})}
    batch, next_n, num_heads, head_dim = q.shape
    check_launch(q.is_contiguous() and weights.is_contiguous() and context_lens.is_contiguous(),
                 "q, weights and context_lens contiguous")
    check_launch(context_lens.dtype == torch.int32 and context_lens.dim() in (1, 2), "context_lens int32 [B] or [B, next_n]")
    check_launch(values.stride()[1:] == (values.shape[2], 1) and block_table.stride(1) == 1,
                 "contiguous page rows and block_table rows")
    check_launch(out.is_contiguous() and cfg["BLOCK_N"] == KERNEL_PAGE_SIZE,
                 "contiguous out and BLOCK_N equal to the kernel page (a tile is one page)")
    max_model_len = out.shape[1]
    grid = (triton.cdiv(max_model_len, cfg["BLOCK_N"] * cfg["TILES"]), batch)
    if mxfp4 and _gluon_decode(cfg, q, values, scales):
        from dsacache.ops.indexer_logits.gluon_kernels import paged_decode_mxfp4_kernel

        paged_decode_mxfp4_kernel[grid](
            q, weights, context_lens, values, block_table, out,
            values.shape[0], block_table.shape[1], block_table.stride(0), values.stride(0), max_model_len,
            out.stride(0), NEXT_N=next_n, ROWS=triton.next_power_of_2(next_n), H=num_heads,
            PER_ROW=context_lens.dim() == 2, TILES=cfg["TILES"], num_warps=4,
        )
        return
    rows = triton.next_power_of_2(next_n)
    if not mxfp4 and _gluon_fp8_decode(cfg, q, values):
        _launch_gluon_fp8_decode(cfg, q, weights, context_lens, values, scales, block_table, out)
        return
    cap = cfg.get("maxnreg") if rows == 1 else cfg.get("maxnreg_rows")
    capped = cap and PTX_AVAILABLE and rows * num_heads <= cfg.get("maxnreg_cols", 0)
    extra = {"maxnreg": cap} if capped else {}
    _paged_decode_kernel[grid](
        q, weights, context_lens, values, scales, block_table, out,
        values.shape[0], block_table.shape[1], block_table.stride(0),
        values.stride(0), scales.stride(0), max_model_len, out.stride(0),
        NEXT_N=next_n, ROWS=rows, H=num_heads, D=head_dim,
        PER_ROW=context_lens.dim() == 2, MXFP4=mxfp4, ASM=PTX_AVAILABLE,
        TABLE=mxfp4 and _table_decode(values), BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"],
        SPLIT=_split_rows(cfg, next_n, num_heads),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )


def launch_ragged_prefill(
    q: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    k_values: torch.Tensor,
    k_scales: torch.Tensor,
    out: torch.Tensor,
    mxfp4: bool,
    config: dict | None = None,
) -> None:
    """Fill ``out [M, N]`` from contiguous keys."""
    cfg = {**PREFILL_CONFIG, **(config or {})}
    num_rows, num_heads, head_dim = q.shape
    check_launch(q.is_contiguous() and weights.is_contiguous() and out.is_contiguous(), "q, weights and out contiguous")
    check_launch(k_values.is_contiguous() and k_scales.is_contiguous(), "k_values and k_scales contiguous")
    num_keys = out.shape[1]
    grid = (triton.cdiv(num_keys, cfg["BLOCK_N"] * cfg["TILES"]), triton.cdiv(num_rows, cfg["ROWS"]))
    _ragged_prefill_kernel[grid](
        q, weights, ks, ke, k_values, k_scales, out, num_rows, num_keys, out.stride(0),
        ROWS=cfg["ROWS"], H=num_heads, D=head_dim, MXFP4=mxfp4, ASM=PTX_AVAILABLE,
        TABLE=mxfp4 and _table_decode(k_values), BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
