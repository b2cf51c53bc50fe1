"""Which top-k kernels run, with which settings, and their launches (and positions -> slots').

A row of ``n`` valid logits is selected one of two ways:

* a short row (``n <= max(k, 2 * samples)``): the select kernel takes it alone (all of it,
  or a radix select over the row);
* a long row: cut down to a few thousand candidates closed upwards (every key at or above
  a cut-off), then selected exactly, in three steps:

  1. the cut-off key, from samples (``cutoff.py``);
  2. the candidates in position order and their histogram (``filter.py``);
  3. the exact top k from them (``select_triton.py``, or ``select_gluon.py`` on Hopper).

On Hopper and newer (compiled CUDA), logits up to ``TopkConfig.row_max_len`` wide with
16-byte aligned rows (decode rows, or prefill windows with row starts) take one launch of
``row_gluon.topk_row_kernel`` for all three steps, a program a row, which finishes every row
itself (the rare row its steps cannot take by radix passes over the row); other logits take
the Triton cut-off and filter, then the Gluon ballot select
(``select_gluon.topk_select_ballot_kernel``, which counts the candidate histogram in shared
memory, the filter leaving it), then ``select_triton.topk_select_kernel`` for the rows the
ballot select leaves (short rows, a missed cut-off, a skewed row).
Elsewhere the steps are three Triton kernels,
``cutoff.topk_cutoff_kernel`` (a program a row), ``filter.topk_filter_kernel`` (PROGS
one-warp programs a row) and ``select_triton.topk_select_kernel``, whose own branches cover a
missed cut-off and a skewed row.

On Hopper and newer (``triton_utils.dependent_launch``) every kernel, the first too, is
launched with programmatic dependent launch: it starts while the kernel before it finishes
and waits (``griddepcontrol.wait``) before reading anything.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from dsacache.ops.topk.cutoff import topk_cutoff_kernel
from dsacache.ops.topk.filter import FILTER_TILE_V, filter_tile_ptx, filter_tile_regs, pool_layout, topk_filter_kernel
from dsacache.ops.topk.select_triton import topk_select_kernel
from dsacache.ops.topk.slots import positions_to_slots_kernel
from dsacache.ops.triton_utils import INTERPRET, check_launch, dependent_launch, l2_cache_bytes, \
    shared_buffer_offset, sm_count

#: Inline PTX where it exists (compiled CUDA); the interpreter and ROCm take the plain Triton ops.
PTX_AVAILABLE = not INTERPRET and torch.version.hip is None
#: Default candidate buffer a row, in multiples of k: room for a cut-off that keeps a few times k.
CANDIDATES_PER_K = 4
#: Digit of the radix passes over candidates and whole rows (16-bin histograms).
RADIX_BITS = 4
#: The values of ``TopkConfig.select``.
SELECTS = ("gluon", "triton", "gluon-only")
#: Largest candidate buffer a row: the Triton select's tiles over 32768 candidates need more shared
#: memory than an H200 SM has (the default for the largest k, 4096, is 16384).
MAX_CAP = 16384


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """Launch settings of top-k; ``None`` picks the default for the shape."""

    #: logits a step of the radix select over a whole row (short rows, a missed cut-off): a row in few steps
    block: int = 2048
    #: keys the cut-off is found from: enough that it keeps between k and CAP candidates on almost every row
    samples: int = 2048
    #: adjacent logits a sample run: 8 fp32 are one 32-byte memory sector
    sample_run: int = 8
    #: bits a radix pass of the cut-off search fixes (32 bins, 6 passes at most, the last two bits left 0, which
    #: only lowers the cut-off): 0.3-0.8 us faster than 4 bits at every measured shape, 6 and 8 bits slower; in
    #: the Hopper row kernel also the digit of the radix passes that cut a chosen bin past ``ties`` candidates
    sample_bits: int = 5
    #: warps of the cut-off kernel's one program a row (the samples in registers, 8 a thread)
    cutoff_warps: int = 8
    #: candidate buffer a row, a power of two from 128 to MAX_CAP (None: CANDIDATES_PER_K * k)
    cap: int | None = None
    #: candidate histogram bins: fine enough that the chosen bin rarely holds more than ``ties``
    bins: int = 2048
    #: the Hopper row kernel's bins (None: 1024 when its programs share SMs, more rows than SMs, else ``bins``):
    #: two programs an SM make its per-row histogram work the larger cost, and the row kernel cuts a fuller
    #: chosen bin itself (measured in docs/benchmarks.md)
    row_bins: int | None = None
    #: one-warp filter programs a row (None: about 32 an SM in all, ``filter_programs``)
    progs: int | None = None
    #: logits a lane a filter step (None: 8; since the filter no longer counts candidates in L2, 4 is slower
    #: also where the logits stream from DRAM: its fixed cost a tile is then what bounds the scan)
    vec: int | None = None
    #: filter tiles loaded ahead of the one scanned, 1 or 2 (None: 1; 2 was no faster at 8 logits a lane)
    ahead: int | None = None
    #: candidate slots of each segment the select loads first (None: ``select_first_load``)
    load: int | None = None
    #: largest chosen bin ranked pairwise (ties^2 compares; a larger bin takes radix passes over its candidates)
    ties: int = 32
    #: programmatic dependent launch of every top-k kernel (Hopper and newer): hides the gaps between launches
    pdl: bool = True
    #: "gluon": on Hopper, the row kernel (``row_gluon``) or, for wider logits, the Gluon ballot
    #: select after the Triton filter, where they apply; "triton": the three Triton kernels only
    #: (the path off Hopper); "gluon-only", for tests: no Triton select after the ballot select
    #: (rows it leaves stay unwritten; the row kernel leaves none)
    select: str = "gluon"
    #: warps of the Triton select (None: 8 when the rows fit one wave on the SMs, which is
    #: latency-bound and holds a row's candidates without spilling, else 16)
    select_warps: int | None = None
    #: warps of the Gluon ballot select (after the Triton filter)
    gluon_select_warps: int = 8
    #: warps of the Hopper row kernel: a warp a filter slice and segment (PROGS)
    row_warps: int = 16
    #: register cap a thread of the row kernel (None: what ptxas picks): 64 lets two 16-warp programs
    #: share an SM, so 256 rows run in one wave on 132 SMs (no spills at 64)
    row_maxnreg: int | None = 64
    #: widest logits the Hopper short-row kernel takes (``short_gluon``: the whole row in registers, no
    #: sampled cut-off; 0: none), at most 16 logits a thread of ``short_warps``: faster than the row kernel
    #: at 2K and 4K, slower at 8K (measured in docs/benchmarks.md)
    short_max_len: int = 4096
    #: warps of the Hopper short-row kernel
    short_warps: int = 16
    #: register cap a thread of the short-row kernel (None: what ptxas picks, 61 at 4K and 79 at 8K): 64 lets
    #: two programs share an SM (no spills at 64)
    short_maxnreg: int | None = 64
    #: widest logits the Hopper row kernel takes: a row's one program streams it with W warps, while
    #: the Triton filter spreads a longer row over many SMs (at B = 64 the row kernel is faster at
    #: 8K and 32K, slower at 64K and 128K; measured in docs/benchmarks.md)
    row_max_len: int = 32768

    def __post_init__(self) -> None:
        if self.select not in SELECTS:
            raise ValueError(f"select={self.select!r}; allowed: {', '.join(SELECTS)}")
        if self.ahead not in (None, 1, 2):
            raise ValueError(f"ahead={self.ahead}; allowed: None, 1, 2")
        if self.short_max_len < 0 or self.short_warps < 1 or self.short_warps & (self.short_warps - 1):
            raise ValueError(f"short_max_len={self.short_max_len}, short_warps={self.short_warps}; allowed: "
                             "short_max_len >= 0 (0: no short-row kernel), short_warps a power of two")
        if self.cap is not None and (self.cap < 128 or self.cap > MAX_CAP or self.cap & (self.cap - 1)):
            raise ValueError(f"cap={self.cap}; allowed: a power of two from 128 to {MAX_CAP}, or None")
        for name in ("bins", "row_bins"):
            value = getattr(self, name)
            if value is not None and (value < 32 or value & (value - 1)):
                raise ValueError(f"{name}={value}; allowed: a power of two, at least 32"
                                 + (", or None" if name == "row_bins" else ""))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A launch's settings resolved for its shape and device."""

    cap: int
    progs: int
    load: int
    vec: int
    ahead: int
    select_warps: int
    #: candidate histogram bins of this launch (the row kernel's ``row_bins`` or ``bins``)
    bins: int
    #: L2 eviction policy of the filter's logits loads: "evict_first" for logits larger than L2, which
    #: every row reads once, so the candidate segments and histograms the select reads stay in L2
    evict: str
    #: what runs before the Triton select: "short" (the Hopper short-row kernel) or "row" (the Hopper
    #: row kernel), each finishing every row itself; "gluon" (the Triton cut-off and filter, then the
    #: Gluon ballot select) or "triton" (the Triton cut-off and filter)
    first: str


