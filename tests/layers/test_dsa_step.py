"""One DSA layer's decode step on a packed K3.1 pool, against a reference computed from the pool's bytes."""

import math

import pytest
import torch

from dsacache import CacheConfig, plan
from dsacache.formats.indexer_key import dequantize_pages
from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries
from dsacache.layers import DsaDecodeInputs, DsaDecodeStep
from dsacache.ops.indexer_k_cache import fused_norm_store_indexer_keys
from dsacache.ops.mla_cache import store_mla_latents
from dsacache.runtime import CachePool, build_indexer_metadata
from tests.helpers import rel_rms_error

SCALE = 192 ** -0.5
TOPK = 48


def _pool(device, num_rows=12):
    pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1"), num_rows=num_rows), device=device)
    pool.buffer.fill_(0x5A)
    return pool


def _prefill(pool, layer, lens, device):
    """Cache the first ``len - next_n`` tokens of each request (its earlier steps)."""
    alloc = pool.allocator
    for r, n in enumerate(lens):
        alloc.add(f"r{r}", num_tokens=n)
    table = alloc.block_table([f"r{r}" for r in range(len(lens))], device=device)
    return table


def _store_tokens(pool, layer, table, request, positions, device):
    slots = torch.tensor([int(table[request, p // 64]) * 64 + p % 64 for p in positions], device=device)
    n = len(positions)
    k = torch.randn(n, 128, device=device)
    fused_norm_store_indexer_keys(k, torch.ones(128, device=device), torch.zeros(128, device=device),
                                  pool.index_pages(layer), slots, impl="torch")
    store_mla_latents(torch.randn(n, 512, device=device), torch.randn(n, 64, device=device),
                      pool.mla_pages(layer), slots, impl="torch")


def _inputs(batch, next_n, heads, device):
    t = batch * next_n
    return DsaDecodeInputs(
        index_k=torch.randn(t, 128, device=device, dtype=torch.bfloat16),
        index_k_norm_weight=torch.rand(128, device=device) + 0.5,
        index_k_norm_bias=torch.randn(128, device=device) * 0.1,
        index_q=torch.randn(batch, next_n, 32, 128, device=device).to(torch.float8_e4m3fn),
        index_weights=torch.rand(t, 32, device=device) / 32,
        kv_c=torch.randn(t, 512, device=device, dtype=torch.bfloat16),
        k_pe=torch.randn(t, 64, device=device, dtype=torch.bfloat16),
        q=torch.randn(batch, next_n, heads, 576, device=device, dtype=torch.bfloat16),
    )


def _reference(pool, layer, table, lens, next_n, inputs):
    """fp64 (out, lse) of every query row from the pool's bytes alone (after the step's stores)."""
    keys = dequantize_pages(pool.index_pages(layer).cpu(), 128).double()  # [P, 64, 128]
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    mla = pool.mla_pages(layer).cpu()
    outs, lses = [], []
    for b, seq in enumerate(lens):
        for i in range(next_n):
            ctx = seq - next_n + i + 1
            pos = torch.arange(ctx)
            pages = table[b, pos // 64].cpu().long()
            k = keys[pages, pos % 64]
            q = inputs.index_q[b, i].cpu().double()
            w = inputs.index_weights[b * next_n + i].cpu().double()
            logits = (torch.relu(q @ k.T) * w[:, None]).sum(0)
            chosen = torch.topk(logits, min(TOPK, ctx)).indices
            kv_c, k_pe = decode_entries(mla[pages[chosen], (pos % 64)[chosen]], fmt)
            kk = torch.cat([kv_c, k_pe], dim=-1).double()
            s = inputs.q[b, i].cpu().double() @ kk.T * SCALE  # [H, n]
            lse = torch.logsumexp(s, dim=-1)
            outs.append(torch.softmax(s, dim=-1) @ kv_c.double())
            lses.append(lse)
    batch = len(lens)
    return torch.stack(outs).view(batch, next_n, -1, 512), torch.stack(lses).view(batch, next_n, -1)


PATHS = [pytest.param("cpu", "torch", id="torch"), pytest.param("cuda", "auto", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,impl", PATHS)
@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_step_matches_the_reference(next_n, device, impl):
    torch.manual_seed(next_n)
    pool = _pool(device)
    layer = pool.layout.dsa_layers[3].layer
    lens = [65, 130, 2]  # a full page + 1, two pages + 2, a request of two tokens
    lens = [max(n, next_n) for n in lens]
    table = _prefill(pool, layer, lens, device)
    for r, n in enumerate(lens):
        if n > next_n:
            _store_tokens(pool, layer, table, r, list(range(n - next_n)), device)
    slot_buf = torch.empty(64, dtype=torch.int64, device=device)
    meta = build_indexer_metadata(table, [next_n] * len(lens), lens, slot_buf, next_n=next_n,
                                  num_decodes=len(lens), workspace_tokens=4096, logits_bytes=1 << 24,
                                  num_kernel_pages=pool.num_kernel_pages)
    step = DsaDecodeStep(pool, batch_size=len(lens), next_n=next_n, num_heads=12, max_model_len=256,
                         softmax_scale=SCALE, topk=TOPK)
    inputs = _inputs(len(lens), next_n, 12, device)
    out, lse = step.run(layer, meta, inputs, impl=impl)
    ref_out, ref_lse = _reference(pool, layer, table, lens, next_n, inputs)
    assert rel_rms_error(out.float().cpu(), ref_out) < 1e-2  # bf16 output
    assert float(((lse.double().cpu() - ref_lse).abs() / ref_lse.abs().clamp_min(1)).max()) < 1e-3


@pytest.mark.gpu
def test_all_dsa_layers_capture_as_one_cuda_graph():
    torch.manual_seed(0)
    pool = _pool("cuda", num_rows=16)
    layers = [slot.layer for slot in pool.layout.dsa_layers]
    lens = [300, 1000, 64, 65]
    table = _prefill(pool, layers[0], lens, "cuda")
    for layer in layers:
        for r, n in enumerate(lens):
            _store_tokens(pool, layer, table, r, list(range(n - 1)), "cuda")
    meta = build_indexer_metadata(table, [1] * len(lens), lens, torch.empty(64, dtype=torch.int64, device="cuda"),
                                  num_decodes=len(lens), workspace_tokens=4096, logits_bytes=1 << 24,
                                  num_kernel_pages=pool.num_kernel_pages)
    step = DsaDecodeStep(pool, batch_size=len(lens), next_n=1, num_heads=12, max_model_len=1024,
                         softmax_scale=SCALE, topk=256)
    inputs = {layer: _inputs(len(lens), 1, 12, "cuda") for layer in layers}
    before = pool.buffer.clone()
    eager = {k: (o.clone(), s.clone()) for k, (o, s) in step.run_all(meta, inputs).items()}
    pool.buffer.copy_(before)  # the stores write the same bytes again on replay
    outputs = {layer: (torch.empty_like(step.out), torch.empty_like(step.lse)) for layer in layers}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run_all(meta, inputs, outputs)
    pool.buffer.copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    for layer in layers:
        assert torch.equal(outputs[layer][0], eager[layer][0]), layer
        assert torch.equal(outputs[layer][1], eager[layer][1]), layer


def test_step_refuses_a_mismatched_shape():
    pool = _pool("cpu")
    step = DsaDecodeStep(pool, batch_size=2, next_n=1, num_heads=12, max_model_len=128, softmax_scale=SCALE)
    table = _prefill(pool, 4, [10, 12], "cpu")
    meta = build_indexer_metadata(table, [1, 1], [10, 12], torch.empty(8, dtype=torch.int64),
                                  num_decodes=2, workspace_tokens=1024, logits_bytes=1 << 20)
    with pytest.raises(ValueError, match="inputs.q has shape"):
        step.run(4, meta, _inputs(2, 1, 16, "cpu"), impl="torch")
    with pytest.raises(ValueError, match="no DSA layers"):
        DsaDecodeStep(CachePool(plan(CacheConfig.from_model("kimi-linear-48b"), num_rows=2)), batch_size=1,
                      next_n=1, num_heads=4, max_model_len=64, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        DsaDecodeStep(pool, batch_size=0, next_n=1, num_heads=12, max_model_len=64, softmax_scale=SCALE)
    assert math.isclose(step.softmax_scale, SCALE)
