"""Top-k and positions -> slots: Triton (interpreter on CPU, compiled on CUDA) against the
PyTorch reference, and both against torch.topk (as sets, never by raw order)."""

import pytest
import torch

from dsacache.ops.topk import positions_to_slots, topk_indices
from tests.helpers import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton"))]
GARBAGE = (float("nan"), 1e30, float("inf"), -float("inf"))


def distinct_logits(rows, length, device=DEVICE):
    """Rows of distinct values (a random permutation, scaled), so the top-k set is unique."""
    return torch.stack([torch.randperm(length, device=device).float() * 0.5 - length / 4 for _ in range(rows)])


def as_sets(positions):
    return [set(row[row >= 0].tolist()) for row in positions.cpu()]


def run_topk(impl, logits, lens, k, **kw):
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device=logits.device)
    topk_indices(logits, lens, k, out=out, impl=impl, **kw)
    assert (out != -7).all(), "unwritten output"
    return out


def check_valid(out, lens, k):
    for row, length in zip(out.cpu(), lens.tolist()):
        want = min(max(length, 0), k)
        assert (row[:want] >= 0).all() and (row[:want] < length).all(), "-1 or out-of-range inside min(len, k)"
        assert (row[want:] == -1).all()
        assert len(set(row[:want].tolist())) == want, "repeated position"


@pytest.mark.parametrize("impl", IMPLS)
def test_no_ties_equals_torch_topk(impl):
    k, length = 64, 2500
    logits = distinct_logits(2, length)
    lens = torch.full((2,), length, dtype=torch.int32, device=DEVICE)
    out = run_topk(impl, logits, lens, k)
    assert as_sets(out) == as_sets(torch.topk(logits, k, dim=1).indices)


@pytest.mark.parametrize("impl", IMPLS)
def test_heavy_ties_values_match_and_runs_repeat(impl):
    k, length = 100, 1500
    logits = torch.randint(0, 4, (3, length), device=DEVICE).float()
    lens = torch.full((3,), length, dtype=torch.int32, device=DEVICE)
    first = run_topk(impl, logits, lens, k)
    picked = torch.gather(logits, 1, first.long()).sort(dim=1).values
    assert torch.equal(picked, torch.topk(logits, k, dim=1).values.sort(dim=1).values)
    for _ in range(20 if impl == "torch" or DEVICE == "cuda" else 3):
        assert torch.equal(run_topk(impl, logits, lens, k), first)


@pytest.mark.parametrize("impl", IMPLS)
def test_edge_lengths_with_garbage_past_the_row(impl):
    k, width = 32, 200
    lengths = [0, 1, k - 1, k, k + 1, 150]
    logits = distinct_logits(len(lengths), width)
    for row, length in enumerate(lengths):
        logits[row, length:] = GARBAGE[row % len(GARBAGE)]
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = run_topk(impl, logits, lens, k)
    check_valid(out, lens, k)
    for row, length in enumerate(lengths):
        expected = torch.topk(logits[row, :length], min(length, k)).indices
        assert as_sets(out[row:row + 1]) == as_sets(expected[None])


@pytest.mark.parametrize("k,length", [(7, 2500), (2048, 2500), (4096, 4200)])
def test_triton_equals_reference_exactly(k, length):
    pytest.importorskip("triton")
    logits = torch.randn(3, length, device=DEVICE)
    logits[1] = torch.randint(-2, 2, (length,), device=DEVICE).float()
    logits[1, ::3] = float("nan")
    logits[2, 100:200] = 0.0
    logits[2, 200:300] = -0.0
    lens = torch.tensor([length, length - 50, k + 3], dtype=torch.int32, device=DEVICE)
    out = run_topk("triton", logits, lens, k)
    assert torch.equal(out, run_topk("torch", logits, lens, k))
    check_valid(out, lens, k)


