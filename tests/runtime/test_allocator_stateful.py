"""Long random add/extend/free/prefix-hit sequences, bad calls among them, against a simple
model of the allocator: the invariants hold after every step, and a call that raises
leaves the allocator's whole state exactly as it was."""

import copy

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsacache.runtime import DcpSettings, OutOfRowsError, RowAllocator

BS = 64
NUM_ROWS = 24
STATE_ROWS = 2
# A few shared prompt prefixes; requests pick one and append their own tail.
PREFIXES = [[1000 * p + i for i in range(3 * BS)] for p in range(3)]
BAD_COUNTS = [100.5, 2.0, -1, True, "3", float("nan"), [3]]
BAD_TOKENS = [1.5, "7", None, 2**63, [1], float("inf")]
BAD_SEQUENCES = ["abc", b"\x00" * 16, {1, 2}, 7, torch.zeros(4), torch.zeros(2, 2, dtype=torch.int64),
                 torch.ones(3, dtype=torch.bool), np.zeros(3), np.zeros((2, 2), dtype=np.int64)]
UNHASHABLE = [[1], {"a": 1}, {2}]


def snapshot(alloc: RowAllocator) -> dict:
    """Everything the allocator holds, copied (request order and the parked LRU order included)."""
    state = copy.deepcopy(vars(alloc))
    state["request order"] = list(alloc.request_ids())
    if alloc.prefix is not None:
        state["prefix"] = copy.deepcopy(vars(alloc.prefix))
    return state


def as_form(tokens, form):
    """The same token ids in one of the accepted containers."""
    if form == "tuple":
        return tuple(tokens)
    if form == "numpy":
        return np.array(tokens, dtype=np.int64)
    if form == "torch":
        return torch.tensor(tokens, dtype=torch.int64)
    return list(tokens)


