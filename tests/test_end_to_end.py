"""The whole pipeline on one request: plan -> pool -> slot mapping -> store keys -> decode
logits -> top-k -> cache slots, checked against plain arithmetic on the pool's bytes."""

import pytest
import torch

from dsacache import CacheConfig, plan
from dsacache.formats.indexer_key import dequantize_pages
from dsacache.ops.indexer_k_cache import fused_norm_store_indexer_keys
from dsacache.ops.indexer_logits import paged_decode_logits, per_row_context_lens
from dsacache.ops.topk import positions_to_slots, topk_indices
from dsacache.runtime import CachePool, compute_slot_mapping
from tests.helpers import triton_available

# The Triton case runs on CPU tensors (the interpreter); on a CUDA machine the gpu tests cover it.
IMPLS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.interpret)] if triton_available() else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_one_request_through_every_step(impl):
    num_tokens, layer, topk = 1300, 8, 256
    pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1"), num_rows=6))
    pool.buffer.fill_(0xA5)
    pool.allocator.add("r0", num_tokens=num_tokens)
    block_table = pool.allocator.block_table(["r0"])
    positions = torch.arange(num_tokens, dtype=torch.int64)
    slots = compute_slot_mapping(block_table, torch.tensor([0, num_tokens], dtype=torch.int32), positions, impl=impl)
    keys = torch.randn(num_tokens, 128, dtype=torch.bfloat16)
    pages = pool.index_pages(layer)
    fused_norm_store_indexer_keys(keys, torch.ones(128), torch.zeros(128), pages, slots[:num_tokens], impl=impl)

    q = torch.randn(1, 1, 32, 128).to(torch.float8_e4m3fn)
    head_weights = torch.rand(1, 32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    context_lens = per_row_context_lens(seq_lens, 1)
    logits = paged_decode_logits(q, head_weights, context_lens, pages, block_table, 2048, impl=impl)

    cached = dequantize_pages(pages, 128, "fp8").reshape(-1, 128)[slots[:num_tokens]]
    expected = (torch.relu(q.float()[0, 0] @ cached.T) * head_weights[0][:, None]).sum(0)
    torch.testing.assert_close(logits[0, :num_tokens], expected, rtol=1e-5, atol=1e-4)
    assert torch.isneginf(logits[0, num_tokens:]).all()

    top = topk_indices(logits, seq_lens, k=topk, impl=impl)
    assert set(top[0].tolist()) == set(torch.topk(logits[0, :num_tokens], topk).indices.tolist())
    cache_slots = positions_to_slots(top, block_table, impl=impl)
    assert torch.equal(cache_slots[0].long(), slots[top[0].long()])
