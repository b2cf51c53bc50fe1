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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.ops.triton_utils import check_launch, loop_bound

#: Launch settings: BLOCK logits a step, SAMPLES sorted for the cut-off. CAP (candidate
#: buffer length, default CANDIDATES_PER_K * k) and SPLITS (programs a row's candidate
#: search uses, default from the row count) may be set to override.
TOPK_CONFIG = {"BLOCK": 2048, "SAMPLES": 1024, "num_warps": 8, "CAP": None, "SPLITS": None}
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
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        hist = tl.zeros([BINS], tl.int32)
        for c in tl.range(0, loop_bound(tl.where(done, 0, num_blocks)), num_stages=3):
            idx = c * BLOCK + lanes
            valid = idx < n
            key = _keys_at(src, idx, valid, FROM_LOGITS)
            if p > 0:
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
def _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride):
    n = tl.load(lens_ptr + row)
    return n, logits_ptr + row.to(tl.int64) * row_stride + tl.load(starts_ptr + row)


@triton.jit
def _topk_filter_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32, clamped to the row
    starts_ptr,       # [R] int32, clamped to the row
    seg_keys_ptr,     # [R, SPLITS, CAP] int32 scratch: candidate keys of each split, in order
    seg_pos_ptr,      # [R, SPLITS, CAP] int32 scratch: their positions
    counts_ptr,       # [R, SPLITS] int32: candidates found by each split (may exceed CAP)
    row_stride,
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr, SPLITS: tl.constexpr,
):
    """Step 1 of a long row, split over SPLITS programs: sampled cut-off, then candidates."""
    split = tl.program_id(0)
    row = tl.program_id(1)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride)
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
                     CAP: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
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
        src = owner.to(tl.int64) * CAP + offset
        tl.store(buf_keys + j, tl.load(seg_keys + src, mask=valid), mask=valid)
        tl.store(buf_pos + j, tl.load(seg_pos + src, mask=valid), mask=valid)


@triton.jit
def _topk_select_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32, clamped to the row
    starts_ptr,       # [R] int32, clamped to the row
    out_ptr,          # [R, K] int32
    seg_keys_ptr,     # [R, SPLITS, CAP] int32 (from _topk_filter_kernel)
    seg_pos_ptr,      # [R, SPLITS, CAP] int32
    counts_ptr,       # [R, SPLITS] int32
    buf_keys_ptr,     # [R, CAP] int32 scratch
    buf_pos_ptr,      # [R, CAP] int32 scratch
    row_stride,
    K: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLES: tl.constexpr,
    SPLITS: tl.constexpr, BITS: tl.constexpr,
):
    """Step 2, one program a row: exact selection (from the candidates when they suffice)."""
    row = tl.program_id(0)
    n, row_ptr = _row_setup(logits_ptr, lens_ptr, starts_ptr, row, row_stride)
    out_row = out_ptr + row.to(tl.int64) * K
    want = tl.minimum(n, K)

    if n <= K:
        _collect(row_ptr, row_ptr, n, tl.full([], -1, tl.int64), 0, out_row, True, BLOCK)
    elif n <= 2 * SAMPLES:
        cut, ties = _radix_select(row_ptr, n, want, True, BLOCK, BITS)
        _collect(row_ptr, row_ptr, n, cut, ties, out_row, True, BLOCK)
    else:
        counts = tl.load(counts_ptr + row * SPLITS + tl.arange(0, SPLITS))
        total = tl.sum(counts, axis=0)
        if (tl.max(counts, axis=0) <= CAP) & (total >= want) & (total <= CAP):
            buf_keys = buf_keys_ptr + row.to(tl.int64) * CAP
            buf_pos = buf_pos_ptr + row.to(tl.int64) * CAP
            seg = row.to(tl.int64) * SPLITS * CAP
            _gather_segments(seg_keys_ptr + seg, seg_pos_ptr + seg, counts, buf_keys, buf_pos, total,
                             CAP, SPLITS, BLOCK)
            tl.debug_barrier()  # the buffer was written by other threads of this program
            cut, ties = _radix_select(buf_keys, total, want, False, BLOCK, BITS)
            _collect(buf_keys, buf_pos, total, cut, ties, out_row, False, BLOCK)
        else:
            cut, ties = _radix_select(row_ptr, n, want, True, BLOCK, BITS)
            _collect(row_ptr, row_ptr, n, cut, ties, out_row, True, BLOCK)

    lanes = tl.arange(0, BLOCK)
    for c in range(0, K, BLOCK):
        idx = c + lanes
        tl.store(out_row + idx, tl.full([BLOCK], -1, tl.int32), mask=(idx >= want) & (idx < K))


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
    """Programs a long row's candidate search is split over: about half the SMs' worth of
    programs in all (measured best on an H200 at 64 rows: 2; at 256 rows: 1)."""
    return max(1, min(8, triton.next_power_of_2(triton.cdiv(num_sms, 2 * max(rows, 1)))))


def launch_topk(logits: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, out: torch.Tensor,
                config: dict | None = None) -> None:
    """Fill ``out [R, k]`` with the top-k positions of each row of ``logits [R, *]`` (two launches)."""
    cfg = {**TOPK_CONFIG, **(config or {})}
    check_launch(logits.stride(1) == 1 and out.is_contiguous(), "contiguous logits rows and out")
    check_launch(lens.is_contiguous() and starts.is_contiguous(), "contiguous lengths and row starts")
    rows, k = logits.shape[0], out.shape[1]
    cap = cfg.get("CAP") or CANDIDATES_PER_K * k
    splits = cfg.get("SPLITS") or topk_splits(rows, _num_sms(logits.device))
    seg_keys = torch.empty(rows, splits, cap, dtype=torch.int32, device=logits.device)
    seg_pos = torch.empty_like(seg_keys)
    counts = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    buf_keys = torch.empty(rows, cap, dtype=torch.int32, device=logits.device)
    buf_pos = torch.empty_like(buf_keys)
    common = dict(K=k, BLOCK=cfg["BLOCK"], CAP=cap, SAMPLES=cfg["SAMPLES"], SPLITS=splits,
                  num_warps=cfg["num_warps"])
    _topk_filter_kernel[(splits, rows)](logits, lens, starts, seg_keys, seg_pos, counts, logits.stride(0), **common)
    _topk_select_kernel[(rows,)](logits, lens, starts, out, seg_keys, seg_pos, counts, buf_keys, buf_pos,
                                 logits.stride(0), BITS=RADIX_BITS, **common)


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
