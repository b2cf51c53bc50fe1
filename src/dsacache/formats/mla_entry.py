"""MLA latent entries: the one definition of each cache dtype's bytes, and their reference codecs.

One token of one MLA layer caches ``kv_lora_rank`` latent values (``kv_c``, the values
attention reads back as V and the first part of K) plus ``rope_dim`` key values
(``k_pe``; cached even with ``mla_use_nope``, where no rotary embedding is applied).
Entries are interleaved per token: entry ``t`` of a page sits at bytes
``[t * E, (t + 1) * E)`` (``docs/formats.md``, "MLA latent entries"):

* ``bfloat16`` (also ``auto``): ``rank + rope`` bf16 values, ``kv_c`` then ``k_pe``.
* ``fp8`` (also ``fp8_e4m3``): ``rank + rope`` e4m3 values divided by one per-tensor fp32
  scale ``k_scale`` that the caller owns.
* ``fp8_ds_mla`` (FlashMLA's sparse format): ``rank`` e4m3 values, then ``rank / 128``
  fp32 tile scales (tile ``i`` covers values ``[128 i, 128 i + 128)``, scale
  ``max(amax, 1e-4) / 448`` as a plain fp32, value ``e4m3(x / scale)``), then the ``rope``
  values in bf16: 656 B at 512 + 64, 528 B at 512 + 0.

The entry width tells the three kinds apart at a given ``(rank, rope)``
(:meth:`MlaEntryFormat.of_entry`), so ops read the kind off the pages the pool hands out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsacache.formats.sizes import DS_MLA_TILE, KERNEL_PAGE_SIZE, KV_CACHE_DTYPES, mla_entry_bytes

MLA_KINDS = ("bfloat16", "fp8", "fp8_ds_mla")
DS_MLA_FP8_MAX = 448.0
DS_MLA_AMAX_FLOOR = 1e-4


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """Map a vLLM-style ``kv_cache_dtype`` to the stored kind: ``bfloat16``, ``fp8`` or ``fp8_ds_mla``."""
    if kv_cache_dtype in ("auto", "bfloat16"):
        return "bfloat16"
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8"
    if kv_cache_dtype == "fp8_ds_mla":
        return "fp8_ds_mla"
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class MlaEntryFormat:
    """One MLA entry kind at one ``(kv_lora_rank, rope_dim)``: its byte split.

    >>> fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    >>> fmt.entry_bytes, fmt.scale_offset, fmt.rope_offset
    (656, 512, 528)
    """

    kind: str
    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        if self.kind not in MLA_KINDS:
            raise ValueError(f"MLA entry kind {self.kind!r}; allowed: {', '.join(MLA_KINDS)}")
        for name in ("kv_lora_rank", "rope_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "kv_lora_rank" else 0):
                raise ValueError(f"{name}={value!r} must be an integer >= {1 if name == 'kv_lora_rank' else 0}")
        mla_entry_bytes(self.kv_lora_rank, self.rope_dim, self.kind)  # the fp8_ds_mla tiling rule

    @classmethod
    def of(cls, kv_cache_dtype: "str | MlaEntryFormat", kv_lora_rank: int, rope_dim: int) -> "MlaEntryFormat":
        """The kind a ``kv_cache_dtype`` names, at these dims."""
        if isinstance(kv_cache_dtype, MlaEntryFormat):
            if (kv_cache_dtype.kv_lora_rank, kv_cache_dtype.rope_dim) != (kv_lora_rank, rope_dim):
                raise ValueError(
                    f"MLA entry format is for {kv_cache_dtype.kv_lora_rank} + {kv_cache_dtype.rope_dim} values, "
                    f"the latents have {kv_lora_rank} + {rope_dim}"
                )
            return kv_cache_dtype
        if not isinstance(kv_cache_dtype, str):
            raise ValueError(f"kv_cache_dtype must be a string ({', '.join(KV_CACHE_DTYPES)}), got {kv_cache_dtype!r}")
        return cls(resolve_kv_cache_dtype(kv_cache_dtype), kv_lora_rank, rope_dim)

    @classmethod
    def of_entry(cls, entry_bytes: int, kv_lora_rank: int, rope_dim: int,
                 kv_cache_dtype: "str | MlaEntryFormat | None" = None) -> "MlaEntryFormat":
        """The kind of pages whose per-token width is ``entry_bytes``; checked against ``kv_cache_dtype`` if given."""
        if kv_cache_dtype is not None:
            fmt = cls.of(kv_cache_dtype, kv_lora_rank, rope_dim)
            if fmt.entry_bytes != entry_bytes:
                raise ValueError(
                    f"MLA pages of {entry_bytes} B a token do not hold {fmt.kind} entries of {kv_lora_rank} + "
                    f"{rope_dim} values ({fmt.entry_bytes} B a token); pass the pages and kv_cache_dtype of one layout"
                )
            return fmt
        candidates = [cls(kind, kv_lora_rank, rope_dim) for kind in MLA_KINDS if _tiles(kind, kv_lora_rank)]
        for fmt in candidates:
            if fmt.entry_bytes == entry_bytes:
                return fmt
        widths = ", ".join(f"{f.entry_bytes} ({f.kind})" for f in candidates)
        raise ValueError(
            f"MLA pages of {entry_bytes} B a token match no entry kind at {kv_lora_rank} + {rope_dim} values; "
            f"allowed widths: {widths}"
        )

    @property
    def entry_bytes(self) -> int:
        """Bytes of one token's entry."""
        return mla_entry_bytes(self.kv_lora_rank, self.rope_dim, self.kind)

    @property
    def cached_dim(self) -> int:
        """Values an entry holds: ``kv_lora_rank + rope_dim`` (the absorbed query's width)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_tiles(self) -> int:
        """``fp8_ds_mla`` scale tiles of 128 latent values (0 for the other kinds)."""
        return self.kv_lora_rank // DS_MLA_TILE if self.kind == "fp8_ds_mla" else 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the ``fp8_ds_mla`` tile scales inside an entry."""
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        """Byte offset of the rope values inside an entry (bf16 for ``fp8_ds_mla`` and ``bfloat16``)."""
        if self.kind == "fp8_ds_mla":
            return self.kv_lora_rank + 4 * self.num_tiles
        if self.kind == "bfloat16":
            return 2 * self.kv_lora_rank
        return self.kv_lora_rank


