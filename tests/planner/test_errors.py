"""Every refusal, through the Python API: a ``ConfigError`` (a ``ValueError``) that names the
setting and, where there is a closed set, the allowed values."""

import copy
import json

import pytest

from dsacache import CacheConfig, ConfigError, ModelSpec, SpeculativeConfig, load_model, plan
from dsacache.config.model import builtin_config_dict
from dsacache.config.serving import parse_attention_config
from dsacache.planner.report import summarize


def k31_raw():
    return copy.deepcopy(builtin_config_dict("kimi-k3.1"))


def small_raw(**lin):
    """4 layers: 1 DSA layer (4), 3 KDA layers; KDA fields overridable."""
    return {
        "num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 0,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 8,
                               "head_dim": 64, "short_conv_kernel_size": 4, **lin},
        "dsa_config": {"index_n_heads": 4, "index_head_dim": 128, "index_topk": 64,
                       "index_k_norm_type": "layernorm", "index_rope_dim": 0},
    }


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- config.json: missing, malformed ---------------------------------------------------------


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_model(tmp_path / "nope" / "config.json")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_malformed_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 4,,}')
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_model(path)
    with pytest.raises(ConfigError, match="malformed JSON"):
        CacheConfig.from_model(tmp_path)


def test_top_level_not_an_object():
    with pytest.raises(ConfigError, match="JSON object"):
        ModelSpec.from_dict([1, 2, 3])
    with pytest.raises(ConfigError, match="'text_config' must be a JSON object"):
        ModelSpec.from_dict({"text_config": [1]})


@pytest.mark.parametrize("field", ["num_hidden_layers", "kv_lora_rank"])
def test_missing_required_field(field):
    raw = k31_raw()
    del raw[field]
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        CacheConfig.from_config_dict(raw)


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", "93"), ("num_hidden_layers", 0), ("num_hidden_layers", True),
    ("kv_lora_rank", -512), ("kv_lora_rank", 512.0), ("qk_rope_head_dim", -1),
])
def test_malformed_integer_field(field, value):
    raw = k31_raw()
    raw[field] = value
    with pytest.raises(ConfigError, match=f"'{field}' must be an integer >= "):
        ModelSpec.from_dict(raw)


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 0), ("num_attention_heads", "96"), ("num_attention_heads", True),
    ("q_lora_rank", 0), ("q_lora_rank", 1536.0), ("qk_nope_head_dim", -1), ("v_head_dim", 0),
])
def test_malformed_mla_width_field(field, value):
    raw = k31_raw()
    raw[field] = value
    with pytest.raises(ConfigError, match=f"'{field}' must be an integer >= "):
        ModelSpec.from_dict(raw)


@pytest.mark.parametrize("value", ["yes", 1, 0, "true"])
def test_malformed_mla_use_nope(value):
    raw = k31_raw()
    raw["mla_use_nope"] = value
    with pytest.raises(ConfigError, match=f"'mla_use_nope' must be true or false, got {value!r}"):
        ModelSpec.from_dict(raw)
    with pytest.raises(ConfigError, match="'mla_use_nope' must be true or false"):
        ModelSpec.from_dict({"text_config": raw})


@pytest.mark.parametrize("field", ["num_heads", "head_dim", "short_conv_kernel_size"])
def test_missing_kda_field(field):
    raw = k31_raw()
    del raw["linear_attn_config"][field]
    with pytest.raises(ConfigError, match=f"linear_attn_config: missing required field '{field}'"):
        ModelSpec.from_dict(raw)


@pytest.mark.parametrize("field", ["index_n_heads", "index_head_dim", "index_topk"])
def test_missing_indexer_field(field):
    raw = k31_raw()
    del raw["dsa_config"][field]
    with pytest.raises(ConfigError, match=f"dsa_config: missing required field '{field}'"):
        ModelSpec.from_dict(raw)


def test_bad_index_k_norm_type_lists_allowed():
    raw = k31_raw()
    raw["dsa_config"]["index_k_norm_type"] = "batchnorm"
    with pytest.raises(ConfigError, match="index_k_norm_type.*batchnorm.*allowed: rmsnorm, layernorm"):
        ModelSpec.from_dict(raw)


def test_non_object_blocks():
    raw = k31_raw()
    raw["dsa_config"] = [1]
    with pytest.raises(ConfigError, match="'dsa_config' must be a JSON object"):
        ModelSpec.from_dict(raw)
    raw = k31_raw()
    raw["linear_attn_config"] = "kda"
    with pytest.raises(ConfigError, match="'linear_attn_config' must be a JSON object"):
        ModelSpec.from_dict(raw)


# --- layer lists -----------------------------------------------------------------------------


