"""Step 1 of a long row: a cut-off key from evenly spaced samples.

One program a row narrows ``SAMPLES`` keys (runs of ``SAMPLE_RUN`` adjacent logits, evenly
spaced, so each run is one memory sector) by radix passes, no sort, until the chosen bin
holds only a few samples: most likely a little over k of the row's keys lie at or above
that cut-off. It also picks the candidate histogram's bin width and zeroes the histogram
the filter fills, and the cursor of the row's candidate pool (``filter.pool_layout``). Shorter
rows (``not long_row``) are left to the select.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.topk.filter import pool_cursor
from dsacache.ops.topk.keys import sortable_key
from dsacache.ops.topk.radix import radix_narrow
from dsacache.ops.topk.rows import long_row, row_setup
from dsacache.ops.triton_utils import INTERPRET

if not INTERPRET:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def topk_cutoff_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 out: the cut-off key (uint32 bits) of each long row
    shift_ptr,        # [R] int32 out: log2 of the candidate histogram's bin width
    hist_ptr,         # [R, BINS] int32 out: zeroed for topk_filter_kernel
    pool_ptr,         # [R, POOL_ROW] int32 out: each row's pool cursor, zeroed for the filter
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, SAMPLES: tl.constexpr, SAMPLE_RUN: tl.constexpr, BINS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
    SAMPLE_BITS: tl.constexpr = 8, PDL: tl.constexpr = False,
    ZERO_HIST: tl.constexpr = True,  # False: the filter does not count (the Hopper ballot select does)
    POOL: tl.constexpr = 0, POOL_ROW: tl.constexpr = 0,  # the filter's pool (filter.pool_layout; 0: none)
    TILE: tl.constexpr = 1,  # the filter's tile (its pool's block)
):
    """One program a row: a cut-off key with, most likely, a little over K of the row's keys
    at or above it (from SAMPLES keys in evenly spaced runs). With PDL it waits for the kernel
    before it, then lets the next kernel launch (which waits for this one before using its outputs)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    n, row_ptr = row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    if long_row(n, K, SAMPLES):
        if ZERO_HIST:
            tl.store(hist_ptr + row.to(tl.int64) * BINS + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
        lanes = tl.arange(0, SAMPLES)
        runs: tl.constexpr = SAMPLES // SAMPLE_RUN
        idx = (lanes // SAMPLE_RUN) * (n // runs) + lanes % SAMPLE_RUN
        keys = sortable_key(tl.load(row_ptr + idx))
        expected = (K * SAMPLES + n - 1) // n
        target = expected + 4 * tl.sqrt(expected.to(tl.float32)).to(tl.int32) + 8
        target = tl.minimum(target, SAMPLES)
        cut, _, _ = radix_narrow(keys, lanes < SAMPLES, SAMPLES, target, tl.zeros([], tl.uint32),
                                 tl.full([], 32, tl.int32), target // 8 + 1, SAMPLE_BITS, 32 // SAMPLE_BITS)
        # Bins as wide as needed for the sampled maximum to land in the lower half.
        log_bins = bit_length(tl.full([], BINS, tl.uint32)) - 1
        shift = tl.maximum(bit_length(tl.max(keys, axis=0) - cut) - (log_bins - 1), 0)
        tl.store(cut_ptr + row, float_cut(cut).to(tl.int32, bitcast=True))
        tl.store(shift_ptr + row, shift)
        if POOL > 0:
            tl.store(pool_ptr + row.to(tl.int64) * POOL_ROW + pool_cursor(POOL, TILE), 0)


@triton.jit
def bit_length(x):
    """Bits needed for the uint32 scalar x (0 for 0); may be one too many, never too few."""
    exponent = (x.to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32)
    return tl.maximum(exponent - 126, 0)


@triton.jit
def float_cut(cut):
    """The cut-off key lowered, where needed, so that ``key(x) >= cut`` is ``x >= float(cut)``:
    +0.0 -> -0.0 and NaN (key 0) -> -inf. Lowering a cut-off only adds candidates."""
    cut = tl.where(cut == 0x80000000, 0x7FFFFFFF, cut)
    return tl.where(cut == 0, 0x007FFFFF, cut).to(tl.uint32)
