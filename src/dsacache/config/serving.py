"""Serving options and the frozen, validated :class:`CacheConfig` (pure Python).

Option names follow vLLM's launch flags so a user can paste them. Every refusal in
``docs/planning.md`` is raised here, once, as a :class:`ConfigError` (a ``ValueError``) or a
``NotImplementedError`` that names the setting and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from dsacache.config.model import (
    BUILTIN_MODELS,
    MAX_FIELD_VALUE,
    ConfigError,
    ModelSpec,
    builtin_config_dict,
    check_int,
    load_config_dict,
    load_model,
    parse_json_text,
    show,
)
from dsacache.formats.key_format import INDEXER_KV_DTYPES, MXFP4_GROUP_SIZE, resolve_indexer_kv_dtype
from dsacache.formats.sizes import KERNEL_PAGE_SIZE, KV_CACHE_DTYPES, mla_entry_bytes

#: TP size at which packed block sizes are computed, then scaled to the serving TP, so
#: prefill and decode instances whose TP sizes divide it can exchange blocks.
PD_REFERENCE_TP = 8

#: An H200's HBM, and the share of it assumed left for the cache by default: after the
#: TP-8 shard of a ~1T-parameter 4-bit model (~70 GB) and activations/graphs (~20 GB).
H200_MEMORY_BYTES = 141 * 10**9
DEFAULT_CACHE_FRACTION = 0.35

SPECULATIVE_METHODS = ("eagle", "eagle3", "dspark", "mtp", "deepseek_mtp", "ngram", "medusa", "draft_model", "suffix")
#: Speculative methods whose draft model keeps its own MLA pages in the packed row.
MLA_DRAFT_METHODS = ("eagle3", "dspark")

TARGET_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "gfx942", "gfx950")
#: Which indexer-logits backend can read MXFP4 keys on which architecture. The reference
#: design (DeepGEMM) reads them only on SM10x; dsacache's Triton kernels decode e2m1 to e4m3
#: in registers and need FP8 tensor-core dots (SM89+, or OCP-FP8 AMD parts).
MXFP4_READERS = {
    "triton": ("sm89", "sm90", "sm100", "sm103", "sm120", "gfx950"),
    "deepgemm": ("sm100", "sm103"),
}
INDEXER_BACKENDS = tuple(MXFP4_READERS)

#: Largest pool: byte offsets into it must fit an int64.
MAX_CACHE_MEMORY_BYTES = 2**63 - 1
#: Largest TP / PCP / DCP / reference TP size: far above any deployment, and it keeps every
#: size the plan derives from it (``lcm(reference_tp, tp)``, the block size) small.
MAX_PARALLEL_SIZE = 2**16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style ``--speculative-config``; ``draft`` holds the draft model's MLA facts, if any."""

    method: str
    num_speculative_tokens: int
    kv_cache_dtype: str | None = None
    draft: ModelSpec | None = None

    def __post_init__(self):
        _check_choice(self.method, "speculative_config.method", SPECULATIVE_METHODS)
        check_int(self.num_speculative_tokens, "speculative_config.num_speculative_tokens", 1, MAX_FIELD_VALUE)
        if self.kv_cache_dtype is not None:
            _check_choice(self.kv_cache_dtype, "speculative_config.kv_cache_dtype", KV_CACHE_DTYPES)
        if self.draft is not None and not isinstance(self.draft, ModelSpec):
            raise ConfigError(f"speculative_config.draft must be a ModelSpec or None, got {show(self.draft)}")

    @property
    def has_mla_draft(self) -> bool:
        """The draft keeps dense MLA pages in the packed row (``eagle3``/``dspark`` with an MLA draft)."""
        return self.method in MLA_DRAFT_METHODS and self.draft is not None

    @classmethod
    def from_json(cls, text_or_dict: str | Mapping[str, Any]) -> "SpeculativeConfig":
        """Parse ``{"method", "num_speculative_tokens", "kv_cache_dtype"?, "model"? | "draft_config"?}``.

        ``model`` is a path to the draft's ``config.json`` (or its directory) or a built-in
        name such as ``kimi-k3.1-dspark``; ``draft_config`` is the draft config inline.
        """
        raw = _parse_json_option(text_or_dict, "--speculative-config")
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens", "kv_cache_dtype", "model", "draft_config"})
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown keys {unknown}; allowed: method, num_speculative_tokens, "
                "kv_cache_dtype, model, draft_config"
            )
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ConfigError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        if "model" in raw and "draft_config" in raw:
            raise ConfigError("--speculative-config: give the draft as 'model' or 'draft_config', not both")
        draft = None
        if "draft_config" in raw:
            draft = _mla_draft(raw["draft_config"], "speculative_config.draft_config")
        elif "model" in raw:
            draft = _mla_draft(*_draft_source(raw["model"]))
        return cls(raw["method"], raw["num_speculative_tokens"], raw.get("kv_cache_dtype"), draft)


