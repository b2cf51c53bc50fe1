"""Indexer logits: score every cached key of a request with the lightning indexer.

``paged_decode_logits`` reads a layer's paged keys through the block table (decode,
``next_n`` speculative rows a request); ``ragged_prefill_logits`` reads keys already
gathered contiguously (prefill, a window of keys a query row). ``naive.py`` is the
PyTorch reference; ``triton_kernels.py`` holds the kernels.
"""

from dsacache.ops.indexer_logits.api import (
    paged_decode_logits,
    per_row_context_lens,
    prefill_row_chunks,
    ragged_prefill_logits,
)

__all__ = ["paged_decode_logits", "per_row_context_lens", "prefill_row_chunks", "ragged_prefill_logits"]
