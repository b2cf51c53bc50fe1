"""The select step on Hopper, in Gluon: warp ballots instead of tile-wide scans. ``ballot_select``
is step 3 of the row kernel (``row_gluon.py``) and, in ``topk_select_ballot_kernel``, of the
three-kernel path after the Triton filter.

The Triton select (``select_triton.py``) works on a [segments, slots] tile whose scans and
reductions Triton lays out for itself, which costs many instructions a warp and spills.
Here the candidates are 32-slot chunks, one warp a run of consecutive chunks and one lane a
slot, so:

* a chunk's count and each lane's place in it are a ``vote.ballot`` and two ``popc``
  (no shuffles), and the running offsets over a warp's chunks are a scan over its own
  registers; only the per-warp totals cross warps;
* the chosen bin's candidates (at most TIES) are compacted by the same offsets into a
  scratch buffer and ranked pairwise on (distance, position), as in the Triton kernel;
* every taken position is written in position order, as the Triton kernel does, so the
  output is the same, element for element.
* the row's candidate histogram lives in shared memory (``histogram_buffer``): the row
  kernel's filter counts into it, the ballot kernel counts the candidates it loads. Gluon has
  no shared-memory atomics, so PTX ``red.shared`` adds to the buffer at the offset the
  compiler gave it (``triton_utils.shared_buffer_offset``, passed in as ``hist_smem``).
  Global atomics a candidate cost an L2 transaction each and made the filter the slower
  (docs/benchmarks.md, "Top-k 2048").

It handles the common row only: a long row whose cut-off kept between k and CAP
candidates and no segment fuller than LOAD, and a chosen bin taken whole or holding at most
TIES candidates; in the row kernel also a fuller chosen bin (heavy ties), cut by radix passes
over its candidates. (After the Triton filter, at 64K and 128K, those passes were 7-20 us
slower than the Triton select's on rows of 50 integer values, so that kernel leaves the row.)
The row kernel selects the rest itself. ``topk_select_ballot_kernel`` also takes a skewed row
(some segment past SEG: its candidates bunched in a few filter slices) with between k and CAP
candidates: gathered densely, in position order, into the Triton select's buffers (the segments
and the pool blocks the filter put the rest in, ``filter.pool_layout``), then ``ballot_select``
over that list (``_select_skewed``). It marks the rows it takes ``done`` (1; 2 for a skewed row it
gathered but leaves, its chosen bin past TIES) and the Triton select, launched after it, selects
the rest (``SKIP_DONE``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import triton

from dsacache.ops.topk.cutoff import bit_length
from dsacache.ops.topk.filter import pool_cursor, pool_owners
from dsacache.ops.topk.keys import key_to_float, sortable_key, sortable_key_not_nan
from dsacache.ops.topk.rows import long_row, row_window

# (candidates in the chunk, lanes before this one holding one) from a 0/1 flag a lane.
_BALLOT_ASM = gl.constexpr("""{
.reg .pred p;
.reg .b32 m, lt;
setp.ne.s32 p, $2, 0;
vote.sync.ballot.b32 m, p, -1;
popc.b32 $0, m;
mov.u32 lt, %lanemask_lt;
and.b32 lt, lt, m;
popc.b32 $1, lt;
}""")


# hist[$2] += 1 in shared memory where $3 is not 0 ($1: the histogram's shared-memory address).
_COUNT_SHARED_ASM = gl.constexpr("""{
.reg .pred p;
.reg .b32 a;
setp.ne.s32 p, $3, 0;
mad.lo.u32 a, $2, 4, $1;
@p red.shared.add.u32 [a], 1;
mov.b32 $0, 0;
}""")


# A row's window and whether it is long: the Triton path's rules, compiled by Gluon.
_row_window = gluon.jit(row_window.fn)
_long_row = gluon.jit(long_row.fn)
_pool_cursor = gluon.jit(pool_cursor.fn)
_pool_owners = gluon.jit(pool_owners.fn)
_bit_length = gluon.jit(bit_length.fn)
_sortable_key = gluon.jit(sortable_key.fn)
_sortable_key_not_nan = gluon.jit(sortable_key_not_nan.fn)
_key_to_float = gluon.jit(key_to_float.fn)


@gluon.jit
def fill_unused(out_row, want, K: gl.constexpr, BLOCK: gl.constexpr, layout: gl.constexpr):
    """``-1`` in a row's output slots ``[want, K)``, BLOCK slots a step (``layout``: BLOCK of them)."""
    lanes = gl.arange(0, BLOCK, layout=layout)
    for c in gl.static_range(0, K, BLOCK):
        idx = c + lanes
        gl.store(out_row + idx, gl.full([BLOCK], -1, gl.int32, layout), mask=(idx >= want) & (idx < K))


