"""Content-hash prefix reuse for attention rows and KDA state checkpoints.

A full block (one attention row's worth of tokens) is named by a hash chain: the hash
of block ``i`` covers the token ids of block ``i`` and the hash of block ``i - 1``, so two
requests share block ``i`` only when their whole prefix up to it is identical.

The cache maps a block hash to the row that holds it. A row whose last owner is freed
is *parked*: it keeps its hash and stays reusable until a new row is needed and it is
the least recently parked one. Reference counts live in the allocator; this module only
knows which rows are named and which of those are parked. Checkpoints (a request's KDA
states at the end of a block, see :mod:`dsacache.runtime.allocator`) are kept by the hash of
that block and parked in the same LRU.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chain hash of one full block: sha256 over the parent's hash and the int64 token ids."""
    if not (isinstance(token_ids, array) and token_ids.typecode == "q"):
        try:
            token_ids = array("q", token_ids)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"token_ids must be integers in the int64 range ({exc})") from None
    digest = hashlib.sha256(parent or b"")
    digest.update(token_ids.tobytes())
    return digest.digest()


class PrefixCache:
    """Block hash <-> row, KDA state checkpoints by block hash, and one LRU of parked rows.

    A checkpoint is the ``state_rows_per_request`` rows holding a request's KDA states as they
    were at the end of a block (named by that block's hash). Its rows are parked and
    evicted like block rows, as a unit: evicting any of them forgets the checkpoint and
    hands all its rows out, and forgetting a block forgets the checkpoint at its end.
    """

    def __init__(self) -> None:
        self._row_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()
        self._checkpoint: dict[BlockHash, tuple[int, ...]] = {}
        self._checkpoint_of: dict[int, BlockHash] = {}

    @property
    def num_parked(self) -> int:
        """Freed full blocks kept for reuse until their row is needed."""
        return len(self._parked)

    @property
    def num_named(self) -> int:
        """Rows that carry a content hash (in use or parked)."""
        return len(self._row_of)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The row holding this block, or None."""
        return self._row_of.get(block_hash)

    def hash_of(self, row: int) -> BlockHash:
        """The content hash ``row`` carries (``KeyError`` if it carries none; see :meth:`is_named`)."""
        return self._hash_of[row]

    def is_named(self, row: int) -> bool:
        """Whether ``row`` carries a content hash."""
        return row in self._hash_of

    def is_parked(self, row: int) -> bool:
        """Whether ``row`` is a freed block kept for reuse."""
        return row in self._parked

    def insert(self, block_hash: BlockHash, row: int) -> bool:
        """Name ``row`` by ``block_hash``; False (and nothing changes) if either is taken.

        A second copy of a block already cached stays anonymous: its row goes back to the
        free list when its owner is freed.
        """
        if block_hash in self._row_of or row in self._hash_of:
            return False
        self._row_of[block_hash] = row
        self._hash_of[row] = block_hash
        return True

    def park(self, row: int) -> None:
        """Mark a named row as owned by nobody; it becomes the most recently parked."""
        if row not in self._hash_of:
            raise ValueError(f"row {row} has no block hash and cannot be parked")
        self._parked[row] = None

    def unpark(self, row: int) -> None:
        """A prefix hit took a parked row back into use."""
        del self._parked[row]

    def evict(self) -> list[int]:
        """Forget the least recently parked entry and hand its rows out: one block row (plus the rows
        of a parked checkpoint at its end), or all rows of a checkpoint."""
        row = next(iter(self._parked))
        if row in self._checkpoint_of:
            return self._drop_checkpoint(self._checkpoint_of[row])
        del self._parked[row]
        block_hash = self._hash_of.pop(row)
        del self._row_of[block_hash]
        rows = self._checkpoint.get(block_hash, ())
        if rows and rows[0] in self._parked:
            return [row] + self._drop_checkpoint(block_hash)
        return [row]

    # Checkpoints ----------------------------------------------------------------------

    @property
    def num_checkpoint_rows(self) -> int:
        """Rows holding checkpoints (parked or in use by a pending copy)."""
        return len(self._checkpoint_of)

    def checkpoint(self, block_hash: BlockHash) -> tuple[int, ...] | None:
        """The state rows of the checkpoint at the end of this block, or None."""
        return self._checkpoint.get(block_hash)

    def add_checkpoint(self, block_hash: BlockHash, rows: Sequence[int]) -> None:
        """Register ``rows`` (in use: the caller parks them) as the checkpoint at the end of this block."""
        if block_hash in self._checkpoint or any(r in self._checkpoint_of or r in self._hash_of for r in rows):
            raise ValueError("the block already has a checkpoint, or a row is already named")
        self._checkpoint[block_hash] = tuple(rows)
        for row in rows:
            self._checkpoint_of[row] = block_hash

    def park_checkpoint(self, block_hash: BlockHash) -> None:
        """The checkpoint's rows have no user left: they become the most recently parked."""
        for row in self._checkpoint[block_hash]:
            self._parked[row] = None

    def unpark_checkpoint(self, block_hash: BlockHash) -> None:
        """A restore took a parked checkpoint back into use."""
        for row in self._checkpoint[block_hash]:
            del self._parked[row]

    def _drop_checkpoint(self, block_hash: BlockHash) -> list[int]:
        rows = list(self._checkpoint.pop(block_hash))
        for row in rows:
            del self._checkpoint_of[row]
            self._parked.pop(row, None)
        return rows

    def is_checkpoint_row(self, row: int) -> bool:
        """Whether ``row`` holds (part of) a checkpoint."""
        return row in self._checkpoint_of

    def parked_rows(self) -> list[int]:
        """Parked rows, least recently parked first (the eviction order)."""
        return list(self._parked)
