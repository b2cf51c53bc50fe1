"""On a CUDA device: the Triton metadata builders against the PyTorch path, CUDA-graph
capture (no host sync), and pool views on the device."""

import random

import pytest
import torch

from dsacache.planner import CacheConfig, plan
from dsacache.runtime import CachePool, DcpSettings, build_indexer_metadata, compute_slot_mapping, decode_context_lens

pytestmark = pytest.mark.gpu


def ragged(num_reqs, max_query, max_prefix, width, device="cuda"):
    rng = random.Random()
    query_lens = [rng.choice([0, 1, 2, rng.randint(0, max_query)]) for _ in range(num_reqs)]
    starts = [rng.randint(0, max_prefix) for _ in range(num_reqs)]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    positions = [p for s, q in zip(starts, query_lens) for p in range(s, s + q)]
    table = torch.randperm(num_reqs * width * 2)[: num_reqs * width].view(num_reqs, width).int()
    return (table.to(device), torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device))


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (8, 64)])
@pytest.mark.parametrize("num_reqs", [1, 7, 256, 1000])
def test_slot_mapping_triton_matches_torch(world, interleave, num_reqs):
    table, qsl, pos = ragged(num_reqs, 2000, 200_000, width=3200)
    for rank in {0, world - 1}:
        out = torch.full((int(qsl[-1]) + 100,), -5, dtype=torch.int64, device="cuda")
        dcp = DcpSettings(world, rank, interleave)
        compute_slot_mapping(table, qsl, pos, out, dcp=dcp)
        ref = compute_slot_mapping(table.cpu(), qsl.cpu(), pos.cpu(), torch.empty_like(out, device="cpu"), dcp=dcp,
                                   impl="torch")
        assert torch.equal(out.cpu(), ref)


def test_decode_context_lens_triton_matches_torch():
    seq_lens = torch.randint(4, 1 << 17, (513,), dtype=torch.int32, device="cuda")
    for next_n in (1, 2, 3):
        out = decode_context_lens(seq_lens, next_n)
        assert torch.equal(out.cpu(), decode_context_lens(seq_lens.cpu(), next_n, impl="torch"))


def test_slot_mapping_is_cuda_graph_capturable():
    """Captured once at a fixed buffer size, replayed on a different batch written in place."""
    max_tokens, max_reqs, width = 4096, 64, 512
    table = torch.full((max_reqs, width), -1, dtype=torch.int32, device="cuda")
    qsl = torch.zeros(max_reqs + 1, dtype=torch.int32, device="cuda")
    pos = torch.zeros(max_tokens, dtype=torch.int64, device="cuda")
    out = torch.empty(max_tokens, dtype=torch.int64, device="cuda")
    seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device="cuda")
    ctx = torch.empty(max_reqs, 2, dtype=torch.int32, device="cuda")
    compute_slot_mapping(table, qsl, pos, out, check=False)  # compile before capture
    decode_context_lens(seq_lens, 2, ctx, check=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # check=False: no host read inside the graph
        compute_slot_mapping(table, qsl, pos, out, check=False)
        decode_context_lens(seq_lens, 2, ctx, check=False)
    for _ in range(3):
        new_table, new_qsl, new_pos = ragged(max_reqs, 60, 20_000, width)
        table.copy_(new_table)
        qsl.copy_(new_qsl)
        pos.zero_()
        pos[: new_pos.numel()].copy_(new_pos)
        seq_lens.copy_(torch.randint(2, 30_000, (max_reqs,), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = compute_slot_mapping(table.cpu(), qsl.cpu(), pos.cpu(), torch.empty(max_tokens, dtype=torch.int64),
                                   check=False, impl="torch")
        assert torch.equal(out.cpu(), ref)
        assert torch.equal(ctx.cpu(), decode_context_lens(seq_lens.cpu(), 2, impl="torch"))


def test_step_metadata_on_cuda_matches_cpu():
    table, _, _ = ragged(6, 1, 1, width=64, device="cpu")
    query_lens, seq_lens = [2, 2, 300, 0, 1000, 5], [100, 4000, 300, 7, 1900, 5]
    kw = dict(next_n=2, workspace_tokens=4096, logits_bytes=1 << 22)
    gpu = build_indexer_metadata(table.cuda(), query_lens, seq_lens, torch.empty(2048, dtype=torch.int64,
                                 device="cuda"), **kw)
    cpu = build_indexer_metadata(table, query_lens, seq_lens, torch.empty(2048, dtype=torch.int64), **kw)
    assert torch.equal(gpu.slot_mapping.cpu(), cpu.slot_mapping)
    assert torch.equal(gpu.decode_context_lens.cpu(), cpu.decode_context_lens)
    assert len(gpu.prefill_chunks) == len(cpu.prefill_chunks)


def test_pool_views_on_cuda_touch_only_their_bytes():
    layout = plan(CacheConfig.from_model("kimi-k3.1", tensor_parallel_size=8), num_rows=3)
    pool = CachePool(layout, device="cuda")
    pool.buffer.fill_(0xA5)
    view = pool.index_pages(layout.dsa_layers[7].layer)
    assert view.stride(0) == 1_210_368
    view.fill_(0x11)
    expected = torch.full((layout.num_rows * layout.row_bytes,), 0xA5, dtype=torch.uint8)
    offset, entry = layout.dsa_layers[7].index_offset, layout.dsa_layers[7].index_entry_bytes
    for page in range(layout.num_kernel_pages):
        start = page * layout.page_stride_bytes + offset
        expected[start : start + 64 * entry] = 0x11
    assert torch.equal(pool.buffer.cpu(), expected)


def test_slot_mapping_triton_refuses_what_torch_refuses():
    """The public function checks once for both paths: on CUDA the Triton path refuses the same inputs."""
    from tests.runtime.test_slot_mapping import REFUSED

    for table, qsl, pos, out_size, num_pages, match in REFUSED:
        args = (torch.tensor(table, dtype=torch.int32, device="cuda"),
                torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                torch.tensor(pos, dtype=torch.int64, device="cuda"))
        out = torch.full((out_size or len(pos),), 77, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=match):
            compute_slot_mapping(*args, out, num_kernel_pages=num_pages)
        assert (out == 77).all()
        compute_slot_mapping(*args, out, num_kernel_pages=num_pages, check=False)
        ref = compute_slot_mapping(*(a.cpu() for a in args), torch.empty_like(out, device="cpu"),
                                   num_kernel_pages=num_pages, check=False, impl="torch")
        assert torch.equal(out.cpu(), ref)


def test_decode_context_lens_triton_refuses_short_lengths():
    out = torch.full((2, 3), -9, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="seq_lens must be >= next_n=3"):
        decode_context_lens(torch.tensor([5, 2], dtype=torch.int32, device="cuda"), 3, out)
    assert (out == -9).all()
