"""The per-step slot mapping: where each scheduled token's cache entries are written.

Built once per scheduler step from the kernel-page block table and reused by every layer
(the indexer key insert and the MLA latent insert both take it). For token ``t`` of
request ``b`` at position ``p`` (rank-local position under DCP, see ``dcp.py``):

    slot = block_table[b, p // page_size] * page_size + p % page_size

``-1`` marks tokens another DCP rank stores and the unused tail of the buffer, which is
preallocated at ``max_num_batched_tokens`` so the call shape never changes (CUDA graphs).
The block-table lookup follows the one rule of ``block_table.py``.
"""

from __future__ import annotations

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.runtime.block_table import check_block_table, lookup_pages
from dsacache.runtime.checks import int_arg, optional_int_arg, tensor_arg
from dsacache.runtime.dcp import NO_DCP, DcpSettings, check_dcp


def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    page_size: int = KERNEL_PAGE_SIZE,
    num_kernel_pages: int | None = None,
    dcp: DcpSettings = NO_DCP,
    check: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Fill ``out`` with the int64 slot of every scheduled token, ``-1`` elsewhere.

    Args:
        block_table: int32 ``[B, W]`` kernel page ids, ``-1``-padded (this rank's, under DCP).
        query_start_loc: int32 ``[B + 1]`` cumulative query token counts (``cu_seqlens``):
            starts at 0, never decreases; request ``b`` owns tokens
            ``[query_start_loc[b], query_start_loc[b + 1])``. Empty requests are fine.
        positions: int64 ``[N]`` global position (>= 0) of every token, ``N >= query_start_loc[-1]``.
        out: int64 ``[max_num_batched_tokens]`` contiguous, ``>= query_start_loc[-1]`` entries,
            written entirely (tail ``-1``). Allocated at ``N`` when omitted.
        page_size: tokens per page; 64 for this pool (a parameter so that examples with
            small pages read as written).
        num_kernel_pages: pages in the pool; a slot at or past it is out of the pool.
        dcp: this rank's decode context parallelism settings (default: none).
        check: validate the data on the host before anything is written (reads
            ``query_start_loc``, ``positions`` and the looked-up pages back: a device sync).
            Refused, with a ``ValueError`` from both paths alike: a ``query_start_loc`` that
            does not start at 0 or decreases, or whose last entry exceeds ``N`` or ``out``; a
            negative position; a token this rank owns without a page (past the table width,
            a ``-1`` entry, or past ``num_kernel_pages``). Pass ``False`` under CUDA-graph
            capture: both paths then never sync, write ``-1`` for a token without a valid
            page (never a slot outside the pool), and give an unspecified (but in-bounds)
            mapping for a ``query_start_loc`` that breaks its rules.
        impl: ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns ``out``.

    >>> bt = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    >>> qsl = torch.tensor([0, 4], dtype=torch.int32)
    >>> pos = torch.tensor([0, 15, 16, 47])
    >>> compute_slot_mapping(bt, qsl, pos, page_size=16, impl="torch").tolist()
    [80, 95, 96, 127]
    """
    page_size, num_kernel_pages = _check_inputs(block_table, query_start_loc, positions, page_size,
                                                num_kernel_pages, dcp)
    if out is None:
        out = torch.empty(positions.numel(), dtype=torch.int64, device=positions.device)
    _check_out(out, positions)
    triton = use_triton(impl, out)
    if check:
        _check_step(block_table, query_start_loc, positions, out, page_size, num_kernel_pages, dcp)
    if block_table.shape[0] == 0 or positions.numel() == 0:
        return out.fill_(-1)
    args = (block_table, query_start_loc, positions, out, page_size, num_kernel_pages, dcp)
    if triton:
        from dsacache.runtime.slot_mapping_triton import launch_slot_mapping

        return launch_slot_mapping(*args)
    return slot_mapping_torch(*args)


def _check_inputs(block_table, query_start_loc, positions, page_size, num_kernel_pages, dcp) -> tuple:
    """Shapes, dtypes, devices and settings (no device value is read); (page_size, num_kernel_pages) as ints."""
    check_block_table(block_table)
    tensor_arg(query_start_loc, "query_start_loc", torch.int32, 1, "int32 [B + 1]")
    tensor_arg(positions, "positions", torch.int64, 1, "int64 [N]")
    if query_start_loc.numel() != block_table.shape[0] + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.numel()} entries; block_table has "
            f"{block_table.shape[0]} requests, so {block_table.shape[0] + 1} are needed"
        )
    check_same_device(block_table=block_table, query_start_loc=query_start_loc, positions=positions)
    check_dcp(dcp)
    return int_arg(page_size, "page_size", 1), optional_int_arg(num_kernel_pages, "num_kernel_pages")


def _check_out(out, positions) -> None:
    tensor_arg(out, "out", torch.int64, 1, "a contiguous int64 [max_num_batched_tokens]", contiguous=True)
    if out.device != positions.device:
        raise ValueError(f"out is on {out.device}, positions on {positions.device}")


def _check_step(block_table, query_start_loc, positions, out, page_size, num_kernel_pages, dcp) -> None:
    """The data checks of ``check=True`` (host reads), the same for both paths."""
    cu = query_start_loc.cpu()
    if cu[0] != 0:
        raise ValueError(f"query_start_loc[0]={int(cu[0])} must be 0")
    falls = (cu[1:] < cu[:-1]).nonzero()
    if falls.numel():
        b = int(falls[0, 0])
        raise ValueError(f"query_start_loc must not decrease: query_start_loc[{b + 1}]={int(cu[b + 1])} < "
                         f"query_start_loc[{b}]={int(cu[b])}")
    total = int(cu[-1])
    if total > min(positions.numel(), out.numel()):
        raise ValueError(f"query_start_loc[-1]={total} tokens, but positions has {positions.numel()} and "
                         f"out has room for {out.numel()}")
    if total == 0:
        return
    if int(positions[:total].min()) < 0:
        raise ValueError("positions must be >= 0")
    _, owned, usable, req, block, pos = _token_slots(block_table, query_start_loc, positions, total, page_size,
                                                     num_kernel_pages, dcp)
    bad = (owned & ~usable).nonzero()
    if not bad.numel():
        return
    i = int(bad[0, 0])
    p, j, width = int(pos[i]), int(block[i]), block_table.shape[1]
    if j >= width:
        raise ValueError(f"position {p} needs page {j} of the block table, which is only {width} pages wide")
    page = int(block_table[int(req[i]), j])
    if page < 0:
        raise ValueError(f"position {p} maps to block table page {j}, which is -1 (no page allocated)")
    raise ValueError(f"position {p} maps to kernel page {page}, outside the pool of {num_kernel_pages} pages")


def _token_slots(block_table, query_start_loc, positions, num_tokens, page_size, num_kernel_pages, dcp):
    """(slot, owned, usable, request, block, position) of tokens ``0 .. num_tokens - 1``, device ops only.

    ``owned``: a live token (below ``query_start_loc[-1]`` and ``positions.numel()``, at a
    position >= 0) that this rank stores; ``usable``: its block's page passes the lookup
    rule; ``slot`` is meaningful where both hold. ``B >= 1`` and ``N >= 1``.
    """
    tok = torch.arange(num_tokens, dtype=torch.int32, device=positions.device)
    live = (tok < query_start_loc[-1]) & (tok < positions.numel())
    req = torch.searchsorted(query_start_loc[1:], tok, right=True).clamp_(max=block_table.shape[0] - 1)
    pos = positions[tok.clamp(max=positions.numel() - 1)]
    owned = live & (pos >= 0) & dcp.owns(pos)
    local = dcp.local_position(pos.clamp(min=0))
    block = local // page_size
    page, usable = lookup_pages(block_table, req, block, num_kernel_pages)
    return page * page_size + local % page_size, owned, usable, req, block, pos


def slot_mapping_torch(block_table, query_start_loc, positions, out, page_size, num_kernel_pages, dcp):
    """The PyTorch path of :func:`compute_slot_mapping` over the whole of ``out`` (inputs checked
    by it; ``B >= 1``, ``N >= 1``). Device ops only: no sync, like the Triton kernel."""
    slot, owned, usable, *_ = _token_slots(block_table, query_start_loc, positions, out.numel(), page_size,
                                           num_kernel_pages, dcp)
    return out.copy_(torch.where(owned & usable, slot, torch.full_like(slot, -1)))
