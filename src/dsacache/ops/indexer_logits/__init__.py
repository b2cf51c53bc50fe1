"""Indexer logits: score every cached key of a request with the lightning indexer.

``paged_decode_logits`` reads a layer's paged keys through the block table (decode,
``next_n`` speculative rows a request); ``ragged_prefill_logits`` reads keys already
gathered contiguously (prefill, a window of keys a query row).

Files: ``api.py`` the public functions; ``naive.py`` the PyTorch reference; ``launch.py``
picks the kernel and its settings; ``decode_triton.py``, ``prefill_triton.py`` and
``decode_gluon.py`` (Hopper) the kernels, ``tiles_triton.py`` what the two Triton kernels
share, ``mxfp4_e4m3.py`` the MXFP4 -> e4m3 decode every kernel shares.
"""

from dsacache.ops.indexer_logits.api import (
    paged_decode_logits,
    per_row_context_lens,
    prefill_row_chunks,
    ragged_prefill_logits,
)

__all__ = ["paged_decode_logits", "per_row_context_lens", "prefill_row_chunks", "ragged_prefill_logits"]
