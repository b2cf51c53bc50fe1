"""Indexer step metadata: decode context lengths, prefill chunks, the step builder."""

import random

import pytest
import torch

from dsacache.runtime import (
    DcpSettings,
    RowAllocator,
    build_indexer_metadata,
    compute_slot_mapping,
    decode_context_lens,
    plan_prefill_chunks,
)
from tests.helpers import triton_available

# The Triton case runs on CPU tensors (the interpreter); on a CUDA machine the gpu tests cover it.
IMPLS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.interpret)] if triton_available() else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_decode_context_lens(impl, next_n):
    seq_lens = torch.randint(next_n, 5000, (37,), dtype=torch.int32)
    out = torch.full((37, next_n), -99, dtype=torch.int32)
    decode_context_lens(seq_lens, next_n, out, impl=impl)
    for b in range(37):
        assert out[b].tolist() == [int(seq_lens[b]) - next_n + i + 1 for i in range(next_n)]


def test_decode_context_lens_rejects_a_bad_buffer():
    with pytest.raises(ValueError, match="out must be"):
        decode_context_lens(torch.ones(3, dtype=torch.int32), 2, torch.empty(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="next_n"):
        decode_context_lens(torch.ones(3, dtype=torch.int32), 0)


def check_chunks(chunks, query_lens, seq_lens, workspace, budget, first_token=0, first_req=0):
    """Every query token in exactly one chunk, in order, with the right key window, under both budgets."""
    starts = [first_token]
    for q in query_lens:
        starts.append(starts[-1] + q)
    covered = []
    for chunk in chunks:
        assert chunk.num_keys <= workspace and chunk.logits_bytes <= budget
        assert chunk.ks.numel() == chunk.ke.numel() == chunk.num_queries
        cu = chunk.cu_seqlens_k.tolist()
        row = 0
        for t in range(chunk.query_start, chunk.query_end):
            b = max(i for i in range(len(query_lens)) if starts[i] <= t and query_lens[i])
            local = b - (chunk.req_start - first_req)
            position = seq_lens[b] - query_lens[b] + (t - starts[b])
            assert int(chunk.ks[row]) == cu[local]
            assert int(chunk.ke[row]) - int(chunk.ks[row]) == position + 1  # keys [0, position]
            assert int(chunk.seq_lens_k[local]) >= position + 1
            covered.append(t)
            row += 1
    assert covered == list(range(first_token, starts[-1]))


def test_prefill_chunks_fit_both_budgets_on_random_batches():
    rng = random.Random()
    for _ in range(30):
        n = rng.randint(1, 6)
        query_lens = [rng.randint(1, 400) for _ in range(n)]
        seq_lens = [q + rng.choice([0, rng.randint(0, 600)]) for q in query_lens]
        workspace = max(seq_lens) + rng.randint(0, 800)
        budget = 4 * workspace * rng.randint(1, 50)
        chunks = plan_prefill_chunks(query_lens, seq_lens, workspace_tokens=workspace, logits_bytes=budget)
        check_chunks(chunks, query_lens, seq_lens, workspace, budget)


def test_a_long_prefill_is_split_by_the_logits_budget():
    # 1000 query tokens on 1000 keys: 4 MB of logits in one piece; a 1 MB budget splits it.
    chunks = plan_prefill_chunks([1000], [1000], workspace_tokens=1000, logits_bytes=1 << 20)
    assert len(chunks) > 1
    check_chunks(chunks, [1000], [1000], 1000, 1 << 20)


def test_small_requests_share_a_chunk():
    chunks = plan_prefill_chunks([10, 20, 30], [10, 25, 100], workspace_tokens=4096, logits_bytes=1 << 30)
    assert len(chunks) == 1 and chunks[0].seq_lens_k.tolist() == [10, 25, 100]
    assert chunks[0].cu_seqlens_k.tolist() == [0, 10, 35, 135]


def test_a_context_longer_than_the_workspace_is_refused():
    with pytest.raises(ValueError, match="workspace_tokens=100"):
        plan_prefill_chunks([1], [101], workspace_tokens=100, logits_bytes=1 << 20)


def test_prefill_context_parallelism_is_refused():
    with pytest.raises(NotImplementedError, match="prefill context parallelism"):
        plan_prefill_chunks([1], [1], workspace_tokens=8, logits_bytes=64, pcp_world_size=2)
    with pytest.raises(NotImplementedError, match="PCP"):
        build_indexer_metadata(torch.zeros(1, 1, dtype=torch.int32), [1], [1], torch.empty(4, dtype=torch.int64),
                               workspace_tokens=8, logits_bytes=64, pcp_world_size=2)


@pytest.mark.parametrize("impl", IMPLS)
def test_step_metadata_from_the_allocator(impl):
    """Two speculative decodes (next_n=2), an empty slot, and two prefills (one after a prefix hit)."""
    alloc = RowAllocator(num_rows=64, block_size=128, state_rows_per_request=1)
    prompt = list(range(700))
    alloc.add("d0", num_tokens=1030)
    alloc.add("d1", num_tokens=62)
    alloc.add("p0", prompt)
    hit = alloc.add("p1", prompt[:300] + [-1] * 40)
    assert hit == 256
    order = ["d0", "d1", "p0", "p1"]
    seq_lens = [alloc.num_tokens(r) for r in order]
    query_lens = [2, 2, 700, 340 - hit]
    block_table = alloc.block_table(order, width=20)
    buffer = torch.full((2048,), 5, dtype=torch.int64)
    meta = build_indexer_metadata(block_table, query_lens, seq_lens, buffer, next_n=2, workspace_tokens=1024,
                                  logits_bytes=1 << 20, num_kernel_pages=64 * 2, impl=impl)
    assert meta.num_decodes == 2 and meta.num_decode_tokens == 4
    assert meta.decode_context_lens.tolist() == [[1029, 1030], [61, 62]]
    assert meta.decode_block_table.shape == (2, 20)
    reference = compute_slot_mapping(block_table, meta.query_start_loc, meta.positions, impl="torch",
                                     out=torch.empty(2048, dtype=torch.int64))
    assert torch.equal(meta.slot_mapping, reference) and meta.slot_mapping is buffer
    assert meta.positions[:4].tolist() == [1028, 1029, 60, 61]
    assert meta.positions[4 + 700].item() == hit  # p1's first query token follows its cached prefix
    check_chunks(meta.prefill_chunks, query_lens[2:], seq_lens[2:], 1024, 1 << 20, first_token=4, first_req=2)
    assert meta.prefill_chunks[0].req_start == 2


def test_decodes_must_come_first():
    with pytest.raises(ValueError, match="decodes come first"):
        build_indexer_metadata(torch.zeros(2, 4, dtype=torch.int32), [5, 1], [5, 9],
                               torch.empty(8, dtype=torch.int64), num_decodes=1, workspace_tokens=64,
                               logits_bytes=1 << 10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 1), (2, 16), (4, 64)])
