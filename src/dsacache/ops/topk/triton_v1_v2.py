"""The earlier top-k algorithms, kept selectable (``algo="v1"`` / ``"v2"``) for comparison.

A radix pass costs about one warp instruction an element, so a long row is first cut
down to a few thousand candidates. ``algo="v1"``, two launches:

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

``algo="v2"`` keeps the same contract and fallbacks but moves the sequential work off the
one-program-a-row path, in three launches:

1. ``_topk_cutoff_kernel`` (``triton_common``), one program a row: the cut-off key.
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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.ops.topk.triton_common import (
    CANDIDATES_PER_K, RADIX_BITS, _filter, _fill_tail, _histogram_cut, _key_to_float, _long_row,
    _narrow_bin_and_write, _row_setup, _row_window, _select_gathered, _select_short_row, _select_whole_row,
    _sortable_key, _topk_cutoff_kernel,
)
from dsacache.ops.triton_utils import check_launch, loop_bound


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

    if not _long_row(n, K, SAMPLES):
        _select_short_row(row_ptr, n, want, out_row, K, BLOCK, BITS)
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

    if not _long_row(n, K, SAMPLES):
        _select_short_row(row_ptr, n, want, out_row, K, BLOCK, BITS)
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


def topk_splits(rows: int, num_sms: int) -> int:
    """Programs a long row's v1 candidate search is split over: about half the SMs' worth of
    programs in all (measured best on an H200 at 64 rows: 2; at 256 rows: 1)."""
    return max(1, min(8, triton.next_power_of_2(triton.cdiv(num_sms, 2 * max(rows, 1)))))


def topk_splits_v2(rows: int, num_sms: int) -> int:
    """Programs a long row's v2 candidate search is split over: about 4 programs an SM in
    all (64 rows on 132 SMs: 8; 256 rows: 2), a power of two up to 16."""
    per_row = max(1, 4 * num_sms // max(rows, 1))
    return min(16, 1 << (per_row.bit_length() - 1))


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