@gluon.jit
def _ballot_counts(flag):
    """``flag`` [chunks, 32 lanes] (int32 0/1, a warp a chunk row) -> (chunk count, lanes before)."""
    return gl.inline_asm_elementwise(_BALLOT_ASM, "=r,=r,r", [flag], dtype=(gl.int32, gl.int32), is_pure=True,
                                     pack=1)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _exclusive_over_chunks(counts):
    """Exclusive prefix sum over axis 0 of [chunks, 32] (every lane of a row holds the same count)."""
    return gl.associative_scan(counts, 0, _add) - counts


@gluon.jit
def _histogram_cut(hist, want, HL: gl.constexpr):
    """(chosen bin, candidates to take from it, candidates in it) for the want-th largest."""
    bins = gl.arange(0, hist.shape[0], layout=HL)
    at_least = gl.sum(hist, axis=0) - gl.associative_scan(hist, 0, _add) + hist
    chosen = gl.sum((at_least >= want).to(gl.int32), axis=0) - 1
    in_bin = gl.sum(gl.where(bins == chosen, hist, 0), axis=0)
    above = gl.sum(gl.where(bins > chosen, hist, 0), axis=0)
    return chosen, want - above, in_bin


@gluon.jit
def _candidate_bin(dist, shift, BINS: gl.constexpr):
    """A candidate's histogram bin from its distance above the cut-off (the last bin open), as
    the filter counts it."""
    return gl.minimum(dist >> shift, BINS - 1).to(gl.int32)


@gluon.jit
def _tie_cut_keeps(dist, pos, cut_d, cut_p):
    """Whether a candidate of the chosen bin ranks at or above the tie cut (cut_d, cut_p) in the
    order distance (largest first) then position (lowest first)."""
    return (dist > cut_d) | ((dist == cut_d) & (pos <= cut_p))


@gluon.jit
def _taken(bin_, dist, pos, chosen, cut_d, cut_p):
    """Whether a candidate is among the top: above the chosen bin, or in it and kept by the tie cut."""
    return (bin_ > chosen) | ((bin_ == chosen) & _tie_cut_keeps(dist, pos, cut_d, cut_p))


