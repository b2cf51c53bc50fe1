"""The DCP merges as pure functions, with the N ranks' inputs simulated on one device.

The top-k merge must give exactly what ``topk_indices`` gives on the whole row's logits
(ties to the lower position, NaN last), the LSE merge the attention over the union of the
ranks' tokens. CPU, and the same on CUDA (``gpu``).
"""

import math

import pytest
import torch

from dsacache.ops.topk import topk_indices
from dsacache.parallel import (
    EMPTY,
    merge_partials,
    merge_topk,
    merged_lse,
    owned_local_positions,
    pack_candidates,
    unpack_positions,
    weighted_partial,
)
from dsacache.runtime import DcpSettings

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _logits(rows: int, width: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "randn":
        return torch.randn(rows, width, generator=gen)
    if kind == "ties":  # a handful of values, each tied many times, across every rank
        return torch.randint(0, 4, (rows, width), generator=gen).float()
    if kind == "equal":  # every score the same: the top-k is the k lowest positions
        return torch.full((rows, width), 0.25)
    special = torch.randint(0, 4, (rows, width), generator=gen).float()  # ties, NaN, +-inf, -0.0 vs 0.0
    pick = torch.randint(0, 8, (rows, width), generator=gen)
    special[pick == 0] = float("nan")
    special[pick == 1] = float("-inf")
    special[pick == 2] = float("inf")
    special[pick == 3] = -0.0
    special[pick == 4] = 0.0
    return special


def _local_logits(logits: torch.Tensor, dcp: DcpSettings, width: int) -> torch.Tensor:
    """The rank's view of ``logits``: column ``q`` holds global position ``global_position(q)``; NaN past the row."""
    local = torch.full((logits.shape[0], width), float("nan"), device=logits.device)
    positions = dcp.global_position(torch.arange(width, device=logits.device))
    inside = positions < logits.shape[1]
    local[:, inside] = logits[:, positions[inside]]
    return local


def _simulate(logits: torch.Tensor, lens: torch.Tensor, k: int, world: int, interleave: int):
    """Every rank's local top-k, packed and stacked as the all-gather delivers them ``[N, R, k]``."""
    width = DcpSettings(world, 0, interleave).local_len(logits.shape[1])
    packed = []
    for rank in range(world):
        dcp = DcpSettings(world, rank, interleave)
        local = _local_logits(logits, dcp, width)
        positions = topk_indices(local, dcp.local_len(lens), k)
        packed.append(pack_candidates(local, positions, dcp))
    return torch.stack(packed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (2, 64), (3, 2), (4, 1), (4, 64), (8, 16)])
@pytest.mark.parametrize("kind", ["randn", "ties", "equal", "special"])
def test_merge_equals_the_one_rank_topk(device, world, interleave, kind):
    gen = torch.Generator().manual_seed(world * 100 + interleave)
    width, k = 700, 48
    lens = torch.tensor([0, 1, 5, 47, 48, 49, 63, 64, 65, 130, 300, 700], dtype=torch.int32)
    logits = _logits(lens.numel(), width, kind, gen).to(device)
    lens = lens.to(device)
    candidates = _simulate(logits, lens, k, world, interleave)
    out = torch.full((lens.numel(), k), 12345, dtype=torch.int32, device=device)
    merged = merge_topk(candidates, k, out=out)
    assert merged is out
    assert torch.equal(merged, topk_indices(logits, lens, k))


@pytest.mark.parametrize("device", DEVICES)
def test_merge_with_a_large_k_on_one_rank(device):
    """k = 2048 over 4 ranks, one row's whole top-k on one rank (the others' candidates all lose)."""
    gen = torch.Generator().manual_seed(7)
    world, interleave, k, width = 4, 64, 2048, 16384
    logits = torch.randn(3, width, generator=gen)
    owner = (torch.arange(width) // interleave) % world
    logits[1, owner == 2] += 100.0
    lens = torch.tensor([width, width, 3000], dtype=torch.int32)
    logits, lens = logits.to(device), lens.to(device)
    merged = merge_topk(_simulate(logits, lens, k, world, interleave), k)
    assert torch.equal(merged, topk_indices(logits, lens, k))
    assert bool((owner.to(device)[merged[1].long()] == 2).all())


@pytest.mark.parametrize("device", DEVICES)
def test_packing_orders_like_the_topk(device):
    """Higher score first; an equal score: the lower global position; NaN below -inf; no candidate lowest."""
    dcp = DcpSettings(2, 1, 1)  # local 0, 1, 2, 3 are global 1, 3, 5, 7
    logits = torch.tensor([[1.0, 1.0, float("-inf"), float("nan")]], device=device)
    positions = torch.tensor([[0, 1, 2, 3, -1]], dtype=torch.int32, device=device)
    packed = pack_candidates(logits, positions, dcp)
    assert unpack_positions(packed).tolist() == [[1, 3, 5, 7, -1]]
    values = packed[0].tolist()
    assert values[0] > values[1] > values[2] > values[3] > values[4] == EMPTY


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (4, 64), (3, 2)])
def test_owned_local_positions(device, world, interleave):
    gen = torch.Generator().manual_seed(3)
    k = 40
    rows = [torch.sort(torch.randperm(500, generator=gen)[:n]).values for n in (0, 1, 17, 40)]
    chosen = torch.full((len(rows), k), -1, dtype=torch.int32)
    for r, row in enumerate(rows):
        chosen[r, :row.numel()] = row.to(torch.int32)
    chosen = chosen.to(device)
    seen = [[] for _ in rows]
    for rank in range(world):
        dcp = DcpSettings(world, rank, interleave)
        out = torch.full_like(chosen, 999)
        owned = owned_local_positions(chosen, dcp, out=out)
        assert owned is out
        for r, row in enumerate(owned.cpu().tolist()):
            count = sum(p >= 0 for p in row)
            assert row[count:] == [-1] * (k - count) and row[:count] == sorted(row[:count])
            mine = [int(p) for p in rows[r] if dcp.owns(int(p))]
            assert [dcp.global_position(p) for p in row[:count]] == mine
            seen[r].extend(mine)
    assert [sorted(s) for s in seen] == [row.tolist() for row in rows]


