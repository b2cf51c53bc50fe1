"""Decode context parallelism (DCP): which rank stores a token, and where.

Position ``p`` belongs to rank ``(p // interleave) % world_size``; on that rank it sits at
the local position ``(p // (interleave * world_size)) * interleave + p % interleave``
(and back: :meth:`DcpSettings.global_position`).
Every rank keeps its own pool and a block table over its local positions. The formula is
defined once here, for ints and integer tensors alike; the Triton slot-mapping kernel
has its one ``@triton.jit`` copy (``slot_mapping_triton._dcp_local``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from dsacache.runtime.checks import int_arg

Positions = TypeVar("Positions", int, torch.Tensor)


@dataclass(frozen=True)
class DcpSettings:
    """The DCP group a rank belongs to: validated once, handed to the allocator, the slot
    mapping and the step metadata builder.

    Attributes:
        world_size: ranks a request's tokens are spread over (``decode_context_parallel_size``).
        rank: this rank, ``0 <= rank < world_size``.
        interleave: consecutive tokens a rank takes before the next rank's turn
            (``cp_kv_cache_interleave_size``); it must divide the block size (the allocator
            and the planner check that, they know the block).

    >>> dcp = DcpSettings(world_size=2, rank=1)
    >>> [dcp.owner(p) for p in range(4)], dcp.local_position(3), dcp.local_len(5)
    ([0, 1, 0, 1], 1, 2)
    >>> dcp.global_position(1)
    3
    """

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        int_arg(self.world_size, "DCP world_size (decode_context_parallel_size)", 1)
        int_arg(self.interleave, "DCP interleave (cp_kv_cache_interleave_size)", 1)
        int_arg(self.rank, "DCP rank", 0)
        if self.rank >= self.world_size:
            raise ValueError(f"DCP rank={self.rank} must be in [0, world_size={self.world_size})")

    @classmethod
    def from_config(cls, config, rank: int = 0) -> DcpSettings:
        """The settings of ``rank`` in the DCP group a :class:`CacheConfig` plans for."""
        return cls(config.decode_context_parallel_size, rank, config.cp_kv_cache_interleave_size)

    @property
    def cycle(self) -> int:
        """Positions after which the owner pattern repeats: ``interleave x world_size``."""
        return self.interleave * self.world_size

    def owner(self, position: Positions) -> Positions:
        """The rank that stores the token at ``position`` (an int, or elementwise over a tensor)."""
        return (position // self.interleave) % self.world_size

    def owns(self, position: Positions):
        """Whether this rank stores the token at ``position`` (bool, or a bool tensor)."""
        return self.owner(position) == self.rank

    def local_position(self, position: Positions) -> Positions:
        """The token's position in its owner's local sequence."""
        return (position // self.cycle) * self.interleave + position % self.interleave

    def global_position(self, local: Positions) -> Positions:
        """The inverse of :meth:`local_position` on this rank: the global position of this rank's
        ``local``-th token (an int, or elementwise over a tensor of non-negative local positions)."""
        return (local // self.interleave) * self.cycle + self.rank * self.interleave + local % self.interleave

    def local_len(self, seq_len: Positions) -> Positions:
        """How many of the positions ``[0, seq_len)`` this rank stores. Over an int32 tensor of
        lengths it stays on the device (graph-capturable) and returns int32."""
        full, rest = seq_len // self.cycle, seq_len % self.cycle - self.rank * self.interleave
        if isinstance(rest, torch.Tensor):
            return (full * self.interleave + rest.clamp(0, self.interleave)).to(torch.int32)
        return full * self.interleave + min(max(rest, 0), self.interleave)

    def check_block_size(self, block_size: int) -> None:
        """``ValueError`` unless the interleave divides ``block_size`` (so a row covers the same
        global tokens on every rank, and can be named by their content)."""
        if block_size % self.interleave:
            raise ValueError(f"DCP interleave={self.interleave} (cp_kv_cache_interleave_size) must divide "
                             f"block_size={block_size}")


#: No context parallelism: one rank stores every token.
NO_DCP = DcpSettings()


def check_dcp(dcp: object) -> DcpSettings:
    """``dcp`` itself, or a ``ValueError`` unless it is a :class:`DcpSettings`."""
    if not isinstance(dcp, DcpSettings):
        raise ValueError(f"dcp must be a DcpSettings (e.g. DcpSettings.from_config(config, rank)), "
                         f"got {type(dcp).__name__}")
    return dcp
