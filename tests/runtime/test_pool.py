"""The pool: paged views over the right bytes, isolation between layers and states."""

import numpy as np
import pytest
import torch

from dsacache.formats.indexer_key import dequantize_pages, fp8_page_views, quantize_fp8
from dsacache.planner import CacheConfig, SpeculativeConfig, plan
from dsacache.runtime import CachePool, build_block_table, compute_slot_mapping, kernel_pages
from tests.helpers import TINY_HYBRID

SENTINEL = 0xA5

TINY = TINY_HYBRID
DRAFT = {"method": "dspark", "num_speculative_tokens": 2,
         "draft_config": {"num_hidden_layers": 2, "kv_lora_rank": 128, "qk_rope_head_dim": 16}}


def tiny_layout(num_rows=6, draft=True, **options):
    speculative = SpeculativeConfig.from_json(DRAFT) if draft else None
    config = CacheConfig.from_config_dict(TINY, tensor_parallel_size=1, speculative=speculative, **options)
    return plan(config, num_rows=num_rows)


def fresh_pool(layout):
    pool = CachePool(layout)
    pool.buffer.fill_(SENTINEL)
    return pool


def region_mask(layout, offset, entry):
    """The bytes a per-layer view must cover, computed from the row rule, not from as_strided."""
    mask = torch.zeros(layout.num_rows * layout.row_bytes, dtype=torch.bool)
    for page in range(layout.num_kernel_pages):
        start = page * layout.page_stride_bytes + offset
        mask[start : start + 64 * entry] = True
    return mask


def views_of(pool):
    layout = pool.layout
    out = []
    for slot in layout.dsa_layers:
        out.append((f"mla{slot.layer}", pool.mla_pages(slot.layer), slot.mla_offset, slot.mla_entry_bytes))
        out.append((f"index{slot.layer}", pool.index_pages(slot.layer), slot.index_offset, slot.index_entry_bytes))
    for slot in layout.draft_layers:
        out.append((f"draft{slot.index}", pool.draft_pages(slot.index), slot.mla_offset, slot.mla_entry_bytes))
    return out


def test_tiny_layout_is_what_the_tests_assume():
    layout = tiny_layout()
    assert layout.kind == "packed" and len(layout.draft_layers) == 2
    assert layout.state_rows_per_request == 3 and layout.pages_per_row >= 2


@pytest.mark.parametrize("draft", [True, False])
def test_views_are_standard_paged_views_that_tile_the_pool(draft):
    layout = tiny_layout(draft=draft)
    pool = fresh_pool(layout)
    covered = torch.zeros(layout.num_rows * layout.row_bytes, dtype=torch.int32)
    for _, view, offset, entry in views_of(pool):
        assert view.shape == (layout.num_kernel_pages, 64, entry)
        assert view.stride() == (layout.page_stride_bytes, entry, 1)
        assert view.dtype == torch.uint8
        covered += region_mask(layout, offset, entry).int()
    assert (covered == 1).all()  # no overlap, no padding


def test_writing_one_layer_changes_only_its_bytes():
    layout = tiny_layout()
    for name, _, offset, entry in views_of(fresh_pool(layout)):
        pool = fresh_pool(layout)
        view = dict((n, v) for n, v, _, _ in views_of(pool))[name]
        data = torch.randint(0, 256, view.shape, dtype=torch.uint8)
        data[data == SENTINEL] = 0
        view.copy_(data)
        mask = region_mask(layout, offset, entry)
        assert (pool.buffer[~mask] == SENTINEL).all(), name
        # Page k, token t of the view is at k * page_stride + offset + t * entry.
        expected = torch.cat([data[k].flatten() for k in range(layout.num_kernel_pages)])
        assert torch.equal(pool.buffer[mask], expected), name


