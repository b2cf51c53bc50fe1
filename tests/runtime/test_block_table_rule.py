"""The one block-table lookup rule: torch helper and Triton helper agree, and neither reads past the table."""

import pytest
import torch

from dsacache.runtime.block_table import check_block_table, lookup_pages
from tests.helpers import triton_available

if triton_available():
    import triton
    import triton.language as tl

    from dsacache.ops.triton_utils import block_table_page

    @triton.jit
    def _probe(bt_ptr, bt_stride, blocks_ptr, out_page, out_ok, width, num_pages, N: tl.constexpr):
        b = tl.program_id(0)
        i = tl.arange(0, N)
        block = tl.load(blocks_ptr + i)
        page, ok = block_table_page(bt_ptr + b * bt_stride, block, True, width, num_pages)
        tl.store(out_page + b * N + i, page)
        tl.store(out_ok + b * N + i, ok.to(tl.int32))


def _table():
    return torch.tensor([[3, -1, 7], [5, 9, 2]], dtype=torch.int32)


def test_lookup_pages_rule():
    table = _table()
    requests = torch.tensor([[0], [1]])
    blocks = torch.tensor([[-1, 0, 1, 2, 3]])
    page, ok = lookup_pages(table, requests, blocks, num_pages=8)
    assert page.tolist() == [[-1, 3, -1, 7, -1], [-1, 5, -1, 2, -1]]  # 9 >= num_pages, block 3 past the table
    assert ok.tolist() == [[False, True, False, True, False], [False, True, False, True, False]]
    page, ok = lookup_pages(table, requests, blocks)
    assert page.tolist()[1] == [-1, 5, 9, 2, -1]


def test_lookup_pages_on_an_empty_table():
    page, ok = lookup_pages(torch.empty(2, 0, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert page.tolist() == [-1, -1] and not ok.any()


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 3, dtype=torch.int64), "int32 tensor"),
    (torch.zeros(3, dtype=torch.int32), "int32 tensor"),
    ([[1, 2]], "got list"),
])
def test_check_block_table_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        check_block_table(bad)


def test_check_block_table_rows_and_width():
    check_block_table(_table(), 2, min_width=3)
    with pytest.raises(ValueError, match="has 2 rows for 3 requests"):
        check_block_table(_table(), 3)
    with pytest.raises(ValueError, match="at least 4 blocks wide"):
        check_block_table(_table(), min_width=4)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpret),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_helper_follows_the_same_rule(device):
    table = _table().to(device)
    blocks = torch.tensor([-1, 0, 1, 2, 3, 4, 0, 1], dtype=torch.int32, device=device)
    out_page = torch.empty(2, 8, dtype=torch.int32, device=device)
    out_ok = torch.empty(2, 8, dtype=torch.int32, device=device)
    _probe[(2,)](table, table.stride(0), blocks, out_page, out_ok, 3, 8, N=8)
    page, ok = lookup_pages(table, torch.arange(2, device=device)[:, None], blocks.long()[None, :], num_pages=8)
    assert out_page.tolist() == page.tolist()
    assert out_ok.bool().tolist() == ok.tolist()