def mla_pages_format(pages: torch.Tensor, kv_lora_rank: int, rope_dim: int,
                     kv_cache_dtype: "str | MlaEntryFormat | None" = None) -> MlaEntryFormat:
    """The entry kind of one layer's paged MLA view, after checking the view; ``ValueError`` otherwise.

    ``pages`` is ``[num_pages, 64, entry_bytes]`` uint8 with strides ``(page_stride, entry_bytes, 1)``
    (any page stride that does not overlap pages). Without ``kv_cache_dtype`` the kind is read off
    the width (what the pool handed out); with it, the pages must match it. ``fp8_ds_mla`` pages
    must be 4-byte aligned (fp32 scales) and ``bfloat16`` pages 2-byte aligned, address and stride.
    """
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 3 \
            or pages.shape[1] != KERNEL_PAGE_SIZE:
        raise ValueError(f"mla_pages must be a uint8 view [num_pages, {KERNEL_PAGE_SIZE}, entry_bytes], got "
                         f"{tuple(getattr(pages, 'shape', ()))} {getattr(pages, 'dtype', type(pages).__name__)}")
    fmt = MlaEntryFormat.of_entry(pages.shape[2], kv_lora_rank, rope_dim, kv_cache_dtype)
    entry = fmt.entry_bytes
    if pages.stride(1) != entry or pages.stride(2) != 1:
        raise ValueError("each MLA page must be contiguous: strides (page_stride, entry_bytes, 1)")
    if pages.shape[0] > 1 and pages.stride(0) < KERNEL_PAGE_SIZE * entry:
        raise ValueError(f"page stride {pages.stride(0)} overlaps pages of {KERNEL_PAGE_SIZE * entry} B")
    align = 4 if fmt.kind == "fp8_ds_mla" else 2 if fmt.kind == "bfloat16" else 1
    if pages.data_ptr() % align or pages.stride(0) % align:
        raise ValueError(f"{fmt.kind} MLA pages must be {align}-byte aligned (address and page stride)")
    return fmt


