"""Indexer key formats: the reference codecs and the page byte layout (PyTorch).

Both formats store a page *value-major*: all 64 tokens' values first, then all 64
tokens' scales (``docs/layout.md``, "indexer page"). A layer's indexer pages reach
this module as a paged view ``[num_pages, 64, entry]`` uint8 whose ``stride(0)`` is
the page stride of the packed pool; ``entry`` is only the per-token byte budget.

Scales are powers of two chosen by exact integer arithmetic on the fp32 bit
pattern (no ``log2`` and no division), so every implementation (this one, Triton,
CUDA) picks bit-identical scales:

* FP8 (e4m3, one quant block per token): ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``,
  i.e. the smallest power of two with ``amax <= 448 * s``.
* MXFP4 (e2m1, one block per 32 values): ``s = 2**ceil(log2(amax / 6))``, i.e. the
  smallest power of two with ``amax <= 6 * s``, exponent clamped to ``[-127, 127]``
  and stored biased by 127 (UE8M0). An all-zero group stores byte 0.

Non-finite input, by rule (both formats): ``amax`` is taken over the finite elements
only, so one bad element never poisons its neighbours' scale; ``+-inf`` saturate to
the largest code (+-448 for FP8, +-6 for MXFP4); NaN is stored as the e4m3 NaN code
for FP8 and as +0 for MXFP4 (e2m1 has no NaN).

MXFP4 rounding is round-half-to-even on the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6};
the sign bit follows IEEE ``signbit`` (so -0.0 and tiny negatives store as -0, 0x8).
"""

from __future__ import annotations

import torch

from dsacache.formats.key_format import MXFP4_GROUP_SIZE, IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
UE8M0_BIAS = 127

#: e2m1 code (low 3 bits) -> magnitude.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between consecutive e2m1 codes, and whether the tie goes up
# (ties go to the even code: 0, 1, 2, 4 have even codes 0, 2, 4, 6).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| over the last dim, ignoring NaN and inf (fp32)."""
    x = x.float().abs()
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x)).amax(dim=-1)


def _pow2_exponent_at_least(amax: torch.Tensor, mantissa_limit: int, shift: int) -> torch.Tensor:
    """Smallest integer ``e`` with ``amax <= M * 2**(e)`` for a grid maximum ``M``.

    ``M = (1 + mantissa_limit / 2**23) * 2**shift``; with ``amax = 1.f * 2**E`` the answer
    is ``E - shift`` when ``f <= mantissa_limit`` and ``E - shift + 1`` otherwise.
    Works on positive normal fp32 values.
    """
    bits = amax.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    return biased - 127 - shift + (frac > mantissa_limit).to(torch.int32)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token ue8m0 scale ``[..., ]`` fp32 for keys ``x [..., head_dim]``."""
    amax = _finite_amax(x).clamp_min(FP8_AMAX_FLOOR)
    # 448 = 1.75 * 2**8: mantissa limit 0x600000, shift 8.
    exp = _pow2_exponent_at_least(amax, 0x600000, 8)
    return torch.ldexp(torch.ones_like(amax), exp.float())


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize keys ``[..., D]`` to (e4m3 values ``[..., D]``, fp32 scales ``[...]``)."""
    x = x.float()
    scale = fp8_scale(x)
    y = x / scale.unsqueeze(-1)  # exact: the scale is a power of two
    y = torch.where(torch.isnan(y), y, y.clamp(-FP8_MAX, FP8_MAX))
    return y.to(torch.float8_e4m3fn), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``values * scale`` in fp32."""
    return values.float() * scale.float().unsqueeze(-1)


def mxfp4_scale_exponent(x: torch.Tensor) -> torch.Tensor:
    """Unbiased power-of-two exponent ``[..., D/32]`` int32 of each 32-value group."""
    groups = x.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    amax = _finite_amax(groups)
    # 6 = 1.5 * 2**2: mantissa limit 0x400000, shift 2.
    exp = _pow2_exponent_at_least(amax, 0x400000, 2)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -UE8M0_BIAS))
    return exp.clamp(-UE8M0_BIAS, UE8M0_BIAS)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` (already divided by its scale) to 4-bit e2m1 codes (uint8 0..15)."""
    mag = y.abs()
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        code += (mag >= threshold if tie_up else mag > threshold).to(torch.uint8)
    sign = torch.signbit(y) & ~torch.isnan(y)
    return code | (sign.to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 0x7).long()]
    return torch.where((code & 0x8) != 0, -mag, mag)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize keys ``[..., D]`` to (packed ``[..., D/2]`` uint8, UE8M0 scales ``[..., D/32]`` uint8).

    Element ``2i`` goes to the low nibble of byte ``i``, element ``2i+1`` to the high nibble.
    """
    if x.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(f"head_dim={x.shape[-1]} must be a multiple of {MXFP4_GROUP_SIZE} for MXFP4")
    exp = mxfp4_scale_exponent(x)
    groups = x.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    y = groups / torch.ldexp(torch.ones_like(groups[..., :1]), exp.unsqueeze(-1).float())
    codes = e2m1_encode(y).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + UE8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: fp32 ``[..., D]``."""
    lo = e2m1_decode(packed & 0xF)
    hi = e2m1_decode(packed >> 4)
    values = torch.stack((lo, hi), dim=-1).flatten(-2)
    exp = scale_bytes.to(torch.int32) - UE8M0_BIAS
    groups = values.unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    scale = torch.ldexp(torch.ones_like(groups[..., :1]), exp.unsqueeze(-1).float())
    return (groups * scale).flatten(-2)


