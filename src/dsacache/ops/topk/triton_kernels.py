"""Triton kernels for top-k selection and positions -> slots, and their launchers.

Top-k works on keys: each fp32 logit becomes an unsigned key that sorts like the float
(NaN -> 0, below ``-inf``). Exact selection is a radix select: passes over the keys
build a 16-bin histogram of one 4-bit digit (most significant first) among the keys that
match the digits fixed so far, until the k-th largest key is known (or a whole bin is
taken). A last pass writes the positions with a larger key, then the first ``need``
positions whose key equals it (ties to the lower position), in ascending position order
through a running prefix sum. Deterministic by construction.

A radix pass costs about one warp instruction an element, so a long row is first cut
down to a few thousand candidates, in two launches:

1. ``_topk_filter_kernel``, SPLITS programs a row: each sorts the same ``SAMPLES``
   evenly spaced logits and takes the one at rank ``r + 4 sqrt(r) + 8`` (``r``: where the
   k-th largest is expected) as the cut-off, then copies (key, position) of every logit
   ``>=`` it in its slice of the row to its own segment, in position order. The copied
   set is closed upwards, so when it has at least ``k`` entries it holds the top k, ties
   included.
2. ``_topk_select_kernel``, one program a row: concatenates the segments and runs the
   radix select on the candidates. When the cut-off missed (fewer than ``k`` candidates,
   or more than ``CAP``, e.g. heavily tied rows) it runs on the whole row instead: same
   answer, slower. Short rows (``n <= max(k, 2 * SAMPLES)``) skip step 1.

That is ``algo="v1"``. The default ``algo="v2"`` keeps the same contract and fallbacks but
moves the sequential work off the one-program-a-row path, in three launches:

1. ``_topk_cutoff_kernel``, one program a row: the cut-off key from ``SAMPLES`` keys (runs
   of ``SAMPLE_RUN`` adjacent logits, evenly spaced, so each run is one memory sector) by an
   in-register radix narrowing with 256-bin histograms that stops once the chosen bin holds
   only a few samples; it also zeroes the row's candidate histogram.
2. ``_topk_filter_v2_kernel``, SPLITS programs a row (a few per SM): copies (key, position)
   of every logit ``>=`` the cut-off, in position order, and counts each candidate into a
   ``BINS``-bin histogram of ``(key - cut) >> shift`` (global atomics: one per candidate,
   integer sums, so deterministic). Each of the program's STREAMS warps owns a contiguous
   piece of its slice and its own segment (``CAP / STREAMS`` apart), so the prefix sum
   that places candidates stays inside the warp; the segments in order are position order.
3. ``_topk_select_v2_kernel``, one program a row: the histogram names the bin holding the
   k-th largest candidate; the candidates sit in registers (``[SPLITS * STREAMS, CAP /
   (SPLITS * STREAMS)]``) and 16-bin radix passes over that bin alone find the exact cut; one
   prefix sum writes the output. A segment holding more than its share of ``CAP`` (a skewed
   row) takes the v1 gather path, a missed cut-off or an overflowing segment the v1
   whole-row path.

The default ``algo="v3"`` keeps v2's cut-off kernel and contract, and reworks the two later
steps for latency:

2. ``_topk_filter_v3_kernel``, PROGS one-warp programs a row (~32 an SM): each streams its
   slice with the next tile's loads in flight, tests ``x >= float(cut)`` (the cut-off is
   never +0.0 or NaN, see ``_float_cut``), places candidates with a warp-local prefix sum
   and writes (key, position) pairs and histogram counts with predicated PTX stores, so
   nothing goes through shared memory and no barrier stalls the loop.
3. ``_topk_select_v3_kernel``, one program a row: all its loads are issued up front; the
   histogram names the chosen bin, whose few candidates (at most TIES) are ranked pairwise
   on (key, position), else by radix passes; one prefix sum writes the output. A skewed row
   (a program over its CAP / PROGS share, e.g. logits growing with the position) is filtered
   again inside the select into a dense buffer and selected the same way, instead of v2's
   whole-row fallback. Loops over radix passes are runtime loops: the select is latency-
   bound and straight-line code larger than the instruction cache made it slower.

On CUDA the filter and select are launched with programmatic dependent launch: each starts
while the kernel before it finishes and waits (``griddepcontrol.wait``) before reading its
outputs. Every kernel clamps the row lengths and starts itself (int32 or int64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.ops.triton_utils import INTERPRET, check_launch, loop_bound

if not INTERPRET:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: Inline PTX is used where it exists (CUDA, compiled); elsewhere the plain Triton ops.
PTX_AVAILABLE = not INTERPRET and torch.version.hip is None

#: Launch settings: ``algo`` ("v3", "v2" or "v1"), BLOCK logits a step, SAMPLES for the
#: cut-off (None: 1024 for v1, 2048 for v2 and v3). CAP (candidate buffer length, default
#: CANDIDATES_PER_K * k, a power of two for v2 and v3) may be set to override. v1 and v2:
#: SPLITS (programs a row's candidate search uses, default from the row and SM counts).
#: v2 and v3: BINS (candidate histogram), SAMPLE_RUN (adjacent logits a sample run),
#: SAMPLE_BITS (radix digit of the cut-off search), num_warps (cut-off kernel), select_warps
#: (None: 16 for v2; for v3 8 when the rows fit one wave on the SMs, else 16).
#: v2 only: STREAMS (per-warp candidate streams a filter program keeps). v3 only: PROGS
#: (one-warp filter programs a row, default from the row and SM counts), V (logits a lane a
#: filter step), TIES (largest chosen bin ranked pairwise), asm (inline PTX where available),
#: pdl (programmatic dependent launch of the filter and select kernels, CUDA only).
TOPK_CONFIG = {"algo": "v3", "BLOCK": 2048, "SAMPLES": None, "num_warps": 8, "CAP": None, "SPLITS": None,
               "BINS": 2048, "SAMPLE_RUN": 8, "select_warps": None, "STREAMS": 8, "PROGS": None, "V": 8,
               "TIES": 32, "asm": True, "SAMPLE_BITS": 4, "pdl": True}
CANDIDATES_PER_K = 4
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
def _sample_cutoff(row_ptr, n, K: tl.constexpr, SAMPLES: tl.constexpr):
    """A logit value with, most likely, a little over K of the n logits at or above it."""
    lanes = tl.arange(0, SAMPLES)
    keys = _sortable_key(tl.load(row_ptr + lanes * (n // SAMPLES)))
    ranked = tl.sort(keys, descending=True)
    expected = (K * SAMPLES + n - 1) // n
    rank = expected + 4 * tl.sqrt(expected.to(tl.float32)).to(tl.int32) + 8
    rank = tl.minimum(rank, SAMPLES) - 1
    return _key_to_float(tl.max(tl.where(lanes == rank, ranked, 0), axis=0))


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
def _topk_filter_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    seg_keys_ptr,     # [R, SPLITS, CAP] int32 scratch: candidate keys of each split, in order
    seg_pos_ptr,      # [R, SPLITS, CAP] int32 scratch: their positions
    counts_ptr,       # [R, SPLITS] int32: candidates found by each split (may exceed CAP)
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr, SPLITS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """Step 1 of a long row, split over SPLITS programs: sampled cut-off, then candidates."""
    split = tl.program_id(0)
    row = tl.program_id(1)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    if n > tl.maximum(K, 2 * SAMPLES):
        cutoff = _sample_cutoff(row_ptr, n, K, SAMPLES)  # every split derives the same value
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
        lo = tl.minimum(split * chunk, n)
        seg = (row.to(tl.int64) * SPLITS + split) * CAP
        count = _filter(row_ptr, lo, tl.minimum(lo + chunk, n), cutoff,
                        seg_keys_ptr + seg, seg_pos_ptr + seg, CAP, BLOCK)
        tl.store(counts_ptr + row * SPLITS + split, count)


@triton.jit
def _gather_segments(seg_keys, seg_pos, counts, buf_keys, buf_pos, total,
                     CAP: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr = 1):
    """Concatenate the SPLITS candidate segments (in split order, so in position order)."""
    lanes = tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS)
    ends = tl.cumsum(counts, axis=0)
    firsts = ends - counts
    for c in range(loop_bound(tl.cdiv(total, BLOCK))):
        j = c * BLOCK + lanes
        valid = j < total
        owner = tl.sum((j[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        offset = j - tl.sum(tl.where(owner[:, None] == splits[None, :], firsts[None, :], 0), axis=1)
        src = (owner.to(tl.int64) * CAP + offset) * PAIR  # PAIR = 2: (key, pos) interleaved
        tl.store(buf_keys + j, tl.load(seg_keys + src, mask=valid), mask=valid)
        tl.store(buf_pos + j, tl.load(seg_pos + src, mask=valid), mask=valid)


@triton.jit
def _topk_select_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    seg_keys_ptr,     # [R, SPLITS, CAP] int32 (from _topk_filter_kernel)
    seg_pos_ptr,      # [R, SPLITS, CAP] int32
    counts_ptr,       # [R, SPLITS] int32
    buf_keys_ptr,     # [R, CAP] int32 scratch
    buf_pos_ptr,      # [R, CAP] int32 scratch
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
    SPLITS: tl.constexpr, BITS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """Step 2, one program a row: exact selection (from the candidates when they suffice)."""
    row = tl.program_id(0)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    elif n <= 2 * SAMPLES:
        _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)
    else:
        counts = tl.load(counts_ptr + row * SPLITS + tl.arange(0, SPLITS))
        total = tl.sum(counts, axis=0)
        if (tl.max(counts, axis=0) <= CAP) & (total >= want) & (total <= CAP):
            seg = row.to(tl.int64) * SPLITS * CAP
            _select_gathered(seg_keys_ptr + seg, seg_pos_ptr + seg, counts, buf_keys_ptr + row.to(tl.int64) * CAP,
                             buf_pos_ptr + row.to(tl.int64) * CAP, total, want, out_row, CAP, SPLITS, BLOCK, BITS)
        else:
            _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)
    _fill_tail(out_row, want, K, BLOCK)


@triton.jit
def _select_gathered(seg_keys, seg_pos, counts, buf_keys, buf_pos, total, want, out_row,
                     STRIDE: tl.constexpr, NSEG: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                     PAIR: tl.constexpr = 1):
    """Concatenate the NSEG candidate segments (STRIDE apart) into the row's buffer, then
    select the top ``want`` of those ``total`` candidates."""
    _gather_segments(seg_keys, seg_pos, counts, buf_keys, buf_pos, total, STRIDE, NSEG, BLOCK, PAIR)
    tl.debug_barrier()  # the buffer was written by other threads of this program
    cut, ties = _radix_select(buf_keys, total, want, False, BLOCK, BITS)
    _collect(buf_keys, buf_pos, total, cut, ties, out_row, False, BLOCK)


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
def _filter_v2(row_ptr, start, lo, hi, cut, shift, hist_row, seg_keys, seg_pos,
               CAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Copy (key, position - start) of every logit in columns [lo, hi) (lo is BLOCK-aligned
    relative to an aligned column, so loads vectorize) whose key is >= cut, in order, into
    the segment (at most CAP); count each into hist_row. Returns how many there are."""
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([], tl.int32)
    for c in tl.range(0, loop_bound(tl.cdiv(hi - lo, BLOCK)), num_stages=3):
        col = lo + c * BLOCK + lanes
        valid = (col >= start) & (col < hi)
        key = _sortable_key(tl.load(row_ptr + col, mask=valid, other=0.0))
        keep = valid & (key >= cut)
        keep_i = keep.to(tl.int32)
        slot = count + tl.cumsum(keep_i, axis=0) - keep_i
        room = keep & (slot < CAP)
        tl.store(seg_keys + slot, key.to(tl.int32, bitcast=True), mask=room)
        tl.store(seg_pos + slot, col - start, mask=room)
        bin_ = tl.minimum((key - cut) >> shift, BINS - 1).to(tl.int32)
        tl.atomic_add(hist_row + bin_, 1, mask=keep, sem="relaxed")
        count += tl.sum(keep_i, axis=0)
    return count