def check_k_scale(k_scale: object, fmt: MlaEntryFormat, read_value: bool) -> None:
    """``k_scale`` is given exactly for ``fp8`` entries, as a one-element float32 tensor.

    With ``read_value`` its value is also read on the host (a device sync for a CUDA tensor) and
    must be positive and finite; callers under CUDA-graph capture pass ``False``.
    """
    if fmt.kind != "fp8":
        if k_scale is not None:
            raise ValueError(f"k_scale applies to kv_cache_dtype 'fp8' only; these pages are {fmt.kind}")
        return
    if not isinstance(k_scale, torch.Tensor) or k_scale.numel() != 1 or k_scale.dtype != torch.float32:
        raise ValueError("kv_cache_dtype 'fp8' needs k_scale, a one-element float32 tensor (the per-tensor scale)")
    if read_value and not 0 < float(k_scale) < float("inf"):
        raise ValueError(f"k_scale must be positive and finite, got {float(k_scale)}")


def _tiles(kind: str, kv_lora_rank: int) -> bool:
    return kind != "fp8_ds_mla" or kv_lora_rank % DS_MLA_TILE == 0


def ds_mla_tile_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, rank / 128]`` tile scales ``max(amax, 1e-4) / 448`` of latents ``[T, rank]``."""
    tiles = kv_c.float().unflatten(-1, (-1, DS_MLA_TILE))
    return tiles.abs().amax(dim=-1).clamp_min(DS_MLA_AMAX_FLOOR) / DS_MLA_FP8_MAX


def encode_entries(kv_c: torch.Tensor, k_pe: torch.Tensor | None, fmt: MlaEntryFormat,
                   k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[T, entry_bytes]``: the entries of latents ``kv_c [T, rank]`` and ``k_pe [T, rope]``.

    ``fp8`` divides by the per-tensor ``k_scale`` (a positive fp32 scalar tensor).
    Values are rounded to nearest and saturate at +-448 (NaN stays NaN).
    """
    num_tokens = kv_c.shape[0]
    rope = k_pe if k_pe is not None else kv_c.new_zeros(num_tokens, 0)
    if fmt.kind == "bfloat16":
        return torch.cat([kv_c.to(torch.bfloat16), rope.to(torch.bfloat16)], dim=-1).view(torch.uint8)
    if fmt.kind == "fp8":
        both = torch.cat([kv_c.float(), rope.float()], dim=-1) / k_scale.float()
        return _to_e4m3(both).view(torch.uint8)
    scales = ds_mla_tile_scales(kv_c)
    values = kv_c.float().unflatten(-1, (-1, DS_MLA_TILE)) / scales.unsqueeze(-1)
    parts = [_to_e4m3(values.flatten(-2)).view(torch.uint8), scales.view(torch.uint8).reshape(num_tokens, -1),
             rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(num_tokens, -1)]
    return torch.cat(parts, dim=-1)


def decode_entries(entries: torch.Tensor, fmt: MlaEntryFormat,
                   k_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c fp32 ``[..., rank]``, k_pe fp32 ``[..., rope]``) of uint8 entries ``[..., entry_bytes]``."""
    entries = entries.contiguous()
    rank, rope = fmt.kv_lora_rank, fmt.rope_dim
    if fmt.kind == "bfloat16":
        values = entries.view(torch.bfloat16).float()
        return values[..., :rank], values[..., rank:]
    if fmt.kind == "fp8":
        values = entries.view(torch.float8_e4m3fn).float() * k_scale.float()
        return values[..., :rank], values[..., rank:]
    values = entries[..., :rank].contiguous().view(torch.float8_e4m3fn).float()
    scales = entries[..., fmt.scale_offset:fmt.rope_offset].contiguous().view(torch.float32)
    kv_c = (values.unflatten(-1, (-1, DS_MLA_TILE)) * scales.unsqueeze(-1)).flatten(-2)
    k_pe = entries[..., fmt.rope_offset:].contiguous().view(torch.bfloat16).float()
    return kv_c, k_pe


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to e4m3 saturating at +-448 (torch's cast does not saturate)."""
    x = torch.where(torch.isnan(x), x, x.clamp(-DS_MLA_FP8_MAX, DS_MLA_FP8_MAX))
    return x.to(torch.float8_e4m3fn)
