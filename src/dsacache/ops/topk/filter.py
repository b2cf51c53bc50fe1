"""Step 2 of a long row: the candidates at or above the cut-off, in position order.

PROGS one-warp programs a row (~32 an SM): each streams its slice with the next tile's loads
in flight, tests ``x >= float(cut)`` (the cut-off is never +0.0 or NaN), places candidates
with a warp-local prefix sum and writes (key, position) pairs and, with COUNT, histogram
counts with predicated PTX stores, so nothing goes through shared memory and no barrier
stalls the loop. (On Hopper the ballot select that follows counts the candidates in shared
memory instead: a histogram ``red`` a candidate was an L2 transaction each.) On aligned
rows a tile step is one PTX block (``filter_tile_ptx``) that does the per-candidate work
only where a lane keeps one; unaligned rows take the per-logit predicated stores. Without
PTX (the interpreter) the same work is plain ``tl.store`` / ``tl.atomic_add``.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from dsacache.ops.topk.keys import key_to_float, sortable_key_not_nan
from dsacache.ops.topk.rows import long_row, row_window
from dsacache.ops.triton_utils import INTERPRET, loop_bound

if not INTERPRET:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: The logits-a-lane counts the tile-step PTX supports (one to four runs of 4).
FILTER_TILE_V = (4, 8, 16)


@triton.jit
def topk_filter_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 (from topk_cutoff_kernel)
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
    EVICT: tl.constexpr = "",  # L2 eviction policy of the logits loads ("" or "evict_first")
    COUNT: tl.constexpr = True,  # count the candidates into hist_ptr (False: the Hopper ballot select counts them)
):
    """PROGS one-warp programs a long row: candidates at or above the row's cut-off.

    One warp a program keeps every scan inside the warp (no barrier in the loop) and lets
    ~32 programs share an SM, so enough loads are in flight to stream the row. With PDL the
    select kernel is let launch once every program is past its loop."""
    prog = tl.program_id(0)
    row = tl.program_id(1)
    start, n = row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    if long_row(n, K, SAMPLES):
        lo, hi = filter_slice(start, n, prog, PROGS, 32 * V)
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
                             TILE_ASM and ALIGNED, TILE_PTX, TILE_REGS, AHEAD, EVICT, COUNT)
        if PDL:
            gdc_launch_dependents()
        tl.store(counts_ptr + row * PROGS + prog, count)


@triton.jit
def filter_slice(start, n, prog, PROGS: tl.constexpr, TILE: tl.constexpr):
    """Columns [lo, hi) of a row that filter program ``prog`` scans: a row's window [start,
    start + n) cut into PROGS slices of whole TILE-column tiles, aligned so the loads vectorize
    (slice 0 may begin before ``start``; the columns before it are never candidates)."""
    end = start + n
    first = tl.multiple_of((start // TILE) * TILE, TILE)
    chunk = tl.multiple_of(tl.cdiv(tl.cdiv(end - first, PROGS), TILE) * TILE, TILE)
    lo = first + prog * chunk
    return lo, tl.minimum(lo + chunk, end)


@triton.jit
def _filter_warp(row_ptr, start, lo, hi, hi_load, cut_ptr, shift_ptr, hist_row, seg,
                 SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr, USE_ASM: tl.constexpr,
                 PDL: tl.constexpr, TILE_ASM: tl.constexpr = False, TILE_PTX: tl.constexpr = "",
                 TILE_REGS: tl.constexpr = "", AHEAD: tl.constexpr = 1, EVICT: tl.constexpr = "",
                 COUNT: tl.constexpr = True):
    """One warp's candidates of columns [lo, hi) (``hi_load >= hi`` bounds the loads, a multiple
    of 4 when ``lo`` is, so they vectorize): (key, position - start) pairs of each key >= cut,
    in order, into the segment ``seg`` (at most SEG_CAP pairs), each counted into the row's
    histogram of ``(key - cut) >> shift`` (the last bin open). The next tile is loaded before
    this one is scanned, so two tiles of loads are in flight.

    ``cut`` is never the key of +0.0 or of NaN (``cutoff.float_cut``), so ``x >= float(cut)``
    is ``key(x) >= cut``: the test runs on the float, the key is built only to be stored.
    With PDL (programmatic dependent launch) the first tile is loaded before waiting for the
    cut-off kernel, whose cut-off, shift and zeroed histogram are used after the wait.
    TILE_ASM runs each tile step as one block of PTX (``filter_tile_ptx``: the per-candidate
    work only where some lane keeps a candidate) instead of per-logit predicated stores
    (needs 16-byte aligned tiles).
    Returns the count (may exceed SEG_CAP)."""
    TILE: tl.constexpr = 32 * V
    lanes = tl.arange(0, TILE)
    span = (hi - start).to(tl.uint32)
    count = tl.zeros([], tl.int32)
    counts = tl.zeros([TILE], tl.int32)  # TILE_ASM: the running count, the same in every lane
    col = lo + lanes
    x = tl.load(row_ptr + col, mask=col < hi_load, other=0.0, eviction_policy=EVICT)
    if AHEAD == 2:
        x_ahead = tl.load(row_ptr + col + TILE, mask=col + TILE < hi_load, other=0.0, eviction_policy=EVICT)
    if PDL:
        gdc_wait()
    cut = tl.load(cut_ptr).to(tl.uint32, bitcast=True)
    shift = tl.load(shift_ptr)
    cut_f = key_to_float(cut)
    for c in tl.range(0, loop_bound(tl.cdiv(hi - lo, TILE)), num_stages=1):
        nxt = col + TILE
        if AHEAD == 2:
            x_next = x_ahead
            x_ahead = tl.load(row_ptr + nxt + TILE, mask=nxt + TILE < hi_load, other=0.0,
                              eviction_policy=EVICT)
        else:
            x_next = tl.load(row_ptr + nxt, mask=nxt < hi_load, other=0.0, eviction_policy=EVICT)
        pos = col - start
        if TILE_ASM:
            counts = _filter_tile_asm(TILE_PTX, TILE_REGS, x, pos, counts, cut_f, span, cut, shift, seg, hist_row,
                                      SEG_CAP, BINS, V)
        else:
            keep = (x >= cut_f) & (pos.to(tl.uint32) < span)
            keep_i = keep.to(tl.int32)
            slot = count + tl.cumsum(keep_i, axis=0) - keep_i
            key = sortable_key_not_nan(x)
            bin_ = tl.minimum((key - cut) >> shift, BINS - 1).to(tl.int32)
            key = key.to(tl.int32, bitcast=True)
            if USE_ASM:
                _store_candidate_asm(seg, hist_row, slot, bin_, key, pos, keep, SEG_CAP, COUNT)
            else:
                room = keep & (slot < SEG_CAP)
                tl.store(seg + 2 * slot, key, mask=room)
                tl.store(seg + 2 * slot + 1, pos, mask=room)
                if COUNT:
                    tl.atomic_add(hist_row + bin_, 1, mask=keep, sem="relaxed")
            count += tl.sum(keep_i, axis=0)
        col = nxt
        x = x_next
    if TILE_ASM:
        count = tl.max(counts, axis=0)
    return count


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


# (key, pos) to seg[slot] (if in room) and hist[bin] += 1, where kept; without the count, the first half only.
_STORE_ASM = """{ .reg .pred k, r; .reg .b64 a;
        setp.ne.b32 k, $7, 0;
        setp.lt.and.s32 r, $3, $8, k;
        mad.wide.s32 a, $3, 8, $1;
        @r st.global.v2.b32 [a], {$5, $6};"""
_STORE_CANDIDATE_ASM = tl.constexpr(_STORE_ASM + """
        mad.wide.s32 a, $4, 4, $2;
        @k red.global.add.u32 [a], 1;
        mov.b32 $0, 0; }""")
_STORE_CANDIDATE_ONLY_ASM = tl.constexpr(_STORE_ASM + """
        mov.b32 $0, 0; }""")


@triton.jit
def _store_candidate_asm(seg, hist_row, slot, bin_, key, pos, keep, SEG_CAP: tl.constexpr, COUNT: tl.constexpr):
    """Where ``keep``: seg[2 * slot : 2 * slot + 2] = (key, pos) (if slot < SEG_CAP), one
    predicated 8-byte store, and hist_row[bin_] += 1, as PTX. As ``tl.store`` and
    ``tl.atomic_add`` the scattered addresses would make Triton move every value into a
    one-element-a-thread layout through shared memory first; here they stay in the load's."""
    if COUNT:
        asm: tl.constexpr = _STORE_CANDIDATE_ASM
    else:
        asm: tl.constexpr = _STORE_CANDIDATE_ONLY_ASM
    tl.inline_asm_elementwise(
        asm,
        "=r,l,l,r,r,r,r,r,r",
        [seg.to(tl.int64, bitcast=True), hist_row.to(tl.int64, bitcast=True), slot, bin_, key, pos,
         keep.to(tl.int32), tl.full(slot.shape, SEG_CAP, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def filter_tile_ptx(v: int, hist: str = "global") -> str:
    """PTX for one warp's tile step of the filter (``_filter_tile_asm``), ``v`` logits a lane;
    each candidate counted into the histogram at a 64-bit global address (``hist="global"``), at
    a 32-bit shared-memory address (``"shared"``, the Hopper row kernel) or not at all
    (``"none"``, the Triton filter before the ballot select, which counts).

    The tile is laid out as the 4-wide loads leave it: a lane holds ``v / 4`` runs of 4 adjacent
    logits, run ``r`` of lane ``l`` at tile columns ``128 r + 4 l .. + 3``. Position order is run,
    then lane, then column, so each lane counts its kept logits per run in one 8-bit field of a
    packed word, and one warp scan of that word gives every run's lane offsets at once.

    The per-candidate work (key, histogram bin, stores) then runs in passes over the lanes'
    kept values: a pass takes each lane's lowest kept value not yet written (picked from the
    lane's ``v`` registers by a select tree over its index), so a tile takes as many passes as
    its busiest lane keeps values. A 32K row keeps ~9 % of its logits (``cutoff.py``'s target):
    about 3 passes a tile at v = 8, against 8 column steps (some lane keeps almost every column)
    before, which also cuts the stores a tile from 16 mostly idle ones to about 6.
    Operands (``pack=v``, each input passed as v registers, only the first read for the scalar
    ones): out count; x bits, positions, count, cut-off float bits, span, cut-off key, shift,
    segment and histogram pointers, segment capacity, last bin.
    """
    if hist not in ("global", "shared", "none"):
        raise ValueError(f"hist={hist!r}; allowed: 'global', 'shared', 'none'")
    runs = v // 4
    out = lambda i: f"${i}"                      # noqa: E731
    arg = lambda k, i=0: f"${v + k * v + i}"     # noqa: E731
    x, pos, count, cutf, span, cut, shift, seg, hist_arg, cap, last = range(11)
    offset = lambda i: 128 * (i // 4) + i % 4    # noqa: E731  (column of value i from the lane's first)
    index_bits = (v - 1).bit_length()            # bits of a value's index in the lane: the select tree's depth
    lines = ["{", f".reg .pred q, y, {', '.join(f'k{i}' for i in range(v))}, {', '.join(f's{b}' for b in range(4))};",
             ".reg .b32 c, s, t, u, ex, tot, acc, key, bin, p, m, j;",
             f".reg .b32 {', '.join(f'b{r}' for r in range(runs))}, {', '.join(f'w{i}' for i in range(v // 2))};",
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
    # c: kept values a run (8-bit fields); m: the lane's kept values as a bit mask
    lines += ["KEPT_${:uid}:", "mov.b32 c, 0;", "mov.b32 m, 0;"]
    lines += [f"@k{i} add.u32 c, c, {1 << (8 * (i // 4))};" for i in range(v)]
    lines += [f"@k{i} or.b32 m, m, {1 << i};" for i in range(v)]
    lines.append("mov.b32 s, c;")
    for d in (1, 2, 4, 8, 16):
        lines += [f"shfl.sync.up.b32 t|y, s, {d}, 0, -1;", "@y add.u32 s, s, t;"]
    lines += ["shfl.sync.idx.b32 tot, s, 31, 31, -1;", "sub.u32 ex, s, c;", f"mov.b32 acc, {arg(count)};"]
    for r in range(runs):  # run r starts after the whole warp's earlier runs and this run's earlier lanes
        lines += [f"bfe.u32 t, ex, {8 * r}, 8;", f"add.u32 b{r}, acc, t;",
                  f"bfe.u32 t, tot, {8 * r}, 8;", "add.u32 acc, acc, t;"]
    lines += ["setp.eq.u32 y, tot, 0;", "@y bra.uni DONE_${:uid};"]
    # a pass: j = the lane's lowest kept value left (y: the lane has one), cleared from m
    lines += ["PASS_${:uid}:", "setp.ne.u32 y, m, 0;", "vote.sync.any.pred q, y, -1;", "@!q bra.uni DONE_${:uid};",
              "brev.b32 t, m;", "clz.b32 j, t;", "sub.u32 t, m, 1;", "and.b32 m, m, t;"]
    for b in range(index_bits):
        lines += [f"and.b32 t, j, {1 << b};", f"setp.ne.u32 s{b}, t, 0;"]
    level = [arg(x, i) for i in range(v)]  # x[j]: bit b of j picks within each pair of level b
    for b in range(index_bits):
        lines += [f"selp.b32 w{h}, {level[2 * h + 1]}, {level[2 * h]}, s{b};" for h in range(len(level) // 2)]
        level = [f"w{h}" for h in range(len(level) // 2)]
    lines += [f"shr.s32 t, {level[0]}, 31;", "or.b32 t, t, 0x80000000;", f"xor.b32 key, {level[0]}, t;",
              f"sub.u32 bin, key, {arg(cut)};", f"shr.u32 bin, bin, {arg(shift)};", f"min.u32 bin, bin, {arg(last)};",
              "shr.u32 t, j, 2;", "shl.b32 t, t, 7;", "and.b32 u, j, 3;", f"add.s32 p, {arg(pos)}, t;",
              "add.s32 p, p, u;"]
    # its slot: the next one of run j >> 2 (bits 2 and 3 of j)
    lines += {1: ["mov.b32 u, b0;"], 2: ["selp.b32 u, b1, b0, s2;"],
              4: ["selp.b32 t, b1, b0, s2;", "selp.b32 u, b3, b2, s2;", "selp.b32 u, u, t, s3;"]}[runs]
    lines += [f"setp.lt.and.s32 q, u, {arg(cap)}, y;", f"mad.wide.s32 a, u, 8, {arg(seg)};",
              "@q st.global.v2.b32 [a], {key, p};"]
    if hist == "shared":
        lines += [f"mad.lo.u32 t, bin, 4, {arg(hist_arg)};", "@y red.shared.add.u32 [t], 1;"]
    elif hist == "global":
        lines += [f"mad.wide.u32 a, bin, 4, {arg(hist_arg)};", "@y red.global.add.u32 [a], 1;"]
    lines += ["shr.u32 t, j, 2;"]
    for r in range(runs):
        lines += [f"setp.eq.and.u32 q, t, {r}, y;", f"@q add.u32 b{r}, b{r}, 1;"]
    lines += ["bra.uni PASS_${:uid};", "DONE_${:uid}:"]
    lines += [f"mov.b32 {out(i)}, acc;" for i in range(v)]
    lines.append("}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def filter_tile_regs(v: int, hist: str = "global") -> str:
    """Inline-asm constraints of ``filter_tile_ptx(v, hist)``: v outputs, then the inputs (7 x v
    32-bit, the segment pointer and the histogram's address, 64-bit or, in shared memory,
    32-bit, x v each, 2 x v 32-bit)."""
    return ",".join(["=r"] * v + ["r"] * (7 * v) + ["l"] * v + ["r" if hist == "shared" else "l"] * v + ["r"] * (2 * v))
