"""The kcache bench's host-side set-up and correctness gate, run on CPU (the bench itself needs CUDA)."""

import pytest
import torch

from dsacache.bench.harness import CorrectnessError
from dsacache.bench.k_cache import (
    SENTINEL,
    BenchPool,
    check_gather,
    check_store,
    clear,
    gather_metadata,
    make_inputs,
)
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.ops.indexer_k_cache import fused_norm_store_indexer_keys, store_indexer_keys
from dsacache.planner import CacheConfig, plan
from dsacache.runtime.pool import CachePool


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_pool_is_a_planned_k31_pool(fmt):
    """The bench's pages are what a user's plan() + CachePool hands out, with rows for the tokens."""
    pool = BenchPool(fmt, 3000, device="cpu")
    layout = plan(CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype=fmt), num_rows=pool.cache.layout.num_rows)
    user = CachePool(layout, device="cpu").index_pages(pool.layer)
    assert pool.pages.shape == user.shape and pool.pages.stride() == user.stride()
    assert pool.fmt == IndexerKeyFormat(fmt, 128) and pool.pages.stride(0) > 900_000
    assert 3000 <= pool.num_slots < 3000 + layout.block_size
    assert bool((pool.raw == SENTINEL).all())


@pytest.mark.parametrize("fmt,mode", [("fp8", "plain"), ("fp8", "fused"), ("mxfp4", "fused")])
def test_correctness_gate_passes_the_reference_and_catches_a_stray_write(fmt, mode):
    pool = BenchPool(fmt, 200, device="cpu")
    k, weight, bias, slots = make_inputs(pool, 100)
    if mode == "plain":
        store_indexer_keys(k, pool.pages, slots, impl="torch")
    else:
        fused_norm_store_indexer_keys(k, weight, bias, pool.pages, slots, impl="torch")
    check_store(pool, mode, k, weight, bias, slots)          # clears the entries again
    assert bool((pool.raw == SENTINEL).all())
    fused_norm_store_indexer_keys(k, weight, bias, pool.pages, slots, impl="torch")
    pool.raw[-1] = 0                                         # a byte no slot owns
    with pytest.raises(CorrectnessError, match="outside the slots"):
        check_store(pool, "fused", k, weight, bias, slots)
    clear(pool, slots)


def test_correctness_gate_catches_wrong_entries():
    pool = BenchPool("fp8", 200, device="cpu")
    k, weight, bias, slots = make_inputs(pool, 100)
    store_indexer_keys(k * 4, pool.pages, slots, impl="torch")
    with pytest.raises(CorrectnessError, match="fp8 plain"):
        check_store(pool, "plain", k, weight, bias, slots)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_metadata_covers_the_pool(fmt):
    pool = BenchPool(fmt, 5000, device="cpu")
    block_table, cu_seqlens, total = gather_metadata(pool)
    assert block_table.dtype == torch.int32 and cu_seqlens.dtype == torch.int32
    assert total == int(cu_seqlens[-1]) and block_table.unique().numel() == block_table.numel()
    assert total > pool.num_slots - 16 * 64
    values, _ = check_gather(pool, block_table, cu_seqlens, total)
    assert values.shape == (total, pool.fmt.value_bytes)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_every_row_is_built_with_the_timers_stubbed(fmt, monkeypatch):
    """The whole suite on CPU (Triton interpreted), each timer replaced by one call: every case
    passes its correctness gate and yields its row."""
    import argparse

    from dsacache.bench import k_cache

    def one_call(fn, *args, **kwargs):
        fn()
        return 1.0

    monkeypatch.setattr(k_cache, "time_graph", one_call)
    monkeypatch.setattr(k_cache, "time_cuda", one_call)
    monkeypatch.setattr(k_cache, "LARGE", 80)
    args = argparse.Namespace(tokens=[1, 80], sweep=True, ceiling_gbps=4000.0)
    rows = k_cache.store_rows(args, fmt, (0.001, 0.001), device="cpu")
    ops = [row.op for row in rows]
    modes = ("plain", "fused") if fmt == "fp8" else ("fused", "quant")
    for mode in modes:
        assert ops.count(f"store {fmt} {mode}") >= 2 and ops.count(f"sweep {fmt} {mode}") == 6
    assert f"gather {fmt}" in ops and f"dequantize {fmt}" in ops
    assert all(row.ms == 1.0 for row in rows)