@triton.jit
def _filter_streams(row_ptr, start, lo, hi, cut, shift, hist_row, seg_keys, seg_pos,
                    STREAMS: tl.constexpr, SEG: tl.constexpr, BINS: tl.constexpr):
    """``_filter_v2`` with the range [lo, hi) cut into STREAMS contiguous pieces, one per warp
    (rows of a [STREAMS, 128] tile): piece r's candidates go to its own segment (``SEG`` apart,
    at most SEG) in order, so the prefix sum that places them never leaves the warp. Returns
    the counts [STREAMS] (may exceed SEG)."""
    LANES: tl.constexpr = 128
    piece = tl.cdiv(tl.cdiv(hi - lo, STREAMS), LANES) * LANES
    base = lo + tl.arange(0, STREAMS)[:, None] * piece + tl.arange(0, LANES)[None, :]   # [STREAMS, LANES]
    end = tl.minimum(base - tl.arange(0, LANES)[None, :] + piece, hi)
    out = tl.arange(0, STREAMS)[:, None] * SEG
    count = tl.zeros([STREAMS], tl.int32)
    for c in tl.range(0, loop_bound(piece // LANES), num_stages=1):
        col = base + c * LANES
        valid = (col >= start) & (col < end)
        key = _sortable_key(tl.load(row_ptr + col, mask=valid, other=0.0))
        keep = valid & (key >= cut)
        keep_i = keep.to(tl.int32)
        slot = count[:, None] + tl.cumsum(keep_i, axis=1) - keep_i
        room = keep & (slot < SEG)
        tl.store(seg_keys + out + slot, key.to(tl.int32, bitcast=True), mask=room)
        tl.store(seg_pos + out + slot, col - start, mask=room)
        bin_ = tl.minimum((key - cut) >> shift, BINS - 1).to(tl.int32)
        tl.atomic_add(hist_row + bin_, 1, mask=keep, sem="relaxed")
        count += tl.sum(keep_i, axis=1)
    return count


@triton.jit
def _topk_filter_v2_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 (from _topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32: candidates a bin, accumulated by every split
    seg_keys_ptr,     # [R, SPLITS, CAP] int32 scratch: candidate keys of each split, in order
    seg_pos_ptr,      # [R, SPLITS, CAP] int32 scratch: their positions
    counts_ptr,       # [R, SPLITS] int32: candidates found by each split (may exceed CAP)
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
    SPLITS: tl.constexpr, BINS: tl.constexpr, STREAMS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """v2 step 2, SPLITS programs a long row: candidates at or above the row's cut-off
    (STREAMS > 1: each program's range in STREAMS per-warp segments of CAP / STREAMS)."""
    split = tl.program_id(0)
    row = tl.program_id(1)
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    if _long_row(n, K, SAMPLES):
        first = (start // 16) * 16  # splits start on aligned columns so loads vectorize
        chunk = tl.cdiv(tl.cdiv(start + n - first, SPLITS), BLOCK) * BLOCK
        lo = first + split * chunk
        seg = (row.to(tl.int64) * SPLITS + split) * CAP
        cut = tl.load(cut_ptr + row).to(tl.uint32, bitcast=True)
        hi = tl.minimum(lo + chunk, start + n)
        if STREAMS > 1:
            counts = _filter_streams(logits_ptr + row.to(tl.int64) * row_stride, start, lo, hi, cut,
                                     tl.load(shift_ptr + row), hist_ptr + row.to(tl.int64) * BINS,
                                     seg_keys_ptr + seg, seg_pos_ptr + seg, STREAMS, CAP // STREAMS, BINS)
            tl.store(counts_ptr + (row * SPLITS + split) * STREAMS + tl.arange(0, STREAMS), counts)
        else:
            count = _filter_v2(logits_ptr + row.to(tl.int64) * row_stride, start, lo, hi,
                               cut, tl.load(shift_ptr + row), hist_ptr + row.to(tl.int64) * BINS,
                               seg_keys_ptr + seg, seg_pos_ptr + seg, CAP, BLOCK, BINS)
            tl.store(counts_ptr + row * SPLITS + split, count)


@triton.jit
def _histogram_cut(hist_row, want, BINS: tl.constexpr):
    """(bin, left, in_bin): the bin holding the want-th largest candidate, how many to take
    from it, and how many it holds."""
    return _histogram_cut_of(tl.load(hist_row + tl.arange(0, BINS)), want)


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
def _select_in_registers(seg_keys, seg_pos, counts, hist_row, cut, shift, want, out_row,
                         CAP: tl.constexpr, SPLITS: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr,
                         STRIDE: tl.constexpr):
    """Exact top ``want`` of the candidates of SPLITS segments STRIDE apart (each holding at
    most CAP / SPLITS), written in position order."""
    SEG: tl.constexpr = CAP // SPLITS
    chosen, left, in_bin = _histogram_cut(hist_row, want, BINS)
    lane = tl.arange(0, SEG)[None, :]
    valid = lane < counts[:, None]
    src = tl.arange(0, SPLITS)[:, None] * STRIDE + lane
    # Distances above the cut-off: the histogram binned (dist >> shift), the last bin open.
    dist = tl.load(seg_keys + src, mask=valid, other=0).to(tl.uint32, bitcast=True) - cut
    pos = tl.load(seg_pos + src, mask=valid, other=-1)
    in_chosen = valid & (tl.minimum(dist >> shift, BINS - 1) == chosen)
    _narrow_bin_and_write(dist, pos, valid, in_chosen, chosen, left, in_bin, shift, out_row, BINS, BITS)


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


@triton.jit
def _topk_select_v2_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 (from _topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32 (from _topk_filter_v2_kernel)
    seg_keys_ptr,     # [R, SPLITS, CAP] int32
    seg_pos_ptr,      # [R, SPLITS, CAP] int32
    counts_ptr,       # [R, SPLITS] int32
    buf_keys_ptr,     # [R, CAP] int32 scratch (skewed rows only)
    buf_pos_ptr,      # [R, CAP] int32 scratch
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
    SPLITS: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr, STREAMS: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """v2 step 3, one program a row: exact selection from the candidates in registers
    (the v1 paths for short rows, skewed rows and a missed cut-off). The row's candidates
    are in SPLITS * STREAMS segments, CAP / STREAMS apart."""
    NSEG: tl.constexpr = SPLITS * STREAMS
    STRIDE: tl.constexpr = CAP // STREAMS
    row = tl.program_id(0)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    elif not _long_row(n, K, SAMPLES):
        _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)
    else:
        counts = tl.load(counts_ptr + row * NSEG + tl.arange(0, NSEG))
        total = tl.sum(counts, axis=0)
        seg = row.to(tl.int64) * SPLITS * CAP
        if (tl.max(counts, axis=0) <= CAP // NSEG) & (total >= want):
            _select_in_registers(seg_keys_ptr + seg, seg_pos_ptr + seg, counts, hist_ptr + row.to(tl.int64) * BINS,
                                 tl.load(cut_ptr + row).to(tl.uint32, bitcast=True), tl.load(shift_ptr + row),
                                 want, out_row, CAP, NSEG, BINS, BITS, STRIDE)
        elif (tl.max(counts, axis=0) <= STRIDE) & (total >= want) & (total <= CAP):
            _select_gathered(seg_keys_ptr + seg, seg_pos_ptr + seg, counts, buf_keys_ptr + row.to(tl.int64) * CAP,
                             buf_pos_ptr + row.to(tl.int64) * CAP, total, want, out_row, STRIDE, NSEG, BLOCK, BITS)
        else:
            _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)
    _fill_tail(out_row, want, K, BLOCK)


@triton.jit
def _filter_warp(row_ptr, start, lo, hi, hi_load, cut_ptr, shift_ptr, hist_row, seg,
                 SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr, USE_ASM: tl.constexpr,
                 PDL: tl.constexpr):
    """One warp's candidates of columns [lo, hi) (``hi_load >= hi`` bounds the loads, a multiple
    of 4 when ``lo`` is, so they vectorize): (key, position - start) pairs of each key >= cut,
    in order, into the segment ``seg`` (at most SEG_CAP pairs), each counted into the row's
    histogram of ``(key - cut) >> shift`` (the last bin open). The next tile is loaded before
    this one is scanned, so two tiles of loads are in flight.

    ``cut`` is never the key of +0.0 or of NaN (see ``_float_cut``), so ``x >= float(cut)``
    is ``key(x) >= cut``: the test runs on the float, the key is built only to be stored.
    With PDL (programmatic dependent launch) the first tile is loaded before waiting for the
    cut-off kernel, whose cut-off, shift and zeroed histogram are used after the wait.
    Returns the count (may exceed SEG_CAP)."""
    TILE: tl.constexpr = 32 * V
    lanes = tl.arange(0, TILE)
    span = (hi - start).to(tl.uint32)
    count = tl.zeros([], tl.int32)
    col = lo + lanes
    x = tl.load(row_ptr + col, mask=col < hi_load, other=0.0)
    if PDL:
        gdc_wait()
    cut = tl.load(cut_ptr).to(tl.uint32, bitcast=True)
    shift = tl.load(shift_ptr)
    cut_f = _key_to_float(cut)
    for c in tl.range(0, loop_bound(tl.cdiv(hi - lo, TILE)), num_stages=1):
        nxt = col + TILE
        x_next = tl.load(row_ptr + nxt, mask=nxt < hi_load, other=0.0)
        pos = col - start
        keep = (x >= cut_f) & (pos.to(tl.uint32) < span)
        keep_i = keep.to(tl.int32)
        slot = count + tl.cumsum(keep_i, axis=0) - keep_i
        key = _sortable_key_not_nan(x)
        bin_ = tl.minimum((key - cut) >> shift, BINS - 1).to(tl.int32)
        key = key.to(tl.int32, bitcast=True)
        if USE_ASM:
            _emit_asm(seg, hist_row, slot, bin_, key, pos, keep, SEG_CAP)
        else:
            room = keep & (slot < SEG_CAP)
            tl.store(seg + 2 * slot, key, mask=room)
            tl.store(seg + 2 * slot + 1, pos, mask=room)
            tl.atomic_add(hist_row + bin_, 1, mask=keep, sem="relaxed")
        count += tl.sum(keep_i, axis=0)
        col = nxt
        x = x_next
    return count


@triton.jit
def _sortable_key_not_nan(x):
    """_sortable_key for an x known not to be NaN."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) | (-0x80000000))).to(tl.uint32, bitcast=True)


@triton.jit
def _emit_asm(seg, hist_row, slot, bin_, key, pos, keep, SEG_CAP: tl.constexpr):
    """Where ``keep``: seg[2 * slot : 2 * slot + 2] = (key, pos) (if slot < SEG_CAP), one
    predicated 8-byte store, and hist_row[bin_] += 1, as PTX. As ``tl.store`` and
    ``tl.atomic_add`` the scattered addresses would make Triton move every value into a
    one-element-a-thread layout through shared memory first; here they stay in the load's."""
    tl.inline_asm_elementwise(
        """{ .reg .pred k, r; .reg .b64 a;
        setp.ne.b32 k, $7, 0;
        setp.lt.and.s32 r, $3, $8, k;
        mad.wide.s32 a, $3, 8, $1;
        @r st.global.v2.b32 [a], {$5, $6};
        mad.wide.s32 a, $4, 4, $2;
        @k red.global.add.u32 [a], 1;
        mov.b32 $0, 0; }""",
        "=r,l,l,r,r,r,r,r,r",
        [seg.to(tl.int64, bitcast=True), hist_row.to(tl.int64, bitcast=True), slot, bin_, key, pos,
         keep.to(tl.int32), tl.full(slot.shape, SEG_CAP, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _topk_filter_v3_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 (from _topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32: candidates a bin, accumulated by every program of the row
    seg_ptr,          # [R, PROGS, SEG_CAP, 2] int32 scratch: (key, position) of each program's candidates, in order
    counts_ptr,       # [R, PROGS] int32: candidates found by each program (may exceed SEG_CAP)
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, SAMPLES: tl.constexpr, PROGS: tl.constexpr, SEG_CAP: tl.constexpr, BINS: tl.constexpr,
    V: tl.constexpr, ALIGNED: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """v3 step 2, PROGS one-warp programs a long row: candidates at or above the row's
    cut-off. One warp a program keeps every scan inside the warp (no barrier in the loop)
    and lets ~32 programs share an SM, so enough loads are in flight to stream the row.
    With PDL the select kernel is let launch once every program is past its loop."""
    prog = tl.program_id(0)
    row = tl.program_id(1)
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    if _long_row(n, K, SAMPLES):
        TILE: tl.constexpr = 32 * V
        end = start + n
        first = tl.multiple_of((start // TILE) * TILE, TILE)  # tiles start aligned: loads vectorize
        chunk = tl.multiple_of(tl.cdiv(tl.cdiv(end - first, PROGS), TILE) * TILE, TILE)
        lo = first + prog * chunk
        hi = tl.minimum(lo + chunk, end)
        if ALIGNED:  # the row's width is a multiple of 4: the 4-wide loads stay inside it
            hi_load = tl.multiple_of(tl.cdiv(hi, 4) * 4, 4)
        else:
            hi_load = hi
        seg = seg_ptr + (row.to(tl.int64) * PROGS + prog) * (2 * SEG_CAP)
        count = _filter_warp(logits_ptr + row.to(tl.int64) * row_stride, start, lo, hi, hi_load, cut_ptr + row,
                             shift_ptr + row, hist_ptr + row.to(tl.int64) * BINS, seg, SEG_CAP, BINS, V, USE_ASM,
                             PDL)
        if PDL:
            gdc_launch_dependents()
        tl.store(counts_ptr + row * PROGS + prog, count)


@triton.jit
def _exclusive_scan_2d(flags):
    """Exclusive prefix sum of an int32 [S, L] tensor in row-major order."""
    inclusive = tl.cumsum(flags, axis=1)
    totals = tl.sum(flags, axis=1)
    return (inclusive - flags) + (tl.cumsum(totals, axis=0) - totals)[:, None]


@triton.jit
def _cut_in_bin(dist, pos, in_chosen, in_bin, left, scratch_keys, scratch_pos, TIES: tl.constexpr):
    """The ``left``-th of the ``in_bin`` (at most TIES) candidates flagged ``in_chosen``, in
    the order distance (largest first) then position (lowest first), as (dist, pos): the
    flagged candidates ranking at or above it are taken. They are compacted to scratch and
    ranked pairwise."""
    at = _exclusive_scan_2d(in_chosen.to(tl.int32))
    tl.store(scratch_keys + at, dist.to(tl.int32, bitcast=True), mask=in_chosen)
    tl.store(scratch_pos + at, pos, mask=in_chosen)
    tl.debug_barrier()  # scratch was written by other threads of this program
    j = tl.arange(0, TIES)
    live = j < in_bin
    d = tl.load(scratch_keys + j, mask=live, other=0).to(tl.uint32, bitcast=True)
    p = tl.load(scratch_pos + j, mask=live, other=0)
    di, pi, dj, pj = d[:, None], p[:, None], d[None, :], p[None, :]
    ahead = live[:, None] & ((di > dj) | ((di == dj) & (pi < pj)))   # i ranks before j
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    pick = live & (rank == left - 1)
    return tl.max(tl.where(pick, d, 0), axis=0), tl.max(tl.where(pick, p, -1), axis=0)


@triton.jit
def _select_v3(keys, pos, valid, hist, cut, shift, want, out_row, scratch_keys, scratch_pos,
               BITS: tl.constexpr, TIES: tl.constexpr):
    """Exact top ``want`` of the candidates ``keys`` / ``pos`` (2-D int32 tiles, row-major in
    position order, ``valid`` where there is one), written in position order.

    The candidates become distances above the cut-off; the filter's histogram of
    ``dist >> shift`` (``hist``, the last bin open) names the bin holding the want-th largest.
    A bin of at most TIES candidates is ranked pairwise, a larger one (ties) by radix passes."""
    BINS: tl.constexpr = hist.numel
    chosen, left, in_bin = _histogram_cut_of(hist, want)
    dist = keys.to(tl.uint32, bitcast=True) - cut
    bin_ = tl.minimum(dist >> shift, BINS - 1).to(tl.int32)
    in_chosen = valid & (bin_ == chosen)
    if (left == in_bin) | (in_bin <= TIES):
        if left == in_bin:
            take = valid & (bin_ >= chosen)
        else:
            cut_d, cut_p = _cut_in_bin(dist, pos, in_chosen, in_bin, left, scratch_keys, scratch_pos, TIES)
            take = valid & ((bin_ > chosen) | (in_chosen & ((dist > cut_d) | ((dist == cut_d) & (pos <= cut_p)))))
        tl.store(out_row + _exclusive_scan_2d(take.to(tl.int32)), pos, mask=take)
    else:
        _narrow_bin_and_write(dist, pos, valid, in_chosen, chosen, left, in_bin, shift, out_row, BINS, BITS)


@triton.jit
def _topk_select_v3_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 (from _topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32 (from _topk_filter_v3_kernel)
    seg_ptr,          # [R, PROGS, CAP // PROGS] int64 (from _topk_filter_v3_kernel): pos << 32 | key
    counts_ptr,       # [R, PROGS] int32
    buf_keys_ptr,     # [R, CAP + TIES] int32 scratch: a skewed row's candidates again, densely; the chosen bin's
    buf_pos_ptr,      # [R, CAP + TIES] int32 scratch
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr, PROGS: tl.constexpr,
    BINS: tl.constexpr, BITS: tl.constexpr, TIES: tl.constexpr, PDL: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
):
    """v3 step 3, one program a row: exact selection from the candidates in registers.

    A skewed row (a program found more than its CAP / PROGS share, e.g. logits that grow
    with the position) is filtered again here, whole, into a dense buffer, and selected the
    same way; short rows and a missed cut-off take the v1 paths."""
    SEG: tl.constexpr = CAP // PROGS
    LANES: tl.constexpr = 128
    row = tl.program_id(0)
    if PDL:
        gdc_wait()  # launched while the filter finished: its outputs are complete from here
    # Every load the register path needs is issued here, before anything waits on another
    # (for a row that turns out short they are unused; the scratch past a count is garbage,
    # masked below).
    counts = tl.load(counts_ptr + row * PROGS + tl.arange(0, PROGS))
    cut = tl.load(cut_ptr + row).to(tl.uint32, bitcast=True)
    shift = tl.load(shift_ptr + row)
    hist = tl.load(hist_ptr + row.to(tl.int64) * BINS + tl.arange(0, BINS))
    lane = tl.arange(0, SEG)[None, :]
    pair = tl.load(seg_ptr + (row.to(tl.int64) * CAP + tl.arange(0, PROGS)[:, None] * SEG + lane))
    keys = pair.to(tl.int32)  # the low word (the filter stores key, pos in that order)
    pos = (pair >> 32).to(tl.int32)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    elif not _long_row(n, K, SAMPLES):
        _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)
    else:
        total = tl.sum(counts, axis=0)
        buf_keys = buf_keys_ptr + row.to(tl.int64) * (CAP + TIES)
        buf_pos = buf_pos_ptr + row.to(tl.int64) * (CAP + TIES)
        if (total < want) | (total > CAP):
            _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)  # the cut-off missed
        elif tl.max(counts, axis=0) <= SEG:
            _select_v3(keys, pos, lane < counts[:, None], hist, cut, shift, want, out_row, buf_keys, buf_pos,
                       BITS, TIES)
        else:
            _filter(row_ptr, 0, n, _key_to_float(cut), buf_keys, buf_pos, CAP, BLOCK)
            tl.debug_barrier()  # the buffer was written by other threads of this program
            j = tl.arange(0, CAP // LANES)[:, None] * LANES + tl.arange(0, LANES)[None, :]
            live = j < total
            # buf_keys doubles as the chosen bin's scratch: past the candidates
            _select_v3(tl.load(buf_keys + j, mask=live, other=0), tl.load(buf_pos + j, mask=live, other=-1), live,
                       hist, cut, shift, want, out_row, buf_keys + total, buf_pos + total, BITS, TIES)
    _fill_tail(out_row, want, K, BLOCK)


@triton.jit
def _positions_to_slots_kernel(
    pos_ptr,          # [R, K] int32
    bt_ptr,           # [B, max_blocks] int32
    out_ptr,          # [R, K] int32
    num_cols, pos_stride, bt_stride, max_blocks, num_pages,
    NEXT_N: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < num_cols
    pos = tl.load(pos_ptr + row.to(tl.int64) * pos_stride + cols, mask=in_row, other=-1)
    block = pos // PAGE
    known = (pos >= 0) & (block < max_blocks)
    page = tl.load(bt_ptr + (row // NEXT_N).to(tl.int64) * bt_stride + block, mask=known, other=-1)
    ok = known & (page >= 0) & (page < num_pages)
    slots = tl.where(ok, page * PAGE + pos % PAGE, -1)
    tl.store(out_ptr + row.to(tl.int64) * num_cols + cols, slots, mask=in_row)


def topk_splits(rows: int, num_sms: int) -> int:
    """Programs a long row's v1 candidate search is split over: about half the SMs' worth of
    programs in all (measured best on an H200 at 64 rows: 2; at 256 rows: 1)."""
    return max(1, min(8, triton.next_power_of_2(triton.cdiv(num_sms, 2 * max(rows, 1)))))


def topk_splits_v2(rows: int, num_sms: int) -> int:
    """Programs a long row's v2 candidate search is split over: about 4 programs an SM in
    all (64 rows on 132 SMs: 8; 256 rows: 2), a power of two up to 16."""
    per_row = max(1, 4 * num_sms // max(rows, 1))
    return min(16, 1 << (per_row.bit_length() - 1))


def launch_topk(logits: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None, out: torch.Tensor,
                config: dict | None = None) -> None:
    """Fill ``out [R, k]`` with the top-k positions of each row of ``logits [R, *]``
    (``config["algo"]``: "v3" or "v2", three launches, or "v1", two). ``lens`` and ``starts``
    (None: every row starts at 0) are int32 or int64 and clamped to the row by the kernels."""
    cfg = {**TOPK_CONFIG, **(config or {})}
    check_launch(logits.stride(1) == 1 and out.is_contiguous(), "contiguous logits rows and out")
    check_launch(lens.is_contiguous() and (starts is None or starts.is_contiguous()),
                 "contiguous lengths and row starts")
    check_launch(cfg["algo"] in ("v1", "v2", "v3"), f"algo {cfg['algo']!r} is v1, v2 or v3")
    launch = {"v1": _launch_v1, "v2": _launch_v2, "v3": _launch_v3}[cfg["algo"]]
    window = dict(width=logits.shape[1], HAS_STARTS=starts is not None)
    launch(logits, lens, lens if starts is None else starts, out, cfg, _num_sms(logits.device), window)


def _launch_v1(logits, lens, starts, out, cfg, num_sms, window):
    rows, k = logits.shape[0], out.shape[1]
    cap = cfg.get("CAP") or CANDIDATES_PER_K * k
    splits = cfg.get("SPLITS") or topk_splits(rows, num_sms)
    seg_keys = torch.empty(rows, splits, cap, dtype=torch.int32, device=logits.device)
    seg_pos = torch.empty_like(seg_keys)
    counts = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    buf_keys = torch.empty(rows, cap, dtype=torch.int32, device=logits.device)
    buf_pos = torch.empty_like(buf_keys)
    common = dict(K=k, BLOCK=cfg["BLOCK"], CAP=cap, SAMPLES=cfg["SAMPLES"] or 1024, SPLITS=splits,
                  num_warps=cfg["num_warps"])
    _topk_filter_kernel[(splits, rows)](logits, lens, starts, seg_keys, seg_pos, counts, logits.stride(0),
                                        **window, **common)
    _topk_select_kernel[(rows,)](logits, lens, starts, out, seg_keys, seg_pos, counts, buf_keys, buf_pos,
                                 logits.stride(0), BITS=RADIX_BITS, **window, **common)


def _launch_v2(logits, lens, starts, out, cfg, num_sms, window):
    rows, k = logits.shape[0], out.shape[1]
    cap = cfg.get("CAP") or triton.next_power_of_2(CANDIDATES_PER_K * k)
    splits = cfg.get("SPLITS") or min(topk_splits_v2(rows, num_sms), cap)
    streams = max(1, min(cfg["STREAMS"], cap // splits))
    samples, bins = cfg["SAMPLES"] or 2048, cfg["BINS"]
    check_launch(cap & (cap - 1) == 0 and splits & (splits - 1) == 0 and cap >= splits and cap < 2**16,
                 "v2: CAP and SPLITS powers of two, SPLITS <= CAP < 65536")
    check_launch(streams & (streams - 1) == 0, "v2: STREAMS a power of two")
    check_launch(samples % cfg["SAMPLE_RUN"] == 0 and bins & (bins - 1) == 0, "v2: SAMPLE_RUN | SAMPLES, BINS a power of two")
    device = logits.device
    seg_keys = torch.empty(rows, splits, cap, dtype=torch.int32, device=device)
    seg_pos = torch.empty_like(seg_keys)
    counts = torch.empty(rows, splits * streams, dtype=torch.int32, device=device)
    buf_keys = torch.empty(rows, cap, dtype=torch.int32, device=device)
    buf_pos = torch.empty_like(buf_keys)
    cut = torch.empty(rows, dtype=torch.int32, device=device)
    shift = torch.empty_like(cut)
    hist = torch.empty(rows, bins, dtype=torch.int32, device=device)
    stride = logits.stride(0)
    _topk_cutoff_kernel[(rows,)](logits, lens, starts, cut, shift, hist, stride, **window, K=k, SAMPLES=samples,
                                 SAMPLE_RUN=cfg["SAMPLE_RUN"], BINS=bins, SAMPLE_BITS=cfg["SAMPLE_BITS"],
                                 num_warps=cfg["num_warps"])
    common = dict(K=k, BLOCK=cfg["BLOCK"], CAP=cap, SAMPLES=samples, SPLITS=splits, BINS=bins, STREAMS=streams)
    _topk_filter_v2_kernel[(splits, rows)](logits, lens, starts, cut, shift, hist, seg_keys, seg_pos, counts,
                                           stride, **window, num_warps=streams if streams > 1 else cfg["num_warps"],
                                           **common)
    _topk_select_v2_kernel[(rows,)](logits, lens, starts, out, cut, shift, hist, seg_keys, seg_pos, counts,
                                    buf_keys, buf_pos, stride, **window, BITS=RADIX_BITS,
                                    num_warps=cfg["select_warps"] or 16,
                                    **common)


def topk_progs_v3(rows: int, num_sms: int, cap: int) -> int:
    """One-warp filter programs a long row gets in v3: about 32 an SM in all (64 rows on 132
    SMs: 64; 256 rows: 16), a power of two, with at least 128 candidate slots each."""
    per_row = max(1, 32 * num_sms // max(rows, 1))
    return max(1, min(1 << (per_row.bit_length() - 1), cap // 128, 256))


def _launch_v3(logits, lens, starts, out, cfg, num_sms, window):
    rows, k = logits.shape[0], out.shape[1]
    cap = cfg.get("CAP") or max(128, triton.next_power_of_2(CANDIDATES_PER_K * k))
    progs = cfg.get("PROGS") or topk_progs_v3(rows, num_sms, cap)
    samples, bins, vec = cfg["SAMPLES"] or 2048, cfg["BINS"], cfg["V"]
    check_launch(cap & (cap - 1) == 0 and progs & (progs - 1) == 0 and 128 * progs <= cap < 2**16,
                 "v3: CAP and PROGS powers of two, 128 * PROGS <= CAP < 65536")
    check_launch(vec & (vec - 1) == 0 and bins & (bins - 1) == 0 and samples % cfg["SAMPLE_RUN"] == 0,
                 "v3: V and BINS powers of two, SAMPLE_RUN | SAMPLES")
    device = logits.device
    seg = torch.empty(rows, cap, 2, dtype=torch.int32, device=device)  # [R, PROGS, CAP // PROGS, 2]
    counts = torch.empty(rows, progs, dtype=torch.int32, device=device)
    buf_keys = torch.empty(rows, cap + cfg["TIES"], dtype=torch.int32, device=device)
    buf_pos = torch.empty_like(buf_keys)
    cut = torch.empty(rows, dtype=torch.int32, device=device)
    shift = torch.empty_like(cut)
    hist = torch.empty(rows, bins, dtype=torch.int32, device=device)
    stride = logits.stride(0)
    aligned = logits.shape[1] % 4 == 0 and stride % 4 == 0 and logits.data_ptr() % 16 == 0
    # Programmatic dependent launch: each later kernel is launched while the one before it
    # finishes and waits (griddepcontrol) before reading its outputs.
    pdl = {"PDL": True, "launch_pdl": True} if cfg["pdl"] and PTX_AVAILABLE else {"PDL": False}
    _topk_cutoff_kernel[(rows,)](logits, lens, starts, cut, shift, hist, stride, **window, K=k, SAMPLES=samples,
                                 SAMPLE_RUN=cfg["SAMPLE_RUN"], BINS=bins, SAMPLE_BITS=cfg["SAMPLE_BITS"],
                                 PDL=pdl["PDL"], num_warps=cfg["num_warps"])
    common = dict(K=k, SAMPLES=samples, PROGS=progs, BINS=bins)
    # One wave of selects (rows <= SMs) is latency-bound: 8 warps hold a row's candidates
    # without spilling. H200, L = 128K: 64 rows 15.0 -> 13.1 us; 256 rows 16 warps are faster.
    select_warps = cfg["select_warps"] or (8 if rows <= num_sms else 16)
    _topk_filter_v3_kernel[(progs, rows)](logits, lens, starts, cut, shift, hist, seg, counts, stride, **window,
                                          SEG_CAP=cap // progs, V=vec, ALIGNED=aligned,
                                          USE_ASM=cfg["asm"] and PTX_AVAILABLE, num_warps=1, **pdl, **common)
    _topk_select_v3_kernel[(rows,)](logits, lens, starts, out, cut, shift, hist, seg.view(torch.int64), counts,
                                    buf_keys, buf_pos, stride, **window, BLOCK=cfg["BLOCK"], CAP=cap, BITS=RADIX_BITS,
                                    TIES=cfg["TIES"], num_warps=select_warps, **pdl, **common)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                              next_n: int, num_pages: int, page_size: int) -> None:
    """Fill ``out [R, k]`` with cache slots of ``positions [R, k]``."""
    check_launch(positions.stride(1) == 1 and block_table.stride(1) == 1 and out.is_contiguous(),
                 "contiguous positions rows, block_table rows and out")
    block = 1024
    grid = (positions.shape[0], triton.cdiv(positions.shape[1], block))
    _positions_to_slots_kernel[grid](
        positions, block_table, out, positions.shape[1], positions.stride(0), block_table.stride(0),
        block_table.shape[1], num_pages, NEXT_N=next_n, PAGE=page_size, BLOCK=block, num_warps=4,
    )
