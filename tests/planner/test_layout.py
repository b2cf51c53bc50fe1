"""The packed block row: block size, states per row, offsets, re-cutting and the TP table.

Expected numbers are worked out by hand from ``docs/planning.md`` (see the comments):
``units = ceil(states_per_row x state_bytes x tp / (64 x reference_tp x row_bytes_per_token))``,
``block_size = 64 x units x reference_tp / tp``, ``reference_tp = lcm(8, tp)``.
"""

import dataclasses
import doctest

import pytest

from dsacache import PD_REFERENCE_TP, CacheConfig, ConfigError, SpeculativeConfig, plan
from dsacache.planner import layout as layout_module
from dsacache.planner.report import STABLE_KEYS, exchange_table, summarize

GIB48 = 48 * 2**30  # 51,539,607,552 B


def k31(**options):
    return CacheConfig.from_model("kimi-k3.1", **options)


# K3.1, fp8_ds_mla MLA (656 B), FP8 keys: row 24 x 788 = 18,912 B/token, states_per_row 23,
# state 814,080 B at TP 8 (23 states = 18,723,840 B; at TP 1, 23 x 6,512,640 = 149,790,720 B).
# TP 1..8: units = ceil(149,790,720 / (64 x 8 x 18912)) = ceil(15.47) = 16 -> 64 x 16 x 8 / tp.
# TP 3: reference 24, units = ceil(23 x 2,170,880 x 3 / (64 x 24 x 18912)) = ceil(5.16) = 6 -> 64 x 6 x 8.
# TP 16: reference 16, units = ceil(23 x 407,040 / (64 x 18912)) = ceil(7.73) = 8 -> 512.
# TP 32: reference 32, units = ceil(23 x 203,520 / 1,210,368) = ceil(3.87) = 4 -> 256.
K31_BLOCKS = {1: (8192, 8), 2: (4096, 8), 3: (3072, 24), 4: (2048, 8), 8: (1024, 8), 16: (512, 16), 32: (256, 32)}


@pytest.mark.parametrize("tp", list(K31_BLOCKS))
def test_k31_block_size_and_reference_tp(tp):
    layout = plan(k31(tensor_parallel_size=tp))
    block, reference = K31_BLOCKS[tp]
    assert layout.kind == "packed" and layout.is_packed
    assert layout.block_size == block
    assert layout.reference_tp == reference
    assert layout.states_per_row == 23
    assert layout.pages_per_row == block // 64


# Other dtypes at TP 8 (state 814,080 B, 23 states = 18,723,840 B), units = ceil(18,723,840 / (64 x row)):
#   auto/bfloat16 + FP8 keys: row 30816, ceil(18,723,840 / 1,972,224) = ceil(9.49) = 10 -> 640
#   auto + MXFP4 keys:         row 29280, ceil(18,723,840 / 1,873,920) = ceil(9.99) = 10 -> 640
#   fp8 + MXFP4 keys:          row 15456, ceil(18,723,840 / 989,184) = ceil(18.93) = 19 -> 1216
#   fp8_ds_mla + MXFP4 keys:   row 17376, ceil(18,723,840 / 1,112,064) = ceil(16.84) = 17 -> 1088
#   fp8 + FP8 keys:            row 16992, ceil(18,723,840 / 1,087,488) = ceil(17.22) = 18 -> 1152
# TP 16 (reference 16) halves the quotient: ceil(4.75) = 5 -> 320, ceil(9.46) = 10 -> 640,
# ceil(8.42) = 9 -> 576, ceil(8.61) = 9 -> 576. TP 1, 2, 4 scale the TP-8 block by 8, 4, 2.
@pytest.mark.parametrize("kv_dtype,indexer,tp,block", [
    ("auto", "fp8", 8, 640), ("bfloat16", "fp8", 1, 5120), ("auto", "fp8", 16, 320),
    ("auto", "mxfp4", 8, 640), ("auto", "mxfp4", 2, 2560),
    ("fp8", "mxfp4", 8, 1216), ("fp8_e4m3", "mxfp4", 1, 9728), ("fp8", "mxfp4", 16, 640),
    ("fp8_ds_mla", "mxfp4", 8, 1088), ("fp8_ds_mla", "mxfp4", 4, 2176), ("fp8_ds_mla", "mxfp4", 16, 576),
    ("fp8", "fp8", 8, 1152), ("fp8", "fp8", 16, 576),
])
def test_k31_block_size_other_dtypes(kv_dtype, indexer, tp, block):
    config = k31(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype, indexer_kv_dtype=indexer)
    assert plan(config).block_size == block


