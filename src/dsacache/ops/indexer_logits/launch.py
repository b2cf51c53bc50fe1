"""Which kernel computes the indexer logits, and with which launch settings.

Paged decode: on Hopper the Gluon kernels (``decode_gluon``) where they apply, FP8 and MXFP4
keys at every next_n; elsewhere (other GPUs, other shapes, the CPU interpreter) the Triton
kernel (``decode_triton``). Ragged prefill: the Triton kernel
(``prefill_triton``). :func:`decode_kernel` says which one a call takes. ``config`` on the
launchers overrides the settings below for one call (tests and ``dsacache.bench logits
--sweep``); the settings were tuned on an H200 (``docs/benchmarks.md``).
"""

from __future__ import annotations

import torch
import triton

from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_logits.decode_triton import paged_decode_kernel
from dsacache.ops.indexer_logits.mxfp4_e4m3 import PTX_AVAILABLE
from dsacache.ops.indexer_logits.prefill_triton import ragged_prefill_kernel
from dsacache.ops.triton_utils import check_launch, resident_programs, sm_count

#: Paged decode settings (a tile is one 64-token page).
DECODE_CONFIG = {
    "TILES": 8,            # pages a program (Triton kernel): the fastest in the H200 sweep (halved on short grids)
    "triton_min_programs_per_sm": 4,  # Triton decode: fewer pages a program (down to 2) until the grid has this
                                      # many programs an SM (B = 32 at 8K: 4 pages 9.1 us, 8 10.1, 2 9.9; at 8 a
                                      # program, which picks 2, H = 64 was slower)
    "num_warps": 4,        # the MXFP4 table decode keeps its keys in registers only at 16 * num_warps tokens a tile
    "num_stages": 2,       # the pipeliner prefetches the next page's key values
    "maxnreg": 64,         # register cap with one query row (NVIDIA): one more program an SM
    "maxnreg_rows": 96,    # the cap with several rows: 64 spills there
    "maxnreg_cols": 64,    # caps apply up to this many product columns (next_n rounded up, times H); wider got slower
    "split_rows": {2: 64},  # next_n -> fewest heads at which a product a row (fewer accumulators) was faster
    "kernel": {1: "gluon", 2: "gluon", 3: "gluon", 4: "gluon"},  # FP8 keys, next_n -> kernel (Triton off Hopper)
    # FP8 Gluon kernel, by product columns (the rows of its score products, gluon_product_rows, times H): (at most
    # this many columns, pages a program, pages in its TMA ring, one wave). Up to 64 columns a
    # 2-page ring leaves room for 8-10 programs an SM, and 16 pages a program were the fastest (or
    # within 0.7 us of it) at every measured shape; at 128 columns the registers allow 5 programs
    # an SM, a grid of 2-3 waves of 16-page programs lost 5-20 % against one wave of longer
    # programs ("one wave": ``one_wave_tiles``), and a 2-page ring was 1-6 % faster than 3 where the
    # grid is one wave, level at 128K; 256 columns as measured before (docs/benchmarks.md, "Paged
    # decode logits").
    "fp8_gluon_shapes": ((64, 16, 2, False), (128, 16, 2, True), (256, 32, 4, False)),
    "gluon_row_split": {3: (2, 1)},  # both Gluon decodes, next_n -> query rows of two score products: next_n 3
                                     # as 2 + 1 rows (3 H columns) instead of one product of 4 (4 H columns)
    "fp8_gluon_tiles": None,   # overrides the pages a program of fp8_gluon_shapes (sweeps, tests)
    "fp8_gluon_stages": None,  # overrides the ring of fp8_gluon_shapes
    "gluon_min_programs_per_sm": 2,  # both Gluon decodes: fewer pages a program (down to 4) until the grid has this
                                     # many programs an SM (B = 32 at 8K: 128 programs of 32 pages took 1.5x the
                                     # time of 512 of 8)
}
#: What MXFP4 keys change in DECODE_CONFIG (tuned on their own).
MXFP4_DECODE_CONFIG: dict = {
    "TILES": 16,           # pages a program (Triton, and Gluon below 128 product columns: 8 and 32 were slower
                           # there at the target shapes; halved on short grids)
    "gluon_wide_tiles": 32,  # pages a program of the Gluon kernel at 128 or more product columns (H = 64 with a
                             # draft row): 1-8 % faster than 16 at every measured context
    "maxnreg_cols": 32,    # the cap helps at H = 32 and hurts at H = 64
    "maxnreg_rows": None,  # no cap with several rows
    "kernel": "gluon",     # Gluon on Hopper at every next_n: far fewer instructions a page than the Triton decode
    "gluon_pair_columns": 32,  # Gluon: two pages an iteration up to this many product columns (H = 32, next_n 1):
                               # ptxas then keeps no per-page register copies, 169 instead of 182 instructions a
                               # page and warp at 64 registers (8 programs an SM); wider products took 10-12
                               # registers more, a program an SM fewer, and were slower (docs/benchmarks.md)
    "gluon_flag_columns": 192,  # Gluon, one page an iteration up to this many product columns: a dropped group's
                                # tables zeroed by a 0/1 multiply (FMA pipe) instead of selects (ALU pipe), 1-3 %
                                # faster; the selects elsewhere, where they need fewer registers (two pages an
                                # iteration 63 against 72, 256 columns 173 against 180) and were faster
}
#: Ragged prefill settings.
PREFILL_CONFIG = {
    "BLOCK_N": 64,         # keys a tile: the MXFP4 table decode keeps them in registers with 4 warps
    "TILES": 8,            # tiles a program, as the decode: long rows of tiles amortise the query load
    "ROWS": 4,             # query rows a program: each key tile is read once for all of them
    "num_warps": 4,        # what BLOCK_N = 64 asks of the table decode
    "num_stages": 3,       # the pipeliner prefetches two tiles of keys ahead
}


