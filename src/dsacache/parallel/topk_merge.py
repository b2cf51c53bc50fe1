"""The exact global top-k of a request from its DCP ranks' local top-k.

Under decode context parallelism each rank scores only the tokens it stores and keeps its
local top-k. The global top-k is among the union of the local ones: every token that beats
a token ``t`` on its owner's rank (a higher score, or the same score at a lower position)
also beats ``t`` globally, because a rank's local positions keep the global order. So if
``t`` is in the global top-k, fewer than ``k`` tokens beat it on its own rank, and it is in
that rank's local top-k. Re-ranking the ``N x k`` candidates therefore gives exactly what
:func:`~dsacache.ops.topk.topk_indices` gives on the whole row.

A candidate travels as one int64 whose integer order is the top-k order:

* high 32 bits: the score's order key (``ops.topk.naive.sortable_keys``: ``-inf < ... < +inf``,
  NaN lowest, the order the one-GPU top-k ranks by) minus ``2**31``;
* low 32 bits: ``2**31 - 1 - p`` for the global position ``p`` (an equal score: the lower
  position wins);
* no candidate (a ``-1`` position): :data:`EMPTY`, below every real one.

So one all-gather of ``[R, k]`` int64 per rank carries the scores and the positions (8 bytes a
candidate), and the merge is an integer top-k whose keys are all distinct (no tie to break).
Every function here is fixed-shape device work with no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from dsacache.ops.topk.naive import sortable_keys
from dsacache.runtime.dcp import DcpSettings

#: The packed value of "no candidate": below every real candidate.
EMPTY = torch.iinfo(torch.int64).min
#: Global positions must stay below this for the low 32 bits to hold them.
MAX_POSITIONS = 2**31 - 1
_LOW = 2**32
_NONE = torch.iinfo(torch.int32).max  # sorts after every position


def pack_candidates(logits: torch.Tensor, positions: torch.Tensor, dcp: DcpSettings,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's local top-k as packed candidates (score order key and global position).

    Args:
        logits: ``[R, L]`` float32, the rank's scores over its local positions (the logits
            buffer the local top-k ranked).
        positions: ``[R, k]`` int32 local positions from :func:`~dsacache.ops.topk.topk_indices`
            (``-1`` = none).
        dcp: this rank's settings (maps local positions back to global ones).
        out: optional ``[R, k]`` int64 buffer.

    Returns:
        ``[R, k]`` int64 packed candidates (see the module docstring); :data:`EMPTY` where
        ``positions`` is ``-1``.

    >>> logits = torch.tensor([[0.5, 2.0, 2.0]])
    >>> dcp = DcpSettings(world_size=2, rank=1)
    >>> packed = pack_candidates(logits, torch.tensor([[1, 2, -1]], dtype=torch.int32), dcp)
    >>> unpack_positions(packed).tolist()   # local 1, 2 on rank 1 of 2 are global 3, 5
    [[3, 5, -1]]
    """
    valid = positions >= 0
    local = positions.clamp_min(0).to(torch.int64)
    keys = sortable_keys(torch.gather(logits, 1, local))
    packed = (keys - 2**31) * _LOW + (MAX_POSITIONS - dcp.global_position(local))
    packed = torch.where(valid, packed, torch.full_like(packed, EMPTY))
    return packed if out is None else out.copy_(packed)


def unpack_positions(packed: torch.Tensor) -> torch.Tensor:
    """The global positions of packed candidates, int32, ``-1`` for :data:`EMPTY`."""
    positions = MAX_POSITIONS - (packed & (_LOW - 1))
    return torch.where(packed == EMPTY, -1, positions).to(torch.int32)


def merge_topk(candidates: torch.Tensor, k: int, out: torch.Tensor | None = None,
               work: torch.Tensor | None = None) -> torch.Tensor:
    """The global top-k of each row from every rank's packed candidates.

    Args:
        candidates: ``[N, R, c]`` int64, rank ``r``'s candidates at ``[r]`` (the output of
            an all-gather of :func:`pack_candidates`), ``c >= k`` in all (``N * c >= k``).
        k: positions kept a row.
        out: optional ``[R, k]`` int32 buffer.
        work: optional ``[R, N, c]`` int64 buffer (the candidates row-major).

    Returns:
        ``[R, k]`` int32 global positions in ascending order, then ``-1`` (fewer than ``k``
        candidates): the same as ``topk_indices`` on the row's global logits.
    """
    num_ranks, rows, per_rank = candidates.shape
    if work is None:
        work = torch.empty(rows, num_ranks, per_rank, dtype=torch.int64, device=candidates.device)
    work.copy_(candidates.permute(1, 0, 2))
    best = torch.topk(work.view(rows, num_ranks * per_rank), k, dim=1, sorted=False).values
    positions = MAX_POSITIONS - (best & (_LOW - 1))
    positions = torch.where(best == EMPTY, _NONE, positions)
    ordered = torch.sort(positions, dim=1).values
    ordered = torch.where(ordered == _NONE, -1, ordered).to(torch.int32)
    return ordered if out is None else out.copy_(ordered)


def owned_local_positions(global_positions: torch.Tensor, dcp: DcpSettings,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """The selected positions this rank stores, as its local positions, packed to the front.

    Args:
        global_positions: ``[R, k]`` int32 global positions (``-1`` = none), e.g. from
            :func:`merge_topk`.
        dcp: this rank's settings.
        out: optional ``[R, k]`` int32 buffer.

    Returns:
        ``[R, k]`` int32: row ``r`` holds the local positions of the row's selected tokens
        that this rank owns, in ascending order, then ``-1`` (so a kernel that stops at a row's
        first ``-1`` reads only this rank's share).

    >>> dcp = DcpSettings(world_size=2, rank=1, interleave=2)
    >>> owned_local_positions(torch.tensor([[0, 2, 3, 6, -1]], dtype=torch.int32), dcp).tolist()
    [[0, 1, 2, -1, -1]]
    """
    mine = (global_positions >= 0) & dcp.owns(global_positions)
    local = dcp.local_position(global_positions.clamp_min(0))
    count = mine.sum(dim=1, keepdim=True)
    dest = torch.where(mine, mine.cumsum(dim=1) - 1, count + (~mine).cumsum(dim=1) - 1)
    values = torch.where(mine, local, -1).to(torch.int32)
    if out is None:
        out = torch.empty_like(values)
    return out.scatter_(1, dest, values)
