"""Indexer key cache write path: quantize + store (plain and fused LayerNorm), gather, dequantize.

``naive.py`` is the PyTorch reference (also the CPU path), ``triton_kernels.py`` the
Triton kernels, ``api.py`` the public functions exported here.
"""

from dsacache.ops.indexer_k_cache.api import (
    dequantize_indexer_keys,
    fused_norm_store_indexer_keys,
    gather_indexer_keys,
    store_indexer_keys,
)

__all__ = [
    "dequantize_indexer_keys",
    "fused_norm_store_indexer_keys",
    "gather_indexer_keys",
    "store_indexer_keys",
]