def test_state_tensors_live_in_the_requests_state_rows_only():
    layout = tiny_layout(num_rows=8)
    pool = fresh_pool(layout)
    pool.allocator.add("a", num_tokens=10)
    pool.allocator.add("b", num_tokens=10)
    state = layout.state
    for slot in layout.kda_layers:
        before = pool.buffer.clone()
        conv, recurrent = pool.state_tensors("b", slot.layer)
        assert conv.dtype == torch.bfloat16 and conv.shape == state.conv_shape
        assert recurrent.dtype == torch.float32 and recurrent.shape == state.recurrent_shape
        conv.copy_(torch.randn(state.conv_shape))
        recurrent.copy_(torch.randn(state.recurrent_shape))
        row = pool.allocator.state_rows("b")[slot.state_row]
        start = row * layout.row_bytes + slot.slot * layout.state_bytes
        changed = (pool.buffer != before).nonzero().flatten()
        assert changed.min() >= start and changed.max() < start + layout.state_bytes
        raw = pool.buffer[start : start + layout.state_bytes]
        assert torch.equal(raw[: state.conv_bytes].view(torch.bfloat16).view(state.conv_shape), conv)
        assert torch.equal(raw[state.conv_bytes :].view(torch.float32).view(state.recurrent_shape), recurrent)
    # Request a's state rows and every attention row were never touched.
    for row in pool.allocator.state_rows("a") + pool.allocator.attention_rows("a") + pool.allocator.attention_rows("b"):
        assert (pool.row(row) == SENTINEL).all()


def test_states_of_different_layers_do_not_overlap():
    layout = tiny_layout(num_rows=8)
    pool = fresh_pool(layout)
    pool.allocator.add("a", num_tokens=1)
    for i, slot in enumerate(layout.kda_layers):
        conv, recurrent = pool.state_tensors("a", slot.layer)
        conv.fill_(float(i + 1))
        recurrent.fill_(float(i + 1))
    for i, slot in enumerate(layout.kda_layers):
        conv, recurrent = pool.state_tensors("a", slot.layer)
        assert (conv == i + 1).all() and (recurrent == i + 1).all()