def test_overlapping_layer_lists():
    raw = k31_raw()
    raw["linear_attn_config"]["kda_layers"].append(4)
    with pytest.raises(ConfigError, match=r"layers \[4\] are in both 'kda_layers' and 'full_attn_layers'"):
        CacheConfig.from_config_dict(raw)


def test_unassigned_layers():
    raw = k31_raw()
    raw["linear_attn_config"]["kda_layers"].remove(5)
    raw["linear_attn_config"]["kda_layers"].remove(91)
    with pytest.raises(ConfigError, match=r"layers \[5, 91\] are in neither 'kda_layers' nor 'full_attn_layers'"
                                          r".*num_hidden_layers=93"):
        CacheConfig.from_config_dict(raw)


def test_layer_outside_range():
    raw = k31_raw()
    raw["linear_attn_config"]["full_attn_layers"].append(94)
    with pytest.raises(ConfigError, match=r"full_attn_layers' has layers \[94\] outside 1..93"):
        ModelSpec.from_dict(raw)
    raw = small_raw(kda_layers=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"kda_layers' has layers \[0\] outside 1..4"):
        ModelSpec.from_dict(raw)


def test_layer_listed_twice():
    raw = small_raw(kda_layers=[1, 2, 2, 3])
    with pytest.raises(ConfigError, match="'linear_attn_config.kda_layers' lists a layer twice"):
        ModelSpec.from_dict(raw)


@pytest.mark.parametrize("value", [None, "1,2,3", [1, "2", 3], [1.0, 2, 3], [True, 2, 3]])
def test_layer_list_not_a_list_of_ints(value):
    raw = small_raw(kda_layers=value)
    with pytest.raises(ConfigError, match="'linear_attn_config.kda_layers' must be a list of 1-based layer numbers"):
        ModelSpec.from_dict(raw)


# --- serving options ------------------------------------------------------------------------


def test_tp_not_dividing_kda_heads_lists_allowed():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=5 does not divide the 96 KDA heads; "
                                          r"allowed: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96$"):
        CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=5)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=64 .* 32 KDA heads; allowed: 1, 2, 4, 8, 16, 32"):
        CacheConfig.from_model("kimi-linear-48b", tensor_parallel_size=64)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        CacheConfig.from_model("kimi-linear-48b", tensor_parallel_size=3)


def test_tp_without_kda_is_not_limited_by_kda_heads():
    # no KDA and no num_attention_heads: nothing bounds the TP size
    raw = copy.deepcopy(builtin_config_dict("deepseek-v3.2"))
    del raw["num_attention_heads"]
    assert plan(CacheConfig.from_config_dict(raw, tensor_parallel_size=5)).kind == "paged"
    assert plan(CacheConfig.from_model("deepseek-v3.2", tensor_parallel_size=16)).kind == "paged"  # 128 / 16


@pytest.mark.parametrize("model,tp,heads", [("deepseek-v3.2", 5, 128), ("deepseek-v3.2", 3, 128),
                                            ("deepseek-v3.2", 256, 128)])
def test_tp_not_dividing_attention_heads(model, tp, heads):
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}"):
        CacheConfig.from_model(model, tensor_parallel_size=tp)


@pytest.mark.parametrize("tp", [5, 64])
def test_k31_tp_not_dividing_96_attention_heads(tp):
    # K3.1's KDA heads are also 96, so the KDA check speaks first. With the KDA heads set to a count
    # the TP size divides (480 = 5 x 96, 192 = 3 x 64) the MLA check speaks and names num_attention_heads.
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp} does not divide"):
        CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=tp)
    raw = k31_raw()
    raw["linear_attn_config"]["num_heads"] = 480 if tp == 5 else 192
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp} does not divide num_attention_heads=96"):
        CacheConfig.from_config_dict(raw, tensor_parallel_size=tp)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "prefill_context_parallel_size",
                                  "decode_context_parallel_size", "reference_tp", "alignment",
                                  "cache_memory_bytes"])
@pytest.mark.parametrize("value", [0, -8, True, 2.0, "8"])
def test_positive_integer_options(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be an integer >= 1"):
        CacheConfig.from_model("kimi-k3.1", **{name: value})


def test_dcp_must_divide_tp():
    with pytest.raises(ConfigError, match="decode_context_parallel_size=3 must divide tensor_parallel_size=8"):
        CacheConfig.from_model("kimi-k3.1", decode_context_parallel_size=3)


def test_alignment_must_be_whole_kernel_pages():
    with pytest.raises(ConfigError, match="alignment=96 must be a multiple of the 64-token kernel page"):
        CacheConfig.from_model("kimi-k3.1", alignment=96)


def test_unknown_kv_cache_dtype():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp16'; allowed: auto, bfloat16, fp8, fp8_e4m3, "
                                          r"fp8_ds_mla"):
        CacheConfig.from_model("kimi-k3.1", kv_cache_dtype="fp16")


