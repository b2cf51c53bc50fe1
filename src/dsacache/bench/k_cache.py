"""Indexer key cache: quantize + store (FP8/MXFP4, plain/fused LayerNorm), gather, dequantize.

Keys go to random slots of one DSA layer's indexer pages in a K3.1 pool planned as a user
plans it (``plan()`` + ``CachePool``, rows enough for the largest batch): 24 DSA layers, each
sub-row holding every layer's fp8_ds_mla MLA page and indexer page, so the layer's view has a
page stride of ~1 MB. Bytes counted: the keys read plus the entries written
(``docs/benchmarks.md``); the slot mapping is not counted. Every case is checked against the
PyTorch reference (and for stray writes) first.
"""

from __future__ import annotations

import statistics

import torch

from dsacache.bench.harness import BenchRow, CorrectnessError, time_cuda, time_graph
from dsacache.bench.peers import attach_peer, peer_for
from dsacache.formats.indexer_key import split_indexer_pages
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_k_cache import (
    dequantize_indexer_keys,
    fused_norm_store_indexer_keys,
    gather_indexer_keys,
    store_indexer_keys,
)
from dsacache.ops.indexer_k_cache import naive
from dsacache.planner import CacheConfig, plan
from dsacache.runtime.pool import CachePool

MODEL = "kimi-k3.1"
SENTINEL = 0xA5
#: From this many tokens on, a store is timed over REPEATS slot permutations.
LARGE = 1 << 16
REPEATS = 5
#: (format, mode): "plain" is the public plain store, "fused" the LayerNorm insert, "quant" the
#: internal MXFP4 launcher without the norm (the public plain store refuses MXFP4 by rule).
CASES = (("fp8", "plain"), ("fp8", "fused"), ("mxfp4", "fused"), ("mxfp4", "quant"))


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192, 1 << 20])
    parser.add_argument("--sweep", action="store_true", help="also time launch shapes at the largest size")


