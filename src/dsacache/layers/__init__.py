"""One layer's cache work for one scheduler step, composed of the ops (no weights, no projections).

``dsa.py``: a DSA layer's decode step on the packed pool (key and latent stores, indexer
logits, top-k, positions to slots, sparse MLA), for one layer or every DSA layer of a rank.
"""

from dsacache.layers.dsa import DsaDecodeInputs, DsaDecodeStep

__all__ = ["DsaDecodeInputs", "DsaDecodeStep"]
