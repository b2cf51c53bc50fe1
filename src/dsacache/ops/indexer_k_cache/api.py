"""Public functions of the indexer key cache write path: validate, then dispatch.

Triton runs when the tensors are on CUDA (or when ``impl="triton"`` is forced, which
under ``TRITON_INTERPRET=1`` also runs on CPU); the PyTorch reference in ``naive.py``
runs otherwise (``impl="torch"`` forces it). Both paths refuse the same inputs: every
check is here, before anything is written. The page byte layout is drawn in
``docs/layout.md`` ("indexer page"); the codecs and their NaN/inf rules are in
:mod:`dsacache.formats.indexer_key`.

The key format comes with the pages the pool hands out (``pool.index_pages(layer)``):
``indexer_kv_dtype=None`` reads it off their entry width at the keys' ``head_dim``; a format
string (``"auto"``, ``"fp8"``, ``"mxfp4"``) or an :class:`~dsacache.formats.key_format.IndexerKeyFormat`
(``CacheLayout.indexer_key_format``) is checked against them.
"""

from __future__ import annotations

import math
import numbers

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.indexer_key import indexer_pages_format
from dsacache.formats.key_format import IndexerKeyFormat, resolve_indexer_kv_dtype
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.checks import check_flag, check_int, check_slot_mapping, check_tensor
from dsacache.ops.indexer_k_cache import naive
from dsacache.runtime.block_table import check_block_table

KEY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MXFP4_RULE = (
    "indexer_kv_dtype='mxfp4' is written only by the fused LayerNorm insert "
    "(fused_norm_store_indexer_keys; docs/planning.md, format choice)"
)


def _check_keys(k: torch.Tensor) -> int:
    if not isinstance(k, torch.Tensor) or k.dim() != 2:
        raise ValueError(f"k must be a 2-D tensor [num_tokens, head_dim], got {getattr(k, 'shape', type(k))}")
    if k.dtype not in KEY_DTYPES:
        raise ValueError(f"k.dtype={k.dtype}; allowed: bfloat16, float16, float32")
    if k.shape[1] == 0:
        raise ValueError("head_dim (k.shape[1]) must be positive")
    return k.shape[1]


def _store_format(pages: torch.Tensor, head_dim: int, indexer_kv_dtype, *, fused: bool) -> IndexerKeyFormat:
    """The format the store writes: named or read off the pages, checked against them; MXFP4 only ``fused``."""
    if not fused and indexer_kv_dtype is not None and IndexerKeyFormat.of(indexer_kv_dtype, head_dim).is_mxfp4:
        raise ValueError(f"store_indexer_keys: {MXFP4_RULE}")
    fmt = indexer_pages_format(pages, head_dim, indexer_kv_dtype)
    if not fused and fmt.is_mxfp4:
        raise ValueError(f"store_indexer_keys: these are MXFP4 pages; {MXFP4_RULE}")
    if pages.data_ptr() % 4 or pages.stride(0) % 4:
        raise ValueError("indexer pages must be 4-byte aligned (address and page stride) for the stores: "
                         "FP8 scales are fp32, MXFP4 values are written a 32-bit word at a time")
    return fmt


def _check_store_args(slot_mapping: object, check_slots: object) -> None:
    check_tensor("slot_mapping", slot_mapping)
    check_flag("check_slots", check_slots)


def _check_norm_params(weight: torch.Tensor, bias: torch.Tensor, head_dim: int, eps: float) -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) or t.shape != (head_dim,) or t.dtype not in KEY_DTYPES:
            raise ValueError(f"{name} must be a [{head_dim}] float tensor, got {getattr(t, 'shape', type(t))}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 <= eps < math.inf):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")


