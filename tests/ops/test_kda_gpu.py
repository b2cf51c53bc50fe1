"""KDA on the H200: the conv kernel and fla-core's kernels (``fused_recurrent_kda_fwd`` in place on
the pool, ``chunk_kda`` with gathered states) against the PyTorch paths and the naive recurrence.

Mirrors ``test_kda.py`` at K3.1 TP-8 shapes (12 heads of 128, conv_dim 4608, width 4).
Tolerances: conv within one bf16 step of its twin; fla-core's recurrent kernel within 1e-4 of
the naive recurrence on the same inputs; ``chunk_kda`` on bf16 inputs within 5e-3 relative RMS
of the fp32 naive recurrence (its intra-chunk products are bf16).
"""

import pytest
import torch
import torch.nn.functional as F

from dsacache.ops.kda import causal_conv1d_prefill_indexed, causal_conv1d_update_indexed, kda_decode, kda_prefill
from dsacache.planner import CacheConfig, plan
from dsacache.runtime import CachePool, build_kda_metadata
from tests.helpers import rel_rms_error
from tests.ops.test_kda import bf16_close, conv_params, conv_reference, recurrent_reference

pytestmark = pytest.mark.gpu
pytest.importorskip("fla.ops.kda")

HEADS, DIM, CHANNELS, W = 12, 128, 4608, 4
SENTINEL = 0xA5


def cuda_inputs(num_tokens, batch_dims=(), seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (*batch_dims, num_tokens, HEADS)
    q, k, v = (torch.randn(*shape, DIM, device="cuda", generator=gen).to(dtype) for _ in range(3))
    g = F.logsigmoid(torch.randn(*shape, DIM, device="cuda", generator=gen)) * 0.3
    beta = torch.rand(*shape, device="cuda", generator=gen).to(dtype)
    return q, k, v, g, beta


def k31_pool(num_rows):
    pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8), num_rows=num_rows),
                     device="cuda")
    pool._allocation.fill_(SENTINEL)
    return pool


@pytest.mark.parametrize("next_n", [1, 2])
def test_conv_decode_kernel_matches_its_twin(next_n):
    weight, bias = (t.cuda() for t in conv_params(CHANNELS))
    states = torch.randn(200, W - 1 + 1, CHANNELS, device="cuda").bfloat16()
    index = torch.randperm(200, device="cuda")[:64].to(torch.int32)
    index[[3, 40]] = -1
    accepted = torch.randint(1, next_n + 1, (64,), device="cuda", dtype=torch.int32)
    x = torch.randn(64 * next_n, CHANNELS, device="cuda").bfloat16()
    runs = []
    for impl in ("triton", "torch"):
        s = states.clone()
        out = torch.full_like(x, float("nan"))
        causal_conv1d_update_indexed(x, s, index, weight, bias, next_n=next_n, num_accepted_tokens=accepted,
                                     out=out, impl=impl)
        runs.append((out, s))
    (out, s), (ref_out, ref_s) = runs
    live = (index >= 0).repeat_interleave(next_n)
    bf16_close(out[live], ref_out[live])
    assert torch.isnan(out[~live].float()).all()
    assert torch.equal(s, ref_s)


def test_conv_ragged_prefill_kernel_matches_its_twin():
    weight, _ = (t.cuda() if t is not None else None for t in conv_params(CHANNELS, bias=False))
    lens = [1, 63, 64, 65, 0, 300]
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lens), CHANNELS, device="cuda").bfloat16()
    states = torch.randn(10, W - 1, CHANNELS, device="cuda").bfloat16()
    index = torch.tensor([5, 0, -1, 9, 2, 7], dtype=torch.int32, device="cuda")
    initial = torch.tensor([True, False, True, True, False, False], device="cuda")
    runs = []
    for impl in ("triton", "torch"):
        s = states.clone()
        out = torch.full_like(x, float("nan"))
        causal_conv1d_prefill_indexed(x, s, index, weight, None, query_start_loc=qsl, has_initial_state=initial,
                                      out=out, impl=impl)
        runs.append((out, s))
    (out, s), (ref_out, ref_s) = runs
    live = torch.repeat_interleave(index >= 0, torch.tensor(lens, device="cuda"))
    bf16_close(out[live], ref_out[live])
    assert torch.isnan(out[~live].float()).all()
    assert torch.equal(s, ref_s)


