"""Row allocator: lifecycle, refusals, prefix reuse and bad input."""

import numpy as np
import pytest
import torch

from dsacache.runtime import DcpSettings, OutOfRowsError, RowAllocator

BS = 128  # tokens per row in these tests (two kernel pages)


def make(num_rows=10, state_rows=2, **kw) -> RowAllocator:
    return RowAllocator(num_rows, BS, state_rows, **kw)


def ids(n, start=0):
    return list(range(start, start + n))


def test_add_takes_state_rows_and_prompt_rows():
    alloc = make()
    assert alloc.add("a", num_tokens=300) == 0
    assert len(alloc.state_rows("a")) == 2
    assert len(alloc.attention_rows("a")) == 3
    assert alloc.num_free_rows == 10 - 5
    alloc.check_invariants()


def test_extend_takes_a_row_only_when_a_block_fills():
    alloc = make()
    alloc.add("a", num_tokens=BS - 1)
    alloc.extend("a", 1)
    assert len(alloc.attention_rows("a")) == 1
    alloc.extend("a", 1)
    assert len(alloc.attention_rows("a")) == 2
    assert alloc.num_tokens("a") == BS + 1


def test_empty_prompt_holds_only_state_rows():
    alloc = make()
    alloc.add("a", num_tokens=0)
    assert alloc.attention_rows("a") == [] and alloc.kernel_pages("a") == []
    alloc.extend("a", 1)
    assert len(alloc.attention_rows("a")) == 1


def test_free_returns_every_row():
    alloc = make()
    alloc.add("a", ids(500))
    alloc.add("b", num_tokens=10)
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_rows == 10 and alloc.num_requests == 0
    alloc.check_invariants()


def test_refused_add_changes_nothing():
    alloc = make(num_rows=6)
    alloc.add("a", num_tokens=BS)  # 3 rows
    before = (alloc.num_free_rows, alloc.request_ids())
    assert not alloc.can_add(num_tokens=2 * BS + 1)  # needs 2 + 3 rows
    with pytest.raises(OutOfRowsError):
        alloc.add("b", num_tokens=2 * BS + 1)
    assert (alloc.num_free_rows, alloc.request_ids()) == before
    assert not alloc.has_request("b")
    alloc.add("b", num_tokens=BS)  # exactly fits
    assert alloc.num_free_rows == 0


def test_refused_extend_changes_nothing():
    alloc = make(num_rows=4)
    alloc.add("a", num_tokens=2 * BS)
    assert alloc.num_free_rows == 0 and not alloc.can_extend("a", 1)
    with pytest.raises(OutOfRowsError):
        alloc.extend("a", 1)
    assert alloc.num_tokens("a") == 2 * BS and len(alloc.attention_rows("a")) == 2
    alloc.check_invariants()


def test_no_row_has_two_owners():
    alloc = make(num_rows=20)
    for i in range(5):
        alloc.add(i, num_tokens=100 + 37 * i)
    rows = [r for i in range(5) for r in alloc.state_rows(i) + alloc.attention_rows(i)]
    assert len(rows) == len(set(rows))


def test_kernel_pages_follow_rows_and_truncate():
    alloc = make(state_rows=1)
    alloc.add("a", num_tokens=BS + 1)  # rows: state 0, attention 1 and 2
    assert alloc.attention_rows("a") == [1, 2]
    assert alloc.kernel_pages("a") == [2, 3, 4]  # 3 pages of 64 for 129 tokens
    table = alloc.block_table(["a"], width=5)
    assert table.dtype == torch.int32
    assert table.tolist() == [[2, 3, 4, -1, -1]]