# DSpark, 3 speculative tokens: row 18912 + 5 x 656 = 22,192, state 841,728 B at TP 8 (23 x = 19,359,744 B).
#   TP 8: units = ceil(19,359,744 / (64 x 22192)) = ceil(19,359,744 / 1,420,288) = ceil(13.63) = 14 -> 896;
#   TP 1: 7168; TP 16: state 420,864, ceil(23 x 420,864 / 1,420,288) = ceil(6.82) = 7 -> 448.
#   draft in bfloat16: row 18912 + 5 x 1152 = 24,672, ceil(19,359,744 / 1,579,008) = ceil(12.26) = 13 -> 832.
#   draft in fp8: row 18912 + 5 x 576 = 21,792, ceil(19,359,744 / 1,394,688) = ceil(13.88) = 14 -> 896.
@pytest.mark.parametrize("tp,draft_dtype,block", [
    (8, None, 896), (1, None, 7168), (16, None, 448),
    (8, "bfloat16", 832), (1, "bfloat16", 6656), (8, "fp8", 896),
])
def test_dspark_block_size(tp, draft_dtype, block):
    raw = {"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"}
    if draft_dtype:
        raw["kv_cache_dtype"] = draft_dtype
    layout = plan(k31(tensor_parallel_size=tp, speculative=SpeculativeConfig.from_json(raw)))
    assert layout.block_size == block


def test_ngram_growth_changes_the_block():
    # 4 speculative tokens: state 850,944 B; ceil(23 x 850,944 / (64 x 18912)) = ceil(16.17) = 17 -> 1088.
    layout = plan(k31(speculative=SpeculativeConfig("ngram", 4)))
    assert layout.state_bytes == 850944
    assert layout.block_size == 1088
    # 3 tokens still fit 16 units: ceil(23 x 841,728 / 1,210,368) = ceil(15.99) = 16 -> 1024.
    assert plan(k31(speculative=SpeculativeConfig("ngram", 3))).block_size == 1024


def test_custom_reference_tp():
    # reference 16 for TP 8: ceil(23 x 814,080 x 8 / (64 x 16 x 18912)) = ceil(7.73) = 8 -> 64 x 8 x 2
    # (the same 1024 as at reference 8, whose 16 units are even).
    assert plan(k31(tensor_parallel_size=8, reference_tp=16)).block_size == 1024
    assert plan(k31(tensor_parallel_size=16, reference_tp=16)).block_size == 512
    assert plan(k31(tensor_parallel_size=1, reference_tp=16)).block_size == 8192
    assert plan(k31(tensor_parallel_size=8, reference_tp=16)).reference_tp == 16
    # fp8 MLA + MXFP4 keys (row 15456): reference 8 gives ceil(18.93) = 19 -> 1216 at TP 8, reference 16
    # gives ceil(23 x 814,080 x 8 / (64 x 16 x 15456)) = ceil(9.46) = 10 -> 64 x 10 x 2 = 1280.
    assert plan(k31(kv_cache_dtype="fp8", indexer_kv_dtype="mxfp4", reference_tp=16)).block_size == 1280
    # reference lcm(6, 4) = 12: ceil(23 x 1,628,160 x 4 / (64 x 12 x 18912)) = ceil(10.31) = 11 -> 64 x 11 x 3.
    layout = plan(k31(tensor_parallel_size=4, reference_tp=6))
    assert layout.reference_tp == 12
    assert layout.block_size == 2112


def test_custom_alignment():
    # alignment 128 at TP 8: ceil(18,723,840 / (128 x 18912)) = ceil(7.73) = 8 -> 1024; TP 1: 8192.
    assert plan(k31(alignment=128)).block_size == 1024
    assert plan(k31(alignment=128, tensor_parallel_size=1)).block_size == 8192
    # alignment 192: ceil(18,723,840 / (192 x 18912)) = ceil(18,723,840 / 3,631,104) = ceil(5.16) = 6 -> 1152.
    assert plan(k31(alignment=192)).block_size == 1152
    assert plan(k31(alignment=192, tensor_parallel_size=1)).block_size == 9216


