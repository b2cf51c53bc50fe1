"""PyTorch reference for top-k selection and positions -> slots (also the path off CUDA).

The order the selection uses, shared with the Triton kernel:

* logits are ranked by their fp32 bit pattern mapped to an unsigned key that sorts like
  the float (``-inf < ... < -0.0 < +0.0 < ... < +inf``); NaN ranks below ``-inf``;
* equal keys: the lower position wins;
* the ``min(len, k)`` selected positions are written in ascending order, then ``-1``.
"""

from __future__ import annotations

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.runtime.block_table import lookup_pages


def sortable_keys(logits: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 keys in ``[0, 2**32)`` that sort like the floats; NaN -> 0."""
    bits = logits.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = bits >= 2**31
    keys = torch.where(negative, 0xFFFFFFFF - bits, bits + 2**31)
    return torch.where(torch.isnan(logits), torch.zeros_like(keys), keys)


def topk_positions(logits: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, k: int) -> torch.Tensor:
    """Reference top-k: row ``r`` ranks ``logits[r, starts[r] : starts[r] + lens[r]]``.

    ``lens`` and ``starts`` are already clamped to the row. Returns ``[R, k]`` int32
    positions relative to ``starts[r]``.
    """
    num_rows = logits.shape[0]
    out = torch.full((num_rows, k), -1, dtype=torch.int32, device=logits.device)
    for r in range(num_rows):
        start, length = int(starts[r]), int(lens[r])
        if length == 0:
            continue
        keys = sortable_keys(logits[r, start:start + length])
        order = torch.sort(keys, descending=True, stable=True).indices[:k]
        chosen = torch.sort(order).values
        out[r, :chosen.numel()] = chosen.to(torch.int32)
    return out


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, next_n: int,
                       num_pages: int) -> torch.Tensor:
    """``slot = block_table[row // next_n, pos // 64] * 64 + pos % 64``; ``-1`` where
    ``pos < 0`` or the block is unusable (``runtime.block_table.lookup_pages``)."""
    requests = torch.arange(positions.shape[0], device=positions.device) // next_n
    pos = positions.to(torch.int64)
    page, usable = lookup_pages(block_table, requests[:, None], pos.div(KERNEL_PAGE_SIZE, rounding_mode="floor"),
                                num_pages)
    slots = page * KERNEL_PAGE_SIZE + pos % KERNEL_PAGE_SIZE
    return torch.where(usable & (pos >= 0), slots, torch.full_like(slots, -1)).to(torch.int32)
