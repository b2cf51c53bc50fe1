"""Top-k on Hopper in one launch: one program of W warps takes a long row through all three steps.

The Triton path runs the steps as three kernels (``cutoff.py``, ``filter.py``,
``select_triton.py``), each waiting for the whole grid before it. Here a row's program runs
the same steps with a CTA barrier between them, which is faster for rows up to 32K
(``docs/benchmarks.md``, "Top-k 2048"):

1. the cut-off: SAMPLES keys in evenly spaced runs of SAMPLE_RUN, narrowed by radix passes of
   SAMPLE_BITS until the chosen bin is taken whole or holds few samples (as ``cutoff.py``);
2. the filter: warp w scans slice w of the row (``filter.filter_slice`` with PROGS = W) with
   the filter's tile PTX (``filter.filter_tile_ptx``): candidates at or above the cut-off, in
   position order, into segment w, and counted into the row's histogram in shared memory
   (``red.shared``; Gluon has no shared-memory atomics, so the PTX addresses the buffer
   ``hist_buf`` by the offset the compiler gave it, ``hist_smem``);
3. the select: ``select_gluon.ballot_select`` over the W segments or, for a skewed row (some
   warp's slice kept more candidates than its segment loads), ``_rescan_select``: two more
   scans of each slice, one counting each warp's takes, one writing them.

Every row is finished here: a row the three steps cannot take (a short row, a missed cut-off,
a skewed row whose chosen bin holds more than TIES candidates) is selected by ``_select_whole_row``,
radix passes over the row as the Triton path's ``radix.select_whole_row``. So no second
kernel follows this one (a Triton select launched after it for the rare row it left cost
0.5-0.9 us a call, ``docs/benchmarks.md``).

It takes logits up to ``TopkConfig.row_max_len`` wide (``launch.py``): a longer row is
streamed faster by the Triton filter's many one-warp programs spread over the SMs.
The first filter tile is loaded before the samples are narrowed, so its latency hides behind
that. Steps 1 and 2 write their outputs (cut-off, shift, segments, counts) to global scratch,
where the select and the rescan read them back; the histogram stays in shared memory.
Rows must be 16-byte aligned (the tile PTX loads 4 logits at once).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsacache.ops.topk.cutoff import float_cut
from dsacache.ops.topk.select_gluon import _add, _bit_length, _candidate_bin, _candidate_bin_cut, \
    _gdc_launch_dependents, _gdc_wait, _histogram_cut, _key_to_float, _long_row, _row_window, _sortable_key, \
    _sortable_key_not_nan, _taken, _tie_cut, _tie_cut_keeps, ballot_select, chosen_bin_prefix, fill_unused, \
    histogram_buffer, radix_digits, radix_narrow, shared_address


# The Triton path's cut-off rounding, compiled by Gluon (it needs no layout): one definition for both paths.
_float_cut = gluon.jit(float_cut.fn)


@gluon.jit
def _narrow_samples(keys, need, slack, BITS: gl.constexpr, layout: gl.constexpr):
    """The prefix (lower bits 0) of a bin holding the ``need``-th largest sample, taken whole
    or holding at most ``slack`` samples: ``radix_narrow`` over all the samples, the last
    32 % BITS bits left 0 (which only lowers the cut-off)."""
    size: gl.constexpr = keys.shape[0]
    prefix, _, _ = radix_narrow(keys, keys == keys, size, need, gl.max(keys, axis=0) & 0, gl.full([], 32, gl.int32),
                                slack, BITS, 32 // BITS, layout)
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
def _filter(row_ptr, x, col, start, hi, limit, tiles, cut, shift, seg, hist_addr, TILE_PTX: gl.constexpr,
            TILE_REGS: gl.constexpr, V: gl.constexpr, SEG: gl.constexpr, BINS: gl.constexpr, AHEAD: gl.constexpr,
            EVICT: gl.constexpr = ""):
    """Step 2: each warp's candidates of its slice (up to ``hi``, ``tiles`` tiles) into its
    segment ``seg``, counted into the shared histogram at ``hist_addr``; ``x`` is the first tile
    (columns ``col``), already loaded; ``limit`` bounds the loads. Returns the candidates a warp
    found ([W], may exceed SEG)."""
    W: gl.constexpr = gl.num_warps()
    TILE: gl.constexpr = 32 * V
    FL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    zero = gl.zeros([W, TILE], gl.int32, FL)
    span = zero + (hi - start)[:, None]
    cut_f = zero + _key_to_float(cut).to(gl.int32, bitcast=True)
    cut_k = zero + cut.to(gl.int32, bitcast=True)
    shift_b = zero + shift
    seg_b = zero.to(gl.int64) + seg.to(gl.int64, bitcast=True)[:, None]
    hist_b = zero + hist_addr
    cap = zero + SEG
    last = zero + (BINS - 1)
    counts = zero
    if AHEAD == 2:
        x_ahead = gl.load(row_ptr + col + TILE, mask=col + TILE < limit, other=0.0, eviction_policy=EVICT)
    for _ in range(tiles):
        nxt = col + TILE
        if AHEAD == 2:
            x_next = x_ahead
            x_ahead = gl.load(row_ptr + nxt + TILE, mask=nxt + TILE < limit, other=0.0, eviction_policy=EVICT)
        else:
            x_next = gl.load(row_ptr + nxt, mask=nxt < limit, other=0.0, eviction_policy=EVICT)
        counts = gl.inline_asm_elementwise(
            TILE_PTX, TILE_REGS,
            [x.to(gl.int32, bitcast=True), col - start, counts, cut_f, span, cut_k, shift_b, seg_b, hist_b, cap, last],
            dtype=gl.int32, is_pure=False, pack=V)
        col = nxt
        x = x_next
    return gl.max(counts, axis=1)


@gluon.jit
def _warp_slices(start, n, TILE: gl.constexpr, FL: gl.constexpr):
    """The filter's slices of the row's window (``filter.filter_slice``, whole tiles, tile-aligned,
    a warp each): (first column, columns a slice, each warp's lo and hi, its load limit [W, 1])."""
    W: gl.constexpr = gl.num_warps()
    end = start + n
    first = gl.multiple_of((start // TILE) * TILE, TILE)
    chunk = gl.multiple_of(gl.cdiv(gl.cdiv(end - first, W), TILE) * TILE, TILE)
    lo = first + gl.arange(0, W, layout=gl.SliceLayout(1, FL)) * chunk
    hi = gl.minimum(lo + chunk, end)
    return first, chunk, lo, hi, (gl.cdiv(hi, 4) * 4)[:, None]


@gluon.jit
def _tile_bins(x, col, start, hi, cut_f, cut, shift, BINS: gl.constexpr):
    """A tile of each warp's slice: (distance above the cut-off, candidate bin, kept) of each
    logit, kept as the filter keeps it (in the row's window, ``x >= float(cut)``)."""
    kept = (x >= cut_f) & (col >= start) & (col < hi)
    dist = _sortable_key_not_nan(x) - cut
    return dist, _candidate_bin(dist, shift, BINS), kept


@gluon.jit
def _tie_takes_by_warp(tie_keys, tie_pos, in_bin, cut_d, cut_p, start, first, chunk, TIES: gl.constexpr,
                       FL: gl.constexpr):
    """How many of the chosen bin's candidates (the scratch's first ``in_bin``) each warp's slice
    holds among those at or above (cut_d, cut_p): [W] in the filter layout's warp slice."""
    W: gl.constexpr = gl.num_warps()
    PL: gl.constexpr = gl.BlockedLayout([1, TIES // 32], [1, 32], [W, 1], [1, 0])
    j = gl.arange(0, TIES, layout=gl.SliceLayout(0, PL))
    d = gl.load(tie_keys + j, mask=j < in_bin, other=0).to(gl.uint32, bitcast=True)
    p = gl.load(tie_pos + j, mask=j < in_bin, other=0)
    taken = (j < in_bin) & _tie_cut_keeps(d, p, cut_d, cut_p)
    warp_of = (p + start - first) // chunk
    w = gl.arange(0, W, layout=gl.SliceLayout(1, PL))
    per = gl.sum(((warp_of[None, :] == w[:, None]) & taken[None, :]).to(gl.int32), axis=1)
    return gl.convert_layout(per, gl.SliceLayout(1, FL))


@gluon.jit(noinline=True)
def _scratch_takes_by_warp(tie_keys, tie_pos, in_bin, cut_d, cut_p, start, first, chunk, SCRATCH: gl.constexpr,
                           FL: gl.constexpr):
    """``_tie_takes_by_warp`` for a chosen bin of up to SCRATCH candidates: a W-bin histogram of
    the slices holding the kept ones, [W] in the filter layout's warp slice."""
    W: gl.constexpr = gl.num_warps()
    FLAT: gl.constexpr = gl.BlockedLayout([SCRATCH // (32 * W)], [32], [W], [0])
    WL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    j = gl.arange(0, SCRATCH, layout=FLAT)
    live = j < in_bin
    d = gl.load(tie_keys + j, mask=live, other=0).to(gl.uint32, bitcast=True)
    p = gl.load(tie_pos + j, mask=live, other=0)
    taken = live & _tie_cut_keeps(d, p, cut_d, cut_p)
    per = gl.histogram((p + start - first) // chunk, W, mask=taken, layout=WL)
    return gl.convert_layout(per, gl.SliceLayout(1, FL))


@gluon.jit(noinline=True)
def _narrow_scratch(tie_keys, tie_pos, in_bin, left, chosen, shift, n, BINS: gl.constexpr, BITS: gl.constexpr,
                    SCRATCH: gl.constexpr):
    """The tie cut (cut_d, cut_p) of a chosen bin of ``in_bin`` (<= SCRATCH) candidates compacted in
    the scratch, in any order: radix passes over their distances for the ``left``-th largest, then,
    when the cut falls inside a run of equal distances, radix passes over the positions of that run
    for the last one taken (lowest positions first). Both start at the bits that can differ: the
    chosen bin's low ``shift`` bits of the distance, a position's bits below ``n``'s length."""
    W: gl.constexpr = gl.num_warps()
    FLAT: gl.constexpr = gl.BlockedLayout([SCRATCH // (32 * W)], [32], [W], [0])
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    PASSES: gl.constexpr = (32 + BITS - 1) // BITS
    j = gl.arange(0, SCRATCH, layout=FLAT)
    live = j < in_bin
    dist = gl.load(tie_keys + j, mask=live, other=0).to(gl.uint32, bitcast=True)
    prefix, top = chosen_bin_prefix(chosen, shift, BINS)
    cut_d, ties, whole = radix_narrow(dist, live, in_bin, left, prefix, top, 0, BITS, PASSES, RL, True)
    cut_p = in_bin * 0 + 0x7FFFFFFF  # whole: every candidate at or above cut_d
    if not whole:
        equal = live & (dist == cut_d)
        # Lower positions rank first: as keys, 0xFFFFFFFF - pos, whose bits from n's length up are all 1.
        later = (0xFFFFFFFF - gl.load(tie_pos + j, mask=live, other=0).to(gl.uint32, bitcast=True))
        top_p = gl.minimum(_bit_length(n.to(gl.uint32)), 31)
        ones = ((0xFFFFFFFF << top_p.to(gl.int64)) & 0xFFFFFFFF).to(gl.uint32)
        key, _, _ = radix_narrow(later, equal, gl.sum(equal.to(gl.int32), axis=0), ties, ones, top_p, 0, BITS, PASSES,
                                 RL)
        # Taken: keys >= key, i.e. positions <= 0xFFFFFFFF - key (all of them when key is still 0).
        cut_p = gl.minimum(0xFFFFFFFF - key, 0x7FFFFFFF).to(gl.int32, bitcast=True)
    return cut_d, cut_p


@gluon.jit
def _rescan_select(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_buf, counts_ptr, tie_keys_ptr,
                   tie_pos_ptr, row_stride, width, stride_tie, K: gl.constexpr, V: gl.constexpr, BINS: gl.constexpr,
                   TIES: gl.constexpr, BITS: gl.constexpr, SCRATCH: gl.constexpr, HAS_STARTS: gl.constexpr):
    """Step 3 for a row the ballot select leaves because some warp's slice kept more candidates
    than its segment loads (a skewed row: its largest logits bunched in a few slices); returns
    1 if it selected the row, else 0 (nothing written to the output).

    The histogram and the counts are complete whatever the segments held, so the chosen bin
    is known; each warp then scans its slice twice more (from L2): once counting its takes
    (the chosen bin's candidates, when only some are taken, compacted into the tie scratch
    and cut as in the ballot select, or, past TIES candidates, by ``_narrow_scratch``, each
    warp's takes of them counted in the scratch), once writing them, in position order, after
    the takes of the warps before it. It refuses a row with fewer than k candidates or a chosen
    bin of more than SCRATCH to cut, and any row whose takes do not add up to k."""
    W: gl.constexpr = gl.num_warps()
    TILE: gl.constexpr = 32 * V
    FL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    # Everything about the row again, recomputed or reloaded from what the earlier steps stored:
    # kept live through the filter and the ballot select, some of it would spill.
    row = gl.program_id(0)
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    row_ptr = logits_ptr + row.to(gl.int64) * (row_stride // 4 * 4)
    first, chunk, lo, hi, limit = _warp_slices(start, n, TILE, FL)
    tiles = chunk // TILE
    count = gl.load(counts_ptr + row * W + gl.arange(0, W, layout=gl.SliceLayout(1, FL)))
    cut = gl.load(cut_ptr + row).to(gl.uint32, bitcast=True)
    shift = gl.load(shift_ptr + row)
    tie_keys = tie_keys_ptr + row.to(gl.int64) * stride_tie
    tie_pos = tie_pos_ptr + row.to(gl.int64) * stride_tie
    out_row = out_ptr + row.to(gl.int64) * K
    want = gl.minimum(n, K)
    chosen, left, in_bin = _candidate_bin_cut(hist_buf, want, BINS, W)
    whole = left == in_bin
    taken = n * 0
    if (gl.sum(count, axis=0) >= want) & (whole | (in_bin <= SCRATCH)):
        cut_f = _key_to_float(cut)
        col0 = lo[:, None] + gl.arange(0, TILE, layout=gl.SliceLayout(0, FL))[None, :]
        hi_b = hi[:, None]
        # The scratch slot after the candidates counts them; a warp takes its tile's slots with one atomic.
        counter = tie_keys + SCRATCH + gl.zeros_like(count)
        gl.store(tie_keys + SCRATCH, 0)
        gl.thread_barrier()  # the zeroed counter before any warp takes a slot
        above = gl.zeros_like(count)
        in_chosen = gl.zeros_like(count)
        col = col0
        for _ in range(tiles):
            x = gl.load(row_ptr + col, mask=col < limit, other=0.0)
            dist, bin_, kept = _tile_bins(x, col, start, hi_b, cut_f, cut, shift, BINS)
            tie = kept & (bin_ == chosen)
            above += gl.sum((kept & (bin_ > chosen)).to(gl.int32), axis=1)
            in_chosen += gl.sum(tie.to(gl.int32), axis=1)
            tie = tie & (left != in_bin)
            t = tie.to(gl.int32)
            ties_w = gl.sum(t, axis=1)
            base = gl.atomic_add(counter, ties_w, mask=ties_w > 0, sem="relaxed")
            slot = base[:, None] + gl.associative_scan(t, 1, _add) - t
            gl.store(tie_keys + slot, dist.to(gl.int32, bitcast=True), mask=tie)
            gl.store(tie_pos + slot, col - start, mask=tie)
            col += TILE
        cut_d = cut * 0                 # whole: every candidate of the chosen bin is taken
        cut_p = n * 0 + 0x7FFFFFFF
        takes = above + in_chosen
        if left != in_bin:
            gl.thread_barrier()  # the chosen bin's candidates in the scratch
            if in_bin <= TIES:
                cut_d, cut_p = _tie_cut(tie_keys, tie_pos, in_bin, left, TIES, W)
                takes = above + _tie_takes_by_warp(tie_keys, tie_pos, in_bin, cut_d, cut_p, start, first, chunk, TIES,
                                                   FL)
            else:  # heavy ties: radix passes over the scratch, then each slice's takes counted there
                cut_d, cut_p = _narrow_scratch(tie_keys, tie_pos, in_bin, left, chosen, shift, n, BINS, BITS, SCRATCH)
                takes = above + _scratch_takes_by_warp(tie_keys, tie_pos, in_bin, cut_d, cut_p, start, first, chunk,
                                                       SCRATCH, FL)
        if gl.sum(takes, axis=0) == want:
            WL: gl.constexpr = gl.BlockedLayout([W], [32], [W], [0])  # all W counts in each thread: a scan in registers
            every = gl.convert_layout(takes, WL)
            running = gl.convert_layout(gl.associative_scan(every, 0, _add) - every, takes.type.layout)
            col = col0
            for _ in range(tiles):
                x = gl.load(row_ptr + col, mask=col < limit, other=0.0)
                dist, bin_, kept = _tile_bins(x, col, start, hi_b, cut_f, cut, shift, BINS)
                pos = col - start
                take = kept & _taken(bin_, dist, pos, chosen, cut_d, cut_p)
                t = take.to(gl.int32)
                gl.store(out_row + running[:, None] + gl.associative_scan(t, 1, _add) - t, pos, mask=take)
                running += gl.sum(t, axis=1)
                col += TILE
            taken = n * 0 + 1
    return taken


@gluon.jit(noinline=True)
def _select_whole_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, row_stride, width, K: gl.constexpr,
                      BITS: gl.constexpr, HAS_STARTS: gl.constexpr):
    """The top ``min(n, K)`` of the row's window by radix passes over it, in position order (ties
    to the lower position), then -1 up to K: every row the sampled steps do not take (a short
    row, a missed cut-off, a skewed row with heavy ties). The rule of the Triton path's
    ``radix.select_whole_row``; each pass streams the window from L2 in blocks of 4 logits a
    thread, the next block's loads in flight while one is counted. Not inlined, and the row's
    window and pointers found again here: values the compiler would otherwise share with the
    other steps, kept live through them, spill at the kernel's register cap."""
    W: gl.constexpr = gl.num_warps()
    row = gl.program_id(0)
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    row_ptr = logits_ptr + row.to(gl.int64) * row_stride
    out_row = out_ptr + row.to(gl.int64) * K
    BLOCK: gl.constexpr = 4 * 32 * W
    BINS: gl.constexpr = 1 << BITS
    BL: gl.constexpr = gl.BlockedLayout([4], [32], [W], [0])
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    lanes = gl.arange(0, BLOCK, layout=BL)
    end = start + n
    blocks = gl.cdiv(n, BLOCK)
    want = gl.minimum(n, K)
    need = want
    prefix = (n * 0).to(gl.uint32)
    top = n * 0 + 32
    whole = need == n  # all of it (or nothing): no pass
    done = whole
    for _ in range((32 + BITS - 1) // BITS):  # a runtime loop: one copy of the pass in the code
        if not done:
            shift = gl.maximum(top - BITS, 0)
            hist = gl.zeros([BINS], gl.int32, RL)
            col = start + lanes
            x = gl.load(row_ptr + col, mask=col < end, other=0.0)
            for _ in range(blocks):
                nxt = col + BLOCK
                x_next = gl.load(row_ptr + nxt, mask=nxt < end, other=0.0)
                match, digit = radix_digits(_sortable_key(x), col < end, prefix, top, shift, BITS)
                hist += gl.histogram(digit, BINS, mask=match, layout=RL)
                col = nxt
                x = x_next
            chosen, need, in_bin = _histogram_cut(hist, need, RL)
            prefix = prefix | (chosen.to(gl.uint32) << shift.to(gl.uint32))
            top = shift
            whole = need == in_bin
            done = whole | (top == 0)
    # A bin taken whole: every key >= prefix. Else every key > prefix and the first `need` equal to it.
    cut = prefix.to(gl.int64) - whole.to(gl.int64)
    ties = need * (1 - whole.to(gl.int32))
    written = n * 0
    seen = n * 0
    col = start + lanes
    x = gl.load(row_ptr + col, mask=col < end, other=0.0)
    for _ in range(blocks):
        nxt = col + BLOCK
        x_next = gl.load(row_ptr + nxt, mask=nxt < end, other=0.0)
        valid = col < end
        key = _sortable_key(x).to(gl.int64)
        tie = (valid & (key == cut)).to(gl.int32)
        take = (valid & (key > cut)) | ((tie != 0) & (seen + gl.associative_scan(tie, 0, _add) - tie < ties))
        t = take.to(gl.int32)
        gl.store(out_row + written + gl.associative_scan(t, 0, _add) - t, col - start, mask=take)
        written += gl.sum(t, axis=0)
        seen += gl.sum(tie, axis=0)
        col = nxt
        x = x_next
    fill_unused(out_row, want, K, BLOCK, BL)


@gluon.jit(do_not_specialize=["hist_smem"])
def topk_row_kernel(
    logits_ptr,       # [R, row_stride] fp32, rows 16-byte aligned
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    cut_ptr,          # [R] int32 scratch: the cut-off key of each long row
    shift_ptr,        # [R] int32 scratch: log2 of the candidate histogram's bin width
    seg_ptr,          # [R, W, SEG] int64 scratch: pos << 32 | key of each warp's candidates, in order
    counts_ptr,       # [R, W] int32 scratch: candidates found by each warp (may exceed SEG)
    tie_keys_ptr,     # [R, stride_tie] int32 scratch: the chosen bin's candidates
    tie_pos_ptr,      # [R, stride_tie] int32 scratch
    row_stride, width, stride_tie,
    hist_smem,        # byte offset of ``hist_buf`` in shared memory (triton_utils.shared_buffer_offset)
    K: gl.constexpr, SAMPLES: gl.constexpr, SAMPLE_RUN: gl.constexpr, SAMPLE_BITS: gl.constexpr,
    SEG: gl.constexpr, LOAD: gl.constexpr, CAP: gl.constexpr, BINS: gl.constexpr, TIES: gl.constexpr,
    V: gl.constexpr, TILE_PTX: gl.constexpr, TILE_REGS: gl.constexpr, AHEAD: gl.constexpr,
    HAS_STARTS: gl.constexpr, PDL: gl.constexpr,
    EVICT: gl.constexpr = "",  # L2 eviction policy of the filter's logits loads (launch._Plan.evict)
):
    W: gl.constexpr = gl.num_warps()
    TILE: gl.constexpr = 32 * V
    FL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])  # tile PTX: runs of 4, a warp a slice
    # A skewed row's chosen bin the rescan can cut past TIES candidates: 8 a thread (more spill at
    # the register cap), at most half the CAP + TIES slots of the tie scratch (the slot after them
    # is its counter).
    SCRATCH: gl.constexpr = min(CAP // 2, 256 * W)
    hist_buf = histogram_buffer(BINS, W)  # the row's candidate histogram (a program a row: zeroed once)
    row = gl.program_id(0)
    if PDL:  # launched with PDL: nothing is read before the kernel before this one has finished
        _gdc_wait()
        _gdc_launch_dependents()  # the kernel after waits for this grid before reading what it wrote
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    taken = n * 0
    if _long_row(n, K, SAMPLES):
        row_ptr = logits_ptr + row.to(gl.int64) * (row_stride // 4 * 4)
        # The filter's slices (filter.filter_slice): whole tiles, tile-aligned, W of them.
        first, chunk, lo, hi, limit = _warp_slices(start, n, TILE, FL)
        warp = gl.arange(0, W, layout=gl.SliceLayout(1, FL))
        col = lo[:, None] + gl.arange(0, TILE, layout=gl.SliceLayout(0, FL))[None, :]
        # in flight while the cut-off is found
        x = gl.load(row_ptr + col, mask=col < limit, other=0.0, eviction_policy=EVICT)

        cut, shift = _cutoff(row_ptr, start, n, K, SAMPLES, SAMPLE_RUN, SAMPLE_BITS, BINS)
        gl.store(cut_ptr + row, cut.to(gl.int32, bitcast=True))
        gl.store(shift_ptr + row, shift)
        gl.thread_barrier()  # the zeroed histogram before any warp counts into it (PTX the compiler does not see)

        seg_row = seg_ptr + row.to(gl.int64) * (W * SEG)
        count = _filter(row_ptr, x, col, start, hi, limit, chunk // TILE, cut, shift, seg_row + warp * SEG,
                        shared_address(row * 0 + hist_smem), TILE_PTX, TILE_REGS, V, SEG, BINS, AHEAD, EVICT)
        gl.store(counts_ptr + row * W + warp, count)
        gl.thread_barrier()  # every warp's candidates, counts and histogram counts before the select

        fast = ballot_select(n, cut, shift, hist_buf, seg_row, counts_ptr + row * W,
                             tie_keys_ptr + row.to(gl.int64) * stride_tie, tie_pos_ptr + row.to(gl.int64) * stride_tie,
                             out_ptr + row.to(gl.int64) * K, K, W, SEG, LOAD, CAP, BINS, TIES, SAMPLE_BITS, True)
        taken = fast.to(gl.int32)
        if taken == 0:  # a skewed row: its takes found by scanning the slices again
            taken = _rescan_select(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_buf, counts_ptr,
                                   tie_keys_ptr, tie_pos_ptr, row_stride, width, stride_tie, K, V, BINS, TIES,
                                   SAMPLE_BITS, SCRATCH, HAS_STARTS)
    if taken == 0:  # a short row, a missed cut-off, a skewed row with heavy ties
        _select_whole_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, row_stride, width, K, SAMPLE_BITS, HAS_STARTS)
