"""KDA on the pool: one decode step of every KDA layer, the conv update, a chunked 32K prefill.

Shapes are those of one K3.1 rank at TP 8 (69 KDA layers, 12 heads of 128, conv_dim 4608,
width 4). Decode: fla-core's ``fused_recurrent_kda_fwd`` in place on the pool's strided state
views (the requests' state rows in random order) against the same kernel on dense contiguous
states indexed in order; target: the pool costs at most 5 %. Bytes counted: each state read
and written once (the floor), plus the q/k/v/g/beta read and the output written. The conv
update is timed against its floor (history read, kept rows written, inputs read, outputs
written). Every case is checked first (pool against dense, conv against its PyTorch twin,
prefill chunks against one pass). Timings are CUDA-graph replays (device time, no host
overhead), as a captured decode step runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsacache.bench.harness import BenchRow, CorrectnessError, capture_graph, time_cuda
from dsacache.ops.kda import causal_conv1d_prefill_indexed, causal_conv1d_update_indexed, kda_decode, kda_prefill
from dsacache.planner import CacheConfig, plan
from dsacache.runtime import CachePool

HEADS, DIM, CHANNELS, WIDTH = 12, 128, 4608, 4
#: The 5 % target of the pool against dense states (docs/benchmarks.md).
POOL_OVERHEAD_TARGET = 1.05


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prefill-tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk size")


def replay_ms(fn, calls: int = 1) -> float:
    """Milliseconds of ``calls`` calls of ``fn`` replayed from one CUDA graph."""
    return time_cuda(capture_graph(fn, calls).replay, warmup=3, rep=20, spin=True)


def _step_inputs(batch, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, 1, HEADS)
    q, k, v = (torch.randn(*shape, DIM, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = F.logsigmoid(torch.randn(*shape, DIM, device="cuda", generator=gen)) * 0.3
    beta = torch.rand(*shape, device="cuda", generator=gen).bfloat16()
    return q, k, v, g, beta


def _k31_pool(batch):
    """A K3.1 TP-8 pool holding ``batch`` requests' state rows (no attention rows), ids in random order."""
    layout = plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8),
                  num_rows=batch * 3 + 1)
    pool = CachePool(layout, device="cuda")
    pool._allocation.zero_()
    for b in range(batch):
        pool.allocator.add(b, num_tokens=0)
    order = torch.randperm(batch).tolist()
    groups = torch.tensor([pool.allocator.state_rows(b) for b in order], dtype=torch.int32, device="cuda").T
    return pool, groups.contiguous()


def decode_rows(args) -> list[BenchRow]:
    rows = []
    for batch in args.batch:
        pool, groups = _k31_pool(batch)
        layers = [slot.layer for slot in pool.layout.kda_layers]
        views = [pool.kda_state_views(layer)[1] for layer in layers]
        indices = [groups[pool.kda_state_row_index(layer)] for layer in layers]
        for view, index in zip(views, indices):
            view[index.long()] = torch.randn(batch, HEADS, DIM, DIM, device="cuda") * 0.05
        dense = [view[index.long()].contiguous() for view, index in zip(views, indices)]
        in_order = torch.arange(batch, dtype=torch.int32, device="cuda")
        q, k, v, g, beta = _step_inputs(batch)
        outs = [torch.empty_like(v) for _ in layers]
        dense_out = torch.empty_like(v)
        kda_decode(q, k, v, g, beta, views[0], indices[0], use_qk_l2norm_in_kernel=True, out=outs[0])
        kda_decode(q, k, v, g, beta, dense[0], in_order, use_qk_l2norm_in_kernel=True, out=dense_out)
        if not (torch.equal(outs[0], dense_out) and torch.equal(views[0][indices[0].long()], dense[0])):
            raise CorrectnessError(f"B={batch}: the pool's decode differs from the dense one")

        def pool_step():
            for view, index, out in zip(views, indices, outs):
                kda_decode(q, k, v, g, beta, view, index, use_qk_l2norm_in_kernel=True, out=out,
                           check_indices=False)

        def dense_step():
            for states, out in zip(dense, outs):
                kda_decode(q, k, v, g, beta, states, in_order, use_qk_l2norm_in_kernel=True, out=out,
                           check_indices=False)

        state_bytes = HEADS * DIM * DIM * 4
        nbytes = len(layers) * batch * (2 * state_bytes + 5 * HEADS * DIM * 2)
        pool_ms, dense_ms = replay_ms(pool_step), replay_ms(dense_step)
        ratio = pool_ms / dense_ms
        shape = f"B={batch} {len(layers)} layers {HEADS}x{DIM}x{DIM}"
        rows.append(BenchRow("kda decode step, pool", shape, pool_ms, nbytes, args.ceiling_gbps,
                             {"per_layer_us": round(pool_ms / len(layers) * 1e3, 1),
                              "vs_dense": round(ratio, 3), "target": POOL_OVERHEAD_TARGET}))
        rows.append(BenchRow("kda decode step, dense", shape, dense_ms, nbytes, args.ceiling_gbps,
                             {"per_layer_us": round(dense_ms / len(layers) * 1e3, 1)}))
        del pool, views, dense
        torch.cuda.empty_cache()
    return rows


