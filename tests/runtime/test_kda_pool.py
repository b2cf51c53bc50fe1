"""The pool's per-layer KDA state views: strided over every row, the same bytes as a request's
state, and index -1 in the guard row in front of row 0."""

import pytest
import torch

from dsacache.planner import CacheConfig, SpeculativeConfig, plan
from dsacache.runtime import CachePool
from tests.helpers import TINY_HYBRID

W = 4
TINY = TINY_HYBRID


def tiny_pool(num_rows, num_spec=0):
    spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": num_spec}) if num_spec else None
    return CachePool(plan(CacheConfig.from_config_dict(TINY, tensor_parallel_size=1, speculative=spec),
                          num_rows=num_rows))


def test_pool_views_index_state_rows_and_minus_one_is_the_guard_row():
    pool = tiny_pool(num_rows=5, num_spec=2)
    layout = pool.layout
    assert layout.guard_rows == 1 and pool._allocation.numel() == 6 * layout.row_bytes
    assert pool.buffer.data_ptr() - pool._allocation.data_ptr() == layout.row_bytes
    for slot in layout.kda_layers:
        conv, recurrent = pool.kda_state_views(slot.layer)
        assert conv.shape == (5, W - 1 + 2, 192) and conv.dtype == torch.bfloat16
        assert recurrent.shape == (5, 4, 16, 16) and recurrent.dtype == torch.float32
        assert conv.stride(0) * 2 == recurrent.stride(0) * 4 == layout.row_bytes
        assert recurrent.stride()[1:] == (256, 16, 1)
        rows = [4, 0, 2][: layout.state_rows_per_request]
        one_conv, one_rec = pool.state_tensors_at(rows, slot.layer)
        row = rows[pool.kda_state_row_index(slot.layer)]
        assert conv[row].data_ptr() == one_conv.data_ptr() and recurrent[row].data_ptr() == one_rec.data_ptr()
        # index -1 through the view's stride lands in the guard row, at the same slot
        guard = recurrent.data_ptr() - recurrent.stride(0) * 4
        assert pool._allocation.data_ptr() <= guard < pool.buffer.data_ptr()
    with pytest.raises(ValueError, match="not a KDA layer"):
        pool.kda_state_views(4)
    paged = CachePool(plan(CacheConfig.from_model("kimi-linear-48b"), num_rows=2))
    assert paged.layout.guard_rows == 0
    with pytest.raises(NotImplementedError, match="packed"):
        paged.kda_state_views(1)


def test_views_write_only_their_layers_bytes():
    pool = tiny_pool(num_rows=4)
    pool._allocation.fill_(0xA5)
    conv, recurrent = pool.kda_state_views(5)
    conv.fill_(1.0)
    recurrent.fill_(2.0)
    written = pool.buffer.view(4, -1) != 0xA5
    slot = next(s for s in pool.layout.kda_layers if s.layer == 5)
    state = pool.layout.state
    expected = torch.zeros_like(written)
    expected[:, slot.offset : slot.offset + state.nbytes] = True
    assert torch.equal(written, expected)
    assert (pool._allocation[: pool.layout.row_bytes] == 0xA5).all()  # the guard row: only index -1 reaches it