@gluon.jit
def shared_address(offset):
    """The shared-memory address of the buffer at byte ``offset`` of the kernel's shared memory
    (``triton_utils.shared_buffer_offset``), for PTX that updates it."""
    return gl.inline_asm_elementwise("mov.u32 $0, global_smem;\nadd.u32 $0, $0, $1;", "=r,r", [offset],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.constexpr_function
def _histogram_layout(bins, warps):
    """The candidate histogram [W, BINS / W] in registers: warp w holds bins [w BINS / W, (w + 1) BINS / W)."""
    return gl.BlockedLayout([1, bins // warps // 32], [1, 32], [warps, 1], [1, 0])


@gluon.jit
def histogram_buffer(BINS: gl.constexpr, W: gl.constexpr):
    """A zeroed candidate histogram in shared memory, [W, BINS / W] (bin b at row b // (BINS / W),
    byte 4 b), for ``_candidate_bin_cut``. Assign it to ``hist_buf``: the launcher finds its
    offset by that name (``launch._hist_offset``)."""
    return gl.allocate_shared_memory(gl.int32, [W, BINS // W], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                                     gl.zeros([W, BINS // W], gl.int32, _histogram_layout(BINS, W)))


@gluon.jit
def count_bins_shared(address, bins, flag):
    """Count each ``bins`` value where ``flag`` into the shared-memory histogram at ``address``
    (one ``red.shared`` a value; the caller's barrier makes the counts visible)."""
    gl.inline_asm_elementwise(_COUNT_SHARED_ASM, "=r,r,r,r", [gl.zeros_like(bins) + address, bins, flag.to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _candidate_bin_cut(hist_buf, want, BINS: gl.constexpr, W: gl.constexpr):
    """``_histogram_cut`` of the row's candidate histogram (``histogram_buffer``, in shared memory)
    with one CTA barrier: warp w sums bins [w BINS / W, (w + 1) BINS / W); every thread takes the
    W sums to find the warp range holding the want-th largest; each warp then loads that range
    again and cuts it with warp-local scans. (``_histogram_cut`` over all BINS takes a CTA-wide
    reduction or scan, each with its barriers, for every one of its five steps.)"""
    PER: gl.constexpr = BINS // W
    L2: gl.constexpr = _histogram_layout(BINS, W)                                 # warp w: range w
    WL: gl.constexpr = gl.BlockedLayout([W], [32], [W], [0])                      # all W sums in each thread
    RL: gl.constexpr = gl.BlockedLayout([PER // 32], [32], [W], [0])               # one range in each warp
    sums = gl.convert_layout(gl.sum(hist_buf.load(L2), axis=1), WL)
    w = gl.arange(0, W, layout=WL)
    above = gl.sum(sums, axis=0) - gl.associative_scan(sums, 0, _add)   # in the ranges after w
    chosen_w = gl.maximum(gl.sum((above + sums >= want).to(gl.int32), axis=0) - 1, 0)
    above_w = gl.sum(gl.where(w == chosen_w, above, 0), axis=0)
    # [W, 1, PER]: indexing the leading dimension needs a layout of one rank less
    ranges = hist_buf._reinterpret(gl.int32, [W, 1, PER], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    part = gl.convert_layout(gl.sum(ranges.index(chosen_w).load(L2), axis=0), RL)  # [1, PER] a warp: no moves
    within, left, in_bin = _histogram_cut(part, want - above_w, RL)
    return chosen_w * PER + within, left, in_bin


@gluon.jit
def _tie_cut(tie_keys, tie_pos, in_bin, left, TIES: gl.constexpr, num_warps: gl.constexpr):
    """The ``left``-th of the ``in_bin`` scratch candidates in the order distance (largest
    first) then position (lowest first), as (distance, position)."""
    PL: gl.constexpr = gl.BlockedLayout([1, TIES // 32], [1, 32], [num_warps, 1], [1, 0])
    i = gl.arange(0, TIES, layout=gl.SliceLayout(1, PL))
    j = gl.arange(0, TIES, layout=gl.SliceLayout(0, PL))
    di = gl.load(tie_keys + i, mask=i < in_bin, other=0).to(gl.uint32, bitcast=True)
    pi = gl.load(tie_pos + i, mask=i < in_bin, other=0)
    dj = gl.load(tie_keys + j, mask=j < in_bin, other=0).to(gl.uint32, bitcast=True)
    pj = gl.load(tie_pos + j, mask=j < in_bin, other=0)
    ahead = (i < in_bin)[:, None] & ((di[:, None] > dj[None, :]) | ((di[:, None] == dj[None, :]) &
                                                                      (pi[:, None] < pj[None, :])))
    rank = gl.sum(ahead.to(gl.int32), axis=0)
    pick = (j < in_bin) & (rank == left - 1)
    return gl.max(gl.where(pick, dj, 0), axis=0), gl.max(gl.where(pick, pj, -1), axis=0)


@gluon.jit
def radix_digits(keys, mask, prefix, top, shift, BITS: gl.constexpr):
    """One radix pass: which keys under ``mask`` share ``prefix``'s bits at and above ``top``, and
    each key's BITS-bit digit at ``shift`` (as int32 bins)."""
    high = ((0xFFFFFFFF << top.to(gl.int64)) & 0xFFFFFFFF).to(gl.uint32)
    match = mask & (((keys ^ prefix) & high) == 0)
    return match, ((keys >> shift.to(gl.uint32)) & ((1 << BITS) - 1)).to(gl.int32)


@gluon.jit
def chosen_bin_prefix(chosen, shift, BINS: gl.constexpr):
    """(prefix, top) of the distances in candidate histogram bin ``chosen`` (bins of ``dist >> shift``):
    they share the bits from ``shift`` up, except in the last bin, which is open."""
    last = chosen == BINS - 1
    return gl.where(last, 0, chosen << shift).to(gl.uint32), gl.where(last, 32, shift)


@gluon.jit
def radix_narrow(keys, mask, count, need, prefix, top, slack, BITS: gl.constexpr, PASSES: gl.constexpr,
                 layout: gl.constexpr, SKIP_SHARED: gl.constexpr = False):
    """Narrow down to the ``need``-th largest of the uint32 ``keys`` (1-D) under ``mask``: the rule
    of the Triton path's ``radix.radix_narrow``. The ``count`` masked keys share their bits at and
    above ``top`` with ``prefix`` (whose lower bits are 0); each of at most PASSES passes fixes the
    next BITS bits from a histogram (``layout``: one for 2**BITS bins). Returns ``(prefix, need,
    whole)``: the top ``need`` are the keys above ``prefix`` plus the first ``need`` equal to it,
    or, when ``whole``, every key ``>= prefix`` (a bin taken whole or holding at most ``slack``).

    SKIP_SHARED first fixes every bit the masked keys share (from their maximum and minimum, two
    reductions) instead of a pass for each BITS of them: the same result, and no pass at all for
    keys that are all equal (heavy ties of one value)."""
    BINS: gl.constexpr = 1 << BITS
    whole = (need == count) | (count <= slack)
    done = whole | (top == 0)
    if SKIP_SHARED:
        if not done:
            high_key = gl.max(gl.where(mask, keys, 0), axis=0)
            low_key = gl.min(gl.where(mask, keys, 0xFFFFFFFF), axis=0)
            # bit_length may be one too many: it then fixes one bit fewer, never a differing one
            top = gl.minimum(top, _bit_length(high_key ^ low_key))
            prefix = high_key & ((0xFFFFFFFF << top.to(gl.int64)) & 0xFFFFFFFF).to(gl.uint32)
            done = top == 0
    for _ in range(PASSES):  # a runtime loop: one copy of the pass in the code
        if not done:
            shift = gl.maximum(top - BITS, 0)
            match, digit = radix_digits(keys, mask, prefix, top, shift, BITS)
            hist = gl.histogram(digit, BINS, mask=match, layout=layout)
            chosen, need, in_bin = _histogram_cut(hist, need, layout)
            prefix = prefix | (chosen.to(gl.uint32) << shift.to(gl.uint32))
            top = shift
            whole = (need == in_bin) | (in_bin <= slack)
            done = whole | (top == 0)
    return prefix, need, whole


@gluon.jit
def _narrow_chosen_bin(seg_row, counts_row, cut, shift, chosen, left, in_bin, PROGS: gl.constexpr,
                       SEG: gl.constexpr, LOAD: gl.constexpr, BINS: gl.constexpr, BITS: gl.constexpr):
    """A chosen bin of more than TIES candidates (heavy ties): radix passes over its candidates'
    distances for the ``left``-th largest, as ``(cut_d, ties, whole)`` (``radix_narrow``). The
    candidates are loaded again from the segments (L2) in a 1-D layout, which the histogram takes."""
    W: gl.constexpr = gl.num_warps()
    SLOTS: gl.constexpr = PROGS * LOAD
    FLAT: gl.constexpr = gl.BlockedLayout([SLOTS // (32 * W)], [32], [W], [0])
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    i = gl.arange(0, SLOTS, layout=FLAT)
    seg_of = i // LOAD
    slot = i % LOAD
    pair = gl.load(seg_row + seg_of * SEG + slot)
    valid = slot < gl.load(counts_row + seg_of)
    dist = pair.to(gl.int32).to(gl.uint32, bitcast=True) - cut
    in_chosen = valid & (_candidate_bin(dist, shift, BINS) == chosen)
    prefix, top = chosen_bin_prefix(chosen, shift, BINS)
    return radix_narrow(dist, in_chosen, in_bin, left, prefix, top, 0, BITS, (32 + BITS - 1) // BITS, RL, True)


@gluon.jit
def _load_candidates(seg_row, pos_row, idx, SPLIT: gl.constexpr):
    """(key, position) int32 of the candidates at ``idx``: from the filter's packed pairs
    (pos << 32 | key) at ``seg_row`` or, SPLIT, from keys at ``seg_row`` and positions at ``pos_row``."""
    if SPLIT:
        key = gl.load(seg_row + idx)
        pos = gl.load(pos_row + idx)
    else:
        pair = gl.load(seg_row + idx)
        key = pair.to(gl.int32)
        pos = (pair >> 32).to(gl.int32)
    return key, pos


@gluon.jit
def ballot_select(n, cut, shift, hist_buf, seg_row, counts_row, tie_keys, tie_pos, out_row,
                  K: gl.constexpr, PROGS: gl.constexpr, SEG: gl.constexpr, LOAD: gl.constexpr, CAP: gl.constexpr,
                  BINS: gl.constexpr, TIES: gl.constexpr, BITS: gl.constexpr, NARROW: gl.constexpr,
                  COUNT: gl.constexpr = False, hist_addr=0, pos_row=0, SPLIT: gl.constexpr = False):
    """The exact top ``min(n, K)`` of one long row from its filtered candidates, written to
    ``out_row`` in position order, if the row is a common one; returns whether it was.

    ``cut`` / ``shift``: the row's (lowered) cut-off key and bin shift; ``hist_buf``: the row's
    candidate histogram in shared memory (``histogram_buffer``), which, with COUNT, this counts
    first from the candidates it loads (at ``hist_addr``), else the filter counted;
    ``seg_row`` [PROGS, SEG] int64 (pos << 32 | key) and ``counts_row`` [PROGS]: what the
    filter wrote, complete and visible to this program (SPLIT: keys int32 at ``seg_row``,
    positions at ``pos_row``, ``_load_candidates``; not with NARROW); ``tie_keys`` / ``tie_pos``: TIES
    slots of scratch. A chosen bin of at most TIES candidates is ranked pairwise, a fuller one
    (heavy ties), with NARROW, by radix passes of BITS bits over its candidates (without, the
    row is left). Nothing is written for a row it does not take."""
    W: gl.constexpr = gl.num_warps()
    CPS: gl.constexpr = LOAD // 32                 # chunks a segment
    NCH: gl.constexpr = PROGS * CPS
    # Warp w: chunks [w NCH / W, (w + 1) NCH / W) in its registers, lane l: slot l of each.
    CH: gl.constexpr = gl.BlockedLayout([NCH // W, 1], [1, 32], [W, 1], [1, 0])
    ch = gl.arange(0, NCH, layout=gl.SliceLayout(1, CH))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, CH))
    seg_of = ch // CPS
    slot = (ch % CPS)[:, None] * 32 + lane[None, :]
    # Every load first, none masked by another's value (slots past a count hold garbage, masked below).
    key, pos = _load_candidates(seg_row, pos_row, (seg_of * SEG)[:, None] + slot, SPLIT)
    count = gl.load(counts_row + seg_of)
    want = gl.minimum(n, K)
    total = gl.sum(count, axis=0) // CPS           # each segment's count is held by its CPS chunks
    if COUNT:  # the filter did not count: the loaded candidates into the shared histogram
        count_bins_shared(hist_addr, _candidate_bin(key.to(gl.uint32, bitcast=True) - cut, shift, BINS),
                          slot < count[:, None])
        gl.thread_barrier()
    chosen, left, in_bin = _candidate_bin_cut(hist_buf, want, BINS, W)
    fast = (total >= want) & (total <= CAP) & (gl.max(count, axis=0) <= LOAD)
    if not NARROW:
        fast = fast & ((left == in_bin) | (in_bin <= TIES))
    if fast:
        valid = slot < count[:, None]
        dist = key.to(gl.uint32, bitcast=True) - cut
        bin_ = _candidate_bin(dist, shift, BINS)
        if left == in_bin:
            take = valid & (bin_ >= chosen)
        elif NARROW and in_bin > TIES:
            cut_d, ties, whole = _narrow_chosen_bin(seg_row, counts_row, cut, shift, chosen, left, in_bin, PROGS,
                                                    SEG, LOAD, BINS, BITS)
            # Above the cut, then the first `ties` equal to it in position order (all of them if whole).
            tie = valid & (dist == cut_d)
            cnt, before = _ballot_counts(tie.to(gl.int32))
            rank = _exclusive_over_chunks(cnt) + before
            take = valid & ((dist > cut_d) | (tie & (whole | (rank < ties))))
        else:
            in_chosen = valid & (bin_ == chosen)
            cnt, before = _ballot_counts(in_chosen.to(gl.int32))
            at = _exclusive_over_chunks(cnt) + before
            gl.store(tie_keys + at, dist.to(gl.int32, bitcast=True), mask=in_chosen)
            gl.store(tie_pos + at, pos, mask=in_chosen)
            gl.thread_barrier()  # the scratch was written by other warps
            cut_d, cut_p = _tie_cut(tie_keys, tie_pos, in_bin, left, TIES, W)
            take = valid & _taken(bin_, dist, pos, chosen, cut_d, cut_p)
        cnt, before = _ballot_counts(take.to(gl.int32))
        at = _exclusive_over_chunks(cnt) + before
        gl.store(out_row + at, pos, mask=take)
    return fast


@gluon.jit
def _count_past_load(seg_row, counts_row, cut, shift, hist_addr, PROGS: gl.constexpr, SEG: gl.constexpr,
                     LOAD: gl.constexpr, CAP: gl.constexpr, BINS: gl.constexpr):
    """For a row ``ballot_select`` (with COUNT) left with no segment past SEG: the stored
    candidates past the first LOAD slots of each segment, which it did not load, into the
    shared histogram at ``hist_addr``."""
    W: gl.constexpr = gl.num_warps()
    BLOCK: gl.constexpr = 4 * 32 * W
    BL: gl.constexpr = gl.BlockedLayout([4], [32], [W], [0])
    lanes = gl.arange(0, BLOCK, layout=BL)
    for b in range(CAP // BLOCK):
        i = b * BLOCK + lanes
        found = gl.load(counts_row + i // SEG)
        live = (i % SEG >= LOAD) & (i % SEG < found)
        key = gl.load(seg_row + i, mask=live, other=0).to(gl.int32)
        count_bins_shared(hist_addr, _candidate_bin(key.to(gl.uint32, bitcast=True) - cut, shift, BINS), live)


@gluon.jit
def _write_histogram(hist_buf, hist_row, BINS: gl.constexpr):
    """The shared histogram, complete, to ``hist_row`` (global) for the Triton select."""
    W: gl.constexpr = gl.num_warps()
    PER: gl.constexpr = BINS // W
    L2: gl.constexpr = _histogram_layout(BINS, W)
    gl.thread_barrier()  # every count before the histogram is read
    rng = gl.arange(0, W, layout=gl.SliceLayout(1, L2))[:, None] * PER
    gl.store(hist_row + rng + gl.arange(0, PER, layout=gl.SliceLayout(0, L2))[None, :], hist_buf.load(L2))


@gluon.jit
def _dense_stored(seg_row, counts_row, cut, shift, hist_addr, dense_keys, dense_pos, PROGS: gl.constexpr,
                  SEG: gl.constexpr, TILE_SLOTS: gl.constexpr, CAP: gl.constexpr, BINS: gl.constexpr):
    """The candidates every segment holds (its first SEG at most), counted into the shared
    histogram and copied to their places in the row's dense list (keys at ``dense_keys``,
    positions at ``dense_pos``); the places of a segment's candidates past SEG, in the pool, are
    left for ``_dense_pool``. Tiles of TILE_SLOTS (as in ``ballot_select``: 32-slot chunks, one
    warp a run of chunks), CAP / TILE_SLOTS of them."""
    W: gl.constexpr = gl.num_warps()
    CPS: gl.constexpr = SEG // 32
    NCH: gl.constexpr = TILE_SLOTS // 32
    CH: gl.constexpr = gl.BlockedLayout([NCH // W, 1], [1, 32], [W, 1], [1, 0])
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, CH))[None, :]
    placed = cut.to(gl.int32) * 0  # candidates of the tiles before
    for t in range(CAP // TILE_SLOTS):
        ch = t * NCH + gl.arange(0, NCH, layout=gl.SliceLayout(1, CH))
        first = (ch % CPS) * 32
        count = gl.load(counts_row + ch // CPS)
        held = gl.minimum(gl.maximum(gl.minimum(count, SEG) - first, 0), 32)
        # a segment's last chunk also spans the places of its pool part
        width = held + gl.where(first == SEG - 32, gl.maximum(count - SEG, 0), 0)
        zero = gl.zeros([NCH, 32], gl.int32, CH)
        valid = lane < zero + held[:, None]
        idx = ((ch // CPS) * SEG + first)[:, None] + lane
        key, pos = _load_candidates(seg_row, 0, idx, False)
        count_bins_shared(hist_addr, _candidate_bin(key.to(gl.uint32, bitcast=True) - cut, shift, BINS), valid)
        at = placed + _exclusive_over_chunks(zero + width[:, None]) + lane
        gl.store(dense_keys + at, key, mask=valid)
        gl.store(dense_pos + at, pos, mask=valid)
        placed += gl.sum(width, axis=0)


@gluon.constexpr_function
def _next_power_of_2(n):
    return triton.next_power_of_2(n)


@gluon.jit
def _dense_pool(pool_row, counts_row, cut, shift, hist_addr, dense_keys, dense_pos, PROGS: gl.constexpr,
                SEG: gl.constexpr, BS: gl.constexpr, POOL: gl.constexpr, BINS: gl.constexpr):
    """The candidates in the row's pool blocks (``filter.pool_layout``), counted into the shared
    histogram and copied to their places in the dense list: program p's r-th block holds its
    candidates from slot SEG + r BS on (it took its blocks in position order), placed after all
    candidates of the programs before p. A warp a block, W blocks a step."""
    W: gl.constexpr = gl.num_warps()
    PB: gl.constexpr = _next_power_of_2(POOL)
    L2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [W, 1], [1, 0])
    BL: gl.constexpr = gl.BlockedLayout([1, BS // 32], [1, 32], [W, 1], [1, 0])
    owner_of = pool_row + _pool_owners(POOL, BS)
    used = gl.minimum(gl.load(pool_row + _pool_cursor(POOL, BS)), POOL)
    j = gl.arange(0, PB, layout=gl.SliceLayout(0, L2))
    owners = gl.load(owner_of + j, mask=j < used, other=-1)[None, :]
    q = gl.arange(0, PROGS, layout=gl.SliceLayout(0, L2))
    counts = gl.load(counts_row + q)[None, :]
    slot = gl.arange(0, BS, layout=gl.SliceLayout(0, BL))[None, :]
    pairs = pool_row.to(gl.pointer_type(gl.int64))
    for c in range(gl.cdiv(used, W)):
        b = c * W + gl.arange(0, W, layout=gl.SliceLayout(1, L2))
        owner = gl.load(owner_of + b, mask=b < used, other=-1)[:, None]
        rank = gl.sum(((j[None, :] < b[:, None]) & (owners == owner)).to(gl.int32), axis=1)
        before = gl.sum(gl.where(q[None, :] < owner, counts, 0), axis=1)
        first = SEG + BS * rank
        held = gl.sum(gl.where(q[None, :] == owner, counts, 0), axis=1) - first  # <= 0 past the used blocks
        at = gl.convert_layout(before + first, gl.SliceLayout(1, BL))[:, None]
        held = gl.convert_layout(held, gl.SliceLayout(1, BL))[:, None]
        bb = gl.convert_layout(gl.minimum(b, POOL - 1), gl.SliceLayout(1, BL))[:, None]  # in the pool, unmasked
        valid = slot < held
        key, pos = _load_candidates(pairs, 0, bb * BS + slot, False)
        count_bins_shared(hist_addr, _candidate_bin(key.to(gl.uint32, bitcast=True) - cut, shift, BINS), valid)
        gl.store(dense_keys + at + slot, key, mask=valid)
        gl.store(dense_pos + at + slot, pos, mask=valid)


@gluon.jit
def _select_skewed(n, cut, shift, hist_buf, hist_addr, seg_row, counts_row, pool_row, dense_keys, dense_pos,
                   total_cell, out_row, K: gl.constexpr, PROGS: gl.constexpr, SEG: gl.constexpr, LOAD: gl.constexpr,
                   CAP: gl.constexpr, BINS: gl.constexpr, TIES: gl.constexpr, BS: gl.constexpr,
                   POOL: gl.constexpr):
    """A skewed row (some filter program found more than SEG candidates, e.g. logits growing with
    the position) with between k and CAP candidates: its candidates gathered densely, in position
    order, into ``dense_keys`` / ``dense_pos`` (the Triton select's buffers, rows of CAP + TIES;
    ``_dense_stored`` from the segments, ``_dense_pool`` from the pool blocks of BS the filter put
    the rest in), the histogram counted from nothing on the way, then ``ballot_select`` over the
    dense list as one segment, PROGS x LOAD slots loaded (the common row's tile: no more
    registers), the chosen bin ranked in the scratch after the list. ``total_cell``: an int32 the
    list's length passes through. Returns 1 if that took the row (written to ``out_row``), else 2:
    the dense list and the histogram are left for the Triton select (more candidates than that
    tile, or a chosen bin of more than TIES)."""
    W: gl.constexpr = gl.num_warps()
    PL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    gl.thread_barrier()  # every warp past its reads of the histogram the first select counted
    hist_buf.store(gl.zeros([W, BINS // W], gl.int32, _histogram_layout(BINS, W)))
    gl.thread_barrier()  # zeroed before any thread counts
    _dense_stored(seg_row, counts_row, cut, shift, hist_addr, dense_keys, dense_pos, PROGS, SEG, PROGS * LOAD, CAP,
                  BINS)
    _dense_pool(pool_row, counts_row, cut, shift, hist_addr, dense_keys, dense_pos, PROGS, SEG, BS, POOL, BINS)
    total = gl.sum(gl.load(counts_row + gl.arange(0, PROGS, layout=PL)), axis=0)
    gl.store(total_cell, total)
    gl.thread_barrier()  # the dense list, its length and the histogram complete
    fast = ballot_select(n, cut, shift, hist_buf, dense_keys, total_cell, dense_keys + total, dense_pos + total,
                         out_row, K, 1, CAP, PROGS * LOAD, CAP, BINS, TIES, 0, False, False, 0, dense_pos, True)
    return 2 - fast.to(gl.int32)


@gluon.jit(do_not_specialize=["hist_smem"])
def topk_select_ballot_kernel(
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 (from topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32 out: the candidate histogram of each row left to the Triton select
    seg_ptr,          # [R, PROGS, SEG] int64 (from topk_filter_kernel): pos << 32 | key
    counts_ptr,       # [R, PROGS] int32
    tie_keys_ptr,     # [R, stride_tie] int32 scratch: the chosen bin's candidates
    tie_pos_ptr,      # [R, stride_tie] int32 scratch
    pool_ptr,         # [R, POOL_ROW] int32 (from topk_filter_kernel): the candidates past each segment
    done_ptr,         # [R] int32 out: 1 where this kernel selected the row, 2 where it left a skewed row's
                      # candidates densely over its segments (``_select_skewed``), else 0
    width, stride_tie,
    hist_smem,        # byte offset of ``hist_buf`` in shared memory (triton_utils.shared_buffer_offset)
    K: gl.constexpr, SAMPLES: gl.constexpr, PROGS: gl.constexpr, SEG: gl.constexpr, LOAD: gl.constexpr,
    CAP: gl.constexpr, BINS: gl.constexpr, TIES: gl.constexpr, HAS_STARTS: gl.constexpr, PDL: gl.constexpr,
    TILE: gl.constexpr,  # the filter's tile: the pool's block
    POOL: gl.constexpr, POOL_ROW: gl.constexpr,  # pool blocks and row words (filter.pool_layout)
):
    """Step 3 of the three-kernel path on Hopper: one program a row, ``ballot_select`` after
    the Triton filter (launched with PDL: it waits for the filter's grid first). The filter
    does not count its candidates here (its histogram atomics were L2 transactions a
    candidate): this kernel counts them in shared memory. A skewed row (a segment past SEG) it
    gathers densely from the segments and the pool and selects from there (``_select_skewed``);
    for a row it leaves with between k and CAP candidates it writes the histogram for the Triton
    select."""
    W: gl.constexpr = gl.num_warps()
    hist_buf = histogram_buffer(BINS, W)  # the row's candidate histogram (a program a row: zeroed once)
    # The zeroing before any warp counts into it (PTX the compiler does not see), while the filter finishes.
    gl.thread_barrier()
    row = gl.program_id(0)
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()  # the Triton select (rows left to it) waits for this grid anyway
    _, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    taken = n * 0
    if _long_row(n, K, SAMPLES):
        cut = gl.load(cut_ptr + row).to(gl.uint32, bitcast=True)
        shift = gl.load(shift_ptr + row)
        seg_row = seg_ptr + row.to(gl.int64) * (PROGS * SEG)
        hist_addr = shared_address(row * 0 + hist_smem)
        counts_row = counts_ptr + row * PROGS
        tie_keys = tie_keys_ptr + row.to(gl.int64) * stride_tie
        out_row = out_ptr + row.to(gl.int64) * K
        fast = ballot_select(n, cut, shift, hist_buf, seg_row, counts_row, tie_keys,
                             tie_pos_ptr + row.to(gl.int64) * stride_tie, out_row, K, PROGS, SEG, LOAD, CAP, BINS,
                             TIES, 0, False, True, hist_addr)
        taken = fast.to(gl.int32)
        if not fast:
            counts = gl.load(counts_row + gl.arange(0, PROGS, layout=gl.BlockedLayout([1], [32], [W], [0])))
            total = gl.sum(counts, axis=0)
            if (total >= gl.minimum(n, K)) & (total <= CAP):  # else the Triton select takes the whole row
                skewed = gl.max(counts, axis=0) > SEG
                if skewed:
                    # The dense list goes to the Triton select's buffers, which the scratch shares; its
                    # length passes through this row's `done`, written last.
                    taken = _select_skewed(n, cut, shift, hist_buf, hist_addr, seg_row, counts_row,
                                           pool_ptr + row.to(gl.int64) * POOL_ROW, tie_keys,
                                           tie_pos_ptr + row.to(gl.int64) * stride_tie, done_ptr + row, out_row, K,
                                           PROGS, SEG, LOAD, CAP, BINS, TIES, TILE, POOL)
                else:
                    _count_past_load(seg_row, counts_row, cut, shift, hist_addr, PROGS, SEG, LOAD, CAP, BINS)
                if taken != 1:
                    _write_histogram(hist_buf, hist_ptr + row.to(gl.int64) * BINS, BINS)
    gl.store(done_ptr + row, taken)


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)
