"""Launcher of the MLA latent store kernel: strides, the grid and its configuration."""

from __future__ import annotations

import torch
import triton

from dsacache.formats.mla_entry import MlaEntryFormat
from dsacache.formats.sizes import DS_MLA_TILE, KERNEL_PAGE_SIZE
from dsacache.ops.mla_cache.store import store_mla_kernel
from dsacache.ops.triton_utils import INTERPRET, check_launch

KINDS = {"bfloat16": 0, "fp8": 1, "fp8_ds_mla": 2}

#: Tokens a program: 4 rows of 512 values keep ~8 values a thread at 4 warps, enough loads in flight.
TOKENS_PER_PROGRAM = 4
NUM_WARPS = 4


def launch_store_mla(kv_c: torch.Tensor, k_pe: torch.Tensor | None, pages: torch.Tensor,
                     slot_mapping: torch.Tensor, fmt: MlaEntryFormat, k_scale: torch.Tensor | None) -> None:
    """Run :func:`store_mla_kernel` over every token (inputs validated by the public function)."""
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return
    check_launch(pages.stride(1) == fmt.entry_bytes and pages.stride(2) == 1, "MLA pages are [P, 64, entry] rows")
    pe = k_pe if k_pe is not None else kv_c
    scale = k_scale if k_scale is not None else slot_mapping  # never read unless fp8
    grid = (triton.cdiv(num_tokens, TOKENS_PER_PROGRAM),)
    store_mla_kernel[grid](
        kv_c, pe, slot_mapping, scale, pages,
        num_tokens, pages.shape[0] * KERNEL_PAGE_SIZE, kv_c.stride(0), kv_c.stride(1), pe.stride(0), pe.stride(1),
        pages.stride(0),
        RANK=fmt.kv_lora_rank, ROPE=fmt.rope_dim, ENTRY=fmt.entry_bytes, KIND=KINDS[fmt.kind],
        PAGE=KERNEL_PAGE_SIZE, TILE=DS_MLA_TILE, BLOCK_T=TOKENS_PER_PROGRAM,
        BLOCK_R=triton.next_power_of_2(fmt.kv_lora_rank),
        BLOCK_G=triton.next_power_of_2(max(fmt.kv_lora_rank // DS_MLA_TILE, 1)),
        BLOCK_P=triton.next_power_of_2(max(fmt.rope_dim, 1)),
        INTERPRET=INTERPRET, num_warps=NUM_WARPS,
    )