def store_indexer_keys(k: torch.Tensor, pages: torch.Tensor, slot_mapping: torch.Tensor,
                       indexer_kv_dtype: str | IndexerKeyFormat | None = None, *, impl: str = "auto",
                       check_slots: bool = True) -> None:
    """Quantize indexer keys to FP8 and write them into one layer's indexer pages.

    Args:
        k: ``[num_tokens, head_dim]`` bf16, fp16 or fp32 keys (any strides).
        pages: the layer's paged view ``[num_pages, 64, head_dim + 4]`` uint8 with
            strides ``(page_stride, head_dim + 4, 1)`` (``pool.index_pages(layer)``);
            ``page_stride`` may span a whole packed row (every layer's pages side by side).
        slot_mapping: ``[num_tokens]`` int32/int64, ``slot = page * 64 + row``; ``-1`` skips
            the token (no byte written).
        indexer_kv_dtype: ``None`` (read off the pages), ``"auto"``, ``"fp8"`` or an FP8
            ``IndexerKeyFormat``. MXFP4 is refused: MXFP4 keys are written only by
            :func:`fused_norm_store_indexer_keys`.
        impl: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.
        check_slots: check on the host (one device sync) that every slot is ``-1`` or
            inside the pool, raising ``ValueError`` before anything is written. Pass
            ``False`` under CUDA-graph capture: out-of-range slots are then skipped
            silently (never written out of bounds).

    Each token's scale is the power of two ``2**ceil(log2(max(amax, 1e-4) / 448))`` over
    its finite elements; values are ``e4m3(k / scale)``, saturating; NaN stores the e4m3
    NaN code. Byte layout: ``docs/layout.md`` (values of all 64 rows, then 64 fp32 scales).
    Repeated slots: the PyTorch path keeps the last token; the Triton path gives no order
    between writers, so a repeated slot's entry is defined only when its tokens carry
    the same key. Bytes of other slots are never touched.

    Example::

        >>> pool = torch.zeros(4, 64, 132, dtype=torch.uint8)
        >>> store_indexer_keys(torch.randn(3, 128), pool, torch.tensor([0, 65, -1]))
    """
    head_dim = _check_keys(k)
    fmt = _store_format(pages, head_dim, indexer_kv_dtype, fused=False)
    _check_store_args(slot_mapping, check_slots)
    check_same_device(k=k, pages=pages, slot_mapping=slot_mapping)
    check_slot_mapping(slot_mapping, k.shape[0], pages.shape[0], check_slots)
    if use_triton(impl, k, pages, slot_mapping):
        from dsacache.ops.indexer_k_cache.launch import launch_store

        launch_store(k, pages, slot_mapping, fmt)
    else:
        naive.store_indexer_keys(k, pages, slot_mapping, fmt)


def fused_norm_store_indexer_keys(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                  pages: torch.Tensor, slot_mapping: torch.Tensor,
                                  indexer_kv_dtype: str | IndexerKeyFormat | None = None, *, eps: float = 1e-6,
                                  impl: str = "auto", check_slots: bool = True) -> None:
    """LayerNorm the keys, quantize them to FP8 or MXFP4 and store them: one launch.

    The K3.1 indexer insert (LayerNorm key norm, no indexer RoPE), and the only writer of
    MXFP4 keys. The normalized key is ``(k - mean) * rstd * weight + bias`` in fp32
    (biased variance, ``rstd = 1 / sqrt(var + eps)``); it is quantized as in
    :func:`store_indexer_keys` (FP8) or per 32-value group (MXFP4: scale
    ``2**ceil(log2(amax / 6))`` as a UE8M0 byte, e2m1 codes rounded half to even).
    The GPU kernels compute the LayerNorm in fp32 in their own order, so a code may differ
    from the reference's by one step where the normalized value sits within a last bit of a
    rounding boundary (~1e-7 of them on random keys). They take the mean and variance from
    raw moments (sum and sum of squares; on the tensor cores for MXFP4 batches of bf16 keys
    from 32K tokens) and ``rsqrt.approx``; a program or tile where that would cancel (a key
    with ``mean**2 > 16 var``) or meets NaN or inf uses the exact two-pass statistics instead.

    Args:
        k: ``[num_tokens, head_dim]`` bf16, fp16 or fp32 keys (any strides).
        weight, bias: ``[head_dim]`` LayerNorm parameters (bf16, fp16 or fp32).
        pages: the layer's paged view ``[num_pages, 64, entry]`` uint8 (``pool.index_pages(layer)``),
            ``entry`` = ``head_dim + 4`` (FP8) or ``head_dim / 2 + head_dim / 32`` (MXFP4, ``head_dim``
            a multiple of 32); strides ``(page_stride, entry, 1)``.
        slot_mapping: ``[num_tokens]`` int32/int64, ``-1`` skips the token.
        indexer_kv_dtype: ``None`` (read off the pages), ``"auto"``, ``"fp8"``, ``"mxfp4"`` or an
            ``IndexerKeyFormat``; a given format must match the pages.
        eps: a finite number ``>= 0``.
        impl, check_slots: as in :func:`store_indexer_keys`.

    A NaN anywhere in a key's input makes its whole normalized key NaN (LayerNorm mixes
    every element): FP8 stores NaN codes, MXFP4 stores +0 codes with scale byte 0.
    Repeated slots follow the rule of :func:`store_indexer_keys`.

    Example::

        >>> pool = torch.zeros(4, 64, 68, dtype=torch.uint8)
        >>> w, b = torch.ones(128), torch.zeros(128)
        >>> fused_norm_store_indexer_keys(torch.randn(3, 128), w, b, pool, torch.tensor([0, 1, 2]))
    """
    head_dim = _check_keys(k)
    fmt = _store_format(pages, head_dim, indexer_kv_dtype, fused=True)
    _check_norm_params(weight, bias, head_dim, eps)
    _check_store_args(slot_mapping, check_slots)
    check_same_device(k=k, weight=weight, bias=bias, pages=pages, slot_mapping=slot_mapping)
    check_slot_mapping(slot_mapping, k.shape[0], pages.shape[0], check_slots)
    if use_triton(impl, k, pages, slot_mapping):
        from dsacache.ops.indexer_k_cache.launch import launch_store

        launch_store(k, pages, slot_mapping, fmt, weight.contiguous(), bias.contiguous(), float(eps))
    else:
        naive.fused_norm_store_indexer_keys(k, weight, bias, pages, slot_mapping, fmt, float(eps))


