"""Top-k on Hopper for short logits rows: the whole row in registers, radix passes, no sampling.

Up to ``TopkConfig.short_max_len`` columns (4K by default, 8K at most) a row is at most 16
logits a thread of a 16-warp program, so it is loaded once and every step works on registers:

1. the keys (``keys.sortable_key``: the float order, NaN below ``-inf``) of the row's window;
2. ``select_gluon.radix_narrow`` over them for the ``min(n, k)``-th largest: first every bit
   the window's keys share (their maximum and minimum), then passes of BITS bits, each a
   histogram of the keys still matching and a cut, until the chosen bin is taken whole;
3. the positions above that key, then the first ones equal to it (ties to the lower position),
   written in position order through one CTA-wide scan, and ``-1`` up to k.

The row kernel (``row_gluon.py``) takes rows over 2 x 2048 logits through a sampled cut-off, a
filter into segments and a select, and shorter ones through radix passes that stream the row
from L2 each pass: at 2K and 4K this kernel is faster, at 8K slower (``docs/benchmarks.md``,
"Top-k 2048"). Any row, any window and any row alignment; the rule is the same as every other
path's (``naive.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsacache.ops.topk.select_gluon import _add, _gdc_launch_dependents, _gdc_wait, _row_window, _sortable_key, \
    fill_unused, radix_narrow


@gluon.jit
def topk_short_row_kernel(
    logits_ptr,       # [R, row_stride] fp32
    lens_ptr,         # [R] int32 or int64 valid lengths (clamped here)
    starts_ptr,       # [R] int32 or int64 first valid columns (clamped here)
    out_ptr,          # [R, K] int32
    row_stride, width,
    K: gl.constexpr,
    COLS: gl.constexpr,  # a power of two >= width, at least 32 * num_warps: the columns a program holds
    BITS: gl.constexpr,  # bits a radix pass fixes
    HAS_STARTS: gl.constexpr, PDL: gl.constexpr,
):
    W: gl.constexpr = gl.num_warps()
    L: gl.constexpr = gl.BlockedLayout([COLS // (32 * W)], [32], [W], [0])  # a thread: adjacent columns
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    row = gl.program_id(0)
    if PDL:  # launched with PDL: nothing is read before the kernel before this one has finished
        _gdc_wait()
        _gdc_launch_dependents()
    start, n = _row_window(lens_ptr, starts_ptr, row, width, HAS_STARTS)
    col = gl.arange(0, COLS, layout=L)
    valid = (col >= start) & (col < start + n)
    x = gl.load(logits_ptr + row.to(gl.int64) * row_stride + col, mask=valid, other=0.0)
    keys = _sortable_key(x).to(gl.uint32)
    want = gl.minimum(n, K)
    prefix, ties, whole = radix_narrow(keys, valid, n, want, (n * 0).to(gl.uint32), n * 0 + 32, 0, BITS,
                                       (32 + BITS - 1) // BITS, RL, True)
    # Above the cut, then the first `ties` equal to it in position order (all of them when whole).
    tie = (valid & (keys == prefix)).to(gl.int32)
    take = (valid & (keys > prefix)) | ((tie != 0) & (whole | (gl.associative_scan(tie, 0, _add) - tie < ties)))
    t = take.to(gl.int32)
    out_row = out_ptr + row.to(gl.int64) * K
    gl.store(out_row + gl.associative_scan(t, 0, _add) - t, col - start, mask=take)
    fill_unused(out_row, want, K, 32 * W, RL)
