"""Which columns of a logits row are ranked, and which rows take the sampled cut-off.

Every kernel clamps the row lengths and starts itself (int32 or int64, any value), so a
launch needs no extra kernel to clamp them first.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS: tl.constexpr):
    """(start, n) of a row, clamped to it: ``0 <= start <= width``, ``0 <= n <= width - start``
    (lengths and starts may be int32 or int64)."""
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row), 0), width).to(tl.int32)
    else:
        start = row * 0  # an int32 0 (program ids are int32), written so that Gluon compiles it too
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + row), 0), width - start).to(tl.int32)
    return start, n


@triton.jit
def row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS: tl.constexpr):
    """(n, pointer to the row's first valid column)."""
    start, n = row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    return n, logits_ptr + row.to(tl.int64) * row_stride + start


@triton.jit
def long_row(n, K: tl.constexpr, SAMPLES: tl.constexpr):
    """Rows that go through the sampled cut-off (the rest are selected directly)."""
    return n > tl.maximum(K, 2 * SAMPLES)
