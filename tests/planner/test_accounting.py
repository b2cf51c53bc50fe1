"""Byte accounting of ``docs/planning.md``, checked against numbers worked out by hand.

Every expected value below is a literal computed from the spec's formulas (the
arithmetic is spelled out beside the less obvious ones); nothing is derived by
calling the code under test.

Kimi-K3.1: 24 DSA layers (MLA 512 + 64 cached values: ``mla_use_nope`` skips the rotary
embedding but still caches the 64 extra key dims; indexer 128), 69 KDA layers (96 heads x
128, conv kernel 4). Kimi-Linear-48B: 7 MLA layers (512 + 64), 20 KDA layers (32 x 128).
A K3.1-like model with ``qk_rope_head_dim`` 0 (NoPE MLA caching only the latent) keeps the
528-B fp8_ds_mla entry.
"""

import json

import pytest

from dsacache import CacheConfig, SpeculativeConfig, plan
from dsacache.planner import accounting as acc
from dsacache.config.model import builtin_config_dict
from dsacache.formats.key_format import indexer_entry_bytes
from dsacache.formats.sizes import mla_entry_bytes

K31 = "kimi-k3.1"
KL48 = "kimi-linear-48b"
DSPARK = "kimi-k3.1-dspark"

# One layer's MLA entry at kv_lora_rank 512, by cache dtype: 512 + 64 (K3.1, Kimi-Linear,
# DeepSeek-V3.2) and 512 + 0 (NoPE MLA). fp8_ds_mla = rank + 4 x rank / 128 + 2 x rope.
MLA_512_64 = {"auto": 1152, "bfloat16": 1152, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}
MLA_512_0 = {"auto": 1024, "bfloat16": 1024, "fp8": 512, "fp8_e4m3": 512, "fp8_ds_mla": 528}
# One indexer key entry at head_dim 128: 128 + 4 (FP8), 64 + 4 (MXFP4).
INDEX_128 = {"auto": 132, "fp8": 132, "mxfp4": 68}
RESOLVED = {"auto": "fp8", "fp8": "fp8", "mxfp4": "mxfp4"}

# K3.1 row bytes per token = 24 x (mla + index), by (kv_cache_dtype, indexer dtype).
K31_ROW = {
    ("auto", "fp8"): 30816,  # 24 x (1152 + 132) = 24 x 1284
    ("auto", "mxfp4"): 29280,  # 24 x (1152 + 68) = 24 x 1220
    ("bfloat16", "fp8"): 30816,
    ("bfloat16", "mxfp4"): 29280,
    ("fp8", "fp8"): 16992,  # 24 x (576 + 132) = 24 x 708
    ("fp8", "mxfp4"): 15456,  # 24 x (576 + 68) = 24 x 644
    ("fp8_e4m3", "fp8"): 16992,
    ("fp8_e4m3", "mxfp4"): 15456,
    ("fp8_ds_mla", "fp8"): 18912,  # 24 x (656 + 132) = 24 x 788
    ("fp8_ds_mla", "mxfp4"): 17376,  # 24 x (656 + 68) = 24 x 724
}

# The same K3.1 layer pattern with qk_rope_head_dim 0 (NoPE MLA, 512 cached values).
K31_NOPE_ROW = {
    ("auto", "fp8"): 27744,  # 24 x (1024 + 132) = 24 x 1156
    ("fp8", "mxfp4"): 13920,  # 24 x (512 + 68) = 24 x 580
    ("fp8_ds_mla", "fp8"): 15840,  # 24 x (528 + 132) = 24 x 660
    ("fp8_ds_mla", "mxfp4"): 14304,  # 24 x (528 + 68) = 24 x 596
}

# K3.1 KDA state per layer per rank, no speculation: (conv, recurrent) bytes.
# conv = 3 x (3 x 96 x 128 / tp) x 2 B; recurrent = (96 / tp) x 128 x 128 x 4 B.
K31_STATE = {
    1: (221184, 6291456),
    2: (110592, 3145728),
    3: (73728, 2097152),
    4: (55296, 1572864),
    8: (27648, 786432),
    16: (13824, 393216),
    32: (6912, 196608),
}

