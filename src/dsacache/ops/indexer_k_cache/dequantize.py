"""Dequantize kernel: gathered FP8 or MXFP4 keys -> fp32 (exact: every scale is a power of two)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_decode(code):
    """e2m1 codes (int32 0..15) -> fp32 {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign."""
    c = (code & 7).to(tl.float32)
    mag = tl.where(c < 4.0, c * 0.5, tl.where(c < 6.0, c - 2.0, (c - 4.0) * 2.0))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def dequantize_kernel(
    values_ptr,  # uint8 [T, D] (FP8 codes) or [T, D/2] (packed e2m1)
    scales_ptr,  # fp32 [T] (FP8) or uint8 [T, D/32] (UE8M0)
    out_ptr,     # fp32 [T, D]
    num_tokens,
    D: tl.constexpr, MXFP4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    rows = offs_t.to(tl.int64)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    if not MXFP4:
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
