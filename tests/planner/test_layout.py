"""The packed block row: block size, states per row, offsets, re-cutting and the TP table.

Expected numbers are worked out by hand from ``packing.md`` (see the comments):
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


# K3.1, fp8_ds_mla MLA, FP8 keys: row 15840 B/token, states_per_row 23, state 814,080 B at TP 8.
# TP 1..8: units = ceil(23 x 6,512,640 / (64 x 8 x 15840)) = ceil(18.47) = 19 -> 64 x 19 x 8 / tp.
# TP 3: reference 24, units = ceil(23 x 2,170,880 x 3 / (64 x 24 x 15840)) = ceil(6.16) = 7 -> 64 x 7 x 8.
# TP 16: reference 16, units = ceil(23 x 407,040 / (64 x 15840)) = ceil(9.24) = 10 -> 640.
# TP 32: reference 32, units = ceil(23 x 203,520 / 1,013,760) = ceil(4.62) = 5 -> 320.
K31_BLOCKS = {1: (9728, 8), 2: (4864, 8), 3: (3584, 24), 4: (2432, 8), 8: (1216, 8), 16: (640, 16), 32: (320, 32)}


@pytest.mark.parametrize("tp", list(K31_BLOCKS))
def test_k31_block_size_and_reference_tp(tp):
    layout = plan(k31(tensor_parallel_size=tp))
    block, reference = K31_BLOCKS[tp]
    assert layout.kind == "packed" and layout.is_packed
    assert layout.block_size == block
    assert layout.reference_tp == reference
    assert layout.states_per_row == 23
    assert layout.pages_per_row == block // 64


# Other dtypes at TP 8 (state 814,080 B, 23 states = 18,723,840 B):
#   auto/bfloat16 + FP8 keys: row 27744, units = ceil(18,723,840 / 1,775,616) = 11 -> 704
#   auto + MXFP4 keys:         row 26208, ceil(18,723,840 / 1,677,312) = 12 -> 768
#   fp8 + MXFP4 keys:          row 13920, ceil(18,723,840 / 890,880) = 22 -> 1408
#   fp8_ds_mla + MXFP4 keys:   row 14304, ceil(18,723,840 / 915,456) = 21 -> 1344
#   fp8 + FP8 keys:            row 15456, ceil(18,723,840 / 989,184) = 19 -> 1216
@pytest.mark.parametrize("kv_dtype,indexer,tp,block", [
    ("auto", "fp8", 8, 704), ("bfloat16", "fp8", 1, 5632), ("auto", "fp8", 16, 384),
    ("auto", "mxfp4", 8, 768), ("auto", "mxfp4", 2, 3072),
    ("fp8", "mxfp4", 8, 1408), ("fp8_e4m3", "mxfp4", 1, 11264), ("fp8", "mxfp4", 16, 704),
    ("fp8_ds_mla", "mxfp4", 8, 1344), ("fp8_ds_mla", "mxfp4", 4, 2688), ("fp8_ds_mla", "mxfp4", 16, 704),
    ("fp8", "fp8", 8, 1216), ("fp8", "fp8", 16, 640),
])
def test_k31_block_size_other_dtypes(kv_dtype, indexer, tp, block):
    config = k31(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype, indexer_kv_dtype=indexer)
    assert plan(config).block_size == block


# DSpark, 3 speculative tokens: row 19120, state 841,728 B at TP 8 (23 x = 19,359,744 B).
#   TP 8: units = ceil(19,359,744 / (64 x 19120)) = ceil(15.82) = 16 -> 1024; TP 1: 8192;
#   TP 16: state 420,864, ceil(23 x 420,864 / 1,223,680) = ceil(7.91) = 8 -> 512.
#   draft in bfloat16: row 21600, ceil(19,359,744 / 1,382,400) = ceil(14.004) = 15 -> 960.
#   draft in fp8: row 18720, ceil(19,359,744 / 1,198,080) = ceil(16.16) = 17 -> 1088.
@pytest.mark.parametrize("tp,draft_dtype,block", [
    (8, None, 1024), (1, None, 8192), (16, None, 512),
    (8, "bfloat16", 960), (1, "bfloat16", 7680), (8, "fp8", 1088),
])
def test_dspark_block_size(tp, draft_dtype, block):
    raw = {"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"}
    if draft_dtype:
        raw["kv_cache_dtype"] = draft_dtype
    layout = plan(k31(tensor_parallel_size=tp, speculative=SpeculativeConfig.from_json(raw)))
    assert layout.block_size == block


def test_ngram_growth_changes_the_block():
    # 4 speculative tokens: state 850,944 B; ceil(23 x 850,944 / 1,013,760) = ceil(19.31) = 20 -> 1280.
    layout = plan(k31(speculative=SpeculativeConfig("ngram", 4)))
    assert layout.state_bytes == 850944
    assert layout.block_size == 1280


def test_custom_reference_tp():
    # reference 16 for TP 8: ceil(23 x 814,080 x 8 / (64 x 16 x 15840)) = ceil(9.24) = 10 -> 64 x 10 x 2.
    assert plan(k31(tensor_parallel_size=8, reference_tp=16)).block_size == 1280
    assert plan(k31(tensor_parallel_size=16, reference_tp=16)).block_size == 640
    assert plan(k31(tensor_parallel_size=1, reference_tp=16)).block_size == 10240
    assert plan(k31(tensor_parallel_size=8, reference_tp=16)).reference_tp == 16
    # reference lcm(6, 4) = 12: ceil(23 x 1,628,160 x 4 / (64 x 12 x 15840)) = ceil(12.31) = 13 -> 64 x 13 x 3.
    layout = plan(k31(tensor_parallel_size=4, reference_tp=6))
    assert layout.reference_tp == 12
    assert layout.block_size == 2496


def test_custom_alignment():
    # alignment 128 at TP 8: ceil(18,723,840 / (128 x 15840)) = ceil(9.24) = 10 -> 1280; TP 1: 10240.
    assert plan(k31(alignment=128)).block_size == 1280
    assert plan(k31(alignment=128, tensor_parallel_size=1)).block_size == 10240


def test_pd_reference_tp_is_8():
    assert PD_REFERENCE_TP == 8
    assert k31().reference_tp == 8


def test_k31_tp8_rows_and_strides():
    layout = plan(k31(cache_memory_bytes=GIB48))
    assert layout.block_size == 1216
    assert layout.pages_per_row == 19
    assert layout.page_stride_bytes == 1013760  # 64 x 15840
    assert layout.row_bytes == 19261440  # 1216 x 15840
    assert layout.num_rows == 2675  # 51,539,607,552 // 19,261,440
    assert layout.num_kernel_pages == 2675 * 19
    assert layout.token_capacity == 2675 * 1216
    assert layout.pool_bytes == 2675 * 19261440
    assert layout.state_rows_per_request == 3  # ceil(69 / 23)
    assert layout.pow2_block_size == 2048  # 1024 x 15840 < 23 x 814,080 <= 2048 x 15840
    assert layout.rows_per_request(32768) == 3 + 27  # ceil(32768 / 1216) = 27
    assert layout.attention_rows_for(1216) == 1
    assert layout.attention_rows_for(1217) == 2


def test_default_budget_rows():
    # 141e9 x 0.35 = 49,350,000,000 B // 19,261,440 = 2562
    assert plan(k31()).num_rows == 2562


def test_num_rows_override():
    layout = plan(k31(), num_rows=10)
    assert layout.num_rows == 10
    assert layout.token_capacity == 12160
    assert layout.pool_bytes == 192614400


def test_k31_tp1_headline():
    layout = plan(k31(tensor_parallel_size=1))
    assert layout.block_size == 9728
    assert layout.state_bytes == 6512640
    assert layout.pages_per_row == 152


# --- offsets inside a sub-row and a state row ----------------------------------------------


def test_attention_slot_offsets_k31():
    layout = plan(k31())
    slots = layout.dsa_layers
    assert [s.layer for s in slots] == [4 * i for i in range(1, 24)] + [93]
    # each layer takes 64 x (528 + 132) = 42,240 B of a sub-row: MLA page, then indexer page
    for k, slot in enumerate(slots):
        assert slot.mla_offset == 42240 * k
        assert slot.index_offset == 42240 * k + 33792  # 64 x 528
        assert slot.mla_entry_bytes == 528
        assert slot.index_entry_bytes == 132
    assert slots[1].mla_offset == 42240 and slots[1].index_offset == 76032
    assert slots[-1].mla_offset == 971520 and slots[-1].index_offset == 1005312
    assert layout.draft_layers == ()


def test_draft_slot_offsets_dspark():
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"})
    layout = plan(k31(speculative=spec))
    assert layout.page_stride_bytes == 64 * 19120 == 1223680
    assert [d.index for d in layout.draft_layers] == [0, 1, 2, 3, 4]
    # the draft pages follow the 24 attention layers (24 x 42,240 = 1,013,760), 64 x 656 = 41,984 each
    assert [d.mla_offset for d in layout.draft_layers] == [1013760, 1055744, 1097728, 1139712, 1181696]
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
    layout = plan(k31(), num_rows=100)  # 1,926,144,000 B
    pow2 = layout.with_block_size(2048)
    assert pow2.block_size == 2048
    assert pow2.num_rows == 59  # 1,926,144,000 // (2048 x 15840)
    assert pow2.row_bytes_per_token == 15840
    assert layout.num_rows == 100  # the original is untouched (frozen)
    same = layout.with_block_size(1216)
    assert same.num_rows == 100


def test_with_block_size_refusals():
    layout = plan(k31(), num_rows=100)
    with pytest.raises(ConfigError, match="multiple of 64"):
        layout.with_block_size(1000)
    # 1152 x 15840 = 18,247,680 < 23 x 814,080 = 18,723,840
    with pytest.raises(ConfigError, match="23 KDA states"):
        layout.with_block_size(1152)


# --- summary, waste and the exchange table -------------------------------------------------


def test_summary_stable_keys_and_values():
    summary = summarize(plan(k31(), num_rows=100), 32768)
    assert set(STABLE_KEYS) <= set(summary)
    assert summary["block_size"] == 1216
    assert summary["states_per_row"] == 23
    assert summary["row_bytes_per_token"] == 15840
    assert summary["index_bytes_per_token"] == 132
    assert summary["mla_bytes_per_token"] == 528
    assert summary["draft_bytes_per_token"] == 0
    assert summary["state_bytes"] == 814080
    assert summary["indexer_kv_dtype"] == "fp8"
    assert summary["num_rows"] == 100
    assert summary["token_capacity"] == 121600
    assert summary["max_concurrent_requests"] == 3  # 100 // (3 + 27)
    assert summary["attention_tail_tokens"] == 64  # 27 x 1216 - 32768
    assert summary["state_row_empty_bytes"] == 537600  # 19,261,440 - 18,723,840
    assert summary["pow2"]["block_size"] == 2048


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
    layouts = [plan(k31(tensor_parallel_size=tp)) for tp in (1, 2, 4, 8, 16)]
    table = exchange_table(layouts)
    assert len(table) == 20
    ok = {(r["tp"], r["other_tp"]): r["exchangeable"] for r in table}
    for a in (1, 2, 4, 8):
        for b in (1, 2, 4, 8):
            if a != b:
                assert ok[(a, b)] is True
    # 640 divides none of 9728, 4864, 2432, 1216
    for a in (1, 2, 4, 8):
        assert ok[(a, 16)] is False and ok[(16, a)] is False


def test_exchange_table_with_reference_16():
    layouts = [plan(k31(tensor_parallel_size=tp, reference_tp=16)) for tp in (1, 2, 4, 8, 16)]
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
