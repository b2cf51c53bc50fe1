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


#: Most pages a view may have for every slot (``page * 64 + offset``) to fit int32.
MAX_SLOT_PAGES = 2**31 // KERNEL_PAGE_SIZE


def _describe(value: object) -> str:
    return f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__


def _check_tensor(name: str, value: object, dtypes: tuple[torch.dtype, ...], shape: str, dims: int,
                  sizes: dict[int, int] | None = None) -> None:
    """``ValueError`` naming ``name`` unless it is a ``dims``-D tensor of one of ``dtypes`` whose
    dimension ``d`` is ``sizes[d]``; ``shape`` is how the message writes the expected shape."""
    ok = (isinstance(value, torch.Tensor) and value.dtype in dtypes and value.dim() == dims
          and all(value.shape[d] == n for d, n in (sizes or {}).items()))
    if not ok:
        kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a {shape} {kinds} tensor, got {_describe(value)}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"integers >= {low}" if high is None else f"integers {low}..{high}"
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")


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
        k: positions per row, an int, ``1 <= k <= 4096`` (2048 by default); ``k > L`` pads
            with ``-1``.
        row_starts: optional ``[R]`` int32 or int64 first valid column of each row (prefill's
            ``ks``, clamped to ``[0, L]``); positions are returned relative to it.
        out: optional preallocated ``[R, k]`` int32 contiguous output.
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``[R, k]`` int32: the ``min(seq_lens[r], k)`` chosen positions in ascending order,
        then ``-1`` (all ``-1`` for an empty window, e.g. ``L = 0``). The same input gives the
        same output on every run, on either path.

    Scratch: the kernels take their buffers from PyTorch's caching allocator on each call (inside
    a CUDA graph, from the graph's pool). At k = 2048 that is nothing for rows up to 4K wide on
    Hopper, about 130 KiB a row up to 32K there, and for wider rows (or on other GPUs) about 200
    KiB a row at large R to 330 KiB at R = 64 on 132 SMs: the candidate segments, the select's
    buffers, the histogram and the candidate pool (``launch.new_pool``), which grows with the
    filter programs a row.

    Raises:
        ValueError: naming the argument, for a wrong type, dtype, shape or device, before
            anything is written; the same on both paths.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.5, 3.0, -1.0, 3.0, float("nan")]])
        >>> topk_indices(logits, torch.tensor([4], dtype=torch.int32), k=3)
        tensor([[0, 1, 3]], dtype=torch.int32)
    """
    _check_tensor("logits", logits, (torch.float32,), "[R, L]", 2)
    _check_int("k", k, 1, MAX_TOPK)
    num_rows, width = logits.shape
    lengths = (torch.int32, torch.int64)
    _check_tensor("seq_lens", seq_lens, lengths, f"[{num_rows}]", 1, {0: num_rows})
    if row_starts is not None:
        _check_tensor("row_starts", row_starts, lengths, f"[{num_rows}]", 1, {0: num_rows})
    if out is not None:
        _check_tensor("out", out, (torch.int32,), f"[{num_rows}, {k}]", 2, {0: num_rows, 1: k})
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    given = {"seq_lens": seq_lens, "row_starts": row_starts, "out": out}
    check_same_device(logits=logits, **{name: t for name, t in given.items() if t is not None})
    if out is None:
        out = torch.empty(num_rows, k, dtype=torch.int32, device=logits.device)
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
        next_n: query rows a request, an int ``>= 1`` that divides ``R``.
        num_pages: pages in the layer's view, an int in ``0 .. 2**31 / 64`` (every slot then
            fits int32); entries at or past it give ``-1``. None: ``2**31 / 64``.
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``[R, k]`` int32 slots.

    Raises:
        ValueError: naming the argument, for a wrong type, dtype, shape, value or device;
            the same on both paths.

    Example:
        >>> import torch
        >>> bt = torch.tensor([[5, 6, 7]], dtype=torch.int32)
        >>> positions_to_slots(torch.tensor([[0, 63, 64, 191, -1]], dtype=torch.int32), bt)
        tensor([[320, 383, 384, 511,  -1]], dtype=torch.int32)
    """
    _check_tensor("positions", positions, (torch.int32,), "[R, k]", 2)
    _check_int("next_n", next_n, 1)
    if positions.shape[0] % next_n:
        raise ValueError(f"next_n={next_n} must divide the {positions.shape[0]} rows of positions")
    check_block_table(block_table, positions.shape[0] // next_n)
    if num_pages is not None:
        _check_int("num_pages", num_pages, 0, MAX_SLOT_PAGES)
    check_same_device(positions=positions, block_table=block_table)
    limit = MAX_SLOT_PAGES if num_pages is None else num_pages
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
