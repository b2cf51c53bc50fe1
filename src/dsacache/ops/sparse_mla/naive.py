"""PyTorch reference of the sparse MLA decode."""

from __future__ import annotations

import torch

from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries
from dsacache.formats.sizes import KERNEL_PAGE_SIZE


def sparse_mla_decode(q, pages, indices, softmax_scale, fmt: MlaEntryFormat, k_scale=None):
    """fp32 ``(out [B, s_q, H, rank], lse [B, s_q, H])``; rows with no valid slot give 0 and ``-inf``."""
    num_slots = pages.shape[0] * KERNEL_PAGE_SIZE
    valid = (indices >= 0) & (indices < num_slots)
    slots = torch.where(valid, indices, 0).long()
    entries = pages[slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE]  # [B, s_q, topk, E]
    kv_c, k_pe = decode_entries(entries, fmt, k_scale)
    keys = torch.cat([kv_c, k_pe], dim=-1)  # [B, s_q, topk, D]
    scores = torch.einsum("bshd,bstd->bsht", q.float(), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("bsht,bstr->bshr", probs, kv_c)
    return out, lse
