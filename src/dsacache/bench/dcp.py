"""Decode context parallelism: the merges on one GPU, the DSA decode step at DCP 1 and DCP N.

One process (``python -m dsacache.bench dcp``): the top-k and LSE merges with the ``N`` ranks'
inputs simulated on the one GPU (``--sim-world``), then the DSA decode step at DCP 1.

Under ``torchrun`` with ``N`` processes, one GPU each, NCCL (``torchrun --nproc-per-node N -m
dsacache.bench.dcp``; this module as ``__main__`` picks each process's GPU before the harness
touches one): the step at DCP 1 on every GPU alone (the baseline), then at DCP ``N``, for strong
scaling (a fixed ``--ctx`` spread over the ranks) and weak scaling (``N x --ctx``, so each rank
holds what the DCP 1 step holds). Printed by rank 0; a step's time is the slowest rank's.

Shapes: K3.1 at TP 8 (12 MLA heads a rank, 32 indexer heads x 128, top-k 2048, fp8_ds_mla
latents, FP8 keys), ``--batch`` requests of ``--ctx`` tokens. The pool holds ``--pool-gib`` of
rows filled with finite random bytes; each request's block table is a random choice of its pages
(requests share pages, so a long context needs no more memory; a layer's pages still span far
more than the L2). Before timing: at DCP 1 the step's top-k equals the reference top-k of its
logits; at DCP N every rank's merged top-k equals the top-k of the whole row's logits,
gathered from every rank, and the outputs are finite.

Columns. ``merge_topk`` (one process) also carries the bytes the step's collectives move a layer at
that ``N`` (printed per collective above it). ``dcp_step``: one step of ``--layers`` DSA layers (a CUDA-graph replay unless
``--no-graph``), bytes = the step's HBM minimum (the rank's keys, its logits written and read,
the latents of its selected tokens); ``coll_us`` = device time of the NCCL kernels in one eager
step (waiting for the other ranks included); ``vs_dcp1`` = this time over the DCP 1 step with
the same per-rank context. ``dcp_<collective>``: that collective alone on the step's buffers,
bytes = what each rank receives (``DcpDsaDecodeStep.collective_bytes``), so its GB/s is the
link's, not HBM's (the copy-ceiling ratio does not apply there).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist

from dsacache.bench.harness import SPIN_CYCLES, BenchRow, CorrectnessError, capture_graph, time_cuda
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.layers import DsaDecodeInputs
from dsacache.ops.topk import topk_indices
from dsacache.parallel import (
    LSE_MERGES,
    DcpDsaDecodeStep,
    collective_bytes,
    gather_into,
    merge_partials,
    merge_topk,
    owned_local_positions,
    pack_candidates,
    weighted_partial,
)
from dsacache.planner import CacheConfig, plan
from dsacache.runtime import CachePool, DcpSettings, RowAllocator, build_indexer_metadata

MODEL = "kimi-k3.1"
HEADS = 12  # K3.1's 96 MLA heads at TP 8
INDEX_HEADS, INDEX_DIM = 32, 128
SOFTMAX_SCALE = 192 ** -0.5  # qk_nope 128 + rope 64
#: Fill bytes of the pool, from this range: finite, positive e4m3 values (0.5 .. 1.9), fp32 and bf16
#: scales and rope values between 2**-31 and 2.
FILL = (0x30, 0x40)
#: Seconds a collective may wait for the other ranks (a rank that stopped: the others stop too).
GROUP_TIMEOUT_S = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=131072, help="context a request (weak scaling: per rank)")
    parser.add_argument("--next-n", type=int, default=1)
    parser.add_argument("-k", "--topk", type=int, default=2048)
    parser.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 24], help="DSA layers a timed step runs")
    parser.add_argument("--lse-merge", nargs="+", default=list(LSE_MERGES), choices=list(LSE_MERGES))
    parser.add_argument("--scaling", nargs="+", default=["strong", "weak"], choices=["strong", "weak"])
    parser.add_argument("--sim-world", type=int, nargs="+", default=[2, 4, 8],
                        help="one process: DCP sizes the merges are timed at")
    parser.add_argument("--pool-gib", type=float, default=32.0, help="pool size a GPU")
    parser.add_argument("--impl", default="auto", choices=["auto", "torch"],
                        help="the ops' path; torch (the references, with host syncs) times eagerly")
    parser.add_argument("--no-graph", action="store_true", help="time the step eagerly, not as a CUDA-graph replay")


def use_graph(args) -> bool:
    """CUDA-graph replays unless ``--no-graph``; the PyTorch references sync with the host, so never with them."""
    return not args.no_graph and args.impl != "torch"


def first_run(step: DcpDsaDecodeStep, layer: int, meta, inputs, impl: str) -> None:
    """One eager run (sets up the communicators before any capture); a path this branch lacks is named."""
    try:
        step.run(layer, meta, inputs, impl=impl)
    except NotImplementedError as err:
        raise NotImplementedError(f"{err}; or time the PyTorch paths with --impl torch") from err


# Set-up (any device: the tests build these on the CPU) ---------------------------------------

def bench_pool(dcp: DcpSettings, pool_bytes: int, device, seed: int = 0) -> CachePool:
    """A K3.1 pool of ``pool_bytes`` for this rank, every byte a finite random value (see ``FILL``)."""
    config = CacheConfig.from_model(MODEL, decode_context_parallel_size=dcp.world_size,
                                    cp_kv_cache_interleave_size=dcp.interleave)
    row_bytes = plan(config, num_rows=1).row_bytes
    layout = plan(config, num_rows=max(1, pool_bytes // row_bytes))
    pool = CachePool(layout, device=device, allocator=RowAllocator.from_layout(layout, dcp=dcp))
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    pool.buffer.random_(*FILL, generator=gen)
    return pool


def bench_step_inputs(pool: CachePool, dcp: DcpSettings, batch: int, ctx: int, next_n: int, seed: int = 0):
    """This rank's step metadata (block tables of random pages, requests of ``ctx`` tokens each) and one
    layer's inputs (the same on every rank, but for the query heads: this rank's ``HEADS``)."""
    device = pool.device
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-DcpSettings(dcp.world_size, 0, dcp.interleave).local_len(ctx) // KERNEL_PAGE_SIZE)
    if width > pool.num_kernel_pages:
        raise ValueError(f"a request of {ctx} tokens needs {width} pages a rank; the pool has "
                         f"{pool.num_kernel_pages}: raise --pool-gib")
    table = torch.stack([torch.randperm(pool.num_kernel_pages, device=device, generator=gen)[:width]
                         for _ in range(batch)]).to(torch.int32)
    meta = build_indexer_metadata(table, [next_n] * batch, [ctx] * batch,
                                  torch.empty(batch * next_n, dtype=torch.int64, device=device), next_n=next_n,
                                  num_decodes=batch, workspace_tokens=1, logits_bytes=4,
                                  num_kernel_pages=pool.num_kernel_pages, dcp=dcp)
    tokens = batch * next_n
    shared = torch.Generator(device=device).manual_seed(seed + 1)  # the same on every rank

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=shared)

    q_all = randn(batch, next_n, HEADS * dcp.world_size, 576).to(torch.bfloat16)
    inputs = DsaDecodeInputs(
        index_k=randn(tokens, INDEX_DIM).to(torch.bfloat16),
        index_k_norm_weight=torch.ones(INDEX_DIM, device=device),
        index_k_norm_bias=torch.zeros(INDEX_DIM, device=device),
        index_q=randn(batch, next_n, INDEX_HEADS, INDEX_DIM).to(torch.float8_e4m3fn),
        index_weights=torch.rand(tokens, INDEX_HEADS, device=device, generator=shared) / INDEX_HEADS,
        kv_c=randn(tokens, 512).to(torch.bfloat16),
        k_pe=randn(tokens, 64).to(torch.bfloat16),
        q=q_all[:, :, dcp.rank * HEADS:(dcp.rank + 1) * HEADS].contiguous(),
    )
    return meta, inputs


def make_step(pool: CachePool, group, dcp: DcpSettings, args, ctx: int, lse_merge: str) -> DcpDsaDecodeStep:
    return DcpDsaDecodeStep(pool, group, dcp, batch_size=args.batch, next_n=args.next_n, num_heads_local=HEADS,
                            max_model_len=ctx, softmax_scale=SOFTMAX_SCALE, topk=args.topk, lse_merge=lse_merge)


def global_logits(step: DcpDsaDecodeStep, ctx: int) -> torch.Tensor:
    """The whole rows' logits ``[R, ctx]``, put together from every rank's local logits (one all-gather)."""
    dcp, local = step.dcp, step.local.logits
    gathered = torch.empty(dcp.world_size, *local.shape, dtype=local.dtype, device=local.device)
    gather_into(gathered, local, step.group)
    whole = torch.empty(local.shape[0], ctx, dtype=local.dtype, device=local.device)
    for rank in range(dcp.world_size):
        owner = DcpSettings(dcp.world_size, rank, dcp.interleave)
        count = owner.local_len(ctx)
        columns = owner.global_position(torch.arange(count, device=local.device))
        whole[:, columns] = gathered[rank, :, :count]
    return whole


def check_step(step: DcpDsaDecodeStep, meta, ctx: int) -> None:
    """``CorrectnessError`` unless the step's top-k is the reference top-k of the whole rows' logits
    and its outputs are finite (on every rank; rank-local, then agreed over the group)."""
    next_n, rows = step.next_n, step.num_rows
    lens = (ctx - next_n + 1 + torch.arange(next_n, device=step.out.device)).repeat(step.batch_size)
    whole = step.local.logits if step.world_size == 1 else global_logits(step, ctx)
    ok = torch.equal(step.global_positions, topk_indices(whole, lens.int(), step.topk, impl="torch"))
    ok = ok and bool(torch.isfinite(step.out.float()).all()) and bool(torch.isfinite(step.lse).all())
    if step.world_size > 1:
        flag = torch.tensor([0 if ok else 1], device=step.out.device)
        dist.all_reduce(flag, group=step.group)
        ok = int(flag) == 0
    if not ok:
        raise CorrectnessError(f"DCP {step.world_size}: the merged top-k of {rows} rows is not the whole rows' "
                               "top-k, or an output is not finite")


def step_hbm_bytes(step: DcpDsaDecodeStep, local_ctx: int, layers: int) -> int:
    """The fewest HBM bytes a rank's step reads and writes: its keys (132 B a token), its logits
    (written, then read by the top-k), the latents of its selected tokens (656 B), queries and outputs."""
    rows = step.num_rows
    selected = int((step.owned_positions >= 0).sum())
    heads = step.num_heads_local * step.world_size
    per_layer = (step.batch_size * local_ctx * 132 + 2 * rows * local_ctx * 4 + selected * 656
                 + rows * heads * (576 + 512) * 2)
    return layers * per_layer


# Timing (CUDA) -------------------------------------------------------------------------------

def graphed(fn):
    """``fn`` captured once in a CUDA graph; returns the replay."""
    try:
        # thread_local: the NCCL watchdog thread may query its events while this thread captures.
        return capture_graph(fn, error_mode="thread_local").replay
    except RuntimeError as err:
        raise RuntimeError(f"capturing the step in a CUDA graph failed ({err}); time it eagerly with --no-graph") \
            from err


def time_group(fn, group, warmup: int = 3, rep: int = 20) -> float:
    """Median ms of ``fn`` on this rank, the ranks lined up before each launch (a barrier, then the
    same spin kernel ahead of the start event on every rank), so a time is the step's, not the skew's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def slowest(value: float, group) -> float:
    """The largest ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def nccl_us(fn) -> float:
    """Device time (us) of the NCCL kernels of one ``fn`` call, from the CUDA profiler (eager)."""
    from dsacache.bench.topk import kernel_times_us

    return sum(us for name, us in kernel_times_us(fn, reps=5).items() if "nccl" in name.lower())


# One process ---------------------------------------------------------------------------------

def simulated_ranks(batch: int, ctx: int, k: int, world: int, interleave: int, device, seed: int = 0):
    """Global logits ``[R, ctx]`` and the ``[N, R, k]`` packed candidates its ``world`` ranks would send."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, ctx, device=device, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    packed = []
    for rank in range(world):
        dcp = DcpSettings(world, rank, interleave)
        columns = dcp.global_position(torch.arange(dcp.local_len(ctx), device=device))
        local = logits[:, columns].contiguous()
        positions = topk_indices(local, dcp.local_len(lens), k)
        packed.append(pack_candidates(local, positions, dcp))
    return logits, lens, torch.stack(packed)


