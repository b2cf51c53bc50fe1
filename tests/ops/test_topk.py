"""Top-k and positions -> slots: Triton (interpreter on CPU, compiled on CUDA) against the
PyTorch reference, and both against torch.topk (as sets, never by raw order)."""

import re

import numpy as np
import pytest
import torch

from dsacache.ops.topk import positions_to_slots, topk_indices
from tests.helpers import PTXAS_USAGE, run_compiled_script, triton_available

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


def launch_small(logits, lens, k, settings):
    """launch_topk on small buffers (``settings``: TopkConfig fields); the output must equal
    the PyTorch reference exactly."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk

    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32, device=DEVICE)
    launch_topk(logits, lens, torch.zeros_like(lens), out, TopkConfig(**settings))
    assert torch.equal(out, topk_indices(logits, lens, k, impl="torch"))
    return out


def branch_rows(k, width, samples):
    """Rows that reach every branch with samples=samples, cap=512 and progs=4 (runs of 8
    samples: 4 runs at width 600)."""
    logits = torch.randn(12, width, device=DEVICE)
    logits[1] = 1.0                                     # too many candidates: ties
    logits[1, ::7] = 2.0
    logits[2] = torch.rand(width, device=DEVICE)        # too few: the largest sit on the sampled runs
    for g in range(4):
        logits[2, g * (width // 4):g * (width // 4) + 8] += 10.0
    stride = 500 // samples
    logits[3] = torch.rand(width, device=DEVICE)        # fewer large values than k, evenly strided
    logits[3, :samples * stride:stride] += 10.0
    logits[4] = torch.arange(width, device=DEVICE).float()  # skewed: every candidate in the last split
    logits[5] = torch.randint(0, 60, (width,), device=DEVICE).float()  # ties at the cut, in registers
    logits[6, 300:] = float("nan")
    logits[7] = -float("inf")
    logits[8, 7] = 1e30
    logits[8, ::11] = -float("inf")
    lens = torch.tensor([600, 600, 600, 500, 600, 600, 600, 600, 600, 5, k, k - 1], dtype=torch.int32,
                        device=DEVICE)
    return logits, lens


@pytest.mark.parametrize("extra", [{"vec": 1, "ties": 8}, {"vec": 2, "ties": 32}, {"vec": 2, "load": 8},
                                   {"vec": 4, "load": 128}, {"vec": 2, "ahead": 2}])
def test_every_kernel_branch_with_small_buffers(extra):
    """Short rows (n < k, n == k, k - 1), the direct radix, the sampled cut-off, both
    fallbacks (too many candidates: ties; too few: the largest values sit exactly on the
    sampled positions), the skewed row (filtered again, densely), the chosen bin ranked
    pairwise or by radix passes (ties 8 and 32), the select loading a few slots a segment
    first (load 8: most rows then reload whole segments) or all of them, NaN and all -inf rows."""
    pytest.importorskip("triton")
    k, samples = 40, 32
    logits, lens = branch_rows(k, 600, samples)
    lens[0] = k + 1  # direct radix on a row too short to sample
    settings = dict(block=64, cap=512, samples=samples, progs=4, bins=64, **extra)
    launch_small(logits, lens, k, settings)
    lens[0] = 600
    launch_small(logits, lens, k, settings)


def _skewed_rows(seed: int, width: int) -> torch.Tensor:
    """Four N(0, 1) rows, row 0 plus a ramp (its later slices overflow), row 1 ascending (every
    candidate in the last slice)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, width, generator=gen).to(DEVICE)
    logits[0] += torch.linspace(0, 4, width, device=DEVICE)
    logits[1] = torch.arange(width, device=DEVICE).float()
    return logits


def pooled_candidates(seg, counts, pool, cap, progs, tile):
    """Each filter program's candidates read back by the pool rule (``filter.pool_layout``): its
    first SEG from its segment, then its pool blocks in the order it took them; [R][PROGS] lists
    of (key, position) int32 pairs."""
    from dsacache.ops.topk.filter import pool_layout

    blocks, owner, cursor, _ = pool_layout(cap, progs, tile)
    seg_len = cap // progs
    rows = []
    for r in range(seg.shape[0]):
        pairs = seg[r].view(progs, seg_len, 2).cpu()
        lists = [pairs[p, :min(int(counts[r, p]), seg_len)].tolist() for p in range(progs)]
        pool_pairs = pool[r, :owner].view(blocks, tile, 2).cpu()
        for b in range(min(int(pool[r, cursor]), blocks)):
            p = int(pool[r, owner + b])
            lists[p] += pool_pairs[b, :min(int(counts[r, p]) - len(lists[p]), tile)].tolist()
        rows.append(lists)
    return rows


@pytest.mark.parametrize("vec", [4, 8])
def test_filter_pool_holds_every_candidate_in_order(vec):
    """The filter's one rule for where candidates go (``filter.pool_layout``): past its segment, a
    program's candidates fill pool blocks it takes in position order. Read back by that rule, every
    program holds exactly the (key, position) pairs of its slice at or above the cut-off, in order,
    on a ramp row (later slices overflow, some by many blocks), an ascending row (every candidate
    in the last slice) and a random one."""
    _check_pool_rule(DEVICE, vec)


@pytest.mark.gpu
@pytest.mark.parametrize("vec", [4, 8, 16])
def test_filter_pool_rule_on_the_gpu(vec):
    """The same rule kept by the tile-step PTX (compiled, 4-16 logits a lane)."""
    _check_pool_rule("cuda", vec)


