"""PyTorch reference for the indexer logits (also the path used off CUDA).

Keys are dequantized with the format codecs of :mod:`dsacache.formats.indexer_key`, so
this file states the math once, in fp32, with no kernel tricks:

    logit[row, j] = sum_h weights[row, h] * relu(q[row, h] . key[j])

where ``key[j]`` already carries its scale (FP8: one per token; MXFP4: one per 32 values).
Positions a row may not see are ``-inf``; see :func:`paged_decode_logits` for the rules.
"""

from __future__ import annotations

import torch

from dsacache.formats.indexer_key import dequantize_fp8, dequantize_mxfp4, dequantize_pages
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.runtime.block_table import lookup_pages


def score_keys(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[rows, H, D]`` queries, ``[rows, H]`` weights, ``[N, D]`` fp32 keys -> ``[rows, N]`` fp32."""
    dots = torch.einsum("rhd,nd->rhn", q.float(), keys.float())
    return torch.einsum("rhn,rh->rn", dots.relu(), weights.float())


def dequantize_keys(k_values: torch.Tensor, k_scales: torch.Tensor, fmt: IndexerKeyFormat) -> torch.Tensor:
    """Contiguous keys of the format ``fmt`` -> fp32 ``[N, D]``."""
    return (dequantize_mxfp4 if fmt.is_mxfp4 else dequantize_fp8)(k_values, k_scales)


def paged_decode_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    row_lens: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    fmt: IndexerKeyFormat,
) -> torch.Tensor:
    """Reference decode logits; ``row_lens`` is the per-row length ``[B, next_n]`` int32.

    One request at a time, so the dequantized keys of a single request are the largest
    temporary (``max_blocks * 64 * D`` fp32). Blocks the block table cannot resolve
    (``lookup_pages``) score ``-inf``.
    """
    batch, next_n, num_heads, head_dim = q.shape
    out = torch.full((batch * next_n, max_model_len), float("-inf"), dtype=torch.float32, device=q.device)
    lens = row_lens.to(torch.int64).clamp(0, max_model_len)
    weights = weights.view(batch, next_n, num_heads)
    cols = torch.arange(max_model_len, device=q.device)
    blocks = torch.arange(-(-max_model_len // KERNEL_PAGE_SIZE), device=q.device)
    for b in range(batch):
        width = int(lens[b].max())
        if width == 0:
            continue
        num_blocks = -(-width // KERNEL_PAGE_SIZE)
        page, usable = lookup_pages(block_table, torch.tensor(b, device=q.device), blocks[:num_blocks], pages.shape[0])
        keys = torch.zeros(num_blocks, KERNEL_PAGE_SIZE, head_dim, dtype=torch.float32, device=q.device)
        if usable.any():
            keys[usable] = dequantize_pages(pages[page[usable]], head_dim, fmt)
        keys = keys.reshape(-1, head_dim)[:width]
        readable = usable[cols[:width] // KERNEL_PAGE_SIZE]
        scores = score_keys(q[b], weights[b], keys)
        visible = readable[None, :] & (cols[None, :width] < lens[b][:, None])
        rows = slice(b * next_n, (b + 1) * next_n)
        out[rows, :width] = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
    return out


def ragged_prefill_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_values: torch.Tensor,
    k_scales: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    fmt: IndexerKeyFormat,
) -> torch.Tensor:
    """Reference prefill logits ``[M, N]``: row ``i`` sees key rows ``[ks[i], ke[i])``."""
    keys = dequantize_keys(k_values, k_scales, fmt)
    scores = score_keys(q, weights, keys)
    cols = torch.arange(keys.shape[0], device=q.device)
    inside = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    return torch.where(inside, scores, torch.full_like(scores, float("-inf")))
