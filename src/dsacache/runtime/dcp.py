"""Decode context parallelism (DCP): which rank stores a token, and where.

Position ``p`` belongs to rank ``(p // interleave) % world``; on that rank it sits at the
local position ``(p // (interleave * world)) * interleave + p % interleave``. Every rank
keeps its own pool and a block table over its local positions.
"""

from __future__ import annotations

import torch


def check_dcp(world_size: int, rank: int, interleave: int) -> None:
    """Raise a ``ValueError`` naming the bad DCP setting."""
    if world_size < 1:
        raise ValueError(f"dcp_world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"dcp_rank={rank} must be in [0, dcp_world_size={world_size})")
    if interleave < 1:
        raise ValueError(f"dcp_interleave={interleave} must be >= 1")


def dcp_owner(position: int, world_size: int, interleave: int) -> int:
    """The DCP rank that stores the token at ``position``."""
    return (position // interleave) % world_size


def dcp_local_position(position: int, world_size: int, interleave: int) -> int:
    """The token's position in its owner's local sequence."""
    return (position // (interleave * world_size)) * interleave + position % interleave


def dcp_local_len(seq_len: int, world_size: int, rank: int, interleave: int) -> int:
    """How many of the positions ``[0, seq_len)`` rank ``rank`` stores."""
    cycle = interleave * world_size
    full, rest = divmod(seq_len, cycle)
    return full * interleave + min(max(rest - rank * interleave, 0), interleave)


def dcp_local_lens(seq_lens: torch.Tensor, world_size: int, rank: int, interleave: int) -> torch.Tensor:
    """:func:`dcp_local_len` over a tensor of lengths (device ops only, graph-capturable)."""
    cycle = interleave * world_size
    lens = seq_lens.to(torch.int32)
    rest = (lens % cycle - rank * interleave).clamp(0, interleave)
    return (lens // cycle * interleave + rest).to(torch.int32)
