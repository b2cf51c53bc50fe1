"""Exact selection by radix passes, over keys in memory or in registers.

In memory (a whole row of logits, or candidates gathered into a buffer): passes over the
keys build a 16-bin histogram of one 4-bit digit (most significant first) among the keys
that match the digits fixed so far, until the k-th largest key is known (or a whole bin is
taken). A last pass writes the positions with a larger key, then the first ``need``
positions whose key equals it (ties to the lower position), in ascending position order
through a running prefix sum. Deterministic by construction.

In registers (``radix_narrow``): the same narrowing on a tensor of keys, used on the sampled
keys of the cut-off and on the candidates of one histogram bin.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.topk.keys import sortable_key
from dsacache.ops.triton_utils import loop_bound


@triton.jit
def _keys_at(src, idx, valid, FROM_LOGITS: tl.constexpr):
    """int64 keys of src[idx]: fp32 logits converted, or uint32 keys stored as int32."""
    if FROM_LOGITS:
        key = sortable_key(tl.load(src + idx, mask=valid, other=0.0))
    else:
        key = tl.load(src + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
    return key.to(tl.int64)


@triton.jit
def _radix_select(src, n, need, FROM_LOGITS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """(cut, ties): the top ``need`` of keys src[:n] are those ``> cut`` plus the first
    ``ties`` equal to ``cut``. ``cut`` is int64 (-1 takes everything)."""
    BINS: tl.constexpr = 1 << BITS
    lanes = tl.arange(0, BLOCK)
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
        chosen, left, in_bin = histogram_cut(hist, need)
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
def select_short_row(row_ptr, n, want, out_row, K: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """A row that skips the cut-off (``not long_row``): all of it when ``n <= K``, else the
    whole-row radix select."""
    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    else:
        select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)


@triton.jit
def select_whole_row(row_ptr, n, want, out_row, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The top ``want`` of the row's ``n`` logits, by radix passes over the whole row."""
    cut, ties = _radix_select(row_ptr, n, want, True, BLOCK, BITS)
    _collect(row_ptr, row_ptr, n, cut, ties, out_row, True, BLOCK)


@triton.jit
def histogram_cut(hist, want):
    """(bin, left, in_bin) of a histogram whose bins ascend by key: the bin holding the
    ``want``-th largest key, how many keys to take from it, and how many it holds."""
    bins = tl.arange(0, hist.numel)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    chosen = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    left = want - (tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_bin)
    return chosen, left, in_bin


@triton.jit
def radix_narrow(keys, mask, count, need, prefix, top, slack, BITS: tl.constexpr, PASSES: tl.constexpr):
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
            chosen, need, in_bin = histogram_cut(hist, need)
            prefix = prefix | (chosen.to(tl.uint32) << shift)
            top = shift
            whole = (need == in_bin) | (in_bin <= slack)
            done = whole | (top == 0)
    return prefix, need, whole


@triton.jit
def narrow_bin_and_write(dist, pos, valid, in_chosen, chosen, left, in_bin, shift, out_row,
                         BINS: tl.constexpr, BITS: tl.constexpr):
    """Radix passes over the ``in_bin`` candidates of histogram bin ``chosen`` (those flagged
    ``in_chosen``; bins are ``dist >> shift``, the last one open) for the ``left``-th largest,
    then write every taken position in order."""
    last = chosen == BINS - 1
    top = tl.where(last, 32, shift)
    low = tl.where(last, 0, chosen << shift).to(tl.uint32)
    cut_dist, ties, whole = radix_narrow(dist, in_chosen, in_bin, left, low, top, 0, BITS, 32 // BITS)
    _write_in_order(dist, pos, valid, cut_dist, tl.where(whole, dist.numel, ties), out_row)


@triton.jit
def _write_in_order(key, pos, valid, cut, ties, out_row):
    """Store pos of the keys above cut and of the first ``ties`` equal to it, in order
    (row-major over the 2-D tensors), through one prefix sum of packed counts."""
    above = (valid & (key > cut)).to(tl.int32)
    equal = (valid & (key == cut)).to(tl.int32)
    before = exclusive_scan_2d(above + (equal << 16))  # CAP < 2**16: both counts fit
    equal_before = before >> 16
    take = (above != 0) | ((equal != 0) & (equal_before < ties))
    slot = (before & 0xFFFF) + tl.minimum(equal_before, ties)
    tl.store(out_row + slot, pos, mask=take)


@triton.jit
def exclusive_scan_2d(flags):
    """Exclusive prefix sum of an int32 [S, L] tensor in row-major order."""
    inclusive = tl.cumsum(flags, axis=1)
    totals = tl.sum(flags, axis=1)
    return (inclusive - flags) + (tl.cumsum(totals, axis=0) - totals)[:, None]