def conv_rows(args) -> list[BenchRow]:
    rows = []
    weight = torch.randn(CHANNELS, WIDTH, device="cuda") * 0.5
    for num_spec, next_n in ((0, 1), (1, 2)):
        conv_rows_per_state = WIDTH - 1 + num_spec
        for batch in args.batch:
            states = torch.randn(batch * 3, conv_rows_per_state, CHANNELS, device="cuda").bfloat16()
            index = torch.randperm(batch * 3, device="cuda")[:batch].to(torch.int32)
            x = torch.randn(batch * next_n, CHANNELS, device="cuda").bfloat16()
            accepted = torch.randint(1, next_n + 1, (batch,), device="cuda", dtype=torch.int32)
            kw = dict(next_n=next_n, num_accepted_tokens=accepted if next_n > 1 else None)
            ref_states, got_states = states.clone(), states.clone()
            ref = causal_conv1d_update_indexed(x, ref_states, index, weight, **kw, impl="torch")
            got = causal_conv1d_update_indexed(x, got_states, index, weight, **kw)
            if not torch.equal(got_states, ref_states) or (got.float() - ref.float()).abs().max() > \
                    ref.float().abs().max() * 2 ** -7:
                raise CorrectnessError(f"conv update B={batch} next_n={next_n} differs from its twin")
            out = torch.empty_like(x)
            ms = replay_ms(lambda: causal_conv1d_update_indexed(x, states, index, weight, **kw, out=out,
                                                                 check_indices=False), calls=20) / 20
            kept = WIDTH - 2 + next_n
            nbytes = batch * CHANNELS * 2 * ((WIDTH - 1) + kept + 2 * next_n)
            rows.append(BenchRow("conv update indexed", f"B={batch} next_n={next_n} C={CHANNELS} W={WIDTH}", ms,
                                 nbytes, args.ceiling_gbps))
    return rows


def prefill_rows(args) -> list[BenchRow]:
    total, chunk = args.prefill_tokens, args.chunk
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(total, HEADS, DIM, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = F.logsigmoid(torch.randn(total, HEADS, DIM, device="cuda", generator=gen)) * 0.3
    beta = torch.rand(total, HEADS, device="cuda", generator=gen).bfloat16()
    x = torch.randn(total, CHANNELS, device="cuda").bfloat16()
    weight = torch.randn(CHANNELS, WIDTH, device="cuda") * 0.5
    recurrent = torch.zeros(4, HEADS, DIM, DIM, device="cuda")
    conv = torch.zeros(4, WIDTH - 1, CHANNELS, device="cuda").bfloat16()
    index = torch.tensor([2], dtype=torch.int32, device="cuda")

    def run_chunks(num):
        pos = 0
        for i in range(0, total, num):
            n = min(num, total - pos)
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            first = torch.tensor([i > 0], device="cuda")
            causal_conv1d_prefill_indexed(x[pos : pos + n], conv, index, weight, query_start_loc=cu,
                                          has_initial_state=first, max_query_len=n, check_indices=False)
            kda_prefill(q[pos : pos + n], k[pos : pos + n], v[pos : pos + n], g[pos : pos + n], beta[pos : pos + n],
                        recurrent, index, cu_seqlens=cu, has_initial_state=first, use_qk_l2norm_in_kernel=True,
                        check_indices=False)
            pos += n

    run_chunks(total)
    whole = recurrent[2].clone()
    run_chunks(chunk)
    error = float((recurrent[2] - whole).norm() / whole.norm())
    if error > 5e-3:
        raise CorrectnessError(f"prefill in chunks of {chunk} ends {error:.1e} away from one pass")
    ms = time_cuda(lambda: run_chunks(chunk), warmup=2, rep=5)
    nbytes = total * (5 * HEADS * DIM * 2 + 2 * CHANNELS * 2)
    return [BenchRow("kda prefill one layer", f"T={total} in chunks of {chunk}, conv + chunk_kda", ms, nbytes,
                     args.ceiling_gbps, {"chunks_vs_one_pass": f"{error:.1e}", "eager": True})]


def run(args) -> list[BenchRow]:
    return decode_rows(args) + conv_rows(args) + prefill_rows(args)
