"""Public entry points for the indexer logits: paged decode and ragged prefill.

Each function validates its input, then runs the Triton kernel when the tensors are on
CUDA (or when ``impl="triton"`` is forced, which under ``TRITON_INTERPRET=1`` also runs
on CPU tensors) and the PyTorch reference in ``naive.py`` otherwise. On Hopper the paged
decode runs Gluon kernels where they apply (FP8 and MXFP4 keys, 1-4 query rows;
``launch.py`` picks the kernel and its settings, ``launch.decode_kernel`` says which one a
call takes).

The key format comes with the keys: the paged decode reads it off the pages the pool hands
out (``indexer_pages_format``; a format named by the caller is checked against them), the
ragged prefill off the dtypes of the gathered tensors.
"""

from __future__ import annotations

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.indexer_key import fp8_page_views, indexer_pages_format, mxfp4_page_views
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.ops.indexer_logits import naive
from dsacache.runtime.block_table import check_block_table


def per_row_context_lens(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per-request context lengths ``[B]`` -> per-row lengths ``[B, next_n]`` int32.

    Row ``i`` of a request (0-based among its ``next_n`` speculative queries) sees the
    positions ``< seq_len - next_n + i + 1``: the last row sees the whole context, each
    earlier row one token less.

    >>> per_row_context_lens(torch.tensor([10, 1], dtype=torch.int32), 3)
    tensor([[ 8,  9, 10],
            [ 0,  0,  1]], dtype=torch.int32)
    """
    _check_tensors(seq_lens=seq_lens)
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 [B], got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n={next_n!r} must be a positive integer")
    offsets = torch.arange(1 - next_n, 1, device=seq_lens.device, dtype=torch.int32)
    return (seq_lens.to(torch.int32)[:, None] + offsets[None, :]).clamp_min(0).contiguous()


def _check_tensors(**tensors: object) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_query(q: torch.Tensor, weights: torch.Tensor, rows: int) -> None:
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be torch.float8_e4m3fn, got {q.dtype}")
    num_heads = q.shape[-2]
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, num_heads):
        raise ValueError(
            f"weights must be float32 [{rows}, {num_heads}], got {tuple(weights.shape)} {weights.dtype}"
        )


def _check_triton_shape(num_heads: int, head_dim: int) -> None:
    if num_heads < 16 or num_heads & (num_heads - 1):
        raise ValueError(f"the Triton path needs a power-of-two head count >= 16, got H={num_heads}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton path needs head_dim a power of two, got {head_dim}")


def _check_out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    _check_tensors(out=out)
    if out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous float32 {list(shape)} tensor on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _check_context_lens(context_lens: torch.Tensor, batch: int, next_n: int) -> torch.Tensor:
    if context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be int32, got {context_lens.dtype}")
    if tuple(context_lens.shape) not in ((batch, next_n), (batch,)):
        raise ValueError(f"context_lens must be [{batch}, {next_n}] (per row) or [{batch}] (per request), "
                         f"got {tuple(context_lens.shape)}")
    if context_lens.dtype == torch.int32 and context_lens.is_contiguous():
        return context_lens
    return context_lens.to(torch.int32).contiguous()


def paged_decode_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    indexer_kv_dtype: str | IndexerKeyFormat | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Indexer logits of decode queries against one layer's paged keys.

    ``logit[b * next_n + i, j] = sum_h weights[b * next_n + i, h] * relu(q[b, i, h] . key[b, j])``,
    fp32 accumulation, where ``key[b, j]`` is token ``j`` of request ``b`` (page
    ``block_table[b, j // 64]``, row ``j % 64``) with its scale applied (``docs/layout.md``,
    "indexer page", for the bytes). The Gluon decodes on Hopper (FP8 and MXFP4 keys, any
    next_n) sum the heads with a second tensor-core product: each ``relu(q . key)``
    is rounded to bf16 first (at most 2**-9 relative a term; the weights keep ~16 bits and
    the sum is fp32), calc-diff ~1e-7 against the reference. The Triton kernels and
    ``impl="torch"`` keep fp32 throughout.

    Args:
        q: ``[B, next_n, H, D]`` float8_e4m3fn queries (the query scale, ``D**-0.5`` and
            ``H**-0.5`` belong in ``weights``). The same FP8 queries serve both key
            formats: the Triton path turns MXFP4 keys into e4m3 in registers, exactly
            except that a 32-value group more than 2**11 below its token's largest group
            is dropped (``mxfp4_e4m3.py``); the reference keeps it.
        weights: ``[B * next_n, H]`` float32 per-head weights.
        context_lens: ``[B, next_n]`` int32, the exact number of positions each row sees
            (row ``b * next_n + i`` sees ``j < context_lens[b, i]``). A ``[B]`` tensor of
            per-request lengths is also accepted and expanded with
            :func:`per_row_context_lens` (row ``i`` sees ``j < ctx - next_n + i + 1``).
            Lengths are clamped to ``[0, max_model_len]``.
        pages: the layer's paged indexer view ``[num_pages, 64, entry]`` uint8 (any page
            stride), as ``CachePool.index_pages`` hands it out; ``entry`` = ``D + 4`` for
            FP8, ``D/2 + D/32`` for MXFP4.
        block_table: ``[B, max_blocks]`` int32 kernel page ids.
        max_model_len: number of output columns.
        indexer_kv_dtype: the key format. ``None`` (the default) reads it off ``pages``
            (the entry width tells the formats apart); ``"fp8"`` (or ``"auto"``),
            ``"mxfp4"`` or an :class:`~dsacache.formats.key_format.IndexerKeyFormat` is
            checked against the pages, ``ValueError`` when they do not hold it.
        out: optional preallocated ``[B * next_n, max_model_len]`` float32 contiguous
            output (e.g. one buffer reused by every layer of a step).
        impl: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"torch"`` or ``"triton"``.

    Returns:
        ``[B * next_n, max_model_len]`` float32. Every column is written: ``-inf`` at
        ``j >= context_lens[b, i]``, and also at positions whose page cannot be read
        (a block table entry ``< 0`` or ``>= num_pages``, or ``j // 64 >= max_blocks``).
        Such pages are never dereferenced, so a padded table never faults, and top-k
        then ranks those positions last.

    Example:
        >>> import torch
        >>> from dsacache.formats.indexer_key import fp8_page_views, quantize_fp8
        >>> pages = torch.zeros(4, 64, 132, dtype=torch.uint8)
        >>> values, scales = fp8_page_views(pages, 128)
        >>> values[:], scales[:] = quantize_fp8(torch.randn(4, 64, 128))
        >>> q = torch.randn(2, 1, 32, 128).to(torch.float8_e4m3fn)
        >>> w = torch.rand(2, 32)
        >>> bt = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
        >>> lens = torch.tensor([[100], [40]], dtype=torch.int32)
        >>> paged_decode_logits(q, w, lens, pages, bt, max_model_len=256).shape
        torch.Size([2, 256])
    """
    _check_tensors(q=q, weights=weights, context_lens=context_lens)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got {tuple(q.shape)}")
    batch, next_n, num_heads, head_dim = q.shape
    _check_query(q, weights, batch * next_n)
    if not 1 <= next_n <= 8:
        raise ValueError(f"next_n={next_n}; allowed: 1..8")
    key_format = indexer_pages_format(pages, head_dim, indexer_kv_dtype)
    check_block_table(block_table, batch)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len!r} must be an integer >= 1")
    check_same_device(q=q, weights=weights, context_lens=context_lens, pages=pages, block_table=block_table)
    context_lens = _check_context_lens(context_lens, batch, next_n)
    out = _check_out(out, (batch * next_n, max_model_len), q.device)
    if not use_triton(impl, q, pages, block_table):
        row_lens = context_lens if context_lens.dim() == 2 else per_row_context_lens(context_lens, next_n)
        row_lens = row_lens.clamp(0, max_model_len)
        return out.copy_(naive.paged_decode_logits(q, weights, row_lens, pages, block_table, max_model_len, key_format))

    from dsacache.ops.indexer_logits.launch import launch_paged_decode

    _check_triton_shape(num_heads, head_dim)
    values, scales = (mxfp4_page_views if key_format.is_mxfp4 else fp8_page_views)(pages, head_dim)
    if batch == 0:
        return out
    launch_paged_decode(q.contiguous(), weights.contiguous(), context_lens, values, scales,
                        block_table if block_table.stride(1) == 1 else block_table.contiguous(), out, key_format)
    return out