def _draft_source(model: Any) -> tuple[Any, str]:
    if not isinstance(model, str):
        raise ConfigError(f"speculative_config.model must be a path or a built-in name, got {model!r}")
    if model in BUILTIN_MODELS:
        return builtin_config_dict(model), model
    return load_config_dict(model)


def _mla_draft(raw: Any, name: str) -> ModelSpec | None:
    """The draft's MLA facts, or None for a draft without ``kv_lora_rank`` (no MLA pages)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: expected a JSON object")
    cfg = raw.get("text_config", raw)
    if not isinstance(cfg, Mapping) or "kv_lora_rank" not in cfg:
        return None
    return ModelSpec.from_dict(raw, name=name)


def _parse_json_option(value: str | Mapping[str, Any], option: str) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"{option}: expected a JSON object or its text, got {type(value).__name__}")
    parsed = parse_json_text(value, option)
    if not isinstance(parsed, dict):
        raise ConfigError(f"{option}: expected a JSON object, got {show(value)}")
    return parsed


def _check_choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name}={show(value)}; allowed: {', '.join(allowed)}")


def parse_attention_config(value: str | Mapping[str, Any]) -> str:
    """``--attention-config '{"indexer_kv_dtype": ...}'`` -> the requested ``indexer_kv_dtype``."""
    raw = _parse_json_option(value, "--attention-config")
    unknown = sorted(set(raw) - {"indexer_kv_dtype"})
    if unknown:
        raise ConfigError(f"--attention-config: unknown keys {unknown}; allowed: indexer_kv_dtype")
    return raw.get("indexer_kv_dtype", "auto")


@dataclass(frozen=True)
class CacheConfig:
    """A model plus serving options, validated on construction (immutable).

    Build one with :meth:`from_model` (built-in name or path) or :meth:`from_config_dict`.
    ``cache_memory_bytes`` is the per-GPU budget for the pool; by default
    ``H200_MEMORY_BYTES * DEFAULT_CACHE_FRACTION``.
    """

    model: ModelSpec
    tensor_parallel_size: int = 8
    kv_cache_dtype: str = "fp8_ds_mla"
    indexer_kv_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    target_arch: str = "sm90"
    indexer_backend: str = "triton"
    reference_tp: int = PD_REFERENCE_TP
    alignment: int = KERNEL_PAGE_SIZE
    cache_memory_bytes: int = field(default=int(H200_MEMORY_BYTES * DEFAULT_CACHE_FRACTION))
    #: Under DCP, consecutive tokens one rank stores before the next rank's turn (vLLM's name);
    #: the planner checks that it divides the block size.
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self):
        if not isinstance(self.model, ModelSpec):
            raise ConfigError(f"model must be a ModelSpec (CacheConfig.from_model takes a name or a path), "
                              f"got {type(self.model).__name__} {show(self.model)}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig or None (SpeculativeConfig.from_json "
                              f"parses one), got {type(self.speculative).__name__} {show(self.speculative)}")
        for name in ("tensor_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size",
                     "reference_tp", "cp_kv_cache_interleave_size"):
            check_int(getattr(self, name), name, 1, MAX_PARALLEL_SIZE)
        check_int(self.alignment, "alignment", 1, MAX_FIELD_VALUE)
        check_int(self.cache_memory_bytes, "cache_memory_bytes", 1, MAX_CACHE_MEMORY_BYTES, " (int64 offsets)")
        self._check_choices()
        self._check_parallelism()
        if self.alignment % KERNEL_PAGE_SIZE:
            raise ConfigError(f"alignment={self.alignment} must be a multiple of the {KERNEL_PAGE_SIZE}-token kernel page")
        self._check_indexer_dtype()
        self._check_mla_dtypes()

    def _check_mla_dtypes(self) -> None:
        """``fp8_ds_mla`` tiles the latent by 128: refuse ranks it cannot tile, for target and draft."""
        mla_entry_bytes(self.model.kv_lora_rank, self.model.qk_rope_head_dim, self.kv_cache_dtype)
        if self.speculative is not None and self.speculative.draft is not None:
            draft = self.speculative.draft
            try:
                mla_entry_bytes(draft.kv_lora_rank, draft.qk_rope_head_dim, self.draft_kv_cache_dtype)
            except ValueError as exc:
                raise ConfigError(f"speculative_config draft ({draft.name}): {exc}") from None

    def _check_choices(self) -> None:
        _check_choice(self.kv_cache_dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
        _check_choice(self.indexer_kv_dtype, "indexer_kv_dtype", INDEXER_KV_DTYPES)
        _check_choice(self.target_arch, "target_arch", TARGET_ARCHS)
        _check_choice(self.indexer_backend, "indexer_backend", INDEXER_BACKENDS)

    def _check_parallelism(self) -> None:
        tp, kda = self.tensor_parallel_size, self.model.kda
        if kda is not None and kda.num_heads % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide the {kda.num_heads} KDA heads; "
                f"allowed: {_divisors_text(kda.num_heads)}"
            )
        heads = self.model.num_attention_heads
        if heads is not None and heads % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide num_attention_heads={heads} (MLA heads are "
                "split evenly over the TP ranks); use a TP size that divides it"
            )
        if tp % self.decode_context_parallel_size:
            raise ConfigError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} must divide "
                f"tensor_parallel_size={tp}"
            )

    def _check_indexer_dtype(self) -> None:
        """MXFP4 keys: only through the fused insert, never with PCP, only where the backend reads them."""
        if self.resolved_indexer_kv_dtype != "mxfp4":
            return
        indexer = self.model.indexer
        if indexer is not None and not indexer.has_fused_key_insert:
            raise ConfigError(
                "indexer_kv_dtype='mxfp4' needs the fused key insert (index_k_norm_type='layernorm' and "
                f"index_rope_dim=0); this model has index_k_norm_type={indexer.k_norm_type!r}, "
                f"index_rope_dim={indexer.rope_dim}. Use indexer_kv_dtype='fp8'"
            )
        if indexer is not None and indexer.head_dim % MXFP4_GROUP_SIZE:
            raise ConfigError(
                f"indexer_kv_dtype='mxfp4' needs index_head_dim divisible by {MXFP4_GROUP_SIZE}, "
                f"got {indexer.head_dim}"
            )
        if self.prefill_context_parallel_size > 1:
            raise ConfigError(
                "indexer_kv_dtype='mxfp4' is refused with prefill context parallelism "
                f"(prefill_context_parallel_size={self.prefill_context_parallel_size}); use 1 or indexer_kv_dtype='fp8'"
            )
        readers = MXFP4_READERS[self.indexer_backend]
        if self.target_arch not in readers:
            raise ConfigError(
                f"indexer_kv_dtype='mxfp4': backend {self.indexer_backend!r} cannot read MXFP4 keys on "
                f"{self.target_arch}; it can on: {', '.join(readers)}"
            )

    @property
    def resolved_indexer_kv_dtype(self) -> str:
        """``"fp8"`` or ``"mxfp4"``."""
        return resolve_indexer_kv_dtype(self.indexer_kv_dtype)

    @property
    def attention_heads_per_rank(self) -> int | None:
        """MLA query heads on one TP rank (12 for K3.1 at TP 8); None when the config omits the count."""
        heads = self.model.num_attention_heads
        return None if heads is None else heads // self.tensor_parallel_size

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0 without speculative decoding); they grow the conv state."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def draft_kv_cache_dtype(self) -> str:
        """The draft's MLA cache dtype: the speculative config's if set, else the main one."""
        if self.speculative and self.speculative.kv_cache_dtype:
            return self.speculative.kv_cache_dtype
        return self.kv_cache_dtype

    @classmethod
    def from_model(cls, model: str | Path | ModelSpec, **options: Any) -> "CacheConfig":
        """From a built-in name (``kimi-k3.1``, ...), a ``config.json`` path/dir, or a ModelSpec."""
        _check_options(options)
        spec = model if isinstance(model, ModelSpec) else load_model(model)
        return cls(model=spec, **options)

    @classmethod
    def from_config_dict(cls, raw: Mapping[str, Any], name: str = "config.json", **options: Any) -> "CacheConfig":
        """From an already-parsed HF ``config.json`` dict."""
        _check_options(options)
        if not isinstance(name, str):
            raise ConfigError(f"name must be a string, got {type(name).__name__} {show(name)}")
        return cls(model=ModelSpec.from_dict(raw, name=name), **options)


def _check_options(options: Mapping[str, Any]) -> None:
    """Serving options are :class:`CacheConfig` fields (other than ``model``)."""
    allowed = [f.name for f in fields(CacheConfig) if f.name != "model"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown CacheConfig options {unknown}; allowed: {', '.join(allowed)}")


def _divisors_text(n: int) -> str:
    """The TP sizes that divide ``n``: its divisors up to ``MAX_PARALLEL_SIZE`` (bounded work for any ``n``)."""
    allowed = ", ".join(str(d) for d in range(1, min(n, MAX_PARALLEL_SIZE) + 1) if n % d == 0)
    return allowed if n <= MAX_PARALLEL_SIZE else f"{allowed} (the divisors up to MAX_PARALLEL_SIZE={MAX_PARALLEL_SIZE})"
