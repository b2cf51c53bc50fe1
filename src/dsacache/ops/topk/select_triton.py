"""Step 3, in Triton: the exact top k of each row from the filter's candidates.

One program a row. All its loads are issued up front (the first LOAD slots of each segment,
where the candidates sit; whole segments only when one holds more); the filter's histogram
names the chosen bin, whose few candidates (at most TIES) are ranked pairwise on (key,
position), else by radix passes; one prefix sum writes the output. The cases the sampled
path does not cover each have their own branch:

* a short row (``n <= max(k, 2 * SAMPLES)``, no cut-off): all of it, or the whole-row radix
  select;
* a missed cut-off (fewer than k candidates, or more than CAP): the whole-row radix select;
* a skewed row (a program over its CAP / PROGS share, e.g. logits growing with the
  position): gathered into a dense buffer from the segments and the pool blocks the filter
  put the rest in (``filter.pool_layout``), then selected like the rest.

On Hopper, for logits wider than the row kernel takes (``row_gluon``, which finishes every
row itself), the Gluon ballot select (``select_gluon``) runs first after the Triton filter and
takes the common row; this kernel then finishes only the rows it left (``SKIP_DONE``). Loops over radix passes are
runtime loops: the select is latency-bound, and straight-line code larger than the
instruction cache is slower.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsacache.ops.topk.filter import pool_cursor, pool_owners
from dsacache.ops.topk.keys import sortable_key
from dsacache.ops.topk.radix import exclusive_scan_2d, histogram_cut, narrow_bin_and_write, select_short_row, \
    select_whole_row
from dsacache.ops.topk.rows import long_row, row_setup
from dsacache.ops.triton_utils import INTERPRET, loop_bound

if not INTERPRET:
    from triton.language.extra.cuda import gdc_wait


@triton.jit
def topk_select_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 (from topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32 (from topk_filter_kernel)
    seg_ptr,          # [R, PROGS, CAP // PROGS] int64 (from topk_filter_kernel): pos << 32 | key
    counts_ptr,       # [R, PROGS] int32
    buf_keys_ptr,     # [R, CAP + TIES] int32 scratch: a skewed row's candidates, densely; the chosen bin's
    buf_pos_ptr,      # [R, CAP + TIES] int32 scratch
    pool_ptr,         # [R, POOL_ROW] int32 (from topk_filter_kernel): the candidates past each segment
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr, PROGS: tl.constexpr,
    BINS: tl.constexpr, BITS: tl.constexpr, TIES: tl.constexpr, PDL: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
    LOAD: tl.constexpr = 0,  # candidate slots of a segment loaded first (<= CAP // PROGS; launchers set it)
    done_ptr=None,  # [R] int32 (with SKIP_DONE): 1 for the rows the Gluon select already wrote, 2 for a skewed
                    # row whose candidates it left densely in buf_keys / buf_pos
    SKIP_DONE: tl.constexpr = False,
    TILE: tl.constexpr = 256,  # the filter's tile (32 V): the pool's block
    POOL: tl.constexpr = 0, POOL_ROW: tl.constexpr = 0,  # pool blocks and row words (filter.pool_layout)
):
    """One program a row: exact selection from the candidates in registers.

    A skewed row (a program found more than its CAP / PROGS share, e.g. logits that grow
    with the position) is gathered into a dense buffer (``_gather_skewed``: the segments and
    the pool blocks) and selected the same way; short rows and a missed
    cut-off take the radix select over the row. With SKIP_DONE, after the Gluon ballot select
    (``select_gluon``), only the rows it left (``done`` 0, or 2: a skewed row already gathered
    densely)."""
    row = tl.program_id(0)
    if PDL:
        gdc_wait()  # launched while the kernel before finished: its outputs are complete from here
    done = 0
    if SKIP_DONE:
        done = tl.load(done_ptr + row)
    if done != 1:
        _select_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_ptr, seg_ptr, counts_ptr,
                    buf_keys_ptr, buf_pos_ptr, pool_ptr + row.to(tl.int64) * POOL_ROW, row_stride, width, row,
                    done == 2, K, BLOCK, CAP, SAMPLES, PROGS, BINS, BITS, TIES, HAS_STARTS, LOAD, TILE, POOL)


@triton.jit
def _select_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_ptr, seg_ptr, counts_ptr,
                buf_keys_ptr, buf_pos_ptr, pool_row, row_stride, width, row, dense,
                K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
                PROGS: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr, TIES: tl.constexpr,
                HAS_STARTS: tl.constexpr, LOAD: tl.constexpr, TILE: tl.constexpr, POOL: tl.constexpr):
    """The body of ``topk_select_kernel`` for one row. ``dense``: the Gluon ballot select left this
    skewed row's candidates in the buffers already (``select_gluon._select_skewed``)."""
    SEG: tl.constexpr = CAP // PROGS
    LANES: tl.constexpr = 128
    # Every load the register path needs is issued here, before anything waits on another
    # (for a row that turns out short they are unused; the scratch past a count is garbage,
    # masked below).
    counts = tl.load(counts_ptr + row * PROGS + tl.arange(0, PROGS))
    cut = tl.load(cut_ptr + row).to(tl.uint32, bitcast=True)
    shift = tl.load(shift_ptr + row)
    hist = tl.load(hist_ptr + row.to(tl.int64) * BINS + tl.arange(0, BINS))
    # Only the first LOAD slots of each segment (most hold ~1/3 of SEG, the rest is empty):
    # half the candidate work when no segment is fuller; the whole segments otherwise.
    lane = tl.arange(0, LOAD)[None, :]
    seg_row = seg_ptr + row.to(tl.int64) * CAP + tl.arange(0, PROGS)[:, None] * SEG
    pair = tl.load(seg_row + lane)
    keys = pair.to(tl.int32)  # the low word (the filter stores key, pos in that order)
    pos = (pair >> 32).to(tl.int32)
    n, row_ptr = row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if not long_row(n, K, SAMPLES):
        select_short_row(row_ptr, n, want, out_row, K, BLOCK, BITS)
    else:
        total = tl.sum(counts, axis=0)
        buf_keys = buf_keys_ptr + row.to(tl.int64) * (CAP + TIES)
        buf_pos = buf_pos_ptr + row.to(tl.int64) * (CAP + TIES)
        if (total < want) | (total > CAP):
            select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)  # the cut-off missed
        elif tl.max(counts, axis=0) <= LOAD:
            _select_candidates(keys, pos, lane < counts[:, None], hist, cut, shift, want, out_row, buf_keys,
                               buf_pos, BITS, TIES)
        elif (LOAD < SEG) & (tl.max(counts, axis=0) <= SEG):
            full = tl.arange(0, SEG)[None, :]
            whole = tl.load(seg_row + full)
            _select_candidates(whole.to(tl.int32), (whole >> 32).to(tl.int32), full < counts[:, None], hist, cut,
                               shift, want, out_row, buf_keys, buf_pos, BITS, TIES)
        else:
            j = tl.arange(0, CAP // LANES)[:, None] * LANES + tl.arange(0, LANES)[None, :]
            live = j < total
            if not dense:
                _gather_skewed(counts, seg_row, pool_row, buf_keys, buf_pos, SEG, PROGS, TILE, POOL)
                tl.debug_barrier()  # the buffer was written by other threads of this program
            # buf_keys doubles as the chosen bin's scratch: past the candidates
            _select_candidates(tl.load(buf_keys + j, mask=live, other=0), tl.load(buf_pos + j, mask=live, other=-1),
                               live, hist, cut, shift, want, out_row, buf_keys + total, buf_pos + total, BITS, TIES)
    _fill_tail(out_row, want, K, BLOCK)


@triton.jit
def _select_candidates(keys, pos, valid, hist, cut, shift, want, out_row, scratch_keys, scratch_pos,
                       BITS: tl.constexpr, TIES: tl.constexpr):
    """Exact top ``want`` of the candidates ``keys`` / ``pos`` (2-D int32 tiles, row-major in
    position order, ``valid`` where there is one), written in position order.

    The candidates become distances above the cut-off; the filter's histogram of
    ``dist >> shift`` (``hist``, the last bin open) names the bin holding the want-th largest.
    A bin of at most TIES candidates is ranked pairwise, a larger one (ties) by radix passes."""
    BINS: tl.constexpr = hist.numel
    chosen, left, in_bin = histogram_cut(hist, want)
    dist = keys.to(tl.uint32, bitcast=True) - cut
    bin_ = tl.minimum(dist >> shift, BINS - 1).to(tl.int32)
    in_chosen = valid & (bin_ == chosen)
    if (left == in_bin) | (in_bin <= TIES):
        if left == in_bin:
            take = valid & (bin_ >= chosen)
        else:
            cut_d, cut_p = _cut_in_bin(dist, pos, in_chosen, in_bin, left, scratch_keys, scratch_pos, TIES)
            take = valid & ((bin_ > chosen) | (in_chosen & ((dist > cut_d) | ((dist == cut_d) & (pos <= cut_p)))))
        tl.store(out_row + exclusive_scan_2d(take.to(tl.int32)), pos, mask=take)
    else:
        narrow_bin_and_write(dist, pos, valid, in_chosen, chosen, left, in_bin, shift, out_row, BINS, BITS)


@triton.jit
def _cut_in_bin(dist, pos, in_chosen, in_bin, left, scratch_keys, scratch_pos, TIES: tl.constexpr):
    """The ``left``-th of the ``in_bin`` (at most TIES) candidates flagged ``in_chosen``, in
    the order distance (largest first) then position (lowest first), as (dist, pos): the
    flagged candidates ranking at or above it are taken. They are compacted to scratch and
    ranked pairwise."""
    at = exclusive_scan_2d(in_chosen.to(tl.int32))
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
def _gather_skewed(counts, seg_row, pool_row, buf_keys, buf_pos, SEG: tl.constexpr, PROGS: tl.constexpr,
                   BS: tl.constexpr, POOL: tl.constexpr):
    """A skewed row's candidates, densely and in position order, into the buffers: program p's
    at the prefix sum of the counts before it, its first SEG from its segment, the rest from its
    pool blocks (``filter.pool_layout``), which it took in position order. The caller has
    checked that the row's candidates fit CAP, so the pool held them all."""
    offsets = tl.cumsum(counts, axis=0) - counts
    lane = tl.arange(0, SEG)[None, :]
    kept = lane < tl.minimum(counts, SEG)[:, None]
    pair = tl.load(seg_row + lane, mask=kept)
    tl.store(buf_keys + offsets[:, None] + lane, pair.to(tl.int32), mask=kept)
    tl.store(buf_pos + offsets[:, None] + lane, (pair >> 32).to(tl.int32), mask=kept)
    progs = tl.arange(0, PROGS)
    held = tl.zeros([PROGS], tl.int32)  # pool blocks of each program copied so far
    pairs = pool_row.to(tl.pointer_type(tl.int64))
    slot = tl.arange(0, BS)
    for b in range(loop_bound(tl.minimum(tl.load(pool_row + pool_cursor(POOL, BS)), POOL))):
        mine = progs == tl.load(pool_row + pool_owners(POOL, BS) + b)
        first = SEG + BS * tl.sum(tl.where(mine, held, 0), axis=0)  # the block's first slot in its program
        at = tl.sum(tl.where(mine, offsets, 0), axis=0) + first
        live = first + slot < tl.sum(tl.where(mine, counts, 0), axis=0)
        found = tl.load(pairs + b * BS + slot, mask=live)
        tl.store(buf_keys + at + slot, found.to(tl.int32), mask=live)
        tl.store(buf_pos + at + slot, (found >> 32).to(tl.int32), mask=live)
        held += mine.to(tl.int32)


@triton.jit
def _fill_tail(out_row, want, K: tl.constexpr, BLOCK: tl.constexpr):
    """-1 in out_row[want:K]."""
    lanes = tl.arange(0, BLOCK)
    for c in range(0, K, BLOCK):
        idx = c + lanes
        tl.store(out_row + idx, tl.full([BLOCK], -1, tl.int32), mask=(idx >= want) & (idx < K))