# Kimi-Linear-48B: conv = 3 x (3 x 32 x 128 / tp) x 2; recurrent = (32 / tp) x 128 x 128 x 4.
KL48_STATE = {
    1: (73728, 2097152),
    2: (36864, 1048576),
    4: (18432, 524288),
    8: (9216, 262144),
    16: (4608, 131072),
    32: (2304, 65536),
}


def k31(**options):
    return CacheConfig.from_model(K31, **options)


def k31_nope(**options):
    """The built-in K3.1 config with ``qk_rope_head_dim`` 0: a NoPE MLA caching only the latent."""
    raw = builtin_config_dict(K31)
    raw["qk_rope_head_dim"] = 0
    return CacheConfig.from_config_dict(raw, name="k31-nope", **options)


# --- entry sizes (formats/sizes.py) --------------------------------------------------------


@pytest.mark.parametrize("dtype,expected", list(MLA_512_64.items()))
def test_mla_entry_512_64(dtype, expected):
    assert mla_entry_bytes(512, 64, dtype) == expected


@pytest.mark.parametrize("dtype,expected", list(MLA_512_0.items()))
def test_mla_entry_512_0(dtype, expected):
    assert mla_entry_bytes(512, 0, dtype) == expected


def test_mla_entry_other_ranks():
    # fp8_ds_mla: rank + 4 x rank/128 + 2 x rope.
    assert mla_entry_bytes(256, 32, "fp8_ds_mla") == 256 + 8 + 64
    assert mla_entry_bytes(128, 0, "fp8_ds_mla") == 132
    assert mla_entry_bytes(384, 64, "bfloat16") == 896
    assert mla_entry_bytes(384, 64, "fp8_e4m3") == 448


@pytest.mark.parametrize("dtype,expected", list(INDEX_128.items()))
def test_indexer_entry_128(dtype, expected):
    assert indexer_entry_bytes(128, dtype) == expected


def test_indexer_entry_other_head_dims():
    assert indexer_entry_bytes(64, "fp8") == 68
    assert indexer_entry_bytes(64, "mxfp4") == 34  # 32 + 2
    assert indexer_entry_bytes(256, "mxfp4") == 136  # 128 + 8
    assert indexer_entry_bytes(32, "mxfp4") == 17  # 16 + 1


def test_fp8_indexer_page_is_8448_bytes():
    assert 64 * indexer_entry_bytes(128, "fp8") == 8448
    assert 64 * indexer_entry_bytes(128, "mxfp4") == 4352


