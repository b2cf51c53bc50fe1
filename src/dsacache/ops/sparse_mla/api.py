"""The public sparse MLA decode: validate once, then dispatch (Triton on CUDA tensors, PyTorch otherwise)."""

from __future__ import annotations

import math
import numbers

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.mla_entry import MlaEntryFormat, check_k_scale, mla_pages_format
from dsacache.ops.checks import check_int, check_tensor
from dsacache.ops.sparse_mla import naive

#: The shapes the op is built and tested for.
MAX_HEADS = 128
MAX_QUERY_ROWS = 4
MAX_TOPK = 4096


def _check_query(q: object, kv_lora_rank: int) -> tuple[int, int, int, int]:
    check_tensor("q", q)
    if q.dim() != 4 or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bfloat16 [B, s_q, H, kv_lora_rank + rope], got {tuple(q.shape)} {q.dtype}")
    batch, s_q, num_heads, dim = q.shape
    if not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"q has H={num_heads} heads; allowed: 1 to {MAX_HEADS}")
    if not 1 <= s_q <= MAX_QUERY_ROWS:
        raise ValueError(f"q has s_q={s_q} query rows a request; allowed: 1 to {MAX_QUERY_ROWS}")
    if dim < kv_lora_rank:
        raise ValueError(f"q's last dim {dim} is below kv_lora_rank={kv_lora_rank}: it must be kv_lora_rank + rope")
    return batch, s_q, num_heads, dim


def _check_indices(indices: object, batch: int, s_q: int) -> None:
    check_tensor("indices", indices)
    if indices.dtype != torch.int32 or indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, s_q):
        raise ValueError(f"indices must be int32 [{batch}, {s_q}, topk], got {tuple(indices.shape)} {indices.dtype}")
    if not 1 <= indices.shape[2] <= MAX_TOPK:
        raise ValueError(f"indices has topk={indices.shape[2]} slots a row; allowed: 1 to {MAX_TOPK}")


def _check_softmax_scale(softmax_scale: object) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
            or not 0 < float(softmax_scale) < math.inf:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def _output(name: str, given: object, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, given)
    if tuple(given.shape) != shape or given.dtype != dtype or not given.is_contiguous() or given.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} tensor on {device}, "
                         f"got {tuple(given.shape)} {given.dtype} on {given.device}")
    return given


