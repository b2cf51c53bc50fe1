"""PyTorch reference of the MLA latent store (and its CPU path)."""

from __future__ import annotations

import torch

from dsacache.formats.mla_entry import MlaEntryFormat, encode_entries
from dsacache.formats.sizes import KERNEL_PAGE_SIZE


def store_mla_latents(kv_c: torch.Tensor, k_pe: torch.Tensor | None, pages: torch.Tensor,
                      slot_mapping: torch.Tensor, fmt: MlaEntryFormat, k_scale: torch.Tensor | None) -> None:
    """Encode every token's entry and write it at its slot; ``-1`` (and any slot outside the pages) is skipped.

    A repeated slot keeps the last token's entry.
    """
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < pages.shape[0] * KERNEL_PAGE_SIZE)
    if not bool(keep.any()):
        return
    tokens = _last_writer_per_slot(slots, keep)
    entries = encode_entries(kv_c[tokens], None if k_pe is None else k_pe[tokens], fmt, k_scale)
    slots = slots[tokens]
    pages[slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE] = entries


def _last_writer_per_slot(slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Indices of the kept tokens, one per distinct slot: the last token that names it."""
    kept = keep.nonzero().squeeze(1)
    unique, inverse = torch.unique(slots[kept], return_inverse=True)
    last = torch.full((unique.numel(),), -1, dtype=torch.long, device=slots.device)
    return last.scatter_reduce(0, inverse, kept, reduce="amax")
