"""Byte accounting of ``docs/planning.md`` (per token, per layer, per TP rank). Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsacache.config.model import check_int
from dsacache.config.serving import CacheConfig, ConfigError
from dsacache.formats.key_format import indexer_entry_bytes
from dsacache.formats.sizes import mla_entry_bytes

CONV_STATE_ITEMSIZE = 2  # bf16
RECURRENT_STATE_ITEMSIZE = 4  # fp32


@dataclass(frozen=True)
class StateShape:
    """One KDA layer's state on one TP rank: conv state first, then the recurrent state."""

    conv_shape: tuple[int, int]  # (conv_kernel - 1 + num_speculative_tokens, 3 * heads * head_dim / tp), bf16
    recurrent_shape: tuple[int, int, int]  # (heads / tp, head_dim, head_dim), fp32

    @property
    def conv_bytes(self) -> int:
        """Bytes of the bf16 conv state."""
        return math.prod(self.conv_shape) * CONV_STATE_ITEMSIZE

    @property
    def recurrent_bytes(self) -> int:
        """Bytes of the fp32 recurrent state."""
        return math.prod(self.recurrent_shape) * RECURRENT_STATE_ITEMSIZE

    @property
    def recurrent_offset(self) -> int:
        """Byte offset of the recurrent state inside one state."""
        return self.conv_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of one state (``state_bytes``)."""
        return self.conv_bytes + self.recurrent_bytes


def check_config(config: CacheConfig) -> None:
    """Refuse anything but a :class:`CacheConfig` with a ConfigError naming the argument."""
    if not isinstance(config, CacheConfig):
        raise ConfigError(f"config must be a CacheConfig (CacheConfig.from_model builds one), "
                          f"got {type(config).__name__}")


def mla_bytes_per_token(config: CacheConfig) -> int:
    """One layer's MLA latent entry in the main ``kv_cache_dtype``."""
    check_config(config)
    model = config.model
    return mla_entry_bytes(model.kv_lora_rank, model.qk_rope_head_dim, config.kv_cache_dtype)


def index_bytes_per_token(config: CacheConfig) -> int:
    """One layer's indexer key entry (0 for a model without an indexer)."""
    check_config(config)
    indexer = config.model.indexer
    if indexer is None:
        return 0
    return indexer_entry_bytes(indexer.head_dim, config.resolved_indexer_kv_dtype)


def draft_entry_bytes(config: CacheConfig) -> int:
    """One draft layer's MLA entry, or 0 when the draft keeps no MLA pages in the row."""
    check_config(config)
    spec = config.speculative
    if spec is None or not spec.has_mla_draft:
        return 0
    return mla_entry_bytes(spec.draft.kv_lora_rank, spec.draft.qk_rope_head_dim, config.draft_kv_cache_dtype)


def num_draft_layers(config: CacheConfig) -> int:
    """Dense MLA draft layers that keep pages in the row (0 if none)."""
    return config.speculative.draft.num_hidden_layers if draft_entry_bytes(config) else 0


def draft_bytes_per_token(config: CacheConfig) -> int:
    """All dense MLA draft layers' bytes per token (``eagle3``/``dspark`` with an MLA draft only)."""
    return num_draft_layers(config) * draft_entry_bytes(config)


def row_bytes_per_token(config: CacheConfig) -> int:
    """``D x (mla + index) + draft``: every attention layer's bytes for one token."""
    per_layer = mla_bytes_per_token(config) + index_bytes_per_token(config)
    return len(config.model.attention_layers) * per_layer + draft_bytes_per_token(config)


def kda_state_shape(config: CacheConfig, tp: int | None = None) -> StateShape | None:
    """Per-layer, per-rank KDA state at ``tp`` (default: the serving TP); None without KDA."""
    check_config(config)
    kda = config.model.kda
    if kda is None:
        return None
    tp = config.tensor_parallel_size if tp is None else check_int(tp, "tp", 1)
    if kda.num_heads % tp:
        raise ConfigError(f"tp={tp} does not divide the {kda.num_heads} KDA heads")
    conv_rows = kda.conv_kernel_size - 1 + config.num_speculative_tokens
    conv_dim = 3 * kda.num_heads * kda.head_dim // tp
    return StateShape((conv_rows, conv_dim), (kda.num_heads // tp, kda.head_dim, kda.head_dim))


def state_bytes(config: CacheConfig, tp: int | None = None) -> int:
    """One KDA layer's state bytes per TP rank at ``tp`` (0 without KDA)."""
    shape = kda_state_shape(config, tp)
    return shape.nbytes if shape else 0


def states_per_row(num_dsa_layers: int, num_kda_layers: int) -> int:
    """``ceil(S / ceil(S / D))``: balanced groups of at most D states in a row."""
    check_int(num_dsa_layers, "num_dsa_layers", 1)
    check_int(num_kda_layers, "num_kda_layers", 0)
    groups = math.ceil(num_kda_layers / num_dsa_layers)
    return math.ceil(num_kda_layers / groups)
