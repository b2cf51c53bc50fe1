"""PyTorch reference of the indexer key cache write path (also the CPU path).

Every function here assumes validated input (the public functions in ``api.py`` check
it) and reads or writes the pages only through :func:`dsacache.formats.indexer_key.split_indexer_pages`,
so the byte layout lives in one place.
"""

from __future__ import annotations

import torch

from dsacache.formats.indexer_key import (
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
    split_indexer_pages,
)
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.runtime.block_table import lookup_pages


def layer_norm(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in fp32, written out so the Triton kernel can mirror it.

    ``(k - mean) * rstd * weight + bias`` with the biased variance, as ``F.layer_norm``.
    """
    x = k.float()
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(dim=-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(var + eps)
    return centered * rstd * weight.float() + bias.float()


def _last_occurrence(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Indices of the tokens to store: slots in ``[0, num_slots)`` only, the last token of a repeated slot."""
    slots = slot_mapping.long()
    slots = torch.where(slots < num_slots, slots, torch.full_like(slots, -1))
    sorted_slots, order = torch.sort(slots, stable=True)
    keep = torch.ones_like(sorted_slots, dtype=torch.bool)
    keep[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    keep &= sorted_slots >= 0
    return order[keep]


def quantized_bytes(x: torch.Tensor, fmt: IndexerKeyFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``x [T, D]`` as the bytes of their entries: (values ``[T, value_bytes]``, scales ``[T, scale_bytes]``) uint8."""
    if fmt.is_mxfp4:
        return quantize_mxfp4(x)
    values, scales = quantize_fp8(x)
    return values.view(torch.uint8), scales.unsqueeze(-1).view(torch.uint8)


def store_quantized(x: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor, fmt: IndexerKeyFormat) -> None:
    """Quantize keys ``x [T, D]`` to ``fmt`` and write them at ``slot_mapping`` (last repeat wins)."""
    tokens = _last_occurrence(slot_mapping, pages.shape[0] * KERNEL_PAGE_SIZE)
    if tokens.numel() == 0:
        return
    values, scales = quantized_bytes(x[tokens], fmt)
    slots = slot_mapping[tokens].long()
    page, row = slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE
    page_values, page_scales = split_indexer_pages(pages, fmt)
    page_values[page, row] = values
    page_scales[page, row] = scales


def store_indexer_keys(k, pages, slot_mapping, fmt: IndexerKeyFormat) -> None:
    store_quantized(k, pages, slot_mapping, fmt)


def fused_norm_store_indexer_keys(k, weight, bias, pages, slot_mapping, fmt: IndexerKeyFormat, eps: float) -> None:
    store_quantized(layer_norm(k, weight, bias, eps), pages, slot_mapping, fmt)


def token_pages_and_rows(block_table: torch.Tensor, cu_seqlens: torch.Tensor, num_pages: int, num_tokens: int):
    """Kernel page id (``-1`` if none), row and validity of every gathered token ``[num_tokens]``.

    Token ``t`` is position ``t - cu_seqlens[r]`` of the last request ``r`` with ``cu_seqlens[r] <= t``
    (empty requests skipped), looked up by the block-table rule (``lookup_pages``): a block past the
    table or an entry that is not a page of the pool (e.g. ``-1``) makes it invalid.
    """
    tokens = torch.arange(num_tokens, device=block_table.device)
    cu = cu_seqlens.long()
    request = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=max(block_table.shape[0] - 1, 0))
    position = tokens - cu[request]
    page, valid = lookup_pages(block_table, request, position // KERNEL_PAGE_SIZE, num_pages)
    return page, position % KERNEL_PAGE_SIZE, valid


def typed_entries(values: torch.Tensor, scales: torch.Tensor, fmt: IndexerKeyFormat):
    """Gathered entry bytes ``[T, value_bytes]``, ``[T, scale_bytes]`` as the public functions return them:
    FP8 ``(float8_e4m3fn [T, D], float32 [T])``, MXFP4 the uint8 bytes as they are."""
    if fmt.is_mxfp4:
        return values, scales
    return values.view(torch.float8_e4m3fn), scales.view(torch.float32).squeeze(-1)


def gather_indexer_keys(pages, block_table, cu_seqlens, fmt: IndexerKeyFormat, num_tokens: int):
    """Contiguous (values, scales) of every request's first ``seq_len`` tokens, request after request."""
    page, row, valid = token_pages_and_rows(block_table, cu_seqlens, pages.shape[0], num_tokens)
    page_values, page_scales = split_indexer_pages(pages, fmt)
    page = page.clamp_min(0)
    values, scales = page_values[page, row], page_scales[page, row]
    values[~valid] = 0
    scales[~valid] = 0
    return typed_entries(values, scales, fmt)


def dequantize_indexer_keys(values: torch.Tensor, scales: torch.Tensor, fmt: IndexerKeyFormat) -> torch.Tensor:
    if fmt.is_mxfp4:
        return dequantize_mxfp4(values, scales)
    return dequantize_fp8(values, scales)