@pytest.mark.parametrize("value", ["fp4", "nvfp4", "FP8", "bfloat16"])
def test_unknown_indexer_kv_dtype(value):
    with pytest.raises(ConfigError, match=f"indexer_kv_dtype='{value}'; allowed: auto, fp8, mxfp4"):
        CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype=value)


def test_unknown_target_arch_and_backend():
    with pytest.raises(ConfigError, match=r"target_arch='sm70'; allowed: sm80, .*gfx950"):
        CacheConfig.from_model("kimi-k3.1", target_arch="sm70")
    with pytest.raises(ConfigError, match="indexer_backend='flashinfer'; allowed: triton, deepgemm"):
        CacheConfig.from_model("kimi-k3.1", indexer_backend="flashinfer")


def test_fp8_ds_mla_needs_rank_in_tiles_of_128():
    raw = small_raw()
    raw["kv_lora_rank"] = 320
    with pytest.raises(ValueError, match="kv_lora_rank=320 must be a multiple of 128.*fp8_ds_mla"):
        plan(CacheConfig.from_config_dict(raw, kv_cache_dtype="fp8_ds_mla", tensor_parallel_size=1))
    assert plan(CacheConfig.from_config_dict(raw, kv_cache_dtype="bfloat16", tensor_parallel_size=1))


def test_state_not_four_byte_aligned():
    # conv state 1 x (3 x 1 x 3) bf16 = 18 B: the fp32 recurrent state after it would be misaligned
    raw = small_raw(num_heads=1, head_dim=3, short_conv_kernel_size=2)
    with pytest.raises(ConfigError, match="not 4-byte aligned"):
        plan(CacheConfig.from_config_dict(raw, tensor_parallel_size=1))


@pytest.mark.parametrize("rows", [-1, 0])
def test_num_rows_below_one(rows):
    # the allocator refuses an empty pool too: plan does not build one
    with pytest.raises(ConfigError, match="num_rows must be an integer >= 1"):
        plan(CacheConfig.from_model("kimi-k3.1"), num_rows=rows)


# --- the MXFP4 refusals ---------------------------------------------------------------------


def test_mxfp4_refused_without_fused_insert_rmsnorm():
    raw = k31_raw()
    raw["dsa_config"]["index_k_norm_type"] = "rmsnorm"
    with pytest.raises(ConfigError, match="indexer_kv_dtype='mxfp4' needs the fused key insert.*"
                                          "index_k_norm_type='rmsnorm'.*Use indexer_kv_dtype='fp8'"):
        CacheConfig.from_config_dict(raw, indexer_kv_dtype="mxfp4")
    assert CacheConfig.from_config_dict(raw, indexer_kv_dtype="fp8")  # FP8 stays allowed


def test_mxfp4_refused_without_fused_insert_default_norm():
    raw = k31_raw()
    del raw["dsa_config"]["index_k_norm_type"]  # absent means rmsnorm
    with pytest.raises(ConfigError, match="fused key insert"):
        CacheConfig.from_config_dict(raw, indexer_kv_dtype="mxfp4")


def test_mxfp4_refused_with_indexer_rope():
    raw = k31_raw()
    raw["dsa_config"]["index_rope_dim"] = 64
    with pytest.raises(ConfigError, match="fused key insert.*index_rope_dim=64"):
        CacheConfig.from_config_dict(raw, indexer_kv_dtype="mxfp4")


def test_mxfp4_refused_for_deepseek_v32():
    with pytest.raises(ConfigError, match="fused key insert.*index_rope_dim=64"):
        CacheConfig.from_model("deepseek-v3.2", indexer_kv_dtype="mxfp4")


def test_mxfp4_refused_with_pcp():
    with pytest.raises(ConfigError, match="mxfp4.*refused with prefill context parallelism.*"
                                          "prefill_context_parallel_size=2"):
        CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype="mxfp4", prefill_context_parallel_size=2)
    # FP8 keys with PCP are a planner-level non-issue (the packed builder refuses PCP at runtime)
    assert CacheConfig.from_model("kimi-k3.1", prefill_context_parallel_size=2)


@pytest.mark.parametrize("backend,arch,readers", [
    ("deepgemm", "sm90", "sm100, sm103"),
    ("deepgemm", "gfx950", "sm100, sm103"),
    ("triton", "sm80", "sm89, sm90, sm100, sm103, sm120, gfx950"),
    ("triton", "gfx942", "sm89, sm90, sm100, sm103, sm120, gfx950"),
])
def test_mxfp4_refused_where_the_backend_cannot_read_it(backend, arch, readers):
    with pytest.raises(ConfigError, match=f"backend '{backend}' cannot read MXFP4 keys on {arch}; "
                                          f"it can on: {readers}"):
        CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype="mxfp4", indexer_backend=backend, target_arch=arch)