def _check_cu_seqlens(cu_seqlens: object, num_reqs: int) -> None:
    check_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape[0] != num_reqs + 1:
        raise ValueError(f"cu_seqlens must be int32 [num_reqs + 1] = [{num_reqs + 1}], got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")


def _checked_num_tokens(cu_seqlens: torch.Tensor) -> int:
    """``cu_seqlens[-1]`` after checking, on the host, that it starts at 0 and never decreases."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    return cu[-1]


def gather_indexer_keys(pages: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor, head_dim: int,
                        indexer_kv_dtype: str | IndexerKeyFormat | None = None, *, num_tokens: int | None = None,
                        impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Gather requests' cached keys out of the pages into contiguous rows (the prefill path).

    Request ``r`` owns output rows ``[cu_seqlens[r], cu_seqlens[r + 1])``; its row ``i`` is
    position ``i`` of the request, read from kernel page ``block_table[r, i // 64]``, row
    ``i % 64``. A position whose block is past the table or whose entry is not a page of
    the pool (e.g. ``-1``) gathers as zero bytes (the rule of ``dsacache.runtime.block_table``).

    Args:
        pages: the layer's paged view ``[num_pages, 64, entry]`` uint8 (``pool.index_pages(layer)``).
        block_table: ``[num_reqs, max_pages]`` int32 kernel page ids, ``max_pages >= 1``.
        cu_seqlens: ``[num_reqs + 1]`` int32, ``0`` first, non-decreasing.
        head_dim: the key width (the entry width alone does not tell the formats apart across
            key widths: 68 B is FP8 at 64 and MXFP4 at 128).
        indexer_kv_dtype: ``None`` (read off the pages), ``"auto"``, ``"fp8"``, ``"mxfp4"`` or an
            ``IndexerKeyFormat``; a given format must match the pages.
        num_tokens: ``cu_seqlens[-1]`` if known (then ``cu_seqlens`` is trusted: no sync, for
            CUDA graphs); ``None`` reads and checks ``cu_seqlens`` on the host.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        FP8: ``(values [T, head_dim] float8_e4m3fn, scales [T] float32)``.
        MXFP4: ``(packed [T, head_dim / 2] uint8, scales [T, head_dim / 32] uint8)``.

    Example::

        >>> pool = torch.zeros(4, 64, 132, dtype=torch.uint8)
        >>> values, scales = gather_indexer_keys(pool, torch.tensor([[2, 0]], dtype=torch.int32),
        ...                                      torch.tensor([0, 70], dtype=torch.int32), 128)
    """
    head_dim = check_int("head_dim", head_dim, 1)
    fmt = indexer_pages_format(pages, head_dim, indexer_kv_dtype)
    check_block_table(block_table, min_width=1)
    _check_cu_seqlens(cu_seqlens, block_table.shape[0])
    check_same_device(pages=pages, block_table=block_table, cu_seqlens=cu_seqlens)
    if num_tokens is None:
        num_tokens = _checked_num_tokens(cu_seqlens)
    num_tokens = check_int("num_tokens", num_tokens, 0)
    if num_tokens and block_table.shape[0] == 0:
        raise ValueError(f"num_tokens={num_tokens} with no requests (block_table has 0 rows)")
    if not use_triton(impl, pages, block_table, cu_seqlens):
        return naive.gather_indexer_keys(pages, block_table, cu_seqlens, fmt, num_tokens)
    from dsacache.ops.indexer_k_cache.launch import launch_gather

    values = torch.empty((num_tokens, fmt.value_bytes), dtype=torch.uint8, device=pages.device)
    scales = torch.empty((num_tokens, fmt.scale_bytes), dtype=torch.uint8, device=pages.device)
    launch_gather(pages, block_table if block_table.stride(1) == 1 else block_table.contiguous(),
                  cu_seqlens.contiguous(), values, scales, fmt)
    return naive.typed_entries(values, scales, fmt)


