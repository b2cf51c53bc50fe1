"""Content-hash prefix reuse for attention rows.

A full block (one attention row's worth of tokens) is named by a hash chain: the hash
of block ``i`` covers the token ids of block ``i`` and the hash of block ``i - 1``, so two
requests share block ``i`` only when their whole prefix up to it is identical.

The cache maps a block hash to the row that holds it. A row whose last owner is freed
is *parked*: it keeps its hash and stays reusable until a new row is needed and it is
the least recently parked one. Reference counts live in the allocator; this module only
knows which rows are named and which of those are parked.
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
    """Block hash <-> row, plus an LRU of parked rows (named, no owner)."""

    def __init__(self) -> None:
        self._row_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()

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

    def evict(self) -> int:
        """Forget the least recently parked row's hash and hand the row out."""
        row, _ = self._parked.popitem(last=False)
        del self._row_of[self._hash_of.pop(row)]
        return row

    def parked_rows(self) -> list[int]:
        """Parked rows, least recently parked first (the eviction order)."""
        return list(self._parked)
