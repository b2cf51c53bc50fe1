"""Slot mapping: the worked examples of docs/formats.md, DCP ownership, ragged batches, errors,
and the Triton kernel (interpreter on CPU) against the PyTorch reference."""

import random

import pytest
import torch

from dsacache.runtime import DcpSettings, compute_slot_mapping
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
        page_size=16, dcp=DcpSettings(world_size=2, rank=1, interleave=1), impl=impl,
    )
    assert out.tolist() == [-1, 80, -1, 81, -1, 82, -1, 96]


def test_dcp_helpers_agree_with_the_rule():
    for world, interleave in [(1, 1), (2, 1), (4, 8), (3, 2)]:
        for n in range(0, 100):
            ranks = [DcpSettings(world, r, interleave) for r in range(world)]
            counts = [0] * world
            for p in range(n):
                owner = ranks[0].owner(p)
                assert [dcp.owns(p) for dcp in ranks] == [r == owner for r in range(world)]
                assert ranks[owner].local_position(p) == counts[owner]
                counts[owner] += 1
            assert counts == [dcp.local_len(n) for dcp in ranks]
            lens = torch.arange(n + 1, dtype=torch.int32)
            for dcp in ranks:  # the tensor form agrees with the int form
                assert dcp.local_len(lens).tolist() == [dcp.local_len(m) for m in range(n + 1)]


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
    cycle = world * interleave
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            p = int(positions[t])
            if (p // interleave) % world != rank:
                out.append(-1)
                continue
            local = (p // cycle) * interleave + p % interleave
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
            compute_slot_mapping(bt, qsl, pos, out, dcp=DcpSettings(world, rank, interleave), impl=impl)
            want = expected_slots(bt, qsl, pos, 64, world, rank, interleave)
            assert out[: len(pos)].tolist() == want
            assert (out[len(pos):] == -1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_every_token_has_exactly_one_dcp_owner(impl):
    bt, qsl, pos, _ = ragged_batch(random.Random(), 6, 200, 2000, 64)
    world = 4
    owned = torch.zeros(len(pos), dtype=torch.int64)
    for rank in range(world):
        out = compute_slot_mapping(bt, qsl, pos, dcp=DcpSettings(world, rank, 2), impl=impl)
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


# Both paths refuse the same inputs: the public function checks once, before either runs.
REFUSED = [
    # (block_table, query_start_loc, positions, out size or None, num_kernel_pages, message)
    ([[1, 2]], [0, 1], [128], None, None, "only 2 pages wide"),
    ([[1, -1]], [0, 1], [64], None, None, "which is -1"),
    ([[1, 8]], [0, 1], [64], None, 8, "outside the pool of 8 pages"),
    ([[1]], [0, 3], [0, 1, 2], 2, None, "room for 2"),
    ([[1]], [0, 4], [0, 1, 2], None, None, "positions has 3"),
    ([[1], [2]], [0, 3, 1], [0, 1, 2], None, None, "must not decrease"),
    ([[1], [2]], [1, 2, 3], [0, 1, 2], None, None, r"query_start_loc\[0\]=1 must be 0"),
    ([[1]], [0, 2], [0, -5], None, None, "positions must be >= 0"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table, qsl, pos, out_size, num_pages, match", REFUSED)
def test_both_paths_refuse_before_writing(impl, table, qsl, pos, out_size, num_pages, match):
    out = torch.full((out_size or len(pos),), 77, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        compute_slot_mapping(i32(table), i32(qsl), i64(pos), out, num_kernel_pages=num_pages, impl=impl)
    assert (out == 77).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table, qsl, pos, out_size, num_pages, match", REFUSED)
def test_unchecked_bad_input_stays_in_bounds(impl, table, qsl, pos, out_size, num_pages, match):
    """check=False never reads back: the same inputs give -1 or a slot of a usable table page, never more."""
    out = torch.full((out_size or len(pos),), 77, dtype=torch.int64)
    compute_slot_mapping(i32(table), i32(qsl), i64(pos), out, num_kernel_pages=num_pages, page_size=64,
                         check=False, impl=impl)
    limit = num_pages if num_pages is not None else 1 << 30
    allowed = {p * 64 + r for row in table for p in row if 0 <= p < limit for r in range(64)} | {-1}
    assert set(out.tolist()) <= allowed


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.interpret
def test_unchecked_paths_agree_on_bad_input():
    for table, qsl, pos, out_size, num_pages, _ in REFUSED:
        outs = [compute_slot_mapping(i32(table), i32(qsl), i64(pos), torch.empty(out_size or len(pos),
                                     dtype=torch.int64), num_kernel_pages=num_pages, check=False, impl=impl)
                for impl in ("torch", "triton")]
        assert outs[0].tolist() == outs[1].tolist(), (table, qsl, pos)


class TestErrors:
    @pytest.mark.parametrize("kw, match", [
        (dict(dcp=2), "dcp must be a DcpSettings"),
        (dict(impl="cuda"), "impl"),
        (dict(page_size=0), "page_size"),
        (dict(page_size=64.0), "page_size must be an integer"),
        (dict(num_kernel_pages=8.5), "num_kernel_pages"),
        (dict(num_kernel_pages="8"), "num_kernel_pages"),
        (dict(out=[0]), "out must be a contiguous int64"),
        (dict(out=torch.empty(4, dtype=torch.int32)), "out must be a contiguous int64"),
        (dict(out=torch.empty(8, dtype=torch.int64)[::2]), "out must be a contiguous int64"),
    ])
    def test_bad_settings(self, kw, match):
        with pytest.raises(ValueError, match=match):
            compute_slot_mapping(i32([[1]]), i32([0, 1]), i64([0]), **kw)

    def test_bad_argument_types(self):
        with pytest.raises(ValueError, match="block_table must be an int32 tensor.*got list"):
            compute_slot_mapping([[1]], i32([0, 1]), i64([0]))
        with pytest.raises(ValueError, match="query_start_loc must be int32 .*got list"):
            compute_slot_mapping(i32([[1]]), [0, 1], i64([0]))
        with pytest.raises(ValueError, match="positions must be int64 .*got tuple"):
            compute_slot_mapping(i32([[1]]), i32([0, 1]), (0,))

    def test_bad_dtypes(self):
        with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
            compute_slot_mapping(i64([[1]]), i32([0, 1]), i64([0]))
        with pytest.raises(ValueError, match="positions must be int64"):
            compute_slot_mapping(i32([[1]]), i32([0, 1]), i32([0]))
        with pytest.raises(ValueError, match="2 are needed"):
            compute_slot_mapping(i32([[1]]), i32([0, 1, 1]), i64([0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_unchecked_paths_drop_unresolvable_tokens_instead_of_writing_outside(impl):
    """With check=False nothing is read back: a token without a valid page gets -1 on both paths."""
    out = compute_slot_mapping(i32([[1, -1, 9]]), i32([0, 4]), i64([0, 64, 128, 192]), num_kernel_pages=8,
                               check=False, impl=impl)
    assert out.tolist() == [64, -1, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_on_both_paths(impl):
    """Views (a transposed table, every other position) give what their contiguous copies give."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4).t()  # [4, 3], stride(1) == 4
    qsl = torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32)
    pos = torch.tensor([5, -9, 70, -9, 130, -9], dtype=torch.int64)[::2]
    out = compute_slot_mapping(table, qsl, pos, impl=impl)
    ref = compute_slot_mapping(table.contiguous(), qsl, pos.contiguous(), impl="torch")
    assert out.tolist() == ref.tolist() == [0 * 64 + 5, 6 * 64 + 6, 11 * 64 + 2]
