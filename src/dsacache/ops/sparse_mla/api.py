"""The public sparse MLA decode: validate, then dispatch."""

from __future__ import annotations

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.mla_entry import MlaEntryFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.sparse_mla import naive


def sparse_mla_decode(q, mla_pages, indices, softmax_scale, *, kv_lora_rank=512, kv_cache_dtype=None,
                      k_scale=None, out=None, lse=None, impl="auto"):
    """Attention of absorbed queries over each row's selected cache slots.

    Args:
        q: ``[B, s_q, H, kv_lora_rank + rope]`` bf16 absorbed queries.
        mla_pages: one layer's MLA pages ``[num_pages, 64, entry_bytes]`` uint8 (any page stride).
        indices: ``[B, s_q, topk]`` int32 cache slots, ``-1`` = none.
        softmax_scale: the softmax scale (a float > 0).
        kv_lora_rank: latent width (the value width); the rest of ``q``'s last dim is rope.
        kv_cache_dtype: checked against the pages' entry width when given.
        k_scale: per-tensor fp32 scale of ``fp8`` entries.
        out, lse: optional preallocated outputs.

    Returns ``out [B, s_q, H, kv_lora_rank]`` bf16 and ``lse [B, s_q, H]`` fp32 (natural log);
    a row with no valid slot gives ``out = 0`` and ``lse = -inf``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be a bf16 tensor [B, s_q, H, D], got {getattr(q, 'shape', type(q))}")
    batch, s_q, heads, dim = q.shape
    fmt = MlaEntryFormat.of_entry(mla_pages.shape[2], kv_lora_rank, dim - kv_lora_rank, kv_cache_dtype)
    if not isinstance(indices, torch.Tensor) or indices.shape[:2] != (batch, s_q) or indices.dim() != 3:
        raise ValueError(f"indices must be [B, s_q, topk] int32, got {getattr(indices, 'shape', type(indices))}")
    check_same_device(q=q, mla_pages=mla_pages, indices=indices)
    if use_triton(impl, q, mla_pages, indices):
        raise NotImplementedError("the Triton sparse MLA decode is not on this branch yet; use impl='torch'")
    o, s = naive.sparse_mla_decode(q, mla_pages, indices, softmax_scale, fmt, k_scale)
    out = torch.empty(batch, s_q, heads, kv_lora_rank, dtype=torch.bfloat16, device=q.device) if out is None else out
    lse = torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device) if lse is None else lse
    out.copy_(o)
    lse.copy_(s)
    return out, lse
