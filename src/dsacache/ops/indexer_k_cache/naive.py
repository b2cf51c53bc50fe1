"""PyTorch reference of the indexer key cache write path (also the CPU path).

Every function here assumes validated input (the public functions in ``api.py`` check
it) and reads or writes the pages only through the format views of
:mod:`dsacache.formats.indexer_key`, so the byte layout lives in one place.
"""

from __future__ import annotations

import torch

from dsacache.formats.indexer_key import (
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_page_views,
    mxfp4_page_views,
    quantize_fp8,
    quantize_mxfp4,
)
from dsacache.formats.sizes import KERNEL_PAGE_SIZE


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


def page_values_and_scales(pages: torch.Tensor, head_dim: int, fmt: str):
    """The (values, scales) views of the pages as same-width byte/word tensors."""
    if fmt == "fp8":
        values, scales = fp8_page_views(pages, head_dim)
        return values.view(torch.uint8), scales
    return mxfp4_page_views(pages, head_dim)


def _quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "fp8":
        values, scales = quantize_fp8(x)
        return values.view(torch.uint8), scales
    return quantize_mxfp4(x)


def store_quantized(x: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Quantize keys ``x [T, D]`` to ``fmt`` and write them at ``slot_mapping`` (last repeat wins)."""
    tokens = _last_occurrence(slot_mapping, pages.shape[0] * KERNEL_PAGE_SIZE)
    if tokens.numel() == 0:
        return
    values, scales = _quantize(x[tokens], fmt)
    slots = slot_mapping[tokens].long()
    page, row = slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE
    page_values, page_scales = page_values_and_scales(pages, x.shape[-1], fmt)
    page_values[page, row] = values
    page_scales[page, row] = scales


def store_indexer_keys(k, pages, slot_mapping, fmt: str) -> None:
    store_quantized(k, pages, slot_mapping, fmt)


def fused_norm_store_indexer_keys(k, weight, bias, pages, slot_mapping, fmt: str, eps: float) -> None:
    store_quantized(layer_norm(k, weight, bias, eps), pages, slot_mapping, fmt)


def token_pages_and_rows(block_table: torch.Tensor, cu_seqlens: torch.Tensor, num_pages: int, num_tokens: int):
    """Kernel page id, row and validity of every gathered token ``[num_tokens]``.

    A token whose block table entry is missing (past the table's width) or not a page of
    the pool (e.g. ``-1``) is invalid: it gathers as zero bytes.
    """
    tokens = torch.arange(num_tokens, device=block_table.device)
    cu = cu_seqlens.long()
    request = torch.searchsorted(cu[1:], tokens, right=True)
    position = tokens - cu[request]
    page_index = position // KERNEL_PAGE_SIZE
    in_table = page_index < block_table.shape[1]
    page = block_table.long()[request, page_index.clamp(max=block_table.shape[1] - 1)]
    valid = in_table & (page >= 0) & (page < num_pages)
    return torch.where(valid, page, 0), position % KERNEL_PAGE_SIZE, valid


def gather_indexer_keys(pages, block_table, cu_seqlens, fmt: str, head_dim: int, num_tokens: int):
    """Contiguous (values, scales) of every request's first ``seq_len`` tokens, request after request."""
    page, row, valid = token_pages_and_rows(block_table, cu_seqlens, pages.shape[0], num_tokens)
    values, scales = page_values_and_scales(pages, head_dim, fmt)
    values, scales = values[page, row], scales[page, row]
    values[~valid] = 0
    scales[~valid] = 0
    if fmt == "fp8":
        values = values.view(torch.float8_e4m3fn)
    return values, scales


def dequantize_indexer_keys(values: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp8":
        return dequantize_fp8(values, scales)
    return dequantize_mxfp4(values, scales)
