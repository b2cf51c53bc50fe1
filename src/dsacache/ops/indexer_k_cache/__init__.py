"""Indexer key cache write path: quantize + store (plain and fused LayerNorm), gather, dequantize.

* ``api.py``: the public functions exported here (validation, docstrings, Triton or PyTorch).
* ``naive.py``: the PyTorch reference (also the CPU path).
* ``launch.py``: which Triton kernel runs and with what launch shape; every tuning knob.
* Kernels: ``store_fp8.py`` (FP8 store), ``store_mxfp4.py`` (MXFP4 store, one tile of tokens a
  program), ``store_mxfp4_loop.py`` (fused LayerNorm + MXFP4 store of large bf16 batches, a tile
  loop with the LayerNorm moments on the tensor cores), ``gather.py``, ``dequantize.py``;
  ``codecs.py`` holds the Triton pieces the stores share (scale arithmetic, e4m3/e2m1 encoding, the
  LayerNorm statistics' rules).
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
