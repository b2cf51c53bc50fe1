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

Where a program's candidates go (the one rule both selects read back, ``pool_layout``):
slots [0, SEG) of its own segment, then pool blocks of one tile (32 V slots) each, taken from
the row's pool as the program fills them (an atomic on the row's cursor, which the cut-off kernel
zeroes; the block's owner recorded beside it). A skewed row (logits growing with the position, a
hot stretch) then keeps every candidate, in order, without reading the row again: a program takes
its blocks in increasing number, so its candidates are its segment followed by the blocks it owns
in increasing number, each full but the last. Whenever a row's candidates fit CAP, the pool
(CAP / tile + PROGS blocks) holds every program's overflow: at most CAP / tile blocks plus one
partly filled block a program.
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


def pool_layout(cap: int, progs: int, tile: int) -> tuple[int, int, int, int]:
    """A row's candidate pool in int32 words: (blocks, owner index, cursor index, row words).
    ``blocks`` blocks of ``tile`` (key, position) pairs, then each block's owner (the filter
    program that took it), then the cursor (blocks taken so far; it may run past ``blocks``), the
    row padded to 16 bytes. CAP / tile + PROGS blocks (the module docstring says why)."""
    blocks = cap // tile + progs
    owner, cursor = pool_words(blocks, tile)
    return blocks, owner, cursor, -(-(cursor + 1) // 4) * 4


def pool_words(blocks: int, tile: int) -> tuple[int, int]:
    """Word index of block 0's owner and of the cursor in a pool row of ``blocks`` blocks of ``tile``
    pairs (``pool_layout``; in kernels ``pool_owners`` and ``pool_cursor``)."""
    owner = 2 * blocks * tile
    return owner, owner + blocks


@triton.jit
def topk_filter_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    cut_ptr,          # [R] int32 (from topk_cutoff_kernel)
    shift_ptr,        # [R] int32
    hist_ptr,         # [R, BINS] int32: candidates a bin, accumulated by every program of the row
    seg_ptr,          # [R, PROGS, SEG_CAP, 2] int32 scratch: (key, position) of each program's first candidates
    counts_ptr,       # [R, PROGS] int32: candidates found by each program (may exceed SEG_CAP)
    pool_ptr,         # [R, POOL_ROW] int32 scratch: the rest, in pool blocks (``pool_layout``; the cursor zeroed
                      # by the cut-off kernel)
    row_stride, width,  # logits row stride and width (columns)
    K: tl.constexpr, SAMPLES: tl.constexpr, PROGS: tl.constexpr, SEG_CAP: tl.constexpr, BINS: tl.constexpr,
    V: tl.constexpr, ALIGNED: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr,
    HAS_STARTS: tl.constexpr,  # False: every row starts at column 0 (starts_ptr unused)
    TILE_ASM: tl.constexpr = False,  # see _filter_warp; needs ALIGNED
    TILE_PTX: tl.constexpr = "", TILE_REGS: tl.constexpr = "",  # with TILE_ASM: filter_tile_ptx(V), filter_tile_regs(V)
    AHEAD: tl.constexpr = 1,  # tiles loaded ahead of the one scanned (1 or 2)
    EVICT: tl.constexpr = "",  # L2 eviction policy of the logits loads ("" or "evict_first")
    COUNT: tl.constexpr = True,  # count the candidates into hist_ptr (False: the Hopper ballot select counts them)
    POOL: tl.constexpr = 0, POOL_ROW: tl.constexpr = 0,  # pool blocks and row words (pool_layout(CAP, PROGS, 32 V))
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
                             hist_ptr + row.to(tl.int64) * BINS, seg, pool_ptr + row.to(tl.int64) * POOL_ROW, prog,
                             SEG_CAP, BINS, V, USE_ASM, PDL, TILE_ASM and ALIGNED, TILE_PTX, TILE_REGS, AHEAD,
                             EVICT, COUNT, POOL)
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
def _filter_warp(row_ptr, start, lo, hi, hi_load, cut_ptr, shift_ptr, hist_row, seg, pool_row, prog,
                 SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr, USE_ASM: tl.constexpr,
                 PDL: tl.constexpr, TILE_ASM: tl.constexpr = False, TILE_PTX: tl.constexpr = "",
                 TILE_REGS: tl.constexpr = "", AHEAD: tl.constexpr = 1, EVICT: tl.constexpr = "",
                 COUNT: tl.constexpr = True, POOL: tl.constexpr = 0):
    """One warp's candidates of columns [lo, hi) (``hi_load >= hi`` bounds the loads, a multiple
    of 4 when ``lo`` is, so they vectorize): (key, position - start) pairs of each key >= cut,
    in order, into the segment ``seg`` (SEG_CAP pairs) and, past it when POOL > 0, into blocks of
    the row's pool (``pool_row``, ``pool_layout``: POOL blocks) taken as program ``prog`` fills
    them; each counted into the row's histogram of ``(key - cut) >> shift`` (the last bin open).
    The next tile is loaded before this one is scanned, so two tiles of loads are in flight.

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
    last = tl.zeros([], tl.int32)  # the program's last pool block (Triton steps)
    counts = tl.zeros([TILE], tl.int32)  # TILE_ASM: the running count, and the last pool block (below)
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
                                      pool_row, prog, SEG_CAP, BINS, V)
        else:
            keep = (x >= cut_f) & (pos.to(tl.uint32) < span)
            keep_i = keep.to(tl.int32)
            slot = count + tl.cumsum(keep_i, axis=0) - keep_i
            found = tl.sum(keep_i, axis=0)
            key = sortable_key_not_nan(x)
            bin_ = tl.minimum((key - cut) >> shift, BINS - 1).to(tl.int32)
            key = key.to(tl.int32, bitcast=True)
            dst, room, last = _candidate_places(seg, pool_row, prog, slot, count, found, last, keep, SEG_CAP, TILE,
                                                POOL)
            if USE_ASM:
                _store_candidate_asm(dst, room, hist_row, bin_, key, pos, keep, COUNT)
            else:
                tl.store(dst, key, mask=room)
                tl.store(dst + 1, pos, mask=room)
                if COUNT:
                    tl.atomic_add(hist_row + bin_, 1, mask=keep, sem="relaxed")
            count += found
        col = nxt
        x = x_next
    if TILE_ASM:
        # every lane's values hold the count but its second (column 4 l + 1), the last pool block
        count = tl.max(tl.where((lanes % 4 == 1) & (lanes < 128), 0, counts), axis=0)
    return count


@triton.jit
def _blocks_for(count, SEG: tl.constexpr, BS: tl.constexpr):
    """Pool blocks of BS slots a program holds once it has ``count`` candidates (SEG in its segment)."""
    return tl.cdiv(tl.maximum(count, SEG) - SEG, BS)


@triton.jit
def _candidate_places(seg, pool_row, prog, slot, count, found, last, keep, SEG: tl.constexpr, BS: tl.constexpr,
                      POOL: tl.constexpr):
    """Where a tile step's candidates go (the Triton steps' form of the PTX's rule): slots below SEG
    in the segment, the rest in pool blocks of BS (one tile, so a step needs at most one new block,
    taken here). ``slot``: each candidate's slot, ``count`` / ``found``: candidates before / in this
    step, ``last``: the program's last block. Returns (int32 pointer of each pair, where to store,
    the last block after this step)."""
    if POOL > 0:
        have = _blocks_for(count, SEG, BS)
        bound = SEG + BS * have  # slots below it: the segment or the last block; from it: a new block
        grows = _blocks_for(count + found, SEG, BS) > have
        taken = POOL + 0 * count
        if grows:
            taken = tl.minimum(tl.atomic_add(pool_row + pool_cursor(POOL, BS), 1, sem="relaxed"), POOL)
            tl.store(pool_row + pool_owners(POOL, BS) + taken, prog, mask=taken < POOL)
        block = tl.where(slot < bound, last, taken)
        at = tl.where(slot < bound, slot - (bound - BS), slot - bound)
        in_pool = slot >= SEG
        dst = tl.where(in_pool, pool_row + 2 * (block * BS + at), seg + 2 * slot)
        room = keep & (~in_pool | (block < POOL))
        # POOL when no block was left: the program's later candidates are dropped (its row is over CAP)
        last = tl.where(grows, taken, last)
    else:
        dst = seg + 2 * slot
        room = keep & (slot < SEG)
    return dst, room, last


@triton.jit
def pool_owners(POOL: tl.constexpr, BS: tl.constexpr):
    """Word index of block 0's owner in a pool row of POOL blocks of BS pairs (``pool_layout``)."""
    return 2 * POOL * BS


