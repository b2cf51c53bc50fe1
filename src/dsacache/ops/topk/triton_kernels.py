"""Triton top-k (``algo="v3"``, the default) and positions -> slots, and their launchers.

The radix select itself and the other shared pieces are in ``triton_common``; the earlier
algorithms, still selectable, in ``triton_v1_v2``. A long row is cut down to a few thousand
candidates closed upwards (every key at or above a cut-off), then selected exactly, in
three launches:

1. ``_topk_cutoff_kernel`` (``triton_common``), one program a row: a cut-off key with, most
   likely, a little over k keys at or above it, from evenly spaced samples.
2. ``_topk_filter_v3_kernel``, PROGS one-warp programs a row (~32 an SM): each streams its
   slice with the next tile's loads in flight, tests ``x >= float(cut)`` (the cut-off is
   never +0.0 or NaN, see ``_float_cut``), places candidates with a warp-local prefix sum
   and writes (key, position) pairs and histogram counts with predicated PTX stores, so
   nothing goes through shared memory and no barrier stalls the loop. On aligned rows a tile
   step is one PTX block that does the per-candidate work only where a lane keeps one.
3. ``_topk_select_v3_kernel``, one program a row: all its loads are issued up front (the
   first LOAD slots of each segment, where the candidates sit, whole segments only when one
   holds more); the histogram names the chosen bin, whose few candidates (at most TIES) are
   ranked pairwise on (key, position), else by radix passes; one prefix sum writes the
   output. A skewed row
   (a program over its CAP / PROGS share, e.g. logits growing with the position) is gathered
   into a dense buffer, the overflowed programs' slices filtered again from the row, and
   selected the same way. A missed cut-off
   (fewer than k candidates, or more than CAP) takes the whole-row radix select, short rows
   (``n <= max(k, 2 * SAMPLES)``) skip steps 1-2. Loops over radix passes are runtime loops:
   the select is latency-bound and straight-line code larger than the instruction cache
   made it slower.

On Hopper and newer, step 3 first runs the Gluon ballot select (``gluon_kernels``), which
takes the common row (the tile-wide scans above as warp ballots, ~2x faster) and marks it
done; the Triton select then finishes only the rows it left (``SKIP_DONE``).

On CUDA the filter and select are launched with programmatic dependent launch: each starts
while the kernel before it finishes and waits (``griddepcontrol.wait``) before reading its
outputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsacache.ops.topk.triton_common import (
    CANDIDATES_PER_K, PTX_AVAILABLE, RADIX_BITS, _filter, _fill_tail, _histogram_cut_of, _key_to_float, _long_row,
    _narrow_bin_and_write, _row_setup, _row_window, _select_short_row, _select_whole_row,
    _topk_cutoff_kernel,
)
from dsacache.ops.triton_utils import INTERPRET, check_launch, l2_cache_bytes, loop_bound, sm_count

if not INTERPRET:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


#: Launch settings: ``algo`` ("v3", "v2" or "v1"), BLOCK logits a step, SAMPLES for the
#: cut-off (None: 1024 for v1, 2048 for v2 and v3). CAP (candidate buffer length, default
#: CANDIDATES_PER_K * k, a power of two for v2 and v3) may be set to override. v1 and v2:
#: SPLITS (programs a row's candidate search uses, default from the row and SM counts).
#: v2 and v3: BINS (candidate histogram), SAMPLE_RUN (adjacent logits a sample run),
#: SAMPLE_BITS (radix digit of the cut-off search), num_warps (cut-off kernel), select_warps
#: (None: 16 for v2; for v3 8 when the rows fit one wave on the SMs, else 16).
#: v2 only: STREAMS (per-warp candidate streams a filter program keeps). v3 only: PROGS
#: (one-warp filter programs a row, default from the row and SM counts), V (logits a lane a
#: filter step) and AHEAD (filter tiles loaded ahead, 1 or 2; None: ``_filter_tiles``), TIES
#: (largest chosen bin ranked pairwise), asm (inline PTX where available), pdl (programmatic
#: dependent launch of the filter and select kernels, CUDA only), select ("gluon": the Gluon
#: ballot select first where it applies, see ``gluon_kernels``; "triton": only the Triton select;
#: "gluon-only", for tests: no Triton select after it), gluon_select_warps (its warps).
TOPK_CONFIG = {"BLOCK": 2048, "SAMPLES": None, "num_warps": 8, "CAP": None,
               "BINS": 2048, "SAMPLE_RUN": 8, "select_warps": None, "PROGS": None, "V": None,
               "TIES": 32, "asm": True, "SAMPLE_BITS": 4, "pdl": True, "tile_asm": True, "LOAD": None,
               "select": "gluon", "gluon_select_warps": 8, "AHEAD": None}


@functools.lru_cache(maxsize=None)
def filter_tile_ptx(v: int) -> str:
    """PTX for one warp's tile step of the v3 filter (``_filter_tile_asm``), ``v`` logits a lane.

    The tile is laid out as the 4-wide loads leave it: a lane holds ``v / 4`` runs of 4 adjacent
    logits, run ``r`` of lane ``l`` at tile columns ``128 r + 4 l .. + 3``. Position order is run,
    then lane, then column, so each lane counts its kept logits per run in one 8-bit field of a
    packed word, and one warp scan of that word gives every run's lane offsets at once. The
    per-candidate work (key, histogram bin, stores) runs only for the columns where some lane of
    the warp keeps one (``vote.any`` + uniform branch): candidates are ~2 % of the logits.
    Operands (``pack=v``, each input passed as v registers, only the first read for the scalar
    ones): out count; x bits, positions, count, cut-off float bits, span, cut-off key, shift,
    segment and histogram pointers, segment capacity, last bin.
    """
    runs = v // 4
    out = lambda i: f"${i}"                      # noqa: E731
    arg = lambda k, i=0: f"${v + k * v + i}"     # noqa: E731
    x, pos, count, cutf, span, cut, shift, seg, hist, cap, last = range(11)
    offset = lambda i: 128 * (i // 4) + i % 4    # noqa: E731  (column of value i from the lane's first)
    lines = ["{", f".reg .pred q, y, {', '.join(f'k{i}' for i in range(v))};",
             ".reg .b32 c, s, t, ex, tot, acc, key, bin, p;", f".reg .b32 {', '.join(f'b{r}' for r in range(runs))};",
             ".reg .b64 a;"]
    # kept: >= the cut-off and, in a tile that is not wholly inside the row's window, inside it
    # (positions are read from the lane's first value only: ptxas drops the rest)
    lines += [f"setp.ge.s32 y, {arg(pos)}, 0;", f"add.s32 p, {arg(pos)}, {offset(v - 1)};",
              f"setp.lt.and.s32 y, p, {arg(span)}, y;", "vote.sync.all.pred y, y, -1;", "@!y bra.uni EDGE_${:uid};"]
    lines += [f"setp.ge.f32 k{i}, {arg(x, i)}, {arg(cutf)};" for i in range(v)]
    lines += ["bra.uni KEPT_${:uid};", "EDGE_${:uid}:"]
    for i in range(v):
        lines += [f"add.s32 p, {arg(pos)}, {offset(i)};", f"setp.lt.u32 q, p, {arg(span)};",
                  f"setp.ge.and.f32 k{i}, {arg(x, i)}, {arg(cutf)}, q;"]
    lines += ["KEPT_${:uid}:", "mov.b32 c, 0;"]
    lines += [f"@k{i} add.u32 c, c, {1 << (8 * (i // 4))};" for i in range(v)]
    lines.append("mov.b32 s, c;")
    for d in (1, 2, 4, 8, 16):
        lines += [f"shfl.sync.up.b32 t|y, s, {d}, 0, -1;", "@y add.u32 s, s, t;"]
    lines += ["shfl.sync.idx.b32 tot, s, 31, 31, -1;", "sub.u32 ex, s, c;", f"mov.b32 acc, {arg(count)};"]
    for r in range(runs):  # run r starts after the whole warp's earlier runs and this run's earlier lanes
        lines += [f"bfe.u32 t, ex, {8 * r}, 8;", f"add.u32 b{r}, acc, t;",
                  f"bfe.u32 t, tot, {8 * r}, 8;", "add.u32 acc, acc, t;"]
    lines += ["setp.eq.u32 y, tot, 0;", "@y bra.uni DONE_${:uid};"]
    for i in range(v):
        b = f"b{i // 4}"
        lines += [f"vote.sync.any.pred y, k{i}, -1;", f"@!y bra.uni SKIP{i}_${{:uid}};",
                  f"shr.s32 t, {arg(x, i)}, 31;", "or.b32 t, t, 0x80000000;", f"xor.b32 key, {arg(x, i)}, t;",
                  f"sub.u32 bin, key, {arg(cut)};", f"shr.u32 bin, bin, {arg(shift)};",
                  f"min.u32 bin, bin, {arg(last)};", f"add.s32 p, {arg(pos)}, {offset(i)};",
                  f"setp.lt.and.s32 q, {b}, {arg(cap)}, k{i};",
                  f"mad.wide.s32 a, {b}, 8, {arg(seg)};", "@q st.global.v2.b32 [a], {key, p};",
                  f"mad.wide.u32 a, bin, 4, {arg(hist)};", f"@k{i} red.global.add.u32 [a], 1;",
                  f"@k{i} add.u32 {b}, {b}, 1;", f"SKIP{i}_${{:uid}}:"]
    lines.append("DONE_${:uid}:")
    lines += [f"mov.b32 {out(i)}, acc;" for i in range(v)]
    lines.append("}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def filter_tile_regs(v: int) -> str:
    """Inline-asm constraints of ``filter_tile_ptx(v)``: v outputs, then the inputs (7 x v 32-bit,
    2 x v pointers, 2 x v 32-bit)."""
    return ",".join(["=r"] * v + ["r"] * (7 * v) + ["l"] * (2 * v) + ["r"] * (2 * v))


#: The logits-a-lane counts the tile-step PTX supports (one to four runs of 4).
FILTER_TILE_V = (4, 8, 16)


@triton.jit
def _filter_tile_asm(asm: tl.constexpr, regs: tl.constexpr, x, pos, count, cut_f, span, cut, shift, seg, hist_row,
                     SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr):
    """One tile step of the filter as PTX (``filter_tile_ptx``); ``count`` is the running
    candidate count broadcast over the tile, returned updated."""
    shape: tl.constexpr = x.shape
    return tl.inline_asm_elementwise(
        asm, regs,
        [x.to(tl.int32, bitcast=True), pos, count, tl.full(shape, cut_f, tl.float32).to(tl.int32, bitcast=True),
         tl.full(shape, span, tl.uint32).to(tl.int32, bitcast=True),
         tl.full(shape, cut, tl.uint32).to(tl.int32, bitcast=True), tl.full(shape, shift, tl.int32),
         tl.full(shape, seg.to(tl.int64, bitcast=True), tl.int64),
         tl.full(shape, hist_row.to(tl.int64, bitcast=True), tl.int64), tl.full(shape, SEG_CAP, tl.int32),
         tl.full(shape, BINS - 1, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=V)


@triton.jit
def _filter_warp(row_ptr, start, lo, hi, hi_load, cut_ptr, shift_ptr, hist_row, seg,
                 SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr, USE_ASM: tl.constexpr,
                 PDL: tl.constexpr, TILE_ASM: tl.constexpr = False, TILE_PTX: tl.constexpr = "",
                 TILE_REGS: tl.constexpr = "", AHEAD: tl.constexpr = 1):
    """One warp's candidates of columns [lo, hi) (``hi_load >= hi`` bounds the loads, a multiple
    of 4 when ``lo`` is, so they vectorize): (key, position - start) pairs of each key >= cut,
    in order, into the segment ``seg`` (at most SEG_CAP pairs), each counted into the row's
    histogram of ``(key - cut) >> shift`` (the last bin open). The next tile is loaded before
    this one is scanned, so two tiles of loads are in flight.

    ``cut`` is never the key of +0.0 or of NaN (see ``_float_cut``), so ``x >= float(cut)``
    is ``key(x) >= cut``: the test runs on the float, the key is built only to be stored.
    With PDL (programmatic dependent launch) the first tile is loaded before waiting for the
    cut-off kernel, whose cut-off, shift and zeroed histogram are used after the wait.
    TILE_ASM runs each tile step
    as one block of PTX (``filter_tile_ptx``: the per-candidate work only where some lane
    keeps a candidate) instead of per-logit predicated stores (needs 16-byte aligned tiles).
    Returns the count (may exceed SEG_CAP)."""
    TILE: tl.constexpr = 32 * V
    lanes = tl.arange(0, TILE)
    span = (hi - start).to(tl.uint32)
    count = tl.zeros([], tl.int32)
    counts = tl.zeros([TILE], tl.int32)  # TILE_ASM: the running count, the same in every lane
    col = lo + lanes
    x = tl.load(row_ptr + col, mask=col < hi_load, other=0.0)
    if AHEAD == 2:
        x_ahead = tl.load(row_ptr + col + TILE, mask=col + TILE < hi_load, other=0.0)
    if PDL:
        gdc_wait()
    cut = tl.load(cut_ptr).to(tl.uint32, bitcast=True)
    shift = tl.load(shift_ptr)
    cut_f = _key_to_float(cut)
    for c in tl.range(0, loop_bound(tl.cdiv(hi - lo, TILE)), num_stages=1):
        nxt = col + TILE
        if AHEAD == 2:
            x_next = x_ahead
            x_ahead = tl.load(row_ptr + nxt + TILE, mask=nxt + TILE < hi_load, other=0.0)
        else:
            x_next = tl.load(row_ptr + nxt, mask=nxt < hi_load, other=0.0)
        pos = col - start
        if TILE_ASM:
            counts = _filter_tile_asm(TILE_PTX, TILE_REGS, x, pos, counts, cut_f, span, cut, shift, seg, hist_row,
                                      SEG_CAP, BINS, V)
        else:
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
    if TILE_ASM:
        count = tl.max(counts, axis=0)
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
    TILE_ASM: tl.constexpr = False,  # see _filter_warp; needs ALIGNED
    TILE_PTX: tl.constexpr = "", TILE_REGS: tl.constexpr = "",  # with TILE_ASM: filter_tile_ptx(V), filter_tile_regs(V)
    AHEAD: tl.constexpr = 1,  # tiles loaded ahead of the one scanned (1 or 2)
):
    """v3 step 2, PROGS one-warp programs a long row: candidates at or above the row's
    cut-off. One warp a program keeps every scan inside the warp (no barrier in the loop)
    and lets ~32 programs share an SM, so enough loads are in flight to stream the row.
    With PDL the select kernel is let launch once every program is past its loop."""
    prog = tl.program_id(0)
    row = tl.program_id(1)
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    if _long_row(n, K, SAMPLES):
        lo, hi = _filter_slice(start, n, prog, PROGS, 32 * V)
        if ALIGNED:  # the row's width is a multiple of 4: the 4-wide loads stay inside it
            hi_load = tl.multiple_of(tl.cdiv(hi, 4) * 4, 4)
        else:
            hi_load = hi
        seg = seg_ptr + (row.to(tl.int64) * PROGS + prog) * (2 * SEG_CAP)
        if ALIGNED:  # a stride written as a multiple of 4: the compiler then knows rows are 16-byte aligned
            row_ptr = logits_ptr + row.to(tl.int64) * (row_stride // 4 * 4)
        else:
            row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        count = _filter_warp(row_ptr, start, lo, hi, hi_load, cut_ptr + row, shift_ptr + row,
                             hist_ptr + row.to(tl.int64) * BINS, seg, SEG_CAP, BINS, V, USE_ASM, PDL,
                             TILE_ASM and ALIGNED, TILE_PTX, TILE_REGS, AHEAD)
        if PDL:
            gdc_launch_dependents()
        tl.store(counts_ptr + row * PROGS + prog, count)


@triton.jit
def _filter_slice(start, n, prog, PROGS: tl.constexpr, TILE: tl.constexpr):
    """Columns [lo, hi) of a row that filter program ``prog`` scans: a row's window [start,
    start + n) cut into PROGS slices of whole TILE-column tiles, aligned so the loads vectorize
    (slice 0 may begin before ``start``; the columns before it are never candidates)."""
    end = start + n
    first = tl.multiple_of((start // TILE) * TILE, TILE)
    chunk = tl.multiple_of(tl.cdiv(tl.cdiv(end - first, PROGS), TILE) * TILE, TILE)
    lo = first + prog * chunk
    return lo, tl.minimum(lo + chunk, end)


@triton.jit
def _gather_skewed(row_ptr, start, n, counts, seg_row, cut_f, buf_keys, buf_pos,
                   SEG: tl.constexpr, PROGS: tl.constexpr, TILE: tl.constexpr, CAP: tl.constexpr,
                   BLOCK: tl.constexpr):
    """A skewed row's candidates, densely and in position order, into the buffers: each
    segment that holds all its candidates (count <= SEG) is copied, each overflowed one (its
    program found more than SEG) is filtered again from its own slice of the row only. The
    counts are exact either way, so every segment lands at its prefix-sum offset."""
    offsets = tl.cumsum(counts, axis=0) - counts
    lane = tl.arange(0, SEG)[None, :]
    kept = (lane < counts[:, None]) & (counts[:, None] <= SEG)
    pair = tl.load(seg_row + lane, mask=kept)
    tl.store(buf_keys + offsets[:, None] + lane, pair.to(tl.int32), mask=kept)
    tl.store(buf_pos + offsets[:, None] + lane, (pair >> 32).to(tl.int32), mask=kept)
    progs = tl.arange(0, PROGS)
    over = counts > SEG
    nth = tl.cumsum(over.to(tl.int32), axis=0) - 1
    for i in range(loop_bound(tl.sum(over.to(tl.int32), axis=0))):
        pick = over & (nth == i)
        prog = tl.sum(tl.where(pick, progs, 0), axis=0)
        at = tl.sum(tl.where(pick, offsets, 0), axis=0)
        lo, hi = _filter_slice(start, n, prog, PROGS, TILE)
        # row_ptr is the row's column ``start``: positions are relative to it
        _filter(row_ptr, tl.maximum(lo - start, 0), hi - start, cut_f, buf_keys + at, buf_pos + at, CAP, BLOCK)


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
    LOAD: tl.constexpr = 0,  # candidate slots of a segment loaded first (<= CAP // PROGS; launchers set it)
    done_ptr=None,  # [R] int32 (with SKIP_DONE): 1 for the rows the Gluon select already wrote
    SKIP_DONE: tl.constexpr = False,
    TILE: tl.constexpr = 256,  # the filter's tile (32 V): its slices are re-filtered for a skewed row
):
    """v3 step 3, one program a row: exact selection from the candidates in registers.

    A skewed row (a program found more than its CAP / PROGS share, e.g. logits that grow
    with the position) is gathered into a dense buffer (``_gather_skewed``: the overflowed
    programs' slices filtered again) and selected the same way; short rows and a missed cut-off take the v1 paths. With SKIP_DONE, after the
    Gluon select (``gluon_kernels``), only the rows it left (``done == 0``)."""
    row = tl.program_id(0)
    if PDL:
        gdc_wait()  # launched while the kernel before finished: its outputs are complete from here
    todo = True
    if SKIP_DONE:
        todo = tl.load(done_ptr + row) == 0
    if todo:
        _select_v3_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_ptr, seg_ptr, counts_ptr,
                       buf_keys_ptr, buf_pos_ptr, row_stride, width, row, K, BLOCK, CAP, SAMPLES, PROGS, BINS, BITS,
                       TIES, HAS_STARTS, LOAD, TILE)


@triton.jit
def _select_v3_row(logits_ptr, lens_ptr, starts_ptr, out_ptr, cut_ptr, shift_ptr, hist_ptr, seg_ptr, counts_ptr,
                   buf_keys_ptr, buf_pos_ptr, row_stride, width, row,
                   K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
                   PROGS: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr, TIES: tl.constexpr,
                   HAS_STARTS: tl.constexpr, LOAD: tl.constexpr, TILE: tl.constexpr):
    """The body of ``_topk_select_v3_kernel`` for one row."""
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
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride, width, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if not _long_row(n, K, SAMPLES):
        _select_short_row(row_ptr, n, want, out_row, K, BLOCK, BITS)
    else:
        total = tl.sum(counts, axis=0)
        buf_keys = buf_keys_ptr + row.to(tl.int64) * (CAP + TIES)
        buf_pos = buf_pos_ptr + row.to(tl.int64) * (CAP + TIES)
        if (total < want) | (total > CAP):
            _select_whole_row(row_ptr, n, want, out_row, BLOCK, BITS)  # the cut-off missed
        elif tl.max(counts, axis=0) <= LOAD:
            _select_v3(keys, pos, lane < counts[:, None], hist, cut, shift, want, out_row, buf_keys, buf_pos,
                       BITS, TIES)
        elif (LOAD < SEG) & (tl.max(counts, axis=0) <= SEG):
            full = tl.arange(0, SEG)[None, :]
            whole = tl.load(seg_row + full)
            _select_v3(whole.to(tl.int32), (whole >> 32).to(tl.int32), full < counts[:, None], hist, cut, shift,
                       want, out_row, buf_keys, buf_pos, BITS, TIES)
        else:
            start, _ = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
            _gather_skewed(row_ptr, start, n, counts, seg_row, _key_to_float(cut), buf_keys, buf_pos, SEG, PROGS,
                           TILE, CAP, BLOCK)
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


def launch_topk(logits: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None, out: torch.Tensor,
                config: dict | None = None) -> None:
    """Fill ``out [R, k]`` with the top-k positions of each row of ``logits [R, *]``. ``lens``
    and ``starts`` (None: every row starts at 0) are int32 or int64 and clamped to the row by
    the kernels."""
    cfg = {**TOPK_CONFIG, **(config or {})}
    check_launch(logits.stride(1) == 1 and out.is_contiguous(), "contiguous logits rows and out")
    check_launch(lens.is_contiguous() and (starts is None or starts.is_contiguous()),
                 "contiguous lengths and row starts")
    window = dict(width=logits.shape[1], HAS_STARTS=starts is not None)
    _launch_v3(logits, lens, lens if starts is None else starts, out, cfg, sm_count(logits.device) or 1, window)


def topk_progs_v3(rows: int, num_sms: int, cap: int) -> int:
    """One-warp filter programs a long row gets in v3: about 32 an SM in all (64 rows on 132
    SMs: 64; 256 rows: 16), a power of two, with at least 128 candidate slots each."""
    per_row = max(1, 32 * num_sms // max(rows, 1))
    return max(1, min(1 << (per_row.bit_length() - 1), cap // 128, 256))


def select_load_v3(k: int, samples: int, width: int, seg: int, progs: int) -> int:
    """Candidate slots of each filter segment the v3 select loads first: a power of two at or
    above the expected candidates a segment plus four standard deviations (full-width rows,
    the most candidates), at most ``seg``. The cut-off keeps about ``target / samples`` of a row
    (``_topk_cutoff_kernel``), so a segment of ``width / progs`` columns holds about that share."""
    expected = -(-k * samples // width)
    target = min(expected + 4 * int(expected**0.5) + 8, samples)
    mean = target * width / samples / progs
    return min(seg, triton.next_power_of_2(int(mean + 4 * mean**0.5) + 1))


def _filter_tiles(cfg: dict, logits: torch.Tensor) -> tuple[int, int]:
    """(V, AHEAD) of the v3 filter: the settings, or for logits larger than the L2 cache (streamed
    from DRAM) 4-wide tiles with two loaded ahead, else 8-wide tiles with one. H200, B = 256,
    L = 128K (134 MB): 81.3 -> 74.6 us; on L2-resident rows (B = 64, L = 128K) the 8-wide tiles
    are faster (25.6 against 26.9 us)."""
    l2_bytes = l2_cache_bytes(logits.device)
    streamed = l2_bytes is not None and logits.shape[0] * logits.stride(0) * logits.element_size() > l2_bytes
    vec = cfg["V"] or (4 if streamed else 8)
    ahead = cfg["AHEAD"] or (2 if streamed else 1)
    check_launch(ahead in (1, 2), f"v3: AHEAD is 1 or 2, not {ahead}")
    return vec, ahead


def _v3_shape(cfg: dict, rows: int, k: int, width: int, num_sms: int) -> tuple[int, int, int, int]:
    """(CAP, PROGS, SAMPLES, LOAD) of a v3 launch: the settings, or their defaults for the shape."""
    cap = cfg.get("CAP") or max(128, triton.next_power_of_2(CANDIDATES_PER_K * k))
    progs = cfg.get("PROGS") or topk_progs_v3(rows, num_sms, cap)
    samples = cfg["SAMPLES"] or 2048
    return cap, progs, samples, cfg["LOAD"] or select_load_v3(k, samples, width, cap // progs, progs)


def _launch_v3(logits, lens, starts, out, cfg, num_sms, window):
    rows, k = logits.shape[0], out.shape[1]
    cap, progs, samples, load = _v3_shape(cfg, rows, k, logits.shape[1], num_sms)
    bins = cfg["BINS"]
    vec, ahead = _filter_tiles(cfg, logits)
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
    tile = {"TILE_ASM": False}
    if cfg["tile_asm"] and cfg["asm"] and PTX_AVAILABLE and vec in FILTER_TILE_V:
        tile = {"TILE_ASM": True, "TILE_PTX": filter_tile_ptx(vec), "TILE_REGS": filter_tile_regs(vec)}
    _topk_filter_v3_kernel[(progs, rows)](logits, lens, starts, cut, shift, hist, seg, counts, stride, **window,
                                          SEG_CAP=cap // progs, V=vec, ALIGNED=aligned,
                                          USE_ASM=cfg["asm"] and PTX_AVAILABLE, AHEAD=ahead, num_warps=1,
                                          **tile, **pdl, **common)
    skip = {}
    gluon_warps = cfg["gluon_select_warps"]
    if _gluon_select(cfg, logits, progs, load, gluon_warps, bins):
        from dsacache.ops.topk.gluon_kernels import topk_select_ballot_kernel

        done = torch.empty(rows, dtype=torch.int32, device=device)
        topk_select_ballot_kernel[(rows,)](lens, starts, out, cut, shift, hist, seg.view(torch.int64), counts,
                                           buf_keys, buf_pos, done, window["width"], buf_keys.stride(0),
                                           SEG=cap // progs, LOAD=load, CAP=cap, TIES=cfg["TIES"],
                                           HAS_STARTS=window["HAS_STARTS"], PDL=pdl["PDL"], num_warps=gluon_warps,
                                           **({"launch_pdl": True} if pdl["PDL"] else {}), **common)
        skip = {"done_ptr": done, "SKIP_DONE": True}
        if cfg["select"] == "gluon-only":
            return  # tests: the rows the Gluon select leaves stay unwritten
    _topk_select_v3_kernel[(rows,)](logits, lens, starts, out, cut, shift, hist, seg.view(torch.int64), counts,
                                    buf_keys, buf_pos, stride, **window, BLOCK=cfg["BLOCK"], CAP=cap, BITS=RADIX_BITS,
                                    TIES=cfg["TIES"], LOAD=load, TILE=32 * vec, num_warps=select_warps, **skip, **pdl,
                                    **common)


def select_kernel(config: dict, logits: torch.Tensor, k: int) -> str:
    """Which select a v3 launch on ``logits`` runs first (for reports): "gluon" or "triton"."""
    cfg = {**TOPK_CONFIG, **config}
    _, progs, _, load = _v3_shape(cfg, logits.shape[0], k, logits.shape[1], sm_count(logits.device) or 1)
    use = _gluon_select(cfg, logits, progs, load, cfg["gluon_select_warps"], cfg["BINS"])
    return "gluon" if use else "triton"


def _gluon_select(cfg: dict, logits: torch.Tensor, progs: int, load: int, num_warps: int, bins: int) -> bool:
    """Whether the v3 select runs the Gluon kernel first (``gluon_kernels``): ``cfg["select"]``
    says so, compiled CUDA on a Hopper or newer GPU, and shapes its layouts tile exactly."""
    if cfg["select"] not in ("gluon", "gluon-only") or not PTX_AVAILABLE or not logits.is_cuda:
        return False
    return (torch.cuda.get_device_capability(logits.device)[0] >= 9 and load % 32 == 0
            and (progs * load // 32) % num_warps == 0
            and bins % (32 * num_warps) == 0 and cfg["TIES"] % 32 == 0)


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