def test_pd_reference_tp_is_8():
    assert PD_REFERENCE_TP == 8
    assert k31().reference_tp == 8


def test_k31_tp8_rows_and_strides():
    layout = plan(k31(cache_memory_bytes=GIB48))
    assert layout.block_size == 1024
    assert layout.pages_per_row == 16
    assert layout.page_stride_bytes == 1210368  # 64 x 18912
    assert layout.row_bytes == 19365888  # 1024 x 18912
    assert layout.num_rows == 2660  # 51,539,607,552 // 19,365,888 = 2661, less the guard row
    assert layout.guard_rows == 1
    assert layout.num_kernel_pages == 2660 * 16
    assert layout.token_capacity == 2660 * 1024
    assert layout.pool_bytes == 2661 * 19365888  # the rows and the guard row
    assert layout.state_rows_per_request == 3  # ceil(69 / 23)
    assert layout.pow2_block_size == 1024  # 512 x 18912 < 23 x 814,080 <= 1024 x 18912
    assert layout.rows_per_request(32768) == 3 + 32  # 32768 / 1024 = 32
    assert layout.attention_rows_for(1024) == 1
    assert layout.attention_rows_for(1025) == 2


def test_pow2_block_differs_from_the_packed_block():
    # DSpark, 3 tokens: row 22,192, 23 states 19,359,744 B; packed 896 (14 units), while
    # 512 x 22192 < 19,359,744 <= 1024 x 22192 gives a power-of-two block of 1024.
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"})
    layout = plan(k31(speculative=spec))
    assert (layout.block_size, layout.pow2_block_size) == (896, 1024)


def test_default_budget_rows():
    # 141e9 x 0.35 = 49,350,000,000 B // 19,365,888 = 2548, less the guard row
    assert plan(k31()).num_rows == 2547


def test_num_rows_override():
    layout = plan(k31(), num_rows=10)
    assert layout.num_rows == 10
    assert layout.token_capacity == 10240  # 10 x 1024
    assert layout.pool_bytes == 213024768  # (10 + the guard row) x 19,365,888


def test_k31_tp1_headline():
    layout = plan(k31(tensor_parallel_size=1))
    assert layout.block_size == 8192
    assert layout.state_bytes == 6512640
    assert layout.pages_per_row == 128


# --- offsets inside a sub-row and a state row ----------------------------------------------


def test_attention_slot_offsets_k31():
    layout = plan(k31())
    slots = layout.dsa_layers
    assert [s.layer for s in slots] == [4 * i for i in range(1, 24)] + [93]
    # each layer takes 64 x (656 + 132) = 50,432 B of a sub-row: MLA page, then indexer page
    for k, slot in enumerate(slots):
        assert slot.mla_offset == 50432 * k
        assert slot.index_offset == 50432 * k + 41984  # 64 x 656
        assert slot.mla_entry_bytes == 656
        assert slot.index_entry_bytes == 132
    assert slots[1].mla_offset == 50432 and slots[1].index_offset == 92416
    assert slots[-1].mla_offset == 1159936 and slots[-1].index_offset == 1201920  # 23 x 50,432 (+ 41,984)
    assert layout.draft_layers == ()


def test_draft_slot_offsets_dspark():
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"})
    layout = plan(k31(speculative=spec))
    assert layout.page_stride_bytes == 64 * 22192 == 1420288
    assert [d.index for d in layout.draft_layers] == [0, 1, 2, 3, 4]
    # the draft pages follow the 24 attention layers (24 x 50,432 = 1,210,368), 64 x 656 = 41,984 each
    assert [d.mla_offset for d in layout.draft_layers] == [1210368, 1252352, 1294336, 1336320, 1378304]
    assert all(d.mla_entry_bytes == 656 for d in layout.draft_layers)
    assert layout.draft_layers[-1].mla_offset + 41984 == layout.page_stride_bytes


