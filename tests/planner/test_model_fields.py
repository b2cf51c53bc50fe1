"""The MLA widths and head count read from ``config.json``, and what the serving config makes of them."""

import copy
import json

import pytest

from dsacache import CacheConfig, ModelSpec, load_model
from dsacache.config.model import builtin_config_dict


def k31_raw():
    return copy.deepcopy(builtin_config_dict("kimi-k3.1"))


def mla_fields(spec):
    return (spec.num_attention_heads, spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim,
            spec.qk_rope_head_dim, spec.v_head_dim, spec.mla_use_nope, spec.mla_cached_dim)


# (heads, q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim, mla_use_nope, cached = rank + rope)
BUILTIN_MLA = {
    "kimi-k3.1": (96, 1536, 512, 128, 64, 128, True, 576),
    "kimi-linear-48b": (32, None, 512, 128, 64, 128, True, 576),
    "deepseek-v3.2": (128, 1536, 512, 128, 64, 128, False, 576),
    "kimi-k3.1-dspark": (96, None, 512, 128, 64, 128, True, 576),
}


@pytest.mark.parametrize("name", list(BUILTIN_MLA))
def test_builtin_mla_fields(name):
    assert mla_fields(load_model(name)) == BUILTIN_MLA[name]


def test_fields_read_from_top_level_and_text_config(tmp_path):
    raw = k31_raw()
    raw.update(num_attention_heads=64, q_lora_rank=768, qk_nope_head_dim=192, v_head_dim=256, mla_use_nope=False)
    expected = (64, 768, 512, 192, 64, 256, False, 576)
    assert mla_fields(ModelSpec.from_dict(raw)) == expected
    assert mla_fields(ModelSpec.from_dict({"text_config": raw, "num_attention_heads": 7})) == expected
    (tmp_path / "config.json").write_text(json.dumps({"text_config": raw}))
    assert mla_fields(load_model(tmp_path)) == expected
    assert mla_fields(CacheConfig.from_model(tmp_path / "config.json").model) == expected


def test_absent_fields_default():
    raw = k31_raw()
    for key in ("num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "mla_use_nope"):
        del raw[key]
    assert mla_fields(ModelSpec.from_dict(raw)) == (None, None, 512, None, 64, None, False, 576)
    assert CacheConfig.from_config_dict(raw).attention_heads_per_rank is None


def test_null_q_lora_rank_is_accepted():
    raw = k31_raw()
    raw["q_lora_rank"] = None
    spec = ModelSpec.from_dict(raw)
    assert spec.q_lora_rank is None
    assert spec.num_attention_heads == 96


def test_mla_cached_dim_without_rope():
    raw = k31_raw()
    raw["qk_rope_head_dim"] = 0
    assert ModelSpec.from_dict(raw).mla_cached_dim == 512
    del raw["qk_rope_head_dim"]  # absent means 0
    assert ModelSpec.from_dict(raw).mla_cached_dim == 512


@pytest.mark.parametrize("tp,per_rank", [(1, 96), (2, 48), (3, 32), (4, 24), (8, 12), (16, 6), (32, 3), (96, 1)])
def test_k31_attention_heads_per_rank(tp, per_rank):
    assert CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=tp).attention_heads_per_rank == per_rank


def test_attention_heads_per_rank_other_models():
    assert CacheConfig.from_model("deepseek-v3.2", tensor_parallel_size=16).attention_heads_per_rank == 8
    assert CacheConfig.from_model("kimi-linear-48b", tensor_parallel_size=4).attention_heads_per_rank == 8


@pytest.mark.parametrize("field,value,match", [
    ("num_attention_heads", 0, "ModelSpec.num_attention_heads must be an integer >= 1"),
    ("q_lora_rank", 1.5, "ModelSpec.q_lora_rank must be an integer"),
    ("v_head_dim", "128", "ModelSpec.v_head_dim must be an integer"),
    ("mla_use_nope", 1, "ModelSpec.mla_use_nope must be True or False"),
])
def test_modelspec_checks_the_mla_fields_it_is_built_with(field, value, match):
    import dataclasses

    from dsacache.config.model import load_model

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(load_model("kimi-k3.1"), **{field: value})