# --- Kimi-K3.1: every TP size and dtype ------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kv_dtype", list(MLA_512_64))
@pytest.mark.parametrize("indexer", ["auto", "fp8", "mxfp4"])
def test_k31_bytes(tp, kv_dtype, indexer):
    config = k31(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype, indexer_kv_dtype=indexer)
    conv, recurrent = K31_STATE[tp]
    assert acc.mla_bytes_per_token(config) == MLA_512_64[kv_dtype]
    assert acc.index_bytes_per_token(config) == INDEX_128[indexer]
    assert acc.draft_bytes_per_token(config) == 0
    assert acc.row_bytes_per_token(config) == K31_ROW[(kv_dtype, RESOLVED[indexer])]
    assert acc.state_bytes(config) == conv + recurrent
    layout = plan(config)
    assert layout.mla_bytes_per_token == MLA_512_64[kv_dtype]
    assert layout.index_bytes_per_token == INDEX_128[indexer]
    assert layout.row_bytes_per_token == K31_ROW[(kv_dtype, RESOLVED[indexer])]
    assert layout.draft_bytes_per_token == 0
    assert layout.state.conv_bytes == conv
    assert layout.state.recurrent_bytes == recurrent
    assert layout.state_bytes == conv + recurrent
    assert layout.indexer_kv_dtype == RESOLVED[indexer]


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16, 32])
def test_k31_state_shapes(tp):
    shape = acc.kda_state_shape(k31(tensor_parallel_size=tp))
    assert shape.conv_shape == (3, 36864 // tp)  # 3 x 96 x 128 = 36864
    assert shape.recurrent_shape == (96 // tp, 128, 128)
    assert shape.recurrent_offset == K31_STATE[tp][0]  # the recurrent state follows the conv state
    assert shape.nbytes == sum(K31_STATE[tp])


def test_k31_tp8_headline_figures():
    layout = plan(k31())
    assert layout.config.model.mla_cached_dim == 576  # 512 + 64
    assert layout.mla_bytes_per_token == 656  # 512 + 16 + 128
    assert layout.index_bytes_per_token == 132
    assert layout.row_bytes_per_token == 18912  # 24 x 788
    assert layout.page_stride_bytes == 1210368  # 64 x 18912
    assert layout.state_bytes == 27648 + 786432 == 814080
    assert layout.states_per_row == 23


@pytest.mark.parametrize("kv_dtype,indexer", list(K31_NOPE_ROW))
def test_nope_mla_without_rope_dims_keeps_the_512_value_entry(kv_dtype, indexer):
    config = k31_nope(kv_cache_dtype=kv_dtype, indexer_kv_dtype=indexer)
    assert config.model.mla_cached_dim == 512
    assert acc.mla_bytes_per_token(config) == MLA_512_0[kv_dtype]
    assert acc.row_bytes_per_token(config) == K31_NOPE_ROW[(kv_dtype, indexer)]
    layout = plan(config)
    assert layout.mla_bytes_per_token == MLA_512_0[kv_dtype]
    assert layout.row_bytes_per_token == K31_NOPE_ROW[(kv_dtype, indexer)]
    assert layout.state_bytes == 814080  # the KDA state does not depend on the MLA entry


def test_nope_mla_tp8_headline_figures():
    layout = plan(k31_nope())
    assert layout.mla_bytes_per_token == 528  # 512 + 4 x 512 / 128
    assert layout.row_bytes_per_token == 15840  # 24 x (528 + 132)
    assert layout.page_stride_bytes == 1013760  # 64 x 15840


def test_state_bytes_at_explicit_tp():
    config = k31(tensor_parallel_size=8)
    assert acc.state_bytes(config, tp=1) == 6512640
    assert acc.state_bytes(config, tp=16) == 407040


def test_states_per_row_formula():
    # ceil(S / ceil(S / D))
    assert acc.states_per_row(24, 69) == 23  # ceil(69 / 3)
    assert acc.states_per_row(7, 20) == 7  # ceil(20 / 3)
    assert acc.states_per_row(24, 25) == 13  # ceil(25 / 2)
    assert acc.states_per_row(24, 24) == 24
    assert acc.states_per_row(24, 3) == 3
    assert acc.states_per_row(4, 9) == 3  # ceil(9 / 3)
    assert acc.states_per_row(1, 5) == 1
    assert acc.states_per_row(5, 1) == 1
    assert acc.states_per_row(10, 31) == 8  # ceil(31 / 4)


# --- speculative decoding: draft pages and conv growth ---------------------------------------


def dspark(n=3, **extra):
    return SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": n, "model": DSPARK, **extra})


@pytest.mark.parametrize("tp,state", [(1, 6733824), (8, 841728), (16, 420864)])
def test_dspark_draft_in_main_dtype(tp, state):
    # 5 draft layers x fp8_ds_mla(512 + 64) = 5 x 656; conv grows to (3 + 3) rows.
    config = k31(tensor_parallel_size=tp, speculative=dspark(3))
    assert acc.draft_entry_bytes(config) == 656
    assert acc.num_draft_layers(config) == 5
    assert acc.draft_bytes_per_token(config) == 3280
    assert acc.row_bytes_per_token(config) == 18912 + 3280 == 22192
    assert acc.kda_state_shape(config).conv_shape == (6, 36864 // tp)
    assert acc.state_bytes(config) == state


@pytest.mark.parametrize("draft_dtype,entry", [("bfloat16", 1152), ("auto", 1152), ("fp8", 576),
                                               ("fp8_e4m3", 576), ("fp8_ds_mla", 656)])
def test_dspark_draft_with_kv_cache_dtype_override(draft_dtype, entry):
    config = k31(speculative=dspark(3, kv_cache_dtype=draft_dtype))
    assert config.draft_kv_cache_dtype == draft_dtype
    assert acc.draft_bytes_per_token(config) == 5 * entry
    assert acc.mla_bytes_per_token(config) == 656  # the target keeps the main dtype
    layout = plan(config)
    assert layout.draft_bytes_per_token == 5 * entry
    assert layout.row_bytes_per_token == 18912 + 5 * entry


def test_dspark_draft_follows_main_dtype_without_override():
    config = k31(kv_cache_dtype="bfloat16", speculative=dspark(2))
    assert config.draft_kv_cache_dtype == "bfloat16"
    assert acc.draft_bytes_per_token(config) == 5 * 1152
    assert acc.row_bytes_per_token(config) == 30816 + 5760


def test_eagle3_inline_mla_draft():
    draft = {"num_hidden_layers": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    spec = SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 2, "draft_config": draft})
    config = k31(speculative=spec)
    assert acc.draft_bytes_per_token(config) == 656
    assert acc.row_bytes_per_token(config) == 19568  # 18912 + 656
    # conv rows 3 + 2 = 5: 5 x 4608 x 2 = 46080
    assert acc.state_bytes(config) == 46080 + 786432


def test_eagle3_json_string_and_two_layer_draft():
    text = ('{"method": "eagle3", "num_speculative_tokens": 1, "kv_cache_dtype": "fp8", '
            '"draft_config": {"num_hidden_layers": 2, "kv_lora_rank": 256, "qk_rope_head_dim": 32}}')
    config = k31(speculative=SpeculativeConfig.from_json(text))
    assert acc.draft_bytes_per_token(config) == 2 * (256 + 32)


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_mla_draft_method_without_draft_model_has_no_draft_pages(method):
    spec = SpeculativeConfig.from_json({"method": method, "num_speculative_tokens": 2})
    config = k31(speculative=spec)
    assert acc.draft_bytes_per_token(config) == 0
    assert acc.state_bytes(config) == 5 * 4608 * 2 + 786432


def test_eagle3_draft_without_kv_lora_rank_has_no_draft_pages():
    draft = {"num_hidden_layers": 1, "hidden_size": 7168, "num_attention_heads": 64}
    spec = SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 3, "draft_config": draft})
    config = k31(speculative=spec)
    assert acc.draft_bytes_per_token(config) == 0
    assert acc.row_bytes_per_token(config) == 18912
    # the speculative tokens still grow the conv state: (3 + 3) x 4608 x 2
    assert acc.state_bytes(config) == 55296 + 786432


