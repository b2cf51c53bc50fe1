"""The DCP settings: one frozen object, validated once, built from the config plus the rank."""

import dataclasses

import numpy as np
import pytest
import torch

from dsacache.planner import CacheConfig, ConfigError, plan
from dsacache.runtime import DcpSettings, RowAllocator


@pytest.mark.parametrize("kw, match", [
    (dict(world_size=0), r"world_size \(decode_context_parallel_size\) must be an integer >= 1"),
    (dict(world_size=2.0), "world_size"),
    (dict(world_size=True), "world_size"),
    (dict(world_size=2, rank=2), r"rank=2 must be in \[0, world_size=2\)"),
    (dict(rank=-1), "rank"),
    (dict(rank="0"), "rank"),
    (dict(interleave=0), r"interleave \(cp_kv_cache_interleave_size\)"),
    (dict(interleave=1.5), "interleave"),
])
def test_bad_settings_name_the_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        DcpSettings(**kw)


def test_settings_are_frozen_and_accept_numpy_ints():
    dcp = DcpSettings(np.int64(4), np.int32(3), 2)
    assert dcp.cycle == 8 and dcp.owns(6) and not dcp.owns(5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dcp.rank = 0


def test_from_config():
    config = CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8, decode_context_parallel_size=4,
                                    cp_kv_cache_interleave_size=16)
    assert DcpSettings.from_config(config, rank=3) == DcpSettings(4, 3, 16)
    assert DcpSettings.from_config(config) == DcpSettings(4, 0, 16)
    with pytest.raises(ValueError, match="rank=4"):
        DcpSettings.from_config(config, rank=4)


def test_formula_over_ints_and_tensors():
    dcp = DcpSettings(world_size=3, rank=1, interleave=2)
    positions = torch.arange(40)
    assert dcp.owner(positions).tolist() == [dcp.owner(p) for p in range(40)]
    assert dcp.local_position(positions).tolist() == [dcp.local_position(p) for p in range(40)]
    assert dcp.owns(positions).tolist() == [dcp.owner(p) == 1 for p in range(40)]
    # Rank 1 stores positions 2, 3, 8, 9, 14, ...: its local positions count them in order.
    assert [dcp.local_position(p) for p in range(40) if dcp.owns(p)] == list(range(dcp.local_len(40)))


def test_allocator_from_layout_takes_the_config_settings():
    layout = plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8, decode_context_parallel_size=2,
                                         cp_kv_cache_interleave_size=64), num_rows=8)
    alloc = RowAllocator.from_layout(layout)
    assert alloc.dcp == DcpSettings(2, 0, 64) and alloc.tokens_per_row == 2 * layout.block_size


class TestInterleaveSetting:
    @pytest.mark.parametrize("bad", [0, -64, 2.0, "64", True])
    def test_config_refuses_a_non_positive_integer(self, bad):
        with pytest.raises(ConfigError, match="cp_kv_cache_interleave_size"):
            CacheConfig.from_model("kimi-k3.1", cp_kv_cache_interleave_size=bad)

    def test_plan_refuses_an_interleave_that_does_not_divide_the_block(self):
        interleave = 2 * plan(CacheConfig.from_model("kimi-k3.1")).block_size
        config = CacheConfig.from_model("kimi-k3.1", cp_kv_cache_interleave_size=interleave)
        with pytest.raises(ConfigError, match=f"cp_kv_cache_interleave_size={interleave} must divide the block"):
            plan(config)

    @pytest.mark.parametrize("interleave", [1, 2, 16, 64])
    def test_powers_of_two_up_to_a_page_always_plan(self, interleave):
        layout = plan(CacheConfig.from_model("kimi-k3.1", cp_kv_cache_interleave_size=interleave))
        layout.with_block_size(layout.pow2_block_size)

    def test_allocator_refuses_an_interleave_that_does_not_divide_its_block(self):
        with pytest.raises(ValueError, match="must divide block_size=128"):
            RowAllocator(4, 128, dcp=DcpSettings(2, 0, 3))


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (3, 2), (4, 64)])
def test_global_position_inverts_local_position(world, interleave):
    positions = torch.arange(5 * world * interleave + 3)
    for rank in range(world):
        dcp = DcpSettings(world, rank, interleave)
        mine = positions[dcp.owns(positions)]
        local = torch.arange(dcp.local_len(positions.numel()))
        assert torch.equal(dcp.global_position(local), mine)
        assert [dcp.global_position(int(q)) for q in local[:5]] == mine[:5].tolist()