class TestPrefixReuse:
    def test_full_blocks_are_shared_and_counted(self):
        alloc = make(num_rows=20)
        prompt = ids(3 * BS + 10)
        assert alloc.add("a", prompt) == 0
        hit = alloc.add("b", prompt[: 2 * BS] + ids(50, start=10_000))
        assert hit == 2 * BS
        assert alloc.attention_rows("b")[:2] == alloc.attention_rows("a")[:2]
        assert alloc.attention_rows("b")[2] not in alloc.attention_rows("a")
        assert alloc.stats.hit_tokens == 2 * BS
        alloc.check_invariants()

    def test_divergent_prefix_stops_the_chain(self):
        alloc = make(num_rows=20)
        alloc.add("a", ids(3 * BS))
        changed = ids(3 * BS)
        changed[5] = -7  # first block differs, so no later block may match either
        assert alloc.add("b", changed) == 0

    def test_last_prompt_token_is_never_a_hit(self):
        alloc = make(num_rows=20)
        alloc.add("a", ids(2 * BS))
        assert alloc.add("b", ids(2 * BS)) == BS  # the second block holds the last token

    def test_freed_block_stays_reusable_until_its_row_is_needed(self):
        alloc = make(num_rows=6, state_rows=1)
        alloc.add("a", ids(2 * BS + 1))
        shared = alloc.attention_rows("a")[:2]
        alloc.free("a")
        assert alloc.num_cached_rows == 2 and alloc.num_free_rows == 6
        assert alloc.add("b", ids(2 * BS + 5)) == 2 * BS
        assert alloc.attention_rows("b")[:2] == shared
        alloc.free("b")
        alloc.add("c", num_tokens=5 * BS)  # needs all 6 rows: the parked blocks are evicted
        assert alloc.num_cached_rows == 0
        alloc.free("c")
        assert alloc.add("d", ids(2 * BS + 1)) == 0

    def test_hit_on_a_parked_row_is_not_evicted_by_the_same_add(self):
        alloc = make(num_rows=4, state_rows=1)
        alloc.add("a", ids(BS + 1))  # state + 2 attention rows; block 0 hashed
        alloc.free("a")
        # 1 parked + 3 free; the new request needs 1 state + 1 new row + the hit.
        assert alloc.can_add(ids(BS + 1))
        assert alloc.add("b", ids(BS + 1)) == BS
        alloc.check_invariants()

    def test_can_add_counts_parked_hits_once(self):
        alloc = make(num_rows=3, state_rows=1)
        alloc.add("a", ids(BS + 1))  # all 3 rows
        alloc.free("a")
        # Parked block 0 + 2 free rows; a different prompt needs 1 + 2 rows: it evicts.
        assert alloc.can_add(ids(BS + 1, start=999))
        # The same prompt needs 1 state + 1 new row + the parked hit.
        assert alloc.can_add(ids(BS + 1))

    def test_shared_row_is_freed_only_by_its_last_owner(self):
        alloc = make(num_rows=20)
        alloc.add("a", ids(2 * BS))
        alloc.add("b", ids(2 * BS))
        row = alloc.attention_rows("a")[0]
        alloc.free("a")
        assert row in alloc.attention_rows("b")
        alloc.check_invariants()

    def test_extend_with_token_ids_makes_generated_blocks_shareable(self):
        alloc = make(num_rows=20)
        alloc.add("a", ids(BS - 10))
        alloc.extend("a", token_ids=ids(20, start=BS - 10))
        assert alloc.add("b", ids(BS + 3)) == BS

    def test_kda_states_are_never_shared(self):
        """Prefix reuse covers attention rows only: a hit starts with its own fresh state rows."""
        alloc = make(num_rows=20, state_rows=2)
        alloc.add("a", ids(3 * BS))
        alloc.add("b", ids(3 * BS))
        assert not set(alloc.state_rows("a")) & set(alloc.state_rows("b"))

    def test_disabled_reuse_shares_nothing(self):
        alloc = make(num_rows=20, enable_prefix_reuse=False)
        alloc.add("a", ids(3 * BS))
        assert alloc.add("b", ids(3 * BS)) == 0
        alloc.free("a")
        assert alloc.num_cached_rows == 0


def test_dcp_rows_cover_world_times_block_tokens():
    alloc = make(num_rows=20, state_rows=0, dcp=DcpSettings(world_size=2))
    alloc.add("a", num_tokens=2 * BS + 1)  # rank 0 stores 129 tokens -> 2 rows, 3 pages
    assert len(alloc.attention_rows("a")) == 2
    assert len(alloc.kernel_pages("a")) == 3


class TestBadInput:
    def test_request_id_used_twice(self):
        alloc = make()
        alloc.add("a", num_tokens=3)
        with pytest.raises(ValueError, match="already allocated"):
            alloc.add("a", num_tokens=3)

    def test_freeing_an_unknown_request(self):
        alloc = make()
        with pytest.raises(ValueError, match="unknown request id 'x'"):
            alloc.free("x")
        alloc.add("a", num_tokens=3)
        alloc.free("a")
        with pytest.raises(ValueError, match="unknown request"):
            alloc.free("a")

    def test_extending_an_unknown_request(self):
        with pytest.raises(ValueError, match="unknown request"):
            make().extend("nope", 1)

    def test_block_table_wider_than_allowed(self):
        alloc = make(max_num_pages_per_request=4)
        alloc.add("a", num_tokens=10)
        with pytest.raises(ValueError, match="wider than allowed"):
            alloc.block_table(["a"], width=5)

    def test_block_table_narrower_than_a_request(self):
        alloc = make()
        alloc.add("a", num_tokens=3 * 64)
        with pytest.raises(ValueError, match="narrower"):
            alloc.block_table(["a"], width=2)

    @pytest.mark.parametrize("kw, match", [
        (dict(num_rows=0), "num_rows"),
        (dict(block_size=100), "block_size"),
        (dict(dcp=DcpSettings(interleave=3)), "cp_kv_cache_interleave_size"),
    ])
    def test_bad_settings(self, kw, match):
        args = dict(num_rows=4, block_size=BS, state_rows_per_request=1) | kw
        with pytest.raises(ValueError, match=match):
            RowAllocator(**args)

    def test_mismatched_token_ids(self):
        alloc = make()
        alloc.add("a", num_tokens=3)
        with pytest.raises(ValueError, match="token_ids"):
            alloc.extend("a", 2, token_ids=[1])
        with pytest.raises(ValueError, match="num_tokens"):
            alloc.add("b", ids(4), num_tokens=3)


