"""The DCP bench's set-up and checks, on the CPU (the bench itself times on CUDA): its pool, inputs and
step run, its correctness check passes on a right step and refuses a wrong one, at DCP 1 and over gloo
at DCP 2 (where the check puts the whole rows' logits together from both ranks)."""

import argparse
import time

import pytest
import torch
import torch.multiprocessing as mp

from dsacache.bench import dcp as bench
from dsacache.bench.harness import CorrectnessError
from dsacache.ops.topk import topk_indices
from dsacache.parallel import merge_topk
from dsacache.runtime import DcpSettings
from tests.parallel.dcp_case import init_group

CTX, TOPK = 2048, 256


def _args(next_n: int = 1) -> argparse.Namespace:
    return argparse.Namespace(batch=2, next_n=next_n, topk=TOPK)


def _step(dcp: DcpSettings, group, next_n: int, lse_merge: str = "all_to_all"):
    pool = bench.bench_pool(dcp, 3 * 19_365_888, "cpu", seed=dcp.rank)
    meta, inputs = bench.bench_step_inputs(pool, dcp, 2, CTX, next_n)
    step = bench.make_step(pool, group, dcp, _args(next_n), CTX, lse_merge)
    step.run(pool.layout.dsa_layers[0].layer, meta, inputs, impl="torch")
    return pool, meta, step


@pytest.mark.parametrize("next_n", [1, 2])
def test_bench_step_at_dcp1_passes_its_check(next_n):
    pool, meta, step = _step(DcpSettings(), None, next_n)
    assert pool.layout.num_rows == 3
    bench.check_step(step, meta, CTX)
    assert bench.step_hbm_bytes(step, CTX, 2) == 2 * bench.step_hbm_bytes(step, CTX, 1) > 0
    step.global_positions[0, :2] = step.global_positions[0, :2].flip(0)
    with pytest.raises(CorrectnessError, match="not the whole rows' top-k"):
        bench.check_step(step, meta, CTX)


def test_bench_pool_is_filled_and_refuses_a_context_it_cannot_page():
    pool = bench.bench_pool(DcpSettings(), 19_365_888, "cpu")
    assert int(pool.buffer.min()) >= bench.FILL[0] and int(pool.buffer.max()) < bench.FILL[1]
    with pytest.raises(ValueError, match="raise --pool-gib"):
        bench.bench_step_inputs(pool, DcpSettings(), 1, 16 * 64 + 1, 1)


@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 64)])
def test_simulated_ranks_merge_to_the_whole_rows_topk(world, interleave):
    logits, lens, candidates = bench.simulated_ranks(3, 5000, 64, world, interleave, "cpu")
    assert candidates.shape == (world, 3, 64)
    assert torch.equal(merge_topk(candidates, 64), topk_indices(logits, lens, 64))


def _bench_rank(rank: int, world: int, store_path: str) -> None:
    init_group(rank, world, store_path, "gloo")
    try:
        for lse_merge in bench.LSE_MERGES:
            _, meta, step = _step(DcpSettings(world, rank, 1), None, 1, lse_merge)
            bench.check_step(step, meta, CTX)
            assert set(step.collective_ops()) == set(step.collective_bytes())
            for op in step.collective_ops().values():
                op()
        if rank == 1:  # one rank's merge is wrong: every rank's check fails
            step.global_positions[1, 0] = -5
        with pytest.raises(CorrectnessError):
            bench.check_step(step, meta, CTX)
    finally:
        torch.distributed.destroy_process_group()


def test_bench_check_over_gloo(tmp_path):
    context = mp.start_processes(_bench_rank, args=(2, str(tmp_path / "store")), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail("the 2 bench ranks did not finish within 120 s")
