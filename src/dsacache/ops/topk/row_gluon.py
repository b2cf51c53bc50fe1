"""Top-k on Hopper in one launch: one program of W warps takes a long row through all three steps.

The Triton path runs the steps as three kernels (``cutoff.py``, ``filter.py``,
``select_triton.py``), each waiting for the whole grid before it. Here a row's program runs
the same steps with a CTA barrier between them, which is faster for rows up to 32K
(``docs/benchmarks.md``, "Top-k 2048"):

1. the cut-off: SAMPLES keys in evenly spaced runs of SAMPLE_RUN, narrowed by radix passes of
   SAMPLE_BITS until the chosen bin is taken whole or holds few samples (as ``cutoff.py``);
2. the filter: warp w scans slice w of the row (``filter.filter_slice`` with PROGS = W) with
   the filter's tile PTX (``filter.filter_tile_ptx``): candidates at or above the cut-off, in
   position order, into segment w, and counted into the row's histogram;
3. the select: ``select_gluon.ballot_select`` over the W segments.

It takes logits up to ``TopkConfig.row_max_len`` wide (``launch.py``): a longer row is
streamed faster by the Triton filter's many one-warp programs spread over the SMs.
The first filter tile is loaded before the samples are narrowed, so its latency hides behind
that. Every output of steps 1 and 2 (cut-off, shift, histogram, segments, counts) is written
where and as the Triton kernels write it, so a row this kernel leaves (``done = 0``: a short
row, a missed cut-off, a skewed row, a chosen bin with more than TIES candidates) is
finished by ``select_triton.topk_select_kernel`` with ``SKIP_DONE``, launched after it.
Rows must be 16-byte aligned (the tile PTX loads 4 logits at once).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsacache.ops.topk.cutoff import bit_length, float_cut
from dsacache.ops.topk.keys import key_to_float, sortable_key
from dsacache.ops.topk.select_gluon import _gdc_launch_dependents, _histogram_cut, _long_row, _row_window, \
    ballot_select


# The Triton path's scalar and elementwise rules, compiled by Gluon (they need no layout): one
# definition of the key order and of the cut-off's rounding for both paths.
_sortable_key = gluon.jit(sortable_key.fn)
_key_to_float = gluon.jit(key_to_float.fn)
_bit_length = gluon.jit(bit_length.fn)
_float_cut = gluon.jit(float_cut.fn)


@gluon.jit
def _narrow_samples(keys, need, slack, BITS: gl.constexpr, layout: gl.constexpr):
    """The prefix (lower bits 0) of a bin holding the ``need``-th largest sample, taken whole
    or holding at most ``slack`` samples: ``radix.radix_narrow`` over all the samples."""
    BINS: gl.constexpr = 1 << BITS
    PASSES: gl.constexpr = 32 // BITS
    size: gl.constexpr = keys.shape[0]
    prefix = gl.max(keys, axis=0) & 0
    top = gl.full([], 32, gl.int32)
    whole = (need == size) | (size <= slack)
    done = whole
    for _ in range(PASSES):  # a runtime loop: one copy of the pass in the code
        if not done:
            shift = gl.maximum(top - BITS, 0)
            high = ((0xFFFFFFFF << top.to(gl.int64)) & 0xFFFFFFFF).to(gl.uint32)
            match = ((keys ^ prefix) & high) == 0
            digit = ((keys >> shift.to(gl.uint32)) & (BINS - 1)).to(gl.int32)
            hist = gl.histogram(digit, BINS, mask=match, layout=layout)
            chosen, need, in_bin = _histogram_cut(hist, need, layout)
            prefix = prefix | (chosen.to(gl.uint32) << shift.to(gl.uint32))
            top = shift
            whole = (need == in_bin) | (in_bin <= slack)
            done = whole | (top == 0)
    return prefix


@gluon.jit
def _cutoff(row_ptr, start, n, K: gl.constexpr, SAMPLES: gl.constexpr, SAMPLE_RUN: gl.constexpr,
            SAMPLE_BITS: gl.constexpr, BINS: gl.constexpr):
    """Step 1: (cut-off key lowered for the float test, histogram shift) of the row's window."""
    W: gl.constexpr = gl.num_warps()
    SL: gl.constexpr = gl.BlockedLayout([SAMPLES // (32 * W)], [32], [W], [0])
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    RUNS: gl.constexpr = SAMPLES // SAMPLE_RUN
    lanes = gl.arange(0, SAMPLES, layout=SL)
    keys = _sortable_key(gl.load(row_ptr + start + (lanes // SAMPLE_RUN) * (n // RUNS) + lanes % SAMPLE_RUN))
    expected = (K * SAMPLES + n - 1) // n
    target = gl.minimum(expected + 4 * gl.sqrt(expected.to(gl.float32)).to(gl.int32) + 8, SAMPLES)
    cut = _narrow_samples(keys, target, target // 8 + 1, SAMPLE_BITS, RL)
    # Bins as wide as needed for the sampled maximum to land in the lower half.
    log_bins = _bit_length(gl.full([], BINS, gl.uint32)) - 1
    shift = gl.maximum(_bit_length(gl.max(keys, axis=0) - cut) - (log_bins - 1), 0)
    return _float_cut(cut), shift


@gluon.jit
def _filter(row_ptr, x, col, start, hi, limit, tiles, cut, shift, seg, hist_row, TILE_PTX: gl.constexpr,
            TILE_REGS: gl.constexpr, V: gl.constexpr, SEG: gl.constexpr, BINS: gl.constexpr, AHEAD: gl.constexpr):
    """Step 2: each warp's candidates of its slice (up to ``hi``, ``tiles`` tiles) into its
    segment ``seg``; ``x`` is the first tile (columns ``col``), already loaded; ``limit``
    bounds the loads. Returns the candidates a warp found ([W], may exceed SEG)."""
    W: gl.constexpr = gl.num_warps()
    TILE: gl.constexpr = 32 * V
    FL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    zero = gl.zeros([W, TILE], gl.int32, FL)
    span = zero + (hi - start)[:, None]
    cut_f = zero + _key_to_float(cut).to(gl.int32, bitcast=True)
    cut_k = zero + cut.to(gl.int32, bitcast=True)
    shift_b = zero + shift
    seg_b = zero.to(gl.int64) + seg.to(gl.int64, bitcast=True)[:, None]
    hist_b = zero.to(gl.int64) + hist_row.to(gl.int64, bitcast=True)
    cap = zero + SEG
    last = zero + (BINS - 1)
    counts = zero
    if AHEAD == 2:
        x_ahead = gl.load(row_ptr + col + TILE, mask=col + TILE < limit, other=0.0)
    for _ in range(tiles):
        nxt = col + TILE
        if AHEAD == 2:
            x_next = x_ahead
            x_ahead = gl.load(row_ptr + nxt + TILE, mask=nxt + TILE < limit, other=0.0)
        else:
            x_next = gl.load(row_ptr + nxt, mask=nxt < limit, other=0.0)
        counts = gl.inline_asm_elementwise(
            TILE_PTX, TILE_REGS,
            [x.to(gl.int32, bitcast=True), col - start, counts, cut_f, span, cut_k, shift_b, seg_b, hist_b, cap, last],
            dtype=gl.int32, is_pure=False, pack=V)
        col = nxt
        x = x_next
    return gl.max(counts, axis=1)


@gluon.jit
def topk_row_kernel(
    logits_ptr,       # [R, row_stride] fp32, rows 16-byte aligned
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 out: the cut-off key of each long row
    shift_ptr,        # [R] int32 out: log2 of the candidate histogram's bin width
    hist_ptr,         # [R, BINS] int32 out: candidates a bin
    seg_ptr,          # [R, W, SEG] int64 out: pos << 32 | key of each warp's candidates, in order
    counts_ptr,       # [R, W] int32 out: candidates found by each warp (may exceed SEG)
    tie_keys_ptr,     # [R, stride_tie] int32 scratch: the chosen bin's candidates
    tie_pos_ptr,      # [R, stride_tie] int32 scratch
    done_ptr,         # [R] int32 out: 1 where this kernel selected the row
    row_stride, width, stride_tie,
    K: gl.constexpr, SAMPLES: gl.constexpr, SAMPLE_RUN: gl.constexpr, SAMPLE_BITS: gl.constexpr,
    SEG: gl.constexpr, LOAD: gl.constexpr, CAP: gl.constexpr, BINS: gl.constexpr, TIES: gl.constexpr,
    V: gl.constexpr, TILE_PTX: gl.constexpr, TILE_REGS: gl.constexpr, AHEAD: gl.constexpr,
    HAS_STARTS: gl.constexpr, PDL: gl.constexpr,
):
    W: gl.constexpr = gl.num_warps()
    TILE: gl.constexpr = 32 * V
    FL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])  # tile PTX: runs of 4, a warp a slice
    HL: gl.constexpr = gl.BlockedLayout([BINS // (32 * W)], [32], [W], [0])
    row = gl.program_id(0)
    if PDL:
        _gdc_launch_dependents()  # the Triton select (rows left to it) waits for this grid anyway
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    taken = n * 0
    if _long_row(n, K, SAMPLES):
        row_ptr = logits_ptr + row.to(gl.int64) * (row_stride // 4 * 4)
        # The filter's slices (filter.filter_slice): whole tiles, tile-aligned, W of them.
        end = start + n
        first = gl.multiple_of((start // TILE) * TILE, TILE)
        chunk = gl.multiple_of(gl.cdiv(gl.cdiv(end - first, W), TILE) * TILE, TILE)
        warp = gl.arange(0, W, layout=gl.SliceLayout(1, FL))
        lo = first + warp * chunk
        hi = gl.minimum(lo + chunk, end)
        limit = (gl.cdiv(hi, 4) * 4)[:, None]
        col = lo[:, None] + gl.arange(0, TILE, layout=gl.SliceLayout(0, FL))[None, :]
        x = gl.load(row_ptr + col, mask=col < limit, other=0.0)  # in flight while the cut-off is found

        hist_row = hist_ptr + row.to(gl.int64) * BINS
        gl.store(hist_row + gl.arange(0, BINS, layout=HL), gl.zeros([BINS], gl.int32, HL))
        cut, shift = _cutoff(row_ptr, start, n, K, SAMPLES, SAMPLE_RUN, SAMPLE_BITS, BINS)
        gl.store(cut_ptr + row, cut.to(gl.int32, bitcast=True))
        gl.store(shift_ptr + row, shift)
        gl.thread_barrier()  # the zeroed histogram before any warp counts into it

        seg_row = seg_ptr + row.to(gl.int64) * (W * SEG)
        count = _filter(row_ptr, x, col, start, hi, limit, chunk // TILE, cut, shift, seg_row + warp * SEG, hist_row,
                        TILE_PTX, TILE_REGS, V, SEG, BINS, AHEAD)
        gl.store(counts_ptr + row * W + warp, count)
        gl.thread_barrier()  # every warp's candidates, counts and histogram counts before the select

        fast = ballot_select(n, cut, shift, hist_row, seg_row, counts_ptr + row * W,
                             tie_keys_ptr + row.to(gl.int64) * stride_tie, tie_pos_ptr + row.to(gl.int64) * stride_tie,
                             out_ptr + row.to(gl.int64) * K, K, W, SEG, LOAD, CAP, BINS, TIES)
        taken = fast.to(gl.int32)
    gl.store(done_ptr + row, taken)
