"""A DSA layer's decode step under DCP N equals the one-rank step: spawned ranks over gloo (CPU) or NCCL (GPU).

The reference runs here on one pool holding every token with all ``N x H_local`` heads; each
spawned rank stores its share in its own pool, runs :class:`DcpDsaDecodeStep` with each LSE merge
and saves what it got. Checked: the same top-k positions (global, exactly, ties included) on
every rank, each rank's heads' output within bf16 rounding and LSE within 1e-3 of the
reference, no byte written outside the rank's own new tokens, and the refusals (in the ranks).
Cases: N = 2 and 4, interleave 1 and 64, next_n 1 and 2, ragged lengths from 1 token up, lengths
below k, and rows where a rank owns no selected token.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from dsacache import CacheConfig, plan
from dsacache.parallel import LSE_MERGES, DcpDsaDecodeStep
from dsacache.runtime import CachePool, DcpSettings, RowAllocator
from tests.helpers import rel_rms_error
from tests.parallel import dcp_case
from tests.parallel.dcp_case import Case

#: Seconds the spawned ranks of one test may take in all (start-up included) before they are killed.
JOIN_TIMEOUT_S = 150


def spawn_ranks(world: int, tmp_path, names: list[str], backend: str, impl: str) -> None:
    """Run ``dcp_case.run_rank`` in ``world`` spawned processes; fail (and kill them) past the timeout."""
    context = mp.start_processes(dcp_case.run_rank, args=(world, str(tmp_path / "store"), str(tmp_path), names,
                                                          backend, impl),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"the {world} DCP ranks did not finish within {JOIN_TIMEOUT_S} s")


def _cases(world: int, interleave: int) -> dict[str, Case]:
    return {f"n{next_n}": Case(world, interleave, next_n) for next_n in (1, 2)}


def _prepare(tmp_path, cases: dict[str, Case], device: str, impl: str) -> dict[str, dict]:
    refs = {}
    for name, case in cases.items():
        data = dcp_case.make_data(case)
        torch.save((case, data), tmp_path / f"{name}.data.pt")
        refs[name] = dcp_case.reference(case, data, device, impl)
    return refs


def _expected_bytes(case: Case, lse_merge: str) -> dict[str, int]:
    """Bytes each rank receives per collective, written out from the shapes (bf16 queries of 576 values,
    int64 candidates, bf16 outputs of 512 values, fp32 LSEs)."""
    others, rows, h = case.world - 1, case.batch * case.next_n, case.heads_local
    moved = {"query_all_gather": others * rows * h * 576 * 2, "topk_all_gather": others * rows * dcp_case.TOPK * 8}
    if lse_merge == "all_to_all":
        moved["lse_all_to_all"] = others * rows * h * (512 * 2 + 4)
    else:
        moved["lse_all_gather"] = others * rows * case.world * h * 4
        moved["out_reduce_scatter"] = others * rows * h * 512 * 2
    return moved


def _check_against_reference(tmp_path, cases: dict[str, Case], refs: dict[str, dict]) -> None:
    for name, case in cases.items():
        ref, h = refs[name], case.heads_local
        no_share = 0  # (rank > 0, row) pairs where the rank owns none of the selected tokens
        for lse_merge in LSE_MERGES:
            for rank in range(case.world):
                got = torch.load(tmp_path / f"{name}.{lse_merge}.rank{rank}.pt")
                where = f"{name} {lse_merge} rank {rank}"
                assert torch.equal(got["global_positions"], ref["positions"]), f"{where}: top-k differs"
                want_out = ref["out"][:, :, rank * h:(rank + 1) * h].float()
                want_lse = ref["lse"][:, :, rank * h:(rank + 1) * h].double()
                assert torch.isfinite(got["out"].float()).all() and torch.isfinite(got["lse"]).all(), where
                assert rel_rms_error(got["out"].float(), want_out) < 5e-3, where
                assert torch.allclose(got["out"].float(), want_out, atol=1e-2, rtol=1e-2), where
                assert float(((got["lse"].double() - want_lse).abs() / want_lse.abs().clamp_min(1)).max()) < 1e-3
                if rank > 0:
                    no_share += int((got["owned"] < 0).all(dim=1).sum())
                assert got["bytes"] == _expected_bytes(case, lse_merge), where
        assert no_share > 0, f"{name}: no row where a rank other than 0 owns none of the selected tokens"
        assert any(int((ref["positions"][r] >= 0).sum()) < dcp_case.TOPK for r in range(ref["positions"].shape[0]))


@pytest.mark.parametrize("world, interleave", [(2, 1), (2, 64), (4, 1), (4, 64)])
def test_dcp_step_equals_the_one_rank_step_over_gloo(tmp_path, world, interleave):
    cases = _cases(world, interleave)
    refs = _prepare(tmp_path, cases, "cpu", "torch")
    spawn_ranks(world, tmp_path, list(cases), "gloo", "torch")
    _check_against_reference(tmp_path, cases, refs)


def _triton_sparse_mla_missing() -> bool:
    from dsacache.ops.sparse_mla import sparse_mla_decode

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16, device="cuda")
    pages = torch.zeros(1, 64, 656, dtype=torch.uint8, device="cuda")
    try:
        sparse_mla_decode(q, pages, torch.zeros(1, 1, 64, dtype=torch.int32, device="cuda"), 0.1, impl="triton")
    except NotImplementedError:
        return True
    return False


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("world, interleave", [(2, 1), (2, 64), (4, 1), (4, 64), (8, 1), (8, 64)])
def test_dcp_step_equals_the_one_rank_step_over_nccl(tmp_path, world, interleave, impl):
    """The same over NCCL, one process a GPU (``impl="auto"``: the Triton kernels on every rank)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    if impl == "auto" and _triton_sparse_mla_missing():
        pytest.skip("the Triton sparse MLA decode is not on this branch (impl='auto' would refuse it)")
    cases = _cases(world, interleave)
    refs = _prepare(tmp_path, cases, "cuda", impl)
    spawn_ranks(world, tmp_path, list(cases), "nccl", impl)
    _check_against_reference(tmp_path, cases, refs)


