"""Paged decode indexer logits (FP8 and MXFP4 keys) against the copy ceiling.

Keys live in a pool whose page stride is twice a page (another layer's page sits
between two of this layer's), and the block table is a random permutation, so the
kernel sees the access pattern of a packed cache. Bytes moved: every cached key entry
(values + scales) read once plus the fp32 logits written.

Times are CUDA-graph replays of the public function (``harness.time_graph``: how decode
steps run in serving engines); ``eager_us`` beside them adds the Python launch overhead of
one call. With ``--peers``, DeepGEMM's paged logits runs on each FP8 row's inputs, is checked
against the same reference inside each row's length and timed the same way; MXFP4 rows carry
their speed-up over that DeepGEMM FP8 time (DeepGEMM has no MXFP4 reader on Hopper).

A timed window repeats one call, so keys that fit in L2 (B = 32 at 8K: 35 MB of FP8 keys) stay
there from one call to the next, which a model step, reading each layer's keys once, does not
see. ``--tables N`` gives each shape N disjoint block tables over N times the pages, taken in
turn by the calls of a window (ours and the peer's alike): no call then finds its keys in L2.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from dsacache.bench.harness import BenchRow, CorrectnessError, in_turn, time_cuda, time_graph
from dsacache.bench.peers import attach_peer, peer_for
from dsacache.formats.indexer_key import fp8_page_views, mxfp4_page_views, quantize_fp8, quantize_mxfp4
from dsacache.formats.key_format import IndexerKeyFormat, indexer_entry_bytes
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_logits import paged_decode_logits

HEAD_DIM = 128
#: Largest relative error (calc-diff) accepted against the reference, by key format.
TOLERANCE = {"fp8": 1e-3, "mxfp4": 2e-2}
#: Tokens quantized at a time while filling the pool (bounds the fp32 temporaries).
FILL_CHUNK = 1 << 20
#: ``--shapes wide``: (batch, ctx) pairs off the target shapes, to see that no shape is tuned alone.
WIDE_SHAPES = ((32, 8192), (32, 65536), (128, 8192), (128, 65536))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--shapes", choices=["grid", "wide"], default="grid",
                        help="grid: every --batch with every --ctx; wide: B 32 and 128 at ctx 8K and 64K "
                             "(--batch and --ctx are then ignored)")
    parser.add_argument("--heads", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--next-n", type=int, default=1)
    parser.add_argument("--formats", nargs="+", default=["fp8", "mxfp4"], choices=["fp8", "mxfp4"])
    parser.add_argument("--sweep", action="store_true",
                        help="also time a grid of launch settings at the largest shape and print each")
    parser.add_argument("--tables", type=int, default=1,
                        help="disjoint block tables a shape's calls take in turn (N times the pages): with N > 1 "
                             "no call finds its keys in L2, as in a model step (default 1: one input set)")


def shape_pairs(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (batch, ctx) pairs to time."""
    if args.shapes == "wide":
        return list(WIDE_SHAPES)
    return list(itertools.product(args.batch, args.ctx))


