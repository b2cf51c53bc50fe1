"""Per-token byte sizes of every cache entry (pure Python, no torch).

The byte layouts themselves are drawn in ``docs/layout.md``. The indexer key format (its
names, value/scale split and rules) is defined in ``key_format.py``; its torch codecs in
``indexer_key.py``.
"""

from __future__ import annotations

#: Tokens per kernel page: the unit that block tables, slot mappings and paged kernels see.
KERNEL_PAGE_SIZE = 64

#: Tile width of ``fp8_ds_mla`` latent scales (one fp32 scale per 128 values).
DS_MLA_TILE = 128

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")


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