def byte_range(pool, t):
    start = t.data_ptr() - pool._allocation.data_ptr()
    return slice(start, start + t.numel() * t.element_size())


def decode_batch(pool, layer, num_requests, num_padded, next_n=1):
    """Requests with state rows in random order plus padded entries, their metadata, and random states."""
    ids = [f"r{i}" for i in range(num_requests)]
    for rid in ids:
        pool.allocator.add(rid, num_tokens=5)
    spare = []  # the draft tokens' recurrent states: state rows of placeholder requests
    for i in range(num_requests * (next_n - 1)):
        pool.allocator.add(f"spare{i}", num_tokens=0)
        spare.append(pool.allocator.state_rows(f"spare{i}"))
    order = torch.randperm(num_requests).tolist()
    rows = [pool.allocator.state_rows(ids[i]) for i in order] + [None] * num_padded
    spec = None
    if next_n > 1:
        spec = [[rows[b]] + spare[b * (next_n - 1) : (b + 1) * (next_n - 1)] for b in range(num_requests)]
        spec += [None] * num_padded
    batch = num_requests + num_padded
    accepted = torch.randint(1, next_n + 1, (batch,)).tolist() if next_n > 1 else None
    meta = build_kda_metadata(rows, [next_n] * batch, [5 + next_n] * num_requests + [next_n] * num_padded,
                              num_decodes=batch, next_n=next_n, num_accepted_tokens=accepted,
                              spec_state_rows=spec, num_rows=pool.layout.num_rows, device="cuda")
    _, recurrent = pool.kda_state_views(layer)
    group = pool.kda_state_row_index(layer)
    index = meta.decode_state_indices(group)
    live = index.view(-1)[index.view(-1) >= 0].long()
    recurrent[live] = torch.randn(live.numel(), HEADS, DIM, DIM, device="cuda") * 0.1
    return meta, recurrent, index


@pytest.mark.parametrize("next_n", [1, 3])
def test_fla_decode_in_the_pool_matches_naive_and_writes_only_its_states(next_n):
    pool = k31_pool(num_rows=130)
    layer = pool.layout.kda_layers[30].layer
    meta, recurrent, index = decode_batch(pool, layer, 12, 2, next_n)
    q, k, v, g, beta = cuda_inputs(next_n, (14,), seed=2)
    before = pool._allocation.clone()
    out = kda_decode(q, k, v, g, beta, recurrent, index, num_accepted_tokens=meta.num_accepted_tokens,
                     use_qk_l2norm_in_kernel=True, impl="triton")
    after = pool._allocation.clone()
    pool._allocation.copy_(before)
    ref = kda_decode(q, k, v, g, beta, recurrent, index, num_accepted_tokens=meta.num_accepted_tokens,
                     use_qk_l2norm_in_kernel=True, impl="torch")
    bf16_close(out[:12], ref[:12])
    allowed = torch.zeros_like(before, dtype=torch.bool)
    allowed[: pool.layout.row_bytes] = True  # the guard row takes the padded entries
    for row in index.view(-1)[index.view(-1) >= 0].tolist():
        span = byte_range(pool, recurrent[row])
        allowed[span] = True
        got = after[span].view(torch.float32).view_as(recurrent[row])
        assert (got - recurrent[row]).abs().max() < 1e-4
    assert not (after != before)[~allowed].any()