def merge_rows(args) -> list[BenchRow]:
    """The merges alone on one GPU, with the inputs of ``N`` simulated ranks."""
    rows, batch, k, ctx = [], args.batch * args.next_n, args.topk, args.ctx
    for world in args.sim_world:
        logits, lens, candidates = simulated_ranks(batch, ctx, k, world, args.interleave, "cuda")
        merged = torch.empty(batch, k, dtype=torch.int32, device="cuda")
        work = torch.empty(batch, world, k, dtype=torch.int64, device="cuda")
        merge_topk(candidates, k, out=merged, work=work)
        if not torch.equal(merged, topk_indices(logits, lens, k)):
            raise CorrectnessError(f"merge_topk at N={world}: not the top-k of the whole rows")
        shape = f"N={world} R={batch} k={k} ctx={ctx}"
        ms = time_cuda(lambda: merge_topk(candidates, k, out=merged, work=work), spin=True)
        moved = {merge: collective_bytes(world, batch, HEADS, 576, 512, k, merge) for merge in args.lse_merge}
        rows.append(BenchRow("merge_topk", shape, ms, batch * k * (3 * 8 * world + 4), args.ceiling_gbps,
                             {f"coll_bytes_{merge}": sum(m.values()) for merge, m in moved.items()}))
        for merge, m in moved.items():
            print(f"DCP {world} collective bytes a rank receives per layer ({merge}): {m}", flush=True)
        dcp = DcpSettings(world, 0, args.interleave)
        local = logits[:, dcp.global_position(torch.arange(dcp.local_len(ctx), device="cuda"))].contiguous()
        positions = topk_indices(local, dcp.local_len(lens), k)
        packed = torch.empty(batch, k, dtype=torch.int64, device="cuda")
        ms = time_cuda(lambda: pack_candidates(local, positions, dcp, out=packed), spin=True)
        rows.append(BenchRow("pack_candidates", shape, ms, batch * k * (4 + 4 + 8), args.ceiling_gbps))
        owned = torch.empty_like(merged)
        ms = time_cuda(lambda: owned_local_positions(merged, dcp, out=owned), spin=True)
        rows.append(BenchRow("owned_local_positions", shape, ms, batch * k * 8, args.ceiling_gbps))
        rows.extend(lse_rows(args, world))
        for row in rows[-5:]:
            print(row.line(), flush=True)
    return rows