def _tiny_pool(world: int = 1, rank: int = 0, interleave: int = 1) -> CachePool:
    config = CacheConfig.from_config_dict(dcp_case.TINY_MODEL, name="tiny", decode_context_parallel_size=world,
                                          cp_kv_cache_interleave_size=interleave)
    layout = plan(config, num_rows=8)
    return CachePool(layout, allocator=RowAllocator.from_layout(layout, dcp=DcpSettings(world, rank, interleave)))


KW = dict(batch_size=2, next_n=1, num_heads_local=4, max_model_len=256, softmax_scale=dcp_case.SCALE)


@pytest.mark.parametrize("change, match", [
    (dict(num_heads_local=16), r"num_heads_local=16 x DCP world_size=4 is more than the model's 32"),
    (dict(num_heads_local=0), "num_heads_local must be an integer >= 1"),
    (dict(max_model_len=2**31), "max_model_len=2147483648 must be at most 2147483647"),
    (dict(max_model_len=1.5), "max_model_len must be an integer >= 1"),
    (dict(topk=0), r"topk=0; allowed: integers 1..4096"),
    (dict(topk=4097), r"topk=4097; allowed: integers 1..4096"),
    (dict(topk=True), r"topk=True; allowed"),
    (dict(lse_merge="ring"), "lse_merge='ring'; allowed: all_to_all, all_gather_reduce_scatter"),
])
def test_refusals_before_any_group(change, match):
    with pytest.raises(ValueError, match=match):
        DcpDsaDecodeStep(_tiny_pool(4, 1, 64), None, DcpSettings(4, 1, 64), **{**KW, **change})


def test_world_size_above_one_needs_a_process_group():
    with pytest.raises(ValueError, match="DCP world_size=2 needs an initialized torch.distributed process group"):
        DcpDsaDecodeStep(_tiny_pool(2, 0), None, DcpSettings(2, 0), **KW)
    with pytest.raises(ValueError, match="dcp must be a DcpSettings"):
        DcpDsaDecodeStep(_tiny_pool(), None, 1, **KW)
    with pytest.raises(ValueError, match="pool must be a CachePool"):
        DcpDsaDecodeStep(object(), None, DcpSettings(), **KW)


def test_world_size_one_is_the_one_gpu_step():
    """DCP 1: no process group, no collective, the same (out, lse) and positions as DsaDecodeStep."""
    case = Case(world=1, interleave=1, next_n=1)
    data = dcp_case.make_data(case)
    ref = dcp_case.reference(case, data)
    pool, meta, inputs = dcp_case.build(case, data, DcpSettings())
    step = DcpDsaDecodeStep(pool, None, DcpSettings(), batch_size=case.batch, next_n=1, num_heads_local=4,
                            max_model_len=dcp_case.MAX_MODEL_LEN, softmax_scale=dcp_case.SCALE, topk=dcp_case.TOPK)
    out, lse = step.run(dcp_case.LAYER, meta, inputs, impl="torch")
    assert step.collective_bytes() == {} and step.collective_ops() == {}
    assert torch.equal(step.global_positions, ref["positions"])
    assert torch.equal(out, ref["out"]) and torch.equal(lse, ref["lse"])
