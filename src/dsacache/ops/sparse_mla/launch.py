"""Which kernel and settings the sparse MLA decode runs with, and their launch.

Two kernels, one grid: one program attends one query row with one block of ``BH`` heads over
one split of its top-k slots; when a row's slots are split over several programs,
``merge_splits`` combines their partial outputs by LSE. The Triton kernel
(``sparse_attention``) runs everywhere; its head block is the smallest of 16, 32, 64 that
holds the heads (``tl.dot`` needs 16 rows; 12 heads pay for 16, not 64), more than 64 heads
take several blocks. On Hopper, 656-B ``fp8_ds_mla`` entries run warp-specialized Gluon
kernels: up to 16 heads ``decode_gluon16`` (the slots as the wgmma M, 16 heads its N: K3.1's
12 heads a rank pay for 16), more than 32 heads ``decode_gluon`` (64 heads a program).
:func:`decode_kernel` says which one a call takes. ``config`` on
:func:`launch_sparse_mla_decode` overrides any setting for one call (tests,
``dsacache.bench mla --sweep``); ``config["kernel"]`` forces ``"triton"``, ``"gluon"`` or
``"gluon16"``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from dsacache.dispatch import interpreting
from dsacache.formats.mla_entry import MlaEntryFormat
from dsacache.formats.sizes import DS_MLA_TILE, KERNEL_PAGE_SIZE
from dsacache.ops.sparse_mla.merge_splits import merge_splits_kernel
from dsacache.ops.sparse_mla.sparse_attention import sparse_mla_attention_kernel
from dsacache.ops.triton_utils import check_launch, sm_count

KINDS = {"bfloat16": 0, "fp8": 1, "fp8_ds_mla": 2}

#: Settings by head block (``KIND_CONFIGS`` below overrides them for one entry kind). Each compiles for sm_90 without register
#: spills (the compile test). For 32 and 64 heads (8 warps, 150-255 registers a thread: one program
#: an SM), num_stages 5 is what gives the gathered entries two shared-memory buffers (the pipeliner
#: splits the stages between the slot load and the gather it feeds), so the next step's entries
#: arrive while this step computes.
CONFIGS = {
    # 16 heads: mma.sync; 32 slots a step, 4 warps at 255 registers, so two programs share an SM and
    # one's gathers overlap the other's products. Measured on the H200 at B=64, s_q 1 and 2, 12 heads
    # (docs/benchmarks.md): 1.5x the 8-warp, 5-stage setting; fewer slots or more stages, warps or
    # splits were all slower.
    16: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2},
    # 32 heads: mma.sync; 16 slots a step (at 32 the doubled accumulator spills).
    32: {"BLOCK_N": 16, "num_warps": 8, "num_stages": 5, "programs_per_sm": 1},
    # 64 heads: wgmma; 8 warps hold the [64, 512] fp32 accumulator at 128 registers a thread; 16
    # slots a step (32 spill 60 B).
    64: {"BLOCK_N": 16, "num_warps": 8, "num_stages": 5, "programs_per_sm": 1},
}
#: Where an entry kind needs other settings: per-tensor ``fp8`` entries at 16 heads spill 16 bytes at
#: 4 warps (their rope part is converted too), so they keep 8 warps and 5 stages.
KIND_CONFIGS = {("fp8", 16): {"num_warps": 8, "num_stages": 5, "programs_per_sm": 1}}
#: The Gluon kernel's settings: one program an SM (12 warps, 225 KB of shared memory), 64 heads a program.
GLUON_CONFIG = {
    "BLOCK_N": 64,         # slots a tile: a 64-wide score wgmma reads the queries once per 64 keys (32: smem-bound)
    "stages": 2,           # tiles in the ring: 2 x 72 KB beside 72 KB of queries fill the 227 KB a block may take
    "l2_ahead": 2,         # the value warpgroup bulk-prefetches into L2 the entries l2_ahead + 1 tiles ahead (0: off;
                           # on the H200 2 and 1 are 7-8 % faster than 0, 2 by up to 1 % more)
    "gather_regs": 128,    # the gather warpgroup's registers: two 16-slot groups of entries in flight (with the
                           # prefetch on, ptxas spills one of them, stored and loaded once a tile)
    "value_regs": 160,     # the value warpgroup's: its [64, 256] fp32 accumulator (128) and the products, no spills
    "maxnreg": 168,        # 12 warps x 168 = the register file; the score warpgroup gets the rest (216: its two
                           # value accumulators and the scores in flight together, no spills)
    "programs_per_sm": 1,
}
#: The 16-head Gluon kernel's settings: one program an SM (12 warps, 173 KB of shared memory); its tiles are
#: 64 slots (the wgmma M) in a two-stage ring, one gatherer warpgroup a stage.
GLUON16_CONFIG = {
    "BLOCK_N": 64,
    "l2_ahead": 1,         # each gatherer bulk-prefetches its next tile's entries into L2 (0: off)
    "gather_regs": 152,    # each gatherer's registers: a 64-slot tile's codes, scales and rope part in flight
    "maxnreg": 168,        # 12 warps x 168 = the register file; the attender gets the rest (200)
    "programs_per_sm": 1,
}
#: Most heads the 16-head Gluon kernel takes.
GLUON16_HEADS = 16
#: Slot counts a Gluon tile may take (its gatherer works 32 slots at a time).
GLUON_BLOCK_N = (32, 64)
#: Steps ahead whose entries the Triton kernel bulk-prefetches into L2 (0: none; a sweep option: 2 steps
#: ahead were 7-12 % slower at 12 heads on the H200, the slot loads it needs stall the step).
TRITON_PREFETCH = 0
#: Latent chunks the kernel holds an accumulator for, and the rank they cover at 128 values a chunk.
MAX_CHUNKS = 4
MAX_RANK = MAX_CHUNKS * DS_MLA_TILE
#: Most programs one row's slots are split over (the merge reads every split's partial output).
MAX_SPLITS = 16
#: What a second launch (the merge) costs, in steps of BLOCK_N slots of one program.
MERGE_COST_STEPS = 4
#: Heads a merge program and its warps (a [4, 512] fp32 accumulator: 16 values a thread).
MERGE_HEADS = 4
MERGE_WARPS = 4


def head_block(num_heads: int) -> int:
    """Heads a program attends: the smallest of 16, 32, 64 holding ``num_heads``, else 64."""
    return min(64, max(16, triton.next_power_of_2(num_heads)))


def choose_splits(rows: int, head_blocks: int, topk: int, block_n: int, slots_on_device: int | None) -> int:
    """Programs each row's slots are split over: the fewest waves of programs times slot steps a
    program, plus the merge launch when split; 1 where the device is unknown (the interpreter)."""
    if slots_on_device is None or rows * head_blocks == 0:
        return 1
    steps = math.ceil(topk / block_n)

    def cost(splits: int) -> int:
        waves = math.ceil(rows * head_blocks * splits / slots_on_device)
        return waves * math.ceil(steps / splits) + (MERGE_COST_STEPS if splits > 1 else 0)

    return min(range(1, min(MAX_SPLITS, steps) + 1), key=lambda s: (cost(s), s))


@functools.lru_cache(maxsize=None)
def _gluon_available() -> bool:
    if interpreting() or torch.version.hip is not None:
        return False
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


def _gluon_supports(q: torch.Tensor, pages: torch.Tensor, fmt: MlaEntryFormat) -> bool:
    """What the Gluon kernel needs: a Hopper GPU, 656-B fp8_ds_mla entries (512 + 64), 16-byte aligned
    pages (its 16-byte gathers and L2 prefetches). It takes 64 heads a program, fewer padded."""
    return (q.is_cuda and _gluon_available() and torch.cuda.get_device_capability(q.device)[0] == 9
            and fmt.kind == "fp8_ds_mla" and (fmt.kv_lora_rank, fmt.rope_dim) == (512, 64)
            and pages.data_ptr() % 16 == 0 and pages.stride(0) % 16 == 0)


def _can_prefetch(pages: torch.Tensor) -> bool:
    """The L2 bulk prefetch needs PTX (not the interpreter) and 16-byte aligned entries (pool pages are)."""
    return not interpreting() and pages.data_ptr() % 16 == 0 and pages.stride(0) % 16 == 0


def decode_kernel(q: torch.Tensor, pages: torch.Tensor, fmt: MlaEntryFormat, config: dict | None = None) -> str:
    """Which kernel :func:`launch_sparse_mla_decode` runs. Where the Gluon kernels are supported: "gluon16"
    up to 16 heads, "gluon" above 32 (17-32 heads would pay for 64 there, more than the Triton kernel's 32
    cost); "triton" elsewhere. ``config["kernel"]`` forces one."""
    choice = (config or {}).get("kernel", "auto")
    if choice not in ("auto", "triton", "gluon", "gluon16"):
        raise ValueError(f"config kernel={choice!r}; allowed: auto, triton, gluon, gluon16")
    supported = _gluon_supports(q, pages, fmt)
    if choice in ("gluon", "gluon16") and not supported:
        raise ValueError("the Gluon sparse MLA decode needs a Hopper GPU and 656-B fp8_ds_mla pages (512 + 64, "
                         "16-byte aligned)")
    if choice == "gluon16" and q.shape[2] > GLUON16_HEADS:
        raise ValueError(f"the 16-head Gluon kernel takes at most {GLUON16_HEADS} heads, got H={q.shape[2]}")
    if choice == "auto":
        if not supported or GLUON16_HEADS < q.shape[2] <= 32:
            return "triton"
        return "gluon16" if q.shape[2] <= GLUON16_HEADS else "gluon"
    return choice


def triton_settings(bh: int, kind: str) -> dict:
    """The Triton kernel's default settings for a head block of ``bh`` heads on ``kind`` entries."""
    return {"BH": bh, "prefetch": TRITON_PREFETCH, **CONFIGS[bh], **KIND_CONFIGS.get((kind, bh), {})}