def lse_rows(args, world: int) -> list[BenchRow]:
    """The LSE merge of ``world`` partials of the ``HEADS`` heads of a rank (all-to-all form), and one rank's
    weighted share of the ``world x HEADS`` heads (reduce-scatter form); checked against fp64 first."""
    gen = torch.Generator(device="cuda").manual_seed(world)
    b, s, r = args.batch, args.next_n, 512
    parts = torch.randn(world, b, s, HEADS, r, device="cuda", generator=gen).to(torch.bfloat16)
    lse_parts = torch.randn(world, b, s, HEADS, device="cuda", generator=gen) * 4
    out = torch.empty(b, s, HEADS, r, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, s, HEADS, device="cuda")
    merge_partials(parts, lse_parts, out=out, lse=lse)
    weights = torch.softmax(lse_parts.double(), dim=0)
    want = (parts.double() * weights[..., None]).sum(0)
    if not torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2):
        raise CorrectnessError(f"merge_partials at N={world}: differs from the fp64 merge")
    shape = f"N={world} B={b} next_n={s} H={HEADS} r={r}"
    nbytes = (world + 1) * b * s * HEADS * (2 * r + 4)
    ms = time_cuda(lambda: merge_partials(parts, lse_parts, out=out, lse=lse), spin=True)
    rows = [BenchRow("merge_partials", shape, ms, nbytes, args.ceiling_gbps)]
    share = torch.empty_like(parts)
    ms = time_cuda(lambda: weighted_partial(parts, lse_parts, lse, out=share), spin=True)
    rows.append(BenchRow("weighted_partial", f"N={world} B={b} next_n={s} H={HEADS}x{world} r={r}", ms,
                         2 * world * b * s * HEADS * (2 * r + 4), args.ceiling_gbps))
    return rows


