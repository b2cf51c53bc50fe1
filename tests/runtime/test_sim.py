"""The capacity simulator: replays drain cleanly, and the packed rows beat power-of-two rows."""

import json

import pytest

from dsacache.planner import CacheConfig, plan
from dsacache.sim import Workload, default_workload, run_simulation
from dsacache.sim.replay import Replay

SMALL = Workload(num_requests=120, arrival_rate=8.0, prompt_len_median=3000, output_len_median=60, seed=1)


@pytest.fixture(scope="module")
def k31():
    """K3.1 at TP8 with a pool small enough (5.4 GiB) for SMALL to fill it."""
    return plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8), num_rows=300)


@pytest.fixture(scope="module")
def k31_mxfp4():
    """K3.1 at TP8 with MXFP4 indexer keys (row 17,376 B/token): packed block 1088, power of two 2048.

    At the default FP8 keys both are 1024. Here 23 states overflow a 1024-token row
    (23 x 814,080 = 18,723,840 B > 1024 x 17,376 = 17,793,024 B), so the power-of-two block
    jumps to 2048 and leaves about half of each state row empty.
    """
    return plan(CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype="mxfp4"), num_rows=300)


def test_packed_rows_hold_more_requests_than_power_of_two_rows(k31_mxfp4):
    report = run_simulation(k31_mxfp4, None, SMALL, progress=False)
    packed, pow2 = report.results
    assert (packed.block_size, pow2.block_size) == (1088, 2048)
    assert packed.pool_bytes >= pow2.pool_bytes > 0.99 * packed.pool_bytes  # the same memory
    assert packed.peak_running > pow2.peak_running
    assert packed.utilisation > pow2.utilisation
    assert packed.state_row_utilisation > 0.9 > pow2.state_row_utilisation
    for result in report.results:
        assert result.finished == SMALL.num_requests and result.rejected == 0
        assert 0 < result.prefix_hit_rate < 1


def test_report_text_and_dict(k31, capsys, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)  # the bar draws only on a terminal
    report = run_simulation(k31, k31.with_block_size(k31.pow2_block_size), SMALL, progress=True)
    text = report.to_text()
    for label in ("peak concurrency", "row utilisation", "prefix hit rate", "admission refusals", "power-of-two"):
        assert label in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["workload"]["num_requests"] == 120 and len(data["results"]) == 2
    assert {"peak_running", "utilisation", "prefix_hit_rate", "admission_refusals"} <= set(data["results"][0])
    assert "100%" in capsys.readouterr().err


def test_replay_is_deterministic_and_drains_a_tight_pool():
    layout = plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8), num_rows=40)
    workload = Workload(num_requests=60, arrival_rate=20.0, prompt_len_median=4000, output_len_median=80, seed=3)
    first = Replay("packed", layout, workload).run()
    second = Replay("packed", layout, workload).run()
    assert first == second
    assert first.admission_refusals > 0  # the pool is tight, so requests wait
    assert first.finished + first.rejected == 60


def test_a_request_larger_than_the_pool_is_rejected_not_looped_on():
    layout = plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8), num_rows=8)
    workload = Workload(num_requests=5, prompt_len_median=20000, prompt_len_sigma=0.01, prompt_len_max=20000,
                        shared_prefix_fraction=0.0)
    result = Replay("packed", layout, workload).run()
    assert result.rejected == 5 and result.finished == 0


def test_paged_layout_is_simulated_alone():
    layout = plan(CacheConfig.from_model("deepseek-v3.2", tensor_parallel_size=8), num_rows=4000)
    report = run_simulation(layout, None, Workload(num_requests=30, output_len_median=20), progress=False)
    assert [r.name for r in report.results] == ["paged"]


def test_default_workload_is_seeded():
    assert default_workload(0).requests() == default_workload(0).requests()
    assert default_workload(0).requests() != default_workload(1).requests()


def test_bad_workload():
    with pytest.raises(ValueError, match="arrival_rate"):
        Workload(arrival_rate=0)
    with pytest.raises(ValueError, match="shared_prefix_fraction"):
        Workload(shared_prefix_fraction=1.5)


def test_paged_kda_model_counts_no_state_bytes_in_the_pool():
    """Kimi-Linear (KDA, no indexer) has a paged layout: its states are not in the pool."""
    layout = plan(CacheConfig.from_model("kimi-linear-48b", tensor_parallel_size=8), num_rows=4000)
    report = run_simulation(layout, None, Workload(num_requests=30, output_len_median=20), progress=False)
    (result,) = report.results
    assert 0 < result.utilisation <= 1
    assert result.state_row_utilisation == 0


def test_checkpoints_skip_the_prefill_of_shared_prefixes(k31):
    shared = Replay("packed", k31, SMALL).run()
    assert 0 < shared.prefill_tokens_saved <= shared.hit_tokens
    assert shared.checkpoints_saved > 0 and shared.checkpoint_rows_peak >= k31.state_rows_per_request
    assert shared.checkpoint_bytes_peak == shared.checkpoint_rows_peak * k31.row_bytes
    alone = Replay("packed", k31, Workload(num_requests=40, arrival_rate=8.0, prompt_len_median=3000,
                                           output_len_median=20, shared_prefix_fraction=0.0, seed=2)).run()
    assert alone.prefill_tokens_saved == 0  # unique prompts: checkpoints are saved but never restored


def test_progress_bar_stays_off_a_stderr_that_is_not_a_terminal(capsys):
    from dsacache.sim.replay import Progress

    bar = Progress("x", 10, enabled=True)
    bar.update(10)
    assert capsys.readouterr().err == ""
