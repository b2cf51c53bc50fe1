"""One rule for "rows a request of N tokens needs": the plan's concurrency figure, the row
allocator and the simulator agree, with and without decode context parallelism."""

import pytest

from dsacache.planner import CacheConfig, plan
from dsacache.planner.layout import attention_rows_for
from dsacache.planner.report import max_concurrent_requests, summarize
from dsacache.runtime import OutOfRowsError, RowAllocator
from dsacache.sim import Workload
from dsacache.sim.replay import Replay

CONTEXT = 32768


def layout_at(dcp, **options):
    return plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8, decode_context_parallel_size=dcp,
                                       **options))


def admitted(allocator, num_tokens):
    """Requests of ``num_tokens`` the allocator takes before it runs out of rows."""
    count = 0
    while True:
        try:
            allocator.add(count, num_tokens=num_tokens)
        except OutOfRowsError:
            return count
        count += 1


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_plan_and_allocator_agree(dcp):
    layout = layout_at(dcp)
    fits = summarize(layout, CONTEXT)["max_concurrent_requests"]
    assert fits == admitted(RowAllocator.from_layout(layout), CONTEXT)
    assert summarize(layout, CONTEXT)["attention_rows_per_request"] == layout.attention_rows_for(CONTEXT)


def test_dcp_multiplies_the_tokens_a_row_covers():
    base = layout_at(1)
    for dcp in (2, 4, 8):
        layout = layout_at(dcp)
        assert layout.block_size == base.block_size and layout.num_rows == base.num_rows
        assert layout.tokens_per_row == dcp * base.block_size
        assert layout.attention_rows_for(CONTEXT) == -(-CONTEXT // (dcp * base.block_size))
        assert max_concurrent_requests(layout, CONTEXT) > max_concurrent_requests(base, CONTEXT)


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_simulated_peak_is_the_planned_concurrency(dcp):
    """Every request arrives at step 0 with a prompt of CONTEXT tokens: the replay admits
    exactly as many as the plan says fit, and then drains."""
    layout = layout_at(dcp)
    fits = max_concurrent_requests(layout, CONTEXT)
    n = fits + 5
    workload = Workload(num_requests=n, arrival_rate=1e9, prompt_len_median=CONTEXT, prompt_len_min=CONTEXT,
                        prompt_len_max=CONTEXT, output_len_median=1, output_len_max=1, shared_prefix_fraction=0.0,
                        max_num_seqs=n, max_num_batched_tokens=CONTEXT * n)
    result = Replay("packed", layout, workload).run()
    assert result.peak_running == fits
    assert result.finished == n and result.rejected == 0
    assert 0 < result.attention_row_utilisation <= 1


@pytest.mark.parametrize("num_tokens, block, dcp, rows", [
    (0, 64, 1, 0), (1, 64, 1, 1), (64, 64, 1, 1), (65, 64, 1, 2), (128, 64, 2, 1), (129, 64, 2, 2), (1, 1216, 8, 1),
])
def test_rows_rule(num_tokens, block, dcp, rows):
    assert attention_rows_for(num_tokens, block, dcp) == rows


@pytest.mark.parametrize("bad", [2.5, -1, True, "7", None])
def test_rows_rule_refuses_a_bad_count(bad):
    with pytest.raises(ValueError, match="num_tokens"):
        attention_rows_for(bad, 64)
