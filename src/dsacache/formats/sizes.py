"""Per-token byte sizes of every cache entry (pure Python, no torch).

The byte layouts themselves are drawn in ``docs/layout.md``; the torch codecs of the
indexer key formats live beside this module (``indexer_key.py``).
"""

from __future__ import annotations

#: Tokens per kernel page: the unit that block tables, slot mappings and paged kernels see.
KERNEL_PAGE_SIZE = 64

#: One fp32 scale per token for FP8 indexer keys (``ue8m0``: always a power of two).
FP8_SCALE_BYTES = 4

#: Values per MXFP4 scale group; the scale is one UE8M0 byte.
MXFP4_GROUP_SIZE = 32

#: Tile width of ``fp8_ds_mla`` latent scales (one fp32 scale per 128 values).
DS_MLA_TILE = 128

INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")


def resolve_indexer_kv_dtype(indexer_kv_dtype: str) -> str:
    """Map a user's ``indexer_kv_dtype`` to the stored format, ``"fp8"`` or ``"mxfp4"``."""
    if indexer_kv_dtype in ("auto", "fp8"):
        return "fp8"
    if indexer_kv_dtype == "mxfp4":
        return "mxfp4"
    raise ValueError(
        f"indexer_kv_dtype={indexer_kv_dtype!r} is not supported; "
        f"allowed: {', '.join(INDEXER_KV_DTYPES)}"
    )


def indexer_entry_bytes(head_dim: int, indexer_kv_dtype: str) -> int:
    """Bytes one token's indexer key takes in a page (values plus scales).

    FP8: ``head_dim`` e4m3 values + one fp32 scale (132 B at 128).
    MXFP4: ``head_dim / 2`` packed e2m1 bytes + one UE8M0 byte per 32 values (68 B at 128).
    """
    dtype = resolve_indexer_kv_dtype(indexer_kv_dtype)
    if dtype == "fp8":
        return head_dim + FP8_SCALE_BYTES
    if head_dim % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"index_head_dim={head_dim} must be a multiple of {MXFP4_GROUP_SIZE} "
            "for indexer_kv_dtype='mxfp4'"
        )
    return head_dim // 2 + head_dim // MXFP4_GROUP_SIZE


def mla_entry_bytes(kv_lora_rank: int, rope_dim: int, kv_cache_dtype: str) -> int:
    """Bytes one token's MLA latent takes for one layer, by ``kv_cache_dtype``.

    ``auto``/``bfloat16``: 2 x (rank + rope). ``fp8``/``fp8_e4m3``: rank + rope.
    ``fp8_ds_mla``: rank e4m3 + 4 x rank/128 fp32 tile scales + 2 x rope bf16 (656 B at 512 + 64).
    """
    if kv_cache_dtype in ("auto", "bfloat16"):
        return 2 * (kv_lora_rank + rope_dim)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return kv_lora_rank + rope_dim
    if kv_cache_dtype == "fp8_ds_mla":
        if kv_lora_rank % DS_MLA_TILE:
            raise ValueError(
                f"kv_lora_rank={kv_lora_rank} must be a multiple of {DS_MLA_TILE} "
                "for kv_cache_dtype='fp8_ds_mla'"
            )
        return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_TILE) + 2 * rope_dim
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported; "
        f"allowed: {', '.join(KV_CACHE_DTYPES)}"
    )
