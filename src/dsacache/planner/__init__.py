"""Plan the packed DSA cache from a model config and serving options (pure Python, no torch)."""

from dsacache.config.model import ConfigError, ModelSpec, load_model
from dsacache.config.serving import PD_REFERENCE_TP, CacheConfig, SpeculativeConfig
from dsacache.planner.accounting import StateShape
from dsacache.planner.layout import AttentionSlot, CacheLayout, DraftSlot, StateSlot, plan

__all__ = [
    "AttentionSlot", "CacheConfig", "CacheLayout", "ConfigError", "DraftSlot", "ModelSpec",
    "PD_REFERENCE_TP", "SpeculativeConfig", "StateShape", "StateSlot", "load_model", "plan",
]
