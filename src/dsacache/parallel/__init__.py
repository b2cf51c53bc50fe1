"""Decode context parallelism (DCP) for DSA layers: one layer's decode step spread over the ranks
of a ``torch.distributed`` group, each storing its share of every request's tokens.

``dcp_step.py``: :class:`DcpDsaDecodeStep`, the step (buffers, collectives, their byte counts);
``topk_merge.py``: the exact global top-k from the ranks' local top-k; ``lse_merge.py``: the
partial attention outputs merged by their log-sum-exp. The merges are pure tensor functions
(no collective), so they run and are tested on one device too.
"""

from dsacache.parallel.dcp_step import LSE_MERGES, DcpDsaDecodeStep, check_group, collective_bytes, gather_into
from dsacache.parallel.lse_merge import merge_partials, merged_lse, partial_weights, weighted_partial
from dsacache.parallel.topk_merge import EMPTY, merge_topk, owned_local_positions, pack_candidates, unpack_positions

__all__ = [
    "EMPTY", "LSE_MERGES", "DcpDsaDecodeStep", "check_group", "collective_bytes", "gather_into", "merge_partials", "merge_topk", "merged_lse",
    "owned_local_positions", "pack_candidates", "partial_weights", "unpack_positions", "weighted_partial",
]