def filter_programs(rows: int, num_sms: int, cap: int) -> int:
    """One-warp filter programs a long row gets: about 32 an SM in all (64 rows on 132 SMs:
    64; 256 rows: 16), a power of two, with at least 128 candidate slots each."""
    per_row = max(1, 32 * num_sms // max(rows, 1))
    return max(1, min(1 << (per_row.bit_length() - 1), cap // 128, 256))


def select_first_load(k: int, samples: int, width: int, seg: int, progs: int) -> int:
    """Candidate slots of each filter segment the select loads first: a power of two at or
    above the expected candidates a segment plus four standard deviations (full-width rows,
    the most candidates), at most ``seg``. The cut-off keeps about ``target / samples`` of a row
    (``cutoff.topk_cutoff_kernel``), so a segment of ``width / progs`` columns holds about that share."""
    width = max(width, 1)  # zero-width logits have no long row: any value will do
    expected = -(-k * samples // width)
    target = min(expected + 4 * int(expected**0.5) + 8, samples)
    mean = target * width / samples / progs
    return min(seg, triton.next_power_of_2(int(mean + 4 * mean**0.5) + 1))


def _plan(cfg: TopkConfig, logits: torch.Tensor, k: int) -> _Plan:
    rows, width = logits.shape
    num_sms = sm_count(logits.device) or 1
    cap = cfg.cap or max(128, triton.next_power_of_2(CANDIDATES_PER_K * k))
    l2_bytes = l2_cache_bytes(logits.device)
    streamed = l2_bytes is not None and rows * logits.stride(0) * logits.element_size() > l2_bytes
    vec = cfg.vec or 8
    gluon = _gluon_allowed(cfg, logits)
    row_bins = cfg.row_bins or (1024 if rows > num_sms else cfg.bins)
    row = gluon and width <= cfg.row_max_len and _row_kernel_fits(cfg, logits, cap, vec, row_bins)
    progs = cfg.row_warps if row else cfg.progs or filter_programs(rows, num_sms, cap)
    load = cfg.load or select_first_load(k, cfg.samples, width, cap // progs, progs)
    if gluon and cfg.short_max_len and width <= min(cfg.short_max_len, 16 * 32 * cfg.short_warps):
        first = "short"
    elif row and load % 32 == 0:
        first = "row"
    elif gluon and _ballot_select_fits(cfg, progs, load):
        first = "gluon"
    else:
        first = "triton"
    return _Plan(cap=cap, progs=progs, load=load, vec=vec, ahead=cfg.ahead or 1,
                 select_warps=cfg.select_warps or (8 if rows <= num_sms else 16),
                 bins=row_bins if first == "row" else cfg.bins, evict="evict_first" if streamed else "",
                 first=first)


def _gluon_allowed(cfg: TopkConfig, logits: torch.Tensor) -> bool:
    """``cfg.select`` allows a Gluon kernel, and it is compiled CUDA on a Hopper or newer GPU."""
    if cfg.select == "triton" or not PTX_AVAILABLE or not logits.is_cuda:
        return False
    return torch.cuda.get_device_capability(logits.device)[0] >= 9


def _ballot_select_fits(cfg: TopkConfig, progs: int, load: int) -> bool:
    """The Gluon ballot select's layouts tile these settings exactly."""
    warps = cfg.gluon_select_warps
    return (load % 32 == 0 and (progs * load // 32) % warps == 0 and cfg.bins % (32 * warps) == 0
            and cfg.ties % 32 == 0)


def _row_kernel_fits(cfg: TopkConfig, logits: torch.Tensor, cap: int, vec: int, bins: int) -> bool:
    """The Hopper row kernel takes these rows and settings: 16-byte aligned rows (the tile PTX)
    and layouts that tile exactly (the candidate slots loaded first, a multiple of 32, are
    checked by ``_plan``)."""
    warps = cfg.row_warps
    return (_aligned(logits) and vec in FILTER_TILE_V and bins % (32 * warps) == 0
            and cfg.samples % (32 * warps) == 0 and cfg.ties % 32 == 0 and 128 * warps <= cap)


def _aligned(logits: torch.Tensor) -> bool:
    """Rows 16-byte aligned, so 4-wide loads never cross a row's end."""
    return logits.shape[1] % 4 == 0 and logits.stride(0) % 4 == 0 and logits.data_ptr() % 16 == 0


def select_kernel(logits: torch.Tensor, k: int, config: TopkConfig | None = None) -> str:
    """What a launch on ``logits`` runs before the Triton select (for reports): "short" (the
    Hopper short-row kernel), "row" (the Hopper row kernel), "gluon" (cut-off, filter, Gluon
    ballot select) or "triton"."""
    return _plan(config or TopkConfig(), logits, k).first


def launch_topk(logits: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None, out: torch.Tensor,
                config: TopkConfig | None = None) -> None:
    """Fill ``out [R, k]`` with the top-k positions of each row of ``logits [R, L]``.

    ``lens`` and ``starts`` (None: every row starts at 0) are int32 or int64 and clamped to
    the row by the kernels. The arguments are checked by ``api.topk_indices``.
    """
    cfg = config or TopkConfig()
    check_launch(logits.stride(1) == 1 and out.is_contiguous(), "contiguous logits rows and out")
    check_launch(lens.is_contiguous() and (starts is None or starts.is_contiguous()),
                 "contiguous lengths and row starts")
    rows, k = logits.shape[0], out.shape[1]
    plan = _plan(cfg, logits, k)
    pdl = {"PDL": True, "launch_pdl": True} if cfg.pdl and dependent_launch(logits.device) else {"PDL": False}
    window = dict(width=logits.shape[1], HAS_STARTS=starts is not None)
    starts = lens if starts is None else starts  # never read without HAS_STARTS
    if plan.first == "short":
        from dsacache.ops.topk.short_gluon import topk_short_row_kernel  # Gluon is imported only where it runs

        cols = max(triton.next_power_of_2(logits.shape[1]), 32 * cfg.short_warps)
        topk_short_row_kernel[(rows,)](logits, lens, starts, out, logits.stride(0), **window, K=k, COLS=cols,
                                       BITS=cfg.sample_bits, num_warps=cfg.short_warps, **pdl,
                                       **({"maxnreg": cfg.short_maxnreg} if cfg.short_maxnreg else {}))
        return
    cap, progs, vec = plan.cap, plan.progs, plan.vec
    check_launch(cap & (cap - 1) == 0 and progs & (progs - 1) == 0 and 128 * progs <= cap < 2**16,
                 "cap and progs powers of two, 128 * progs <= cap < 65536")
    check_launch(vec & (vec - 1) == 0 and plan.bins & (plan.bins - 1) == 0 and cfg.samples % cfg.sample_run == 0,
                 "vec and bins powers of two, sample_run divides samples")
    device = logits.device
    seg = torch.empty(rows, cap, 2, dtype=torch.int32, device=device)  # [R, PROGS, CAP // PROGS, 2]
    counts = torch.empty(rows, progs, dtype=torch.int32, device=device)
    buf_keys = torch.empty(rows, cap + cfg.ties, dtype=torch.int32, device=device)
    buf_pos = torch.empty_like(buf_keys)
    cut = torch.empty(rows, dtype=torch.int32, device=device)
    shift = torch.empty_like(cut)
    stride = logits.stride(0)
    common = dict(K=k, SAMPLES=cfg.samples, PROGS=progs, BINS=plan.bins)
    skip = {}
    if plan.first == "row":
        from dsacache.ops.topk.row_gluon import topk_row_kernel  # Gluon is imported only where it runs

        args = (logits, lens, starts, out, cut, shift, seg.view(torch.int64), counts, buf_keys, buf_pos, stride,
                window["width"], buf_keys.stride(0))
        consts = dict(K=k, SAMPLES=cfg.samples, SAMPLE_RUN=cfg.sample_run, SAMPLE_BITS=cfg.sample_bits,
                      SEG=cap // progs, LOAD=plan.load, CAP=cap, BINS=plan.bins, TIES=cfg.ties, V=vec,
                      TILE_PTX=filter_tile_ptx(vec, "shared"), TILE_REGS=filter_tile_regs(vec, "shared"),
                      AHEAD=plan.ahead, HAS_STARTS=window["HAS_STARTS"], EVICT=plan.evict, num_warps=progs, **pdl,
                      **({"maxnreg": cfg.row_maxnreg} if cfg.row_maxnreg else {}))
        # It finishes every row itself: no Triton select after it.
        topk_row_kernel[(rows,)](*args, _hist_offset(topk_row_kernel, (rows,), args, consts), **consts)
        return
    hist = torch.empty(rows, plan.bins, dtype=torch.int32, device=device)
    pool = new_pool(rows, cap, progs, vec, device)
    pooled = _launch_cutoff_and_filter(cfg, plan, logits, lens, starts, cut, shift, hist, seg, counts, pool, window,
                                       pdl, common)
    if plan.first == "gluon":
        from dsacache.ops.topk.select_gluon import topk_select_ballot_kernel

        done = torch.empty(rows, dtype=torch.int32, device=device)
        args = (lens, starts, out, cut, shift, hist, seg.view(torch.int64), counts, buf_keys, buf_pos, pool, done,
                window["width"], buf_keys.stride(0))
        consts = dict(SEG=cap // progs, LOAD=plan.load, CAP=cap, TIES=cfg.ties, HAS_STARTS=window["HAS_STARTS"],
                      PDL=pdl["PDL"], TILE=32 * vec, num_warps=cfg.gluon_select_warps,
                      **pooled, **({"launch_pdl": True} if pdl["PDL"] else {}), **common)
        topk_select_ballot_kernel[(rows,)](*args, _hist_offset(topk_select_ballot_kernel, (rows,), args, consts),
                                           **consts)
        skip = {"done_ptr": done, "SKIP_DONE": True}
    if skip and cfg.select == "gluon-only":
        return
    topk_select_kernel[(rows,)](logits, lens, starts, out, cut, shift, hist, seg.view(torch.int64), counts,
                                buf_keys, buf_pos, pool, stride, **window, BLOCK=cfg.block, CAP=cap, BITS=RADIX_BITS,
                                TIES=cfg.ties, LOAD=plan.load, TILE=32 * vec, num_warps=plan.select_warps, **skip,
                                **pooled, **pdl, **common)


def new_pool(rows: int, cap: int, progs: int, vec: int, device: torch.device) -> torch.Tensor:
    """Scratch for the rows' candidate pools (``filter.pool_layout``): [R, row words] int32."""
    return torch.empty(rows, pool_layout(cap, progs, 32 * vec)[3], dtype=torch.int32, device=device)


def pool_constants(pool: torch.Tensor, cap: int, progs: int, vec: int) -> dict:
    """The pool settings the filter and both selects take (``filter.pool_layout``)."""
    blocks, _, _, words = pool_layout(cap, progs, 32 * vec)
    check_launch(pool.is_contiguous() and pool.shape[1] == words, "a pool from new_pool")
    return {"POOL": blocks, "POOL_ROW": words}


def _launch_cutoff_and_filter(cfg: TopkConfig, plan: _Plan, logits: torch.Tensor, lens: torch.Tensor,
                              starts: torch.Tensor, cut: torch.Tensor, shift: torch.Tensor, hist: torch.Tensor,
                              seg: torch.Tensor, counts: torch.Tensor, pool: torch.Tensor, window: dict, pdl: dict,
                              common: dict) -> dict:
    """Steps 1 and 2 of the Triton path: the cut-off kernel, then the filter (dependent launch),
    each program's candidates past its segment in the row's ``pool`` (``new_pool``); returns the
    pool's constants (``pool_constants``) for the selects. Before the Gluon ballot select the
    filter does not count its candidates: that select does."""
    rows, k, vec = logits.shape[0], common["K"], plan.vec
    count_hist = plan.first != "gluon"
    stride = logits.stride(0)
    pooled = pool_constants(pool, plan.cap, plan.progs, vec)
    topk_cutoff_kernel[(rows,)](logits, lens, starts, cut, shift, hist, pool, stride, **window, K=k,
                                SAMPLES=cfg.samples, SAMPLE_RUN=cfg.sample_run, BINS=cfg.bins,
                                SAMPLE_BITS=cfg.sample_bits, ZERO_HIST=count_hist, TILE=32 * vec,
                                num_warps=cfg.cutoff_warps, **pooled, **pdl)
    tile = {"TILE_ASM": False}
    if PTX_AVAILABLE and vec in FILTER_TILE_V:
        at = "global" if count_hist else "none"
        tile = {"TILE_ASM": True, "TILE_PTX": filter_tile_ptx(vec, at, pooled["POOL"]),
                "TILE_REGS": filter_tile_regs(vec, at, pooled["POOL"])}
    topk_filter_kernel[(plan.progs, rows)](logits, lens, starts, cut, shift, hist, seg, counts, pool, stride,
                                           **window, SEG_CAP=plan.cap // plan.progs, V=vec, ALIGNED=_aligned(logits),
                                           USE_ASM=PTX_AVAILABLE, AHEAD=plan.ahead, EVICT=plan.evict,
                                           COUNT=count_hist, num_warps=1, **pooled,
                                           **tile, **pdl,
                                           **common)
    return pooled


#: (kernel, device, constants) -> byte offset of the kernel's shared histogram (``hist_buf``)
_HIST_OFFSETS: dict = {}


def _hist_offset(kernel, grid: tuple, args: tuple, consts: dict) -> int:
    """Where the compiler placed a Gluon kernel's shared histogram, found once per compiled variant."""
    key = (kernel.fn.__name__, args[0].device, *sorted(consts.items()))
    if key not in _HIST_OFFSETS:
        compiled = kernel.warmup(*args, 0, grid=grid, **consts)
        _HIST_OFFSETS[key] = shared_buffer_offset(compiled, "hist_buf")
    return _HIST_OFFSETS[key]


def launch_positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                              next_n: int, num_pages: int, page_size: int) -> None:
    """Fill ``out [R, k]`` with cache slots of ``positions [R, k]`` (checked by ``api.positions_to_slots``)."""
    check_launch(positions.stride(1) == 1 and block_table.stride(1) == 1 and out.is_contiguous(),
                 "contiguous positions rows, block_table rows and out")
    block = 1024
    grid = (positions.shape[0], triton.cdiv(positions.shape[1], block))
    positions_to_slots_kernel[grid](
        positions, block_table, out, positions.shape[1], positions.stride(0), block_table.stride(0),
        block_table.shape[1], num_pages, NEXT_N=next_n, PAGE=page_size, BLOCK=block, num_warps=4,
    )
