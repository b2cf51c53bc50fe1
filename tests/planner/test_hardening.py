"""Issue 17 through the Python API: bounded work for any value, a ValueError naming the
argument for any wrong type, and every ``config.json`` failure as one ConfigError.

No expected number here depends on a built-in model's exact row bytes: sizes are read off
a plan of the same config, or come from small hand-made configs.
"""

import builtins
import copy
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsacache import CacheConfig, ConfigError, ModelSpec, SpeculativeConfig, load_model, plan
from dsacache.config.model import (
    MAX_CONFIG_BYTES,
    MAX_FIELD_VALUE,
    MAX_NUM_LAYERS,
    IndexerSpec,
    KdaSpec,
    builtin_config_dict,
    load_config_dict,
)
from dsacache.config.serving import MAX_CACHE_MEMORY_BYTES, MAX_PARALLEL_SIZE
from dsacache.planner import accounting as acc
from dsacache.planner.layout import packed_block_size, pow2_block_size
from dsacache.planner.report import render_text, summarize

FAST = 1.0  # seconds: every plan answers or refuses well under this


def hybrid_raw(num_layers=8, heads=8, **lin):
    """A small KDA-hybrid DSA config: every 4th layer is attention."""
    full = list(range(4, num_layers + 1, 4)) or [num_layers]
    return {
        "num_hidden_layers": num_layers, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "linear_attn_config": {"kda_layers": [i for i in range(1, num_layers + 1) if i not in full],
                               "full_attn_layers": full, "num_heads": heads, "head_dim": 64,
                               "short_conv_kernel_size": 4, **lin},
        "dsa_config": {"index_n_heads": 4, "index_head_dim": 128, "index_topk": 64,
                       "index_k_norm_type": "layernorm", "index_rope_dim": 0},
    }


def timed(fn, *args, **kwargs):
    """(result or raised ConfigError, seconds)."""
    start = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except ConfigError as exc:
        out = exc
    return out, time.perf_counter() - start


def plan_and_summarize(raw, **options):
    layout = plan(CacheConfig.from_config_dict(raw, **options))
    return render_text(summarize(layout, 4096))


# --- class 2: work that grows with a number in the input --------------------------------------


@pytest.mark.parametrize("with_kda", [False, True])
@pytest.mark.parametrize("layers", [MAX_NUM_LAYERS + 1, 10**12, 10**400])
def test_absurd_layer_count_is_refused_at_once(layers, with_kda):
    raw = hybrid_raw() if with_kda else {"num_hidden_layers": 1, "kv_lora_rank": 512}
    raw["num_hidden_layers"] = layers
    out, seconds = timed(ModelSpec.from_dict, raw)
    assert isinstance(out, ConfigError) and seconds < FAST
    assert "'num_hidden_layers' must be <= 4,096" in str(out) and "MAX_NUM_LAYERS" in str(out)