def calc_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``1 - 2<x, y> / (<x, x> + <y, y>)`` over the finite reference entries."""
    mask = torch.isfinite(ref)
    x, y = out[mask].double(), ref[mask].double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def make_pages(num_pages: int, fmt: str, device: torch.device) -> torch.Tensor:
    """A layer's pages inside a pool of two interleaved layers, filled with random keys."""
    entry = indexer_entry_bytes(HEAD_DIM, fmt)
    pool = torch.zeros(num_pages, 2, KERNEL_PAGE_SIZE * entry, dtype=torch.uint8, device=device)
    pages = pool[:, 1].view(num_pages, KERNEL_PAGE_SIZE, entry)
    values, scales = (fp8_page_views if fmt == "fp8" else mxfp4_page_views)(pages, HEAD_DIM)
    quantize = quantize_fp8 if fmt == "fp8" else quantize_mxfp4
    step = max(1, FILL_CHUNK // KERNEL_PAGE_SIZE)
    for p in range(0, num_pages, step):
        keys = torch.randn(min(step, num_pages - p), KERNEL_PAGE_SIZE, HEAD_DIM, device=device)
        values[p:p + step], scales[p:p + step] = quantize(keys)
    return pages


def make_inputs(batch: int, ctx: int, heads: int, next_n: int, pages: torch.Tensor, seed: int = 0,
                tables: int = 1):
    """(q, weights, seq_lens, block_tables) of one shape: ``tables`` disjoint block tables
    ``[batch, ctx / 64]`` int32, pages drawn at random from ``pages`` without repeats."""
    gen = torch.Generator(device=pages.device).manual_seed(seed)
    blocks = ctx // KERNEL_PAGE_SIZE
    if tables < 1 or tables * batch * blocks > pages.shape[0]:
        raise ValueError(f"tables={tables} of {batch} x {blocks} pages need 1 <= tables and "
                         f"tables x {batch * blocks} <= {pages.shape[0]} pages")
    q = torch.randn(batch, next_n, heads, HEAD_DIM, device=pages.device, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.rand(batch * next_n, heads, device=pages.device, generator=gen) * heads**-0.5
    perm = torch.randperm(pages.shape[0], device=pages.device, generator=gen)[: tables * batch * blocks]
    block_tables = list(perm.to(torch.int32).view(tables, batch, blocks).unbind(0))
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=pages.device)
    return q, weights, seq_lens, block_tables


def check(args_tuple, fmt: str, max_model_len: int) -> tuple[float, torch.Tensor]:
    """Run both paths once; raise CorrectnessError unless they agree. Returns (calc-diff, reference)."""
    out = paged_decode_logits(*args_tuple, max_model_len=max_model_len, impl="triton")
    ref = paged_decode_logits(*args_tuple, max_model_len=max_model_len, impl="torch")
    if not torch.equal(torch.isneginf(out), torch.isneginf(ref)) or torch.isnan(out).any():
        raise CorrectnessError(f"{fmt} logits: -inf pattern differs from the reference (or NaN)")
    diff = calc_diff(out, ref)
    if diff > TOLERANCE[fmt]:
        raise CorrectnessError(f"{fmt} logits: calc-diff {diff:.2e} > {TOLERANCE[fmt]:.0e}")
    return diff, ref


def peer_agreement(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """A peer's FP8 logits against the reference where the reference is finite (inside each row's
    length: the peer leaves the rest undefined), with the FP8 tolerance: ``(agrees, note)``."""
    diff = calc_diff(out, ref)
    return diff <= TOLERANCE["fp8"], f"calc-diff {diff:.1e}"


def sweep_configs(fmt: str) -> list[dict]:
    """A few launch settings around the defaults (each compiles once, about a second)."""
    # A tile is one 64-token page; the table decode keeps keys in registers with 4 warps.
    if fmt == "fp8":  # the Gluon kernel's pages a program and ring (Hopper), then the Triton kernel's
        rings = [(16, 2), (32, 2), (16, 3), (32, 3), (32, 4), (64, 3)]
        grid = [(8, 2, 64), (16, 2, 64), (8, 3, 64)]
        gluon = [{"fp8_gluon_tiles": tiles, "fp8_gluon_stages": stages} for tiles, stages in rings]
        return gluon + [{"kernel": "triton", "TILES": t, "num_stages": st, "maxnreg": cap} for t, st, cap in grid]
    grid = [(16, 2, None), (8, 2, None), (32, 2, None), (16, 3, None), (8, 3, None), (16, 2, 64)]
    return [{"TILES": tiles, "num_stages": stages, "maxnreg": cap} for tiles, stages, cap in grid]


def run_sweep(args_tuple, fmt: str, max_model_len: int, ceiling: float, nbytes: int) -> None:
    from dsacache.ops.indexer_logits.launch import launch_paged_decode

    q, weights, seq_lens, pages, block_table = args_tuple
    values, scales = (fp8_page_views if fmt == "fp8" else mxfp4_page_views)(pages, HEAD_DIM)
    out = torch.empty(q.shape[0] * q.shape[1], max_model_len, dtype=torch.float32, device=q.device)
    ref = paged_decode_logits(*args_tuple, max_model_len=max_model_len, impl="torch")
    for cfg in sweep_configs(fmt):
        def launch():
            launch_paged_decode(q, weights, seq_lens, values, scales, block_table, out,
                                IndexerKeyFormat(fmt, HEAD_DIM), cfg)
        try:
            launch()
            ok = calc_diff(out, ref) < TOLERANCE[fmt] and torch.equal(out.isneginf(), ref.isneginf())
            ms = time_graph(launch)
        except Exception as err:  # a setting that does not compile is reported, not fatal
            print(f"sweep {fmt} H={q.shape[2]} {cfg}: failed ({type(err).__name__}: {err})"[:300])
            continue
        gbps = nbytes / (ms * 1e-3) / 1e9
        print(f"sweep {fmt} H={q.shape[2]} {cfg}: {ms * 1e3:.1f} us {gbps:.0f} GB/s {gbps / ceiling:.1%}"
              f"{'' if ok else ' WRONG'}", flush=True)


def time_row(args, inputs, fmt: str, ctx: int, nbytes: int, fp8_ms: dict, peer_ms: dict,
             more_tables: tuple = ()) -> BenchRow:
    """Check, then time the public function on one shape; FP8 rows get the peer beside them.
    FP8 times (ours and the peer's) are kept by shape for the MXFP4 rows' speed-up columns.
    ``more_tables``: further block tables the timed calls take in turn after ``inputs``' own."""
    q, weights, seq_lens, pages, first = inputs
    batch, heads = q.shape[0], q.shape[2]
    diff, ref = check(inputs, fmt, ctx)
    tables = (first, *more_tables)
    call = in_turn([functools.partial(paged_decode_logits, q, weights, seq_lens, pages, table, max_model_len=ctx)
                    for table in tables])
    ms = time_graph(call)
    extra = {"calc_diff": f"{diff:.1e}", "eager_us": f"{time_cuda(call) * 1e3:.1f}"}
    key = (batch, ctx, heads)
    if fmt == "mxfp4" and key in fp8_ms:
        extra["speedup_vs_fp8"] = f"{fp8_ms[key] / ms:.2f}x"
    if fmt == "mxfp4" and key in peer_ms:
        extra["deepgemm_fp8_us"] = f"{peer_ms[key] * 1e3:.1f}"
        extra["speedup_vs_deepgemm_fp8"] = f"{peer_ms[key] / ms:.2f}x"
    shape = f"{fmt} B={batch} ctx={ctx} H={heads} next_n={args.next_n}"
    if len(tables) > 1:
        shape += f" tables={len(tables)}"
    from dsacache.ops.indexer_logits.launch import decode_kernel

    views = (mxfp4_page_views if fmt == "mxfp4" else fp8_page_views)(pages, HEAD_DIM)
    extra["kernel"] = decode_kernel(q, views[0], views[1], IndexerKeyFormat(fmt, HEAD_DIM))
    row = BenchRow("paged_decode_logits", shape, ms, nbytes, args.ceiling_gbps, extra)
    if fmt == "fp8":
        fp8_ms[key] = ms
        peer = peer_for(args, "logits")
        def peer_call():
            return in_turn([peer.make_call(q, weights, seq_lens, pages, table, ctx) for table in tables])
        attach_peer(row, peer, peer_call, lambda out: peer_agreement(out, ref), timer=time_graph)
        if row.peer_ms is not None:
            peer_ms[key] = row.peer_ms
    return row


def run(args: argparse.Namespace) -> list[BenchRow]:
    device = torch.device("cuda")
    rows: list[BenchRow] = []
    fp8_ms: dict[tuple[int, int, int], float] = {}
    peer_ms: dict[tuple[int, int, int], float] = {}
    pairs = shape_pairs(args)
    largest_ctx = max(ctx for _, ctx in pairs)
    if args.tables < 1:
        raise ValueError(f"--tables must be at least 1, got {args.tables}")
    for fmt in args.formats:
        entry = indexer_entry_bytes(HEAD_DIM, fmt)
        pages = make_pages(max(batch * ctx for batch, ctx in pairs) // KERNEL_PAGE_SIZE * args.tables, fmt, device)
        for batch, ctx in pairs:
            for heads in args.heads:
                q, weights, seq_lens, tables = make_inputs(batch, ctx, heads, args.next_n, pages, tables=args.tables)
                inputs = (q, weights, seq_lens, pages, tables[0])
                nbytes = batch * ctx * entry + batch * args.next_n * ctx * 4
                rows.append(time_row(args, inputs, fmt, ctx, nbytes, fp8_ms, peer_ms, tuple(tables[1:])))
                print(rows[-1].line(), flush=True)
                if args.sweep and ctx == largest_ctx:
                    run_sweep(inputs, fmt, ctx, args.ceiling_gbps, nbytes)
        del pages
        torch.cuda.empty_cache()
    return rows
