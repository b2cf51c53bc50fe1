"""Pieces every top-k algorithm shares (see ``triton_kernels`` for the algorithms).

Top-k works on keys: each fp32 logit becomes an unsigned key that sorts like the float
(NaN -> 0, below ``-inf``). Exact selection is a radix select: passes over the keys
build a 16-bin histogram of one 4-bit digit (most significant first) among the keys that
match the digits fixed so far, until the k-th largest key is known (or a whole bin is
taken). A last pass writes the positions with a larger key, then the first ``need``
positions whose key equals it (ties to the lower position), in ascending position order
through a running prefix sum. Deterministic by construction.

Here: the key maps, that radix select and its in-order writes (over a whole row, or over
candidates gathered into a buffer), the in-register radix narrowing and histogram cut used
on candidates, and ``_topk_cutoff_kernel``, step 1 of v2 and v3: one program a row finds a
cut-off key from ``SAMPLES`` keys (runs of ``SAMPLE_RUN`` adjacent logits, evenly spaced, so
each run is one memory sector) by radix narrowing that stops once the chosen bin holds only
a few samples, and zeroes the row's candidate histogram. Every kernel clamps the row lengths
and starts itself (int32 or int64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.ops.triton_utils import INTERPRET, loop_bound

if not INTERPRET:
    from triton.language.extra.cuda import gdc_launch_dependents


#: Inline PTX is used where it exists (CUDA, compiled); elsewhere the plain Triton ops.
PTX_AVAILABLE = not INTERPRET and torch.version.hip is None
#: Default candidate buffer length, in multiples of k.
CANDIDATES_PER_K = 4
#: Digit of the radix passes over candidates and whole rows.
RADIX_BITS = 4


@triton.jit
def _sortable_key(x):
    """fp32 -> uint32 key with the float's order; NaN -> 0."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, tl.zeros_like(key), key)


