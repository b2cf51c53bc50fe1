"""KDA state checkpoints in the allocator: the policy's positions, saves and restores as ordered
row copies, eviction with the cached blocks, capacity, and the invariants throughout."""

import pytest

from dsacache.runtime import RowAllocator

BS = 64
G = 2  # state rows per request


def alloc(num_rows=40):
    return RowAllocator(num_rows=num_rows, block_size=BS, state_rows_per_request=G)


def prompt(prefix, length, start):
    return list(prefix) + list(range(start, start + length - len(prefix)))


def test_continuation_restores_from_the_last_full_block():
    a = alloc()
    first = prompt([], 3 * BS + 10, 0)
    assert a.add("a", first) == 0
    assert a.checkpoint_positions("a") == [3 * BS]  # no shared prefix: the last full block only
    assert a.save_checkpoint("a", 3 * BS)
    saves = a.pop_state_copies()
    assert [src for src, _ in saves] == a.state_rows("a") and a.num_checkpoint_rows == G
    checkpoint = [dst for _, dst in saves]
    a.check_invariants()
    a.free("a")
    assert a.num_free_rows == a.num_rows  # parked blocks and the checkpoint are all evictable
    nxt = first + list(range(5000, 5000 + 2 * BS))
    assert a.add("b", nxt) == 3 * BS  # its fourth block differs (first ended inside it)
    assert a.restored_tokens("b") == 3 * BS
    assert a.stats.restored_tokens == 3 * BS
    assert a.pop_state_copies() == list(zip(checkpoint, a.state_rows("b")))
    assert a.checkpoint_positions("b") == [(len(nxt) - 1) // BS * BS]
    a.check_invariants()


def test_fork_point_checkpoint_serves_the_third_prompt():
    a = alloc()
    system = list(range(10_000, 10_000 + 2 * BS))
    a.add("a", prompt(system, 2 * BS + 30, 0))
    assert a.checkpoint_positions("a") == [2 * BS]  # its last full block is the shared prefix here
    a.free("a")  # no save: a prompt may skip its checkpoints
    a.add("b", prompt(system, 4 * BS + 5, 1000))
    assert a.restored_tokens("b") == 0
    assert a.checkpoint_positions("b") == [2 * BS, 4 * BS]  # the fork point, then its last full block
    assert a.save_checkpoint("b", 2 * BS)
    with pytest.raises(ValueError, match="checkpoint positions"):
        a.save_checkpoint("b", 3 * BS)
    a.add("c", prompt(system, 3 * BS, 2000))  # added before the save is applied: copies stay ordered
    assert a.restored_tokens("c") == 2 * BS
    copies = a.pop_state_copies()
    checkpoint = [dst for _, dst in copies[:G]]
    assert copies == list(zip(a.state_rows("b"), checkpoint)) + list(zip(checkpoint, a.state_rows("c")))
    assert a.pop_state_copies() == []
    a.check_invariants()


def test_checkpoints_are_evicted_with_the_cached_blocks_and_counted():
    a = alloc(num_rows=12)
    first = prompt([], 3 * BS + 1, 0)
    a.add("a", first)
    a.save_checkpoint("a", 3 * BS)
    a.pop_state_copies()
    a.free("a")
    assert (a.num_cached_rows, a.num_checkpoint_rows) == (3 + G, G)
    a.add("big", num_tokens=(12 - G) * BS)  # needs every row: blocks and checkpoint are evicted
    assert a.num_checkpoint_rows == 0
    a.check_invariants()
    a.free("big")
    a.add("b", first)
    assert a.restored_tokens("b") == 0


def test_save_without_free_rows_returns_false():
    a = alloc(num_rows=G + 2)
    a.add("a", prompt([], BS + 1, 0))  # G state rows + 2 attention rows: nothing left
    assert a.checkpoint_positions("a") == [BS]
    assert not a.save_checkpoint("a", BS)
    assert a.checkpoint_positions("a") == [] and a.pop_state_copies() == []
    a.check_invariants()


def test_free_with_pending_copies_keeps_the_copies_in_order():
    a = alloc()
    first = prompt([], 2 * BS + 3, 0)
    a.add("a", first)
    rows_a = a.state_rows("a")
    assert a.save_checkpoint("a", 2 * BS)
    a.free("a")
    a.check_invariants()
    copies = a.pop_state_copies()
    assert [src for src, _ in copies] == rows_a  # the rows still hold a's states: no layer ran
    a.check_invariants()
    assert a.num_checkpoint_rows == G


def test_no_checkpoints_without_state_rows_or_token_ids():
    plain = RowAllocator(num_rows=8, block_size=BS)
    plain.add("a", list(range(3 * BS)))
    assert plain.checkpoint_positions("a") == []
    a = alloc()
    a.add("b", num_tokens=3 * BS)
    assert a.checkpoint_positions("b") == []


def test_a_checkpoint_of_a_block_two_requests_share_is_not_evicted():
    a = alloc(num_rows=20)
    system = list(range(10_000, 10_000 + 2 * BS))
    a.add("a", prompt(system, 2 * BS + 5, 0))
    a.add("b", prompt(system, 2 * BS + 7, 1000))
    assert a.checkpoint_positions("b") == [2 * BS]
    assert a.save_checkpoint("b", 2 * BS)
    a.pop_state_copies()
    held = a.num_free_rows
    assert a.num_checkpoint_rows == G and held == 20 - 2 * G - 2 - 2 * 1 - G  # rows: states, shared, tails, checkpoint
    a.free("a")  # one user left: the checkpoint becomes evictable again
    assert a.num_free_rows == held + G + 1 + G
    a.check_invariants()