FORMS = st.sampled_from(["list", "tuple", "numpy", "torch"])


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = RowAllocator(NUM_ROWS, BS, STATE_ROWS, max_num_pages_per_request=64)
        self.tokens: dict[int, int] = {}  # the model: request -> token count
        self.next_id = 0
        self.next_token = 10**6

    def _fresh(self, n):
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _refused(self, error, call, *args, **kwargs):
        """``call`` must raise ``error`` and change nothing."""
        before = snapshot(self.alloc)
        try:
            call(*args, **kwargs)
        except error:
            assert snapshot(self.alloc) == before, f"{call.__name__}{args} raised but changed the allocator"
            return
        raise AssertionError(f"{call.__name__}{args} {kwargs} did not raise {error.__name__}")

    def _expect_add(self, prompt, form="list"):
        rid = self.next_id
        self.next_id += 1
        if not self.alloc.can_add(as_form(prompt, form)):
            self._refused(OutOfRowsError, self.alloc.add, rid, as_form(prompt, form))
            return
        hit = self.alloc.add(rid, as_form(prompt, form))
        assert hit % BS == 0 and hit < max(len(prompt), 1)
        self.tokens[rid] = len(prompt)

    def _live(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), shared=st.integers(0, 3 * BS), tail=st.integers(0, 150),
          form=FORMS)
    def add_with_prefix(self, prefix, shared, tail, form):
        self._expect_add(PREFIXES[prefix][:shared] + self._fresh(tail), form)

    @rule(n=st.integers(0, 300))
    def add_unique(self, n):
        self._expect_add(self._fresh(n))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 130), with_ids=st.booleans())
    def extend(self, data, n, with_ids):
        rid = self._live(data)
        if not self.alloc.can_extend(rid, n):
            self._refused(OutOfRowsError, self.alloc.extend, rid, n, self._fresh(n) if with_ids else None)
            return
        rows_before = self.alloc.attention_rows(rid)
        self.alloc.extend(rid, n, self._fresh(n) if with_ids else None)
        assert self.alloc.attention_rows(rid)[: len(rows_before)] == rows_before
        self.tokens[rid] += n

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = self._live(data)
        self.alloc.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def save_checkpoint(self, data):
        rid = self._live(data)
        positions = self.alloc.checkpoint_positions(rid)
        if not positions:
            self._refused(ValueError, self.alloc.save_checkpoint, rid, BS)
            return
        position = data.draw(st.sampled_from(positions))
        saved = self.alloc.save_checkpoint(rid, position)
        assert position not in self.alloc.checkpoint_positions(rid)
        if saved:
            assert self.alloc.num_checkpoint_rows >= STATE_ROWS

    @rule()
    def pop_state_copies(self):
        for src, dst in self.alloc.pop_state_copies():
            assert src != dst

    # Bad calls: each must raise ValueError and change nothing -----------------------

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), shared=st.integers(0, 3 * BS), tail=st.integers(1, 200),
          data=st.data())
    def add_with_a_bad_token(self, prefix, shared, tail, data):
        """A bad id anywhere, also in a block after the first prefix miss (hashed only once rows are taken)."""
        prompt = PREFIXES[prefix][:shared] + self._fresh(tail)
        prompt[data.draw(st.integers(0, len(prompt) - 1))] = data.draw(st.sampled_from(BAD_TOKENS))
        self._refused(ValueError, self.alloc.add, self.next_id, prompt)

    @rule(count=st.sampled_from(BAD_COUNTS), with_ids=st.booleans())
    def add_with_a_bad_count(self, count, with_ids):
        self._refused(ValueError, self.alloc.add, self.next_id, self._fresh(3) if with_ids else None, count)

    @rule(n=st.integers(0, 200), delta=st.sampled_from([-1, 1]))
    def add_with_a_count_that_disagrees(self, n, delta):
        if n + delta >= 0:
            self._refused(ValueError, self.alloc.add, self.next_id, self._fresh(n), n + delta)

    @rule(bad=st.sampled_from(BAD_SEQUENCES))
    def add_with_a_bad_sequence(self, bad):
        self._refused(ValueError, self.alloc.add, self.next_id, bad)

    @rule(bad=st.sampled_from(UNHASHABLE), n=st.integers(0, 100))
    def add_with_an_unhashable_id(self, bad, n):
        self._refused(ValueError, self.alloc.add, bad, self._fresh(n))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def add_a_live_id_again(self, data):
        self._refused(ValueError, self.alloc.add, self._live(data), self._fresh(5))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.sampled_from(BAD_COUNTS))
    def extend_with_a_bad_count(self, data, count):
        self._refused(ValueError, self.alloc.extend, self._live(data), count)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 200))
    def extend_with_a_bad_token(self, data, n):
        ids = self._fresh(n)
        ids[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from(BAD_TOKENS))
        self._refused(ValueError, self.alloc.extend, self._live(data), token_ids=ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 100))
    def extend_with_a_count_that_disagrees(self, data, n):
        self._refused(ValueError, self.alloc.extend, self._live(data), n + 1, self._fresh(n))

    @rule(bad=st.sampled_from(UNHASHABLE + ["never added", -5]), free=st.booleans())
    def unknown_or_unhashable_id(self, bad, free):
        if free:
            self._refused(ValueError, self.alloc.free, bad)
        else:
            self._refused(ValueError, self.alloc.extend, bad, 1)

    # ---------------------------------------------------------------------------------

    @invariant()
    def rows_are_consistent(self):
        self.alloc.check_invariants()
        for rid, n in self.tokens.items():
            assert self.alloc.num_tokens(rid) == n
            assert len(self.alloc.kernel_pages(rid)) == -(-n // 64)
        owned = [r for rid in self.tokens for r in self.alloc.state_rows(rid)]
        assert len(owned) == len(set(owned)) == STATE_ROWS * len(self.tokens)

    def teardown(self):
        for rid in list(self.tokens):
            self.alloc.free(rid)
        self.alloc.pop_state_copies()  # checkpoints held by pending copies become evictable
        self.alloc.check_invariants()
        assert self.alloc.num_free_rows == NUM_ROWS and self.alloc.num_requests == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=80, deadline=None, derandomize=False
)
TestAllocatorMachine = AllocatorMachine.TestCase


class DcpAllocatorMachine(AllocatorMachine):
    """The same sequences with rows of 2 x 64 tokens (DCP world 2, interleave 16)."""

    def __init__(self):
        super().__init__()
        self.alloc = RowAllocator(NUM_ROWS, BS, STATE_ROWS, max_num_pages_per_request=64,
                                  dcp=DcpSettings(2, 0, 16))

    @invariant()
    def rows_are_consistent(self):
        self.alloc.check_invariants()
        for rid, n in self.tokens.items():
            assert self.alloc.num_tokens(rid) == n
            assert len(self.alloc.attention_rows(rid)) == -(-n // (2 * BS))
            assert len(self.alloc.kernel_pages(rid)) == -(-DcpSettings(2, 0, 16).local_len(n) // 64)


DcpAllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None, derandomize=False
)
TestDcpAllocatorMachine = DcpAllocatorMachine.TestCase