def _words_aligned(values: torch.Tensor) -> bool:
    """Whether MXFP4 key rows can be read as 32-bit words (the table decode): 4-byte aligned,
    as cache pages and fresh tensors always are; otherwise the byte-wise decode runs."""
    return values.data_ptr() % 4 == 0 and values.stride(0) % 4 == 0


def _split_rows(cfg: dict, next_n: int, num_heads: int) -> bool:
    """Whether the Triton decode runs one product per query row (``cfg["split_rows"]``: next_n ->
    the fewest heads for it). The kernel handles 2-4 rows that way."""
    least = (cfg.get("split_rows") or {}).get(next_n)
    return least is not None and 2 <= next_n <= 4 and num_heads >= least


def next_n_kernel(choice, next_n: int) -> str:
    """The kernel a config entry picks for next_n: a name, or a dict next_n -> name ("triton" if absent)."""
    if isinstance(choice, dict):
        return choice.get(next_n, "triton")
    return choice or "triton"


def _gluon_applies(q: torch.Tensor, values: torch.Tensor) -> bool:
    """What both Gluon decodes need: a Hopper GPU, D = 128, 16-128 heads, at most 256 product
    columns (next_n rounded up to a power of two, times H), at least one 16-byte aligned key page."""
    if not PTX_AVAILABLE or not q.is_cuda:
        return False
    batch, next_n, num_heads, head_dim = q.shape
    return (torch.cuda.get_device_capability(q.device)[0] == 9 and head_dim == 128
            and num_heads in (16, 32, 64, 128) and triton.next_power_of_2(next_n) * num_heads <= 256
            and values.shape[0] > 0 and values.data_ptr() % 16 == 0 and values.stride(0) % 16 == 0)


