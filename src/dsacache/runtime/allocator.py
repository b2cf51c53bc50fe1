"""The row allocator: which request owns which rows of the pool.

All rows are equal and come from one free list. A request owns
``state_rows_per_request`` *state rows* (its KDA states) for its whole life, and one
*attention row* per ``block_size`` tokens (per ``block_size x dcp.world_size`` tokens
with decode context parallelism: every rank holds the same row ids, each storing its
share of the row's tokens).

Every row is in exactly one of three places: the free list, in use (reference count
>= 1), or parked in the prefix cache (a full block nobody owns, reusable by content
until its row is needed). Adding or extending a request either gets all the rows it
needs or raises ``OutOfRowsError`` and changes nothing.

Prefix reuse shares attention rows, and KDA states through checkpoints. A request whose
prompt starts with cached full blocks shares those rows (reference counted) and gets its
own state rows. At most ``(len(prompt) - 1) // tokens_per_row`` blocks are shared, so the
last prompt token is always computed and a request never writes into a shared row.

A KDA state sums up the whole prefix before it, so sharing blocks alone saves memory and
key writes but no prefill: the engine would still run every cached token through the KDA
layers. A *checkpoint* is a copy of a request's state rows (every KDA layer's conv and
recurrent state) taken when its prefill stands exactly at the end of a block; it lives in
``state_rows_per_request`` rows owned by the prefix cache, named by that block's hash,
parked (evictable, LRU with the cached blocks) whenever no copy to or from it is pending,
and counted in the pool's rows like any other; while two or more requests share the block it
ends it is kept out of eviction. A new request whose shared blocks reach a
checkpoint gets its states copied from it and skips the prefill of every token before it
(:meth:`RowAllocator.restored_tokens`): attention blocks and indexer keys are reused, the
KDA states restored. The deepest checkpoint among the shared blocks is used.

Policy (:meth:`RowAllocator.checkpoint_positions`): a prompt asks for a checkpoint at two
block boundaries at most, each only if that block has none yet:

* the end of its shared prefix (its deepest cached full block): another prompt is known to
  have diverged there (a system prompt, a few-shot header), so the next prompt with that
  prefix restores from it;
* its last full block ``(len(prompt) - 1) // tokens_per_row``: the continuation of the same
  conversation (the next turn's prompt starts with this one) restores from there.

Checkpoints elsewhere would cost ``state_rows_per_request`` rows each (at K3.1 TP 8 as much
as three 1024-token blocks) for prefixes no other prompt is known to share. The engine ends
a prefill chunk at each position and calls :meth:`RowAllocator.save_checkpoint`; the copies
(saves and restores, in order) are handed out by :meth:`RowAllocator.pop_state_copies`, to
be applied (:meth:`CachePool.copy_state_rows`) before the next step's layers run. A
checkpoint is taken only if rows are free, and restored only if its rows can be held until
the copy; otherwise the request runs its prefill as before.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.planner.layout import attention_rows_for
from dsacache.runtime.block_table import build_block_table, kernel_pages
from dsacache.runtime.checks import int_arg, optional_int_arg
from dsacache.runtime.dcp import NO_DCP, DcpSettings, check_dcp
from dsacache.runtime.prefix import BlockHash, PrefixCache, hash_block

RequestId = Hashable


def _check_id(request_id: object) -> RequestId:
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"request id must be hashable, got a {type(request_id).__name__}") from None
    return request_id


def _token_id_array(token_ids: object) -> array:
    """Token ids as an int64 ``array`` (one pass, before anything changes); see :class:`RowAllocator`."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype.is_complex \
                or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids as a tensor must be 1-D of an integer dtype, got {token_ids.dtype} "
                             f"{tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    elif hasattr(token_ids, "dtype") and hasattr(token_ids, "tolist"):  # a NumPy array
        if getattr(token_ids, "ndim", None) != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids as an array must be 1-D of an integer dtype, got {token_ids.dtype}")
        token_ids = token_ids.tolist()
    elif not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes, bytearray)):
        raise ValueError(f"token_ids must be a sequence of integers, got {type(token_ids).__name__}")
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token_ids must hold integers in the int64 range ({exc})") from None