@triton.jit
def _key_to_float(key):
    """Inverse of _sortable_key (key 0 -> a NaN, which no comparison passes)."""
    bits = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _keys_at(src, idx, valid, FROM_LOGITS: tl.constexpr):
    """int64 keys of src[idx]: fp32 logits converted, or uint32 keys stored as int32."""
    if FROM_LOGITS:
        key = _sortable_key(tl.load(src + idx, mask=valid, other=0.0))
    else:
        key = tl.load(src + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
    return key.to(tl.int64)


@triton.jit
def _radix_select(src, n, need, FROM_LOGITS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """(cut, ties): the top ``need`` of keys src[:n] are those ``> cut`` plus the first
    ``ties`` equal to ``cut``. ``cut`` is int64 (-1 takes everything)."""
    BINS: tl.constexpr = 1 << BITS
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)
    num_blocks = tl.cdiv(n, BLOCK)
    done = need == 0
    prefix = tl.where(done, tl.full([], 1 << 32, tl.int64), tl.zeros([], tl.int64))
    for p in range(32 // BITS):  # a runtime loop: one copy of the pass in the code (instruction cache)
        shift = 32 - BITS * (p + 1)
        hist = tl.zeros([BINS], tl.int32)
        for c in tl.range(0, loop_bound(tl.where(done, 0, num_blocks)), num_stages=3):
            idx = c * BLOCK + lanes
            valid = idx < n
            key = _keys_at(src, idx, valid, FROM_LOGITS)
            # the digits above this pass's match the prefix (none above the first pass's)
            valid = valid & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
            hist += tl.histogram(((key >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=valid)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        chosen = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
        in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
        left = need - (tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin)
        finished = (not done) & (left == in_bin)
        need = tl.where(done, need, left)
        prefix = tl.where(done, prefix, prefix | (chosen.to(tl.int64) << shift))
        done = done | finished
    # A bin taken whole: every key >= prefix, no ties to break.
    cut = tl.where(done, prefix - 1, prefix)
    return cut, tl.where(done, 0, need)


@triton.jit
def _collect(src, pos_src, n, cut, ties_wanted, out_row, FROM_LOGITS: tl.constexpr, BLOCK: tl.constexpr):
    """Write the positions of keys src[:n] above ``cut`` and the first ``ties_wanted`` equal to it."""
    lanes = tl.arange(0, BLOCK)
    written = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c in tl.range(0, loop_bound(tl.cdiv(n, BLOCK)), num_stages=3):
        idx = c * BLOCK + lanes
        valid = idx < n
        key = _keys_at(src, idx, valid, FROM_LOGITS)
        tie = (valid & (key == cut)).to(tl.int32)
        take = (valid & (key > cut)) | ((tie != 0) & (ties + tl.cumsum(tie, axis=0) - tie < ties_wanted))
        take_i = take.to(tl.int32)
        slot = written + tl.cumsum(take_i, axis=0) - take_i
        if FROM_LOGITS:
            pos = idx
        else:
            pos = tl.load(pos_src + idx, mask=take, other=-1)
        tl.store(out_row + slot, pos, mask=take)
        written += tl.sum(take_i, axis=0)
        ties += tl.sum(tie, axis=0)


@triton.jit
def _filter(row_ptr, lo, hi, cutoff, buf_keys, buf_pos, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Copy (key, position) of every logit in [lo, hi) that is >= cutoff, in order, into the
    buffers (at most CAP); return how many there are."""
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([], tl.int32)
    for c in tl.range(0, loop_bound(tl.cdiv(hi - lo, BLOCK)), num_stages=3):
        idx = lo + c * BLOCK + lanes
        x = tl.load(row_ptr + idx, mask=idx < hi, other=float("-inf"))
        keep = ((idx < hi) & (x >= cutoff)).to(tl.int32)
        slot = count + tl.cumsum(keep, axis=0) - keep
        room = (keep != 0) & (slot < CAP)
        tl.store(buf_keys + slot, _sortable_key(x).to(tl.int32, bitcast=True), mask=room)
        tl.store(buf_pos + slot, idx, mask=room)
        count += tl.sum(keep, axis=0)
    return count


@triton.jit
def _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS: tl.constexpr):
    """(start, n) of a row, clamped to it: ``0 <= start <= width``, ``0 <= n <= width - start``
    (lengths and starts may be int32 or int64)."""
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row), 0), width).to(tl.int32)
    else:
        start = tl.zeros([], tl.int32)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + row), 0), width - start).to(tl.int32)
    return start, n


@triton.jit
def _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS: tl.constexpr):
    """(n, pointer to the row's first valid column)."""
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    return n, logits_ptr + row.to(tl.int64) * row_stride + start


@triton.jit
def _select_short_row(row_ptr, n, want, out_row, K: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """A row that skips the cut-off (``not _long_row``): all of it when ``n <= K``, else the
    whole-row radix select."""
    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    else:
        _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)


@triton.jit
def _select_whole_row(row_ptr, n, want, out_row, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The top ``want`` of the row's ``n`` logits, by radix passes over the whole row."""
    cut, ties = _radix_select(row_ptr, n, want, True, BLOCK, BITS)
    _collect(row_ptr, row_ptr, n, cut, ties, out_row, True, BLOCK)


@triton.jit
def _fill_tail(out_row, want, K: tl.constexpr, BLOCK: tl.constexpr):
    """-1 in out_row[want:K]."""
    lanes = tl.arange(0, BLOCK)
    for c in range(0, K, BLOCK):
        idx = c + lanes
        tl.store(out_row + idx, tl.full([BLOCK], -1, tl.int32), mask=(idx >= want) & (idx < K))


@triton.jit
def _bit_length(x):
    """Bits needed for the uint32 scalar x (0 for 0); may be one too many, never too few."""
    exponent = (x.to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32)
    return tl.maximum(exponent - 126, 0)


@triton.jit
def _radix_narrow(keys, mask, count, need, prefix, top, slack, BITS: tl.constexpr, PASSES: tl.constexpr):
    """Narrow down to the ``need``-th largest of the uint32 ``keys`` under ``mask``.

    The ``count`` masked keys share their bits at and above ``top`` with ``prefix`` (whose
    lower bits are 0). Each pass fixes the next BITS bits from a histogram. Returns
    ``(cut, ties, whole)``: the top ``need`` are the keys above ``cut`` plus the first
    ``ties`` equal to it, or, when ``whole``, every key ``>= cut`` (the narrowing stopped at
    a bin taken whole or holding at most ``slack`` keys).
    """
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    size: tl.constexpr = keys.numel
    whole = (need == count) | (count <= slack)
    done = whole | (top == 0)
    for _ in range(PASSES):  # a runtime loop: one copy of the pass in the code (instruction cache)
        if not done:
            shift = tl.maximum(top - BITS, 0)
            high = ((0xFFFFFFFF << top.to(tl.int64)) & 0xFFFFFFFF).to(tl.uint32)
            match = mask & (((keys ^ prefix) & high) == 0)
            digit = tl.where(match, (keys >> shift) & (BINS - 1), 0).to(tl.int32)
            hist = tl.histogram(tl.reshape(digit, [size], can_reorder=True), BINS)
            unmatched = size - tl.sum(tl.reshape(match.to(tl.int32), [size], can_reorder=True), axis=0)
            hist -= tl.where(bins == 0, unmatched, 0)
            at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            chosen = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
            in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
            need = need - (tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin)
            prefix = prefix | (chosen.to(tl.uint32) << shift)
            top = shift
            whole = (need == in_bin) | (in_bin <= slack)
            done = whole | (top == 0)
    return prefix, need, whole


@triton.jit
def _long_row(n, K: tl.constexpr, SAMPLES: tl.constexpr):
    """Rows that go through the sampled cut-off (the rest are selected directly)."""
    return n > tl.maximum(K, 2 * SAMPLES)


@triton.jit
def _float_cut(cut):
    """The cut-off key lowered, where needed, so that ``key(x) >= cut`` is ``x >= float(cut)``:
    +0.0 -> -0.0 and NaN (key 0) -> -inf. Lowering a cut-off only adds candidates."""
    cut = tl.where(cut == 0x80000000, 0x7FFFFFFF, cut)
    return tl.where(cut == 0, 0x007FFFFF, cut).to(tl.uint32)


@triton.jit
def _topk_cutoff_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 out: the cut-off key (uint32 bits) of each long row
    shift_ptr,        # [R] int32 out: log2 of the candidate histogram's bin width
    hist_ptr,         # [R, BINS] int32 out: zeroed for _topk_filter_v2_kernel
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, SAMPLES: tl.constexpr, SAMPLE_RUN: tl.constexpr, BINS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
    SAMPLE_BITS: tl.constexpr = 8, PDL: tl.constexpr = False,
):
    """v2 step 1, one program a row: a cut-off key with, most likely, a little over K of
    the row's keys at or above it (from SAMPLES keys in evenly spaced runs). With PDL the
    next kernel is let launch at once (it waits for this one before using its outputs)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    if _long_row(n, K, SAMPLES):
        tl.store(hist_ptr + row.to(tl.int64) * BINS + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
        lanes = tl.arange(0, SAMPLES)
        runs: tl.constexpr = SAMPLES // SAMPLE_RUN
        idx = (lanes // SAMPLE_RUN) * (n // runs) + lanes % SAMPLE_RUN
        keys = _sortable_key(tl.load(row_ptr + idx))
        expected = (K * SAMPLES + n - 1) // n
        target = expected + 4 * tl.sqrt(expected.to(tl.float32)).to(tl.int32) + 8
        target = tl.minimum(target, SAMPLES)
        cut, _, _ = _radix_narrow(keys, lanes < SAMPLES, SAMPLES, target, tl.zeros([], tl.uint32),
                                  tl.full([], 32, tl.int32), target // 8 + 1, SAMPLE_BITS, 32 // SAMPLE_BITS)
        # Bins as wide as needed for the sampled maximum to land in the lower half.
        log_bins = _bit_length(tl.full([], BINS, tl.uint32)) - 1
        shift = tl.maximum(_bit_length(tl.max(keys, axis=0) - cut) - (log_bins - 1), 0)
        tl.store(cut_ptr + row, _float_cut(cut).to(tl.int32, bitcast=True))
        tl.store(shift_ptr + row, shift)


@triton.jit
def _histogram_cut_of(hist, want):
    """_histogram_cut of the histogram's values."""
    bins = tl.arange(0, hist.numel)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    chosen = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    left = want - (tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin)
    return chosen, left, in_bin


@triton.jit
def _narrow_bin_and_write(dist, pos, valid, in_chosen, chosen, left, in_bin, shift, out_row,
                          BINS: tl.constexpr, BITS: tl.constexpr):
    """Radix passes over the ``in_bin`` candidates of histogram bin ``chosen`` (those flagged
    ``in_chosen``; bins are ``dist >> shift``, the last one open) for the ``left``-th largest,
    then write every taken position in order."""
    last = chosen == BINS - 1
    top = tl.where(last, 32, shift)
    low = tl.where(last, 0, chosen << shift).to(tl.uint32)
    cut_dist, ties, whole = _radix_narrow(dist, in_chosen, in_bin, left, low, top, 0, BITS, 32 // BITS)
    _write_in_order(dist, pos, valid, cut_dist, tl.where(whole, dist.numel, ties), out_row)


@triton.jit
def _write_in_order(key, pos, valid, cut, ties, out_row):
    """Store pos of the keys above cut and of the first ``ties`` equal to it, in order
    (row-major over the 2-D tensors), through one prefix sum of packed counts."""
    above = (valid & (key > cut)).to(tl.int32)
    equal = (valid & (key == cut)).to(tl.int32)
    packed = above + (equal << 16)  # CAP < 2**16: both counts fit
    inclusive = tl.cumsum(packed, axis=1)
    seg_total = tl.sum(packed, axis=1)
    before = (inclusive - packed) + (tl.cumsum(seg_total, axis=0) - seg_total)[:, None]
    equal_before = before >> 16
    take = (above != 0) | ((equal != 0) & (equal_before < ties))
    slot = (before & 0xFFFF) + tl.minimum(equal_before, ties)
    tl.store(out_row + slot, pos, mask=take)
