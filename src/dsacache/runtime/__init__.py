"""The runtime cache: one pool, per-layer paged views, a row allocator, per-step metadata.

Pipeline: a planned ``CacheLayout`` -> :class:`CachePool` (the bytes and typed views) and
:class:`RowAllocator` (which request owns which rows) -> per scheduler step, the
kernel-page block table, :func:`compute_slot_mapping`, :func:`build_indexer_metadata` and
:func:`build_kda_metadata`, built once and read by every layer.
"""

from dsacache.runtime.allocator import OutOfRowsError, PrefixStats, RowAllocator
from dsacache.runtime.block_table import build_block_table, kernel_pages
from dsacache.runtime.dcp import DcpSettings
from dsacache.runtime.kda_metadata import KdaStepMetadata, build_kda_metadata
from dsacache.runtime.metadata import (
    IndexerStepMetadata,
    PrefillChunk,
    build_indexer_metadata,
    decode_context_lens,
    plan_prefill_chunks,
)
from dsacache.runtime.pool import CachePool
from dsacache.runtime.prefix import PrefixCache, hash_block
from dsacache.runtime.slot_mapping import compute_slot_mapping

__all__ = [
    "CachePool", "DcpSettings", "IndexerStepMetadata", "KdaStepMetadata", "OutOfRowsError", "PrefillChunk", "PrefixCache", "PrefixStats",
    "RowAllocator", "build_block_table", "build_indexer_metadata", "build_kda_metadata",
    "compute_slot_mapping", "decode_context_lens",
    "hash_block", "kernel_pages", "plan_prefill_chunks",
]
