"""KDA step metadata: state indices per state-row group, -1 padding, speculative row sets, refusals."""

import pytest
import torch

from dsacache.runtime import build_kda_metadata


def test_indices_per_group_decodes_first_and_padding():
    meta = build_kda_metadata([[0, 1, 2], None, [3, 4, 5], [6, 7, 8]], [1, 1, 5, 3], [10, 1, 5, 9], num_decodes=2,
                              num_rows=9)
    assert meta.state_indices.dtype == torch.int32 and meta.state_indices.shape == (3, 4)
    assert meta.state_indices.tolist() == [[0, -1, 3, 6], [1, -1, 4, 7], [2, -1, 5, 8]]
    assert meta.decode_state_indices(1).tolist() == [1, -1]
    assert meta.decode_conv_indices(1).tolist() == [1, -1]
    assert meta.prefill_state_indices(2).tolist() == [5, 8]
    assert meta.prefill_query_start_loc.tolist() == [0, 5, 8]
    assert meta.prefill_cu_seqlens.dtype == torch.int64
    assert meta.has_initial_state.tolist() == [False, True]  # a first chunk, then a continued one
    assert (meta.num_prefills, meta.max_prefill_len, meta.spec_state_indices) == (2, 5, None)


def test_speculative_row_sets():
    meta = build_kda_metadata([[0, 1], [2, 3], None], [2, 2, 2], [10, 9, 2], num_decodes=3, next_n=2,
                              num_accepted_tokens=[1, 2, 1], spec_state_rows=[[[0, 1], [4, 5]], [[2, 3], [6, 7]], None])
    assert meta.spec_state_indices.shape == (2, 3, 2)
    assert meta.decode_state_indices(0).tolist() == [[0, 4], [2, 6], [-1, -1]]
    assert meta.decode_conv_indices(1).tolist() == [1, 3, -1]
    assert meta.num_accepted_tokens.tolist() == [1, 2, 1]


@pytest.mark.parametrize("change", [
    dict(state_rows=[[0, 1], [1, 2]]),  # a row twice
    dict(state_rows=[[0, 1], [2]]),
    dict(state_rows=[None, None]),
    dict(state_rows=[[0, 1], [2, 9]]),  # past num_rows
    dict(query_lens=[2, 3]),  # a decode without next_n tokens
    dict(num_decodes=3),
    dict(next_n=2),  # speculation needs accepted counts and row sets
    dict(num_accepted_tokens=[1, 1]),
    dict(spec_state_rows=[[[0, 1]], [[2, 3]]]),
])
def test_refusals(change):
    args = dict(state_rows=[[0, 1], [2, 3]], query_lens=[1, 3], seq_lens=[5, 3], num_decodes=1, num_rows=8) | change
    with pytest.raises(ValueError):
        build_kda_metadata(**args)


def test_speculative_refusals():
    base = dict(state_rows=[[0], [1]], query_lens=[2, 2], seq_lens=[5, 6], num_decodes=2, next_n=2,
                num_accepted_tokens=[1, 2], spec_state_rows=[[[0], [2]], [[1], [3]]])
    build_kda_metadata(**base)
    for change in (dict(spec_state_rows=[[[0], [2]], [[1], [2]]]),  # a draft row twice
                   dict(spec_state_rows=[[[5], [2]], [[1], [3]]]),  # first set is not the request's rows
                   dict(num_accepted_tokens=[1, 3]),
                   dict(spec_state_rows=[[[0], [2]]])):
        with pytest.raises(ValueError):
            build_kda_metadata(**(base | change))
