"""The cache-relevant facts of a model, read from a HF ``config.json`` (pure Python).

Only the fields the cache and its kernels depend on are read (``docs/planning.md``, "The model family"):
the KDA layer split and sizes, the MLA sizes (the cached latent and the query/value
widths the attention kernels need) and the DSA indexer. Everything else in the file is
ignored. Each fact is validated once, here, with an error that names the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

BUILTIN_MODELS = ("kimi-k3.1", "kimi-linear-48b", "deepseek-v3.2", "kimi-k3.1-dspark")
INDEX_K_NORM_TYPES = ("rmsnorm", "layernorm")

#: Most layers a model may have. The plan holds one slot per layer, so this bounds its
#: time and memory; real models have at most a few hundred.
MAX_NUM_LAYERS = 4096
_LAYERS_WHY = " (dsacache plans one slot per layer; MAX_NUM_LAYERS)"
#: Largest value of any other integer field (heads, dims, ranks, top-k): an int32, as the
#: kernels index with int32; a larger value is a typo, not a model.
MAX_FIELD_VALUE = 2**31 - 1
#: Largest ``config.json`` read; real ones are a few KB.
MAX_CONFIG_BYTES = 16 * 2**20


class ConfigError(ValueError):
    """A model or serving setting is missing, malformed or not allowed."""


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a huge integer by its size), for one-line errors."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(value: Any, name: str, minimum: int, maximum: int | None = None, why: str = "") -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[minimum, maximum]``; else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {show(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum:,}{why}, got {show(value)}")
    return value


def _check_type(value: Any, types: type | tuple[type, ...], name: str, what: str) -> None:
    if not isinstance(value, types):
        raise ConfigError(f"{name} must be {what}, got {type(value).__name__} {show(value)}")


def _check_layer_numbers(layers: Any, name: str, num_layers: int) -> None:
    """A list/tuple of distinct 1-based layer numbers within ``1..num_layers``."""
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ConfigError(f"{name} must be a list of 1-based layer numbers, got {show(layers)}")
    bad = [x for x in layers if not 1 <= x <= num_layers]
    if bad:
        raise ConfigError(f"{name} has layers {show(bad)} outside 1..{num_layers} (num_hidden_layers)")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{name} lists a layer twice")


@dataclass(frozen=True)
class IndexerSpec:
    """The DSA lightning indexer of every full-attention layer."""

    n_heads: int
    head_dim: int
    topk: int
    k_norm_type: str = "rmsnorm"
    rope_dim: int = 0

    def __post_init__(self):
        for name in ("n_heads", "head_dim", "topk"):
            check_int(getattr(self, name), f"IndexerSpec.{name}", 1, MAX_FIELD_VALUE)
        check_int(self.rope_dim, "IndexerSpec.rope_dim", 0, MAX_FIELD_VALUE)
        _check_norm_type(self.k_norm_type, "IndexerSpec.k_norm_type")

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

    def __post_init__(self):
        _check_layer_numbers(self.layers, "KdaSpec.layers", MAX_NUM_LAYERS)
        for name in ("num_heads", "head_dim", "conv_kernel_size"):
            check_int(getattr(self, name), f"KdaSpec.{name}", 1, MAX_FIELD_VALUE)


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

    def __post_init__(self):
        _check_type(self.name, str, "ModelSpec.name", "a string")
        n = check_int(self.num_hidden_layers, "ModelSpec.num_hidden_layers", 1, MAX_NUM_LAYERS, _LAYERS_WHY)
        check_int(self.kv_lora_rank, "ModelSpec.kv_lora_rank", 1, MAX_FIELD_VALUE)
        check_int(self.qk_rope_head_dim, "ModelSpec.qk_rope_head_dim", 0, MAX_FIELD_VALUE)
        _check_type(self.attention_layers, tuple, "ModelSpec.attention_layers", "a tuple of layer numbers")
        _check_layer_numbers(self.attention_layers, "ModelSpec.attention_layers", n)
        if not self.attention_layers:
            raise ConfigError(f"{self.name}: no attention layers (full_attn_layers is empty): a model without "
                              "attention layers has no KV cache to plan")
        _check_type(self.kda, (KdaSpec, type(None)), "ModelSpec.kda", "a KdaSpec or None")
        _check_type(self.indexer, (IndexerSpec, type(None)), "ModelSpec.indexer", "an IndexerSpec or None")
        if self.kda is not None:
            _check_layer_numbers(self.kda.layers, "ModelSpec.kda.layers", n)
        for name, minimum in (("num_attention_heads", 1), ("q_lora_rank", 1), ("qk_nope_head_dim", 0),
                              ("v_head_dim", 1)):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f"ModelSpec.{name}", minimum, MAX_FIELD_VALUE)
        _check_type(self.mla_use_nope, bool, "ModelSpec.mla_use_nope", "True or False")

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
        num_layers = _int_field(cfg, "num_hidden_layers", name, minimum=1, maximum=MAX_NUM_LAYERS,
                                why=_LAYERS_WHY)
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


def _int_field(cfg: Mapping[str, Any], key: str, where: str, minimum: int, default: int | None = None,
               maximum: int = MAX_FIELD_VALUE, why: str = "") -> int:
    if key not in cfg:
        if default is None:
            raise ConfigError(f"{where}: missing required field '{key}'")
        return default
    return check_int(cfg[key], f"{where}: '{key}'", minimum, maximum, why)


def _check_norm_type(norm: Any, name: str) -> None:
    if not isinstance(norm, str) or norm not in INDEX_K_NORM_TYPES:
        raise ConfigError(f"{name}={show(norm)}; allowed: {', '.join(INDEX_K_NORM_TYPES)}")


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
    _check_layer_numbers(value, f"{where}: 'linear_attn_config.{key}'", num_layers)
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
    overlap = sorted(set(kda_layers) & set(full_layers))
    if overlap:
        raise ConfigError(f"{where}: layers {show(overlap)} are in both 'kda_layers' and 'full_attn_layers'")
    missing = sorted(set(range(1, num_layers + 1)) - set(kda_layers) - set(full_layers))
    if missing:
        raise ConfigError(
            f"{where}: layers {show(missing)} are in neither 'kda_layers' nor 'full_attn_layers' "
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
    _check_norm_type(norm, f"{sub}: 'index_k_norm_type'")
    return IndexerSpec(
        n_heads=_int_field(dsa, "index_n_heads", sub, minimum=1),
        head_dim=_int_field(dsa, "index_head_dim", sub, minimum=1),
        topk=_int_field(dsa, "index_topk", sub, minimum=1),
        k_norm_type=norm,
        rope_dim=_int_field(dsa, "index_rope_dim", sub, minimum=0, default=0),
    )


def parse_json_text(text: str | bytes, where: str) -> Any:
    """Decode JSON (UTF-8 when bytes); every failure is a ConfigError naming ``where``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8 JSON text (undecodable byte at offset {exc.start})") from None
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected JSON text, got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply to read") from None
    except ValueError:  # the only other one: an integer literal over Python's digit limit
        raise ConfigError(f"{where}: malformed JSON (an integer with too many digits)") from None