def test_the_layer_limit_itself_plans_fast():
    raw = {"num_hidden_layers": MAX_NUM_LAYERS, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    out, seconds = timed(plan_and_summarize, raw, cache_memory_bytes=2**40)
    assert isinstance(out, str) and seconds < FAST
    hybrid = hybrid_raw(num_layers=MAX_NUM_LAYERS)
    out, seconds = timed(plan_and_summarize, hybrid, cache_memory_bytes=2**40, tensor_parallel_size=8)
    assert isinstance(out, str) and seconds < FAST


@pytest.mark.parametrize("heads", [1_000_000_007, 2**31 - 1, 2**31 - 2])
def test_huge_kda_head_count_message_is_bounded(heads):
    out, seconds = timed(CacheConfig.from_config_dict, hybrid_raw(heads=heads), tensor_parallel_size=65536)
    assert isinstance(out, ConfigError) and seconds < FAST
    message = str(out)
    assert f"tensor_parallel_size=65536 does not divide the {heads} KDA heads; allowed: 1" in message
    assert "MAX_PARALLEL_SIZE" in message
    divisors = [int(d) for d in message.split("allowed: ")[1].split(" (")[0].split(", ")]
    assert divisors == [d for d in range(1, MAX_PARALLEL_SIZE + 1) if heads % d == 0]


def test_small_head_count_lists_every_divisor():
    with pytest.raises(ConfigError, match=r"does not divide the 12 KDA heads; allowed: 1, 2, 3, 4, 6, 12$"):
        CacheConfig.from_config_dict(hybrid_raw(heads=12), tensor_parallel_size=5)


@pytest.mark.parametrize("path", [
    ("kv_lora_rank",), ("qk_rope_head_dim",),
    ("linear_attn_config", "num_heads"), ("linear_attn_config", "head_dim"),
    ("linear_attn_config", "short_conv_kernel_size"),
    ("dsa_config", "index_n_heads"), ("dsa_config", "index_head_dim"), ("dsa_config", "index_topk"),
    ("dsa_config", "index_rope_dim"),
])
@pytest.mark.parametrize("value", [MAX_FIELD_VALUE + 1, 10**30, 10**4000])
def test_oversized_integer_fields_are_refused_at_once(path, value):
    raw = hybrid_raw()
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    out, seconds = timed(ModelSpec.from_dict, raw)
    assert isinstance(out, ConfigError) and seconds < FAST
    assert f"'{path[-1]}' must be <= 2,147,483,647" in str(out)
    assert len(str(out)) < 300  # a 4000-digit integer is not printed


@pytest.mark.parametrize("field,value", [
    ("tensor_parallel_size", MAX_PARALLEL_SIZE + 1), ("reference_tp", 10**50),
    ("decode_context_parallel_size", 10**9), ("prefill_context_parallel_size", 2**17),
    ("cache_memory_bytes", MAX_CACHE_MEMORY_BYTES + 1), ("alignment", 2**40),
])
def test_oversized_serving_options_are_refused(field, value):
    raw = {"num_hidden_layers": 2, "kv_lora_rank": 512}
    out, seconds = timed(CacheConfig.from_config_dict, raw, **{field: value})
    assert isinstance(out, ConfigError) and seconds < FAST
    assert field in str(out)


def test_largest_values_everywhere_plan_or_refuse_fast():
    """Every field at its limit at once: the plan refuses (a state bigger than any budget) at once."""
    raw = hybrid_raw(num_layers=MAX_NUM_LAYERS, heads=2**30, head_dim=MAX_FIELD_VALUE,
                     short_conv_kernel_size=MAX_FIELD_VALUE)
    raw["kv_lora_rank"] = raw["qk_rope_head_dim"] = MAX_FIELD_VALUE
    raw["dsa_config"]["index_head_dim"] = 2**31 - 32
    out, seconds = timed(plan_and_summarize, raw, kv_cache_dtype="bfloat16", reference_tp=MAX_PARALLEL_SIZE,
                         alignment=2**31 - 64, cache_memory_bytes=MAX_CACHE_MEMORY_BYTES,
                         tensor_parallel_size=MAX_PARALLEL_SIZE)
    assert seconds < FAST
    assert isinstance(out, ConfigError) and "holds no row" in str(out)


@given(rbpt=st.integers(1, 2**40), states=st.integers(0, 2**60), page=st.sampled_from((64, 128)))
@settings(max_examples=200, deadline=None)
def test_pow2_block_size_is_the_smallest_doubling_that_fits(rbpt, states, page):
    block = pow2_block_size(rbpt, states, page)
    assert block >= page and (block // page) & (block // page - 1) == 0
    assert block * rbpt >= states
    assert block == page or (block // 2) * rbpt < states


@pytest.mark.parametrize("args,name", [
    ((0, 100), "row_bytes_per_token"), ((100, -1), "states_bytes"), ((1.5, 100), "row_bytes_per_token"),
    ((100, 100, 0), "page"),
])
def test_pow2_block_size_refuses_what_would_loop(args, name):
    out, seconds = timed(pow2_block_size, *args)
    assert isinstance(out, ConfigError) and name in str(out) and seconds < FAST


# --- the budget that holds no row -------------------------------------------------------------


@pytest.mark.parametrize("model", ["kimi-k3.1", "kimi-linear-48b", "deepseek-v3.2"])
def test_budget_under_one_row_names_the_budget_and_the_row(model):
    layout = plan(CacheConfig.from_model(model))
    row_bytes = layout.row_bytes
    need = (1 + layout.guard_rows) * row_bytes  # a layout with KDA states also pays for its guard row
    for budget in (1, need - 1):
        with pytest.raises(ConfigError) as info:
            plan(CacheConfig.from_model(model, cache_memory_bytes=budget))
        message = str(info.value)
        assert f"cache_memory_bytes={budget:,} B" in message and "--kv-cache-memory-bytes" in message
        assert f"one row is {row_bytes:,} B" in message and f"give at least {need:,} B" in message
    assert plan(CacheConfig.from_model(model, cache_memory_bytes=need)).num_rows == 1


def test_power_of_two_rows_of_a_one_row_pool_are_refused_by_name():
    layout = plan(CacheConfig.from_model("kimi-k3.1"), num_rows=1)
    bigger = layout.pow2_block_size * 4
    with pytest.raises(ConfigError, match="holds no row of block_size=.*--kv-cache-memory-bytes"):
        layout.with_block_size(bigger)


def test_context_length_beyond_the_pool_is_refused_before_sizing():
    layout = plan(CacheConfig.from_model("kimi-k3.1"))
    for length in (layout.token_capacity + 1, 10**400):
        out, seconds = timed(summarize, layout, length)
        assert isinstance(out, ConfigError) and seconds < FAST
        assert "cannot hold one request" in str(out) and "--context-length" in str(out)


# --- class 7: API types -----------------------------------------------------------------------


K31 = load_model("kimi-k3.1")

BAD_CACHE_CONFIG_FIELDS = [
    ("model", "kimi-k3.1"), ("model", {"num_hidden_layers": 4}), ("model", None),
    ("tensor_parallel_size", "8"), ("tensor_parallel_size", 8.0), ("tensor_parallel_size", True),
    ("tensor_parallel_size", None), ("prefill_context_parallel_size", "1"), ("decode_context_parallel_size", 1.0),
    ("reference_tp", [8]), ("alignment", "64"), ("cache_memory_bytes", 4.8e10), ("cache_memory_bytes", "48GiB"),
    ("kv_cache_dtype", 8), ("kv_cache_dtype", None), ("kv_cache_dtype", ["fp8"]),
    ("indexer_kv_dtype", b"fp8"), ("indexer_kv_dtype", None), ("target_arch", 90), ("indexer_backend", {"triton"}),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1}), ("speculative", "mtp"),
]


@pytest.mark.parametrize("field,value", BAD_CACHE_CONFIG_FIELDS)
def test_cache_config_refuses_wrong_types_by_name(field, value):
    options = {"model": K31, field: value}
    with pytest.raises(ValueError, match=field):
        CacheConfig(**options)


@pytest.mark.parametrize("field,value", [f for f in BAD_CACHE_CONFIG_FIELDS if f[0] != "model"])
def test_from_model_refuses_wrong_types_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig.from_model("kimi-k3.1", **{field: value})


def test_unknown_option_is_a_value_error_listing_the_options():
    with pytest.raises(ConfigError, match=r"unknown CacheConfig options \['tp'\]; allowed: tensor_parallel_size"):
        CacheConfig.from_model("kimi-k3.1", tp=8)
    with pytest.raises(ConfigError, match="unknown CacheConfig options"):
        CacheConfig.from_config_dict(builtin_config_dict("kimi-k3.1"), max_model_len=8)


@pytest.mark.parametrize("source", [8, None, ["kimi-k3.1"], b"kimi-k3.1"])
def test_model_source_types(source):
    with pytest.raises(ConfigError, match="model must be a built-in name or a path"):
        CacheConfig.from_model(source)
    with pytest.raises(ConfigError, match="model must be a built-in name or a path"):
        load_model(source)


def test_config_dict_name_must_be_a_string():
    with pytest.raises(ConfigError, match="name must be a string"):
        CacheConfig.from_config_dict(builtin_config_dict("kimi-k3.1"), name=3)


@pytest.mark.parametrize("num_rows", [2.5, 10.0, "10", True, [10]])
def test_plan_num_rows_must_be_an_int(num_rows):
    with pytest.raises(ConfigError, match="num_rows must be an integer >= 1"):
        plan(CacheConfig.from_model("kimi-k3.1"), num_rows=num_rows)


@pytest.mark.parametrize("config", ["kimi-k3.1", None, K31, {"tensor_parallel_size": 8}])
def test_plan_config_must_be_a_cache_config(config):
    with pytest.raises(ConfigError, match="config must be a CacheConfig"):
        plan(config)


def test_pool_past_the_int64_limit_is_refused():
    config = CacheConfig.from_model("kimi-k3.1")
    with pytest.raises(ConfigError, match="pool limit"):
        plan(config, num_rows=2**62)


@pytest.mark.parametrize("length", [2.5, "4096", None, True])
def test_summarize_context_length_type(length):
    with pytest.raises(ConfigError, match="context_length must be >= 1"):
        summarize(plan(CacheConfig.from_model("kimi-k3.1")), length)


def test_summarize_layout_type():
    with pytest.raises(ConfigError, match="layout must be a CacheLayout"):
        summarize(CacheConfig.from_model("kimi-k3.1"), 4096)


@pytest.mark.parametrize("block", [2048.0, "2048", None, 0])
def test_with_block_size_type(block):
    with pytest.raises(ConfigError, match="block_size must be an integer >= 64"):
        plan(CacheConfig.from_model("kimi-k3.1")).with_block_size(block)


def test_accounting_functions_check_their_arguments():
    config = CacheConfig.from_model("kimi-k3.1")
    with pytest.raises(ConfigError, match="config must be a CacheConfig"):
        acc.row_bytes_per_token("kimi-k3.1")
    with pytest.raises(ConfigError, match="tp must be an integer"):
        acc.kda_state_shape(config, tp="8")
    with pytest.raises(ConfigError, match="tp=5 does not divide"):
        acc.state_bytes(config, tp=5)
    with pytest.raises(ConfigError, match="num_dsa_layers must be an integer >= 1"):
        acc.states_per_row(0, 3)
    with pytest.raises(ConfigError, match="states_per_row must be an integer >= 1"):
        packed_block_size(config, 100, 0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(method=3, num_speculative_tokens=1), "method"),
    (dict(method="mtp", num_speculative_tokens="3"), "num_speculative_tokens"),
    (dict(method="mtp", num_speculative_tokens=2.0), "num_speculative_tokens"),
    (dict(method="mtp", num_speculative_tokens=1, kv_cache_dtype=8), "kv_cache_dtype"),
    (dict(method="dspark", num_speculative_tokens=1, draft={"kv_lora_rank": 512}), "draft"),
    (dict(method="dspark", num_speculative_tokens=1, draft="kimi-k3.1-dspark"), "draft"),
])
def test_speculative_config_types(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("value", [3, None, ["mtp"], b"{}"])
def test_json_options_refuse_non_text(value):
    with pytest.raises(ConfigError, match="--speculative-config"):
        SpeculativeConfig.from_json(value)


@pytest.mark.parametrize("kwargs,name", [
    (dict(name=1), "ModelSpec.name"),
    (dict(num_hidden_layers="4"), "ModelSpec.num_hidden_layers"),
    (dict(kv_lora_rank=512.0), "ModelSpec.kv_lora_rank"),
    (dict(qk_rope_head_dim=None), "ModelSpec.qk_rope_head_dim"),
    (dict(attention_layers=[1, 2]), "ModelSpec.attention_layers"),
    (dict(attention_layers=(0,)), "ModelSpec.attention_layers"),
    (dict(attention_layers=(5,)), "ModelSpec.attention_layers"),
    (dict(attention_layers=("1",)), "ModelSpec.attention_layers"),
    (dict(attention_layers=()), "no attention layers"),
    (dict(kda={"num_heads": 8}), "ModelSpec.kda"),
    (dict(indexer="fp8"), "ModelSpec.indexer"),
])
def test_model_spec_types(kwargs, name):
    fields = dict(name="m", num_hidden_layers=4, attention_layers=(4,), kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(ConfigError, match=name):
        ModelSpec(**{**fields, **kwargs})


def test_sub_spec_types():
    with pytest.raises(ConfigError, match="KdaSpec.num_heads"):
        KdaSpec((1, 2), "8", 64, 4)
    with pytest.raises(ConfigError, match="KdaSpec.layers"):
        KdaSpec([1.0], 8, 64, 4)
    with pytest.raises(ConfigError, match="IndexerSpec.head_dim"):
        IndexerSpec(4, 128.0, 64)
    with pytest.raises(ConfigError, match="IndexerSpec.k_norm_type"):
        IndexerSpec(4, 128, 64, k_norm_type=None)


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                 st.binary(max_size=4), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                          st.integers(), max_size=2))
_FIELDS = ("tensor_parallel_size", "kv_cache_dtype", "indexer_kv_dtype", "speculative",
           "prefill_context_parallel_size", "decode_context_parallel_size", "target_arch", "indexer_backend",
           "reference_tp", "alignment", "cache_memory_bytes")


