"""Which indexer key cache kernel runs, and with what launch shape.

The public functions (``api.py``) validate their inputs, then call the ``launch_*`` functions
here, which pick the kernel and its configuration and set the grid. Every tuning knob is a
constant below with the reason for its value (measured on the H200 at 1M tokens unless said;
``docs/benchmarks.md`` has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dsacache.dispatch import interpreting
from dsacache.formats.key_format import MXFP4_GROUP_SIZE, IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_k_cache.dequantize import dequantize_kernel
from dsacache.ops.indexer_k_cache.gather import gather_kernel
from dsacache.ops.indexer_k_cache.store_fp8 import store_fp8_kernel
from dsacache.ops.indexer_k_cache.store_mxfp4 import store_mxfp4_kernel
from dsacache.ops.indexer_k_cache.store_mxfp4_loop import norm_store_mxfp4_loop_kernel
from dsacache.ops.triton_utils import check_launch, dependent_launch, sm_count

#: About 2K elements a program: enough bytes in flight per SM, few registers a thread.
ELEMENTS_PER_PROGRAM = 2048
#: At most this many tokens a program, however narrow the entry.
MAX_TOKENS_PER_PROGRAM = 64
#: Up to this many tokens a store's time is latency (a launch, one memory round trip, the
#: reductions): one-warp programs of SMALL_TOKENS_PER_PROGRAM tokens keep the reductions in the warp.
SMALL_BATCH = 64
SMALL_TOKENS_PER_PROGRAM = 2
#: Warps a store program past SMALL_BATCH: 2 was fastest for both formats.
STORE_WARPS = 2
#: From this many tokens the MXFP4 store gives each thread two rows (LARGE_MXFP4_TOKENS_PER_PROGRAM
#: tokens, 2 warps: fastest), and the fused store of bf16 keys runs the tile loop.
LARGE_BATCH = 32768
LARGE_MXFP4_TOKENS_PER_PROGRAM = 32
#: The tile loop: 8-token tiles in one warp (the moments' all-tokens-well-conditioned test is
#: then one warp reduction, no barrier), 20 programs an SM: fastest.
LOOP_TOKENS_PER_TILE = 8
LOOP_WARPS = 1
LOOP_PROGRAMS_PER_SM = 20
#: Gather and dequantize are streaming copies: 4 warps keep enough loads in flight.
COPY_WARPS = 4
#: Not a knob: from this many slots the MXFP4 store's page and row need 64-bit math.
SLOTS_32BIT = 2**31

#: The store kernels a :class:`StoreLaunch` can name.
STORE_KERNELS = ("fp8", "mxfp4", "mxfp4_loop")
#: The fused LayerNorm's statistics in the ``fp8`` and ``mxfp4`` kernels (``codecs.py``): "raw" (sum and
#: sum of squares in one reduction, guarded, ``rsqrt.approx``) or "two_pass" (exact). Raw runs the small
#: batches: 0.02-0.04 us faster at 1-64 tokens on an H200; its program-wide guard costs barriers in
#: multi-warp programs (8192 MXFP4 tokens 3.25 -> 4.54 us, 1M FP8 tokens 115 -> 125 us), so larger
#: batches stay two-pass (docs/benchmarks.md, "Quantize + store indexer keys").
STORE_MOMENTS = ("raw", "two_pass")


@dataclass(frozen=True)
class StoreLaunch:
    """One store launch: the kernel, ``block_t`` tokens a program (a tile, for the loop) and
    ``num_warps``; ``programs`` is the loop's grid (0: LOOP_PROGRAMS_PER_SM an SM).

    ``kernel``: ``"fp8"``; ``"mxfp4"`` (one tile of tokens a program); ``"mxfp4_loop"`` (the fused
    LayerNorm store of bf16 keys, programs looping over tiles). ``moments``: the LayerNorm
    statistics of the ``fp8`` and ``mxfp4`` kernels (``STORE_MOMENTS``; the loop has its own).
    """

    kernel: str
    block_t: int
    num_warps: int
    programs: int = 0
    moments: str = "two_pass"

    def __post_init__(self) -> None:
        check_launch(self.kernel in STORE_KERNELS, f"kernel {self.kernel!r} in {STORE_KERNELS}")
        check_launch(self.moments in STORE_MOMENTS, f"moments {self.moments!r} in {STORE_MOMENTS}")
        check_launch(self.block_t >= 1 and self.block_t & (self.block_t - 1) == 0, "block_t a power of two")


def _tokens_per_program(num_tokens: int, block: int) -> int:
    return max(1, min(triton.next_power_of_2(num_tokens), ELEMENTS_PER_PROGRAM // block, MAX_TOKENS_PER_PROGRAM))


def _bf16_pairs(k: torch.Tensor) -> bool:
    """bf16 keys whose rows load as 32-bit pairs."""
    return k.dtype == torch.bfloat16 and k.stride(1) == 1 and k.stride(0) % 2 == 0 and k.data_ptr() % 4 == 0


def _fp32_pairs(weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """fp32 LayerNorm parameters that load as 64-bit pairs."""
    return weight is not None and all(t.dtype == torch.float32 and t.data_ptr() % 8 == 0 for t in (weight, bias))


def _loop_applies(k: torch.Tensor, pages: torch.Tensor, fmt: IndexerKeyFormat,
                  weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """The tile loop's preconditions (``store_mxfp4_loop.py``)."""
    groups = fmt.scale_bytes  # one UE8M0 byte a 32-value group
    whole_groups = groups % 4 == 0 and triton.next_power_of_2(groups) == groups
    return (fmt.is_mxfp4 and _bf16_pairs(k) and _fp32_pairs(weight, bias) and whole_groups
            and pages.shape[0] * KERNEL_PAGE_SIZE < SLOTS_32BIT)