def indexer_pages_format(pages: torch.Tensor, head_dim: int,
                         indexer_kv_dtype: str | IndexerKeyFormat | None = None) -> IndexerKeyFormat:
    """The key format of a layer's paged indexer view, after checking the view; ``ValueError`` otherwise.

    ``pages`` is ``[num_pages, 64, entry]`` uint8 with strides ``(page_stride, entry, 1)``.
    Without ``indexer_kv_dtype`` the format is read off ``entry`` (what the pool handed
    out); with it, the pages must match it.
    """
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 3:
        raise ValueError(
            f"indexer pages must be a uint8 view [num_pages, {KERNEL_PAGE_SIZE}, entry], "
            f"got {tuple(getattr(pages, 'shape', ()))} {getattr(pages, 'dtype', type(pages).__name__)}"
        )
    if pages.shape[1] != KERNEL_PAGE_SIZE:
        raise ValueError(f"indexer pages must be [num_pages, {KERNEL_PAGE_SIZE}, entry], got {tuple(pages.shape)}")
    fmt = IndexerKeyFormat.of_entry(pages.shape[2], head_dim, indexer_kv_dtype)
    entry = fmt.entry_bytes
    if pages.shape[0] > 1 and pages.stride(0) < KERNEL_PAGE_SIZE * entry:
        raise ValueError(f"page stride {pages.stride(0)} overlaps pages of {KERNEL_PAGE_SIZE * entry} B")
    if pages.stride(1) != entry or pages.stride(2) != 1:
        raise ValueError("each indexer page must be contiguous: strides (page_stride, entry, 1)")
    return fmt


def _page_region(pages: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int):
    return pages.as_strided(shape, strides, pages.storage_offset() + offset)


def split_indexer_pages(pages: torch.Tensor, fmt: IndexerKeyFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ``[P, 64, value_bytes]``, scale bytes ``[P, 64, scale_bytes]``) uint8 views of checked pages.

    The views alias the pool: writing them writes the cache.
    """
    num_pages, stride = pages.shape[0], pages.stride(0)
    values = _page_region(pages, (num_pages, KERNEL_PAGE_SIZE, fmt.value_bytes), (stride, fmt.value_bytes, 1), 0)
    scales = _page_region(pages, (num_pages, KERNEL_PAGE_SIZE, fmt.scale_bytes), (stride, fmt.scale_bytes, 1),
                          KERNEL_PAGE_SIZE * fmt.value_bytes)
    return values, scales


def fp8_page_views(pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP8 indexer pages into (values ``[P, 64, D]`` e4m3, scales ``[P, 64]`` fp32) views."""
    values, scales = split_indexer_pages(pages, indexer_pages_format(pages, head_dim, "fp8"))
    return values.view(torch.float8_e4m3fn), scales.view(torch.float32).squeeze(-1)


def mxfp4_page_views(pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split MXFP4 indexer pages into (packed ``[P, 64, D/2]``, scale bytes ``[P, 64, D/32]``) uint8 views."""
    return split_indexer_pages(pages, indexer_pages_format(pages, head_dim, "mxfp4"))


def dequantize_pages(pages: torch.Tensor, head_dim: int,
                     indexer_kv_dtype: str | IndexerKeyFormat | None = None) -> torch.Tensor:
    """Every token of every page as fp32 keys ``[P, 64, D]`` (reference reader)."""
    fmt = indexer_pages_format(pages, head_dim, indexer_kv_dtype)
    if fmt.is_mxfp4:
        return dequantize_mxfp4(*mxfp4_page_views(pages, head_dim))
    return dequantize_fp8(*fp8_page_views(pages, head_dim))