def sparse_mla_decode(
    q: torch.Tensor,
    mla_pages: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    kv_lora_rank: int = 512,
    kv_cache_dtype: str | MlaEntryFormat | None = None,
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of absorbed queries over their selected cache slots: ``(out, lse)``.

    For query row ``(b, s)`` and head ``h``, over the row's valid slots ``j``:
    ``out[b, s, h] = sum_j p_j v_j`` with ``p = softmax_j(softmax_scale * q[b, s, h] . k_j)``,
    where ``k_j`` is slot ``j``'s dequantized entry (all ``kv_lora_rank + rope`` values) and
    ``v_j`` its first ``kv_lora_rank`` values; ``lse[b, s, h]`` is the natural log of
    ``sum_j exp(softmax_scale * q[b, s, h] . k_j)`` (what decode context parallelism merges
    partial outputs with). A row without a valid slot gets ``out = 0`` and ``lse = -inf``. A
    slot listed twice counts twice. Prefill uses the same call with one row a token (``s_q = 1``).

    Args:
        q: ``[B, s_q, H, kv_lora_rank + rope]`` bfloat16 absorbed queries (``q_nope`` through
            ``W_UK``, then the rope part); ``H`` 1 to 128 with no padding, ``s_q`` 1 to 4, ``B``
            may be 0. Any strides.
        mla_pages: one layer's MLA pages ``[num_pages, 64, entry_bytes]`` uint8, strides
            ``(page_stride, entry_bytes, 1)`` with any page stride (``pool.mla_pages(layer)``).
            Never written.
        indices: ``[B, s_q, topk]`` int32 cache slots ``page * 64 + row`` (``positions_to_slots``
            of the top-k), ``topk`` 1 to 4096. A slot ``< 0`` or ``>= num_pages * 64`` is none
            and is never read, wherever it sits in the row.
        softmax_scale: the score scale, a positive float (``1 / sqrt(qk_head_dim)`` for K3.1).
        kv_lora_rank: values a latent has (V's width); ``rope = q.shape[-1] - kv_lora_rank``. The
            Triton path takes up to 512 (``NotImplementedError`` beyond).
        kv_cache_dtype: ``None`` reads the entry kind off the pages' width (``fp8_ds_mla``: 656 B
            at 512 + 64, 528 B at 512 + 0; ``bfloat16``; ``fp8``); a name or
            :class:`MlaEntryFormat` is checked against it.
        k_scale: for ``fp8`` entries (and only those), the per-tensor scale, a one-element
            float32 tensor on the pages' device; keys are ``e4m3 * k_scale``. Its value is read on
            the host only when it is on the CPU (a CUDA scale costs no sync and can be captured).
        out: optional preallocated ``[B, s_q, H, kv_lora_rank]`` bfloat16, contiguous (CUDA graphs).
        lse: optional preallocated ``[B, s_q, H]`` float32, contiguous.
        impl: ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(out, lse)``: ``[B, s_q, H, kv_lora_rank]`` bfloat16 and ``[B, s_q, H]`` float32.

    The GPU path multiplies bf16 operands on the tensor cores with fp32 accumulation, rounds the
    softmax weights to bf16 for the value product and keeps the LSE in fp32. Its Triton kernel
    never rounds a key (e4m3 and bf16 values are exact in bf16; ``fp8_ds_mla`` tile scales
    multiply the fp32 scores and the weights). On Hopper, 656-B ``fp8_ds_mla`` entries run Gluon
    kernels: up to 16 heads one that keeps keys exact the same way, more than 32 heads one that
    dequantizes each key value to bf16 once (``e4m3 * tile scale``, rounded, as FlashMLA does;
    ``launch.decode_kernel`` says which runs). The PyTorch path works in fp32 throughout. All are
    deterministic.

    Example::

        >>> from dsacache.formats.mla_entry import MlaEntryFormat, encode_entries
        >>> fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
        >>> pages = torch.zeros(2, 64, fmt.entry_bytes, dtype=torch.uint8)
        >>> pages[0, :3] = encode_entries(torch.randn(3, 512), torch.randn(3, 64), fmt)
        >>> q = torch.randn(1, 1, 12, 576, dtype=torch.bfloat16)
        >>> out, lse = sparse_mla_decode(q, pages, torch.tensor([[[0, 2, -1, 1]]], dtype=torch.int32), 576 ** -0.5)
        >>> out.shape, lse.shape
        (torch.Size([1, 1, 12, 512]), torch.Size([1, 1, 12]))
        >>> empty = sparse_mla_decode(q, pages, torch.full((1, 1, 4), -1, dtype=torch.int32), 0.1)
        >>> bool((empty[0] == 0).all()), bool(torch.isneginf(empty[1]).all())
        (True, True)
    """
    rank = check_int("kv_lora_rank", kv_lora_rank, 1)
    batch, s_q, num_heads, dim = _check_query(q, rank)
    fmt = mla_pages_format(mla_pages, rank, dim - rank, kv_cache_dtype)
    _check_indices(indices, batch, s_q)
    scale = _check_softmax_scale(softmax_scale)
    check_k_scale(k_scale, fmt, read_value=isinstance(k_scale, torch.Tensor) and k_scale.device.type == "cpu")
    tensors = dict(q=q, mla_pages=mla_pages, indices=indices)
    tensors.update({name: t for name, t in (("k_scale", k_scale), ("out", out), ("lse", lse)) if t is not None})
    check_same_device(**tensors)
    triton_path = use_triton(impl, *tensors.values())
    out = _output("out", out, (batch, s_q, num_heads, rank), torch.bfloat16, q.device)
    lse = _output("lse", lse, (batch, s_q, num_heads), torch.float32, q.device)
    if triton_path:
        from dsacache.ops.sparse_mla.launch import MAX_RANK, launch_sparse_mla_decode, triton_supports

        if not triton_supports(fmt):
            raise NotImplementedError(f"the Triton sparse MLA decode takes kv_lora_rank <= {MAX_RANK}, got {rank}; "
                                      "use impl='torch'")
        launch_sparse_mla_decode(q, mla_pages, indices, scale, fmt, k_scale, out, lse)
    else:
        naive.sparse_mla_decode(q, mla_pages, indices, scale, fmt, k_scale, out, lse)
    return out, lse