def test_indexer_keys_written_through_the_slot_mapping_read_back_through_the_block_table():
    """A reference paged reader given the layer's view and the kernel-page block table reads the keys."""
    layout = tiny_layout(num_rows=10)
    pool = fresh_pool(layout)
    alloc, layer, head_dim = pool.allocator, layout.dsa_layers[1].layer, layout.indexer_head_dim
    alloc.add("x", num_tokens=3)  # takes rows first, so "y" does not start at row 0
    alloc.add("y", num_tokens=700)
    table = alloc.block_table(["y"])
    positions = torch.arange(700)
    slots = compute_slot_mapping(table, torch.tensor([0, 700], dtype=torch.int32), positions,
                                 num_kernel_pages=pool.num_kernel_pages)
    keys = torch.randn(700, head_dim)
    values, scales = quantize_fp8(keys)
    page_values, page_scales = fp8_page_views(pool.index_pages(layer), head_dim)
    page_values[slots // 64, slots % 64] = values
    page_scales[slots // 64, slots % 64] = scales
    all_keys = dequantize_pages(pool.index_pages(layer), head_dim, "fp8")
    pages = table[0, : -(-700 // 64)].long()
    read = all_keys[pages].reshape(-1, head_dim)[:700]
    assert torch.equal(read, values.float() * scales[:, None])
    written = torch.zeros_like(pool.buffer, dtype=torch.bool)
    for slot in slots.tolist():
        start = (slot // 64) * layout.page_stride_bytes + layout.dsa_layers[1].index_offset
        t = slot % 64
        written[start + t * head_dim : start + (t + 1) * head_dim] = True
        written[start + 64 * head_dim + 4 * t : start + 64 * head_dim + 4 * (t + 1)] = True
    assert (pool.buffer[~written] == SENTINEL).all()


def test_paged_layout_without_kda():
    layout = plan(CacheConfig.from_model("deepseek-v3.2", tensor_parallel_size=8), num_rows=4)
    assert layout.kind == "paged" and layout.state_rows_per_request == 0
    pool = fresh_pool(layout)
    view = pool.index_pages(layout.dsa_layers[0].layer)
    assert view.shape[0] == 4 and view.stride(0) == layout.page_stride_bytes
    pool.allocator.add("a", num_tokens=100)
    assert pool.allocator.kernel_pages("a") == [0, 1]


class TestBadInput:
    def test_unknown_layers(self):
        pool = fresh_pool(tiny_layout())
        with pytest.raises(ValueError, match="not a DSA layer"):
            pool.mla_pages(1)
        pool.allocator.add("a", num_tokens=1)
        with pytest.raises(ValueError, match="not a KDA layer"):
            pool.state_tensors("a", 4)
        with pytest.raises(ValueError, match="draft layer 5"):
            pool.draft_pages(5)
        with pytest.raises(ValueError, match="unknown request"):
            pool.state_tensors("zzz", 1)

    def test_misaligned_state_view(self):
        pool = fresh_pool(tiny_layout())
        with pytest.raises(ValueError, match="not 4-byte aligned"):
            pool._typed(2, 16, torch.float32, (4,))

    def test_row_outside_the_pool(self):
        with pytest.raises(ValueError, match=r"row must be an integer in \[0, 2\), got 2"):
            fresh_pool(tiny_layout(num_rows=2)).row(2)

    @pytest.mark.parametrize("call, match", [
        (lambda pool: pool.row(1.0), "row must be an integer"),
        (lambda pool: pool.row("0"), "row must be an integer"),
        (lambda pool: pool.mla_pages(4.0), "not a DSA layer"),
        (lambda pool: pool.index_pages([4]), "not a DSA layer"),
        (lambda pool: pool.draft_pages(0.5), "draft layer 0.5"),
        (lambda pool: pool.state_tensors_at([0, 1, 2], 1.0), "not a KDA layer"),
        (lambda pool: pool.state_tensors_at([0, 1.5, 2], 1), r"state_rows\[1\]"),
        (lambda pool: pool.state_tensors_at([0, 1], 1), "2 state rows given"),
    ])
    def test_wrong_types_are_value_errors(self, call, match):
        with pytest.raises(ValueError, match=match):
            call(fresh_pool(tiny_layout()))

    @pytest.mark.parametrize("kw, match", [
        (dict(layout="kimi-k3.1"), "layout must be a CacheLayout"),
        (dict(allocator=object()), "allocator must be a RowAllocator"),
        (dict(device="gpu0"), "device must be a torch device"),
        (dict(device=1.5), "device must be a torch device"),
    ])
    def test_constructor_refuses_wrong_types(self, kw, match):
        with pytest.raises(ValueError, match=match):
            CachePool(**(dict(layout=tiny_layout()) | kw))


class TestBlockTableArguments:
    @pytest.mark.parametrize("call, match", [
        (lambda: build_block_table([[1, 2.0]]), r"page_lists\[0\]\[1\] must be an integer"),
        (lambda: build_block_table([[1, -1]]), r"page_lists\[0\]\[1\] must be an integer >= 0"),
        (lambda: build_block_table([[2**31]]), "past the int32 table"),
        (lambda: build_block_table("12"), "page_lists must be a sequence"),
        (lambda: build_block_table([[1]], width=2.0), "width must be an integer"),
        (lambda: build_block_table([[1]], max_width="4"), "max_width"),
        (lambda: build_block_table([[1]], device="nowhere"), "device"),
        (lambda: kernel_pages([0, 1.0], 2, 3), r"rows\[1\]"),
        (lambda: kernel_pages([0, 1], 2.0, 3), "pages_per_row"),
        (lambda: kernel_pages([0, 1], 2, 3.0), "num_pages"),
    ])
    def test_wrong_types_are_value_errors(self, call, match):
        with pytest.raises(ValueError, match=match):
            call()

    def test_numpy_and_tensor_page_lists(self):
        table = build_block_table([np.array([3, 4]), torch.tensor([7])], width=3)
        assert table.tolist() == [[3, 4, -1], [7, -1, -1]]


def test_paged_kda_model_has_no_state_views():
    """Kimi-Linear's paged layout keeps no KDA states in the pool: asking for one says so."""
    pool = CachePool(plan(CacheConfig.from_model("kimi-linear-48b"), num_rows=4))
    pool.allocator.add("a", num_tokens=10)
    with pytest.raises(NotImplementedError, match="only the packed layout"):
        pool.state_tensors("a", 1)