class TestAllOrNothing:
    """A call that raises leaves the allocator as it was (issue 17, class 1)."""

    def test_a_bad_token_after_the_first_miss_takes_no_row(self):
        alloc = make(num_rows=20)
        alloc.add("a", ids(3 * BS))
        free_before = alloc.num_free_rows
        prompt = ids(BS) + ids(2 * BS, start=50_000)
        prompt[2 * BS + 3] = 2.5  # block 2, after the miss on block 1
        with pytest.raises(ValueError, match="token_ids must hold integers"):
            alloc.add("b", prompt)
        assert not alloc.has_request("b") and alloc.num_free_rows == free_before
        alloc.check_invariants()
        # A later prompt sharing blocks 0 and 1 of the bad one gets only the block it shares with "a".
        assert alloc.add("c", ids(BS) + ids(BS + 1, start=50_000)) == BS

    @pytest.mark.parametrize("count", [100.5, 100.0, True, "100", -1])
    def test_a_bad_count_takes_no_row(self, count):
        alloc = make()
        with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
            alloc.add("a", num_tokens=count)
        assert alloc.num_requests == 0 and alloc.num_free_rows == 10

    def test_extend_with_a_bad_token_keeps_the_request_as_it_was(self):
        alloc = make()
        alloc.add("a", ids(BS - 1))
        with pytest.raises(ValueError, match="token_ids"):
            alloc.extend("a", token_ids=ids(BS - 1, start=BS - 1) + [None])
        assert alloc.num_tokens("a") == BS - 1 and len(alloc.attention_rows("a")) == 1
        with pytest.raises(ValueError, match="num_new_tokens must be an integer"):
            alloc.extend("a", 1.5)
        with pytest.raises(ValueError, match="num_new_tokens must be an integer"):
            alloc.can_extend("a", 1.5)
        alloc.check_invariants()

    @pytest.mark.parametrize("bad", [["x"], {"k": 1}])
    def test_unhashable_request_ids(self, bad):
        alloc = make()
        for call in (lambda: alloc.add(bad, num_tokens=1), lambda: alloc.free(bad), lambda: alloc.extend(bad, 1),
                     lambda: alloc.num_tokens(bad)):
            with pytest.raises(ValueError, match="request id must be hashable"):
                call()

    @pytest.mark.parametrize("bad", ["abc", b"abcdefgh", {1, 2}, 5, torch.zeros(3), torch.zeros(1, 3, dtype=torch.int64),
                                     np.zeros(3), torch.ones(2, dtype=torch.bool)])
    def test_token_ids_of_a_wrong_kind(self, bad):
        with pytest.raises(ValueError, match="token_ids"):
            make().add("a", bad)


@pytest.mark.parametrize("form", [tuple, lambda x: x, np.array, lambda x: np.array(x, dtype=np.int32),
                                  lambda x: torch.tensor(x, dtype=torch.int32), torch.tensor])
def test_token_ids_in_every_accepted_container_share_the_same_blocks(form):
    alloc = make(num_rows=20)
    alloc.add("a", list(range(2 * BS + 1)))
    assert alloc.add("b", form(range(2 * BS + 1))) == 2 * BS


@pytest.mark.parametrize("kw, match", [
    (dict(num_rows=2.5), "num_rows must be an integer >= 1"),
    (dict(num_rows="4"), "num_rows"),
    (dict(block_size=128.0), "block_size"),
    (dict(state_rows_per_request=-1), "state_rows_per_request"),
    (dict(state_rows_per_request=None), "state_rows_per_request"),
    (dict(max_num_pages_per_request=0), "max_num_pages_per_request"),
    (dict(enable_prefix_reuse="yes"), "enable_prefix_reuse"),
    (dict(dcp=2), "dcp must be a DcpSettings"),
])
def test_constructor_refuses_wrong_types(kw, match):
    args = dict(num_rows=4, block_size=BS, state_rows_per_request=1) | kw
    with pytest.raises(ValueError, match=match):
        RowAllocator(**args)


def test_numpy_integers_are_integers():
    alloc = RowAllocator(np.int64(4), np.int32(BS), np.int64(1))
    alloc.add("a", num_tokens=np.int64(BS + 1))
    alloc.extend("a", np.int32(3))
    assert alloc.num_tokens("a") == BS + 4 and type(alloc.num_rows) is int
