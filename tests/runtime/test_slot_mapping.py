"""Slot mapping: the worked examples of formats.md, DCP ownership, ragged batches, errors,
and the Triton kernel (interpreter on CPU) against the PyTorch reference."""

import random

import pytest
import torch

from dsacache.runtime import compute_slot_mapping, dcp_local_len, dcp_local_position, dcp_owner
from tests.helpers import triton_available

# The Triton case runs on CPU tensors (the interpreter); on a CUDA machine the gpu tests cover it.
IMPLS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.interpret)] if triton_available() else [])


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("impl", IMPLS)
def test_formats_example_single_rank(impl):
    out = torch.full((6,), 12345, dtype=torch.int64)
    compute_slot_mapping(i32([[5, 6, 7]]), i32([0, 4]), i64([0, 15, 16, 47]), out, page_size=16, impl=impl)
    assert out.tolist() == [80, 95, 96, 127, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
def test_formats_example_two_dcp_ranks(impl):
    out = compute_slot_mapping(
        i32([[5, 6]]), i32([0, 8]), i64([0, 1, 2, 3, 4, 5, 32, 33]),
        page_size=16, dcp_world_size=2, dcp_rank=1, dcp_interleave=1, impl=impl,
    )
    assert out.tolist() == [-1, 80, -1, 81, -1, 82, -1, 96]


def test_dcp_helpers_agree_with_the_rule():
    for world, interleave in [(1, 1), (2, 1), (4, 8), (3, 2)]:
        for n in range(0, 100):
            counts = [0] * world
            for p in range(n):
                owner = dcp_owner(p, world, interleave)
                assert dcp_local_position(p, world, interleave) == counts[owner]
                counts[owner] += 1
            assert counts == [dcp_local_len(n, world, r, interleave) for r in range(world)]


def ragged_batch(rng, num_reqs, max_query, max_prefix, page_size, extra_width=1):
    """A batch of requests with random prefixes (positions not starting at 0), some empty."""
    query_lens = [rng.choice([0, 1, rng.randint(0, max_query)]) for _ in range(num_reqs)]
    starts = [rng.randint(0, max_prefix) for _ in range(num_reqs)]
    seq_lens = [s + q for s, q in zip(starts, query_lens)]
    width = max(-(-s // page_size) for s in seq_lens + [1]) + extra_width
    pages = torch.randperm(num_reqs * width * 2)[: num_reqs * width].view(num_reqs, width).int()
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    positions = [p for s, q in zip(starts, query_lens) for p in range(s, s + q)]
    return pages, i32(cu), i64(positions), seq_lens


def expected_slots(block_table, query_start_loc, positions, page_size, world=1, rank=0, interleave=1):
    """The rule written token by token (independent of both implementations)."""
    out = []
    cu = query_start_loc.tolist()
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            p = int(positions[t])
            if dcp_owner(p, world, interleave) != rank:
                out.append(-1)
                continue
            local = dcp_local_position(p, world, interleave)
            out.append(int(block_table[b, local // page_size]) * page_size + local % page_size)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (4, 16), (3, 64)])
def test_ragged_batches_match_the_rule(impl, world, interleave):
    rng = random.Random()
    for _ in range(3):
        bt, qsl, pos, _ = ragged_batch(rng, rng.randint(1, 9), 300, 3000, 64)
        budget = len(pos) + rng.randint(0, 40)
        for rank in range(world):
            out = torch.full((budget,), -7, dtype=torch.int64)
            compute_slot_mapping(bt, qsl, pos, out, dcp_world_size=world, dcp_rank=rank,
                                 dcp_interleave=interleave, impl=impl)
            want = expected_slots(bt, qsl, pos, 64, world, rank, interleave)
            assert out[: len(pos)].tolist() == want
            assert (out[len(pos):] == -1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_every_token_has_exactly_one_dcp_owner(impl):
    bt, qsl, pos, _ = ragged_batch(random.Random(), 6, 200, 2000, 64)
    world = 4
    owned = torch.zeros(len(pos), dtype=torch.int64)
    for rank in range(world):
        out = compute_slot_mapping(bt, qsl, pos, dcp_world_size=world, dcp_rank=rank, dcp_interleave=2, impl=impl)
        owned += (out >= 0).long()
    assert (owned == 1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_across_the_1024_token_mark_with_empty_requests(impl):
    # Request 0 is empty, request 1 decodes at 1023 and 1024, request 2 is empty, request 3
    # prefills [1000, 1100): page 15 ends at 1023, page 16 starts at 1024.
    bt = torch.arange(4 * 20, dtype=torch.int32).view(4, 20) + 100
    qsl = i32([0, 0, 2, 2, 102])
    pos = i64([1023, 1024] + list(range(1000, 1100)))
    out = compute_slot_mapping(bt, qsl, pos, impl=impl)
    assert out[:2].tolist() == [(120 + 15) * 64 + 63, (120 + 16) * 64]
    assert out[2:].tolist() == [int(bt[3, p // 64]) * 64 + p % 64 for p in range(1000, 1100)]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_fills_the_buffer_with_minus_one(impl):
    out = torch.full((16,), 3, dtype=torch.int64)
    compute_slot_mapping(torch.zeros(0, 4, dtype=torch.int32), i32([0]), i64([]), out, impl=impl)
    assert (out == -1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_batch_in_a_padded_buffer(impl):
    """Positions continue a cached prefix; the buffer is larger than the batch (CUDA-graph padding)."""
    bt = i32([[3, 9, 5, -1]])
    out = torch.full((8,), 77, dtype=torch.int64)
    compute_slot_mapping(bt, i32([0, 3]), i64([126, 127, 128, 0, 0]), out, num_kernel_pages=10, impl=impl)
    assert out.tolist() == [9 * 64 + 62, 9 * 64 + 63, 5 * 64] + [-1] * 5


class TestErrors:
    def test_page_past_the_table_width(self):
        with pytest.raises(ValueError, match="only 2 pages wide"):
            compute_slot_mapping(i32([[1, 2]]), i32([0, 1]), i64([128]), impl="torch")

    def test_unallocated_page(self):
        with pytest.raises(ValueError, match="-1"):
            compute_slot_mapping(i32([[1, -1]]), i32([0, 1]), i64([64]), impl="torch")

    def test_slot_outside_the_pool(self):
        with pytest.raises(ValueError, match="outside the pool of 8 pages"):
            compute_slot_mapping(i32([[1, 8]]), i32([0, 1]), i64([64]), num_kernel_pages=8, impl="torch")

    def test_buffer_too_small(self):
        with pytest.raises(ValueError, match="room for 2"):
            compute_slot_mapping(i32([[1]]), i32([0, 3]), i64([0, 1, 2]), torch.empty(2, dtype=torch.int64),
                                 impl="torch")

    @pytest.mark.parametrize("kw, match", [
        (dict(dcp_world_size=2, dcp_rank=2), "dcp_rank"),
        (dict(dcp_interleave=0), "dcp_interleave"),
        (dict(impl="cuda"), "impl"),
        (dict(page_size=0), "page_size"),
    ])
    def test_bad_settings(self, kw, match):
        with pytest.raises(ValueError, match=match):
            compute_slot_mapping(i32([[1]]), i32([0, 1]), i64([0]), **kw)

    def test_bad_dtypes(self):
        with pytest.raises(ValueError, match="block_table must be int32"):
            compute_slot_mapping(i64([[1]]), i32([0, 1]), i64([0]))
        with pytest.raises(ValueError, match="positions must be int64"):
            compute_slot_mapping(i32([[1]]), i32([0, 1]), i32([0]))
        with pytest.raises(ValueError, match="2 are needed"):
            compute_slot_mapping(i32([[1]]), i32([0, 1, 1]), i64([0]))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.interpret
def test_triton_drops_unresolvable_tokens_instead_of_writing_outside():
    """The kernel cannot raise; a token without a valid page gets -1."""
    out = compute_slot_mapping(i32([[1, -1, 9]]), i32([0, 4]), i64([0, 64, 128, 192]), num_kernel_pages=8,
                               impl="triton")
    assert out.tolist() == [64, -1, -1, -1]