class BenchPool:
    """The indexer pages of the middle DSA layer of a K3.1 pool with ``indexer_kv_dtype=fmt`` and
    rows for ``num_tokens`` tokens, every byte of the pool the sentinel."""

    def __init__(self, fmt: str, num_tokens: int, device: torch.device | str = "cuda"):
        config = CacheConfig.from_model(MODEL, indexer_kv_dtype=fmt)
        block_size = plan(config, num_rows=1).block_size
        self.cache = CachePool(plan(config, num_rows=max(1, -(-num_tokens // block_size))), device=device)
        dsa_layers = self.cache.layout.dsa_layers
        self.layer = dsa_layers[len(dsa_layers) // 2].layer
        self.pages = self.cache.index_pages(self.layer)
        self.fmt = self.cache.layout.indexer_key_format
        self.raw = self.cache.buffer
        self.raw.fill_(SENTINEL)

    @property
    def num_slots(self) -> int:
        return self.pages.shape[0] * KERNEL_PAGE_SIZE


def _store_fn(pool, mode, k, weight, bias, slots, impl="auto", check_slots=False):
    """The store of one case as a no-argument callable (no host sync unless ``check_slots``)."""
    if mode == "plain":
        return lambda: store_indexer_keys(k, pool.pages, slots, impl=impl, check_slots=check_slots)
    if mode == "fused":
        return lambda: fused_norm_store_indexer_keys(k, weight, bias, pool.pages, slots, impl=impl,
                                                     check_slots=check_slots)
    from dsacache.ops.indexer_k_cache.launch import launch_store

    return lambda: launch_store(k, pool.pages, slots, pool.fmt)


def _entries(pool, values, scales):
    """Entry bytes as compared: values as bytes, scales as one value a scale (fp32 for FP8)."""
    return values, naive.typed_entries(values, scales, pool.fmt)[1]


def store_mismatch(pool, pages, mode, k, weight, bias, slots) -> tuple[float, float]:
    """Shares of value bytes and of scales at ``slots`` of ``pages`` (in ``pool``'s key format)
    that differ from the reference's quantization of ``k`` (LayerNorm'd first for ``fused``)."""
    page, row = slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE
    values, scales = split_indexer_pages(pages, pool.fmt)
    x = naive.layer_norm(k, weight, bias, 1e-6) if mode == "fused" else k
    want_values, want_scales = _entries(pool, *naive.quantized_bytes(x, pool.fmt))
    got_values, got_scales = _entries(pool, values[page, row], scales[page, row])
    return float((got_values != want_values).float().mean()), float((got_scales != want_scales).float().mean())


def _within_tolerance(mode, value_mismatch, scale_mismatch) -> bool:
    # FP8: the hardware cast and torch's may differ by a code on rare ties; fused: LayerNorm last bits.
    return value_mismatch <= 0.01 and scale_mismatch <= (0.0 if mode != "fused" else 1e-3)


def check_store(pool, mode, k, weight, bias, slots):
    """Entries match the reference; clearing them back to the sentinel leaves a pristine pool."""
    value_mismatch, scale_mismatch = store_mismatch(pool, pool.pages, mode, k, weight, bias, slots)
    if not _within_tolerance(mode, value_mismatch, scale_mismatch):
        raise CorrectnessError(f"{pool.fmt.name} {mode}: {value_mismatch:.2%} values, {scale_mismatch:.2%} scales differ")
    clear(pool, slots)
    if not bool((pool.raw == SENTINEL).all()):
        raise CorrectnessError(f"{pool.fmt.name} {mode}: bytes outside the slots were written")


def peer_store_agreement(pool, k, slots, cache) -> tuple[bool, str]:
    """The peer's FP8 plain store (``cache``: contiguous pages, zeros before) against the same
    reference and tolerance as ours, and no byte written outside the slots: ``(agrees, note)``."""
    value_mismatch, scale_mismatch = store_mismatch(pool, cache, "plain", k, None, None, slots)
    note = f"{value_mismatch:.2%} values, {scale_mismatch:.2%} scales differ" if value_mismatch or scale_mismatch else ""
    rest = cache.clone()
    values, scales = split_indexer_pages(rest, pool.fmt)
    values[slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE] = 0
    scales[slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE] = 0
    if rest.any():
        return False, "bytes outside the slots were written"
    return _within_tolerance("plain", value_mismatch, scale_mismatch), note


def clear(pool, slots):
    """Put the sentinel back into the entries of ``slots``."""
    page, row = slots // KERNEL_PAGE_SIZE, slots % KERNEL_PAGE_SIZE
    values, scales = split_indexer_pages(pool.pages, pool.fmt)
    values[page, row] = SENTINEL
    scales[page, row] = SENTINEL


def make_inputs(pool, num_tokens):
    """bf16 keys, LayerNorm weight and bias, and distinct random slots of the pool."""
    device, head_dim = pool.raw.device, pool.fmt.head_dim
    k = torch.randn(num_tokens, head_dim, device=device, dtype=torch.bfloat16)
    weight = torch.rand(head_dim, device=device) + 0.5
    bias = torch.randn(head_dim, device=device) * 0.1
    slots = torch.randperm(pool.num_slots, device=device)[:num_tokens]
    return k, weight, bias, slots


def _launch_floor() -> tuple[float, float]:
    """A single small launch (a one-element ``torch`` fill): (graph ms, eager ms)."""
    x = torch.empty(1, device="cuda")
    fn = lambda: x.fill_(1.0)  # noqa: E731
    return time_graph(fn), time_cuda(fn, warmup=10, rep=50)


def store_rows(args, fmt, launch_ms, device="cuda"):
    """Every case of ``fmt`` at every size, then the extra rows at the largest size (gather included)."""
    pool = BenchPool(fmt, max(args.tokens), device)
    head_dim = pool.fmt.head_dim
    rows = []
    for case_fmt, mode in CASES:
        if case_fmt != fmt:
            continue
        for n in args.tokens:
            k, weight, bias, slots = make_inputs(pool, n)
            fn = _store_fn(pool, mode, k, weight, bias, slots)
            fn()
            check_store(pool, mode, k, weight, bias, slots)
            ms, eager_ms = time_graph(fn), time_cuda(fn)
            clear(pool, slots)
            nbytes = n * (k.element_size() * head_dim + pool.fmt.entry_bytes)
            extra = {"eager_us": round(eager_ms * 1e3, 1)}
            if n >= LARGE:
                ms, extra["spread_us"] = _repeated_ms(pool, mode, k, weight, bias, ms)
            if n <= 64:
                extra.update(launch_graph_us=round(launch_ms[0] * 1e3, 2), launch_eager_us=round(launch_ms[1] * 1e3, 1))
            rows.append(BenchRow(f"store {fmt} {mode}", f"T={n} D={head_dim} bf16 random", ms, nbytes,
                                 args.ceiling_gbps, extra))
            if (fmt, mode) == ("fp8", "plain"):
                _attach_store_peer(args, rows[-1], pool, k, slots)
    rows += _extra_store_rows(args, pool)
    del pool
    torch.cuda.empty_cache()
    return rows


def _attach_store_peer(args, row, pool, k, slots):
    """vLLM's FP8 store on the row's keys and (first) slots, into a contiguous cache of the pool's page count."""
    peer = peer_for(args, "store")
    attach_peer(row, peer, lambda: peer.make_call(k, slots, pool.pages.shape[0]),
                lambda cache: peer_store_agreement(pool, k, slots, cache), timer=time_graph)


def _repeated_ms(pool, mode, k, weight, bias, first_ms):
    """Median over REPEATS slot permutations (the first already timed) of the graph median, and
    the range: with random slots over a ~16 GB pool one permutation can be ~10 % off another."""
    times = [first_ms]
    for _ in range(REPEATS - 1):
        slots = torch.randperm(pool.num_slots, device=pool.raw.device)[:k.shape[0]]
        times.append(time_graph(_store_fn(pool, mode, k, weight, bias, slots)))
    pool.raw.fill_(SENTINEL)  # pristine again for the next case's stray-write check
    return statistics.median(times), f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}"


def _extra_store_rows(args, pool):
    """Largest size: sorted slots (a prefill's real pattern), the host slot check, the torch reference."""
    fmt, head_dim = pool.fmt.name, pool.fmt.head_dim
    n = max(args.tokens)
    k, weight, bias, slots = make_inputs(pool, n)
    nbytes = n * (2 * head_dim + pool.fmt.entry_bytes)
    mode = "plain" if fmt == "fp8" else "fused"
    rows = []
    sorted_slots = torch.arange(n, device=pool.raw.device)
    ms = time_graph(_store_fn(pool, mode, k, weight, bias, sorted_slots))
    rows.append(BenchRow(f"store {fmt} {mode}", f"T={n} D={head_dim} bf16 sorted", ms, nbytes, args.ceiling_gbps))
    ms = time_cuda(_store_fn(pool, mode, k[:64], weight, bias, slots[:64], check_slots=True))
    rows.append(BenchRow(f"store {fmt} {mode} +check", f"T=64 D={head_dim} host slot check, eager", ms,
                         64 * (2 * head_dim + pool.fmt.entry_bytes), args.ceiling_gbps))
    ms = time_cuda(_store_fn(pool, mode, k, weight, bias, slots, impl="torch"), warmup=2, rep=5)
    rows.append(BenchRow(f"store {fmt} {mode} torch ref", f"T={n} D={head_dim} bf16 random", ms, nbytes,
                         args.ceiling_gbps))
    if args.sweep:
        for sweep_mode in ("plain", "fused") if fmt == "fp8" else ("fused", "quant"):
            rows += _sweep_rows(args, sweep_mode, pool, k, weight, bias, slots, nbytes)
    rows += _gather_rows(args, pool)
    return rows


def _sweep_rows(args, mode, pool, k, weight, bias, slots, nbytes):
    """The store's one-tile kernel at each launch shape (MXFP4 fused: the kernel small batches run)."""
    from dsacache.ops.indexer_k_cache.launch import StoreLaunch, launch_store

    norm = {"weight": weight, "bias": bias, "eps": 1e-6} if mode == "fused" else {}
    rows = []
    for tokens_per_program in (16, 32, 64):
        for num_warps in (2, 4):
            launch = StoreLaunch(pool.fmt.name, tokens_per_program, num_warps)
            ms = time_graph(lambda: launch_store(k, pool.pages, slots, pool.fmt, **norm, launch=launch))
            rows.append(BenchRow(f"sweep {pool.fmt.name} {mode}",
                                 f"T={k.shape[0]} tpp={tokens_per_program} w={num_warps}",
                                 ms, nbytes, args.ceiling_gbps))
    return rows


def gather_metadata(pool):
    """Every page of the pool as (up to) 16 requests: (block_table, cu_seqlens, num_tokens)."""
    device, num_pages = pool.raw.device, pool.pages.shape[0]
    num_reqs = min(16, num_pages)
    pages_per_req = num_pages // num_reqs
    block_table = torch.randperm(num_pages, device=device)[:num_reqs * pages_per_req].int().view(num_reqs, -1)
    per_req = pages_per_req * KERNEL_PAGE_SIZE
    cu_seqlens = torch.arange(num_reqs + 1, device=device, dtype=torch.int32) * per_req
    return block_table, cu_seqlens, per_req * num_reqs


def check_gather(pool, block_table, cu_seqlens, total):
    """Gather and dequantize against the reference; returns the gathered (values, scales)."""
    fmt = pool.fmt
    values, scales = gather_indexer_keys(pool.pages, block_table, cu_seqlens, fmt.head_dim, num_tokens=total)
    ref = naive.gather_indexer_keys(pool.pages, block_table, cu_seqlens, fmt, total)
    if not (torch.equal(values.view(torch.uint8), ref[0].view(torch.uint8)) and
            torch.equal(scales.view(torch.uint8), ref[1].view(torch.uint8))):
        raise CorrectnessError(f"gather {fmt.name} differs from the reference")
    if not torch.equal(dequantize_indexer_keys(values, scales), naive.dequantize_indexer_keys(values, scales, fmt)):
        raise CorrectnessError(f"dequantize {fmt.name} differs from the reference")
    return values, scales


def _gather_rows(args, pool):
    """Gather every page of the pool as (up to) 16 requests, then dequantize."""
    fmt = pool.fmt
    block_table, cu_seqlens, total = gather_metadata(pool)
    values, scales = check_gather(pool, block_table, cu_seqlens, total)
    ms = time_graph(lambda: gather_indexer_keys(pool.pages, block_table, cu_seqlens, fmt.head_dim, num_tokens=total))
    rows = [BenchRow(f"gather {fmt.name}", f"T={total} {block_table.shape[0]} requests", ms,
                     2 * total * fmt.entry_bytes, args.ceiling_gbps)]
    ms = time_graph(lambda: dequantize_indexer_keys(values, scales))
    rows.append(BenchRow(f"dequantize {fmt.name}", f"T={total} D={fmt.head_dim}", ms,
                         total * (fmt.entry_bytes + 4 * fmt.head_dim), args.ceiling_gbps))
    return rows


def run(args) -> list[BenchRow]:
    launch_ms = _launch_floor()
    rows = [BenchRow("single small launch", "torch fill_ of 1 element", launch_ms[0], 4, args.ceiling_gbps,
                     {"eager_us": round(launch_ms[1] * 1e3, 1)})]
    for fmt in ("fp8", "mxfp4"):
        rows += store_rows(args, fmt, launch_ms)
    return rows
