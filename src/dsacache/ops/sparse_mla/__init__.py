"""Sparse MLA decode: absorbed queries attend over their top-k selected cache slots of one layer.

``sparse_mla_decode`` returns ``(out, lse)`` (natural-log LSE, for decode context parallelism)
and reads the layer's MLA pages in place: ``fp8_ds_mla`` (656 B at 512 + 64, 528 B at 512 + 0),
``bfloat16`` and ``fp8`` entries, any page stride. Prefill uses it with one row a token.

Files: ``api.py`` the public function; ``naive.py`` the PyTorch reference; ``launch.py`` picks
the kernel and its settings (head block, slot step, warps, stages, split count) and launches;
``sparse_attention.py`` the Triton kernel (one query row, one head block, one split of its
slots); ``decode_gluon.py`` the warp-specialized Hopper kernel for 656-B entries and 33-128
heads (same grid), ``decode_gluon16.py`` its counterpart for up to 16 heads (the slots as the
wgmma M); ``merge_splits.py`` the Triton kernel that merges split partial outputs by LSE.
"""

from dsacache.ops.sparse_mla.api import sparse_mla_decode

__all__ = ["sparse_mla_decode"]