def decode_config(q: torch.Tensor, topk: int, config: dict | None, kernel: str, kind: str) -> dict:
    """The settings a call of ``kernel`` on ``kind`` entries runs with: head block, its defaults, the
    split count, overrides."""
    num_heads = q.shape[2]
    config = {k: v for k, v in (config or {}).items() if k != "kernel"}
    if kernel == "gluon16":
        cfg = {"BH": GLUON16_HEADS, **GLUON16_CONFIG, **config}
        if cfg["BH"] != GLUON16_HEADS or cfg["BLOCK_N"] != 64:
            raise ValueError(f"the 16-head Gluon kernel takes BH {GLUON16_HEADS} and BLOCK_N 64, got {cfg['BH']}, "
                             f"{cfg['BLOCK_N']}")
    elif kernel == "gluon":
        cfg = {"BH": 64, **GLUON_CONFIG, **config}
        if cfg["BH"] != 64 or cfg["BLOCK_N"] not in GLUON_BLOCK_N:
            raise ValueError(f"the Gluon kernel takes BH 64 and BLOCK_N in {GLUON_BLOCK_N}, got {cfg['BH']}, "
                             f"{cfg['BLOCK_N']}")
    else:
        bh = config.get("BH", head_block(num_heads))
        cfg = {**triton_settings(bh, kind), **config}
    cfg["kernel"] = kernel
    if "splits" not in cfg:
        sms = sm_count(q.device)
        slots = None if sms is None else sms * cfg["programs_per_sm"]
        cfg["splits"] = choose_splits(q.shape[0] * q.shape[1], triton.cdiv(num_heads, cfg["BH"]), topk,
                                      cfg["BLOCK_N"], slots)
    return cfg