def test_dcp_decode_lengths_count_each_ranks_share(impl, world, interleave):
    """Under DCP every rank sees its own share of each row; the shares add up to the row."""
    seq_lens = [200, 63, 3, 4097]
    next_n = 2
    global_lens = decode_context_lens(torch.tensor(seq_lens, dtype=torch.int32), next_n, impl="torch")
    shares = []
    for rank in range(world):
        meta = build_indexer_metadata(
            torch.zeros(len(seq_lens), 80, dtype=torch.int32), [next_n] * len(seq_lens), seq_lens,
            torch.empty(64, dtype=torch.int64), next_n=next_n, num_decodes=len(seq_lens), workspace_tokens=64,
            logits_bytes=1 << 20, dcp=DcpSettings(world, rank, interleave), impl=impl)
        expected = [[DcpSettings(world, rank, interleave).local_len(n) for n in row] for row in global_lens.tolist()]
        assert meta.decode_context_lens.tolist() == expected
        shares.append(meta.decode_context_lens)
    assert torch.equal(torch.stack(shares).sum(0), global_lens)


def test_dcp_with_prefills_is_refused():
    with pytest.raises(NotImplementedError, match="decode context parallelism"):
        build_indexer_metadata(torch.zeros(2, 4, dtype=torch.int32), [1, 5], [9, 5], torch.empty(8, dtype=torch.int64),
                               workspace_tokens=64, logits_bytes=1 << 10, dcp=DcpSettings(2, 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_context_lens_refuses_short_lengths_on_both_paths(impl):
    out = torch.full((2, 3), -9, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens must be >= next_n=3"):
        decode_context_lens(torch.tensor([5, 2], dtype=torch.int32), 3, out, impl=impl)
    assert (out == -9).all()
    decode_context_lens(torch.tensor([5, 2], dtype=torch.int32), 3, out, check=False, impl=impl)
    assert out.tolist() == [[3, 4, 5], [0, 1, 2]]


@pytest.mark.parametrize("kw, match", [
    (dict(next_n=1.0), "next_n must be an integer"),
    (dict(next_n=True), "next_n"),
    (dict(seq_lens=[3, 4]), "seq_lens must be int32"),
    (dict(out=[[0]]), "out must be"),
])
def test_decode_context_lens_refuses_bad_types(kw, match):
    args = dict(seq_lens=torch.tensor([3, 4], dtype=torch.int32), next_n=1) | kw
    with pytest.raises(ValueError, match=match):
        decode_context_lens(**args)


def _metadata_args(**kw):
    args = dict(block_table=torch.zeros(2, 4, dtype=torch.int32), query_lens=[1, 3], seq_lens=[9, 3],
                slot_mapping=torch.empty(8, dtype=torch.int64), workspace_tokens=64, logits_bytes=1 << 10)
    return args | kw


@pytest.mark.parametrize("kw, match", [
    (dict(query_lens=[1, 3.0]), r"query_lens\[1\] must be an integer"),
    (dict(seq_lens=[9, -3]), r"seq_lens\[1\]"),
    (dict(seq_lens="93"), "seq_lens must be a sequence"),
    (dict(query_lens=[1, 4]), "query_len <= seq_len"),
    (dict(query_lens=[1]), "1 query_lens but 2 seq_lens"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), "3 rows for 2 requests"),
    (dict(block_table=torch.zeros(2, 4)), "int32 tensor"),
    (dict(slot_mapping=torch.empty(3, dtype=torch.int64)), "room for 3 tokens; the step schedules 4"),
    (dict(slot_mapping=torch.empty(8, dtype=torch.int32)), "slot_mapping must be a contiguous int64"),
    (dict(next_n="1"), "next_n"),
    (dict(num_decodes=0.5), "num_decodes"),
    (dict(workspace_tokens=64.0), "workspace_tokens"),
    (dict(logits_bytes=2), "logits_bytes must be an integer >= 4"),
    (dict(dcp=(2, 0, 1)), "dcp must be a DcpSettings"),
    (dict(pcp_world_size=1.0), "pcp_world_size"),
    (dict(num_kernel_pages=2.5), "num_kernel_pages"),
])
def test_step_builder_refuses_bad_arguments_before_writing(kw, match):
    args = _metadata_args(**kw)
    slot_mapping = args["slot_mapping"]
    if isinstance(slot_mapping, torch.Tensor):
        slot_mapping.fill_(55)
    with pytest.raises(ValueError, match=match):
        build_indexer_metadata(**args)
    assert (slot_mapping == 55).all()


def test_step_builder_page_check_and_its_sync_free_form():
    """A prefill token without a page is refused with check=True; check=False writes -1 for it."""
    args = _metadata_args(block_table=torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1]], dtype=torch.int32),
                          query_lens=[1, 70], seq_lens=[9, 70], slot_mapping=torch.full((80,), 55, dtype=torch.int64),
                          workspace_tokens=128, logits_bytes=1 << 20)
    with pytest.raises(ValueError, match="which is -1"):
        build_indexer_metadata(**args, impl="torch")
    assert (args["slot_mapping"] == 55).all()
    meta = build_indexer_metadata(**args, check=False, impl="torch")
    assert meta.slot_mapping[1 + 64:71].tolist() == [-1] * 6 and meta.slot_mapping[1] == 4 * 64


@pytest.mark.parametrize("kw, match", [
    (dict(query_lens=[4.0]), r"query_lens\[0\] must be an integer"),
    (dict(seq_lens=(4, 5)), "1 query_lens but 2 seq_lens"),
    (dict(workspace_tokens="64"), "workspace_tokens"),
    (dict(logits_bytes=1e6), "logits_bytes"),
    (dict(first_token=-1), "first_token"),
    (dict(first_req=0.0), "first_req"),
    (dict(pcp_world_size="1"), "pcp_world_size"),
])
def test_prefill_chunks_refuse_bad_types(kw, match):
    args = dict(query_lens=[4], seq_lens=[4], workspace_tokens=64, logits_bytes=1 << 10) | kw
    with pytest.raises(ValueError, match=match):
        plan_prefill_chunks(**args)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_context_lens_takes_a_strided_seq_lens_on_both_paths(impl):
    seq_lens = torch.tensor([7, 0, 9, 0, 4, 0], dtype=torch.int32)[::2]
    assert decode_context_lens(seq_lens, 2, impl=impl).tolist() == [[6, 7], [8, 9], [3, 4]]
