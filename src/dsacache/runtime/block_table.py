"""Kernel-page block tables: what paged kernels see instead of rows.

A row of ``block_size`` tokens is ``pages_per_row`` kernel pages of 64 tokens; page ``j``
of row ``r`` is kernel page ``r * pages_per_row + j`` (``docs/layout.md``). A request's
block table is the concatenation of its rows' pages, cut to the pages its tokens use,
and ``-1``-padded to the table width.

The lookup rule every reader follows (defined here for PyTorch, in
``dsacache.ops.triton_utils.block_table_page`` for Triton): block ``j`` of request ``b`` is
usable iff ``0 <= j < width`` and its entry ``page`` satisfies ``0 <= page < num_pages``;
an unusable block reads as nothing (no key, no slot) and is never dereferenced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsacache.runtime.checks import device_arg, int_arg, int_list, optional_int_arg

#: Page ids must fit the int32 block table.
_MAX_PAGE = 2**31 - 1


def check_block_table(block_table: object, num_requests: int | None = None, *, name: str = "block_table",
                      min_width: int = 0) -> None:
    """``ValueError`` unless ``block_table`` is an int32 ``[num_requests, width]`` tensor, ``width >= min_width``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        got = f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor) else \
            type(block_table).__name__
        raise ValueError(f"{name} must be an int32 tensor [num_requests, max_blocks], got {got}")
    if num_requests is not None and block_table.shape[0] != num_requests:
        raise ValueError(f"{name} has {block_table.shape[0]} rows for {num_requests} requests")
    if block_table.shape[1] < min_width:
        raise ValueError(f"{name} must be at least {min_width} blocks wide, got {block_table.shape[1]}")


def lookup_pages(block_table: torch.Tensor, requests: torch.Tensor, blocks: torch.Tensor,
                 num_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 page ids, bool usable) of block ``blocks[i]`` of request ``requests[i]`` (broadcast).

    Unusable blocks (outside the table, a negative entry, or an entry ``>= num_pages``) give
    page ``-1`` and ``usable`` False, without indexing past the table.
    """
    width = block_table.shape[1]
    in_table = (blocks >= 0) & (blocks < width)
    if width == 0:
        page = torch.full(torch.broadcast_shapes(requests.shape, blocks.shape), -1, dtype=torch.int64,
                          device=block_table.device)
    else:
        page = block_table.long()[requests, blocks.clamp(0, width - 1)]
    usable = in_table & (page >= 0)
    if num_pages is not None:
        usable &= page < num_pages
    return torch.where(usable, page, torch.full_like(page, -1)), usable


def kernel_pages(rows: Sequence[int], pages_per_row: int, num_pages: int) -> list[int]:
    """The first ``num_pages`` kernel page ids of a request that owns ``rows`` in order."""
    rows = int_list(rows, "rows")
    pages_per_row, num_pages = int_arg(pages_per_row, "pages_per_row", 1), int_arg(num_pages, "num_pages")
    if num_pages > len(rows) * pages_per_row:
        raise ValueError(
            f"num_pages={num_pages} is more than the {len(rows)} rows x "
            f"{pages_per_row} pages the request owns"
        )
    return [row * pages_per_row + j for row in rows for j in range(pages_per_row)][:num_pages]


def build_block_table(
    page_lists: Sequence[Sequence[int]],
    width: int | None = None,
    *,
    max_width: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Stack per-request kernel page lists into an int32 ``[B, width]`` table, ``-1``-padded.

    ``width`` defaults to the longest list. ``max_width`` is the widest table the caller's
    kernels and buffers accept (e.g. ``ceil(max_model_len / 64)``); a wider one is refused.

    >>> build_block_table([[4, 5, 6], [9]], width=4)
    tensor([[ 4,  5,  6, -1],
            [ 9, -1, -1, -1]], dtype=torch.int32)
    """
    if isinstance(page_lists, (str, bytes)) or not isinstance(page_lists, Sequence):
        raise ValueError(f"page_lists must be a sequence of page id lists, got {type(page_lists).__name__}")
    page_lists = [_page_list(pages, f"page_lists[{i}]") for i, pages in enumerate(page_lists)]
    device = device_arg(device)
    longest = max((len(pages) for pages in page_lists), default=0)
    width = longest if width is None else int_arg(width, "width")
    max_width = optional_int_arg(max_width, "max_width")
    if width < longest:
        raise ValueError(f"width={width} is narrower than the longest page list ({longest} pages)")
    if max_width is not None and width > max_width:
        raise ValueError(f"block table width {width} is wider than allowed (max_width={max_width})")
    table = torch.full((len(page_lists), width), -1, dtype=torch.int32)
    for i, pages in enumerate(page_lists):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table.to(device)


def _page_list(pages: object, name: str) -> list[int]:
    pages = int_list(pages, name)
    if pages and max(pages) > _MAX_PAGE:
        raise ValueError(f"{name} holds page {max(pages)}, past the int32 table's {_MAX_PAGE}")
    return pages