@given(st.dictionaries(st.sampled_from(_FIELDS), _ANY, min_size=1, max_size=4))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_option_values_give_a_layout_or_a_value_error(options):
    """Never TypeError/AttributeError/ZeroDivisionError: a layout, or a ValueError/NotImplementedError."""
    start = time.perf_counter()
    try:
        layout = plan(CacheConfig.from_model(K31, **options))
    except (ValueError, NotImplementedError):
        return
    finally:
        assert time.perf_counter() - start < FAST
    assert layout.num_rows >= 1


# --- class 3 at the API: every config.json failure is a ConfigError naming the file ------------


def test_unreadable_config_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("{}")
    if os.geteuid() == 0:  # root reads a mode-000 file: make the open fail as it would for a user
        real_open = builtins.open

        def refuse(file, *args, **kwargs):
            if os.fspath(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", refuse)
        monkeypatch.setattr(type(path), "open", lambda self, *a, **k: refuse(self, *a, **k))
    else:
        path.chmod(0)
    with pytest.raises(ConfigError, match=r"config.json: cannot read \(Permission denied\)"):
        load_model(path)


def test_deeply_nested_config_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="config.json: JSON nested too deeply"):
        load_model(path)
    with pytest.raises(ConfigError, match="--speculative-config: JSON nested too deeply"):
        SpeculativeConfig.from_json('{"method": ' + "[" * 100_000 + "]" * 100_000 + "}")


