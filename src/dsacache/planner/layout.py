"""The planner: a :class:`CacheConfig` in, a :class:`CacheLayout` out. Pure Python.

For a KDA-hybrid DSA model the layout is the packed block row of ``docs/planning.md``: equal
rows that hold either ``block_size`` tokens of every attention layer (an attention row)
or ``states_per_row`` KDA states (a state row). Other models get a plain paged layout
whose rows are single 64-token kernel pages. Byte pictures: ``docs/layout.md``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from dsacache.config.model import check_int
from dsacache.config.serving import MAX_CACHE_MEMORY_BYTES, CacheConfig, ConfigError
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.planner import accounting as acc
from dsacache.planner.accounting import StateShape


@dataclass(frozen=True)
class AttentionSlot:
    """Where one attention layer's pages sit inside a 64-token sub-row (byte offsets)."""

    layer: int  # 1-based model layer number
    mla_offset: int
    mla_entry_bytes: int
    index_offset: int
    index_entry_bytes: int  # 0 without an indexer


@dataclass(frozen=True)
class DraftSlot:
    """Where one dense MLA draft layer's page sits inside a 64-token sub-row."""

    index: int  # 0-based draft layer
    mla_offset: int
    mla_entry_bytes: int


@dataclass(frozen=True)
class StateSlot:
    """Where one KDA layer's state sits among a request's state rows."""

    layer: int  # 1-based model layer number
    state_row: int  # 0-based among the request's state rows
    slot: int  # 0..states_per_row-1
    offset: int  # bytes from the start of the row


@dataclass(frozen=True)
class CacheLayout:
    """The planned pool. ``kind`` is ``"packed"`` or ``"paged"``; see the module docstring."""

    config: CacheConfig
    kind: str
    block_size: int
    reference_tp: int
    row_bytes_per_token: int
    mla_bytes_per_token: int
    index_bytes_per_token: int
    draft_bytes_per_token: int
    state: StateShape | None
    states_per_row: int
    num_rows: int
    dsa_layers: tuple[AttentionSlot, ...]
    draft_layers: tuple[DraftSlot, ...]
    kda_layers: tuple[StateSlot, ...]
    pow2_block_size: int | None
    kernel_page_size: int = KERNEL_PAGE_SIZE

    @property
    def is_packed(self) -> bool:
        """KDA-hybrid DSA model: rows hold either attention blocks or KDA states."""
        return self.kind == "packed"

    @property
    def pages_per_row(self) -> int:
        """64-token kernel pages (sub-rows) in one row."""
        return self.block_size // self.kernel_page_size

    @property
    def page_stride_bytes(self) -> int:
        """``stride(0)`` of every per-layer paged view: one 64-token sub-row."""
        return self.kernel_page_size * self.row_bytes_per_token

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, attention or state: ``block_size x row_bytes_per_token``."""
        return self.block_size * self.row_bytes_per_token

    @property
    def tokens_per_row(self) -> int:
        """A request's tokens one attention row covers: ``block_size x`` the DCP world size
        (each rank stores its share of them in its own copy of the row)."""
        return self.block_size * self.config.decode_context_parallel_size

    @property
    def num_kernel_pages(self) -> int:
        """Kernel pages in the pool: the first dim of every per-layer view."""
        return self.num_rows * self.pages_per_row

    @property
    def guard_rows(self) -> int:
        """Rows the pool allocates in front of row 0 and hands to no request: 1 when the layout holds
        KDA states (a state index of ``-1`` then addresses this guard row in every per-layer state
        view, so state kernels without a padding check, such as fla-core's, write padded batch
        entries there), else 0. Counted in :attr:`pool_bytes` and in the rows the budget gives."""
        return 1 if self.state_rows_per_request else 0

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool (one allocation per GPU): ``num_rows`` rows plus the guard rows."""
        return (self.num_rows + self.guard_rows) * self.row_bytes

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds if every row is an attention row."""
        return self.num_rows * self.block_size

    @property
    def state_bytes(self) -> int:
        """One KDA layer's state on one TP rank (conv + recurrent), 0 without KDA."""
        return self.state.nbytes if self.state else 0

    @property
    def num_kda_layers(self) -> int:
        """KDA layers of the model (S)."""
        return self.config.model.num_kda_layers

    @property
    def state_rows_per_request(self) -> int:
        """State rows one request owns: ``ceil(S / states_per_row)`` (0 when not packed)."""
        if not self.states_per_row:
            return 0
        return math.ceil(self.num_kda_layers / self.states_per_row)

    @property
    def indexer_head_dim(self) -> int | None:
        """Indexer key width, None without an indexer."""
        indexer = self.config.model.indexer
        return indexer.head_dim if indexer else None

    @property
    def indexer_kv_dtype(self) -> str:
        """Resolved indexer key format, ``"fp8"`` or ``"mxfp4"``."""
        return self.config.resolved_indexer_kv_dtype

    @property
    def indexer_key_format(self) -> IndexerKeyFormat | None:
        """The indexer key format of every DSA layer's pages (None without an indexer); the ops
        read the same format off the pages the pool hands out."""
        head_dim = self.indexer_head_dim
        return None if head_dim is None else IndexerKeyFormat.of(self.indexer_kv_dtype, head_dim)

    @property
    def mla_kv_cache_dtype(self) -> str:
        """MLA latent cache dtype of the target model."""
        return self.config.kv_cache_dtype

    def attention_rows_for(self, num_tokens: int) -> int:
        """Attention rows (on each rank) that a request of ``num_tokens`` tokens occupies; see
        :func:`attention_rows_for`, with this layout's block size and DCP world size."""
        return attention_rows_for(num_tokens, self.block_size, self.config.decode_context_parallel_size)

    def rows_per_request(self, num_tokens: int) -> int:
        """State rows plus attention rows that one request of ``num_tokens`` occupies (on each rank)."""
        return self.state_rows_per_request + self.attention_rows_for(num_tokens)

    def with_block_size(self, block_size: int) -> "CacheLayout":
        """The same pool bytes cut into rows of another block size (e.g. :attr:`pow2_block_size`)."""
        check_int(block_size, "block_size", self.kernel_page_size)
        if block_size % self.kernel_page_size:
            raise ConfigError(f"block_size={block_size} must be a multiple of {self.kernel_page_size}")
        row_bytes = block_size * self.row_bytes_per_token
        if row_bytes < self.states_per_row * self.state_bytes:
            raise ConfigError(f"block_size={block_size} rows cannot hold {self.states_per_row} KDA states")
        _check_interleave(self.config, block_size)
        num_rows = self.pool_bytes // row_bytes - self.guard_rows
        if num_rows < 1:
            raise ConfigError(f"the pool of {self.pool_bytes:,} B holds no row of block_size={block_size} "
                              f"({row_bytes:,} B) beside its guard row; raise cache_memory_bytes "
                              "(--kv-cache-memory-bytes)")
        return dataclasses.replace(self, block_size=block_size, num_rows=num_rows)


