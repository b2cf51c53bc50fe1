"""Public entry points: top-k positions of each logits row, and positions -> cache slots.

Triton runs when the tensors are on CUDA (or when ``impl="triton"`` is forced, which under
``TRITON_INTERPRET=1`` also runs on CPU); the PyTorch reference in ``naive.py`` otherwise.
"""

from __future__ import annotations

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.dispatch import check_same_device, use_triton
from dsacache.ops.topk import naive
from dsacache.runtime.block_table import check_block_table

#: Default number of positions kept per row (``index_topk`` of DeepSeek V3.2 and Kimi-K3.1).
DEFAULT_TOPK = 2048
#: Largest ``k`` the kernels are built and tested for.
MAX_TOPK = 4096


def _check_row_vector(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (rows,):
        raise ValueError(f"{name} must be int32 or int64 [{rows}], got {tuple(t.shape)} {t.dtype}")


def topk_indices(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    k: int = DEFAULT_TOPK,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Positions of the ``k`` largest valid logits of each row.

    Row ``r`` ranks ``logits[r, s : s + seq_lens[r]]`` with ``s = row_starts[r]`` (0 when
    ``row_starts`` is None); what lies past that window is never read, so it may hold
    anything (NaN, stale values). Ties go to the lower position; NaN inside the window
    ranks below ``-inf``.

    Args:
        logits: ``[R, L]`` float32 (rows may be strided; columns contiguous), e.g. the
            output of :func:`~dsacache.ops.indexer_logits.paged_decode_logits` with
            ``seq_lens = context_lens.flatten()``.
        seq_lens: ``[R]`` int32 or int64 valid length of each row (clamped to ``[0, L - s]``).
        k: positions per row, ``1 <= k <= 4096`` (2048 by default).
        row_starts: optional ``[R]`` int32 or int64 first valid column of each row (prefill's ``ks``,
            clamped to ``[0, L]``);
            positions are returned relative to it.
        out: optional preallocated ``[R, k]`` int32 contiguous output.
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``[R, k]`` int32: the ``min(seq_lens[r], k)`` chosen positions in ascending order,
        then ``-1``. The same input gives the same output on every run.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.5, 3.0, -1.0, 3.0, float("nan")]])
        >>> topk_indices(logits, torch.tensor([4], dtype=torch.int32), k=3)
        tensor([[0, 1, 3]], dtype=torch.int32)
    """
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logits must be float32 [R, L], got {tuple(logits.shape)} {logits.dtype}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"k={k}; allowed: 1..{MAX_TOPK}")
    num_rows, width = logits.shape
    check_same_device(logits=logits, seq_lens=seq_lens,
                      **({} if row_starts is None else {"row_starts": row_starts}))
    _check_row_vector("seq_lens", seq_lens, num_rows)
    if row_starts is not None:
        _check_row_vector("row_starts", row_starts, num_rows)
    if out is None:
        out = torch.empty(num_rows, k, dtype=torch.int32, device=logits.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (num_rows, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 [{num_rows}, {k}] tensor, got {tuple(out.shape)} {out.dtype}")
    if not use_triton(impl, logits):
        starts = torch.zeros_like(seq_lens) if row_starts is None else row_starts.clamp(0, width)
        lens = torch.minimum(seq_lens.clamp_min(0), width - starts)
        return out.copy_(naive.topk_positions(logits, lens, starts, k))

    from dsacache.ops.topk.launch import launch_topk

    if num_rows:  # the kernels clamp the lengths and starts themselves (no extra launches)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        launch_topk(logits, seq_lens.contiguous(), None if row_starts is None else row_starts.contiguous(), out)
    return out


def positions_to_slots(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    next_n: int = 1,
    num_pages: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Turn request-local token positions into cache slots for the sparse attention kernel.

    ``slot = block_table[r // next_n, pos // 64] * 64 + pos % 64`` for row ``r`` (decode
    rows come ``next_n`` to a request). ``-1`` stays ``-1``; a position whose block is unusable
    (past the table, or an entry that is negative or ``>= num_pages`` when given: the rule of
    :mod:`dsacache.runtime.block_table`) also gives ``-1``.

    Args:
        positions: ``[R, k]`` int32 (e.g. from :func:`topk_indices`).
        block_table: ``[R // next_n, max_blocks]`` int32 kernel page ids.
        next_n: query rows a request.
        num_pages: pages in the layer's view; entries at or past it give ``-1``.
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``[R, k]`` int32 slots.

    Example:
        >>> import torch
        >>> bt = torch.tensor([[5, 6, 7]], dtype=torch.int32)
        >>> positions_to_slots(torch.tensor([[0, 63, 64, 191, -1]], dtype=torch.int32), bt)
        tensor([[320, 383, 384, 511,  -1]], dtype=torch.int32)
    """
    if positions.dtype != torch.int32 or positions.dim() != 2:
        raise ValueError(f"positions must be int32 [R, k], got {tuple(positions.shape)} {positions.dtype}")
    if next_n < 1 or positions.shape[0] % next_n:
        raise ValueError(f"next_n={next_n} must be >= 1 and divide the {positions.shape[0]} rows")
    check_block_table(block_table, positions.shape[0] // next_n)
    check_same_device(positions=positions, block_table=block_table)
    limit = 2**31 // KERNEL_PAGE_SIZE if num_pages is None else num_pages
    if not use_triton(impl, positions):
        return naive.positions_to_slots(positions, block_table, next_n, limit)

    from dsacache.ops.topk.launch import launch_positions_to_slots

    out = torch.empty_like(positions, memory_format=torch.contiguous_format)
    if positions.numel():
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        launch_positions_to_slots(positions, table, out, next_n, limit, KERNEL_PAGE_SIZE)
    return out
