"""The cache-relevant facts of a model, read from a HF ``config.json`` (pure Python).

Only the fields the cache and its kernels depend on are read (``docs/planning.md``, "The model family"):
the KDA layer split and sizes, the MLA sizes (the cached latent and the query/value
widths the attention kernels need) and the DSA indexer. Everything else in the file is
ignored. Each fact is validated once, here, with an error that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

BUILTIN_MODELS = ("kimi-k3.1", "kimi-linear-48b", "deepseek-v3.2", "kimi-k3.1-dspark")
INDEX_K_NORM_TYPES = ("rmsnorm", "layernorm")


class ConfigError(ValueError):
    """A model or serving setting is missing, malformed or not allowed."""


@dataclass(frozen=True)
class IndexerSpec:
    """The DSA lightning indexer of every full-attention layer."""

    n_heads: int
    head_dim: int
    topk: int
    k_norm_type: str = "rmsnorm"
    rope_dim: int = 0

    @property
    def has_fused_key_insert(self) -> bool:
        """LayerNorm key norm and no indexer RoPE: norm + quantize + store is one kernel."""
        return self.k_norm_type == "layernorm" and self.rope_dim == 0


@dataclass(frozen=True)
class KdaSpec:
    """Kimi Delta Attention layers: a fixed recurrent state per request."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    conv_kernel_size: int


@dataclass(frozen=True)
class ModelSpec:
    """What the cache needs to know about a model. Layer numbers are 1-based.

    MLA: each token caches ``kv_lora_rank + qk_rope_head_dim`` values (:attr:`mla_cached_dim`).
    With ``mla_use_nope`` (Kimi-K3 / K3.1, Kimi-Linear) no rotary embedding is applied, but the
    ``qk_rope_head_dim`` extra key dimensions are still computed and cached. The head count and
    the query/value widths are optional (a draft config may omit them); the attention kernels
    need ``num_attention_heads``.
    """

    name: str
    num_hidden_layers: int
    attention_layers: tuple[int, ...]
    kv_lora_rank: int
    qk_rope_head_dim: int
    kda: KdaSpec | None = None
    indexer: IndexerSpec | None = None
    num_attention_heads: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_use_nope: bool = False

    @property
    def mla_cached_dim(self) -> int:
        """Values one token's MLA entry holds: ``kv_lora_rank + qk_rope_head_dim`` (576 for K3.1)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_dsa_layers(self) -> int:
        """Full-attention layers carrying an indexer (D); 0 without a ``dsa_config``."""
        return len(self.attention_layers) if self.indexer else 0

    @property
    def num_kda_layers(self) -> int:
        """KDA layers (S)."""
        return len(self.kda.layers) if self.kda else 0

    @property
    def is_packed_hybrid(self) -> bool:
        """KDA layers and DSA layers in one model: the packed block row applies."""
        return self.num_kda_layers > 0 and self.num_dsa_layers > 0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], name: str = "config.json") -> "ModelSpec":
        """Build from a parsed ``config.json`` (top level or its ``text_config``)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{name}: expected a JSON object at the top level")
        cfg = raw.get("text_config", raw)
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{name}: 'text_config' must be a JSON object")
        num_layers = _int_field(cfg, "num_hidden_layers", name, minimum=1)
        kv_lora_rank = _int_field(cfg, "kv_lora_rank", name, minimum=1)
        rope = _int_field(cfg, "qk_rope_head_dim", name, minimum=0, default=0)
        kda, attention = _parse_layer_split(cfg, num_layers, name)
        return cls(
            name=name,
            num_hidden_layers=num_layers,
            attention_layers=attention,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            kda=kda,
            indexer=_parse_indexer(cfg, name),
            num_attention_heads=_optional_int_field(cfg, "num_attention_heads", name, minimum=1),
            q_lora_rank=_optional_int_field(cfg, "q_lora_rank", name, minimum=1),
            qk_nope_head_dim=_optional_int_field(cfg, "qk_nope_head_dim", name, minimum=0),
            v_head_dim=_optional_int_field(cfg, "v_head_dim", name, minimum=1),
            mla_use_nope=_bool_field(cfg, "mla_use_nope", name, default=False),
        )


def _int_field(cfg: Mapping[str, Any], key: str, where: str, minimum: int, default: int | None = None) -> int:
    if key not in cfg:
        if default is None:
            raise ConfigError(f"{where}: missing required field '{key}'")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _optional_int_field(cfg: Mapping[str, Any], key: str, where: str, minimum: int) -> int | None:
    """An integer field that may be absent or JSON ``null`` (None then)."""
    if cfg.get(key) is None:
        return None
    return _int_field(cfg, key, where, minimum)


