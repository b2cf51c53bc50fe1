"""dsacache: the packed DSA cache for hybrid sparse-attention LLMs.

The top level exports the planner only, so ``import dsacache`` needs no torch. The
runtime (``dsacache.runtime``) and the kernels (``dsacache.ops``) import torch.
"""

from dsacache.planner import (
    PD_REFERENCE_TP,
    AttentionSlot,
    CacheConfig,
    CacheLayout,
    ConfigError,
    DraftSlot,
    ModelSpec,
    SpeculativeConfig,
    StateShape,
    StateSlot,
    load_model,
    plan,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionSlot", "CacheConfig", "CacheLayout", "ConfigError", "DraftSlot", "ModelSpec",
    "PD_REFERENCE_TP", "SpeculativeConfig", "StateShape", "StateSlot", "load_model", "plan",
]
