"""The pool: one allocation of ``num_rows x row_bytes`` bytes, and typed views into it.

Byte layout (drawn in ``docs/layout.md``): row ``r`` starts at ``r * row_bytes`` and is
``pages_per_row`` sub-rows of 64 tokens, sub-row ``j`` being kernel page
``r * pages_per_row + j``. Inside a sub-row every DSA layer's MLA page and indexer page sit
side by side, then the draft layers' MLA pages. So each layer's pages form one standard
paged view ``[num_kernel_pages, 64, entry]`` with ``stride(0) = page_stride_bytes``, the
shape DeepGEMM- and FlashMLA-style paged kernels take. A state row instead holds
``states_per_row`` KDA states back to back from its first byte (conv state, then the
recurrent state).

For a layout with KDA states the allocation starts with one guard row
(``layout.guard_rows``) in front of row 0: :attr:`CachePool.buffer` is the ``num_rows``
rows after it. Every per-layer state view (:meth:`CachePool.kda_state_views`) has
``stride(0)`` of one row, so a state index of ``-1`` lands in the guard row. Kernels that
write states through indices and have no padding check (fla-core's recurrent decode) thus
write padded batch entries there, never into a request's state; no request owns it and
nothing reads it.
"""

from __future__ import annotations

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.planner.layout import CacheLayout
from dsacache.runtime.allocator import RequestId, RowAllocator
from dsacache.runtime.checks import device_arg, int_list, is_int