def _config_path(source: Any) -> Path:
    """The ``config.json`` that ``source`` (a file, or a directory holding one) names."""
    _check_type(source, (str, os.PathLike), "config path", "a path")
    if not str(source).strip():
        raise ConfigError("config path is empty")
    path = Path(source)
    try:
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        if not path.is_file():
            raise ConfigError(f"{path}: not a regular file")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(f"{path!r}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    return path


def load_config_dict(source: str | Path) -> tuple[dict, str]:
    """Read a ``config.json`` (a file, or a directory holding one); returns (dict, display name).

    Refused with a :class:`ConfigError` naming the file: missing, unreadable, larger than
    ``MAX_CONFIG_BYTES``, not UTF-8, not JSON, or nested too deeply.
    """
    path = _config_path(source)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB; a config.json is a few KB")
    return parse_json_text(data, str(path)), str(path)


def builtin_config_dict(name: str) -> dict:
    """The raw ``config.json`` dict of a built-in model."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"unknown built-in model {name!r}; allowed: {', '.join(BUILTIN_MODELS)}")
    text = resources.files("dsacache.config.builtin").joinpath(f"{name}.json").read_text()
    return json.loads(text)


def load_model(source: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a built-in name or a path to a ``config.json`` / model directory."""
    _check_type(source, (str, os.PathLike), "model", "a built-in name or a path")
    if str(source) in BUILTIN_MODELS:
        return ModelSpec.from_dict(builtin_config_dict(str(source)), name=str(source))
    raw, name = load_config_dict(source)
    return ModelSpec.from_dict(raw, name=name)
