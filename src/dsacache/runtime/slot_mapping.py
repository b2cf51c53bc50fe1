"""The per-step slot mapping: where each scheduled token's cache entries are written.

Built once per scheduler step from the kernel-page block table and reused by every layer
(the indexer key insert and the MLA latent insert both take it). For token ``t`` of
request ``b`` at position ``p`` (rank-local position under DCP, see ``dcp.py``):

    slot = block_table[b, p // page_size] * page_size + p % page_size

``-1`` marks tokens another DCP rank stores and the unused tail of the buffer, which is
preallocated at ``max_num_batched_tokens`` so the call shape never changes (CUDA graphs).
"""

from __future__ import annotations

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.dispatch import use_triton
from dsacache.runtime.dcp import check_dcp



def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    page_size: int = KERNEL_PAGE_SIZE,
    num_kernel_pages: int | None = None,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    dcp_interleave: int = 1,
    impl: str = "auto",
) -> torch.Tensor:
    """Fill ``out`` with the int64 slot of every scheduled token, ``-1`` elsewhere.

    Args:
        block_table: int32 ``[B, W]`` kernel page ids, ``-1``-padded (this rank's, under DCP).
        query_start_loc: int32 ``[B + 1]`` cumulative query token counts (``cu_seqlens``);
            request ``b`` owns tokens ``[query_start_loc[b], query_start_loc[b + 1])``.
            Empty requests (equal neighbours) are fine.
        positions: int64 ``[N]`` global position of every token, ``N >= query_start_loc[-1]``.
        out: int64 ``[max_num_batched_tokens]``, written entirely (tail ``-1``).
            Allocated at ``N`` when omitted.
        page_size: tokens per page; 64 for this pool (a parameter so that examples with
            small pages read as written).
        num_kernel_pages: pages in the pool; a slot at or past it is out of the pool.
        dcp_world_size, dcp_rank, dcp_interleave: decode context parallelism.
        impl: ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns ``out``.

    Errors: the torch path raises ``ValueError`` when a token this rank owns has no page
    (past the table width, a ``-1`` entry, or past ``num_kernel_pages``). The Triton path
    cannot raise without a host sync, so it writes ``-1`` for such a token (its write is
    dropped rather than landing outside the pool).

    >>> bt = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    >>> qsl = torch.tensor([0, 4], dtype=torch.int32)
    >>> pos = torch.tensor([0, 15, 16, 47])
    >>> compute_slot_mapping(bt, qsl, pos, page_size=16, impl="torch").tolist()
    [80, 95, 96, 127]
    """
    _check_inputs(block_table, query_start_loc, positions, page_size)
    check_dcp(dcp_world_size, dcp_rank, dcp_interleave)
    if out is None:
        out = torch.empty(positions.numel(), dtype=torch.int64, device=positions.device)
    _check_out(out, positions)
    args = (block_table, query_start_loc, positions, out, page_size, num_kernel_pages,
            dcp_world_size, dcp_rank, dcp_interleave)
    if use_triton(impl, out):
        from dsacache.runtime.slot_mapping_triton import launch_slot_mapping

        return launch_slot_mapping(*args)
    return slot_mapping_torch(*args)


def _check_inputs(block_table, query_start_loc, positions, page_size) -> None:
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [B, W], got {block_table.dtype} {tuple(block_table.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32:
        raise ValueError(
            f"query_start_loc must be int32 [B + 1], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if query_start_loc.numel() != block_table.shape[0] + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.numel()} entries; block_table has "
            f"{block_table.shape[0]} requests, so {block_table.shape[0] + 1} are needed"
        )
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [N], got {positions.dtype} {tuple(positions.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    devices = {block_table.device, query_start_loc.device, positions.device}
    if len(devices) > 1:
        raise ValueError(f"block_table, query_start_loc and positions must share a device, got {devices}")


def _check_out(out: torch.Tensor, positions: torch.Tensor) -> None:
    if out.dim() != 1 or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [max_num_batched_tokens], got {out.dtype} {tuple(out.shape)}")
    if out.device != positions.device:
        raise ValueError(f"out is on {out.device}, positions on {positions.device}")


def slot_mapping_torch(
    block_table, query_start_loc, positions, out, page_size, num_kernel_pages,
    dcp_world_size, dcp_rank, dcp_interleave,
) -> torch.Tensor:
    """The PyTorch reference (and CPU path) of :func:`compute_slot_mapping`; validates slots."""
    total = int(query_start_loc[-1])
    if total > min(positions.numel(), out.numel()):
        raise ValueError(
            f"query_start_loc[-1]={total} tokens, but positions has {positions.numel()} and "
            f"out has room for {out.numel()}"
        )
    tokens = torch.arange(total, device=positions.device, dtype=torch.int32)
    req = torch.searchsorted(query_start_loc[1:], tokens, right=True)
    pos = positions[:total]
    if total and int(pos.min()) < 0:
        raise ValueError("positions must be >= 0")
    cycle = dcp_interleave * dcp_world_size
    owned = (pos // dcp_interleave) % dcp_world_size == dcp_rank
    local = (pos // cycle) * dcp_interleave + pos % dcp_interleave
    page_index = local // page_size
    width = block_table.shape[1]
    in_table = page_index < width
    page = block_table[req, page_index.clamp(max=max(width - 1, 0))].long() if width else torch.full_like(pos, -1)
    page = torch.where(in_table, page, torch.full_like(page, -1))
    _check_pages(page[owned], page_index[owned], pos[owned], width, num_kernel_pages)
    slot = page * page_size + local % page_size
    out.fill_(-1)
    out[:total] = torch.where(owned, slot, torch.full_like(slot, -1))
    return out


def _check_pages(page, page_index, pos, width, num_kernel_pages) -> None:
    bad = page < 0
    if num_kernel_pages is not None:
        bad |= page >= num_kernel_pages
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    p, j = int(pos[i]), int(page_index[i])
    if j >= width:
        raise ValueError(f"position {p} needs page {j} of the block table, which is only {width} pages wide")
    if page[i] < 0:
        raise ValueError(f"position {p} maps to block table page {j}, which is -1 (no page allocated)")
    raise ValueError(
        f"position {p} maps to kernel page {int(page[i])}, outside the pool of {num_kernel_pages} pages"
    )