def _check_interleave(config: CacheConfig, block_size: int) -> None:
    """A row must cover the same global tokens on every DCP rank: the interleave divides the block."""
    interleave = config.cp_kv_cache_interleave_size
    if block_size % interleave:
        raise ConfigError(f"cp_kv_cache_interleave_size={interleave} must divide the block size {block_size}; "
                          "use 1 or a power of two up to 64")


def attention_rows_for(num_tokens: int, block_size: int, dcp_world_size: int = 1) -> int:
    """Attention rows a request of ``num_tokens`` tokens occupies on each rank.

    The one rule behind the planner's concurrency figure, the row allocator and the
    simulator. A row holds ``block_size`` tokens of each rank's share of the request, and
    under decode context parallelism every rank holds the same row ids, so a row covers
    ``block_size x dcp_world_size`` of the request's tokens: ``ceil(num_tokens / that)``.
    (That is rank 0's count, the busiest rank, whenever the interleave divides the block.)

    >>> attention_rows_for(3000, 1216), attention_rows_for(3000, 1216, dcp_world_size=2)
    (3, 2)
    """
    integer = type(num_tokens) is int or (isinstance(num_tokens, numbers.Integral) and not isinstance(num_tokens, bool))
    if not integer or num_tokens < 0:
        raise ConfigError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    return -(-int(num_tokens) // (block_size * dcp_world_size))


def packed_block_size(config: CacheConfig, row_bytes_per_token: int, states_per_row: int) -> tuple[int, int]:
    """(block_size, reference_tp): the TP-invariant packed block size of ``docs/planning.md``.

    ``reference_tp = lcm(config.reference_tp, tp)``; the number of alignment units is
    computed at the reference TP (where the state is smallest) and the block scaled by
    ``reference_tp / tp``, so block sizes at TP sizes dividing the reference divide each other.
    """
    acc.check_config(config)
    check_int(row_bytes_per_token, "row_bytes_per_token", 1)
    check_int(states_per_row, "states_per_row", 1)
    tp, align = config.tensor_parallel_size, config.alignment
    reference_tp = math.lcm(config.reference_tp, tp)
    need = states_per_row * acc.state_bytes(config) * tp
    units = -(-need // (align * reference_tp * row_bytes_per_token))
    return align * units * (reference_tp // tp), reference_tp


def pow2_block_size(row_bytes_per_token: int, states_bytes: int, page: int = KERNEL_PAGE_SIZE) -> int:
    """The smallest ``page x 2**k`` block whose row holds ``states_bytes`` (closed form, no loop)."""
    check_int(row_bytes_per_token, "row_bytes_per_token", 1)
    check_int(states_bytes, "states_bytes", 0)
    check_int(page, "page", 1)
    pages = -(-states_bytes // (page * row_bytes_per_token))
    return page << max(pages - 1, 0).bit_length()


def _attention_slots(config: CacheConfig, mla: int, index: int) -> tuple[AttentionSlot, ...]:
    page, slots, offset = KERNEL_PAGE_SIZE, [], 0
    for layer in config.model.attention_layers:
        slots.append(AttentionSlot(layer, offset, mla, offset + page * mla, index))
        offset += page * (mla + index)
    return tuple(slots)


def _draft_slots(config: CacheConfig, start: int) -> tuple[DraftSlot, ...]:
    entry = acc.draft_entry_bytes(config)
    return tuple(
        DraftSlot(i, start + i * KERNEL_PAGE_SIZE * entry, entry) for i in range(acc.num_draft_layers(config))
    )


def _state_slots(config: CacheConfig, per_row: int, nbytes: int) -> tuple[StateSlot, ...]:
    layers = config.model.kda.layers
    return tuple(StateSlot(layer, i // per_row, i % per_row, (i % per_row) * nbytes) for i, layer in enumerate(layers))


def plan(config: CacheConfig, num_rows: int | None = None) -> CacheLayout:
    """Plan the pool for ``config``; ``num_rows`` overrides the count the memory budget gives.

    >>> layout = plan(CacheConfig.from_model("kimi-k3.1"))
    >>> layout.block_size, layout.row_bytes_per_token, layout.states_per_row
    (1024, 18912, 23)

    Raises :class:`ConfigError` if ``config`` is not a CacheConfig, ``num_rows`` is not an
    integer >= 1, the budget holds no row, or the pool would pass ``MAX_CACHE_MEMORY_BYTES``.
    """
    acc.check_config(config)
    if num_rows is not None:
        check_int(num_rows, "num_rows", 1)
    model = config.model
    mla, index = acc.mla_bytes_per_token(config), acc.index_bytes_per_token(config)
    draft = acc.draft_bytes_per_token(config)
    per_token = acc.row_bytes_per_token(config)
    state = acc.kda_state_shape(config)
    attention = _attention_slots(config, mla, index)
    drafts = _draft_slots(config, len(attention) * KERNEL_PAGE_SIZE * (mla + index))
    if model.is_packed_hybrid:
        per_row = acc.states_per_row(model.num_dsa_layers, model.num_kda_layers)
        block, reference_tp = packed_block_size(config, per_token, per_row)
        pow2 = pow2_block_size(per_token, per_row * state.nbytes)
        kind, kda_slots = "packed", _state_slots(config, per_row, state.nbytes)
    else:
        per_row, block, reference_tp, pow2 = 0, KERNEL_PAGE_SIZE, config.reference_tp, None
        kind, kda_slots = "paged", ()
    if state is not None and state.recurrent_offset % 4 or (state and state.nbytes % 4):
        raise ConfigError(f"KDA state of {state.nbytes} B is not 4-byte aligned; fp32 recurrent states need it")
    _check_interleave(config, block)
    guard = 1 if kda_slots else 0  # CacheLayout.guard_rows
    rows = _num_rows(config, block * per_token, block, per_token, guard) if num_rows is None else num_rows
    if (rows + guard) * block * per_token > MAX_CACHE_MEMORY_BYTES:
        raise ConfigError(f"num_rows={rows:,} rows of {block * per_token:,} B (and {guard} guard row) pass the "
                          f"{MAX_CACHE_MEMORY_BYTES:,} B pool limit (int64 offsets)")
    return CacheLayout(
        config=config, kind=kind, block_size=block, reference_tp=reference_tp,
        row_bytes_per_token=per_token, mla_bytes_per_token=mla, index_bytes_per_token=index,
        draft_bytes_per_token=draft, state=state, states_per_row=per_row, num_rows=rows,
        dsa_layers=attention, draft_layers=drafts, kda_layers=kda_slots, pow2_block_size=pow2,
    )


def _num_rows(config: CacheConfig, row_bytes: int, block: int, per_token: int, guard: int) -> int:
    """Rows the budget holds after ``guard`` guard rows; a budget under one row is refused, naming it and
    the row size."""
    rows = config.cache_memory_bytes // row_bytes - guard
    if rows < 1:
        raise ConfigError(
            f"cache_memory_bytes={config.cache_memory_bytes:,} B (--kv-cache-memory-bytes) holds no row: one row "
            f"is {row_bytes:,} B ({block} tokens x {per_token:,} B/token){' plus the guard row' if guard else ''}; "
            f"give at least {(1 + guard) * row_bytes:,} B"
        )
    return rows