def _gathered_format(values: torch.Tensor, scales: torch.Tensor, indexer_kv_dtype) -> IndexerKeyFormat:
    """The format of gathered ``(values, scales)``, named or read off ``values.dtype``, after checking them."""
    check_tensor("values", values)
    check_tensor("scales", scales)
    if values.dim() != 2 or scales.dim() < 1 or values.shape[0] != scales.shape[0]:
        raise ValueError(f"values must be [num_tokens, width] matching scales, got {tuple(values.shape)} "
                         f"and {tuple(scales.shape)}")
    if indexer_kv_dtype is None:
        if values.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"values.dtype={values.dtype}: gathered keys are float8_e4m3fn (fp8) or uint8 "
                             "(mxfp4 pairs); pass indexer_kv_dtype")
        indexer_kv_dtype = "fp8" if values.dtype == torch.float8_e4m3fn else "mxfp4"
    name = indexer_kv_dtype.name if isinstance(indexer_kv_dtype, IndexerKeyFormat) else \
        resolve_indexer_kv_dtype(indexer_kv_dtype)
    # A gathered row is value_bytes wide: head_dim e4m3 codes (fp8) or head_dim / 2 e2m1 pairs (mxfp4).
    fmt = IndexerKeyFormat.of(indexer_kv_dtype, values.shape[1] * (2 if name == "mxfp4" else 1))
    if fmt.is_mxfp4:
        if values.dtype != torch.uint8 or scales.dtype != torch.uint8 or \
                tuple(scales.shape) != (values.shape[0], fmt.scale_bytes):
            raise ValueError("MXFP4 keys are (packed [T, D/2] uint8, scales [T, D/32] uint8), D a multiple of 32")
    elif values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or scales.dim() != 1:
        raise ValueError("FP8 keys are (values [T, D] float8_e4m3fn, scales [T] float32)")
    return fmt


def dequantize_indexer_keys(values: torch.Tensor, scales: torch.Tensor,
                            indexer_kv_dtype: str | IndexerKeyFormat | None = None, *,
                            impl: str = "auto") -> torch.Tensor:
    """Decode gathered keys (as returned by :func:`gather_indexer_keys`) to fp32 ``[T, head_dim]``.

    FP8: ``value * scale``; MXFP4: each e2m1 value times ``2**(scale_byte - 127)`` of its
    32-value group. Exact (every scale is a power of two). ``indexer_kv_dtype=None`` reads
    the format off ``values.dtype`` (float8_e4m3fn: FP8, uint8: MXFP4); a given one is checked.

    Example::

        >>> values = torch.ones(2, 128).to(torch.float8_e4m3fn)
        >>> dequantize_indexer_keys(values, torch.tensor([0.5, 2.0]))[:, 0]
        tensor([0.5000, 2.0000])
    """
    fmt = _gathered_format(values, scales, indexer_kv_dtype)
    check_same_device(values=values, scales=scales)
    if not use_triton(impl, values, scales):
        return naive.dequantize_indexer_keys(values, scales, fmt)
    from dsacache.ops.indexer_k_cache.launch import launch_dequantize

    out = torch.empty((values.shape[0], fmt.head_dim), dtype=torch.float32, device=values.device)
    launch_dequantize(values.contiguous().view(torch.uint8), scales.contiguous(), out, fmt)
    return out