def _sub_row_segments(layout):
    page = layout.kernel_page_size
    segs = []
    for s in layout.dsa_layers:
        segs.append((s.mla_offset, page * s.mla_entry_bytes))
        if s.index_entry_bytes:
            segs.append((s.index_offset, page * s.index_entry_bytes))
    segs += [(d.mla_offset, page * d.mla_entry_bytes) for d in layout.draft_layers]
    return sorted(segs)


@pytest.mark.parametrize("config", [
    k31(),
    k31(indexer_kv_dtype="mxfp4", kv_cache_dtype="bfloat16"),
    k31(speculative=SpeculativeConfig.from_json(
        {"method": "dspark", "num_speculative_tokens": 2, "model": "kimi-k3.1-dspark", "kv_cache_dtype": "fp8"})),
    CacheConfig.from_model("kimi-linear-48b"),
    CacheConfig.from_model("deepseek-v3.2"),
], ids=["k31", "k31-mxfp4-bf16", "k31-dspark", "kimi-linear", "dsv32"])
def test_sub_row_is_tiled_without_gaps(config):
    layout = plan(config)
    pos = 0
    for offset, size in _sub_row_segments(layout):
        assert offset == pos
        assert offset % 64 == 0  # every page starts 64-byte aligned
        pos += size
    assert pos == layout.page_stride_bytes == 64 * layout.row_bytes_per_token


def test_state_slots_k31():
    layout = plan(k31())
    slots = layout.kda_layers
    kda = [n for n in range(1, 94) if n % 4 and n != 93]
    assert [s.layer for s in slots] == kda
    assert len(slots) == 69
    assert (slots[0].state_row, slots[0].slot, slots[0].offset) == (0, 0, 0)
    assert (slots[1].state_row, slots[1].slot, slots[1].offset) == (0, 1, 814080)
    assert (slots[22].state_row, slots[22].slot, slots[22].offset) == (0, 22, 17909760)
    assert (slots[23].state_row, slots[23].slot, slots[23].offset) == (1, 0, 0)
    assert (slots[68].layer, slots[68].state_row, slots[68].slot) == (91, 2, 22)
    for s in slots:
        assert s.offset + 814080 <= layout.row_bytes
        assert s.offset % 4 == 0


def test_paged_layout_kimi_linear():
    layout = plan(CacheConfig.from_model("kimi-linear-48b", cache_memory_bytes=GIB48))
    assert layout.kind == "paged"
    assert layout.block_size == 64
    assert layout.states_per_row == 0
    assert layout.kda_layers == ()
    assert layout.pow2_block_size is None
    assert layout.state_rows_per_request == 0
    assert [s.layer for s in layout.dsa_layers] == [4, 8, 12, 16, 20, 24, 27]
    assert all(s.index_entry_bytes == 0 for s in layout.dsa_layers)
    assert layout.num_rows == 175371  # 51,539,607,552 // (64 x 4592)
    assert layout.token_capacity == 175371 * 64


def test_paged_layout_deepseek_v32():
    layout = plan(CacheConfig.from_model("deepseek-v3.2", cache_memory_bytes=GIB48))
    assert layout.kind == "paged"
    assert len(layout.dsa_layers) == 61
    assert layout.num_rows == 16753  # 51,539,607,552 // (64 x 48068)


# --- with_block_size ------------------------------------------------------------------------


def test_with_block_size_keeps_pool_bytes():
    layout = plan(k31(), num_rows=100)  # (100 + 1 guard) x 1024 x 18912 = 1,955,954,688 B
    wide = layout.with_block_size(2048)
    assert wide.block_size == 2048
    assert wide.num_rows == 49  # 1,955,954,688 // (2048 x 18912) = 50, less its guard row
    assert wide.row_bytes_per_token == 18912
    assert layout.num_rows == 100  # the original is untouched (frozen)
    # 1,955,954,688 // (1088 x 18912 = 20,576,256) = 95, less the guard row
    assert layout.with_block_size(1088).num_rows == 94
    same = layout.with_block_size(1024)
    assert same.num_rows == 100


def test_with_block_size_refusals():
    layout = plan(k31(), num_rows=100)
    with pytest.raises(ConfigError, match="multiple of 64"):
        layout.with_block_size(1000)
    # 960 x 18912 = 18,155,520 < 23 x 814,080 = 18,723,840
    with pytest.raises(ConfigError, match="23 KDA states"):
        layout.with_block_size(960)