class CachePool:
    """The packed (or paged) cache of one TP rank, plus the allocator handing out its rows.

    >>> from dsacache.planner import CacheConfig, plan
    >>> pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1"), num_rows=4))
    >>> pool.index_pages(4).shape, pool.index_pages(4).stride()
    (torch.Size([64, 64, 132]), (1210368, 132, 1))
    """

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu",
                 allocator: RowAllocator | None = None) -> None:
        if not isinstance(layout, CacheLayout):
            raise ValueError(f"layout must be a CacheLayout (from dsacache.planner.plan), got {type(layout).__name__}")
        if allocator is not None and not isinstance(allocator, RowAllocator):
            raise ValueError(f"allocator must be a RowAllocator or None, got {type(allocator).__name__}")
        device = device_arg(device)
        if layout.num_rows < 1:
            raise ValueError(f"layout.num_rows={layout.num_rows}: the pool needs at least one row")
        self.layout = layout
        guard = layout.guard_rows * layout.row_bytes
        self._allocation = torch.empty(guard + layout.num_rows * layout.row_bytes, dtype=torch.uint8, device=device)
        self.buffer = self._allocation[guard:]
        self.allocator = allocator if allocator is not None else RowAllocator.from_layout(layout)
        if self.allocator.num_rows > layout.num_rows or self.allocator.block_size != layout.block_size:
            raise ValueError("the allocator's rows or block size do not match the layout")
        self._dsa = {slot.layer: slot for slot in layout.dsa_layers}
        self._kda = {slot.layer: slot for slot in layout.kda_layers}

    @property
    def device(self) -> torch.device:
        """Device of the pool."""
        return self.buffer.device

    @property
    def num_kernel_pages(self) -> int:
        """Kernel pages in the pool: the first dim of every per-layer view."""
        return self.layout.num_kernel_pages

    # Paged views ---------------------------------------------------------------------

    def mla_pages(self, layer: int) -> torch.Tensor:
        """uint8 ``[num_kernel_pages, 64, mla_entry_bytes]`` MLA latent pages of DSA layer ``layer``."""
        slot = self._dsa_slot(layer)
        return self._paged_view(slot.mla_offset, slot.mla_entry_bytes)

    def index_pages(self, layer: int) -> torch.Tensor:
        """uint8 ``[num_kernel_pages, 64, index_entry_bytes]`` indexer key pages of DSA layer ``layer``."""
        slot = self._dsa_slot(layer)
        if not slot.index_entry_bytes:
            raise ValueError(f"layer {layer} has no indexer (the model has no dsa_config)")
        return self._paged_view(slot.index_offset, slot.index_entry_bytes)

    def draft_pages(self, index: int) -> torch.Tensor:
        """uint8 ``[num_kernel_pages, 64, entry]`` MLA pages of draft layer ``index`` (0-based)."""
        drafts = self.layout.draft_layers
        if not is_int(index) or not 0 <= index < len(drafts):
            raise ValueError(f"draft layer {index} does not exist; the layout has {len(drafts)} draft layers")
        return self._paged_view(drafts[index].mla_offset, drafts[index].mla_entry_bytes)

    def _dsa_slot(self, layer: int):
        if not is_int(layer) or layer not in self._dsa:
            raise ValueError(f"layer {layer} is not a DSA layer; DSA layers: {sorted(self._dsa)}")
        return self._dsa[layer]

    def _paged_view(self, offset: int, entry: int) -> torch.Tensor:
        shape = (self.layout.num_kernel_pages, KERNEL_PAGE_SIZE, entry)
        stride = (self.layout.page_stride_bytes, entry, 1)
        return self.buffer.as_strided(shape, stride, self.buffer.storage_offset() + offset)

    # Rows and states -----------------------------------------------------------------

    def row(self, row: int) -> torch.Tensor:
        """uint8 ``[row_bytes]``: the raw bytes of one row."""
        if not is_int(row) or not 0 <= row < self.layout.num_rows:
            raise ValueError(f"row must be an integer in [0, {self.layout.num_rows}), got {row!r}")
        size = self.layout.row_bytes
        return self.buffer[row * size : (row + 1) * size]

    def state_tensors(self, request_id: RequestId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv bf16 ``conv_shape``, recurrent fp32 ``recurrent_shape``) of KDA layer ``layer``
        for this request: views into the request's state rows, written in place by the model."""
        return self.state_tensors_at(self.allocator.state_rows(request_id), layer)

    def state_tensors_at(self, state_rows: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`state_tensors`, for an explicit list of a request's state rows."""
        state_rows = int_list(state_rows, "state_rows")
        slot, state = self._kda_slot(layer), self.layout.state
        if len(state_rows) != self.layout.state_rows_per_request:
            raise ValueError(
                f"{len(state_rows)} state rows given; a request owns {self.layout.state_rows_per_request}"
            )
        start = self.row(state_rows[slot.state_row]).storage_offset() - self.buffer.storage_offset()
        start += slot.offset
        conv = self._typed(start, state.conv_bytes, torch.bfloat16, state.conv_shape)
        recurrent = self._typed(start + state.conv_bytes, state.recurrent_bytes, torch.float32, state.recurrent_shape)
        return conv, recurrent

    def kda_state_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of KDA layer ``layer`` in every row, as two strided views over the pool.

        Returns:
            conv: bf16 ``[num_rows, conv_kernel - 1 + num_speculative_tokens, conv_dim]``,
                ``stride = (row_bytes / 2, conv_dim, 1)``.
            recurrent: fp32 ``[num_rows, H / tp, K, V]`` (K first, fla-core's default layout),
                ``stride = (row_bytes / 4, K x V, V, 1)``.

        Index both with a request's state row for this layer: row
        ``state_rows[slot.state_row]`` where ``slot`` is the layer's ``StateSlot``
        (:meth:`kda_state_row_index`; the step metadata holds these per request). Entries of
        rows that are not a request's state row for this layer are other bytes of the pool;
        index ``-1`` is the guard row (see the module docstring).
        """
        slot, state = self._kda_slot(layer), self.layout.state
        row_bytes = self.layout.row_bytes
        conv_rows, conv_dim = state.conv_shape
        heads, k, v = state.recurrent_shape
        conv = self._typed_rows(slot.offset, torch.bfloat16, (conv_rows, conv_dim), row_bytes)
        recurrent = self._typed_rows(slot.offset + state.conv_bytes, torch.float32, (heads, k, v), row_bytes)
        return conv, recurrent

    def copy_state_rows(self, copies: list[tuple[int, int]]) -> None:
        """Copy the KDA states of row ``src`` over those of row ``dst`` for each pair, in order
        (the allocator's :meth:`RowAllocator.pop_state_copies`: checkpoint saves and restores).

        Only the state bytes of a row are copied (``states_per_row x state_bytes``). Every
        pair is checked first; then one device copy a pair, no host sync.
        """
        num_rows = self.layout.num_rows
        for i, pair in enumerate(copies):
            if (not isinstance(pair, tuple) or len(pair) != 2 or not all(is_int(r) and 0 <= r < num_rows for r in pair)
                    or pair[0] == pair[1]):
                raise ValueError(f"copies[{i}] must be a (src, dst) pair of two different rows in [0, {num_rows}), "
                                 f"got {pair!r}")
        nbytes = self.layout.states_per_row * self.layout.state_bytes
        for src, dst in copies:
            self.row(dst)[:nbytes].copy_(self.row(src)[:nbytes])

    def kda_state_row_index(self, layer: int) -> int:
        """Which of a request's state rows holds KDA layer ``layer`` (0-based among its state rows)."""
        return self._kda_slot(layer).state_row

    def _kda_slot(self, layer: int):
        if not is_int(layer) or layer not in self._kda:
            kda = self.layout.config.model.kda
            if kda is not None and is_int(layer) and layer in kda.layers:
                raise NotImplementedError(
                    f"layer {layer} is a KDA layer of a {self.layout.kind} layout: only the packed layout "
                    "(KDA-hybrid DSA models) holds KDA states in the pool"
                )
            raise ValueError(f"layer {layer} is not a KDA layer; KDA layers: {sorted(self._kda)}")
        return self._kda[layer]

    def _typed_rows(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], row_bytes: int) -> torch.Tensor:
        """``[num_rows, *shape]`` contiguous-inside-a-row view of ``dtype`` at byte ``offset`` of every row."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or row_bytes % itemsize or self.buffer.data_ptr() % itemsize:
            raise ValueError(f"byte offset {offset} or row size {row_bytes} is not {itemsize}-byte aligned for a "
                             f"{dtype} state view")
        typed = self.buffer.view(dtype)
        inner = [1]
        for size in reversed(shape[1:]):
            inner.insert(0, inner[0] * size)
        return typed.as_strided((self.layout.num_rows, *shape), (row_bytes // itemsize, *inner),
                                typed.storage_offset() + offset // itemsize)

    def _typed(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (self.buffer.data_ptr() + offset) % itemsize:
            raise ValueError(f"byte offset {offset} is not {itemsize}-byte aligned for a {dtype} state view")
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)
