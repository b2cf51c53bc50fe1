"""Request positions -> cache slots through the block table (one program a row and column block).

The block-table lookup is ``triton_utils.block_table_page``, the rule every paged kernel follows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.triton_utils import block_table_page


@triton.jit
def positions_to_slots_kernel(
    pos_ptr,          # [R, K] int32
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [R, K] int32
    num_cols, pos_stride, bt_stride, max_blocks, num_pages,
    NEXT_N: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < num_cols
    pos = tl.load(pos_ptr + row.to(tl.int64) * pos_stride + cols, mask=in_row, other=-1)
    # pos // PAGE truncates towards 0: a negative position is ruled out by ``live``, not by its block
    page, ok = block_table_page(bt_ptr + (row // NEXT_N).to(tl.int64) * bt_stride, pos // PAGE, pos >= 0, max_blocks,
                                num_pages)
    slots = tl.where(ok, page * PAGE + pos % PAGE, -1)
    tl.store(out_ptr + row.to(tl.int64) * num_cols + cols, slots, mask=in_row)
