"""The logits bench's inputs and its calls in turn (built on CPU here; the bench itself needs CUDA)."""

import pytest
import torch

from dsacache.bench.harness import in_turn
from dsacache.bench.logits import make_inputs, make_pages
from dsacache.ops.indexer_logits import paged_decode_logits


def test_in_turn_runs_the_calls_one_a_call_round_and_round():
    seen = []
    call = in_turn([lambda i=i: seen.append(i) or i for i in range(3)])
    assert [call() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    one = lambda: 5  # noqa: E731
    assert in_turn([one]) is one
    with pytest.raises(ValueError, match="at least one call"):
        in_turn([])


def test_block_tables_are_disjoint_and_the_first_is_the_one_table():
    pages = make_pages(40, "fp8", torch.device("cpu"))
    q, w, lens, tables = make_inputs(3, 256, 4, 2, pages, seed=7, tables=3)
    assert len(tables) == 3 and all(t.shape == (3, 4) and t.dtype == torch.int32 for t in tables)
    every = torch.cat([t.flatten() for t in tables])
    assert every.unique().numel() == every.numel() == 36 and int(every.max()) < 40
    q1, w1, lens1, (only,) = make_inputs(3, 256, 4, 2, pages, seed=7)
    assert torch.equal(only, tables[0]) and torch.equal(q1.float(), q.float()) and torch.equal(w1, w)
    assert lens.tolist() == [256] * 3


def test_each_table_scores_its_own_pages():
    """Two tables over one pool give what the reference gives on each (the calls in turn differ)."""
    pages = make_pages(16, "mxfp4", torch.device("cpu"))
    q, w, lens, tables = make_inputs(2, 256, 4, 1, pages, seed=1, tables=2)
    outs = [paged_decode_logits(q, w, lens, pages, t, max_model_len=256, impl="torch") for t in tables]
    call = in_turn([lambda t=t: paged_decode_logits(q, w, lens, pages, t, max_model_len=256, impl="torch")
                    for t in tables])
    assert torch.equal(call(), outs[0]) and torch.equal(call(), outs[1]) and not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("tables", [0, 4])
def test_too_few_or_too_many_tables_are_refused(tables):
    pages = make_pages(24, "fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match=f"tables={tables}"):
        make_inputs(2, 512, 4, 1, pages, tables=tables)