def choose_store(k: torch.Tensor, pages: torch.Tensor, fmt: IndexerKeyFormat,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> StoreLaunch:
    """The store launch for keys ``k [T, D]`` (fused LayerNorm when ``weight`` is given)."""
    num_tokens = k.shape[0]
    if num_tokens <= SMALL_BATCH:
        return StoreLaunch("mxfp4" if fmt.is_mxfp4 else "fp8", SMALL_TOKENS_PER_PROGRAM, 1, moments="raw")
    if not fmt.is_mxfp4:
        return StoreLaunch("fp8", _tokens_per_program(num_tokens, triton.next_power_of_2(fmt.head_dim)), STORE_WARPS)
    if num_tokens < LARGE_BATCH:
        block = triton.next_power_of_2(fmt.scale_bytes) * MXFP4_GROUP_SIZE  # one scale byte a group
        return StoreLaunch("mxfp4", _tokens_per_program(num_tokens, block), STORE_WARPS)
    if _loop_applies(k, pages, fmt, weight, bias):
        return StoreLaunch("mxfp4_loop", LOOP_TOKENS_PER_TILE, LOOP_WARPS)
    return StoreLaunch("mxfp4", LARGE_MXFP4_TOKENS_PER_PROGRAM, STORE_WARPS)


def launch_store(k: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor, fmt: IndexerKeyFormat,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 0.0,
                 launch: StoreLaunch | None = None) -> None:
    """Quantize ``k [T, D]`` (LayerNorm first when ``weight`` is given) into ``pages`` at ``slot_mapping``.

    ``launch`` overrides :func:`choose_store` (tests and the bench's shape sweep); its kernel's
    preconditions are checked. MXFP4 without ``weight`` is the plain quantizer, which the public
    API does not expose (MXFP4 keys are written only by the fused insert): tests pin the
    encoder with it and the bench times it.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    check_launch(pages.data_ptr() % 4 == 0 and pages.stride(0) % 4 == 0, "pages 4-byte aligned")
    check_launch(pages.stride(1) == fmt.entry_bytes and pages.stride(2) == 1, "contiguous page entries")
    launch = launch or choose_store(k, pages, fmt, weight, bias)
    check_launch(launch.kernel.startswith("mxfp4") == fmt.is_mxfp4, f"kernel {launch.kernel!r} stores {fmt.name}")
    num_slots = pages.shape[0] * KERNEL_PAGE_SIZE
    if launch.kernel == "mxfp4_loop":
        check_launch(_loop_applies(k, pages, fmt, weight, bias), "the tile loop's preconditions")
        _launch_loop(k, pages, slot_mapping, weight, bias, eps, fmt, launch)
        return
    norm = weight is not None
    args = (k, weight if norm else k, bias if norm else k, slot_mapping, pages,
            num_tokens, num_slots, k.stride(0), k.stride(1), pages.stride(0), float(eps))
    grid = (triton.cdiv(num_tokens, launch.block_t),)
    # With PDL a store's launch overlaps the kernel before it (it waits for that kernel's writes
    # before its first load): a 1-64-token store then costs about one small launch.
    pdl = {"PDL": True, "launch_pdl": True} if dependent_launch(k.device) else {}
    if launch.kernel == "fp8":
        store_fp8_kernel[grid](
            *args, D=fmt.head_dim, PAGE=KERNEL_PAGE_SIZE, NORM=norm, INTERPRET=interpreting(),
            BLOCK_T=launch.block_t, BLOCK_D=triton.next_power_of_2(fmt.head_dim), MOMENTS=launch.moments,
            num_warps=launch.num_warps, **pdl)
        return
    store_mxfp4_kernel[grid](
        *args, D=fmt.head_dim, PAGE=KERNEL_PAGE_SIZE, NORM=norm, PAIRS=_bf16_pairs(k),
        NORM_PAIRS=_fp32_pairs(weight, bias), INTERPRET=interpreting(), BLOCK_T=launch.block_t,
        BLOCK_G=triton.next_power_of_2(fmt.scale_bytes), EXACT=norm or k.dtype == torch.float32,
        SLOTS64=num_slots >= SLOTS_32BIT, MOMENTS=launch.moments, num_warps=launch.num_warps, **pdl)


def _launch_loop(k, pages, slot_mapping, weight, bias, eps, fmt, launch) -> None:
    """The fused LayerNorm + MXFP4 tile loop: ``programs`` (or LOOP_PROGRAMS_PER_SM an SM) loop over the tiles."""
    num_tokens = k.shape[0]
    programs = launch.programs or LOOP_PROGRAMS_PER_SM * (sm_count(k.device) or 4)
    grid = (min(triton.cdiv(num_tokens, launch.block_t), programs),)
    norm_store_mxfp4_loop_kernel[grid](
        k, weight, bias, slot_mapping, pages,
        num_tokens, pages.shape[0] * KERNEL_PAGE_SIZE, k.stride(0), pages.stride(0), float(eps),
        D=fmt.head_dim, PAGE=KERNEL_PAGE_SIZE, INTERPRET=interpreting(), BLOCK_T=launch.block_t,
        num_warps=launch.num_warps)


def launch_gather(pages: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                  values: torch.Tensor, scales: torch.Tensor, fmt: IndexerKeyFormat) -> None:
    """Copy each token's entry bytes into ``values [T, value_bytes]`` and ``scales [T, scale_bytes]`` (uint8)."""
    num_tokens = values.shape[0]
    if num_tokens == 0:
        return
    check_launch(values.is_contiguous() and scales.is_contiguous() and values.dtype == scales.dtype == torch.uint8,
                 "contiguous uint8 gather outputs")
    check_launch(tuple(values.shape[1:]) == (fmt.value_bytes,) and tuple(scales.shape[1:]) == (fmt.scale_bytes,),
                 "gather outputs of the format's value and scale bytes")
    check_launch(pages.stride(1) == fmt.entry_bytes and pages.stride(2) == 1, "contiguous page entries")
    check_launch(block_table.stride(1) == 1 and cu_seqlens.is_contiguous(), "contiguous block_table rows and cu_seqlens")
    num_reqs = cu_seqlens.shape[0] - 1
    block_v = triton.next_power_of_2(fmt.value_bytes)
    block_t = _tokens_per_program(num_tokens, block_v)
    gather_kernel[(triton.cdiv(num_tokens, block_t),)](
        pages, block_table, cu_seqlens, values, scales,
        num_tokens, num_reqs, pages.shape[0], block_table.shape[1], block_table.stride(0), pages.stride(0),
        SEARCH_STEPS=max(1, num_reqs).bit_length(), VALUE_BYTES=fmt.value_bytes, SCALE_BYTES=fmt.scale_bytes,
        PAGE=KERNEL_PAGE_SIZE, BLOCK_T=block_t, BLOCK_V=block_v,
        BLOCK_S=triton.next_power_of_2(fmt.scale_bytes), num_warps=COPY_WARPS,
    )


def launch_dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: IndexerKeyFormat) -> None:
    """Decode contiguous ``values``/``scales`` rows (uint8 / fp32 views) into ``out [T, D]`` fp32."""
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return
    check_launch(values.is_contiguous() and scales.is_contiguous() and out.is_contiguous(),
                 "contiguous values, scales and output")
    block_d = max(triton.next_power_of_2(fmt.head_dim), MXFP4_GROUP_SIZE)
    block_t = _tokens_per_program(num_tokens, block_d)
    dequantize_kernel[(triton.cdiv(num_tokens, block_t),)](
        values, scales, out, num_tokens, D=fmt.head_dim, MXFP4=fmt.is_mxfp4,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=COPY_WARPS)