def launch_sparse_mla_decode(q: torch.Tensor, pages: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                             fmt: MlaEntryFormat, k_scale: torch.Tensor | None, out: torch.Tensor,
                             lse: torch.Tensor, config: dict | None = None) -> None:
    """Fill ``out`` and ``lse`` (inputs validated by the public function; ``out``/``lse`` contiguous)."""
    batch, s_q, num_heads, _ = q.shape
    rows, topk = batch * s_q, indices.shape[2]
    if rows == 0:
        return
    check_launch(triton_supports(fmt), f"kv_lora_rank <= {MAX_RANK}")
    check_launch(out.is_contiguous() and lse.is_contiguous(), "contiguous out and lse")
    check_launch(pages.stride(1) == fmt.entry_bytes and pages.stride(2) == 1, "MLA pages are [P, 64, entry] rows")
    q = q if q.stride(3) == 1 else q.contiguous()
    indices = indices if indices.stride(2) == 1 else indices.contiguous()
    kernel = decode_kernel(q, pages, fmt, config)
    cfg = decode_config(q, topk, config, kernel, fmt.kind)
    if not _can_prefetch(pages):
        cfg["prefetch"] = 0
    bh, block_n = cfg["BH"], cfg["BLOCK_N"]
    keys_per_split = triton.cdiv(triton.cdiv(topk, cfg["splits"]), block_n) * block_n
    splits = triton.cdiv(topk, keys_per_split)
    head_blocks = triton.cdiv(num_heads, bh)
    if splits > 1:
        part = torch.empty(rows, splits, num_heads, fmt.kv_lora_rank, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, splits, num_heads, dtype=torch.float32, device=q.device)
        dest, dest_lse = part, part_lse
    else:
        dest, dest_lse = out, lse
    args = (num_heads, s_q, topk, keys_per_split, splits, pages.shape[0] * KERNEL_PAGE_SIZE, pages.stride(0),
            q.stride(0), q.stride(1), q.stride(2), indices.stride(0), indices.stride(1),
            softmax_scale * math.log2(math.e))
    grid = (rows * head_blocks * splits,)
    if kernel == "gluon16":
        from dsacache.ops.sparse_mla.decode_gluon16 import sparse_mla_decode_gluon16_kernel

        sparse_mla_decode_gluon16_kernel[grid](
            q, pages, indices, dest, dest_lse, *args, SPLIT=splits > 1, L2_AHEAD=bool(cfg["l2_ahead"]),
            GATHER_REGS=cfg["gather_regs"], num_warps=4, maxnreg=cfg["maxnreg"],
        )
    elif kernel == "gluon":
        from dsacache.ops.sparse_mla.decode_gluon import sparse_mla_decode_gluon_kernel

        sparse_mla_decode_gluon_kernel[grid](
            q, pages, indices, dest, dest_lse, *args, SPLIT=splits > 1, BLOCK_N=block_n, STAGES=cfg["stages"],
            L2_AHEAD=cfg["l2_ahead"], GATHER_REGS=cfg["gather_regs"], VALUE_REGS=cfg["value_regs"],
            num_warps=4, maxnreg=cfg["maxnreg"],
        )
    else:
        sparse_mla_attention_kernel[grid](
            q, pages, indices, k_scale if k_scale is not None else lse, dest, dest_lse, *args,
            **attention_constants(fmt, cfg, splits > 1), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if splits > 1:
        merge_splits_kernel[(rows, triton.cdiv(num_heads, MERGE_HEADS))](
            part, part_lse, out, lse, num_heads, splits, **merge_constants(fmt), num_warps=MERGE_WARPS,
        )


def attention_constants(fmt: MlaEntryFormat, cfg: dict, split: bool) -> dict:
    """The compile-time arguments of ``sparse_mla_attention_kernel`` for an entry kind and settings."""
    return dict(RANK=fmt.kv_lora_rank, ROPE=fmt.rope_dim, ENTRY=fmt.entry_bytes, KIND=KINDS[fmt.kind],
                PAGE=KERNEL_PAGE_SIZE, TILE=DS_MLA_TILE, BH=cfg["BH"], BLOCK_N=cfg["BLOCK_N"],
                CHUNK=value_chunk(fmt.kv_lora_rank), BLOCK_P=_pow2_at_least_16(fmt.rope_dim), SPLIT=split,
                PREFETCH=cfg.get("prefetch", TRITON_PREFETCH))


def value_chunk(kv_lora_rank: int) -> int:
    """Latent values a chunk of the kernel (an fp8_ds_mla scale tile: 128; fewer for a small rank)."""
    return min(DS_MLA_TILE, _pow2_at_least_16(kv_lora_rank))


def triton_supports(fmt: MlaEntryFormat) -> bool:
    """Whether the Triton kernel takes this entry kind: at most four latent chunks (rank <= 512)."""
    return math.ceil(fmt.kv_lora_rank / value_chunk(fmt.kv_lora_rank)) <= MAX_CHUNKS


def merge_constants(fmt: MlaEntryFormat) -> dict:
    """The compile-time arguments of ``merge_splits_kernel``."""
    return dict(RANK=fmt.kv_lora_rank, BLOCK_H=MERGE_HEADS, BLOCK_R=_pow2_at_least_16(fmt.kv_lora_rank))


def _pow2_at_least_16(n: int) -> int:
    """A tile width for ``n`` values: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(max(n, 1)))