def _pool_pages(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether MXFP4 views have the pool's page layout the Gluon kernel reads: each page's scales
    right after its values (as ``mxfp4_page_views`` cuts them)."""
    return (scales.data_ptr() == values.data_ptr() + values.shape[1] * values.shape[2]
            and scales.stride(0) == values.stride(0) and scales.stride(1) == scales.shape[2])


def _decode_config(fmt: IndexerKeyFormat, config: dict | None) -> dict:
    return {**DECODE_CONFIG, **(MXFP4_DECODE_CONFIG if fmt.is_mxfp4 else {}), **(config or {})}


def _choose_decode(cfg: dict, q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                   fmt: IndexerKeyFormat) -> str:
    if next_n_kernel(cfg.get("kernel"), q.shape[1]) != "gluon" or not _gluon_applies(q, values):
        return "triton"
    if fmt.is_mxfp4 and not _pool_pages(values, scales):
        return "triton"
    return "gluon"


def decode_kernel(q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, fmt: IndexerKeyFormat,
                  config: dict | None = None) -> str:
    """Which kernel ``launch_paged_decode`` runs for these inputs: "gluon" or "triton" (for reports)."""
    return _choose_decode(_decode_config(fmt, config), q, values, scales, fmt)


def launch_paged_decode(
    q: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    fmt: IndexerKeyFormat,
    config: dict | None = None,
) -> None:
    """Fill ``out [B*next_n, max_model_len]``; ``values``/``scales`` are the page views of the format
    ``fmt``, ``context_lens`` is per row ``[B, next_n]`` or per request ``[B]`` (unclamped)."""
    cfg = _decode_config(fmt, config)
    check_launch(q.is_contiguous() and weights.is_contiguous() and context_lens.is_contiguous(),
                 "q, weights and context_lens contiguous")
    check_launch(context_lens.dtype == torch.int32 and context_lens.dim() in (1, 2),
                 "context_lens int32 [B] or [B, next_n]")
    check_launch(values.stride()[1:] == (values.shape[2], 1) and block_table.stride(1) == 1,
                 "contiguous page rows and block_table rows")
    check_launch(out.is_contiguous(), "contiguous out")
    args = (q, weights, context_lens, values, scales, block_table, out, cfg)
    if _choose_decode(cfg, q, values, scales, fmt) == "triton":
        _launch_triton_decode(*args, fmt)
    elif fmt.is_mxfp4:
        _launch_gluon_mxfp4_decode(*args)
    else:
        _launch_gluon_fp8_decode(*args)


def _launch_triton_decode(q, weights, context_lens, values, scales, block_table, out, cfg, fmt) -> None:
    batch, next_n, num_heads, head_dim = q.shape
    max_model_len = out.shape[1]
    rows = triton.next_power_of_2(next_n)
    cap = cfg.get("maxnreg") if rows == 1 else cfg.get("maxnreg_rows")
    capped = cap and PTX_AVAILABLE and rows * num_heads <= cfg.get("maxnreg_cols", 0)
    extra = {"maxnreg": cap} if capped else {}
    tiles, runs = _page_runs(q, max_model_len, cfg["TILES"], cfg["triton_min_programs_per_sm"], 2)
    paged_decode_kernel[(runs, batch)](
        q, weights, context_lens, values, scales, block_table, out,
        values.shape[0], block_table.shape[1], block_table.stride(0),
        values.stride(0), scales.stride(0), max_model_len, out.stride(0),
        NEXT_N=next_n, ROWS=rows, H=num_heads, D=head_dim, PER_ROW=context_lens.dim() == 2,
        MXFP4=fmt.is_mxfp4, ALIGNED=_words_aligned(values), VALUE_BYTES=fmt.value_bytes,
        SCALES_PER_TOKEN=fmt.scale_bytes // scales.element_size(),
        BLOCK_N=KERNEL_PAGE_SIZE, TILES=tiles, SPLIT=_split_rows(cfg, next_n, num_heads),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
    )


def pages_per_program(tiles: int, batch: int, max_model_len: int, num_sms: int | None, min_per_sm: int,
                      least: int) -> int:
    """Pages a program of a decode kernel: ``tiles``, halved (down to ``least``) while the grid, a
    program per request and run of pages, would have fewer than ``min_per_sm`` programs an SM. A
    program scores its pages one after another, so a short grid leaves SMs idle."""
    if num_sms is None:
        return tiles
    while tiles > least and batch * triton.cdiv(max_model_len, KERNEL_PAGE_SIZE * tiles) < min_per_sm * num_sms:
        tiles //= 2
    return tiles


def _page_runs(q: torch.Tensor, max_model_len: int, tiles: int, min_per_sm: int, least: int) -> tuple[int, int]:
    """(pages a program, programs a request) of a decode launch on ``q``'s device (``pages_per_program``)."""
    tiles = pages_per_program(tiles, q.shape[0], max_model_len, sm_count(q.device), min_per_sm, least)
    return tiles, triton.cdiv(max_model_len, KERNEL_PAGE_SIZE * tiles)


def gluon_product_rows(cfg: dict, next_n: int) -> tuple[int, int]:
    """(query rows of the first score product, of the second; 0: none) of a Gluon decode. A
    product's rows are a power of two (a tensor's shape): next_n rounded up in one product, or
    the split ``gluon_row_split`` gives, the keys of a page multiplied twice."""
    return (cfg["gluon_row_split"] or {}).get(next_n, (triton.next_power_of_2(next_n), 0))


def _launch_gluon_mxfp4_decode(q, weights, context_lens, values, scales, block_table, out, cfg) -> None:
    """``decode_gluon.paged_decode_mxfp4_kernel``: reads whole pages (values, then scales);
    ``gluon_wide_tiles`` or ``TILES`` pages a program (fewer on a short grid)."""
    from dsacache.ops.indexer_logits.decode_gluon import paged_decode_mxfp4_kernel

    batch, next_n, num_heads, head_dim = q.shape
    max_model_len = out.shape[1]
    rows, rows2 = gluon_product_rows(cfg, next_n)
    columns = (rows + rows2) * num_heads
    pairs = columns <= cfg["gluon_pair_columns"]
    tiles, runs = _page_runs(q, max_model_len, cfg["gluon_wide_tiles"] if columns >= 128 else cfg["TILES"],
                             cfg["gluon_min_programs_per_sm"], 4)
    paged_decode_mxfp4_kernel[(runs, batch)](
        q, weights, context_lens, values, block_table, out,
        values.shape[0], block_table.shape[1], block_table.stride(0), values.stride(0), max_model_len,
        out.stride(0), -1, NEXT_N=next_n, ROWS=rows, H=num_heads,
        PER_ROW=context_lens.dim() == 2, TILES=tiles, ROWS2=rows2,
        PAIRS=pairs, FLAG=not pairs and columns <= cfg["gluon_flag_columns"], num_warps=4,
    )


def fp8_gluon_settings(cfg: dict, columns: int) -> tuple[int, int, bool]:
    """(pages a program, pages in the TMA ring, one wave) of the FP8 Gluon decode for a product of
    ``columns`` columns: the first entry of ``cfg["fp8_gluon_shapes"]`` that takes that many
    (the last one for any wider), pages and ring overridden by ``fp8_gluon_tiles`` / ``_stages``."""
    for most, tiles, stages, one_wave in cfg["fp8_gluon_shapes"]:
        if columns <= most:
            break
    return cfg["fp8_gluon_tiles"] or tiles, cfg["fp8_gluon_stages"] or stages, one_wave


def one_wave_tiles(tiles: int, batch: int, max_model_len: int, resident: int | None, most: int) -> int:
    """Pages a program: the fewest of ``tiles``, ``2 tiles``, ... up to ``most`` whose grid (a
    program per request and run of pages) fits in one wave of ``resident`` programs, else
    ``tiles``. A grid of a few waves waits on its last, part-filled one; many short programs or
    one wave do not."""
    t = tiles
    while resident is not None and t <= most:
        if batch * triton.cdiv(max_model_len, KERNEL_PAGE_SIZE * t) <= resident:
            return t
        t *= 2
    return tiles


#: Resident programs of the FP8 Gluon decode by (device, pages a program, settings).
_FP8_GLUON_RESIDENT: dict[tuple, int | None] = {}


def _launch_gluon_fp8_decode(q, weights, context_lens, values, scales, block_table, out, cfg) -> None:
    """``decode_gluon.paged_decode_fp8_kernel``: key pages by TMA (a descriptor over the pool's
    pages), pages a program and ring from ``fp8_gluon_settings`` (fewer pages on a short grid;
    where the settings say, more if that makes the grid one wave)."""
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsacache.ops.indexer_logits.decode_gluon import paged_decode_fp8_kernel

    batch, next_n, num_heads, head_dim = q.shape
    max_model_len = out.shape[1]
    rows, rows2 = gluon_product_rows(cfg, next_n)
    tiles, stages, one_wave = fp8_gluon_settings(cfg, (rows + rows2) * num_heads)
    tiles, runs = _page_runs(q, max_model_len, tiles, cfg["gluon_min_programs_per_sm"], 4)
    k_desc = TensorDescriptor(values, list(values.shape), list(values.stride()), [1, KERNEL_PAGE_SIZE, head_dim],
                              NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
    args = (q, weights, context_lens, k_desc, scales, block_table, out, values.shape[0], block_table.shape[1],
            block_table.stride(0), scales.stride(0), max_model_len, out.stride(0))
    consts = dict(NEXT_N=next_n, ROWS=rows, ROWS2=rows2, H=num_heads, PER_ROW=context_lens.dim() == 2, STAGES=stages,
                  num_warps=4)
    if one_wave:
        # Programs resident at once, from the kernel compiled with these settings (the pages a
        # program change only its block-table buffer, a few hundred bytes of shared memory), once
        # a device and setting.
        key = (q.device, tiles, *consts.values())
        if key not in _FP8_GLUON_RESIDENT:
            compiled = paged_decode_fp8_kernel.warmup(*args, grid=(runs, batch), TILES=tiles, **consts)
            _FP8_GLUON_RESIDENT[key] = resident_programs(compiled, q.device)
        tiles = one_wave_tiles(tiles, batch, max_model_len, _FP8_GLUON_RESIDENT[key], 64)
        runs = triton.cdiv(max_model_len, KERNEL_PAGE_SIZE * tiles)
    paged_decode_fp8_kernel[(runs, batch)](*args, TILES=tiles, **consts)


def launch_ragged_prefill(
    q: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    k_values: torch.Tensor,
    k_scales: torch.Tensor,
    out: torch.Tensor,
    fmt: IndexerKeyFormat,
    config: dict | None = None,
) -> None:
    """Fill ``out [M, N]`` from contiguous keys of the format ``fmt``."""
    cfg = {**PREFILL_CONFIG, **(config or {})}
    num_rows, num_heads, head_dim = q.shape
    check_launch(q.is_contiguous() and weights.is_contiguous() and out.is_contiguous(), "q, weights and out contiguous")
    check_launch(k_values.is_contiguous() and k_scales.is_contiguous(), "k_values and k_scales contiguous")
    num_keys = out.shape[1]
    grid = (triton.cdiv(num_keys, cfg["BLOCK_N"] * cfg["TILES"]), triton.cdiv(num_rows, cfg["ROWS"]))
    ragged_prefill_kernel[grid](
        q, weights, ks, ke, k_values, k_scales, out, num_rows, num_keys, out.stride(0),
        ROWS=cfg["ROWS"], H=num_heads, D=head_dim, MXFP4=fmt.is_mxfp4, ALIGNED=_words_aligned(k_values),
        VALUE_BYTES=fmt.value_bytes, SCALES_PER_TOKEN=fmt.scale_bytes // k_scales.element_size(),
        BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