def _bool_field(cfg: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def _layer_list(cfg: Mapping[str, Any], key: str, where: str, num_layers: int) -> tuple[int, ...]:
    value = cfg.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ConfigError(f"{where}: 'linear_attn_config.{key}' must be a list of 1-based layer numbers")
    bad = [x for x in value if not 1 <= x <= num_layers]
    if bad:
        raise ConfigError(
            f"{where}: 'linear_attn_config.{key}' has layers {bad} outside 1..{num_layers} (num_hidden_layers)"
        )
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: 'linear_attn_config.{key}' lists a layer twice")
    return tuple(sorted(value))


def _parse_layer_split(cfg: Mapping[str, Any], num_layers: int, where: str):
    """(KDA spec or None, attention layers): which layers are KDA and which are MLA."""
    lin = cfg.get("linear_attn_config")
    if lin is None:
        return None, tuple(range(1, num_layers + 1))
    if not isinstance(lin, Mapping):
        raise ConfigError(f"{where}: 'linear_attn_config' must be a JSON object")
    kda_layers = _layer_list(lin, "kda_layers", where, num_layers)
    full_layers = _layer_list(lin, "full_attn_layers", where, num_layers)
    if not full_layers:
        raise ConfigError(
            f"{where}: 'linear_attn_config.full_attn_layers' is empty: a model without attention layers "
            "has no KV cache to plan"
        )
    overlap = sorted(set(kda_layers) & set(full_layers))
    if overlap:
        raise ConfigError(f"{where}: layers {overlap} are in both 'kda_layers' and 'full_attn_layers'")
    missing = sorted(set(range(1, num_layers + 1)) - set(kda_layers) - set(full_layers))
    if missing:
        raise ConfigError(
            f"{where}: layers {missing} are in neither 'kda_layers' nor 'full_attn_layers' "
            f"(num_hidden_layers={num_layers})"
        )
    sub = f"{where}: linear_attn_config"
    kda = KdaSpec(
        layers=kda_layers,
        num_heads=_int_field(lin, "num_heads", sub, minimum=1),
        head_dim=_int_field(lin, "head_dim", sub, minimum=1),
        conv_kernel_size=_int_field(lin, "short_conv_kernel_size", sub, minimum=1),
    )
    return (kda if kda_layers else None), full_layers


def _parse_indexer(cfg: Mapping[str, Any], where: str) -> IndexerSpec | None:
    """The ``dsa_config`` block, or DeepSeek-V3.2's top-level ``index_*`` fields."""
    dsa = cfg.get("dsa_config")
    if dsa is None:
        if "index_n_heads" not in cfg:
            return None
        dsa, sub = cfg, where
    elif not isinstance(dsa, Mapping):
        raise ConfigError(f"{where}: 'dsa_config' must be a JSON object")
    else:
        sub = f"{where}: dsa_config"
    norm = dsa.get("index_k_norm_type", "rmsnorm")
    if norm not in INDEX_K_NORM_TYPES:
        raise ConfigError(f"{sub}: 'index_k_norm_type'={norm!r}; allowed: {', '.join(INDEX_K_NORM_TYPES)}")
    return IndexerSpec(
        n_heads=_int_field(dsa, "index_n_heads", sub, minimum=1),
        head_dim=_int_field(dsa, "index_head_dim", sub, minimum=1),
        topk=_int_field(dsa, "index_topk", sub, minimum=1),
        k_norm_type=norm,
        rope_dim=_int_field(dsa, "index_rope_dim", sub, minimum=0, default=0),
    )


def load_config_dict(source: str | Path) -> tuple[dict, str]:
    """Read a ``config.json`` (a file, or a directory holding one); returns (dict, display name)."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open() as f:
            return json.load(f), str(path)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None


def builtin_config_dict(name: str) -> dict:
    """The raw ``config.json`` dict of a built-in model."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"unknown built-in model {name!r}; allowed: {', '.join(BUILTIN_MODELS)}")
    text = resources.files("dsacache.config.builtin").joinpath(f"{name}.json").read_text()
    return json.loads(text)


def load_model(source: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a built-in name or a path to a ``config.json`` / model directory."""
    if str(source) in BUILTIN_MODELS:
        return ModelSpec.from_dict(builtin_config_dict(str(source)), name=str(source))
    raw, name = load_config_dict(source)
    return ModelSpec.from_dict(raw, name=name)
