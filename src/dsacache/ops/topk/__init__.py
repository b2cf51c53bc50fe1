"""Top-k selection over indexer logits, and request positions -> cache slots.

``topk_indices`` keeps the ``k`` best positions of each row (exact set, deterministic
ties); ``positions_to_slots`` maps them through the block table for the sparse
attention kernel. ``naive.py`` is the PyTorch reference; ``triton_kernels.py`` the kernels.
"""

from dsacache.ops.topk.api import DEFAULT_TOPK, MAX_TOPK, positions_to_slots, topk_indices

__all__ = ["DEFAULT_TOPK", "MAX_TOPK", "positions_to_slots", "topk_indices"]