def _tokens_and_count(token_ids, count, count_name: str) -> tuple[array | None, int]:
    """(token ids as an array or None, the token count): checked and consistent."""
    tokens = None if token_ids is None else _token_id_array(token_ids)
    if count is None:
        return tokens, len(tokens)
    count = int_arg(count, count_name)
    if tokens is not None and len(tokens) != count:
        raise ValueError(f"{count_name}={count} but {len(tokens)} token_ids")
    return tokens, count


class OutOfRowsError(RuntimeError):
    """Not enough free rows; the allocator is unchanged."""


@dataclass
class _Request:
    state_rows: list[int]
    rows: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    last_hash: BlockHash | None = None
    # Token ids of the unfinished block; None once ids stop being known (no more hashing).
    pending: array | None = field(default_factory=lambda: array("q"))
    hashes: list[BlockHash] = field(default_factory=list)  # chain hash of each full block
    num_restored_tokens: int = 0
    checkpoints: list[int] = field(default_factory=list)  # positions still to save


@dataclass
class _Copy:
    """Pending state-row copies: a save (request -> checkpoint) or a restore (checkpoint -> request);
    the checkpoint is held (not evictable) until they are handed out."""

    block_hash: BlockHash
    pairs: list[tuple[int, int]]


@dataclass
class PrefixStats:
    """Prompt tokens looked up and found in the prefix cache, over the allocator's life."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    restored_tokens: int = 0  # prompt tokens whose prefill a restored checkpoint skipped
    checkpoints_saved: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from reused blocks."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RowAllocator:
    """Rows of one pool handed to requests; see the module docstring for the rules.

    Every call checks all its arguments before it changes anything: a call that raises
    leaves the allocator exactly as it was. Request ids are any hashable values; token
    counts are integers (Python or NumPy, not ``bool``, not float); token ids are a
    sequence of integers in the int64 range (a list, tuple, range or ``array``, a 1-D
    NumPy integer array, or a 1-D integer torch tensor, read back to the host once;
    inside a list a ``bool`` counts as 0 or 1, as Python has it). An int64 ``array``
    (typecode ``"q"``) is used without a copy, and never modified.

    >>> alloc = RowAllocator(num_rows=8, block_size=128, state_rows_per_request=1)
    >>> alloc.add("a", list(range(200)))      # 1 state row + 2 attention rows
    0
    >>> alloc.num_free_rows
    5
    >>> alloc.extend("a", 100)                # 300 tokens now need a third row
    >>> alloc.free("a"); alloc.num_free_rows
    8
    """

    def __init__(
        self,
        num_rows: int,
        block_size: int,
        state_rows_per_request: int = 0,
        *,
        enable_prefix_reuse: bool = True,
        max_num_pages_per_request: int | None = None,
        dcp: DcpSettings = NO_DCP,
    ) -> None:
        self.num_rows = int_arg(num_rows, "num_rows", 1)
        self.block_size = int_arg(block_size, "block_size", KERNEL_PAGE_SIZE)
        if self.block_size % KERNEL_PAGE_SIZE:
            raise ValueError(f"block_size={block_size} must be a positive multiple of {KERNEL_PAGE_SIZE}")
        self.state_rows_per_request = int_arg(state_rows_per_request, "state_rows_per_request")
        self.max_num_pages_per_request = optional_int_arg(max_num_pages_per_request, "max_num_pages_per_request", 1)
        if not isinstance(enable_prefix_reuse, bool):
            raise ValueError(f"enable_prefix_reuse must be True or False, got {enable_prefix_reuse!r}")
        check_dcp(dcp).check_block_size(self.block_size)
        self.pages_per_row = self.block_size // KERNEL_PAGE_SIZE
        self.dcp = dcp
        self.tokens_per_row = self.block_size * dcp.world_size
        # Rank 0 stores the most of every request: its page count sizes every rank's table.
        self._busiest_rank = dataclasses.replace(dcp, rank=0)
        self.prefix = PrefixCache() if enable_prefix_reuse else None
        self.stats = PrefixStats()
        # Popped from the end: rows are handed out in increasing order from a fresh pool.
        self._free: list[int] = list(range(self.num_rows - 1, -1, -1))
        self._refs = [0] * self.num_rows
        self._requests: dict[RequestId, _Request] = {}
        self._copies: list[_Copy] = []

    @classmethod
    def from_layout(cls, layout, *, num_rows: int | None = None, **kwargs) -> RowAllocator:
        """An allocator for a planned ``CacheLayout`` (DCP settings from its config)."""
        kwargs.setdefault("dcp", DcpSettings.from_config(layout.config))
        return cls(
            num_rows if num_rows is not None else layout.num_rows,
            layout.block_size,
            layout.state_rows_per_request,
            **kwargs,
        )

    # Counters ------------------------------------------------------------------------

    @property
    def num_free_rows(self) -> int:
        """Rows a new allocation can take: free ones plus parked ones (evicted on demand)."""
        return len(self._free) + self._num_parked()

    @property
    def num_used_rows(self) -> int:
        """Rows owned by live requests (state and attention rows)."""
        return self.num_rows - self.num_free_rows

    @property
    def num_cached_rows(self) -> int:
        """Parked rows: full blocks no request owns that a prefix hit can still reuse."""
        return self._num_parked()

    @property
    def num_requests(self) -> int:
        """Live requests."""
        return len(self._requests)

    @property
    def num_checkpoint_rows(self) -> int:
        """Rows holding KDA state checkpoints (parked, or held by a pending copy)."""
        return self.prefix.num_checkpoint_rows if self.prefix else 0

    def _num_parked(self) -> int:
        return self.prefix.num_parked if self.prefix else 0

    def rows_for_tokens(self, num_tokens: int) -> int:
        """Attention rows that hold ``num_tokens`` tokens (the planner's rule,
        :func:`dsacache.planner.layout.attention_rows_for`)."""
        return attention_rows_for(num_tokens, self.block_size, self.dcp.world_size)

    # Lifecycle -----------------------------------------------------------------------

    def can_add(self, token_ids: Sequence[int] | None = None, num_tokens: int | None = None) -> bool:
        """Whether ``add`` would succeed now for a prompt of these tokens."""
        token_ids, num_tokens = self._prompt(token_ids, num_tokens)
        hits = self._lookup_prefix(token_ids, num_tokens)
        return self._new_rows_for_prompt(num_tokens, hits) <= self._rows_available(hits)

    def add(
        self,
        request_id: RequestId,
        token_ids: Sequence[int] | None = None,
        num_tokens: int | None = None,
    ) -> int:
        """Allocate a new request's state rows and the attention rows of its prompt.

        Give ``token_ids`` to take part in prefix reuse (or only ``num_tokens``, to opt
        out). Returns how many leading prompt tokens are already in the cache.
        Raises ``OutOfRowsError`` (nothing allocated) when the rows are not there.
        """
        if _check_id(request_id) in self._requests:
            raise ValueError(f"request id {request_id!r} is already allocated")
        token_ids, num_tokens = self._prompt(token_ids, num_tokens)
        hits = self._lookup_prefix(token_ids, num_tokens)
        needed = self._new_rows_for_prompt(num_tokens, hits)
        if needed > self._rows_available(hits):
            raise OutOfRowsError(
                f"request {request_id!r} needs {needed} new rows, {self._rows_available(hits)} are free"
            )
        restore = self._restorable(hits, needed)
        # Hits (and the checkpoint) leave the parked set before any new row is taken, so none is evicted.
        request = _Request(state_rows=[])
        self._share_hits(request, hits)
        if restore is not None:
            self._pin(restore[1])
        request.state_rows = self._take_rows(self.state_rows_per_request)
        self._requests[request_id] = request
        self._grow(request, num_tokens - request.num_tokens, self._tail(token_ids, request.num_tokens))
        if restore is not None:
            blocks, block_hash = restore
            rows = self.prefix.checkpoint(block_hash)
            self._copies.append(_Copy(block_hash, list(zip(rows, request.state_rows))))
            request.num_restored_tokens = blocks * self.tokens_per_row
        request.checkpoints = self._positions(request, num_tokens, len(hits))
        self.stats.prompt_tokens += num_tokens
        self.stats.hit_tokens += request.num_cached_tokens
        self.stats.restored_tokens += request.num_restored_tokens
        return request.num_cached_tokens

    def can_extend(self, request_id: RequestId, num_new_tokens: int) -> bool:
        """Whether ``extend`` by ``num_new_tokens`` would succeed now."""
        request = self._get(request_id)
        return self._rows_to_grow(request, int_arg(num_new_tokens, "num_new_tokens")) <= self.num_free_rows

    def extend(
        self,
        request_id: RequestId,
        num_new_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Append tokens to a request, taking a new row whenever a block fills.

        Pass ``token_ids`` to keep hashing the blocks they complete (then
        ``num_new_tokens`` defaults to their count); without them the request's later
        blocks are not shared. Raises ``OutOfRowsError`` (nothing changes) when short.
        """
        request = self._get(request_id)
        if num_new_tokens is None and token_ids is None:
            raise ValueError("extend needs num_new_tokens or token_ids")
        token_ids, num_new_tokens = _tokens_and_count(token_ids, num_new_tokens, "num_new_tokens")
        needed = self._rows_to_grow(request, num_new_tokens)
        if needed > self.num_free_rows:
            raise OutOfRowsError(
                f"request {request_id!r} needs {needed} new rows, {self.num_free_rows} are free"
            )
        self._grow(request, num_new_tokens, token_ids)

    def free(self, request_id: RequestId) -> None:
        """Release a request: state rows go back to the free list, attention rows lose an owner.

        The tail block is released first so that, among one request's parked blocks, the
        deepest ones are evicted first and the shared prefix stays longest.
        """
        # Pending copies stay: no layer writes a row before they are applied, so a freed
        # request's rows still hold what a save reads, and later copies run after earlier ones.
        request = self._requests.pop(self._check_known(request_id))
        for row in reversed(request.rows):
            self._release(row)
        for row in request.state_rows:
            self._release(row)

    # KDA state checkpoints -----------------------------------------------------------

    def restored_tokens(self, request_id: RequestId) -> int:
        """Leading prompt tokens whose prefill is skipped: its states come from a checkpoint
        (0 without one). Always a multiple of ``tokens_per_row`` and ``<=`` the cached tokens."""
        return self._get(request_id).num_restored_tokens

    def checkpoint_positions(self, request_id: RequestId) -> list[int]:
        """Token positions (block boundaries, ascending) at which the request's prefill should stop
        and :meth:`save_checkpoint`; see the module docstring for the policy."""
        return list(self._get(request_id).checkpoints)

    def save_checkpoint(self, request_id: RequestId, num_computed_tokens: int) -> bool:
        """Keep a copy of the request's states, computed up to ``num_computed_tokens``, one of its
        :meth:`checkpoint_positions`. Takes ``state_rows_per_request`` rows for the prefix cache and
        queues the copy (:meth:`pop_state_copies`); False (nothing changes but the position is
        dropped) when the block got a checkpoint meanwhile or the rows are not free."""
        request = self._get(request_id)
        position = int_arg(num_computed_tokens, "num_computed_tokens")
        if position not in request.checkpoints:
            raise ValueError(f"num_computed_tokens={position} is not one of the request's checkpoint positions "
                             f"{request.checkpoints}")
        request.checkpoints.remove(position)
        block_hash = request.hashes[position // self.tokens_per_row - 1]
        if self.prefix.checkpoint(block_hash) is not None or self.num_free_rows < self.state_rows_per_request:
            return False
        rows = self._take_rows(self.state_rows_per_request)
        self.prefix.add_checkpoint(block_hash, rows)
        self._copies.append(_Copy(block_hash, list(zip(request.state_rows, rows))))
        self.stats.checkpoints_saved += 1
        return True

    def pop_state_copies(self) -> list[tuple[int, int]]:
        """The pending ``(source row, destination row)`` copies, in the order they must run, once:
        apply them (:meth:`CachePool.copy_state_rows`) before the next step's layers run. The
        checkpoints they read or write become evictable again."""
        pairs = [pair for copy in self._copies for pair in copy.pairs]
        for copy in self._copies:
            self._unpin(copy.block_hash)
        self._copies = []
        return pairs

    # Queries -------------------------------------------------------------------------

    def has_request(self, request_id: RequestId) -> bool:
        """Whether ``request_id`` is live."""
        return request_id in self._requests

    def request_ids(self) -> list[RequestId]:
        """Live request ids, in admission order."""
        return list(self._requests)

    def state_rows(self, request_id: RequestId) -> list[int]:
        """The request's KDA state rows (``state_rows_per_request`` of them)."""
        return list(self._get(request_id).state_rows)

    def attention_rows(self, request_id: RequestId) -> list[int]:
        """The request's attention rows, in token order."""
        return list(self._get(request_id).rows)

    def num_tokens(self, request_id: RequestId) -> int:
        """Tokens the request holds in the cache."""
        return self._get(request_id).num_tokens

    def num_pages(self, request_id: RequestId) -> int:
        """Kernel pages the request's tokens use on the busiest DCP rank (rank 0)."""
        local = self._busiest_rank.local_len(self._get(request_id).num_tokens)
        return -(-local // KERNEL_PAGE_SIZE)

    def kernel_pages(self, request_id: RequestId) -> list[int]:
        """The request's kernel page ids in token order (its row of the block table)."""
        request = self._get(request_id)
        return kernel_pages(request.rows, self.pages_per_row, self.num_pages(request_id))

    def block_table(
        self,
        request_ids: Iterable[RequestId],
        width: int | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """int32 ``[B, width]`` kernel-page block table of these requests, ``-1``-padded."""
        pages = [self.kernel_pages(rid) for rid in request_ids]
        max_width = self.max_num_pages_per_request
        if max_width is None:
            max_width = self.num_rows * self.pages_per_row
        return build_block_table(pages, width, max_width=max_width, device=device)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a row is lost, doubly owned or miscounted (for tests)."""
        owners = [0] * self.num_rows
        for request in self._requests.values():
            for row in request.rows + request.state_rows:
                owners[row] += 1
        for copy in self._copies:
            for row in self.prefix.checkpoint(copy.block_hash):
                owners[row] += 1
        parked = self.prefix.parked_rows() if self.prefix else []
        # A checkpoint whose block a request holds is neither parked nor owned by a request.
        held = [r for r in range(self.num_rows) if self.prefix and self.prefix.is_checkpoint_row(r)
                and not owners[r] and not self.prefix.is_parked(r)]
        places = sorted(self._free + parked + held + [r for r in range(self.num_rows) if owners[r]])
        if places != list(range(self.num_rows)):
            raise AssertionError("a row is lost or in two places")
        if owners != self._refs:
            raise AssertionError("reference counts disagree with the requests' rows")
        for request in self._requests.values():
            if any(owners[row] != 1 for row in request.state_rows):
                raise AssertionError("a state row is shared")
            if len(request.rows) != self.rows_for_tokens(request.num_tokens):
                raise AssertionError("a request holds the wrong number of attention rows")

    # Internals -----------------------------------------------------------------------

    def _check_known(self, request_id: RequestId) -> RequestId:
        if _check_id(request_id) not in self._requests:
            raise ValueError(f"unknown request id {request_id!r}")
        return request_id

    def _get(self, request_id: RequestId) -> _Request:
        return self._requests[self._check_known(request_id)]

    @staticmethod
    def _prompt(token_ids, num_tokens) -> tuple[array | None, int]:
        if token_ids is None and num_tokens is None:
            raise ValueError("give token_ids or num_tokens")
        return _tokens_and_count(token_ids, num_tokens, "num_tokens")

    @staticmethod
    def _tail(token_ids: array | None, start: int) -> array | None:
        return None if token_ids is None else token_ids[start:]

    def _lookup_prefix(self, token_ids: Sequence[int] | None, num_tokens: int) -> list[int]:
        """Rows of the cached leading full blocks of this prompt (never its last token)."""
        if self.prefix is None or token_ids is None or num_tokens == 0:
            return []
        hits, parent, size = [], None, self.tokens_per_row
        for i in range((num_tokens - 1) // size):
            parent = hash_block(parent, token_ids[i * size : (i + 1) * size])
            row = self.prefix.lookup(parent)
            if row is None:
                break
            hits.append(row)
        return hits

    def _new_rows_for_prompt(self, num_tokens: int, hits: list[int]) -> int:
        return self.state_rows_per_request + self.rows_for_tokens(num_tokens) - len(hits)

    def _rows_available(self, hits: list[int]) -> int:
        """Free rows once the hit rows, if parked, are taken out of the evictable set, and with them
        the parked checkpoints of hit blocks that another request already holds (sharing them holds
        the checkpoint: :meth:`_settle`)."""
        taken = 0
        for row in hits:
            if self.prefix.is_parked(row):
                taken += 1
            elif self._checkpoint_parked(self.prefix.hash_of(row)):
                taken += self.state_rows_per_request
        return self.num_free_rows - taken

    def _checkpoint_parked(self, block_hash: BlockHash) -> bool:
        rows = self.prefix.checkpoint(block_hash)
        return rows is not None and self.prefix.is_parked(rows[0])

    def _rows_to_grow(self, request: _Request, num_new_tokens: int) -> int:
        return self.rows_for_tokens(request.num_tokens + num_new_tokens) - len(request.rows)

    def _restorable(self, hits: list[int], needed: int) -> tuple[int, BlockHash] | None:
        """(blocks, hash) of the deepest checkpoint among the hits, if its rows can be held as well."""
        for blocks in range(len(hits), 0, -1):
            block_hash = self.prefix.hash_of(hits[blocks - 1])
            rows = self.prefix.checkpoint(block_hash)
            if rows is None:
                continue
            # Held once shared if another request holds the block (counted in _rows_available already).
            extra = self.state_rows_per_request if self.prefix.is_parked(hits[blocks - 1]) \
                and self.prefix.is_parked(rows[0]) else 0
            return (blocks, block_hash) if needed <= self._rows_available(hits) - extra else None
        return None

    def _positions(self, request: _Request, num_tokens: int, num_hits: int) -> list[int]:
        """The checkpoint policy of the module docstring, for a request just added."""
        if not self.state_rows_per_request or self.prefix is None:
            return []
        size, out = self.tokens_per_row, []
        for blocks in (num_hits, (num_tokens - 1) // size if num_tokens else 0):
            position = blocks * size
            if (blocks and blocks <= len(request.hashes) and position > request.num_restored_tokens
                    and position not in out and self.prefix.checkpoint(request.hashes[blocks - 1]) is None):
                out.append(position)
        return sorted(out)

    def _pin(self, block_hash: BlockHash) -> None:
        rows = self.prefix.checkpoint(block_hash)
        if self.prefix.is_parked(rows[0]):
            self.prefix.unpark_checkpoint(block_hash)
        for row in rows:
            self._refs[row] += 1

    def _unpin(self, block_hash: BlockHash) -> None:
        for row in self.prefix.checkpoint(block_hash):  # held, so never evicted meanwhile
            self._refs[row] -= 1
        self._settle(block_hash)

    def _settle(self, block_hash: BlockHash) -> None:
        """Park a checkpoint exactly when no copy holds it and fewer than two requests share the block
        it ends (a prefix in active use by several requests keeps its checkpoint out of eviction)."""
        rows = self.prefix.checkpoint(block_hash)
        if rows is None:
            return
        block = self.prefix.lookup(block_hash)
        held = self._refs[rows[0]] > 0 or (block is not None and self._refs[block] > 1)
        parked = self.prefix.is_parked(rows[0])
        if held and parked:
            self.prefix.unpark_checkpoint(block_hash)
        elif not held and not parked:
            self.prefix.park_checkpoint(block_hash)

    def _share_hits(self, request: _Request, hits: list[int]) -> None:
        for row in hits:
            if self._refs[row] == 0:
                self.prefix.unpark(row)
            self._refs[row] += 1
            request.rows.append(row)
            request.hashes.append(self.prefix.hash_of(row))
            self._settle(request.hashes[-1])
        request.num_tokens = request.num_cached_tokens = len(hits) * self.tokens_per_row
        if hits:
            request.last_hash = self.prefix.hash_of(hits[-1])

    def _take_rows(self, n: int) -> list[int]:
        rows = []
        while len(rows) < n:
            if not self._free:
                self._free.extend(reversed(self.prefix.evict()))
            rows.append(self._free.pop())
        for row in rows:
            self._refs[row] = 1
        return rows

    def _release(self, row: int) -> None:
        self._refs[row] -= 1
        named = self.prefix is not None and self.prefix.is_named(row)
        if not self._refs[row]:
            if named:
                self.prefix.park(row)
            else:
                self._free.append(row)
        if named:
            self._settle(self.prefix.hash_of(row))

    def _grow(self, request: _Request, num_new_tokens: int, token_ids: Sequence[int] | None) -> None:
        """Take the rows, then record the tokens (hashing every block they complete)."""
        request.rows += self._take_rows(self._rows_to_grow(request, num_new_tokens))
        request.num_tokens += num_new_tokens
        if token_ids is None or request.pending is None or self.prefix is None:
            request.pending = None
            return
        request.pending.extend(token_ids)
        size = self.tokens_per_row
        while len(request.pending) >= size:
            block, request.pending = request.pending[:size], request.pending[size:]
            request.last_hash = hash_block(request.last_hash, block)
            request.hashes.append(request.last_hash)
            index = request.num_tokens - len(request.pending) - size
            if self.prefix.insert(request.last_hash, request.rows[index // size]):
                self._settle(request.last_hash)