def _partials(scores: torch.Tensor, values: torch.Tensor, owner: torch.Tensor, world: int):
    """fp64 attention of each rank over the tokens it owns: out ``[N, rows, D]``, lse ``[N, rows]``."""
    outs, lses = [], []
    for rank in range(world):
        s = scores.masked_fill(owner != rank, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[:, None])
        outs.append(p @ values)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_lse_merge_is_attention_over_the_union(device, world):
    gen = torch.Generator().manual_seed(world)
    rows, tokens, dim = 6, 50, 512
    scores = torch.randn(rows, tokens, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    owner = torch.randint(0, world, (rows, tokens), generator=gen)
    owner[1] = 0  # one row held by rank 0 alone: every other rank has lse = -inf there
    scores[2] = float("-inf")  # one row with no token at all
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref_out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values
    out_parts, lse_parts = _partials(scores, values, owner, world)
    out_parts, lse_parts = out_parts.to(device, torch.bfloat16), lse_parts.to(device, torch.float32)
    out = torch.full((rows, dim), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((rows,), float("nan"), device=device)
    merge_partials(out_parts, lse_parts, out=out, lse=lse)
    assert torch.isneginf(lse[2]) and bool((out[2] == 0).all())
    keep = torch.isfinite(ref_lse)
    assert torch.allclose(lse.cpu().double()[keep], ref_lse[keep], atol=1e-5)
    assert torch.allclose(out.cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
    # The reduce-scatter form: each rank's weighted share, summed, is the same output.
    total = merged_lse(lse_parts)
    shares = torch.stack([weighted_partial(out_parts[r], lse_parts[r], total) for r in range(world)])
    assert torch.equal(total, lse)
    assert torch.allclose(shares.double().sum(0).cpu(), ref_out, atol=3e-2, rtol=3e-2)


def test_lse_merge_matches_a_single_part():
    """N = 1: the merge leaves a partial result as it is."""
    out = torch.randn(3, 4, 512).to(torch.bfloat16)
    lse = torch.randn(3, 4)
    merged, total = merge_partials(out[None], lse[None])
    assert torch.equal(merged, out) and torch.allclose(total, lse)
    assert math.isclose(float(merged_lse(torch.tensor([[0.0], [0.0]]))[0]), math.log(2), rel_tol=1e-6)


@pytest.mark.gpu
def test_merges_capture_in_a_cuda_graph():
    """No host sync and fixed shapes: the merges replay from a CUDA graph with the eager results."""
    world, interleave, k = 4, 64, 2048
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 20000, generator=gen).cuda()
    lens = torch.tensor([20000, 5, 0, 3000, 20000, 64, 65, 19999], dtype=torch.int32).cuda()
    candidates = _simulate(logits, lens, k, world, interleave)
    parts = torch.randn(world, 8, 12, 512, generator=gen).to("cuda", torch.bfloat16)
    lse_parts = torch.randn(world, 8, 12, generator=gen).cuda()
    dcp = DcpSettings(world, 1, interleave)
    merged = torch.empty(8, k, dtype=torch.int32, device="cuda")
    work = torch.empty(8, world, k, dtype=torch.int64, device="cuda")
    owned = torch.empty_like(merged)
    out = torch.empty(8, 12, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(8, 12, device="cuda")

    def merges():
        merge_topk(candidates, k, out=merged, work=work)
        owned_local_positions(merged, dcp, out=owned)
        merge_partials(parts, lse_parts, out=out, lse=lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        merges()
    torch.cuda.current_stream().wait_stream(side)
    want = [t.clone() for t in (merged, owned, out, lse)]
    for t in (merged, owned, out, lse):
        t.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merges()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(got, w) for got, w in zip((merged, owned, out, lse), want))
    assert torch.equal(merged, topk_indices(logits, lens, k))
