"""Top-k selection over indexer logits, and request positions -> cache slots.

``topk_indices`` keeps the ``k`` best positions of each row (exact set, deterministic
ties); ``positions_to_slots`` maps them through the block table for the sparse
attention kernel.

Files: ``api.py`` the public functions (argument checks, Triton or PyTorch);
``naive.py`` the PyTorch reference; ``launch.py`` which kernels run with which settings
(the algorithm's outline is there). Kernels, by what they compute: ``cutoff.py`` (a
cut-off key from samples), ``filter.py`` (the candidates at or above it),
``select_triton.py`` (the exact top k from them), ``select_gluon.py`` (the same on
Hopper, in Gluon) and ``row_gluon.py`` (all three steps in one Hopper launch, a program a
row), ``slots.py`` (positions -> slots); their shared pieces ``keys.py`` (the
fp32 -> sortable key order), ``rows.py`` (a row's ranked window) and ``radix.py`` (radix
select).
"""

from dsacache.ops.topk.api import DEFAULT_TOPK, MAX_TOPK, positions_to_slots, topk_indices

__all__ = ["DEFAULT_TOPK", "MAX_TOPK", "positions_to_slots", "topk_indices"]
