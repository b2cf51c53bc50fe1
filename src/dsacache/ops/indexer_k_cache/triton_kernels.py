"""Triton kernels for the indexer key cache: quantize + store, gather, dequantize.

Each kernel has a launcher (``launch_*``) that checks strides and dtypes and sets the
grid; input validation and docstrings live in the public functions (``api.py``).
Scales are chosen by the same integer arithmetic on fp32 bits as the reference codecs
in :mod:`dsacache.formats.indexer_key`, so scales and MXFP4 codes are bit-identical.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsacache.formats.sizes import KERNEL_PAGE_SIZE, MXFP4_GROUP_SIZE

FORMAT_IDS = {"fp8": 0, "mxfp4": 1}

# About 2K elements a program: enough bytes in flight per SM, few registers a thread.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _pow2(exp):
    """``2.0 ** exp`` for integer ``-126 <= exp <= 127``, built from its fp32 bits."""
    return ((exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs(x):
    """``|x|`` with NaN and inf replaced by 0: one bad element never sets a block's scale."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _ceil_pow2_exponent(amax, MANTISSA_LIMIT: tl.constexpr, SHIFT: tl.constexpr):
    """Smallest ``e`` with ``amax <= (1 + MANTISSA_LIMIT / 2**23) * 2**SHIFT * 2**e`` (exact)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return biased - 127 - SHIFT + (frac > MANTISSA_LIMIT).to(tl.int32)


@triton.jit
def _layer_norm(x, mask_d, w_ptr, b_ptr, offs_d, eps, D: tl.constexpr):
    # x: [BLOCK_T, BLOCK_D] fp32, zero where ~mask_d -> [BLOCK_T, BLOCK_D] fp32
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    centered = tl.where(mask_d[None, :], x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / D
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    return centered * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def _e4m3_encode_int(y):
    """fp32 ``y`` in [-448, 448] or NaN -> e4m3 byte (int32), round half to even.

    Integer twin of the hardware cast, for the Triton interpreter, whose fp8 cast drops
    the carry when rounding up into the next binade (125.1 -> 64 instead of 128).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    # Normal e4m3 (|y| >= 2**-6): keep 3 mantissa bits, rebias the exponent from 127 to 7.
    normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal e4m3: multiples of 2**-9; adding 2**23 rounds to an integer, half to even.
    tiny = tl.where(mag_bits < 0x3C800000, tl.abs(y), 0.0)
    sub = ((tiny * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag_bits < 0x3C800000, sub, normal)
    return tl.where(y != y, 0x7F, code) | sign


@triton.jit
def _store_fp8(x, page_ptr, row, valid, offs_d, mask_d, D: tl.constexpr, PAGE: tl.constexpr,
               INT_CAST: tl.constexpr):
    # x: [BLOCK_T, BLOCK_D] fp32; page_ptr, row, valid: [BLOCK_T]
    amax = tl.maximum(tl.max(_finite_abs(x), axis=1), 1e-4)
    # 448 = 1.75 * 2**8: mantissa limit 0x600000, shift 8.
    exp = _ceil_pow2_exponent(amax, 0x600000, 8)
    y = x * _pow2(-exp)[:, None]
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
    if INT_CAST:
        codes = _e4m3_encode_int(y).to(tl.uint8)
    else:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    value_ptr = page_ptr[:, None] + row[:, None] * D + offs_d[None, :]
    tl.store(value_ptr, codes, mask=valid[:, None] & mask_d[None, :])
    scale_ptr = (page_ptr + PAGE * D + row * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, _pow2(exp), mask=valid)


@triton.jit
def _e2m1_encode(y):
    """fp32 ``y`` (already divided by its scale, so ``|y| <= 6`` or inf/NaN) -> e2m1 codes (int32 0..15).

    Round half to even by integer arithmetic on the fp32 bits: the kernel is ALU-bound, and
    this costs about half of comparing against the seven thresholds (no float-to-int
    conversion, which runs at a quarter rate). inf saturates to 6, NaN -> +0.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 28) & 8
    mag_bits = bits & 0x7FFFFFFF
    # |y| >= 1: keep one mantissa bit (round half to even), rebias the exponent from 127 to 1.
    normal = tl.minimum((mag_bits + (0x1FFFFF - (252 << 22)) + ((mag_bits >> 22) & 1)) >> 22, 7)
    # |y| < 1: multiples of 0.5 (codes 0, 1, 2). Adding 2**23 rounds 2|y| to an integer, half
    # to even, and leaves that integer in the low mantissa bits.
    small = mag_bits < 0x3F800000
    twice = tl.where(small, mag_bits, 0).to(tl.float32, bitcast=True) * 2.0
    halves = (twice + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(small, halves, normal) | sign
    return tl.where(mag_bits > 0x7F800000, 0, code)


@triton.jit
def _store_mxfp4(x, page_ptr, row, valid, D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # x: [BLOCK_T, BLOCK_D] fp32; page_ptr, row, valid: [BLOCK_T]
    GROUPS: tl.constexpr = BLOCK_D // 32
    groups = tl.reshape(x, (BLOCK_T, GROUPS, 32))
    amax = tl.max(_finite_abs(groups), axis=2)
    # 6 = 1.5 * 2**2: mantissa limit 0x400000, shift 2; an all-zero group gets the smallest scale.
    exp = _ceil_pow2_exponent(amax, 0x400000, 2)
    exp = tl.where(amax > 0, exp, -127)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    codes = _e2m1_encode(groups * _pow2(-exp)[:, :, None])
    low, high = tl.split(tl.reshape(codes, (BLOCK_T, BLOCK_D // 2, 2)))
    packed = (low | (high << 4)).to(tl.uint8)
    offs_b = tl.arange(0, BLOCK_D // 2)
    value_ptr = page_ptr[:, None] + row[:, None] * (D // 2) + offs_b[None, :]
    tl.store(value_ptr, packed, mask=valid[:, None] & (offs_b < D // 2)[None, :])
    offs_g = tl.arange(0, GROUPS)
    scale_ptr = page_ptr[:, None] + PAGE * (D // 2) + row[:, None] * (D // 32) + offs_g[None, :]
    tl.store(scale_ptr, (exp + 127).to(tl.uint8), mask=valid[:, None] & (offs_g < D // 32)[None, :])


@triton.jit
def _store_kernel(
    k_ptr,          # [num_tokens, D] bf16/fp16/fp32, strides (stride_kt, stride_kd)
    w_ptr, b_ptr,   # [D] LayerNorm weight and bias (read only when NORM)
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    pages_ptr,      # uint8 base of the layer's pages [num_pages, PAGE, entry], page stride page_stride
    num_tokens, num_slots, stride_kt, stride_kd, page_stride, eps,
    D: tl.constexpr, PAGE: tl.constexpr, FORMAT: tl.constexpr, NORM: tl.constexpr,
    INT_CAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_t = offs_t < num_tokens
    # The key load does not wait for the slot load: both are in flight at once.
    k_rows = k_ptr + offs_t.to(tl.int64)[:, None] * stride_kt + offs_d[None, :] * stride_kd
    x = tl.load(k_rows, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    if NORM:
        x = _layer_norm(x, mask_d, w_ptr, b_ptr, offs_d, eps, D)
    page_ptr = pages_ptr + (slot // PAGE) * page_stride
    row = slot % PAGE
    if FORMAT == 0:
        _store_fp8(x, page_ptr, row, valid, offs_d, mask_d, D, PAGE, INT_CAST)
    else:
        _store_mxfp4(x, page_ptr, row, valid, D, PAGE, BLOCK_T, BLOCK_D)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tokens_per_program(num_tokens: int, block: int) -> int:
    return max(1, min(triton.next_power_of_2(num_tokens), _ELEMENTS_PER_PROGRAM // block, 64))


def launch_store(k: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor, fmt: str,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 eps: float = 0.0, tokens_per_program: int | None = None, num_warps: int = 2) -> None:
    """Quantize ``k [T, D]`` (LayerNorm first when ``weight`` is given) into ``pages`` at ``slot_mapping``.

    ``tokens_per_program`` and ``num_warps`` override the launch shape (the benchmark sweeps
    them; 16 tokens and 2 warps were fastest at 1M tokens on the H200).
    """
    num_tokens, head_dim = k.shape
    if num_tokens == 0:
        return
    if pages.stride(1) * KERNEL_PAGE_SIZE > pages.stride(0) and pages.shape[0] > 1:
        raise ValueError("pages overlap: stride(0) is smaller than one page")
    if pages.stride(2) != 1:
        raise ValueError("each page entry must be contiguous (pages.stride(2) == 1)")
    if fmt == "fp8" and (pages.data_ptr() % 4 or pages.stride(0) % 4):
        raise ValueError("FP8 pages must be 4-byte aligned: their scales are stored as fp32 words")
    norm = weight is not None
    block_d = max(triton.next_power_of_2(head_dim), MXFP4_GROUP_SIZE)
    block_t = tokens_per_program or _tokens_per_program(num_tokens, block_d)
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kernel[grid](
        k, weight if norm else k, bias if norm else k, slot_mapping, pages,
        num_tokens, pages.shape[0] * KERNEL_PAGE_SIZE, k.stride(0), k.stride(1), pages.stride(0),
        float(eps), D=head_dim, PAGE=KERNEL_PAGE_SIZE, FORMAT=FORMAT_IDS[fmt], NORM=norm,
        INT_CAST=_interpreted(), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
    )


@triton.jit
def _gather_kernel(
    pages_ptr,        # uint8 [num_pages, PAGE, entry], page stride page_stride
    block_table_ptr,  # int32 [num_reqs, max_pages], row stride bt_stride
    cu_seqlens_ptr,   # int32 [num_reqs + 1]
    values_ptr,       # uint8 [num_tokens, VALUE_BYTES]
    scales_ptr,       # uint8 [num_tokens, SCALE_BYTES]
    num_tokens, num_reqs, num_pages, max_pages, bt_stride, page_stride,
    SEARCH_STEPS: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    # Request of each token: the last r with cu_seqlens[r] <= t (binary search; empty requests skipped).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens_ptr + mid, mask=mask_t, other=0) <= offs_t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    position = offs_t - tl.load(cu_seqlens_ptr + lo, mask=mask_t, other=0)
    page_index = position // PAGE
    in_table = mask_t & (page_index < max_pages)
    page = tl.load(block_table_ptr + lo.to(tl.int64) * bt_stride + page_index, mask=in_table, other=-1)
    valid = in_table & (page >= 0) & (page < num_pages)
    row = position % PAGE
    page_ptr = pages_ptr + page.to(tl.int64) * page_stride

    offs_v = tl.arange(0, BLOCK_V)
    mask_v = valid[:, None] & (offs_v < VALUE_BYTES)[None, :]
    v = tl.load(page_ptr[:, None] + row[:, None] * VALUE_BYTES + offs_v[None, :], mask=mask_v, other=0)
    out_t = offs_t.to(tl.int64)[:, None]
    tl.store(values_ptr + out_t * VALUE_BYTES + offs_v[None, :], v,
             mask=mask_t[:, None] & (offs_v < VALUE_BYTES)[None, :])

    offs_s = tl.arange(0, BLOCK_S)
    mask_s = valid[:, None] & (offs_s < SCALE_BYTES)[None, :]
    s = tl.load(page_ptr[:, None] + PAGE * VALUE_BYTES + row[:, None] * SCALE_BYTES + offs_s[None, :],
                mask=mask_s, other=0)
    tl.store(scales_ptr + out_t * SCALE_BYTES + offs_s[None, :], s,
             mask=mask_t[:, None] & (offs_s < SCALE_BYTES)[None, :])


def launch_gather(pages: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                  values: torch.Tensor, scales: torch.Tensor) -> None:
    """Copy each token's entry bytes into ``values [T, value_bytes]`` and ``scales [T, scale_bytes]`` (uint8)."""
    num_tokens, value_bytes = values.shape
    scale_bytes = scales.shape[1]
    if num_tokens == 0:
        return
    if not (values.is_contiguous() and scales.is_contiguous()) or values.dtype != torch.uint8:
        raise ValueError("gather outputs must be contiguous uint8 byte views")
    if pages.stride(1) != value_bytes + scale_bytes or pages.stride(2) != 1:
        raise ValueError("pages must have contiguous entries of value_bytes + scale_bytes")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    num_reqs = cu_seqlens.shape[0] - 1
    block_v = triton.next_power_of_2(value_bytes)
    block_t = _tokens_per_program(num_tokens, block_v)
    grid = (triton.cdiv(num_tokens, block_t),)
    _gather_kernel[grid](
        pages, block_table, cu_seqlens, values, scales,
        num_tokens, num_reqs, pages.shape[0], block_table.shape[1], block_table.stride(0), pages.stride(0),
        SEARCH_STEPS=max(1, num_reqs).bit_length(), VALUE_BYTES=value_bytes, SCALE_BYTES=scale_bytes,
        PAGE=KERNEL_PAGE_SIZE,
        BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_S=triton.next_power_of_2(scale_bytes), num_warps=4,
    )


@triton.jit
def _e2m1_decode(code):
    """e2m1 codes (int32 0..15) -> fp32 {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign."""
    c = (code & 7).to(tl.float32)
    mag = tl.where(c < 4.0, c * 0.5, tl.where(c < 6.0, c - 2.0, (c - 4.0) * 2.0))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _dequant_kernel(
    values_ptr,  # uint8 [T, D] (FP8 codes) or [T, D/2] (packed e2m1)
    scales_ptr,  # fp32 [T] (FP8) or uint8 [T, D/32] (UE8M0)
    out_ptr,     # fp32 [T, D]
    num_tokens,
    D: tl.constexpr, FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    rows = offs_t.to(tl.int64)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    if FORMAT == 0:
        codes = tl.load(values_ptr + rows * D + offs_d[None, :], mask=mask, other=0)
        scale = tl.load(scales_ptr + offs_t, mask=mask_t, other=0.0)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    else:
        offs_b = tl.arange(0, BLOCK_D // 2)
        mask_b = mask_t[:, None] & (offs_b < D // 2)[None, :]
        packed = tl.load(values_ptr + rows * (D // 2) + offs_b[None, :], mask=mask_b, other=0)
        packed = packed.to(tl.int32)
        pairs = tl.join(_e2m1_decode(packed & 0xF), _e2m1_decode(packed >> 4))
        offs_g = tl.arange(0, BLOCK_D // 32)
        mask_g = mask_t[:, None] & (offs_g < D // 32)[None, :]
        biased = tl.load(scales_ptr + rows * (D // 32) + offs_g[None, :], mask=mask_g, other=0).to(tl.int32)
        # Biased exponent 0 is 2**-127, an fp32 subnormal with bit pattern 1 << 22.
        scale = tl.where(biased == 0, 1 << 22, biased << 23).to(tl.float32, bitcast=True)
        groups = tl.reshape(pairs, (BLOCK_T, BLOCK_D // 32, 32)) * scale[:, :, None]
        x = tl.reshape(groups, (BLOCK_T, BLOCK_D))
    tl.store(out_ptr + rows * D + offs_d[None, :], x, mask=mask)


def launch_dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: str) -> None:
    """Decode contiguous ``values``/``scales`` rows (uint8 / fp32 views) into ``out [T, D]`` fp32."""
    num_tokens, head_dim = out.shape
    if num_tokens == 0:
        return
    if not (values.is_contiguous() and scales.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequantize needs contiguous values, scales and output")
    block_d = max(triton.next_power_of_2(head_dim), MXFP4_GROUP_SIZE)
    block_t = _tokens_per_program(num_tokens, block_d)
    grid = (triton.cdiv(num_tokens, block_t),)
    _dequant_kernel[grid](values, scales, out, num_tokens, D=head_dim, FORMAT=FORMAT_IDS[fmt],
                          BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