def test_draft_model_path_without_kv_lora_rank_has_no_draft_pages(tmp_path):
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 1, "hidden_size": 4096}}')
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 1, "model": str(tmp_path)})
    assert acc.draft_bytes_per_token(k31(speculative=spec)) == 0


def test_draft_model_path_with_text_config(tmp_path):
    draft = {"text_config": {"num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64}}
    (tmp_path / "config.json").write_text(json.dumps(draft))
    spec = SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 1,
                                        "model": str(tmp_path / "config.json")})
    assert acc.draft_bytes_per_token(k31(speculative=spec)) == 3 * 656


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp", "eagle", "draft_model"])
def test_non_mla_draft_method_keeps_no_draft_pages_even_with_an_mla_draft(method):
    spec = SpeculativeConfig.from_json({"method": method, "num_speculative_tokens": 1, "model": DSPARK})
    config = k31(speculative=spec)
    assert acc.draft_bytes_per_token(config) == 0
    assert acc.row_bytes_per_token(config) == 18912
    # conv rows 3 + 1 = 4: 4 x 4608 x 2 = 36864
    assert acc.state_bytes(config) == 36864 + 786432 == 823296


@pytest.mark.parametrize("n,conv", [(1, 36864), (2, 46080), (4, 64512), (7, 92160)])
def test_ngram_grows_the_conv_state(n, conv):
    spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": n})
    config = k31(speculative=spec)
    assert config.num_speculative_tokens == n
    assert acc.draft_bytes_per_token(config) == 0
    assert acc.kda_state_shape(config).conv_shape == (3 + n, 4608)
    assert plan(config).state.conv_bytes == conv
    assert plan(config).state.recurrent_bytes == 786432  # the recurrent state does not grow