@triton.jit
def pool_cursor(POOL: tl.constexpr, BS: tl.constexpr):
    """Word index of the cursor in a pool row (``pool_layout``): after the POOL owners."""
    return 2 * POOL * BS + POOL


@triton.jit
def _filter_tile_asm(asm: tl.constexpr, regs: tl.constexpr, x, pos, count, cut_f, span, cut, shift, seg, hist_row,
                     pool_row, prog, SEG_CAP: tl.constexpr, BINS: tl.constexpr, V: tl.constexpr):
    """One tile step of the filter as PTX (``filter_tile_ptx`` with its pool: ``pool_row``, program
    ``prog``); ``count`` is the running count broadcast over the tile (with a pool, each lane's
    second value the program's last pool block), returned updated."""
    shape: tl.constexpr = x.shape
    return tl.inline_asm_elementwise(
        asm, regs,
        [x.to(tl.int32, bitcast=True), pos, count, tl.full(shape, cut_f, tl.float32).to(tl.int32, bitcast=True),
         tl.full(shape, span, tl.uint32).to(tl.int32, bitcast=True),
         tl.full(shape, cut, tl.uint32).to(tl.int32, bitcast=True), tl.full(shape, shift, tl.int32),
         tl.full(shape, seg.to(tl.int64, bitcast=True), tl.int64),
         tl.full(shape, hist_row.to(tl.int64, bitcast=True), tl.int64), tl.full(shape, SEG_CAP, tl.int32),
         tl.full(shape, BINS - 1, tl.int32), tl.full(shape, pool_row.to(tl.int64, bitcast=True), tl.int64),
         tl.full(shape, prog, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=V)


# (key, pos) to [dst] where room, and hist[bin] += 1 where kept; without the count, the first half only.
_STORE_ASM = """{ .reg .pred k, r;
        setp.ne.b32 k, $6, 0;
        setp.ne.b32 r, $7, 0;
        @r st.global.v2.b32 [$1], {$4, $5};"""
_STORE_CANDIDATE_ASM = tl.constexpr(_STORE_ASM + """
        { .reg .b64 a;
        mad.wide.s32 a, $3, 4, $2;
        @k red.global.add.u32 [a], 1; }
        mov.b32 $0, 0; }""")
_STORE_CANDIDATE_ONLY_ASM = tl.constexpr(_STORE_ASM + """
        mov.b32 $0, 0; }""")


@triton.jit
def _store_candidate_asm(dst, room, hist_row, bin_, key, pos, keep, COUNT: tl.constexpr):
    """Where ``room``: (key, pos) to the pair at ``dst`` (``_candidate_places``), one predicated
    8-byte store, and where ``keep`` hist_row[bin_] += 1, as PTX. As ``tl.store`` and
    ``tl.atomic_add`` the scattered addresses would make Triton move every value into a
    one-element-a-thread layout through shared memory first; here they stay in the load's."""
    if COUNT:
        asm: tl.constexpr = _STORE_CANDIDATE_ASM
    else:
        asm: tl.constexpr = _STORE_CANDIDATE_ONLY_ASM
    tl.inline_asm_elementwise(
        asm,
        "=r,l,l,r,r,r,r,r",
        [dst.to(tl.int64, bitcast=True), tl.full(bin_.shape, hist_row.to(tl.int64, bitcast=True), tl.int64), bin_,
         key, pos, keep.to(tl.int32), room.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def filter_tile_ptx(v: int, hist: str = "global", pool: int = 0) -> str:
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
    With a pool (``pool``: its blocks, ``pool_layout``; not with the shared histogram), the slots
    past the segment go to pool blocks of one tile (32 v slots): a step whose candidates all fit
    the segment stores as before; otherwise it knows the (at most two) places its slots fall in,
    the segment or the program's last block and a new block taken by lane 0 (an atomic on the
    row's cursor, the owner written beside it), and picks one a candidate. The last block travels
    in each lane's second count value. A step that keeps every logit of the tile (a slice full of
    candidates, as in sorted rows) skips the passes: its slots are its columns, stored at once.
    Operands (``pack=v``, each input passed as v registers, only the first read for the scalar
    ones): out count (with a pool, the second out the last block, read back as the second count
    in); x bits, positions, count, cut-off float bits, span, cut-off key, shift, segment and
    histogram pointers, segment capacity, last bin; with a pool, the row's pool pointer and the
    program's index.
    """
    if hist not in ("global", "shared", "none"):
        raise ValueError(f"hist={hist!r}; allowed: 'global', 'shared', 'none'")
    if pool < 0 or (pool and hist == "shared"):
        raise ValueError(f"pool={pool} with hist={hist!r}; allowed: pool >= 0, and 0 with the shared histogram")
    runs = v // 4
    out = lambda i: f"${i}"                      # noqa: E731
    arg = lambda k, i=0: f"${v + k * v + i}"     # noqa: E731
    x, pos, count, cutf, span, cut, shift, seg, hist_arg, cap, last, pool_arg, prog = range(13)
    tile = 32 * v
    owner_bytes, cursor_bytes = (4 * word for word in pool_words(pool, tile))
    offset = lambda i: 128 * (i // 4) + i % 4    # noqa: E731  (column of value i from the lane's first)
    index_bits = (v - 1).bit_length()            # bits of a value's index in the lane: the select tree's depth
    lines = ["{", f".reg .pred q, y, {', '.join(f'k{i}' for i in range(v))}, {', '.join(f's{b}' for b in range(4))};",
             ".reg .b32 c, s, t, u, ex, tot, acc, key, bin, p, m, j;",
             f".reg .b32 {', '.join(f'b{r}' for r in range(runs))}, {', '.join(f'w{i}' for i in range(v // 2))};",
             ".reg .b64 a;"]
    if pool:
        lines += [".reg .b32 c0, hv, nd, bnd, offa, offs, lb, nb, oo;", ".reg .b64 basea, baseb, bases;",
                  ".reg .pred fast, ina, oka, okb, oks, r2;"]
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
    lines += ["shfl.sync.idx.b32 tot, s, 31, 31, -1;", "sub.u32 ex, s, c;"]
    if pool:
        lines += [f"mov.b32 acc, {arg(count)};", f"mov.b32 lb, {arg(count, 1)};", "mov.b32 c0, acc;"]
    else:
        lines += [f"mov.b32 acc, {arg(count)};"]
    for r in range(runs):  # run r starts after the whole warp's earlier runs and this run's earlier lanes
        lines += [f"bfe.u32 t, ex, {8 * r}, 8;", f"add.u32 b{r}, acc, t;",
                  f"bfe.u32 t, tot, {8 * r}, 8;", "add.u32 acc, acc, t;"]
    lines += ["setp.eq.u32 y, tot, 0;", "@y bra.uni DONE_${:uid};"]
    if pool:
        lines += _pool_places_ptx(arg(cap), arg(seg), arg(pool_arg), arg(prog), pool, tile, owner_bytes, cursor_bytes)
    # a pass: j = the lane's lowest kept value left (y: the lane has one), cleared from m. With a pool,
    # three copies of the loop: a step whose slots all lie in the segment (fast) stores as without
    # one, a step whose slots lie in one place of the pool (one) at that place's base and offset, and
    # a step across two places picks one a candidate.
    home = [f"setp.lt.and.s32 q, u, {arg(cap)}, y;", f"mad.wide.s32 a, u, 8, {arg(seg)};",
            "@q st.global.v2.b32 [a], {key, p};"]
    single = ["sub.u32 oo, u, offs;", "mad.wide.u32 a, oo, 8, bases;", "and.pred q, oks, y;",
              "@q st.global.v2.b32 [a], {key, p};"]
    placed = ["setp.lt.u32 ina, u, bnd;", "sub.u32 t, u, offa;", "sub.u32 oo, u, bnd;", "selp.b32 oo, t, oo, ina;",
              "selp.b64 a, basea, baseb, ina;", "mad.wide.u32 a, oo, 8, a;", "and.pred q, ina, oka;",
              "not.pred r2, ina;", "and.pred r2, r2, okb;", "or.pred q, q, r2;", "and.pred q, q, y;",
              "@q st.global.v2.b32 [a], {key, p};"]
    if pool:  # a step that keeps every logit goes straight to its stores (DENSE, below)
        lines += [f"setp.eq.u32 q, m, {(1 << v) - 1};", "vote.sync.all.pred q, q, -1;", "@q bra.uni DENSE_${:uid};",
                  "@!fast bra.uni POOLED_${:uid};"]
    loops = [("PASS", home)] + ([("POOLED", []), ("ONE", single), ("TWO", placed)] if pool else [])
    for label, store in loops:
        if label == "POOLED":  # which of the two pool loops: one place (ina: all in a, r2: all in b) or two
            lines += ["POOLED_${:uid}:", "setp.le.u32 ina, acc, bnd;", "setp.ge.u32 r2, c0, bnd;",
                      "selp.b64 bases, basea, baseb, ina;", "selp.b32 offs, offa, bnd, ina;",
                      "and.pred oks, ina, oka;", "and.pred q, r2, okb;", "or.pred oks, oks, q;",
                      "or.pred q, ina, r2;", "@!q bra.uni TWO_${:uid};"]
            continue
        lines += [label + "_${:uid}:", "setp.ne.u32 y, m, 0;", "vote.sync.any.pred q, y, -1;",
                  "@!q bra.uni DONE_${:uid};", "brev.b32 t, m;", "clz.b32 j, t;", "sub.u32 t, m, 1;",
                  "and.b32 m, m, t;"]
        for b in range(index_bits):
            lines += [f"and.b32 t, j, {1 << b};", f"setp.ne.u32 s{b}, t, 0;"]
        level = [arg(x, i) for i in range(v)]  # x[j]: bit b of j picks within each pair of level b
        for b in range(index_bits):
            lines += [f"selp.b32 w{h}, {level[2 * h + 1]}, {level[2 * h]}, s{b};" for h in range(len(level) // 2)]
            level = [f"w{h}" for h in range(len(level) // 2)]
        lines += [f"shr.s32 t, {level[0]}, 31;", "or.b32 t, t, 0x80000000;", f"xor.b32 key, {level[0]}, t;",
                  f"sub.u32 bin, key, {arg(cut)};", f"shr.u32 bin, bin, {arg(shift)};",
                  f"min.u32 bin, bin, {arg(last)};", "shr.u32 t, j, 2;", "shl.b32 t, t, 7;", "and.b32 u, j, 3;",
                  f"add.s32 p, {arg(pos)}, t;", "add.s32 p, p, u;"]
        # its slot: the next one of run j >> 2 (bits 2 and 3 of j)
        lines += {1: ["mov.b32 u, b0;"], 2: ["selp.b32 u, b1, b0, s2;"],
                  4: ["selp.b32 t, b1, b0, s2;", "selp.b32 u, b3, b2, s2;", "selp.b32 u, u, t, s3;"]}[runs]
        lines += store
        if hist == "shared":
            lines += [f"mad.lo.u32 t, bin, 4, {arg(hist_arg)};", "@y red.shared.add.u32 [t], 1;"]
        elif hist == "global":
            lines += [f"mad.wide.u32 a, bin, 4, {arg(hist_arg)};", "@y red.global.add.u32 [a], 1;"]
        lines += ["shr.u32 t, j, 2;"]
        for r in range(runs):
            lines += [f"setp.eq.and.u32 q, t, {r}, y;", f"@q add.u32 b{r}, b{r}, 1;"]
        lines += [f"bra.uni {label}_${{:uid}};"]
    if pool:
        lines += _dense_step_ptx(v, arg, offset, hist, placed, seg=arg(seg), cap=arg(cap))
    lines += ["DONE_${:uid}:"]
    lines += [f"mov.b32 {out(i)}, {'lb' if pool and i == 1 else 'acc'};" for i in range(v)]
    lines.append("}")
    return "\n".join(lines)


def _dense_step_ptx(v: int, arg, offset, hist: str, placed: list[str], seg: str, cap: str) -> list[str]:
    """PTX of a tile step that keeps every logit (``filter_tile_ptx`` with a pool): each value's
    slot is the step's first plus its column in the tile, so it is stored at once, without the
    passes. In a fast step (all in the segment) the places are set to the segment first, so the
    two-place store of the pool loop (``placed``, which reads u, key, p, y) serves both."""
    x, pos, cut, shift, hist_arg, last = 0, 1, 5, 6, 8, 10
    lines = ["DENSE_${:uid}:", f"@fast mov.b32 bnd, {cap};", "@fast mov.b32 offa, 0;", f"@fast mov.b64 basea, {seg};",
             "@fast setp.eq.u32 oka, 0, 0;", f"shfl.sync.idx.b32 j, {arg(pos)}, 0, 31, -1;", "setp.eq.u32 y, 0, 0;"]
    for i in range(v):
        lines += [f"add.s32 p, {arg(pos)}, {offset(i)};", "sub.s32 u, p, j;", "add.u32 u, u, c0;",
                  f"shr.s32 t, {arg(x, i)}, 31;", "or.b32 t, t, 0x80000000;", f"xor.b32 key, {arg(x, i)}, t;"]
        if hist == "global":
            lines += [f"sub.u32 bin, key, {arg(cut)};", f"shr.u32 bin, bin, {arg(shift)};",
                      f"min.u32 bin, bin, {arg(last)};", f"mad.wide.u32 a, bin, 4, {arg(hist_arg)};",
                      "red.global.add.u32 [a], 1;"]
        lines += placed
    return lines + ["bra.uni DONE_${:uid};"]


def _pool_places_ptx(seg_cap: str, seg: str, pool_ptr: str, prog: str, blocks: int, tile: int, owner_bytes: int,
                     cursor_bytes: int) -> list[str]:
    """PTX of a tile step's places with a pool (``filter_tile_ptx``), after the count: c0 / acc the
    count before / after the step, lb the last block. Sets fast (every slot in the segment: then
    nothing else is needed, and nothing else runs), else bnd (slots below it: region a, the
    segment or block lb, at offa; from it: region b, block nb), the bases and whether each region
    may be written (a block number of ``blocks`` means none was left)."""
    log = tile.bit_length() - 1
    held = lambda out, c: [f"max.u32 t, {c}, {seg_cap};", f"sub.u32 t, t, {seg_cap};",  # noqa: E731
                           f"add.u32 t, t, {tile - 1};", f"shr.u32 {out}, t, {log};"]
    return ([f"setp.le.u32 fast, acc, {seg_cap};", "@fast bra.uni SEGMENT_${:uid};"]
            + held("hv", "c0") + held("nd", "acc")
            + [f"shl.b32 bnd, hv, {log};", f"add.u32 bnd, bnd, {seg_cap};",
               "setp.eq.u32 q, hv, 0;", f"sub.u32 offa, bnd, {tile};", "selp.b32 offa, 0, offa, q;",
               f"mul.wide.u32 a, lb, {8 * tile};", f"add.s64 basea, {pool_ptr}, a;",
               f"selp.b64 basea, {seg}, basea, q;", f"setp.lt.u32 oka, lb, {blocks};", "or.pred oka, oka, q;",
               f"mov.b32 nb, {blocks};", "setp.gt.u32 q, nd, hv;", "@!q bra.uni PLACED_${:uid};",
               "mov.u32 t, %laneid;", "setp.eq.u32 q, t, 0;",
               f"@q atom.global.add.u32 nb, [{pool_ptr}+{cursor_bytes}], 1;",
               "shfl.sync.idx.b32 nb, nb, 0, 31, -1;", f"min.u32 nb, nb, {blocks};",
               f"setp.lt.and.u32 q, nb, {blocks}, q;", "mul.wide.u32 a, nb, 4;", f"add.s64 a, a, {pool_ptr};",
               f"@q st.global.u32 [a+{owner_bytes}], {prog};", "mov.b32 lb, nb;",
               "PLACED_${:uid}:",
               f"setp.lt.u32 okb, nb, {blocks};", f"mul.wide.u32 a, nb, {8 * tile};", f"add.s64 baseb, {pool_ptr}, a;",
               "SEGMENT_${:uid}:"])


@functools.lru_cache(maxsize=None)
def filter_tile_regs(v: int, hist: str = "global", pool: int = 0) -> str:
    """Inline-asm constraints of ``filter_tile_ptx(v, hist, pool)``: v outputs, then the inputs (7 x v
    32-bit, the segment pointer and the histogram's address, 64-bit or, in shared memory,
    32-bit, x v each, 2 x v 32-bit; with a pool, its pointer, 64-bit, and the program, 32-bit,
    x v each)."""
    regs = ["=r"] * v + ["r"] * (7 * v) + ["l"] * v + ["r" if hist == "shared" else "l"] * v + ["r"] * (2 * v)
    return ",".join(regs + (["l"] * v + ["r"] * v if pool else []))