def _gathered_keys_format(k_values: torch.Tensor, k_scales: torch.Tensor, head_dim: int) -> IndexerKeyFormat:
    """The format of keys gathered contiguously, read off their dtypes (FP8: e4m3 values and one
    float32 scale a key; MXFP4: uint8 packed values and uint8 scale bytes), after checking them."""
    if k_values.dtype == torch.float8_e4m3fn:
        fmt, scale_dtype, scale_dims = IndexerKeyFormat("fp8", head_dim), torch.float32, ()
    elif k_values.dtype == torch.uint8:
        fmt = IndexerKeyFormat("mxfp4", head_dim)
        scale_dtype, scale_dims = torch.uint8, (fmt.scale_bytes,)
    else:
        raise ValueError(f"k_values must be float8_e4m3fn (FP8 keys) or uint8 (MXFP4 keys), got {k_values.dtype}")
    num_keys = k_values.shape[0] if k_values.dim() else 0
    values_shape, scales_shape = (num_keys, fmt.value_bytes), (num_keys, *scale_dims)
    if tuple(k_values.shape) != values_shape or k_scales.dtype != scale_dtype or tuple(k_scales.shape) != scales_shape:
        raise ValueError(
            f"{fmt.name} keys must be k_values {list(values_shape)} {k_values.dtype} and k_scales "
            f"{list(scales_shape)} {scale_dtype}, got {tuple(k_values.shape)} and {tuple(k_scales.shape)} "
            f"{k_scales.dtype}"
        )
    return fmt


