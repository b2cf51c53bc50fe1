"""Triton kernel that merges the split partial outputs of the sparse MLA decode by their LSEs.

Split ``i`` of a query row holds ``o_i`` (its own softmax's output, fp32) and ``lse_i`` (base
2). The row's output is ``sum_i w_i o_i / sum_i w_i`` with ``w_i = 2**(lse_i - max lse)``, its
LSE ``max lse + log2(sum_i w_i)``, returned as a natural log. Splits without a valid slot have
``lse_i = -inf`` and weigh 0; a row with none at all gets ``out = 0`` and ``lse = -inf``.
Splits are summed in index order, so the result does not depend on which program ran first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.sparse_mla.sparse_attention import LN2, to_bf16
from dsacache.ops.triton_utils import loop_bound


@triton.jit
def merge_splits_kernel(
    part_ptr,       # fp32 [rows, num_splits, H, RANK] partial outputs (contiguous)
    part_lse_ptr,   # fp32 [rows, num_splits, H] base-2 LSEs
    out_ptr,        # bf16 [rows, H, RANK] (contiguous)
    lse_ptr,        # fp32 [rows, H] natural log
    num_heads, num_splits,
    RANK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    mask = head_ok[:, None] & (offs_r < RANK)[None, :]
    first = row * num_splits

    top = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for i in range(0, loop_bound(num_splits)):
        lse_i = tl.load(part_lse_ptr + (first + i) * num_heads + heads, mask=head_ok, other=float("-inf"))
        top = tl.maximum(top, lse_i)
    top_sub = tl.where(top == float("-inf"), 0.0, top)

    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for i in range(0, loop_bound(num_splits)):
        part = (first + i) * num_heads + heads
        w = tl.exp2(tl.load(part_lse_ptr + part, mask=head_ok, other=float("-inf")) - top_sub)
        o_i = tl.load(part_ptr + part[:, None] * RANK + offs_r[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o_i
        total += w

    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(out_ptr + (row * num_heads + heads)[:, None] * RANK + offs_r[None, :], to_bf16(out), mask=mask)
    lse = tl.where(seen, (top + tl.log2(tl.where(seen, total, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + row * num_heads + heads, lse, mask=head_ok)