def test_ngram_grows_the_conv_state_at_tp1():
    spec = SpeculativeConfig("ngram", 4)
    config = k31(tensor_parallel_size=1, speculative=spec)
    assert acc.state_bytes(config) == 7 * 36864 * 2 + 6291456  # 516096 + 6291456


# --- Kimi-Linear-48B: paged, no indexer ------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("kv_dtype", list(MLA_512_64))
def test_kimi_linear_bytes(tp, kv_dtype):
    config = CacheConfig.from_model(KL48, tensor_parallel_size=tp, kv_cache_dtype=kv_dtype)
    conv, recurrent = KL48_STATE[tp]
    assert config.model.num_dsa_layers == 0
    assert config.model.num_kda_layers == 20
    assert acc.index_bytes_per_token(config) == 0
    assert acc.mla_bytes_per_token(config) == MLA_512_64[kv_dtype]
    # every one of the 7 full-attention layers keeps its MLA page
    assert acc.row_bytes_per_token(config) == 7 * MLA_512_64[kv_dtype]
    layout = plan(config)
    assert not layout.is_packed
    assert layout.kind == "paged"
    assert layout.state.conv_bytes == conv
    assert layout.state.recurrent_bytes == recurrent
    assert layout.states_per_row == 0


def test_kimi_linear_row_bytes_literals():
    assert plan(CacheConfig.from_model(KL48)).row_bytes_per_token == 4592  # 7 x 656
    assert plan(CacheConfig.from_model(KL48, kv_cache_dtype="auto")).row_bytes_per_token == 8064  # 7 x 1152
    assert plan(CacheConfig.from_model(KL48, kv_cache_dtype="fp8")).row_bytes_per_token == 4032  # 7 x 576


def test_kimi_linear_speculation_grows_conv():
    spec = SpeculativeConfig("ngram", 2)
    config = CacheConfig.from_model(KL48, tensor_parallel_size=4, speculative=spec)
    # (3 + 2) x (3 x 32 x 128 / 4) x 2 = 5 x 3072 x 2
    assert acc.kda_state_shape(config).conv_shape == (5, 3072)
    assert acc.state_bytes(config) == 30720 + 524288


# --- DeepSeek-V3.2: every layer MLA + indexer, no KDA ----------------------------------------


def test_deepseek_v32_bytes():
    layout = plan(CacheConfig.from_model("deepseek-v3.2"))
    assert layout.mla_bytes_per_token == 656
    assert layout.index_bytes_per_token == 132
    assert layout.row_bytes_per_token == 61 * 788 == 48068
    assert layout.state is None
    assert layout.state_bytes == 0
    assert not layout.is_packed


def test_deepseek_v32_no_state_shape():
    assert acc.kda_state_shape(CacheConfig.from_model("deepseek-v3.2")) is None
    assert acc.state_bytes(CacheConfig.from_model("deepseek-v3.2")) == 0


# --- the MXFP4 decision ---------------------------------------------------------------------


@pytest.mark.parametrize("requested,resolved", [("auto", "fp8"), ("fp8", "fp8"), ("mxfp4", "mxfp4")])
def test_indexer_dtype_resolution(requested, resolved):
    assert k31(indexer_kv_dtype=requested).resolved_indexer_kv_dtype == resolved


@pytest.mark.parametrize("arch,backend", [("sm89", "triton"), ("sm90", "triton"), ("sm100", "triton"),
                                          ("sm103", "triton"), ("sm120", "triton"), ("gfx950", "triton"),
                                          ("sm100", "deepgemm"), ("sm103", "deepgemm")])
def test_mxfp4_accepted_where_the_backend_reads_it(arch, backend):
    config = k31(indexer_kv_dtype="mxfp4", target_arch=arch, indexer_backend=backend)
    assert plan(config).index_bytes_per_token == 68


def test_mxfp4_with_decode_context_parallelism_is_allowed():
    config = k31(indexer_kv_dtype="mxfp4", decode_context_parallel_size=2)
    assert plan(config).indexer_kv_dtype == "mxfp4"
