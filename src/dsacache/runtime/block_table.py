"""Kernel-page block tables: what paged kernels see instead of rows.

A row of ``block_size`` tokens is ``pages_per_row`` kernel pages of 64 tokens; page ``j``
of row ``r`` is kernel page ``r * pages_per_row + j`` (``docs/layout.md``). A request's
block table is the concatenation of its rows' pages, cut to the pages its tokens use,
and ``-1``-padded to the table width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kernel_pages(rows: Sequence[int], pages_per_row: int, num_pages: int) -> list[int]:
    """The first ``num_pages`` kernel page ids of a request that owns ``rows`` in order."""
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
    longest = max((len(pages) for pages in page_lists), default=0)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width={width} is narrower than the longest page list ({longest} pages)")
    if max_width is not None and width > max_width:
        raise ValueError(f"block table width {width} is wider than allowed (max_width={max_width})")
    table = torch.full((len(page_lists), width), -1, dtype=torch.int32)
    for i, pages in enumerate(page_lists):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table.to(device)
