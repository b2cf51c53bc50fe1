"""The order top-k ranks by, on the Triton side: each fp32 logit as an unsigned key.

The key is the float's bit pattern mapped so that unsigned order is float order
(``-inf < ... < -0.0 < +0.0 < ... < +inf``), with NaN as 0, below ``-inf``: the order
``naive.sortable_keys`` gives the PyTorch reference.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sortable_key(x):
    """fp32 -> uint32 key with the float's order; NaN -> 0."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, 0, key)


@triton.jit
def sortable_key_not_nan(x):
    """sortable_key for an x known not to be NaN."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) | (-0x80000000))).to(tl.uint32, bitcast=True)


@triton.jit
def key_to_float(key):
    """Inverse of sortable_key (key 0 -> a NaN, which no comparison passes)."""
    bits = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)
