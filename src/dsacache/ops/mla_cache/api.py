"""The public MLA latent store: validate, then dispatch (Triton on CUDA tensors, PyTorch otherwise)."""

from __future__ import annotations

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.mla_entry import MlaEntryFormat, check_k_scale, mla_pages_format
from dsacache.ops.checks import check_slot_mapping
from dsacache.ops.mla_cache import naive

LATENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_latents(kv_c: object, k_pe: object) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) of ``kv_c [T, rank]`` and ``k_pe [T, rope]`` (or None)."""
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t is None and name == "k_pe":
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [num_tokens, dim], got {getattr(t, 'shape', type(t))}")
        if t.dtype not in LATENT_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype}; allowed: bfloat16, float16, float32")
    if k_pe is not None and k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens, kv_c has {kv_c.shape[0]}")
    if kv_c.shape[1] == 0:
        raise ValueError("kv_lora_rank (kv_c.shape[1]) must be positive")
    return kv_c.shape[1], 0 if k_pe is None else k_pe.shape[1]


def store_mla_latents(kv_c: torch.Tensor, k_pe: torch.Tensor | None, mla_pages: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str | MlaEntryFormat | None = None, *,
                      k_scale: torch.Tensor | None = None, impl: str = "auto", check_slots: bool = True) -> None:
    """Write a step's MLA latents into one layer's MLA pages at the step's slot mapping.

    Args:
        kv_c: ``[num_tokens, kv_lora_rank]`` bf16, fp16 or fp32 compressed latents (any strides).
        k_pe: ``[num_tokens, qk_rope_head_dim]`` the cached extra key dims (RoPE'd or, with
            ``mla_use_nope``, as computed), or ``None`` for a model with ``qk_rope_head_dim`` 0.
        mla_pages: the layer's paged view ``[num_pages, 64, entry_bytes]`` uint8, strides
            ``(page_stride, entry_bytes, 1)`` (``pool.mla_pages(layer)``; any page stride).
        slot_mapping: ``[num_tokens]`` int32/int64, ``slot = page * 64 + row``; ``-1`` skips the token.
        kv_cache_dtype: ``None`` reads the entry kind off the pages' width; ``"fp8_ds_mla"``,
            ``"bfloat16"``/``"auto"``, ``"fp8"``/``"fp8_e4m3"`` (or an :class:`MlaEntryFormat`) is
            checked against them.
        k_scale: for ``fp8`` entries, the per-tensor fp32 scale (one-element tensor on the
            pages' device): stored values are ``e4m3(x / k_scale)``.
        impl: ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.
        check_slots: check on the host (one device sync) that every slot is ``-1`` or inside the
            pages and that ``k_scale`` is positive, raising before anything is written. Pass
            ``False`` under CUDA-graph capture: out-of-range slots are then skipped, never written.

    Entries (``docs/formats.md``, "MLA latent entries"): ``fp8_ds_mla`` stores ``kv_lora_rank``
    e4m3 values, one plain fp32 scale ``max(amax, 1e-4) / 448`` per 128-value tile and the rope
    values in bf16 (656 B at 512 + 64, the layout FlashMLA's sparse decode reads in place);
    ``bfloat16`` stores both parts in bf16; ``fp8`` both in e4m3 under ``k_scale``. Casts round
    to nearest even and saturate at +-448. Latents are expected finite. Only the slots named
    are written; a repeated slot keeps one of its tokens' entries (the last, on the PyTorch path).

    Example::

        >>> pages = torch.zeros(4, 64, 656, dtype=torch.uint8)
        >>> store_mla_latents(torch.randn(3, 512), torch.randn(3, 64), pages, torch.tensor([0, 65, -1]))
        >>> bool(pages[1, 1].any()), bool(pages[0, 1].any())
        (True, False)
    """
    rank, rope = _check_latents(kv_c, k_pe)
    fmt = mla_pages_format(mla_pages, rank, rope, kv_cache_dtype)
    check_slot_mapping(slot_mapping, kv_c.shape[0], mla_pages.shape[0], check_slots)
    check_k_scale(k_scale, fmt, check_slots)
    tensors = dict(kv_c=kv_c, mla_pages=mla_pages, slot_mapping=slot_mapping)
    tensors.update({name: t for name, t in (("k_pe", k_pe), ("k_scale", k_scale)) if t is not None})
    check_same_device(**tensors)
    if use_triton(impl, *tensors.values()):
        from dsacache.ops.mla_cache.launch import launch_store_mla

        launch_store_mla(kv_c, k_pe, mla_pages, slot_mapping, fmt, k_scale)
    else:
        naive.store_mla_latents(kv_c, k_pe, mla_pages, slot_mapping, fmt, k_scale)
