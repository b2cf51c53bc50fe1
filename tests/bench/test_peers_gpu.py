"""The bench's CUDA-graph timer and the peers on a GPU, at small sizes (the twins of test_peers.py).

The peer tests need the pack (``DSACACHE_PEERS``, default ``.peers`` in the repository root) and
skip a peer that is not in it, as the bench does.
"""

import os

import pytest
import torch

from dsacache.bench import peers
from dsacache.bench.harness import time_graph

pytestmark = pytest.mark.gpu

PACK = os.environ.get("DSACACHE_PEERS", ".peers")


@pytest.fixture(scope="module")
def loaded():
    return peers.load_peers(PACK)


def _peer(loaded, key):
    peer = loaded.get(key)
    if peer is None:
        pytest.skip(f"{loaded.peers[key].name}: {loaded.peers[key].reason}")
    return peer


def test_time_graph_gives_a_per_call_time_whatever_the_window():
    x = torch.randn(1 << 26, device="cuda")
    short, long = time_graph(lambda: x.mul_(1.0), window=10, windows=3), time_graph(lambda: x.mul_(1.0))
    assert 0 < short and 0 < long and abs(short - long) < 0.3 * long


def test_vllm_topk_agrees_with_the_reference(loaded):
    from dsacache.ops.topk import topk_indices

    peer = _peer(loaded, "topk")
    logits = torch.randn(8, 8192, device="cuda")
    lens = torch.full((8,), 8192, dtype=torch.int32, device="cuda")
    out = peer.make_call(logits, lens, 2048)()
    ref = topk_indices(logits, lens, 2048, impl="torch")
    assert peers.topk_agreement(out, ref, logits) == (True, "")


def test_vllm_store_agrees_with_the_reference(loaded):
    from dsacache.bench.k_cache import BenchPool, make_inputs, peer_store_agreement

    peer = _peer(loaded, "store")
    pool = BenchPool("fp8", 4096)
    k, _, _, slots = make_inputs(pool, 1000)
    cache = peer.make_call(k, slots, pool.pages.shape[0])()
    agrees, note = peer_store_agreement(pool, k, slots, cache)
    assert agrees, note


@pytest.mark.parametrize("next_n", [1, 2])
def test_deepgemm_logits_agree_with_the_reference(loaded, next_n):
    from dsacache.bench import logits
    from dsacache.ops.indexer_logits import paged_decode_logits

    peer = _peer(loaded, "logits")
    pages = logits.make_pages(4 * 64, "fp8", torch.device("cuda"))
    q, weights, seq_lens, (block_table,) = logits.make_inputs(4, 4096, 32, next_n, pages)
    seq_lens[1] = 4000  # a partly filled last page
    out = peer.make_call(q, weights, seq_lens, pages, block_table, 4096)()
    ref = paged_decode_logits(q, weights, seq_lens, pages, block_table, max_model_len=4096, impl="torch")
    agrees, note = logits.peer_agreement(out, ref)
    assert agrees, note


@pytest.mark.parametrize("heads", [12, 64, 128])
def test_flashmla_agrees_with_the_reference(loaded, heads):
    from dsacache.bench import mla

    peer = _peer(loaded, "sparse_mla")
    pages = mla.build_pool(1 << 16, "cuda")
    inputs = mla.build_inputs(4, 2, heads, 2048, pages)
    out = peer.make_call(inputs.q, pages, inputs.indices, inputs.softmax_scale)()
    agrees, note = mla.peer_agreement(out, mla.reference(inputs, pages))
    assert agrees, note
