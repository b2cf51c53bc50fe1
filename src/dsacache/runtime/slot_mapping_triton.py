"""Triton kernels for the per-step metadata: slot mapping and decode context lengths.

Both are CUDA-graph friendly: the grid depends only on buffer sizes known on the host
(never on ``query_start_loc[-1]`` or any other device value), nothing is read back, and
every element of the fixed-size output is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.ops.triton_utils import block_table_page

#: Any page id fits below this when the caller gives no pool size.
_NO_PAGE_LIMIT = 2**31 - 1


@triton.jit
def _dcp_local(pos, world, rank, interleave):
    """(owned by ``rank``, local position) of positions ``pos >= 0``: the rule of ``dcp.py``."""
    owned = (pos // interleave) % world == rank
    local = (pos // (interleave * world)) * interleave + pos % interleave
    return owned, local


@triton.jit
def _slot_mapping_kernel(
    block_table_ptr,  # [B, W] int32, rows contiguous
    bt_stride,
    width,
    query_start_loc_ptr,  # [B + 1] int32
    num_reqs,  # B >= 1
    positions_ptr,  # [N] int64
    num_positions,
    out_ptr,  # [T] int64, T = max_num_batched_tokens
    out_len,
    page_size,
    num_kernel_pages,
    world,
    rank,
    interleave,
    BLOCK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # >= log2(B + 1): binary-search rounds (one compile per bit length of B)
):
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] index into out
    total = tl.load(query_start_loc_ptr + num_reqs)
    live = (tok < total) & (tok < num_positions)
    # Upper-bound search: req = #{b in 1..B : query_start_loc[b] <= tok}, which skips empty requests.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        bound = tl.load(query_start_loc_ptr + mid + 1, mask=live & active, other=0)
        right = active & (bound <= tok)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    req = tl.minimum(lo, num_reqs - 1)  # in the table even for a query_start_loc that breaks its rules
    pos = tl.load(positions_ptr + tok, mask=live, other=0)  # [BLOCK] int64
    mine, local = _dcp_local(tl.maximum(pos, 0), world, rank, interleave)
    owned = live & (pos >= 0) & mine
    page, ok = block_table_page(block_table_ptr + req.to(tl.int64) * bt_stride, local // page_size, owned,
                                width, num_kernel_pages)
    slot = page.to(tl.int64) * page_size + local % page_size
    tl.store(out_ptr + tok, tl.where(ok, slot, -1), mask=tok < out_len)


def launch_slot_mapping(
    block_table, query_start_loc, positions, out, page_size, num_kernel_pages, dcp, block: int = 256,
) -> torch.Tensor:
    """Launch over the whole of ``out``; inputs checked by the public function (``B >= 1``, ``N >= 1``)."""
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    num_reqs = block_table.shape[0]
    grid = (triton.cdiv(out.numel(), block),)
    _slot_mapping_kernel[grid](
        block_table, block_table.stride(0), block_table.shape[1],
        query_start_loc.contiguous(), num_reqs,
        positions.contiguous(), positions.numel(), out, out.numel(),
        page_size, _NO_PAGE_LIMIT if num_kernel_pages is None else num_kernel_pages,
        dcp.world_size, dcp.rank, dcp.interleave,
        BLOCK=block, SEARCH_STEPS=num_reqs.bit_length(),
    )
    return out


@triton.jit
def _decode_context_lens_kernel(
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, next_n] int32, contiguous
    num_elements,  # B * next_n
    next_n,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < num_elements
    req, row = idx // next_n, idx % next_n
    seq_len = tl.load(seq_lens_ptr + req, mask=mask, other=0)
    tl.store(out_ptr + idx, seq_len - next_n + row + 1, mask=mask)


def launch_decode_context_lens(seq_lens: torch.Tensor, out: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``out[b, i] = seq_lens[b] - next_n + i + 1`` for a contiguous ``out [B, next_n]`` (checked by
    the public function)."""
    seq_lens = seq_lens.contiguous()
    grid = (max(triton.cdiv(out.numel(), block), 1),)
    _decode_context_lens_kernel[grid](seq_lens, out, out.numel(), out.shape[1], BLOCK=block)
    return out