def test_chunk_kda_prefill_in_chunks_matches_one_pass_and_the_recurrence():
    q, k, v, g, beta = cuda_inputs(300, seed=4)
    states = torch.full((3, HEADS, DIM, DIM), float("nan"), device="cuda")
    ref_out, ref_state = recurrent_reference(q, k, v, g, beta)
    results = []
    for chunks in ([300], [128, 100, 72], [1, 64, 235]):
        s = states.clone()
        outs, pos = [], 0
        for i, n in enumerate(chunks):
            part = [t[pos : pos + n] for t in (q, k, v, g, beta)]
            outs.append(kda_prefill(*part, s, torch.tensor([1], dtype=torch.int32, device="cuda"),
                                    cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device="cuda"),
                                    has_initial_state=torch.tensor([i > 0], device="cuda"),
                                    use_qk_l2norm_in_kernel=True, impl="triton"))
            pos += n
        assert rel_rms_error(torch.cat(outs), ref_out) < 5e-3
        assert rel_rms_error(s[1], ref_state) < 5e-3
        assert torch.isnan(s[[0, 2]]).all()
        results.append(s[1])
    assert rel_rms_error(results[1], results[0]) < 5e-3


def test_one_request_in_the_k31_pool_prefill_chunks_then_decodes():
    """Conv and recurrence of one K3.1 KDA layer: two chunks and four decodes on the device paths,
    against the whole-sequence references; every other byte of the pool keeps the sentinel."""
    pool = k31_pool(num_rows=8)
    layer = pool.layout.kda_layers[50].layer
    group = pool.kda_state_row_index(layer)
    pool.allocator.add("a", num_tokens=200)
    rows = pool.allocator.state_rows("a")
    conv_view, rec_view = pool.kda_state_views(layer)
    weight, bias = (t.cuda() for t in conv_params(CHANNELS))
    chunks, steps = [130, 66], 4
    total = sum(chunks) + steps
    x = torch.randn(total, CHANNELS, device="cuda").bfloat16()
    q, k, v, g, beta = cuda_inputs(total, seed=6)
    conv_outs, rec_outs, pos = [], [], 0
    for n in chunks:
        meta = build_kda_metadata([rows], [n], [pos + n], num_decodes=0, device="cuda")
        index = meta.prefill_state_indices(group)
        conv_outs.append(causal_conv1d_prefill_indexed(
            x[pos : pos + n], conv_view, index, weight, bias, query_start_loc=meta.prefill_query_start_loc,
            has_initial_state=meta.has_initial_state, max_query_len=meta.max_prefill_len))
        rec_outs.append(kda_prefill(*(t[pos : pos + n] for t in (q, k, v, g, beta)), rec_view, index,
                                    cu_seqlens=meta.prefill_cu_seqlens, has_initial_state=meta.has_initial_state,
                                    use_qk_l2norm_in_kernel=True))
        pos += n
    for _ in range(steps):
        meta = build_kda_metadata([rows, None], [1, 1], [pos + 1, 1], num_decodes=2, device="cuda")
        conv_outs.append(causal_conv1d_update_indexed(torch.cat([x[pos : pos + 1]] * 2), conv_view,
                                                      meta.decode_conv_indices(group), weight, bias)[:1])
        step = [torch.stack([t[pos], t[pos]])[:, None] for t in (q, k, v, g, beta)]
        rec_outs.append(kda_decode(*step, rec_view, meta.decode_state_indices(group),
                                   use_qk_l2norm_in_kernel=True)[0])
        pos += 1
    bf16_close(torch.cat(conv_outs), conv_reference(x, weight, bias))
    ref_out, ref_state = recurrent_reference(q, k, v, g, beta)
    assert rel_rms_error(torch.cat(rec_outs), ref_out) < 5e-3
    conv, recurrent = pool.state_tensors("a", layer)
    assert torch.equal(conv[: W - 1], x[-(W - 1):])
    assert rel_rms_error(recurrent, ref_state) < 5e-3
    allowed = torch.zeros_like(pool._allocation, dtype=torch.bool)
    allowed[: pool.layout.row_bytes] = True
    allowed[byte_range(pool, conv[: W - 1])] = True
    allowed[byte_range(pool, recurrent)] = True
    assert (pool._allocation[~allowed] == SENTINEL).all()
