"""PyTorch reference of the sparse MLA decode (and its CPU path).

Entries are dequantized with the reference codec (``decode_entries``) and the attention is
computed in fp32: scores, a log-sum-exp over the valid slots, the softmax-weighted sum of the
values. Query rows go through in chunks, so the gathered entries stay a bounded temporary.
"""

from __future__ import annotations

import math

import torch

from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries
from dsacache.formats.sizes import KERNEL_PAGE_SIZE

#: Gathered values (rows x topk x cached values) dequantized at a time.
CHUNK_VALUES = 1 << 26


def sparse_mla_decode(q: torch.Tensor, pages: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                      fmt: MlaEntryFormat, k_scale: torch.Tensor | None, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """Fill ``out [B, s_q, H, rank]`` and ``lse [B, s_q, H]`` (natural log); a slot outside
    ``[0, num_pages * 64)`` is none, a row without any valid slot gets 0 and ``-inf``."""
    rank = fmt.kv_lora_rank
    rows = q.shape[0] * q.shape[1]
    if rows == 0:
        return
    q_rows = q.reshape(rows, q.shape[2], q.shape[3])
    idx_rows = indices.reshape(rows, indices.shape[2])
    out_rows, lse_rows = out.view(rows, q.shape[2], rank), lse.view(rows, q.shape[2])
    step = max(1, CHUNK_VALUES // (idx_rows.shape[1] * fmt.cached_dim))
    for start in range(0, rows, step):
        o, l = _attend(q_rows[start:start + step], pages, idx_rows[start:start + step], softmax_scale, fmt, k_scale)
        out_rows[start:start + step] = o.to(out.dtype)
        lse_rows[start:start + step] = l


def _attend(q: torch.Tensor, pages: torch.Tensor, idx: torch.Tensor, softmax_scale: float, fmt: MlaEntryFormat,
            k_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [R, H, rank], lse fp32 [R, H]) of query rows ``q [R, H, D]`` over slots ``idx [R, topk]``."""
    slots = idx.long()
    valid = (slots >= 0) & (slots < pages.shape[0] * KERNEL_PAGE_SIZE)
    slots = torch.where(valid, slots, 0)
    entries = pages[slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE]     # [R, topk, E] uint8
    kv_c, k_pe = decode_entries(entries, fmt, k_scale)
    keys = torch.cat([kv_c, k_pe], dim=-1)                                    # [R, topk, D] fp32
    scores = torch.einsum("rhd,rtd->rht", q.float(), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                                     # -inf where nothing is valid
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("rht,rtc->rhc", weights, kv_c), lse