def test_every_kernel_branch_with_small_buffers():
    """Short rows, the direct radix, the sampled cut-off, and both fallbacks (too many
    candidates: ties; too few: the largest values sit exactly on the sampled positions)."""
    pytest.importorskip("triton")
    from dsacache.ops.topk.triton_kernels import launch_topk

    k, width, samples = 40, 600, 32
    logits = torch.randn(5, width, device=DEVICE)
    logits[3] = 1.0
    logits[3, ::7] = 2.0
    logits[4] = torch.rand(width, device=DEVICE)
    stride = 500 // samples
    logits[4, :samples * stride:stride] += 10.0
    lens = torch.tensor([5, 60, 600, 600, 500], dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    out = torch.full((5, k), -7, dtype=torch.int32, device=DEVICE)
    launch_topk(logits, lens, starts, out, {"BLOCK": 64, "CAP": 512, "SAMPLES": samples, "SPLITS": 2})
    assert torch.equal(out, topk_indices(logits, lens, k, impl="torch"))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_ranks_last_and_ties_go_low(impl):
    logits = torch.tensor([[float("nan"), 1.0, -float("inf"), 1.0, 1.0, 0.5]], device=DEVICE)
    lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    assert run_topk(impl, logits, lens, 2).tolist() == [[1, 3]]
    assert run_topk(impl, logits, lens, 5).tolist() == [[1, 2, 3, 4, 5]]
    assert run_topk(impl, logits, lens, 6).tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("impl", IMPLS)
def test_row_starts_are_prefill_windows(impl):
    k = 16
    logits = distinct_logits(3, 300)
    starts = torch.tensor([0, 50, 290], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([300, 100, 100], dtype=torch.int32, device=DEVICE)
    out = run_topk(impl, logits, lens, k, row_starts=starts)
    for row, (s, n) in enumerate([(0, 300), (50, 100), (290, 10)]):
        expected = torch.topk(logits[row, s:s + n], min(n, k)).indices
        assert as_sets(out[row:row + 1]) == as_sets(expected[None])


def test_topk_validation():
    logits = torch.zeros(2, 10)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="k=0"):
        topk_indices(logits, lens, k=0)
    with pytest.raises(ValueError, match="k=4097"):
        topk_indices(logits, lens, k=4097)
    with pytest.raises(ValueError, match="seq_lens"):
        topk_indices(logits, lens[:1], k=2)
    with pytest.raises(ValueError, match="logits"):
        topk_indices(logits.double(), lens, k=2)


@pytest.mark.parametrize("impl", IMPLS)
def test_positions_to_slots(impl):
    table = torch.tensor([[5, -1, 7], [1, 2, 3]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([[0, 63, 64, 191, -1, 200],
                              [130, 129, 64, 63, -1, 5],
                              [0, 1, 64, 65, 128, 192],
                              [-1, -1, -1, -1, -1, 0]], dtype=torch.int32, device=DEVICE)
    out = positions_to_slots(positions, table, next_n=2, num_pages=3, impl=impl)
    assert out.tolist() == [[-1, -1, -1, -1, -1, -1],
                            [-1, -1, -1, -1, -1, -1],
                            [64, 65, 128, 129, -1, -1],
                            [-1, -1, -1, -1, -1, 64]]
    out = positions_to_slots(positions, table, next_n=2, impl=impl)
    assert out[0].tolist() == [320, 383, -1, 511, -1, -1]
    assert out[1].tolist() == [450, 449, -1, 383, -1, 325]


@pytest.mark.parametrize("impl", IMPLS)
def test_topk_then_slots_random(impl):
    positions = torch.randint(-1, 640, (6, 50), dtype=torch.int32, device=DEVICE)
    table = torch.randint(-1, 100, (3, 10), dtype=torch.int32, device=DEVICE)
    out = positions_to_slots(positions, table, next_n=2, num_pages=90, impl=impl)
    ref = positions_to_slots(positions, table, next_n=2, num_pages=90, impl="torch")
    assert torch.equal(out, ref)
    ok = out >= 0
    page = table.long()[torch.arange(6, device=DEVICE)[:, None] // 2, (positions.long() // 64).clamp(0, 9)]
    assert torch.equal(ok, (positions >= 0) & (page >= 0) & (page < 90))


@pytest.mark.gpu
@pytest.mark.parametrize("length", [2047, 2049, 20_000, 131_072])
@pytest.mark.parametrize("k", [2048, 4096])
def test_topk_gpu_matches_reference_and_topk_sets(length, k):
    rows = 8
    logits = torch.randn(rows, length, device="cuda")
    logits[1] = torch.randint(0, 3, (length,), device="cuda").float()
    logits[2] = logits[2].sort().values
    lens = torch.tensor([length, length, length, 0, 1, k - 1, k, k + 1], dtype=torch.int32, device="cuda")
    lens = lens.clamp_max(length)
    out = run_topk("triton", logits, lens, k)
    assert torch.equal(out, run_topk("torch", logits, lens, k))
    check_valid(out, lens, k)
    for _ in range(20):
        assert torch.equal(run_topk("triton", logits, lens, k), out)
    row0 = torch.topk(logits[0], min(k, length)).indices
    assert as_sets(out[:1]) == as_sets(row0[None])