def _check_pool_rule(device, vec):
    """Run the cut-off and the filter on ``_skewed_rows`` and compare ``pooled_candidates`` with
    each slice's candidates computed in PyTorch."""
    pytest.importorskip("triton")
    from dsacache.ops.topk import launch
    from dsacache.ops.topk.filter import pool_layout

    k, width = 200, 4000
    logits = _skewed_rows(11, width).to(device)
    lens = torch.full((4,), width, dtype=torch.int32, device=device)
    cfg = launch.TopkConfig(block=64, cap=1024, samples=256, progs=8, bins=64, vec=vec, select="triton")
    plan = launch._plan(cfg, logits, k)
    cap, progs, tile = plan.cap, plan.progs, 32 * plan.vec
    seg = torch.full((4, cap, 2), -5, dtype=torch.int32, device=device)
    counts = torch.empty(4, progs, dtype=torch.int32, device=device)
    pool = launch.new_pool(4, cap, progs, plan.vec, device).fill_(-5)
    cut = torch.empty(4, dtype=torch.int32, device=device)
    shift = torch.empty_like(cut)
    hist = torch.empty(4, plan.bins, dtype=torch.int32, device=device)
    launch._launch_cutoff_and_filter(cfg, plan, logits, lens, lens, cut, shift, hist, seg, counts, pool,
                                     dict(width=width, HAS_STARTS=False), {"PDL": False},
                                     dict(K=k, SAMPLES=cfg.samples, PROGS=progs, BINS=plan.bins))
    assert (counts.max(dim=1).values > cap // progs).tolist() == [True, True, False, False]
    assert int(pool[1, pool_layout(cap, progs, tile)[2]]) >= 2, "the ascending row took one pool block at most"
    for r, lists in enumerate(pooled_candidates(seg, counts, pool, cap, progs, tile)):
        key = cut[r].item() & 0xFFFFFFFF
        bits = np.array([key ^ (0x80000000 if key >= 0x80000000 else 0xFFFFFFFF)], np.uint32)
        cut_f = float(bits.view(np.float32)[0])
        for p in range(progs):
            lo = p * -(-width // progs // tile) * tile
            x = logits[r, lo:lo + -(-width // progs // tile) * tile]
            pos = (x >= cut_f).nonzero().flatten().to(torch.int32) + lo
            raw = logits[r, pos.long()].view(torch.int32)
            keys = torch.where(raw < 0, ~raw, raw | torch.tensor(-2**31, dtype=torch.int32, device=device))
            assert lists[p] == torch.stack([keys, pos], 1).tolist(), f"row {r}, program {p}"


@pytest.mark.parametrize("start", [0, 37])
def test_skewed_rows_gathered_from_segments_and_pool(start):
    """Skewed rows (candidates piling up towards the end): each segment is copied and the
    candidates past it come from the pool; with row starts that are not tile aligned (slice 0
    begins before the row), the output equals the reference exactly."""
    pytest.importorskip("triton")
    from dsacache.ops.topk.launch import TopkConfig, launch_topk

    k, width = 200, 1500
    logits = _skewed_rows(3, width)
    logits[2, 600:700] += 5.0                                         # one hot slice in the middle
    starts = torch.full((4,), start, dtype=torch.int32, device=DEVICE)
    lens = torch.full((4,), width - start, dtype=torch.int32, device=DEVICE)
    config = TopkConfig(block=64, cap=1024, samples=256, progs=8, bins=64, vec=4, select="triton")
    out = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
    launch_topk(logits, lens, starts, out, config)
    assert torch.equal(out, topk_indices(logits, lens, k, row_starts=starts, impl="torch"))


def test_triton_select_takes_a_skewed_row_gathered_by_the_ballot_select():
    """After the Hopper ballot select, a row marked ``done == 2`` has its candidates in the dense
    buffers already (``select_gluon._select_skewed``): the Triton select selects from those and
    neither copies the segments nor filters the row again. Here the dense lists are written by
    PyTorch and the skewed rows' segments overwritten with junk, so only that path gives the
    reference; the other rows (done 0) still take their own paths."""
    pytest.importorskip("triton")
    from dsacache.ops.topk import launch
    from dsacache.ops.topk.select_triton import topk_select_kernel

    k, width = 200, 1500
    logits = _skewed_rows(5, width)
    lens = torch.tensor([width, width, width, 999], dtype=torch.int32, device=DEVICE)
    cfg = launch.TopkConfig(block=64, cap=1024, samples=256, progs=8, bins=64, vec=4, select="triton")
    plan = launch._plan(cfg, logits, k)
    cap, progs = plan.cap, plan.progs
    seg = torch.empty(4, cap, 2, dtype=torch.int32, device=DEVICE)
    counts = torch.empty(4, progs, dtype=torch.int32, device=DEVICE)
    buf_keys = torch.empty(4, cap + cfg.ties, dtype=torch.int32, device=DEVICE)
    buf_pos = torch.empty_like(buf_keys)
    cut = torch.empty(4, dtype=torch.int32, device=DEVICE)
    shift = torch.empty_like(cut)
    hist = torch.empty(4, plan.bins, dtype=torch.int32, device=DEVICE)
    common = dict(K=k, SAMPLES=cfg.samples, PROGS=progs, BINS=plan.bins)
    window = dict(width=width, HAS_STARTS=False)
    pool = launch.new_pool(4, cap, progs, plan.vec, DEVICE)
    launch._launch_cutoff_and_filter(cfg, plan, logits, lens, lens, cut, shift, hist, seg, counts, pool, window,
                                     {"PDL": False}, common)
    skewed = (counts.max(dim=1).values > cap // progs).tolist()
    assert skewed[:2] == [True, True] and skewed[2:] == [False, False]
    done = torch.tensor([2, 2, 0, 0], dtype=torch.int32, device=DEVICE)
    for row in (0, 1):
        key = cut[row].item() & 0xFFFFFFFF  # the cut-off key's float, as the filter tests it (keys.key_to_float)
        bits = np.array([key ^ (0x80000000 if key >= 0x80000000 else 0xFFFFFFFF)], np.uint32)
        cut_f = float(bits.view(np.float32)[0])
        x = logits[row, :width]
        pos = (x >= cut_f).nonzero().flatten().to(torch.int32)
        assert pos.numel() == counts[row].sum().item() <= cap
        bits = x[pos.long()].view(torch.int32)
        keys = torch.where(bits < 0, ~bits, bits | torch.tensor(-2**31, dtype=torch.int32))
        buf_keys[row, :pos.numel()] = keys
        buf_pos[row, :pos.numel()] = pos
        seg[row] = 12345  # junk: a path that copied the segments or the pool would fail
        pool[row] = 12345
    out = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
    topk_select_kernel[(4,)](logits, lens, lens, out, cut, shift, hist, seg.view(torch.int64), counts, buf_keys,
                             buf_pos, pool, width, **window, BLOCK=cfg.block, CAP=cap, BITS=launch.RADIX_BITS,
                             TIES=cfg.ties, LOAD=plan.load, TILE=32 * plan.vec, num_warps=4, done_ptr=done,
                             SKIP_DONE=True, PDL=False, **launch.pool_constants(pool, cap, progs, plan.vec), **common)
    assert torch.equal(out, topk_indices(logits, lens, k, impl="torch"))


def test_register_path_with_ties_and_the_open_last_bin():
    """In registers: a row whose candidates are heavily tied at the cut, and one whose k-th
    key lies far above the sampled maximum (the histogram's open last bin)."""
    pytest.importorskip("triton")
    k, width = 40, 600
    logits = torch.rand(2, width, device=DEVICE) * 1e6 + 100
    for g in range(4):
        logits[0, g * (width // 4):g * (width // 4) + 8] = torch.rand(8, device=DEVICE)
    logits[1] = 1.0
    logits[1, ::7] = 2.0
    lens = torch.full((2,), width, dtype=torch.int32, device=DEVICE)
    launch_small(logits, lens, k, dict(block=64, cap=1024, samples=32, progs=4, bins=64, vec=1))


def test_signed_zeros_and_nan_at_the_cut():
    """The filter tests candidates on the float: a cut-off at +0.0 is lowered to -0.0 (so -0.0, which
    ranks below +0.0, still counts) and a NaN cut-off is raised to -inf (NaN ranks last)."""
    pytest.importorskip("triton")
    k, width = 40, 600
    logits = torch.zeros(3, width, device=DEVICE)
    logits[0, 1::2] = -0.0
    logits[0, ::37] = 1.0                               # 17 positives, then +0.0 before -0.0
    logits[1] = -0.0
    logits[1, 5::41] = 0.0                              # +0.0 at 15 places among -0.0
    logits[2] = float("nan")
    logits[2, ::9] = torch.randn(67, device=DEVICE)     # a row mostly NaN
    lens = torch.full((3,), width, dtype=torch.int32, device=DEVICE)
    launch_small(logits, lens, k, dict(block=64, cap=512, samples=32, progs=4, bins=64, vec=2))


def test_small_buffers_with_row_starts_on_random_rows():
    pytest.importorskip("triton")
    from dsacache.ops.topk.launch import TopkConfig, launch_topk

    k, width = 24, 1000
    logits = torch.randn(4, width, device=DEVICE)
    logits[1] = torch.randint(-20, 20, (width,), device=DEVICE).float()
    lens = torch.tensor([1000, 999, 700, 333], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1, 299, 13], dtype=torch.int32, device=DEVICE)
    out = torch.full((4, k), -7, dtype=torch.int32, device=DEVICE)
    launch_topk(logits, lens, starts, out, TopkConfig(block=128, cap=256, samples=64, progs=2, bins=128, vec=2))
    assert torch.equal(out, topk_indices(logits, lens, k, row_starts=starts, impl="torch"))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_ranks_last_and_ties_go_low(impl):
    logits = torch.tensor([[float("nan"), 1.0, -float("inf"), 1.0, 1.0, 0.5]], device=DEVICE)
    lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    assert run_topk(impl, logits, lens, 2).tolist() == [[1, 3]]
    assert run_topk(impl, logits, lens, 5).tolist() == [[1, 2, 3, 4, 5]]
    assert run_topk(impl, logits, lens, 6).tolist() == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_lengths_and_starts_out_of_range_are_clamped(impl):
    """Lengths and starts may be int64 and outside the row: both paths clamp them alike
    (the kernels themselves, without extra launches)."""
    width, k = 300, 16
    logits = torch.randn(4, width, device=DEVICE)
    lens = torch.tensor([-3, width + 10, 5, 200], dtype=torch.int64, device=DEVICE)
    starts = torch.tensor([-2, 3, width + 1, 150], dtype=torch.int64, device=DEVICE)
    out = run_topk(impl, logits, lens, k, row_starts=starts)
    assert torch.equal(out, run_topk("torch", logits, lens.int(), k, row_starts=starts.int()))
    assert (out[0] == -1).all() and (out[2] == -1).all()
    assert torch.equal(out[1], torch.topk(logits[1, 3:], k).indices.sort().values.int())
    assert torch.equal(out[3], torch.topk(logits[3, 150:], k).indices.sort().values.int())


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


def topk_edge(case, device):
    """(logits, seq_lens, row_starts, k, expected output) of an edge case both paths must agree on."""
    i32 = dict(dtype=torch.int32, device=device)
    ramp = torch.arange(5.0, device=device)[None, :]
    if case == "zero-width logits":
        return torch.zeros(2, 0, device=device), torch.tensor([3, 0], **i32), None, 4, [[-1] * 4] * 2
    if case == "zero rows":
        return torch.zeros(0, 10, device=device), torch.zeros(0, **i32), None, 4, torch.zeros(0, 4)
    if case == "zero rows, zero width":
        return torch.zeros(0, 0, device=device), torch.zeros(0, **i32), None, 4, torch.zeros(0, 4)
    if case == "k larger than the width":
        return ramp, torch.tensor([5], **i32), None, 8, [[0, 1, 2, 3, 4, -1, -1, -1]]
    if case == "lengths past the width":
        return ramp.repeat(2, 1), torch.tensor([9, 2**31 - 1], **i32), None, 3, [[2, 3, 4], [2, 3, 4]]
    if case == "negative lengths":
        return ramp.repeat(2, 1), torch.tensor([-1, -(2**31)], **i32), None, 3, [[-1] * 3] * 2
    if case == "starts past the width, negative starts":
        return (ramp.repeat(3, 1), torch.tensor([5, 5, 2], **i32), torch.tensor([5, -4, 7], **i32), 2,
                [[-1, -1], [3, 4], [-1, -1]])
    raise AssertionError(case)


TOPK_EDGES = ["zero-width logits", "zero rows", "zero rows, zero width", "k larger than the width",
              "lengths past the width", "negative lengths", "starts past the width, negative starts"]


@pytest.mark.parametrize("case", TOPK_EDGES)
@pytest.mark.parametrize("impl", IMPLS)
def test_topk_edges_give_the_same_answer_on_both_paths(impl, case):
    logits, lens, starts, k, expected = topk_edge(case, DEVICE)
    out = run_topk(impl, logits, lens, k, row_starts=starts)
    assert out.shape == (logits.shape[0], k)
    assert out.tolist() == torch.as_tensor(expected).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("case", TOPK_EDGES)
def test_topk_edges_gpu(case):
    logits, lens, starts, k, expected = topk_edge(case, "cuda")
    for impl in ("triton", "torch"):
        assert run_topk(impl, logits, lens, k, row_starts=starts).tolist() == torch.as_tensor(expected).tolist()


def bad_topk_call(case):
    """(arguments of topk_indices with one wrong, the argument the refusal must name)."""
    logits = torch.zeros(2, 10, device=DEVICE)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    good = dict(logits=logits, seq_lens=lens, k=2)
    wrong = {
        "logits float16": ("logits", dict(logits=logits.half())),
        "logits float64": ("logits", dict(logits=logits.double())),
        "logits 1-D": ("logits", dict(logits=logits[0])),
        "logits a list": ("logits", dict(logits=logits.tolist())),
        "seq_lens float": ("seq_lens", dict(seq_lens=lens.float())),
        "seq_lens uint8": ("seq_lens", dict(seq_lens=lens.to(torch.uint8))),
        "seq_lens one short": ("seq_lens", dict(seq_lens=lens[:1])),
        "seq_lens [R, 1]": ("seq_lens", dict(seq_lens=lens[:, None])),
        "seq_lens a list": ("seq_lens", dict(seq_lens=[3, 4])),
        "row_starts a list": ("row_starts", dict(row_starts=[0, 0])),
        "row_starts int16": ("row_starts", dict(row_starts=lens.to(torch.int16))),
        "k 0": ("k=0", dict(k=0)),
        "k 4097": ("k=4097", dict(k=4097)),
        "k a float": ("k=2.0", dict(k=2.0)),
        "k a string": ("k='2'", dict(k="2")),
        "k a bool": ("k=True", dict(k=True)),
        "k a tensor": ("k=tensor", dict(k=torch.tensor(2))),
        "out int64": ("out", dict(out=torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))),
        "out too small": ("out", dict(out=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))),
        "out not contiguous": ("out", dict(out=torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)[:, ::2])),
        "out a list": ("out", dict(out=[[0, 0], [0, 0]])),
    }[case]
    return {**good, **wrong[1]}, wrong[0]


TOPK_REFUSALS = ["logits float16", "logits float64", "logits 1-D", "logits a list", "seq_lens float",
                 "seq_lens uint8", "seq_lens one short", "seq_lens [R, 1]", "seq_lens a list", "row_starts a list",
                 "row_starts int16", "k 0", "k 4097", "k a float", "k a string", "k a bool", "k a tensor",
                 "out int64", "out too small", "out not contiguous", "out a list"]


@pytest.mark.parametrize("case", TOPK_REFUSALS)
@pytest.mark.parametrize("impl", IMPLS)
def test_topk_refuses_the_same_on_both_paths(impl, case):
    """A ValueError naming the argument, before anything is written (a given ``out`` keeps its bytes)."""
    kwargs, name = bad_topk_call(case)
    sentinel = None
    if "out" not in kwargs:
        kwargs["out"] = sentinel = torch.full((2, 2), -7, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape(name)):
        topk_indices(**kwargs, impl=impl)
    assert sentinel is None or (sentinel == -7).all()


def test_topk_refuses_an_unknown_impl_or_launch_setting():
    pytest.importorskip("triton")
    from dsacache.ops.topk.launch import TopkConfig

    with pytest.raises(ValueError, match="impl='cuda'"):
        topk_indices(torch.zeros(1, 4), torch.tensor([4], dtype=torch.int32), 2, impl="cuda")
    with pytest.raises(ValueError, match="select='fast'"):
        TopkConfig(select="fast")
    with pytest.raises(ValueError, match="ahead=3"):
        TopkConfig(ahead=3)
    with pytest.raises(ValueError, match="row_bins=1000; allowed: a power of two"):
        TopkConfig(row_bins=1000)
    with pytest.raises(ValueError, match="bins=16; allowed"):
        TopkConfig(bins=16)
    for cap in (64, 3000, 32768):
        with pytest.raises(ValueError, match=f"cap={cap}; allowed: a power of two from 128 to 16384"):
            TopkConfig(cap=cap)
    with pytest.raises(ValueError, match="short_warps=12; allowed"):
        TopkConfig(short_warps=12)


def test_hopper_kernel_choice_by_width_alignment_and_settings(monkeypatch):
    """Where a Gluon kernel may run (Hopper, compiled CUDA; forced here so the rule is checked on
    any machine): the row kernel for aligned logits up to ``row_max_len`` wide, without row
    starts or with them (prefill windows); the Triton filter then the ballot select for wider
    or unaligned logits; the Triton kernels alone when the settings do not tile the Gluon layouts or
    ``select="triton"``."""
    pytest.importorskip("triton")
    from dsacache.ops.topk import launch
    from dsacache.ops.topk.launch import TopkConfig, select_kernel

    monkeypatch.setattr(launch, "_gluon_allowed", lambda cfg, logits: cfg.select != "triton")
    k = 2048
    assert select_kernel(torch.zeros(4, 32768), k) == "row"
    assert select_kernel(torch.zeros(4, 4096), k) == "short"                  # up to short_max_len
    assert select_kernel(torch.zeros(4, 4097)[:, 1:], k) == "short"           # any alignment
    assert select_kernel(torch.zeros(4, 4096), k, TopkConfig(short_max_len=0)) == "row"
    assert select_kernel(torch.zeros(4, 4100), k) == "row"
    assert select_kernel(torch.zeros(4, 8192), k) == "row"
    assert select_kernel(torch.zeros(4, 8192), k, TopkConfig(short_max_len=8192)) == "short"
    short_8 = TopkConfig(short_max_len=8192, short_warps=8)                     # 16 logits a thread at most
    assert (select_kernel(torch.zeros(4, 8192), k, short_8), select_kernel(torch.zeros(4, 4096), k, short_8)) == \
        ("row", "short")
    assert select_kernel(torch.zeros(4, 32772), k) == "gluon"                  # wider than row_max_len
    assert select_kernel(torch.zeros(4, 32768), k, TopkConfig(row_max_len=16384)) == "gluon"
    assert select_kernel(torch.zeros(4, 32769)[:, :32767], k) == "gluon"      # rows not 16-byte aligned
    assert select_kernel(torch.zeros(4, 32768), k, TopkConfig(row_warps=128)) == "gluon"  # bins / 32 warps
    assert select_kernel(torch.zeros(4, 131072), k, TopkConfig(gluon_select_warps=128)) == "triton"
    assert select_kernel(torch.zeros(4, 32768), k, TopkConfig(select="triton")) == "triton"


def test_row_kernel_bins_by_rows_an_sm(monkeypatch):
    """The row kernel takes 1024 histogram bins once its programs share SMs (more rows than SMs),
    ``bins`` otherwise or when ``row_bins`` is set; the wider path always takes ``bins``."""
    pytest.importorskip("triton")
    from dsacache.ops.topk import launch
    from dsacache.ops.topk.launch import TopkConfig

    monkeypatch.setattr(launch, "_gluon_allowed", lambda cfg, logits: cfg.select != "triton")
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    k = 2048

    def plan(rows, width, **settings):
        return launch._plan(TopkConfig(**settings), torch.zeros(rows, width), k)

    assert (plan(132, 32768).first, plan(132, 32768).bins) == ("row", 2048)
    assert (plan(133, 32768).first, plan(133, 32768).bins) == ("row", 1024)
    assert plan(256, 16384, row_bins=2048).bins == 2048
    assert plan(64, 16384, row_bins=1024).bins == 1024
    assert (plan(256, 4096).first, plan(256, 4096).bins) == ("short", 2048)
    assert (plan(256, 65536).first, plan(256, 65536).bins) == ("gluon", 2048)
    assert plan(256, 32768, bins=4096).bins == 1024


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


def slots_edge(case, device):
    """(positions, block_table, next_n, num_pages, expected slots) of an edge case."""
    i32 = dict(dtype=torch.int32, device=device)
    positions = torch.tensor([[0, 64, 130, -1], [63, 2**31 - 1, -(2**31), 127]], **i32)
    table = torch.tensor([[1, 2]], **i32)
    if case == "zero rows":
        return torch.zeros(0, 4, **i32), torch.zeros(0, 2, **i32), 1, None, torch.zeros(0, 4)
    if case == "zero columns":
        return torch.zeros(2, 0, **i32), table, 2, None, torch.zeros(2, 0)
    if case == "zero-width table":
        return positions, torch.zeros(1, 0, **i32), 2, None, [[-1] * 4] * 2
    if case == "no pages":
        return positions, table, 2, 0, [[-1] * 4] * 2
    if case == "extreme positions":
        return positions, table, 2, None, [[64, 128, -1, -1], [127, -1, -1, 191]]
    if case == "entries past the int32 slots":
        return positions, torch.tensor([[2**25, 2**25 - 1]], **i32), 2, None, \
            [[-1, 2**31 - 64, -1, -1], [-1, -1, -1, 2**31 - 1]]
    raise AssertionError(case)


SLOTS_EDGES = ["zero rows", "zero columns", "zero-width table", "no pages", "extreme positions",
               "entries past the int32 slots"]


@pytest.mark.parametrize("case", SLOTS_EDGES)
@pytest.mark.parametrize("impl", IMPLS)
def test_positions_to_slots_edges_give_the_same_answer_on_both_paths(impl, case):
    positions, table, next_n, num_pages, expected = slots_edge(case, DEVICE)
    out = positions_to_slots(positions, table, next_n=next_n, num_pages=num_pages, impl=impl)
    assert out.dtype == torch.int32 and out.shape == positions.shape
    assert out.tolist() == torch.as_tensor(expected).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("case", SLOTS_EDGES)
def test_positions_to_slots_edges_gpu(case):
    positions, table, next_n, num_pages, expected = slots_edge(case, "cuda")
    for impl in ("triton", "torch"):
        out = positions_to_slots(positions, table, next_n=next_n, num_pages=num_pages, impl=impl)
        assert out.tolist() == torch.as_tensor(expected).tolist()


SLOTS_REFUSALS = {
    "positions int64": ("positions", dict(positions=torch.zeros(2, 3, dtype=torch.int64))),
    "positions 1-D": ("positions", dict(positions=torch.zeros(6, dtype=torch.int32))),
    "positions a list": ("positions", dict(positions=[[0, 1, 2]] * 2)),
    "block_table int64": ("block_table", dict(block_table=torch.zeros(1, 2, dtype=torch.int64))),
    "block_table a list": ("block_table", dict(block_table=[[1, 2]])),
    "block_table rows": ("block_table", dict(block_table=torch.zeros(2, 2, dtype=torch.int32))),
    "next_n 0": ("next_n=0", dict(next_n=0)),
    "next_n a float": ("next_n=2.0", dict(next_n=2.0)),
    "next_n a bool": ("next_n=True", dict(next_n=True)),
    "next_n not dividing": ("next_n=3", dict(next_n=3)),
    "num_pages negative": ("num_pages=-1", dict(num_pages=-1)),
    "num_pages a float": ("num_pages=2.5", dict(num_pages=2.5)),
    "num_pages past int32 slots": ("num_pages=33554433", dict(num_pages=2**25 + 1)),
}


@pytest.mark.parametrize("case", list(SLOTS_REFUSALS))
@pytest.mark.parametrize("impl", IMPLS)
def test_positions_to_slots_refuses_the_same_on_both_paths(impl, case):
    name, wrong = SLOTS_REFUSALS[case]
    good = dict(positions=torch.zeros(2, 3, dtype=torch.int32), block_table=torch.zeros(1, 2, dtype=torch.int32),
                next_n=2)
    kwargs = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
              for key, value in {**good, **wrong}.items()}
    with pytest.raises(ValueError, match=re.escape(name)):
        positions_to_slots(**kwargs, impl=impl)


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


@pytest.mark.gpu
@pytest.mark.parametrize("width", [20_000, 65_536])
def test_topk_gpu_long_windows_with_row_starts(width):
    """Prefill-style windows (row starts, lengths up to the row's end) of long rows on the GPU
    path equal the reference: starts that cut into a filter tile, windows shorter and longer
    than the sampled path's threshold, ties and a sorted row."""
    k = 2048
    logits = torch.randn(6, width, device="cuda")
    logits[1] = torch.randint(0, 3, (width,), device="cuda").float()
    logits[2] = logits[2].sort().values
    starts = torch.tensor([0, 1, 257, 1000, width - 5000, 3], dtype=torch.int32, device="cuda")
    lens = torch.tensor([width, width - 1, width - 300, 4000, 5000, width - 3], dtype=torch.int32, device="cuda")
    ref = run_topk("torch", logits, lens, k, row_starts=starts)
    out = run_topk("triton", logits, lens, k, row_starts=starts)
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(6, 8_192), (40, 20_000), (130, 32_768)])
def test_row_kernel_on_prefill_windows(rows, width):
    """The Hopper row kernel on rows with row starts (prefill windows: start = the query's
    first visible column, some cutting into a filter tile, some shorter than the sampled
    path's threshold) equals the reference: the rows its sampled steps take and the short one
    it selects by radix passes over the window."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon row kernel runs on Hopper and newer")
    k = 2048
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, width, device="cuda", generator=gen)
    logits[:, ::97] = logits[:, ::97].round()  # exact ties near every cut-off
    starts = torch.randint(0, width // 4, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    starts[:3] = torch.tensor([0, 1, 255], dtype=torch.int32)
    lens = (width - starts).to(torch.int32)
    lens[3] = 5000  # a window shorter than the row, ending mid-row
    lens[4] = 3000  # short: not sampled, radix passes over the window
    assert select_kernel(logits, k, TopkConfig(short_max_len=0)) == "row"
    ref = run_topk("torch", logits, lens, k, row_starts=starts)
    out = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    launch_topk(logits, lens, starts, out, TopkConfig(select="gluon-only", short_max_len=0))
    assert torch.equal(out, ref)


def _skewed_gpu_rows(rows: int, width: int, hot: int, gen: torch.Generator) -> torch.Tensor:
    """N(0, 1) rows on the GPU, the first seven skewed: ascending, descending, a steep ramp, a ramp
    down, one hot stretch of ``hot`` logits, a ramp with exact ties, distinct and sorted."""
    logits = torch.randn(rows, width, device="cuda", generator=gen)
    logits[0] = logits[0].sort().values
    logits[1] = logits[1].sort(descending=True).values
    logits[2] += torch.linspace(0, 6, width, device="cuda")
    logits[3] += torch.linspace(3, 0, width, device="cuda")
    logits[4, width // 3:width // 3 + hot] += 4.0
    logits[5] = (logits[5] + torch.linspace(0, 6, width, device="cuda")).mul(8).round()
    logits[6] = torch.arange(width, device="cuda").float()
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("width, with_starts", [(8_192, False), (20_000, True), (32_768, False), (32_768, True)])
@pytest.mark.parametrize("row_bins", [None, 1024])
def test_row_kernel_keeps_skewed_rows(width, with_starts, row_bins):
    """Rows whose largest logits bunch in a few warps' slices (sorted either way, ramps, one hot
    slice, a ramp with exact ties at the cut-off) give those warps more candidates than the ballot
    select loads a segment (at 32K more than a segment holds), so only the rescan
    (``_rescan_select``) or the radix passes over the row can take them: every row equals the
    reference, on repeated launches. The last row is skewed with heavy ties: its second half holds
    7 values, so the rescan cuts a chosen bin of hundreds to thousands of equal candidates. With
    1024 bins (``row_bins``, the default past one row an SM) each chosen bin holds more."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon row kernel runs on Hopper and newer")
    k = 2048
    gen = torch.Generator(device="cuda").manual_seed(width)
    logits = _skewed_gpu_rows(9, width, 2500, gen)
    logits[8, width // 2:] = torch.randint(20, 27, (width - width // 2,), device="cuda", generator=gen).float()
    if with_starts:
        starts = torch.randint(0, width // 8, (9,), device="cuda", generator=gen, dtype=torch.int32)
        starts[0] = 3
        lens = (width - starts).to(torch.int32)
        lens[7] = width // 2  # a random window ending mid-row
    else:
        starts = None
        lens = torch.full((9,), width, dtype=torch.int32, device="cuda")
    assert select_kernel(logits, k, TopkConfig(short_max_len=0)) == "row"
    ref = run_topk("torch", logits, lens, k, row_starts=starts)
    for _ in range(2):
        out = torch.full((9, k), -7, dtype=torch.int32, device="cuda")
        launch_topk(logits, lens, starts, out, TopkConfig(row_bins=row_bins, short_max_len=0))
        assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, with_starts", [(9, 40_000, True), (64, 131_072, False), (256, 65_536, True)])
def test_ballot_select_takes_skewed_rows(rows, width, with_starts):
    """Wider logits (the Triton filter, then the Gluon ballot select): rows whose candidates bunch
    in a few filter slices, more than a segment holds (sorted either way, ramps, one hot stretch,
    a ramp with exact ties). The ballot select gathers them densely (the stored segments copied,
    the overflowed slices filtered again) and selects them itself (``_select_skewed``); a skewed
    row whose chosen bin holds more than TIES (row 8: 7 values over its last eighth) is left
    gathered to the Triton select (``done == 2``). Every row equals the reference, on
    repeated launches; with ``gluon-only`` the skewed rows without heavy ties are written by the
    ballot select alone."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon ballot select runs on Hopper and newer")
    k = 2048
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = _skewed_gpu_rows(rows, width, 3000, gen)
    logits[8, -(width // 8):] = torch.randint(20, 27, (width // 8,), device="cuda", generator=gen).float()
    lens = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    starts = None
    if with_starts:
        starts = torch.randint(0, width // 8, (rows,), device="cuda", generator=gen, dtype=torch.int32)
        starts[0] = 3
        lens = (width - starts).to(torch.int32)
        lens[7] = width // 2  # a random window ending mid-row
    assert select_kernel(logits, k) == "gluon"
    ref = run_topk("torch", logits, lens, k, row_starts=starts)
    only = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    launch_topk(logits, lens, starts, only, TopkConfig(select="gluon-only"))
    taken = (only != -7).all(dim=1)
    alone = [0, 1, 2, 3, 4, 6, 7]  # skewed without many ties at the cut, and a random window
    assert taken[alone].all(), f"the ballot select left rows {(~taken).nonzero().flatten().tolist()}"
    assert not taken[8], "a chosen bin of hundreds of ties, taken by the ballot select"
    assert torch.equal(only[taken], ref[taken])
    assert ((only == -7).all(dim=1) | taken).all(), "a row partly written by the ballot select"
    for _ in range(2):
        out = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
        launch_topk(logits, lens, starts, out)
        assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("width, first", [(5_000, "short"), (8_192, "short"), (8_192, "row"), (32_768, "row"),
                                          (40_000, "gluon")])
def test_gluon_kernels_select_the_rows_the_common_path_cannot(width, first):
    """Rows off the Gluon kernels' common path. The short-row kernel takes every row whole (and must
    equal the reference on all of them). The row kernel (nothing after it, ``gluon-only``)
    takes them all: heavy ties (a chosen bin far past TIES, cut by radix passes over its
    candidates, or over the rescan's scratch when the row is skewed too), and the rows its sampled
    steps cannot take, selected by radix passes over the row (``_select_whole_row``): empty, one
    logit, lengths around k and around the sampled path's
    threshold (2 x 2048 samples), a few values each tied thousands of times, and cut-offs the
    samples miss both ways (samples far above the rest: fewer than k candidates; far below: more
    than the buffer holds). Each row equals the reference, on repeated launches."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon kernels run on Hopper and newer")
    k, runs, run = 2048, 2048 // 8, 8
    gen = torch.Generator(device="cuda").manual_seed(width)
    logits = torch.randn(13, width, device="cuda", generator=gen)
    lens = torch.tensor([0, 1, k - 1, k, k + 1, 4096, 4097, width, width, width, width, 63, width],
                        dtype=torch.int32, device="cuda")
    logits[7] = torch.randint(0, 5, (width,), device="cuda", generator=gen).float()    # thousands of ties
    sampled = ((torch.arange(2048) // run) * (width // runs) + torch.arange(2048) % run).cuda()
    logits[8, sampled] += 20.0 + torch.rand(2048, device="cuda", generator=gen)  # a cut-off above all but samples
    logits[9, sampled] -= 20.0                                                    # a cut-off below every logit
    logits[10, ::3] = 1.0                                                         # a third of the row tied
    logits[12] = torch.randint(0, 50, (width,), device="cuda", generator=gen).float()  # a chosen bin past TIES
    short = {"short_max_len": 8192 if first == "short" else 0}
    assert select_kernel(logits, k, TopkConfig(**short)) == first
    ref = run_topk("torch", logits, lens, k)
    check_valid(ref, lens, k)
    only = torch.full((13, k), -7, dtype=torch.int32, device="cuda")
    launch_topk(logits, lens, None, only, TopkConfig(select="gluon-only", **short))
    taken = (only != -7).all(dim=1)
    assert first == "gluon" or taken.all(), f"the {first} kernel left rows {(~taken).nonzero().flatten().tolist()}"
    assert torch.equal(only[taken], ref[taken])
    for _ in range(2):
        out = torch.full((13, k), -7, dtype=torch.int32, device="cuda")
        launch_topk(logits, lens, None, out, TopkConfig(**short))
        assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length, pdl, first", [(3, 20_000, True, "row"), (64, 131_072, True, "gluon"),
                                                      (256, 32_768, True, "row"), (64, 32_768, False, "row"),
                                                      (5, 8_192, True, "row"), (7, 40_000, False, "gluon"),
                                                      (160, 131_072, True, "gluon"), (512, 32_768, True, "row"),
                                                      (5, 4_096, True, "short"), (256, 4_096, True, "short"),
                                                      (9, 3_000, False, "short")])
def test_gluon_kernels_match_reference(rows, length, pdl, first):
    """The Hopper kernels (the row kernel: cut-off, filter and ballot select in one launch, up
    to ``row_max_len``; the ballot select after the Triton filter for wider logits) on the rows
    they take (random rows, ties inside the chosen bin) write the reference's output element
    for element. The rows the sampled steps cannot take (heavy ties, a sorted row, short rows)
    are finished by the row kernel itself, or by the Triton select after the ballot select.
    The last two shapes are logits larger than L2, whose filter loads are marked evict-first."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon row kernel runs on Hopper and newer")
    k = 2048
    logits = torch.randn(rows, length, device="cuda")
    logits[:, ::97] = logits[:, ::97].round()  # exact ties near every cut-off
    lens = torch.full((rows,), length, dtype=torch.int32, device="cuda")
    ref = run_topk("torch", logits, lens, k)
    only = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    launch_topk(logits, lens, None, only, TopkConfig(select="gluon-only", pdl=pdl))
    taken = (only != -7).all(dim=1)
    assert taken.float().mean() > 0.9, "the Gluon kernel left most random rows"
    assert torch.equal(only[taken], ref[taken])
    assert ((only == -7).all(dim=1) | taken).all(), "a row partly written by the Gluon kernel"
    assert first == "gluon" or taken.all(), f"the {first} kernel left a row"

    logits[0] = torch.randint(0, 3, (length,), device="cuda").float()
    logits[1] = logits[1].sort().values
    lens[2] = 5000
    ref = run_topk("torch", logits, lens, k)
    for select in ("gluon",) if first == "gluon" else ("gluon", "gluon-only"):
        for _ in range(3):
            out = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
            launch_topk(logits, lens, None, out, TopkConfig(pdl=pdl, select=select))
            assert torch.equal(out, ref)
    assert select_kernel(logits, k) == first
    if first == "row":  # rows not 16-byte aligned: the Triton filter, then the ballot select
        assert select_kernel(logits[:, 1:], k) == "gluon"
    if first == "short":  # any alignment
        assert select_kernel(logits[:, 1:], k) == "short"


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 63, 64, 65, 2047, 2048, 2049, 5000, 8192])
@pytest.mark.parametrize("k", [2048, 64])
def test_short_row_kernel_edge_cases(width, k):
    """The short-row kernel (the whole row in registers, radix passes) against the reference on
    widths around a kernel page and around k, every length from 0 up, row starts, unaligned rows,
    rows of one repeated value, integer ties, sorted rows, and NaN / +-inf / +-0.0; twice each."""
    from dsacache.ops.topk.launch import TopkConfig, launch_topk, select_kernel

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon short-row kernel runs on Hopper and newer")
    gen = torch.Generator(device="cuda").manual_seed(width * 7 + k)
    base = torch.randn(12, width + 1, device="cuda", generator=gen)
    base[1] = 0.25                                                                        # one value
    base[2] = torch.randint(0, 4, (width + 1,), device="cuda", generator=gen).float()     # heavy ties
    base[3] = base[3].sort().values                                                       # ascending
    base[4] = base[4].sort(descending=True).values
    base[5, ::3] = float("nan")
    base[5, 1::5] = float("-inf")
    base[5, 2::7] = float("inf")
    base[6, ::2] = 0.0
    base[6, 1::2] = -0.0
    base[7] = (base[7] * 4).round()
    lengths = [width, 0, 1, min(width, 63), min(width, 64), min(width, 65), width, width, width, width, width,
               max(width - 1, 0)]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cfg = TopkConfig(select="gluon-only", short_max_len=8192)  # the widest it takes; 4K by default
    for logits in (base[:, :width], base[:, 1:]):                                         # aligned, then not
        assert select_kernel(logits, k, cfg) == "short"
        starts = torch.randint(0, max(width // 3, 1), (12,), device="cuda", generator=gen, dtype=torch.int32)
        starts[0] = 0
        for row_starts in (None, starts):
            ref = run_topk("torch", logits, lens, k, row_starts=row_starts)
            for _ in range(2):
                out = torch.full((12, k), -7, dtype=torch.int32, device="cuda")
                launch_topk(logits, lens, row_starts, out, cfg)
                assert torch.equal(out, ref)


@pytest.mark.parametrize("warps, vec, bins", [(16, 8, 2048), (16, 8, 1024), (8, 4, 2048)])
def test_gluon_kernels_compile_for_hopper_without_spills(warps, vec, bins):
    """The Hopper row kernel, the Gluon ballot select and the short-row kernel build for sm_90 on any machine (ptxas
    ships with Triton): their layouts tile the default shapes, the row kernel's filter loads are
    16-byte vectors, its histogram counts are shared-memory atomics at the offset the compiler gave the
    buffer, and nothing spills at the default register cap but, in the 16-warp row kernel, a few values
    live across its steps (at most 64 bytes; none in its loops, read from the SASS). In a fresh
    interpreter: this process runs Triton in interpreter mode, where kernels cannot be compiled."""
    pytest.importorskip("triton.experimental.gluon")
    script = PTXAS_USAGE + f"""
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsacache.ops.topk.filter import filter_tile_ptx, filter_tile_regs
from dsacache.ops.topk.launch import TopkConfig
from dsacache.ops.topk.row_gluon import topk_row_kernel as kernel
from dsacache.ops.topk.select_gluon import topk_select_ballot_kernel as select
from dsacache.ops.triton_utils import shared_buffer_offset

W, V, BINS = {warps}, {vec}, {bins}
pointers = ["logits_ptr", "lens_ptr", "starts_ptr", "out_ptr", "cut_ptr", "shift_ptr", "seg_ptr", "counts_ptr",
            "tie_keys_ptr", "tie_pos_ptr"]
signature = {{name: "*i32" for name in pointers}}
signature.update(logits_ptr="*fp32", seg_ptr="*i64", row_stride="i32", width="i32", stride_tie="i32", hist_smem="i32")
constants = dict(K=2048, SAMPLES=2048, SAMPLE_RUN=8, SAMPLE_BITS=TopkConfig().sample_bits, SEG=8192 // W, LOAD=256,
                 CAP=8192, BINS=BINS, TIES=32, V=V, TILE_PTX=filter_tile_ptx(V, "shared"),
                 TILE_REGS=filter_tile_regs(V, "shared"), AHEAD=1, HAS_STARTS=True, PDL=True)
signature.update({{name: "constexpr" for name in constants}})
attrs = {{(0,): [["tt.divisibility", 16]]}}
compiled = triton.compile(GluonASTSource(kernel, signature, constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={{"num_warps": W, "maxnreg": TopkConfig().row_maxnreg}})
ptx = compiled.asm["ptx"]
regs, spilled, _ = usage(compiled)
print(f"row kernel W={{W}} V={{V}} BINS={{BINS}}: {{regs}} registers, spilled={{spilled}}")
assert "vote.sync.ballot.b32" in ptx and "ld.global.v4" in ptx and "red.shared.add.u32" in ptx
assert "red.global" not in ptx and spilled <= (64 if W == 16 else 0)
assert shared_buffer_offset(compiled, "hist_buf") % 4 == 0

# The ballot select alone (after the Triton filter, for wider logits), at its default shape.
from dsacache.ops.topk.filter import pool_layout, topk_filter_kernel
pool, _, _, pool_row = pool_layout(8192, 64, 32 * V)
pointers = ["lens_ptr", "starts_ptr", "out_ptr", "cut_ptr", "shift_ptr", "hist_ptr", "seg_ptr",
            "counts_ptr", "tie_keys_ptr", "tie_pos_ptr", "pool_ptr", "done_ptr"]
signature = {{name: "*i64" if name == "seg_ptr" else "*i32" for name in pointers}}
signature.update(width="i32", stride_tie="i32", hist_smem="i32")
constants = dict(K=2048, SAMPLES=2048, PROGS=64, SEG=128, LOAD=128, CAP=8192, BINS=2048, TIES=32,
                 HAS_STARTS=False, PDL=True, TILE=32 * V, POOL=pool, POOL_ROW=pool_row)
signature.update({{name: "constexpr" for name in constants}})
compiled = triton.compile(GluonASTSource(select, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={{"num_warps": 8}})
regs, spilled, _ = usage(compiled)
assert "vote.sync.ballot.b32" in compiled.asm["ptx"] and "red.shared.add.u32" in compiled.asm["ptx"] and spilled == 0
shared_buffer_offset(compiled, "hist_buf")

# The Triton filter before it: the tile-step PTX with the pool (ptxas checks it).
pointers = ["logits_ptr", "lens_ptr", "starts_ptr", "cut_ptr", "shift_ptr", "hist_ptr", "seg_ptr", "counts_ptr",
            "pool_ptr"]
signature = {{name: "*fp32" if name == "logits_ptr" else "*i32" for name in pointers}}
signature.update(row_stride="i32", width="i32")
constants = dict(K=2048, SAMPLES=2048, PROGS=64, SEG_CAP=128, BINS=2048, V=V, ALIGNED=True, USE_ASM=True, PDL=True,
                 HAS_STARTS=False, TILE_ASM=True, TILE_PTX=filter_tile_ptx(V, "none", pool),
                 TILE_REGS=filter_tile_regs(V, "none", pool), AHEAD=1, EVICT="", COUNT=False, POOL=pool,
                 POOL_ROW=pool_row)
signature.update({{name: "constexpr" for name in constants}})
compiled = triton.compile(triton.compiler.ASTSource(topk_filter_kernel, signature, constants),
                          target=GPUTarget("cuda", 90, 32), options={{"num_warps": 1}})
assert "atom.global.add.u32" in compiled.asm["ptx"] and compiled.asm["cubin"]

# The cut-off kernel before it, which zeroes the pool's cursor.
from dsacache.ops.topk.cutoff import topk_cutoff_kernel
signature = dict(logits_ptr="*fp32", lens_ptr="*i32", starts_ptr="*i32", cut_ptr="*i32", shift_ptr="*i32",
                 hist_ptr="*i32", pool_ptr="*i32", row_stride="i32", width="i32")
constants = dict(K=2048, SAMPLES=2048, SAMPLE_RUN=8, BINS=2048, HAS_STARTS=True, SAMPLE_BITS=8, PDL=True,
                 ZERO_HIST=False, POOL=pool, POOL_ROW=pool_row, TILE=32 * V)
signature.update({{name: "constexpr" for name in constants}})
compiled = triton.compile(triton.compiler.ASTSource(topk_cutoff_kernel, signature, constants),
                          target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
assert compiled.asm["cubin"]

# The Triton select after both, which gathers a skewed row from the segments and the pool.
from dsacache.ops.topk.select_triton import topk_select_kernel
pointers = ["logits_ptr", "lens_ptr", "starts_ptr", "out_ptr", "cut_ptr", "shift_ptr", "hist_ptr", "seg_ptr",
            "counts_ptr", "buf_keys_ptr", "buf_pos_ptr", "pool_ptr", "done_ptr"]
signature = {{name: "*fp32" if name == "logits_ptr" else "*i64" if name == "seg_ptr" else "*i32"
             for name in pointers}}
signature.update(row_stride="i32", width="i32")
constants = dict(K=2048, BLOCK=2048, CAP=8192, SAMPLES=2048, PROGS=64, BINS=2048, BITS=8, TIES=32, PDL=True,
                 HAS_STARTS=False, LOAD=128, SKIP_DONE=True, TILE=32 * V, POOL=pool, POOL_ROW=pool_row)
signature.update({{name: "constexpr" for name in constants}})
compiled = triton.compile(triton.compiler.ASTSource(topk_select_kernel, signature, constants),
                          target=GPUTarget("cuda", 90, 32), options={{"num_warps": 16}})
assert compiled.asm["cubin"]

# The short-row kernel at the widest rows it takes (16 logits a thread), at its register cap.
from dsacache.ops.topk.short_gluon import topk_short_row_kernel as short
signature = dict(logits_ptr="*fp32", lens_ptr="*i32", starts_ptr="*i32", out_ptr="*i32", row_stride="i32", width="i32")
constants = dict(K=2048, COLS=16 * 32 * TopkConfig().short_warps, BITS=TopkConfig().sample_bits, HAS_STARTS=True,
                 PDL=True)
signature.update({{name: "constexpr" for name in constants}})
compiled = triton.compile(GluonASTSource(short, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={{"num_warps": TopkConfig().short_warps, "maxnreg": TopkConfig().short_maxnreg}})
regs, spilled, _ = usage(compiled)
assert spilled == 0, ("short-row kernel", regs, spilled)
print("built")
"""
    assert "built" in run_compiled_script(script)