@pytest.mark.parametrize("data", [b"\xff\xfe{}", b'{"num_hidden_layers": 4, "x": "\xe9"}', b"\x00" * 64])
def test_binary_config_names_the_file(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=r"config.json: (not UTF-8 JSON text|malformed JSON)"):
        load_model(path)


def test_integer_with_too_many_digits_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match="config.json: malformed JSON .an integer with too many digits"):
        load_model(path)


def test_oversized_and_irregular_files(tmp_path, monkeypatch):
    monkeypatch.setattr("dsacache.config.model.MAX_CONFIG_BYTES", 64)
    path = tmp_path / "config.json"
    path.write_text('{"pad": "' + "x" * 100 + '"}')
    with pytest.raises(ConfigError, match="config.json: larger than"):
        load_config_dict(path)
    assert MAX_CONFIG_BYTES == 16 * 2**20
    with pytest.raises(ConfigError, match="/dev/null: not a regular file"):
        load_config_dict("/dev/null")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="fifo: not a regular file"):  # and does not block reading it
        load_config_dict(fifo)


@pytest.mark.parametrize("source", ["", "   "])
def test_empty_config_path(source):
    with pytest.raises(ConfigError, match="config path is empty"):
        load_config_dict(source)


def test_long_values_are_cut_in_messages():
    raw = copy.deepcopy(builtin_config_dict("kimi-k3.1"))
    raw["linear_attn_config"]["kda_layers"] = list(range(10_000, 20_000))
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_dict(raw)
    assert len(str(info.value)) < 300 and "..." in str(info.value)
    assert "\n" not in str(info.value)