def test_mxfp4_refused_for_head_dim_not_in_groups_of_32():
    raw = small_raw()
    raw["dsa_config"]["index_head_dim"] = 48
    with pytest.raises(ConfigError, match="index_head_dim divisible by 32, got 48"):
        CacheConfig.from_config_dict(raw, indexer_kv_dtype="mxfp4", tensor_parallel_size=1)


# --- the budget -----------------------------------------------------------------------------


def test_budget_too_small_for_one_request():
    layout = plan(CacheConfig.from_model("kimi-k3.1", cache_memory_bytes=10**9))
    # 35 rows of 19,365,888 B are needed for 32768 tokens (3 state + 32 attention); 1 GB gives 51 rows -> fits 1
    assert summarize(layout, 32768)["max_concurrent_requests"] == 1
    small = plan(CacheConfig.from_model("kimi-k3.1", cache_memory_bytes=5 * 10**8))
    with pytest.raises(ConfigError, match="cache budget of 500,000,000 B cannot hold one request of 32768 tokens"
                                          ".*--kv-cache-memory-bytes"):
        summarize(small, 32768)


def test_budget_too_small_paged():
    layout = plan(CacheConfig.from_model("kimi-linear-48b", cache_memory_bytes=10**6))
    with pytest.raises(ConfigError, match="cannot hold one request"):
        summarize(layout, 4096)


def test_context_length_must_be_positive():
    with pytest.raises(ConfigError, match="context_length must be >= 1"):
        summarize(plan(CacheConfig.from_model("kimi-k3.1")), 0)


# --- JSON options ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['{"indexer_kv_dtype": mxfp4}', "{", "indexer_kv_dtype=mxfp4", ""])
def test_attention_config_malformed_json(text):
    with pytest.raises(ConfigError, match="--attention-config: malformed JSON"):
        parse_attention_config(text)


def test_attention_config_not_an_object_or_unknown_key():
    with pytest.raises(ConfigError, match="--attention-config: expected a JSON object"):
        parse_attention_config('["mxfp4"]')
    with pytest.raises(ConfigError, match=r"--attention-config: unknown keys \['use_fp4'\]; allowed: indexer_kv_dtype"):
        parse_attention_config('{"use_fp4": true}')
    assert parse_attention_config("{}") == "auto"
    assert parse_attention_config('{"indexer_kv_dtype": "mxfp4"}') == "mxfp4"


@pytest.mark.parametrize("text", ["{method: ngram}", '{"method": "ngram",}', "[", "null"])
def test_speculative_config_malformed_json(text):
    with pytest.raises(ConfigError, match="--speculative-config"):
        SpeculativeConfig.from_json(text)


def test_speculative_config_refusals():
    with pytest.raises(ConfigError, match="needs 'method' and 'num_speculative_tokens'"):
        SpeculativeConfig.from_json('{"method": "ngram"}')
    with pytest.raises(ConfigError, match=r"unknown keys \['tokens'\]; allowed: method, num_speculative_tokens"):
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "tokens": 2}')
    with pytest.raises(ConfigError, match="speculative_config.method='medusa2'; allowed: eagle, eagle3, dspark"):
        SpeculativeConfig.from_json('{"method": "medusa2", "num_speculative_tokens": 2}')
    with pytest.raises(ConfigError, match="'model' or 'draft_config', not both"):
        SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 2, "model": "kimi-k3.1-dspark",
                                     "draft_config": {"num_hidden_layers": 1, "kv_lora_rank": 512}})
    with pytest.raises(ConfigError, match="speculative_config.kv_cache_dtype='fp16'; allowed: auto, bfloat16"):
        SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 2, "kv_cache_dtype": "fp16"})


@pytest.mark.parametrize("n", [0, -1, "3", 2.5, True])
def test_speculative_tokens_must_be_positive_int(n):
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.from_json(json.dumps({"method": "ngram", "num_speculative_tokens": n}))


def test_speculative_draft_model_missing(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 2,
                                     "model": str(tmp_path / "missing")})


def test_speculative_draft_config_malformed():
    with pytest.raises(ConfigError, match="draft_config"):
        SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 2, "draft_config": [1, 2]})
    with pytest.raises(ConfigError, match="'kv_lora_rank' must be an integer >= 1"):
        SpeculativeConfig.from_json({"method": "eagle3", "num_speculative_tokens": 2,
                                     "draft_config": {"num_hidden_layers": 1, "kv_lora_rank": "512"}})


def test_speculative_draft_model_not_a_string():
    with pytest.raises(ConfigError, match="speculative_config.model must be a path or a built-in name"):
        SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 2, "model": 5})
