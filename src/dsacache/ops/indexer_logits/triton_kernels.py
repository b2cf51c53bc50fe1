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
same FP8 tensor as for FP8 keys.

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

#: Launch settings for the paged decode kernel (BLOCK_N keys a tile, TILES tiles a program).
DECODE_CONFIG = {"BLOCK_N": 64, "TILES": 16, "num_warps": 4, "num_stages": 2, "mxfp4_asm": PTX_AVAILABLE}
#: Launch settings for the ragged prefill kernel (ROWS query rows a program).
PREFILL_CONFIG = {"BLOCK_N": 64, "TILES": 8, "ROWS": 4, "num_warps": 4, "num_stages": 3,
                  "mxfp4_asm": PTX_AVAILABLE}


@triton.jit
def _head_sum(acc, w, ROWS: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, ROWS*H] fp32, w [ROWS*H] -> sum_h w * relu(acc) as [BLOCK_N, ROWS]."""
    acc = tl.maximum(acc, 0.0) * w[None, :]
    return tl.sum(tl.reshape(acc, [BLOCK_N, ROWS, H]), axis=2)


#: Group offset byte marking a dropped group (``t < 0``); otherwise the byte is ``8 * t``.
DROPPED_GROUP = tl.constexpr(0x80)

# $0/$1: e4m3 bytes of the low/high nibbles of the four packed bytes in $2; $3 holds each
# byte's group offset (8 t, or 0x80 = dropped). The table words hold the e4m3 codes of the
# e2m1 magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 times 2**-5 (0x00 08 10 14 | 18 1C 20 24, all
# normal but 0); prmt looks up four at once; adding 8 t to a nonzero code multiplies it by
# 2**t and never carries into the next byte (codes stay <= 0x7C).
_PRMT_ASM = tl.constexpr("""
{
.reg .b32 tlo, thi, keep, x, nz, sel, mag;
mov.b32 tlo, 0x14100800;
mov.b32 thi, 0x24201C18;
and.b32 keep, $3, 0x80808080;
shr.u32 keep, keep, 7;
mul.lo.u32 keep, keep, 0xFF;
not.b32 keep, keep;
and.b32 x, $2, 0x07070707;
add.u32 nz, x, 0x7F7F7F7F;
and.b32 nz, nz, 0x80808080;
shr.u32 nz, nz, 7;
mul.lo.u32 nz, nz, 0xFF;
and.b32 nz, nz, $3;
shr.u32 sel, x, 4;
or.b32 sel, sel, x;
prmt.b32 sel, sel, sel, 0x0020;
prmt.b32 mag, tlo, thi, sel;
add.u32 mag, mag, nz;
shl.b32 x, $2, 4;
and.b32 x, x, 0x80808080;
or.b32 mag, mag, x;
and.b32 $0, mag, keep;
shr.u32 x, $2, 4;
and.b32 x, x, 0x07070707;
add.u32 nz, x, 0x7F7F7F7F;
and.b32 nz, nz, 0x80808080;
shr.u32 nz, nz, 7;
mul.lo.u32 nz, nz, 0xFF;
and.b32 nz, nz, $3;
shr.u32 sel, x, 4;
or.b32 sel, sel, x;
prmt.b32 sel, sel, sel, 0x0020;
prmt.b32 mag, tlo, thi, sel;
add.u32 mag, mag, nz;
and.b32 x, $2, 0x80808080;
or.b32 mag, mag, x;
and.b32 $1, mag, keep;
}
""")


@triton.jit
def _nibble_to_e4m3(code, offset):
    """One e2m1 code (int32 0..15) and its group offset byte -> e4m3 byte (int32), plain ops."""
    mag = code & 7
    base = tl.where(mag == 1, 8, 4 * mag + 8)
    byte = tl.where(mag == 0, 0, base + offset) | ((code & 8) << 4)
    return tl.where(offset >= DROPPED_GROUP, 0, byte)


@triton.jit
def _mxfp4_key_tile(packed_rows, scale_rows, ok, D: tl.constexpr, ASM: tl.constexpr):
    """MXFP4 keys at byte pointers packed_rows/scale_rows [BLOCK_N] -> (e4m3 [BLOCK_N, D], fp32 [BLOCK_N])."""
    G: tl.constexpr = D // 32
    g = tl.arange(0, G)
    byte = tl.arange(0, 16)
    packed = tl.load(packed_rows[:, None, None] + (16 * g[None, :, None] + byte[None, None, :]),
                     mask=ok[:, None, None], other=0)
    scale = tl.load(scale_rows[:, None] + g[None, :], mask=ok[:, None], other=0).to(tl.int32)
    top = tl.max(scale, axis=1)
    t = scale - top[:, None] + 11
    offset = tl.where(t >= 0, 8 * t, DROPPED_GROUP)
    offset = tl.broadcast_to(offset[:, :, None], packed.shape)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _PRMT_ASM, "=r,=r,r,r", [packed, offset.to(tl.uint8)],
            dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        codes = packed.to(tl.int32)
        lo = _nibble_to_e4m3(codes & 15, offset).to(tl.uint8)
        hi = _nibble_to_e4m3(codes >> 4, offset).to(tl.uint8)
    keys = tl.reshape(tl.join(lo, hi), [packed.shape[0], D]).to(tl.float8e4nv, bitcast=True)
    # 2**(top - 133): 2**(top - 127) built from its bits (top 0 -> 2**-127), then 2**-6.
    unit = (tl.maximum(top, 1) << 23).to(tl.float32, bitcast=True) * tl.where(top == 0, 0.5, 1.0)
    return keys, unit * 0.015625


@triton.jit
def _key_tile(value_rows, scale_rows, ok, D: tl.constexpr, MXFP4: tl.constexpr, ASM: tl.constexpr):
    """Keys of one tile as (e4m3 [BLOCK_N, D], per-token fp32 factor [BLOCK_N]); rows not ok read 0."""
    if MXFP4:
        keys, factor = _mxfp4_key_tile(value_rows, scale_rows, ok, D, ASM)
    else:
        d = tl.arange(0, D)
        keys = tl.load(value_rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        factor = tl.load(scale_rows, mask=ok, other=0.0)
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
    MXFP4: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
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

    m = tl.arange(0, ROWS * H)
    m_ok = (m // H) < NEXT_N
    w = tl.load(w_ptr + b * NEXT_N * H + m, mask=m_ok, other=0.0)
    q = _load_queries(q_ptr + b * NEXT_N * H * D, m, m_ok, tl.arange(0, D), D)

    num_scored = loop_bound(tl.minimum(tl.maximum(tl.cdiv(longest - col0, BLOCK_N), 0), TILES))
    for t in range(num_scored):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        block = cols // PAGE
        page = tl.load(bt_ptr + b * bt_stride + block, mask=(block < max_blocks) & (cols < longest), other=-1)
        ok = (page >= 0) & (page < num_pages)
        page = tl.where(ok, page, 0).to(tl.int64)
        token = cols % PAGE
        keys, factor = _key_tile(values_ptr + page * page_stride + token * VALUE_BYTES,
                                 scales_ptr + page * scale_stride + token * SCALES_PER_TOKEN,
                                 ok, D, MXFP4, ASM)
        scores = _head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
        visible = ok[:, None] & (cols[:, None] < lens[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, max_model_len, scores)

    blank = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
    for t in range(num_scored, TILES):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
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
    MXFP4: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
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
    q = _load_queries(q_ptr + row0.to(tl.int64) * H * D, m, m_ok, tl.arange(0, D), D)

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
        keys, factor = _key_tile(values_ptr + key * VALUE_BYTES, scales_ptr + key * SCALES_PER_TOKEN,
                                 ok, D, MXFP4, ASM)
        scores = _head_sum(tl.dot(keys, tl.trans(q)), w, ROWS, H, BLOCK_N) * factor[:, None]
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        scores = tl.where(inside, scores, float("-inf"))
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, scores)
    for t in range(hi, TILES):
        cols = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_tile(out_ptr, out_stride, rows, row_ok, cols, num_keys, blank)


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
    cfg = {**DECODE_CONFIG, **(config or {})}
    batch, next_n, num_heads, head_dim = q.shape
    check_launch(q.is_contiguous() and weights.is_contiguous() and context_lens.is_contiguous(),
                 "q, weights and context_lens contiguous")
    check_launch(context_lens.dtype == torch.int32 and context_lens.dim() in (1, 2), "context_lens int32 [B] or [B, next_n]")
    check_launch(values.stride()[1:] == (values.shape[2], 1) and block_table.stride(1) == 1,
                 "contiguous page rows and block_table rows")
    check_launch(out.is_contiguous() and cfg["BLOCK_N"] % KERNEL_PAGE_SIZE == 0,
                 "contiguous out and BLOCK_N a multiple of the kernel page")
    max_model_len = out.shape[1]
    grid = (triton.cdiv(max_model_len, cfg["BLOCK_N"] * cfg["TILES"]), batch)
    _paged_decode_kernel[grid](
        q, weights, context_lens, values, scales, block_table, out,
        values.shape[0], block_table.shape[1], block_table.stride(0),
        values.stride(0), scales.stride(0), max_model_len, out.stride(0),
        NEXT_N=next_n, ROWS=triton.next_power_of_2(next_n), H=num_heads, D=head_dim,
        PER_ROW=context_lens.dim() == 2, MXFP4=mxfp4, ASM=cfg["mxfp4_asm"],
        BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
        ROWS=cfg["ROWS"], H=num_heads, D=head_dim, MXFP4=mxfp4, ASM=cfg["mxfp4_asm"],
        BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
