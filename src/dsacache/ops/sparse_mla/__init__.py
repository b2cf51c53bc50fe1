"""Sparse MLA decode over the top-k selected cache slots (PyTorch reference path only, for now)."""

from dsacache.ops.sparse_mla.api import sparse_mla_decode

__all__ = ["sparse_mla_decode"]