def ragged_prefill_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_values: torch.Tensor,
    k_scales: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Indexer logits of prefill queries against keys gathered contiguously.

    ``logit[i, j] = sum_h weights[i, h] * relu(q[i, h] . key[j])`` for ``ks[i] <= j < ke[i]``,
    ``-inf`` elsewhere. Call it once per prefill chunk of the step metadata
    (:func:`dsacache.runtime.plan_prefill_chunks`, whose ``ks``/``ke`` are these windows), so the
    ``[M, N]`` output stays within the step's logits budget.

    Args:
        q: ``[M, H, D]`` float8_e4m3fn queries.
        weights: ``[M, H]`` float32.
        k_values, k_scales: the gathered keys, in the cache's encoding, which their dtypes
            name: FP8 ``[N, D]`` e4m3 + ``[N]`` float32, or MXFP4 ``[N, D/2]`` uint8 (two
            e2m1 a byte, element ``2i`` low nibble) + ``[N, D/32]`` uint8 UE8M0 scale bytes.
        ks, ke: ``[M]`` int32 key-row window of each query row (clamped to ``[0, N]``).
        out: optional preallocated ``[M, N]`` float32 contiguous output.
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``[M, N]`` float32, every element written.

    Example:
        >>> import torch
        >>> from dsacache.formats.indexer_key import quantize_fp8
        >>> kv, kscale = quantize_fp8(torch.randn(300, 128))
        >>> q = torch.randn(5, 32, 128).to(torch.float8_e4m3fn)
        >>> ks = torch.zeros(5, dtype=torch.int32)
        >>> ke = torch.arange(296, 301, dtype=torch.int32)
        >>> ragged_prefill_logits(q, torch.rand(5, 32), kv, kscale, ks, ke).shape
        torch.Size([5, 300])
    """
    _check_tensors(q=q, weights=weights, k_values=k_values, k_scales=k_scales, ks=ks, ke=ke)
    if q.dim() != 3:
        raise ValueError(f"q must be [M, H, D], got {tuple(q.shape)}")
    num_rows, num_heads, head_dim = q.shape
    _check_query(q, weights, num_rows)
    fmt = _gathered_keys_format(k_values, k_scales, head_dim)
    for name, t in (("ks", ks), ("ke", ke)):
        if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (num_rows,):
            raise ValueError(f"{name} must be int32 [{num_rows}], got {tuple(t.shape)} {t.dtype}")
    check_same_device(q=q, weights=weights, k_values=k_values, k_scales=k_scales, ks=ks, ke=ke)
    num_keys = k_values.shape[0]
    ks = ks.to(torch.int32).clamp(0, num_keys)
    ke = ke.to(torch.int32).clamp(0, num_keys)
    out = _check_out(out, (num_rows, num_keys), q.device)
    if not use_triton(impl, q, k_values):
        return out.copy_(naive.ragged_prefill_logits(q, weights, k_values, k_scales, ks, ke, fmt))

    from dsacache.ops.indexer_logits.launch import launch_ragged_prefill

    _check_triton_shape(num_heads, head_dim)
    if num_rows and num_keys:
        launch_ragged_prefill(q.contiguous(), weights.contiguous(), ks.contiguous(), ke.contiguous(),
                              k_values.contiguous(), k_scales.contiguous(), out, fmt)
    return out


def prefill_row_chunks(num_rows: int, num_keys: int, max_logits_bytes: int) -> list[tuple[int, int]]:
    """Split ``num_rows`` query rows into ``[start, end)`` chunks whose fp32 logits
    (``rows x num_keys x 4`` bytes) fit ``max_logits_bytes``; at least one row a chunk.

    For a single block of rows against one key set; a scheduler step with many requests uses
    :func:`dsacache.runtime.plan_prefill_chunks`, which also bounds the gathered keys."""
    if num_rows < 0 or num_keys < 0 or max_logits_bytes <= 0:
        raise ValueError(f"need num_rows, num_keys >= 0 and max_logits_bytes > 0, got "
                         f"{num_rows}, {num_keys}, {max_logits_bytes}")
    step = max(1, max_logits_bytes // max(4 * num_keys, 1))
    return [(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]