def dcp1_rows(args, group=None) -> dict[int, BenchRow]:
    """The step at DCP 1 on this GPU, by layer count (checked first)."""
    dcp = DcpSettings(1, 0, args.interleave)
    pool = bench_pool(dcp, int(args.pool_gib * 2**30), "cuda")
    meta, inputs = bench_step_inputs(pool, dcp, args.batch, args.ctx, args.next_n)
    step = make_step(pool, None, dcp, args, args.ctx, LSE_MERGES[0])
    first_run(step, pool.layout.dsa_layers[0].layer, meta, inputs, args.impl)
    check_step(step, meta, args.ctx)
    out = {}
    for layers in args.layers:
        fn = layer_loop(step, pool, meta, inputs, layers, args.impl)
        timed = graphed(fn) if use_graph(args) else fn
        ms = time_cuda(timed, spin=True) if group is None else slowest(time_group(timed, group), group)
        shape = f"N=1 ctx={args.ctx} B={args.batch} H={HEADS} k={args.topk} layers={layers}"
        out[layers] = BenchRow("dcp_step", shape, ms, step_hbm_bytes(step, args.ctx, layers), args.ceiling_gbps,
                               {"graph": use_graph(args), "eager_us": f"{time_cuda(fn) * 1e3:.1f}"})
        print(out[layers].line(), flush=True)
    del step, pool
    torch.cuda.empty_cache()
    return out