# --- summary, waste and the exchange table -------------------------------------------------


def test_summary_stable_keys_and_values():
    summary = summarize(plan(k31(), num_rows=100), 32000)
    assert set(STABLE_KEYS) <= set(summary)
    assert summary["block_size"] == 1024
    assert summary["states_per_row"] == 23
    assert summary["row_bytes_per_token"] == 18912
    assert summary["index_bytes_per_token"] == 132
    assert summary["mla_bytes_per_token"] == 656
    assert summary["draft_bytes_per_token"] == 0
    assert summary["state_bytes"] == 814080
    assert summary["indexer_kv_dtype"] == "fp8"
    assert summary["num_rows"] == 100
    assert summary["token_capacity"] == 102400
    assert summary["max_concurrent_requests"] == 2  # 100 // (3 + ceil(32000 / 1024) = 32)
    assert summary["attention_tail_tokens"] == 768  # 32 x 1024 - 32000
    assert summary["state_row_empty_bytes"] == 642048  # 19,365,888 - 18,723,840
    assert summary["pow2"]["block_size"] == 1024


def test_summary_paged_has_null_block_size():
    summary = summarize(plan(CacheConfig.from_model("kimi-linear-48b")), 4096)
    assert summary["block_size"] is None
    assert summary["states_per_row"] is None
    assert summary["index_bytes_per_token"] == 0
    assert "pow2" not in summary


def test_stable_keys_pinned():
    assert set(STABLE_KEYS) == {
        "block_size", "states_per_row", "row_bytes_per_token", "index_bytes_per_token", "mla_bytes_per_token",
        "draft_bytes_per_token", "state_bytes", "indexer_kv_dtype", "num_rows", "token_capacity",
    }


def test_exchange_table_k31():
    # 8192, 4096, 2048, 1024 and TP 16's 512 (8 units at reference 16, half of 16): all divide each other
    layouts = [plan(k31(tensor_parallel_size=tp)) for tp in (1, 2, 4, 8, 16)]
    assert [la.block_size for la in layouts] == [8192, 4096, 2048, 1024, 512]
    table = exchange_table(layouts)
    assert len(table) == 20
    assert all(r["exchangeable"] is True for r in table)


def test_exchange_table_tp16_outside_the_reference():
    # fp8 MLA + MXFP4 keys (row 15456): TP 1..8 take 19 units -> 9728, 4864, 2432, 1216; TP 16 (reference 16)
    # takes ceil(9.46) = 10 -> 640, which divides none of them.
    layouts = [plan(k31(tensor_parallel_size=tp, kv_cache_dtype="fp8", indexer_kv_dtype="mxfp4"))
               for tp in (1, 2, 4, 8, 16)]
    assert [la.block_size for la in layouts] == [9728, 4864, 2432, 1216, 640]
    ok = {(r["tp"], r["other_tp"]): r["exchangeable"] for r in exchange_table(layouts)}
    for a in (1, 2, 4, 8):
        for b in (1, 2, 4, 8):
            if a != b:
                assert ok[(a, b)] is True
    for a in (1, 2, 4, 8):
        assert ok[(a, 16)] is False and ok[(16, a)] is False


def test_exchange_table_with_reference_16():
    # reference 16 everywhere: 10 units at TP 16 -> 640 x 16 / tp
    layouts = [plan(k31(tensor_parallel_size=tp, kv_cache_dtype="fp8", indexer_kv_dtype="mxfp4", reference_tp=16))
               for tp in (1, 2, 4, 8, 16)]
    assert [la.block_size for la in layouts] == [10240, 5120, 2560, 1280, 640]
    assert all(r["exchangeable"] for r in exchange_table(layouts))


# --- the API contract ----------------------------------------------------------------------


def test_layout_and_config_are_frozen():
    config = k31()
    layout = plan(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.block_size = 2048
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tensor_parallel_size = 4


def test_plan_is_pure():
    config = k31()
    before = dataclasses.replace(config)
    assert plan(config) == plan(config)
    assert config == before


def test_plan_docstring_example_runs():
    result = doctest.testmod(layout_module, verbose=False)
    assert result.attempted >= 1
    assert result.failed == 0