def layer_loop(step: DcpDsaDecodeStep, pool: CachePool, meta, inputs, layers: int, impl: str):
    """One call runs the step over the first ``layers`` DSA layers of the pool, in order."""
    numbers = [slot.layer for slot in pool.layout.dsa_layers[:layers]]
    if len(numbers) < layers:
        raise ValueError(f"--layers {layers}: the model has {len(numbers)} DSA layers")

    def fn():
        for layer in numbers:
            step.run(layer, meta, inputs, impl=impl)
    return fn


# torchrun ------------------------------------------------------------------------------------

def dcp_rows(args, group, world: int, rank: int, baseline: dict[int, BenchRow]) -> list[BenchRow]:
    """The step at DCP ``world`` for each scaling, LSE merge and layer count, and its collectives alone."""
    rows = []
    for scaling in args.scaling:
        ctx = args.ctx if scaling == "strong" else args.ctx * world
        dcp = DcpSettings(world, rank, args.interleave)
        local_ctx = DcpSettings(world, 0, args.interleave).local_len(ctx)
        pool = bench_pool(dcp, int(args.pool_gib * 2**30), "cuda", seed=rank)
        meta, inputs = bench_step_inputs(pool, dcp, args.batch, ctx, args.next_n)
        for lse_merge in args.lse_merge:
            step = make_step(pool, group, dcp, args, ctx, lse_merge)
            first_run(step, pool.layout.dsa_layers[0].layer, meta, inputs, args.impl)
            check_step(step, meta, ctx)
            per_layer = step.collective_bytes()
            for layers in args.layers:
                fn = layer_loop(step, pool, meta, inputs, layers, args.impl)
                timed = graphed(fn) if use_graph(args) else fn
                ms = slowest(time_group(timed, group), group)
                coll = slowest(nccl_us(fn), group)
                shape = (f"N={world} {scaling} ctx={ctx} local={local_ctx} B={args.batch} H={HEADS}x{world} "
                         f"k={args.topk} layers={layers} {lse_merge}")
                extra = {"graph": use_graph(args), "coll_us": f"{coll:.1f}",
                         "coll_bytes": sum(per_layer.values()) * layers}
                base = baseline[layers]
                if scaling == "weak":
                    extra["vs_dcp1"] = f"{ms / base.ms:.2f}x"  # the target: at most 1.3x
                else:
                    extra["speedup_vs_dcp1"] = f"{base.ms / ms:.2f}x"
                rows.append(BenchRow("dcp_step", shape, ms, step_hbm_bytes(step, local_ctx, layers),
                                     args.ceiling_gbps, extra))
                print(rows[-1].line(), flush=True)
            for name, op in step.collective_ops().items():
                ms = slowest(time_group(op, group), group)
                rows.append(BenchRow(f"dcp_{name}", f"N={world} {scaling} B={args.batch} {lse_merge}", ms,
                                     per_layer[name], args.ceiling_gbps))
                print(rows[-1].line(), flush=True)
            del step
        del pool, meta, inputs
        torch.cuda.empty_cache()
    return rows


def _quiet_unless_rank0(rank: int, args) -> None:
    """Ranks other than 0 print nothing and write no JSON (rank 0 reports the group)."""
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # for the rest of the process
        args.json = None


def run(args: argparse.Namespace) -> list[BenchRow]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return merge_rows(args) + list(dcp1_rows(args).values())
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.current_device() != local_rank:
        raise RuntimeError("under torchrun launch this suite as `torchrun --nproc-per-node N -m dsacache.bench.dcp "
                           "...` (it puts each process on its own GPU before the harness uses one)")
    _quiet_unless_rank0(rank, args)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    group = dist.group.WORLD
    baseline = dcp1_rows(args, group)
    return list(baseline.values()) + dcp_rows(args, group, world, rank, baseline)


def main(argv: list[str] | None = None) -> int:
    """``torchrun`` entry point: this process's GPU first, then the bench harness on the ``dcp`` suite."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from dsacache.bench.__main__ import main as bench_main

    head = argv[:2] if argv[:1] == ["--json"] else []
    try:
        return bench_main([*head, "dcp", *argv[len(head):]])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
